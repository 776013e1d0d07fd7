"""The pre-attention predictor's online step: the exact SGD update, when it learns and when not, the calibrated
tensors untouched, and that it adapts to served routing the calibration never saw."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from actors.prefetch.pre_attention import PRE_ATTENTION_ONLINE_ROWS, PreAttentionMLP, PreAttentionPredictor
from actors.prefetch.predictors import make_predictor
from router_service.routing.fitting import RoutingTrace, fit_pre_attention
from router_service.routing.prequential import prequential_eval
from tests.actors.prefetch.test_pre_attention import _counts, _synthetic

L, E, K, D = 2, 8, 2, 16


def _mlp(seed: int = 0, hidden: int = 6) -> PreAttentionMLP:
    g = torch.Generator().manual_seed(seed)
    return PreAttentionMLP(w1=torch.randn(hidden, D, generator=g), b1=torch.randn(hidden, generator=g),
                           w2=torch.randn(E, hidden, generator=g), b2=torch.randn(E, generator=g))


def _reference_step(m: PreAttentionMLP, h_TD: torch.Tensor, ids_TK: torch.Tensor, lr: float):
    """One SGD step on (w2, b2) by autograd: per token the mean binary cross-entropy over E, summed over the
    tokens, times min(T, ROWS) / T (the predictor's contract)."""
    w2, b2 = m.w2.clone().requires_grad_(True), m.b2.clone().requires_grad_(True)
    x = h_TD * torch.rsqrt(h_TD.pow(2).mean(-1, keepdim=True) + m.eps)
    z = F.linear(F.gelu(F.linear(x, m.w1, m.b1)), w2, b2)
    y = torch.zeros(h_TD.shape[0], E).scatter_(1, ids_TK, 1.0)
    T = h_TD.shape[0]
    loss = F.binary_cross_entropy_with_logits(z, y, reduction="sum") / E * min(T, PRE_ATTENTION_ONLINE_ROWS) / T
    loss.backward()
    return (w2 - lr * w2.grad).detach(), (b2 - lr * b2.grad).detach()


@pytest.mark.parametrize("T", [1, 3, 2 * PRE_ATTENTION_ONLINE_ROWS])
def test_online_step_is_sgd_on_the_output_layer(T):
    m, lr = _mlp(), 0.05
    h = torch.randn(T, D, generator=torch.Generator().manual_seed(T))
    ids = torch.stack([torch.randperm(E, generator=torch.Generator().manual_seed(t))[:K] for t in range(T)])
    p = PreAttentionPredictor(L, E, K, mlps={1: m}, online_lr=lr)
    p.scores(1, None, None, h, T)
    assert p.learns(1)
    p.observe(1, ids, None, None)
    w2, b2 = _reference_step(m, h, ids, lr)
    assert torch.allclose(p.mlps[1].w2, w2, atol=1e-6) and torch.allclose(p.mlps[1].b2, b2, atol=1e-6)
    assert torch.equal(p.mlps[1].w1, m.w1) and torch.equal(p.mlps[1].b1, m.b1)  # the hidden layer stays
    assert not torch.allclose(p.mlps[1].w2, m.w2)  # it moved, on its own copy:
    assert torch.equal(m.w2, _mlp().w2) and torch.equal(m.b2, _mlp().b2)  # the calibrated tensors are unchanged


def test_learns_only_on_the_rows_it_scored_once():
    m = _mlp()
    h, ids = torch.randn(4, D), torch.tensor([[0, 1], [2, 3], [4, -1], [5, 6]])
    p = PreAttentionPredictor(L, E, K, mlps={1: m}, online_lr=0.1)
    before = p.mlps[1].w2.clone()
    p.observe(1, ids, None, None)  # nothing scored for layer 1 yet
    assert torch.equal(p.mlps[1].w2, before) and not p.learns(1)
    p.scores(1, None, None, h, 4)
    p.observe(1, ids[:3], None, None)  # another row count: no step, the rows are dropped
    assert torch.equal(p.mlps[1].w2, before) and not p.learns(1)
    p.scores(1, None, None, h, 4)
    p.observe(1, ids, None, None)
    moved = p.mlps[1].w2.clone()
    assert not torch.equal(moved, before)
    p.observe(1, ids, None, None)  # the same rows are not learned twice
    assert torch.equal(p.mlps[1].w2, moved)
    # -1 entries are not targets: token 2 with ids [4, -1] is the same step as with [4] alone (expert 4 only)
    q1 = PreAttentionPredictor(L, E, K, mlps={1: m}, online_lr=0.1)
    q1.scores(1, None, None, h[2:3], 1)
    q1.observe(1, torch.tensor([[4, -1]]), None, None)
    w2, _ = _reference_step(m, h[2:3], torch.tensor([[4]]), 0.1)
    assert torch.allclose(q1.mlps[1].w2, w2, atol=1e-6)


def test_frozen_with_lr_zero_and_errors():
    m = _mlp()
    p = PreAttentionPredictor(L, E, K, mlps={1: m}, online_lr=0.0)
    h = torch.randn(5, D)
    p.scores(1, None, None, h, 5)
    p.observe(1, torch.randint(0, E, (5, K)), None, None)
    assert p.mlps[1] is m and not p.learns(1)
    with pytest.raises(ValueError, match="online_lr=-0.1"):
        PreAttentionPredictor(L, E, K, mlps={1: m}, online_lr=-0.1)


def _permuted(traces: list[RoutingTrace], perm: torch.Tensor) -> list[RoutingTrace]:
    """The same hidden states, layer 1's experts renamed by `perm` (served routing the calibration never saw)."""
    out = []
    for tr in traces:
        ids = tr.ids.clone()
        ids[:, 1] = perm[ids[:, 1]]
        out.append(RoutingTrace(ids=ids, hidden=tr.hidden))
    return out


def test_adapts_to_a_routing_shift_where_the_frozen_mlp_cannot():
    train = _synthetic(0, 16, 256)
    mlps = fit_pre_attention(train, E, hidden=64, epochs=30)
    served = _permuted(_synthetic(1, 4, 256), torch.tensor([1, 0, 3, 2, 5, 4, 7, 6]))
    kw = dict(num_layers=L, num_experts=E, top_k=K)
    preds = {lr: PreAttentionPredictor(**kw, mlps=mlps, online_lr=lr) for lr in (0.0, 0.05)}
    res = {lr: st.summary()[1]["recall"] for lr, st in prequential_eval(preds, served).items()}
    print(f"recall at k+1 on permuted routing: frozen {res[0.0]:.3f}, online {res[0.05]:.3f}")
    assert res[0.05] > res[0.0] + 0.2
    # the hybrid's MLP learns too (its observe reaches the MLP), and the counts' MLPs stay as calibrated
    counts = _counts(train, mlps)
    w2 = counts.pre_attention[1].w2.clone()
    hyb = make_predictor("pre_attention_hybrid", **kw, counts=counts)
    prequential_eval({"h": hyb}, served[:1])
    assert not torch.allclose(hyb.lookahead.mlps[1].w2, w2) and torch.equal(counts.pre_attention[1].w2, w2)

