/* icecache_test (issue 16): page summaries through libkvclient against a real kvd: a pool
 * attached with KVC_ATTACH_SUMMARIES gets, for each committed block, exactly the summary
 * kvk_page_summaries_cpu computes over the client's own mapping of the block; unknown hashes
 * are reported as not found; a pool attached without the flag refuses (KV_ENOTSUP). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kernels/kvk.h"
#include "kvclient.h"
#include "tests/integration/kvd_harness.h"

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

static void test_summaries_match_kernel(void **state) {
    (void)state;
    kvc_conn *c;
    assert_int_equal(kvd_harness_connect(&h, "ice", &c), KV_OK);
    kv_layout want = kvd_harness_layout();
    kvc_pool *p, *plain;
    assert_int_equal(kvc_pool_attach_ex(c, "m-ice", &want, KVC_ATTACH_SUMMARIES, &p), KV_OK);
    assert_int_equal(kvc_pool_attach(c, "m-ice", &want, &plain), KV_OK);
    assert_int_not_equal(kvc_pool_id(p), kvc_pool_id(plain)); /* the flag is in the identity */
    const kv_layout *ly = kvc_pool_layout(p);
    uint32_t toks[48];
    for (int i = 0; i < 48; i++) {
        toks[i] = (uint32_t)(i * 7 + 3);
    }
    kv_hash128 hs[4];
    size_t nh;
    assert_int_equal(kvc_pool_hash_tokens(p, NULL, 0, toks, 48, hs, 3, &nh), KV_OK);
    kvc_block b[3];
    assert_int_equal(kvc_allocate(p, 3, b), KV_OK);
    uint64_t seed = 99;
    for (int i = 0; i < 3; i++) {
        for (uint32_t l = 0; l < ly->num_layers; l++) {
            for (int kv = 0; kv < 2; kv++) {
                uint16_t *x = kvc_pool_addr(p, b[i].id, l, kv, 0, 0);
                for (uint64_t e = 0; e < ly->kv_block_bytes / 2; e++) {
                    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
                    x[e] = (uint16_t)(0x3000 + ((seed >> 40) & 0x0fff)); /* finite fp16 */
                }
            }
        }
    }
    kvc_commit_entry ent[3];
    for (int i = 0; i < 3; i++) {
        ent[i] = (kvc_commit_entry){b[i], hs[i], i == 0 ? KVC_NO_PARENT : b[i - 1].id};
    }
    kvc_block canon[3];
    assert_int_equal(kvc_commit(p, ent, 3, canon), KV_OK);
    size_t per = KVK_SUMMARY_FLOATS(ly->num_layers, ly->num_kv_heads, ly->head_dim);
    float *got = calloc(4 * per, sizeof(float)), *want_s = calloc(per, sizeof(float));
    uint8_t found[4];
    hs[3] = (kv_hash128){1, 2};
    assert_int_equal(kvc_summaries(p, hs, 4, got, found), KV_OK);
    assert_int_equal(found[3], 0);
    uint32_t nb = 0;
    void *base = kvc_pool_segment_base(p, 0, &nb);
    kvk_cache kc;
    assert_int_equal(kvk_cache_from_segment(ly, (uintptr_t)base, nb, &kc), KV_OK);
    for (int i = 0; i < 3; i++) {
        assert_int_equal(found[i], 1);
        int32_t id = (int32_t)canon[i].id;
        assert_int_equal(kvk_page_summaries_cpu(&kc, &id, NULL, 1, want_s), KV_OK);
        assert_memory_equal(got + i * per, want_s, per * sizeof(float));
    }
    assert_int_equal(kvc_summaries(plain, hs, 3, got, found), KV_ENOTSUP);
    free(got);
    free(want_s);
    kvc_conn_close(c);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_summaries_match_kernel),
    };
    return cmocka_run_group_tests_name("icecache", tests, group_setup, group_teardown);
}
