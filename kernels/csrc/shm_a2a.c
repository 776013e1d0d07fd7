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
#define _GNU_SOURCE
#include <limits.h>
#include <linux/futex.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <sched.h>
#include <time.h>
#include <unistd.h>
#include <immintrin.h>

static inline int64_t *counter(char *base, long line, long r) { return (int64_t *)(base + r * line); }
static inline int32_t *sleepers(char *base, long line, long r) { return (int32_t *)(base + r * line + 8); }
static inline char *slot(char *base, long line, long W, long slot_bytes, long bank, long src, long dst) {
    return base + W * line + ((bank * W + src) * W + dst) * slot_bytes;
}
static inline long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

/* Call number `call` (0-based) of rank r, first half: inp's chunk for rank d (nb bytes each, W chunks) into
   slot(call % 2, r, d), its own chunk straight to out, then counter[r] = call + 1 (waking sleepers). */
void moeray_shm_a2a_send(char *base, long line, long W, long r, long slot_bytes, long call, const char *inp,
                         char *out, long nb) {
    const long bank = call & 1;
    for (long d = 0; d < W; d++)
        if (d != r) memcpy(slot(base, line, W, slot_bytes, bank, r, d), inp + d * nb, (size_t)nb);
    memcpy(out + r * nb, inp + r * nb, (size_t)nb);
    __atomic_store_n(counter(base, line, r), (int64_t)(call + 1), __ATOMIC_SEQ_CST);
    if (__atomic_load_n(sleepers(base, line, r), __ATOMIC_SEQ_CST) > 0)
        syscall(SYS_futex, (uint32_t *)counter(base, line, r), FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/* Until counter[s] >= target: 1 when it is, 0 when wait_ns passed first (spinning the first spin_ns, with a
   sched_yield every yield_ns when that is > 0: another task queued on this core runs now, not at the next tick). */
static int wait_for(char *base, long line, long s, int64_t target, long spin_ns, long deadline_ns, long yield_ns) {
    int64_t *c = counter(base, line, s);
    if (__atomic_load_n(c, __ATOMIC_ACQUIRE) >= target) return 1;
    const long t0 = now_ns();
    long last_yield = t0;
    for (;;) {
        for (int i = 0; i < 32; i++) {
            _mm_pause();
            if (__atomic_load_n(c, __ATOMIC_ACQUIRE) >= target) return 1;
        }
        const long t = now_ns();
        if (t - t0 >= spin_ns || t >= deadline_ns) break;
        if (yield_ns > 0 && t - last_yield >= yield_ns) {  /* a task queued on this core runs now, not at the tick */
            sched_yield();
            last_yield = t;
        }
    }
    int32_t *z = sleepers(base, line, s);
    __atomic_fetch_add(z, 1, __ATOMIC_SEQ_CST);
    int ok = 0;
    for (;;) {
        const int64_t v = __atomic_load_n(c, __ATOMIC_SEQ_CST);
        if (v >= target) { ok = 1; break; }
        const long left = deadline_ns - now_ns();
        if (left <= 0) break;
        struct timespec ts = { left / 1000000000L, left % 1000000000L };  /* FUTEX_WAIT: a relative timeout */
        syscall(SYS_futex, (uint32_t *)c, FUTEX_WAIT, (uint32_t)v, &ts, NULL, 0);
    }
    __atomic_fetch_sub(z, 1, __ATOMIC_SEQ_CST);
    return ok;
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
