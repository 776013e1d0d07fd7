"""Packed-expert layer on a GPU: Mixtral-8x7B-shaped experts, random weights, 3 / 4 bits, batch 1 and 16.

Shape legend: E = experts (8), D = hidden (4096), I = expert intermediate (14336), B = tokens (batch), K = 2.

Measures the fused dequant grouped-GEMM expert FFN (`kernels.packed_weights_triton.packed_expert_ffn`) on one
MoE layer: every token routed to K random experts, and reports ms per layer call, the bytes of packed weights
the call must read (codes + fp16 scales and zeros of the experts used; activations are negligible), the
achieved bandwidth (bytes / time) and its fraction of the device's peak memory bandwidth. A dense fp16 run of
the same experts (`torch.matmul` on dequantized weights) is timed alongside for reference. Decode at batch 1
is memory-bound, so the bandwidth fraction is the figure of merit (Marlin, arXiv 2408.11743, reaches ~0.8+ on
4-bit dense layers).

    python bench/gpu_experts.py            # on a CUDA GPU (H100 / H200 peak bandwidth known; else --peak-gbps)
    TRITON_INTERPRET=1 python bench/gpu_experts.py --tiny   # tiny shapes, CPU interpreter (a code-path test)

Last stdout line: `RESULT bw_frac_3b_b1=.. bw_frac_4b_b1=.. bw_frac_3b_b16=.. bw_frac_4b_b16=.. ms_3b_b1=..
ms_4b_b1=.. ms_3b_b16=.. ms_4b_b16=.. fp16_ms_b1=.. fp16_ms_b16=..` (bandwidth fraction 0 when the peak is
unknown).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.gpu_common import PEAK_GBPS, timed  # noqa: E402
from kernels.packed_format import PackedExperts, PackedWeight, words_per_row  # noqa: E402

def random_packed(e: int, n: int, k: int, bits: int, group: int, device) -> PackedWeight:
    """Random codes with plausible fp16 scales / zeros (the kernel's cost does not depend on the values)."""
    w = words_per_row(k, bits)
    codes = torch.randint(-(2**31), 2**31 - 1, (e, n, w), dtype=torch.int32, device=device)
    spare = w * 32 - k * bits
    if spare:  # keep the format's zero padding at the end of each row
        codes[..., -1] &= (1 << (32 - spare)) - 1
    g = -(-k // group)
    scales = (torch.rand(e, n, g, device=device) * 0.01 + 1e-3).half()
    zeros = torch.full((e, n, g), float((1 << bits) // 2), device=device).half()
    return PackedWeight(codes=codes, scales=scales, zeros=zeros, bits=bits, group_size=group, shape=(e, n, k))


def routing(b: int, e: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """`[B, K]` distinct random experts per token."""
    return torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(b)])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (E=4, D=64, I=96): runs under TRITON_INTERPRET=1")
    ap.add_argument("--quick", action="store_true", help="fewer timing iterations")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--peak-gbps", type=float, default=None, help="device peak memory bandwidth (GB/s)")
    a = ap.parse_args(argv)

    from kernels import packed_weights_triton as tri
    from kernels.packed_weights import dequantize

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    E, D, I, K = (4, 64, 96, 2) if a.tiny else (8, 4096, 14336, 2)
    batches = (1, 16)
    dtype = torch.float16 if cuda else torch.float32  # the interpreter is wrong for bf16; fp32 on CPU
    iters = 1 if (a.tiny and not cuda) else (10 if a.quick else 50)
    name = torch.cuda.get_device_name() if cuda else "cpu (Triton interpreter)"
    peak = a.peak_gbps or next((v for k, v in PEAK_GBPS.items() if k in name), 0.0)
    gen = torch.Generator().manual_seed(0)
    res: dict[str, float] = {}
    print(f"device: {name}; peak {peak or 'unknown'} GB/s; layer E={E} D={D} I={I} top-{K}; dtype {dtype}")
    print(f"{'weights':>8} {'batch':>5} {'experts':>7} {'MiB read':>9} {'ms':>9} {'GB/s':>8} {'of peak':>8}")
    dense = {}
    for bits in (3, 4):
        experts = PackedExperts(gate_up=random_packed(E, 2 * I, D, bits, a.group_size, dev),
                                down=random_packed(E, D, I, bits, a.group_size, dev))
        per_expert = experts.nbytes / E
        if bits == 4:
            dense = {"gu": dequantize(experts.gate_up, dtype), "dn": dequantize(experts.down, dtype)}
        for b in batches:
            ids = routing(b, E, K, gen)
            flat = ids.flatten()
            order = torch.argsort(flat, stable=True)
            counts = torch.bincount(flat, minlength=E).to(dev)
            x = torch.randn(b, D, generator=gen).to(dev, dtype)
            xs = x[(order // K).to(dev)].contiguous()
            used = int((counts > 0).sum())
            nbytes = used * per_expert + 2 * xs.numel() * xs.element_size()
            ms = timed(lambda xs=xs, counts=counts, experts=experts: tri.packed_expert_ffn(xs, counts, experts),
                       iters, cuda)
            gbps = nbytes / (ms * 1e-3) / 1e9
            frac = gbps / peak if peak else 0.0
            res[f"bw_frac_{bits}b_b{b}"], res[f"ms_{bits}b_b{b}"] = frac, ms
            print(f"{bits:>6}-b {b:>5} {used:>7} {nbytes / 2**20:>9.2f} {ms:>9.3f} {gbps:>8.1f} {frac:>8.3f}")
    for b in batches:
        ids = routing(b, E, K, gen)
        x = torch.randn(b, D, generator=gen).to(dev, dtype)

        def dense_call(x=x, ids=ids) -> None:
            for e in ids.flatten().unique().tolist():
                g, u = (x @ dense["gu"][e].T).chunk(2, dim=-1)
                (torch.nn.functional.silu(g) * u) @ dense["dn"][e].T

        used = int(ids.flatten().unique().numel())
        ms = timed(dense_call, iters, cuda)
        nbytes = used * 3 * D * I * torch.finfo(dtype).bits // 8
        gbps = nbytes / (ms * 1e-3) / 1e9
        res[f"fp16_ms_b{b}"] = ms
        print(f"{'dense':>8} {b:>5} {used:>7} {nbytes / 2**20:>9.2f} {ms:>9.3f} {gbps:>8.1f} "
              f"{(gbps / peak if peak else 0.0):>8.3f}")
    keys = ["bw_frac_3b_b1", "bw_frac_4b_b1", "bw_frac_3b_b16", "bw_frac_4b_b16", "ms_3b_b1", "ms_4b_b1",
            "ms_3b_b16", "ms_4b_b16", "fp16_ms_b1", "fp16_ms_b16"]
    print("RESULT " + " ".join(f"{k}={res.get(k, 0.0):.4f}" for k in keys))
    return 0


if __name__ == "__main__":
    sys.exit(main())
