"""Expert-prefetch predictors by name: which experts will the next MoE layer use for these tokens?

Shape legend: T = tokens, K = experts per token (top-k), B = prediction budget per token (k + 1 by default),
E = routed experts, L = layers, D = hidden. Expert ids are int64 global ids; -1 = unknown / none.

The interface is `actors.prefetch.base.ExpertPredictor`. Predictors (all evaluated prequentially by
`router_service.routing.prequential.prequential_eval`: each prediction is made before the token is
routed at that layer, and the predictor learns from the truth right after; the fits, `fit_loglinear` and
`fit_lookahead_gates`, are in `router_service.routing.fitting`):
  none      - predicts nothing (baseline: every non-resident expert is a miss).
  frequent  - the layer's most used experts so far (calibration counts + online counts).
  markov    - first-order Markov chains over expert sets: P(b at l | set at the previous MoE layer, same token)
              and P(b at l | set at l, previous token), combined log-linearly (summed PMI terms, naive-Bayes
              style) with per-layer weights fitted on calibration text (`fit_loglinear`); counts seeded from
              a calibration run on training text (a prior worth at most 256 tokens) and updated online (ProMoE
              arXiv 2410.22134 and "Exploiting inter-layer expert affinity" arXiv 2401.08383 report these
              chains are strongly non-uniform; the layer-to-layer chain is the one ExFlow uses).
  lookahead - the next layer's gate applied to the current hidden state (mixtral-offloading, Eliseev &
              Mazur 2023, arXiv 2312.17238: hidden states change little between adjacent layers); where the
              calibration file carries fitted lookahead gates (`fit_lookahead_gates`: a least-squares pre-gate,
              after Pre-gated MoE, Hwang et al. 2024, arXiv 2308.12066), those replace the next layer's gate.
  hybrid    - markov and lookahead in one log-linear model (a product of experts), weights fitted per layer.
  pre_attention - a two-layer MLP per MoE layer (linear -> GELU -> linear, width 256) on the residual entering
              the previous MoE layer's FFN, i.e. before this layer's attention and before the previous layer's
              FFN (the prefetch's lead time), trained in the calibration run with a multi-label cross-entropy on
              the true top-k and shipped in the calibration file (`fit_pre_attention`; after the pre-attention
              predictor of arXiv 2511.10676; `actors.prefetch.pre_attention` says why this hidden state).
              Its output layer learns online from the served routing (`PRE_ATTENTION_ONLINE_LR`).
  pre_attention_hybrid - markov and pre_attention in the hybrid's log-linear model (`fit_loglinear`).
  pre_attention_prev - pre_attention with a second state as input, the previous token's residual entering the
              predicted layer's FFN (`actors.prefetch.pre_attention_prev`; rows without it: the one-state MLP).
  pre_attention_prev_hybrid - markov and pre_attention_prev in the hybrid's log-linear model.
"""
from __future__ import annotations

from actors.prefetch.base import ExpertPredictor, NoPredictor
from actors.prefetch.lookahead import HybridPredictor, LookaheadPredictor, PreAttentionHybridPredictor
from actors.prefetch.markov import FrequencyPredictor, MarkovPredictor
from actors.prefetch.pre_attention import PRE_ATTENTION_ONLINE_LR, PreAttentionPredictor
from actors.prefetch.pre_attention_prev import PreAttentionPrevHybridPredictor, PreAttentionPrevPredictor
from actors.prefetch.transitions import TransitionCounts

PREDICTORS = ("none", "frequent", "markov", "lookahead", "hybrid", "pre_attention", "pre_attention_hybrid",
              "pre_attention_prev", "pre_attention_prev_hybrid")
# Chosen by measurement (bench/experts.py, prequential recall on held-out prose and code of the tiny-moe model).
# The pre_attention predictors recall more (full bench on the shipped 4k model: pre_attention_prev 0.972 / 0.951,
# pre_attention_hybrid 0.947 / 0.924, against hybrid's 0.888 / 0.855; BENCHMARKS.md) but none is the default yet:
# they need a calibration file with the MLPs (a model without one would fail to start with the default), and their
# decode step runs in Python, not in the hybrid's one compiled call (`kernels.cpu`), so their batch-1 cost is
# unmeasured against the recall they buy. Serve them with prefetch="pre_attention_prev" (or "..._hybrid").
DEFAULT_PREDICTOR = "hybrid"


def make_predictor(name: str, *, num_layers: int, num_experts: int, top_k: int, moe_layers: list[bool] | None = None,
                   counts: TransitionCounts | None = None, gate_weights: list | None = None,
                   norm_weights: list | None = None, norm_eps: float = 1e-6,
                   online_lr: float = PRE_ATTENTION_ONLINE_LR) -> ExpertPredictor:
    """Build a predictor by name (one of PREDICTORS). Where `counts` carries fitted lookahead gates
    (`fit_lookahead_gates`), lookahead and hybrid use them in place of the routers' `gate_weights`; the
    pre_attention predictors need `counts` with trained MLPs (`counts.pre_attention`, `fit_pre_attention`; the
    _prev ones also `counts.pre_attention_prev`). `online_lr`: their MLPs' online learning rate (0: frozen).

    Raises:
        ValueError: unknown `name`, lookahead / hybrid without `gate_weights`, fitted gates whose shape does
            not match the routers', or a pre_attention predictor without its trained MLPs in `counts`.
    """
    kw = {"num_layers": num_layers, "num_experts": num_experts, "top_k": top_k, "moe_layers": moe_layers}
    if name == "none":
        return NoPredictor(**kw)
    if name == "frequent":
        return FrequencyPredictor(**kw, counts=counts)
    if name == "markov":
        return MarkovPredictor(**kw, counts=counts)
    if name.startswith("pre_attention") and name in PREDICTORS:
        if counts is None or not counts.pre_attention or ("_prev" in name and not counts.pre_attention_prev):
            raise ValueError(f"prefetch={name!r} needs a calibration file with pre-attention MLPs (rerun the "
                             f"calibration: moeray.cli_quantize.run_calibration)")
        for l, m in counts.pre_attention.items():
            if gate_weights is not None and l < len(gate_weights) and gate_weights[l] is not None \
                    and m.dims[0] != gate_weights[l].shape[1]:
                raise ValueError(f"pre_attention[{l}] reads hidden size {m.dims[0]}, the model's is "
                                 f"{gate_weights[l].shape[1]} (a transitions file from another model?)")
        if "_prev" in name:
            pa = PreAttentionPrevPredictor(**kw, mlps=counts.pre_attention, prev_mlps=counts.pre_attention_prev,
                                           online_lr=online_lr)
            hyb = PreAttentionPrevHybridPredictor
        else:
            pa, hyb = PreAttentionPredictor(**kw, mlps=counts.pre_attention, online_lr=online_lr), PreAttentionHybridPredictor
        return pa if not name.endswith("_hybrid") else hyb(MarkovPredictor(**kw, counts=counts), pa, counts=counts)
    if name in ("lookahead", "hybrid"):
        if gate_weights is None:
            raise ValueError(f"prefetch={name!r} needs the routers' gate_weights")
        if counts is not None and counts.lookahead_gates:
            for l, g in counts.lookahead_gates.items():
                if l >= len(gate_weights) or gate_weights[l] is None or tuple(g.shape) != tuple(gate_weights[l].shape):
                    raise ValueError(f"lookahead_gates[{l}].shape={tuple(g.shape)} does not match the model's router "
                                     f"at layer {l} (a transitions file from another model?)")
            gate_weights = [counts.lookahead_gates.get(l, g) if g is not None else None for l, g in enumerate(gate_weights)]
        look = LookaheadPredictor(**kw, gate_weights=gate_weights, norm_weights=norm_weights, norm_eps=norm_eps)
        return look if name == "lookahead" else HybridPredictor(MarkovPredictor(**kw, counts=counts), look,
                                                                counts=counts)
    raise ValueError(f"prefetch={name!r} is not a known predictor (expected one of {PREDICTORS})")


def keep_previous_first(pred: list[int], prev: list[int], budget: int) -> list[int]:
    """One token's prediction under the `sticky` gating policy: its predecessor's experts at this layer first,
    then the predictor's own ranking `pred` (best first) up to `budget` ids in all.

    Why: `sticky` keeps a previous expert whenever it scores within `sticky_margin` of a new one (thrash 0.37
    against exact routing's 0.77 on the shipped model), while the predictors learned their weights on exact
    routing and rank the previous experts lower. Measured by `bench/gating.py` (prequential recall, budget
    k+1): hybrid on sticky routing 0.69 alone, 0.96 with the previous experts first (exact routing: 0.90).
    Unknown entries (< 0) in `prev` are skipped; duplicates are not repeated."""
    out = [e for e in dict.fromkeys(prev) if e >= 0][:budget]
    seen = set(out)
    for e in pred:
        if len(out) >= budget:
            break
        if e >= 0 and e not in seen:
            out.append(e)
            seen.add(e)
    return out
