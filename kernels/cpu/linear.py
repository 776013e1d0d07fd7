"""bf16-weight linear and (residual add +) RMSNorm for fp32 decode rows (kernels/csrc/linear.c, rms_norm.c).

Shape legend: M = rows (tokens), K = input features, N = output features, D = hidden.

Both always return a result: the compiled call where it can run, else the PyTorch ops (same contract).
`linear` reads bf16 weights, widens them to fp32 exactly (a bf16 is the top half of an fp32) and accumulates in
fp32 with FMA, so it equals fp32 math over the widened weights up to summation order (~1e-6 relative), at half
the bytes of an fp32 copy: torch has no CPU op that multiplies fp32 activations by bf16 weights without first
materialising an fp32 copy of the weight (what the fallback does, every call). A weight seen twice gets a packed
copy in the panel layout (`kernels.cpu.packing`: same bytes, bounded budget) and runs the outer-product panel
GEMM (kernels/csrc/gemm_panel.c), ~1.5x MKL's fp32 GEMM on one thread at 1 to 64 rows (BENCHMARKS.md). Without
a packed copy: one row runs dot products straight from the bf16 stream, more rows the blocked row-major GEMM
(kernels/csrc/gemm.c), which widens each block of 4 weight rows once into L1 for all rows. Both have AVX-512
and AVX2 loops, chosen at load (`kernels.cpu._build`). `rms_norm` fuses the residual add and the norm
into one call instead of ~7 ops (as vLLM's fused_add_rms_norm).
"""
from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from kernels import tuning
from kernels.cpu import _build
from kernels.cpu._abi import LinearArgs, RmsNormArgs, f32_cpu
from kernels.cpu.packing import panels
from kernels.cpu.parallel import TASK_LINEAR, TASK_RMS_NORM, row_ranges, run_kernel


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` that also takes a bf16 weight with fp32 activations.

    Args:
        x: [M, K] (or [K], or any [..., K]) activations. w: [N, K] weight, x's dtype or bf16.
        b: optional [N] bias in x's dtype.
    Returns:
        [..., N] in x's dtype. With w in x's dtype this is exactly `F.linear`. With a bf16 `w`, fp32 `x` on CPU
        and at most `MAX_GEMM_ROWS` rows, the compiled kernel runs (fp32 accumulation over the exactly
        widened weights); otherwise the weight is widened to x's dtype and `F.linear` runs.
    Raises:
        RuntimeError: as `F.linear` for mismatched shapes (the kernel path checks K and the bias length).
        MemoryError: the kernel's scratch (K > 1024) could not be allocated.
    """
    if w.dtype == x.dtype:
        return F.linear(x, w, b)
    if (w.dtype == torch.bfloat16 and x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2
            and x.shape[0] <= tuning.MAX_GEMM_ROWS and w.is_contiguous() and x.stride(1) == 1):
        lib = _build.lib()
        if lib is not None:
            M, K = x.shape
            N = w.shape[0]
            if w.shape[1] != K or (b is not None and (b.shape != (N,) or b.dtype != x.dtype or not b.is_contiguous())):
                raise RuntimeError(f"linear: x {tuple(x.shape)}, w {tuple(w.shape)}, "
                                   f"b {None if b is None else tuple(b.shape)} do not match")
            y = torch.empty(M, N, dtype=x.dtype)
            if M:
                wp = panels(w)
                bp = b.data_ptr() if b is not None else None
                ranges = row_ranges(M)
                if len(ranges) > 1:  # one share of the rows per compute thread (kernels.cpu.parallel)
                    sx, xp, yp, wpp = x.stride(0), x.data_ptr(), y.data_ptr(), None if wp is None else wp.data_ptr()
                    rc = run_kernel(TASK_LINEAR, [LinearArgs(xp + 4 * lo * sx, sx, w.data_ptr(), wpp, bp,
                                                             yp + 4 * lo * N, N, hi - lo, N, K) for lo, hi in ranges])
                elif wp is not None:
                    rc = lib.moeray_linear_panels(x.data_ptr(), x.stride(0), wp.data_ptr(), bp, y.data_ptr(), N, M, N, K)
                else:
                    rc = lib.moeray_linear_bf16w(x.data_ptr(), x.stride(0), w.data_ptr(), bp, y.data_ptr(), N, M, N, K)
                if rc:
                    raise MemoryError(f"linear: no scratch for K={K}")
            return y
    return F.linear(x, w.to(x.dtype), b)


def _rms_norm_torch(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:  # no casts (each op costs microseconds at decode); sum: mean is slower
        return w * (x * torch.rsqrt((x * x).sum(-1, keepdim=True).div_(x.shape[-1]).add_(eps)))
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """RMSNorm over the last dim (fp32 math, cast back, as transformers does), optionally after a residual add.

    Args:
        x: [..., D] input. w: [D] weight. eps: added to the mean square.
        residual: optional [..., D] (x's shape and dtype): then `h = residual + x` is normed.
    Returns:
        `w * x / rms(x)` [..., D]; with `residual`, the tuple `(h, w * h / rms(h))`. One compiled call for fp32
        rows on CPU, else the PyTorch ops.
    """
    lib = _build.lib()
    if (lib is not None and f32_cpu(x, w) and x.dim() >= 1 and x.stride(-1) == 1 and w.is_contiguous()
            and (residual is None or (f32_cpu(residual) and residual.shape == x.shape and residual.is_contiguous()))):
        D = x.shape[-1]
        x2 = x.reshape(-1, D)  # a view for row-strided inputs of any rank
        if x2.stride(-1) == 1 and w.shape == (D,):
            M = x2.shape[0]
            y = torch.empty(x.shape, dtype=x.dtype)
            h = None if residual is None else torch.empty(x.shape, dtype=x.dtype)
            sx, xp, yp, wp = x2.stride(0), x2.data_ptr(), y.data_ptr(), w.data_ptr()
            ranges = row_ranges(M)
            if h is None:
                args = [RmsNormArgs(xp + 4 * lo * sx, sx, None, 0, None, 0, wp, yp + 4 * lo * D, D, hi - lo, D, eps)
                        for lo, hi in ranges]
            else:
                rp, hp = residual.data_ptr(), h.data_ptr()
                args = [RmsNormArgs(rp + 4 * lo * D, D, xp + 4 * lo * sx, sx, hp + 4 * lo * D, D, wp, yp + 4 * lo * D,
                                    D, hi - lo, D, eps) for lo, hi in ranges]
            if len(args) > 1:  # one share of the rows per compute thread (kernels.cpu.parallel)
                run_kernel(TASK_RMS_NORM, args)
            elif M:
                lib.moeray_rms_norm(ctypes.byref(args[0]))
            return y if h is None else (h, y)
    if residual is None:
        return _rms_norm_torch(x, w, eps)
    h = residual + x
    return h, _rms_norm_torch(h, w, eps)
