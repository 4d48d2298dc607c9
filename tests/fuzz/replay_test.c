/* replay_test: the regression test of a fuzz harness. Linked with one fuzz_*.c instead of
 * libFuzzer, it feeds the harness every file of the directories named on its command line (the
 * harness's committed seed corpus and its crash inputs, one directory each), so every input
 * that ever crashed stays a test. A directory may hold no inputs only if its name has "crashes"
 * in it. A harness that aborts fails the test with the file's name printed first. */
#include <dirent.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <cmocka.h>

#include "tests/fuzz/fuzz.h"

static int replay_file(const char *path) {
    FILE *f = fopen(path, "rb");
    if (f == NULL) {
        return -1;
    }
    struct stat st;
    if (fstat(fileno(f), &st) != 0 || !S_ISREG(st.st_mode)) {
        fclose(f);
        return 0;
    }
    uint8_t *buf = malloc(st.st_size > 0 ? (size_t)st.st_size : 1);
    size_t n = buf != NULL ? fread(buf, 1, (size_t)st.st_size, f) : 0;
    fclose(f);
    if (buf == NULL || n != (size_t)st.st_size) {
        free(buf);
        return -1;
    }
    fprintf(stderr, "replay %s (%zu bytes)\n", path, n);
    LLVMFuzzerTestOneInput(buf, n);
    free(buf);
    return 1;
}

static void test_replay_dir(void **state) {
    const char *dir = *state;
    DIR *d = opendir(dir);
    assert_non_null(d);
    int inputs = 0;
    struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        if (de->d_name[0] == '.' || strcmp(de->d_name, "README") == 0) {
            continue;
        }
        char path[4096];
        snprintf(path, sizeof(path), "%s/%s", dir, de->d_name);
        int rc = replay_file(path);
        assert_true(rc >= 0);
        inputs += rc;
    }
    closedir(d);
    printf("%s: %d inputs replayed\n", dir, inputs);
    if (strstr(dir, "crashes") == NULL) {
        assert_true(inputs > 0);
    }
}

int main(int argc, char **argv) {
    if (argc < 2 || argc > 9) {
        fprintf(stderr, "usage: %s DIR...\n", argv[0]);
        return 2;
    }
    struct CMUnitTest tests[8];
    for (int i = 1; i < argc; i++) {
        struct CMUnitTest t = {argv[i], test_replay_dir, NULL, NULL, argv[i]};
        tests[i - 1] = t;
    }
    return _cmocka_run_group_tests("replay", tests, (size_t)(argc - 1), NULL, NULL);
}
