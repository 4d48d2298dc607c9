/* admin_doc_test: docs/ADMIN.md is exactly what the command table generates (regenerate with
 * `bazel run //daemon:kvd -- --print-admin-doc > docs/ADMIN.md`), and every command's row and
 * section are in it. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "daemon/ops/admin_cmds.h"

static char *read_file(const char *path) {
    FILE *f = fopen(path, "r");
    if (f == NULL) {
        return NULL;
    }
    char *buf = calloc(1, 1 << 20);
    assert_non_null(buf);
    size_t n = fread(buf, 1, (1 << 20) - 1, f);
    buf[n] = '\0';
    fclose(f);
    return buf;
}

static void test_doc_is_current(void **state) {
    (void)state;
    char *have = read_file("docs/ADMIN.md");
    assert_non_null(have);
    char *want = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&want, &len);
    assert_non_null(f);
    kvd_admin_write_doc(f);
    fclose(f);
    if (strcmp(have, want) != 0) {
        size_t i = 0;
        while (have[i] != '\0' && have[i] == want[i]) {
            i++;
        }
        fail_msg("docs/ADMIN.md is stale (first difference at byte %zu); regenerate with "
                 "`kvd --print-admin-doc > docs/ADMIN.md`",
                 i);
    }
    size_t n;
    const kvd_admin_cmd *cmds = kvd_admin_cmds(&n);
    for (size_t k = 0; k < n; k++) {
        char row[128], sec[128];
        snprintf(row, sizeof(row), "| `%s` |", cmds[k].name);
        snprintf(sec, sizeof(sec), "\n### %s", cmds[k].name);
        assert_non_null(strstr(have, row));
        assert_non_null(strstr(have, sec));
        assert_non_null(cmds[k].run);
        assert_true(strlen(cmds[k].summary) > 0 && strlen(cmds[k].doc) > 0);
    }
    free(have);
    free(want);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_doc_is_current),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
