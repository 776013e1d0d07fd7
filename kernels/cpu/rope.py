"""Rotary position embedding of fp32 decode rows in one compiled call (kernels/csrc/rope.c).

Shape legend: T = tokens, H = heads, Dh = head_dim, P = table positions.

Replaces the three ops of `actors.model.layers.Rotary`'s PyTorch path (and its two table gathers per step) by
one call that reads the tables at each token's position. Returns None when it cannot run; the caller then runs
its PyTorch path (same result up to rounding: the kernel fuses the second product into an FMA).
"""
from __future__ import annotations

import torch

from kernels.cpu import _build
from kernels.cpu._abi import f32_cpu


def rope(x_THD: torch.Tensor, cos_PD: torch.Tensor, sin_signed_PD: torch.Tensor, positions_T: torch.Tensor
         ) -> torch.Tensor | None:
    """`x * cos[pos] + roll(x, Dh/2) * sin_signed[pos]` (HF rotate-half RoPE with the sign in the table).

    Args:
        x_THD: [T, H, Dh] fp32, unit stride along Dh (rows may be strided: a column slice of a fused q/k/v).
        cos_PD, sin_signed_PD: [P, Dh] fp32 contiguous (sin_signed: first half negated). positions_T: int64 [T].
    Returns:
        [T, H, Dh] fp32 contiguous, or None when the kernel cannot run (other dtypes or devices, odd Dh).
    Raises:
        IndexError: a position outside [0, P).
    """
    lib = _build.lib()
    if (lib is None or x_THD.dim() != 3 or not f32_cpu(x_THD, cos_PD, sin_signed_PD) or x_THD.stride(-1) != 1
            or x_THD.shape[-1] % 2 or positions_T.dtype is not torch.int64 or positions_T.device.type != "cpu"
            or not (cos_PD.is_contiguous() and sin_signed_PD.is_contiguous() and positions_T.is_contiguous())):
        return None
    T, H, Dh = x_THD.shape
    out = torch.empty(T, H, Dh, dtype=torch.float32)
    if T and lib.moeray_rope(x_THD.data_ptr(), x_THD.stride(0), x_THD.stride(1), cos_PD.data_ptr(),
                             sin_signed_PD.data_ptr(), positions_T.data_ptr(), cos_PD.shape[0], out.data_ptr(), T, H, Dh):
        raise IndexError(f"rope: a position is outside [0, {cos_PD.shape[0]})")
    return out
