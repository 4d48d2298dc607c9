/* kvd_tenancy: the parts of multi-tenancy that sit between the handlers and the pools
 * (docs/TENANCY.md): read-only fds for segments a tenant may only read, guarantees pushed into
 * pools, session counts for quotas, and the commons, where a block enters only after
 * min-tenants distinct tenants committed its hash in their own domains (the daemon then copies
 * one of those blocks into the commons pool of the same model, host or GPU memory).
 * Internal to the server (uses server_int.h). Loop thread only.
 */
#ifndef KVD_TENANCY_H
#define KVD_TENANCY_H

#include <stdint.h>

#include "common/kv_err.h"
#include "common/kv_hash.h"
#include "daemon/pool.h"
#include "daemon/server_int.h"

/* A read-only fd for the memfd fd: reopens it through /proc/self/fd with O_RDONLY (mmap with
 * PROT_WRITE and MAP_SHARED of the result fails with EACCES) and makes the memfd mode 0400, so a
 * non-root receiver cannot reopen its copy writable either. The daemon's own mapping stays
 * writable. *out is the caller's to close. KV_ESYS (logged). */
kv_err kvd_tenancy_ro_fd(int fd, int *out);

/* Sets in sp's pool the guarantee of every tenant that may write sp's domain. */
void kvd_tenancy_apply_guarantees(kvd_server *s, kvd_srv_pool *sp);

/* Open sessions (after Hello) of tenant. O(connections). */
uint64_t kvd_tenancy_sessions(const kvd_server *s, uint32_t tenant);

/* Counts that tenant committed hash h as block blk of pool pool_id (a private or group pool).
 * When min-tenants distinct tenants have and the commons pool of that model lacks h, copies the
 * block into the commons (memcpy for host pools; cuMemcpyDtoD and a synchronize for GPU pools)
 * and caches it there. Failures (no memory in the budget)
 * only skip the promotion. Counting is lossy (a fixed table; a colliding hash restarts the
 * count), which can only delay a promotion, never make one early. */
void kvd_tenancy_count_commit(kvd_server *s, uint32_t pool_id, uint32_t tenant, kvd_block_ref blk,
                              kv_hash128 h);

/* Frees the commons counters; accepts a server without them. */
void kvd_tenancy_free(kvd_server *s);

#endif
