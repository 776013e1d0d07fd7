"""Expert placement plans: which rank holds which expert of each MoE layer."""
from __future__ import annotations

from actors.dispatch import ExpertPlacement


def contiguous_placement(num_layers: int, num_experts: int, world_size: int) -> ExpertPlacement:
    """Rank r holds experts [r*E//W, (r+1)*E//W) of every layer; E need not divide by W
    (60 experts on 8 ranks: shards of 7 and 8)."""
    return ExpertPlacement.contiguous(num_layers, num_experts, world_size)
