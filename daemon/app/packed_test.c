/* packed_test: the fast-path forms of the protocol against the real server (temporary socket,
 * its own loop thread, raw kv_wire frames over blocking sockets):
 *  - packed lists (PROTOCOL.md 6, "Packed lists"): Lookup.hashes_packed, Release/Rewind
 *    blocks_packed, and blocks_packed in LookupReply/AllocateReply for a client whose Hello
 *    asked for them (a client that did not gets BlockRef messages);
 *  - Commit.entries_packed, and CommitReply.canonical_packed for a client whose Hello asked;
 *  - malformed packed fields (length not a multiple of 16/8/28, both forms at once) -> EPROTO
 *    with the connection kept; a block listed twice with one reference -> EPERM, nothing released;
 *  - replies coalesced into one output chunk: a burst of pipelined requests under a small
 *    max-inflight gets every reply, in order. */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cmocka.h>
#include <uv.h>

#include "common/kv_log.h"
#include "common/kv_wire.h"
#include "daemon/config/config.h"
#include "daemon/app/daemon.h"
#include "daemon/core/pool.h"
#include "daemon/testing/raw_client.h"

#define NB 8 /* blocks of the test prefix */

typedef kvd_test_server harness;

static harness *start(uint64_t max_inflight) {
    harness *h = calloc(1, sizeof(*h));
    assert_non_null(h);
    kvd_test_server_init(h, "packed-test");
    h->cfg.pool_memory =
        2 * ((64 << 10) + 128 * 64) + 2 * KVD_POOL_META_BASE; /* 2 segments, 2 pools */
    h->cfg.segment_bytes = 64 << 10;
    h->cfg.index_entries = 4096;
    h->cfg.max_blocks_per_request = 16;
    h->cfg.max_inflight = max_inflight;
    h->cfg.log_level = KV_LOG_ERROR;
    snprintf(h->cfg.backend, sizeof(h->cfg.backend), "host");
    kvd_test_server_start(h);
    return h;
}

static void stop(harness *h) {
    kvd_test_server_stop(h);
    rmdir(h->dir);
    free(h);
}

static int dial(harness *h) {
    return kvd_raw_dial(h->cfg.socket);
}

static uint64_t next_id = 1;

/* Sends env with a new id. */
static void send_env(int fd, Kvd__Envelope *env) {
    env->id = next_id++;
    kvd_raw_send_env(fd, env);
}

/* Receives one frame (fds closed); EOF fails the test. */
static Kvd__Envelope *recv_env(int fd) {
    Kvd__Envelope *env = kvd_raw_recv_env(fd);
    assert_non_null(env);
    return env;
}

/* Sends req (with a new id) and returns its reply. */
static Kvd__Envelope *rpc(int fd, Kvd__Envelope *req) {
    send_env(fd, req);
    Kvd__Envelope *r = recv_env(fd);
    assert_int_equal(r->id, req->id);
    return r;
}

static Kvd__Envelope *rpc_ok(int fd, Kvd__Envelope *req, Kvd__Envelope__BodyCase want) {
    Kvd__Envelope *r = rpc(fd, req);
    if (r->body_case == KVD__ENVELOPE__BODY_ERROR) {
        fail_msg("request failed: %s: %s", kv_err_name(r->error->code), r->error->message);
    }
    assert_int_equal(r->body_case, want);
    return r;
}

/* Sends req with a new id and expects an Error with code. */
static void expect_error(int fd, Kvd__Envelope *req, kv_err code) {
    req->id = next_id++;
    kvd_raw_expect_error(fd, req, code);
}

/* Hello (with features: the packed reply forms asked for) and AttachPool; returns the pool id. */
static uint32_t open_session_with(int fd, uint32_t features) {
    Kvd__Envelope e = KVD__ENVELOPE__INIT;
    Kvd__Hello h = KVD__HELLO__INIT;
    h.protocol_version = 1;
    h.client_name = "packed_test";
    h.features = features;
    e.body_case = KVD__ENVELOPE__BODY_HELLO;
    e.hello = &h;
    Kvd__Envelope *r = rpc_ok(fd, &e, KVD__ENVELOPE__BODY_HELLO_REPLY);
    /* The daemon takes packed requests from everyone and says so. */
    assert_true(r->hello_reply->features & KV_FEATURE_PACKED);
    assert_true(r->hello_reply->features & KV_FEATURE_PACKED_COMMIT);
    kv_wire_free(r);
    Kvd__AttachPool a = KVD__ATTACH_POOL__INIT;
    Kvd__Layout l = KVD__LAYOUT__INIT;
    kvd_raw_fill_layout(&l);
    a.model_id = "packed";
    a.layout = &l;
    kvd__envelope__init(&e);
    e.body_case = KVD__ENVELOPE__BODY_ATTACH_POOL;
    e.attach_pool = &a;
    r = rpc_ok(fd, &e, KVD__ENVELOPE__BODY_ATTACH_POOL_REPLY);
    uint32_t pool = r->attach_pool_reply->pool_id;
    kv_wire_free(r);
    return pool;
}

static uint32_t open_session(int fd, int packed) {
    return open_session_with(fd, packed ? KV_FEATURE_PACKED : 0);
}

static void hash_of(size_t i, uint64_t *lo, uint64_t *hi) {
    *lo = 0x1000 + i;
    *hi = 0xfeedface;
}

/* Lookup of n hashes of the test prefix, packed or as Hash128 messages. */
static Kvd__Envelope *lookup(int fd, uint32_t pool, size_t n, int packed) {
    uint8_t buf[32 * KV_WIRE_HASH_BYTES];
    Kvd__Hash128 h[32], *ph[32];
    assert_true(n <= 32);
    Kvd__Lookup l = KVD__LOOKUP__INIT;
    l.pool_id = pool;
    for (size_t i = 0; i < n; i++) {
        uint64_t lo, hi;
        hash_of(i, &lo, &hi);
        kv_wire_hash_put(buf, i, lo, hi);
        kvd__hash128__init(&h[i]);
        h[i].lo = lo;
        h[i].hi = hi;
        ph[i] = &h[i];
    }
    if (packed) {
        l.hashes_packed.data = buf;
        l.hashes_packed.len = n * KV_WIRE_HASH_BYTES;
    } else {
        l.n_hashes = n;
        l.hashes = ph;
    }
    Kvd__Envelope e = KVD__ENVELOPE__INIT;
    e.body_case = KVD__ENVELOPE__BODY_LOOKUP;
    e.lookup = &l;
    return rpc_ok(fd, &e, KVD__ENVELOPE__BODY_LOOKUP_REPLY);
}

/* Release (or Rewind) of blocks[0..n) as blocks_packed. */
static Kvd__Envelope *release_packed(int fd, uint32_t pool, const uint32_t (*blocks)[2], size_t n,
                                     int rewind) {
    uint8_t buf[32 * KV_WIRE_BLOCK_BYTES];
    for (size_t i = 0; i < n; i++) {
        kv_wire_block_put(buf, i, blocks[i][0], blocks[i][1]);
    }
    Kvd__Release rel = KVD__RELEASE__INIT;
    Kvd__Rewind rew = KVD__REWIND__INIT;
    Kvd__Envelope e = KVD__ENVELOPE__INIT;
    ProtobufCBinaryData b = {n * KV_WIRE_BLOCK_BYTES, buf};
    if (rewind) {
        rew.pool_id = pool;
        rew.blocks_packed = b;
        e.body_case = KVD__ENVELOPE__BODY_REWIND;
        e.rewind = &rew;
    } else {
        rel.pool_id = pool;
        rel.blocks_packed = b;
        e.body_case = KVD__ENVELOPE__BODY_RELEASE;
        e.release = &rel;
    }
    send_env(fd, &e);
    Kvd__Envelope *r = recv_env(fd);
    assert_int_equal(r->id, e.id);
    return r;
}

/* A packed block list holds exactly blk[0..n). */
static void assert_packed(const ProtobufCBinaryData *packed, const uint32_t (*blk)[2], size_t n) {
    assert_int_equal(packed->len, n * KV_WIRE_BLOCK_BYTES);
    for (size_t i = 0; i < n; i++) {
        uint32_t id, gen;
        kv_wire_block_get(packed->data, i, &id, &gen);
        assert_int_equal(id, blk[i][0]);
        assert_int_equal(gen, blk[i][1]);
    }
}

static uint64_t refs_held(int fd) {
    Kvd__Stats s = KVD__STATS__INIT;
    Kvd__Envelope e = KVD__ENVELOPE__INIT;
    e.body_case = KVD__ENVELOPE__BODY_STATS;
    e.stats = &s;
    Kvd__Envelope *r = rpc_ok(fd, &e, KVD__ENVELOPE__BODY_STATS_REPLY);
    uint64_t v = UINT64_MAX;
    for (size_t i = 0; i < r->stats_reply->n_stats; i++) {
        if (strcmp(r->stats_reply->stats[i]->name, "session.refs_held") == 0) {
            v = r->stats_reply->stats[i]->value;
        }
    }
    kv_wire_free(r);
    assert_true(v != UINT64_MAX);
    return v;
}

/* Allocates NB blocks (the session reads packed replies); out gets the handles. */
static void allocate_nb(int fd, uint32_t pool, uint32_t (*out)[2]) {
    Kvd__Allocate a = KVD__ALLOCATE__INIT;
    a.pool_id = pool;
    a.count = NB;
    Kvd__Envelope e = KVD__ENVELOPE__INIT;
    e.body_case = KVD__ENVELOPE__BODY_ALLOCATE;
    e.allocate = &a;
    Kvd__Envelope *r = rpc_ok(fd, &e, KVD__ENVELOPE__BODY_ALLOCATE_REPLY);
    assert_int_equal(r->allocate_reply->n_blocks, 0);
    assert_int_equal(r->allocate_reply->blocks_packed.len, NB * KV_WIRE_BLOCK_BYTES);
    for (size_t i = 0; i < NB; i++) {
        kv_wire_block_get(r->allocate_reply->blocks_packed.data, i, &out[i][0], &out[i][1]);
    }
    kv_wire_free(r);
}

/* Allocates NB blocks (packed reply), commits them as the test prefix, releases them packed;
 * out gets the handles. */
static void make_prefix(int fd, uint32_t pool, uint32_t (*out)[2]) {
    allocate_nb(fd, pool, out);
    Kvd__Envelope e = KVD__ENVELOPE__INIT;
    Kvd__Envelope *r;
    Kvd__CommitEntry ent[NB], *pe[NB];
    Kvd__Hash128 h[NB];
    Kvd__BlockRef br[NB];
    for (size_t i = 0; i < NB; i++) {
        kvd__commit_entry__init(&ent[i]);
        kvd__hash128__init(&h[i]);
        kvd__block_ref__init(&br[i]);
        br[i].id = out[i][0];
        br[i].gen = out[i][1];
        hash_of(i, &h[i].lo, &h[i].hi);
        ent[i].block = &br[i];
        ent[i].hash = &h[i];
        ent[i].parent = i == 0 ? UINT32_MAX : out[i - 1][0];
        pe[i] = &ent[i];
    }
    Kvd__Commit c = KVD__COMMIT__INIT;
    c.pool_id = pool;
    c.n_entries = NB;
    c.entries = pe;
    kvd__envelope__init(&e);
    e.body_case = KVD__ENVELOPE__BODY_COMMIT;
    e.commit = &c;
    kv_wire_free(rpc_ok(fd, &e, KVD__ENVELOPE__BODY_COMMIT_REPLY));
    r = release_packed(fd, pool, (const uint32_t(*)[2])out, NB, 0);
    assert_int_equal(r->body_case, KVD__ENVELOPE__BODY_RELEASE_REPLY);
    kv_wire_free(r);
    assert_int_equal(refs_held(fd), 0);
}

static void test_packed_round_trip(void **state) {
    (void)state;
    harness *h = start(64);
    int fd = dial(h);
    uint32_t pool = open_session(fd, 1);
    uint32_t blk[NB][2];
    make_prefix(fd, pool, blk);

    /* Packed lookup, packed reply: the prefix's handles in order, then the first miss ends it. */
    Kvd__Envelope *r = lookup(fd, pool, NB + 2, 1);
    assert_int_equal(r->lookup_reply->n_blocks, 0);
    assert_packed(&r->lookup_reply->blocks_packed, (const uint32_t(*)[2])blk, NB);
    kv_wire_free(r);
    assert_int_equal(refs_held(fd), NB);
    /* Repeated-form lookup from the same (packed) client: the daemon takes both forms. */
    r = lookup(fd, pool, NB, 0);
    assert_int_equal(r->lookup_reply->blocks_packed.len, NB * KV_WIRE_BLOCK_BYTES);
    kv_wire_free(r);
    assert_int_equal(refs_held(fd), 2 * NB);
    /* Rewind drops the first lookup's references, Release the second's. */
    r = release_packed(fd, pool, (const uint32_t(*)[2])blk, NB, 1);
    assert_int_equal(r->body_case, KVD__ENVELOPE__BODY_REWIND_REPLY);
    kv_wire_free(r);
    r = release_packed(fd, pool, (const uint32_t(*)[2])blk, NB, 0);
    assert_int_equal(r->body_case, KVD__ENVELOPE__BODY_RELEASE_REPLY);
    kv_wire_free(r);
    assert_int_equal(refs_held(fd), 0);

    /* A client that did not ask for packed replies gets BlockRef messages, packed request or
     * not. */
    int fd2 = dial(h);
    uint32_t pool2 = open_session(fd2, 0);
    assert_int_equal(pool2, pool);
    for (int packed = 0; packed < 2; packed++) {
        r = lookup(fd2, pool, NB, packed);
        assert_int_equal(r->lookup_reply->blocks_packed.len, 0);
        assert_int_equal(r->lookup_reply->n_blocks, NB);
        for (size_t i = 0; i < NB; i++) {
            assert_int_equal(r->lookup_reply->blocks[i]->id, blk[i][0]);
            assert_int_equal(r->lookup_reply->blocks[i]->gen, blk[i][1]);
        }
        kv_wire_free(r);
    }
    assert_int_equal(refs_held(fd2), 2 * NB);
    close(fd2);
    close(fd);
    stop(h);
}

static void test_packed_malformed(void **state) {
    (void)state;
    harness *h = start(64);
    int fd = dial(h);
    uint32_t pool = open_session(fd, 1);
    uint32_t blk[NB][2];
    make_prefix(fd, pool, blk);

    uint8_t buf[64 * KV_WIRE_HASH_BYTES];
    memset(buf, 0, sizeof(buf));
    Kvd__Lookup l = KVD__LOOKUP__INIT;
    Kvd__Envelope e = KVD__ENVELOPE__INIT;
    e.body_case = KVD__ENVELOPE__BODY_LOOKUP;
    e.lookup = &l;
    l.pool_id = pool;
    /* Not a multiple of 16. */
    l.hashes_packed.data = buf;
    l.hashes_packed.len = 17;
    expect_error(fd, &e, KV_EPROTO);
    l.hashes_packed.len = 15;
    expect_error(fd, &e, KV_EPROTO);
    /* Both forms at once. */
    Kvd__Hash128 one = KVD__HASH128__INIT, *pone = &one;
    l.hashes_packed.len = 16;
    l.n_hashes = 1;
    l.hashes = &pone;
    expect_error(fd, &e, KV_EPROTO);
    /* Longer than max-blocks-per-request (16 here) in the packed form. */
    l.n_hashes = 0;
    l.hashes = NULL;
    l.hashes_packed.len = 17 * KV_WIRE_HASH_BYTES;
    expect_error(fd, &e, KV_ETOOBIG);

    Kvd__Release rel = KVD__RELEASE__INIT;
    kvd__envelope__init(&e);
    e.body_case = KVD__ENVELOPE__BODY_RELEASE;
    e.release = &rel;
    rel.pool_id = pool;
    rel.blocks_packed.data = buf;
    rel.blocks_packed.len = 12;
    expect_error(fd, &e, KV_EPROTO);
    Kvd__BlockRef br = KVD__BLOCK_REF__INIT, *pbr = &br;
    rel.blocks_packed.len = 8;
    rel.n_blocks = 1;
    rel.blocks = &pbr;
    expect_error(fd, &e, KV_EPROTO);
    Kvd__Rewind rew = KVD__REWIND__INIT;
    kvd__envelope__init(&e);
    e.body_case = KVD__ENVELOPE__BODY_REWIND;
    e.rewind = &rew;
    rew.pool_id = pool;
    rew.blocks_packed.data = buf;
    rew.blocks_packed.len = 7;
    expect_error(fd, &e, KV_EPROTO);

    /* The connection is still in sync: one reference, listed twice -> EPERM, nothing dropped;
     * an id out of range -> ENOENT. */
    Kvd__Envelope *r = lookup(fd, pool, 1, 1);
    assert_int_equal(r->lookup_reply->blocks_packed.len, KV_WIRE_BLOCK_BYTES);
    kv_wire_free(r);
    uint32_t twice[2][2] = {{blk[0][0], blk[0][1]}, {blk[0][0], blk[0][1]}};
    r = release_packed(fd, pool, (const uint32_t(*)[2])twice, 2, 0);
    assert_int_equal(r->body_case, KVD__ENVELOPE__BODY_ERROR);
    assert_int_equal(r->error->code, KV_EPERM);
    kv_wire_free(r);
    uint32_t bad[2][2] = {{blk[0][0], blk[0][1]}, {UINT32_MAX, 0}};
    r = release_packed(fd, pool, (const uint32_t(*)[2])bad, 2, 0);
    assert_int_equal(r->body_case, KVD__ENVELOPE__BODY_ERROR);
    assert_int_equal(r->error->code, KV_ENOENT);
    kv_wire_free(r);
    assert_int_equal(refs_held(fd), 1);
    r = release_packed(fd, pool, (const uint32_t(*)[2])twice, 1, 0);
    assert_int_equal(r->body_case, KVD__ENVELOPE__BODY_RELEASE_REPLY);
    kv_wire_free(r);
    assert_int_equal(refs_held(fd), 0);
    close(fd);
    stop(h);
}

/* Many small requests in one write with max-inflight 4: the replies of one read share an output
 * chunk, and flow control still lets every request through, in order. */
static void test_pipelined_burst(void **state) {
    (void)state;
    harness *h = start(4);
    int fd = dial(h);
    uint32_t pool = open_session(fd, 1);
    enum { N = 200 };
    uint8_t *all = NULL;
    size_t total = 0;
    uint64_t first = next_id;
    for (int i = 0; i < N; i++) {
        Kvd__Ping p = KVD__PING__INIT;
        Kvd__Stats st = KVD__STATS__INIT;
        Kvd__Envelope e = KVD__ENVELOPE__INIT;
        e.id = next_id++;
        if (i % 10 == 9) {
            st.pool_id = pool; /* a larger reply now and then */
            e.body_case = KVD__ENVELOPE__BODY_STATS;
            e.stats = &st;
        } else {
            p.nonce = (uint64_t)i;
            e.body_case = KVD__ENVELOPE__BODY_PING;
            e.ping = &p;
        }
        uint8_t *buf;
        size_t len;
        assert_int_equal(kv_wire_encode(&e, 1u << 30, &buf, &len), KV_OK);
        all = realloc(all, total + len);
        memcpy(all + total, buf, len);
        total += len;
        free(buf);
    }
    assert_int_equal(send(fd, all, total, MSG_NOSIGNAL), (ssize_t)total);
    free(all);
    for (int i = 0; i < N; i++) {
        Kvd__Envelope *r = recv_env(fd);
        assert_int_equal(r->id, first + (uint64_t)i);
        if (i % 10 == 9) {
            assert_int_equal(r->body_case, KVD__ENVELOPE__BODY_STATS_REPLY);
        } else {
            assert_int_equal(r->body_case, KVD__ENVELOPE__BODY_PONG);
            assert_int_equal(r->pong->nonce, (uint64_t)i);
        }
        kv_wire_free(r);
    }
    close(fd);
    stop(h);
}

/* The packed Commit (entries_packed) of blk[0..n) as the test prefix's first n hashes, chained;
 * c gets the request (its fields point into ent, which holds n * 28 bytes). */
static void commit_packed_req(Kvd__Commit *c, uint8_t *ent, uint32_t pool, const uint32_t (*blk)[2],
                              size_t n) {
    kvd__commit__init(c);
    c->pool_id = pool;
    for (size_t i = 0; i < n; i++) {
        kv_wire_commit w = {blk[i][0], blk[i][1], 0, 0, i == 0 ? UINT32_MAX : blk[i - 1][0]};
        hash_of(i, &w.lo, &w.hi);
        kv_wire_commit_put(ent, i, &w);
    }
    c->entries_packed.data = ent;
    c->entries_packed.len = n * KV_WIRE_COMMIT_BYTES;
}

/* Commit.entries_packed (PROTOCOL.md 6, "Packed lists"): the blocks are committed as with the
 * repeated form and a client that asked (Hello.features PACKED_COMMIT) gets canonical_packed,
 * another canonical BlockRefs naming the same blocks (its duplicates); malformed packed fields
 * are EPROTO (ETOOBIG past the limit, EINVAL for a digest the xxh3 daemon has no use for) with
 * the connection kept and nothing committed. */
static void test_packed_commit(void **state) {
    (void)state;
    harness *h = start(64);
    int fd = dial(h);
    uint32_t pool = open_session_with(fd, KV_FEATURE_PACKED | KV_FEATURE_PACKED_COMMIT);
    uint32_t blk[NB][2];
    uint8_t ent[(NB + 9) * KV_WIRE_COMMIT_BYTES];
    allocate_nb(fd, pool, blk);
    Kvd__Commit c;
    commit_packed_req(&c, ent, pool, (const uint32_t(*)[2])blk, NB);
    Kvd__Envelope e = KVD__ENVELOPE__INIT;
    e.body_case = KVD__ENVELOPE__BODY_COMMIT;
    e.commit = &c;
    Kvd__Envelope *r = rpc_ok(fd, &e, KVD__ENVELOPE__BODY_COMMIT_REPLY);
    assert_int_equal(r->commit_reply->n_canonical, 0);
    assert_packed(&r->commit_reply->canonical_packed, (const uint32_t(*)[2])blk, NB);
    kv_wire_free(r);
    r = release_packed(fd, pool, (const uint32_t(*)[2])blk, NB, 0);
    assert_int_equal(r->body_case, KVD__ENVELOPE__BODY_RELEASE_REPLY);
    kv_wire_free(r);
    /* Committed as a chain: a lookup of the prefix hits every block. */
    r = lookup(fd, pool, NB, 1);
    assert_int_equal(r->lookup_reply->blocks_packed.len, NB * KV_WIRE_BLOCK_BYTES);
    kv_wire_free(r);
    r = release_packed(fd, pool, (const uint32_t(*)[2])blk, NB, 0);
    kv_wire_free(r);
    assert_int_equal(refs_held(fd), 0);

    /* A client without the bit: the same packed request is taken, the reply is BlockRefs, and
     * its blocks are duplicates of the first client's. */
    int fd2 = dial(h);
    assert_int_equal(open_session_with(fd2, KV_FEATURE_PACKED), pool);
    uint32_t blk2[NB][2];
    allocate_nb(fd2, pool, blk2);
    commit_packed_req(&c, ent, pool, (const uint32_t(*)[2])blk2, NB);
    r = rpc_ok(fd2, &e, KVD__ENVELOPE__BODY_COMMIT_REPLY);
    assert_int_equal(r->commit_reply->canonical_packed.len, 0);
    assert_int_equal(r->commit_reply->n_canonical, NB);
    for (size_t i = 0; i < NB; i++) {
        assert_int_equal(r->commit_reply->canonical[i]->id, blk[i][0]);
    }
    kv_wire_free(r);
    r = release_packed(fd2, pool, (const uint32_t(*)[2])blk, NB, 0);
    assert_int_equal(r->body_case, KVD__ENVELOPE__BODY_RELEASE_REPLY);
    kv_wire_free(r);
    close(fd2);

    /* Malformed: nothing is committed, the connection stays. */
    uint32_t blk3[NB + 9][2];
    memset(blk3, 0, sizeof(blk3)); /* the 17th is never allocated: ETOOBIG comes first */
    allocate_nb(fd, pool, blk3);
    allocate_nb(fd, pool, blk3 + NB);
    uint8_t junk[(NB + 9) * 32];
    memset(junk, 0, sizeof(junk));
    commit_packed_req(&c, ent, pool, (const uint32_t(*)[2])blk3, NB);
    c.entries_packed.len = NB * KV_WIRE_COMMIT_BYTES - 1; /* a cut record */
    expect_error(fd, &e, KV_EPROTO);
    c.entries_packed.len = NB * KV_WIRE_COMMIT_BYTES;
    Kvd__CommitEntry one = KVD__COMMIT_ENTRY__INIT, *pone = &one;
    Kvd__BlockRef oneb = KVD__BLOCK_REF__INIT;
    Kvd__Hash128 oneh = KVD__HASH128__INIT;
    one.block = &oneb; /* a whole entry: an empty one would be EINVAL first (field order) */
    one.hash = &oneh;
    c.n_entries = 1; /* both forms */
    c.entries = &pone;
    expect_error(fd, &e, KV_EPROTO);
    one.block = NULL; /* an entry without its block: EINVAL before the packed field's EPROTO */
    expect_error(fd, &e, KV_EINVAL);
    c.n_entries = 0;
    c.entries = NULL;
    c.hash_full_packed.data = junk;
    c.hash_full_packed.len = 32 * NB - 32; /* one digest short */
    expect_error(fd, &e, KV_EPROTO);
    c.hash_full_packed.len = 0;
    c.token_ids_packed.data = junk;
    c.token_ids_packed.len = 3; /* not whole token ids */
    expect_error(fd, &e, KV_EPROTO);
    c.token_ids_packed.len = 0;
    c.entries_packed.len = 0; /* a companion alone */
    c.parent_hash_full.data = junk;
    c.parent_hash_full.len = 32;
    expect_error(fd, &e, KV_EPROTO);
    c.parent_hash_full.len = 0;
    commit_packed_req(&c, ent, pool, (const uint32_t(*)[2])blk3, 17); /* past 16 a request */
    expect_error(fd, &e, KV_ETOOBIG);
    commit_packed_req(&c, ent, pool, (const uint32_t(*)[2])blk3, NB);
    c.hash_full_packed.data = junk; /* a digest this xxh3 daemon has no use for */
    c.hash_full_packed.len = 32 * NB;
    expect_error(fd, &e, KV_EINVAL);
    commit_packed_req(&c, ent, pool, (const uint32_t(*)[2])blk3, NB);
    kv_wire_put_le32(ent + 3 * KV_WIRE_COMMIT_BYTES + 24, blk3[3][0]); /* its own parent */
    expect_error(fd, &e, KV_EINVAL);
    /* All still WRITING: the well-formed request commits them (the prefix's hashes: the
     * first client's blocks are canonical). */
    commit_packed_req(&c, ent, pool, (const uint32_t(*)[2])blk3, NB);
    r = rpc_ok(fd, &e, KVD__ENVELOPE__BODY_COMMIT_REPLY);
    assert_int_equal(r->commit_reply->canonical_packed.len, NB * KV_WIRE_BLOCK_BYTES);
    uint32_t id0, gen0;
    kv_wire_block_get(r->commit_reply->canonical_packed.data, 0, &id0, &gen0);
    assert_int_equal(id0, blk[0][0]);
    kv_wire_free(r);
    close(fd);
    stop(h);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_packed_round_trip),
        cmocka_unit_test(test_packed_malformed),
        cmocka_unit_test(test_packed_commit),
        cmocka_unit_test(test_pipelined_burst),
    };
    return cmocka_run_group_tests_name("packed", tests, NULL, NULL);
}
