"""Expert-prefetch predictors and routing statistics (pure tensors, no model).

Shape legend: T = tokens, L = layers, K = experts per token, E = experts, D = hidden.
"""
import math

import pytest
import torch

from actors.moe import stats
from actors.prefetch.base import DEFAULT_WEIGHTS, ExpertPredictor
from router_service.routing.fitting import RoutingTrace, fit_loglinear, fit_lookahead_gates
from actors.prefetch.markov import FrequencyPredictor, MarkovPredictor
from actors.prefetch.predictors import PREDICTORS, keep_previous_first, make_predictor
from actors.prefetch.transitions import TransitionCounts
from router_service.routing.prequential import prequential_eval

E, K, L = 8, 2, 3


def test_set_metrics_by_hand():
    pred = torch.tensor([[0, 1, 2], [3, 4, -1]])
    true = torch.tensor([[1, 5], [3, 4]])
    assert stats.set_recall(pred, true, E) == pytest.approx((1 / 2 + 2 / 2) / 2)
    assert stats.set_precision(pred, true, E) == pytest.approx((1 / 3 + 2 / 2) / 2)
    a = torch.tensor([[0, 1], [2, 3], [0, 1]])
    # consecutive rows: {0,1}->{2,3} distance 1, {2,3}->{0,1} distance 1
    assert stats.thrashing(a, E) == pytest.approx(1.0)
    assert stats.thrashing(torch.tensor([[0, 1], [1, 0]]), E) == 0.0
    d = stats.jaccard_distance(torch.tensor([[0, 1]]), torch.tensor([[1, 2]]), E)
    assert d.tolist() == pytest.approx([1 - 1 / 3])
    assert stats.hit_rate(3, 4) == 0.75 and math.isnan(stats.hit_rate(0, 0))
    assert stats.wasted_prefetches([1, 2, 3], [2]) == 2
    assert math.isnan(stats.thrashing(a[:1], E))


def test_routing_stats_summary():
    s = stats.RoutingStats()
    s.add_prediction(1, torch.tensor([[0, 1, 2]]), torch.tensor([[0, 1]]), E)
    s.add_lookups(1, hits=1, lookups=2)
    s.add_prefetch(1, prefetched=3, wasted=1)
    s.add_thrashing(1, torch.tensor([0.5, 1.0]))
    out = s.summary()[1]
    assert out["recall"] == 1.0 and out["precision"] == pytest.approx(2 / 3)
    assert out["hit_rate"] == 0.5 and out["wasted_prefetch_frac"] == pytest.approx(1 / 3)
    assert out["thrashing"] == pytest.approx(0.75)


def _chain_trace(T: int, seed: int, with_hidden: bool = False, d: int = 16) -> RoutingTrace:
    """Layer 0 uses two random distinct experts; layer l uses layer l-1's experts shifted by one, (e + 1) % E:
    a deterministic chain. With hidden: a multi-hot code of layer l's experts (for a lookahead gate)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.empty(T, L, K, dtype=torch.int64)
    ids[:, 0] = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    for l in range(1, L):
        ids[:, l] = (ids[:, l - 1] + 1) % E
    hidden = None
    if with_hidden:
        hidden = torch.zeros(T, L, d)
        for l in range(L):
            for k in range(K):
                hidden[torch.arange(T), l, ids[:, l, k]] = 4.0
    return RoutingTrace(ids=ids, hidden=hidden)


def test_markov_learns_a_deterministic_chain_online():
    traces = [_chain_trace(64, s) for s in range(3)]
    preds = {"markov": MarkovPredictor(L, E, K), "frequent": FrequencyPredictor(L, E, K),
             "none": make_predictor("none", num_layers=L, num_experts=E, top_k=K)}
    res = {n: s.summary() for n, s in prequential_eval(preds, traces).items()}
    # Markov needs a handful of tokens per source expert; after that it is exact.
    assert all(res["markov"][l]["recall"] > 0.9 for l in (1, 2))
    assert all(res["markov"][l]["recall"] > res["frequent"][l]["recall"] + 0.3 for l in (1, 2))
    assert math.isnan(res["none"][1]["recall"]) or res["none"][1]["recall"] == 0.0
    assert 0 not in res["markov"]  # the first MoE layer has no previous layer to predict from


def test_seeded_markov_is_right_from_the_first_token():
    cal = _chain_trace(256, 0)
    counts = TransitionCounts.zeros(L, E)
    for l in range(L):
        counts.observe(l, cal.ids[:, l], cal.ids[:, l - 1] if l else None, None)
    assert counts.tokens == 256
    p = MarkovPredictor(L, E, K, counts=counts)
    t = _chain_trace(8, 1)
    pred = p.predict(1, t.ids[:, 0], None, None, 8)
    assert pred.shape == (8, K + 1)
    assert stats.set_recall(pred, t.ids[:, 1], E) == 1.0
    # A longer calibration run is a prior worth `prior_tokens` tokens, so online evidence can take over.
    big = TransitionCounts(inter=counts.inter * 4, intra=counts.intra * 4, freq=counts.freq * 4, tokens=1024)
    assert float(MarkovPredictor(L, E, K, counts=big).counts.freq[0].sum()) == pytest.approx(256 * K)
    assert float(MarkovPredictor(L, E, K, counts=big, prior_tokens=None).counts.freq[0].sum()) == 1024 * K


def test_lookahead_and_hybrid_use_the_hidden_state():
    d = 16
    # Gate of layer l maps the hidden code of expert e (at l-1) to expert (e+1).
    gates = [None] + [torch.zeros(E, d) for _ in range(L - 1)]
    for l in range(1, L):
        for e in range(E):
            gates[l][(e + 1) % E, e] = 3.0
    look = make_predictor("lookahead", num_layers=L, num_experts=E, top_k=K, gate_weights=gates)
    hyb = make_predictor("hybrid", num_layers=L, num_experts=E, top_k=K, gate_weights=gates)
    res = prequential_eval({"lookahead": look, "hybrid": hyb}, [_chain_trace(32, 3, with_hidden=True, d=d)])
    assert res["lookahead"].summary()[1]["recall"] == 1.0
    assert res["hybrid"].summary()[2]["recall"] > 0.9


def test_transition_counts_save_load(tmp_path):
    c = TransitionCounts.zeros(L, E)
    tr = _chain_trace(20, 5)
    for l in range(L):
        c.observe(l, tr.ids[:, l], tr.ids[:, l - 1] if l else None, tr.ids[:, l].roll(1, 0))
    f = tmp_path / "t.safetensors"
    c.save(str(f), {"note": "test"})
    d = TransitionCounts.load(str(f))
    assert torch.equal(d.inter, c.inter) and torch.equal(d.intra, c.intra) and torch.equal(d.freq, c.freq)
    assert d.tokens == 20
    with pytest.raises(FileNotFoundError):
        TransitionCounts.load(str(tmp_path / "missing"))


def test_predictor_errors_and_union():
    with pytest.raises(ValueError, match="prefetch='bogus'"):
        make_predictor("bogus", num_layers=L, num_experts=E, top_k=K)
    with pytest.raises(ValueError, match="gate_weights"):
        make_predictor("lookahead", num_layers=L, num_experts=E, top_k=K)
    with pytest.raises(ValueError, match="top_k=9"):
        MarkovPredictor(L, E, 9)
    assert ExpertPredictor.union(torch.tensor([[3, 1, -1], [1, 0, 3]])) == [0, 1, 3]
    assert set(PREDICTORS) == {"none", "frequent", "markov", "lookahead", "hybrid", "pre_attention",
                               "pre_attention_hybrid", "pre_attention_prev", "pre_attention_prev_hybrid"}
    none = make_predictor("none", num_layers=L, num_experts=E, top_k=K)
    assert none.predict(1, None, None, None, 4).shape == (4, 0)


def test_markov_uses_the_whole_previous_set():
    # Layer 1's expert is decided by the PAIR used at layer 0 (XOR-like): no single expert predicts it, the set
    # does. The log-linear set model (sum of PMI terms) must beat the old average of per-expert rows.
    g = torch.Generator().manual_seed(0)
    T = 400
    ids = torch.full((T, L, K), -1, dtype=torch.int64)
    a = torch.randint(0, 2, (T,), generator=g)
    b = torch.randint(0, 2, (T,), generator=g)
    ids[:, 0, 0], ids[:, 0, 1] = a, 2 + b  # sets {0|1, 2|3}
    ids[:, 1, 0] = 4 + (a ^ b)  # 4 or 5
    ids[:, 1, 1] = 6 + a  # 6 or 7
    ids[:, 2] = ids[:, 1]
    m = MarkovPredictor(L, E, K)
    res = prequential_eval({"m": m}, [RoutingTrace(ids=ids)]).get("m").summary()
    assert res[1]["recall"] > 0.75  # 6|7 always right; 4|5 mostly, from its rank among the k + 1 = 3


def test_fit_loglinear_and_weights_round_trip(tmp_path):
    d = 16
    traces = [_chain_trace(48, s, with_hidden=True, d=d) for s in range(4)]
    gates = [None] + [torch.zeros(E, d) for _ in range(L - 1)]
    for l in range(1, L):
        for e in range(E):
            gates[l][(e + 1) % E, e] = 3.0
    look = make_predictor("lookahead", num_layers=L, num_experts=E, top_k=K, gate_weights=gates)
    w = fit_loglinear(traces, L, E, K, lookahead=look, steps=20)
    assert len(w["markov"]) == L and all(len(r) == 2 for r in w["markov"])
    assert len(w["hybrid"]) == L and all(len(r) == 3 for r in w["hybrid"])
    assert w["markov"][0] == list(DEFAULT_WEIGHTS["markov"])  # the first MoE layer is never predicted from a layer
    c = TransitionCounts.zeros(L, E)
    c.weights = w
    f = tmp_path / "t.safetensors"
    c.save(str(f))
    back = TransitionCounts.load(str(f))
    assert back.weights == w
    m = make_predictor("markov", num_layers=L, num_experts=E, top_k=K, counts=back)
    assert torch.allclose(m.weights, torch.tensor(w["markov"]))
    h = make_predictor("hybrid", num_layers=L, num_experts=E, top_k=K, counts=back, gate_weights=gates)
    assert torch.allclose(h.weights, torch.tensor(w["hybrid"]))
    assert make_predictor("markov", num_layers=L, num_experts=E, top_k=K).weights[1].tolist() == [1.0, 0.5]
    with pytest.raises(ValueError, match="markov weights shape"):
        MarkovPredictor(L, E, K, weights=[[1.0, 0.5]])
    # Without hidden states only the Markov weights are fitted.
    assert set(fit_loglinear([_chain_trace(16, 0)], L, E, K, steps=2)) == {"markov"}


def test_hybrid_is_a_product_of_markov_and_lookahead():
    # Markov has learned that {3, 4} at layer 0 is followed by {2, 7}; the lookahead gate prefers 0 then 1. The
    # product keeps both Markov experts and fills the spare slot with the lookahead's favourite.
    gates = [None] + [torch.eye(E) * 1.5 for _ in range(L - 1)]
    look = make_predictor("lookahead", num_layers=L, num_experts=E, top_k=K, gate_weights=gates)
    h = make_predictor("hybrid", num_layers=L, num_experts=E, top_k=K, gate_weights=gates)
    for _ in range(50):
        h.observe(1, torch.tensor([[2, 7]]), torch.tensor([[3, 4]]), None)
        h.observe(1, torch.tensor([[0, 1]]), torch.tensor([[5, 6]]), None)
    hid = torch.zeros(1, E)
    hid[0, 0], hid[0, 1] = 1.0, 0.5
    prev = torch.tensor([[3, 4]])
    p = h.scores(1, prev, None, hid, 1)
    assert torch.allclose(p.sum(-1), torch.ones(1))
    assert set(h.predict(1, prev, None, hid, 1)[0].tolist()) == {2, 7, 0}
    assert int(look.predict(1, None, None, hid, 1)[0, 0]) == 0
    assert set(h.predict(1, prev, None, None, 1)[0, :2].tolist()) == {2, 7}  # no hidden state: Markov alone


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("name", ["frequent", "markov", "hybrid", "lookahead", "none"])
def test_list_path_matches_tensor_path(name, compiled, monkeypatch):
    """`scores_lists` / `observe_lists` (decode bookkeeping on Python lists: the compiled CPU calls, or pure
    Python without them) track `scores` / `observe`: same scores after every update, same counts (and token
    count) when read back, with batches of 1 and 3 tokens, padded (-1) ids and tokens without a predecessor."""
    import random

    from kernels.cpu import _build

    if not compiled:
        monkeypatch.setattr(_build, "_lib", None)
        monkeypatch.setattr(_build, "_tried", True)
    elif not _build.cpu_kernels_available():
        pytest.skip("no compiled CPU kernels here")

    rng = random.Random(0)
    g = torch.Generator().manual_seed(0)
    D = 16
    gates = [torch.randn(E, D, generator=g) for _ in range(L)]
    norms = [torch.rand(D, generator=g) + 0.5 for _ in range(L)]
    c = TransitionCounts.zeros(L, E)
    c.freq += torch.rand(L, E, generator=g) * 5
    c.inter += torch.rand(L, E, E, generator=g) * 3
    c.intra += torch.rand(L, E, E, generator=g) * 3
    c.tokens = 100
    kw = dict(num_layers=L, num_experts=E, top_k=K, counts=c, gate_weights=gates, norm_weights=norms)
    a, b = make_predictor(name, **kw), make_predictor(name, **kw)

    def pad(rows):
        return torch.tensor([r + [-1] * (K - len(r)) for r in rows], dtype=torch.int64).reshape(len(rows), K)

    prev = {}
    for _ in range(12):
        T = rng.choice([1, 1, 3])
        pl = None
        for l in range(L):
            ids = [rng.sample(range(E), K) for _ in range(T)]
            if rng.random() < 0.3:
                ids[0][1] = -1
            pt = [prev.get((l, t), []) for t in range(T)]
            h = torch.randn(T, D, generator=g)
            sa = a.scores(l, None if pl is None else pad(pl), pad(pt), h, T)
            sb = b.scores_lists(l, pl, pt, h, T)
            assert torch.allclose(sa, torch.tensor(sb), rtol=1e-4, atol=1e-6)
            a.observe(l, pad(ids), None if pl is None else pad(pl), pad(pt))
            b.observe_lists(l, ids, pl, pt)
            prev.update({(l, t): ids[t] for t in range(T)})
            pl = ids
    for p, q in ((a, b), (getattr(a, "markov", None), getattr(b, "markov", None))):
        if hasattr(p, "counts"):
            for f in ("freq", "inter", "intra"):
                assert torch.allclose(getattr(p.counts, f), getattr(q.counts, f))
            assert p.counts.tokens == q.counts.tokens


def test_list_observations_reach_the_counts_and_the_tensor_tables():
    # observe_lists updates a Python copy at once and the tensors when `counts` is read; the tensor path
    # (`scores`) must see them too (its cached PMI tables are rebuilt).
    m = MarkovPredictor(L, E, K)
    before = m.scores(1, torch.tensor([[0, 1]]), None, None, 1)
    for _ in range(20):
        m.observe_lists(0, [[0, 1]], None, [[]])
        m.observe_lists(1, [[5, 6]], [[0, 1]], [[]])
    assert float(m.counts.inter[1, 0, 5]) == 20 and float(m.counts.freq[1, 6]) == 20 and m.counts.tokens == 20
    after = m.scores(1, torch.tensor([[0, 1]]), None, None, 1)
    assert set(torch.topk(after, 2).indices[0].tolist()) == {5, 6}
    assert not torch.allclose(before, after)
    assert m.scores_lists(1, [[0, 1]], [[]], None, 1)[0] == pytest.approx(after[0].tolist(), rel=1e-4)


def _rotated_traces(n: int, T: int, D: int, gates: list, rot: torch.Tensor, seed: int) -> list[RoutingTrace]:
    """Hidden h at layer 0 random; h at layer l = h at layer l-1 @ rot (the residual turns between layers);
    ids: each layer's true top-k of its own gate on its own hidden state."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        h = [torch.randn(T, D, generator=g)]
        for _ in range(1, L):
            h.append(h[-1] @ rot)
        hid = torch.stack(h, 1)  # [T, L, D]
        ids = torch.stack([(hid[:, l] @ gates[l].T).topk(K, -1).indices for l in range(L)], 1)
        out.append(RoutingTrace(ids=ids, hidden=hid))
    return out


def test_fitted_lookahead_gate_learns_the_residual_turn_the_router_gate_misses():
    # Between layers the residual is rotated by 90 degrees in every plane: the next layer's own gate applied to
    # the current hidden state is then blind (recall near random, 3/8), while the least-squares pre-gate learns
    # gate_l @ rot^T from calibration traces and recovers the true routing on fresh traces.
    D = 16
    gen = torch.Generator().manual_seed(0)
    gates = [torch.randn(E, D, generator=gen) * 2 for _ in range(L)]
    rot = torch.zeros(D, D)
    for i in range(0, D, 2):
        rot[i, i + 1], rot[i + 1, i] = 1.0, -1.0
    cal = _rotated_traces(8, 64, D, gates, rot, seed=1)
    fitted = fit_lookahead_gates(cal, gates, None, ridge=1e-3)
    assert set(fitted) == {1, 2} and fitted[1].shape == (E, D) and fitted[1].dtype == torch.float32
    test = _rotated_traces(4, 64, D, gates, rot, seed=2)
    raw = make_predictor("lookahead", num_layers=L, num_experts=E, top_k=K, gate_weights=gates)
    c = TransitionCounts.zeros(L, E)
    c.lookahead_gates = fitted
    fit = make_predictor("lookahead", num_layers=L, num_experts=E, top_k=K, gate_weights=gates, counts=c)
    rec = {n: sum(v["pred_inter"] for v in st.c.values()) / sum(v["true_n"] for v in st.c.values())
           for n, st in prequential_eval({"raw": raw, "fit": fit}, test).items()}
    assert rec["fit"] >= 0.97
    assert rec["raw"] <= 0.6


def test_lookahead_gates_round_trip_and_replace_the_router_gates(tmp_path):
    D = 4
    gates = [torch.randn(E, D) for _ in range(L)]
    c = TransitionCounts.zeros(L, E)
    c.lookahead_gates = {1: torch.full((E, D), 0.5), 2: torch.full((E, D), -1.0)}
    f = tmp_path / "t.safetensors"
    c.save(str(f))
    back = TransitionCounts.load(str(f))
    assert set(back.lookahead_gates) == {1, 2} and torch.equal(back.lookahead_gates[2], c.lookahead_gates[2])
    assert back.clone().lookahead_gates is back.lookahead_gates
    for name in ("lookahead", "hybrid"):
        p = make_predictor(name, num_layers=L, num_experts=E, top_k=K, gate_weights=gates, counts=back)
        look = p if name == "lookahead" else p.lookahead
        assert torch.equal(look.gate[0], gates[0])  # no fitted gate for the first layer: the router's
        assert torch.equal(look.gate[1], c.lookahead_gates[1]) and torch.equal(look.gate[2], c.lookahead_gates[2])
    # A file without fitted gates loads as None (files written before the fit existed keep working).
    TransitionCounts.zeros(L, E).save(str(f))
    assert TransitionCounts.load(str(f)).lookahead_gates is None
    with pytest.raises(ValueError, match=r"lookahead_gates\[1\]"):
        TransitionCounts(inter=c.inter, intra=c.intra, freq=c.freq, lookahead_gates={1: torch.zeros(E + 1, D)})
    with pytest.raises(ValueError, match=r"lookahead_gates\[1\].shape=\(8, 4\) does not match"):
        make_predictor("hybrid", num_layers=L, num_experts=E, top_k=K, counts=back,
                       gate_weights=[torch.randn(E, D + 1) for _ in range(L)])
    with pytest.raises(ValueError, match="ridge"):
        fit_lookahead_gates([], gates, ridge=-1.0)
    assert fit_lookahead_gates([RoutingTrace(ids=torch.zeros(3, L, K, dtype=torch.int64))], gates) == {}


def test_keep_previous_first():
    # previous experts first (unknown -1 skipped, no repeats), then the predictor's ranking up to the budget
    assert keep_previous_first([4, 1, 7, 2], [7, 3], 3) == [7, 3, 4]
    assert keep_previous_first([4, 1, 7], [-1, -1], 3) == [4, 1, 7]
    assert keep_previous_first([4, 1, 7], [1, 1], 3) == [1, 4, 7]
    assert keep_previous_first([4, 1], [5, 6, 7], 2) == [5, 6]


def test_prequential_eval_keep_previous_scores_the_sticky_prediction():
    # a sequence that keeps expert 3 at layer 1 throughout: the frequency predictor (seeded towards expert 0)
    # misses it at budget 1 until it has learned; with keep_previous every token after the first predicts it
    ids = torch.tensor([[[0], [3]]] * 6)  # [T=6, L=2, K=1]
    counts = TransitionCounts.zeros(2, 4)
    counts.freq[1, 0] = 100.0
    plain = prequential_eval({"f": FrequencyPredictor(2, 4, 1, counts=counts.clone())}, [RoutingTrace(ids=ids)],
                             budget=1)["f"].c[1]
    kept = prequential_eval({"f": FrequencyPredictor(2, 4, 1, counts=counts.clone())}, [RoutingTrace(ids=ids)],
                            budget=1, keep_previous=True)["f"].c[1]
    assert plain["pred_inter"] == 0 and kept["pred_inter"] == 5 and kept["true_n"] == 6
