"""`moeray serve`: OpenAI-style HTTP through Ray Serve plus the gRPC API, over one EP cluster.

    moeray serve --model models/tiny-moe --ranks 2 --http-port 8000 --grpc-port 50051

Both listen on --host (127.0.0.1 unless told otherwise). With --http-port > 0 the EP cluster lives in
the Serve replica (`router_service.serve.deployment.MoerayServer`), which serves HTTP itself on --http-port
(`--http-via replica`, the default: no Serve proxy hop per streamed event; `--http-via proxy`: through Ray
Serve's HTTP proxy), and the gRPC server runs in that replica too, sharing its router; with --http-port 0 no Serve is started and the gRPC server runs in this
process (a standalone server). `--grpc-proxy` answers gRPC through Ray Serve's own gRPC proxy instead
(the path deploy/serve_config.yaml uses), which binds every interface whatever --host says (Serve 2.60
has no host option for it). The gRPC server admits --max-queue streams plus a few control calls.
--request-timeout-s holds on every server this starts: HTTP 504, gRPC Generate DEADLINE_EXCEEDED (aborted on its rank).
The API key, if any, comes from --api-key or $MOERAY_API_KEY.

Ray token authentication: when this command starts its own local Ray (no --address / $RAY_ADDRESS, or
the address `local`), it starts it with RAY_AUTH_MODE=token unless RAY_AUTH_MODE is already set (Ray
then generates a token in ~/.ray/auth_token, or uses $RAY_AUTH_TOKEN / $RAY_AUTH_TOKEN_PATH); to join
a cluster, set RAY_AUTH_MODE and RAY_AUTH_TOKEN as that cluster requires. On a cluster the app is this command's:
a failed deploy is deleted before it exits, and a cluster-side watchdog (`router_service.serve.watchdog`) deletes
the app once this command stops renewing its lease (killed by any signal); `--detach` leaves the app running.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading

from cluster.config import DEFAULT_MODEL
from router_service.http.models import ServeAppArgs


def add_parser(sub) -> None:
    from moeray.cli import HelpFormatter

    p = sub.add_parser("serve", help="serve the model over OpenAI-style HTTP (Ray Serve) and gRPC",
                       formatter_class=HelpFormatter)
    p.add_argument("--model", default=os.environ.get("MOERAY_MODEL", DEFAULT_MODEL), help="model folder (HF layout)")
    p.add_argument("--ranks", type=int, default=None, help="EP ranks (default: 2 on CPU, one per GPU)")
    p.add_argument("--host", default="127.0.0.1", help="address both servers bind")
    p.add_argument("--http-port", type=int, default=8000, help="HTTP port (0: no HTTP, no Serve)")
    p.add_argument("--grpc-port", type=int, default=50051, help="gRPC port (0: no gRPC)")
    p.add_argument("--api-key", default=None, help="required bearer key (default: $MOERAY_API_KEY; none if unset)")
    p.add_argument("--max-queue", type=int, default=ServeAppArgs.model_fields["max_queue"].default,
                   help="requests in flight (running + queued) before 503 / RESOURCE_EXHAUSTED (default: by memory, "
                        "1024 at max_model_len 4096)")
    p.add_argument("--max-body-bytes", type=int, default=4 << 20,
                   help="HTTP request bodies above this many bytes get 413 before they are parsed (4 MiB)")
    p.add_argument("--request-timeout-s", type=float, default=ServeAppArgs.model_fields["request_timeout_s"].default,
                   help="a request still generating after this many seconds is aborted: HTTP 504, gRPC "
                        "DEADLINE_EXCEEDED, on every server this starts")
    p.add_argument("--served-model-name", default=None, help="public model id (default: the model folder's name)")
    p.add_argument("--address", default=None, help="Ray address (else RAY_ADDRESS, else a private local Ray)")
    p.add_argument("--detach", action="store_true",
                   help="with --address: exit once the app is up and leave it running on the cluster (without it, "
                        "a cluster-side watchdog deletes the app within 30 s of this command's end, SIGKILL included)")
    p.add_argument("--http-via", choices=("replica", "proxy"), default="replica",
                   help="replica: the Serve replica serves HTTP itself on --http-port (no proxy hop per streamed "
                        "event; Serve still manages the replica); proxy: through Ray Serve's HTTP proxy")
    p.add_argument("--grpc-proxy", action="store_true",
                   help="serve gRPC through Ray Serve's gRPC proxy on --grpc-port (binds every interface, "
                        "not --host) instead of the replica's own server on --host")
    from moeray.cli import add_engine_args

    add_engine_args(p)  # what each rank runs: --kv-bits, --gating, --weight-bits, ... as for `generate`
    p.set_defaults(func=cmd_serve)


def _validate(a) -> str | None:
    if a.http_port == 0 and a.grpc_port == 0:
        return "--http-port 0 and --grpc-port 0: nothing to serve"
    for name in ("http_port", "grpc_port"):
        v = getattr(a, name)
        if not 0 <= v <= 65535:
            return f"--{name.replace('_', '-')}={v} must be in [0, 65535]"
    if a.grpc_proxy and (a.http_port == 0 or a.grpc_port == 0):
        return "--grpc-proxy needs Serve and a gRPC port: --http-port and --grpc-port must be > 0"
    if a.detach and (a.http_port == 0 or owns_local_ray(a.address or os.environ.get("RAY_ADDRESS"))):
        return "--detach needs --address (or $RAY_ADDRESS) and --http-port > 0: a private Ray or a gRPC-only " \
               "server ends with this command"
    if a.ranks is not None and a.ranks < 1:
        return f"--ranks={a.ranks} must be >= 1"
    if a.max_body_bytes < 0:
        return f"--max-body-bytes={a.max_body_bytes} must be >= 0"
    if not a.request_timeout_s > 0:
        return f"--request-timeout-s={a.request_timeout_s} must be > 0"
    if not os.path.isfile(os.path.join(a.model, "config.json")):
        return f"--model={a.model!r}: no config.json there"
    return None


class _DropRecord(logging.Filter):
    """Drops log records whose message contains `text`."""

    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def _port_problem(a) -> str | None:
    """Where this machine's servers would bind (a private local Ray: the Serve proxies and the replica run here),
    a port that cannot be bound now, named by its flag. Serve's HTTP proxy shares a port with another listener
    that set SO_REUSEPORT (a second `moeray serve` on the same port) without an error, and a plainly busy port
    fails only ~10 s later inside Ray with a traceback; a test bind and listen catch both at once. The test socket
    sets SO_REUSEADDR, as the real listeners do: the connections of a server stopped a moment ago (TIME_WAIT, ~60 s)
    do not make its port busy."""
    import socket

    if not owns_local_ray(a.address or os.environ.get("RAY_ADDRESS")):
        return None  # the proxies and the replica may run on other nodes
    checks = [("--http-port", a.host, a.http_port)] if a.http_port else []
    if a.grpc_port:
        checks.append(("--grpc-port", "0.0.0.0" if a.grpc_proxy else a.host, a.grpc_port))
    for flag, host, port in checks:
        try:
            family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind((host, port))
                s.listen(1)
        except OSError as e:
            return f"{flag}={port}: cannot listen on {host}:{port} ({e.strerror or e}); choose another port"
    return None


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def owns_local_ray(address: str | None) -> bool:
    """True when `ray.init(address=address)` starts a new local Ray (no address, or `local`)."""
    return not address or address == "local"


def enable_ray_token_auth() -> bool:
    """Turn on Ray token authentication for a local Ray this process is about to start, unless the user
    chose a mode (RAY_AUTH_MODE set, also to `disabled`). Returns True if it set RAY_AUTH_MODE=token.

    Ray reads RAY_AUTH_MODE into its cached config when `ray` is imported, so setting the variable alone
    afterwards makes `ray.init()` fail (`AuthenticationError: ... RAY_AUTH_MODE is currently 'disabled'`,
    seen with Ray 2.60): the config is re-read here, as Ray's own default-on path does. Ray >= 2.52 then
    writes a token to ~/.ray/auth_token if none exists (or takes $RAY_AUTH_TOKEN / $RAY_AUTH_TOKEN_PATH).
    If the config cannot be re-read (a Ray without this API), the variable is left unset and Ray's own
    default applies (2.60: token auth on for a new local cluster).
    """
    if os.environ.get("RAY_AUTH_MODE") is not None:
        return False
    os.environ["RAY_AUTH_MODE"] = "token"
    try:
        from ray._raylet import Config

        Config.initialize("")
    except (ImportError, AttributeError) as e:
        del os.environ["RAY_AUTH_MODE"]
        print(f"moeray: cannot switch Ray to token auth ({e}); Ray's default applies", file=sys.stderr)
        return False
    return True


def init_ray(address: str | None) -> None:
    """Join `address`, or start a private local Ray with token authentication (see `enable_ray_token_auth`), also
    when a `ray start` cluster runs on this machine. Does nothing if Ray is already initialized in this process."""
    import ray

    if ray.is_initialized():
        return
    if not owns_local_ray(address):
        ray.init(address=address, log_to_driver=True)
        return
    enable_ray_token_auth()
    # "local", never ray.init()'s default: with no address Ray joins the cluster a `ray start` on this machine
    # recorded (/tmp/ray/ray_current_cluster), where this server would not be private
    ray.init(address=address or "local", include_dashboard=False)


def cmd_serve(a) -> int:
    err = _validate(a) or _port_problem(a)
    if err:
        print(f"moeray: error: {err}", file=sys.stderr)
        return 2
    api_key = a.api_key if a.api_key is not None else os.environ.get("MOERAY_API_KEY")
    from moeray.cli import engine_kwargs

    try:
        a.cluster_kw = engine_kwargs(a)
    except ValueError as e:
        print(f"moeray: error: {e}", file=sys.stderr)
        return 2
    if a.http_port == 0:
        return _grpc_only(a, api_key)

    from ray import serve

    from router_service.http.models import ServeAppArgs
    from router_service.serve.deployment import GRPC_SERVICER_FUNCTION, build_app, wait_ready

    address = a.address or os.environ.get("RAY_ADDRESS")
    init_ray(address)
    import torch

    ranks = a.ranks or (torch.cuda.device_count() or 2)  # as LLM / ClusterConfig.auto: one per GPU, else 2
    in_replica = a.grpc_port and not a.grpc_proxy
    direct = a.http_via == "replica"
    args = ServeAppArgs(model=os.path.abspath(a.model), ranks=ranks, max_queue=a.max_queue, api_key=api_key,
                        grpc_port=a.grpc_port if in_replica else None, grpc_host=a.host,
                        http_port=a.http_port if direct else None, http_host=a.host,
                        served_model_name=a.served_model_name, max_body_bytes=a.max_body_bytes,
                        request_timeout_s=a.request_timeout_s, cluster_options=a.cluster_kw)
    grpc_options = None
    if a.grpc_proxy:
        grpc_options = {"port": a.grpc_port, "grpc_servicer_functions": [GRPC_SERVICER_FUNCTION],
                        "request_timeout_s": a.request_timeout_s}
    lease = None
    if not owns_local_ray(address):  # a cluster outlives this command: a watchdog deletes the app once it is gone
        from router_service.serve.watchdog import Lease, serve_running

        # before Serve and the app exist: a command killed while deploying leaves nothing behind either
        lease = Lease(APP, owns_serve=not serve_running()).start()
        signal.signal(signal.SIGTERM, _exit_on_sigterm)  # SIGTERM while deploying: tear down as after an error
    # serve.run re-enters serve.start, which logs "Connecting to existing Serve app ... New http_options ... will
    # not be applied" about the instance started just above with those very options: drop that one line
    quiet = _DropRecord("New http_options/controller_options will not be applied")
    try:
        if not direct:
            serve.start(http_options={"host": a.host, "port": a.http_port}, grpc_options=grpc_options)
        elif a.grpc_proxy:  # the proxies carry gRPC; their HTTP side gets a loopback port nobody needs to know
            serve.start(http_options={"host": "127.0.0.1", "port": _free_port()}, grpc_options=grpc_options)
        else:
            serve.start(proxy_location="Disabled")
        # one replica (the deployment's default) owns the EP cluster; deploy/serve_config.yaml autoscales instead
        logging.getLogger("ray.serve").addFilter(quiet)
        serve.run(build_app(args), name=APP, route_prefix="/", blocking=False)
        logging.getLogger("ray.serve").removeFilter(quiet)
        failed = wait_ready(serve.get_app_handle(APP),
                            say=lambda m: print(f"moeray: {m} ...", file=sys.stderr, flush=True))
    except BaseException as e:
        logging.getLogger("ray.serve").removeFilter(quiet)
        if lease is None:  # a private local Ray goes with this process anyway
            raise
        print(f"moeray: deploy failed ({type(e).__name__}); deleting the app", file=sys.stderr, flush=True)
        _teardown(serve, lease)
        if not isinstance(e, Exception):  # KeyboardInterrupt, SystemExit (SIGTERM)
            raise
        print(f"moeray: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    if failed is not None:
        print(f"moeray: error: {failed}", file=sys.stderr)
        _teardown(serve, lease)
        return 2
    grpc_at = f", gRPC on {'[::] (Serve proxy)' if a.grpc_proxy else a.host}:{a.grpc_port}" if a.grpc_port else ""
    print(f"moeray: HTTP on http://{a.host}:{a.http_port}/v1{grpc_at}", file=sys.stderr, flush=True)
    if a.detach:
        lease.release()
        print(f"moeray: detached: app {APP!r} outlives this command; stop it with `serve shutdown -a "
              f"http://<head>:8265` (all of Serve, via the Ray dashboard) or, in Python, "
              f"`ray.init(address={address!r}); serve.delete({APP!r})`", file=sys.stderr, flush=True)
        return 0
    try:
        _wait_for_signal()
        # in a thread: Serve's handle lookup has no timeout of its own (seen blocking when the app never came up)
        t = threading.Thread(target=_drain, args=(serve,), name="moeray-drain", daemon=True)
        t.start()
        t.join(DRAIN_S + 40)
        if t.is_alive():
            print("moeray: drain did not answer; shutting down", file=sys.stderr)
    finally:
        _teardown(serve, lease)
    return 0


APP = "moeray"  # the Serve application name


def _teardown(serve, lease) -> None:
    """The way out of `cmd_serve`: a private local Ray's Serve is shut down; on a cluster (`lease` set) the app is
    deleted, Serve too if this command started it and nothing else runs on it, then the watchdog is ended (it
    finishes the job if this command is killed meanwhile). An app another command took over is left alone."""
    if lease is None:
        serve.shutdown()
        return
    from router_service.serve.watchdog import teardown

    if not lease.lost.is_set():
        teardown(APP, lease.owns_serve)
    lease.release()


def _exit_on_sigterm(*_) -> None:
    raise SystemExit(128 + signal.SIGTERM)


DRAIN_S = 30.0  # seconds requests in flight may run on after SIGINT / SIGTERM


def _drain(serve, timeout_s: float = DRAIN_S) -> None:
    """Before Serve stops its proxies: let requests in flight finish (up to `timeout_s` s) and end the rest with
    a final retriable error event, so no client stream is cut without one (`MoerayServer.drain`)."""
    import time

    try:
        ended = serve.get_app_handle("moeray").drain.remote(timeout_s).result(timeout_s=timeout_s + 30)
        if ended:
            print(f"moeray: ended {ended} request(s) still running after {timeout_s:.0f} s", file=sys.stderr)
        time.sleep(0.5)  # let the proxies flush those final events
    except Exception as e:  # noqa: BLE001 - shutting down anyway
        print(f"moeray: drain failed ({type(e).__name__}: {e}); shutting down", file=sys.stderr)


def _wait_for_signal() -> None:
    """Block until SIGINT or SIGTERM. A signal handler plus an Event, because a KeyboardInterrupt does not
    reach a main thread parked in grpc's `wait_for_termination`."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):
        pass


def _grpc_only(a, api_key: str | None) -> int:
    from moeray.cli import start_llm
    from router_service.grpc.server import start_grpc_server

    if owns_local_ray(a.address or os.environ.get("RAY_ADDRESS")):
        enable_ray_token_auth()  # LLM starts the local Ray
    llm = start_llm(a, max_queue=a.max_queue, **a.cluster_kw)  # the CLI's one error rule (exit 2 / 1)
    if isinstance(llm, int):
        return llm
    try:
        server = start_grpc_server(llm.router, a.host, a.grpc_port, api_key, a.served_model_name,
                                   request_timeout_s=a.request_timeout_s)
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
