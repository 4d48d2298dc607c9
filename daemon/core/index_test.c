/* Tests of kvd_index: insert/find/remove, duplicates, namespaces, backward-shift deletion
 * under heavy collision, prefix probes, capacity limits. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include <cmocka.h>

#include "daemon/core/index.h"

static kv_hash128 hash_of(uint64_t k) {
    uint64_t x = k * 0x9E3779B97F4A7C15ull + 1;
    x ^= x >> 31;
    kv_hash128 h = {x, k};
    return h;
}

static void test_insert_find_remove(void **state) {
    (void)state;
    kvd_index *idx;
    assert_int_equal(kvd_index_alloc(1000, &idx), KV_OK);
    assert_true(kvd_index_capacity(idx) >= 1000 / 0.7);
    uint64_t v = 0;
    assert_int_equal(kvd_index_find(idx, 1, hash_of(5), &v), KV_ENOENT);
    for (uint64_t k = 0; k < 1000; k++) {
        assert_int_equal(kvd_index_insert(idx, 1, hash_of(k), k * 10, NULL), KV_OK);
    }
    assert_int_equal(kvd_index_count(idx), 1000);
    for (uint64_t k = 0; k < 1000; k++) {
        assert_int_equal(kvd_index_find(idx, 1, hash_of(k), &v), KV_OK);
        assert_int_equal(v, k * 10);
    }
    /* Duplicate insert keeps the first value and reports it. */
    uint64_t ex = 0;
    assert_int_equal(kvd_index_insert(idx, 1, hash_of(7), 999, &ex), KV_EEXIST);
    assert_int_equal(ex, 70);
    assert_int_equal(kvd_index_find(idx, 1, hash_of(7), &v), KV_OK);
    assert_int_equal(v, 70);
    /* Another namespace is another key space. */
    assert_int_equal(kvd_index_find(idx, 2, hash_of(7), &v), KV_ENOENT);
    assert_int_equal(kvd_index_insert(idx, 2, hash_of(7), 5, NULL), KV_OK);
    assert_int_equal(kvd_index_find(idx, 2, hash_of(7), &v), KV_OK);
    assert_int_equal(v, 5);
    /* Remove the even keys; odd ones must stay findable after the backward shifts. */
    for (uint64_t k = 0; k < 1000; k += 2) {
        assert_int_equal(kvd_index_remove(idx, 1, hash_of(k)), KV_OK);
    }
    assert_int_equal(kvd_index_remove(idx, 1, hash_of(0)), KV_ENOENT);
    for (uint64_t k = 0; k < 1000; k++) {
        kv_err want = (k % 2) ? KV_OK : KV_ENOENT;
        assert_int_equal(kvd_index_find(idx, 1, hash_of(k), &v), want);
        if (want == KV_OK) {
            assert_int_equal(v, k * 10);
        }
    }
    assert_int_equal(kvd_index_count(idx), 501);
    kvd_index_free(idx);
    kvd_index_free(NULL);
}

/* Fill to the limit, then churn: every entry inserted must be findable, every removed one
 * gone, so displacement and shifting stay correct at the highest load. */
static void test_full_table_churn(void **state) {
    (void)state;
    kvd_index *idx;
    assert_int_equal(kvd_index_alloc(100, &idx), KV_OK);
    size_t cap = kvd_index_capacity(idx);
    uint64_t k = 0;
    kv_err err;
    while ((err = kvd_index_insert(idx, 3, hash_of(k), k, NULL)) == KV_OK) {
        k++;
    }
    assert_int_equal(err, KV_ENOSPC);
    assert_true(k >= 100 && k < cap);
    uint64_t lo = 0, hi = k;
    srand(42);
    for (int round = 0; round < 20000; round++) {
        assert_int_equal(kvd_index_remove(idx, 3, hash_of(lo)), KV_OK);
        lo++;
        assert_int_equal(kvd_index_insert(idx, 3, hash_of(hi), hi, NULL), KV_OK);
        hi++;
        uint64_t probe = lo + (uint64_t)rand() % (hi - lo);
        uint64_t v;
        assert_int_equal(kvd_index_find(idx, 3, hash_of(probe), &v), KV_OK);
        assert_int_equal(v, probe);
        if (lo > 0) {
            assert_int_equal(kvd_index_find(idx, 3, hash_of(lo - 1), &v), KV_ENOENT);
        }
    }
    for (uint64_t i = lo; i < hi; i++) {
        uint64_t v;
        assert_int_equal(kvd_index_find(idx, 3, hash_of(i), &v), KV_OK);
    }
    kvd_index_free(idx);
}

static void test_probe_prefix(void **state) {
    (void)state;
    kvd_index *idx;
    assert_int_equal(kvd_index_alloc(4096, &idx), KV_OK);
    kv_hash128 hs[300];
    uint64_t vals[300];
    for (uint64_t i = 0; i < 300; i++) {
        hs[i] = hash_of(1000 + i);
    }
    for (uint64_t i = 0; i < 200; i++) {
        assert_int_equal(kvd_index_insert(idx, 9, hs[i], i + 1, NULL), KV_OK);
    }
    /* hs[200..300) absent, then one present again after the gap: the prefix stops at 200. */
    assert_int_equal(kvd_index_insert(idx, 9, hs[250], 77, NULL), KV_OK);
    assert_int_equal(kvd_index_probe_prefix(idx, 9, hs, 300, vals), 200);
    for (uint64_t i = 0; i < 200; i++) {
        assert_int_equal(vals[i], i + 1);
    }
    assert_int_equal(kvd_index_probe_prefix(idx, 9, hs, 17, vals), 17);
    assert_int_equal(kvd_index_probe_prefix(idx, 9, hs + 200, 100, vals), 0);
    assert_int_equal(kvd_index_probe_prefix(idx, 8, hs, 300, vals), 0);
    assert_int_equal(kvd_index_probe_prefix(idx, 9, hs, 0, vals), 0);
    kvd_index_free(idx);
}

/* kvd_index_probe_prefix against kvd_index_find hash by hash, in a table that fits the caches
 * (probed in order) and in one of 32 MiB (probed interleaved, INDEX_WIDE_BYTES), each near its
 * load limit with two namespaces mixed in its runs and a third of the entries removed (shifted
 * runs): random prefixes of present keys, of 0-300 hashes, some with an absent or other-namespace
 * key planted, give the same count and values. */
static void test_probe_prefix_matches_find(void **state) {
    (void)state;
    size_t sizes[2] = {4096, 400000};
    for (int t = 0; t < 2; t++) {
        kvd_index *idx;
        assert_int_equal(kvd_index_alloc(sizes[t], &idx), KV_OK);
        size_t cap = kvd_index_capacity(idx);
        assert_true(t == 0 ? kvd_index_bytes(idx) < ((size_t)16 << 20)
                           : kvd_index_bytes(idx) >= ((size_t)16 << 20));
        size_t n = cap * 6 / 10; /* keys 0..n: even in namespace 9, odd in 8 */
        for (uint64_t k = 0; k < n; k++) {
            assert_int_equal(kvd_index_insert(idx, 9 - (uint32_t)(k & 1), hash_of(k), k, NULL),
                             KV_OK);
        }
        for (uint64_t k = 0; k < n; k += 3) {
            assert_int_equal(kvd_index_remove(idx, 9 - (uint32_t)(k & 1), hash_of(k)), KV_OK);
        }
        uint64_t r = 42 + (uint64_t)t;
        kv_hash128 hs[300];
        uint64_t got[300], want[300];
        for (int q = 0; q < 3000; q++) {
            r = r * 6364136223846793005ull + 1442695040888963407ull;
            size_t len = (size_t)(r >> 33) % 301;
            for (size_t i = 0; i < len; i++) {
                r = r * 6364136223846793005ull + 1442695040888963407ull;
                uint64_t k = ((r >> 20) % (n / 6)) * 6 + 2; /* even, not a multiple of 3 */
                if (q % 4 == 1 && i == len / 2) {
                    k = n + (r >> 40); /* never inserted */
                } else if (q % 4 == 2 && i == len / 3) {
                    k += 1; /* odd: lives in namespace 8 */
                } else if (q % 4 == 3 && i == len / 4) {
                    k = ((r >> 20) % (n / 3)) * 3; /* removed */
                }
                hs[i] = hash_of(k);
            }
            size_t expect = 0;
            while (expect < len && kvd_index_find(idx, 9, hs[expect], &want[expect]) == KV_OK) {
                expect++;
            }
            assert_int_equal(kvd_index_probe_prefix(idx, 9, hs, len, got), expect);
            for (size_t i = 0; i < expect; i++) {
                assert_int_equal(got[i], want[i]);
            }
        }
        kvd_index_free(idx);
    }
}

/* Reservations grow the table: every reserved entry fits, entries survive the rehash, and an
 * insert beyond the reservations of an index at its load limit is refused. */
static void test_reserve_grows(void **state) {
    (void)state;
    kvd_index *idx;
    assert_int_equal(kvd_index_alloc(1024, &idx), KV_OK);
    size_t cap0 = kvd_index_capacity(idx);
    for (uint64_t i = 0; i < 1000; i++) {
        kv_hash128 h = {i * 0x9E3779B97F4A7C15ull, i};
        assert_int_equal(kvd_index_insert(idx, 3, h, i, NULL), KV_OK);
    }
    assert_int_equal(kvd_index_reserve(idx, 8192), KV_OK);
    assert_true(kvd_index_capacity(idx) > cap0);
    assert_int_equal(kvd_index_reserved(idx), 8192);
    for (uint64_t i = 1000; i < 8192; i++) {
        kv_hash128 h = {i * 0x9E3779B97F4A7C15ull, i};
        assert_int_equal(kvd_index_insert(idx, 3, h, i, NULL), KV_OK);
    }
    for (uint64_t i = 0; i < 8192; i++) {
        kv_hash128 h = {i * 0x9E3779B97F4A7C15ull, i};
        uint64_t v = 0;
        assert_int_equal(kvd_index_find(idx, 3, h, &v), KV_OK);
        assert_int_equal(v, i);
    }
    kvd_index_unreserve(idx, 8192);
    assert_int_equal(kvd_index_reserved(idx), 0);
    kvd_index_free(idx);
}

static void test_bad_size(void **state) {
    (void)state;
    kvd_index *idx = (kvd_index *)0x1;
    assert_int_equal(kvd_index_alloc(0, &idx), KV_EINVAL);
    assert_ptr_equal(idx, (kvd_index *)0x1); /* out untouched on error */
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_insert_find_remove), cmocka_unit_test(test_full_table_churn),
        cmocka_unit_test(test_probe_prefix),       cmocka_unit_test(test_reserve_grows),
        cmocka_unit_test(test_bad_size),           cmocka_unit_test(test_probe_prefix_matches_find),
    };
    return cmocka_run_group_tests_name("kvd_index", tests, NULL, NULL);
}
