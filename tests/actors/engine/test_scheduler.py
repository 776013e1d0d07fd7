"""Continuous batching: preemption under a full KV pool, no deadlock, every block freed, and the
same greedy tokens as an unconstrained run."""
from __future__ import annotations

import random

from actors.engine.messages import GenerateRequest
from actors.engine.sampling import SamplingParams
from tests.actors.model.test_model_vs_hf import make_engine, run_to_completion


def test_preemption_recompute_gives_same_tokens(tiny_model_dir):
    path = tiny_model_dir("qwen2_moe", num_layers=3)
    prompts = [[(7 * i + j) % 300 + 1 for j in range(5 + 3 * i)] for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    big = run_to_completion(make_engine(path), prompts, params)
    # a pool of 8 blocks of 16 tokens cannot hold 6 sequences of up to 44 tokens at once
    small_eng = make_engine(path, max_model_len=64, kv_cache_bytes=8 * 16 * 2 * 3 * 2 * 16 * 4, block_size=16)
    assert small_eng.cache.allocator.num_blocks == 8
    small = run_to_completion(small_eng, prompts, params)
    assert small == big
    a = small_eng.cache.allocator
    assert a.num_free == a.num_blocks


def test_random_workload_with_aborts_frees_everything(tiny_model_dir):
    path = tiny_model_dir("qwen2_moe", num_layers=3)
    eng = make_engine(path, max_model_len=64, kv_cache_bytes=6 * 16 * 2 * 3 * 2 * 16 * 4)
    rng = random.Random(0)
    live = set()
    for step in range(120):
        if rng.random() < 0.3:
            rid = f"r{step}"
            n = rng.randint(1, 30)
            eng.add_request(GenerateRequest(request_id=rid, prompt_ids=[rng.randint(1, 300) for _ in range(n)],
                                            params=SamplingParams(temperature=0.8, seed=step, max_tokens=rng.randint(1, 30)).to_dict()))
            live.add(rid)
        if live and rng.random() < 0.1:
            eng.abort(rng.choice(sorted(live)))
        for o in eng.step():
            if o.finish_reason:
                assert o.finish_reason in ("stop", "length", "abort"), o.error
                live.discard(o.request_id)
    while eng.has_work:
        for o in eng.step():
            if o.finish_reason:
                live.discard(o.request_id)
    assert not live
    a = eng.cache.allocator
    assert a.num_free == a.num_blocks


def test_prompt_that_can_never_fit_fails_cleanly(tiny_model_dir):
    path = tiny_model_dir("qwen2_moe", num_layers=3)
    eng = make_engine(path, max_model_len=64, kv_cache_bytes=4 * 16 * 2 * 3 * 2 * 16 * 4)
    eng.add_request(GenerateRequest(request_id="big", prompt_ids=list(range(1, 100)), params=SamplingParams(max_tokens=2).to_dict()))
    eng.add_request(GenerateRequest(request_id="ok", prompt_ids=[1, 2, 3], params=SamplingParams(temperature=0, max_tokens=2).to_dict()))
    res = {}
    while eng.has_work:
        for o in eng.step():
            if o.finish_reason:
                res[o.request_id] = (o.finish_reason, o.error)
    assert res["big"][0] == "error" and "KV blocks" in res["big"][1]
    assert res["ok"][0] == "length"
