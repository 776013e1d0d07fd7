"""The kernels a layer's experts run on: the backend's fused dequant ops (`kernel_ops`) and where the compiled CPU
fused path serves misses (`fused_path_runs`).

Contract: both backends compute the same function (`packed_expert_ffn(x [R, D], counts [E], packed) -> [R, D]`
rows sorted by expert; `dequantize(pw, dtype) -> dense weight`); the choice is made once, when a layer is built.
"""
from __future__ import annotations

import os
import threading
from collections.abc import Callable

import torch

from kernels.cpu import cpu_kernels_available


# The Triton interpreter patches `triton.language` globally while a kernel runs, so two threads must not
# interpret kernels at once (the prefetch worker's dequantize would break the forward's GEMM).
_INTERPRETER_LOCK = threading.Lock()


def _serialized(fn: Callable) -> Callable:
    def run(*a, **kw):
        with _INTERPRETER_LOCK:
            return fn(*a, **kw)

    return run


def kernel_ops(backend: str):
    """(packed_expert_ffn, dequantize) of the backend: "torch" (reference) or "triton"."""
    if backend == "torch":
        from kernels import packed_weights as k
    elif backend == "triton":
        from kernels import packed_weights_triton as k

        if os.environ.get("TRITON_INTERPRET", "0") == "1":
            return _serialized(k.packed_expert_ffn), _serialized(k.dequantize)
    else:
        raise ValueError(f"kernel_backend={backend!r} must be torch or triton")
    return k.packed_expert_ffn, k.dequantize


def fused_path_runs(device: torch.device | str, backend: str, dtype: torch.dtype) -> bool:
    """True where a decode-sized miss runs the compiled fused kernel on the packed bytes
    (`kernels.cpu.packed_expert_ffn`: CPU, the torch backend, fp32 activations, kernels built).

    There the dequantized expert cache does not pay, so `expert_cache_capacity` defaults to 0: the fused kernel
    reads ~4.5 bits per weight (4-bit, group 64) and unpacks in registers, while a cached fp32 copy is 32 bits per
    weight to read (the measurements: BENCHMARKS.md, `bench/experts.py`).
    """
    return (torch.device(device).type == "cpu" and backend == "torch" and dtype == torch.float32
            and cpu_kernels_available())
