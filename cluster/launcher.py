"""Bring up N ranks as Ray actors on a placement group and join them in one torch.distributed group."""
from __future__ import annotations

import logging
import threading
import time
from collections import deque

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.model.config import ModelConfig
from actors.rank.worker import RankWorker
from cluster.config import ClusterConfig
from cluster.lost_nodes import ask_health, avoid_selector, silent_nodes
from cluster.metrics import aggregate_stats
from cluster.node_groups import PlacementTimeoutError, bundle_of, describe_unplaced, rank_bundles
from cluster.placement import (contiguous_placement, eplb_placement, expected_rank_load, redundant_placement,
                               shrink_placement)

log = logging.getLogger("moeray.cluster")


class EPCluster:
    """An expert-parallel group: `ranks` RankWorker actors on one placement group: one bundle per rank, or with
    `ranks_per_node` = N one per node group, rank r in bundle r // N (`cluster.node_groups`).

    Raises:
        PlacementTimeoutError (a TimeoutError): the placement group cannot be scheduled within
            `cfg.placement_timeout_s` seconds (the group is removed, not left pending).
        TimeoutError: the ranks are not set up within `setup_timeout_s` seconds (weights read, process group).
        ray.exceptions.RayActorError: a rank failed during setup (message includes the cause).
    """

    def __init__(self, cfg: ClusterConfig, setup_timeout_s: float = 300.0):
        self.cfg = cfg
        mc = ModelConfig.from_pretrained(cfg.model)
        self.model_config = mc
        self._dense = [l for l in range(mc.num_layers) if not mc.moe_layers[l]]
        self.placement = (redundant_placement(mc.num_layers, mc.num_experts, cfg.ranks, dense_layers=self._dense)
                          if cfg.redundant_experts else contiguous_placement(mc.num_layers, mc.num_experts, cfg.ranks))
        self._initial_placement = self.placement  # what a whole-group rebuild (`restart`) starts from
        self._avoid: set[str] = set()  # node ids a rebuild found silent (`cluster.lost_nodes`)
        self.pg = self._placement_group()
        ready, _ = ray.wait([self.pg.ready()], timeout=cfg.placement_timeout_s)
        if not ready:
            remove_placement_group(self.pg)
            raise PlacementTimeoutError(describe_unplaced(cfg, cfg.placement_timeout_s))
        self.ranks: list = []
        self.slots: list[int] = []  # each rank's rank in the whole group (its bundle: `bundle_of(slot, N)`)
        self.generation = 0
        self._spawn(setup_timeout_s)
        self.kv_blocks_per_rank = self.info[0]["kv_blocks"]
        # sliding window of expert load: (monotonic time s, cumulative [L][E] summed over ranks) snapshots,
        # taken by every stats() / sample_load() / rebalance() call; the first is all zeros (cluster start)
        self._load_snaps: deque = deque(maxlen=4096)
        self._load_snaps.append((time.monotonic(), [[0] * mc.num_experts for _ in range(mc.num_layers)]))
        self._placement_epoch = 0
        self._rebalance_lock = threading.Lock()
        log.info("EP group up: %d ranks, %s, %d KV blocks per rank, %s compute threads per rank", cfg.ranks, cfg.backend,
                 self.kv_blocks_per_rank, "/".join(str(i.get("threads")) for i in self.info))
        if cfg.redundant_experts:
            m = self.expert_memory()
            log.info("redundant experts: every expert on >= 2 ranks; routed expert weights %.1f MiB over all ranks, "
                     "%.1f MiB of them replicas (%.2fx a single copy)", m["expert_bytes"] / 2**20,
                     m["redundant_expert_bytes"] / 2**20, m["expert_bytes"] / max(1, m["expert_bytes"] - m["redundant_expert_bytes"]))
        slow = [i["rank"] for i in self.info if i.get("cpu_kernels") is False]
        if slow:  # the ranks log why in their own worker logs, which a driver with log_to_driver=False never shows
            log.warning("ranks %s run without the compiled CPU kernels (no C compiler, no AVX2/FMA, or "
                        "MOERAY_DISABLE_CPU_KERNELS=1): PyTorch paths, same results, about half the decode speed",
                        slow)

    def _placement_group(self):
        """The ranks' placement group (one bundle per rank or node group), kept off the nodes in `self._avoid`."""
        cfg = self.cfg
        bundles = rank_bundles(cfg.ranks, cfg.num_cpus_per_rank, cfg.num_gpus_per_rank, cfg.ranks_per_node)
        return placement_group(bundles, strategy=cfg.placement_strategy,
                               bundle_label_selector=avoid_selector(self._avoid, len(bundles)))

    def _spawn(self, timeout_s: float) -> None:
        """Start one RankWorker per rank (rank i in bundle `bundle_of(i, N)` of `self.pg`) under the current
        placement and join them in a new process group (a fresh rendezvous store, on a port rank 0 holds from the
        bind on, each time)."""
        cfg = self.cfg
        actor_cls = ray.remote(RankWorker)
        self.slots = list(range(cfg.ranks))
        self.ranks = [
            actor_cls.options(
                num_cpus=cfg.num_cpus_per_rank, num_gpus=cfg.num_gpus_per_rank, max_concurrency=16,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=bundle_of(i, cfg.ranks_per_node)),
            ).remote(i, cfg.ranks, cfg.engine_config(), self.placement.to_dict(), cfg.num_threads_per_rank,
                     cfg.redundant_experts)
            for i in range(cfg.ranks)
        ]
        try:
            # every actor process up before the rendezvous starts
            ray.get([r.node_ip.remote() for r in self.ranks], timeout=timeout_s)
            addr, port = ray.get(self.ranks[0].open_rendezvous.remote(max(120.0, cfg.pg_timeout_s)), timeout=timeout_s)
            self.info = ray.get([r.setup.remote(addr, port, cfg.backend, cfg.pg_timeout_s, cfg.transport) for r in self.ranks],
                                timeout=timeout_s)
        except BaseException:
            self._kill_ranks()
            raise

    def expert_memory(self, per_rank: list[dict] | None = None) -> dict:
        """{expert_bytes: routed expert weights held over all ranks, replicas included (bytes, as the ranks report
        them in `per_rank` stats, else at setup); redundant_expert_bytes: the share of it beyond one copy of each expert (the memory cost of
        `--redundant-experts` or EPLB replicas), assuming every expert of the model has the same size}."""
        total = sum(i.get("expert_bytes", 0) for i in (self.info if per_rank is None else per_rank))
        moe = [l for l in range(self.model_config.num_layers) if l not in self._dense]
        held = sum(len(reps) for l in moe for reps in self.placement.replicas[l])
        extra = sum(self.placement.num_redundant(l) for l in moe)
        return {"expert_bytes": total, "redundant_expert_bytes": round(total * extra / held) if held else 0}

    def _kill_ranks(self) -> None:
        for r in self.ranks:
            try:
                ray.kill(r, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead
                pass

    def restart(self, timeout_s: float = 60.0, silent: frozenset[int] = frozenset()) -> float:
        """Tear the whole EP group down and bring up a new one: every rank joins every all-to-all, so one
        dead rank leaves the others unable to step. Kills every rank actor (the survivors may be blocked in a
        collective until the process-group timeout, so they are only asked `health`: a rank that gives no answer
        within `lost_nodes.NODE_PROBE_S` sits on a lost node, and the placement group is then made anew without
        that node, `cluster.lost_nodes`), starts new actors in the placement group's bundles with the initial
        expert placement, and joins them in a new process group. KV caches and in-flight sequences are lost: the
        caller fails them first. silent: ranks the caller already found silent (not asked again). Returns the
        seconds taken.

        Raises:
            TimeoutError: the placement group or the new ranks are not ready within `timeout_s`.
            ray.exceptions.RayActorError: a new rank failed during setup.
        """
        t0 = time.perf_counter()
        lost = silent_nodes(self.pg, self.ranks, [bundle_of(s, self.cfg.ranks_per_node) for s in self.slots],
                            known=silent)
        self._kill_ranks()
        if lost - self._avoid:  # Ray still counts them alive and keeps bundles there: a new group, off them
            self._avoid |= lost
            remove_placement_group(self.pg)
            self.pg = self._placement_group()
        self.placement = self._initial_placement  # all cfg.ranks ranks again, even after a `shrink`
        ready, _ = ray.wait([self.pg.ready()], timeout=timeout_s)
        if not ready:
            raise TimeoutError(f"placement group not ready within {timeout_s}s after a rank failure")
        self._spawn(timeout_s)
        self.generation += 1
        # the new ranks count expert load from zero: restart the cumulative snapshots with them
        mc = self.model_config
        self._load_snaps.clear()
        self._load_snaps.append((time.monotonic(), [[0] * mc.num_experts for _ in range(mc.num_layers)]))
        log.warning("EP group rebuilt (generation %d) in %.1f s", self.generation, time.perf_counter() - t0)
        return time.perf_counter() - t0

    def shrink(self, dead: int, timeout_s: float = 30.0) -> dict:
        """Elastic EP: drop rank `dead` (killed if still there) and form a new group over the survivors, without
        restarting them: a new process group under a new store prefix, ranks renumbered in order, the placement
        without the dead rank's replicas (`shrink_placement`: the survivors keep their experts). The survivors'
        sequences and KV caches are untouched; each re-runs the step the loss interrupted. Returns {dead,
        world_size, generation, shrink_s, regroup_s (slowest survivor's switch)}.

        Raises:
            ValueError: no redundant experts, a single rank, or some expert lived only on `dead` (rebuild instead).
            TimeoutError / RuntimeError / ray errors: a survivor did not switch (rebuild the group).
        """
        t0 = time.perf_counter()
        if not self.cfg.redundant_experts:
            raise ValueError("shrink needs redundant experts (ClusterConfig.redundant_experts)")
        new = shrink_placement(self.placement, dead, dense_layers=self._dense)
        self._whole_placement = self.placement  # what a replacement rank joins back (`prepare_grow`)
        try:
            ray.kill(self.ranks[dead], no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass
        survivors = [r for i, r in enumerate(self.ranks) if i != dead]
        W = len(survivors)
        self.generation += 1
        addr, port = ray.get(survivors[0].open_regroup_store.remote(), timeout=timeout_s) if W > 1 else ("", 0)
        prefix = f"moeray/elastic/{self.generation}"
        cfg = self.cfg
        done = ray.get([r.regroup.remote(i, W, addr, port, new.to_dict(), prefix, cfg.backend, cfg.pg_timeout_s,
                                         cfg.transport, timeout_s, interrupt=True) for i, r in enumerate(survivors)],
                       timeout=timeout_s + 5)  # interrupt: a survivor waiting on the lost rank stops waiting
        self.ranks, self.placement = survivors, new
        del self.slots[dead]
        # the lost rank's expert-load counts went with it: the load window restarts from the survivors' counts now
        self._load_snaps.clear()
        self.stats()
        self.info = [{**info, "rank": d["rank"]} for info, d in zip(
            [x for i, x in enumerate(self.info) if i != dead], done)]
        out = {"dead": dead, "world_size": W, "generation": self.generation, "shrink_s": time.perf_counter() - t0,
               "regroup_s": max(d["regroup_s"] for d in done)}
        log.warning("rank %d lost: %d survivors regrouped (generation %d) in %.2f s", dead, W, self.generation,
                    out["shrink_s"])
        return out

    def prepare_grow(self, timeout_s: float = 120.0):
        """Elastic EP, after a `shrink`: start a replacement rank in the lost rank's bundle (its node group's with
        `ranks_per_node`) and read its experts
        (the whole group's placement) while the others keep serving. Returns the handle for `finish_grow`.
        Raises ValueError unless exactly one rank of the whole group is missing."""
        lost = [b for b in range(self.cfg.ranks) if b not in self.slots]
        if len(lost) != 1:
            raise ValueError(f"grow needs exactly one missing rank, missing: {lost}")
        cfg, b = self.cfg, lost[0]
        actor = ray.remote(RankWorker).options(
            num_cpus=cfg.num_cpus_per_rank, num_gpus=cfg.num_gpus_per_rank, max_concurrency=16,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self.pg, placement_group_bundle_index=bundle_of(b, cfg.ranks_per_node)),
        ).remote(b, cfg.ranks, cfg.engine_config(), self._whole_placement.to_dict(), cfg.num_threads_per_rank, True)
        t0 = time.perf_counter()
        try:
            info = ray.get(actor.prepare_join.remote(), timeout=timeout_s)
        except BaseException:
            ray.kill(actor, no_restart=True)
            raise
        return {"slot": b, "actor": actor, "info": info, "prepare_s": time.perf_counter() - t0}

    def finish_grow(self, prepared: dict, timeout_s: float = 30.0) -> dict:
        """Switch to the whole group between steps: the survivors `regroup` back to their ranks of the whole group
        (same experts, same local rows), the replacement `join`s, all under a new store prefix. Returns {rank
        (the replacement's), world_size, generation, prepare_s, switch_s}. Raises what the calls raise (the
        caller rebuilds the group)."""
        t0 = time.perf_counter()
        b, actor, cfg = prepared["slot"], prepared["actor"], self.cfg
        slots = sorted(self.slots + [b])
        ranks = [actor if s == b else self.ranks[self.slots.index(s)] for s in slots]
        addr, port = ray.get(ranks[0].open_regroup_store.remote(), timeout=timeout_s)
        self.generation += 1
        prefix, full = f"moeray/elastic/{self.generation}", self._whole_placement
        calls = [actor.join.remote(addr, port, prefix, cfg.backend, cfg.pg_timeout_s, cfg.transport) if s == b else
                 r.regroup.remote(i, len(slots), addr, port, full.to_dict(), prefix, cfg.backend, cfg.pg_timeout_s,
                                  cfg.transport, timeout_s) for i, (s, r) in enumerate(zip(slots, ranks))]
        ray.get(calls, timeout=timeout_s + 5)
        info = {s: x for s, x in zip(self.slots, self.info)}
        info[b] = prepared["info"]
        self.ranks, self.slots, self.placement = ranks, slots, full
        self.info = [{**info[s], "rank": i} for i, s in enumerate(slots)]
        self._load_snaps.clear()
        self.stats()
        out = {"rank": b, "world_size": len(slots), "generation": self.generation,
               "prepare_s": prepared["prepare_s"], "switch_s": time.perf_counter() - t0}
        log.warning("replacement rank %d joined (generation %d): read its experts in %.2f s, switched in %.2f s",
                    b, self.generation, out["prepare_s"], out["switch_s"])
        return out

    def stats(self) -> dict:
        """Cluster snapshot: per-rank stats and aggregated expert load (see `cluster.metrics`)."""
        per_rank = ray.get([r.stats.remote() for r in self.ranks], timeout=30)
        out = aggregate_stats(per_rank, self.placement)
        out.update(self.expert_memory(per_rank))
        self._load_snaps.append((time.monotonic(), out["expert_load"]))
        return out

    # ------------------------------------------------------------------ expert placement (EPLB)
    def sample_load(self) -> list[list[int]]:
        """Take a load snapshot now; returns the cumulative expert load [L][E] (summed over ranks)."""
        return self.stats()["expert_load"]

    def windowed_load(self, window_s: float | None = None) -> list[list[int]]:
        """Expert load [L][E] routed within the last `window_s` seconds (None: since cluster start).

        Sliding window by differencing cumulative snapshots: now minus the oldest snapshot taken at most
        `window_s` ago (so the window's true length is between the age of that snapshot and window_s;
        sample_load() more often for a finer window). Raises ValueError if window_s <= 0.
        """
        if window_s is not None and window_s <= 0:
            raise ValueError(f"window_s={window_s} must be > 0 (or None for since start)")
        now = self.sample_load()
        t_now = self._load_snaps[-1][0]
        base = self._load_snaps[0][1]
        if window_s is not None:
            inside = [snap for t, snap in self._load_snaps if t >= t_now - window_s]
            base = inside[0]  # never empty: it holds the snapshot just taken
        return [[a - b for a, b in zip(ra, rb)] for ra, rb in zip(now, base)]

    def rebalance(self, window_s: float | None = None, num_redundant: int | None = None,
                  load: list[list[float]] | None = None, timeout_s: float = 120.0) -> dict:
        """Plan an EPLB placement from the observed expert load and switch every rank to it between two steps,
        while requests keep running (none is lost or restarted).

        Args:
            window_s: load window in seconds (see `windowed_load`; None: everything since start).
            num_redundant: extra expert replicas per layer (default: world size, one spare slot per rank).
            load: [L][E] loads to plan from instead of the observed window (tests, offline plans).
        Returns {epoch, step (engine steps each rank ran before switching), tokens (assignments in the
        window), redundant (per layer), rank_balance_before / _after (per layer mean/max of the window's
        expected rank load under the old / new placement), load_s (slowest rank's weight read, s)}.
        Raises:
            ValueError: bad window_s / num_redundant. RuntimeError: the ranks did not switch at the same step.
        """
        W = len(self.ranks)
        mc = self.model_config
        # redundant experts: every expert keeps >= 2 replicas, so the group still survives a rank loss
        least = 2 if self.cfg.redundant_experts and W >= 2 else 1
        if num_redundant is None:
            num_redundant = max(W if W > 1 else 0, mc.num_experts * (least - 1))
        with self._rebalance_lock:
            if load is None:
                load = self.windowed_load(window_s)
            dense = [l for l in range(mc.num_layers) if not mc.moe_layers[l]]
            new = eplb_placement(load, W, num_redundant, dense_layers=dense, min_replicas=least)
            self._placement_epoch += 1
            epoch = self._placement_epoch
            prep = ray.get([r.prepare_placement.remote(new.to_dict(), epoch) for r in self.ranks], timeout=timeout_s)
            done = ray.get([r.commit_placement.remote(epoch, timeout_s) for r in self.ranks], timeout=timeout_s + 10)
            steps = {d["step"] for d in done}
            if len(steps) != 1:
                raise RuntimeError(f"placement epoch={epoch} applied at different steps per rank: {done}")
            old, self.placement = self.placement, new
        moe = [l for l in range(mc.num_layers) if mc.moe_layers[l]]

        def bal(p):
            rl = expected_rank_load(p, load)
            return [(sum(rl[l]) / W) / max(rl[l]) if max(rl[l]) > 0 else 1.0 for l in moe]

        out = {"epoch": epoch, "step": steps.pop(), "tokens": sum(map(sum, load)),
               "redundant": [new.num_redundant(l) for l in range(mc.num_layers)],
               "rank_balance_before": bal(old), "rank_balance_after": bal(new),
               "load_s": max(p["load_s"] for p in prep)}
        log.info("placement epoch %d applied at step %d: rank balance (mean/max) %s -> %s", epoch, out["step"],
                 [round(x, 3) for x in out["rank_balance_before"]], [round(x, 3) for x in out["rank_balance_after"]])
        return out

    def health(self) -> list[dict]:
        """Each rank's health, all asked at once within `lost_nodes.NODE_PROBE_S` (`ask_health`)."""
        return ask_health(self.ranks)

    def shutdown(self, seq: int) -> None:
        try:
            ray.get([r.shutdown.remote(seq) for r in self.ranks], timeout=30)
        except Exception as e:  # noqa: BLE001 - best effort; actors are killed below anyway
            log.warning("rank shutdown: %s", e)
        self._kill_ranks()
        remove_placement_group(self.pg)
