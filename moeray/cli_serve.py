"""`moeray serve`: OpenAI-style HTTP through Ray Serve plus the gRPC API, over one EP cluster.

    moeray serve --model models/tiny-moe --ranks 2 --http-port 8000 --grpc-port 50051

Both listen on --host (127.0.0.1 unless told otherwise). With --http-port > 0 the EP cluster lives in
the Serve replica (`router_service.serve_app.MoerayServer`) and the gRPC server runs in that replica
too, sharing its router; with --http-port 0 no Serve is started and the gRPC server runs in this
process (a standalone server). The API key, if any, comes from --api-key or $MOERAY_API_KEY.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from cluster.config import DEFAULT_MODEL


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve the model over OpenAI-style HTTP (Ray Serve) and gRPC",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=os.environ.get("MOERAY_MODEL", DEFAULT_MODEL), help="model folder (HF layout)")
    p.add_argument("--ranks", type=int, default=None, help="EP ranks (default: 2 on CPU, one per GPU)")
    p.add_argument("--host", default="127.0.0.1", help="address both servers bind")
    p.add_argument("--http-port", type=int, default=8000, help="HTTP port (0: no HTTP, no Serve)")
    p.add_argument("--grpc-port", type=int, default=50051, help="gRPC port (0: no gRPC)")
    p.add_argument("--api-key", default=None, help="required bearer key (default: $MOERAY_API_KEY; none if unset)")
    p.add_argument("--max-queue", type=int, default=256, help="requests in flight before 503 / RESOURCE_EXHAUSTED")
    p.add_argument("--served-model-name", default=None, help="public model id (default: the model folder's name)")
    p.add_argument("--address", default=None, help="Ray address (else RAY_ADDRESS, else a private local Ray)")
    p.set_defaults(func=cmd_serve)


def _validate(a) -> str | None:
    if a.http_port == 0 and a.grpc_port == 0:
        return "--http-port 0 and --grpc-port 0: nothing to serve"
    for name in ("http_port", "grpc_port"):
        v = getattr(a, name)
        if not 0 <= v <= 65535:
            return f"--{name.replace('_', '-')}={v} must be in [0, 65535]"
    if a.ranks is not None and a.ranks < 1:
        return f"--ranks={a.ranks} must be >= 1"
    if not os.path.isfile(os.path.join(a.model, "config.json")):
        return f"--model={a.model!r}: no config.json there"
    return None


def cmd_serve(a) -> int:
    err = _validate(a)
    if err:
        print(f"moeray: error: {err}", file=sys.stderr)
        return 2
    import ray

    api_key = a.api_key if a.api_key is not None else os.environ.get("MOERAY_API_KEY")
    if a.http_port == 0:
        return _grpc_only(a, api_key)

    from ray import serve

    from router_service.http_models import ServeAppArgs
    from router_service.serve_app import build_app

    addr = a.address or os.environ.get("RAY_ADDRESS")
    if not ray.is_initialized():
        if addr:
            ray.init(address=addr, log_to_driver=True)
        else:
            ray.init(include_dashboard=False)
    import torch

    ranks = a.ranks or (torch.cuda.device_count() or 2)  # as LLM / ClusterConfig.auto: one per GPU, else 2
    args = ServeAppArgs(model=os.path.abspath(a.model), ranks=ranks, max_queue=a.max_queue, api_key=api_key,
                        grpc_port=a.grpc_port or None, grpc_host=a.host, served_model_name=a.served_model_name)
    serve.start(http_options={"host": a.host, "port": a.http_port})
    # one replica (the deployment's default) owns the EP cluster; deploy/serve_config.yaml autoscales instead
    app = build_app(args)
    serve.run(app, name="moeray", route_prefix="/", blocking=False)
    print(f"moeray: HTTP on http://{a.host}:{a.http_port}/v1"
          + (f", gRPC on {a.host}:{a.grpc_port}" if a.grpc_port else ""), file=sys.stderr, flush=True)
    try:
        _wait_for_signal()
    finally:
        serve.shutdown()
    return 0


def _wait_for_signal() -> None:
    """Block until SIGINT or SIGTERM. A signal handler plus an Event, because a KeyboardInterrupt does not
    reach a main thread parked in grpc's `wait_for_termination`."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass


def _grpc_only(a, api_key: str | None) -> int:
    from moeray.api import LLM
    from router_service.grpc_server import start_grpc_server

    try:
        llm = LLM(model=a.model, ranks=a.ranks, address=a.address, max_queue=a.max_queue)
    except (ValueError, FileNotFoundError) as e:
        print(f"moeray: error: {e}", file=sys.stderr)
        return 2
    try:
        server = start_grpc_server(llm.router, a.host, a.grpc_port, api_key, a.served_model_name)
    except RuntimeError as e:
        llm.shutdown()
        print(f"moeray: error: {e}", file=sys.stderr)
        return 2
    print(f"moeray: gRPC on {server.address}", file=sys.stderr, flush=True)
    try:
        _wait_for_signal()
    finally:
        server.stop()
        llm.shutdown()
    return 0
