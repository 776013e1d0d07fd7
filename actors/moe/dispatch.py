"""Dispatch / combine of token rows between ranks (expert parallelism).

The seam is `Dispatcher.run(x, topk_ids, topk_weights, experts) -> out`: route each (token, k)
pair to a rank that holds its expert, compute there, bring the result back and take the weighted
sum. `AllToAllDispatcher` does it with `torch.distributed.all_to_all_single` and uneven splits
(counts exchanged first); with `world_size == 1` it runs the same code with no collective, which
is the reference every EP run must equal. Every rank calls `run` for every MoE layer of every
step, with zero rows if it has no tokens, so the collectives always match.

Redundant experts (EPLB-style placement, `cluster.placement.eplb_placement`): an expert may have
replicas on several ranks; each (token, expert) pair goes to exactly one replica, chosen so that
the rows this rank sends in this layer are spread as evenly as possible over ranks (water-filling,
see `_split_over_replicas`). Expert id -1 in `topk_ids` is padding (policies with a variable
number of experts per token pad with id -1 and weight 0): never sent, contributes zero.

Shape legend: T = tokens on this rank, K = experts per token, D = hidden, P = T*K (token, k) pairs,
V = valid pairs (id >= 0), S = rows sent (= V), R = rows received, W = world size, E = routed
experts, M = most replicas of one expert in a layer.
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kernels import tuning
from kernels.cpu import pack_fixed_rows

Replica = tuple[int, int]  # (rank, local row on that rank)


@dataclass(kw_only=True, slots=True)
class ExpertPlacement:
    """Which ranks hold which expert, per MoE layer (possibly several replicas of one expert).

    Give either `replicas` or `rank_of` + `local_index` (one replica per expert):
      replicas[l][e]: list of (rank, local_index) replicas of expert e of layer l, primary first;
      rank_of[l][e], local_index[l][e]: the primary replica (always filled in after construction).
    local_experts(l, rank): global ids held by `rank`, in local row order.

    Raises:
        ValueError: a layer without num_experts entries, an expert with no replica, a rank out of
            [0, world_size), two replicas of one expert on one rank, or a rank's local rows not 0..n-1.
    """

    num_experts: int
    world_size: int
    rank_of: list[list[int]] | None = None
    local_index: list[list[int]] | None = None
    replicas: list[list[list[Replica]]] | None = None

    def __post_init__(self) -> None:
        E, W = self.num_experts, self.world_size
        if self.replicas is None:
            if self.rank_of is None or self.local_index is None:
                raise ValueError("placement needs `replicas` or both `rank_of` and `local_index`")
            if len(self.rank_of) != len(self.local_index):
                raise ValueError(f"placement: rank_of has {len(self.rank_of)} layers, "
                                 f"local_index {len(self.local_index)}")
            for l, (ranks, loc) in enumerate(zip(self.rank_of, self.local_index)):
                if len(ranks) != E or len(loc) != E:
                    raise ValueError(f"placement layer {l}: {len(ranks)} entries, expected num_experts={E}")
            self.replicas = [[[(int(r), int(i))] for r, i in zip(ranks, loc)]
                             for ranks, loc in zip(self.rank_of, self.local_index)]
        else:
            self.replicas = [[[(int(r), int(i)) for r, i in reps] for reps in layer] for layer in self.replicas]
        for l, layer in enumerate(self.replicas):
            if len(layer) != E:
                raise ValueError(f"placement layer {l}: {len(layer)} entries, expected num_experts={E}")
            rows: dict[int, list[int]] = {}
            for e, reps in enumerate(layer):
                if not reps:
                    raise ValueError(f"placement layer {l} expert {e}: no replica")
                if len({r for r, _ in reps}) != len(reps):
                    raise ValueError(f"placement layer {l} expert {e}: two replicas on one rank {reps}")
                for r, i in reps:
                    if not 0 <= r < W:
                        raise ValueError(f"placement layer {l}: rank {r} out of range [0, {W})")
                    rows.setdefault(r, []).append(i)
            for r, idx in rows.items():
                if sorted(idx) != list(range(len(idx))):
                    raise ValueError(f"placement layer {l} rank {r}: local rows {sorted(idx)} "
                                     f"are not 0..{len(idx) - 1}")
        self.rank_of = [[reps[0][0] for reps in layer] for layer in self.replicas]
        self.local_index = [[reps[0][1] for reps in layer] for layer in self.replicas]

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

    @property
    def num_layers(self) -> int:
        return len(self.replicas)

    def local_experts(self, layer: int, rank: int) -> list[int]:
        """Global expert ids held by `rank` in layer `layer`, in local row order."""
        held = [(i, e) for e, reps in enumerate(self.replicas[layer]) for r, i in reps if r == rank]
        return [e for _, e in sorted(held)]

    def num_replicas(self, layer: int, expert: int) -> int:
        return len(self.replicas[layer][expert])

    def num_redundant(self, layer: int) -> int:
        """Replicas beyond one per expert in layer `layer` (0 for a plain partition)."""
        return sum(len(reps) for reps in self.replicas[layer]) - self.num_experts

    def to_dict(self) -> dict:
        """Plain lists (msgpack / JSON / Ray friendly); `from_dict` reads it back."""
        return {"num_experts": self.num_experts, "world_size": self.world_size,
                "rank_of": self.rank_of, "local_index": self.local_index,
                "replicas": [[[list(rep) for rep in reps] for reps in layer] for layer in self.replicas]}

    @classmethod
    def from_dict(cls, d: dict) -> "ExpertPlacement":
        """Inverse of `to_dict`; a dict without `replicas` (one replica per expert) is accepted too."""
        if d.get("replicas") is not None:
            return cls(num_experts=d["num_experts"], world_size=d["world_size"], replicas=d["replicas"])
        return cls(num_experts=d["num_experts"], world_size=d["world_size"], rank_of=d["rank_of"],
                   local_index=d["local_index"])


def water_fill(loads: list[int], n: int, prefer: list[int]) -> list[int]:
    """Split `n` rows over bins with current `loads` as evenly as possible: the result equals giving
    each row, one at a time, to the least-loaded bin (ties: the bin with the smallest `prefer`).

    Returns the rows given to each bin (sums to n). O(m log m) for m bins, independent of n.
    """
    m = len(loads)
    order = sorted(range(m), key=lambda j: (loads[j], prefer[j]))
    k, level, left = 1, loads[order[0]], n
    while k < m and (loads[order[k]] - level) * k <= left:  # lift the k lowest bins to the next level
        left -= (loads[order[k]] - level) * k
        level = loads[order[k]]
        k += 1
    q, rest = divmod(left, k)
    alloc = [0] * m
    low = sorted(order[:k], key=lambda j: prefer[j])
    for t, j in enumerate(low):
        alloc[j] = level + q + (1 if t < rest else 0) - loads[j]
    return alloc




class Dispatcher(ABC):
    """Route (token, expert) pairs to the experts' ranks, run them, combine the weighted results."""

    @abstractmethod
    def run(self, layer: int, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_w_TK: torch.Tensor,
            experts, may_pad: bool = True) -> torch.Tensor:
        """Returns out [T, D] = sum_k w[t, k] * expert_{ids[t, k]}(x[t]), in x's dtype (ids -1: padding, skipped).

        may_pad=False promises no id is -1 (the gating policy cannot pad), which skips the padding scan."""


class AllToAllDispatcher(Dispatcher):
    """all_to_all_single with uneven splits: counts, then rows (+ expert ids), then results back.

    Fixed capacity (decode). When the lockstep loop has agreed on this step's largest per-rank token count
    T_max (`step_max_tokens`) and C = T_max * `max_experts_per_token` is at most `FIXED_MAX_ROWS`, no counts are
    exchanged: every rank sends every rank exactly C rows (its pairs for that rank, then padding rows whose
    expert id is -1), so the splits are known in advance. That saves one collective (and its host sync) per
    MoE layer: 2 instead of 3 in fp32, where the ids ride in the rows. A rank receives at most C real rows
    from each peer because it sends at most T * K' <= C pairs in all.

    Timings of the collectives are accumulated in `comm_s` (seconds) for the benchmark breakdown;
    `sent_rows` [L, W] int64 counts the rows this rank sent to each rank per layer (cumulative), i.e. the
    measured rank load that replicas balance. `set_placement` swaps the tables between steps.
    """

    def __init__(self, placement: ExpertPlacement, rank: int, group=None, device: torch.device | str = "cpu"):
        self.rank = rank
        self.world = placement.world_size
        self.group = group
        self.device = torch.device(device)
        # same-node shared-memory transport for the fixed-capacity exchange (`actors.rank.shm_collective`; set by the
        # rank actor when every rank is on one node), else None: torch.distributed for everything
        self.shm = None
        self.comm_s = 0.0
        self.step_max_tokens: int | None = None  # set per step by the engine (None: unknown, exchange counts)
        self.max_experts_per_token = 1  # K' at most, over every gating policy (set by the engine)
        self._sent = torch.zeros(placement.num_layers, self.world, dtype=torch.int64, device=self.device)
        self._sent_fast = [0] * placement.num_layers  # rows of the one-token fast path (host ints: no tensor op)
        self.set_placement(placement)

    @property
    def sent_rows(self) -> torch.Tensor:
        """[L, W] int64: rows this rank sent to each rank per layer (cumulative)."""
        out = self._sent.clone()
        out[:, self.rank] += torch.tensor(self._sent_fast, dtype=torch.int64, device=self.device)
        return out

    def set_placement(self, placement: ExpertPlacement) -> None:
        """Use `placement` from the next `run` on (the caller makes sure every rank switches at the same step).

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

    def _a2a(self, out: torch.Tensor, inp: torch.Tensor, out_splits, in_splits) -> None:
        t0 = time.perf_counter()
        if out_splits is None and self.shm is not None and self.shm.fits(inp.nbytes // self.world):
            self.shm.all_to_all_single(out, inp)  # equal splits of an agreed size: every rank takes this branch
        else:
            dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group)
        self.comm_s += time.perf_counter() - t0

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

    def _run_fixed(self, layer: int, x_TD: torch.Tensor, tok_V: torch.Tensor, dest_V: torch.Tensor,
                   local_V: torch.Tensor, experts, C: int) -> torch.Tensor:
        """Fixed-capacity exchange: C rows to and from every rank; returns the results [V, D] of the V pairs."""
        W, D, dev, dt = self.world, x_TD.shape[1], x_TD.device, x_TD.dtype
        V = dest_V.numel()
        packed = pack_fixed_rows(x_TD, tok_V, dest_V, local_V, W, C)  # fp32 on CPU: one compiled call
        if packed is not None:
            send, slot_V, counts = packed
            self._sent[layer] += counts
        else:
            order = torch.argsort(dest_V, stable=True)
            counts = torch.bincount(dest_V, minlength=W)
            self._sent[layer] += counts
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
            self._a2a(recv, send, None, None)
            x_R, lid_R = recv[:, :D], recv[:, D].to(torch.int64)
        else:
            send = torch.zeros(W * C, D, dtype=dt, device=dev)
            send[slot_V] = x_TD[tok_V]
            lid = torch.full((W * C,), -1, dtype=torch.int64, device=dev)
            lid[slot_V] = local_V
            x_R, lid_R = torch.empty_like(send), torch.empty_like(lid)
            self._a2a(x_R, send, None, None)
            self._a2a(lid_R, lid, None, None)
        padded = getattr(experts, "run_padded", None)  # LocalExperts: one call, no host sync on the padding
        if padded is not None:
            y_R = padded(x_R, lid_R)
        else:
            real = (lid_R >= 0).nonzero().squeeze(1)
            y_R = torch.zeros(W * C, D, dtype=dt, device=dev)
            if real.numel():
                y_R[real] = experts(x_R[real].contiguous(), lid_R[real])
        y_S = torch.empty_like(y_R)
        self._a2a(y_S, y_R, None, None)
        return y_S[slot_V]

    def run(self, layer, x_TD, topk_ids_TK, topk_w_TK, experts, may_pad=True):
        T, K = topk_ids_TK.shape
        D = x_TD.shape[1]
        if T == 1 and not may_pad and self.identity[layer]:  # one decode token on one rank: fewest ops
            self._sent_fast[layer] += K
            combine = getattr(experts, "combine_token", None)  # LocalExperts: one call, no row copies at all
            if combine is not None:
                return combine(x_TD, topk_ids_TK[0], topk_w_TK)
            token = getattr(experts, "run_token", None)  # packed experts: no row copies
            if token is not None:
                y_KD = token(x_TD, topk_ids_TK[0])
            else:
                y_KD = experts(x_TD.expand(K, D).contiguous(), topk_ids_TK[0])
            return topk_w_TK.to(y_KD.dtype) @ y_KD  # [1, K] @ [K, D]
        ids_P = topk_ids_TK.reshape(-1)
        tok_P = torch.arange(T, device=x_TD.device).repeat_interleave(K)
        padded = False
        if may_pad:  # id -1 = padding: never sent (the scan is a host sync, so only when a policy can pad)
            keep_V = (ids_P >= 0).nonzero().squeeze(1)
            padded = keep_V.numel() != ids_P.numel()
        ids_V, tok_V = (ids_P[keep_V], tok_P[keep_V]) if padded else (ids_P, tok_P)
        dest_V, local_V = self._route(layer, ids_V)
        if self.world == 1:
            self._sent[layer, 0] += ids_V.numel()
            y_V = experts(x_TD[tok_V], local_V)
        elif self.step_max_tokens is not None and self.step_max_tokens * self.max_experts_per_token <= tuning.FIXED_MAX_ROWS:
            # every rank computes the same C from agreed values only (never from its own K, which policies vary)
            if K > self.max_experts_per_token:
                raise RuntimeError(f"{K} experts per token exceed max_experts_per_token={self.max_experts_per_token}")
            y_V = self._run_fixed(layer, x_TD, tok_V, dest_V, local_V, experts,
                                  self.step_max_tokens * self.max_experts_per_token)
        else:
            order = torch.argsort(dest_V, stable=True)  # send buffer grouped by destination rank
            send_counts = torch.bincount(dest_V, minlength=self.world)
            self._sent[layer] += send_counts
            recv_counts = torch.empty_like(send_counts)
            self._a2a(recv_counts, send_counts, None, None)
            s_split, r_split = send_counts.tolist(), recv_counts.tolist()
            R = sum(r_split)
            local_ids = local_V[order]
            if x_TD.dtype == torch.float32:
                # ids ride along as an extra fp32 column (exact below 2**24): one collective, not two
                send = torch.cat([x_TD[tok_V[order]], local_ids.to(torch.float32)[:, None]], dim=1)
                recv = torch.empty(R, D + 1, dtype=x_TD.dtype, device=x_TD.device)
                self._a2a(recv, send, r_split, s_split)
                x_R, lid_R = recv[:, :D], recv[:, D].to(torch.int64)
            else:
                x_R = torch.empty(R, D, dtype=x_TD.dtype, device=x_TD.device)
                lid_R = torch.empty(R, dtype=torch.int64, device=x_TD.device)
                self._a2a(x_R, x_TD[tok_V[order]].contiguous(), r_split, s_split)
                self._a2a(lid_R, local_ids, r_split, s_split)
            y_R = experts(x_R.contiguous(), lid_R)
            y_S = torch.empty(len(order), D, dtype=x_TD.dtype, device=x_TD.device)
            self._a2a(y_S, y_R, s_split, r_split)
            y_V = torch.empty_like(y_S)
            y_V[order] = y_S
        if padded:  # padding pairs contribute exactly zero (their weight is 0, their row is never computed)
            y_P = torch.zeros(ids_P.numel(), D, dtype=x_TD.dtype, device=x_TD.device)
            y_P[keep_V] = y_V
        else:
            y_P = y_V
        y_P = y_P * topk_w_TK.reshape(-1, 1).to(y_P.dtype)
        return y_P.view(T, K, D).sum(dim=1)
