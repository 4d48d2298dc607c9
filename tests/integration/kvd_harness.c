/* kvd_harness: see kvd_harness.h. kvd is found as the runfile daemon/kvd (the test's working
 * directory is the runfiles root under `bazel test`). */
#include "tests/integration/kvd_harness.h"

#include <errno.h>
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
    pid_t pid = fork();
    if (pid < 0) {
        return -1;
    }
    if (pid == 0) {
        execv(KVD_PATH, argv);
        fprintf(stderr, "harness: exec %s: %s\n", KVD_PATH, strerror(errno));
        _exit(127);
    }
    h->pid = pid;
    for (int i = 0; i < 1000; i++) {
        int fd = kvd_harness_raw_connect(h);
        if (fd >= 0) {
            close(fd);
            return 0;
        }
        int st;
        if (waitpid(pid, &st, WNOHANG) == pid) {
            fprintf(stderr, "harness: kvd exited during start (status %d)\n", st);
            h->pid = 0;
            return -1;
        }
        sleep_ms(10);
    }
    fprintf(stderr, "harness: kvd did not accept on %s within 10 s\n", h->sock);
    kvd_harness_stop(h);
    return -1;
}

int kvd_harness_start(kvd_harness *h, const char *const *flags) {
    memset(h, 0, sizeof(*h));
    const char *tmp = getenv("TEST_TMPDIR");
    snprintf(h->dir, sizeof(h->dir), "%s/kvd-it-XXXXXX", tmp && strlen(tmp) < 60 ? tmp : "/tmp");
    if (mkdtemp(h->dir) == NULL) {
        /* TEST_TMPDIR paths can be long; a socket path must fit in 108 bytes. */
        snprintf(h->dir, sizeof(h->dir), "/tmp/kvd-it-XXXXXX");
        if (mkdtemp(h->dir) == NULL) {
            return -1;
        }
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
    kill(h->pid, SIGTERM);
    int st = 0;
    for (int i = 0; i < 500; i++) {
        if (waitpid(h->pid, &st, WNOHANG) == h->pid) {
            h->pid = 0;
            return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
        }
        sleep_ms(10);
    }
    kill(h->pid, SIGKILL);
    waitpid(h->pid, &st, 0);
    h->pid = 0;
    return -1;
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
