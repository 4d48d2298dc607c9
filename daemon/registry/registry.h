/* kvd_registry: every pool of the daemon, keyed by (model, layout shape, domain), and what is
 * decided across pools: the shared memory budget (`pool-memory`) and parking, the pools one
 * attach makes (its own, one per group, the commons) within max-pools and the tenant's quota,
 * pools freed when idle and empty, open sessions per tenant (max-sessions), quota changes, the
 * commons promotion (daemon/registry/commons.h) and the event ring of admin `events`.
 *
 * The registry sits above the pools (daemon/core), the backends (daemon/mem) and the tenants
 * (daemon/tenancy), and below the request handlers (daemon/proto), the admin commands
 * (daemon/ops) and the daemon's assembly (daemon/app). It never sees a connection. The config
 * it reads is the daemon's live copy (admin `config set` changes runtime options in place).
 * Loop thread only.
 */
#ifndef KVD_REGISTRY_H
#define KVD_REGISTRY_H

#include <stddef.h>
#include <stdint.h>

#include "common/kv_err.h"
#include "common/kv_hash.h"
#include "common/kv_layout.h"
#include "daemon/config/config.h"
#include "daemon/core/backend.h"
#include "daemon/core/duel.h"
#include "daemon/core/events.h"
#include "daemon/core/index.h"
#include "daemon/core/pool.h"
#include "daemon/mem/backend_cuda.h"
#include "daemon/registry/summary.h"
#include "daemon/registry/verify.h"
#include "daemon/tenancy/quota.h"
#include "daemon/tenancy/tenant.h"

#define KVD_MAX_BLOCKS_PER_SEGMENT 65536 /* caps metadata per segment for tiny blocks */

/* Pool flags (part of a pool's key: pools that differ only by them share nothing). */
#define KVD_POOL_LOSSY_TIERS 1u /* its layout asked for lossy lower tiers (docs/TIERS.md) */
#define KVD_POOL_SUMMARIES 2u   /* its layout asked for page summaries (docs/ICECACHE.md) */

/* One pool of the registry: key (model_id, layout shape, flags, domain) -> kvd_pool. */
typedef struct kvd_reg_pool {
    uint32_t pool_id;                           /* > 0, never reused */
    char model_id[KV_WIRE_MAX_MODEL_ID + 1];    /* NUL-terminated */
    kv_layout layout;                           /* shape (derived fields filled) */
    uint32_t flags;                             /* KVD_POOL_*: part of the key */
    uint32_t domain;                            /* the owner's domain: a tenant id, a group, the
                                                   commons (daemon/tenancy/tenant.h) */
    uint64_t segment_bytes;                     /* bytes of one segment's memory */
    uint64_t seg_cost;                          /* what a new segment costs the budget: its
                                                   memory and its block records */
    kv_hash128 seed;                            /* hash_seed sent to clients: model and layout */
    kv_hash128 model_key;                       /* model, layout and flags, in every hash mode
                                                   (hash-mode vllm gives all pools one seed) */
    kvd_pool *pool;                             /* owned */
    uint32_t links[KVD_MAX_DOMAINS_PER_TENANT]; /* private pool: pool ids of the same model in
                                                   the tenant's other domains, lookup order */
    uint32_t nlinks;                            /* used entries of links */
    uint32_t commons_id;                        /* pool id of the same model's commons; 0 none */
    uint32_t creator;                           /* tenant whose attach created it (max-pools) */
    uint32_t nsessions;                         /* sessions that attached it (or it as a link) */
    kvd_verify verify;                          /* verify-blocks: checksums of its blocks */
    kvd_summaries summ;                         /* KVD_POOL_SUMMARIES: its blocks' summaries */
    void *tiers;    /* the tiers layer's state of this pool (daemon/tiers), or NULL */
    kvd_duel *duel; /* evict-duel: the minis that pick its leaf order (core/duel.h), or NULL */
} kvd_reg_pool;

typedef struct kvd_registry {
    const kvd_config *cfg;       /* the daemon's live options (not owned) */
    kvd_tenants *tenants;        /* peer credentials -> tenant (not owned) */
    const kvd_backend_ops *be;   /* segment memory (not owned) */
    void *be_ctx;                /* be's context */
    const kvd_backend_sel *sel;  /* the chosen backend: GPU context for copies, device UUID */
    uint64_t (*clock)(void *);   /* milliseconds of the loop clock (pins, parking) */
    void *clock_arg;             /* clock's argument */
    kvd_index *index;            /* the one prefix index (owned) */
    kvd_reg_pool *pools;         /* live pools, sorted by pool_id */
    uint32_t npools, pools_cap;  /* used and allocated entries */
    uint32_t next_pool_id;       /* next pool id to hand out */
    uint32_t *sessions;          /* [KVD_MAX_TENANTS] open sessions per tenant; lazy */
    struct kvd_commons *commons; /* commits counted toward the commons (registry/commons.h);
                                    made on first use, with its destructor: */
    void (*commons_free)(struct kvd_commons *c);
    kvd_events events; /* eviction/refusal ring and per-tenant counters (admin) */
    /* Told just before a pool is freed (idle reclaim, pool_close, fini), so a layer above that
     * keeps state per pool (daemon/tiers) lets it go; NULL: nobody. */
    void (*pool_gone)(void *arg, kvd_reg_pool *p);
    /* Asked before an idle empty pool is freed: 1 keeps it (its lower tiers still hold blocks,
     * which are a cache as much as T0's). NULL: free it. Same argument as pool_gone. */
    int (*pool_keep)(void *arg, const kvd_reg_pool *p);
    void *pool_gone_arg;
    int vllm;                      /* hash-mode vllm: clients hash with vLLM's sha256_cbor */
    uint8_t none_hash[32];         /* vllm: NONE_HASH (vllm-hash-seed, or random per run) */
    struct kvd_reqtrace *reqtrace; /* admin `trace start`: the request trace (reqtrace.h) */
    uint64_t duel_pending;         /* evict-duel: picked Lookups waiting over all pools */
    uint32_t duel_next;            /* evict-duel: the pool kvd_registry_duel_step tries first */
} kvd_registry;

/* What kvd_registry_init needs; the registry keeps the pointers. */
typedef struct kvd_registry_deps {
    const kvd_config *cfg; /* pool-memory, segment-bytes, evict-policy, hugepages,
                              max-pools, index-entries, events */
    kvd_tenants *tenants;
    const kvd_backend_sel *sel; /* ops and ctx of the chosen backend */
    uint64_t (*clock)(void *);
    void *clock_arg;
} kvd_registry_deps;

/* Makes the index (index-entries) and the event ring (events), and in hash-mode vllm the
 * NONE_HASH every pool's chain starts from (every pool's seed is its key). KV_ENOMEM; KV_EINVAL
 * for a vllm-hash-seed vLLM could not hash (not UTF-8). */
kv_err kvd_registry_init(kvd_registry *g, const kvd_registry_deps *d);

/* Frees every pool, the index, the commons counters and the event ring. Idempotent. */
void kvd_registry_fini(kvd_registry *g);

/* The registry's clock now (milliseconds). */
uint64_t kvd_registry_now(const kvd_registry *g);

/* The pool with this id, its clock advanced to now; NULL when unknown. Pointers move when a pool
 * is made or freed: hold ids across such calls. O(log pools). */
kvd_reg_pool *kvd_registry_pool(kvd_registry *g, uint32_t pool_id);

/* The pool with this id without touching its clock (reports); NULL when unknown. */
const kvd_reg_pool *kvd_registry_peek(const kvd_registry *g, uint32_t pool_id);

/* AttachPool for tenant: finds or makes its pool of (model_id, layout, flags: KVD_POOL_*) and
 * the same model's pool (same flags) in each of its other domains (groups, the commons), in
 * lookup order. The pools it must
 * make fit max-pools (KV_ENOSPC) and the tenant's max-pools quota (KV_EQUOTA) all together or
 * none is made. A linked pool that cannot get its first segment (pool-memory spent) is left
 * out (logged). On success ids[0] is the tenant's pool and ids[1..*n) its links; each gets
 * one more session (kvd_registry_sessions_gone gives them back). *conflict is 1 when another
 * pool of model_id has a different layout shape (logged at WARN; with strict-layouts the attach
 * is refused, KV_EINVAL). msg gets a sentence on error. */
kv_err kvd_registry_attach(kvd_registry *g, uint32_t tenant, const char *model_id,
                           const kv_layout *l, uint32_t flags, uint32_t *ids, uint32_t *n,
                           int *conflict, char *msg);

/* A pool of (model_id, layout, domain) outside any attach (the isolation self-test): found or
 * made with no creator and no session. */
kv_err kvd_registry_pool_open(kvd_registry *g, const char *model_id, const kv_layout *l,
                              uint32_t domain, uint32_t *pool_id, char *msg);

/* verify-blocks (registry/verify.h): records the checksum of blk, a block just committed in p
 * (not a duplicate). A failure to read or record it is logged and leaves the block unchecked. */
void kvd_registry_verify_commit(kvd_registry *g, kvd_reg_pool *p, kvd_block_ref blk);

/* verify-blocks: how many leading hits[0..n) of pool p still have their committed bytes; the
 * first one that does not is quarantined (the caller gives back its references from there). */
size_t kvd_registry_verify_hits(kvd_registry *g, kvd_reg_pool *p, const kvd_block_ref *hits,
                                size_t n);

/* Frees a pool no session has attached, whatever it holds (the self-test's own pools). */
void kvd_registry_pool_close(kvd_registry *g, uint32_t pool_id);

/* A session closed: the pools it had attached (ids, each once) lose a session, and pools no
 * session uses that hold no block are freed. */
void kvd_registry_sessions_gone(kvd_registry *g, const uint32_t *ids, uint32_t n);

/* Allocate of n blocks in pool p for a session: decides first whether free blocks, the pool's
 * evictable cache, growth within the budget and other pools' idle segments can supply them
 * (KV_ENOSPC with a sentence if not: nothing changed), then parks what it must elsewhere,
 * sets the pool's segment limit and allocates. Evictions are recorded in the event ring. */
kv_err kvd_registry_allocate(kvd_registry *g, kvd_reg_pool *p, uint32_t n, uint64_t session,
                             uint32_t tenant, kvd_block_ref *out, char *msg);

/* Sets p's segment limit from the shared budget (live segments plus what the budget still
 * holds); returns the segments it may still add. */
uint32_t kvd_registry_budget_apply(kvd_registry *g, kvd_reg_pool *p);

/* Bytes the budget counts now: resident segment memory and every pool's metadata. */
uint64_t kvd_registry_budget_used(const kvd_registry *g);

/* A session of tenant opened (Hello) or closed. KV_ENOMEM. */
kv_err kvd_registry_session_open(kvd_registry *g, uint32_t tenant);
void kvd_registry_session_close(kvd_registry *g, uint32_t tenant);

/* Open sessions of tenant. */
uint64_t kvd_registry_sessions(const kvd_registry *g, uint32_t tenant);

/* Sets in p's pool the guarantee of every tenant that may write p's domain. */
void kvd_registry_apply_guarantees(kvd_registry *g, kvd_reg_pool *p);

/* The quota of the tenant named `tenant` (its own, or the default it inherits). KV_ENOENT when
 * no such tenant is known. */
kv_err kvd_registry_quota_get(kvd_registry *g, const char *tenant, kvd_quota *out);

/* Replaces the tenant's quota ("default": the default of tenants without their own) and
 * applies it at once: guarantees into every pool the tenant can use; later requests are checked
 * against the new limits (blocks held above a lowered limit stay held). KV_ENOENT. */
kv_err kvd_registry_quota_set(kvd_registry *g, const char *tenant, const kvd_quota *q);

/* Sets one limit by name (KVD_QUOTA_NAMES) from text and applies it (admin `quota set`).
 * KV_ENOENT (tenant or name), KV_EINVAL (value); err gets a sentence. */
kv_err kvd_registry_quota_set_field(kvd_registry *g, const char *tenant, const char *name,
                                    const char *value, char *err, size_t errlen);

/* The tenant's usage through sink: "sessions", and summed over pools "held", "cached",
 * "pinned". KV_ENOENT unknown tenant. */
kv_err kvd_registry_quota_usage(kvd_registry *g, const char *tenant, kvd_stat_sink sink, void *arg);

/* evict-duel: queues a Lookup of hashes h[0..n) for pool p's eviction duel (core/duel.h) when
 * the duel picks it; nothing when p has no duel. */
void kvd_registry_duel_observe(kvd_registry *g, kvd_reg_pool *p, const kv_hash128 *h, size_t n);

/* evict-duel: runs up to max waiting Lookups through their pools' duels, one pool after another
 * (round robin), each pool's oldest first. Returns how many still wait (g->duel_pending). */
uint64_t kvd_registry_duel_step(kvd_registry *g, uint32_t max);

/* The `evict-policy` option's value as an enum (unknown names: LRU; the config checks names). */
kvd_evict_policy kvd_registry_policy(const kvd_registry *g);

#endif
