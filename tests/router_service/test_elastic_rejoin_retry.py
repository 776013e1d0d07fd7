"""Elastic EP's replacement rank (`router_service.elastic.rejoin`) when it cannot be placed at once: a TimeoutError
from `prepare_grow` (no room off the lost node: STRICT_SPREAD with no spare node, a full cluster) is tried again
later, so the group grows back once a node has room; any other error, a rebuild (new generation) or a closed router
ends the tries. Router and cluster are stand-ins (no Ray)."""
from __future__ import annotations

import itertools
import threading
import time
from types import SimpleNamespace

import pytest

from router_service import elastic


class Cluster:
    """`prepare_grow` raises the queued errors in turn, then succeeds; `finish_grow` switches rank 1 in."""

    def __init__(self, errors):
        self.errors, self.calls, self.ranks = list(errors), [], ["r0"]

    def prepare_grow(self):
        self.calls.append(time.monotonic())
        if self.errors:
            raise self.errors.pop(0)
        return {"slot": 1}

    def finish_grow(self, prepared):
        self.ranks.append("r1")
        return {"rank": 1, "world_size": 2}

    def abandon_grow(self, prepared):
        raise AssertionError("nothing to abandon here")


def _router(cluster):
    return SimpleNamespace(cluster=cluster, _lock=threading.Lock(), _gen=3, _closed=False, _recovering=None,
                           _streams={}, _ranks=SimpleNamespace(insert=lambda b: None),
                           _channels=SimpleNamespace(add=lambda b, r: None), _seq=itertools.count(1), rejoins=[],
                           _wake_others=lambda rank, seq: None)


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch):
    monkeypatch.setattr(elastic, "REJOIN_RETRY_S", (0.05, 0.1))


def test_a_replacement_not_placed_is_tried_again_until_it_joins():
    cl = Cluster([TimeoutError("no replacement rank within 120s (placement_strategy=STRICT_SPREAD)")] * 3)
    router = _router(cl)
    info = elastic.rejoin(router, 3)
    assert info is not None and info["world_size"] == 2 and router.rejoins == [info] and len(cl.calls) == 4
    gaps = [b - a for a, b in zip(cl.calls, cl.calls[1:])]
    assert gaps[0] >= 0.05 and gaps[1] >= 0.1 and gaps[2] >= 0.1, gaps  # the pause doubles up to its bound
    assert router._recovering is None


def test_other_errors_are_not_retried():
    cl = Cluster([ValueError("grow needs exactly one missing rank, missing: [1, 2]")])
    router = _router(cl)
    assert elastic.rejoin(router, 3) is None and len(cl.calls) == 1 and router.rejoins == []


@pytest.mark.parametrize("how", ["rebuild", "close"])
def test_the_tries_end_with_the_generation_or_the_router(how, monkeypatch):
    cl = Cluster([TimeoutError("not placed")] * 100)
    router = _router(cl)
    monkeypatch.setattr(elastic, "REJOIN_RETRY_S", (0.3, 0.3))

    def end():
        time.sleep(0.1)
        if how == "rebuild":
            router._gen += 1
        else:
            router._closed = True
    threading.Thread(target=end).start()
    t0 = time.monotonic()
    assert elastic.rejoin(router, 3) is None
    assert len(cl.calls) == 1 and time.monotonic() - t0 < 1.0 and router.rejoins == []
