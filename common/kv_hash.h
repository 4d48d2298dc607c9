/* kv_hash: the block-hash chain that every engine computes the same way (proto/PROTOCOL.md,
 * "Block hash", gives the byte layout and test vectors).
 *
 *   h_0 = H(seed || extra_0 || tokens_0),   h_i = H(h_{i-1} || extra_i || tokens_i)
 *
 * seed is the pool's 128-bit salt (AttachPool returns it); the daemon keys its index by pool,
 * and a pool belongs to one domain, so the domain is part of every block's identity without a
 * client ever naming one. H is XXH3-128 (default) or the first 16 bytes of SHA-256.
 * Pure functions; any thread.
 */
#ifndef KV_HASH_H
#define KV_HASH_H

#include <stddef.h>
#include <stdint.h>

#include "common/kv_err.h"

typedef struct kv_hash128 {
    uint64_t lo; /* bytes 0..7 of the digest, little-endian */
    uint64_t hi; /* bytes 8..15 of the digest, little-endian */
} kv_hash128;

typedef enum kv_hash_algo {
    KV_HASH_XXH3_128 = 1,   /* XXH3_128bits, seed 0 */
    KV_HASH_SHA256_128 = 2, /* first 16 bytes of SHA-256 (OpenSSL), for crafted-collision fears */
} kv_hash_algo;

/* Largest extra key accepted per block (adapter id, multimodal hash, ...), in bytes. */
#define KV_HASH_MAX_EXTRA 256

/* Hashes one block: parent is the previous block's hash, or the seed for block 0. extra may be
 * NULL when extra_len is 0. Returns KV_EINVAL for an unknown algo or extra_len too large. */
kv_err kv_hash_block(kv_hash_algo algo, kv_hash128 parent, const void *extra, size_t extra_len,
                     const uint32_t *tokens, size_t ntokens, kv_hash128 *out);

/* Hashes the full blocks of a token sequence: floor(ntokens / tokens_per_block) hashes, at most
 * max_out, written to out; *nout gets the count. The same extra applies to every block (pass
 * NULL, 0 for none). A partial last block is not hashed (only full blocks are ever cached). */
kv_err kv_hash_chain(kv_hash_algo algo, kv_hash128 seed, const void *extra, size_t extra_len,
                     const uint32_t *tokens, size_t ntokens, uint32_t tokens_per_block,
                     kv_hash128 *out, size_t max_out, size_t *nout);

/* True when a and b are the same digest. */
static inline int kv_hash_eq(kv_hash128 a, kv_hash128 b) {
    return a.lo == b.lo && a.hi == b.hi;
}

/* Writes 32 lowercase hex digits (digest bytes 0..15 in order) and a NUL into buf[33]. */
void kv_hash_hex(kv_hash128 h, char buf[33]);

/* Parses 32 hex digits written by kv_hash_hex; KV_EINVAL otherwise. */
kv_err kv_hash_parse(const char *hex, kv_hash128 *out);

#endif
