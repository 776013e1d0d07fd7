"""The ranks' placement-group bundles: one per rank, or with `ranks_per_node` one per node group of N ranks.

Ray's placement groups have no "N bundles per node" strategy, and a bundle never spans nodes. So with
`ClusterConfig.ranks_per_node = N` the group asks for ranks / N bundles of N x the per-rank resources each, under
STRICT_SPREAD (each on its own node) or SPREAD (own nodes where possible); rank r runs in bundle r // N
(`bundle_of`), taking its per-rank share of it, so ranks N*g .. N*g + N - 1 share node group g's node. A
replacement rank (rank failure, elastic grow) goes back into its own group's bundle. Without N: one bundle per
rank under `placement_strategy`, and bundle index == rank.
"""
from __future__ import annotations

import ray


def rank_bundles(ranks: int, num_cpus_per_rank: float, num_gpus_per_rank: float = 0.0,
                 ranks_per_node: int | None = None) -> list[dict[str, float]]:
    """The placement group's bundles: `ranks` of {CPU: num_cpus_per_rank[, GPU: num_gpus_per_rank]} (None), or
    ranks / N of N times that (ranks_per_node = N; resources in Ray units, CPU cores / GPUs, rounded to 1e-4 as
    Ray does). No GPU key when num_gpus_per_rank is 0. Raises ValueError unless ranks is a multiple of N >= 1."""
    n = 1 if ranks_per_node is None else ranks_per_node
    if n < 1 or ranks % n:
        raise ValueError(f"ranks={ranks} must be a multiple of ranks_per_node={ranks_per_node}")
    bundle = {"CPU": round(n * num_cpus_per_rank, 4)}
    if num_gpus_per_rank:
        bundle["GPU"] = round(n * num_gpus_per_rank, 4)
    return [dict(bundle) for _ in range(ranks // n)]


def bundle_of(rank: int, ranks_per_node: int | None = None) -> int:
    """The bundle index rank `rank` (of the whole group) runs in: rank // N with ranks_per_node = N, else rank."""
    return rank // ranks_per_node if ranks_per_node else rank


class PlacementTimeoutError(TimeoutError):
    """The rank placement group was not placed within `ClusterConfig.placement_timeout_s`; the message is
    `describe_unplaced`'s (what was asked for, the strategy, the alive nodes and cluster resources). No attempt
    with the same layout on the same cluster can do better, so callers report it instead of retrying."""


def describe_wanted(cfg) -> tuple[str, str]:
    """What a rank placement group of `cfg` (a ClusterConfig) asks for, as (what, need): "2 x {'CPU': 1.0}" or the
    node groups of `ranks_per_node`, and under STRICT_SPREAD with node groups how many nodes that takes (else "")."""
    bundles = rank_bundles(cfg.ranks, cfg.num_cpus_per_rank, cfg.num_gpus_per_rank, cfg.ranks_per_node)
    what, need = f"{cfg.ranks} x {bundles[0]}", ""
    if cfg.ranks_per_node:
        what = (f"{len(bundles)} node groups of ranks_per_node={cfg.ranks_per_node} ranks ({len(bundles)} x "
                f"{bundles[0]})")
        if cfg.placement_strategy == "STRICT_SPREAD":
            need = f": each group on its own node, so it needs {len(bundles)} nodes with that much free"
    return what, need


def describe_unplaced(cfg, timeout_s: float) -> str:
    """The TimeoutError message for a rank placement group of `cfg` (a ClusterConfig) not placed within
    `timeout_s` seconds: what it asked for, under which strategy, and the alive nodes / cluster resources."""
    try:
        alive = sum(1 for n in ray.nodes() if n.get("Alive"))
    except Exception:  # noqa: BLE001 - the message is best effort
        alive = "?"
    what, need = describe_wanted(cfg)
    return (f"placement group of {what} not schedulable within {timeout_s}s under {cfg.placement_strategy}{need} "
            f"({alive} alive nodes; cluster resources: {ray.cluster_resources()})")
