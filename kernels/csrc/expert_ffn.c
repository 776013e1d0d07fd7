/* SwiGLU experts on fp32 rows: bf16 weight stacks (grouped by expert, optional routing-weighted sum), or one fp32 expert. */
#include <stdlib.h>
#include <string.h>
#include "gemm.h"
#include "entry_points.h"

/* Pair r goes through expert e = ids[r] (gu [E, 2I, D]: gate rows then up rows; dn [E, D, I]) on token row
   x[r / K] (K: pairs per token): f(x) = dn_e (silu(gate_e x) * (up_e x)).  Without wts: y[r] = f(x[r / K]) (a pair
   with e < 0 gets zeros).  With wts: y[t] = sum over pairs r of token t (r / K == t) of wts[r] * f(x[t]) (each
   token's experts combined; pairs with e < 0 contribute nothing).
   Grouped: the pairs are counting-sorted by expert, and each active expert runs its rows as two GEMMs
   (gate/up [n_e, 2I], then down [n_e, D]), so every expert's weights are read once per call whatever its row
   count: on the panel-layout stacks gup [E, ceil(2I/32), D, 16] and dnp [E, ceil(D/32), I, 16] words when given
   (`moeray_linear_panels`), else on gu / dn (`moeray_linear_bf16w`).  Returns 0; -1 when scratch could not be
   allocated; -2 when an id is >= E (nothing written in either case). */
static int expert_ffn_bf16w(const float *x, long sx, const uint16_t *gu, const uint16_t *dn, const uint32_t *gup,
                            const uint32_t *dnp, const long *ids, const float *wts, long R, long K, long E, long D,
                            long I, float *y, long sy) {
    const long gup_stride = (2 * I + 31) / 32 * D * 16, dnp_stride = (D + 31) / 32 * I * 16;
    for (long r = 0; r < R; r++)
        if (ids[r] >= E) return -2;
    /* start[e]: first sorted position of expert e (counting sort); order: pairs grouped by expert */
    long *start = (long *)calloc((size_t)(2 * (E + 1) + R), sizeof(long));
    if (!start) return -1;
    long *pos = start + E + 1, *order = pos + E + 1, nmax = 0;
    for (long r = 0; r < R; r++)
        if (ids[r] >= 0) start[ids[r] + 1]++;
    for (long e = 0; e < E; e++) {
        if (start[e + 1] > nmax) nmax = start[e + 1];
        start[e + 1] += start[e];
    }
    for (long e = 0; e <= E; e++) pos[e] = start[e];
    for (long r = 0; r < R; r++)
        if (ids[r] >= 0) order[pos[ids[r]]++] = r;
    /* per active expert: its rows gathered [n, D], gate/up [n, 2I] (silu * up in the first I columns), down [n, D] */
    float *xs = (float *)malloc((size_t)(nmax > 0 ? nmax : 1) * (size_t)(2 * D + 2 * I) * sizeof(float));
    if (!xs) { free(start); return -1; }
    float *h = xs + nmax * D, *ys = h + nmax * 2 * I;
    if (wts) {
        for (long t = 0; t < (R + K - 1) / K; t++) memset(y + t * sy, 0, (size_t)D * sizeof(float));
    } else {
        for (long r = 0; r < R; r++)
            if (ids[r] < 0) memset(y + r * sy, 0, (size_t)D * sizeof(float));
    }
    int rc = 0;
    for (long e = 0; e < E && rc == 0; e++) {
        const long n = start[e + 1] - start[e];
        if (!n) continue;
        const long *rows = order + start[e];
        for (long j = 0; j < n; j++) memcpy(xs + j * D, x + (rows[j] / K) * sx, (size_t)D * sizeof(float));
        if (gup) moeray_linear_panels(xs, D, gup + e * gup_stride, NULL, h, 2 * I, n, 2 * I, D);
        else rc = (int)moeray_linear_bf16w(xs, D, gu + e * 2 * I * D, NULL, h, 2 * I, n, 2 * I, D);
        if (rc) break;
        swiglu_rows(h, n, I);
        if (dnp) moeray_linear_panels(h, 2 * I, dnp + e * dnp_stride, NULL, ys, D, n, D, I);
        else rc = (int)moeray_linear_bf16w(h, 2 * I, dn + e * D * I, NULL, ys, D, n, D, I);
        if (rc) break;
        for (long j = 0; j < n; j++) {
            const float *src = ys + j * D;
            if (wts) {
                const __m256 wv = _mm256_set1_ps(wts[rows[j]]);
                float *yt = y + (rows[j] / K) * sy;
                long d = 0;
                for (; d + 8 <= D; d += 8)
                    _mm256_storeu_ps(yt + d, _mm256_fmadd_ps(wv, _mm256_loadu_ps(src + d), _mm256_loadu_ps(yt + d)));
                for (; d < D; d++) yt[d] += wts[rows[j]] * src[d];
            } else {
                memcpy(y + rows[j] * sy, src, (size_t)D * sizeof(float));
            }
        }
    }
    free(start); free(xs);
    return rc;
}

/* Entry point: expert_ffn_bf16w's arguments as one struct (entry_points.h; kernels/cpu/_abi.py: ExpertFFNArgs). */
long moeray_expert_ffn_bf16w(const moeray_expert_ffn_bf16w_args *a) {
    return expert_ffn_bf16w(a->x, a->sx, a->gu, a->dn, a->gup, a->dnp, a->ids, a->wts, a->R, a->K, a->E, a->D, a->I,
                            a->y, a->sy);
}

/* Rows r < R through one SwiGLU expert with fp32 weights gu [2I, D] (gate rows then up rows), dn [D, I]:
   y[r] = dn (silu(gate x_r) * (up x_r)).  Weight row outer, rows inner (each weight row read once).
   scratch: R * 2I floats. */
void moeray_swiglu_f32w(const float *x, long sx, long R, const float *gu, const float *dn, long D, long I,
                        float *y, long sy, float *scratch) {
    const long gn = 2 * I;
    for (long n = 0; n < gn; n++)
        for (long r = 0; r < R; r++) scratch[r * gn + n] = dotf(gu + n * D, x + r * sx, D);
    swiglu_rows(scratch, R, I);
    for (long d = 0; d < D; d++)
        for (long r = 0; r < R; r++) y[r * sy + d] = dotf(dn + d * I, scratch + r * gn, I);
}

/* The shared expert of a Qwen2-MoE layer from the layer's fused input projection y [T, *] (row stride sy): its
   gate at columns [off, off + I), up at [off + I, off + 2I), the shared gate's logit at off + 2I.
   out[t] = sigmoid(logit) (* scale[t] when given) * dn (silu(gate) * up), dn [D, I] bf16 (or its panels dnp).
   Returns 0, or -1 when scratch could not be allocated (nothing written). */
typedef struct {
    const float *y; long sy, off, I; const uint16_t *dn; const uint32_t *dnp; const float *scale; long T, D;
    float *out;
} moeray_shared_expert_args;

long moeray_shared_expert(const moeray_shared_expert_args *a) {
    const long T = a->T, I = a->I, D = a->D;
    float *t = thread_scratch((size_t)(T > 0 ? T : 1) * (size_t)(2 * I));
    if (!t) return -1;
    for (long r = 0; r < T; r++) memcpy(t + r * 2 * I, a->y + r * a->sy + a->off, (size_t)(2 * I) * sizeof(float));
    swiglu_rows(t, T, I);
    long rc = 0;
    if (a->dnp) moeray_linear_panels(t, 2 * I, a->dnp, NULL, a->out, D, T, D, I);
    else rc = moeray_linear_bf16w(t, 2 * I, a->dn, NULL, a->out, D, T, D, I);
    if (rc) return -1;
    for (long r = 0; r < T; r++) {
        float g = 1.0f / (1.0f + expf(-a->y[r * a->sy + a->off + 2 * I]));
        if (a->scale) g *= a->scale[r];
        const __m256 gv = _mm256_set1_ps(g);
        float *o = a->out + r * D;
        long d = 0;
        for (; d + 8 <= D; d += 8) _mm256_storeu_ps(o + d, _mm256_mul_ps(gv, _mm256_loadu_ps(o + d)));
        for (; d < D; d++) o[d] *= g;
    }
    return 0;
}
