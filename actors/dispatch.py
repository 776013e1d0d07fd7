"""Dispatch / combine of token rows between ranks (expert parallelism).

The seam is `Dispatcher.run(x, topk_ids, topk_weights, experts) -> out`: route each (token, k)
pair to a rank that holds its expert, compute there, bring the result back and take the weighted
sum. `AllToAllDispatcher` does it with `torch.distributed.all_to_all_single` and uneven splits
(counts exchanged first); with `world_size == 1` it runs the same code with no collective, which
is the reference every EP run must equal. Every rank calls `run` for every MoE layer of every
step, with zero rows if it has no tokens, so the collectives always match.

Shape legend: T = tokens on this rank, K = experts per token, D = hidden, P = T*K (token, k) pairs,
S = rows sent (= P), R = rows received, W = world size, E = routed experts.
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(kw_only=True, slots=True)
class ExpertPlacement:
    """Which rank holds which expert, per MoE layer.

    rank_of[l][e]: the rank holding expert e of layer l; local_index[l][e]: its row on that rank.
    local_experts(l, rank): global ids held by `rank`, in local row order.
    """

    num_experts: int
    world_size: int
    rank_of: list[list[int]]
    local_index: list[list[int]]

    def __post_init__(self) -> None:
        for l, ranks in enumerate(self.rank_of):
            if len(ranks) != self.num_experts:
                raise ValueError(f"placement layer {l}: {len(ranks)} entries, expected num_experts={self.num_experts}")
            if any(not 0 <= r < self.world_size for r in ranks):
                raise ValueError(f"placement layer {l}: rank out of range [0, {self.world_size})")

    @classmethod
    def contiguous(cls, num_layers: int, num_experts: int, world_size: int) -> "ExpertPlacement":
        """Contiguous shards: rank r holds experts [r*E//W, (r+1)*E//W) (sizes differ by <= 1)."""
        bounds = [r * num_experts // world_size for r in range(world_size + 1)]
        rank_of, local = [], []
        for e in range(num_experts):
            r = next(r for r in range(world_size) if bounds[r] <= e < bounds[r + 1])
            rank_of.append(r)
            local.append(e - bounds[r])
        return cls(num_experts=num_experts, world_size=world_size,
                   rank_of=[list(rank_of) for _ in range(num_layers)], local_index=[list(local) for _ in range(num_layers)])

    def local_experts(self, layer: int, rank: int) -> list[int]:
        ids = [e for e in range(self.num_experts) if self.rank_of[layer][e] == rank]
        return sorted(ids, key=lambda e: self.local_index[layer][e])

    def to_dict(self) -> dict:
        return {"num_experts": self.num_experts, "world_size": self.world_size,
                "rank_of": self.rank_of, "local_index": self.local_index}

    @classmethod
    def from_dict(cls, d: dict) -> "ExpertPlacement":
        return cls(**d)


class Dispatcher(ABC):
    """Route (token, expert) pairs to the experts' ranks, run them, combine the weighted results."""

    @abstractmethod
    def run(self, layer: int, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_w_TK: torch.Tensor,
            experts) -> torch.Tensor:
        """Returns out [T, D] = sum_k w[t, k] * expert_{ids[t, k]}(x[t]), in x's dtype."""


class AllToAllDispatcher(Dispatcher):
    """all_to_all_single with uneven splits: counts, then rows (+ expert ids), then results back.

    Timings of the collectives are accumulated in `comm_s` (seconds) for the benchmark breakdown.
    """

    def __init__(self, placement: ExpertPlacement, rank: int, group=None, device: torch.device | str = "cpu"):
        self.placement = placement
        self.rank = rank
        self.world = placement.world_size
        self.group = group
        self.device = torch.device(device)
        self.comm_s = 0.0
        self._tables(placement)

    def _tables(self, placement: ExpertPlacement) -> None:
        self.rank_of = [torch.tensor(r, dtype=torch.int64, device=self.device) for r in placement.rank_of]
        self.local_of = [torch.tensor(i, dtype=torch.int64, device=self.device) for i in placement.local_index]

    def _a2a(self, out: torch.Tensor, inp: torch.Tensor, out_splits, in_splits) -> None:
        t0 = time.perf_counter()
        dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group)
        self.comm_s += time.perf_counter() - t0

    def run(self, layer, x_TD, topk_ids_TK, topk_w_TK, experts):
        T, K = topk_ids_TK.shape
        D = x_TD.shape[1]
        ids_P = topk_ids_TK.reshape(-1)
        tok_P = torch.arange(T, device=x_TD.device).repeat_interleave(K)
        dest_P = self.rank_of[layer][ids_P]
        if self.world == 1:
            y_P = experts(x_TD[tok_P], self.local_of[layer][ids_P])
        else:
            order = torch.argsort(dest_P, stable=True)  # send buffer grouped by destination rank
            send_counts = torch.bincount(dest_P, minlength=self.world)
            recv_counts = torch.empty_like(send_counts)
            self._a2a(recv_counts, send_counts, None, None)
            s_split, r_split = send_counts.tolist(), recv_counts.tolist()
            R = sum(r_split)
            local_ids = self.local_of[layer][ids_P[order]]
            if x_TD.dtype == torch.float32:
                # ids ride along as an extra fp32 column (exact below 2**24): one collective, not two
                send = torch.cat([x_TD[tok_P[order]], local_ids.to(torch.float32)[:, None]], dim=1)
                recv = torch.empty(R, D + 1, dtype=x_TD.dtype, device=x_TD.device)
                self._a2a(recv, send, r_split, s_split)
                x_R, lid_R = recv[:, :D], recv[:, D].to(torch.int64)
            else:
                x_R = torch.empty(R, D, dtype=x_TD.dtype, device=x_TD.device)
                lid_R = torch.empty(R, dtype=torch.int64, device=x_TD.device)
                self._a2a(x_R, x_TD[tok_P[order]].contiguous(), r_split, s_split)
                self._a2a(lid_R, local_ids, r_split, s_split)
            y_R = experts(x_R.contiguous(), lid_R)
            y_S = torch.empty(len(order), D, dtype=x_TD.dtype, device=x_TD.device)
            self._a2a(y_S, y_R, s_split, r_split)
            y_P = torch.empty_like(y_S)
            y_P[order] = y_S
        y_P = y_P * topk_w_TK.reshape(-1, 1).to(y_P.dtype)
        return y_P.view(T, K, D).sum(dim=1)
