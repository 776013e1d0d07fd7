"""Dense building blocks of the decoder: RMSNorm, rotary embedding, MLP, the attention block in compiled calls.

Shape legend: T = tokens in the step (all sequences flattened), D = hidden, H = heads, Dh = head_dim.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.cpu import linear, rms_norm, rope  # noqa: F401 - rms_norm is part of this module's API
from kernels.cpu.attention_block import attention_halves_apply, attention_in, attention_out
from kernels.cpu.attention_block import attention_block as attention_block_call
from kernels.rope import rope_tables


class Rotary:
    """Rotary position embedding (RoPE), default type, rotate-half convention of HF Llama/Qwen.

    Caches cos/sin tables [max_pos, Dh] in the compute dtype; `apply(x [T, H, Dh], positions [T])`.
    rotate_half(x) * sin is computed as roll(x, Dh/2) * [-sin_a, sin_b] (the sign folded into the table),
    and the last positions tensor's rows are reused, so the q and k of every layer in one step gather the
    tables once (decode is bound by per-op overhead). fp32 on CPU with the compiled kernels: one call
    (`kernels.cpu.rope`) that reads the tables at each position, no gather. `cos` / `sin_signed` [max_pos, Dh]: the
    tables those kernels read (sin_signed: the first half negated).
    """

    def __init__(self, head_dim: int, theta: float, max_pos: int, dtype: torch.dtype, device=None):
        cos, sin = rope_tables(max_pos, head_dim, base=theta, device=device)  # [P, Dh] fp32
        self.cos = cos.to(dtype)
        self.sin = sin.to(dtype)
        self.half = head_dim // 2
        self.sin_signed = torch.cat([-sin[:, : self.half], sin[:, self.half :]], dim=1).to(dtype)
        self._last: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (positions, cos, sin_signed)

    def tables(self, positions_T: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos [T, 1, Dh], signed sin [T, 1, Dh]) at `positions_T`; the same tensor object is looked up once."""
        last = self._last
        if last is not None and last[0] is positions_T:
            return last[1], last[2]
        cos = self.cos.index_select(0, positions_T).unsqueeze(1)
        sin = self.sin_signed.index_select(0, positions_T).unsqueeze(1)
        self._last = (positions_T, cos, sin)
        return cos, sin

    def apply(self, x_THD: torch.Tensor, positions_T: torch.Tensor) -> torch.Tensor:
        """RoPE of x [T, H, Dh] at positions [T] (int64): [T, H, Dh] in x's dtype.

        Raises:
            IndexError: a position beyond the tables (max_pos)."""
        out = rope(x_THD, self.cos, self.sin_signed, positions_T)
        if out is not None:
            return out
        cos, sin = self.tables(positions_T)
        return torch.addcmul(x_THD * cos, x_THD.roll(self.half, -1), sin)


def swiglu_mlp(x_TD: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """down(silu(gate x) * up x); w_gate_up [2I, D] (gate rows first), w_down [D, I]."""
    g, u = linear(x_TD, w_gate_up).chunk(2, dim=-1)
    return linear(F.silu(g) * u, w_down)


def attention_block(cfg, w: dict[str, torch.Tensor], l: int, rotary: Rotary, scale: float, h_TD: torch.Tensor,
                    delta_TD: torch.Tensor | None, positions_T: torch.Tensor, cache, meta
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Layer l's input (the previous layer's output `delta` [T, D] added to the residual stream h [T, D], then the
    input norm), attention, residual add and post-attention norm: (h, x), each [T, D], bit-identical to the residual
    add and input norm, `MoEModel.attention` and `rms_norm(..., residual=h)` (they run the same kernels). A
    decode-only step over full-precision pages (`KVCache.fp_pages`) is one compiled call
    (`kernels.cpu.attention_block`); any other cache or step takes its two halves around the cache's own `attend`
    (`attention_in`, `attention_out`). None where neither applies (q/k norms or clipping, other dtypes or devices,
    rows split over compute threads): nothing was computed and the caller goes op by op.

    Args: cfg: the `ModelConfig`; w: the model's weights (fused `qkv_w`, see `MoEModel`); rotary: its `Rotary`;
    scale: the softmax scale; cache, meta: the step's `KVCache` and `AttentionMetadata`.
    """
    if cfg.qk_norm != "none" or cfg.clip_qkv is not None:
        return None
    p, eps = f"layers.{l}.", cfg.rms_norm_eps
    weights = (w[p + "input_norm"], w[p + "qkv_w"], w.get(p + "qkv_b"), w[p + "o_w"], w.get(p + "o_b"),
               w[p + "post_norm"])
    pages = None if meta.prefills else cache.fp_pages(l)
    if pages is not None:
        hx = attention_block_call(h_TD, delta_TD, *weights, eps, rotary.cos, rotary.sin_signed, positions_T, *pages,
                                  meta.slot_mapping, meta.decode_tokens, meta.decode_block_tables,
                                  meta.decode_context_lens, cfg.num_heads, scale)
        if hx is not None:
            return hx
    if not attention_halves_apply(h_TD, delta_TD, *weights, rotary.cos, rotary.sin_signed, positions_T, cfg.num_heads,
                                  cfg.num_kv_heads):
        return None
    h, q, k, v = attention_in(h_TD, delta_TD, *weights[:3], eps, rotary.cos, rotary.sin_signed, positions_T,
                              cfg.num_heads, cfg.num_kv_heads)
    o = cache.attend(l, q, k, v, positions_T, meta, rotary, scale)  # k before RoPE
    return attention_out(h, o.reshape(o.shape[0], -1), *weights[3:], eps)
