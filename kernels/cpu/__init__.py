"""Fused CPU kernels for small-batch decode (C in kernels/csrc, compiled at first use); this package re-exports them.

Modules: `linear` (bf16-weight linear, residual add + RMSNorm), `packing` (bf16 weights in the panel GEMM's
layout, cached), `attention` (paged decode and causal prefill attention), `rope` (rotary embedding), `experts`
(SwiGLU experts with bf16 or fp32 weights, grouped by expert), `packed` (packed sub-4-bit weights: dequantize,
fused SwiGLU experts), `dispatch` (the fixed-capacity dispatch's send buffer, the combine's weighted sum), `shm`
(the shared-memory all-to-all's copies and futex wait), `routing` (the router's softmax and top-k), `predict` (the
expert predictor's decode-step bookkeeping), `parallel` (a call with many rows split over the rank's compute
threads: the C pool of kernels/csrc/pool.c), `_build` (compile, cache and load; holds the library), `_abi` (the C
entry points' ctypes argument structs).

Why. Decode at batch 1 on CPU is bound by two things: reading every weight once per token, and the per-op
overhead of eager PyTorch (~550 ops per token on the shipped model). These kernels read bf16 or packed weights
without materialising an fp32 copy, and replace a chain of small ops by one call.

Contract: every kernel has a PyTorch path with the same contract, used for other dtypes and devices, large
batches (more than `tuning.MAX_KERNEL_ROWS` rows; the bf16 GEMMs: `MAX_GEMM_ROWS`), or when the C code cannot be built. `linear` and `rms_norm`
run that path themselves and always return a result; every other wrapper returns None (`decode_attention`:
False; `MarkovTables.observe`: False) when it cannot run, having written nothing, and its caller then runs its
own PyTorch path. `cpu_kernels_available()` says whether the compiled code runs: not without a C compiler,
without AVX2/FMA, off x86-64, or with `MOERAY_DISABLE_CPU_KERNELS=1` (see `_build` for the build and cache).
The engine keeps weights bf16 only when it runs (`EngineConfig.weight_storage`).
"""
from kernels.cpu import parallel
from kernels.cpu._build import cpu_kernels_available
from kernels.cpu.attention import decode_attention, prefill_attention
from kernels.cpu.dispatch import pack_fixed_ids, pack_fixed_rows, weigh_rows
from kernels.cpu.experts import expert_ffn, shared_expert, swiglu_f32
from kernels.cpu.linear import linear, rms_norm
from kernels.cpu.packed import PackedFFNArgs, dequant_packed, packed_expert_ffn
from kernels.cpu.predict import GateLogprobs, MarkovTables, prefetch_step
from kernels.cpu.rope import rope

__all__ = [
    "GateLogprobs", "MarkovTables", "PackedFFNArgs", "cpu_kernels_available", "decode_attention", "dequant_packed",
    "expert_ffn", "linear", "pack_fixed_ids", "pack_fixed_rows", "parallel", "packed_expert_ffn", "prefetch_step",
    "prefill_attention", "rms_norm", "rope", "shared_expert", "swiglu_f32", "weigh_rows",
]
