"""The pre-attention predictor with the previous token's state: an MLP per MoE layer l on two hidden states side by
side, this token's residual entering the previous MoE layer's FFN (what `pre_attention` reads) and the previous
token's residual entering layer l's FFN.

Why the second state: layer l's router reads the residual after l's attention, and that attention mixes in the
earlier tokens' layer-l states; the nearest one, the previous token's, has been computed a whole step before this
token reaches layer l (in decode: the previous step), so it costs no lead time. Measured on the shipped 4k tiny-moe
(offline, MLP alone, top-3 recall of 8 x 512 held-out tokens per domain, prose / code; BENCHMARKS.md, issue 21
part 3): this token's state alone 0.942 / 0.908, with the previous token's layer-l state 0.971 / 0.933 (layer 1
0.97 -> 0.98, layer 2 0.91 -> 0.975; layer 3 on table-like code stays at 0.85). Also measured and not kept:
layer l's own input before its attention (the choice of arXiv 2511.10676, a third of the lead time) 0.947 / 0.911.

Where the previous token's state is unknown (a sequence's first token; in a prefill, a predecessor in the same
step, whose layer-l state is computed at the same time), the caller passes zeros there and the row is scored by
the one-state MLP (`actors.prefetch.pre_attention`), which ships beside it.

Input of `scores` / `log_probs` (`prev_token_input`): `[T, 2D]`, this token's state at the previous MoE layer,
then the previous token's at the predicted layer (zeros: unknown); a `[T, D]` input scores every row with the
one-state MLP. Callers build it where `needs_prev_token_hidden` is True (`prequential_eval`, `fit_loglinear`, and
the serving runtime, `actors.experts.prediction.PredictionBookkeeping._predictor_hidden`, which keeps each
sequence's last layer-l state from the previous step: decode tokens get it, prefill tokens zeros).

Shape legend: T = tokens, E = routed experts, L = layers, D = hidden.
"""
from __future__ import annotations

import torch

from actors.prefetch.lookahead import PreAttentionHybridPredictor
from actors.prefetch.pre_attention import PRE_ATTENTION_ONLINE_LR, PreAttentionMLP, PreAttentionPredictor


def prev_token_input(h_pl_TD: torch.Tensor, h_prev_TD: torch.Tensor | None) -> torch.Tensor:
    """`[T, 2D]` float32 input of the two-state MLP: `h_pl_TD` `[T, D]` (this token, entering the previous MoE
    layer's FFN) and `h_prev_TD` `[T, D]` (the previous token, entering the predicted layer's FFN; None or zero
    rows: unknown)."""
    h = h_pl_TD.float()
    return torch.cat([h, torch.zeros_like(h) if h_prev_TD is None else h_prev_TD.float()], -1)


def shift_prev_token(h_TD: torch.Tensor) -> torch.Tensor:
    """`[T, D]`: row t holds row t - 1 of `h_TD` (one sequence's states), row 0 zeros (no previous token)."""
    return torch.cat([torch.zeros_like(h_TD[:1]), h_TD[:-1]])


class PreAttentionPrevPredictor(PreAttentionPredictor):
    """Scores layer l's experts by its two-state MLP (`prev_mlps[l]`, `PreAttentionMLP.parts` = 2) on rows whose
    previous-token state is known, and by the one-state MLP (`mlps[l]`) on the others (module docstring). Learns
    online like `PreAttentionPredictor` (each MLP on the rows it scored).

    Args:
        mlps: MoE layer -> one-state PreAttentionMLP (`TransitionCounts.pre_attention`).
        prev_mlps: MoE layer -> two-state PreAttentionMLP (`TransitionCounts.pre_attention_prev`).
        online_lr: as for `PreAttentionPredictor`.
    Raises:
        ValueError: as `PreAttentionPredictor`; a two-state MLP with parts != 2, an E not num_experts, a layer
            outside [0, L), or a layer with a two-state MLP but no one-state MLP.
    """

    name = "pre_attention_prev"
    needs_prev_token_hidden = True

    def __init__(self, num_layers, num_experts, top_k, moe_layers=None, *, mlps: dict[int, PreAttentionMLP],
                 prev_mlps: dict[int, PreAttentionMLP], online_lr: float = PRE_ATTENTION_ONLINE_LR):
        super().__init__(num_layers, num_experts, top_k, moe_layers, mlps=mlps, online_lr=online_lr)
        for l, m in prev_mlps.items():
            if not 0 <= l < num_layers or m.dims[2] != num_experts or m.parts != 2 or l not in mlps:
                raise ValueError(f"pre_attention_prev[{l}]: parts={m.parts}, E={m.dims[2]}; expected a layer in "
                                 f"[0, {num_layers}) with a one-state MLP, parts=2 and num_experts={num_experts}")
        self.prev_mlps = self._own(prev_mlps)

    def _groups(self, layer: int, hidden_TD: torch.Tensor) -> list[tuple]:
        one, two = self.mlps[layer], self.prev_mlps.get(layer)
        D = one.dims[0]
        if two is None or hidden_TD.shape[1] != 2 * D:
            return [(one, None, hidden_TD[:, :D])]
        known = hidden_TD[:, D:].abs().sum(-1) > 0  # [T]: rows with a previous-token state
        if bool(known.all()):
            return [(two, None, hidden_TD)]
        rows2, rows1 = known.nonzero().squeeze(1), (~known).nonzero().squeeze(1)
        out = [(one, rows1, hidden_TD[rows1, :D])]
        return out + ([(two, rows2, hidden_TD[rows2])] if rows2.numel() else [])


class PreAttentionPrevHybridPredictor(PreAttentionHybridPredictor):
    """`PreAttentionHybridPredictor` with `PreAttentionPrevPredictor` as its hidden-state source: score(b) = log P(b)
    + w_inter * g_inter(b) + w_intra * g_intra(b) + w_pa * log p_mlp(b), weights
    `counts.weights["pre_attention_prev_hybrid"]` (`fit_loglinear`); its input as `PreAttentionPrevPredictor`'s."""

    name = "pre_attention_prev_hybrid"
    needs_prev_token_hidden = True
