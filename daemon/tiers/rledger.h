/* kvd_rledger: the remote tier's ledger — which values this node announced on medium REMOTE
 * (BlockStored after Redis acknowledged its write) and has not yet announced gone. With
 * remote-watch, Redis's drops are heard as keyspace notifications, but Redis keeps no backlog:
 * a drop while a subscription is being made again goes unheard (docs/TIERS.md, "Remote tier").
 * After such a gap the daemon asks Redis about every entry (kvd_tiers' reconciliation) and
 * announces BlockRemoved for the values that are gone; the ledger is what it asks about.
 *
 * A bounded set of (pool id, block hash) in 4-way sets, two choices of set per entry: an entry
 * whose two sets are full replaces their oldest one (counted in `lost`: a drop of that value in a
 * later gap goes unreported, as every drop did before). Every add stamps its entry with a new
 * number, so an answer about an entry can be matched with the announcement it was asked about
 * (kvd_rledger_remove_if). 48 to 96 bytes an entry asked for (24-byte slots, at least two an
 * entry and a power of two in all), allocated at once. Loop thread only.
 */
#ifndef KVD_RLEDGER_H
#define KVD_RLEDGER_H

#include <stddef.h>
#include <stdint.h>

#include "common/kv_err.h"
#include "common/kv_hash.h"

typedef struct kvd_rledger kvd_rledger;

/* An entry as a scan hands it out. */
typedef struct kvd_rledger_ent {
    kv_hash128 hash;
    uint32_t pool_id;
    uint32_t stamp; /* the add that made it (kvd_rledger_remove_if) */
} kvd_rledger_ent;

/* A ledger for `entries` entries: twice as many slots, rounded up to a power of two (at least 4),
 * so that with `entries` in it an entry is pushed out now and then only (2 in 32768 measured
 * at half full, 146 at 70%).
 * KV_EINVAL for 0; KV_ENOMEM. */
kv_err kvd_rledger_alloc(size_t entries, kvd_rledger **out);

/* Frees it; accepts NULL. */
void kvd_rledger_free(kvd_rledger *l);

/* Records (pool_id, hash) as announced, with a new stamp (an entry already there gets the new
 * stamp). pool_id 0 is not a pool and is ignored. */
void kvd_rledger_add(kvd_rledger *l, uint32_t pool_id, kv_hash128 hash);

/* Forgets (pool_id, hash): 1 when it was there, else 0. */
int kvd_rledger_remove(kvd_rledger *l, uint32_t pool_id, kv_hash128 hash);

/* Forgets (pool_id, hash) only if its stamp is still `stamp` (no add since the scan that
 * handed it out): 1 when it did, else 0. */
int kvd_rledger_remove_if(kvd_rledger *l, uint32_t pool_id, kv_hash128 hash, uint32_t stamp);

/* Copies up to max entries, in slot order from *cursor on, into out and moves *cursor past the
 * slots it looked at; returns how many it copied. A walk from *cursor = 0 until
 * *cursor == kvd_rledger_slots(l) sees every entry present throughout (entries added or removed
 * meanwhile may or may not be seen). */
size_t kvd_rledger_scan(const kvd_rledger *l, size_t *cursor, kvd_rledger_ent *out, size_t max);

size_t kvd_rledger_slots(const kvd_rledger *l);  /* slots (at least twice the entries asked) */
size_t kvd_rledger_count(const kvd_rledger *l);  /* entries present */
uint64_t kvd_rledger_lost(const kvd_rledger *l); /* entries replaced for room, ever */
size_t kvd_rledger_bytes(const kvd_rledger *l);  /* memory held */

#endif
