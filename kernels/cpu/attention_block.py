"""The attention half of a decoder layer for a decode step in one compiled call (kernels/csrc/attention_block.c).

Shape legend: T = tokens of the step (one per decode sequence), D = hidden, H = query heads, Hkv = KV heads,
Dh = head_dim, N = (H + 2 Hkv) Dh, NB = cache blocks, S = block size, MB = blocks per block table, P = RoPE positions.

What the call does is what `MoEModel.forward` does around `MoEModel.attention` on that step with the compiled
kernels (the previous layer's output added to the residual stream and the input RMSNorm, fused q/k/v linear, RoPE of
q and k, the K / V cache write, paged decode attention, the output linear, residual add and post-attention RMSNorm),
through the same kernels in the same order, so the result is bit-identical; it only drops the Python between them.
It applies where each of those steps would take its compiled kernel on one thread: fp32 activations on CPU, bf16
weights, fp32 post-RoPE K / V pages, a decode-only step whose rows are not split over compute threads
(`kernels.cpu.parallel.row_ranges`). Elsewhere `attention_block` returns None and the caller runs the layer op by op.

A cache that attends itself (the quantized one), or a step with prefills, takes the block's two halves apart:
`attention_in` (residual add, input norm, q/k/v linear, RoPE of q) and `attention_out` (output linear, residual add,
post-attention norm), with the cache's `attend` between them; also bit-identical to the op-by-op path.
"""
from __future__ import annotations

import ctypes

import torch

from kernels import tuning
from kernels.cpu import _build
from kernels.cpu._abi import AttentionBlockArgs, f32_cpu
from kernels.cpu.packing import panels
from kernels.cpu.parallel import row_ranges

_I64 = torch.int64


def _bf16_matrix(w: torch.Tensor) -> bool:
    return w.dtype is torch.bfloat16 and w.dim() == 2 and w.is_contiguous() and w.device.type == "cpu"


def _bias_ok(b: torch.Tensor | None, n: int) -> bool:
    return b is None or (f32_cpu(b) and b.shape == (n,) and b.is_contiguous())


def _i64(*ts: torch.Tensor) -> bool:
    for t in ts:
        if t.dtype is not _I64 or t.device.type != "cpu" or not t.is_contiguous():
            return False
    return True


def _weights_ok(D: int, N: int, qd: int, w_qkv, b_qkv, w_o, b_o, in_norm_w, norm_w) -> bool:
    return (_bf16_matrix(w_qkv) and _bf16_matrix(w_o) and w_qkv.shape == (N, D) and w_o.shape == (D, qd)
            and _bias_ok(b_qkv, N) and _bias_ok(b_o, D) and f32_cpu(in_norm_w, norm_w) and in_norm_w.shape == (D,)
            and norm_w.shape == (D,) and in_norm_w.is_contiguous() and norm_w.is_contiguous())


def _rows_ok(h_TD: torch.Tensor, delta_TD: torch.Tensor | None) -> bool:
    """fp32 contiguous [T, D] rows (and delta alike) that one thread runs: what both halves need of their input."""
    if h_TD.dim() != 2 or not f32_cpu(h_TD) or not h_TD.is_contiguous():
        return False
    if delta_TD is not None and not (f32_cpu(delta_TD) and delta_TD.shape == h_TD.shape and delta_TD.is_contiguous()):
        return False
    T = h_TD.shape[0]
    return 0 < T <= tuning.MAX_GEMM_ROWS and len(row_ranges(T)) == 1


def _tables_ok(cos_PD: torch.Tensor, sin_signed_PD: torch.Tensor, positions_T: torch.Tensor, T: int) -> bool:
    """fp32 contiguous RoPE tables of one shape and T int64 positions."""
    return (cos_PD.dim() == 2 and f32_cpu(cos_PD, sin_signed_PD) and cos_PD.is_contiguous()
            and sin_signed_PD.is_contiguous() and sin_signed_PD.shape == cos_PD.shape and _i64(positions_T)
            and positions_T.shape == (T,))


def attention_block(h_TD: torch.Tensor, delta_TD: torch.Tensor | None, in_norm_w: torch.Tensor, w_qkv: torch.Tensor,
                    b_qkv: torch.Tensor | None, w_o: torch.Tensor, b_o: torch.Tensor | None, norm_w: torch.Tensor,
                    eps: float, cos_PD: torch.Tensor, sin_signed_PD: torch.Tensor, positions_T: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, slots_T: torch.Tensor, tokens_B: torch.Tensor,
                    block_tables_BM: torch.Tensor, context_lens_B: torch.Tensor, num_heads: int, scale: float
                    ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One decode step's attention block of a layer: (h_out, x_out), each [T, D] fp32.

    With h' = h + delta (h without delta) and x = RMSNorm(h') * in_norm_w: h_out = h' + (attention(RoPE(q)) Wo^T +
    b_o), x_out = RMSNorm(h_out) * norm_w, where q, k, v = x Wqkv^T + b_qkv; RoPE(k) and v are written to the cache
    rows `slots_T` first (each token sees itself), as `actors.kv.paged.PagedKVCache.attend` does.

    Args:
        h_TD: [T, D] fp32 contiguous, the residual stream. delta_TD: [T, D] fp32 contiguous, the previous layer's
            MLP / MoE output not yet added to it, or None (the first layer). in_norm_w: [D] fp32, the input norm's
            weight.
        w_qkv: [N, D] bf16 (q rows, then k, then v); b_qkv: [N] fp32 or None. w_o: [D, H Dh] bf16; b_o: [D] or None.
        norm_w: [D] fp32, the post-attention norm's weight; eps: both norms' epsilon.
        cos_PD, sin_signed_PD: [P, Dh] fp32 contiguous RoPE tables (`actors.model.layers.Rotary`: the sine's first
            half negated). positions_T: [T] int64.
        k_cache, v_cache: [NB, S, Hkv, Dh] fp32 contiguous, post-RoPE keys. slots_T: [T] int64 flat slots.
        tokens_B: [B] int64 query row of each decode sequence (B == T). block_tables_BM: [B, MB] int64;
        context_lens_B: [B] int64 tokens to attend, the new one included.
        num_heads: H. scale: softmax scale.
    Returns:
        (h_out, x_out), or None when the compiled call does not apply (nothing written; see the module docstring).
    Raises:
        IndexError: a position outside the RoPE tables, or a slot outside the cache (nothing written).
        MemoryError: the kernel's scratch could not be allocated.
    """
    lib = _build.lib()
    if lib is None or not _rows_ok(h_TD, delta_TD) or k_cache.dim() != 4:
        return None
    T, D = h_TD.shape
    NB, S, Hkv, Dh = k_cache.shape
    qd = num_heads * Dh
    if not (tokens_B.numel() == T and _weights_ok(D, qd + 2 * Hkv * Dh, qd, w_qkv, b_qkv, w_o, b_o, in_norm_w, norm_w)
            and _tables_ok(cos_PD, sin_signed_PD, positions_T, T) and cos_PD.shape[1] == Dh
            and f32_cpu(k_cache, v_cache) and k_cache.is_contiguous() and v_cache.is_contiguous()
            and v_cache.shape == k_cache.shape and block_tables_BM.dim() == 2
            and _i64(slots_T, tokens_B, block_tables_BM, context_lens_B)):
        return None
    h_out, x_out = torch.empty(T, D), torch.empty(T, D)
    p_qkv, p_o = panels(w_qkv), panels(w_o)  # the packed copy `linear` would use (same policy, same kernel)
    rc = lib.moeray_attention_block(ctypes.byref(AttentionBlockArgs(
        h_TD.data_ptr(), None if delta_TD is None else delta_TD.data_ptr(), in_norm_w.data_ptr(), h_out.data_ptr(),
        x_out.data_ptr(), T, D,
        w_qkv.data_ptr(), None if p_qkv is None else p_qkv.data_ptr(), None if b_qkv is None else b_qkv.data_ptr(),
        w_o.data_ptr(), None if p_o is None else p_o.data_ptr(), None if b_o is None else b_o.data_ptr(),
        norm_w.data_ptr(), eps, cos_PD.data_ptr(), sin_signed_PD.data_ptr(), cos_PD.shape[0], positions_T.data_ptr(),
        k_cache.data_ptr(), v_cache.data_ptr(), NB * S, slots_T.data_ptr(), block_tables_BM.data_ptr(),
        block_tables_BM.shape[1], context_lens_B.data_ptr(), tokens_B.data_ptr(), T, num_heads, Hkv, Dh, S, scale)))
    if rc == -2:
        raise IndexError(f"attention_block: a position is outside the RoPE tables [0, {cos_PD.shape[0]})")
    if rc == -3:
        raise IndexError(f"attention_block: a slot is outside the cache [0, {NB * S})")
    if rc:
        raise MemoryError(f"attention_block: no scratch for {T} rows")
    return h_out, x_out


def attention_halves_apply(h_TD: torch.Tensor, delta_TD: torch.Tensor | None, in_norm_w: torch.Tensor,
                           w_qkv: torch.Tensor, b_qkv: torch.Tensor | None, w_o: torch.Tensor, b_o: torch.Tensor | None,
                           norm_w: torch.Tensor, cos_PD: torch.Tensor, sin_signed_PD: torch.Tensor,
                           positions_T: torch.Tensor, num_heads: int, num_kv_heads: int) -> bool:
    """Whether `attention_in` and `attention_out` both run for these inputs (checked before the cache attends, so that
    the second half never falls back after the first ran). Arguments as `attention_block`."""
    if _build.lib() is None or not _rows_ok(h_TD, delta_TD):
        return False
    T, D = h_TD.shape
    Dh = cos_PD.shape[1] if cos_PD.dim() == 2 else 0
    qd = num_heads * Dh
    return (Dh > 0 and _weights_ok(D, qd + 2 * num_kv_heads * Dh, qd, w_qkv, b_qkv, w_o, b_o, in_norm_w, norm_w)
            and _tables_ok(cos_PD, sin_signed_PD, positions_T, T))


def _args(**fields) -> AttentionBlockArgs:
    return AttentionBlockArgs(**{k: v for k, v in fields.items() if v is not None})


def attention_in(h_TD: torch.Tensor, delta_TD: torch.Tensor | None, in_norm_w: torch.Tensor, w_qkv: torch.Tensor,
                 b_qkv: torch.Tensor | None, eps: float, cos_PD: torch.Tensor, sin_signed_PD: torch.Tensor,
                 positions_T: torch.Tensor, num_heads: int, num_kv_heads: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The attention block's first half: (h', q, k, v) with h' = h + delta (h itself without delta) [T, D], x =
    RMSNorm(h') * in_norm_w, q = RoPE(x Wq^T + bq) [T, H, Dh], k = x Wk^T + bk (before RoPE) and v = x Wv^T + bv
    [T, Hkv, Dh], all fp32 contiguous. Call only where `attention_halves_apply` said yes.

    Raises:
        IndexError: a position outside the RoPE tables (nothing written). MemoryError: no scratch.
    """
    T, D = h_TD.shape
    Dh = cos_PD.shape[1]
    h_mid = torch.empty(T, D) if delta_TD is not None else h_TD
    q, k, v = torch.empty(T, num_heads, Dh), torch.empty(T, num_kv_heads, Dh), torch.empty(T, num_kv_heads, Dh)
    p_qkv = panels(w_qkv)  # the packed copy `linear` would use (same policy, same kernel)
    a = _args(h=h_TD.data_ptr(), delta=None if delta_TD is None else delta_TD.data_ptr(),
              in_norm_w=in_norm_w.data_ptr(), T=T, D=D, wqkv=w_qkv.data_ptr(),
              wqkv_p=None if p_qkv is None else p_qkv.data_ptr(), bqkv=None if b_qkv is None else b_qkv.data_ptr(),
              eps=eps, cos=cos_PD.data_ptr(), sin_signed=sin_signed_PD.data_ptr(), P=cos_PD.shape[0],
              pos=positions_T.data_ptr(), H=num_heads, Hkv=num_kv_heads, Dh=Dh)
    rc = _build.lib().moeray_attention_in(ctypes.byref(a), h_mid.data_ptr(), q.data_ptr(), k.data_ptr(), v.data_ptr())
    if rc == -2:
        raise IndexError(f"attention_in: a position is outside the RoPE tables [0, {cos_PD.shape[0]})")
    if rc:
        raise MemoryError(f"attention_in: no scratch for {T} rows")
    return h_mid, q, k, v


def attention_out(h_TD: torch.Tensor, o_TQ: torch.Tensor, w_o: torch.Tensor, b_o: torch.Tensor | None,
                  norm_w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention block's second half: (h_out, x_out) with h_out = h + o Wo^T + b_o and x_out = RMSNorm(h_out) *
    norm_w, each [T, D] fp32; o [T, H Dh] (made fp32 contiguous here). Call only where `attention_halves_apply` said
    yes. Raises MemoryError: no scratch."""
    T, D = h_TD.shape
    o = o_TQ.to(torch.float32).contiguous()
    h_out, x_out = torch.empty(T, D), torch.empty(T, D)
    p_o = panels(w_o)
    a = _args(h_out=h_out.data_ptr(), x_out=x_out.data_ptr(), T=T, D=D, wo=w_o.data_ptr(),
              wo_p=None if p_o is None else p_o.data_ptr(), bo=None if b_o is None else b_o.data_ptr(),
              norm_w=norm_w.data_ptr(), eps=eps, H=1, Dh=o.shape[1])  # the kernel reads o's width as H Dh
    if _build.lib().moeray_attention_out(ctypes.byref(a), h_TD.data_ptr(), o.data_ptr()):
        raise MemoryError(f"attention_out: no scratch for {T} rows")
    return h_out, x_out
