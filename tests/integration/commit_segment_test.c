/* Integration: a commit whose canonical block lies in a segment this session has not mapped yet.
 * Session A allocates a block while the pool has one segment; session B then grows the pool
 * (a second segment), writes the same hash into a block of the new segment and commits it first;
 * A's commit of that hash returns B's block as canonical. CommitReply carries no
 * new_segments_from, so libkvclient must notice the unmapped canonical block and map its segment
 * before kvc_commit returns: A reads the block's bytes at once (the soak test's rare "bytes
 * mismatched" was a NULL kvc_pool_addr for exactly this). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "tests/integration/kvd_harness.h"

#define SEG_BLOCKS 64 /* 1 MiB segments of the harness layout's 16 KiB blocks */

static kvd_harness g_h;

static int setup(void **state) {
    (void)state;
    static const char *const flags[] = {"--segment-bytes=1M", "--pool-memory=16M", NULL};
    return kvd_harness_start(&g_h, flags);
}

static int teardown(void **state) {
    (void)state;
    kvd_harness_fini(&g_h);
    return 0;
}

/* Fills every K and V run of block b with words derived from seed. */
static void fill(kvc_pool *p, kvc_block b, uint64_t seed) {
    const kv_layout *l = kvc_pool_layout(p);
    for (uint32_t layer = 0; layer < l->num_layers; layer++) {
        for (int kv = KV_K; kv <= KV_V; kv++) {
            uint64_t *w = kvc_pool_addr(p, b.id, layer, kv, 0, 0);
            assert_non_null(w);
            for (size_t i = 0; i < l->kv_block_bytes / 8; i++) {
                w[i] = seed ^ ((uint64_t)layer << 48) ^ ((uint64_t)kv << 40) ^ i;
            }
        }
    }
}

/* 1 when block b of p holds what fill(seed) wrote. */
static int holds(kvc_pool *p, kvc_block b, uint64_t seed) {
    const kv_layout *l = kvc_pool_layout(p);
    for (uint32_t layer = 0; layer < l->num_layers; layer++) {
        for (int kv = KV_K; kv <= KV_V; kv++) {
            const uint64_t *w = kvc_pool_addr(p, b.id, layer, kv, 0, 0);
            if (w == NULL) {
                return 0;
            }
            for (size_t i = 0; i < l->kv_block_bytes / 8; i++) {
                if (w[i] != (seed ^ ((uint64_t)layer << 48) ^ ((uint64_t)kv << 40) ^ i)) {
                    return 0;
                }
            }
        }
    }
    return 1;
}

static void test_duplicate_commit_in_unmapped_segment(void **state) {
    (void)state;
    kv_layout l = kvd_harness_layout();
    kvc_conn *ca, *cb;
    kvc_pool *pa, *pb;
    assert_int_equal(kvd_harness_connect(&g_h, "a", &ca), KV_OK);
    assert_int_equal(kvc_pool_attach(ca, "commit-seg", &l, &pa), KV_OK);
    assert_int_equal(kvc_pool_blocks_per_segment(pa), SEG_BLOCKS);
    assert_int_equal(kvc_pool_segments(pa), 1);

    /* A's block: segment 0, the only one when A allocates. */
    kvc_block a;
    assert_int_equal(kvc_allocate(pa, 1, &a), KV_OK);
    assert_true(a.id < SEG_BLOCKS);

    /* B takes the rest of segment 0 and one block more: the pool grows segment 1. */
    assert_int_equal(kvd_harness_connect(&g_h, "b", &cb), KV_OK);
    assert_int_equal(kvc_pool_attach(cb, "commit-seg", &l, &pb), KV_OK);
    kvc_block bb[SEG_BLOCKS];
    assert_int_equal(kvc_allocate(pb, SEG_BLOCKS, bb), KV_OK);
    kvc_block b = bb[SEG_BLOCKS - 1];
    assert_true(b.id >= SEG_BLOCKS);
    assert_int_equal(kvc_pool_segments(pa), 1); /* A has not heard of segment 1 */

    kv_hash128 h = {0x1234567890abcdefull, 0x0fedcba987654321ull};
    uint64_t seed = 0x5eed5eed5eed5eedull;
    fill(pb, b, seed);
    kvc_commit_entry eb = {.block = b, .hash = h, .parent = KVC_NO_PARENT};
    kvc_block canon_b;
    assert_int_equal(kvc_commit(pb, &eb, 1, &canon_b), KV_OK);
    assert_int_equal(canon_b.id, b.id);

    /* A computed the same block: its commit is a duplicate and returns B's block. */
    fill(pa, a, seed);
    kvc_commit_entry ea = {.block = a, .hash = h, .parent = KVC_NO_PARENT};
    kvc_block canon_a;
    assert_int_equal(kvc_commit(pa, &ea, 1, &canon_a), KV_OK);
    assert_int_equal(canon_a.id, b.id);
    assert_int_equal(canon_a.gen, b.gen);
    assert_non_null(kvc_pool_addr(pa, canon_a.id, 0, KV_K, 0, 0));
    assert_true(holds(pa, canon_a, seed));

    assert_int_equal(kvc_release(pa, &canon_a, 1), KV_OK);
    assert_int_equal(kvc_release(pb, bb, SEG_BLOCKS), KV_OK);
    kvc_pool_detach(pa);
    kvc_pool_detach(pb);
    kvc_conn_close(ca);
    kvc_conn_close(cb);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_duplicate_commit_in_unmapped_segment),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
