"""gRPC front door (`moeray.v1.Moeray`, see `router_service/proto/moeray/v1/moeray.proto`).

A synchronous `grpc.server`: each `Generate` call holds one worker thread while it streams. What the
servicer guarantees:
- a call that ends early (client cancel, disconnect, deadline) aborts its request on its rank at once,
  through `context.add_callback`, so its KV blocks are freed without waiting for the next token;
- bad input -> INVALID_ARGUMENT whose message starts with the field (`max_tokens: max_tokens=5000
  exceeds the context window ...`); queue limit -> RESOURCE_EXHAUSTED (also when every worker
  thread is busy: `maximum_concurrent_rpcs`); a rank failure -> UNAVAILABLE (retriable);
- an optional API key, sent as metadata `authorization: Bearer <key>` or `x-api-key: <key>`
  (`Health` needs none, so probes work);
- it binds 127.0.0.1 unless another host is given.

`python -m router_service.grpc_server --model DIR --ranks 2 --port 50051` runs it alone (no Serve).
"""
from __future__ import annotations

import argparse
import hmac
import logging
import os
import queue
import re
import signal
import threading
import uuid
from concurrent import futures
from dataclasses import fields

import grpc

from actors.messages import TokenOutput
from actors.sampling import SamplingParams
from router_service.errors import EngineError, InvalidRequestError, OverloadedError
from router_service.proto.moeray.v1 import moeray_pb2 as pb
from router_service.proto.moeray.v1 import moeray_pb2_grpc as pb_grpc
from router_service.router import Router

log = logging.getLogger("moeray.grpc")

FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH, "abort": pb.FINISH_REASON_ABORT,
          "error": pb.FINISH_REASON_ERROR}
_PARAM_FIELDS = {f.name for f in fields(SamplingParams)}
# How often a blocked stream re-checks that its call is still alive (s). The abort itself is immediate
# (callback); this only bounds how long a worker thread lingers if a rank never answers.
_LIVENESS_S = 0.5


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
    for name in ("temperature", "top_p", "top_k", "max_tokens", "seed", "gating", "kv_profile"):
        if sp.HasField(name):
            kw[name] = getattr(sp, name)
    kw["stop"] = list(sp.stop)
    kw["stop_token_ids"] = list(sp.stop_token_ids)
    kw["ignore_eos"] = sp.ignore_eos
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


class MoerayServicer(pb_grpc.MoerayServicer):
    """Implements `moeray.v1.Moeray` over a `Router`.

    Args:
        router: a running router. model_name: public model id (default: model folder name).
        api_key: if set, every call except `Health` must present it.
    """

    def __init__(self, router: Router, model_name: str | None = None, api_key: str | None = None):
        self.router = router
        self.model_name = served_model_name(router, model_name)
        self.api_key = api_key or None

    # ------------------------------------------------------------------ helpers
    def _auth(self, context: grpc.ServicerContext) -> None:
        if not self.api_key:
            return
        md = {k.lower(): v for k, v in context.invocation_metadata()}
        key = md.get("x-api-key")
        auth = md.get("authorization", "")
        if key is None and auth.lower().startswith("bearer "):
            key = auth[7:].strip()
        if not api_key_ok(self.api_key, key):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong API key (metadata authorization: Bearer <key>)")

    def _check_model(self, model: str) -> None:
        if model and model != self.model_name:
            raise InvalidRequestError("model", f"model={model!r} is not served; available: [{self.model_name!r}]")

    # ------------------------------------------------------------------ RPCs
    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext):
        self._auth(context)
        kind = request.WhichOneof("prompt")
        try:
            self._check_model(request.model)
            if kind is None:
                raise InvalidRequestError("prompt", "prompt is missing: set text or token_ids")
            prompt = request.text if kind == "text" else list(request.token_ids.ids)
            params = params_from_proto(request.sampling)
            rid = request.request_id or uuid.uuid4().hex
            stream = self.router.submit(prompt, params, rid)
        except InvalidRequestError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{e.field}: {e}")
        except OverloadedError as e:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except EngineError as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, str(e))

        finished = threading.Event()

        def on_terminate() -> None:  # runs when the call ends for any reason (also normal completion)
            if not finished.is_set():
                self.router.abort(rid)

        if not context.add_callback(on_terminate):  # the call already ended while we submitted
            self.router.abort(rid)
            return
        completion = 0
        try:
            while True:
                try:
                    o: TokenOutput = stream.get(timeout=_LIVENESS_S)
                except queue.Empty:
                    if not context.is_active():
                        return
                    continue
                if o.finish_reason == "error":
                    finished.set()
                    context.abort(grpc.StatusCode.UNAVAILABLE, o.error or "the rank failed")
                completion += len(o.token_ids)
                resp = pb.GenerateResponse(request_id=rid, text=o.text, token_ids=o.token_ids,
                                           finish_reason=FINISH.get(o.finish_reason, pb.FINISH_REASON_UNSPECIFIED))
                if o.finish_reason is not None:
                    finished.set()
                    p = stream.out.prompt_tokens
                    resp.usage.CopyFrom(pb.Usage(prompt_tokens=p, completion_tokens=completion,
                                                 total_tokens=p + completion))
                    if o.finish_reason == "abort" and not context.is_active():
                        return
                yield resp
                if o.finish_reason is not None:
                    return
        finally:
            # GeneratorExit (grpc closed the iterator) or an exception: make sure the rank lets go.
            if not finished.is_set():
                finished.set()
                self.router.abort(rid)

    def Cancel(self, request: pb.CancelRequest, context: grpc.ServicerContext) -> pb.CancelResponse:
        self._auth(context)
        if not request.request_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id: request_id is empty")
        found = is_in_flight(self.router, request.request_id)
        if found:
            self.router.abort(request.request_id)
        return pb.CancelResponse(found=found)

    def Health(self, request: pb.HealthRequest, context: grpc.ServicerContext) -> pb.HealthResponse:
        h = self.router.health()
        ranks, ok = h["ranks"], h["ok"]
        return pb.HealthResponse(
            status=pb.HealthResponse.STATUS_SERVING if ok else pb.HealthResponse.STATUS_NOT_SERVING,
            ranks=[pb.RankHealth(rank=r["rank"], ok=bool(r.get("ok")), error=r.get("error") or "") for r in ranks])

    def ListModels(self, request: pb.ListModelsRequest, context: grpc.ServicerContext) -> pb.ListModelsResponse:
        self._auth(context)
        return pb.ListModelsResponse(models=[pb.ModelInfo(
            id=self.model_name, max_model_len=self.router.cfg.max_model_len, vocab_size=self.router.vocab_size,
            ranks=self.router.cfg.ranks)])

    def GetClusterStats(self, request: pb.GetClusterStatsRequest, context: grpc.ServicerContext) -> pb.ClusterStats:
        self._auth(context)
        try:
            s = self.router.stats()
        except Exception as e:  # noqa: BLE001 - a rank did not answer
            context.abort(grpc.StatusCode.UNAVAILABLE, f"cluster stats unavailable: {type(e).__name__}: {e}")
        return pb.ClusterStats(
            in_flight=s["in_flight"], running=s["running"], waiting=s["waiting"],
            kv_blocks_total=s["kv_blocks_total"], kv_blocks_free=s["kv_blocks_free"],
            layers=[pb.LayerLoad(**row) for row in s["layers"]],
            ranks=[pb.RankStats(rank=r["rank"], kv_blocks_total=r["kv_blocks_total"], kv_blocks_free=r["kv_blocks_free"],
                                running=r["running"], waiting=r["waiting"], steps=int(r.get("steps", 0)),
                                failed=r.get("failed") or "") for r in s["ranks"]])


class GrpcServer:
    """A started gRPC server and the port it bound (`port=0` picks a free one).

    Args:
        max_workers: worker threads; each streaming call holds one. Calls beyond it are refused with
            RESOURCE_EXHAUSTED at once rather than queued (`maximum_concurrent_rpcs`).
    Raises:
        RuntimeError: the address cannot be bound.
    """

    def __init__(self, servicer: MoerayServicer, host: str = "127.0.0.1", port: int = 0, max_workers: int = 64):
        self.servicer = servicer
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
                                  maximum_concurrent_rpcs=max_workers)
        pb_grpc.add_MoerayServicer_to_server(servicer, self.server)
        addr = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            self.port = self.server.add_insecure_port(addr)
        except RuntimeError as e:
            raise RuntimeError(f"cannot bind gRPC server to {addr}: {e}") from e
        if self.port == 0:
            raise RuntimeError(f"cannot bind gRPC server to {addr}")
        self.host = host
        self.server.start()
        log.info("gRPC server on %s:%d", host, self.port)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def stop(self, grace_s: float = 2.0) -> None:
        self.server.stop(grace_s).wait()

    def wait(self) -> None:
        self.server.wait_for_termination()


def start_grpc_server(router: Router, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None,
                      model_name: str | None = None, max_workers: int = 64) -> GrpcServer:
    """Serve `router` over gRPC; returns the started server (see `GrpcServer`)."""
    return GrpcServer(MoerayServicer(router, model_name, api_key), host, port, max_workers)


def main(argv: list[str] | None = None) -> int:
    """Standalone gRPC server: start (or join) Ray, bring up the EP cluster, serve until interrupted."""
    import ray

    from cluster.config import DEFAULT_MODEL, ClusterConfig
    from cluster.launcher import EPCluster

    ap = argparse.ArgumentParser(prog="python -m router_service.grpc_server")
    ap.add_argument("--model", default=os.environ.get("MOERAY_MODEL", DEFAULT_MODEL))
    ap.add_argument("--ranks", type=int, default=None)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=50051)
    ap.add_argument("--api-key", default=os.environ.get("MOERAY_API_KEY"))
    ap.add_argument("--max-queue", type=int, default=256)
    a = ap.parse_args(argv)
    logging.basicConfig(level=os.environ.get("MOERAY_LOG", "INFO"))
    cfg = ClusterConfig.auto(model=a.model, **({"ranks": a.ranks} if a.ranks else {}))
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False, log_to_driver=False)
    router = Router(EPCluster(cfg), max_queue=a.max_queue)
    server = start_grpc_server(router, a.host, a.port, a.api_key)
    print(f"moeray gRPC on {server.address}", flush=True)
    # a KeyboardInterrupt does not reach a main thread parked in wait_for_termination: wait on signals
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        while not stop.wait(1.0):
            pass
    finally:
        server.stop()
        router.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
