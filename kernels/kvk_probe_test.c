/* Runs everywhere: the probe must answer without crashing, and on a machine without a GPU say
 * so. When KVD_EXPECT_GPU=1 is set (tests/gpu/bundle/run.sh), a GPU must be found. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "kernels/kvk.h"

static void test_probe_answers(void **state) {
    (void)state;
    char why[256];
    memset(why, 'x', sizeof(why));
    int n = kvk_gpu_probe(why, sizeof(why));
    assert_true(n >= 0);
    assert_non_null(memchr(why, '\0', sizeof(why)));
    printf("kvk_gpu_probe: built_with_cuda=%d devices=%d (%s)\n", kvk_built_with_cuda(), n, why);
    const char *expect = getenv("KVD_EXPECT_GPU");
    if (expect != NULL && strcmp(expect, "1") == 0) {
        assert_true(n > 0);
    }
    if (n == 0) {
        assert_non_null(strstr(why, "no usable GPU"));
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_probe_answers),
    };
    return cmocka_run_group_tests_name("kvk_probe", tests, NULL, NULL);
}
