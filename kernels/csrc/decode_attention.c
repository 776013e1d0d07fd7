/* Paged decode attention over full-precision fp32 K/V: per (sequence, KV head), the scores of every query head
   that shares the KV head, an exact softmax, then the weighted sum of V. */
#include <stdlib.h>
#include "common.h"

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

/* For each sequence b: query row tok[b] of q [T, H, Dh] attends over its first ctx[b] cached tokens, whose
   slot t lives in block bt[b, t / S] at offset t % S of k/v [NB, S, Hkv, Dh] (post-RoPE keys); query head h
   reads KV head h / (H / Hkv).  out row tok[b] [H, Dh].  Scratch: max ctx floats (scores) and longs (each
   token's row offset, from the block table once per sequence: no division per key).  Returns 0, or -1 when
   the scratch could not be allocated (nothing written). */
static int decode_attention(const float *q, const float *kc, const float *vc, const long *bt, long mb,
                            const long *ctx, const long *tok, float *out, long B, long H, long Hkv, long Dh,
                            long S, float scale) {
    const long rep = H / Hkv, Dh8 = Dh & ~7L;
    long nmax = 1;
    for (long b = 0; b < B; b++) nmax = ctx[b] > nmax ? ctx[b] : nmax;
    float *sc = (float *)malloc((size_t)nmax * sizeof(float));
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

/* Entry point: decode_attention's arguments as one struct (kernels/cpu/_abi.py: DecodeAttentionArgs). */
typedef struct {
    const float *q, *kc, *vc; const long *bt; long mb; const long *ctx, *tok; float *out;
    long B, H, Hkv, Dh, S; float scale;
} moeray_decode_attention_args;

long moeray_decode_attention(const moeray_decode_attention_args *a) {
    return decode_attention(a->q, a->kc, a->vc, a->bt, a->mb, a->ctx, a->tok, a->out, a->B, a->H, a->Hkv, a->Dh,
                            a->S, a->scale);
}
