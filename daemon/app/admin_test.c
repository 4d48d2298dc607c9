/* admin_test: the admin socket and the metrics endpoint of a real in-process server (its own
 * loop in a thread): every command's reply over a real socket, error JSON for bad commands,
 * drain refusing a new Hello, the peer credential check (a forked child that setuid()s to
 * another uid is refused), and /metrics checked by `promtool check metrics`. Client traffic
 * (Hello, AttachPool, Allocate, Commit, Lookup, Release) is sent as raw kv_wire frames. */
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>
#include <jansson.h>
#include <uv.h>

#include "common/kv_layout.h"
#include "common/kv_log.h"
#include "common/kv_wire.h"
#include "daemon/ops/admin_cmds.h"
#include "daemon/config/config.h"
#include "daemon/ops/metrics.h"
#include "daemon/app/daemon.h"
#include "daemon/testing/raw_client.h"

typedef struct harness {
    kvd_test_server ts; /* the server on its temporary socket */
    char admin[128];    /* admin socket path */
} harness;

static uint16_t free_port(void) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(fd >= 0);
    struct sockaddr_in sin;
    memset(&sin, 0, sizeof(sin));
    sin.sin_family = AF_INET;
    sin.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    assert_int_equal(bind(fd, (struct sockaddr *)&sin, sizeof(sin)), 0);
    socklen_t len = sizeof(sin);
    assert_int_equal(getsockname(fd, (struct sockaddr *)&sin, &len), 0);
    close(fd);
    return ntohs(sin.sin_port);
}

static harness *start(void (*tweak)(kvd_config *)) {
    harness *h = calloc(1, sizeof(*h));
    assert_non_null(h);
    kvd_test_server_init(&h->ts, "admin-test");
    snprintf(h->admin, sizeof(h->admin), "%s/admin.sock", h->ts.dir);
    h->ts.cfg.pool_memory = 8 << 20;
    h->ts.cfg.segment_bytes = 64 << 10;
    h->ts.cfg.index_entries = 4096;
    h->ts.cfg.log_level = KV_LOG_WARN;
    if (tweak != NULL) {
        tweak(&h->ts.cfg);
    }
    kvd_test_server_start(&h->ts);
    return h;
}

static void stop(harness *h) {
    kvd_test_server_stop(&h->ts);
    /* Both socket files are gone after a clean stop. */
    assert_int_not_equal(access(h->ts.cfg.socket, F_OK), 0);
    assert_int_not_equal(access(h->admin, F_OK), 0);
    rmdir(h->ts.dir);
    free(h);
}

static int dial(harness *h) {
    return kvd_raw_dial(h->ts.cfg.socket);
}

static void release(int fd, uint32_t pool, Kvd__BlockRef **blocks, size_t n) {
    Kvd__Envelope e;
    Kvd__Release rel;
    kvd__envelope__init(&e);
    kvd__release__init(&rel);
    rel.pool_id = pool;
    rel.n_blocks = n;
    rel.blocks = blocks;
    e.id = kvd_raw_next_id();
    e.body_case = KVD__ENVELOPE__BODY_RELEASE;
    e.release = &rel;
    Kvd__Envelope *r = kvd_raw_rpc(fd, &e);
    if (r->body_case == KVD__ENVELOPE__BODY_ERROR) {
        fail_msg("release: %s", r->error->message);
    }
    kv_wire_free(r);
}

/* ---- admin socket helpers --------------------------------------------------------------- */

/* Reads one line (without '\n') into a malloc'd string; NULL on EOF first. */
static char *read_line(int fd) {
    size_t cap = 1 << 16, len = 0;
    char *buf = malloc(cap);
    assert_non_null(buf);
    for (;;) {
        if (len + 1 == cap) {
            cap *= 2;
            buf = realloc(buf, cap);
            assert_non_null(buf);
        }
        ssize_t n = recv(fd, buf + len, 1, 0);
        if (n <= 0) {
            if (len == 0) {
                free(buf);
                return NULL;
            }
            break;
        }
        if (buf[len] == '\n') {
            break;
        }
        len++;
    }
    buf[len] = '\0';
    return buf;
}

/* Sends one command line on fd and parses the reply line (which must be one JSON object). */
static json_t *cmd_on(int fd, const char *line) {
    char out[8192];
    snprintf(out, sizeof(out), "%s\n", line);
    kvd_raw_send(fd, out, strlen(out));
    char *reply = read_line(fd);
    assert_non_null(reply);
    assert_null(strchr(reply, '\n'));
    json_error_t err;
    json_t *o = json_loads(reply, 0, &err);
    if (o == NULL || !json_is_object(o)) {
        fail_msg("reply to '%s' is not a JSON object: %s", line, reply);
    }
    free(reply);
    return o;
}

static json_t *cmd(harness *h, const char *line) {
    int fd = kvd_raw_dial(h->admin);
    json_t *o = cmd_on(fd, line);
    close(fd);
    return o;
}

/* Runs line and returns its result (a new reference); fails the test on an error reply. */
static json_t *ok(harness *h, const char *line) {
    json_t *o = cmd(h, line);
    if (!json_is_true(json_object_get(o, "ok"))) {
        char *t = json_dumps(o, JSON_COMPACT);
        fail_msg("'%s' failed: %s", line, t);
    }
    json_t *r = json_incref(json_object_get(o, "result"));
    json_decref(o);
    assert_non_null(r);
    return r;
}

/* Runs line and checks it fails with code (name) and a message. */
static void fails(harness *h, const char *line, const char *code) {
    json_t *o = cmd(h, line);
    assert_true(json_is_false(json_object_get(o, "ok")));
    json_t *e = json_object_get(o, "error");
    assert_non_null(e);
    if (strcmp(json_string_value(json_object_get(e, "code")), code) != 0) {
        fail_msg("'%s': expected %s, got %s: %s", line, code,
                 json_string_value(json_object_get(e, "code")),
                 json_string_value(json_object_get(e, "message")));
    }
    assert_true(json_is_integer(json_object_get(e, "errno")));
    assert_true(strlen(json_string_value(json_object_get(e, "message"))) > 0);
    json_decref(o);
}

static long long jint(const json_t *o, const char *path) {
    char key[64];
    const char *p = path;
    while (o != NULL && *p != '\0') {
        const char *dot = strchr(p, '.');
        size_t kl = dot ? (size_t)(dot - p) : strlen(p);
        snprintf(key, sizeof(key), "%.*s", (int)kl, p);
        o = json_is_array(o) ? json_array_get(o, (size_t)atoi(key)) : json_object_get(o, key);
        p += kl + (dot ? 1 : 0);
    }
    if (!json_is_integer(o)) {
        fail_msg("%s is not an integer", path);
    }
    return (long long)json_integer_value(o);
}

/* A client with a 4-block prefix committed, released, looked up once and released again: four
 * CACHED blocks with one hit each. Returns the client fd (open) and the pool id. */
static int populate(harness *h, uint32_t *pool) {
    int fd = dial(h);
    kvd_raw_hello(fd, "admin_test");
    kvd_raw_attached at = kvd_raw_attach(fd, "admin-model");
    munmap(at.base, at.seg_bytes);
    Kvd__Envelope *r = kvd_raw_allocate(fd, at.pool_id, 4);
    assert_int_equal(r->body_case, KVD__ENVELOPE__BODY_ALLOCATE_REPLY);
    Kvd__BlockRef blocks[4];
    Kvd__BlockRef *pb[4];
    for (size_t i = 0; i < 4; i++) {
        blocks[i] = *r->allocate_reply->blocks[i];
        pb[i] = &blocks[i];
    }
    kv_wire_free(r);
    kvd_raw_commit(fd, at.pool_id, blocks, 4, 1000, KV_OK);
    release(fd, at.pool_id, pb, 4);
    r = kvd_raw_lookup(fd, at.pool_id, 1000, 4);
    assert_int_equal(r->body_case, KVD__ENVELOPE__BODY_LOOKUP_REPLY);
    assert_int_equal(r->lookup_reply->n_blocks, 4);
    release(fd, at.pool_id, r->lookup_reply->blocks, 4);
    kv_wire_free(r);
    *pool = at.pool_id;
    return fd;
}

/* ---- tests ------------------------------------------------------------------------------ */

static void test_commands(void **state) {
    (void)state;
    harness *h = start(NULL);
    uint32_t pool;
    int client = populate(h, &pool);

    json_t *r = ok(h, "help");
    size_t ncmd;
    kvd_admin_cmds(&ncmd);
    assert_int_equal(json_array_size(json_object_get(r, "commands")), ncmd);
    json_decref(r);

    r = ok(h, "info");
    char epoch[17];
    snprintf(epoch, sizeof(epoch), "%016llx", (unsigned long long)kvd_daemon_boot_epoch(h->ts.srv));
    assert_string_equal(json_string_value(json_object_get(r, "boot_epoch")), epoch);
    assert_non_null(json_string_value(json_object_get(r, "version")));
    assert_string_equal(json_string_value(json_object_get(r, "admin_socket")), h->admin);
    assert_true(json_is_true(json_object_get(r, "ready")));
    /* The kernel's word for its shmem THP mode (as kv_shmem_thp_mode reads it; not compared:
     * a root process on the host may change it between the two reads). */
    const char *thp = json_string_value(json_object_get(r, "shmem_thp"));
    assert_non_null(thp);
    assert_true(thp[0] != '\0');
    assert_string_equal(
        json_string_value(json_object_get(json_object_get(r, "config"), "index-entries")), "4096");
    json_decref(r);

    r = ok(h, "stats");
    json_t *p = json_array_get(json_object_get(r, "pools"), 0);
    assert_non_null(p);
    assert_int_equal(jint(p, "id"), pool);
    assert_int_equal(jint(p, "queries"), 1);
    assert_int_equal(jint(p, "query_blocks"), 4);
    assert_int_equal(jint(p, "hit_blocks"), 4);
    assert_int_equal(jint(p, "hit_tokens"), 16);
    assert_int_equal(jint(p, "commits"), 4);
    assert_int_equal(jint(p, "blocks_cached"), 4);
    assert_int_equal(jint(p, "hit_rate.query_blocks"), 4);
    json_t *t = NULL;
    json_t *tenants = json_object_get(r, "tenants");
    for (size_t i = 0; i < json_array_size(tenants); i++) {
        if (jint(json_array_get(tenants, i), "commits") > 0) {
            t = json_array_get(tenants, i);
        }
    }
    assert_non_null(t);
    assert_int_equal(jint(t, "queries"), 1);
    assert_int_equal(jint(t, "hit_blocks"), 4);
    assert_int_equal(jint(t, "hit_tokens"), 16);
    assert_int_equal(jint(t, "commits"), 4);
    assert_int_equal(jint(t, "blocks_cached"), 4);
    assert_int_equal(jint(t, "sessions"), 1);
    assert_int_equal(jint(r, "daemon.sessions"), 1);
    json_decref(r);

    r = ok(h, "pools");
    assert_int_equal(jint(r, "pools.0.layout.tokens_per_block"), 4);
    assert_string_equal(
        json_string_value(json_object_get(json_array_get(json_object_get(r, "pools"), 0), "model")),
        "admin-model");
    json_decref(r);

    r = ok(h, "sessions");
    assert_int_equal(json_array_size(json_object_get(r, "sessions")), 1);
    assert_int_equal(jint(r, "sessions.0.pid"), getpid());
    assert_int_equal(jint(r, "sessions.0.blocks_held"), 0);
    assert_string_equal(json_string_value(json_object_get(
                            json_array_get(json_object_get(r, "sessions"), 0), "client")),
                        "admin_test");
    json_decref(r);

    r = ok(h, "tenants");
    assert_true(json_array_size(json_object_get(r, "tenants")) >= 1);
    json_decref(r);

    /* The prefix is one chain of 4 blocks: one root, collapsed into one node. */
    r = ok(h, "prefixes");
    assert_int_equal(jint(r, "pools.0.prefixes"), 1);
    assert_int_equal(jint(r, "pools.0.top.0.blocks"), 4);
    assert_int_equal(jint(r, "pools.0.top.0.size"), 4);
    assert_int_equal(jint(r, "pools.0.top.0.depth"), 4);
    assert_int_equal(jint(r, "pools.0.top.0.hits"), 1);
    char hash[40];
    snprintf(hash, sizeof(hash), "%s",
             json_string_value(json_object_get(
                 json_array_get(
                     json_object_get(json_array_get(json_object_get(r, "pools"), 0), "top"), 0),
                 "hash")));
    json_decref(r);

    /* Pin the root; a dry run then shows only the three others, and why. */
    char line[256];
    snprintf(line, sizeof(line), "pin %s retention=600000", hash);
    r = ok(h, line);
    assert_int_equal(jint(r, "pool"), pool);
    json_decref(r);
    r = ok(h, "evict --dry-run all");
    assert_int_equal(jint(r, "would_evict"), 3);
    assert_int_equal(json_array_size(json_object_get(json_array_get(json_object_get(r, "pools"), 0),
                                                     "would_evict")),
                     3);
    json_decref(r);
    snprintf(line, sizeof(line), "unpin %s", hash);
    json_decref(ok(h, line));
    r = ok(h, "evict --dry-run all");
    assert_int_equal(jint(r, "would_evict"), 4);
    json_decref(r);
    r = ok(h, "stats");
    assert_int_equal(jint(r, "pools.0.blocks_cached"), 4); /* a dry run changes nothing */
    json_decref(r);
    snprintf(line, sizeof(line), "evict pool=%u max=1", pool);
    r = ok(h, line);
    assert_int_equal(jint(r, "evicted"), 1);
    json_decref(r);
    r = ok(h, "evict all");
    assert_int_equal(jint(r, "evicted"), 3);
    json_decref(r);
    r = ok(h, "stats");
    assert_int_equal(jint(r, "pools.0.blocks_cached"), 0);
    assert_int_equal(jint(r, "pools.0.evictions_admin"), 4);
    json_decref(r);
    r = ok(h, "events kind=evict");
    json_t *ev = json_object_get(r, "events");
    assert_int_equal(json_array_size(ev), 2);
    assert_string_equal(json_string_value(json_object_get(json_array_get(ev, 1), "reason")),
                        "admin");
    assert_int_equal(jint(r, "events.1.count"), 3);
    json_decref(r);

    /* Config: runtime options change live, others are refused. */
    r = ok(h, "config set max-inflight 7");
    assert_string_equal(json_string_value(json_object_get(r, "value")), "7");
    json_decref(r);
    r = ok(h, "config get max-inflight");
    assert_string_equal(json_string_value(json_object_get(r, "value")), "7");
    assert_true(json_is_true(json_object_get(r, "runtime")));
    json_decref(r);
    fails(h, "config set socket /tmp/x", "ENOTSUP");
    fails(h, "config set max-inflight lots", "EINVAL");
    fails(h, "config get no-such-option", "ENOENT");
    r = ok(h, "log level debug");
    assert_string_equal(json_string_value(json_object_get(r, "level")), "debug");
    json_decref(r);
    json_decref(ok(h, "log level warn"));
    assert_int_equal(kv_log_threshold, KV_LOG_WARN);

    /* Drain: open sessions go on, a new Hello is refused, ready fails. */
    r = ok(h, "drain");
    assert_true(json_is_true(json_object_get(r, "draining")));
    json_decref(r);
    fails(h, "ready", "EDRAINING");
    int late = dial(h);
    Kvd__Envelope e = KVD__ENVELOPE__INIT;
    Kvd__Hello hl = KVD__HELLO__INIT;
    hl.protocol_version = 1;
    hl.client_name = "late";
    e.id = kvd_raw_next_id();
    e.body_case = KVD__ENVELOPE__BODY_HELLO;
    e.hello = &hl;
    kvd_raw_expect_error(late, &e, KV_EDRAINING);
    close(late);
    Kvd__Envelope *lr = kvd_raw_lookup(client, pool, 7777, 1); /* the open session still works */
    assert_int_equal(lr->body_case, KVD__ENVELOPE__BODY_LOOKUP_REPLY);
    kv_wire_free(lr);
    r = ok(h, "events kind=refuse 1");
    assert_string_equal(json_string_value(json_object_get(
                            json_array_get(json_object_get(r, "events"), 0), "reason")),
                        "EDRAINING");
    json_decref(r);
    json_decref(ok(h, "drain off"));
    json_decref(ok(h, "ready"));

    /* quota and selftest answer through the tenancy module. */
    json_decref(ok(h, "quota get"));
    r = ok(h, "selftest isolation");
    assert_true(json_is_true(json_object_get(r, "passed")));
    json_decref(r);

    close(client);
    stop(h);
}

static void test_errors(void **state) {
    (void)state;
    harness *h = start(NULL);
    fails(h, "frobnicate", "ENOENT");
    fails(h, "config", "ENOENT"); /* a family name alone */
    fails(h, "info extra", "EINVAL");
    fails(h, "evict", "EINVAL"); /* no scope */
    fails(h, "evict tenant=nobody-here", "ENOENT");
    fails(h, "evict pool=99", "ENOENT");
    fails(h, "pin not-a-hash", "EINVAL");
    fails(h, "pin 00000000000000000000000000000000", "ENOENT");
    fails(h, "log level loud", "EINVAL");
    fails(h, "events kind=other", "EINVAL");
    fails(h, "prefixes top=0", "EINVAL");

    /* Several commands on one connection, blank lines ignored, JSON-hostile input escaped. */
    int fd = kvd_raw_dial(h->admin);
    kvd_raw_send(fd, "\n\n", 2);
    json_t *o = cmd_on(fd, "bad\"cmd\\\x01");
    assert_true(json_is_false(json_object_get(o, "ok")));
    assert_non_null(
        strstr(json_string_value(json_object_get(json_object_get(o, "error"), "message")),
               "bad\"cmd\\\x01"));
    json_decref(o);
    o = cmd_on(fd, "info");
    assert_true(json_is_true(json_object_get(o, "ok")));
    json_decref(o);
    /* A line over the limit: ETOOBIG, then the connection closes. */
    char *big = malloc(KVD_ADMIN_LINE_MAX + 10);
    assert_non_null(big);
    memset(big, 'x', KVD_ADMIN_LINE_MAX + 9);
    big[KVD_ADMIN_LINE_MAX + 9] = '\0';
    kvd_raw_send(fd, big, strlen(big));
    free(big);
    char *line = read_line(fd);
    assert_non_null(line);
    assert_non_null(strstr(line, "ETOOBIG"));
    free(line);
    assert_null(read_line(fd));
    close(fd);
    stop(h);
}

/* ---- peer credentials ------------------------------------------------------------------- */

static void open_admin(kvd_config *c) {
    c->admin_socket_mode = 0666; /* the file lets anyone in: only the credential check stops */
}

static void test_peer_refused(void **state) {
    (void)state;
    if (geteuid() != 0) {
        skip(); /* setuid() to another uid needs root */
    }
    harness *h = start(open_admin);
    assert_int_equal(chmod(h->ts.dir, 0755), 0);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        if (setgid(65534) != 0 || setuid(65534) != 0) {
            _exit(10);
        }
        int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        struct sockaddr_un sa;
        memset(&sa, 0, sizeof(sa));
        sa.sun_family = AF_UNIX;
        memcpy(sa.sun_path, h->admin, strlen(h->admin) + 1);
        if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0) {
            _exit(11);
        }
        struct timeval tv = {20, 0};
        setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
        const char *q = "info\n";
        (void)!send(fd, q, strlen(q), MSG_NOSIGNAL);
        char buf[1024];
        size_t len = 0;
        ssize_t n;
        while (len < sizeof(buf) - 1 && (n = recv(fd, buf + len, sizeof(buf) - 1 - len, 0)) > 0) {
            len += (size_t)n;
        }
        buf[len] = '\0';
        /* One EPERM line, no info, and the daemon closed the connection. */
        int refused = strstr(buf, "\"EPERM\"") != NULL && strstr(buf, "boot_epoch") == NULL &&
                      strchr(buf, '\n') == buf + len - 1;
        _exit(refused ? 0 : 12);
    }
    int status;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFEXITED(status));
    assert_int_equal(WEXITSTATUS(status), 0);
    /* The refusal is an event; our own uid is still served. */
    json_t *r = ok(h, "events kind=refuse");
    assert_int_equal(json_array_size(json_object_get(r, "events")), 1);
    assert_string_equal(json_string_value(json_object_get(
                            json_array_get(json_object_get(r, "events"), 0), "reason")),
                        "EPERM");
    json_decref(r);
    stop(h);
}

/* ---- metrics ---------------------------------------------------------------------------- */

static uint16_t metrics_port;

static void with_metrics(kvd_config *c) {
    c->metrics_port = metrics_port;
}

/* GETs path from 127.0.0.1:port; returns the status and the body (malloc'd) in *body. */
static int http_get(uint16_t port, const char *path, char **body) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    assert_true(fd >= 0);
    struct sockaddr_in sin;
    memset(&sin, 0, sizeof(sin));
    sin.sin_family = AF_INET;
    sin.sin_port = htons(port);
    sin.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    assert_int_equal(connect(fd, (struct sockaddr *)&sin, sizeof(sin)), 0);
    struct timeval tv = {20, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    char req[256];
    snprintf(req, sizeof(req), "GET %s HTTP/1.0\r\nHost: localhost\r\n\r\n", path);
    kvd_raw_send(fd, req, strlen(req));
    size_t cap = 1 << 16, len = 0;
    char *buf = malloc(cap);
    assert_non_null(buf);
    ssize_t n;
    while ((n = recv(fd, buf + len, cap - 1 - len, 0)) > 0) {
        len += (size_t)n;
        if (len + 1 == cap) {
            cap *= 2;
            buf = realloc(buf, cap);
            assert_non_null(buf);
        }
    }
    close(fd);
    buf[len] = '\0';
    int status = 0;
    assert_int_equal(sscanf(buf, "HTTP/1.%*d %d", &status), 1);
    char *b = strstr(buf, "\r\n\r\n");
    assert_non_null(b);
    *body = strdup(b + 4);
    free(buf);
    return status;
}

static void test_metrics(void **state) {
    (void)state;
    metrics_port = free_port();
    harness *h = start(with_metrics);
    uint32_t pool;
    int client = populate(h, &pool);
    char *body;
    assert_int_equal(http_get(metrics_port, "/healthz", &body), 200);
    free(body);
    assert_int_equal(http_get(metrics_port, "/readyz", &body), 200);
    free(body);
    assert_int_equal(http_get(metrics_port, "/nothing", &body), 404);
    free(body);
    assert_int_equal(http_get(metrics_port, "/metrics", &body), 200);
    /* The same numbers as stats. */
    char want[256];
    snprintf(want, sizeof(want),
             "kvd_pool_hit_blocks_total{pool=\"%u\",model=\"admin-model\",domain=\"", pool);
    char *at = strstr(body, want);
    assert_non_null(at);
    assert_non_null(strstr(at, "\"} 4\n"));
    assert_non_null(strstr(body, "# TYPE kvd_pool_evictions_total counter\n"));
    assert_non_null(strstr(body, "kvd_sessions 1\n"));
    assert_non_null(strstr(body, "kvd_tenant_commits_total{tenant=\""));

    /* promtool checks the exposition (names, types, HELP, counters ending in _total). */
    char path[] = "/tmp/kvd-metrics-XXXXXX";
    int mfd = mkstemp(path);
    assert_true(mfd >= 0);
    assert_int_equal(write(mfd, body, strlen(body)), (ssize_t)strlen(body));
    close(mfd);
    free(body);
    if (system("command -v promtool >/dev/null 2>&1") != 0) {
        unlink(path);
        fail_msg("promtool not found: install Debian package prometheus (./dev installs it)");
    }
    char cmdline[256];
    snprintf(cmdline, sizeof(cmdline), "promtool check metrics < %s", path);
    int rc = system(cmdline);
    unlink(path);
    assert_int_equal(rc, 0);

    json_decref(ok(h, "drain"));
    assert_int_equal(http_get(metrics_port, "/readyz", &body), 503);
    free(body);
    assert_int_equal(http_get(metrics_port, "/healthz", &body), 200);
    free(body);
    close(client);
    stop(h);
}

/* The renderer escapes label values (a model id may hold quotes and backslashes). */
static void test_render_escapes(void **state) {
    (void)state;
    json_t *st = json_pack(
        "{s:{s:i, s:i, s:i, s:i, s:i, s:i, s:b, s:i, s:i, s:i}, s:[{s:i, s:s, s:s, s:i}], s:[]}",
        "daemon", "sessions", 0, "pools", 1, "pool_memory_bytes", 1, "pool_memory_used_bytes", 0,
        "index_entries", 0, "index_capacity", 8, "draining", 0, "uptime_seconds", 3, "events_evict",
        0, "events_refuse", 0, "pools", "id", 1, "model", "m\"x\\y\nz", "domain", "d", "queries", 2,
        "tenants");
    assert_non_null(st);
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    assert_int_equal(kvd_metrics_render(st, "0.1.0", f), KV_OK);
    fclose(f);
    assert_non_null(strstr(buf, "kvd_pool_lookups_total{pool=\"1\",model=\"m\\\"x\\\\y\\nz\","
                                "domain=\"d\"} 2\n"));
    assert_non_null(strstr(buf, "kvd_uptime_seconds 3\n"));
    free(buf);
    json_decref(st);
    json_t *bad = json_object();
    f = open_memstream(&buf, &len);
    assert_int_equal(kvd_metrics_render(bad, "0.1.0", f), KV_EINVAL);
    fclose(f);
    free(buf);
    json_decref(bad);
}

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_commands),       cmocka_unit_test(test_errors),
        cmocka_unit_test(test_peer_refused),   cmocka_unit_test(test_metrics),
        cmocka_unit_test(test_render_escapes),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
