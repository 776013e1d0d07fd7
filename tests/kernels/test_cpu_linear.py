"""The bf16-weight CPU linear (`kernels.cpu_linear.linear`) against a float64 reference over the same
(exactly widened) weights, on shapes that are not multiples of the kernel's blocks."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_linear
from kernels.cpu_linear import MAX_KERNEL_ROWS, bf16_linear_available, linear


def _ref(x, w, b):
    return F.linear(x.double(), w.double(), None if b is None else b.double()).float()


@pytest.mark.skipif(not bf16_linear_available(), reason="no C compiler or no AVX2/FMA: the fallback path runs")
@pytest.mark.parametrize("M", [0, 1, 2, 3, 4, 5, 7, 8, 9, MAX_KERNEL_ROWS])
@pytest.mark.parametrize("N,K", [(1, 1), (3, 7), (5, 8), (9, 15), (4, 16), (6, 17), (513, 256), (31, 255)])
def test_kernel_matches_float64_reference(M, N, K):
    g = torch.Generator().manual_seed(M * 1000 + N * 10 + K)
    x = torch.randn(M, K, generator=g)
    w = torch.randn(N, K, generator=g).bfloat16()
    b = torch.randn(N, generator=g)
    for bias in (None, b):
        got = linear(x, w, bias)
        assert got.shape == (M, N) and got.dtype == torch.float32
        torch.testing.assert_close(got, _ref(x, w, bias), atol=2e-5 * K ** 0.5, rtol=1e-5)


@pytest.mark.skipif(not bf16_linear_available(), reason="no C compiler or no AVX2/FMA: the fallback path runs")
def test_kernel_reads_row_strided_activations_and_weight_views():
    """Rows of x that are a column slice of a wider tensor, and a weight that is a row block of a fused
    matrix (how q/k/v and the per-expert views are stored)."""
    x = torch.randn(3, 300)[:, 10:266]
    fused = torch.randn(96, 256).bfloat16()
    w = fused[32:96]
    torch.testing.assert_close(linear(x, w), _ref(x, w, None), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(linear(x[1], w), _ref(x[1:2], w, None)[0], atol=1e-4, rtol=1e-5)  # 1-D x


def test_fallback_paths_equal_the_widened_f_linear(monkeypatch):
    """Large batches (and machines without the kernel) widen the weight and call F.linear; same-dtype weights
    are plain F.linear."""
    x = torch.randn(MAX_KERNEL_ROWS + 3, 40)
    w = torch.randn(12, 40).bfloat16()
    torch.testing.assert_close(linear(x, w), F.linear(x, w.float()), atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(cpu_linear, "_fn", None)
    monkeypatch.setattr(cpu_linear, "_tried", True)
    torch.testing.assert_close(linear(x[:2], w), F.linear(x[:2], w.float()), atol=1e-5, rtol=1e-5)
    wf = torch.randn(12, 40)
    assert torch.equal(linear(x, wf), F.linear(x, wf))


@pytest.mark.skipif(not bf16_linear_available(), reason="no C compiler or no AVX2/FMA: the fallback path runs")
def test_shape_mismatch_raises():
    with pytest.raises(RuntimeError, match="do not match"):
        linear(torch.randn(2, 8), torch.randn(4, 9).bfloat16())
    with pytest.raises(RuntimeError, match="do not match"):
        linear(torch.randn(2, 8), torch.randn(4, 8).bfloat16(), torch.randn(5))
