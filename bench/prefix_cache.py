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

    python bench/prefix_cache.py --quick     # 1 round; last line: RESULT ttft_hit_ratio=.. shared_prefix_speedup=.. hit_rate=..
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--prefix", type=int, default=900)
    ap.add_argument("--suffix", type=int, default=50)
    ap.add_argument("--output", type=int, default=128)
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
    print(f"RESULT ttft_hit_ratio={statistics.median(ratios):.3f} shared_prefix_speedup={speedup:.2f} "
          f"hit_rate={hit_rate:.3f}")


if __name__ == "__main__":
    main()
