/* The same-node shared-memory segment's sync: counters, slots, the publish and the spin-then-futex wait, shared by
   the all-to-all (shm_a2a.c) and the expert-parallel slot exchange (ep_exchange.c).  Layout and wake protocol:
   shm_a2a.c's header comment. */
#ifndef MOERAY_SHM_SYNC_H
#define MOERAY_SHM_SYNC_H
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
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

/* counter[r] = value (seq_cst: the data stores before it are visible first), waking sleepers on it. */
static inline void shm_publish(char *base, long line, long r, int64_t value) {
    __atomic_store_n(counter(base, line, r), value, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(sleepers(base, line, r), __ATOMIC_SEQ_CST) > 0)
        syscall(SYS_futex, (uint32_t *)counter(base, line, r), FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/* Until counter[s] >= target: 1 when it is, 0 when wait_ns passed first (spinning the first spin_ns, with a
   sched_yield every yield_ns when that is > 0: another task queued on this core runs now, not at the next tick). */
static inline int wait_for(char *base, long line, long s, int64_t target, long spin_ns, long deadline_ns, long yield_ns) {
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

#endif
