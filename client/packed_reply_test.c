/* packed_reply_test: libkvclient's handling of packed block lists in replies (PROTOCOL.md 6,
 * "Packed lists"), straight through kvc__op_complete with crafted envelopes: both forms decode
 * to the same handles, and a malformed packed list (length not a multiple of 8, both forms at
 * once, more hits than hashes, a wrong Allocate or Commit count) is a malformed reply
 * (KV_EPROTO) that writes nothing past what was asked. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "client/conn.h"
#include "client/map.h"
#include "client/rpc.h"
#include "common/kv_wire.h"

typedef struct fixture {
    kvc_conn conn;      /* zeroed: no socket, no log callback */
    kvc_pool pool;      /* zeroed but for its geometry: nothing is mapped */
    kvc_block out[8];   /* the caller's output array */
    size_t nout;        /* lookup hit count */
    uint8_t buf[80];    /* packed records */
    Kvd__BlockRef r[8]; /* repeated form */
    Kvd__BlockRef *pr[8];
} fixture;

static fixture *fx_new(void) {
    fixture *f = calloc(1, sizeof(*f));
    assert_non_null(f);
    f->pool.conn = &f->conn;
    f->pool.diag = &f->conn.diag;
    f->pool.blocks_per_segment = 16;
    for (uint32_t i = 0; i < 8; i++) {
        kv_wire_block_put(f->buf, i, 100 + i, 7 * i);
        kvd__block_ref__init(&f->r[i]);
        f->r[i].id = 100 + i;
        f->r[i].gen = 7 * i;
        f->pr[i] = &f->r[i];
    }
    memset(f->out, 0xee, sizeof(f->out));
    return f;
}

/* An op of kind waiting for count blocks into the fixture's output array. */
static kvc__op block_op(fixture *f, kvc__op_kind kind, size_t count) {
    kvc__op op;
    memset(&op, 0, sizeof(op));
    op.kind = kind;
    op.pool = &f->pool;
    op.count = count;
    op.out = f->out;
    return op;
}

static kv_err complete_lookup(fixture *f, size_t asked, size_t nrep, size_t packed_len,
                              uint32_t nsf) {
    kvc__op op;
    memset(&op, 0, sizeof(op));
    op.kind = KVC__OP_LOOKUP;
    op.pool = &f->pool;
    op.count = asked;
    op.out = f->out;
    op.nout = &f->nout;
    Kvd__LookupReply lr = KVD__LOOKUP_REPLY__INIT;
    lr.n_blocks = nrep;
    lr.blocks = f->pr;
    lr.blocks_packed.data = f->buf;
    lr.blocks_packed.len = packed_len;
    lr.new_segments_from = nsf;
    Kvd__Envelope env = KVD__ENVELOPE__INIT;
    env.body_case = KVD__ENVELOPE__BODY_LOOKUP_REPLY;
    env.lookup_reply = &lr;
    return kvc__op_complete(&f->conn, &op, &env, NULL, 0);
}

static void test_lookup_both_forms(void **state) {
    (void)state;
    for (int packed = 0; packed < 2; packed++) {
        fixture *f = fx_new();
        kv_err rc = packed ? complete_lookup(f, 8, 0, 5 * KV_WIRE_BLOCK_BYTES, 3)
                           : complete_lookup(f, 8, 5, 0, 3);
        assert_int_equal(rc, KV_OK);
        assert_int_equal(f->nout, 5);
        for (uint32_t i = 0; i < 5; i++) {
            assert_int_equal(f->out[i].id, 100 + i);
            assert_int_equal(f->out[i].gen, 7 * i);
        }
        assert_int_equal(f->out[5].id, 0xeeeeeeeeu); /* nothing past the hits */
        assert_true(f->pool.need_map);               /* announced, and the hits are not mapped */
        free(f);
    }
    fixture *f = fx_new();
    assert_int_equal(complete_lookup(f, 8, 0, 0, 0), KV_OK); /* no hit: both empty */
    assert_int_equal(f->nout, 0);
    free(f);
}

static void test_lookup_malformed(void **state) {
    (void)state;
    fixture *f = fx_new();
    f->nout = 99;
    assert_int_equal(complete_lookup(f, 8, 0, 12, 0), KV_EPROTO);    /* not a multiple of 8 */
    assert_int_equal(complete_lookup(f, 8, 0, 7, 0), KV_EPROTO);     /* shorter than a record */
    assert_int_equal(complete_lookup(f, 8, 2, 16, 0), KV_EPROTO);    /* both forms */
    assert_int_equal(complete_lookup(f, 4, 0, 5 * 8, 0), KV_EPROTO); /* more hits than hashes */
    assert_int_equal(f->nout, 99);
    assert_int_equal(f->out[0].id, 0xeeeeeeeeu);
    assert_true(strstr(kvc_last_error(&f->conn), "malformed") != NULL);
    free(f);
}

static void test_allocate_packed(void **state) {
    (void)state;
    fixture *f = fx_new();
    kvc__op op = block_op(f, KVC__OP_ALLOCATE, 3);
    Kvd__AllocateReply ar = KVD__ALLOCATE_REPLY__INIT;
    ar.blocks_packed.data = f->buf;
    ar.blocks_packed.len = 3 * KV_WIRE_BLOCK_BYTES;
    Kvd__Envelope env = KVD__ENVELOPE__INIT;
    env.body_case = KVD__ENVELOPE__BODY_ALLOCATE_REPLY;
    env.allocate_reply = &ar;
    assert_int_equal(kvc__op_complete(&f->conn, &op, &env, NULL, 0), KV_OK);
    assert_int_equal(f->out[2].id, 102);
    assert_int_equal(f->out[2].gen, 14);
    ar.blocks_packed.len = 2 * KV_WIRE_BLOCK_BYTES; /* fewer than asked */
    assert_int_equal(kvc__op_complete(&f->conn, &op, &env, NULL, 0), KV_EPROTO);
    ar.blocks_packed.len = 3 * KV_WIRE_BLOCK_BYTES + 1;
    assert_int_equal(kvc__op_complete(&f->conn, &op, &env, NULL, 0), KV_EPROTO);
    free(f);
}

/* CommitReply.canonical_packed (Hello.features PACKED_COMMIT): the same handles as canonical;
 * one record short, a cut record or both forms are malformed and write nothing. */
static void test_commit_packed(void **state) {
    (void)state;
    for (int packed = 0; packed < 2; packed++) {
        fixture *f = fx_new();
        kvc__op op = block_op(f, KVC__OP_COMMIT, 4);
        Kvd__CommitReply cr = KVD__COMMIT_REPLY__INIT;
        if (packed) {
            cr.canonical_packed.data = f->buf;
            cr.canonical_packed.len = 4 * KV_WIRE_BLOCK_BYTES;
        } else {
            cr.n_canonical = 4;
            cr.canonical = f->pr;
        }
        Kvd__Envelope env = KVD__ENVELOPE__INIT;
        env.body_case = KVD__ENVELOPE__BODY_COMMIT_REPLY;
        env.commit_reply = &cr;
        assert_int_equal(kvc__op_complete(&f->conn, &op, &env, NULL, 0), KV_OK);
        for (uint32_t i = 0; i < 4; i++) {
            assert_int_equal(f->out[i].id, 100 + i);
            assert_int_equal(f->out[i].gen, 7 * i);
        }
        assert_int_equal(f->out[4].id, 0xeeeeeeeeu);
        assert_true(f->pool.need_map); /* the canonical blocks are not mapped here */
        free(f);
    }
    fixture *f = fx_new();
    kvc__op op = block_op(f, KVC__OP_COMMIT, 4);
    Kvd__CommitReply cr = KVD__COMMIT_REPLY__INIT;
    cr.canonical_packed.data = f->buf;
    Kvd__Envelope env = KVD__ENVELOPE__INIT;
    env.body_case = KVD__ENVELOPE__BODY_COMMIT_REPLY;
    env.commit_reply = &cr;
    cr.canonical_packed.len = 3 * KV_WIRE_BLOCK_BYTES; /* one short */
    assert_int_equal(kvc__op_complete(&f->conn, &op, &env, NULL, 0), KV_EPROTO);
    cr.canonical_packed.len = 4 * KV_WIRE_BLOCK_BYTES - 1; /* a cut record */
    assert_int_equal(kvc__op_complete(&f->conn, &op, &env, NULL, 0), KV_EPROTO);
    cr.canonical_packed.len = 4 * KV_WIRE_BLOCK_BYTES;
    cr.n_canonical = 4; /* both forms */
    cr.canonical = f->pr;
    assert_int_equal(kvc__op_complete(&f->conn, &op, &env, NULL, 0), KV_EPROTO);
    assert_int_equal(f->out[0].id, 0xeeeeeeeeu);
    free(f);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_lookup_both_forms),
        cmocka_unit_test(test_commit_packed),
        cmocka_unit_test(test_lookup_malformed),
        cmocka_unit_test(test_allocate_packed),
    };
    return cmocka_run_group_tests_name("packed_reply", tests, NULL, NULL);
}
