"""In-process decode-step profile of one rank (world size 1, 1 torch thread): ms/step and where it goes.

Builds `RankEngine(EngineConfig(model=..., num_threads=1))` in this process, starts B sequences (short prompts,
EOS ignored), lets them prefill and decode a few warm-up steps, then times `steps` decode steps of the whole
engine (`engine.step()`: schedule + forward + logits + sampling). Two passes per batch size:

1. plain: no instrumentation; ms/step = median step time, tok/s = B / mean step time.

Times are this thread's CPU time (`time.thread_time`: the rank runs one torch thread, and on a shared machine
wall time mostly measures the neighbours); `--clock wall` uses `time.perf_counter` instead.
2. instrumented: the model's regions wrapped by timers (exclusive time: a nested region's time is not also
   counted in its parent), printed as ms/step per region. Wrappers add ~1 us per call, so the regions sum to a
   little more than the plain step.

    python bench/decode_step.py                      # batches 1 8 32 64, this checkout
    python bench/decode_step.py --batches 32 --steps 64 --no-regions
    python bench/decode_step.py --root /path/to/old/checkout    # profile another checkout's code
    python bench/decode_step.py --compare /work/main --rounds 3
        # old (the checkout at /work/main) vs new (this one), interleaved: each round runs one subprocess per
        # checkout, alternately; prints per-round and median ms/step and tok/s@B / tok/s@1 of both.

Last line: RESULT ms_step_1=.. ms_step_8=.. ms_step_32=.. ms_step_64=.. tps32_over_tps1=..
(with --compare: the new checkout's medians, plus old_* keys).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict

CLOCK = time.thread_time
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Regions:
    """Exclusive timers keyed by region path ("forward/attention/linear")."""

    def __init__(self):
        self.stack: list[str] = []
        self.excl = defaultdict(float)
        self.calls = defaultdict(int)
        self.child = [0.0]  # per stack level: time spent in children

    def wrap(self, name, fn):
        @functools.wraps(fn)
        def timed(*a, **kw):
            self.stack.append(name)
            self.child.append(0.0)
            t0 = CLOCK()
            try:
                return fn(*a, **kw)
            finally:
                dt = CLOCK() - t0
                kids = self.child.pop()
                key = "/".join(self.stack)
                self.stack.pop()
                self.excl[key] += dt - kids
                self.calls[key] += 1
                self.child[-1] += dt
        return timed

    def reset(self):
        self.excl.clear()
        self.calls.clear()


def instrument(reg: Regions) -> None:
    """Wrap the model's regions where the model looks them up (module attributes and methods)."""
    import actors.engine.engine as eng_mod
    import actors.kv.paged as paged
    import actors.model.layers as layers
    import actors.model.model as model
    import actors.moe.dispatch as dispatch
    import actors.moe.experts as experts

    def patch(obj, attr, name):
        if hasattr(obj, attr):
            setattr(obj, attr, reg.wrap(name, getattr(obj, attr)))

    patch(eng_mod.RankEngine, "plan", "schedule")
    patch(eng_mod.RankEngine, "run", "run")
    patch(eng_mod, "sample", "sample")
    patch(eng_mod.RankEngine, "_append", "append+detok")
    patch(model.MoEModel, "forward", "forward")
    patch(model.MoEModel, "attention_block", "attention_block")
    patch(model.MoEModel, "attention", "attention")
    patch(model.MoEModel, "moe", "moe")
    patch(model.MoEModel, "logits", "lm_head")
    patch(model, "linear", "linear")
    patch(model, "rms_norm", "rms_norm")
    patch(model, "swiglu_mlp", "dense_mlp")
    patch(model, "select_experts", "route")
    patch(model.GatingRouter, "route", "route")
    patch(layers.Rotary, "apply", "rope")
    patch(paged.PagedKVCache, "write", "kv_write")
    patch(paged, "paged_attention", "attend")
    patch(dispatch.AllToAllDispatcher, "dispatch", "dispatch")
    patch(dispatch.AllToAllDispatcher, "combine", "combine")
    patch(experts.ExpertRows, "run", "experts")


def build(model: str, batch: int, max_tokens: int, *, placement=None, rank: int = 0, group=None, shm=None,
          first: int = 0):
    """A one-thread `RankEngine` holding `batch` greedy requests (short synthetic prompts, EOS ignored): requests
    first .. first + batch - 1 of one fixed list. placement / rank / group / shm: an EP rank's (default: one rank)."""
    import torch

    from actors.engine.config import EngineConfig
    from actors.engine.engine import RankEngine
    from actors.engine.messages import GenerateRequest
    from actors.engine.sampling import SamplingParams
    from actors.model.config import ModelConfig
    from actors.moe.placement import ExpertPlacement

    torch.set_num_threads(1)
    mc = ModelConfig.from_pretrained(model)
    eng = RankEngine(EngineConfig(model=model, num_threads=1, max_num_seqs=max(64, batch)),
                     placement or ExpertPlacement.contiguous(mc.num_layers, mc.num_experts, 1), rank, group, shm=shm)
    p = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True).to_dict()
    for i in range(first, first + batch):
        prompt = [(7 * i + 3 * j) % 4000 + 10 for j in range(12 + i % 7)]
        eng.add_request(GenerateRequest(request_id=str(i), prompt_ids=prompt, params=p))
    return eng


def measure(model: str, batch: int, steps: int, regions: bool) -> dict:
    eng = build(model, batch, max_tokens=2 * steps + 40)
    while len(eng.scheduler.running) < batch or any(s.num_cached < len(s.prompt_ids) for s in eng.scheduler.running):
        eng.step()
    for _ in range(8):  # warm-up decode steps
        eng.step()
    times = []
    for _ in range(steps):
        t0 = CLOCK()
        eng.step()
        times.append(CLOCK() - t0)
    out = {"batch": batch, "ms_step": statistics.median(times) * 1e3, "tps": batch * len(times) / sum(times)}
    if regions:
        reg = Regions()
        instrument(reg)
        for _ in range(4):
            eng.step()
        reg.reset()
        t0 = CLOCK()
        for _ in range(steps):
            eng.step()
        out["instrumented_ms_step"] = (CLOCK() - t0) / steps * 1e3
        out["regions"] = {k: (v / steps * 1e3, reg.calls[k] / steps) for k, v in reg.excl.items()}
    return out


def print_regions(r: dict) -> None:
    print(f"\nbatch {r['batch']}: {r['ms_step']:.3f} ms/step plain, {r['instrumented_ms_step']:.3f} instrumented")
    print("| region (exclusive) | ms/step | calls/step |")
    print("|---|---|---|")
    for k, (ms, calls) in sorted(r["regions"].items(), key=lambda kv: -kv[1][0]):
        if ms >= 0.005:
            print(f"| {k} | {ms:.3f} | {calls:.0f} |")


def child(args) -> None:
    res = [measure(args.model, b, args.steps, not args.no_regions) for b in args.batches]
    print("JSON " + json.dumps(res))


def run_child(root: str, args) -> list[dict]:
    cmd = [sys.executable, os.path.join(HERE, "bench", "decode_step.py"), "--child", "--model", args.model,
           "--steps", str(args.steps), "--clock", args.clock, "--no-regions", "--batches", *map(str, args.batches)]
    env = dict(os.environ, PYTHONPATH=root)
    out = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, check=True).stdout
    return json.loads(next(line for line in out.splitlines() if line.startswith("JSON "))[5:])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join(HERE, "models", "tiny-moe"))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    ap.add_argument("--no-regions", action="store_true")
    ap.add_argument("--compare", metavar="OLD_ROOT", help="checkout to compare against (interleaved subprocesses)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--root", default=HERE, help="checkout whose code runs (default: this one)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.model = os.path.abspath(args.model)
    global CLOCK
    CLOCK = time.thread_time if args.clock == "cpu" else time.perf_counter
    if args.child:
        sys.path.insert(0, os.environ.get("PYTHONPATH", HERE))
        return child(args)
    if args.compare:
        runs = {"old": [], "new": []}
        for rnd in range(args.rounds):
            for name, root in (("old", os.path.abspath(args.compare)), ("new", HERE))[:: 1 if rnd % 2 == 0 else -1]:
                res = run_child(root, args)
                runs[name].append({r["batch"]: r for r in res})
                print(f"round {rnd} {name}: " + " ".join(f"@{r['batch']} {r['ms_step']:.3f} ms" for r in res), flush=True)
        med = {n: {b: statistics.median(rr[b]["ms_step"] for rr in runs[n]) for b in args.batches} for n in runs}
        print("\n| batch | old ms/step | new ms/step | new/old | old tok/s | new tok/s |")
        print("|---|---|---|---|---|---|")
        for b in args.batches:
            o, n = med["old"][b], med["new"][b]
            print(f"| {b} | {o:.3f} | {n:.3f} | {n / o:.3f} | {b / o * 1e3:.0f} | {b / n * 1e3:.0f} |")
        keys = []
        for name, prefix in (("new", ""), ("old", "old_")):
            m = med[name]
            keys += [f"{prefix}ms_step_{b}={m[b]:.3f}" for b in args.batches]
            if 1 in m and 32 in m:
                keys.append(f"{prefix}tps32_over_tps1={m[1] * 32 / m[32]:.2f}")
        print("RESULT " + " ".join(keys))
        return
    sys.path.insert(0, os.path.abspath(args.root))
    res = [measure(args.model, b, args.steps, not args.no_regions) for b in args.batches]
    for r in res:
        if "regions" in r:
            print_regions(r)
    print("\n| batch | ms/step | tok/s |")
    print("|---|---|---|")
    for r in res:
        print(f"| {r['batch']} | {r['ms_step']:.3f} | {r['tps']:.0f} |")
    m = {r["batch"]: r["ms_step"] for r in res}
    keys = [f"ms_step_{b}={v:.3f}" for b, v in m.items()]
    if 1 in m and 32 in m:
        keys.append(f"tps32_over_tps1={m[1] * 32 / m[32]:.2f}")
    print("RESULT " + " ".join(keys))


if __name__ == "__main__":
    main()
