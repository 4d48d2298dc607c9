/* soak_test: the short soaks of ./dev test: 6 to 10 s of 64 worker processes over 4 token
 * tenants with random deaths against a real kvd, once with 1 MiB segments and once with 64 KiB
 * segments while both cores are kept busy (the setting that once found a race), then with tiers
 * and the remote tier, two of them with KV events; every invariant of soak_run must hold (no
 * block leaked, every hit's bytes are its writer's and addressable, no hit crossed a domain, no
 * unexpected error, kvd exits 0 on SIGTERM, every event batch from the first received on came in
 * order and well formed). Figures are printed, not asserted. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <unistd.h>

#include <cmocka.h>

#include "tests/soak/soak.h"

/* Runs the soak and asserts every invariant; *out (may be NULL) gets its result. */
static void check_soak(const soak_options *o, soak_result *out) {
    soak_result r;
    int rc = soak_run(o, &r);
    assert_int_equal(r.leaked, 0);
    assert_int_equal(r.mismatched, 0);
    assert_int_equal(r.unmapped, 0);
    assert_int_equal(r.cross_domain, 0);
    assert_int_equal(r.unexpected, 0);
    assert_int_equal(r.crashes, 0);
    assert_int_equal(r.kvd_status, 0);
    assert_false(r.check_failed);
    assert_true(r.ops > 0);
    assert_true(r.verified > 0);
    if (o->events) { /* every batch from the first one received on, in order and well formed */
        assert_int_equal(r.ev_gaps, 0);
        assert_int_equal(r.ev_bad, 0);
        assert_true(r.ev_stored > 0);
        assert_true(r.ev_published > 0);              /* kvd's count was read */
        assert_true(r.ev_last + 1 >= r.ev_published); /* none lost at the end */
    }
    assert_int_equal(rc, 0);
    if (out != NULL) {
        *out = r;
    }
}

/* With KV events published (token ids on) and a subscriber checking every batch. */
static void test_soak_short(void **state) {
    (void)state;
    soak_options o;
    soak_options_init(&o);
    o.seconds = 6;
    o.events = 1;
    o.verbose = 1;
    soak_result r;
    check_soak(&o, &r);
    assert_true(r.ev_removed > 0); /* the pools filled: evictions were published too */
}

/* 64 KiB segments (hundreds per pool, so sessions see many segments they lack) with both cores
 * kept busy by two burners: the setting in which a hole in a session's segment map published
 * stale bytes in about one run of three. */
static void test_soak_small_segments_busy(void **state) {
    (void)state;
    soak_options o;
    soak_options_init(&o);
    o.seconds = 10;
    o.seg_size = "64K";
    o.busy = 2;
    o.verbose = 1;
    check_soak(&o, NULL);
}

/* Tiers on (issue 14): the workers Fetch, so hits come from T0, T1 and T2 and every one's bytes
 * are checked; the pools are small so blocks go down and come up all the time. */
static void test_soak_tiers(void **state) {
    (void)state;
    soak_options o;
    soak_options_init(&o);
    o.seconds = 10;
    o.pool_mem = "8M";
    o.seg_size = "256K";
    o.tiers = 1;
    o.busy = 2;
    o.verbose = 1;
    check_soak(&o, NULL);
}

/* The same with block-major pools, write-through: each block is one piece of host memory, so its
 * T2 copies go between the disk and T0 with no copy (format 2 files); every hit's bytes are
 * checked, and the zero-copy path really ran. */
static void test_soak_tiers_zero_copy(void **state) {
    (void)state;
    soak_options o;
    soak_options_init(&o);
    o.seconds = 8;
    o.pool_mem = "8M";
    o.seg_size = "256K";
    o.tiers = 2;
    o.block_major = 1;
    o.busy = 2;
    o.verbose = 1;
    soak_result r;
    check_soak(&o, &r);
    assert_true(r.t2_zero_copy > 0);
}

/* The remote tier (issue 17) under the same faults: kvd with a redis-server the soak starts,
 * tier 1 small and no tier 2, so hits come back from Redis read straight into T0 blocks (the
 * direct path) while workers die mid-Fetch; every hit's bytes are checked, nothing leaks, no
 * value is bad, and the direct path really ran. */
static void soak_remote(const char *remote_write, int events) {
    if (access("/usr/bin/redis-server", X_OK) != 0) {
        skip(); /* ./dev installs it; a machine without it has no remote tier to soak */
    }
    soak_options o;
    soak_options_init(&o);
    o.seconds = 6;
    o.pool_mem = "8M";
    o.seg_size = "256K";
    o.tiers = 2;
    o.redis = "/usr/bin/redis-server";
    o.remote_write = remote_write;
    o.events = events;
    o.busy = 2;
    o.verbose = 1;
    soak_result r;
    check_soak(&o, &r);
    assert_int_equal(r.remote_bad, 0);
    assert_true(r.remote_direct > 0);
    assert_true(r.remote_lookups > 0);
    assert_true(r.remote_lookup_hits > 0); /* Lookups saw Redis hold what T0 and T1 let go */
}

static void test_soak_remote(void **state) {
    (void)state;
    soak_remote(NULL, 0); /* remote-write write-through: every block that lands in T1 */
}

/* The same with remote-write write-back: only what T1 is about to give up goes to Redis, each
 * held busy while it is written, as workers die and T1 turns over; KV events on, with both
 * cores busy (their batches checked as in test_soak_short). */
static void test_soak_remote_write_back(void **state) {
    (void)state;
    soak_remote("write-back", 1);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_soak_short),  cmocka_unit_test(test_soak_small_segments_busy),
        cmocka_unit_test(test_soak_tiers),  cmocka_unit_test(test_soak_tiers_zero_copy),
        cmocka_unit_test(test_soak_remote), cmocka_unit_test(test_soak_remote_write_back),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
