/* The same-node shared-memory all-to-all's data path and waiting (actors/rank/shm_collective.py): copies, the
   counter publish and a spin-then-futex wait, so a waiting rank neither burns its core nor answers late.

   Segment layout (as in shm_collective.py): W header lines of `line` bytes, line r = { int64 counter[r] (its low
   32 bits, little-endian, are the futex word), int32 sleepers[r] (ranks asleep on that word) }, then two banks of
   W x W slots of slot_bytes: slot(bank, src, dst) at W * line + ((bank * W + src) * W + dst) * slot_bytes.

   Wake protocol (Linux futex(2), shared ops on the MAP_SHARED segment: works across processes).  Publisher:
   seq_cst store of counter[r] (x86-64: xchg, a full fence), then read sleepers[r], FUTEX_WAKE only when it is
   nonzero (the fast path makes no system call).  Waiter: spins for spin_ns (pause), then increments sleepers[s]
   (lock xadd: a full fence), re-reads counter[s] and FUTEX_WAITs on its low word with that value.  Both sides
   fence between their store and their load, so either the publisher sees the sleeper and wakes it, or the
   waiter sees the new counter (a futex wait on a changed word returns at once); no wake-up is lost. */
#include "shm_sync.h"

/* Call number `call` (0-based) of rank r, first half: inp's chunk for rank d (nb bytes each, W chunks) into
   slot(call % 2, r, d), its own chunk straight to out, then counter[r] = call + 1 (waking sleepers). */
void moeray_shm_a2a_send(char *base, long line, long W, long r, long slot_bytes, long call, const char *inp,
                         char *out, long nb) {
    const long bank = call & 1;
    for (long d = 0; d < W; d++)
        if (d != r) memcpy(slot(base, line, W, slot_bytes, bank, r, d), inp + d * nb, (size_t)nb);
    memcpy(out + r * nb, inp + r * nb, (size_t)nb);
    shm_publish(base, line, r, (int64_t)(call + 1));
}

/* Second half: for every peer s in order, wait until counter[s] >= call + 1, then copy slot(call % 2, s, r) to
   out's chunk s.  Returns -1 when every chunk is in, else the first peer that did not arrive within wait_ns
   (the caller checks the peer's liveness and its timeout, then calls again: chunks already copied are copied
   again, which is safe, since no peer overwrites bank call % 2 before this rank publishes call + 2). */
long moeray_shm_a2a_recv(char *base, long line, long W, long r, long slot_bytes, long call, char *out, long nb,
                         long spin_ns, long wait_ns, long yield_ns) {
    const long bank = call & 1, deadline = now_ns() + wait_ns;
    for (long s = 0; s < W; s++) {
        if (s == r) continue;
        if (!wait_for(base, line, s, (int64_t)(call + 1), spin_ns, deadline, yield_ns)) return s;
        memcpy(out + s * nb, slot(base, line, W, slot_bytes, bank, s, r), (size_t)nb);
    }
    return -1;
}
