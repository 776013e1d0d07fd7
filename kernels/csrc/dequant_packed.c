/* Packed sub-4-bit weights (kernels/packed_format.py layout) to fp32, bit-identical to the PyTorch reference. */
#include "common.h"

/* One row of a packed matrix (kernels/packed_format.py layout: a little-endian bitstream of b-bit codes in
   uint32 words) to fp32: o[k] = (level[q_k] - z[g]) * s[g], g = k / gs, level = lv (the matrix's codebook, as
   floats) when lv, else q; s, z fp16.  The PyTorch reference's fp32 operations: bit-identical. */
static void deq_row(const uint32_t *wr, const uint16_t *sr, const uint16_t *zr, long G, long gs, const float *lv,
                    long K, long bits, float *o) {
    const uint32_t mask = (1u << bits) - 1u;
    for (long g = 0; g < G; g++) {
        const float zg = half_to_float(zr[g]), sg = half_to_float(sr[g]);
        const long k1 = (g + 1) * gs < K ? (g + 1) * gs : K;
        long k = g * gs;
        if (bits == 2 || bits == 4) {  /* 8 codes at a time: codes never straddle words at 2 and 4 bits */
            const long lg = bits == 4 ? 3 : 4, cpw_mask = (1L << lg) - 1;  /* codes per word: 8 or 16 */
            const __m256i step = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                                    _mm256_set1_epi32((int)bits));
            const __m256i mv = _mm256_set1_epi32((int)mask);
            const __m256 zv = _mm256_set1_ps(zg), sv = _mm256_set1_ps(sg);
            for (; k + 8 <= k1; k += 8) {  /* k % 8 == 0: group sizes are multiples of 8 */
                const __m256i sh = _mm256_add_epi32(step, _mm256_set1_epi32((int)((k & cpw_mask) * bits)));
                const __m256i q = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)wr[k >> lg]), sh), mv);
                const __m256 l = lv ? _mm256_i32gather_ps(lv, q, 4) : _mm256_cvtepi32_ps(q);
                _mm256_storeu_ps(o + k, _mm256_mul_ps(_mm256_sub_ps(l, zv), sv));
            }
        }
        for (; k < k1; k++) {
            const long p = k * bits, lo = p >> 5, off = p & 31;
            uint32_t v = wr[lo] >> off;
            if (off + bits > 32) v |= wr[lo + 1] << (32 - off);
            const uint32_t q = v & mask;
            o[k] = ((lv ? lv[q] : (float)q) - zg) * sg;
        }
    }
}

/* Rows r < R of a packed stack to fp32 out [R, K]; cb: L fp16 levels per matrix of rows_per_matrix rows (or 0). */
static void dequant_packed(const uint32_t *codes, long W, const uint16_t *s, const uint16_t *z, long G, long gs,
                           const uint16_t *cb, long L, long rows_per_matrix, long R, long K, long bits, float *out) {
    float lv[16];
    long cur = -1;
    for (long r = 0; r < R; r++) {
        const long m = r / rows_per_matrix;
        if (cb && m != cur) { load_levels(cb + m * L, bits, lv); cur = m; }
        deq_row(codes + r * W, s + r * G, z + r * G, G, gs, cb ? lv : 0, K, bits, out + r * K);
    }
}

/* Entry point: dequant_packed's arguments as one struct (kernels/cpu/_abi.py: DequantPackedArgs). */
typedef struct {
    const uint32_t *codes; long W; const uint16_t *s, *z; long G, gs; const uint16_t *cb; long L;
    long rows_per_matrix, R, K, bits; float *out;
} moeray_dequant_packed_args;

void moeray_dequant_packed(const moeray_dequant_packed_args *a) {
    dequant_packed(a->codes, a->W, a->s, a->z, a->G, a->gs, a->cb, a->L, a->rows_per_matrix, a->R, a->K, a->bits,
                   a->out);
}
