"""Gating policies inside the engine: per-request overrides mixed in one step, slots reused, stats."""
from __future__ import annotations

import pytest

from actors.engine.sampling import SamplingParams
from tests.actors.model.test_model_vs_hf import make_engine, run_to_completion


def _prompts():
    return [[(11 * i + j) % 250 + 3 for j in range(4 + 5 * i)] for i in range(4)]


@pytest.mark.parametrize("mixed", ["sticky", "dynamic", "velocity"])
def test_mixed_policies_in_one_batch_equal_each_alone(tiny_model_dir, mixed):
    path = tiny_model_dir("qwen2_moe", num_layers=3)
    opts = {"sticky_margin": 0.2, "velocity_fast": 0.3, "velocity_slow": 0.1, "top_p": 0.4}
    prompts = _prompts()
    exact = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    other = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, gating=mixed)
    eng = make_engine(path, gating_options=opts)
    from actors.engine.messages import GenerateRequest

    for i, p in enumerate(prompts):
        eng.add_request(GenerateRequest(request_id=str(i), prompt_ids=p,
                                        params=(other if i % 2 else exact).to_dict()))
    together: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while eng.has_work:
        for o in eng.step():
            together[o.request_id] += o.token_ids
    alone_exact = run_to_completion(make_engine(path, gating_options=opts), prompts[0::2], exact)
    alone_other = run_to_completion(make_engine(path, gating=mixed, gating_options=opts), prompts[1::2], other)
    assert [together[str(i)] for i in (0, 2)] == list(alone_exact.values())
    assert [together[str(i)] for i in (1, 3)] == list(alone_other.values())
    st = eng.stats()["routing"]
    assert st["policy_tokens"][mixed] > 0 and st["policy_tokens"]["exact"] > 0
    assert all(0 <= t <= 1 for t in st["thrash"] if t == t) and any(t == t for t in st["thrash"])
    assert len(eng._slot_of) == 0 and len(eng._free_slots) == eng.cfg.max_num_seqs  # every slot back


def test_bad_gating_is_rejected(tiny_model_dir):
    path = tiny_model_dir("qwen2_moe", num_layers=3)
    with pytest.raises(ValueError, match="gating='fastest'"):
        SamplingParams(gating="fastest")
    with pytest.raises(ValueError, match="gating policy='x'"):
        make_engine(path, gating="x")
