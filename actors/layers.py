"""Dense building blocks of the decoder: RMSNorm, rotary embedding, MLP.

Shape legend: T = tokens in the step (all sequences flattened), D = hidden, H = heads, Dh = head_dim.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.paged_attention import rope_tables


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in fp32 and cast back (as transformers does)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


class Rotary:
    """Rotary position embedding (RoPE), default type, rotate-half convention of HF Llama/Qwen.

    Caches cos/sin tables [max_pos, Dh] in fp32; `apply(x [T, H, Dh], positions [T])`.
    """

    def __init__(self, head_dim: int, theta: float, max_pos: int, dtype: torch.dtype, device=None):
        cos, sin = rope_tables(max_pos, head_dim, base=theta, device=device)  # [P, Dh] fp32
        self.cos = cos.to(dtype)
        self.sin = sin.to(dtype)
        self.half = head_dim // 2

    def apply(self, x_THD: torch.Tensor, positions_T: torch.Tensor) -> torch.Tensor:
        cos = self.cos[positions_T].unsqueeze(1)  # [T, 1, Dh]
        sin = self.sin[positions_T].unsqueeze(1)
        x1, x2 = x_THD[..., : self.half], x_THD[..., self.half :]
        return x_THD * cos + torch.cat([-x2, x1], dim=-1) * sin


def swiglu_mlp(x_TD: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """down(silu(gate x) * up x); w_gate_up [2I, D] (gate rows first), w_down [D, I]."""
    g, u = F.linear(x_TD, w_gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(g) * u, w_down)
