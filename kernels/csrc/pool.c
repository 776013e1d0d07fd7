/* A rank's compute threads for row-split kernel calls (kernels/cpu/parallel.py): one call runs n tasks, task 0 on
   the calling thread and task i on helper i - 1, and returns when all are done.  A task is one kernel entry on one
   argument struct (its rows of one output), so the tasks of a call write disjoint memory.

   Per helper one slot: the caller writes the task into an idle slot, then bumps its `gen` (release) and wakes it;
   the helper runs the task, stores `done = gen` (release) and wakes the caller if it sleeps.  A slot is written only
   while its helper is idle (done == gen), so no task is ever read half-written.  Both sides spin briefly (a task's
   peers finish within microseconds of each other), then FUTEX_WAIT: an idle rank leaves its other cores alone,
   unlike an OpenMP pool's spin-wait.

   Step-scoped spin (`moeray_pool_set_spin`, `moeray_pool_park`).  Waking a helper asleep in FUTEX_WAIT costs ~40 us
   on a 2-vCPU KVM guest (the idle vCPU halts; measured: a 500-row RMSNorm takes 19 us back to back, 57-70 us after
   any pause), and a 500-token prefill makes ~35 pool calls with one-thread work between them (routing, RoPE, KV
   writes: 20-300 us each).  So helpers spin up to `helper_spin_ns` for the next task (30 us until set;
   kernels/cpu/parallel.py sets 1 ms) and the engine parks them at the end of each step: a park makes a spinning helper go to sleep at
   once, so a rank between steps still leaves its cores alone.
   Calls are serialized by a mutex (the engine calls from one thread; tests may call from several). */
#define _GNU_SOURCE
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#include <immintrin.h>

#define MAX_HELPERS 63
/* how long helpers spin for their next task and the caller for its helpers' tasks before sleeping
   (`moeray_pool_set_spin`; 30 us until set) */
static long helper_spin_ns = 30000L;
static uint32_t park_gen = 0;        /* bumped by `moeray_pool_park`: spinning helpers sleep at once */

/* the kernels a task can run (their argument structs are defined with them; kernels/cpu/_abi.py mirrors them) */
long moeray_linear_task(const void *a);
void moeray_rms_norm(const void *a);
long moeray_expert_ffn_bf16w(const void *a);
long moeray_prefill_attention(const void *a);

enum { TASK_LINEAR = 0, TASK_RMS_NORM = 1, TASK_EXPERT_FFN = 2, TASK_PREFILL_ATTENTION = 3 };

static long run_task(long kind, const void *a) {
    switch (kind) {
        case TASK_LINEAR: return moeray_linear_task(a);
        case TASK_RMS_NORM: moeray_rms_norm(a); return 0;
        case TASK_EXPERT_FFN: return moeray_expert_ffn_bf16w(a);
        case TASK_PREFILL_ATTENTION: return moeray_prefill_attention(a);
        default: return -100;
    }
}

struct slot { /* not a typedef'd struct: no ctypes mirror (tests/kernels/test_cpu_abi.py reads those) */
    uint32_t gen, done;     /* futex words: gen (caller -> helper), done (helper -> caller) */
    int32_t helper_asleep;  /* the helper sleeps on `gen` (so the caller must wake it) */
    int32_t caller_asleep;  /* the caller sleeps on `done` (so the helper must wake it) */
    long kind, rc;
    const void *args;
    pthread_t thread;
    char pad[64];
};
typedef struct slot slot_t;

static slot_t slots[MAX_HELPERS];
static long n_helpers = 0;
static pthread_mutex_t run_lock = PTHREAD_MUTEX_INITIALIZER;

static long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

static void futex_wait(uint32_t *w, uint32_t v) { syscall(SYS_futex, w, FUTEX_WAIT_PRIVATE, v, NULL, NULL, 0); }
static void futex_wake(uint32_t *w) { syscall(SYS_futex, w, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0); }

/* spin up to spin_ns for *w != v (and while park_gen still reads park0), else sleep on it; returns the new value */
static uint32_t wait_change(uint32_t *w, uint32_t v, int32_t *asleep_flag, long spin_ns, uint32_t park0) {
    uint32_t x;
    long t0 = now_ns();
    while ((x = __atomic_load_n(w, __ATOMIC_ACQUIRE)) == v) {
        if (now_ns() - t0 > spin_ns || __atomic_load_n(&park_gen, __ATOMIC_ACQUIRE) != park0) {
            /* flag, then re-check (both seq_cst; the waker stores the word, then reads the flag): either the waker
               sees the flag and wakes us, or we see the new word; FUTEX_WAIT returns at once on a changed word */
            __atomic_store_n(asleep_flag, 1, __ATOMIC_SEQ_CST);
            while ((x = __atomic_load_n(w, __ATOMIC_SEQ_CST)) == v) futex_wait(w, v);
            __atomic_store_n(asleep_flag, 0, __ATOMIC_RELAXED);
            return x;
        }
        _mm_pause();
    }
    return x;
}

static void *helper_main(void *p) {
    slot_t *s = (slot_t *)p;
    /* the gen the slot was created with (0), not a fresh read: a call made before this thread first runs has
       already bumped gen, and reading that as "seen" would lose the task (the caller would wait forever) */
    uint32_t seen = 0;
    for (;;) {
        const uint32_t park0 = __atomic_load_n(&park_gen, __ATOMIC_ACQUIRE);
        seen = wait_change(&s->gen, seen, &s->helper_asleep, __atomic_load_n(&helper_spin_ns, __ATOMIC_RELAXED),
                           park0);
        s->rc = run_task(s->kind, s->args);
        __atomic_store_n(&s->done, seen, __ATOMIC_SEQ_CST);
        if (__atomic_load_n(&s->caller_asleep, __ATOMIC_SEQ_CST)) futex_wake(&s->done);
    }
    return NULL;
}

/* a forked child has none of the parent's helper threads: it runs every task on its calling thread */
static void forget_helpers(void) { n_helpers = 0; pthread_mutex_init(&run_lock, NULL); }
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;
static void register_atfork(void) { pthread_atfork(NULL, NULL, forget_helpers); }

/* Make sure at least `n` helper threads exist (capped at MAX_HELPERS; never fewer than before).
   Returns the number of helpers. */
long moeray_pool_start(long n) {
    pthread_once(&atfork_once, register_atfork);
    pthread_mutex_lock(&run_lock);
    if (n > MAX_HELPERS) n = MAX_HELPERS;
    while (n_helpers < n) {
        slot_t *s = &slots[n_helpers];
        s->gen = s->done = 0;
        s->helper_asleep = s->caller_asleep = 0;
        if (pthread_create(&s->thread, NULL, helper_main, s)) break;
        pthread_detach(s->thread);
        n_helpers++;
    }
    long r = n_helpers;
    pthread_mutex_unlock(&run_lock);
    return r;
}

/* Run task `kind` on n argument structs (args, args + stride, ...): task 0 here, task i on helper i - 1 (n - 1 must
   not exceed the helpers started; extra tasks run here).  Returns the first nonzero task result by task order,
   else 0. */
long moeray_pool_run(long kind, const char *args, long stride, long n) {
    pthread_mutex_lock(&run_lock);
    long on_helpers = n - 1 < n_helpers ? n - 1 : n_helpers;
    if (on_helpers < 0) on_helpers = 0;
    for (long h = 0; h < on_helpers; h++) {
        slot_t *s = &slots[h];
        s->kind = kind;
        s->args = args + (h + 1) * stride;
        s->rc = 0;
        uint32_t g = s->gen + 1;
        __atomic_store_n(&s->gen, g, __ATOMIC_SEQ_CST);
        if (__atomic_load_n(&s->helper_asleep, __ATOMIC_SEQ_CST)) futex_wake(&s->gen);
    }
    long rc = n > 0 ? run_task(kind, args) : 0;
    for (long i = on_helpers + 1; i < n; i++) {  /* more tasks than helpers */
        long r = run_task(kind, args + i * stride);
        if (!rc) rc = r;
    }
    /* the caller spins as long as a helper would: a task still running will end within the step */
    const long spin = __atomic_load_n(&helper_spin_ns, __ATOMIC_RELAXED);
    const uint32_t park0 = __atomic_load_n(&park_gen, __ATOMIC_ACQUIRE);
    for (long h = 0; h < on_helpers; h++) {
        slot_t *s = &slots[h];
        uint32_t g = s->gen, d = __atomic_load_n(&s->done, __ATOMIC_ACQUIRE);
        while (d != g) d = wait_change(&s->done, d, &s->caller_asleep, spin, park0);
        if (!rc) rc = s->rc;
    }
    pthread_mutex_unlock(&run_lock);
    return rc;
}

/* Helpers spin up to `ns` nanoseconds (>= 0) for their next task before sleeping. */
void moeray_pool_set_spin(long ns) { __atomic_store_n(&helper_spin_ns, ns < 0 ? 0 : ns, __ATOMIC_RELAXED); }

/* Spinning helpers go to sleep now (the end of a step); the next call wakes them. */
void moeray_pool_park(void) { __atomic_add_fetch(&park_gen, 1, __ATOMIC_RELEASE); }
