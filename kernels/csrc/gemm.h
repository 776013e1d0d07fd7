/* The bf16-weight GEMMs the dense and expert kernels share (gemm.c: row-major weights; gemm_panel.c: panel
   layout) and the run-time ISA choice. */
#ifndef MOERAY_GEMM_H
#define MOERAY_GEMM_H
#include "common.h"

/* 1: AVX2 + FMA loops, 2: AVX-512 loops (set by moeray_set_isa; kernels/cpu/_build.py sets it at load). */
extern long moeray_isa_level;

/* y[m * sy + n] = sum_k x[m * sx + k] * widen(w[n * K + k]) (+ b[n]) for m < M, n < N.  w: [N, K] bf16 bits,
   contiguous rows.  Returns 0, or -1 when scratch could not be allocated (K > 1024; nothing written). */
int moeray_gemm_bf16w(const float *x, long sx, const uint16_t *w, const float *b, float *y, long sy,
                      long M, long N, long K);

/* linear.c: the same product, one row as dot products straight from the bf16 stream, more rows by the GEMM. */
long moeray_linear_bf16w(const float *x, long sx, const uint16_t *w, const float *b, float *y, long sy,
                         long M, long N, long K);

/* gemm_panel.c: y [M, N] (row stride sy) = x [M, K] (row stride sx) w^T (+ b [N]), w in the 32-column panel
   layout (kernels/cpu/packing.py): ceil(N / 32) panels of K x 16 words, word j = column j | column 16 + j << 16. */
void moeray_linear_panels(const float *x, long sx, const uint32_t *wp, const float *b, float *y, long sy,
                          long M, long N, long K);

#endif
