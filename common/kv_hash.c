/* kv_hash: the chained 128-bit block hash (docs/HASH.md is the byte-for-byte spec).
 *
 * The input to H for one block is
 *   parent.lo (u64 LE) || parent.hi (u64 LE) || extra_len (u32 LE) || extra || ntokens (u32 LE)
 *   || tokens (each u32 LE)
 * and it is hashed in one shot from a stack buffer: XXH3's one-shot path is several times faster
 * than its streaming state for the 16-token blocks engines use, which keeps hashing near
 * 1 ns/token. Only blocks larger than the stack buffer (more than KV_LAYOUT_MAX_TOKENS_PER_BLOCK
 * tokens) go through a heap buffer.
 */
#include "common/kv_hash.h"

#include <stdlib.h>
#include <string.h>

#include <sha2.h>
#include <xxhash.h>

/* Fixed part of the input: parent (16) + extra_len (4) + ntokens (4). */
#define HASH_FIXED_BYTES 24u

/* Holds any block of up to 1024 tokens with the largest extra, so every block a pool can hold
 * is hashed without touching the heap. */
#define HASH_STACK_BYTES (HASH_FIXED_BYTES + KV_HASH_MAX_EXTRA + 4u * 1024u)

/* Little-endian stores. On little-endian hosts a plain memcpy: the byte-by-byte form compiles
 * to a reassembly through the stack whose wide reload misses store forwarding and costs more
 * than the hash itself for a 16-token block. */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define HASH_HOST_LE 1
#else
#define HASH_HOST_LE 0
#endif

static void put_u32le(unsigned char *p, uint32_t v) {
#if HASH_HOST_LE
    memcpy(p, &v, sizeof(v));
#else
    p[0] = (unsigned char)v;
    p[1] = (unsigned char)(v >> 8);
    p[2] = (unsigned char)(v >> 16);
    p[3] = (unsigned char)(v >> 24);
#endif
}

static void put_u64le(unsigned char *p, uint64_t v) {
#if HASH_HOST_LE
    memcpy(p, &v, sizeof(v));
#else
    put_u32le(p, (uint32_t)v);
    put_u32le(p + 4, (uint32_t)(v >> 32));
#endif
}

static uint64_t get_u64le(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) {
        v = (v << 8) | p[i];
    }
    return v;
}

/* Lays out one block's input in buf, which holds 24 + extra_len + 4 * ntokens bytes. The parent
 * comes as two scalars and bytes 16..23 are one store when there is no extra: XXH3 reads the
 * input in 8-byte words, and a word assembled from several narrower stores (or a struct spilled
 * and reloaded as one 16-byte vector) misses store forwarding, which cost more than the hash
 * itself for a 16-token block. */
static void hash_fill(unsigned char *buf, uint64_t parent_lo, uint64_t parent_hi, const void *extra,
                      size_t extra_len, const uint32_t *tokens, size_t ntokens) {
    unsigned char *p = buf;
    put_u64le(p, parent_lo);
    put_u64le(p + 8, parent_hi);
    if (extra_len == 0) {
        put_u64le(p + 16, (uint64_t)ntokens << 32); /* extra_len 0, then ntokens */
        p += 24;
    } else {
        put_u32le(p + 16, (uint32_t)extra_len);
        memcpy(p + 20, extra, extra_len);
        put_u32le(p + 20 + extra_len, (uint32_t)ntokens);
        p += 24 + extra_len;
    }
#if HASH_HOST_LE
    if (ntokens > 0) {
        memcpy(p, tokens, ntokens * sizeof(uint32_t));
    }
#else
    for (size_t i = 0; i < ntokens; i++) {
        put_u32le(p + 4 * i, tokens[i]);
    }
#endif
}

static kv_err hash_digest(kv_hash_algo algo, const unsigned char *buf, size_t len,
                          kv_hash128 *out) {
    if (algo == KV_HASH_XXH3_128) {
        XXH128_hash_t d = XXH3_128bits(buf, len);
        out->lo = d.low64;
        out->hi = d.high64;
        return KV_OK;
    }
    /* libmd's SHA-256 (Debian libmd0): no libcrypto in libkvclient for one digest. */
    uint8_t md[SHA256_DIGEST_LENGTH];
    SHA2_CTX ctx;
    SHA256Init(&ctx);
    SHA256Update(&ctx, buf, len);
    SHA256Final(md, &ctx);
    out->lo = get_u64le(md);
    out->hi = get_u64le(md + 8);
    return KV_OK;
}

static kv_err hash_check(kv_hash_algo algo, const void *extra, size_t extra_len) {
    if (algo != KV_HASH_XXH3_128 && algo != KV_HASH_SHA256_128) {
        return KV_EINVAL;
    }
    if (extra_len > KV_HASH_MAX_EXTRA || (extra_len > 0 && extra == NULL)) {
        return KV_EINVAL;
    }
    return KV_OK;
}

/* One block, arguments already checked except the token count. */
static kv_err hash_one(kv_hash_algo algo, kv_hash128 parent, const void *extra, size_t extra_len,
                       const uint32_t *tokens, size_t ntokens, kv_hash128 *out) {
    if (ntokens > UINT32_MAX || (ntokens > 0 && tokens == NULL)) {
        return KV_EINVAL;
    }
    size_t len = HASH_FIXED_BYTES + extra_len;
    if (ntokens > (SIZE_MAX - len) / 4) {
        return KV_EINVAL;
    }
    len += 4 * ntokens;

    unsigned char stackbuf[HASH_STACK_BYTES];
    unsigned char *buf = stackbuf;
    if (len > sizeof(stackbuf)) {
        buf = malloc(len);
        if (buf == NULL) {
            return KV_ENOMEM;
        }
    }
    hash_fill(buf, parent.lo, parent.hi, extra, extra_len, tokens, ntokens);
    kv_hash128 h;
    kv_err err = hash_digest(algo, buf, len, &h);
    if (buf != stackbuf) {
        free(buf);
    }
    if (err == KV_OK) {
        *out = h;
    }
    return err;
}

kv_err kv_hash_block(kv_hash_algo algo, kv_hash128 parent, const void *extra, size_t extra_len,
                     const uint32_t *tokens, size_t ntokens, kv_hash128 *out) {
    if (out == NULL) {
        return KV_EINVAL;
    }
    kv_err err = hash_check(algo, extra, extra_len);
    if (err != KV_OK) {
        return err;
    }
    return hash_one(algo, parent, extra, extra_len, tokens, ntokens, out);
}

kv_err kv_hash_chain(kv_hash_algo algo, kv_hash128 seed, const void *extra, size_t extra_len,
                     const uint32_t *tokens, size_t ntokens, uint32_t tokens_per_block,
                     kv_hash128 *out, size_t max_out, size_t *nout) {
    if (nout == NULL || tokens_per_block == 0 || (max_out > 0 && out == NULL) ||
        (ntokens > 0 && tokens == NULL)) {
        return KV_EINVAL;
    }
    kv_err err = hash_check(algo, extra, extra_len);
    if (err != KV_OK) {
        return err;
    }
    size_t nblocks = ntokens / tokens_per_block;
    if (nblocks > max_out) {
        nblocks = max_out;
    }
    kv_hash128 parent = seed;
    for (size_t b = 0; b < nblocks; b++) {
        err = hash_one(algo, parent, extra, extra_len, tokens + b * tokens_per_block,
                       tokens_per_block, &out[b]);
        if (err != KV_OK) {
            return err;
        }
        parent = out[b];
    }
    *nout = nblocks;
    return KV_OK;
}

void kv_hash_hex(kv_hash128 h, char buf[33]) {
    static const char digits[] = "0123456789abcdef";
    unsigned char bytes[16];
    put_u64le(bytes, h.lo);
    put_u64le(bytes + 8, h.hi);
    for (int i = 0; i < 16; i++) {
        buf[2 * i] = digits[bytes[i] >> 4];
        buf[2 * i + 1] = digits[bytes[i] & 0xf];
    }
    buf[32] = '\0';
}

static int hex_val(char c) {
    if (c >= '0' && c <= '9') {
        return c - '0';
    }
    if (c >= 'a' && c <= 'f') {
        return c - 'a' + 10;
    }
    if (c >= 'A' && c <= 'F') {
        return c - 'A' + 10;
    }
    return -1;
}

kv_err kv_hash_parse(const char *hex, kv_hash128 *out) {
    if (hex == NULL || out == NULL) {
        return KV_EINVAL;
    }
    unsigned char bytes[16];
    for (int i = 0; i < 16; i++) {
        int a = hex_val(hex[2 * i]);
        if (a < 0) {
            return KV_EINVAL;
        }
        int b = hex_val(hex[2 * i + 1]);
        if (b < 0) {
            return KV_EINVAL;
        }
        bytes[i] = (unsigned char)(a << 4 | b);
    }
    if (hex[32] != '\0') {
        return KV_EINVAL;
    }
    out->lo = get_u64le(bytes);
    out->hi = get_u64le(bytes + 8);
    return KV_OK;
}
