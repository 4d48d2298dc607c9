/* fault_test: fault injection against a live kvd (issue 8). Workers SIGKILLed at every step of
 * allocate/write/commit; request frames cut at every byte boundary and sent byte by byte; a
 * client that never reads its replies and a slow reader, while another client's Ping keeps
 * being answered; kvd out of file descriptors; the pool exhausted; SIGTERM under load; kvd
 * SIGKILLed and restarted. After each fault the daemon must answer, and every block a dead or
 * cut session held must be back (checked through Stats). No timing is asserted.
 *
 * Buffers are bounded per connection here (input <= max-frame-bytes + header + one read chunk,
 * queued output <= max-output-bytes) and over all connections by max-buffer-bytes
 * (buffer_limit_test). */
#include <errno.h>
#include <fcntl.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "common/kv_wire.h"
#include "tests/integration/kvd_harness.h"

static kvd_harness H;

/* 16 KiB blocks, 1 MiB segments (64 blocks), 4 MiB budget: 256 blocks over all pools. Replies
 * a client leaves unread beyond 1 MiB get it disconnected. */
static const char *const FLAGS[] = {"--pool-memory=4M", "--segment-bytes=1M",
                                    "--max-output-bytes=1M", NULL};

static int setup(void **state) {
    (void)state;
    signal(SIGPIPE, SIG_IGN);
    return kvd_harness_start(&H, FLAGS);
}

static int teardown(void **state) {
    (void)state;
    return kvd_harness_finish(&H);
}

static void open_pool(const char *name, kvc_conn **c, kvc_pool **p) {
    kv_layout l = kvd_harness_layout();
    assert_int_equal(kvd_harness_connect(&H, name, c), KV_OK);
    assert_int_equal(kvc_pool_attach(*c, "fault-model", &l, p), KV_OK);
}

/* The observer's view once every other session is gone: no block held, none WRITING. */
static void expect_nothing_held(kvc_conn *obs, kvc_pool *p) {
    uint32_t id = kvc_pool_id(p);
    assert_int_equal(kvd_harness_wait_stat(obs, 0, "daemon.sessions", 1), 1);
    assert_int_equal(kvd_harness_wait_stat(obs, id, "pool.blocks_writing", 0), 0);
    assert_int_equal(kvd_harness_wait_stat(obs, id, "pool.blocks_committed", 0), 0);
    uint64_t total = 0, fr = 0, cached = 0;
    assert_int_equal(kvc_stat_get(obs, id, "pool.blocks_total", &total), KV_OK);
    assert_int_equal(kvc_stat_get(obs, id, "pool.blocks_free", &fr), KV_OK);
    assert_int_equal(kvc_stat_get(obs, id, "pool.blocks_cached", &cached), KV_OK);
    assert_int_equal(fr + cached, total);
}

/* ---- SIGKILL at every step ----------------------------------------------------------- */

enum {
    STEP_CONNECTED,
    STEP_ATTACHED,
    STEP_LOOKED_UP,
    STEP_ALLOCATED,
    STEP_HALF_WRITTEN,
    STEP_WRITTEN,
    STEP_COMMITTED,
    STEP_PINNED,
    STEP_RELEASED_HALF,
    NSTEPS
};

/* Child: walks the cycle of a worker and SIGKILLs itself at step `die`. */
static void step_child(int die, uint32_t salt) {
    kvc_conn *c;
    kvc_pool *p;
    kv_layout l = kvd_harness_layout();
    if (kvd_harness_connect(&H, "doomed", &c) != KV_OK) {
        _exit(1);
    }
    if (die == STEP_CONNECTED) {
        raise(SIGKILL);
    }
    if (kvc_pool_attach(c, "fault-model", &l, &p) != KV_OK) {
        _exit(1);
    }
    if (die == STEP_ATTACHED) {
        raise(SIGKILL);
    }
    uint32_t tok[8 * 16];
    for (int i = 0; i < 8 * 16; i++) {
        tok[i] = (i < 4 * 16 ? 5 : salt) + (uint32_t)i; /* 4 shared blocks, 4 of this child */
    }
    kv_hash128 hs[8];
    size_t nh, nhit = 0;
    kvc_block hit[8], b[8], canon[8];
    if (kvc_pool_hash_tokens(p, NULL, 0, tok, 8 * 16, hs, 8, &nh) != KV_OK ||
        kvc_lookup(p, hs, 8, hit, &nhit) != KV_OK) {
        _exit(1);
    }
    if (die == STEP_LOOKED_UP) {
        raise(SIGKILL);
    }
    size_t need = 8 - nhit;
    if (need == 0 || kvc_allocate(p, (uint32_t)need, b) != KV_OK) {
        _exit(1);
    }
    if (die == STEP_ALLOCATED) {
        raise(SIGKILL);
    }
    for (size_t j = 0; j < need; j++) {
        uint8_t *a = kvc_pool_addr(p, b[j].id, 0, KV_K, 0, 0);
        if (a == NULL) {
            _exit(1);
        }
        memset(a, 0x5a, 4096);
        if (die == STEP_HALF_WRITTEN && j == need / 2) {
            raise(SIGKILL);
        }
    }
    if (die == STEP_WRITTEN) {
        raise(SIGKILL);
    }
    kvc_commit_entry e[8];
    for (size_t j = 0; j < need; j++) {
        e[j].block = b[j];
        e[j].hash = hs[nhit + j];
        e[j].parent = j > 0 ? b[j - 1].id : (nhit > 0 ? hit[nhit - 1].id : KVC_NO_PARENT);
    }
    if (kvc_commit(p, e, need, canon) != KV_OK) {
        _exit(1);
    }
    if (die == STEP_COMMITTED) {
        raise(SIGKILL);
    }
    if (kvc_pin(p, canon, need, 1, 1, 0) != KV_OK) {
        _exit(1);
    }
    if (die == STEP_PINNED) {
        raise(SIGKILL);
    }
    if (kvc_release(p, canon, need / 2) != KV_OK) {
        _exit(1);
    }
    raise(SIGKILL);
}

static void test_sigkill_every_step(void **state) {
    (void)state;
    kvc_conn *obs;
    kvc_pool *op;
    open_pool("observer", &obs, &op);
    for (int step = 0; step < NSTEPS; step++) {
        pid_t pid = fork();
        assert_true(pid >= 0);
        if (pid == 0) {
            step_child(step, 100000u * (uint32_t)(step + 1));
        }
        int st;
        assert_int_equal(waitpid(pid, &st, 0), pid);
        assert_true(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL); /* it got to its step */
        expect_nothing_held(obs, op);
        assert_int_equal(kvc_ping(obs, NULL, 0), KV_OK);
    }
    kvc_conn_close(obs);
}

/* ---- frames cut at every byte -------------------------------------------------------- */

static size_t append_env(uint8_t *buf, size_t at, Kvd__Envelope *env) {
    uint8_t *f;
    size_t n;
    assert_int_equal(kv_wire_encode(env, 1u << 20, &f, &n), KV_OK);
    memcpy(buf + at, f, n);
    free(f);
    return at + n;
}

/* Hello, AttachPool, Allocate(4) as one byte stream; *ends gets where each frame ends. */
static size_t session_bytes(uint8_t *buf, size_t ends[3], uint32_t pool_id) {
    Kvd__Envelope env = KVD__ENVELOPE__INIT;
    Kvd__Hello hello = KVD__HELLO__INIT;
    hello.protocol_version = 1;
    hello.client_name = "cut";
    env.id = 1;
    env.body_case = KVD__ENVELOPE__BODY_HELLO;
    env.hello = &hello;
    size_t n = ends[0] = append_env(buf, 0, &env);
    kv_layout kl = kvd_harness_layout();
    Kvd__Layout l = KVD__LAYOUT__INIT;
    l.num_layers = kl.num_layers;
    l.num_kv_heads = kl.num_kv_heads;
    l.head_dim = kl.head_dim;
    l.tokens_per_block = kl.tokens_per_block;
    l.dtype = (Kvd__DType)kl.dtype;
    l.arrangement = (Kvd__Arrangement)kl.arrangement;
    Kvd__AttachPool att = KVD__ATTACH_POOL__INIT;
    att.model_id = "fault-model";
    att.layout = &l;
    env.id = 2;
    env.body_case = KVD__ENVELOPE__BODY_ATTACH_POOL;
    env.attach_pool = &att;
    n = ends[1] = append_env(buf, n, &env);
    Kvd__Allocate al = KVD__ALLOCATE__INIT;
    al.pool_id = pool_id; /* the observer's pool: the same tenant, so the same pool */
    al.count = 4;
    env.id = 3;
    env.body_case = KVD__ENVELOPE__BODY_ALLOCATE;
    env.allocate = &al;
    n = ends[2] = append_env(buf, n, &env);
    return n;
}

static void test_frames_cut_at_every_byte(void **state) {
    (void)state;
    kvc_conn *obs;
    kvc_pool *op;
    open_pool("observer", &obs, &op);
    uint8_t buf[1024];
    size_t ends[3];
    size_t len = session_bytes(buf, ends, kvc_pool_id(op));
    /* A valid prefix, then close: at every boundary. */
    for (size_t cut = 0; cut <= len; cut++) {
        int fd = kvd_harness_raw_connect(&H);
        assert_true(fd >= 0);
        if (cut > 0) {
            assert_int_equal(send(fd, buf, cut, MSG_NOSIGNAL), (ssize_t)cut);
        }
        close(fd);
    }
    expect_nothing_held(obs, op);
    /* The whole stream byte by byte with pauses: every reply comes, in order. */
    int fd = kvd_harness_raw_connect(&H);
    assert_true(fd >= 0);
    for (size_t i = 0; i < len; i++) {
        assert_int_equal(send(fd, buf + i, 1, MSG_NOSIGNAL), 1);
        if (i % 8 == 0) {
            kvd_harness_sleep_ms(1);
        }
    }
    static const Kvd__Envelope__BodyCase want[3] = {KVD__ENVELOPE__BODY_HELLO_REPLY,
                                                    KVD__ENVELOPE__BODY_ATTACH_POOL_REPLY,
                                                    KVD__ENVELOPE__BODY_ALLOCATE_REPLY};
    for (int i = 0; i < 3; i++) {
        Kvd__Envelope *e = NULL;
        assert_int_equal(kvd_harness_raw_read(fd, &e), 0);
        assert_int_equal(e->id, (uint64_t)(i + 1));
        assert_int_equal(e->body_case, want[i]);
        if (i == 2) {
            assert_int_equal(e->allocate_reply->n_blocks, 4);
        }
        kv_wire_free(e);
    }
    uint64_t writing = 0;
    assert_int_equal(kvc_stat_get(obs, kvc_pool_id(op), "pool.blocks_writing", &writing), KV_OK);
    assert_int_equal(writing, 4);
    close(fd); /* the 4 leased blocks go back */
    expect_nothing_held(obs, op);
    kvc_conn_close(obs);
}

/* ---- clients that do not read -------------------------------------------------------- */

static void hello_raw(int fd) {
    uint8_t buf[1024];
    size_t ends[3];
    session_bytes(buf, ends, 1);
    assert_int_equal(send(fd, buf, ends[0], MSG_NOSIGNAL), (ssize_t)ends[0]);
    Kvd__Envelope *e = NULL;
    assert_int_equal(kvd_harness_raw_read(fd, &e), 0);
    assert_int_equal(e->body_case, KVD__ENVELOPE__BODY_HELLO_REPLY);
    kv_wire_free(e);
}

static size_t ping_frame(uint8_t **out, uint64_t id, size_t payload) {
    Kvd__Envelope env = KVD__ENVELOPE__INIT;
    Kvd__Ping ping = KVD__PING__INIT;
    uint8_t *pl = calloc(1, payload + 1);
    ping.nonce = id;
    ping.payload.data = pl;
    ping.payload.len = payload;
    env.id = id;
    env.body_case = KVD__ENVELOPE__BODY_PING;
    env.ping = &ping;
    size_t n;
    assert_int_equal(kv_wire_encode(&env, 1u << 20, out, &n), KV_OK);
    free(pl);
    return n;
}

static void test_client_never_reads(void **state) {
    (void)state;
    kvc_conn *other;
    assert_int_equal(kvd_harness_connect(&H, "bystander", &other), KV_OK);
    int fd = kvd_harness_raw_connect(&H);
    assert_true(fd >= 0);
    hello_raw(fd);
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    uint8_t *f;
    size_t n = ping_frame(&f, 7, 60000);
    /* Pipeline Pings with 60 KB payloads and never read: the replies pile up in kvd until the
     * 1 MiB output bound drops the connection. Meanwhile the bystander is answered: after every
     * frame, and while our socket is full. (Whether it ever fills depends on how fast kvd reads
     * us; under load it may keep up until it drops us, so both places ping.) */
    int closed = 0, pings = 0;
    for (int round = 0; round < 2000 && !closed && pings <= 5000; round++) {
        size_t off = 0;
        while (off < n) {
            ssize_t w = send(fd, f + off, n - off, MSG_NOSIGNAL);
            if (w > 0) {
                off += (size_t)w;
                continue;
            }
            if (w < 0 && (errno == EPIPE || errno == ECONNRESET)) {
                closed = 1;
                break;
            }
            assert_int_equal(kvc_ping(other, "x", 1), KV_OK); /* never stalls */
            pings++;
            kvd_harness_sleep_ms(2);
            if (pings > 5000) {
                break;
            }
        }
        if (!closed) {
            assert_int_equal(kvc_ping(other, "x", 1), KV_OK);
            pings++;
        }
    }
    free(f);
    if (!closed) {
        /* Our writes may be refused before kvd got to close us: the socket must end. */
        fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
        assert_true(kvd_harness_raw_closed(fd));
    }
    close(fd);
    assert_true(pings > 0);
    assert_int_equal(kvc_ping(other, NULL, 0), KV_OK);
    assert_int_equal(kvd_harness_wait_stat(other, 0, "daemon.sessions", 1), 1);
    kvc_conn_close(other);
}

static void test_slow_reader(void **state) {
    (void)state;
    kvc_conn *other;
    assert_int_equal(kvd_harness_connect(&H, "bystander", &other), KV_OK);
    int fd = kvd_harness_raw_connect(&H);
    assert_true(fd >= 0);
    hello_raw(fd);
    /* 300 small pipelined Pings (beyond max-inflight), replies read one at a time slowly. */
    enum { N = 300 };
    for (uint64_t i = 0; i < N; i++) {
        uint8_t *f;
        size_t n = ping_frame(&f, 100 + i, 100);
        assert_int_equal(send(fd, f, n, MSG_NOSIGNAL), (ssize_t)n);
        free(f);
    }
    for (uint64_t i = 0; i < N; i++) {
        Kvd__Envelope *e = NULL;
        assert_int_equal(kvd_harness_raw_read(fd, &e), 0);
        assert_int_equal(e->body_case, KVD__ENVELOPE__BODY_PONG);
        assert_int_equal(e->id, 100 + i); /* in order, none lost */
        kv_wire_free(e);
        if (i % 10 == 0) {
            kvd_harness_sleep_ms(3);
            assert_int_equal(kvc_ping(other, NULL, 0), KV_OK);
        }
    }
    close(fd);
    kvc_conn_close(other);
}

/* ---- resources ----------------------------------------------------------------------- */

static void test_pool_exhausted(void **state) {
    (void)state;
    kvc_conn *c, *obs;
    kvc_pool *p, *op;
    open_pool("hog", &c, &p);
    open_pool("observer", &obs, &op);
    kvc_block b[64];
    size_t held = 0;
    kv_err rc = KV_OK;
    while (held + 64 <= 1024 && (rc = kvc_allocate(p, 64, b)) == KV_OK) {
        held += 64;
        /* keep them: leases are released when the session closes */
    }
    assert_int_equal(rc, KV_ENOSPC);
    assert_true(strstr(kvc_last_error(c), "could be had") != NULL);
    kvc_block one;
    while (kvc_allocate(p, 1, &one) == KV_OK) {
        held++;
    }
    assert_int_equal(kvc_allocate(op, 1, &one), KV_ENOSPC);
    assert_int_equal(kvc_ping(obs, NULL, 0), KV_OK);
    kvc_conn_close(c); /* everything it held comes back */
    expect_nothing_held(obs, op);
    assert_int_equal(kvc_allocate(op, 4, b), KV_OK);
    assert_int_equal(kvc_release(op, b, 4), KV_OK);
    kvc_conn_close(obs);
}

static void test_fd_exhaustion(void **state) {
    (void)state;
    /* A kvd of its own whose RLIMIT_NOFILE (inherited through fork and exec) is 48. */
    struct rlimit old, low;
    assert_int_equal(getrlimit(RLIMIT_NOFILE, &old), 0);
    low = old;
    low.rlim_cur = 48;
    assert_int_equal(setrlimit(RLIMIT_NOFILE, &low), 0);
    kvd_harness small;
    int started = kvd_harness_start(&small, FLAGS);
    assert_int_equal(setrlimit(RLIMIT_NOFILE, &old), 0);
    assert_int_equal(started, 0);
    enum { N = 80 };
    int fds[N];
    for (int i = 0; i < N; i++) {
        fds[i] = kvd_harness_raw_connect(&small); /* the backlog takes what kvd cannot */
    }
    /* Some of these are beyond kvd's limit: it must neither die nor stop serving. */
    kvd_harness_sleep_ms(200);
    for (int i = 0; i < N; i++) {
        if (fds[i] >= 0) {
            close(fds[i]);
        }
    }
    kvc_conn *c = NULL;
    kv_err rc = KV_ESYS;
    for (int i = 0; i < 100 && rc != KV_OK; i++) {
        rc = kvd_harness_connect(&small, "after", &c);
        if (rc != KV_OK) {
            kvd_harness_sleep_ms(50);
        }
    }
    assert_int_equal(rc, KV_OK);
    assert_int_equal(kvc_ping(c, NULL, 0), KV_OK);
    kvc_pool *p;
    kv_layout l = kvd_harness_layout();
    assert_int_equal(kvc_pool_attach(c, "fd-model", &l, &p), KV_OK);
    kvc_conn_close(c);
    assert_int_equal(kvd_harness_stop(&small), 0);
    kvd_harness_fini(&small);
}

/* ---- daemon faults ------------------------------------------------------------------- */

/* A worker looping allocate/write/commit/release until the daemon goes away. */
static void load_child(int i) {
    kvc_conn *c;
    kvc_pool *p;
    kv_layout l = kvd_harness_layout();
    if (kvd_harness_connect(&H, "load", &c) != KV_OK ||
        kvc_pool_attach(c, "fault-model", &l, &p) != KV_OK) {
        _exit(1);
    }
    uint32_t tok[16];
    for (uint32_t k = 0;; k++) {
        for (int t = 0; t < 16; t++) {
            tok[t] = (uint32_t)i * 1000003u + k * 16u + (uint32_t)t;
        }
        kv_hash128 h;
        size_t nh;
        kvc_block b, canon;
        if (kvc_pool_hash_tokens(p, NULL, 0, tok, 16, &h, 1, &nh) != KV_OK ||
            kvc_allocate(p, 1, &b) != KV_OK) {
            _exit(0);
        }
        kvc_commit_entry e = {.block = b, .hash = h, .parent = KVC_NO_PARENT};
        if (kvc_commit(p, &e, 1, &canon) != KV_OK || kvc_release(p, &canon, 1) != KV_OK) {
            _exit(0);
        }
    }
}

static void test_sigterm_under_load(void **state) {
    (void)state;
    enum { N = 8 };
    pid_t pids[N];
    for (int i = 0; i < N; i++) {
        pids[i] = fork();
        assert_true(pids[i] >= 0);
        if (pids[i] == 0) {
            load_child(i);
        }
    }
    kvc_conn *obs;
    assert_int_equal(kvd_harness_connect(&H, "observer", &obs), KV_OK);
    assert_int_equal(kvd_harness_wait_stat(obs, 0, "daemon.sessions", N + 1), N + 1);
    kvd_harness_sleep_ms(200);
    kvc_conn_close(obs);
    assert_int_equal(kvd_harness_stop(&H), 0); /* drains and exits 0 */
    for (int i = 0; i < N; i++) {
        int st;
        assert_int_equal(waitpid(pids[i], &st, 0), pids[i]);
        assert_true(WIFEXITED(st)); /* the workers saw the close as an error, nothing worse */
    }
    assert_int_equal(kvd_harness_restart(&H), 0);
}

static void test_kill_and_restart(void **state) {
    (void)state;
    kvc_conn *c;
    kvc_pool *p;
    open_pool("survivor", &c, &p);
    uint64_t epoch = kvc_conn_boot_epoch(c);
    uint32_t tok[4 * 16];
    for (int i = 0; i < 4 * 16; i++) {
        tok[i] = 777 + (uint32_t)i;
    }
    kv_hash128 hs[4];
    size_t nh, nhit = 9;
    kvc_block b[4], canon[4], hit[4];
    assert_int_equal(kvc_pool_hash_tokens(p, NULL, 0, tok, 4 * 16, hs, 4, &nh), KV_OK);
    assert_int_equal(kvc_allocate(p, 4, b), KV_OK);
    kvc_commit_entry e[4];
    for (int i = 0; i < 4; i++) {
        memset(kvc_pool_addr(p, b[i].id, 0, KV_K, 0, 0), 0x77, 4096);
        e[i].block = b[i];
        e[i].hash = hs[i];
        e[i].parent = i > 0 ? b[i - 1].id : KVC_NO_PARENT;
    }
    assert_int_equal(kvc_commit(p, e, 4, canon), KV_OK);
    /* kvd dies without a chance to clean up, and a new one starts on the same socket. */
    kill(H.pid, SIGKILL);
    int st;
    assert_int_equal(waitpid(H.pid, &st, 0), H.pid);
    H.pid = 0;
    assert_int_equal(kvd_harness_restart(&H), 0);
    /* The first call finds the connection broken (ECLOSED) or has already reconnected and seen
     * the new epoch (EEPOCH); either way nothing is written and the pool is stale from then on.
     * A reconnect reports the restart as EEPOCH. */
    kv_err rc = kvc_lookup(p, hs, 4, hit, &nhit);
    assert_true(rc == KV_ECLOSED || rc == KV_EEPOCH);
    assert_int_equal(nhit, 9); /* outputs untouched on error */
    if (rc == KV_ECLOSED) {
        assert_int_equal(kvc_conn_reconnect(c), KV_EEPOCH);
    }
    assert_true(kvc_conn_boot_epoch(c) != epoch);
    assert_true(kvc_pool_stale(p));
    rc = kvc_release(p, canon, 4);
    assert_true(rc == KV_EEPOCH || rc == KV_ECLOSED);
    assert_int_equal(kvc_lookup(p, hs, 4, hit, &nhit), rc);
    assert_int_equal(nhit, 9);
    kvc_pool_detach(p);
    /* Attached again: the new daemon has none of the old blocks; the client reads nothing of
     * the old daemon's memory because nothing of it is handed out. */
    kv_layout l = kvd_harness_layout();
    assert_int_equal(kvc_pool_attach(c, "fault-model", &l, &p), KV_OK);
    assert_int_equal(kvc_pool_hash_tokens(p, NULL, 0, tok, 4 * 16, hs, 4, &nh), KV_OK);
    assert_int_equal(kvc_lookup(p, hs, 4, hit, &nhit), KV_OK);
    assert_int_equal(nhit, 0);
    /* A raw request carrying the old epoch is refused before anything else. */
    int fd = kvd_harness_raw_connect(&H);
    assert_true(fd >= 0);
    Kvd__Envelope env = KVD__ENVELOPE__INIT;
    Kvd__Ping ping = KVD__PING__INIT;
    env.id = 5;
    env.boot_epoch = epoch;
    env.body_case = KVD__ENVELOPE__BODY_PING;
    env.ping = &ping;
    uint8_t *f;
    size_t n;
    assert_int_equal(kv_wire_encode(&env, 1u << 20, &f, &n), KV_OK);
    assert_int_equal(send(fd, f, n, MSG_NOSIGNAL), (ssize_t)n);
    free(f);
    Kvd__Envelope *r = NULL;
    assert_int_equal(kvd_harness_raw_read(fd, &r), 0);
    assert_int_equal(r->body_case, KVD__ENVELOPE__BODY_ERROR);
    assert_int_equal(r->error->code, KV_EEPOCH);
    kv_wire_free(r);
    close(fd);
    kvc_conn_close(c);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sigkill_every_step), cmocka_unit_test(test_frames_cut_at_every_byte),
        cmocka_unit_test(test_client_never_reads), cmocka_unit_test(test_slow_reader),
        cmocka_unit_test(test_pool_exhausted),     cmocka_unit_test(test_fd_exhaustion),
        cmocka_unit_test(test_sigterm_under_load), cmocka_unit_test(test_kill_and_restart),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
