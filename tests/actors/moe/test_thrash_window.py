"""The deferred, windowed thrash accounting equals a token-by-token reference (Jaccard distance between
consecutive tokens' expert sets per sequence and layer), across prefill chunks, decodes, interleaved
sequences, slot reuse (a new sequence at position 0) and flushes in the middle of a step."""
from __future__ import annotations

import random

import torch

from actors.moe.gating import GatingBatch, GatingConfig
from actors.moe.gating_router import GatingRouter

E, K, L, D = 8, 2, 3, 4


def _reference(events):
    """events: [(layer, slot, position, set)] in time order -> per-layer mean Jaccard distance."""
    prev, tot, n = {}, [0.0] * L, [0] * L
    for layer, slot, pos, cur in events:
        key = (slot, layer)
        if pos == 0:
            prev.pop(key, None)
        if key in prev:
            a, b = set(cur), prev[key]
            tot[layer] += 1 - len(a & b) / len(a | b)
            n[layer] += 1
        prev[key] = set(cur)
    return [t / c if c else float("nan") for t, c in zip(tot, n)]


def test_windowed_thrash_equals_token_by_token_reference():
    rnd = random.Random(0)
    g = torch.Generator().manual_seed(0)
    r = GatingRouter(GatingConfig(policy="exact"), num_layers=L, num_experts=E, top_k=K, renormalize=False,
                     hidden=D, num_slots=6, has_shared_expert=False)
    lengths = {}  # slot -> next position
    events = []
    for step in range(150):  # > RoutingState.WINDOW several times over
        slots, pos = [], []
        for s in rnd.sample(range(5), rnd.randint(1, 4)):
            if s not in lengths or rnd.random() < 0.05:
                lengths[s] = 0  # a new sequence in this slot (or a preempted one restarting)
            n = rnd.randint(2, 5) if lengths[s] == 0 else 1  # prefill chunk or one decode token
            slots += [s] * n
            pos += range(lengths[s], lengths[s] + n)
            lengths[s] += n
        batch = GatingBatch(slots_T=torch.tensor(slots), positions_T=torch.tensor(pos))
        for layer in range(L):
            logits = torch.randn(len(slots), E, generator=g) * 2
            out = r.route(layer, logits, torch.zeros(len(slots), D), batch)
            events += [(layer, s, p, ids) for s, p, ids in zip(slots, pos, out.ids.tolist())]
            if step % 37 == 5 and layer == 1:
                r.state.flush()  # a stats() read from another thread, mid-step
    got = r.stats()["thrash"]
    want = _reference(events)
    assert torch.allclose(torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64), atol=1e-12)
    assert all(0.0 < x < 1.0 for x in got)
