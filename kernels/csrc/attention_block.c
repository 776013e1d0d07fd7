/* The attention half of a decoder layer for a decode step over the full-precision paged KV cache, in one call
   (kernels/cpu/attention_block.py calls it; actors/model/model.py decides when it applies):

     h = h + delta; x = RMSNorm(h) * w_in   (rms_norm.c: the previous layer's output added, this layer's input norm)
     qkv = x Wqkv^T + b                     (linear.c / gemm_panel.c: the same kernel `linear` would pick)
     q = RoPE(q); K / V cache rows at each token's slot = RoPE(k), v      (rope.c)
     o = paged decode attention of q        (decode_attention.c)
     h_out = h + o Wo^T (+ bo); x_out = RMSNorm(h_out) * w                 (rms_norm.c)

   It runs the very kernels the PyTorch-level path calls one by one, in the same order on the same values, so its
   outputs are bit-identical to that path; what it removes is the Python between them (wrappers, views, index_put
   writes, allocations: with the shared expert's call, a one-sequence decode step of the shipped model 1.30 -> 0.90 ms,
   BENCHMARKS.md).
   One thread (the caller uses it only when the rows would not be split over compute threads anyway).  A cache that
   attends itself (the quantized one) or a step with prefills takes the two halves apart, `moeray_attention_in` and
   `moeray_attention_out`, with the cache's own attention between them. */
#include <stdlib.h>
#include <string.h>
#include "gemm.h"
#include "entry_points.h"

/* Entry point's arguments (kernels/cpu/_abi.py: AttentionBlockArgs).  h, delta (NULL: none), h_out, x_out: [T, D]
   fp32 contiguous; in_norm_w [D] the input norm's weight, norm_w [D] the post-attention norm's (same eps).
   Weights: bf16 [N, K] row-major (w*) or their packed panels (w*_p, kernels/cpu/packing.py; NULL: none), fp32
   biases or NULL; Wqkv [(H + 2 Hkv) Dh, D] (q rows, then k, then v), Wo [D, H Dh].  cos / sin_signed [P, Dh]
   (sin_signed: first half negated), pos [T].  kc / vc [nslots / S, S, Hkv, Dh] fp32 (post-RoPE keys), slots [T]
   flat slot of each token.  bt [B, mb], ctx [B], tok [B] as moeray_decode_attention_args. */
typedef struct {
    const float *h, *delta, *in_norm_w; float *h_out, *x_out; long T, D;
    const uint16_t *wqkv; const uint32_t *wqkv_p; const float *bqkv;
    const uint16_t *wo; const uint32_t *wo_p; const float *bo;
    const float *norm_w; float eps;
    const float *cos, *sin_signed; long P; const long *pos;
    float *kc, *vc; long nslots; const long *slots;
    const long *bt; long mb; const long *ctx, *tok; long B;
    long H, Hkv, Dh, S; float scale;
} moeray_attention_block_args;

/* y [M, N] = x [M, K] (row stride sx) W^T (+ b): the panel kernel when W has panels, else the bf16 one. */
static long linear(const float *x, long sx, const uint16_t *w, const uint32_t *wp, const float *b, float *y, long M,
                   long N, long K) {
    if (wp) {
        moeray_linear_panels(x, sx, wp, b, y, N, M, N, K);
        return 0;
    }
    return moeray_linear_bf16w(x, sx, w, b, y, N, M, N, K);
}

static long check_positions(const moeray_attention_block_args *a) {
    for (long t = 0; t < a->T; t++)
        if (a->pos[t] < 0 || a->pos[t] >= a->P) return -2;
    return 0;
}

/* The block's first half into qkv [T, N] (q still unrotated) and x [T, D] scratch: h_mid = h + delta (h itself
   without delta, then h_mid is not written), x = RMSNorm(h_mid) * in_norm_w, qkv = x Wqkv^T + b.  Returns the
   residual stream after the add (h_mid or h), NULL when the GEMM's scratch could not be allocated. */
static const float *first_half(const moeray_attention_block_args *a, float *h_mid, float *x, float *qkv) {
    const long T = a->T, D = a->D, N = (a->H + 2 * a->Hkv) * a->Dh;
    const moeray_rms_norm_args in = {a->h, D, a->delta, D, h_mid, D, a->in_norm_w, x, D, T, D, a->eps};
    moeray_rms_norm(&in);
    if (linear(x, D, a->wqkv, a->wqkv_p, a->bqkv, qkv, T, N, D)) return NULL;
    return a->delta ? h_mid : a->h;
}

/* The block's second half: h_out = h + o Wo^T (+ bo), x_out = RMSNorm(h_out) * norm_w; y: [T, D] scratch. */
static long second_half(const moeray_attention_block_args *a, const float *h, const float *o, float *y) {
    const long T = a->T, D = a->D, qd = a->H * a->Dh;
    if (linear(o, qd, a->wo, a->wo_p, a->bo, y, T, D, qd)) return -1;
    const moeray_rms_norm_args rn = {h, D, y, D, a->h_out, D, a->norm_w, a->x_out, D, T, D, a->eps};
    moeray_rms_norm(&rn);
    return 0;
}

/* 0; -1 when a scratch could not be allocated; -2 when a position is outside [0, P); -3 when a slot is outside
   [0, nslots).  Nothing is written on -2 / -3 (checked first). */
long moeray_attention_block(const moeray_attention_block_args *a) {
    const long T = a->T, D = a->D, H = a->H, Dh = a->Dh, qd = H * Dh, kd = a->Hkv * Dh, N = qd + 2 * kd;
    if (check_positions(a)) return -2;
    for (long t = 0; t < T; t++)
        if (a->slots[t] < 0 || a->slots[t] >= a->nslots) return -3;
    float *qkv = thread_scratch((size_t)T * (size_t)(N + 2 * qd + 3 * D));  /* qkv, q, o, y, h_mid, x */
    if (!qkv) return -1;
    float *q = qkv + T * N, *o = q + T * qd, *y = o + T * qd, *h_mid = y + T * D, *x = h_mid + T * D;
    const float *h = first_half(a, h_mid, x, qkv);
    if (!h) return -1;
    moeray_rope(qkv, N, Dh, a->cos, a->sin_signed, a->pos, a->P, q, T, H, Dh);
    for (long t = 0; t < T; t++) {  /* the new K / V rows straight into their cache slots */
        const float *row = qkv + t * N;
        moeray_rope(row + qd, N, Dh, a->cos, a->sin_signed, a->pos + t, a->P, a->kc + a->slots[t] * kd, 1, a->Hkv,
                    Dh);
        memcpy(a->vc + a->slots[t] * kd, row + qd + kd, (size_t)kd * sizeof(float));
    }
    const moeray_decode_attention_args da = {q, a->kc, a->vc, a->bt, a->mb, a->ctx, a->tok, o, a->B, H, a->Hkv, Dh,
                                             a->S, a->scale};
    if (moeray_decode_attention(&da)) return -1;
    return second_half(a, h, o, y);
}

/* The block's first half alone, for a cache that attends itself (the quantized one, or a step with prefills):
   h_mid [T, D] = h + delta (not written without delta), q [T, H, Dh] = RoPE of the q columns, k / v [T, Hkv, Dh] the
   k (before RoPE) and v columns.  Reads the input, q/k/v and RoPE fields of `a`.  0; -1 without scratch; -2 when a
   position is outside [0, P) (nothing written). */
long moeray_attention_in(const moeray_attention_block_args *a, float *h_mid, float *q, float *k, float *v) {
    const long T = a->T, D = a->D, H = a->H, Dh = a->Dh, qd = H * Dh, kd = a->Hkv * Dh, N = qd + 2 * kd;
    if (check_positions(a)) return -2;
    float *qkv = thread_scratch((size_t)T * (size_t)(N + D));
    if (!qkv || !first_half(a, h_mid, qkv + T * N, qkv)) return -1;
    moeray_rope(qkv, N, Dh, a->cos, a->sin_signed, a->pos, a->P, q, T, H, Dh);
    for (long t = 0; t < T; t++) {
        memcpy(k + t * kd, qkv + t * N + qd, (size_t)kd * sizeof(float));
        memcpy(v + t * kd, qkv + t * N + qd + kd, (size_t)kd * sizeof(float));
    }
    return 0;
}

/* The block's second half alone: h_out / x_out from the residual stream h [T, D] (the first half's h_mid, or h)
   and the attention output o [T, H Dh].  Reads the output-linear and norm fields of `a`.  0; -1 without scratch. */
long moeray_attention_out(const moeray_attention_block_args *a, const float *h, const float *o) {
    float *y = thread_scratch((size_t)a->T * (size_t)a->D);
    return y ? second_half(a, h, o, y) : -1;
}
