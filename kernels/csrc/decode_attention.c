/* Paged decode attention over full-precision fp32 K/V: one pass of online softmax per (sequence, head). */
#include "common.h"

/* For each sequence b: query row tok[b] of q [T, H, Dh] attends over its first ctx[b] cached tokens, whose
   slot t lives in block bt[b, t / S] at offset t % S of k/v [NB, S, Hkv, Dh] (post-RoPE keys); one pass of
   online softmax; query head h reads KV head h / (H / Hkv).  out row tok[b] [H, Dh].  Needs Dh <= 1024. */
static void decode_attention(const float *q, const float *kc, const float *vc, const long *bt, long mb,
                             const long *ctx, const long *tok, float *out, long B, long H, long Hkv, long Dh,
                             long S, float scale) {
    const long rep = H / Hkv, Dh8 = Dh & ~7L;
    float acc[1024];
    for (long b = 0; b < B; b++) {
        const long n = ctx[b];
        const long *tb = bt + b * mb;
        for (long h = 0; h < H; h++) {
            const float *qh = q + (tok[b] * H + h) * Dh;
            const long g = h / rep;
            float mx = -INFINITY, l = 0.0f;
            for (long i = 0; i < Dh; i++) acc[i] = 0.0f;
            for (long t = 0; t < n; t++) {
                const long slot = (tb[t / S] * S + t % S) * Hkv + g;
                const float *kt = kc + slot * Dh, *vt = vc + slot * Dh;
                const float sc = dotf(qh, kt, Dh) * scale;
                float p;
                if (sc > mx) {
                    const float c = expf(mx - sc);  /* rescale what was accumulated so far */
                    l *= c;
                    const __m256 cv = _mm256_set1_ps(c);
                    long i = 0;
                    for (; i < Dh8; i += 8) _mm256_storeu_ps(acc + i, _mm256_mul_ps(_mm256_loadu_ps(acc + i), cv));
                    for (; i < Dh; i++) acc[i] *= c;
                    mx = sc;
                    p = 1.0f;
                } else {
                    p = expf(sc - mx);
                }
                l += p;
                const __m256 pv = _mm256_set1_ps(p);
                long i = 0;
                for (; i < Dh8; i += 8) _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(pv, _mm256_loadu_ps(vt + i), _mm256_loadu_ps(acc + i)));
                for (; i < Dh; i++) acc[i] += p * vt[i];
            }
            float *oh = out + (tok[b] * H + h) * Dh;
            const float inv = l > 0.0f ? 1.0f / l : 0.0f;
            for (long i = 0; i < Dh; i++) oh[i] = acc[i] * inv;
        }
    }
}

/* Entry point: decode_attention's arguments as one struct (kernels/cpu/_abi.py: DecodeAttentionArgs). */
typedef struct {
    const float *q, *kc, *vc; const long *bt; long mb; const long *ctx, *tok; float *out;
    long B, H, Hkv, Dh, S; float scale;
} moeray_decode_attention_args;

void moeray_decode_attention(const moeray_decode_attention_args *a) {
    decode_attention(a->q, a->kc, a->vc, a->bt, a->mb, a->ctx, a->tok, a->out, a->B, a->H, a->Hkv, a->Dh, a->S,
                     a->scale);
}
