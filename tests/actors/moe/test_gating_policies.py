"""Gating policies: validity on any input, each policy's defining property, recurrences that do not depend
on how a sequence is split into steps, and per-request policies mixed in one engine step."""
from __future__ import annotations

import math

import pytest
import torch

from kernels.gating import topk_softmax_ref
from actors.moe.gating import POLICIES, GatingBatch, GatingConfig
from actors.moe.gating_router import GatingRouter

E, K, D = 8, 2, 16


def make_router(policy: str, slots: int = 4, shared: bool = True, **kw) -> GatingRouter:
    return GatingRouter(GatingConfig(policy=policy, **kw), num_layers=2, num_experts=E, top_k=K, renormalize=False,
                        hidden=D, num_slots=slots, has_shared_expert=shared)


def check_valid(r, T):
    ids, w = r.ids, r.weights
    assert ids.shape[0] == T and w.shape == ids.shape and ids.dtype == torch.int64
    assert bool(((ids >= -1) & (ids < E)).all())
    for row, wr in zip(ids.tolist(), w.tolist()):
        used = [e for e in row if e >= 0]
        assert len(used) >= 1 and len(set(used)) == len(used)
        assert all(x == 0 for e, x in zip(row, wr) if e < 0)
    assert bool(torch.isfinite(w).all())
    if r.shared_scale is not None:
        assert r.shared_scale.shape == (T,) and bool(torch.isfinite(r.shared_scale).all())


def nasty_logits(T: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, E, generator=g) * 2
    x[1] = float("nan")
    x[2, 3] = float("inf")
    x[3] = float("-inf")
    x[4, :5] = float("nan")
    return x


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_valid_on_nan_inf_and_zero_tokens(policy):
    r = make_router(policy)
    T = 12
    batch = GatingBatch(slots_T=torch.tensor([0] * 6 + [1] * 6), positions_T=torch.tensor(list(range(6)) * 2))
    x = torch.randn(T, D)
    x[1] = float("nan")  # a non-finite hidden state must not poison velocity either
    for layer in (0, 1):
        out = r.route(layer, nasty_logits(T, layer), x, batch)
        check_valid(out, T)
    empty = GatingBatch(slots_T=torch.zeros(0, dtype=torch.int64), positions_T=torch.zeros(0, dtype=torch.int64))
    out = r.route(0, torch.zeros(0, E), torch.zeros(0, D), empty)
    assert out.ids.shape[0] == 0 and out.weights.shape[0] == 0


def test_exact_is_the_models_routing():
    r = make_router("exact")
    logits = torch.randn(9, E)
    out = r.route(0, logits, torch.randn(9, D), GatingBatch.single(torch.arange(9)))
    w, ids = topk_softmax_ref(logits, K, False)
    assert torch.equal(out.ids, ids) and torch.allclose(out.weights, w)


def test_balanced_flattens_a_skewed_load_and_keeps_unbiased_weights():
    torch.manual_seed(0)
    skew = torch.tensor([2.0, 1.5, 1.0, 0.5, 0, 0, 0, 0])
    r = make_router("balanced", balance_rate=0.005)
    def maxmean(ids):
        c = torch.bincount(ids.reshape(-1), minlength=E).float()
        return float(c.max() / c.mean())
    exact = maxmean(topk_softmax_ref(torch.randn(4096, E) + skew, K, False)[1])
    for _ in range(400):  # warm the bias up, one update per step, as a serving rank does over its first steps
        r.route(0, torch.randn(64, E) + skew, torch.randn(64, D), GatingBatch.single(torch.arange(64)))
        r.update_bias(r.take_balance_load())
    logits = torch.randn(4096, E) + skew
    out = r.route(0, logits, torch.randn(4096, D), GatingBatch.single(torch.arange(4096)))
    assert exact > 2.0 and maxmean(out.ids) < 1.25  # the sign rule hovers within ~u of the balance point
    probs = torch.softmax(logits, -1)
    assert torch.allclose(out.weights, probs.gather(1, out.ids))
    assert r.stats()["bias_absmax"] > 0


def test_balanced_bias_step_is_the_sign_rule_on_the_summed_load():
    """update_bias: b += ceil(tokens / balance_tokens) * u * sign(mean - load) per layer with load (tokens =
    load / top_k); a layer without load keeps its bias;
    take_balance_load counts this router's balanced selections since the last take, then restarts."""
    r = make_router("balanced", balance_rate=0.5, balance_tokens=64)
    assert r.take_balance_load() is None
    logits = torch.full((3, E), -5.0)
    logits[:, 1] = logits[:, 6] = 5.0  # experts 1 and 6 for all three tokens
    r.route(1, logits, torch.randn(3, D), GatingBatch.single(torch.arange(3)))
    load = r.take_balance_load()
    want = torch.zeros(2, E, dtype=torch.int64)
    want[1, 1] = want[1, 6] = 3
    assert torch.equal(load, want) and r.take_balance_load() is None
    r.update_bias(load)  # mean load 6/8 = 0.75: experts 1, 6 above (-u), the rest below (+u); layer 0 none
    b = torch.full((E,), 0.5)
    b[1] = b[6] = -0.5
    assert torch.equal(r.bias, torch.stack([torch.zeros(E), b]))
    big = torch.zeros(2, E, dtype=torch.int64)  # 130 tokens x top-2 on layer 0: ceil(130 / 64) = 3 steps of u
    big[0, 0], big[0, 3] = 130, 130
    r.update_bias(big)
    b0 = torch.full((E,), 1.5)
    b0[0] = b0[3] = -1.5
    assert torch.equal(r.bias, torch.stack([b0, b]))


def test_balanced_is_the_same_however_the_tokens_are_split_over_ranks():
    """Rank invariance: routers that each route a part of every step's tokens and update from the summed
    load choose what one router routing all of them chooses, step after step, and hold its bias."""
    torch.manual_seed(3)
    skew = torch.tensor([2.0, 1.5, 1.0, 0.5, 0, 0, 0, 0])
    one = make_router("balanced", balance_rate=0.02)
    split = [make_router("balanced", balance_rate=0.02) for _ in range(3)]
    for step in range(30):
        logits = torch.randn(10, E) + skew
        x = torch.randn(10, D)
        ids1 = one.route(0, logits, x, GatingBatch.single(torch.arange(10))).ids
        one.update_bias(one.take_balance_load())
        parts = [(0, 4), (4, 7), (7, 10)] if step % 2 else [(0, 1), (1, 10), (10, 10)]  # a rank may have none
        ids = [r.route(0, logits[a:b], x[a:b], GatingBatch.single(torch.arange(b - a))).ids
               for r, (a, b) in zip(split, parts)]
        assert torch.equal(torch.cat(ids), ids1)
        loads = [r.take_balance_load() for r in split]
        total = sum(l for l in loads if l is not None)
        for r in split:
            r.update_bias(total)
            assert torch.equal(r.bias, one.bias)
    assert float(one.bias.abs().max()) > 0.1  # the bias moved: the comparison above was not of zeros


def test_capacity_never_overflows_and_never_drops():
    torch.manual_seed(1)
    logits = torch.randn(50, E)
    logits[:, 0] += 5  # everyone wants expert 0
    r = make_router("capacity", capacity_factor=1.0)
    out = r.route(0, logits, torch.randn(50, D), GatingBatch.single(torch.arange(50)))
    check_valid(out, 50)
    assert bool((out.ids >= 0).all())  # K experts for every token
    cap = math.ceil(50 * K / E)
    assert int(torch.bincount(out.ids.reshape(-1), minlength=E).max()) <= cap
    # the best-scoring tokens keep their first choice
    probs = torch.softmax(logits, -1)
    best = probs[:, 0].argsort(descending=True)[:cap]
    assert bool((out.ids[best] == 0).any(dim=1).all())


def test_dynamic_uses_experts_until_top_p():
    r = make_router("dynamic", top_p=0.5, k_min=1, k_max=4)
    logits = torch.log(torch.tensor([[0.7, 0.1, 0.1, 0.05, 0.05, 0, 0, 0],
                                     [0.3, 0.15, 0.15, 0.15, 0.1, 0.1, 0.05, 0],
                                     [0.125] * 8]) + 1e-9)
    out = r.route(0, logits, torch.randn(3, D), GatingBatch.single(torch.arange(3)))
    check_valid(out, 3)
    n = (out.ids >= 0).sum(1).tolist()
    assert n == [1, 3, 4]  # 0.7 >= 0.5; 0.3+0.15+0.15; capped at k_max


def _route_stepwise(r: GatingRouter, logits, x, slot=0):
    """Route one sequence token by token (decode), returning the concatenated ids."""
    outs = []
    for t in range(logits.shape[0]):
        b = GatingBatch(slots_T=torch.tensor([slot]), positions_T=torch.tensor([t]))
        outs.append(r.route(0, logits[t : t + 1], x[t : t + 1], b))
    return outs


@pytest.mark.parametrize("policy", ["sticky", "velocity"])
def test_recurrences_do_not_depend_on_step_split(policy):
    torch.manual_seed(2)
    T = 24
    logits, x = torch.randn(T, E), torch.randn(T, D)
    x[5:12] = x[4] + 0.01 * torch.randn(7, D)  # a slow stretch
    kw = {"sticky_margin": 0.1} if policy == "sticky" else {"velocity_fast": 0.8, "velocity_slow": 0.3}
    one = make_router(policy, **kw).route(0, logits, x, GatingBatch.single(torch.arange(T)))
    steps = _route_stepwise(make_router(policy, **kw), logits, x)
    ids = torch.cat([s.ids for s in steps])
    assert torch.equal(one.ids, ids)
    assert torch.allclose(one.weights, torch.cat([s.weights for s in steps]))
    if policy == "velocity":
        # None = unscaled (a step whose tokens are neither fast nor slow skips the scale)
        shared = torch.cat([torch.ones(1) if s.shared_scale is None else s.shared_scale for s in steps])
        assert any(s.shared_scale is None for s in steps)
        assert torch.equal(one.shared_scale, shared)
        assert bool((shared > 1).any()) and bool((one.ids < 0).any())  # slow tokens lean on the shared expert


def test_sticky_cuts_thrash_and_zero_margin_is_exact():
    torch.manual_seed(3)
    T = 200
    logits = torch.randn(T, E) * 0.3
    x = torch.randn(T, D)
    ex = make_router("exact")
    ex.route(0, logits, x, GatingBatch.single(torch.arange(T)))
    st = make_router("sticky", sticky_margin=0.1)
    st.route(0, logits, x, GatingBatch.single(torch.arange(T)))
    assert st.stats()["thrash"][0] < 0.5 * ex.stats()["thrash"][0]
    z = make_router("sticky", sticky_margin=0.0).route(0, logits, x, GatingBatch.single(torch.arange(T)))
    assert torch.equal(z.ids.sort(1).values, topk_softmax_ref(logits, K, False)[1].sort(1).values)


def test_sequences_keep_separate_state_and_position_zero_resets():
    torch.manual_seed(4)
    logits, x = torch.randn(10, E), torch.randn(10, D)
    r = make_router("sticky", sticky_margin=0.2)
    a = r.route(0, logits, x, GatingBatch(slots_T=torch.tensor([0] * 5 + [1] * 5),
                                          positions_T=torch.tensor(list(range(5)) * 2)))
    b0 = make_router("sticky", sticky_margin=0.2).route(0, logits[:5], x[:5], GatingBatch.single(torch.arange(5)))
    b1 = make_router("sticky", sticky_margin=0.2).route(0, logits[5:], x[5:], GatingBatch.single(torch.arange(5)))
    assert torch.equal(a.ids, torch.cat([b0.ids, b1.ids]))


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="policy='nope'"):
        GatingConfig(policy="nope")
    with pytest.raises(ValueError, match="top_p=0"):
        GatingConfig(policy="dynamic", top_p=0)
    with pytest.raises(ValueError, match="unknown gating option"):
        GatingConfig.from_options("exact", {"margin": 1})
    with pytest.raises(ValueError, match="velocity_k=3"):
        make_router("velocity", velocity_k=3)


def test_sticky_list_path_equals_tensor_rule_with_ties_and_missing_previous():
    """The decode path's `_stick_lists` and the prefill path's `_stick` pick the same ids in the same order,
    including all-tie rows (uniform scores) and rows without a previous token (-1)."""
    from actors.moe.gating_router import _stick, _stick_lists

    g = torch.Generator().manual_seed(5)
    for trial in range(300):
        N, k = 1 + trial % 6, 2
        logits = torch.randn(N, E, generator=g) * (0.1, 1.0, 3.0)[trial % 3]
        if trial % 7 == 0:
            logits[0] = 0.0
        probs = logits.softmax(-1)
        new = probs.topk(k, -1).indices
        prev = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(N)])
        if trial % 5 == 0:
            prev[0] = -1
        margin = (0.0, 0.05, 0.15, 0.3, 1.0)[trial % 5]
        want = _stick(probs, new, prev, margin)
        assert torch.equal(_stick_lists(probs.tolist(), new.tolist(), prev.tolist(), margin, "cpu"), want), trial
