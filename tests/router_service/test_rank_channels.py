"""Rank loss in moeray's words: what clients are told names the rank and what happened, never the exception's own
text (Ray's carries actor ids, pids and node addresses), which goes to the log."""
from __future__ import annotations

import socket
from types import SimpleNamespace

import pytest

from router_service.rank_channels import RankChannels, RankFailed, client_reason


class RayActorError(Exception):  # stands in for ray.exceptions.RayActorError: the module is what is checked
    __module__ = "ray.exceptions"


def test_client_reason_keeps_ray_internals_out():
    text = ("The actor died unexpectedly. actor_id=9f3c0a, pid=4242, namespace=moeray-serve, ip=10.1.2.3, "
            "worker_id=ab12")
    cases = {
        RayActorError(text): "rank 1 is unreachable (its actor is gone)",
        ConnectionError("output channel closed " + text): "rank 1 is unreachable (its channel closed: the process "
                                                          "exited or its node is gone)",
        socket.timeout("timed out"): "rank 1 is unreachable (no answer within 60 s)",
        RankFailed("rank 1: RuntimeError: shared-memory all_to_all: rank 0 (pid 4242) exited"):
            "rank 1 failed during a step (RuntimeError)",
        ValueError(text): "rank 1 is unreachable (ValueError)",
    }
    for exc, want in cases.items():
        got = client_reason(1, exc)
        assert got == want
        for leak in ("9f3c0a", "4242", "10.1.2.3", "namespace", "worker_id"):
            assert leak not in got


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
def test_silent_rank_indices_follow_a_shrink_and_a_grow():
    """`silent` (for `EPCluster.shrink(silent=...)` / `restart(silent=...)`) holds indices now: an elastic drop or
    add renumbers it as it does the ranks, so a later verdict never names a rank that was not silent."""
    ch = RankChannels([], next_seq=lambda: 0, on_outputs=lambda outs: None, on_failure=lambda *a: None)
    ch.close()  # no poller reports anything
    ch.ranks, ch._slots, ch.silent = ["r0", "r1", "r2"], [0, 1, 2], frozenset({0, 2})
    ch.drop(0)  # rank 0 (silent) dropped: the one that was rank 2 is now rank 1
    assert ch.silent == {1} and ch.ranks == ["r1", "r2"]

    def unreachable():  # its poller stops at once (and, closed, reports nothing)
        raise ConnectionError("no channel")

    ch.add(0, SimpleNamespace(open_output_channel=SimpleNamespace(remote=unreachable)))  # a replacement at 0
    assert ch.silent == {2} and ch.ranks[1:] == ["r1", "r2"]
    ch._threads[-1].join(5)  # a poller that never connected ends without an error of its own
