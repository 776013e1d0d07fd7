"""Paged decode attention over quantized KV blocks (KVQuant, arXiv 2401.18079): the contract and its reference.

One decode step for B sequences: each query head attends, in this order of positions, to
  1. the full-precision sink prefix: positions [0, sink_lens[b]), dense post-RoPE K and V;
  2. the sealed quantized blocks: positions sink_lens[b] + [0, context_lens[b]); token t lives in block
     block_tables[b, t // S] at slot t % S of `KVPages` (layout in kernels/kv_pages.py). Keys are stored
     before RoPE, so they are dequantized, then rotated at their sequence position;
  3. the full-precision unsealed tail (the block being filled): tail_lens[b] tokens, dense post-RoPE K and V.
Softmax runs over the union of the three. A sequence with no token at all gets a zero output.

RoPE follows HF Llama/Qwen (rotate-half, `kernels.rope`): `x * cos[pos] + rotate_half(x) * sin[pos]`,
`rotate_half(x) = cat(-x[D/2:], x[:D/2])`, cos/sin [max_pos, D].

`paged_decode_attention_ref` dequantizes one sequence's blocks at a time with the PyTorch functions of
kernels.kv_quant. `kernels.paged_attention_triton.paged_decode_attention_triton` is the fast path with the
same signature and result.

Shape legend: B = sequences, Hq = query heads, H = KV heads, D = head_dim, S = block_size,
NB = blocks in the pool, M = max blocks per sequence, Ns = sink tokens, Nt = tail tokens, Pmax = max_pos,
P = packed bytes per token and head, Ok / Ov = outlier channels per head.
"""
from __future__ import annotations

import torch

from kernels.kv_pages import KVPages
from kernels.kv_profile import KVQuantProfile
from kernels.kv_quant import dequantize_keys, dequantize_values
from kernels.rope import apply_rope


def _validate(q, pages: KVPages, block_tables, context_lens, profile: KVQuantProfile, cos, sin,
              sink_k, sink_v, sink_lens, tail_k, tail_v, tail_lens):
    """Shape checks shared by both implementations; returns (B, Hq, H, D)."""
    if q.dim() != 3:
        raise ValueError(f"q.shape={tuple(q.shape)} must be [B, Hq, D]")
    b, hq, d = q.shape
    h = profile.num_kv_heads
    if d != profile.head_dim:
        raise ValueError(f"q head_dim={d} != profile.head_dim={profile.head_dim}")
    if hq % h:
        raise ValueError(f"query heads Hq={hq} must be a multiple of KV heads H={h}")
    if pages.k_codes.shape[1] != h or pages.k_codes.shape[3] != profile.k_packed_bytes:
        raise ValueError(f"pages.k_codes.shape={tuple(pages.k_codes.shape)} does not match the profile "
                         f"(H={h}, Pk={profile.k_packed_bytes})")
    if pages.v_codes.shape[3] != profile.packed_bytes:
        raise ValueError(f"pages.v_codes.shape={tuple(pages.v_codes.shape)} does not match the profile "
                         f"(P={profile.packed_bytes})")
    if pages.k_outliers.shape[-1] != profile.n_outlier_k or pages.v_outliers.shape[-1] != profile.n_outlier_v:
        raise ValueError("pages outlier widths do not match profile.k_outlier_idx / v_outlier_idx")
    if block_tables.dim() != 2 or block_tables.shape[0] != b:
        raise ValueError(f"block_tables.shape={tuple(block_tables.shape)} must be [B={b}, M]")
    if context_lens.shape != (b,):
        raise ValueError(f"context_lens.shape={tuple(context_lens.shape)} must be [B={b}]")
    if cos.dim() != 2 or cos.shape[1] != d or sin.shape != cos.shape:
        raise ValueError(f"cos.shape={tuple(cos.shape)}, sin.shape={tuple(sin.shape)} must be [max_pos, D={d}]")
    for name, k, v, lens in (("sink", sink_k, sink_v, sink_lens), ("tail", tail_k, tail_v, tail_lens)):
        if (k is None) != (v is None):
            raise ValueError(f"{name}_k and {name}_v must be given together")
        if k is None:
            if lens is not None:
                raise ValueError(f"{name}_lens given without {name}_k / {name}_v")
            continue
        if k.dim() != 4 or k.shape[0] != b or k.shape[2:] != (h, d) or v.shape != k.shape:
            raise ValueError(f"{name}_k.shape={tuple(k.shape)}, {name}_v.shape={tuple(v.shape)} must be "
                             f"[B={b}, N, H={h}, D={d}]")
        if lens is not None and lens.shape != (b,):
            raise ValueError(f"{name}_lens.shape={tuple(lens.shape)} must be [B={b}]")
    if tail_k is not None and tail_lens is None:
        raise ValueError("tail_lens is required with tail_k / tail_v")
    return b, hq, h, d


def paged_decode_attention_ref(
    q: torch.Tensor,
    pages: KVPages,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    profile: KVQuantProfile,
    cos: torch.Tensor,
    sin: torch.Tensor,
    scale: float,
    *,
    sink_k: torch.Tensor | None = None,
    sink_v: torch.Tensor | None = None,
    sink_lens: torch.Tensor | None = None,
    tail_k: torch.Tensor | None = None,
    tail_v: torch.Tensor | None = None,
    tail_lens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention over sink + quantized paged blocks + tail, in PyTorch (the contract's reference).

    Args:
        q: [B, Hq, D] fp32/fp16/bf16, queries already rotated by RoPE.
        pages: KVPages of the layer (k_codes/v_codes [NB, H, S, P] uint8, v_scale [NB, S, H] fp16 or uint8
            log2 codes (v_scale_bits 8), k_outliers [NB, S, H, Ok] fp16, v_outliers [NB, S, H, Ov] fp16); keys
            quantized BEFORE RoPE.
        block_tables: [B, M] int32 block ids; entries past ceil(context_lens[b] / S) are ignored.
        context_lens: [B] int32, sealed quantized tokens per sequence.
        profile: the layer's KVQuantProfile.
        cos, sin: [Pmax, D] fp32 RoPE tables; every quantized position sink_lens[b] + t must be < Pmax.
        scale: softmax scale (usually D ** -0.5).
        sink_k, sink_v: optional [B, Ns, H, D] full-precision sink prefix (K post-RoPE).
        sink_lens: optional [B] int32 valid sink tokens (default Ns when sinks are given, else 0).
        tail_k, tail_v: optional [B, Nt, H, D] full-precision unsealed tail (K post-RoPE).
        tail_lens: [B] int32 valid tail tokens, required with tail_k.
    Returns:
        [B, Hq, D] in q.dtype; zeros for a sequence with no tokens.
    Raises:
        ValueError: naming the argument whose shape is inconsistent, Hq not a multiple of H, or a position
        beyond the RoPE table (reference only; the kernel does not synchronise to check).
    """
    b, hq, h, d = _validate(q, pages, block_tables, context_lens, profile, cos, sin,
                            sink_k, sink_v, sink_lens, tail_k, tail_v, tail_lens)
    group = hq // h
    s = pages.block_size
    out = torch.zeros(b, hq, d, dtype=torch.float32, device=q.device)
    for i in range(b):
        ks, vs = [], []
        n_sink = 0
        if sink_k is not None:
            n_sink = int(sink_lens[i]) if sink_lens is not None else sink_k.shape[1]
            ks.append(sink_k[i, :n_sink].float())
            vs.append(sink_v[i, :n_sink].float())
        ctx = int(context_lens[i])
        if ctx:
            if n_sink + ctx > cos.shape[0]:
                raise ValueError(f"sequence {i}: position {n_sink + ctx - 1} exceeds the RoPE table "
                                 f"(max_pos={cos.shape[0]})")
            n_blk = -(-ctx // s)
            blocks = block_tables[i, :n_blk].long()
            k_codes = pages.k_codes[blocks].transpose(1, 2).reshape(n_blk * s, h, -1)[:ctx]  # [ctx, H, P]
            v_codes = pages.v_codes[blocks].transpose(1, 2).reshape(n_blk * s, h, -1)[:ctx]
            k_out = pages.k_outliers[blocks].reshape(n_blk * s, h, -1)[:ctx]
            v_out = pages.v_outliers[blocks].reshape(n_blk * s, h, -1)[:ctx]
            v_scale = pages.v_scale[blocks].reshape(n_blk * s, h)[:ctx]
            pos = torch.arange(n_sink, n_sink + ctx, device=q.device)
            ks.append(apply_rope(dequantize_keys(k_codes, k_out, profile), cos[pos].float(), sin[pos].float()))
            vs.append(dequantize_values(v_codes, v_scale, v_out, profile))
        if tail_k is not None:
            n_tail = int(tail_lens[i])
            ks.append(tail_k[i, :n_tail].float())
            vs.append(tail_v[i, :n_tail].float())
        k_all = torch.cat(ks) if ks else q.new_zeros(0, h, d, dtype=torch.float32)  # [T, H, D]
        v_all = torch.cat(vs) if vs else q.new_zeros(0, h, d, dtype=torch.float32)
        if k_all.shape[0] == 0:
            continue
        q_GhD = q[i].float().reshape(h, group, d)
        scores = torch.einsum("hgd,thd->hgt", q_GhD, k_all) * scale
        probs = scores.softmax(dim=-1)
        out[i] = torch.einsum("hgt,thd->hgd", probs, v_all).reshape(hq, d)
    return out.to(q.dtype)
