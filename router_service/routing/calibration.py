"""Calibration of the expert predictors: record a sequence's routing, count expert transitions, fit the
lookahead gates, train the pre-attention MLPs and fit the log-linear weights (`calibrate`, run by `moeray quantize` unless `--no-calibrate`).

Shape legend: T = tokens of a sequence, L = layers, K = experts per token, D = hidden, V = vocabulary.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from router_service.routing.fitting import RoutingTrace, fit_loglinear, fit_lookahead_gates, fit_pre_attention
from actors.prefetch.predictors import make_predictor
from actors.prefetch.pre_attention import PreAttentionPredictor
from actors.prefetch.pre_attention_prev import PreAttentionPrevPredictor
from actors.prefetch.transitions import TransitionCounts


class _RoutingRecorder:
    """The routing observer of `record_routing`: the model's own observer first, then a copy of ids and hidden."""

    def __init__(self, inner, ids_TLK: torch.Tensor, hid_TLD: torch.Tensor | None):
        self.inner, self.ids, self.hid = inner, ids_TLK, hid_TLD

    def begin_step(self, meta, num_tokens: int, gating) -> None:
        self.inner.begin_step(meta, num_tokens, gating)

    def on_route(self, l: int, t: torch.Tensor) -> None:
        self.inner.on_route(l, t)
        self.ids[:, l] = t.cpu()

    def on_hidden(self, l: int, h: torch.Tensor) -> None:
        self.inner.on_hidden(l, h)
        if self.hid is not None:
            self.hid[:, l] = h.float().cpu()


@torch.inference_mode()
def record_routing(engine, token_ids: list[int], *, with_hidden: bool = False) -> tuple[RoutingTrace, torch.Tensor]:
    """Run one sequence through `engine.prompt_logits` (world size 1) and record its routing.

    Returns:
        (RoutingTrace with ids `[T, L, K]` (-1 at dense layers) and hidden `[T, L, D]` float32 or None,
         logits `[T, V]` fp32).
    """
    model = engine.model
    mc = model.cfg
    T = len(token_ids)
    ids = torch.full((T, mc.num_layers, mc.top_k), -1, dtype=torch.int64)
    hid = torch.zeros(T, mc.num_layers, mc.hidden_size) if with_hidden else None
    logits = engine.prompt_logits(list(token_ids), observer=_RoutingRecorder(model.observer, ids, hid))
    return RoutingTrace(ids=ids, hidden=hid), logits


def transitions_from_traces(traces: list[RoutingTrace], num_layers: int, num_experts: int) -> TransitionCounts:
    """Markov counts of recorded sequences (layer-to-layer within a token, token-to-token within a layer)."""
    c = TransitionCounts.zeros(num_layers, num_experts)
    for tr in traces:
        moe = [l for l in range(num_layers) if bool((tr.ids[:, l] >= 0).any())]
        for i, l in enumerate(moe):
            cur = tr.ids[:, l]
            prev_tok = torch.cat([torch.full_like(cur[:1], -1), cur[:-1]])
            c.observe(l, cur, tr.ids[:, moe[i - 1]] if i else None, prev_tok)
    return c


def calibrate(engine, token_chunks: Iterable[list[int]], out_path: str | None = None,
              meta: dict | None = None, *, pre_attention_chunks: Iterable[list[int]] | None = None,
              pre_attention: bool = True) -> TransitionCounts:
    """Calibration run: route `token_chunks` through the model, count expert transitions, fit the lookahead
    gates (`fit_lookahead_gates`), train the pre-attention MLPs (`fit_pre_attention`, on `token_chunks` plus
    `pre_attention_chunks`: the MLPs gain from more text than the counts need, measured on tiny-moe: 16k
    calibration tokens 0.936 / 0.922 held-out prose / code recall, 118k 0.948 / 0.931), then the Markov / hybrid
    predictors' log-linear weights on `token_chunks` (`fit_loglinear`, block-prequential for the counts, with
    the fitted lookahead and MLPs as served); optionally save it all (`out_path`, usually
    `<model>/expert_transitions.safetensors`). All chunks: training-side text only. `pre_attention=False`
    skips the MLPs. The pre_attention_hybrid weights are fitted with MLPs trained on `pre_attention_chunks`
    alone (out of sample for `token_chunks`, as served text is), when there are any. The two-state MLPs
    (`fit_pre_attention(..., prev_token=True)`, `actors.prefetch.pre_attention_prev`) train on
    `pre_attention_chunks` alone (else on `token_chunks`) and fit the pre_attention_prev_hybrid weights as served."""
    mc = engine.model.cfg
    traces = [record_routing(engine, ch, with_hidden=True)[0] for ch in token_chunks if len(ch) > 1]
    counts = transitions_from_traces(traces, mc.num_layers, mc.num_experts)
    w = engine.model.w
    gates = [w.get(f"layers.{l}.gate_w") for l in range(mc.num_layers)]
    gates = [g.float() if g is not None and mc.moe_layers[l] else None for l, g in enumerate(gates)]
    norms = [w.get(f"layers.{l}.post_norm") for l in range(mc.num_layers)]
    counts.lookahead_gates = fit_lookahead_gates(traces, gates, norms, mc.rms_norm_eps) or None
    kw = dict(num_layers=mc.num_layers, num_experts=mc.num_experts, top_k=mc.top_k, moe_layers=mc.moe_layers,
              counts=counts, gate_weights=gates, norm_weights=norms, norm_eps=mc.rms_norm_eps)
    look = make_predictor("lookahead", **kw)  # with the fitted gates, as served
    pa = pa_prev = None
    if pre_attention:
        extra = [record_routing(engine, ch, with_hidden=True)[0] for ch in (pre_attention_chunks or []) if len(ch) > 1]
        counts.pre_attention = fit_pre_attention(traces + extra, mc.num_experts) or None
        # The two-state MLPs train on `extra` alone where there is one (`traces` are under 3% of it on the shipped
        # recipe), so the hybrid's fit on `traces` scores them out of sample at the cost of one training, not two.
        counts.pre_attention_prev = fit_pre_attention(extra or traces, mc.num_experts, prev_token=True) or None
        if counts.pre_attention:  # the hybrid's fit scores `traces`: with MLPs trained without them if there is text
            held = fit_pre_attention(extra, mc.num_experts) if extra else {}
            pa = make_predictor("pre_attention", **{**kw, "counts": counts.clone()})
            if held:
                pa = PreAttentionPredictor(mc.num_layers, mc.num_experts, mc.top_k, mc.moe_layers, mlps=held)
            if counts.pre_attention_prev:
                pa_prev = PreAttentionPrevPredictor(mc.num_layers, mc.num_experts, mc.top_k, mc.moe_layers,
                                                    mlps=pa.mlps, prev_mlps=counts.pre_attention_prev, online_lr=0.0)
        del extra
    counts.weights = fit_loglinear(traces, mc.num_layers, mc.num_experts, mc.top_k, lookahead=look, pre_attention=pa,
                                   pre_attention_prev=pa_prev)
    if out_path:
        counts.save(out_path, meta)
    return counts
