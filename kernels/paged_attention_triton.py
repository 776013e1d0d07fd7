"""Triton paged decode attention over quantized KV blocks; same contract as `kernels.paged_attention`.

`paged_decode_attention_triton` runs one program per (sequence, KV head) and serves all H_q / H_kv
query heads of the group from one dequantization: it walks the block table, unpacks codes from uint8 in
registers, looks levels up in the codebook (or, with per-channel key widths `k_bits`, reads each key
channel at its own bit offset and width and maps it onto its uniform grid), applies scales, outliers and RoPE,
and folds each block into a
flash-decoding online softmax. No dense copy of the cache is ever made.

Shape legend: B = sequences, Hq = query heads, H = KV heads, D = head_dim, S = block_size,
NB = blocks in the pool, M = max blocks per sequence, Ns = sink tokens, Nt = tail tokens, Pmax = max_pos,
P = packed bytes per token and head, Ok / Ov = outlier channels per head.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.kv_pack import channel_bit_offsets
from kernels.kv_pages import KVPages
from kernels.kv_profile import KVQuantProfile
from kernels.kv_quant import value_scale_table
from kernels.paged_attention import _validate
from kernels.triton_launch import launch_guard


@triton.jit
def _unpack(ptr, row_T, chan_C, mask_T, BITS: tl.constexpr, P: tl.constexpr):
    """[T, C] int32 codes of channels chan_C from packed rows starting at byte offsets row_T."""
    bit = chan_C * BITS
    byte = bit // 8
    shift = bit % 8
    m = mask_T[:, None]
    word = tl.load(ptr + row_T[:, None] + byte[None, :], mask=m, other=0).to(tl.int32)
    if BITS == 3:
        # 3-bit codes may straddle two bytes; the last byte of a row has no successor.
        nxt = tl.load(ptr + row_T[:, None] + byte[None, :] + 1, mask=m & (byte[None, :] + 1 < P), other=0)
        word = word | (nxt.to(tl.int32) << 8)
    return (word >> shift[None, :]) & ((1 << BITS) - 1)


@triton.jit
def _unpack_var(ptr, row_T, off_C, mask_C, mask_T, P: tl.constexpr):
    """[T, C] int32 codes of per-channel widths: channel c at bit offset off_C[c] of each packed row, code
    mask mask_C[c] = 2**width - 1 (width <= 8, so a code spans at most two bytes)."""
    byte = off_C // 8
    shift = off_C % 8
    m = mask_T[:, None]
    word = tl.load(ptr + row_T[:, None] + byte[None, :], mask=m, other=0).to(tl.int32)
    nxt = tl.load(ptr + row_T[:, None] + byte[None, :] + 1, mask=m & (byte[None, :] + 1 < P), other=0)
    word = word | (nxt.to(tl.int32) << 8)
    return (word >> shift[None, :]) & mask_C[None, :]


@triton.jit
def _online_softmax_step(q1, q2, k1, k2, v, valid_T, m_i, l_i, acc, sm_scale):
    """Fold one tile of T keys/values into the running (max, sum, acc) of BLOCK_G query heads.

    q1, q2 [G, D/2] and k1, k2 [T, D/2] are the two RoPE halves; v [T, D].
    """
    s = tl.sum(q1[:, None, :] * k1[None, :, :], axis=2) + tl.sum(q2[:, None, :] * k2[None, :, :], axis=2)
    s = tl.where(valid_T[None, :], s * sm_scale, float("-inf"))  # [G, T]
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
    return m_new, l_i, acc


@triton.jit
def _dense_tile(q1, q2, k_ptr, v_ptr, seq, n_max, n_valid, m_i, l_i, acc, sm_scale,
                H: tl.constexpr, head, D: tl.constexpr, HALF: tl.constexpr, BLOCK_N: tl.constexpr):
    """Attend to a dense post-RoPE [B, n_max, H, D] buffer (sink or tail), first n_valid tokens."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_h = tl.arange(0, HALF)
    offs_d = tl.arange(0, D)
    for start in range(0, n_valid, BLOCK_N):
        tok = start + offs_n
        valid = tok < n_valid
        row = ((seq * n_max + tok) * H + head).to(tl.int64) * D
        m2 = valid[:, None]
        k1 = tl.load(k_ptr + row[:, None] + offs_h[None, :], mask=m2, other=0.0).to(tl.float32)
        k2 = tl.load(k_ptr + row[:, None] + HALF + offs_h[None, :], mask=m2, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + row[:, None] + offs_d[None, :], mask=m2, other=0.0).to(tl.float32)
        m_i, l_i, acc = _online_softmax_step(q1, q2, k1, k2, v, valid, m_i, l_i, acc, sm_scale)
    return m_i, l_i, acc


@triton.jit
def _paged_decode_kernel(
    q_ptr, out_ptr,
    k_codes_ptr, v_codes_ptr, v_scale_ptr, k_out_ptr, v_out_ptr,
    k_cb_ptr, v_cb_ptr, k_scale_ptr, k_zero_ptr, v_zero_ptr, k_slot_ptr, v_slot_ptr,
    k_off_ptr, k_mask_ptr, k_step_ptr, vs_lut_ptr,
    block_tables_ptr, context_lens_ptr, cos_ptr, sin_ptr,
    sink_k_ptr, sink_v_ptr, sink_lens_ptr, tail_k_ptr, tail_v_ptr, tail_lens_ptr,
    sm_scale, max_blocks, n_sink_max, n_tail_max,
    kc_bs, vc_bs, vs_bs, ko_bs, vo_bs,
    H: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
    BITS: tl.constexpr, P: tl.constexpr, PK: tl.constexpr, K_VAR: tl.constexpr, S: tl.constexpr,
    BLOCK_S: tl.constexpr,
    N_OUT_K: tl.constexpr, N_OUT_V: tl.constexpr,
    HAS_SINK: tl.constexpr, HAS_TAIL: tl.constexpr, BLOCK_N: tl.constexpr, VS8: tl.constexpr = False,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_g = tl.arange(0, BLOCK_G)
    offs_h = tl.arange(0, HALF)
    offs_d = tl.arange(0, D)
    g_mask = offs_g < GROUP
    q_row = ((seq * H + head) * GROUP + offs_g) * D  # query heads of this KV head are contiguous
    q1 = tl.load(q_ptr + q_row[:, None] + offs_h[None, :], mask=g_mask[:, None], other=0.0).to(tl.float32)
    q2 = tl.load(q_ptr + q_row[:, None] + HALF + offs_h[None, :], mask=g_mask[:, None], other=0.0).to(tl.float32)

    # Finite start so a fully masked tile gives exp(-inf - m) = 0 rather than NaN.
    m_i = tl.full([BLOCK_G], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)

    n_sink = 0
    if HAS_SINK:
        n_sink = tl.load(sink_lens_ptr + seq)
        m_i, l_i, acc = _dense_tile(q1, q2, sink_k_ptr, sink_v_ptr, seq, n_sink_max, n_sink, m_i, l_i, acc,
                                    sm_scale, H, head, D, HALF, BLOCK_N)

    ks1 = tl.load(k_scale_ptr + head * D + offs_h)
    ks2 = tl.load(k_scale_ptr + head * D + HALF + offs_h)
    kz1 = tl.load(k_zero_ptr + head * D + offs_h)
    kz2 = tl.load(k_zero_ptr + head * D + HALF + offs_h)
    kslot1 = tl.load(k_slot_ptr + head * D + offs_h)
    kslot2 = tl.load(k_slot_ptr + head * D + HALF + offs_h)
    if K_VAR:  # per-channel key widths: bit offset, code mask and grid step 2 / (2**b - 1) per channel
        koff1 = tl.load(k_off_ptr + head * D + offs_h)
        koff2 = tl.load(k_off_ptr + head * D + HALF + offs_h)
        kmask1 = tl.load(k_mask_ptr + head * D + offs_h)
        kmask2 = tl.load(k_mask_ptr + head * D + HALF + offs_h)
        kstep1 = tl.load(k_step_ptr + head * D + offs_h)
        kstep2 = tl.load(k_step_ptr + head * D + HALF + offs_h)
    vslot = tl.load(v_slot_ptr + head * D + offs_d)
    vz = tl.load(v_zero_ptr + head * D + offs_d)

    ctx = tl.load(context_lens_ptr + seq)
    offs_t = tl.arange(0, BLOCK_S)
    in_block = offs_t < S
    for j in range(0, tl.cdiv(ctx, S)):
        blk = tl.load(block_tables_ptr + seq * max_blocks + j).to(tl.int64)
        tok = j * S + offs_t
        valid = in_block & (tok < ctx)
        # Blocks are addressed by their own stride (elements), so pages may be strided views of a byte arena;
        # within a block every array is contiguous.
        code_in = (head * S + offs_t) * P  # [T] byte offset of each token's packed row within the block
        side_row = offs_t * H + head  # [T] row within the block of the [S, H, ...] side arrays
        m2 = valid[:, None]

        if K_VAR:
            kcode_in = (head * S + offs_t) * PK
            lv1 = _unpack_var(k_codes_ptr + blk * kc_bs, kcode_in, koff1, kmask1, valid, PK).to(tl.float32) \
                * kstep1[None, :] - 1.0
            lv2 = _unpack_var(k_codes_ptr + blk * kc_bs, kcode_in, koff2, kmask2, valid, PK).to(tl.float32) \
                * kstep2[None, :] - 1.0
            k1 = lv1 * ks1[None, :] + kz1[None, :]
            k2 = lv2 * ks2[None, :] + kz2[None, :]
        else:
            k1 = tl.load(k_cb_ptr + _unpack(k_codes_ptr + blk * kc_bs, code_in, offs_h, valid, BITS, P)) \
                * ks1[None, :] + kz1[None, :]
            k2 = tl.load(k_cb_ptr + _unpack(k_codes_ptr + blk * kc_bs, code_in, HALF + offs_h, valid, BITS, P)) \
                * ks2[None, :] + kz2[None, :]
        if N_OUT_K > 0:
            o1 = tl.load(k_out_ptr + blk * ko_bs + side_row[:, None] * N_OUT_K + kslot1[None, :],
                         mask=m2 & (kslot1[None, :] >= 0), other=0.0).to(tl.float32)
            o2 = tl.load(k_out_ptr + blk * ko_bs + side_row[:, None] * N_OUT_K + kslot2[None, :],
                         mask=m2 & (kslot2[None, :] >= 0), other=0.0).to(tl.float32)
            k1 = tl.where(kslot1[None, :] >= 0, o1, k1)
            k2 = tl.where(kslot2[None, :] >= 0, o2, k2)
        # Keys were quantized before RoPE; rotate at sequence position sink + t.
        pos = (n_sink + tok).to(tl.int64) * D
        c1 = tl.load(cos_ptr + pos[:, None] + offs_h[None, :], mask=m2, other=0.0)
        c2 = tl.load(cos_ptr + pos[:, None] + HALF + offs_h[None, :], mask=m2, other=0.0)
        s1 = tl.load(sin_ptr + pos[:, None] + offs_h[None, :], mask=m2, other=0.0)
        s2 = tl.load(sin_ptr + pos[:, None] + HALF + offs_h[None, :], mask=m2, other=0.0)
        k1r = k1 * c1 - k2 * s1
        k2r = k2 * c2 + k1 * s2

        if VS8:  # 8-bit log2 scale codes (kernels.kv_quant.value_scale_table)
            vsc = tl.load(vs_lut_ptr + tl.load(v_scale_ptr + blk * vs_bs + side_row, mask=valid, other=0).to(tl.int32))
        else:
            vsc = tl.load(v_scale_ptr + blk * vs_bs + side_row, mask=valid, other=0.0).to(tl.float32)
        v = tl.load(v_cb_ptr + _unpack(v_codes_ptr + blk * vc_bs, code_in, offs_d, valid, BITS, P)) * vsc[:, None] \
            + vz[None, :]
        if N_OUT_V > 0:
            ov = tl.load(v_out_ptr + blk * vo_bs + side_row[:, None] * N_OUT_V + vslot[None, :],
                         mask=m2 & (vslot[None, :] >= 0), other=0.0).to(tl.float32)
            v = tl.where(vslot[None, :] >= 0, ov, v)
        m_i, l_i, acc = _online_softmax_step(q1, q2, k1r, k2r, v, valid, m_i, l_i, acc, sm_scale)

    if HAS_TAIL:
        n_tail = tl.load(tail_lens_ptr + seq)
        m_i, l_i, acc = _dense_tile(q1, q2, tail_k_ptr, tail_v_ptr, seq, n_tail_max, n_tail, m_i, l_i, acc,
                                    sm_scale, H, head, D, HALF, BLOCK_N)

    out = tl.where(l_i[:, None] > 0, acc / tl.maximum(l_i, 1e-30)[:, None], 0.0)
    tl.store(out_ptr + q_row[:, None] + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])


def _block_major(t: torch.Tensor) -> torch.Tensor:
    """`t` [NB, ...] as is when each block is contiguous (any block stride, e.g. a view of a byte arena),
    else a contiguous copy. The kernel addresses block j at j * t.stride(0) elements."""
    if t.shape[0] == 0 or t[0].is_contiguous() or t[0].numel() == 0:
        return t
    return t.contiguous()


def paged_decode_attention_triton(
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
    """Triton version of `paged_decode_attention_ref`, same arguments, shapes, dtypes and result.

    Grid: (B, H); each program serves the Hq / H query heads of one KV head. Extra constraint: D must be
    a power of two (tl.arange). The page arrays may be strided in their block dimension (views of one byte
    arena, as `QuantizedPagedKVCache` keeps them) as long as each block is contiguous; they are not copied. Positions are not checked against the RoPE table (no host sync); loads
    beyond it are undefined as in any paged kernel. Runs on CUDA tensors, or on CPU tensors under
    TRITON_INTERPRET=1 (set before importing this module; fp32/fp16 only, the interpreter is wrong for bf16).

    Raises:
        ValueError: as the reference, and if D is not a power of two.
        RuntimeError: CPU tensors without TRITON_INTERPRET=1.
    """
    b, hq, h, d = _validate(q, pages, block_tables, context_lens, profile, cos, sin,
                            sink_k, sink_v, sink_lens, tail_k, tail_v, tail_lens)
    if q.device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise RuntimeError(f"paged_decode_attention_triton needs CUDA tensors or TRITON_INTERPRET=1 set before "
                           f"importing triton (q is on {q.device})")
    if d < 2 or d & (d - 1):
        raise ValueError(f"head_dim={d} must be a power of two for the Triton kernel")
    group = hq // h
    dev = q.device
    out = torch.empty(b, hq, d, dtype=q.dtype, device=dev)
    i32 = torch.int32
    has_sink, has_tail = sink_k is not None, tail_k is not None
    dummy_f = q.new_zeros(1)
    dummy_i = torch.zeros(1, dtype=i32, device=dev)
    if has_sink and sink_lens is None:
        sink_lens = torch.full((b,), sink_k.shape[1], dtype=i32, device=dev)
    s = pages.block_size
    if profile.per_channel_keys:
        kb = profile.k_bits.to(torch.int32)
        k_off, k_mask = channel_bit_offsets(profile.k_bits).contiguous(), ((1 << kb) - 1).contiguous()
        k_step = (2.0 / ((1 << kb) - 1).float()).contiguous()
    else:
        k_off = k_mask = dummy_i
        k_step = dummy_f.float()
    kc, vc, vs, ko, vo = (_block_major(t) for t in (pages.k_codes, pages.v_codes, pages.v_scale, pages.k_outliers,
                                                     pages.v_outliers))
    with launch_guard():
        _paged_decode_kernel[(b, h)](
            q.contiguous(), out,
            kc, vc, vs, ko, vo,
            profile.k_codebook, profile.v_codebook, profile.k_scale, profile.k_zero, profile.v_zero,
            profile.outlier_slots("k"), profile.outlier_slots("v"),
            k_off, k_mask, k_step, value_scale_table(dev),
            block_tables.to(i32).contiguous(), context_lens.to(i32).contiguous(),
            cos.float().contiguous(), sin.float().contiguous(),
            sink_k.contiguous() if has_sink else dummy_f, sink_v.contiguous() if has_sink else dummy_f,
            sink_lens.to(i32).contiguous() if has_sink else dummy_i,
            tail_k.contiguous() if has_tail else dummy_f, tail_v.contiguous() if has_tail else dummy_f,
            tail_lens.to(i32).contiguous() if has_tail else dummy_i,
            float(scale), block_tables.shape[1],
            sink_k.shape[1] if has_sink else 0, tail_k.shape[1] if has_tail else 0,
            kc.stride(0), vc.stride(0), vs.stride(0), ko.stride(0), vo.stride(0),
            H=h, GROUP=group, BLOCK_G=triton.next_power_of_2(group), D=d, HALF=d // 2,
            BITS=profile.bits, P=profile.packed_bytes, PK=profile.k_packed_bytes, K_VAR=profile.per_channel_keys,
            S=s, BLOCK_S=triton.next_power_of_2(s),
            N_OUT_K=profile.n_outlier_k, N_OUT_V=profile.n_outlier_v,
            HAS_SINK=has_sink, HAS_TAIL=has_tail, BLOCK_N=16, VS8=pages.v_scale.dtype == torch.uint8,
        )
    return out
