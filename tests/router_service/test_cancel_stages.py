"""Cancellation at every stage of a request frees every KV block (issue 6).

Stages: queued (in the rank's inbox, or waiting in its scheduler behind `max_num_seqs`), during prefill,
mid-decode, at the last step (racing the final token), and twice (twice in flight, after the finish, an
unknown id). Each case asserts: the request's stream ends with exactly one finish output, nothing follows
it, free KV blocks are back at the initial count once the cluster is idle, and the next request is served.

Two levels:
- engine (`RankEngine`, world_size 1, in-process): the stage is hit exactly, by aborting from inside the
  step (a wrapped `model.forward`), and every raw output of the rank is visible (so a second finish would
  show; the router drops outputs of finished requests);
- router (a real 2-rank cluster with `max_num_seqs=2`, plus the gRPC `Cancel` RPC on it): the stage is
  reached by timing where it cannot be forced from outside the rank process (prefill, last token).
"""
from __future__ import annotations

import queue
import threading
import time

import pytest

from actors.engine.messages import GenerateRequest, TokenOutput
from actors.engine.sampling import SamplingParams
from tests.router_service.conftest import wait_idle

PROMPT = "To be, or not to be"
CTX = 256  # the tiny test model's context window


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens)


# ================================================================================ engine level (exact stages)
@pytest.fixture
def engine(tiny_moe_dir):
    from actors.model.config import ModelConfig
    from actors.moe.placement import ExpertPlacement
    from actors.engine.config import EngineConfig
    from actors.engine.engine import RankEngine

    mc = ModelConfig.from_pretrained(tiny_moe_dir)
    cfg = EngineConfig(model=tiny_moe_dir, max_model_len=CTX, kv_cache_bytes=1 << 20, max_num_seqs=2)
    eng = RankEngine(cfg, ExpertPlacement.contiguous(mc.num_layers, max(mc.num_experts, 1), 1))
    eng.initial_free = eng.cache.allocator.num_free
    return eng


def add(eng, rid: str, n_prompt: int = 8, max_tokens: int = 50) -> None:
    ids = [(7 * i + 3) % 300 + 1 for i in range(n_prompt)]
    eng.add_request(GenerateRequest(request_id=rid, prompt_ids=ids, params=greedy(max_tokens).to_dict()))


class Outputs:
    """Every output the engine emitted, per request id."""

    def __init__(self):
        self.by_id: dict[str, list[TokenOutput]] = {}

    def step(self, eng) -> None:
        for o in eng.step():
            self.by_id.setdefault(o.request_id, []).append(o)

    def finishes(self, rid: str) -> list[str]:
        return [o.finish_reason for o in self.by_id.get(rid, []) if o.finish_reason is not None]

    def tokens(self, rid: str) -> int:
        return sum(len(o.token_ids) for o in self.by_id.get(rid, []))


def drain(eng, outs: Outputs, max_steps: int = 400) -> None:
    """Step until the engine has no work, then a few idle steps more (a late second finish would show)."""
    for _ in range(max_steps):
        if not eng.has_work:
            break
        outs.step(eng)
    assert not eng.has_work
    for _ in range(3):
        outs.step(eng)


def assert_clean(eng) -> None:
    """All KV blocks and gating slots back; nothing queued."""
    assert eng.cache.allocator.num_free == eng.initial_free
    assert not eng.scheduler.running and not eng.scheduler.waiting
    assert not eng._slot_of and len(eng._free_slots) == eng.cfg.max_num_seqs


def assert_next_served(eng, outs: Outputs) -> None:
    add(eng, "next", max_tokens=4)
    drain(eng, outs)
    assert outs.finishes("next") == ["length"] and outs.tokens("next") == 4
    assert_clean(eng)


def abort_inside_forward(monkeypatch, eng, rid: str, when) -> dict:
    """Call `eng.abort(rid)` from inside the first forward for which `when(meta, eng)` holds, i.e. while that
    step runs (the abort is then seen by the next step's drain, as with a real router thread)."""
    fired = {"step": None}
    orig = eng.model.forward

    def forward(ids, pos, cache, meta, gb):
        if fired["step"] is None and when(meta, eng):
            eng.abort(rid)
            fired["step"] = eng.timing["steps"]
        return orig(ids, pos, cache, meta, gb)

    monkeypatch.setattr(eng.model, "forward", forward)
    return fired


def running(eng, rid: str):
    return next((s for s in eng.scheduler.running if s.request_id == rid), None)


def test_engine_cancel_queued_in_inbox(engine):
    outs = Outputs()
    add(engine, "a")
    engine.abort("a")  # before any step: request and abort meet in the same drain
    drain(engine, outs)
    assert outs.finishes("a") == ["abort"] and outs.tokens("a") == 0
    assert_clean(engine)
    assert_next_served(engine, outs)


def test_engine_cancel_waiting_behind_max_num_seqs(engine):
    outs = Outputs()
    for rid in ("hog0", "hog1", "queued"):
        add(engine, rid, max_tokens=100)
    outs.step(engine)
    assert [s.request_id for s in engine.scheduler.waiting] == ["queued"]
    engine.abort("queued")
    outs.step(engine)
    assert outs.finishes("queued") == ["abort"] and outs.tokens("queued") == 0
    assert len(engine.scheduler.running) == 2  # the others go on
    engine.abort("hog0")
    engine.abort("hog1")
    drain(engine, outs)
    assert outs.finishes("hog0") == ["abort"] and outs.finishes("hog1") == ["abort"]
    assert_clean(engine)
    assert_next_served(engine, outs)


def test_engine_cancel_during_prefill(engine, monkeypatch):
    outs = Outputs()
    fired = abort_inside_forward(monkeypatch, engine, "long", lambda meta, eng: bool(meta.prefills))
    add(engine, "long", n_prompt=CTX - 60, max_tokens=50)
    drain(engine, outs)
    assert fired["step"] == 0  # aborted while its prefill ran
    # the prefill step still emits its token; the abort ends it at the next step
    assert outs.finishes("long") == ["abort"] and outs.tokens("long") == 1
    assert_clean(engine)
    assert_next_served(engine, outs)


def test_engine_cancel_mid_decode(engine):
    outs = Outputs()
    add(engine, "a", max_tokens=100)
    for _ in range(5):
        outs.step(engine)
    engine.abort("a")
    drain(engine, outs)
    assert outs.finishes("a") == ["abort"] and outs.tokens("a") == 5
    assert_clean(engine)
    assert_next_served(engine, outs)


@pytest.mark.parametrize("max_tokens", [1, 3])
def test_engine_cancel_at_the_last_step(engine, monkeypatch, max_tokens):
    """The abort arrives while the step that produces the final token runs: the request finishes `length`
    in that step, and the late abort finds nothing to free and emits nothing."""
    outs = Outputs()

    def last_step(meta, eng):
        s = running(eng, "a")
        return s is not None and len(s.output_ids) == max_tokens - 1

    fired = abort_inside_forward(monkeypatch, engine, "a", last_step)
    add(engine, "a", max_tokens=max_tokens)
    drain(engine, outs)
    assert fired["step"] == max_tokens - 1
    assert outs.finishes("a") == ["length"] and outs.tokens("a") == max_tokens
    assert_clean(engine)
    assert_next_served(engine, outs)


def test_engine_cancel_twice_after_finish_and_unknown(engine):
    outs = Outputs()
    add(engine, "a", max_tokens=100)
    add(engine, "b", max_tokens=100)
    outs.step(engine)
    engine.abort("a")
    engine.abort("a")  # twice before the drain
    outs.step(engine)
    engine.abort("a")  # again after its abort was processed
    engine.abort("nobody")  # unknown id
    outs.step(engine)
    assert outs.finishes("a") == ["abort"]
    engine.abort("b")
    drain(engine, outs)
    engine.abort("b")  # after the finish
    engine.abort("b")
    drain(engine, outs)
    assert outs.finishes("b") == ["abort"] and "nobody" not in outs.by_id
    assert_clean(engine)
    assert_next_served(engine, outs)


# ================================================================================ router level (2-rank cluster)
@pytest.fixture(scope="module")
def llm(ray_session, tiny_moe_dir):
    from moeray.api import LLM

    # max_num_seqs=2 per rank: the fifth long request waits in a rank's scheduler (the "queued" stage)
    llm = LLM(model=tiny_moe_dir, ranks=2, max_queue=64, kv_cache_bytes=4 * 2**20, max_num_seqs=2)
    s = wait_idle(llm.router)
    llm.initial_free = s["kv_blocks_free"]
    assert llm.initial_free == s["kv_blocks_total"] > 0
    yield llm
    llm.shutdown()


def collect(stream, timeout_s: float = 60.0) -> list[TokenOutput]:
    """Outputs of `stream` up to and including its finish (fails if none comes within timeout_s)."""
    outs, deadline = [], time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        assert left > 0, f"request {stream.request_id}: no finish within {timeout_s}s"
        try:
            o = stream.get(timeout=left)
        except queue.Empty:
            continue
        outs.append(o)
        if o.finish_reason is not None:
            return outs


def finishes(outs: list[TokenOutput]) -> list[str]:
    return [o.finish_reason for o in outs if o.finish_reason is not None]


def wait_tokens(stream, n: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len(stream.out.token_ids) < n and not stream.done.is_set():
        assert time.monotonic() < deadline, f"request {stream.request_id}: {n} tokens not reached"
        time.sleep(0.01)


def assert_idle_and_served(llm, *streams) -> None:
    """Idle with every KV block free, nothing after any stream's finish, and a new request is served."""
    s = wait_idle(llm.router)
    assert s["in_flight"] == 0 and s["running"] == 0 and s["waiting"] == 0
    assert s["kv_blocks_free"] == llm.initial_free
    for st in streams:
        assert st.q.empty(), f"request {st.request_id}: output after its finish"
    out = llm.router.submit(PROMPT, greedy(4)).result(timeout=60)
    assert out.finish_reason == "length" and len(out.token_ids) == 4
    assert wait_idle(llm.router)["kv_blocks_free"] == llm.initial_free


def fill_ranks(llm, n: int = 4) -> list:
    """`n` long requests, all running (2 per rank fill `max_num_seqs=2`)."""
    hogs = [llm.router.submit(PROMPT, greedy(CTX - 16)) for _ in range(n)]  # long enough to outlast the test
    for h in hogs:
        wait_tokens(h, 1)
    return hogs


@pytest.mark.ray
def test_router_cancel_queued(llm):
    router = llm.router
    hogs = fill_ranks(llm)
    victim = router.submit(PROMPT, greedy(50))
    deadline = time.monotonic() + 30
    while router.stats()["waiting"] < 1:
        assert time.monotonic() < deadline, "the fifth request never waited"
        time.sleep(0.02)
    assert not victim.out.token_ids
    victim.cancel()
    outs = collect(victim)
    assert finishes(outs) == ["abort"] and sum(len(o.token_ids) for o in outs) == 0
    assert all(not h.done.is_set() for h in hogs)  # the others go on
    for h in hogs:
        h.cancel()
    for h in hogs:
        assert finishes(collect(h)) == ["abort"]
    assert_idle_and_served(llm, victim, *hogs)


@pytest.mark.ray
@pytest.mark.parametrize("delay_s", [0.0, 0.005, 0.02])
def test_router_cancel_during_prefill(llm, delay_s):
    """A long prompt cancelled right after submit: the abort lands while the request sits in the inbox,
    while its prefill runs, or just after (which one depends on timing; each must end the same way)."""
    router = llm.router
    ids = [(7 * i + 3) % 300 + 1 for i in range(CTX - 40)]
    stream = router.submit(ids, greedy(30))
    time.sleep(delay_s)
    stream.cancel()
    outs = collect(stream)
    assert finishes(outs) == ["abort"] and sum(len(o.token_ids) for o in outs) < 30
    assert_idle_and_served(llm, stream)


@pytest.mark.ray
def test_router_cancel_mid_decode(llm):
    stream = llm.router.submit(PROMPT, greedy(200))
    wait_tokens(stream, 5)
    stream.cancel()
    outs = collect(stream)
    assert finishes(outs) == ["abort"] and len(stream.out.token_ids) < 200
    assert_idle_and_served(llm, stream)


@pytest.mark.ray
@pytest.mark.parametrize("max_tokens", [1, 2, 4])
def test_router_cancel_racing_the_last_token(llm, max_tokens):
    """Cancel as soon as max_tokens - 1 tokens arrived: the final token and the abort race. Either wins,
    but there is exactly one finish (`length` with all tokens, or `abort` with fewer)."""
    stream = llm.router.submit(PROMPT, greedy(max_tokens))
    outs, got = [], 0
    while got < max_tokens - 1:
        o = stream.q.get(timeout=60)
        outs.append(o)
        got += len(o.token_ids)
        assert o.finish_reason is None
    stream.cancel()
    outs += collect(stream)
    n = sum(len(o.token_ids) for o in outs)
    assert finishes(outs) in (["length"], ["abort"])
    assert n == max_tokens if finishes(outs) == ["length"] else n < max_tokens
    assert_idle_and_served(llm, stream)


@pytest.mark.ray
def test_router_cancel_twice_after_finish_and_unknown(llm):
    router = llm.router
    stream = router.submit(PROMPT, greedy(200))
    wait_tokens(stream, 2)
    stream.cancel()
    stream.cancel()  # twice in flight
    outs = collect(stream)
    assert finishes(outs) == ["abort"]
    stream.cancel()  # after the finish
    router.abort("no-such-request")  # unknown id
    done = router.submit(PROMPT, greedy(3))
    assert done.result(timeout=60).finish_reason == "length"
    done.cancel()  # cancel of a request that finished normally
    done.cancel()
    assert_idle_and_served(llm, stream)


@pytest.mark.ray
def test_grpc_cancel_rpc_of_a_queued_request(llm):
    """The gRPC `Cancel` of a request waiting behind full ranks ends its stream with one ABORT; a second
    Cancel finds nothing (and frees nothing twice)."""
    import grpc

    from router_service.grpc.server import start_grpc_server
    from router_service.proto.moeray.v1 import moeray_pb2 as pb
    from router_service.proto.moeray.v1 import moeray_pb2_grpc as pb_grpc

    srv = start_grpc_server(llm.router, host="127.0.0.1", port=0)
    ch = grpc.insecure_channel(srv.address)
    try:
        stub = pb_grpc.MoerayStub(ch)
        hogs = fill_ranks(llm)
        responses: list = []
        call = stub.Generate(pb.GenerateRequest(request_id="queued-grpc", text=PROMPT, sampling=pb.SamplingParams(
            max_tokens=50, temperature=0.0, ignore_eos=True)), timeout=60)
        reader = threading.Thread(target=lambda: responses.extend(call))
        reader.start()
        deadline = time.monotonic() + 30
        while llm.router.stats()["waiting"] < 1:
            assert time.monotonic() < deadline, "the gRPC request never waited"
            time.sleep(0.02)
        assert stub.Cancel(pb.CancelRequest(request_id="queued-grpc"), timeout=10).found
        reader.join(timeout=30)
        assert not reader.is_alive()
        assert [r.finish_reason for r in responses] == [pb.FINISH_REASON_ABORT]
        assert not responses[0].token_ids
        assert not stub.Cancel(pb.CancelRequest(request_id="queued-grpc"), timeout=10).found
        for h in hogs:
            h.cancel()
        for h in hogs:
            assert finishes(collect(h)) == ["abort"]
        assert_idle_and_served(llm, *hogs)
    finally:
        ch.close()
        srv.stop()


@pytest.mark.ray
@pytest.mark.parametrize("path", ["channel", "actor"])
def test_router_cancel_while_the_rank_is_taking_the_request(llm, monkeypatch, path):
    """A cancel (e.g. gRPC Cancel with the client's request_id) that arrives while `submit` is still handing the
    request to its rank is not lost: it is held and replayed once the rank has the request. (The engine also
    tolerates an abort that overtakes its request within one drain; the router does not rely on that.)
    path: "channel", the request frame on the rank's channel; "actor", the Ray actor call the router takes
    while the channels are not all up (forced here by a `post` that sends nothing)."""
    import router_service.router as rmod
    from actors.rank.output_channel import REQUEST

    router = llm.router
    channels, rid, calls = router._channels, "cancel-during-admission-" + path, []
    real_get, real_post = rmod.ray.get, channels.post

    def cancel_once():
        if not calls and router.get_stream(rid) is not None:
            calls.append(1)
            router.abort(rid)

    def post_with_cancel(owner, kind, payload, wake=True):
        if kind == REQUEST:
            cancel_once()
            if path == "actor":
                return False
        return real_post(owner, kind, payload, wake=wake)

    def get_with_cancel(ref, *a, **kw):
        # pollers call ray.get too: any call in the window will do
        cancel_once()
        return real_get(ref, *a, **kw)

    monkeypatch.setattr(channels, "post", post_with_cancel)
    if path == "actor":
        monkeypatch.setattr(rmod.ray, "get", get_with_cancel)
    stream = router.submit(PROMPT, greedy(CTX - 16), request_id=rid)
    monkeypatch.setattr(rmod.ray, "get", real_get)
    monkeypatch.setattr(channels, "post", real_post)
    assert calls and stream.abort_pending  # deferred, not sent to a rank that may not have the request yet
    outs = collect(stream)
    assert finishes(outs) == ["abort"] and len(stream.out.token_ids) < CTX - 16
    assert_idle_and_served(llm, stream)
