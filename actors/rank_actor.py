"""The Ray actor that owns one rank, and the lockstep loop that keeps all ranks' collectives paired.

Lockstep protocol. Every router call that may create work (a request, an abort, shutdown) carries
a wake sequence number `seq` that is sent to every rank. A rank sleeps (on a condition variable:
no spinning) until it has seen a `seq` above the last agreed one. Each round, every rank
contributes `[has_work, seen_seq, stop]` to one `all_reduce(MAX)`; all ranks therefore agree on
the same `agreed_seq`, on whether to run a step (all of them do, with zero tokens if need be), and
on when to go back to sleep or stop. Since every `seq` reaches every rank, a rank that wakes for
`seq` is always joined by the others.
"""
from __future__ import annotations

import os
import socket
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from actors.dispatch import ExpertPlacement
from actors.engine import EngineConfig, RankEngine
from actors.messages import GenerateRequest, TokenOutput, encode_outputs


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
        self._out_cond = threading.Condition()
        self._outbox: list[TokenOutput] = []
        self._failed: str | None = None
        self._thread: threading.Thread | None = None
        self.group = None

    # ------------------------------------------------------------------ bring-up
    def node_address(self) -> tuple[str, int]:
        """(IP of this node, a free TCP port) for the process-group rendezvous."""
        try:
            import ray

            ip = ray.util.get_node_ip_address()
        except Exception:  # noqa: BLE001 - outside Ray
            ip = "127.0.0.1"
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ip, port

    def setup(self, master_addr: str, master_port: int, backend: str = "gloo", timeout_s: float = 10.0) -> dict:
        """Join the process group (if world_size > 1), load weights, start the loop thread."""
        if self.world_size > 1:
            # rendezvous may wait for slow-starting peers; collectives themselves time out after timeout_s
            store = dist.TCPStore(master_addr, master_port, self.world_size, is_master=self.rank == 0,
                                  timeout=timedelta(seconds=max(120.0, timeout_s)))
            dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.world_size,
                                    timeout=timedelta(seconds=timeout_s))
            self.group = dist.group.WORLD
        self.engine = RankEngine(self.engine_cfg, self.placement, self.rank, self.group)
        self._thread = threading.Thread(target=self._loop, name=f"rank{self.rank}-loop", daemon=True)
        self._thread.start()
        return {"rank": self.rank, "pid": os.getpid(), "kv_blocks": self.engine.cache.allocator.num_blocks}

    # ------------------------------------------------------------------ router calls
    def _bump(self, seq: int) -> None:
        with self._cond:
            self._wake_seq = max(self._wake_seq, seq)
            self._cond.notify_all()

    def add_request(self, data: bytes, seq: int) -> None:
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

    def poll(self, timeout_s: float = 1.0) -> bytes:
        """Block up to `timeout_s` for new outputs; returns msgpack (see `actors.messages`)."""
        with self._out_cond:
            if not self._outbox:
                self._out_cond.wait(timeout=timeout_s)
            out, self._outbox = self._outbox, []
        return encode_outputs(out)

    def stats(self) -> dict:
        s = self.engine.stats() if self.engine else {}
        s["failed"] = self._failed
        return s

    def health(self) -> dict:
        return {"rank": self.rank, "ok": self._failed is None and self._thread is not None and self._thread.is_alive(),
                "error": self._failed}

    def prompt_logits(self, prompt_ids: list[int]) -> list[list[float]]:
        return self.engine.prompt_logits(prompt_ids).tolist()

    # ------------------------------------------------------------------ loop
    def _emit(self, outs: list[TokenOutput]) -> None:
        if outs:
            with self._out_cond:
                self._outbox.extend(outs)
                self._out_cond.notify_all()

    def _loop(self) -> None:
        agreed, idle = 0, True
        flag = torch.zeros(3, dtype=torch.int64, device=self.engine.device)  # NCCL needs it on the GPU
        try:
            while True:
                with self._cond:
                    while idle and self._wake_seq <= agreed and not self._stop:
                        self._cond.wait(timeout=5.0)
                    seen, stop = self._wake_seq, self._stop
                flag[0], flag[1], flag[2] = int(self.engine.has_work), seen, int(stop)
                if self.world_size > 1:
                    t0 = time.perf_counter()
                    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
                    self.engine.timing["sync_s"] += time.perf_counter() - t0
                agreed = int(flag[1])
                if flag[2]:
                    break
                if not flag[0]:
                    idle = True
                    continue
                idle = False
                self._emit(self.engine.step())
        except Exception as e:  # noqa: BLE001 - a dead peer or a bug: fail in-flight requests loudly
            self._failed = f"rank {self.rank}: {type(e).__name__}: {e}"
            traceback.print_exc()
            self._fail_all(self._failed)
        finally:
            if self.world_size > 1 and dist.is_initialized():
                try:
                    dist.destroy_process_group()
                except Exception:  # noqa: BLE001
                    pass

    def _fail_all(self, err: str) -> None:
        eng = self.engine
        eng._drain_inbox()
        seqs = list(eng.scheduler.running) + list(eng.scheduler.waiting)
        outs = []
        for s in seqs:
            eng.scheduler.abort(s.request_id)
            outs.append(TokenOutput(request_id=s.request_id, finish_reason="error", error=err))
        self._emit(outs)
