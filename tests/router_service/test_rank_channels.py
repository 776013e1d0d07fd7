"""Rank loss in moeray's words: what clients are told names the rank and what happened, never the exception's own
text (Ray's carries actor ids, pids and node addresses), which goes to the log."""
from __future__ import annotations

import socket

from router_service.rank_channels import RankFailed, client_reason


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
