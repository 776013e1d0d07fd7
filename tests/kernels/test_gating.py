"""Router edge cases: non-finite logits, one dominant expert, zero tokens."""
from __future__ import annotations

import pytest
import torch

from actors.moe.dispatch import AllToAllDispatcher
from actors.moe.placement import ExpertPlacement
from actors.moe.experts import LocalExperts
from kernels.cpu import cpu_kernels_available
from kernels.gating import select_experts_ref, topk_softmax_ref


def _check(w, ids, k, E):
    assert ids.shape[1] == k and w.shape == ids.shape
    assert bool(((ids >= 0) & (ids < E)).all())
    for row in ids.tolist():
        assert len(set(row)) == k
    assert bool(torch.isfinite(w).all())


def non_finite_logits(seed: int, E: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [6, E] with rows 1-5 non-finite in different ways, the clean original). Row 0 stays finite."""
    torch.manual_seed(seed)
    logits = torch.randn(6, E)
    clean = logits.clone()
    logits[1] = float("nan")
    logits[2, 3] = float("inf")
    logits[3] = float("-inf")
    logits[4, :4] = float("nan")
    logits[5, 0] = float("inf")
    logits[5, 1] = float("inf")
    return logits, clean


def test_nan_inf_rows_do_not_corrupt_others():
    E, k = 8, 2
    logits, clean = non_finite_logits(0, E)
    for renorm in (False, True):
        w, ids = topk_softmax_ref(logits, k, renorm)
        _check(w, ids, k, E)
        w0, ids0 = topk_softmax_ref(clean[[0]], k, renorm)
        assert torch.equal(ids[0], ids0[0]) and torch.allclose(w[0], w0[0])
        assert 3 in ids[2].tolist()  # +inf wins
        assert set(ids[5].tolist()) == {0, 1}
        assert set(ids[4].tolist()) <= set(range(4, 8))  # NaN entries never beat finite ones


def test_every_token_prefers_one_expert_and_zero_tokens():
    E, k, D = 8, 2, 16
    logits = torch.full((32, E), -5.0)
    logits[:, 6] = 10.0
    w, ids = topk_softmax_ref(logits, k, renormalize=True)
    _check(w, ids, k, E)
    assert bool((ids[:, 0] == 6).all())
    # all rows land on one expert through the dispatcher; and a [0, D] step works
    torch.manual_seed(0)
    experts = LocalExperts(torch.randn(E, 2 * 8, D), torch.randn(E, D, 8))
    disp = AllToAllDispatcher(ExpertPlacement.contiguous(1, E, 1), rank=0)
    x = torch.randn(32, D)
    out = disp.run(0, x, ids, w, experts)
    ref = sum(w[:, j : j + 1] * torch.stack([experts._ffn(x[t : t + 1], int(ids[t, j]))[0] for t in range(32)]) for j in range(k))
    assert torch.allclose(out, ref, atol=1e-5)
    w0, ids0 = topk_softmax_ref(torch.empty(0, E), k, renormalize=False)
    assert w0.shape == (0, k)
    assert disp.run(0, torch.empty(0, D), ids0, w0, experts).shape == (0, D)


def test_topk_out_of_range_raises():
    import pytest

    with pytest.raises(ValueError, match="top_k=9"):
        topk_softmax_ref(torch.zeros(1, 8), 9, False)


@pytest.mark.skipif(not cpu_kernels_available(), reason="the compiled CPU kernels are not built")
@pytest.mark.parametrize("renorm", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_compiled_selection_equals_the_reference(renorm, with_bias):
    """`kernels.cpu.routing.select_experts` (one compiled call) picks the reference's ids, ties to the lowest id,
    and its weights within fp32 rounding, on strided logits, non-finite rows, exact ties and many experts."""
    from kernels.cpu.routing import select_experts

    g = torch.Generator().manual_seed(7)
    for T, E, K in [(1, 8, 2), (64, 8, 2), (500, 8, 2), (9, 60, 4), (3, 128, 8)]:
        bias = torch.randn(E, generator=g) * 0.01 if with_bias else None
        x = (torch.randn(T, E + 5, generator=g) * 3)[:, 2:E + 2]  # a column slice: row stride E + 5
        w, ids = select_experts(x, K, renorm, bias)
        w_ref, ids_ref = select_experts_ref(x, K, renorm, bias)
        assert torch.equal(ids, ids_ref), (T, E, K)
        torch.testing.assert_close(w, w_ref, atol=1e-6, rtol=1e-6)
    inf, nan = float("inf"), float("nan")
    x = torch.tensor([[nan, inf, 1.0, inf], [nan] * 4, [-inf] * 4, [0.0] * 4, [2.0, 5.0, 5.0, 5.0]])
    w, ids = select_experts(x, 2, renorm)
    assert ids.tolist() == [[1, 3], [0, 1], [0, 1], [0, 1], [1, 2]]
    torch.testing.assert_close(w, select_experts_ref(x, 2, renorm)[0])
    with pytest.raises(ValueError, match="top_k"):
        select_experts(torch.zeros(2, 4), 5, False)
