"""Logit controls through HTTP (`presence_penalty`, `frequency_penalty`, `repetition_penalty`, `logit_bias`,
`min_tokens`) with the openai SDK over a real uvicorn server on the shipped model (one in-process engine, the
`EngineRouter` of test_http_logprobs): the greedy output equals a greedy loop over transformers' logits with
transformers' logits processors (tests.actors.engine.test_penalties._reference); bad values are 400 naming the
field, on both endpoints."""
from __future__ import annotations

import socket
import threading
import time

import pytest
import torch
from fastapi.testclient import TestClient

from router_service.http.app import create_app
from tests.actors.engine.test_chunked_prefill import _engine
from tests.actors.engine.test_penalties import _reference
from tests.conftest import SHIPPED
from tests.router_service.test_http_logprobs import EngineRouter

PROMPT = "ROMEO. O, she doth teach the torches to burn bright! It seems"
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def router():
    r = EngineRouter(_engine(max_batched_tokens=16))
    yield r
    r.close()


@pytest.fixture(scope="module")
def client(router):
    with TestClient(create_app(router)) as c:
        yield c


def _hf_greedy(ids: list[int], n: int, p) -> list[int]:
    from tests.tiny_models import load_hf

    hf = load_hf(SHIPPED)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            x = hf(torch.tensor([ids + out])).logits[0, -1].float()
            out.append(int(_reference(x, p, ids, out, {0}).argmax()))
    return out


def test_openai_sdk_penalties_equal_transformers_processors(router):
    openai = pytest.importorskip("openai")
    import uvicorn

    from actors.engine.sampling import SamplingParams

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(router), host="127.0.0.1", log_level="warning"))
    th = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    ids = router.tokenizer.encode(PROMPT).ids
    plain_ids = _hf_greedy(ids, 10, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    # the plain greedy's second token pushed out, so the controls must change the text (the shipped model's
    # continuation of this prompt is confident enough that the penalties alone do not)
    bias = {ids[2]: 4.0, ids[5]: -3.0, plain_ids[1]: -100.0}
    p = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, presence_penalty=0.8, frequency_penalty=0.6,
                       repetition_penalty=1.4, logit_bias=bias, min_tokens=4)
    want = router.tokenizer.decode(_hf_greedy(ids, 10, p))
    try:
        deadline = time.monotonic() + 20
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        cl = openai.OpenAI(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}/v1", api_key="none", max_retries=0)
        c = cl.completions.create(model="tiny-moe", prompt=PROMPT, max_tokens=10, temperature=0, presence_penalty=0.8,
                                  frequency_penalty=0.6, logit_bias={str(k): v for k, v in bias.items()},
                                  extra_body={"repetition_penalty": 1.4, "min_tokens": 4, "ignore_eos": True})
        assert c.choices[0].text == want and c.usage.completion_tokens == 10
        plain = cl.completions.create(model="tiny-moe", prompt=PROMPT, max_tokens=10, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert plain.choices[0].text != want  # the controls changed the output (else this test could not fail)
        ch = cl.chat.completions.create(model="tiny-moe", messages=CHAT["messages"], max_completion_tokens=8,
                                        temperature=0, logit_bias={"0": 100}, extra_body={"min_tokens": 3})
        assert ch.usage.completion_tokens == 3 and ch.choices[0].finish_reason == "stop"  # EOS right after 3
        with pytest.raises(openai.BadRequestError) as ei:
            cl.chat.completions.create(model="tiny-moe", messages=CHAT["messages"], max_tokens=2,
                                       logit_bias={str(router.vocab_size): 1})
        assert ei.value.body["param"] == "logit_bias"
    finally:
        server.should_exit = True
        th.join(10)


@pytest.mark.parametrize("extra,field", [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"min_tokens": 3}, "min_tokens"),
    ({"min_tokens": -1}, "min_tokens"), ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"five": 1}}, "logit_bias"), ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ({"logit_bias": {"999999": 1}}, "logit_bias")])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_bad_controls_are_400_naming_the_field(client, path, extra, field):
    body = {"prompt": PROMPT} if "chat" not in path else CHAT
    r = client.post(path, json={**body, "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"], err


def test_grpc_controls_equal_transformers_processors(router):
    import grpc

    from actors.engine.sampling import SamplingParams
    from router_service.grpc.server import start_grpc_server
    from router_service.proto.moeray.v1 import moeray_pb2 as pb
    from router_service.proto.moeray.v1 import moeray_pb2_grpc as pb_grpc

    ids = router.tokenizer.encode(PROMPT).ids
    bias = {ids[1]: 6.0, 0: 100.0}
    p = SamplingParams(temperature=0, max_tokens=6, presence_penalty=-0.5, frequency_penalty=1.1,
                       repetition_penalty=0.8, logit_bias=bias, min_tokens=5)
    want = _hf_greedy(ids, 5, p)  # then EOS (biased +100) ends it: 5 tokens, "stop"
    srv = start_grpc_server(router, host="127.0.0.1", port=0)
    ch = grpc.insecure_channel(srv.address)
    try:
        stub = pb_grpc.MoerayStub(ch)
        sp = pb.SamplingParams(temperature=0, max_tokens=6, presence_penalty=-0.5, frequency_penalty=1.1,
                               repetition_penalty=0.8, logit_bias=bias, min_tokens=5)
        resps = list(stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=sp), timeout=60))
        assert [t for r in resps for t in r.token_ids] == want
        assert resps[-1].finish_reason == pb.FINISH_REASON_STOP
        for bad, field in ((pb.SamplingParams(logit_bias={router.vocab_size: 1.0}), "logit_bias"),
                           (pb.SamplingParams(max_tokens=2, min_tokens=3), "min_tokens"),
                           (pb.SamplingParams(presence_penalty=2.5), "presence_penalty")):
            with pytest.raises(grpc.RpcError) as ei:
                list(stub.Generate(pb.GenerateRequest(text=PROMPT, sampling=bad), timeout=60))
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and ei.value.details().startswith(field)
    finally:
        ch.close()
        srv.stop()
