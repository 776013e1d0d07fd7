/* Rotary position embedding (rotate-half, HF Llama/Qwen) of fp32 rows in one pass, tables indexed in place. */
#include "common.h"
#include "entry_points.h"

/* out[t, h, d] = x[t, h, d] * cos[p, d] + x[t, h, (d + Dh/2) % Dh] * sin_signed[p, d], p = pos[t]; x rows have
   strides st (token) and sh (head), unit stride along d; cos / sin_signed [P, Dh] contiguous (sin_signed: the
   first half negated, so the rotate-half sign is in the table); out [T, H, Dh] contiguous.  Returns 0, or -1
   when a position is outside [0, P) (nothing written). */
long moeray_rope(const float *x, long st, long sh, const float *cos, const float *sin_signed, const long *pos,
                 long P, float *out, long T, long H, long Dh) {
    for (long t = 0; t < T; t++)
        if (pos[t] < 0 || pos[t] >= P) return -1;
    const long half = Dh / 2, h8 = half & ~7L;
    for (long t = 0; t < T; t++) {
        const float *c = cos + pos[t] * Dh, *s = sin_signed + pos[t] * Dh;
        for (long h = 0; h < H; h++) {
            const float *xr = x + t * st + h * sh;
            float *o = out + (t * H + h) * Dh;
            long d = 0;
            for (; d < h8; d += 8) {  /* d in the first half reads d + half; d + half reads d */
                const __m256 a = _mm256_loadu_ps(xr + d), b = _mm256_loadu_ps(xr + half + d);
                _mm256_storeu_ps(o + d, _mm256_fmadd_ps(b, _mm256_loadu_ps(s + d),
                                                        _mm256_mul_ps(a, _mm256_loadu_ps(c + d))));
                _mm256_storeu_ps(o + half + d, _mm256_fmadd_ps(a, _mm256_loadu_ps(s + half + d),
                                                               _mm256_mul_ps(b, _mm256_loadu_ps(c + half + d))));
            }
            for (; d < half; d++) {
                o[d] = xr[d] * c[d] + xr[half + d] * s[d];
                o[half + d] = xr[half + d] * c[half + d] + xr[d] * s[half + d];
            }
        }
    }
    return 0;
}
