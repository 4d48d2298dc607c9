/* kv_vllm_hash: vLLM's sha256_cbor block hashes (docs/HASH.md, "vLLM mode").
 *
 * One block's CBOR is written with libcbor's streaming encoders, which emit the shortest head for
 * every length and integer as cbor2's canonical mode does, into a stack buffer, and hashed in one
 * SHA256Update call. The buffer is chosen from an upper bound (5 bytes per token) so that nothing
 * is measured twice; blocks whose bound exceeds the stack buffer (more than about 128 tokens, or
 * long extra keys) use a heap buffer. NONE_HASH needs no buffer: the seed's head and the seed go
 * to SHA-256 one after the other.
 */
#include "common/kv_vllm_hash.h"

#include <stdlib.h>
#include <string.h>

#include <cbor.h>
#include <sha2.h>

/* Outer array head (1) + byte-string head (2) + parent (32) + token-array head (at most 9). */
#define VLLM_FIXED_BOUND 44u

/* Widest CBOR head of a uint32 token id (0x1a + 4 bytes). */
#define VLLM_TOKEN_BOUND 5u

/* Holds a block of 128 tokens at the widest encoding with 340 bytes of extra keys, which
 * covers vLLM's usual block sizes (16 by default) with a LoRA name and a salt. */
#define VLLM_STACK_BYTES 1024u

/* Extra keys after checking: their lengths and the exact size of their CBOR. */
typedef struct vllm_extras {
    const char *const *keys;            /* the caller's strings, borrowed */
    size_t n;                           /* number of keys; 0 encodes null */
    size_t len[KV_VLLM_MAX_EXTRA_KEYS]; /* byte length of each key */
    size_t cbor_len;                    /* bytes of the null or the array of text strings */
} vllm_extras;

static size_t head_len(uint64_t v) {
    if (v < 24) {
        return 1;
    }
    if (v <= UINT8_MAX) {
        return 2;
    }
    if (v <= UINT16_MAX) {
        return 3;
    }
    if (v <= UINT32_MAX) {
        return 5;
    }
    return 9;
}

/* Strict UTF-8 (RFC 3629): no overlong forms, no surrogates, nothing above U+10FFFF. cbor2 writes
 * a Python str as its UTF-8 bytes and cannot encode anything else, so other bytes would give a
 * hash that no vLLM can produce. */
static int utf8_valid(const unsigned char *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        unsigned char c = s[i];
        if (c < 0x80) {
            i++;
            continue;
        }
        size_t more;
        unsigned char lo = 0x80, hi = 0xbf; /* allowed range of the second byte */
        if (c >= 0xc2 && c <= 0xdf) {
            more = 1;
        } else if (c >= 0xe0 && c <= 0xef) {
            more = 2;
            if (c == 0xe0) {
                lo = 0xa0; /* overlong */
            } else if (c == 0xed) {
                hi = 0x9f; /* surrogates */
            }
        } else if (c >= 0xf0 && c <= 0xf4) {
            more = 3;
            if (c == 0xf0) {
                lo = 0x90; /* overlong */
            } else if (c == 0xf4) {
                hi = 0x8f; /* above U+10FFFF */
            }
        } else {
            return 0;
        }
        if (n - i <= more) {
            return 0;
        }
        if (s[i + 1] < lo || s[i + 1] > hi) {
            return 0;
        }
        for (size_t k = 2; k <= more; k++) {
            if (s[i + k] < 0x80 || s[i + k] > 0xbf) {
                return 0;
            }
        }
        i += more + 1;
    }
    return 1;
}

static kv_err extras_check(const char *const *keys, size_t n, vllm_extras *x) {
    if (n > KV_VLLM_MAX_EXTRA_KEYS || (n > 0 && keys == NULL)) {
        return KV_EINVAL;
    }
    x->keys = keys;
    x->n = n;
    x->cbor_len = n == 0 ? 1 : head_len(n);
    for (size_t i = 0; i < n; i++) {
        if (keys[i] == NULL) {
            return KV_EINVAL;
        }
        /* Bounded scan: a key with no NUL in its first 257 bytes is refused without reading
         * further. */
        size_t len = 0;
        while (len <= KV_VLLM_MAX_KEY_BYTES && keys[i][len] != '\0') {
            len++;
        }
        if (len > KV_VLLM_MAX_KEY_BYTES || !utf8_valid((const unsigned char *)keys[i], len)) {
            return KV_EINVAL;
        }
        x->len[i] = len;
        x->cbor_len += head_len(len) + len;
    }
    return KV_OK;
}

/* Writes the block's CBOR into buf (cap bytes, at least the bound) and returns its length, or 0
 * if an encoder ran out of room, which the bound rules out. */
static size_t block_encode(unsigned char *buf, size_t cap, const uint8_t *parent,
                           const uint32_t *tokens, size_t ntokens, const vllm_extras *x) {
    size_t at = 0, w;
#define VLLM_PUT(call)                                                                             \
    do {                                                                                           \
        w = (call);                                                                                \
        if (w == 0) {                                                                              \
            return 0;                                                                              \
        }                                                                                          \
        at += w;                                                                                   \
    } while (0)
    VLLM_PUT(cbor_encode_array_start(3, buf + at, cap - at));
    VLLM_PUT(cbor_encode_bytestring_start(KV_VLLM_HASH_BYTES, buf + at, cap - at));
    memcpy(buf + at, parent, KV_VLLM_HASH_BYTES);
    at += KV_VLLM_HASH_BYTES;
    VLLM_PUT(cbor_encode_array_start(ntokens, buf + at, cap - at));
    for (size_t i = 0; i < ntokens; i++) {
        VLLM_PUT(cbor_encode_uint(tokens[i], buf + at, cap - at));
    }
    if (x->n == 0) {
        VLLM_PUT(cbor_encode_null(buf + at, cap - at));
    } else {
        VLLM_PUT(cbor_encode_array_start(x->n, buf + at, cap - at));
        for (size_t i = 0; i < x->n; i++) {
            VLLM_PUT(cbor_encode_string_start(x->len[i], buf + at, cap - at));
            if (cap - at < x->len[i]) {
                return 0;
            }
            memcpy(buf + at, x->keys[i], x->len[i]);
            at += x->len[i];
        }
    }
#undef VLLM_PUT
    return at;
}

/* One block, extras already checked. */
static kv_err hash_one(const uint8_t *parent, const uint32_t *tokens, size_t ntokens,
                       const vllm_extras *x, uint8_t *out) {
    if (ntokens > 0 && tokens == NULL) {
        return KV_EINVAL;
    }
    size_t fixed = VLLM_FIXED_BOUND + x->cbor_len;
    if (ntokens > (SIZE_MAX - fixed) / VLLM_TOKEN_BOUND) {
        return KV_EINVAL;
    }
    size_t bound = fixed + VLLM_TOKEN_BOUND * ntokens;

    unsigned char stackbuf[VLLM_STACK_BYTES];
    unsigned char *buf = stackbuf;
    if (bound > sizeof(stackbuf)) {
        buf = malloc(bound);
        if (buf == NULL) {
            return KV_ENOMEM;
        }
    }
    kv_err err = KV_OK;
    size_t len = block_encode(buf, bound, parent, tokens, ntokens, x);
    if (len == 0) {
        err = KV_EINTERNAL; /* the bound is wrong: a bug, not bad input */
    } else {
        /* Through a local digest so that out may alias parent. */
        uint8_t md[SHA256_DIGEST_LENGTH];
        SHA2_CTX ctx;
        SHA256Init(&ctx);
        SHA256Update(&ctx, buf, len);
        SHA256Final(md, &ctx);
        memcpy(out, md, KV_VLLM_HASH_BYTES);
    }
    if (buf != stackbuf) {
        free(buf);
    }
    return err;
}

kv_err kv_vllm_none_hash(const char *seed, size_t seed_len, uint8_t out[KV_VLLM_HASH_BYTES]) {
    if (out == NULL || seed_len > KV_VLLM_MAX_SEED_BYTES || (seed_len > 0 && seed == NULL)) {
        return KV_EINVAL;
    }
    if (!utf8_valid((const unsigned char *)seed, seed_len)) {
        return KV_EINVAL;
    }
    unsigned char head[9];
    size_t hlen = cbor_encode_string_start(seed_len, head, sizeof(head));
    if (hlen == 0) {
        return KV_EINTERNAL;
    }
    SHA2_CTX ctx;
    SHA256Init(&ctx);
    SHA256Update(&ctx, head, hlen);
    if (seed_len > 0) {
        SHA256Update(&ctx, (const uint8_t *)seed, seed_len);
    }
    SHA256Final(out, &ctx);
    return KV_OK;
}

kv_err kv_vllm_hash_block(const uint8_t parent[KV_VLLM_HASH_BYTES], const uint32_t *tokens,
                          size_t ntokens, const char *const *extra_keys, size_t nextra,
                          uint8_t out[KV_VLLM_HASH_BYTES]) {
    if (parent == NULL || out == NULL) {
        return KV_EINVAL;
    }
    vllm_extras x;
    kv_err err = extras_check(extra_keys, nextra, &x);
    if (err != KV_OK) {
        return err;
    }
    return hash_one(parent, tokens, ntokens, &x, out);
}

kv_err kv_vllm_hash_chain(const uint8_t none_hash[KV_VLLM_HASH_BYTES], const uint32_t *tokens,
                          size_t ntokens, uint32_t tokens_per_block, const char *const *extra_keys,
                          size_t nextra, uint8_t (*out)[KV_VLLM_HASH_BYTES], size_t max_out,
                          size_t *nout) {
    if (none_hash == NULL || nout == NULL || tokens_per_block == 0 ||
        (max_out > 0 && out == NULL) || (ntokens > 0 && tokens == NULL)) {
        return KV_EINVAL;
    }
    vllm_extras x;
    kv_err err = extras_check(extra_keys, nextra, &x);
    if (err != KV_OK) {
        return err;
    }
    size_t nblocks = ntokens / tokens_per_block;
    if (nblocks > max_out) {
        nblocks = max_out;
    }
    const uint8_t *parent = none_hash;
    for (size_t b = 0; b < nblocks; b++) {
        err = hash_one(parent, tokens + b * tokens_per_block, tokens_per_block, &x, out[b]);
        if (err != KV_OK) {
            return err;
        }
        parent = out[b];
    }
    *nout = nblocks;
    return KV_OK;
}

uint64_t kv_vllm_hash_u64(const uint8_t h[KV_VLLM_HASH_BYTES]) {
    uint64_t v = 0;
    for (int i = KV_VLLM_HASH_BYTES - 8; i < KV_VLLM_HASH_BYTES; i++) {
        v = (v << 8) | h[i];
    }
    return v;
}
