"""The EP cluster on Ray: 2 ranks equal 1 rank, streaming, bad input, idle ranks do not spin."""
from __future__ import annotations

import re
import time

import psutil
import pytest

from actors.engine.sampling import SamplingParams
from moeray import LLM

PROMPTS = ["To be, or not to be", "def add(a, b):", "The quick brown fox", "x"]


@pytest.fixture(scope="module")
def model_path(tiny_model_dir):
    return tiny_model_dir("qwen2_moe", num_layers=3)


@pytest.fixture(scope="module")
def llm2(ray_session, model_path):
    llm = LLM(model=model_path, ranks=2, max_model_len=128, kv_cache_bytes=4 << 20)
    yield llm
    llm.shutdown()


def test_two_ranks_equal_one_rank(ray_session, model_path, llm2):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    two = llm2.generate(PROMPTS, params)
    with LLM(model=model_path, ranks=1, max_model_len=128, kv_cache_bytes=4 << 20) as llm1:
        one = llm1.generate(PROMPTS, params)
    assert [o.token_ids for o in two] == [o.token_ids for o in one]
    assert all(len(o.token_ids) == 16 and o.finish_reason == "length" for o in two)
    # one node: the decode step's small all-to-alls went through shared memory
    assert [r["transport"] for r in llm2.cluster.info] == ["shm+gloo"] * 2
    from kernels.cpu import cpu_kernels_available  # each rank reports whether its fast path runs

    assert [r["cpu_kernels"] for r in llm2.cluster.info] == [cpu_kernels_available()] * 2
    with LLM(model=model_path, ranks=2, max_model_len=128, kv_cache_bytes=4 << 20, transport="torch") as gloo:
        assert [r["transport"] for r in gloo.cluster.info] == ["gloo"] * 2
        assert [o.token_ids for o in gloo.generate(PROMPTS, params)] == [o.token_ids for o in one]
    # both ranks served sequences and all blocks came back
    s = llm2.stats()
    assert s["kv_blocks_free"] == s["kv_blocks_total"]
    assert sum(r["steps"] for r in s["ranks"]) > 0
    assert [row["layer"] for row in s["layers"]] == [0, 2]  # layer 1 is a dense MLP layer (mlp_only_layers)
    assert all(row["tokens"] > 0 for row in s["layers"])


def test_mixed_policies_across_ranks_equal_one_rank(ray_session, model_path, llm2):
    """Requests with different gating policies (so different experts-per-token widths) on different ranks in
    the same steps: the fixed-capacity dispatch must agree on its capacity from group-wide values only."""
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, gating=g)
              for g in ("dynamic", "exact", "sticky", "dynamic")]
    two = llm2.generate(PROMPTS, params)
    with LLM(model=model_path, ranks=1, max_model_len=128, kv_cache_bytes=4 << 20) as llm1:
        one = llm1.generate(PROMPTS, params)
    assert all(o.error is None and len(o.token_ids) == 10 for o in two)
    assert [o.token_ids for o in two] == [o.token_ids for o in one]


def test_streaming_and_seeded_sampling(llm2):
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=123, max_tokens=12, ignore_eos=True)
    stream = llm2.stream("To be", params)
    chunks = list(stream)
    assert chunks[-1].finish_reason == "length"
    assert sum(len(c.token_ids) for c in chunks) == 12
    again = llm2.generate(["To be"], params)[0]
    assert again.token_ids == stream.out.token_ids  # per-request seed reproduces the draw
    # vLLM's shape of the same result
    (seq,) = again.outputs
    assert again.finished and (seq.index, seq.text, seq.token_ids, seq.finish_reason) == (
        0, again.text, again.token_ids, "length")


def test_chat_renders_the_template_and_generates(llm2):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    want = llm2.generate(["System: Be brief.\nUser: Hello\nAssistant:"], params)[0]  # the default template
    one = llm2.chat(conv, params)
    two = llm2.chat([conv, conv[1:]], params)
    assert [o.token_ids for o in one] == [want.token_ids] and one[0].prompt == want.prompt
    assert len(two) == 2 and two[0].token_ids == want.token_ids and two[1].prompt == "User: Hello\nAssistant:"
    for bad, name in (([{"role": "user"}], "messages[0][0].content"), ([[]], "messages[0]"), ([], "empty")):
        with pytest.raises(ValueError, match=re.escape(name)):
            llm2.chat(bad, params)
    tools = [{"type": "function", "function": {"name": "get_time", "description": "Now.", "parameters": {}}}]
    with_tools = llm2.chat(conv[1:], params, tools=tools)[0]
    assert with_tools.prompt.startswith("System: Tools:\n- get_time: Now.") and with_tools.prompt.endswith(
        "User: Hello\nAssistant:")
    with pytest.raises(ValueError, match=re.escape("tools[0].function.name")):
        llm2.chat(conv, params, tools=[{"type": "function", "function": {}}])


def test_bad_input_is_named_and_others_go_on(llm2):
    outs = llm2.generate(["", "hello there", "x " * 50], [
        SamplingParams(max_tokens=4), SamplingParams(temperature=0, max_tokens=4),
        SamplingParams(temperature=0, max_tokens=120)])
    assert outs[0].finish_reason == "error" and "prompt is empty" in outs[0].error
    assert outs[1].finish_reason in ("length", "stop") and outs[1].error is None
    assert outs[2].finish_reason == "error" and "max_tokens=120 exceeds the context window" in outs[2].error
    assert llm2.generate(["next one"], SamplingParams(temperature=0, max_tokens=3))[0].error is None


def test_idle_cluster_does_not_spin(llm2):
    llm2.generate(["warm up"], SamplingParams(temperature=0, max_tokens=2))
    time.sleep(1.0)
    pids = [r["pid"] for r in llm2.cluster.info]
    procs = [psutil.Process(p) for p in pids]
    before = [sum(p.cpu_times()[:2]) for p in procs]
    time.sleep(5.0)
    used = [sum(p.cpu_times()[:2]) - b for p, b in zip(procs, before)]
    assert max(used) < 0.2, f"rank CPU seconds over 5 idle seconds: {used}"


def test_rank_niceness_reaches_the_rank_processes(ray_session, model_path, llm2):
    """Ray starts its workers at niceness 15; the rank actors run at `rank_niceness` (default 0) through their
    runtime env."""
    assert all(psutil.Process(info["pid"]).nice() == 0 for info in llm2.cluster.info)
    llm = LLM(model=model_path, ranks=1, max_model_len=64, kv_cache_bytes=2 << 20, rank_niceness=5)
    try:
        assert psutil.Process(llm.cluster.info[0]["pid"]).nice() == 5
        out = llm.generate(["x"], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))[0]
        assert out.error is None and len(out.token_ids) == 2
    finally:
        llm.shutdown()


def test_rank_niceness_is_checked():
    from cluster.config import ClusterConfig

    assert ClusterConfig(rank_niceness=None).rank_niceness is None  # Ray's own (15)
    with pytest.raises(ValueError, match=r"rank_niceness=-1 must be in \[0, 19\] or None"):
        ClusterConfig(rank_niceness=-1)
