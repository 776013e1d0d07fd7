/* Decode attention over the quantized paged KV cache (kernels/paged_attention.py: the contract and its PyTorch
   reference, which this equals up to fp32 rounding; kernels/cpu/quant_attention.py calls it).

   Per sequence: its sink (full precision, post-RoPE), its sealed quantized tokens and its unsealed tail (full
   precision, post-RoPE) are laid out as contiguous fp32 K / V rows [T, H, D] in a scratch, the quantized ones
   dequantized on the way: keys unpacked from their per-channel-width bitstream (or fixed-width codes) to levels
   (the per-channel uniform grid, or the key codebook), times k_scale plus k_zero, the outlier channels restored
   from fp16, then rotated by RoPE at their position (keys are stored before RoPE); values: v_codebook[code] times
   the token's fp16 scale plus v_zero, outliers restored.  Then attend_rows (decode_attention.c) attends the query
   over the rows.  The scratch (2 T H D floats) is reused across the call's sequences. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "gemm.h"

long attend_rows(const float *q, const float *k, const float *v, long n, long H, long Hkv, long Dh, float scale,
                 float *out);                                                      /* decode_attention.c */
void unpack_code_row(const uint8_t *in, long pk, const long *w, long D, long *c);  /* kv_bits.c */

/* Entry point's arguments (kernels/cpu/_abi.py: QuantDecodeArgs).  Page fields: pointers to page 0 and each
   field's page stride in its own elements (inner dimensions dense): k_codes [NB, H, S, Pk], v_codes [NB, H, S, P]
   (bytes), v_scale [NB, S, H], k_outliers [NB, S, H, Ok], v_outliers [NB, S, H, Ov] (fp16).  Sink / tail: [B, Ns or Nt, H, D]
   fp32 post-RoPE (NULL: none) with valid lengths.  kw: [H, D] int64 key widths; k_grid 1: keys on the per-channel
   uniform grid -1 + 2 c / (2^w - 1), 0: k_cb[c] (then every width = bits). */
typedef struct {
    const float *q; const uint8_t *kc, *vc; const uint16_t *vs, *ko, *vo; long skc, svc, svs, sko, svo;
    const long *bt; long mb; const long *ctx; const float *cosr, *sinr;
    const float *sk, *sv; const long *slen; long ns; const float *tk, *tv; const long *tlen; long nt;
    const float *k_scale, *k_zero, *v_zero, *k_cb, *v_cb; const long *kw; long k_grid, vbits, Pk, P;
    const long *k_oidx, *v_oidx; long Ok, Ov; float *out; long B, Hq, H, D, S; float scale;
} moeray_quant_decode_args;

static void dequant_token(const moeray_quant_decode_args *a, long page, long slot, long pos, float *krow,
                          float *vrow, long *code, long *vw) {
    const long H = a->H, D = a->D, S = a->S, half = D / 2;
    const uint8_t *kc = a->kc + page * a->skc, *vc = a->vc + page * a->svc;
    const uint16_t *vs = a->vs + page * a->svs, *ko = a->ko + page * a->sko, *vo = a->vo + page * a->svo;
    const float *cs = a->cosr + pos * D, *sn = a->sinr + pos * D;
    for (long h = 0; h < H; h++) {
        const long *w = a->kw + h * D;
        float x[1024];
        unpack_code_row(kc + (h * S + slot) * a->Pk, a->Pk, w, D, code);
        for (long d = 0; d < D; d++) {
            const float level = a->k_grid ? (float)code[d] * (2.0f / (float)((1L << w[d]) - 1)) - 1.0f : a->k_cb[code[d]];
            x[d] = level * a->k_scale[h * D + d] + a->k_zero[h * D + d];
        }
        for (long o = 0; o < a->Ok; o++) x[a->k_oidx[h * a->Ok + o]] = half_to_float(ko[(slot * H + h) * a->Ok + o]);
        float *kr = krow + h * D;
        for (long d = 0; d < D; d++) kr[d] = x[d] * cs[d] + (d < half ? -x[d + half] : x[d - half]) * sn[d];
        unpack_code_row(vc + (h * S + slot) * a->P, a->P, vw, D, code);
        const float scale = half_to_float(vs[slot * H + h]);
        float *vr = vrow + h * D;
        for (long d = 0; d < D; d++) vr[d] = a->v_cb[code[d]] * scale + a->v_zero[h * D + d];
        for (long o = 0; o < a->Ov; o++) vr[a->v_oidx[h * a->Ov + o]] = half_to_float(vo[(slot * H + h) * a->Ov + o]);
    }
}

/* 0; -1 when the scratch could not be allocated; -3 when D > 1024 (nothing written in either case). */
long moeray_quant_decode_attention(const moeray_quant_decode_args *a) {
    const long H = a->H, D = a->D, row = H * D;
    if (D > 1024) return -3;
    long tmax = 1;
    for (long b = 0; b < a->B; b++) {
        const long t = (a->sk ? a->slen[b] : 0) + a->ctx[b] + (a->tk ? a->tlen[b] : 0);
        if (t > tmax) tmax = t;
    }
    float *K = (float *)malloc((size_t)(2 * tmax * row) * sizeof(float));
    long *code = (long *)malloc((size_t)(2 * D) * sizeof(long));
    if (!K || !code) { free(K); free(code); return -1; }
    float *V = K + tmax * row;
    long *vw = code + D;
    for (long d = 0; d < D; d++) vw[d] = a->vbits;
    long rc = 0;
    for (long b = 0; b < a->B && rc == 0; b++) {
        long t = 0;
        const long n_sink = a->sk ? a->slen[b] : 0;
        if (n_sink) {
            memcpy(K, a->sk + b * a->ns * row, (size_t)(n_sink * row) * sizeof(float));
            memcpy(V, a->sv + b * a->ns * row, (size_t)(n_sink * row) * sizeof(float));
            t = n_sink;
        }
        for (long i = 0; i < a->ctx[b]; i++, t++)
            dequant_token(a, a->bt[b * a->mb + i / a->S], i % a->S, n_sink + i, K + t * row, V + t * row, code, vw);
        const long n_tail = a->tk ? a->tlen[b] : 0;
        if (n_tail) {
            memcpy(K + t * row, a->tk + b * a->nt * row, (size_t)(n_tail * row) * sizeof(float));
            memcpy(V + t * row, a->tv + b * a->nt * row, (size_t)(n_tail * row) * sizeof(float));
            t += n_tail;
        }
        float *o = a->out + b * a->Hq * D;
        if (t == 0) memset(o, 0, (size_t)(a->Hq * D) * sizeof(float));
        else rc = attend_rows(a->q + b * a->Hq * D, K, V, t, a->Hq, H, D, a->scale, o);
    }
    free(K); free(code);
    return rc;
}
