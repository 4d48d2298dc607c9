/* kv_arena: a bump allocator for the lifetime of one message (one request in kvd, one reply in
 * libkvclient), usable as protobuf-c's ProtobufCAllocator.
 *
 * protobuf-c allocates every submessage, repeated-field array and bytes field on its own; a
 * Lookup of 128 hashes unpacks into 130 mallocs and as many frees. Unpacking into an arena
 * turns them into pointer bumps, and kv_arena_reset drops everything at once. Requests larger
 * than the block spill to malloc (tracked and freed at reset), and the block then grows so the
 * next message of that size fits. Not thread-safe: one owner thread.
 */
#ifndef KV_ARENA_H
#define KV_ARENA_H

#include <stddef.h>
#include <stdint.h>

#include <protobuf-c/protobuf-c.h>

#define KV_ARENA_MAX_BLOCK (16u << 20) /* the block never grows beyond this; larger spills */

typedef struct kv_arena {
    uint8_t *buf;                 /* the block; NULL until the first allocation */
    size_t cap;                   /* bytes of buf */
    size_t used;                  /* bytes handed out since the last reset */
    void **spill;                 /* allocations that did not fit, freed at reset */
    size_t nspill, spill_cap;     /* entries used and allocated in spill */
    size_t spilled;               /* bytes spilled since the last reset (sizes the next block) */
    ProtobufCAllocator allocator; /* protobuf-c view of this arena (kv_arena_init sets it) */
} kv_arena;

/* Initialises an empty arena in caller storage; nothing is allocated until first use. The
 * arena must not move afterwards (its allocator points at it). */
void kv_arena_init(kv_arena *a);

/* Frees the block and all spills; accepts NULL and zeroed memory. */
void kv_arena_fini(kv_arena *a);

/* Returns size bytes aligned to 16, valid until the next kv_arena_reset, or NULL when out of
 * memory (size 0 gets a valid pointer too). */
void *kv_arena_alloc(kv_arena *a, size_t size);

/* Forgets every allocation (frees spills) and grows the block when the last message spilled,
 * up to KV_ARENA_MAX_BLOCK. Pointers handed out before are invalid afterwards. */
void kv_arena_reset(kv_arena *a);

/* The arena as a ProtobufCAllocator (its free does nothing; reset releases). Borrowed: valid
 * while a is. */
ProtobufCAllocator *kv_arena_allocator(kv_arena *a);

#endif
