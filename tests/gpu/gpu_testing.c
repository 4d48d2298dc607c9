/* gpu_testing: the GPU tests' shared set-up (see gpu_testing.h). */
#include "tests/gpu/gpu_testing.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/kv_cuda.h"

void kvd_gpu_test_use_fake_driver(void) {
    static char path[4096];
    const char *src = getenv("TEST_SRCDIR");
    const char *ws = getenv("TEST_WORKSPACE");
    if (src != NULL && ws != NULL) {
        snprintf(path, sizeof(path), "%s/%s/daemon/testing/libfakecuda.so", src, ws);
    } else {
        char cwd[2048];
        snprintf(path, sizeof(path), "%s/daemon/testing/libfakecuda.so",
                 getcwd(cwd, sizeof(cwd)) != NULL ? cwd : ".");
    }
    setenv("KV_CUDA_LIBRARY", path, 1);
}

int kvd_gpu_test_probe(char *why, size_t len) {
    int p[2];
    if (pipe(p) != 0) {
        snprintf(why, len, "pipe failed");
        return -1;
    }
    fflush(NULL);
    pid_t pid = fork();
    if (pid < 0) {
        close(p[0]);
        close(p[1]);
        snprintf(why, len, "fork failed");
        return -1;
    }
    if (pid == 0) {
        close(p[0]);
        kv_cuda probe;
        char msg[256] = "";
        int ok = kv_cuda_load(NULL, &probe, msg, sizeof(msg)) == KV_OK;
        if (write(p[1], msg, strlen(msg) + 1) < 0) {
            _exit(3);
        }
        _exit(ok ? 0 : 1);
    }
    close(p[1]);
    ssize_t n = read(p[0], why, len - 1);
    why[n > 0 ? (size_t)n : 0] = '\0';
    close(p[0]);
    int st = 0;
    if (waitpid(pid, &st, 0) != pid) {
        snprintf(why, len, "waitpid failed");
        return -1;
    }
    return WIFEXITED(st) && WEXITSTATUS(st) == 0 ? 0 : -1;
}
