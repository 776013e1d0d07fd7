"""Fused CPU kernels for small-batch decode: bf16-weight linear, RMSNorm, paged decode attention, expert FFNs
(bf16, fp32 and packed sub-4-bit weights), packed-weight dequantize, and the expert predictor's decode-step
bookkeeping (Markov counts, lookahead gate, top-B).

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
3. Packed experts: `packed_expert_ffn` runs SwiGLU experts straight from the packed codes
   (`kernels/packed_weights.py` layout), unpacking in registers with each group's scale and zero taken out of
   its sum, so ~4.5 bits per weight leave memory instead of 32 for a dequantized fp32 copy; on CPU that is no
   slower than the copy, so the engine keeps none by default (`actors.experts.store.fused_path_runs`).
   `MarkovTables`, `GateLogprobs` and `prefetch_step` do the expert predictor's per-layer decode bookkeeping
   (the formulas of `actors/prefetch/predictors.py`) in one call each, where ~40 small Python and tensor
   ops cost ~0.3 ms.

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

from kernels import tuning

log = logging.getLogger(__name__)


# -fno-semantic-interposition: with -fPIC alone gcc ran the packed-expert kernel ~2.5x slower (measured)
_FLAGS = ["-O3", "-mavx2", "-mfma", "-shared", "-fPIC", "-fno-semantic-interposition", "-std=c99"]

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

/* ---------------------------------------------------------------- packed sub-4-bit weights */
/* fp16 bits -> fp32 (exact; no F16C needed). */
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    union { uint32_t u; float f; } c;
    if (e == 0x1fu) c.u = sign | 0x7f800000u | (m << 13);            /* inf, nan */
    else if (e) c.u = sign | ((e + 112u) << 23) | (m << 13);         /* normal */
    else { c.f = (float)m * 5.9604644775390625e-08f; c.u |= sign; }  /* zero, subnormal: m * 2^-24 (exact) */
    return c.f;
}

/* One row of a packed matrix (kernels/packed_weights.py layout: a little-endian bitstream of b-bit codes in
   uint32 words) to fp32: o[k] = (level[q_k] - z[g]) * s[g], g = k / gs, level = lv (the matrix's codebook, as
   floats) when lv, else q; s, z fp16.  The PyTorch reference's fp32 operations: bit-identical. */
static void deq_row(const uint32_t *wr, const uint16_t *sr, const uint16_t *zr, long G, long gs, const float *lv,
                    long K, long bits, float *o) {
    const uint32_t mask = (1u << bits) - 1u;
    for (long g = 0; g < G; g++) {
        const float zg = half_to_float(zr[g]), sg = half_to_float(sr[g]);
        const long k1 = (g + 1) * gs < K ? (g + 1) * gs : K;
        long k = g * gs;
        if (bits == 2 || bits == 4) {  /* 8 codes at a time: codes never straddle words at 2 and 4 bits */
            const long lg = bits == 4 ? 3 : 4, cpw_mask = (1L << lg) - 1;  /* codes per word: 8 or 16 */
            const __m256i step = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                                    _mm256_set1_epi32((int)bits));
            const __m256i mv = _mm256_set1_epi32((int)mask);
            const __m256 zv = _mm256_set1_ps(zg), sv = _mm256_set1_ps(sg);
            for (; k + 8 <= k1; k += 8) {  /* k % 8 == 0: group sizes are multiples of 8 */
                const __m256i sh = _mm256_add_epi32(step, _mm256_set1_epi32((int)((k & cpw_mask) * bits)));
                const __m256i q = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)wr[k >> lg]), sh), mv);
                const __m256 l = lv ? _mm256_i32gather_ps(lv, q, 4) : _mm256_cvtepi32_ps(q);
                _mm256_storeu_ps(o + k, _mm256_mul_ps(_mm256_sub_ps(l, zv), sv));
            }
        }
        for (; k < k1; k++) {
            const long p = k * bits, lo = p >> 5, off = p & 31;
            uint32_t v = wr[lo] >> off;
            if (off + bits > 32) v |= wr[lo + 1] << (32 - off);
            const uint32_t q = v & mask;
            o[k] = ((lv ? lv[q] : (float)q) - zg) * sg;
        }
    }
}

static inline void load_levels(const uint16_t *cb, long bits, float *lv) {
    for (long i = 0; i < (1L << bits); i++) lv[i] = half_to_float(cb[i]);
}

/* Rows r < R of a packed stack to fp32 out [R, K]; cb: L fp16 levels per matrix of rows_per_matrix rows (or 0). */
void moeray_dequant_packed(const uint32_t *codes, long W, const uint16_t *s, const uint16_t *z, long G, long gs,
                           const uint16_t *cb, long L, long rows_per_matrix, long R, long K, long bits, float *out) {
    float lv[16];
    long cur = -1;
    for (long r = 0; r < R; r++) {
        const long m = r / rows_per_matrix;
        if (cb && m != cur) { load_levels(cb + m * L, bits, lv); cur = m; }
        deq_row(codes + r * W, s + r * G, z + r * G, G, gs, cb ? lv : 0, K, bits, out + r * K);
    }
}

/* Levels of the 8 codes k..k+7 of a row at 2 or 4 bits (k % 8 == 0), as floats: the code itself, or the
   matrix's codebook (<= 16 levels held in two registers, looked up with in-register permutes, not gathers). */
static inline __m256 levels8(const uint32_t *wr, long k, long bits, long lg, __m256i step, __m256i mv,
                             int has_cb, __m256 lv_lo, __m256 lv_hi) {
    const __m256i sh = _mm256_add_epi32(step, _mm256_set1_epi32((int)((k & ((1L << lg) - 1)) * bits)));
    const __m256i q = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)wr[k >> lg]), sh), mv);
    if (!has_cb) return _mm256_cvtepi32_ps(q);
    const __m256 lo = _mm256_permutevar8x32_ps(lv_lo, q);
    if (bits == 2) return lo;
    return _mm256_blendv_ps(lo, _mm256_permutevar8x32_ps(lv_hi, q), _mm256_castsi256_ps(_mm256_slli_epi32(q, 28)));
}

/* One packed [N, K] matrix (a stack member: pointers already at it) times R fp32 rows, without materialising it:
       y[r*sy + n] = sum_g s[n,g] * (sum_{k in g} level[q_nk] x_rk  -  z[n,g] * sum_{k in g} x_rk)
   (the dequantization formula with the scale and zero taken out of each group's sum).  xs: R * G floats for
   the per-group sums of each row; tmp: K floats (3-bit codes, which straddle words, are unpacked there first).
   Rows of x are taken 4 at a time so each unpacked code is used up to 4 times from registers. */
static inline __attribute__((always_inline)) void packed_rows_impl(
        const float *x, long sx, long R, const uint32_t *c, long W, const uint16_t *s, const uint16_t *z, long G,
        long gs, const uint16_t *cb, const long bits, long N, long K, float *y, long sy, float *xs, float *tmp) {
    float lv[16] = {0};
    if (cb) load_levels(cb, bits, lv);
    const __m256 lv_lo = _mm256_loadu_ps(lv), lv_hi = _mm256_loadu_ps(lv + 8);
    const uint32_t mask = (1u << bits) - 1u;
    const int vec = bits == 2 || bits == 4, has_cb = cb != 0;
    const long lg = bits == 4 ? 3 : 4, K8 = K & ~7L;
    const __m256i step = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32((int)bits));
    const __m256i mv = _mm256_set1_epi32((int)mask);
    for (long r = 0; r < R; r++)
        for (long g = 0; g < G; g++) {
            const long k0 = g * gs, k1 = k0 + gs < K ? k0 + gs : K;
            float a = 0.0f;
            for (long k = k0; k < k1; k++) a += x[r * sx + k];
            xs[r * G + g] = a;
        }
    for (long n = 0; n < N; n++) {
        const uint32_t *wr = c + n * W;
        const uint16_t *sn = s + n * G, *zn = z + n * G;
        if (!vec || K8 < K)  /* levels the vector loop cannot unpack in registers: 3-bit codes, a K % 8 tail */
            for (long k = vec ? K8 : 0; k < K; k++) {
                const long p = k * bits, lo = p >> 5, off = p & 31;
                uint32_t v = wr[lo] >> off;
                if (off + bits > 32) v |= wr[lo + 1] << (32 - off);
                tmp[k] = has_cb ? lv[v & mask] : (float)(v & mask);
            }
        for (long r0 = 0; r0 < R; r0 += 4) {
            const long nr = R - r0 < 4 ? R - r0 : 4;
            const float *x0 = x + r0 * sx;
            const float *x1 = nr > 1 ? x0 + sx : x0, *x2 = nr > 2 ? x0 + 2 * sx : x0, *x3 = nr > 3 ? x0 + 3 * sx : x0;
            __m256 o0 = _mm256_setzero_ps(), o1 = o0, o2 = o0, o3 = o0;  /* sum_g s_g * (group's level . x) */
            float zt[4] = {0.0f, 0.0f, 0.0f, 0.0f}, tl[4] = {0.0f, 0.0f, 0.0f, 0.0f};  /* zero terms, K tail */
            for (long g = 0; g < G; g++) {
                const long k0 = g * gs, k1 = k0 + gs < K ? k0 + gs : K, k8 = k1 < K8 ? k1 : K8;
                const float sg = half_to_float(sn[g]), zg = half_to_float(zn[g]);
                const __m256 sv = _mm256_set1_ps(sg);
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                long k = k0;
                if (nr == 1 && vec) {  /* decode: two chains, so the FMA latency does not bound the loop */
                    __m256 b0 = a0;
                    for (; k + 16 <= k8; k += 16) {
                        a0 = _mm256_fmadd_ps(levels8(wr, k, bits, lg, step, mv, has_cb, lv_lo, lv_hi),
                                             _mm256_loadu_ps(x0 + k), a0);
                        b0 = _mm256_fmadd_ps(levels8(wr, k + 8, bits, lg, step, mv, has_cb, lv_lo, lv_hi),
                                             _mm256_loadu_ps(x0 + k + 8), b0);
                    }
                    a0 = _mm256_add_ps(a0, b0);
                }
                for (; k < k8; k += 8) {
                    const __m256 l = vec ? levels8(wr, k, bits, lg, step, mv, has_cb, lv_lo, lv_hi)
                                         : _mm256_loadu_ps(tmp + k);
                    a0 = _mm256_fmadd_ps(l, _mm256_loadu_ps(x0 + k), a0);
                    if (nr > 1) a1 = _mm256_fmadd_ps(l, _mm256_loadu_ps(x1 + k), a1);
                    if (nr > 2) a2 = _mm256_fmadd_ps(l, _mm256_loadu_ps(x2 + k), a2);
                    if (nr > 3) a3 = _mm256_fmadd_ps(l, _mm256_loadu_ps(x3 + k), a3);
                }
                o0 = _mm256_fmadd_ps(sv, a0, o0);
                if (nr > 1) o1 = _mm256_fmadd_ps(sv, a1, o1);
                if (nr > 2) o2 = _mm256_fmadd_ps(sv, a2, o2);
                if (nr > 3) o3 = _mm256_fmadd_ps(sv, a3, o3);
                for (; k < k1; k++) {
                    tl[0] += sg * tmp[k] * x0[k]; tl[1] += sg * tmp[k] * x1[k];
                    tl[2] += sg * tmp[k] * x2[k]; tl[3] += sg * tmp[k] * x3[k];
                }
                const float szg = sg * zg;
                for (long i = 0; i < nr; i++) zt[i] += szg * xs[(r0 + i) * G + g];
            }
            y[r0 * sy + n] = hsum(o0) + tl[0] - zt[0];
            if (nr > 1) y[(r0 + 1) * sy + n] = hsum(o1) + tl[1] - zt[1];
            if (nr > 2) y[(r0 + 2) * sy + n] = hsum(o2) + tl[2] - zt[2];
            if (nr > 3) y[(r0 + 3) * sy + n] = hsum(o3) + tl[3] - zt[3];
        }
    }
}

/* packed_rows_impl compiled once per (bits, codebook or not) of the decode path: with both known the inner loop
   is ~2x faster than one generic body (measured on the 2-core EPYC test machine). */
static void packed_rows(const float *x, long sx, long R, const uint32_t *c, long W, const uint16_t *s,
                        const uint16_t *z, long G, long gs, const uint16_t *cb, long bits, long N, long K,
                        float *y, long sy, float *xs, float *tmp) {
    if (bits == 4 && !cb && R == 1 && gs == 64)
        packed_rows_impl(x, sx, 1, c, W, s, z, G, 64, 0, 4, N, K, y, sy, xs, tmp);
    else if (bits == 4 && !cb && R == 1) packed_rows_impl(x, sx, 1, c, W, s, z, G, gs, 0, 4, N, K, y, sy, xs, tmp);
    else if (bits == 4 && !cb) packed_rows_impl(x, sx, R, c, W, s, z, G, gs, 0, 4, N, K, y, sy, xs, tmp);
    else if (bits == 4) packed_rows_impl(x, sx, R, c, W, s, z, G, gs, cb, 4, N, K, y, sy, xs, tmp);
    else if (bits == 2 && !cb) packed_rows_impl(x, sx, R, c, W, s, z, G, gs, 0, 2, N, K, y, sy, xs, tmp);
    else if (bits == 2) packed_rows_impl(x, sx, R, c, W, s, z, G, gs, cb, 2, N, K, y, sy, xs, tmp);
    else packed_rows_impl(x, sx, R, c, W, s, z, G, gs, cb, bits, N, K, y, sy, xs, tmp);
}

/* t[r] (2I floats: gate then up) -> t[r][0:I] = silu(gate) * up. */
static inline void swiglu_rows(float *t, long R, long I) {
    for (long r = 0; r < R; r++) {
        float *tr = t + r * 2 * I;
        for (long j = 0; j < I; j++) tr[j] = tr[j] / (1.0f + expf(-tr[j])) * tr[I + j];
    }
}

/* Rows r < R through packed SwiGLU experts: y[r] = down_e(silu(gate_e x_r) * up_e x_r), e = ids[r] (< 0: a zero
   row).  gu: the fused gate_up stack [E, 2I, D] (gate rows then up rows), dn: [E, D, I]; a stack is codes
   [E, N, W] int32, scales / zeros [E, N, G] fp16 and a codebook [E, 2**bits] fp16 or 0.  A run of rows with the
   same id shares each weight row's unpacking.  x's row stride may be 0 (one token, several experts).
   scratch: max(D, I) + R * (max(G_gu, G_dn) + 2I) floats. */
void moeray_packed_expert_ffn(const float *x, long sx, const long *ids, long R,
                              const uint32_t *guc, const uint16_t *gus, const uint16_t *guz, const uint16_t *gucb,
                              long guW, long guG, long gugs, long gubits,
                              const uint32_t *dnc, const uint16_t *dns, const uint16_t *dnz, const uint16_t *dncb,
                              long dnW, long dnG, long dngs, long dnbits,
                              long D, long I, float *y, long sy, float *scratch) {
    const long Kmax = D > I ? D : I, Gmax = guG > dnG ? guG : dnG;
    float *tmp = scratch, *xs = scratch + Kmax, *t = xs + R * Gmax;
    long r0 = 0;
    while (r0 < R) {
        const long e = ids[r0];
        long r1 = r0 + 1;
        while (r1 < R && ids[r1] == e) r1++;
        const long n = r1 - r0;
        if (e < 0) {
            for (long r = r0; r < r1; r++) for (long d = 0; d < D; d++) y[r * sy + d] = 0.0f;
        } else {
            const long gn = 2 * I;
            packed_rows(x + r0 * sx, sx, n, guc + e * gn * guW, guW, gus + e * gn * guG, guz + e * gn * guG, guG,
                        gugs, gucb ? gucb + (e << gubits) : 0, gubits, gn, D, t, gn, xs, tmp);
            swiglu_rows(t, n, I);
            packed_rows(t, gn, n, dnc + e * D * dnW, dnW, dns + e * D * dnG, dnz + e * D * dnG, dnG,
                        dngs, dncb ? dncb + (e << dnbits) : 0, dnbits, D, I, y + r0 * sy, sy, xs, tmp);
        }
        r0 = r1;
    }
}

/* Rows r < R through one SwiGLU expert with fp32 weights gu [2I, D] (gate rows then up rows), dn [D, I]:
   y[r] = dn (silu(gate x_r) * (up x_r)).  Weight row outer, rows inner (each weight row read once).
   scratch: R * 2I floats. */
void moeray_swiglu_f32w(const float *x, long sx, long R, const float *gu, const float *dn, long D, long I,
                        float *y, long sy, float *scratch) {
    const long gn = 2 * I;
    for (long n = 0; n < gn; n++)
        for (long r = 0; r < R; r++) scratch[r * gn + n] = dotf(gu + n * D, x + r * sx, D);
    swiglu_rows(scratch, R, I);
    for (long d = 0; d < D; d++)
        for (long r = 0; r < R; r++) y[r * sy + d] = dotf(dn + d * I, scratch + r * gn, I);
}

/* ---------------------------------------------------------------- expert prediction for decode steps */
/* The distinct valid (0 <= id < E) ids of a row of K, in first-seen order; returns how many (K <= 64). */
static long id_set(const long *row, long K, long E, long *out) {
    long n = 0;
    for (long k = 0; k < K; k++) {
        const long e = row[k];
        int dup = e < 0 || e >= E;
        for (long i = 0; i < n && !dup; i++) dup = out[i] == e;
        if (!dup) out[n++] = e;
    }
    return n;
}

/* Markov counts of one layer (actors/prefetch/predictors.py: TransitionCounts; float64): for each token t
   with expert set B_t (ids [T, K], -1 padded): freq[b] += 1, inter[a, b] += 1 for a in the token's set at the
   previous MoE layer (pl [T, Kp], or 0), intra[a, b] += 1 for a in its predecessor's set here (pt [T, Kt], or 0). */
void moeray_markov_observe(double *freq, double *inter, double *intra, long E, long T, const long *ids, long K,
                           const long *pl, long Kp, const long *pt, long Kt) {
    long cur[64], src[64];
    for (long t = 0; t < T; t++) {
        const long nc = id_set(ids + t * K, K, E, cur);
        if (!nc) continue;
        for (long i = 0; i < nc; i++) freq[cur[i]] += 1.0;
        for (int which = 0; which < 2; which++) {
            const long *rows = which ? pt : pl, Ks = which ? Kt : Kp;
            double *m = which ? intra : inter;
            if (!rows) continue;
            const long ns = id_set(rows + t * Ks, Ks, E, src);
            for (long j = 0; j < ns; j++)
                for (long i = 0; i < nc; i++) m[src[j] * E + cur[i]] += 1.0;
        }
    }
}

/* Per token the softmax over E of the log-linear Markov score (MarkovPredictor / HybridPredictor):
       s(b) = log P(b) + w0 sum_{a in A_t} (log P_inter(b | a) - log P(b)) + w1 sum_{a in B_t} (log P_intra(b | a)
              - log P(b)) + w2 look[t, b]
   with additive smoothing alpha on every count row; A_t from pl [T, Kp] (or 0), B_t from pt [T, Kt] (or 0),
   look [T, E] log-probabilities (or 0).  out [T, E] float32. */
void moeray_markov_probs(const double *freq, const double *inter, const double *intra, long E, double alpha,
                         double w0, double w1, double w2, long T, const long *pl, long Kp, const long *pt, long Kt,
                         const float *look, float *out) {
    double logf[E], sc[E];
    long src[64];
    double fs = 0.0;
    for (long b = 0; b < E; b++) fs += freq[b];
    for (long b = 0; b < E; b++) logf[b] = log((freq[b] + alpha) / (fs + E * alpha));
    for (long t = 0; t < T; t++) {
        for (long b = 0; b < E; b++) sc[b] = logf[b];
        for (int which = 0; which < 2; which++) {
            const long *rows = which ? pt : pl, Ks = which ? Kt : Kp;
            const double *m = which ? intra : inter, w = which ? w1 : w0;
            if (!rows) continue;
            const long ns = id_set(rows + t * Ks, Ks, E, src);
            for (long j = 0; j < ns; j++) {
                const double *ra = m + src[j] * E;
                double rs = 0.0;
                for (long b = 0; b < E; b++) rs += ra[b];
                const double tot = rs + E * alpha;
                for (long b = 0; b < E; b++) sc[b] += w * (log((ra[b] + alpha) / tot) - logf[b]);
            }
        }
        if (look) for (long b = 0; b < E; b++) sc[b] += w2 * (double)look[t * E + b];
        double mx = sc[0], z = 0.0;
        for (long b = 1; b < E; b++) mx = sc[b] > mx ? sc[b] : mx;
        for (long b = 0; b < E; b++) { sc[b] = exp(sc[b] - mx); z += sc[b]; }
        for (long b = 0; b < E; b++) out[t * E + b] = (float)(sc[b] / z);
    }
}

/* The lookahead predictor's log softmax(gate (rmsnorm(h) * norm_w)) for T rows of h [T, D] (row stride sh);
   gate [E, D] float32, norm_w [D] or 0.  out [T, E]. */
void moeray_gate_logprobs(const float *h, long sh, long T, long D, const float *norm_w, float eps,
                          const float *gate, long E, float *out, float *scratch) {
    for (long t = 0; t < T; t++) {
        const float *ht = h + t * sh;
        float ss = dotf(ht, ht, D);
        const float r = 1.0f / sqrtf(ss / (float)D + eps);
        for (long d = 0; d < D; d++) scratch[d] = norm_w ? (ht[d] * r) * norm_w[d] : ht[d] * r;
        float *o = out + t * E, mx = -INFINITY, z = 0.0f;
        for (long e = 0; e < E; e++) { o[e] = dotf(gate + e * D, scratch, D); mx = o[e] > mx ? o[e] : mx; }
        for (long e = 0; e < E; e++) z += expf(o[e] - mx);
        const float lz = mx + logf(z);
        for (long e = 0; e < E; e++) o[e] -= lz;
    }
}

/* One MoE layer of a decode step's expert-prediction bookkeeping (actors/experts/store.py: ExpertRuntime), for
   T tokens, in one call:
   1. score the prediction made for this layer (pred [T, B], or 0) against its routing ids [T, K]:
      stats[0..3] += (sum |pred_t & B_t|, sum |pred_t|, sum |B_t|, T);
   2. router thrash against each token's predecessor's set pt [T, Kt] (or 0): stats[4..5] += (sum of Jaccard
      distances over tokens whose predecessor routed, their count);
   3. learn: this layer's counts (freq, inter, intra; 0: skip) as moeray_markov_observe, with pl [T, Kp];
   4. predict the next MoE layer (nfreq != 0): per token the Markov / hybrid distribution of
      moeray_markov_probs from the next layer's counts, with this layer's routing as its previous-layer set,
      npt [T, Knt] as the predecessors' sets there, and, when gate != 0, w2 times the lookahead log-probabilities
      of h [T, D] (row stride sh) under the next layer's norm and gate; then the top B experts per token (ties:
      the lower id) into pred_out [T, NB], and per expert the sum (agg) and max (top) of the T probabilities.
   scratch: D + 2 * T * E floats. */
void moeray_prefetch_step(double *stats, const long *ids, long K, long T, const long *pred, long B,
                          const long *pl, long Kp, const long *pt, long Kt,
                          double *freq, double *inter, double *intra, long E,
                          const double *nfreq, const double *ninter, const double *nintra, double alpha,
                          double w0, double w1, double w2, const long *npt, long Knt,
                          const float *h, long sh, long D, const float *norm, float eps, const float *gate,
                          long NB, long *pred_out, float *agg, float *top, float *scratch) {
    long cur[64], oth[64];
    for (long t = 0; t < T; t++) {
        const long nc = id_set(ids + t * K, K, E, cur);
        if (pred) {
            const long np = id_set(pred + t * B, B, E, oth);
            long hit = 0;
            for (long i = 0; i < np; i++) for (long j = 0; j < nc; j++) hit += oth[i] == cur[j];
            stats[0] += hit; stats[1] += np; stats[2] += nc;
        }
        if (pt) {
            const long na = id_set(pt + t * Kt, Kt, E, oth);
            if (na) {
                long in = 0;
                for (long i = 0; i < na; i++) for (long j = 0; j < nc; j++) in += oth[i] == cur[j];
                stats[4] += 1.0 - (double)in / (double)(na + nc - in);
                stats[5] += 1.0;
            }
        }
    }
    if (pred) stats[3] += T;
    if (freq) moeray_markov_observe(freq, inter, intra, E, T, ids, K, pl, Kp, pt, Kt);
    if (!nfreq) return;
    float *look = 0, *p = scratch + D + T * E;
    if (gate) {
        look = scratch + D;
        moeray_gate_logprobs(h, sh, T, D, norm, eps, gate, E, look, scratch);
    }
    moeray_markov_probs(nfreq, ninter, nintra, E, alpha, w0, w1, look ? w2 : 0.0, T, ids, K, npt, Knt, look, p);
    for (long e = 0; e < E; e++) { agg[e] = 0.0f; top[e] = 0.0f; }
    for (long t = 0; t < T; t++) {
        const float *pr = p + t * E;
        for (long e = 0; e < E; e++) { agg[e] += pr[e]; top[e] = pr[e] > top[e] ? pr[e] : top[e]; }
        long *po = pred_out + t * NB;
        for (long i = 0; i < NB; i++) {
            long best = -1;
            for (long e = 0; e < E; e++) {
                int used = 0;
                for (long j = 0; j < i && !used; j++) used = po[j] == e;
                if (!used && (best < 0 || pr[e] > pr[best])) best = e;
            }
            po[i] = best;
        }
    }
}
"""


_lock = threading.Lock()
_lib = None  # the loaded ctypes library, once built
_tried = False
_L, _P, _F, _D = ctypes.c_long, ctypes.c_void_p, ctypes.c_float, ctypes.c_double
_SIGNATURES = {
    "moeray_linear_bf16w": [_P, _L, _P, _P, _P, _L, _L, _L, _L],
    "moeray_rms_norm": [_P, _L, _P, _L, _P, _L, _P, _P, _L, _L, _L, _F],
    "moeray_decode_attention": [_P, _P, _P, _P, _L, _P, _P, _P, _L, _L, _L, _L, _L, _F],
    "moeray_expert_ffn_bf16w": [_P, _L, _P, _P, _P, _P, _L, _L, _L, _P, _L, _P],
    "moeray_pack_rows": [_P, _L, _P, _P, _P, _L, _L, _L, _P, _P, _P],
    "moeray_dequant_packed": [_P, _L, _P, _P, _L, _L, _P, _L, _L, _L, _L, _L, _P],
    "moeray_packed_expert_ffn": [_P, _L, _P, _L] + [_P, _P, _P, _P, _L, _L, _L, _L] * 2 + [_L, _L, _P, _L, _P],
    "moeray_swiglu_f32w": [_P, _L, _L, _P, _P, _L, _L, _P, _L, _P],
    "moeray_markov_observe": [_P, _P, _P, _L, _L, _P, _L, _P, _L, _P, _L],
    "moeray_markov_probs": [_P, _P, _P, _L, _D, _D, _D, _D, _L, _P, _L, _P, _L, _P, _P],
    "moeray_gate_logprobs": [_P, _L, _L, _L, _P, _F, _P, _L, _P, _P],
    "moeray_prefetch_step": [_P, _P, _L, _L, _P, _L, _P, _L, _P, _L, _P, _P, _P, _L, _P, _P, _P, _D, _D, _D, _D,
                             _P, _L, _P, _L, _L, _P, _F, _P, _L, _P, _P, _P, _P],
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
_F16 = torch.float16


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
            and x.shape[0] <= tuning.MAX_KERNEL_ROWS and w.is_contiguous() and x.stride(1) == 1):
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
    if (lib is None or R > tuning.MAX_KERNEL_ROWS or w_gate_up.dtype != torch.bfloat16 or w_down.dtype != torch.bfloat16
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
    """The fixed-capacity dispatch's send buffer in one call (`actors.moe.dispatch.AllToAllDispatcher._run_fixed`).

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
        codes: `[*, N, W]` int32 (layout of `kernels/packed_weights.py`). scales / zeros: `[*, N, G]` fp16.
            codebook: None or `[*, 2**bits]` fp16 levels. bits: 2, 3 or 4. group_size: inputs per group.
            shape: `(N, K)` or `(E, N, K)`. out: optional fp32 contiguous tensor of `shape` to fill.
    Returns:
        fp32 `[*, N, K]` equal bit for bit to the PyTorch reference (`(level[q] - zero) * scale` in fp32), or None
        when the kernel cannot run (CUDA tensors, other dtypes, no compiled kernels).
    """
    lib = _kernels()
    if (lib is None or codes.device.type != "cpu" or scales.dtype != _F16 or zeros.dtype != _F16
            or (codebook is not None and codebook.dtype != _F16)
            or (out is not None and not (_f32_cpu(out) and out.is_contiguous()))):
        return None
    K = shape[-1]
    R = codes.numel() // codes.shape[-1]
    c, s, z = codes.contiguous(), scales.contiguous(), zeros.contiguous()
    cb = codebook.contiguous() if codebook is not None else None
    y = out if out is not None else torch.empty(shape, dtype=torch.float32)
    lib.moeray_dequant_packed(c.data_ptr(), c.shape[-1], s.data_ptr(), z.data_ptr(), s.shape[-1], group_size,
                              cb.data_ptr() if cb is not None else None, 1 << bits, shape[-2], R, K, bits,
                              y.data_ptr())
    return y


class PackedFFNArgs:
    """The raw arguments of one layer's packed SwiGLU expert stacks for `packed_expert_ffn`, prepared once.

    Holds references to the tensors, so the pointers stay valid while this object lives.

    Args:
        gate_up: a PackedWeight stack `[E, 2I, D]` (gate rows then up rows). down: a PackedWeight stack `[E, D, I]`.
            (Any objects with `codes`, `scales`, `zeros`, `codebook`, `bits`, `group_size`, `shape`.)
    Raises:
        ValueError: the stacks do not fit together (E, D or I differ).
    """

    def __init__(self, gate_up, down):
        E, I2, D = gate_up.shape
        if tuple(down.shape) != (E, D, I2 // 2) or I2 % 2:
            raise ValueError(f"gate_up.shape={tuple(gate_up.shape)} and down.shape={tuple(down.shape)} are not one "
                             "SwiGLU stack [E, 2I, D] / [E, D, I]")
        self.num_experts, self.hidden, self.intermediate = E, D, I2 // 2
        self._keep = []
        self.ok = all(t.device.type == "cpu" and t.dtype == _F16
                      for pw in (gate_up, down) for t in (pw.scales, pw.zeros, pw.codebook) if t is not None)
        args = []
        for pw in (gate_up, down):
            ts = [pw.codes.contiguous(), pw.scales.contiguous(), pw.zeros.contiguous(),
                  None if pw.codebook is None else pw.codebook.contiguous()]
            self._keep += ts
            args += [t.data_ptr() if t is not None else None for t in ts]
            args += [pw.codes.shape[-1], pw.scales.shape[-1], pw.group_size, pw.bits]
        self.args = tuple(args)
        self._shapes = [(pw.codes.shape[-2:], pw.scales.shape[-1], pw.shape[-1], pw.group_size, pw.bits)
                        for pw in (gate_up, down)]

    def dequantize(self, e: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Expert `e` dequantized to fp32: (`[2I, D]` gate_up, `[D, I]` down), bit-identical to
        `kernels.packed_weights.dequantize`, in two calls with no per-call tensor bookkeeping (the prefetch
        worker's fill). None when the kernel cannot run."""
        lib = _kernels()
        if lib is None or not self.ok:
            return None
        out = []
        for i, ((N, W), G, K, gs, bits) in enumerate(self._shapes):
            c, sc, z, cb = self.args[8 * i : 8 * i + 4]
            y = torch.empty(N, K, dtype=torch.float32)
            L = 1 << bits
            lib.moeray_dequant_packed(c + 4 * e * N * W, W, sc + 2 * e * N * G, z + 2 * e * N * G, G, gs,
                                      None if cb is None else cb + 2 * e * L, L, N, N, K, bits, y.data_ptr())
            out.append(y)
        return out[0], out[1]


def packed_expert_ffn(x_RD: torch.Tensor, ids_R: list[int] | torch.Tensor, packed: PackedFFNArgs
                      ) -> torch.Tensor | None:
    """Rows through packed sub-4-bit SwiGLU experts without materialising the weights (fused dequant-GEMV).

    The codes are unpacked in registers and each group's scale and zero are taken out of its sum,
    `sum_g s_g (sum_k level_k x_k - z_g sum_k x_k)`, so only the packed bytes (~4.5 bits per weight at 4 bits,
    group 64) leave memory and no weight is materialised. The result equals the dequantize-then-matmul
    reference up to fp32 summation order (~1e-6 relative; the tests bound it at 1e-5).

    Args:
        x_RD: [R, D] fp32 rows; [1, D] with several ids is one token sent to each of those experts.
        ids_R: the R local expert ids (list or int64 tensor; -1: a zero row); rows of one expert should be
            consecutive (each run dequantizes the expert's rows once).
        packed: the layer's `PackedFFNArgs`.
    Returns:
        [R, D] fp32, or None when the kernel cannot run (no compiled kernels, CUDA or non-fp32 rows, more than
        `MAX_KERNEL_ROWS` rows, non-fp16 scales): the caller uses its PyTorch path.
    """
    lib = _kernels()
    ids = ids_R if isinstance(ids_R, list) else ids_R.tolist()
    R = len(ids)
    if lib is None or not packed.ok or R > tuning.MAX_KERNEL_ROWS or not _f32_cpu(x_RD) or x_RD.stride(-1) != 1:
        return None
    D, I = packed.hidden, packed.intermediate
    if x_RD.shape[-1] != D or (x_RD.shape[0] != R and x_RD.shape[0] != 1):
        raise ValueError(f"packed_expert_ffn: x shape={tuple(x_RD.shape)}, expected [{R}, {D}] or [1, {D}]")
    if R and max(ids) >= packed.num_experts:
        raise ValueError(f"packed_expert_ffn: expert id {max(ids)} >= num_experts={packed.num_experts}")
    y = torch.empty(R, D, dtype=torch.float32)
    if R:
        ids_a = (ctypes.c_long * R)(*ids)
        G = max(packed.args[5], packed.args[13])  # groups per row of gate_up, down
        scratch = torch.empty(max(D, I) + R * (G + 2 * I), dtype=torch.float32)
        sx = 0 if x_RD.shape[0] == 1 else x_RD.stride(0)
        lib.moeray_packed_expert_ffn(x_RD.data_ptr(), sx, ids_a, R, *packed.args, D, I, y.data_ptr(), D,
                                     scratch.data_ptr())
    return y


def swiglu_f32(x_RD: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor | None:
    """One SwiGLU expert with fp32 weights for a few fp32 rows: `w_down (silu(gate x) * (up x))` in one call.

    Args:
        x_RD: [R, D] fp32. w_gate_up: [2I, D] fp32 (gate rows, then up rows). w_down: [D, I] fp32; contiguous.
    Returns:
        [R, D] fp32, or None when the kernel cannot run (other dtypes/devices, more than `MAX_KERNEL_ROWS` rows).
    """
    lib = _kernels()
    R = x_RD.shape[0]
    if (lib is None or R > tuning.MAX_KERNEL_ROWS or not _f32_cpu(x_RD, w_gate_up, w_down) or x_RD.stride(-1) != 1
            or not (w_gate_up.is_contiguous() and w_down.is_contiguous())):
        return None
    I2, D = w_gate_up.shape
    y = torch.empty(R, D, dtype=torch.float32)
    if R:
        scratch = torch.empty(R * I2, dtype=torch.float32)
        lib.moeray_swiglu_f32w(x_RD.data_ptr(), x_RD.stride(0), R, w_gate_up.data_ptr(), w_down.data_ptr(), D,
                               I2 // 2, y.data_ptr(), D, scratch.data_ptr())
    return y


_F64 = torch.float64
_MAX_SET = 64  # the C predictor's bound on ids per token row


def _id_rows(rows: list[list[int]] | None) -> tuple[ctypes.Array | None, int]:
    """Ragged id rows as one -1-padded C long array and its row length (None, 0: no rows or all empty)."""
    if rows is None:
        return None, 0
    if len(rows) == 1:  # decode at batch 1
        r = rows[0]
        return ((ctypes.c_long * len(r))(*r), len(r)) if r else (None, 0)
    k = max(len(r) for r in rows) if rows else 0
    if k == 0:
        return None, 0
    flat = [e for r in rows for e in (list(r) + [-1] * (k - len(r)))]
    return (ctypes.c_long * len(flat))(*flat), k


class MarkovTables:
    """Compiled decode-step access to Markov transition counts (`actors.prefetch.predictors`'s
    `TransitionCounts`): pointers checked and computed once, then one C call per layer and step.

    Args:
        freq_LE: `[L, E]`, inter_LEE / intra_LEE: `[L, E, E]` float64 contiguous CPU tensors (updated in place;
            this object keeps them alive).
    Attributes:
        ok: False when the kernels cannot run on these tensors (then every method returns None / False).
    """

    def __init__(self, freq_LE: torch.Tensor, inter_LEE: torch.Tensor, intra_LEE: torch.Tensor):
        self._keep = (freq_LE, inter_LEE, intra_LEE)
        self.ok = _kernels() is not None and all(
            t.dtype is _F64 and t.device.type == "cpu" and t.is_contiguous() for t in self._keep)
        L, E = freq_LE.shape
        self.E = E
        if self.ok:
            self._f, self._i, self._t = freq_LE.data_ptr(), inter_LEE.data_ptr(), intra_LEE.data_ptr()

    def observe(self, layer: int, ids: list[list[int]], prev_layer: list[list[int]] | None,
                prev_tok: list[list[int]] | None) -> bool:
        """Layer `layer`'s counts updated from a step (`TransitionCounts.observe`'s rule: each token's distinct
        experts B get freq[b] += 1, inter[a, b] += 1 for a in its previous MoE layer's set, intra[a, b] += 1 for a
        in its predecessor's set here). Rows are lists of ids (-1 ignored; may be empty). Returns False (nothing
        done) when the kernel cannot run (no kernels, rows over 64 ids)."""
        if not self.ok:
            return False
        a, k = _id_rows(ids)
        pl, kp = _id_rows(prev_layer)
        pt, kt = _id_rows(prev_tok)
        if k > _MAX_SET or kp > _MAX_SET or kt > _MAX_SET:
            return False
        if a is not None:
            E = self.E
            _lib.moeray_markov_observe(self._f + 8 * layer * E, self._i + 8 * layer * E * E,
                                       self._t + 8 * layer * E * E, E, len(ids), a, k, pl, kp, pt, kt)
        return True

    def probs(self, layer: int, alpha: float, weights: list[float], prev_layer: list[list[int]] | None,
              prev_tok: list[list[int]] | None, num_tokens: int, look_TE: torch.Tensor | None = None
              ) -> list[list[float]] | None:
        """Per token the Markov (with `look_TE`, hybrid) expert distribution: softmax over E of
        log P(b) + w_inter * PMI_inter + w_intra * PMI_intra [+ w_look * look] (`MarkovPredictor`,
        `HybridPredictor`; additive smoothing `alpha`).

        Args:
            weights: (w_inter, w_intra[, w_look]). prev_layer / prev_tok: T rows of ids, or None.
            look_TE: optional `[T, E]` float32 contiguous lookahead log-probabilities.
        Returns:
            T lists of E probabilities, or None when the kernel cannot run.
        """
        if not self.ok:
            return None
        pl, kp = _id_rows(prev_layer)
        pt, kt = _id_rows(prev_tok)
        if kp > _MAX_SET or kt > _MAX_SET:
            return None
        E, T = self.E, num_tokens
        out = (ctypes.c_float * (T * E))()
        w2 = weights[2] if look_TE is not None else 0.0
        _lib.moeray_markov_probs(self._f + 8 * layer * E, self._i + 8 * layer * E * E, self._t + 8 * layer * E * E,
                                 E, alpha, weights[0], weights[1], w2, T, pl, kp, pt, kt,
                                 None if look_TE is None else look_TE.data_ptr(), out)
        flat = list(out)
        return [flat[t * E : (t + 1) * E] for t in range(T)] if T > 1 else [flat]


class GateLogprobs:
    """The lookahead predictor's `log_softmax(gate_l(rmsnorm(h) * norm_l))` for a few rows in one call per layer,
    with the per-layer weights checked once.

    Args:
        gates: per layer `[E, D]` float32 router weights (None for dense layers). norms: per layer `[D]` float32
            RMSNorm weights or None. eps: RMSNorm epsilon.
    """

    def __init__(self, gates: list, norms: list, eps: float):
        self.eps = eps
        self._keep = []
        self._ptrs: list[tuple | None] = []
        for g, n in zip(gates, norms):
            ok = (g is not None and _f32_cpu(g) and g.dim() == 2 and g.is_contiguous()
                  and (n is None or (_f32_cpu(n) and n.is_contiguous() and n.shape == (g.shape[1],))))
            self._keep.append((g, n))
            self._ptrs.append((g.data_ptr(), None if n is None else n.data_ptr(), *g.shape) if ok else None)

    def ptrs(self, layer: int) -> tuple | None:
        """(gate pointer, norm pointer or None, E, D) of `layer`, or None where the kernel cannot run."""
        return self._ptrs[layer] if _kernels() is not None else None

    def __call__(self, layer: int, h_TD: torch.Tensor) -> torch.Tensor | None:
        """`[T, E]` float32 log-probabilities for `h_TD` `[T, D]` float32 CPU rows, or None when the kernel
        cannot run (no kernels, other dtypes/devices, more than `MAX_KERNEL_ROWS` rows, a layer without gate)."""
        p = self._ptrs[layer]
        T = h_TD.shape[0]
        if p is None or _kernels() is None or T > tuning.MAX_KERNEL_ROWS or h_TD.dtype is not _F32 \
                or h_TD.device.type != "cpu" or h_TD.stride(-1) != 1:
            return None
        gp, npt, E, D = p
        out = torch.empty(T, E, dtype=torch.float32)
        scratch = (ctypes.c_float * D)()
        _lib.moeray_gate_logprobs(h_TD.data_ptr(), h_TD.stride(0), T, D, npt, self.eps, gp, E, out.data_ptr(),
                                  scratch)
        return out


def prefetch_step(tables: MarkovTables, layer: int, ids_TK: torch.Tensor, pred: list[list[int]] | None,
                  prev_layer_TK: torch.Tensor | None, prev_tok: list[list[int]] | None, next_layer: int | None,
                  alpha: float, weights: list[float] | None, next_prev_tok: list[list[int]] | None,
                  h_TD: torch.Tensor | None, look: tuple | None, eps: float, budget: int):
    """One MoE layer of a decode step's expert-prediction bookkeeping in one call (the C function
    `moeray_prefetch_step`): score `pred` against the routing, router thrash against the predecessors' sets,
    learn the layer's Markov counts, and predict `next_layer` (Markov, or hybrid with `look`).

    Args:
        tables: the predictor's `MarkovTables`. ids_TK: `[T, K]` int64 CPU contiguous routing of `layer` (-1 pad).
        pred: the prediction made for `layer` (T rows), or None. prev_layer_TK: the previous MoE layer's routing
            `[T, K']` int64 CPU contiguous, or None. prev_tok: T rows, each token's predecessor's set here.
        next_layer: the MoE layer to predict, or None. alpha, weights: the Markov smoothing and per-layer
            weights of `next_layer` (w_inter, w_intra[, w_look]). next_prev_tok: predecessors' sets there.
        h_TD: `[T, D]` float32 hidden state (for the lookahead term), look: `GateLogprobs.ptrs(next_layer)` or
            None (Markov only). eps: its RMSNorm epsilon. budget: experts predicted per token (B).
    Returns:
        (stats, next): stats = [pred hits, predicted, routed, tokens scored, thrash sum, thrash pairs];
        next = (T rows of B predicted ids, agg [E] summed probabilities, top [E] max probabilities) or None
        without `next_layer`. None when the kernel cannot run (rows over 64 ids, more than `MAX_KERNEL_ROWS`
        tokens).
    """
    if not tables.ok:
        return None
    T, K = ids_TK.shape
    E = tables.E
    pr, B = _id_rows(pred)
    pt, kt = _id_rows(prev_tok)
    npt, knt = _id_rows(next_prev_tok)
    if max(K, B, kt, knt) > _MAX_SET or T > tuning.MAX_KERNEL_ROWS or (pred is not None and B != len(pred[0])):
        return None
    stats = (ctypes.c_double * 6)()
    f, i, t = tables._f, tables._i, tables._t
    if next_layer is None:
        _lib.moeray_prefetch_step(stats, ids_TK.data_ptr(), K, T, pr, B,
                                  None if prev_layer_TK is None else prev_layer_TK.data_ptr(),
                                  0 if prev_layer_TK is None else prev_layer_TK.shape[1], pt, kt,
                                  f + 8 * layer * E, i + 8 * layer * E * E, t + 8 * layer * E * E, E,
                                  None, None, None, 0.0, 0.0, 0.0, 0.0, None, 0, None, 0, 0, None, 0.0, None,
                                  0, None, None, None, None)
        return list(stats), None
    D = h_TD.shape[1] if look is not None else 0
    pred_out = (ctypes.c_long * (T * budget))()
    agg, top = (ctypes.c_float * E)(), (ctypes.c_float * E)()
    scratch = (ctypes.c_float * (D + 2 * T * E))()
    w2 = weights[2] if look is not None else 0.0
    nl = next_layer
    _lib.moeray_prefetch_step(stats, ids_TK.data_ptr(), K, T, pr, B,
                              None if prev_layer_TK is None else prev_layer_TK.data_ptr(),
                              0 if prev_layer_TK is None else prev_layer_TK.shape[1], pt, kt,
                              f + 8 * layer * E, i + 8 * layer * E * E, t + 8 * layer * E * E, E,
                              f + 8 * nl * E, i + 8 * nl * E * E, t + 8 * nl * E * E, alpha, weights[0], weights[1], w2,
                              npt, knt, None if look is None else h_TD.data_ptr(),
                              0 if look is None else h_TD.stride(0), D, None if look is None else look[1], eps,
                              None if look is None else look[0], budget, pred_out, agg, top, scratch)
    po = list(pred_out)
    return list(stats), ([po[r * budget : (r + 1) * budget] for r in range(T)], list(agg), list(top))
