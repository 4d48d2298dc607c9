/* Checks the block hash against the published vectors of docs/HASH.md, and each vector also
 * against an independent computation: the input bytes built by hand here and hashed with
 * XXH3_128bits / SHA256 directly. The hex digests were also reproduced with Python's xxhash and
 * hashlib (docs/HASH.md shows how). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>
#include <openssl/sha.h>
#include <xxhash.h>

#include "common/kv_hash.h"

static const kv_hash128 ZERO_SEED = {0, 0};
static const kv_hash128 SEED = {0x0123456789abcdefull, 0xfedcba9876543210ull};

/* The spec, written out independently of kv_hash.c: appends v as n little-endian bytes. */
static size_t ref_put(unsigned char *buf, size_t at, uint64_t v, int n) {
    for (int i = 0; i < n; i++) {
        buf[at + (size_t)i] = (unsigned char)((v >> (8 * i)) & 0xff);
    }
    return at + (size_t)n;
}

static size_t ref_input(unsigned char *buf, kv_hash128 parent, const char *extra,
                        const uint32_t *tokens, size_t ntokens) {
    size_t at = 0;
    size_t elen = extra ? strlen(extra) : 0;
    at = ref_put(buf, at, parent.lo, 8);
    at = ref_put(buf, at, parent.hi, 8);
    at = ref_put(buf, at, elen, 4);
    for (size_t i = 0; i < elen; i++) {
        buf[at++] = (unsigned char)extra[i];
    }
    at = ref_put(buf, at, ntokens, 4);
    for (size_t i = 0; i < ntokens; i++) {
        at = ref_put(buf, at, tokens[i], 4);
    }
    return at;
}

static kv_hash128 ref_hash(kv_hash_algo algo, kv_hash128 parent, const char *extra,
                           const uint32_t *tokens, size_t ntokens) {
    unsigned char buf[8192];
    size_t len = ref_input(buf, parent, extra, tokens, ntokens);
    kv_hash128 h = {0, 0};
    if (algo == KV_HASH_XXH3_128) {
        XXH128_hash_t d = XXH3_128bits(buf, len);
        h.lo = d.low64;
        h.hi = d.high64;
    } else {
        unsigned char md[SHA256_DIGEST_LENGTH];
        SHA256(buf, len, md);
        for (int i = 7; i >= 0; i--) {
            h.lo = (h.lo << 8) | md[i];
            h.hi = (h.hi << 8) | md[8 + i];
        }
    }
    return h;
}

/* Hashes one block with kv_hash_block, checks it equals the reference and the published hex. */
static kv_hash128 check_block(kv_hash_algo algo, kv_hash128 parent, const char *extra,
                              const uint32_t *tokens, size_t ntokens, const char *want_hex) {
    kv_hash128 got;
    size_t elen = extra ? strlen(extra) : 0;
    assert_int_equal(kv_hash_block(algo, parent, extra, elen, tokens, ntokens, &got), KV_OK);
    kv_hash128 ref = ref_hash(algo, parent, extra, tokens, ntokens);
    char hex[33];
    kv_hash_hex(got, hex);
    if (strcmp(hex, want_hex) != 0) {
        print_message("vector mismatch: got %s want %s\n", hex, want_hex);
    }
    assert_true(kv_hash_eq(got, ref));
    assert_string_equal(hex, want_hex);
    return got;
}

static void fill_seq(uint32_t *t, size_t n, uint32_t first) {
    for (size_t i = 0; i < n; i++) {
        t[i] = first + (uint32_t)i;
    }
}

/* Vector 1: zero seed, no extra, tokens 1..16. */
static void test_vector_xxh3_empty_extra(void **state) {
    (void)state;
    uint32_t t[16];
    fill_seq(t, 16, 1);
    check_block(KV_HASH_XXH3_128, ZERO_SEED, NULL, t, 16, "e8abdae47543823695223d748af9dd05");
}

/* Vector 2: zero seed, extra "lora:7", tokens 1..16. */
static void test_vector_xxh3_with_extra(void **state) {
    (void)state;
    uint32_t t[16];
    fill_seq(t, 16, 1);
    check_block(KV_HASH_XXH3_128, ZERO_SEED, "lora:7", t, 16, "ccc3edce67c8baae5f13f39a39535c51");
}

/* Vector 3: zero seed, no extra, the single token 42. */
static void test_vector_xxh3_one_token(void **state) {
    (void)state;
    uint32_t t[1] = {42};
    check_block(KV_HASH_XXH3_128, ZERO_SEED, NULL, t, 1, "fcf2b13a5d3b0fc5d994780ecb3def98");
}

/* Vectors 4a-4c: zero seed, no extra, tokens 1000..1047 as three 16-token blocks. */
static void test_vector_xxh3_chain_of_three(void **state) {
    (void)state;
    static const char *want[3] = {
        "f8d6f8989e27a6f707fb4fd28b71c193",
        "44b9cc41652e844d4df58caa7aac6346",
        "9e9240a4c422f9818d1749a4d66a66e6",
    };
    uint32_t t[48];
    fill_seq(t, 48, 1000);
    kv_hash128 parent = ZERO_SEED;
    for (int b = 0; b < 3; b++) {
        parent = check_block(KV_HASH_XXH3_128, parent, NULL, t + 16 * b, 16, want[b]);
    }
    /* kv_hash_chain gives the same three hashes. */
    kv_hash128 out[4];
    size_t n = 99;
    assert_int_equal(kv_hash_chain(KV_HASH_XXH3_128, ZERO_SEED, NULL, 0, t, 48, 16, out, 4, &n),
                     KV_OK);
    assert_int_equal(n, 3);
    for (int b = 0; b < 3; b++) {
        char hex[33];
        kv_hash_hex(out[b], hex);
        assert_string_equal(hex, want[b]);
    }
}

/* Vector 5: seed 0xfedcba9876543210_0123456789abcdef (hi_lo), no extra, tokens 1..16. */
static void test_vector_xxh3_nonzero_seed(void **state) {
    (void)state;
    uint32_t t[16];
    fill_seq(t, 16, 1);
    check_block(KV_HASH_XXH3_128, SEED, NULL, t, 16, "b07cc11d348412a1bc480b1af43a2e12");
}

/* Vector 6: SHA-256 mode, the seed of vector 5, extra "lora:7", tokens 1..16. */
static void test_vector_sha256(void **state) {
    (void)state;
    uint32_t t[16];
    fill_seq(t, 16, 1);
    check_block(KV_HASH_SHA256_128, SEED, "lora:7", t, 16, "b6b02640e78f713516e08ae1a98c5def");
}

/* Vector 7: zero seed, no extra, no tokens (the degenerate block still has a defined hash). */
static void test_vector_xxh3_no_tokens(void **state) {
    (void)state;
    check_block(KV_HASH_XXH3_128, ZERO_SEED, NULL, NULL, 0, "2a8ac7e44ef93d74202329e27c5ce410");
}

/* The spec is byte for byte: every field changes the hash, including the extra's length prefix
 * (extra "ab" + tokens differs from extra "a" + ...). */
static void test_every_field_matters(void **state) {
    (void)state;
    uint32_t t[16];
    fill_seq(t, 16, 1);
    kv_hash128 base, h;
    assert_int_equal(kv_hash_block(KV_HASH_XXH3_128, SEED, "x", 1, t, 16, &base), KV_OK);
    kv_hash128 seed2 = SEED;
    seed2.hi ^= 1;
    assert_int_equal(kv_hash_block(KV_HASH_XXH3_128, seed2, "x", 1, t, 16, &h), KV_OK);
    assert_false(kv_hash_eq(base, h));
    assert_int_equal(kv_hash_block(KV_HASH_XXH3_128, SEED, "y", 1, t, 16, &h), KV_OK);
    assert_false(kv_hash_eq(base, h));
    assert_int_equal(kv_hash_block(KV_HASH_XXH3_128, SEED, "x", 1, t, 15, &h), KV_OK);
    assert_false(kv_hash_eq(base, h));
    t[15] ^= 0x80000000u;
    assert_int_equal(kv_hash_block(KV_HASH_XXH3_128, SEED, "x", 1, t, 16, &h), KV_OK);
    assert_false(kv_hash_eq(base, h));
    assert_int_equal(kv_hash_block(KV_HASH_SHA256_128, SEED, "x", 1, t, 16, &h), KV_OK);
    assert_false(kv_hash_eq(base, h));
}

/* Blocks too big for the stack buffer take the heap path and still follow the spec. */
static void test_large_block_heap_path(void **state) {
    (void)state;
    enum { N = 1500 };
    static uint32_t t[N];
    fill_seq(t, N, 7);
    char extra[KV_HASH_MAX_EXTRA + 1];
    memset(extra, 'e', KV_HASH_MAX_EXTRA);
    extra[KV_HASH_MAX_EXTRA] = '\0';
    for (int algo = KV_HASH_XXH3_128; algo <= KV_HASH_SHA256_128; algo++) {
        kv_hash128 got;
        assert_int_equal(
            kv_hash_block((kv_hash_algo)algo, SEED, extra, KV_HASH_MAX_EXTRA, t, N, &got), KV_OK);
        assert_true(kv_hash_eq(got, ref_hash((kv_hash_algo)algo, SEED, extra, t, N)));
    }
}

static void test_chain_partial_last_block_not_hashed(void **state) {
    (void)state;
    uint32_t t[40];
    fill_seq(t, 40, 5);
    kv_hash128 out[8];
    size_t n = 0;
    assert_int_equal(kv_hash_chain(KV_HASH_XXH3_128, SEED, "a", 1, t, 40, 16, out, 8, &n), KV_OK);
    assert_int_equal(n, 2);
    kv_hash128 h0 = ref_hash(KV_HASH_XXH3_128, SEED, "a", t, 16);
    kv_hash128 h1 = ref_hash(KV_HASH_XXH3_128, h0, "a", t + 16, 16);
    assert_true(kv_hash_eq(out[0], h0));
    assert_true(kv_hash_eq(out[1], h1));
    /* Fewer tokens than one block: no hashes, success. */
    n = 99;
    assert_int_equal(kv_hash_chain(KV_HASH_XXH3_128, SEED, NULL, 0, t, 15, 16, out, 8, &n), KV_OK);
    assert_int_equal(n, 0);
}

static void test_chain_respects_max_out(void **state) {
    (void)state;
    uint32_t t[64];
    fill_seq(t, 64, 0);
    kv_hash128 out[4];
    kv_hash128 canary = {0x1111, 0x2222};
    out[2] = canary;
    out[3] = canary;
    size_t n = 0;
    assert_int_equal(kv_hash_chain(KV_HASH_SHA256_128, SEED, NULL, 0, t, 64, 16, out, 2, &n),
                     KV_OK);
    assert_int_equal(n, 2);
    assert_true(kv_hash_eq(out[2], canary));
    assert_true(kv_hash_eq(out[3], canary));
    assert_true(kv_hash_eq(out[0], ref_hash(KV_HASH_SHA256_128, SEED, NULL, t, 16)));
    /* max_out 0 with no array is fine. */
    n = 99;
    assert_int_equal(kv_hash_chain(KV_HASH_XXH3_128, SEED, NULL, 0, t, 64, 16, NULL, 0, &n), KV_OK);
    assert_int_equal(n, 0);
}

static void test_bad_arguments(void **state) {
    (void)state;
    uint32_t t[16];
    fill_seq(t, 16, 0);
    kv_hash128 out[1];
    kv_hash128 h;
    size_t n = 77;
    char extra[KV_HASH_MAX_EXTRA + 1];
    memset(extra, 'x', sizeof(extra));

    assert_int_equal(kv_hash_chain((kv_hash_algo)0, SEED, NULL, 0, t, 16, 16, out, 1, &n),
                     KV_EINVAL);
    assert_int_equal(kv_hash_chain((kv_hash_algo)3, SEED, NULL, 0, t, 16, 16, out, 1, &n),
                     KV_EINVAL);
    assert_int_equal(
        kv_hash_chain(KV_HASH_XXH3_128, SEED, extra, KV_HASH_MAX_EXTRA + 1, t, 16, 16, out, 1, &n),
        KV_EINVAL);
    assert_int_equal(kv_hash_chain(KV_HASH_XXH3_128, SEED, NULL, 0, t, 16, 0, out, 1, &n),
                     KV_EINVAL);
    assert_int_equal(kv_hash_chain(KV_HASH_XXH3_128, SEED, NULL, 0, t, 16, 16, NULL, 1, &n),
                     KV_EINVAL);
    assert_int_equal(kv_hash_chain(KV_HASH_XXH3_128, SEED, NULL, 0, t, 16, 16, out, 1, NULL),
                     KV_EINVAL);
    assert_int_equal(n, 77); /* out-param untouched on error */

    assert_int_equal(kv_hash_block((kv_hash_algo)9, SEED, NULL, 0, t, 16, &h), KV_EINVAL);
    assert_int_equal(
        kv_hash_block(KV_HASH_SHA256_128, SEED, extra, KV_HASH_MAX_EXTRA + 1, t, 16, &h),
        KV_EINVAL);
    assert_int_equal(kv_hash_block(KV_HASH_XXH3_128, SEED, NULL, 3, t, 16, &h), KV_EINVAL);
    assert_int_equal(kv_hash_block(KV_HASH_XXH3_128, SEED, NULL, 0, NULL, 16, &h), KV_EINVAL);
    assert_int_equal(kv_hash_block(KV_HASH_XXH3_128, SEED, NULL, 0, t, 16, NULL), KV_EINVAL);
    /* The largest extra is accepted. */
    assert_int_equal(kv_hash_block(KV_HASH_XXH3_128, SEED, extra, KV_HASH_MAX_EXTRA, t, 16, &h),
                     KV_OK);
}

static void test_hex_round_trip(void **state) {
    (void)state;
    kv_hash128 h = {0x0123456789abcdefull, 0xfedcba9876543210ull};
    char hex[33];
    kv_hash_hex(h, hex);
    /* Digest bytes 0..15 in order: lo's bytes little-endian, then hi's. */
    assert_string_equal(hex, "efcdab89674523011032547698badcfe");
    kv_hash128 back;
    assert_int_equal(kv_hash_parse(hex, &back), KV_OK);
    assert_true(kv_hash_eq(h, back));
    assert_int_equal(kv_hash_parse("EFCDAB89674523011032547698BADCFE", &back), KV_OK);
    assert_true(kv_hash_eq(h, back));

    kv_hash128 untouched = {1, 2};
    assert_int_equal(kv_hash_parse("efcdab89674523011032547698badcf", &untouched), KV_EINVAL);
    assert_int_equal(kv_hash_parse("efcdab89674523011032547698badcfe0", &untouched), KV_EINVAL);
    assert_int_equal(kv_hash_parse("efcdab89674523011032547698badcfg", &untouched), KV_EINVAL);
    assert_int_equal(kv_hash_parse("", &untouched), KV_EINVAL);
    assert_int_equal(kv_hash_parse(NULL, &untouched), KV_EINVAL);
    assert_int_equal(untouched.lo, 1);
    assert_int_equal(untouched.hi, 2);

    for (uint64_t i = 0; i < 200; i++) {
        kv_hash128 r = {i * 0x9e3779b97f4a7c15ull, ~i * 0xc2b2ae3d27d4eb4full};
        kv_hash_hex(r, hex);
        assert_int_equal(strlen(hex), 32);
        assert_int_equal(kv_hash_parse(hex, &back), KV_OK);
        assert_true(kv_hash_eq(r, back));
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_vector_xxh3_empty_extra),
        cmocka_unit_test(test_vector_xxh3_with_extra),
        cmocka_unit_test(test_vector_xxh3_one_token),
        cmocka_unit_test(test_vector_xxh3_chain_of_three),
        cmocka_unit_test(test_vector_xxh3_nonzero_seed),
        cmocka_unit_test(test_vector_sha256),
        cmocka_unit_test(test_vector_xxh3_no_tokens),
        cmocka_unit_test(test_every_field_matters),
        cmocka_unit_test(test_large_block_heap_path),
        cmocka_unit_test(test_chain_partial_last_block_not_hashed),
        cmocka_unit_test(test_chain_respects_max_out),
        cmocka_unit_test(test_bad_arguments),
        cmocka_unit_test(test_hex_round_trip),
    };
    return cmocka_run_group_tests_name("kv_hash", tests, NULL, NULL);
}
