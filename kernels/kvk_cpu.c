/* kvk_cpu: how the CPU kernels run: which instruction set (a const table of vector kernels chosen
 * once from CPUID, capped by KVK_SIMD) and on how many threads (a small pool of helper threads
 * that the caller joins as worker 0).
 *
 * The pool runs one call at a time. A call that finds it busy (another application thread is in
 * a kernel) runs alone on its own thread instead of waiting, so kernels never block each other
 * and never deadlock; outputs do not depend on which thread ran which task, so that changes
 * nothing but speed.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kvk_internal.h"

/* ---- Instruction set ------------------------------------------------------------------------- */

static pthread_once_t simd_once = PTHREAD_ONCE_INIT;
static int simd_cpu;           /* best level the CPU has */
static _Atomic int simd_level; /* level in use */

static void simd_init(void) {
    int best = KVK__SIMD_SCALAR;
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c")) {
        best = KVK__SIMD_AVX2;
        if (__builtin_cpu_supports("avx512f")) {
            best = KVK__SIMD_AVX512;
        }
    }
#endif
    simd_cpu = best;
    int level = best;
    const char *env = getenv("KVK_SIMD");
    if (env != NULL) {
        if (strcmp(env, "scalar") == 0) {
            level = KVK__SIMD_SCALAR;
        } else if (strcmp(env, "avx2") == 0 && level > KVK__SIMD_AVX2) {
            level = KVK__SIMD_AVX2;
        }
    }
    atomic_store(&simd_level, level);
}

int kvk__simd_force(int level) {
    pthread_once(&simd_once, simd_init);
    level = level < KVK__SIMD_SCALAR ? KVK__SIMD_SCALAR : level;
    level = level > simd_cpu ? simd_cpu : level;
    atomic_store(&simd_level, level);
    return level;
}

const kvk__simd_ops *kvk__ops(void) {
    pthread_once(&simd_once, simd_init);
#if defined(__x86_64__) && defined(__GNUC__)
    switch (atomic_load(&simd_level)) {
        case KVK__SIMD_AVX512:
            return &kvk__simd_avx512;
        case KVK__SIMD_AVX2:
            return &kvk__simd_avx2;
    }
#endif
    return NULL;
}

const char *kvk_simd_name(void) {
    const kvk__simd_ops *ops = kvk__ops();
    return ops == NULL ? "scalar" : ops->name;
}

void kvk__convert(const kvk__simd_ops *ops, kv_dtype sd, const void *src, float mul, kv_dtype dd,
                  void *dst, uint64_t n, float div) {
    enum { CHUNK = 512 };
    float buf[CHUNK];
    uint32_t sb = kvk_dtype_bytes(sd), db = kvk_dtype_bytes(dd);
    for (uint64_t i = 0; i < n; i += CHUNK) {
        uint64_t m = n - i < CHUNK ? n - i : CHUNK;
        ops->to_f32(sd, (const char *)src + i * sb, m, mul, buf);
        ops->from_f32(dd, buf, m, div, (char *)dst + i * db);
    }
}

/* ---- Threads --------------------------------------------------------------------------------- */

typedef struct pool_job {
    void (*fn)(void *ctx, uint64_t task, uint32_t worker);
    void *ctx;
    uint64_t ntasks;
    _Atomic uint64_t next; /* next task to hand out */
    uint32_t workers;      /* helpers 1 .. workers-1 take part */
} pool_job;

static pthread_mutex_t pool_run = PTHREAD_MUTEX_INITIALIZER; /* held by the call using the pool */
static pthread_mutex_t pool_mu = PTHREAD_MUTEX_INITIALIZER;  /* guards the fields below */
static pthread_cond_t pool_wake = PTHREAD_COND_INITIALIZER;
static pthread_cond_t pool_idle = PTHREAD_COND_INITIALIZER;
static pthread_t pool_threads[KVK_MAX_THREADS];
static uint32_t pool_started; /* helper threads running: indices 1 .. pool_started */
static uint64_t pool_gen;     /* bumped per job; helpers run each generation once */
static pool_job *pool_cur;    /* the job of generation pool_gen */
static uint32_t pool_busy;    /* helpers still in the current job */
static int pool_quit;         /* helpers above pool_keep exit */
static uint32_t pool_keep;
static uint64_t helper_gen0[KVK_MAX_THREADS]; /* pool_gen when helper i was created */
static _Atomic uint32_t nthreads;
static pthread_once_t threads_once = PTHREAD_ONCE_INIT;

static void threads_init(void) {
    uint32_t n = 1;
    const char *env = getenv("KVK_THREADS");
    if (env != NULL) {
        long v = strtol(env, NULL, 10);
        n = v >= 1 && v <= KVK_MAX_THREADS ? (uint32_t)v : 1;
    }
    atomic_store(&nthreads, n);
}

static void job_run(pool_job *j, uint32_t worker) {
    for (;;) {
        uint64_t t = atomic_fetch_add(&j->next, 1);
        if (t >= j->ntasks) {
            return;
        }
        j->fn(j->ctx, t, worker);
    }
}

static void *helper_main(void *arg) {
    uint32_t id = (uint32_t)(uintptr_t)arg;
    pthread_mutex_lock(&pool_mu);
    /* The generation when this helper was created, not when it got here: a job posted in
     * between counts this helper in pool_busy and must be seen. */
    uint64_t seen = helper_gen0[id];
    for (;;) {
        while (pool_gen == seen && !(pool_quit && id > pool_keep)) {
            pthread_cond_wait(&pool_wake, &pool_mu);
        }
        if (pool_quit && id > pool_keep) {
            break;
        }
        seen = pool_gen;
        pool_job *j = pool_cur;
        if (id < j->workers) {
            pthread_mutex_unlock(&pool_mu);
            job_run(j, id);
            pthread_mutex_lock(&pool_mu);
        }
        if (--pool_busy == 0) {
            pthread_cond_signal(&pool_idle);
        }
    }
    pthread_mutex_unlock(&pool_mu);
    return NULL;
}

/* Starts or stops helpers so that 1 + helpers == n. Caller holds pool_run. */
static kv_err pool_resize(uint32_t n) {
    if (n - 1 < pool_started) {
        pthread_mutex_lock(&pool_mu);
        pool_quit = 1;
        pool_keep = n - 1;
        pthread_cond_broadcast(&pool_wake);
        pthread_mutex_unlock(&pool_mu);
        for (uint32_t i = n; i <= pool_started; i++) {
            pthread_join(pool_threads[i - 1], NULL);
        }
        pthread_mutex_lock(&pool_mu);
        pool_quit = 0;
        pool_started = n - 1;
        pthread_mutex_unlock(&pool_mu);
    }
    while (pool_started < n - 1) {
        uint32_t id = pool_started + 1;
        pthread_mutex_lock(&pool_mu);
        helper_gen0[id] = pool_gen;
        pthread_mutex_unlock(&pool_mu);
        if (pthread_create(&pool_threads[id - 1], NULL, helper_main, (void *)(uintptr_t)id) != 0) {
            return kvk__fail(KV_EINTERNAL, "set_threads: cannot start thread %u", id);
        }
        pthread_mutex_lock(&pool_mu);
        pool_started = id;
        pthread_mutex_unlock(&pool_mu);
    }
    return KV_OK;
}

kv_err kvk_set_threads(uint32_t n) {
    pthread_once(&threads_once, threads_init);
    if (n < 1 || n > KVK_MAX_THREADS) {
        return kvk__fail(KV_EINVAL, "set_threads: %u is not 1..%d", n, KVK_MAX_THREADS);
    }
    pthread_mutex_lock(&pool_run);
    kv_err rc = KV_OK;
    if (n - 1 < pool_started) {
        rc = pool_resize(n); /* stopping never fails */
    }
    if (rc == KV_OK) {
        atomic_store(&nthreads, n); /* helpers start lazily, on the first call that needs them */
    }
    pthread_mutex_unlock(&pool_run);
    return rc;
}

uint32_t kvk_threads(void) {
    pthread_once(&threads_once, threads_init);
    return atomic_load(&nthreads);
}

uint32_t kvk__workers(void) {
    return kvk_threads();
}

void kvk__parallel_for(uint64_t ntasks, uint32_t max_workers,
                       void (*fn)(void *ctx, uint64_t task, uint32_t worker), void *ctx) {
    pool_job j = {.fn = fn, .ctx = ctx, .ntasks = ntasks, .workers = 1};
    atomic_init(&j.next, 0);
    uint32_t want = max_workers < kvk_threads() ? max_workers : kvk_threads();
    want = (uint64_t)want > ntasks ? (uint32_t)ntasks : want;
    if (want <= 1 || pthread_mutex_trylock(&pool_run) != 0) {
        job_run(&j, 0);
        return;
    }
    if (pool_started < want - 1 && pool_resize(want) != KV_OK) {
        want = pool_started + 1; /* run with the helpers that did start */
    }
    j.workers = want;
    if (want > 1) {
        pthread_mutex_lock(&pool_mu);
        pool_cur = &j;
        pool_busy = pool_started;
        pool_gen++;
        pthread_cond_broadcast(&pool_wake);
        pthread_mutex_unlock(&pool_mu);
    }
    job_run(&j, 0);
    if (want > 1) {
        /* Every started helper looks at the job (those above j.workers only to skip it) before
         * j, on this stack, goes out of scope. */
        pthread_mutex_lock(&pool_mu);
        while (pool_busy != 0) {
            pthread_cond_wait(&pool_idle, &pool_mu);
        }
        pool_cur = NULL;
        pthread_mutex_unlock(&pool_mu);
    }
    pthread_mutex_unlock(&pool_run);
}
