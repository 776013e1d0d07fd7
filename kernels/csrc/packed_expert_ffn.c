/* SwiGLU experts straight from packed sub-4-bit codes: fused dequant-GEMV, no weight materialised. */
#include "common.h"

/* Levels of the 8 codes k..k+7 of a row at 2 or 4 bits (k % 8 == 0), as floats: the code itself, or the
   matrix's codebook (<= 16 levels held in two registers, looked up with in-register permutes, not gathers). */
static inline __m256 levels8(const uint32_t *wr, long k, long bits, long lg, __m256i step, __m256i mv,
                             int has_cb, __m256 lv_lo, __m256 lv_hi) {
    const __m256i sh = _mm256_add_epi32(step, _mm256_set1_epi32((int)((k & ((1L << lg) - 1)) * bits)));
    const __m256i q = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)wr[k >> lg]), sh), mv);
    if (!has_cb) return _mm256_cvtepi32_ps(q);
    const __m256 lo = _mm256_permutevar8x32_ps(lv_lo, q);
    if (bits == 2) return lo;
    return _mm256_blendv_ps(lo, _mm256_permutevar8x32_ps(lv_hi, q), _mm256_castsi256_ps(_mm256_slli_epi32(q, 28)));
}

/* One packed [N, K] matrix (a stack member: pointers already at it) times R fp32 rows, without materialising it:
       y[r*sy + n] = sum_g s[n,g] * (sum_{k in g} level[q_nk] x_rk  -  z[n,g] * sum_{k in g} x_rk)
   (the dequantization formula with the scale and zero taken out of each group's sum).  xs: R * G floats for
   the per-group sums of each row; tmp: K floats (3-bit codes, which straddle words, are unpacked there first).
   Rows of x are taken 4 at a time so each unpacked code is used up to 4 times from registers. */
static inline __attribute__((always_inline)) void packed_rows_impl(
        const float *x, long sx, long R, const uint32_t *c, long W, const uint16_t *s, const uint16_t *z, long G,
        long gs, const uint16_t *cb, const long bits, long N, long K, float *y, long sy, float *xs, float *tmp) {
    float lv[16] = {0};
    if (cb) load_levels(cb, bits, lv);
    const __m256 lv_lo = _mm256_loadu_ps(lv), lv_hi = _mm256_loadu_ps(lv + 8);
    const uint32_t mask = (1u << bits) - 1u;
    const int vec = bits == 2 || bits == 4, has_cb = cb != 0;
    const long lg = bits == 4 ? 3 : 4, K8 = K & ~7L;
    const __m256i step = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32((int)bits));
    const __m256i mv = _mm256_set1_epi32((int)mask);
    for (long r = 0; r < R; r++)
        for (long g = 0; g < G; g++) {
            const long k0 = g * gs, k1 = k0 + gs < K ? k0 + gs : K;
            float a = 0.0f;
            for (long k = k0; k < k1; k++) a += x[r * sx + k];
            xs[r * G + g] = a;
        }
    for (long n = 0; n < N; n++) {
        const uint32_t *wr = c + n * W;
        const uint16_t *sn = s + n * G, *zn = z + n * G;
        if (!vec || K8 < K)  /* levels the vector loop cannot unpack in registers: 3-bit codes, a K % 8 tail */
            for (long k = vec ? K8 : 0; k < K; k++) {
                const long p = k * bits, lo = p >> 5, off = p & 31;
                uint32_t v = wr[lo] >> off;
                if (off + bits > 32) v |= wr[lo + 1] << (32 - off);
                tmp[k] = has_cb ? lv[v & mask] : (float)(v & mask);
            }
        for (long r0 = 0; r0 < R; r0 += 4) {
            const long nr = R - r0 < 4 ? R - r0 : 4;
            const float *x0 = x + r0 * sx;
            const float *x1 = nr > 1 ? x0 + sx : x0, *x2 = nr > 2 ? x0 + 2 * sx : x0, *x3 = nr > 3 ? x0 + 3 * sx : x0;
            __m256 o0 = _mm256_setzero_ps(), o1 = o0, o2 = o0, o3 = o0;  /* sum_g s_g * (group's level . x) */
            float zt[4] = {0.0f, 0.0f, 0.0f, 0.0f}, tl[4] = {0.0f, 0.0f, 0.0f, 0.0f};  /* zero terms, K tail */
            for (long g = 0; g < G; g++) {
                const long k0 = g * gs, k1 = k0 + gs < K ? k0 + gs : K, k8 = k1 < K8 ? k1 : K8;
                const float sg = half_to_float(sn[g]), zg = half_to_float(zn[g]);
                const __m256 sv = _mm256_set1_ps(sg);
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                long k = k0;
                if (nr == 1 && vec) {  /* decode: two chains, so the FMA latency does not bound the loop */
                    __m256 b0 = a0;
                    for (; k + 16 <= k8; k += 16) {
                        a0 = _mm256_fmadd_ps(levels8(wr, k, bits, lg, step, mv, has_cb, lv_lo, lv_hi),
                                             _mm256_loadu_ps(x0 + k), a0);
                        b0 = _mm256_fmadd_ps(levels8(wr, k + 8, bits, lg, step, mv, has_cb, lv_lo, lv_hi),
                                             _mm256_loadu_ps(x0 + k + 8), b0);
                    }
                    a0 = _mm256_add_ps(a0, b0);
                }
                for (; k < k8; k += 8) {
                    const __m256 l = vec ? levels8(wr, k, bits, lg, step, mv, has_cb, lv_lo, lv_hi)
                                         : _mm256_loadu_ps(tmp + k);
                    a0 = _mm256_fmadd_ps(l, _mm256_loadu_ps(x0 + k), a0);
                    if (nr > 1) a1 = _mm256_fmadd_ps(l, _mm256_loadu_ps(x1 + k), a1);
                    if (nr > 2) a2 = _mm256_fmadd_ps(l, _mm256_loadu_ps(x2 + k), a2);
                    if (nr > 3) a3 = _mm256_fmadd_ps(l, _mm256_loadu_ps(x3 + k), a3);
                }
                o0 = _mm256_fmadd_ps(sv, a0, o0);
                if (nr > 1) o1 = _mm256_fmadd_ps(sv, a1, o1);
                if (nr > 2) o2 = _mm256_fmadd_ps(sv, a2, o2);
                if (nr > 3) o3 = _mm256_fmadd_ps(sv, a3, o3);
                for (; k < k1; k++) {
                    tl[0] += sg * tmp[k] * x0[k]; tl[1] += sg * tmp[k] * x1[k];
                    tl[2] += sg * tmp[k] * x2[k]; tl[3] += sg * tmp[k] * x3[k];
                }
                const float szg = sg * zg;
                for (long i = 0; i < nr; i++) zt[i] += szg * xs[(r0 + i) * G + g];
            }
            y[r0 * sy + n] = hsum(o0) + tl[0] - zt[0];
            if (nr > 1) y[(r0 + 1) * sy + n] = hsum(o1) + tl[1] - zt[1];
            if (nr > 2) y[(r0 + 2) * sy + n] = hsum(o2) + tl[2] - zt[2];
            if (nr > 3) y[(r0 + 3) * sy + n] = hsum(o3) + tl[3] - zt[3];
        }
    }
}

/* packed_rows_impl compiled once per (bits, codebook or not) of the decode path: with both known the inner loop
   is ~2x faster than one generic body (measured on the 2-core EPYC test machine). */
static void packed_rows(const float *x, long sx, long R, const uint32_t *c, long W, const uint16_t *s,
                        const uint16_t *z, long G, long gs, const uint16_t *cb, long bits, long N, long K,
                        float *y, long sy, float *xs, float *tmp) {
    if (bits == 4 && !cb && R == 1 && gs == 64)
        packed_rows_impl(x, sx, 1, c, W, s, z, G, 64, 0, 4, N, K, y, sy, xs, tmp);
    else if (bits == 4 && !cb && R == 1) packed_rows_impl(x, sx, 1, c, W, s, z, G, gs, 0, 4, N, K, y, sy, xs, tmp);
    else if (bits == 4 && !cb) packed_rows_impl(x, sx, R, c, W, s, z, G, gs, 0, 4, N, K, y, sy, xs, tmp);
    else if (bits == 4) packed_rows_impl(x, sx, R, c, W, s, z, G, gs, cb, 4, N, K, y, sy, xs, tmp);
    else if (bits == 2 && !cb) packed_rows_impl(x, sx, R, c, W, s, z, G, gs, 0, 2, N, K, y, sy, xs, tmp);
    else if (bits == 2) packed_rows_impl(x, sx, R, c, W, s, z, G, gs, cb, 2, N, K, y, sy, xs, tmp);
    else packed_rows_impl(x, sx, R, c, W, s, z, G, gs, cb, bits, N, K, y, sy, xs, tmp);
}

/* Rows r < R through packed SwiGLU experts: y[r] = down_e(silu(gate_e x_r) * up_e x_r), e = ids[r] (< 0: a zero
   row).  gu: the fused gate_up stack [E, 2I, D] (gate rows then up rows), dn: [E, D, I]; a stack is codes
   [E, N, W] int32, scales / zeros [E, N, G] fp16 and a codebook [E, 2**bits] fp16 or 0.  A run of rows with the
   same id shares each weight row's unpacking.  x's row stride may be 0 (one token, several experts).
   scratch: max(D, I) + R * (max(G_gu, G_dn) + 2I) floats. */
static void packed_expert_ffn(const float *x, long sx, const long *ids, long R,
                              const uint32_t *guc, const uint16_t *gus, const uint16_t *guz, const uint16_t *gucb,
                              long guW, long guG, long gugs, long gubits,
                              const uint32_t *dnc, const uint16_t *dns, const uint16_t *dnz, const uint16_t *dncb,
                              long dnW, long dnG, long dngs, long dnbits,
                              long D, long I, float *y, long sy, float *scratch) {
    const long Kmax = D > I ? D : I, Gmax = guG > dnG ? guG : dnG;
    float *tmp = scratch, *xs = scratch + Kmax, *t = xs + R * Gmax;
    long r0 = 0;
    while (r0 < R) {
        const long e = ids[r0];
        long r1 = r0 + 1;
        while (r1 < R && ids[r1] == e) r1++;
        const long n = r1 - r0;
        if (e < 0) {
            for (long r = r0; r < r1; r++) for (long d = 0; d < D; d++) y[r * sy + d] = 0.0f;
        } else {
            const long gn = 2 * I;
            packed_rows(x + r0 * sx, sx, n, guc + e * gn * guW, guW, gus + e * gn * guG, guz + e * gn * guG, guG,
                        gugs, gucb ? gucb + (e << gubits) : 0, gubits, gn, D, t, gn, xs, tmp);
            swiglu_rows(t, n, I);
            packed_rows(t, gn, n, dnc + e * D * dnW, dnW, dns + e * D * dnG, dnz + e * D * dnG, dnG,
                        dngs, dncb ? dncb + (e << dnbits) : 0, dnbits, D, I, y + r0 * sy, sy, xs, tmp);
        }
        r0 = r1;
    }
}

/* One packed stack as the entry point takes it (kernels/cpu/_abi.py: PackedStack): codes [E, N, W] int32,
   scales / zeros [E, N, G] fp16, codebook [E, 2**bits] fp16 or 0, group size gs. */
typedef struct {
    const uint32_t *codes; const uint16_t *scales, *zeros, *codebook; long W, G, gs, bits;
} moeray_packed_stack;

/* Entry point: packed_expert_ffn's arguments as one struct (kernels/cpu/_abi.py: PackedExpertFFNArgs), each
   stack's eight as a moeray_packed_stack. */
typedef struct {
    const float *x; long sx; const long *ids; long R; const moeray_packed_stack *gu, *dn;
    long D, I; float *y; long sy; float *scratch;
} moeray_packed_expert_ffn_args;

void moeray_packed_expert_ffn(const moeray_packed_expert_ffn_args *a) {
    const moeray_packed_stack *gu = a->gu, *dn = a->dn;
    packed_expert_ffn(a->x, a->sx, a->ids, a->R,
                      gu->codes, gu->scales, gu->zeros, gu->codebook, gu->W, gu->G, gu->gs, gu->bits,
                      dn->codes, dn->scales, dn->zeros, dn->codebook, dn->W, dn->G, dn->gs, dn->bits,
                      a->D, a->I, a->y, a->sy, a->scratch);
}
