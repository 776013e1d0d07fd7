"""The Ray Serve deployment `MoerayServer` (one replica = one EP cluster) and its application builder
`build_app`; the HTTP routes it serves as its ingress are in `router_service.http.app`.

`build_app(args)` (public import path `router_service.serve_app:build_app`, used by deploy/serve_config.yaml,
k8s/rayservice.yaml and `moeray serve`) binds `MoerayServer`, a deployment whose replica builds one EP
cluster in its constructor (a placement group plus one Ray actor per rank, owned by the replica, so they go
away with it) and serves the HTTP app over it, plus the `moeray.v1.Moeray` gRPC methods for Serve's gRPC
proxy (`grpc_options.grpc_servicer_functions: [GRPC_SERVICER_FUNCTION]`; see `MoerayServer`).
Graceful shutdown: `MoerayServer.drain` (`Router.drain`).
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from contextlib import aclosing

import grpc

from router_service.grpc.rpc import MoerayRpc, RpcError
from router_service.http.app import create_app
from router_service.http.models import ServeAppArgs
from router_service.http.serving import OpenAIServer
from router_service.request_timeout import RequestTimedOut
from router_service.router import Router

log = logging.getLogger("moeray.http")

# `grpc_options.grpc_servicer_functions` entry that puts moeray.v1.Moeray on Serve's gRPC proxy
GRPC_SERVICER_FUNCTION = "router_service.proto.moeray.v1.moeray_pb2_grpc.add_MoerayServicer_to_server"


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
# (DEADLINE_EXCEEDED: a call ran past the server's request timeout, an expected end, not a fault)
CLIENT_ERROR_CODES = frozenset(getattr(grpc.StatusCode, n) for n in (
    "CANCELLED", "INVALID_ARGUMENT", "NOT_FOUND", "OUT_OF_RANGE", "FAILED_PRECONDITION", "UNAUTHENTICATED",
    "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"))


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

    # the replica (front door, router) at niceness 0 like its rank actors (`ClusterConfig.rank_niceness`), not at
    # Ray's 15 for workers: below nice-0 ranks it starves where they hold every core, and at 15 any nice-0 process
    # preempts it
    @serve.deployment(name="MoerayServer", max_ongoing_requests=300, health_check_period_s=10,
                      health_check_timeout_s=30, ray_actor_options={
                          "num_cpus": 0.25, "runtime_env": {"env_vars": {"RAY_worker_niceness": "0"}}})
    @serve.ingress()
    class MoerayServer:
        """One replica = one EP cluster (placement group + rank actors, built once here), serving
        - HTTP: the OpenAI-style app (`create_app`) as the Serve ingress;
        - gRPC through Serve's gRPC proxy: the methods `Generate` (server-streaming), `Cancel`, `Health`,
          `ListModels`, `GetClusterStats` answer `moeray.v1.Moeray` when the Serve config has `grpc_options`
          with `GRPC_SERVICER_FUNCTION` (deploy/serve_config.yaml). They reuse `router_service.grpc.rpc.MoerayRpc`, so the
          status codes, the API key and the abort-on-disconnect behaviour are the standalone server's. Clients
          send metadata `application: <app name>` (optional while Serve runs one application). With several
          replicas the proxy may route `Cancel` to a replica that does not hold the request (`found=false`);
          cancelling the Generate call itself always reaches the right one;
        - optionally the replica's own HTTP listener (`args.http_port`, `router_service.serve.listener`): the same
          app without the proxy hop per SSE event; `moeray serve` serves HTTP this way;
        - the request timeout (`args.request_timeout_s`, `router_service.request_timeout`) on every path: HTTP
          504; a Generate, proxied or on the replica's own server, still generating past it is aborted on its
          rank and ends with DEADLINE_EXCEEDED naming the limit;
        - optionally the replica's own gRPC server (`args.grpc_port`), kept for `moeray serve`: Serve 2.60's
          gRPC proxy binds every interface (`[::]`, no host option), the replica's server binds `grpc_host`
          (127.0.0.1 by default). One port per replica, so use it with a single replica.
        Several replicas are independent data-parallel copies.

        Raises:
            ValueError / pydantic.ValidationError: bad arguments. (An EP group that cannot be built is reported by
            `health_report` / `check_health`, status "failed".)
        """

        def __init__(self, args: dict):
            from cluster.config import ClusterConfig

            self.args = ServeAppArgs.model_validate(args)
            if not any(isinstance(f, ClientErrorLogFilter) for f in logging.getLogger("ray.serve").filters):
                logging.getLogger("ray.serve").addFilter(ClientErrorLogFilter())
            self.api_key = self.args.api_key if self.args.api_key is not None else os.environ.get("MOERAY_API_KEY")
            cfg = ClusterConfig(**resolve_args(self.args))
            # the EP group is built in the background: until it is up (placement may wait for a node), every
            # request gets 503 + Retry-After and /health says "starting", instead of hanging on a constructor
            # Serve has not finished (the old replica may already be gone)
            self.router = Router(cfg, max_queue=self.args.max_queue)
            # not `self.app`: the ingress wrapper owns that name (a read-only property)
            self.http_app = create_app(self.router, model_name=self.args.served_model_name, api_key=self.api_key,
                                       max_body_bytes=self.args.max_body_bytes,
                                       request_timeout_s=self.args.request_timeout_s)
            self.http: OpenAIServer = self.http_app.state.server
            # proxy gRPC calls are timed by `self.http.outputs` (below); the replica's own gRPC server is given
            # the same Metrics, so one /metrics covers both protocols
            self.rpc = MoerayRpc(self.router, self.args.served_model_name, self.api_key, metrics=self.http.metrics)
            self.grpc = None
            if self.args.grpc_port is not None:
                from router_service.grpc.server import start_grpc_server

                self.grpc = start_grpc_server(self.router, self.args.grpc_host, self.args.grpc_port, self.api_key,
                                              self.args.served_model_name, metrics=self.http.metrics,
                                              request_timeout_s=self.args.request_timeout_s)
            self.listener = None
            if self.args.http_port is not None:  # HTTP straight from this replica (no proxy hop per event)
                from router_service.serve.listener import HTTPListener

                self.listener = HTTPListener(self.http_app, self.args.http_host, self.args.http_port).start()
            log.info("MoerayServer up: %s, %d ranks (EP group being built)", cfg.model, cfg.ranks)

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
            and `call.close()` aborts the request on its rank. Past the server's request timeout (HTTP's rule,
            `self.http.outputs`) the request is aborted on its rank and the call ends with DEADLINE_EXCEEDED."""
            call = await self._unary(grpc_context, self.rpc.start, request, grpc_context.invocation_metadata(),
                                     False, auth=False)  # authorized and counted by start; timed by outputs
            try:
                async with aclosing(self.http.outputs(call.streams, "grpc")) as outs:  # shares the latency metrics
                    try:
                        async for i, o in outs:
                            try:
                                resp = call.response(o, i)
                            except RpcError as e:
                                _fail(grpc_context, e)
                            yield resp
                            if call.finished:
                                return
                    except RequestTimedOut as e:  # `outputs` already aborted the requests on their ranks
                        call.close("DEADLINE_EXCEEDED")
                        _fail(grpc_context, RpcError(grpc.StatusCode.DEADLINE_EXCEEDED, str(e)))
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

        def health_report(self) -> dict:
            """`Router.health()` of this replica (`moeray serve` waits on it for the EP group to be up)."""
            return self.router.health()

        def check_health(self) -> None:
            """Serve's replica health check. The router builds and rebuilds the EP group itself (see
            `router_service.router`), so the replica stays healthy while it does; it is reported unhealthy
            (and Serve replaces it) if the group cannot be built (bad configuration) or a rebuild has not
            succeeded within 120 s."""
            h = self.router.health()
            if h["status"] == "failed":
                raise RuntimeError(h["error"])
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
            if getattr(self, "listener", None) is not None:
                self.listener.stop()
            if getattr(self, "grpc", None) is not None:
                self.grpc.stop(0)
            if getattr(self, "router", None) is not None:
                self.router.close()


def wait_ready(handle, timeout_s: float | None = None, say=None) -> str | None:
    """Wait until the replica behind `handle` (a `MoerayServer` app handle) has built its EP group; meanwhile the
    app answers 503 + Retry-After. `say(message)` is called with each new stage. Returns None once it is up, or
    why it cannot be built. Raises TimeoutError after `timeout_s` seconds (None: no limit)."""
    deadline, said = None if timeout_s is None else time.monotonic() + timeout_s, None
    while True:
        h = handle.health_report.remote().result(timeout_s=60)
        if h["status"] == "failed":
            return h["error"]
        if h["status"] != "starting":
            return None
        if say is not None and h.get("error") != said:
            said = h.get("error")
            say(said)
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"{h.get('error')}: not up within {timeout_s} s")
        time.sleep(0.25)


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
