"""Routed experts held by one rank (reference implementation: full-precision weights).

Shape legend: R = token rows received for this rank's experts, D = hidden, I = expert intermediate,
E_loc = experts held on this rank.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import tuning
from kernels.cpu import expert_ffn, linear




class LocalExperts:
    """The experts of one layer that live on this rank.

    Args:
        w_gate_up: [E_loc, 2I, D] (gate rows first, then up), w_down: [E_loc, D, I], same dtype: the
            compute dtype, or bf16 with fp32 activations (`kernels.cpu.linear`).
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
        if x_RD.shape[0] <= tuning.SMALL_ROWS:  # decode: one compiled call (bf16 weights), else one host read of the ids
            fused = expert_ffn(x_RD, self.w_gate_up, self.w_down, local_ids_R)
            if fused is not None:
                return fused
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

    def _ffn(self, x: torch.Tensor, e: int) -> torch.Tensor:
        g, u = linear(x, self._gu[e]).chunk(2, dim=-1)
        return linear(F.silu(g) * u, self._dn[e])
