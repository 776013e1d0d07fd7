"""The network interface that carries this rank's Ray node IP, for gloo's device (`RankWorker.setup`).

gloo's default device binds the address the machine's hostname resolves to. On Debian and Ubuntu the hostname
resolves to 127.0.1.1 (/etc/hosts), which peers on other nodes cannot reach: the group never forms
(`Gloo connectFullMesh failed ... remote=[127.0.1.1]`). Ray already knows the address other nodes reach this
one at (the node IP), so the rank names the interface holding it in GLOO_SOCKET_IFNAME, which gloo reads when
the process group is built. NCCL chooses its own interface (NCCL_SOCKET_IFNAME; README "Several machines").
"""
from __future__ import annotations

import ipaddress
import logging
import os
import socket

log = logging.getLogger("moeray.rank")


def interface_for_ip(ip: str) -> str | None:
    """Name of the local interface holding address `ip` (IPv4 or IPv6), else the first interface whose subnet
    contains it (127.0.0.12 -> "lo" through 127.0.0.0/8, as Ray's loopback-alias nodes use); None when no
    interface does, `ip` is not an address, or psutil is not installed. Uses psutil.net_if_addrs."""
    try:
        want = ipaddress.ip_address(ip)
        import psutil

        addrs = psutil.net_if_addrs()
    except (ValueError, ImportError):
        return None
    subnet = None
    for name, entries in addrs.items():
        for a in entries:
            if a.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                have = ipaddress.ip_address(a.address.split("%")[0])
                if have == want:
                    return name
                if subnet is None and a.netmask and have.version == want.version:
                    net = ipaddress.ip_network(f"{have}/{a.netmask}", strict=False)
                    if net.prefixlen > 0 and want in net:
                        subnet = name
            except ValueError:  # an address or mask psutil reports in a form ipaddress does not take
                continue
    return subnet


def select_gloo_interface(node_ip: str) -> str | None:
    """Point gloo at the interface of `node_ip` (sets GLOO_SOCKET_IFNAME in this process) unless the user set
    GLOO_SOCKET_IFNAME already. Returns the interface gloo will use, or None when no interface holds `node_ip`:
    then gloo keeps its default (the hostname's address) and a warning says how to choose one."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return os.environ["GLOO_SOCKET_IFNAME"]
    iface = interface_for_ip(node_ip)
    if iface is None:
        log.warning("no network interface holds the Ray node IP %s: gloo binds the address of hostname %r; "
                    "set GLOO_SOCKET_IFNAME if ranks on other nodes cannot connect", node_ip, socket.gethostname())
        return None
    os.environ["GLOO_SOCKET_IFNAME"] = iface
    return iface
