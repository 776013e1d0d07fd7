"""Pins the eviction order of the expert cache and the cold tier: a fixed sequence of operations per policy
(`lru`, `lfu`, `predicted`; protect sets, speculative fills, set_scores, pinned slots) and the trace it
produced, recorded from the code before the store was split (the literals below are that recording).

Each trace row is `(op, args, result, resident)`: the call, what it returned (slot maps as sorted pairs) and
the resident set right after it; the cold tier's rows also carry its counters.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from actors.experts.cache import ExpertCache
from actors.experts.cold_tier import ColdExpertTier

E = 6


def cache_trace(policy: str) -> list:
    loads: list[int] = []
    c = ExpertCache(3, E, policy, lambda e: loads.append(e) or (f"w{e}",))
    out: list = []

    def rec(op, args, res):
        out.append((op, args, res, tuple(c.resident)))

    for e in (0, 1, 2):
        rec("fill", (e,), c.fill(e))
    rec("lookup", (0, 0), sorted(c.lookup([0, 0])))
    rec("lookup", (0,), sorted(c.lookup([0])))
    rec("lookup", (2, 4), sorted(c.lookup([2, 4])))
    rec("set_scores", (0.5, 0.9, 0.1, 0.3, 0.7, 0.2), c.set_scores([0.5, 0.9, 0.1, 0.3, 0.7, 0.2]))
    rec("fill", (3,), c.fill(3))
    rec("fill", (4, "spec"), c.fill(4, speculative=True))
    rec("fill", (5, "spec"), c.fill(5, speculative=True))
    rec("fill", (5, "protect", 0, 1, 2, 3, 4), c.fill(5, protect={0, 1, 2, 3, 4}))
    rec("lookup", (1, 3), sorted(c.lookup([1, 3])))
    rec("put", (2,), c.put(2, ("p2",)))
    rec("put", (2, "again"), c.put(2, ("p2b",)))
    rec("set_scores", (0.0, 0.1, 0.9, 0.8, 0.05, 0.6), c.set_scores([0.0, 0.1, 0.9, 0.8, 0.05, 0.6]))
    rec("fill", (5, "spec", "protect", 2), c.fill(5, protect={2}, speculative=True))
    rec("put", (0, "protect", 1, 2, 3, 4, 5), c.put(0, ("p0",), protect={1, 2, 3, 4, 5}))
    rec("put", (0,), c.put(0, ("p0",)))
    rec("lookup", (0, 1, 2, 3, 4, 5), sorted(c.lookup([0, 1, 2, 3, 4, 5])))
    rec("lookup", (5,), sorted(c.lookup([5])))
    rec("fill", (1, "spec"), c.fill(1, speculative=True))
    rec("fill", (4,), c.fill(4))
    out.append(("loads", tuple(loads), None, ()))
    zero = ExpertCache(0, E, policy, lambda e: (e,))
    out.append(("zero-capacity", (zero.fill(1), zero.put(1, (1,))), None, tuple(zero.resident)))
    return out


class FakeReader:
    """The PackedExpertReader surface the tier uses, with no file: reads are recorded, not copied."""

    def __init__(self):
        self.reads: list[tuple[int, int]] = []
        self.block: dict[int, tuple[threading.Event, threading.Event]] = {}  # expert -> (entered, go)
        self.fail: set[int] = set()

    def empty(self, layer, n, device):
        return SimpleNamespace(intermediate_size=4, nbytes=n * 100, gate_up=[None] * n, down=[None] * n)

    def expert_nbytes(self, layer):
        return 100

    def read_into(self, layer, expert, pool, slot):
        if expert in self.block:
            entered, go = self.block[expert]
            entered.set()
            go.wait(10)
        if expert in self.fail:
            raise OSError(f"read of expert {expert} failed")
        self.reads.append((expert, slot))
        return 100

    def read_one(self, layer, expert, device):
        self.reads.append((expert, -1))
        return SimpleNamespace(gate_up=[f"g{expert}"], down=[f"d{expert}"])


class WaitThenGo:
    """A read's event whose first waiter lets the read finish (so the wait happens before the read ends)."""

    def __init__(self, ev: threading.Event, go: threading.Event):
        self.ev, self.go = ev, go

    def wait(self, timeout=None):
        self.go.set()
        return self.ev.wait(10)


SCORES = (0.1, 0.9, 0.3, 0.2, 0.7, 0.4)


def tier_trace(policy: str) -> list:
    reader = FakeReader()
    local = [10, 11, 12, 13, 14, 15]  # global ids: reads name the global expert
    t = ColdExpertTier(3, local, reader, capacity=3, policy=policy, device="cpu")
    out: list = []

    def rec(op, args, res):
        s = t.stats()
        out.append(
            (
                op,
                args,
                res,
                tuple(t.resident),
                tuple(reader.reads),
                tuple(
                    s[k]
                    for k in ("hits", "misses", "waits", "prefetch_reads", "transient_reads", "evictions", "bytes_read")
                ),
            )
        )
        reader.reads.clear()

    def acq(experts, demand):
        got = t.acquire(list(experts), demand=demand)
        rec("acquire", (tuple(experts), demand), tuple(sorted(got.items())))
        return got

    t.release(acq([0, 1], True))
    rec("prefetch", (2,), t.prefetch([2]))
    t.release(acq([0], True))
    t.release(acq([0, 2], True))
    rec("set_scores", (0.9, 0.2, 0.5, 0.8, 0.1, 0.6), t.set_scores([0.9, 0.2, 0.5, 0.8, 0.1, 0.6]))
    t.release(acq([3], True))
    rec("prefetch", (4, 5), t.prefetch([4, 5]))
    rec("prefetch", (5, 1), t.prefetch([5, 1]))
    pinned = acq([0, 3], True)  # held: only the third slot can be evicted
    t.release(acq([4, 5], True))
    t.release(acq([1], False))
    held = acq([4], True)  # now every slot is pinned
    t.release(acq([2], True))
    rec("dequantized", (2,), t.dequantized(2, lambda w, dt: (w, dt), "fp"))
    rec("read_transient", (1,), t.read_transient(1).gate_up[0])
    t.release(held)
    t.release(pinned)
    rec("set_scores", SCORES, t.set_scores(list(SCORES)))
    rec("prefetch", (1, 5, 0), t.prefetch([1, 5, 0]))
    t.release(acq([1, 2, 5, 4], True))
    t.release(acq([3, 0], False))
    rec("dequantized", (4,), t.dequantized(4, lambda w, dt: (w, dt), "fp"))
    # a read in flight on another thread: a prefetch does not wait for it, a demand acquire does (a `wait`)
    x = max((e for e in range(E) if e not in t), key=lambda e: (SCORES[e], e))
    entered, go = reader.block[local[x]] = (threading.Event(), threading.Event())
    loader = threading.Thread(target=t.prefetch, args=([x],))
    loader.start()
    assert entered.wait(10)
    reader.block.clear()
    t.release(acq([x], False))
    t._loading[x] = WaitThenGo(t._loading[x], go)  # the read finishes once the demand acquire waits for it
    got: dict = {}
    waiter = threading.Thread(target=lambda: got.update(t.acquire([x], demand=True)))
    waiter.start()
    loader.join(10)
    waiter.join(10)
    t.release(got)
    rec("waited", (x,), tuple(sorted(got.items())))
    # a read that raises frees its slot and unpins what the call had obtained
    y = next(e for e in range(E) if e not in t)
    reader.fail.add(local[y])
    with pytest.raises(OSError):
        t.acquire([x, y], demand=True)
    reader.fail.clear()
    rec("failed", (x, y), tuple(t._pins))
    t.release(acq([y, x], True))
    return out


EXPECTED_CACHE: dict = {
    "lru": [
        ("fill", (0,), True, (0,)),
        ("fill", (1,), True, (0, 1)),
        ("fill", (2,), True, (0, 1, 2)),
        ("lookup", (0, 0), [0], (0, 1, 2)),
        ("lookup", (0,), [0], (0, 1, 2)),
        ("lookup", (2, 4), [2], (0, 1, 2)),
        ("set_scores", (0.5, 0.9, 0.1, 0.3, 0.7, 0.2), None, (0, 1, 2)),
        ("fill", (3,), True, (0, 2, 3)),
        ("fill", (4, "spec"), True, (0, 2, 4)),
        ("fill", (5, "spec"), True, (2, 4, 5)),
        ("fill", (5, "protect", 0, 1, 2, 3, 4), False, (2, 4, 5)),
        ("lookup", (1, 3), [], (2, 4, 5)),
        ("put", (2,), False, (2, 4, 5)),
        ("put", (2, "again"), False, (2, 4, 5)),
        ("set_scores", (0.0, 0.1, 0.9, 0.8, 0.05, 0.6), None, (2, 4, 5)),
        ("fill", (5, "spec", "protect", 2), False, (2, 4, 5)),
        ("put", (0, "protect", 1, 2, 3, 4, 5), False, (2, 4, 5)),
        ("put", (0,), True, (0, 2, 4)),
        ("lookup", (0, 1, 2, 3, 4, 5), [0, 2, 4], (0, 2, 4)),
        ("lookup", (5,), [], (0, 2, 4)),
        ("fill", (1, "spec"), True, (0, 1, 4)),
        ("fill", (4,), False, (0, 1, 4)),
        ("loads", (0, 1, 2, 3, 4, 5, 1), None, ()),
        ("zero-capacity", (False, False), None, ()),
    ],
    "lfu": [
        ("fill", (0,), True, (0,)),
        ("fill", (1,), True, (0, 1)),
        ("fill", (2,), True, (0, 1, 2)),
        ("lookup", (0, 0), [0], (0, 1, 2)),
        ("lookup", (0,), [0], (0, 1, 2)),
        ("lookup", (2, 4), [2], (0, 1, 2)),
        ("set_scores", (0.5, 0.9, 0.1, 0.3, 0.7, 0.2), None, (0, 1, 2)),
        ("fill", (3,), True, (0, 2, 3)),
        ("fill", (4, "spec"), True, (0, 2, 4)),
        ("fill", (5, "spec"), True, (0, 4, 5)),
        ("fill", (5, "protect", 0, 1, 2, 3, 4), False, (0, 4, 5)),
        ("lookup", (1, 3), [], (0, 4, 5)),
        ("put", (2,), True, (0, 2, 4)),
        ("put", (2, "again"), False, (0, 2, 4)),
        ("set_scores", (0.0, 0.1, 0.9, 0.8, 0.05, 0.6), None, (0, 2, 4)),
        ("fill", (5, "spec", "protect", 2), True, (0, 2, 5)),
        ("put", (0, "protect", 1, 2, 3, 4, 5), False, (0, 2, 5)),
        ("put", (0,), False, (0, 2, 5)),
        ("lookup", (0, 1, 2, 3, 4, 5), [0, 2, 5], (0, 2, 5)),
        ("lookup", (5,), [5], (0, 2, 5)),
        ("fill", (1, "spec"), True, (0, 1, 5)),
        ("fill", (4,), True, (0, 4, 5)),
        ("loads", (0, 1, 2, 3, 4, 5, 5, 1, 4), None, ()),
        ("zero-capacity", (False, False), None, ()),
    ],
    "predicted": [
        ("fill", (0,), True, (0,)),
        ("fill", (1,), True, (0, 1)),
        ("fill", (2,), True, (0, 1, 2)),
        ("lookup", (0, 0), [0], (0, 1, 2)),
        ("lookup", (0,), [0], (0, 1, 2)),
        ("lookup", (2, 4), [2], (0, 1, 2)),
        ("set_scores", (0.5, 0.9, 0.1, 0.3, 0.7, 0.2), None, (0, 1, 2)),
        ("fill", (3,), True, (0, 1, 3)),
        ("fill", (4, "spec"), True, (0, 1, 4)),
        ("fill", (5, "spec"), False, (0, 1, 4)),
        ("fill", (5, "protect", 0, 1, 2, 3, 4), False, (0, 1, 4)),
        ("lookup", (1, 3), [1], (0, 1, 4)),
        ("put", (2,), True, (1, 2, 4)),
        ("put", (2, "again"), False, (1, 2, 4)),
        ("set_scores", (0.0, 0.1, 0.9, 0.8, 0.05, 0.6), None, (1, 2, 4)),
        ("fill", (5, "spec", "protect", 2), True, (1, 2, 5)),
        ("put", (0, "protect", 1, 2, 3, 4, 5), False, (1, 2, 5)),
        ("put", (0,), True, (0, 2, 5)),
        ("lookup", (0, 1, 2, 3, 4, 5), [0, 2, 5], (0, 2, 5)),
        ("lookup", (5,), [5], (0, 2, 5)),
        ("fill", (1, "spec"), True, (1, 2, 5)),
        ("fill", (4,), True, (2, 4, 5)),
        ("loads", (0, 1, 2, 3, 4, 5, 1, 4), None, ()),
        ("zero-capacity", (False, False), None, ()),
    ],
}
EXPECTED_TIER: dict = {
    "lru": [
        ("acquire", ((0, 1), True), ((0, 0), (1, 1)), (0, 1), ((10, 0), (11, 1)), (0, 2, 0, 0, 0, 0, 200)),
        ("prefetch", (2,), None, (0, 1, 2), ((12, 2),), (0, 2, 0, 1, 0, 0, 300)),
        ("acquire", ((0,), True), ((0, 0),), (0, 1, 2), (), (1, 2, 0, 1, 0, 0, 300)),
        ("acquire", ((0, 2), True), ((0, 0), (2, 2)), (0, 1, 2), (), (3, 2, 0, 1, 0, 0, 300)),
        ("set_scores", (0.9, 0.2, 0.5, 0.8, 0.1, 0.6), None, (0, 1, 2), (), (3, 2, 0, 1, 0, 0, 300)),
        ("acquire", ((3,), True), ((3, 1),), (0, 2, 3), ((13, 1),), (3, 3, 0, 1, 0, 1, 400)),
        ("prefetch", (4, 5), None, (3, 4, 5), ((14, 0), (15, 2)), (3, 3, 0, 3, 0, 3, 600)),
        ("prefetch", (5, 1), None, (1, 4, 5), ((11, 1),), (3, 3, 0, 4, 0, 4, 700)),
        ("acquire", ((0, 3), True), ((0, 0), (3, 2)), (0, 1, 3), ((10, 0), (13, 2)), (3, 5, 0, 4, 0, 6, 900)),
        ("acquire", ((4, 5), True), ((4, 1),), (0, 3, 4), ((14, 1),), (3, 6, 0, 4, 0, 7, 1000)),
        ("acquire", ((1,), False), ((1, 1),), (0, 1, 3), ((11, 1),), (3, 6, 0, 5, 0, 8, 1100)),
        ("acquire", ((4,), True), ((4, 1),), (0, 3, 4), ((14, 1),), (3, 7, 0, 5, 0, 9, 1200)),
        ("acquire", ((2,), True), (), (0, 3, 4), (), (3, 7, 0, 5, 0, 9, 1200)),
        ("dequantized", (2,), (("g12", "fp"), ("d12", "fp")), (0, 3, 4), ((12, -1),), (3, 7, 0, 5, 1, 9, 1300)),
        ("read_transient", (1,), "g11", (0, 3, 4), ((11, -1),), (3, 7, 0, 5, 2, 9, 1400)),
        ("set_scores", (0.1, 0.9, 0.3, 0.2, 0.7, 0.4), None, (0, 3, 4), (), (3, 7, 0, 5, 2, 9, 1400)),
        ("prefetch", (1, 5, 0), None, (0, 1, 5), ((11, 2), (15, 1)), (3, 7, 0, 7, 2, 11, 1600)),
        ("acquire", ((1, 2, 5, 4), True), ((1, 2), (2, 0), (5, 1)), (1, 2, 5), ((12, 0),), (5, 8, 0, 7, 2, 12, 1700)),
        ("acquire", ((3, 0), False), ((0, 1), (3, 0)), (0, 1, 3), ((13, 0), (10, 1)), (5, 8, 0, 9, 2, 14, 1900)),
        ("dequantized", (4,), (("g14", "fp"), ("d14", "fp")), (0, 1, 3), ((14, -1),), (5, 8, 0, 9, 3, 14, 2000)),
        ("acquire", ((4,), False), (), (0, 3), (), (5, 8, 0, 9, 3, 15, 2000)),
        ("waited", (4,), ((4, 2),), (0, 3, 4), ((14, 2),), (5, 8, 1, 10, 3, 15, 2100)),
        ("failed", (4, 1), (0, 0, 0), (0, 4), (), (6, 8, 1, 10, 3, 16, 2100)),
        ("acquire", ((1, 4), True), ((1, 0), (4, 2)), (0, 1, 4), ((11, 0),), (7, 9, 1, 10, 3, 16, 2200)),
    ],
    "lfu": [
        ("acquire", ((0, 1), True), ((0, 0), (1, 1)), (0, 1), ((10, 0), (11, 1)), (0, 2, 0, 0, 0, 0, 200)),
        ("prefetch", (2,), None, (0, 1, 2), ((12, 2),), (0, 2, 0, 1, 0, 0, 300)),
        ("acquire", ((0,), True), ((0, 0),), (0, 1, 2), (), (1, 2, 0, 1, 0, 0, 300)),
        ("acquire", ((0, 2), True), ((0, 0), (2, 2)), (0, 1, 2), (), (3, 2, 0, 1, 0, 0, 300)),
        ("set_scores", (0.9, 0.2, 0.5, 0.8, 0.1, 0.6), None, (0, 1, 2), (), (3, 2, 0, 1, 0, 0, 300)),
        ("acquire", ((3,), True), ((3, 1),), (0, 2, 3), ((13, 1),), (3, 3, 0, 1, 0, 1, 400)),
        ("prefetch", (4, 5), None, (0, 4, 5), ((14, 2), (15, 1)), (3, 3, 0, 3, 0, 3, 600)),
        ("prefetch", (5, 1), None, (0, 1, 5), ((11, 2),), (3, 3, 0, 4, 0, 4, 700)),
        ("acquire", ((0, 3), True), ((0, 0), (3, 1)), (0, 1, 3), ((13, 1),), (4, 4, 0, 4, 0, 5, 800)),
        ("acquire", ((4, 5), True), ((4, 2),), (0, 3, 4), ((14, 2),), (4, 5, 0, 4, 0, 6, 900)),
        ("acquire", ((1,), False), ((1, 2),), (0, 1, 3), ((11, 2),), (4, 5, 0, 5, 0, 7, 1000)),
        ("acquire", ((4,), True), ((4, 2),), (0, 3, 4), ((14, 2),), (4, 6, 0, 5, 0, 8, 1100)),
        ("acquire", ((2,), True), (), (0, 3, 4), (), (4, 6, 0, 5, 0, 8, 1100)),
        ("dequantized", (2,), (("g12", "fp"), ("d12", "fp")), (0, 3, 4), ((12, -1),), (4, 6, 0, 5, 1, 8, 1200)),
        ("read_transient", (1,), "g11", (0, 3, 4), ((11, -1),), (4, 6, 0, 5, 2, 8, 1300)),
        ("set_scores", (0.1, 0.9, 0.3, 0.2, 0.7, 0.4), None, (0, 3, 4), (), (4, 6, 0, 5, 2, 8, 1300)),
        ("prefetch", (1, 5, 0), None, (0, 1, 5), ((11, 1), (15, 2)), (4, 6, 0, 7, 2, 10, 1500)),
        ("acquire", ((1, 2, 5, 4), True), ((1, 1), (2, 0), (5, 2)), (1, 2, 5), ((12, 0),), (6, 7, 0, 7, 2, 11, 1600)),
        ("acquire", ((3, 0), False), ((0, 2), (3, 1)), (0, 2, 3), ((13, 1), (10, 2)), (6, 7, 0, 9, 2, 13, 1800)),
        ("dequantized", (4,), (("g14", "fp"), ("d14", "fp")), (0, 2, 3), ((14, -1),), (6, 7, 0, 9, 3, 13, 1900)),
        ("acquire", ((1,), False), (), (0, 2), (), (6, 7, 0, 9, 3, 14, 1900)),
        ("waited", (1,), ((1, 1),), (0, 1, 2), ((11, 1),), (6, 7, 1, 10, 3, 14, 2000)),
        ("failed", (1, 3), (0, 0, 0), (0, 1), (), (7, 7, 1, 10, 3, 15, 2000)),
        ("acquire", ((3, 1), True), ((1, 1), (3, 0)), (0, 1, 3), ((13, 0),), (8, 8, 1, 10, 3, 15, 2100)),
    ],
    "predicted": [
        ("acquire", ((0, 1), True), ((0, 0), (1, 1)), (0, 1), ((10, 0), (11, 1)), (0, 2, 0, 0, 0, 0, 200)),
        ("prefetch", (2,), None, (0, 1, 2), ((12, 2),), (0, 2, 0, 1, 0, 0, 300)),
        ("acquire", ((0,), True), ((0, 0),), (0, 1, 2), (), (1, 2, 0, 1, 0, 0, 300)),
        ("acquire", ((0, 2), True), ((0, 0), (2, 2)), (0, 1, 2), (), (3, 2, 0, 1, 0, 0, 300)),
        ("set_scores", (0.9, 0.2, 0.5, 0.8, 0.1, 0.6), None, (0, 1, 2), (), (3, 2, 0, 1, 0, 0, 300)),
        ("acquire", ((3,), True), ((3, 1),), (0, 2, 3), ((13, 1),), (3, 3, 0, 1, 0, 1, 400)),
        ("prefetch", (4, 5), None, (0, 3, 5), ((15, 2),), (3, 3, 0, 2, 0, 2, 500)),
        ("prefetch", (5, 1), None, (0, 3, 5), (), (3, 3, 0, 2, 0, 2, 500)),
        ("acquire", ((0, 3), True), ((0, 0), (3, 1)), (0, 3, 5), (), (5, 3, 0, 2, 0, 2, 500)),
        ("acquire", ((4, 5), True), ((5, 2),), (0, 3, 5), (), (6, 3, 0, 2, 0, 2, 500)),
        ("acquire", ((1,), False), (), (0, 3, 5), (), (6, 3, 0, 2, 0, 2, 500)),
        ("acquire", ((4,), True), ((4, 2),), (0, 3, 4), ((14, 2),), (6, 4, 0, 2, 0, 3, 600)),
        ("acquire", ((2,), True), (), (0, 3, 4), (), (6, 4, 0, 2, 0, 3, 600)),
        ("dequantized", (2,), (("g12", "fp"), ("d12", "fp")), (0, 3, 4), ((12, -1),), (6, 4, 0, 2, 1, 3, 700)),
        ("read_transient", (1,), "g11", (0, 3, 4), ((11, -1),), (6, 4, 0, 2, 2, 3, 800)),
        ("set_scores", (0.1, 0.9, 0.3, 0.2, 0.7, 0.4), None, (0, 3, 4), (), (6, 4, 0, 2, 2, 3, 800)),
        ("prefetch", (1, 5, 0), None, (0, 1, 4), ((11, 1),), (6, 4, 0, 3, 2, 4, 900)),
        ("acquire", ((1, 2, 5, 4), True), ((1, 1), (2, 0), (4, 2)), (1, 2, 4), ((12, 0),), (8, 5, 0, 3, 2, 5, 1000)),
        ("acquire", ((3, 0), False), (), (1, 2, 4), (), (8, 5, 0, 3, 2, 5, 1000)),
        ("dequantized", (4,), ((None, "fp"), (None, "fp")), (1, 2, 4), (), (8, 5, 0, 3, 2, 5, 1000)),
        ("acquire", ((5,), False), (), (1, 4), (), (8, 5, 0, 3, 2, 6, 1000)),
        ("waited", (5,), ((5, 0),), (1, 4, 5), ((15, 0),), (8, 5, 1, 4, 2, 6, 1100)),
        ("failed", (5, 0), (0, 0, 0), (1, 5), (), (9, 5, 1, 4, 2, 7, 1100)),
        ("acquire", ((0, 5), True), ((0, 2), (5, 0)), (0, 1, 5), ((10, 2),), (10, 6, 1, 4, 2, 7, 1200)),
    ],
}


@pytest.mark.parametrize("policy", ["lru", "lfu", "predicted"])
def test_expert_cache_eviction_trace(policy):
    assert cache_trace(policy) == EXPECTED_CACHE[policy]


@pytest.mark.parametrize("policy", ["lru", "lfu", "predicted"])
def test_cold_tier_eviction_trace(policy):
    assert tier_trace(policy) == EXPECTED_TIER[policy]
