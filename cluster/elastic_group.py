"""Elastic EP on the launcher's side: drop a lost rank, then grow back with a replacement rank between steps.

`EPCluster.shrink` forms a new group over the survivors (no actor restarted); `prepare_grow` starts a replacement
and reads its experts while the survivors serve; `finish_grow` switches it in. Where the replacement runs: the lost
rank's own bundle (its node group's with `ranks_per_node`) when that bundle's node is alive (a SIGKILLed rank). When
the router found the lost rank silent (`RankSilent`: no frame, no health answer) and no survivor shares its node,
that node counts as lost (`cluster.lost_nodes`), and Ray keeps the bundle there until its GCS health checks fail
(about a minute), so a replacement started in it would not come up in time: it goes to a one-bundle placement group
of its own, off the lost nodes (`replacement_selector`), and lives there (`_own`) until the group is rebuilt
(`EPCluster.restart`) or shut down, which remove those groups. Ray cannot remove one bundle of a placement group,
so the lost rank's old bundle stays reserved until that rebuild or shutdown removes the whole group (on the lost
node at first; once Ray declares that node dead it moves the bundle to a live node, where it holds its resources
idle: BENCHMARKS.md "Node loss"); the rebuild then makes the group anew off the lost nodes.
"""
from __future__ import annotations

import logging
import time
from types import MappingProxyType

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.rank.worker import RankWorker
from cluster.lost_nodes import bundle_nodes, replacement_selector, silent_nodes
from cluster.node_groups import bundle_of, rank_bundles
from cluster.placement import shrink_placement

log = logging.getLogger("moeray.cluster")


class ElasticGroup:
    """`shrink` / `prepare_grow` / `finish_grow` / `abandon_grow` of `cluster.launcher.EPCluster`.

    Reads and writes the cluster's `cfg`, `ranks`, `slots`, `pg`, `placement`, `info`, `generation`, `_dense`,
    `_load_snaps`, `_avoid` (node ids found lost), `_own` (slot -> the replacement's own placement group) and
    `_lost_silently` (the slot the last `shrink` dropped, if the router found it silent); calls `stats`."""

    _lost_silently: int | None = None
    _own: "dict | MappingProxyType" = MappingProxyType({})  # rebound, never changed in place (`EPCluster` sets {})

    def home(self, slot: int) -> tuple:
        """(placement group, bundle index) rank `slot` of the whole group runs in: its own group's bundle 0 for a
        replacement placed off a lost node, else bundle `bundle_of(slot, ranks_per_node)` of the group's."""
        own = self._own.get(slot)
        return (own, 0) if own is not None else (self.pg, bundle_of(slot, self.cfg.ranks_per_node))

    def _bundles(self, slots: list[int]) -> list:
        """`lost_nodes.bundle_nodes` entries for `slots`: a bundle index into `self.pg`, or (own group, 0)."""
        return [self.home(s) if s in self._own else bundle_of(s, self.cfg.ranks_per_node) for s in slots]

    def release_own(self) -> None:
        """Remove every replacement's own placement group (before a whole-group rebuild, or at shutdown)."""
        for pg in self._own.values():
            remove_placement_group(pg)
        self._own = {}

    def shrink(self, dead: int, timeout_s: float = 30.0, silent: bool = False) -> dict:
        """Elastic EP: drop rank `dead` (killed if still there) and form a new group over the survivors, without
        restarting them: a new process group under a new store prefix, ranks renumbered in order, the placement
        without the dead rank's replicas (`shrink_placement`: the survivors keep their experts). The survivors'
        sequences and KV caches are untouched; each re-runs the step the loss interrupted. silent: the router found
        `dead` silent rather than gone (its node may be lost: `prepare_grow` then checks). Returns {dead,
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
        self._lost_silently = self.slots[dead] if silent else None
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

    def _replacement_home(self, slot: int, timeout_s: float) -> tuple:
        """(placement group, bundle index, own group or None) for the replacement of `slot`: its home (`home`),
        unless `slot` was lost silently and its node counts as lost (the survivors are asked `health`,
        `lost_nodes.silent_nodes`): then a new one-bundle group off the lost nodes, placed within `timeout_s`
        seconds. Raises TimeoutError (the new group removed) when it is not placed in time."""
        if slot != self._lost_silently:
            return (*self.home(slot), None)
        lost = silent_nodes(self.pg, [*self.ranks, None], self._bundles([*self.slots, slot]),
                            known=frozenset({len(self.ranks)}))
        if not lost:
            return (*self.home(slot), None)
        self._avoid |= lost
        cfg = self.cfg
        try:
            survivor_nodes = {n for n in bundle_nodes(self.pg, self._bundles(self.slots)) if n}
        except Exception:  # noqa: BLE001 - only STRICT_SPREAD needs them: Ray then places it where it can
            survivor_nodes = set()
        bundle = rank_bundles(1, cfg.num_cpus_per_rank, cfg.num_gpus_per_rank)
        pg = placement_group(bundle, strategy="PACK",
                             bundle_label_selector=replacement_selector(self._avoid, cfg.placement_strategy,
                                                                        survivor_nodes))
        ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
        if not ready:
            remove_placement_group(pg)
            raise TimeoutError(f"no node outside the lost ones {sorted(n[:12] for n in self._avoid)} had "
                               f"{bundle[0]} free for a replacement rank within {timeout_s}s "
                               f"(placement_strategy={cfg.placement_strategy})")
        log.warning("rank %d's node %s counts as lost: its replacement goes to a placement group of its own "
                    "off it", slot, sorted(n[:12] for n in lost))
        return pg, 0, pg

    def prepare_grow(self, timeout_s: float = 120.0) -> dict:
        """Elastic EP, after a `shrink`: start a replacement rank in the lost rank's bundle (its node group's with
        `ranks_per_node`), or off its node when that node counts as lost (module docstring), and read its experts
        (the whole group's placement) while the others keep serving. Returns the handle for `finish_grow` (or
        `abandon_grow`): {slot, actor, info, prepare_s (seconds to place, start and load it), pg (its own
        placement group, or None)}.

        Raises:
            ValueError: not exactly one rank of the whole group is missing.
            TimeoutError / ray errors: not placed or loaded within `timeout_s` seconds, or its setup failed (the
                actor killed, its own group removed).
        """
        lost = [b for b in range(self.cfg.ranks) if b not in self.slots]
        if len(lost) != 1:
            raise ValueError(f"grow needs exactly one missing rank, missing: {lost}")
        cfg, b = self.cfg, lost[0]
        t0 = time.perf_counter()
        group, index, own = self._replacement_home(b, timeout_s)
        actor = None
        try:
            actor = ray.remote(RankWorker).options(
                num_cpus=cfg.num_cpus_per_rank, num_gpus=cfg.num_gpus_per_rank, max_concurrency=16,
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=group,
                                                                     placement_group_bundle_index=index),
            ).remote(b, cfg.ranks, cfg.engine_config(), self._whole_placement.to_dict(), cfg.num_threads_per_rank,
                     True)
            info = ray.get(actor.prepare_join.remote(), timeout=max(1.0, timeout_s - (time.perf_counter() - t0)))
        except BaseException:
            self.abandon_grow({"actor": actor, "pg": own})
            raise
        return {"slot": b, "actor": actor, "info": info, "prepare_s": time.perf_counter() - t0, "pg": own}

    def abandon_grow(self, prepared: dict) -> None:
        """Undo a `prepare_grow` that will not be switched in: kill its actor, remove its own placement group."""
        if prepared.get("actor") is not None:
            try:
                ray.kill(prepared["actor"], no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        if prepared.get("pg") is not None:
            remove_placement_group(prepared["pg"])

    def finish_grow(self, prepared: dict, timeout_s: float = 30.0) -> dict:
        """Switch to the whole group between steps: the survivors `regroup` back to their ranks of the whole group
        (same experts, same local rows), the replacement `join`s, all under a new store prefix; a replacement in a
        placement group of its own keeps it (`home`). Returns {rank (the replacement's), world_size, generation,
        prepare_s, switch_s}. Raises what the calls raise (the replacement is then killed and its own group
        removed; the caller rebuilds the group)."""
        t0 = time.perf_counter()
        b, actor, cfg = prepared["slot"], prepared["actor"], self.cfg
        slots = sorted(self.slots + [b])
        ranks = [actor if s == b else self.ranks[self.slots.index(s)] for s in slots]
        try:
            addr, port = ray.get(ranks[0].open_regroup_store.remote(), timeout=timeout_s)
            self.generation += 1
            prefix, full = f"moeray/elastic/{self.generation}", self._whole_placement
            calls = [actor.join.remote(addr, port, prefix, cfg.backend, cfg.pg_timeout_s, cfg.transport) if s == b
                     else r.regroup.remote(i, len(slots), addr, port, full.to_dict(), prefix, cfg.backend,
                                           cfg.pg_timeout_s, cfg.transport, timeout_s)
                     for i, (s, r) in enumerate(zip(slots, ranks))]
            ray.get(calls, timeout=timeout_s + 5)
        except BaseException:
            self.abandon_grow(prepared)
            raise
        if prepared.get("pg") is not None:  # its home from now on; the one it had before (lost too) goes
            old = self._own.get(b)
            self._own = {**self._own, b: prepared["pg"]}
            if old is not None:
                remove_placement_group(old)
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
