"""The pre-attention expert predictor: fit and prediction shapes, learning a learnable routing, save / load."""
from __future__ import annotations

import pytest
import torch

from actors.moe.stats import multi_hot
from actors.prefetch.pre_attention import PreAttentionMLP, PreAttentionPredictor, fit_pre_attention_mlp
from actors.prefetch.predictors import make_predictor
from actors.prefetch.transitions import TransitionCounts
from router_service.routing.fitting import RoutingTrace, fit_loglinear, fit_pre_attention
from router_service.routing.prequential import prequential_eval

L, E, K, D = 2, 8, 2, 16


def _synthetic(seed: int, n_seq: int, T: int) -> list[RoutingTrace]:
    """Two MoE layers; layer 1's experts are the top-k of a fixed non-linear map of the hidden state entering
    layer 0's FFN (learnable from it), layer 0's the top-k of a linear one. Which experts a token uses varies
    with its hidden state, so the frequency ranking knows only the skew of the map."""
    g = torch.Generator().manual_seed(1234)  # the "model": the same for every call
    a0, b1, a1 = (torch.randn(s, generator=g) for s in ((E, D), (32, D), (E, 32)))
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_seq):
        h = torch.randn(T, L, D, generator=g)
        ids = torch.stack([(h[:, 0] @ a0.T).topk(K, -1).indices,
                           (torch.relu(h[:, 0] @ b1.T) @ a1.T).topk(K, -1).indices], 1)  # [T, L, K]
        out.append(RoutingTrace(ids=ids, hidden=h))
    return out


def _counts(traces, mlps=None) -> TransitionCounts:
    c = TransitionCounts.zeros(L, E)
    for tr in traces:
        c.observe(0, tr.ids[:, 0], None, None)
        c.observe(1, tr.ids[:, 1], tr.ids[:, 0], None)
    c.pre_attention = mlps
    return c


def test_fit_and_prediction_shapes():
    x, ids = torch.randn(50, D), torch.randint(0, E, (50, K))
    m = fit_pre_attention_mlp(x, multi_hot(ids, E), hidden=12, epochs=2)
    assert m.dims == (D, 12, E) and m.w1.dtype == torch.float32
    assert m.logits(torch.randn(7, D)).shape == (7, E)
    p = PreAttentionPredictor(L, E, K, mlps={1: m})
    assert p.predict(1, None, None, torch.randn(5, D), 5).shape == (5, K + 1)
    assert p.predict(1, None, None, torch.randn(5, D), 5, budget=1).shape == (5, 1)
    assert torch.allclose(p.scores(0, None, None, torch.randn(3, D), 3), torch.full((3, E), 1 / E))  # no MLP
    assert torch.allclose(p.scores(1, None, None, None, 3), torch.full((3, E), 1 / E))  # no hidden
    with pytest.raises(ValueError, match="b1.shape"):
        PreAttentionMLP(w1=m.w1, b1=torch.zeros(3), w2=m.w2, b2=m.b2)
    with pytest.raises(ValueError, match="same number"):
        fit_pre_attention_mlp(torch.randn(0, D), torch.zeros(0, E))
    with pytest.raises(ValueError, match="num_experts=4"):
        PreAttentionPredictor(L, 4, K, mlps={1: m})


def test_learns_a_learnable_routing_and_beats_frequent():
    train, held = _synthetic(0, 16, 256), _synthetic(1, 2, 200)
    mlps = fit_pre_attention(train, E, hidden=64, epochs=30)
    assert set(mlps) == {1}  # only layers with a previous MoE layer
    counts = _counts(train, mlps)
    kw = dict(num_layers=L, num_experts=E, top_k=K, counts=counts)
    preds = {n: make_predictor(n, **kw) for n in ("frequent", "pre_attention")}
    res = {n: st.summary()[1]["recall"] for n, st in prequential_eval(preds, held).items()}
    r_freq, r_pa = res["frequent"], res["pre_attention"]
    print(f"recall at k+1: frequent {r_freq:.3f}, pre_attention {r_pa:.3f}")
    assert r_pa > 0.85 and r_pa > r_freq + 0.15


def test_save_load_round_trip_and_hybrid(tmp_path):
    train = _synthetic(0, 2, 128)
    counts = _counts(train, fit_pre_attention(train, E, hidden=16, epochs=2))
    pa = make_predictor("pre_attention", num_layers=L, num_experts=E, top_k=K, counts=counts)
    counts.weights = fit_loglinear(train, L, E, K, pre_attention=pa, steps=5)
    assert len(counts.weights["pre_attention_hybrid"][1]) == 3 and "hybrid" not in counts.weights
    path = str(tmp_path / "t.safetensors")
    counts.save(path)
    back = TransitionCounts.load(path)
    assert set(back.pre_attention) == {1}
    for k, t in counts.pre_attention[1].tensors().items():
        assert torch.equal(back.pre_attention[1].tensors()[k], t)
    h = torch.randn(4, D)
    kw = dict(num_layers=L, num_experts=E, top_k=K)
    for name in ("pre_attention", "pre_attention_hybrid"):
        a, b = make_predictor(name, **kw, counts=counts), make_predictor(name, **kw, counts=back)
        prev = train[0].ids[:4, 0]
        assert torch.equal(a.predict(1, prev, None, h, 4), b.predict(1, prev, None, h, 4))
        assert torch.allclose(a.scores(1, prev, None, h, 4), b.scores(1, prev, None, h, 4))
    assert back.weights == counts.weights
    with pytest.raises(ValueError, match="pre-attention MLPs"):
        make_predictor("pre_attention", **kw, counts=_counts(train))
    with pytest.raises(ValueError, match="hidden size"):
        make_predictor("pre_attention", **kw, counts=counts, gate_weights=[torch.zeros(E, 2 * D)] * L)
