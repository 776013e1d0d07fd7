/* The attention half of a decoder layer for a decode step over the full-precision paged KV cache, in one call
   (kernels/cpu/attention_block.py calls it; actors/model/model.py decides when it applies):

     h = h + delta; x = RMSNorm(h) * w_in   (rms_norm.c: the previous layer's output added, this layer's input norm)
     qkv = x Wqkv^T + b                     (linear.c / gemm_panel.c: the same kernel `linear` would pick)
     q = RoPE(q); K / V cache rows at each token's slot = RoPE(k), v      (rope.c)
     o = paged decode attention of q        (decode_attention.c)
     h_out = h + o Wo^T (+ bo); x_out = RMSNorm(h_out) * w                 (rms_norm.c)

   It runs the very kernels the PyTorch-level path calls one by one, in the same order on the same values, so its
   outputs are bit-identical to that path; what it removes is the Python between them (~110 us of wrappers, views,
   index_put writes and allocations per layer on the shipped model, about a quarter of a one-sequence decode step).
   One thread (the caller uses it only when the rows would not be split over compute threads anyway). */
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

/* 0; -1 when a scratch could not be allocated; -2 when a position is outside [0, P); -3 when a slot is outside
   [0, nslots).  Nothing is written on -2 / -3 (checked first). */
long moeray_attention_block(const moeray_attention_block_args *a) {
    const long T = a->T, D = a->D, H = a->H, Dh = a->Dh, qd = H * Dh, kd = a->Hkv * Dh, N = qd + 2 * kd;
    for (long t = 0; t < T; t++) {
        if (a->pos[t] < 0 || a->pos[t] >= a->P) return -2;
        if (a->slots[t] < 0 || a->slots[t] >= a->nslots) return -3;
    }
    /* per-thread scratch that only grows: qkv [T, N], q [T, qd], o [T, qd], y [T, D], h_in [T, D], x [T, D] */
    static __thread float *scratch = NULL;
    static __thread size_t cap = 0;
    const size_t need = (size_t)T * (size_t)(N + 2 * qd + 3 * D);
    if (need > cap) {
        free(scratch);
        scratch = (float *)malloc(need * sizeof(float));
        cap = scratch ? need : 0;
        if (!scratch) return -1;
    }
    float *qkv = scratch, *q = qkv + T * N, *o = q + T * qd, *y = o + T * qd, *h_in = y + T * D, *x = h_in + T * D;
    const moeray_rms_norm_args in = {a->h, D, a->delta, D, h_in, D, a->in_norm_w, x, D, T, D, a->eps};
    moeray_rms_norm(&in);  /* without delta h_in is not written: the residual stream is h itself */
    const float *h = a->delta ? h_in : a->h;
    if (linear(x, D, a->wqkv, a->wqkv_p, a->bqkv, qkv, T, N, D)) return -1;
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
    if (linear(o, qd, a->wo, a->wo_p, a->bo, y, T, D, qd)) return -1;
    const moeray_rms_norm_args rn = {h, D, y, D, a->h_out, D, a->norm_w, a->x_out, D, T, D, a->eps};
    moeray_rms_norm(&rn);
    return 0;
}
