"""Triton kernel of the fused expert selection; same contract as `kernels.gating.select_experts_ref`.

One program handles BLOCK_T tokens x all E experts (E padded to a power of two) in registers: sanitize
the logits (NaN -> -inf, +inf -> FLT_MAX, a row with nothing finite -> uniform), softmax, add the
selection bias, K rounds of arg-max with masking (ties go to the lowest expert id), gather the unbiased
scores as weights, renormalise. Nothing but the [T, K] outputs is written.

Runs on CUDA tensors, or on CPU tensors under `TRITON_INTERPRET=1` (fp32 only there: the interpreter is
wrong for bf16, so inputs are cast to fp32 first, as the reference does).

Shape legend: T = tokens, E = routed experts, K = experts per token.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


from kernels.gating import check_selection_args
from kernels.triton_launch import launch_guard

__all__ = ["select_experts_triton"]

_FLT_MAX = 3.4028234663852886e38


@triton.jit
def _select_kernel(logits_ptr, bias_ptr, w_ptr, ids_ptr, T, E,
                   K: tl.constexpr, RENORM: tl.constexpr, HAS_BIAS: tl.constexpr,
                   BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    rmask = rows < T
    cmask = cols < E
    m2 = rmask[:, None] & cmask[None, :]
    x = tl.load(logits_ptr + rows[:, None] * E + cols[None, :], mask=m2, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("-inf"), x)  # NaN
    x = tl.where(x == float("inf"), _FLT_MAX, x)
    row_max = tl.max(x, axis=1)
    dead = row_max == float("-inf")  # nothing finite left: uniform scores
    x = tl.where(dead[:, None] & cmask[None, :], 0.0, x)
    row_max = tl.where(dead, 0.0, row_max)
    p = tl.where(cmask[None, :], tl.exp(x - row_max[:, None]), 0.0)
    probs = p / tl.sum(p, axis=1)[:, None]
    scores = probs
    if HAS_BIAS:
        b = tl.load(bias_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
        scores = scores + b[None, :]
    scores = tl.where(cmask[None, :], scores, float("-inf"))
    total = tl.zeros([BLOCK_T], dtype=tl.float32)
    for j in tl.static_range(K):
        best = tl.max(scores, axis=1)
        is_best = scores == best[:, None]
        idx = tl.min(tl.where(is_best, cols[None, :], BLOCK_E), axis=1)
        hit = cols[None, :] == idx[:, None]
        w = tl.sum(tl.where(hit, probs, 0.0), axis=1)
        total += w
        tl.store(ids_ptr + rows * K + j, idx.to(tl.int64), mask=rmask)
        tl.store(w_ptr + rows * K + j, w, mask=rmask)
        scores = tl.where(hit, float("-inf"), scores)
    if RENORM:
        denom = tl.maximum(total, 1.1754943508222875e-38)
        for j in tl.static_range(K):
            w = tl.load(w_ptr + rows * K + j, mask=rmask, other=0.0)
            tl.store(w_ptr + rows * K + j, w / denom, mask=rmask)


def select_experts_triton(logits_TE: torch.Tensor, k: int, renormalize: bool,
                          bias_E: torch.Tensor | None = None, block_t: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused selection kernel (see `kernels.gating.select_experts_ref` for the contract).

    Args:
        logits_TE: [T, E] router logits (cast to contiguous fp32). k: experts per token, 1 <= k <= E.
        renormalize: divide the K weights by their sum. bias_E: optional [E] selection bias.
        block_t: tokens per program (a power of two).
    Returns:
        (weights [T, K] float32, ids [T, K] int64).
    Raises:
        ValueError: bad shapes or k outside [1, E].
    """
    check_selection_args(logits_TE, k, bias_E)
    T, E = logits_TE.shape
    x = logits_TE.to(torch.float32).contiguous()
    w = torch.empty(T, k, dtype=torch.float32, device=x.device)
    ids = torch.empty(T, k, dtype=torch.int64, device=x.device)
    if T == 0:
        return w, ids
    bias = bias_E.to(x.device, torch.float32).contiguous() if bias_E is not None else x  # dummy pointer
    grid = (triton.cdiv(T, block_t),)
    with launch_guard():
        _select_kernel[grid](x, bias, w, ids, T, E, K=k, RENORM=bool(renormalize), HAS_BIAS=bias_E is not None,
                             BLOCK_T=block_t, BLOCK_E=triton.next_power_of_2(E))
    return w, ids
