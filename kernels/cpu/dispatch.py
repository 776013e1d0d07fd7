"""The fixed-capacity all-to-all dispatch's send buffer packed in one call, and the combine's weighted sum over the
receive buffer in one call (kernels/csrc/pack_rows.c).

Shape legend: T = tokens, K = experts per token, D = hidden, V = (token, expert) pairs, E = routed experts,
W = ranks, C = rows per rank, R = rows of a receive buffer.

Each returns None when it cannot run; the caller (`actors.moe.exchange`) then takes PyTorch ops.
"""
from __future__ import annotations

import ctypes

import torch

from kernels.cpu import _build
from kernels.cpu._abi import PackIdsArgs, PackRowsArgs, WeighRowsArgs, f32_cpu


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


def pack_fixed_ids(x_TD: torch.Tensor, ids_TK: torch.Tensor, rank_of_E: torch.Tensor, local_of_E: torch.Tensor,
                   world: int, capacity: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """`pack_fixed_rows` straight from the router's ids, for a layer without replicas or padding ids: pair
    v = (t, k) (t = v // K) goes to rank rank_of_E[ids[t, k]] as its local row local_of_E[ids[t, k]].

    Args:
        x_TD: [T, D] fp32 contiguous. ids_TK: [T, K] int64 expert ids in [0, E). rank_of_E / local_of_E: [E]
            int64 placement tables of the layer. world: W. capacity: C.
    Returns:
        (send [W * C, D + 1] fp32, slot [T * K] int64, counts [W] int64) as `pack_fixed_rows`, or None when the
        kernel cannot run.
    Raises:
        ValueError: an id outside [0, E), or a rank would receive more than C pairs.
    """
    lib = _build.lib()
    if (lib is None or not f32_cpu(x_TD) or not x_TD.is_contiguous() or x_TD.dim() != 2 or ids_TK.dim() != 2
            or ids_TK.dtype != torch.int64 or rank_of_E.dtype != torch.int64 or local_of_E.dtype != torch.int64):
        return None
    T, K = ids_TK.shape
    D = x_TD.shape[1]
    ids, rank_of, local_of = ids_TK.contiguous(), rank_of_E.contiguous(), local_of_E.contiguous()
    send = torch.empty(world * capacity, D + 1, dtype=torch.float32)
    slot = torch.empty(T * K, dtype=torch.int64)
    counts = torch.empty(world, dtype=torch.int64)
    rc = lib.moeray_pack_ids(ctypes.byref(PackIdsArgs(
        x_TD.data_ptr(), D, ids.data_ptr(), T, K, rank_of.data_ptr(), local_of.data_ptr(), rank_of.numel(), world,
        capacity, send.data_ptr(), slot.data_ptr(), counts.data_ptr())))
    if rc == -2:
        raise ValueError(f"pack_fixed_ids: an expert id outside [0, {rank_of.numel()})")
    if rc != 0:
        raise ValueError(f"pack_fixed_ids: a rank outside [0, {world}) or more than capacity={capacity} pairs for one "
                         "rank")
    return send, slot, counts


def weigh_rows(y_RD: torch.Tensor, slot_V: torch.Tensor, w_TK: torch.Tensor) -> torch.Tensor | None:
    """The combine's weighted sum over a receive buffer: out[t] = sum_k w[t, k] * y[slot[t * K + k]], k in order.

    Args:
        y_RD: [R, D] fp32 rows (unit column stride). slot_V: [T * K] int64 rows of y, each in [0, R).
        w_TK: [T, K] routing weights (cast to fp32).
    Returns:
        out [T, D] fp32, or None when the kernel cannot run.
    """
    lib = _build.lib()
    if lib is None or not f32_cpu(y_RD) or y_RD.dim() != 2 or y_RD.stride(1) != 1 or slot_V.dtype != torch.int64:
        return None
    T, K = w_TK.shape
    D = y_RD.shape[1]
    w, slot = w_TK.to(torch.float32).contiguous(), slot_V.contiguous()
    out = torch.empty(T, D, dtype=torch.float32)
    lib.moeray_weigh_rows(ctypes.byref(WeighRowsArgs(y_RD.data_ptr(), D, y_RD.stride(0), slot.data_ptr(),
                                                     w.data_ptr(), T, K, out.data_ptr())))
    return out
