"""Decode latency and throughput: transformers.generate vs moeray (1 rank) vs moeray (2 Ray ranks).

All rows are measured in one run on the same checkpoint with the same per-process thread count
(1 torch thread per process: the transformers process, and each moeray rank).

    python bench/decode.py            # full table (several minutes)
    python bench/decode.py --quick    # under 3 minutes

TPOT (ms per output token) at batch 1 = median over runs of (t_last - t_first) / (n - 1) with n = 128
forced tokens (EOS ignored). Throughput = output tokens / wall seconds with 8 and 32 (full run: also 64)
concurrent sequences, prompt and start-up included; "x@32" = tok/s at 32 over tok/s at 1 (= 1000 / TPOT), how
throughput grows with batch (conservative: the batch-1 figure excludes the prefill the tok/s figures include).
The 2-rank breakdown splits rank time into all-to-all, step agreement (all_reduce), compute (forward minus
all-to-all) and scheduling + sampling, per decode step.
Last line: RESULT moeray_1rank=<ms> moeray_2ranks=<ms> transformers=<ms> moeray_1rank_tps32=<tok/s>
moeray_1rank_x32=<ratio> moeray_2ranks_tps32=<tok/s> moeray_2ranks_x32=<ratio> transformers_x32=<ratio>
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

PROMPT = "ROMEO. But soft, what light through yonder window breaks?"
CODE_PROMPT = "def parse_header(line):\n    "


def hf_tpot(model, tok_ids, n, runs):
    from transformers.generation.streamers import BaseStreamer

    class Clock(BaseStreamer):
        def __init__(self):
            self.t = []

        def put(self, value):
            self.t.append(time.perf_counter())

        def end(self):
            pass

    out = []
    for _ in range(runs):
        c = Clock()
        with torch.no_grad():
            model.generate(torch.tensor([tok_ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           streamer=c, pad_token_id=0)
        t = c.t[1:]  # first put() is the prompt
        out.append((t[-1] - t[0]) / (len(t) - 1) * 1000)
    return statistics.median(out)


def hf_throughput(model, prompts_ids, n):
    B = len(prompts_ids)
    L = max(len(p) for p in prompts_ids)
    ids = torch.zeros(B, L, dtype=torch.long)
    mask = torch.zeros(B, L, dtype=torch.long)
    for i, p in enumerate(prompts_ids):  # left padding
        ids[i, L - len(p):] = torch.tensor(p)
        mask[i, L - len(p):] = 1
    t0 = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return B * n / (time.perf_counter() - t0)


def moeray_tpot(llm, tok_ids, n, runs):
    from actors.engine.sampling import SamplingParams

    p = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    out = []
    for _ in range(runs):
        o = llm.generate([tok_ids], p)[0]
        t = o.token_times
        assert len(t) == n, (len(t), o.error)
        out.append((t[-1] - t[0]) / (n - 1) * 1000)
    return statistics.median(out)


def moeray_throughput(llm, prompts_ids, n):
    from actors.engine.sampling import SamplingParams

    p = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts_ids, p)
    dt = time.perf_counter() - t0
    assert all(len(o.token_ids) == n for o in outs), [o.error for o in outs]
    return len(prompts_ids) * n / dt


def breakdown(before, after):
    rows = []
    for b, a in zip(before["ranks"], after["ranks"]):
        steps = max(1, a["steps"] - b["steps"])
        d = {k: (a[k] - b[k]) * 1000 / steps for k in ("forward_s", "comm_s", "sync_s", "schedule_s", "sample_s")}
        rows.append((a["rank"], steps, d["comm_s"], d["sync_s"], d["forward_s"] - d["comm_s"], d["schedule_s"] + d["sample_s"]))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()
    torch.set_num_threads(1)
    runs = 2 if args.quick else 5
    n = args.tokens
    conc = [8, 32] if args.quick else [8, 32, 64]
    n_tp = 32 if args.quick else 64

    import ray
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    from moeray import LLM

    tok = Tokenizer.from_file(os.path.join(args.model, "tokenizer.json"))
    p_ids = tok.encode(PROMPT).ids
    prompts = [tok.encode((PROMPT if i % 2 == 0 else CODE_PROMPT) + " " * (i % 5)).ids for i in range(max(conc))]
    res = {}

    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    hf_tpot(hf, p_ids, 8, 1)  # warm-up
    res[("transformers", "tpot")] = hf_tpot(hf, p_ids, n, runs)
    for c in conc:
        res[("transformers", c)] = hf_throughput(hf, prompts[:c], n_tp)
    del hf

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    bd = []
    for ranks in (1, 2):
        name = f"moeray {ranks} rank" + ("s" if ranks > 1 else "")
        llm = LLM(model=args.model, ranks=ranks, num_threads_per_rank=1, num_cpus_per_rank=1.0)
        try:
            moeray_tpot(llm, p_ids, 8, 1)  # warm-up
            before = llm.stats()
            res[(name, "tpot")] = moeray_tpot(llm, p_ids, n, runs)
            after = llm.stats()
            if ranks == 2:
                bd = breakdown(before, after)
            for c in conc:
                res[(name, c)] = moeray_throughput(llm, prompts[:c], n_tp)
        finally:
            llm.shutdown()
    ray.shutdown()

    names = ["transformers", "moeray 1 rank", "moeray 2 ranks"]
    print(f"\nmodel: {args.model}; {n} forced tokens, {runs} runs, 1 torch thread per process; tok/s columns: "
          f"{n_tp} tokens per sequence{' (--quick: half the full run, so the per-request start-up weighs twice as much)' if args.quick else ''}")
    def x32(nm):  # tok/s at 32 sequences over tok/s at 1 (1000 / TPOT)
        return res[(nm, 32)] * res[(nm, "tpot")] / 1000

    hdr = "| engine | TPOT batch 1 (ms) | ratio vs transformers | " + " | ".join(f"tok/s @{c}" for c in conc) + " | x@32 |"
    print(hdr)
    print("|" + "---|" * (4 + len(conc)))
    for nm in names:
        print(f"| {nm} | {res[(nm, 'tpot')]:.2f} | {res[(nm, 'tpot')] / res[('transformers', 'tpot')]:.3f} | "
              + " | ".join(f"{res[(nm, c)]:.1f}" for c in conc) + f" | {x32(nm):.2f} |")
    print("\n2-rank decode step breakdown (ms per step, batch-1 runs)")
    print("| rank | steps | all-to-all | step agreement | compute | schedule+sample |")
    print("|---|---|---|---|---|---|")
    for r in bd:
        print(f"| {r[0]} | {r[1]} | {r[2]:.2f} | {r[3]:.2f} | {r[4]:.2f} | {r[5]:.2f} |")
    print(f"RESULT moeray_1rank={res[('moeray 1 rank', 'tpot')]:.3f} moeray_2ranks={res[('moeray 2 ranks', 'tpot')]:.3f} "
          f"transformers={res[('transformers', 'tpot')]:.3f} moeray_1rank_tps32={res[('moeray 1 rank', 32)]:.1f} "
          f"moeray_1rank_x32={x32('moeray 1 rank'):.2f} moeray_2ranks_tps32={res[('moeray 2 ranks', 32)]:.1f} "
          f"moeray_2ranks_x32={x32('moeray 2 ranks'):.2f} transformers_x32={x32('transformers'):.2f}")


if __name__ == "__main__":
    main()
