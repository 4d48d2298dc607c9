/* kvd_index: the one prefix index, an open-addressing hash table from (namespace, block hash)
 * to a 64-bit value (the pool packs pool-local block id and generation into it).
 *
 * Namespace is the pool id: a pool serves one model in one domain, so keying by pool keeps
 * domains apart. Linear probing over 32-byte slots with tombstone-free backward-shift deletion;
 * capacity is a power of two (sized at init for the entries asked at load <= 0.7). Pools reserve
 * one entry per block slot they own before they own it (kvd_index_reserve), and the table grows
 * (a rehash) when the reservations would pass its load limit, so an insert for a pool's block
 * never finds the index full: a Commit cannot fail half way for want of index room. Batched
 * probes prefetch ahead so a long prompt costs parallel cache misses; in a table larger than
 * the caches they interleave, a probe whose run goes on into another cache line yielding to
 * the others while that line arrives.
 * Loop thread only; no locks.
 */
#ifndef KVD_INDEX_H
#define KVD_INDEX_H

#include <stddef.h>
#include <stdint.h>

#include "common/kv_err.h"
#include "common/kv_hash.h"

typedef struct kvd_index kvd_index;

/* Allocates an index that holds at least max_entries entries. KV_ENOMEM on failure. */
kv_err kvd_index_alloc(size_t max_entries, kvd_index **out);

/* Reserves room for n more entries (a pool growing by n block slots): grows the table (a rehash,
 * O(entries), logged KVD-INDEX-GROW) when the reservations would pass its load limit. KV_ENOMEM
 * (nothing changed) when it cannot. */
kv_err kvd_index_reserve(kvd_index *idx, size_t n);

/* Gives back n reserved entries (a pool's segment or the pool went away). */
void kvd_index_unreserve(kvd_index *idx, size_t n);

/* Entries reserved by pools. */
size_t kvd_index_reserved(const kvd_index *idx);

/* Frees the index; accepts NULL. */
void kvd_index_free(kvd_index *idx);

/* Inserts (ns, h) -> value. If the key is present, leaves it and writes the existing value to
 * *existing (when not NULL) and returns KV_EEXIST. KV_ENOSPC when the table is at its load limit
 * (never for an entry within the reservations). */
kv_err kvd_index_insert(kvd_index *idx, uint32_t ns, kv_hash128 h, uint64_t value,
                        uint64_t *existing);

/* Finds (ns, h); KV_ENOENT when absent. */
kv_err kvd_index_find(const kvd_index *idx, uint32_t ns, kv_hash128 h, uint64_t *value);

/* Removes (ns, h); KV_ENOENT when absent. */
kv_err kvd_index_remove(kvd_index *idx, uint32_t ns, kv_hash128 h);

/* Probes hashes[0..n) in order and returns how many leading ones are present (stops at the
 * first miss); their values go to values[0..k). Prefetches ahead so misses overlap. */
size_t kvd_index_probe_prefix(const kvd_index *idx, uint32_t ns, const kv_hash128 *hashes, size_t n,
                              uint64_t *values);

size_t kvd_index_count(const kvd_index *idx);    /* entries present */
size_t kvd_index_capacity(const kvd_index *idx); /* slots */
size_t kvd_index_bytes(const kvd_index *idx);    /* memory held */

#endif
