"""Sampling parameters, seeded sampling, top-k/top-p, stop strings and incremental detokenization."""
from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer

from actors.engine.detokenizer import IncrementalDetokenizer
from actors.engine.sampling import SamplingParams, sample


@pytest.mark.parametrize("kw,field", [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"),
                                      ({"top_p": 1.5}, "top_p"), ({"max_tokens": 0}, "max_tokens"),
                                      ({"top_k": -2}, "top_k"), ({"stop": [""]}, "stop")])
def test_invalid_params_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


def test_seeded_sampling_is_reproducible_and_respects_top_k_top_p():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    p = SamplingParams(temperature=0.9, top_k=5, top_p=0.9, seed=7)
    draws = []
    for _ in range(2):
        gens = [torch.Generator().manual_seed(7) for _ in range(3)]
        draws.append([sample(logits, [p] * 3, gens) for _ in range(20)])
    assert draws[0] == draws[1]
    top5 = torch.topk(logits, 5).indices
    for step in draws[0]:
        for r, tok in enumerate(step):
            assert tok in top5[r].tolist()
    # top_p tiny -> always the argmax
    gens = [torch.Generator().manual_seed(1)]
    assert all(sample(logits[:1], [SamplingParams(temperature=1.0, top_p=1e-6)], gens)[0] == int(logits[0].argmax())
               for _ in range(10))


def _tok(tiny_model_dir) -> Tokenizer:
    return Tokenizer.from_file(tiny_model_dir("qwen2_moe", num_layers=3) + "/tokenizer.json")


def test_detokenizer_deltas_concatenate_to_decode_and_no_replacement_char(tiny_model_dir):
    tok = _tok(tiny_model_dir)
    text = "héllo wörld — 日本語 ✓ done"
    ids = tok.encode(text).ids
    d = IncrementalDetokenizer(tok)
    deltas = [d.add(i)[0] for i in ids] + [d.flush()]
    assert all("\ufffd" not in x for x in deltas)
    assert "".join(deltas) == tok.decode(ids)


def test_stop_string_held_back_and_excluded(tiny_model_dir):
    tok = _tok(tiny_model_dir)
    text = "alpha beta STOP gamma"
    ids = tok.encode(text).ids
    d = IncrementalDetokenizer(tok, stop=["STOP", "zz"])
    deltas, stopped = [], False
    for i in ids:
        delta, stopped = d.add(i)
        deltas.append(delta)
        assert "S" not in "".join(deltas) or stopped  # nothing that may start the stop string leaks early
        if stopped:
            break
    assert stopped and "".join(deltas) == "alpha beta "


def test_detokenizer_final_text_equals_decode_when_cut_mid_character(tiny_model_dir):
    tok = _tok(tiny_model_dir)
    ids = tok.encode("ab日本").ids
    # cut inside the last character: the byte-level pieces of '本' span more than one token, or
    # at least the last token carries an incomplete byte sequence once its final byte is dropped
    cut = next((n for n in range(len(ids), 0, -1) if tok.decode(ids[:n]).endswith("\ufffd")), None)
    if cut is None:
        import pytest

        pytest.skip("tokenizer keeps every character of this text in one token")
    d = IncrementalDetokenizer(tok)
    deltas = [d.add(i)[0] for i in ids[:cut]] + [d.flush()]
    assert all("\ufffd" not in x for x in deltas[:-1])
    assert "".join(deltas) == tok.decode(ids[:cut])
