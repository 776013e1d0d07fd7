"""The fixed-capacity all-to-all dispatch's send buffer packed in one call (kernels/csrc/pack_rows.c).

Shape legend: T = tokens, D = hidden, V = (token, expert) pairs, W = ranks, C = rows per rank.

Returns None when it cannot run; the caller (`actors.moe.dispatch`) then builds the buffer with PyTorch ops.
"""
from __future__ import annotations

import ctypes

import torch

from kernels.cpu import _build
from kernels.cpu._abi import PackRowsArgs, f32_cpu


def pack_fixed_rows(x_TD: torch.Tensor, tok_V: torch.Tensor, dest_V: torch.Tensor, local_V: torch.Tensor,
                    world: int, capacity: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The fixed-capacity dispatch's send buffer in one call (`actors.moe.exchange.FixedCapacityExchange.send`).

    Args:
        x_TD: [T, D] fp32 contiguous token rows. tok_V / dest_V / local_V: int64 [V] token, destination rank and
            local expert row of each (token, expert) pair. world: W ranks. capacity: C rows per rank.
    Returns:
        (send [W * C, D + 1] fp32: the pairs for rank r in rows r * C + j in pair order, the local id in the last
        column and -1 there on padding rows, whose other columns are unset; slot_V int64 [V] the row of each
        pair; counts int64 [W] pairs per rank), or None when the kernel cannot run (the caller builds them with
        PyTorch ops).
    Raises:
        ValueError: a rank would receive more than C pairs, or a destination is out of range.
    """
    lib = _build.lib()
    if lib is None or not f32_cpu(x_TD) or not x_TD.is_contiguous() or x_TD.dim() != 2:
        return None
    D = x_TD.shape[1]
    V = dest_V.numel()
    tok, dest, local = (t.to(torch.int64).contiguous() for t in (tok_V, dest_V, local_V))
    send = torch.empty(world * capacity, D + 1, dtype=torch.float32)
    slot = torch.empty(V, dtype=torch.int64)
    counts = torch.empty(world, dtype=torch.int64)
    if lib.moeray_pack_rows(ctypes.byref(PackRowsArgs(x_TD.data_ptr(), D, tok.data_ptr(), dest.data_ptr(),
                                                      local.data_ptr(), V, world, capacity, send.data_ptr(),
                                                      slot.data_ptr(), counts.data_ptr()))) != 0:
        raise ValueError(f"pack_fixed_rows: a destination outside [0, {world}) or more than capacity={capacity} "
                         f"pairs for one rank")
    return send, slot, counts
