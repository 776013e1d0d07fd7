/* Blocked GEMM of fp32 rows by bf16 weight rows: y = x w^T (+ b), fp32 accumulation over exactly widened weights.

   The shape every dense layer and expert of a decode step has: x [M, K] fp32 rows, w [N, K] bf16 rows (the
   checkpoint's layout, not repacked), M from 1 to a few hundred.  Both operands are read along K, so the kernel
   is a register-blocked dot-product GEMM: a panel of 4 weight rows is widened once into an fp32 scratch (in L1)
   and reused by every row of x; a tile of MR x rows by the 4 panel rows keeps MR * 4 vector accumulators, which
   are summed horizontally four at a time at the end of K.  Rows are taken in chunks of `MC` so the x rows of a
   chunk stay in L2 while every panel passes over them.

   Two builds of the same loop, picked at run time by `moeray_isa` (set from Python at load, see
   kernels/cpu/_build.py): AVX-512 (16 lanes, MR = 4) and AVX2 + FMA (8 lanes, MR = 3).  The AVX-512 functions
   carry a target attribute, so the library itself still builds with -mavx2 and loads on any AVX2 machine.

   Summation order: each output is sum over lanes of per-lane partial sums over K (the lane count is the
   vector width): fp32 math over the widened weights up to summation order (~1e-6 relative). */
#include <stdlib.h>
#include <string.h>
#include "gemm.h"

long moeray_isa_level = 1;  /* 1: AVX2 + FMA, 2: AVX-512 (F, BW, DQ, VL) */

void moeray_set_isa(long level) { moeray_isa_level = level >= 2 ? 2 : 1; }
long moeray_isa(void) { return moeray_isa_level; }

#define MC 64   /* rows of x per chunk */
#define NR 4    /* weight rows per panel */
#define AI __attribute__((always_inline)) static inline
#define T512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")))

/* ------------------------------------------------------------------------------------------------ AVX-512 */
/* nr bf16 rows w[j * K + k] -> wf[j * Kp + k] fp32, zero past K (to Kp, a multiple of 16) and for rows nr..3. */
T512 AI void widen_panel_512(const uint16_t *w, long K, long Kp, long nr, float *wf) {
    for (long j = 0; j < NR; j++) {
        float *o = wf + j * Kp;
        if (j >= nr) { memset(o, 0, (size_t)Kp * sizeof(float)); continue; }
        const uint16_t *wr = w + j * K;
        long k = 0;
        for (; k + 16 <= K; k += 16) {
            const __m256i h = _mm256_loadu_si256((const __m256i *)(wr + k));
            _mm512_storeu_ps(o + k, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
        }
        if (k < K) {
            const __m256i h = _mm256_maskz_loadu_epi16((__mmask16)((1u << (K - k)) - 1), wr + k);
            _mm512_storeu_ps(o + k, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
        }
    }
}

/* [sum(a), sum(b), sum(c), sum(d)] */
T512 AI __m128 hsum4_512(__m512 a, __m512 b, __m512 c, __m512 d) {
    const __m256 a8 = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
    const __m256 b8 = _mm256_add_ps(_mm512_castps512_ps256(b), _mm512_extractf32x8_ps(b, 1));
    const __m256 c8 = _mm256_add_ps(_mm512_castps512_ps256(c), _mm512_extractf32x8_ps(c, 1));
    const __m256 d8 = _mm256_add_ps(_mm512_castps512_ps256(d), _mm512_extractf32x8_ps(d, 1));
    const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a8, b8), _mm256_hadd_ps(c8, d8));
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

/* y[i * sy + j] = dot(x[i * sx:], wf[j * Kp:]) + bv[j] for i < mr (a constant after inlining), j < nr. */
T512 AI void tile_512(const float *x, long sx, const float *wf, long Kp, long K, __m128 bv, float *y, long sy,
                      long nr, const int mr) {
    __m512 acc[4][NR];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < NR; j++) acc[i][j] = _mm512_setzero_ps();
    const long K16 = K & ~15L;
    long k = 0;
    for (; k < K16; k += 16) {
        const __m512 w0 = _mm512_loadu_ps(wf + k), w1 = _mm512_loadu_ps(wf + Kp + k);
        const __m512 w2 = _mm512_loadu_ps(wf + 2 * Kp + k), w3 = _mm512_loadu_ps(wf + 3 * Kp + k);
        for (int i = 0; i < mr; i++) {
            const __m512 xv = _mm512_loadu_ps(x + i * sx + k);
            acc[i][0] = _mm512_fmadd_ps(xv, w0, acc[i][0]);
            acc[i][1] = _mm512_fmadd_ps(xv, w1, acc[i][1]);
            acc[i][2] = _mm512_fmadd_ps(xv, w2, acc[i][2]);
            acc[i][3] = _mm512_fmadd_ps(xv, w3, acc[i][3]);
        }
    }
    if (k < K) {  /* the weight panel is zero past K; x lanes past K are masked off */
        const __mmask16 m = (__mmask16)((1u << (K - k)) - 1);
        const __m512 w0 = _mm512_loadu_ps(wf + k), w1 = _mm512_loadu_ps(wf + Kp + k);
        const __m512 w2 = _mm512_loadu_ps(wf + 2 * Kp + k), w3 = _mm512_loadu_ps(wf + 3 * Kp + k);
        for (int i = 0; i < mr; i++) {
            const __m512 xv = _mm512_maskz_loadu_ps(m, x + i * sx + k);
            acc[i][0] = _mm512_fmadd_ps(xv, w0, acc[i][0]);
            acc[i][1] = _mm512_fmadd_ps(xv, w1, acc[i][1]);
            acc[i][2] = _mm512_fmadd_ps(xv, w2, acc[i][2]);
            acc[i][3] = _mm512_fmadd_ps(xv, w3, acc[i][3]);
        }
    }
    for (int i = 0; i < mr; i++) {
        const __m128 s = _mm_add_ps(hsum4_512(acc[i][0], acc[i][1], acc[i][2], acc[i][3]), bv);
        if (nr == NR) {
            _mm_storeu_ps(y + i * sy, s);
        } else {
            float t[4];
            _mm_storeu_ps(t, s);
            for (long j = 0; j < nr; j++) y[i * sy + j] = t[j];
        }
    }
}

T512 static void gemm_512(const float *x, long sx, const uint16_t *w, const float *b, float *y, long sy,
                          long M, long N, long K, float *wf) {
    const long Kp = (K + 15) & ~15L;
    for (long m0 = 0; m0 < M; m0 += MC) {
        const long mc = M - m0 < MC ? M - m0 : MC;
        const float *xc = x + m0 * sx;
        float *yc = y + m0 * sy;
        for (long n0 = 0; n0 < N; n0 += NR) {
            const long nr = N - n0 < NR ? N - n0 : NR;
            widen_panel_512(w + n0 * K, K, Kp, nr, wf);
            float bb[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            if (b) for (long j = 0; j < nr; j++) bb[j] = b[n0 + j];
            const __m128 bv = _mm_loadu_ps(bb);
            long m = 0;
            for (; m + 4 <= mc; m += 4) tile_512(xc + m * sx, sx, wf, Kp, K, bv, yc + m * sy + n0, sy, nr, 4);
            switch (mc - m) {
                case 3: tile_512(xc + m * sx, sx, wf, Kp, K, bv, yc + m * sy + n0, sy, nr, 3); break;
                case 2: tile_512(xc + m * sx, sx, wf, Kp, K, bv, yc + m * sy + n0, sy, nr, 2); break;
                case 1: tile_512(xc + m * sx, sx, wf, Kp, K, bv, yc + m * sy + n0, sy, nr, 1); break;
                default: break;
            }
        }
    }
}

/* ------------------------------------------------------------------------------------------------ AVX2 */
AI void widen_panel_256(const uint16_t *w, long K, long Kp, long nr, float *wf) {
    for (long j = 0; j < NR; j++) {
        float *o = wf + j * Kp;
        if (j >= nr) { memset(o, 0, (size_t)Kp * sizeof(float)); continue; }
        const uint16_t *wr = w + j * K;
        long k = 0;
        for (; k + 8 <= K; k += 8) _mm256_storeu_ps(o + k, load8(wr + k));
        for (; k < K; k++) o[k] = widen(wr[k]);
        for (; k < Kp; k++) o[k] = 0.0f;
    }
}

AI __m128 hsum4_256(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

/* the K tail's x lanes: mask of the first r lanes (r < 8) */
static const int32_t tail_mask_256[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};

AI void tile_256(const float *x, long sx, const float *wf, long Kp, long K, __m128 bv, float *y, long sy,
                 long nr, const int mr) {
    __m256 acc[3][NR];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < NR; j++) acc[i][j] = _mm256_setzero_ps();
    const long K8 = K & ~7L;
    long k = 0;
    for (; k < K8; k += 8) {
        __m256 xv[3];
        for (int i = 0; i < mr; i++) xv[i] = _mm256_loadu_ps(x + i * sx + k);
        for (int j = 0; j < NR; j++) {
            const __m256 wv = _mm256_loadu_ps(wf + j * Kp + k);
            for (int i = 0; i < mr; i++) acc[i][j] = _mm256_fmadd_ps(xv[i], wv, acc[i][j]);
        }
    }
    if (k < K) {
        const __m256i msk = _mm256_loadu_si256((const __m256i *)(tail_mask_256 + 8 - (K - k)));
        __m256 xv[3];
        for (int i = 0; i < mr; i++) xv[i] = _mm256_maskload_ps(x + i * sx + k, msk);
        for (int j = 0; j < NR; j++) {
            const __m256 wv = _mm256_loadu_ps(wf + j * Kp + k);
            for (int i = 0; i < mr; i++) acc[i][j] = _mm256_fmadd_ps(xv[i], wv, acc[i][j]);
        }
    }
    for (int i = 0; i < mr; i++) {
        const __m128 s = _mm_add_ps(hsum4_256(acc[i][0], acc[i][1], acc[i][2], acc[i][3]), bv);
        if (nr == NR) {
            _mm_storeu_ps(y + i * sy, s);
        } else {
            float t[4];
            _mm_storeu_ps(t, s);
            for (long j = 0; j < nr; j++) y[i * sy + j] = t[j];
        }
    }
}

static void gemm_256(const float *x, long sx, const uint16_t *w, const float *b, float *y, long sy,
                     long M, long N, long K, float *wf) {
    const long Kp = (K + 15) & ~15L;
    for (long m0 = 0; m0 < M; m0 += MC) {
        const long mc = M - m0 < MC ? M - m0 : MC;
        const float *xc = x + m0 * sx;
        float *yc = y + m0 * sy;
        for (long n0 = 0; n0 < N; n0 += NR) {
            const long nr = N - n0 < NR ? N - n0 : NR;
            widen_panel_256(w + n0 * K, K, Kp, nr, wf);
            float bb[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            if (b) for (long j = 0; j < nr; j++) bb[j] = b[n0 + j];
            const __m128 bv = _mm_loadu_ps(bb);
            long m = 0;
            for (; m + 3 <= mc; m += 3) tile_256(xc + m * sx, sx, wf, Kp, K, bv, yc + m * sy + n0, sy, nr, 3);
            switch (mc - m) {
                case 2: tile_256(xc + m * sx, sx, wf, Kp, K, bv, yc + m * sy + n0, sy, nr, 2); break;
                case 1: tile_256(xc + m * sx, sx, wf, Kp, K, bv, yc + m * sy + n0, sy, nr, 1); break;
                default: break;
            }
        }
    }
}

/* ------------------------------------------------------------------------------------------------ dispatch */
int moeray_gemm_bf16w(const float *x, long sx, const uint16_t *w, const float *b, float *y, long sy,
                      long M, long N, long K) {
    if (M <= 0 || N <= 0) return 0;
    const long Kp = (K + 15) & ~15L;
    float stack_wf[NR * 1024];
    float *wf = Kp <= 1024 ? stack_wf : (float *)malloc((size_t)(NR * Kp) * sizeof(float));
    if (!wf) return -1;
    if (moeray_isa_level >= 2) gemm_512(x, sx, w, b, y, sy, M, N, K, wf);
    else gemm_256(x, sx, w, b, y, sy, M, N, K, wf);
    if (wf != stack_wf) free(wf);
    return 0;
}
