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

#include "daemon/evict_trace.h"

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
        kvd_trace_result lru, s3, opt;
        assert_int_equal(kvd_trace_replay(&t, KVD_EVICT_LRU, sizes[s], 97, &lru), KV_OK);
        assert_int_equal(kvd_trace_replay(&t, KVD_EVICT_S3FIFO, sizes[s], 97, &s3), KV_OK);
        assert_int_equal(kvd_trace_belady(&t, sizes[s], &opt), KV_OK);
        assert_int_equal(lru.query_blocks, t.off[t.nreq]);
        assert_int_equal(s3.query_blocks, t.off[t.nreq]);
        assert_int_equal(opt.query_blocks, t.off[t.nreq]);
        assert_true(lru.hit_blocks > 0);
        assert_true(s3.hit_blocks > 0);
        assert_true(opt.hit_blocks > 0);
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

/* With room for every key, each policy hits exactly what Belady hits: nothing is evicted. */
static void test_unbounded_cache_matches_optimum(void **state) {
    (void)state;
    kvd_trace t;
    assert_int_equal(kvd_trace_gen(KVD_TRACE_SYSPROMPT, 9, 500, &t), KV_OK);
    kvd_trace_result lru, s3, opt;
    assert_int_equal(kvd_trace_replay(&t, KVD_EVICT_LRU, t.nkeys, 50, &lru), KV_OK);
    assert_int_equal(kvd_trace_replay(&t, KVD_EVICT_S3FIFO, t.nkeys, 50, &s3), KV_OK);
    assert_int_equal(kvd_trace_belady(&t, t.nkeys, &opt), KV_OK);
    assert_int_equal(lru.hit_blocks, opt.hit_blocks);
    assert_int_equal(s3.hit_blocks, opt.hit_blocks);
    kvd_trace_fini(&t);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_chat_trace),
        cmocka_unit_test(test_sysprompt_trace),
        cmocka_unit_test(test_unbounded_cache_matches_optimum),
    };
    return cmocka_run_group_tests_name("kvd_evict_trace", tests, NULL, NULL);
}
