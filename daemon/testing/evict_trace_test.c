/* Trace tests for eviction: every seeded trace shape replayed against pools of every policy at
 * two sizes. Asserts correctness (every lookup result carries the asked hash, allocation never
 * fails while every other block is released, the pool invariants hold throughout) and a few
 * orderings of hit rates that must hold whatever the host (no online policy above Belady,
 * ADAPTIVE and its set dueling never below LRU, the dueling above ADAPTIVE on few-shot); the
 * figures themselves are the benchmark's. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

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
        kvd_trace_result lru, s3, pl, ad, opt;
        assert_int_equal(kvd_trace_replay(&t, KVD_EVICT_ADAPTIVE, sizes[s], 97, &ad), KV_OK);
        assert_int_equal(ad.query_blocks, t.off[t.nreq]);
        assert_true(ad.hit_blocks > 0);
        /* The leaf policies never cache a block behind a hole in its prefix, so no commit
         * finds its block already cached (the lookup would have hit it). */
        assert_int_equal(ad.duplicates, 0);
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
        assert_true(ad.hit_blocks <= opt.hit_blocks);
        assert_int_equal(s3.duplicates, 0);
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

static void test_agent_trace(void **state) {
    (void)state;
    check_trace(KVD_TRACE_AGENT, 2468);
}

static void test_rag_trace(void **state) {
    (void)state;
    check_trace(KVD_TRACE_RAG, 1357);
}

static void test_parallel_trace(void **state) {
    (void)state;
    check_trace(KVD_TRACE_PARALLEL, 9753);
}

static void test_shift_trace(void **state) {
    (void)state;
    check_trace(KVD_TRACE_SHIFT, 8642);
}

/* The regression of issue 20: S3-FIFO evicted blocks from the middle of cached prefixes, so a
 * later request re-committed blocks that were still cached behind the hole (505,890 such
 * commits in 30,000 agent-loop requests at 1%). Every leaf policy has none at small sizes,
 * where evictions are most frequent. */
static void test_s3fifo_evicts_tails_only(void **state) {
    (void)state;
    static const kvd_trace_kind kinds[] = {KVD_TRACE_AGENT, KVD_TRACE_CHAT, KVD_TRACE_FEWSHOT,
                                           KVD_TRACE_SESSIONS};
    for (size_t k = 0; k < sizeof(kinds) / sizeof(kinds[0]); k++) {
        kvd_trace t;
        assert_int_equal(kvd_trace_gen(kinds[k], 31 + k, 4000, &t), KV_OK);
        uint32_t cap = t.nkeys / 100 > t.max_len ? t.nkeys / 100 : t.max_len;
        kvd_trace_result s3, ad;
        assert_int_equal(kvd_trace_replay(&t, KVD_EVICT_S3FIFO, cap, 0, &s3), KV_OK);
        assert_int_equal(kvd_trace_replay(&t, KVD_EVICT_ADAPTIVE, cap, 0, &ad), KV_OK);
        assert_int_equal(s3.duplicates, 0);
        assert_int_equal(ad.duplicates, 0);
        kvd_trace_fini(&t);
    }
}

/* A trace written as a file and read back is the same trace (keys renumbered in order of first
 * appearance, which these generators already use for most keys: compare the structure). Bad
 * files are refused. */
/* ADAPTIVE, and ADAPTIVE with set dueling (kvd_trace_replay_duel), are never below LRU by more
 * than 0.5% on any shape at 1% and 3% of the distinct blocks (seeds other than the
 * benchmark's). Two regressions it guards: a ghost-driven bias that evicted conversations'
 * newest turns (0.91 of LRU on chat at 3%), and shared rounds taken one block at a time up a
 * shared chain, so that a forked agent context outlived everything else (0.73 of LRU on agent
 * loops at 3%). And the dueling earns its place: on few-shot prompts it beats plain ADAPTIVE by
 * at least 3% at both sizes (it picks the never-reused leaves first there), with no duplicate
 * commits and the minis' invariants checked along the way. */
static void test_adaptive_never_below_lru(void **state) {
    (void)state;
    static const kvd_trace_kind kinds[] = {
        KVD_TRACE_CHAT,  KVD_TRACE_SYSPROMPT, KVD_TRACE_SESSIONS, KVD_TRACE_FEWSHOT,
        KVD_TRACE_AGENT, KVD_TRACE_RAG,       KVD_TRACE_PARALLEL, KVD_TRACE_SHIFT};
    for (size_t k = 0; k < sizeof(kinds) / sizeof(kinds[0]); k++) {
        kvd_trace t;
        assert_int_equal(kvd_trace_gen(kinds[k], 91 + k, 8000, &t), KV_OK);
        static const double frac[2] = {0.01, 0.03};
        for (int f = 0; f < 2; f++) {
            uint32_t cap = (uint32_t)(t.nkeys * frac[f]);
            if (cap < t.max_len) {
                cap = t.max_len;
            }
            kvd_trace_result lru, ad, du;
            assert_int_equal(kvd_trace_replay(&t, KVD_EVICT_LRU, cap, 0, &lru), KV_OK);
            assert_int_equal(kvd_trace_replay(&t, KVD_EVICT_ADAPTIVE, cap, 0, &ad), KV_OK);
            assert_int_equal(kvd_trace_replay_duel(&t, cap, 2003, &du), KV_OK);
            if (ad.hit_blocks * 1000 < lru.hit_blocks * 995) {
                fail_msg("shape %d, cache %u: ADAPTIVE %llu hits, LRU %llu", (int)kinds[k], cap,
                         (unsigned long long)ad.hit_blocks, (unsigned long long)lru.hit_blocks);
            }
            if (du.hit_blocks * 1000 < lru.hit_blocks * 995) {
                fail_msg("shape %d, cache %u: dueling %llu hits, LRU %llu", (int)kinds[k], cap,
                         (unsigned long long)du.hit_blocks, (unsigned long long)lru.hit_blocks);
            }
            assert_int_equal(du.duplicates, 0);
            if (kinds[k] == KVD_TRACE_FEWSHOT && du.hit_blocks * 100 < ad.hit_blocks * 103) {
                fail_msg("few-shot, cache %u: dueling %llu hits, ADAPTIVE %llu", cap,
                         (unsigned long long)du.hit_blocks, (unsigned long long)ad.hit_blocks);
            }
            printf("# shape %d, cache %u: LRU %llu, ADAPTIVE %llu, dueling %llu hits\n",
                   (int)kinds[k], cap, (unsigned long long)lru.hit_blocks,
                   (unsigned long long)ad.hit_blocks, (unsigned long long)du.hit_blocks);
        }
        kvd_trace_fini(&t);
    }
}

static void test_trace_file_roundtrip(void **state) {
    (void)state;
    kvd_trace t, u;
    assert_int_equal(kvd_trace_gen(KVD_TRACE_RAG, 55, 800, &t), KV_OK);
    char path[] = "/tmp/kvd_trace_test_XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    close(fd);
    assert_int_equal(kvd_trace_save(&t, path), KV_OK);
    assert_int_equal(kvd_trace_load(path, &u), KV_OK);
    assert_int_equal(u.nreq, t.nreq);
    assert_int_equal(u.max_len, t.max_len);
    assert_memory_equal(u.off, t.off, ((size_t)t.nreq + 1) * sizeof(uint32_t));
    /* Same key where and only where the original had the same key. */
    uint32_t *map = malloc((size_t)t.nkeys * sizeof(uint32_t));
    assert_non_null(map);
    memset(map, 0xff, (size_t)t.nkeys * sizeof(uint32_t));
    uint32_t distinct = 0;
    for (uint32_t i = 0; i < t.off[t.nreq]; i++) {
        if (map[t.keys[i]] == UINT32_MAX) {
            map[t.keys[i]] = u.keys[i];
            distinct++;
        }
        assert_int_equal(map[t.keys[i]], u.keys[i]);
    }
    assert_int_equal(u.nkeys, distinct);
    free(map);
    kvd_trace_result a, b;
    assert_int_equal(kvd_trace_replay(&t, KVD_EVICT_LRU, t.max_len * 4, 0, &a), KV_OK);
    assert_int_equal(kvd_trace_replay(&u, KVD_EVICT_LRU, u.max_len * 4, 0, &b), KV_OK);
    assert_int_equal(a.hit_blocks, b.hit_blocks);
    kvd_trace_fini(&u);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs("# comment only\n\n", f);
    fclose(f);
    assert_int_equal(kvd_trace_load(path, &u), KV_EINVAL);
    f = fopen(path, "w");
    assert_non_null(f);
    fputs("00ff 12zz\n", f);
    fclose(f);
    assert_int_equal(kvd_trace_load(path, &u), KV_EINVAL);
    f = fopen(path, "w");
    assert_non_null(f);
    fputs("  AbC1 # the first block\nabc1\tdd  \n", f);
    fclose(f);
    assert_int_equal(kvd_trace_load(path, &u), KV_OK);
    assert_int_equal(u.nreq, 2);
    assert_int_equal(u.nkeys, 2);
    assert_int_equal(u.keys[0], u.keys[1]); /* case-insensitive */
    kvd_trace_fini(&u);
    unlink(path);
    assert_int_equal(kvd_trace_load(path, &u), KV_ENOENT);
    kvd_trace_fini(&t);
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
    kvd_trace_result lru, s3, pl, ad, opt;
    assert_int_equal(kvd_trace_replay(&t, KVD_EVICT_ADAPTIVE, t.nkeys, 50, &ad), KV_OK);
    assert_int_equal(kvd_trace_replay(&t, KVD_EVICT_LRU, t.nkeys, 50, &lru), KV_OK);
    assert_int_equal(kvd_trace_replay(&t, KVD_EVICT_S3FIFO, t.nkeys, 50, &s3), KV_OK);
    assert_int_equal(kvd_trace_replay(&t, KVD_EVICT_PREFIX_LRU, t.nkeys, 50, &pl), KV_OK);
    assert_int_equal(kvd_trace_belady(&t, t.nkeys, &opt), KV_OK);
    assert_int_equal(lru.hit_blocks, opt.hit_blocks);
    assert_int_equal(s3.hit_blocks, opt.hit_blocks);
    assert_int_equal(pl.hit_blocks, opt.hit_blocks);
    assert_int_equal(ad.hit_blocks, opt.hit_blocks);
    kvd_trace_fini(&t);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_chat_trace),
        cmocka_unit_test(test_sysprompt_trace),
        cmocka_unit_test(test_sessions_trace),
        cmocka_unit_test(test_fewshot_trace),
        cmocka_unit_test(test_agent_trace),
        cmocka_unit_test(test_rag_trace),
        cmocka_unit_test(test_parallel_trace),
        cmocka_unit_test(test_shift_trace),
        cmocka_unit_test(test_s3fifo_evicts_tails_only),
        cmocka_unit_test(test_adaptive_never_below_lru),
        cmocka_unit_test(test_trace_file_roundtrip),
        cmocka_unit_test(test_trace_shapes),
        cmocka_unit_test(test_unbounded_cache_matches_optimum),
    };
    return cmocka_run_group_tests_name("kvd_evict_trace", tests, NULL, NULL);
}
