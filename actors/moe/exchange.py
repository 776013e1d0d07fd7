"""How a layer's (token, expert) rows travel to their experts' ranks and back: the dispatcher's exchanges.

`Exchange.send` takes the valid pairs (token row, destination rank, local expert row) and returns the rows
this rank's experts get (`actors.moe.experts.ExpertRows`); `receive` brings the experts' results back to the
pairs, in pair order. `LocalExchange` is world_size 1 (no collective); `CountsExchange` is the general
all-to-all (counts first, uneven splits); `FixedCapacityExchange` sends C rows to every rank, padded with id
-1, so no counts are exchanged (decode steps; `actors.moe.dispatch.AllToAllDispatcher` picks it per step).
Every exchange adds the rows it sends per rank to the caller's counter row, in place.

Shape legend: T = tokens on this rank, D = hidden, V = valid pairs, R = rows received, W = world size,
C = fixed capacity (rows to and from each rank).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable

import torch

from actors.moe.experts import ExpertRows
from kernels.cpu import pack_fixed_ids, pack_fixed_rows, weigh_rows

A2A = Callable[[torch.Tensor, torch.Tensor, Any, Any], None]  # (out, inp, out_splits, in_splits): all_to_all_single


class Exchange(ABC):
    """How the valid pairs' rows reach their ranks and their results come back."""

    @abstractmethod
    def send(self, x_TD: torch.Tensor, tok_V: torch.Tensor, dest_V: torch.Tensor, local_V: torch.Tensor,
             sent_W: torch.Tensor, capacity: int | None) -> tuple[ExpertRows, Any]:
        """Rows for this rank's experts and the state `receive` needs; adds the rows sent per rank to sent_W [W]
        in place. capacity: C (the fixed-capacity exchange only)."""

    @abstractmethod
    def receive(self, y_RD: torch.Tensor, state: Any) -> torch.Tensor:
        """The experts' results [R, D] back to this rank's pairs: [V, D] in pair order."""


@dataclass(slots=True)
class DispatchHandle:
    """What `combine` needs to bring a layer's results back: the exchange that sent the rows (None: the one-token
    path, nothing to bring back) and its state, the pair shape (T, K), and where the valid pairs sit among the
    T*K when some ids were padding (keep_V; None: all valid)."""

    exchange: Exchange | None
    state: Any
    T: int
    K: int
    keep_V: torch.Tensor | None = None


def weigh_pairs(y_P: torch.Tensor, w_TK: torch.Tensor) -> torch.Tensor:
    """Every (t, k) pair's result [T * K, D], in (t, k) order -> out [T, D] = sum_k w[t, k] * y_P[t * K + k], in
    y_P's dtype (the PyTorch form of `kernels.cpu.weigh_rows`)."""
    T, K = w_TK.shape
    return (y_P * w_TK.reshape(-1, 1).to(y_P.dtype)).view(T, K, y_P.shape[1]).sum(dim=1)


class LocalExchange(Exchange):
    """world_size 1: the pairs' rows go straight to this rank's experts (no collective)."""

    def send(self, x_TD, tok_V, dest_V, local_V, sent_W, capacity):
        sent_W[0] += local_V.numel()
        return ExpertRows(x_TD[tok_V], local_V), None

    def receive(self, y_RD, state):
        return y_RD


class CountsExchange(Exchange):
    """all_to_all_single with uneven splits: counts, then rows (+ expert ids), then results back."""

    def __init__(self, world: int, a2a: A2A):
        self.world, self.a2a = world, a2a

    def send(self, x_TD, tok_V, dest_V, local_V, sent_W, capacity):
        D = x_TD.shape[1]
        order = torch.argsort(dest_V, stable=True)  # send buffer grouped by destination rank
        send_counts = torch.bincount(dest_V, minlength=self.world)
        sent_W += send_counts
        recv_counts = torch.empty_like(send_counts)
        self.a2a(recv_counts, send_counts, None, None)
        s_split, r_split = send_counts.tolist(), recv_counts.tolist()
        R = sum(r_split)
        local_ids = local_V[order]
        if x_TD.dtype == torch.float32:
            # ids ride along as an extra fp32 column (exact below 2**24): one collective, not two
            send = torch.cat([x_TD[tok_V[order]], local_ids.to(torch.float32)[:, None]], dim=1)
            recv = torch.empty(R, D + 1, dtype=x_TD.dtype, device=x_TD.device)
            self.a2a(recv, send, r_split, s_split)
            x_R, lid_R = recv[:, :D], recv[:, D].to(torch.int64)
        else:
            x_R = torch.empty(R, D, dtype=x_TD.dtype, device=x_TD.device)
            lid_R = torch.empty(R, dtype=torch.int64, device=x_TD.device)
            self.a2a(x_R, x_TD[tok_V[order]].contiguous(), r_split, s_split)
            self.a2a(lid_R, local_ids, r_split, s_split)
        return ExpertRows(x_R.contiguous(), lid_R), (order, s_split, r_split, x_TD.dtype, x_TD.device)

    def receive(self, y_RD, state):
        order, s_split, r_split, dtype, device = state
        y_S = torch.empty(len(order), y_RD.shape[1], dtype=dtype, device=device)
        self.a2a(y_S, y_RD, s_split, r_split)
        y_V = torch.empty_like(y_S)
        y_V[order] = y_S
        return y_V


class FixedCapacityExchange(Exchange):
    """C rows to and from every rank (this rank's pairs for that rank, then padding rows of id -1): the splits
    are known in advance, so no counts are exchanged.

    Split form (two-batch overlap, `actors.model.two_batch`): `post_send` / `finish_send` and `post_receive` /
    `finish_receive` are `send` and `receive` cut where the collective is in flight, so one micro-batch's rows
    travel while the other computes. They need the transport's split all-to-all, `post(out, inp) -> token` (the
    sends; `out` is written by `wait(token)` at the latest) and `wait(token)`, given to the constructor. There every
    dtype makes one collective per direction: the ids ride as raw bytes beside the rows (fp32: as a float column,
    as in `send`).
    """

    def __init__(self, world: int, a2a: A2A, post: Callable[[torch.Tensor, torch.Tensor], Any] | None = None,
                 wait: Callable[[Any], None] | None = None):
        self.world, self.a2a, self.post, self.wait = world, a2a, post, wait

    def _slots(self, x_TD, tok_V, dest_V, local_V, sent_W, C):
        """(send buffer [W * C, D + 1] fp32 with the ids in the last column, or None when not packed here; slot of
        each pair in it [V]); adds the rows per rank to sent_W."""
        W, dev = self.world, x_TD.device
        packed = pack_fixed_rows(x_TD, tok_V, dest_V, local_V, W, C)  # fp32 on CPU: one compiled call
        if packed is not None:
            send, slot_V, counts = packed
            sent_W += counts
            return send, slot_V
        order = torch.argsort(dest_V, stable=True)
        counts = torch.bincount(dest_V, minlength=W)
        sent_W += counts
        starts = torch.cumsum(counts, 0) - counts
        slot_V = torch.empty_like(order)  # row of each pair in the [W * C] send buffer
        slot_V[order] = dest_V[order] * C + torch.arange(dest_V.numel(), device=dev) - starts[dest_V[order]]
        return None, slot_V

    def send(self, x_TD, tok_V, dest_V, local_V, sent_W, capacity):
        W, D, dev, dt, C = self.world, x_TD.shape[1], x_TD.device, x_TD.dtype, capacity
        send, slot_V = self._slots(x_TD, tok_V, dest_V, local_V, sent_W, C)
        if dt == torch.float32:  # ids ride along as an extra column (exact below 2**24); -1 marks padding
            if send is None:
                send = torch.zeros(W * C, D + 1, dtype=dt, device=dev)
                send[:, D] = -1
                send[slot_V, :D] = x_TD[tok_V]
                send[slot_V, D] = local_V.to(dt)
            recv = torch.empty_like(send)
            self.a2a(recv, send, None, None)
            return self._rows(recv, D), slot_V
        else:
            send = torch.zeros(W * C, D, dtype=dt, device=dev)
            send[slot_V] = x_TD[tok_V]
            lid = torch.full((W * C,), -1, dtype=torch.int64, device=dev)
            lid[slot_V] = local_V
            x_R, lid_R = torch.empty_like(send), torch.empty_like(lid)
            self.a2a(x_R, send, None, None)
            self.a2a(lid_R, lid, None, None)
        # run_padded (LocalExperts): one call, no host sync on the padding
        return ExpertRows(x_R, lid_R, kind="padded"), slot_V

    @staticmethod
    def _rows(recv: torch.Tensor, D: int) -> ExpertRows:
        """The rows a received fp32 buffer [W * C, D + 1] holds for this rank's experts (ids in the last column, -1
        on padding: `run_padded` skips them in one call, no host sync)."""
        return ExpertRows(recv[:, :D], recv[:, D].to(torch.int64), kind="padded")

    def receive(self, y_RD, state):
        y_S = torch.empty_like(y_RD)
        self.a2a(y_S, y_RD, None, None)
        return y_S[state]

    def send_ids(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, rank_of_E: torch.Tensor, local_of_E: torch.Tensor,
                 sent_W: torch.Tensor, capacity: int) -> tuple[ExpertRows, torch.Tensor] | None:
        """`send` for a layer without replicas or padding ids, straight from the router's ids [T, K]: the pairs'
        ranks and local rows are looked up by the kernel that packs them (rank_of_E / local_of_E [E]: the layer's
        placement tables), so no pair tensors are built (decode: ~10 torch ops a layer fewer). Returns (rows, the
        slot of every (t, k) pair [T * K]: `receive_weighed`'s state), or None when the kernel cannot run (fp32
        only; the caller then takes `send`)."""
        packed = pack_fixed_ids(x_TD, ids_TK, rank_of_E, local_of_E, self.world, capacity)
        if packed is None:
            return None
        send, slot_TK, counts = packed
        sent_W += counts
        recv = torch.empty_like(send)
        self.a2a(recv, send, None, None)
        return self._rows(recv, x_TD.shape[1]), slot_TK

    def receive_weighed(self, y_RD: torch.Tensor, slot_TK: torch.Tensor, w_TK: torch.Tensor) -> torch.Tensor:
        """`receive` and the weighted sum at once, for a step without padding ids (the state of `send` or `send_ids`
        is then the slot of every (t, k) pair [T * K]): out [T, D] = sum_k w[t, k] * y_pair[t, k] in y's dtype (one
        compiled call after the collective for fp32; `weigh_pairs` otherwise)."""
        y_S = torch.empty_like(y_RD)
        self.a2a(y_S, y_RD.contiguous(), None, None)
        out = weigh_rows(y_S, slot_TK, w_TK)
        return weigh_pairs(y_S[slot_TK], w_TK) if out is None else out

    def post_send(self, x_TD: torch.Tensor, tok_V: torch.Tensor, dest_V: torch.Tensor, local_V: torch.Tensor,
                  sent_W: torch.Tensor, capacity: int) -> tuple:
        """`send` up to the collective, which is left in flight: returns what `finish_send` needs. Same arguments
        as `send` (capacity: C, required)."""
        W, D, dev, dt, C = self.world, x_TD.shape[1], x_TD.device, x_TD.dtype, capacity
        send, slot_V = self._slots(x_TD, tok_V, dest_V, local_V, sent_W, C)
        if send is None:
            if dt == torch.float32:
                send = torch.zeros(W * C, D + 1, dtype=dt, device=dev)
                send[:, D] = -1
                send[slot_V, :D] = x_TD[tok_V]
                send[slot_V, D] = local_V.to(dt)
            else:  # the int64 ids as raw bytes: 8 // itemsize columns of x's dtype after the row (bits copied only)
                lid = torch.full((W * C, 1), -1, dtype=torch.int64, device=dev)
                lid[slot_V, 0] = local_V
                rows = torch.zeros(W * C, D, dtype=dt, device=dev)
                rows[slot_V] = x_TD[tok_V]
                send = torch.cat([rows, lid.view(dt)], dim=1)
        recv = torch.empty_like(send)
        return self.post(recv, send), recv, slot_V, D

    def finish_send(self, pending: tuple) -> tuple[ExpertRows, Any]:
        """Wait for `post_send`'s collective: (the rows for this rank's experts, the state `receive` or
        `post_receive` needs), as `send` returns."""
        token, recv, slot_V, D = pending
        self.wait(token)
        if recv.dtype == torch.float32:
            return self._rows(recv, D), slot_V
        return ExpertRows(recv[:, :D], recv[:, D:].contiguous().view(torch.int64).view(-1), kind="padded"), slot_V

    def post_receive(self, y_RD: torch.Tensor, state: Any) -> tuple:
        """`receive` up to its collective, left in flight: y_RD [W * C, D], the experts' results (contiguous)."""
        y_S = torch.empty_like(y_RD)
        return self.post(y_S, y_RD.contiguous()), y_S, state

    def finish_receive(self, pending: tuple) -> torch.Tensor:
        """Wait for `post_receive`'s collective: this rank's pairs' results [V, D] in pair order."""
        token, y_S, state = pending
        self.wait(token)
        return y_S[state]


class AgreedCapacityExchange(Exchange):
    """The general exchange over an equal-split transport (same-node shared memory, TCP): every rank's pair count
    per destination goes to every rank (one W x W all-to-all of int64), then the fixed-capacity exchange runs with
    C = the largest count of any (source, destination) pair, which every rank computes alike. So no step needs
    torch.distributed's uneven all-to-all (gloo: ~1 ms a call, and a wait there cannot be interrupted); the
    dispatcher's all-to-all carries a C too large for one call in pieces."""

    def __init__(self, world: int, a2a: A2A, fixed: FixedCapacityExchange):
        self.world, self.a2a, self.fixed = world, a2a, fixed

    def send(self, x_TD, tok_V, dest_V, local_V, sent_W, capacity):
        W = self.world
        counts = torch.bincount(dest_V, minlength=W).to(torch.int64)
        table = torch.empty(W * W, dtype=torch.int64, device=counts.device)  # row s: rank s's counts
        self.a2a(table, counts.repeat(W), None, None)
        return self.fixed.send(x_TD, tok_V, dest_V, local_V, sent_W, max(int(table.max()), 1))

    def receive(self, y_RD, state):
        return self.fixed.receive(y_RD, state)
