/* proto/PROTOCOL.md's Stats section names exactly the pool statistics of the table
 * (kvd_pool_stat_descs): a field added to the table without the spec, or a name the spec lists
 * that the daemon does not report, fails here. (docs/ADMIN.md is generated from the same table
 * and checked by //daemon/ops:admin_doc_test.) */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "daemon/core/pool.h"

static char *read_file(const char *path) {
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    assert_non_null(buf);
    assert_int_equal(fread(buf, 1, (size_t)n, f), (size_t)n);
    buf[n] = '\0';
    fclose(f);
    return buf;
}

static void test_protocol_lists_every_pool_stat(void **state) {
    (void)state;
    char *doc = read_file("proto/PROTOCOL.md");
    const char *from = strstr(doc, "for every counter of `kvd_pool_stats`");
    assert_non_null(from);
    const char *to = strstr(from, "plus `pool.session_refs`");
    assert_non_null(to);
    size_t n;
    const kv_stat_desc *d = kvd_pool_stat_descs(&n);
    /* Every backticked name in the list is one of the table's, and every one of the table's is
     * in the list. */
    size_t listed = 0;
    for (const char *p = from + strlen("for every counter of `kvd_pool_stats`"); p < to;) {
        const char *a = strchr(p, '`');
        if (a == NULL || a >= to) {
            break;
        }
        const char *b = strchr(a + 1, '`');
        assert_non_null(b);
        char name[64];
        size_t len = (size_t)(b - a - 1);
        assert_true(len < sizeof(name));
        memcpy(name, a + 1, len);
        name[len] = '\0';
        int known = 0;
        for (size_t i = 0; i < n; i++) {
            known |= strcmp(d[i].name, name) == 0;
        }
        if (!known) {
            fail_msg("PROTOCOL.md lists pool.%s, which the daemon does not report", name);
        }
        listed++;
        p = b + 1;
    }
    for (size_t i = 0; i < n; i++) {
        char quoted[72];
        snprintf(quoted, sizeof(quoted), "`%s`", d[i].name);
        const char *at = strstr(from, quoted);
        if (at == NULL || at > to) {
            fail_msg("PROTOCOL.md's Stats section does not list pool.%s", d[i].name);
        }
    }
    assert_int_equal(listed, n);
    free(doc);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_protocol_lists_every_pool_stat),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
