/* Integration: kvd evicts as the trace replay says. Two traces (few-shot from shared examples,
 * where dueling changes the order, and multi-turn chat, where it does not) go through a real kvd
 * over libkvclient, one call at a time, into a pool of exactly 1% of their distinct blocks, with
 * evict-duel off and on; kvd's hits must equal the in-process replay's (kvd_trace_replay ADAPTIVE,
 * kvd_trace_replay_duel) block for block. What made them differ once: ages in milliseconds (a
 * busy daemon's requests tied), one age per trace request instead of one per call. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "daemon/testing/evict_trace.h"
#include "daemon/testing/trace_kvc.h"
#include "tests/integration/kvd_harness.h"

#define NREQ 3000

/* The trace through a fresh kvd with one pool of cap blocks (trace_kvc.h), evict-duel on or
 * off. */
static kvd_trace_result through_kvd(const kvd_trace *t, uint32_t cap, int duel) {
    char seg[64], mem[64];
    kvd_trace_kvc_flags(cap, seg, mem);
    const char *flags[] = {seg, mem, duel ? "--evict-duel=true" : "--evict-duel=false", NULL};
    kvd_harness h;
    assert_int_equal(kvd_harness_start(&h, flags), 0);
    kvc_conn *c;
    assert_int_equal(kvd_harness_connect(&h, "evict_replay_test", &c), KV_OK);
    kv_layout l = kvd_trace_kvc_layout();
    kvc_pool *p;
    assert_int_equal(kvc_pool_attach(c, "replay", &l, &p), KV_OK);
    assert_int_equal(kvd_harness_stat(c, kvc_pool_id(p), "pool.blocks_total"), cap);
    kvd_trace_result r;
    assert_int_equal(kvd_trace_replay_kvc(p, t, &r), KV_OK);
    kvc_conn_close(c);
    assert_int_equal(kvd_harness_finish(&h), 0);
    return r;
}

static void check_kind(kvd_trace_kind kind, uint64_t seed, int expect_duel_gain) {
    kvd_trace t;
    assert_int_equal(kvd_trace_gen(kind, seed, NREQ, &t), KV_OK);
    uint32_t cap = (uint32_t)(t.nkeys / 100);
    cap = cap < t.max_len ? t.max_len : cap;
    cap += cap % 2; /* 4 KiB blocks are 2 KiB K and V halves: kvd takes an even count a page */
    kvd_trace_result ad, du;
    assert_int_equal(kvd_trace_replay(&t, KVD_EVICT_ADAPTIVE, cap, 0, &ad), KV_OK);
    assert_int_equal(kvd_trace_replay_duel(&t, cap, 0, &du), KV_OK);
    kvd_trace_result off = through_kvd(&t, cap, 0), on = through_kvd(&t, cap, 1);
    fprintf(stderr, "kind %d cap %u: in-process %llu / %llu (duel), kvd %llu / %llu of %llu\n",
            (int)kind, cap, (unsigned long long)ad.hit_blocks, (unsigned long long)du.hit_blocks,
            (unsigned long long)off.hit_blocks, (unsigned long long)on.hit_blocks,
            (unsigned long long)ad.query_blocks);
    assert_int_equal(off.query_blocks, ad.query_blocks);
    assert_int_equal(off.hit_blocks, ad.hit_blocks);
    assert_int_equal(on.hit_blocks, du.hit_blocks);
    if (expect_duel_gain) {
        assert_true(on.hit_blocks > off.hit_blocks * 105 / 100);
    }
    kvd_trace_fini(&t);
}

static void test_fewshot_hits_as_replayed(void **state) {
    (void)state;
    check_kind(KVD_TRACE_FEWSHOT, 20240604, 1);
}

static void test_chat_hits_as_replayed(void **state) {
    (void)state;
    check_kind(KVD_TRACE_CHAT, 20240601, 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fewshot_hits_as_replayed),
        cmocka_unit_test(test_chat_hits_as_replayed),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
