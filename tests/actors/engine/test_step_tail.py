"""The engine step's tail: a seeded request's tokens do not depend on its batch, and one request's bad logits or
broken state ends that request with an error while the others in its steps finish as they would have."""
from __future__ import annotations

from actors.engine import engine as engine_module
from actors.engine.messages import GenerateRequest
from actors.engine.sampling import SamplingParams
from tests.actors.model.test_model_vs_hf import make_engine

PROMPTS = [[5, 17, 33, 2, 99], [200, 3, 4], [11, 12, 13, 14, 15, 16], [40, 41], [7, 8, 9, 10]]
PARAMS = [SamplingParams(temperature=0.9, seed=11, max_tokens=14, ignore_eos=True),
          SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
          SamplingParams(temperature=1.2, top_k=20, top_p=0.9, seed=5, max_tokens=12, ignore_eos=True),
          SamplingParams(temperature=0.7, top_p=0.5, seed=3, max_tokens=9, ignore_eos=True),
          SamplingParams(temperature=1.0, seed=8, max_tokens=13, ignore_eos=True)]


def run(eng, idx: list[int]) -> dict[str, tuple[list[int], str, str | None, str | None]]:
    """Requests `idx` of PROMPTS/PARAMS together: request id -> (tokens, text, finish_reason, error)."""
    for i in idx:
        eng.add_request(GenerateRequest(request_id=str(i), prompt_ids=PROMPTS[i], params=PARAMS[i].to_dict()))
    out = {str(i): ([], "", None, None) for i in idx}
    for _ in range(1000):
        for o in eng.step():
            t, s, _, _ = out[o.request_id]
            out[o.request_id] = (t + o.token_ids, s + o.text, o.finish_reason, o.error)
        if not eng.has_work:
            return out
    raise AssertionError("engine did not finish")


def test_seeded_requests_draw_the_same_tokens_alone_and_batched(tiny_model_dir):
    path = tiny_model_dir("qwen2_moe", num_layers=3)
    together = run(make_engine(path), list(range(len(PROMPTS))))
    for i in range(len(PROMPTS)):
        alone = run(make_engine(path), [i])
        assert alone[str(i)] == together[str(i)]
        assert together[str(i)][2] == "length" and len(together[str(i)][0]) == PARAMS[i].max_tokens


def test_bad_logits_end_one_request_with_an_error(tiny_model_dir, monkeypatch):
    path = tiny_model_dir("qwen2_moe", num_layers=3)
    clean = run(make_engine(path), list(range(len(PROMPTS))))
    real = engine_module.sample
    seen = {"n": 0}

    def nan_for_request_4(logits, params, gens, controls=None, grammars=None):
        for r, p in enumerate(params):
            if p.max_tokens == 13:  # request 4
                seen["n"] += 1
                if seen["n"] == 3:
                    logits[r] = float("nan")
        return real(logits, params, gens, controls, grammars)

    monkeypatch.setattr(engine_module, "sample", nan_for_request_4)
    eng = make_engine(path)
    got = run(eng, list(range(len(PROMPTS))))
    toks, _, reason, err = got["4"]
    assert reason == "error" and "not finite" in err and toks == clean["4"][0][:2]
    for i in range(4):
        assert got[str(i)] == clean[str(i)]
    assert not eng._slot_of and len(eng._free_slots) == eng.cfg.max_num_seqs
    assert eng.cache.allocator.num_used == 0 and not eng.scheduler.running


def test_a_broken_sequence_ends_alone(tiny_model_dir):
    path = tiny_model_dir("qwen2_moe", num_layers=3)
    clean = run(make_engine(path), list(range(len(PROMPTS))))
    eng = make_engine(path)
    for i in range(len(PROMPTS)):
        eng.add_request(GenerateRequest(request_id=str(i), prompt_ids=PROMPTS[i], params=PARAMS[i].to_dict()))
    eng.step()  # the prefills
    seq = next(s for s in eng.scheduler.running if s.request_id == "2")

    def broken(tok):
        raise KeyError("detokenizer state lost")

    seq.detok.add = broken
    got = {str(i): ([], "", None, None) for i in range(len(PROMPTS))}
    while eng.has_work:
        for o in eng.step():
            t, s, _, _ = got[o.request_id]
            got[o.request_id] = (t + o.token_ids, s + o.text, o.finish_reason, o.error)
    assert got["2"][2] == "error" and "detokenizer state lost" in got["2"][3]
    for i in (0, 1, 3, 4):
        assert got[str(i)][0] == clean[str(i)][0][1:] and got[str(i)][2] == "length"
    assert eng.cache.allocator.num_used == 0 and not eng._slot_of
