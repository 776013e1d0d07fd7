"""Linear layers with bf16-stored weights and fp32 activations on CPU (decode GEMV / skinny GEMM).

Shape legend: M = rows (tokens), K = input features, N = output features. A layer computes
`y[M, N] = x[M, K] @ w[N, K].T (+ b[N])`.

Why: decode at small batch reads every weight once per token, so on CPU a step is bound by memory traffic
(measured on the 2-core test machine: a [256, 256] fp32 GEMV at batch 1 costs ~60 us when the weight comes
from DRAM against ~17 us when it sits in cache). A checkpoint stored in bf16 (the shipped one is) loses
nothing when its matrices stay bf16 in memory: every weight value is exactly the checkpoint's. This kernel
reads bf16 weights, widens them to fp32 in registers (a bf16 is the top half of an fp32, so widening is a
16-bit shift: exact) and accumulates in fp32 with FMA, so the result equals an fp32 `F.linear` over the
widened weights up to summation order (|diff| ~ 1e-6 relative), at half the weight bytes.

torch has no CPU op that multiplies fp32 activations by bf16 weights without first materialising an fp32
copy of the weight, hence this small C kernel (AVX2 + FMA, one thread). It is compiled at first use with
the system C compiler (`$CC`, else `cc`) into `$MOERAY_KERNEL_CACHE` (default `~/.cache/moeray/kernels`),
keyed by a hash of the source and flags, and called through `ctypes` (which releases the GIL). When it
cannot be used (no compiler, no AVX2/FMA, not x86-64, `MOERAY_DISABLE_CPU_KERNELS=1`), `linear` falls back
to widening the weight and calling `F.linear`: same numbers, no speed-up. `bf16_linear_available()` says
which path runs; the engine keeps weights bf16 only when it is True (`EngineConfig.weight_storage`).
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
import threading

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

# the kernel runs batches of at most this many rows; larger batches (prefill) widen the weight once and run
# torch's GEMM, where the O(M N K) work hides the widening and torch's threads help
MAX_KERNEL_ROWS = 16

_FLAGS = ["-O3", "-mavx2", "-mfma", "-shared", "-fPIC", "-std=c99"]

_SOURCE = r"""
#include <stdint.h>
#include <immintrin.h>

/* 8 bf16 -> 8 fp32: zero-extend to 32 bits and shift into the high half (exact). */
static inline __m256 load8(const uint16_t *p) {
    __m128i h = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
static inline float widen(uint16_t h) {
    union { uint32_t u; float f; } c;
    c.u = (uint32_t)h << 16;
    return c.f;
}

/* one output: dot(x[0:K], widen(w[0:K])); two accumulators break the FMA dependency chain while the
   weight row is still read as one sequential stream (4 interleaved rows measured ~1.5x slower). */
static inline float dot1(const float *x, const uint16_t *wn, long K) {
    const long K16 = K & ~15L, K8 = K & ~7L;
    __m256 a = _mm256_setzero_ps(), c = a;
    long k = 0;
    for (; k < K16; k += 16) {
        a = _mm256_fmadd_ps(load8(wn + k), _mm256_loadu_ps(x + k), a);
        c = _mm256_fmadd_ps(load8(wn + k + 8), _mm256_loadu_ps(x + k + 8), c);
    }
    for (; k < K8; k += 8) a = _mm256_fmadd_ps(load8(wn + k), _mm256_loadu_ps(x + k), a);
    float s = hsum(_mm256_add_ps(a, c));
    for (; k < K; k++) s += widen(wn[k]) * x[k];
    return s;
}

/* y[m*sy + n] = sum_k x[m*sx + k] * w[n*K + k] (+ b[n]).  w: [N, K] bf16 bits, row-major, contiguous. */
void moeray_linear_bf16w(const float *x, long sx, const uint16_t *w, const float *b, float *y, long sy,
                         long M, long N, long K) {
    const long K8 = K & ~7L, M4 = M & ~3L;
    for (long n = 0; n < N; n++) {  /* each weight row leaves memory once; blocks of 4 rows of x reuse it */
        const uint16_t *wn = w + n * K;
        const float bn = b ? b[n] : 0.0f;
        for (long m0 = 0; m0 < M4; m0 += 4) {
            const float *x0 = x + m0 * sx, *x1 = x0 + sx, *x2 = x1 + sx, *x3 = x2 + sx;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (long k = 0; k < K8; k += 8) {
                const __m256 wv = load8(wn + k);
                a0 = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x0 + k), a0);
                a1 = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x1 + k), a1);
                a2 = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x2 + k), a2);
                a3 = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x3 + k), a3);
            }
            float s0 = hsum(a0), s1 = hsum(a1), s2 = hsum(a2), s3 = hsum(a3);
            for (long k = K8; k < K; k++) {
                const float wk = widen(wn[k]);
                s0 += wk * x0[k]; s1 += wk * x1[k]; s2 += wk * x2[k]; s3 += wk * x3[k];
            }
            y[m0 * sy + n] = s0 + bn; y[(m0 + 1) * sy + n] = s1 + bn;
            y[(m0 + 2) * sy + n] = s2 + bn; y[(m0 + 3) * sy + n] = s3 + bn;
        }
        for (long m = M4; m < M; m++) y[m * sy + n] = dot1(x + m * sx, wn, K) + bn;
    }
}
"""

_lock = threading.Lock()
_fn = None  # the ctypes function once loaded
_tried = False


def _cpu_supports_avx2_fma() -> bool:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx2" in flags and "fma" in flags


def _build() -> ctypes.CDLL:
    cc = os.environ.get("CC", "cc")
    key = hashlib.sha256((_SOURCE + " ".join(_FLAGS) + cc).encode()).hexdigest()[:16]
    cache = os.environ.get("MOERAY_KERNEL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "moeray", "kernels")
    os.makedirs(cache, exist_ok=True)
    so = os.path.join(cache, f"linear_bf16w_{key}.so")
    if not os.path.isfile(so):
        # build under a private name, then rename: ranks starting together never load a half-written file
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            src = os.path.join(tmp, "linear_bf16w.c")
            with open(src, "w") as f:
                f.write(_SOURCE)
            out = os.path.join(tmp, "k.so")
            subprocess.run([cc, *_FLAGS, src, "-o", out], check=True, capture_output=True, timeout=120)
            os.replace(out, so)
    return ctypes.CDLL(so)


def _load():
    global _fn, _tried
    if _tried:
        return _fn
    with _lock:
        if _tried:
            return _fn
        if os.environ.get("MOERAY_DISABLE_CPU_KERNELS") == "1" or not _cpu_supports_avx2_fma():
            _tried = True
            return None
        try:
            fn = _build().moeray_linear_bf16w
            fn.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                           ctypes.c_long, ctypes.c_long, ctypes.c_long, ctypes.c_long]
            fn.restype = None
            _fn = fn
        except (OSError, subprocess.SubprocessError, AttributeError) as e:
            detail = getattr(e, "stderr", b"") or b""
            log.warning("bf16-weight CPU kernel unavailable (%s %s); using the widen-then-F.linear fallback",
                        e, detail.decode(errors="replace")[:500])
        _tried = True
        return _fn


def bf16_linear_available() -> bool:
    """True when the compiled bf16-weight kernel can run on this machine (compiles it on first call)."""
    return _load() is not None


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` that also takes a bf16 weight with fp32 activations.

    Args:
        x: [M, K] (or [K], or any [..., K]) activations. w: [N, K] weight, x's dtype or bf16.
        b: optional [N] bias in x's dtype.
    Returns:
        [..., N] in x's dtype. With w in x's dtype this is exactly `F.linear`. With a bf16 `w`, fp32 `x` on CPU
        and at most `MAX_KERNEL_ROWS` rows, the compiled kernel runs (fp32 accumulation over the exactly
        widened weights); otherwise the weight is widened to x's dtype and `F.linear` runs.
    Raises:
        RuntimeError: as `F.linear` for mismatched shapes (the kernel path checks K and the bias length).
    """
    if w.dtype == x.dtype:
        return F.linear(x, w, b)
    if (w.dtype == torch.bfloat16 and x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2
            and x.shape[0] <= MAX_KERNEL_ROWS and w.is_contiguous() and x.stride(1) == 1):
        fn = _fn if _tried else _load()
        if fn is not None:
            M, K = x.shape
            N = w.shape[0]
            if w.shape[1] != K or (b is not None and (b.shape != (N,) or b.dtype != x.dtype or not b.is_contiguous())):
                raise RuntimeError(f"linear: x {tuple(x.shape)}, w {tuple(w.shape)}, "
                                   f"b {None if b is None else tuple(b.shape)} do not match")
            y = torch.empty(M, N, dtype=x.dtype)
            if M:
                fn(x.data_ptr(), x.stride(0), w.data_ptr(), b.data_ptr() if b is not None else None, y.data_ptr(),
                   N, M, N, K)
            return y
    return F.linear(x, w.to(x.dtype), b)
