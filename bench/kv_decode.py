"""Decode speed with the quantized paged KV cache against the full-precision paged cache, same run.

One rank in-process (no Ray, no collectives: this isolates attention over the cache), shipped model, fp32
compute, 1 torch thread. For each context length (256 and 1024 by default) and batch size, `batch` greedy
sequences are prefilled to `context - decode` tokens of held-out prose and then decoded `decode` more tokens
(EOS ignored), so attention reads contexts that grow up to the target length. ms/token = median step time of
the decode steps / 1 (every step makes one token per sequence; at batch B the per-sequence figure is the
step time, the throughput figure is B / step time). Each configuration runs `--repeats` times, interleaved,
and the median is kept, so machine noise hits every row alike; compare the ratio column, not single times.

Rows: full-precision KV (`fp`), ours at 4/3/2 bits with the `prose` profile on the `torch` reference path (the
CPU fast path; the Triton kernel is the GPU path and runs here only under the slow interpreter, so it is not
timed). KV bytes per token are the cache's own accounting of live data (sealed blocks, outliers, scales, sink, tail)
at the last decode step; the full-precision row gives the fp16 paged layout (2 x layers x KV heads x head_dim
x 2 bytes) for the ratio the issue asks for, although the CPU run computes in fp32.

    python bench/kv_decode.py            # contexts 256 and 1024, batch 1 and 8, 3 repeats
    python bench/kv_decode.py --quick    # contexts 256 and 1024, batch 1, 1 repeat, fewer decode steps

Last line: RESULT fp_ms_256=<ms> q3_ms_256=<ms> ratio3_256=<x> fp_ms_1024=<ms> q3_ms_1024=<ms> ratio3_1024=<x>
ratio2_1024=<x> (batch 1; ratio = quantized / full-precision ms per token).
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


def prose_ids(model: str, n: int) -> list[int]:
    from tokenizers import Tokenizer

    text = open(os.path.join(DEFAULT_MODEL, "heldout", "prose.txt")).read()
    ids = Tokenizer.from_file(os.path.join(model, "tokenizer.json")).encode(text).ids
    if len(ids) < n:
        raise ValueError(f"held-out prose has {len(ids)} tokens; {n} needed")
    return ids


def run_once(model: str, kv_bits: int | None, context: int, batch: int, decode: int, ids: list[int]) -> dict:
    """Median decode step ms and KV bytes per token for one configuration (a fresh engine)."""
    from actors.model.config import ModelConfig
    from actors.moe.placement import ExpertPlacement
    from actors.engine.config import EngineConfig
    from actors.engine.engine import RankEngine
    from actors.engine.messages import GenerateRequest
    from actors.engine.sampling import SamplingParams

    mc = ModelConfig.from_pretrained(model)
    opts = {"kv_bits": kv_bits, "kv_profile": "prose"} if kv_bits else {}
    eng = RankEngine(EngineConfig(model=model, max_model_len=context, kv_cache_bytes=256 << 20,
                                  max_num_seqs=batch, **opts),
                     ExpertPlacement.contiguous(mc.num_layers, mc.num_experts, 1))
    prompt = context - decode
    for b in range(batch):
        p = ids[b * 7: b * 7 + prompt]  # different prompts per sequence
        eng.add_request(GenerateRequest(request_id=f"s{b}", prompt_ids=p, params=SamplingParams(
            temperature=0.0, max_tokens=decode, ignore_eos=True).to_dict()))
    steps, done, kv = [], 0, float("nan")
    while done < batch:
        t0 = time.perf_counter()
        outs = eng.step()
        dt = time.perf_counter() - t0
        done += sum(o.finish_reason is not None for o in outs)
        n = eng.timing["steps"]
        if n > 1 and not any(o.finish_reason for o in outs):
            steps.append(dt)
            if hasattr(eng.cache, "memory_stats"):  # tokens in the cache now: prompt + (n - 1) per sequence
                kv = eng.cache.memory_stats()["kv_bytes_live"] / (batch * (prompt + n - 1))
    if not hasattr(eng.cache, "memory_stats"):  # full precision: report the fp16 paged layout for reference
        kv = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * 2
    return {"ms": statistics.median(steps) * 1e3 if steps else float("nan"), "kv_bytes_per_token": kv}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--contexts", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--batches", type=int, nargs="+", default=None, help="default 1 8 (1 with --quick)")
    ap.add_argument("--repeats", type=int, default=None, help="default 3 (1 with --quick)")
    ap.add_argument("--decode", type=int, default=None, help="decode steps timed (default 64; 24 with --quick)")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    batches = args.batches or ([1] if args.quick else [1, 8])
    repeats = args.repeats or (1 if args.quick else 3)
    decode = args.decode or (24 if args.quick else 64)
    torch.set_num_threads(1)
    ids = prose_ids(args.model, max(args.contexts) + 8 * 7)
    configs = [None, 4, 3, 2]
    res: dict = {}
    for rep in range(repeats):
        for ctx in args.contexts:
            for b in batches:
                for bits in configs:
                    r = run_once(args.model, bits, ctx, b, decode, ids)
                    res.setdefault((ctx, b, bits), []).append(r)
                    print(f"rep {rep} context {ctx} batch {b} {'fp' if bits is None else f'{bits}-bit'}: "
                          f"{r['ms']:.2f} ms/step", flush=True)

    def ms(ctx, b, bits):
        return statistics.median(r["ms"] for r in res[(ctx, b, bits)])

    print()
    print("| context | batch | KV | ms/token (per sequence) | tokens/s | vs full precision | KV bytes/token | vs fp16 |")
    print("|---|---|---|---|---|---|---|---|")
    for ctx in args.contexts:
        for b in batches:
            base = ms(ctx, b, None)
            fp16 = statistics.median(r["kv_bytes_per_token"] for r in res[(ctx, b, None)])
            for bits in configs:
                m = ms(ctx, b, bits)
                kvb = statistics.median(r["kv_bytes_per_token"] for r in res[(ctx, b, bits)])
                name = "full precision (paged)" if bits is None else f"ours {bits}-bit (prose profile)"
                kvs = f"{kvb:.1f}" if kvb == kvb else "-"
                print(f"| {ctx} | {b} | {name} | {m:.2f} | {b * 1000 / m:.1f} | {m / base:.2f}x | {kvs} | "
                      f"{kvb / fp16:.3f} |")
    c_lo, c_hi = min(args.contexts), max(args.contexts)
    print(f"RESULT fp_ms_{c_lo}={ms(c_lo, 1, None):.3f} q3_ms_{c_lo}={ms(c_lo, 1, 3):.3f} "
          f"ratio3_{c_lo}={ms(c_lo, 1, 3) / ms(c_lo, 1, None):.3f} fp_ms_{c_hi}={ms(c_hi, 1, None):.3f} "
          f"q3_ms_{c_hi}={ms(c_hi, 1, 3):.3f} ratio3_{c_hi}={ms(c_hi, 1, 3) / ms(c_hi, 1, None):.3f} "
          f"ratio2_{c_hi}={ms(c_hi, 1, 2) / ms(c_hi, 1, None):.3f}")


if __name__ == "__main__":
    main()
