"""Logprobs on the rank (`actors.engine.logprobs`): the shipped model's sampled-token and prompt-token
log-probabilities, top-k alternatives and ranks equal transformers' log_softmax of its fp32 logits (< 1e-4;
measured ~5e-6), for greedy and sampled tokens, with prompts split in prefill chunks (budget 16 < prompt
length), with `max_tokens=0` (the prompt only), batched with a request that asks for nothing (whose outputs
carry none and whose tokens are those it gets alone)."""
from __future__ import annotations

import pytest
import torch

from actors.engine.messages import GenerateRequest
from actors.engine.sampling import SamplingParams
from cluster.config import DEFAULT_MODEL
from tests.actors.engine.test_chunked_prefill import _engine

PROMPT = "ROMEO. O, she doth teach the torches to burn bright! It seems she hangs"
TOL = 1e-4


def _run(eng, reqs: dict[str, SamplingParams], ids: list[int]) -> dict[str, list]:
    for k, p in reqs.items():
        eng.add_request(GenerateRequest(request_id=k, prompt_ids=ids, params=p.to_dict()))
    outs: dict[str, list] = {k: [] for k in reqs}
    while eng.has_work:
        for o in eng.step():
            outs[o.request_id].append(o)
    return outs


@pytest.fixture(scope="module")
def hf():
    from tests.tiny_models import load_hf

    return load_hf(DEFAULT_MODEL)


def _check_entry(e: list, ref_V: torch.Tensor, target: int, k: int) -> float:
    """Max abs diff of one [logprob, rank, top_ids, top_logprobs] entry against reference log-probs [V]."""
    assert len(e[2]) == len(e[3]) == k
    assert e[1] == int((ref_V > ref_V[target]).sum()) + 1
    tv, ti = ref_V.topk(k)
    diff = max([abs(e[0] - float(ref_V[target]))] + [abs(a - b) for a, b in zip(e[3], tv.tolist())])
    # ids agree where the reference's values are apart (a near-tie may order either way)
    for j, (a, b) in enumerate(zip(e[2], ti.tolist())):
        if a != b:
            assert abs(float(ref_V[a]) - float(ref_V[b])) < TOL, (j, a, b)
    assert e[3] == sorted(e[3], reverse=True)
    return diff


def test_logprobs_match_transformers(hf):
    eng = _engine(max_batched_tokens=16)
    ids = eng.tokenizer.encode(PROMPT).ids
    assert len(ids) > 16  # the prompt is prefilled in chunks
    reqs = {"greedy": SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5, prompt_logprobs=3),
            "sampled": SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True, logprobs=2),
            "prompt_only": SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=0),
            "plain": SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)}
    outs = _run(eng, reqs, ids)
    alone = _run(_engine(max_batched_tokens=16), {"plain": reqs["plain"]}, ids)["plain"]
    assert [o.token_ids for o in outs["plain"]] == [o.token_ids for o in alone]
    assert all(o.logprobs is None and o.prompt_logprobs is None for o in outs["plain"])
    assert [(o.token_ids, o.finish_reason) for o in outs["prompt_only"]] == [([], "length")]
    worst = 0.0
    for k in ("greedy", "sampled", "prompt_only"):
        p, os_ = reqs[k], outs[k]
        toks = [t for o in os_ for t in o.token_ids]
        assert len(toks) == p.max_tokens
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([ids + toks])).logits[0].float(), dim=-1)
        if p.logprobs is not None:
            assert all(len(o.logprobs) == len(o.token_ids) for o in os_)
            lps = [e for o in os_ for e in o.logprobs]
            for j, e in enumerate(lps):
                worst = max(worst, _check_entry(e, ref[len(ids) - 1 + j], toks[j], p.logprobs))
            if p.temperature == 0:
                assert all(e[1] == 1 for e in lps)  # greedy takes the most probable token
        else:
            assert all(o.logprobs is None for o in os_)
        plp = [o.prompt_logprobs for o in os_ if o.prompt_logprobs is not None]
        if p.prompt_logprobs is None:
            assert plp == []
            continue
        assert len(plp) == 1 and os_[0].prompt_logprobs is plp[0]  # in the first output only
        assert len(plp[0]) == len(ids) and plp[0][0] is None
        for t in range(1, len(ids)):
            worst = max(worst, _check_entry(plp[0][t], ref[t - 1], ids[t], p.prompt_logprobs))
    assert worst < TOL, worst


def test_logprob_limits_name_the_field():
    for name in ("logprobs", "prompt_logprobs"):
        for bad in (21, -1, True, 1.5):
            with pytest.raises(ValueError, match=f"{name}="):
                SamplingParams(**{name: bad})
        assert getattr(SamplingParams(**{name: 20}), name) == 20
    with pytest.raises(ValueError, match="max_tokens="):
        SamplingParams(max_tokens=-1)
