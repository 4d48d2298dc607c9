/* man_test: docs/man/kvd.8 and docs/man/kvctl.1 are exactly what the option and admin command
 * tables generate (regenerate with `kvd --print-man=kvd > docs/man/kvd.8` and
 * `kvd --print-man=kvctl > docs/man/kvctl.1`), every option and command is in them, and groff
 * (when installed) renders them without a warning. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "daemon/config/config.h"
#include "daemon/ops/admin_cmds.h"
#include "daemon/ops/man.h"

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

static char *generate(const char *page) {
    char *out = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&out, &len);
    assert_non_null(f);
    assert_int_equal(kvd_man_write(f, page), 0);
    fclose(f);
    return out;
}

static void check_current(const char *page, const char *path) {
    char *have = read_file(path);
    assert_non_null(have);
    char *want = generate(page);
    if (strcmp(have, want) != 0) {
        size_t i = 0;
        while (have[i] != '\0' && have[i] == want[i]) {
            i++;
        }
        fail_msg("%s is stale (first difference at byte %zu); regenerate with "
                 "`kvd --print-man=%s > %s`",
                 path, i, page, path);
    }
    free(have);
    free(want);
}

/* groff's warnings (-ww) for the page, if groff is installed; the output must be empty. */
static void check_lint(const char *path) {
    if (system("command -v groff >/dev/null 2>&1") != 0) {
        print_message("groff not installed: %s not linted\n", path);
        return;
    }
    char cmd[512];
    snprintf(cmd, sizeof(cmd), "groff -man -ww -z -Tutf8 %s 2>&1", path);
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    char buf[4096];
    size_t n = fread(buf, 1, sizeof(buf) - 1, p);
    buf[n] = '\0';
    assert_int_equal(pclose(p), 0);
    if (n != 0) {
        fail_msg("groff warns about %s:\n%s", path, buf);
    }
}

static void test_kvd_page(void **state) {
    (void)state;
    check_current("kvd", "docs/man/kvd.8");
    check_lint("docs/man/kvd.8");
    char *have = read_file("docs/man/kvd.8");
    size_t n;
    const kvd_config_option *o = kvd_config_options(&n);
    for (size_t i = 0; i < n; i++) {
        /* the flag as roff writes it: hyphens are \- */
        char flag[128] = "\\fB\\-\\-";
        size_t k = strlen(flag);
        for (const char *s = o[i].name; *s != '\0' && k + 3 < sizeof(flag); s++) {
            if (*s == '-') {
                flag[k++] = '\\';
            }
            flag[k++] = *s;
        }
        flag[k] = '\0';
        if (strstr(have, flag) == NULL) {
            fail_msg("option %s missing from kvd.8", o[i].name);
        }
    }
    free(have);
}

static void test_kvctl_page(void **state) {
    (void)state;
    check_current("kvctl", "docs/man/kvctl.1");
    check_lint("docs/man/kvctl.1");
    char *have = read_file("docs/man/kvctl.1");
    size_t n;
    const kvd_admin_cmd *c = kvd_admin_cmds(&n);
    for (size_t i = 0; i < n; i++) {
        /* The page writes a '-' of a name as groff's "\-". */
        char name[96], row[128];
        size_t k = 0;
        for (const char *q = c[i].name; *q != '\0' && k + 3 < sizeof(name); q++) {
            if (*q == '-') {
                name[k++] = '\\';
            }
            name[k++] = *q;
        }
        name[k] = '\0';
        snprintf(row, sizeof(row), ".TP\n\\fB%s\\fR", name);
        if (strstr(have, row) == NULL) {
            fail_msg("command %s missing from kvctl.1", c[i].name);
        }
    }
    free(have);
}

static void test_unknown_page(void **state) {
    (void)state;
    FILE *f = fopen("/dev/null", "w");
    assert_non_null(f);
    assert_int_equal(kvd_man_write(f, "kvd.conf"), -1);
    fclose(f);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_kvd_page),
        cmocka_unit_test(test_kvctl_page),
        cmocka_unit_test(test_unknown_page),
    };
    return cmocka_run_group_tests_name("man", tests, NULL, NULL);
}
