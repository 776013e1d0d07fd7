"""The Ray actor that owns one rank, and the lockstep loop that keeps all ranks' collectives paired.

Lockstep protocol. Every router call that may create work (a request, an abort, shutdown) is followed
by a wake sequence number `seq` that is sent to every rank; for a request, the router draws it only
after the owning rank holds the request. A rank sleeps (on a condition variable: no spinning) until it
has seen a `seq` above the last agreed one. Each round, every rank reads its `seen_seq` and then
checks for work, and contributes `[has_work, -seen_seq, stop, -committed_epoch, num_tokens]` to one
MAX over the group (an all-to-all of the replicated flags: cheaper than gloo's all_reduce); all ranks
therefore agree on whether to run a step (all of them do, with zero tokens if need be), on when to
stop, and on `agreed_seq`, the SMALLEST seq seen: a rank goes back to sleep only when every rank has
read its latest seq, so the work behind that seq was in this round's `has_work`. (With the largest
seq, a rank whose request landed just after its work check could be told its own seq was agreed,
while a peer that got the wake first reported no work: it slept with the request queued. Seen once
as a hung request in `tests/cluster/test_cluster.py`.) Since every `seq` reaches every rank, a rank
that wakes for `seq` is always joined by the others.

Expert placement changes (EPLB rebalancing) ride on the same agreement: the launcher first has every
rank `prepare_placement(placement, epoch)` (weights read off the step thread), then `commit_placement(epoch)`
on every rank. A fourth flag carries `-committed_epoch`, so MAX gives minus the smallest epoch committed on
all ranks; when that exceeds the applied epoch, every rank applies it in the same round, before the step.
Sequences and KV caches are untouched, so requests in flight just continue under the new placement.

Output channel. Outputs reach the router over a plain TCP stream (`open_output_channel`), not one Ray call per
token: on the 2-core CPU machine a Ray `poll` round trip per decode step, and even a second thread woken per
step to send, cost 1-1.5 ms of the rank's ~8 ms step (the GIL and the CPU are shared with the step thread); vLLM
streams engine outputs over ZeroMQ for the same reason. The loop thread itself writes length-prefixed msgpack
frames after each step (4-byte big-endian length, then `encode_outputs` bytes; an empty frame is a heartbeat,
sent when idle for 1 s). An accept thread only authenticates the router (a per-channel random token, sent
first) and hands the connection to the loop. A failed rank sends a `failed` frame first, then the error outputs of
its requests: the router fails every in-flight request of the group with one retriable error when it reads the
`failed` frame and rebuilds the group, whichever rank noticed the failure first (a survivor of a dead peer notices
within milliseconds on the shared-memory transport). Outputs wait in the outbox while no channel is open (or
after a broken one).
"""
from __future__ import annotations

import hmac
import os
import secrets
import socket
import struct
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from actors.model.config import ModelConfig
from actors.moe.dispatch import ExpertPlacement
from actors.engine.engine import EngineConfig, RankEngine
from actors.engine.messages import GenerateRequest, TokenOutput, encode_failure, encode_outputs
from actors.rank.rendezvous import host_store, join_store
from actors.rank.shm_collective import ShmAllToAll
from kernels import tuning
from kernels.cpu import cpu_kernels_available

HEARTBEAT_S = 1.0  # the sender writes an empty frame after this long without outputs
SHM_MAX_BYTES = 256 << 20  # the shared-memory transport's segment (both banks, all rank pairs) at most


class RankWorker:
    """One rank: engine + lockstep loop + outbox. Wrapped as a Ray actor by `cluster` (any process
    can host it; tests may use it in-process for world_size == 1).

    Methods are thread-safe; the engine itself runs only on the loop thread.
    """

    def __init__(self, rank: int, world_size: int, engine_cfg: dict, placement: dict, num_threads: int = 1):
        self.rank = rank
        self.world_size = world_size
        self.engine_cfg = EngineConfig(**engine_cfg)
        self.placement = ExpertPlacement.from_dict(placement)
        if num_threads > 0:
            torch.set_num_threads(num_threads)
        self.engine: RankEngine | None = None
        self._cond = threading.Condition()
        self._wake_seq = 0
        self._stop = False
        self._out_lock = threading.Lock()  # outbox and connection hand-over (accept thread <-> loop thread)
        self._outbox: list[TokenOutput] = []
        self._failed: str | None = None
        self._thread: threading.Thread | None = None
        self.group = None
        self._store = None  # rank 0: the rendezvous TCPStore server (open_rendezvous)
        self.shm: ShmAllToAll | None = None  # same-node transport of the step's small all-to-alls (setup)
        # placement epochs: prepared (weights read), committed (ready to apply), applied (in use)
        self._prepared: dict[int, tuple[ExpertPlacement, dict]] = {}
        self._commit_epoch = 0
        self._applied_epoch = 0
        self._applied_step = 0
        self._pl_cond = threading.Condition()
        self._channel: socket.socket | None = None  # listening socket of the output channel
        self._new_conn: socket.socket | None = None  # authenticated, not yet adopted by the loop thread
        self._conn: socket.socket | None = None  # the connection the loop thread writes to
        self._last_send = 0.0

    # ------------------------------------------------------------------ bring-up
    def node_ip(self) -> str:
        """IP address of this rank's node (127.0.0.1 outside Ray)."""
        try:
            import ray

            return ray.util.get_node_ip_address()
        except Exception:  # noqa: BLE001 - outside Ray
            return "127.0.0.1"

    def open_rendezvous(self, timeout_s: float = 120.0) -> tuple[str, int]:
        """Rank 0 only: start the process group's TCPStore server (`actors.rank.rendezvous.host_store`, on a port the
        kernel picks and this process holds from then on) and return (node IP, port) for `setup`. Raises
        ValueError on any other rank."""
        if self.rank != 0:
            raise ValueError(f"open_rendezvous is rank 0's job, not rank {self.rank}'s")
        if self._store is None:
            self._store = host_store(self.world_size, timeout_s)
        return self.node_ip(), self._store.port

    def setup(self, master_addr: str, master_port: int, backend: str = "gloo", timeout_s: float = 10.0,
              transport: str = "auto") -> dict:
        """Join the process group (if world_size > 1), load weights, start the loop thread.

        master_addr, master_port: the store opened by rank 0's `open_rendezvous` (rank 0 uses its own; ValueError
        if it has none). transport: "auto" also opens the shared-memory
        all-to-all (`actors.rank.shm_collective`) for the step agreement and the fixed-capacity decode dispatch when
        the backend is gloo and every rank is on this node; "torch": torch.distributed for every collective.
        Returns {rank, pid, kv_blocks, cpu_kernels, transport}."""
        if transport not in ("auto", "torch"):
            raise ValueError(f"transport={transport!r} must be auto or torch")
        if self.world_size > 1:
            # rendezvous may wait for slow-starting peers; collectives themselves time out after timeout_s
            if self.rank == 0 and self._store is None:
                raise ValueError("rank 0 hosts the rendezvous: call open_rendezvous() before setup()")
            store = self._store or join_store(master_addr, master_port, self.world_size, max(120.0, timeout_s))
            dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.world_size,
                                    timeout=timedelta(seconds=timeout_s))
            self.group = dist.group.WORLD
            if backend == "gloo" and transport == "auto":
                # slots sized for the largest fixed-capacity exchange (FIXED_MAX_ROWS rows of hidden + 1 fp32),
                # within SHM_MAX_BYTES for the whole segment; a larger message takes torch.distributed
                hidden = ModelConfig.from_pretrained(self.engine_cfg.model).hidden_size
                slot = min(tuning.FIXED_MAX_ROWS * (hidden + 1) * 4, SHM_MAX_BYTES // (2 * self.world_size ** 2))
                self.shm = ShmAllToAll.setup(store, self.rank, self.world_size, timeout_s, slot_bytes=max(slot, 1024))
        self.engine = RankEngine(self.engine_cfg, self.placement, self.rank, self.group)
        self.engine.dispatcher.shm = self.shm
        self._thread = threading.Thread(target=self._loop, name=f"rank{self.rank}-loop", daemon=True)
        self._thread.start()
        return {"rank": self.rank, "pid": os.getpid(), "kv_blocks": self.engine.cache.allocator.num_blocks,
                # None on GPU ranks (the kernels are the CPU path only)
                "cpu_kernels": cpu_kernels_available() if self.engine.device.type == "cpu" else None,
                "transport": "shm+" + backend if self.shm is not None else (backend if self.world_size > 1 else "none")}

    # ------------------------------------------------------------------ router calls
    def _bump(self, seq: int) -> None:
        with self._cond:
            self._wake_seq = max(self._wake_seq, seq)
            self._cond.notify_all()

    def add_request(self, data: bytes, seq: int = 0) -> None:
        """Queue one encoded `GenerateRequest` on this rank. The router then sends a freshly drawn `seq` to every
        rank (`wake`), so no rank can have seen that seq before this rank holds the request; `seq` here wakes
        this rank's loop directly (a caller driving one rank in-process). Raises RuntimeError on a failed rank."""
        if self._failed is not None:
            raise RuntimeError(self._failed)
        self.engine.add_request(GenerateRequest.decode(data))
        self._bump(seq)

    def abort(self, request_id: str, seq: int) -> None:
        self.engine.abort(request_id)
        self._bump(seq)

    def wake(self, seq: int) -> None:
        self._bump(seq)

    def shutdown(self, seq: int) -> None:
        with self._cond:
            self._stop = True
        self._bump(seq)
        if self._thread is not None:
            self._thread.join(timeout=30)

    # ------------------------------------------------------------------ output channel
    def open_output_channel(self) -> tuple[str, int, str]:
        """Listen for the router's output connection; returns (host, port, token). One connection is served at a
        time (a new one replaces the old); it must send the token (ASCII hex, newline-terminated) first."""
        if self._channel is None:
            host = self.node_ip()
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
                got = b""
                while not got.endswith(b"\n") and len(got) < 64:
                    chunk = conn.recv(64 - len(got))
                    if not chunk:
                        break
                    got += chunk
                if not hmac.compare_digest(got.strip(), self._channel_token.encode()):
                    conn.close()
                    continue
                conn.settimeout(30.0)  # a stuck peer fails a send instead of blocking the loop forever
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                conn.close()
                continue
            loop_alive = self._thread is not None and self._thread.is_alive()
            with self._out_lock:
                old, self._new_conn = self._new_conn, conn
            if old is not None:
                old.close()
            if loop_alive:
                self._bump(0)  # an idle loop adopts it at once (flushing what waited in the outbox)
            else:  # the loop is gone (failed or stopped): deliver what is left from here
                self._channel_tick(heartbeat=False)

    def _channel_tick(self, heartbeat: bool = True) -> None:
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
        if self._failed is not None:
            self._send(encode_failure(self._failed), [])
        if out and self._conn is not None:
            self._send(encode_outputs(out), out)
        if self._failed is None and heartbeat and time.monotonic() - self._last_send >= HEARTBEAT_S:
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

    def stats(self) -> dict:
        s = self.engine.stats() if self.engine else {}
        s["failed"] = self._failed
        if self.engine is not None:
            # rows this rank sent to each rank per layer (cumulative [L][W]): the measured rank load
            s["dispatch_rows"] = self.engine.dispatcher.sent_rows.tolist()
            s["placement_epoch"] = self._applied_epoch
            if getattr(self.engine, "expert_runtime", None) is not None:  # packed experts: cache hit rate, recall
                try:
                    s["expert_cache"] = self.engine.expert_runtime.summary()
                except RuntimeError:  # a layer's counters were created mid-read by the step thread; next time
                    pass
        return s

    # ------------------------------------------------------------------ expert placement
    def prepare_placement(self, placement: dict, epoch: int) -> dict:
        """Phase 1 of a placement change: read this rank's new expert shard (the loop keeps stepping).

        Returns {rank, epoch, load_s}. Raises ValueError if epoch is not above the applied one.
        """
        if self._failed is not None:
            raise RuntimeError(self._failed)
        if epoch <= self._applied_epoch:
            raise ValueError(f"placement epoch={epoch} must exceed the applied epoch {self._applied_epoch}")
        t0 = time.perf_counter()
        pl = ExpertPlacement.from_dict(placement)
        weights = self.engine.prepare_placement(pl)
        with self._cond:
            self._prepared[epoch] = (pl, weights)
        return {"rank": self.rank, "epoch": epoch, "load_s": time.perf_counter() - t0}

    def commit_placement(self, epoch: int, timeout_s: float = 120.0) -> dict:
        """Phase 2: apply prepared `epoch` at the next round that all ranks have committed it; block until
        applied. Returns {rank, epoch, step} (step = engine steps run before the switch, equal on all ranks).

        Raises:
            ValueError: `epoch` was not prepared on this rank. TimeoutError: not applied within timeout_s
            (a peer was not committed). RuntimeError: the rank failed.
        """
        with self._cond:
            if epoch not in self._prepared and epoch > self._applied_epoch:
                raise ValueError(f"placement epoch={epoch} was not prepared on rank {self.rank}")
            self._commit_epoch = max(self._commit_epoch, epoch)
            self._cond.notify_all()
        deadline = time.monotonic() + timeout_s
        with self._pl_cond:
            while self._applied_epoch < epoch and self._failed is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"rank {self.rank}: placement epoch={epoch} not applied within {timeout_s}s")
                self._pl_cond.wait(timeout=min(left, 1.0))
        if self._failed is not None:
            raise RuntimeError(self._failed)
        return {"rank": self.rank, "epoch": epoch, "step": self._applied_step}

    def _apply_placement(self, epoch: int) -> None:
        with self._cond:
            pl, weights = self._prepared.pop(epoch)
            for old in [e for e in self._prepared if e < epoch]:
                del self._prepared[old]
        self.engine.apply_placement(pl, weights)
        self.placement = pl
        with self._pl_cond:
            self._applied_epoch, self._applied_step = epoch, self.engine.timing["steps"]
            self._pl_cond.notify_all()

    def health(self) -> dict:
        return {"rank": self.rank, "ok": self._failed is None and self._thread is not None and self._thread.is_alive(),
                "error": self._failed}

    def prompt_logits(self, prompt_ids: list[int]) -> list[list[float]]:
        return self.engine.prompt_logits(prompt_ids).tolist()

    # ------------------------------------------------------------------ loop
    def _emit(self, outs: list[TokenOutput]) -> None:
        """Loop thread: send the step's outputs on the channel (or keep them in the outbox until one is open)."""
        if self._conn is not None and self._new_conn is None and not self._outbox:
            if outs:
                self._send(encode_outputs(outs), outs)
            return
        if outs:
            with self._out_lock:
                self._outbox.extend(outs)
        self._channel_tick(heartbeat=False)

    def _loop(self) -> None:
        agreed, idle = 0, True
        flag = torch.zeros(5, dtype=torch.int64, device=self.engine.device)  # NCCL needs it on the GPU
        flags_in = torch.zeros(5 * self.world_size, dtype=torch.int64, device=self.engine.device)
        try:
            while True:
                with self._cond:
                    if (idle and self._wake_seq <= agreed and not self._stop
                            and self._commit_epoch <= self._applied_epoch):
                        self._cond.wait(timeout=HEARTBEAT_S)
                    still_idle = (idle and self._wake_seq <= agreed and not self._stop
                                  and self._commit_epoch <= self._applied_epoch)
                    seen, stop, committed = self._wake_seq, self._stop, self._commit_epoch
                if still_idle:
                    self._channel_tick()  # a new connection, or a heartbeat
                    continue
                plan, t_max = None, None
                if self.world_size > 1:
                    # this rank's step is planned before the agreement, so the group learns its largest token
                    # count (the dispatcher's fixed capacity) in the same agreement
                    plan = self.engine.plan() if self.engine.has_work and not stop else None
                    n = plan.num_tokens if plan is not None else 0
                    flag[0], flag[1], flag[2], flag[3], flag[4] = int(plan is not None), -seen, int(stop), -committed, n
                    t0 = time.perf_counter()
                    # MAX over ranks as an all-to-all of the replicated flags: gloo's all_reduce of 5 int64 takes
                    # ~1.9 ms on the 2-core machine, its all-to-all ~0.7 ms, shared memory ~0.1 ms
                    if self.shm is not None:
                        self.shm.all_to_all_single(flags_in, flag.repeat(self.world_size))
                    else:
                        dist.all_to_all_single(flags_in, flag.repeat(self.world_size), group=self.group)
                    self.engine.timing["sync_s"] += time.perf_counter() - t0
                    work, agreed, stop, committed, t_max = flags_in.view(self.world_size, 5).amax(0).tolist()
                    agreed, committed = -agreed, -committed  # the smallest seq seen, the smallest epoch committed
                else:  # alone: nothing to agree on (and no tensor ops on the decode path)
                    work, agreed = self.engine.has_work, seen
                if stop:
                    break
                if committed > self._applied_epoch:  # committed on every rank: switch now, all together
                    self._apply_placement(committed)
                if not work:
                    idle = True
                    continue
                idle = False
                if plan is None:  # alone, or the others have work: an empty step if nothing was planned here
                    plan = self.engine.plan(schedule=self.world_size == 1)
                self._emit(self.engine.run(plan, t_max))
        except Exception as e:  # noqa: BLE001 - a dead peer or a bug: fail in-flight requests loudly
            self._failed = f"rank {self.rank}: {type(e).__name__}: {e}"
            traceback.print_exc()
            self._fail_all(self._failed)
            self._channel_tick(heartbeat=False)  # the `failed` frame, then the error outputs
            with self._pl_cond:
                self._pl_cond.notify_all()
        finally:
            if self.world_size > 1 and dist.is_initialized():
                try:
                    dist.destroy_process_group()
                except Exception:  # noqa: BLE001
                    pass
            if self.shm is not None:
                self.engine.dispatcher.shm = None
                self.shm.close()

    def _fail_all(self, err: str) -> None:
        eng = self.engine
        eng._drain_inbox()
        seqs = list(eng.scheduler.running) + list(eng.scheduler.waiting)
        outs = []
        for s in seqs:
            eng.scheduler.abort(s.request_id)
            eng._release(s.request_id)
            outs.append(TokenOutput(request_id=s.request_id, finish_reason="error", error=err))
        with self._out_lock:  # sent by the next channel tick, after the `failed` frame
            self._outbox.extend(outs)
