/* Checks kv_wire's additions for the fast Lookup path: decoding into an arena, the packed list
 * helpers (byte layout of PROTOCOL.md, malformed lengths -> EPROTO), and that packed and
 * repeated lists survive a full encode/decode round trip. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "common/kv_arena.h"
#include "common/kv_wire.h"

static void test_packed_byte_layout(void **state) {
    (void)state;
    uint8_t h[2 * KV_WIRE_HASH_BYTES];
    kv_wire_hash_put(h, 0, 0x0123456789abcdefull, 0xfedcba9876543210ull);
    kv_wire_hash_put(h, 1, 1, 2);
    static const uint8_t want0[16] = {0xef, 0xcd, 0xab, 0x89, 0x67, 0x45, 0x23, 0x01,
                                      0x10, 0x32, 0x54, 0x76, 0x98, 0xba, 0xdc, 0xfe};
    assert_memory_equal(h, want0, 16);
    uint64_t lo, hi;
    kv_wire_hash_get(h, 0, &lo, &hi);
    assert_true(lo == 0x0123456789abcdefull && hi == 0xfedcba9876543210ull);
    kv_wire_hash_get(h, 1, &lo, &hi);
    assert_true(lo == 1 && hi == 2);

    uint8_t b[2 * KV_WIRE_BLOCK_BYTES];
    kv_wire_block_put(b, 0, 0x04030201u, 0x08070605u);
    kv_wire_block_put(b, 1, 0xffffffffu, 0);
    static const uint8_t wantb[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    assert_memory_equal(b, wantb, 8);
    uint32_t id, gen;
    kv_wire_block_get(b, 1, &id, &gen);
    assert_true(id == 0xffffffffu && gen == 0);

    /* A packed Commit entry: id, gen, hash lo, hash hi, parent, little-endian, no padding. */
    uint8_t c[2 * KV_WIRE_COMMIT_BYTES];
    kv_wire_commit e0 = {0x04030201u, 0x08070605u, 0x100f0e0d0c0b0a09ull, 0x1817161514131211ull,
                         0x1c1b1a19u};
    kv_wire_commit e1 = {7, 1, 2, 3, 0xffffffffu};
    kv_wire_commit_put(c, 0, &e0);
    kv_wire_commit_put(c, 1, &e1);
    for (int k = 0; k < KV_WIRE_COMMIT_BYTES; k++) {
        assert_int_equal(c[k], k + 1);
    }
    kv_wire_commit g = kv_wire_commit_get(c, 1);
    assert_true(g.id == 7 && g.gen == 1 && g.lo == 2 && g.hi == 3 && g.parent == 0xffffffffu);
    g = kv_wire_commit_get(c, 0);
    assert_true(g.id == e0.id && g.gen == e0.gen && g.lo == e0.lo && g.hi == e0.hi &&
                g.parent == e0.parent);
}

static void test_packed_counts(void **state) {
    (void)state;
    size_t n = 99;
    assert_int_equal(kv_wire_packed_count(0, 16, &n), KV_OK);
    assert_int_equal(n, 0);
    assert_int_equal(kv_wire_packed_count(2048, 16, &n), KV_OK);
    assert_int_equal(n, 128);
    n = 7;
    assert_int_equal(kv_wire_packed_count(2047, 16, &n), KV_EPROTO);
    assert_int_equal(kv_wire_packed_count(12, 8, &n), KV_EPROTO);
    assert_int_equal(n, 7); /* untouched on error */
    assert_int_equal(kv_wire_list_count(5, 0, 8, &n), KV_OK);
    assert_int_equal(n, 5);
    assert_int_equal(kv_wire_list_count(0, 24, 8, &n), KV_OK);
    assert_int_equal(n, 3);
    assert_int_equal(kv_wire_list_count(0, 0, 8, &n), KV_OK);
    assert_int_equal(n, 0);
    assert_int_equal(kv_wire_list_count(1, 8, 8, &n), KV_EPROTO); /* both forms */
    assert_int_equal(kv_wire_list_count(0, 9, 8, &n), KV_EPROTO);
}

/* Encodes a Lookup with n packed hashes, decodes it into arena a. */
static Kvd__Envelope *lookup_round_trip(kv_arena *a, size_t n, uint8_t **frame) {
    uint8_t *packed = malloc(n * KV_WIRE_HASH_BYTES + 1);
    for (size_t i = 0; i < n; i++) {
        kv_wire_hash_put(packed, i, i * 3 + 1, ~(uint64_t)i);
    }
    Kvd__Lookup lk = KVD__LOOKUP__INIT;
    lk.pool_id = 7;
    lk.hashes_packed.data = packed;
    lk.hashes_packed.len = n * KV_WIRE_HASH_BYTES;
    Kvd__Envelope env = KVD__ENVELOPE__INIT;
    env.id = 42;
    env.body_case = KVD__ENVELOPE__BODY_LOOKUP;
    env.lookup = &lk;
    size_t len;
    assert_int_equal(kv_wire_encode(&env, 4u << 20, frame, &len), KV_OK);
    free(packed);
    Kvd__Envelope *out = NULL;
    size_t used = 0;
    assert_int_equal(kv_wire_decode_with(*frame, len, 4u << 20, kv_arena_allocator(a), &out, &used),
                     KV_OK);
    assert_non_null(out);
    assert_int_equal(used, len);
    return out;
}

static void test_decode_into_arena(void **state) {
    (void)state;
    kv_arena a;
    kv_arena_init(&a);
    /* 128 hashes fit the first block; 100000 (1.6 MB) spill, then the block grows. */
    size_t sizes[] = {128, 100000, 100000, 3};
    for (size_t k = 0; k < sizeof(sizes) / sizeof(sizes[0]); k++) {
        uint8_t *frame;
        Kvd__Envelope *e = lookup_round_trip(&a, sizes[k], &frame);
        assert_int_equal(e->id, 42);
        assert_int_equal(e->body_case, KVD__ENVELOPE__BODY_LOOKUP);
        assert_int_equal(e->lookup->n_hashes, 0);
        size_t n;
        assert_int_equal(kv_wire_list_count(e->lookup->n_hashes, e->lookup->hashes_packed.len,
                                            KV_WIRE_HASH_BYTES, &n),
                         KV_OK);
        assert_int_equal(n, sizes[k]);
        for (size_t i = 0; i < n; i++) {
            uint64_t lo, hi;
            kv_wire_hash_get(e->lookup->hashes_packed.data, i, &lo, &hi);
            assert_true(lo == i * 3 + 1 && hi == ~(uint64_t)i);
        }
        if (k == 1) {
            assert_true(a.nspill > 0);
        }
        if (k == 2) {
            assert_int_equal(a.nspill, 0); /* the block grew at the reset after k == 1 */
        }
        kv_arena_reset(&a);
        free(frame);
    }
    kv_arena_fini(&a);
    kv_arena_fini(NULL);
}

static void test_decode_with_null_allocator(void **state) {
    (void)state;
    Kvd__BlockRef r[3], *rp[3];
    for (int i = 0; i < 3; i++) {
        kvd__block_ref__init(&r[i]);
        r[i].id = (uint32_t)i;
        r[i].gen = 9;
        rp[i] = &r[i];
    }
    Kvd__Release rel = KVD__RELEASE__INIT;
    rel.n_blocks = 3;
    rel.blocks = rp;
    Kvd__Envelope env = KVD__ENVELOPE__INIT;
    env.body_case = KVD__ENVELOPE__BODY_RELEASE;
    env.release = &rel;
    uint8_t *frame;
    size_t len;
    assert_int_equal(kv_wire_encode(&env, KV_WIRE_DEFAULT_MAX_FRAME, &frame, &len), KV_OK);
    Kvd__Envelope *out = NULL;
    size_t used = 0;
    /* Not whole yet: no message, nothing consumed. */
    assert_int_equal(kv_wire_decode_with(frame, len - 1, 1024, NULL, &out, &used), KV_OK);
    assert_null(out);
    assert_int_equal(kv_wire_decode_with(frame, len, 1024, NULL, &out, &used), KV_OK);
    assert_non_null(out);
    size_t n;
    assert_int_equal(kv_wire_list_count(out->release->n_blocks, out->release->blocks_packed.len,
                                        KV_WIRE_BLOCK_BYTES, &n),
                     KV_OK);
    assert_int_equal(n, 3);
    assert_int_equal(out->release->blocks[2]->id, 2);
    kv_wire_free_with(out, NULL);
    /* A frame too long for max_frame. */
    assert_int_equal(kv_wire_decode_with(frame, len, 4, NULL, &out, &used), KV_ETOOBIG);
    free(frame);
}

/* Decodes one hand-made request body; returns the code and the id it reports. */
static kv_err decode_body_at(const uint8_t *body, size_t n, uint64_t epoch, uint64_t *id,
                             char *why) {
    uint8_t frame[64];
    assert_true(n + 4 <= sizeof(frame));
    frame[0] = (uint8_t)n;
    frame[1] = frame[2] = frame[3] = 0;
    memcpy(frame + 4, body, n);
    Kvd__Envelope *env = NULL;
    size_t used = 0;
    kv_err rc = kv_wire_decode_request(frame, n + 4, 4096, epoch, NULL, &env, &used, id, why, 256);
    assert_int_equal(used, n + 4); /* accepted or skipped, the frame is consumed */
    if (rc == KV_OK) {
        assert_non_null(env);
        kv_wire_free(env);
    } else {
        assert_null(env);
    }
    return rc;
}

static kv_err decode_body(const uint8_t *body, size_t n, uint64_t *id, char *why) {
    return decode_body_at(body, n, 0, id, why);
}

/* The request decoder refuses strings protobuf-c would cut or pass on: a NUL byte inside
 * AttachPool.model_id ("m\0x" and "m" were one pool), bytes that are not UTF-8; it answers a
 * body type it does not know with ENOTSUP and the request's id (a newer client), and an envelope
 * without any body with EPROTO. */
static void test_request_decoder(void **state) {
    (void)state;
    char why[256];
    uint64_t id = 0;
    /* Envelope{id 5, attach_pool{model_id "m\0x"}} */
    const uint8_t nul[] = {0x08, 0x05, 0x62, 0x05, 0x0a, 0x03, 'm', 0x00, 'x'};
    assert_int_equal(decode_body(nul, sizeof(nul), &id, why), KV_EINVAL);
    assert_int_equal(id, 5);
    assert_non_null(strstr(why, "AttachPool.model_id"));
    const uint8_t ok[] = {0x08, 0x05, 0x62, 0x05, 0x0a, 0x03, 'm', 'y', 'x'};
    assert_int_equal(decode_body(ok, sizeof(ok), &id, why), KV_OK);
    /* Envelope{id 6, hello{client_name "\xff"}} */
    const uint8_t bad[] = {0x08, 0x06, 0x52, 0x03, 0x12, 0x01, 0xff};
    assert_int_equal(decode_body(bad, sizeof(bad), &id, why), KV_EINVAL);
    assert_int_equal(id, 6);
    assert_non_null(strstr(why, "Hello.client_name"));
    /* Envelope{id 7, field 99 (a future request) empty} */
    const uint8_t future[] = {0x08, 0x07, 0x9a, 0x06, 0x00};
    assert_int_equal(decode_body(future, sizeof(future), &id, why), KV_ENOTSUP);
    assert_int_equal(id, 7);
    /* Envelope{id 8} and nothing else. */
    const uint8_t empty[] = {0x08, 0x08};
    assert_int_equal(decode_body(empty, sizeof(empty), &id, why), KV_EPROTO);
    assert_int_equal(id, 8);
    /* Not protobuf at all: id 0. */
    const uint8_t junk[] = {0xff, 0xff, 0xff};
    assert_int_equal(decode_body(junk, sizeof(junk), &id, why), KV_EPROTO);
    assert_int_equal(id, 0);
    /* A request for another boot epoch is EEPOCH before any other fault (PROTOCOL.md §4): no
     * body, an unknown body, a bad string. Envelope{id 9, boot_epoch 5, ...}. */
    const uint8_t e_empty[] = {0x08, 0x09, 0x11, 5, 0, 0, 0, 0, 0, 0, 0};
    const uint8_t e_future[] = {0x08, 0x09, 0x11, 5, 0, 0, 0, 0, 0, 0, 0, 0x9a, 0x06, 0x00};
    const uint8_t e_nul[] = {0x08, 0x09, 0x11, 5,    0,    0,    0,   0, 0,
                             0,    0,    0x62, 0x05, 0x0a, 0x03, 'm', 0, 'x'};
    assert_int_equal(decode_body_at(e_empty, sizeof(e_empty), 7, &id, why), KV_EEPOCH);
    assert_int_equal(id, 9);
    assert_non_null(strstr(why, "boot epoch 0000000000000005"));
    assert_int_equal(decode_body_at(e_future, sizeof(e_future), 7, &id, why), KV_EEPOCH);
    assert_int_equal(decode_body_at(e_nul, sizeof(e_nul), 7, &id, why), KV_EEPOCH);
    /* The right epoch: the other checks apply. */
    assert_int_equal(decode_body_at(e_empty, sizeof(e_empty), 5, &id, why), KV_EPROTO);
    assert_int_equal(decode_body_at(e_nul, sizeof(e_nul), 5, &id, why), KV_EINVAL);
    /* UTF-8 edges. */
    assert_int_equal(kv_utf8_prefix("caf\xc3\xa9", 5), 5);
    assert_int_equal(kv_utf8_prefix("\xc0\xaf", 2), 0);         /* overlong */
    assert_int_equal(kv_utf8_prefix("a\xed\xa0\x80", 4), 1);    /* surrogate */
    assert_int_equal(kv_utf8_prefix("\xf4\x90\x80\x80", 4), 0); /* above U+10FFFF */
    assert_int_equal(kv_utf8_prefix("ab\xe2\x9c", 4), 2);       /* cut short */
}

/* Ping and Pong are packed, measured and unpacked by hand (kv_wire.c): the bytes equal
 * protobuf-c's for every nonce and payload length at the varint edges, and the decoder gives
 * protobuf-c's message (or falls back to it) for every frame and 200000 mutations of them. */
static uint64_t rnd_state = 0x9E3779B97F4A7C15ull;
static uint64_t rnd(void) {
    rnd_state ^= rnd_state << 13;
    rnd_state ^= rnd_state >> 7;
    rnd_state ^= rnd_state << 17;
    return rnd_state;
}

/* The envelope's re-packed bytes (malloc'd) and their length. */
static uint8_t *repack(const Kvd__Envelope *e, size_t *n) {
    *n = kvd__envelope__get_packed_size(e);
    uint8_t *b = malloc(*n + 1);
    assert_non_null(b);
    assert_int_equal(kvd__envelope__pack(e, b), *n);
    return b;
}

/* Decodes body[0..n) (an envelope's bytes) both ways and checks they agree. */
static void check_decoders_agree(const uint8_t *body, size_t n) {
    uint8_t *frame = malloc(n + 4);
    assert_non_null(frame);
    frame[0] = (uint8_t)n;
    frame[1] = (uint8_t)(n >> 8);
    frame[2] = frame[3] = 0;
    memcpy(frame + 4, body, n);
    Kvd__Envelope *fast = NULL;
    size_t used = 0;
    kv_err rc = kv_wire_decode_with(frame, n + 4, 1 << 20, NULL, &fast, &used);
    Kvd__Envelope *slow = kvd__envelope__unpack(NULL, n, body);
    /* What kv_wire accepts, protobuf-c accepts as the same message (kv_wire refuses more: an
     * envelope without a body or with unknown fields). */
    assert_true(fast == NULL || slow != NULL);
    assert_true(fast != NULL || rc != KV_OK || slow == NULL);
    if (fast != NULL) {
        size_t a, b;
        uint8_t *pa = repack(fast, &a), *pb = repack(slow, &b);
        assert_int_equal(a, b);
        assert_memory_equal(pa, pb, a);
        free(pa);
        free(pb);
        kv_wire_free(fast);
    }
    if (slow != NULL) {
        kvd__envelope__free_unpacked(slow, NULL);
    }
    free(frame);
}

static void test_ping_by_hand(void **state) {
    (void)state;
    assert_int_equal(offsetof(Kvd__Ping, nonce), offsetof(Kvd__Pong, nonce));
    assert_int_equal(offsetof(Kvd__Ping, payload), offsetof(Kvd__Pong, payload));
    assert_int_equal(sizeof(Kvd__Ping), sizeof(Kvd__Pong));
    const uint64_t nonces[] = {0, 1, 127, 128, 16383, 16384, 1ull << 32, UINT64_MAX};
    const size_t lens[] = {0, 1, 127, 128, 300};
    uint8_t pay[300];
    for (size_t i = 0; i < sizeof(pay); i++) {
        pay[i] = (uint8_t)(i * 7 + 1);
    }
    size_t checked = 0;
    for (int pong = 0; pong < 2; pong++) {
        for (size_t a = 0; a < sizeof(nonces) / sizeof(nonces[0]); a++) {
            for (size_t b = 0; b < sizeof(lens) / sizeof(lens[0]); b++) {
                Kvd__Ping pi = KVD__PING__INIT;
                Kvd__Pong po = KVD__PONG__INIT;
                pi.nonce = po.nonce = nonces[a];
                pi.payload.len = po.payload.len = lens[b];
                pi.payload.data = po.payload.data = pay;
                Kvd__Envelope env = KVD__ENVELOPE__INIT;
                env.id = 1 + a * 1000;
                env.boot_epoch = b % 2 ? 0x0102030405060708ull : 0;
                if (pong) {
                    env.body_case = KVD__ENVELOPE__BODY_PONG;
                    env.pong = &po;
                } else {
                    env.body_case = KVD__ENVELOPE__BODY_PING;
                    env.ping = &pi;
                }
                size_t want;
                uint8_t *ref = repack(&env, &want);
                uint8_t buf[512];
                assert_int_equal(kv_wire_frame_size(&env), want + 4);
                assert_int_equal(kv_wire_encode_into(&env, buf), want + 4);
                assert_memory_equal(buf + 4, ref, want);
                check_decoders_agree(ref, want);
                /* Mutations: a byte changed, dropped or added, the end cut. */
                for (int k = 0; k < 2500; k++) {
                    uint8_t mut[520];
                    size_t n = want;
                    memcpy(mut, ref, n);
                    switch (rnd() % 4) {
                        case 0:
                            if (n > 0) {
                                mut[rnd() % n] = (uint8_t)rnd();
                            }
                            break;
                        case 1:
                            if (n > 0) {
                                size_t at = rnd() % n;
                                memmove(mut + at, mut + at + 1, n - at - 1);
                                n--;
                            }
                            break;
                        case 2: {
                            size_t at = rnd() % (n + 1);
                            memmove(mut + at + 1, mut + at, n - at);
                            mut[at] = (uint8_t)rnd();
                            n++;
                            break;
                        }
                        default:
                            n = n > 0 ? rnd() % n : 0;
                            break;
                    }
                    check_decoders_agree(mut, n);
                    checked++;
                }
                free(ref);
            }
        }
    }
    assert_int_equal(checked, 200000);
    /* Varints at protobuf-c's edges, in an Envelope{id 1, ping{...}}: a nonce of 10 bytes whose
     * last has high bits; payload lengths padded to 5, 6 and 10 bytes. */
    const uint8_t edges[][24] = {
        /* (ping is field 28) */
        {0x08, 0x01, 0xe2, 0x01, 11, 0x08, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
         0x7f},
        {0x08, 0x01, 0xe2, 0x01, 7, 0x12, 0x81, 0x80, 0x80, 0x80, 0x00, 'x'},
        {0x08, 0x01, 0xe2, 0x01, 8, 0x12, 0x81, 0x80, 0x80, 0x80, 0x80, 0x00, 'x'},
        {0x08, 0x01, 0xe2, 0x01, 12, 0x12, 0x81, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x80,
         0x00, 'x'},
        {0x08, 0x01, 0xe2, 0x01, 7, 0x12, 0x81, 0x80, 0x80, 0x80, 0x10, 'x'},
    };
    const size_t elen[] = {16, 12, 13, 17, 12};
    for (size_t k = 0; k < sizeof(elen) / sizeof(elen[0]); k++) {
        check_decoders_agree(edges[k], elen[k]);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_packed_byte_layout),
        cmocka_unit_test(test_packed_counts),
        cmocka_unit_test(test_decode_into_arena),
        cmocka_unit_test(test_decode_with_null_allocator),
        cmocka_unit_test(test_request_decoder),
        cmocka_unit_test(test_ping_by_hand),
    };
    return cmocka_run_group_tests_name("kv_wire", tests, NULL, NULL);
}
