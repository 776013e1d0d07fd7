"""Logit controls on the rank (`actors.engine.penalties`): logit_bias, min_tokens, repetition_penalty,
presence_penalty and frequency_penalty against transformers' logits processors (`SequenceBiasLogitsProcessor`,
`MinNewTokensLengthLogitsProcessor`, `RepetitionPenaltyLogitsProcessor`) and OpenAI's formula by hand, on the
logits the engine sees at each step; rows without controls in a mixed batch get exactly the tokens they get alone;
logprobs stay those of the raw logits; stop strings wait for min_tokens; bad values are refused naming the field."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import actors.engine.engine as engine_mod
from actors.engine.detokenizer import IncrementalDetokenizer
from actors.engine.messages import GenerateRequest
from actors.engine.penalties import SequenceControls, apply_controls
from actors.engine.sampler import make_generator, sample
from actors.engine.sampling import SamplingParams
from tests.actors.engine.test_chunked_prefill import _engine
from tests.actors.engine.test_logprobs import _run

PROMPT = "ROMEO. O, she doth teach the torches to burn bright! It seems she hangs"
EOS = 0


def _reference(x_V: torch.Tensor, p: SamplingParams, prompt: list[int], out: list[int], eos: set[int]) -> torch.Tensor:
    """The controlled logits [V] by transformers' processors (bias, min new tokens, repetition) and OpenAI's
    presence / frequency formula by hand, in vLLM's order."""
    from transformers import (MinNewTokensLengthLogitsProcessor, RepetitionPenaltyLogitsProcessor,
                              SequenceBiasLogitsProcessor)

    ids = torch.tensor([prompt + out])
    s = x_V.float().clone().unsqueeze(0)
    if p.logit_bias:
        s = SequenceBiasLogitsProcessor({(t,): b for t, b in p.logit_bias.items()})(ids, s)
    if p.min_tokens:
        stop = sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else eos))
        s = MinNewTokensLengthLogitsProcessor(len(prompt), p.min_tokens, stop)(ids, s)
    if p.repetition_penalty != 1.0:
        s = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, s)
    for t in set(out):
        s[0, t] -= p.frequency_penalty * out.count(t) + p.presence_penalty
    return s[0]


CASES = {
    "bias": dict(logit_bias={5: 3.5, 17: -100.0, 200: 7.25}),
    "min_tokens": dict(min_tokens=3, stop_token_ids=[11, 12]),
    "repetition": dict(repetition_penalty=1.7),
    "repetition_below_1": dict(repetition_penalty=0.6),
    "presence_frequency": dict(presence_penalty=0.7, frequency_penalty=0.45),
    "negative_penalties": dict(presence_penalty=-1.5, frequency_penalty=-0.3),
    "all": dict(logit_bias={3: 2.0, 9: -4.0}, min_tokens=2, repetition_penalty=1.3, presence_penalty=0.5,
                frequency_penalty=1.25, stop_token_ids=[7]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_apply_controls_equals_transformers_processors_incrementally(case):
    g = torch.Generator().manual_seed(1)
    V, prompt = 300, [4, 9, 9, 150, 3]
    p = SamplingParams(temperature=0, max_tokens=20, **CASES[case])
    out: list[int] = []
    c = SequenceControls.of(p, prompt, out, {EOS})
    for step in range(8):  # the state follows the output as it grows (repeats included)
        x = torch.randn(V, generator=g) * 4
        x[7] = x[11] = x[EOS] = 30.0  # the stop ids would win while min_tokens masks them
        xs = np.stack([np.zeros(V, np.float32), x.numpy()])
        apply_controls(xs, [1], [c])
        assert not xs[0].any()  # rows not named are left alone
        ref = _reference(x, p, prompt, out, {EOS})
        assert torch.allclose(torch.from_numpy(xs[1]), ref, atol=1e-5, rtol=1e-6, equal_nan=True), (case, step)
        out += [int(torch.randint(0, 20, (1,), generator=g))] + ([9] if step % 3 == 0 else [])


def test_no_controls_is_none_and_bad_row_fails_alone():
    assert SequenceControls.of(SamplingParams(), [1], [], {EOS}) is None
    x = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    raw = x.clone()
    ps = [SamplingParams(temperature=0), SamplingParams(temperature=0, logit_bias={60: 1.0}),
          SamplingParams(temperature=0, logit_bias={int(x[2].argmin()): 100.0})]
    ctl = [None] + [SequenceControls.of(p, [1, 2], [], {EOS}) for p in ps[1:]]
    toks, errors = sample(x, ps, [None] * 3, ctl)
    assert list(errors) == [1] and "logit controls" in errors[1]  # an id >= V (the router refuses it first)
    assert toks == [int(raw[0].argmax()), -1, int(raw[2].argmin())]
    assert torch.equal(x, raw)  # the caller's logits stay raw


def _tokens(outs: list) -> list[int]:
    return [t for o in outs for t in o.token_ids]


def test_engine_rows_follow_the_processors_and_plain_rows_are_untouched(monkeypatch):
    """Every step, each controlled row's token is the greedy / seeded draw from the reference-processed logits the
    engine saw; the plain rows of the same batch get the tokens they get alone; logprobs are the raw ones."""
    seen: list = []

    def spy(logits, params, gens, controls=None, grammars=None):
        states = [None if g is None else g.getstate() for g in gens]
        outs = [list(c.output_ids) if c is not None else None for c in (controls or [None] * len(params))]
        toks, errors = sample(logits, params, gens, controls, grammars)
        seen.append((logits.clone(), list(params), states, outs, toks))
        return toks, errors

    monkeypatch.setattr(engine_mod, "sample", spy)
    eng = _engine(max_batched_tokens=16)
    ids = eng.tokenizer.encode(PROMPT).ids
    reqs = {"plain": SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
            "plain_sampled": SamplingParams(temperature=1.0, seed=5, max_tokens=8, ignore_eos=True),
            "rep": SamplingParams(temperature=0, max_tokens=8, repetition_penalty=1.8, logprobs=1, ignore_eos=True),
            "pf": SamplingParams(temperature=0.8, seed=2, max_tokens=8, presence_penalty=1.5, frequency_penalty=0.9,
                                 logit_bias={int(ids[3]): 5.0}, ignore_eos=True)}
    outs = _run(eng, reqs, ids)
    checked = 0
    for logits, params, states, prev, toks in seen:
        for i, p in enumerate(params):
            if prev[i] is None:
                continue
            ref = _reference(logits[i], p, ids, prev[i], {EOS})
            if p.temperature == 0:
                assert toks[i] == int(ref.argmax())
            else:
                g = make_generator(None)
                g.setstate(states[i])
                assert toks[i] == sample(ref.unsqueeze(0), [p], [g])[0][0]
            checked += 1
    assert checked == 16
    alone = _run(_engine(max_batched_tokens=16), {k: reqs[k] for k in ("plain", "plain_sampled")}, ids)
    for k in ("plain", "plain_sampled"):
        assert _tokens(outs[k]) == _tokens(alone[k])
    rep = _tokens(outs["rep"])
    assert rep != _tokens(outs["plain"])  # the penalty changed the output (else this test could not fail)
    lps = [e for o in outs["rep"] for e in (o.logprobs or [])]
    assert len(lps) == len(rep)
    # raw logprobs: each token's is log_softmax of the raw logits of the step that sampled it, not the penalized
    steps = [(s[0][s[1].index(reqs["rep"])], s[4][s[1].index(reqs["rep"])]) for s in seen if reqs["rep"] in s[1]]
    assert [t for _, t in steps] == rep
    assert max(abs(e[0] - float(torch.log_softmax(x.float(), -1)[t])) for e, (x, t) in zip(lps, steps)) < 1e-5


def test_min_tokens_holds_eos_and_stop_token_ids():
    eng = _engine(max_batched_tokens=16)
    ids = eng.tokenizer.encode(PROMPT).ids
    stop = 42
    reqs = {"eos_now": SamplingParams(temperature=0, max_tokens=8, logit_bias={EOS: 100.0}),
            "eos_after_3": SamplingParams(temperature=0, max_tokens=8, logit_bias={EOS: 100.0}, min_tokens=3),
            "stop_after_2": SamplingParams(temperature=0, max_tokens=8, logit_bias={stop: 100.0}, min_tokens=2,
                                           stop_token_ids=[stop])}
    outs = _run(eng, reqs, ids)
    assert _tokens(outs["eos_now"]) == [] and outs["eos_now"][-1].finish_reason == "stop"
    t3 = _tokens(outs["eos_after_3"])
    assert len(t3) == 3 and EOS not in t3 and outs["eos_after_3"][-1].finish_reason == "stop"
    t2 = _tokens(outs["stop_after_2"])
    assert len(t2) == 3 and t2[2] == stop and stop not in t2[:2] and outs["stop_after_2"][-1].finish_reason == "stop"


def test_stop_strings_wait_for_min_tokens():
    eng = _engine()
    tok = eng.tokenizer
    ids = tok.encode(" ab ab ab cd").ids
    n_first = len(tok.encode(" ab").ids)

    def run(min_tokens):
        d = IncrementalDetokenizer(tok, ["ab"], min_tokens)
        text, k = "", 0
        for k, t in enumerate(ids, 1):
            delta, stopped = d.add(t)
            text += delta
            if stopped:
                return text, k
        return text + d.flush(), None

    assert run(0) == (" ", n_first)
    text, k = run(n_first)  # the first " ab" is released; the next "ab" stops
    assert text == " ab " and k is not None and k > n_first


@pytest.mark.parametrize("kw,field", [
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(min_tokens=17), "min_tokens"),
    (dict(logit_bias={1: 101.0}), "logit_bias"), (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={i: 1.0 for i in range(301)}), "logit_bias")])
def test_bad_controls_name_the_field(kw, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        SamplingParams(max_tokens=16, **kw)


def test_controls_cross_the_wire_to_the_rank():
    """Router -> rank: the msgpack `GenerateRequest` carries the controls (logit_bias keys stay token ids)."""
    p = SamplingParams(max_tokens=9, presence_penalty=0.25, frequency_penalty=-1.0, repetition_penalty=1.1,
                       logit_bias={7: -2.5, 4095: 100.0}, min_tokens=9, stop_token_ids=[3])
    got = GenerateRequest.decode(GenerateRequest(request_id="a", prompt_ids=[1], params=p.to_dict()).encode())
    assert SamplingParams.from_dict(got.params) == p
    assert SamplingParams(logit_bias={"12": 1}).logit_bias == {12: 1.0}  # JSON-style keys are parsed
