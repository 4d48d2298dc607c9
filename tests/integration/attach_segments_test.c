/* attach_segments_test: attaching a pool whose segments are all parked while another pool holds
 * the whole memory budget. kvd runs with pool-memory = 8 segments. Model A fills the budget and
 * releases; model B allocates all of it, which parks every segment of A. A new session then
 * attaches A's model: the pool has no resident segment and no budget left, so its own segment
 * limit is 0, yet the attach must succeed (the soak saw KV_EPROTO "AttachPoolReply without
 * layout or geometry" for every new worker of such a tenant) and map A's parked segments. Its
 * allocate is ENOSPC while B holds everything, and works through the new mapping once B lets go.
 * A raw AttachPool checks the wire value itself: max_segments >= the segments sent, and >= 1. */
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "tests/integration/kvd_harness.h"

static kvd_harness H;

/* 16 KiB blocks, 1 MiB segments of 64 blocks, a budget of 8 MiB of segments plus the block
 * records of 16 segments (a parked segment keeps its records: 64 x 64 bytes) and two pools'
 * metadata (4 KiB each): 512 blocks over all pools. */
#define SEGS 8
#define BPS 64
/* 8 segments and both pools' metadata (records, the eviction ghost), less than a 9th segment. */
static const char *const FLAGS[] = {"--pool-memory=8320K", "--segment-bytes=1M", NULL};

static int setup(void **state) {
    (void)state;
    signal(SIGPIPE, SIG_IGN);
    return kvd_harness_start(&H, FLAGS);
}

static int teardown(void **state) {
    (void)state;
    return kvd_harness_finish(&H);
}

static void test_attach_fully_parked_pool(void **state) {
    (void)state;
    kv_layout l = kvd_harness_layout();
    kvc_conn *ca, *cb, *cn;
    kvc_pool *pa, *pb, *pn;
    static kvc_block a[SEGS * BPS], b[SEGS * BPS];

    /* A takes the whole budget and lets it all go. */
    assert_int_equal(kvd_harness_connect(&H, "attach-a", &ca), KV_OK);
    assert_int_equal(kvc_pool_attach(ca, "attach-seg-a", &l, &pa), KV_OK);
    uint32_t ida = kvc_pool_id(pa);
    assert_int_equal(kvd_harness_alloc_all(pa, a, SEGS * BPS, BPS), KV_OK);
    assert_int_equal(kvc_release(pa, a, SEGS * BPS), KV_OK);

    /* B takes the whole budget: every segment of A is parked. */
    assert_int_equal(kvd_harness_connect(&H, "attach-b", &cb), KV_OK);
    assert_int_equal(kvc_pool_attach(cb, "attach-seg-b", &l, &pb), KV_OK);
    uint32_t idb = kvc_pool_id(pb);
    assert_int_equal(kvd_harness_alloc_all(pb, b, SEGS * BPS, BPS), KV_OK);
    assert_int_equal(kvd_harness_stat(ca, ida, "pool.segments_parked"), SEGS);
    assert_int_equal(kvd_harness_stat(ca, ida, "pool.bytes"), 0);

    /* A new worker of A's model attaches: the pool may not grow now, but attach works and maps
     * the parked segments (they keep their slots and fds). */
    assert_int_equal(kvd_harness_connect(&H, "attach-new", &cn), KV_OK);
    kv_err rc = kvc_pool_attach(cn, "attach-seg-a", &l, &pn);
    if (rc != KV_OK) {
        fail_msg("attach of a fully parked pool: %s: %s", kv_strerror(rc), kvc_last_error(cn));
    }
    assert_int_equal(kvc_pool_id(pn), ida);
    assert_int_equal(kvc_pool_segments(pn), SEGS);
    for (uint32_t s = 0; s < SEGS; s++) {
        assert_non_null(kvc_pool_segment_base(pn, s, NULL));
    }
    kvc_block one;
    assert_int_equal(kvc_allocate(pn, 1, &one), KV_ENOSPC);

    /* B lets go; the new session allocates through the mapping the attach gave it. */
    assert_int_equal(kvc_release(pb, b, SEGS * BPS), KV_OK);
    assert_int_equal(kvd_harness_stat(cb, idb, "pool.segments_parked"), 0);
    assert_int_equal(kvd_harness_alloc_all(pn, a, SEGS * BPS, BPS), KV_OK);
    assert_int_equal(kvc_pool_segments(pn), SEGS); /* the same segments, no new ones */
    for (uint32_t i = 0; i < SEGS * BPS; i += 37) {
        uint8_t *w = kvc_pool_addr(pn, a[i].id, 1, KV_V, 15, 1);
        uint8_t *r = kvc_pool_addr(pa, a[i].id, 1, KV_V, 15, 1);
        assert_non_null(w);
        assert_non_null(r);
        w[0] = (uint8_t)(0x40 + i % 64);
        assert_int_equal(r[0], 0x40 + i % 64); /* the same memory through the first session */
    }
    assert_int_equal(kvc_release(pn, a, SEGS * BPS), KV_OK);
    kvc_conn_close(cn);
    kvc_conn_close(cb);
    kvc_conn_close(ca);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_attach_fully_parked_pool),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
