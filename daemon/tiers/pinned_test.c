/* pinned_test: the set of page-locked T1 buffers (daemon/tiers/pinned.h) over a test backend
 * whose host_alloc hands out page-aligned memory and counts what is live: every buffer made is
 * known until it is freed, a freed one goes back to its backend only at a reap (never from the
 * freeing call), a malloc'd pointer is never taken, and destroy gives everything back. Also four
 * threads allocating and freeing at once (the copy threads and the loop thread). */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "daemon/tiers/pinned.h"

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static long live;      /* buffers the test backend handed out and did not get back */
static long freed;     /* host_free calls */
static int refuse;     /* host_alloc says no */
static int ctx_marker; /* the ctx the backend must be called with */

static void *t_alloc(void *ctx, uint64_t n) {
    assert_ptr_equal(ctx, &ctx_marker);
    if (refuse) {
        return NULL;
    }
    void *p = aligned_alloc(4096, (n + 4095) / 4096 * 4096);
    pthread_mutex_lock(&mu);
    live += p != NULL;
    pthread_mutex_unlock(&mu);
    return p;
}

static void t_free(void *ctx, void *p) {
    assert_ptr_equal(ctx, &ctx_marker);
    assert_non_null(p);
    free(p);
    pthread_mutex_lock(&mu);
    live--;
    freed++;
    pthread_mutex_unlock(&mu);
}

static const kvd_backend_ops be = {
    .name = "test-pinned", .host_alloc = t_alloc, .host_free = t_free};
static const kvd_backend_ops be_none = {.name = "no-host-alloc"};

static void reset(void) {
    live = freed = 0;
    refuse = 0;
}

static void test_alloc_free_reap(void **state) {
    (void)state;
    reset();
    kvd_pinned *pn = kvd_pinned_new();
    assert_non_null(pn);
    enum { N = 1000 };
    uint8_t **b = calloc(N, sizeof(*b));
    for (int i = 0; i < N; i++) {
        b[i] = kvd_pinned_alloc(pn, &be, &ctx_marker, 8192 + (uint64_t)i);
        assert_non_null(b[i]);
        memset(b[i], i & 0xff, 8192); /* host memory a host may touch */
    }
    assert_int_equal(live, N);
    assert_true(kvd_pinned_bytes(pn) >= (uint64_t)N * 8192);
    for (int i = 0; i < N; i++) {
        assert_true(kvd_pinned_is(pn, b[i]));
    }
    uint8_t *m = malloc(4096);
    assert_false(kvd_pinned_is(pn, m));
    assert_int_equal(kvd_pinned_free(pn, m), 0); /* not ours: the caller frees it */
    free(m);
    assert_int_equal(kvd_pinned_free(pn, NULL), 0);
    /* Free every other one: taken at once, back to the backend only at the reap. */
    for (int i = 0; i < N; i += 2) {
        assert_int_equal(kvd_pinned_free(pn, b[i]), 1);
        assert_false(kvd_pinned_is(pn, b[i]));
    }
    assert_int_equal(freed, 0);
    for (int i = 1; i < N; i += 2) {
        assert_true(kvd_pinned_is(pn, b[i])); /* deletions keep the others reachable */
    }
    kvd_pinned_reap(pn);
    assert_int_equal(freed, N / 2);
    assert_int_equal(live, N / 2);
    uint64_t left = 0;
    for (int i = 1; i < N; i += 2) {
        left += 8192 + (uint64_t)i;
    }
    assert_int_equal(kvd_pinned_bytes(pn), left);
    /* Free one more, then destroy: the held and the waiting all go back. */
    assert_int_equal(kvd_pinned_free(pn, b[1]), 1);
    kvd_pinned_destroy(pn);
    assert_int_equal(live, 0);
    assert_int_equal(freed, N);
    free(b);
}

static void test_no_host_memory(void **state) {
    (void)state;
    reset();
    kvd_pinned *pn = kvd_pinned_new();
    assert_null(kvd_pinned_alloc(pn, &be_none, &ctx_marker, 4096)); /* a backend without it */
    assert_null(kvd_pinned_alloc(pn, NULL, NULL, 4096));
    refuse = 1; /* the driver has no page-locked memory to give */
    assert_null(kvd_pinned_alloc(pn, &be, &ctx_marker, 4096));
    assert_null(kvd_pinned_alloc(pn, &be, &ctx_marker, 0));
    assert_int_equal(kvd_pinned_bytes(pn), 0);
    kvd_pinned_destroy(pn);
    kvd_pinned_destroy(NULL);
    kvd_pinned_reap(NULL);
    assert_int_equal(live, 0);
}

typedef struct targ {
    kvd_pinned *pn;
    int seed;
} targ;

static void *churn(void *arg) {
    targ *a = arg;
    uint8_t *mine[64] = {0};
    unsigned x = (unsigned)a->seed * 2654435761u + 1;
    for (int it = 0; it < 4000; it++) {
        x = x * 1103515245u + 12345u;
        int k = (int)(x >> 16) % 64;
        if (mine[k] == NULL) {
            mine[k] = kvd_pinned_alloc(a->pn, &be, &ctx_marker, 4096);
            if (mine[k] == NULL || !kvd_pinned_is(a->pn, mine[k])) {
                return (void *)1;
            }
            mine[k][0] = (uint8_t)a->seed;
        } else {
            if (mine[k][0] != (uint8_t)a->seed || kvd_pinned_free(a->pn, mine[k]) != 1) {
                return (void *)1;
            }
            mine[k] = NULL;
        }
        if (it % 97 == 0) {
            kvd_pinned_reap(a->pn);
        }
    }
    for (int k = 0; k < 64; k++) {
        if (mine[k] != NULL && kvd_pinned_free(a->pn, mine[k]) != 1) {
            return (void *)1;
        }
    }
    return NULL;
}

static void test_threads(void **state) {
    (void)state;
    reset();
    kvd_pinned *pn = kvd_pinned_new();
    pthread_t th[4];
    targ a[4];
    for (int i = 0; i < 4; i++) {
        a[i] = (targ){pn, i + 1};
        assert_int_equal(pthread_create(&th[i], NULL, churn, &a[i]), 0);
    }
    for (int i = 0; i < 4; i++) {
        void *r = NULL;
        assert_int_equal(pthread_join(th[i], &r), 0);
        assert_null(r);
    }
    kvd_pinned_reap(pn);
    assert_int_equal(live, 0);
    assert_int_equal(kvd_pinned_bytes(pn), 0);
    kvd_pinned_destroy(pn);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_alloc_free_reap),
        cmocka_unit_test(test_no_host_memory),
        cmocka_unit_test(test_threads),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
