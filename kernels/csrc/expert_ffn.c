/* SwiGLU experts on fp32 rows: bf16 weight stacks (grouped by expert, optional routing-weighted sum), or one fp32 expert. */
#include <stdlib.h>
#include <string.h>
#include "gemm.h"

/* Row r goes through expert e = ids[r] (gu [E, 2I, D]: gate rows then up rows; dn [E, D, I]):
   f(x) = dn_e (silu(gate_e x) * (up_e x)).  With wts == NULL: y[r] = f(x[r]) (a row with e < 0 gets zeros).
   With wts: y[0] = sum_r wts[r] * f(x[r]) (one token's experts combined; x's row stride may be 0).
   Grouped: the rows are counting-sorted by expert, and each active expert runs its rows as two GEMMs
   (gate/up [n_e, 2I], then down [n_e, D]), so every expert's weights are read once per call whatever its row
   count: on the panel-layout stacks gup [E, ceil(2I/32), D, 16] and dnp [E, ceil(D/32), I, 16] words when given
   (`moeray_linear_panels`), else on gu / dn (`moeray_linear_bf16w`).  Returns 0; -1 when scratch could not be allocated; -2 when an id is >= E
   (nothing written in either case). */
static int expert_ffn_bf16w(const float *x, long sx, const uint16_t *gu, const uint16_t *dn, const uint32_t *gup,
                            const uint32_t *dnp, const long *ids, const float *wts, long R, long E, long D, long I,
                            float *y, long sy) {
    const long gup_stride = (2 * I + 31) / 32 * D * 16, dnp_stride = (D + 31) / 32 * I * 16;
    for (long r = 0; r < R; r++)
        if (ids[r] >= E) return -2;
    long *cnt = (long *)calloc((size_t)(E + 1), sizeof(long));
    long *order = (long *)malloc((size_t)(R > 0 ? R : 1) * sizeof(long));
    long nmax = 0;
    if (cnt && order) {
        for (long r = 0; r < R; r++)
            if (ids[r] >= 0) cnt[ids[r] + 1]++;
        for (long e = 0; e < E; e++) {
            if (cnt[e + 1] > nmax) nmax = cnt[e + 1];
            cnt[e + 1] += cnt[e];  /* cnt[e]: first sorted position of expert e */
        }
    }
    /* per active expert: its rows gathered [n, D], gate/up [n, 2I] (silu * up in the first I columns), down [n, D] */
    float *buf = cnt && order ? (float *)malloc((size_t)(nmax > 0 ? nmax : 1) * (size_t)(2 * D + 2 * I) * sizeof(float))
                              : NULL;
    if (!buf) {
        free(cnt); free(order);
        return -1;
    }
    float *xs = buf, *h = xs + nmax * D, *ys = h + nmax * 2 * I;
    long *pos = (long *)calloc((size_t)(E + 1), sizeof(long));
    if (!pos) { free(cnt); free(order); free(buf); return -1; }
    for (long e = 0; e <= E; e++) pos[e] = cnt[e];
    for (long r = 0; r < R; r++)
        if (ids[r] >= 0) order[pos[ids[r]]++] = r;
    free(pos);
    if (wts) for (long d = 0; d < D; d++) y[d] = 0.0f;
    else for (long r = 0; r < R; r++)
        if (ids[r] < 0) for (long d = 0; d < D; d++) y[r * sy + d] = 0.0f;
    int rc = 0;
    for (long e = 0; e < E && rc == 0; e++) {
        const long n = cnt[e + 1] - cnt[e];
        if (!n) continue;
        const long *rows = order + cnt[e];
        for (long j = 0; j < n; j++) memcpy(xs + j * D, x + rows[j] * sx, (size_t)D * sizeof(float));
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
                const float wr = wts[rows[j]];
                for (long d = 0; d < D; d++) y[d] += wr * src[d];
            } else {
                memcpy(y + rows[j] * sy, src, (size_t)D * sizeof(float));
            }
        }
    }
    free(cnt); free(order); free(buf);
    return rc;
}

/* Entry point: expert_ffn_bf16w's arguments as one struct (kernels/cpu/_abi.py: ExpertFFNArgs). */
typedef struct {
    const float *x; long sx; const uint16_t *gu, *dn; const uint32_t *gup, *dnp; const long *ids; const float *wts;
    long R, E, D, I; float *y; long sy;
} moeray_expert_ffn_bf16w_args;

long moeray_expert_ffn_bf16w(const moeray_expert_ffn_bf16w_args *a) {
    return expert_ffn_bf16w(a->x, a->sx, a->gu, a->dn, a->gup, a->dnp, a->ids, a->wts, a->R, a->E, a->D, a->I, a->y,
                            a->sy);
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
