"""gRPC front door against a real 2-rank tiny cluster on 127.0.0.1 (one cluster for the module)."""
from __future__ import annotations

import threading
import time

import grpc
import pytest

from router_service.grpc.server import start_grpc_server
from router_service.proto.moeray.v1 import moeray_pb2 as pb
from router_service.proto.moeray.v1 import moeray_pb2_grpc as pb_grpc
from tests.router_service.conftest import start_llm, wait_idle

pytestmark = pytest.mark.ray

PROMPT = "To be, or not to be"


@pytest.fixture(scope="module")
def llm(ray_session, tiny_moe_dir):
    llm = start_llm(tiny_moe_dir, ranks=2)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def server(llm):
    srv = start_grpc_server(llm.router, host="127.0.0.1", port=0)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def stub(server):
    ch = grpc.insecure_channel(server.address)
    yield pb_grpc.MoerayStub(ch)
    ch.close()


def gen(stub, text=PROMPT, timeout=60, metadata=None, **sampling):
    req = pb.GenerateRequest(text=text, sampling=pb.SamplingParams(**sampling))
    return list(stub.Generate(req, timeout=timeout, metadata=metadata))


def assert_served(stub):
    """A normal request right after a rejected one is served."""
    out = gen(stub, max_tokens=3, temperature=0.0, ignore_eos=True)
    assert out[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert out[-1].usage.completion_tokens == 3


def test_list_models_health_stats(stub, llm):
    models = stub.ListModels(pb.ListModelsRequest(), timeout=10).models
    assert [m.id for m in models] == [llm.router.cfg.model.rstrip("/").split("/")[-1]]
    assert models[0].max_model_len == llm.router.cfg.max_model_len and models[0].ranks == 2
    h = stub.Health(pb.HealthRequest(), timeout=10)
    assert h.status == pb.HealthResponse.STATUS_SERVING and [r.rank for r in h.ranks] == [0, 1]
    s = stub.GetClusterStats(pb.GetClusterStatsRequest(), timeout=10)
    assert len(s.ranks) == 2 and s.kv_blocks_total > 0


def test_generate_stream_matches_router(stub, llm):
    out = gen(stub, max_tokens=12, temperature=0.0, ignore_eos=True)
    ref = llm.generate([PROMPT], llm_params(max_tokens=12))[0]
    ids = [t for r in out for t in r.token_ids]
    text = "".join(r.text for r in out)
    assert ids == ref.token_ids and text == ref.text
    last = out[-1]
    assert last.finish_reason == pb.FINISH_REASON_LENGTH
    assert all(r.finish_reason == pb.FINISH_REASON_UNSPECIFIED for r in out[:-1])
    assert last.usage.completion_tokens == 12 and last.usage.prompt_tokens == ref.prompt_tokens
    assert last.usage.total_tokens == 12 + ref.prompt_tokens
    assert len({r.request_id for r in out}) == 1 and out[0].request_id


def llm_params(**kw):
    from actors.engine.sampling import SamplingParams

    return SamplingParams(temperature=0.0, ignore_eos=True, **kw)


def test_sampled_text_deltas_are_whole_characters(stub, llm):
    """Random tokens of a byte-level vocab often split UTF-8 characters: the deltas must still add up to
    the decoded text (no U+FFFD emitted for half a character and then corrected)."""
    tok = llm.router.tokenizer
    split = 0
    for seed in (1, 2, 3, 4, 5):
        out = gen(stub, max_tokens=40, temperature=1.0, seed=seed, ignore_eos=True)
        ids = [t for r in out for t in r.token_ids]
        split += sum("\ufffd" in tok.decode([t]) for t in ids)
        text = "".join(r.text for r in out)
        assert all(not r.text.endswith("\ufffd") for r in out[:-1])
        # a sequence cut by max_tokens in the middle of a character ends with U+FFFD, as decode() gives
        assert text == tok.decode(ids, skip_special_tokens=True)
    assert split > 0  # the case this test is about did occur


def test_stop_string_held_back(stub):
    full = "".join(r.text for r in gen(stub, max_tokens=24, temperature=0.0, ignore_eos=True))
    assert len(full) > 6
    stop = full[3:6]
    out = gen(stub, max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop])
    text = "".join(r.text for r in out)
    assert text == full[: full.index(stop)]
    assert out[-1].finish_reason == pb.FINISH_REASON_STOP


@pytest.mark.parametrize("request_kw, field, limit", [
    (dict(sampling=pb.SamplingParams(max_tokens=-1)), "max_tokens", ">= 0"),
    (dict(sampling=pb.SamplingParams(max_tokens=100000)), "max_tokens", "context window"),
    (dict(sampling=pb.SamplingParams(top_p=1.5)), "top_p", "(0, 1]"),
    (dict(sampling=pb.SamplingParams(temperature=-0.5)), "temperature", "[0, 100]"),
    (dict(sampling=pb.SamplingParams(stop=[""])), "stop", "non-empty"),
    (dict(sampling=pb.SamplingParams(gating="fastest")), "gating", "must be one of exact"),
    (dict(text=""), "prompt", "empty"),
    (dict(token_ids=pb.TokenIds(ids=[10**6])), "prompt", "out of range"),
])
def test_invalid_argument_names_field_and_limit(stub, request_kw, field, limit):
    kw = {"text": PROMPT} if "token_ids" not in request_kw else {}
    kw.update(request_kw)
    with pytest.raises(grpc.RpcError) as ei:
        list(stub.Generate(pb.GenerateRequest(**kw), timeout=30))
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert ei.value.details().startswith(f"{field}: ") and limit in ei.value.details()
    assert_served(stub)


def test_unserved_model_is_not_found(stub):
    """As HTTP's 404 model_not_found."""
    with pytest.raises(grpc.RpcError) as ei:
        list(stub.Generate(pb.GenerateRequest(model="no-such-model", text=PROMPT), timeout=30))
    assert ei.value.code() == grpc.StatusCode.NOT_FOUND
    assert ei.value.details().startswith("model: model='no-such-model' is not served; available: [")
    assert_served(stub)


def test_batch_prompts_stream_each_prompt_indexed(stub, llm):
    """A batch of text and token-id prompts: prompt i's responses carry index i and request id "<id>-<i>", its
    tokens and text equal its own greedy run, its last response its usage."""
    texts = [PROMPT, "All the world's a stage"]
    ids = llm.router.tokenizer.encode("Now is the winter").ids
    ref = llm.generate(texts + [ids], llm_params(max_tokens=6))
    batch = pb.PromptBatch(prompts=[pb.Prompt(text=t) for t in texts] + [pb.Prompt(token_ids=pb.TokenIds(ids=ids))])
    out = list(stub.Generate(pb.GenerateRequest(request_id="b", batch=batch, sampling=pb.SamplingParams(
        max_tokens=6, temperature=0.0, ignore_eos=True)), timeout=60))
    assert {m.index for m in out} == {0, 1, 2}
    for i, r in enumerate(ref):
        mine = [m for m in out if m.index == i]
        assert {m.request_id for m in mine} == {f"b-{i}"}
        assert [t for m in mine for t in m.token_ids] == r.token_ids and "".join(m.text for m in mine) == r.text
        assert mine[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert all(m.finish_reason == pb.FINISH_REASON_UNSPECIFIED for m in mine[:-1])
        assert (mine[-1].usage.prompt_tokens, mine[-1].usage.completion_tokens) == (r.prompt_tokens, 6)


@pytest.mark.parametrize("prompts, details, aborted", [
    ([pb.Prompt(text=PROMPT), pb.Prompt(text="")], "prompt: prompt 1 of the batch: prompt is empty", ["r-0"]),
    ([pb.Prompt(text=PROMPT), pb.Prompt(token_ids=pb.TokenIds(ids=[10**6]))], "prompt: prompt 1 of the batch: ",
     ["r-0"]),
    ([pb.Prompt(text=PROMPT), pb.Prompt()], "prompt: prompt 1 of the batch is missing: set text or token_ids", []),
    ([], "prompt: batch has 0 prompts; 1 to 256 in one request", []),
    ([pb.Prompt(text="x")] * 257, "prompt: batch has 257 prompts; 1 to 256 in one request", []),
])
def test_batch_is_refused_whole(stub, llm, monkeypatch, prompts, details, aborted):
    """One bad prompt refuses the call; the prompts admitted before it are aborted on their ranks."""
    calls, abort = [], llm.router.abort
    monkeypatch.setattr(llm.router, "abort", lambda rid: (calls.append(rid), abort(rid)))
    req = pb.GenerateRequest(request_id="r", sampling=pb.SamplingParams(max_tokens=100, temperature=0.0,
                                                                        ignore_eos=True))
    req.batch.SetInParent()
    req.batch.prompts.extend(prompts)
    with pytest.raises(grpc.RpcError) as ei:
        list(stub.Generate(req, timeout=30))
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and ei.value.details().startswith(details)
    assert calls == aborted
    _free_after_idle(llm)


def test_missing_prompt(stub):
    with pytest.raises(grpc.RpcError) as ei:
        list(stub.Generate(pb.GenerateRequest(), timeout=30))
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt" in ei.value.details()


def test_overload_is_resource_exhausted(stub, llm):
    router = llm.router
    old = router.max_queue
    router.max_queue = 1
    try:
        hog = router.submit(PROMPT, llm_params(max_tokens=200))
        with pytest.raises(grpc.RpcError) as ei:
            gen(stub, max_tokens=2)
        assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue limit" in ei.value.details()
        hog.cancel()
        hog.result(timeout=30)
    finally:
        router.max_queue = old
    assert_served(stub)


def _free_after_idle(llm):
    s = wait_idle(llm.router)
    assert s["in_flight"] == 0
    assert s["kv_blocks_free"] == s["kv_blocks_total"]


def test_client_cancel_mid_decode_frees_kv(stub, llm):
    call = stub.Generate(pb.GenerateRequest(text=PROMPT, sampling=pb.SamplingParams(
        max_tokens=200, temperature=0.0, ignore_eos=True)), timeout=60)
    got = 0
    for r in call:
        got += len(r.token_ids)
        if got >= 3:
            break
    assert llm.router.in_flight == 1
    call.cancel()
    _free_after_idle(llm)
    assert_served(stub)


def test_deadline_aborts_and_frees_kv(stub, llm):
    # a deadline that expires about a third of the way through 240 tokens, whatever this machine's speed
    t0 = time.monotonic()
    gen(stub, max_tokens=16, temperature=0.0, ignore_eos=True)
    timeout = max(0.2, 5 * (time.monotonic() - t0))
    with pytest.raises(grpc.RpcError) as ei:
        gen(stub, timeout=timeout, max_tokens=240, temperature=0.0, ignore_eos=True)
    assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    _free_after_idle(llm)


def test_server_request_timeout_aborts_and_frees_kv(llm):
    srv = start_grpc_server(llm.router, port=0, request_timeout_s=0.2)  # the client's own deadline is 60 s
    try:
        with grpc.insecure_channel(srv.address) as ch, pytest.raises(grpc.RpcError) as ei:
            gen(pb_grpc.MoerayStub(ch), max_tokens=240, temperature=0.0, ignore_eos=True)
        assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "request timeout of 0.2 s (--request-timeout-s)" in ei.value.details()
        _free_after_idle(llm)  # aborted on its rank: nothing in flight, every KV block free
    finally:
        srv.stop()


def test_cancel_rpc(stub, llm):
    responses = []
    call = stub.Generate(pb.GenerateRequest(request_id="cancel-me", text=PROMPT, sampling=pb.SamplingParams(
        max_tokens=200, temperature=0.0, ignore_eos=True)), timeout=60)
    t = threading.Thread(target=lambda: responses.extend(call))
    t.start()
    deadline = time.monotonic() + 30
    while not responses and time.monotonic() < deadline:
        time.sleep(0.02)
    assert stub.Cancel(pb.CancelRequest(request_id="cancel-me"), timeout=10).found
    t.join(timeout=30)
    assert responses[-1].finish_reason == pb.FINISH_REASON_ABORT
    assert sum(len(r.token_ids) for r in responses) < 200
    assert not stub.Cancel(pb.CancelRequest(request_id="cancel-me"), timeout=10).found
    _free_after_idle(llm)


def test_api_key(llm):
    srv = start_grpc_server(llm.router, port=0, api_key="s3cret")
    try:
        with grpc.insecure_channel(srv.address) as ch:
            stub = pb_grpc.MoerayStub(ch)
            with pytest.raises(grpc.RpcError) as ei:
                stub.ListModels(pb.ListModelsRequest(), timeout=10)
            assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as ei:
                gen(stub, max_tokens=2, metadata=[("authorization", "Bearer wrong")])
            assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
            out = gen(stub, max_tokens=2, temperature=0.0, metadata=[("authorization", "Bearer s3cret")])
            assert out[-1].finish_reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_STOP)
            assert stub.ListModels(pb.ListModelsRequest(), timeout=10, metadata=[("x-api-key", "s3cret")]).models
            assert stub.Health(pb.HealthRequest(), timeout=10).status == pb.HealthResponse.STATUS_SERVING
    finally:
        srv.stop()


def test_rank_failure_is_unavailable(stub, llm):
    """A rank failure reaches the client as UNAVAILABLE (injected the way the router reports an unreachable rank)."""
    call = stub.Generate(pb.GenerateRequest(text=PROMPT, sampling=pb.SamplingParams(
        max_tokens=30, temperature=0.0, ignore_eos=True)), timeout=60)
    with pytest.raises(grpc.RpcError) as ei:
        for r in call:
            if r.token_ids:
                llm.router._fail_rank(0, "rank 0 unreachable: injected")
                llm.router._fail_rank(1, "rank 1 unreachable: injected")
    assert ei.value.code() == grpc.StatusCode.UNAVAILABLE and "injected" in ei.value.details()
    _free_after_idle(llm)
    assert_served(stub)


def test_generate_feeds_the_latency_metrics(llm):
    """With a Metrics given (as the Serve replica does with its HTTP app's), gRPC Generates are timed and
    counted: /metrics covers both protocols."""
    from router_service.metrics import Metrics

    m = Metrics(llm.router)
    srv = start_grpc_server(llm.router, host="127.0.0.1", port=0, metrics=m)
    try:
        with grpc.insecure_channel(srv.address) as ch:
            out = gen(pb_grpc.MoerayStub(ch), max_tokens=4, temperature=0.0, ignore_eos=True)
        assert out[-1].finish_reason == pb.FINISH_REASON_LENGTH
    finally:
        srv.stop()
    assert m.generated_tokens.labels("grpc")._value.get() == 4 and m.generated_tokens.labels("http")._value.get() == 0
    assert m.requests.labels("grpc", "Generate", "OK")._value.get() == 1
    assert m.ttft._sum.get() > 0 and m.e2e._sum.get() > 0


def test_server_reflection_describes_the_service(server):
    """grpcurl-style discovery without the .proto: the service, its methods, their message types."""
    from google.protobuf.descriptor_pool import DescriptorPool
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with grpc.insecure_channel(server.address) as ch:
        db = ProtoReflectionDescriptorDatabase(ch)
        assert "moeray.v1.Moeray" in db.get_services()
        svc = DescriptorPool(db).FindServiceByName("moeray.v1.Moeray")
        methods = {m.name: m for m in svc.methods}
        assert set(methods) == {"Generate", "Cancel", "Health", "ListModels", "GetClusterStats"}
        gen_m = methods["Generate"]
        assert gen_m.input_type.full_name == "moeray.v1.GenerateRequest" and gen_m.server_streaming


def test_64_concurrent_generate_streams_arrive_in_order(stub, llm):
    """64 Generate streams at once (beyond max_num_seqs: queued on the ranks, not refused): each stream's token
    ids, in arrival order, equal the greedy reference of its prompt."""
    import concurrent.futures as cf

    prompts = [f"{PROMPT} {i}" for i in range(64)]
    ref = llm.generate(prompts, llm_params(max_tokens=12))
    with cf.ThreadPoolExecutor(64) as ex:
        outs = list(ex.map(lambda p: gen(stub, text=p, timeout=180, max_tokens=12, temperature=0.0,
                                         ignore_eos=True), prompts))
    for out, r in zip(outs, ref):
        assert [t for m in out for t in m.token_ids] == r.token_ids
        assert out[-1].finish_reason == pb.FINISH_REASON_LENGTH
