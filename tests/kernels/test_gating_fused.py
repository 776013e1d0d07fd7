"""Fused expert selection (scores, bias, top-k, weights): Triton kernel against the PyTorch reference."""
from __future__ import annotations

import pytest
import torch

from kernels.gating import select_experts_ref, topk_softmax_ref
from kernels.gating_triton import select_experts_triton
from tests.kernels.test_gating import non_finite_logits


def _valid(w, ids, k, E):
    assert ids.shape[1] == k and w.shape == ids.shape and ids.dtype == torch.int64
    assert bool(((ids >= 0) & (ids < E)).all())
    assert all(len(set(r)) == k for r in ids.tolist())
    assert bool(torch.isfinite(w).all())


@pytest.mark.parametrize("T,E,k", [(1, 8, 2), (37, 8, 2), (5, 60, 4), (17, 6, 1), (3, 5, 5)])
@pytest.mark.parametrize("renorm", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_triton_matches_reference(T, E, k, renorm, with_bias):
    g = torch.Generator().manual_seed(T * 100 + E + k)
    logits = torch.randn(T, E, generator=g) * 3
    bias = torch.randn(E, generator=g) * 0.05 if with_bias else None
    w_ref, ids_ref = select_experts_ref(logits, k, renorm, bias)
    w, ids = select_experts_triton(logits, k, renorm, bias)
    _valid(w, ids, k, E)
    assert torch.equal(ids, ids_ref)
    assert torch.allclose(w, w_ref, atol=1e-6, rtol=1e-5)


def test_no_bias_is_exact_routing_and_bias_moves_selection_not_weights():
    torch.manual_seed(0)
    logits = torch.randn(64, 8)
    w0, ids0 = topk_softmax_ref(logits, 2, False)
    w1, ids1 = select_experts_ref(logits, 2, False, torch.zeros(8))
    assert torch.equal(ids0, ids1) and torch.allclose(w0, w1)
    bias = torch.zeros(8)
    bias[5] = 10.0  # expert 5 always selected ...
    for fn in (select_experts_ref, select_experts_triton):
        w, ids = fn(logits, 2, False, bias)
        assert bool((ids == 5).any(dim=1).all())
        probs = torch.softmax(logits, -1)
        assert torch.allclose(w, probs.gather(1, ids), atol=1e-6)  # ... with its unbiased weight


def test_non_finite_rows_with_triton():
    E, k = 8, 2
    logits, clean = non_finite_logits(1, E)
    for renorm in (False, True):
        w, ids = select_experts_triton(logits, k, renorm, torch.full((E,), 0.01))
        _valid(w, ids, k, E)
        w0, ids0 = select_experts_ref(clean[[0]], k, renorm, torch.full((E,), 0.01))
        assert torch.equal(ids[0], ids0[0]) and torch.allclose(w[0], w0[0], atol=1e-6)
        assert 3 in ids[2].tolist()
        assert set(ids[4].tolist()) <= set(range(4, 8))
        assert set(ids[5].tolist()) == {0, 1}


def test_zero_tokens_and_bad_args():
    w, ids = select_experts_triton(torch.empty(0, 8), 2, True)
    assert w.shape == (0, 2) and ids.shape == (0, 2)
    with pytest.raises(ValueError, match="top_k=9"):
        select_experts_triton(torch.zeros(1, 8), 9, False)
    with pytest.raises(ValueError, match="bias"):
        select_experts_ref(torch.zeros(1, 8), 2, False, torch.zeros(7))


def test_the_interpreter_runs_the_kernel_on_cpu():
    """CI has no GPU: the kernel tests above run the Triton kernel on CPU tensors through the interpreter
    (tests/conftest.py sets TRITON_INTERPRET=1), never skipped."""
    import os

    assert torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
    w, ids = select_experts_triton(torch.tensor([[0.0, 2.0, 1.0]]), 1, False)
    assert ids.device.type == ("cuda" if torch.cuda.is_available() else "cpu") and ids.tolist() == [[1]]


@pytest.mark.parametrize("fn", [select_experts_ref, select_experts_triton])
def test_exact_ties_go_to_the_lowest_expert_id(fn):
    # uniform rows (all logits equal): the first k experts, in id order
    assert fn(torch.zeros(1, 8), 2, False)[1].tolist() == [[0, 1]]
    assert fn(torch.zeros(3, 8), 4, True)[1].tolist() == [[0, 1, 2, 3]] * 3
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0, 3.0, 0.0],   # a three-way tie for first place: ids 1, 2 chosen
                           [5.0, 2.0, 2.0, 2.0, 0.0, 2.0],   # first place clear, a tie for the second slot
                           [1.0, 1.0, 4.0, 1.0, 1.0, 4.0]])  # tie for first (2, 5): order by id
    assert fn(logits, 2, False)[1].tolist() == [[1, 2], [0, 1], [2, 5]]
    # ties made by the selection bias: scores 1/8 + b with b equal on experts 3 and 6
    bias = torch.tensor([0.0, 0.0, 0.0, 0.01, 0.0, 0.0, 0.01, 0.0])
    w, ids = fn(torch.zeros(2, 8), 3, False, bias)
    assert ids.tolist() == [[3, 6, 0]] * 2 and torch.equal(w, torch.full((2, 3), 0.125))


@pytest.mark.parametrize("fn", [select_experts_ref, select_experts_triton])
def test_near_ties_go_to_the_larger_score_whatever_its_id(fn):
    """One float32 ulp decides: the highest expert id wins when its score is one ulp above the others."""
    ulp = float(torch.nextafter(torch.tensor(0.125), torch.tensor(1.0))) - 0.125  # 2**-26
    bias = torch.zeros(8)
    bias[7] = ulp  # scores 0.125 (exact: softmax of equal logits) + bias
    assert fn(torch.zeros(1, 8), 2, False, bias)[1].tolist() == [[7, 0]]
    bias[4] = ulp
    bias[6] = 2 * ulp
    assert fn(torch.zeros(1, 8), 3, False, bias)[1].tolist() == [[6, 4, 7]]
    logits = torch.tensor([[0.0, 1.0, 1.0 + 1e-6, 1.0 - 1e-6, 0.0]])  # distinct after softmax, by ~8 ulps
    assert fn(logits, 3, False)[1].tolist() == [[2, 1, 3]]
