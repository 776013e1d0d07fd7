/* GEMM of fp32 rows by bf16 weights stored in column panels: y = x w^T (+ b), fp32 accumulation, no reduction.

   Panel layout (kernels/cpu/packing.py writes it once per weight): w [N, K] bf16 becomes P = ceil(N / 32)
   panels of 32 output columns; panel p holds, for each k, 16 32-bit words, word j = bf16(w[32p + j, k]) in the
   low half and bf16(w[32p + 16 + j, k]) in the high half (columns past N are zero).  So one 64-byte load per k
   gives 32 columns, widened exactly by one shift (low halves) and one mask (high halves).

   Outer-product micro-kernel (the BLIS / MKL form): a tile of MR rows by the 32 panel columns keeps MR x 2
   16-lane accumulators; for each k, x[m, k] is broadcast and multiplied into both.  Every output is summed over
   k in order, in one lane: no horizontal reduction, whatever K.  The panel (32 K 2 bytes) stays in L1 while
   every row of x passes over it, so each weight is read from memory once per call.  AVX-512: MR = 8; AVX2
   (8 lanes, the same panel read as two 32-byte halves): MR = 2, 8 accumulators. */
#include "gemm.h"

#define AI __attribute__((always_inline)) static inline
#define T512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")))

/* store columns [0, nc) of the 32 in (lo: columns 0-15, hi: 16-31) to y (+ bias b, nc columns) */
T512 AI void store32_512(float *y, const float *b, long nc, __m512 lo, __m512 hi) {
    const __mmask16 m0 = nc >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << nc) - 1);
    const __mmask16 m1 = nc >= 32 ? (__mmask16)0xffff : nc <= 16 ? (__mmask16)0 : (__mmask16)((1u << (nc - 16)) - 1);
    if (b) {
        lo = _mm512_add_ps(lo, _mm512_maskz_loadu_ps(m0, b));
        hi = _mm512_add_ps(hi, _mm512_maskz_loadu_ps(m1, b + 16));
    }
    _mm512_mask_storeu_ps(y, m0, lo);
    _mm512_mask_storeu_ps(y + 16, m1, hi);
}

T512 AI void ptile_512(const float *x, long sx, const uint32_t *wp, long K, const float *b, float *y, long sy,
                       long nc, const int mr) {
    __m512 lo[8], hi[8];
    for (int i = 0; i < mr; i++) lo[i] = hi[i] = _mm512_setzero_ps();
    const __m512i mask_hi = _mm512_set1_epi32((int)0xffff0000u);
    for (long k = 0; k < K; k++) {
        const __m512i h = _mm512_loadu_si512((const void *)(wp + k * 16));
        const __m512 w0 = _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
        const __m512 w1 = _mm512_castsi512_ps(_mm512_and_si512(h, mask_hi));
        for (int i = 0; i < mr; i++) {
            const __m512 xv = _mm512_set1_ps(x[i * sx + k]);
            lo[i] = _mm512_fmadd_ps(xv, w0, lo[i]);
            hi[i] = _mm512_fmadd_ps(xv, w1, hi[i]);
        }
    }
    for (int i = 0; i < mr; i++) store32_512(y + i * sy, b, nc, lo[i], hi[i]);
}

T512 static void panel_gemm_512(const float *x, long sx, const uint32_t *wp, const float *b, float *y, long sy,
                                long M, long N, long K) {
    for (long n0 = 0; n0 < N; n0 += 32) {
        const uint32_t *p = wp + (n0 / 32) * K * 16;
        const float *bn = b ? b + n0 : 0;
        const long nc = N - n0 < 32 ? N - n0 : 32;
        long m = 0;
        for (; m + 8 <= M; m += 8) ptile_512(x + m * sx, sx, p, K, bn, y + m * sy + n0, sy, nc, 8);
        const float *xm = x + m * sx;
        float *ym = y + m * sy + n0;
        switch (M - m) {
            case 7: ptile_512(xm, sx, p, K, bn, ym, sy, nc, 7); break;
            case 6: ptile_512(xm, sx, p, K, bn, ym, sy, nc, 6); break;
            case 5: ptile_512(xm, sx, p, K, bn, ym, sy, nc, 5); break;
            case 4: ptile_512(xm, sx, p, K, bn, ym, sy, nc, 4); break;
            case 3: ptile_512(xm, sx, p, K, bn, ym, sy, nc, 3); break;
            case 2: ptile_512(xm, sx, p, K, bn, ym, sy, nc, 2); break;
            case 1: ptile_512(xm, sx, p, K, bn, ym, sy, nc, 1); break;
            default: break;
        }
    }
}

/* AVX2: words 0-7 hold columns 0-7 (low) and 16-23 (high), words 8-15 columns 8-15 and 24-31. */
AI void ptile_256(const float *x, long sx, const uint32_t *wp, long K, const float *b, float *y, long sy,
                  long nc, const int mr) {
    __m256 a[2][4];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < 4; j++) a[i][j] = _mm256_setzero_ps();
    const __m256i mask_hi = _mm256_set1_epi32((int)0xffff0000u);
    for (long k = 0; k < K; k++) {
        const __m256i h0 = _mm256_loadu_si256((const __m256i *)(wp + k * 16));
        const __m256i h1 = _mm256_loadu_si256((const __m256i *)(wp + k * 16 + 8));
        const __m256 c0 = _mm256_castsi256_ps(_mm256_slli_epi32(h0, 16));   /* columns 0-7 */
        const __m256 c1 = _mm256_castsi256_ps(_mm256_slli_epi32(h1, 16));   /* 8-15 */
        const __m256 c2 = _mm256_castsi256_ps(_mm256_and_si256(h0, mask_hi));  /* 16-23 */
        const __m256 c3 = _mm256_castsi256_ps(_mm256_and_si256(h1, mask_hi));  /* 24-31 */
        for (int i = 0; i < mr; i++) {
            const __m256 xv = _mm256_set1_ps(x[i * sx + k]);
            a[i][0] = _mm256_fmadd_ps(xv, c0, a[i][0]);
            a[i][1] = _mm256_fmadd_ps(xv, c1, a[i][1]);
            a[i][2] = _mm256_fmadd_ps(xv, c2, a[i][2]);
            a[i][3] = _mm256_fmadd_ps(xv, c3, a[i][3]);
        }
    }
    for (int i = 0; i < mr; i++) {
        float t[32];
        for (int j = 0; j < 4; j++) _mm256_storeu_ps(t + 8 * j, a[i][j]);
        float *yi = y + i * sy;
        for (long c = 0; c < nc; c++) yi[c] = t[c] + (b ? b[c] : 0.0f);
    }
}

static void panel_gemm_256(const float *x, long sx, const uint32_t *wp, const float *b, float *y, long sy,
                           long M, long N, long K) {
    for (long n0 = 0; n0 < N; n0 += 32) {
        const uint32_t *p = wp + (n0 / 32) * K * 16;
        const float *bn = b ? b + n0 : 0;
        const long nc = N - n0 < 32 ? N - n0 : 32;
        long m = 0;
        for (; m + 2 <= M; m += 2) ptile_256(x + m * sx, sx, p, K, bn, y + m * sy + n0, sy, nc, 2);
        if (m < M) ptile_256(x + m * sx, sx, p, K, bn, y + m * sy + n0, sy, nc, 1);
    }
}

void moeray_linear_panels(const float *x, long sx, const uint32_t *wp, const float *b, float *y, long sy,
                          long M, long N, long K) {
    if (M <= 0 || N <= 0) return;
    if (moeray_isa_level >= 2) panel_gemm_512(x, sx, wp, b, y, sy, M, N, K);
    else panel_gemm_256(x, sx, wp, b, y, sy, M, N, K);
}
