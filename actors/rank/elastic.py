"""Elastic EP on one rank: after a peer is lost, join the survivors' new group without restarting the actor.

With redundant experts (every routed expert on >= 2 ranks, `cluster.placement.redundant_placement`) a lost rank's
experts all have replicas on the survivors. A survivor's step thread that meets an error (the shared-memory
transport sees the dead peer's process gone within `shm_collective.LIVENESS_S`; gloo / TCP get a reset) does not
fail its requests: it waits up to `REGROUP_WAIT_S` for the launcher's `regroup` order (`cluster.launcher.EPCluster.shrink`),
leaves the old process group, joins a new one over the survivors (a new store prefix, the old rank 0's store if it
survived, else one the new rank 0 hosts), switches its engine to the shrunk placement (same experts, same local
rows: no weight moves, `RankEngine.regroup`) and re-runs the interrupted step (`actors.rank.lockstep`). No order
within the wait (a bug rather than a lost peer, or the launcher gone): it fails as a non-elastic rank does.
An idle survivor (no collective running) takes the order at its next round: the order wakes its loop. A peer lost
without a reset (its node gone silent) raises nothing until the collective timeout; the router finds it first
(`router_service.rank_channels`, 2 x rank_silence_s) and the order interrupts the waiting collective.
"""
from __future__ import annotations

import os
import time

import torch.distributed as dist

from actors.moe.placement import ExpertPlacement
from actors.rank.output_channel import HEARTBEAT_S
from actors.rank.rendezvous import host_store, join_store
from actors.rank.threads import apply_threads

# seconds a survivor waits for the new group before failing its requests: the router learns of a SIGKILLed rank
# within milliseconds (its channel closes); a lost node takes the collective timeout (<= 10 s) plus this margin
REGROUP_WAIT_S = 15.0


class RegroupNow(RuntimeError):
    """Raised in the step thread of a rank that has a regroup order but met no error (it was idle)."""


class ElasticRank:
    """`regroup` / `open_regroup_store` of `actors.rank.worker.RankWorker` and the step thread's side of them.

    Reads and writes the worker's `rank`, `world_size`, `group`, `shm`, `placement`, `engine`, `_store`, `_cond`,
    `_stop`, `_regroup_order`, `_regroup_done`, `channel`; calls `_close_group`, `_join_group`, `node_ip`."""

    def open_regroup_store(self) -> tuple[str, int]:
        """The new rank 0 of a regroup: (node IP, port) of a store for the new group (this rank's own rendezvous
        store if it hosted the old group's, else a new one)."""
        if self._store is None:
            self._store = host_store(self.world_size)
        return self.node_ip(), self._store.port

    def regroup(self, rank: int, world_size: int, addr: str, port: int, placement: dict, prefix: str,
                backend: str = "gloo", timeout_s: float = 10.0, transport: str = "auto",
                wait_s: float = 60.0, interrupt: bool = False) -> dict:
        """Join the survivors' new EP group as `rank` of `world_size` (store at addr:port under `prefix`; the new rank
        0 must have called `open_regroup_store`), under `placement` (the shrunk one: this rank keeps its experts).
        Blocks until the step thread has switched. Returns {rank, world_size, pid, regroup_s (seconds the switch
        took on the step thread)}. Raises ValueError for a rank out of range or a non-elastic rank, TimeoutError
        when not switched within wait_s, RuntimeError when the switch failed (the rank then fails its requests).
        interrupt: a peer is lost (`EPCluster.shrink`): a step collective of the old group that waits on it gives
        up now (`interrupt` of the step transport) rather than at the collective timeout; a gloo collective (a
        message too large for that transport) still waits its timeout."""
        if not self.elastic:
            raise ValueError(f"rank {self.rank} is not elastic (no redundant experts): the group is rebuilt instead")
        if not 0 <= rank < world_size:
            raise ValueError(f"regroup: rank={rank} out of range for world_size={world_size}")
        order = (rank, world_size, addr, port, ExpertPlacement.from_dict(placement), prefix, backend, timeout_s,
                 transport)
        deadline = time.monotonic() + wait_s
        with self._cond:
            old = self.shm  # the old group's: the step thread swaps it only after it has read the order
            self._regroup_done = None
            self._regroup_order = order
            self._cond.notify_all()
            if interrupt and old is not None:
                old.interrupt()
            while self._regroup_done is None:
                left = deadline - time.monotonic()
                if left <= 0 or self._failed is not None:
                    break
                self._cond.wait(timeout=min(left, 0.5))
            done = self._regroup_done
        if done is None:
            if self._failed is not None:
                raise RuntimeError(f"rank {self.rank} failed before it could regroup")
            raise TimeoutError(f"rank {self.rank}: not regrouped within {wait_s}s")
        if "error" in done:
            raise RuntimeError(done["error"])
        return done

    def _await_regroup(self, exc: Exception) -> bool:
        """Step thread, after `exc` interrupted a round: wait for a regroup order (heartbeats go on meanwhile) and
        apply it. Returns False (the caller fails the rank) when none comes within REGROUP_WAIT_S, on stop, or when
        applying it fails."""
        if not isinstance(exc, RegroupNow):
            print(f"rank {self.rank}: step interrupted ({type(exc).__name__}: {exc}); waiting for the survivors' "
                  f"new group", flush=True)
        deadline = time.monotonic() + REGROUP_WAIT_S
        while True:
            with self._cond:
                if self._regroup_order is None and not self._stop:
                    self._cond.wait(timeout=min(HEARTBEAT_S, max(0.0, deadline - time.monotonic())))
                order, self._regroup_order, stop = self._regroup_order, None, self._stop
            if order is not None:
                break
            if stop or time.monotonic() > deadline:
                return False
            self.channel.tick()  # the router's channel stays alive (heartbeats) while we wait
        t0 = time.perf_counter()
        try:
            self._apply_regroup(*order)
        except Exception as e:  # noqa: BLE001 - the order could not be applied: fail like a non-elastic rank
            with self._cond:
                self._regroup_done = {"error": f"rank {self.rank}: regroup failed ({type(e).__name__}: {e})"}
                self._cond.notify_all()
            return False
        with self._cond:
            self._regroup_done = {"rank": self.rank, "world_size": self.world_size, "pid": os.getpid(),
                                  "regroup_s": time.perf_counter() - t0}
            self._cond.notify_all()
        return True

    def _apply_regroup(self, rank: int, world_size: int, addr: str, port: int, placement: ExpertPlacement,
                       prefix: str, backend: str, timeout_s: float, transport: str) -> None:
        self._close_group()  # the old group's process group and transport
        self.group, self.shm = None, None
        self.rank, self.world_size = rank, world_size
        if world_size > 1:
            base = self._store if rank == 0 else join_store(addr, port, world_size, max(120.0, timeout_s))
            self._join_group(dist.PrefixStore(prefix, base), backend, timeout_s, transport)
        self.engine.regroup(placement, rank, self.group, self.shm)
        self.placement = placement


    # ------------------------------------------------------------------ a replacement rank
    def prepare_join(self) -> dict:
        """A replacement rank, before it joins a running group: build the engine (weights read, KV cache
        allocated) with no process group yet, while the others keep serving. It computes on `num_threads_per_rank`
        threads, or one when that is 0 (the ranks sharing its node are not counted here). Returns {rank, pid,
        kv_blocks, expert_bytes}."""
        from actors.engine.engine import RankEngine

        self.num_threads = self.num_threads or 1
        apply_threads(self.num_threads)
        self.engine = RankEngine(self.engine_cfg, self.placement, self.rank, None, shm=None)
        return {"rank": self.rank, "pid": os.getpid(), "kv_blocks": self.engine.cache.allocator.num_blocks,
                "expert_bytes": self.expert_bytes()}

    def join(self, addr: str, port: int, prefix: str, backend: str = "gloo", timeout_s: float = 10.0,
             transport: str = "auto") -> dict:
        """A prepared replacement rank joins the group the others form by `regroup` (store at addr:port under
        `prefix`; this rank hosts it when it is rank 0, after `open_regroup_store`), then starts its step thread.
        Returns {rank, world_size, pid}. Raises RuntimeError before `prepare_join`."""
        if self.engine is None:
            raise RuntimeError(f"rank {self.rank}: join before prepare_join")
        base = self._store if self.rank == 0 else join_store(addr, port, self.world_size, max(120.0, timeout_s))
        self._join_group(dist.PrefixStore(prefix, base), backend, timeout_s, transport)
        self.engine.regroup(self.placement, self.rank, self.group, self.shm)
        self._start_loop()
        return {"rank": self.rank, "world_size": self.world_size, "pid": os.getpid()}
