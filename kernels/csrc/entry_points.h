/* Entry points that another kernel calls as well as Python (attention_block.c and ep_exchange.c compose them):
   their argument structs are defined here once, mirrored by kernels/cpu/_abi.py. */
#ifndef MOERAY_ENTRY_POINTS_H
#define MOERAY_ENTRY_POINTS_H
#include <stdint.h>

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

/* expert_ffn.c: SwiGLU experts with bf16 stacks on fp32 rows, grouped by expert (ExpertFFNArgs); rows with id -1
   give zero rows.  Returns 0, -2 for an id >= E, -1 without scratch. */
typedef struct {
    const float *x; long sx; const uint16_t *gu, *dn; const uint32_t *gup, *dnp; const long *ids; const float *wts;
    long R, K, E, D, I; float *y; long sy;
} moeray_expert_ffn_bf16w_args;
long moeray_expert_ffn_bf16w(const moeray_expert_ffn_bf16w_args *a);

#endif
