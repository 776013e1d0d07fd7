"""The prediction bookkeeping of `ExpertRuntime`'s hooks, on three paths with the same counters, learning and
prefetch: one compiled call per layer (`kernels.cpu.prefetch_step`, Markov / hybrid on CPU), Python lists (small
steps, `tuning.SMALL_STEP_CELLS`) and tensors (large steps).

Shape legend: T = tokens of the step, K = experts per token, E = routed experts of a layer (global),
B = prediction budget per token.

`PredictionBookkeeping` is the part of `runtime.ExpertRuntime` that scores, learns and predicts; it reads the
runtime's configuration (`cfg`, `predictor`, `stats`, `layers`, `local`, `local_of`, `num_experts`, `budget`,
`min_prefetch_prob`, `prefetching`, `prev_moe`, `next_moe`, `gating_router`) and the step's state that `begin_step`
sets (`_T`, `_key`, `_prev`, `_decode`, `_sticky`) and the hooks update (`_ids`, `_ids_t`, `_hidden`, `_pred`,
`_last`).
"""
from __future__ import annotations

import torch

from actors.moe.gating import POLICIES, GatingBatch
from actors.prefetch.base import ExpertPredictor
from actors.prefetch.predictors import keep_previous_first
from actors.prefetch.pre_attention_prev import prev_token_input
from kernels.cpu import prefetch_step


class PredictionBookkeeping:
    """Scoring, learning and next-layer prediction of `ExpertRuntime` (a base class: it holds no state)."""

    def _sticky_tokens(self, gating: GatingBatch | None, T: int) -> list[bool] | None:
        """Per token, True where the `sticky` policy routes it; None when no token is (the common case)."""
        router = self.gating_router
        if gating is None or router is None:
            return None
        if gating.policy_T is None:
            return [True] * T if router.cfg.policy == "sticky" else None
        flags = (gating.policy_T == POLICIES.index("sticky")).tolist()
        return flags if any(flags) else None

    def _keep_previous(self, pred: list[list[int]], prev_tok: list[list[int]], agg: list[float],
                       top: list[float]) -> tuple[list[list[int]], list[float], list[float]]:
        """The prediction for `sticky` tokens: their predecessor's experts first (`keep_previous_first`), each
        counted as a sure use in `agg` (expected uses in the batch) and `top` (best per-token probability)."""
        if self._sticky is None:
            return pred, agg, top
        agg, top, sure = list(agg), list(top), {}
        for t, on in enumerate(self._sticky):
            if on and prev_tok[t]:
                pred[t] = keep_previous_first(pred[t], prev_tok[t], self.budget)
                for g in prev_tok[t]:
                    if g >= 0:
                        sure[g] = sure.get(g, 0) + 1
        for g, n in sure.items():
            agg[g], top[g] = max(agg[g], float(n)), 1.0
        return pred, agg, top

    def _prev_tok_lists(self, l: int, ids: list[list[int]] | None) -> list[list[int]]:
        """Per token, its predecessor's experts at layer l ([] where unknown); the list form of
        `_prev_token_ids`."""
        last = self._last.get(l, {})
        out = [[] for _ in range(self._T)]
        if ids is not None:
            for t, p in enumerate(self._prev):
                if p >= 0:
                    out[t] = ids[p]
        for t in self._decode:
            v = last.get(self._key[t])
            if v is not None:
                out[t] = v
        return out

    def _prev_token_ids(self, l: int, ids_TK: torch.Tensor | None) -> torch.Tensor:
        """`[T, K]` experts of each token's predecessor at layer l (-1 where unknown)."""
        K = self.cfg.top_k
        out = torch.full((self._T, K), -1, dtype=torch.int64)
        if ids_TK is not None:
            has = self._prev >= 0
            out[has] = ids_TK[self._prev[has]]
        last = self._last.get(l, {})
        for t in self._decode:
            v = last.get(self._key[t])
            if v is not None:
                out[t] = torch.as_tensor(v, dtype=torch.int64)
        return out

    def _compiled_step(self, l: int, ids_TK: torch.Tensor, h_TD: torch.Tensor | None) -> bool:
        """`_on_route_small` for the Markov and hybrid predictors in one compiled call
        (`kernels.cpu.prefetch_step`: scoring, thrash, learning, the next layer's prediction and top-B);
        same counters, counts and predictions. False (nothing done) where it cannot run."""
        pred = self.predictor
        if pred.name not in ("markov", "hybrid") or ids_TK.dtype != torch.int64 or ids_TK.device.type != "cpu":
            return False
        m = getattr(pred, "markov", pred)
        m.flush()
        tabs = m.compiled_tables()
        if not tabs.ok:
            return False
        nl = self.next_moe.get(l) if self.prefetching else None
        look = None
        if nl is not None and pred.name == "hybrid" and h_TD is not None:
            look = pred.lookahead.compiled_gate(nl)
            if look is None or h_TD.dtype != torch.float32 or h_TD.device.type != "cpu" or h_TD.stride(-1) != 1:
                return False
        ids_TK = ids_TK.contiguous()  # read through its pointer here and, as the previous layer's, at the next
        ids = ids_TK.tolist()
        prev_tok = self._prev_tok_lists(l, ids)
        p_prev = self._pred.pop(l, None)
        next_prev = None if nl is None else self._prev_tok_lists(nl, None)
        res = prefetch_step(tabs, l, ids_TK, p_prev, self._ids_t.get(self.prev_moe.get(l)), prev_tok,
                            nl, m.alpha, pred.weights_list(nl) if nl is not None else None,
                            next_prev, h_TD, look,
                            pred.lookahead.norm_eps if look is not None else 0.0, self.budget)
        if res is None:
            if p_prev is not None:
                self._pred[l] = p_prev
            return False
        st, nxt = res
        c = self.stats.c[l]
        if p_prev is not None:
            c["pred_inter"] += st[0]
            c["pred_n"] += st[1]
            c["true_n"] += st[2]
            c["pred_tokens"] += st[3]
        c["thrash_sum"] += st[4]
        c["thrash_n"] += st[5]
        m.after_compiled_observe(l, ids)
        self._ids[l], self._ids_t[l] = ids, ids_TK
        self._last[l] = {k: ids[t] for t, k in enumerate(self._key) if k >= 0}
        if nxt is not None:
            p_next, agg, top = nxt
            p_next, agg, top = self._keep_previous(p_next, next_prev, agg, top)
            self._pred[nl] = p_next
            self._prefetch(nl, sorted({g for r in p_next for g in r}), agg, top)
        return True

    def _on_route_small(self, l: int, ids: list[list[int]]) -> None:
        """`on_route` of a small step on Python lists (same counters, same learning, same prefetch)."""
        prev_layer = self._ids.get(self.prev_moe.get(l))
        prev_tok = self._prev_tok_lists(l, ids)
        c = self.stats.c[l]
        pred = self._pred.pop(l, None)
        true = [{e for e in row if e >= 0} for row in ids]
        if pred is not None:
            for p, t in zip(pred, true):
                ps = set(p)
                c["pred_inter"] += len(ps & t)
                c["pred_n"] += len(ps)
                c["true_n"] += len(t)
            c["pred_tokens"] += len(pred)
        for p, t in zip(prev_tok, true):
            a = {e for e in p if e >= 0}
            if a:
                c["thrash_sum"] += 1.0 - len(a & t) / len(a | t)
                c["thrash_n"] += 1
        self.predictor.observe_lists(l, ids, prev_layer, prev_tok)
        self._ids[l] = ids
        self._last[l] = {k: ids[t] for t, k in enumerate(self._key) if k >= 0}
        nl = self.next_moe.get(l)
        if self.prefetching and nl is not None:
            self._predict_small(nl, ids, self._prev_tok_lists(nl, None), self._hidden.get(l))

    def _predictor_hidden(self, layer: int, h_TD: torch.Tensor | None) -> torch.Tensor | None:
        """The hidden-state input of the prediction for `layer`: `h_TD` `[T, D]` (entering the previous MoE
        layer's FFN), or for predictors that read the previous token's state (`needs_prev_token_hidden`) `[T, 2D]`
        with each decode token's predecessor's residual entering `layer`'s FFN, from the previous step (zeros
        where unknown: prefill tokens, whose predecessor's state at `layer` is computed in this same step)."""
        if h_TD is None or not self.predictor.needs_prev_token_hidden:
            return h_TD
        last = self._last_h.get(layer, {})
        prev = torch.zeros(h_TD.shape[0], h_TD.shape[1])
        for t in self._decode:
            v = last.get(self._key[t])
            if v is not None:
                prev[t] = v
        return prev_token_input(h_TD, prev)

    def _predict_small(self, layer: int, prev_layer, prev_tok, hidden) -> None:
        """`_predict_and_prefetch` on Python lists: scores per token, top-`budget` by a stable sort (ties: the
        lower id, as the frequency predictor's tie-break intends)."""
        hidden = self._predictor_hidden(layer, hidden)
        s = self.predictor.scores_lists(layer, prev_layer, prev_tok, hidden, self._T)  # T lists of E
        rng, B = range(self.num_experts), self.budget
        # sorted(reverse=True) is stable: equal scores keep the lower id first, as heapq.nlargest would (faster
        # at E <= a few hundred)
        pred = [sorted(rng, key=row.__getitem__, reverse=True)[:B] for row in s]
        if len(s) == 1:
            agg = top = s[0]
        else:
            agg = [sum(col) for col in zip(*s)]
            top = [max(col) for col in zip(*s)]
        pred, agg, top = self._keep_previous(pred, prev_tok, agg, top)
        self._pred[layer] = pred
        self._prefetch(layer, sorted({g for p in pred for g in p}), agg, top)

    def _predict_and_prefetch(self, layer: int, prev_layer, prev_tok, hidden) -> None:
        hidden = self._predictor_hidden(layer, hidden)
        s = self.predictor.scores(layer, prev_layer, prev_tok, hidden, self._T)  # [T, E]
        # a stable sort, not topk: ties go to the lower id, as on the list path (topk's tie order is unspecified)
        pred = torch.sort(s, dim=-1, descending=True, stable=True).indices[:, : self.budget]  # [T, B]
        store = self.layers[layer]
        fills = not (store is None or (store.cache.capacity == 0 and store.tier is None))
        agg = top = None
        if fills or self._sticky is not None:
            # [E] expected uses in the batch and best per-token probability, read back once each
            agg, top = s.sum(0).tolist(), s.max(0).values.tolist()
        if self._sticky is not None:
            rows, agg, top = self._keep_previous(pred.tolist(), prev_tok.tolist(), agg, top)
            pred = torch.tensor(rows, dtype=torch.int64)
        self._pred[layer] = pred
        if fills:
            self._prefetch(layer, ExpertPredictor.union(pred), agg, top)

    def _prefetch(self, layer: int, union: list[int], agg: list[float], top: list[float]) -> None:
        """Queue the predicted experts `union` (global ids) of `layer`: the likeliest (by `agg`, expected uses
        in the batch) to the dequantized cache, the next ones to the cold tier's packed slots."""
        store = self.layers[layer]
        if store is None or (store.cache.capacity == 0 and store.tier is None):
            return
        lo = self.local_of[layer]
        scores = [agg[g] for g in self.local[layer]]  # per local expert
        store.cache.set_scores(scores)
        want = [lo[g] for g in union if g in lo and top[g] >= self.min_prefetch_prob]
        want.sort(key=lambda i: -agg[self.local[layer][i]])
        c = store.cache.capacity
        if c:
            store.request(want[:c], protect=set(want[:c]), prefetch=True)
        if store.tier is not None:
            # The most likely experts go to the dequantized cache; the next ones to the packed slots, so a
            # predicted expert the cache cannot take is at least not a cold miss.
            store.tier.set_scores(scores)
            store.request_packed(want[c : c + store.tier.capacity])
