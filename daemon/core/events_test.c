/* events_test: the event ring keeps the newest entries in order, counts what it dropped, and
 * the eviction probe charges the right tenant. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "daemon/core/events.h"

static void test_ring(void **state) {
    (void)state;
    kvd_events e;
    assert_int_equal(kvd_events_init(&e, 0), KV_EINVAL);
    assert_int_equal(kvd_events_init(&e, 4), KV_OK);
    assert_int_equal(kvd_events_count(&e), 0);
    for (int i = 1; i <= 6; i++) {
        kvd_events_push(&e, i % 2 ? KVD_EVENT_EVICT : KVD_EVENT_REFUSE, 3, i, (uint64_t)i,
                        i % 2 ? KV_OK : KV_ENOSPC, i % 2 ? "capacity" : "ENOSPC", "event %d", i);
    }
    assert_int_equal(kvd_events_count(&e), 4);
    for (size_t k = 0; k < 4; k++) {
        const kvd_event *ev = kvd_events_at(&e, k);
        assert_int_equal(ev->seq, k + 3); /* 1 and 2 were overwritten */
        char want[16];
        snprintf(want, sizeof(want), "event %zu", k + 3);
        assert_string_equal(ev->detail, want);
        assert_int_equal(ev->count, k + 3);
        assert_true(ev->unix_ms > 0);
    }
    assert_int_equal(e.pushed[KVD_EVENT_EVICT], 3);
    assert_int_equal(e.pushed[KVD_EVENT_REFUSE], 3);
    /* A long detail is cut, not overflowed. */
    char longer[400];
    memset(longer, 'a', sizeof(longer) - 1);
    longer[sizeof(longer) - 1] = '\0';
    kvd_events_push(&e, KVD_EVENT_REFUSE, 0, -1, 1, KV_EPERM, "EPERM", "%s", longer);
    assert_int_equal(strlen(kvd_events_at(&e, 3)->detail), KVD_EVENT_DETAIL - 1);
    kvd_events_tenant(&e, 7)->queries++;
    assert_int_equal(kvd_events_tenant(&e, 7)->queries, 1);
    kvd_events_fini(&e);
    kvd_events_fini(&e); /* zeroed memory is fine */
}

static void test_refusal_kinds(void **state) {
    (void)state;
    assert_true(kvd_events_is_refusal(KV_ENOSPC));
    assert_true(kvd_events_is_refusal(KV_EQUOTA));
    assert_true(kvd_events_is_refusal(KV_EDRAINING));
    assert_false(kvd_events_is_refusal(KV_ESTALE));
    assert_false(kvd_events_is_refusal(KV_OK));
    assert_string_equal(kvd_evict_reason_name(KVD_EVICT_CAPACITY), "capacity");
    assert_string_equal(kvd_evict_reason_name(KVD_EVICT_ADMIN), "admin");
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_ring),
        cmocka_unit_test(test_refusal_kinds),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
