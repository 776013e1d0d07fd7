"""The shared-memory all-to-all (`actors.rank.shm_collective`) against gloo's `all_to_all_single`, and its failure
modes: a peer that exits or never arrives raises instead of hanging."""
from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from actors.rank.rendezvous import host_store, join_store
from actors.rank.shm_collective import ShmAllToAll
from kernels.cpu import cpu_kernels_available


def _equal_worker(rank, world, port, q, path="c"):
    store = join_store("127.0.0.1", port, world, 60.0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    shm = ShmAllToAll.setup(store, rank, world, timeout_s=30.0, slot_bytes=4096)
    assert (shm._c is not None) == cpu_kernels_available()  # the C copies and futex wait whenever they build
    if path == "python":
        shm._c = None  # the polling fallback (no compiled kernels)
    g = torch.Generator().manual_seed(rank)
    mismatches = 0
    for i in range(200):  # many calls in a row: both banks, reuse, sizes changing every call
        rows = 1 + (i * 7) % 13
        dtype = (torch.float32, torch.int64, torch.bfloat16)[i % 3]
        inp = (torch.randn(world * rows, 3, generator=g) * 100).to(dtype)
        want, got = torch.empty_like(inp), torch.empty_like(inp)
        dist.all_to_all_single(want, inp)
        shm.all_to_all_single(got, inp)
        mismatches += int(not torch.equal(want, got))
    with pytest.raises(ValueError, match="slot_bytes"):
        big = torch.zeros(world * 2048, dtype=torch.int64)
        shm.all_to_all_single(torch.empty_like(big), big)
    q.put((rank, mismatches, shm.calls))
    shm.close()
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("path", ["c", "python"])
def test_equals_gloo_all_to_all_over_many_calls(path):
    ctx = mp.get_context("spawn")
    store = host_store(3)  # held until the workers are done
    q, port = ctx.Queue(), store.port
    procs = [ctx.Process(target=_equal_worker, args=(r, 3, port, q, path)) for r in range(3)]
    for p in procs:
        p.start()
    res = sorted(q.get(timeout=120) for _ in range(3))
    for p in procs:
        p.join(timeout=60)
    assert res == [(0, 0, 200), (1, 0, 200), (2, 0, 200)]


def _late_worker(rank, port, q):
    store = join_store("127.0.0.1", port, 2, 60.0)
    shm = ShmAllToAll.setup(store, rank, 2, timeout_s=30.0)
    got = []
    for i in range(4):
        if rank == 1:
            time.sleep(0.1)  # far past the spin: rank 0 sleeps in FUTEX_WAIT and is woken by the publish
        x = torch.arange(4.0) + 10 * rank + 100 * i
        out = torch.empty_like(x)
        shm.all_to_all_single(out, x)
        got.append(out.tolist())
    # sleepers[peer]: only this rank sleeps on its one peer's counter, so its count is this rank's alone
    sleepers = int(shm._counters.base.view(np.int32).reshape(2, -1)[1 - rank, 2])
    q.put((rank, got, sleepers))
    shm.close()


def test_a_late_peer_wakes_the_sleeping_rank_with_the_right_values():
    """The futex path: rank 0 sleeps on rank 1's counter each call; it is woken with rank 1's data, and every
    sleeper count it raised (int32 at byte 8 of the peer's counter line) is back to 0 afterwards."""
    ctx = mp.get_context("spawn")
    store = host_store(2)
    q, port = ctx.Queue(), store.port
    procs = [ctx.Process(target=_late_worker, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    res = sorted(q.get(timeout=120) for _ in range(2))
    for p in procs:
        p.join(timeout=60)
    for i in range(4):
        assert res[0][1][i] == [0.0 + 100 * i, 1.0 + 100 * i, 10.0 + 100 * i, 11.0 + 100 * i]
        assert res[1][1][i] == [2.0 + 100 * i, 3.0 + 100 * i, 12.0 + 100 * i, 13.0 + 100 * i]
    assert res[0][2] == 0 and res[1][2] == 0


def _dying_worker(rank, port, q, mode):
    store = join_store("127.0.0.1", port, 2, 60.0)
    shm = ShmAllToAll.setup(store, rank, 2, timeout_s=3.0)
    x = torch.arange(4.0)
    shm.all_to_all_single(torch.empty_like(x), x)  # one good call
    if rank == 1:
        if mode == "exit":
            os._exit(0)  # the peer dies between calls
        time.sleep(8)  # the peer stalls past the timeout
        return
    t0 = time.perf_counter()
    try:
        shm.all_to_all_single(torch.empty_like(x), x)
        q.put(("no error", 0.0))
    except RuntimeError as e:
        q.put((str(e), time.perf_counter() - t0))


@pytest.mark.parametrize("mode", ["exit", "stall"])
def test_dead_or_stalled_peer_raises(mode):
    ctx = mp.get_context("spawn")
    store = host_store(2)  # held until the workers are done
    q, port = ctx.Queue(), store.port
    procs = [ctx.Process(target=_dying_worker, args=(r, port, q, mode)) for r in range(2)]
    for p in procs:
        p.start()
    msg, waited = q.get(timeout=60)
    for p in procs:
        p.join(timeout=30)
    if mode == "exit":
        assert "rank 1" in msg and "exited" in msg and waited < 2.0
    else:
        assert "did not arrive within 3.0 s" in msg and 3.0 <= waited < 6.0


def test_bad_shapes_are_refused():
    from multiprocessing import shared_memory

    name = f"moeray_test_{os.getpid()}"
    a = ShmAllToAll(0, 2, name, 1024, 1.0, [os.getpid()] * 2, create=True)
    try:
        with pytest.raises(ValueError, match="divisible by 2"):
            a.all_to_all_single(torch.empty(3), torch.zeros(3))
        with pytest.raises(ValueError, match="equal contiguous shapes"):
            a.all_to_all_single(torch.empty(4), torch.zeros(4, dtype=torch.int64))
    finally:
        a.close()
        shared_memory.SharedMemory(name=name).unlink()


def _quiet_worker(rank, port, q):
    store = join_store("127.0.0.1", port, 2, 60.0)
    shm = ShmAllToAll.setup(store, rank, 2, timeout_s=30.0)
    x = torch.arange(4.0) + 10 * rank
    out = torch.empty_like(x)
    shm.all_to_all_single(out, x)
    q.put((rank, out.tolist(), shm.shm.name))
    shm.close()


def test_setup_leaves_the_resource_tracker_quiet_and_the_name_unlinked(capfd):
    """The creating rank's unlink() unregisters the name itself: untracking it as well made each rank's resource
    tracker print `KeyError: '/moeray_...'` with a traceback at every cluster start."""
    from multiprocessing import shared_memory

    ctx = mp.get_context("spawn")
    store = host_store(2)  # held until the workers are done
    q, port = ctx.Queue(), store.port
    procs = [ctx.Process(target=_quiet_worker, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    res = sorted(q.get(timeout=120) for _ in range(2))
    for p in procs:
        p.join(timeout=60)
    assert [r[1] for r in res] == [[0.0, 1.0, 10.0, 11.0], [2.0, 3.0, 12.0, 13.0]]
    time.sleep(0.5)  # the trackers write asynchronously
    err = capfd.readouterr().err
    assert "KeyError" not in err and "leaked shared_memory" not in err, err
    with pytest.raises(FileNotFoundError):
        shared_memory.SharedMemory(name=res[0][2])
