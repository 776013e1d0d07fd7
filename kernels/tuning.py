"""Row-count thresholds that pick a decode-step code path: one home, each with the measurement behind it.

Each constant chooses between a path tuned for few rows (decode: launch- and Python-bound) and one for many rows
(prefill, large batches: compute-bound). Read them as module attributes (`tuning.SMALL_ROWS`) so a test or an A/B
run can change one in one place. Timings are kept in BENCHMARKS.md (`bench/decode.py`, `bench/experts.py`,
`bench/gating.py`, `bench/collective_latency.py`), not here.
"""
from __future__ import annotations

import os

# `kernels.cpu`: the compiled row-by-row kernels (packed experts, predictor) run batches of at most this many rows;
# larger batches (prefill) widen the weight once and run torch's GEMM, where the O(M N K) work hides the widening.
MAX_KERNEL_ROWS = 16

# `kernels.cpu.linear` / `expert_ffn` (bf16 weights, the blocked GEMM of kernels/csrc/gemm.c): at most this many
# rows per call. On one thread the blocked kernel keeps pace with MKL's fp32 GEMM at every row count measured
# (BENCHMARKS.md); beyond it (long prefills) torch's GEMM runs, whose threads help when a rank has several.
MAX_GEMM_ROWS = 1024

# `kernels.cpu.parallel`: calls with at least this many rows per compute thread are split over a rank's threads
# (linear, RMSNorm, grouped experts, prefill attention); fewer run on one (a handoff costs ~30 us). 64 keeps decode
# batches up to 127 rows on one thread; a 500-token prefill with 2 threads: 40 -> 30 ms (BENCHMARKS.md).
PARALLEL_ROWS = 64

# `kernels.cpu.packing`: most bytes of packed (panel-layout) copies of bf16 weights, all weights together; each
# copy costs its weight's bf16 bytes (tiny-moe: ~18 MB for every dense matrix and expert). Past it, weights run
# the row-major kernel. `MOERAY_PANEL_CACHE_BYTES` overrides it (0: never pack).
PANEL_CACHE_BYTES = 1 << 30

# `actors.moe.experts.LocalExperts` without the compiled kernel (fp32 weights): at most this many rows with
# distinct experts run row by row (decode batches): fewer ops than sort + scatter.
SMALL_ROWS = 4

# `actors.experts` runtime: a step of at most this many token x expert cells does its prediction bookkeeping on
# Python lists (decode); larger steps use tensor ops (on tiny-moe, E = 8, batch 1: the tensor path cost about a
# whole step's expert compute per MoE layer; see BENCHMARKS.md, bench/experts.py).
SMALL_STEP_CELLS = 512

# `actors.moe.gating`: `sticky` decode rows up to which the list form of the rule runs instead of tensor ops.
STICK_LIST_ROWS = 32

# `actors.moe.dispatch`: fixed-capacity all-to-all when every rank sends every rank at most this many rows (no
# count exchange, one collective); `MOERAY_FIXED_DISPATCH_ROWS` sets it for A/B runs (0: always exchange counts).
FIXED_MAX_ROWS = int(os.environ.get("MOERAY_FIXED_DISPATCH_ROWS", "256"))
