"""OpenAI-style HTTP front door: a FastAPI app over a `Router`, and the Ray Serve deployment that owns
the EP cluster.

Routes (see `router_service.http.models` for the request fields and their limits):
  POST /v1/completions, POST /v1/chat/completions  JSON, or SSE with `"stream": true` (the last event
      before `data: [DONE]` carries `usage`, `choices: []`, when `stream_options.include_usage` is true)
  GET /v1/models, GET /health (200, or 503 while a rank is down or the EP group is being rebuilt), GET /metrics (Prometheus text)
Status codes: 400 bad input (`error.param` names the field, `error.message` the value and the limit),
401 missing / wrong API key (`Authorization: Bearer <key>`; /health and /metrics need none), 503 queue
limit reached (at once, with `Retry-After`) or a rank failed. A client that disconnects mid-stream
aborts its requests on their ranks (KV blocks freed).

Chat template: `chat_template` from the model's tokenizer_config.json (Jinja, rendered in a sandbox
with `messages`, `add_generation_prompt=True`, `bos_token`, `eos_token`), else `DEFAULT_CHAT_TEMPLATE`:
one `Role: content` line per message, then `Assistant:` (plain text, since the shipped model has no
chat special tokens).

Serve: `build_app(args)` (import path `router_service.serve_app:build_app`, used by
deploy/serve_config.yaml and `moeray serve`) binds `MoerayServer`, a deployment whose replica builds
one EP cluster in its constructor (a placement group plus one Ray actor per rank, owned by the replica,
so they go away with it) and serves this app over it, plus the `moeray.v1.Moeray` gRPC methods for Serve's
gRPC proxy (`grpc_options.grpc_servicer_functions: [GRPC_SERVICER_FUNCTION]`; see `MoerayServer`).
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import threading
import time
import uuid
from contextlib import aclosing
from typing import AsyncIterator

import grpc
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from actors.engine.messages import TokenOutput
from router_service.chat_template import ChatTemplate, load_chat_template
from router_service.errors import EngineError, InvalidRequestError, OverloadedError
from router_service.grpc.server import MoerayRpc, RpcError, api_key_ok, params_error_field, served_model_name
from router_service.http.models import (ChatCompletionRequest, CompletionRequest, ModelCard, SamplingFields,
                                        ServeAppArgs)
from router_service.metrics import Metrics
from router_service.router import RequestStream, Router

log = logging.getLogger("moeray.http")

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# `grpc_options.grpc_servicer_functions` entry that puts moeray.v1.Moeray on Serve's gRPC proxy
GRPC_SERVICER_FUNCTION = "router_service.proto.moeray.v1.moeray_pb2_grpc.add_MoerayServicer_to_server"


# ---------------------------------------------------------------------------------------------- errors
def error_response(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                   headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}},
                        status_code=status, headers=headers)


def _validation_message(err: dict) -> tuple[str, str]:
    """(field, message) of one pydantic error, e.g. ("max_tokens", "max_tokens=-1: Input should be
    greater than or equal to 1")."""
    if err.get("type") == "json_invalid":  # FastAPI's loc is ("body", <byte offset>): name the body, not "0"
        return "body", f"body: invalid JSON ({err.get('ctx', {}).get('error', 'decode error')} at byte " \
                       f"{err.get('loc', ('', '?'))[-1]})"
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    # union members show up in loc (`str`, `list[int]`); keep the field path only
    loc = [p for p in loc if not (p.startswith(("str", "list[", "int", "float", "bool", "function-")))]
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


class _Reject(Exception):
    def __init__(self, response: JSONResponse, reason: str):
        self.response, self.reason = response, reason


# ---------------------------------------------------------------------------------------------- the server
class OpenAIServer:
    """Request handling over a `Router` (no HTTP framework in here, so handlers stay testable)."""

    def __init__(self, router: Router, model_name: str | None = None, api_key: str | None = None,
                 chat_template: ChatTemplate | None = None):
        self.router = router
        self.model_name = served_model_name(router, model_name)
        self.api_key = api_key or None
        self.chat_template = chat_template or load_chat_template(router.cfg.model)
        self.metrics = Metrics(router)
        self.created = int(time.time())

    # -------------------------------------------------------------- admission
    def _check_model(self, req: SamplingFields) -> None:
        if req.model is not None and req.model != self.model_name:
            raise InvalidRequestError("model", f"model={req.model!r} is not served; available: [{self.model_name!r}]")

    def _submit_all(self, jobs: list[tuple]) -> list[RequestStream]:
        """Submit (prompt, params, request_id) jobs; all or nothing (a refusal aborts those submitted)."""
        streams: list[RequestStream] = []
        try:
            for prompt, params, rid in jobs:
                streams.append(self.router.submit(prompt, params, rid))
        except BaseException:
            for s in streams:
                self.router.abort(s.request_id)
            raise
        return streams

    async def submit(self, jobs: list[tuple]) -> list[RequestStream]:
        """Submit off the event loop (the router makes a blocking call to the rank). Maps router errors
        to `_Reject` with the HTTP response."""
        try:
            return await asyncio.get_running_loop().run_in_executor(None, self._submit_all, jobs)
        except InvalidRequestError as e:
            raise _Reject(error_response(400, str(e), e.field), "invalid") from e
        except OverloadedError as e:
            raise _Reject(error_response(503, str(e), None, "overloaded_error", {"Retry-After": "1"}), "overloaded") from e
        except EngineError as e:
            raise _Reject(error_response(503, str(e), None, "engine_unavailable", {"Retry-After": "1"}), "unavailable") from e

    def prompt_len(self, prompt: str | list[int]) -> int:
        return len(prompt) if isinstance(prompt, list) else len(self.router.tokenizer.encode(prompt).ids)

    def completion_jobs(self, req: CompletionRequest, rid: str) -> list[tuple]:
        self._check_model(req)
        max_tokens = req.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS
        jobs = []
        for p_i, prompt in enumerate(req.prompts()):
            for j in range(req.n):
                jobs.append((prompt, req.sampling_params(max_tokens, j), f"{rid}-{p_i * req.n + j}"))
        return jobs

    def chat_jobs(self, req: ChatCompletionRequest, rid: str) -> list[tuple]:
        self._check_model(req)
        text = self.chat_template.render([{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
                                          for m in req.messages])
        ids = self.router.tokenizer.encode(text).ids
        L = self.router.cfg.max_model_len
        if req.max_tokens is not None:
            max_tokens = req.max_tokens
        elif len(ids) >= L:
            raise InvalidRequestError("messages", f"the templated prompt has {len(ids)} tokens; the context window is {L}")
        else:
            max_tokens = L - len(ids)  # the rest of the context window
        return [(ids, req.sampling_params(max_tokens, j), f"{rid}-{j}") for j in range(req.n)]

    # -------------------------------------------------------------- streaming
    async def outputs(self, streams: list[RequestStream]) -> AsyncIterator[tuple[int, TokenOutput]]:
        """(choice index, output) of all streams as they arrive. One pump thread per stream hands outputs
        to the event loop, so no executor slot is held per stream. On exit (also cancellation: the client
        went away) every unfinished request is aborted on its rank."""
        loop = asyncio.get_running_loop()
        aq: asyncio.Queue = asyncio.Queue()

        def pump(i: int, s: RequestStream) -> None:
            for o in s:
                try:
                    loop.call_soon_threadsafe(aq.put_nowait, (i, o))
                except RuntimeError:  # the loop is gone; the request was aborted by the finally below
                    return

        for i, s in enumerate(streams):
            threading.Thread(target=pump, args=(i, s), daemon=True, name=f"sse-{s.request_id}").start()
        left = len(streams)
        timer = self.metrics.observer([s.t0 for s in streams])  # TTFT, inter-token and end-to-end latency
        try:
            while left:
                i, o = await aq.get()
                timer.observe(i, o.token_ids, o.finish_reason)
                if o.finish_reason is not None:
                    left -= 1
                yield i, o
        finally:
            for s in streams:
                if not s.done.is_set():
                    self.router.abort(s.request_id)

    @staticmethod
    def usage(streams: list[RequestStream], completion: list[int], n: int = 1) -> dict:
        """OpenAI `usage`: each prompt counted once (its `n` choices are streams i*n .. i*n+n-1, as OpenAI and
        vLLM count them), completion tokens summed over every choice."""
        p = sum(s.out.prompt_tokens for s in streams[::n])
        c = sum(completion)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def create_app(router: Router, *, model_name: str | None = None, api_key: str | None = None,
               chat_template: ChatTemplate | None = None) -> FastAPI:
    """The FastAPI app over `router` (usable with a TestClient, uvicorn, or as a Serve ingress)."""
    srv = OpenAIServer(router, model_name, api_key, chat_template)
    app = FastAPI(title="moeray", description="OpenAI-compatible API of an expert-parallel MoE cluster")
    app.state.server = srv
    m = srv.metrics

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        field, msg = _validation_message(errs[0]) if errs else ("body", "invalid request body")
        m.rejections.labels("invalid").inc()
        m.requests.labels(request.url.path, "400").inc()
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
        m.rejections.labels(exc.reason).inc()
        m.requests.labels(request.url.path, str(exc.response.status_code)).inc()
        return exc.response

    @app.exception_handler(InvalidRequestError)
    async def _invalid_request(request: Request, exc: InvalidRequestError):
        m.rejections.labels("invalid").inc()
        m.requests.labels(request.url.path, "400").inc()
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

    @app.get("/v1/models", dependencies=[Depends(require_key)])
    async def models():
        card = ModelCard(id=srv.model_name, created=srv.created, max_model_len=router.cfg.max_model_len)
        return {"object": "list", "data": [card.model_dump()]}

    @app.post("/v1/completions", dependencies=[Depends(require_key)])
    async def completions(req: CompletionRequest, request: Request):
        rid = f"cmpl-{uuid.uuid4().hex}"
        streams = await srv.submit(srv.completion_jobs(req, rid))
        for s in streams:
            m.prompt_tokens.inc(s.out.prompt_tokens)
        return await _respond(req, streams, rid, "text_completion", request.url.path)

    @app.post("/v1/chat/completions", dependencies=[Depends(require_key)])
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await srv.submit(srv.chat_jobs(req, rid))
        for s in streams:
            m.prompt_tokens.inc(s.out.prompt_tokens)
        return await _respond(req, streams, rid, "chat.completion", request.url.path)

    async def _respond(req: SamplingFields, streams: list[RequestStream], rid: str, obj: str, path: str):
        chat = obj == "chat.completion"
        created = int(time.time())
        base = {"id": rid, "created": created, "model": srv.model_name}
        completion = [0] * len(streams)
        if not req.stream:
            texts, reasons = [""] * len(streams), [None] * len(streams)
            async with aclosing(srv.outputs(streams)) as outs:  # closing aborts the others at once on error
                async for i, o in outs:
                    if o.finish_reason == "error":
                        m.requests.labels(path, "503").inc()
                        return error_response(503, o.error or "a rank failed", None, "engine_unavailable",
                                              {"Retry-After": "1"})
                    texts[i] += o.text
                    completion[i] += len(o.token_ids)
                    reasons[i] = o.finish_reason or reasons[i]
            choices = [({"index": i, "message": {"role": "assistant", "content": texts[i]}, "logprobs": None,
                         "finish_reason": reasons[i]} if chat else
                        {"index": i, "text": texts[i], "logprobs": None, "finish_reason": reasons[i]})
                       for i in range(len(streams))]
            m.requests.labels(path, "200").inc()
            return {**base, "object": obj, "choices": choices, "usage": srv.usage(streams, completion, req.n)}

        chunk_obj = "chat.completion.chunk" if chat else "text_completion"

        def event(d: dict) -> str:
            return f"data: {json.dumps(d, ensure_ascii=False)}\n\n"

        async def sse():
            if chat:
                for i in range(len(streams)):
                    yield event({**base, "object": chunk_obj, "choices": [
                        {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]})
            failed = False
            async with aclosing(srv.outputs(streams)) as outs:
                async for i, o in outs:
                    if o.finish_reason == "error":
                        failed = True
                        yield event({"error": {"message": o.error or "a rank failed", "type": "engine_unavailable",
                                               "param": None, "code": 503}})
                        break
                    completion[i] += len(o.token_ids)
                    if not o.text and o.finish_reason is None:
                        continue  # text held back (partial character or possible stop string)
                    if chat:
                        delta = {"content": o.text} if o.text else {}
                        choice = {"index": i, "delta": delta, "logprobs": None, "finish_reason": o.finish_reason}
                    else:
                        choice = {"index": i, "text": o.text, "logprobs": None, "finish_reason": o.finish_reason}
                    yield event({**base, "object": chunk_obj, "choices": [choice]})
            if not failed and req.include_usage:
                yield event({**base, "object": chunk_obj, "choices": [], "usage": srv.usage(streams, completion, req.n)})
            yield "data: [DONE]\n\n"

        m.requests.labels(path, "200").inc()
        return StreamingResponse(sse(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return app


# ---------------------------------------------------------------------------------------------- Ray Serve
def resolve_args(args: ServeAppArgs) -> dict:
    """ClusterConfig keyword arguments from the app args and this node's environment (see ServeAppArgs)."""
    import ray

    from cluster.config import DEFAULT_MODEL

    env = os.environ
    gpus = args.num_gpus_per_rank
    if gpus is None and env.get("MOERAY_NUM_GPUS_PER_RANK"):
        gpus = float(env["MOERAY_NUM_GPUS_PER_RANK"])
    if gpus is None:
        gpus = 1.0 if ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0 else 0.0
    cpus = args.num_cpus_per_rank
    if cpus is None and env.get("MOERAY_NUM_CPUS_PER_RANK"):
        cpus = float(env["MOERAY_NUM_CPUS_PER_RANK"])
    if cpus is None:
        cpus = 1.0 if gpus else 0.5
    kw = dict(args.cluster_options)
    kw.update(model=args.model or env.get("MOERAY_MODEL") or DEFAULT_MODEL, ranks=args.ranks,
              num_gpus_per_rank=gpus, num_cpus_per_rank=cpus)
    return kw


# Status codes that mean "the client asked for something wrong or was refused", not a server fault
CLIENT_ERROR_CODES = frozenset(getattr(grpc.StatusCode, n) for n in (
    "CANCELLED", "INVALID_ARGUMENT", "NOT_FOUND", "OUT_OF_RANGE", "FAILED_PRECONDITION", "UNAUTHENTICATED",
    "PERMISSION_DENIED", "RESOURCE_EXHAUSTED"))


class ClientErrorLogFilter(logging.Filter):
    """Shortens Serve's log record of a proxied gRPC call that ended with a client-error status (an `RpcError`
    with a code in CLIENT_ERROR_CODES, raised by `_fail`, possibly wrapped by Serve in `gRPCStatusError`): one
    INFO line `gRPC call ended with INVALID_ARGUMENT: <details>` instead of an ERROR with a traceback, which
    under load buried the real faults. Installed on the replica's `ray.serve` logger; Serve's proxy process
    still logs its own line."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        for _ in range(4):  # RpcError, or Serve's wrapper (original_exception) / the `raise ... from` chain
            if exc is None or isinstance(exc, RpcError):
                break
            exc = getattr(exc, "original_exception", None) or exc.__cause__
        if isinstance(exc, RpcError) and exc.code in CLIENT_ERROR_CODES:
            record.msg, record.args, record.exc_info, record.exc_text = (
                "gRPC call ended with %s: %s", (exc.code.name, exc.details), None, None)
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


try:
    from ray import serve
except ImportError:  # pragma: no cover - ray[serve] is a dependency; keep create_app importable without it
    serve = None


if serve is not None:

    def _fail(grpc_context, e: RpcError):
        """End a proxied gRPC call with `e`'s status: Serve 2.60 keeps the code set on the context when the
        method raises (`gRPCStatusError`), and the proxy sends it with the details."""
        grpc_context.set_code(e.code)
        grpc_context.set_details(e.details)
        raise e

    @serve.deployment(name="MoerayServer", max_ongoing_requests=300, health_check_period_s=10,
                      health_check_timeout_s=30, ray_actor_options={"num_cpus": 0.25})
    @serve.ingress()
    class MoerayServer:
        """One replica = one EP cluster (placement group + rank actors, built once here), serving
        - HTTP: the OpenAI-style app (`create_app`) as the Serve ingress;
        - gRPC through Serve's gRPC proxy: the methods `Generate` (server-streaming), `Cancel`, `Health`,
          `ListModels`, `GetClusterStats` answer `moeray.v1.Moeray` when the Serve config has `grpc_options`
          with `GRPC_SERVICER_FUNCTION` (deploy/serve_config.yaml). They reuse `grpc_server.MoerayRpc`, so the
          status codes, the API key and the abort-on-disconnect behaviour are the standalone server's. Clients
          send metadata `application: <app name>` (optional while Serve runs one application). With several
          replicas the proxy may route `Cancel` to a replica that does not hold the request (`found=false`);
          cancelling the Generate call itself always reaches the right one;
        - optionally the replica's own gRPC server (`args.grpc_port`), kept for `moeray serve`: Serve 2.60's
          gRPC proxy binds every interface (`[::]`, no host option), the replica's server binds `grpc_host`
          (127.0.0.1 by default). One port per replica, so use it with a single replica.
        Several replicas are independent data-parallel copies.

        Raises:
            ValueError: bad arguments or cluster configuration. TimeoutError: ranks cannot be placed.
        """

        def __init__(self, args: dict):
            from cluster.config import ClusterConfig
            from cluster.launcher import EPCluster

            self.args = ServeAppArgs.model_validate(args)
            if not any(isinstance(f, ClientErrorLogFilter) for f in logging.getLogger("ray.serve").filters):
                logging.getLogger("ray.serve").addFilter(ClientErrorLogFilter())
            self.api_key = self.args.api_key if self.args.api_key is not None else os.environ.get("MOERAY_API_KEY")
            cfg = ClusterConfig(**resolve_args(self.args))
            self.router = Router(EPCluster(cfg), max_queue=self.args.max_queue)
            # not `self.app`: the ingress wrapper owns that name (a read-only property)
            self.http_app = create_app(self.router, model_name=self.args.served_model_name, api_key=self.api_key)
            self.http: OpenAIServer = self.http_app.state.server
            # proxy gRPC calls are timed by `self.http.outputs` (below); the replica's own gRPC server is given
            # the same Metrics, so one /metrics covers both protocols
            self.rpc = MoerayRpc(self.router, self.args.served_model_name, self.api_key)
            self.grpc = None
            if self.args.grpc_port is not None:
                from router_service.grpc.server import start_grpc_server

                self.grpc = start_grpc_server(self.router, self.args.grpc_host, self.args.grpc_port, self.api_key,
                                              self.args.served_model_name, metrics=self.http.metrics)
            log.info("MoerayServer up: %s, %d ranks", cfg.model, cfg.ranks)

        def __serve_build_asgi_app__(self):
            return self.http_app

        # ------------------------------------------------------ moeray.v1.Moeray behind Serve's gRPC proxy
        async def _unary(self, grpc_context, fn, *args, auth: bool = True):
            """Run a blocking `MoerayRpc` call off the event loop; its RpcError ends the call (`_fail`)."""
            try:
                if auth:
                    self.rpc.authorize(grpc_context.invocation_metadata())
                return await asyncio.get_running_loop().run_in_executor(None, fn, *args)
            except RpcError as e:
                _fail(grpc_context, e)

        async def Generate(self, request, grpc_context):
            """Server-streaming `Generate`: one `GenerateResponse` per output. A client that cancels,
            disconnects or passes its deadline cancels this generator (Serve raises CancelledError in it),
            and `call.close()` aborts the request on its rank."""
            call = await self._unary(grpc_context, self.rpc.start, request)
            try:
                async with aclosing(self.http.outputs([call.stream])) as outs:  # shares the latency metrics
                    async for _, o in outs:
                        try:
                            resp = call.response(o)
                        except RpcError as e:
                            _fail(grpc_context, e)
                        yield resp
                        if call.finished:
                            return
            finally:
                call.close()

        async def Cancel(self, request, grpc_context):
            return await self._unary(grpc_context, self.rpc.cancel, request)

        async def Health(self, request, grpc_context):
            return await self._unary(grpc_context, self.rpc.health, auth=False)  # probes need no key

        async def ListModels(self, request, grpc_context):
            return await self._unary(grpc_context, self.rpc.list_models)

        async def GetClusterStats(self, request, grpc_context):
            return await self._unary(grpc_context, self.rpc.cluster_stats)

        # ------------------------------------------------------ Serve hooks
        async def drain(self, timeout_s: float = 30.0) -> int:
            """Graceful shutdown of this replica (`Router.drain`): refuse new requests, let running ones finish
            for up to `timeout_s` s, end the rest with a retriable error. Returns how many were ended."""
            return await asyncio.get_running_loop().run_in_executor(None, self.router.drain, timeout_s)

        def check_health(self) -> None:
            """Serve's replica health check. The router rebuilds a failed EP group itself (see
            `router_service.router`), so the replica stays healthy while it does; it is reported unhealthy
            (and Serve replaces it) only if the rebuild has not succeeded within 120 s."""
            h = self.router.health()
            if h["status"] == "recovering" and h["recovering_s"] > 120:
                raise RuntimeError(f"EP group not rebuilt after {h['recovering_s']:.0f} s: {h['error']}")

        async def record_autoscaling_stats(self) -> dict[str, float]:
            """Serve's custom-metrics hook (polled every look_back_period_s / 5): queue depth, ITL p95 (ms)
            and rank balancedness of this replica, read by `router_service.autoscaling.MoerayAutoscalingPolicy`."""
            from router_service.autoscaling import ReplicaSignals

            if getattr(self, "_signals", None) is None:
                self._signals = ReplicaSignals()
            return await asyncio.get_running_loop().run_in_executor(None, self._signals.collect, self.router)

        def __del__(self):
            if getattr(self, "grpc", None) is not None:
                self.grpc.stop(0)
            if getattr(self, "router", None) is not None:
                self.router.close()


def build_app(args: ServeAppArgs | dict):
    """Serve application builder (`import_path: router_service.serve_app:build_app`). `serve run` passes
    the config's `args` as a plain dict (it cannot resolve the postponed annotation); validate it here.

    Raises:
        pydantic.ValidationError: an unknown or out-of-range argument (names it).
    """
    if serve is None:
        raise RuntimeError("ray[serve] is not installed")
    if not isinstance(args, ServeAppArgs):
        args = ServeAppArgs.model_validate(args or {})
    return MoerayServer.bind(args.model_dump())
