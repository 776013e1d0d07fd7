"""The OpenAI-style HTTP routes: a FastAPI app (`create_app`) over an `OpenAIServer`, with JSON and SSE
responses and the error shape.

Routes (see `router_service.http.models` for the request fields and their limits):
  POST /v1/completions, POST /v1/chat/completions  JSON, or SSE with `"stream": true` (the last event
      before `data: [DONE]` carries `usage`, `choices: []`, when `stream_options.include_usage` is true)
  GET /v1/models, GET /v1/models/{id} (the model card, or 404 `model_not_found`), GET /health (200, or 503 while a rank is down or the EP group is being rebuilt), GET /metrics (Prometheus text)
Status codes: 400 bad input (`error.param` names the field, `error.message` the value and the limit),
404 a model not served (`error.code` = `model_not_found`, as OpenAI), 401 missing / wrong API key (`Authorization: Bearer <key>`; /health and /metrics need none), 503 queue
limit reached (at once, with `Retry-After`), the EP group being built or rebuilt, or a rank failed; 413 a body
over `max_body_bytes`; 504 a request still generating after `request_timeout_s` (in-band in a stream). A client
that disconnects mid-stream aborts its requests on their ranks (KV blocks freed).

The app is usable with a TestClient, uvicorn, or as the Serve ingress of
`router_service.serve.deployment.MoerayServer`.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from contextlib import aclosing

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from router_service.chat_template import ChatTemplate
from router_service.errors import InvalidRequestError, ModelNotFoundError
from router_service.http.body_limit import BodyLimit
from router_service.grpc.rpc import api_key_ok, params_error_field
from router_service.http.models import ChatCompletionRequest, CompletionRequest, ModelCard, SamplingFields
from router_service.http.serving import OpenAIServer, RequestTimedOut, _Reject, error_response, model_not_found
from router_service.http.structured import tool_call_choice, tool_mode
from router_service.request_timeout import REQUEST_TIMEOUT_S
from router_service.router import Router
from router_service.stream import RequestStream

log = logging.getLogger("moeray.http")

MAX_BODY_BYTES = 4 << 20  # request bodies above this get 413 unparsed (default of `create_app` and --max-body-bytes)
_UNION_MEMBER = re.compile(r"(str|int|float|bool|none|nullable|(list|dict|literal|function-\w+)\[.*\]|[A-Z]\w*)")


def _validation_message(err: dict) -> tuple[str, str]:
    """(field, message) of one pydantic error, e.g. ("max_tokens", "max_tokens=-1: Input should be
    greater than or equal to 1")."""
    if err.get("type") == "json_invalid":  # FastAPI's loc is ("body", <byte offset>): name the body, not "0"
        return "body", f"body: invalid JSON ({err.get('ctx', {}).get('error', 'decode error')} at byte " \
                       f"{err.get('loc', ('', '?'))[-1]})"
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    # union members show up in loc (`str`, `list[int]`, `ContentPart`); keep the field path only (`stream` stays)
    loc = [p for p in loc if not _UNION_MEMBER.fullmatch(p)]
    msg = err.get("msg", "invalid")
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    lead = re.match(r"(\w+)[:=]", msg)  # model-level validators start their message with the field
    field = ".".join(loc) or (lead.group(1) if lead else params_error_field(msg))
    if msg.startswith(f"{field}=") or msg.startswith(f"{field}:"):
        pass  # the validator already named the field and its value
    elif loc and "input" in err and not isinstance(err["input"], (dict, list)):
        msg = f"{field}={err['input']!r}: {msg}"
    elif loc:
        msg = f"{field}: {msg}"
    return field, msg


def create_app(router: Router, *, model_name: str | None = None, api_key: str | None = None,
               chat_template: ChatTemplate | None = None, max_body_bytes: int = MAX_BODY_BYTES,
               request_timeout_s: float | None = REQUEST_TIMEOUT_S) -> FastAPI:
    """The FastAPI app over `router` (usable with a TestClient, uvicorn, or as a Serve ingress).

    max_body_bytes: request bodies above it get 413 before they are parsed (`router_service.http.body_limit`).
    request_timeout_s: a request still generating after it is stopped with 504 (`OpenAIServer`; None: none)."""
    srv = OpenAIServer(router, model_name, api_key, chat_template, request_timeout_s)
    app = FastAPI(title="moeray", description="OpenAI-compatible API of an expert-parallel MoE cluster")
    app.state.server = srv
    m = srv.metrics

    def too_large() -> JSONResponse:
        m.rejections.labels("http", "too_large").inc()
        return error_response(413, f"the request body exceeds the limit of {max_body_bytes} bytes "
                                   f"(--max-body-bytes)", "body")

    async def reject(scope, receive, send):
        m.requests.labels("http", scope.get("path", ""), "413").inc()
        await too_large()(scope, receive, send)

    app.add_middleware(BodyLimit, max_bytes=max_body_bytes, reject=reject)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        m.requests.labels("http", request.url.path, str(exc.status_code)).inc()
        if exc.status_code == 413:
            return too_large()
        return error_response(exc.status_code, str(exc.detail), None, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        field, msg = _validation_message(errs[0]) if errs else ("body", "invalid request body")
        m.rejections.labels("http", "invalid").inc()
        m.requests.labels("http", request.url.path, "400").inc()
        return error_response(400, msg, field)

    def require_key(request: Request) -> None:
        if not srv.api_key:
            return
        auth = request.headers.get("authorization", "")
        key = auth[7:].strip() if auth.lower().startswith("bearer ") else request.headers.get("x-api-key")
        if not api_key_ok(srv.api_key, key):
            raise _Reject(error_response(401, "missing or wrong API key (Authorization: Bearer <key>)", None,
                                         "authentication_error"), "unauthorized")

    @app.exception_handler(_Reject)
    async def _rejected(request: Request, exc: _Reject):
        m.rejections.labels("http", exc.reason).inc()
        m.requests.labels("http", request.url.path, str(exc.response.status_code)).inc()
        return exc.response

    @app.exception_handler(InvalidRequestError)
    async def _invalid_request(request: Request, exc: InvalidRequestError):
        m.rejections.labels("http", "invalid").inc()
        m.requests.labels("http", request.url.path, "400").inc()
        return error_response(400, str(exc), exc.field)

    @app.get("/health")
    async def health():
        h = await asyncio.get_running_loop().run_in_executor(None, router.health)
        return JSONResponse(h, status_code=200 if h["ok"] else 503)

    @app.get("/metrics")
    async def metrics():
        try:
            m.refresh(await asyncio.get_running_loop().run_in_executor(None, router.stats))
        except Exception as e:  # noqa: BLE001 - still export what we have
            log.warning("stats for /metrics failed: %s", e)
        return PlainTextResponse(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)

    def card() -> dict:
        return ModelCard(id=srv.model_name, created=srv.created, max_model_len=router.cfg.max_model_len).model_dump()

    @app.get("/v1/models", dependencies=[Depends(require_key)])
    async def models():
        return {"object": "list", "data": [card()]}

    @app.get("/v1/models/{model_id:path}", dependencies=[Depends(require_key)])
    async def model(model_id: str):
        if model_id != srv.model_name:
            raise _Reject(model_not_found(ModelNotFoundError(model_id, srv.model_name)), "model_not_found")
        return card()

    def _body_bytes(request: Request) -> int | None:
        n = request.headers.get("content-length")
        return int(n) if n is not None and n.isdigit() else None

    @app.post("/v1/completions", dependencies=[Depends(require_key)])
    async def completions(req: CompletionRequest, request: Request):
        rid = f"cmpl-{uuid.uuid4().hex}"
        streams = await srv.submit(lambda: srv.completion_jobs(req, rid), _body_bytes(request))
        m.prompt_tokens.labels("http").inc(sum(s.out.prompt_tokens for s in streams))
        return await _respond(req, streams, rid, "text_completion", request.url.path)

    @app.post("/v1/chat/completions", dependencies=[Depends(require_key)])
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await srv.submit(lambda: srv.chat_jobs(req, rid), _body_bytes(request))
        m.prompt_tokens.labels("http").inc(sum(s.out.prompt_tokens for s in streams))
        return await _respond(req, streams, rid, "chat.completion", request.url.path)

    async def _respond(req: SamplingFields, streams: list[RequestStream], rid: str, obj: str, path: str):
        chat = obj == "chat.completion"
        created = int(time.time())
        base = {"id": rid, "created": created, "model": srv.model_name}
        completion = [0] * len(streams)
        views = srv.views(req, streams)  # echo / logprobs / prompt_logprobs; None: none asked
        if not req.stream:
            texts, reasons = [""] * len(streams), [None] * len(streams)
            try:
                async with aclosing(srv.outputs(streams)) as outs:  # closing aborts the others at once on error
                    async for i, o in outs:
                        if o.finish_reason == "error":
                            m.requests.labels("http", path, "503").inc()
                            return error_response(503, o.error or "a rank failed", None, "engine_unavailable",
                                                  {"Retry-After": "1"})
                        texts[i] += o.text
                        completion[i] += len(o.token_ids)
                        reasons[i] = o.finish_reason or reasons[i]
                        if views is not None:
                            views[i].add(o)
            except RequestTimedOut as e:
                m.requests.labels("http", path, "504").inc()
                return error_response(504, str(e), None, "timeout_error")
            choices = [({"index": i, "message": {"role": "assistant", "content": texts[i]}, "logprobs": None,
                         "finish_reason": reasons[i]} if chat else
                        {"index": i, "text": texts[i], "logprobs": None, "finish_reason": reasons[i]})
                       for i in range(len(streams))]
            if views is not None:
                choices = [v.fill(c) for v, c in zip(views, choices)]
            if chat and (tool := tool_mode(req)) is not None:  # the constrained text as message.tool_calls
                choices = [tool_call_choice(c, tool) for c in choices]
                if chat and req.prompt_logprobs is not None:
                    base["prompt_logprobs"] = views[0].prompt_logprobs()
            m.requests.labels("http", path, "200").inc()
            return {**base, "object": obj, "choices": choices, "usage": srv.usage(streams, completion, req.n)}

        chunk_obj = "chat.completion.chunk" if chat else "text_completion"

        def event(d: dict) -> str:
            return f"data: {json.dumps(d, ensure_ascii=False)}\n\n"

        # per choice, the chunk event around its text and finish reason, rendered once: a token's event is then
        # two json.dumps of scalars and a join (the same bytes as `event` of the whole chunk dict)
        def template(i: int, delta: bool) -> tuple[str, str, str]:
            mark_t, mark_f = "\x00text\x00", "\x00finish\x00"
            body = {"delta": {"content": mark_t}} if delta else {"text": mark_t}
            full = event({**base, "object": chunk_obj, "choices": [
                {"index": i, **body, "logprobs": None, "finish_reason": mark_f}]})
            head, rest = full.split(json.dumps(mark_t), 1)
            mid, tail = rest.split(json.dumps(mark_f), 1)
            return head, mid, tail

        templates = [template(i, chat) for i in range(len(streams))]
        empty_delta = [event({**base, "object": chunk_obj, "choices": [
            {"index": i, "delta": {}, "logprobs": None, "finish_reason": "\x00finish\x00"}]}).split(
            json.dumps("\x00finish\x00"), 1) for i in range(len(streams))] if chat else []

        def token_event(i: int, text: str, finish: str | None) -> str:
            fin = "null" if finish is None else json.dumps(finish)
            if chat and not text:
                head, tail = empty_delta[i]
                return head + fin + tail
            head, mid, tail = templates[i]
            return head + json.dumps(text, ensure_ascii=False) + mid + fin + tail

        async def sse():
            if chat:
                for i in range(len(streams)):
                    yield event({**base, "object": chunk_obj, "choices": [
                        {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]})
            failed = False
            try:
                async with aclosing(srv.outputs(streams)) as outs:
                    async for i, o in outs:
                        if o.finish_reason == "error":
                            failed = True
                            yield event({"error": {"message": o.error or "a rank failed", "type": "engine_unavailable",
                                                   "param": None, "code": 503}})
                            break
                        completion[i] += len(o.token_ids)
                        if views is not None:  # the general path: whole chunk dicts
                            for c in views[i].chunks(i, o):
                                yield event({**base, "object": chunk_obj, "choices": [c]})
                            continue
                        if not o.text and o.finish_reason is None:
                            continue  # text held back (partial character or possible stop string)
                        yield token_event(i, o.text, o.finish_reason)
            except RequestTimedOut as e:
                failed = True
                yield event({"error": {"message": str(e), "type": "timeout_error", "param": None, "code": 504}})
            if not failed and req.include_usage:
                yield event({**base, "object": chunk_obj, "choices": [], "usage": srv.usage(streams, completion, req.n)})
            yield "data: [DONE]\n\n"

        m.requests.labels("http", path, "200").inc()
        return StreamingResponse(sse(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return app
