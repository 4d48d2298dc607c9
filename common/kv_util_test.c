/* kv_util: decimal and size parsing, the huge-page advice (the socket path is covered by the
 * daemon's and the client's tests, which run with and without XDG_RUNTIME_DIR). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
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
    assert_int_equal(kv_map_advise_huge(NULL, n), 0); /* nothing to advise */
    int before = kv_map_advised_huge(a);
    int took = kv_map_advise_huge(a, n) == 0; /* a kernel without THP refuses the advice */
    int after = kv_map_advised_huge(a);
    int other = kv_map_advised_huge(b);
    int below = kv_map_advised_huge((const void *)16);
    munmap(a, n);
    munmap(b, n);
    if (before < 0) {
        skip(); /* no /proc/self/smaps here */
    }
    assert_int_equal(before, 0);
    assert_int_equal(other, 0);
    assert_int_equal(below, -1); /* below any mapping */
    if (took) {
        assert_int_equal(after, 1);
    }
}

/* Large buffers: 2 MiB-aligned and advised (where the kernel takes advice); small ones
 * 4096-aligned for O_DIRECT; nothing for 0 bytes. */
static void test_alloc_huge(void **state) {
    (void)state;
    assert_null(kv_alloc_huge(0));
    uint8_t *s = kv_alloc_huge(5000);
    assert_non_null(s);
    assert_int_equal((uintptr_t)s % 4096, 0);
    memset(s, 1, 5000);
    free(s);
    uint64_t n = (2u << 20) + 4096; /* a 2 MiB block's T2 slot */
    uint8_t *b = kv_alloc_huge(n);
    assert_non_null(b);
    assert_int_equal((uintptr_t)b % (2u << 20), 0);
    memset(b, 2, n);
    int advised = kv_map_advised_huge(b);
    void *probe = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    assert_true(probe != MAP_FAILED);
    int thp = kv_map_advise_huge(probe, 4096) == 0 && kv_map_advised_huge(probe) == 1;
    munmap(probe, 4096);
    free(b);
    if (thp) {
        assert_int_equal(advised, 1);
    }
}

static void test_shmem_thp_mode(void **state) {
    (void)state;
    char buf[32];
    const char *m = kv_shmem_thp_mode(buf, sizeof(buf));
    assert_ptr_equal(m, buf);
    /* One word as the kernel spells its modes (never, advise, within_size...), or "unknown". */
    assert_true(m[0] != '\0' && m[strspn(m, "abcdefghijklmnopqrstuvwxyz_")] == '\0');
    assert_true(kv_shmem_thp_huge("advise") && kv_shmem_thp_huge("within_size") &&
                kv_shmem_thp_huge("always") && kv_shmem_thp_huge("force"));
    assert_false(kv_shmem_thp_huge("never") || kv_shmem_thp_huge("deny") ||
                 kv_shmem_thp_huge("unknown") || kv_shmem_thp_huge("adv"));
    char tiny[3];
    assert_true(strlen(kv_shmem_thp_mode(tiny, sizeof(tiny))) <= 2); /* cut, never overrun */
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_parse_u64),      cmocka_unit_test(test_parse_size),
        cmocka_unit_test(test_advise_huge),    cmocka_unit_test(test_alloc_huge),
        cmocka_unit_test(test_shmem_thp_mode),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
