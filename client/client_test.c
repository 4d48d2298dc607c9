/* libkvclient against fake_kvd (real framing and fd passing, one connection at a time): the
 * synchronous calls, pipelined batches, segment growth, sequences and their CSR export, error
 * codes with messages, and restart detection. tests/integration runs the same paths against
 * the real kvd. */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "client/testing/fake_kvd.h"
#include "client/include/kvclient.h"

typedef struct fixture {
    fake_kvd *kvd;
    kvc_conn *conn;
    kvc_pool *pool;
    int logs; /* lines the log callback received */
} fixture;

static void count_log(void *arg, int level, const char *id, const char *msg) {
    (void)level;
    (void)msg;
    fixture *f = arg;
    assert_non_null(id);
    f->logs++;
}

static kv_layout test_layout(void) {
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

static int setup_cfg_hide(void **state, uint32_t bps, uint32_t init, uint32_t max, uint32_t maxb,
                          uint32_t hide_from) {
    static fixture fx;
    memset(&fx, 0, sizeof(fx));
    fake_kvd_config cfg = {.blocks_per_segment = bps,
                           .initial_segments = init,
                           .max_segments = max,
                           .max_blocks = maxb,
                           .epoch = 0x1111,
                           .hide_from = hide_from};
    if (fake_kvd_start(&cfg, &fx.kvd) != 0) {
        return -1;
    }
    kvc_options o;
    kvc_options_init(&o);
    o.socket_path = fake_kvd_path(fx.kvd);
    o.client_name = "client_test";
    o.log = count_log;
    o.log_arg = &fx;
    o.log_level = KVC_LOG_DEBUG;
    o.timeout_ms = 5000;
    if (kvc_conn_open(&o, &fx.conn) != KV_OK) {
        return -1;
    }
    kv_layout l = test_layout();
    if (kvc_pool_attach(fx.conn, "test-model", &l, &fx.pool) != KV_OK) {
        return -1;
    }
    *state = &fx;
    return 0;
}

static int setup_cfg(void **state, uint32_t bps, uint32_t init, uint32_t max, uint32_t maxb) {
    return setup_cfg_hide(state, bps, init, max, maxb, 0);
}

static int setup(void **state) {
    return setup_cfg(state, 4, 1, 8, 4096);
}

/* A lying daemon: segment 1 and later are never sent nor announced. */
static int setup_lying(void **state) {
    return setup_cfg_hide(state, 4, 1, 8, 4096, 1);
}

static int setup_many_segments(void **state) {
    return setup_cfg(state, 4, 1, 64, 4096);
}

static int setup_small_lists(void **state) {
    return setup_cfg(state, 4, 1, 16, 3);
}

static int teardown(void **state) {
    fixture *f = *state;
    kvc_conn_close(f->conn);
    fake_kvd_stop(f->kvd);
    return 0;
}

static void tokens_fill(uint32_t *t, size_t n, uint32_t base) {
    for (size_t i = 0; i < n; i++) {
        t[i] = base + (uint32_t)i;
    }
}

/* A daemon that hands out blocks in a segment it never sends: the call that returned them fails
 * with KV_EPROTO (they are still leased), and a commit of such a block is refused with
 * KV_ESTATE while the client releases the lease itself, so bytes this worker never wrote
 * through its mapping are never published. */
static void test_unaddressable_blocks(void **state) {
    fixture *f = *state;
    kvc_block b[4], x[2];
    assert_int_equal(kvc_allocate(f->pool, 4, b), KV_OK); /* segment 0: mapped */
    assert_int_equal(kvc_allocate(f->pool, 2, x), KV_EPROTO);
    assert_non_null(strstr(kvc_last_error(f->conn), "never sent"));
    assert_true(x[0].id >= 4);
    assert_null(kvc_pool_addr(f->pool, x[0].id, 0, KV_K, 0, 0));
    assert_int_equal(fake_kvd_writing(f->kvd), 6);
    /* Committing an unaddressable block: refused, nothing committed, its lease released. */
    kvc_commit_entry e[2] = {{.block = b[0], .hash = {1, 2}, .parent = KVC_NO_PARENT},
                             {.block = x[0], .hash = {3, 4}, .parent = b[0].id}};
    kvc_block canon[2];
    assert_int_equal(kvc_commit(f->pool, e, 2, canon), KV_ESTATE);
    assert_non_null(strstr(kvc_last_error(f->conn), "not mapped"));
    assert_non_null(strstr(kvc_last_error(f->conn), "released"));
    assert_int_equal(fake_kvd_writing(f->kvd), 5); /* x[0] went back; b[0] is still ours */
    assert_int_equal(kvc_release(f->pool, b, 4), KV_OK);
    assert_int_equal(kvc_release(f->pool, &x[1], 1), KV_OK);
    assert_int_equal(fake_kvd_writing(f->kvd), 0);
    assert_int_equal(fake_kvd_refs(f->kvd), 0);
}

static void test_hello_ping_stats(void **state) {
    fixture *f = *state;
    assert_int_equal(kvc_conn_boot_epoch(f->conn), 0x1111);
    assert_string_equal(kvc_conn_tenant(f->conn), "test");
    assert_true(kvc_conn_session_id(f->conn) > 0);
    assert_int_equal(kvc_ping(f->conn, "hello", 5), KV_OK);
    assert_int_equal(kvc_ping(f->conn, NULL, 0), KV_OK);
    uint64_t v = 99;
    assert_int_equal(kvc_stat_get(f->conn, kvc_pool_id(f->pool), "session.refs_held", &v), KV_OK);
    assert_int_equal(v, 0);
    assert_int_equal(kvc_stat_get(f->conn, 0, "no.such", &v), KV_ENOENT);
    assert_true(strlen(kvc_last_error(f->conn)) > 0);
}

static void test_attach_maps_layers(void **state) {
    fixture *f = *state;
    const kv_layout *l = kvc_pool_layout(f->pool);
    assert_int_equal(l->tokens_per_block, 16);
    assert_true(l->block_bytes > 0);
    assert_int_equal(kvc_pool_blocks_per_segment(f->pool), 4);
    assert_int_equal(kvc_pool_segments(f->pool), 1);
    assert_int_equal(kvc_pool_hash_seed(f->pool).lo, 0x1234);
    uint16_t *k = kvc_pool_addr(f->pool, 2, 1, KV_K, 3, 1);
    assert_non_null(k);
    *k = 4242;
    uint8_t *base = kvc_pool_layer_base(f->pool, 1, KV_K);
    assert_non_null(base);
    /* Two windows (segment, layer tensor) on the same shared pages. */
    uint16_t *k2 = (uint16_t *)(base + 2 * l->kv_block_bytes + 3 * l->token_bytes + 64 * 2);
    assert_int_equal(*k2, 4242);
    *k2 = 777;
    assert_int_equal(*k, 777);
}

static void test_allocate_grows_and_maps(void **state) {
    fixture *f = *state;
    kvc_block b[10];
    /* 10 blocks with 4 per segment: the fake grows two segments and announces them. */
    assert_int_equal(kvc_allocate(f->pool, 10, b), KV_OK);
    assert_int_equal(fake_kvd_segments(f->kvd), 3);
    assert_int_equal(kvc_pool_segments(f->pool), 3);
    for (int i = 0; i < 10; i++) {
        uint32_t *e = kvc_pool_addr(f->pool, b[i].id, 1, KV_V, 15, 1);
        assert_non_null(e);
        *e = b[i].id; /* every block writable */
    }
    assert_int_equal(fake_kvd_writing(f->kvd), 10);
    assert_int_equal(kvc_release(f->pool, b, 10), KV_OK);
    assert_int_equal(fake_kvd_writing(f->kvd), 0);
    assert_int_equal(fake_kvd_refs(f->kvd), 0);
}

static void test_commit_lookup_and_errors(void **state) {
    fixture *f = *state;
    uint32_t tok[64];
    tokens_fill(tok, 64, 100);
    kv_hash128 h[4];
    size_t nh = 0;
    assert_int_equal(kvc_pool_hash_tokens(f->pool, NULL, 0, tok, 64, h, 4, &nh), KV_OK);
    assert_int_equal(nh, 4);
    kvc_block b[4];
    assert_int_equal(kvc_allocate(f->pool, 4, b), KV_OK);
    kvc_commit_entry e[4];
    for (int i = 0; i < 4; i++) {
        e[i].block = b[i];
        e[i].hash = h[i];
        e[i].parent = i == 0 ? KVC_NO_PARENT : b[i - 1].id;
    }
    kvc_block canon[4];
    assert_int_equal(kvc_commit(f->pool, e, 4, canon), KV_OK);
    assert_memory_equal(canon, b, sizeof(b));
    /* Committing again: the blocks are no longer WRITING. */
    assert_int_equal(kvc_commit(f->pool, e, 1, canon), KV_ESTATE);
    assert_non_null(strstr(kvc_last_error(f->conn), "ESTATE"));
    kvc_block hit[4];
    size_t nhit = 0;
    assert_int_equal(kvc_lookup(f->pool, h, 4, hit, &nhit), KV_OK);
    assert_int_equal(nhit, 4);
    assert_memory_equal(hit, b, sizeof(b));
    /* A stale generation is refused and nothing changes. */
    kvc_block stale = b[0];
    stale.gen++;
    assert_int_equal(kvc_release(f->pool, &stale, 1), KV_ESTALE);
    kvc_block bogus = {.id = 100000, .gen = 0};
    assert_int_equal(kvc_release(f->pool, &bogus, 1), KV_ENOENT);
    assert_int_equal(kvc_release(f->pool, hit, 4), KV_OK);
    assert_int_equal(kvc_release(f->pool, b, 4), KV_OK);
    assert_int_equal(fake_kvd_refs(f->kvd), 0);
    /* Local checks never reach the daemon. */
    assert_int_equal(kvc_allocate(f->pool, 0, b), KV_EINVAL);
}

static void test_batch_pipelined(void **state) {
    fixture *f = *state;
    kvc_batch *bt;
    assert_int_equal(kvc_batch_alloc(f->conn, &bt), KV_OK);
    enum { N = 200 };
    static kvc_block blocks[N];
    size_t idx[N + 1];
    for (int i = 0; i < N; i++) {
        assert_int_equal(kvc_batch_allocate(bt, f->pool, 1, &blocks[i], &idx[i]), KV_OK);
    }
    assert_int_equal(kvc_batch_ping(bt, "x", 1, &idx[N]), KV_OK);
    assert_int_equal(kvc_batch_count(bt), N + 1);
    uint64_t before = fake_kvd_requests(f->kvd);
    assert_int_equal(kvc_batch_send(bt), KV_OK);
    assert_int_equal(kvc_batch_wait(bt), KV_OK);
    /* The requests, plus one MapSegments for every segment the pool grew meanwhile. */
    assert_int_equal(fake_kvd_requests(f->kvd) - before, N + 2);
    for (int i = 0; i <= N; i++) {
        assert_int_equal(kvc_batch_status(bt, idx[i]), KV_OK);
    }
    /* Blocks are distinct and mapped (the pool grew while the batch ran). */
    for (int i = 0; i < N; i++) {
        assert_non_null(kvc_pool_addr(f->pool, blocks[i].id, 0, KV_K, 0, 0));
        for (int j = 0; j < i; j++) {
            assert_int_not_equal(blocks[i].id, blocks[j].id);
        }
    }
    kvc_batch_reset(bt);
    size_t ok, bad;
    assert_int_equal(kvc_batch_release(bt, f->pool, blocks, N, &ok), KV_OK);
    assert_int_equal(kvc_batch_release(bt, f->pool, blocks, 1, &bad), KV_OK); /* freed: ESTALE */
    assert_int_equal(kvc_batch_run(bt), KV_OK);
    assert_int_equal(kvc_batch_status(bt, ok), KV_OK);
    assert_int_equal(kvc_batch_status(bt, bad), KV_ESTALE);
    assert_int_equal(kvc_batch_status(bt, 99), KV_EINVAL);
    assert_int_equal(fake_kvd_refs(f->kvd), 0);
    kvc_batch_free(bt);
    /* The connection still works after a batch. */
    assert_int_equal(kvc_ping(f->conn, NULL, 0), KV_OK);
}

/* kvc_batch_lookup_many / kvc_batch_release_many: n requests from one call, consecutive
 * indexes, and nothing queued when one of them is refused locally. */
static void test_batch_many(void **state) {
    fixture *f = *state;
    uint32_t tok[64];
    tokens_fill(tok, 64, 300);
    kv_hash128 h[4];
    size_t nh = 0;
    assert_int_equal(kvc_pool_hash_tokens(f->pool, NULL, 0, tok, 64, h, 4, &nh), KV_OK);
    kvc_block b[4], canon[4];
    assert_int_equal(kvc_allocate(f->pool, 4, b), KV_OK);
    kvc_commit_entry e[4];
    for (int i = 0; i < 4; i++) {
        e[i] = (kvc_commit_entry){b[i], h[i], i == 0 ? KVC_NO_PARENT : b[i - 1].id};
    }
    assert_int_equal(kvc_commit(f->pool, e, 4, canon), KV_OK);
    kvc_batch *bt;
    assert_int_equal(kvc_batch_alloc(f->conn, &bt), KV_OK);
    size_t first = 99, i0 = 0;
    assert_int_equal(kvc_batch_ping(bt, NULL, 0, &i0), KV_OK);
    kvc_block o1[4], o2[2], o3[4];
    const kv_hash128 *hl[3] = {h, h, h};
    size_t nl[3] = {4, 2, 4};
    kvc_block *const ol[3] = {o1, o2, o3};
    size_t nhit[3] = {0, 0, 0};
    assert_int_equal(kvc_batch_lookup_many(bt, f->pool, hl, nl, ol, nhit, 3, &first), KV_OK);
    assert_int_equal(first, 1);
    assert_int_equal(kvc_batch_count(bt), 4);
    /* One refused locally (NULL output): none of the three is queued. */
    kvc_block *const bad[3] = {o1, NULL, o3};
    assert_int_equal(kvc_batch_lookup_many(bt, f->pool, hl, nl, bad, nhit, 3, &first), KV_EINVAL);
    assert_int_equal(kvc_batch_count(bt), 4);
    assert_int_equal(kvc_batch_run(bt), KV_OK);
    for (size_t i = 0; i < 4; i++) {
        assert_int_equal(kvc_batch_status(bt, i), KV_OK);
    }
    assert_int_equal(nhit[0], 4);
    assert_int_equal(nhit[1], 2);
    assert_int_equal(nhit[2], 4);
    assert_memory_equal(o1, b, sizeof(o1));
    assert_memory_equal(o2, b, sizeof(o2));
    kvc_batch_reset(bt);
    const kvc_block *rl[4] = {o1, o2, o3, b};
    size_t rn[4] = {4, 2, 4, 4};
    const kvc_block *rbad[2] = {o1, NULL};
    assert_int_equal(kvc_batch_release_many(bt, f->pool, rbad, rn, 2, NULL), KV_EINVAL);
    assert_int_equal(kvc_batch_count(bt), 0);
    assert_int_equal(kvc_batch_release_many(bt, f->pool, rl, rn, 4, &first), KV_OK);
    assert_int_equal(first, 0);
    assert_int_equal(kvc_batch_run(bt), KV_OK);
    assert_int_equal(kvc_batch_first_error(bt, NULL), KV_OK);
    assert_int_equal(fake_kvd_refs(f->kvd), 0);
    kvc_batch_free(bt);
}

static void test_seq_prefill_commit_share(void **state) {
    fixture *f = *state;
    uint32_t prompt[70];
    tokens_fill(prompt, 70, 7);
    kvc_seq *a, *b;
    assert_int_equal(kvc_seq_alloc(f->pool, 256, NULL, 0, &a), KV_OK);
    assert_int_equal(kvc_seq_alloc(f->pool, 256, NULL, 0, &b), KV_OK);
    size_t cached = 99;
    assert_int_equal(kvc_seq_prefill(a, prompt, 70, &cached), KV_OK);
    assert_int_equal(cached, 0);
    assert_int_equal(kvc_seq_nblocks(a), 5); /* ceil(70 / 16) */
    assert_int_equal(kvc_seq_prefill(a, prompt, 70, &cached), KV_ESTATE);
    size_t nc = 0;
    assert_int_equal(kvc_seq_commit(a, 70, &nc), KV_OK);
    assert_int_equal(nc, 4); /* the partial fifth block is not committed */
    assert_int_equal(kvc_seq_ncommitted(a), 4);
    /* Same 64-token prefix, different suffix: four blocks hit. */
    uint32_t p2[80];
    memcpy(p2, prompt, 64 * sizeof(uint32_t));
    tokens_fill(p2 + 64, 16, 5000);
    assert_int_equal(kvc_seq_prefill(b, p2, 80, &cached), KV_OK);
    assert_int_equal(cached, 64);
    assert_int_equal(kvc_seq_nblocks(b), 5);
    for (size_t i = 0; i < 4; i++) {
        assert_int_equal(kvc_seq_block(b, i).id, kvc_seq_block(a, i).id);
    }
    /* Exactly 64 tokens: the lookup is capped at 63, so only 3 blocks hit and the last block
     * (holding the last token) is computed again. */
    kvc_seq *c;
    assert_int_equal(kvc_seq_alloc(f->pool, 64, NULL, 0, &c), KV_OK);
    assert_int_equal(kvc_seq_prefill(c, prompt, 64, &cached), KV_OK);
    assert_int_equal(cached, 48);
    /* Committing its fourth block finds the cached copy: the table takes the canonical id. */
    assert_int_equal(kvc_seq_commit(c, 64, &nc), KV_OK);
    assert_int_equal(nc, 1);
    assert_int_equal(kvc_seq_block(c, 3).id, kvc_seq_block(a, 3).id);
    /* A different extra key (adapter) changes every hash: no hits. */
    kvc_seq *d;
    assert_int_equal(kvc_seq_alloc(f->pool, 128, "lora-7", 6, &d), KV_OK);
    assert_int_equal(kvc_seq_prefill(d, prompt, 70, &cached), KV_OK);
    assert_int_equal(cached, 0);
    kvc_seq_free(d);
    kvc_seq_free(c);
    assert_int_equal(kvc_seq_release(a), KV_OK);
    assert_int_equal(kvc_seq_length(a), 0);
    kvc_seq_free(a);
    kvc_seq_free(b);
    assert_int_equal(fake_kvd_refs(f->kvd), 0);
    assert_int_equal(fake_kvd_writing(f->kvd), 0);
}

static void test_seq_append_rewind(void **state) {
    fixture *f = *state;
    uint32_t t[40];
    tokens_fill(t, 40, 1);
    kvc_seq *s;
    size_t cached, valid;
    assert_int_equal(kvc_seq_alloc(f->pool, 48, NULL, 0, &s), KV_OK);
    assert_int_equal(kvc_seq_prefill(s, t, 20, &cached), KV_OK);
    assert_int_equal(kvc_seq_nblocks(s), 2);
    assert_int_equal(kvc_seq_append(s, t + 20, 14), KV_OK); /* 34 tokens: 3 blocks */
    assert_int_equal(kvc_seq_nblocks(s), 3);
    assert_int_equal(kvc_seq_append(s, t, 15), KV_ETOOBIG);
    /* Drafts 30..33 are rejected: commit only up to 30 (one full block). */
    size_t nc;
    assert_int_equal(kvc_seq_commit(s, 30, &nc), KV_OK);
    assert_int_equal(nc, 1);
    assert_int_equal(kvc_seq_rewind(s, 30, &valid), KV_OK);
    assert_int_equal(valid, 30);
    assert_int_equal(kvc_seq_nblocks(s), 2);
    assert_int_equal(kvc_seq_length(s), 30);
    /* Rewinding into the committed first block replaces it. */
    kvc_block first = kvc_seq_block(s, 0);
    assert_int_equal(kvc_seq_rewind(s, 10, &valid), KV_OK);
    assert_int_equal(valid, 0);
    assert_int_equal(kvc_seq_nblocks(s), 1);
    assert_int_equal(kvc_seq_ncommitted(s), 0);
    assert_true(kvc_seq_block(s, 0).id != first.id || kvc_seq_block(s, 0).gen != first.gen);
    assert_int_equal(fake_kvd_writing(f->kvd), 1);
    assert_int_equal(kvc_seq_rewind(s, 11, &valid), KV_EINVAL);
    kvc_seq_free(s);
    assert_int_equal(fake_kvd_refs(f->kvd), 0);
}

static void test_csr_export(void **state) {
    fixture *f = *state;
    uint32_t t[100];
    tokens_fill(t, 100, 3);
    kvc_seq *s[3];
    size_t cached;
    assert_int_equal(kvc_seq_alloc(f->pool, 100, NULL, 0, &s[0]), KV_OK);
    assert_int_equal(kvc_seq_alloc(f->pool, 100, NULL, 0, &s[1]), KV_OK);
    assert_int_equal(kvc_seq_alloc(f->pool, 100, NULL, 0, &s[2]), KV_OK);
    assert_int_equal(kvc_seq_prefill(s[0], t, 33, &cached), KV_OK);      /* 3 blocks, last 1 */
    assert_int_equal(kvc_seq_prefill(s[2], t + 50, 32, &cached), KV_OK); /* 2 blocks, last 16 */
    int32_t indptr[4], indices[5], last[3];
    size_t n = 0;
    assert_int_equal(kvc_seq_export_csr(s, 3, indptr, 4, indices, 5, last, 3, &n), KV_OK);
    assert_int_equal(n, 5);
    assert_int_equal(indptr[0], 0);
    assert_int_equal(indptr[1], 3);
    assert_int_equal(indptr[2], 3);
    assert_int_equal(indptr[3], 5);
    assert_int_equal(last[0], 1);
    assert_int_equal(last[1], 0);
    assert_int_equal(last[2], 16);
    for (int i = 0; i < 3; i++) {
        assert_int_equal(indices[i], (int32_t)kvc_seq_block(s[0], (size_t)i).id);
    }
    assert_int_equal(indices[3], (int32_t)kvc_seq_block(s[2], 0).id);
    /* Buffers too small. */
    assert_int_equal(kvc_seq_export_csr(s, 3, indptr, 4, indices, 4, last, 3, &n), KV_ETOOBIG);
    assert_int_equal(kvc_seq_export_csr(s, 3, indptr, 3, indices, 5, last, 3, &n), KV_ETOOBIG);
    assert_int_equal(kvc_seq_export_csr(s, 3, indptr, 4, indices, 5, last, 2, &n), KV_ETOOBIG);
    for (int i = 0; i < 3; i++) {
        kvc_seq_free(s[i]);
    }
}

static void test_list_limit_chunks(void **state) {
    /* The daemon takes at most 3 blocks per request here: sequences split their calls. */
    fixture *f = *state;
    uint32_t t[160];
    tokens_fill(t, 160, 11);
    kvc_seq *s;
    size_t cached, nc;
    assert_int_equal(kvc_seq_alloc(f->pool, 160, NULL, 0, &s), KV_OK);
    assert_int_equal(kvc_seq_prefill(s, t, 160, &cached), KV_OK);
    assert_int_equal(kvc_seq_nblocks(s), 10);
    assert_int_equal(kvc_seq_commit(s, 160, &nc), KV_OK);
    assert_int_equal(nc, 10);
    kvc_block b[4];
    assert_int_equal(kvc_allocate(f->pool, 4, b), KV_ETOOBIG);
    kvc_seq_free(s);
    assert_int_equal(fake_kvd_refs(f->kvd), 0);
}

static void test_restart_is_eepoch(void **state) {
    fixture *f = *state;
    kvc_block b[2];
    assert_int_equal(kvc_allocate(f->pool, 2, b), KV_OK);
    assert_int_equal(fake_kvd_restart(f->kvd, 0x2222), 0);
    /* The old socket is gone: this call fails, the next one reconnects and sees the epoch. */
    kv_err err = kvc_ping(f->conn, NULL, 0);
    assert_int_equal(err, KV_ECLOSED);
    assert_int_equal(kvc_ping(f->conn, NULL, 0), KV_EEPOCH);
    assert_int_equal(kvc_conn_boot_epoch(f->conn), 0x2222);
    assert_true(kvc_pool_stale(f->pool));
    assert_int_equal(kvc_release(f->pool, b, 2), KV_EEPOCH);
    assert_int_equal(kvc_ping(f->conn, NULL, 0), KV_OK);
    kvc_pool_detach(f->pool);
    kv_layout l = test_layout();
    assert_int_equal(kvc_pool_attach(f->conn, "test-model", &l, &f->pool), KV_OK);
    assert_false(kvc_pool_stale(f->pool));
    assert_int_equal(kvc_allocate(f->pool, 2, b), KV_OK);
    assert_true(f->logs > 0); /* the restart was logged through the callback */
}

static void test_lost_connection_voids_pool(void **state) {
    fixture *f = *state;
    kvc_block b[2];
    assert_int_equal(kvc_allocate(f->pool, 2, b), KV_OK);
    uint64_t session = kvc_conn_session_id(f->conn);
    /* Same epoch: the connection dropped but the daemon did not restart. */
    assert_int_equal(fake_kvd_restart(f->kvd, 0x1111), 0);
    assert_int_equal(kvc_ping(f->conn, NULL, 0), KV_ECLOSED);
    assert_int_equal(kvc_ping(f->conn, NULL, 0), KV_OK); /* reconnected, new session */
    assert_int_not_equal(kvc_conn_session_id(f->conn), session);
    assert_true(kvc_pool_stale(f->pool));
    assert_int_equal(kvc_release(f->pool, b, 2), KV_ECLOSED);
    assert_non_null(strstr(kvc_last_error(f->conn), "session"));
    kvc_pool_detach(f->pool);
    kv_layout l = test_layout();
    assert_int_equal(kvc_pool_attach(f->conn, "test-model", &l, &f->pool), KV_OK);
    assert_int_equal(kvc_allocate(f->pool, 2, b), KV_OK);
}

static void test_connect_refused(void **state) {
    (void)state;
    kvc_options o;
    kvc_options_init(&o);
    o.socket_path = "/nonexistent/kvd.sock";
    kvc_conn *c = NULL;
    assert_int_equal(kvc_conn_open(&o, &c), KV_ESYS);
    assert_null(c);
    char path[108];
    assert_int_equal(kvc_default_socket_path(path, sizeof(path)), KV_OK);
    assert_non_null(strstr(path, "kvd"));
    assert_int_equal(kvc_default_socket_path(path, 4), KV_ETOOBIG);
}

/* Deferred Releases: nothing is sent until the next call, which carries them in its own write
 * (one request more reaches the daemon, no round trip more); a refusal does not fail that call
 * but is counted and returned by kvc_flush; batches and a full queue send them first. */
static void test_release_deferred(void **state) {
    fixture *f = *state;
    uint32_t tok[64];
    tokens_fill(tok, 64, 900);
    kv_hash128 h[4];
    size_t nh = 0;
    assert_int_equal(kvc_pool_hash_tokens(f->pool, NULL, 0, tok, 64, h, 4, &nh), KV_OK);
    kvc_block b[4], canon[4], hit[4];
    assert_int_equal(kvc_allocate(f->pool, 4, b), KV_OK);
    kvc_commit_entry e[4];
    for (int i = 0; i < 4; i++) {
        e[i].block = b[i];
        e[i].hash = h[i];
        e[i].parent = i == 0 ? KVC_NO_PARENT : b[i - 1].id;
    }
    assert_int_equal(kvc_commit(f->pool, e, 4, canon), KV_OK);
    assert_int_equal(kvc_release_deferred(f->pool, canon, 4), KV_OK);
    size_t nhit = 0;
    uint64_t before = fake_kvd_requests(f->kvd);
    assert_int_equal(fake_kvd_refs(f->kvd), 4);
    assert_int_equal(kvc_conn_deferred_pending(f->conn), 1);
    /* The Lookup carries the Release: both reach the daemon, the Release first. */
    assert_int_equal(kvc_lookup(f->pool, h, 4, hit, &nhit), KV_OK);
    assert_int_equal(nhit, 4);
    assert_int_equal(fake_kvd_requests(f->kvd), before + 2);
    assert_int_equal(fake_kvd_refs(f->kvd), 4);
    assert_int_equal(kvc_conn_deferred_pending(f->conn), 0);
    /* A refused one: the next call still succeeds; kvc_flush says what failed, once. */
    kvc_block stale = hit[0];
    stale.gen++;
    assert_int_equal(kvc_release_deferred(f->pool, &stale, 1), KV_OK);
    assert_int_equal(kvc_ping(f->conn, "x", 1), KV_OK);
    assert_int_equal(kvc_conn_deferred_failures(f->conn), 1);
    assert_int_equal(kvc_flush(f->conn), KV_ESTALE);
    assert_non_null(strstr(kvc_last_error(f->conn), "deferred"));
    assert_int_equal(kvc_flush(f->conn), KV_OK);
    /* kvc_flush sends them alone. */
    assert_int_equal(kvc_release_deferred(f->pool, hit, 4), KV_OK);
    assert_int_equal(fake_kvd_refs(f->kvd), 4);
    assert_int_equal(kvc_flush(f->conn), KV_OK);
    assert_int_equal(fake_kvd_refs(f->kvd), 0);
    /* Local checks fail at once; nothing is queued. */
    assert_int_equal(kvc_release_deferred(f->pool, NULL, 2), KV_EINVAL);
    assert_int_equal(kvc_conn_deferred_pending(f->conn), 0);
    /* A full queue sends itself before it takes one more. */
    for (int i = 0; i < 70; i++) {
        assert_int_equal(kvc_lookup(f->pool, h, 1, hit, &nhit), KV_OK);
        assert_int_equal(kvc_release_deferred(f->pool, hit, 1), KV_OK);
        assert_true(kvc_conn_deferred_pending(f->conn) <= 64);
    }
    assert_true(fake_kvd_refs(f->kvd) <= 64);
    /* A batch sends the queued ones first; its indexes are its own. */
    kvc_batch *bt;
    assert_int_equal(kvc_batch_alloc(f->conn, &bt), KV_OK);
    size_t idx = 99;
    assert_int_equal(kvc_batch_ping(bt, "y", 1, &idx), KV_OK);
    assert_int_equal(idx, 0);
    assert_int_equal(kvc_batch_run(bt), KV_OK);
    assert_int_equal(kvc_batch_status(bt, 0), KV_OK);
    assert_int_equal(fake_kvd_refs(f->kvd), 0);
    assert_int_equal(kvc_conn_deferred_pending(f->conn), 0);
    kvc_batch_free(bt);
    assert_int_equal(kvc_conn_deferred_failures(f->conn), 1);
}

/* Deferred Releases queued when the connection is lost are dropped, not sent to the restarted
 * daemon (their session and its references are gone); the next call reports the restart. */
static void test_release_deferred_lost(void **state) {
    fixture *f = *state;
    kvc_block b[2];
    assert_int_equal(kvc_allocate(f->pool, 2, b), KV_OK);
    assert_int_equal(kvc_release_deferred(f->pool, b, 2), KV_OK);
    assert_int_equal(fake_kvd_restart(f->kvd, 0x2222), 0);
    /* The ping carries them into the closed socket and fails; the next one reconnects. */
    assert_int_equal(kvc_ping(f->conn, NULL, 0), KV_ECLOSED);
    assert_int_equal(kvc_conn_deferred_pending(f->conn), 0);
    assert_int_equal(kvc_ping(f->conn, NULL, 0), KV_EEPOCH);
    /* Queued on a pool of the old daemon: refused at once, as kvc_release would be. */
    assert_int_equal(kvc_release_deferred(f->pool, b, 2), KV_EEPOCH);
    assert_int_equal(kvc_conn_deferred_pending(f->conn), 0);
    assert_int_equal(kvc_flush(f->conn), KV_OK);
    assert_int_equal(kvc_conn_deferred_failures(f->conn), 0);
    assert_int_equal(fake_kvd_refs(f->kvd), 0);
}

/* A "daemon" that listens but never answers: the Hello's wait ends with KV_ETIMEDOUT after
 * the timeout (the blocking recvmsg wakes every slice to look at the deadline), not before it
 * and not long after it. */
static int silent_listener(char *path, size_t cap) {
    snprintf(path, cap, "/tmp/kvc-silent-%d.sock", (int)getpid());
    unlink(path);
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path);
    if (fd < 0 || bind(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0 || listen(fd, 4) != 0) {
        return -1;
    }
    return fd;
}

static double mono_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e3 + (double)t.tv_nsec / 1e6;
}

static void test_silent_daemon_times_out(void **state) {
    (void)state;
    char path[108];
    int lfd = silent_listener(path, sizeof(path));
    assert_true(lfd >= 0);
    const int timeouts[] = {1, 250, 1200};
    for (size_t i = 0; i < sizeof(timeouts) / sizeof(timeouts[0]); i++) {
        kvc_options o;
        kvc_options_init(&o);
        o.socket_path = path;
        o.timeout_ms = timeouts[i];
        kvc_conn *c = NULL;
        double t0 = mono_ms();
        assert_int_equal(kvc_conn_open(&o, &c), KV_ETIMEDOUT);
        double took = mono_ms() - t0;
        assert_null(c);
        assert_true(took >= timeouts[i] - 1);
        assert_true(took < timeouts[i] + 1000);
        /* Take the connection off the backlog so that the next one is queued too. */
        int a = accept(lfd, NULL, NULL);
        assert_true(a >= 0);
        close(a);
    }
    close(lfd);
    unlink(path);
}

typedef struct {
    int lfd;
} closer_arg;

static void *close_after(void *arg) {
    closer_arg *a = arg;
    usleep(200 * 1000);
    int c = accept(a->lfd, NULL, NULL);
    close(c);
    return NULL;
}

/* The daemon's side going away while a call waits wakes the wait at once: KV_ECLOSED, long
 * before the timeout. */
static void test_peer_close_wakes_wait(void **state) {
    (void)state;
    char path[108];
    closer_arg a = {.lfd = silent_listener(path, sizeof(path))};
    assert_true(a.lfd >= 0);
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, close_after, &a), 0);
    kvc_options o;
    kvc_options_init(&o);
    o.socket_path = path;
    o.timeout_ms = 20000;
    kvc_conn *c = NULL;
    double t0 = mono_ms();
    assert_int_equal(kvc_conn_open(&o, &c), KV_ECLOSED);
    assert_true(mono_ms() - t0 < 10000);
    pthread_join(t, NULL);
    close(a.lfd);
    unlink(path);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_hello_ping_stats, setup, teardown),
        cmocka_unit_test_setup_teardown(test_unaddressable_blocks, setup_lying, teardown),
        cmocka_unit_test_setup_teardown(test_attach_maps_layers, setup, teardown),
        cmocka_unit_test_setup_teardown(test_allocate_grows_and_maps, setup, teardown),
        cmocka_unit_test_setup_teardown(test_commit_lookup_and_errors, setup, teardown),
        cmocka_unit_test_setup_teardown(test_batch_pipelined, setup_many_segments, teardown),
        cmocka_unit_test_setup_teardown(test_seq_prefill_commit_share, setup, teardown),
        cmocka_unit_test_setup_teardown(test_seq_append_rewind, setup, teardown),
        cmocka_unit_test_setup_teardown(test_csr_export, setup, teardown),
        cmocka_unit_test_setup_teardown(test_list_limit_chunks, setup_small_lists, teardown),
        cmocka_unit_test_setup_teardown(test_restart_is_eepoch, setup, teardown),
        cmocka_unit_test_setup_teardown(test_lost_connection_voids_pool, setup, teardown),
        cmocka_unit_test(test_connect_refused),
        cmocka_unit_test_setup_teardown(test_release_deferred, setup, teardown),
        cmocka_unit_test_setup_teardown(test_release_deferred_lost, setup, teardown),
        cmocka_unit_test_setup_teardown(test_batch_many, setup, teardown),
        cmocka_unit_test(test_silent_daemon_times_out),
        cmocka_unit_test(test_peer_close_wakes_wait),
    };
    return cmocka_run_group_tests_name("client", tests, NULL, NULL);
}
