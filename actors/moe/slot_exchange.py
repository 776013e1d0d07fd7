"""The expert-parallel decode exchange in the same-node shared-memory segment's own slots: no buffers, no copies.

Role. A decode step's MoE layer without replicas or padding ids (the fixed-capacity case of
`actors.moe.dispatch.AllToAllDispatcher`), over the same-node transport (`actors.rank.shm_collective.ShmAllToAll`),
runs its dispatch, experts and combine on the segment itself (kernels/csrc/ep_exchange.c: the protocol, and why
the slots may be read in place):
- `send_ids` packs this rank's (token, expert) pairs straight into each destination's slot and publishes (one
  compiled call);
- the experts (`ExpertRows` of kind "slots": `SlotRows.run`) run on each source's chunk where it lies, this rank's
  own chunk first, before any wait (so its experts overlap the peers' lag), then each peer's as it arrives, writing
  the results straight into the slots their senders read: bf16 `LocalExperts` in one compiled call for every chunk;
  any other `Experts` chunk by chunk through `run_padded` (a copy of each chunk's results);
- `combine` waits for every peer's results and takes each token's weighted sum from their slots (one compiled call).
Against `FixedCapacityExchange` over the same transport, per layer this drops the send and receive buffers, four
copies of the W x C rows, ~10 torch ops and two collectives' Python; the results equal it to fp32 rounding (the
same kernels on the same rows, grouped per source chunk: tests).

Invariant: every rank of the group takes this path for the same layers of the same steps (the choice depends on
the agreed capacity, the model's width and dtype and the placement only: `fits`), since its calls are numbered in
the transport's one sequence (`ShmAllToAll.reserve`: two per layer, the dispatch and the combine).

Shape legend: T = tokens on this rank, K = experts per token, D = hidden, E = routed experts, W = world size,
C = fixed capacity (rows to and from each rank).
"""
from __future__ import annotations

import ctypes
import time
from typing import Callable

import torch

from actors.moe.experts import ExpertRows, Experts, LocalExperts
from actors.rank.shm_collective import LINE, ShmAllToAll
from kernels.cpu import _build
from kernels.cpu._abi import EpCombineArgs, EpDispatchArgs, EpExpertsArgs
from kernels.cpu.packing import panels


class SlotRows:
    """The rows a `SlotExchange.send_ids` left in the slots for this rank's experts (`ExpertRows.source`)."""

    __slots__ = ("exchange", "call", "C", "D")

    def __init__(self, exchange: "SlotExchange", call: int, C: int, D: int):
        self.exchange, self.call, self.C, self.D = exchange, call, C, D

    def run(self, experts: Experts) -> None:
        """This rank's experts on every source's chunk, results left in the slots for `SlotExchange.combine`."""
        self.exchange.run_experts(experts, self)


class SlotExchange:
    """Dispatch, experts and combine of one rank in the shared-memory segment's slots (module docstring).

    Args:
        shm: the group's same-node transport (its compiled calls must run: `usable`).

    `comm_s` accumulates the seconds spent packing, waiting for peers and combining (the dispatcher's breakdown).
    """

    def __init__(self, shm: ShmAllToAll):
        self.shm, self.lib = shm, _build.lib()
        self.comm_s = 0.0
        self._d, self._e, self._c = EpDispatchArgs(), EpExpertsArgs(), EpCombineArgs()
        for a in (self._d, self._e, self._c):  # filled once; each call sets the rest
            a.base, a.line, a.W, a.r, a.slot_bytes = shm.base, LINE, shm.world, shm.rank, shm.slot_bytes

    @staticmethod
    def usable(shm: ShmAllToAll | None) -> bool:
        """Whether a transport can carry this exchange: same-node shared memory with its compiled calls."""
        return isinstance(shm, ShmAllToAll) and _build.lib() is not None

    def fits(self, x_TD: torch.Tensor, capacity: int) -> bool:
        """Whether a layer of this width and dtype goes through the slots at this agreed capacity (the same answer on
        every rank: fp32 rows on CPU, C rows of D + 1 floats within a slot, transport open)."""
        return (not self.shm.closed and x_TD.dtype is torch.float32 and x_TD.device.type == "cpu"
                and capacity * (x_TD.shape[1] + 1) * 4 <= self.shm.slot_bytes)

    def send_ids(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, rank_of_E: torch.Tensor, local_of_E: torch.Tensor,
                 sent_W: torch.Tensor, capacity: int) -> tuple[ExpertRows, tuple]:
        """Pack pair (t, k) (expert ids[t, k] on rank rank_of_E[e] as local row local_of_E[e]) into its rank's slot
        and publish; adds the pairs sent per rank to sent_W [W] (contiguous int64) in place.

        Args: x_TD [T, D] fp32; ids_TK [T, K] expert ids in [0, E); rank_of_E / local_of_E [E] int64 (the layer's
            placement); capacity: C, the agreed rows per rank.
        Returns: (ExpertRows of kind "slots", the state `combine` needs).
        Raises: ValueError: an id outside [0, E), a rank outside the group, or more than C pairs for one rank.
        """
        t0 = time.perf_counter()
        T, K = ids_TK.shape
        x = x_TD if x_TD.stride(-1) == 1 else x_TD.contiguous()
        ids = ids_TK.to(torch.int64).contiguous()
        slot = torch.empty(T * K, dtype=torch.int64)
        call = self.shm.reserve(2)
        a = self._d
        a.call, a.x, a.sx, a.D, a.ids, a.T, a.K = call, x.data_ptr(), x.stride(0), x.shape[1], ids.data_ptr(), T, K
        a.rank_of, a.local_of, a.E, a.C = rank_of_E.data_ptr(), local_of_E.data_ptr(), rank_of_E.numel(), capacity
        a.slot, a.sent = slot.data_ptr(), sent_W.data_ptr()
        rc = self.lib.moeray_ep_dispatch(ctypes.byref(a))
        if rc == -2:
            raise ValueError(f"slot exchange: an expert id outside [0, {rank_of_E.numel()})")
        if rc:
            raise ValueError(f"slot exchange: a rank outside [0, {self.shm.world}) or more than capacity={capacity} "
                             "pairs for one rank")
        self.comm_s += time.perf_counter() - t0
        rows = SlotRows(self, call, capacity, x.shape[1])
        return ExpertRows(None, None, kind="slots", source=rows), (rows, slot)

    def run_experts(self, experts: Experts, rows: SlotRows) -> None:
        """`experts` on the chunk from every rank (own first, then each peer's once published), results into the
        slots their senders read, then publish. Raises RuntimeError (a peer timed out, exited, or the group is
        interrupted), ValueError (a local id out of range), MemoryError (no scratch)."""
        shm, W, r, C, D = self.shm, self.shm.world, self.shm.rank, rows.C, rows.D
        gu = experts.w_gate_up if isinstance(experts, LocalExperts) else None
        if gu is not None and gu.dtype is torch.bfloat16 and gu.is_contiguous() and experts.w_down.is_contiguous():
            dn = experts.w_down
            gup, dnp = panels(gu), panels(dn)
            e = self._e
            e.call, e.C, e.D, e.I, e.E = rows.call, C, D, dn.shape[2], gu.shape[0]
            e.gu, e.dn = gu.data_ptr(), dn.data_ptr()
            e.gup, e.dnp = (None if gup is None else gup.data_ptr()), (None if dnp is None else dnp.data_ptr())
            e.next, e.spin_ns, e.wait_ns, e.yield_ns, e.waited_ns = 0, shm.step_spin_ns, shm.slice_ns, shm.yield_ns, 0
            s = self._until_done(lambda: self.lib.moeray_ep_experts(ctypes.byref(e)))
            if s == -2:
                raise ValueError(f"slot exchange: a local expert id >= {gu.shape[0]}")
            if s == -3:
                raise MemoryError(f"slot exchange: no scratch for {C} rows")
            waited = e.waited_ns * 1e-9
        else:  # any other experts: chunk by chunk through run_padded
            waited, bank = 0.0, rows.call & 1
            for i in range(W):
                s = (r + i) % W
                if s != r:
                    waited += self._wait(s, rows.call + 1)
                x = shm.slot(bank, s, r, C * (D + 1) * 4).view(torch.float32).view(C, D + 1)
                y = experts.run_padded(x[:, :D], x[:, D].to(torch.int64))
                shm.slot(bank ^ 1, r, s, C * D * 4).view(torch.float32).view(C, D).copy_(y)
            self.lib.moeray_shm_publish(shm.base, LINE, r, rows.call + 2)
        shm.wait_s += waited
        self.comm_s += waited

    def _wait(self, s: int, target: int) -> float:
        """Wait until rank s published `target` (liveness checks between slices); returns the seconds waited."""
        shm, t0 = self.shm, time.perf_counter()
        self._until_done(lambda: self.lib.moeray_shm_wait(shm.base, LINE, s, target, shm.step_spin_ns, shm.slice_ns,
                                                          shm.yield_ns))
        return time.perf_counter() - t0

    def _until_done(self, call: Callable[[], int]) -> int:
        """`call()` (a compiled wait: the peer it still waits for when a liveness slice passed, else a code < 0) again
        after each slice, once `ShmAllToAll.check_peer` found that peer alive and in time; returns the final code.
        Raises RuntimeError as `check_peer` does."""
        t0 = time.perf_counter()
        s = call()
        while s >= 0:
            self.shm.check_peer(s, time.perf_counter() - t0)
            s = call()
        return s

    def combine(self, state: tuple, w_TK: torch.Tensor) -> torch.Tensor:
        """Wait for every peer's results, then out [T, D] fp32 = sum_k w[t, k] * result of pair (t, k).
        Raises RuntimeError as `run_experts` does."""
        rows, slot = state
        shm, t0 = self.shm, time.perf_counter()
        T, K = w_TK.shape
        w = w_TK if w_TK.dtype is torch.float32 and w_TK.is_contiguous() else w_TK.to(torch.float32).contiguous()
        out = torch.empty(T, rows.D, dtype=torch.float32)
        c = self._c
        c.call, c.C, c.D, c.slot, c.w = rows.call, rows.C, rows.D, slot.data_ptr(), w.data_ptr()
        c.T, c.K, c.out = T, K, out.data_ptr()
        c.spin_ns, c.wait_ns, c.yield_ns, c.waited_ns = shm.step_spin_ns, shm.slice_ns, shm.yield_ns, 0
        self._until_done(lambda: self.lib.moeray_ep_combine(ctypes.byref(c)))
        shm.wait_s += c.waited_ns * 1e-9
        self.comm_s += time.perf_counter() - t0
        return out
