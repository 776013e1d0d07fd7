"""Transport-free `moeray.v1.Moeray` logic (`MoerayRpc`), the status a call ends with (`RpcError`) and the
proto <-> engine conversions, shared by both gRPC transports.

The transports (see `router_service/proto/moeray/v1/moeray.proto` for the service):
- `router_service.grpc.server`: a standalone synchronous `grpc.server` (`MoerayServicer`, `GrpcServer`), used
  by `moeray serve` (in its own process with `--http-port 0`, else inside the Serve replica) because it binds
  the host it is given (127.0.0.1 by default), while Serve 2.60's gRPC proxy always binds every interface;
- `router_service.serve.deployment.MoerayServer`: the same RPCs as deployment methods behind Serve's gRPC proxy
  (`grpc_options` in deploy/serve_config.yaml), the path for clusters (KubeRay).

What both guarantee (the logic here is what makes it so):
- a call that ends early (client cancel, disconnect, deadline) aborts its request on its rank at once,
  so its KV blocks are freed without waiting for the next token (`GenerateCall.close`);
- bad input -> INVALID_ARGUMENT whose message starts with the field (`max_tokens: max_tokens=5000
  exceeds the context window ...`); queue limit -> RESOURCE_EXHAUSTED; a rank failure -> UNAVAILABLE
  (retriable);
- an optional API key, sent as metadata `authorization: Bearer <key>` or `x-api-key: <key>`
  (`Health` needs none, so probes work);
- client data is parsed as protobuf only (never unpickled).
"""
from __future__ import annotations

import hmac
import os
import re
import threading
import uuid
from dataclasses import fields
from typing import Iterable

import grpc

from actors.engine.messages import TokenOutput
from actors.engine.sampling import SamplingParams
from router_service.errors import EngineError, InvalidRequestError, ModelNotFoundError, OverloadedError
from router_service.proto.moeray.v1 import moeray_pb2 as pb
from router_service.router import Router
from router_service.stream import RequestStream

FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH, "abort": pb.FINISH_REASON_ABORT,
          "error": pb.FINISH_REASON_ERROR}
_PARAM_FIELDS = {f.name for f in fields(SamplingParams)}


def served_model_name(router: Router, name: str | None = None) -> str:
    """The public model id: `name`, else the model folder's base name (`models/tiny-moe` -> `tiny-moe`)."""
    return name or os.path.basename(os.path.normpath(router.cfg.model))


def params_error_field(message: str) -> str:
    """The SamplingParams field a `ValueError` message names (`top_p=2.0 must be ...` -> `top_p`)."""
    m = re.match(r"(\w+)", message)
    return m.group(1) if m and m.group(1) in _PARAM_FIELDS else "sampling"


def params_from_proto(sp: pb.SamplingParams) -> SamplingParams:
    """Proto -> validated `SamplingParams`; unset optional fields take the defaults.

    Raises:
        InvalidRequestError: naming the field, its value and the allowed range.
    """
    kw: dict = {}
    for name in ("temperature", "top_p", "top_k", "max_tokens", "seed", "gating", "kv_profile", "logprobs",
                 "prompt_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens"):
        if sp.HasField(name):
            kw[name] = getattr(sp, name)
    kw["stop"] = list(sp.stop)
    kw["stop_token_ids"] = list(sp.stop_token_ids)
    kw["ignore_eos"] = sp.ignore_eos
    kw["logit_bias"] = dict(sp.logit_bias) or None
    try:
        return SamplingParams(**kw)
    except ValueError as e:
        raise InvalidRequestError(params_error_field(str(e)), str(e)) from e


def is_in_flight(router: Router, request_id: str) -> bool:
    return router.get_stream(request_id) is not None


def api_key_ok(expected: str | None, presented: str | None) -> bool:
    """Constant-time comparison; no key configured means every caller is accepted."""
    if not expected:
        return True
    return presented is not None and hmac.compare_digest(presented.encode(), expected.encode())


def presented_key(metadata: Iterable[tuple[str, str]]) -> str | None:
    """The API key in gRPC metadata: `x-api-key: <key>`, else `authorization: Bearer <key>`; None if absent."""
    md = {k.lower(): v for k, v in metadata}
    key = md.get("x-api-key")
    auth = md.get("authorization", "")
    if key is None and auth.lower().startswith("bearer "):
        key = auth[7:].strip()
    return key


class RpcError(Exception):
    """The status a call ends with (`code`, a `grpc.StatusCode`, and `details`). Each transport turns it into
    its own abort: `context.abort` in the standalone server, `grpc_context.set_code` + raise behind Serve."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details

    def __reduce__(self):  # Serve carries it from the replica to the proxy; rebuild with both fields
        return (RpcError, (self.code, self.details))


def _token_logprob(token_id: int, e: list) -> pb.TokenLogprob:
    """A rank's `TokenLogprob` entry ([logprob, rank, top_ids, top_logprobs]) as the proto message."""
    return pb.TokenLogprob(token_id=token_id, logprob=e[0], rank=e[1],
                           top=[pb.TopLogprob(token_id=i, logprob=v) for i, v in zip(e[2], e[3])])


class GenerateCall:
    """One `Generate` in flight: turns the request's `TokenOutput`s into `GenerateResponse`s and makes sure
    the rank lets go of it. `close()` (idempotent, thread-safe) aborts the request unless it already
    finished; transports call it when the call ends for any reason (cancel, disconnect, deadline, error)."""

    def __init__(self, router: Router, stream: RequestStream, timer=None, metrics=None):
        self.router, self.stream = router, stream
        self.timer = timer  # a router_service.metrics.RequestObserver (TTFT / ITL / e2e), or None
        self.metrics = metrics  # a router_service.metrics.Metrics: the call's end status is counted, or None
        self.request_id = stream.request_id
        self.completion = 0  # tokens streamed so far
        self._finished = threading.Event()

    @property
    def finished(self) -> bool:
        return self._finished.is_set()

    def response(self, o: TokenOutput) -> pb.GenerateResponse:
        """The response for one output; the last one (finish_reason set) carries usage.

        Raises:
            RpcError: UNAVAILABLE when the rank failed (`finish_reason == "error"`; retriable).
        """
        if self.timer is not None:
            self.timer.observe(0, o.token_ids, o.finish_reason)
        if o.finish_reason == "error":
            self._finished.set()  # the router already ended it on every rank
            self._count("UNAVAILABLE")
            raise RpcError(grpc.StatusCode.UNAVAILABLE, o.error or "the rank failed")
        self.completion += len(o.token_ids)
        resp = pb.GenerateResponse(request_id=self.request_id, text=o.text, token_ids=o.token_ids,
                                   finish_reason=FINISH.get(o.finish_reason, pb.FINISH_REASON_UNSPECIFIED))
        if o.logprobs:
            resp.logprobs.extend(_token_logprob(t, e) for t, e in zip(o.token_ids, o.logprobs))
        if o.prompt_logprobs is not None:
            p = self.stream.out.prompt
            ids = list(p) if isinstance(p, list) else self.router.tokenizer.encode(p).ids
            resp.prompt_logprobs.extend(_token_logprob(t, e) for t, e in zip(ids[1:], o.prompt_logprobs[1:]))
        if o.finish_reason is not None:
            self._finished.set()
            self._count("CANCELLED" if o.finish_reason == "abort" else "OK")
            p = self.stream.out.prompt_tokens
            resp.usage.CopyFrom(pb.Usage(prompt_tokens=p, completion_tokens=self.completion,
                                         total_tokens=p + self.completion))
        return resp

    def close(self) -> None:
        if not self._finished.is_set():
            self._finished.set()
            self._count("CANCELLED")  # ended early: cancel, disconnect or deadline
            self.router.abort(self.request_id)

    def _count(self, code: str) -> None:
        if self.metrics is not None:
            self.metrics.requests.labels("grpc", "Generate", code).inc()


class MoerayRpc:
    """The `moeray.v1.Moeray` logic without a transport, shared by the standalone server (`MoerayServicer`)
    and the Ray Serve deployment behind Serve's gRPC proxy (`router_service.serve.deployment.MoerayServer`).
    Every method may block on the ranks (a Ray call): async callers run it in an executor.

    Args:
        router: a running router. model_name: public model id (default: model folder name).
        api_key: if set, every call except `Health` must present it (see `presented_key`).
        metrics: a `router_service.metrics.Metrics` whose latency histograms and `frontend="grpc"` counters
            (Generate calls by end status, rejections, prompt and generated tokens) Generate calls feed (the HTTP
            app's, so one /metrics covers both protocols), or None.
    """

    def __init__(self, router: Router, model_name: str | None = None, api_key: str | None = None, metrics=None):
        self.router = router
        self.metrics = metrics
        self.model_name = served_model_name(router, model_name)
        self.api_key = api_key or None

    def authorize(self, metadata: Iterable[tuple[str, str]]) -> None:
        """Raises RpcError(UNAUTHENTICATED) unless the metadata carries the API key (when one is set)."""
        if self.api_key and not api_key_ok(self.api_key, presented_key(metadata)):
            if self.metrics is not None:
                self.metrics.rejections.labels("grpc", "unauthorized").inc()
            raise RpcError(grpc.StatusCode.UNAUTHENTICATED,
                           "missing or wrong API key (metadata authorization: Bearer <key>)")

    def _check_model(self, model: str) -> None:
        if model and model != self.model_name:
            raise ModelNotFoundError(model, self.model_name)

    def start(self, request: pb.GenerateRequest, metadata: Iterable[tuple[str, str]] | None = None,
              timed: bool = True) -> GenerateCall:
        """Authorize (when `metadata` is given), validate and submit one Generate request, counted in `metrics`
        (`frontend="grpc"`). `timed=False`: the caller times the outputs itself (the Serve deployment, through
        `OpenAIServer.outputs`).

        Raises:
            RpcError: UNAUTHENTICATED (see `authorize`), INVALID_ARGUMENT (details start with the field:
                `max_tokens: max_tokens=5000 exceeds the context window ...`), RESOURCE_EXHAUSTED (queue limit),
                UNAVAILABLE (a rank failed or the EP group is being rebuilt; retriable).
        """
        try:
            if metadata is not None:
                self.authorize(metadata)
            stream = self._submit(request)
        except RpcError as e:
            if self.metrics is not None:
                self.metrics.requests.labels("grpc", "Generate", e.code.name).inc()
            raise
        m = self.metrics
        if m is not None:
            m.prompt_tokens.labels("grpc").inc(stream.out.prompt_tokens)
        timer = m.observer([stream.t0], "grpc") if m is not None and timed else None
        return GenerateCall(self.router, stream, timer, m)

    def _submit(self, request: pb.GenerateRequest) -> RequestStream:
        reason = None
        try:
            self._check_model(request.model)
            kind = request.WhichOneof("prompt")
            if kind is None:
                raise InvalidRequestError("prompt", "prompt is missing: set text or token_ids")
            prompt = request.text if kind == "text" else list(request.token_ids.ids)
            params = params_from_proto(request.sampling)
            return self.router.submit(prompt, params, request.request_id or uuid.uuid4().hex)
        except InvalidRequestError as e:
            reason = "model_not_found" if isinstance(e, ModelNotFoundError) else "invalid"
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, f"{e.field}: {e}") from e
        except OverloadedError as e:
            reason = "overloaded"
            raise RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from e
        except EngineError as e:
            reason = "unavailable"
            raise RpcError(grpc.StatusCode.UNAVAILABLE, str(e)) from e
        finally:
            if reason is not None and self.metrics is not None:
                self.metrics.rejections.labels("grpc", reason).inc()

    def cancel(self, request: pb.CancelRequest) -> pb.CancelResponse:
        """Abort `request.request_id` if it is in flight on this router. Raises RpcError(INVALID_ARGUMENT)
        for an empty id."""
        if not request.request_id:
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, "request_id: request_id is empty")
        found = is_in_flight(self.router, request.request_id)
        if found:
            self.router.abort(request.request_id)
        return pb.CancelResponse(found=found)

    def health(self) -> pb.HealthResponse:
        h = self.router.health()
        return pb.HealthResponse(
            status=pb.HealthResponse.STATUS_SERVING if h["ok"] else pb.HealthResponse.STATUS_NOT_SERVING,
            ranks=[pb.RankHealth(rank=r["rank"], ok=bool(r.get("ok")), error=r.get("error") or "") for r in h["ranks"]])

    def list_models(self) -> pb.ListModelsResponse:
        return pb.ListModelsResponse(models=[pb.ModelInfo(
            id=self.model_name, max_model_len=self.router.cfg.max_model_len, vocab_size=self.router.vocab_size,
            ranks=self.router.cfg.ranks)])

    def cluster_stats(self) -> pb.ClusterStats:
        """Raises RpcError(UNAVAILABLE) when a rank does not answer or the EP group is being rebuilt."""
        try:
            s = self.router.stats()
        except Exception as e:  # noqa: BLE001 - a rank did not answer
            raise RpcError(grpc.StatusCode.UNAVAILABLE, f"cluster stats unavailable: {type(e).__name__}: {e}") from e
        return pb.ClusterStats(
            in_flight=s["in_flight"], running=s["running"], waiting=s["waiting"],
            kv_blocks_total=s["kv_blocks_total"], kv_blocks_free=s["kv_blocks_free"],
            layers=[pb.LayerLoad(**row) for row in s["layers"]],
            ranks=[pb.RankStats(rank=r["rank"], kv_blocks_total=r["kv_blocks_total"], kv_blocks_free=r["kv_blocks_free"],
                                running=r["running"], waiting=r["waiting"], steps=int(r.get("steps", 0)),
                                failed=r.get("failed") or "") for r in s["ranks"]])
