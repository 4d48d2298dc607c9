/* kvd_commons: the commons, where a block enters only after min-tenants distinct tenants
 * committed its hash in their own domains; the daemon then copies one of those blocks into the
 * commons pool of the same model (host or GPU memory) and caches it there (docs/TENANCY.md).
 * Part of the registry. Loop thread only.
 */
#ifndef KVD_COMMONS_H
#define KVD_COMMONS_H

#include <stdint.h>

#include "common/kv_hash.h"
#include "daemon/core/pool.h"
#include "daemon/registry/registry.h"

/* Counts that tenant committed hash h as block blk of pool pool_id (a private or group pool).
 * When min-tenants distinct tenants have and the commons pool of that model lacks h, copies the
 * block into the commons (memcpy for host pools; cuMemcpyDtoD and a synchronize for GPU pools)
 * and caches it there. Failures (no memory in the budget) only skip the promotion. Counting is
 * lossy (a fixed table; a colliding hash restarts the count), which can only delay a promotion,
 * never make one early. Returns the commons pool when h entered it now (KV events publish it),
 * with *parent set to the hash of the commons block it was chained to (*has_parent 0: none);
 * else NULL. */
kvd_reg_pool *kvd_commons_count_commit(kvd_registry *g, uint32_t pool_id, uint32_t tenant,
                                       kvd_block_ref blk, kv_hash128 h, kv_hash128 *parent,
                                       int *has_parent);

#endif
