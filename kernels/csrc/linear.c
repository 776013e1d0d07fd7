/* bf16-weight linear for fp32 rows: y = x w^T (+ b), the weight widened exactly in registers. */
#include "common.h"

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
