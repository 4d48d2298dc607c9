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
#include "daemon/admin.h"
#include "daemon/config.h"
#include "daemon/metrics.h"
#include "daemon/server.h"

typedef struct harness {
    kvd_config cfg;     /* options the server runs with */
    char dir[64];       /* temporary socket directory */
    char admin[128];    /* admin socket path */
    uv_loop_t loop;     /* the server thread's loop */
    kvd_server *srv;    /* the server */
    pthread_t thread;   /* runs the loop */
    pthread_mutex_t mu; /* guards ready */
    pthread_cond_t cv;  /* signals ready */
    int ready;          /* 1 started, -1 failed */
    int loop_close_rc;  /* uv_loop_close() after the loop ended */
} harness;

static void *server_main(void *arg) {
    harness *h = arg;
    uv_loop_init(&h->loop);
    kv_err rc = kvd_server_alloc(&h->cfg, &h->loop, &h->srv);
    if (rc == KV_OK) {
        rc = kvd_server_start(h->srv, 0);
        if (rc != KV_OK) {
            kvd_server_stop(h->srv);
        }
    }
    pthread_mutex_lock(&h->mu);
    h->ready = rc == KV_OK ? 1 : -1;
    pthread_cond_signal(&h->cv);
    pthread_mutex_unlock(&h->mu);
    if (h->srv != NULL) {
        uv_run(&h->loop, UV_RUN_DEFAULT);
        kvd_server_free(h->srv);
    }
    h->loop_close_rc = uv_loop_close(&h->loop);
    return NULL;
}

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
    kvd_config_init(&h->cfg);
    snprintf(h->dir, sizeof(h->dir), "/tmp/kvd-admin-test-XXXXXX");
    assert_non_null(mkdtemp(h->dir));
    snprintf(h->cfg.socket, sizeof(h->cfg.socket), "%s/kvd.sock", h->dir);
    snprintf(h->admin, sizeof(h->admin), "%s/admin.sock", h->dir);
    h->cfg.pool_memory = 8 << 20;
    h->cfg.segment_bytes = 64 << 10;
    h->cfg.index_entries = 4096;
    h->cfg.log_level = KV_LOG_WARN;
    if (tweak != NULL) {
        tweak(&h->cfg);
    }
    kv_log_threshold = h->cfg.log_level;
    pthread_mutex_init(&h->mu, NULL);
    pthread_cond_init(&h->cv, NULL);
    assert_int_equal(pthread_create(&h->thread, NULL, server_main, h), 0);
    pthread_mutex_lock(&h->mu);
    while (h->ready == 0) {
        pthread_cond_wait(&h->cv, &h->mu);
    }
    pthread_mutex_unlock(&h->mu);
    assert_int_equal(h->ready, 1);
    return h;
}

static void stop(harness *h) {
    kvd_server_stop_async(h->srv);
    pthread_join(h->thread, NULL);
    assert_int_equal(h->loop_close_rc, 0);
    /* Both socket files are gone after a clean stop. */
    assert_int_not_equal(access(h->cfg.socket, F_OK), 0);
    assert_int_not_equal(access(h->admin, F_OK), 0);
    rmdir(h->dir);
    pthread_mutex_destroy(&h->mu);
    pthread_cond_destroy(&h->cv);
    free(h);
}

static int dial_path(const char *path) {
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    assert_true(fd >= 0);
    struct sockaddr_un sa;
    memset(&sa, 0, sizeof(sa));
    sa.sun_family = AF_UNIX;
    assert_true(strlen(path) < sizeof(sa.sun_path));
    memcpy(sa.sun_path, path, strlen(path) + 1);
    assert_int_equal(connect(fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
    /* A hung test fails instead of hanging. */
    struct timeval tv = {20, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    return fd;
}

static int dial(harness *h) {
    return dial_path(h->cfg.socket);
}

static void send_raw(int fd, const void *buf, size_t len) {
    assert_int_equal(send(fd, buf, len, MSG_NOSIGNAL), (ssize_t)len);
}

static void send_env(int fd, Kvd__Envelope *env) {
    uint8_t *buf;
    size_t len;
    assert_int_equal(kv_wire_encode(env, 1u << 30, &buf, &len), KV_OK);
    send_raw(fd, buf, len);
    free(buf);
}

static int recv_exact(int fd, uint8_t *buf, size_t len, int *fds, size_t *nfds) {
    size_t got = 0;
    while (got < len) {
        union {
            char b[CMSG_SPACE(sizeof(int) * 200)];
            struct cmsghdr align;
        } ctl;
        struct iovec iov = {buf + got, len - got};
        struct msghdr mh;
        memset(&mh, 0, sizeof(mh));
        mh.msg_iov = &iov;
        mh.msg_iovlen = 1;
        mh.msg_control = ctl.b;
        mh.msg_controllen = sizeof(ctl.b);
        ssize_t n = recvmsg(fd, &mh, MSG_CMSG_CLOEXEC);
        if (n <= 0) {
            return -1;
        }
        for (struct cmsghdr *cm = CMSG_FIRSTHDR(&mh); cm != NULL; cm = CMSG_NXTHDR(&mh, cm)) {
            if (cm->cmsg_type == SCM_RIGHTS) {
                size_t k = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
                memcpy(fds + *nfds, CMSG_DATA(cm), k * sizeof(int));
                *nfds += k;
            }
        }
        got += (size_t)n;
    }
    return 0;
}

/* Receives one frame; NULL on EOF. fds (capacity 200) get the frame's fds. */
static Kvd__Envelope *recv_env_fds(int fd, int *fds, size_t *nfds) {
    uint8_t hdr[4];
    *nfds = 0;
    if (recv_exact(fd, hdr, 4, fds, nfds) != 0) {
        return NULL;
    }
    uint32_t len =
        (uint32_t)hdr[0] | (uint32_t)hdr[1] << 8 | (uint32_t)hdr[2] << 16 | (uint32_t)hdr[3] << 24;
    uint8_t *buf = malloc(len + 4);
    assert_non_null(buf);
    memcpy(buf, hdr, 4);
    assert_int_equal(recv_exact(fd, buf + 4, len, fds, nfds), 0);
    Kvd__Envelope *env;
    size_t used;
    assert_int_equal(kv_wire_decode(buf, len + 4, 1u << 30, &env, &used), KV_OK);
    assert_non_null(env);
    free(buf);
    return env;
}

static Kvd__Envelope *recv_env(int fd) {
    int fds[200];
    size_t n;
    Kvd__Envelope *e = recv_env_fds(fd, fds, &n);
    for (size_t i = 0; i < n; i++) {
        close(fds[i]);
    }
    return e;
}

static Kvd__Envelope *rpc(int fd, Kvd__Envelope *req) {
    send_env(fd, req);
    Kvd__Envelope *r = recv_env(fd);
    assert_non_null(r);
    assert_int_equal(r->id, req->id);
    return r;
}

/* Sends req and expects an Error with code. */
static void expect_error(int fd, Kvd__Envelope *req, kv_err code) {
    Kvd__Envelope *r = rpc(fd, req);
    if (r->body_case != KVD__ENVELOPE__BODY_ERROR) {
        fail_msg("expected %s, got body %d", kv_err_name(code), r->body_case);
    }
    if ((int)r->error->code != (int)code) {
        fail_msg("expected %s, got %s: %s", kv_err_name(code), kv_err_name(r->error->code),
                 r->error->message);
    }
    assert_true(strlen(r->error->message) > 0);
    kv_wire_free(r);
}

static uint64_t next_id = 100;

static void hello(int fd) {
    Kvd__Envelope e = KVD__ENVELOPE__INIT;
    Kvd__Hello h = KVD__HELLO__INIT;
    h.protocol_version = 1;
    h.client_name = "admin_test";
    e.id = next_id++;
    e.body_case = KVD__ENVELOPE__BODY_HELLO;
    e.hello = &h;
    Kvd__Envelope *r = rpc(fd, &e);
    assert_int_equal(r->body_case, KVD__ENVELOPE__BODY_HELLO_REPLY);
    assert_true(r->hello_reply->session_id > 0);
    assert_int_equal(r->hello_reply->boot_epoch, r->boot_epoch);
    assert_true(r->boot_epoch != 0);
    assert_int_equal(r->hello_reply->protocol_version, 1);
    assert_int_equal(r->hello_reply->n_domains, 1);
    kv_wire_free(r);
}

typedef struct attached {
    uint32_t pool_id;   /* from the reply */
    uint32_t bps;       /* blocks per segment */
    uint64_t seg_bytes; /* bytes of segment 0 */
    uint8_t *base;      /* our mapping of segment 0 */
    kv_layout layout;   /* the layout we asked */
} attached;

static void fill_layout(Kvd__Layout *l) {
    l->num_layers = 2;
    l->num_kv_heads = 2;
    l->head_dim = 8;
    l->tokens_per_block = 4;
    l->dtype = KVD__DTYPE__FP16;
    l->arrangement = KVD__ARRANGEMENT__LAYER_MAJOR;
}

static attached attach(int fd, const char *model) {
    Kvd__Envelope e = KVD__ENVELOPE__INIT;
    Kvd__AttachPool a = KVD__ATTACH_POOL__INIT;
    Kvd__Layout l = KVD__LAYOUT__INIT;
    fill_layout(&l);
    a.model_id = (char *)model;
    a.layout = &l;
    e.id = next_id++;
    e.body_case = KVD__ENVELOPE__BODY_ATTACH_POOL;
    e.attach_pool = &a;
    send_env(fd, &e);
    int fds[200];
    size_t nfds;
    Kvd__Envelope *r = recv_env_fds(fd, fds, &nfds);
    assert_non_null(r);
    if (r->body_case == KVD__ENVELOPE__BODY_ERROR) {
        fail_msg("attach: %s", r->error->message);
    }
    assert_int_equal(r->body_case, KVD__ENVELOPE__BODY_ATTACH_POOL_REPLY);
    Kvd__AttachPoolReply *ar = r->attach_pool_reply;
    assert_true(ar->pool_id > 0);
    assert_true(ar->n_segments >= 1);
    assert_int_equal(nfds, ar->n_segments);
    assert_int_equal(ar->segments[0]->index, 0);
    assert_int_equal(ar->segments[0]->kind, KVD__MEMORY_KIND__HOST_MEMFD);
    assert_int_equal(ar->hash_algo, 1);
    assert_non_null(ar->hash_seed);
    attached at;
    at.pool_id = ar->pool_id;
    at.bps = ar->blocks_per_segment;
    at.seg_bytes = ar->segments[0]->bytes;
    assert_int_equal(kv_layout_init(2, 2, 8, 4, KV_DTYPE_FP16, KV_LAYER_MAJOR, &at.layout), KV_OK);
    assert_int_equal(ar->layout->block_bytes, at.layout.block_bytes);
    assert_true(at.seg_bytes >= kv_layout_segment_bytes(&at.layout, at.bps));
    /* The memfd is sealed against resizing. */
    int seals = fcntl(fds[ar->segments[0]->fd_index], F_GET_SEALS);
    assert_true(seals & F_SEAL_SHRINK);
    assert_true(seals & F_SEAL_GROW);
    at.base = mmap(NULL, at.seg_bytes, PROT_READ | PROT_WRITE, MAP_SHARED,
                   fds[ar->segments[0]->fd_index], 0);
    assert_true(at.base != MAP_FAILED);
    for (size_t i = 0; i < nfds; i++) {
        close(fds[i]);
    }
    kv_wire_free(r);
    return at;
}

static Kvd__Envelope *allocate(int fd, uint32_t pool, uint32_t count) {
    Kvd__Envelope e = KVD__ENVELOPE__INIT;
    Kvd__Allocate a = KVD__ALLOCATE__INIT;
    a.pool_id = pool;
    a.count = count;
    e.id = next_id++;
    e.body_case = KVD__ENVELOPE__BODY_ALLOCATE;
    e.allocate = &a;
    return rpc(fd, &e);
}

static void commit(int fd, uint32_t pool, Kvd__BlockRef *blocks, size_t n, uint64_t salt,
                   kv_err expect) {
    Kvd__Envelope e = KVD__ENVELOPE__INIT;
    Kvd__Commit c = KVD__COMMIT__INIT;
    Kvd__CommitEntry ent[8];
    Kvd__CommitEntry *pe[8];
    Kvd__Hash128 h[8];
    Kvd__BlockRef br[8];
    assert_true(n <= 8);
    for (size_t i = 0; i < n; i++) {
        kvd__commit_entry__init(&ent[i]);
        kvd__hash128__init(&h[i]);
        kvd__block_ref__init(&br[i]);
        br[i].id = blocks[i].id;
        br[i].gen = blocks[i].gen;
        h[i].lo = salt + i;
        h[i].hi = 0xabcdef;
        ent[i].block = &br[i];
        ent[i].hash = &h[i];
        ent[i].parent = i == 0 ? UINT32_MAX : blocks[i - 1].id;
        pe[i] = &ent[i];
    }
    c.pool_id = pool;
    c.n_entries = n;
    c.entries = pe;
    e.id = next_id++;
    e.body_case = KVD__ENVELOPE__BODY_COMMIT;
    e.commit = &c;
    if (expect != KV_OK) {
        expect_error(fd, &e, expect);
        return;
    }
    Kvd__Envelope *r = rpc(fd, &e);
    if (r->body_case == KVD__ENVELOPE__BODY_ERROR) {
        fail_msg("commit: %s", r->error->message);
    }
    assert_int_equal(r->commit_reply->n_canonical, n);
    for (size_t i = 0; i < n; i++) {
        assert_int_equal(r->commit_reply->canonical[i]->id, blocks[i].id);
    }
    kv_wire_free(r);
}

static Kvd__Envelope *lookup(int fd, uint32_t pool, uint64_t salt, size_t n) {
    Kvd__Envelope e = KVD__ENVELOPE__INIT;
    Kvd__Lookup l = KVD__LOOKUP__INIT;
    Kvd__Hash128 h[8];
    Kvd__Hash128 *ph[8];
    for (size_t i = 0; i < n; i++) {
        kvd__hash128__init(&h[i]);
        h[i].lo = salt + i;
        h[i].hi = 0xabcdef;
        ph[i] = &h[i];
    }
    l.pool_id = pool;
    l.n_hashes = n;
    l.hashes = ph;
    e.id = next_id++;
    e.body_case = KVD__ENVELOPE__BODY_LOOKUP;
    e.lookup = &l;
    return rpc(fd, &e);
}

static void release(int fd, uint32_t pool, Kvd__BlockRef **blocks, size_t n) {
    Kvd__Envelope e;
    Kvd__Release rel;
    kvd__envelope__init(&e);
    kvd__release__init(&rel);
    rel.pool_id = pool;
    rel.n_blocks = n;
    rel.blocks = blocks;
    e.id = next_id++;
    e.body_case = KVD__ENVELOPE__BODY_RELEASE;
    e.release = &rel;
    Kvd__Envelope *r = rpc(fd, &e);
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
    send_raw(fd, out, strlen(out));
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
    int fd = dial_path(h->admin);
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
    hello(fd);
    attached at = attach(fd, "admin-model");
    munmap(at.base, at.seg_bytes);
    Kvd__Envelope *r = allocate(fd, at.pool_id, 4);
    assert_int_equal(r->body_case, KVD__ENVELOPE__BODY_ALLOCATE_REPLY);
    Kvd__BlockRef blocks[4];
    Kvd__BlockRef *pb[4];
    for (size_t i = 0; i < 4; i++) {
        blocks[i] = *r->allocate_reply->blocks[i];
        pb[i] = &blocks[i];
    }
    kv_wire_free(r);
    commit(fd, at.pool_id, blocks, 4, 1000, KV_OK);
    release(fd, at.pool_id, pb, 4);
    r = lookup(fd, at.pool_id, 1000, 4);
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
    snprintf(epoch, sizeof(epoch), "%016llx", (unsigned long long)kvd_server_boot_epoch(h->srv));
    assert_string_equal(json_string_value(json_object_get(r, "boot_epoch")), epoch);
    assert_non_null(json_string_value(json_object_get(r, "version")));
    assert_string_equal(json_string_value(json_object_get(r, "admin_socket")), h->admin);
    assert_true(json_is_true(json_object_get(r, "ready")));
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
    e.id = next_id++;
    e.body_case = KVD__ENVELOPE__BODY_HELLO;
    e.hello = &hl;
    expect_error(late, &e, KV_EDRAINING);
    close(late);
    Kvd__Envelope *lr = lookup(client, pool, 7777, 1); /* the open session still works */
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
    int fd = dial_path(h->admin);
    send_raw(fd, "\n\n", 2);
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
    send_raw(fd, big, strlen(big));
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
    assert_int_equal(chmod(h->dir, 0755), 0);
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
    send_raw(fd, req, strlen(req));
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
