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
- a Generate still generating past the server's request timeout (`request_timeout_s`, default 600 s,
  `--request-timeout-s`; `router_service.request_timeout`, HTTP's 504 rule) is aborted on its rank the same way
  and ends with DEADLINE_EXCEEDED naming the limit; a client's own shorter deadline ends it first, as before;
- bad input -> INVALID_ARGUMENT whose message starts with the field (`max_tokens: max_tokens=5000
  exceeds the context window ...`); an unserved `model` -> NOT_FOUND (HTTP's 404 model_not_found); queue limit
  -> RESOURCE_EXHAUSTED; a rank failure -> UNAVAILABLE (retriable);
- a batch (`GenerateRequest.batch`, each prompt `sampling.n` times) is admitted whole or not at all: a refused
  prompt aborts those submitted; `sampling.json_schema` / `json_object` use HTTP's grammar helper;
- an optional API key, sent as metadata `authorization: Bearer <key>` or `x-api-key: <key>`
  (`Health` needs none, so probes work);
- client data is parsed as protobuf only (never unpickled).
"""
from __future__ import annotations

import hmac
import json
import os
import re
import uuid
from dataclasses import fields
from typing import Iterable

import grpc

from actors.engine.sampling import SamplingParams
from router_service.errors import EngineError, InvalidRequestError, ModelNotFoundError, OverloadedError
from router_service.grpc.call import GenerateCall, RpcError
from router_service.http.models import MAX_PROMPTS, MAX_SEED, check_n
from router_service.http.structured import ANY_OBJECT, schema_grammar
from router_service.proto.moeray.v1 import moeray_pb2 as pb
from router_service.router import Router
from router_service.stream import RequestStream

_PARAM_FIELDS = {f.name for f in fields(SamplingParams)}


def served_model_name(router: Router, name: str | None = None) -> str:
    """The public model id: `name`, else the model folder's base name (`models/tiny-moe` -> `tiny-moe`)."""
    return name or os.path.basename(os.path.normpath(router.cfg.model))


def params_error_field(message: str) -> str:
    """The SamplingParams field a `ValueError` message names (`top_p=2.0 must be ...` -> `top_p`)."""
    m = re.match(r"(\w+)", message)
    return m.group(1) if m and m.group(1) in _PARAM_FIELDS else "sampling"


def params_from_proto(sp: pb.SamplingParams, grammar: str | None = None, index: int = 0) -> SamplingParams:
    """Proto -> validated `SamplingParams` of output `index` of a prompt (its seed offset by `index` so the n
    outputs differ, as HTTP's `n`), constrained by `grammar` (`proto_grammar`'s); unset optional fields take the
    defaults.

    Raises:
        InvalidRequestError: naming the field, its value and the allowed range.
    """
    kw: dict = {}
    for name in ("temperature", "top_p", "top_k", "max_tokens", "seed", "gating", "kv_profile", "logprobs",
                 "prompt_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens"):
        if sp.HasField(name):
            kw[name] = getattr(sp, name)
    if index and "seed" in kw:
        kw["seed"] = (kw["seed"] + index) % MAX_SEED
    kw["stop"] = list(sp.stop)
    kw["stop_token_ids"] = list(sp.stop_token_ids)
    kw["ignore_eos"] = sp.ignore_eos
    kw["logit_bias"] = dict(sp.logit_bias) or None
    kw["grammar"] = grammar
    try:
        return SamplingParams(**kw)
    except ValueError as e:
        raise InvalidRequestError(params_error_field(str(e)), str(e)) from e


def proto_n(sp: pb.SamplingParams) -> int:
    """`sampling.n` (unset: 1). Raises InvalidRequestError naming `n` outside 1..MAX_N (HTTP's words)."""
    try:
        return check_n(sp.n) if sp.HasField("n") else 1
    except ValueError as e:
        raise InvalidRequestError("n", str(e)) from e


def proto_grammar(sp: pb.SamplingParams, router: Router) -> str | None:
    """The grammar of `sampling.json_schema` (a JSON schema as text) or `json_object: true` (any JSON object),
    built by HTTP's helper (`structured.schema_grammar`); None: unconstrained (`json_object: false` included).

    Raises:
        InvalidRequestError: naming `json_schema` (not JSON, not an object, does not compile) or `json_object`.
    """
    kind = sp.WhichOneof("structured")
    if kind == "json_schema":
        try:
            schema = json.loads(sp.json_schema)
        except ValueError as e:
            raise InvalidRequestError("json_schema", f"json_schema: not JSON text ({e})") from e
        return schema_grammar(schema, "json_schema", router)
    if kind == "json_object" and sp.json_object:
        return schema_grammar(ANY_OBJECT, "json_object", router)
    return None


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
        """Authorize (when `metadata` is given), validate and submit one Generate request (one prompt, or each of
        a batch: all or none), counted in `metrics` (`frontend="grpc"`). `timed=False`: the caller times the
        outputs itself (the Serve deployment, through `OpenAIServer.outputs`).

        Raises:
            RpcError: UNAUTHENTICATED (see `authorize`), INVALID_ARGUMENT (details start with the field:
                `max_tokens: max_tokens=5000 exceeds the context window ...`; a batch's prompt i adds
                `prompt i of the batch: `), NOT_FOUND (`model` is not the served one), RESOURCE_EXHAUSTED (queue
                limit), UNAVAILABLE (a rank failed or the EP group is being rebuilt; retriable).
        """
        try:
            if metadata is not None:
                self.authorize(metadata)
            streams = self._submit(request)
        except RpcError as e:
            if self.metrics is not None:
                self.metrics.requests.labels("grpc", "Generate", e.code.name).inc()
            raise
        m = self.metrics
        if m is not None:
            m.prompt_tokens.labels("grpc").inc(sum(s.out.prompt_tokens for s in streams))
        timer = m.observer([s.t0 for s in streams], "grpc") if m is not None and timed else None
        return GenerateCall(self.router, streams, timer, m)

    @staticmethod
    def _prompts(request: pb.GenerateRequest) -> list[str | list[int]] | None:
        """The request's prompts: one, or a batch's (None: not a batch). Raises InvalidRequestError."""
        kind = request.WhichOneof("prompt")
        if kind is None:
            raise InvalidRequestError("prompt", "prompt is missing: set text, token_ids or batch")
        if kind != "batch":
            return [request.text if kind == "text" else list(request.token_ids.ids)]
        ps = request.batch.prompts
        if not 1 <= len(ps) <= MAX_PROMPTS:
            raise InvalidRequestError("prompt", f"batch has {len(ps)} prompts; 1 to {MAX_PROMPTS} in one request")
        out = []
        for i, p in enumerate(ps):
            k = p.WhichOneof("prompt")
            if k is None:
                raise InvalidRequestError("prompt", f"prompt {i} of the batch is missing: set text or token_ids")
            out.append(p.text if k == "text" else list(p.token_ids.ids))
        return out

    def _submit(self, request: pb.GenerateRequest) -> list[RequestStream]:
        reason, streams = None, []
        try:
            self._check_model(request.model)
            prompts = self._prompts(request)
            sp = request.sampling
            params_from_proto(sp)  # the plain fields' errors first, before a grammar is compiled
            n = proto_n(sp)
            grammar = proto_grammar(sp, self.router)  # compiled and checked once, for every output
            outs = [params_from_proto(sp, grammar, j) for j in range(n)]
            rid = request.request_id or uuid.uuid4().hex
            batch = request.WhichOneof("prompt") == "batch"
            for i, prompt in enumerate(prompts):
                for j in range(n):  # output i * n + j: prompt-major, as HTTP's choices
                    try:
                        streams.append(self.router.submit(prompt, outs[j], f"{rid}-{i * n + j}" if batch or n > 1
                                                          else rid))
                    except InvalidRequestError as e:
                        if batch:
                            raise InvalidRequestError(e.field, f"prompt {i} of the batch: {e}") from e
                        raise
            return streams
        except ModelNotFoundError as e:
            reason = "model_not_found"
            raise RpcError(grpc.StatusCode.NOT_FOUND, _detail(e)) from e
        except InvalidRequestError as e:
            reason = "invalid"
            raise RpcError(grpc.StatusCode.INVALID_ARGUMENT, _detail(e)) from e
        except OverloadedError as e:
            reason = "overloaded"
            raise RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from e
        except EngineError as e:
            reason = "unavailable"
            raise RpcError(grpc.StatusCode.UNAVAILABLE, str(e)) from e
        finally:
            if reason is not None:
                for s in streams:  # all or nothing: the batch's prompts admitted before the refusal
                    self.router.abort(s.request_id)
                if self.metrics is not None:
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
        """SERVING, or NOT_SERVING with `detail` saying why (`Router.health`'s error: the build or rebuild's trigger and
        blocker, draining, a failed build); each rank's health once the EP group is up."""
        h = self.router.health()
        return pb.HealthResponse(
            status=pb.HealthResponse.STATUS_SERVING if h["ok"] else pb.HealthResponse.STATUS_NOT_SERVING,
            ranks=[pb.RankHealth(rank=r["rank"], ok=bool(r.get("ok")), error=r.get("error") or "") for r in h["ranks"]],
            detail="" if h["ok"] else h.get("error") or "")

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


def _detail(e: InvalidRequestError) -> str:
    """A status's details: the message, led by its field once (`json_schema: not JSON text ...`)."""
    msg = str(e)
    return msg if msg.startswith(f"{e.field}:") else f"{e.field}: {msg}"
