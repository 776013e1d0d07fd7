"""Expert placement plans: which ranks hold which experts of each MoE layer.

`contiguous_placement`: the default partition (E/W experts per rank, no replicas).
`eplb_placement`: load-aware placement with redundant replicas of hot experts, after DeepSeek's
Expert Parallelism Load Balancer (EPLB, github.com/deepseek-ai/EPLB, the "global" policy of the
DeepSeek-V3 report, arXiv:2412.19437 sec. 3.4): (1) give `num_redundant` extra replicas one at a
time to the expert with the largest load per replica; (2) pack the replicas onto ranks, heaviest
first, each to the least-loaded rank that has a free slot and does not hold that expert yet
(slots per rank = ceil((E + R) / W)); then (not in EPLB) a local search moves or swaps replicas
off the busiest rank while that lowers its load. A replicated expert's load is assumed split evenly
over its replicas (the dispatcher water-fills its rows, which makes this hold up to rounding).
"""
from __future__ import annotations

import math
from typing import Sequence

from actors.moe.placement import ExpertPlacement


def contiguous_placement(num_layers: int, num_experts: int, world_size: int) -> ExpertPlacement:
    """Rank r holds experts [r*E//W, (r+1)*E//W) of every layer; E need not divide by W
    (60 experts on 8 ranks: shards of 7 and 8)."""
    return ExpertPlacement.contiguous(num_layers, num_experts, world_size)


def _replicate(load: Sequence[float], num_replicas: int, max_per_expert: int, min_per_expert: int = 1) -> list[int]:
    """Replica count per expert: start at `min_per_expert`, then repeatedly +1 for the expert with the largest
    load / count (ties: lower id) that has fewer than `max_per_expert` replicas."""
    count = [min_per_expert] * len(load)
    for _ in range(num_replicas - min_per_expert * len(load)):
        cand = [e for e in range(len(load)) if count[e] < max_per_expert]
        if not cand:
            break
        e = max(cand, key=lambda e: (load[e] / count[e], -e))
        count[e] += 1
    return count


def _pack(load: Sequence[float], count: list[int], world_size: int, slots: int) -> list[list[int]]:
    """Ranks holding each expert's replicas. Replicas go heaviest first (load / count; ties: lower expert id)
    to the least-loaded rank with a free slot that does not hold the expert (ties: fewer experts, lower rank).
    A replica that fits nowhere is dropped (its expert keeps its other replicas, so every expert keeps >= 1)."""
    items = sorted(((load[e] / count[e], e) for e in range(len(load)) for _ in range(count[e])),
                   key=lambda t: (-t[0], t[1]))
    rank_load = [0.0] * world_size
    held: list[set[int]] = [set() for _ in range(world_size)]
    ranks_of: list[list[int]] = [[] for _ in load]
    for w, e in items:
        free = [r for r in range(world_size) if len(held[r]) < slots and e not in held[r]]
        if not free:
            continue
        r = min(free, key=lambda r: (rank_load[r], len(held[r]), r))
        held[r].add(e)
        ranks_of[e].append(r)
        rank_load[r] += w
    _refine(load, ranks_of, held, rank_load, slots)
    return ranks_of


def _refine(load: Sequence[float], ranks_of: list[list[int]], held: list[set[int]], rank_load: list[float],
            slots: int, max_moves: int = 1000) -> None:
    """Local search after greedy packing (in place): move a replica off the busiest rank, or swap it with a
    lighter replica of another rank, while that lowers the pair's larger load; keeps slots and distinctness."""
    W = len(rank_load)
    share = lambda e: load[e] / len(ranks_of[e])  # noqa: E731
    for _ in range(max_moves):
        b = max(range(W), key=lambda r: (rank_load[r], -r))
        best = None  # (new max of the pair, e on b, rank r, f on r or None)
        for e in held[b]:
            for r in range(W):
                if r == b or e in held[r]:
                    continue
                cands = ([None] if len(held[r]) < slots else []) + [f for f in held[r] if f not in held[b]]
                for f in cands:
                    d = share(e) - (share(f) if f is not None else 0.0)
                    if d <= 0:
                        continue
                    new_max = max(rank_load[b] - d, rank_load[r] + d)
                    if new_max < rank_load[b] - 1e-12 and (best is None or new_max < best[0]):
                        best = (new_max, e, r, f)
        if best is None:
            return
        _, e, r, f = best
        d = share(e) - (share(f) if f is not None else 0.0)
        held[b].remove(e)
        held[r].add(e)
        ranks_of[e][ranks_of[e].index(b)] = r
        if f is not None:
            held[r].remove(f)
            held[b].add(f)
            ranks_of[f][ranks_of[f].index(r)] = b
        rank_load[b] -= d
        rank_load[r] += d


def eplb_placement(load_LE: Sequence[Sequence[float]], world_size: int, num_redundant: int = 0, *,
                   dense_layers: Sequence[int] = (), min_replicas: int = 1) -> ExpertPlacement:
    """Load-balanced placement with `num_redundant` extra replicas per layer (see module docstring).

    Args:
        load_LE: [L][E] observed expert loads (token-expert assignments in a window), any non-negative numbers.
        world_size: W ranks. num_redundant: R extra replicas per layer, 0 <= R <= E * (W - 1).
        dense_layers: layers to leave contiguous (no routed experts). A layer with zero observed load is
            left contiguous too (no evidence; avoids moving weights for nothing), unless min_replicas > 1.
        min_replicas: replicas every expert of a MoE layer gets at least (2: every expert survives the loss of
            one rank, `--redundant-experts`); needs 1 <= min_replicas <= W and R >= E * (min_replicas - 1).
    Returns an `ExpertPlacement` where every expert has 1..W replicas on distinct ranks and every rank holds
    at most ceil((E + R) / W) experts per layer; local rows on a rank are in ascending global id order.
    Raises:
        ValueError: world_size < 1, num_redundant out of range, a negative load, or ragged load_LE.
    """
    L = len(load_LE)
    E = len(load_LE[0]) if L else 0
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    if not 0 <= num_redundant <= E * (world_size - 1):
        raise ValueError(f"num_redundant={num_redundant} must be in [0, E * (W - 1) = {E * (world_size - 1)}]")
    if not 1 <= min_replicas <= world_size:
        raise ValueError(f"min_replicas={min_replicas} must be in [1, world_size={world_size}]")
    if num_redundant < E * (min_replicas - 1):
        raise ValueError(f"num_redundant={num_redundant} must be >= E * (min_replicas - 1) = {E * (min_replicas - 1)} "
                         f"for min_replicas={min_replicas}")
    base = ExpertPlacement.contiguous(L, E, world_size)
    slots = math.ceil((E + num_redundant) / world_size)
    replicas = []
    for l, load in enumerate(load_LE):
        if len(load) != E:
            raise ValueError(f"load_LE layer {l} has {len(load)} experts, layer 0 has {E}")
        if any(x < 0 for x in load):
            raise ValueError(f"load_LE layer {l} has a negative load")
        if min_replicas > 1 and l not in dense_layers and not sum(load):
            load = [1.0] * E  # no evidence: every expert alike, each still on min_replicas ranks
        if l in dense_layers or not sum(load) or world_size == 1:
            replicas.append(base.replicas[l])
            continue
        # all R replicas, as EPLB does: fitting fewer to the window generalises worse on held-out text
        # (bench/placement.py), since the dispatcher water-fills replicas to follow unseen load shifts
        ranks_of = _pack(load, _replicate(load, E + num_redundant, world_size, min_replicas), world_size, slots)
        local: dict[int, int] = {}
        layer = []
        for e in range(E):  # ascending ids: local row = order of arrival on the rank
            reps = []
            for r in sorted(ranks_of[e]):
                reps.append((r, local.get(r, 0)))
                local[r] = local.get(r, 0) + 1
            layer.append(reps)
        replicas.append(layer)
    return ExpertPlacement(num_experts=E, world_size=world_size, replicas=replicas)


def redundant_placement(num_layers: int, num_experts: int, world_size: int, *,
                        dense_layers: Sequence[int] = ()) -> ExpertPlacement:
    """`--redundant-experts`: every routed expert on two ranks (no load observed yet, so all alike), so that the
    group survives the loss of any one rank (`shrink_placement`). Each rank holds ceil(2E / W) experts per MoE
    layer instead of about E / W. Raises ValueError if world_size < 2."""
    if world_size < 2:
        raise ValueError(f"redundant experts need world_size >= 2 (every expert on two ranks), got {world_size}")
    zeros = [[0.0] * num_experts for _ in range(num_layers)]
    return eplb_placement(zeros, world_size, num_experts, dense_layers=dense_layers, min_replicas=2)


def shrink_placement(placement: ExpertPlacement, dead: int, *, dense_layers: Sequence[int] = ()) -> ExpertPlacement:
    """The placement after rank `dead` is lost: its replicas dropped, ranks above it renumbered down by one, every
    survivor's local rows unchanged (no weight moves); `dense_layers` (no routed experts) become contiguous over
    the survivors. Raises ValueError if some expert of a MoE layer lived only on `dead`."""
    W = placement.world_size
    if not 0 <= dead < W or W < 2:
        raise ValueError(f"dead={dead} must be a rank of a group of >= 2 (world_size={W})")
    base = ExpertPlacement.contiguous(placement.num_layers, placement.num_experts, W - 1)
    replicas = []
    for l, layer in enumerate(placement.replicas):
        if l in dense_layers:
            replicas.append(base.replicas[l])
            continue
        row = []
        for e, reps in enumerate(layer):
            keep = [(r - (r > dead), i) for r, i in reps if r != dead]
            if not keep:
                raise ValueError(f"layer {l} expert {e} lived only on rank {dead}: no replica survives")
            row.append(keep)
        replicas.append(row)
    return ExpertPlacement(num_experts=placement.num_experts, world_size=W - 1, replicas=replicas)


def expected_rank_load(placement: ExpertPlacement, load_LE: Sequence[Sequence[float]]) -> list[list[float]]:
    """[L][W] rank loads if each expert's load splits evenly over its replicas (what water-filling aims at)."""
    out = []
    for l, load in enumerate(load_LE):
        row = [0.0] * placement.world_size
        for e, x in enumerate(load):
            reps = placement.replicas[l][e]
            for r, _ in reps:
                row[r] += x / len(reps)
        out.append(row)
    return out
