"""`--redundant-experts`: every routed expert on two ranks, the memory cost reported, the same greedy tokens."""
from __future__ import annotations

import pytest

from cluster.placement import redundant_placement, shrink_placement


def test_redundant_placement_every_expert_twice_and_shrinks():
    p = redundant_placement(3, 8, 4, dense_layers=[0])
    for l in (1, 2):
        assert all(len({r for r, _ in reps}) == 2 for reps in p.replicas[l])
        assert all(len(p.local_experts(l, r)) == 4 for r in range(4))  # ceil(2E / W) each
    assert all(len(reps) == 1 for reps in p.replicas[0])  # a dense layer stays contiguous
    for dead in range(4):
        s = shrink_placement(p, dead, dense_layers=[0])
        assert s.world_size == 3
        for r_old in range(4):  # survivors keep their local rows (no weight moves)
            if r_old != dead:
                assert s.local_experts(1, r_old - (r_old > dead)) == p.local_experts(1, r_old)


def test_redundant_needs_two_ranks():
    with pytest.raises(ValueError, match="world_size >= 2"):
        redundant_placement(2, 8, 1)
    p = redundant_placement(2, 8, 2)
    one = shrink_placement(p, 1)
    with pytest.raises(ValueError, match="no replica survives"):
        shrink_placement(shrink_placement(redundant_placement(2, 8, 3), 0), 0)
    assert one.world_size == 1 and one.local_experts(0, 0) == list(range(8))


def test_config_refuses_one_rank(tiny_model_dir):
    from cluster.config import ClusterConfig

    with pytest.raises(ValueError, match="redundant_experts needs ranks >= 2"):
        ClusterConfig(model=tiny_model_dir("qwen2_moe"), ranks=1, redundant_experts=True)
