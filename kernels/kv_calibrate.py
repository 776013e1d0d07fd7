"""Offline calibration of one layer's `KVQuantProfile` (KVQuant, arXiv 2401.18079, sections 3.1-3.4).

`fit_kv_profile` takes calibration keys (pre-RoPE) and values of one layer and fits everything
`kernels.kv_quant` needs: per-channel key scale and zero (min/max or MSE-clipped ranges), the fp16 outlier
channels, the per-channel value mean, and the key and value codebooks (`fit_codebook`, 1-D Lloyd-Max on the
normalised inliers). With `k_channel_bits=B` it allocates B bits per head row to per-channel key widths
instead of a key codebook (`allocate_channel_bits`): greedy reverse water-filling on the calibration keys'
squared error weighted by the query energy of the channel's RoPE pair (the expected squared attention-logit
error): classic transform-coding bit allocation (Gersho & Gray, ch. 8) applied to keys, in the spirit of
KVQuant's sensitivity-weighted quantization (section 3.3, Fisher-weighted k-means). Calibration only: the
stored format is the profile's (`kernels.kv_profile`).

Shape legend: N = calibration tokens, H = KV heads, D = head_dim, L = 2**bits codebook levels,
B = widths 0..8 (first dim of the per-width error err_BHD).
"""
from __future__ import annotations

import math

import torch

from kernels.codebook import lloyd_max
from kernels.kv_pack import MAX_CHANNEL_BITS, _check_bits, packed_bytes
from kernels.kv_profile import KVQuantProfile
from kernels.kv_quant import (_inlier_mask, _uniform_channel_codes, _uniform_channel_levels, _value_scale,
                              nearest_level, value_scale_float)

CODEBOOK_METHODS = ("kmeans", "uniform")
# k-means on more points than this changes the codebook by far less than the quantization step.
_MAX_FIT_SAMPLES = 1 << 20
K_RANGES = ("mse", "minmax")
# Candidate shrink factors of a key channel's calibrated half-range for k_range="mse". Below 0.4 the clipped
# tails dominate the error for every channel measured on tiny-moe, so the grid stops there.
MSE_CLIP_FACTORS = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4)
MSE_ROUNDS = 2


def fit_codebook(samples: torch.Tensor, bits: int, *, method: str = "kmeans", iters: int = 30) -> torch.Tensor:
    """Fit a 2**bits-level codebook on normalised values (KVQuant section 3.3, non-uniform quantization).

    `kmeans` is 1-D Lloyd-Max: deterministic quantile initialisation, then `iters` rounds of
    assign-to-nearest / move-to-mean. `uniform` is the cheap grid linspace(-1, 1, L). Samples are clamped
    to [-1, 1] (values outside were clipped by the calibrated scale anyway) and deterministically
    subsampled above 2**20 elements.

    Args:
        samples: any shape, float, normalised to roughly [-1, 1]. May be empty (returns the uniform grid).
        bits: 1, 2, 3 or 4 (1: two levels, a layer's 1-bit values, `actors.kv.layer_widths`).
        method: "kmeans" or "uniform".
        iters: Lloyd iterations, >= 0.
    Returns:
        [L] fp32 levels, strictly ascending.
    Raises:
        ValueError: unsupported bits or method, negative iters.
    """
    _check_bits(bits)
    if method not in CODEBOOK_METHODS:
        raise ValueError(f"method={method!r} is not one of {CODEBOOK_METHODS}")
    if iters < 0:
        raise ValueError(f"iters={iters} must be >= 0")
    n_levels = 1 << bits
    uniform = torch.linspace(-1.0, 1.0, n_levels)
    x = samples.detach().reshape(-1).float().cpu().clamp(-1.0, 1.0)
    if method == "uniform" or x.numel() < n_levels:
        return uniform
    if x.numel() > _MAX_FIT_SAMPLES:
        x = x[torch.linspace(0, x.numel() - 1, _MAX_FIT_SAMPLES).long()]
    levels = lloyd_max(x, n_levels, iters)
    # Identical levels (e.g. from a constant input) would make nearest_level ambiguous; break ties.
    if not bool((levels[1:] > levels[:-1]).all()):
        levels = levels + torch.arange(n_levels, dtype=torch.float32) * 1e-6
    return levels.contiguous()


def allocate_channel_bits(err_BHD: torch.Tensor, weight_HD: torch.Tensor, budget: int, *, min_bits: int = 2
                          ) -> torch.Tensor:
    """Per-channel widths minimising sum_d weight[h, d] * err[b[h, d], h, d] with sum_d b[h, d] = budget.

    Greedy reverse water-filling: start every channel at `min_bits`, then hand out one bit at a time to the
    channel whose weighted error drops most (optimal for convex error curves; err is made non-increasing).

    Args:
        err_BHD: [B + 1, H, D] float, err[b] = mean squared error of the channel at width b (index 0 unused).
        weight_HD: [H, D] float >= 0, importance of the channel's squared error.
        budget: bits per head row, min_bits * D <= budget <= (B) * D.
        min_bits: smallest width, >= 1.
    Returns:
        [H, D] uint8 widths.
    Raises:
        ValueError: budget or min_bits out of range.
    """
    bmax = err_BHD.shape[0] - 1
    _, h, d = err_BHD.shape
    if not 1 <= min_bits <= bmax or not min_bits * d <= budget <= bmax * d:
        raise ValueError(f"k_channel_bits={budget} must be in [{min_bits} * D, {bmax} * D] with D={d}, "
                         f"min_bits={min_bits} in [1, {bmax}]")
    err = torch.cummin(err_BHD.float(), dim=0).values
    bits = torch.full((h, d), min_bits, dtype=torch.int64, device=err.device)
    ar = torch.arange(d, device=err.device)
    for hh in range(h):
        for _ in range(budget - min_bits * d):
            b = bits[hh]
            nxt = (b + 1).clamp(max=bmax)
            gain = weight_HD[hh].float() * (err[b, hh, ar] - err[nxt, hh, ar])
            gain = torch.where(b < bmax, gain, torch.full_like(gain, -float("inf")))
            bits[hh, int(gain.argmax())] += 1
    return bits.to(torch.uint8)


def _top_channels(x_NHD: torch.Tensor, n: int) -> torch.Tensor:
    """[H, n] int32 channels of largest max-abs per head, sorted ascending (deterministic order)."""
    mag_HD = x_NHD.abs().amax(dim=0)
    return mag_HD.topk(n, dim=1).indices.sort(dim=1).values.to(torch.int32)


def fit_kv_profile(
    k_calib: torch.Tensor,
    v_calib: torch.Tensor,
    *,
    bits: int,
    n_outlier: int = 2,
    n_outlier_v: int = 0,
    percentile: float = 1.0,
    use_zero: bool = True,
    use_v_zero: bool = True,
    codebook: str = "kmeans",
    iters: int = 30,
    k_range: str = "mse",
    codebook_v: str | None = None,
    k_channel_bits: int | None = None,
    query_energy: torch.Tensor | None = None,
    k_min_bits: int = 2,
    v_scale_bits: int = 16,
) -> KVQuantProfile:
    """Calibrate one layer's `KVQuantProfile` offline (KVQuant, arXiv 2401.18079, sections 3.1-3.4).

    Args:
        k_calib: [N, H, D] float, calibration keys BEFORE RoPE (per-channel structure is cleaner pre-RoPE).
        v_calib: [N, H, D] float, calibration values.
        bits: code width, 1, 2, 3 or 4 bits per element (1: for a layer's values inside a 2-bit profile with
            per-channel keys, `actors.kv.layer_widths`; keys then take their widths from k_channel_bits).
        n_outlier: key outlier channels per head kept in fp16, 0 <= n_outlier <= D (D bypasses K quantization).
        n_outlier_v: value outlier channels per head kept in fp16, 0 <= n_outlier_v <= D.
        percentile: in (0.5, 1]; per-channel key range is [q(1 - p), q(p)] over tokens (1.0 = min/max),
            values beyond are clipped to the end levels.
        use_zero: per-channel key zero point (asymmetric range) if True, else symmetric max-abs scale.
        use_v_zero: subtract the calibrated per-channel value mean before per-token scaling.
        codebook: "kmeans" (non-uniform, Lloyd-Max) or "uniform", for the key codebook (and the value one
            unless codebook_v is given).
        codebook_v: "kmeans" or "uniform" for the value codebook; None = same as codebook. At 2 bits on
            tiny-moe a uniform key grid with a k-means value codebook measured best (BENCHMARKS.md, KV section):
            MSE-fitted key levels pull the end levels inwards, and the rare large keys that decide attention
            lose most.
        iters: Lloyd iterations.
        k_range: "mse" (default) or "minmax". "minmax" maps each key channel's calibrated [lo, hi] (after
            `percentile`) onto [-1, 1]. "mse" then shrinks each channel's half-range by the factor in
            `MSE_CLIP_FACTORS` that minimises that channel's squared error through the layer's codebook,
            refitting the codebook after each of `MSE_ROUNDS` rounds (clipping search as in weight
            quantizers, e.g. AWQ's clip search, arXiv 2306.00978, applied per key channel). Calibration-only:
            the stored format is unchanged. On tiny-moe at 2 bits it lowers the held-out perplexity increase
            by ~0.4-1 points (bench/kv_quality.py, row `-mse`).
        k_channel_bits: None (one width `bits` for every key channel), or B bits per head row for per-channel
            key widths (`k_bits`, module docstring): each inlier channel's width in [k_min_bits, 8] on a
            uniform grid over its calibrated range (after `percentile`; codebook then does not apply to
            keys), allocated by `allocate_channel_bits` on the calibration keys' squared error weighted by
            `query_energy`. With k_range="mse" each channel's error at each width is the least over
            `MSE_CLIP_FACTORS` of its half-range, and the channel keeps the factor of the width it gets.
            Outlier channels get k_min_bits (their slots are ignored) and should normally be 0: a large channel
            gets more bits instead. B in [k_min_bits * D, 8 * D]; the key
            row costs ceil(B / 8) bytes per token and head.
        query_energy: [H, D] float >= 0, the weight of channel d's squared key error: for RoPE'd attention,
            the mean over calibration queries of (q_d**2 + q_{d +- D/2}**2) / 2 summed over the KV head's
            query heads (`actors.kv.calibration.collect_calibration_kv(..., with_query_energy=True)`). A
            pre-RoPE key error e_d moves the logit by q_rot . R e, whose mean square over the pair's
            rotation angle is that pair energy times e_d**2 / 2 (rotation-invariant, so post-RoPE queries
            give it). None = equal weights.
        k_min_bits: smallest per-channel key width, in [1, 8].
        v_scale_bits: 16 (the per-token value scale in fp16) or 8 (an 8-bit log2 code, `KVQuantProfile`); the
            value codebook is fitted on values normalised by the stored scale.
    Returns:
        KVQuantProfile on the device of k_calib.
    Raises:
        ValueError: mismatched shapes, N == 0, out-of-range bits / n_outlier / n_outlier_v / percentile /
            k_channel_bits / k_min_bits, query_energy not [H, D], unknown k_range.
    """
    codebook_v = codebook if codebook_v is None else codebook_v
    if codebook_v not in CODEBOOK_METHODS:
        raise ValueError(f"codebook_v={codebook_v!r} is not one of {CODEBOOK_METHODS}")
    if k_range not in K_RANGES:
        raise ValueError(f"k_range={k_range!r} is not one of {K_RANGES}")
    if k_calib.dim() != 3 or v_calib.shape != k_calib.shape:
        raise ValueError(f"k_calib.shape={tuple(k_calib.shape)} and v_calib.shape={tuple(v_calib.shape)} "
                         "must both be [N, H, D]")
    n, h, d = k_calib.shape
    if n == 0:
        raise ValueError("k_calib has N=0 calibration tokens; need at least 1")
    _check_bits(bits)
    packed_bytes(d, bits)
    if not 0 <= n_outlier <= d:
        raise ValueError(f"n_outlier={n_outlier} must be in [0, head_dim={d}]")
    if not 0 <= n_outlier_v <= d:
        raise ValueError(f"n_outlier_v={n_outlier_v} must be in [0, head_dim={d}]")
    if not 0.5 < percentile <= 1.0:
        raise ValueError(f"percentile={percentile} must be in (0.5, 1.0]")
    k = k_calib.detach().float()
    v = v_calib.detach().float()

    k_idx = _top_channels(k, n_outlier)
    v_idx = _top_channels(v, n_outlier_v)
    k_in_HD = _inlier_mask(k_idx, d)
    v_in_HD = _inlier_mask(v_idx, d)

    if percentile >= 1.0:
        hi_HD, lo_HD = k.amax(dim=0), k.amin(dim=0)
    else:
        k_sorted = k.sort(dim=0).values
        hi_HD = k_sorted[min(n - 1, math.ceil(percentile * (n - 1)))]
        lo_HD = k_sorted[max(0, math.floor((1.0 - percentile) * (n - 1)))]
    if use_zero:
        zero_HD = (hi_HD + lo_HD) * 0.5
        scale_HD = (hi_HD - lo_HD) * 0.5
    else:
        zero_HD = torch.zeros_like(hi_HD)
        scale_HD = torch.maximum(hi_HD.abs(), lo_HD.abs())
    # A constant channel has zero range; any positive scale reproduces it through the zero point.
    scale_HD = torch.where(k_in_HD, scale_HD.clamp_min(1e-8), torch.ones_like(scale_HD))
    zero_HD = torch.where(k_in_HD, zero_HD, torch.zeros_like(zero_HD))

    k_bits_HD = torch.zeros(0, dtype=torch.uint8)
    if k_channel_bits is not None:
        if query_energy is not None and tuple(query_energy.shape) != (h, d):
            raise ValueError(f"query_energy.shape={tuple(query_energy.shape)} must be [H={h}, D={d}]")
        w_HD = torch.ones(h, d) if query_energy is None else query_energy.detach().float().cpu().clamp_min(0)
        factors = MSE_CLIP_FACTORS if k_range == "mse" else (1.0,)
        err, factor_BHD = _channel_grid_errors(k, zero_HD, scale_HD, factors)
        # outlier channels never go through the grid; keep them at the floor so the budget goes elsewhere
        w_HD = torch.where(k_in_HD.cpu(), w_HD, torch.zeros(()))
        k_bits_HD = allocate_channel_bits(err, w_HD, k_channel_bits, min_bits=k_min_bits).to(k.device)
        chosen_HD = factor_BHD.gather(0, k_bits_HD.long()[None].cpu())[0].to(k.device)  # 1.0 unless mse
        scale_HD = torch.where(k_in_HD, scale_HD * chosen_HD, scale_HD)
        k_codebook = torch.linspace(-1.0, 1.0, 1 << bits, device=k.device)  # unused with k_bits
        k_range = "minmax"  # done: each channel's clip factor was chosen at its own width above
    else:
        k_norm = ((k - zero_HD) / scale_HD)[:, k_in_HD]  # [N, inliers]
        k_codebook = fit_codebook(k_norm, bits, method=codebook, iters=iters).to(k.device)
    if k_range == "mse":
        for _ in range(MSE_ROUNDS):
            scale_HD = _mse_clip_scale(k, zero_HD, scale_HD, k_codebook, k_in_HD)
            k_norm = ((k - zero_HD) / scale_HD)[:, k_in_HD]
            k_codebook = fit_codebook(k_norm, bits, method=codebook, iters=iters).to(k.device)
    v_zero_HD = torch.where(v_in_HD, v.mean(dim=0), torch.zeros((), device=v.device)) if use_v_zero \
        else torch.zeros(h, d, device=v.device)
    v_c = v - v_zero_HD
    v_scale_NH = value_scale_float(_value_scale(v_c, v_in_HD, v_scale_bits))
    v_norm = (v_c / v_scale_NH[..., None])[:, v_in_HD]
    return KVQuantProfile(
        bits=bits,
        k_scale=scale_HD,
        k_zero=zero_HD,
        v_zero=v_zero_HD,
        k_codebook=k_codebook,
        v_codebook=fit_codebook(v_norm, bits, method=codebook_v, iters=iters).to(k.device),
        k_outlier_idx=k_idx,
        v_outlier_idx=v_idx,
        k_bits=k_bits_HD,
        v_scale_bits=v_scale_bits,
    )


def _channel_grid_errors(k_NHD: torch.Tensor, zero_HD: torch.Tensor, scale_HD: torch.Tensor, factors
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-width key error of the per-channel uniform grid, each channel clipped at its best factor.

    Returns ([B + 1, H, D] fp32 mean squared error on the CPU, err[b] at width b with the best of `factors` for
    that channel and width (err[0] unused, set above err[1]); [B + 1, H, D] fp32 those factors of the half-range).
    With factors (1.0,) this is the min/max grid (no clipping search)."""
    h, d = scale_HD.shape
    errs, facs = [torch.zeros(h, d)], [torch.ones(h, d)]
    for b in range(1, MAX_CHANNEL_BITS + 1):
        wb = torch.full((h, d), b, dtype=torch.int64, device=k_NHD.device)
        best_err, best_f = None, None
        for f in factors:
            s = scale_HD * f
            x_norm = (k_NHD - zero_HD) / s
            e = (((_uniform_channel_levels(_uniform_channel_codes(x_norm, wb), wb) - x_norm) * s) ** 2).mean(dim=0)
            if best_err is None:
                best_err, best_f = e, torch.full_like(e, f)
            else:
                better = e < best_err
                best_err, best_f = torch.where(better, e, best_err), torch.where(better, f, best_f)
        errs.append(best_err.cpu())
        facs.append(best_f.cpu())
    err, fac = torch.stack(errs), torch.stack(facs)
    err[0] = err[1] * 4  # unused (min_bits >= 1); keeps cummin monotone
    return err, fac


def _mse_clip_scale(k_NHD: torch.Tensor, zero_HD: torch.Tensor, scale_HD: torch.Tensor, codebook: torch.Tensor,
                    inlier_HD: torch.Tensor) -> torch.Tensor:
    """[H, D] per-channel key scale: scale_HD times the factor of MSE_CLIP_FACTORS with the least squared error
    of the channel's calibration keys through `codebook` (values beyond the clipped range saturate at the end
    levels). Outlier channels keep scale 1. Ties keep the earlier (larger) factor."""
    best_err = torch.full_like(scale_HD, float("inf"))
    best = scale_HD.clone()
    for f in MSE_CLIP_FACTORS:
        s = scale_HD * f
        x_hat = codebook[nearest_level((k_NHD - zero_HD) / s, codebook)] * s + zero_HD
        err = ((x_hat - k_NHD) ** 2).mean(dim=0)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better, s, best)
    return torch.where(inlier_HD, best, torch.ones_like(best))
