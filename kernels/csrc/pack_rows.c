/* The fixed-capacity all-to-all dispatch's send buffer: (token, expert) pairs packed into per-rank rows. */
#include "common.h"

/* Pair v (token tok[v] for local expert local[v] on rank dest[v]) goes to row dest[v] * C + j of send
   [W * C, D + 1], j = its rank among the pairs for that rank (stable); column D carries the local id as fp32,
   -1 on padding rows (whose other columns are left as they are: receivers skip them).  slot[v] = the row,
   counts[r] = pairs for rank r.  Returns -1 if a rank gets more than C pairs, else 0. */
static long pack_rows(const float *x, long D, const long *tok, const long *dest, const long *local, long V,
                      long W, long C, float *send, long *slot, long *counts) {
    for (long r = 0; r < W; r++) counts[r] = 0;
    for (long v = 0; v < V; v++) {
        const long r = dest[v];
        if (r < 0 || r >= W || counts[r] >= C) return -1;
        const long row = r * C + counts[r]++;
        slot[v] = row;
        float *dst = send + row * (D + 1);
        const float *src = x + tok[v] * D;
        for (long d = 0; d < D; d++) dst[d] = src[d];
        dst[D] = (float)local[v];
    }
    for (long r = 0; r < W; r++)
        for (long j = counts[r]; j < C; j++) send[(r * C + j) * (D + 1) + D] = -1.0f;
    return 0;
}

/* Entry point: pack_rows's arguments as one struct (kernels/cpu/_abi.py: PackRowsArgs); returns pack_rows's. */
typedef struct {
    const float *x; long D; const long *tok, *dest, *local; long V, W, C; float *send; long *slot, *counts;
} moeray_pack_rows_args;

long moeray_pack_rows(const moeray_pack_rows_args *a) {
    return pack_rows(a->x, a->D, a->tok, a->dest, a->local, a->V, a->W, a->C, a->send, a->slot, a->counts);
}
