"""The router's side of the ranks' channels: one TCP connection per rank and cluster generation, both ways.

Each rank listens (`actors.rank.output_channel.OutputChannel`); a poller thread per rank connects, then reads the
rank's output frames and hands them to the router (`on_outputs`). Once every rank's connection is up, the router's
requests, aborts and wakes are written on the same connections (`post`): a control frame costs tens of
microseconds, where the Ray actor calls it replaces (`add_request`, `wake`, `abort`, still the path before the
connections are up) cost the first token several milliseconds each.

Ordering (what the lockstep protocol of `actors.rank.lockstep` needs): a rank that has seen a wake seq must
already hold every request behind it. `post` draws the seq and writes every rank's frame under one lock, and the
frames of one connection arrive in the order written, so the owner reads a request before any seq drawn after it.

A generation's channels end together: the first poller that finds its rank dead or failed reports it
(`on_failure`), and `close` stops the others.
"""
from __future__ import annotations

import socket
import threading
from typing import Callable

import ray

from actors.engine.messages import TokenOutput, decode_frame
from actors.rank.output_channel import WAKE, encode_control, read_frame
from cluster.config import RANK_SILENCE_S

# seconds without any frame on a rank's channel (it sends a heartbeat every second, during steps too) before the
# router asks the actor directly whether it is alive; it then has as long again to answer, else the rank counts
# as lost (a node gone without a reset: nothing else would ever tell). `ClusterConfig.rank_silence_s` sets it.
CHANNEL_SILENCE_S = RANK_SILENCE_S
CONNECT_TIMEOUT_S = 60.0  # a rank's channel: opened (a Ray call) and connected within this long


class RankFailed(RuntimeError):
    """A rank's `failed` frame: its step loop raised (the message is the rank's own report)."""


class RankSilent(TimeoutError):
    """A rank's channel was silent and the rank did not answer a health call either: `silent_s` seconds in all."""

    def __init__(self, silent_s: float):
        super().__init__(f"no frame and no answer to a health call for {silent_s:.1f} s")
        self.silent_s = silent_s


def client_reason(rank: int, exc: BaseException) -> str:
    """What a client is told about rank `rank`'s loss, in moeray's words: which rank and what happened, never the
    exception's text (Ray's carries actor ids, pids, node addresses; the log gets it). Retry advice is added by
    the router."""
    if isinstance(exc, RankFailed):
        kind = str(exc).split(":")[1].strip() if str(exc).count(":") >= 2 else "an error"
        return f"rank {rank} failed during a step ({kind})"
    if isinstance(exc, (ConnectionError, EOFError)):
        return f"rank {rank} is unreachable (its channel closed: the process exited or its node is gone)"
    if isinstance(exc, RankSilent):
        return f"rank {rank} is unreachable (silent for {exc.silent_s:.0f} s: its node may be lost)"
    if isinstance(exc, (TimeoutError, socket.timeout)):
        return f"rank {rank} is unreachable (no answer within {CONNECT_TIMEOUT_S:.0f} s)"
    if type(exc).__module__.startswith("ray"):
        return f"rank {rank} is unreachable (its actor is gone)"
    return f"rank {rank} is unreachable ({type(exc).__name__})"


class RankChannels:
    """The channels of one cluster generation.

    Args:
        ranks: the generation's rank actor handles (`open_output_channel`, `health`), in rank order.
        next_seq: draws a fresh wake seq (the router's counter, shared by both paths).
        on_outputs: called on a poller thread with each output frame's `TokenOutput`s.
        on_failure: called once per failing rank with (reason, detail, rank): `reason` in moeray's words for
            clients (`client_reason`), `detail` with the exception's own text for the log, `rank` its index now
            (the router acts on the first report of a generation).
        silence_s: seconds without a frame from a rank before it is asked `health`; it has as long again to
            answer, else it is reported lost (`RankSilent`): a rank is declared lost at most 2 * silence_s
            seconds after its last frame.
    `drop(rank)` takes a lost rank out (elastic EP): the others keep their connections and move down one index.
    `silent`: the ranks reported silent (`RankSilent`), for the rebuild (`EPCluster.restart(silent=...)`).
    """

    def __init__(self, ranks: list, next_seq: Callable[[], int], on_outputs: Callable[[list[TokenOutput]], None],
                 on_failure: Callable[[str, str, int], None], silence_s: float = CHANNEL_SILENCE_S):
        if not silence_s > 0:
            raise ValueError(f"silence_s={silence_s} must be > 0 (seconds)")
        self.silence_s = silence_s
        self.silent: frozenset[int] = frozenset()  # ranks (index now) reported as `RankSilent`
        self.ranks = list(ranks)
        self._slots = list(range(len(ranks)))  # index now -> the poller's slot (its index at start)
        self._next_seq, self._on_outputs, self._on_failure = next_seq, on_outputs, on_failure
        self._lock = threading.Lock()
        self._conns: dict[int, socket.socket] = {}  # by slot
        self._send_lock = threading.Lock()  # a seq is drawn and written to every rank under it
        self._closed = False
        self._threads = [threading.Thread(target=self._poll, args=(i, r), daemon=True, name=f"poll-rank{i}")
                         for i, r in enumerate(self.ranks)]
        for t in self._threads:
            t.start()

    @property
    def connected(self) -> bool:
        """Whether every rank's channel is up (so `post` sends)."""
        with self._lock:
            return all(s in self._conns for s in self._slots) and not self._closed

    def drop(self, rank: int) -> None:
        """Rank `rank` is gone from the group: no more frames to it; the ranks above it move down one index."""
        with self._lock:
            slot = self._slots.pop(rank)
            del self.ranks[rank]
            conn = self._conns.pop(slot, None)
            self.silent = frozenset(i - (i > rank) for i in self.silent if i != rank)  # indices now
        if conn is not None:
            try:
                conn.close()
            except OSError:
                pass

    def add(self, rank: int, actor) -> None:
        """A replacement rank joined as index `rank` (elastic EP): the ranks from `rank` up move up one index; its
        poller connects in the background (until then `post` returns False: the caller takes the actor calls)."""
        with self._lock:
            slot = len(self._threads)
            self._slots.insert(rank, slot)
            self.silent = frozenset(i + (i >= rank) for i in self.silent)
            self.ranks.insert(rank, actor)
            actors = dict(zip(self._slots, self.ranks))
            t = threading.Thread(target=self._poll, args=(slot, actors[slot]), daemon=True, name=f"poll-rank{rank}")
            self._threads.append(t)
        t.start()

    def _live(self) -> list[socket.socket] | None:
        """Every live rank's connection in index order, or None while one is not up (or closed)."""
        with self._lock:
            if self._closed or not all(s in self._conns for s in self._slots):
                return None
            return [self._conns[s] for s in self._slots]

    def post(self, owner: int, kind: bytes, payload: bytes, wake: bool = True) -> bool:
        """Write (kind, seq, payload) to rank `owner` and a wake with the same fresh seq to every other rank.
        kind: `REQUEST` (payload `GenerateRequest.encode()`) or `ABORT` (the request id, UTF-8). wake=False: only
        the owner's frame, with seq 0 (it wakes nobody; a later `post` or `wake_all` does, for every request
        written before it: a batch of requests starts in one step).

        Returns False, sending nothing, while some channel is not up (the caller takes the actor calls).
        Raises OSError when a write fails (that rank's poller reports it unreachable)."""
        conns = self._live()
        if conns is None:
            return False
        with self._send_lock:
            if not wake:
                conns[owner].sendall(encode_control(kind, 0, payload))
                return True
            seq = self._next_seq()
            for i, conn in enumerate(conns):
                conn.sendall(encode_control(kind, seq, payload) if i == owner else encode_control(WAKE, seq))
        return True

    def wake_all(self) -> bool:
        """A fresh wake seq to every rank (after requests posted with wake=False). False while a channel is down.
        Raises OSError when a write fails."""
        conns = self._live()
        if conns is None:
            return False
        with self._send_lock:
            seq = self._next_seq()
            for conn in conns:
                conn.sendall(encode_control(WAKE, seq))
        return True

    def _poll(self, rank: int, actor) -> None:
        """Connect to rank `rank`'s channel and read it until `close`; a dead or failed rank is reported. Silence
        (no frame, not even a heartbeat) for `silence_s` asks the actor itself whether it lives, with as long to
        answer. `rank`: the poller's slot (its index when it started)."""
        conn = None
        try:
            host, port, token = ray.get(actor.open_output_channel.remote(), timeout=CONNECT_TIMEOUT_S)
            conn = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.sendall(token.encode() + b"\n")
            conn.settimeout(self.silence_s)
            with self._lock:
                if self._closed:
                    return
                self._conns[rank] = conn

            def alive() -> None:  # silence: ask the actor (raises if it is gone, failed or silent too)
                try:
                    h = ray.get(actor.health.remote(), timeout=self.silence_s)
                except ray.exceptions.GetTimeoutError:
                    raise RankSilent(2 * self.silence_s) from None
                if not h["ok"]:
                    raise RankFailed(h["error"] or "loop thread stopped")

            while not self._closed:
                outs, failed = decode_frame(read_frame(conn, alive))
                self._on_outputs(outs)
                if failed is not None:
                    raise RankFailed(failed)
        except Exception as e:  # noqa: BLE001 - the rank died or failed: the router rebuilds the group
            with self._lock:
                index = self._slots.index(rank) if rank in self._slots else None
            if not self._closed and index is not None:
                if isinstance(e, RankSilent):
                    self.silent = self.silent | {index}
                self._on_failure(client_reason(index, e), f"rank {index}: {type(e).__name__}: {e}", index)
        finally:
            with self._lock:
                if conn is not None and self._conns.get(rank) is conn:  # None: it never connected
                    del self._conns[rank]
            if conn is not None:
                conn.close()

    def close(self, join_s: float = 0.0) -> None:
        """Stop writing control frames at once; the pollers exit at their next frame (or silence). join_s > 0:
        wait up to that long for each poller."""
        with self._lock:
            self._closed = True
            self._conns.clear()
        for t in self._threads:
            if join_s > 0 and t is not threading.current_thread():
                t.join(timeout=join_s)
