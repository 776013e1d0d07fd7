"""The gating router: applies the policies to one MoE layer call, keeping their per-sequence state.

Policies (every one returns, for any input including rows of NaN/inf logits, unique in-range expert ids
and finite weights; ids of -1 with weight 0 pad rows that use fewer experts than the widest row):

- `exact`: the model's own routing: softmax, top-k, renormalised iff the config's `norm_topk_prob`.
  The default, and the reference the others are measured against.
- `balanced`: auxiliary-loss-free bias balancing (DeepSeek-V3, arXiv 2412.19437; Loss-Free Balancing,
  arXiv 2408.15664). A per-layer, per-expert bias b is added to the scores for selection only; once per
  step, b_i += n * u * sign(mean load - load_i) over that step's load of the layer's `balanced` tokens summed over
  the EP group, n = ceil(tokens / `balance_tokens`) with tokens the layer's `balanced` tokens in that load (so a
  1,024-token prefill step moves the bias as far as 4 decode steps of <= 256 tokens; the papers step once per
  training batch of far more tokens than a serving step holds) (`take_balance_load` on every rank, summed, then `update_bias` on every rank: the engine at
  world size 1, the lockstep agreement otherwise), so every rank holds the same bias after every step and a
  token's experts depend on the traffic balanced over, never on how it is split over ranks. Weights stay the
  unbiased scores. Selection runs in the fused kernel.
- `capacity`: each expert takes at most C = ceil(capacity_factor * T * K / E) tokens per call. In round
  j = 0..E-1 every token still short of K experts proposes its j-th best expert; an expert accepts the
  highest-scoring proposals up to its remaining room. C * E >= T * K, so every token ends with K experts:
  none is dropped.
- `dynamic`: a variable number of experts per token (granular top-p): experts in score order until their
  cumulative probability reaches `top_p`, at least `k_min` and at most `k_max`.
- `velocity`: per sequence and layer, the token velocity v_t = beta * v_(t-1) + (1 - beta) *
  (1 - cos(x_t, x_(t-1))), x the MoE layer's input (v starts at the first difference). Rule:
  v_t >= `velocity_fast` (the context is shifting): the token uses its `velocity_k` best routed experts
  only, their weights rescaled to the top-k weight mass (a few specialised experts, same routed mass);
  v_t <= `velocity_slow` (a slow, long-horizon stretch): `velocity_k` routed experts with their own
  weights, and the shared expert's output scaled by 1 + `velocity_shared_boost` (leans on the shared
  expert); otherwise exact top-k. Models without a shared expert skip the boost.
- `sticky` (anti-thrash): for each expert p the sequence's previous token used at this layer but the exact
  top-k dropped, if score(p) >= score(j) - `sticky_margin` for the lowest-scoring newly chosen expert j
  that the previous token did not use, p replaces j. Weights are the scores of the final set (renormalised
  iff `norm_topk_prob`). The previous token's set is the final (sticky) one, so stickiness carries.

Shape legend: T = tokens in the call, E = routed experts, K = experts per token (config top-k),
K' = widest row of a call (>= 1), D = hidden, L = layers.
"""
from __future__ import annotations

import math

import torch

from kernels import tuning
from kernels.cpu.routing import select_experts
from kernels.gating import sanitize_router_logits, topk_lowest_id
from actors.moe.gating import POLICIES, GatingBatch, GatingConfig, Routing
from actors.moe.gating_state import RoutingState

_STATEFUL = ("velocity", "sticky")  # policies that read the previous token's routing state


def _renorm(w: torch.Tensor, on: bool) -> torch.Tensor:
    return w / w.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) if on else w


class GatingRouter:
    """The per-rank gating entry point: policies, their state, and the thrash metric.

    Args:
        cfg: deployment gating settings. num_layers, num_experts, top_k, renormalize: from the model config
            (`norm_topk_prob`). hidden: model width. num_slots: sequence slots (max concurrent sequences
            + 1; slot S-1 is scratch for prompt scoring). has_shared_expert: whether `velocity` may boost it.
    Raises:
        ValueError: knobs incompatible with the model (k_min > E, velocity_k > top_k).
    """

    def __init__(self, cfg: GatingConfig, *, num_layers: int, num_experts: int, top_k: int, renormalize: bool,
                 hidden: int, num_slots: int, has_shared_expert: bool, device: torch.device | str = "cpu"):
        self.cfg = cfg
        self.E, self.K, self.renorm = num_experts, top_k, renormalize
        self.k_max = min(cfg.k_max or 2 * top_k, num_experts)
        if cfg.k_min > num_experts:
            raise ValueError(f"gating k_min={cfg.k_min} must be <= num_experts={num_experts}")
        if cfg.velocity_k > top_k:
            raise ValueError(f"gating velocity_k={cfg.velocity_k} must be <= the model's top_k={top_k}")
        self.has_shared = has_shared_expert
        self.device = torch.device(device)
        self.state = RoutingState(num_slots, num_layers, num_experts, max(self.k_max, top_k), hidden, self.device)
        self.bias = torch.zeros(num_layers, num_experts, dtype=torch.float32, device=self.device)
        # [L, E] int64: `balanced` selections since the last `take_balance_load` (this rank's tokens)
        self._balance_load = torch.zeros(num_layers, num_experts, dtype=torch.int64, device=self.device)
        self._balance_pending = False
        self.policy_tokens = dict.fromkeys(POLICIES, 0)
        self.experts_used = 0  # routed (token, expert) pairs chosen, all policies
        if cfg.backend == "triton":
            from kernels.gating_triton import select_experts_triton
            self._select = select_experts_triton
        else:  # CPU fp32: one compiled call (`kernels.cpu.routing`), else the reference
            self._select = select_experts

    # ------------------------------------------------------------------ entry point
    def route(self, layer: int, logits_TE: torch.Tensor, x_TD: torch.Tensor, batch: GatingBatch) -> Routing:
        """Route one MoE layer call; records per-sequence state and thrash. T may be 0."""
        if self.state.step is not batch.step_key and (batch.policy_T is not None or self.cfg.policy in _STATEFUL):
            self.state.flush()  # the earlier steps' sets, before a policy that reads them
        T = logits_TE.shape[0]
        default = POLICIES.index(self.cfg.policy)
        if batch.policy_T is None or T == 0 or bool((batch.policy_T == default).all()):
            out = self._run(self.cfg.policy, layer, logits_TE, x_TD, batch, None)
        else:
            parts = []
            for p in batch.policy_T.unique().tolist():
                rows = (batch.policy_T == p).nonzero().squeeze(1)
                parts.append((rows, self._run(POLICIES[p], layer, logits_TE, x_TD, batch, rows)))
            width = max(r.ids.shape[1] for _, r in parts)
            w = torch.zeros(T, width, dtype=torch.float32, device=logits_TE.device)
            ids = torch.full((T, width), -1, dtype=torch.int64, device=logits_TE.device)
            shared = None
            for rows, r in parts:
                w[rows, : r.weights.shape[1]] = r.weights
                ids[rows, : r.ids.shape[1]] = r.ids
                if r.shared_scale is not None:
                    shared = torch.ones(T, device=logits_TE.device) if shared is None else shared
                    shared[rows] = r.shared_scale
            out = Routing(weights=w, ids=ids, shared_scale=shared, may_pad=True)
        self.state.record(layer, batch, out.ids, x_TD)
        self.experts_used += (out.ids >= 0).sum() if out.may_pad else out.ids.numel()
        return out

    def _run(self, policy: str, layer: int, logits: torch.Tensor, x: torch.Tensor, batch: GatingBatch,
             rows: torch.Tensor | None) -> Routing:
        if rows is not None:
            # a sub-group: a request's policy is fixed, so a token's predecessor is in the same group
            logits, x = logits[rows], x[rows]
            batch = GatingBatch(slots_T=batch.slots_T[rows], positions_T=batch.positions_T[rows])
        self.policy_tokens[policy] += logits.shape[0]
        if policy == "exact":
            w, ids = self._select(logits, self.K, self.renorm)
            return Routing(weights=w, ids=ids)
        if policy == "balanced":
            return self._balanced(layer, logits)
        if policy == "capacity":
            return self._capacity(logits)
        if policy == "dynamic":
            return self._dynamic(logits)
        if policy == "velocity":
            return self._velocity(layer, logits, x, batch)
        return self._sticky(layer, logits, batch)

    # ------------------------------------------------------------------ policies
    def _balanced(self, layer: int, logits: torch.Tensor) -> Routing:
        w, ids = self._select(logits, self.K, self.renorm, self.bias[layer])
        if ids.numel():
            self._balance_load[layer] += torch.bincount(ids.reshape(-1), minlength=self.E)
            self._balance_pending = True
        return Routing(weights=w, ids=ids)

    # ------------------------------------------------------------------ balancing bias
    def take_balance_load(self) -> torch.Tensor | None:
        """This rank's `balanced` expert load since the last call: [L, E] int64 (a copy; the counters restart
        at zero), or None when no `balanced` token was routed (nothing to add)."""
        if not self._balance_pending:
            return None
        load, self._balance_pending = self._balance_load.clone(), False
        self._balance_load.zero_()
        return load

    def update_bias(self, load_LE: torch.Tensor) -> None:
        """One bias step from a step's `balanced` load summed over the EP group (the sum of every rank's
        `take_balance_load`, zeros for a rank that had none): b_l += n_l * u * sign(mean_e load_l - load_l) for
        each layer l with any load, n_l = ceil(tokens_l / balance_tokens) and tokens_l = sum_e load_l / top_k
        (every `balanced` token takes top_k experts); other layers keep their bias. load_LE: [L, E] integer
        counts, any device. The result depends on the summed load only, so it is the same on every rank."""
        load = load_LE.to(self.device, torch.float32)
        n = torch.ceil(load.sum(dim=1, keepdim=True) / (self.K * self.cfg.balance_tokens))  # 0 for an idle layer
        self.bias += n * self.cfg.balance_rate * torch.sign(load.mean(dim=1, keepdim=True) - load)

    def _capacity(self, logits: torch.Tensor) -> Routing:
        T, E, K = logits.shape[0], self.E, self.K
        probs = torch.softmax(sanitize_router_logits(logits), dim=-1)
        if T == 0:
            return Routing(weights=probs.new_zeros(0, K), ids=torch.zeros(0, K, dtype=torch.int64, device=probs.device))
        cap = max(1, math.ceil(self.cfg.capacity_factor * T * K / E))
        ranked = torch.argsort(probs, dim=-1, descending=True, stable=True)  # [T, E]
        room = torch.full((E,), cap, dtype=torch.int64, device=probs.device)
        got = torch.zeros(T, dtype=torch.int64, device=probs.device)
        ids = torch.full((T, K), -1, dtype=torch.int64, device=probs.device)
        for j in range(E):
            need = (got < K).nonzero().squeeze(1)
            if need.numel() == 0:
                break
            cand = ranked[need, j]
            score = probs[need, cand]
            # per expert, accept the best-scoring proposals up to its room: sort by (expert, -score)
            order = torch.argsort(cand * 4.0 - score, stable=True)  # scores in [0, 1], so the expert dominates
            cand_o, need_o = cand[order], need[order]
            first = torch.searchsorted(cand_o, cand_o, right=False)
            rank_in_e = torch.arange(cand_o.numel(), device=probs.device) - first
            ok = rank_in_e < room[cand_o]
            acc_t, acc_e = need_o[ok], cand_o[ok]
            ids[acc_t, got[acc_t]] = acc_e
            got[acc_t] += 1
            room -= torch.bincount(acc_e, minlength=E)
        w = _renorm(probs.gather(1, ids), self.renorm)
        return Routing(weights=w, ids=ids)

    def _dynamic(self, logits: torch.Tensor) -> Routing:
        probs = torch.softmax(sanitize_router_logits(logits), dim=-1)
        w, ids = topk_lowest_id(probs, self.k_max)
        before = torch.cumsum(w, dim=-1) - w  # mass of the experts ranked above each one
        keep = before < self.cfg.top_p
        keep[:, : self.cfg.k_min] = True
        w = torch.where(keep, w, torch.zeros_like(w))
        ids = torch.where(keep, ids, torch.full_like(ids, -1))
        return Routing(weights=_renorm(w, self.renorm), ids=ids, may_pad=True)

    def _velocity(self, layer: int, logits: torch.Tensor, x: torch.Tensor, batch: GatingBatch) -> Routing:
        cfg, st = self.cfg, self.state
        T, dev = logits.shape[0], logits.device
        slots, pos, prev_row = batch.slots_T, batch.positions_T, batch.prev_row_T
        xf = x.float()
        beta = cfg.velocity_beta
        if not batch.has_inner:
            # every row's predecessor is stored (a decode step): one wave, no in-step predecessors, and the
            # last row of each sequence is every row; same values as the general path below, fewer ops
            dist = 1 - torch.cosine_similarity(xf, st.inputs()[slots, layer], dim=-1)
            dist = torch.where(batch.fresh_T, torch.full_like(dist, float("nan")), dist)
            base = st.velocity[slots, layer]  # nan when unset; a fresh row's dist is nan, so its v is too
            vel = torch.where(torch.isnan(base), dist, beta * base + (1 - beta) * dist)
            st.velocity[slots, layer] = vel
        else:
            # cosine distance to the predecessor's input: in this step if there, else the stored one
            prev_x = st.inputs()[slots, layer]  # advanced indexing: a copy
            inside = prev_row >= 0
            prev_x[inside] = xf[prev_row[inside]]
            dist = 1 - torch.cosine_similarity(xf, prev_x, dim=-1)
            dist = torch.where(pos > 0, dist, torch.full_like(dist, float("nan")))
            # v_t = beta * v_(t-1) + (1 - beta) * d_t, walked in waves (a row's predecessor is in the wave before)
            vel = torch.full((T,), float("nan"), device=dev)
            stored = st.velocity[slots, layer]
            for wv in batch.wave_list():
                pr = prev_row[wv]
                base = torch.where(pr >= 0, vel[pr.clamp(min=0)], stored[wv])
                base = torch.where(pos[wv] == 0, torch.full_like(base, float("nan")), base)
                d = dist[wv]
                vel[wv] = torch.where(torch.isnan(base), d, beta * base + (1 - beta) * d)
            st.velocity[slots[batch.last_rows], layer] = vel[batch.last_rows]
        # the rule (module docstring); a token with no history yet (nan) counts as neither fast nor slow
        w, ids = self._select(logits, self.K, self.renorm)
        fast = torch.nan_to_num(vel, nan=-1.0) >= cfg.velocity_fast
        slow = torch.nan_to_num(vel, nan=float("inf")) <= cfg.velocity_slow
        kv, tiny = cfg.velocity_k, torch.finfo(torch.float32).tiny
        if T and not bool((fast | slow).any()):  # most tokens: exact top-k, the shared expert unscaled
            return Routing(weights=w, ids=ids)
        if kv < self.K:
            drop = (fast | slow)[:, None] & (torch.arange(self.K, device=dev) >= kv)[None, :]
            kept = torch.where(drop, torch.zeros_like(w), w)
            rescaled = kept * w.sum(1, keepdim=True) / kept.sum(1, keepdim=True).clamp_min(tiny)
            w = torch.where(fast[:, None], rescaled, kept)
            ids = torch.where(drop, torch.full_like(ids, -1), ids)
        shared = None
        if self.has_shared:
            shared = torch.where(slow, 1 + cfg.velocity_shared_boost, 1.0).float()
        return Routing(weights=w, ids=ids, shared_scale=shared, may_pad=True)

    def _sticky(self, layer: int, logits: torch.Tensor, batch: GatingBatch) -> Routing:
        T, K = logits.shape[0], self.K
        probs = torch.softmax(sanitize_router_logits(logits), dim=-1)
        ids = topk_lowest_id(probs, K)[1]
        stored = self.state.prev_ids[batch.slots_T, layer, :K]
        if not batch.has_inner and 0 < T <= tuning.STICK_LIST_ROWS:
            # a decode step: every row's predecessor is stored; the rule on Python lists beats ~30 tiny ops
            prev = torch.where(batch.fresh_T[:, None], torch.full_like(stored, -1), stored)
            ids = _stick_lists(probs.tolist(), ids.tolist(), prev.tolist(), self.cfg.sticky_margin, ids.device)
            return Routing(weights=_renorm(probs.gather(1, ids), self.renorm), ids=ids)
        for wv in batch.wave_list():
            pr = batch.prev_row_T[wv]
            prev = torch.where((pr >= 0)[:, None], ids[pr.clamp(min=0)], stored[wv])
            prev = torch.where((batch.positions_T[wv] == 0)[:, None], torch.full_like(prev, -1), prev)
            ids[wv] = _stick(probs[wv], ids[wv], prev, self.cfg.sticky_margin)
        return Routing(weights=_renorm(probs.gather(1, ids), self.renorm), ids=ids)

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict:
        """{"policy", "thrash": [L] (nan: no pairs), "bias_absmax", "policy_tokens", "experts_per_token"}."""
        self.state.flush()
        routed = sum(self.policy_tokens.values())
        return {"policy": self.cfg.policy, "thrash": self.state.thrash(),
                "bias_absmax": float(self.bias.abs().max()) if self.bias.numel() else 0.0,
                "policy_tokens": dict(self.policy_tokens),
                "experts_per_token": int(self.experts_used) / routed if routed else float("nan")}


def _stick_rows(probs: list, new: list, prev: list, margin: float) -> None:
    """`_stick` on Python lists (rows [N][E] probabilities, [N][K] chosen ids, [N][K] previous ids with -1 =
    none), updating the rows of `new` in place: the same rule and the same tie order (previous experts by
    descending score, stable)."""
    for pr, nw, pv in zip(probs, new, prev):
        for p in sorted((e for e in pv if e >= 0), key=lambda e: -pr[e]):
            if p in nw:
                continue
            fresh = [j for j in range(len(nw)) if nw[j] not in pv]
            if not fresh:
                break
            slot = min(fresh, key=lambda j: pr[nw[j]])
            if pr[p] >= pr[nw[slot]] - margin:
                nw[slot] = p


def _stick_lists(probs: list, new: list, prev: list, margin: float, device) -> torch.Tensor:
    """`_stick_rows`, returning the chosen ids as [N, K] int64 on `device` (N >= 1)."""
    _stick_rows(probs, new, prev, margin)
    return torch.tensor(new, dtype=torch.int64, device=device).view(len(new), -1)


def _stick(probs_NE: torch.Tensor, new_NK: torch.Tensor, prev_NK: torch.Tensor, margin: float) -> torch.Tensor:
    """Replace newly chosen experts by previous ones that score within `margin` (see module docstring)."""
    new = new_NK.clone()
    N, K = new.shape
    if N == 0:
        return new
    rows = torch.arange(N, device=new.device)
    # previous experts in descending score order
    pscore = torch.where(prev_NK >= 0, probs_NE.gather(1, prev_NK.clamp(min=0)), torch.full(prev_NK.shape, -1.0, device=new.device))
    porder = torch.argsort(pscore, dim=1, descending=True, stable=True)  # ties: previous order (`_stick_lists`)
    for j in range(prev_NK.shape[1]):
        p = prev_NK.gather(1, porder[:, j : j + 1]).squeeze(1)
        ps = pscore.gather(1, porder[:, j : j + 1]).squeeze(1)
        valid = p >= 0
        in_new = (new == p[:, None]).any(dim=1)
        # candidates to replace: chosen experts that the previous token did not use
        was_prev = (new[:, :, None] == prev_NK[:, None, :]).any(dim=2)
        nscore = torch.where(was_prev, torch.full((N, K), 2.0, device=new.device), probs_NE.gather(1, new))
        slot = nscore.argmin(dim=1)
        ok = valid & ~in_new & (nscore[rows, slot] <= 1.0) & (ps >= nscore[rows, slot] - margin)
        new[rows[ok], slot[ok]] = p[ok]
    return new
