/* Paged decode attention over full-precision fp32 K/V: per (sequence, query head) the scores over the context,
   an exact-max softmax, then the weighted sum of V.  AVX-512 (moeray_isa_level 2): two query heads that share a
   KV head at once, the V sum in registers; AVX2: one head at a time. */
#include <stdlib.h>
#include "gemm.h"
#include "entry_points.h"

#define AI __attribute__((always_inline)) static inline
#define T512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")))

/* [sum(a), sum(b), sum(c), sum(d)] of four 8-lane vectors. */
static inline __m128 hsum4x8(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

/* sc[t] = scale * dot(qh, kh + row[t]) for t < n (4 tokens at a time: one horizontal-sum tree for 4 scores). */
static void scores(const float *qh, const float *kh, const long *row, long n, long Dh, float scale, float *sc) {
    const long Dh8 = Dh & ~7L;
    long t = 0;
    for (; t + 4 <= n; t += 4) {
        const float *k[4];
        for (int i = 0; i < 4; i++) k[i] = kh + row[t + i];
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        long d = 0;
        for (; d < Dh8; d += 8) {
            const __m256 qv = _mm256_loadu_ps(qh + d);
            a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[0] + d), a0);
            a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[1] + d), a1);
            a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[2] + d), a2);
            a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[3] + d), a3);
        }
        float s4[4];
        _mm_storeu_ps(s4, hsum4x8(a0, a1, a2, a3));
        for (int i = 0; i < 4; i++) {
            for (long e = d; e < Dh; e++) s4[i] += qh[e] * k[i][e];
            sc[t + i] = s4[i] * scale;
        }
    }
    for (; t < n; t++) sc[t] = dotf(qh, kh + row[t], Dh) * scale;
}

/* p[t] = exp(sc[t] - max) in place; returns sum p (exact max: every p <= 1, as softmax's reference form). */
static float softmax_unnormalized(float *sc, long n) {
    float mx = -INFINITY;
    for (long t = 0; t < n; t++) mx = sc[t] > mx ? sc[t] : mx;
    const __m256 mv = _mm256_set1_ps(mx);
    __m256 sv = _mm256_setzero_ps();
    long t = 0;
    for (; t + 8 <= n; t += 8) {
        const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + t), mv));
        _mm256_storeu_ps(sc + t, p);
        sv = _mm256_add_ps(sv, p);
    }
    float l = hsum(sv);
    for (; t < n; t++) { sc[t] = expf(sc[t] - mx); l += sc[t]; }
    return l;
}

/* ---------------------------------------------------------------------------------------------- AVX-512
   nh (1 or 2) query heads that share one KV head at once: each K and V row is loaded once for both; the V sum
   is kept in registers (64 dims a pass), not in memory. */
T512 AI __mmask16 lanes(long left) { return left >= 16 ? (__mmask16)0xffff : left <= 0 ? 0 : (__mmask16)((1u << left) - 1); }

T512 AI float hsum16(__m512 v) { return _mm512_reduce_add_ps(v); }

/* sc[i * n + t] = scale * dot(q_i, kh + row[t]) for heads i < nh (q_i = qh + i * Dh), t < n. */
T512 AI void scores_512(const float *qh, const float *kh, const long *row, long n, long Dh, float scale, float *sc,
                        const int nh) {
    long t = 0;
    for (; t + 4 <= n; t += 4) {
        const float *k0 = kh + row[t], *k1 = kh + row[t + 1], *k2 = kh + row[t + 2], *k3 = kh + row[t + 3];
        __m512 a[2][4];
        for (int i = 0; i < nh; i++)
            for (int j = 0; j < 4; j++) a[i][j] = _mm512_setzero_ps();
        for (long d = 0; d < Dh; d += 16) {
            const __mmask16 m = lanes(Dh - d);
            const __m512 v0 = _mm512_maskz_loadu_ps(m, k0 + d), v1 = _mm512_maskz_loadu_ps(m, k1 + d);
            const __m512 v2 = _mm512_maskz_loadu_ps(m, k2 + d), v3 = _mm512_maskz_loadu_ps(m, k3 + d);
            for (int i = 0; i < nh; i++) {
                const __m512 qv = _mm512_maskz_loadu_ps(m, qh + i * Dh + d);
                a[i][0] = _mm512_fmadd_ps(qv, v0, a[i][0]);
                a[i][1] = _mm512_fmadd_ps(qv, v1, a[i][1]);
                a[i][2] = _mm512_fmadd_ps(qv, v2, a[i][2]);
                a[i][3] = _mm512_fmadd_ps(qv, v3, a[i][3]);
            }
        }
        for (int i = 0; i < nh; i++) {
            const __m256 s01 = _mm256_add_ps(_mm512_castps512_ps256(a[i][0]), _mm512_extractf32x8_ps(a[i][0], 1));
            const __m256 s11 = _mm256_add_ps(_mm512_castps512_ps256(a[i][1]), _mm512_extractf32x8_ps(a[i][1], 1));
            const __m256 s21 = _mm256_add_ps(_mm512_castps512_ps256(a[i][2]), _mm512_extractf32x8_ps(a[i][2], 1));
            const __m256 s31 = _mm256_add_ps(_mm512_castps512_ps256(a[i][3]), _mm512_extractf32x8_ps(a[i][3], 1));
            _mm_storeu_ps(sc + i * n + t, _mm_mul_ps(hsum4x8(s01, s11, s21, s31), _mm_set1_ps(scale)));
        }
    }
    for (; t < n; t++) {
        const float *k0 = kh + row[t];
        for (int i = 0; i < nh; i++) {
            __m512 a = _mm512_setzero_ps();
            for (long d = 0; d < Dh; d += 16) {
                const __mmask16 m = lanes(Dh - d);
                a = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, qh + i * Dh + d), _mm512_maskz_loadu_ps(m, k0 + d), a);
            }
            sc[i * n + t] = hsum16(a) * scale;
        }
    }
}

/* o_i = inv_i * sum_t p_i[t] v_t for heads i < nh (p_i = p + i * n, o_i = oh + i * Dh), 64 dims a pass. */
T512 AI void weighted_v_512(const float *p, const float *vh, const long *row, long n, long Dh, const float *inv,
                            float *oh, const int nh) {
    for (long d0 = 0; d0 < Dh; d0 += 64) {
        const __mmask16 m0 = lanes(Dh - d0), m1 = lanes(Dh - d0 - 16), m2 = lanes(Dh - d0 - 32), m3 = lanes(Dh - d0 - 48);
        __m512 a[2][4];
        for (int i = 0; i < nh; i++)
            for (int j = 0; j < 4; j++) a[i][j] = _mm512_setzero_ps();
        for (long t = 0; t < n; t++) {
            const float *v = vh + row[t] + d0;
            const __m512 v0 = _mm512_maskz_loadu_ps(m0, v), v1 = _mm512_maskz_loadu_ps(m1, v + 16);
            const __m512 v2 = _mm512_maskz_loadu_ps(m2, v + 32), v3 = _mm512_maskz_loadu_ps(m3, v + 48);
            for (int i = 0; i < nh; i++) {
                const __m512 pv = _mm512_set1_ps(p[i * n + t]);
                a[i][0] = _mm512_fmadd_ps(pv, v0, a[i][0]);
                a[i][1] = _mm512_fmadd_ps(pv, v1, a[i][1]);
                a[i][2] = _mm512_fmadd_ps(pv, v2, a[i][2]);
                a[i][3] = _mm512_fmadd_ps(pv, v3, a[i][3]);
            }
        }
        for (int i = 0; i < nh; i++) {
            const __m512 iv = _mm512_set1_ps(inv[i]);
            float *o = oh + i * Dh + d0;
            _mm512_mask_storeu_ps(o, m0, _mm512_mul_ps(a[i][0], iv));
            _mm512_mask_storeu_ps(o + 16, m1, _mm512_mul_ps(a[i][1], iv));
            _mm512_mask_storeu_ps(o + 32, m2, _mm512_mul_ps(a[i][2], iv));
            _mm512_mask_storeu_ps(o + 48, m3, _mm512_mul_ps(a[i][3], iv));
        }
    }
}

/* Query heads h0 .. h0 + nh - 1 (consecutive: they share KV head g) of one sequence; sc: nh * n floats. */
T512 static void heads_512(const float *qh, const float *kh, const float *vh, const long *row, long n, long Dh,
                           float scale, float *sc, float *oh, long nh) {
    float inv[2];
    if (nh == 2) scores_512(qh, kh, row, n, Dh, scale, sc, 2);
    else scores_512(qh, kh, row, n, Dh, scale, sc, 1);
    for (long i = 0; i < nh; i++) inv[i] = 1.0f / softmax_unnormalized(sc + i * n, n);
    if (nh == 2) weighted_v_512(sc, vh, row, n, Dh, inv, oh, 2);
    else weighted_v_512(sc, vh, row, n, Dh, inv, oh, 1);
}

/* For each sequence b: query row tok[b] of q [T, H, Dh] attends over its first ctx[b] cached tokens, whose
   slot t lives in block bt[b, t / S] at offset t % S of k/v [NB, S, Hkv, Dh] (post-RoPE keys); query head h
   reads KV head h / (H / Hkv).  out row tok[b] [H, Dh].  Scratch: 2 x max ctx floats (scores) and max ctx longs (each
   token's row offset, from the block table once per sequence: no division per key).  Returns 0, or -1 when
   the scratch could not be allocated (nothing written). */
static int decode_attention(const float *q, const float *kc, const float *vc, const long *bt, long mb,
                            const long *ctx, const long *tok, float *out, long B, long H, long Hkv, long Dh,
                            long S, float scale) {
    const long rep = H / Hkv, Dh8 = Dh & ~7L;
    long nmax = 1;
    for (long b = 0; b < B; b++) nmax = ctx[b] > nmax ? ctx[b] : nmax;
    float *sc = (float *)malloc((size_t)(2 * nmax) * sizeof(float));
    long *row = (long *)malloc((size_t)nmax * sizeof(long));
    if (!sc || !row) {
        free(sc); free(row);
        return -1;
    }
    for (long b = 0; b < B; b++) {
        const long n = ctx[b];
        const long *tb = bt + b * mb;
        for (long t0 = 0, blk = 0; t0 < n; t0 += S, blk++)  /* offset of token t's slot (KV head 0), in floats */
            for (long o = 0; o < S && t0 + o < n; o++) row[t0 + o] = (tb[blk] * S + o) * Hkv * Dh;
        if (b + 1 < B) {  /* the next sequence's K and V (scattered blocks, cold since the last step) into L2 */
            const long n1 = ctx[b + 1], *tb1 = bt + (b + 1) * mb, blk_floats = S * Hkv * Dh;
            for (long t0 = 0, blk = 0; t0 < n1; t0 += S, blk++) {
                const long len = (n1 - t0 < S ? n1 - t0 : S) * Hkv * Dh;
                const float *kb = kc + tb1[blk] * blk_floats, *vb = vc + tb1[blk] * blk_floats;
                for (long f = 0; f < len; f += 16) {
                    _mm_prefetch((const char *)(kb + f), _MM_HINT_T1);
                    _mm_prefetch((const char *)(vb + f), _MM_HINT_T1);
                }
            }
        }
        if (moeray_isa_level >= 2 && n > 0) {
            for (long h = 0; h < H;) {  /* heads of one KV head two at a time */
                const long g = h / rep, nh = (h + 1 < H && (h + 1) / rep == g) ? 2 : 1;
                heads_512(q + (tok[b] * H + h) * Dh, kc + g * Dh, vc + g * Dh, row, n, Dh, scale, sc,
                          out + (tok[b] * H + h) * Dh, nh);
                h += nh;
            }
            continue;
        }
        for (long h = 0; h < H; h++) {
            const long g = h / rep;
            const float *qh = q + (tok[b] * H + h) * Dh, *kh = kc + g * Dh, *vh = vc + g * Dh;
            float *oh = out + (tok[b] * H + h) * Dh;
            for (long d = 0; d < Dh; d++) oh[d] = 0.0f;
            if (n <= 0) continue;
            scores(qh, kh, row, n, Dh, scale, sc);
            const float l = softmax_unnormalized(sc, n);
            for (long t = 0; t < n; t++) {  /* oh += p_t v_t, accumulated in the output row (L1) */
                const float *vt = vh + row[t];
                const __m256 pv = _mm256_set1_ps(sc[t]);
                long d = 0;
                for (; d < Dh8; d += 8)
                    _mm256_storeu_ps(oh + d, _mm256_fmadd_ps(pv, _mm256_loadu_ps(vt + d), _mm256_loadu_ps(oh + d)));
                for (; d < Dh; d++) oh[d] += sc[t] * vt[d];
            }
            const __m256 inv = _mm256_set1_ps(1.0f / l);
            long d = 0;
            for (; d < Dh8; d += 8) _mm256_storeu_ps(oh + d, _mm256_mul_ps(_mm256_loadu_ps(oh + d), inv));
            for (; d < Dh; d++) oh[d] *= 1.0f / l;
        }
    }
    free(sc); free(row);
    return 0;
}

/* One query row q [H, Dh] over n contiguous post-RoPE keys / values k, v [n, Hkv, Dh] (the quantized cache's
   dequantized rows, kernels/csrc/quant_decode_attention.c) -> out [H, Dh]; 0, or -1 without scratch. */
long attend_rows(const float *q, const float *k, const float *v, long n, long H, long Hkv, long Dh, float scale,
                 float *out) {
    const long bt = 0, ctx = n, tok = 0;
    return decode_attention(q, k, v, &bt, 1, &ctx, &tok, out, 1, H, Hkv, Dh, n > 0 ? n : 1, scale);
}

/* Entry point: decode_attention's arguments as one struct (moeray_decode_attention_args, entry_points.h). */
long moeray_decode_attention(const moeray_decode_attention_args *a) {
    return decode_attention(a->q, a->kc, a->vc, a->bt, a->mb, a->ctx, a->tok, a->out, a->B, a->H, a->Hkv, a->Dh,
                            a->S, a->scale);
}
