"""What real OpenAI clients send, through the HTTP app and the gRPC server over a fake router (no Ray): batch prompts
in every form, JSON nulls meaning the default, `max_completion_tokens`, `n` / `best_of` limits, GET /v1/models/{id}
and 404 `model_not_found`, and the `frontend` label of the request counters. The fake router records the
SamplingParams each choice is submitted with and answers with tokens computed from the prompt, so the expected
choices are known exactly. The openai SDK is the client where it is installed."""
from __future__ import annotations

import json
from types import SimpleNamespace

import grpc
import pytest
from fastapi.testclient import TestClient
from prometheus_client import generate_latest
from tokenizers import Tokenizer

from actors.engine.messages import TokenOutput
from actors.engine.sampling import SamplingParams
from router_service.chat_template import DEFAULT_CHAT_TEMPLATE, ChatTemplate
from router_service.http.app import create_app
from router_service.stream import RequestStream
from tests.router_service.test_metrics import samples

MODEL = "fake-moe"


class FakeRouter:
    """The slice of `Router` the front doors use. A request's output is `max_tokens` tokens, token k being
    (last prompt id + 1 + k + seed) % 200 (seed 0 if unset), one output per token, the last with finish `length`."""

    def __init__(self, model_dir: str):
        self.tokenizer = Tokenizer.from_file(f"{model_dir}/tokenizer.json")
        self.cfg = SimpleNamespace(model=model_dir, max_model_len=256, ranks=1)
        self.vocab_size, self.max_queue, self.in_flight = 320, 64, 0
        self.submitted: list[tuple] = []  # (prompt, params, request_id)
        self.streams: dict[str, RequestStream] = {}
        self.submit_is_quick = True  # outputs are pushed in `submit`: the small-body path runs on the loop

    def encode(self, text: str, field: str = "prompt") -> list[int]:
        return self.tokenizer.encode(text).ids

    def tokens(self, prompt, params: SamplingParams) -> list[int]:
        ids = self.encode(prompt) if isinstance(prompt, str) else prompt
        return [(ids[-1] + 1 + k + (params.seed or 0)) % 200 for k in range(params.max_tokens)]

    def submit(self, prompt, params: SamplingParams, request_id: str) -> RequestStream:
        self.submitted.append((prompt, params, request_id))
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        s = self.streams[request_id] = RequestStream(self, request_id, prompt, 0, len(ids), len(ids) + params.max_tokens)
        toks = self.tokens(prompt, params)
        for k, t in enumerate(toks):
            s._push(TokenOutput(request_id=request_id, token_ids=[t], text=self.tokenizer.decode([t]),
                                finish_reason="length" if k == len(toks) - 1 else None))
        return s

    def abort(self, request_id: str) -> None:
        pass

    def get_stream(self, request_id: str):
        return self.streams.get(request_id)

    def health(self) -> dict:
        return {"ok": True, "status": "ok", "ranks": [{"rank": 0, "ok": True}]}

    def stats(self) -> dict:
        return {"running": 0, "waiting": 0, "kv_blocks_total": 1, "kv_blocks_free": 1, "in_flight": 0}


@pytest.fixture
def router(tiny_moe_dir):
    return FakeRouter(tiny_moe_dir)


@pytest.fixture
def client(router):
    with TestClient(create_app(router, model_name=MODEL, chat_template=ChatTemplate(DEFAULT_CHAT_TEMPLATE))) as c:
        yield c


def sdk(client):
    openai = pytest.importorskip("openai")
    return openai, openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=client, max_retries=0)


def sse(resp) -> list:
    return [json.loads(ln[6:]) for ln in resp.iter_lines() if ln.startswith("data: ") and ln != "data: [DONE]"]


def expected(router: FakeRouter, prompts: list, n: int, max_tokens: int, seed: int) -> list[str]:
    """Choice texts in OpenAI's order: choice i * n + j is the j-th of prompt i (seed offset by j)."""
    dec = router.tokenizer.decode
    return [dec(router.tokens(p, SamplingParams(max_tokens=max_tokens, seed=seed + j))) for p in prompts for j in range(n)]


# ------------------------------------------------------------------------------------------------ batch prompts
@pytest.mark.parametrize("prompt, prompts", [
    ("To be, or not to be", ["To be, or not to be"]),
    (["To be", "def add(a, b):", "x"], ["To be", "def add(a, b):", "x"]),
    ([5, 6, 7], [[5, 6, 7]]),
    ([[5, 6, 7], [9], [11, 12]], [[5, 6, 7], [9], [11, 12]]),
])
def test_batch_prompt_forms(client, router, prompt, prompts):
    body = {"model": MODEL, "prompt": prompt, "n": 2, "max_tokens": 3, "seed": 10}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    d = r.json()
    want = expected(router, prompts, 2, 3, 10)
    assert [c["index"] for c in d["choices"]] == list(range(len(want)))
    assert [c["text"] for c in d["choices"]] == want
    assert [p for p, _, _ in router.submitted] == [p for p in prompts for _ in range(2)]
    ptoks = sum(len(router.encode(p)) if isinstance(p, str) else len(p) for p in prompts)  # each prompt once
    assert d["usage"] == {"prompt_tokens": ptoks, "completion_tokens": 3 * len(want), "total_tokens": ptoks + 3 * len(want)}
    # streamed: the same choices by index, and the same usage
    with client.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                        "stream_options": {"include_usage": True}}) as resp:
        ev = sse(resp)
    texts = [""] * len(want)
    for e in ev[:-1]:
        (c,) = e["choices"]
        texts[c["index"]] += c["text"]
    assert texts == want and ev[-1]["choices"] == [] and ev[-1]["usage"] == d["usage"]


@pytest.mark.parametrize("prompt, says", [
    ("", "prompt is empty"),
    ([], "empty list"),
    ([[]], "token-id list 0 of the batch is empty"),
    ([[1], []], "token-id list 1 of the batch is empty"),
    (["a", ""], "text 1 of the batch is empty"),
    ([1, "a"], "one form, not mixed"),
    ([[1], "a"], "one form, not mixed"),
    ([1.5], "a list of float"),
    ([True], "a list of bool"),
    ([[1, True]], "holds True"),
    ([-1], "holds -1"),
    ([[3, -2]], "holds -2"),
    ([["a"]], "holds 'a'"),
    ({"text": "a"}, "got dict"),
    (7, "got int"),
    (None, "Field required"),
    (["a"] * 257, "at most 256"),
])
def test_bad_prompt_400_names_prompt(client, router, prompt, says):
    r = client.post("/v1/completions", json={"prompt": prompt})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "prompt" and says in err["message"], err
    assert not router.submitted


def test_sdk_batch_of_token_lists(client, router):
    _, oa = sdk(client)
    prompts = [[5, 6, 7], [40, 41]]
    out = oa.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=4, seed=1)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.text for c in out.choices] == expected(router, prompts, 2, 4, 1)
    assert out.usage.prompt_tokens == 5 and out.usage.completion_tokens == 16
    chunks = list(oa.completions.create(model=MODEL, prompt=prompts, max_tokens=2, stream=True))
    got = {}
    for ch in chunks:
        got[ch.choices[0].index] = got.get(ch.choices[0].index, "") + ch.choices[0].text
    assert got == dict(enumerate(expected(router, prompts, 1, 2, 0)))


# ------------------------------------------------------------------------------------------------ nulls
COMMON_NULLS = ["model", "max_tokens", "temperature", "top_p", "top_k", "n", "stream", "stream_options", "stop",
                "stop_token_ids", "seed", "ignore_eos", "gating", "kv_profile", "presence_penalty",
                "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "logprobs", "user"]


def test_nulls_mean_the_default_completions(client, router):
    body = {"prompt": "hello", **{k: None for k in COMMON_NULLS + ["echo", "suffix", "best_of"]}}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text  # `stream: null` is no stream: one JSON body
    d = r.json()
    assert d["object"] == "text_completion" and len(d["choices"]) == 1
    ((_, params, _),) = router.submitted
    assert params == SamplingParams(max_tokens=16)  # the defaults (16: OpenAI's max_tokens for completions)
    r = client.post("/v1/completions", json={"prompt": "hi", "stream": True, "stream_options": {"include_usage": None}})
    assert r.status_code == 200 and "usage" not in r.text


def test_nulls_mean_the_default_chat(client, router):
    body = {"messages": [{"role": "user", "content": "hi", "name": None}],
            **{k: None for k in COMMON_NULLS + ["max_completion_tokens"]}}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "chat.completion"
    ((prompt, params, _),) = router.submitted
    assert params == SamplingParams(max_tokens=256 - len(prompt))  # the rest of the context window


def test_stream_null_is_not_an_error_about_another_field(client):
    r = client.post("/v1/completions", json={"prompt": "hi", "stream": None, "max_tokens": 2})
    assert r.status_code == 200, r.text
    r = client.post("/v1/completions", json={"prompt": "hi", "stream": "yes please"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream"


def test_sdk_sends_nulls(client, router):
    _, oa = sdk(client)
    out = oa.completions.create(model=MODEL, prompt="hi", max_tokens=None, temperature=None, top_p=None,
                                presence_penalty=None, frequency_penalty=None, stop=None, seed=None, n=None,
                                stream=None, logprobs=None, best_of=None, user=None)
    assert len(out.choices) == 1
    msg = oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=None,
                                     top_p=None, max_tokens=None, max_completion_tokens=None, n=None, stop=None,
                                     seed=None, stream=None, presence_penalty=None, frequency_penalty=None)
    assert msg.choices[0].message.role == "assistant"
    assert [p.temperature for _, p, _ in router.submitted] == [1.0, 1.0]
    assert router.submitted[0][1] == SamplingParams(max_tokens=16)


# ------------------------------------------------------------------------------------------------ limits
def test_max_completion_tokens_wins(client, router):
    msgs = [{"role": "user", "content": "hi"}]
    for body, want in (({"max_completion_tokens": 3}, 3), ({"max_tokens": 5, "max_completion_tokens": 3}, 3),
                       ({"max_tokens": 5}, 5)):
        r = client.post("/v1/chat/completions", json={"messages": msgs, **body})
        assert r.status_code == 200, r.text
        assert router.submitted[-1][1].max_tokens == want and r.json()["usage"]["completion_tokens"] == want
    for field in ("max_completion_tokens", "max_tokens"):
        r = client.post("/v1/chat/completions", json={"messages": msgs, field: 300})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == field and "context window" in err["message"], err


@pytest.mark.parametrize("body, field, says", [
    ({"n": 9}, "n", "1 to 8"),
    ({"n": 0}, "n", "1 to 8"),
    ({"n": 2, "best_of": 3}, "best_of", "must equal n=2"),
])
def test_n_and_best_of_state_the_limit(client, body, field, says):
    r = client.post("/v1/completions", json={"prompt": "hi", **body})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == field and says in err["message"], err


# ------------------------------------------------------------------------------------------------ models
def test_models_retrieve_and_404(client, router):
    r = client.get(f"/v1/models/{MODEL}")
    assert r.status_code == 200 and r.json()["id"] == MODEL and r.json()["max_model_len"] == 256
    r = client.get("/v1/models/gpt-4o")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        r = client.post(path, json={**body, "model": "gpt-4o"})
        err = r.json()["error"]
        assert r.status_code == 404 and err["code"] == "model_not_found" and err["param"] == "model", err
        assert "'gpt-4o' is not served" in err["message"]
    assert not router.submitted


def test_sdk_models_retrieve(client):
    openai, oa = sdk(client)
    assert oa.models.retrieve(MODEL).id == MODEL
    assert [m.id for m in oa.models.list()] == [MODEL]
    with pytest.raises(openai.NotFoundError) as ei:
        oa.models.retrieve("nope")
    assert ei.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        oa.completions.create(model="nope", prompt="hi")


# ------------------------------------------------------------------------------------------------ metrics
def test_request_counters_by_front_door(client, router):
    from router_service.grpc.server import start_grpc_server
    from router_service.proto.moeray.v1 import moeray_pb2 as pb
    from router_service.proto.moeray.v1 import moeray_pb2_grpc as pb_grpc

    m = client.app.state.server.metrics
    assert client.post("/v1/completions", json={"prompt": [[5, 6, 7], [9]], "max_tokens": 2}).status_code == 200
    assert client.post("/v1/completions", json={"prompt": "hi", "n": 9}).status_code == 400
    assert client.post("/v1/completions", json={"prompt": "hi", "model": "x"}).status_code == 404
    srv = start_grpc_server(router, port=0, model_name=MODEL, api_key="k", metrics=m)
    key = (("authorization", "Bearer k"),)
    try:
        with grpc.insecure_channel(srv.address) as ch:
            stub = pb_grpc.MoerayStub(ch)
            out = list(stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3, 4]),
                                                        sampling=pb.SamplingParams(max_tokens=3)), metadata=key))
            assert out[-1].usage.completion_tokens == 3
            for req, md, code in ((pb.GenerateRequest(text="hi", model="x"), key, grpc.StatusCode.NOT_FOUND),
                                  (pb.GenerateRequest(text="hi"), (), grpc.StatusCode.UNAUTHENTICATED)):
                with pytest.raises(grpc.RpcError) as ei:
                    list(stub.Generate(req, metadata=md))
                assert ei.value.code() == code
    finally:
        srv.stop(0)
    s = samples(generate_latest(m.registry).decode())

    def v(name, **labels):
        return s[name].get(tuple(sorted(labels.items())), 0)

    assert v("moeray_requests_total", frontend="http", endpoint="/v1/completions", code="200") == 1
    assert v("moeray_requests_total", frontend="http", endpoint="/v1/completions", code="400") == 1
    assert v("moeray_requests_total", frontend="http", endpoint="/v1/completions", code="404") == 1
    assert v("moeray_rejections_total", frontend="http", reason="invalid") == 1
    assert v("moeray_rejections_total", frontend="http", reason="model_not_found") == 1
    assert v("moeray_prompt_tokens_total", frontend="http") == 4
    assert v("moeray_generated_tokens_total", frontend="http") == 4
    assert v("moeray_requests_total", frontend="grpc", endpoint="Generate", code="OK") == 1
    assert v("moeray_requests_total", frontend="grpc", endpoint="Generate", code="NOT_FOUND") == 1
    assert v("moeray_requests_total", frontend="grpc", endpoint="Generate", code="UNAUTHENTICATED") == 1
    assert v("moeray_rejections_total", frontend="grpc", reason="model_not_found") == 1
    assert v("moeray_rejections_total", frontend="grpc", reason="unauthorized") == 1
    assert v("moeray_prompt_tokens_total", frontend="grpc") == 4
    assert v("moeray_generated_tokens_total", frontend="grpc") == 3


@pytest.mark.parametrize("quick", [True, False])
def test_small_bodies_on_the_loop_and_the_rest_off_it(client, router, monkeypatch, quick):
    """A small body is submitted on the event loop while the router's submit is quick (no rank round trip); a
    large one, or any body while submit may wait on a rank, goes through the executor. Same answer either way."""
    import asyncio

    import router_service.http.serving as serving

    on_loop, real = [], router.submit

    def submit(*a, **kw):
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:  # an executor thread
            on_loop.append(False)
        return real(*a, **kw)

    router.submit_is_quick = quick
    monkeypatch.setattr(router, "submit", submit)
    small = client.post("/v1/completions", json={"prompt": [5, 6, 5], "max_tokens": 3})
    big = client.post("/v1/completions", json={"prompt": [6] * serving.INLINE_BODY_BYTES + [5], "max_tokens": 3})
    assert small.status_code == big.status_code == 200
    assert small.json()["choices"][0]["text"] == big.json()["choices"][0]["text"]  # both end in id 5
    assert on_loop == [quick, False]


def test_bodies_over_the_limit_get_413_unparsed(router):
    """A body over `max_body_bytes` gets 413 with the OpenAI error body, before any parsing or tokenizing: with a
    Content-Length (answered unread) and chunked (refused once the count passes the limit); others go on."""
    with TestClient(create_app(router, model_name=MODEL, max_body_bytes=1000)) as c:
        r = c.post("/v1/completions", json={"prompt": "a" * 2000, "max_tokens": 2})
        assert r.status_code == 413 and r.json()["error"]["param"] == "body" and "1000 bytes" in r.json()["error"]["message"]
        chunks = (b" " * 400 for _ in range(5))  # no Content-Length: chunked
        r = c.post("/v1/completions", content=chunks, headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == 413
        assert router.submitted == []  # nothing reached the router
        assert c.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2}).status_code == 200
        metrics = c.get("/metrics").text
    assert 'moeray_rejections_total{frontend="http",reason="too_large"} 2.0' in metrics


@pytest.mark.parametrize("field,value", [("min_p", 0.1), ("guided_json", {"type": "object"}),
                                         ("functions", [{"name": "f"}])])
def test_output_changing_fields_not_implemented_get_400(client, router, field, value):
    """A field that would change the output is never accepted and ignored: until it is implemented, any value
    but the no-op one is a 400 naming it; the no-op values and null pass."""
    for path, body in (("/v1/completions", {"prompt": "ab"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        r = client.post(path, json={**body, "max_tokens": 2, field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field and "not supported yet" in r.text
        assert client.post(path, json={**body, "max_tokens": 2, field: None}).status_code == 200
    assert router.submitted and all(p is not None for p, _, _ in router.submitted)
    noop = {"min_p": 0.0, "functions": []}
    if field in noop:
        assert client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2, field: noop[field]}).status_code == 200


class SilentRouter(FakeRouter):
    """Requests that never produce an output (a rank that stopped answering)."""

    def __init__(self, model_dir):
        super().__init__(model_dir)
        self.aborted: list[str] = []

    def submit(self, prompt, params, request_id):
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        s = self.streams[request_id] = RequestStream(self, request_id, prompt, 0, len(ids), len(ids) + params.max_tokens)
        return s

    def abort(self, request_id):
        self.aborted.append(request_id)


def test_a_request_past_the_timeout_gets_504_and_is_aborted(tiny_moe_dir):
    router = SilentRouter(tiny_moe_dir)
    with TestClient(create_app(router, model_name=MODEL, request_timeout_s=0.2)) as c:
        r = c.post("/v1/completions", json={"prompt": "ab", "max_tokens": 4})
        assert r.status_code == 504 and r.json()["error"]["type"] == "timeout_error"
        assert "request timeout of 0.2 s" in r.json()["error"]["message"]
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "stream": True})
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert r.status_code == 200 and json.loads(events[-2])["error"]["code"] == 504 and events[-1] == "[DONE]"
    assert len(router.aborted) == 2  # both stopped on their ranks
    with pytest.raises(ValueError, match="request_timeout_s=0"):
        create_app(router, request_timeout_s=0)


# ------------------------------------------------------------------------------------------------ gRPC n
def test_grpc_n_is_prompt_major_with_http_limits(router):
    from router_service.grpc.server import start_grpc_server
    from router_service.proto.moeray.v1 import moeray_pb2 as pb
    from router_service.proto.moeray.v1 import moeray_pb2_grpc as pb_grpc

    prompts = [[5, 6, 7], [9]]
    srv = start_grpc_server(router, port=0, model_name=MODEL)
    try:
        with grpc.insecure_channel(srv.address) as ch:
            stub = pb_grpc.MoerayStub(ch)
            batch = pb.PromptBatch(prompts=[pb.Prompt(token_ids=pb.TokenIds(ids=p)) for p in prompts])
            resps = list(stub.Generate(pb.GenerateRequest(request_id="q", batch=batch, sampling=pb.SamplingParams(
                max_tokens=3, seed=4, n=3))))
            texts = {}
            for r in resps:
                assert r.request_id == f"q-{r.index}"
                texts[r.index] = texts.get(r.index, "") + r.text
            assert [texts[i] for i in range(6)] == expected(router, prompts, n=3, max_tokens=3, seed=4)
            assert [rid for _, _, rid in router.submitted] == [f"q-{i}" for i in range(6)]
            one = list(stub.Generate(pb.GenerateRequest(request_id="s", text="hi", sampling=pb.SamplingParams(
                max_tokens=2, n=2))))
            assert {(r.index, r.request_id) for r in one} == {(0, "s-0"), (1, "s-1")}
            for n in (0, 9):
                with pytest.raises(grpc.RpcError) as ei:
                    list(stub.Generate(pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(n=n))))
                assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert ei.value.details() == f"n: n={n} is out of range: 1 to 8 choices per prompt (moeray's limit)"
    finally:
        srv.stop(0)


def test_chat_tools_reach_the_template(client, router):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "forecast",
                                               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                  "tools": tools, "tool_choice": "none"})
    assert r.status_code == 200, r.text
    prompt = router.tokenizer.decode(router.submitted[-1][0], skip_special_tokens=False)
    assert prompt == ('System: Tools:\n- get_weather: forecast; parameters: {"type": "object", "properties": '
                      '{"city": {"type": "string"}}}\nUser: hi\nAssistant:')
