"""The expert-predictor interface (`ExpertPredictor`), the null predictor, and helpers the predictors share.

Shape legend: T = tokens, K = experts per token (top-k), B = prediction budget per token (k + 1 by default),
E = routed experts, L = layers, D = hidden. Expert ids are int64 global ids; -1 = unknown / none.

Every predictor answers `scores(layer, prev_layer_ids, prev_token_ids, hidden) -> [T, E]` (higher = more
likely to be used by that token at `layer`) from what is known before `layer` routes:
  prev_layer_ids `[T, K]`: the same tokens' experts at the previous MoE layer (None at the first one);
  prev_token_ids `[T, K]`: each token's predecessor in its sequence, its experts at `layer` (-1 rows: none);
  hidden `[T, D]`: the residual stream entering the previous MoE layer's FFN (for lookahead).
`predict` keeps the top `budget` per token; `union` is what a rank makes ready for a batch. `observe`
feeds the true routing back (online update); the engine calls it right after each layer's gate.

Each predictor answers in two forms with the same results: on tensors (`scores` / `observe`) and on Python
lists (`scores_lists` / `observe_lists`, for small decode batches, where the default converts to tensors). The
Markov-based predictors run their list form in compiled C (`kernels.cpu`) where it can run, and fall back to
Python per call (no kernels, over-long id rows).
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod

import torch


def _moe_layer_list(num_layers: int, moe_layers: list[bool] | None) -> list[bool]:
    return list(moe_layers) if moe_layers is not None else [True] * num_layers


def _ids_tensor(rows: list[list[int]] | None) -> torch.Tensor | None:
    """Ragged id lists -> `[T, max len]` int64, padded with -1 (None stays None)."""
    if rows is None:
        return None
    k = max((len(r) for r in rows), default=0)
    return torch.tensor([list(r) + [-1] * (k - len(r)) for r in rows], dtype=torch.int64).reshape(len(rows), k)


def _id_set(row) -> list[int]:
    """Distinct valid (>= 0) ids of one token, in first-seen order (a multi-hot row's members)."""
    return list(dict.fromkeys(e for e in row if e >= 0))


def _softmax(v: list[float]) -> list[float]:
    m = max(v)
    ex = [math.exp(x - m) for x in v]
    t = sum(ex)
    return [x / t for x in ex]


def _loglinear(logf: torch.Tensor, feats: list, weights, num_tokens: int) -> torch.Tensor:
    """`[T, E]` log-linear score: the prior `logf` ([1, E] or [T, E]) plus sum_i weights[i] * feats[i] over the
    features present (None: that source has nothing for these tokens)."""
    s = logf.expand(num_tokens, -1).clone()
    for i, f in enumerate(feats):
        if f is not None:
            s += float(weights[i]) * f
    return s


# Log-linear weights used when the calibration file has none: naive Bayes over the previous layer's set (1.0),
# the previous token's set at half weight (consecutive tokens share under half their experts on tiny-moe), and
# the lookahead at the weight the calibration fit found on tiny-moe (about 2: the gate is sharper than its softmax);
# the pre-attention MLP's term starts there too.
DEFAULT_WEIGHTS = {"markov": (1.0, 0.5), "hybrid": (1.0, 0.5, 2.0), "pre_attention_hybrid": (1.0, 0.5, 2.0),
                   "pre_attention_prev_hybrid": (1.0, 0.5, 2.0)}


def _layer_weights(name: str, num_layers: int, num_features: int, weights, counts) -> torch.Tensor:
    """`[L, F]` float32 log-linear weights: given, else fitted in `counts`, else DEFAULT_WEIGHTS[name]."""
    if weights is None and counts is not None and counts.weights and name in counts.weights:
        weights = counts.weights[name]
    if weights is None:
        weights = [DEFAULT_WEIGHTS[name]] * num_layers
    w = torch.as_tensor(weights, dtype=torch.float32)
    if tuple(w.shape) != (num_layers, num_features):
        raise ValueError(f"{name} weights shape={tuple(w.shape)}, expected (num_layers, {num_features}) = "
                         f"{(num_layers, num_features)}")
    return w


class ExpertPredictor(ABC):
    """Scores the experts a layer will use, from what is known before it routes (module docstring).

    Args:
        num_layers: L. num_experts: E. top_k: K (the default budget is K + 1).
        moe_layers: `[L]` bool, True where the layer has routed experts (default: all).
    """

    name = "base"
    # True: `hidden` is `[T, 2D]`, this token's state entering the previous MoE layer's FFN, then the previous
    # token's entering `layer`'s FFN (zeros: unknown); `actors.prefetch.pre_attention_prev.prev_token_input`.
    needs_prev_token_hidden = False

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

    def scores_lists(self, layer: int, prev_layer: list[list[int]] | None, prev_tok: list[list[int]],
                     hidden_TD: torch.Tensor | None, num_tokens: int) -> list[list[float]]:
        """`scores` for a small batch given as Python lists: per token its E scores.

        `prev_layer` / `prev_tok`: per token the expert ids (any length; empty or -1 entries: unknown). The
        default converts to `[T, K]` tensors and calls `scores`; predictors with per-token state in Python
        (`MarkovPredictor`, `HybridPredictor`) answer without tensor ops, for small decode batches
        (bench/experts.py, decode table, measures both paths).
        """
        return self.scores(layer, _ids_tensor(prev_layer), _ids_tensor(prev_tok), hidden_TD, num_tokens).tolist()

    def observe_lists(self, layer: int, ids: list[list[int]], prev_layer: list[list[int]] | None,
                      prev_tok: list[list[int]]) -> None:
        """`observe` for a small batch given as Python lists (same conventions as `scores_lists`)."""
        self.observe(layer, _ids_tensor(ids), _ids_tensor(prev_layer), _ids_tensor(prev_tok))

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
