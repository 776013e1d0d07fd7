"""Rank-level expert load balance before and after EPLB rebalancing, on a skewed (code-only) workload.

The workload is code only (held-out CPython stdlib sources, `models/tiny-moe/heldout/code.txt`), which
drives the router towards a domain's favourite experts, so contiguous expert shards load ranks unevenly.
For each cluster size (2 and 4 ranks by default), on one running cluster:
  1. observe: run prompt set A under the default contiguous placement; its expert load is the window;
  2. before: run held-out prompt set B (same domain, other text) under the contiguous placement;
  3. rebalance: `EPCluster.rebalance(load=<set A's window>, num_redundant=W)` (EPLB: replicate hot experts,
     pack replicas by load), applied between steps while the cluster stays up;
  4. after: run set B again under the new placement.
Balancedness of a layer = mean / max over ranks of the rows that rank's experts computed (measured by
the dispatchers, replicas included; 1.0 = even). Greedy decoding, so both B runs route identically.

    python bench/placement.py            # 2 and 4 ranks, 24 prompts x 192 tokens per set
    python bench/placement.py --quick    # 8 prompts x 96 tokens per set

Last line: RESULT rank_balance_before=<x> rank_balance_after=<x> (mean/max averaged over MoE layers and
cluster sizes), then the same per cluster size (`_w2`, `_w4`, ...) and `planned_after` (the planner's
expected figure for set B's load, before rounding).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cluster.config import DEFAULT_MODEL  # noqa: E402


def code_prompts(model: str, n: int, tokens: int, skip: int = 0) -> list[list[int]]:
    """`n` consecutive `tokens`-token windows of the held-out code text, after the first `skip` windows."""
    from tokenizers import Tokenizer

    path = os.path.join(DEFAULT_MODEL, "heldout", "code.txt")
    ids = Tokenizer.from_file(os.path.join(model, "tokenizer.json")).encode(open(path).read()).ids
    need = (skip + n) * tokens
    if need > len(ids):
        raise ValueError(f"{n} prompts x {tokens} tokens after {skip} windows need {need} tokens; "
                         f"{path} has {len(ids)}")
    return [ids[(skip + i) * tokens:(skip + i + 1) * tokens] for i in range(n)]


def _rows(stats: dict) -> list[list[int]]:
    return stats["dispatch_rank_rows"]


def _diff(a, b):
    return [[x - y for x, y in zip(ra, rb)] for ra, rb in zip(a, b)]


def _bal(row) -> float:
    mx = max(row)
    return (sum(row) / len(row)) / mx if mx > 0 else 1.0


def run_size(W: int, args, set_a, set_b) -> dict:
    from actors.engine.sampling import SamplingParams
    from cluster.placement import expected_rank_load
    from moeray import LLM

    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    with LLM(model=args.model, ranks=W, max_model_len=args.prompt_tokens + args.max_tokens + 1,
             kv_cache_bytes=args.kv_mb << 20) as llm:
        cl = llm.cluster
        moe = [l for l in range(cl.model_config.num_layers) if cl.model_config.moe_layers[l]]
        s0 = cl.stats()
        llm.generate(set_a, params)
        s1 = cl.stats()
        window = _diff(s1["expert_load"], s0["expert_load"])
        ref = llm.generate(set_b, params)
        s2 = cl.stats()
        before = _diff(_rows(s2), _rows(s1))
        load_b = _diff(s2["expert_load"], s1["expert_load"])
        res = cl.rebalance(load=window, num_redundant=args.num_redundant if args.num_redundant is not None else W)
        s3 = cl.stats()
        again = llm.generate(set_b, params)
        s4 = cl.stats()
        after = _diff(_rows(s4), _rows(s3))
        planned = expected_rank_load(cl.placement, load_b)
        same = [o.token_ids for o in again] == [o.token_ids for o in ref]
        return {"W": W, "layers": moe, "before": [_bal(before[l]) for l in moe], "after": [_bal(after[l]) for l in moe],
                "planned": [_bal(planned[l]) for l in moe], "redundant": [res["redundant"][l] for l in moe],
                "rows_before": [before[l] for l in moe], "rows_after": [after[l] for l in moe],
                "same_tokens": same, "step": res["step"], "load_s": res["load_s"],
                "tokens": sum(len(p) for p in set_b)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--ranks", default="2,4", help="comma-separated cluster sizes")
    ap.add_argument("--prompts", type=int, default=None, help="prompts per set (default 24, quick 8)")
    ap.add_argument("--prompt-tokens", type=int, default=None, help="tokens per prompt (default 192, quick 96)")
    ap.add_argument("--max-tokens", type=int, default=None, help="generated per prompt (default 16, quick 8)")
    ap.add_argument("--num-redundant", type=int, default=None, help="extra replicas per layer (default: W)")
    ap.add_argument("--kv-mb", type=int, default=16)
    args = ap.parse_args()
    args.prompts = args.prompts or (8 if args.quick else 24)
    args.prompt_tokens = args.prompt_tokens or (96 if args.quick else 192)
    args.max_tokens = args.max_tokens or (8 if args.quick else 16)
    sizes = [int(x) for x in args.ranks.split(",")]
    set_a = code_prompts(args.model, args.prompts, args.prompt_tokens)
    set_b = code_prompts(args.model, args.prompts, args.prompt_tokens, skip=args.prompts)

    results = [run_size(W, args, set_a, set_b) for W in sizes]
    print(f"\ncode-only workload: plan from set A ({args.prompts} x {args.prompt_tokens} tokens), "
          f"measure on held-out set B (+{args.max_tokens} generated each); balancedness = mean/max rank rows")
    print(f"{'ranks':>5} {'layer':>5} {'before':>7} {'after':>7} {'planned':>7} {'extra':>5}  "
          f"{'rows per rank before':<28} rows per rank after")
    for r in results:
        for i, l in enumerate(r["layers"]):
            print(f"{r['W']:>5} {l:>5} {r['before'][i]:>7.3f} {r['after'][i]:>7.3f} {r['planned'][i]:>7.3f} "
                  f"{r['redundant'][i]:>5}  {str(r['rows_before'][i]):<28} {r['rows_after'][i]}")
        print(f"{r['W']:>5} {'mean':>5} {sum(r['before']) / len(r['before']):>7.3f} "
              f"{sum(r['after']) / len(r['after']):>7.3f} {sum(r['planned']) / len(r['planned']):>7.3f}        "
              f"switched at step {r['step']}, weights read in {r['load_s'] * 1000:.0f} ms, "
              f"greedy tokens unchanged: {r['same_tokens']}")

    def avg(key, rs):
        xs = [x for r in rs for x in r[key]]
        return sum(xs) / len(xs)

    kv = {"rank_balance_before": avg("before", results), "rank_balance_after": avg("after", results),
          "planned_after": avg("planned", results)}
    for r in results:
        kv[f"rank_balance_before_w{r['W']}"] = avg("before", [r])
        kv[f"rank_balance_after_w{r['W']}"] = avg("after", [r])
    kv["same_tokens"] = int(all(r["same_tokens"] for r in results))
    print("RESULT " + " ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in kv.items()))


if __name__ == "__main__":
    main()
