"""Triton kernels for packed sub-4-bit expert weights; same contracts as `kernels.packed_weights`.

Shape legend: E = experts, T = tokens, D = hidden, I = expert intermediate, K = input dim,
N = output dim, G = groups along K = ceil(K / group_size), W = int32 words per row = ceil(K * bits / 32),
L = codebook levels = 2**bits.

The packed format (row-aligned little-endian bit stream in int32 words, fp16 group scale/zero, optional fp16
codebook) is described in `kernels.packed_format`, the quantization method in `kernels.packed_quantize`.
Every kernel dequantizes a `[BLOCK_N, BLOCK_K]` tile in registers with `_dequant_tile` and never writes the
full-precision weight, which is the point: a decode step reads ~b/16 of the bf16 bytes.

Runs on CUDA tensors, or on CPU tensors under `TRITON_INTERPRET=1` (set it before importing this module).
No `.item()` / `.tolist()` on the hot path: the grouped GEMM builds its tile map on the device, so it can
be captured in a CUDA graph; on CUDA the expert split is therefore trusted, not value-checked.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.packed_format import PackedExperts, PackedWeight, _check_bits, words_per_row
from kernels.packed_weights import _check_ffn_input, _check_x, expert_offsets_from
from kernels.triton_launch import launch_guard

__all__ = ["unpack_codes", "dequantize", "gemv", "grouped_gemm", "packed_expert_ffn"]


@triton.jit
def _unpack_tile(codes_ptr, rows, ks, mask, W, BITS: tl.constexpr):
    """Codes `[BLOCK_N, BLOCK_K]` uint32 of rows `rows` (int64 `[BLOCK_N]`) at inputs `ks` (`[BLOCK_K]`)."""
    bit = ks * BITS
    w0 = bit >> 5
    w1 = (bit + BITS - 1) >> 5
    off = (bit & 31).to(tl.uint32)
    base = rows[:, None] * W
    lo = tl.load(codes_ptr + base + w0[None, :], mask=mask, other=0).to(tl.uint32, bitcast=True)
    hi = tl.load(codes_ptr + base + w1[None, :], mask=mask, other=0).to(tl.uint32, bitcast=True)
    # Two shifts keep each amount in [0, 31]; a shift by 32 is undefined on GPUs.
    q = (lo >> off[None, :]) | ((hi << 1) << (31 - off)[None, :])
    return q & ((1 << BITS) - 1)


@triton.jit
def _dequant_tile(codes_ptr, scales_ptr, zeros_ptr, cb_ptr, rows, cb_rows, ks, mask, W, G,
                  BITS: tl.constexpr, GROUP: tl.constexpr, HAS_CB: tl.constexpr):
    """fp32 `[BLOCK_N, BLOCK_K]` weights `(level[q] - zero) * scale`; exactly 0 where `mask` is False."""
    q = _unpack_tile(codes_ptr, rows, ks, mask, W, BITS)
    if HAS_CB:
        lv = tl.load(cb_ptr + cb_rows[:, None] * (1 << BITS) + q.to(tl.int32), mask=mask, other=0.0).to(tl.float32)
    else:
        lv = q.to(tl.float32)
    gidx = rows[:, None] * G + (ks // GROUP)[None, :]
    s = tl.load(scales_ptr + gidx, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(zeros_ptr + gidx, mask=mask, other=0.0).to(tl.float32)
    return (lv - z) * s


@triton.jit
def _unpack_kernel(codes_ptr, out_ptr, R, K, W, BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows < R)[:, None] & (ks < K)[None, :]
    q = _unpack_tile(codes_ptr, rows, ks, mask, W, BITS)
    tl.store(out_ptr + rows[:, None] * K + ks[None, :], q.to(tl.uint8), mask=mask)


@triton.jit
def _dequant_kernel(codes_ptr, scales_ptr, zeros_ptr, cb_ptr, out_ptr, R, N, K, W, G,
                    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_CB: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (rows < R)[:, None] & (ks < K)[None, :]
    w = _dequant_tile(codes_ptr, scales_ptr, zeros_ptr, cb_ptr, rows, rows // N, ks, mask, W, G, BITS, GROUP, HAS_CB)
    tl.store(out_ptr + rows[:, None] * K + ks[None, :], w.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gemv_kernel(x_ptr, codes_ptr, scales_ptr, zeros_ptr, cb_ptr, out_ptr, N, K, W, G,
                 BITS: tl.constexpr, GROUP: tl.constexpr, HAS_CB: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    row_mask = rows < N
    cb_rows = tl.zeros([BLOCK_N], dtype=tl.int64)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        x = tl.load(x_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)
        w = _dequant_tile(codes_ptr, scales_ptr, zeros_ptr, cb_ptr, rows, cb_rows, ks,
                          row_mask[:, None] & k_mask[None, :], W, G, BITS, GROUP, HAS_CB)
        acc += tl.sum(w * x[None, :], axis=1)
    tl.store(out_ptr + rows, acc.to(out_ptr.dtype.element_ty), mask=row_mask)


@triton.jit
def _grouped_gemm_kernel(x_ptr, tile_expert_ptr, tile_start_ptr, tile_end_ptr,
                         codes_ptr, scales_ptr, zeros_ptr, cb_ptr, out_ptr, N, K, W, G,
                         BITS: tl.constexpr, GROUP: tl.constexpr, HAS_CB: tl.constexpr, X_FP32: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    tile = tl.program_id(0)
    t0 = tl.load(tile_start_ptr + tile)
    t1 = tl.load(tile_end_ptr + tile)
    # The grid is an upper bound on the tile count (no host sync); surplus tiles have t0 == t1.
    if t0 < t1:
        e = tl.load(tile_expert_ptr + tile)
        toks = (t0 + tl.arange(0, BLOCK_T)).to(tl.int64)
        t_mask = toks < t1
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = cols < N
        rows = e * N + cols.to(tl.int64)  # rows of the [E * N, W] code matrix
        cb_rows = tl.zeros([BLOCK_N], dtype=tl.int64) + e
        acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < K
            x = tl.load(x_ptr + toks[:, None] * K + ks[None, :], mask=t_mask[:, None] & k_mask[None, :], other=0.0)
            w = _dequant_tile(codes_ptr, scales_ptr, zeros_ptr, cb_ptr, rows, cb_rows, ks,
                              n_mask[:, None] & k_mask[None, :], W, G, BITS, GROUP, HAS_CB)
            if X_FP32:
                # fp32 in, fp32 out: TF32 would cost ~1e-3 relative error against the reference.
                acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
        tl.store(out_ptr + toks[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=t_mask[:, None] & n_mask[None, :])


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _check_device(t: torch.Tensor) -> None:
    if t.device.type != "cuda" and not _interpreting():
        raise RuntimeError(f"Triton packed-weight kernels need CUDA tensors or TRITON_INTERPRET=1 (set before "
                           f"importing triton), got a tensor on {t.device}")


def _blocks(device: torch.device, gpu: tuple[int, ...], interp: tuple[int, ...]) -> tuple[int, ...]:
    # The interpreter runs each program in numpy: fewer, smaller tiles keep tests fast. On GPU these are
    # untuned starting points (no autotune, so the same code runs in the interpreter).
    return gpu if device.type == "cuda" else interp


def _cb_arg(pw: PackedWeight) -> torch.Tensor:
    # Any valid pointer will do when HAS_CB is False: the branch is compiled out.
    return pw.scales if pw.codebook is None else pw.codebook.contiguous()


def unpack_codes(words: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """Unpack packed rows on the device (contract of `packed_weights.unpack_codes`).

    Args:
        words: `[*, W]` int32 packed rows, W = ceil(K * bits / 32).
        bits: 2, 3 or 4.
        k: codes per row K.
    Returns:
        `[*, K]` uint8 codes in [0, 2**bits - 1].
    Raises:
        ValueError: `bits` unsupported, `words` not int32, or W does not match `k`.
        RuntimeError: tensors on CPU without TRITON_INTERPRET=1.
    """
    _check_bits(bits)
    if words.dtype != torch.int32:
        raise ValueError(f"words must be int32, got dtype={words.dtype}")
    if words.shape[-1] != words_per_row(k, bits):
        raise ValueError(f"words has {words.shape[-1]} words per row, expected {words_per_row(k, bits)} "
                         f"for k={k}, bits={bits}")
    _check_device(words)
    r = words.numel() // max(words.shape[-1], 1)
    out = torch.empty(*words.shape[:-1], k, dtype=torch.uint8, device=words.device)
    if out.numel() == 0:
        return out
    bn, bk = _blocks(words.device, (32, 128), (32, 64))
    with launch_guard():
        _unpack_kernel[(triton.cdiv(r, bn), triton.cdiv(k, bk))](
            words.contiguous(), out, r, k, words.shape[-1], BITS=bits, BLOCK_N=bn, BLOCK_K=bk)
    return out


def dequantize(pw: PackedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dequantize on the device: `(level[q] - zero) * scale` in fp32, stored as `dtype`.

    Args:
        pw: PackedWeight `(N, K)` or `(E, N, K)`.
        dtype: output dtype.
    Returns:
        `[N, K]` or `[E, N, K]` tensor of `dtype` on `pw.device`.
    Raises:
        RuntimeError: tensors on CPU without TRITON_INTERPRET=1.
    """
    _check_device(pw.codes)
    n, k = pw.shape[-2:]
    r = pw.codes.numel() // pw.codes.shape[-1]
    out = torch.empty(*pw.shape, dtype=dtype, device=pw.device)
    bn, bk = _blocks(pw.device, (32, 128), (32, 64))
    with launch_guard():
        _dequant_kernel[(triton.cdiv(r, bn), triton.cdiv(k, bk))](
            pw.codes.contiguous(), pw.scales.contiguous(), pw.zeros.contiguous(), _cb_arg(pw), out,
            r, n, k, pw.codes.shape[-1], pw.num_groups,
            BITS=pw.bits, GROUP=pw.group_size, HAS_CB=pw.codebook is not None, BLOCK_N=bn, BLOCK_K=bk)
    return out


def gemv(x: torch.Tensor, pw: PackedWeight) -> torch.Tensor:
    """Fused dequant-GEMV for one token: `dequantize(pw) @ x`, one program per BLOCK_N output rows.

    Args:
        x: `[K]` float (fp32 / fp16 / bf16).
        pw: PackedWeight `(N, K)`.
    Returns:
        `[N]` tensor of `x.dtype` (fp32 accumulation).
    Raises:
        ValueError: `pw` is a stack, `x` not 1-D, K or device mismatch.
        RuntimeError: tensors on CPU without TRITON_INTERPRET=1.
    """
    if pw.num_experts is not None:
        raise ValueError(f"gemv needs a single (N, K) weight, got shape={pw.shape}")
    _check_x(x, pw, 1, "x")
    _check_device(x)
    n, k = pw.shape
    out = torch.empty(n, dtype=x.dtype, device=x.device)
    bn, bk = _blocks(x.device, (16, 128), (32, 64))
    with launch_guard():
        _gemv_kernel[(triton.cdiv(n, bn),)](
            x.contiguous(), pw.codes.contiguous(), pw.scales.contiguous(), pw.zeros.contiguous(), _cb_arg(pw), out,
            n, k, pw.codes.shape[-1], pw.num_groups,
            BITS=pw.bits, GROUP=pw.group_size, HAS_CB=pw.codebook is not None, BLOCK_N=bn, BLOCK_K=bk)
    return out


def _tile_map(offsets: torch.Tensor, num_tokens: int, block_t: int) -> tuple[torch.Tensor, ...]:
    """Device-side map from program to (expert, first token, end token) for tiles of BLOCK_T tokens that
    never cross an expert boundary. Returns three `[P]` int64 tensors; P is a host-known upper bound
    sum_e ceil(c_e / BLOCK_T) <= (T + min(T, E) * (BLOCK_T - 1)) // BLOCK_T, surplus tiles are empty."""
    e = offsets.shape[0] - 1
    counts = offsets[1:] - offsets[:-1]  # [E]
    tiles = (counts + block_t - 1) // block_t  # [E]
    last_tile = torch.cumsum(tiles, 0)  # [E], exclusive end of each expert's tiles
    p = (num_tokens + min(num_tokens, e) * (block_t - 1)) // block_t
    tile = torch.arange(p, device=offsets.device, dtype=torch.int64)
    expert = torch.searchsorted(last_tile, tile, right=True)  # [P], == E for surplus tiles
    valid = expert < e
    ex = expert.clamp(max=e - 1)
    start = offsets[ex] + (tile - (last_tile - tiles)[ex]) * block_t
    start = torch.where(valid, start, 0)
    end = torch.where(valid, torch.minimum(start + block_t, offsets[ex + 1]), 0)
    return ex, start, end


def grouped_gemm(x: torch.Tensor, expert_offsets: torch.Tensor, pw: PackedWeight) -> torch.Tensor:
    """Grouped dequant-GEMM: rows offsets[e]:offsets[e+1] of `x` times `dequantize(pw[e]).T`.

    Programs run over (tile of up to BLOCK_T tokens of one expert, block of BLOCK_N outputs); experts with
    0 tokens get no tile. fp32 inputs use IEEE fp32 `tl.dot`; fp16 / bf16 inputs dequantize to their dtype.

    Args:
        x: `[T, K]` float, rows sorted by expert (T may be 0).
        expert_offsets: `[E+1]` int offsets (0..T) or `[E]` int tokens per expert.
        pw: PackedWeight stack `(E, N, K)`.
    Returns:
        `[T, N]` tensor of `x.dtype` (fp32 accumulation).
    Raises:
        ValueError: `pw` not a stack, `x` not `[T, K]`, or a bad split (values checked on CPU only).
        RuntimeError: tensors on CPU without TRITON_INTERPRET=1.
    """
    if pw.num_experts is None:
        raise ValueError(f"grouped_gemm needs a stacked (E, N, K) weight, got shape={pw.shape}")
    _check_x(x, pw, 2, "x")
    _check_device(x)
    t = x.shape[0]
    e, n, k = pw.shape
    offsets = expert_offsets_from(expert_offsets.to(x.device), e, t, check=x.device.type != "cuda")
    out = torch.empty(t, n, dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    bt, bn, bk = _blocks(x.device, (16, 64, 64), (16, 32, 32))
    tile_expert, tile_start, tile_end = _tile_map(offsets, t, bt)
    with launch_guard():
        _grouped_gemm_kernel[(tile_expert.shape[0], triton.cdiv(n, bn))](
            x.contiguous(), tile_expert, tile_start, tile_end,
            pw.codes.contiguous(), pw.scales.contiguous(), pw.zeros.contiguous(), _cb_arg(pw), out,
            n, k, pw.codes.shape[-1], pw.num_groups,
            BITS=pw.bits, GROUP=pw.group_size, HAS_CB=pw.codebook is not None, X_FP32=x.dtype == torch.float32,
            BLOCK_T=bt, BLOCK_N=bn, BLOCK_K=bk)
    return out


def packed_expert_ffn(x_sorted: torch.Tensor, tokens_per_expert: torch.Tensor, experts: PackedExperts, *,
                      act: Callable[[torch.Tensor], torch.Tensor] = F.silu) -> torch.Tensor:
    """Expert FFN `down(act(gate x) * up x)` over tokens sorted by expert, with the Triton grouped GEMM.

    Args:
        x_sorted: `[T, D]` float, rows grouped by expert in expert order (T may be 0).
        tokens_per_expert: `[E]` int tokens per expert (or `[E+1]` offsets); zeros allowed.
        experts: PackedExperts with E experts.
        act: elementwise activation on the gate projection (default silu).
    Returns:
        `[T, D]` tensor of `x_sorted.dtype`; the `[T, I]` intermediate is rounded to that dtype (as in
            the reference).
    Raises:
        ValueError: `x_sorted` not `[T, D]` or a bad split; RuntimeError: CPU tensors without the interpreter.
    """
    _check_ffn_input(x_sorted, experts)
    _check_device(x_sorted)
    offsets = expert_offsets_from(tokens_per_expert.to(x_sorted.device), experts.num_experts, x_sorted.shape[0],
                                  check=x_sorted.device.type != "cuda")
    if experts.fused:
        g, u = grouped_gemm(x_sorted, offsets, experts.gate_up).split(experts.intermediate_size, dim=1)
    else:
        g, u = grouped_gemm(x_sorted, offsets, experts.gate), grouped_gemm(x_sorted, offsets, experts.up)
    # The product is formed in fp32 and rounded once to the activation dtype, as HF MoE blocks do.
    h = (act(g.float()) * u.float()).to(x_sorted.dtype)  # [T, I]
    return grouped_gemm(h, offsets, experts.down)
