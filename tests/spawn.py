"""Run a test's worker function in `world` spawned processes around one hosted rendezvous store (no Ray)."""
from __future__ import annotations

import torch.multiprocessing as mp

from actors.rank.rendezvous import host_store


def spawn_ranks(worker, world: int, *args, timeout_s: float = 300.0) -> dict:
    """Call worker(rank, world, store_port, *args, queue) in `world` spawned processes; each puts one (key, value)
    on the queue. Returns {key: value}. Raises AssertionError if a process exits non-zero."""
    store = host_store(world)  # held until the workers are done
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, world, store.port, *args, q)) for r in range(world)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=timeout_s) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return got
