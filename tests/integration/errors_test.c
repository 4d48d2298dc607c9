/* Integration: every bad input gets its error code and kvd keeps serving others. Bad handles
 * (unknown id, another session's block, stale generation, commit of a block not WRITING), an
 * exhausted pool (ENOSPC) and eviction of cached blocks in a small pool, and raw bytes no
 * library would send (an oversized frame, garbage, requests before Hello). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmocka.h>

#include "common/kv_wire.h"
#include "tests/integration/kvd_harness.h"

static kvd_harness H;

static int setup(void **state) {
    (void)state;
    return kvd_harness_start(&H, NULL);
}

static int teardown(void **state) {
    (void)state;
    return kvd_harness_finish(&H);
}

static void open_pool(const kvd_harness *h, const char *name, kvc_conn **c, kvc_pool **p) {
    kv_layout l = kvd_harness_layout();
    assert_int_equal(kvd_harness_connect(h, name, c), KV_OK);
    assert_int_equal(kvc_pool_attach(*c, "err-model", &l, p), KV_OK);
}

static void commit_chain(kvc_pool *p, const kvc_block *b, size_t n, uint32_t base) {
    uint32_t tok[16 * 32];
    for (size_t i = 0; i < n * 16; i++) {
        tok[i] = base + (uint32_t)i;
    }
    kv_hash128 hs[32];
    size_t nh;
    assert_int_equal(kvc_pool_hash_tokens(p, NULL, 0, tok, n * 16, hs, 32, &nh), KV_OK);
    kvc_commit_entry e[32];
    for (size_t i = 0; i < n; i++) {
        e[i].block = b[i];
        e[i].hash = hs[i];
        e[i].parent = i == 0 ? KVC_NO_PARENT : b[i - 1].id;
    }
    kvc_block canon[32];
    assert_int_equal(kvc_commit(p, e, n, canon), KV_OK);
}

static void test_bad_handles(void **state) {
    (void)state;
    kvc_conn *c1, *c2;
    kvc_pool *p1, *p2;
    open_pool(&H, "one", &c1, &p1);
    open_pool(&H, "two", &c2, &p2);
    kvc_block b[2];
    assert_int_equal(kvc_allocate(p1, 2, b), KV_OK);
    /* Unknown block id. */
    kvc_block bogus = {.id = 1u << 30, .gen = 0};
    assert_int_equal(kvc_release(p1, &bogus, 1), KV_ENOENT);
    assert_true(strlen(kvc_last_error(c1)) > 0);
    /* Another session's block: neither released nor committed by session two. */
    assert_int_equal(kvc_release(p2, b, 1), KV_EPERM);
    kvc_commit_entry e = {.block = b[0], .hash = {1, 2}, .parent = KVC_NO_PARENT};
    kvc_block canon;
    assert_int_equal(kvc_commit(p2, &e, 1, &canon), KV_EPERM);
    /* A handle the session gave back: it no longer holds the block, so EPERM whether or not the
     * block was handed out again; once it holds the block at a new generation, the old handle
     * is ESTALE (PROTOCOL.md §7, which error). */
    assert_int_equal(kvc_release(p1, &b[1], 1), KV_OK);
    assert_int_equal(kvc_release(p1, &b[1], 1), KV_EPERM);
    kvc_block again;
    assert_int_equal(kvc_allocate(p1, 1, &again), KV_OK);
    assert_int_equal(again.id, b[1].id); /* the freed record is reused first */
    assert_int_equal(kvc_release(p1, &b[1], 1), KV_ESTALE);
    kvc_commit_entry se = {.block = b[1], .hash = {3, 4}, .parent = KVC_NO_PARENT};
    assert_int_equal(kvc_commit(p1, &se, 1, &canon), KV_ESTALE);
    /* Commit of a block that is not WRITING any more. */
    commit_chain(p1, b, 1, 900);
    assert_int_equal(kvc_commit(p1, &e, 1, &canon), KV_ESTATE);
    /* Nothing above hurt either session. */
    assert_int_equal(kvc_ping(c1, NULL, 0), KV_OK);
    assert_int_equal(kvc_ping(c2, NULL, 0), KV_OK);
    assert_int_equal(kvc_release(p1, b, 1), KV_OK);
    assert_int_equal(kvc_release(p1, &again, 1), KV_OK);
    kvc_conn_close(c1);
    kvc_conn_close(c2);
}

static void test_exhaustion_and_eviction(void **state) {
    (void)state;
    /* 16 KiB blocks, 64 KiB segments (4 blocks), a budget of 4 segments with their block records
     * (4 x 64 bytes each) and two pools' metadata (4 KiB each): 16 blocks in all. */
    static const char *const flags[] = {"--pool-memory=265K", "--segment-bytes=64K", NULL};
    kvd_harness small;
    assert_int_equal(kvd_harness_start(&small, flags), 0);
    kvc_conn *c, *other;
    kvc_pool *p, *po;
    open_pool(&small, "hog", &c, &p);
    open_pool(&small, "other", &other, &po);
    kvc_block b[16];
    assert_int_equal(kvc_allocate(p, 16, b), KV_OK);
    kvc_block one;
    assert_int_equal(kvc_allocate(p, 1, &one), KV_ENOSPC);
    assert_int_equal(kvc_allocate(po, 1, &one), KV_ENOSPC);
    assert_int_equal(kvc_ping(other, NULL, 0), KV_OK);
    /* Commit them and let go: cached, evictable. New allocations evict them. */
    commit_chain(p, b, 16, 1);
    assert_int_equal(kvc_release(p, b, 16), KV_OK);
    kvc_block nb[10];
    assert_int_equal(kvc_allocate(po, 10, nb), KV_OK);
    uint64_t ev = 0;
    assert_int_equal(kvc_stat_get(other, kvc_pool_id(po), "pool.evictions_capacity", &ev), KV_OK);
    assert_int_equal(ev, 10);
    /* Eviction takes the tail of the prefix first: the first 6 blocks are still found. */
    uint32_t tok[256];
    for (int i = 0; i < 256; i++) {
        tok[i] = 1 + (uint32_t)i;
    }
    kv_hash128 hs[16];
    size_t nh, nhit = 0;
    assert_int_equal(kvc_pool_hash_tokens(p, NULL, 0, tok, 256, hs, 16, &nh), KV_OK);
    kvc_block hit[16];
    assert_int_equal(kvc_lookup(p, hs, 16, hit, &nhit), KV_OK);
    assert_int_equal(nhit, 6);
    /* Held blocks are never evicted: everything is held now. */
    assert_int_equal(kvc_allocate(po, 1, &one), KV_ENOSPC);
    assert_int_equal(kvc_release(p, hit, nhit), KV_OK);
    assert_int_equal(kvc_release(po, nb, 10), KV_OK);
    kvc_conn_close(c);
    kvc_conn_close(other);
    assert_int_equal(kvd_harness_stop(&small), 0);
    kvd_harness_fini(&small);
}

static void send_bytes(int fd, const void *b, size_t n) {
    assert_int_equal(send(fd, b, n, MSG_NOSIGNAL), (ssize_t)n);
}

static void send_env(int fd, Kvd__Envelope *env) {
    uint8_t *buf;
    size_t len;
    assert_int_equal(kv_wire_encode(env, 1u << 20, &buf, &len), KV_OK);
    send_bytes(fd, buf, len);
    free(buf);
}

static void expect_error(int fd, uint64_t id, kv_err code) {
    Kvd__Envelope *env = NULL;
    assert_int_equal(kvd_harness_raw_read(fd, &env), 0);
    assert_int_equal(env->body_case, KVD__ENVELOPE__BODY_ERROR);
    assert_int_equal(env->id, id);
    assert_int_equal(env->error->code, code);
    assert_true(strlen(env->error->message) > 0);
    kv_wire_free(env);
}

static void test_raw_bad_frames(void **state) {
    (void)state;
    kvc_conn *c;
    kvc_pool *p;
    open_pool(&H, "bystander", &c, &p);
    /* Oversized frame: ETOOBIG with id 0, then the daemon hangs up. */
    int fd = kvd_harness_raw_connect(&H);
    assert_true(fd >= 0);
    uint8_t hdr[4] = {0x01, 0x00, 0x20, 0x00}; /* 2 MiB + 1 > the 1 MiB limit */
    send_bytes(fd, hdr, 4);
    expect_error(fd, 0, KV_ETOOBIG);
    assert_true(kvd_harness_raw_closed(fd));
    close(fd);
    /* Garbage body of a valid length: EPROTO with id 0, the connection stays. */
    fd = kvd_harness_raw_connect(&H);
    assert_true(fd >= 0);
    uint8_t junk[4 + 12] = {12, 0, 0, 0};
    memset(junk + 4, 0xff, 12);
    send_bytes(fd, junk, sizeof(junk));
    expect_error(fd, 0, KV_EPROTO);
    /* A request before Hello: EPROTO with its id; then Hello and a Ping work. */
    Kvd__Ping ping = KVD__PING__INIT;
    ping.nonce = 77;
    Kvd__Envelope env = KVD__ENVELOPE__INIT;
    env.id = 5;
    env.body_case = KVD__ENVELOPE__BODY_PING;
    env.ping = &ping;
    send_env(fd, &env);
    expect_error(fd, 5, KV_EPROTO);
    Kvd__Hello hello = KVD__HELLO__INIT;
    hello.protocol_version = 1;
    hello.client_name = "raw";
    Kvd__Envelope he = KVD__ENVELOPE__INIT;
    he.id = 6;
    he.body_case = KVD__ENVELOPE__BODY_HELLO;
    he.hello = &hello;
    send_env(fd, &he);
    Kvd__Envelope *r = NULL;
    assert_int_equal(kvd_harness_raw_read(fd, &r), 0);
    assert_int_equal(r->body_case, KVD__ENVELOPE__BODY_HELLO_REPLY);
    kv_wire_free(r);
    env.id = 7;
    send_env(fd, &env);
    assert_int_equal(kvd_harness_raw_read(fd, &r), 0);
    assert_int_equal(r->body_case, KVD__ENVELOPE__BODY_PONG);
    assert_int_equal(r->pong->nonce, 77);
    kv_wire_free(r);
    /* A request meant for another daemon instance: EEPOCH. */
    env.id = 8;
    env.boot_epoch = kvc_conn_boot_epoch(c) ^ 1;
    send_env(fd, &env);
    expect_error(fd, 8, KV_EEPOCH);
    close(fd);
    /* The library's own session was never disturbed. */
    kvc_block b[2];
    assert_int_equal(kvc_allocate(p, 2, b), KV_OK);
    assert_int_equal(kvc_release(p, b, 2), KV_OK);
    assert_int_equal(kvc_ping(c, "still here", 10), KV_OK);
    kvc_conn_close(c);
}

/* Pin and Rewind against the real daemon, through the sequence helper as an engine uses them. */
static void test_pin_and_seq_rewind(void **state) {
    (void)state;
    kvc_conn *c;
    kvc_pool *p;
    open_pool(&H, "spec", &c, &p);
    uint32_t tok[48];
    for (int i = 0; i < 48; i++) {
        tok[i] = 300 + (uint32_t)i;
    }
    kvc_seq *s;
    size_t cached, valid, nc;
    assert_int_equal(kvc_seq_alloc(p, 64, NULL, 0, &s), KV_OK);
    assert_int_equal(kvc_seq_prefill(s, tok, 20, &cached), KV_OK);
    assert_int_equal(kvc_seq_append(s, tok + 20, 20), KV_OK); /* drafts up to 40 */
    assert_int_equal(kvc_seq_nblocks(s), 3);
    assert_int_equal(kvc_seq_commit(s, 33, &nc), KV_OK); /* 33 accepted: 2 full blocks */
    assert_int_equal(nc, 2);
    assert_int_equal(kvc_seq_rewind(s, 33, &valid), KV_OK);
    assert_int_equal(valid, 33);
    assert_int_equal(kvc_seq_nblocks(s), 3);
    /* Pinning: committed blocks yes, the WRITING third block no. */
    kvc_block b0 = kvc_seq_block(s, 0), b2 = kvc_seq_block(s, 2);
    assert_int_equal(kvc_pin(p, &b0, 1, 60000, 7, 0), KV_OK);
    assert_int_equal(kvc_pin(p, &b2, 1, 60000, 7, 0), KV_ESTATE);
    assert_int_equal(kvc_pin(p, &b0, 1, 0, 0, 1), KV_OK);
    /* Rewind into the committed second block: replaced, recompute from token 16. */
    assert_int_equal(kvc_seq_rewind(s, 20, &valid), KV_OK);
    assert_int_equal(valid, 16);
    assert_int_equal(kvc_seq_ncommitted(s), 1);
    assert_int_equal(kvc_seq_nblocks(s), 2);
    uint64_t v = 0;
    assert_int_equal(kvc_stat_get(c, kvc_pool_id(p), "pool.blocks_writing", &v), KV_OK);
    assert_int_equal(v, 1);
    assert_int_equal(kvc_seq_release(s), KV_OK);
    assert_int_equal(kvc_stat_get(c, 0, "session.refs_held", &v), KV_OK);
    assert_int_equal(v, 0);
    kvc_seq_free(s);
    kvc_conn_close(c);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bad_handles),
        cmocka_unit_test(test_exhaustion_and_eviction),
        cmocka_unit_test(test_raw_bad_frames),
        cmocka_unit_test(test_pin_and_seq_rewind),
    };
    return cmocka_run_group_tests_name("integration_errors", tests, setup, teardown);
}
