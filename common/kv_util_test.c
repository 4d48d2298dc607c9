/* kv_util: decimal and size parsing (the socket path is covered by the daemon's and the
 * client's tests, which run with and without XDG_RUNTIME_DIR). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "common/kv_util.h"

static void test_parse_u64(void **state) {
    (void)state;
    uint64_t v = 7;
    const char *end = NULL;
    assert_int_equal(kv_parse_u64("123x", &end, &v), 0);
    assert_int_equal(v, 123);
    assert_int_equal(*end, 'x');
    assert_int_equal(kv_parse_u64("18446744073709551615", NULL, &v), 0);
    assert_true(v == UINT64_MAX);
    v = 7;
    assert_int_equal(kv_parse_u64("18446744073709551616", NULL, &v), -1);
    assert_int_equal(kv_parse_u64("-1", NULL, &v), -1);
    assert_int_equal(kv_parse_u64(" 1", NULL, &v), -1);
    assert_int_equal(kv_parse_u64("", NULL, &v), -1);
    assert_int_equal(kv_parse_u64(NULL, NULL, &v), -1);
    assert_int_equal(v, 7); /* untouched on failure */
}

static void test_parse_size(void **state) {
    (void)state;
    static const struct {
        const char *s;
        uint64_t v;
    } ok[] = {
        {"0", 0},
        {"4096", 4096},
        {"64K", 64ull << 10},
        {"64k", 64ull << 10},
        {"2M", 2ull << 20},
        {"2MiB", 2ull << 20},
        {"3GB", 3ull << 30},
        {"1T", 1ull << 40},
        {"1t", 1ull << 40},
        {"16777215T", 16777215ull << 40},
    };
    for (size_t i = 0; i < sizeof(ok) / sizeof(ok[0]); i++) {
        uint64_t v = 1;
        assert_int_equal(kv_parse_size(ok[i].s, &v), 0);
        assert_true(v == ok[i].v);
    }
    static const char *const bad[] = {"",    "K",   "1X",   "1KB2",      "1Kb",
                                      "1 K", "-1K", "1.5M", "16777216T", "1KiBB"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        uint64_t v = 9;
        assert_int_equal(kv_parse_size(bad[i], &v), -1);
        assert_int_equal(v, 9);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_parse_u64),
        cmocka_unit_test(test_parse_size),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
