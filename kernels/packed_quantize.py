"""Quantize full-precision weights into the packed sub-4-bit format (`kernels.packed_format`).

Shape legend: E = experts, T = tokens, D = hidden, I = expert intermediate, K = input dim,
N = output dim, G = groups along K = ceil(K / group_size), W = int32 words per row = ceil(K * bits / 32),
L = codebook levels = 2**bits. A weight is `[N, K]` (or a stack `[E, N, K]`) and a layer computes `x @ w.T`.

Method
------
Group-wise asymmetric quantization, as in GPTQ / AWQ-style inference kernels: each row is cut along K into
groups of `group_size` inputs (the last group is shorter when K is not a multiple), and each group has an
fp16 `scale` s and an fp16 `zero` z (in code units), so that

    w[n, k] ~= (level[q[n, k]] - z[n, g]) * s[n, g],      g = k // group_size

With the uniform grid, `level[q] = q` for integer codes q in [0, L-1]. With a codebook, `level` is a per-matrix
table of L fp16 values in code units [0, L-1], fitted by Lloyd-Max / 1-D k-means on the group-normalised
weights `w / s + z` (the non-uniform, sensitivity-free variant of SqueezeLLM, arXiv 2306.07629). The group
range is widened to include 0 (as GPTQ's quantizer does), which keeps `z` inside [0, L-1]: it never overflows
fp16 and keeps about 3 decimal digits, whatever the sign of the group.

Storage layout and what a weight costs in bits: `kernels.packed_format`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kernels.codebook import lloyd_max
from kernels.packed_format import PackedExperts, PackedWeight, _check_bits, _check_group_size, pack_codes

# Smallest normal fp16: a group whose range is below (L - 1) * this is rounded on a coarser grid rather
# than letting the stored scale flush to zero.
_MIN_SCALE = 2.0**-14
_FP16_MAX = 65504.0

__all__ = ["fit_codebook", "quantize", "quantize_experts"]


def fit_codebook(u: torch.Tensor, bits: int, *, iters: int = 30, max_samples: int = 1 << 18) -> torch.Tensor:
    """Fit 2**bits non-uniform levels to normalised weights by Lloyd-Max (1-D k-means, squared error).

    Source: Lloyd (1982) / Max (1960) scalar quantizer; SqueezeLLM (arXiv 2306.07629) uses the same
    k-means over weight values (there weighted by Fisher information; here unweighted).

    Args:
        u: any-shape float tensor of group-normalised weights in code units, nominally in [0, 2**bits - 1].
        bits: 2, 3 or 4.
        iters: Lloyd iterations (each: assign to nearest level, move level to its cluster mean).
        max_samples: above this many values a deterministic strided subsample is fitted (the levels are
            a 1-D distribution summary; 2**18 samples pin them to ~1e-3 code units).
    Returns:
        `[2**bits]` float32 levels, sorted ascending.
    Raises:
        ValueError: `bits` unsupported, `u` empty, or `iters` < 1.
    """
    _check_bits(bits)
    if u.numel() == 0:
        raise ValueError("u is empty: cannot fit a codebook to zero weights")
    if iters < 1:
        raise ValueError(f"iters={iters} must be >= 1")
    v = u.detach().reshape(-1).float()
    if v.numel() > max_samples:
        v = v[:: math.ceil(v.numel() / max_samples)]
    return lloyd_max(v, 1 << bits, iters)


def _nearest_level(u: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Index of the nearest of the sorted `levels` `[L]` for each value of `u` (int64, same shape)."""
    return torch.bucketize(u, (levels[1:] + levels[:-1]) / 2)


def _quantize_matrix(w: torch.Tensor, bits: int, group_size: int, codebook: bool, kmeans_iters: int):
    """One `[N, K]` fp32 matrix -> (codes `[N, W]` int32, scales `[N, G]` fp16, zeros `[N, G]` fp16,
    codebook `[L]` fp16 or None)."""
    n, k = w.shape
    n_levels = 1 << bits
    g = -(-k // group_size)
    # Zero padding of the tail group is harmless because the range includes 0 anyway.
    wg = F.pad(w, (0, g * group_size - k)).reshape(n, g, group_size)
    lo = wg.amin(-1).clamp(max=0)
    hi = wg.amax(-1).clamp(min=0)
    scale = ((hi - lo) / (n_levels - 1)).clamp(min=_MIN_SCALE)
    if float(scale.max()) > _FP16_MAX:
        raise ValueError(f"weight range {float((hi - lo).max()):.4g} needs a scale above the fp16 maximum {_FP16_MAX}")
    scale16 = scale.half()
    zero16 = (-lo / scale16.float()).clamp(0, n_levels - 1).half()
    # Normalise with the stored fp16 values so the codes are optimal for what dequantize will read.
    s = scale16.float().repeat_interleave(group_size, -1)[:, :k]
    z = zero16.float().repeat_interleave(group_size, -1)[:, :k]
    u = w / s + z  # [N, K], code units
    levels16 = None
    if codebook:
        levels16 = fit_codebook(u, bits, iters=kmeans_iters).half()
        levels16, _ = torch.sort(levels16)
        q = _nearest_level(u, levels16.float())
    else:
        q = torch.round(u).clamp_(0, n_levels - 1)
    return pack_codes(q.to(torch.int64), bits), scale16, zero16, levels16


def quantize(w: torch.Tensor, *, bits: int = 4, group_size: int = 128, codebook: bool = False,
             kmeans_iters: int = 30) -> PackedWeight:
    """Quantize and pack a weight matrix (or a stack of expert matrices) group-wise along K.

    Source: group-wise asymmetric min/max quantization (GPTQ / AWQ-style kernels' storage format, without
    their error-compensating updates); optional per-matrix non-uniform codebook by Lloyd-Max k-means on the
    group-normalised weights (SqueezeLLM, arXiv 2306.07629, unweighted).

    Args:
        w: `[N, K]` or `[E, N, K]` float (fp32 / fp16 / bf16; computed in fp32), finite.
        bits: bits per code, 2, 3 or 4.
        group_size: inputs per scale/zero group, 32, 64 or 128; K need not be a multiple (short tail group).
        codebook: fit a 2**bits-level codebook per matrix (per expert for a stack) instead of the uniform grid.
        kmeans_iters: Lloyd iterations when `codebook` is set.
    Returns:
        PackedWeight with `shape == tuple(w.shape)`, on `w.device`.
    Raises:
        ValueError: `bits` / `group_size` unsupported, `w` not 2-D/3-D, empty, not floating point, not
        finite, or so large that a group scale exceeds the fp16 maximum 65504.
    """
    _check_bits(bits)
    _check_group_size(group_size)
    if w.dim() not in (2, 3) or w.numel() == 0:
        raise ValueError(f"w must be a non-empty [N, K] or [E, N, K] tensor, got shape={tuple(w.shape)}")
    if not w.dtype.is_floating_point:
        raise ValueError(f"w must be floating point, got dtype={w.dtype}")
    wf = w.detach().float()
    if not bool(torch.isfinite(wf).all()):
        raise ValueError("w contains inf or nan")
    # One matrix at a time: bounds the int64 packing temporaries and gives each expert its own codebook.
    parts = [_quantize_matrix(m, bits, group_size, codebook, kmeans_iters) for m in wf.reshape(-1, *w.shape[-2:])]
    codes, scales, zeros, books = (list(x) for x in zip(*parts))
    if w.dim() == 2:
        return PackedWeight(codes=codes[0], scales=scales[0], zeros=zeros[0], codebook=books[0],
                            bits=bits, group_size=group_size, shape=tuple(w.shape))
    return PackedWeight(codes=torch.stack(codes), scales=torch.stack(scales), zeros=torch.stack(zeros),
                        codebook=torch.stack(books) if codebook else None,
                        bits=bits, group_size=group_size, shape=tuple(w.shape))


def quantize_experts(gate_proj: torch.Tensor, up_proj: torch.Tensor, down_proj: torch.Tensor, *, bits: int = 4,
                     group_size: int = 128, codebook: bool = False, fuse_gate_up: bool = False,
                     kmeans_iters: int = 30) -> PackedExperts:
    """Quantize stacked full-precision expert weights (see `quantize` for the method and errors).

    Args:
        gate_proj: `[E, I, D]` float.
        up_proj: `[E, I, D]` float.
        down_proj: `[E, D, I]` float.
        bits, group_size, codebook, kmeans_iters: as in `quantize`, applied to every projection.
        fuse_gate_up: store gate and up as one `[E, 2I, D]` matrix per expert (one codebook for both),
            so a kernel reads one weight and launches once for the two projections.
    Returns:
        PackedExperts.
    Raises:
        ValueError: shapes not `[E, I, D]`, `[E, I, D]`, `[E, D, I]`, plus everything `quantize` raises.
    """
    if gate_proj.dim() != 3 or up_proj.shape != gate_proj.shape:
        raise ValueError(f"gate_proj and up_proj must both be [E, I, D], got {tuple(gate_proj.shape)} and "
                         f"{tuple(up_proj.shape)}")
    e, i, d = gate_proj.shape
    if tuple(down_proj.shape) != (e, d, i):
        raise ValueError(f"down_proj.shape={tuple(down_proj.shape)}, expected [E, D, I]={(e, d, i)}")
    kw = dict(bits=bits, group_size=group_size, codebook=codebook, kmeans_iters=kmeans_iters)
    down = quantize(down_proj, **kw)
    if fuse_gate_up:
        return PackedExperts(gate_up=quantize(torch.cat([gate_proj, up_proj], dim=1), **kw), down=down)
    return PackedExperts(gate=quantize(gate_proj, **kw), up=quantize(up_proj, **kw), down=down)
