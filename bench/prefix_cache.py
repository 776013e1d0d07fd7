"""Automatic prefix caching in-process: TTFT of a request whose 900-token prefix is cached, and a shared-prefix
workload with vs without the cache.

One rank (`RankEngine`, world size 1, 1 torch thread like a rank actor), the shipped checkpoint, greedy,
full-precision KV (the in-process engine: the HTTP path adds the same per-request overhead either way).
  1. TTFT: a 900-token prompt (held-out prose) + 20 tokens of its own, alone; then a second request with the same
     900 tokens and another 20 (cache on). ttft_hit_ratio = TTFT(second) / TTFT(first).
  2. Shared prefix: 16 streams, each the same 900-token system prompt + its own 50-token suffix, 128 output
     tokens (ignore_eos; capped to fit the shipped model's 1024 positions: 74), all submitted at once to a fresh engine with and without prefix caching (interleaved
     over rounds). shared_prefix_speedup = tok/s with / without (output tokens over wall time, medians);
     hit_rate = prefix_cache_hits / prefix_cache_queries of the cached run.
The first stream of the cached run computes the prefix; the others hit once it has been committed (the step
after its last prefill chunk), as in vLLM.
  3. Two ranks (a real 2-rank EP cluster on a local Ray, the router in front; prefix caching on): 8 documents of
     --doc-tokens tokens, each asked a first question (all 8 submitted at once: the least-loaded rank alternates),
     then a follow-up question on the same document (all 8 at once, in a shuffled order), with the router's prefix
     routing on (`--prefix-routing`) and off (`--no-prefix-routing`: least-loaded), each on a fresh cluster.
     hit_rate_2ranks_* = prefix-cache hits / queries (tokens) of the follow-ups; TTFT: their median.

    python bench/prefix_cache.py --quick     # 1 round; last line: RESULT ttft_hit_ratio=.. shared_prefix_speedup=..
                                             #   hit_rate=.. hit_rate_2ranks_routed=.. hit_rate_2ranks_least_loaded=..
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cluster.config import DEFAULT_MODEL  # noqa: E402


def make_engine(caching: bool, streams: int = 16):
    from actors.engine.config import EngineConfig
    from actors.engine.engine import RankEngine
    from actors.model.config import ModelConfig
    from actors.moe.placement import ExpertPlacement

    mc = ModelConfig.from_pretrained(DEFAULT_MODEL)
    cfg = EngineConfig(model=DEFAULT_MODEL, max_num_seqs=streams, max_model_len=1024, kv_cache_bytes=256 * 2**20,
                       max_batched_tokens=512, enable_prefix_caching=caching)
    return RankEngine(cfg, ExpertPlacement.contiguous(mc.num_layers, max(mc.num_experts, 1), 1))


def _req(rid, ids, n):
    from actors.engine.messages import GenerateRequest
    from actors.engine.sampling import SamplingParams

    return GenerateRequest(request_id=rid, prompt_ids=ids,
                           params=SamplingParams(temperature=0, max_tokens=n, ignore_eos=True).to_dict())


def ttft(eng, ids) -> float:
    t0 = time.perf_counter()
    eng.add_request(_req(f"t{t0}", ids, 1))
    while eng.has_work:
        eng.step()
    return time.perf_counter() - t0


def workload(eng, prompts, n_out) -> tuple[float, int]:
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        eng.add_request(_req(str(i), p, n_out))
    toks = 0
    while eng.has_work:
        toks += sum(len(o.token_ids) for o in eng.step())
    return toks / (time.perf_counter() - t0), toks


def two_ranks(routing: bool, docs: list[list[int]], first: list[list[int]], second: list[list[int]]) -> dict:
    """Follow-up hit rate, median follow-up TTFT (ms) and requests routed by prefix on a fresh 2-rank cluster."""
    import random

    from actors.engine.sampling import SamplingParams
    from moeray.api import LLM

    llm = LLM(ranks=2, prefix_routing=routing, kv_cache_bytes=256 * 2**20, max_num_seqs=16, max_batched_tokens=512)
    try:
        sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        llm.generate([d + q for d, q in zip(docs, first)], sp)
        s0 = llm.stats()
        order = list(range(len(docs)))
        random.Random(0).shuffle(order)
        outs = llm.generate([docs[i] + second[i] for i in order], sp)
        s1 = llm.stats()
    finally:
        llm.shutdown()
    assert all(o.finish_reason == "length" for o in outs), [o.error for o in outs]
    hits = s1["prefix_cache_hits"] - s0["prefix_cache_hits"]
    queries = s1["prefix_cache_queries"] - s0["prefix_cache_queries"]
    return {"hit_rate": hits / max(1, queries), "ttft_ms": 1e3 * statistics.median(o.ttft_s for o in outs),
            "routed": s1["prefix_routed"] - s0["prefix_routed"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--prefix", type=int, default=900)
    ap.add_argument("--suffix", type=int, default=50)
    ap.add_argument("--output", type=int, default=128)
    ap.add_argument("--doc-tokens", type=int, default=400, help="two-rank part: tokens per document")
    a = ap.parse_args()
    if a.prefix + a.suffix + a.output > 1024:  # the shipped model's max_position_embeddings
        a.output = 1024 - a.prefix - a.suffix
        print(f"output capped at {a.output} tokens: prefix + suffix + output must fit the model's 1024 positions")
    rounds = 1 if a.quick else a.rounds
    torch.set_num_threads(1)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(DEFAULT_MODEL, "tokenizer.json"))
    ids = tok.encode(open(os.path.join(DEFAULT_MODEL, "heldout", "prose.txt")).read()).ids
    system = ids[:a.prefix]
    prompts = [system + ids[5000 + i * a.suffix:5000 + (i + 1) * a.suffix] for i in range(a.streams)]

    ratios, speed = [], {True: [], False: []}
    hit_rate = 0.0
    for r in range(rounds):
        eng = make_engine(True, a.streams)
        ttft(eng, ids[3000:3100])  # warm-up (first-call allocations)
        first = ttft(eng, system + ids[4000:4020])
        second = ttft(eng, system + ids[4100:4120])
        ratios.append(second / first)
        print(f"round {r}: TTFT first {first * 1e3:.0f} ms, second (900 cached) {second * 1e3:.0f} ms, "
              f"ratio {second / first:.3f}", flush=True)
        for caching in (r % 2 == 0, r % 2 != 0):  # interleaved order
            eng = make_engine(caching, a.streams)
            ttft(eng, ids[3000:3100])
            tps, n = workload(eng, prompts, a.output)
            speed[caching].append(tps)
            if caching:
                st = eng.scheduler.prefix.stats()
                hit_rate = st["prefix_cache_hits"] / max(1, st["prefix_cache_queries"])
            print(f"round {r}: {'with' if caching else 'without'} caching {tps:.1f} tok/s ({n} tokens)", flush=True)
    speedup = statistics.median(speed[True]) / statistics.median(speed[False])

    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)  # one local Ray for both clusters
    docs = [ids[8000 + i * a.doc_tokens:8000 + (i + 1) * a.doc_tokens] for i in range(8)]
    qs = [ids[20000 + i * 20:20000 + (i + 1) * 20] for i in range(16)]
    two = {}
    try:
        for routing in (True, False):
            two[routing] = two_ranks(routing, docs, qs[:8], qs[8:])
    finally:
        ray.shutdown()
    print(f"\ntwo ranks, 8 documents x {a.doc_tokens} tokens, 8 follow-ups sharing them:")
    print(f"{'routing':<14} {'follow-up hit rate':>18} {'follow-up TTFT ms':>18} {'routed by prefix':>17}")
    for routing, name in ((True, "prefix-aware"), (False, "least-loaded")):
        r = two[routing]
        print(f"{name:<14} {r['hit_rate']:>18.3f} {r['ttft_ms']:>18.0f} {r['routed']:>17d}")
    print(f"RESULT ttft_hit_ratio={statistics.median(ratios):.3f} shared_prefix_speedup={speedup:.2f} "
          f"hit_rate={hit_rate:.3f} hit_rate_2ranks_routed={two[True]['hit_rate']:.3f} "
          f"hit_rate_2ranks_least_loaded={two[False]['hit_rate']:.3f} ttft_2ranks_routed_ms={two[True]['ttft_ms']:.0f} "
          f"ttft_2ranks_least_loaded_ms={two[False]['ttft_ms']:.0f}")


if __name__ == "__main__":
    main()
