/* engine_api_test (issue 22): the libkvclient calls a vLLM-style scheduler needs, against a
 * real kvd: errors that are always set (kvc_last_error, also without a connection), the wrong
 * socket named at once, one round trip per scheduler step (kvc_seq_append_many), reservations
 * and lookahead slots, slot-mapping and padded block-table exports, DetachPool releasing
 * everything, teardown in any order, and the layout-conflict guardrail. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "kvclient.h"
#include "tests/integration/kvd_harness.h"

#define T 16 /* tokens per block of the harness layout */

static kvd_harness h;

static int group_setup(void **state) {
    (void)state;
    const char *flags[] = {"--pool-memory=64M", "--segment-bytes=1M", NULL};
    return kvd_harness_start(&h, flags);
}

static int group_teardown(void **state) {
    (void)state;
    return kvd_harness_finish(&h);
}

static kvc_pool *attach(kvc_conn *c, const char *model) {
    kv_layout l = kvd_harness_layout();
    kvc_pool *p;
    assert_int_equal(kvc_pool_attach(c, model, &l, &p), KV_OK);
    return p;
}

static uint32_t *tokens(size_t n, uint32_t base) {
    uint32_t *t = malloc(n * sizeof(*t));
    for (size_t i = 0; i < n; i++) {
        t[i] = base + (uint32_t)i;
    }
    return t;
}

/* A failing call without a round trip sets the message (it was stale or empty), and so does
 * one without a connection. */
static void test_last_error_always_set(void **state) {
    (void)state;
    kvc_conn *c;
    assert_int_equal(kvd_harness_connect(&h, "errors", &c), KV_OK);
    kvc_pool *p = attach(c, "m-errors");
    kvc_seq *s;
    assert_int_equal(kvc_seq_alloc(p, 64, NULL, 0, &s), KV_OK);
    uint32_t *t = tokens(40, 1);
    size_t cached;
    assert_int_equal(kvc_seq_prefill(s, t, 40, &cached), KV_OK);
    assert_int_equal(kvc_seq_rewind(s, 41, NULL), KV_EINVAL); /* leaves a rewind message */
    int32_t indptr[2], indices[1], last[1];
    assert_int_equal(kvc_seq_export_csr(&s, 1, indptr, 2, indices, 1, last, 1, NULL), KV_ETOOBIG);
    assert_non_null(strstr(kvc_last_error(c), "indices[3]"));
    kv_hash128 out[4];
    size_t nout;
    char extra[300]; /* above KV_HASH_MAX_EXTRA */
    memset(extra, 'x', sizeof(extra));
    assert_int_not_equal(kvc_pool_hash_tokens(p, extra, sizeof(extra), t, 32, out, 4, &nout),
                         KV_OK);
    assert_non_null(strstr(kvc_last_error(c), "hashing"));
    assert_non_null(strstr(kvc_last_error(NULL), "hashing")); /* the thread's too */
    assert_string_equal(kvc_err_name(KV_ENOSPC), "ENOSPC");
    assert_true(strlen(kvc_strerror(KV_ENOSPC)) > 0);
    kvc_seq_free(s);
    kvc_conn_close(c);
    /* kvc_conn_open has no connection to report on: the thread's last error says why. */
    kvc_options o;
    kvc_options_init(&o);
    o.socket_path = "/nonexistent-kvd-dir/kvd.sock";
    o.timeout_ms = 1000;
    assert_int_equal(kvc_conn_open(&o, &c), KV_ESYS);
    assert_non_null(strstr(kvc_last_error(NULL), "connect /nonexistent-kvd-dir/kvd.sock"));
    free(t);
}

/* kvc_conn_open of a socket at path with timeout_ms: expects want, within 2 s, and needle in
 * the last error. */
static void open_fails_fast(const char *path, int timeout_ms, kv_err want, const char *needle) {
    kvc_options o;
    kvc_options_init(&o);
    o.socket_path = path;
    o.timeout_ms = timeout_ms;
    kvc_conn *c;
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    assert_int_equal(kvc_conn_open(&o, &c), want);
    clock_gettime(CLOCK_MONOTONIC, &b);
    double secs = (double)(b.tv_sec - a.tv_sec) + (double)(b.tv_nsec - a.tv_nsec) / 1e9;
    assert_true(secs < 2.0);
    assert_non_null(strstr(kvc_last_error(NULL), needle));
}

/* A worker pointed at the admin socket hears so at once instead of timing out. */
static void test_wrong_socket(void **state) {
    (void)state;
    char admin[160];
    snprintf(admin, sizeof(admin), "%s/admin.sock", h.dir);
    open_fails_fast(admin, 5000, KV_EPROTO, "admin socket");
    /* A path longer than a Unix socket's: refused, and the last error says so (it kept the
     * previous call's text). */
    char longp[300];
    memset(longp, 'a', sizeof(longp) - 1);
    longp[0] = '/';
    longp[sizeof(longp) - 1] = '\0';
    open_fails_fast(longp, 5000, KV_ETOOBIG, "too long");
}

/* A socket whose listen queue is full and that never accepts (a kvd stopped or hung):
 * kvc_conn_open gives up within its timeout (a blocking connect waited for ever). */
static void test_connect_keeps_to_the_timeout(void **state) {
    (void)state;
    char path[160];
    snprintf(path, sizeof(path), "%s/full.sock", h.dir);
    int l = socket(AF_UNIX, SOCK_STREAM, 0);
    assert_true(l >= 0);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    assert_true(strlen(path) < sizeof(sa.sun_path));
    memcpy(sa.sun_path, path, strlen(path) + 1);
    assert_int_equal(bind(l, (struct sockaddr *)&sa, sizeof(sa)), 0);
    assert_int_equal(listen(l, 0), 0);
    int fill[64], nfill = 0;
    for (; nfill < 64; nfill++) { /* until the queue refuses one */
        fill[nfill] = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK, 0);
        if (connect(fill[nfill], (struct sockaddr *)&sa, sizeof(sa)) != 0) {
            close(fill[nfill]);
            break;
        }
    }
    assert_true(nfill < 64);
    open_fails_fast(path, 200, KV_ETIMEDOUT, "accepted no connection");
    for (int i = 0; i < nfill; i++) {
        close(fill[i]);
    }
    close(l);
    unlink(path);
}

/* One scheduler step for 64 sequences is one request (one Allocate for the pool), where
 * per-sequence appends make one each. */
static void test_append_many_one_round_trip(void **state) {
    (void)state;
    kvc_conn *c;
    assert_int_equal(kvd_harness_connect(&h, "step", &c), KV_OK);
    kvc_pool *p = attach(c, "m-step");
    enum { N = 64 };
    kvc_seq *seqs[N];
    const uint32_t *tok[N];
    size_t counts[N];
    kv_err st[N];
    uint32_t *t = tokens(2 * T, 100);
    /* Map the segments the step will use first: a step that grows the pool into a new
     * segment also fetches its mapping (one more request, only that once). */
    kvc_block warm[2 * N];
    assert_int_equal(kvd_harness_alloc_all(p, warm, 2 * N, N), KV_OK);
    assert_int_equal(kvc_release(p, warm, 2 * N), KV_OK);
    for (int i = 0; i < N; i++) {
        assert_int_equal(kvc_seq_alloc(p, 8 * T, NULL, 0, &seqs[i]), KV_OK);
        size_t cached;
        assert_int_equal(kvc_seq_prefill(seqs[i], t, T, &cached), KV_OK); /* one full block */
        tok[i] = t + T;
        counts[i] = 1; /* each crosses into a new block */
    }
    uint64_t before = kvd_harness_stat(c, 0, "session.requests");
    assert_int_equal(kvc_seq_append_many(seqs, N, tok, counts, st), KV_OK);
    uint64_t after = kvd_harness_stat(c, 0, "session.requests");
    assert_int_equal(after - before, 1 + 1); /* the Allocate, and the Stats that read it */
    for (int i = 0; i < N; i++) {
        assert_int_equal(st[i], KV_OK);
        assert_int_equal(kvc_seq_length(seqs[i]), T + 1);
        assert_int_equal(kvc_seq_nblocks(seqs[i]), 2);
    }
    /* Blocks are distinct across sequences. */
    for (int i = 0; i < N; i++) {
        for (int j = i + 1; j < N; j++) {
            assert_int_not_equal(kvc_seq_block(seqs[i], 1).id, kvc_seq_block(seqs[j], 1).id);
        }
    }
    /* A step where nothing crosses a block boundary costs no request at all. */
    before = kvd_harness_stat(c, 0, "session.requests");
    assert_int_equal(kvc_seq_append_many(seqs, N, tok, counts, st), KV_OK);
    assert_int_equal(kvd_harness_stat(c, 0, "session.requests") - before, 1);
    /* A sequence past its max_tokens fails alone; the others grow. */
    uint32_t *big = tokens(8 * T, 7);
    tok[3] = big;
    counts[3] = 8 * T;
    assert_int_equal(kvc_seq_append_many(seqs, N, tok, counts, st), KV_ETOOBIG);
    assert_int_equal(st[3], KV_ETOOBIG);
    assert_int_equal(st[4], KV_OK);
    assert_int_equal(kvc_seq_length(seqs[3]), T + 2);
    assert_int_equal(kvc_seq_length(seqs[4]), T + 3);
    for (int i = 0; i < N; i++) {
        kvc_seq_free(seqs[i]);
    }
    free(big);
    free(t);
    kvc_conn_close(c);
}

/* Reservations and lookahead: held blocks past the length, appends within them need no
 * request, rewind keeps them, release gives everything back. */
static void test_reserve_and_lookahead(void **state) {
    (void)state;
    kvc_conn *c;
    assert_int_equal(kvd_harness_connect(&h, "reserve", &c), KV_OK);
    kvc_pool *p = attach(c, "m-reserve");
    kvc_seq *s;
    assert_int_equal(kvc_seq_alloc(p, 16 * T, NULL, 0, &s), KV_OK);
    assert_int_equal(kvc_seq_reserve(s, 8 * T), KV_OK); /* admission: the whole request */
    assert_int_equal(kvc_seq_capacity(s), 8 * T);
    assert_int_equal(kvd_harness_stat(c, kvc_pool_id(p), "pool.blocks_writing"), 8);
    uint32_t *t = tokens(8 * T, 1);
    size_t cached;
    uint64_t before = kvd_harness_stat(c, 0, "session.requests");
    assert_int_equal(kvc_seq_prefill(s, t, 3 * T, &cached), KV_OK); /* a Lookup only */
    assert_int_equal(kvc_seq_append(s, t + 3 * T, 4 * T), KV_OK);   /* no request */
    assert_int_equal(kvd_harness_stat(c, 0, "session.requests") - before, 1 + 1);
    assert_int_equal(kvc_seq_nblocks(s), 7);
    /* Rewind keeps the reservation's blocks held. */
    assert_int_equal(kvc_seq_rewind(s, 2 * T, NULL), KV_OK);
    assert_int_equal(kvc_seq_capacity(s), 8 * T);
    /* Lookahead: 2 draft slots past the length, their slots exported before the drafts exist. */
    assert_int_equal(kvc_seq_reserve(s, 0), KV_OK);
    assert_int_equal(kvc_seq_set_lookahead(s, 2), KV_OK);
    assert_int_equal(kvc_seq_capacity(s), 3 * T);
    int64_t slots[3];
    assert_int_equal(kvc_seq_export_slots(s, 2 * T, 2 * T + 2, slots, 3), KV_OK);
    assert_int_equal(slots[0], (int64_t)kvc_seq_block(s, 2).id * T);
    assert_int_equal(kvc_seq_export_slots(s, 0, 3 * T + 1, slots, 3), KV_EINVAL);
    assert_int_equal(kvc_seq_release(s), KV_OK);
    assert_int_equal(kvd_harness_stat(c, kvc_pool_id(p), "pool.blocks_writing"), 0);
    kvc_seq_free(s);
    free(t);
    kvc_conn_close(c);
}

/* A reservation made while empty, then a prefill whose prefix is cached: the hits stand for part
 * of the reservation, the reserved blocks past it go back (they all went behind the hits: a table
 * of 4 blocks took 7 entries, and the sequence held 7 blocks for a 4-block reservation). */
static void test_reserve_then_prefill_with_hits(void **state) {
    (void)state;
    kvc_conn *c;
    assert_int_equal(kvd_harness_connect(&h, "reserve-hits", &c), KV_OK);
    kvc_pool *p = attach(c, "m-reserve-hits");
    uint32_t *t = tokens(4 * T, 3);
    size_t cached;
    kvc_seq *a;
    assert_int_equal(kvc_seq_alloc(p, 4 * T, NULL, 0, &a), KV_OK);
    assert_int_equal(kvc_seq_prefill(a, t, 4 * T, &cached), KV_OK);
    assert_int_equal(kvc_seq_commit(a, 4 * T, NULL), KV_OK); /* the 4 full blocks cached */
    kvc_seq *s;
    assert_int_equal(kvc_seq_alloc(p, 4 * T, NULL, 0, &s), KV_OK);
    assert_int_equal(kvc_seq_reserve(s, 4 * T), KV_OK);
    uint64_t writing = kvd_harness_stat(c, kvc_pool_id(p), "pool.blocks_writing");
    assert_int_equal(kvc_seq_prefill(s, t, 4 * T, &cached), KV_OK);
    assert_int_equal(cached, 3 * T); /* the last block is computed again (the last token) */
    assert_int_equal(kvc_seq_nblocks(s), 4);
    assert_int_equal(kvc_seq_capacity(s), 4 * T);
    /* Of the 4 reserved, one stays (behind the 3 hits): 3 went back. */
    assert_int_equal(kvd_harness_stat(c, kvc_pool_id(p), "pool.blocks_writing"), writing - 3);
    assert_int_equal(kvc_seq_release(s), KV_OK);
    assert_int_equal(kvc_seq_release(a), KV_OK);
    kvc_seq_free(s);
    kvc_seq_free(a);
    free(t);
    kvc_conn_close(c);
}

/* The padded 2-D block table (fixed buffer) and its limits. */
static void test_export_table(void **state) {
    (void)state;
    kvc_conn *c;
    assert_int_equal(kvd_harness_connect(&h, "table", &c), KV_OK);
    kvc_pool *p = attach(c, "m-table");
    kvc_seq *s[2];
    uint32_t *t = tokens(3 * T, 9);
    size_t cached;
    assert_int_equal(kvc_seq_alloc(p, 4 * T, NULL, 0, &s[0]), KV_OK);
    assert_int_equal(kvc_seq_alloc(p, 4 * T, NULL, 0, &s[1]), KV_OK);
    assert_int_equal(kvc_seq_prefill(s[0], t, 3 * T, &cached), KV_OK);
    assert_int_equal(kvc_seq_prefill(s[1], t, T + 1, &cached), KV_OK);
    int32_t table[2 * 4];
    size_t used;
    assert_int_equal(kvc_seq_export_table(s, 2, table, 4, -1, &used), KV_OK);
    assert_int_equal(used, 3);
    assert_int_equal(table[0], (int32_t)kvc_seq_block(s[0], 0).id);
    assert_int_equal(table[3], -1);
    assert_int_equal(table[4 + 1], (int32_t)kvc_seq_block(s[1], 1).id);
    assert_int_equal(table[4 + 2], -1);
    assert_int_equal(kvc_seq_export_table(s, 2, table, 2, -1, &used), KV_ETOOBIG);
    kvc_seq_free(s[0]);
    kvc_seq_free(s[1]);
    free(t);
    kvc_conn_close(c);
}

/* kvc_pool_detach gives back everything the session held there (DetachPool), and the pool's
 * sequences become empty shells that may be freed afterwards. */
static void test_detach_releases(void **state) {
    (void)state;
    kvc_conn *c, *watch;
    assert_int_equal(kvd_harness_connect(&h, "detach", &c), KV_OK);
    assert_int_equal(kvd_harness_connect(&h, "watch", &watch), KV_OK);
    kvc_pool *p = attach(c, "m-detach");
    kvc_pool *w = attach(watch, "m-detach"); /* keeps the pool alive to look at */
    uint32_t pid = kvc_pool_id(p);
    kvc_seq *s;
    assert_int_equal(kvc_seq_alloc(p, 8 * T, NULL, 0, &s), KV_OK);
    uint32_t *t = tokens(4 * T, 3);
    size_t cached;
    assert_int_equal(kvc_seq_prefill(s, t, 4 * T, &cached), KV_OK);
    kvc_block raw[3];
    assert_int_equal(kvc_allocate(p, 3, raw), KV_OK); /* held outside any sequence */
    assert_int_equal(kvd_harness_stat(watch, kvc_pool_id(w), "pool.blocks_writing"), 7);
    kvc_pool_detach(p);
    assert_int_equal(kvd_harness_stat(watch, pid, "pool.blocks_writing"), 0);
    assert_int_equal(kvc_seq_append(s, t, 1), KV_ESTATE);
    assert_non_null(strstr(kvc_last_error(NULL), "detached"));
    kvc_seq_free(s);
    free(t);
    kvc_conn_close(c);
    kvc_conn_close(watch);
}

/* kvc_conn_close with sequences and batches still alive: they are freed afterwards without
 * touching freed memory (ASan checks), and their calls say the connection is gone. */
static void test_close_in_any_order(void **state) {
    (void)state;
    kvc_conn *c;
    assert_int_equal(kvd_harness_connect(&h, "order", &c), KV_OK);
    kvc_pool *p = attach(c, "m-order");
    kvc_seq *s;
    assert_int_equal(kvc_seq_alloc(p, 4 * T, NULL, 0, &s), KV_OK);
    kvc_batch *b;
    assert_int_equal(kvc_batch_alloc(c, &b), KV_OK);
    assert_int_equal(kvc_batch_ping(b, NULL, 0, NULL), KV_OK);
    kvc_conn_close(c);
    assert_int_equal(kvc_batch_run(b), KV_ECLOSED);
    uint32_t one = 1;
    assert_int_equal(kvc_seq_append(s, &one, 1), KV_ESTATE);
    kvc_batch_free(b);
    kvc_seq_free(s);
}

/* A second attach of a model id with another layout is flagged (and logged by kvd). */
static void test_layout_conflict(void **state) {
    (void)state;
    kvc_conn *c;
    assert_int_equal(kvd_harness_connect(&h, "layout", &c), KV_OK);
    kv_layout a = kvd_harness_layout();
    kv_layout b;
    assert_int_equal(kv_layout_init(a.num_layers, a.num_kv_heads * 2, a.head_dim,
                                    a.tokens_per_block, a.dtype, a.arrangement, &b),
                     KV_OK);
    kvc_pool *pa, *pb;
    assert_int_equal(kvc_pool_attach(c, "m-layout", &a, &pa), KV_OK);
    assert_int_equal(kvc_pool_layout_conflict(pa), 0);
    assert_int_equal(kvc_pool_attach(c, "m-layout", &b, &pb), KV_OK);
    assert_int_equal(kvc_pool_layout_conflict(pb), 1);
    assert_true(kvc_pool_max_blocks(pb) > 0);
    kvc_conn_close(c);
}

/* Fills every byte of block b (all layers, K and V) with v. */
static void fill_block(kvc_pool *p, uint32_t b, uint8_t v) {
    const kv_layout *l = kvc_pool_layout(p);
    for (uint32_t layer = 0; layer < l->num_layers; layer++) {
        for (int kv = KV_K; kv <= KV_V; kv++) {
            memset(kvc_pool_addr(p, b, layer, kv, 0, 0), v, l->kv_block_bytes);
        }
    }
}

/* 1 when every byte of block b is v. */
static int block_is(kvc_pool *p, uint32_t b, uint8_t v) {
    const kv_layout *l = kvc_pool_layout(p);
    for (uint32_t layer = 0; layer < l->num_layers; layer++) {
        for (int kv = KV_K; kv <= KV_V; kv++) {
            const uint8_t *a = kvc_pool_addr(p, b, layer, kv, 0, 0);
            for (uint64_t i = 0; i < l->kv_block_bytes; i++) {
                if (a[i] != v) {
                    return 0;
                }
            }
        }
    }
    return 1;
}

/* Fork: committed blocks are shared (same ids, one more reference), the partial last block is
 * a fresh lease listed for copying; the two then grow apart; too small a copy list makes
 * nothing; everything goes back when both are freed. */
static void test_fork_shares_committed_blocks(void **state) {
    (void)state;
    kvc_conn *c;
    assert_int_equal(kvd_harness_connect(&h, "fork", &c), KV_OK);
    kvc_pool *p = attach(c, "m-fork");
    uint32_t pid = kvc_pool_id(p);
    kvc_seq *a, *b;
    assert_int_equal(kvc_seq_alloc(p, 8 * T, NULL, 0, &a), KV_OK);
    uint32_t *t = tokens(2 * T + 5, 40);
    size_t cached;
    assert_int_equal(kvc_seq_prefill(a, t, 2 * T + 5, &cached), KV_OK);
    for (size_t i = 0; i < 3; i++) {
        fill_block(p, kvc_seq_block(a, i).id, (uint8_t)(0x10 + i));
    }
    assert_int_equal(kvc_seq_commit(a, 2 * T + 5, NULL), KV_OK); /* the two full blocks */
    int32_t from[2], to[2];
    size_t ncopy;
    uint64_t writing = kvd_harness_stat(c, pid, "pool.blocks_writing");
    assert_int_equal(kvc_seq_fork(a, &b, from, to, 0, &ncopy), KV_ETOOBIG);
    assert_int_equal(kvd_harness_stat(c, pid, "pool.blocks_writing"), writing);
    assert_int_equal(kvc_seq_fork(a, &b, from, to, 2, &ncopy), KV_OK);
    assert_int_equal(ncopy, 1);
    assert_int_equal(kvc_seq_length(b), 2 * T + 5);
    assert_int_equal(kvc_seq_ncommitted(b), 2);
    for (size_t i = 0; i < 2; i++) {
        assert_int_equal(kvc_seq_block(b, i).id, kvc_seq_block(a, i).id);
    }
    assert_int_equal(from[0], (int32_t)kvc_seq_block(a, 2).id);
    assert_int_equal(to[0], (int32_t)kvc_seq_block(b, 2).id);
    assert_int_not_equal(to[0], from[0]);
    assert_int_equal(kvd_harness_stat(c, pid, "pool.blocks_writing"), writing + 1);
    assert_int_equal(kvc_pool_copy_blocks(p, from, to, ncopy), KV_OK);
    assert_true(block_is(p, (uint32_t)to[0], 0x12));
    /* They grow apart: different tokens into their own last blocks. */
    uint32_t x = 7, y = 9;
    assert_int_equal(kvc_seq_append(a, &x, 1), KV_OK);
    assert_int_equal(kvc_seq_append(b, &y, 1), KV_OK);
    fill_block(p, kvc_seq_block(b, 2).id, 0x77);
    assert_true(block_is(p, kvc_seq_block(a, 2).id, 0x12));
    /* Forking an uncommitted sequence copies every block. */
    kvc_seq *u, *v;
    assert_int_equal(kvc_seq_alloc(p, 8 * T, NULL, 0, &u), KV_OK);
    uint32_t *t2 = tokens(2 * T, 900);
    assert_int_equal(kvc_seq_prefill(u, t2, 2 * T, &cached), KV_OK);
    assert_int_equal(kvc_seq_fork(u, &v, from, to, 2, &ncopy), KV_OK);
    assert_int_equal(ncopy, 2);
    kvc_seq_free(v);
    kvc_seq_free(u);
    kvc_seq_free(b);
    kvc_seq_free(a);
    assert_int_equal(kvd_harness_stat(c, pid, "pool.blocks_writing"), 0);
    assert_int_equal(kvd_harness_stat(c, pid, "pool.session_refs"), 0);
    free(t2);
    free(t);
    kvc_conn_close(c);
}

/* A step the pool cannot supply whole changes no sequence and holds nothing more; once room
 * is made the same step succeeds. Runs last: it spends the daemon's whole budget. */
static void test_append_many_all_or_none(void **state) {
    (void)state;
    kvc_conn *c;
    assert_int_equal(kvd_harness_connect(&h, "full", &c), KV_OK);
    kvc_pool *p = attach(c, "m-full");
    enum { N = 64, CHUNK = 32, MAXHOG = 8192 };
    kvc_seq *seqs[N];
    const uint32_t *tok[N];
    size_t counts[N];
    kv_err st[N];
    uint32_t *t = tokens(2 * T, 5);
    for (int i = 0; i < N; i++) {
        assert_int_equal(kvc_seq_alloc(p, 4 * T, NULL, 0, &seqs[i]), KV_OK);
        size_t cached;
        assert_int_equal(kvc_seq_prefill(seqs[i], t, T, &cached), KV_OK);
        tok[i] = t + T;
        counts[i] = 1;
    }
    kvc_block *hog = malloc(MAXHOG * sizeof(*hog));
    size_t nhog = 0;
    while (nhog + CHUNK <= MAXHOG && kvc_allocate(p, CHUNK, hog + nhog) == KV_OK) {
        nhog += CHUNK;
    }
    assert_true(nhog >= 2 * CHUNK && nhog + CHUNK <= MAXHOG); /* the budget ran out */
    assert_int_equal(kvc_release(p, hog + nhog - CHUNK, CHUNK), KV_OK);
    nhog -= CHUNK;
    uint64_t writing = kvd_harness_stat(c, kvc_pool_id(p), "pool.blocks_writing");
    assert_int_equal(kvc_seq_append_many(seqs, N, tok, counts, st), KV_ENOSPC);
    for (int i = 0; i < N; i++) {
        assert_int_equal(st[i], KV_ENOSPC);
        assert_int_equal(kvc_seq_length(seqs[i]), T);
    }
    assert_int_equal(kvd_harness_stat(c, kvc_pool_id(p), "pool.blocks_writing"), writing);
    assert_int_equal(kvc_release(p, hog + nhog - CHUNK, CHUNK), KV_OK);
    nhog -= CHUNK;
    assert_int_equal(kvc_seq_append_many(seqs, N, tok, counts, st), KV_OK);
    assert_int_equal(kvc_seq_length(seqs[N - 1]), T + 1);
    assert_int_equal(kvc_release(p, hog, nhog), KV_OK);
    for (int i = 0; i < N; i++) {
        kvc_seq_free(seqs[i]);
    }
    free(hog);
    free(t);
    kvc_conn_close(c);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_last_error_always_set),
        cmocka_unit_test(test_wrong_socket),
        cmocka_unit_test(test_connect_keeps_to_the_timeout),
        cmocka_unit_test(test_append_many_one_round_trip),
        cmocka_unit_test(test_reserve_and_lookahead),
        cmocka_unit_test(test_reserve_then_prefill_with_hits),
        cmocka_unit_test(test_export_table),
        cmocka_unit_test(test_detach_releases),
        cmocka_unit_test(test_close_in_any_order),
        cmocka_unit_test(test_layout_conflict),
        cmocka_unit_test(test_fork_shares_committed_blocks),
        cmocka_unit_test(test_append_many_all_or_none),
    };
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
