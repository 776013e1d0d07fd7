"""Quantized paged decode attention on a GPU: achieved memory bandwidth at 8K-32K tokens of context.

Shape legend: B = sequences (batch), Hq = query heads (32), H = KV heads (8), D = head_dim (128), T = context
tokens per sequence, S = block size (16). A Llama/Mixtral-shaped attention layer (GQA 32:8, D = 128).

Measures `kernels.paged_attention_triton.paged_decode_attention_triton` (walks the block table, unpacks the b-bit
codes, dequantizes through the codebook, applies RoPE to keys in registers, online softmax) for one decode
step of B sequences of T tokens each, at 2, 3 and 4 bits, and reports ms per call, the bytes the call must read
(packed K and V codes + fp16 value scales + outlier channels of every block of every sequence; q, the output,
the codebooks and the RoPE tables are negligible), the achieved bandwidth (bytes / time) and its fraction of
the device's peak memory bandwidth. Dense fp16 attention over the same context (`scaled_dot_product_attention`
on materialised fp16 K/V, which reads 2 x 16 bits per element) is timed alongside: decode attention is
memory-bound, so the quantized kernel's speed-up over it approaches the byte ratio when the kernel saturates
bandwidth. Block contents are random codes (the cost does not depend on the values); the profile is fitted
on random calibration keys so the layout (outlier channels, codebooks) is the real one.

    python bench/gpu_kv.py                 # on a CUDA GPU (H100 / H200 peak known; else --peak-gbps)
    python bench/gpu_kv.py --quick         # fewer iterations, contexts 8K and 32K only
    TRITON_INTERPRET=1 python bench/gpu_kv.py --tiny   # tiny shapes on the CPU interpreter (a code-path test)

Last stdout line: `RESULT bw_frac_3b_8k=.. bw_frac_3b_32k=.. bw_frac_2b_32k=.. bw_frac_4b_32k=.. ms_3b_8k=..
ms_3b_32k=.. fp16_ms_32k=.. speedup_3b_32k=..` (bandwidth fraction 0 when the peak is unknown).
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.gpu_common import PEAK_GBPS, timed  # noqa: E402
from kernels.kv_calibrate import fit_kv_profile  # noqa: E402
from kernels.kv_pages import KVPages  # noqa: E402

def random_pages(profile, num_blocks: int, block_size: int, device, gen: torch.Generator) -> KVPages:
    """A page pool of `num_blocks` blocks with random codes, scales and outliers in the profile's layout."""
    p = KVPages.empty(profile, num_blocks=num_blocks, block_size=block_size)
    p.k_codes.random_(0, 256, generator=gen)
    p.v_codes.random_(0, 256, generator=gen)
    p.v_scale.copy_((torch.rand(p.v_scale.shape, generator=gen) * 0.1 + 0.01).half())
    p.k_outliers.copy_(torch.randn(p.k_outliers.shape, generator=gen).half())
    p.v_outliers.copy_(torch.randn(p.v_outliers.shape, generator=gen).half())
    return KVPages(**{f: getattr(p, f).to(device) for f in ("k_codes", "v_codes", "v_scale", "k_outliers",
                                                            "v_outliers")})


def pages_nbytes(pages: KVPages, blocks: int) -> int:
    """Bytes of `blocks` blocks of `pages` (every array, per block)."""
    per = sum(t[0].numel() * t.element_size() for t in (pages.k_codes, pages.v_codes, pages.v_scale,
                                                        pages.k_outliers, pages.v_outliers))
    return per * blocks


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (Hq=4, H=2, D=32, T=64): CPU interpreter")
    ap.add_argument("--quick", action="store_true", help="fewer iterations; contexts 8K and 32K")
    ap.add_argument("--batch", type=int, default=8, help="sequences per decode step")
    ap.add_argument("--peak-gbps", type=float, default=None, help="device peak memory bandwidth (GB/s)")
    a = ap.parse_args(argv)

    from kernels.paged_attention_triton import paged_decode_attention_triton
    from kernels.rope import rope_tables

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    if a.tiny:
        Hq, H, D, S, B = 4, 2, 32, 4, 2
        contexts = {"8k": 24, "32k": 40}  # labels kept so the RESULT keys are always present
    else:
        Hq, H, D, S, B = 32, 8, 128, 16, a.batch
        contexts = {"8k": 8192, "32k": 32768} if a.quick else {"8k": 8192, "16k": 16384, "32k": 32768}
    iters = 1 if (a.tiny and not cuda) else (10 if a.quick else 50)
    warmup = 0 if (a.tiny and not cuda) else 2  # the interpreter has nothing to warm up
    name = torch.cuda.get_device_name() if cuda else "cpu (Triton interpreter)"
    peak = a.peak_gbps or next((v for k, v in PEAK_GBPS.items() if k in name), 0.0)
    gen = torch.Generator().manual_seed(0)
    dtype = torch.float16 if cuda else torch.float32  # the interpreter is wrong for bf16
    print(f"device: {name}; peak {peak or 'unknown'} GB/s; attention Hq={Hq} H={H} D={D} block {S}, batch {B}")
    print(f"{'KV':>6} {'context':>8} {'MiB read':>9} {'ms':>9} {'GB/s':>8} {'of peak':>8} {'vs fp16':>8}")
    res: dict[str, float] = {}
    k_cal, v_cal = torch.randn(512, H, D, generator=gen), torch.randn(512, H, D, generator=gen)
    max_t = max(contexts.values())
    cos, sin = rope_tables(max_t + 1, D)
    cos, sin = cos.to(dev), sin.to(dev)
    fp16_ms: dict[str, float] = {}
    for label, T in contexts.items():  # dense fp16 baseline: materialised K/V, one SDPA call
        k = torch.randn(B, Hq, T, D, generator=gen).to(dev, dtype)
        v = torch.randn(B, Hq, T, D, generator=gen).to(dev, dtype)
        q = torch.randn(B, Hq, 1, D, generator=gen).to(dev, dtype)
        kv = k[:, ::Hq // H], v[:, ::Hq // H]  # the GQA cache holds H heads; SDPA reads them per query group
        ms = timed(lambda q=q, kv=kv: torch.nn.functional.scaled_dot_product_attention(
            q, kv[0].repeat_interleave(Hq // H, 1), kv[1].repeat_interleave(Hq // H, 1)), iters, cuda, warmup)
        fp16_ms[label] = ms
        nbytes = 2 * B * H * T * D * 2
        gbps = nbytes / (ms * 1e-3) / 1e9
        print(f"{'fp16':>6} {T:>8} {nbytes / 2**20:>9.2f} {ms:>9.3f} {gbps:>8.1f} "
              f"{(gbps / peak if peak else 0.0):>8.3f} {1.0:>8.2f}")
        del k, v, kv
    for bits in (2, 3, 4):
        prof = fit_kv_profile(k_cal, v_cal, bits=bits, n_outlier=1 if bits == 2 else 0).to(dev)
        for label, T in contexts.items():
            nb = math.ceil(T / S)
            pages = random_pages(prof, B * nb, S, dev, gen)
            table = torch.randperm(B * nb, generator=gen).view(B, nb).to(dev, torch.int32)
            lens = torch.full((B,), T, dtype=torch.int32, device=dev)
            q = torch.randn(B, Hq, D, generator=gen).to(dev, dtype)
            ms = timed(lambda q=q, pages=pages, table=table, lens=lens, prof=prof: paged_decode_attention_triton(
                q, pages, table, lens, prof, cos, sin, D ** -0.5), iters, cuda, warmup)
            nbytes = pages_nbytes(pages, B * nb)
            gbps = nbytes / (ms * 1e-3) / 1e9
            frac = gbps / peak if peak else 0.0
            res[f"bw_frac_{bits}b_{label}"], res[f"ms_{bits}b_{label}"] = frac, ms
            res[f"speedup_{bits}b_{label}"] = fp16_ms[label] / ms
            print(f"{bits:>4}-b {T:>8} {nbytes / 2**20:>9.2f} {ms:>9.3f} {gbps:>8.1f} {frac:>8.3f} "
                  f"{fp16_ms[label] / ms:>8.2f}")
            del pages
    res["fp16_ms_32k"] = fp16_ms["32k"]
    keys = ["bw_frac_3b_8k", "bw_frac_3b_32k", "bw_frac_2b_32k", "bw_frac_4b_32k", "ms_3b_8k", "ms_3b_32k",
            "fp16_ms_32k", "speedup_3b_32k"]
    print("RESULT " + " ".join(f"{k}={res.get(k, 0.0):.4f}" for k in keys))
    return 0


if __name__ == "__main__":
    sys.exit(main())
