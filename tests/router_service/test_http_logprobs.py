"""Logprobs, echo and prompt logprobs through the HTTP app (completions and chat, JSON and SSE, and the openai SDK
over a real uvicorn server), on the shipped model, against transformers' log_softmax of its fp32 logits (< 1e-4).

No Ray: the app runs over `EngineRouter`, a router whose one rank is an in-process `RankEngine` stepped by a
thread; its outputs go through the rank -> router wire format (`encode_outputs` / `decode_outputs`) and the real
`RequestStream`s, as the cluster's do. The 2-rank cluster check is `test_two_ranks_logprobs_equal_transformers`."""
from __future__ import annotations

import itertools
import json
import socket
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from fastapi.testclient import TestClient

from actors.engine.messages import GenerateRequest, decode_outputs, encode_outputs
from cluster.config import DEFAULT_MODEL
from router_service.admission import PromptAdmission
from router_service.http.app import create_app
from router_service.router import Router
from router_service.stream import RequestStream
from tests.actors.engine.test_chunked_prefill import _engine
from tests.conftest import SHIPPED

PROMPT = "ROMEO. O, she doth teach the torches to burn bright! It seems"
TOL = 1e-4


class EngineRouter:
    """The `Router` surface the HTTP app uses, over one in-process engine (validation is the Router's own)."""

    validate = Router.validate
    encode = Router.encode

    def __init__(self, engine):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.vocab_size = engine.model_cfg.vocab_size
        self.cfg = SimpleNamespace(model=DEFAULT_MODEL, max_model_len=engine.cfg.max_model_len, engine_options={},
                                   ranks=1)
        self.admission = PromptAdmission(self.tokenizer, self.vocab_size, self.cfg)
        self.max_prompt_chars = self.admission.max_prompt_chars
        self.submit_is_quick = False  # submit runs in the executor, as the router's actor-call path does
        self.in_flight = 0
        self.max_queue = 64
        self.streams: dict[str, RequestStream] = {}
        self._ids = itertools.count()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def submit(self, prompt, params, request_id=None) -> RequestStream:
        ids = self.validate(prompt, params)
        rid = request_id or f"r{next(self._ids)}"
        s = self.streams[rid] = RequestStream(self, rid, prompt, 0, len(ids), len(ids) + params.max_tokens)
        self.engine.add_request(GenerateRequest(request_id=rid, prompt_ids=ids, params=params.to_dict()))
        return s

    def abort(self, rid: str) -> None:
        self.engine.abort(rid)

    def _loop(self) -> None:
        while not self._stop:
            if not self.engine.has_work:
                time.sleep(0.002)
                continue
            posts: dict = {}
            for o in decode_outputs(encode_outputs(self.engine.step())):
                sent = self.streams[o.request_id]._push(o)
                if sent is not None:
                    posts.setdefault(sent[0], []).append(sent[1])
            for mb, items in posts.items():
                mb.post(items)

    def close(self) -> None:
        self._stop = True
        self._thread.join(5)


@pytest.fixture(scope="module")
def router():
    r = EngineRouter(_engine(max_batched_tokens=16))  # prompts are prefilled in chunks of 16
    yield r
    r.close()


@pytest.fixture(scope="module")
def client(router):
    with TestClient(create_app(router)) as c:
        yield c


@pytest.fixture(scope="module")
def ref_logprobs():
    """ids -> transformers' log_softmax [len(ids), V] (fp32) of the shipped model."""
    from tests.tiny_models import load_hf

    hf = load_hf(SHIPPED)

    def ref(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)

    return ref


def _prompt_ids(router) -> list[int]:
    return router.tokenizer.encode(PROMPT).ids


def _out_ids(router, d: dict, i: int = 0) -> list[int]:
    return router.streams[f"{d['id']}-{i}"].out.token_ids


def _sse(resp) -> list:
    return [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]


def _check_top(top: dict, ref_V: torch.Tensor, texts, k: int, chosen: str) -> float:
    """A completions top_logprobs dict against reference log-probs [V]: the k best (and the chosen) token."""
    tv, ti = ref_V.topk(k)
    want = {texts(int(i)): float(v) for i, v in zip(ti, tv)}
    assert set(want) | {chosen} >= set(top) >= set(want)
    return max(abs(top[t] - v) for t, v in want.items()) if want else 0.0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_completions_echo_logprobs_match_transformers(client, router, ref_logprobs, temperature):
    from router_service.http.logprobs import TokenTexts

    tt = TokenTexts(router.tokenizer)
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 5, "temperature": temperature, "seed": 7,
                                             "ignore_eos": True, "logprobs": 3, "echo": True})
    assert r.status_code == 200, r.text
    d = r.json()
    c = d["choices"][0]
    p_ids, o_ids = _prompt_ids(router), _out_ids(router, d)
    ids = p_ids + o_ids
    ref = ref_logprobs(ids)
    lp = c["logprobs"]
    assert c["text"].startswith(PROMPT) and len(o_ids) == 5
    assert lp["tokens"] == [tt.text(t) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:j]) for j in range(len(ids))]
    worst = 0.0
    for j in range(1, len(ids)):
        worst = max(worst, abs(lp["token_logprobs"][j] - float(ref[j - 1, ids[j]])),
                    _check_top(lp["top_logprobs"][j], ref[j - 1], tt.text, 3, lp["tokens"][j]))
    assert worst < TOL, worst
    if temperature == 0:  # greedy: each output token is the most probable one
        assert all(lp["token_logprobs"][j] == max(lp["top_logprobs"][j].values()) for j in range(len(p_ids), len(ids)))
    # streamed: the same tokens, logprobs and text, the echoed prompt first
    with client.stream("POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 5, "temperature": temperature,
                                                        "seed": 7, "ignore_eos": True, "logprobs": 3, "echo": True,
                                                        "stream": True}) as resp:
        chunks = [e["choices"][0] for e in _sse(resp)]
    assert chunks[0]["text"] == PROMPT and chunks[0]["logprobs"]["tokens"] == lp["tokens"][:len(p_ids)]
    assert "".join(ch["text"] for ch in chunks) == c["text"]
    got = {key: [x for ch in chunks if ch["logprobs"] for x in ch["logprobs"][key]] for key in lp}
    assert got["tokens"] == lp["tokens"] and got["text_offset"] == lp["text_offset"]
    assert [x is None for x in got["token_logprobs"]] == [x is None for x in lp["token_logprobs"]]
    # two runs of one request round apart in the last bits (GEMMs over other batch shapes): compare within TOL
    assert max(abs(a - b) for a, b in zip(got["token_logprobs"][1:], lp["token_logprobs"][1:])) < TOL
    assert all(set(a) == set(b) for a, b in zip(got["top_logprobs"][1:], lp["top_logprobs"][1:]))


def test_echo_max_tokens_zero_token_id_prompt_and_vllm_prompt_logprobs(client, router, ref_logprobs):
    """lm-eval's loglikelihood request: token-id prompt, echo, logprobs, max_tokens 0: the prompt only."""
    ids = _prompt_ids(router)
    ref = ref_logprobs(ids)
    r = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1,
                                             "prompt_logprobs": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    d = r.json()
    c = d["choices"][0]
    assert c["finish_reason"] == "length" and d["usage"]["completion_tokens"] == 0
    assert c["text"] == router.tokenizer.decode(ids, skip_special_tokens=False)
    lp = c["logprobs"]
    assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None
    assert max(abs(lp["token_logprobs"][j] - float(ref[j - 1, ids[j]])) for j in range(1, len(ids))) < TOL
    plp = c["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    for j in range(1, len(ids)):
        e = plp[j]
        assert abs(e[str(ids[j])]["logprob"] - float(ref[j - 1, ids[j]])) < TOL
        assert e[str(ids[j])]["rank"] == int((ref[j - 1] > ref[j - 1, ids[j]]).sum()) + 1
        top = ref[j - 1].topk(2)
        for r_, (v, i) in enumerate(zip(top.values, top.indices), 1):
            assert abs(e[str(int(i))]["logprob"] - float(v)) < TOL
    # without logprobs, echo alone returns the prompt text and no logprobs
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 0, "echo": True})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == PROMPT
    assert r.json()["choices"][0]["logprobs"] is None


def test_chat_logprobs_match_transformers_streamed_too(client, router, ref_logprobs):
    from router_service.http.logprobs import TokenTexts

    tt = TokenTexts(router.tokenizer)
    body = {"messages": [{"role": "user", "content": "Speak, Romeo"}], "max_tokens": 6, "temperature": 0,
            "ignore_eos": True, "logprobs": True, "top_logprobs": 2}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    d = r.json()
    s = router.streams[f"{d['id']}-0"]
    ids = list(s.out.prompt) + s.out.token_ids
    ref = ref_logprobs(ids)
    content = d["choices"][0]["logprobs"]["content"]
    n = len(s.out.prompt)
    assert [x["token"] for x in content] == [tt.text(t) for t in s.out.token_ids]
    for j, x in enumerate(content):
        assert abs(x["logprob"] - float(ref[n - 1 + j, ids[n + j]])) < TOL
        assert bytes(x["bytes"]).decode("utf-8", "replace") == x["token"] and len(x["top_logprobs"]) == 2
        top = ref[n - 1 + j].topk(2)
        assert max(abs(a["logprob"] - float(v)) for a, v in zip(x["top_logprobs"], top.values)) < TOL
        assert x["top_logprobs"][0]["token"] == x["token"]  # greedy
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as resp:
        chunks = [e["choices"][0] for e in _sse(resp)]
    streamed = [x for ch in chunks if ch["logprobs"] for x in ch["logprobs"]["content"]]
    assert [(x["token"], x["bytes"]) for x in streamed] == [(x["token"], x["bytes"]) for x in content]
    assert max(abs(a["logprob"] - b["logprob"]) for a, b in zip(streamed, content)) < TOL
    assert "".join(ch["delta"].get("content") or "" for ch in chunks) == d["choices"][0]["message"]["content"]
    # top_logprobs 0: the token's own logprob, no alternatives
    r = client.post("/v1/chat/completions", json={**body, "top_logprobs": 0})
    assert all(x["top_logprobs"] == [] for x in r.json()["choices"][0]["logprobs"]["content"])
    # no logprobs asked: null, as before
    r = client.post("/v1/chat/completions", json={**body, "logprobs": False, "top_logprobs": None})
    assert r.json()["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("path,extra,field", [
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"logprobs": -1}, "logprobs"),
    ("/v1/completions", {"max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
])
def test_bad_logprob_fields_are_400_naming_the_field(client, path, extra, field):
    body = {"prompt": PROMPT} if "chat" not in path else {"messages": [{"role": "user", "content": "hi"}]}
    r = client.post(path, json={**body, "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"], err


def test_openai_sdk_logprobs(router, ref_logprobs):
    openai = pytest.importorskip("openai")
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(router), host="127.0.0.1", log_level="warning"))
    th = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        cl = openai.OpenAI(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}/v1", api_key="none", max_retries=0)
        ids = _prompt_ids(router)
        ref = ref_logprobs(ids)
        c = cl.completions.create(model="tiny-moe", prompt=ids, max_tokens=1, echo=True, logprobs=2, temperature=0)
        lp = c.choices[0].logprobs
        assert lp.token_logprobs[0] is None and len(lp.tokens) == len(ids) + 1
        assert max(abs(lp.token_logprobs[j] - float(ref[j - 1, ids[j]])) for j in range(1, len(ids))) < TOL
        ch = cl.chat.completions.create(model="tiny-moe", messages=[{"role": "user", "content": "Speak"}],
                                        max_tokens=3, temperature=0, logprobs=True, top_logprobs=3)
        content = ch.choices[0].logprobs.content
        assert len(content) == ch.usage.completion_tokens and all(len(x.top_logprobs) == 3 for x in content)
        assert all(x.logprob == x.top_logprobs[0].logprob for x in content)  # greedy
    finally:
        server.should_exit = True
        th.join(10)


def test_grpc_logprobs_match_transformers(router, ref_logprobs):
    import grpc

    from router_service.grpc.server import start_grpc_server
    from router_service.proto.moeray.v1 import moeray_pb2 as pb
    from router_service.proto.moeray.v1 import moeray_pb2_grpc as pb_grpc

    srv = start_grpc_server(router, host="127.0.0.1", port=0)
    ch = grpc.insecure_channel(srv.address)
    try:
        req = pb.GenerateRequest(text=PROMPT, sampling=pb.SamplingParams(
            temperature=0, max_tokens=3, ignore_eos=True, logprobs=2, prompt_logprobs=1))
        resps = list(pb_grpc.MoerayStub(ch).Generate(req, timeout=60))
        bad = pb.GenerateRequest(text=PROMPT, sampling=pb.SamplingParams(logprobs=21))
        with pytest.raises(grpc.RpcError) as ei:
            list(pb_grpc.MoerayStub(ch).Generate(bad, timeout=60))
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and ei.value.details().startswith("logprobs: ")
    finally:
        ch.close()
        srv.stop()
    ids = _prompt_ids(router)
    out = [t for r in resps for t in r.token_ids]
    ref = ref_logprobs(ids + out)
    lps = [e for r in resps for e in r.logprobs]
    assert [e.token_id for e in lps] == out and all(len(e.top) == 2 and e.rank == 1 for e in lps)
    assert max(abs(e.logprob - float(ref[len(ids) - 1 + j, t])) for j, (e, t) in enumerate(zip(lps, out))) < TOL
    plp = resps[0].prompt_logprobs
    assert [e.token_id for e in plp] == ids[1:] and all(len(e.top) == 1 for e in plp)
    assert max(abs(e.logprob - float(ref[j, ids[j + 1]])) for j, e in enumerate(plp)) < TOL
    assert all(not r.prompt_logprobs for r in resps[1:])


@pytest.mark.ray
def test_two_ranks_logprobs_equal_transformers(ray_session, ref_logprobs):
    """2 ranks (the real cluster, rank actors, the wire): sampled-token and prompt logprobs equal transformers'."""
    from actors.engine.sampling import SamplingParams
    from moeray.api import LLM

    llm = LLM(model=SHIPPED, ranks=2, max_model_len=1024, kv_cache_bytes=4 * 2**20, max_num_seqs=4, max_batched_tokens=16)
    try:
        ids = llm.router.tokenizer.encode(PROMPT).ids
        outs = llm.generate([PROMPT, PROMPT], [
            SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2, prompt_logprobs=2),
            SamplingParams(temperature=1, seed=1, max_tokens=4, ignore_eos=True, logprobs=2)])
    finally:
        llm.shutdown()
    for o in outs:
        full = ids + o.token_ids
        ref = ref_logprobs(full)
        assert len(o.logprobs) == len(o.token_ids) == 4
        assert max(abs(e[0] - float(ref[len(ids) - 1 + j, t])) for j, (e, t) in enumerate(zip(o.logprobs, o.token_ids))) < TOL
    plp = outs[0].prompt_logprobs
    assert plp[0] is None and len(plp) == len(ids)
    assert max(abs(plp[j][0] - float(ref[j - 1, ids[j]])) for j in range(1, len(ids))) < TOL
    assert outs[1].prompt_logprobs is None
