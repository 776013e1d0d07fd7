"""KIVI-style uniform KV quantization (KIVI, arXiv 2402.02750), the baseline bench/kv_quality.py compares against.

Keys per channel over groups of G tokens, values per token over groups of Gv channels, each group with an
fp16 scale and zero; codes of 1-4 bits packed like `kernels.kv_pack.pack_codes`, of 5-8 bits one byte each
(counted at their width, as a packed format would store them: the fidelity ladder of bench/kv_quality.py).
Benchmark and test code only.

Shape legend: N = tokens, H = KV heads, D = head_dim, P = packed bytes per token and head (D * bits / 8),
G = key group size (tokens), Gv = value group size (channels).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.kv_pack import SUPPORTED_BITS, _check_bits, pack_codes, packed_bytes, unpack_codes
from kernels.kv_quant import _FP16_MAX

MAX_PACKED_BITS = max(SUPPORTED_BITS)  # wider codes (up to 8 bits) are kept one per byte


@dataclass(kw_only=True, slots=True)
class KiviQuantized:
    """KIVI-style uniform quantized K/V (arXiv 2402.02750), for benchmark comparison.

    Fields (N tokens, G = group_size, Gv = v_group_size): k_codes / v_codes [N, H, P] uint8 packed like
    `pack_codes` (bits <= 4), or [N, H, D] uint8, one code per byte (bits 5-8); k_scale / k_zero [N / G, H, D] fp16 (per channel, one group = G consecutive tokens);
    v_scale / v_zero [N, H, D / Gv] fp16 (per token, one group = Gv consecutive channels); bits; group_size;
    v_group_size.
    """

    bits: int
    group_size: int
    v_group_size: int
    k_codes: torch.Tensor
    k_scale: torch.Tensor
    k_zero: torch.Tensor
    v_codes: torch.Tensor
    v_scale: torch.Tensor
    v_zero: torch.Tensor

    def effective_bits(self) -> float:
        """Bits per K/V element counting codes, scales and zeros."""
        n, h, p = self.k_codes.shape
        d = p * 8 // self.bits if self.bits <= MAX_PACKED_BITS else p
        meta = sum(t.numel() * t.element_size() for t in (self.k_scale, self.k_zero, self.v_scale, self.v_zero))
        return (meta * 8.0 + 2 * n * h * d * self.bits) / (n * 2 * h * d)


def _uniform_group(x: torch.Tensor, bits: int, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric uniform quantization with min/max over `dim`; returns codes, fp16 scale, fp16 zero."""
    lo = x.amin(dim=dim, keepdim=True)
    hi = x.amax(dim=dim, keepdim=True)
    zero = lo.clamp(-_FP16_MAX, _FP16_MAX).to(torch.float16)
    scale = ((hi - lo) / ((1 << bits) - 1)).clamp(max=_FP16_MAX).to(torch.float16)
    s = torch.where(scale > 0, scale.float(), torch.ones_like(scale, dtype=torch.float32))
    codes = torch.round((x - zero.float()) / s).clamp(0, (1 << bits) - 1).to(torch.int64)
    return codes, scale, zero


def kivi_quantize(k: torch.Tensor, v: torch.Tensor, *, bits: int, group_size: int = 32,
                  v_group_size: int | None = None) -> KiviQuantized:
    """Uniform KIVI quantization: keys per channel over groups of `group_size` tokens, values per token over
    groups of `v_group_size` channels, each group with fp16 scale and zero (KIVI, arXiv 2402.02750).

    Effective bits = bits + 16 / group_size (K) averaged with bits + 16 / v_group_size (V); larger groups
    are how the baseline is brought to a given bit budget (e.g. G = 128 tokens, Gv = 64 channels: bits + 0.375).

    Args:
        k, v: [N, H, D] float (KIVI quantizes post-RoPE keys; either works here).
        bits: 1 to 8 bits per element.
        group_size: G tokens per key group; N must be a multiple of G (KIVI keeps the remainder in full
            precision).
        v_group_size: Gv channels per value group (default G); D must be a multiple of Gv.
    Returns:
        KiviQuantized.
    Raises:
        ValueError: shape mismatch, unsupported bits, a group size < 1, N not a multiple of group_size or D
            not a multiple of v_group_size.
    """
    if bits > MAX_PACKED_BITS:
        if bits > 8:
            raise ValueError(f"bits={bits} is not supported; choose 1 to 8")
    else:
        _check_bits(bits)
    if k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"k.shape={tuple(k.shape)} and v.shape={tuple(v.shape)} must both be [N, H, D]")
    n, h, d = k.shape
    gv = group_size if v_group_size is None else v_group_size
    if group_size < 1 or n % group_size:
        raise ValueError(f"group_size={group_size} must be >= 1 and divide N={n}")
    if gv < 1 or d % gv:
        raise ValueError(f"v_group_size={gv} must be >= 1 and divide D={d}")
    if bits <= MAX_PACKED_BITS:
        packed_bytes(d, bits)
    kg = k.float().reshape(n // group_size, group_size, h, d)
    k_codes, k_scale, k_zero = _uniform_group(kg, bits, dim=1)
    vg = v.float().reshape(n, h, d // gv, gv)
    v_codes, v_scale, v_zero = _uniform_group(vg, bits, dim=3)
    return KiviQuantized(
        bits=bits, group_size=group_size, v_group_size=gv,
        k_codes=_pack(k_codes.reshape(n, h, d), bits), k_scale=k_scale.squeeze(1), k_zero=k_zero.squeeze(1),
        v_codes=_pack(v_codes.reshape(n, h, d), bits), v_scale=v_scale.squeeze(3), v_zero=v_zero.squeeze(3),
    )


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[N, H, D] int64 codes -> packed [N, H, P] uint8 (bits <= 4) or one byte per code."""
    return pack_codes(codes, bits) if bits <= MAX_PACKED_BITS else codes.to(torch.uint8)


def _unpack(codes: torch.Tensor, bits: int, d: int) -> torch.Tensor:
    return unpack_codes(codes, bits, d) if bits <= MAX_PACKED_BITS else codes


def kivi_dequantize(q: KiviQuantized) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `kivi_quantize`: returns (k, v), each [N, H, D] fp32."""
    n, h, p = q.k_codes.shape
    d = p * 8 // q.bits if q.bits <= MAX_PACKED_BITS else p
    g, gv = q.group_size, q.v_group_size
    kc = _unpack(q.k_codes, q.bits, d).float().reshape(n // g, g, h, d)
    k = kc * q.k_scale.float().unsqueeze(1) + q.k_zero.float().unsqueeze(1)
    vc = _unpack(q.v_codes, q.bits, d).float().reshape(n, h, d // gv, gv)
    v = vc * q.v_scale.float().unsqueeze(3) + q.v_zero.float().unsqueeze(3)
    return k.reshape(n, h, d), v.reshape(n, h, d)
