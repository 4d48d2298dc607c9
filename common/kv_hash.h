/* kv_hash: the block-hash chain that every engine computes the same way (docs/HASH.md, included
 * in proto/PROTOCOL.md, gives the byte layout and test vectors).
 *
 *   h_0 = H(seed || extra_0 || tokens_0),   h_i = H(h_{i-1} || extra_i || tokens_i)
 *
 * seed is the pool's 128-bit salt (AttachPool returns it); the daemon keys its index by pool,
 * and a pool belongs to one domain, so the domain is part of every block's identity without a
 * client ever naming one. H is XXH3-128 (default) or the first 16 bytes of SHA-256. The bytes
 * hashed for one block are
 *   parent.lo (u64 LE) || parent.hi (u64 LE) || extra_len (u32 LE) || extra
 *   || ntokens (u32 LE) || tokens (each u32 LE)
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
    KV_HASH_SHA256_128 = 2, /* first 16 bytes of SHA-256 (libmd), for crafted-collision fears */
    KV_HASH_VLLM = 3, /* vLLM's sha256_cbor, chained over 32-byte digests: common/kv_vllm_hash.h
                         (kv_hash_block and kv_hash_chain refuse it with KV_EINVAL) */
} kv_hash_algo;

/* Largest extra key accepted per block (adapter id, multimodal hash, ...), in bytes. */
#define KV_HASH_MAX_EXTRA 256

/* Hashes one block: parent is the previous block's hash, or the seed for block 0. extra may be
 * NULL when extra_len is 0; tokens may be NULL when ntokens is 0. Returns KV_EINVAL for an
 * unknown algo, extra_len above KV_HASH_MAX_EXTRA, a NULL pointer with a non-zero length, or
 * ntokens above UINT32_MAX; KV_ENOMEM when a block of more than 1024 tokens cannot get its heap
 * buffer; KV_EINTERNAL if the digest fails. Writes *out only on success. */
kv_err kv_hash_block(kv_hash_algo algo, kv_hash128 parent, const void *extra, size_t extra_len,
                     const uint32_t *tokens, size_t ntokens, kv_hash128 *out);

/* Hashes the full blocks of a token sequence: floor(ntokens / tokens_per_block) hashes, at most
 * max_out, written to out; *nout gets the count. The same extra applies to every block (pass
 * NULL, 0 for none). A partial last block is not hashed (only full blocks are ever cached).
 * Errors as kv_hash_block, and KV_EINVAL for tokens_per_block 0, nout NULL, or out NULL with
 * max_out > 0; argument errors are found before anything is written. *nout is written only on
 * success (after a late KV_ENOMEM/KV_EINTERNAL, out may hold some hashes). */
kv_err kv_hash_chain(kv_hash_algo algo, kv_hash128 seed, const void *extra, size_t extra_len,
                     const uint32_t *tokens, size_t ntokens, uint32_t tokens_per_block,
                     kv_hash128 *out, size_t max_out, size_t *nout);

/* True when a and b are the same digest. */
static inline int kv_hash_eq(kv_hash128 a, kv_hash128 b) {
    return a.lo == b.lo && a.hi == b.hi;
}

/* Writes 32 lowercase hex digits (digest bytes 0..15 in order) and a NUL into buf[33]. */
void kv_hash_hex(kv_hash128 h, char buf[33]);

/* Parses exactly 32 hex digits (as kv_hash_hex writes them; upper case accepted too) followed by
 * NUL; KV_EINVAL otherwise. Writes *out only on success. */
kv_err kv_hash_parse(const char *hex, kv_hash128 *out);

#endif
