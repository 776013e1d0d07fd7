/* Decode attention over the quantized paged KV cache (kernels/paged_attention.py: the contract and its PyTorch
   reference, which this equals up to fp32 rounding; kernels/cpu/quant_attention.py calls it).

   Per sequence: its sink (full precision, post-RoPE), its sealed quantized tokens and its unsealed tail (full
   precision, post-RoPE) are laid out as contiguous fp32 K / V rows [T, H, D] in a scratch, the quantized ones
   dequantized on the way: keys unpacked from their per-channel-width bitstream (or fixed-width codes) to levels
   (the per-channel uniform grid, or the key codebook), times k_scale plus k_zero, the outlier channels restored
   from fp16, then rotated by RoPE at their position (keys are stored before RoPE); values: v_codebook[code] times
   the token's scale (fp16, or with vs_lut an 8-bit log2 code looked up in vs_lut[256]) plus v_zero, outliers
   restored.  Then attend_rows (decode_attention.c) attends the query
   over the rows.  The scratch (2 T H D floats) is kept per thread, across calls. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "gemm.h"

long attend_rows(const float *q, const float *k, const float *v, long n, long H, long Hkv, long Dh, float scale,
                 float *out);  /* decode_attention.c */

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
    const float *vs_lut;  /* NULL: v_scale is fp16; else v_scale is uint8 codes and vs_lut[256] their scales */
} moeray_quant_decode_args;

/* Where channel d's code of a packed row sits: byte `at`, bit `sh` (LSB first), `w` bits (< 2 bytes, since w <= 8). */
struct code_at { int32_t at, sh, w; };

static inline long code_of(const uint8_t *row, struct code_at c) {
    unsigned v = row[c.at];
    if (c.sh + c.w > 8) v |= (unsigned)row[c.at + 1] << 8;  /* the code's bits end inside the row: in bounds */
    return (long)((v >> c.sh) & ((1u << c.w) - 1));
}

/* kfac[h * D + d]: the grid step 2 / (2^w - 1) of each key channel (the reference's fp32 division, done once);
   kat / vat: each key / value channel's place in its row. */
static void dequant_token(const moeray_quant_decode_args *a, const float *kfac, const struct code_at *kat,
                          const struct code_at *vat, long page, long slot, long pos, float *krow, float *vrow,
                          long *code) {
    const long H = a->H, D = a->D, S = a->S, half = D / 2;
    const uint8_t *kc = a->kc + page * a->skc, *vc = a->vc + page * a->svc;
    const uint16_t *vs = a->vs + page * a->svs, *ko = a->ko + page * a->sko, *vo = a->vo + page * a->svo;
    const float *cs = a->cosr + pos * D, *sn = a->sinr + pos * D;
    for (long h = 0; h < H; h++) {
        const float *ks = a->k_scale + h * D, *kz = a->k_zero + h * D, *kf = kfac + h * D, *vz = a->v_zero + h * D;
        float x[1024];
        const uint8_t *krw = kc + (h * S + slot) * a->Pk, *vrw = vc + (h * S + slot) * a->P;
        for (long d = 0; d < D; d++) code[d] = code_of(krw, kat[h * D + d]);
        if (a->k_grid)
            for (long d = 0; d < D; d++) x[d] = ((float)code[d] * kf[d] - 1.0f) * ks[d] + kz[d];
        else
            for (long d = 0; d < D; d++) x[d] = a->k_cb[code[d]] * ks[d] + kz[d];
        for (long o = 0; o < a->Ok; o++) x[a->k_oidx[h * a->Ok + o]] = half_to_float(ko[(slot * H + h) * a->Ok + o]);
        float *kr = krow + h * D;  /* rotate-half RoPE: two loops, no branch per element */
        for (long d = 0; d < half; d++) kr[d] = x[d] * cs[d] - x[d + half] * sn[d];
        for (long d = half; d < D; d++) kr[d] = x[d] * cs[d] + x[d - half] * sn[d];
        for (long d = 0; d < D; d++) code[d] = code_of(vrw, vat[d]);
        const float scale = a->vs_lut ? a->vs_lut[((const uint8_t *)a->vs + page * a->svs)[slot * H + h]]
                                      : half_to_float(vs[slot * H + h]);
        float *vr = vrow + h * D;
        for (long d = 0; d < D; d++) vr[d] = a->v_cb[code[d]] * scale + vz[d];
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
    /* the rows' scratch is kept per thread and only grows: a fresh 1 MB block per call (context 1,000) cost its
       page faults on every layer of every step */
    static __thread float *scratch = NULL;
    static __thread size_t cap = 0;
    const size_t need = (size_t)(2 * tmax * row + row);
    if (need > cap) {
        free(scratch);
        scratch = (float *)malloc(need * sizeof(float));
        cap = scratch ? need : 0;
    }
    float *K = scratch;
    long *code = (long *)malloc((size_t)D * sizeof(long));
    struct code_at *kat = (struct code_at *)malloc((size_t)(row + D) * sizeof(struct code_at));
    if (!K || !code || !kat) { free(code); free(kat); return -1; }
    float *V = K + tmax * row, *kfac = V + tmax * row;
    struct code_at *vat = kat + row;
    for (long h = 0; h < H; h++)
        for (long d = 0, off = 0; d < D; off += a->kw[h * D + d], d++) {
            kat[h * D + d] = (struct code_at){(int32_t)(off / 8), (int32_t)(off % 8), (int32_t)a->kw[h * D + d]};
            kfac[h * D + d] = 2.0f / (float)((1L << a->kw[h * D + d]) - 1);
        }
    for (long d = 0; d < D; d++)
        vat[d] = (struct code_at){(int32_t)(d * a->vbits / 8), (int32_t)(d * a->vbits % 8), (int32_t)a->vbits};
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
            dequant_token(a, kfac, kat, vat, a->bt[b * a->mb + i / a->S], i % a->S, n_sink + i, K + t * row, V + t * row,
                          code);
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
    free(code); free(kat);
    return rc;
}
