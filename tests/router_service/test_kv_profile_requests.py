"""Per-request KV quantization profile end to end: `SamplingParams.kv_profile`, the HTTP body field and the gRPC
field, on a real 1-rank cluster of the shipped model with a 3-bit KV cache (`prose` and `code` profiles).

Unknown names are refused at the edge (HTTP 400 `param: kv_profile`, gRPC INVALID_ARGUMENT `kv_profile: ...`)
and the next request is served; requests with different profiles share a batch and each gets the tokens it
gets alone. One cluster for the module."""
from __future__ import annotations

from types import SimpleNamespace

import grpc
import pytest

from actors.engine.sampling import SamplingParams, served_kv_profiles
from cluster.config import DEFAULT_MODEL
from router_service.admission import PromptAdmission
from router_service.errors import InvalidRequestError
from router_service.grpc.server import start_grpc_server
from router_service.proto.moeray.v1 import moeray_pb2 as pb
from router_service.proto.moeray.v1 import moeray_pb2_grpc as pb_grpc
from router_service.router import Router
from tests.router_service.conftest import wait_idle

pytestmark = pytest.mark.ray

PROSE = "ROMEO. But soft, what light through yonder window breaks?"
CODE = "def add(a, b):\n    return {'sum': a + b, 'items': [a, b]}  # (x)\n"


@pytest.fixture(scope="module")
def llm(ray_session):
    from moeray.api import LLM

    llm = LLM(model=DEFAULT_MODEL, ranks=1, kv_bits=3, kv_profile="auto", max_model_len=256,
              kv_cache_bytes=2**22, max_num_seqs=8, max_queue=32)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def stub(llm):
    srv = start_grpc_server(llm.router, host="127.0.0.1", port=0)
    ch = grpc.insecure_channel(srv.address)
    yield pb_grpc.MoerayStub(ch)
    ch.close()
    srv.stop()


def greedy(max_tokens: int = 8, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def complete(client, **kw):
    body = {"prompt": PROSE, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    body.update(kw)
    return client.post("/v1/completions", json=body)


def assert_400_kv_profile(r, *needles: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "kv_profile" and err["message"].startswith("kv_profile")
    assert all(n in err["message"] for n in needles), err["message"]


def test_served_profile_names(llm):
    assert llm.kv_profiles == ("code", "prose")


def test_mixed_profiles_in_one_batch_equal_each_alone(llm):
    jobs = [(PROSE, "code"), (CODE, "prose"), (CODE, "auto"), (PROSE, None)]
    router = llm.router
    # queued together, so they share steps (tests/actors/engine/test_engine_kv_profile.py pins one batch)
    streams = [router.submit(p, greedy(kv_profile=k)) for p, k in jobs]
    mixed = [s.result(timeout=120) for s in streams]
    assert all(o.finish_reason == "length" and len(o.token_ids) == 8 for o in mixed), mixed
    s = wait_idle(router)
    kv = s["ranks"][0]["kv_memory"]  # the rank reports its quantized cache's memory
    # idle: the only sequences left are ended ones the prefix cache keeps as sources (evicted when pages are needed)
    assert kv["kv_bits"] == 3 and s["ranks"][0]["running"] == 0
    assert kv["kv_sequences"] == s["ranks"][0]["prefix_cache_sources"] <= len(jobs)
    for (p, k), o in zip(jobs, mixed):
        alone = router.submit(p, greedy(kv_profile=k)).result(timeout=120)
        assert alone.token_ids == o.token_ids, (p, k)


def test_http_kv_profile(client):
    r = complete(client, kv_profile="code")
    assert r.status_code == 200, r.text
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": CODE}], "max_tokens": 3,
                                                   "temperature": 0, "kv_profile": "auto"})
    assert r.status_code == 200, r.text
    assert_400_kv_profile(complete(client, kv_profile="nope"), "'nope'", "code, prose")
    assert_400_kv_profile(client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "kv_profile": "nope"}), "code, prose")
    assert_400_kv_profile(complete(client, kv_profile="../code"), "letters, digits")
    r = complete(client, kv_profile=5)
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_profile", r.text
    r = complete(client, max_tokens=2)  # the next normal request is served
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text


def test_grpc_kv_profile(stub):
    def gen(**sampling):
        req = pb.GenerateRequest(text=PROSE, sampling=pb.SamplingParams(max_tokens=3, temperature=0.0,
                                                                         ignore_eos=True, **sampling))
        return list(stub.Generate(req, timeout=120))

    assert gen(kv_profile="code")[-1].usage.completion_tokens == 3
    for bad, needle in (("nope", "available: code, prose"), ("a/b", "letters, digits")):
        with pytest.raises(grpc.RpcError) as ei:
            gen(kv_profile=bad)
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert ei.value.details().startswith("kv_profile: ") and needle in ei.value.details(), ei.value.details()
    out = gen()  # the next normal request is served
    assert out[-1].finish_reason == pb.FINISH_REASON_LENGTH and out[-1].usage.completion_tokens == 3


def test_llm_generate_unknown_profile_is_an_error_output(llm):
    bad, good = llm.generate([PROSE, PROSE], [greedy(2, kv_profile="nope"), greedy(2, kv_profile="prose")])
    assert bad.finish_reason == "error" and "kv_profile='nope'" in bad.error
    assert good.finish_reason == "length" and len(good.token_ids) == 2


def test_full_precision_router_refuses_a_named_profile(llm):
    # the router's prompt checks against a full-precision deployment of the same model (no second cluster needed)
    fp = PromptAdmission(llm.router.tokenizer, llm.router.vocab_size,
                         SimpleNamespace(model=DEFAULT_MODEL, max_model_len=256, engine_options={}))
    assert fp.validate(PROSE, greedy(kv_profile="auto"))
    with pytest.raises(InvalidRequestError, match="needs a quantized KV cache") as ei:
        fp.validate(PROSE, greedy(kv_profile="prose"))
    assert ei.value.field == "kv_profile"
    misses = served_kv_profiles.cache_info().misses
    for _ in range(5):  # the served names are resolved once per deployment, not per request
        llm.router.validate(PROSE, greedy(kv_profile="code"))
    assert served_kv_profiles.cache_info().misses == misses
