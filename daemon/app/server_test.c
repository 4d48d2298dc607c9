/* server_test: runs the real server on a temporary socket in a thread (its own libuv loop) and
 * drives it with raw frames built with kv_wire over plain blocking sockets. Checks the happy
 * path through shared memory (a second connection sees the bytes the first wrote), every bad
 * input's error code, and that a connection closed mid-write gives its blocks back. */
#include <errno.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cmocka.h>
#include <uv.h>

#include "common/kv_layout.h"
#include "common/kv_log.h"
#include "common/kv_wire.h"
#include "daemon/config/config.h"
#include "daemon/app/daemon.h"
#include "daemon/core/pool.h"
#include "daemon/testing/raw_client.h"

typedef kvd_test_server harness;

static harness *start(void (*tweak)(kvd_config *)) {
    harness *h = calloc(1, sizeof(*h));
    assert_non_null(h);
    kvd_test_server_init(h, "server-test");
    h->cfg.pool_memory =
        2 * ((64 << 10) + 128 * 64) + 2 * KVD_POOL_META_BASE; /* 2 segments, 2 pools */
    h->cfg.segment_bytes = 64 << 10;
    h->cfg.index_entries = 4096;
    h->cfg.log_level = KV_LOG_WARN;
    /* memfd checks below: pin host so that `auto` on a GPU machine does not change the test. */
    snprintf(h->cfg.backend, sizeof(h->cfg.backend), "host");
    if (tweak != NULL) {
        tweak(&h->cfg);
    }
    kvd_test_server_start(h);
    return h;
}

static void stop(harness *h) {
    kvd_test_server_stop(h);
    /* The socket file is gone after a clean stop. */
    assert_int_not_equal(access(h->cfg.socket, F_OK), 0);
    rmdir(h->dir);
    free(h);
}

static int dial(harness *h) {
    return kvd_raw_dial(h->cfg.socket);
}

static Kvd__Envelope *release_env(Kvd__Envelope *e, Kvd__Release *rel, uint32_t pool,
                                  Kvd__BlockRef **pb, size_t n) {
    kvd__envelope__init(e);
    kvd__release__init(rel);
    rel->pool_id = pool;
    rel->n_blocks = n;
    rel->blocks = pb;
    e->id = kvd_raw_next_id();
    e->body_case = KVD__ENVELOPE__BODY_RELEASE;
    e->release = rel;
    return e;
}

static uint64_t stat_of(int fd, uint32_t pool, const char *name) {
    Kvd__Envelope e = KVD__ENVELOPE__INIT;
    Kvd__Stats s = KVD__STATS__INIT;
    s.pool_id = pool;
    e.id = kvd_raw_next_id();
    e.body_case = KVD__ENVELOPE__BODY_STATS;
    e.stats = &s;
    Kvd__Envelope *r = kvd_raw_rpc(fd, &e);
    assert_int_equal(r->body_case, KVD__ENVELOPE__BODY_STATS_REPLY);
    uint64_t v = UINT64_MAX;
    for (size_t i = 0; i < r->stats_reply->n_stats; i++) {
        if (strcmp(r->stats_reply->stats[i]->name, name) == 0) {
            v = r->stats_reply->stats[i]->value;
        }
    }
    kv_wire_free(r);
    if (v == UINT64_MAX) {
        fail_msg("stat %s missing", name);
    }
    return v;
}

static void test_share_through_memfd(void **state) {
    (void)state;
    harness *h = start(NULL);
    int a = dial(h);
    kvd_raw_hello(a, "server_test");
    kvd_raw_attached pa = kvd_raw_attach(a, "llama-test");
    Kvd__Envelope *r = kvd_raw_allocate(a, pa.pool_id, 2);
    assert_int_equal(r->body_case, KVD__ENVELOPE__BODY_ALLOCATE_REPLY);
    assert_int_equal(r->allocate_reply->n_blocks, 2);
    Kvd__BlockRef blocks[2] = {*r->allocate_reply->blocks[0], *r->allocate_reply->blocks[1]};
    kv_wire_free(r);
    /* Write a pattern into layer 1's V of each block through our mapping. */
    for (int b = 0; b < 2; b++) {
        uint64_t off = kv_layout_offset(&pa.layout, pa.bps, blocks[b].id % pa.bps, 1, KV_V, 0, 0);
        memset(pa.base + off, 0x40 + b, pa.layout.kv_block_bytes);
    }
    assert_int_equal(stat_of(a, pa.pool_id, "pool.blocks_writing"), 2);
    kvd_raw_commit(a, pa.pool_id, blocks, 2, 1000, KV_OK);
    assert_int_equal(stat_of(a, pa.pool_id, "pool.blocks_committed"), 2);

    int b = dial(h);
    kvd_raw_hello(b, "server_test");
    kvd_raw_attached pb = kvd_raw_attach(b, "llama-test");
    assert_int_equal(pb.pool_id, pa.pool_id);
    r = kvd_raw_lookup(b, pb.pool_id, 1000, 3);
    assert_int_equal(r->body_case, KVD__ENVELOPE__BODY_LOOKUP_REPLY);
    assert_int_equal(r->lookup_reply->n_blocks, 2);
    for (int i = 0; i < 2; i++) {
        assert_int_equal(r->lookup_reply->blocks[i]->id, blocks[i].id);
        uint64_t off = kv_layout_offset(&pb.layout, pb.bps, blocks[i].id % pb.bps, 1, KV_V, 0, 0);
        for (uint64_t k = 0; k < pb.layout.kv_block_bytes; k++) {
            assert_int_equal(pb.base[off + k], 0x40 + i);
        }
    }
    kv_wire_free(r);
    assert_int_equal(stat_of(b, pb.pool_id, "pool.session_refs"), 2);
    /* A different model is another pool. */
    kvd_raw_attached pc = kvd_raw_attach(b, "other-model");
    assert_int_not_equal(pc.pool_id, pa.pool_id);

    munmap(pa.base, pa.seg_bytes);
    munmap(pb.base, pb.seg_bytes);
    munmap(pc.base, pc.seg_bytes);
    close(a);
    close(b);
    stop(h);
}

static void small_lists(kvd_config *c) {
    c->max_blocks_per_request = 4;
    c->max_frame_bytes = 65536; /* the smallest allowed */
}

static void test_bad_inputs(void **state) {
    (void)state;
    harness *h = start(small_lists);
    int a = dial(h);
    Kvd__Envelope e = KVD__ENVELOPE__INIT;
    Kvd__Ping ping = KVD__PING__INIT;
    ping.nonce = 7;
    e.id = kvd_raw_next_id();
    e.body_case = KVD__ENVELOPE__BODY_PING;
    e.ping = &ping;
    /* Anything before Hello: EPROTO, connection kept. */
    kvd_raw_expect_error(a, &e, KV_EPROTO);
    Kvd__Hello hl = KVD__HELLO__INIT;
    hl.protocol_version = 2;
    Kvd__Envelope he = KVD__ENVELOPE__INIT;
    he.id = kvd_raw_next_id();
    he.body_case = KVD__ENVELOPE__BODY_HELLO;
    he.hello = &hl;
    kvd_raw_expect_error(a, &he, KV_EVERSION);
    kvd_raw_hello(a, "server_test");
    kvd_raw_expect_error(a, &he, KV_ESTATE); /* a second Hello */
    /* Stale boot epoch. */
    e.id = kvd_raw_next_id();
    e.boot_epoch = 12345;
    kvd_raw_expect_error(a, &e, KV_EEPOCH);
    e.boot_epoch = 0;
    /* A body that does not decode: EPROTO with id 0, and the stream stays usable. */
    uint8_t junk[] = {5, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0xff};
    kvd_raw_send(a, junk, sizeof(junk));
    Kvd__Envelope *r = kvd_raw_recv_env(a);
    assert_non_null(r);
    assert_int_equal(r->id, 0);
    assert_int_equal(r->body_case, KVD__ENVELOPE__BODY_ERROR);
    assert_int_equal(r->error->code, KV_EPROTO);
    kv_wire_free(r);
    e.id = kvd_raw_next_id();
    r = kvd_raw_rpc(a, &e);
    assert_int_equal(r->body_case, KVD__ENVELOPE__BODY_PONG);
    assert_int_equal(r->pong->nonce, 7);
    kv_wire_free(r);
    /* A reply type sent as a request. */
    Kvd__Pong pong = KVD__PONG__INIT;
    Kvd__Envelope pe = KVD__ENVELOPE__INIT;
    pe.id = kvd_raw_next_id();
    pe.body_case = KVD__ENVELOPE__BODY_PONG;
    pe.pong = &pong;
    kvd_raw_expect_error(a, &pe, KV_EPROTO);
    /* Bad layout and model id. */
    Kvd__AttachPool ap = KVD__ATTACH_POOL__INIT;
    Kvd__Layout lay = KVD__LAYOUT__INIT;
    kvd_raw_fill_layout(&lay);
    lay.head_dim = 0;
    ap.model_id = "m";
    ap.layout = &lay;
    Kvd__Envelope ae = KVD__ENVELOPE__INIT;
    ae.id = kvd_raw_next_id();
    ae.body_case = KVD__ENVELOPE__BODY_ATTACH_POOL;
    ae.attach_pool = &ap;
    kvd_raw_expect_error(a, &ae, KV_EINVAL);
    ap.model_id = "";
    kvd_raw_fill_layout(&lay);
    ae.id = kvd_raw_next_id();
    kvd_raw_expect_error(a, &ae, KV_EINVAL);
    /* Unknown pool. */
    r = kvd_raw_allocate(a, 999, 1);
    assert_int_equal(r->error->code, KV_ENOENT);
    kv_wire_free(r);

    kvd_raw_attached pa = kvd_raw_attach(a, "m");
    r = kvd_raw_allocate(a, pa.pool_id, 0);
    assert_int_equal(r->error->code, KV_EINVAL);
    kv_wire_free(r);
    r = kvd_raw_allocate(a, pa.pool_id, 5); /* above max-blocks-per-request */
    assert_int_equal(r->error->code, KV_ETOOBIG);
    kv_wire_free(r);
    r = kvd_raw_lookup(a, pa.pool_id, 1, 5);
    assert_int_equal(r->error->code, KV_ETOOBIG);
    kv_wire_free(r);
    r = kvd_raw_allocate(a, pa.pool_id, 2);
    assert_int_equal(r->body_case, KVD__ENVELOPE__BODY_ALLOCATE_REPLY);
    Kvd__BlockRef blk[2] = {*r->allocate_reply->blocks[0], *r->allocate_reply->blocks[1]};
    kv_wire_free(r);

    /* Release: out of range, stale generation, not held. */
    Kvd__BlockRef bad = blk[0];
    Kvd__BlockRef *pb[1] = {&bad};
    Kvd__Release rel;
    bad.id = 1u << 30;
    kvd_raw_expect_error(a, release_env(&e, &rel, pa.pool_id, pb, 1), KV_ENOENT);
    bad = blk[0];
    bad.gen += 1;
    kvd_raw_expect_error(a, release_env(&e, &rel, pa.pool_id, pb, 1), KV_ESTALE);
    int b = dial(h);
    kvd_raw_hello(b, "server_test");
    kvd_raw_attached pb2 = kvd_raw_attach(b, "m");
    bad = blk[0];
    kvd_raw_expect_error(b, release_env(&e, &rel, pb2.pool_id, pb, 1), KV_EPERM);
    /* Commit by someone else: EPERM; commit of a committed block: ESTATE. */
    kvd_raw_commit(b, pb2.pool_id, blk, 1, 50, KV_EPERM);
    kvd_raw_commit(a, pa.pool_id, blk, 1, 50, KV_OK);
    kvd_raw_commit(a, pa.pool_id, blk, 1, 50, KV_ESTATE);
    Kvd__BlockRef twice[2] = {blk[1], blk[1]};
    kvd_raw_commit(a, pa.pool_id, twice, 2, 60, KV_ESTATE);
    /* Releasing a block twice when held once: EPERM, and nothing changes. */
    Kvd__BlockRef *p2[2] = {&blk[0], &blk[0]};
    kvd_raw_expect_error(a, release_env(&e, &rel, pa.pool_id, p2, 2), KV_EPERM);
    r = kvd_raw_rpc(a, release_env(&e, &rel, pa.pool_id, p2, 1));
    assert_int_equal(r->body_case, KVD__ENVELOPE__BODY_RELEASE_REPLY);
    kv_wire_free(r);
    /* Pin: priority out of range, and a block not held. */
    Kvd__Pin pin = KVD__PIN__INIT;
    Kvd__BlockRef *pp[1] = {&blk[0]};
    pin.pool_id = pa.pool_id;
    pin.n_blocks = 1;
    pin.blocks = pp;
    pin.priority = 300;
    Kvd__Envelope pne = KVD__ENVELOPE__INIT;
    pne.id = kvd_raw_next_id();
    pne.body_case = KVD__ENVELOPE__BODY_PIN;
    pne.pin = &pin;
    kvd_raw_expect_error(a, &pne, KV_EINVAL);
    pin.priority = 1;
    pne.id = kvd_raw_next_id();
    kvd_raw_expect_error(a, &pne, KV_EPERM);
    /* Pool exhausted: 128 KiB of 512-byte blocks is 256; ask for more in steps of 4. */
    int got_enospc = 0;
    for (int i = 0; i < 100 && !got_enospc; i++) {
        r = kvd_raw_allocate(b, pb2.pool_id, 4);
        if (r->body_case == KVD__ENVELOPE__BODY_ERROR) {
            assert_int_equal(r->error->code, KV_ENOSPC);
            assert_non_null(strstr(r->error->message, "asked 4 blocks"));
            got_enospc = 1;
        }
        kv_wire_free(r);
    }
    assert_true(got_enospc);
    /* Ping payload too long for max-frame-bytes (its reply must fit max-frame-bytes + 64). */
    static uint8_t payload[65500];
    memset(payload, 1, sizeof(payload));
    ping.payload.data = payload;
    ping.payload.len = sizeof(payload);
    e.id = kvd_raw_next_id();
    e.body_case = KVD__ENVELOPE__BODY_PING;
    e.ping = &ping;
    kvd_raw_expect_error(a, &e, KV_ETOOBIG);
    /* A frame above max-frame-bytes: ETOOBIG with id 0, then the daemon closes. */
    uint8_t big[4] = {1, 0, 1, 0}; /* 65537 */
    kvd_raw_send(a, big, sizeof(big));
    r = kvd_raw_recv_env(a);
    assert_non_null(r);
    assert_int_equal(r->id, 0);
    assert_int_equal(r->error->code, KV_ETOOBIG);
    kv_wire_free(r);
    assert_null(kvd_raw_recv_env(a));
    munmap(pa.base, pa.seg_bytes);
    munmap(pb2.base, pb2.seg_bytes);
    close(a);
    close(b);
    stop(h);
}

static void test_close_gives_blocks_back(void **state) {
    (void)state;
    harness *h = start(NULL);
    int a = dial(h);
    kvd_raw_hello(a, "server_test");
    kvd_raw_attached pa = kvd_raw_attach(a, "crash");
    /* Take every block the budget allows (2 segments of 128 blocks). */
    Kvd__Envelope *r = kvd_raw_allocate(a, pa.pool_id, 256);
    assert_int_equal(r->body_case, KVD__ENVELOPE__BODY_ALLOCATE_REPLY);
    kv_wire_free(r);
    int b = dial(h);
    kvd_raw_hello(b, "server_test");
    kvd_raw_attached pb = kvd_raw_attach(b, "crash");
    r = kvd_raw_allocate(b, pb.pool_id, 1);
    assert_int_equal(r->error->code, KV_ENOSPC);
    kv_wire_free(r);
    assert_int_equal(stat_of(b, pb.pool_id, "pool.blocks_writing"), 256);
    /* A dies mid-write. */
    munmap(pa.base, pa.seg_bytes);
    close(a);
    /* The daemon notices the close on its own schedule; poll its stats (no timing asserted). */
    uint64_t writing = 256;
    for (int i = 0; i < 2000 && writing != 0; i++) {
        writing = stat_of(b, pb.pool_id, "pool.blocks_writing");
        if (writing != 0) {
            usleep(1000);
        }
    }
    assert_int_equal(writing, 0);
    r = kvd_raw_allocate(b, pb.pool_id, 256);
    assert_int_equal(r->body_case, KVD__ENVELOPE__BODY_ALLOCATE_REPLY);
    kv_wire_free(r);
    munmap(pb.base, pb.seg_bytes);
    close(b);
    stop(h);
}

static void one_conn(kvd_config *c) {
    c->max_connections = 1;
}

static void test_max_connections(void **state) {
    (void)state;
    harness *h = start(one_conn);
    int a = dial(h);
    kvd_raw_hello(a, "server_test");
    int b = dial(h);
    Kvd__Envelope *r = kvd_raw_recv_env(b);
    assert_non_null(r);
    assert_int_equal(r->body_case, KVD__ENVELOPE__BODY_ERROR);
    assert_int_equal(r->error->code, KV_EBUSY);
    kv_wire_free(r);
    assert_null(kvd_raw_recv_env(b));
    close(b);
    close(a);
    stop(h);
}

static void short_frame_timeout(kvd_config *c) {
    c->frame_timeout_ms = 300;
}

/* A client that sends half a frame and stops gets ETIMEDOUT and is disconnected after
 * frame-timeout-ms (it held its connection, and a max-connections slot, for ever); a client that
 * sends nothing (an idle worker holding leases) and one whose frame arrives byte by byte but
 * completes within the limit are kept. */
static void test_frame_timeout(void **state) {
    (void)state;
    harness *h = start(short_frame_timeout);
    int idle = dial(h);
    kvd_raw_hello(idle, "idle");
    int half = dial(h);
    kvd_raw_hello(half, "half");
    uint8_t hdr[6] = {100, 0, 0, 0, 0x08, 0x01}; /* a 100-byte frame, 2 bytes of it */
    kvd_raw_send(half, hdr, sizeof(hdr));
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    Kvd__Envelope *r = kvd_raw_recv_env(half);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    assert_non_null(r);
    assert_int_equal(r->body_case, KVD__ENVELOPE__BODY_ERROR);
    assert_int_equal(r->error->code, KV_ETIMEDOUT);
    assert_non_null(strstr(r->error->message, "frame-timeout-ms"));
    assert_int_equal(r->id, 0);
    kv_wire_free(r);
    assert_null(kvd_raw_recv_env(half)); /* closed */
    double waited = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9;
    assert_true(waited >= 0.25 && waited < 5.0);
    close(half);
    /* The idle one is still served; a slow but steady sender too. */
    Kvd__Envelope p = KVD__ENVELOPE__INIT;
    Kvd__Ping ping = KVD__PING__INIT;
    p.id = kvd_raw_next_id();
    p.body_case = KVD__ENVELOPE__BODY_PING;
    p.ping = &ping;
    r = kvd_raw_rpc(idle, &p);
    assert_int_equal(r->body_case, KVD__ENVELOPE__BODY_PONG);
    kv_wire_free(r);
    p.id = kvd_raw_next_id();
    uint8_t *frame = NULL;
    size_t n = 0;
    assert_int_equal(kv_wire_encode(&p, 1 << 20, &frame, &n), KV_OK);
    assert_true(n < 20);
    for (size_t i = 0; i < n; i++) {
        kvd_raw_send(idle, frame + i, 1);
        usleep(5000); /* the whole frame within the limit: served */
    }
    free(frame);
    r = kvd_raw_recv_env(idle);
    assert_non_null(r);
    assert_int_equal(r->body_case, KVD__ENVELOPE__BODY_PONG);
    kv_wire_free(r);
    close(idle);
    stop(h);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_share_through_memfd),     cmocka_unit_test(test_bad_inputs),
        cmocka_unit_test(test_close_gives_blocks_back), cmocka_unit_test(test_max_connections),
        cmocka_unit_test(test_frame_timeout),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
