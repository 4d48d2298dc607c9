/* Integration: several worker processes share prefixes through one real kvd. A parent
 * commits a prefix and forked workers find it, read the same bytes from their own mappings of
 * the shared memory and compute only their suffix; then 64 processes at once race to compute
 * and commit one prefix, and every one ends up reading identical bytes. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "tests/integration/kvd_harness.h"

#define TPB 16

static uint16_t value(uint32_t token, uint32_t pos, uint32_t layer, int kv, uint32_t head,
                      uint32_t d) {
    uint64_t x = (uint64_t)token * 0x9e3779b97f4a7c15ull ^ (uint64_t)pos << 40 ^
                 (uint64_t)layer << 28 ^ (uint64_t)kv << 24 ^ (uint64_t)head << 16 ^ d;
    x ^= x >> 31;
    x *= 0xbf58476d1ce4e5b9ull;
    return (uint16_t)(x ^ x >> 29);
}

/* Writes (check = 0) or verifies (check = 1) tokens [from, to) of s; returns mismatches. */
static uint64_t touch(kvc_pool *p, kvc_seq *s, const uint32_t *tok, size_t from, size_t to,
                      int check) {
    const kv_layout *l = kvc_pool_layout(p);
    uint64_t bad = 0;
    for (size_t pos = from; pos < to; pos++) {
        uint32_t id = kvc_seq_block(s, pos / TPB).id;
        for (uint32_t layer = 0; layer < l->num_layers; layer++) {
            for (int kv = KV_K; kv <= KV_V; kv++) {
                for (uint32_t h = 0; h < l->num_kv_heads; h++) {
                    uint16_t *e = kvc_pool_addr(p, id, layer, kv, (uint32_t)(pos % TPB), h);
                    if (e == NULL) {
                        return UINT64_MAX;
                    }
                    for (uint32_t d = 0; d < l->head_dim; d++) {
                        uint16_t v = value(tok[pos], (uint32_t)pos, layer, kv, h, d);
                        if (check) {
                            bad += e[d] != v;
                        } else {
                            e[d] = v;
                        }
                    }
                }
            }
        }
    }
    return bad;
}

static void make_prompt(uint32_t *t, size_t prefix, size_t n, uint32_t seed) {
    for (size_t i = 0; i < n; i++) {
        t[i] = i < prefix ? 100 + (uint32_t)i * 3 : 50000 + seed * 1000 + (uint32_t)i;
    }
}

/* One worker: prefill, verify what was cached, write the rest, commit, verify all, release.
 * Returns 0 on success; *cached gets the cached token count. */
static int worker(const kvd_harness *h, const char *model, size_t prefix, size_t n, uint32_t seed,
                  size_t *cached) {
    uint32_t tok[1024];
    make_prompt(tok, prefix, n, seed);
    kvc_conn *c = NULL;
    kvc_pool *p = NULL;
    kvc_seq *s = NULL;
    int rc = 1;
    kv_layout l = kvd_harness_layout();
    if (kvd_harness_connect(h, "worker", &c) != KV_OK ||
        kvc_pool_attach(c, model, &l, &p) != KV_OK || kvc_seq_alloc(p, n, NULL, 0, &s) != KV_OK ||
        kvc_seq_prefill(s, tok, n, cached) != KV_OK) {
        goto out;
    }
    if (touch(p, s, tok, 0, *cached, 1) != 0) {
        goto out;
    }
    touch(p, s, tok, *cached, n, 0);
    if (kvc_seq_commit(s, n, NULL) != KV_OK) {
        goto out;
    }
    /* After commit the table names canonical blocks, possibly another process's copy. */
    if (touch(p, s, tok, 0, n, 1) != 0) {
        goto out;
    }
    rc = kvc_seq_release(s) == KV_OK ? 0 : 1;
out:
    kvc_seq_free(s);
    kvc_pool_detach(p);
    kvc_conn_close(c);
    return rc;
}

static kvd_harness H;

static int setup(void **state) {
    (void)state;
    return kvd_harness_start(&H, NULL);
}

static int teardown(void **state) {
    (void)state;
    return kvd_harness_finish(&H);
}

static void test_forked_workers_share_prefix(void **state) {
    (void)state;
    size_t cached = 99;
    /* The parent computes 256 prefix tokens + 10 of its own. */
    assert_int_equal(worker(&H, "share-model", 256, 266, 0, &cached), 0);
    assert_int_equal(cached, 0);
    enum { W = 4 };
    pid_t pids[W];
    for (int i = 0; i < W; i++) {
        pids[i] = fork();
        assert_true(pids[i] >= 0);
        if (pids[i] == 0) {
            size_t got = 0;
            int rc = worker(&H, "share-model", 256, 300, (uint32_t)i + 1, &got);
            _exit(rc != 0 ? 1 : got == 256 ? 0 : 2);
        }
    }
    for (int i = 0; i < W; i++) {
        int st;
        assert_int_equal(waitpid(pids[i], &st, 0), pids[i]);
        assert_true(WIFEXITED(st));
        assert_int_equal(WEXITSTATUS(st), 0);
    }
    kvc_conn *c;
    kvc_pool *p;
    kv_layout l = kvd_harness_layout();
    assert_int_equal(kvd_harness_connect(&H, "check", &c), KV_OK);
    assert_int_equal(kvc_pool_attach(c, "share-model", &l, &p), KV_OK);
    uint64_t hits = 0;
    assert_int_equal(kvc_stat_get(c, kvc_pool_id(p), "pool.hit_blocks", &hits), KV_OK);
    assert_true(hits >= W * 16);
    assert_int_equal(kvd_harness_wait_stat(c, kvc_pool_id(p), "pool.blocks_writing", 0), 0);
    kvc_conn_close(c);
}

static void test_64_concurrent_processes(void **state) {
    (void)state;
    enum { N = 64 };
    int go[2];
    assert_int_equal(pipe(go), 0);
    pid_t pids[N];
    for (int i = 0; i < N; i++) {
        pids[i] = fork();
        assert_true(pids[i] >= 0);
        if (pids[i] == 0) {
            close(go[1]);
            char b;
            /* Start together: everyone races to compute and commit the same prefix. */
            if (read(go[0], &b, 1) != 0) {
                _exit(3);
            }
            size_t got = 0;
            _exit(worker(&H, "crowd-model", 128, 150, (uint32_t)i, &got) != 0 ? 1 : 0);
        }
    }
    close(go[0]);
    close(go[1]);
    int failed = 0;
    for (int i = 0; i < N; i++) {
        int st;
        assert_int_equal(waitpid(pids[i], &st, 0), pids[i]);
        failed += !(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    }
    assert_int_equal(failed, 0);
    kvc_conn *c;
    kvc_pool *p;
    kv_layout l = kvd_harness_layout();
    assert_int_equal(kvd_harness_connect(&H, "check", &c), KV_OK);
    assert_int_equal(kvc_pool_attach(c, "crowd-model", &l, &p), KV_OK);
    /* Every worker's session is gone and held nothing at the end. */
    assert_int_equal(kvd_harness_wait_stat(c, 0, "daemon.sessions", 1), 1);
    assert_int_equal(kvd_harness_wait_stat(c, kvc_pool_id(p), "pool.blocks_writing", 0), 0);
    /* The shared prefix is cached once: a lookup finds all 8 blocks. */
    uint32_t tok[128];
    make_prompt(tok, 128, 128, 0);
    kv_hash128 hs[8];
    size_t nh;
    assert_int_equal(kvc_pool_hash_tokens(p, NULL, 0, tok, 128, hs, 8, &nh), KV_OK);
    kvc_block hit[8];
    size_t nhit = 0;
    assert_int_equal(kvc_lookup(p, hs, nh, hit, &nhit), KV_OK);
    assert_int_equal(nhit, 8);
    assert_int_equal(kvc_release(p, hit, nhit), KV_OK);
    kvc_conn_close(c);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_forked_workers_share_prefix),
        cmocka_unit_test(test_64_concurrent_processes),
    };
    return cmocka_run_group_tests_name("integration_sharing", tests, setup, teardown);
}
