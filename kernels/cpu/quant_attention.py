"""Decode attention over the quantized paged KV cache on CPU (kernels/csrc/quant_decode_attention.c).

The contract is `kernels.paged_attention.paged_decode_attention_ref`'s (sink, sealed quantized blocks, tail; keys
dequantized then rotated at their position): this path dequantizes each sequence's tokens into fp32 rows in one
compiled pass (codes unpacked, levels, scale and zero, outliers, RoPE) and attends with the full-precision decode
kernel's loop, where the reference runs ~40 PyTorch ops per sequence and layer. Equal to the reference up to fp32
rounding (tests/kernels/test_quant_attention.py). Returns None when it cannot run; the caller runs the reference.
The cache passes its staging rows in place (`StagedRows`) instead of gathered, rotated sink and tail tensors; its
prefill reads sealed tokens dequantized and rotated by the same unpacking (`quant_dequant_rows`).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from kernels.cpu import _build
from kernels.cpu._abi import QuantDecodeArgs
from kernels.kv_pages import KVPages
from kernels.kv_profile import KVQuantProfile
from kernels.kv_quant import profile_tables, value_scale_table
from kernels.paged_attention import _validate, paged_decode_attention_ref


def _page_strides(pages: KVPages) -> list[int] | None:
    """Each field's page stride (in its elements) when its inner dimensions are dense on the CPU; else None."""
    out = []
    for t in (pages.k_codes, pages.v_codes, pages.v_scale, pages.k_outliers, pages.v_outliers):
        dense, s = True, 1
        for n, st in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
            dense = dense and (n <= 1 or st == s)
            s *= n
        if t.device.type != "cpu" or not (dense or t.numel() == 0):
            return None
        out.append(t.stride(0))
    return out


_LAYER_ARGS: dict[tuple, tuple] = {}  # ids of (pages, profile, cos, sin) -> (those objects, a prototype args struct)


def _layer_args(pages: KVPages, profile: KVQuantProfile, cf: torch.Tensor, sf: torch.Tensor) -> QuantDecodeArgs | None:
    """A fresh `QuantDecodeArgs` holding one layer's page, profile-table and RoPE-table fields (cf / sf: fp32
    contiguous), copied from a prototype made once per (pages, profile, tables): both entry points fill in the rest.
    None when the kernel cannot read the pages (`_page_strides`). The prototype's entry keeps those objects alive, so
    the pointers in it stay valid."""
    key = (id(pages), id(profile), id(cf), id(sf))
    hit = _LAYER_ARGS.get(key)
    if hit is None or any(a is not b for a, b in zip(hit[0], (pages, profile, cf, sf))):
        t, strides = profile_tables(profile), _page_strides(pages)
        proto = None if strides is None else QuantDecodeArgs(
            kc=pages.k_codes.data_ptr(), vc=pages.v_codes.data_ptr(), vs=pages.v_scale.data_ptr(),
            ko=pages.k_outliers.data_ptr(), vo=pages.v_outliers.data_ptr(), skc=strides[0], svc=strides[1],
            svs=strides[2], sko=strides[3], svo=strides[4], cosr=cf.data_ptr(), sinr=sf.data_ptr(),
            k_scale=t.k_scale.data_ptr(), k_zero=t.k_zero.data_ptr(), v_zero=t.v_zero.data_ptr(),
            k_cb=t.k_cb.data_ptr(), v_cb=t.v_cb.data_ptr(), kw=t.kw.data_ptr(), k_grid=t.grid, vbits=profile.bits,
            Pk=pages.k_codes.shape[-1], P=pages.v_codes.shape[-1], k_oidx=t.k_oidx.data_ptr(),
            v_oidx=t.v_oidx.data_ptr(), Ok=t.k_oidx.shape[1], Ov=t.v_oidx.shape[1], H=profile.num_kv_heads,
            D=profile.head_dim, S=pages.block_size, maxpos=cf.shape[0],
            vs_lut=value_scale_table().data_ptr() if pages.v_scale.dtype == torch.uint8 else None)
        if len(_LAYER_ARGS) >= 1024:
            _LAYER_ARGS.clear()
        hit = _LAYER_ARGS[key] = ((pages, profile, cf, sf), proto)
    return None if hit[1] is None else QuantDecodeArgs.from_buffer_copy(hit[1])


def quant_decode_attention(q: torch.Tensor, pages: KVPages, block_tables: torch.Tensor, context_lens: torch.Tensor,
                           profile: KVQuantProfile, cos: torch.Tensor, sin: torch.Tensor, scale: float, *,
                           sink_k=None, sink_v=None, sink_lens=None, tail_k=None, tail_v=None,
                           tail_lens=None, staged=None) -> torch.Tensor | None:
    """`paged_decode_attention_ref` (same arguments, same result up to fp32 rounding) in one compiled call.

    staged: instead of sink_k / sink_v / tail_k / tail_v, the cache's staging rows as they lie (no gather, no
        RoPE pass, no copy per layer: `StagedRows` says what they hold), with sink_lens and tail_lens [B].

    Returns:
        [B, Hq, D] in q.dtype, or None when the kernel cannot run (no compiled kernels, tensors off the CPU, page
        fields whose inner dimensions are not dense, a head_dim over 1,024): the caller runs the reference.
    Raises:
        ValueError: as the reference (shapes; a position beyond the RoPE table). MemoryError: no scratch.
    """
    lib = _build.lib()
    if lib is None or q.device.type != "cpu":
        return None
    if staged is not None and (sink_k is not None or tail_k is not None):
        raise ValueError("staged rows replace sink_k / sink_v / tail_k / tail_v: give one or the other")
    b, hq, h, d = _validate(q, pages, block_tables, context_lens, profile, cos, sin, sink_k, sink_v,
                            None if staged else sink_lens, tail_k, tail_v, None if staged else tail_lens)
    cf, sf = cos.float().contiguous(), sin.float().contiguous()
    a = _layer_args(pages, profile, cf, sf)
    if a is None:
        return None
    ctx = context_lens.to(torch.int64).contiguous()
    sk = sv = sl = tk = tv = tl = None
    st = None
    if staged is not None:
        st = staged.check(b, h, d)
        if st is None:
            return None
        sl, tl = sink_lens.to(torch.int64).contiguous(), tail_lens.to(torch.int64).contiguous()
    if sink_k is not None:
        sk, sv = sink_k.float().contiguous(), sink_v.float().contiguous()
        sl = (sink_lens.to(torch.int64) if sink_lens is not None
              else torch.full((b,), sk.shape[1], dtype=torch.int64)).contiguous()
    if tail_k is not None:
        tk, tv, tl = tail_k.float().contiguous(), tail_v.float().contiguous(), tail_lens.to(torch.int64).contiguous()
    qf = q.float().contiguous()
    bt = block_tables.to(torch.int64).contiguous()
    out = torch.empty(b, hq, d, dtype=torch.float32)
    if b == 0:
        return out.to(q.dtype)

    def ptr(t):
        return None if t is None else t.data_ptr()
    a.q, a.bt, a.mb, a.ctx, a.out, a.B, a.Hq, a.scale = qf.data_ptr(), bt.data_ptr(), bt.shape[1], ctx.data_ptr(), \
        out.data_ptr(), b, hq, scale
    a.slen, a.tlen = ptr(sl), ptr(tl)
    if st is not None:
        a.ns, (a.stk, a.stv, a.sslot, a.srows, a.sbs) = staged.sink_rows, st
    else:
        a.sk, a.sv, a.ns, a.tk, a.tv = ptr(sk), ptr(sv), 0 if sk is None else sk.shape[1], ptr(tk), ptr(tv)
        a.nt, a.sbs = 0 if tk is None else tk.shape[1], 1
    rc = lib.moeray_quant_decode_attention(ctypes.byref(a))
    if rc == -4:  # a rotated position beyond the table (the kernel checks before it writes anything)
        last = ctx + (sl if sl is not None else 0) + (tl if st is not None else 0)
        i = int(((last > 0) & (ctx > 0 if st is None else last > 0) & (last > cos.shape[0])).nonzero()[0])
        raise ValueError(f"sequence {i}: position {int(last[i]) - 1} exceeds the RoPE table (max_pos={cos.shape[0]})")
    if rc == -3:
        return None
    if rc:
        raise MemoryError("quant_decode_attention: no scratch for the dequantized rows")
    return out.to(q.dtype)


@dataclass
class StagedRows:
    """The quantized cache's full-precision staging rows of one layer, read in place by `quant_decode_attention`.

    k / v: [slots, Ns + S, H, D] (keys before RoPE); slots [B] int64: each sequence's slot. A sequence's sink is
    rows 0 .. sink_lens[b] - 1 (positions 0 ..), its tail of tail_lens[b] tokens rows sink_rows + ctx[b] % S ..
    (positions sink_lens[b] + ctx[b] ..); sink_rows: the cache's sink tokens Ns; block_size: its logical block S
    (the rows' block, not the pages' token count)."""

    k: torch.Tensor
    v: torch.Tensor
    slots: torch.Tensor
    sink_rows: int
    block_size: int

    def check(self, b: int, h: int, d: int) -> tuple | None:
        """(k, v, slots pointers, rows per slot, block size) for the kernel, or None when it cannot read them in place
        (not fp32 contiguous on the CPU). Raises ValueError on shapes that do not fit."""
        k, v = self.k, self.v
        if k.dim() != 4 or k.shape != v.shape or tuple(k.shape[2:]) != (h, d) or self.slots.shape != (b,):
            raise ValueError(f"staged rows k {tuple(k.shape)}, v {tuple(v.shape)}, slots {tuple(self.slots.shape)}: "
                             f"need [slots, rows, H={h}, D={d}] twice and [B={b}]")
        if k.dtype != torch.float32 or v.dtype != torch.float32 or not (k.is_contiguous() and v.is_contiguous()) or (
                k.device.type != "cpu"):
            return None
        self._slots = self.slots.to(torch.int64).contiguous()  # kept alive for the call
        return k.data_ptr(), v.data_ptr(), self._slots.data_ptr(), k.shape[1], self.block_size


def quant_decode_attention_or_ref(*args, **kwargs) -> torch.Tensor:
    """`quant_decode_attention` where it runs, else `paged_decode_attention_ref` (same arguments and result)."""
    out = quant_decode_attention(*args, **kwargs)
    return out if out is not None else paged_decode_attention_ref(*args, **kwargs)


def quant_dequant_rows(pages: KVPages, pages_n: torch.Tensor, slots_n: torch.Tensor, profile: KVQuantProfile,
                       cos: torch.Tensor, sin: torch.Tensor, pos0: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """n sealed tokens of one layer read from their pages, dequantized, and their keys rotated at positions pos0,
    pos0 + 1, ... (kernels/csrc/quant_decode_attention.c `moeray_quant_dequant_rows`; what the quantized cache's
    prefill attends over, equal to `dequantize_kv` of the pages' rows then `apply_rope` up to fp32 rounding).

    Args:
        pages: the layer's page views. pages_n / slots_n: [n] int64 page and slot of each token.
        cos / sin: [max_pos, D] RoPE tables. pos0: the first token's position.
    Returns:
        (K [n, H, D] fp32 after RoPE, V [n, H, D] fp32), or None when the kernel cannot run (the caller then
        reads, dequantizes and rotates with PyTorch ops).
    Raises:
        ValueError: a position beyond the RoPE table. MemoryError: no scratch.
    """
    lib = _build.lib()
    h, d = profile.num_kv_heads, profile.head_dim
    if lib is None or cos.device.type != "cpu" or d > 1024:
        return None
    cf, sf = cos.float().contiguous(), sin.float().contiguous()
    a = _layer_args(pages, profile, cf, sf)
    if a is None:
        return None
    n = pages_n.numel()
    pg, sl = pages_n.to(torch.int64).contiguous(), slots_n.to(torch.int64).contiguous()
    K, V = torch.empty(n, h, d, dtype=torch.float32), torch.empty(n, h, d, dtype=torch.float32)
    rc = lib.moeray_quant_dequant_rows(ctypes.byref(a), pg.data_ptr(), sl.data_ptr(), n, pos0, K.data_ptr(),
                                       V.data_ptr()) if n else 0
    if rc == -4:
        raise ValueError(f"position {pos0 + n - 1} exceeds the RoPE table (max_pos={cos.shape[0]})")
    if rc == -3:
        return None
    if rc:
        raise MemoryError("quant_dequant_rows: no scratch for the unpacking tables")
    return K, V
