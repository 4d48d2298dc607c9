/* kv_util: decimal and size parsing, the huge-page advice (the socket path is covered by the
 * daemon's and the client's tests, which run with and without XDG_RUNTIME_DIR). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>

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

/* The advice shows in the mapping's VmFlags whatever the system's THP mode (the kernel keeps the
 * flag even where it will not use huge pages), and only on the mapping advised. */
static void test_advise_huge(void **state) {
    (void)state;
    size_t n = 4u << 20;
    uint8_t *a = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    uint8_t *b = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    assert_true(a != MAP_FAILED && b != MAP_FAILED);
    if (kv_map_advised_huge(a) < 0) {
        skip(); /* no /proc/self/smaps here */
    }
    assert_int_equal(kv_map_advised_huge(a), 0);
    kv_map_advise_huge(a, n);
    kv_map_advise_huge(NULL, n); /* ignored */
    if (kv_map_advised_huge(a) != 1) {
        skip(); /* a kernel built without transparent huge pages refuses the advice */
    }
    assert_int_equal(kv_map_advised_huge(a + n - 1), 1);
    assert_int_equal(kv_map_advised_huge(b), 0);
    assert_int_equal(kv_map_advised_huge((const void *)16), -1); /* below any mapping */
    munmap(a, n);
    munmap(b, n);
}

static void test_shmem_thp_mode(void **state) {
    (void)state;
    char buf[32];
    const char *m = kv_shmem_thp_mode(buf, sizeof(buf));
    assert_ptr_equal(m, buf);
    const char *known[] = {"never", "advise", "within_size", "always", "deny", "force", "unknown"};
    int ok = 0;
    for (size_t i = 0; i < sizeof(known) / sizeof(known[0]); i++) {
        ok |= strcmp(m, known[i]) == 0;
    }
    assert_true(ok);
    char tiny[3];
    assert_true(strlen(kv_shmem_thp_mode(tiny, sizeof(tiny))) <= 2); /* cut, never overrun */
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_parse_u64),
        cmocka_unit_test(test_parse_size),
        cmocka_unit_test(test_advise_huge),
        cmocka_unit_test(test_shmem_thp_mode),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
