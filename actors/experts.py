"""Routed experts held by one rank (reference implementation: full-precision weights).

Shape legend: R = token rows received for this rank's experts, D = hidden, I = expert intermediate,
E_loc = experts held on this rank.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


class LocalExperts:
    """The experts of one layer that live on this rank.

    Args:
        w_gate_up: [E_loc, 2I, D] (gate rows first, then up), w_down: [E_loc, D, I], same dtype.
    """

    def __init__(self, w_gate_up: torch.Tensor, w_down: torch.Tensor):
        self.w_gate_up = w_gate_up
        self.w_down = w_down
        self.num_local = w_gate_up.shape[0]

    def __call__(self, x_RD: torch.Tensor, local_ids_R: torch.Tensor) -> torch.Tensor:
        """y[r] = expert[local_ids[r]](x[r]); rows may be in any order, R may be 0."""
        y = torch.empty_like(x_RD)
        if x_RD.shape[0] == 0:
            return y
        if x_RD.shape[0] == 1:
            e = int(local_ids_R[0])
            return self._ffn(x_RD, e)
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

    def _ffn(self, x: torch.Tensor, e: int) -> torch.Tensor:
        g, u = F.linear(x, self.w_gate_up[e]).chunk(2, dim=-1)
        return F.linear(F.silu(g) * u, self.w_down[e])
