"""Which ranks hold which routed experts (expert placement, EPLB-style replicas), apart from the transport.

An `ExpertPlacement` maps each (MoE layer, expert) to one or more replicas `(rank, local row)`; the primary
replica comes first. A rank's local rows of a layer are always 0..n-1 (validated), so a rank's expert shard is
a dense stack in local row order (`local_experts`). `water_fill` is the even split of rows over bins that the
dispatcher uses to spread a replicated expert's rows over its replicas (`actors.moe.dispatch`), and the
placement planner reasons with (`cluster.placement`).
"""
from __future__ import annotations

from dataclasses import dataclass

Replica = tuple[int, int]  # (rank, local row on that rank)


@dataclass(kw_only=True, slots=True)
class ExpertPlacement:
    """Which ranks hold which expert, per MoE layer (possibly several replicas of one expert).

    Give either `replicas` or `rank_of` + `local_index` (one replica per expert):
      replicas[l][e]: list of (rank, local_index) replicas of expert e of layer l, primary first;
      rank_of[l][e], local_index[l][e]: the primary replica (always filled in after construction).
    local_experts(l, rank): global ids held by `rank`, in local row order.

    Raises:
        ValueError: a layer without num_experts entries, an expert with no replica, a rank out of
            [0, world_size), two replicas of one expert on one rank, or a rank's local rows not 0..n-1.
    """

    num_experts: int
    world_size: int
    rank_of: list[list[int]] | None = None
    local_index: list[list[int]] | None = None
    replicas: list[list[list[Replica]]] | None = None

    def __post_init__(self) -> None:
        E, W = self.num_experts, self.world_size
        if self.replicas is None:
            if self.rank_of is None or self.local_index is None:
                raise ValueError("placement needs `replicas` or both `rank_of` and `local_index`")
            if len(self.rank_of) != len(self.local_index):
                raise ValueError(f"placement: rank_of has {len(self.rank_of)} layers, "
                                 f"local_index {len(self.local_index)}")
            for l, (ranks, loc) in enumerate(zip(self.rank_of, self.local_index)):
                if len(ranks) != E or len(loc) != E:
                    raise ValueError(f"placement layer {l}: {len(ranks)} entries, expected num_experts={E}")
            self.replicas = [[[(int(r), int(i))] for r, i in zip(ranks, loc)]
                             for ranks, loc in zip(self.rank_of, self.local_index)]
        else:
            self.replicas = [[[(int(r), int(i)) for r, i in reps] for reps in layer] for layer in self.replicas]
        for l, layer in enumerate(self.replicas):
            if len(layer) != E:
                raise ValueError(f"placement layer {l}: {len(layer)} entries, expected num_experts={E}")
            rows: dict[int, list[int]] = {}
            for e, reps in enumerate(layer):
                if not reps:
                    raise ValueError(f"placement layer {l} expert {e}: no replica")
                if len({r for r, _ in reps}) != len(reps):
                    raise ValueError(f"placement layer {l} expert {e}: two replicas on one rank {reps}")
                for r, i in reps:
                    if not 0 <= r < W:
                        raise ValueError(f"placement layer {l}: rank {r} out of range [0, {W})")
                    rows.setdefault(r, []).append(i)
            for r, idx in rows.items():
                if sorted(idx) != list(range(len(idx))):
                    raise ValueError(f"placement layer {l} rank {r}: local rows {sorted(idx)} "
                                     f"are not 0..{len(idx) - 1}")
        self.rank_of = [[reps[0][0] for reps in layer] for layer in self.replicas]
        self.local_index = [[reps[0][1] for reps in layer] for layer in self.replicas]

    @classmethod
    def contiguous(cls, num_layers: int, num_experts: int, world_size: int) -> "ExpertPlacement":
        """Contiguous shards: rank r holds experts [r*E//W, (r+1)*E//W) (sizes differ by <= 1)."""
        bounds = [r * num_experts // world_size for r in range(world_size + 1)]
        rank_of, local = [], []
        for e in range(num_experts):
            r = next(r for r in range(world_size) if bounds[r] <= e < bounds[r + 1])
            rank_of.append(r)
            local.append(e - bounds[r])
        return cls(num_experts=num_experts, world_size=world_size,
                   rank_of=[list(rank_of) for _ in range(num_layers)], local_index=[list(local) for _ in range(num_layers)])

    @property
    def num_layers(self) -> int:
        return len(self.replicas)

    def local_experts(self, layer: int, rank: int) -> list[int]:
        """Global expert ids held by `rank` in layer `layer`, in local row order."""
        held = [(i, e) for e, reps in enumerate(self.replicas[layer]) for r, i in reps if r == rank]
        return [e for _, e in sorted(held)]

    def num_replicas(self, layer: int, expert: int) -> int:
        return len(self.replicas[layer][expert])

    def num_redundant(self, layer: int) -> int:
        """Replicas beyond one per expert in layer `layer` (0 for a plain partition)."""
        return sum(len(reps) for reps in self.replicas[layer]) - self.num_experts

    def to_dict(self) -> dict:
        """Plain lists (msgpack / JSON / Ray friendly); `from_dict` reads it back."""
        return {"num_experts": self.num_experts, "world_size": self.world_size,
                "rank_of": self.rank_of, "local_index": self.local_index,
                "replicas": [[[list(rep) for rep in reps] for reps in layer] for layer in self.replicas]}

    @classmethod
    def from_dict(cls, d: dict) -> "ExpertPlacement":
        """Inverse of `to_dict`; a dict without `replicas` (one replica per expert) is accepted too."""
        if d.get("replicas") is not None:
            return cls(num_experts=d["num_experts"], world_size=d["world_size"], replicas=d["replicas"])
        return cls(num_experts=d["num_experts"], world_size=d["world_size"], rank_of=d["rank_of"],
                   local_index=d["local_index"])


def water_fill(loads: list[int], n: int, prefer: list[int]) -> list[int]:
    """Split `n` rows over bins with current `loads` as evenly as possible: the result equals giving
    each row, one at a time, to the least-loaded bin (ties: the bin with the smallest `prefer`).

    Returns the rows given to each bin (sums to n). O(m log m) for m bins, independent of n.
    """
    m = len(loads)
    order = sorted(range(m), key=lambda j: (loads[j], prefer[j]))
    k, level, left = 1, loads[order[0]], n
    while k < m and (loads[order[k]] - level) * k <= left:  # lift the k lowest bins to the next level
        left -= (loads[order[k]] - level) * k
        level = loads[order[k]]
        k += 1
    q, rest = divmod(left, k)
    alloc = [0] * m
    low = sorted(order[:k], key=lambda j: prefer[j])
    for t, j in enumerate(low):
        alloc[j] = level + q + (1 if t < rest else 0) - loads[j]
    return alloc



