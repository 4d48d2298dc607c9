/* rebalance_test: memory moves between pools through parking, and clients' mappings survive it.
 * kvd runs with pool-memory = 8 segments. Model A fills all of it, writes every block through
 * its mapping and releases; model B attaches and allocates the whole budget, which succeeds only
 * by parking A's idle segments; the memory really goes back (this process's RssShmem drops by
 * what A had touched) while A's mapping stays valid and reads zeros. While B holds everything,
 * A gets ENOSPC (no pool has idle memory). Once B releases, A allocates the whole budget again
 * (B's segments are parked for it, A's own are unparked) and its old mapping works for writes. */
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

/* This process's resident shared memory (memfd pages it has mapped and touched), in bytes. */
static uint64_t rss_shmem(void) {
    FILE *f = fopen("/proc/self/status", "r");
    assert_non_null(f);
    char line[256];
    uint64_t kb = 0;
    while (fgets(line, sizeof(line), f) != NULL) {
        if (strncmp(line, "RssShmem:", 9) == 0) {
            kb = strtoull(line + 9, NULL, 10);
        }
    }
    fclose(f);
    return kb * 1024;
}

static void fill_segments(kvc_pool *p, uint8_t byte) {
    for (uint32_t s = 0; s < kvc_pool_segments(p); s++) {
        uint32_t nblocks = 0;
        uint8_t *base = kvc_pool_segment_base(p, s, &nblocks);
        assert_non_null(base);
        memset(base, byte, (size_t)nblocks * kvc_pool_layout(p)->block_bytes);
    }
}

static void test_rebalance(void **state) {
    (void)state;
    kv_layout l = kvd_harness_layout();
    kvc_conn *ca, *cb;
    kvc_pool *pa, *pb;
    static kvc_block a[SEGS * BPS], b[SEGS * BPS];
    assert_int_equal(kvd_harness_connect(&H, "model-a", &ca), KV_OK);
    assert_int_equal(kvc_pool_attach(ca, "rebalance-a", &l, &pa), KV_OK);
    assert_int_equal(kvc_pool_blocks_per_segment(pa), BPS);
    uint32_t ida = kvc_pool_id(pa);

    /* A takes the whole budget, touches every page, and lets it all go. */
    assert_int_equal(kvd_harness_alloc_all(pa, a, SEGS * BPS, BPS), KV_OK);
    assert_int_equal(kvc_pool_segments(pa), SEGS);
    uint64_t rss_before = rss_shmem();
    fill_segments(pa, 0xab);
    uint64_t rss_filled = rss_shmem();
    assert_true(rss_filled >= rss_before + (uint64_t)(SEGS - 1) * (1u << 20));
    assert_int_equal(kvc_release(pa, a, SEGS * BPS), KV_OK);
    assert_int_equal(kvd_harness_stat(ca, ida, "pool.segments_parked"), 0);

    /* B attaches and takes the whole budget: A's idle segments are parked for it. */
    assert_int_equal(kvd_harness_connect(&H, "model-b", &cb), KV_OK);
    assert_int_equal(kvc_pool_attach(cb, "rebalance-b", &l, &pb), KV_OK);
    uint32_t idb = kvc_pool_id(pb);
    assert_int_equal(kvd_harness_alloc_all(pb, b, SEGS * BPS, BPS), KV_OK);
    assert_int_equal(kvd_harness_stat(ca, ida, "pool.segments_parked"), SEGS);
    assert_int_equal(kvd_harness_stat(ca, ida, "pool.blocks_parked"), SEGS * BPS);
    assert_int_equal(kvd_harness_stat(ca, ida, "pool.bytes"), 0);
    assert_int_equal(kvd_harness_stat(cb, idb, "pool.segments"), SEGS);
    /* The memory A touched went back to the system; A's mapping is still there, reading zeros. */
    uint64_t rss_parked = rss_shmem();
    printf("# RssShmem: %llu before, %llu with A written, %llu after parking A\n",
           (unsigned long long)rss_before, (unsigned long long)rss_filled,
           (unsigned long long)rss_parked);
    assert_true(rss_parked + (uint64_t)(SEGS - 1) * (1u << 20) <= rss_filled);
    for (uint32_t s = 0; s < SEGS; s++) {
        uint32_t nblocks = 0;
        uint8_t *base = kvc_pool_segment_base(pa, s, &nblocks);
        assert_non_null(base);
        assert_int_equal(base[0], 0);
        assert_int_equal(base[(size_t)nblocks * kvc_pool_layout(pa)->block_bytes - 1], 0);
    }

    /* B holds everything: A cannot have a block, and says why. */
    kvc_block one;
    assert_int_equal(kvc_allocate(pa, 1, &one), KV_ENOSPC);

    /* B lets go; A allocates the whole budget again through its old mapping. */
    assert_int_equal(kvc_release(pb, b, SEGS * BPS), KV_OK);
    assert_int_equal(kvd_harness_alloc_all(pa, a, SEGS * BPS, BPS), KV_OK);
    assert_int_equal(kvc_pool_segments(pa), SEGS); /* the same segments, no new ones */
    assert_int_equal(kvd_harness_stat(ca, ida, "pool.segments_parked"), 0);
    assert_int_equal(kvd_harness_stat(cb, idb, "pool.segments_parked"), SEGS);
    fill_segments(pa, 0xcd);
    uint8_t *base0 = kvc_pool_segment_base(pa, 0, NULL);
    assert_int_equal(base0[12345], 0xcd);
    assert_int_equal(kvc_release(pa, a, SEGS * BPS), KV_OK);
    kvc_conn_close(cb);
    kvc_conn_close(ca);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rebalance),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
