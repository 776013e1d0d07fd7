/* Decode attention over the quantized paged KV cache (kernels/paged_attention.py: the contract and its PyTorch
   reference, which this equals up to fp32 rounding; kernels/cpu/quant_attention.py calls it).

   Per sequence: its sink (full precision, post-RoPE), its sealed quantized tokens and its unsealed tail (full
   precision, post-RoPE) are laid out as contiguous fp32 K / V rows [T, H, D] in a scratch, the quantized ones
   dequantized on the way: keys unpacked from their per-channel-width bitstream (or fixed-width codes) to levels
   (the per-channel uniform grid, or the key codebook), times k_scale plus k_zero, the outlier channels restored
   from fp16, then rotated by RoPE at their position (keys are stored before RoPE); values: v_codebook[code] times
   the token's scale (fp16, or with vs_lut an 8-bit log2 code looked up in vs_lut[256]) plus v_zero, outliers
   restored.  Then
   attend_rows (decode_attention.c) attends the query over the rows (a long sequence: in chunks with an online
   softmax, below).

   Unpacking a token, three ways (the same arithmetic per element, so they agree up to fp32 rounding): with AVX-512
   and VBMI 16 channels a byte permute (`dequant_token16`), else with D % 16 == 0 8 channels a gather
   (`dequant_token8`), else per element (`dequant_token`).  64 sequences x ~100 tokens, 4 layers, shipped model,
   kv_bits 4: this kernel 16.3 -> 3.4 ms a decode step (per element -> 16 channels). */
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
    /* The cache's staging rows instead of sk / sv / tk / tv (NULL: absent): stk / stv [slots, srows, H, D] fp32,
       keys before RoPE; sequence b's rows are slot sslot[b]: its sink at rows 0 .. slen[b] - 1 (positions 0 ..),
       its tail of tlen[b] tokens at rows ns + ctx[b] % sbs ... (positions slen[b] + ctx[b] ..; ns: the cache's sink
       rows, sbs: its logical block size, not the page's S), rotated here. */
    const float *stk, *stv; const long *sslot; long srows, sbs;
    long maxpos;  /* rows of cosr / sinr: every rotated position must be below it */
} moeray_quant_decode_args;

/* out [H, D] = x [H, D] rotated (rotate-half RoPE) by the table rows cs / sn [D] of its position. */
static void rope_row(const float *x, const float *cs, const float *sn, long H, long D, float *out) {
    const long half = D / 2;
    for (long h = 0; h < H; h++, x += D, out += D) {
        for (long d = 0; d < half; d++) out[d] = x[d] * cs[d] - x[d + half] * sn[d];
        for (long d = half; d < D; d++) out[d] = x[d] * cs[d] + x[d - half] * sn[d];
    }
}

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

/* ------------------------------------------------------------------------------------ 8 channels at a time
   The same token, AVX2: the codes of 8 channels come out of a row with one gather (each lane reads the 32-bit
   word at its code's byte, shifts its code down and masks it), then levels, scale and zero in FMAs, RoPE on whole
   vectors, value levels from the codebook by permutes (up to 16 levels) or a gather.  The rows are first copied
   into buffers with 4 readable zero bytes past their end, so no lane reads past a page.  Same arithmetic per
   element as `dequant_token` (the FMAs contract the same products), so the two agree up to fp32 rounding.
   Needs D % 16 == 0 (RoPE's halves in whole vectors). */
struct code_lanes {
    const int32_t *kat, *ksh, *kmask;  /* [H * D]: each key channel's byte, bit and mask in its row */
    const int32_t *vat, *vsh;          /* [D]: each value channel's byte and bit; vmask the codes' mask */
    int32_t vmask;
};

static inline __m256i codes8(const uint8_t *buf, __m256i at, __m256i sh, __m256i mask) {
    return _mm256_and_si256(_mm256_srlv_epi32(_mm256_i32gather_epi32((const int *)buf, at, 1), sh), mask);
}

/* levels[c] for 8 codes: two permutes and a blend when the codebook has <= 16 levels, else a gather. */
static inline __m256 levels8(const float *cb, long ncb, __m256 lo, __m256 hi, __m256i c) {
    if (ncb > 16) return _mm256_i32gather_ps(cb, c, 4);
    const __m256 a = _mm256_permutevar8x32_ps(lo, c);
    if (ncb <= 8) return a;
    const __m256 b = _mm256_permutevar8x32_ps(hi, c);
    return _mm256_blendv_ps(a, b, _mm256_castsi256_ps(_mm256_cmpgt_epi32(c, _mm256_set1_epi32(7))));
}

static void dequant_token8(const moeray_quant_decode_args *a, const float *kfac, const struct code_lanes *cl, long nkcb,
                           const float *cb16, long page, long slot, long pos, float *krow, float *vrow, uint8_t *buf) {
    const long H = a->H, D = a->D, S = a->S, half = D / 2;
    const long nvcb = 1L << a->vbits;
    const uint8_t *kc = a->kc + page * a->skc, *vc = a->vc + page * a->svc;
    const uint16_t *vs = a->vs + page * a->svs, *ko = a->ko + page * a->sko, *vo = a->vo + page * a->svo;
    const float *cs = a->cosr + pos * D, *sn = a->sinr + pos * D;
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 klo = _mm256_loadu_ps(cb16), khi = _mm256_loadu_ps(cb16 + 8);  /* zero-padded codebooks */
    const __m256 vlo = _mm256_loadu_ps(cb16 + 16), vhi = _mm256_loadu_ps(cb16 + 24);
    const __m256i vmask = _mm256_set1_epi32(cl->vmask);
    float x[1024];
    for (long h = 0; h < H; h++) {
        const float *ks = a->k_scale + h * D, *kz = a->k_zero + h * D, *kf = kfac + h * D, *vz = a->v_zero + h * D;
        const int32_t *at = cl->kat + h * D, *sh = cl->ksh + h * D, *mk = cl->kmask + h * D;
        memcpy(buf, kc + (h * S + slot) * a->Pk, (size_t)a->Pk);
        for (long d = 0; d < D; d += 8) {
            const __m256i c = codes8(buf, _mm256_loadu_si256((const __m256i *)(at + d)),
                                     _mm256_loadu_si256((const __m256i *)(sh + d)),
                                     _mm256_loadu_si256((const __m256i *)(mk + d)));
            __m256 lv;
            if (a->k_grid)
                lv = _mm256_fmsub_ps(_mm256_cvtepi32_ps(c), _mm256_loadu_ps(kf + d), one);
            else
                lv = levels8(a->k_cb, nkcb, klo, khi, c);
            _mm256_storeu_ps(x + d, _mm256_fmadd_ps(lv, _mm256_loadu_ps(ks + d), _mm256_loadu_ps(kz + d)));
        }
        for (long o = 0; o < a->Ok; o++) x[a->k_oidx[h * a->Ok + o]] = half_to_float(ko[(slot * H + h) * a->Ok + o]);
        float *kr = krow + h * D;  /* rotate-half RoPE */
        for (long d = 0; d < half; d += 8) {
            const __m256 lo = _mm256_loadu_ps(x + d), hi = _mm256_loadu_ps(x + d + half);
            _mm256_storeu_ps(kr + d, _mm256_fmsub_ps(lo, _mm256_loadu_ps(cs + d),
                                                     _mm256_mul_ps(hi, _mm256_loadu_ps(sn + d))));
            _mm256_storeu_ps(kr + d + half, _mm256_fmadd_ps(hi, _mm256_loadu_ps(cs + d + half),
                                                            _mm256_mul_ps(lo, _mm256_loadu_ps(sn + d + half))));
        }
        memcpy(buf, vc + (h * S + slot) * a->P, (size_t)a->P);
        const float scale = a->vs_lut ? a->vs_lut[((const uint8_t *)a->vs + page * a->svs)[slot * H + h]]
                                      : half_to_float(vs[slot * H + h]);
        const __m256 sv = _mm256_set1_ps(scale);
        float *vr = vrow + h * D;
        for (long d = 0; d < D; d += 8) {
            const __m256i c = codes8(buf, _mm256_loadu_si256((const __m256i *)(cl->vat + d)),
                                     _mm256_loadu_si256((const __m256i *)(cl->vsh + d)), vmask);
            _mm256_storeu_ps(vr + d, _mm256_fmadd_ps(levels8(a->v_cb, nvcb, vlo, vhi, c), sv, _mm256_loadu_ps(vz + d)));
        }
        for (long o = 0; o < a->Ov; o++) vr[a->v_oidx[h * a->Ov + o]] = half_to_float(vo[(slot * H + h) * a->Ov + o]);
    }
}

/* --------------------------------------------------------------------------- 16 channels at a time, AVX-512
   With AVX512-VBMI a packed row (at most 128 bytes) sits in one or two registers and one byte permute moves every
   code's two bytes into its 32-bit lane (`vpermb` / `vpermt2b`: no memory gather), then shift, mask, levels and
   RoPE as in `dequant_token8`, 16 lanes wide.  Needs D % 32 == 0 and rows of at most 128 bytes. */
#define TVBMI __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vbmi,avx2,fma")))

/* byte index of lane j's 4 bytes in a permute: at, at + 1, at + 1, at + 1 (a code spans at most 2 bytes). */
static void permute_index(const int32_t *at, long n, uint8_t *idx) {
    for (long d = 0; d < n; d++) {
        idx[4 * d] = (uint8_t)(at[d] & 127);
        idx[4 * d + 1] = idx[4 * d + 2] = idx[4 * d + 3] = (uint8_t)((at[d] + 1) & 127);
    }
}

TVBMI static inline __m512i codes16(__m512i lo, __m512i hi, int two, __m512i idx, __m512i sh, __m512i mask) {
    const __m512i w = two ? _mm512_permutex2var_epi8(lo, idx, hi) : _mm512_permutexvar_epi8(idx, lo);
    return _mm512_and_si512(_mm512_srlv_epi32(w, sh), mask);
}

TVBMI static inline __m512 levels16(const float *cb, long ncb, __m512 tab, __m512i c) {
    return ncb <= 16 ? _mm512_permutexvar_ps(c, tab) : _mm512_i32gather_ps(c, cb, 4);
}

TVBMI static inline void load_row(const uint8_t *row, long n, __m512i *lo, __m512i *hi) {
    *lo = _mm512_maskz_loadu_epi8(n >= 64 ? ~0ULL : (1ULL << n) - 1, row);
    *hi = n > 64 ? _mm512_maskz_loadu_epi8(n >= 128 ? ~0ULL : (1ULL << (n - 64)) - 1, row + 64) : _mm512_setzero_si512();
}

TVBMI static void dequant_token16(const moeray_quant_decode_args *a, const float *kfac, const struct code_lanes *cl,
                                  const uint8_t *kidx, const uint8_t *vidx, long nkcb, const float *cb16, long page,
                                  long slot, long pos, float *krow, float *vrow) {
    const long H = a->H, D = a->D, S = a->S, half = D / 2, nvcb = 1L << a->vbits;
    const uint8_t *kc = a->kc + page * a->skc, *vc = a->vc + page * a->svc;
    const uint16_t *vs = a->vs + page * a->svs, *ko = a->ko + page * a->sko, *vo = a->vo + page * a->svo;
    const float *cs = a->cosr + pos * D, *sn = a->sinr + pos * D;
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512 ktab = _mm512_loadu_ps(cb16), vtab = _mm512_loadu_ps(cb16 + 16);  /* zero-padded codebooks */
    const __m512i vmask = _mm512_set1_epi32(cl->vmask);
    const int ktwo = a->Pk > 64, vtwo = a->P > 64;
    float x[1024];
    for (long h = 0; h < H; h++) {
        const float *ks = a->k_scale + h * D, *kz = a->k_zero + h * D, *kf = kfac + h * D, *vz = a->v_zero + h * D;
        const int32_t *sh = cl->ksh + h * D, *mk = cl->kmask + h * D;
        const uint8_t *ki = kidx + 4 * h * D;
        __m512i lo, hi;
        load_row(kc + (h * S + slot) * a->Pk, a->Pk, &lo, &hi);
        for (long d = 0; d < D; d += 16) {
            const __m512i c = codes16(lo, hi, ktwo, _mm512_loadu_si512(ki + 4 * d), _mm512_loadu_si512(sh + d),
                                      _mm512_loadu_si512(mk + d));
            const __m512 lv = a->k_grid ? _mm512_fmsub_ps(_mm512_cvtepi32_ps(c), _mm512_loadu_ps(kf + d), one)
                                        : levels16(a->k_cb, nkcb, ktab, c);
            _mm512_storeu_ps(x + d, _mm512_fmadd_ps(lv, _mm512_loadu_ps(ks + d), _mm512_loadu_ps(kz + d)));
        }
        for (long o = 0; o < a->Ok; o++) x[a->k_oidx[h * a->Ok + o]] = half_to_float(ko[(slot * H + h) * a->Ok + o]);
        float *kr = krow + h * D;  /* rotate-half RoPE */
        for (long d = 0; d < half; d += 16) {
            const __m512 l = _mm512_loadu_ps(x + d), u = _mm512_loadu_ps(x + d + half);
            _mm512_storeu_ps(kr + d, _mm512_fmsub_ps(l, _mm512_loadu_ps(cs + d), _mm512_mul_ps(u, _mm512_loadu_ps(sn + d))));
            _mm512_storeu_ps(kr + d + half, _mm512_fmadd_ps(u, _mm512_loadu_ps(cs + d + half),
                                                            _mm512_mul_ps(l, _mm512_loadu_ps(sn + d + half))));
        }
        load_row(vc + (h * S + slot) * a->P, a->P, &lo, &hi);
        const float scale = a->vs_lut ? a->vs_lut[((const uint8_t *)a->vs + page * a->svs)[slot * H + h]]
                                      : half_to_float(vs[slot * H + h]);
        const __m512 sv = _mm512_set1_ps(scale);
        float *vr = vrow + h * D;
        for (long d = 0; d < D; d += 16) {
            const __m512i c = codes16(lo, hi, vtwo, _mm512_loadu_si512(vidx + 4 * d), _mm512_loadu_si512(cl->vsh + d),
                                      vmask);
            _mm512_storeu_ps(vr + d, _mm512_fmadd_ps(levels16(a->v_cb, nvcb, vtab, c), sv, _mm512_loadu_ps(vz + d)));
        }
        for (long o = 0; o < a->Ov; o++) vr[a->v_oidx[h * a->Ov + o]] = half_to_float(vo[(slot * H + h) * a->Ov + o]);
    }
}

/* What unpacking a token of this layer takes, made once per call: each key / value channel's place in its row
   (per element), as int32 lanes (8 channels), as byte-permute indices (16 channels), and the key grid steps. */
struct unpacker {
    long *code; struct code_at *kat, *vat; float *kfac; int32_t *lanes; uint8_t *pidx;
    struct code_lanes cl; int simd, wide; long nkcb;
    float cb16[32];  /* the key codebook's first 16 levels, then the value codebook's, zero-padded */
};

static void unpacker_free(struct unpacker *u) { free(u->code); free(u->kat); free(u->kfac); free(u->lanes); free(u->pidx); }

/* 0, or -1 when its tables could not be allocated (nothing to free then). */
static int unpacker_init(const moeray_quant_decode_args *a, struct unpacker *u) {
    const long H = a->H, D = a->D, row = H * D;
    memset(u, 0, sizeof *u);
    u->simd = D % 16 == 0;
    /* the 16-channel path: AVX-512 in use (moeray_isa_level 2), VBMI, rows of <= 128 bytes, D % 32 == 0 */
    u->wide = u->simd && moeray_isa_level >= 2 && D % 32 == 0 && a->Pk <= 128 && a->P <= 128
              && __builtin_cpu_supports("avx512vbmi");
    u->code = (long *)malloc((size_t)D * sizeof(long));
    u->kat = (struct code_at *)malloc((size_t)(row + D) * sizeof(struct code_at));
    u->kfac = (float *)malloc((size_t)row * sizeof(float));
    u->lanes = u->simd ? (int32_t *)malloc((size_t)(3 * row + 2 * D) * sizeof(int32_t)) : NULL;
    u->pidx = u->wide ? (uint8_t *)malloc((size_t)(4 * row + 4 * D)) : NULL;
    if (!u->code || !u->kat || !u->kfac || (u->simd && !u->lanes) || (u->wide && !u->pidx)) {
        unpacker_free(u);
        return -1;
    }
    u->vat = u->kat + row;
    for (long h = 0; h < H; h++)
        for (long d = 0, off = 0; d < D; off += a->kw[h * D + d], d++) {
            u->kat[h * D + d] = (struct code_at){(int32_t)(off / 8), (int32_t)(off % 8), (int32_t)a->kw[h * D + d]};
            u->kfac[h * D + d] = 2.0f / (float)((1L << a->kw[h * D + d]) - 1);
        }
    for (long d = 0; d < D; d++)
        u->vat[d] = (struct code_at){(int32_t)(d * a->vbits / 8), (int32_t)(d * a->vbits % 8), (int32_t)a->vbits};
    if (u->simd) {  /* the same places as int32 lanes */
        int32_t *l = u->lanes;
        for (long i = 0; i < row; i++) {
            l[i] = u->kat[i].at; l[row + i] = u->kat[i].sh; l[2 * row + i] = (int32_t)((1u << u->kat[i].w) - 1);
        }
        for (long d = 0; d < D; d++) { l[3 * row + d] = u->vat[d].at; l[3 * row + D + d] = u->vat[d].sh; }
        u->cl = (struct code_lanes){l, l + row, l + 2 * row, l + 3 * row, l + 3 * row + D,
                                    (int32_t)((1u << a->vbits) - 1)};
    }
    u->nkcb = 1L << a->kw[0];  /* fixed-width keys (a codebook): every width is `bits` */
    if (!a->k_grid) memcpy(u->cb16, a->k_cb, (size_t)(u->nkcb < 16 ? u->nkcb : 16) * sizeof(float));
    const long nv = 1L << a->vbits;
    memcpy(u->cb16 + 16, a->v_cb, (size_t)(nv < 16 ? nv : 16) * sizeof(float));
    if (u->wide) { permute_index(u->cl.kat, row, u->pidx); permute_index(u->cl.vat, D, u->pidx + 4 * row); }
    return 0;
}

/* Token (page, slot) at position pos: its key rotated into krow [H, D], its value into vrow [H, D].  buf: a
   packed row and 4 readable bytes past it (1,032 bytes). */
static void unpack_token(const moeray_quant_decode_args *a, const struct unpacker *u, long page, long slot, long pos,
                         float *krow, float *vrow, uint8_t *buf) {
    const long row = a->H * a->D;
    if (u->wide)
        dequant_token16(a, u->kfac, &u->cl, u->pidx, u->pidx + 4 * row, u->nkcb, u->cb16, page, slot, pos, krow,
                        vrow);
    else if (u->simd)
        dequant_token8(a, u->kfac, &u->cl, u->nkcb, u->cb16, page, slot, pos, krow, vrow, buf);
    else
        dequant_token(a, u->kfac, u->kat, u->vat, page, slot, pos, krow, vrow, u->code);
}

/* A prefill's sealed tokens, dequantized and rotated (the quantized cache's prefill attention reads them):
   K / V [n, H, D] fp32, token i = (pages[i], slots[i]) at position pos0 + i.  Reads the profile and page fields of
   `a` only.  0; -1 without scratch; -3 when D > 1024; -4 when pos0 + n > maxpos (nothing written then). */
long moeray_quant_dequant_rows(const moeray_quant_decode_args *a, const long *pages, const long *slots, long n,
                               long pos0, float *K, float *V) {
    const long row = a->H * a->D;
    if (a->D > 1024) return -3;
    if (pos0 + n > a->maxpos) return -4;
    struct unpacker u;
    if (unpacker_init(a, &u)) return -1;
    uint8_t buf[1024 + 8];
    for (long i = 0; i < n; i++) unpack_token(a, &u, pages[i], slots[i], pos0 + i, K + i * row, V + i * row, buf);
    unpacker_free(&u);
    return 0;
}

/* ------------------------------------------------------------------------ attention in chunks of rows
   A sequence's rows (sink, dequantized tokens, tail) are made CHUNK at a time into a small scratch and attended
   with an online softmax (running max, sum and weighted V per query head, rescaled when the max grows: the
   flash-decoding recurrence), so the dequantized rows never leave the L1 / L2 cache: only the packed codes
   stream from memory, 3-5 bits per element where the full-precision cache streams 32.  A sequence of at most
   WHOLE_ROWS rows is instead made whole and attended by the full-precision kernel's loop (attend_rows: two query
   heads per KV row load, AVX-512), no slower while the rows fit the cache anyway.  Measured (shipped model, 3-bit,
   bench/kv_decode.py, ratio to the full-precision ms/token): 512 tokens, batch 1 / 8: 1.41 / 1.31 whole, 1.35 /
   1.27 in chunks; 1,024: 1.52 -> 1.41; 4,096: 1.54 -> 1.32-1.40; 64 sequences of ~100 tokens alike either way. */
#define CHUNK 32
#define WHOLE_ROWS 256

/* Query heads q [Hq, D] over n rows K / V [n, H, D] (GQA: head h reads KV head h / (Hq / H)): m, l [Hq] and acc
   [Hq, D] updated in place (m = -inf, l = 0, acc = 0 before the first chunk); sc: n floats of scratch. */
static void attend_chunk(const float *q, const float *K, const float *V, long n, long Hq, long H, long D,
                         float scale, float *m, float *l, float *acc, float *sc) {
    const long g = Hq / H, row = H * D, D8 = D & ~7L;
    for (long h = 0; h < Hq; h++) {
        const long kv = h / g;
        const float *qh = q + h * D;
        float mx = m[h];
        for (long t = 0; t < n; t++) {
            const float x = dotf(qh, K + t * row + kv * D, D) * scale;
            sc[t] = x;
            if (x > mx) mx = x;
        }
        const float corr = m[h] == -INFINITY ? 0.0f : expf(m[h] - mx);
        const __m256 mv = _mm256_set1_ps(mx);
        float sum = 0.0f;
        long t = 0;
        for (; t + 8 <= n; t += 8) {
            const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + t), mv));
            _mm256_storeu_ps(sc + t, p);
            sum += hsum(p);
        }
        for (; t < n; t++) { sc[t] = expf(sc[t] - mx); sum += sc[t]; }
        l[h] = l[h] * corr + sum;
        m[h] = mx;
        float *oh = acc + h * D;
        const __m256 cv = _mm256_set1_ps(corr);
        long d = 0;
        for (; d < D8; d += 8) _mm256_storeu_ps(oh + d, _mm256_mul_ps(_mm256_loadu_ps(oh + d), cv));
        for (; d < D; d++) oh[d] *= corr;
        for (t = 0; t < n; t++) {
            const float *vt = V + t * row + kv * D;
            const __m256 pv = _mm256_set1_ps(sc[t]);
            for (d = 0; d < D8; d += 8)
                _mm256_storeu_ps(oh + d, _mm256_fmadd_ps(pv, _mm256_loadu_ps(vt + d), _mm256_loadu_ps(oh + d)));
            for (; d < D; d++) oh[d] += sc[t] * vt[d];
        }
    }
}

/* The same for D = 64 and two query heads per KV head (the shipped model's shape), AVX-512: each K and V row is
   loaded once for both heads, the weighted V sums stay in 8 registers across the chunk. */
#define T512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")))

T512 static void attend_chunk_d64g2(const float *q, const float *K, const float *V, long n, long H, float scale,
                                    float *m, float *l, float *acc, float *sc) {
    const long row = H * 64;
    float *s0 = sc, *s1 = sc + n;
    for (long kv = 0; kv < H; kv++) {
        const float *q0 = q + 2 * kv * 64, *q1 = q0 + 64;
        const __m512 a0 = _mm512_loadu_ps(q0), a1 = _mm512_loadu_ps(q0 + 16), a2 = _mm512_loadu_ps(q0 + 32),
                     a3 = _mm512_loadu_ps(q0 + 48), b0 = _mm512_loadu_ps(q1), b1 = _mm512_loadu_ps(q1 + 16),
                     b2 = _mm512_loadu_ps(q1 + 32), b3 = _mm512_loadu_ps(q1 + 48);
        float mx0 = m[2 * kv], mx1 = m[2 * kv + 1];
        for (long t = 0; t < n; t++) {
            const float *k = K + t * row + kv * 64;
            const __m512 k0 = _mm512_loadu_ps(k), k1 = _mm512_loadu_ps(k + 16), k2 = _mm512_loadu_ps(k + 32),
                         k3 = _mm512_loadu_ps(k + 48);
            const __m512 x = _mm512_fmadd_ps(a3, k3, _mm512_fmadd_ps(a2, k2, _mm512_fmadd_ps(a1, k1,
                                                                                            _mm512_mul_ps(a0, k0))));
            const __m512 y = _mm512_fmadd_ps(b3, k3, _mm512_fmadd_ps(b2, k2, _mm512_fmadd_ps(b1, k1,
                                                                                            _mm512_mul_ps(b0, k0))));
            s0[t] = _mm512_reduce_add_ps(x) * scale;
            s1[t] = _mm512_reduce_add_ps(y) * scale;
            if (s0[t] > mx0) mx0 = s0[t];
            if (s1[t] > mx1) mx1 = s1[t];
        }
        const float c0 = m[2 * kv] == -INFINITY ? 0.0f : expf(m[2 * kv] - mx0);
        const float c1 = m[2 * kv + 1] == -INFINITY ? 0.0f : expf(m[2 * kv + 1] - mx1);
        float sum0 = 0.0f, sum1 = 0.0f;
        long t = 0;
        const __m256 m0v = _mm256_set1_ps(mx0), m1v = _mm256_set1_ps(mx1);
        for (; t + 8 <= n; t += 8) {
            const __m256 p0 = exp8(_mm256_sub_ps(_mm256_loadu_ps(s0 + t), m0v));
            const __m256 p1 = exp8(_mm256_sub_ps(_mm256_loadu_ps(s1 + t), m1v));
            _mm256_storeu_ps(s0 + t, p0);
            _mm256_storeu_ps(s1 + t, p1);
            sum0 += hsum(p0);
            sum1 += hsum(p1);
        }
        for (; t < n; t++) {
            s0[t] = expf(s0[t] - mx0); sum0 += s0[t];
            s1[t] = expf(s1[t] - mx1); sum1 += s1[t];
        }
        l[2 * kv] = l[2 * kv] * c0 + sum0;
        l[2 * kv + 1] = l[2 * kv + 1] * c1 + sum1;
        m[2 * kv] = mx0;
        m[2 * kv + 1] = mx1;
        float *o0 = acc + 2 * kv * 64, *o1 = o0 + 64;
        const __m512 cv0 = _mm512_set1_ps(c0), cv1 = _mm512_set1_ps(c1);
        __m512 u0 = _mm512_mul_ps(_mm512_loadu_ps(o0), cv0), u1 = _mm512_mul_ps(_mm512_loadu_ps(o0 + 16), cv0),
               u2 = _mm512_mul_ps(_mm512_loadu_ps(o0 + 32), cv0), u3 = _mm512_mul_ps(_mm512_loadu_ps(o0 + 48), cv0);
        __m512 w0 = _mm512_mul_ps(_mm512_loadu_ps(o1), cv1), w1 = _mm512_mul_ps(_mm512_loadu_ps(o1 + 16), cv1),
               w2 = _mm512_mul_ps(_mm512_loadu_ps(o1 + 32), cv1), w3 = _mm512_mul_ps(_mm512_loadu_ps(o1 + 48), cv1);
        for (t = 0; t < n; t++) {
            const float *v = V + t * row + kv * 64;
            const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16), v2 = _mm512_loadu_ps(v + 32),
                         v3 = _mm512_loadu_ps(v + 48);
            const __m512 p = _mm512_set1_ps(s0[t]), r = _mm512_set1_ps(s1[t]);
            u0 = _mm512_fmadd_ps(p, v0, u0); u1 = _mm512_fmadd_ps(p, v1, u1);
            u2 = _mm512_fmadd_ps(p, v2, u2); u3 = _mm512_fmadd_ps(p, v3, u3);
            w0 = _mm512_fmadd_ps(r, v0, w0); w1 = _mm512_fmadd_ps(r, v1, w1);
            w2 = _mm512_fmadd_ps(r, v2, w2); w3 = _mm512_fmadd_ps(r, v3, w3);
        }
        _mm512_storeu_ps(o0, u0); _mm512_storeu_ps(o0 + 16, u1); _mm512_storeu_ps(o0 + 32, u2);
        _mm512_storeu_ps(o0 + 48, u3);
        _mm512_storeu_ps(o1, w0); _mm512_storeu_ps(o1 + 16, w1); _mm512_storeu_ps(o1 + 32, w2);
        _mm512_storeu_ps(o1 + 48, w3);
    }
}

/* One sequence's attention state across its chunks. */
struct chunked {
    float *K, *V;  /* [CHUNK, H, D] */
    float *m, *l, *acc, *sc;  /* [Hq], [Hq], [Hq, D], [2 CHUNK] */
    long n;  /* rows in the current chunk */
};

static inline void flush(const moeray_quant_decode_args *a, const float *q, struct chunked *c) {
    if (c->n && a->D == 64 && a->Hq == 2 * a->H && moeray_isa_level >= 2)
        attend_chunk_d64g2(q, c->K, c->V, c->n, a->H, a->scale, c->m, c->l, c->acc, c->sc);
    else if (c->n)
        attend_chunk(q, c->K, c->V, c->n, a->Hq, a->H, a->D, a->scale, c->m, c->l, c->acc, c->sc);
    c->n = 0;
}

/* 0; -1 when the scratch could not be allocated; -3 when D > 1024; -4 when a position to rotate (sink and quantized
   tokens, and the staged tail) is >= maxpos (nothing written in these cases). */
long moeray_quant_decode_attention(const moeray_quant_decode_args *a) {
    const long H = a->H, D = a->D, row = H * D, Hq = a->Hq;
    if (D > 1024) return -3;
    long rows = CHUNK;  /* the longest sequence made whole, or a chunk */
    for (long b = 0; b < a->B; b++) {
        const long ns = a->sk || a->stk ? a->slen[b] : 0, t = ns + a->ctx[b] + (a->tk || a->stk ? a->tlen[b] : 0);
        if (a->stk ? t > a->maxpos : a->ctx[b] > 0 && ns + a->ctx[b] > a->maxpos) return -4;
        if (t <= WHOLE_ROWS && t > rows) rows = t;
    }
    /* the rows made whole or one chunk of them, then the online softmax state */
    float *const scratch = thread_scratch((size_t)(2 * rows * row + 2 * Hq + Hq * D + 2 * CHUNK));
    struct unpacker u;
    if (!scratch || unpacker_init(a, &u)) return -1;
    float *const tail = scratch + 2 * rows * row;
    struct chunked c = {scratch, scratch + rows * row, tail, tail + Hq, tail + 2 * Hq, tail + 2 * Hq + Hq * D, 0};
    uint8_t buf[1024 + 8];  /* one packed row (<= 8 bits x D <= 1024 bytes) and 4 readable bytes past it */
    for (long b = 0; b < a->B; b++) {
        const float *q = a->q + b * Hq * D;
        for (long h = 0; h < Hq; h++) { c.m[h] = -INFINITY; c.l[h] = 0.0f; }
        memset(c.acc, 0, (size_t)(Hq * D) * sizeof(float));
        c.n = 0;
        const long n_sink = a->sk || a->stk ? a->slen[b] : 0;
        const long total = n_sink + a->ctx[b] + (a->tk || a->stk ? a->tlen[b] : 0);
        const long cap_rows = total <= WHOLE_ROWS ? total + 1 : CHUNK;  /* whole: never flushed before the end */
        const float *stk = a->stk ? a->stk + a->sslot[b] * a->srows * row : NULL;
        const float *stv = a->stk ? a->stv + a->sslot[b] * a->srows * row : NULL;
        for (long i = 0; i < n_sink; i++) {
            if (stk) {
                rope_row(stk + i * row, a->cosr + i * D, a->sinr + i * D, H, D, c.K + c.n * row);
                memcpy(c.V + c.n * row, stv + i * row, (size_t)row * sizeof(float));
            } else {
                memcpy(c.K + c.n * row, a->sk + (b * a->ns + i) * row, (size_t)row * sizeof(float));
                memcpy(c.V + c.n * row, a->sv + (b * a->ns + i) * row, (size_t)row * sizeof(float));
            }
            if (++c.n == cap_rows) flush(a, q, &c);
        }
        for (long i = 0, pg = 0, sl = 0; i < a->ctx[b]; i++) {  /* page and slot counted, not divided (idiv) */
            unpack_token(a, &u, a->bt[b * a->mb + pg], sl, n_sink + i, c.K + c.n * row, c.V + c.n * row, buf);
            if (++sl == a->S) { sl = 0; pg++; }
            if (++c.n == cap_rows) flush(a, q, &c);
        }
        const long n_tail = a->tk || a->stk ? a->tlen[b] : 0;
        const long r0 = stk ? a->ns + a->ctx[b] % a->sbs : 0;
        for (long j = 0; j < n_tail; j++) {
            if (stk) {
                const long pos = n_sink + a->ctx[b] + j;
                rope_row(stk + (r0 + j) * row, a->cosr + pos * D, a->sinr + pos * D, H, D, c.K + c.n * row);
                memcpy(c.V + c.n * row, stv + (r0 + j) * row, (size_t)row * sizeof(float));
            } else {
                memcpy(c.K + c.n * row, a->tk + (b * a->nt + j) * row, (size_t)row * sizeof(float));
                memcpy(c.V + c.n * row, a->tv + (b * a->nt + j) * row, (size_t)row * sizeof(float));
            }
            if (++c.n == cap_rows) flush(a, q, &c);
        }
        float *o = a->out + b * Hq * D;
        if (total <= WHOLE_ROWS && c.n) {
            if (attend_rows(q, c.K, c.V, c.n, Hq, H, D, a->scale, o)) { unpacker_free(&u); return -1; }
            continue;
        }
        flush(a, q, &c);
        for (long h = 0; h < Hq; h++) {  /* no rows at all: l = 0, a zero output */
            const float inv = c.l[h] > 0.0f ? 1.0f / c.l[h] : 0.0f;
            for (long d = 0; d < D; d++) o[h * D + d] = c.acc[h * D + d] * inv;
        }
    }
    unpacker_free(&u);
    return 0;
}
