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
from actors.rank.shm_collective import ShmAllToAll, _node_id
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


def _agree_worker(rank, port, q, mode):
    """Rank 1 misbehaves by `mode`: its attach raises FileNotFoundError (its /dev/shm is not rank 0's), its
    attach comes after rank 0's attach timeout, or it opts out with MOERAY_SHM=0."""
    store = join_store("127.0.0.1", port, 2, 60.0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    calls = []
    if rank == 1 and mode == "fail":
        def attach(cls, *a):
            calls.append(a[2])
            raise FileNotFoundError(2, "No such file or directory", f"/{a[2]}")
        ShmAllToAll._attach = classmethod(attach)
    elif rank == 1 and mode == "slow":
        orig = ShmAllToAll._attach.__func__

        def attach(cls, *a):
            calls.append(a[2])
            time.sleep(2.0)  # past rank 0's attach_timeout_s: rank 0 has given up and unlinked the name
            return orig(cls, *a)
        ShmAllToAll._attach = classmethod(attach)
    elif rank == 1 and mode == "off":
        os.environ["MOERAY_SHM"] = "0"
    shm = ShmAllToAll.setup(store, rank, 2, timeout_s=30.0, attach_timeout_s=0.5 if mode == "slow" else None)
    x = torch.arange(4.0) + 10 * rank  # the group goes on over gloo
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x)
    q.put((rank, shm is None, len(calls), out.tolist()))
    dist.destroy_process_group()


@pytest.mark.parametrize("mode", ["fail", "slow", "off"])
def test_all_ranks_fall_back_together_and_no_segment_is_left(mode):
    """Issue 19: a rank whose /dev/shm is not rank 0's (host-network pods) raised FileNotFoundError out of setup
    and the segment leaked (also on the attach timeout). Now every rank returns None together and the name is
    gone from /dev/shm."""
    from multiprocessing import shared_memory

    ctx = mp.get_context("spawn")
    store = host_store(2)
    q, port = ctx.Queue(), store.port
    procs = [ctx.Process(target=_agree_worker, args=(r, port, q, mode)) for r in range(2)]
    for p in procs:
        p.start()
    res = sorted(q.get(timeout=120) for _ in range(2))
    for p in procs:
        p.join(timeout=60)
    assert [r[1] for r in res] == [True, True]  # both None
    assert res[0][3] == [0.0, 1.0, 10.0, 11.0] and res[1][3] == [2.0, 3.0, 12.0, 13.0]
    name = store.get("moeray/shm/name").decode()
    verdict = store.get("moeray/shm/verdict").decode()
    if mode == "off":
        assert name == "" and verdict == "off (MOERAY_SHM=0)"
        return
    assert res[1][2] == 1  # rank 1 did try to attach
    assert name.startswith("moeray_") and not os.path.exists(f"/dev/shm/{name}")
    with pytest.raises(FileNotFoundError):
        shared_memory.SharedMemory(name=name)
    want = "rank 1: FileNotFoundError" if mode == "fail" else "rank 1: no report within 0.5 s"
    assert verdict.startswith("off (") and want in verdict, verdict


def test_an_error_in_setup_still_unlinks_the_segment(monkeypatch):
    """Rank 0 alone against a store where rank 1 has announced itself: an exception while collecting the attach
    reports propagates, and the segment rank 0 created is unlinked on the way out."""
    from datetime import timedelta

    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, timeout=timedelta(seconds=5), wait_for_workers=False)
    store.set("moeray/shm/node/1", f"{_node_id()}|{os.getpid()}|1")

    def boom(*a):
        raise RuntimeError("store went away")
    monkeypatch.setattr(ShmAllToAll, "_collect", staticmethod(boom))
    with pytest.raises(RuntimeError, match="store went away"):
        ShmAllToAll.setup(store, 0, 2, timeout_s=5.0, slot_bytes=1024)
    name = store.get("moeray/shm/name").decode()
    assert name.startswith("moeray_") and not os.path.exists(f"/dev/shm/{name}")


_KILLED_MID_SETUP = """
import os
from datetime import timedelta

import torch.distributed as dist

from actors.rank.shm_collective import ShmAllToAll, _node_id

store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, timeout=timedelta(seconds=120), wait_for_workers=False)
store.set("moeray/shm/node/1", f"{_node_id()}|{os.getpid()}|1")  # rank 1 announced itself, then never attaches
collect = ShmAllToAll._collect


def say_name(store, prefix, world, wait_s):
    print("NAME", store.get(prefix + "/name").decode(), flush=True)
    return collect(store, prefix, world, wait_s)


ShmAllToAll._collect = staticmethod(say_name)
ShmAllToAll.setup(store, 0, 2, timeout_s=5.0, slot_bytes=1 << 20, attach_timeout_s=60)
"""


def test_rank_0_killed_mid_setup_leaves_no_segment():
    """Issue 19, the kill path out of setup: rank 0 SIGKILLed while it waits for the attach reports (its segment
    created, not yet unlinked) leaves nothing in /dev/shm: the creator's registration with Python's resource
    tracker, kept until `setup` unlinks the name itself, unlinks it when the process dies."""
    import signal
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    p = subprocess.Popen([sys.executable, "-c", _KILLED_MID_SETUP], stdout=subprocess.PIPE, text=True, cwd=repo)
    try:
        line = p.stdout.readline()
        assert line.startswith("NAME moeray_"), line
        path = f"/dev/shm/{line.split()[1]}"
        assert os.path.exists(path)  # created, waiting for rank 1's report
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(30)
    deadline = time.monotonic() + 10
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(path), f"{path} left behind by a SIGKILLed rank 0"


@pytest.mark.skipif(not cpu_kernels_available(), reason="the spin-then-futex wait is the compiled path's")
def test_a_call_within_a_step_spins_longer_before_sleeping():
    """`within_step=True` (the MoE exchanges, back-to-back agreements) spins `STEP_SPIN_S` before the futex sleep,
    a call outside a step `SPIN_S`: with the peer 30 ms late, the waiting rank burns ~the step spin, not more."""
    import threading

    name = f"moeray_test_{os.getpid()}"
    a = ShmAllToAll(0, 2, name, 4096, 10.0, [os.getpid()] * 2, create=True)
    b = ShmAllToAll(1, 2, name, 4096, 10.0, [os.getpid()] * 2)
    try:
        a._spin_ns, a.step_spin_ns = 30_000, 10_000_000  # 30 us / 10 ms
        burnt = {}
        for within in (False, True):
            def late_peer():
                time.sleep(0.03)
                b.all_to_all_single(torch.empty(2), torch.tensor([2.0, 3.0]))

            t = threading.Thread(target=late_peer)
            t.start()
            out, c0 = torch.empty(2), time.thread_time()
            a.all_to_all_single(out, torch.tensor([0.0, 1.0]), within_step=within)
            burnt[within] = time.thread_time() - c0
            t.join()
            assert out.tolist() == [0.0, 2.0]
        assert burnt[False] < 0.004, burnt  # 30 us of spin, then asleep
        assert 0.006 < burnt[True] < 0.025, burnt  # ~10 ms of spin, then asleep (not the whole 30 ms)
    finally:
        a.close()
        b.close()
        from actors.rank.shm_segment import unlink
        unlink(name, tracked=True)


@pytest.mark.skipif(not cpu_kernels_available(), reason="the spin-then-futex wait is the compiled path's")
def test_a_spinning_rank_yields_its_core_to_a_thread_queued_there():
    """While it spins within a step, a waiting rank calls sched_yield every `YIELD_S`: a thread sharing its core (the
    front door's, on a busy node) gets the core at once instead of one scheduler slice in two. Both threads pinned
    to one CPU; the peer arrives when the other thread has done its 40 ms of work."""
    import threading

    name = f"moeray_test_y{os.getpid()}"
    a = ShmAllToAll(0, 2, name, 4096, 10.0, [os.getpid()] * 2, create=True)
    b = ShmAllToAll(1, 2, name, 4096, 10.0, [os.getpid()] * 2)
    cpu = min(os.sched_getaffinity(0))
    took = {}
    try:
        a.step_spin_ns = 2_000_000_000  # spin through the whole test
        for yield_ns in (0, 50_000):
            a.yield_ns = yield_ns
            started = threading.Event()

            def work_then_arrive():
                os.sched_setaffinity(0, {cpu})
                started.wait()
                t0, c0 = time.perf_counter(), time.thread_time()
                while time.thread_time() - c0 < 0.04:  # 40 ms of CPU (the GIL is free: the spinner is in C)
                    pass
                took[yield_ns] = time.perf_counter() - t0
                b.all_to_all_single(torch.empty(2), torch.tensor([2.0, 3.0]), within_step=True)

            t = threading.Thread(target=work_then_arrive)
            t.start()

            def spin():
                os.sched_setaffinity(0, {cpu})
                started.set()
                a.all_to_all_single(torch.empty(2), torch.tensor([0.0, 1.0]), within_step=True)

            s = threading.Thread(target=spin)
            s.start()
            s.join()
            t.join()
    finally:
        a.close()
        b.close()
        from actors.rank.shm_segment import unlink
        unlink(name, tracked=True)
    assert took[50_000] < 0.8 * took[0], took  # yielding: ~all of the core; spinning alone: about half of it
