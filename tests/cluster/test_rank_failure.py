"""A rank actor killed mid-generation: the router fails every in-flight request with a retriable error, tears
the EP group down, rebuilds it (new actors, new process group) and serves again, with no manual restart and no
KV block lost. The issue's time limits (errors within 15 s, serving within 30 s) are measured by
`bench/failover.py`, not asserted here: this machine's load makes timed assertions flaky; the limits below
only bound a hang."""
from __future__ import annotations

import threading
import time

import pytest

from tests.router_service.conftest import start_llm, wait_idle

pytestmark = pytest.mark.usefixtures("ray_session")


@pytest.fixture(scope="module")
def llm(ray_session, tiny_model_dir):
    llm = start_llm(tiny_model_dir("qwen2_moe"), ranks=2)
    yield llm
    llm.shutdown()


def _long(max_tokens: int = 200):
    from actors.engine.sampling import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _wait_serving(router, timeout_s: float) -> float:
    """Seconds until the router accepts and completes a request again (raises if not within timeout_s)."""
    from actors.engine.sampling import SamplingParams
    from router_service.errors import EngineError

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        try:
            out = router.submit("hello there", SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)).result(
                timeout=max(1.0, timeout_s - (time.monotonic() - t0)))
            if out.finish_reason == "length":
                return time.monotonic() - t0
        except EngineError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"not serving again within {timeout_s}s: {router.health()}")


def _kill_mid_generation(llm, victim: int):
    import ray

    router = llm.router
    streams = [router.submit(f"prompt number {i} about the sea", _long()) for i in range(3)]
    first = streams[0].get(timeout=30)  # decoding has started
    assert first.finish_reason is None
    old_pids = {r["pid"] for r in router.cluster.info}
    t_kill = time.monotonic()
    ray.kill(router.cluster.ranks[victim], no_restart=True)
    return streams, t_kill, old_pids


@pytest.mark.parametrize("victim", [1, 0])
def test_killed_rank_rebuilds_group(llm, victim):
    router = llm.router
    before = len(router.recoveries)
    ref = router.submit("the same prompt", _long(6)).result(timeout=120)
    streams, t_kill, old_pids = _kill_mid_generation(llm, victim)
    for s in streams:
        out = s.result(timeout=60)
        assert out.finish_reason == "error" and "rebuilt" in out.error, out
    _wait_serving(router, 180)
    assert len(router.recoveries) == before + 1
    rec = router.recoveries[-1]
    assert rec["failed_requests"] >= 3 and rec["generation"] == router.cluster.generation
    assert {r["pid"] for r in router.cluster.info}.isdisjoint(old_pids)  # new actors, new process group
    h = router.health()
    assert h["ok"] and h["status"] == "ok" and len(h["ranks"]) == 2
    s = wait_idle(router)
    assert s["kv_blocks_free"] == s["kv_blocks_total"] and s["in_flight"] == 0
    # the rebuilt group serves the same greedy tokens as the group before the failure
    again = router.submit("the same prompt", _long(6)).result(timeout=120)
    assert again.token_ids == ref.token_ids and len(ref.token_ids) == 6


def test_refuses_while_rebuilding_and_http_gets_503(llm):
    """During the rebuild, new requests get a retriable EngineError (HTTP 503 + Retry-After), /health says
    recovering (503), and an in-flight HTTP stream ends with an in-band 503 error event."""
    import ray
    from fastapi.testclient import TestClient

    from router_service.errors import EngineError
    from router_service.http.app import create_app

    router = llm.router
    client = TestClient(create_app(router, model_name="m"))
    result: dict = {"lines": []}
    streaming = threading.Event()

    def stream_req():
        body = {"model": "m", "prompt": "a long story", "max_tokens": 200, "stream": True, "ignore_eos": True}
        with client.stream("POST", "/v1/completions", json=body) as r:
            result["status"] = r.status_code
            for ln in r.iter_lines():
                if ln:
                    result["lines"].append(ln)
                    streaming.set()
        streaming.set()

    t = threading.Thread(target=stream_req)
    t.start()
    # kill a rank as soon as the stream has its first token: on a fast machine the 200 tokens take well under a
    # second, so a fixed sleep could let the stream finish before the kill
    assert streaming.wait(30)
    ray.kill(router.cluster.ranks[1], no_restart=True)
    deadline = time.monotonic() + 15
    while router.health()["status"] != "recovering" and time.monotonic() < deadline:
        time.sleep(0.02)
    if router.health()["status"] == "recovering":  # the rebuild can be fast; check the refusal while it lasts
        with pytest.raises(EngineError, match="rebuilt"):
            router.submit("x", _long(2))
        r = client.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 2})
        assert r.status_code in (200, 503)
        if r.status_code == 503:
            assert r.headers.get("retry-after") and r.json()["error"]["type"] == "engine_unavailable"
    t.join(timeout=60)
    assert not t.is_alive()
    assert result["status"] == 200 and any('"code": 503' in ln or '"code":503' in ln for ln in result["lines"]), result
    _wait_serving(router, 180)
    assert client.get("/health").status_code == 200
    s = wait_idle(router)
    assert s["kv_blocks_free"] == s["kv_blocks_total"]
