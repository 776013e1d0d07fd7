"""Structured output through HTTP on the shipped model (one in-process engine, the `EngineRouter` of
test_http_logprobs), the openai SDK as the client over a real uvicorn server: `response_format` json_schema on both
endpoints (10 outputs sampled at temperature 1, max_tokens 256: every one ends with "stop" and validates with
jsonschema; a truncated output fails), streamed too; json_object; tool calls for a named function and for
"required"; and the 400s that name `response_format`, `tools`, `tool_choice`, `stream` before anything reaches
the engine."""
from __future__ import annotations

import json
import socket
import threading
import time

import jsonschema
import pytest
from fastapi.testclient import TestClient

from router_service.http.app import create_app
from tests.actors.engine.test_chunked_prefill import _engine
from tests.router_service.test_http_logprobs import EngineRouter

MSGS = [{"role": "user", "content": "Describe a person in JSON."}]
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["admin", "user", "guest"]}, "active": {"type": "boolean"}},
    "required": ["name", "age", "role", "active"], "additionalProperties": False}
ORDER = {"type": "object", "properties": {
    "id": {"type": "string", "pattern": "^[a-z0-9]{1,8}$"},
    "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "object", "properties": {
        "sku": {"type": "integer", "minimum": 1, "maximum": 9999}, "gift": {"type": "boolean"}},
        "required": ["sku", "gift"], "additionalProperties": False}}},
    "required": ["id", "items"], "additionalProperties": False}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "ping"}}]  # no parameters: arguments must be {}
NO_ARGS = {"type": "object", "properties": {}, "additionalProperties": False}


@pytest.fixture(scope="module")
def router():
    r = EngineRouter(_engine(max_num_seqs=8))
    yield r
    r.close()


@pytest.fixture(scope="module")
def client(router):
    with TestClient(create_app(router)) as c:
        yield c


@pytest.fixture(scope="module")
def sdk(router):
    openai = pytest.importorskip("openai")
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(router), host="127.0.0.1", log_level="warning"))
    th = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}/v1", api_key="none", max_retries=0)
    server.should_exit = True
    th.join(10)


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def test_sdk_sampled_outputs_end_with_stop_and_follow_their_schema(sdk):
    chat = sdk.chat.completions.create(model="tiny-moe", messages=MSGS, n=5, temperature=1.0, seed=7, max_tokens=256,
                                       response_format=_schema_format(PERSON))
    comp = sdk.completions.create(model="tiny-moe", prompt="order = ", n=5, temperature=1.0, seed=11, max_tokens=256,
                                  extra_body={"response_format": _schema_format(ORDER)})
    outs = [(c.message.content, c.finish_reason, PERSON) for c in chat.choices] + \
           [(c.text, c.finish_reason, ORDER) for c in comp.choices]
    assert len(outs) == 10
    for text, reason, schema in outs:
        assert reason == "stop", (reason, text)  # a truncated output ("length") is a failure
        jsonschema.validate(json.loads(text), schema)
    assert len({t for t, _, _ in outs}) >= 8  # sampled: different outputs
    stream = sdk.chat.completions.create(model="tiny-moe", messages=MSGS, temperature=1.0, seed=3, max_tokens=256,
                                         response_format=_schema_format(PERSON), stream=True)
    parts, reasons = [], []
    for ev in stream:
        parts.append(ev.choices[0].delta.content or "")
        reasons.append(ev.choices[0].finish_reason)
    assert reasons[-1] == "stop"
    jsonschema.validate(json.loads("".join(parts)), PERSON)


def test_sdk_tool_calls_follow_the_function_schema(sdk):
    named = sdk.chat.completions.create(model="tiny-moe", messages=MSGS, n=3, temperature=1.0, seed=5, max_tokens=256,
                                        tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    required = sdk.chat.completions.create(model="tiny-moe", messages=MSGS, n=4, temperature=1.0, seed=9,
                                           max_tokens=256, tools=TOOLS, tool_choice="required")
    schemas = {"get_weather": WEATHER, "ping": NO_ARGS}
    for resp, only in ((named, "get_weather"), (required, None)):
        for c in resp.choices:
            assert c.finish_reason == "tool_calls" and c.message.content is None
            (call,) = c.message.tool_calls
            assert call.type == "function" and call.id.startswith("call_")
            assert call.function.name == only if only else call.function.name in schemas
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_a_named_call_cut_short_is_still_the_call(sdk):
    r = sdk.chat.completions.create(model="tiny-moe", messages=MSGS, temperature=0, max_tokens=3, tools=TOOLS,
                                    tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (c,) = r.choices
    assert c.finish_reason == "length" and c.message.content is None and r.usage.completion_tokens == 3
    (call,) = c.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments.startswith("{")  # partial arguments


JSON_LINES = '{"a": 1}\n{"b": 2}\n'


def test_json_object_gives_an_object(client):
    # JSON lines as the prompt: greedy on the shipped model closes the object (after `return ` it loops in a key)
    r = client.post("/v1/completions", json={"prompt": JSON_LINES, "max_tokens": 256, "temperature": 0,
                                             "response_format": {"type": "json_object"}}).json()
    (c,) = r["choices"]
    assert c["finish_reason"] == "stop" and isinstance(json.loads(c["text"]), dict)


CHAT, COMP = "/v1/chat/completions", "/v1/completions"
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("path,extra,param,words", [
    (CHAT, {"response_format": _schema_format({"type": "nosuchtype"})}, "response_format", "does not compile"),
    (COMP, {"response_format": _schema_format({"type": "string", "pattern": "(("})}, "response_format", "regex"),
    (CHAT, {"response_format": {"type": "json_schema"}}, "response_format", "needs json_schema"),
    (CHAT, {"response_format": {"type": "xml"}}, "response_format.type", "json_object"),
    (CHAT, {"tools": TOOLS}, "tool_choice", "no tool-call parser"),
    (CHAT, {"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "no tool-call parser"),
    (CHAT, {"tool_choice": "required"}, "tool_choice", "needs tools"),
    (CHAT, {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not among the tools"),
    (CHAT, {"tools": TOOLS + TOOLS[:1], "tool_choice": "required"}, "tools", "distinct"),
    (CHAT, {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nosuchtype"}}}],
            "tool_choice": "required"}, "tools", "does not compile"),
    (CHAT, {"tools": TOOLS, "tool_choice": NAMED, "stream": True}, "stream", "not streamed"),
    (CHAT, {"tools": TOOLS, "tool_choice": NAMED, "response_format": {"type": "json_object"}}, "response_format",
     "tool call"),
    (COMP, {"tools": TOOLS, "tool_choice": "required"}, "tools", "chat/completions"),
    (COMP, {"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos", "grammar"),
    (CHAT, {"response_format": {"type": "json_object"}, "min_tokens": 2}, "min_tokens", "grammar"),
])
def test_structured_output_refusals_name_the_field(client, router, path, extra, param, words):
    body = {"messages": MSGS} if path == CHAT else {"prompt": "hi"}
    before = len(router.streams)
    r = client.post(path, json={**body, "max_tokens": 8, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    assert len(router.streams) == before  # refused before anything reached the engine


def test_noop_values_pass(client):
    for extra in ({"response_format": {"type": "text"}}, {"tools": TOOLS, "tool_choice": "none"}, {"tools": []},
                  {"response_format": None, "tools": None, "tool_choice": None}):
        r = client.post(CHAT, json={"messages": MSGS, "max_tokens": 2, "temperature": 0, **extra})
        assert r.status_code == 200 and isinstance(r.json()["choices"][0]["message"]["content"], str), r.text


def test_admission_checks_a_grammar_from_any_front_door(router):
    """A grammar handed to the router directly (the Python API, a Serve handle) is checked at admission too."""
    from actors.engine.grammar import json_schema_grammar
    from actors.engine.sampling import SamplingParams
    from router_service.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="Invalid type") as e:
        router.validate("hi", SamplingParams(max_tokens=4, grammar=json_schema_grammar({"type": "nosuchtype"})))
    assert e.value.field == "grammar"
    assert router.validate("hi", SamplingParams(max_tokens=4, grammar=json_schema_grammar(PERSON)))


# ------------------------------------------------------------------------------------------------ over gRPC
@pytest.fixture(scope="module")
def grpc_stub(router):
    import grpc

    from router_service.grpc.server import start_grpc_server
    from router_service.proto.moeray.v1 import moeray_pb2_grpc as pb_grpc

    srv = start_grpc_server(router, host="127.0.0.1", port=0)
    ch = grpc.insecure_channel(srv.address)
    yield pb_grpc.MoerayStub(ch)
    ch.close()
    srv.stop(0)


def _outputs(resps) -> dict[int, tuple[str, int]]:
    """Per output index: (its text, its finish reason)."""
    texts: dict[int, list[str]] = {}
    reasons = {}
    for r in resps:
        texts.setdefault(r.index, []).append(r.text)
        if r.finish_reason:
            reasons[r.index] = r.finish_reason
    return {i: ("".join(t), reasons.get(i)) for i, t in texts.items()}


def test_grpc_json_schema_and_json_object(grpc_stub):
    from router_service.proto.moeray.v1 import moeray_pb2 as pb

    req = pb.GenerateRequest(text="order = ", sampling=pb.SamplingParams(
        temperature=1.0, seed=13, max_tokens=256, n=4, json_schema=json.dumps(ORDER)))
    outs = _outputs(grpc_stub.Generate(req, timeout=120))
    assert sorted(outs) == [0, 1, 2, 3]
    for text, reason in outs.values():
        assert reason == pb.FINISH_REASON_STOP, (reason, text)  # a truncated output is a failure
        jsonschema.validate(json.loads(text), ORDER)
    assert len({t for t, _ in outs.values()}) >= 3  # sampled: different outputs
    req = pb.GenerateRequest(text=JSON_LINES, sampling=pb.SamplingParams(
        temperature=0.0, max_tokens=256, json_object=True))
    ((text, reason),) = _outputs(grpc_stub.Generate(req, timeout=120)).values()
    assert reason == pb.FINISH_REASON_STOP and isinstance(json.loads(text), dict)


@pytest.mark.parametrize("sampling, field, words", [
    ({"json_schema": json.dumps({"type": "nosuchtype"})}, "json_schema", "does not compile"),
    ({"json_schema": "{not json"}, "json_schema", "not JSON"),
    ({"json_schema": "[1, 2]"}, "json_schema", "must be an object"),
    ({"json_object": True, "ignore_eos": True}, "ignore_eos", "grammar"),
    ({"json_object": True, "min_tokens": 2}, "min_tokens", "grammar"),
])
def test_grpc_bad_structured_output_is_invalid_argument(grpc_stub, router, sampling, field, words):
    import grpc

    from router_service.proto.moeray.v1 import moeray_pb2 as pb

    before = len(router.streams)
    with pytest.raises(grpc.RpcError) as ei:
        list(grpc_stub.Generate(pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=8, **sampling)),
                                timeout=60))
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    d = ei.value.details()
    assert d.startswith(f"{field}: ") and f"{field}: {field}:" not in d and words in d, d  # the field named once
    assert len(router.streams) == before  # refused before anything reached the engine
