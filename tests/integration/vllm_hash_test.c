/* vllm_hash_test (issue 17): libkvclient against a real kvd in hash-mode vllm. The pool says
 * hash_algo 3 with vLLM's NONE_HASH for the daemon's seed; the client's digests are the vectors
 * of docs/HASH.md (computed by tests/vllm/vllm_hash_ref.py) and the keys their first 16 bytes;
 * kvc_pool_hash_next refuses to extend a key; a Commit without the digests is EINVAL, one with
 * them (kvc_commit_ex) is indexed under the keys; a kvc_seq hashes, commits and finds its prefix
 * again on its own. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kvclient.h"
#include "tests/integration/kvd_harness.h"

#define T 16 /* tokens per block of the harness layout */

static kvd_harness h;

/* docs/HASH.md vectors N0, C0, C1 (seed "0", tokens 1..16 and 17..32). */
static const char *N0 = "4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e";
static const char *C0 = "202da172482d928bbc42ab25b0151e2b895f13f41002e27b2ceabcfae6d332ea";
static const char *C1 = "4a0a393805c6d2f0ed831000d41bb65980336c4c04895d5e26470bbec927f5bf";

static void hex32(const uint8_t *d, char out[65]) {
    for (int i = 0; i < 32; i++) {
        snprintf(out + 2 * i, 3, "%02x", d[i]);
    }
}

static int group_setup(void **state) {
    (void)state;
    const char *flags[] = {"--pool-memory=16M", "--segment-bytes=1M", "--hash-mode=vllm",
                           "--vllm-hash-seed=0", NULL};
    return kvd_harness_start(&h, flags);
}

static int group_teardown(void **state) {
    (void)state;
    return kvd_harness_finish(&h);
}

static kvc_pool *attach(kvc_conn *c) {
    kv_layout l = kvd_harness_layout();
    kvc_pool *p;
    assert_int_equal(kvc_pool_attach(c, "vllm-model", &l, &p), KV_OK);
    return p;
}

static void test_pool_hashes_like_vllm(void **state) {
    (void)state;
    kvc_conn *c;
    assert_int_equal(kvd_harness_connect(&h, "vllm", &c), KV_OK);
    kvc_pool *p = attach(c);
    assert_int_equal(kvc_pool_hash_algo(p), KVC_HASH_VLLM);
    uint8_t none[32], full[2][32];
    char hx[65];
    assert_int_equal(kvc_pool_vllm_none_hash(p, none), KV_OK);
    hex32(none, hx);
    assert_string_equal(hx, N0);

    uint32_t tok[2 * T];
    for (int i = 0; i < 2 * T; i++) {
        tok[i] = (uint32_t)i + 1;
    }
    size_t n;
    assert_int_equal(kvc_pool_vllm_hash_tokens(p, NULL, 0, tok, 2 * T, full, 2, &n), KV_OK);
    assert_int_equal(n, 2);
    hex32(full[0], hx);
    assert_string_equal(hx, C0);
    hex32(full[1], hx);
    assert_string_equal(hx, C1);
    uint8_t next[32];
    assert_int_equal(kvc_pool_vllm_hash_next(p, full[0], NULL, 0, tok + T, next), KV_OK);
    assert_memory_equal(next, full[1], 32);

    /* Keys: the digests' first 16 bytes, lo and hi little-endian (kv_hash_hex prints them). */
    kv_hash128 keys[2];
    assert_int_equal(kvc_pool_hash_tokens(p, NULL, 0, tok, 2 * T, keys, 2, &n), KV_OK);
    assert_int_equal(n, 2);
    char kh[33];
    kv_hash_hex(keys[0], kh);
    assert_memory_equal(kh, C0, 32);
    assert_true(kv_hash_eq(kvc_pool_hash_seed(p),
                           (kv_hash128){0x9ee50d02df95114eull, 0x18f179423aa3650dull}));
    kv_hash128 out;
    assert_int_equal(kvc_pool_hash_next(p, keys[0], NULL, 0, tok + T, &out), KV_ENOTSUP);
    assert_non_null(strstr(kvc_last_error(c), "kvc_pool_vllm_hash_next"));

    /* Commit: the digests are required, and then the keys are what Lookup finds. */
    kvc_block b[2], canon[2], hit[2];
    assert_int_equal(kvc_allocate(p, 2, b), KV_OK);
    kvc_commit_entry e[2] = {{b[0], keys[0], KVC_NO_PARENT}, {b[1], keys[1], b[0].id}};
    assert_int_equal(kvc_commit(p, e, 2, canon), KV_EINVAL);
    assert_non_null(strstr(kvc_last_error(c), "hash_full"));
    /* A batch commit without the digests is refused as well; with them it goes through. */
    kvc_batch *bt;
    size_t ix;
    assert_int_equal(kvc_batch_alloc(c, &bt), KV_OK);
    assert_int_equal(kvc_batch_commit(bt, p, e, 2, canon, &ix), KV_OK);
    assert_int_equal(kvc_batch_run(bt), KV_OK);
    assert_int_equal(kvc_batch_status(bt, ix), KV_EINVAL);
    kvc_batch_free(bt);
    assert_int_equal(kvc_batch_alloc(c, &bt), KV_OK);
    assert_int_equal(kvc_batch_commit_ex(bt, p, e, 2, full, NULL, tok, canon, &ix), KV_OK);
    assert_int_equal(kvc_batch_run(bt), KV_OK);
    assert_int_equal(kvc_batch_status(bt, ix), KV_OK);
    kvc_batch_free(bt);
    size_t nhit;
    assert_int_equal(kvc_lookup(p, keys, 2, hit, &nhit), KV_OK);
    assert_int_equal(nhit, 2);
    assert_int_equal(hit[1].id, canon[1].id);
    assert_int_equal(kvc_release(p, hit, 2), KV_OK);
    assert_int_equal(kvc_release(p, canon, 2), KV_OK);
    kvc_conn_close(c);
}

static void test_seq_on_a_vllm_pool(void **state) {
    (void)state;
    kvc_conn *c;
    assert_int_equal(kvd_harness_connect(&h, "vllm-seq", &c), KV_OK);
    kvc_pool *p = attach(c);
    uint32_t tok[5 * T + 3];
    for (size_t i = 0; i < sizeof(tok) / sizeof(tok[0]); i++) {
        tok[i] = 5000 + (uint32_t)i * 7;
    }
    size_t n = sizeof(tok) / sizeof(tok[0]), cached;
    kvc_seq *s;
    assert_int_equal(kvc_seq_alloc(p, 1024, "lora-a", 6, &s), KV_OK);
    assert_int_equal(kvc_seq_prefill(s, tok, n, &cached), KV_OK);
    assert_int_equal(cached, 0);
    size_t nc;
    assert_int_equal(kvc_seq_commit(s, n, &nc), KV_OK);
    assert_int_equal(nc, 5);

    /* Another sequence with the same extra key finds the 5 blocks (the last token is never
     * looked up, so all 5 full blocks before it hit). */
    kvc_seq *s2;
    assert_int_equal(kvc_seq_alloc(p, 1024, "lora-a", 6, &s2), KV_OK);
    assert_int_equal(kvc_seq_prefill(s2, tok, n, &cached), KV_OK);
    assert_int_equal(cached, 5 * T);
    /* Another LoRA name is another chain: nothing hits. */
    kvc_seq *s3;
    assert_int_equal(kvc_seq_alloc(p, 1024, "lora-b", 6, &s3), KV_OK);
    assert_int_equal(kvc_seq_prefill(s3, tok, n, &cached), KV_OK);
    assert_int_equal(cached, 0);

    /* The chain the sequence hashed is vLLM's with extra_keys ("lora-a",): its keys hit. */
    kv_hash128 k[5];
    assert_int_equal(kvc_pool_hash_tokens(p, "lora-a", 6, tok, n, k, 5, &nc), KV_OK);
    kvc_block hit[5];
    size_t nhit;
    assert_int_equal(kvc_lookup(p, k, 5, hit, &nhit), KV_OK);
    assert_int_equal(nhit, 5);
    assert_int_equal(kvc_release(p, hit, nhit), KV_OK);
    kvc_seq_free(s3);
    kvc_seq_free(s2);
    kvc_seq_free(s);
    kvc_conn_close(c);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_pool_hashes_like_vllm),
        cmocka_unit_test(test_seq_on_a_vllm_pool),
    };
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
