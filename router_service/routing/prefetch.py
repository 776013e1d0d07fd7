"""Expert-prefetch predictors: which experts will the next MoE layer use for these tokens?

Shape legend: T = tokens, K = experts per token (top-k), B = prediction budget per token (k + 1 by default),
E = routed experts, L = layers, D = hidden. Expert ids are int64 global ids; -1 = unknown / none.

Every predictor answers `scores(layer, prev_layer_ids, prev_token_ids, hidden) -> [T, E]` (higher = more
likely to be used by that token at `layer`) from what is known before `layer` routes:
  prev_layer_ids `[T, K]`: the same tokens' experts at the previous MoE layer (None at the first one);
  prev_token_ids `[T, K]`: each token's predecessor in its sequence, its experts at `layer` (-1 rows: none);
  hidden `[T, D]`: the residual stream entering the previous MoE layer's FFN (for lookahead).
`predict` keeps the top `budget` per token; `union` is what a rank makes ready for a batch. `observe`
feeds the true routing back (online update); the engine calls it right after each layer's gate.

Predictors (all evaluated prequentially by `prequential_eval`: each prediction is made before the token is
routed at that layer, and the predictor learns from the truth right after):
  none      - predicts nothing (baseline: every non-resident expert is a miss).
  frequent  - the layer's most used experts so far (calibration counts + online counts).
  markov    - first-order Markov chains over expert sets: P(b at l | a at previous MoE layer, same token)
              and P(b at l | a at l, previous token), mixed; counts seeded from a calibration run on
              training text and updated online (ProMoE arXiv 2410.22134 and "Exploiting inter-layer expert
              affinity" arXiv 2401.08383 report these chains are strongly non-uniform; the layer-to-layer
              chain is the one ExFlow uses).
  lookahead - the next layer's gate applied to the current hidden state (mixtral-offloading, Eliseev &
              Mazur 2023, arXiv 2312.17238: hidden states change little between adjacent layers).
  hybrid    - markov and lookahead distributions mixed, with a per-layer weight learned online.
"""
from __future__ import annotations

import json
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from router_service.routing.stats import RoutingStats, multi_hot

PREDICTORS = ("none", "frequent", "markov", "lookahead", "hybrid")
# Chosen by measurement (bench/experts.py, prequential recall on held-out prose and code of the tiny-moe model).
DEFAULT_PREDICTOR = "hybrid"
TRANSITIONS_FILE = "expert_transitions.safetensors"


def _moe_layer_list(num_layers: int, moe_layers: list[bool] | None) -> list[bool]:
    return list(moe_layers) if moe_layers is not None else [True] * num_layers


@dataclass(kw_only=True, slots=True)
class TransitionCounts:
    """Expert co-occurrence counts (float64 so online updates never overflow).

    inter: `[L, E, E]`, inter[l, a, b] = tokens that used a at the previous MoE layer and b at l.
    intra: `[L, E, E]`, intra[l, a, b] = (previous token used a, token used b) at layer l, same sequence.
    freq: `[L, E]`, freq[l, b] = tokens that used b at layer l.
    tokens: tokens observed (at any one layer).
    Raises (in `__post_init__`): ValueError naming a field whose shape disagrees with `freq`.
    """

    inter: torch.Tensor
    intra: torch.Tensor
    freq: torch.Tensor
    tokens: int = 0

    def __post_init__(self) -> None:
        L, E = self.freq.shape
        for name in ("inter", "intra"):
            if tuple(getattr(self, name).shape) != (L, E, E):
                raise ValueError(f"{name}.shape={tuple(getattr(self, name).shape)}, expected {(L, E, E)}")

    @classmethod
    def zeros(cls, num_layers: int, num_experts: int) -> TransitionCounts:
        z = torch.float64
        return cls(inter=torch.zeros(num_layers, num_experts, num_experts, dtype=z),
                   intra=torch.zeros(num_layers, num_experts, num_experts, dtype=z),
                   freq=torch.zeros(num_layers, num_experts, dtype=z))

    @property
    def num_layers(self) -> int:
        return self.freq.shape[0]

    @property
    def num_experts(self) -> int:
        return self.freq.shape[1]

    def clone(self) -> TransitionCounts:
        return TransitionCounts(inter=self.inter.clone(), intra=self.intra.clone(), freq=self.freq.clone(),
                                tokens=self.tokens)

    def observe(self, layer: int, ids_TK: torch.Tensor, prev_layer_ids_TK: torch.Tensor | None,
                prev_token_ids_TK: torch.Tensor | None) -> None:
        """Add one layer's routing of T tokens (see the module docstring for the arguments)."""
        E = self.num_experts
        cur = multi_hot(ids_TK.cpu(), E).double()  # [T, E]
        self.freq[layer] += cur.sum(0)
        if prev_layer_ids_TK is not None:
            self.inter[layer] += multi_hot(prev_layer_ids_TK.cpu(), E).double().T @ cur
        if prev_token_ids_TK is not None:
            self.intra[layer] += multi_hot(prev_token_ids_TK.cpu(), E).double().T @ cur
        if layer == 0 or not bool(self.freq[:layer].any()):
            self.tokens += ids_TK.shape[0]  # counted once per token: at the first layer that routes

    def save(self, path: str, meta: dict | None = None) -> None:
        """Write a safetensors file (counts + json metadata: layers, experts, tokens, anything in `meta`)."""
        from safetensors.torch import save_file

        md = {"num_layers": str(self.num_layers), "num_experts": str(self.num_experts), "tokens": str(self.tokens),
              "meta": json.dumps(meta or {})}
        save_file({"inter": self.inter.contiguous(), "intra": self.intra.contiguous(), "freq": self.freq.contiguous()},
                  path, metadata=md)

    @classmethod
    def load(cls, path: str) -> TransitionCounts:
        """Read `save`'s file. Raises FileNotFoundError, or ValueError on inconsistent shapes."""
        from safetensors import safe_open

        if not os.path.isfile(path):
            raise FileNotFoundError(f"no expert-transition file at {path!r}")
        with safe_open(path, "pt") as f:
            md = f.metadata() or {}
            t = {k: f.get_tensor(k).double() for k in ("inter", "intra", "freq")}
        return cls(**t, tokens=int(md.get("tokens", 0)))


class ExpertPredictor(ABC):
    """Scores the experts a layer will use, from what is known before it routes (module docstring).

    Args:
        num_layers: L. num_experts: E. top_k: K (the default budget is K + 1).
        moe_layers: `[L]` bool, True where the layer has routed experts (default: all).
    """

    name = "base"

    def __init__(self, num_layers: int, num_experts: int, top_k: int, moe_layers: list[bool] | None = None):
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
        self.num_layers, self.num_experts, self.top_k = num_layers, num_experts, top_k
        self.moe_layers = _moe_layer_list(num_layers, moe_layers)

    @abstractmethod
    def scores(self, layer: int, prev_layer_ids_TK: torch.Tensor | None, prev_token_ids_TK: torch.Tensor | None,
               hidden_TD: torch.Tensor | None, num_tokens: int) -> torch.Tensor:
        """`[T, E]` float32 scores (higher = more likely); T = `num_tokens`."""

    def observe(self, layer: int, ids_TK: torch.Tensor, prev_layer_ids_TK: torch.Tensor | None,
                prev_token_ids_TK: torch.Tensor | None) -> None:
        """Learn from the true routing of `layer` (default: stateless)."""

    def predict(self, layer: int, prev_layer_ids_TK: torch.Tensor | None, prev_token_ids_TK: torch.Tensor | None,
                hidden_TD: torch.Tensor | None, num_tokens: int, budget: int | None = None) -> torch.Tensor:
        """Top-`budget` expert ids per token, `[T, B]` int64 (B = min(budget, E); default budget K + 1)."""
        b = min(self.top_k + 1 if budget is None else budget, self.num_experts)
        s = self.scores(layer, prev_layer_ids_TK, prev_token_ids_TK, hidden_TD, num_tokens)
        return torch.topk(s, b, dim=-1).indices

    @staticmethod
    def union(pred_TB: torch.Tensor) -> list[int]:
        """Sorted distinct expert ids predicted for the batch."""
        return sorted(int(e) for e in torch.unique(pred_TB) if e >= 0)


class NoPredictor(ExpertPredictor):
    """Predicts nothing: `predict` returns `[T, 0]`."""

    name = "none"

    def scores(self, layer, prev_layer_ids_TK, prev_token_ids_TK, hidden_TD, num_tokens):
        return torch.zeros(num_tokens, self.num_experts)

    def predict(self, layer, prev_layer_ids_TK, prev_token_ids_TK, hidden_TD, num_tokens, budget=None):
        return torch.zeros(num_tokens, 0, dtype=torch.int64)


class FrequencyPredictor(ExpertPredictor):
    """The layer's most frequently used experts (calibration counts + online counts), same for every token.

    Seed counts are a prior worth at most `prior_tokens` tokens (scaled down when the calibration run saw
    more), so that online evidence from the served text takes over after a few hundred tokens: calibration
    text is never exactly the served domain (measured on tiny-moe: an unscaled 4096-token seed cost 0.12
    recall on held-out code against no seed; scaled to 256 tokens it keeps the cold start and loses ~0.03).
    """

    name = "frequent"

    def __init__(self, num_layers, num_experts, top_k, moe_layers=None, counts: TransitionCounts | None = None,
                 prior_tokens: float | None = 256):
        super().__init__(num_layers, num_experts, top_k, moe_layers)
        self.counts = counts.clone() if counts is not None else TransitionCounts.zeros(num_layers, num_experts)
        if counts is not None and prior_tokens is not None and counts.tokens > prior_tokens:
            s = prior_tokens / counts.tokens
            self.counts.inter *= s
            self.counts.intra *= s
            self.counts.freq *= s

    def scores(self, layer, prev_layer_ids_TK, prev_token_ids_TK, hidden_TD, num_tokens):
        f = self.counts.freq[layer].float()
        # A deterministic tie-break towards low ids keeps predictions reproducible before any data.
        f = f - 1e-6 * torch.arange(self.num_experts, dtype=torch.float32)
        return f.expand(num_tokens, -1)

    def observe(self, layer, ids_TK, prev_layer_ids_TK, prev_token_ids_TK):
        self.counts.observe(layer, ids_TK, prev_layer_ids_TK, prev_token_ids_TK)


class MarkovPredictor(FrequencyPredictor):
    """Markov chains over expert sets, layer-to-layer (same token) and token-to-token (same layer).

    score(b) = [w_inter * mean_{a in prev layer set} P_inter(b | a) + w_intra * mean_{a in prev token set}
    P_intra(b | a) + eps * P(b)] / (weights of the terms present + eps); each P is a row-normalised count
    matrix with additive smoothing `alpha`, P(b) the layer's expert frequency. A token with neither context
    falls back to the frequency ranking.
    """

    name = "markov"

    def __init__(self, num_layers, num_experts, top_k, moe_layers=None, counts: TransitionCounts | None = None,
                 w_inter: float = 1.0, w_intra: float = 1.0, alpha: float = 0.5, eps: float = 1e-3,
                 prior_tokens: float | None = 256):
        super().__init__(num_layers, num_experts, top_k, moe_layers, counts, prior_tokens)
        if alpha <= 0:
            raise ValueError(f"alpha={alpha} must be > 0")
        self.w_inter, self.w_intra, self.alpha, self.eps = w_inter, w_intra, alpha, eps

    def _rows(self, m_EE: torch.Tensor) -> torch.Tensor:
        m = m_EE.float() + self.alpha
        return m / m.sum(-1, keepdim=True)

    def _term(self, ids_TK: torch.Tensor, m_EE: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = multi_hot(ids_TK.cpu(), self.num_experts).float()  # [T, E]
        n = h.sum(1, keepdim=True)
        return (h @ self._rows(m_EE)) / n.clamp(min=1), (n > 0).float()  # [T, E], [T, 1]

    def scores(self, layer, prev_layer_ids_TK, prev_token_ids_TK, hidden_TD, num_tokens):
        f = self.counts.freq[layer].float() + self.alpha
        s = self.eps * (f / f.sum()).expand(num_tokens, -1).clone()
        w = torch.full((num_tokens, 1), self.eps)
        if prev_layer_ids_TK is not None and self.w_inter > 0:
            p, present = self._term(prev_layer_ids_TK, self.counts.inter[layer])
            s += self.w_inter * p * present
            w += self.w_inter * present
        if prev_token_ids_TK is not None and self.w_intra > 0:
            p, present = self._term(prev_token_ids_TK, self.counts.intra[layer])
            s += self.w_intra * p * present
            w += self.w_intra * present
        return s / w

    def probabilities(self, *a) -> torch.Tensor:
        """`scores` (already a distribution over E per token)."""
        return self.scores(*a)


class LookaheadPredictor(ExpertPredictor):
    """The next layer's router applied to the current hidden state: softmax(gate_l(rmsnorm_l(h))).

    Args:
        gate_weights: per layer `[E, D]` router weights (None for dense layers).
        norm_weights: per layer `[D]` post-attention RMSNorm weights (None: no norm weight).
        norm_eps: RMSNorm epsilon.
    Raises:
        ValueError: `gate_weights` does not have one entry per layer.
    """

    name = "lookahead"

    def __init__(self, num_layers, num_experts, top_k, moe_layers=None, *, gate_weights: list, norm_weights=None,
                 norm_eps: float = 1e-6):
        super().__init__(num_layers, num_experts, top_k, moe_layers)
        if len(gate_weights) != num_layers:
            raise ValueError(f"gate_weights has {len(gate_weights)} entries, expected num_layers={num_layers}")
        self.gate = [None if g is None else g.detach().float().cpu() for g in gate_weights]
        self.norm = [None if n is None else n.detach().float().cpu() for n in (norm_weights or [None] * num_layers)]
        self.norm_eps = norm_eps

    def scores(self, layer, prev_layer_ids_TK, prev_token_ids_TK, hidden_TD, num_tokens):
        if hidden_TD is None or self.gate[layer] is None:
            return torch.full((num_tokens, self.num_experts), 1.0 / self.num_experts)
        h = hidden_TD.detach().float().cpu()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.norm_eps)
        if self.norm[layer] is not None:
            h = h * self.norm[layer]
        return torch.softmax(h @ self.gate[layer].T, dim=-1)


class HybridPredictor(ExpertPredictor):
    """Per-layer mixture of the Markov and lookahead distributions: p = (1 - lam_l) p_markov + lam_l p_lookahead.

    With `adaptive`, lam_l is learned online by gradient ascent on the mixture's log-likelihood of the experts
    each layer actually routed to (d log p / d lam = (p_lookahead - p_markov) / p), clipped to [0.05, 0.95]:
    lookahead is strong where adjacent layers' hidden states are similar, Markov where routing is sticky, and
    which one wins differs per layer and domain. `scores` remembers both components of the last prediction per
    layer; `observe` of the same tokens updates lam_l from them.
    """

    name = "hybrid"

    def __init__(self, markov: MarkovPredictor, lookahead: LookaheadPredictor, w_lookahead: float = 0.5,
                 adaptive: bool = True, lr: float = 0.05):
        super().__init__(markov.num_layers, markov.num_experts, markov.top_k, markov.moe_layers)
        if not 0 <= w_lookahead <= 1:
            raise ValueError(f"w_lookahead={w_lookahead} must be in [0, 1]")
        self.markov, self.lookahead, self.adaptive, self.lr = markov, lookahead, adaptive, lr
        self.lam = [w_lookahead] * markov.num_layers
        self._last: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def scores(self, layer, prev_layer_ids_TK, prev_token_ids_TK, hidden_TD, num_tokens):
        a = (prev_layer_ids_TK, prev_token_ids_TK, hidden_TD, num_tokens)
        pm = self.markov.scores(layer, *a)
        if hidden_TD is None:
            self._last.pop(layer, None)
            return pm
        pl = self.lookahead.scores(layer, *a)
        self._last[layer] = (pm, pl)
        lam = self.lam[layer]
        return (1 - lam) * pm + lam * pl

    def observe(self, layer, ids_TK, prev_layer_ids_TK, prev_token_ids_TK):
        self.markov.observe(layer, ids_TK, prev_layer_ids_TK, prev_token_ids_TK)
        last = self._last.pop(layer, None)
        if not self.adaptive or last is None or last[0].shape[0] != ids_TK.shape[0]:
            return
        pm, pl = last
        ids = ids_TK.cpu()
        valid = ids >= 0
        idx = ids.clamp(min=0)
        m, lk = pm.gather(1, idx)[valid], pl.gather(1, idx)[valid]
        if m.numel():
            lam = self.lam[layer]
            grad = float(((lk - m) / ((1 - lam) * m + lam * lk).clamp(min=1e-6)).mean())
            self.lam[layer] = min(0.95, max(0.05, lam + self.lr * grad))


def make_predictor(name: str, *, num_layers: int, num_experts: int, top_k: int, moe_layers: list[bool] | None = None,
                   counts: TransitionCounts | None = None, gate_weights: list | None = None,
                   norm_weights: list | None = None, norm_eps: float = 1e-6) -> ExpertPredictor:
    """Build a predictor by name (one of PREDICTORS).

    Raises:
        ValueError: unknown `name`, or lookahead / hybrid without `gate_weights`.
    """
    kw = {"num_layers": num_layers, "num_experts": num_experts, "top_k": top_k, "moe_layers": moe_layers}
    if name == "none":
        return NoPredictor(**kw)
    if name == "frequent":
        return FrequencyPredictor(**kw, counts=counts)
    if name == "markov":
        return MarkovPredictor(**kw, counts=counts)
    if name in ("lookahead", "hybrid"):
        if gate_weights is None:
            raise ValueError(f"prefetch={name!r} needs the routers' gate_weights")
        look = LookaheadPredictor(**kw, gate_weights=gate_weights, norm_weights=norm_weights, norm_eps=norm_eps)
        return look if name == "lookahead" else HybridPredictor(MarkovPredictor(**kw, counts=counts), look)
    raise ValueError(f"prefetch={name!r} is not a known predictor (expected one of {PREDICTORS})")


@dataclass(kw_only=True, slots=True)
class RoutingTrace:
    """The routing of one sequence through every layer (recorded by running the model).

    ids: `[T, L, K]` int64 expert ids (-1 at dense layers). hidden: `[T, L, D]` float residual stream entering
    each layer's FFN, or None (then lookahead predictors see no hidden state).
    """

    ids: torch.Tensor
    hidden: torch.Tensor | None = None


def prequential_eval(predictors: dict[str, ExpertPredictor], traces: list[RoutingTrace], *,
                     budget: int | None = None) -> dict[str, RoutingStats]:
    """Score each predictor token by token, predicting (t, l) before it is observed, then learning from it.

    Every MoE layer after the first is predicted (the first has no previous layer in the same token; its
    prefetch, if any, comes from the previous token alone). Predictors are updated online in place.

    Args:
        predictors: name -> predictor (all share L, E, K).
        traces: sequences, in the order they are served.
        budget: experts per token predicted (default K + 1).
    Returns:
        name -> RoutingStats with per-layer recall and precision (`summary()`).
    """
    out = {n: RoutingStats() for n in predictors}
    for tr in traces:
        T, L, _ = tr.ids.shape
        moe = [l for l in range(L) if bool((tr.ids[:, l] >= 0).any())]
        for t in range(T):
            for i, l in enumerate(moe):
                pl = moe[i - 1] if i else None
                prev_layer = tr.ids[t : t + 1, pl] if pl is not None else None
                prev_tok = tr.ids[t - 1 : t, l] if t else None
                hidden = tr.hidden[t : t + 1, pl] if (pl is not None and tr.hidden is not None) else None
                true = tr.ids[t : t + 1, l]
                for name, p in predictors.items():
                    if pl is not None:
                        pred = p.predict(l, prev_layer, prev_tok, hidden, 1, budget)
                        out[name].add_prediction(l, pred, true, p.num_experts)
                    p.observe(l, true, prev_layer, prev_tok)
    return out
