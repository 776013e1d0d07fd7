/* bf16-weight linear for fp32 rows: y = x w^T (+ b), the weight widened exactly in registers. */
#include "gemm.h"

/* y[m*sy + n] = sum_k x[m*sx + k] * w[n*K + k] (+ b[n]).  w: [N, K] bf16 bits, row-major, contiguous.
   One row (decode at batch 1): one dot product per weight row, widened in registers straight from the bf16
   stream (no scratch: the fastest form when nothing reuses the widened row).  More rows: the blocked GEMM
   (gemm.c), which widens each panel of weight rows once for all of them.
   Returns 0, or -1 when the GEMM's scratch could not be allocated (nothing written). */
long moeray_linear_bf16w(const float *x, long sx, const uint16_t *w, const float *b, float *y, long sy,
                        long M, long N, long K) {
    if (M != 1) return moeray_gemm_bf16w(x, sx, w, b, y, sy, M, N, K);
    for (long n = 0; n < N; n++) y[n] = dot1(x, w + n * K, K) + (b ? b[n] : 0.0f);
    return 0;
}

/* One row-split share of a linear (kernels/csrc/pool.c runs several at once): `moeray_linear_panels` when `wp` is
   given, else `moeray_linear_bf16w`.  Returns 0, or -1 as moeray_linear_bf16w. */
typedef struct {
    const float *x; long sx; const uint16_t *w; const uint32_t *wp; const float *b; float *y; long sy, M, N, K;
} moeray_linear_args;

long moeray_linear_task(const moeray_linear_args *a) {
    if (a->wp) {
        moeray_linear_panels(a->x, a->sx, a->wp, a->b, a->y, a->sy, a->M, a->N, a->K);
        return 0;
    }
    return moeray_linear_bf16w(a->x, a->sx, a->w, a->b, a->y, a->sy, a->M, a->N, a->K);
}
