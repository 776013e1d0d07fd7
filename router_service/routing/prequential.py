"""Prequential evaluation of expert predictors on recorded traces (benchmarks, tests; not the serving path).

Prequential: every (token, layer) is predicted before it is observed, then the predictor learns from it, so
the score is what serving would see, with no held-out split needed.
"""
from __future__ import annotations

import torch

from actors.moe.stats import RoutingStats
from actors.prefetch.base import ExpertPredictor
from router_service.routing.fitting import RoutingTrace
from actors.prefetch.predictors import keep_previous_first
from actors.prefetch.pre_attention_prev import prev_token_input


def prequential_eval(predictors: dict[str, ExpertPredictor], traces: list[RoutingTrace], *,
                     budget: int | None = None, keep_previous: bool = False) -> dict[str, RoutingStats]:
    """Score each predictor token by token, predicting (t, l) before it is observed, then learning from it.

    Every MoE layer after the first is predicted (the first has no previous layer in the same token; its
    prefetch, if any, comes from the previous token alone). Predictors are updated online in place.

    Args:
        predictors: name -> predictor (all share L, E, K).
        traces: sequences, in the order they are served.
        budget: experts per token predicted (default K + 1).
        keep_previous: the traces were routed by `sticky`: predict as the engine does for it
            (`keep_previous_first`).
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
                # the previous token's state entering l's FFN, for predictors that read it (zeros at t = 0)
                hidden2 = None if hidden is None else prev_token_input(hidden, tr.hidden[t - 1 : t, l] if t else None)
                true = tr.ids[t : t + 1, l]
                for name, p in predictors.items():
                    if pl is not None:
                        h = hidden2 if p.needs_prev_token_hidden else hidden
                        pred = p.predict(l, prev_layer, prev_tok, h, 1, budget)
                        if keep_previous and prev_tok is not None:
                            pred = torch.tensor([keep_previous_first(pred[0].tolist(), prev_tok[0].tolist(),
                                                                     pred.shape[1])], dtype=torch.int64)
                        out[name].add_prediction(l, pred, true, p.num_experts)
                    p.observe(l, true, prev_layer, prev_tok)
    return out
