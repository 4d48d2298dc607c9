/* zipage_test (issue 15): Zipage's client side against a real kvd. A sequence under a block
 * budget refuses to grow past it (KV_EQUOTA), is compacted into fresh private blocks with
 * kvk_compact_tokens_cpu while another sequence shares its prefix, and then: the shared
 * prefix blocks are bit-identical to before, the fresh blocks hold exactly the kept rows, the
 * compressed sequence commits nothing and grows with private blocks, its position counts the
 * dropped tokens, it cannot be forked; kvc_unshare works on a block the session alone holds and
 * is refused on a shared one; a client process killed between allocating its private blocks and
 * compacting leaks nothing. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "kernels/kvk.h"
#include "kvclient.h"
#include "tests/integration/kvd_harness.h"

#define T 16 /* tokens per block of the harness layout */

static kvd_harness h;

static int group_setup(void **state) {
    (void)state;
    const char *flags[] = {"--pool-memory=64M", "--segment-bytes=1M", NULL};
    return kvd_harness_start(&h, flags);
}

static int group_teardown(void **state) {
    (void)state;
    return kvd_harness_finish(&h);
}

static kvc_pool *attach(kvc_conn *c, const char *model) {
    kv_layout l = kvd_harness_layout();
    kvc_pool *p;
    assert_int_equal(kvc_pool_attach(c, model, &l, &p), KV_OK);
    return p;
}

static uint32_t *tokens(size_t n, uint32_t base) {
    uint32_t *t = malloc(n * sizeof(*t));
    for (size_t i = 0; i < n; i++) {
        t[i] = base + (uint32_t)i;
    }
    return t;
}

/* Layer l of the pool as a two-section kvk cache (K, V) over every block id. */
static kvk_cache layer_cache(kvc_pool *p, uint32_t l) {
    kv_layout ly = *kvc_pool_layout(p); /* derived fields (kv_block_bytes) filled */
    uint8_t *kb = kvc_pool_layer_base(p, l, KV_K), *vb = kvc_pool_layer_base(p, l, KV_V);
    assert_non_null(kb);
    assert_non_null(vb);
    kvk_cache c = {.data = (uintptr_t)kb,
                   .block_stride = (int64_t)ly.kv_block_bytes,
                   .section_stride = (int64_t)(vb - kb),
                   .num_blocks = kvc_pool_max_segments(p) * kvc_pool_blocks_per_segment(p),
                   .num_sections = 2,
                   .tokens_per_block = ly.tokens_per_block,
                   .num_kv_heads = ly.num_kv_heads,
                   .head_dim = ly.head_dim,
                   .dtype = ly.dtype};
    return c;
}

/* Row bytes of one token of one layer's K (or V) in a block. */
static size_t row_bytes(void) {
    kv_layout ly = kvd_harness_layout();
    return (size_t)ly.num_kv_heads * ly.head_dim * 2; /* fp16 */
}

/* Writes a distinct byte pattern into every row of the sequence's blocks [b0, b1). */
static void fill_rows(kvc_pool *p, kvc_seq *s, size_t b0, size_t b1, uint8_t salt) {
    kv_layout ly = *kvc_pool_layout(p);
    for (size_t b = b0; b < b1; b++) {
        uint32_t id = kvc_seq_block(s, b).id;
        for (uint32_t l = 0; l < ly.num_layers; l++) {
            for (int kv = 0; kv < 2; kv++) {
                for (uint32_t t = 0; t < T; t++) {
                    uint8_t *r = kvc_pool_addr(p, id, l, kv, t, 0);
                    assert_non_null(r);
                    for (size_t i = 0; i < row_bytes(); i++) {
                        r[i] = (uint8_t)(salt + b * 31 + t * 7 + l * 3 + (size_t)kv + i);
                    }
                }
            }
        }
    }
}

static uint64_t stat(kvc_conn *c, kvc_pool *p, const char *name) {
    return kvd_harness_stat(c, kvc_pool_id(p), name);
}

/* Compacts s keeping the tokens at kept_slots (ascending slot indexes of its current table):
 * private blocks, a gather per layer, kvc_seq_compact. Returns the fresh blocks (malloc'd). */
static kvc_block *compact(kvc_pool *p, kvc_seq *s, const uint32_t *kept_slots, size_t nkept,
                          const uint32_t *all_tokens) {
    size_t nfresh = (nkept + T - 1) / T;
    kvc_block *fresh = malloc(nfresh * sizeof(*fresh));
    assert_int_equal(kvc_allocate_private(p, (uint32_t)nfresh, fresh), KV_OK);
    int64_t *src = malloc(nkept * sizeof(*src));
    uint32_t *kept_tok = malloc(nkept * sizeof(*kept_tok));
    int32_t *dst = malloc(nfresh * sizeof(*dst));
    for (size_t i = 0; i < nkept; i++) {
        uint32_t slot = kept_slots[i];
        src[i] = (int64_t)kvc_seq_block(s, slot / T).id * T + slot % T;
        kept_tok[i] = all_tokens[slot];
    }
    for (size_t j = 0; j < nfresh; j++) {
        dst[j] = (int32_t)fresh[j].id;
    }
    kv_layout ly = *kvc_pool_layout(p);
    for (uint32_t l = 0; l < ly.num_layers; l++) {
        kvk_cache c = layer_cache(p, l);
        assert_int_equal(kvk_compact_tokens_cpu(&c, &c, src, (uint32_t)nkept, dst), KV_OK);
    }
    assert_int_equal(kvc_seq_compact(s, kept_tok, nkept, fresh, nfresh), KV_OK);
    free(src);
    free(kept_tok);
    free(dst);
    return fresh;
}

static void test_budget_compact_shared_prefix(void **state) {
    (void)state;
    kvc_conn *c;
    assert_int_equal(kvd_harness_connect(&h, "zipage", &c), KV_OK);
    kvc_pool *p = attach(c, "m-zip");
    assert_true(kvc_conn_has_private(c));
    kv_layout ly = *kvc_pool_layout(p);
    assert_true(ly.kv_block_bytes > 0);
    uint32_t *t = tokens(200, 7);
    /* A: a committed 4-block prefix, kept held. */
    kvc_seq *a, *b;
    assert_int_equal(kvc_seq_alloc(p, 256, NULL, 0, &a), KV_OK);
    size_t cached;
    assert_int_equal(kvc_seq_prefill(a, t, 65, &cached), KV_OK);
    fill_rows(p, a, 0, kvc_seq_nblocks(a), 1);
    size_t nc;
    assert_int_equal(kvc_seq_commit(a, 64, &nc), KV_OK);
    assert_int_equal(nc, 4);
    /* B: the same prompt hits A's four blocks, then decodes under a budget of 6 blocks. */
    assert_int_equal(kvc_seq_alloc(p, 256, NULL, 0, &b), KV_OK);
    assert_int_equal(kvc_seq_prefill(b, t, 66, &cached), KV_OK);
    assert_int_equal(cached, 64);
    assert_int_equal(kvc_seq_set_block_budget(b, 6), KV_OK);
    assert_int_equal(kvc_seq_append(b, t + 66, 96 - 66), KV_OK);
    fill_rows(p, b, 4, 6, 9);
    assert_int_equal(kvc_seq_append(b, t + 96, 1), KV_EQUOTA);
    assert_non_null(strstr(kvc_last_error(c), "budget"));
    assert_int_equal(kvc_seq_length(b), 96);
    /* Snapshot the shared blocks' bytes (every layer, K and V). */
    size_t blk = ly.kv_block_bytes;
    uint8_t *snap = malloc(4 * ly.num_layers * 2 * blk);
    for (size_t i = 0; i < 4; i++) {
        for (uint32_t l = 0; l < ly.num_layers; l++) {
            for (int kv = 0; kv < 2; kv++) {
                memcpy(snap + ((i * ly.num_layers + l) * 2 + (size_t)kv) * blk,
                       kvc_pool_addr(p, kvc_seq_block(a, i).id, l, kv, 0, 0), blk);
            }
        }
    }
    uint64_t commits = stat(c, p, "pool.commits");
    /* Keep 4 sinks, every third token of the middle, the last 16: into ceil(n/16) blocks. */
    uint32_t keep[96];
    size_t nk = 0;
    for (uint32_t i = 0; i < 96; i++) {
        if (i < 4 || i >= 80 || i % 3 == 0) {
            keep[nk++] = i;
        }
    }
    kvc_block expect_src[96];
    for (size_t i = 0; i < 6; i++) {
        expect_src[i] = kvc_seq_block(b, i);
    }
    kvc_block *fresh = compact(p, b, keep, nk, t);
    assert_true(kvc_seq_compressed(b));
    assert_int_equal(kvc_seq_length(b), nk);
    assert_int_equal(kvc_seq_position(b), 96);
    assert_int_equal(kvc_seq_nblocks(b), (nk + T - 1) / T);
    assert_int_equal(stat(c, p, "pool.blocks_private"), (nk + T - 1) / T);
    /* Shared blocks untouched, still A's and still committed. */
    for (size_t i = 0; i < 4; i++) {
        for (uint32_t l = 0; l < ly.num_layers; l++) {
            for (int kv = 0; kv < 2; kv++) {
                assert_memory_equal(snap + ((i * ly.num_layers + l) * 2 + (size_t)kv) * blk,
                                    kvc_pool_addr(p, kvc_seq_block(a, i).id, l, kv, 0, 0), blk);
            }
        }
    }
    /* Fresh rows equal the kept source rows (A's blocks hold B's first 64 tokens). */
    for (size_t i = 0; i < nk; i++) {
        uint32_t slot = keep[i];
        uint32_t sid = slot < 64 ? kvc_seq_block(a, slot / T).id : expect_src[slot / T].id;
        for (uint32_t l = 0; l < ly.num_layers; l++) {
            for (int kv = 0; kv < 2; kv++) {
                if (slot >= 64) {
                    continue; /* B's own old blocks went back (freed); checked through A only */
                }
                assert_memory_equal(kvc_pool_addr(p, fresh[i / T].id, l, kv, i % T, 0),
                                    kvc_pool_addr(p, sid, l, kv, slot % T, 0), row_bytes());
            }
        }
    }
    /* The compressed sequence publishes nothing, even once it fills blocks again. */
    assert_int_equal(kvc_seq_append(b, t + 96, 40), KV_OK);
    assert_int_equal(kvc_seq_position(b), 136);
    assert_int_equal(kvc_seq_commit(b, kvc_seq_length(b), &nc), KV_OK);
    assert_int_equal(nc, 0);
    assert_int_equal(stat(c, p, "pool.commits"), commits);
    assert_int_equal(stat(c, p, "pool.blocks_private"), kvc_seq_nblocks(b));
    kvc_seq *f;
    int32_t cs[8], cd[8];
    size_t ncp;
    assert_int_equal(kvc_seq_fork(b, &f, cs, cd, 8, &ncp), KV_ENOTSUP);
    /* Rewound to nothing and prefilled again, it is an ordinary sequence: its prompt's hashes
     * find A's prefix again. */
    assert_int_equal(kvc_seq_reserve(b, 3 * T), KV_OK); /* held across the rewind: private */
    assert_int_equal(kvc_seq_rewind(b, 0, NULL), KV_OK);
    assert_int_equal(kvc_seq_prefill(b, t, 66, &cached), KV_OK);
    assert_int_equal(cached, 64);
    assert_false(kvc_seq_compressed(b));
    assert_int_equal(kvc_seq_position(b), kvc_seq_length(b));
    /* Its held blocks are ordinary ones now (the private ones it kept went back): it publishes
     * its prompt again. */
    assert_int_equal(stat(c, p, "pool.blocks_private"), 0);
    assert_int_equal(kvc_seq_append(b, t + 66, T), KV_OK);
    assert_int_equal(kvc_seq_commit(b, kvc_seq_length(b), &nc), KV_OK);
    assert_int_equal(nc, 1);
    assert_int_equal(kvc_seq_reserve(b, 0), KV_OK);
    /* Unshare: a block two sequences of this session hold (A and b2 share it) is refused; the
     * other-session case is tests/pyclient/test_private.py's. */
    kvc_block last = kvc_seq_block(a, 3);
    assert_int_equal(kvc_seq_release(b), KV_OK);
    assert_int_equal(stat(c, p, "pool.blocks_private"), 0);
    kvc_seq *b2;
    assert_int_equal(kvc_seq_alloc(p, 256, NULL, 0, &b2), KV_OK);
    assert_int_equal(kvc_seq_prefill(b2, t, 66, &cached), KV_OK);
    assert_int_equal(kvc_unshare(p, &last, 1), KV_EBUSY);
    assert_non_null(strstr(kvc_last_error(c), "held 2 times"));
    kvc_seq_free(b2);
    free(fresh);
    free(snap);
    free(t);
    kvc_seq_free(b);
    kvc_seq_free(a);
    kvc_conn_close(c);
}

static void test_unshare_alone(void **state) {
    (void)state;
    kvc_conn *c;
    assert_int_equal(kvd_harness_connect(&h, "unshare", &c), KV_OK);
    kvc_pool *p = attach(c, "m-unshare");
    uint32_t *t = tokens(40, 1000);
    kvc_seq *a;
    assert_int_equal(kvc_seq_alloc(p, 64, NULL, 0, &a), KV_OK);
    size_t cached, nc;
    assert_int_equal(kvc_seq_prefill(a, t, 33, &cached), KV_OK);
    assert_int_equal(kvc_seq_commit(a, 32, &nc), KV_OK);
    kvc_block last = kvc_seq_block(a, 1);
    assert_int_equal(kvc_unshare(p, &last, 1), KV_OK);
    assert_int_equal(stat(c, p, "pool.unshares"), 1);
    assert_int_equal(stat(c, p, "pool.blocks_private"), 1);
    kv_hash128 hs[2];
    size_t nh;
    assert_int_equal(kvc_pool_hash_tokens(p, NULL, 0, t, 32, hs, 2, &nh), KV_OK);
    kvc_block got[2];
    size_t nhit;
    assert_int_equal(kvc_lookup(p, hs, 2, got, &nhit), KV_OK);
    assert_int_equal(nhit, 1); /* the unshared block is out of the index */
    assert_int_equal(kvc_release(p, got, nhit), KV_OK);
    kvc_seq_free(a); /* releases the private block too */
    assert_int_equal(stat(c, p, "pool.blocks_private"), 0);
    assert_int_equal(stat(c, p, "pool.blocks_writing"), 0);
    free(t);
    kvc_conn_close(c);
}

/* A worker dies with a shared prefix held and private blocks written but not yet compacted
 * into its sequence: the daemon frees the private blocks and the prefix stays cached. */
static void test_killed_mid_compression(void **state) {
    (void)state;
    kvc_conn *c;
    assert_int_equal(kvd_harness_connect(&h, "zip-parent", &c), KV_OK);
    kvc_pool *p = attach(c, "m-zip-kill");
    uint32_t *t = tokens(80, 500);
    kvc_seq *a;
    assert_int_equal(kvc_seq_alloc(p, 128, NULL, 0, &a), KV_OK);
    size_t cached, nc;
    assert_int_equal(kvc_seq_prefill(a, t, 65, &cached), KV_OK);
    fill_rows(p, a, 0, 5, 3);
    assert_int_equal(kvc_seq_commit(a, 64, &nc), KV_OK);
    uint8_t before[4096]; /* one (layer, kv) section of a block */
    memcpy(before, kvc_pool_addr(p, kvc_seq_block(a, 2).id, 1, KV_V, 0, 0), sizeof(before));
    assert_int_equal(kvc_seq_release(a), KV_OK);
    pid_t pid = fork();
    if (pid == 0) {
        kvc_conn *k;
        if (kvd_harness_connect(&h, "zip-child", &k) != KV_OK) {
            _exit(2);
        }
        kv_layout l = kvd_harness_layout();
        kvc_pool *kp;
        kvc_seq *s;
        size_t got;
        kvc_block fresh[3];
        if (kvc_pool_attach(k, "m-zip-kill", &l, &kp) != KV_OK ||
            kvc_seq_alloc(kp, 128, NULL, 0, &s) != KV_OK ||
            kvc_seq_prefill(s, t, 66, &got) != KV_OK || got != 64 ||
            kvc_allocate_private(kp, 3, fresh) != KV_OK) {
            _exit(3);
        }
        memset(kvc_pool_addr(kp, fresh[0].id, 0, KV_K, 0, 0), 0xee, 4096);
        _exit(0); /* killed mid-compression: no compact, no release, no goodbye */
    }
    int st;
    assert_int_equal(waitpid(pid, &st, 0), pid);
    assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    assert_int_equal(kvd_harness_wait_stat(c, kvc_pool_id(p), "pool.blocks_writing", 0), 0);
    assert_int_equal(kvd_harness_wait_stat(c, kvc_pool_id(p), "pool.blocks_committed", 0), 0);
    assert_int_equal(stat(c, p, "pool.blocks_private"), 0);
    assert_int_equal(stat(c, p, "pool.blocks_cached"), 4);
    kvc_seq *again;
    assert_int_equal(kvc_seq_alloc(p, 128, NULL, 0, &again), KV_OK);
    assert_int_equal(kvc_seq_prefill(again, t, 66, &cached), KV_OK);
    assert_int_equal(cached, 64);
    assert_memory_equal(before, kvc_pool_addr(p, kvc_seq_block(again, 2).id, 1, KV_V, 0, 0),
                        sizeof(before));
    kvc_seq_free(again);
    kvc_seq_free(a);
    free(t);
    kvc_conn_close(c);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_budget_compact_shared_prefix),
        cmocka_unit_test(test_unshare_alone),
        cmocka_unit_test(test_killed_mid_compression),
    };
    return cmocka_run_group_tests_name("zipage", tests, group_setup, group_teardown);
}
