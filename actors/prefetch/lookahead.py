"""Hidden-state expert predictors: `lookahead` (the next gate on the current hidden state) and `hybrid`.

`lookahead` applies the next MoE layer's router (or its fitted pre-gate) to the hidden state entering the
previous MoE layer's FFN; `hybrid` multiplies it with the Markov chains of `actors.prefetch.markov`.

Shape legend: T = tokens, K = experts per token (top-k), E = routed experts, L = layers, D = hidden.
"""
from __future__ import annotations

import torch

from kernels.cpu import GateLogprobs
from actors.prefetch.base import ExpertPredictor, _layer_weights, _loglinear, _softmax
from actors.prefetch.markov import MarkovPredictor
from actors.prefetch.transitions import TransitionCounts


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
        self._compiled = GateLogprobs(self.gate, self.norm, norm_eps)

    def compiled_gate(self, layer: int) -> tuple | None:
        """`layer`'s gate for the compiled kernels (`kernels.cpu.GateLogprobs.ptrs`: gate pointer, norm pointer
        or None, E, D), or None where they cannot run."""
        return self._compiled.ptrs(layer)

    def log_probs(self, layer: int, hidden_TD: torch.Tensor) -> torch.Tensor:
        """`[T, E]` float32 log softmax(gate_l(rmsnorm_l(h))) (layer must have a gate)."""
        fast = self._compiled(layer, hidden_TD)
        if fast is not None:
            return fast
        h = hidden_TD.detach().float().cpu()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.norm_eps)
        if self.norm[layer] is not None:
            h = h * self.norm[layer]
        return torch.log_softmax(h @ self.gate[layer].T, dim=-1)

    def scores(self, layer, prev_layer_ids_TK, prev_token_ids_TK, hidden_TD, num_tokens):
        if hidden_TD is None or self.gate[layer] is None:
            return torch.full((num_tokens, self.num_experts), 1.0 / self.num_experts)
        return self.log_probs(layer, hidden_TD).exp()


class HybridPredictor(ExpertPredictor):
    """Markov chains and lookahead in one log-linear model (a product of experts, not a mixture):

        score(b) = log P(b) + w_inter * g_inter(b) + w_intra * g_intra(b) + w_look * log p_lookahead(b)

    with the Markov terms of `MarkovPredictor` and p_lookahead the next gate's softmax on the current hidden
    state; per-layer weights fitted on calibration text (`fit_loglinear`). A product keeps an expert only if
    both sources find it plausible, so each vetoes the other's confident mistakes; a mixture only averages
    them (measured on tiny-moe held-out text, quick bench: product 0.89-0.91 recall, mixture 0.88). Without
    a hidden state (the first MoE layer) it is the Markov predictor with the hybrid's weights.

    Args:
        markov, lookahead: the two sources (share L, E, K). weights: `[L, 3]`, else `counts.weights["hybrid"]`,
            else DEFAULT_WEIGHTS["hybrid"]. counts: the calibration counts (for their fitted weights).
    Raises:
        ValueError: weights not of shape `[L, 3]`.
    """

    name = "hybrid"
    num_features = 3

    def __init__(self, markov: MarkovPredictor, lookahead: LookaheadPredictor, weights=None,
                 counts: TransitionCounts | None = None):
        super().__init__(markov.num_layers, markov.num_experts, markov.top_k, markov.moe_layers)
        self.markov, self.lookahead = markov, lookahead
        self.weights = _layer_weights(self.name, markov.num_layers, self.num_features, weights, counts)

    def logits(self, layer, prev_layer_ids_TK, prev_token_ids_TK, hidden_TD, num_tokens) -> torch.Tensor:
        """`[T, E]` float32 unnormalised log-probabilities (class docstring)."""
        logf, g = self.markov.features(layer, prev_layer_ids_TK, prev_token_ids_TK, num_tokens)
        if hidden_TD is not None and self.lookahead.gate[layer] is not None:
            g.append(self.lookahead.log_probs(layer, hidden_TD))
        return _loglinear(logf, g, self.weights[layer], num_tokens)

    def scores(self, layer, prev_layer_ids_TK, prev_token_ids_TK, hidden_TD, num_tokens):
        """`[T, E]` float32 probabilities (softmax of `logits`)."""
        return torch.softmax(self.logits(layer, prev_layer_ids_TK, prev_token_ids_TK, hidden_TD, num_tokens), -1)

    def scores_lists(self, layer, prev_layer, prev_tok, hidden_TD, num_tokens):
        w = self.weights_list(layer)
        look = None
        if hidden_TD is not None and self.lookahead.gate[layer] is not None:
            look = self.lookahead.log_probs(layer, hidden_TD)
        m = self.markov
        m.flush()
        p = m.compiled_tables().probs(layer, m.alpha, w, prev_layer, prev_tok, num_tokens, look)
        if p is not None:  # the compiled path (same formula)
            return p
        rows = m._logits_lists(layer, prev_layer, prev_tok, num_tokens, w)
        if hidden_TD is not None and self.lookahead.gate[layer] is not None:
            for r, look in zip(rows, look.tolist()):
                for b, v in enumerate(look):
                    r[b] += w[2] * v
        return [_softmax(r) for r in rows]

    def weights_list(self, layer: int) -> list[float]:
        """`weights[layer]` as floats (`MarkovPredictor.weights_list` on the hybrid's weights)."""
        return MarkovPredictor.weights_list(self, layer)

    def observe(self, layer, ids_TK, prev_layer_ids_TK, prev_token_ids_TK):
        self.markov.observe(layer, ids_TK, prev_layer_ids_TK, prev_token_ids_TK)

    def observe_lists(self, layer, ids, prev_layer, prev_tok):
        self.markov.observe_lists(layer, ids, prev_layer, prev_tok)


class PreAttentionHybridPredictor(HybridPredictor):
    """`HybridPredictor` with the pre-attention MLP (`actors.prefetch.pre_attention.PreAttentionPredictor`) as its
    hidden-state source in place of the lookahead gate: score(b) = log P(b) + w_inter * g_inter(b) +
    w_intra * g_intra(b) + w_pa * log p_mlp(b), weights `counts.weights["pre_attention_hybrid"]` (`fit_loglinear`).
    The Markov terms learn online from the served text, and so does the MLP's output layer (its `online_lr`)."""

    name = "pre_attention_hybrid"

    def observe(self, layer, ids_TK, prev_layer_ids_TK, prev_token_ids_TK):
        super().observe(layer, ids_TK, prev_layer_ids_TK, prev_token_ids_TK)
        self.lookahead.observe(layer, ids_TK, prev_layer_ids_TK, prev_token_ids_TK)

    def observe_lists(self, layer, ids, prev_layer, prev_tok):
        super().observe_lists(layer, ids, prev_layer, prev_tok)
        if self.lookahead.learns(layer):
            self.lookahead.observe_lists(layer, ids, prev_layer, prev_tok)
