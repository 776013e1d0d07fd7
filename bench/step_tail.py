"""Cost of a decode step's tail (sampling, stop checks, detokenization, outputs) at 32 and 64 sequences.

In-process engine, world size 1, 1 torch thread, the shipped checkpoint. The tail of a step is the time from the
LM head's return (`model.logits`) to the end of `RankEngine.run`: everything the engine does per sequence after
the forward. Only decode steps that carry every sequence count (prefill steps and the ragged end are left out). Times are the
step thread's CPU time (`time.thread_time`), so other processes on a shared machine inflate them less.

    python bench/step_tail.py                       # 32 and 64 sequences x 128 tokens, every mode
    python bench/step_tail.py --seqs 64 --modes stop

Modes: greedy (temperature 0); temp (temperature 1, seeded); sampled (temperature 0.8, top_k 50, top_p 0.9, seeded); stop (greedy + two stop
strings that never match, so every token runs the held-back search); penalties (greedy + presence, frequency and
repetition penalties and a 10-entry logit_bias on every sequence: `actors.engine.penalties`). EOS is ignored so every sequence runs to
max_tokens. Prints one line per (mode, seqs): mean and median tail per step in microseconds.
To compare two versions, run this script from both checkouts alternately (timings are noisy on a shared machine).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from actors.engine.config import EngineConfig  # noqa: E402
from actors.engine.engine import RankEngine  # noqa: E402
from actors.engine.messages import GenerateRequest  # noqa: E402
from actors.engine.sampling import SamplingParams  # noqa: E402
from actors.model.config import ModelConfig  # noqa: E402
from actors.moe.placement import ExpertPlacement  # noqa: E402

MODES = {
    "greedy": dict(temperature=0.0),
    "temp": dict(temperature=1.0, seed=1),
    "sampled": dict(temperature=0.8, top_k=50, top_p=0.9, seed=1),
    "stop": dict(temperature=0.0, stop=["<<never>>", "qqzzqq"]),
    "penalties": dict(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2,
                      logit_bias={t: 1.0 for t in range(100, 110)}),
}


def tail_per_step(eng: RankEngine, n: int, tokens: int, mode: str) -> list[float]:
    """Tail seconds of each full decode step of `n` sequences x `tokens` tokens."""
    kw = dict(MODES[mode])
    for i in range(n):
        p = SamplingParams(max_tokens=tokens, ignore_eos=True, **{**kw, **({"seed": i} if "seed" in kw else {})})
        eng.add_request(GenerateRequest(request_id=f"{mode}-{i}", prompt_ids=[(7 * i + j) % 4000 + 5 for j in range(8)],
                                        params=p.to_dict()))
    mark = {}
    logits_fn = eng.model.logits

    def timed_logits(h):
        out = logits_fn(h)
        mark["t"] = time.thread_time()
        return out

    eng.model.logits = timed_logits
    tails = []
    try:
        while eng.has_work:
            plan = eng.plan()
            full = len(plan.seqs) == n and not plan.meta.prefills
            mark.clear()
            eng.run(plan)
            t = time.thread_time()
            if full and "t" in mark:
                tails.append(t - mark["t"])
    finally:
        eng.model.logits = logits_fn
    return tails


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/tiny-moe")
    ap.add_argument("--seqs", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--modes", default="greedy,temp,sampled,stop")
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(1)
    mc = ModelConfig.from_pretrained(args.model)
    eng = RankEngine(EngineConfig(model=args.model, num_threads=1, max_num_seqs=max(args.seqs)),
                     ExpertPlacement.contiguous(mc.num_layers, mc.num_experts, 1), 0)
    for _ in range(args.rounds):
        for mode in args.modes.split(","):
            for n in args.seqs:
                tails = tail_per_step(eng, n, args.tokens, mode)
                print(f"mode={mode} seqs={n} steps={len(tails)} tail_mean_us={statistics.mean(tails) * 1e6:.0f} "
                      f"tail_median_us={statistics.median(tails) * 1e6:.0f} "
                      f"per_seq_us={statistics.median(tails) * 1e6 / n:.1f}", flush=True)


if __name__ == "__main__":
    main()
