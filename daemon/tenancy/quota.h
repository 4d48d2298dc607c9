/* kvd_quota: per-tenant limits, read and changed at run time (admin `quota get|set`).
 *
 * A tenant's quota has ten limits. The block limits apply per pool (each (model, layout,
 * domain) pool counts the tenant's blocks separately, as kvd_pool_tenant_usage does); the
 * session limit and tier-total-bytes apply to the whole daemon. 0 means "no limit" (for the
 * guarantees: "no share"). The *-bytes limits take a size suffix (64M).
 *
 * - max-held: blocks the tenant holds in one pool: WRITING leases + references on committed
 *   blocks. Allocate past it is KV_EQUOTA; Lookup returns at most what it leaves.
 * - guarantee: cached blocks of the tenant in one pool that capacity eviction for other
 *   tenants does not take while the tenant is at or under it (kvd_pool_set_guarantee).
 * - max-pinned: pinned blocks charged to the tenant in one pool; Pin past it is KV_EQUOTA.
 * - max-sessions: open sessions of the tenant; a Hello past it is KV_EQUOTA.
 * - max-pools: live pools the tenant's AttachPool requests created (a new model or layout,
 *   with its linked pools); an attach that would create one more is KV_EQUOTA.
 * - tier-max: blocks charged to the tenant in each lower tier (T1, T2) of one pool: a block
 *   of the tenant's that goes down past it takes the place of the tenant's own oldest block
 *   of that tier (docs/TIERS.md, "Tenants in the lower tiers").
 * - tier-max-bytes: the same in bytes: the tenant's T1 blocks as stored there (a compressed
 *   block counts its compressed size) and its T2 records (a slot's size each) in each lower
 *   tier of one pool.
 * - tier-guarantee: blocks of the tenant in each lower tier of one pool that other tenants'
 *   blocks coming down do not evict while the tenant is at or under it.
 * - tier-guarantee-bytes: the same in bytes (counted as tier-max-bytes counts them); with both
 *   set, the tenant's blocks are protected while it is at or under either.
 * - tier-total-bytes: bytes of the tenant in each lower tier over all of its pools together
 *   (counted as tier-max-bytes counts them): a block of the tenant's that goes down past it
 *   takes the place of the tenant's oldest block in the pool where it holds the most there.
 *
 * Tenants without a `quota` line in the tenants file get the `quota default` line (or no limits).
 * This module is the limits and their names; the registry applies a change (guarantees into
 * every pool) and reports usage.
 */
#ifndef KVD_QUOTA_H
#define KVD_QUOTA_H

#include <stddef.h>
#include <stdint.h>

#include "common/kv_err.h"
#include "daemon/core/pool.h"

typedef struct kvd_quota {
    uint64_t max_held;       /* blocks held per pool (WRITING + referenced); 0 = unlimited */
    uint64_t guarantee;      /* cached blocks per pool protected from others' eviction; 0 = none */
    uint64_t max_pinned;     /* pinned blocks per pool; 0 = unlimited */
    uint64_t max_sessions;   /* open sessions in the daemon; 0 = unlimited */
    uint64_t max_pools;      /* pools the tenant's attaches created and that live; 0 = unlimited */
    uint64_t tier_max;       /* blocks per lower tier per pool; 0 = unlimited */
    uint64_t tier_guarantee; /* blocks per lower tier per pool protected from others; 0 = none */
    uint64_t tier_max_bytes; /* bytes per lower tier per pool; 0 = unlimited */
    uint64_t tier_guarantee_bytes; /* bytes per lower tier per pool protected; 0 = none */
    uint64_t tier_total_bytes;     /* bytes per lower tier over all pools; 0 = unlimited */
} kvd_quota;

/* Names of the limits as the tenants file and the admin command spell them. */
#define KVD_QUOTA_NAMES                                                                            \
    "max-held, guarantee, max-pinned, max-sessions, max-pools, tier-max, tier-guarantee, "         \
    "tier-max-bytes, tier-guarantee-bytes, tier-total-bytes"

/* Sets one limit of q by name (KVD_QUOTA_NAMES) from a decimal text value (the *-bytes limits:
 * with an optional K/M/G/T suffix, kv_parse_size). KV_ENOENT unknown name, KV_EINVAL bad number.
 * Pure; any thread. */
kv_err kvd_quota_parse_field(kvd_quota *q, const char *name, const char *value);

/* Reports q's limits through sink under their names (KVD_QUOTA_NAMES order). Any thread. */
void kvd_quota_report(const kvd_quota *q, kvd_stat_sink sink, void *arg);

/* Getting, setting and applying a tenant's quota at run time, and its usage, need the pools:
 * daemon/registry/registry.h (kvd_registry_quota_*). */

#endif
