"""Fused CPU kernels for small-batch decode: bf16-weight linear, RMSNorm, paged decode attention, expert FFNs.

Shape legend: M = rows (tokens), K = input features, N = output features, D = hidden, I = expert intermediate,
E = experts, R = expert rows, B = decode sequences, H = query heads, Hkv = KV heads, Dh = head_dim,
S = block size (tokens), NB = cache blocks, MB = blocks per block table.

Why. Decode at batch 1 on CPU is bound by two things: reading every weight once per token, and the
per-op overhead of eager PyTorch (a few microseconds per op, ~550 ops per token on the shipped model).

1. Memory: a checkpoint stored in bf16 (the shipped one is) loses nothing when its matrices stay bf16 in
   memory: every value is exactly the checkpoint's. These kernels read bf16 weights, widen them to fp32 in
   registers (a bf16 is the top half of an fp32, so widening is a 16-bit shift: exact) and accumulate in fp32
   with FMA, so a result equals fp32 math over the widened weights up to summation order (~1e-6 relative),
   at half the bytes (measured on the 2-core test machine: a [256, 256] GEMV at batch 1 ~60 us in fp32 from
   DRAM against ~30 us here). torch has no CPU op that multiplies fp32 activations by bf16 weights without
   first materialising an fp32 copy of the weight.
2. Op count: one call replaces a chain of small ops. `rms_norm` (residual add + RMSNorm: 1 call instead of
   ~7 ops, as vLLM's fused_add_rms_norm), `decode_attention` (one pass of online softmax over a sequence's
   paged K/V, as FlashDecoding / vLLM's paged_attention_v1 do on GPU: no gather, mask or padding), and
   `expert_ffn` (SwiGLU experts for a set of rows, or one token's K experts summed with their routing weights:
   one call instead of ~14 ops per MoE layer).

Every kernel has a PyTorch path with the same contract, used for other dtypes and devices, large batches, or
when the C code cannot be built; `cpu_kernels_available()` says which runs. The C source (AVX2 + FMA, one
thread) is compiled at first use with the system C compiler (`$CC`, else `cc`) into `$MOERAY_KERNEL_CACHE`
(default `~/.cache/moeray/kernels`), keyed by a hash of the source and flags, and called through `ctypes`
(which releases the GIL). It is not used without a compiler, without AVX2/FMA, off x86-64, or with
`MOERAY_DISABLE_CPU_KERNELS=1`. The engine keeps weights bf16 only when it is (`EngineConfig.weight_storage`).
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
#include <math.h>
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

/* ---------------------------------------------------------------- RMSNorm (+ residual add), fp32 rows */
/* if delta: h_out = h + delta (written to h_out), normed = that; else normed = h.  y = w * (v / rms(v)). */
void moeray_rms_norm(const float *h, long sh, const float *delta, long sd, float *h_out, long so,
                     const float *w, float *y, long sy, long M, long D, float eps) {
    const long D8 = D & ~7L;
    for (long m = 0; m < M; m++) {
        const float *hm = h + m * sh;
        const float *src = hm;
        if (delta) {
            const float *dm = delta + m * sd;
            float *om = h_out + m * so;
            long d = 0;
            for (; d < D8; d += 8)
                _mm256_storeu_ps(om + d, _mm256_add_ps(_mm256_loadu_ps(hm + d), _mm256_loadu_ps(dm + d)));
            for (; d < D; d++) om[d] = hm[d] + dm[d];
            src = om;
        }
        __m256 a = _mm256_setzero_ps();
        long d = 0;
        for (; d < D8; d += 8) { __m256 v = _mm256_loadu_ps(src + d); a = _mm256_fmadd_ps(v, v, a); }
        float ss = hsum(a);
        for (; d < D; d++) ss += src[d] * src[d];
        const float r = 1.0f / sqrtf(ss / (float)D + eps);
        const __m256 rv = _mm256_set1_ps(r);
        float *ym = y + m * sy;
        for (d = 0; d < D8; d += 8)
            _mm256_storeu_ps(ym + d, _mm256_mul_ps(_mm256_loadu_ps(w + d), _mm256_mul_ps(_mm256_loadu_ps(src + d), rv)));
        for (; d < D; d++) ym[d] = w[d] * (src[d] * r);
    }
}

/* ---------------------------------------------------------------- paged decode attention, fp32 */
static inline float dotf(const float *a, const float *b, long n) {
    const long n8 = n & ~7L;
    __m256 s = _mm256_setzero_ps();
    long i = 0;
    for (; i < n8; i += 8) s = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s);
    float r = hsum(s);
    for (; i < n; i++) r += a[i] * b[i];
    return r;
}
/* For each sequence b: query row tok[b] of q [T, H, Dh] attends over its first ctx[b] cached tokens, whose
   slot t lives in block bt[b, t / S] at offset t % S of k/v [NB, S, Hkv, Dh] (post-RoPE keys); one pass of
   online softmax; query head h reads KV head h / (H / Hkv).  out row tok[b] [H, Dh].  Needs Dh <= 1024. */
void moeray_decode_attention(const float *q, const float *kc, const float *vc, const long *bt, long mb,
                             const long *ctx, const long *tok, float *out, long B, long H, long Hkv, long Dh,
                             long S, float scale) {
    const long rep = H / Hkv, Dh8 = Dh & ~7L;
    float acc[1024];
    for (long b = 0; b < B; b++) {
        const long n = ctx[b];
        const long *tb = bt + b * mb;
        for (long h = 0; h < H; h++) {
            const float *qh = q + (tok[b] * H + h) * Dh;
            const long g = h / rep;
            float mx = -INFINITY, l = 0.0f;
            for (long i = 0; i < Dh; i++) acc[i] = 0.0f;
            for (long t = 0; t < n; t++) {
                const long slot = (tb[t / S] * S + t % S) * Hkv + g;
                const float *kt = kc + slot * Dh, *vt = vc + slot * Dh;
                const float sc = dotf(qh, kt, Dh) * scale;
                float p;
                if (sc > mx) {
                    const float c = expf(mx - sc);  /* rescale what was accumulated so far */
                    l *= c;
                    const __m256 cv = _mm256_set1_ps(c);
                    long i = 0;
                    for (; i < Dh8; i += 8) _mm256_storeu_ps(acc + i, _mm256_mul_ps(_mm256_loadu_ps(acc + i), cv));
                    for (; i < Dh; i++) acc[i] *= c;
                    mx = sc;
                    p = 1.0f;
                } else {
                    p = expf(sc - mx);
                }
                l += p;
                const __m256 pv = _mm256_set1_ps(p);
                long i = 0;
                for (; i < Dh8; i += 8) _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(pv, _mm256_loadu_ps(vt + i), _mm256_loadu_ps(acc + i)));
                for (; i < Dh; i++) acc[i] += p * vt[i];
            }
            float *oh = out + (tok[b] * H + h) * Dh;
            const float inv = l > 0.0f ? 1.0f / l : 0.0f;
            for (long i = 0; i < Dh; i++) oh[i] = acc[i] * inv;
        }
    }
}

/* ---------------------------------------------------------------- SwiGLU experts, bf16 weights */
/* Row r goes through expert e = ids[r] (gu [E, 2I, D]: gate rows then up rows; dn [E, D, I]):
   f(x) = dn_e (silu(gate_e x) * (up_e x)).  With wts == NULL: y[r] = f(x[r]) (a row with e < 0 gets zeros).
   With wts: y[0] = sum_r wts[r] * f(x[r]) (one token's experts combined; x's row stride may be 0).
   scratch: 2I floats. */
void moeray_expert_ffn_bf16w(const float *x, long sx, const uint16_t *gu, const uint16_t *dn, const long *ids,
                             const float *wts, long R, long D, long I, float *y, long sy, float *scratch) {
    float *t = scratch, *hid = scratch + I;
    if (wts) for (long d = 0; d < D; d++) y[d] = 0.0f;
    for (long r = 0; r < R; r++) {
        const long e = ids[r];
        float *yr = wts ? y : y + r * sy;
        if (e < 0) {
            if (!wts) for (long d = 0; d < D; d++) yr[d] = 0.0f;
            continue;
        }
        const float *xr = x + r * sx;
        const uint16_t *g = gu + e * 2 * I * D, *dw = dn + e * D * I;
        for (long j = 0; j < I; j++) t[j] = dot1(xr, g + j * D, D);
        for (long j = 0; j < I; j++) {
            const float u = dot1(xr, g + (I + j) * D, D);
            hid[j] = t[j] / (1.0f + expf(-t[j])) * u;
        }
        if (wts) {
            const float wr = wts[r];
            for (long d = 0; d < D; d++) yr[d] += wr * dot1(hid, dw + d * I, I);
        } else {
            for (long d = 0; d < D; d++) yr[d] = dot1(hid, dw + d * I, I);
        }
    }
}

/* ---------------------------------------------------------------- fixed-capacity dispatch packing, fp32 */
/* Pair v (token tok[v] for local expert local[v] on rank dest[v]) goes to row dest[v] * C + j of send
   [W * C, D + 1], j = its rank among the pairs for that rank (stable); column D carries the local id as fp32,
   -1 on padding rows (whose other columns are left as they are: receivers skip them).  slot[v] = the row,
   counts[r] = pairs for rank r.  Returns -1 if a rank gets more than C pairs, else 0. */
long moeray_pack_rows(const float *x, long D, const long *tok, const long *dest, const long *local, long V,
                      long W, long C, float *send, long *slot, long *counts) {
    for (long r = 0; r < W; r++) counts[r] = 0;
    for (long v = 0; v < V; v++) {
        const long r = dest[v];
        if (r < 0 || r >= W || counts[r] >= C) return -1;
        const long row = r * C + counts[r]++;
        slot[v] = row;
        float *dst = send + row * (D + 1);
        const float *src = x + tok[v] * D;
        for (long d = 0; d < D; d++) dst[d] = src[d];
        dst[D] = (float)local[v];
    }
    for (long r = 0; r < W; r++)
        for (long j = counts[r]; j < C; j++) send[(r * C + j) * (D + 1) + D] = -1.0f;
    return 0;
}

/* ---------------------------------------------------------------- packed sub-4-bit weights -> fp32 */
/* Rows r of a packed stack (kernels/packed_weights.py layout: each row a little-endian bitstream of b-bit codes
   in W uint32 words): out[r, k] = (level[q] - z[r, g]) * s[r, g], g = k / gs, level = cb[r / rows_per_matrix]
   when cb (L levels per matrix) else q.  Same fp32 operations as the PyTorch reference: bit-identical. */
void moeray_dequant_packed(const uint32_t *codes, long W, const float *s, const float *z, long G, long gs,
                           const float *cb, long L, long rows_per_matrix, long R, long K, long bits, float *out) {
    const uint32_t mask = (1u << bits) - 1u;
    for (long r = 0; r < R; r++) {
        const uint32_t *wr = codes + r * W;
        const float *sr = s + r * G, *zr = z + r * G;
        const float *lv = cb ? cb + (r / rows_per_matrix) * L : 0;
        float *o = out + r * K;
        for (long g = 0; g < G; g++) {
            const float zg = zr[g], sg = sr[g];
            const long k1 = (g + 1) * gs < K ? (g + 1) * gs : K;
            long k = g * gs;
            if (bits == 2 || bits == 4) {  /* 8 codes at a time: codes never straddle words at 2 and 4 bits */
                const long cpw = 32 / bits;
                const __m256i step = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                                        _mm256_set1_epi32((int)bits));
                const __m256i mv = _mm256_set1_epi32((int)mask);
                const __m256 zv = _mm256_set1_ps(zg), sv = _mm256_set1_ps(sg);
                for (; k + 8 <= k1; k += 8) {  /* k % 8 == 0: group sizes are multiples of 8 */
                    const __m256i sh = _mm256_add_epi32(step, _mm256_set1_epi32((int)((k % cpw) * bits)));
                    const __m256i q = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)wr[k / cpw]), sh), mv);
                    const __m256 l = lv ? _mm256_i32gather_ps(lv, q, 4) : _mm256_cvtepi32_ps(q);
                    _mm256_storeu_ps(o + k, _mm256_mul_ps(_mm256_sub_ps(l, zv), sv));
                }
            }
            for (; k < k1; k++) {
                const long p = k * bits, lo = p >> 5, off = p & 31;
                uint32_t v = wr[lo] >> off;
                if (off + bits > 32) v |= wr[lo + 1] << (32 - off);
                const uint32_t q = v & mask;
                const float l = lv ? lv[q] : (float)q;
                o[k] = (l - zg) * sg;
            }
        }
    }
}
"""


_lock = threading.Lock()
_lib = None  # the loaded ctypes library, once built
_tried = False
_L, _P, _F = ctypes.c_long, ctypes.c_void_p, ctypes.c_float
_SIGNATURES = {
    "moeray_linear_bf16w": [_P, _L, _P, _P, _P, _L, _L, _L, _L],
    "moeray_rms_norm": [_P, _L, _P, _L, _P, _L, _P, _P, _L, _L, _L, _F],
    "moeray_decode_attention": [_P, _P, _P, _P, _L, _P, _P, _P, _L, _L, _L, _L, _L, _F],
    "moeray_expert_ffn_bf16w": [_P, _L, _P, _P, _P, _P, _L, _L, _L, _P, _L, _P],
    "moeray_pack_rows": [_P, _L, _P, _P, _P, _L, _L, _L, _P, _P, _P],
    "moeray_dequant_packed": [_P, _L, _P, _P, _L, _L, _P, _L, _L, _L, _L, _L, _P],
}
_RESTYPES = {"moeray_pack_rows": ctypes.c_long}


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
    so = os.path.join(cache, f"cpu_kernels_{key}.so")
    if not os.path.isfile(so):
        # build under a private name, then rename: ranks starting together never load a half-written file
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            src = os.path.join(tmp, "cpu_kernels.c")
            with open(src, "w") as f:
                f.write(_SOURCE)
            out = os.path.join(tmp, "k.so")
            subprocess.run([cc, *_FLAGS, src, "-o", out, "-lm"], check=True, capture_output=True, timeout=120)
            os.replace(out, so)
    return ctypes.CDLL(so)


def _load():
    global _lib, _tried
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        if os.environ.get("MOERAY_DISABLE_CPU_KERNELS") == "1" or not _cpu_supports_avx2_fma():
            _tried = True
            return None
        try:
            lib = _build()
            for name, args in _SIGNATURES.items():
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = args, _RESTYPES.get(name)
            _lib = lib
        except (OSError, subprocess.SubprocessError, AttributeError) as e:
            detail = getattr(e, "stderr", b"") or b""
            log.warning("CPU kernels unavailable (%s %s); using the PyTorch paths", e,
                        detail.decode(errors="replace")[:500])
        _tried = True
        return _lib


def cpu_kernels_available() -> bool:
    """True when the compiled CPU kernels can run on this machine (compiles them on first call)."""
    return _load() is not None


def _kernels():
    return _lib if _tried else _load()


_F32 = torch.float32


def _f32_cpu(*ts: torch.Tensor) -> bool:
    for t in ts:  # a loop, not all(genexpr): this runs ~30 times per decode step
        if t.dtype is not _F32 or t.device.type != "cpu":
            return False
    return True


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
        lib = _kernels()
        if lib is not None:
            M, K = x.shape
            N = w.shape[0]
            if w.shape[1] != K or (b is not None and (b.shape != (N,) or b.dtype != x.dtype or not b.is_contiguous())):
                raise RuntimeError(f"linear: x {tuple(x.shape)}, w {tuple(w.shape)}, "
                                   f"b {None if b is None else tuple(b.shape)} do not match")
            y = torch.empty(M, N, dtype=x.dtype)
            if M:
                lib.moeray_linear_bf16w(x.data_ptr(), x.stride(0), w.data_ptr(), b.data_ptr() if b is not None else None,
                                        y.data_ptr(), N, M, N, K)
            return y
    return F.linear(x, w.to(x.dtype), b)


def _rms_norm_torch(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:  # no casts (each op costs microseconds at decode); sum: mean is slower
        return w * (x * torch.rsqrt((x * x).sum(-1, keepdim=True).div_(x.shape[-1]).add_(eps)))
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """RMSNorm over the last dim (fp32 math, cast back, as transformers does), optionally after a residual add.

    Args:
        x: [..., D] input. w: [D] weight. eps: added to the mean square.
        residual: optional [..., D] (x's shape and dtype): then `h = residual + x` is normed.
    Returns:
        `w * x / rms(x)` [..., D]; with `residual`, the tuple `(h, w * h / rms(h))`. One compiled call for fp32
        rows on CPU, else the PyTorch ops.
    """
    lib = _kernels()
    if (lib is not None and _f32_cpu(x, w) and x.dim() >= 1 and x.stride(-1) == 1 and w.is_contiguous()
            and (residual is None or (_f32_cpu(residual) and residual.shape == x.shape and residual.is_contiguous()))):
        D = x.shape[-1]
        x2 = x.reshape(-1, D)  # a view for row-strided inputs of any rank
        if x2.stride(-1) == 1 and w.shape == (D,):
            M = x2.shape[0]
            y = torch.empty(x.shape, dtype=x.dtype)
            if residual is None:
                if M:
                    lib.moeray_rms_norm(x2.data_ptr(), x2.stride(0), None, 0, None, 0, w.data_ptr(), y.data_ptr(), D,
                                        M, D, eps)
                return y
            h = torch.empty(x.shape, dtype=x.dtype)
            if M:
                lib.moeray_rms_norm(residual.data_ptr(), D, x2.data_ptr(), x2.stride(0), h.data_ptr(), D, w.data_ptr(),
                                    y.data_ptr(), D, M, D, eps)
            return h, y
    if residual is None:
        return _rms_norm_torch(x, w, eps)
    h = residual + x
    return h, _rms_norm_torch(h, w, eps)


def decode_attention(q_THD: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tokens_B: torch.Tensor,
                     block_tables_BM: torch.Tensor, context_lens_B: torch.Tensor, scale: float,
                     out_THD: torch.Tensor) -> bool:
    """Decode attention over paged full-precision K/V, one pass of online softmax per (sequence, head).

    Args:
        q_THD: [T, H, Dh] fp32 queries (post-RoPE), contiguous. k_cache/v_cache: [NB, S, Hkv, Dh] fp32
            (post-RoPE keys). tokens_B: int64 [B] query row of each decode sequence. block_tables_BM: int64 [B, MB].
        context_lens_B: int64 [B] tokens to attend (the new one included). scale: softmax scale.
        out_THD: [T, H, Dh] fp32; rows tokens_B are written.
    Returns:
        True if the compiled kernel ran; False (nothing written) when it cannot (other dtype or device,
        Dh > 1024, non-contiguous inputs): the caller then runs the PyTorch reference.
    """
    lib = _kernels()
    if lib is None or not _f32_cpu(q_THD, k_cache, v_cache, out_THD) or q_THD.shape[-1] > 1024:
        return False
    if not (q_THD.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous() and out_THD.is_contiguous()):
        return False
    T, H, Dh = q_THD.shape
    NB, S, Hkv, _ = k_cache.shape
    bt = block_tables_BM.to(torch.int64).contiguous()
    ctx = context_lens_B.to(torch.int64).contiguous()
    tok = tokens_B.to(torch.int64).contiguous()
    B = tok.numel()
    if B:
        lib.moeray_decode_attention(q_THD.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), bt.data_ptr(),
                                    bt.shape[1], ctx.data_ptr(), tok.data_ptr(), out_THD.data_ptr(), B, H, Hkv, Dh,
                                    S, scale)
    return True


def expert_ffn(x_RD: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, ids_R: torch.Tensor,
               weights_R: torch.Tensor | None = None) -> torch.Tensor | None:
    """SwiGLU experts with bf16 weights for a few fp32 rows, in one call.

    Args:
        x_RD: [R, D] fp32 rows (with `weights_R`, [1, D] is one token sent to every expert of ids_R).
        w_gate_up: [E, 2I, D] bf16 (gate rows, then up rows), w_down: [E, D, I] bf16, contiguous.
        ids_R: int64 [R] expert of each row (-1: none, a zero row or no contribution).
        weights_R: optional fp32 [R] routing weights: then the result is `sum_r w_r f_{ids_r}(x)` [1, D].
    Returns:
        [R, D] (or [1, D]) fp32, or None when the kernel cannot run (other dtypes/devices, more than
        `MAX_KERNEL_ROWS` rows): the caller uses its PyTorch path.
    """
    lib = _kernels()
    R = ids_R.numel()
    if (lib is None or R > MAX_KERNEL_ROWS or w_gate_up.dtype != torch.bfloat16 or w_down.dtype != torch.bfloat16
            or not _f32_cpu(x_RD) or not (w_gate_up.is_contiguous() and w_down.is_contiguous())
            or x_RD.stride(-1) != 1 or (weights_R is not None and not _f32_cpu(weights_R))):
        return None
    E, I2, D = w_gate_up.shape
    if x_RD.shape[-1] != D or w_down.shape != (E, D, I2 // 2):
        raise RuntimeError(f"expert_ffn: x {tuple(x_RD.shape)}, w_gate_up {tuple(w_gate_up.shape)}, "
                           f"w_down {tuple(w_down.shape)} do not match")
    ids = ids_R.to(torch.int64).contiguous()
    scratch = torch.empty(I2, dtype=torch.float32)
    if weights_R is not None:
        wts = weights_R.reshape(-1).contiguous()
        y = torch.empty(1, D, dtype=torch.float32)
        lib.moeray_expert_ffn_bf16w(x_RD.data_ptr(), 0, w_gate_up.data_ptr(), w_down.data_ptr(), ids.data_ptr(),
                                    wts.data_ptr(), R, D, I2 // 2, y.data_ptr(), D, scratch.data_ptr())
        return y
    y = torch.empty(R, D, dtype=torch.float32)
    if R:
        lib.moeray_expert_ffn_bf16w(x_RD.data_ptr(), x_RD.stride(0), w_gate_up.data_ptr(), w_down.data_ptr(),
                                    ids.data_ptr(), None, R, D, I2 // 2, y.data_ptr(), D, scratch.data_ptr())
    return y


def pack_fixed_rows(x_TD: torch.Tensor, tok_V: torch.Tensor, dest_V: torch.Tensor, local_V: torch.Tensor,
                    world: int, capacity: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The fixed-capacity dispatch's send buffer in one call (`actors.dispatch.AllToAllDispatcher._run_fixed`).

    Args:
        x_TD: [T, D] fp32 contiguous token rows. tok_V / dest_V / local_V: int64 [V] token, destination rank and
            local expert row of each (token, expert) pair. world: W ranks. capacity: C rows per rank.
    Returns:
        (send [W * C, D + 1] fp32: the pairs for rank r in rows r * C + j in pair order, the local id in the last
        column and -1 there on padding rows, whose other columns are unset; slot_V int64 [V] the row of each
        pair; counts int64 [W] pairs per rank), or None when the kernel cannot run (the caller builds them with
        PyTorch ops).
    Raises:
        ValueError: a rank would receive more than C pairs, or a destination is out of range.
    """
    lib = _kernels()
    if lib is None or not _f32_cpu(x_TD) or not x_TD.is_contiguous() or x_TD.dim() != 2:
        return None
    D = x_TD.shape[1]
    V = dest_V.numel()
    tok, dest, local = (t.to(torch.int64).contiguous() for t in (tok_V, dest_V, local_V))
    send = torch.empty(world * capacity, D + 1, dtype=torch.float32)
    slot = torch.empty(V, dtype=torch.int64)
    counts = torch.empty(world, dtype=torch.int64)
    if lib.moeray_pack_rows(x_TD.data_ptr(), D, tok.data_ptr(), dest.data_ptr(), local.data_ptr(), V, world,
                            capacity, send.data_ptr(), slot.data_ptr(), counts.data_ptr()) != 0:
        raise ValueError(f"pack_fixed_rows: a destination outside [0, {world}) or more than capacity={capacity} "
                         f"pairs for one rank")
    return send, slot, counts


def dequant_packed(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, codebook: torch.Tensor | None,
                   bits: int, group_size: int, shape: tuple[int, ...], out: torch.Tensor | None = None
                   ) -> torch.Tensor | None:
    """Packed sub-4-bit weights to fp32 in one pass (`kernels.packed_weights.dequantize`'s CPU fast path).

    Args:
        codes: `[*, N, W]` int32 (layout of `kernels/packed_weights.py`). scales / zeros: `[*, N, G]` (any float
            dtype; fp16 as stored). codebook: None or `[*, 2**bits]` levels. bits: 2, 3 or 4. group_size: inputs
            per group. shape: `(N, K)` or `(E, N, K)`. out: optional fp32 contiguous tensor of `shape` to fill.
    Returns:
        fp32 `[*, N, K]` equal bit for bit to the PyTorch reference (`(level[q] - zero) * scale` in fp32), or None
        when the kernel cannot run (CUDA tensors, no compiled kernels).
    """
    lib = _kernels()
    if lib is None or codes.device.type != "cpu" or (out is not None and not (_f32_cpu(out) and out.is_contiguous())):
        return None
    K = shape[-1]
    R = codes.numel() // codes.shape[-1]
    rows_per_matrix = shape[-2]
    c = codes.contiguous()
    s = scales.float().contiguous()
    z = zeros.float().contiguous()
    cb = codebook.float().contiguous() if codebook is not None else None
    y = out if out is not None else torch.empty(shape, dtype=torch.float32)
    lib.moeray_dequant_packed(c.data_ptr(), c.shape[-1], s.data_ptr(), z.data_ptr(), s.shape[-1], group_size,
                              cb.data_ptr() if cb is not None else None, 1 << bits, rows_per_matrix, R, K, bits,
                              y.data_ptr())
    return y
