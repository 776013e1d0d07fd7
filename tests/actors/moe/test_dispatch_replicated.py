"""A fully replicated layer (every expert on every rank: `--redundant-experts` on 2 ranks) keeps each rank's pairs
on its own replicas and makes no collective: no process group exists here, so any collective would raise. Results
equal the one-rank run, with local rows in any order, padding ids, zero tokens and one token."""
from __future__ import annotations

import pytest
import torch

from actors.moe.dispatch import AllToAllDispatcher
from actors.moe.experts import LocalExperts
from actors.moe.placement import ExpertPlacement
from cluster.placement import redundant_placement
from kernels.gating import topk_softmax_ref

E, D, I, K = 6, 12, 10, 2


def _weights():
    g = torch.Generator().manual_seed(0)
    return torch.randn(E, 2 * I, D, generator=g), torch.randn(E, D, I, generator=g), torch.randn(E, D, generator=g)


def _permuted_full_replicas(world: int) -> ExpertPlacement:
    """Layer 0: every expert on every rank, rank r's local rows a rotation of the expert ids by r."""
    return ExpertPlacement(num_experts=E, world_size=world,
                           replicas=[[[(r, (e + r) % E) for r in range(world)] for e in range(E)]])


def _rank_experts(pl: ExpertPlacement, rank: int, wgu, wd, dtype) -> LocalExperts:
    loc = pl.local_experts(0, rank)  # global expert of each local row
    return LocalExperts(wgu[loc].to(dtype), wd[loc].to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [0, 1, 5])
def test_replicated_layer_equals_one_rank_without_collectives(dtype, T):
    wgu, wd, gate = _weights()
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(T))
    w, ids = topk_softmax_ref(x @ gate.T, K, False)
    ref = AllToAllDispatcher(ExpertPlacement.contiguous(1, E, 1), 0).run(
        0, x, ids, w, _rank_experts(ExpertPlacement.contiguous(1, E, 1), 0, wgu, wd, dtype), may_pad=False)
    for pl in (_permuted_full_replicas(2), redundant_placement(1, E, 2)):
        for rank in range(2):
            disp = AllToAllDispatcher(pl, rank, max_experts_per_token=K)  # group None: no process group exists
            assert disp.replicated == [True]
            out = disp.run(0, x, ids, w, _rank_experts(pl, rank, wgu, wd, dtype), may_pad=False, step_max_tokens=8)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
            assert disp.sent_rows.tolist() == [[T * K if r == rank else 0 for r in range(2)]]


def test_replicated_layer_with_padding_ids():
    """Ids of -1 (weight 0) are never run and contribute zero; the valid pairs count as rows kept on this rank."""
    wgu, wd, gate = _weights()
    x = torch.randn(4, D, generator=torch.Generator().manual_seed(1))
    w, ids = topk_softmax_ref(x @ gate.T, K, False)
    ids[1, 1], ids[3, 0] = -1, -1
    w[1, 1], w[3, 0] = 0.0, 0.0
    pl1 = ExpertPlacement.contiguous(1, E, 1)
    ref = AllToAllDispatcher(pl1, 0).run(0, x, ids, w, _rank_experts(pl1, 0, wgu, wd, torch.float32))
    pl = _permuted_full_replicas(2)
    for rank in range(2):
        disp = AllToAllDispatcher(pl, rank, max_experts_per_token=K)
        out = disp.run(0, x, ids, w, _rank_experts(pl, rank, wgu, wd, torch.float32), may_pad=True)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        assert disp.sent_rows[0, rank].item() == 6


def test_partly_replicated_layers_keep_the_exchange():
    """Only layers whose every expert lives on every rank skip the exchange; 3 ranks with two replicas per expert
    (`redundant_placement`) and a layer of single replicas keep it."""
    assert AllToAllDispatcher(redundant_placement(2, E, 3), 0).replicated == [False, False]
    mixed = ExpertPlacement(num_experts=E, world_size=2, replicas=[[[(0, e), (1, e)] for e in range(E)],
                                      [[(e % 2, e // 2)] for e in range(E)]])
    assert AllToAllDispatcher(mixed, 1).replicated == [True, False]
