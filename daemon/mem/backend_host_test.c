/* backend_host_test: segments are sealed memfds, page-rounded, shared between two mappings,
 * advised for huge pages, and freeing accepts a zeroed segment. Huge pages: either a segment or a
 * clean error. */
#include <fcntl.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cmocka.h>

#include "common/kv_util.h"
#include "daemon/mem/backend_host.h"

static void test_segment(void **state) {
    (void)state;
    kvd_backend_host_ctx ctx = {0};
    kvd_segment_mem m;
    assert_int_equal(kvd_backend_host.segment_alloc(&ctx, 0, &m), KV_EINVAL);
    assert_int_equal(kvd_backend_host.segment_alloc(&ctx, 5000, &m), KV_OK);
    assert_true(m.bytes >= 5000 && m.bytes % (uint64_t)sysconf(_SC_PAGESIZE) == 0);
    assert_true(m.fd > 2);
    int seals = fcntl(m.fd, F_GET_SEALS);
    assert_true(seals & F_SEAL_SHRINK);
    assert_true(seals & F_SEAL_GROW);
    assert_true(seals & F_SEAL_SEAL);
    assert_int_not_equal(ftruncate(m.fd, 100), 0);
    /* A second mapping (what a client does with the fd) sees the daemon's writes. */
    uint8_t *other = mmap(NULL, m.bytes, PROT_READ, MAP_SHARED, m.fd, 0);
    assert_true(other != MAP_FAILED);
    memset(m.base, 0x5a, m.bytes);
    assert_int_equal(other[m.bytes - 1], 0x5a);
    munmap(other, m.bytes);
    /* The daemon's mapping asks for transparent huge pages, where the kernel takes the advice
     * (one built without THP refuses it: probed on a scratch mapping) and smaps can tell. */
    void *probe = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    assert_true(probe != MAP_FAILED);
    if (kv_map_advise_huge(probe, 4096) == 0 && kv_map_advised_huge(probe) == 1) {
        assert_int_equal(kv_map_advised_huge(m.base), 1);
    }
    munmap(probe, 4096);
    kvd_backend_host.segment_free(&ctx, &m);
    assert_int_equal(m.fd, -1);
    kvd_segment_mem zero;
    memset(&zero, 0, sizeof(zero));
    kvd_backend_host.segment_free(&ctx, &zero);
}

static void test_hugepages_clear_result(void **state) {
    (void)state;
    kvd_backend_host_ctx ctx = {1};
    kvd_segment_mem m;
    kv_err rc = kvd_backend_host.segment_alloc(&ctx, 4096, &m);
    if (rc == KV_OK) {
        assert_int_equal(m.bytes % (2u << 20), 0);
        kvd_backend_host.segment_free(&ctx, &m);
    } else {
        assert_true(rc == KV_ESYS || rc == KV_ENOMEM);
    }
}

/* Where 2 MiB huge pages can be had: a segment discarded (its pages given back) and restored
 * has its pages again, and is written without a fault; with no page free, restore says
 * KV_ENOMEM (the segment stays parked) instead of a SIGBUS at the first touch. */
static void test_hugepages_discard_restore(void **state) {
    (void)state;
    kvd_backend_host_ctx ctx = {1};
    kvd_segment_mem m;
    if (kvd_backend_host.segment_alloc(&ctx, 4u << 20, &m) != KV_OK) {
        return; /* no huge pages here (vm.nr_hugepages 0): nothing to check */
    }
    memset(m.base, 7, m.bytes);
    assert_int_equal(kvd_backend_host.segment_discard(&ctx, &m), KV_OK);
    assert_int_equal(((uint8_t *)m.base)[0], 0);
    assert_int_equal(kvd_backend_host.segment_restore(&ctx, &m), KV_OK);
    memset(m.base, 9, m.bytes);
    assert_int_equal(((uint8_t *)m.base)[m.bytes - 1], 9);
    kvd_backend_host.segment_free(&ctx, &m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_segment),
        cmocka_unit_test(test_hugepages_clear_result),
        cmocka_unit_test(test_hugepages_discard_restore),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
