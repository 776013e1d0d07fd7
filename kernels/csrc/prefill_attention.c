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

/* s[v * ld + j] = scale * q_v . k_j for v < MR and keys j of blocks [c0, c1) of kt ([nb][Dh][KB]). */
T512 static void tile_scores(const float *const *qv, const float *kt, long c0, long c1, long Dh, float scale, float *s,
                             long ld) {
    const __m512 sc = _mm512_set1_ps(scale);
    for (long c = c0; c < c1; c++) {
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

/* A run of keys [j0, j1) whose values are read at vh + row[j] with the weights p[v * ld + j]. */
struct pv_run { const float *p, *vh; const long *row; long j0, j1; };  /* not typedef'd: no ctypes mirror */

/* o_v = inv[v] * sum over the runs of sum_j p[v * ld + j] v_j for v < MR, 32 dimensions a pass. */
T512 static void tile_pv(const struct pv_run *runs, int nruns, long ld, long Dh, const float *inv, float *const *ov) {
    for (long d0 = 0; d0 < Dh; d0 += 32) {
        const __mmask16 m0 = lanes16(Dh - d0), m1 = lanes16(Dh - d0 - 16);
        __m512 a[MR][2];
        for (int v = 0; v < MR; v++) a[v][0] = a[v][1] = _mm512_setzero_ps();
        for (int r = 0; r < nruns; r++) {
            const float *p = runs[r].p, *vh = runs[r].vh;
            const long *row = runs[r].row;
            for (long j = runs[r].j0; j < runs[r].j1; j++) {
                const float *vj = vh + row[j] + d0;
                const __m512 v0 = _mm512_maskz_loadu_ps(m0, vj), v1 = _mm512_maskz_loadu_ps(m1, vj + 16);
                for (int v = 0; v < MR; v++) {
                    const __m512 w = _mm512_set1_ps(p[v * ld + j]);
                    a[v][0] = _mm512_fmadd_ps(w, v0, a[v][0]);
                    a[v][1] = _mm512_fmadd_ps(w, v1, a[v][1]);
                }
            }
        }
        for (int v = 0; v < MR; v++) {
            const __m512 iv = _mm512_set1_ps(inv[v]);
            _mm512_mask_storeu_ps(ov[v] + d0, m0, _mm512_mul_ps(a[v][0], iv));
            _mm512_mask_storeu_ps(ov[v] + d0 + 16, m1, _mm512_mul_ps(a[v][1], iv));
        }
    }
}

/* kt[c][d][j % KB] = k_j[d] for keys j < ctx (k_j = kh + row[j]), zero padded to whole blocks. */
static void transpose_keys(const float *kh, const long *row, long ctx, long Dh, float *kt) {
    const long nbk = (ctx + KB - 1) / KB;
    memset(kt, 0, (size_t)(nbk * KB * Dh) * sizeof(float));
    for (long j = 0; j < ctx; j++) {
        const float *kj = kh + row[j];
        float *dst = kt + (j / KB) * Dh * KB + j % KB;
        for (long d = 0; d < Dh; d++) dst[d * KB] = kj[d];
    }
}

/* Entry point's arguments (kernels/cpu/_abi.py: PrefillAttentionArgs).  q, out: [n, H, Dh] (the prefill's own
   rows); kc, vc: [NB, S, Hkv, Dh] (a dense [ctx, Hkv, Dh] is S = ctx with bt = {0}); bt: the sequence's block table
   (>= ceil(ctx / S) entries).  Mixed (kf non-NULL, the quantized cache's prefill): key j of query i comes from
   kc / vc only where lo <= j < hi[i], else from the dense kf / vf [ctx, Hkv, Dh] (what decoding will see: the
   sealed blocks dequantized, the sink and the open tail in full precision).  A task computes KV heads
   [g_lo, g_hi) and, of each, query tiles part, part + parts, part + 2 parts, ... */
typedef struct {
    const float *q, *kc, *vc; const long *bt; const float *kf, *vf; const long *hi; float *out;
    long n, ctx, H, Hkv, Dh, S, lo, g_lo, g_hi, part, parts; float scale;
} moeray_prefill_attention_args;

T512 static long prefill_attention(const moeray_prefill_attention_args *a) {
    const long n = a->n, ctx = a->ctx, H = a->H, Hkv = a->Hkv, Dh = a->Dh, S = a->S, rep = H / Hkv, lo = a->lo;
    const long nbk = (ctx + KB - 1) / KB, ld = nbk * KB, p0 = ctx - n, mixed = a->kf != NULL;
    /* one tile: tr positions x hs heads of a group (hs <= MR), the heads of a group in sub-groups of hs */
    const long hs = rep < MR ? rep : MR, tr = MR / hs, nsub = (rep + hs - 1) / hs, ntile = (n + tr - 1) / tr;
    const size_t ktn = (size_t)(nbk * KB * Dh), sn = (size_t)(MR * ld);
    float *kt = (float *)malloc((mixed ? 2 : 1) * ktn * sizeof(float));
    float *s = (float *)malloc((mixed ? 2 : 1) * sn * sizeof(float));
    long *row = (long *)malloc((mixed ? 2 : 1) * (size_t)ctx * sizeof(long));
    if (!kt || !s || !row) {
        free(kt); free(s); free(row);
        return -1;
    }
    float *ktf = kt + ktn, *s2 = s + sn;  /* mixed: the dense source's keys and scores (then its weights) */
    long *rowf = row + ctx;
    for (long j = 0; j < ctx; j++) row[j] = (a->bt[j / S] * S + j % S) * Hkv * Dh;
    if (mixed)
        for (long j = 0; j < ctx; j++) rowf[j] = j * Hkv * Dh;
    for (long g = a->g_lo; g < a->g_hi; g++) {
        transpose_keys(a->kc + g * Dh, row, ctx, Dh, kt);
        if (mixed) transpose_keys(a->kf + g * Dh, rowf, ctx, Dh, ktf);
        for (long t = a->part; t < ntile * nsub; t += a->parts) {
            const long r0 = (t / nsub) * tr, h0 = g * rep + (t % nsub) * hs;
            const long nr = n - r0 < tr ? n - r0 : tr, nh = g * rep + rep - h0 < hs ? g * rep + rep - h0 : hs;
            const float *qv[MR];
            float *ov[MR];
            long lim[MR], from[MR], hmin = ctx;
            float inv[MR];
            for (int v = 0; v < MR; v++) {  /* vectors past the tile's positions or heads repeat the last real one */
                const long r = r0 + (v / hs < nr ? v / hs : nr - 1), h = h0 + (v % hs < nh ? v % hs : nh - 1);
                qv[v] = a->q + (r * H + h) * Dh;
                ov[v] = a->out + (r * H + h) * Dh;
                lim[v] = p0 + r + 1;  /* keys this vector sees */
                from[v] = mixed ? (a->hi[r] > lo ? a->hi[r] : lo) : ctx;  /* dense source from here on (and below lo) */
                if (from[v] > lim[v]) from[v] = lim[v];
                if (from[v] < hmin) hmin = from[v];
            }
            const long keys = p0 + r0 + nr;  /* the tile's last position sees this many */
            const long nb = (keys + KB - 1) / KB, clo = mixed ? (lo + KB - 1) / KB : 0, chi = hmin / KB;
            tile_scores(qv, kt, 0, nb, Dh, a->scale, s, ld);
            if (mixed) {  /* the dense source's scores where any vector reads it: keys below lo, and from hmin on */
                tile_scores(qv, ktf, 0, clo < nb ? clo : nb, Dh, a->scale, s2, ld);
                tile_scores(qv, ktf, chi > clo ? chi : clo, nb, Dh, a->scale, s2, ld);
                for (int v = 0; v < MR; v++)
                    for (long j = 0; j < lim[v]; j++)
                        if (j < lo || j >= from[v]) s[v * ld + j] = s2[v * ld + j];
            }
            for (int v = 0; v < MR; v++) inv[v] = tile_softmax(s + v * ld, lim[v], nb * KB);
            struct pv_run runs[3] = {{s, a->vc + g * Dh, row, 0, keys}};
            int nruns = 1;
            if (mixed) {  /* move the dense source's weights to s2 (exact zeros left behind in either row) */
                const long l0 = lo < keys ? lo : keys;
                for (int v = 0; v < MR; v++) {
                    float *p = s + v * ld, *p2 = s2 + v * ld;
                    for (long j = 0; j < l0; j++) { p2[j] = p[j]; p[j] = 0.0f; }
                    for (long j = l0 > hmin ? l0 : hmin; j < keys; j++) {
                        const int dense = j < lim[v] && j >= from[v];
                        p2[j] = dense ? p[j] : 0.0f;
                        if (dense) p[j] = 0.0f;
                    }
                }
                runs[nruns++] = (struct pv_run){s2, a->vf + g * Dh, rowf, 0, l0};
                runs[nruns++] = (struct pv_run){s2, a->vf + g * Dh, rowf, l0 > hmin ? l0 : hmin, keys};
            }
            tile_pv(runs, nruns, ld, Dh, inv, ov);
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
