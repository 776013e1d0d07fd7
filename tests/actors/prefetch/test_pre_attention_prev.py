"""The two-state pre-attention predictor: its input, which MLP scores which row, that it learns a routing only the
previous token's state explains, save / load, and the hybrid's fit."""
from __future__ import annotations

import pytest
import torch

from actors.moe.stats import multi_hot
from actors.prefetch.pre_attention import PreAttentionMLP, fit_pre_attention_mlp
from actors.prefetch.pre_attention_prev import PreAttentionPrevPredictor, prev_token_input, shift_prev_token
from actors.prefetch.predictors import make_predictor
from actors.prefetch.transitions import TransitionCounts
from router_service.routing.fitting import RoutingTrace, fit_loglinear, fit_pre_attention
from router_service.routing.prequential import prequential_eval

L, E, K, D = 2, 8, 2, 16


def _prev_state_routing(seed: int, n_seq: int, T: int) -> list[RoutingTrace]:
    """Layer 1's experts are the top-k of a fixed map of the previous token's state entering layer 1's FFN
    (`hidden[t - 1, 1]`), independent of this token's state entering layer 0's FFN (`hidden[t, 0]`)."""
    a0, a1 = (torch.randn(E, D, generator=torch.Generator().manual_seed(s)) for s in (7, 8))
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_seq):
        h = torch.randn(T, L, D, generator=g)
        src = torch.cat([h[:1, 0], h[:-1, 1]])  # t = 0: no previous token, something else
        ids = torch.stack([(h[:, 0] @ a0.T).topk(K, -1).indices, (src @ a1.T).topk(K, -1).indices], 1)
        out.append(RoutingTrace(ids=ids, hidden=h))
    return out


def _counts(traces, prev: bool = True) -> TransitionCounts:
    c = TransitionCounts.zeros(L, E)
    for tr in traces:
        c.observe(0, tr.ids[:, 0], None, None)
        c.observe(1, tr.ids[:, 1], tr.ids[:, 0], None)
    c.pre_attention = fit_pre_attention(traces, E, hidden=32, epochs=3)
    c.pre_attention_prev = fit_pre_attention(traces, E, hidden=64, epochs=30, prev_token=True) if prev else None
    return c


def test_input_helpers():
    h = torch.arange(6.0).reshape(3, 2)
    assert torch.equal(shift_prev_token(h), torch.tensor([[0.0, 0.0], [0.0, 1.0], [2.0, 3.0]]))
    assert torch.equal(prev_token_input(h, None), torch.cat([h, torch.zeros(3, 2)], -1))
    assert torch.equal(prev_token_input(h, h + 1), torch.cat([h, h + 1], -1))
    with pytest.raises(ValueError, match="parts=3"):
        PreAttentionMLP(w1=torch.zeros(4, 16), b1=torch.zeros(4), w2=torch.zeros(E, 4), b2=torch.zeros(E), parts=3)
    # parts = 2 normalises each half apart: scaling one half leaves the logits as they were
    x, y = torch.randn(64, 2 * D), multi_hot(torch.randint(0, E, (64, K)), E)
    m = fit_pre_attention_mlp(x, y, hidden=8, epochs=1, parts=2)
    assert m.parts == 2 and m.dims == (2 * D, 8, E)
    assert torch.allclose(m.logits(torch.cat([x[:, :D] * 5, x[:, D:]], -1)), m.logits(x), atol=1e-5)


def test_learns_what_only_the_previous_token_state_explains():
    train, held = _prev_state_routing(0, 16, 256), _prev_state_routing(1, 2, 200)
    counts = _counts(train)
    assert set(counts.pre_attention_prev) == {1} and counts.pre_attention_prev[1].parts == 2
    kw = dict(num_layers=L, num_experts=E, top_k=K, counts=counts, online_lr=0.0)
    preds = {n: make_predictor(n, **kw) for n in ("pre_attention", "pre_attention_prev")}
    res = {n: st.summary()[1]["recall"] for n, st in prequential_eval(preds, held).items()}
    print(f"recall at k+1: one state {res['pre_attention']:.3f}, with the previous token's {res['pre_attention_prev']:.3f}")
    assert res["pre_attention_prev"] > 0.85 and res["pre_attention_prev"] > res["pre_attention"] + 0.2


def test_rows_without_a_previous_state_use_the_one_state_mlp():
    counts = _counts(_prev_state_routing(0, 2, 64))
    p = make_predictor("pre_attention_prev", num_layers=L, num_experts=E, top_k=K, counts=counts, online_lr=0.0)
    one, two = counts.pre_attention[1], counts.pre_attention_prev[1]
    h, hp = torch.randn(4, D), torch.randn(4, D)
    hp[[0, 2]] = 0  # rows 0 and 2: no previous token state
    lp = p.log_probs(1, prev_token_input(h, hp))
    assert torch.allclose(lp[[0, 2]], torch.log_softmax(one.logits(h[[0, 2]]), -1), atol=1e-6)
    assert torch.allclose(lp[[1, 3]], torch.log_softmax(two.logits(torch.cat([h, hp], -1)[[1, 3]]), -1), atol=1e-6)
    assert torch.allclose(p.log_probs(1, h), torch.log_softmax(one.logits(h), -1), atol=1e-6)  # [T, D]: one state
    # online: each MLP learns on the rows it scored (both move here), the counts' MLPs stay as calibrated
    q = make_predictor("pre_attention_prev", num_layers=L, num_experts=E, top_k=K, counts=counts, online_lr=0.1)
    q.scores(1, None, None, prev_token_input(h, hp), 4)
    q.observe(1, torch.randint(0, E, (4, K)), None, None)
    assert not torch.allclose(q.mlps[1].w2, one.w2) and not torch.allclose(q.prev_mlps[1].w2, two.w2)
    assert torch.equal(counts.pre_attention_prev[1].w2, two.w2)
    with pytest.raises(ValueError, match="parts=1"):
        PreAttentionPrevPredictor(L, E, K, mlps=counts.pre_attention, prev_mlps=counts.pre_attention)


def test_save_load_and_hybrid_fit(tmp_path):
    train = _prev_state_routing(0, 2, 128)
    counts = _counts(train)
    pa = make_predictor("pre_attention_prev", num_layers=L, num_experts=E, top_k=K, counts=counts, online_lr=0.0)
    counts.weights = fit_loglinear(train, L, E, K, pre_attention_prev=pa, steps=5)
    assert len(counts.weights["pre_attention_prev_hybrid"][1]) == 3
    path = str(tmp_path / "t.safetensors")
    counts.save(path)
    back = TransitionCounts.load(path)
    assert back.pre_attention_prev[1].parts == 2
    for k, t in counts.pre_attention_prev[1].tensors().items():
        assert torch.equal(back.pre_attention_prev[1].tensors()[k], t)
    kw = dict(num_layers=L, num_experts=E, top_k=K)
    a, b = (make_predictor("pre_attention_prev_hybrid", **kw, counts=c) for c in (counts, back))
    assert a.needs_prev_token_hidden and b.weights.tolist() == a.weights.tolist()
    x = prev_token_input(torch.randn(3, D), torch.randn(3, D))
    assert torch.allclose(a.scores(1, train[0].ids[:3, 0], None, x, 3), b.scores(1, train[0].ids[:3, 0], None, x, 3))
    with pytest.raises(ValueError, match="pre-attention MLPs"):
        make_predictor("pre_attention_prev", **kw, counts=_counts(train, prev=False))
