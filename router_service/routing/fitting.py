"""Fitting the expert predictors on calibration traces: the lookahead pre-gates and the log-linear weights.

Offline work (a calibration run, `router_service.routing.calibration.calibrate`): a trace is recorded by
running the model (`RoutingTrace`), then fitted here, and the results are saved with the transition counts
(`TransitionCounts.lookahead_gates`, `TransitionCounts.weights`).

Shape legend: T = tokens, L = layers, K = experts per token, E = routed experts, D = hidden, F = features.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from actors.moe.stats import multi_hot
from actors.prefetch.base import DEFAULT_WEIGHTS
from actors.prefetch.lookahead import LookaheadPredictor
from actors.prefetch.markov import MarkovPredictor
from actors.prefetch.pre_attention import PRE_ATTENTION_HIDDEN, PreAttentionMLP, PreAttentionPredictor, \
    fit_pre_attention_mlp
from actors.prefetch.pre_attention_prev import prev_token_input, shift_prev_token


@dataclass(kw_only=True, slots=True)
class RoutingTrace:
    """The routing of one sequence through every layer (recorded by running the model).

    ids: `[T, L, K]` int64 expert ids (-1 at dense layers). hidden: `[T, L, D]` float residual stream entering
    each layer's FFN, or None (then lookahead predictors see no hidden state).
    """

    ids: torch.Tensor
    hidden: torch.Tensor | None = None


LOOKAHEAD_RIDGE = 10.0  # ridge of `fit_lookahead_gates`; on tiny-moe held-out recall is flat over 1-100


def fit_lookahead_gates(traces: list[RoutingTrace], gate_weights: list, norm_weights: list | None = None,
                        norm_eps: float = 1e-6, *, ridge: float = LOOKAHEAD_RIDGE) -> dict[int, torch.Tensor]:
    """Fit, per MoE layer l after the first, a linear pre-gate G_l `[E, D]` that maps the hidden state the
    lookahead sees (the residual entering the previous MoE layer's FFN) to layer l's router log-probabilities:

        G_l = argmin_G sum_t || x_t G^T - log softmax(gate_l(n_l(h_t^l))) ||^2 + ridge * ||G||^2,
        x_t = n_l(h_t^(l_prev)),  n_l = RMSNorm with layer l's post-attention norm weight,

    solved in closed form (ridge regression). The raw lookahead uses G_l = gate_l, which ignores what layer
    l_prev's FFN and layer l's attention add to the residual; the fit learns that map on calibration text (the
    pre-gate of Pre-gated MoE, Hwang et al. 2024, arXiv 2308.12066, fitted here without training the model).
    Measured on tiny-moe (bench/experts.py): see BENCHMARKS.md, issue 4.

    Args:
        traces: calibration sequences with hidden states (`RoutingTrace.hidden` `[T, L, D]`), training text only.
        gate_weights: per layer `[E, D]` router weights (None for dense layers). norm_weights: per layer `[D]`
            post-attention RMSNorm weights (None: none). ridge: L2 penalty (>= 0).
    Returns:
        {layer: `[E, D]` float32} for every MoE layer with a previous MoE layer ({} without hidden states).
    Raises:
        ValueError: ridge < 0.
    """
    if ridge < 0:
        raise ValueError(f"ridge={ridge} must be >= 0")
    L = len(gate_weights)
    norms = list(norm_weights or [None] * L)

    def rms(h: torch.Tensor, l: int) -> torch.Tensor:
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm_eps)
        return h * norms[l].float() if norms[l] is not None else h

    moe = [l for l in range(L) if gate_weights[l] is not None]
    xtx: dict[int, torch.Tensor] = {}
    xty: dict[int, torch.Tensor] = {}
    for tr in traces:
        if tr.hidden is None:
            continue
        for pl, l in zip(moe, moe[1:]):
            x = rms(tr.hidden[:, pl].double(), l)
            y = torch.log_softmax(rms(tr.hidden[:, l].double(), l) @ gate_weights[l].double().T, dim=-1)
            xtx[l] = xtx.get(l, 0) + x.T @ x
            xty[l] = xty.get(l, 0) + x.T @ y
    out = {}
    for l, a in xtx.items():
        eye = torch.eye(a.shape[0], dtype=a.dtype)
        out[l] = torch.linalg.solve(a + ridge * eye, xty[l]).T.float().contiguous()
    return out


def fit_pre_attention(traces: list[RoutingTrace], num_experts: int, *, hidden: int = PRE_ATTENTION_HIDDEN, epochs: int = 10,
                      seed: int = 0, prev_token: bool = False) -> dict[int, PreAttentionMLP]:
    """Train, per MoE layer l after the first, the pre-attention MLP (`actors.prefetch.pre_attention`): input the
    residual entering the previous MoE layer's FFN (`RoutingTrace.hidden[:, l_prev]`), target layer l's true
    top-k as a multi-hot vector, binary cross-entropy (`fit_pre_attention_mlp`). Training text only.
    `prev_token`: the two-state MLP of `actors.prefetch.pre_attention_prev` instead (parts = 2): input that state
    and the previous token's residual entering layer l's FFN (`hidden[t - 1, l]`), on every token but a trace's
    first (the predictor scores rows without a previous state with the one-state MLP).

    Returns:
        {layer: PreAttentionMLP} ({} when no trace has hidden states).
    """
    xs: dict[int, list] = {}
    ys: dict[int, list] = {}
    for tr in traces:
        if tr.hidden is None:
            continue
        L = tr.ids.shape[1]
        moe = [l for l in range(L) if bool((tr.ids[:, l] >= 0).any())]
        for pl, l in zip(moe, moe[1:]):
            if prev_token:
                if tr.hidden.shape[0] > 1:
                    xs.setdefault(l, []).append(prev_token_input(tr.hidden[1:, pl], tr.hidden[:-1, l]))
                    ys.setdefault(l, []).append(tr.ids[1:, l])
                continue
            xs.setdefault(l, []).append(tr.hidden[:, pl])
            ys.setdefault(l, []).append(tr.ids[:, l])
    return {l: fit_pre_attention_mlp(torch.cat(xs[l]), multi_hot(torch.cat(ys[l]), num_experts), hidden=hidden,
                                     epochs=epochs, seed=seed + l, parts=2 if prev_token else 1) for l in xs}


def source_input(source, tr: RoutingTrace, pl: int, l: int) -> torch.Tensor:
    """The hidden-state input a predictor `source` reads for layer l from a trace: `[T, D]` (the residual entering
    the previous MoE layer pl's FFN), or `[T, 2D]` where `source.needs_prev_token_hidden` (with each token's
    predecessor's residual entering l's FFN, `prev_token_input`)."""
    if getattr(source, "needs_prev_token_hidden", False):
        return prev_token_input(tr.hidden[:, pl], shift_prev_token(tr.hidden[:, l]))
    return tr.hidden[:, pl]


def fit_loglinear(traces: list[RoutingTrace], num_layers: int, num_experts: int, top_k: int, *,
                  lookahead: LookaheadPredictor | None = None, pre_attention: PreAttentionPredictor | None = None,
                  pre_attention_prev: PreAttentionPredictor | None = None, alpha: float = 0.5,
                  steps: int = 200) -> dict:
    """Fit the per-layer log-linear weights of `MarkovPredictor` and the hybrids on calibration traces.

    Features are computed block-prequentially: each sequence is scored with the counts of the sequences before
    it only (starting from zero counts), so a token never informs its own prediction and the fit sees the
    counts as sparse as they are early in serving. Then per layer the weights minimise a pairwise ranking
    loss, mean softplus(score(unused) - score(used)) (full-batch Adam, `steps` steps, from the defaults).

    Args:
        traces: calibration sequences (training text, never the evaluation text); hidden states are needed for
            the hybrids' hidden-state term: "hybrid" with `lookahead`, "pre_attention_hybrid" with
            `pre_attention`, "pre_attention_prev_hybrid" with `pre_attention_prev` (without hidden states, or
            without any source, only "markov" is fitted).
    Returns:
        {"markov": `[L][2]` floats, "hybrid" / "pre_attention_hybrid": `[L][3]` floats (when fitted)}; dense
        layers keep the defaults.
    """
    m = MarkovPredictor(num_layers, num_experts, top_k, alpha=alpha, prior_tokens=None)
    sources = {n: p for n, p in (("hybrid", lookahead), ("pre_attention_hybrid", pre_attention),
                                 ("pre_attention_prev_hybrid", pre_attention_prev)) if p is not None}
    feats: dict[int, list] = {}  # layer -> [(logf [E], g [T, F, E], multi-hot truth [T, E])]
    fitted = set(sources) if all(tr.hidden is not None for tr in traces) else set()
    for tr in traces:
        moe = [l for l in range(num_layers) if bool((tr.ids[:, l] >= 0).any())]
        T = tr.ids.shape[0]
        for i, l in enumerate(moe[1:], 1):
            pl = moe[i - 1]
            prev_tok = torch.cat([torch.full_like(tr.ids[:1, l], -1), tr.ids[:-1, l]])
            logf, g = m.features(l, tr.ids[:, pl], prev_tok, T)
            cols = [g[0], g[1]]
            for n, src in sources.items():  # one column per hidden-state source (zeros where it has none)
                has = tr.hidden is not None and src.gate[l] is not None
                cols.append(src.log_probs(l, source_input(src, tr, pl, l)) if has else torch.zeros_like(g[0]))
                if not has:
                    fitted.discard(n)
            feats.setdefault(l, []).append((logf, torch.stack(cols, 1), multi_hot(tr.ids[:, l], num_experts).float()))
        for i, l in enumerate(moe):
            prev_tok = torch.cat([torch.full_like(tr.ids[:1, l], -1), tr.ids[:-1, l]])
            m.observe(l, tr.ids[:, l], tr.ids[:, moe[i - 1]] if i else None, prev_tok)
    out = {"markov": [list(DEFAULT_WEIGHTS["markov"]) for _ in range(num_layers)]}
    cols_of = {"markov": [0, 1]}
    for j, n in enumerate(sources):
        if n in fitted and feats:
            out[n] = [list(DEFAULT_WEIGHTS[n]) for _ in range(num_layers)]
            cols_of[n] = [0, 1, 2 + j]
    for l, rows in feats.items():
        logf = torch.cat([r[0].expand(r[1].shape[0], -1) for r in rows])  # [N, E]
        g = torch.cat([r[1] for r in rows])  # [N, F, E]
        y = torch.cat([r[2] for r in rows])  # [N, E]
        pairs = y.unsqueeze(2) * (1 - y).unsqueeze(1)  # [N, E, E]: (used, unused) pairs
        for name, cols in cols_of.items():
            w = torch.tensor(DEFAULT_WEIGHTS[name], requires_grad=True)
            opt = torch.optim.Adam([w], lr=0.05)
            gf = g[:, cols]
            for _ in range(steps):
                opt.zero_grad()
                s = logf + torch.einsum("f,nfe->ne", w, gf)
                # Pairwise ranking loss (used expert above unused one): prefetch keeps the top k + 1, so the
                # ranking matters, not calibrated probabilities (a likelihood fit damps the sharp lookahead).
                margin = s.unsqueeze(2) - s.unsqueeze(1)  # [N, E, E]: s(used) - s(other)
                loss = (F.softplus(-margin) * pairs).sum() / pairs.sum()
                loss.backward()
                opt.step()
            out[name][l] = [round(float(x), 4) for x in w.detach()]
    return out
