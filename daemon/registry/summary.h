/* kvd_summaries: IceCache's page summaries of one pool's T0 blocks (docs/ICECACHE.md).
 *
 * A pool attached with Layout.summaries keeps, beside each committed block, the per-channel min,
 * max and mean of its keys for every (layer, KV head) (kernels' kvk_page_summaries layout:
 * [layers][kv_heads][3][head_dim] float32). The daemon computes a summary itself when the block
 * is committed, from the block's bytes as the backend reads them (device memory included), so
 * a client can never make it disagree with the data. A lower tier's copy of the block carries a
 * copy of the summary (daemon/tiers: the tier entry), and a promotion puts it back beside the
 * T0 block, so a summary survives demotion and promotion unchanged; a block that comes up from
 * a T2 record found by a restart's scan gets its summary computed again from its bytes.
 * Entries are per block id with the block's generation: a reused record never serves an old
 * summary. Memory: summary bytes per block slot of the pool, outside the pool-memory budget
 * (like verify-blocks' sums).
 * Loop thread only.
 */
#ifndef KVD_SUMMARY_H
#define KVD_SUMMARY_H

#include <stddef.h>
#include <stdint.h>

#include "common/kv_err.h"
#include "daemon/core/backend.h"
#include "daemon/core/pool.h"

typedef struct kvd_summaries {
    float *v;      /* [cap][per] summaries by block id */
    uint32_t *gen; /* [cap] generation + 1 of the block each holds (0: none) */
    uint32_t cap;  /* block ids covered */
    size_t per;    /* floats of one summary */
} kvd_summaries;

/* Floats of one block's summary for layout l. */
size_t kvd_summary_floats(const kv_layout *l);

/* Computes the summary of block blk of pool from its bytes into out (kvd_summary_floats
 * floats). KV_ENOENT when its segment is gone, backend errors, KV_ENOMEM. */
kv_err kvd_summary_compute(const kvd_backend_ops *be, void *ctx, const kvd_pool *pool, uint32_t id,
                           float *out);

/* Records the summary of a block just committed (computed from its bytes), or, with src, the
 * given one (a promotion). KV_ENOMEM, backend errors. */
kv_err kvd_summaries_set(kvd_summaries *s, const kvd_backend_ops *be, void *ctx,
                         const kvd_pool *pool, kvd_block_ref blk, const float *src);

/* The summary of blk when one was recorded at its generation, else NULL. */
const float *kvd_summaries_get(const kvd_summaries *s, kvd_block_ref blk);

/* Frees everything. Idempotent. */
void kvd_summaries_free(kvd_summaries *s);

#endif
