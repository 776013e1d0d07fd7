"""Paged decode attention over full-precision fp32 K/V for CPU decode steps (kernels/csrc/decode_attention.c).

Shape legend: T = query rows, B = decode sequences, H = query heads, Hkv = KV heads, Dh = head_dim,
S = block size (tokens), NB = cache blocks, MB = blocks per block table.

Per (sequence, head), straight from the paged K/V through the block table (as vLLM's paged_attention_v1 reads
it): no gather, mask or padding. The scores of a head's whole context are computed first (4 keys per horizontal
sum), then an exact-max softmax (vectorized exp, every weight <= 1, as the reference's) and the weighted sum of
V: no per-key rescaling or branch. Returns False when it cannot run; the caller then runs its PyTorch reference.
"""
from __future__ import annotations

import ctypes

import torch

from kernels.cpu import _build
from kernels.cpu._abi import DecodeAttentionArgs, f32_cpu


def decode_attention(q_THD: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tokens_B: torch.Tensor,
                     block_tables_BM: torch.Tensor, context_lens_B: torch.Tensor, scale: float,
                     out_THD: torch.Tensor) -> bool:
    """Decode attention over paged full-precision K/V, per (sequence, head): scores, softmax, weighted V.

    Args:
        q_THD: [T, H, Dh] fp32 queries (post-RoPE), contiguous. k_cache/v_cache: [NB, S, Hkv, Dh] fp32
            (post-RoPE keys). tokens_B: int64 [B] query row of each decode sequence. block_tables_BM: int64 [B, MB].
        context_lens_B: int64 [B] tokens to attend (the new one included). scale: softmax scale.
        out_THD: [T, H, Dh] fp32; rows tokens_B are written.
    Returns:
        True if the compiled kernel ran; False (nothing written) when it cannot (other dtype or device,
        non-contiguous inputs): the caller then runs the PyTorch reference.
    Raises:
        MemoryError: the scores' scratch (max context floats) could not be allocated.
    """
    lib = _build.lib()
    if lib is None or not f32_cpu(q_THD, k_cache, v_cache, out_THD):
        return False
    if not (q_THD.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous() and out_THD.is_contiguous()):
        return False
    T, H, Dh = q_THD.shape
    NB, S, Hkv, _ = k_cache.shape
    bt = block_tables_BM.to(torch.int64).contiguous()
    ctx = context_lens_B.to(torch.int64).contiguous()
    tok = tokens_B.to(torch.int64).contiguous()
    B = tok.numel()
    if B and lib.moeray_decode_attention(ctypes.byref(DecodeAttentionArgs(
            q_THD.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), bt.data_ptr(), bt.shape[1], ctx.data_ptr(),
            tok.data_ptr(), out_THD.data_ptr(), B, H, Hkv, Dh, S, scale))):
        raise MemoryError(f"decode_attention: no scratch for {int(ctx.max())} scores")
    return True
