"""Constrained decoding on the rank (`actors.engine.grammar`): the masked logits at a grammar state allow exactly
the tokens llguidance says (its own single-matcher bitmask; each of them one it would consume), the sampler draws only allowed tokens and
takes the masked argmax when greedy, a broken grammar fails its row alone, and on the engine sampled outputs of a
bounded schema at temperature 1 all end with "stop" and validate, while a request with a broken grammar fails
alone beside them."""
from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
import torch

from actors.engine.grammar import GrammarState, apply_grammar_masks, json_schema_grammar, load_tokenizer
from actors.engine.messages import GenerateRequest
from actors.engine.sampler import make_generator, sample
from actors.engine.sampling import SamplingParams
from cluster.config import DEFAULT_MODEL
from tests.actors.engine.test_chunked_prefill import _engine

V = 4096  # the shipped model's vocabulary
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "pet": {"enum": ["cat", "dog", "none"]}, "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
    "required": ["name", "age", "pet", "tags"], "additionalProperties": False}
TEXT = '{"name": "Ann", "age": 42, "pet": "dog", "tags": [true]}'


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(f"{DEFAULT_MODEL}/tokenizer.json", V, (0,))


@pytest.fixture(scope="module")
def grammar():
    return json_schema_grammar(SCHEMA)


def _library_mask(m) -> np.ndarray:
    """llguidance's own single-matcher bitmask (`compute_bitmask`, not the batched path under test), [V] bool."""
    return np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little")[:V].astype(bool)


def test_masked_logits_allow_exactly_the_library_tokens(tok, grammar):
    ids = [int(t) for t in _hf_ids(TEXT)]
    states = [GrammarState(tok, grammar) for _ in range(4)]
    cuts = [0, 3, 6, len(ids)]  # the start, after a key, inside a string value, the complete object
    for s, c in zip(states, cuts):
        for t in ids[:c]:
            s.advance(t)
    x = torch.randn(len(states) + 1, V).numpy()
    before = x.copy()
    errors: dict = {}
    apply_grammar_masks(x, [0, 1, 2, 3], states, errors)
    assert errors == {}
    np.testing.assert_array_equal(x[4], before[4])  # the row without a grammar is untouched
    for j, s in enumerate(states):
        want = _library_mask(s.matcher)
        allowed = np.isfinite(x[j])
        np.testing.assert_array_equal(allowed, want)
        np.testing.assert_array_equal(x[j][allowed], before[j][allowed])  # allowed logits keep their value
        # every allowed token is one the library would consume (the mask may leave out non-canonical spellings of
        # forced text, e.g. '"' then ':' where '":' is the token)
        assert all(s.matcher.validate_tokens([t]) == 1 for t in np.flatnonzero(want)[:50].tolist() if t != 0)
    assert np.flatnonzero(np.isfinite(x[3])).tolist() == [0]  # complete: EOS alone
    assert 0 not in np.flatnonzero(np.isfinite(x[0]))  # EOS only where the grammar accepts
    assert 1 < np.isfinite(x[2]).sum() < V


def _hf_ids(text: str) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(f"{DEFAULT_MODEL}/tokenizer.json").encode(text).ids


def test_sampler_draws_only_allowed_tokens_and_a_broken_grammar_fails_alone(tok, grammar):
    ids = _hf_ids(TEXT)
    s_greedy, s_sampled = GrammarState(tok, grammar), GrammarState(tok, grammar)
    for t in ids[:6]:  # inside a string value: many tokens allowed
        s_greedy.advance(t), s_sampled.advance(t)
    broken = GrammarState(tok, '{"grammars": [{"json_schema": {"type": "foo"}}]}')
    assert broken.matcher is None and "does not compile" in broken.error
    allowed = _library_mask(s_sampled.matcher)
    assert 100 < allowed.sum() < V - 100
    logits = torch.randn(4, V) * 3
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.8, top_p=0.9)]
    gens = [None, make_generator(1), make_generator(2), make_generator(3)]
    plain_gen = make_generator(3)
    for _ in range(20):
        toks, errors = sample(logits, params, gens, None, [s_greedy, s_sampled, broken, None])
        assert set(errors) == {2} and "does not compile" in errors[2] and toks[2] == -1
        assert toks[0] == int(torch.where(torch.from_numpy(allowed), logits[0], -torch.inf).argmax())
        assert allowed[toks[1]]
        want, _ = sample(logits[3:], params[3:], [plain_gen])  # the row without a grammar: as if sampled alone
        assert toks[3] == want[0]
    assert torch.isfinite(logits).all()  # the caller's logits are never modified


def test_engine_outputs_follow_the_schema_and_a_bad_grammar_fails_alone(grammar):
    eng = _engine(max_num_seqs=11)
    prompt = eng.tokenizer.encode("Reply in JSON: ").ids
    for i in range(10):
        p = SamplingParams(temperature=1.0, max_tokens=256, seed=100 + i, grammar=grammar)
        msg = GenerateRequest.decode(GenerateRequest(request_id=f"g{i}", prompt_ids=prompt, params=p.to_dict()).encode())
        assert SamplingParams.from_dict(msg.params) == p  # the grammar travels router -> rank in the msgpack message
        eng.add_request(msg)
    bad = SamplingParams(temperature=1.0, max_tokens=8, grammar='{"grammars": [{"json_schema": {"type": "foo"}}]}')
    eng.add_request(GenerateRequest(request_id="bad", prompt_ids=prompt, params=bad.to_dict()))
    texts, ids, done = {}, {}, {}
    while eng.has_work:
        for o in eng.step():
            texts[o.request_id] = texts.get(o.request_id, "") + o.text
            ids.setdefault(o.request_id, []).extend(o.token_ids)
            if o.finish_reason is not None:
                done[o.request_id] = (o.finish_reason, o.error)
    assert done.pop("bad")[0] == "error" and ids["bad"] == []
    assert all(r == ("stop", None) for r in done.values()), done
    for rid, text in texts.items():
        if rid == "bad":
            continue
        jsonschema.validate(json.loads(text), SCHEMA)
        assert eng.tokenizer.decode(ids[rid]) == text and 0 not in ids[rid]  # ended by the grammar, EOS never emitted
    assert len(set(texts.values())) > 5  # sampled, not one output ten times


def test_grammar_state_survives_preemption(grammar):
    """A preempted sequence is recomputed from its prompt + output tokens; its grammar state (already advanced over
    those tokens) carries on: every output still ends with "stop" and validates."""
    eng = _engine(max_num_seqs=6, max_model_len=192, kv_cache_bytes=12 * 65536)  # 12 blocks of 16 tokens, 6 seqs
    assert eng.cache.allocator.num_blocks == 12
    preempted = []
    orig = eng.scheduler._preempt

    def preempt(victim):
        preempted.append(victim.request_id)
        orig(victim)

    eng.scheduler._preempt = preempt
    prompt = eng.tokenizer.encode("Reply in JSON, please, with a name, an age, a pet and tags: ").ids
    for i in range(6):
        p = SamplingParams(temperature=1.0, max_tokens=150, seed=200 + i, grammar=grammar)
        eng.add_request(GenerateRequest(request_id=f"p{i}", prompt_ids=prompt, params=p.to_dict()))
    texts, done = {}, {}
    while eng.has_work:
        for o in eng.step():
            texts[o.request_id] = texts.get(o.request_id, "") + o.text
            if o.finish_reason is not None:
                done[o.request_id] = (o.finish_reason, o.error)
    assert preempted, "no preemption: the test would not test it"
    assert all(r == ("stop", None) for r in done.values()) and len(done) == 6, done
    for text in texts.values():
        jsonschema.validate(json.loads(text), SCHEMA)
