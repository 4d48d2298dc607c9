/* kv_wire: framing of the client protocol, as pure functions (bytes in, message or error out),
 * shared by kvd and libkvclient and fuzzed on their own.
 *
 * A frame is a 4-byte little-endian length L followed by L bytes of one protobuf-c
 * kvd.Envelope. File descriptors travel beside the frame as SCM_RIGHTS (the transport's job,
 * not this module's). Any thread; no state.
 */
#ifndef KV_WIRE_H
#define KV_WIRE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "common/kv_err.h"
#include "common/kv_limits.h"
#include "proto/kvd.pb-c.h"

#define KV_WIRE_HEADER_BYTES 4
#define KV_WIRE_DEFAULT_MAX_FRAME (1u << 20) /* 1 MiB, configurable in kvd */
#define KV_PROTOCOL_VERSION 1

/* Bytes the framed envelope takes (header included). */
size_t kv_wire_frame_size(const Kvd__Envelope *env);

/* Writes the frame of env into buf, which has room for kv_wire_frame_size(env) bytes; returns
 * the bytes written. */
size_t kv_wire_encode_into(const Kvd__Envelope *env, uint8_t *buf);

/* kv_wire_frame_size that also returns what kv_wire_encode_measured needs (the body's packed
 * size), so a caller that sizes its buffer first packs the body's size only once. */
size_t kv_wire_frame_measure(const Kvd__Envelope *env, size_t *body_len);

/* kv_wire_encode_into for an env measured by kv_wire_frame_measure (body_len from it, env
 * unchanged since); buf has room for the size it returned. Returns the frame's bytes. */
size_t kv_wire_encode_measured(const Kvd__Envelope *env, size_t body_len, uint8_t *buf);

/* Frames env into a malloc'd buffer (*buf, caller frees). KV_ETOOBIG when larger than
 * max_frame, KV_ENOMEM. Writes outputs only on success. */
kv_err kv_wire_encode(const Kvd__Envelope *env, uint32_t max_frame, uint8_t **buf, size_t *len);

/* Looks at the start of buf[0..len): if a whole frame is there, unpacks it into *env (free with
 * kv_wire_free) and sets *consumed to its size. If more bytes are needed, returns KV_OK with
 * *env = NULL and *consumed = 0. Errors (the stream cannot continue): KV_ETOOBIG when the
 * length exceeds max_frame, KV_EPROTO when the body does not unpack or has no body. */
kv_err kv_wire_decode(const uint8_t *buf, size_t len, uint32_t max_frame, Kvd__Envelope **env,
                      size_t *consumed);

/* Frees an envelope from kv_wire_decode; accepts NULL. */
void kv_wire_free(Kvd__Envelope *env);

/* kv_wire_decode with an allocator for the unpacked message (e.g. kv_arena_allocator, so one
 * request costs no malloc). alloc NULL is kv_wire_decode. Free *env with
 * kv_wire_free_with(env, alloc) (with an arena: reset the arena instead). */
kv_err kv_wire_decode_with(const uint8_t *buf, size_t len, uint32_t max_frame,
                           ProtobufCAllocator *alloc, Kvd__Envelope **env, size_t *consumed);

/* The daemon's decoder of one request frame: kv_wire_decode_with, and then the checks a request
 * must pass before a handler sees it. Returns KV_OK with *env NULL while more bytes are needed.
 * Errors: KV_ETOOBIG (the length exceeds max_frame: the stream cannot continue); otherwise the
 * frame is skipped (*consumed set) and why gets a sentence: KV_EPROTO (the body does not unpack,
 * *id 0; or the envelope has no body), KV_EEPOCH (boot_epoch is set and is not epoch, checked
 * before everything else; epoch 0: not checked), KV_ENOTSUP (the body is a type this protocol
 * version does not have: a newer client's request), KV_EINVAL (a string field is not UTF-8 or holds
 * a NUL byte, which protobuf-c would silently cut). *id gets the envelope's id when it unpacked, so
 * the error can answer that request. */
kv_err kv_wire_decode_request(const uint8_t *buf, size_t len, uint32_t max_frame, uint64_t epoch,
                              ProtobufCAllocator *alloc, Kvd__Envelope **env, size_t *consumed,
                              uint64_t *id, char *why, size_t whylen);

/* Length of the longest prefix of s[0..n) that is well-formed UTF-8 (no overlong forms, no
 * surrogates, nothing above U+10FFFF): n when all of it is. Pure. */
size_t kv_utf8_prefix(const char *s, size_t n);

/* Frees an envelope from kv_wire_decode_with(..., alloc, ...); accepts NULL. */
void kv_wire_free_with(Kvd__Envelope *env, ProtobufCAllocator *alloc);

/* ---- packed lists (PROTOCOL.md 6, "Packed lists") ----------------------------------------
 * Lookup.hashes_packed holds 16 bytes per hash (lo as LE u64, then hi as LE u64); blocks_packed
 * (LookupReply, AllocateReply, Release, Rewind) holds 8 bytes per block (id as LE u32, then gen
 * as LE u32). A sender fills either the packed field or the repeated one, never both. */

#define KV_WIRE_HASH_BYTES 16 /* one packed hash */
#define KV_WIRE_BLOCK_BYTES 8 /* one packed block handle */

/* Hello.features / HelloReply.features bits. */
#define KV_FEATURE_PACKED                                                                          \
    1u /* packed lists: the daemon takes them in requests (HelloReply);                            \
          the client takes them in replies (Hello) */
#define KV_FEATURE_TIERS                                                                           \
    2u /* lower tiers: the client reads LookupReply's tier fields and may get a FetchReply after   \
          replies to later requests (Hello); the daemon has lower tiers (HelloReply) */
#define KV_FEATURE_PRIVATE                                                                         \
    4u /* private blocks: the daemon honours Allocate.private and takes Unshare (HelloReply; a     \
          client's bit means nothing) */
#define KV_FEATURE_REMOTE                                                                          \
    8u /* a remote tier: the daemon answers Lookup.remote (HelloReply; a client's bit means        \
          nothing) */
#define KV_FEATURE_PACKED_COMMIT                                                                   \
    16u /* packed Commit: the daemon takes Commit.entries_packed (HelloReply); the client reads    \
           CommitReply.canonical_packed (Hello) */

/* One packed Commit entry (Commit.entries_packed): block id LE32, gen LE32, hash lo LE64, hash hi
 * LE64, parent LE32. */
#define KV_WIRE_COMMIT_BYTES 28
#define KV_WIRE_DIGEST_BYTES 32 /* one hash_full_packed record: a vLLM sha256_cbor digest */

/* Entries of a packed field of len bytes with unit-byte entries: KV_EPROTO when len is not a
 * multiple of unit (a malformed frame). Writes *n only on success. */
kv_err kv_wire_packed_count(size_t len, size_t unit, size_t *n);

/* Entries of a list sent either as n_repeated repeated entries or as a packed field of
 * packed_len bytes: KV_EPROTO when both forms are non-empty or the packed length is not a
 * multiple of unit. Writes *n only on success. */
kv_err kv_wire_list_count(size_t n_repeated, size_t packed_len, size_t unit, size_t *n);

/* Little-endian loads and stores at any alignment: memcpy on little-endian hosts (one move
 * each; GCC does not merge the byte loop into one), bytes elsewhere. */
static inline uint64_t kv_wire_le64(const uint8_t *q) {
    uint64_t v;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    memcpy(&v, q, sizeof(v));
#else
    v = 0;
    for (int k = 7; k >= 0; k--) {
        v = v << 8 | q[k];
    }
#endif
    return v;
}

static inline uint32_t kv_wire_le32(const uint8_t *q) {
    uint32_t v;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    memcpy(&v, q, sizeof(v));
#else
    v = (uint32_t)q[0] | (uint32_t)q[1] << 8 | (uint32_t)q[2] << 16 | (uint32_t)q[3] << 24;
#endif
    return v;
}

static inline void kv_wire_put_le64(uint8_t *q, uint64_t v) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    memcpy(q, &v, sizeof(v));
#else
    for (int k = 0; k < 8; k++) {
        q[k] = (uint8_t)(v >> (8 * k));
    }
#endif
}

static inline void kv_wire_put_le32(uint8_t *q, uint32_t v) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    memcpy(q, &v, sizeof(v));
#else
    for (int k = 0; k < 4; k++) {
        q[k] = (uint8_t)(v >> (8 * k));
    }
#endif
}

/* Packed hash i of p (p holds at least 16 * (i + 1) bytes). */
static inline void kv_wire_hash_get(const uint8_t *p, size_t i, uint64_t *lo, uint64_t *hi) {
    const uint8_t *q = p + i * KV_WIRE_HASH_BYTES;
    *lo = kv_wire_le64(q);
    *hi = kv_wire_le64(q + 8);
}

/* Writes packed hash i into p. */
static inline void kv_wire_hash_put(uint8_t *p, size_t i, uint64_t lo, uint64_t hi) {
    uint8_t *q = p + i * KV_WIRE_HASH_BYTES;
    kv_wire_put_le64(q, lo);
    kv_wire_put_le64(q + 8, hi);
}

/* Packed block i of p (p holds at least 8 * (i + 1) bytes). */
static inline void kv_wire_block_get(const uint8_t *p, size_t i, uint32_t *id, uint32_t *gen) {
    const uint8_t *q = p + i * KV_WIRE_BLOCK_BYTES;
    *id = kv_wire_le32(q);
    *gen = kv_wire_le32(q + 4);
}

/* Writes packed block i into p. */
static inline void kv_wire_block_put(uint8_t *p, size_t i, uint32_t id, uint32_t gen) {
    uint8_t *q = p + i * KV_WIRE_BLOCK_BYTES;
    kv_wire_put_le32(q, id);
    kv_wire_put_le32(q + 4, gen);
}

/* One packed Commit entry (KV_WIRE_COMMIT_BYTES). */
typedef struct kv_wire_commit {
    uint32_t id, gen;
    uint64_t lo, hi;
    uint32_t parent;
} kv_wire_commit;

/* Packed Commit entry i of p (p holds at least 28 * (i + 1) bytes). */
static inline kv_wire_commit kv_wire_commit_get(const uint8_t *p, size_t i) {
    const uint8_t *q = p + i * KV_WIRE_COMMIT_BYTES;
    kv_wire_commit e = {kv_wire_le32(q), kv_wire_le32(q + 4), kv_wire_le64(q + 8),
                        kv_wire_le64(q + 16), kv_wire_le32(q + 24)};
    return e;
}

/* Writes packed Commit entry i into p. */
static inline void kv_wire_commit_put(uint8_t *p, size_t i, const kv_wire_commit *e) {
    uint8_t *q = p + i * KV_WIRE_COMMIT_BYTES;
    kv_wire_put_le32(q, e->id);
    kv_wire_put_le32(q + 4, e->gen);
    kv_wire_put_le64(q + 8, e->lo);
    kv_wire_put_le64(q + 16, e->hi);
    kv_wire_put_le32(q + 24, e->parent);
}

#endif
