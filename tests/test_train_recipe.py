"""The training recipe's routing terms (scripts/train_tiny_moe.py): the sequence-wise balance loss, routing
smoothness, and `sticky` routing in training must follow the serving rule exactly."""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

import train_tiny_moe as T  # noqa: E402
from actors.moe.gating import GatingBatch, GatingConfig  # noqa: E402
from actors.moe.gating_router import GatingRouter, _stick  # noqa: E402


def test_sticky_ids_equal_the_serving_rule_token_by_token():
    g = torch.Generator().manual_seed(0)
    B, L, E, K = 3, 120, 8, 2
    probs = (torch.randn(B, L, E, generator=g) * 1.5).softmax(-1)
    ids = probs.topk(K, dim=-1).indices
    got = T.sticky_ids(probs, ids, 0.15)
    want = ids.clone()
    for t in range(1, L):
        want[:, t] = _stick(probs[:, t], want[:, t], want[:, t - 1], 0.15)
    assert torch.equal(got, want)
    assert not torch.equal(got, ids)  # the margin changed some sets


def test_sticky_ids_equal_the_gating_router_on_one_sequence():
    g = torch.Generator().manual_seed(1)
    L, E, K = 64, 8, 2
    logits = torch.randn(L, E, generator=g) * 2
    router = GatingRouter(GatingConfig(policy="sticky", sticky_margin=0.2), num_layers=1, num_experts=E, top_k=K,
                          renormalize=False, hidden=4, num_slots=2, has_shared_expert=False)
    batch = GatingBatch(slots_T=torch.zeros(L, dtype=torch.long), positions_T=torch.arange(L))
    served = router.route(0, logits, torch.randn(L, 4, generator=g), batch).ids
    probs = logits.softmax(-1)
    trained = T.sticky_ids(probs[None], probs.topk(K, dim=-1).indices[None], 0.2)[0]
    assert torch.equal(served.sort(-1).values, trained.sort(-1).values)


def test_routing_losses_balanced_and_smooth_values():
    B, L, E = 2, 16, 8
    flat = [torch.zeros(B * L, E)]  # uniform router: perfectly balanced, perfectly smooth
    bal, smooth = T.routing_losses(flat, B, L, 2)
    assert bal.item() == pytest.approx(1.0) and smooth.item() == pytest.approx(0.0)
    one = torch.full((B * L, E), -30.0)
    one[:, 3] = 30.0  # every token on expert 3: f_3 = 1/2 (one of two slots), P_3 = 1 -> E * 1/2
    bal, _ = T.routing_losses([one], B, L, 2)
    assert bal.item() == pytest.approx(E / 2, rel=1e-4)
    alt = torch.full((B, L, E), -30.0)
    alt[:, 0::2, 0] = 30.0
    alt[:, 1::2, 1] = 30.0  # the argmax flips every token: total variation 1 between neighbours
    _, smooth = T.routing_losses([alt.view(B * L, E)], B, L, 2)
    assert smooth.item() == pytest.approx(1.0, abs=1e-4)
