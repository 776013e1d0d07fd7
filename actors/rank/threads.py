"""How many compute threads a rank runs on, and applying that count.

`num_threads_per_rank` > 0 is taken as given; 0 (the default) means the CPUs this process may use on its node
(affinity, capped by a cgroup CPU quota: a Kubernetes pod's limit) shared evenly by the ranks on that node, at
least 1. The count sets the compiled kernels' row split (`kernels.cpu.parallel`); torch's own intra-op threads
stay at 1 while those kernels run (an OpenMP team beside them made a 500-token prefill slower: 31.0 -> 35.4 ms,
BENCHMARKS.md), and take the count otherwise (the PyTorch paths then do the heavy work).
"""
from __future__ import annotations

import math
import os

import torch

from kernels.cpu import cpu_kernels_available, parallel


def available_cpus() -> int:
    """CPUs this process may run on: its affinity mask, capped by the cgroup v2 quota (`cpu.max`) if one is set."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            n = min(n, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, n)


def ranks_on_node(store, rank: int, world_size: int, node_key: str) -> int:
    """Ranks of the group on this rank's node (those that posted the same `node_key`, e.g. the Ray node IP), read
    through the group's rendezvous store (every rank must call it; blocks until all have posted)."""
    store.set(f"threads/node/{rank}", node_key)
    return sum(store.get(f"threads/node/{r}").decode() == node_key for r in range(world_size))


def auto_threads(local_ranks: int) -> int:
    """`available_cpus()` shared by `local_ranks` ranks, at least 1."""
    return max(1, available_cpus() // max(1, local_ranks))


def apply_threads(n: int) -> None:
    """Run this process's compute on n threads (`kernels.cpu.parallel`; torch: see the module docstring).

    Raises:
        ValueError: n < 1.
    """
    parallel.set_threads(n)
    torch.set_num_threads(1 if cpu_kernels_available() else n)
