/* config_test: the option table parses flags and files, reports bad input, and is documented
 * in full by --help and deploy/kvd.conf (with the true defaults). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "daemon/config/config.h"

static void test_defaults(void **state) {
    (void)state;
    kvd_config c;
    kvd_config_init(&c);
    assert_int_equal(c.pool_memory, 1ull << 30);
    assert_int_equal(c.segment_bytes, 64ull << 20);
    assert_int_equal(c.max_connections, 1024);
    assert_int_equal(c.max_inflight, 64);
    assert_int_equal(c.max_output_bytes, 8ull << 20);
    assert_int_equal(c.max_blocks_per_request, 4096);
    assert_int_equal(c.socket_mode, 0600);
    assert_int_equal(c.socket_dir_mode, 0700);
    assert_string_equal(c.backend, "auto");
    assert_int_equal(c.device, 0);
    assert_string_equal(c.socket, "");
    assert_int_equal(c.hugepages, 0);
    assert_int_equal(c.log_level, KV_LOG_INFO);
}

static void test_flags(void **state) {
    (void)state;
    kvd_config c;
    kvd_config_init(&c);
    char *argv[] = {"kvd",
                    "--pool-memory=2G",
                    "--socket=/x/y.sock",
                    "--hugepages=yes",
                    "--log-level=debug",
                    "--socket-mode=0666",
                    "--max-inflight=7"};
    int help = 0;
    char err[256];
    assert_int_equal(kvd_config_parse_args(&c, 7, argv, &help, err, sizeof(err)), KV_OK);
    assert_int_equal(help, 0);
    assert_int_equal(c.pool_memory, 2ull << 30);
    assert_string_equal(c.socket, "/x/y.sock");
    assert_int_equal(c.hugepages, 1);
    assert_int_equal(c.log_level, KV_LOG_DEBUG);
    assert_int_equal(c.socket_mode, 0666);
    assert_int_equal(c.max_inflight, 7);

    char *argv2[] = {"kvd", "--help"};
    assert_int_equal(kvd_config_parse_args(&c, 2, argv2, &help, err, sizeof(err)), KV_OK);
    assert_int_equal(help, 1);
}

static void test_flag_errors(void **state) {
    (void)state;
    kvd_config c;
    kvd_config_init(&c);
    int help = 0;
    char err[256];
    char *unknown[] = {"kvd", "--no-such-thing=1"};
    assert_int_equal(kvd_config_parse_args(&c, 2, unknown, &help, err, sizeof(err)), KV_ENOENT);
    assert_non_null(strstr(err, "no-such-thing"));
    char *notnum[] = {"kvd", "--pool-memory=lots"};
    assert_int_equal(kvd_config_parse_args(&c, 2, notnum, &help, err, sizeof(err)), KV_EINVAL);
    assert_non_null(strstr(err, "pool-memory"));
    char *range[] = {"kvd", "--max-inflight=0"};
    assert_int_equal(kvd_config_parse_args(&c, 2, range, &help, err, sizeof(err)), KV_EINVAL);
    char *shape[] = {"kvd", "pool-memory"};
    assert_int_equal(kvd_config_parse_args(&c, 2, shape, &help, err, sizeof(err)), KV_EINVAL);
    char *suffix[] = {"kvd", "--pool-memory=3X"};
    assert_int_equal(kvd_config_parse_args(&c, 2, suffix, &help, err, sizeof(err)), KV_EINVAL);
    char *mode[] = {"kvd", "--socket-mode=0999"};
    assert_int_equal(kvd_config_parse_args(&c, 2, mode, &help, err, sizeof(err)), KV_EINVAL);
    char *backend[] = {"kvd", "--backend=floppy"};
    assert_int_equal(kvd_config_parse_args(&c, 2, backend, &help, err, sizeof(err)), KV_EINVAL);
    char *level[] = {"kvd", "--log-level=loud"};
    assert_int_equal(kvd_config_parse_args(&c, 2, level, &help, err, sizeof(err)), KV_EINVAL);
    char *overflow[] = {"kvd", "--pool-memory=99999999999999999999T"};
    assert_int_equal(kvd_config_parse_args(&c, 2, overflow, &help, err, sizeof(err)), KV_EINVAL);
    char *rwrite[] = {"kvd", "--remote-write=sometimes"};
    assert_int_equal(kvd_config_parse_args(&c, 2, rwrite, &help, err, sizeof(err)), KV_EINVAL);
    assert_non_null(strstr(err, "remote-write"));
    char *drain[] = {"kvd", "--remote-drain-s=3601"};
    assert_int_equal(kvd_config_parse_args(&c, 2, drain, &help, err, sizeof(err)), KV_EINVAL);
    /* Errors leave the defaults alone. */
    assert_int_equal(c.pool_memory, 1ull << 30);
    assert_string_equal(c.remote_write, "write-through");
    assert_int_equal(c.remote_drain_s, 10);
    assert_int_equal(c.max_inflight, 64);
}

static void test_text(void **state) {
    (void)state;
    kvd_config c;
    kvd_config_init(&c);
    char err[256];
    const char *text = "# comment\n\n  segment-bytes = 4M  # trailing\nsocket=\n"
                       "evict-policy = s3fifo\r\n";
    assert_int_equal(kvd_config_parse_text(&c, text, "t", err, sizeof(err)), KV_OK);
    assert_int_equal(c.segment_bytes, 4ull << 20);
    assert_string_equal(c.evict_policy, "s3fifo");

    assert_int_equal(kvd_config_parse_text(&c, "a\nsegment-bytes 5\n", "f.conf", err, sizeof(err)),
                     KV_EINVAL);
    assert_non_null(strstr(err, "f.conf:1"));
    assert_int_equal(kvd_config_parse_text(&c, "\n\nbogus = 1\n", "f.conf", err, sizeof(err)),
                     KV_ENOENT);
    assert_non_null(strstr(err, "f.conf:3"));
}

static void test_file_and_flag_order(void **state) {
    (void)state;
    char path[] = "/tmp/kvd-config-test-XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    const char *text = "max-connections = 5\nmax-inflight = 9\n";
    assert_int_equal(write(fd, text, strlen(text)), (ssize_t)strlen(text));
    close(fd);
    char flag[64];
    snprintf(flag, sizeof(flag), "--config=%s", path);
    /* The flag comes first but still overrides the file. */
    char *argv[] = {"kvd", "--max-inflight=3", flag};
    kvd_config c;
    kvd_config_init(&c);
    int help = 0;
    char err[256];
    assert_int_equal(kvd_config_parse_args(&c, 3, argv, &help, err, sizeof(err)), KV_OK);
    assert_int_equal(c.max_connections, 5);
    assert_int_equal(c.max_inflight, 3);
    unlink(path);
    char *missing[] = {"kvd", "--config=/nonexistent/kvd.conf"};
    assert_int_equal(kvd_config_parse_args(&c, 2, missing, &help, err, sizeof(err)), KV_ESYS);
}

static void test_help_lists_every_option(void **state) {
    (void)state;
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    assert_non_null(f);
    kvd_config_print_help(f);
    fclose(f);
    size_t n;
    const kvd_config_option *opts = kvd_config_options(&n);
    for (size_t i = 0; i < n; i++) {
        char flag[128];
        snprintf(flag, sizeof(flag), "--%s=", opts[i].name);
        if (strstr(buf, flag) == NULL) {
            fail_msg("--help misses option %s", opts[i].name);
        }
        if (strstr(buf, opts[i].description) == NULL) {
            fail_msg("--help misses the description of %s", opts[i].name);
        }
    }
    free(buf);
}

/* deploy/kvd.conf names every option as "# name = default"; uncommented, it parses and yields
 * exactly the built-in defaults. */
static void test_example_conf_is_complete(void **state) {
    (void)state;
    FILE *f = fopen("deploy/kvd.conf", "r");
    assert_non_null(f);
    char *text = calloc(1, 1 << 20);
    assert_non_null(text);
    size_t len = fread(text, 1, (1 << 20) - 1, f);
    fclose(f);
    text[len] = '\0';

    size_t n;
    const kvd_config_option *opts = kvd_config_options(&n);
    char *uncommented = calloc(1, len + 1);
    assert_non_null(uncommented);
    size_t out = 0;
    for (char *line = text; line != NULL && *line != '\0';) {
        char *next = strchr(line, '\n');
        size_t l = next ? (size_t)(next - line) : strlen(line);
        const char *body = line;
        size_t bl = l;
        if (l > 2 && line[0] == '#' && line[1] == ' ') {
            for (size_t i = 0; i < n; i++) {
                size_t nl = strlen(opts[i].name);
                if (l >= 2 + nl + 2 && strncmp(line + 2, opts[i].name, nl) == 0 &&
                    strncmp(line + 2 + nl, " =", 2) == 0) {
                    body = line + 2;
                    bl = l - 2;
                }
            }
        }
        if (body != line || line[0] != '#') {
            memcpy(uncommented + out, body, bl);
            out += bl;
            uncommented[out++] = '\n';
        }
        line = next ? next + 1 : NULL;
    }
    for (size_t i = 0; i < n; i++) {
        char key[128];
        snprintf(key, sizeof(key), "\n%s =", opts[i].name);
        char head[128];
        snprintf(head, sizeof(head), "%s =", opts[i].name);
        if (strstr(uncommented, key) == NULL && strncmp(uncommented, head, strlen(head)) != 0) {
            fail_msg("deploy/kvd.conf misses option %s", opts[i].name);
        }
    }
    kvd_config from_file, defaults;
    kvd_config_init(&defaults);
    kvd_config_init(&from_file);
    char err[256];
    assert_int_equal(
        kvd_config_parse_text(&from_file, uncommented, "deploy/kvd.conf", err, sizeof(err)), KV_OK);
    for (size_t i = 0; i < n; i++) {
        char a[256], b[256];
        kvd_config_format(&defaults, &opts[i], a, sizeof(a));
        kvd_config_format(&from_file, &opts[i], b, sizeof(b));
        if (strcmp(a, b) != 0) {
            fail_msg("deploy/kvd.conf gives %s = %s, the default is %s", opts[i].name, b, a);
        }
    }
    free(uncommented);
    free(text);
}

/* deploy/kvd.conf is exactly what `kvd --print-config` writes (kvd_config_print_example), and
 * the runtime-settable options are marked. */
static void test_example_conf_is_generated(void **state) {
    (void)state;
    FILE *f = fopen("deploy/kvd.conf", "r");
    assert_non_null(f);
    char *have = calloc(1, 1 << 20);
    assert_non_null(have);
    size_t len = fread(have, 1, (1 << 20) - 1, f);
    fclose(f);
    have[len] = '\0';
    char *want = NULL;
    size_t wlen = 0;
    FILE *m = open_memstream(&want, &wlen);
    assert_non_null(m);
    kvd_config_print_example(m);
    fclose(m);
    if (strcmp(have, want) != 0) {
        fail_msg(
            "deploy/kvd.conf is stale: regenerate with `kvd --print-config > deploy/kvd.conf`");
    }
    const kvd_config_option *o = kvd_config_find("log-level");
    assert_non_null(o);
    assert_true(o->runtime);
    assert_false(kvd_config_find("socket")->runtime);
    assert_null(kvd_config_find("no-such-option"));
    free(have);
    free(want);
}

/* Options that only make sense together: every reply must fit max-frame-bytes. */
static void test_cross_checks(void **state) {
    (void)state;
    kvd_config c;
    kvd_config_init(&c);
    char err[256];
    assert_int_equal(kvd_config_check(&c, err, sizeof(err)), KV_OK);
    assert_int_equal(kvd_config_set(&c, "max-frame-bytes", "64K", err, sizeof(err)), KV_OK);
    assert_int_equal(kvd_config_check(&c, err, sizeof(err)), KV_EINVAL);
    assert_non_null(strstr(err, "max-blocks-per-request"));
    assert_int_equal(kvd_config_set(&c, "max-blocks-per-request", "2048", err, sizeof(err)), KV_OK);
    assert_int_equal(kvd_config_check(&c, err, sizeof(err)), KV_OK);
    assert_int_equal(kvd_config_set(&c, "max-frame-bytes", "4096", err, sizeof(err)), KV_EINVAL);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cross_checks),
        cmocka_unit_test(test_defaults),
        cmocka_unit_test(test_flags),
        cmocka_unit_test(test_flag_errors),
        cmocka_unit_test(test_text),
        cmocka_unit_test(test_file_and_flag_order),
        cmocka_unit_test(test_help_lists_every_option),
        cmocka_unit_test(test_example_conf_is_complete),
        cmocka_unit_test(test_example_conf_is_generated),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
