"""OpenAI-style HTTP app over a real 1-rank tiny cluster, through a TestClient (no Serve needed), plus one
real uvicorn server on 127.0.0.1 for the client-disconnect case. One cluster for the module."""
from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import pytest
from fastapi.testclient import TestClient

from router_service.chat_template import DEFAULT_CHAT_TEMPLATE, ChatTemplate, load_chat_template
from router_service.http.app import create_app
from tests.router_service.conftest import start_llm, wait_idle

pytestmark = pytest.mark.ray

PROMPT = "To be, or not to be"


@pytest.fixture(scope="module")
def llm(ray_session, tiny_moe_dir):
    llm = start_llm(tiny_moe_dir, ranks=1)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def model_id(client):
    return client.get("/v1/models").json()["data"][0]["id"]


def sse_events(resp) -> list:
    out = []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            body = line[len("data: "):]
            out.append(body if body == "[DONE]" else json.loads(body))
    return out


def complete(client, **kw):
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    body.update(kw)
    return client.post("/v1/completions", json=body)


def assert_served(client):
    r = complete(client, max_tokens=2)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


def test_models_health_metrics(client, llm, model_id):
    assert model_id == llm.router.cfg.model.rstrip("/").split("/")[-1]
    card = client.get("/v1/models").json()["data"][0]
    assert card["object"] == "model" and card["max_model_len"] == llm.router.cfg.max_model_len
    h = client.get("/health")
    assert h.status_code == 200 and h.json()["status"] == "ok"
    complete(client, max_tokens=2)
    text = client.get("/metrics").text
    assert "moeray_kv_blocks_total" in text and "moeray_generated_tokens_total" in text
    assert 'moeray_requests_total{code="200",endpoint="/v1/completions",frontend="http"}' in text


def test_completion_matches_router(client, llm, model_id):
    from actors.engine.sampling import SamplingParams

    r = complete(client, max_tokens=10, model=model_id)
    assert r.status_code == 200, r.text
    d = r.json()
    ref = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    assert d["object"] == "text_completion" and d["model"] == model_id
    assert d["choices"][0]["text"] == ref.text and d["choices"][0]["finish_reason"] == "length"
    assert d["usage"] == {"prompt_tokens": ref.prompt_tokens, "completion_tokens": 10,
                          "total_tokens": ref.prompt_tokens + 10}


def test_per_request_gating_policy(client, llm):
    from actors.engine.sampling import SamplingParams

    r = complete(client, max_tokens=6, gating="sticky")
    assert r.status_code == 200, r.text
    ref = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, gating="sticky"))[0]
    assert r.json()["choices"][0]["text"] == ref.text
    routing = llm.router.stats()["ranks"][0]["routing"]
    assert routing["policy"] == "exact" and routing["policy_tokens"]["sticky"] > 0


def test_completion_stream_with_usage(client, llm):
    full = complete(client, max_tokens=10).json()["choices"][0]["text"]
    with client.stream("POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 10, "temperature": 0,
                                                        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        ev = sse_events(r)
    assert ev[-1] == "[DONE]"
    usage = ev[-2]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 10
    chunks = ev[:-2]
    assert "".join(c["choices"][0]["text"] for c in chunks) == full
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


@pytest.mark.parametrize("options", [None, {}, {"include_usage": False}])
def test_stream_without_usage(client, options):
    # the OpenAI default: no usage event unless asked (clients index chunk.choices[0] of every chunk)
    body = {"prompt": PROMPT, "max_tokens": 3, "stream": True}
    if options is not None:
        body["stream_options"] = options
    with client.stream("POST", "/v1/completions", json=body) as r:
        ev = sse_events(r)
    assert ev[-1] == "[DONE]" and all("usage" not in e and len(e["choices"]) == 1 for e in ev[:-1])


def test_sampled_stream_text_is_whole_characters(client, llm):
    """Byte-level random tokens split UTF-8 characters; SSE deltas must still add up to the decoded text."""
    tok = llm.router.tokenizer
    for seed in (4, 5):
        body = {"prompt": [5, 6, 7], "max_tokens": 40, "temperature": 1.0, "seed": seed, "ignore_eos": True}
        ref = complete(client, **body).json()["choices"][0]["text"]
        with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            ev = sse_events(r)
        streamed = "".join(c["choices"][0]["text"] for c in ev[:-1])  # no usage event: not asked for
        assert streamed == ref  # same seed, same tokens
        assert all(not c["choices"][0]["text"].endswith("\ufffd") for c in ev[:-2])
    # and the text equals a decode of the ids the router produced (a character cut by max_tokens ends as U+FFFD)
    from actors.engine.sampling import SamplingParams

    for seed in (4, 5):
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=1.0, seed=seed, max_tokens=40, ignore_eos=True))[0]
        assert any("\ufffd" in tok.decode([t]) for t in out.token_ids)  # characters were split across tokens
        assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)


def test_stop_string_held_back_in_stream(client):
    full = complete(client, max_tokens=24).json()["choices"][0]["text"]
    stop = full[4:7]
    with client.stream("POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 24, "temperature": 0,
                                                        "ignore_eos": True, "stop": stop, "stream": True}) as r:
        ev = sse_events(r)
    chunks = ev[:-1]
    assert "".join(c["choices"][0]["text"] for c in chunks) == full[: full.index(stop)]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_n_and_batch(client):
    r = complete(client, prompt=[PROMPT, "def add(a, b):"], n=2, max_tokens=4, temperature=0.8, seed=3)
    assert r.status_code == 200, r.text
    d = r.json()
    assert sorted(c["index"] for c in d["choices"]) == [0, 1, 2, 3]
    assert d["usage"]["completion_tokens"] == 16
    # each prompt counted once, not once per choice (as OpenAI and vLLM count)
    tok = client.app.state.server.router.tokenizer
    want = len(tok.encode(PROMPT).ids) + len(tok.encode("def add(a, b):").ids)
    assert d["usage"]["prompt_tokens"] == want and d["usage"]["total_tokens"] == want + 16


def test_token_list_batch_and_stop_token_ids_match_the_router(client, llm):
    """A batch of token-id lists (lm-eval's default) gives each prompt's greedy output in prompt order; a
    `stop_token_ids` id ends its choice, is counted, and its text is left out (as vLLM)."""
    from actors.engine.sampling import SamplingParams

    tok = llm.router.tokenizer
    prompts = [tok.encode(PROMPT).ids, tok.encode("def add(a, b):").ids]
    refs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    r = complete(client, prompt=prompts, max_tokens=6)
    assert r.status_code == 200, r.text
    assert [c["text"] for c in r.json()["choices"]] == [x.text for x in refs]
    stop = refs[0].token_ids[3]
    first = refs[0].token_ids.index(stop)
    r = complete(client, prompt=prompts[0], max_tokens=6, stop_token_ids=[stop])
    c = r.json()["choices"][0]
    assert c["finish_reason"] == "stop" and c["text"] == tok.decode(refs[0].token_ids[:first])
    assert r.json()["usage"]["completion_tokens"] == first + 1


def test_chat_completion_default_template(client, llm):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    r = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 6, "temperature": 0,
                                                  "ignore_eos": True})
    assert r.status_code == 200, r.text
    d = r.json()
    from actors.engine.sampling import SamplingParams

    prompt = "System: Be brief.\nUser: Hello\nAssistant:"
    ref = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    assert d["object"] == "chat.completion"
    assert d["choices"][0]["message"] == {"role": "assistant", "content": ref.text}
    assert d["usage"]["prompt_tokens"] == ref.prompt_tokens
    with client.stream("POST", "/v1/chat/completions", json={"messages": msgs, "max_tokens": 6, "temperature": 0,
                                                             "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}) as r:
        ev = sse_events(r)
    assert ev[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in ev[1:-2]) == ref.text
    assert ev[-2]["usage"]["completion_tokens"] == 6


def test_chat_default_max_tokens_fills_context(client, llm):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "temperature": 0,
                                                  "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
    ev = sse_events(r)
    u = ev[-2]["usage"]
    assert u["total_tokens"] == llm.router.cfg.max_model_len
    assert ev[-3]["choices"][0]["finish_reason"] == "length"


def test_chat_template_from_tokenizer_config(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": {"content": "</s>"}, "bos_token": "<s>",
        "chat_template": "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{{ eos_token }}{% endfor %}"
                         "{% if add_generation_prompt %}[assistant]{% endif %}"}))
    t = load_chat_template(str(tmp_path))
    assert t.render([{"role": "user", "content": "hi"}]) == "<s>[user]hi</s>[assistant]"
    assert load_chat_template(str(tmp_path / "missing")).template is not None
    assert ChatTemplate(DEFAULT_CHAT_TEMPLATE).render([{"role": "user", "content": "x"}]) == "User: x\nAssistant:"


def test_templates_render_tools():
    """The default template lists each tool (name, description, JSON parameters) in a system block before the
    messages; a checkpoint's template gets `tools` as transformers passes them, with transformers' `tojson`."""
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"}]
    params = {"type": "object", "properties": {"city": {"type": "string", "description": "<name> & country"}}}
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "forecast", "parameters": params}},
             {"type": "function", "function": {"name": "ping"}}]
    assert ChatTemplate(DEFAULT_CHAT_TEMPLATE).render(msgs, tools) == (
        'System: Tools:\n'
        '- get_weather: forecast; parameters: {"type": "object", "properties": {"city": {"type": "string", '
        '"description": "<name> & country"}}}\n'
        '- ping; no parameters\n'
        'System: Be brief.\nUser: Weather in Oslo?\nAssistant:')
    assert ChatTemplate(DEFAULT_CHAT_TEMPLATE).render(msgs, []) == "System: Be brief.\nUser: Weather in Oslo?\nAssistant:"
    own = ChatTemplate("{% if tools %}<tools>{% for t in tools %}{{ t | tojson(indent=1) }}{% endfor %}</tools>"
                       "{% endif %}{% for m in messages %}{{ m.content }};{% endfor %}")
    assert own.render(msgs, tools[1:]) == ('<tools>{\n "type": "function",\n "function": {\n  "name": "ping"\n }\n}'
                                           '</tools>Be brief.;Weather in Oslo?;')
    assert own.render(msgs) == "Be brief.;Weather in Oslo?;"


@pytest.mark.parametrize("body, field, limit", [
    ({"max_tokens": -1}, "max_tokens", "greater than or equal to 0"),
    ({"max_tokens": 0}, "max_tokens", "needs echo=true"),
    ({"max_tokens": 100000}, "max_tokens", "context window"),
    ({"temperature": -0.1}, "temperature", "greater than or equal to 0"),
    ({"temperature": 3}, "temperature", "less than or equal to 2"),
    ({"top_p": 0}, "top_p", "greater than 0"),
    ({"top_p": 1.5}, "top_p", "less than or equal to 1"),
    ({"n": 9}, "n", "1 to 8"),
    ({"n": 0}, "n", "1 to 8"),
    ({"prompt": ""}, "prompt", "empty"),
    ({"prompt": []}, "prompt", "empty"),
    ({"prompt": [100000]}, "prompt", "out of range"),
    ({"stop": [""]}, "stop", "non-empty"),
    ({"stop": ["a"] * 17}, "stop", "at most 16"),
    ({"seed": -1}, "seed", "greater than or equal to 0"),
    ({"logprobs": 21}, "logprobs", "less than or equal to 20"),
    ({"presence_penalty": 2.5}, "presence_penalty", "less than or equal to 2"),
    ({"gating": "fastest"}, "gating", "must be one of exact"),
])
def test_completion_validation_400(client, body, field, limit):
    r = complete(client, **body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and limit in err["message"], err
    assert field in err["message"]
    assert_served(client)


@pytest.mark.parametrize("body, field", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": ""}]}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000}, "max_tokens"),
])
def test_chat_validation_400(client, body, field):
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field
    assert_served(client)


def test_invalid_json_body_400(client):
    r = client.post("/v1/completions", content=b'{"prompt": "x", ', headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "body" and "invalid JSON" in err["message"], err
    r = complete(client, gating="fastest")
    assert r.json()["error"]["message"].count("gating=") == 1  # the field is named once
    assert_served(client)


def test_overload_503_at_once(client, llm):
    from actors.engine.sampling import SamplingParams

    router = llm.router
    old = router.max_queue
    router.max_queue = 1
    try:
        hog = router.submit(PROMPT, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        t0 = time.monotonic()
        r = complete(client, max_tokens=2)
        assert r.status_code == 503 and r.headers.get("retry-after") == "1"
        assert "queue limit" in r.json()["error"]["message"]
        assert time.monotonic() - t0 < 10  # refused, not queued behind the hog (loose bound: 2 busy cores)
        hog.cancel()
        hog.result(timeout=30)
    finally:
        router.max_queue = old
    assert_served(client)
    assert 'moeray_rejections_total{frontend="http",reason="overloaded"}' in client.get("/metrics").text


def test_rank_failure_mid_stream(client, llm):
    """A rank failure mid-stream ends the SSE stream with an error event (injected the way the router reports
    an unreachable rank); the next request is served."""
    with client.stream("POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 30, "temperature": 0,
                                                        "ignore_eos": True, "stream": True}) as r:
        events = []
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if len(events) == 1:
                llm.router._fail_rank(0, "rank 0 unreachable: injected")
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["code"] == 503 and "injected" in err["message"]
    s = wait_idle(llm.router)
    assert s["kv_blocks_free"] == s["kv_blocks_total"]
    assert_served(client)


def test_api_key(llm):
    with TestClient(create_app(llm.router, api_key="k1")) as c:
        assert c.get("/v1/models").status_code == 401
        assert c.get("/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
        assert c.get("/v1/models", headers={"Authorization": "Bearer k1"}).status_code == 200
        assert c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2},
                      headers={"Authorization": "Bearer k1"}).status_code == 200
        assert c.get("/health").status_code == 200  # probes need no key


def test_client_disconnect_mid_stream_frees_kv(llm):
    """A real HTTP server (uvicorn on 127.0.0.1): closing the socket mid-stream aborts the request."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # the server takes the bound socket: no free-port race
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(llm.router), host="127.0.0.1", port=port, log_level="warning"))
    th = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        steps0 = llm.router.stats()["ranks"][0]["steps"]
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("POST", "/v1/completions", body=json.dumps(
            {"prompt": PROMPT, "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}),
            headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        seen = 0
        while seen < 3:
            if resp.fp.readline().startswith(b"data: "):
                seen += 1
        assert llm.router.in_flight == 1
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
        s = wait_idle(llm.router)
        assert s["in_flight"] == 0 and s["kv_blocks_free"] == s["kv_blocks_total"]
        assert s["ranks"][0]["steps"] - steps0 < 150  # aborted well before max_tokens=200
    finally:
        server.should_exit = True
        th.join(timeout=10)


def test_huge_prompt_refused_untokenized_while_others_stream(client, llm):
    """A 3 MiB prompt (under the 4 MiB body limit) is refused by its length alone (tokenizing it would hold the GIL
    for seconds): 400 naming `prompt` and the character limit, and a stream running beside it completes."""
    import concurrent.futures as cf

    limit = llm.router.max_prompt_chars
    assert limit < 3 << 20
    with cf.ThreadPoolExecutor(1) as ex:
        running = ex.submit(lambda: complete(client, max_tokens=24, stream=True))
        r = client.post("/v1/completions", json={"prompt": "x" * (3 << 20), "max_tokens": 4})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "prompt" and f"{limit} characters" in err["message"]
        other = running.result(timeout=120)
    assert other.status_code == 200
    assert sse_events(other)[-1] == "[DONE]"


def test_64_concurrent_streams_through_the_replica_listener_arrive_in_order(llm):
    """64 streams at once through `HTTPListener` (the replica's own uvicorn): more than max_num_seqs (16), so
    most wait in the rank's queue instead of being refused; each stream's text, token by token in arrival
    order, equals the non-streamed greedy completion of its prompt."""
    import asyncio

    import aiohttp

    from router_service.serve.listener import HTTPListener

    from actors.engine.sampling import SamplingParams

    prompts = [f"{PROMPT} {i}" for i in range(64)]
    ref = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    listener = HTTPListener(create_app(llm.router), "127.0.0.1", 0).start()

    async def one(sess, p):
        body = {"prompt": p, "max_tokens": 16, "temperature": 0, "ignore_eos": True, "stream": True}
        text, finishes = "", []
        async with sess.post(f"http://127.0.0.1:{listener.port}/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()
            async for line in r.content:
                if line.startswith(b"data: {"):
                    ch = json.loads(line[6:])["choices"][0]
                    text += ch["text"]
                    finishes.append(ch["finish_reason"])
        return text, finishes

    async def main():
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as sess:
            return await asyncio.gather(*[one(sess, p) for p in prompts])

    try:
        got = asyncio.run(main())
    finally:
        listener.stop()
    for (text, finishes), r in zip(got, ref):
        assert text == r.text
        assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    s = wait_idle(llm.router)
    assert s["kv_blocks_free"] == s["kv_blocks_total"]


def test_response_format_through_a_ray_rank(client):
    """The grammar travels router -> rank over the rank channel (msgpack) and is enforced there: sampled outputs of
    a bounded schema end with "stop" and validate (the tiny random model's own vocabulary)."""
    import jsonschema

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                                "maximum": 99}},
              "required": ["ok", "n"], "additionalProperties": False}
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 64, "temperature": 1.0, "n": 3, "seed": 1,
                                             "response_format": {"type": "json_schema",
                                                                 "json_schema": {"name": "x", "schema": schema}}})
    assert r.status_code == 200, r.text
    for c in r.json()["choices"]:
        assert c["finish_reason"] == "stop", c
        jsonschema.validate(json.loads(c["text"]), schema)
