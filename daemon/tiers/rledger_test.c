/* Tests of kvd_rledger: add, remove, remove_if against stamps, the oldest entry of a full set
 * replaced (and counted lost), a refreshed entry kept, and scans that see every entry once. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "daemon/tiers/rledger.h"

static kv_hash128 H(uint64_t i) {
    kv_hash128 h = {i * 0x9E3779B97F4A7C15ull + 1, i ^ 0x5555};
    return h;
}

static void test_refuses_zero(void **state) {
    (void)state;
    kvd_rledger *l = (kvd_rledger *)1;
    assert_int_equal(kvd_rledger_alloc(0, &l), KV_EINVAL);
    assert_null(l);
}

static void test_add_remove(void **state) {
    (void)state;
    kvd_rledger *l;
    assert_int_equal(kvd_rledger_alloc(1000, &l), KV_OK);
    assert_true(kvd_rledger_slots(l) >= 1000);
    for (uint64_t i = 0; i < 100; i++) {
        kvd_rledger_add(l, 7, H(i));
    }
    kvd_rledger_add(l, 7, H(5));    /* again: one entry */
    kvd_rledger_add(l, 0, H(1000)); /* not a pool */
    assert_int_equal(kvd_rledger_count(l), 100);
    assert_int_equal(kvd_rledger_remove(l, 8, H(5)), 0); /* another pool's */
    assert_int_equal(kvd_rledger_remove(l, 7, H(5)), 1);
    assert_int_equal(kvd_rledger_remove(l, 7, H(5)), 0);
    assert_int_equal(kvd_rledger_remove(l, 0, H(1000)), 0);
    assert_int_equal(kvd_rledger_count(l), 99);
    assert_int_equal(kvd_rledger_lost(l), 0);
    assert_true(kvd_rledger_bytes(l) >= kvd_rledger_slots(l) * 24);
    kvd_rledger_free(l);
    kvd_rledger_free(NULL);
}

/* Scans in small steps see every entry exactly once, with the stamps remove_if needs. */
static void test_scan_and_remove_if(void **state) {
    (void)state;
    kvd_rledger *l;
    assert_int_equal(kvd_rledger_alloc(4096, &l), KV_OK);
    enum { N = 1500 };
    for (uint64_t i = 0; i < N; i++) {
        kvd_rledger_add(l, 1 + (uint32_t)(i % 3), H(i));
    }
    uint8_t *seen = calloc(N, 1);
    kvd_rledger_ent batch[37];
    size_t cursor = 0, total = 0, n;
    kvd_rledger_ent keep = {0};
    while (cursor < kvd_rledger_slots(l)) {
        n = kvd_rledger_scan(l, &cursor, batch, 37);
        assert_true(n <= 37);
        for (size_t j = 0; j < n; j++) {
            uint64_t i = (batch[j].hash.hi ^ 0x5555) % N; /* H's inverse */
            assert_true(kv_hash_eq(H(i), batch[j].hash));
            assert_int_equal(batch[j].pool_id, 1 + (uint32_t)(i % 3));
            assert_int_equal(seen[i], 0);
            seen[i] = 1;
            if (i == 10) {
                keep = batch[j];
            }
        }
        total += n;
    }
    assert_int_equal(total, N);
    assert_int_equal(kvd_rledger_lost(l), 0);
    assert_int_equal(kvd_rledger_scan(l, &cursor, batch, 37), 0);
    /* An add after the scan: its answer is about the old announcement, so it stays. */
    kvd_rledger_add(l, keep.pool_id, keep.hash);
    assert_int_equal(kvd_rledger_remove_if(l, keep.pool_id, keep.hash, keep.stamp), 0);
    assert_int_equal(kvd_rledger_count(l), N);
    cursor = 0;
    total = 0;
    while (cursor < kvd_rledger_slots(l)) {
        n = kvd_rledger_scan(l, &cursor, batch, 37);
        for (size_t j = 0; j < n; j++) {
            assert_int_equal(
                kvd_rledger_remove_if(l, batch[j].pool_id, batch[j].hash, batch[j].stamp), 1);
        }
        total += n;
    }
    assert_int_equal(total, N);
    assert_int_equal(kvd_rledger_count(l), 0);
    free(seen);
    kvd_rledger_free(l);
}

/* One set of four (both choices are the same set): a fifth entry replaces the oldest; an entry
 * added again is the newest. */
static void test_full_set_replaces_the_oldest(void **state) {
    (void)state;
    kvd_rledger *l;
    assert_int_equal(kvd_rledger_alloc(2, &l), KV_OK);
    assert_int_equal(kvd_rledger_slots(l), 4);
    for (uint64_t i = 0; i < 4; i++) {
        kvd_rledger_add(l, 3, H(i));
    }
    kvd_rledger_add(l, 3, H(0)); /* refreshed: now H(1) is the oldest */
    kvd_rledger_add(l, 3, H(4));
    assert_int_equal(kvd_rledger_count(l), 4);
    assert_int_equal(kvd_rledger_lost(l), 1);
    assert_int_equal(kvd_rledger_remove(l, 3, H(1)), 0);
    assert_int_equal(kvd_rledger_remove(l, 3, H(0)), 1);
    assert_int_equal(kvd_rledger_remove(l, 3, H(2)), 1);
    assert_int_equal(kvd_rledger_remove(l, 3, H(3)), 1);
    assert_int_equal(kvd_rledger_remove(l, 3, H(4)), 1);
    assert_int_equal(kvd_rledger_count(l), 0);
    /* A freed way is used before anything is replaced. */
    for (uint64_t i = 10; i < 14; i++) {
        kvd_rledger_add(l, 3, H(i));
    }
    assert_int_equal(kvd_rledger_lost(l), 1);
    assert_int_equal(kvd_rledger_count(l), 4);
    kvd_rledger_free(l);
}

/* Two choices fill the sets evenly: the entries asked for fit, (almost) nothing pushed out. */
static void test_fills_evenly(void **state) {
    (void)state;
    kvd_rledger *l;
    size_t n = 1 << 16;
    assert_int_equal(kvd_rledger_alloc(n, &l), KV_OK);
    for (uint64_t i = 0; i < n; i++) {
        kvd_rledger_add(l, 2, H(i));
    }
    assert_true(kvd_rledger_lost(l) * 10000 <= n); /* <= 0.01% (2 in 32768 measured) */
    assert_int_equal(kvd_rledger_count(l), n - kvd_rledger_lost(l));
    kvd_rledger_free(l);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_refuses_zero),
        cmocka_unit_test(test_add_remove),
        cmocka_unit_test(test_scan_and_remove_if),
        cmocka_unit_test(test_full_set_replaces_the_oldest),
        cmocka_unit_test(test_fills_evenly),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
