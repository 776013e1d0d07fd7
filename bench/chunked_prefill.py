"""Chunked prefill in-process: a long prompt arriving while N streams decode, per token budget.

One rank (`RankEngine`, world size 1), the shipped checkpoint, on 1 and 2 compute threads (`--threads`: a rank
actor's `num_threads_per_rank`, applied as the actor does, `actors.rank.threads`). Each round, per configuration
(budget x threads, interleaved, so machine noise hits every configuration alike): N streams are started and
decode; after a few decode-only steps a P-token prompt (held-out prose) arrives. Printed per configuration
(medians over rounds): the decode-only step time, the steps the prompt's prefill took and their tokens
(decodes + chunk), the longest step while it prefilled (= the largest inter-token gap any running stream
saw, since every stream gets one token per step), that over the decode-only median, and the prompt's TTFT
(arrival to first token, in-process).

    python bench/chunked_prefill.py                       # budgets 128, 256, 512 and unchunked x 1, 2 threads
    python bench/chunked_prefill.py --budgets 256 --threads 2 --rounds 1
    python bench/chunked_prefill.py --streams 0 --prompt-len 500 --budgets 256,512  # an idle rank's TTFT
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


def make_engine(budget: int | None, streams: int):
    from actors.engine.config import EngineConfig
    from actors.engine.engine import RankEngine
    from actors.model.config import ModelConfig
    from actors.moe.placement import ExpertPlacement

    mc = ModelConfig.from_pretrained(DEFAULT_MODEL)
    kw = dict(max_batched_tokens=budget) if budget else dict(max_batched_tokens=4096, enable_chunked_prefill=False)
    cfg = EngineConfig(model=DEFAULT_MODEL, max_num_seqs=max(streams + 1, 8), max_model_len=1024,
                       kv_cache_bytes=96 * 2**20, **kw)
    return RankEngine(cfg, ExpertPlacement.contiguous(mc.num_layers, max(mc.num_experts, 1), 1))


def one_round(eng, streams: int, long_ids: list[int], tag: str) -> dict:
    from actors.engine.messages import GenerateRequest
    from actors.engine.sampling import SamplingParams

    dec = SamplingParams(temperature=0, max_tokens=1024 - 32, ignore_eos=True).to_dict()
    for i in range(streams):
        eng.add_request(GenerateRequest(request_id=f"{tag}s{i}", prompt_ids=[(7 * i + j) % 3000 + 5 for j in range(16)],
                                        params=dec))
    for _ in range(4):
        eng.step()  # admitted, prefilled, decoding
    steady = []
    for _ in range(10 if streams else 0):
        t0 = time.perf_counter()
        eng.step()
        steady.append(time.perf_counter() - t0)
    eng.add_request(GenerateRequest(request_id=f"{tag}long", prompt_ids=long_ids,
                                    params=SamplingParams(temperature=0, max_tokens=4, ignore_eos=True).to_dict()))
    arrive = time.perf_counter()
    steps = []  # (decodes, prefill tokens, ms)
    ttft = None
    while ttft is None:
        t0 = time.perf_counter()
        plan = eng.plan()
        outs = eng.run(plan)
        t1 = time.perf_counter()
        nd = plan.meta.decode_tokens.numel()
        steps.append((nd, plan.num_tokens - nd, (t1 - t0) * 1e3))
        if any(o.request_id == f"{tag}long" and o.token_ids for o in outs):
            ttft = (t1 - arrive) * 1e3
    for s in list(eng.scheduler.running) + list(eng.scheduler.waiting):
        eng.abort(s.request_id)
    while eng.has_work:
        eng.step()
    med = statistics.median(steady) * 1e3 if steady else float("nan")
    worst = max(ms for _, _, ms in steps)
    return {"steady_ms": med, "steps": steps, "worst_ms": worst, "ratio": worst / med, "ttft_ms": ttft}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budgets", default="128,256,512,0", help="max_batched_tokens values; 0 = chunking off")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", default="1,2", help="compute threads per configuration (comma-separated)")
    ap.add_argument("--quick", action="store_true", help="budgets 256 and 512, one round")
    a = ap.parse_args()
    if a.quick:
        a.budgets, a.rounds = "256,512", 1
    from actors.rank.threads import apply_threads

    budgets = [int(b) for b in a.budgets.split(",")]
    threads = [int(t) for t in a.threads.split(",")]
    configs = [(b, t) for b in budgets for t in threads]
    engines = {b: make_engine(b or None, a.streams) for b in budgets}
    text = open(os.path.join(DEFAULT_MODEL, "heldout", "prose.txt")).read()
    ids = next(iter(engines.values())).tokenizer.encode(text).ids
    n_calls = (a.rounds + 1) * len(configs)  # each arrival a different slice: none hits the prefix cache
    ids = ids * (a.prompt_len * n_calls // max(len(ids), 1) + 1)
    res: dict[tuple[int, int], list[dict]] = {c: [] for c in configs}
    with torch.inference_mode():
        for r in range(a.rounds + 1):  # round 0 warms up (first-use weight packing), not counted
            for i, (b, t) in enumerate(configs):
                apply_threads(t)
                k = (r * len(configs) + i) * a.prompt_len
                one = one_round(engines[b], a.streams, ids[k : k + a.prompt_len], f"r{r}b{b}t{t}")
                if r:
                    res[(b, t)].append(one)
    print(f"{a.streams} decoding streams, a {a.prompt_len}-token prompt arrives; {a.rounds} rounds (medians)")
    print(f"{'budget':>9} {'threads':>7} {'decode step ms':>14} {'prefill steps':>13} {'worst step ms':>13} "
          f"{'worst/decode':>12} {'TTFT ms':>8}  tokens per step (decodes+chunk), last round")
    for b, t in configs:
        rs = res[(b, t)]
        med = lambda k: statistics.median(x[k] for x in rs)  # noqa: E731
        steps = rs[-1]["steps"]
        layout = ", ".join(f"{d}+{p}" for d, p, _ in steps)
        print(f"{b or 'unchunked':>9} {t:7d} {med('steady_ms'):14.2f} {len(steps):13d} {med('worst_ms'):13.1f} "
              f"{med('ratio'):12.2f} {med('ttft_ms'):8.1f}  {layout}")
    # worst/decode is nan without decoding streams: printed as 0 (the key stays a plain decimal)
    print("RESULT " + " ".join(f"worst_ratio_{b or 'off'}_t{t}={_num(statistics.median(x['ratio'] for x in res[(b, t)])):.2f} "
                               f"ttft_{b or 'off'}_t{t}_ms={statistics.median(x['ttft_ms'] for x in res[(b, t)]):.1f}"
                               for b, t in configs))


def _num(x: float) -> float:
    return 0.0 if x != x else x


if __name__ == "__main__":
    main()
