"""gloo's interface from the Ray node IP (`actors.rank.netif`), not from the hostname (issue 19: a hostname
resolving to 127.0.1.1 cannot join a group across nodes)."""
from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from actors.rank.netif import interface_for_ip, select_gloo_interface


def test_loopback_addresses_map_to_lo():
    assert interface_for_ip("127.0.0.1") == "lo"
    assert interface_for_ip("127.0.0.12") == "lo"  # no address of its own: inside lo's 127.0.0.0/8


def test_unknown_or_bad_ip_maps_to_none():
    assert interface_for_ip("203.0.113.7") is None  # TEST-NET-3: on no interface here
    assert interface_for_ip("not-an-ip") is None


def test_select_sets_gloo_ifname_unless_the_user_did(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    assert select_gloo_interface("127.0.0.1") == "lo" and os.environ["GLOO_SOCKET_IFNAME"] == "lo"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    assert select_gloo_interface("127.0.0.1") == "eth7" and os.environ["GLOO_SOCKET_IFNAME"] == "eth7"


def test_unknown_ip_falls_back_to_gloo_default(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    assert select_gloo_interface("203.0.113.7") is None
    assert "GLOO_SOCKET_IFNAME" not in os.environ


def test_gloo_group_builds_on_the_selected_interface(monkeypatch):
    """The derived name is one gloo accepts: a process group forms on it and runs a collective."""
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    assert select_gloo_interface("127.0.0.1") == "lo"
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=10))
    try:
        x = torch.arange(3.0)
        dist.all_reduce(x)
        assert x.tolist() == [0.0, 1.0, 2.0]
    finally:
        dist.destroy_process_group()
