"""world_size == 1 dispatch without padding ids: the step's tokens go to the experts' `combine_tokens` (one
compiled call for bf16 weights on CPU) and equal the general path (gather, `__call__`, weighted sum), for fp32
and bf16 experts and for the protocol's reference body."""
from __future__ import annotations

import pytest
import torch

from actors.moe.dispatch import AllToAllDispatcher
from actors.moe.experts import Experts, LocalExperts
from actors.moe.placement import ExpertPlacement
from kernels.gating import topk_softmax_ref

E, D, I, K = 6, 40, 24, 2


class _Reference(Experts):
    """Only `__call__` of its own: every other entry is the protocol's reference body."""

    def __init__(self, inner: LocalExperts):
        self.inner = inner

    def __call__(self, x_RD, local_ids_R):
        return self.inner(x_RD, local_ids_R)


@pytest.mark.parametrize("T", [1, 5, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tokens_path_equals_general_path(T, dtype):
    g = torch.Generator().manual_seed(T)
    experts = LocalExperts((torch.randn(E, 2 * I, D, generator=g) * 0.3).to(dtype),
                           (torch.randn(E, D, I, generator=g) * 0.3).to(dtype))
    x = torch.randn(T, D, generator=g)
    w, ids = topk_softmax_ref(x @ torch.randn(E, D, generator=g).T, K, False)
    disp = AllToAllDispatcher(ExpertPlacement.contiguous(1, E, 1), 0)
    general = disp.run(0, x, ids, w, experts, may_pad=True)  # the gather / __call__ / weighted-sum path
    rows, _ = disp.dispatch(0, x, ids, may_pad=False)
    assert rows.kind == ("token" if T == 1 else "tokens")
    for exp in (experts, _Reference(experts)):
        for _ in range(2):  # bf16: row-major weights, then their packed panel copies
            got = disp.run(0, x, ids, w, exp, may_pad=False)
            torch.testing.assert_close(got, general, atol=2e-5, rtol=1e-5)
    assert disp.sent_rows.tolist() == [[(2 + 2 * 2) * T * K]]  # every dispatch counts its T * K rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tokens_path_of_an_empty_step(dtype):
    """A step with no tokens (a rank joining the others' step, or everything aborted) gives [0, D], not a reshape
    error (seen in tests/actors/engine/test_scheduler.py's random workload)."""
    experts = LocalExperts(torch.zeros(E, 2 * I, D).to(dtype), torch.zeros(E, D, I).to(dtype))
    for exp in (experts, _Reference(experts)):
        y = exp.combine_tokens(torch.zeros(0, D), torch.zeros(0, K, dtype=torch.int64), torch.zeros(0, K))
        assert y.shape == (0, D)
