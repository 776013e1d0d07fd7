/* Quantizing N tokens of one layer's keys and values for the paged cache (kernels/kv_quant.py: quantize_kv, the
   reference this equals bit for bit): the seal of a full block in decode, and a prompt's sealed blocks in prefill.

   Keys (pre-RoPE, per channel): x = (k - k_zero) / k_scale, then with per-channel widths w the nearest level of
   the uniform grid, code = min(rint((clamp(x, -1, 1) + 1) * 0.5 * top), top), top = 2^w - 1 (rint: ties to even,
   as torch.round); with a codebook the number of codebook midpoints below x (torch.bucketize, right=False).
   Values (per token): c = v - v_zero, the row's scale from the largest |c| over its inlier channels (fp16, never 0;
   or the least 8-bit log2 code whose table scale is >= it, `encode_value_scale`), code = midpoints below c / scale.
   Codes are packed as kv_bits.c packs them; outlier channels are also kept as fp16 (saturating at 65504).
   Every float operation is the reference's, in its order, so no contraction or rounding differs. */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <immintrin.h>

void moeray_pack_codes_var(const long *codes, long N, long H, long D, const long *w, long pk, uint8_t *packed);

#define FP16_MAX 65504.0f

/* fp32 -> fp16 bits, round to nearest even (F16C). */
__attribute__((target("f16c"))) static inline uint16_t to_half(float x) {
    return (uint16_t)_mm_cvtsi128_si32(_mm_cvtps_ph(_mm_set_ss(x), _MM_FROUND_TO_NEAREST_INT));
}
__attribute__((target("f16c"))) static inline float from_half(uint16_t h) {
    return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h)));
}

/* 4 int64 (small, non-negative) -> 4 int32 */
static inline __m128i widths4(const long *p) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)p);
    const __m256i lo = _mm256_permutevar8x32_epi32(v, _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6));
    return _mm256_castsi256_si128(lo);
}

/* how many of the n ascending midpoints are < x (torch.bucketize(x, mids), right=False) */
static inline long below(const float *mids, long n, float x) {
    long lo = 0, hi = n;
    while (lo < hi) {
        const long m = (lo + hi) / 2;
        if (mids[m] < x) lo = m + 1; else hi = m;
    }
    return lo;
}

/* Arguments (kernels/cpu/_abi.py: QuantizeKVArgs). k, v: [N, H, D] fp32. k_zero, k_scale, v_zero: [H, D] fp32.
   kw: [H, D] int64 key widths; k_grid 1: the per-channel uniform grid, 0: k_mids [nk] (the key codebook's
   midpoints). v_mids [nv]; vbits: value code width. v_inlier [H, D] uint8 (1: the channel sets the scale).
   vs_lut: NULL (fp16 scales into v_scale16 [N, H]) or the [256] 8-bit scale table (codes into v_scale8 [N, H]).
   k_oidx [H, Ok], v_oidx [H, Ov] int64; k_out [N, H, Ok], v_out [N, H, Ov] fp16 bits. k_codes [N, H, Pk],
   v_codes [N, H, P] uint8. codes: int64 scratch of N * H * D. */
typedef struct {
    const float *k, *v; long N, H, D;
    const float *k_zero, *k_scale, *v_zero; const long *kw; long k_grid; const float *k_mids; long nk;
    const float *v_mids; long nv; long vbits; const uint8_t *v_inlier; const float *vs_lut;
    const long *k_oidx; long Ok; const long *v_oidx; long Ov;
    uint8_t *k_codes; long Pk; uint8_t *v_codes; long P; uint16_t *v_scale16; uint8_t *v_scale8;
    uint16_t *k_out; uint16_t *v_out; long *codes;
} moeray_quantize_kv_args;

/* the least 8-bit code whose table scale is >= mag (encode_value_scale: a log2 estimate, then +-1 by the table) */
static uint8_t scale_code(float mag, const float *lut) {
    const float m = mag < 1e-30f ? 1e-30f : mag;
    float e = ceilf(log2f(m) * 16.0f) + 128.0f;
    long c = (long)(e < 0.0f ? 0.0f : e > 255.0f ? 255.0f : e);
    if (c > 0 && lut[c - 1] >= mag) c--;
    if (c < 255 && lut[c] < mag) c++;
    return (uint8_t)c;
}

/* 8 lanes of `below`: the count of midpoints < x, one compare per midpoint (codebooks of up to 16 levels). */
static inline __m256i below8(const float *mids, long n, __m256 x) {
    __m256i c = _mm256_setzero_si256();
    for (long j = 0; j < n; j++)
        c = _mm256_sub_epi32(c, _mm256_castps_si256(_mm256_cmp_ps(_mm256_set1_ps(mids[j]), x, _CMP_LT_OQ)));
    return c;
}

/* int32 lanes -> int64 codes */
static inline void store_codes8(long *out, __m256i c) {
    _mm256_storeu_si256((__m256i *)out, _mm256_cvtepi32_epi64(_mm256_castsi256_si128(c)));
    _mm256_storeu_si256((__m256i *)(out + 4), _mm256_cvtepi32_epi64(_mm256_extracti128_si256(c, 1)));
}

void moeray_quantize_kv(const moeray_quantize_kv_args *a) {
    const long N = a->N, H = a->H, D = a->D, row = H * D;
    /* keys: 8 elements a vector, the rest one at a time (the same IEEE operations; rounding ties to even) */
    const int vec = a->k_grid || a->nk <= 15;
    const __m256 one = _mm256_set1_ps(1.0f), neg = _mm256_set1_ps(-1.0f), half = _mm256_set1_ps(0.5f);
    for (long n = 0; n < N; n++) {
        long i = 0;
        for (; vec && i + 8 <= row; i += 8) {
            const __m256 x = _mm256_div_ps(_mm256_sub_ps(_mm256_loadu_ps(a->k + n * row + i),
                                                         _mm256_loadu_ps(a->k_zero + i)),
                                           _mm256_loadu_ps(a->k_scale + i));
            __m256i c;
            if (a->k_grid) {
                const __m256i w = _mm256_set_m128i(widths4(a->kw + i + 4), widths4(a->kw + i));
                const __m256 top = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_sllv_epi32(_mm256_set1_epi32(1), w),
                                                                       _mm256_set1_epi32(1)));
                const __m256 y = _mm256_min_ps(_mm256_max_ps(x, neg), one);
                const __m256 r = _mm256_round_ps(_mm256_mul_ps(_mm256_mul_ps(_mm256_add_ps(y, one), half), top),
                                                 _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                c = _mm256_cvtps_epi32(_mm256_min_ps(r, top));
            } else {
                c = below8(a->k_mids, a->nk, x);
            }
            store_codes8(a->codes + n * row + i, c);
        }
        for (; i < row; i++) {
            const float x = (a->k[n * row + i] - a->k_zero[i]) / a->k_scale[i];
            long c;
            if (a->k_grid) {
                const float top = (float)((1L << a->kw[i]) - 1);
                const float y = x < -1.0f ? -1.0f : x > 1.0f ? 1.0f : x;
                const float r = rintf((y + 1.0f) * 0.5f * top);
                c = (long)(r < top ? r : top);
            } else {
                c = below(a->k_mids, a->nk, x);
            }
            a->codes[n * row + i] = c;
        }
    }
    moeray_pack_codes_var(a->codes, N, H, D, a->kw, a->Pk, a->k_codes);
    /* values */
    long vw[1024];
    for (long d = 0; d < D && d < 1024; d++) vw[d] = a->vbits;
    for (long n = 0; n < N; n++)
        for (long h = 0; h < H; h++) {
            const float *v = a->v + (n * H + h) * D, *vz = a->v_zero + h * D;
            const uint8_t *in = a->v_inlier + h * D;
            float c[1024], mag = 0.0f;
            for (long d = 0; d < D; d++) {
                c[d] = v[d] - vz[d];
                const float m = in[d] ? fabsf(c[d]) : 0.0f;
                if (m > mag) mag = m;
            }
            float s;
            if (a->vs_lut) {
                const uint8_t code = scale_code(mag, a->vs_lut);
                a->v_scale8[n * H + h] = code;
                s = a->vs_lut[code];
            } else {
                uint16_t hs = to_half(mag < FP16_MAX ? mag : FP16_MAX);
                if (!(from_half(hs) > 0.0f)) hs = 0x3c00;  /* 1.0: a row of zeros */
                a->v_scale16[n * H + h] = hs;
                s = from_half(hs);
            }
            long *out = a->codes + (n * H + h) * D;
            long d = 0;
            if (a->nv <= 15) {
                const __m256 sv = _mm256_set1_ps(s);
                for (; d + 8 <= D; d += 8)
                    store_codes8(out + d, below8(a->v_mids, a->nv, _mm256_div_ps(_mm256_loadu_ps(c + d), sv)));
            }
            for (; d < D; d++) out[d] = below(a->v_mids, a->nv, c[d] / s);
        }
    for (long h = 0; h < H; h++)  /* pack_codes_var with one width per head row = pack_codes */
        for (long n = 0; n < N; n++)
            moeray_pack_codes_var(a->codes + (n * H + h) * D, 1, 1, D, vw, a->P, a->v_codes + (n * H + h) * a->P);
    /* outlier channels, fp16 */
    for (long n = 0; n < N; n++)
        for (long h = 0; h < H; h++) {
            for (long o = 0; o < a->Ok; o++) {
                const float x = a->k[(n * H + h) * D + a->k_oidx[h * a->Ok + o]];
                a->k_out[(n * H + h) * a->Ok + o] = to_half(x < -FP16_MAX ? -FP16_MAX : x > FP16_MAX ? FP16_MAX : x);
            }
            for (long o = 0; o < a->Ov; o++) {
                const float x = a->v[(n * H + h) * D + a->v_oidx[h * a->Ov + o]];
                a->v_out[(n * H + h) * a->Ov + o] = to_half(x < -FP16_MAX ? -FP16_MAX : x > FP16_MAX ? FP16_MAX : x);
            }
        }
}
