"""The expert runtime feeds the two-state pre-attention predictor: each decode token's predecessor's state at the
predicted layer, from the previous step; prefill tokens zeros. Tokens stay those of an engine without prefetch."""
from __future__ import annotations

import os

import torch

from actors.experts.checkpoint import write_packed_checkpoint
from actors.prefetch.transitions import TRANSITIONS_FILE
from router_service.routing.calibration import calibrate
from tests.actors.experts.test_expert_store import PROMPTS, greedy, make_engine, qwen_dir  # noqa: F401 (fixture)


def test_decode_tokens_get_the_previous_steps_state(qwen_dir, tmp_path):  # noqa: F811
    dst = str(tmp_path / "packed")
    write_packed_checkpoint(qwen_dir, dst, bits=4, group_size=64)
    counts = calibrate(make_engine(dst), [list(range(3, 60)), list(range(100, 140))], os.path.join(dst, TRANSITIONS_FILE))
    assert counts.pre_attention_prev and all(m.parts == 2 for m in counts.pre_attention_prev.values())
    eng = make_engine(dst, weight_bits=4, expert_cache_capacity=2, prefetch="pre_attention_prev")
    rt = eng.expert_runtime
    pred = rt.predictor
    assert pred.name == "pre_attention_prev" and pred.needs_prev_token_hidden
    seen, states = [], []  # (layer, input) per prediction; (layer, h) per on_hidden
    scores, on_hidden = pred.scores, rt.on_hidden

    def spy(layer, pl, pt, hidden, n):
        seen.append((layer, None if hidden is None else hidden.clone()))
        return scores(layer, pl, pt, hidden, n)

    def spy_hidden(l, h):
        states.append((l, h.detach().clone()))
        on_hidden(l, h)

    pred.scores, rt.on_hidden = spy, spy_hidden  # its list path (the base class's) calls `scores`
    out = greedy(eng, PROMPTS[:1], 4)
    ref = greedy(make_engine(dst, weight_bits=4, expert_cache_capacity=2, prefetch="none"), PROMPTS[:1], 4)
    assert out == ref  # prefetch never changes tokens
    mc = eng.model.cfg
    D, last = mc.hidden_size, [l for l in range(mc.num_layers) if mc.moe_layers[l]][-1]
    inputs = [h for l, h in seen if l == last and h is not None]
    lstates = [h for l, h in states if l == last]
    assert len(inputs) == len(lstates) == 4 and all(h.shape[1] == 2 * D for h in inputs)
    assert inputs[0].shape[0] == len(PROMPTS[0]) and torch.all(inputs[0][:, D:] == 0)  # prefill: unknown
    for step in range(1, 4):  # decode: the previous step's last state at the predicted layer
        assert inputs[step].shape[0] == 1
        assert torch.equal(inputs[step][0, D:], lstates[step - 1][-1].float())
