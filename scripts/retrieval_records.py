"""Retrieval records: key-value facts planted at chosen depths in real text, asked for at the end.

One builder serves both sides, so that what the model is trained on and what it is measured on have one form:
  * training (`scripts/train_tiny_moe.py`): `plant_training_records` turns about a tenth of the training
    windows (Shakespeare / CPython text) into retrieval windows of the same length;
  * evaluation (`bench/kv_quality.py --retrieval`): `build_eval_records` builds records from the held-out
    texts (never trained on), the same records for every KV width.

A record is a few facts `\\nThe {key} code is {value}.\\n` (value: 5 random digits; key: an adjective-noun pair,
one of `len(ADJECTIVES) * len(NOUNS)`) planted in the text, then a question that names one key and ends where
the value should follow: `\\nQuestion: what is the {key} code?\\nAnswer: The {key} code is`. The other facts
are distractors with other keys. This is the key-value / passkey family of long-context probes (Mohtashami &
Jaggi, "Landmark Attention", arXiv 2305.16300, passkey; Liu et al., "Lost in the Middle", arXiv 2307.03172,
key-value retrieval), in words this model's byte-level BPE reads. A completion is correct when its text,
stripped of leading spaces, starts with the 5 digits (`is_correct`): exact match.

Invariants: the target fact starts at `depth` of the filler (a fraction of the context in tokens, 0 = first
token); a record's prompt is exactly `context` tokens; the same (text, seed, cell) gives the same records.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

ADJECTIVES = ("amber", "bitter", "silent", "golden", "hollow", "crimson", "gentle", "frozen", "hidden", "ancient",
              "brave", "quiet", "northern", "wild", "pale", "iron")
NOUNS = ("river", "falcon", "lantern", "harbor", "meadow", "tower", "garden", "forest", "mirror", "anchor",
         "castle", "shadow", "bridge", "island", "crown", "engine")


@dataclass(frozen=True)
class RetrievalRecord:
    """One evaluation record. prompt_ids: exactly `context` token ids (filler with facts, then the question);
    answer: the 5-digit value asked for; depth: where the target fact starts, as a fraction of the context."""

    prompt_ids: tuple[int, ...]
    answer: str
    key: str
    context: int
    depth: float


def _fact(key: str, value: str) -> str:
    return f"\nThe {key} code is {value}.\n"


def _question(key: str) -> str:
    return f"\nQuestion: what is the {key} code?\nAnswer: The {key} code is"


def _draw(rng: random.Random, n: int) -> list[tuple[str, str]]:
    """n facts with distinct keys: [(key, value)], values 5 digits with no leading zero."""
    keys = rng.sample([f"{a} {b}" for a in ADJECTIVES for b in NOUNS], n)
    return [(k, str(rng.randrange(10000, 100000))) for k in keys]


def _encode(tok, text: str) -> list[int]:
    return list(tok.encode(text).ids)


def _plant(filler: Sequence[int], inserts: list[tuple[int, list[int]]]) -> list[int]:
    """filler with each (position, ids) inserted before filler[position]; positions in filler coordinates."""
    out, at = [], 0
    for pos, ids in sorted(inserts, key=lambda p: p[0]):
        out.extend(filler[at:pos])
        out.extend(ids)
        at = pos
    out.extend(filler[at:])
    return out


def build_record(tok, filler_ids: Sequence[int], context: int, depth: float, rng: random.Random,
                 n_distractors: int = 3) -> RetrievalRecord:
    """One record of exactly `context` tokens from `filler_ids` (a token stream at least `context` long).

    tok: a `tokenizers.Tokenizer`; depth in [0, 1]: where the target fact starts (fraction of the context);
    distractor facts go at uniformly random depths. Raises ValueError if the filler is too short or depth is
    outside [0, 1].
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth={depth} must be in [0, 1]")
    facts = _draw(rng, 1 + n_distractors)
    key, value = facts[0]
    fact_ids = [_encode(tok, _fact(k, v)) for k, v in facts]
    q_ids = _encode(tok, _question(key))
    n_fill = context - len(q_ids) - sum(len(f) for f in fact_ids)
    if n_fill < 16 or len(filler_ids) < n_fill:
        raise ValueError(f"filler of {len(filler_ids)} tokens cannot make a {context}-token record")
    start = rng.randrange(0, len(filler_ids) - n_fill + 1)
    filler = list(filler_ids[start:start + n_fill])
    # the target starts exactly at `want`: the distractors drawn before it, then filler up to `want`, go first
    want = int(round(depth * (context - len(q_ids) - len(fact_ids[0]))))
    before, after = [], []
    for ids in fact_ids[1:]:
        side = before if rng.random() < depth and sum(map(len, before)) + len(ids) <= want else after
        side.append(ids)
    n_before = want - sum(map(len, before))
    head, tail = filler[:n_before], filler[n_before:]
    prompt = (_plant(head, [(rng.randrange(0, len(head) + 1), ids) for ids in before]) + fact_ids[0]
              + _plant(tail, [(rng.randrange(0, len(tail) + 1), ids) for ids in after]) + q_ids)
    assert len(prompt) == context, (len(prompt), context)
    return RetrievalRecord(tuple(prompt), value, key, context, depth)


def build_eval_records(tok, text: str, contexts: Sequence[int], depths: Sequence[float], per_cell: int,
                       seed: int = 0) -> list[RetrievalRecord]:
    """`per_cell` records for every (context, depth) from held-out `text`, deterministic in `seed`.

    Returns them context-major, then depth, then index. Raises ValueError if the text is shorter than the
    largest context.
    """
    ids = _encode(tok, text)
    out = []
    for c in contexts:
        for d in depths:
            rng = random.Random(f"{seed}:{c}:{d}")
            out.extend(build_record(tok, ids, c, d, rng) for _ in range(per_cell))
    return out


def plant_training_records(tok, window_ids: Sequence[int], rng: random.Random, n_facts: int = 4,
                           answer_mask: bool = False):
    """A training window of the same length with `n_facts` facts planted at random depths and, at its end,
    a question and answer for each (in random order): `... Answer: The {key} code is {value}.` The model is
    trained on the whole window (next-token loss everywhere), so the answers carry the retrieval signal.

    Returns the window's token ids, or with `answer_mask` (ids, mask): mask[i] is True where ids[i] is a token
    of an answer's value (what a training loss may weight up). Raises ValueError if the window is too short
    for the facts and questions.
    """
    facts = _draw(rng, n_facts)
    fact_ids = [_encode(tok, _fact(k, v)) for k, v in facts]
    order = list(range(n_facts))
    rng.shuffle(order)
    qa, qa_mask = [], []
    for i in order:
        k, v = facts[i]
        q = _encode(tok, _question(k))
        a = _encode(tok, _question(k) + f" {v}.\n")
        qa.extend(a)  # encoded whole (as the eval prompt is followed by the answer); value tokens after the question's
        qa_mask.extend([False] * len(q) + [True] * (len(a) - len(q)))
    n_fill = len(window_ids) - len(qa) - sum(len(f) for f in fact_ids)
    if n_fill < 16:
        raise ValueError(f"a window of {len(window_ids)} tokens is too short for {n_facts} facts")
    filler = list(window_ids[:n_fill])
    inserts = [(rng.randrange(0, n_fill + 1), ids) for ids in fact_ids]
    ids = _plant(filler, inserts) + qa
    if not answer_mask:
        return ids
    return ids, [False] * (len(ids) - len(qa)) + qa_mask


def plant_repeats(window_ids: Sequence[int], rng: random.Random, n_spans: int, lo: int = 8,
                  hi: int = 48) -> tuple[list[int], list[bool]]:
    """The window with `n_spans` spans of its own text (lo..hi tokens, from anywhere before) copied over later
    positions, the same length: the pattern an induction head completes ("[A][B] ... [A] -> [B]", Olsson et
    al. 2022, arXiv 2209.11895), which the planted records' retrieval needs and which a model trained on a
    few million tokens has not formed. mask[i] is True where ids[i] is a copied token after its span's first
    (predictable from the earlier occurrence). Raises ValueError if the window is shorter than 4 * hi.
    """
    ids, mask = list(window_ids), [False] * len(window_ids)
    if len(ids) < 4 * hi:
        raise ValueError(f"a window of {len(ids)} tokens is too short for spans of up to {hi} tokens")
    for _ in range(n_spans):
        m = rng.randint(lo, hi)
        dst = rng.randrange(m + 1, len(ids) - m + 1)
        src = rng.randrange(0, dst - m + 1)
        ids[dst:dst + m] = ids[src:src + m]
        mask[dst + 1:dst + m] = [True] * (m - 1)
    return ids, mask


def repeated_random(stream: Sequence[int], length: int, rng: random.Random, lo: int = 8,
                    hi: int | None = None) -> tuple[list[int], list[bool]]:
    """A window of `length` tokens: one sequence of lo..hi tokens drawn at random positions of `stream` (so with
    the text's unigram frequencies, in no order) repeated until the window is full. Nothing but copying from the
    earlier repeat predicts a token after the first repeat, so this is the plainest induction-head task (the
    "repeated random tokens" probe of Olsson et al. 2022, arXiv 2209.11895, used as training data).

    Returns (ids, mask): mask[i] is True for every token after the first repeat. hi defaults to length // 2.
    Raises ValueError if length < 2 * lo.
    """
    hi = length // 2 if hi is None else hi
    if length < 2 * lo or hi < lo:
        raise ValueError(f"a window of {length} tokens is too short for repeats of {lo}..{hi} tokens")
    m = rng.randint(lo, hi)
    seq = [int(stream[rng.randrange(len(stream))]) for _ in range(m)]
    ids = (seq * (length // m + 1))[:length]
    return ids, [i >= m for i in range(length)]


def is_correct(completion: str, answer: str) -> bool:
    """Exact match: the completion, leading whitespace stripped, starts with the answer's digits and the
    next character (if any) is not a digit."""
    s = completion.lstrip()
    return s.startswith(answer) and not s[len(answer):len(answer) + 1].isdigit()
