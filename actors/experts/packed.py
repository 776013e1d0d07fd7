"""The routed experts of one layer on this rank (`PackedLayerExperts`): packed weights, a dequantized cache,
and the fused dequant path for misses (the `actors.moe.experts.LocalExperts` contract).

Shape legend: R = token rows received for this rank's experts, D = hidden, I = expert intermediate,
E_loc = this rank's experts of a layer, K = experts per token.

Per MoE layer the rank keeps
  * its E_loc experts packed (`kernels.packed_format.PackedExperts`, fused gate_up), resident (all of them,
    unless the cold tier, `cold_tier.ColdExpertTier`, is on);
  * an `ExpertCache` of up to C_loc of them dequantized in the compute dtype (C experts per layer overall,
    C_loc = ceil(C * E_loc / E) on this rank).
A layer call serves each expert it needs from the cache when it is ready there (hit: a dense matmul) and
otherwise runs the fused dequant path on the packed weights directly (miss: `packed_expert_ffn`, Triton, the
compiled CPU kernel `kernels.cpu.packed_expert_ffn` for decode-sized rows, or the PyTorch reference). On CPU
that kernel is no slower than a hit, so the cache defaults to empty there (`fused_path_runs`). It never waits
for a load: experts become ready only through the `PrefetchWorker` thread, which fills the cache with the
experts a predictor expects at the next layer (and, after a miss, with the missed expert), overlapping the
current layer's compute. Both paths compute the same function of the same dequantized weights, so they agree
to fp32 rounding (the tests check relative error < 1e-5 and identical greedy tokens at C = E and C = E / 4).
"""
from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from actors.experts.cache import ExpertCache
from actors.experts.cold_tier import ColdExpertTier
from actors.experts.ops import fused_path_runs, kernel_ops
from actors.experts.worker import PrefetchWorker
from actors.moe.experts import Experts
from actors.moe.stats import RoutingStats
from kernels import tuning
from kernels.cpu import PackedFFNArgs, swiglu_f32
from kernels.cpu import packed_expert_ffn as packed_expert_ffn_cpu
from kernels.packed_format import PackedExperts


class PackedLayerExperts(Experts):
    """The experts of one layer on this rank: packed weights + expert cache (the `Experts` protocol; its
    `run_padded` and `combine_token` are the protocol's, on top of `__call__` / `run_token`).

    With a cold tier (`tier`, packed experts not all resident) a miss runs the same fused path on the tier's
    slot stack: the expert's packed bytes are pinned there, read from the memory-mapped checkpoint first when
    not resident (a cold miss must read them once; the layer reads them itself rather than queueing a load).
    When a step needs more experts than the tier has unpinned slots, they run in rounds of as many as fit.

    Miss paths, one chosen per layer when it is built: the cold tier's slots (`_misses_cold`); the compiled CPU
    kernel (`_misses_compiled`, up to `tuning.MAX_KERNEL_ROWS` missed rows a call, else inline); the reference
    dequantize-and-offer (`_misses_inline`, torch backend); the backend's fused kernel (`_misses_kernel`).

    Args:
        layer: layer index. packed: PackedExperts with fused gate_up `(E_loc, 2I, D)` (None when E_loc = 0 or
            with a cold tier). tier: the layer's ColdExpertTier (None: every packed expert resident).
        capacity: cache size C_loc. policy: eviction policy. dtype: compute dtype of cached weights.
        backend: "torch" or "triton". worker: the rank's PrefetchWorker. stats: the rank's RoutingStats.
        demand_fill: after a miss, also queue the missed expert for the cache.
    Raises:
        ValueError: both `packed` and `tier` given.
    """

    def __init__(self, layer: int, packed: PackedExperts | None, *, capacity: int, policy: str,
                 dtype: torch.dtype, backend: str, worker: PrefetchWorker, stats: RoutingStats,
                 demand_fill: bool = True, tier: ColdExpertTier | None = None):
        if packed is not None and tier is not None:
            raise ValueError(f"layer {layer}: give packed experts or a cold tier, not both")
        self.layer, self.packed, self.dtype, self.worker, self.stats = layer, packed, dtype, worker, stats
        self.tier = tier
        src = tier or packed
        self.num_local = 0 if src is None else src.num_experts
        self.intermediate = 0 if src is None else src.intermediate_size
        self._ffn, self._deq = kernel_ops(backend)
        # The reference miss path dequantizes the whole expert anyway: it computes on the dequantized pair and
        # hands it to the cache itself, so a demand fill costs nothing more (the worker would dequantize again).
        self.inline_fill = backend == "torch"
        # CPU: the compiled fused path (`kernels.cpu.packed_expert_ffn`) serves decode-sized misses straight
        # from the packed bytes, and the worker's fills dequantize through it; None where it cannot run.
        # With a cold tier the same kernel runs on the slot stack (slot ids for expert ids).
        self._cffn = None
        stack = tier.pool if tier is not None else packed
        if stack is not None and stack.fused and fused_path_runs(stack.gate_up.device, backend, dtype):
            self._cffn = PackedFFNArgs(stack.gate_up, stack.down)
            if not self._cffn.ok:
                self._cffn = None
        self.cache = ExpertCache(min(capacity, self.num_local), self.num_local, policy, self._load)
        self.demand_fill = demand_fill
        # The miss paths, chosen once from what is fixed here (tier, compiled kernel, backend): `_run_misses` for
        # the general path (the compiled one still checks its row count per call), `_token_misses` for `run_token`.
        if tier is not None:
            self._run_misses = self._misses_cold
        elif self._cffn is not None:
            self._run_misses = self._misses_compiled
        elif self.inline_fill:
            self._run_misses = self._misses_inline
        else:
            self._run_misses = self._misses_kernel
        if self._cffn is not None and tier is None:
            self._token_misses = self._token_compiled
        elif self.inline_fill and tier is None:
            self._token_misses = self._token_inline
        else:
            self._token_misses = self._token_general
        self._lock = threading.Lock()
        self._pending: set[int] = set()
        self._prefetched: set[int] = set()  # filled by prefetch since this layer's last call

    def _load(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cffn is not None and self.tier is None:
            w = self._cffn.dequantize(e)
            if w is not None:  # None: the compiled kernels went away (never cache None: dequantize below)
                return w
        if self.tier is not None:
            gu, dn = self.tier.dequantized(e, self._deq, self.dtype)
        else:
            gu = self._deq(self.packed.gate_up[e], self.dtype)
            dn = self._deq(self.packed.down[e], self.dtype)
        if gu.is_cuda:
            torch.cuda.current_stream(gu.device).synchronize()
        return gu, dn

    def request(self, experts: list[int], *, protect: set[int], prefetch: bool) -> None:
        """Queue cache fills for local `experts` (in priority order) on the worker; duplicates are dropped."""
        with self._lock:
            todo = [e for e in experts if e not in self._pending and e not in self.cache]
            self._pending.update(todo)
        if not todo:
            return

        def run() -> None:
            try:
                for e in todo:
                    if self.cache.fill(e, protect, speculative=prefetch):
                        with self._lock:
                            self.stats.add_fills(self.layer, 1)
                            if prefetch:
                                self._prefetched.add(e)
            finally:
                with self._lock:
                    self._pending.difference_update(todo)

        self.worker.submit(run)

    def request_packed(self, experts: list[int]) -> None:
        """Queue reads of local `experts` (priority order) into the cold tier's resident set (no-op without)."""
        if self.tier is None or not experts:
            return
        todo = [e for e in experts if e not in self.tier]
        if todo:
            self.worker.submit(lambda: self.tier.prefetch(todo))

    def warm(self, experts: list[int]) -> None:
        """Fill the cache synchronously (at start-up) with `experts`, up to capacity."""
        for e in experts[: self.cache.capacity]:
            self.cache.fill(e)

    def __call__(self, x_RD: torch.Tensor, local_ids_R: torch.Tensor) -> torch.Tensor:
        """y[r] = expert[local_ids[r]](x[r]); rows in any order, R may be 0. Hits use cached weights, misses
        the fused dequant path on the packed weights."""
        R = x_RD.shape[0]
        if R == 0 or self.num_local == 0:
            return torch.empty_like(x_RD)
        counts = torch.bincount(local_ids_R, minlength=self.num_local)  # [E_loc]
        used = counts.nonzero().flatten().tolist()
        return self._run(x_RD, local_ids_R, counts, used, self._lookup(used))

    def run_token(self, x_1D: torch.Tensor, local_ids_K: torch.Tensor) -> torch.Tensor:
        """One token [1, D] through K distinct local experts (decode at batch 1): returns [K, D]. When all K are
        cached, each runs on the cached weights directly (no sort, scatter or bincount); otherwise, or with
        repeated ids, the general path."""
        ids = local_ids_K.tolist()
        if self.num_local == 0 or len(set(ids)) != len(ids):
            return self(x_1D.expand(len(ids), -1).contiguous(), local_ids_K)
        ready = self._lookup(ids)
        if len(ready) == len(ids):
            return torch.cat([self._cached_ffn(x_1D, *ready[e]) for e in ids])
        return self._token_misses(x_1D, local_ids_K, ids, ready)

    def _token_compiled(self, x_1D: torch.Tensor, local_ids_K: torch.Tensor, ids: list[int],
                        ready: dict[int, tuple]) -> torch.Tensor:
        """CPU: the misses in one compiled call on their packed bytes (no weight materialised); fills go to the
        worker, as on a GPU. The general path if the compiled kernels went away."""
        miss = [e for e in ids if e not in ready]
        y_miss = packed_expert_ffn_cpu(x_1D, miss, self._cffn)
        if y_miss is None:
            return self._token_general(x_1D, local_ids_K, ids, ready)
        if self.demand_fill and self.cache.capacity:
            self.request(miss, protect=set(ids), prefetch=False)
        if not ready:
            return y_miss
        it = iter(y_miss)
        return torch.cat([self._cached_ffn(x_1D, *ready[e]) if e in ready else next(it)[None] for e in ids])

    def _token_inline(self, x_1D: torch.Tensor, local_ids_K: torch.Tensor, ids: list[int],
                      ready: dict[int, tuple]) -> torch.Tensor:
        """Reference backend: a miss dequantizes its expert anyway, so each expert runs on its own dense pair
        (hit: cached; miss: dequantized now and offered to the cache), with no sort / bincount / scatter."""
        protect = set(ids)
        return torch.cat([self._cached_ffn(x_1D, *ready[e]) if e in ready else self._miss_inline(x_1D, e, protect)
                          for e in ids])

    def _token_general(self, x_1D: torch.Tensor, local_ids_K: torch.Tensor, ids: list[int],
                       ready: dict[int, tuple]) -> torch.Tensor:
        counts = torch.bincount(local_ids_K, minlength=self.num_local)
        return self._run(x_1D.expand(len(ids), -1).contiguous(), local_ids_K, counts, ids, ready)

    def _lookup(self, used: list[int]) -> dict[int, tuple]:
        """Cache lookup of the `used` local experts, with the hit/prefetch counters."""
        ready = self.cache.lookup(used)
        with self._lock:
            self.stats.add_lookups(self.layer, len(ready), len(used))
            if self._prefetched:
                self.stats.add_prefetch(self.layer, len(self._prefetched), len(self._prefetched - set(used)))
                self._prefetched.clear()
        return ready

    def _miss_inline(self, x_RD: torch.Tensor, e: int, protect: set[int]) -> torch.Tensor:
        """Rows `x_RD` through local expert `e`, not cached: dequantize it (reference backend), compute as a hit
        would, and offer the pair to the cache (the demand fill costs nothing more)."""
        gu, dn = self._deq(self.packed.gate_up[e], self.dtype), self._deq(self.packed.down[e], self.dtype)
        y = self._cached_ffn(x_RD, gu, dn)
        if self.demand_fill and self.cache.put(e, (gu, dn), protect):
            with self._lock:
                self.stats.add_fills(self.layer, 1)
        return y

    def _cached_ffn(self, x: torch.Tensor, gu: torch.Tensor, dn: torch.Tensor) -> torch.Tensor:
        y = swiglu_f32(x, gu, dn) if self._cffn is not None else None  # CPU, fp32, a few rows: one compiled call
        if y is not None:
            return y
        g, u = F.linear(x, gu).split(self.intermediate, dim=1)
        # The product is rounded once to the activation dtype, as on the packed path.
        if x.dtype == torch.float32:
            return F.linear(F.silu(g) * u, dn)
        return F.linear((F.silu(g.float()) * u.float()).to(x.dtype), dn)

    def _run(self, x_RD: torch.Tensor, local_ids_R: torch.Tensor, counts: torch.Tensor, used: list[int],
             ready: dict[int, tuple]) -> torch.Tensor:
        """The general path: rows sorted by expert; hits on cached weights, misses on the packed weights."""
        misses = [e for e in used if e not in ready]
        order = torch.argsort(local_ids_R, stable=True)
        xs = x_RD[order]
        ys = torch.empty_like(xs)
        bounds = [0] + torch.cumsum(counts, 0).tolist()
        for e, (gu, dn) in ready.items():
            lo, hi = bounds[e], bounds[e + 1]
            ys[lo:hi] = self._cached_ffn(xs[lo:hi], gu, dn)
        if misses:
            ys = self._run_misses(xs, ys, counts, bounds, misses, used)
        y = torch.empty_like(x_RD)
        y[order] = ys
        return y

    # The general path's miss paths: (xs [R, D] sorted by expert, ys [R, D] with the hits written, counts [E_loc],
    # bounds, misses, used) -> ys with the misses' rows written too (in place, or a new tensor).
    def _misses_cold(self, xs: torch.Tensor, ys: torch.Tensor, counts: torch.Tensor, bounds: list[int],
                     misses: list[int], used: list[int]) -> torch.Tensor:
        self._cold_ffn(xs, ys, counts, bounds, misses)
        if self.demand_fill and self.cache.capacity:
            self.request(misses, protect=set(used), prefetch=False)
        return ys

    def _misses_compiled(self, xs: torch.Tensor, ys: torch.Tensor, counts: torch.Tensor, bounds: list[int],
                         misses: list[int], used: list[int]) -> torch.Tensor:
        """The compiled fused kernel on the packed bytes up to `tuning.MAX_KERNEL_ROWS` missed rows; beyond, the
        reference inline path (the compiled kernel runs only with the torch backend)."""
        if sum(int(counts[e]) for e in misses) > tuning.MAX_KERNEL_ROWS:
            return self._misses_inline(xs, ys, counts, bounds, misses, used)
        rows = torch.cat([torch.arange(bounds[e], bounds[e + 1]) for e in misses])
        ys[rows] = packed_expert_ffn_cpu(xs[rows], [e for e in misses for _ in range(bounds[e + 1] - bounds[e])],
                                         self._cffn)
        if self.demand_fill and self.cache.capacity:
            self.request(misses, protect=set(used), prefetch=False)
        return ys

    def _misses_inline(self, xs: torch.Tensor, ys: torch.Tensor, counts: torch.Tensor, bounds: list[int],
                       misses: list[int], used: list[int]) -> torch.Tensor:
        protect = set(used)
        for e in misses:
            lo, hi = bounds[e], bounds[e + 1]
            ys[lo:hi] = self._miss_inline(xs[lo:hi], e, protect)
        return ys

    def _misses_kernel(self, xs: torch.Tensor, ys: torch.Tensor, counts: torch.Tensor, bounds: list[int],
                       misses: list[int], used: list[int]) -> torch.Tensor:
        """The backend's fused dequant kernel (`packed_expert_ffn`, Triton or the reference) on the packed stack."""
        miss_counts = torch.zeros_like(counts)
        miss_counts[misses] = counts[misses]
        if len(misses) == len(used):
            ys = self._ffn(xs, miss_counts, self.packed)
        else:
            rows = torch.cat([torch.arange(bounds[e], bounds[e + 1]) for e in misses]).to(xs.device)
            ys[rows] = self._ffn(xs[rows], miss_counts, self.packed)
        if self.demand_fill and self.cache.capacity:
            self.request(misses, protect=set(used), prefetch=False)
        return ys

    def _cold_ffn(self, xs: torch.Tensor, ys: torch.Tensor, counts: torch.Tensor, bounds: list[int],
                  misses: list[int]) -> None:
        """ys[rows of e] = expert e (xs[rows of e]) for each of `misses` (local ids), on the tier's slot stack.

        Rows are grouped by slot, in slot order, so one fused call serves every expert pinned this round.
        """
        tier = self.tier
        todo = list(misses)
        while todo:
            got = tier.acquire(todo, demand=True)
            if not got:  # every slot pinned by the prefetch worker: use this expert's bytes once, unslotted
                e = todo.pop(0)
                lo, hi = bounds[e], bounds[e + 1]
                ys[lo:hi] = self._ffn(xs[lo:hi], counts[e : e + 1], tier.read_transient(e))
                continue
            try:
                by_slot = sorted(got.items(), key=lambda es: es[1])
                slot_counts = torch.zeros(tier.capacity, dtype=counts.dtype, device=counts.device)  # [P_loc]
                for e, s in by_slot:
                    slot_counts[s] = counts[e]
                rows = torch.cat([torch.arange(bounds[e], bounds[e + 1]) for e, _ in by_slot]).to(xs.device)
                y = None
                if self._cffn is not None and len(rows) <= tuning.MAX_KERNEL_ROWS:  # CPU: the compiled fused kernel
                    y = packed_expert_ffn_cpu(xs[rows], [s for e, s in by_slot for _ in range(int(counts[e]))],
                                              self._cffn)
                ys[rows] = y if y is not None else self._ffn(xs[rows], slot_counts, tier.pool)
            finally:
                tier.release(got)
            todo = [e for e in todo if e not in got]
