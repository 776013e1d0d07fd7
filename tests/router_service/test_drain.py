"""Graceful shutdown (`Router.drain`, called by `moeray serve` on SIGINT / SIGTERM before Serve stops): new
requests are refused with a retriable error, running ones may finish, the rest end with a final error output,
and every KV block is free."""
from __future__ import annotations

import time

import pytest

from actors.engine.sampling import SamplingParams
from router_service.errors import EngineError
from tests.router_service.conftest import start_llm, wait_idle


@pytest.fixture(scope="module")
def llm(ray_session, tiny_moe_dir):
    llm = start_llm(tiny_moe_dir, ranks=1)
    yield llm
    llm.shutdown()


def test_drain_finishes_short_ends_long_and_refuses_new(llm):
    router = llm.router
    total = wait_idle(router)["kv_blocks_total"]
    short = router.submit("to be", SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    long = router.submit("or not", SamplingParams(max_tokens=240, temperature=0.0, ignore_eos=True))
    short.get(timeout=60), long.get(timeout=60)  # both decoding: the short one needs 3 more steps, the long 239
    # The drain window: ~20 decode steps at this machine's pace (measured on the long request), so the short one
    # finishes inside it and the long one cannot (a fixed 0.2 s let all 240 tokens finish on a fast machine).
    t0, n0 = time.monotonic(), len(long.out.token_ids)
    while len(long.out.token_ids) < n0 + 5 and time.monotonic() - t0 < 5:
        time.sleep(0.001)
    step_s = (time.monotonic() - t0) / max(len(long.out.token_ids) - n0, 1)
    assert len(long.out.token_ids) < 200  # room left for the long request to be cut short
    ended = router.drain(timeout_s=20 * step_s)
    assert ended == 1
    assert short.result(timeout=5).finish_reason == "length" and len(short.out.token_ids) == 4
    out = long.result(timeout=5)
    assert out.finish_reason == "error" and "shutting down" in out.error and len(out.token_ids) < 240
    with pytest.raises(EngineError, match="shutting down"):
        router.submit("x", SamplingParams(max_tokens=2))
    # probes see it: HTTP /health 503 and gRPC Health NOT_SERVING (they refuse Generate now)
    h = router.health()
    assert not h["ok"] and h["status"] == "draining"
    from fastapi.testclient import TestClient

    from router_service.grpc.rpc import MoerayRpc
    from router_service.http.app import create_app
    from router_service.proto.moeray.v1 import moeray_pb2 as pb

    with TestClient(create_app(router)) as c:
        assert c.get("/health").status_code == 503
    g = MoerayRpc(router).health()
    assert g.status == pb.HealthResponse.STATUS_NOT_SERVING and g.detail == "the server is shutting down"
    s = wait_idle(router)
    assert s["kv_blocks_free"] == total and s["running"] == 0
