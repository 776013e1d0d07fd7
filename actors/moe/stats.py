"""Routing statistics: prediction recall / precision, cache hit rate, wasted prefetches, router thrashing.

Shape legend: T = tokens, K = experts per token (top-k), B = predicted experts per token (budget),
E = routed experts. Expert-id tensors are int64; an id of -1 means "no expert" (padding) and is ignored.

Definitions (per layer):
- recall: mean over tokens of |predicted ∩ used| / |used|; precision: mean of |predicted ∩ used| / |predicted|.
- hit rate: expert uses served from the dequantized expert cache / all expert uses (a use = one expert
  needed by one layer call, however many rows it gets).
- wasted prefetch: an expert made ready by the prefetcher that the layer's next call did not use.
- thrashing: mean Jaccard distance 1 - |A ∩ B| / |A ∪ B| between the expert sets of consecutive tokens of
  a sequence (0: the same experts every token; 1: disjoint sets every token). Source: the "routing
  consistency" measures of MoE-Infinity (arXiv 2401.14361) and the Mixtral report's expert-switch counts.
"""
from __future__ import annotations

from collections import defaultdict

import torch


def multi_hot(ids_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """`[T, K]` int expert ids (-1 = none) -> `[T, E]` bool membership."""
    out = torch.zeros(ids_TK.shape[0], num_experts + 1, dtype=torch.bool, device=ids_TK.device)
    # -1 lands in the spare column E (Python-style remainder), which is dropped: 3 small ops on the hot path.
    out.scatter_(1, ids_TK.to(torch.int64).remainder(num_experts + 1), True)
    return out[:, :num_experts]


def overlap_counts(pred_TB: torch.Tensor, true_TK: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, ...]:
    """Per token: (|pred ∩ true|, |pred|, |true|), three `[T]` int64 tensors."""
    p, t = multi_hot(pred_TB, num_experts), multi_hot(true_TK, num_experts)
    return (p & t).sum(1), p.sum(1), t.sum(1)


def set_recall(pred_TB: torch.Tensor, true_TK: torch.Tensor, num_experts: int) -> float:
    """Mean over tokens (with >= 1 used expert) of |pred ∩ true| / |true|; nan when T == 0."""
    inter, _, n_true = overlap_counts(pred_TB, true_TK, num_experts)
    ok = n_true > 0
    return float((inter[ok] / n_true[ok]).mean()) if bool(ok.any()) else float("nan")


def set_precision(pred_TB: torch.Tensor, true_TK: torch.Tensor, num_experts: int) -> float:
    """Mean over tokens (with >= 1 predicted expert) of |pred ∩ true| / |pred|; nan when none predicted."""
    inter, n_pred, _ = overlap_counts(pred_TB, true_TK, num_experts)
    ok = n_pred > 0
    return float((inter[ok] / n_pred[ok]).mean()) if bool(ok.any()) else float("nan")


def jaccard_distance(a_TK: torch.Tensor, b_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Row-wise Jaccard distance `[T]` float32 between two expert-set tensors (1 where both are empty: 0)."""
    a, b = multi_hot(a_TK, num_experts), multi_hot(b_TK, num_experts)
    union = (a | b).sum(1)
    inter = (a & b).sum(1)
    return torch.where(union > 0, 1 - inter / union.clamp(min=1), torch.zeros_like(union, dtype=torch.float32))


def thrashing(ids_TK: torch.Tensor, num_experts: int) -> float:
    """Mean Jaccard distance between consecutive rows of one sequence's `[T, K]` ids; nan when T < 2."""
    if ids_TK.shape[0] < 2:
        return float("nan")
    return float(jaccard_distance(ids_TK[1:], ids_TK[:-1], num_experts).mean())


def hit_rate(hits: int, lookups: int) -> float:
    """hits / lookups; nan when there were no lookups."""
    return hits / lookups if lookups else float("nan")


def wasted_prefetches(prefetched: set[int] | list[int], used: set[int] | list[int]) -> int:
    """Experts made ready by a prefetch that the next call of that layer did not use."""
    return len(set(prefetched) - set(used))


class RoutingStats:
    """Per-layer accumulator of the metrics above (plain counters, cheap to update every step).

    `summary()` returns `{layer: {recall, precision, hit_rate, wasted_prefetch_frac, thrashing, ...}}`
    with nan where a metric had no events.
    """

    _KEYS = ("pred_inter", "pred_n", "true_n", "pred_tokens", "hits", "lookups", "prefetched", "wasted",
             "thrash_sum", "thrash_n", "fills")

    def __init__(self) -> None:
        self.c: dict[int, dict[str, float]] = defaultdict(lambda: dict.fromkeys(self._KEYS, 0.0))

    def add_prediction(self, layer: int, pred_TB: torch.Tensor, true_TK: torch.Tensor, num_experts: int) -> None:
        inter, n_pred, n_true = overlap_counts(pred_TB, true_TK, num_experts)
        c = self.c[layer]
        c["pred_inter"] += float(inter.sum())
        c["pred_n"] += float(n_pred.sum())
        c["true_n"] += float(n_true.sum())
        c["pred_tokens"] += pred_TB.shape[0]

    def add_lookups(self, layer: int, hits: int, lookups: int) -> None:
        self.c[layer]["hits"] += hits
        self.c[layer]["lookups"] += lookups

    def add_prefetch(self, layer: int, prefetched: int, wasted: int) -> None:
        self.c[layer]["prefetched"] += prefetched
        self.c[layer]["wasted"] += wasted

    def add_fills(self, layer: int, n: int) -> None:
        self.c[layer]["fills"] += n

    def add_thrashing(self, layer: int, dist_T: torch.Tensor) -> None:
        self.c[layer]["thrash_sum"] += float(dist_T.sum())
        self.c[layer]["thrash_n"] += dist_T.numel()

    def summary(self) -> dict[int, dict[str, float]]:
        nan = float("nan")
        out = {}
        for l, c in sorted(self.c.items()):
            out[l] = {
                "recall": c["pred_inter"] / c["true_n"] if c["true_n"] else nan,
                "precision": c["pred_inter"] / c["pred_n"] if c["pred_n"] else nan,
                "hit_rate": hit_rate(int(c["hits"]), int(c["lookups"])),
                "lookups": c["lookups"],
                "prefetched": c["prefetched"],
                "wasted_prefetches": c["wasted"],
                "wasted_prefetch_frac": c["wasted"] / c["prefetched"] if c["prefetched"] else nan,
                "cache_fills": c["fills"],
                "thrashing": c["thrash_sum"] / c["thrash_n"] if c["thrash_n"] else nan,
            }
        return out
