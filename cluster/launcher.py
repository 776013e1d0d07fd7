"""Bring up N ranks as Ray actors on a placement group and join them in one torch.distributed group."""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Callable

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.model.config import ModelConfig
from actors.rank.worker import RankWorker
from cluster.config import ClusterConfig
from cluster.elastic_group import ElasticGroup
from cluster.lost_nodes import ask_health, avoid_selector, silent_nodes
from cluster.metrics import aggregate_stats
from cluster.node_groups import PlacementTimeoutError, bundle_of, describe_unplaced, describe_wanted, rank_bundles
from cluster.placement import contiguous_placement, eplb_placement, expected_rank_load, redundant_placement

log = logging.getLogger("moeray.cluster")


class EPCluster(ElasticGroup):
    """An expert-parallel group: `ranks` RankWorker actors on one placement group: one bundle per rank, or with
    `ranks_per_node` = N one per node group, rank r in bundle r // N (`cluster.node_groups`); with redundant
    experts a lost rank is dropped and replaced while the others serve (`cluster.elastic_group`). `on_stage(what)`,
    if given (also to `restart`), hears what the build or a rebuild waits on at each stage (the router's /health).

    Raises:
        PlacementTimeoutError (a TimeoutError): the placement group cannot be scheduled within
            `cfg.placement_timeout_s` seconds (the group is removed, not left pending).
        TimeoutError: the ranks are not set up within `setup_timeout_s` seconds (weights read, process group).
        ray.exceptions.RayActorError: a rank failed during setup (message includes the cause).
    """

    on_stage: Callable[[str], None] | None = None

    def __init__(self, cfg: ClusterConfig, setup_timeout_s: float = 300.0,
                 on_stage: Callable[[str], None] | None = None):
        self.cfg, self.on_stage = cfg, on_stage
        mc = ModelConfig.from_pretrained(cfg.model)
        self.model_config = mc
        self._dense = [l for l in range(mc.num_layers) if not mc.moe_layers[l]]
        self.placement = (redundant_placement(mc.num_layers, mc.num_experts, cfg.ranks, dense_layers=self._dense)
                          if cfg.redundant_experts else contiguous_placement(mc.num_layers, mc.num_experts, cfg.ranks))
        self._initial_placement = self.placement  # what a whole-group rebuild (`restart`) starts from
        self._avoid: set[str] = set()  # node ids a rebuild or a replacement found lost (`cluster.lost_nodes`)
        self._own: dict = {}  # slot -> a replacement's own placement group, off a lost node (`cluster.elastic_group`)
        self.pg = self._placement_group()
        self._stage(self._placing())
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

    def _stage(self, what: str) -> None:
        """Tell `on_stage` (if set) what the build or rebuild waits on now."""
        if self.on_stage is not None:
            self.on_stage(what)

    def _placing(self) -> str:
        """The stage while Ray places the ranks' placement group: what it asks for, the strategy, lost nodes avoided."""
        what, need = describe_wanted(self.cfg)
        off = f", off {len(self._avoid)} lost node(s)" if self._avoid else ""
        return (f"waiting for Ray to place the ranks' placement group ({what} under {self.cfg.placement_strategy}"
                f"{need}{off})")

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
        self._stage(f"starting {cfg.ranks} rank actors (reading the weights, forming the process group)")
        actor_cls = ray.remote(RankWorker)
        self.slots = list(range(cfg.ranks))
        self.ranks = [
            actor_cls.options(
                num_cpus=cfg.num_cpus_per_rank, num_gpus=cfg.num_gpus_per_rank, max_concurrency=16,
                runtime_env=None if cfg.rank_niceness is None else {
                    "env_vars": {"RAY_worker_niceness": str(cfg.rank_niceness)}},
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

    def restart(self, timeout_s: float = 60.0, silent: frozenset[int] = frozenset(),
                on_stage: Callable[[str], None] | None = None) -> float:
        """Tear the whole EP group down and bring up a new one: every rank joins every all-to-all, so one
        dead rank leaves the others unable to step. Kills every rank actor (the survivors may be blocked in a
        collective until the process-group timeout, so they are only asked `health`: a rank that gives no answer
        within `lost_nodes.NODE_PROBE_S` sits on a lost node, and the placement group is then made anew without
        that node, `cluster.lost_nodes`; so it is, too, when an elastic replacement had left its bundle for a group
        of its own, which is removed: `cluster.elastic_group`), starts new actors in the placement group's bundles
        with the initial expert placement, and joins them in a new process group. KV caches and in-flight
        sequences are lost: the caller fails them first. silent: ranks the caller already found silent (not asked
        again). on_stage: replaces the constructor's (`_stage`). Returns the seconds taken.

        Raises:
            TimeoutError: the placement group or the new ranks are not ready within `timeout_s`.
            ray.exceptions.RayActorError: a new rank failed during setup.
        """
        t0 = time.perf_counter()
        self.on_stage = on_stage or self.on_stage
        self._stage("asking the old ranks whether their nodes are alive")
        lost = silent_nodes(self.pg, self.ranks, self._bundles(self.slots), known=silent)
        self._kill_ranks()
        # Ray still counts lost nodes alive and keeps bundles there: a new group, off them (also when a replacement
        # lives in a group of its own: the group's bundle it left sits on a lost node)
        if lost - self._avoid or self._own:
            self._avoid |= lost
            self.release_own()
            remove_placement_group(self.pg)
            self.pg = self._placement_group()
        self.placement = self._initial_placement  # all cfg.ranks ranks again, even after a `shrink`
        self._stage(self._placing())
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
        self.release_own()
        remove_placement_group(self.pg)
