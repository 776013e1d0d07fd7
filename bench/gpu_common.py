"""Shared by the GPU kernel benchmarks (`bench/gpu_experts.py`, `bench/gpu_kv.py`): peak memory bandwidth of
known devices and a timer that uses CUDA events on a GPU and the wall clock elsewhere."""
from __future__ import annotations

import time

import torch

# peak HBM bandwidth in GB/s by device-name substring (vendor data sheets); others need --peak-gbps
PEAK_GBPS = {"H200": 4800.0, "H100 NVL": 3900.0, "H100": 3350.0, "A100": 2039.0, "L40S": 864.0}


def timed(fn, iters: int, cuda: bool, warmup: int = 2) -> float:
    """Mean ms per call of `fn()` over `iters` calls, after `warmup` calls (CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) * 1e3 / iters
