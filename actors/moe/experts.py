"""The routed experts of one layer on one rank: the `Experts` seam and its full-precision implementation.

`Experts` is what the MoE block runs between dispatch and combine (`actors.moe.dispatch`): rows in any order,
each with the local row of its expert (0..E_loc-1), results in the rows' order and dtype. Beside the general
call it has the entries the dispatcher's rows may need: `ExpertRows` (what a dispatcher hands the experts)
picks one in `run`: `run_padded` (a fixed-capacity exchange: rows with id -1 give zero rows), `combine_token`
(one decode token through its K experts on one rank, weighted and summed; `run_token` without the sum),
`combine_tokens` (every token of a step through its K experts on one rank, weighted and summed).
No entry is probed with getattr: every implementation has all five. The protocol's own bodies are the
reference for those entries, built on `__call__`; an implementation subclasses it and overrides what it can do
faster. `LocalExperts` (here) holds full-precision weights; `actors.experts.packed.PackedLayerExperts` packed
ones with a dequantized cache.

Shape legend: R = token rows received for this rank's experts, D = hidden, I = expert intermediate,
E_loc = experts held on this rank, K = experts per token.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from kernels import tuning
from kernels.cpu import expert_ffn, linear


class Experts(Protocol):
    """The experts of one layer that live on this rank (local rows 0..E_loc-1)."""

    def __call__(self, x_RD: torch.Tensor, local_ids_R: torch.Tensor) -> torch.Tensor:
        """y[r] = expert[local_ids[r]](x[r]): [R, D] in x's dtype; rows may be in any order, R may be 0."""
        ...

    def run_padded(self, x_RD: torch.Tensor, local_ids_R: torch.Tensor) -> torch.Tensor:
        """Like `__call__`, but rows with id -1 (padding of a fixed-capacity exchange) give zero rows."""
        y = torch.zeros(x_RD.shape, dtype=x_RD.dtype, device=x_RD.device)
        real = (local_ids_R >= 0).nonzero().squeeze(1)
        if real.numel():
            y[real] = self(x_RD[real].contiguous(), local_ids_R[real])
        return y

    def run_token(self, x_1D: torch.Tensor, local_ids_K: torch.Tensor) -> torch.Tensor:
        """One token through K experts (decode at batch 1): returns [K, D], row k = expert[local_ids[k]](x)."""
        return self(x_1D.expand(local_ids_K.numel(), x_1D.shape[1]).contiguous(), local_ids_K)

    def combine_token(self, x_1D: torch.Tensor, local_ids_K: torch.Tensor, weights_1K: torch.Tensor) -> torch.Tensor:
        """One token through K experts, summed with its routing weights: [1, D] = sum_k w_k expert_k(x)."""
        y_KD = self.run_token(x_1D, local_ids_K)
        return weights_1K.to(y_KD.dtype) @ y_KD  # [1, K] @ [K, D]

    def combine_tokens(self, x_TD: torch.Tensor, local_ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        """Every token through its K experts (all on this rank), summed with its routing weights: [T, D],
        y[t] = sum_k w[t, k] expert_{ids[t, k]}(x[t]) (ids >= 0)."""
        T, K = local_ids_TK.shape
        y_PD = self(x_TD.repeat_interleave(K, dim=0), local_ids_TK.reshape(-1))  # pairs in token-major order
        return (y_PD.view(T, K, y_PD.shape[-1]) * weights_TK.unsqueeze(-1).to(y_PD.dtype)).sum(dim=1)


@dataclass(slots=True)
class ExpertRows:
    """The rows a dispatcher hands this rank's experts (`actors.moe.dispatch`): x [R, D] and the local row of
    each one's expert [R] (int64).

    kind: "rows" (every row real), "padded" (rows with id -1 from a fixed-capacity exchange: zero results),
    "token" (one token [1, D] and its K local ids [K]: the experts weigh and sum them, `combine_token`),
    "tokens" (the step's tokens [T, D] and their local ids [T, K]: likewise, `combine_tokens`) or "slots" (the rows
    lie in a shared-memory exchange's slots, x_RD and local_ids_R are None: `source.run(experts)` runs them there
    and leaves the results for the dispatcher's combine, `actors.moe.slot_exchange`)."""

    x_RD: torch.Tensor | None
    local_ids_R: torch.Tensor | None
    kind: str = "rows"
    source: Any = None

    def run(self, experts: Experts, topk_w_TK: torch.Tensor) -> torch.Tensor | None:
        """The experts on these rows: [R, D] results (kinds "token" and "tokens": [T, D], already weighted and
        summed; "slots": None, the results stay in the slots)."""
        if self.kind == "slots":
            return self.source.run(experts)
        if self.kind == "token":
            return experts.combine_token(self.x_RD, self.local_ids_R, topk_w_TK)
        if self.kind == "tokens":
            return experts.combine_tokens(self.x_RD, self.local_ids_R, topk_w_TK)
        if self.kind == "padded":
            return experts.run_padded(self.x_RD, self.local_ids_R)
        return experts(self.x_RD, self.local_ids_R)


def local_experts(moe_layers: list[bool], weights: dict[str, torch.Tensor]) -> list[LocalExperts | None]:
    """Per layer, `LocalExperts` over `layers.{l}.w_gate_up` / `layers.{l}.w_down` of `weights` (None: dense)."""
    return [LocalExperts(weights[f"layers.{l}.w_gate_up"], weights[f"layers.{l}.w_down"]) if moe else None
            for l, moe in enumerate(moe_layers)]


class LocalExperts(Experts):
    """The experts of one layer that live on this rank.

    Args:
        w_gate_up: [E_loc, 2I, D] (gate rows first, then up), w_down: [E_loc, D, I], same dtype: the
            compute dtype, or bf16 with fp32 activations.

    bf16 weights on CPU run every entry through the compiled grouped kernel (`kernels.cpu.expert_ffn`: rows
    sorted by expert, two GEMMs per active expert, no per-row or per-expert Python); otherwise the rows are
    sorted by expert and each active expert runs as two torch matmuls over its rows (a grouped GEMM in torch
    ops), or row by row for a few rows with distinct experts.
    """

    def __init__(self, w_gate_up: torch.Tensor, w_down: torch.Tensor):
        self.w_gate_up = w_gate_up
        self.w_down = w_down
        self.num_local = w_gate_up.shape[0]
        self._gu, self._dn = list(w_gate_up.unbind(0)), list(w_down.unbind(0))  # per-expert views: no select op

    def __call__(self, x_RD: torch.Tensor, local_ids_R: torch.Tensor) -> torch.Tensor:
        """y[r] = expert[local_ids[r]](x[r]); rows may be in any order, R may be 0."""
        y = torch.empty_like(x_RD)
        if x_RD.shape[0] == 0:
            return y
        fused = expert_ffn(x_RD, self.w_gate_up, self.w_down, local_ids_R)  # bf16 on CPU: one grouped-GEMM call
        if fused is not None:
            return fused
        if x_RD.shape[0] <= tuning.SMALL_ROWS:  # a few rows: one host read of the ids, row by row
            ids = local_ids_R.tolist()
            if len(set(ids)) == len(ids):
                return torch.cat([self._ffn(x_RD[r : r + 1], e) for r, e in enumerate(ids)])
        order = torch.argsort(local_ids_R, stable=True)
        counts = torch.bincount(local_ids_R, minlength=self.num_local).tolist()
        xs = x_RD[order]
        ys = torch.empty_like(xs)
        start = 0
        for e, n in enumerate(counts):
            if n:
                ys[start : start + n] = self._ffn(xs[start : start + n], e)
                start += n
        y[order] = ys
        return y

    def run_token(self, x_1D: torch.Tensor, local_ids_K: torch.Tensor) -> torch.Tensor:
        """One token through K experts (decode at batch 1): returns [K, D], row k = expert[local_ids[k]](x)."""
        ids = local_ids_K.tolist()
        if len(ids) == 1:
            return self._ffn(x_1D, ids[0])
        return torch.cat([self._ffn(x_1D, e) for e in ids])

    def run_padded(self, x_RD: torch.Tensor, local_ids_R: torch.Tensor) -> torch.Tensor:
        """Like `__call__`, but rows with id -1 (padding of a fixed-capacity exchange) give zero rows."""
        fused = expert_ffn(x_RD, self.w_gate_up, self.w_down, local_ids_R)
        if fused is not None:
            return fused
        y = torch.zeros(x_RD.shape, dtype=x_RD.dtype, device=x_RD.device)
        real = (local_ids_R >= 0).nonzero().squeeze(1)
        if real.numel():
            y[real] = self(x_RD[real].contiguous(), local_ids_R[real])
        return y

    def combine_token(self, x_1D: torch.Tensor, local_ids_K: torch.Tensor, weights_1K: torch.Tensor) -> torch.Tensor:
        """One token through K experts, summed with its routing weights: [1, D] = sum_k w_k expert_k(x)."""
        y = expert_ffn(x_1D, self.w_gate_up, self.w_down, local_ids_K, weights_1K)
        if y is not None:
            return y
        y_KD = self.run_token(x_1D, local_ids_K)
        return weights_1K.to(y_KD.dtype) @ y_KD

    def combine_tokens(self, x_TD: torch.Tensor, local_ids_TK: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
        """Every token through its K experts, weighted and summed: [T, D] (bf16 on CPU: one compiled call that
        gathers, runs each active expert as two GEMMs and scatter-adds the weighted results)."""
        y = expert_ffn(x_TD, self.w_gate_up, self.w_down, local_ids_TK, weights_TK)
        return y if y is not None else Experts.combine_tokens(self, x_TD, local_ids_TK, weights_TK)

    def _ffn(self, x: torch.Tensor, e: int) -> torch.Tensor:
        g, u = linear(x, self._gu[e]).chunk(2, dim=-1)
        return linear(F.silu(g) * u, self._dn[e])
