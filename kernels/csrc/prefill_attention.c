/* Causal prefill attention over paged full-precision fp32 K/V (AVX-512; kernels/cpu/attention.py).

   The n new tokens of one sequence sit at positions ctx - n .. ctx - 1 and attend over keys 0 .. their own position
   (a cached prefix included).  Per KV head g: its keys are copied once into a transposed, 32-key-blocked scratch
   (Kt[c][d][j], keys 32c .. 32c + 31, zero padded), then query tiles of up to 8 vectors ((position, query head)
   pairs of the heads that read g) are computed in two passes, as decode_attention.c does per head:
     1. scores: s[v][j] = scale * q_v . k_j for the tile's keys (a register-blocked 8 x 32 micro-kernel: 16
        accumulators, one broadcast of q_v[d] per vector per d), keys past a vector's own position set to -inf;
     2. an exact-max softmax per vector (every weight <= 1, masked keys exactly 0), then o_v = sum_j p_v[j] v_j / l_v,
        32 dimensions a pass with 16 accumulators.
   Each vector's result depends only on its own query and keys, never on the tile it shares or on the range of tiles
   a task computes (masked weights are exact zeros), so any split of the work over threads, and any chunking of the
   prompt, gives bit-identical output.  Scratch: the transposed keys (ceil(ctx / 32) * 32 * Dh floats) and 8 rows of
   scores (8 * that many keys) per call.  Without AVX-512 the entry returns -2 and the caller runs PyTorch's SDPA. */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "gemm.h"

#define T512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")))
#define MR 8   /* query vectors per tile */
#define KB 32  /* keys per block of the transposed K */

T512 static inline __mmask16 lanes16(long left) {
    return left >= 16 ? (__mmask16)0xffff : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
}

/* exp(x) on 16 lanes: exp8's Cephes polynomial (common.h) at 512 bits, same clamp and accuracy (~2 ulp). */
T512 static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-88.3762626647949f)), _mm512_set1_ps(88.3762626647949f));
    const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                          _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, x, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

/* s[v * ld + j] = scale * q_v . k_j for v < MR and keys j of blocks [0, nb) of kt ([nb][Dh][KB]). */
T512 static void tile_scores(const float *const *qv, const float *kt, long nb, long Dh, float scale, float *s, long ld) {
    const __m512 sc = _mm512_set1_ps(scale);
    for (long c = 0; c < nb; c++) {
        const float *kc = kt + c * Dh * KB;
        __m512 a[MR][2];
        for (int v = 0; v < MR; v++) a[v][0] = a[v][1] = _mm512_setzero_ps();
        for (long d = 0; d < Dh; d++) {
            const __m512 k0 = _mm512_loadu_ps(kc + d * KB), k1 = _mm512_loadu_ps(kc + d * KB + 16);
            for (int v = 0; v < MR; v++) {
                const __m512 q = _mm512_set1_ps(qv[v][d]);
                a[v][0] = _mm512_fmadd_ps(q, k0, a[v][0]);
                a[v][1] = _mm512_fmadd_ps(q, k1, a[v][1]);
            }
        }
        for (int v = 0; v < MR; v++) {
            _mm512_storeu_ps(s + v * ld + c * KB, _mm512_mul_ps(a[v][0], sc));
            _mm512_storeu_ps(s + v * ld + c * KB + 16, _mm512_mul_ps(a[v][1], sc));
        }
    }
}

/* Row s[0, n) of one vector, keys [0, n) valid and [n, w) masked (w a multiple of 16): p = exp(s - max) in place
   (masked keys exactly 0); returns 1 / sum p. */
T512 static float tile_softmax(float *s, long n, long w) {
    __m512 mv = _mm512_set1_ps(-INFINITY);
    for (long j = 0; j < n; j += 16) mv = _mm512_max_ps(mv, _mm512_maskz_loadu_ps(lanes16(n - j), s + j));
    const float mx = _mm512_reduce_max_ps(mv);
    const __m512 m = _mm512_set1_ps(mx);
    __m512 l = _mm512_setzero_ps();
    for (long j = 0; j < w; j += 16) {
        const __mmask16 k = lanes16(n - j);
        const __m512 p = _mm512_maskz_mov_ps(k, exp16(_mm512_sub_ps(_mm512_loadu_ps(s + j), m)));
        _mm512_storeu_ps(s + j, p);
        l = _mm512_add_ps(l, p);
    }
    return 1.0f / _mm512_reduce_add_ps(l);
}

/* o_v = inv[v] * sum_{j < n} p[v * ld + j] v_j for v < MR (v_j = vh + row[j]), 32 dimensions a pass. */
T512 static void tile_pv(const float *p, long ld, const float *vh, const long *row, long n, long Dh,
                         const float *inv, float *const *ov) {
    for (long d0 = 0; d0 < Dh; d0 += 32) {
        const __mmask16 m0 = lanes16(Dh - d0), m1 = lanes16(Dh - d0 - 16);
        __m512 a[MR][2];
        for (int v = 0; v < MR; v++) a[v][0] = a[v][1] = _mm512_setzero_ps();
        for (long j = 0; j < n; j++) {
            const float *vj = vh + row[j] + d0;
            const __m512 v0 = _mm512_maskz_loadu_ps(m0, vj), v1 = _mm512_maskz_loadu_ps(m1, vj + 16);
            for (int v = 0; v < MR; v++) {
                const __m512 w = _mm512_set1_ps(p[v * ld + j]);
                a[v][0] = _mm512_fmadd_ps(w, v0, a[v][0]);
                a[v][1] = _mm512_fmadd_ps(w, v1, a[v][1]);
            }
        }
        for (int v = 0; v < MR; v++) {
            const __m512 iv = _mm512_set1_ps(inv[v]);
            _mm512_mask_storeu_ps(ov[v] + d0, m0, _mm512_mul_ps(a[v][0], iv));
            _mm512_mask_storeu_ps(ov[v] + d0 + 16, m1, _mm512_mul_ps(a[v][1], iv));
        }
    }
}

/* Entry point's arguments (kernels/cpu/_abi.py: PrefillAttentionArgs).  q, out: [n, H, Dh] (the prefill's own
   rows); kc, vc: [NB, S, Hkv, Dh]; bt: the sequence's block table (>= ceil(ctx / S) entries).  A task computes
   KV heads [g_lo, g_hi) and, of each, query tiles part, part + parts, part + 2 parts, ... */
typedef struct {
    const float *q, *kc, *vc; const long *bt; float *out;
    long n, ctx, H, Hkv, Dh, S, g_lo, g_hi, part, parts; float scale;
} moeray_prefill_attention_args;

T512 static long prefill_attention(const moeray_prefill_attention_args *a) {
    const long n = a->n, ctx = a->ctx, H = a->H, Hkv = a->Hkv, Dh = a->Dh, S = a->S, rep = H / Hkv;
    const long nbk = (ctx + KB - 1) / KB, ld = nbk * KB, p0 = ctx - n;
    /* one tile: tr positions x hs heads of a group (hs <= MR), the heads of a group in sub-groups of hs */
    const long hs = rep < MR ? rep : MR, tr = MR / hs, nsub = (rep + hs - 1) / hs, ntile = (n + tr - 1) / tr;
    float *kt = (float *)malloc((size_t)(nbk * KB * Dh) * sizeof(float));
    float *s = (float *)malloc((size_t)(MR * ld) * sizeof(float));
    long *row = (long *)malloc((size_t)ctx * sizeof(long));
    if (!kt || !s || !row) {
        free(kt); free(s); free(row);
        return -1;
    }
    for (long j = 0; j < ctx; j++) row[j] = (a->bt[j / S] * S + j % S) * Hkv * Dh;
    for (long g = a->g_lo; g < a->g_hi; g++) {
        memset(kt, 0, (size_t)(nbk * KB * Dh) * sizeof(float));
        for (long j = 0; j < ctx; j++) {
            const float *kj = a->kc + row[j] + g * Dh;
            float *dst = kt + (j / KB) * Dh * KB + j % KB;
            for (long d = 0; d < Dh; d++) dst[d * KB] = kj[d];
        }
        const float *vh = a->vc + g * Dh;
        for (long t = a->part; t < ntile * nsub; t += a->parts) {
            const long r0 = (t / nsub) * tr, h0 = g * rep + (t % nsub) * hs;
            const long nr = n - r0 < tr ? n - r0 : tr, nh = g * rep + rep - h0 < hs ? g * rep + rep - h0 : hs;
            const float *qv[MR];
            float *ov[MR];
            long lim[MR];
            float inv[MR];
            for (int v = 0; v < MR; v++) {  /* vectors past the tile's positions or heads repeat the last real one */
                const long r = r0 + (v / hs < nr ? v / hs : nr - 1), h = h0 + (v % hs < nh ? v % hs : nh - 1);
                qv[v] = a->q + (r * H + h) * Dh;
                ov[v] = a->out + (r * H + h) * Dh;
                lim[v] = p0 + r + 1;  /* keys this vector sees */
            }
            const long keys = p0 + r0 + nr;  /* the tile's last position sees this many */
            const long nb = (keys + KB - 1) / KB;
            tile_scores(qv, kt, nb, Dh, a->scale, s, ld);
            for (int v = 0; v < MR; v++) inv[v] = tile_softmax(s + v * ld, lim[v], nb * KB);
            tile_pv(s, ld, vh, row, keys, Dh, inv, ov);
        }
    }
    free(kt); free(s); free(row);
    return 0;
}

/* 0, -1 when the scratch could not be allocated, -2 without AVX-512 (nothing written in either case). */
long moeray_prefill_attention(const void *args) {
    if (moeray_isa_level < 2) return -2;
    return prefill_attention((const moeray_prefill_attention_args *)args);
}
