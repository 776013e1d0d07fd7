"""What a second rank adds without a front door: moeray's `LLM` API in-process (Ray actors, no HTTP), 1 rank vs 2
ranks with the experts sharded vs 2 ranks with `--redundant-experts` (every expert on both ranks, each rank's pairs
kept on its own replicas: no per-layer collective), same prompts, same machine, interleaved rounds, medians.

Why beside `bench/serving.py`: on a 2-core machine the Serve proxy, the replica and the load generator need about
half a core at 4,000 tok/s, so an HTTP run of 2 ranks measures the front door's share of the cores as much as the
ranks; this bench drives the router from the driver process instead (requests submitted together, tokens read
from the router as the CLI's `generate` does) and counts every Ray process's CPU (psutil: `ray::` processes, the
driver included).

Per configuration and round: N prompts (held-out prose, 40 tokens) x 128 output tokens, greedy, `ignore_eos`:
aggregate tok/s = N x 128 / wall; CPU ms per token over every Ray process and the driver; and the single-stream
inter-token time (one prompt, 128 tokens: wall / tokens, prefill included). Compute threads per rank: automatic
(the node's CPUs over its ranks, as `moeray serve`).

    python bench/rank_scaling.py --quick     # 64 streams, 2 rounds (~3 min)
    python bench/rank_scaling.py             # 64 streams, 4 rounds

Last line: RESULT tps_2v1=.. cpu_2v1=.. itl_2v1=.. tps_2v1_redundant=.. cpu_2v1_redundant=.. itl_2v1_redundant=..
tps_1rank=.. tps_2ranks=.. tps_2ranks_redundant=.. tokens_equal=.. (2v1: the 2-rank figure over the 1-rank one of
the same round, median over rounds; tokens_equal: every configuration gave the same greedy tokens).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
OUT_TOKENS = 128
CONFIGS = [("1rank", 1, False), ("2ranks", 2, False), ("2ranks_redundant", 2, True)]


def ray_cpu_s() -> float:
    """CPU seconds so far of this process and every `ray::` process (rank actors, Ray's own workers)."""
    tot = 0.0
    for p in psutil.process_iter():
        try:
            if p.pid == os.getpid() or p.cmdline()[:1] and p.cmdline()[0].startswith("ray::"):
                c = p.cpu_times()
                tot += c.user + c.system
        except (psutil.Error, IndexError):
            pass
    return tot


def prompts(n: int) -> list[list[int]]:
    from tokenizers import Tokenizer

    from cluster.config import DEFAULT_MODEL
    tok = Tokenizer.from_file(os.path.join(DEFAULT_MODEL, "tokenizer.json"))
    text = open(os.path.join(DEFAULT_MODEL, "heldout", "prose.txt")).read()
    return [tok.encode(text[i * 211: i * 211 + 400]).ids[:40] for i in range(n)]


def run(ranks: int, redundant: bool, ps: list[list[int]]) -> dict:
    from actors.engine.sampling import SamplingParams
    from cluster.config import DEFAULT_MODEL
    from moeray import LLM

    llm = LLM(model=DEFAULT_MODEL, ranks=ranks, redundant_experts=redundant)
    try:
        p = SamplingParams(temperature=0, max_tokens=OUT_TOKENS, ignore_eos=True)
        llm.generate(ps[:8], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))  # warm-up
        llm.generate(ps, p)  # a whole load once: first-touch of the KV arena and the kernels' panels
        t0 = time.perf_counter()
        llm.generate(ps[:1], p)
        itl = (time.perf_counter() - t0) / OUT_TOKENS
        c0, t0 = ray_cpu_s(), time.perf_counter()
        outs = llm.generate(ps, p)
        wall, cpu = time.perf_counter() - t0, ray_cpu_s() - c0
        n = len(ps) * OUT_TOKENS
        return {"tps": n / wall, "cpu_ms": cpu * 1e3 / n, "itl_ms": itl * 1e3,
                "tokens": [list(o.token_ids) for o in outs]}
    finally:
        llm.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--streams", type=int, default=64)
    a = ap.parse_args()
    rounds = a.rounds or (2 if a.quick else 4)
    import ray
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    ps = prompts(a.streams)
    res: dict[str, list[dict]] = {name: [] for name, _, _ in CONFIGS}
    for rnd in range(rounds):
        for name, ranks, red in CONFIGS:
            r = run(ranks, red, ps)
            res[name].append(r)
            print(f"# round {rnd + 1}/{rounds} {name}: tok/s {r['tps']:.0f}, CPU {r['cpu_ms']:.3f} ms/token, "
                  f"1-stream {r['itl_ms']:.2f} ms/token", flush=True)
    ray.shutdown()
    print(f"\nmachine: {os.cpu_count()} cores; {a.streams} streams x {OUT_TOKENS} tokens; rounds: {rounds}; "
          "medians\n\n| config | tok/s | CPU ms/token (all Ray processes) | 1-stream ms/token | tok/s vs 1 rank | "
          "CPU vs 1 rank |\n|---|---|---|---|---|---|")
    ratio = lambda name, k: statistics.median(x[k] / b[k] for x, b in zip(res[name], res["1rank"]))  # noqa: E731
    for name, _, _ in CONFIGS:
        m = {k: statistics.median(r[k] for r in res[name]) for k in ("tps", "cpu_ms", "itl_ms")}
        print(f"| {name} | {m['tps']:.0f} | {m['cpu_ms']:.3f} | {m['itl_ms']:.2f} | {ratio(name, 'tps'):.2f}x | "
              f"{ratio(name, 'cpu_ms'):.2f}x |")
    ref = res["1rank"][0]["tokens"]
    equal = int(all(r["tokens"] == ref for v in res.values() for r in v))
    out = {"tps_2v1": ratio("2ranks", "tps"), "cpu_2v1": ratio("2ranks", "cpu_ms"), "itl_2v1": ratio("2ranks", "itl_ms"),
           "tps_2v1_redundant": ratio("2ranks_redundant", "tps"), "cpu_2v1_redundant": ratio("2ranks_redundant", "cpu_ms"),
           "itl_2v1_redundant": ratio("2ranks_redundant", "itl_ms"),
           **{f"tps_{name}": statistics.median(r["tps"] for r in res[name]) for name, _, _ in CONFIGS},
           "tokens_equal": equal}
    print("RESULT " + " ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in out.items()))


if __name__ == "__main__":
    main()
