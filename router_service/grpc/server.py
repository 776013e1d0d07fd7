"""Standalone gRPC server of `moeray.v1.Moeray`: a synchronous `grpc.server` over `MoerayRpc`
(`router_service.grpc.rpc`, which holds the RPC logic and the guarantees both transports give), with
server reflection, and a `main` that runs it alone.

`moeray serve` uses it (in its own process with `--http-port 0`, else inside the Serve replica) because it
binds the host it is given (127.0.0.1 by default), while Serve 2.60's gRPC proxy always binds every interface.

A Generate call still generating `request_timeout_s` (default 600 s, `--request-timeout-s`) after it was
admitted is aborted on its rank at once (as a client cancel: KV blocks freed) and ends with DEADLINE_EXCEEDED,
`the request ran past the server's request timeout of 600 s (--request-timeout-s) and was stopped`
(`router_service.request_timeout`, HTTP's 504 rule); a client's own shorter deadline ends it first, as before.

The standalone server admits `max_queue + CONTROL_HEADROOM` concurrent calls (one thread each), so the
router's queue limit, not the thread pool, decides when Generate gets RESOURCE_EXHAUSTED.

`python -m router_service.grpc.server --model DIR --ranks 2 --port 50051` runs it alone (no Serve).
"""
from __future__ import annotations

import argparse
import logging
import os
import queue
import signal
import sys
import threading
import time
from concurrent import futures

import grpc
from grpc_reflection.v1alpha import reflection

from router_service.grpc.rpc import GenerateCall, MoerayRpc, RpcError
from router_service.proto.moeray.v1 import moeray_pb2 as pb
from router_service.proto.moeray.v1 import moeray_pb2_grpc as pb_grpc
from router_service.request_timeout import REQUEST_TIMEOUT_S, RequestTimedOut, check_request_timeout
from router_service.router import Router

log = logging.getLogger("moeray.grpc")

# How often a blocked stream re-checks that its call is still alive (s). The abort itself is immediate
# (callback); this only bounds how long a worker thread lingers if a rank never answers.
_LIVENESS_S = 0.5


class MoerayServicer(pb_grpc.MoerayServicer):
    """`moeray.v1.Moeray` for a `grpc.server` (the standalone server): `MoerayRpc` plus
    `context.abort` for errors and `context.add_callback` for calls that end early.

    Args: as `MoerayRpc`, plus request_timeout_s: a Generate call still generating this many seconds after it was
        admitted is aborted on its rank and ends with DEADLINE_EXCEEDED (None: no limit).

    Raises:
        ValueError: request_timeout_s <= 0 (`request_timeout_s=0 must be > 0 ...`).
    """

    def __init__(self, router: Router, model_name: str | None = None, api_key: str | None = None, metrics=None,
                 request_timeout_s: float | None = REQUEST_TIMEOUT_S):
        self.request_timeout_s = check_request_timeout(request_timeout_s)
        self.rpc = MoerayRpc(router, model_name, api_key, metrics)
        self.router, self.model_name, self.api_key = router, self.rpc.model_name, self.rpc.api_key

    @staticmethod
    def _call(context: grpc.ServicerContext, fn, *args):
        try:
            return fn(*args)
        except RpcError as e:
            context.abort(e.code, e.details)  # raises

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext):
        call: GenerateCall = self._call(context, self.rpc.start, request, context.invocation_metadata())
        # runs when the call ends for any reason, also normal completion (then close() does nothing)
        if not context.add_callback(call.close):  # the call already ended while we submitted
            call.close()
            return
        T = self.request_timeout_s
        end_at = None if T is None else time.monotonic() + T  # the server's request timeout, from admission
        outs: queue.Queue = queue.Queue()  # (prompt index, output) of every prompt of the call
        for i, s in enumerate(call.streams):
            s.attach_queue(outs, i)
        try:
            while True:
                left = _LIVENESS_S if end_at is None else min(_LIVENESS_S, end_at - time.monotonic())
                if left <= 0:  # past the request timeout: abort on the ranks now (as a cancel), then end the call
                    call.close("DEADLINE_EXCEEDED")
                    context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(RequestTimedOut(T)))  # raises
                try:
                    i, o = outs.get(timeout=left)
                except queue.Empty:
                    if not context.is_active():
                        return
                    continue
                resp = self._call(context, call.response, o, i)
                if o.finish_reason == "abort" and not context.is_active():
                    return
                yield resp
                if call.finished:
                    return
        finally:
            call.close()  # GeneratorExit (grpc closed the iterator) or an exception: make sure the rank lets go

    def Cancel(self, request: pb.CancelRequest, context: grpc.ServicerContext) -> pb.CancelResponse:
        self._call(context, self.rpc.authorize, context.invocation_metadata())
        return self._call(context, self.rpc.cancel, request)

    def Health(self, request: pb.HealthRequest, context: grpc.ServicerContext) -> pb.HealthResponse:
        return self.rpc.health()  # no key: probes must work

    def ListModels(self, request: pb.ListModelsRequest, context: grpc.ServicerContext) -> pb.ListModelsResponse:
        self._call(context, self.rpc.authorize, context.invocation_metadata())
        return self.rpc.list_models()

    def GetClusterStats(self, request: pb.GetClusterStatsRequest, context: grpc.ServicerContext) -> pb.ClusterStats:
        self._call(context, self.rpc.authorize, context.invocation_metadata())
        return self._call(context, self.rpc.cluster_stats)


# Concurrent RPCs admitted beyond the router's queue limit, so that Cancel / Health / ListModels /
# GetClusterStats still get a thread while `max_queue` Generate streams are open.
CONTROL_HEADROOM = 16


class GrpcServer:
    """A started gRPC server and the port it bound (`port=0` picks a free one).

    Each streaming call holds one worker thread for its whole life, so the thread pool and grpc's
    `maximum_concurrent_rpcs` are both `max_concurrency`: by default the router's `max_queue` plus
    `CONTROL_HEADROOM` (16) for unary calls. A Generate beyond the queue limit thus reaches the router and
    gets its RESOURCE_EXHAUSTED ("... the queue limit is N"); calls beyond `max_concurrency` are refused by
    grpc with RESOURCE_EXHAUSTED at once rather than queued.

    Raises:
        RuntimeError: the address cannot be bound. ValueError: max_concurrency < 1.
    """

    def __init__(self, servicer: MoerayServicer, host: str = "127.0.0.1", port: int = 0,
                 max_concurrency: int | None = None):
        if max_concurrency is None:
            max_concurrency = servicer.router.max_queue + CONTROL_HEADROOM
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency={max_concurrency} must be >= 1")
        self.servicer = servicer
        self.max_concurrency = max_concurrency
        # ThreadPoolExecutor starts threads on demand, so a large limit costs nothing while idle
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="grpc"),
                                  maximum_concurrent_rpcs=max_concurrency)
        pb_grpc.add_MoerayServicer_to_server(servicer, self.server)
        # server reflection (as Serve's gRPC proxy offers): `grpcurl -plaintext HOST:PORT list` / `describe` work
        # without the .proto; it exposes the schema only, which ships in the package anyway
        reflection.enable_server_reflection(
            (pb.DESCRIPTOR.services_by_name["Moeray"].full_name, reflection.SERVICE_NAME), self.server)
        addr = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            self.port = self.server.add_insecure_port(addr)
        except RuntimeError as e:
            raise RuntimeError(f"cannot bind gRPC server to {addr}: {e}") from e
        if self.port == 0:
            raise RuntimeError(f"cannot bind gRPC server to {addr}")
        self.host = host
        self.server.start()
        log.info("gRPC server on %s:%d (at most %d concurrent calls)", host, self.port, max_concurrency)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def stop(self, grace_s: float = 2.0) -> None:
        self.server.stop(grace_s).wait()

    def wait(self) -> None:
        self.server.wait_for_termination()


def start_grpc_server(router: Router, host: str = "127.0.0.1", port: int = 0, api_key: str | None = None,
                      model_name: str | None = None, max_concurrency: int | None = None, metrics=None,
                      request_timeout_s: float | None = REQUEST_TIMEOUT_S) -> GrpcServer:
    """Serve `router` over gRPC; returns the started server (see `GrpcServer` for `max_concurrency`; `metrics`:
    see `MoerayRpc`; `request_timeout_s`: see `MoerayServicer`).

    Raises:
        ValueError: request_timeout_s <= 0 or max_concurrency < 1. RuntimeError: the address cannot be bound.
    """
    servicer = MoerayServicer(router, model_name, api_key, metrics, request_timeout_s)
    return GrpcServer(servicer, host, port, max_concurrency)


def main(argv: list[str] | None = None) -> int:
    """Standalone gRPC server: start (or join) Ray, bring up the EP cluster, serve until interrupted."""
    import ray

    from cluster.config import CLI_PLACEMENT_TIMEOUT_S, DEFAULT_MODEL, ClusterConfig, check_placement_timeout
    from cluster.launcher import EPCluster, PlacementTimeoutError

    ap = argparse.ArgumentParser(prog="python -m router_service.grpc.server")
    ap.add_argument("--model", default=os.environ.get("MOERAY_MODEL", DEFAULT_MODEL))
    ap.add_argument("--ranks", type=int, default=None)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=50051)
    ap.add_argument("--api-key", default=os.environ.get("MOERAY_API_KEY"))
    ap.add_argument("--max-queue", type=int, default=256, help="requests in flight before RESOURCE_EXHAUSTED")
    ap.add_argument("--max-concurrency", type=int, default=None,
                    help=f"concurrent calls (threads) at most; default --max-queue + {CONTROL_HEADROOM}")
    ap.add_argument("--request-timeout-s", type=float, default=REQUEST_TIMEOUT_S,
                    help=f"a Generate call still generating after this many seconds is aborted with "
                         f"DEADLINE_EXCEEDED (default {REQUEST_TIMEOUT_S:g})")
    ap.add_argument("--placement-timeout-s", type=float, default=CLI_PLACEMENT_TIMEOUT_S,
                    help="seconds to wait for Ray to place the ranks before exiting 1 with what could not be placed "
                         f"(default {CLI_PLACEMENT_TIMEOUT_S:g})")
    a = ap.parse_args(argv)
    if not a.request_timeout_s > 0:
        ap.error(f"--request-timeout-s={a.request_timeout_s} must be > 0")
    try:
        check_placement_timeout(a.placement_timeout_s)
    except ValueError as e:
        ap.error(f"--{str(e).replace('_', '-')}")
    logging.basicConfig(level=os.environ.get("MOERAY_LOG", "INFO"))
    cfg = ClusterConfig.auto(model=a.model, placement_timeout_s=a.placement_timeout_s,
                             **({"ranks": a.ranks} if a.ranks else {}))
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False, log_to_driver=False)
    try:
        cluster = EPCluster(cfg)
    except PlacementTimeoutError as e:
        print(f"error: could not bring up the cluster: {e}", file=sys.stderr)
        return 1
    router = Router(cluster, max_queue=a.max_queue)
    server = start_grpc_server(router, a.host, a.port, a.api_key, max_concurrency=a.max_concurrency,
                               request_timeout_s=a.request_timeout_s)
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
