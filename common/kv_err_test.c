/* Checks the error map: dense numbering, distinct names and messages. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <string.h>

#include <cmocka.h>

#include "common/kv_err.h"

static void test_codes_are_dense_and_named(void **state) {
    (void)state;
    for (int i = 0; i < KV_ERR_COUNT; i++) {
        assert_string_not_equal(kv_err_name(i), "UNKNOWN");
        assert_string_not_equal(kv_strerror(i), "unknown error");
        for (int j = 0; j < i; j++) {
            assert_string_not_equal(kv_err_name(i), kv_err_name(j));
        }
    }
    assert_string_equal(kv_err_name(KV_ERR_COUNT), "UNKNOWN");
    assert_string_equal(kv_strerror(-1), "unknown error");
}

static void test_known_numbers_never_change(void **state) {
    (void)state;
    /* These numbers are on the wire; renumbering breaks every deployed client. */
    assert_int_equal(KV_OK, 0);
    assert_int_equal(KV_ENOSPC, 3);
    assert_int_equal(KV_ESTALE, 5);
    assert_int_equal(KV_EQUOTA, 8);
    assert_int_equal(KV_EEPOCH, 12);
    assert_string_equal(kv_err_name(KV_EPROTO), "EPROTO");
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_codes_are_dense_and_named),
        cmocka_unit_test(test_known_numbers_never_change),
    };
    return cmocka_run_group_tests_name("kv_err", tests, NULL, NULL);
}
