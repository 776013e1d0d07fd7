"""Reference KV-cache quantize / dequantize of one layer: sub-4-bit, outlier-aware, non-uniform (KVQuant).

KVQuant: arXiv 2401.18079. What is quantized, and how (one layer):
  * keys, per channel: `k_norm = (k - k_zero[h, d]) / k_scale[h, d]` with scales/zeros calibrated offline on
    pre-RoPE keys (KVQuant section 3.1-3.2: per-channel, pre-RoPE; the range is min/max or, `k_range="mse"`,
    shrunk per channel to the least squared error through the codebook), then the nearest level of the
    layer's key codebook (k-means / Lloyd-Max fitted on normalised calibration keys, section 3.3, or a
    uniform grid);
  * values, per token: `v_norm = (v - v_zero[h, d]) / v_scale[t, h]`, `v_scale` = max-abs of the token's
    centred inlier channels, computed online at quantize time and stored as fp16 (or, with the profile's
    `v_scale_bits = 8`, as an 8-bit log2 code: the scale 2 ** ((c - 128) / 16), c the least code whose scale
    is >= the max-abs, saturating at 2 ** -8 and 2 ** (127 / 16); 1/16-octave steps, so the rounded-up scale
    is at most 4.4% above the max-abs), then the nearest level of the value codebook. `v_zero` is an optional
    calibrated per-channel mean (not in KVQuant): values share a per-channel offset (e.g. the v_proj bias of
    Qwen2), and removing it leaves the per-token scale to the part that varies, which at 3 bits halves the
    value error on such data; it costs H * D fp32 per layer;
  * outlier channels: per KV head, the `n_outlier` channels of largest calibrated max-abs are kept dense in
    fp16 in a side array and excluded from the scale and codebook fit. KVQuant isolates ~1% of values as
    sparse per-token outliers; a fixed per-head channel set is the dense-and-static variant, chosen because
    the paged kernel can restore it with one gather and no sparse format. Their code slots are still
    stored (and ignored), which costs `n_outlier * bits` bits per token and head but keeps the bit offset
    of channel d equal to `d * bits`.

Per-channel key widths (`k_bits`, optional): instead of one `bits`-bit codebook for every key channel, each
channel d of head h gets its own width b[h, d] in [1, 8] on a uniform grid over its calibrated range:
`k = k_zero + k_scale * (2 * code / (2**b - 1) - 1)` (the `uniform` codebook, per channel). It replaces the
fp16 outlier side array: a large channel simply gets more bits. Every head's widths sum to the same B, so the
key row is P_k = ceil(B / 8) bytes (the value row stays P); the codes of a row are one bitstream, channel d at
bit offset sum(b[h, :d]) (`kernels.kv_pack.pack_codes_var`). The widths are allocated offline
(`kernels.kv_calibrate.allocate_channel_bits`).

On CPU `quantize_kv` runs as one compiled pass (kernels/csrc/kv_quantize.c, bit-identical to the PyTorch ops here,
which stay the reference and the path elsewhere).

Code packing: `kernels.kv_pack`; the profile: `kernels.kv_profile`; calibration: `kernels.kv_calibrate`;
paged storage: `kernels.kv_pages`. The KIVI baseline (arXiv 2402.02750) compared against lives in
bench/kivi.py.

Shape legend: N = tokens, H = KV heads, D = head_dim, L = 2**bits codebook levels, P = packed bytes per
token and head (D * bits / 8), Pk = packed key bytes, Ok / Ov = outlier channels per head (K / V).
"""
from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kernels.kv_pack import pack_codes, pack_codes_var, unpack_codes, unpack_codes_var
from kernels.kv_profile import KVQuantProfile

_FP16_MAX = 65504.0
V_SCALE_CODE_ZERO = 128  # 8-bit value scale code c means 2 ** ((c - V_SCALE_CODE_ZERO) / V_SCALE_STEPS)
V_SCALE_STEPS = 16


@functools.lru_cache(maxsize=8)
def _scale_table(device: str) -> torch.Tensor:
    return torch.exp2((torch.arange(256, dtype=torch.float64) - V_SCALE_CODE_ZERO) / V_SCALE_STEPS).float().to(device)


def value_scale_table(device: torch.device | str = "cpu") -> torch.Tensor:
    """[256] fp32: the value scale of each 8-bit log2 code (module docstring); every kernel reads this table."""
    return _scale_table(str(torch.device(device)))


def encode_value_scale(mag: torch.Tensor) -> torch.Tensor:
    """uint8 code of the least scale in `value_scale_table` that is >= `mag` (any shape, >= 0), saturating at
    codes 0 and 255. No error: magnitudes beyond the top scale clip to the codebook's end levels."""
    table = value_scale_table(mag.device)
    c = (torch.ceil(torch.log2(mag.float().clamp_min(1e-30)) * V_SCALE_STEPS) + V_SCALE_CODE_ZERO).clamp(0, 255)
    c = c.to(torch.int64)
    c = c - ((c > 0) & (table[(c - 1).clamp_min(0)] >= mag)).to(torch.int64)  # log2 rounding either way
    c = c + ((c < 255) & (table[c] < mag)).to(torch.int64)
    return c.to(torch.uint8)


def value_scale_float(v_scale: torch.Tensor) -> torch.Tensor:
    """fp32 scales of stored value scales: fp16 ones as they are, uint8 log2 codes through `value_scale_table`."""
    if v_scale.dtype == torch.uint8:
        return value_scale_table(v_scale.device)[v_scale.long()]
    return v_scale.float()


def _uniform_channel_codes(x_norm: torch.Tensor, widths_HD: torch.Tensor) -> torch.Tensor:
    """Nearest level of the per-channel uniform grid -1 + 2 c / (2**b - 1), c in [0, 2**b)."""
    top = ((1 << widths_HD.to(torch.int64)) - 1).to(x_norm.dtype)
    return torch.minimum(((x_norm.clamp(-1.0, 1.0) + 1.0) * 0.5 * top).round(), top).to(torch.int64)


def _uniform_channel_levels(codes: torch.Tensor, widths_HD: torch.Tensor) -> torch.Tensor:
    top = ((1 << widths_HD.to(torch.int64)) - 1).float()
    return codes.float() * (2.0 / top) - 1.0


def nearest_level(x: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """Index of the nearest codebook level for every element.

    Args:
        x: any shape, float.
        codebook: [L] float, sorted ascending.
    Returns:
        int64 codes, same shape as x. Values outside the codebook range clip to the end levels.
    """
    mids = (codebook[1:] + codebook[:-1]) * 0.5
    return torch.bucketize(x.float().contiguous(), mids.float().contiguous())


def _inlier_mask(idx_HO: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[H, D] bool, True on channels that go through the codebook."""
    mask = torch.ones(idx_HO.shape[0], head_dim, dtype=torch.bool, device=idx_HO.device)
    if idx_HO.shape[1]:
        mask.scatter_(1, idx_HO.long(), False)
    return mask


def _value_scale(v_NHD: torch.Tensor, inlier_HD: torch.Tensor, scale_bits: int = 16) -> torch.Tensor:
    """[N, H] per-token scale: max-abs over inlier channels; fp16 (fp16-safe, never 0), or with scale_bits=8
    uint8 log2 codes (`encode_value_scale`)."""
    mag = torch.where(inlier_HD, v_NHD.float().abs(), torch.zeros((), device=v_NHD.device)).amax(dim=-1)
    if scale_bits == 8:
        return encode_value_scale(mag)
    # Rounding to fp16 first means quantize divides by exactly the scale dequantize multiplies by.
    s = mag.clamp(max=_FP16_MAX).to(torch.float16)
    return torch.where(s > 0, s, torch.ones_like(s))


@dataclass(kw_only=True, slots=True)
class QuantizedKV:
    """Quantized keys and values of N tokens of one layer, in per-token rows ready to write into pages.

    Fields: k_codes [N, H, Pk] / v_codes [N, H, P] uint8 (packed, module-docstring layout), v_scale [N, H] fp16
    (uint8 log2 codes when the profile's v_scale_bits is 8),
    k_outliers [N, H, Ok] fp16, v_outliers [N, H, Ov] fp16.
    """

    k_codes: torch.Tensor
    v_codes: torch.Tensor
    v_scale: torch.Tensor
    k_outliers: torch.Tensor
    v_outliers: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.k_codes.shape[0]


def _check_kv(x: torch.Tensor, profile: KVQuantProfile, name: str) -> None:
    if x.dim() != 3 or x.shape[1:] != (profile.num_kv_heads, profile.head_dim):
        raise ValueError(f"{name}.shape={tuple(x.shape)} must be [N, H={profile.num_kv_heads}, "
                         f"D={profile.head_dim}]")


def _gather_channels(x_NHD: torch.Tensor, idx_HO: torch.Tensor) -> torch.Tensor:
    """[N, H, O] fp16 values of the outlier channels."""
    idx = idx_HO.long().unsqueeze(0).expand(x_NHD.shape[0], -1, -1)
    return x_NHD.gather(2, idx).clamp(-_FP16_MAX, _FP16_MAX).to(torch.float16)


def _restore_channels(x_NHD: torch.Tensor, vals_NHO: torch.Tensor, idx_HO: torch.Tensor) -> torch.Tensor:
    if idx_HO.shape[1] == 0:
        return x_NHD
    idx = idx_HO.long().unsqueeze(0).expand(x_NHD.shape[0], -1, -1)
    return x_NHD.scatter(2, idx, vals_NHO.float())


def quantize_kv(k: torch.Tensor, v: torch.Tensor, profile: KVQuantProfile) -> QuantizedKV:
    """Quantize N tokens of keys (pre-RoPE, per channel) and values (per token) with a calibrated profile.

    Args:
        k: [N, H, D] float keys BEFORE RoPE.
        v: [N, H, D] float values.
        profile: the layer's KVQuantProfile (same device).
    Returns:
        QuantizedKV with k_codes [N, H, Pk] / v_codes [N, H, P] uint8, v_scale [N, H] fp16 (uint8 codes with
        v_scale_bits 8), k_outliers [N, H, Ok] fp16,
        v_outliers [N, H, Ov] fp16. Magnitudes above 65504 saturate in the fp16 side arrays.
    Raises:
        ValueError: k or v not [N, H, D] matching the profile.
    """
    _check_kv(k, profile, "k")
    _check_kv(v, profile, "v")
    kf, vf = k.float(), v.float()
    fast = _compiled_quantize(kf, vf, profile)
    if fast is not None:
        return fast
    k_norm = (kf - profile.k_zero) / profile.k_scale
    if profile.per_channel_keys:
        k_packed = pack_codes_var(_uniform_channel_codes(k_norm, profile.k_bits), profile.k_bits)
    else:
        k_packed = pack_codes(nearest_level(k_norm, profile.k_codebook), profile.bits)
    v_c = vf - profile.v_zero
    v_scale = _value_scale(v_c, _inlier_mask(profile.v_outlier_idx, profile.head_dim), profile.v_scale_bits)
    v_codes = nearest_level(v_c / value_scale_float(v_scale)[..., None], profile.v_codebook)
    return QuantizedKV(
        k_codes=k_packed,
        v_codes=pack_codes(v_codes, profile.bits),
        v_scale=v_scale,
        k_outliers=_gather_channels(kf, profile.k_outlier_idx),
        v_outliers=_gather_channels(vf, profile.v_outlier_idx),
    )


class ProfileTables(NamedTuple):
    """One layer profile's tensors as the compiled kernels read them (kernels/csrc/kv_quantize.c,
    kernels/csrc/quant_decode_attention.c): k_scale, k_zero, v_zero [H, D] fp32; the key / value codebooks [L]
    fp32 and their midpoints [L - 1] fp32 (as `nearest_level` computes them); key widths kw [H, D] int64 (`bits`
    everywhere with a codebook); grid 1 with per-channel key widths; outlier channels [H, O] int64; the value
    inlier mask [H, D] uint8."""

    k_scale: torch.Tensor
    k_zero: torch.Tensor
    v_zero: torch.Tensor
    k_cb: torch.Tensor
    v_cb: torch.Tensor
    kw: torch.Tensor
    grid: int
    k_oidx: torch.Tensor
    v_oidx: torch.Tensor
    k_mids: torch.Tensor
    v_mids: torch.Tensor
    v_inlier: torch.Tensor


_PROFILE_TABLES: dict[int, tuple] = {}  # id(profile) -> (profile, its ProfileTables)


def profile_tables(profile: KVQuantProfile) -> ProfileTables:
    """`ProfileTables` of a layer profile, made once per profile object and kept with it (CPU tensors)."""
    hit = _PROFILE_TABLES.get(id(profile))
    if hit is not None and hit[0] is profile:
        return hit[1]
    H, D = profile.num_kv_heads, profile.head_dim
    grid = profile.per_channel_keys
    kw = (profile.k_bits.to(torch.int64) if grid else torch.full((H, D), profile.bits, dtype=torch.int64)).contiguous()

    def f32(x):
        return x.to(torch.float32).contiguous()

    def mids(cb):
        return ((cb[1:] + cb[:-1]) * 0.5).float().contiguous()
    t = ProfileTables(f32(profile.k_scale), f32(profile.k_zero), f32(profile.v_zero), f32(profile.k_codebook),
                      f32(profile.v_codebook), kw, int(grid), profile.k_outlier_idx.to(torch.int64).contiguous(),
                      profile.v_outlier_idx.to(torch.int64).contiguous(), mids(profile.k_codebook),
                      mids(profile.v_codebook), _inlier_mask(profile.v_outlier_idx, D).to(torch.uint8).contiguous())
    if len(_PROFILE_TABLES) >= 1024:
        _PROFILE_TABLES.clear()
    _PROFILE_TABLES[id(profile)] = (profile, t)
    return t


def _compiled_quantize(kf: torch.Tensor, vf: torch.Tensor, profile: KVQuantProfile) -> "QuantizedKV | None":
    """`quantize_kv` in one compiled pass (kernels/csrc/kv_quantize.c, bit-identical), or None where it cannot run
    (no compiled kernels, tensors off the CPU, D > 1024)."""
    if kf.device.type != "cpu" or profile.k_scale.device.type != "cpu" or profile.head_dim > 1024:
        return None
    from kernels.cpu import _build  # here, not at import: kernels.cpu needs no part of this module
    from kernels.cpu._abi import QuantizeKVArgs

    lib = _build.lib()
    if lib is None:
        return None
    t = profile_tables(profile)
    k, v = kf.contiguous(), vf.contiguous()
    n, h, d = k.shape
    pk, p, ok, ov = profile.k_packed_bytes, profile.packed_bytes, t.k_oidx.shape[1], t.v_oidx.shape[1]
    eight = profile.v_scale_bits == 8
    out = QuantizedKV(k_codes=torch.empty(n, h, pk, dtype=torch.uint8), v_codes=torch.empty(n, h, p, dtype=torch.uint8),
                      v_scale=torch.empty(n, h, dtype=torch.uint8 if eight else torch.float16),
                      k_outliers=torch.empty(n, h, ok, dtype=torch.float16),
                      v_outliers=torch.empty(n, h, ov, dtype=torch.float16))
    codes = torch.empty(n, h, d, dtype=torch.int64)
    lut = value_scale_table() if eight else None
    lib.moeray_quantize_kv(ctypes.byref(QuantizeKVArgs(
        k.data_ptr(), v.data_ptr(), n, h, d, t.k_zero.data_ptr(), t.k_scale.data_ptr(), t.v_zero.data_ptr(),
        t.kw.data_ptr(), t.grid, t.k_mids.data_ptr(), t.k_mids.numel(), t.v_mids.data_ptr(), t.v_mids.numel(),
        profile.bits, t.v_inlier.data_ptr(), None if lut is None else lut.data_ptr(), t.k_oidx.data_ptr(), ok,
        t.v_oidx.data_ptr(), ov, out.k_codes.data_ptr(), pk, out.v_codes.data_ptr(), p,
        None if eight else out.v_scale.data_ptr(), out.v_scale.data_ptr() if eight else None,
        out.k_outliers.data_ptr(), out.v_outliers.data_ptr(), codes.data_ptr())))
    return out


def dequantize_keys(k_codes: torch.Tensor, k_outliers: torch.Tensor, profile: KVQuantProfile) -> torch.Tensor:
    """[N, H, Pk] uint8 codes + [N, H, Ok] fp16 outliers -> [N, H, D] fp32 keys (pre-RoPE)."""
    if profile.per_channel_keys:
        level = _uniform_channel_levels(unpack_codes_var(k_codes, profile.k_bits), profile.k_bits)
    else:
        level = profile.k_codebook[unpack_codes(k_codes, profile.bits, profile.head_dim)]
    k = level * profile.k_scale + profile.k_zero
    return _restore_channels(k, k_outliers, profile.k_outlier_idx)


def dequantize_values(v_codes: torch.Tensor, v_scale: torch.Tensor, v_outliers: torch.Tensor,
                      profile: KVQuantProfile) -> torch.Tensor:
    """[N, H, P] uint8 codes, [N, H] fp16 scale (or uint8 log2 codes), [N, H, Ov] fp16 outliers -> [N, H, D]
    fp32 values."""
    codes = unpack_codes(v_codes, profile.bits, profile.head_dim)
    v = profile.v_codebook[codes] * value_scale_float(v_scale)[..., None] + profile.v_zero
    return _restore_channels(v, v_outliers, profile.v_outlier_idx)


def dequantize_kv(q: QuantizedKV, profile: KVQuantProfile) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `quantize_kv`: returns (k [N, H, D] fp32 pre-RoPE, v [N, H, D] fp32)."""
    return (dequantize_keys(q.k_codes, q.k_outliers, profile),
            dequantize_values(q.v_codes, q.v_scale, q.v_outliers, profile))
