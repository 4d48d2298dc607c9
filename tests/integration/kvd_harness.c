/* kvd_harness: see kvd_harness.h. kvd is found as the runfile daemon/kvd (the test's working
 * directory is the runfiles root under `bazel test`). */
#include "tests/integration/kvd_harness.h"

#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "common/kv_wire.h"

#define KVD_PATH "daemon/kvd"

static void sleep_ms(int ms) {
    struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000};
    nanosleep(&ts, NULL);
}

int kvd_harness_raw_connect(const kvd_harness *h) {
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        return -1;
    }
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", h->sock);
    if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
        close(fd);
        return -1;
    }
    struct timeval tv = {.tv_sec = 5};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    return fd;
}

static int can_connect(const char *sock) {
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", sock);
    int ok = fd >= 0 && connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0;
    if (fd >= 0) {
        close(fd);
    }
    return ok;
}

int kvd_harness_spawn(char *const *argv, const char *sock, int timeout_ms, const char *who,
                      pid_t *pid) {
    *pid = 0;
    pid_t child = fork();
    if (child < 0) {
        fprintf(stderr, "%s: fork: %s\n", who, strerror(errno));
        return -1;
    }
    if (child == 0) {
        execvp(argv[0], argv);
        fprintf(stderr, "%s: exec %s: %s\n", who, argv[0], strerror(errno));
        _exit(127);
    }
    for (int waited = 0; waited < timeout_ms; waited += 10) {
        if (can_connect(sock)) {
            *pid = child;
            return 0;
        }
        int st;
        if (waitpid(child, &st, WNOHANG) == child) {
            fprintf(stderr, "%s: kvd exited during start (status %d)\n", who, st);
            return -1;
        }
        sleep_ms(10);
    }
    fprintf(stderr, "%s: kvd did not accept on %s within %d ms\n", who, sock, timeout_ms);
    *pid = child;
    return -1;
}

int kvd_harness_kill(pid_t pid, int timeout_ms) {
    kill(pid, SIGTERM);
    int st = 0;
    for (int waited = 0; waited < timeout_ms; waited += 10) {
        if (waitpid(pid, &st, WNOHANG) == pid) {
            return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
        }
        sleep_ms(10);
    }
    kill(pid, SIGKILL);
    waitpid(pid, &st, 0);
    return -1;
}

int kvd_harness_make_dir(char *dir, size_t cap, const char *prefix, size_t max_tmp_len) {
    const char *tmp = getenv("TEST_TMPDIR");
    snprintf(dir, cap, "%s/%s-XXXXXX", tmp && strlen(tmp) < max_tmp_len ? tmp : "/tmp", prefix);
    if (mkdtemp(dir) == NULL) {
        /* TEST_TMPDIR paths can be long; a socket path must fit in 108 bytes. */
        snprintf(dir, cap, "/tmp/%s-XXXXXX", prefix);
        if (mkdtemp(dir) == NULL) {
            return -1;
        }
    }
    return 0;
}

static int spawn(kvd_harness *h) {
    char sockflag[200];
    snprintf(sockflag, sizeof(sockflag), "--socket=%s", h->sock);
    char *argv[14];
    int n = 0;
    argv[n++] = KVD_PATH;
    argv[n++] = sockflag;
    argv[n++] = "--log-level=warn";
    /* The tests check memfd sharing: pin host so a GPU machine's `auto` does not change it
     * (a later --backend in args overrides this one). */
    argv[n++] = "--backend=host";
    for (int i = 0; i < h->nargs; i++) {
        argv[n++] = h->args[i];
    }
    argv[n] = NULL;
    if (kvd_harness_spawn(argv, h->sock, 10000, "harness", &h->pid) != 0) {
        kvd_harness_stop(h); /* only when it is still running after 10 s */
        return -1;
    }
    return 0;
}

int kvd_harness_start(kvd_harness *h, const char *const *flags) {
    memset(h, 0, sizeof(*h));
    if (kvd_harness_make_dir(h->dir, sizeof(h->dir), "kvd-it", 60) != 0) {
        return -1;
    }
    snprintf(h->sock, sizeof(h->sock), "%s/kvd.sock", h->dir);
    for (int i = 0; flags != NULL && flags[i] != NULL && i < 8; i++) {
        snprintf(h->args[i], sizeof(h->args[i]), "%s", flags[i]);
        h->nargs++;
    }
    return spawn(h);
}

int kvd_harness_stop(kvd_harness *h) {
    if (h->pid == 0) {
        return -1;
    }
    int st = kvd_harness_kill(h->pid, 5000);
    h->pid = 0;
    return st;
}

int kvd_harness_restart(kvd_harness *h) {
    kvd_harness_stop(h);
    unlink(h->sock);
    return spawn(h);
}

void kvd_harness_fini(kvd_harness *h) {
    if (h->pid != 0) {
        kvd_harness_stop(h);
    }
    unlink(h->sock);
    rmdir(h->dir);
}

kv_err kvd_harness_connect(const kvd_harness *h, const char *name, kvc_conn **out) {
    kvc_options o;
    kvc_options_init(&o);
    o.socket_path = h->sock;
    o.client_name = name;
    o.timeout_ms = 5000;
    return kvc_conn_open(&o, out);
}

kv_layout kvd_harness_layout(void) {
    kv_layout l;
    memset(&l, 0, sizeof(l));
    l.num_layers = 2;
    l.num_kv_heads = 2;
    l.head_dim = 64;
    l.tokens_per_block = 16;
    l.dtype = KV_DTYPE_FP16;
    l.arrangement = KV_LAYER_MAJOR;
    return l;
}

int kvd_harness_raw_read(int fd, struct Kvd__Envelope **env) {
    uint8_t *buf = malloc(2u << 20);
    size_t len = 0;
    int rc = -1;
    while (buf != NULL && len < (2u << 20)) {
        Kvd__Envelope *e;
        size_t used;
        if (kv_wire_decode(buf, len, 2u << 20, &e, &used) != KV_OK) {
            break;
        }
        if (e != NULL) {
            *env = e;
            rc = 0;
            break;
        }
        ssize_t n = recv(fd, buf + len, 1, 0); /* byte by byte: never eat the next frame */
        if (n <= 0) {
            break;
        }
        len += (size_t)n;
    }
    free(buf);
    return rc;
}

int kvd_harness_raw_closed(int fd) {
    char b[4096];
    for (;;) {
        ssize_t n = recv(fd, b, sizeof(b), 0);
        if (n == 0) {
            return 1;
        }
        if (n < 0) {
            return errno == ECONNRESET;
        }
    }
}

uint64_t kvd_harness_wait_stat(kvc_conn *c, uint32_t pool_id, const char *name, uint64_t want) {
    uint64_t v = UINT64_MAX;
    for (int i = 0; i < 1000; i++) {
        if (kvc_stat_get(c, pool_id, name, &v) == KV_OK && v == want) {
            return v;
        }
        sleep_ms(10);
    }
    return v;
}

int kvd_harness_finish(kvd_harness *h) {
    int st = kvd_harness_stop(h);
    kvd_harness_fini(h);
    return st == 0 ? 0 : -1;
}

uint64_t kvd_harness_stat(kvc_conn *c, uint32_t pool_id, const char *name) {
    uint64_t v = 0;
    assert_int_equal(kvc_stat_get(c, pool_id, name, &v), KV_OK);
    return v;
}

kv_err kvd_harness_alloc_all(kvc_pool *p, kvc_block *out, uint32_t n, uint32_t per) {
    for (uint32_t i = 0; i < n; i += per) {
        kv_err rc = kvc_allocate(p, per, out + i);
        if (rc != KV_OK) {
            return rc;
        }
    }
    return KV_OK;
}

void kvd_harness_sleep_ms(int ms) {
    sleep_ms(ms);
}
