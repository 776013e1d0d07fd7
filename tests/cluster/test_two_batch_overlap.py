"""Two-batch overlap through the lockstep loop (`actors.rank.lockstep`: the agreed step size and the sixth flag,
"any rank has a prefill"): 2 ranks on gloo alone (`transport="torch"`; the same-node shared memory has no split
all-to-all), 8 greedy prompts with `balanced` gating (its load rides after the flags in the same agreement), give
the same tokens with two_batch_overlap on as with it off and on one rank, and every decode step ran as two
micro-batches on both ranks (the prefill step did not)."""
from __future__ import annotations

from actors.engine.sampling import SamplingParams
from cluster.config import DEFAULT_MODEL
from moeray import LLM

PROMPTS = ["To be, or not to be", "def add(a, b):", "ROMEO. But soft,", "import os\nimport sys",
           "Now is the winter of our discontent", "for i in range(10):", "KING. What", "class Node:"]
TOKENS = 12


def _run(ranks: int, tbo: bool) -> tuple[list[list[int]], dict]:
    # tbo_min_batch 4: 8 prompts over 2 ranks are 4 sequences per rank
    opts = {"gating": "balanced", "two_batch_overlap": tbo, "tbo_min_batch": 4}
    with LLM(model=DEFAULT_MODEL, ranks=ranks, engine_options=opts, max_model_len=128, kv_cache_bytes=4 << 20,
             max_num_seqs=8, transport="torch") as llm:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True))
        assert all(o.error is None and len(o.token_ids) == TOKENS for o in outs)
        return [o.token_ids for o in outs], llm.stats()


def test_two_batch_overlap_through_the_lockstep_loop(ray_session):
    one, _ = _run(1, False)
    off, s_off = _run(2, False)
    on, s_on = _run(2, True)
    assert off == one and on == one
    assert [r["two_batch_steps"] for r in s_off["ranks"]] == [0, 0]
    assert [r["steps"] for r in s_on["ranks"]] == [TOKENS] * 2  # one prefill step, then TOKENS - 1 decode steps
    assert [r["two_batch_steps"] for r in s_on["ranks"]] == [TOKENS - 1] * 2
