"""Rotary position embedding (RoPE) tables and rotation, HF Llama/Qwen convention (rotate-half).

`x * cos[pos] + rotate_half(x) * sin[pos]`, `rotate_half(x) = cat(-x[D/2:], x[:D/2])`, cos/sin [max_pos, D]
with the half-frequencies repeated.

Shape legend: N = tokens, H = heads, D = head_dim.
"""
from __future__ import annotations

import torch


def rope_tables(max_pos: int, head_dim: int, *, base: float = 10000.0,
                device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """HF-style RoPE tables: (cos, sin), each [max_pos, D] fp32, with the half-frequencies repeated.

    Raises: ValueError if head_dim is odd or max_pos < 1.
    """
    if head_dim % 2 or max_pos < 1:
        raise ValueError(f"head_dim={head_dim} must be even and max_pos={max_pos} >= 1")
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32, device=device), inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x [..., N, H, D]; cos, sin [N, D] (already indexed by position). Returns fp32."""
    x = x.float()
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rot * sin[:, None, :]
