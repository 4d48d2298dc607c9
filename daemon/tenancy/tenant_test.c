/* tenant_test: the tenants file format, uid-before-gid matching, default uid tenants, errors. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <string.h>

#include <cmocka.h>

#include "daemon/core/pool.h"
#include "daemon/tenancy/tenant.h"

static void test_default_uid_tenants(void **state) {
    (void)state;
    kvd_tenants *t;
    assert_int_equal(kvd_tenants_alloc(&t), KV_OK);
    uint32_t a, b, a2;
    assert_int_equal(kvd_tenants_resolve(t, 1000, 100, &a), KV_OK);
    assert_int_equal(kvd_tenants_resolve(t, 1001, 100, &b), KV_OK);
    assert_int_equal(kvd_tenants_resolve(t, 1000, 999, &a2), KV_OK);
    assert_int_not_equal(a, b);
    assert_int_equal(a, a2);
    assert_string_equal(kvd_tenants_name(t, a), "uid-1000");
    assert_string_equal(kvd_tenants_name(t, b), "uid-1001");
    assert_string_equal(kvd_tenants_name(t, 77), "?");
    kvd_tenants_free(t);
}

static void test_file_mapping(void **state) {
    (void)state;
    kvd_tenants *t;
    assert_int_equal(kvd_tenants_alloc(&t), KV_OK);
    char err[256];
    const char *text = "# teams\n"
                       "tenant infer uid=1000,1001 gid=2000\n"
                       "\n"
                       "tenant batch gid=3000   # whole group\n"
                       "tenant grp2 gid=2000\n";
    assert_int_equal(kvd_tenants_parse(t, text, "tenants", err, sizeof(err)), KV_OK);
    assert_int_equal(kvd_tenants_count(t), 3);
    uint32_t id;
    assert_int_equal(kvd_tenants_resolve(t, 1001, 5, &id), KV_OK);
    assert_string_equal(kvd_tenants_name(t, id), "infer");
    /* uid match beats an earlier... or later gid match. */
    assert_int_equal(kvd_tenants_resolve(t, 1000, 3000, &id), KV_OK);
    assert_string_equal(kvd_tenants_name(t, id), "infer");
    assert_int_equal(kvd_tenants_resolve(t, 4242, 3000, &id), KV_OK);
    assert_string_equal(kvd_tenants_name(t, id), "batch");
    /* First line with the gid wins. */
    assert_int_equal(kvd_tenants_resolve(t, 4243, 2000, &id), KV_OK);
    assert_string_equal(kvd_tenants_name(t, id), "infer");
    assert_int_equal(kvd_tenants_resolve(t, 4244, 1, &id), KV_OK);
    assert_string_equal(kvd_tenants_name(t, id), "uid-4244");
    kvd_tenants_free(t);
}

static void test_bad_lines(void **state) {
    (void)state;
    const char *bad[] = {
        "tenent x uid=1\n",
        "tenant\n",
        "tenant x\n",
        "tenant x uid=\n",
        "tenant x uid=a\n",
        "tenant x uid=1 foo=2\n",
        "tenant uid-5 uid=5\n",
        "tenant a/b uid=1\n",
        "tenant x uid=1\ntenant x uid=2\n",
        "tenant x uid=1 uid=2\n",
        "tenant x gid=1,\n",
        "tiers model=m\n",
        "tiers write=up\n",
        "tiers remote-write=later\n",
        "tiers remote-write=write-back remote-write=write-back\n",
        "tiers domains=zz write=write-back\n",
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        kvd_tenants *t;
        assert_int_equal(kvd_tenants_alloc(&t), KV_OK);
        char err[256] = "";
        if (kvd_tenants_parse(t, bad[i], "f", err, sizeof(err)) != KV_EINVAL) {
            fail_msg("accepted: %s", bad[i]);
        }
        assert_non_null(strstr(err, "f:"));
        kvd_tenants_free(t);
    }
    kvd_tenants *t;
    assert_int_equal(kvd_tenants_alloc(&t), KV_OK);
    char err[256];
    assert_int_equal(kvd_tenants_load(t, "/nonexistent/tenants", err, sizeof(err)), KV_ESYS);
    kvd_tenants_free(t);
}

static void test_tiers_lines(void **state) {
    (void)state;
    kvd_tenants *t;
    assert_int_equal(kvd_tenants_alloc(&t), KV_OK);
    char err[256];
    const char *text = "tenant a uid=1\n"
                       "tenant b uid=2\n"
                       "group g members=a,b\n"
                       "tiers model=sys domains=a,group:g write=write-through\n"
                       "tiers domains=b min-hits=3 clean-ahead=5 remote-write=write-back\n"
                       "tiers model=sys write=write-back\n";
    assert_int_equal(kvd_tenants_parse(t, text, "tenants", err, sizeof(err)), KV_OK);
    uint32_t a, b;
    assert_int_equal(kvd_tenants_find(t, "a", &a), KV_OK);
    assert_int_equal(kvd_tenants_find(t, "b", &b), KV_OK);
    uint32_t doms[KVD_MAX_DOMAINS_PER_TENANT];
    assert_int_equal(kvd_tenants_domains(t, a, doms), 2);
    uint32_t g = doms[1];
    const kvd_tiers_line *l = kvd_tenants_tiers_rule(t, "sys", a);
    assert_non_null(l);
    assert_int_equal(l->write_through, 1);
    assert_int_equal(l->remote_back, -1);
    assert_int_equal(l->min_hits, -1);
    assert_int_equal(l->lineno, 4);
    assert_int_equal(kvd_tenants_tiers_rule(t, "sys", g)->lineno, 4);
    /* b: its own line first for any model, then the model line for others' domains. */
    l = kvd_tenants_tiers_rule(t, "sys", b);
    assert_int_equal(l->lineno, 5);
    assert_int_equal(l->min_hits, 3);
    assert_int_equal(l->clean_ahead, 5);
    assert_int_equal(l->write_through, -1);
    assert_int_equal(l->remote_back, 1);
    assert_int_equal(kvd_tenants_tiers_rule(t, "sys", 4242)->lineno, 6);
    assert_null(kvd_tenants_tiers_rule(t, "other", a));
    assert_int_equal(kvd_tenants_tiers_rule(t, "other", b)->lineno, 5);
    kvd_tenants_free(t);
}

static void test_table_full(void **state) {
    (void)state;
    kvd_tenants *t;
    assert_int_equal(kvd_tenants_alloc(&t), KV_OK);
    uint32_t id;
    for (uint32_t u = 0; u < KVD_MAX_TENANTS; u++) {
        assert_int_equal(kvd_tenants_resolve(t, u, 0, &id), KV_OK);
        assert_true(id < KVD_MAX_TENANTS);
    }
    assert_int_equal(kvd_tenants_resolve(t, 999999, 0, &id), KV_EQUOTA);
    assert_int_equal(kvd_tenants_resolve(t, 5, 0, &id), KV_OK);
    assert_int_equal(id, 5);
    kvd_tenants_free(t);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_default_uid_tenants), cmocka_unit_test(test_file_mapping),
        cmocka_unit_test(test_bad_lines),           cmocka_unit_test(test_tiers_lines),
        cmocka_unit_test(test_table_full),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
