"""Dispatch / combine of token rows between ranks (expert parallelism): the seams around the experts.

The MoE block reads gate -> dispatch -> experts -> combine (vLLM fused_moe's prepare / experts / finalize):
    rows, handle = dispatcher.dispatch(layer, x_TD, topk_ids_TK, may_pad=..., step_max_tokens=...)
    y_RD = rows.run(experts, topk_w_TK)               # this rank's experts (`actors.moe.experts.Experts`)
    y_TD = dispatcher.combine(y_RD, handle, topk_w_TK)  # results back to their tokens, weighted sum
`dispatch` routes each (token, k) pair to a rank that holds its expert and hands this rank the rows sent to
its experts; `combine` brings every result back to its pair and takes y[t] = sum_k w[t, k] * y_pair[t, k].
Every rank calls both for every MoE layer of every step, with zero rows if it has no tokens, so the
collectives always match.

The exchange is chosen when the dispatcher is built: with `world_size == 1` the rows go straight to the
experts (no collective: the reference every EP run must equal; without padding ids the step's tokens take
`combine_tokens`, one decode token `combine_token`: the experts' one-call paths); otherwise `torch.distributed.all_to_all_single` with uneven splits, counts exchanged
first. On top of that, a step whose agreed largest token count allows it takes the fixed-capacity exchange
(no counts: see `AllToAllDispatcher`): a per-step choice, made from `step_max_tokens`, the same on every rank.
The same-node shared-memory transport (`actors.rank.shm_collective`, or TCP across nodes), when the rank has one,
is given to the constructor and carries the collectives whose sizes every rank knows in advance; then a step
that is not fixed-capacity (a prefill) takes `AgreedCapacityExchange` instead of uneven splits: the W x W pair
counts first, then the fixed-capacity exchange at the largest of them, in pieces when a call cannot carry it all.
So no step waits in gloo's all-to-all (slower, and a wait there cannot be interrupted by an elastic regroup). A decode
layer without replicas or padding ids over that transport goes further: its rows, experts and results stay in the
segment's slots (`actors.moe.slot_exchange.SlotExchange`: no buffers or copies, the own chunk's experts before any
wait), and `combine` weighs from them.

Redundant experts (EPLB-style placement, `actors.moe.placement`, `cluster.placement.eplb_placement`): an
expert may have replicas on several ranks; each (token, expert) pair goes to exactly one replica, chosen so
that the rows this rank sends in this layer are spread as evenly as possible over ranks (water-filling, see
`_route`). A layer whose every expert has a replica on every rank (`--redundant-experts` on 2 ranks) is the
limit case: each rank's pairs stay on its own replicas and the layer makes no collective (SGLang's static dispatch
to the nearest replica; every rank reads the same placement, so all skip together). Expert id -1 in `topk_ids` is padding (policies with a variable number of experts per token pad
with id -1 and weight 0): never sent, contributes zero.

Shape legend: T = tokens on this rank, K = experts per token, D = hidden, P = T*K (token, k) pairs,
V = valid pairs (id >= 0), S = rows sent (= V), R = rows received, W = world size, E = routed
experts, M = most replicas of one expert in a layer, C = fixed capacity (rows to and from each rank).
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
import torch
import torch.distributed as dist

from actors.moe.exchange import (AgreedCapacityExchange, CountsExchange, DispatchHandle, FixedCapacityExchange,
                                 LocalExchange, weigh_pairs)
from actors.moe.experts import ExpertRows, Experts
from actors.moe.placement import ExpertPlacement, water_fill
from actors.moe.slot_exchange import SlotExchange
from actors.moe.split_dispatch import SplitDispatchMixin
from kernels import tuning


class Dispatcher(ABC):
    """Route (token, expert) pairs to the experts' ranks and bring the results back (the seam around `Experts`)."""

    @abstractmethod
    def dispatch(self, layer: int, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, *, may_pad: bool = True,
                 step_max_tokens: int | None = None) -> tuple[ExpertRows, DispatchHandle]:
        """Send each valid (token, k) pair's row to its expert's rank; returns the rows this rank's experts get.

        may_pad=False promises no id is -1 (the gating policy cannot pad), which skips the padding scan.
        step_max_tokens: the largest token count of this step on any rank (agreed; None: unknown)."""

    @abstractmethod
    def combine(self, y_RD: torch.Tensor, handle: DispatchHandle, topk_w_TK: torch.Tensor) -> torch.Tensor:
        """Results of `dispatch`'s rows back to their pairs: out [T, D] = sum_k w[t, k] * y_pair[t, k], in x's
        dtype (padding pairs contribute zero)."""

    def overlaps(self, step_max_tokens: int | None) -> bool:
        """Whether a step of that agreed size may run as two micro-batches with split calls (`dispatch_post` ...,
        `actors.moe.split_dispatch`); the base dispatcher has none."""
        return False

    def run(self, layer: int, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_w_TK: torch.Tensor,
            experts: Experts, may_pad: bool = True, step_max_tokens: int | None = None) -> torch.Tensor:
        """dispatch -> experts -> combine in one call: out [T, D] = sum_k w[t, k] * expert_{ids[t, k]}(x[t])
        (callers that hold one layer's experts: tests, benchmarks; the MoE block makes the three calls)."""
        rows, handle = self.dispatch(layer, x_TD, topk_ids_TK, may_pad=may_pad, step_max_tokens=step_max_tokens)
        return self.combine(rows.run(experts, topk_w_TK), handle, topk_w_TK)


class AllToAllDispatcher(SplitDispatchMixin, Dispatcher):
    """The expert-parallel dispatcher of one rank: placement tables, replica choice and the exchanges.

    Exchanges (chosen at construction): `LocalExchange` when world_size is 1, else `CountsExchange` (with a
    transport: `AgreedCapacityExchange`), plus
    `FixedCapacityExchange` for the steps that allow it. Fixed capacity (decode): when the lockstep loop has
    agreed on this step's largest per-rank token count T_max (`step_max_tokens`) and C = T_max *
    `max_experts_per_token` is at most `FIXED_MAX_ROWS`, every rank sends every rank exactly C rows, so the
    splits are known in advance. That saves one collective (and its host sync) per MoE layer: 2 instead of 3 in
    fp32, where the ids ride in the rows. A rank receives at most C real rows from each peer because it sends at
    most T * K' <= C pairs in all.

    Args:
        placement: which ranks hold which experts. rank: this rank. group: the EP process group (None: default).
        device: where the tables and counters live. shm: the same-node shared-memory transport
            (`actors.rank.shm_collective.ShmAllToAll`; None: torch.distributed for everything); it carries the
            equal-split exchanges whose per-peer size `fits`. max_experts_per_token: K' at most, over every gating
            policy (the fixed capacity's factor, the same on every rank).

    Timings of the collectives are accumulated in `comm_s` (seconds) for the benchmark breakdown;
    `sent_rows` [L, W] int64 counts the rows this rank sent to each rank per layer (cumulative), i.e. the
    measured rank load that replicas balance. `set_placement` swaps the tables between steps. The split calls
    (`dispatch_post` ... `combine_finish`, two-batch overlap) are `actors.moe.split_dispatch.SplitDispatchMixin`'s.
    """

    def __init__(self, placement: ExpertPlacement, rank: int, group=None, device: torch.device | str = "cpu", *,
                 shm=None, max_experts_per_token: int = 1):
        self.rank = rank
        self.world = placement.world_size
        self.group = group
        self.device = torch.device(device)
        self.shm = shm
        self._comm_s = 0.0
        self.max_experts_per_token = max_experts_per_token
        self._local = LocalExchange()
        self._exchange = self._local if self.world == 1 else CountsExchange(self.world, self._a2a)
        self._fixed = None if self.world == 1 else FixedCapacityExchange(self.world, self._a2a, self._a2a_post,
                                                                          self._a2a_wait)
        # two-batch overlap needs a split all-to-all: torch.distributed's async_op (gloo, NCCL) or the TCP transport's
        # post / complete; the same-node shared memory has none (one collective in flight, `shm_collective`)
        self.can_overlap = self.world > 1 and (shm is None or callable(getattr(shm, "post", None)))
        if shm is not None and self._fixed is not None:  # an equal-split transport carries every step
            self._exchange = AgreedCapacityExchange(self.world, self._a2a, self._fixed)
        # same-node shared memory: the decode layers' rows, experts and results in its slots (no copies)
        self._slots = SlotExchange(shm) if self.world > 1 and SlotExchange.usable(shm) else None
        self._sent = torch.zeros(placement.num_layers, self.world, dtype=torch.int64, device=self.device)
        self._sent_fast = [0] * placement.num_layers  # rows of the one-token fast path (host ints: no tensor op)
        self._tok_of = {}  # (T, K) -> token index of each (token, k) pair [T * K] (read only: 2 ops per layer saved)
        self.set_placement(placement)

    @property
    def comm_s(self) -> float:
        """Seconds in collectives (cumulative): the all-to-alls', plus the slot exchange's packing, waits and
        combines."""
        return self._comm_s + (self._slots.comm_s if self._slots is not None else 0.0)

    @property
    def sent_rows(self) -> torch.Tensor:
        """[L, W] int64: rows this rank sent to each rank per layer (cumulative)."""
        out = self._sent.clone()
        out[:, self.rank] += torch.tensor(self._sent_fast, dtype=torch.int64, device=self.device)
        return out

    def set_placement(self, placement: ExpertPlacement) -> None:
        """Use `placement` from the next `dispatch` on (the caller makes sure every rank switches at the same step).

        Raises:
            ValueError: its world_size or layer count differs from the dispatcher's.
        """
        if placement.world_size != self.world or placement.num_layers != self._sent.shape[0]:
            raise ValueError(f"placement world_size={placement.world_size}, layers={placement.num_layers}; "
                             f"dispatcher has world_size={self.world}, layers={self._sent.shape[0]}")
        self.placement = placement
        self._tables(placement)


    def _tables(self, placement: ExpertPlacement) -> None:
        dev = self.device
        self.rank_of = [torch.tensor(r, dtype=torch.int64, device=dev) for r in placement.rank_of]
        self.local_of = [torch.tensor(i, dtype=torch.int64, device=dev) for i in placement.local_index]
        # replica tables [E, M], padded with the primary replica; only layers with replicas use them
        self.rep_rank, self.rep_local, self.num_rep, self.rep_list = [], [], [], []
        for layer in placement.replicas:
            M = max(len(reps) for reps in layer)
            pad = [reps + [reps[0]] * (M - len(reps)) for reps in layer]
            self.rep_rank.append(torch.tensor([[r for r, _ in reps] for reps in pad], dtype=torch.int64, device=dev))
            self.rep_local.append(torch.tensor([[i for _, i in reps] for reps in pad], dtype=torch.int64, device=dev))
            self.num_rep.append(torch.tensor([len(reps) for reps in layer], dtype=torch.int64, device=dev))
            self.rep_list.append([[r for r, _ in reps] for reps in layer] if M > 1 else None)
        # layers where a global expert id is its own local row (one rank, no replicas): no table lookups
        self.identity = [self.world == 1 and reps is None and loc == list(range(len(loc)))
                         for reps, loc in zip(self.rep_list, placement.local_index)]
        # fully replicated layers (every expert has a replica on every rank: `--redundant-experts` on 2 ranks): each
        # rank's pairs go to its own replicas and no rank sends anything, so the layer makes no collective (every
        # rank reads the same placement, so all skip it together). [E + 1] int64: this rank's local row of each
        # expert, then -1, so padding ids (-1) index the last entry and stay -1.
        self.replicated = [self.world > 1 and all(len({r for r, _ in reps}) == self.world for reps in layer)
                           for layer in placement.replicas]
        self.local_row = [torch.tensor([next(i for r, i in reps if r == self.rank) for reps in layer] + [-1],
                                       dtype=torch.int64, device=dev) if full else None
                          for full, layer in zip(self.replicated, placement.replicas)]


    def _a2a(self, out: torch.Tensor, inp: torch.Tensor, out_splits, in_splits) -> None:
        t0 = time.perf_counter()
        if out_splits is None and self.shm is not None and self.shm.fits(inp.nbytes // self.world):
            # equal splits of an agreed size: every rank takes this branch
            self.shm.all_to_all_single(out, inp, within_step=True)
        elif out_splits is None and self.shm is not None and self.shm.fits(inp[0].nbytes):
            self._a2a_pieces(out, inp)  # too large for one call, not for one row: in pieces
        else:
            dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group)
        self._comm_s += time.perf_counter() - t0

    def _a2a_pieces(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """An equal-split all-to-all larger than one transport call, in calls of as many rows per peer as fit (the
        same count on every rank: it depends on the agreed shape only). out, inp: [W * n, ...] contiguous."""
        W = self.world
        src, dst = inp.view(W, inp.shape[0] // W, -1), out.view(W, out.shape[0] // W, -1)
        n, row = src.shape[1], src[0, 0].nbytes
        step = max(1, self.shm.max_chunk_bytes // row)
        for a in range(0, n, step):
            piece = src[:, a: a + step].contiguous()
            got = torch.empty_like(piece)
            self.shm.all_to_all_single(got.view(-1, *inp.shape[1:]), piece.view(-1, *inp.shape[1:]),
                                       within_step=True)
            dst[:, a: a + step] = got

    def _route(self, layer: int, ids_V: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(dest rank [V], local row [V]) of each valid pair; a replicated expert's pairs are water-filled
        over its replicas by the rows this rank already sends to each rank in this layer (pairs of
        single-replica experts first, then replicated experts by descending pair count)."""
        reps = self.rep_list[layer]
        if reps is None:
            return self.rank_of[layer][ids_V], self.local_of[layer][ids_V]
        multi = self.num_rep[layer][ids_V] > 1
        load = torch.bincount(self.rank_of[layer][ids_V[~multi]], minlength=self.world).tolist()
        choice_V = torch.zeros_like(ids_V)
        idx_M = multi.nonzero().squeeze(1)
        if idx_M.numel():
            ids_M = ids_V[idx_M]
            counts = torch.bincount(ids_M, minlength=len(reps)).tolist()
            for e in sorted((e for e, n in enumerate(counts) if n), key=lambda e: (-counts[e], e)):
                ranks = reps[e]
                # ties go to the replica nearest this rank (its own first: no network hop)
                alloc = water_fill([load[r] for r in ranks], counts[e], [(r - self.rank) % self.world for r in ranks])
                for r, a in zip(ranks, alloc):
                    load[r] += a
                pos = idx_M[(ids_M == e).nonzero().squeeze(1)]
                choice_V[pos] = torch.repeat_interleave(torch.arange(len(ranks), device=ids_V.device),
                                                        torch.tensor(alloc, device=ids_V.device))
        return self.rep_rank[layer][ids_V, choice_V], self.rep_local[layer][ids_V, choice_V]

    def _step_exchange(self, K: int, step_max_tokens: int | None) -> tuple[Exchange, int | None]:
        """This step's exchange and its capacity: fixed capacity when the agreed step size allows it (every rank
        computes the same C from agreed values only, never from its own K, which policies vary), else the
        construction-time exchange (capacity None)."""
        if self._fixed is not None and step_max_tokens is not None and (
                step_max_tokens * self.max_experts_per_token <= tuning.FIXED_MAX_ROWS):
            if K > self.max_experts_per_token:
                raise RuntimeError(f"{K} experts per token exceed max_experts_per_token={self.max_experts_per_token}")
            return self._fixed, step_max_tokens * self.max_experts_per_token
        return self._exchange, None

    def dispatch(self, layer, x_TD, topk_ids_TK, *, may_pad=True, step_max_tokens=None):
        T, K = topk_ids_TK.shape
        if not may_pad and self.identity[layer]:  # one rank, no padding: the experts weigh and sum each token's K
            self._sent_fast[layer] += T * K
            if T == 1:  # one decode token: fewest ops
                return ExpertRows(x_TD, topk_ids_TK[0], kind="token"), DispatchHandle(None, None, T, K)
            return ExpertRows(x_TD, topk_ids_TK, kind="tokens"), DispatchHandle(None, None, T, K)
        if self.replicated[layer]:
            return self._dispatch_local(layer, x_TD, self.local_row[layer][topk_ids_TK], may_pad)
        exchange, capacity = self._step_exchange(K, step_max_tokens)
        if exchange is self._fixed and not may_pad and self.rep_list[layer] is None:  # decode, no replicas
            if self._slots is not None and self._slots.fits(x_TD, capacity):  # same node: in the segment's slots
                rows, state = self._slots.send_ids(x_TD, topk_ids_TK, self.rank_of[layer], self.local_of[layer],
                                                   self._sent[layer], capacity)
                return rows, DispatchHandle(self._slots, state, T, K)
            got = exchange.send_ids(x_TD, topk_ids_TK, self.rank_of[layer], self.local_of[layer], self._sent[layer],
                                    capacity)
            if got is not None:
                return got[0], DispatchHandle(exchange, got[1], T, K)
        tok_V, dest_V, local_V, keep_V = self._pairs(layer, x_TD, topk_ids_TK, may_pad)
        rows, state = exchange.send(x_TD, tok_V, dest_V, local_V, self._sent[layer], capacity)
        return rows, DispatchHandle(exchange, state, T, K, keep_V)

    def _pairs(self, layer: int, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, may_pad: bool):
        """(token [V], destination rank [V], local expert row [V] of each valid pair, and keep_V: where they sit
        among the T*K pairs, None when none is padding)."""
        T, K = topk_ids_TK.shape
        ids_P = topk_ids_TK.reshape(-1)
        tok_P = self._tok_of.get((T, K))
        if tok_P is None:
            if len(self._tok_of) >= 256:  # one entry per batch size seen: bounded
                self._tok_of.clear()
            tok_P = self._tok_of[(T, K)] = torch.arange(T, device=x_TD.device).repeat_interleave(K)
        padded = False
        if may_pad:  # id -1 = padding: never sent (the scan is a host sync, so only when a policy can pad)
            keep_V = (ids_P >= 0).nonzero().squeeze(1)
            padded = keep_V.numel() != ids_P.numel()
        ids_V, tok_V = (ids_P[keep_V], tok_P[keep_V]) if padded else (ids_P, tok_P)
        dest_V, local_V = self._route(layer, ids_V)
        return tok_V, dest_V, local_V, keep_V if padded else None

    def _dispatch_local(self, layer: int, x_TD: torch.Tensor, local_TK: torch.Tensor,
                        may_pad: bool) -> tuple[ExpertRows, DispatchHandle]:
        """A fully replicated layer: this rank's own replicas take every pair (local rows [T, K], -1: padding), as
        one rank's experts would: weighed and summed by the experts (no padding) or as rows (padding)."""
        T, K = local_TK.shape
        if may_pad:
            keep_V = (local_TK.reshape(-1) >= 0).nonzero().squeeze(1)
            if keep_V.numel() != T * K:  # padding: the valid pairs as rows, combined like an exchange's
                self._sent[layer, self.rank] += keep_V.numel()
                tok_V = keep_V // K
                return (ExpertRows(x_TD[tok_V], local_TK.reshape(-1)[keep_V]),
                        DispatchHandle(self._local, None, T, K, keep_V))
        self._sent_fast[layer] += T * K
        if T == 1:
            return ExpertRows(x_TD, local_TK[0], kind="token"), DispatchHandle(None, None, T, K)
        return ExpertRows(x_TD, local_TK, kind="tokens"), DispatchHandle(None, None, T, K)

    def combine(self, y_RD, handle, topk_w_TK):
        if handle.exchange is None:  # the one-rank paths: the experts already weighed and summed each token's K
            return y_RD
        if handle.exchange is self._slots:  # the results wait in the slots (y_RD is None)
            return self._slots.combine(handle.state, topk_w_TK)
        if handle.exchange is self._fixed and handle.keep_V is None:  # gathered and weighed in one call
            return self._fixed.receive_weighed(y_RD, handle.state, topk_w_TK)
        return self._weigh(handle.exchange.receive(y_RD, handle.state), handle, topk_w_TK)

    def _weigh(self, y_V: torch.Tensor, handle: DispatchHandle, topk_w_TK: torch.Tensor) -> torch.Tensor:
        """The valid pairs' results [V, D] -> out [T, D] = sum_k w[t, k] * y_pair[t, k] (padding pairs: zero)."""
        T, K, D = handle.T, handle.K, y_V.shape[1]
        if handle.keep_V is not None:  # padding pairs contribute exactly zero (weight 0, row never computed)
            y_P = torch.zeros(T * K, D, dtype=y_V.dtype, device=y_V.device)
            y_P[handle.keep_V] = y_V
        else:
            y_P = y_V
        return weigh_pairs(y_P, topk_w_TK)
