/* kvd_registry: the pool table, the shared memory budget and parking, attaches, quotas and
 * session counts (daemon/registry/registry.h). */
#include "daemon/registry/registry.h"

#include <stdio.h>
#include <sys/random.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <xxhash.h>

#include "common/kv_log.h"
#include "common/kv_vllm_hash.h"
#include "daemon/registry/reqtrace.h"
#include "common/kv_wire.h"

#define FAIL(rc, ...)                                                                              \
    do {                                                                                           \
        snprintf(msg, KVD_REG_MSG, __VA_ARGS__);                                                   \
        return (rc);                                                                               \
    } while (0)

#define KVD_REG_MSG 256 /* bytes of the msg buffers callers pass (KV_ERRMSG) */

static void pool_close(kvd_registry *s, uint32_t pool_id);

uint64_t kvd_registry_now(const kvd_registry *g) {
    return g->clock != NULL ? g->clock(g->clock_arg) : 0;
}

void kvd_registry_duel_observe(kvd_registry *g, kvd_reg_pool *p, const kv_hash128 *h, size_t n) {
    if (p->duel == NULL) {
        return;
    }
    size_t before = kvd_duel_pending(p->duel);
    /* Out of memory for the copy: counted as dropped; the Lookup goes on. */
    (void)kvd_duel_observe(p->duel, h, n, kvd_registry_now(g));
    g->duel_pending += kvd_duel_pending(p->duel) - before;
}

uint64_t kvd_registry_duel_step(kvd_registry *g, uint32_t max) {
    for (uint32_t done = 0, tried = 0; done < max && g->duel_pending > 0 && tried < g->npools;) {
        if (g->duel_next >= g->npools) {
            g->duel_next = 0;
        }
        kvd_reg_pool *p = &g->pools[g->duel_next++];
        if (p->duel == NULL || kvd_duel_pending(p->duel) == 0) {
            tried++;
            continue;
        }
        tried = 0;
        /* A mini out of memory is counted (skipped) and made again by a later request. */
        (void)kvd_duel_step(p->duel, p->pool);
        g->duel_pending--;
        done++;
    }
    return g->duel_pending;
}

kvd_evict_policy kvd_registry_policy(const kvd_registry *g) {
    kvd_evict_policy p;
    return kvd_evict_policy_parse(g->cfg->evict_policy, &p) == KV_OK ? p : KVD_EVICT_ADAPTIVE;
}

/* ---- budget and pools ------------------------------------------------------------------ */

/* Bytes of every pool's resident segments (parked ones cost no segment memory) and of every
 * pool's metadata (block records included, parked segments' too): what pool-memory bounds, so
 * that many pools of tiny blocks cannot take the daemon far past it. O(pools). */
static uint64_t budget_used(const kvd_registry *s) {
    uint64_t used = 0;
    for (uint32_t i = 0; i < s->npools; i++) {
        used += kvd_pool_resident_bytes(s->pools[i].pool) + kvd_pool_meta_bytes(s->pools[i].pool);
    }
    return used;
}

/* Segments pool sp can add with `bytes` of budget: its own parked ones first (unparking costs
 * their memory only: the block records stayed), then new ones (memory and records). */
static uint64_t segments_for(const kvd_reg_pool *sp, uint64_t bytes) {
    uint64_t parked = kvd_pool_parked_segments(sp->pool);
    uint64_t k1 = bytes / sp->segment_bytes;
    if (k1 > parked) {
        k1 = parked;
    }
    return k1 + (bytes - k1 * sp->segment_bytes) / sp->seg_cost;
}

/* Sets sp's segment limit to its live segments plus what the shared budget still holds, so the
 * pool's own allocate grows while memory is left and evicts within itself after that. Returns
 * the number of segments it may still add. */
static uint32_t budget_apply(kvd_registry *s, kvd_reg_pool *sp) {
    uint64_t used = budget_used(s);
    uint64_t left = used < s->cfg->pool_memory ? s->cfg->pool_memory - used : 0;
    uint32_t live = kvd_pool_resident_segments(sp->pool);
    uint64_t extra = segments_for(sp, left);
    uint64_t max = live + extra;
    if (max > KVD_MAX_SEGMENTS) {
        max = KVD_MAX_SEGMENTS;
    }
    kvd_pool_set_max_segments(sp->pool, (uint32_t)max);
    return (uint32_t)(max - (live < max ? live : max));
}

static uint64_t budget_left(const kvd_registry *s) {
    uint64_t used = budget_used(s);
    return used < s->cfg->pool_memory ? s->cfg->pool_memory - used : 0;
}

/* Frees budget for `bytes` more of segments in pool `self` (NULL: a pool about to be created)
 * by parking idle segments of other pools: each step takes the pool with the most idle memory
 * (parkable segments x segment size; ties: the least recently used segment) and parks its best
 * segment (fewest cached blocks, least recently used). With free_only, only segments without a
 * cached block are taken: self could manage by evicting its own cache, and another pool's cache
 * is not worth less than ours, but its unused memory is. Backends without segment_discard park
 * nothing. Returns the budget left afterwards (may still be short of bytes). */
static uint64_t make_room(kvd_registry *s, const kvd_reg_pool *self, uint64_t bytes,
                          int free_only) {
    uint64_t left = budget_left(s);
    uint64_t now = kvd_registry_now(s);
    while (left < bytes) {
        kvd_reg_pool *victim = NULL;
        kvd_park_candidate best = {0, 0, 0, 0};
        for (uint32_t i = 0; i < s->npools; i++) {
            kvd_reg_pool *vp = &s->pools[i];
            kvd_park_candidate c;
            if (vp == self) {
                continue;
            }
            kvd_pool_set_now(vp->pool, now); /* expired pins must not keep memory */
            if (kvd_pool_park_candidate(vp->pool, &c) != KV_OK || (free_only && c.cached > 0)) {
                continue;
            }
            uint64_t idle = (uint64_t)c.parkable * vp->segment_bytes;
            uint64_t best_idle =
                victim == NULL ? 0 : (uint64_t)best.parkable * victim->segment_bytes;
            if (victim == NULL || idle > best_idle ||
                (idle == best_idle && c.last_access < best.last_access)) {
                victim = vp;
                best = c;
            }
        }
        if (victim == NULL) {
            break;
        }
        kv_err rc = kvd_pool_park(victim->pool, best.seg);
        if (rc != KV_OK) {
            KV_LOG(WARN, "KVD-POOL-PARK", "pool %u: parking segment %u failed: %s", victim->pool_id,
                   best.seg, kv_strerror(rc));
            break;
        }
        KV_LOG(DEBUG, "KVD-POOL-PARK",
               "pool %u: parked segment %u (%u cached blocks evicted) for pool %u", victim->pool_id,
               best.seg, best.cached, self != NULL ? self->pool_id : 0);
        left = budget_left(s);
    }
    return left;
}

static uint32_t gcd32(uint64_t a, uint64_t b) {
    while (b != 0) {
        uint64_t t = a % b;
        a = b;
        b = t;
    }
    return (uint32_t)a;
}

/* The backend's mapping granularity (CUDA VMM: the allocation granularity), at least a page. */
static uint64_t backend_align(const kvd_registry *s) {
    uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);
    uint64_t a = s->be->align != NULL ? s->be->align(s->be_ctx) : 0;
    return a > page ? a : page;
}

/* Blocks per segment: floor(segment-bytes / block_bytes), rounded down to a multiple of m, the
 * smallest count that makes nblocks * kv_block_bytes a multiple of page: the backend's mapping
 * granularity for LAYER_MAJOR pools (so clients can map each section at its offset), else the
 * page size (at least m). */
static uint32_t pick_blocks_per_segment(const kv_layout *l, uint64_t segment_bytes, uint64_t page) {
    uint64_t m = page / gcd32(l->kv_block_bytes, page);
    uint64_t n = segment_bytes / l->block_bytes;
    if (n > KVD_MAX_BLOCKS_PER_SEGMENT) {
        n = KVD_MAX_BLOCKS_PER_SEGMENT;
    }
    n = n / m * m;
    if (n < m) {
        n = m;
    }
    return (uint32_t)n;
}

static kv_hash128 pool_seed(const char *model_id, const kv_layout *l) {
    uint8_t buf[KV_WIRE_MAX_MODEL_ID + 24];
    size_t n = strlen(model_id);
    memcpy(buf, model_id, n);
    uint32_t f[6] = {l->num_layers,       l->num_kv_heads,    l->head_dim,
                     l->tokens_per_block, (uint32_t)l->dtype, (uint32_t)l->arrangement};
    for (int i = 0; i < 6; i++) {
        buf[n++] = (uint8_t)f[i];
        buf[n++] = (uint8_t)(f[i] >> 8);
        buf[n++] = (uint8_t)(f[i] >> 16);
        buf[n++] = (uint8_t)(f[i] >> 24);
    }
    XXH128_hash_t h = XXH3_128bits(buf, n);
    kv_hash128 out = {h.low64, h.high64};
    return out;
}

/* Every request names its pool, so this is on the hot path: a binary search, because s->pools is
 * sorted by id (ids only grow, pool_open appends, kvd_handlers_pool_close keeps the order). A
 * linear scan cost a daemon with 100 pools about 500 instructions per request. */
static kvd_reg_pool *pool_by_id(kvd_registry *s, uint32_t id) {
    uint32_t lo = 0, hi = s->npools;
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (s->pools[mid].pool_id < id) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    return lo < s->npools && s->pools[lo].pool_id == id ? &s->pools[lo] : NULL;
}

static int same_shape(const kv_layout *a, const kv_layout *b) {
    return a->num_layers == b->num_layers && a->num_kv_heads == b->num_kv_heads &&
           a->head_dim == b->head_dim && a->tokens_per_block == b->tokens_per_block &&
           a->dtype == b->dtype && a->arrangement == b->arrangement;
}

/* Finds or creates the pool for (model_id, layout, domain); a new pool gets its first segment
 * so that new_segments_from = 0 never has to mean anything. */
/* Frees every pool that no session uses and that holds nothing: its memory and metadata go
 * back (a pool with cached blocks stays, as a cache; once parking or eviction empties it, it
 * goes too). O(pools). */
static void reclaim_pools(kvd_registry *s) {
    /* cuda-ipc: a worker whose connection broke may still have a pool's IPC memory open, and
     * freeing it under an importer is undefined in CUDA; such pools live until kvd stops. */
    if (s->be->kind == KVD_MEM_CUDA_IPC) {
        return;
    }
    for (uint32_t i = 0; i < s->npools;) {
        kvd_reg_pool *p = &s->pools[i];
        if (p->nsessions == 0 && !kvd_pool_in_use(p->pool) &&
            (s->pool_keep == NULL || !s->pool_keep(s->pool_gone_arg, p))) {
            KV_LOG(INFO, "KVD-POOL-FREE", "pool %u (model %s): no session and no block; freed",
                   p->pool_id, p->model_id);
            pool_close(s, p->pool_id); /* keeps the order; i now names the next */
        } else {
            i++;
        }
    }
}

/* The pool of (model, layout) in domain, or NULL. */
static kvd_reg_pool *pool_find(kvd_registry *s, const char *model_id, const kv_layout *l,
                               uint32_t flags, uint32_t domain) {
    for (uint32_t i = 0; i < s->npools; i++) {
        kvd_reg_pool *sp = &s->pools[i];
        if (sp->domain == domain && strcmp(sp->model_id, model_id) == 0 &&
            same_shape(&sp->layout, l) && sp->flags == flags) {
            return sp;
        }
    }
    return NULL;
}

/* Whether `more` new pools fit max-pools and creator's max-pools quota: KV_ENOSPC / KV_EQUOTA
 * with a sentence otherwise. */
static kv_err pools_fit(kvd_registry *s, uint32_t creator, uint32_t more, char *msg) {
    if (s->npools + (uint64_t)more > s->cfg->max_pools) {
        FAIL(KV_ENOSPC,
             "kvd has %u of max-pools (%llu) pools in use; this attach needs %u more (a new model "
             "or layout needs its own pool and one in each of the tenant's groups and the "
             "commons; raise max-pools, or let pools of models no longer used empty)",
             s->npools, (unsigned long long)s->cfg->max_pools, more);
    }
    uint64_t max_pools =
        creator < KVD_MAX_TENANTS ? kvd_tenants_quota(s->tenants, creator)->max_pools : 0;
    if (max_pools != 0) {
        uint64_t mine = 0;
        for (uint32_t i = 0; i < s->npools; i++) {
            mine += s->pools[i].creator == creator;
        }
        if (mine + more > max_pools) {
            FAIL(KV_EQUOTA,
                 "tenant %s: quota max-pools is %llu; its attaches made %llu and this one needs "
                 "%u more (its own pool and one per group and the commons)",
                 kvd_tenants_name(s->tenants, creator), (unsigned long long)max_pools,
                 (unsigned long long)mine, more);
        }
    }
    return KV_OK;
}

static kv_err pool_open(kvd_registry *s, const char *model_id, const kv_layout *l, uint32_t flags,
                        uint32_t domain, uint32_t creator, kvd_reg_pool **out, char *msg) {
    kvd_reg_pool *found = pool_find(s, model_id, l, flags, domain);
    if (found != NULL) {
        *out = found;
        return KV_OK;
    }
    kv_err frc = pools_fit(s, creator, 1, msg);
    if (frc != KV_OK) {
        return frc;
    }
    if (s->npools == s->pools_cap) {
        uint32_t ncap = s->pools_cap == 0 ? 8 : s->pools_cap * 2;
        kvd_reg_pool *n = realloc(s->pools, sizeof(*n) * ncap);
        if (n == NULL) {
            FAIL(KV_ENOMEM, "no memory for a new pool");
        }
        s->pools = n;
        s->pools_cap = ncap;
    }
    kvd_reg_pool sp;
    memset(&sp, 0, sizeof(sp));
    snprintf(sp.model_id, sizeof(sp.model_id), "%s", model_id);
    sp.layout = *l;
    sp.flags = flags;
    sp.domain = domain;
    sp.creator = creator;
    sp.model_key = pool_seed(model_id, l);
    sp.seed = s->vllm ? kv_vllm_hash_key(s->none_hash) : sp.model_key;
    sp.model_key.lo ^= (uint64_t)flags * 0x9E3779B97F4A7C15ull;
    kvd_pool_config pc;
    memset(&pc, 0, sizeof(pc));
    pc.pool_id = s->next_pool_id;
    pc.domain = domain;
    pc.layout = *l;
    pc.blocks_per_segment = pick_blocks_per_segment(
        l, s->cfg->segment_bytes,
        l->arrangement == KV_LAYER_MAJOR ? backend_align(s) : (uint64_t)sysconf(_SC_PAGESIZE));
    pc.max_segments = 1;
    pc.policy = kvd_registry_policy(s);
    uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);
    if (s->cfg->hugepages) {
        page = 2ull << 20;
    }
    if (backend_align(s) > page) {
        page = backend_align(s); /* GPU segments are granularity multiples */
    }
    sp.segment_bytes = (kv_layout_segment_bytes(l, pc.blocks_per_segment) + page - 1) / page * page;
    /* A new segment also costs its block records; a new pool its own metadata (an estimate
     * until the pool exists: its record and first slots and tenants). */
    sp.seg_cost =
        sp.segment_bytes + (uint64_t)pc.blocks_per_segment * kvd_pool_meta_bytes_per_block();
    uint64_t need = sp.seg_cost + KVD_POOL_META_BASE;
    if (make_room(s, NULL, need, 0) < need) {
        uint64_t used = budget_used(s);
        FAIL(KV_ENOSPC,
             "pool-memory is spent: %llu of %llu bytes used and no pool has an idle segment to "
             "give back; a pool of this layout needs %llu (a segment and its metadata)",
             (unsigned long long)used, (unsigned long long)s->cfg->pool_memory,
             (unsigned long long)need);
    }
    kv_err rc = kvd_pool_alloc(&pc, s->index, s->be, s->be_ctx, &sp.pool);
    if (rc != KV_OK) {
        FAIL(rc, "cannot create the pool: %s", kv_strerror(rc));
    }
    rc = kvd_pool_grow(sp.pool, NULL);
    if (rc != KV_OK) {
        kvd_pool_free(sp.pool);
        FAIL(rc == KV_ESYS ? KV_ESYS : rc,
             "cannot create the pool's first segment (%llu bytes): %s",
             (unsigned long long)sp.segment_bytes, kv_strerror(rc));
    }
    if (pc.policy == KVD_EVICT_ADAPTIVE && s->cfg->evict_duel &&
        kvd_duel_alloc(&sp.duel) != KV_OK) {
        kvd_pool_free(sp.pool);
        FAIL(KV_ENOMEM, "no memory for the pool's eviction duel");
    }
    sp.pool_id = s->next_pool_id++;
    KV_ASSERT(s->npools == 0 || s->pools[s->npools - 1].pool_id < sp.pool_id); /* pool_by_id */
    s->pools[s->npools] = sp;
    *out = &s->pools[s->npools++];
    kvd_registry_apply_guarantees(s, *out);
    KV_LOG(INFO, "KVD-POOL-NEW",
           "pool %u: model %s, %u layers x %u heads x %u dim, %s, %u tokens/block, %llu "
           "bytes/block, %u blocks/segment, domain %u",
           sp.pool_id, model_id, l->num_layers, l->num_kv_heads, l->head_dim,
           kv_dtype_name(l->dtype), l->tokens_per_block, (unsigned long long)l->block_bytes,
           pc.blocks_per_segment, domain);
    return KV_OK;
}

/* Bytes other pools could give back by parking (their idle segments, guarantees kept): what
 * make_room can find, counted without changing anything. O(segments of other pools). */
static uint64_t parkable_elsewhere(kvd_registry *s, const kvd_reg_pool *self) {
    uint64_t bytes = 0;
    uint64_t now = kvd_registry_now(s);
    for (uint32_t i = 0; i < s->npools; i++) {
        kvd_reg_pool *vp = &s->pools[i];
        kvd_park_candidate c;
        if (vp == self) {
            continue;
        }
        kvd_pool_set_now(vp->pool, now); /* expired pins must not keep memory */
        if (kvd_pool_park_candidate(vp->pool, &c) == KV_OK) {
            bytes += (uint64_t)c.parkable * vp->segment_bytes;
        }
    }
    return bytes;
}

/* Before p allocates n blocks: when its free blocks and the budget left fall short, other
 * pools' idle segments are parked for it (their unused ones only while p's own cache covers
 * the rest). p's allocate then unparks its own parked segments or grows. */
static void make_room_for(kvd_registry *s, kvd_reg_pool *p, uint32_t n) {
    kvd_pool_counts acc = kvd_pool_counts_get(p->pool);
    if (acc.free >= n) {
        return;
    }
    uint64_t bps = kvd_pool_config_get(p->pool)->blocks_per_segment;
    uint64_t need = n - acc.free;
    uint64_t bytes = (need + bps - 1) / bps * p->seg_cost;
    uint64_t left = budget_left(s);
    if (left >= bytes) {
        return;
    }
    int own_ok = acc.evictable + segments_for(p, left) * bps >= need;
    make_room(s, p, bytes, own_ok);
}

/* ---- quotas ---- */

/* UINT32_MAX for "default", else the tenant's id. */
static kv_err quota_target(kvd_registry *s, const char *tenant, uint32_t *id) {
    if (strcmp(tenant, "default") == 0) {
        *id = UINT32_MAX;
        return KV_OK;
    }
    return kvd_tenants_find(s->tenants, tenant, id);
}

kv_err kvd_registry_quota_get(kvd_registry *s, const char *tenant, kvd_quota *out) {
    uint32_t id;
    kv_err rc = quota_target(s, tenant, &id);
    if (rc != KV_OK) {
        return rc;
    }
    *out = *kvd_tenants_quota(s->tenants, id);
    return KV_OK;
}

kv_err kvd_registry_quota_set(kvd_registry *s, const char *tenant, const kvd_quota *q) {
    uint32_t id;
    kv_err rc = quota_target(s, tenant, &id);
    if (rc != KV_OK) {
        return rc;
    }
    kvd_tenants_set_quota(s->tenants, id, q);
    for (uint32_t i = 0; i < s->npools; i++) {
        kvd_registry_apply_guarantees(s, &s->pools[i]);
    }
    KV_LOG(INFO, "KVD-QUOTA",
           "quota of %s: max-held %llu, guarantee %llu, max-pinned %llu, max-sessions %llu, "
           "max-pools %llu, tier-max %llu, tier-guarantee %llu, tier-max-bytes %llu, "
           "tier-guarantee-bytes %llu, tier-total-bytes %llu",
           tenant, (unsigned long long)q->max_held, (unsigned long long)q->guarantee,
           (unsigned long long)q->max_pinned, (unsigned long long)q->max_sessions,
           (unsigned long long)q->max_pools, (unsigned long long)q->tier_max,
           (unsigned long long)q->tier_guarantee, (unsigned long long)q->tier_max_bytes,
           (unsigned long long)q->tier_guarantee_bytes, (unsigned long long)q->tier_total_bytes);
    return KV_OK;
}

kv_err kvd_registry_quota_set_field(kvd_registry *s, const char *tenant, const char *name,
                                    const char *value, char *err, size_t errlen) {
    kvd_quota q;
    kv_err rc = kvd_registry_quota_get(s, tenant, &q);
    if (rc != KV_OK) {
        snprintf(err, errlen, "no tenant named %s", tenant);
        return rc;
    }
    rc = kvd_quota_parse_field(&q, name, value);
    if (rc == KV_ENOENT) {
        snprintf(err, errlen, "no limit named %s; limits are %s", name, KVD_QUOTA_NAMES);
        return rc;
    }
    if (rc != KV_OK) {
        snprintf(err, errlen,
                 "%s must be a decimal number of blocks or sessions (the *-bytes limits: a size "
                 "such as 4096, 64K, 1G; 0 = none)",
                 name);
        return rc;
    }
    return kvd_registry_quota_set(s, tenant, &q);
}

kv_err kvd_registry_quota_usage(kvd_registry *s, const char *tenant, kvd_stat_sink sink,
                                void *arg) {
    uint32_t id;
    kv_err rc = kvd_tenants_find(s->tenants, tenant, &id);
    if (rc != KV_OK) {
        return rc;
    }
    kvd_tenant_usage sum = {0, 0, 0};
    for (uint32_t i = 0; i < s->npools; i++) {
        kvd_tenant_usage u = kvd_pool_tenant_usage(s->pools[i].pool, id);
        sum.held += u.held;
        sum.cached += u.cached;
        sum.pinned += u.pinned;
    }
    sink(arg, "sessions", kvd_registry_sessions(s, id));
    sink(arg, "held", sum.held);
    sink(arg, "cached", sum.cached);
    sink(arg, "pinned", sum.pinned);
    return KV_OK;
}

/* ---- the interface --------------------------------------------------------------------- */

static void pool_close(kvd_registry *s, uint32_t pool_id) {
    kvd_reg_pool *p = pool_by_id(s, pool_id);
    if (p == NULL) {
        return;
    }
    uint32_t i = (uint32_t)(p - s->pools);
    if (s->pool_gone != NULL) {
        s->pool_gone(s->pool_gone_arg, p);
    }
    kvd_pool_free(p->pool);
    if (p->duel != NULL) {
        s->duel_pending -= kvd_duel_pending(p->duel);
    }
    kvd_duel_free(p->duel);
    kvd_verify_free(&p->verify);
    kvd_summaries_free(&p->summ);
    memmove(&s->pools[i], &s->pools[i + 1], sizeof(s->pools[0]) * (s->npools - i - 1));
    s->npools--;
}

kv_err kvd_registry_init(kvd_registry *g, const kvd_registry_deps *d) {
    memset(g, 0, sizeof(*g));
    g->cfg = d->cfg;
    g->tenants = d->tenants;
    g->sel = d->sel;
    g->be = d->sel->ops;
    g->be_ctx = d->sel->ctx;
    g->clock = d->clock;
    g->clock_arg = d->clock_arg;
    g->next_pool_id = 1;
    g->vllm = strcmp(d->cfg->hash_mode, "vllm") == 0;
    if (g->vllm) {
        const char *seed = d->cfg->vllm_hash_seed;
        if (seed[0] != '\0') {
            if (kv_vllm_none_hash(seed, strlen(seed), g->none_hash) != KV_OK) {
                KV_LOG(ERROR, "KVD-HASH", "vllm-hash-seed is not a string vLLM can hash (UTF-8)");
                return KV_EINVAL;
            }
        } else {
            /* vLLM without PYTHONHASHSEED: os.urandom(32). */
            if (getrandom(g->none_hash, sizeof(g->none_hash), 0) != (ssize_t)sizeof(g->none_hash)) {
                return KV_ESYS;
            }
            KV_LOG(WARN, "KVD-HASH",
                   "hash-mode vllm without vllm-hash-seed: NONE_HASH is random for this run, so "
                   "no vLLM-aware router can compute these keys and no hit survives a restart");
        }
    }
    kv_err rc = kvd_index_alloc(d->cfg->index_entries, &g->index);
    if (rc != KV_OK) {
        return rc;
    }
    rc = kvd_events_init(&g->events, (uint32_t)d->cfg->events);
    if (rc != KV_OK) {
        kvd_index_free(g->index);
        g->index = NULL;
    }
    return rc;
}

void kvd_registry_fini(kvd_registry *g) {
    (void)kvd_reqtrace_stop(g->reqtrace, NULL); /* a trace left running is flushed and kept */
    g->reqtrace = NULL;
    if (g->commons != NULL && g->commons_free != NULL) {
        g->commons_free(g->commons);
    }
    g->commons = NULL;
    for (uint32_t i = 0; i < g->npools; i++) {
        if (g->pool_gone != NULL) {
            g->pool_gone(g->pool_gone_arg, &g->pools[i]);
        }
        kvd_pool_free(g->pools[i].pool);
        kvd_duel_free(g->pools[i].duel);
        kvd_verify_free(&g->pools[i].verify);
        kvd_summaries_free(&g->pools[i].summ);
    }
    free(g->pools);
    g->pools = NULL;
    g->npools = g->pools_cap = 0;
    g->duel_pending = 0;
    free(g->sessions);
    g->sessions = NULL;
    if (g->index != NULL) {
        kvd_index_free(g->index);
        g->index = NULL;
    }
    kvd_events_fini(&g->events);
}

kvd_reg_pool *kvd_registry_pool(kvd_registry *g, uint32_t pool_id) {
    kvd_reg_pool *p = pool_by_id(g, pool_id);
    if (p != NULL) {
        kvd_pool_set_now(p->pool, kvd_registry_now(g));
    }
    return p;
}

const kvd_reg_pool *kvd_registry_peek(const kvd_registry *g, uint32_t pool_id) {
    return pool_by_id((kvd_registry *)g, pool_id);
}

uint32_t kvd_registry_budget_apply(kvd_registry *g, kvd_reg_pool *p) {
    return budget_apply(g, p);
}

uint64_t kvd_registry_budget_used(const kvd_registry *g) {
    return budget_used(g);
}

/* Another pool of model_id whose layout shape differs from l, or NULL. */
static const kvd_reg_pool *layout_rival(const kvd_registry *s, const char *model_id,
                                        const kv_layout *l) {
    for (uint32_t i = 0; i < s->npools; i++) {
        const kvd_reg_pool *p = &s->pools[i];
        if (strcmp(p->model_id, model_id) == 0 && !same_shape(&p->layout, l)) {
            return p;
        }
    }
    return NULL;
}

kv_err kvd_registry_attach(kvd_registry *s, uint32_t tenant, const char *model_id,
                           const kv_layout *l, uint32_t flags, uint32_t *ids, uint32_t *n,
                           int *conflict, char *msg) {
    const kvd_reg_pool *rival = layout_rival(s, model_id, l);
    *conflict = rival != NULL;
    if (rival != NULL) {
        const kv_layout *o = &rival->layout;
        char theirs[160], ours[160];
        snprintf(theirs, sizeof(theirs), "%u layers x %u heads x %u dim, %u tokens/block, %s, %s",
                 o->num_layers, o->num_kv_heads, o->head_dim, o->tokens_per_block,
                 kv_dtype_name(o->dtype), kv_arrangement_name(o->arrangement));
        snprintf(ours, sizeof(ours), "%u layers x %u heads x %u dim, %u tokens/block, %s, %s",
                 l->num_layers, l->num_kv_heads, l->head_dim, l->tokens_per_block,
                 kv_dtype_name(l->dtype), kv_arrangement_name(l->arrangement));
        if (s->cfg->strict_layouts) {
            FAIL(KV_EINVAL,
                 "model %.40s has pool %u with layout %.60s; this attach asks for %.60s "
                 "(strict-layouts)",
                 model_id, rival->pool_id, theirs, ours);
        }
        KV_LOG(WARN, "KVD-POOL-LAYOUT",
               "model %s: an attach asks for layout %s while pool %u has %s; the pools share "
               "nothing (strict-layouts refuses this)",
               model_id, ours, rival->pool_id, theirs);
    }
    /* Idle pools go before new ones are counted against max-pools (never during the opens
     * below: a pool this attach just made has no session yet). */
    reclaim_pools(s);
    /* The pools this attach makes (its own and one per other domain: groups, commons) fit
     * max-pools and the quota all together, or none is made. */
    uint32_t doms[KVD_MAX_DOMAINS_PER_TENANT], links[KVD_MAX_DOMAINS_PER_TENANT];
    uint32_t ndoms = kvd_tenants_domains(s->tenants, tenant, doms), nlinks = 0;
    uint32_t missing = pool_find(s, model_id, l, flags, tenant) == NULL;
    for (uint32_t i = 1; i < ndoms; i++) {
        missing += pool_find(s, model_id, l, flags, doms[i]) == NULL;
    }
    if (missing > 0) {
        kv_err rc = pools_fit(s, tenant, missing, msg);
        if (rc != KV_OK) {
            return rc;
        }
    }
    kvd_reg_pool *p;
    kv_err rc = pool_open(s, model_id, l, flags, tenant, tenant, &p, msg);
    if (rc != KV_OK) {
        return rc;
    }
    uint32_t pool_id = p->pool_id;
    /* The same model in the tenant's other domains, in lookup order. Opening pools moves
     * s->pools, so pools are named by id from here on. A domain whose pool cannot be had now
     * (pool-memory spent) is left out of this attach's links, which the reply lists. */
    uint32_t commons_id = 0;
    for (uint32_t i = 1; i < ndoms; i++) {
        char lmsg[KVD_REG_MSG];
        kvd_reg_pool *lp;
        if (pool_open(s, model_id, l, flags, doms[i], tenant, &lp, lmsg) != KV_OK) {
            KV_LOG(WARN, "KVD-POOL-LINK", "tenant %s: no pool in domain %u: %s",
                   kvd_tenants_name(s->tenants, tenant), doms[i], lmsg);
            continue;
        }
        links[nlinks++] = lp->pool_id;
        if (doms[i] == KVD_DOMAIN_COMMONS) {
            commons_id = lp->pool_id;
        }
    }
    for (uint32_t i = 0; i < nlinks; i++) {
        kvd_reg_pool *lp = pool_by_id(s, links[i]);
        if (lp->domain != KVD_DOMAIN_COMMONS) {
            lp->commons_id = commons_id; /* group commits count toward the commons too */
        }
        lp->nsessions++;
    }
    p = pool_by_id(s, pool_id);
    memcpy(p->links, links, sizeof(links[0]) * nlinks);
    p->nlinks = nlinks;
    p->commons_id = commons_id;
    p->nsessions++;
    budget_apply(s, p);
    ids[0] = pool_id;
    memcpy(ids + 1, links, sizeof(links[0]) * nlinks);
    *n = 1 + nlinks;
    return KV_OK;
}

kv_err kvd_registry_pool_open(kvd_registry *g, const char *model_id, const kv_layout *l,
                              uint32_t domain, uint32_t *pool_id, char *msg) {
    kvd_reg_pool *p;
    kv_err rc = pool_open(g, model_id, l, 0, domain, KVD_MAX_TENANTS, &p, msg);
    if (rc == KV_OK) {
        *pool_id = p->pool_id;
    }
    return rc;
}

void kvd_registry_verify_commit(kvd_registry *g, kvd_reg_pool *p, kvd_block_ref blk) {
    kv_err rc = kvd_verify_commit(&p->verify, g->be, g->be_ctx, p->pool, blk);
    if (rc != KV_OK) {
        KV_LOG(WARN, "KVD-VERIFY", "pool %u block %u: no checksum recorded (%s); it is not checked",
               p->pool_id, blk.id, kv_strerror(rc));
    }
}

size_t kvd_registry_verify_hits(kvd_registry *g, kvd_reg_pool *p, const kvd_block_ref *hits,
                                size_t n) {
    return kvd_verify_hits(&p->verify, g->be, g->be_ctx, p->pool, p->pool_id, hits, n);
}

void kvd_registry_pool_close(kvd_registry *g, uint32_t pool_id) {
    pool_close(g, pool_id);
}

void kvd_registry_sessions_gone(kvd_registry *g, const uint32_t *ids, uint32_t n) {
    for (uint32_t i = 0; i < n; i++) {
        kvd_reg_pool *p = pool_by_id(g, ids[i]);
        if (p != NULL && p->nsessions > 0) {
            p->nsessions--;
        }
    }
    reclaim_pools(g);
}

kv_err kvd_registry_allocate(kvd_registry *g, kvd_reg_pool *p, uint32_t n, uint64_t session,
                             uint32_t tenant, kvd_block_ref *out, char *msg) {
    /* Decide before anything changes: free blocks, evictable cached ones, and segments the
     * budget holds now or after parking other pools' idle segments. A refused Allocate parks,
     * grows and evicts nothing. */
    kvd_pool_counts acc = kvd_pool_counts_get(p->pool);
    uint64_t bps = kvd_pool_config_get(p->pool)->blocks_per_segment;
    uint64_t left = budget_left(g);
    uint64_t idle = acc.free + acc.evictable >= n ? 0 : parkable_elsewhere(g, p);
    uint64_t room = segments_for(p, left + idle);
    uint32_t slots = KVD_MAX_SEGMENTS - kvd_pool_resident_segments(p->pool);
    if (room > slots) {
        room = slots;
    }
    uint64_t could = acc.free + acc.evictable + room * bps;
    if (could < n) {
        FAIL(KV_ENOSPC,
             "pool %u exhausted: asked %u blocks, %llu could be had (%llu free, %llu evictable "
             "cached, %llu pinned, room for %llu more segments of %llu blocks: %llu bytes of "
             "pool-memory left, %llu idle in other pools); release blocks or raise pool-memory",
             p->pool_id, n, (unsigned long long)could, (unsigned long long)acc.free,
             (unsigned long long)acc.evictable, (unsigned long long)acc.pinned,
             (unsigned long long)room, (unsigned long long)bps, (unsigned long long)left,
             (unsigned long long)idle);
    }
    make_room_for(g, p, n);
    budget_apply(g, p);
    uint64_t evicted_before = kvd_pool_evictions(p->pool, KVD_EVICT_CAPACITY);
    kv_err rc = kvd_pool_allocate(p->pool, n, session, tenant, out);
    kvd_events_note_evictions(&g->events, p->pool, tenant, KVD_EVICT_CAPACITY, evicted_before,
                              "allocate");
    if (rc == KV_ENOSPC) {
        /* The estimate above said it could (a bug or a backend that failed to grow). */
        acc = kvd_pool_counts_get(p->pool);
        FAIL(rc,
             "pool %u exhausted: asked %u blocks; %llu free, %llu evictable; the pool could "
             "not grow as the memory budget allowed (see the daemon log)",
             p->pool_id, n, (unsigned long long)acc.free, (unsigned long long)acc.evictable);
    }
    if (rc != KV_OK) {
        FAIL(rc, "allocate failed: %s", kv_strerror(rc));
    }
    return KV_OK;
}

kv_err kvd_registry_session_open(kvd_registry *g, uint32_t tenant) {
    if (tenant >= KVD_MAX_TENANTS) {
        return KV_EINVAL;
    }
    if (g->sessions == NULL) {
        g->sessions = calloc(KVD_MAX_TENANTS, sizeof(*g->sessions));
        if (g->sessions == NULL) {
            return KV_ENOMEM;
        }
    }
    g->sessions[tenant]++;
    return KV_OK;
}

void kvd_registry_session_close(kvd_registry *g, uint32_t tenant) {
    if (g->sessions != NULL && tenant < KVD_MAX_TENANTS && g->sessions[tenant] > 0) {
        g->sessions[tenant]--;
    }
}

uint64_t kvd_registry_sessions(const kvd_registry *g, uint32_t tenant) {
    return g->sessions != NULL && tenant < KVD_MAX_TENANTS ? g->sessions[tenant] : 0;
}

void kvd_registry_apply_guarantees(kvd_registry *g, kvd_reg_pool *p) {
    uint32_t n = kvd_tenants_count(g->tenants);
    for (uint32_t t = 0; t < n && t < KVD_MAX_TENANTS; t++) {
        if (kvd_tenants_domain_writable(g->tenants, t, p->domain)) {
            kvd_pool_set_guarantee(p->pool, t, kvd_tenants_quota(g->tenants, t)->guarantee);
        }
    }
}
