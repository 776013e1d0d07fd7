"""1-D Lloyd-Max (k-means) codebooks shared by the KV cache and the packed expert weights.

Source: Lloyd (1982) / Max (1960) scalar quantizer; used for non-uniform KV levels in KVQuant
(arXiv 2401.18079) and for weight levels in SqueezeLLM (arXiv 2306.07629).
"""
from __future__ import annotations

import torch


def lloyd_max(samples: torch.Tensor, n_levels: int, iters: int) -> torch.Tensor:
    """Fit `n_levels` scalar levels minimising squared error to `samples`.

    Quantile initialisation, then `iters` Lloyd rounds. Samples are sorted once, so each level's
    cell is a contiguous run and a round is a searchsorted plus prefix-sum differences:
    O(L log N) per round instead of O(N). An empty cell keeps its level.

    Args:
        samples: any shape, float, non-empty (the caller subsamples large inputs).
        n_levels: number of levels L >= 1. iters: Lloyd rounds >= 0.
    Returns:
        [L] float32 levels, sorted ascending (ties possible for degenerate inputs), on samples' device.
    Raises:
        ValueError: empty samples or negative iters.
    """
    x = samples.detach().reshape(-1).float()
    if x.numel() == 0:
        raise ValueError("samples is empty: cannot fit a codebook")
    if iters < 0:
        raise ValueError(f"iters={iters} must be >= 0")
    xs = x.sort().values
    pos = ((torch.arange(n_levels, dtype=torch.float64) + 0.5) * (xs.numel() / n_levels)).long()
    levels = xs[pos.clamp_(max=xs.numel() - 1).to(xs.device)].clone()
    prefix = torch.cat([torch.zeros(1, dtype=torch.float64, device=xs.device), xs.double().cumsum(0)])
    n = torch.full((1,), xs.numel(), dtype=torch.long, device=xs.device)
    zero = torch.zeros(1, dtype=torch.long, device=xs.device)
    for _ in range(iters):
        edges = torch.cat([zero, torch.searchsorted(xs, (levels[1:] + levels[:-1]) * 0.5), n])
        counts = (edges[1:] - edges[:-1]).double()
        means = ((prefix[edges[1:]] - prefix[edges[:-1]]) / counts.clamp_min(1.0)).float()
        levels = torch.where(counts > 0, means, levels).sort().values
    return levels.contiguous()
