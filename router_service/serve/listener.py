"""The replica's own HTTP listener: the OpenAI app served by uvicorn inside the Serve replica process.

Why: through Ray Serve's HTTP proxy, every SSE event of every stream is one ASGI message the replica hands to
the proxy process over a Ray streaming call, and the proxy writes it to the client: at 32 streams that hop cost
about as much CPU per token as the model (BENCHMARKS.md, "Serving throughput"). The listener serves the same
ASGI app (`router_service.http.app.create_app`) straight from the replica, so an event is written to the client's
socket where it is made. Serve still manages the replica (deployment, health checks, replacement, drain) and its
handle and gRPC methods; only the HTTP bytes skip the proxy.

Invariants: the socket is bound with SO_REUSEPORT, so several replicas on one node share the port (the kernel
spreads connections over them) and a replacement replica can bind before the old one is gone; the server runs on
its own event loop in a daemon thread (uvloop when installed), never on Serve's loop; `stop()` closes the
socket and ends the thread (in-flight streams are ended by the router's drain first).
"""
from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time

log = logging.getLogger("moeray.http")


def bind_reuseport(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port with SO_REUSEADDR and SO_REUSEPORT (IPv4 or IPv6 by `host`).

    Raises:
        OSError: the address cannot be bound (names host and port).
    """
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if hasattr(socket, "SO_REUSEPORT"):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(2048)
        sock.setblocking(False)
    except OSError as e:
        sock.close()
        raise OSError(e.errno, f"HTTP listener cannot listen on {host}:{port}: {e.strerror or e}") from e
    return sock


class HTTPListener:
    """uvicorn serving `app` on host:port from a thread of this process.

    Args:
        app: an ASGI app. host, port: where to listen (port 0: the kernel picks; read `port` after start).

    Raises (from `start`):
        OSError: the port cannot be bound. RuntimeError: uvicorn did not come up within 30 s.
    """

    def __init__(self, app, host: str, port: int):
        self.app, self.host = app, host
        self.sock = bind_reuseport(host, port)
        self.port = self.sock.getsockname()[1]
        self._server = None
        self._thread: threading.Thread | None = None

    def start(self) -> "HTTPListener":
        import uvicorn

        try:
            import uvloop  # noqa: F401

            loop = "uvloop"
        except ImportError:
            loop = "asyncio"
        cfg = uvicorn.Config(self.app, loop=loop, http="auto", lifespan="off", log_level="warning",
                             access_log=False, timeout_keep_alive=30, backlog=2048)
        self._server = server = uvicorn.Server(cfg)  # off the main thread: it installs no signal handlers

        def run() -> None:
            if loop == "uvloop":
                import uvloop

                ev = uvloop.new_event_loop()
            else:
                ev = asyncio.new_event_loop()
            asyncio.set_event_loop(ev)
            try:
                ev.run_until_complete(server.serve(sockets=[self.sock]))
            except BaseException:  # noqa: BLE001 - logged; `start` reports it
                log.exception("HTTP listener on %s:%d stopped", self.host, self.port)
            finally:
                ev.close()

        self._thread = threading.Thread(target=run, name=f"http-listener-{self.port}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not server.started:
            server.should_exit = True
            raise RuntimeError(f"HTTP listener on {self.host}:{self.port} did not start")
        log.info("replica HTTP listener on %s:%d", self.host, self.port)
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop accepting, close the connections, end the thread (idempotent)."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
        try:
            self.sock.close()
        except OSError:
            pass
