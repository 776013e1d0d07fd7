"""A rank's compute threads (`actors.rank.threads`): the CPUs of its node shared by the ranks placed there."""
from __future__ import annotations

import os

import torch

from actors.rank import threads as T
from actors.rank.rendezvous import host_store
from kernels.cpu import cpu_kernels_available, parallel


def test_ranks_on_node_counts_through_the_store():
    store = host_store(3, timeout_s=10)
    try:
        # ranks 0 and 2 on one node, 1 on another: every rank posts before any counts
        for r, key in ((0, "10.0.0.1"), (1, "10.0.0.2"), (2, "10.0.0.1")):
            store.set(f"threads/node/{r}", key)
        assert T.ranks_on_node(store, 0, 3, "10.0.0.1") == 2
        assert T.ranks_on_node(store, 1, 3, "10.0.0.2") == 1
    finally:
        del store


def test_auto_threads_share_the_cpus(monkeypatch):
    monkeypatch.setattr(T, "available_cpus", lambda: 8)
    assert [T.auto_threads(n) for n in (1, 2, 3, 8, 16)] == [8, 4, 2, 1, 1]


def test_available_cpus_within_affinity():
    n = T.available_cpus()
    assert 1 <= n <= len(os.sched_getaffinity(0))


def test_apply_threads_sets_the_split_and_keeps_torch_at_one():
    before = torch.get_num_threads()
    try:
        T.apply_threads(2)
        assert parallel.threads() == 2
        assert torch.get_num_threads() == (1 if cpu_kernels_available() else 2)
    finally:
        parallel.set_threads(1)
        torch.set_num_threads(before)
