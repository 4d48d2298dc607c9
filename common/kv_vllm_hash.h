/* kv_vllm_hash: vLLM's own block hashes ("sha256_cbor", vLLM v0.10.2 and later), so that kvd can
 * index the blocks a vLLM engine names in its KV events (docs/HASH.md, "vLLM mode").
 *
 *   NONE_HASH = SHA-256(CBOR(seed))                  seed: PYTHONHASHSEED, as a text string
 *   h_i       = SHA-256(CBOR([h_{i-1}, [tokens_i...], extra_keys_i]))     h_{-1} = NONE_HASH
 *
 * CBOR is what cbor2.dumps(..., canonical=True) writes for vLLM's Python tuple: an array of 3,
 * the parent as a 32-byte byte string, the token ids as an array of unsigned integers (each in
 * its shortest head), and extra_keys as null or an array of text strings. Digests are the full
 * 32 bytes; kvd's index keys a block by the first 16 (kv_vllm_hash_key), and vLLM publishes the
 * last 8 read big-endian (kv_vllm_hash_u64). kvd supports text-string extra keys only (LoRA name,
 * cache salt, multimodal hash strings). tests/vllm/vllm_hash_ref.py is the Python reference.
 * Pure functions; any thread.
 */
#ifndef KV_VLLM_HASH_H
#define KV_VLLM_HASH_H

#include <stddef.h>
#include <stdint.h>

#include "common/kv_err.h"
#include "common/kv_hash.h"

/* Bytes of a vLLM block hash (a full SHA-256 digest). */
#define KV_VLLM_HASH_BYTES 32

/* Most extra key strings one block may carry. */
#define KV_VLLM_MAX_EXTRA_KEYS 8

/* Longest extra key, in bytes (not counting the NUL). */
#define KV_VLLM_MAX_KEY_BYTES 256

/* Longest seed accepted by kv_vllm_none_hash, in bytes. */
#define KV_VLLM_MAX_SEED_BYTES 4096

/* Computes NONE_HASH, the parent of a chain's first block, for a vLLM started with
 * PYTHONHASHSEED=seed: SHA-256 of the seed encoded as a CBOR text string (seed "0" hashes the
 * bytes 61 30). seed is seed_len bytes of UTF-8, not NUL-terminated (it may be NULL when seed_len
 * is 0). Returns KV_EINVAL for a NULL seed with seed_len > 0, seed_len above
 * KV_VLLM_MAX_SEED_BYTES, bytes that are not valid UTF-8 (vLLM could never hash them), or out NULL.
 * Writes out only on success. */
kv_err kv_vllm_none_hash(const char *seed, size_t seed_len, uint8_t out[KV_VLLM_HASH_BYTES]);

/* Hashes one block: parent is the previous block's digest, or NONE_HASH for block 0. tokens may be
 * NULL when ntokens is 0. extra_keys holds nextra NUL-terminated UTF-8 strings in vLLM's order
 * (LoRA name, multimodal hashes, cache salt); nextra 0 encodes null, as vLLM does for a block
 * without keys (extra_keys may then be NULL). A key cannot contain a NUL byte. Returns KV_EINVAL
 * for a NULL parent or out, tokens NULL with ntokens > 0, nextra above KV_VLLM_MAX_EXTRA_KEYS,
 * extra_keys NULL with nextra > 0, a NULL key, a key longer than KV_VLLM_MAX_KEY_BYTES or not
 * valid UTF-8; KV_ENOMEM when a large block (over about 128 tokens, or long keys) cannot get its
 * heap buffer (KV_EINTERNAL would mean a bug in the size bound). Writes out only on success; out
 * may alias parent. */
kv_err kv_vllm_hash_block(const uint8_t parent[KV_VLLM_HASH_BYTES], const uint32_t *tokens,
                          size_t ntokens, const char *const *extra_keys, size_t nextra,
                          uint8_t out[KV_VLLM_HASH_BYTES]);

/* Hashes the full blocks of a token sequence, starting from none_hash: floor(ntokens /
 * tokens_per_block) digests, at most max_out, into out; *nout gets the count. A partial last
 * block is not hashed. The same extra keys go into every block; vLLM's keys can differ per block
 * (a cache salt only on block 0, a multimodal key only on the blocks its input overlaps), and
 * such chains are built with kv_vllm_hash_block, each block's parent the previous digest.
 * Errors as kv_vllm_hash_block, and KV_EINVAL for a NULL none_hash, tokens_per_block 0, nout NULL,
 * or out NULL with max_out > 0; argument errors are found before anything is written. *nout is
 * written only on success (after a late KV_ENOMEM, out may hold some digests). */
kv_err kv_vllm_hash_chain(const uint8_t none_hash[KV_VLLM_HASH_BYTES], const uint32_t *tokens,
                          size_t ntokens, uint32_t tokens_per_block, const char *const *extra_keys,
                          size_t nextra, uint8_t (*out)[KV_VLLM_HASH_BYTES], size_t max_out,
                          size_t *nout);

/* The 64-bit form vLLM publishes in KV events by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES):
 * int.from_bytes(digest, "big") & (2**64 - 1), i.e. digest bytes 24..31 read big-endian. It
 * cannot be extended into a chain: the next block hashes the full 32-byte parent. */
uint64_t kv_vllm_hash_u64(const uint8_t h[KV_VLLM_HASH_BYTES]);

/* kvd's 128-bit index key for a vLLM digest: lo = bytes 0..7, hi = bytes 8..15, each read
 * little-endian, so the key's 16 digest bytes (docs/HASH.md) are the digest's first 16 bytes and
 * kv_hash_hex prints them in order. */
static inline kv_hash128 kv_vllm_hash_key(const uint8_t h[KV_VLLM_HASH_BYTES]) {
    kv_hash128 k = {0, 0};
    for (int i = 7; i >= 0; i--) {
        k.lo = (k.lo << 8) | h[i];
        k.hi = (k.hi << 8) | h[8 + i];
    }
    return k;
}

#endif
