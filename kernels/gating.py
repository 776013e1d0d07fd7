"""Top-k gating: router logits -> (expert weights, expert ids), robust to non-finite logits.

`select_experts_ref` is the PyTorch reference of the fused selection kernel
(`kernels.gating_triton.select_experts_triton`, same contract): scores = softmax(logits), selection by
scores + a per-expert bias (auxiliary-loss-free balancing, DeepSeek-V3 arXiv 2412.19437 and Loss-Free
Balancing arXiv 2408.15664; no bias = the model's exact routing), weights from the unbiased scores,
optionally renormalised over the K chosen. Exact ties go to the lowest expert id in every implementation
(`torch.topk` leaves the order of equal values unspecified: on CPU `topk(zeros(8), 2)` gives ids 6, 5), so the
reference, the kernel and the gating policies built on `topk_lowest_id` choose the same experts.

Shape legend: T = tokens, E = routed experts, K = experts per token (top-k).
"""
from __future__ import annotations

import math

import torch


def sanitize_router_logits(logits_TE: torch.Tensor) -> torch.Tensor:
    """Make router logits safe for softmax/top-k without changing finite rows.

    NaN -> -inf; +inf -> the dtype's largest finite value; a row with no finite entry left
    becomes all zeros (uniform scores), so every row still yields K unique in-range experts and
    finite weights, and one bad row cannot corrupt the others.

    Args:
        logits_TE: [T, E] float tensor. Returns a float32 [T, E] tensor (a copy only if needed).
    """
    x = logits_TE.float()
    if math.isfinite(x.sum().item()):  # any nan/inf makes the sum non-finite; a finite overflow only costs the
        return x                       # exact check below
    if bool(torch.isfinite(x).all()):
        return x
    x = torch.nan_to_num(x, nan=float("-inf"), posinf=torch.finfo(torch.float32).max)
    dead = torch.isneginf(x).all(dim=-1, keepdim=True)
    return torch.where(dead, torch.zeros_like(x), x)


def topk_softmax_ref(logits_TE: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts, then top-k, optionally renormalised over the k chosen.

    This is the routing of Qwen2-MoE / Qwen3-MoE / OLMoE (and, with `renormalize=True`, equal to
    Mixtral's top-k-then-softmax). Exact ties go to the lowest expert id (`topk_lowest_id`).

    Args:
        logits_TE: [T, E] router logits (any float dtype; computed in fp32).
        k: experts per token, 1 <= k <= E.
        renormalize: divide the k weights by their sum (`norm_topk_prob`).
    Returns:
        (weights [T, K] float32, ids [T, K] int64); ids unique per row, weights finite.
    Raises:
        ValueError: if k is outside [1, E].
    """
    return select_experts_ref(logits_TE, k, renormalize)


def topk_lowest_id(x_TE: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`torch.topk(x, k, dim=-1)` with a defined tie order: values in descending order, equal values by
    ascending index (a stable descending sort, then the first k).

    Args:
        x_TE: [T, E] float tensor without NaN (T may be 0). k: 0 <= k <= E.
    Returns:
        (values [T, k] in x's dtype, indices [T, k] int64).
    """
    v, i = torch.sort(x_TE, dim=-1, descending=True, stable=True)
    return v[:, :k], i[:, :k]


def check_selection_args(logits_TE: torch.Tensor, k: int, bias_E: torch.Tensor | None) -> None:
    """Shared argument checks of the selection kernels (raise ValueError naming the field and limit)."""
    if logits_TE.dim() != 2:
        raise ValueError(f"router logits must be [T, E], got shape {tuple(logits_TE.shape)}")
    E = logits_TE.shape[1]
    if not 1 <= k <= E:
        raise ValueError(f"top_k={k} must be in [1, num_experts={E}]")
    if bias_E is not None and tuple(bias_E.shape) != (E,):
        raise ValueError(f"bias must have shape [{E}] (num_experts), got {tuple(bias_E.shape)}")


def select_experts_ref(logits_TE: torch.Tensor, k: int, renormalize: bool,
                       bias_E: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused selection, PyTorch reference: scores, bias, top-k, weights in one call.

    scores = softmax(sanitize(logits)); ids = top-k of (scores + bias), exact ties to the lowest expert id
    (as the kernel's arg-max rounds); weights = scores[ids], divided
    by their sum when `renormalize`. The bias steers selection only and never enters the weights, as in
    DeepSeek-V3's auxiliary-loss-free balancing (arXiv 2412.19437, section 2.1.2).

    Args:
        logits_TE: [T, E] router logits, any float dtype (computed in fp32); T may be 0.
        k: experts per token, 1 <= k <= E.
        renormalize: the config's `norm_topk_prob` (Mixtral's top-k-then-softmax is the renormalised case).
        bias_E: optional [E] fp32 per-expert selection bias (finite).
    Returns:
        (weights [T, K] float32, ids [T, K] int64): ids unique per row and in [0, E), weights finite.
    Raises:
        ValueError: bad shapes or k outside [1, E].
    """
    check_selection_args(logits_TE, k, bias_E)
    probs = torch.softmax(sanitize_router_logits(logits_TE), dim=-1)
    if bias_E is None:
        w, ids = topk_lowest_id(probs, k)
    else:
        ids = topk_lowest_id(probs + bias_E.to(probs.device, torch.float32), k)[1]
        w = probs.gather(1, ids)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    return w, ids
