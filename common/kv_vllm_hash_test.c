/* Checks vLLM mode against the vectors of docs/HASH.md ("vLLM mode"), which were computed with
 * the independent Python reference tests/vllm/vllm_hash_ref.py (cbor2 + hashlib); the same hex
 * is pinned in tests/vllm/test_vllm_hash_ref.py so the two cannot drift apart. Blocks beyond the
 * vectors are checked against a CBOR encoder written out here by hand (not libcbor). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>
#include <sha2.h>

#include "common/kv_vllm_hash.h"

/* Vectors (tests/vllm/vllm_hash_ref.py prints them). */
#define N0_HEX "4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e"
#define N1_HEX "dfa66c9da4dad0601316e0b63a2909b4068e72830385ddbd16e0c980c76c9e12"
#define C0_HEX "202da172482d928bbc42ab25b0151e2b895f13f41002e27b2ceabcfae6d332ea"
#define C1_HEX "4a0a393805c6d2f0ed831000d41bb65980336c4c04895d5e26470bbec927f5bf"
#define E1_HEX "299bba42a4abf75c4002c66cf42b9bff3bdcf5452cdc6826e01a1ca3ec1218ea"
#define E2_HEX "7c8449dc50d644bae8a0f8a1f60e3ca033cc3c923fab2cd1cece5b1e27f0fce9"
#define E3_HEX "5d346543b40b63ce19d23c35f4c212d0caf9d23b954e1b5aead9f5289fa795fb"
#define E4_HEX "2a2bf3872739de2df68837a677fd9b69b4f15070f743b0c5e3b5e103a83a4f31"
#define W1_HEX "e67563b12b7a302bb7911742d9726f71223631f0750a3abe1bf5d64a1bc94f21"
#define W2_HEX "39532d759036eca7efd7a6e039e216836a50436ef6b04f2f261c9e2f453fb3ec"
#define X1_HEX "162f742a0a76cfe60ad43f8a53bf42366139d1895b1f6eb1bff16ed00b25de27"
#define L1_HEX "3f6ccd25fb997691ca4a0827cca6734935e587296ec13d126579131f51ebaee9"

/* The 55 CBOR bytes of vector X1 (docs/HASH.md walks through them). */
#define X1_INPUT_HEX "835820" N0_HEX "840118181903e81a0001117081666c6f72612d61"

static void hex_bytes(const char *hex, uint8_t *out, size_t n) {
    assert_int_equal(strlen(hex), 2 * n);
    for (size_t i = 0; i < n; i++) {
        unsigned v = 0;
        assert_int_equal(sscanf(hex + 2 * i, "%2x", &v), 1);
        out[i] = (uint8_t)v;
    }
}

static void to_hex(const uint8_t *h, char buf[2 * KV_VLLM_HASH_BYTES + 1]) {
    for (int i = 0; i < KV_VLLM_HASH_BYTES; i++) {
        snprintf(buf + 2 * i, 3, "%02x", h[i]);
    }
}

static void assert_digest(const uint8_t *got, const char *want_hex) {
    char hex[2 * KV_VLLM_HASH_BYTES + 1];
    to_hex(got, hex);
    if (strcmp(hex, want_hex) != 0) {
        print_message("vector mismatch: got %s want %s\n", hex, want_hex);
    }
    assert_string_equal(hex, want_hex);
}

static void fill_seq(uint32_t *t, size_t n, uint32_t first) {
    for (size_t i = 0; i < n; i++) {
        t[i] = first + (uint32_t)i;
    }
}

static void none0(uint8_t out[KV_VLLM_HASH_BYTES]) {
    assert_int_equal(kv_vllm_none_hash("0", 1, out), KV_OK);
}

static void sha256(const uint8_t *buf, size_t len, uint8_t out[KV_VLLM_HASH_BYTES]) {
    SHA2_CTX ctx;
    SHA256Init(&ctx);
    SHA256Update(&ctx, buf, len);
    SHA256Final(out, &ctx);
}

/* The spec written out by hand: a CBOR head of major type `major` for value v, shortest form. */
static size_t ref_head(uint8_t *buf, size_t at, unsigned major, uint64_t v) {
    int n;
    if (v < 24) {
        buf[at++] = (uint8_t)(major << 5 | v);
        return at;
    } else if (v < 0x100) {
        buf[at++] = (uint8_t)(major << 5 | 24);
        n = 1;
    } else if (v < 0x10000) {
        buf[at++] = (uint8_t)(major << 5 | 25);
        n = 2;
    } else if (v < 0x100000000ull) {
        buf[at++] = (uint8_t)(major << 5 | 26);
        n = 4;
    } else {
        buf[at++] = (uint8_t)(major << 5 | 27);
        n = 8;
    }
    for (int i = n - 1; i >= 0; i--) {
        buf[at++] = (uint8_t)(v >> (8 * i));
    }
    return at;
}

static void ref_block(const uint8_t *parent, const uint32_t *tokens, size_t ntokens,
                      const char *const *keys, size_t nkeys, uint8_t out[KV_VLLM_HASH_BYTES]) {
    static uint8_t buf[1 << 16];
    size_t at = ref_head(buf, 0, 4, 3);
    at = ref_head(buf, at, 2, KV_VLLM_HASH_BYTES);
    memcpy(buf + at, parent, KV_VLLM_HASH_BYTES);
    at += KV_VLLM_HASH_BYTES;
    at = ref_head(buf, at, 4, ntokens);
    for (size_t i = 0; i < ntokens; i++) {
        at = ref_head(buf, at, 0, tokens[i]);
    }
    if (nkeys == 0) {
        buf[at++] = 0xf6;
    } else {
        at = ref_head(buf, at, 4, nkeys);
        for (size_t i = 0; i < nkeys; i++) {
            size_t len = strlen(keys[i]);
            at = ref_head(buf, at, 3, len);
            memcpy(buf + at, keys[i], len);
            at += len;
        }
    }
    sha256(buf, at, out);
}

static void test_none_hash(void **state) {
    (void)state;
    uint8_t h[KV_VLLM_HASH_BYTES];
    none0(h);
    assert_digest(h, N0_HEX);
    static const uint8_t cbor0[2] = {0x61, 0x30}; /* text(1) "0" */
    uint8_t ref[KV_VLLM_HASH_BYTES];
    sha256(cbor0, sizeof(cbor0), ref);
    assert_memory_equal(h, ref, KV_VLLM_HASH_BYTES);
    assert_int_equal(kv_vllm_none_hash("1234", 4, h), KV_OK);
    assert_digest(h, N1_HEX);
    /* The empty seed is text(0), the single byte 0x60. */
    assert_int_equal(kv_vllm_none_hash(NULL, 0, h), KV_OK);
    assert_digest(h, "8d33f520a3c4cef80d2453aef81b612bfe1cb44c8b2025630ad38662763f13d3");
    /* The longest seed (4096 bytes: a 3-byte head) matches the hand encoding. */
    static char seed[KV_VLLM_MAX_SEED_BYTES];
    memset(seed, '7', sizeof(seed));
    static uint8_t enc[KV_VLLM_MAX_SEED_BYTES + 3];
    size_t at = ref_head(enc, 0, 3, sizeof(seed));
    assert_int_equal(at, 3);
    memcpy(enc + at, seed, sizeof(seed));
    sha256(enc, at + sizeof(seed), ref);
    assert_int_equal(kv_vllm_none_hash(seed, sizeof(seed), h), KV_OK);
    assert_memory_equal(h, ref, KV_VLLM_HASH_BYTES);
}

/* Tokens 1..32 with seed "0", 16 per block: digests, published u64 forms, index keys. */
static void test_chain_seed0(void **state) {
    (void)state;
    uint8_t none[KV_VLLM_HASH_BYTES];
    none0(none);
    uint32_t t[40];
    fill_seq(t, 40, 1);
    uint8_t out[4][KV_VLLM_HASH_BYTES];
    size_t n = 99;
    assert_int_equal(kv_vllm_hash_chain(none, t, 32, 16, NULL, 0, out, 4, &n), KV_OK);
    assert_int_equal(n, 2);
    assert_digest(out[0], C0_HEX);
    assert_digest(out[1], C1_HEX);
    assert_true(kv_vllm_hash_u64(out[0]) == 3236607068019569386ull);
    assert_true(kv_vllm_hash_u64(out[1]) == 2758186210834249151ull);
    assert_true(kv_vllm_hash_u64(none) == 17921330210090130494ull);

    /* The same blocks one at a time; out aliasing parent is allowed. */
    uint8_t h[KV_VLLM_HASH_BYTES];
    memcpy(h, none, sizeof(h));
    assert_int_equal(kv_vllm_hash_block(h, t, 16, NULL, 0, h), KV_OK);
    assert_digest(h, C0_HEX);
    assert_int_equal(kv_vllm_hash_block(h, t + 16, 16, NULL, 0, h), KV_OK);
    assert_digest(h, C1_HEX);

    /* A partial last block is not hashed. */
    n = 99;
    assert_int_equal(kv_vllm_hash_chain(none, t, 40, 16, NULL, 0, out, 4, &n), KV_OK);
    assert_int_equal(n, 2);
    assert_digest(out[1], C1_HEX);

    /* kvd's index key is the first 16 bytes: kv_hash_hex prints the digest's first 32 digits. */
    kv_hash128 k = kv_vllm_hash_key(out[0]);
    assert_true(k.lo == 0x8b922d4872a12d20ull);
    assert_true(k.hi == 0x2b1e15b025ab42bcull);
    char khex[33];
    kv_hash_hex(k, khex);
    assert_memory_equal(khex, C0_HEX, 32);
}

static void test_extra_keys(void **state) {
    (void)state;
    uint8_t none[KV_VLLM_HASH_BYTES], h[KV_VLLM_HASH_BYTES];
    none0(none);
    uint32_t t[16];
    fill_seq(t, 16, 1);
    const char *one[] = {"lora-a"};
    assert_int_equal(kv_vllm_hash_block(none, t, 16, one, 1, h), KV_OK);
    assert_digest(h, E1_HEX);
    const char *two[] = {"lora-a", "salt"};
    assert_int_equal(kv_vllm_hash_block(none, t, 16, two, 2, h), KV_OK);
    assert_digest(h, E2_HEX);
    /* Text heads count bytes, not characters: "café-ü" is 6 characters, 8 bytes of UTF-8. */
    const char *utf8[] = {"caf\xc3\xa9-\xc3\xbc"};
    assert_int_equal(kv_vllm_hash_block(none, t, 16, utf8, 1, h), KV_OK);
    assert_digest(h, E3_HEX);
    /* The most keys, each the longest (its 3-byte head); their bound takes the heap path. */
    static char big[KV_VLLM_MAX_EXTRA_KEYS][KV_VLLM_MAX_KEY_BYTES + 1];
    const char *keys[KV_VLLM_MAX_EXTRA_KEYS];
    for (int i = 0; i < KV_VLLM_MAX_EXTRA_KEYS; i++) {
        memset(big[i], 'a' + i, KV_VLLM_MAX_KEY_BYTES);
        big[i][KV_VLLM_MAX_KEY_BYTES] = '\0';
        keys[i] = big[i];
    }
    assert_int_equal(kv_vllm_hash_block(none, t, 16, keys, KV_VLLM_MAX_EXTRA_KEYS, h), KV_OK);
    assert_digest(h, E4_HEX);

    /* A chain with keys puts them on every block. */
    uint8_t out[2][KV_VLLM_HASH_BYTES];
    size_t n = 0;
    assert_int_equal(kv_vllm_hash_chain(none, t, 16, 16, one, 1, out, 2, &n), KV_OK);
    assert_int_equal(n, 1);
    assert_digest(out[0], E1_HEX);
}

/* Token ids whose heads take 1, 2, 3 and 5 bytes (uint32 never needs the 9-byte head). */
static void test_wide_tokens(void **state) {
    (void)state;
    uint8_t none[KV_VLLM_HASH_BYTES], h[KV_VLLM_HASH_BYTES];
    none0(none);
    static const uint32_t w1[] = {70000, 4294967295u, 23, 24};
    assert_int_equal(kv_vllm_hash_block(none, w1, 4, NULL, 0, h), KV_OK);
    assert_digest(h, W1_HEX);
    static const uint32_t w2[] = {0, 23, 24, 255, 256, 65535, 65536, 4294967295u};
    assert_int_equal(kv_vllm_hash_block(none, w2, 8, NULL, 0, h), KV_OK);
    assert_digest(h, W2_HEX);
}

/* Vector X1: the documented input bytes hash to the vector, and so does the code. */
static void test_example_bytes(void **state) {
    (void)state;
    uint8_t input[55], h[KV_VLLM_HASH_BYTES];
    hex_bytes(X1_INPUT_HEX, input, sizeof(input));
    sha256(input, sizeof(input), h);
    assert_digest(h, X1_HEX);
    uint8_t none[KV_VLLM_HASH_BYTES];
    none0(none);
    static const uint32_t t[] = {1, 24, 1000, 70000};
    const char *keys[] = {"lora-a"};
    assert_int_equal(kv_vllm_hash_block(none, t, 4, keys, 1, h), KV_OK);
    assert_digest(h, X1_HEX);
}

/* 300 tokens of 5 bytes each: 1,539 bytes of CBOR, more than the 1 KiB stack buffer. */
static void test_large_block_heap_path(void **state) {
    (void)state;
    uint8_t none[KV_VLLM_HASH_BYTES], h[KV_VLLM_HASH_BYTES];
    none0(none);
    static uint32_t t[300];
    fill_seq(t, 300, 100000);
    assert_int_equal(kv_vllm_hash_block(none, t, 300, NULL, 0, h), KV_OK);
    assert_digest(h, L1_HEX);
    uint8_t out[1][KV_VLLM_HASH_BYTES];
    size_t n = 0;
    assert_int_equal(kv_vllm_hash_chain(none, t, 300, 300, NULL, 0, out, 1, &n), KV_OK);
    assert_int_equal(n, 1);
    assert_digest(out[0], L1_HEX);
}

/* Many blocks of mixed widths and sizes (stack and heap, with and without keys) against the
 * hand-written encoder. */
static void test_matches_hand_encoder(void **state) {
    (void)state;
    static uint32_t t[2000];
    uint64_t x = 0x9e3779b97f4a7c15ull;
    for (size_t i = 0; i < 2000; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        unsigned shift = (unsigned)(x % 33); /* spread over every head width */
        t[i] = shift == 32 ? (uint32_t)(x >> 32) : (uint32_t)((x >> 32) >> shift);
    }
    const char *keys[] = {"lora-7", "", "mm:0123abcd", "salt-\xe2\x82\xac", "k"};
    static const size_t sizes[] = {0, 1, 15, 16, 17, 23, 24, 25, 128, 129, 255, 256, 1000, 2000};
    uint8_t parent[KV_VLLM_HASH_BYTES];
    none0(parent);
    for (size_t s = 0; s < sizeof(sizes) / sizeof(sizes[0]); s++) {
        for (size_t nk = 0; nk <= 5; nk++) {
            uint8_t got[KV_VLLM_HASH_BYTES], want[KV_VLLM_HASH_BYTES];
            assert_int_equal(kv_vllm_hash_block(parent, t, sizes[s], keys, nk, got), KV_OK);
            ref_block(parent, t, sizes[s], keys, nk, want);
            assert_memory_equal(got, want, KV_VLLM_HASH_BYTES);
            memcpy(parent, got, sizeof(parent));
        }
    }
}

static void test_chain_respects_max_out(void **state) {
    (void)state;
    uint8_t none[KV_VLLM_HASH_BYTES];
    none0(none);
    uint32_t t[64];
    fill_seq(t, 64, 1);
    uint8_t out[4][KV_VLLM_HASH_BYTES];
    memset(out, 0xee, sizeof(out));
    size_t n = 0;
    assert_int_equal(kv_vllm_hash_chain(none, t, 64, 16, NULL, 0, out, 2, &n), KV_OK);
    assert_int_equal(n, 2);
    assert_digest(out[1], C1_HEX);
    for (int i = 0; i < KV_VLLM_HASH_BYTES; i++) {
        assert_int_equal(out[2][i], 0xee);
        assert_int_equal(out[3][i], 0xee);
    }
    n = 99;
    assert_int_equal(kv_vllm_hash_chain(none, t, 64, 16, NULL, 0, NULL, 0, &n), KV_OK);
    assert_int_equal(n, 0);
    n = 99;
    assert_int_equal(kv_vllm_hash_chain(none, NULL, 0, 16, NULL, 0, out, 4, &n), KV_OK);
    assert_int_equal(n, 0);
}

static void test_u64_and_key_byte_order(void **state) {
    (void)state;
    uint8_t h[KV_VLLM_HASH_BYTES];
    for (int i = 0; i < KV_VLLM_HASH_BYTES; i++) {
        h[i] = (uint8_t)i;
    }
    assert_true(kv_vllm_hash_u64(h) == 0x18191a1b1c1d1e1full);
    kv_hash128 k = kv_vllm_hash_key(h);
    assert_true(k.lo == 0x0706050403020100ull);
    assert_true(k.hi == 0x0f0e0d0c0b0a0908ull);
}

static void test_bad_arguments(void **state) {
    (void)state;
    uint8_t none[KV_VLLM_HASH_BYTES], h[KV_VLLM_HASH_BYTES];
    none0(none);
    uint32_t t[16];
    fill_seq(t, 16, 1);
    uint8_t out[1][KV_VLLM_HASH_BYTES];
    size_t n = 77;
    static char seed[KV_VLLM_MAX_SEED_BYTES + 1];
    memset(seed, '1', sizeof(seed));
    char longkey[KV_VLLM_MAX_KEY_BYTES + 2];
    memset(longkey, 'x', sizeof(longkey) - 1);
    longkey[sizeof(longkey) - 1] = '\0';
    const char *toolong[] = {longkey};
    const char *nullkey[] = {"a", NULL};
    const char *nine[] = {"1", "2", "3", "4", "5", "6", "7", "8", "9"};
    const char *badutf8[][1] = {
        {"\xff"}, {"\xc0\xaf"}, {"\xed\xa0\x80"}, {"\xf4\x90\x80\x80"}, {"ab\xe2\x82"}};

    memset(h, 0x5a, sizeof(h));
    assert_int_equal(kv_vllm_none_hash(NULL, 1, h), KV_EINVAL);
    assert_int_equal(kv_vllm_none_hash(seed, sizeof(seed), h), KV_EINVAL);
    assert_int_equal(kv_vllm_none_hash("\xff", 1, h), KV_EINVAL);
    assert_int_equal(kv_vllm_none_hash("0", 1, NULL), KV_EINVAL);
    assert_int_equal(kv_vllm_none_hash(seed, KV_VLLM_MAX_SEED_BYTES, h), KV_OK);

    memset(h, 0x5a, sizeof(h));
    assert_int_equal(kv_vllm_hash_block(NULL, t, 16, NULL, 0, h), KV_EINVAL);
    assert_int_equal(kv_vllm_hash_block(none, t, 16, NULL, 0, NULL), KV_EINVAL);
    assert_int_equal(kv_vllm_hash_block(none, NULL, 16, NULL, 0, h), KV_EINVAL);
    assert_int_equal(kv_vllm_hash_block(none, t, 16, NULL, 1, h), KV_EINVAL);
    assert_int_equal(kv_vllm_hash_block(none, t, 16, nullkey, 2, h), KV_EINVAL);
    assert_int_equal(kv_vllm_hash_block(none, t, 16, toolong, 1, h), KV_EINVAL);
    assert_int_equal(kv_vllm_hash_block(none, t, 16, nine, 9, h), KV_EINVAL);
    for (size_t i = 0; i < sizeof(badutf8) / sizeof(badutf8[0]); i++) {
        assert_int_equal(kv_vllm_hash_block(none, t, 16, badutf8[i], 1, h), KV_EINVAL);
    }
    for (int i = 0; i < KV_VLLM_HASH_BYTES; i++) {
        assert_int_equal(h[i], 0x5a); /* out-param untouched on error */
    }
    /* The limits themselves are accepted: 256-byte key, 8 keys, the 4-byte U+10FFFF. */
    longkey[KV_VLLM_MAX_KEY_BYTES] = '\0';
    assert_int_equal(kv_vllm_hash_block(none, t, 16, toolong, 1, h), KV_OK);
    assert_int_equal(kv_vllm_hash_block(none, t, 16, nine, 8, h), KV_OK);
    const char *maxcp[] = {"\xf4\x8f\xbf\xbf"};
    assert_int_equal(kv_vllm_hash_block(none, t, 16, maxcp, 1, h), KV_OK);
    longkey[KV_VLLM_MAX_KEY_BYTES] = 'x';

    memset(out, 0x5a, sizeof(out));
    assert_int_equal(kv_vllm_hash_chain(NULL, t, 16, 16, NULL, 0, out, 1, &n), KV_EINVAL);
    assert_int_equal(kv_vllm_hash_chain(none, t, 16, 0, NULL, 0, out, 1, &n), KV_EINVAL);
    assert_int_equal(kv_vllm_hash_chain(none, t, 16, 16, NULL, 0, NULL, 1, &n), KV_EINVAL);
    assert_int_equal(kv_vllm_hash_chain(none, t, 16, 16, NULL, 0, out, 1, NULL), KV_EINVAL);
    assert_int_equal(kv_vllm_hash_chain(none, NULL, 16, 16, NULL, 0, out, 1, &n), KV_EINVAL);
    assert_int_equal(kv_vllm_hash_chain(none, t, 16, 16, toolong, 1, out, 1, &n), KV_EINVAL);
    assert_int_equal(kv_vllm_hash_chain(none, t, 16, 16, nine, 9, out, 1, &n), KV_EINVAL);
    assert_int_equal(n, 77);
    for (int i = 0; i < KV_VLLM_HASH_BYTES; i++) {
        assert_int_equal(out[0][i], 0x5a);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_none_hash),
        cmocka_unit_test(test_chain_seed0),
        cmocka_unit_test(test_extra_keys),
        cmocka_unit_test(test_wide_tokens),
        cmocka_unit_test(test_example_bytes),
        cmocka_unit_test(test_large_block_heap_path),
        cmocka_unit_test(test_matches_hand_encoder),
        cmocka_unit_test(test_chain_respects_max_out),
        cmocka_unit_test(test_u64_and_key_byte_order),
        cmocka_unit_test(test_bad_arguments),
    };
    return cmocka_run_group_tests_name("kv_vllm_hash", tests, NULL, NULL);
}
