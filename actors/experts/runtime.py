"""The expert runtime of one rank (`ExpertRuntime`): packed experts, caches, cold tiers, predictor and prefetch
worker of every MoE layer, and the routing observer that drives the prefetch.

Shape legend: T = tokens of the step, K = experts per token, E = routed experts of a layer (global),
E_loc = this rank's experts of a layer.

Observer (`actors.model.model.RoutingObserver`: the engine gives the runtime to the model's constructor, or
`ExpertRuntime.attach` makes it a built model's observer): the model calls `begin_step(meta, T, gating)` first,
whose `AttentionMetadata` tells which token follows which in a sequence (the first KV block of a sequence is
its key while it runs), then `on_hidden(l, h)` before each FFN and `on_route(l, ids)` after each gate; the
runtime learns the routing online (Markov counts), predicts the next MoE layer's experts (k + 1 per token, union
over the batch), and submits their prefetch (`prediction.PredictionBookkeeping`). It never waits for a fill: the
bookkeeping runs on the forward thread, the fills on the worker (inline, deterministic, with async_prefetch=False).

Sources: expert offloading with an LRU cache and lookahead prefetch (mixtral-offloading, arXiv 2312.17238);
Markov / affinity-based prefetch (ProMoE arXiv 2410.22134, ExFlow arXiv 2401.08383).
"""
from __future__ import annotations

import math

import torch

from actors.experts.checkpoint import PackedExpertReader
from actors.experts.cold_tier import ColdExpertTier
from actors.experts.packed import PackedLayerExperts
from actors.experts.prediction import PredictionBookkeeping
from actors.experts.worker import PrefetchWorker
from actors.model.config import ModelConfig
from actors.moe.gating import GatingBatch
from actors.moe.gating_router import GatingRouter
from actors.moe.stats import RoutingStats, jaccard_distance
from actors.prefetch.base import ExpertPredictor
from actors.prefetch.transitions import TransitionCounts
from kernels import tuning
from kernels.packed_format import PackedExperts


def local_share(per_layer: int | None, n_loc: int, num_experts: int) -> int:
    """This rank's share of a per-layer expert count: ceil(per_layer * E_loc / E), capped at E_loc (None: E_loc).

    A rank with any experts gets at least one slot whenever `per_layer` >= 1.
    """
    if per_layer is None:
        return n_loc
    return min(n_loc, math.ceil(per_layer * n_loc / num_experts))


class ExpertRuntime(PredictionBookkeeping):
    """Packed experts + caches + predictor + prefetch worker of one rank, and the model hooks.

    Args:
        model_cfg: the model's configuration. local: per layer, the global expert ids on this rank (row order).
        packed: per layer PackedExperts of those experts (None for dense layers or E_loc = 0).
        dtype, device: compute dtype and device of cached weights.
        capacity: C, experts per layer kept dequantized over the whole layer (None: all).
        predictor: next-layer expert predictor (a NoPredictor disables prefetch).
        policy: eviction policy (default: `predicted` with a predictor, else `lru`).
        backend: "torch" | "triton". async_prefetch: fills on a worker thread (False: inline, deterministic).
        budget: experts predicted per token (default K + 1). demand_fill: queue a missed expert for the cache.
        warm_counts: calibration counts that order the initial cache fill (most frequent first).
        min_prefetch_prob: prefetch an expert only if some token's predicted probability of using it is at
            least this (0: every expert in the budget, as the issue's k + 1 rule says).
        cold: the packed folder's PackedExpertReader; with `resident` set, layers whose share of `resident`
            is below E_loc get a ColdExpertTier instead of `packed[l]` (which must then be None).
        resident: packed experts per layer kept in memory over the whole layer (None: all), P_loc =
            ceil(resident * E_loc / E) on this rank (`local_share`).
        gating_router: the model's gating router (its default policy tells which tokens `sticky` routes).
    Raises:
        ValueError: capacity < 0, resident < 1, unknown policy or backend, `resident` without `cold`, or a
            layer with neither packed experts nor a tier.
    """

    def __init__(self, *, model_cfg: ModelConfig, local: list[list[int]], packed: list[PackedExperts | None],
                 dtype: torch.dtype, device: torch.device, capacity: int | None, predictor: ExpertPredictor,
                 policy: str | None = None, backend: str = "torch", async_prefetch: bool = True,
                 budget: int | None = None, demand_fill: bool = True, warm_counts: TransitionCounts | None = None,
                 min_prefetch_prob: float = 0.0, cold: PackedExpertReader | None = None,
                 resident: int | None = None, gating_router: GatingRouter | None = None):
        mc = model_cfg
        if capacity is not None and capacity < 0:
            raise ValueError(f"expert_cache_capacity={capacity} must be >= 0")
        if resident is not None and (resident < 1 or cold is None):
            raise ValueError(f"resident_experts={resident} must be >= 1 and needs a packed checkpoint to read the "
                             "other experts from")
        self.cfg, self.local, self.predictor = mc, local, predictor
        self.num_experts = mc.num_experts
        self.prefetching = predictor.name != "none"
        self.policy = policy or ("predicted" if self.prefetching else "lru")
        # per-layer predictor bookkeeping (~20% of a batch-1 step on CPU) only when something reads it
        self._observing = self.prefetching or self.policy == "predicted"
        self.budget = min(mc.top_k + 1 if budget is None else budget, mc.num_experts)
        self.capacity = capacity
        self.min_prefetch_prob = min_prefetch_prob
        self.stats = RoutingStats()
        self.worker = PrefetchWorker(sync=not async_prefetch, device=device)
        self.local_of = [{g: i for i, g in enumerate(ids)} for ids in local]
        self.layers: list[PackedLayerExperts | None] = []
        for l in range(mc.num_layers):
            if not mc.moe_layers[l]:
                self.layers.append(None)
                continue
            n_loc = len(local[l])
            cap = local_share(capacity, n_loc, mc.num_experts)
            p_loc = local_share(resident, n_loc, mc.num_experts)
            tier = None
            if p_loc < n_loc:
                tier = ColdExpertTier(l, local[l], cold, capacity=p_loc, policy=self.policy, device=device)
            elif n_loc and packed[l] is None:
                raise ValueError(f"layer {l}: no packed experts for this rank's {n_loc} experts")
            self.layers.append(PackedLayerExperts(l, None if tier else packed[l], capacity=cap, policy=self.policy,
                                                  dtype=dtype, backend=backend, worker=self.worker,
                                                  stats=self.stats, demand_fill=demand_fill, tier=tier))
        moe = [l for l in range(mc.num_layers) if mc.moe_layers[l]]
        self.prev_moe = {l: (moe[i - 1] if i else None) for i, l in enumerate(moe)}
        self.next_moe = {l: (moe[i + 1] if i + 1 < len(moe) else None) for i, l in enumerate(moe)}
        self.first_moe = moe[0] if moe else None
        self._warm(warm_counts)
        self._last: dict[int, dict[int, torch.Tensor]] = {l: {} for l in moe}  # layer -> seq key -> ids [K]
        # layer -> seq key -> [D] float32: the sequence's last token's residual entering the layer's FFN, kept
        # for predictors that read the previous token's state (`ExpertPredictor.needs_prev_token_hidden`)
        self._last_h: dict[int, dict[int, torch.Tensor]] = {l: {} for l in moe}
        self._T = 0
        self.gating_router = gating_router
        self._model = None  # the model `attach` made this runtime the observer of

    def _warm(self, counts: TransitionCounts | None) -> None:
        """Start with the caches full: the calibration's most frequent experts first (else the lowest ids).

        With a cold tier its slots take the experts ranked after the dequantized cache's (read once each), so
        the two tiers start with different experts.
        """
        freq = counts or getattr(getattr(self.predictor, "markov", self.predictor), "counts", None)
        for l, store in enumerate(self.layers):
            if store is None:
                continue
            order = list(range(store.num_local))
            if freq is not None:
                f = freq.freq[l]
                order.sort(key=lambda i: -float(f[self.local[l][i]]))
            c = store.cache.capacity
            if store.tier is not None:
                store.tier.prefetch((order[c:] + order[:c])[: store.tier.capacity])
            if c:
                store.warm(order)

    # ------------------------------------------------------------------------ routing observer
    def attach(self, model) -> None:
        """Make this runtime the routing observer of a built `model` (`actors.model.model.MoEModel`), reading its
        gating router; the engine passes the runtime to the model's constructor instead."""
        self._model, self._saved = model, model.observer
        self.gating_router = model.gating_router
        model.observer = self

    def detach(self) -> None:
        """Undo `attach` (if attached: the model's previous observer is back) and stop the worker."""
        if self._model is not None:
            self._model.observer = self._saved
            self._model = None
        self.worker.close()

    def begin_step(self, meta, num_tokens: int, gating: GatingBatch | None = None) -> None:
        """Map the step's tokens to sequences: key (first KV block) per token, index of the previous token;
        predict and prefetch the first MoE layer from the previous tokens. `gating`: the step's per-token policies
        (tokens routed by `sticky` are predicted with their predecessor's experts first, `keep_previous_first`).

        The hooks do their bookkeeping on the forward thread (compiled calls for decode steps) and hand only the
        fills to the worker: queueing every hook on the worker cost more in thread wake-ups than the bookkeeping
        itself."""
        T = num_tokens
        self._T = T
        self._ids: dict[int, torch.Tensor] = {}
        self._ids_t: dict[int, torch.Tensor] = {}  # the same routing as int64 tensors (compiled step)
        self._hidden: dict[int, torch.Tensor] = {}
        self._pred: dict[int, torch.Tensor] = {}
        self._sticky: list[bool] | None = None
        if T == 0 or not self._observing:
            return
        key = [-1] * T
        prev = [-1] * T
        for start, n, _, table in meta.prefills:
            k = int(table[0]) if len(table) else -1
            key[start : start + n] = [k] * n
            prev[start + 1 : start + n] = range(start, start + n - 1)
        self._decode = meta.decode_tokens.tolist()
        if self._decode:
            bt = meta.decode_block_tables
            first = bt[:, 0].tolist() if bt.shape[1] else [-1] * len(self._decode)
            for t, k in zip(self._decode, first):
                key[t] = int(k)
        # Small steps (decode) keep every piece of bookkeeping in Python lists: a few dozen tiny tensor ops per
        # layer cost more than the layer's experts at batch 1 (see `SMALL_STEP_CELLS`).
        self._small = T * self.num_experts <= tuning.SMALL_STEP_CELLS
        self._key = key
        self._prev = prev if self._small else torch.tensor(prev, dtype=torch.int64)
        self._sticky = self._sticky_tokens(gating, T)
        if self.prefetching and self.first_moe is not None and self._decode:
            l = self.first_moe
            if self._small:
                self._predict_small(l, None, self._prev_tok_lists(l, None), None)
            else:
                self._predict_and_prefetch(l, None, self._prev_token_ids(l, None), None)

    def on_hidden(self, l: int, h_TD: torch.Tensor) -> None:
        """Residual stream entering layer l's FFN (kept for the lookahead predictor)."""
        if self._T and self.prefetching:
            self._hidden[l] = h_TD
            if self.predictor.needs_prev_token_hidden:  # a copy: its rows outlive the step
                h = h_TD.detach().float().cpu().clone()
                self._last_h[l] = {k: h[t] for t, k in enumerate(self._key) if k >= 0}  # last token of each wins

    def on_route(self, l: int, ids_TK: torch.Tensor) -> None:
        """Layer l just routed: score the prediction made for it, learn, predict the next MoE layer, prefetch.
        Without a prefetcher or predicted eviction there is nothing to learn or predict: it returns at once (the
        router thrash metric is the gating router's, `stats()["routing"]["thrash"]`)."""
        if self._T == 0 or ids_TK.shape[0] != self._T or not self._observing:
            return
        if self._small and self._compiled_step(l, ids_TK, self._hidden.get(l)):
            return
        if self._small:
            self._on_route_small(l, ids_TK.tolist())
            return
        ids = ids_TK.detach().to("cpu", torch.int64)
        prev_layer = self._ids.get(self.prev_moe.get(l))
        prev_tok = self._prev_token_ids(l, ids)
        if l in self._pred:
            self.stats.add_prediction(l, self._pred.pop(l), ids, self.num_experts)
        has = (prev_tok >= 0).any(1)
        if bool(has.any()):
            self.stats.add_thrashing(l, jaccard_distance(prev_tok[has], ids[has], self.num_experts))
        self.predictor.observe(l, ids, prev_layer, prev_tok)
        self._ids[l] = ids
        rows = ids.tolist()
        self._last[l] = {k: rows[t] for t, k in enumerate(self._key) if k >= 0}  # last token of each sequence wins
        nl = self.next_moe.get(l)
        if self.prefetching and nl is not None:
            self._predict_and_prefetch(nl, ids, self._prev_token_ids(nl, None), self._hidden.get(l))

    # ------------------------------------------------------------------------ reporting
    def wait_idle(self) -> None:
        self.worker.wait_idle()

    def summary(self) -> dict:
        """Per-layer metrics (stats.RoutingStats.summary) and totals: hit_rate, recall, precision, thrashing
        (prediction and thrashing are nan without a prefetcher or predicted eviction: nothing is observed)."""
        per = self.stats.summary()
        c = self.stats.c

        def tot(a: str, b: str) -> float:
            num = sum(v[a] for v in c.values())
            den = sum(v[b] for v in c.values())
            return num / den if den else float("nan")

        th = [v["thrashing"] for v in per.values() if not math.isnan(v["thrashing"])]
        return {"layers": per, "hit_rate": tot("hits", "lookups"), "recall": tot("pred_inter", "true_n"),
                "precision": tot("pred_inter", "pred_n"), "wasted_prefetch_frac": tot("wasted", "prefetched"),
                "thrashing": sum(th) / len(th) if th else float("nan"), "policy": self.policy,
                "predictor": self.predictor.name, "tiers": self.tier_stats()}

    def tier_stats(self) -> dict:
        """Memory and traffic per expert tier, summed over this rank's MoE layers (bytes are bytes held now):

        `cache`: dequantized experts (compute dtype): `experts`, `capacity`, `resident_bytes`, `hits`,
            `lookups` (experts looked up per layer call).
        `packed`: packed experts in memory: `experts`, `capacity`, `resident_bytes`, `allocated_bytes`,
            `budget_bytes` (all equal to the full packed size without a cold tier), `hits` (cache misses served
            from resident packed bytes).
        `cold`: the memory-mapped checkpoint (`enabled` False without one): `misses` (read on demand by the
            forward), `waits`, `prefetch_reads`, `transient_reads`, `evictions`, `bytes_read`.
        `layers`: {layer: {"cache_experts", "packed_experts", ColdExpertTier.stats() keys}}.
        """
        cache = dict.fromkeys(("experts", "capacity", "resident_bytes", "hits", "lookups"), 0)
        packed = dict.fromkeys(("experts", "capacity", "resident_bytes", "allocated_bytes", "budget_bytes",
                                "hits"), 0)
        cold = dict.fromkeys(("misses", "waits", "prefetch_reads", "transient_reads", "evictions", "bytes_read"), 0)
        layers: dict[int, dict] = {}
        c = self.stats.c
        for l, store in enumerate(self.layers):
            if store is None:
                continue
            n_cache = len(store.cache.resident)
            cache["experts"] += n_cache
            cache["capacity"] += store.cache.capacity
            cache["resident_bytes"] += store.cache.resident_bytes
            cache["hits"] += int(c.get(l, {}).get("hits", 0))
            cache["lookups"] += int(c.get(l, {}).get("lookups", 0))
            if store.tier is None:
                nb = 0 if store.packed is None else store.packed.nbytes
                packed["experts"] += store.num_local
                packed["capacity"] += store.num_local
                for k in ("resident_bytes", "allocated_bytes", "budget_bytes"):
                    packed[k] += nb
                layers[l] = {"cache_experts": n_cache, "packed_experts": store.num_local}
                continue
            t = store.tier.stats()
            packed["experts"] += t["resident_experts"]
            for k in ("capacity", "resident_bytes", "allocated_bytes", "budget_bytes", "hits"):
                packed[k] += t[k]
            for k in cold:
                cold[k] += t[k]
            layers[l] = {"cache_experts": n_cache, "packed_experts": t["resident_experts"], **t}
        cold["enabled"] = any(s is not None and s.tier is not None for s in self.layers)
        return {"cache": cache, "packed": packed, "cold": cold, "layers": layers}
