/* RMSNorm over fp32 rows, optionally after a residual add (one pass each). */
#include "common.h"
#include "entry_points.h"

/* if delta: h_out = h + delta (written to h_out), normed = that; else normed = h.  y = w * (v / rms(v)). */
static void rms_norm(const float *h, long sh, const float *delta, long sd, float *h_out, long so,
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

/* Entry point: rms_norm's arguments as one struct (moeray_rms_norm_args, entry_points.h). */
void moeray_rms_norm(const moeray_rms_norm_args *a) {
    rms_norm(a->h, a->sh, a->delta, a->sd, a->h_out, a->so, a->w, a->y, a->sy, a->M, a->D, a->eps);
}
