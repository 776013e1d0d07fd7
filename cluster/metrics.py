"""Cluster-level aggregation of per-rank statistics (expert load, balancedness, routing, KV blocks, timings).

Balance is reported both ways round, per MoE layer:
  - `*_max_mean` = max / mean load (1.0 = perfectly balanced, grows with skew; the EPLB / DeepSeek-V3 view);
  - `*_balancedness` = mean / max load in (0, 1] (1.0 = perfectly balanced; the fraction of the busiest
    expert's or rank's work the average one does, i.e. the utilisation a lockstep step can reach).
Both are given across the experts of a layer (`expert_`) and across the ranks that hold them (`rank_`).
"""
from __future__ import annotations

import math

from actors.moe.placement import ExpertPlacement


def max_over_mean(xs: list[float]) -> float:
    """max/mean of non-negative loads (1.0 = perfectly balanced; 0 loads give 1.0)."""
    m = sum(xs) / len(xs) if xs else 0.0
    return max(xs) / m if m > 0 else 1.0


def balancedness(xs: list[float]) -> float:
    """mean/max of non-negative loads, in (0, 1] (1.0 = perfectly balanced; 0 loads give 1.0)."""
    mx = max(xs) if xs else 0.0
    return (sum(xs) / len(xs)) / mx if mx > 0 else 1.0


def _per_layer(v, L: int) -> list[float]:
    """A rank's routing metric as a per-layer list of floats (a scalar applies to every layer; None -> nan)."""
    if v is None:
        return [math.nan] * L
    if isinstance(v, dict):  # {layer: value}, keys may arrive as str after msgpack / json
        return [float(v.get(l, v.get(str(l), math.nan))) for l in range(L)]
    if isinstance(v, (list, tuple)):
        out = [math.nan if x is None else float(x) for x in v[:L]]
        return out + [math.nan] * (L - len(out))
    return [float(v)] * L


def _nanmean(xs: list[float]) -> float:
    ok = [x for x in xs if not math.isnan(x)]
    return sum(ok) / len(ok) if ok else math.nan


ROUTING_KEYS = ("thrash", "hit_rate", "recall")


def _rank_routing(r: dict, L: int) -> dict[str, list[float]]:
    """One rank's routing metrics as per-layer lists: `stats()["routing"]` keys first, then hit_rate / recall
    from `stats()["expert_cache"]` (`actors.experts.runtime.ExpertRuntime.summary()`: {"layers": {l: {...}}})
    where `routing` does not carry them."""
    out = {}
    routing = r.get("routing") or {}
    for k in ROUTING_KEYS:
        if k in routing:
            out[k] = _per_layer(routing[k], L)
    per_layer = (r.get("expert_cache") or {}).get("layers") or {}
    for k in ("hit_rate", "recall"):
        if k not in out and per_layer:
            out[k] = _per_layer({l: v.get(k, math.nan) for l, v in per_layer.items()}, L)
    return out


def aggregate_routing(per_rank: list[dict], L: int) -> dict[str, list[float]]:
    """Per-layer routing metrics from the ranks' optional stats, averaged over the ranks that report a value
    (nan where none does).

    Read from `stats()["routing"]` (each a per-layer list, a {layer: value} dict or a scalar; absent keys are
    skipped), hit_rate / recall also from `stats()["expert_cache"]["layers"]` (packed experts):
      thrash: mean Jaccard distance between consecutive tokens' expert sets (actors.moe.stats);
      hit_rate: expert-cache hits / lookups; recall: prefetch prediction recall.
    Returns {key: [L] floats} for the keys at least one rank reports.
    """
    ranks = [_rank_routing(r, L) for r in per_rank]
    out = {}
    for k in ROUTING_KEYS:
        vals = [x[k] for x in ranks if k in x]
        if vals:
            out[k] = [_nanmean([v[l] for v in vals]) for l in range(L)]
    return out


def aggregate_stats(per_rank: list[dict], placement: ExpertPlacement) -> dict:
    """Sum expert token counts over ranks; report per-layer expert and rank balance and routing metrics.

    `expert_load[l][e]` counts (token, expert) assignments made by the router on every rank.
    Rank load of layer l = sum of the loads of the experts that rank holds (a replicated expert's load split
    evenly over its replicas). `dispatch_rank_rows` [L][W]: rows each rank's experts actually received
    (measured by the dispatchers; [] if ranks do not report it), `dispatch_rank_balancedness`: its mean/max per
    busy layer; `redundant_experts` [L]: replicas beyond one per expert.
    Per layer with tokens: `layers` rows {layer, tokens, expert_max_mean, rank_max_mean} (the gRPC
    `LayerLoad` message, so its keys stay fixed) and `balance` rows {layer, expert_balancedness,
    rank_balancedness} (see the module docstring). `routing`: see `aggregate_routing`.
    """
    L = len(per_rank[0]["expert_load"]) if per_rank else 0
    E = placement.num_experts
    load = [[sum(r["expert_load"][l][e] for r in per_rank) for e in range(E)] for l in range(L)]
    rank_load = [[0] * placement.world_size for _ in range(L)]
    for l in range(L):
        for e in range(E):
            reps = placement.replicas[l][e]
            for r, _ in reps:  # a replicated expert's load splits evenly over its replicas (water-filled rows)
                rank_load[l][r] += load[l][e] if len(reps) == 1 else load[l][e] / len(reps)
    # measured rank load: rows each rank's experts received, per layer (ranks report rows sent per destination)
    W = placement.world_size
    rows = [r["dispatch_rows"] for r in per_rank if r.get("dispatch_rows")]
    dispatch_rows = [[sum(x[l][d] for x in rows) for d in range(W)] for l in range(L)] if rows else []
    busy = [l for l in range(L) if sum(load[l])]  # dense layers route nothing
    layers = [{"layer": l, "tokens": sum(load[l]), "expert_max_mean": max_over_mean(load[l]),
               "rank_max_mean": max_over_mean(rank_load[l])} for l in busy]
    balance = [{"layer": l, "expert_balancedness": balancedness(load[l]),
                "rank_balancedness": balancedness(rank_load[l])} for l in busy]
    kv_total = sum(r["kv_blocks_total"] for r in per_rank)
    kv_free = sum(r["kv_blocks_free"] for r in per_rank)
    return {
        "expert_load": load,
        "rank_load": rank_load,
        "layers": layers,
        "balance": balance,
        "kv_blocks_total": kv_total,
        "kv_blocks_free": kv_free,
        "kv_blocks_used": kv_total - kv_free,
        # automatic prefix caching (tokens, as vLLM): prompt tokens looked up at admission, of those found cached
        "prefix_cache_queries": sum(r.get("prefix_cache_queries", 0) for r in per_rank),
        "prefix_cache_hits": sum(r.get("prefix_cache_hits", 0) for r in per_rank),
        "running": sum(r["running"] for r in per_rank),
        "waiting": sum(r["waiting"] for r in per_rank),
        "routing": aggregate_routing(per_rank, L),
        "dispatch_rank_rows": dispatch_rows,
        "dispatch_rank_balancedness": [balancedness(dispatch_rows[l]) for l in busy] if dispatch_rows else [],
        "redundant_experts": [placement.num_redundant(l) for l in range(placement.num_layers)],
        "ranks": per_rank,
    }
