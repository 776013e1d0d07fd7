"""Row-split parallelism of one rank's compute: a call with many rows runs on the rank's compute threads.

Role. The compiled kernels are single-threaded C. A call with many rows (a prefill chunk, a large decode batch)
is split into contiguous row ranges, one per compute thread; every range runs the same kernel on its own rows and
writes its own rows of one preallocated output. Two ways to run the ranges at once:
- `run_kernel`: compiled kernels (linear, RMSNorm, grouped experts) on the C pool (kernels/csrc/pool.c: one call,
  ~5 us of handoff, no GIL);
- `run_ranges`: any Python function of (lo, hi) whose work releases the GIL (torch's ops: prefill attention),
  on Python threads (~80 us of handoff: for coarse work only).
vLLM's CPU backend gets the same from OpenMP inside its kernels (`VLLM_CPU_OMP_THREADS_BIND`).

Invariants.
- Results are bit-identical to one call: ranges are disjoint, cover [0, M) and start at multiples of `ROW_ALIGN`
  (every kernel split here computes each row on its own, in the same order of operations, whatever its
  neighbours: the panel GEMM sums each output over k in one lane, RMSNorm and attention are per row / per head).
- Few rows run inline (`tuning.PARALLEL_ROWS`): handing a range to a thread costs ~30 us, a decode row ~2 us.
- The helper threads are made once per process (`set_threads`); between calls the C helpers spin up to
  `STEP_SPIN_S`, then sleep on a futex, and `park` (the engine, at the end of every step) sends them to sleep at
  once; the Python ones sleep in a queue. So the calls of one step find their helpers awake (a futex wake-up
  costs ~40 us on a 2-vCPU KVM guest: a 500-token prefill 18.4 -> 16.7-17.2 ms, BENCHMARKS.md) and a rank with
  nothing to split leaves its other cores alone, unlike an OpenMP pool's spin-wait (measured here: torch with 2 OpenMP threads beside these made a 500-token
  prefill slower, 28.6 -> 31.8 ms, so a rank running these kernels keeps torch at one thread).
- Helpers run in the caller's inference mode (thread-local in torch). A forked child starts on one thread (its
  parent's helpers do not exist there; the C pool then runs every share on the caller).
- An exception on any range is raised to the caller after every range has finished (no range outlives the call).
"""
from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from kernels import tuning
from kernels.cpu import _build

# task kinds of `moeray_pool_run` (kernels/csrc/pool.c), each with its argument struct (kernels.cpu._abi)
TASK_LINEAR, TASK_RMS_NORM, TASK_EXPERT_FFN, TASK_PREFILL_ATTENTION = 0, 1, 2, 3

ROW_ALIGN = 16  # range starts: a multiple of every kernel's row tile (panel GEMM: 8 rows), so tiles stay whole

# how long the C helpers spin for the next call of a step before sleeping (the engine parks them after each step)
STEP_SPIN_S = float(os.environ.get("MOERAY_POOL_SPIN_S", "0.001"))

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_threads = 1


def set_threads(n: int) -> None:
    """Compute threads of this process (a rank's `num_threads_per_rank`): the caller plus n - 1 helpers.

    Raises:
        ValueError: n < 1.
    """
    global _pool, _threads
    if n < 1:
        raise ValueError(f"compute threads must be >= 1, got {n}")
    with _lock:
        if _pool is not None:
            _pool.shutdown(wait=True)
        _pool = ThreadPoolExecutor(n - 1, thread_name_prefix="moeray-compute") if n > 1 else None
        lib = _build.lib()
        if lib is not None and n > 1:
            n = min(n, 1 + int(lib.moeray_pool_start(n - 1)))  # the C pool only grows; its cap: 63 helpers
            lib.moeray_pool_set_spin(int(STEP_SPIN_S * 1e9))
        _threads = n


def park() -> None:
    """The end of a step: the C helpers spinning for a next call go to sleep now (the next call wakes them)."""
    if _threads > 1:
        lib = _build.lib()
        if lib is not None:
            lib.moeray_pool_park()


def _forget_after_fork() -> None:  # a forked child has none of the parent's threads: one thread until told
    global _pool, _threads, _lock
    _pool, _threads, _lock = None, 1, threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)


def threads() -> int:
    """This process's compute threads (1 unless `set_threads` said otherwise)."""
    return _threads


def row_ranges(M: int, min_rows: int | None = None) -> list[tuple[int, int]]:
    """Split rows [0, M) into at most `threads()` ranges of at least `min_rows` (default `tuning.PARALLEL_ROWS`)
    rows, each starting at a multiple of `ROW_ALIGN`; one range [(0, M)] when M is too small to split (decode
    calls: returned before any other work, the hot path pays one comparison)."""
    min_rows = tuning.PARALLEL_ROWS if min_rows is None else max(min_rows, 1)
    if _threads == 1 or M < 2 * min_rows:
        return [(0, M)]
    parts = min(_threads, M // min_rows)
    step = -(-M // parts)
    step = -(-step // ROW_ALIGN) * ROW_ALIGN
    bounds = list(range(0, M, step)) + [M]
    return list(zip(bounds[:-1], bounds[1:]))


def _in_mode(inference: bool, fn: Callable[[int, int], None], lo: int, hi: int) -> None:
    with torch.inference_mode(inference):  # thread-local: the helper takes the caller's (in-place writes need it)
        fn(lo, hi)


def run_ranges(fn: Callable[[int, int], None], ranges: list[tuple[int, int]]) -> None:
    """Run `fn(lo, hi)` for every range: the first on the calling thread, the others on the helpers.

    Raises:
        Whatever `fn` raised (the first range's error first), after every range has finished.
    """
    pool = _pool
    if len(ranges) == 1 or pool is None:
        for lo, hi in ranges:
            fn(lo, hi)
        return
    futures = [pool.submit(_in_mode, torch.is_inference_mode_enabled(), fn, lo, hi) for lo, hi in ranges[1:]]
    err: BaseException | None = None
    try:
        fn(*ranges[0])
    except BaseException as e:  # noqa: BLE001 - re-raised below once every range is done
        err = e
    for f in futures:
        e = f.exception()
        err = err or e
    if err is not None:
        raise err


def run_kernel(kind: int, args: Sequence[ctypes.Structure]) -> int:
    """Run compiled kernel `kind` (a `TASK_*`) on every argument struct at once: the first on the calling thread,
    the others on the C pool's helpers. The structs must describe disjoint outputs.

    Returns:
        The first nonzero kernel result in `args` order (the kernels' own error codes), else 0.
    Raises:
        RuntimeError: the compiled kernels are not built.
    """
    lib = _build.lib()
    if lib is None:
        raise RuntimeError("run_kernel: the CPU kernels are not built")
    arr = (type(args[0]) * len(args))(*args)
    return int(lib.moeray_pool_run(kind, ctypes.addressof(arr), ctypes.sizeof(type(args[0])), len(args)))
