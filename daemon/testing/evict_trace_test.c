/* Trace tests for eviction: seeded multi-turn chat and shared-system-prompt traces replayed
 * against pools of both policies at two sizes. Asserts correctness only (every lookup result
 * carries the asked hash, allocation never fails while every other block is released, the pool
 * invariants hold throughout), not hit rates: those are benchmark figures. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "daemon/testing/evict_trace.h"

static void check_trace(kvd_trace_kind kind, uint64_t seed) {
    kvd_trace t;
    assert_int_equal(kvd_trace_gen(kind, seed, 3000, &t), KV_OK);
    assert_int_equal(t.nreq, 3000);
    assert_true(t.max_len > 0);
    /* Same seed, same trace. */
    kvd_trace t2;
    assert_int_equal(kvd_trace_gen(kind, seed, 3000, &t2), KV_OK);
    assert_int_equal(t2.off[t2.nreq], t.off[t.nreq]);
    assert_memory_equal(t2.keys, t.keys, t.off[t.nreq] * sizeof(uint32_t));
    kvd_trace_fini(&t2);
    for (uint32_t i = 0; i < t.off[t.nreq]; i++) {
        assert_true(t.keys[i] < t.nkeys);
    }
    uint32_t sizes[2] = {t.max_len, t.max_len * 8};
    for (int s = 0; s < 2; s++) {
        kvd_trace_result lru, s3, pl, opt;
        assert_int_equal(kvd_trace_replay(&t, KVD_EVICT_LRU, sizes[s], 97, &lru), KV_OK);
        assert_int_equal(kvd_trace_replay(&t, KVD_EVICT_S3FIFO, sizes[s], 97, &s3), KV_OK);
        assert_int_equal(kvd_trace_replay(&t, KVD_EVICT_PREFIX_LRU, sizes[s], 97, &pl), KV_OK);
        assert_int_equal(pl.query_blocks, t.off[t.nreq]);
        assert_true(pl.hit_blocks > 0);
        assert_int_equal(kvd_trace_belady(&t, sizes[s], &opt), KV_OK);
        assert_int_equal(lru.query_blocks, t.off[t.nreq]);
        assert_int_equal(s3.query_blocks, t.off[t.nreq]);
        assert_int_equal(opt.query_blocks, t.off[t.nreq]);
        assert_true(lru.hit_blocks > 0);
        assert_true(s3.hit_blocks > 0);
        assert_true(opt.hit_blocks > 0);
        /* No online policy beats the offline optimum. */
        assert_true(lru.hit_blocks <= opt.hit_blocks);
        assert_true(s3.hit_blocks <= opt.hit_blocks);
        assert_true(pl.hit_blocks <= opt.hit_blocks);
    }
    /* A pool smaller than the longest request cannot serve the trace. */
    kvd_trace_result r;
    assert_int_equal(kvd_trace_replay(&t, KVD_EVICT_LRU, t.max_len - 1, 0, &r), KV_EINVAL);
    kvd_trace_fini(&t);
}

static void test_chat_trace(void **state) {
    (void)state;
    check_trace(KVD_TRACE_CHAT, 1234);
}

static void test_sysprompt_trace(void **state) {
    (void)state;
    check_trace(KVD_TRACE_SYSPROMPT, 5678);
}

static void test_sessions_trace(void **state) {
    (void)state;
    check_trace(KVD_TRACE_SESSIONS, 4321);
}

static void test_fewshot_trace(void **state) {
    (void)state;
    check_trace(KVD_TRACE_FEWSHOT, 8765);
}

/* Shapes the generators promise: chat sessions re-send their history (a request that is not a
 * conversation's first turn starts with an earlier request's blocks); few-shot requests share
 * their instruction with others; an unknown kind is refused. */
static void test_trace_shapes(void **state) {
    (void)state;
    kvd_trace t;
    assert_int_equal(kvd_trace_gen((kvd_trace_kind)99, 1, 10, &t), KV_EINVAL);
    assert_int_equal(kvd_trace_gen(KVD_TRACE_SESSIONS, 1, 0, &t), KV_EINVAL);
    assert_int_equal(kvd_trace_gen(KVD_TRACE_SESSIONS, 77, 2000, &t), KV_OK);
    uint32_t continued = 0;
    for (uint32_t q = 1; q < t.nreq; q++) {
        uint32_t n = t.off[q + 1] - t.off[q];
        assert_true(n >= 6 && n <= 128); /* system prompt + at least one turn, window cap */
        continued += n > 4 + 16;         /* longer than any first turn */
    }
    assert_true(continued > 0);
    kvd_trace_fini(&t);
    assert_int_equal(kvd_trace_gen(KVD_TRACE_FEWSHOT, 78, 2000, &t), KV_OK);
    uint32_t same_first = 0;
    for (uint32_t q = 1; q < t.nreq; q++) {
        same_first += t.keys[t.off[q]] == t.keys[t.off[q - 1]];
        assert_true(t.off[q + 1] - t.off[q] >= 2 + 4 + 1);
    }
    assert_true(same_first > 100); /* popular instructions recur */
    kvd_trace_fini(&t);
}

/* With room for every key, each policy hits exactly what Belady hits: nothing is evicted. */
static void test_unbounded_cache_matches_optimum(void **state) {
    (void)state;
    kvd_trace t;
    assert_int_equal(kvd_trace_gen(KVD_TRACE_SYSPROMPT, 9, 500, &t), KV_OK);
    kvd_trace_result lru, s3, pl, opt;
    assert_int_equal(kvd_trace_replay(&t, KVD_EVICT_LRU, t.nkeys, 50, &lru), KV_OK);
    assert_int_equal(kvd_trace_replay(&t, KVD_EVICT_S3FIFO, t.nkeys, 50, &s3), KV_OK);
    assert_int_equal(kvd_trace_replay(&t, KVD_EVICT_PREFIX_LRU, t.nkeys, 50, &pl), KV_OK);
    assert_int_equal(kvd_trace_belady(&t, t.nkeys, &opt), KV_OK);
    assert_int_equal(lru.hit_blocks, opt.hit_blocks);
    assert_int_equal(s3.hit_blocks, opt.hit_blocks);
    assert_int_equal(pl.hit_blocks, opt.hit_blocks);
    kvd_trace_fini(&t);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_chat_trace),
        cmocka_unit_test(test_sysprompt_trace),
        cmocka_unit_test(test_sessions_trace),
        cmocka_unit_test(test_fewshot_trace),
        cmocka_unit_test(test_trace_shapes),
        cmocka_unit_test(test_unbounded_cache_matches_optimum),
    };
    return cmocka_run_group_tests_name("kvd_evict_trace", tests, NULL, NULL);
}
