"""Paged attention over full-precision fp32 K/V on CPU: decode steps (kernels/csrc/decode_attention.c) and causal
prefills (kernels/csrc/prefill_attention.c).

Shape legend: T = query rows, B = decode sequences, H = query heads, Hkv = KV heads, Dh = head_dim,
S = block size (tokens), NB = cache blocks, MB = blocks per block table.

Per (sequence, head), straight from the paged K/V through the block table (as vLLM's paged_attention_v1 reads
it): no gather, mask or padding. The scores of a head's whole context are computed first (4 keys per horizontal
sum), then an exact-max softmax (vectorized exp, every weight <= 1, as the reference's) and the weighted sum of
V: no per-key rescaling or branch. A prefill is computed per KV head over a transposed copy of its keys, in tiles of
8 (token, query head) vectors with a register-blocked score micro-kernel, then the same exact-max softmax and a
blocked weighted sum of V (`bench/prefill_attention.py`: 2.97x the gather + SDPA path at 500 tokens, 1.76x at 2,000,
one thread). Each returns False when it cannot run; the caller then runs its PyTorch reference.
"""
from __future__ import annotations

import ctypes

import torch

from kernels import tuning
from kernels.cpu import _build, parallel
from kernels.cpu._abi import DecodeAttentionArgs, PrefillAttentionArgs, f32_cpu


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


def prefill_attention(q_nHD: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                      ctx: int, scale: float, out_nHD: torch.Tensor) -> bool:
    """Causal attention of one sequence's n new tokens (positions ctx - n .. ctx - 1) over its paged K/V, every
    key up to each token's own position (a cached prefix included); kernels/csrc/prefill_attention.c.

    A call of at least `tuning.PARALLEL_ROWS` tokens is split over the rank's compute threads (`parallel`): by KV
    head when the heads divide evenly, else by interleaved query tiles (the causal work stays balanced). The
    output is bit-identical for any split and any chunking of the prompt (each (token, head) is computed alone).

    Args:
        q_nHD: [n, H, Dh] fp32 queries (post-RoPE), contiguous. k_cache/v_cache: [NB, S, Hkv, Dh] fp32, contiguous,
            this sequence's K/V already written. block_table: int64 [>= ceil(ctx / S)]. ctx: tokens of context
            (n <= ctx). scale: softmax scale. out_nHD: [n, H, Dh] fp32, contiguous; written.
    Returns:
        True if the compiled kernel ran; False (nothing written) when it cannot (no AVX-512, other dtype or device,
        non-contiguous inputs): the caller then runs the PyTorch reference.
    Raises:
        MemoryError: the scratch (transposed keys, 8 rows of scores) could not be allocated.
    """
    if not f32_cpu(k_cache, v_cache) or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        return False
    return _run(q_nHD, k_cache, v_cache, block_table, None, None, None, 0, ctx, scale, out_nHD)


def mixed_prefill_attention(q_nHD: torch.Tensor, k_q_CHD: torch.Tensor, v_q_CHD: torch.Tensor, k_fp_CHD: torch.Tensor,
                            v_fp_CHD: torch.Tensor, quant_lo: int, quant_hi_n: torch.Tensor, scale: float,
                            out_nHD: torch.Tensor) -> bool:
    """Causal attention of a quantized cache's prefill, where query i (position C - n + i) reads key j dequantized
    (`k_q`, `v_q`) when quant_lo <= j < quant_hi_n[i], else in full precision (`k_fp`, `v_fp`): the contract of
    `actors.kv.quantized.mixed_causal_attention`, for queries at the last n positions of C keys, in the same kernel
    and split as `prefill_attention` (key j of both sources is scored only where some query of a tile reads it).

    Args:
        q_nHD: [n, H, Dh] fp32 (post-RoPE), contiguous. k_q/v_q, k_fp/v_fp: [C, Hkv, Dh] fp32, contiguous (post-RoPE
            keys). quant_lo: first key position ever read dequantized. quant_hi_n: int64 [n]. scale: softmax scale.
        out_nHD: [n, H, Dh] fp32, contiguous; written.
    Returns:
        True if the kernel ran; False (nothing written) when it cannot: the caller runs its PyTorch path.
    Raises:
        MemoryError: no scratch.
    """
    C = k_q_CHD.shape[0]
    ts = (k_q_CHD, v_q_CHD, k_fp_CHD, v_fp_CHD)
    if not f32_cpu(*ts) or not all(t.is_contiguous() and t.shape == k_q_CHD.shape for t in ts) or C == 0:
        return False
    hi = quant_hi_n.to(torch.int64).contiguous()
    return _run(q_nHD, k_q_CHD[None], v_q_CHD[None], torch.zeros(1, dtype=torch.int64), k_fp_CHD, v_fp_CHD, hi,
                quant_lo, C, scale, out_nHD)


def _run(q_nHD, kc, vc, block_table, kf, vf, hi, lo, ctx, scale, out_nHD) -> bool:
    """One prefill through moeray_prefill_attention, split over the compute threads (see `prefill_attention`)."""
    lib = _build.lib()
    if lib is None or not f32_cpu(q_nHD, out_nHD) or not (q_nHD.is_contiguous() and out_nHD.is_contiguous()):
        return False
    n, H, Dh = q_nHD.shape
    _, S, Hkv, _ = kc.shape
    if n == 0 or not 0 < n <= ctx or H % Hkv or kc.shape[-1] != Dh:
        return n == 0
    bt = block_table.to(torch.int64).contiguous()
    P = parallel.threads() if n >= tuning.PARALLEL_ROWS else 1
    if P > 1 and Hkv % P == 0:
        split = [(i * Hkv // P, (i + 1) * Hkv // P, 0, 1) for i in range(P)]
    else:
        split = [(0, Hkv, i, P) for i in range(P)]
    ptrs = [None if t is None else t.data_ptr() for t in (kf, vf, hi)]
    args = [PrefillAttentionArgs(q_nHD.data_ptr(), kc.data_ptr(), vc.data_ptr(), bt.data_ptr(), *ptrs,
                                 out_nHD.data_ptr(), n, ctx, H, Hkv, Dh, S, lo, g_lo, g_hi, part, parts, scale)
            for g_lo, g_hi, part, parts in split]
    rc = parallel.run_kernel(parallel.TASK_PREFILL_ATTENTION, args) if len(args) > 1 else \
        lib.moeray_prefill_attention(ctypes.byref(args[0]))
    if rc == -2:
        return False
    if rc:
        raise MemoryError(f"prefill_attention: no scratch for {ctx} keys")
    return True
