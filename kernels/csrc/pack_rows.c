/* The fixed-capacity all-to-all dispatch's send buffer: (token, expert) pairs packed into per-rank rows. */
#include "common.h"

/* Place one pair (token row src for local expert `local` on rank r) in the next free row of rank r's C rows of send
   [W * C, D + 1]: its slot, or -1 if rank r already has C pairs or r is outside [0, W). */
static long place(const float *src, long D, long local, long r, long W, long C, float *send, long *counts) {
    if (r < 0 || r >= W || counts[r] >= C) return -1;
    const long row = r * C + counts[r]++;
    float *dst = send + row * (D + 1);
    for (long d = 0; d < D; d++) dst[d] = src[d];
    dst[D] = (float)local;
    return row;
}

/* -1 in the id column of every row past each rank's pairs (receivers skip those rows). */
static void mark_padding(long D, long W, long C, float *send, const long *counts) {
    for (long r = 0; r < W; r++)
        for (long j = counts[r]; j < C; j++) send[(r * C + j) * (D + 1) + D] = -1.0f;
}

/* Pair v (token tok[v] for local expert local[v] on rank dest[v]) goes to row dest[v] * C + j of send
   [W * C, D + 1], j = its rank among the pairs for that rank (stable); column D carries the local id as fp32,
   -1 on padding rows (whose other columns are left as they are: receivers skip them).  slot[v] = the row,
   counts[r] = pairs for rank r.  Returns -1 if a rank gets more than C pairs, else 0. */
static long pack_rows(const float *x, long D, const long *tok, const long *dest, const long *local, long V,
                      long W, long C, float *send, long *slot, long *counts) {
    for (long r = 0; r < W; r++) counts[r] = 0;
    for (long v = 0; v < V; v++)
        if ((slot[v] = place(x + tok[v] * D, D, local[v], dest[v], W, C, send, counts)) < 0) return -1;
    mark_padding(D, W, C, send, counts);
    return 0;
}

/* Entry point: pack_rows's arguments as one struct (kernels/cpu/_abi.py: PackRowsArgs); returns pack_rows's. */
typedef struct {
    const float *x; long D; const long *tok, *dest, *local; long V, W, C; float *send; long *slot, *counts;
} moeray_pack_rows_args;

long moeray_pack_rows(const moeray_pack_rows_args *a) {
    return pack_rows(a->x, a->D, a->tok, a->dest, a->local, a->V, a->W, a->C, a->send, a->slot, a->counts);
}

/* The same straight from the router's ids (a layer without replicas or padding ids): pair v = (t, k), t = v / K,
   of ids [T, K] goes to rank rank_of[ids[v]] as local row local_of[ids[v]] (rank_of / local_of [E]: the layer's
   placement tables).  Returns -1 as pack_rows does, -2 for an id outside [0, E). */
typedef struct {
    const float *x; long D; const long *ids; long T, K; const long *rank_of, *local_of; long E, W, C; float *send;
    long *slot, *counts;
} moeray_pack_ids_args;

long moeray_pack_ids(const moeray_pack_ids_args *a) {
    const long D = a->D, K = a->K, V = a->T * a->K;
    for (long r = 0; r < a->W; r++) a->counts[r] = 0;
    for (long v = 0; v < V; v++) {
        const long e = a->ids[v];
        if (e < 0 || e >= a->E) return -2;
        a->slot[v] = place(a->x + (v / K) * D, D, a->local_of[e], a->rank_of[e], a->W, a->C, a->send, a->counts);
        if (a->slot[v] < 0) return -1;
    }
    mark_padding(D, a->W, a->C, a->send, a->counts);
    return 0;
}

/* The combine's weighted sum over a fixed-capacity receive buffer: out[t] = sum_k w[t, k] * y[slot[t * K + k]],
   k in order (y [R, D] fp32 rows with row stride ys, w [T, K] fp32, out [T, D]). */
typedef struct { const float *y; long D, ys; const long *slot; const float *w; long T, K; float *out; } moeray_weigh_rows_args;

void moeray_weigh_rows(const moeray_weigh_rows_args *a) {
    const long D = a->D, K = a->K;
    for (long t = 0; t < a->T; t++) {
        float *o = a->out + t * D;
        for (long k = 0; k < K; k++)
            weigh_term(o, a->y + a->slot[t * K + k] * a->ys, a->w[t * K + k], D, k == 0);
    }
}
