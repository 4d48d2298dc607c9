/* validate_test: the pure request checks refuse bad input with the documented code and a
 * message, and accept good input. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <string.h>

#include <cmocka.h>

#include "common/kv_arena.h"
#include "common/kv_wire.h"
#include "daemon/proto/validate.h"

static void test_hello(void **state) {
    (void)state;
    char msg[256];
    Kvd__Hello h = KVD__HELLO__INIT;
    h.protocol_version = 1;
    assert_int_equal(kvd_validate_hello(&h, msg, sizeof(msg)), KV_OK);
    h.client_name = "worker-1";
    assert_int_equal(kvd_validate_hello(&h, msg, sizeof(msg)), KV_OK);
    h.protocol_version = 0;
    assert_int_equal(kvd_validate_hello(&h, msg, sizeof(msg)), KV_EVERSION);
    assert_non_null(strstr(msg, "protocol_version"));
    h.protocol_version = 1;
    char longname[100];
    memset(longname, 'a', sizeof(longname) - 1);
    longname[99] = '\0';
    h.client_name = longname;
    assert_int_equal(kvd_validate_hello(&h, msg, sizeof(msg)), KV_EINVAL);
    h.client_name = NULL;
    /* A token's length is checked here; whether it names a tenant is the tenant table's. */
    uint8_t tok[KV_WIRE_MAX_TOKEN + 1] = {1, 2, 3};
    h.token.data = tok;
    h.token.len = 3;
    assert_int_equal(kvd_validate_hello(&h, msg, sizeof(msg)), KV_OK);
    h.token.len = KV_WIRE_MAX_TOKEN + 1;
    assert_int_equal(kvd_validate_hello(&h, msg, sizeof(msg)), KV_EINVAL);
}

static void test_attach(void **state) {
    (void)state;
    char msg[256];
    Kvd__AttachPool a = KVD__ATTACH_POOL__INIT;
    Kvd__Layout l = KVD__LAYOUT__INIT;
    kv_layout out;
    a.model_id = "m";
    assert_int_equal(kvd_validate_attach(&a, &out, msg, sizeof(msg)), KV_EINVAL); /* no layout */
    a.layout = &l;
    l.num_layers = 4;
    l.num_kv_heads = 8;
    l.head_dim = 128;
    l.tokens_per_block = 16;
    l.dtype = KVD__DTYPE__BF16;
    l.arrangement = KVD__ARRANGEMENT__BLOCK_MAJOR;
    assert_int_equal(kvd_validate_attach(&a, &out, msg, sizeof(msg)), KV_OK);
    assert_int_equal(out.block_bytes, 4ull * 2 * 16 * 8 * 128 * 2);
    Kvd__Layout bad = l;
    bad.dtype = 77;
    a.layout = &bad;
    assert_int_equal(kvd_validate_attach(&a, &out, msg, sizeof(msg)), KV_EINVAL);
    assert_non_null(strstr(msg, "layout"));
    bad = l;
    bad.num_layers = 0;
    assert_int_equal(kvd_validate_attach(&a, &out, msg, sizeof(msg)), KV_EINVAL);
    bad = l;
    bad.tokens_per_block = 5000;
    assert_int_equal(kvd_validate_attach(&a, &out, msg, sizeof(msg)), KV_EINVAL);
    a.layout = &l;
    a.model_id = "";
    assert_int_equal(kvd_validate_attach(&a, &out, msg, sizeof(msg)), KV_EINVAL);
    char longid[200];
    memset(longid, 'x', sizeof(longid) - 1);
    longid[199] = '\0';
    a.model_id = longid;
    assert_int_equal(kvd_validate_attach(&a, &out, msg, sizeof(msg)), KV_EINVAL);
    assert_non_null(strstr(msg, "model_id"));
}

static void test_lists(void **state) {
    (void)state;
    char msg[256];
    Kvd__Allocate al = KVD__ALLOCATE__INIT;
    assert_int_equal(kvd_validate_allocate(&al, 10, msg, sizeof(msg)), KV_EINVAL);
    al.count = 10;
    assert_int_equal(kvd_validate_allocate(&al, 10, msg, sizeof(msg)), KV_OK);
    al.count = 11;
    assert_int_equal(kvd_validate_allocate(&al, 10, msg, sizeof(msg)), KV_ETOOBIG);

    Kvd__Hash128 h = KVD__HASH128__INIT;
    Kvd__Hash128 *hs[2] = {&h, NULL};
    Kvd__Lookup lk = KVD__LOOKUP__INIT;
    lk.hashes = hs;
    lk.n_hashes = 1;
    assert_int_equal(kvd_validate_lookup(&lk, 4, msg, sizeof(msg)), KV_OK);
    lk.n_hashes = 2;
    assert_int_equal(kvd_validate_lookup(&lk, 4, msg, sizeof(msg)), KV_EINVAL);
    assert_int_equal(kvd_validate_lookup(&lk, 1, msg, sizeof(msg)), KV_ETOOBIG);

    Kvd__BlockRef b = KVD__BLOCK_REF__INIT;
    Kvd__CommitEntry e = KVD__COMMIT_ENTRY__INIT;
    Kvd__CommitEntry *es[1] = {&e};
    Kvd__Commit c = KVD__COMMIT__INIT;
    c.entries = es;
    c.n_entries = 1;
    assert_int_equal(kvd_validate_commit(&c, 4, msg, sizeof(msg)), KV_EINVAL);
    e.block = &b;
    assert_int_equal(kvd_validate_commit(&c, 4, msg, sizeof(msg)), KV_EINVAL);
    e.hash = &h;
    assert_int_equal(kvd_validate_commit(&c, 4, msg, sizeof(msg)), KV_OK);
    assert_int_equal(kvd_validate_commit(&c, 0, msg, sizeof(msg)), KV_ETOOBIG);

    Kvd__BlockRef *bs[2] = {&b, NULL};
    assert_int_equal(kvd_validate_refs(1, bs, 4, msg, sizeof(msg)), KV_OK);
    assert_int_equal(kvd_validate_refs(2, bs, 4, msg, sizeof(msg)), KV_EINVAL);
    assert_int_equal(kvd_validate_refs(2, bs, 1, msg, sizeof(msg)), KV_ETOOBIG);
}

/* A packed Commit comes out as the repeated form, entry for entry; malformed or oversized packed
 * fields are refused in field order and leave *out the request itself. */
static void test_commit_any(void **state) {
    (void)state;
    char msg[256];
    kv_arena a;
    kv_arena_init(&a);
    enum { TPB = 4 };
    uint8_t ent[3 * KV_WIRE_COMMIT_BYTES], full[3 * KV_WIRE_DIGEST_BYTES], tok[3 * TPB * 4],
        pfull[32];
    for (size_t i = 0; i < 3; i++) {
        kv_wire_commit w = {10 + (uint32_t)i, 7, 100 + i, 200 + i,
                            i == 0 ? UINT32_MAX : 9 + (uint32_t)i};
        kv_wire_commit_put(ent, i, &w);
    }
    for (size_t i = 0; i < sizeof(full); i++) {
        full[i] = (uint8_t)i;
    }
    for (size_t i = 0; i < 3 * TPB; i++) {
        kv_wire_put_le32(tok + 4 * i, 0x01020300u + (uint32_t)i);
    }
    memset(pfull, 0xab, sizeof(pfull));
    Kvd__Commit c = KVD__COMMIT__INIT;
    const Kvd__Commit *out = NULL;
    /* No packed field: the request itself. */
    assert_int_equal(
        kvd_validate_commit_any(&c, 4, TPB, kv_arena_allocator(&a), &out, msg, sizeof(msg)), KV_OK);
    assert_ptr_equal(out, &c);
    c.entries_packed.data = ent;
    c.entries_packed.len = sizeof(ent);
    c.hash_full_packed.data = full;
    c.hash_full_packed.len = sizeof(full);
    c.token_ids_packed.data = tok;
    c.token_ids_packed.len = sizeof(tok);
    c.parent_hash_full.data = pfull;
    c.parent_hash_full.len = sizeof(pfull);
    assert_int_equal(
        kvd_validate_commit_any(&c, 4, TPB, kv_arena_allocator(&a), &out, msg, sizeof(msg)), KV_OK);
    assert_ptr_not_equal(out, &c);
    assert_int_equal(out->n_entries, 3);
    assert_int_equal(out->entries_packed.len, 0);
    for (size_t i = 0; i < 3; i++) {
        const Kvd__CommitEntry *e = out->entries[i];
        assert_int_equal(e->block->id, 10 + i);
        assert_int_equal(e->block->gen, 7);
        assert_true(e->hash->lo == 100 + i && e->hash->hi == 200 + i);
        assert_int_equal(e->parent, i == 0 ? UINT32_MAX : 9 + i);
        assert_int_equal(e->hash_full.len, 32);
        assert_memory_equal(e->hash_full.data, full + 32 * i, 32);
        assert_int_equal(e->n_token_ids, TPB);
        assert_int_equal(e->token_ids[TPB - 1], 0x01020300u + i * TPB + TPB - 1);
        assert_int_equal(e->parent_hash_full.len, i == 0 ? 32 : 0);
    }
    /* Refusals, in field order; *out stays the request. */
    assert_int_equal(
        kvd_validate_commit_any(&c, 2, TPB, kv_arena_allocator(&a), &out, msg, sizeof(msg)),
        KV_ETOOBIG);
    assert_ptr_equal(out, &c);
    c.token_ids_packed.len = sizeof(tok) - 4;
    assert_int_equal(
        kvd_validate_commit_any(&c, 4, TPB, kv_arena_allocator(&a), &out, msg, sizeof(msg)),
        KV_EPROTO);
    assert_non_null(strstr(msg, "token_ids_packed"));
    c.token_ids_packed.len = sizeof(tok);
    c.hash_full_packed.len = 32;
    assert_int_equal(
        kvd_validate_commit_any(&c, 4, TPB, kv_arena_allocator(&a), &out, msg, sizeof(msg)),
        KV_EPROTO);
    c.hash_full_packed.len = sizeof(full);
    c.entries_packed.len = sizeof(ent) - 1;
    assert_int_equal(
        kvd_validate_commit_any(&c, 4, TPB, kv_arena_allocator(&a), &out, msg, sizeof(msg)),
        KV_EPROTO);
    c.entries_packed.len = 0; /* companions alone */
    assert_int_equal(
        kvd_validate_commit_any(&c, 4, TPB, kv_arena_allocator(&a), &out, msg, sizeof(msg)),
        KV_EPROTO);
    /* Both forms: EPROTO, unless the repeated entries are refused first (field 2). */
    Kvd__BlockRef b = KVD__BLOCK_REF__INIT;
    Kvd__Hash128 h = KVD__HASH128__INIT;
    Kvd__CommitEntry e = KVD__COMMIT_ENTRY__INIT, *es[1] = {&e};
    e.block = &b;
    e.hash = &h;
    c.entries_packed.len = sizeof(ent);
    c.entries = es;
    c.n_entries = 1;
    assert_int_equal(
        kvd_validate_commit_any(&c, 4, TPB, kv_arena_allocator(&a), &out, msg, sizeof(msg)),
        KV_EPROTO);
    e.hash = NULL;
    assert_int_equal(
        kvd_validate_commit_any(&c, 4, TPB, kv_arena_allocator(&a), &out, msg, sizeof(msg)),
        KV_EINVAL);
    kv_arena_fini(&a);
}

static void test_pin_and_ping(void **state) {
    (void)state;
    char msg[256];
    Kvd__BlockRef b = KVD__BLOCK_REF__INIT;
    Kvd__BlockRef *bs[1] = {&b};
    Kvd__Pin p = KVD__PIN__INIT;
    p.blocks = bs;
    p.n_blocks = 1;
    p.retention_ms = 1000;
    p.priority = 255;
    assert_int_equal(kvd_validate_pin(&p, 4, msg, sizeof(msg)), KV_OK);
    p.priority = 256;
    assert_int_equal(kvd_validate_pin(&p, 4, msg, sizeof(msg)), KV_EINVAL);
    p.priority = 0;
    p.retention_ms = KV_WIRE_MAX_RETENTION_MS + 1;
    assert_int_equal(kvd_validate_pin(&p, 4, msg, sizeof(msg)), KV_EINVAL);
    p.unpin = 1; /* retention and priority are ignored for unpin */
    assert_int_equal(kvd_validate_pin(&p, 4, msg, sizeof(msg)), KV_OK);

    Kvd__Ping pg = KVD__PING__INIT;
    pg.payload.len = 1000;
    assert_int_equal(kvd_validate_ping(&pg, 4096, msg, sizeof(msg)), KV_OK);
    pg.payload.len = 4096 - KV_WIRE_PING_SLACK + 1;
    assert_int_equal(kvd_validate_ping(&pg, 4096, msg, sizeof(msg)), KV_ETOOBIG);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_hello),        cmocka_unit_test(test_attach),
        cmocka_unit_test(test_lists),        cmocka_unit_test(test_commit_any),
        cmocka_unit_test(test_pin_and_ping),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
