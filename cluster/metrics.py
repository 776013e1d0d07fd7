"""Cluster-level aggregation of per-rank statistics (expert load, KV blocks, timings)."""
from __future__ import annotations

from actors.dispatch import ExpertPlacement


def max_over_mean(xs: list[float]) -> float:
    """max/mean of non-negative loads (1.0 = perfectly balanced; 0 loads give 1.0)."""
    m = sum(xs) / len(xs) if xs else 0.0
    return max(xs) / m if m > 0 else 1.0


def aggregate_stats(per_rank: list[dict], placement: ExpertPlacement) -> dict:
    """Sum expert token counts over ranks; report per-layer expert and rank max/mean.

    `expert_load[l][e]` counts (token, expert) assignments made by the router on every rank.
    Rank load of layer l = sum of the loads of the experts that rank holds.
    """
    L = len(per_rank[0]["expert_load"]) if per_rank else 0
    E = placement.num_experts
    load = [[sum(r["expert_load"][l][e] for r in per_rank) for e in range(E)] for l in range(L)]
    rank_load = [[0] * placement.world_size for _ in range(L)]
    for l in range(L):
        for e in range(E):
            rank_load[l][placement.rank_of[l][e]] += load[l][e]
    layers = [{"layer": l, "tokens": sum(load[l]), "expert_max_mean": max_over_mean(load[l]),
               "rank_max_mean": max_over_mean(rank_load[l])} for l in range(L) if sum(load[l])]
    return {
        "expert_load": load,
        "rank_load": rank_load,
        "layers": layers,
        "kv_blocks_total": sum(r["kv_blocks_total"] for r in per_rank),
        "kv_blocks_free": sum(r["kv_blocks_free"] for r in per_rank),
        "running": sum(r["running"] for r in per_rank),
        "waiting": sum(r["waiting"] for r in per_rank),
        "ranks": per_rank,
    }
