/* The expert-parallel decode exchange in the shared-memory segment's own slots (actors/moe/slot_exchange.py): no
   send or receive buffer, no copy in or out.

   Segment layout, call numbering and wake protocol: shm_a2a.c / shm_sync.h.  One MoE layer takes two calls, n (the
   dispatch) and n + 1 (the combine), so bank(n) = n % 2 carries the rows and the other bank the results:
     dispatch  rank r packs its (token, expert) pairs for rank d straight into slot(bank(n), r, d) (C rows of D + 1
               fp32: the token row, then the local expert id; -1 marks padding), its own pairs included (the
               diagonal slot), and publishes counter[r] = n + 1.
     experts   rank r runs its experts on slot(bank(n), s, r) for every source s, its own chunk first (no wait:
               that overlaps its experts with the peers' lag), then each peer's once counter[s] >= n + 1, writing
               results straight into slot(bank(n + 1), r, s) (C rows of D fp32); then publishes counter[r] = n + 2.
     combine   once every counter[s] >= n + 2, out[t] = sum_k w[t, k] * (row j of slot(bank(n + 1), d, r)) for
               pair (t, k)'s slot d * C + j.
   Why the slots may be read in place.  shm_a2a.c's two-bank rule (a rank writes call m's slots only after seeing
   every peer at >= m - 1) still holds, now that readers read the slots themselves instead of copies: rank r rewrites
   its rows in bank(n) at call n + 2 (the next dispatch, or the next step's agreement) only after its combine saw every
   peer at >= n + 2, published after that peer's experts finished reading them; it rewrites its results for peer s in
   bank(n + 1) at call n + 3 only after seeing s at >= n + 3, published after s's combine read them (its own chunk
   only r reads). */
#include "shm_sync.h"
#include "common.h"
#include "entry_points.h"

/* Dispatch: pack pair v = (t, k) of ids [T, K] (expert e = ids[v] -> rank rank_of[e], local row local_of[e]) into
   its rank's slot of bank(call), pad, publish counter[r] = call + 1.  slot[v] = d * C + j (its row among the W * C
   rows this rank sends), sent[d] += pairs for rank d.  Returns 0; -1 when a rank would get more than C pairs, -2 for
   an id outside [0, E) (nothing published: the caller fails the step). */
typedef struct {
    char *base; long line, W, r, slot_bytes, call;
    const float *x; long sx, D; const long *ids; long T, K; const long *rank_of, *local_of; long E, C;
    long *slot, *sent;
} moeray_ep_dispatch_args;

long moeray_ep_dispatch(const moeray_ep_dispatch_args *a) {
    const long D = a->D, K = a->K, V = a->T * a->K, W = a->W, C = a->C, bank = a->call & 1;
    long counts[W];
    for (long d = 0; d < W; d++) counts[d] = 0;
    for (long v = 0; v < V; v++) {
        const long e = a->ids[v];
        if (e < 0 || e >= a->E) return -2;
        const long d = a->rank_of[e];
        if (d < 0 || d >= W || counts[d] >= C) return -1;
        const long j = counts[d]++;
        float *dst = (float *)slot(a->base, a->line, W, a->slot_bytes, bank, a->r, d) + j * (D + 1);
        memcpy(dst, a->x + (v / K) * a->sx, (size_t)D * sizeof(float));
        dst[D] = (float)a->local_of[e];
        a->slot[v] = d * C + j;
    }
    for (long d = 0; d < W; d++) {
        float *s = (float *)slot(a->base, a->line, W, a->slot_bytes, bank, a->r, d);
        for (long j = counts[d]; j < C; j++) s[j * (D + 1) + D] = -1.0f;
        a->sent[d] += counts[d];
    }
    shm_publish(a->base, a->line, a->r, (int64_t)(a->call + 1));
    return 0;
}

/* Experts: the chunks of bank(call) addressed to rank r, in the order r, r + 1, ... (mod W), from chunk number
   `next` on (0 on the first entry); each peer's after counter[s] >= call + 1.  Full-precision bf16 stacks gu / dn
   (panels gup / dnp or NULL), E local experts.  Then publishes counter[r] = call + 2.  Returns -1 when done; s >= 0
   when peer s did not arrive within wait_ns (`next` then names its chunk: call again after the liveness check);
   waited_ns += the nanoseconds spent waiting for peers;
   -2 for a local id >= E, -3 without scratch (nothing published). */
typedef struct {
    char *base; long line, W, r, slot_bytes, call; long C, D, I, E;
    const uint16_t *gu, *dn; const uint32_t *gup, *dnp;
    long next, spin_ns, wait_ns, yield_ns, waited_ns;
} moeray_ep_experts_args;

long moeray_ep_experts(moeray_ep_experts_args *a) {
    const long W = a->W, C = a->C, D = a->D, bank = a->call & 1;
    const long deadline = now_ns() + a->wait_ns;
    long *ids = (long *)thread_scratch((size_t)C * 2);  /* C int64 ids */
    if (!ids) return -3;
    for (; a->next < W; a->next++) {
        const long s = (a->r + a->next) % W;
        if (s != a->r) {
            const long t0 = now_ns();
            const int ok = wait_for(a->base, a->line, s, (int64_t)(a->call + 1), a->spin_ns, deadline, a->yield_ns);
            a->waited_ns += now_ns() - t0;
            if (!ok) return s;
        }
        const float *x = (const float *)slot(a->base, a->line, W, a->slot_bytes, bank, s, a->r);
        long n = 0;
        for (long j = 0; j < C; j++) {
            ids[j] = (long)x[j * (D + 1) + D];
            if (ids[j] >= 0) n = j + 1;
        }
        float *y = (float *)slot(a->base, a->line, W, a->slot_bytes, bank ^ 1, a->r, s);
        /* pairs fill a chunk from its first row: rows past the last real one are padding, never read */
        moeray_expert_ffn_bf16w_args f = {x, D + 1, a->gu, a->dn, a->gup, a->dnp, ids, NULL, n, 1, a->E, D, a->I, y, D};
        const long rc = n ? moeray_expert_ffn_bf16w(&f) : 0;
        if (rc == -2) return -2;
        if (rc) return -3;
    }
    shm_publish(a->base, a->line, a->r, (int64_t)(a->call + 2));
    return -1;
}

/* Combine: once every counter[s] >= call + 2, out [T, D] = sum_k w[t, k] * y(slot[t * K + k]) with y(d * C + j) =
   row j of slot(bank(call + 1), d, r).  Returns -1 when done, s >= 0 when peer s did not arrive within wait_ns
   (call again; nothing written); waited_ns += the nanoseconds spent waiting. */
typedef struct {
    char *base; long line, W, r, slot_bytes, call; long C, D; const long *slot; const float *w; long T, K;
    float *out; long spin_ns, wait_ns, yield_ns, waited_ns;
} moeray_ep_combine_args;

long moeray_ep_combine(moeray_ep_combine_args *a) {
    const long W = a->W, C = a->C, D = a->D, K = a->K, bank = (a->call + 1) & 1;
    const long t0 = now_ns(), deadline = t0 + a->wait_ns;
    for (long s = 0; s < W; s++)
        if (s != a->r && !wait_for(a->base, a->line, s, (int64_t)(a->call + 2), a->spin_ns, deadline, a->yield_ns)) {
            a->waited_ns += now_ns() - t0;
            return s;
        }
    a->waited_ns += now_ns() - t0;
    for (long t = 0; t < a->T; t++) {
        float *o = a->out + t * D;
        for (long k = 0; k < K; k++) {
            const long g = a->slot[t * K + k], d = g / C, j = g % C;
            const float *y = (const float *)slot(a->base, a->line, W, a->slot_bytes, bank, d, a->r) + j * D;
            weigh_term(o, y, a->w[t * K + k], D, k == 0);
        }
    }
    return -1;
}

/* counter[r] = value, waking sleepers: the experts' publish when they ran outside moeray_ep_experts (experts other than
   bf16 stacks: actors/moe/slot_exchange.py runs them chunk by chunk in Python). */
void moeray_shm_publish(char *base, long line, long r, long value) { shm_publish(base, line, r, (int64_t)value); }

/* -1 once counter[s] >= target, s when wait_ns passed first (the Python experts path waits for each peer's chunk). */
long moeray_shm_wait(char *base, long line, long s, long target, long spin_ns, long wait_ns, long yield_ns) {
    return wait_for(base, line, s, (int64_t)target, spin_ns, now_ns() + wait_ns, yield_ns) ? -1 : s;
}
