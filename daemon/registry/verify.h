/* kvd_verify: the verify-blocks debug mode. A worker that writes through its mapping after it
 * released a block silently changes a block others read as a hit; this mode catches it.
 *
 * When a block is committed (a new canonical block, not a duplicate) its bytes get a 64-bit
 * checksum (XXH3 over every byte of the block: each (layer, K|V) run and its scales, read
 * through the backend, so device memory works too, with copies). At each Lookup hit the bytes
 * are summed again; a block whose sum differs is quarantined (kvd_pool_quarantine: out of the
 * index, freed at its last release), logged as KVD-VERIFY and counted in the pool's
 * `quarantines`; the hit list ends before it. Blocks committed while the mode was off have no
 * sum and are not checked. Sums are kept per block id with the block's generation, so a reused
 * record never matches an old sum. 16 bytes per block of the pool's slots, outside the memory
 * budget (a debug mode).
 *
 * Loop thread only, like the pools.
 */
#ifndef KVD_VERIFY_H
#define KVD_VERIFY_H

#include <stddef.h>
#include <stdint.h>

#include "common/kv_err.h"
#include "daemon/core/backend.h"
#include "daemon/core/pool.h"

typedef struct kvd_verify_sum {
    uint64_t sum; /* XXH3-64 of the block's bytes at commit */
    uint32_t gen; /* the block's generation then */
    uint32_t set; /* 1 when sum is valid */
} kvd_verify_sum;

typedef struct kvd_verify {
    kvd_verify_sum *sums; /* [cap] by block id; grows with the pool */
    uint32_t cap;         /* entries of sums */
} kvd_verify;

/* The checksum of block blk's bytes as they are now. KV_ENOENT when its segment is gone,
 * backend errors (device copies) pass through, KV_ENOMEM. */
kv_err kvd_verify_block_sum(const kvd_backend_ops *be, void *ctx, const kvd_pool *pool, uint32_t id,
                            uint64_t *out);

/* Records the sum of a block just committed. KV_ENOMEM (nothing recorded) or backend errors. */
kv_err kvd_verify_commit(kvd_verify *v, const kvd_backend_ops *be, void *ctx, const kvd_pool *pool,
                         kvd_block_ref blk);

/* Checks hits[0..n) in order; returns how many leading ones still have their committed bytes
 * (blocks without a sum count as good). The first one that does not is quarantined in pool
 * and logged with its pool id and hash; the caller gives back its references to it and to
 * every hit after it. Counts the blocks checked in the pool's `verified`. */
size_t kvd_verify_hits(kvd_verify *v, const kvd_backend_ops *be, void *ctx, kvd_pool *pool,
                       uint32_t pool_id, const kvd_block_ref *hits, size_t n);

/* Frees the sums. Idempotent. */
void kvd_verify_free(kvd_verify *v);

#endif
