/* Entry points that another kernel calls as well as Python (attention_block.c composes them): their argument
   structs are defined here once, mirrored by kernels/cpu/_abi.py. */
#ifndef MOERAY_ENTRY_POINTS_H
#define MOERAY_ENTRY_POINTS_H

/* rms_norm.c: if delta, h_out = h + delta and that is normed, else h; y = w * (v / rms(v)) (RmsNormArgs). */
typedef struct {
    const float *h; long sh; const float *delta; long sd; float *h_out; long so;
    const float *w; float *y; long sy; long M, D; float eps;
} moeray_rms_norm_args;
void moeray_rms_norm(const moeray_rms_norm_args *a);

/* decode_attention.c: paged decode attention over fp32 K / V (DecodeAttentionArgs). */
typedef struct {
    const float *q, *kc, *vc; const long *bt; long mb; const long *ctx, *tok; float *out;
    long B, H, Hkv, Dh, S; float scale;
} moeray_decode_attention_args;
long moeray_decode_attention(const moeray_decode_attention_args *a);

/* rope.c: rotate-half RoPE of fp32 rows, tables indexed at each token's position. */
long moeray_rope(const float *x, long st, long sh, const float *cos, const float *sin_signed, const long *pos,
                 long P, float *out, long T, long H, long Dh);

#endif
