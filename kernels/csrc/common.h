/* Helpers every CPU kernel shares: bf16 / fp16 widening, AVX2 dot products and reductions, SwiGLU on rows.

   Build: kernels/cpu/_build.py compiles every csrc .c file into one shared library (AVX2 + FMA, C99).  Each
   kernel runs on one thread; pool.c runs the row shares of one call on several.
   ABI: an entry point with more than 10 arguments takes one `const moeray_<op>_args *`, a struct whose fields are
   the arguments in their documented order; kernels/cpu/_abi.py mirrors each struct field for field.  Pointers
   are raw tensor data (row-major, the strides passed next to them), `long` is int64, a 0 pointer means "absent". */
#ifndef MOERAY_COMMON_H
#define MOERAY_COMMON_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <immintrin.h>

/* At least `floats` floats of scratch kept per thread (one buffer per kernel file) that only grows: a fresh block per
   call pays its page faults on every layer of every decode step.  NULL when it cannot be allocated. */
static inline float *thread_scratch(size_t floats) {
    static __thread float *scratch = NULL;
    static __thread size_t cap = 0;
    if (floats > cap) {
        free(scratch);
        scratch = (float *)malloc(floats * sizeof(float));
        cap = scratch ? floats : 0;
    }
    return scratch;
}

/* o = w * y (first) or o += w * y, D floats: one term of a combine's weighted sum (pack_rows.c, ep_exchange.c). */
static inline void weigh_term(float *o, const float *y, float w, long D, int first) {
    if (first)
        for (long d = 0; d < D; d++) o[d] = w * y[d];
    else
        for (long d = 0; d < D; d++) o[d] += w * y[d];
}

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

/* dot(a[0:n], b[0:n]), fp32 rows. */
static inline float dotf(const float *a, const float *b, long n) {
    const long n8 = n & ~7L;
    __m256 s = _mm256_setzero_ps();
    long i = 0;
    for (; i < n8; i += 8) s = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s);
    float r = hsum(s);
    for (; i < n; i++) r += a[i] * b[i];
    return r;
}

/* fp16 bits -> fp32 (exact; no F16C needed). */
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    union { uint32_t u; float f; } c;
    if (e == 0x1fu) c.u = sign | 0x7f800000u | (m << 13);            /* inf, nan */
    else if (e) c.u = sign | ((e + 112u) << 23) | (m << 13);         /* normal */
    else { c.f = (float)m * 5.9604644775390625e-08f; c.u |= sign; }  /* zero, subnormal: m * 2^-24 (exact) */
    return c.f;
}

/* A codebook's 2**bits fp16 levels as floats. */
static inline void load_levels(const uint16_t *cb, long bits, float *lv) {
    for (long i = 0; i < (1L << bits); i++) lv[i] = half_to_float(cb[i]);
}

/* exp(x) on 8 lanes: Cephes' expf (range reduction by ln 2 in two parts, degree-5 polynomial, scale by 2^n),
   within ~2 ulp of expf over the clamped range [-88.38, 88.38] (below: ~1e-38, not 0; above: ~2.4e38). */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-88.3762626647949f)), _mm256_set1_ps(88.3762626647949f));
    const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, x, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* t[r] (2I floats: gate then up) -> t[r][0:I] = silu(gate) * up = gate / (1 + exp(-gate)) * up. */
static inline void swiglu_rows(float *t, long R, long I) {
    const long I8 = I & ~7L;
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    for (long r = 0; r < R; r++) {
        float *tr = t + r * 2 * I;
        long j = 0;
        for (; j < I8; j += 8) {
            const __m256 g = _mm256_loadu_ps(tr + j);
            const __m256 s = _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, g))));
            _mm256_storeu_ps(tr + j, _mm256_mul_ps(s, _mm256_loadu_ps(tr + I + j)));
        }
        for (; j < I; j++) tr[j] = tr[j] / (1.0f + expf(-tr[j])) * tr[I + j];
    }
}

#endif
