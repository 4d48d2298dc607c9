/* kvd_tstore: the lower-tier entries of one pool (one (model, layout, domain)): which block
 * hashes have a copy in T1 (host memory the daemon owns) and in T2 (a slot of the pool's disk
 * file), in which format, and the order each tier evicts them in.
 *
 * Entries live in one array with a free list and a chained hash table keyed by the block's
 * chain hash; each tier keeps an intrusive LRU list of its present entries (a Lookup or Fetch
 * that finds an entry makes it newest). An entry may be charged to a tenant, its owner (the
 * tenant the block's T0 copy was charged to, kvd_tstore_own): each owner has its own LRU list
 * and count per tier, so that per-tenant limits and guarantees can pick among its entries in
 * O(1) (daemon/tenancy/quota.h: tier-max, tier-guarantee). An entry is copied to or from by copy
 * threads only while it is busy (a count the tiers layer raises before it hands the entry's bytes
 * to a job and drops when the job is back on the loop thread); eviction never takes a busy entry.
 * Sizes are counted here; what the budgets allow is the caller's decision. The domain is the
 * pool's, so a store never holds two domains' blocks.
 *
 * Loop thread only; the bytes of a present T1 entry are immutable until it leaves T1, so a job
 * may read them while the entry is busy.
 */
#ifndef KVD_TSTORE_H
#define KVD_TSTORE_H

#include <stddef.h>
#include <stdint.h>

#include "common/kv_err.h"
#include "common/kv_hash.h"

#define KVD_TNONE UINT32_MAX /* "no entry" */
#define KVD_TNOOWNER 0xffffu /* kvd_tentry.owner: charged to no tenant */

typedef struct kvd_tentry {
    kv_hash128 hash;   /* the block's chain hash */
    kv_hash128 parent; /* its parent's chain hash (zero for a first block or unknown) */
    uint8_t *t1;       /* T1: the block's bytes in format fmt1 (malloc'd), NULL when absent */
    float *summ;       /* the block's page summary (summaries pools; malloc'd) or NULL: it goes
                          with the block to every tier and is freed with the entry */
    uint64_t len1;     /* bytes at t1 */
    uint64_t slot2;    /* T2: slot of the pool's file, valid when in2 */
    uint64_t len2;     /* T2: payload bytes of that slot */
    uint64_t seq;      /* T2: record sequence number (newest wins at a restart) */
    uint32_t busy;     /* copy jobs using the entry now */
    uint32_t hits;     /* lookups and fetches that found it (saturating) */
    uint8_t fmt1;      /* kvd_tier_format of t1 */
    uint8_t fmt2;      /* kvd_tier_format of the T2 record */
    uint8_t in2;       /* a valid record of it is in slot2 */
    uint8_t pending;   /* a copy into T1 or T2 is in flight (KVD_TPEND_* bits) */
    uint8_t doomed;    /* must go when no longer busy (quarantined) */
    uint8_t used;      /* the record is an entry (not on the free list) */
    uint8_t inr;       /* the remote tier holds its value: written there by this node, or read
                          from there (remote-ttl-s 0); write-back skips it (tiers.c) */
    uint8_t has_tail;  /* hash-mode vllm: tail holds the digest's last 16 bytes (the first 16
                          are the hash), so the remote tier and KV events can name the block */
    uint8_t tail[16];
    uint16_t owner;   /* index into the store's owners, or KVD_TNOOWNER */
    uint32_t hnext;   /* hash chain */
    uint32_t prev[2]; /* LRU links, per tier (index 0: T1, 1: T2) */
    uint32_t next[2];
    uint32_t oprev[2]; /* the owner's LRU links, per tier */
    uint32_t onext[2];
} kvd_tentry;

/* A tenant the store holds entries of: its oldest and newest entry and its count, per tier, and
 * the T1 bytes of its entries (len1 summed; a T2 entry takes one slot, whatever its payload). */
typedef struct kvd_towner {
    uint32_t tenant;
    uint32_t head[2], tail[2];
    uint64_t count[2];
    uint64_t bytes1;
} kvd_towner;

#define KVD_TPEND_T1 0x01u /* a copy into T1 is in flight */
#define KVD_TPEND_T2 0x02u /* a write into T2 is in flight */

typedef struct kvd_tstore {
    kvd_tentry *e;      /* [cap] entries */
    uint32_t cap, n;    /* entries allocated, entries used */
    uint32_t free_head; /* free list through hnext */
    uint32_t *buckets;  /* [nbuckets] heads of hash chains */
    uint32_t nbuckets;  /* a power of two */
    uint32_t head[2];   /* oldest present entry per tier */
    uint32_t tail[2];   /* newest */
    uint64_t count[2];  /* present entries per tier */
    uint64_t bytes[2];  /* bytes per tier (T1: len1 summed; T2: slots * slot size) */
    uint64_t *free2;    /* T2 slots given back, reused first */
    uint64_t nfree2, free2_cap;
    uint64_t next_slot2; /* next never-used T2 slot */
    kvd_towner *own;     /* [nown] the owners seen (never removed: at most the tenants) */
    uint32_t nown, own_cap;
    /* Told when an entry enters (present 1) or leaves (0) tier 1 or 2: set1/set2 and
     * drop/take1/unlink2 (not fini). NULL: nobody (init). */
    void (*on_tier)(void *arg, const kvd_tentry *e, int tier, int present);
    void *on_tier_arg;
    /* Frees T1 bytes the store lets go (drop, fini): NULL is free(). The tiers route page-locked
     * buffers back to their driver with it (daemon/tiers/pinned.h). */
    void (*free1)(void *arg, uint8_t *bytes);
    void *free1_arg;
} kvd_tstore;

/* init makes an empty store (call it before any other function: zeroed storage is not one; it
 * clears the hooks). fini frees every T1 buffer (through free1) and the store's arrays (nothing
 * may be busy), leaving an empty store without hooks; it accepts NULL and zeroed memory. */
void kvd_tstore_init(kvd_tstore *s);
void kvd_tstore_fini(kvd_tstore *s);

/* The entry of hash h, or KVD_TNONE. O(1) expected. */
uint32_t kvd_tstore_find(const kvd_tstore *s, kv_hash128 h);

/* The entry of h, made (absent from both tiers) when there is none. KV_ENOMEM. */
kv_err kvd_tstore_get(kvd_tstore *s, kv_hash128 h, kv_hash128 parent, uint32_t *out);

/* The entry's record (valid until the next call that may make an entry). */
static inline kvd_tentry *kvd_tstore_at(kvd_tstore *s, uint32_t i) {
    return &s->e[i];
}

/* 1 when the entry has a copy in tier (1 or 2). */
int kvd_tstore_in(const kvd_tstore *s, uint32_t i, int tier);

/* Puts bytes (format fmt, len bytes; the store takes ownership of the malloc'd buffer) into T1
 * as the newest entry there. The entry must not be in T1 already. */
void kvd_tstore_set1(kvd_tstore *s, uint32_t i, uint8_t *bytes, uint64_t len, uint8_t fmt);

/* Records that T2 slot `slot` (slot_bytes on disk) holds the entry (payload len, format fmt,
 * sequence seq), as the newest entry there. The entry must not be in T2 already. */
void kvd_tstore_set2(kvd_tstore *s, uint32_t i, uint64_t slot, uint64_t len, uint8_t fmt,
                     uint64_t seq, uint64_t slot_bytes);

/* Takes the entry out of tier (1: frees its bytes through free1; 2: gives its slot back, slot_bytes
 * uncounted). An entry in neither tier, not busy and not pending, is freed (its index may be
 * reused). The entry must not be busy. */
void kvd_tstore_drop(kvd_tstore *s, uint32_t i, int tier, uint64_t slot_bytes);

/* Takes the entry out of T1 and returns its bytes (the caller owns them now: reuses or frees
 * them). Frees the entry when it is then in neither tier and not pending. The entry must be in
 * T1 and not busy. */
uint8_t *kvd_tstore_take1(kvd_tstore *s, uint32_t i);

/* Takes the entry out of T2 without giving its slot back (the caller zeroes the slot first and
 * then gives it back with kvd_tstore_slot2_back); returns the slot. The entry must be in T2 and
 * not busy. Frees the entry when it is then in neither tier and not pending. */
uint64_t kvd_tstore_unlink2(kvd_tstore *s, uint32_t i, uint64_t slot_bytes);

/* Frees an entry in neither tier that is not busy or pending (a copy that failed). */
void kvd_tstore_forget(kvd_tstore *s, uint32_t i);

/* Makes a present entry the newest of each tier it is in and counts a hit. */
void kvd_tstore_touch(kvd_tstore *s, uint32_t i);

/* The oldest entry of tier that is not busy, or KVD_TNONE. Walks past busy ones (few: copies in
 * flight). */
uint32_t kvd_tstore_oldest(const kvd_tstore *s, int tier);

/* Charges entry i to tenant from now on. Only an entry in neither tier changes owner (one in a
 * tier keeps the one it has); KV_ENOMEM leaves it unowned. */
kv_err kvd_tstore_own(kvd_tstore *s, uint32_t i, uint32_t tenant);

/* The tenant entry i is charged to, or UINT32_MAX for none. */
uint32_t kvd_tstore_owner(const kvd_tstore *s, uint32_t i);

/* Present entries of tenant in tier (1 or 2). */
uint64_t kvd_tstore_owned(const kvd_tstore *s, uint32_t tenant, int tier);

/* Bytes of tenant's entries in T1 (their len1 summed). */
uint64_t kvd_tstore_owned_bytes1(const kvd_tstore *s, uint32_t tenant);

/* The oldest entry of tenant in tier that is not busy, or KVD_TNONE. */
uint32_t kvd_tstore_oldest_of(const kvd_tstore *s, uint32_t tenant, int tier);

/* A T2 slot for a new record: one given back, else the next never used. KV_ENOMEM. */
kv_err kvd_tstore_slot2(kvd_tstore *s, uint64_t *slot);

/* Gives a T2 slot that was taken but never recorded (a write that failed) back. */
void kvd_tstore_slot2_back(kvd_tstore *s, uint64_t slot);

#endif
