"""The batched sampler: equal to a per-row reference (same seeds, same tokens), the distribution it draws from,
tiny temperatures, and per-row error isolation."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from actors.engine import sampler as S
from actors.engine.sampler import make_generator, sample
from actors.engine.sampling import SamplingParams


def reference_row(x: torch.Tensor, p: SamplingParams, u: float) -> int:
    """One row the plain way, in float64: greedy below 1e-5; z = max((x - max) / T, -87); top-k on z (ties
    kept); softmax; top-p on the sorted probabilities (keep while the mass before a token is < top_p); then the
    first index whose cumulative probability exceeds u."""
    if p.temperature < S.GREEDY_BELOW_TEMPERATURE:
        return int(x.argmax())
    z = ((x.float() - x.max()) / p.temperature).clamp(min=S._Z_FLOOR).double()
    if 0 < p.top_k < x.numel():
        z = z.masked_fill(z < torch.topk(z, p.top_k).values[-1], float("-inf"))
    probs = torch.softmax(z, dim=0)
    if p.top_p < 1.0:
        sp = torch.sort(probs, descending=True).values
        smallest_kept = sp[sp.cumsum(0) - sp < p.top_p][-1]
        probs = torch.where(probs >= smallest_kept, probs, torch.zeros_like(probs))
    cdf = probs.cumsum(0)
    return int(torch.searchsorted(cdf, torch.tensor([float(torch.tensor(u, dtype=torch.float32)) * float(cdf[-1])],
                                                    dtype=torch.float64), right=True).clamp(max=x.numel() - 1))


MIX = [SamplingParams(temperature=0), SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=5),
       SamplingParams(temperature=1.3, top_p=0.8), SamplingParams(temperature=0.9, top_k=40, top_p=0.95),
       SamplingParams(temperature=0.5, top_k=1), SamplingParams(temperature=2.0, top_p=0.3),
       SamplingParams(temperature=1.0, top_k=300, top_p=0.99), SamplingParams(temperature=1e-38),
       SamplingParams(temperature=5.0, top_p=0.9)]  # a nucleus wider than the 256 candidates: the whole-row sort


@pytest.mark.parametrize("V", [1000, 4096])  # 1000: not a whole number of the prefix sum's 64-blocks
def test_batched_equals_per_row_reference_and_each_row_alone(V):
    g = torch.Generator().manual_seed(V)
    B, steps = 3 * len(MIX), 12
    params = [MIX[i % len(MIX)] for i in range(B)]
    batched = [make_generator(100 + i) for i in range(B)]
    alone = [make_generator(100 + i) for i in range(B)]
    ref = [make_generator(100 + i) for i in range(B)]
    for _ in range(steps):
        logits = torch.randn(B, V, generator=g) * 4
        toks, errors = sample(logits, params, batched)
        assert errors == {}
        for i, p in enumerate(params):
            one, err = sample(logits[i:i + 1], [p], [alone[i]])
            assert err == {} and one[0] == toks[i], (i, p)  # whatever the batch: a seeded row draws the same
            u = ref[i].random() if p.temperature >= S.GREEDY_BELOW_TEMPERATURE else 0.0
            assert toks[i] == reference_row(logits[i], p, u), (i, p)
            if p.temperature >= S.GREEDY_BELOW_TEMPERATURE:
                assert toks[i] == S._sample_one(logits[i], p.temperature, p.top_k if 0 < p.top_k < V else V,
                                                 p.top_p, u)


def test_fallback_per_row_gives_the_same_tokens(monkeypatch):
    logits = torch.randn(len(MIX), 500, generator=torch.Generator().manual_seed(3)) * 3
    want, _ = sample(logits, MIX, [make_generator(i) for i in range(len(MIX))])

    def broken(*a, **k):
        raise RuntimeError("batched path broke")

    monkeypatch.setattr(S, "_sample_rows", broken)
    got, errors = sample(logits, MIX, [make_generator(i) for i in range(len(MIX))])
    assert errors == {} and got == want


def test_draws_follow_the_filtered_distribution():
    """Inverse-CDF draws vs the exact probabilities after temperature, top-k and top-p (8 tokens)."""
    x = torch.tensor([2.0, 1.5, 1.2, 0.3, 0.0, -0.5, -3.0, 1.9])
    p = SamplingParams(temperature=0.8, top_k=6, top_p=0.85)
    probs = torch.softmax(x / 0.8, 0).double()
    probs[torch.argsort(x)[:2]] = 0  # top-k 6 drops the two smallest
    probs /= probs.sum()
    sp, si = torch.sort(probs, descending=True)
    keep = si[sp.cumsum(0) - sp < 0.85]
    want = torch.zeros(8, dtype=torch.float64)
    want[keep] = probs[keep] / probs[keep].sum()
    B, steps = 500, 80
    gens = [make_generator(i) for i in range(B)]
    counts = torch.zeros(8, dtype=torch.float64)
    for _ in range(steps):
        toks, _ = sample(x.expand(B, 8), [p] * B, gens)
        counts += torch.bincount(torch.tensor(toks), minlength=8)
    freq = counts / counts.sum()
    assert (freq[want == 0] == 0).all()  # nothing top-k or top-p removed is ever drawn
    assert (freq - want).abs().max() < 0.01, (freq, want)  # 40k draws: 4 standard deviations


@pytest.mark.parametrize("t", [1e-38, 1e-30, 1e-6])
def test_tiny_temperature_is_greedy_and_never_fails(t):
    x = torch.randn(4, 4096, generator=torch.Generator().manual_seed(1)) * 30
    toks, errors = sample(x, [SamplingParams(temperature=t)] * 4, [make_generator(0) for _ in range(4)])
    assert errors == {} and toks == x.argmax(dim=1).tolist()


def test_small_temperature_with_wide_logits_stays_finite():
    """x / T overflowed before the stable form: logits 1e4 apart at T = 1e-5 (the smallest sampled T)."""
    x = torch.zeros(3, 300)
    x[:, 7], x[:, 11] = 1e4, -1e4
    toks, errors = sample(x, [SamplingParams(temperature=1e-5), SamplingParams(temperature=0.01, top_p=0.5),
                              SamplingParams(temperature=1e-5, top_k=3)], [make_generator(i) for i in range(3)])
    assert errors == {} and toks == [7, 7, 7]


def test_one_bad_row_fails_alone():
    g = torch.Generator().manual_seed(5)
    params = [SamplingParams(temperature=0.8, top_k=20, seed=i) if i % 2 else SamplingParams(temperature=0)
              for i in range(8)]
    x = torch.randn(8, 700, generator=g)
    clean, _ = sample(x, params, [make_generator(i) for i in range(8)])
    bad = x.clone()
    bad[1, 3] = float("nan")
    bad[2, 0] = float("inf")
    bad[5] = float("-inf")
    params[6] = SimpleNamespace(temperature="hot", top_k=0, top_p=1.0)  # a bug upstream, not a validated param
    toks, errors = sample(bad, params, [make_generator(i) for i in range(8)])
    assert sorted(errors) == [1, 2, 5, 6]
    assert "not finite" in errors[1] and "not finite" in errors[5] and "temperature" not in errors[1]
    assert "unusable" in errors[6]
    assert all(toks[i] == -1 for i in errors)
    assert [toks[i] for i in (0, 3, 4, 7)] == [clean[i] for i in (0, 3, 4, 7)]


def test_empty_batch():
    assert sample(torch.zeros(0, 10), [], []) == ([], {})
