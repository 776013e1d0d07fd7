"""The retrieval record builder (scripts/retrieval_records.py): exact lengths, the target at its depth, one answer
that only the target fact gives, determinism, and the exact-match rule."""
from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer

from cluster.config import DEFAULT_MODEL
from scripts.retrieval_records import (build_eval_records, build_record, is_correct, plant_training_records,
                                       _fact)


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_file(f"{DEFAULT_MODEL}/tokenizer.json")


@pytest.fixture(scope="module")
def held(tok):
    return open(f"{DEFAULT_MODEL}/heldout/prose.txt").read()[:40000]


def _find(seq, sub):
    for i in range(len(seq) - len(sub) + 1):
        if list(seq[i:i + len(sub)]) == sub:
            return i
    return -1


@pytest.mark.parametrize("context,depth", [(512, 0.0), (512, 0.5), (1024, 0.9), (1024, 1.0)])
def test_record_is_exactly_context_long_with_the_target_at_its_depth(tok, held, context, depth):
    ids = tok.encode(held).ids
    r = build_record(tok, ids, context, depth, random.Random(3))
    assert len(r.prompt_ids) == context
    text = tok.decode(list(r.prompt_ids))
    assert text.endswith(f"Answer: The {r.key} code is")
    assert text.count(f"The {r.key} code is {r.answer}.") == 1  # asked once, stated once
    fact = tok.encode(_fact(r.key, r.answer)).ids
    at = _find(r.prompt_ids, fact)
    q_len = len(tok.encode(f"\nQuestion: what is the {r.key} code?\nAnswer: The {r.key} code is").ids)
    assert at == round(depth * (context - q_len - len(fact)))


def test_eval_records_are_deterministic_and_cover_every_cell(tok, held):
    a = build_eval_records(tok, held, [256, 512], [0.1, 0.9], 3, seed=7)
    b = build_eval_records(tok, held, [256, 512], [0.1, 0.9], 3, seed=7)
    assert a == b and len(a) == 12
    assert [(r.context, r.depth) for r in a[::3]] == [(256, 0.1), (256, 0.9), (512, 0.1), (512, 0.9)]
    assert build_eval_records(tok, held, [256], [0.5], 3, seed=8) != build_eval_records(tok, held, [256], [0.5], 3,
                                                                                          seed=7)


def test_training_window_keeps_its_length_and_answers_every_fact(tok, held):
    ids = tok.encode(held).ids[:1025]
    out = plant_training_records(tok, ids, random.Random(0), n_facts=4)
    assert len(out) == 1025
    text = tok.decode(out)
    assert text.count("Question: what is the") == 4
    for line in text.split("\nAnswer: ")[1:]:
        key, value = line.split(" code is ")[0][4:], line.split(" code is ")[1][:5]
        assert f"\nThe {key} code is {value}.\n" in text


def test_exact_match():
    assert is_correct(" 12345.", "12345") and is_correct("12345", "12345")
    assert not is_correct(" 123456", "12345") and not is_correct(" 1234", "12345") and not is_correct("x", "12345")
    with pytest.raises(ValueError, match="depth"):
        build_record(None, [], 10, 1.5, random.Random(0))


def test_answer_mask_marks_each_answer_value_and_nothing_else(tok, held):
    ids = tok.encode(held).ids[:1025]
    out, mask = plant_training_records(tok, ids, random.Random(3), n_facts=3, answer_mask=True)
    assert out == plant_training_records(tok, ids, random.Random(3), n_facts=3)  # same window either way
    assert len(mask) == len(out)
    marked = tok.decode([t for t, m in zip(out, mask) if m])
    answers = [line.split(" code is ")[1][:5] for line in tok.decode(out).split("\nAnswer: ")[1:]]
    assert marked.replace(".\n", "").split() == answers  # the values (and their ".\n"), in question order


def test_repeats_copy_earlier_spans_and_mark_the_predictable_tokens(tok, held):
    from scripts.retrieval_records import plant_repeats

    ids = tok.encode(held).ids[:1024]
    out, mask = plant_repeats(ids, random.Random(4), n_spans=3, lo=8, hi=16)
    assert len(out) == len(mask) == 1024 and 3 * 15 >= sum(mask) >= 7  # 3 spans of 8-16 tokens, each less its first
    i = mask.index(True)  # the first marked token continues a copy of an earlier span: its context occurs before
    assert any(out[j:j + 2] == out[i - 1:i + 1] for j in range(i - 1))
    with pytest.raises(ValueError, match="too short"):
        plant_repeats(ids[:40], random.Random(0), 1, hi=16)


def test_repeated_random_repeats_one_sequence_and_masks_all_but_the_first_copy(tok, held):
    from scripts.retrieval_records import repeated_random

    stream = tok.encode(held).ids
    ids, mask = repeated_random(stream, 257, random.Random(3), lo=8, hi=40)
    m = mask.index(True)
    assert len(ids) == len(mask) == 257 and 8 <= m <= 40 and not any(mask[:m]) and all(mask[m:])
    assert all(ids[i] == ids[i - m] for i in range(m, 257)) and set(ids) <= set(stream)
    with pytest.raises(ValueError, match="too short"):
        repeated_random(stream, 15, random.Random(0), lo=8)
