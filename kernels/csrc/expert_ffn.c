/* SwiGLU experts for a few fp32 rows: bf16 weight stacks (with optional routing-weighted sum), or one fp32 expert. */
#include "common.h"

/* Row r goes through expert e = ids[r] (gu [E, 2I, D]: gate rows then up rows; dn [E, D, I]):
   f(x) = dn_e (silu(gate_e x) * (up_e x)).  With wts == NULL: y[r] = f(x[r]) (a row with e < 0 gets zeros).
   With wts: y[0] = sum_r wts[r] * f(x[r]) (one token's experts combined; x's row stride may be 0).
   scratch: 2I floats. */
static void expert_ffn_bf16w(const float *x, long sx, const uint16_t *gu, const uint16_t *dn, const long *ids,
                             const float *wts, long R, long D, long I, float *y, long sy, float *scratch) {
    float *t = scratch, *hid = scratch + I;
    if (wts) for (long d = 0; d < D; d++) y[d] = 0.0f;
    for (long r = 0; r < R; r++) {
        const long e = ids[r];
        float *yr = wts ? y : y + r * sy;
        if (e < 0) {
            if (!wts) for (long d = 0; d < D; d++) yr[d] = 0.0f;
            continue;
        }
        const float *xr = x + r * sx;
        const uint16_t *g = gu + e * 2 * I * D, *dw = dn + e * D * I;
        for (long j = 0; j < I; j++) t[j] = dot1(xr, g + j * D, D);
        for (long j = 0; j < I; j++) {
            const float u = dot1(xr, g + (I + j) * D, D);
            hid[j] = t[j] / (1.0f + expf(-t[j])) * u;
        }
        if (wts) {
            const float wr = wts[r];
            for (long d = 0; d < D; d++) yr[d] += wr * dot1(hid, dw + d * I, I);
        } else {
            for (long d = 0; d < D; d++) yr[d] = dot1(hid, dw + d * I, I);
        }
    }
}

/* Entry point: expert_ffn_bf16w's arguments as one struct (kernels/cpu/_abi.py: ExpertFFNArgs). */
typedef struct {
    const float *x; long sx; const uint16_t *gu, *dn; const long *ids; const float *wts;
    long R, D, I; float *y; long sy; float *scratch;
} moeray_expert_ffn_bf16w_args;

void moeray_expert_ffn_bf16w(const moeray_expert_ffn_bf16w_args *a) {
    expert_ffn_bf16w(a->x, a->sx, a->gu, a->dn, a->ids, a->wts, a->R, a->D, a->I, a->y, a->sy, a->scratch);
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
