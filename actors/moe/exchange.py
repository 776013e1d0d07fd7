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
from typing import Any, Callable

import torch

from actors.moe.experts import ExpertRows
from kernels.cpu import pack_fixed_rows

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
    are known in advance, so no counts are exchanged."""

    def __init__(self, world: int, a2a: A2A):
        self.world, self.a2a = world, a2a

    def send(self, x_TD, tok_V, dest_V, local_V, sent_W, capacity):
        W, D, dev, dt, C = self.world, x_TD.shape[1], x_TD.device, x_TD.dtype, capacity
        V = dest_V.numel()
        packed = pack_fixed_rows(x_TD, tok_V, dest_V, local_V, W, C)  # fp32 on CPU: one compiled call
        if packed is not None:
            send, slot_V, counts = packed
            sent_W += counts
        else:
            order = torch.argsort(dest_V, stable=True)
            counts = torch.bincount(dest_V, minlength=W)
            sent_W += counts
            starts = torch.cumsum(counts, 0) - counts
            slot_V = torch.empty_like(order)  # row of each pair in the [W * C] send buffer
            slot_V[order] = dest_V[order] * C + torch.arange(V, device=dev) - starts[dest_V[order]]
        if dt == torch.float32:  # ids ride along as an extra column (exact below 2**24); -1 marks padding
            if packed is None:
                send = torch.zeros(W * C, D + 1, dtype=dt, device=dev)
                send[:, D] = -1
                send[slot_V, :D] = x_TD[tok_V]
                send[slot_V, D] = local_V.to(dt)
            recv = torch.empty_like(send)
            self.a2a(recv, send, None, None)
            x_R, lid_R = recv[:, :D], recv[:, D].to(torch.int64)
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

    def receive(self, y_RD, state):
        y_S = torch.empty_like(y_RD)
        self.a2a(y_S, y_RD, None, None)
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
