"""Top-k gating: router logits -> (expert weights, expert ids), robust to non-finite logits.

Shape legend: T = tokens, E = routed experts, K = experts per token (top-k).
"""
from __future__ import annotations

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
    if bool(torch.isfinite(x).all()):
        return x
    x = torch.nan_to_num(x, nan=float("-inf"), posinf=torch.finfo(torch.float32).max)
    dead = torch.isneginf(x).all(dim=-1, keepdim=True)
    return torch.where(dead, torch.zeros_like(x), x)


def topk_softmax_ref(logits_TE: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts, then top-k, optionally renormalised over the k chosen.

    This is the routing of Qwen2-MoE / Qwen3-MoE / OLMoE (and, with `renormalize=True`, equal to
    Mixtral's top-k-then-softmax). Ties are broken as `torch.topk` does, as transformers does.

    Args:
        logits_TE: [T, E] router logits (any float dtype; computed in fp32).
        k: experts per token, 1 <= k <= E.
        renormalize: divide the k weights by their sum (`norm_topk_prob`).
    Returns:
        (weights [T, K] float32, ids [T, K] int64); ids unique per row, weights finite.
    Raises:
        ValueError: if k is outside [1, E].
    """
    T, E = logits_TE.shape
    if not 1 <= k <= E:
        raise ValueError(f"top_k={k} must be in [1, num_experts={E}]")
    probs = torch.softmax(sanitize_router_logits(logits_TE), dim=-1)
    w, ids = torch.topk(probs, k, dim=-1)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    return w, ids
