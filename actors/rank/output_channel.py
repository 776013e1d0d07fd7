"""The rank's channel to the router: a plain TCP stream of length-prefixed frames both ways, and the outbox behind it.

Outputs reach the router over this stream, not one Ray call per token: a Ray `poll` round trip per decode step,
and even a second thread woken per step to send, cost a sizeable share of a CPU rank's decode step (the GIL and
the CPU are shared with the step thread); vLLM streams engine outputs over ZeroMQ for the same reason. The loop
thread itself writes the frames after each step (`emit`, `tick`): a 4-byte big-endian length, then
`encode_outputs` bytes; an empty frame is a heartbeat, sent after `HEARTBEAT_S` without a frame (idle, or
stepping with no output of this rank's). An accept thread only
authenticates the router (a per-channel random token, sent first, ASCII hex, newline-terminated) and hands the
connection to the loop; one connection is served at a time (a new one replaces the old).

The router writes control frames on the same connection (`encode_control`: a request, an abort, a wake, each with
its wake sequence number; see `actors.rank.lockstep` for the protocol); a reader thread per connection hands them
to the rank (`on_control`). One Ray actor call per request and per wake cost the first token 3-4 ms each on the
2-core machine; a frame costs tens of microseconds. Frames on one connection arrive in the order written, which
the lockstep protocol relies on: the router writes a request, then its seq, to the owning rank.

A failed rank sends a `failed` frame first, then the error outputs of its requests: the router fails every
in-flight request of the group with one retriable error when it reads the `failed` frame and rebuilds the group,
whichever rank noticed the failure first (a survivor of a dead peer notices at once on the shared-memory
transport, which watches its peers' processes). Outputs wait in the outbox while no channel is open (or after a
broken one); once the loop thread is gone, the accept thread delivers what is left itself.
"""
from __future__ import annotations

import hmac
import secrets
import socket
import struct
import threading
import time
import traceback
from typing import Callable

from actors.engine.messages import TokenOutput, encode_failure, encode_outputs

HEARTBEAT_S = 1.0  # the sender writes an empty frame after this long without outputs

# control frames (router -> rank): kind byte, wake seq (uint64, big-endian), payload
CONTROL = struct.Struct(">cQ")
REQUEST, ABORT, WAKE = b"R", b"A", b"W"  # payload: `GenerateRequest.encode()`, request id (UTF-8), nothing


def encode_control(kind: bytes, seq: int, payload: bytes = b"") -> bytes:
    """One router -> rank frame, length prefix included: `kind` (REQUEST | ABORT | WAKE), the wake `seq` that
    follows it, then the payload."""
    body = CONTROL.pack(kind, seq) + payload
    return struct.pack(">I", len(body)) + body


def decode_control(frame: bytes) -> tuple[bytes, int, bytes]:
    """(kind, seq, payload) of a control frame's body. Raises ValueError on a malformed one."""
    if len(frame) < CONTROL.size:
        raise ValueError(f"control frame of {len(frame)} bytes; at least {CONTROL.size} expected")
    kind, seq = CONTROL.unpack_from(frame)
    if kind not in (REQUEST, ABORT, WAKE):
        raise ValueError(f"control frame kind {kind!r}")
    return kind, seq, frame[CONTROL.size:]


class OutputChannel:
    """The output stream of one rank.

    Args:
        rank: the rank (thread names). host: returns the address to listen on (called once, at `open`).
        wake: wakes the loop thread (it adopts a new connection at once, flushing the outbox).
        loop_alive: whether the loop thread still runs. failure: the rank's failure message (None: healthy).
        on_control: called with (kind, seq, payload) of every control frame the router writes, in order, on the
            connection's reader thread (None: control frames are refused, the connection closed).

    Thread-safety: `open` and `push` from any thread; `emit` and `tick` from the loop thread (or, once it is
    gone, the accept thread).
    """

    def __init__(self, rank: int, *, host: Callable[[], str], wake: Callable[[], None],
                 loop_alive: Callable[[], bool], failure: Callable[[], str | None],
                 on_control: Callable[[bytes, int, bytes], None] | None = None):
        self.rank = rank
        self._host, self._wake, self._loop_alive, self._failure = host, wake, loop_alive, failure
        self._on_control = on_control
        self._out_lock = threading.Lock()  # outbox and connection hand-over (accept thread <-> loop thread)
        self._outbox: list[TokenOutput] = []
        self._channel: socket.socket | None = None  # listening socket
        self._new_conn: socket.socket | None = None  # authenticated, not yet adopted by the loop thread
        self._conn: socket.socket | None = None  # the connection the loop thread writes to
        self._last_send = 0.0

    def open(self) -> tuple[str, int, str]:
        """Listen for the router's output connection; returns (host, port, token). One connection is served at a
        time (a new one replaces the old); it must send the token (ASCII hex, newline-terminated) first."""
        if self._channel is None:
            host = self._host()
            srv = socket.socket()
            srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            srv.bind((host, 0))
            srv.listen(2)
            self._channel = srv
            self._channel_token = secrets.token_hex(16)
            threading.Thread(target=self._serve_channel, name=f"rank{self.rank}-outputs", daemon=True).start()
        host, port = self._channel.getsockname()[:2]
        return host, port, self._channel_token

    def _serve_channel(self) -> None:
        while True:
            try:
                conn, _ = self._channel.accept()
            except OSError:
                return
            try:
                conn.settimeout(10.0)
                # exactly the token's bytes: control frames may follow in the same segment
                want = len(self._channel_token) + 1
                got = b""
                while len(got) < want:
                    chunk = conn.recv(want - len(got))
                    if not chunk:
                        break
                    got += chunk
                if not hmac.compare_digest(got, self._channel_token.encode() + b"\n"):
                    conn.close()
                    continue
                conn.settimeout(30.0)  # a stuck peer fails a send instead of blocking the loop forever
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                conn.close()
                continue
            loop_alive = self._loop_alive()
            threading.Thread(target=self._read_control, args=(conn,), name=f"rank{self.rank}-control",
                             daemon=True).start()
            with self._out_lock:
                old, self._new_conn = self._new_conn, conn
            if old is not None:
                old.close()
            if loop_alive:
                self._wake()  # an idle loop adopts it at once (flushing what waited in the outbox)
            else:  # the loop is gone (failed or stopped): deliver what is left from here
                self.tick(heartbeat=False)

    def _read_control(self, conn: socket.socket) -> None:
        """The reader thread of one connection: control frames to `on_control` until it closes. A malformed frame
        or a refused one closes the connection (the router then treats the rank as unreachable)."""
        try:
            while True:
                frame = read_frame(conn, lambda: None)
                if not frame:
                    continue
                if self._on_control is None:
                    raise ValueError("this rank takes no control frames")
                self._on_control(*decode_control(frame))
        except (OSError, ConnectionError):
            return
        except Exception:  # noqa: BLE001 - a bad frame: drop the connection, loudly
            traceback.print_exc()
            conn.close()

    def tick(self, heartbeat: bool = True) -> None:
        """Loop thread: adopt a new connection, send the `failed` frame (a failed rank), waiting outputs, and a
        heartbeat if due."""
        with self._out_lock:
            if self._new_conn is not None:
                if self._conn is not None:
                    self._conn.close()
                self._conn, self._new_conn = self._new_conn, None
            if self._conn is None:
                return
            out, self._outbox = self._outbox, []
        failed = self._failure()
        if failed is not None:
            self._send(encode_failure(failed), [])
        if out and self._conn is not None:
            self._send(encode_outputs(out), out)
        if failed is None and heartbeat and time.monotonic() - self._last_send >= HEARTBEAT_S:
            self._send(b"", [])

    def _send(self, data: bytes, outs: list[TokenOutput]) -> None:
        """One frame to the router; on a broken connection the outputs go back to the outbox (for the next
        connection)."""
        conn = self._conn
        try:
            conn.sendall(struct.pack(">I", len(data)) + data)
            self._last_send = time.monotonic()
        except OSError:
            conn.close()
            with self._out_lock:
                if self._conn is conn:
                    self._conn = None
                self._outbox[:0] = outs

    def emit(self, outs: list[TokenOutput]) -> None:
        """Loop thread: send the step's outputs on the channel (or keep them in the outbox until one is open); a
        step with no output of this rank's sends a heartbeat when one is due, so a busy rank is never silent."""
        if self._conn is not None and self._new_conn is None and not self._outbox:
            if outs:
                self._send(encode_outputs(outs), outs)
            elif time.monotonic() - self._last_send >= HEARTBEAT_S:
                self._send(b"", [])
            return
        if outs:
            with self._out_lock:
                self._outbox.extend(outs)
        self.tick(heartbeat=False)

    def push(self, outs: list[TokenOutput]) -> None:
        """Queue outputs for the next `tick` (a failed rank's error outputs, sent after the `failed` frame)."""
        with self._out_lock:
            self._outbox.extend(outs)


def recv_exact(conn: socket.socket, n: int, on_timeout) -> bytes:
    """n bytes from `conn`; `on_timeout()` runs on each socket timeout (it raises to give up). Raises
    ConnectionError if the peer closes first."""
    buf = bytearray()
    while len(buf) < n:
        try:
            chunk = conn.recv(n - len(buf))
        except TimeoutError:
            on_timeout()
            continue
        if not chunk:
            raise ConnectionError("output channel closed")
        buf += chunk
    return bytes(buf)


def read_frame(conn: socket.socket, on_timeout) -> bytes:
    """One frame's payload (b"" for a heartbeat) from either side; `on_timeout` as in `recv_exact`."""
    n = struct.unpack(">I", recv_exact(conn, 4, on_timeout))[0]
    return recv_exact(conn, n, on_timeout) if n else b""
