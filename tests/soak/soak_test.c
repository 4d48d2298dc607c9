/* soak_test: the short soak of ./dev test: 10 s of 64 worker processes over 4 token tenants
 * with random deaths against a real kvd; every invariant of soak_run must hold (no block
 * leaked, every hit's bytes are its writer's, no hit crossed a domain, no unexpected error,
 * kvd exits 0 on SIGTERM). Figures are printed, not asserted. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "tests/soak/soak.h"

static void test_soak_short(void **state) {
    (void)state;
    soak_options o;
    soak_options_init(&o);
    o.seconds = 10;
    o.verbose = 1;
    soak_result r;
    int rc = soak_run(&o, &r);
    assert_int_equal(r.leaked, 0);
    assert_int_equal(r.mismatched, 0);
    assert_int_equal(r.cross_domain, 0);
    assert_int_equal(r.unexpected, 0);
    assert_int_equal(r.crashes, 0);
    assert_int_equal(r.kvd_status, 0);
    assert_false(r.check_failed);
    assert_true(r.ops > 0);
    assert_true(r.verified > 0);
    assert_int_equal(rc, 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_soak_short),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
