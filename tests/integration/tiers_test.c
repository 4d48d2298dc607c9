/* Integration: libkvclient's lower-tier calls against a real kvd with tier 1 on (issue 14). A
 * chain committed and then pushed out of the pool by other chains comes back: kvc_lookup_tiers
 * reports the run below T0, kvc_fetch brings it into T0 with the bytes as written, a batched
 * fetch completes beside a ping, and the sequence helper's prefill fetches it by itself. A
 * second daemon without tiers answers kvc_fetch as a lookup. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "tests/integration/kvd_harness.h"

#define NB 8 /* blocks of the chain under test */

static kvd_harness h;

static int group_setup(void **state) {
    (void)state;
    /* 16 KiB blocks (kvd_harness_layout), 16 a segment: a pool of 3 segments, flooded below. */
    const char *flags[] = {"--pool-memory=900K",    "--segment-bytes=256K",
                           "--tier1-memory=16M",    "--tier-write=write-through",
                           "--fetch-min-tokens=16", NULL};
    return kvd_harness_start(&h, flags);
}

static int group_teardown(void **state) {
    (void)state;
    return kvd_harness_finish(&h);
}

static uint16_t value(uint32_t chain, uint32_t block, uint64_t i) {
    uint64_t x = (uint64_t)chain * 0x9e3779b97f4a7c15ull ^ (uint64_t)block << 40 ^ i;
    x ^= x >> 31;
    x *= 0xbf58476d1ce4e5b9ull;
    return (uint16_t)(x ^ x >> 29);
}

/* Writes (check 0) or counts mismatches (check 1) of every element of block b. */
static uint64_t touch(kvc_pool *p, uint32_t id, uint32_t chain, uint32_t b, int check) {
    const kv_layout *l = kvc_pool_layout(p);
    uint64_t bad = 0, i = 0;
    for (uint32_t layer = 0; layer < l->num_layers; layer++) {
        for (int kv = KV_K; kv <= KV_V; kv++) {
            for (uint32_t t = 0; t < l->tokens_per_block; t++) {
                for (uint32_t hd = 0; hd < l->num_kv_heads; hd++) {
                    uint16_t *e = kvc_pool_addr(p, id, layer, kv, t, hd);
                    for (uint32_t d = 0; d < l->head_dim; d++, i++) {
                        uint16_t v = value(chain, b, i);
                        if (check) {
                            bad += e[d] != v;
                        } else {
                            e[d] = v;
                        }
                    }
                }
            }
        }
    }
    return bad;
}

static void chain_hashes(kvc_pool *p, uint32_t chain, uint32_t nb, kv_hash128 *out) {
    uint32_t tok[NB * 16];
    uint32_t tpb = kvc_pool_layout(p)->tokens_per_block;
    for (uint32_t i = 0; i < nb * tpb; i++) {
        tok[i] = chain * 100000 + i;
    }
    size_t n = 0;
    assert_int_equal(kvc_pool_hash_tokens(p, NULL, 0, tok, nb * tpb, out, nb, &n), KV_OK);
    assert_int_equal(n, nb);
}

/* Allocates, writes, commits and releases chain `chain` of nb blocks. */
static void put_chain(kvc_pool *p, uint32_t chain, uint32_t nb) {
    kvc_block blk[NB], canon[NB];
    kv_hash128 hs[NB];
    chain_hashes(p, chain, nb, hs);
    /* Blocks being copied down carry a tier lease and cannot be evicted meanwhile: on a busy
     * machine an Allocate may find too few evictable blocks for a moment. */
    kv_err err = kvc_allocate(p, nb, blk);
    for (int tries = 0; err == KV_ENOSPC && tries < 500; tries++) {
        kvd_harness_sleep_ms(10);
        err = kvc_allocate(p, nb, blk);
    }
    assert_int_equal(err, KV_OK);
    kvc_commit_entry e[NB];
    for (uint32_t b = 0; b < nb; b++) {
        touch(p, blk[b].id, chain, b, 0);
        e[b].block = blk[b];
        e[b].hash = hs[b];
        e[b].parent = b == 0 ? KVC_NO_PARENT : blk[b - 1].id;
    }
    assert_int_equal(kvc_commit(p, e, nb, canon), KV_OK);
    assert_int_equal(kvc_release(p, canon, nb), KV_OK);
}

/* Pushes chain 1 out of T0 with other chains (their copies land in T1 too). */
static void flood(kvc_pool *p, uint32_t from) {
    for (uint32_t k = 0; k < 12; k++) {
        put_chain(p, from + k, NB);
    }
    kvd_harness_sleep_ms(100); /* the copies down are asynchronous */
}

static void test_lookup_tiers_then_fetch(void **state) {
    (void)state;
    kvc_conn *c;
    assert_int_equal(kvd_harness_connect(&h, "tiers", &c), KV_OK);
    assert_true(kvc_conn_has_tiers(c));
    kv_layout l = kvd_harness_layout();
    kvc_pool *p;
    assert_int_equal(kvc_pool_attach(c, "tiers-model", &l, &p), KV_OK);
    put_chain(p, 1, NB);
    kvd_harness_sleep_ms(50);
    flood(p, 100);
    kv_hash128 hs[NB];
    chain_hashes(p, 1, NB, hs);
    kvc_block out[NB];
    size_t nhit = 0;
    kvc_tier_hits th;
    assert_int_equal(kvc_lookup_tiers(p, hs, NB, out, &nhit, &th), KV_OK);
    assert_int_equal(kvc_release(p, out, nhit), KV_OK);
    assert_true(nhit < NB);
    assert_int_equal(nhit + th.fetchable, NB);
    assert_true(th.t1 > 0);
    kvc_fetch_result fr;
    assert_int_equal(kvc_fetch(p, hs, NB, 0, out, &fr), KV_OK);
    assert_int_equal(fr.status, KVC_FETCH_DONE);
    assert_int_equal(fr.nblocks, NB);
    assert_int_equal(fr.t0_hits, nhit);
    assert_true(fr.promoted >= 1);
    for (uint32_t b = 0; b < NB; b++) {
        assert_int_equal(touch(p, out[b].id, 1, b, 1), 0);
    }
    assert_int_equal(kvc_release(p, out, NB), KV_OK);

    /* Batched: a fetch and a ping in one round trip; the fetch's reply may come second. */
    flood(p, 200);
    kvc_batch *bt;
    assert_int_equal(kvc_batch_alloc(c, &bt), KV_OK);
    size_t fi, pi;
    assert_int_equal(kvc_batch_fetch(bt, p, hs, NB, 16, out, &fr, &fi), KV_OK);
    assert_int_equal(kvc_batch_ping(bt, "x", 1, &pi), KV_OK);
    assert_int_equal(kvc_batch_run(bt), KV_OK);
    assert_int_equal(kvc_batch_status(bt, fi), KV_OK);
    assert_int_equal(kvc_batch_status(bt, pi), KV_OK);
    assert_int_equal(fr.nblocks, NB);
    for (uint32_t b = 0; b < NB; b++) {
        assert_int_equal(touch(p, out[b].id, 1, b, 1), 0);
    }
    kvc_batch_free(bt);
    assert_int_equal(kvc_release(p, out, NB), KV_OK);

    /* The sequence helper: prefill of the chain's tokens (+1) fetches what is below T0. */
    flood(p, 300);
    kvc_seq *s;
    assert_int_equal(kvc_seq_alloc(p, NB * 16 + 16, NULL, 0, &s), KV_OK);
    uint32_t tok[NB * 16 + 1];
    for (uint32_t i = 0; i < NB * 16 + 1; i++) {
        tok[i] = 1 * 100000 + i;
    }
    size_t cached = 0;
    assert_int_equal(kvc_seq_prefill(s, tok, NB * 16 + 1, &cached), KV_OK);
    assert_int_equal(cached, NB * 16);
    assert_true(kvc_seq_promoted(s) >= 1);
    for (uint32_t b = 0; b < NB; b++) {
        assert_int_equal(touch(p, kvc_seq_block(s, b).id, 1, b, 1), 0);
    }
    kvc_seq_free(s);
    kvc_conn_close(c);
}

static void test_fetch_without_tiers_is_a_lookup(void **state) {
    (void)state;
    kvd_harness h2;
    memset(&h2, 0, sizeof(h2));
    const char *flags[] = {"--pool-memory=8M", "--segment-bytes=256K", NULL};
    assert_int_equal(kvd_harness_start(&h2, flags), 0);
    kvc_conn *c;
    assert_int_equal(kvd_harness_connect(&h2, "no-tiers", &c), KV_OK);
    assert_false(kvc_conn_has_tiers(c));
    kv_layout l = kvd_harness_layout();
    kvc_pool *p;
    assert_int_equal(kvc_pool_attach(c, "plain", &l, &p), KV_OK);
    put_chain(p, 7, 4);
    kv_hash128 hs[NB];
    chain_hashes(p, 7, NB, hs);
    kvc_block out[NB];
    kvc_fetch_result fr;
    assert_int_equal(kvc_fetch(p, hs, NB, 0, out, &fr), KV_OK);
    assert_int_equal(fr.status, KVC_FETCH_DONE);
    assert_int_equal(fr.nblocks, 4);
    assert_int_equal(fr.t0_hits, 4);
    assert_int_equal(fr.promoted, 0);
    assert_int_equal(kvc_release(p, out, 4), KV_OK);
    kvc_tier_hits th;
    size_t nhit;
    assert_int_equal(kvc_lookup_tiers(p, hs, NB, out, &nhit, &th), KV_OK);
    assert_int_equal(nhit, 4);
    assert_int_equal(th.fetchable, 0);
    assert_int_equal(kvc_release(p, out, nhit), KV_OK);
    kvc_conn_close(c);
    assert_int_equal(kvd_harness_finish(&h2), 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_lookup_tiers_then_fetch),
        cmocka_unit_test(test_fetch_without_tiers_is_a_lookup),
    };
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
