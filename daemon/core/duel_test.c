/* Tests of kvd_duel (set dueling of an ADAPTIVE pool's leaf order): only picked requests feed
 * the minis; a scan over a reused working set makes the pool take never-reused leaves first and a
 * recency workload leaves it by age; the minis follow the pool's capacity up and down; a request
 * too long for the minis is skipped; bad arguments. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "daemon/core/duel.h"

typedef struct fixture {
    kvd_index *idx;
    kvd_pool *pool;
    kvd_duel *duel;
} fixture;

static void setup(fixture *f, uint32_t bps, uint32_t max_segments) {
    kvd_pool_config cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.pool_id = 1;
    assert_int_equal(kv_layout_init(1, 1, 8, 16, KV_DTYPE_FP16, KV_BLOCK_MAJOR, &cfg.layout),
                     KV_OK);
    cfg.blocks_per_segment = bps;
    cfg.max_segments = max_segments;
    cfg.policy = KVD_EVICT_ADAPTIVE;
    assert_int_equal(kvd_index_alloc(bps, &f->idx), KV_OK);
    assert_int_equal(kvd_pool_alloc(&cfg, f->idx, &kvd_backend_malloc, NULL, &f->pool), KV_OK);
    assert_int_equal(kvd_duel_alloc(&f->duel), KV_OK);
}

static void teardown(fixture *f) {
    assert_int_equal(kvd_duel_check(f->duel), KV_OK);
    kvd_duel_free(f->duel);
    kvd_pool_free(f->pool);
    kvd_index_free(f->idx);
}

static kv_hash128 H(uint64_t k) {
    kv_hash128 h = {k * 0xD6E8FEB86659FD93ull + 11, k};
    return h;
}

/* Fills h[0..len) with a chain named by id whose last hash is picked (want = 1) or not: block i
 * is H(id * 64 + i), the last one H of the first free number at or after id * 64 + len - 1 that
 * the sample rule answers as wanted (ids are spaced so that chains never meet). */
static void chain(uint64_t id, uint32_t len, int want, kv_hash128 *h) {
    for (uint32_t i = 0; i + 1 < len; i++) {
        h[i] = H(id * 64 + i);
    }
    uint64_t k = id * 64 + len - 1;
    while (kvd_duel_picks(H(k)) != want) {
        k++;
    }
    assert_true(k < id * 64 + 64);
    h[len - 1] = H(k);
}

/* kvd_duel_observe, then every queued request stepped (as the trace replay does). */
static kv_err observe(fixture *f, const kv_hash128 *h, size_t n, uint64_t now) {
    kv_err err = kvd_duel_observe(f->duel, h, n, now);
    while (err == KV_OK && kvd_duel_pending(f->duel) > 0) {
        err = kvd_duel_step(f->duel, f->pool);
    }
    return err;
}

static kvd_duel_stats stats(const fixture *f) {
    kvd_duel_stats st;
    kvd_duel_stats_get(f->duel, &st);
    return st;
}

static void test_only_picked_requests_feed_the_minis(void **state) {
    (void)state;
    fixture f;
    setup(&f, 64, 2);
    kv_hash128 h[4];
    for (uint64_t id = 1; id <= 20; id++) {
        chain(id, 4, 0, h);
        assert_int_equal(observe(&f, h, 4, id), KV_OK);
    }
    assert_int_equal(stats(&f).sampled, 0);
    assert_int_equal(stats(&f).mini_blocks, 0);
    for (uint64_t id = 21; id <= 30; id++) {
        chain(id, 4, 1, h);
        assert_int_equal(observe(&f, h, 4, id), KV_OK);
    }
    kvd_duel_stats st = stats(&f);
    assert_int_equal(st.sampled, 10);
    assert_int_equal(st.skipped, 0);
    assert_int_equal(st.mini_blocks, 2 * 32); /* half a segment, as many segments as the pool */
    assert_true(st.bytes > 2 * 64 * kvd_pool_meta_bytes_per_block());
    /* The pool itself was not touched: nothing allocated, nothing looked up. */
    kvd_pool_counts c = kvd_pool_counts_get(f.pool);
    assert_int_equal(c.cached, 0);
    assert_int_equal(kvd_pool_resident_segments(f.pool), 0);
    teardown(&f);
}

/* A working set of 8 chains of 4 blocks asked twice every round, between rounds 16 one-off
 * chains: 96 distinct blocks a round against minis of 64. By age every working chain is gone
 * before its next round (only the second ask hits); with never-reused leaves first the one-offs
 * make room for each other and both asks hit. */
static void scan_rounds(fixture *f, int rounds, uint64_t *fresh, uint64_t *now) {
    kv_hash128 h[4];
    for (int round = 0; round < rounds; round++) {
        for (int twice = 0; twice < 2; twice++) {
            for (uint64_t w = 1; w <= 8; w++) {
                chain(w, 4, 1, h);
                assert_int_equal(observe(f, h, 4, ++*now), KV_OK);
            }
        }
        for (int s = 0; s < 16; s++) {
            chain((*fresh)++, 4, 1, h);
            assert_int_equal(observe(f, h, 4, ++*now), KV_OK);
        }
        assert_int_equal(kvd_duel_check(f->duel), KV_OK);
    }
}

static void test_scan_over_working_set_takes_unreused_first(void **state) {
    (void)state;
    fixture f;
    setup(&f, 64, 2);
    uint64_t fresh = 1000, now = 0;
    scan_rounds(&f, 40, &fresh, &now);
    kvd_duel_stats st = stats(&f);
    assert_int_equal(st.sampled, 40 * 32);
    assert_true(st.score[1] > st.score[0] * 1.5);
    assert_int_equal(st.order, KVD_LEAF_ORDER_UNREUSED_FIRST);
    assert_int_equal(st.switches, 1);
    assert_int_equal(kvd_pool_leaf_order(f.pool), KVD_LEAF_ORDER_UNREUSED_FIRST);
    teardown(&f);
}

/* A request too long for the minis (more than half of one) sends the pool back to its order by
 * age at once, and the minis are trusted again only after KVD_DUEL_DECAY picked requests in a
 * row that fit. */
static void test_too_long_request_distrusts_the_minis(void **state) {
    (void)state;
    fixture f;
    setup(&f, 64, 2);
    uint64_t fresh = 1000, now = 0;
    scan_rounds(&f, 40, &fresh, &now);
    assert_int_equal(kvd_pool_leaf_order(f.pool), KVD_LEAF_ORDER_UNREUSED_FIRST);
    kv_hash128 h[40];
    chain(900, 40, 1, h); /* minis of 64 blocks: 40 is too long */
    assert_int_equal(observe(&f, h, 40, ++now), KV_OK);
    assert_int_equal(kvd_pool_leaf_order(f.pool), KVD_LEAF_ORDER_AGE);
    assert_int_equal(stats(&f).skipped, 1);
    scan_rounds(&f, 15, &fresh, &now); /* 480 picked requests: not yet */
    assert_int_equal(kvd_pool_leaf_order(f.pool), KVD_LEAF_ORDER_AGE);
    assert_int_equal(stats(&f).order, KVD_LEAF_ORDER_AGE);
    scan_rounds(&f, 1, &fresh, &now); /* 512 */
    assert_int_equal(kvd_pool_leaf_order(f.pool), KVD_LEAF_ORDER_UNREUSED_FIRST);
    assert_int_equal(stats(&f).switches, 3);
    teardown(&f);
}

/* A reused working set that goes stale, then a stream of new chains each asked again five
 * chains later: by age the stale set ages out and every second ask hits; with never-reused leaves
 * first the stale set stays and each new chain is evicted before its second ask. The pool keeps
 * (or goes back to) its order by age. */
static void test_recency_workload_stays_by_age(void **state) {
    (void)state;
    fixture f;
    setup(&f, 64, 2);
    kv_hash128 h[4];
    uint64_t now = 0;
    for (int pass = 0; pass < 3; pass++) {
        for (uint64_t w = 1; w <= 12; w++) {
            chain(w, 4, 1, h);
            assert_int_equal(observe(&f, h, 4, ++now), KV_OK);
        }
    }
    for (uint64_t t = 0; t < 400; t++) {
        chain(100 + t, 4, 1, h);
        assert_int_equal(observe(&f, h, 4, ++now), KV_OK);
        if (t >= 5) {
            chain(100 + t - 5, 4, 1, h);
            assert_int_equal(observe(&f, h, 4, ++now), KV_OK);
        }
    }
    kvd_duel_stats st = stats(&f);
    assert_int_equal(st.sampled, 36 + 400 + 395);
    assert_true(st.score[0] > st.score[1] * 1.5);
    assert_int_equal(st.order, KVD_LEAF_ORDER_AGE);
    assert_int_equal(kvd_pool_leaf_order(f.pool), KVD_LEAF_ORDER_AGE);
    teardown(&f);
}

/* The minis are as large as the pool may become; when its limit falls they give back segments
 * (and what those held) and stay consistent; when it rises again they grow. */
static void test_minis_follow_the_pool_capacity(void **state) {
    (void)state;
    fixture f;
    setup(&f, 64, 4);
    kv_hash128 h[4];
    uint64_t fresh = 1, now = 0;
    for (int i = 0; i < 40; i++) { /* 160 blocks: every mini segment in use */
        chain(fresh++, 4, 1, h);
        assert_int_equal(observe(&f, h, 4, ++now), KV_OK);
    }
    assert_int_equal(stats(&f).mini_blocks, 4 * 32);
    uint64_t big = stats(&f).bytes;
    kvd_pool_set_max_segments(f.pool, 1);
    chain(fresh++, 4, 1, h);
    assert_int_equal(observe(&f, h, 4, ++now), KV_OK);
    assert_int_equal(stats(&f).mini_blocks, 32);
    assert_true(stats(&f).bytes < big);
    assert_int_equal(kvd_duel_check(f.duel), KV_OK);
    for (int i = 0; i < 20; i++) {
        chain(fresh++, 4, 1, h);
        assert_int_equal(observe(&f, h, 4, ++now), KV_OK);
    }
    kvd_pool_set_max_segments(f.pool, 3);
    for (int i = 0; i < 40; i++) {
        chain(fresh++, 4, 1, h);
        assert_int_equal(observe(&f, h, 4, ++now), KV_OK);
    }
    assert_int_equal(stats(&f).mini_blocks, 3 * 32);
    assert_int_equal(stats(&f).skipped, 0);
    teardown(&f);
}

static void test_request_too_long_is_skipped(void **state) {
    (void)state;
    fixture f;
    setup(&f, 16, 1); /* minis of 8 blocks: requests up to 4 */
    kv_hash128 h[8];
    chain(1, 5, 1, h);
    assert_int_equal(observe(&f, h, 5, 1), KV_OK);
    chain(2, 4, 1, h);
    assert_int_equal(observe(&f, h, 4, 2), KV_OK);
    kvd_duel_stats st = stats(&f);
    assert_int_equal(st.skipped, 1);
    assert_int_equal(st.sampled, 1);
    teardown(&f);
}

/* Picked requests wait for kvd_duel_step, in order; beyond KVD_DUEL_QUEUE requests (or
 * KVD_DUEL_QUEUE_BLOCKS blocks) waiting they are dropped and counted; freeing a duel with
 * requests waiting frees them (the sanitizer builds check). */
static void test_queue_bounds_and_drops(void **state) {
    (void)state;
    fixture f;
    setup(&f, 64, 2);
    kv_hash128 h[4];
    for (uint64_t id = 1; id <= KVD_DUEL_QUEUE + 6; id++) {
        chain(id, 4, 1, h);
        assert_int_equal(kvd_duel_observe(f.duel, h, 4, id), KV_OK);
    }
    kvd_duel_stats st = stats(&f);
    assert_int_equal(st.queued, KVD_DUEL_QUEUE);
    assert_int_equal(st.dropped, 6);
    assert_int_equal(st.sampled, 0);
    assert_int_equal(kvd_duel_pending(f.duel), KVD_DUEL_QUEUE);
    assert_int_equal(kvd_duel_step(f.duel, f.pool), KV_OK);
    assert_int_equal(kvd_duel_pending(f.duel), KVD_DUEL_QUEUE - 1);
    assert_int_equal(stats(&f).sampled, 1);
    while (kvd_duel_pending(f.duel) > 0) {
        assert_int_equal(kvd_duel_step(f.duel, f.pool), KV_OK);
    }
    st = stats(&f);
    assert_int_equal(st.sampled, KVD_DUEL_QUEUE);
    assert_int_equal(st.queued, 0);
    /* The first KVD_DUEL_QUEUE chains went in, in order: the last of them is still cached
     * (a hit of 4 blocks), the first one dropped was never seen (a miss). */
    double s0 = stats(&f).score[0];
    chain(KVD_DUEL_QUEUE, 4, 1, h);
    assert_int_equal(observe(&f, h, 4, 100), KV_OK);
    double s1 = stats(&f).score[0];
    assert_true(s1 > s0 * (1.0 - 1.0 / KVD_DUEL_DECAY) + 3.99 &&
                s1 < s0 * (1.0 - 1.0 / KVD_DUEL_DECAY) + 4.01);
    chain(KVD_DUEL_QUEUE + 1, 4, 1, h);
    assert_int_equal(observe(&f, h, 4, 101), KV_OK);
    double s2 = stats(&f).score[0];
    assert_true(s2 < s1 && s2 > s1 * (1.0 - 1.0 / KVD_DUEL_DECAY) - 0.01);
    teardown(&f);
    /* A block bound too: one long request fills it. */
    setup(&f, 64, 2);
    static kv_hash128 big[KVD_DUEL_QUEUE_BLOCKS];
    for (uint32_t i = 0; i < KVD_DUEL_QUEUE_BLOCKS; i++) {
        big[i] = H(1000000 + i);
    }
    uint64_t k = 5000000;
    while (!kvd_duel_picks(H(k))) {
        k++;
    }
    big[KVD_DUEL_QUEUE_BLOCKS - 1] = H(k);
    assert_int_equal(kvd_duel_observe(f.duel, big, KVD_DUEL_QUEUE_BLOCKS, 1), KV_OK);
    chain(1, 4, 1, h);
    assert_int_equal(kvd_duel_observe(f.duel, h, 4, 2), KV_OK);
    st = stats(&f);
    assert_int_equal(st.queued, 1);
    assert_int_equal(st.dropped, 1);
    kvd_duel_free(f.duel); /* with a request waiting */
    assert_int_equal(kvd_duel_alloc(&f.duel), KV_OK);
    teardown(&f);
}

static void test_bad_arguments(void **state) {
    (void)state;
    fixture f;
    setup(&f, 16, 1);
    assert_int_equal(kvd_duel_observe(f.duel, NULL, 3, 1), KV_EINVAL);
    assert_int_equal(kvd_duel_observe(f.duel, NULL, 0, 1), KV_OK);
    assert_int_equal(kvd_duel_step(f.duel, f.pool), KV_OK); /* nothing waiting */
    kvd_duel_free(NULL);
    teardown(&f);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_only_picked_requests_feed_the_minis),
        cmocka_unit_test(test_scan_over_working_set_takes_unreused_first),
        cmocka_unit_test(test_recency_workload_stays_by_age),
        cmocka_unit_test(test_minis_follow_the_pool_capacity),
        cmocka_unit_test(test_request_too_long_is_skipped),
        cmocka_unit_test(test_too_long_request_distrusts_the_minis),
        cmocka_unit_test(test_queue_bounds_and_drops),
        cmocka_unit_test(test_bad_arguments),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
