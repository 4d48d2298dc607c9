/* session_test: the per-pool reference table (add, count, sub, EPERM, deletion keeps other
 * entries findable) and that release_all gives a pool back every reference and lease. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "daemon/session/session.h"

static void test_refs_table(void **state) {
    (void)state;
    kvd_refs r;
    kvd_refs_init(&r);
    assert_int_equal(kvd_refs_count(&r, 5, NULL), 0);
    assert_int_equal(kvd_refs_sub(&r, 5, 1), KV_EPERM);
    /* Enough entries to grow the table several times. */
    for (uint32_t i = 0; i < 1000; i++) {
        assert_int_equal(kvd_refs_add(&r, i * 7, i, 1 + i % 3), KV_OK);
    }
    assert_int_equal(r.used, 1000);
    for (uint32_t i = 0; i < 1000; i++) {
        uint32_t gen = 0;
        assert_int_equal(kvd_refs_count(&r, i * 7, &gen), 1 + i % 3);
        assert_int_equal(gen, i);
    }
    assert_int_equal(kvd_refs_sub(&r, 7, 3), KV_EPERM); /* holds 2 */
    assert_int_equal(kvd_refs_count(&r, 7, NULL), 2);
    /* Remove every other entry; the rest must stay findable (backward-shift deletion). */
    for (uint32_t i = 0; i < 1000; i += 2) {
        assert_int_equal(kvd_refs_sub(&r, i * 7, 1 + i % 3), KV_OK);
    }
    for (uint32_t i = 0; i < 1000; i++) {
        assert_int_equal(kvd_refs_count(&r, i * 7, NULL), i % 2 ? 1 + i % 3 : 0);
    }
    assert_int_equal(r.used, 500);
    kvd_refs_fini(&r);
    kvd_refs_fini(&r);
}

static void test_release_all(void **state) {
    (void)state;
    kvd_index *idx;
    assert_int_equal(kvd_index_alloc(1024, &idx), KV_OK);
    kvd_pool_config pc;
    memset(&pc, 0, sizeof(pc));
    pc.pool_id = 1;
    assert_int_equal(kv_layout_init(1, 1, 8, 4, KV_DTYPE_FP16, KV_LAYER_MAJOR, &pc.layout), KV_OK);
    pc.blocks_per_segment = 16;
    pc.max_segments = 1;
    pc.policy = KVD_EVICT_LRU;
    kvd_pool *pool;
    assert_int_equal(kvd_pool_alloc(&pc, idx, &kvd_backend_malloc, NULL, &pool), KV_OK);

    kvd_session s;
    kvd_session_init(&s, 9, 1, 2, 3);
    s.tenant = 4;
    kvd_session_pool *sp;
    assert_int_equal(kvd_session_add_pool(&s, 1, pool, &sp), KV_OK);
    kvd_block_ref refs[16];
    assert_int_equal(kvd_pool_allocate(pool, 16, s.id, s.tenant, refs), KV_OK);
    for (int i = 0; i < 16; i++) {
        assert_int_equal(kvd_refs_add(&sp->refs, refs[i].id, refs[i].gen, 1), KV_OK);
    }
    /* Commit two and take a second reference on one of them. */
    kvd_block_ref canon;
    assert_int_equal(kvd_pool_commit(pool, s.id, refs[0], (kv_hash128){1, 2}, KVD_NO_BLOCK, &canon),
                     KV_OK);
    assert_int_equal(kvd_pool_commit(pool, s.id, refs[1], (kv_hash128){3, 4}, refs[0].id, &canon),
                     KV_OK);
    assert_int_equal(kvd_pool_hold(pool, s.tenant, refs[0]), KV_OK);
    assert_int_equal(kvd_refs_add(&sp->refs, refs[0].id, refs[0].gen, 1), KV_OK);
    assert_int_equal(kvd_session_refs_held(&s), 17);
    kvd_block_ref more;
    assert_int_equal(kvd_pool_allocate(pool, 1, 77, 0, &more), KV_ENOSPC);

    assert_int_equal(kvd_session_release_all(&s), 17);
    assert_int_equal(kvd_session_refs_held(&s), 0);
    kvd_block_info info;
    assert_int_equal(kvd_pool_block_info(pool, refs[0].id, &info), KV_OK);
    assert_int_equal(info.state, KVD_BLOCK_CACHED);
    assert_int_equal(info.refcount, 0);
    assert_int_equal(kvd_pool_block_info(pool, refs[5].id, &info), KV_OK);
    assert_int_equal(info.state, KVD_BLOCK_FREE);
    assert_int_equal(kvd_pool_check(pool), KV_OK);
    /* Everything can be had again (the cached pair by eviction). */
    kvd_block_ref all[16];
    assert_int_equal(kvd_pool_allocate(pool, 16, 77, 0, all), KV_OK);
    kvd_session_fini(&s);
    kvd_session_fini(&s);
    kvd_pool_free(pool);
    kvd_index_free(idx);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_refs_table),
        cmocka_unit_test(test_release_all),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
