"""Bring up N ranks as Ray actors on a placement group and join them in one torch.distributed group."""
from __future__ import annotations

import logging

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.config import ModelConfig
from actors.rank_actor import RankWorker
from cluster.config import ClusterConfig
from cluster.metrics import aggregate_stats
from cluster.placement import contiguous_placement

log = logging.getLogger("moeray.cluster")


class EPCluster:
    """An expert-parallel group: `ranks` RankWorker actors, one per placement-group bundle.

    Raises:
        TimeoutError: the placement group cannot be scheduled within `timeout_s`.
        ray.exceptions.RayActorError: a rank failed during setup (message includes the cause).
    """

    def __init__(self, cfg: ClusterConfig, timeout_s: float = 300.0):
        self.cfg = cfg
        mc = ModelConfig.from_pretrained(cfg.model)
        self.model_config = mc
        self.placement = contiguous_placement(mc.num_layers, mc.num_experts, cfg.ranks)
        bundle = {"CPU": cfg.num_cpus_per_rank}
        if cfg.num_gpus_per_rank:
            bundle["GPU"] = cfg.num_gpus_per_rank
        self.pg = placement_group([dict(bundle) for _ in range(cfg.ranks)], strategy=cfg.placement_strategy)
        ready, _ = ray.wait([self.pg.ready()], timeout=timeout_s)
        if not ready:
            remove_placement_group(self.pg)
            raise TimeoutError(f"placement group of {cfg.ranks} x {bundle} not schedulable within {timeout_s}s "
                               f"(cluster resources: {ray.cluster_resources()})")
        actor_cls = ray.remote(RankWorker)
        self.ranks = [
            actor_cls.options(
                num_cpus=cfg.num_cpus_per_rank, num_gpus=cfg.num_gpus_per_rank, max_concurrency=16,
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=self.pg, placement_group_bundle_index=i),
            ).remote(i, cfg.ranks, cfg.engine_config(), self.placement.to_dict(), cfg.num_threads_per_rank)
            for i in range(cfg.ranks)
        ]
        # every actor process up before the rendezvous starts
        addr, port = ray.get([r.node_address.remote() for r in self.ranks], timeout=timeout_s)[0]
        self.info = ray.get([r.setup.remote(addr, port, cfg.backend, cfg.pg_timeout_s) for r in self.ranks],
                            timeout=timeout_s)
        self.kv_blocks_per_rank = self.info[0]["kv_blocks"]
        log.info("EP group up: %d ranks, %s, %d KV blocks per rank", cfg.ranks, cfg.backend, self.kv_blocks_per_rank)

    def stats(self) -> dict:
        """Cluster snapshot: per-rank stats and aggregated expert load (see `cluster.metrics`)."""
        per_rank = ray.get([r.stats.remote() for r in self.ranks], timeout=30)
        return aggregate_stats(per_rank, self.placement)

    def health(self) -> list[dict]:
        out = []
        for i, r in enumerate(self.ranks):
            try:
                out.append(ray.get(r.health.remote(), timeout=5))
            except Exception as e:  # noqa: BLE001
                out.append({"rank": i, "ok": False, "error": f"{type(e).__name__}: {e}"})
        return out

    def shutdown(self, seq: int) -> None:
        try:
            ray.get([r.shutdown.remote(seq) for r in self.ranks], timeout=30)
        except Exception as e:  # noqa: BLE001 - best effort; actors are killed below anyway
            log.warning("rank shutdown: %s", e)
        for r in self.ranks:
            ray.kill(r)
        remove_placement_group(self.pg)
