/* raw_client: the in-process test server and the raw kv_wire client the daemon's tests share
 * (see raw_client.h). Failures go through cmocka assertions, so every call fails the test that
 * made it rather than returning an error. */
#include "daemon/testing/raw_client.h"

#include <fcntl.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include <cmocka.h>

#include "common/kv_log.h"
#include "common/kv_wire.h"

static void test_server_on_call(uv_async_t *a) {
    kvd_test_server *ts = a->data;
    pthread_mutex_lock(&ts->mu);
    void (*fn)(kvd_daemon *, void *) = ts->call_fn;
    void *arg = ts->call_arg;
    pthread_mutex_unlock(&ts->mu);
    if (fn == NULL) {
        return;
    }
    fn(ts->srv, arg);
    pthread_mutex_lock(&ts->mu);
    ts->call_fn = NULL;
    ts->call_done = 1;
    pthread_cond_broadcast(&ts->cv);
    pthread_mutex_unlock(&ts->mu);
}

/* The last call before stopping: the call handle must be closed on the loop thread, or the loop
 * would never end. */
static void test_server_close_call(kvd_daemon *s, void *arg) {
    (void)s;
    kvd_test_server *ts = arg;
    uv_close((uv_handle_t *)&ts->call_async, NULL);
}

static void *test_server_main(void *arg) {
    kvd_test_server *ts = arg;
    uv_loop_init(&ts->loop);
    kv_err rc = kvd_daemon_alloc(&ts->cfg, &ts->loop, &ts->srv);
    if (rc == KV_OK) {
        rc = kvd_daemon_start(ts->srv, 0);
        if (rc != KV_OK) {
            kvd_daemon_stop(ts->srv);
        } else {
            ts->call_async.data = ts;
            uv_async_init(&ts->loop, &ts->call_async, test_server_on_call);
            if (ts->on_loop != NULL) {
                ts->on_loop(ts->srv);
            }
        }
    }
    pthread_mutex_lock(&ts->mu);
    ts->ready = rc == KV_OK ? 1 : -1;
    pthread_cond_signal(&ts->cv);
    pthread_mutex_unlock(&ts->mu);
    if (ts->srv != NULL) {
        uv_run(&ts->loop, UV_RUN_DEFAULT);
        kvd_daemon_free(ts->srv);
    }
    ts->loop_close_rc = uv_loop_close(&ts->loop);
    return NULL;
}

void kvd_test_server_init(kvd_test_server *ts, const char *tag) {
    memset(ts, 0, sizeof(*ts));
    kvd_config_init(&ts->cfg);
    int n = snprintf(ts->dir, sizeof(ts->dir), "/tmp/kvd-%s-XXXXXX", tag);
    assert_true(n > 0 && (size_t)n < sizeof(ts->dir));
    assert_non_null(mkdtemp(ts->dir));
    snprintf(ts->cfg.socket, sizeof(ts->cfg.socket), "%s/kvd.sock", ts->dir);
}

void kvd_test_server_start(kvd_test_server *ts) {
    kv_log_threshold = ts->cfg.log_level;
    pthread_mutex_init(&ts->mu, NULL);
    pthread_cond_init(&ts->cv, NULL);
    assert_int_equal(pthread_create(&ts->thread, NULL, test_server_main, ts), 0);
    pthread_mutex_lock(&ts->mu);
    while (ts->ready == 0) {
        pthread_cond_wait(&ts->cv, &ts->mu);
    }
    pthread_mutex_unlock(&ts->mu);
    assert_int_equal(ts->ready, 1);
}

void kvd_test_server_call(kvd_test_server *ts, void (*fn)(kvd_daemon *s, void *arg), void *arg) {
    pthread_mutex_lock(&ts->mu);
    ts->call_fn = fn;
    ts->call_arg = arg;
    ts->call_done = 0;
    pthread_mutex_unlock(&ts->mu);
    uv_async_send(&ts->call_async);
    pthread_mutex_lock(&ts->mu);
    while (!ts->call_done) {
        pthread_cond_wait(&ts->cv, &ts->mu);
    }
    pthread_mutex_unlock(&ts->mu);
}

void kvd_test_server_stop(kvd_test_server *ts) {
    kvd_test_server_call(ts, test_server_close_call, ts);
    kvd_daemon_stop_async(ts->srv);
    pthread_join(ts->thread, NULL);
    assert_int_equal(ts->loop_close_rc, 0);
    pthread_mutex_destroy(&ts->mu);
    pthread_cond_destroy(&ts->cv);
}

int kvd_raw_dial(const char *path) {
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    assert_true(fd >= 0);
    struct sockaddr_un sa;
    memset(&sa, 0, sizeof(sa));
    sa.sun_family = AF_UNIX;
    assert_true(strlen(path) < sizeof(sa.sun_path));
    memcpy(sa.sun_path, path, strlen(path) + 1);
    assert_int_equal(connect(fd, (struct sockaddr *)&sa, sizeof(sa)), 0);
    struct timeval tv = {20, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    return fd;
}

void kvd_raw_send(int fd, const void *buf, size_t len) {
    assert_int_equal(send(fd, buf, len, MSG_NOSIGNAL), (ssize_t)len);
}

void kvd_raw_send_env(int fd, Kvd__Envelope *env) {
    uint8_t *buf;
    size_t len;
    assert_int_equal(kv_wire_encode(env, 1u << 30, &buf, &len), KV_OK);
    kvd_raw_send(fd, buf, len);
    free(buf);
}

int kvd_raw_recv_exact(int fd, uint8_t *buf, size_t len, int *fds, size_t *nfds) {
    size_t got = 0;
    while (got < len) {
        union {
            char b[CMSG_SPACE(sizeof(int) * KVD_RAW_MAX_FDS)];
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
            if (cm->cmsg_type != SCM_RIGHTS) {
                continue;
            }
            size_t k = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
            if (fds == NULL) {
                for (size_t i = 0; i < k; i++) {
                    int d;
                    memcpy(&d, CMSG_DATA(cm) + i * sizeof(int), sizeof(int));
                    close(d);
                }
                continue;
            }
            assert_true(*nfds + k <= KVD_RAW_MAX_FDS);
            memcpy(fds + *nfds, CMSG_DATA(cm), k * sizeof(int));
            *nfds += k;
        }
        got += (size_t)n;
    }
    return 0;
}

Kvd__Envelope *kvd_raw_recv_env_fds(int fd, int *fds, size_t *nfds) {
    uint8_t hdr[4];
    *nfds = 0;
    if (kvd_raw_recv_exact(fd, hdr, 4, fds, nfds) != 0) {
        return NULL;
    }
    uint32_t len =
        (uint32_t)hdr[0] | (uint32_t)hdr[1] << 8 | (uint32_t)hdr[2] << 16 | (uint32_t)hdr[3] << 24;
    uint8_t *buf = malloc((size_t)len + 4);
    assert_non_null(buf);
    memcpy(buf, hdr, 4);
    assert_int_equal(kvd_raw_recv_exact(fd, buf + 4, len, fds, nfds), 0);
    Kvd__Envelope *env;
    size_t used;
    assert_int_equal(kv_wire_decode(buf, (size_t)len + 4, 1u << 30, &env, &used), KV_OK);
    assert_non_null(env);
    free(buf);
    return env;
}

Kvd__Envelope *kvd_raw_recv_env(int fd) {
    int fds[KVD_RAW_MAX_FDS];
    size_t n;
    Kvd__Envelope *e = kvd_raw_recv_env_fds(fd, fds, &n);
    for (size_t i = 0; i < n; i++) {
        close(fds[i]);
    }
    return e;
}

Kvd__Envelope *kvd_raw_rpc(int fd, Kvd__Envelope *req) {
    kvd_raw_send_env(fd, req);
    Kvd__Envelope *r = kvd_raw_recv_env(fd);
    assert_non_null(r);
    assert_int_equal(r->id, req->id);
    return r;
}

void kvd_raw_expect_error(int fd, Kvd__Envelope *req, kv_err code) {
    Kvd__Envelope *r = kvd_raw_rpc(fd, req);
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

static uint64_t raw_next_id = 100;

uint64_t kvd_raw_next_id(void) {
    return raw_next_id++;
}

void kvd_raw_hello(int fd, const char *client_name) {
    Kvd__Envelope e = KVD__ENVELOPE__INIT;
    Kvd__Hello h = KVD__HELLO__INIT;
    h.protocol_version = 1;
    h.client_name = (char *)client_name;
    e.id = kvd_raw_next_id();
    e.body_case = KVD__ENVELOPE__BODY_HELLO;
    e.hello = &h;
    Kvd__Envelope *r = kvd_raw_rpc(fd, &e);
    assert_int_equal(r->body_case, KVD__ENVELOPE__BODY_HELLO_REPLY);
    assert_true(r->hello_reply->session_id > 0);
    assert_int_equal(r->hello_reply->boot_epoch, r->boot_epoch);
    assert_true(r->boot_epoch != 0);
    assert_int_equal(r->hello_reply->protocol_version, 1);
    assert_int_equal(r->hello_reply->n_domains, 1);
    kv_wire_free(r);
}

void kvd_raw_fill_layout(Kvd__Layout *l) {
    l->num_layers = 2;
    l->num_kv_heads = 2;
    l->head_dim = 8;
    l->tokens_per_block = 4;
    l->dtype = KVD__DTYPE__FP16;
    l->arrangement = KVD__ARRANGEMENT__LAYER_MAJOR;
}

kvd_raw_attached kvd_raw_attach(int fd, const char *model) {
    Kvd__Envelope e = KVD__ENVELOPE__INIT;
    Kvd__AttachPool a = KVD__ATTACH_POOL__INIT;
    Kvd__Layout l = KVD__LAYOUT__INIT;
    kvd_raw_fill_layout(&l);
    a.model_id = (char *)model;
    a.layout = &l;
    e.id = kvd_raw_next_id();
    e.body_case = KVD__ENVELOPE__BODY_ATTACH_POOL;
    e.attach_pool = &a;
    kvd_raw_send_env(fd, &e);
    int fds[KVD_RAW_MAX_FDS];
    size_t nfds;
    Kvd__Envelope *r = kvd_raw_recv_env_fds(fd, fds, &nfds);
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
    kvd_raw_attached at;
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

Kvd__Envelope *kvd_raw_allocate(int fd, uint32_t pool, uint32_t count) {
    Kvd__Envelope e = KVD__ENVELOPE__INIT;
    Kvd__Allocate a = KVD__ALLOCATE__INIT;
    a.pool_id = pool;
    a.count = count;
    e.id = kvd_raw_next_id();
    e.body_case = KVD__ENVELOPE__BODY_ALLOCATE;
    e.allocate = &a;
    return kvd_raw_rpc(fd, &e);
}

void kvd_raw_commit(int fd, uint32_t pool, Kvd__BlockRef *blocks, size_t n, uint64_t salt,
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
    e.id = kvd_raw_next_id();
    e.body_case = KVD__ENVELOPE__BODY_COMMIT;
    e.commit = &c;
    if (expect != KV_OK) {
        kvd_raw_expect_error(fd, &e, expect);
        return;
    }
    Kvd__Envelope *r = kvd_raw_rpc(fd, &e);
    if (r->body_case == KVD__ENVELOPE__BODY_ERROR) {
        fail_msg("commit: %s", r->error->message);
    }
    assert_int_equal(r->commit_reply->n_canonical, n);
    for (size_t i = 0; i < n; i++) {
        assert_int_equal(r->commit_reply->canonical[i]->id, blocks[i].id);
    }
    kv_wire_free(r);
}

Kvd__Envelope *kvd_raw_lookup(int fd, uint32_t pool, uint64_t salt, size_t n) {
    Kvd__Envelope e = KVD__ENVELOPE__INIT;
    Kvd__Lookup l = KVD__LOOKUP__INIT;
    Kvd__Hash128 h[8];
    Kvd__Hash128 *ph[8];
    assert_true(n <= 8);
    for (size_t i = 0; i < n; i++) {
        kvd__hash128__init(&h[i]);
        h[i].lo = salt + i;
        h[i].hi = 0xabcdef;
        ph[i] = &h[i];
    }
    l.pool_id = pool;
    l.n_hashes = n;
    l.hashes = ph;
    e.id = kvd_raw_next_id();
    e.body_case = KVD__ENVELOPE__BODY_LOOKUP;
    e.lookup = &l;
    return kvd_raw_rpc(fd, &e);
}

uint32_t kvd_raw_map_segments(int fd, uint32_t pool, uint32_t first_index) {
    Kvd__Envelope e = KVD__ENVELOPE__INIT;
    Kvd__MapSegments m = KVD__MAP_SEGMENTS__INIT;
    m.pool_id = pool;
    m.first_index = first_index;
    e.id = kvd_raw_next_id();
    e.body_case = KVD__ENVELOPE__BODY_MAP_SEGMENTS;
    e.map_segments = &m;
    Kvd__Envelope *r = kvd_raw_rpc(fd, &e);
    assert_int_equal(r->body_case, KVD__ENVELOPE__BODY_MAP_SEGMENTS_REPLY);
    uint32_t n = (uint32_t)r->map_segments_reply->n_segments;
    kv_wire_free(r);
    return n;
}
