"""Dispatch and combine split where the all-to-all is in flight: the dispatcher side of two-batch overlap.

`AllToAllDispatcher.dispatch` / `combine` make each collective and wait for it. Two-batch overlap
(`actors.model.two_batch`) instead starts one micro-batch's exchange, computes the other micro-batch, and only
then waits:
    p = dispatcher.dispatch_post(layer, x_TD, ids_TK, may_pad=..., step_max_tokens=C_tokens)  # rows sent
    ... the other micro-batch computes ...
    rows, handle = dispatcher.dispatch_finish(p)                      # the peers' rows are here
    q = dispatcher.combine_post(rows.run(experts, w_TK), handle, w_TK)  # results sent back
    ... the other micro-batch computes ...
    y_TD = dispatcher.combine_finish(q)
Same results as `dispatch` + `combine` (the fixed-capacity exchange's rows, only the waiting moves). Only the
fixed-capacity exchange (decode) has a split form, over a split transport: the TCP transport's `post` /
`complete` when the chunk fits it, else torch.distributed's `async_op=True` (gloo, NCCL); `can_overlap` is False
with the same-node shared memory (one collective in flight). Layers that make no collective (fully replicated:
redundant experts on 2 ranks) finish at once. Calls finish in the order they were posted (the TCP transport's
rule), and every rank makes the same calls in the same order (the caller's schedule depends on agreed values only).

Shape legend: T = tokens of the micro-batch on this rank, K = experts per token, D = hidden, R = rows received
(W x C), W = world size, C = fixed capacity.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from actors.moe.exchange import DispatchHandle
from actors.moe.experts import ExpertRows
from kernels import tuning


@dataclass(slots=True)
class PendingExchange:
    """A split dispatch or combine between its post and its finish: the exchange's in-flight state (None: the layer
    made no collective and `done` holds the result), the pair shape (T, K), keep_V (valid pairs among T*K, None:
    all) and, for a combine, its handle and weights."""

    state: Any
    done: Any = None
    T: int = 0
    K: int = 0
    keep_V: torch.Tensor | None = None
    handle: Any = None
    topk_w_TK: torch.Tensor | None = None


class SplitDispatchMixin:
    """The split calls of `actors.moe.dispatch.AllToAllDispatcher` (a mixin on its state: world, group, shm,
    _comm_s, max_experts_per_token, replicated, local_row, _fixed, _sent, can_overlap)."""

    def overlaps(self, step_max_tokens: int | None) -> bool:
        """Whether a step whose agreed largest token count is `step_max_tokens` can run as two micro-batches of at
        most ceil(step_max_tokens / 2) tokens each: a split transport (`can_overlap`) and the fixed-capacity
        exchange at that micro-batch size. Depends on agreed values only: the same answer on every rank."""
        return (self.can_overlap and step_max_tokens is not None and step_max_tokens >= 1
                and -(-step_max_tokens // 2) * self.max_experts_per_token <= tuning.FIXED_MAX_ROWS)

    def dispatch_post(self, layer: int, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, *, may_pad: bool = True,
                      step_max_tokens: int) -> PendingExchange:
        """`dispatch` up to its all-to-all, which is left in flight; `dispatch_finish` returns what `dispatch` would.

        Args:
            x_TD: [T, D] this micro-batch's rows (T may be 0). topk_ids_TK: [T, K] int64 (-1: padding, when
                may_pad). step_max_tokens: the micro-batch's agreed largest token count on any rank (its capacity).
        Raises:
            ValueError: `overlaps` is False for that size (no split transport, or too large for fixed capacity).
            RuntimeError: K exceeds max_experts_per_token.
        """
        if not (self.can_overlap and step_max_tokens * self.max_experts_per_token <= tuning.FIXED_MAX_ROWS):
            raise ValueError(f"dispatch_post: step_max_tokens={step_max_tokens} cannot overlap (split transport: "
                             f"{self.can_overlap}; capacity {step_max_tokens * self.max_experts_per_token} rows, "
                             f"limit FIXED_MAX_ROWS={tuning.FIXED_MAX_ROWS})")
        T, K = topk_ids_TK.shape
        if self.replicated[layer]:  # no collective: finished now
            return PendingExchange(None, self._dispatch_local(layer, x_TD, self.local_row[layer][topk_ids_TK], may_pad))
        if K > self.max_experts_per_token:
            raise RuntimeError(f"{K} experts per token exceed max_experts_per_token={self.max_experts_per_token}")
        tok_V, dest_V, local_V, keep_V = self._pairs(layer, x_TD, topk_ids_TK, may_pad)
        state = self._fixed.post_send(x_TD.contiguous(), tok_V, dest_V, local_V, self._sent[layer],
                                      step_max_tokens * self.max_experts_per_token)
        return PendingExchange(state, None, T, K, keep_V)

    def dispatch_finish(self, p: PendingExchange) -> tuple[ExpertRows, Any]:
        """Wait for `dispatch_post`'s rows: (rows for this rank's experts, the handle `combine_post` takes)."""
        if p.state is None:
            return p.done
        rows, state = self._fixed.finish_send(p.state)
        return rows, DispatchHandle(self._fixed, state, p.T, p.K, p.keep_V)

    def combine_post(self, y_RD: torch.Tensor, handle, topk_w_TK: torch.Tensor) -> PendingExchange:
        """`combine` up to its all-to-all (y_RD: the experts' results on `dispatch_finish`'s rows), left in flight."""
        if handle.exchange is not self._fixed:  # a layer without a collective: combined now
            return PendingExchange(None, self.combine(y_RD, handle, topk_w_TK))
        return PendingExchange(self._fixed.post_receive(y_RD, handle.state), None, handle=handle, topk_w_TK=topk_w_TK)

    def combine_finish(self, p: PendingExchange) -> torch.Tensor:
        """Wait for `combine_post`'s results: out [T, D] = sum_k w[t, k] * y_pair[t, k], in x's dtype."""
        if p.state is None:
            return p.done
        return self._weigh(self._fixed.finish_receive(p.state), p.handle, p.topk_w_TK)

    def _a2a_post(self, out: torch.Tensor, inp: torch.Tensor) -> tuple:
        """An equal-split all-to-all left in flight (`FixedCapacityExchange.post_send`): over the TCP transport when
        the chunk `fits` (its `post`), else torch.distributed's with async_op=True (the same choice on every rank:
        it depends on the agreed size only). `_a2a_wait` finishes it; `out` is written by then."""
        t0 = time.perf_counter()
        if self.shm is not None and self.shm.fits(inp.nbytes // self.world):
            token = (self.shm.post(inp), out)
        else:
            token = (dist.all_to_all_single(out, inp, group=self.group, async_op=True), None)
        self._comm_s += time.perf_counter() - t0
        return token

    def _a2a_wait(self, token: tuple) -> None:
        t0 = time.perf_counter()
        call, out = token
        if out is not None:
            self.shm.complete(call, out)
        else:
            call.wait()
        self._comm_s += time.perf_counter() - t0
