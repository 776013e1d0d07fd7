"""Causal prefill attention: the compiled kernel (`kernels.cpu.prefill_attention`) against the PyTorch path it
replaced (`actors.model.attention.paged_attention_ref`: the blocks gathered, then SDPA with its causal kernel, KV
heads split over the compute threads), in one process, interleaved, on the shipped model's attention shape.

Per prompt length n (a whole prompt: n new tokens over n keys) and compute-thread count: the best of `--rounds`
timings of `--reps` calls each, in microseconds, and the kernel's rate in GFLOP/s of causal work (4 * H * Dh *
n^2 / 2 flops: scores and weighted values of the lower triangle). Random fp32 K/V in a paged cache with a shuffled
block table, as a prefill writes it.

    python bench/prefill_attention.py            # n = 128, 500, 2000, 4000 on 1 and 2 threads
    python bench/prefill_attention.py --quick    # n = 500, 2000

Last line: RESULT speedup_500_t1=.. speedup_500_t2=.. speedup_2000_t1=.. speedup_2000_t2=.. gflops_500_t1=..
(speedup: PyTorch time / kernel time; 0 where the kernel cannot run on this CPU, which then keeps PyTorch's path).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from actors.model.attention import AttentionMetadata, paged_attention_ref  # noqa: E402
from cluster.config import DEFAULT_MODEL  # noqa: E402
from kernels.cpu import parallel, prefill_attention  # noqa: E402


def best_us(fn, reps: int, rounds: int) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = json.load(open(os.path.join(DEFAULT_MODEL, "config.json")))
    H, Hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    Dh = cfg.get("head_dim", cfg["hidden_size"] // H)
    S = 16
    lengths = [500, 2000] if args.quick else [128, 500, 2000, 4000]
    g = torch.Generator().manual_seed(0)
    rows, res = [], {}
    for n in lengths:
        nb = -(-n // S)
        kc, vc = torch.randn(nb + 4, S, Hkv, Dh, generator=g), torch.randn(nb + 4, S, Hkv, Dh, generator=g)
        table = torch.randperm(nb + 4, generator=g)[:nb]
        q = torch.randn(n, H, Dh, generator=g)
        out = torch.empty_like(q)
        meta = AttentionMetadata(slot_mapping=torch.zeros(n, dtype=torch.int64),
                                 decode_tokens=torch.zeros(0, dtype=torch.int64),
                                 decode_block_tables=torch.zeros(0, 1, dtype=torch.int64),
                                 decode_context_lens=torch.zeros(0, dtype=torch.int64), prefills=[(0, n, n, table)])
        reps = max(2, int(2e5 // (n * n / 100 + 1)))
        for th in (1, 2):
            parallel.set_threads(th)
            ok = prefill_attention(q, kc, vc, table, n, Dh ** -0.5, out)
            ref_us = best_us(lambda: paged_attention_ref(q, kc, vc, meta, Dh ** -0.5), reps, args.rounds)
            k_us = best_us(lambda: prefill_attention(q, kc, vc, table, n, Dh ** -0.5, out), reps, args.rounds) if ok else 0.0
            gflops = 4 * H * Dh * n * n / 2 / (k_us * 1e3) if ok else 0.0
            res[(n, th)] = (ref_us / k_us if ok else 0.0, gflops)
            rows.append((n, th, ref_us, k_us, res[(n, th)][0], gflops))
    parallel.set_threads(1)
    print(f"\nshape: H={H} query heads, Hkv={Hkv} KV heads, Dh={Dh}, block {S}; best of {args.rounds} rounds")
    print("| prompt tokens | threads | PyTorch (gather + SDPA) us | kernel us | speedup | kernel GFLOP/s |")
    print("|---|---|---|---|---|---|")
    for n, th, r, k, sp, gf in rows:
        print(f"| {n} | {th} | {r:.0f} | {k:.0f} | {sp:.2f} | {gf:.1f} |")

    def key(n, th, i):
        return res.get((n, th), (0.0, 0.0))[i]
    print(f"RESULT speedup_500_t1={key(500, 1, 0):.3f} speedup_500_t2={key(500, 2, 0):.3f} "
          f"speedup_2000_t1={key(2000, 1, 0):.3f} speedup_2000_t2={key(2000, 2, 0):.3f} "
          f"gflops_500_t1={key(500, 1, 1):.1f}")


if __name__ == "__main__":
    main()
