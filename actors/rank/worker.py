"""The Ray actor that owns one rank: bring-up (process group, shared-memory transport, engine), the router's
calls, expert placement epochs, health and statistics.

The step thread is the lockstep loop (`actors.rank.lockstep`, whose docstring states the protocol that keeps
every rank's collectives paired); outputs reach the router over the output channel
(`actors.rank.output_channel`). The rank builds its transport before its engine and hands it to the engine's
constructor (the dispatcher's same-node all-to-all), so nothing is wired into the engine afterwards.
"""
from __future__ import annotations

import os
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from actors.model.config import ModelConfig
from actors.moe.placement import ExpertPlacement
from actors.engine.config import EngineConfig
from actors.engine.engine import RankEngine
from actors.engine.messages import GenerateRequest
from actors.rank.elastic import ElasticRank
from actors.rank.lockstep import LockstepLoop
from actors.rank.netif import select_gloo_interface
from actors.rank.output_channel import ABORT, REQUEST, OutputChannel
from actors.rank.rendezvous import host_store, join_store
from actors.rank.shm_collective import ShmAllToAll
from actors.rank.tcp_collective import TcpAllToAll
from actors.rank.threads import apply_threads, auto_threads, ranks_on_node
from kernels import tuning
from kernels.cpu import cpu_kernels_available

SHM_MAX_BYTES = 256 << 20  # the shared-memory transport's segment (both banks, all rank pairs) at most


class RankWorker(ElasticRank, LockstepLoop):
    """One rank: engine + lockstep loop + output channel. Wrapped as a Ray actor by `cluster` (any process
    can host it; tests may use it in-process for world_size == 1).

    Methods are thread-safe; the engine itself runs only on the loop thread. elastic: the rank's experts are
    replicated (redundant experts), so a lost peer leaves it waiting for the survivors' new group (`regroup`).
    """

    def __init__(self, rank: int, world_size: int, engine_cfg: dict, placement: dict, num_threads: int = 0,
                 elastic: bool = False):
        self.rank = rank
        self.elastic = elastic  # redundant experts: a lost peer means a new group over the survivors, not failure
        self._inflight = None  # the planned step now running (re-run after a regroup)
        self._regroup_order: tuple | None = None
        self._regroup_done: dict | None = None
        self.world_size = world_size
        self.engine_cfg = EngineConfig(**engine_cfg)
        self.placement = ExpertPlacement.from_dict(placement)
        if num_threads < 0:
            raise ValueError(f"num_threads={num_threads} must be >= 0 (0: the node's CPUs over its ranks)")
        self.num_threads = num_threads  # applied in setup (0: once the ranks on this node are known)
        self.engine: RankEngine | None = None
        self._cond = threading.Condition()
        self._wake_seq = 0
        self._stop = False
        self._failed: str | None = None
        self._thread: threading.Thread | None = None
        self.group = None
        self._store = None  # rank 0: the rendezvous TCPStore server (open_rendezvous)
        # transport of the step's small all-to-alls (setup): shared memory on one node, else TCP; None: gloo/NCCL
        self.shm: ShmAllToAll | TcpAllToAll | None = None
        # placement epochs: prepared (weights read), committed (ready to apply), applied (in use)
        self._prepared: dict[int, tuple[ExpertPlacement, dict]] = {}
        self._commit_epoch = 0
        self._applied_epoch = 0
        self._applied_step = 0
        self._pl_cond = threading.Condition()
        self.channel = OutputChannel(rank, host=self.node_ip, wake=lambda: self._bump(0),
                                     loop_alive=lambda: self._thread is not None and self._thread.is_alive(),
                                     failure=lambda: self._failed, on_control=self._on_control)

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
        the backend is gloo and every rank is on this node, else the same calls over TCP between the ranks
        (`actors.rank.tcp_collective`); "torch": torch.distributed for every collective.
        gloo's device is built for this node's Ray IP (GLOO_SOCKET_IFNAME set to the interface holding it, unless
        the user set it; `actors.rank.netif`), not for the hostname: a hostname resolving to 127.0.1.1 (Debian's
        default) gave a device that ranks on other nodes cannot reach, and the group never formed.
        num_threads 0 becomes the node's CPUs over the ranks on it (`actors.rank.threads`).
        Returns {rank, pid, kv_blocks, cpu_kernels, threads, transport ("shm+gloo", "tcp+gloo", "gloo", "nccl",
        "none")}."""
        if transport not in ("auto", "torch"):
            raise ValueError(f"transport={transport!r} must be auto or torch")
        if self.world_size > 1:
            # rendezvous may wait for slow-starting peers; collectives themselves time out after timeout_s
            if self.rank == 0 and self._store is None:
                raise ValueError("rank 0 hosts the rendezvous: call open_rendezvous() before setup()")
            store = self._store or join_store(master_addr, master_port, self.world_size, max(120.0, timeout_s))
            self._join_group(store, backend, timeout_s, transport)
            if self.num_threads == 0:
                self.num_threads = auto_threads(ranks_on_node(store, self.rank, self.world_size, self.node_ip()))
        elif self.num_threads == 0:
            self.num_threads = auto_threads(1)
        apply_threads(self.num_threads)
        self.engine = RankEngine(self.engine_cfg, self.placement, self.rank, self.group, shm=self.shm)
        self.engine.model.warm_up(self.engine_cfg.max_batched_tokens)  # a full step's kernels, before any request
        self._start_loop()
        return {"rank": self.rank, "pid": os.getpid(), "kv_blocks": self.engine.cache.allocator.num_blocks,
                "expert_bytes": self.expert_bytes(), "threads": self.num_threads,
                # None on GPU ranks (the kernels are the CPU path only)
                "cpu_kernels": cpu_kernels_available() if self.engine.device.type == "cpu" else None,
                "transport": (("tcp+" if isinstance(self.shm, TcpAllToAll) else "shm+") + backend if self.shm is not None
                              else backend if self.world_size > 1 else "none")}

    def _start_loop(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=f"rank{self.rank}-loop", daemon=True)
        self._thread.start()

    def _join_group(self, store, backend: str, timeout_s: float, transport: str) -> None:
        """Init the process group over `store` as (self.rank, self.world_size) and open the step transport."""
        if backend == "gloo":
            select_gloo_interface(self.node_ip())
        dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.world_size,
                                timeout=timedelta(seconds=timeout_s))
        self.group = dist.group.WORLD
        if backend == "gloo" and transport == "auto":
            # slots sized for a full step's rows to one peer (the step token budget x top_k, at least the decode
            # exchange's FIXED_MAX_ROWS, rows of hidden + 1 fp32), within SHM_MAX_BYTES for the whole segment; a
            # larger exchange goes in pieces (`AllToAllDispatcher._a2a_pieces`)
            mc = ModelConfig.from_pretrained(self.engine_cfg.model)
            rows = max(tuning.FIXED_MAX_ROWS, self.engine_cfg.max_batched_tokens * max(mc.top_k, 1))
            slot = min(rows * (mc.hidden_size + 1) * 4, SHM_MAX_BYTES // (2 * self.world_size ** 2))
            self.shm = ShmAllToAll.setup(store, self.rank, self.world_size, timeout_s, slot_bytes=max(slot, 1024))
            if self.shm is None:  # not one node (or shared memory refused): the same calls over TCP
                self.shm = TcpAllToAll.setup(store, self.rank, self.world_size, self.node_ip(), timeout_s)

    # ------------------------------------------------------------------ router calls
    def _bump(self, seq: int) -> None:
        with self._cond:
            self._wake_seq = max(self._wake_seq, seq)
            self._cond.notify_all()

    def add_request(self, data: bytes, seq: int = 0) -> None:
        """Queue one encoded `GenerateRequest` on this rank. The router then sends a freshly drawn `seq` to every
        rank (`wake`), so no rank can have seen that seq before this rank holds the request; `seq` here wakes
        this rank's loop directly (a caller driving one rank in-process). Raises RuntimeError on a failed rank, or
        on one not set up yet (its group is still being built: the router's retryable error names it)."""
        if self._failed is not None:
            raise RuntimeError(self._failed)
        if self.engine is None:
            raise RuntimeError(f"rank {self.rank} is not set up yet (its group is being built)")
        self.engine.add_request(GenerateRequest.decode(data))
        self._bump(seq)

    def _on_control(self, kind: bytes, seq: int, payload: bytes) -> None:
        """A control frame from the router's channel (`actors.rank.output_channel.encode_control`): the same
        calls as the Ray methods, in the order the router wrote them. A failed rank drops requests (the router
        fails them when it reads the `failed` frame)."""
        if kind == REQUEST:
            if self._failed is None:
                self.engine.add_request(GenerateRequest.decode(payload))
        elif kind == ABORT:
            self.engine.abort(payload.decode())
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
        """Listen for the router's output connection (`actors.rank.output_channel.OutputChannel.open`); returns
        (host, port, token)."""
        return self.channel.open()

    def expert_bytes(self) -> int:
        """Bytes of the routed expert weights this rank holds (full precision: its [E_loc, ...] stacks; packed
        experts: their packed bytes in memory)."""
        n = sum(v.nbytes for k, v in self.engine.model.w.items() if k.endswith((".w_gate_up", ".w_down")))
        if n == 0 and getattr(self.engine, "expert_runtime", None) is not None:
            n = self.engine.expert_runtime.tier_stats()["packed"]["allocated_bytes"]
        return int(n)

    def stats(self) -> dict:
        s = self.engine.stats() if self.engine else {}
        s["failed"] = self._failed
        if self.engine is not None:
            # rows this rank sent to each rank per layer (cumulative [L][W]): the measured rank load
            s["dispatch_rows"] = self.engine.dispatcher.sent_rows.tolist()
            s["placement_epoch"] = self._applied_epoch
            s["expert_bytes"] = self.expert_bytes()
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
