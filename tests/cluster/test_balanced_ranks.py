"""`balanced` gating does not depend on the rank count: 8 concurrent prompts x 64 greedy tokens on the shipped
model give the same tokens on 1, 2 and 3 ranks, every rank ending with the same balancing bias.

Each rank's `balanced` expert load is summed over the EP group in the lockstep agreement of the next step
(`actors.rank.lockstep`), so the bias, and with it every token's experts, depends only on the traffic
balanced over. That traffic must be the same on every rank count: `LLM.generate` wakes the ranks once after
submitting every prompt, so all 8 start in step 0, and the test checks it (each rank ran exactly 64 steps)."""
from __future__ import annotations

import pytest

from actors.engine.sampling import SamplingParams
from cluster.config import DEFAULT_MODEL
from moeray import LLM

PROMPTS = ["To be, or not to be", "def add(a, b):", "ROMEO. But soft,", "import os\nimport sys",
           "Now is the winter of our discontent", "for i in range(10):", "KING. What", "class Node:"]
TOKENS = 64


def _run(ranks: int) -> tuple[list[list[int]], dict]:
    with LLM(model=DEFAULT_MODEL, ranks=ranks, engine_options={"gating": "balanced"}, max_model_len=128,
             kv_cache_bytes=4 << 20, max_num_seqs=8) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True))
        assert all(o.error is None and len(o.token_ids) == TOKENS for o in outs)
        return [o.token_ids for o in outs], llm.stats()


def test_balanced_gives_the_same_tokens_on_1_2_and_3_ranks(ray_session):
    one, s1 = _run(1)
    assert s1["ranks"][0]["steps"] == TOKENS
    want_bias = s1["ranks"][0]["routing"]["bias_absmax"]
    assert want_bias > 0  # the bias moved (on this traffic it changes 5 of the 8 prompts' tokens against `exact`)
    for ranks in (2, 3):
        got, s = _run(ranks)
        assert got == one, f"{ranks} ranks: tokens differ from 1 rank"
        # all 8 prompts admitted in step 0 on every rank: prefill + 63 decode steps, no step more
        assert [r["steps"] for r in s["ranks"]] == [TOKENS] * ranks
        assert [r["routing"]["bias_absmax"] for r in s["ranks"]] == [want_bias] * ranks
