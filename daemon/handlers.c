/* kvd handlers: one function per request. Each checks its fields (validate.c), then the
 * session's state, and only then changes pools, so an Error reply means nothing changed. On
 * success a handler queues its own reply (built on the stack, arrays on the heap for the
 * request's lifetime); on failure it returns the code and writes a message, and the dispatcher
 * queues the Error. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <xxhash.h>

#include "common/kv_log.h"
#include "common/kv_wire.h"
#include "daemon/server_int.h"
#include "daemon/tenancy.h"

#define FAIL(rc, ...)                                                                              \
    do {                                                                                           \
        snprintf(msg, KVD_ERRMSG, __VA_ARGS__);                                                    \
        return (rc);                                                                               \
    } while (0)

static void env_init(kvd_conn *c, Kvd__Envelope *env, uint64_t id) {
    kvd__envelope__init(env);
    env->id = id;
    env->boot_epoch = c->srv->boot_epoch;
}

/* ---- budget and pools ------------------------------------------------------------------ */

/* Bytes of every pool's resident segments (parked ones cost no segment memory) and of every
 * pool's metadata (block records included, parked segments' too): what pool-memory bounds, so
 * that many pools of tiny blocks cannot take the daemon far past it. O(pools). */
static uint64_t budget_used(const kvd_server *s) {
    uint64_t used = 0;
    for (uint32_t i = 0; i < s->npools; i++) {
        used += kvd_pool_resident_bytes(s->pools[i].pool) + kvd_pool_meta_bytes(s->pools[i].pool);
    }
    return used;
}

/* Segments pool sp can add with `bytes` of budget: its own parked ones first (unparking costs
 * their memory only: the block records stayed), then new ones (memory and records). */
static uint64_t segments_for(const kvd_srv_pool *sp, uint64_t bytes) {
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
static uint32_t budget_apply(kvd_server *s, kvd_srv_pool *sp) {
    uint64_t used = budget_used(s);
    uint64_t left = used < s->cfg.pool_memory ? s->cfg.pool_memory - used : 0;
    uint32_t live = kvd_pool_resident_segments(sp->pool);
    uint64_t extra = segments_for(sp, left);
    uint64_t max = live + extra;
    if (max > KVD_MAX_SEGMENTS) {
        max = KVD_MAX_SEGMENTS;
    }
    kvd_pool_set_max_segments(sp->pool, (uint32_t)max);
    return (uint32_t)(max - (live < max ? live : max));
}

static uint64_t budget_left(const kvd_server *s) {
    uint64_t used = budget_used(s);
    return used < s->cfg.pool_memory ? s->cfg.pool_memory - used : 0;
}

/* Frees budget for `bytes` more of segments in pool `self` (NULL: a pool about to be created)
 * by parking idle segments of other pools: each step takes the pool with the most idle memory
 * (parkable segments x segment size; ties: the least recently used segment) and parks its best
 * segment (fewest cached blocks, least recently used). With free_only, only segments without a
 * cached block are taken: self could manage by evicting its own cache, and another pool's cache
 * is not worth less than ours, but its unused memory is. Backends without segment_discard park
 * nothing. Returns the budget left afterwards (may still be short of bytes). */
static uint64_t make_room(kvd_server *s, const kvd_srv_pool *self, uint64_t bytes, int free_only) {
    uint64_t left = budget_left(s);
    uint64_t now = uv_now(s->loop);
    while (left < bytes) {
        kvd_srv_pool *victim = NULL;
        kvd_park_candidate best = {0, 0, 0, 0};
        for (uint32_t i = 0; i < s->npools; i++) {
            kvd_srv_pool *vp = &s->pools[i];
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
static uint64_t backend_align(const kvd_server *s) {
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
    uint8_t buf[KVD_MAX_MODEL_ID + 24];
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
static kvd_srv_pool *pool_by_id(kvd_server *s, uint32_t id) {
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
static void reclaim_pools(kvd_server *s) {
    for (uint32_t i = 0; i < s->npools;) {
        kvd_srv_pool *p = &s->pools[i];
        if (p->nsessions == 0 && !kvd_pool_in_use(p->pool)) {
            KV_LOG(INFO, "KVD-POOL-FREE", "pool %u (model %s): no session and no block; freed",
                   p->pool_id, p->model_id);
            kvd_handlers_pool_close(s, p->pool_id); /* keeps the order; i now names the next */
        } else {
            i++;
        }
    }
}

/* The pool of (model, layout) in domain, or NULL. */
static kvd_srv_pool *pool_find(kvd_server *s, const char *model_id, const kv_layout *l,
                               uint32_t domain) {
    for (uint32_t i = 0; i < s->npools; i++) {
        kvd_srv_pool *sp = &s->pools[i];
        if (sp->domain == domain && strcmp(sp->model_id, model_id) == 0 &&
            same_shape(&sp->layout, l)) {
            return sp;
        }
    }
    return NULL;
}

/* Whether `more` new pools fit max-pools and creator's max-pools quota: KV_ENOSPC / KV_EQUOTA
 * with a sentence otherwise. */
static kv_err pools_fit(kvd_server *s, uint32_t creator, uint32_t more, char *msg) {
    if (s->npools + (uint64_t)more > s->cfg.max_pools) {
        FAIL(KV_ENOSPC,
             "kvd has %u of max-pools (%llu) pools in use; this attach needs %u more (a new model "
             "or layout needs its own pool and one in each of the tenant's groups and the "
             "commons; raise max-pools, or let pools of models no longer used empty)",
             s->npools, (unsigned long long)s->cfg.max_pools, more);
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

static kv_err pool_open(kvd_server *s, const char *model_id, const kv_layout *l, uint32_t domain,
                        uint32_t creator, kvd_srv_pool **out, char *msg) {
    kvd_srv_pool *found = pool_find(s, model_id, l, domain);
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
        kvd_srv_pool *n = realloc(s->pools, sizeof(*n) * ncap);
        if (n == NULL) {
            FAIL(KV_ENOMEM, "no memory for a new pool");
        }
        s->pools = n;
        s->pools_cap = ncap;
    }
    kvd_srv_pool sp;
    memset(&sp, 0, sizeof(sp));
    snprintf(sp.model_id, sizeof(sp.model_id), "%s", model_id);
    sp.layout = *l;
    sp.domain = domain;
    sp.creator = creator;
    sp.seed = pool_seed(model_id, l);
    kvd_pool_config pc;
    memset(&pc, 0, sizeof(pc));
    pc.pool_id = s->next_pool_id;
    pc.domain = domain;
    pc.layout = *l;
    pc.blocks_per_segment = pick_blocks_per_segment(
        l, s->cfg.segment_bytes,
        l->arrangement == KV_LAYER_MAJOR ? backend_align(s) : (uint64_t)sysconf(_SC_PAGESIZE));
    pc.max_segments = 1;
    pc.policy = strcmp(s->cfg.evict_policy, "s3fifo") == 0       ? KVD_EVICT_S3FIFO
                : strcmp(s->cfg.evict_policy, "prefix-lru") == 0 ? KVD_EVICT_PREFIX_LRU
                                                                 : KVD_EVICT_LRU;
    uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);
    if (s->cfg.hugepages) {
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
             (unsigned long long)used, (unsigned long long)s->cfg.pool_memory,
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
    sp.pool_id = s->next_pool_id++;
    KV_ASSERT(s->npools == 0 || s->pools[s->npools - 1].pool_id < sp.pool_id); /* pool_by_id */
    s->pools[s->npools] = sp;
    *out = &s->pools[s->npools++];
    kvd_tenancy_apply_guarantees(s, *out);
    KV_LOG(INFO, "KVD-POOL-NEW",
           "pool %u: model %s, %u layers x %u heads x %u dim, %s, %u tokens/block, %llu "
           "bytes/block, %u blocks/segment, domain %u",
           sp.pool_id, model_id, l->num_layers, l->num_kv_heads, l->head_dim,
           kv_dtype_name(l->dtype), l->tokens_per_block, (unsigned long long)l->block_bytes,
           pc.blocks_per_segment, domain);
    return KV_OK;
}

uint32_t kvd_handlers_budget_apply(kvd_server *s, kvd_srv_pool *sp) {
    return budget_apply(s, sp);
}

kvd_srv_pool *kvd_handlers_pool_by_id(kvd_server *s, uint32_t id) {
    return pool_by_id(s, id);
}

kv_err kvd_handlers_pool_open(kvd_server *s, const char *model_id, const kv_layout *l,
                              uint32_t domain, kvd_srv_pool **out, char *msg) {
    return pool_open(s, model_id, l, domain, KVD_MAX_TENANTS, out, msg);
}

void kvd_handlers_sessions_gone(kvd_server *s, const uint32_t *pool_ids, uint32_t n) {
    for (uint32_t i = 0; i < n; i++) {
        kvd_srv_pool *p = pool_by_id(s, pool_ids[i]);
        if (p != NULL && p->nsessions > 0) {
            p->nsessions--;
        }
    }
    reclaim_pools(s);
}

void kvd_handlers_pool_close(kvd_server *s, uint32_t pool_id) {
    kvd_srv_pool *p = pool_by_id(s, pool_id);
    if (p == NULL) {
        return;
    }
    uint32_t i = (uint32_t)(p - s->pools);
    kvd_pool_free(p->pool);
    memmove(&s->pools[i], &s->pools[i + 1], sizeof(s->pools[0]) * (s->npools - i - 1));
    s->npools--;
}

void kvd_handlers_free_pools(kvd_server *s) {
    kvd_tenancy_free(s);
    for (uint32_t i = 0; i < s->npools; i++) {
        kvd_pool_free(s->pools[i].pool);
    }
    free(s->pools);
    s->pools = NULL;
    s->npools = s->pools_cap = 0;
}

/* The session's pool entry and the server's, or ENOENT. */
static kv_err session_pool(kvd_conn *c, uint32_t pool_id, kvd_session_pool **out,
                           kvd_srv_pool **srv_out, char *msg) {
    kvd_session_pool *sp = kvd_session_find_pool(&c->sess, pool_id);
    kvd_srv_pool *p = pool_by_id(c->srv, pool_id);
    if (sp == NULL || p == NULL) {
        FAIL(KV_ENOENT, "pool %u is not attached by this session (AttachPool first)", pool_id);
    }
    kvd_pool_set_now(p->pool, uv_now(c->srv->loop));
    *out = sp;
    if (srv_out != NULL) {
        *srv_out = p;
    }
    return KV_OK;
}

/* Requests that hand out blocks (Allocate, Lookup, Commit) name a pool whose segment 0 the
 * session was sent: an attached pool's AttachPool reply sends it, a linked pool's comes with
 * MapSegments{pool_id, 0}. Until then a reply could not announce segment 0 (new_segments_from
 * = 0 means "nothing new"), so such requests are refused. */
static kv_err need_segment0(kvd_session_pool *sp, char *msg) {
    if (!kvd_session_pool_was_sent(sp, 0)) {
        FAIL(KV_ESTATE,
             "pool %u: this session was never sent its segments; send MapSegments{pool_id %u, "
             "first_index 0} before using it",
             sp->pool_id, sp->pool_id);
    }
    return KV_OK;
}

/* new_segments_from for a reply about sp: the lowest live segment slot this session was not
 * sent, or 0 when it was sent every one. Slot 0 is sent by every AttachPool and lives as long as
 * the pool, so for an attached pool 0 can only mean "nothing new" (PROTOCOL.md, MapSegments). */
static uint32_t new_segments_from(kvd_session_pool *sp) {
    uint32_t h = kvd_session_pool_first_unsent(sp);
    return h == KVD_NO_SEGMENT ? 0 : h;
}

#ifndef NDEBUG
/* The rule of PROTOCOL.md §6 (Segments a reply hands out): a block in a reply lies in a segment
 * the session was sent, or the same reply announces it (nsf != 0 and <= its segment). */
static void check_announced(kvd_session_pool *sp, const kvd_block_ref *refs, size_t n,
                            uint32_t nsf) {
    uint32_t bps = kvd_pool_config_get(sp->pool)->blocks_per_segment;
    for (size_t i = 0; i < n; i++) {
        uint32_t seg = refs[i].id / bps;
        KV_ASSERT(kvd_session_pool_was_sent(sp, seg) || (nsf != 0 && nsf <= seg));
    }
}
#else
#define check_announced(sp, refs, n, nsf) ((void)0)
#endif

/* Fills segs (capacity KVD_MAX_FDS_PER_FRAME) with the live segments >= first, as many as their
 * fds fit one frame (KVD_MAX_FDS_PER_FRAME: one fd per segment, one per part for segments made
 * of parts, none for CUDA_IPC), and fds with their fds in fd_index order; *nfds gets the count.
 * kind is the backend's kvd.MemoryKind. Records nothing: the caller marks them sent once the
 * reply is queued. */
static uint32_t collect_segments(kvd_session_pool *sp, uint32_t first, Kvd__Segment *segs,
                                 Kvd__Segment **ptrs, int *fds, uint32_t *nfds, int *more,
                                 uint32_t kind) {
    uint32_t n = 0, nf = 0;
    *more = 0;
    uint32_t slots = kvd_pool_segment_slots(sp->pool);
    const kvd_pool_config *pc = kvd_pool_config_get(sp->pool);
    for (uint32_t i = first; i < slots && n < KVD_MAX_FDS_PER_FRAME; i++) {
        const kvd_segment_mem *m = kvd_pool_segment(sp->pool, i);
        if (m == NULL) {
            continue;
        }
        uint32_t need = kind == KVD__MEMORY_KIND__CUDA_IPC ? 0 : m->nparts > 0 ? m->nparts : 1;
        if (nf + need > KVD_MAX_FDS_PER_FRAME) {
            *more = 1; /* the next reply: the client asks from here */
            break;
        }
        kvd__segment__init(&segs[n]);
        segs[n].index = i;
        segs[n].nblocks = pc->blocks_per_segment;
        segs[n].bytes = m->bytes;
        segs[n].kind = (Kvd__MemoryKind)kind;
        segs[n].fd_index = nf;
        if (segs[n].kind == KVD__MEMORY_KIND__CUDA_IPC) {
            /* No fd travels (send_segments_reply sends none): the handle names the memory. */
            segs[n].ipc_handle.len = sizeof(m->ipc_handle);
            segs[n].ipc_handle.data = (uint8_t *)m->ipc_handle;
        }
        if (m->nparts > 0) {
            segs[n].n_part_bytes = m->nparts;
            segs[n].part_bytes = m->part_bytes;
            for (uint32_t k = 0; k < m->nparts; k++) {
                fds[nf++] = m->part_fds[k];
            }
        } else if (need == 1) {
            fds[nf++] = m->fd;
        }
        /* The commons is written only by the daemon (promotions); every tenant reads it. */
        segs[n].read_only = pc->domain == KVD_DOMAIN_COMMONS;
        ptrs[n] = &segs[n];
        n++;
    }
    for (uint32_t i = first + n; !*more && n > 0 && i < slots; i++) {
        *more = kvd_pool_segment(sp->pool, i) != NULL && i > segs[n - 1].index;
    }
    *nfds = nf;
    return n;
}

/* ---- requests -------------------------------------------------------------------------- */

static kv_err on_hello(kvd_conn *c, uint64_t id, const Kvd__Hello *h, char *msg) {
    kvd_server *s = c->srv;
    if (c->sess.hello) {
        FAIL(KV_ESTATE, "Hello was already done on this connection");
    }
    if (s->draining) {
        FAIL(KV_EDRAINING, "kvd is draining (admin `drain`) for a restart; connect to the new "
                           "instance");
    }
    kv_err rc = kvd_validate_hello(h, msg, KVD_ERRMSG);
    if (rc != KV_OK) {
        return rc;
    }
    uint32_t tenant;
    if (h->token.len != 0) {
        rc = kvd_tenants_resolve_token(s->tenants, c->sess.uid, c->sess.gid, h->token.data,
                                       h->token.len, &tenant);
        if (rc != KV_OK) {
            KV_LOG(WARN, "KVD-AUTH", "session %llu: pid %d uid %d: tenant token refused",
                   (unsigned long long)c->sess.id, (int)c->sess.pid, (int)c->sess.uid);
            FAIL(KV_EAUTH, "the token names no tenant that uid %d gid %d may be", (int)c->sess.uid,
                 (int)c->sess.gid);
        }
    } else {
        rc = kvd_tenants_resolve(s->tenants, c->sess.uid, c->sess.gid, &tenant);
        if (rc != KV_OK) {
            FAIL(rc, "the daemon knows %d tenants already; uid %d cannot get a new one",
                 KVD_MAX_TENANTS, (int)c->sess.uid);
        }
    }
    uint64_t max_sessions = kvd_tenants_quota(s->tenants, tenant)->max_sessions;
    if (max_sessions != 0 && kvd_tenancy_sessions(s, tenant) >= max_sessions) {
        FAIL(KV_EQUOTA, "tenant %s: max-sessions is %llu and that many are open",
             kvd_tenants_name(s->tenants, tenant), (unsigned long long)max_sessions);
    }
    c->sess.tenant = tenant;
    c->sess.hello = 1;
    c->features = h->features & KV_FEATURE_PACKED; /* what we may send it */
    snprintf(c->sess.name, sizeof(c->sess.name), "%s", h->client_name ? h->client_name : "");
    Kvd__Envelope env;
    env_init(c, &env, id);
    Kvd__HelloReply r = KVD__HELLO_REPLY__INIT;
    uint32_t doms[KVD_MAX_DOMAINS_PER_TENANT];
    char dnames[KVD_MAX_DOMAINS_PER_TENANT][KVD_TENANT_NAME_MAX + 8];
    char *domains[KVD_MAX_DOMAINS_PER_TENANT];
    uint32_t ndoms = kvd_tenants_domains(s->tenants, tenant, doms);
    for (uint32_t i = 0; i < ndoms; i++) {
        domains[i] =
            (char *)kvd_tenants_domain_name(s->tenants, doms[i], dnames[i], sizeof(dnames[i]));
    }
    r.session_id = c->sess.id;
    r.tenant = domains[0];
    r.n_domains = ndoms;
    r.domains = domains;
    r.boot_epoch = s->boot_epoch;
    r.protocol_version = KV_PROTOCOL_VERSION;
    r.max_frame_bytes = (uint32_t)s->cfg.max_frame_bytes;
    r.max_inflight = (uint32_t)s->cfg.max_inflight;
    r.max_blocks_per_request = (uint32_t)s->cfg.max_blocks_per_request;
    r.features = KV_FEATURE_PACKED; /* what it may send us */
    env.body_case = KVD__ENVELOPE__BODY_HELLO_REPLY;
    env.hello_reply = &r;
    KV_LOG(INFO, "KVD-HELLO", "session %llu: client '%s' pid %d is tenant %s",
           (unsigned long long)c->sess.id, c->sess.name, (int)c->sess.pid, domains[0]);
    return kvd_conn_send(c, &env, NULL, 0);
}

static kv_err send_segments_reply(kvd_conn *c, uint64_t id, kvd_session_pool *sp, kvd_srv_pool *p,
                                  uint32_t first, int attach) {
    Kvd__Segment *segs = calloc(KVD_MAX_FDS_PER_FRAME, sizeof(*segs));
    Kvd__Segment **ptrs = calloc(KVD_MAX_FDS_PER_FRAME, sizeof(*ptrs));
    int *fds = calloc(KVD_MAX_FDS_PER_FRAME, sizeof(int));
    int *ro_fds = calloc(KVD_MAX_FDS_PER_FRAME, sizeof(int));
    Kvd__LinkedPool *links = calloc(KVD_MAX_DOMAINS_PER_TENANT, sizeof(*links));
    Kvd__LinkedPool **link_ptrs = calloc(KVD_MAX_DOMAINS_PER_TENANT, sizeof(*link_ptrs));
    char(*lnames)[KVD_TENANT_NAME_MAX + 8] = calloc(KVD_MAX_DOMAINS_PER_TENANT, sizeof(*lnames));
    uint32_t n = 0, nfds = 0, nro = 0, nlinks = 0;
    kv_err rc = KV_ENOMEM;
    if (segs == NULL || ptrs == NULL || fds == NULL || ro_fds == NULL || links == NULL ||
        link_ptrs == NULL || lnames == NULL) {
        goto cleanup;
    }
    if (kvd_session_pool_reserve(sp, kvd_pool_segment_slots(sp->pool)) != KV_OK) {
        goto cleanup;
    }
    int more = 0;
    n = collect_segments(sp, first, segs, ptrs, fds, &nfds, &more,
                         c->srv->be->kind != KVD_MEM_NONE ? c->srv->be->kind : KVD_MEM_HOST_MEMFD);
    /* Segments the session may only read travel as fds that cannot be mapped writable. */
    for (uint32_t i = 0; i < n; i++) {
        /* GPU memory cannot be handed out read-only: there read_only is advisory (docs/GPU.md). */
        if (segs[i].read_only && segs[i].kind == KVD__MEMORY_KIND__HOST_MEMFD) {
            rc = kvd_tenancy_ro_fd(fds[segs[i].fd_index], &ro_fds[nro]);
            if (rc != KV_OK) {
                goto cleanup;
            }
            fds[segs[i].fd_index] = ro_fds[nro++];
        }
    }
    for (uint32_t i = 0; attach && i < p->nlinks; i++) {
        kvd_srv_pool *lp = pool_by_id(c->srv, p->links[i]);
        if (lp == NULL) {
            continue;
        }
        kvd__linked_pool__init(&links[nlinks]);
        links[nlinks].pool_id = lp->pool_id;
        links[nlinks].domain = (char *)kvd_tenants_domain_name(c->srv->tenants, lp->domain,
                                                               lnames[nlinks], sizeof(lnames[0]));
        links[nlinks].read_only =
            !kvd_tenants_domain_writable(c->srv->tenants, c->sess.tenant, lp->domain);
        links[nlinks].blocks_per_segment = kvd_pool_config_get(lp->pool)->blocks_per_segment;
        link_ptrs[nlinks] = &links[nlinks];
        nlinks++;
    }
    Kvd__Envelope env;
    env_init(c, &env, id);
    Kvd__AttachPoolReply ar = KVD__ATTACH_POOL_REPLY__INIT;
    Kvd__MapSegmentsReply mr = KVD__MAP_SEGMENTS_REPLY__INIT;
    Kvd__Layout lay = KVD__LAYOUT__INIT;
    Kvd__Hash128 seed = KVD__HASH128__INIT;
    if (attach) {
        const kv_layout *l = &p->layout;
        lay.num_layers = l->num_layers;
        lay.num_kv_heads = l->num_kv_heads;
        lay.head_dim = l->head_dim;
        lay.tokens_per_block = l->tokens_per_block;
        lay.dtype = (Kvd__DType)l->dtype;
        lay.arrangement = (Kvd__Arrangement)l->arrangement;
        lay.block_bytes = l->block_bytes;
        seed.lo = p->seed.lo;
        seed.hi = p->seed.hi;
        ar.pool_id = p->pool_id;
        ar.layout = &lay;
        ar.blocks_per_segment = kvd_pool_config_get(p->pool)->blocks_per_segment;
        ar.n_segments = n;
        ar.segments = ptrs;
        ar.hash_seed = &seed;
        ar.hash_algo = 1;
        /* The pool's own limit is 0 while all its segments are parked and the budget is
         * spent (it may not grow now), but the client sizes its address space by this and
         * takes 0 for a malformed reply; parked segments keep their slots. So: at least the
         * pool's slots, and at least 1. */
        uint32_t max_segs = kvd_pool_config_get(p->pool)->max_segments;
        uint32_t slots = kvd_pool_segment_slots(p->pool);
        max_segs = max_segs > slots ? max_segs : slots;
        ar.max_segments = max_segs > 0 ? max_segs : 1;
        ar.n_linked = nlinks;
        ar.linked = link_ptrs;
        ar.more_segments = more;
        if (c->srv->backend_sel.cuda != NULL) {
            ar.device_uuid.data = c->srv->backend_sel.cuda->dev.uuid.bytes;
            ar.device_uuid.len = sizeof(c->srv->backend_sel.cuda->dev.uuid.bytes);
        }
        env.body_case = KVD__ENVELOPE__BODY_ATTACH_POOL_REPLY;
        env.attach_pool_reply = &ar;
    } else {
        mr.n_segments = n;
        mr.segments = ptrs;
        mr.more_segments = more;
        env.body_case = KVD__ENVELOPE__BODY_MAP_SEGMENTS_REPLY;
        env.map_segments_reply = &mr;
    }
    /* CUDA_IPC segments carry handle bytes instead of fds. */
    rc = kvd_conn_send(c, &env, fds, nfds);
    if (rc == KV_OK) {
        for (uint32_t i = 0; i < n; i++) {
            kvd_session_pool_mark_sent(sp, segs[i].index);
        }
    }
cleanup:
    for (uint32_t i = 0; i < nro; i++) {
        close(ro_fds[i]); /* kvd_conn_send keeps its own dups */
    }
    free(segs);
    free(ptrs);
    free(fds);
    free(ro_fds);
    free(links);
    free(link_ptrs);
    free(lnames);
    return rc;
}

static kv_err on_attach(kvd_conn *c, uint64_t id, const Kvd__AttachPool *a, char *msg) {
    kv_layout l;
    kv_err rc = kvd_validate_attach(a, &l, msg, KVD_ERRMSG);
    if (rc != KV_OK) {
        return rc;
    }
    kvd_server *s = c->srv;
    kvd_srv_pool *p;
    /* Idle pools go before new ones are counted against max-pools (never during the opens
     * below: a pool this attach just made has no session yet). */
    reclaim_pools(s);
    /* The pools this attach makes (its own and one per other domain: groups, commons) fit
     * max-pools and the quota all together, or none is made. */
    uint32_t doms[KVD_MAX_DOMAINS_PER_TENANT], links[KVD_MAX_DOMAINS_PER_TENANT];
    uint32_t ndoms = kvd_tenants_domains(s->tenants, c->sess.tenant, doms), nlinks = 0;
    uint32_t missing = pool_find(s, a->model_id, &l, c->sess.tenant) == NULL;
    for (uint32_t i = 1; i < ndoms; i++) {
        missing += pool_find(s, a->model_id, &l, doms[i]) == NULL;
    }
    if (missing > 0) {
        rc = pools_fit(s, c->sess.tenant, missing, msg);
        if (rc != KV_OK) {
            return rc;
        }
    }
    rc = pool_open(s, a->model_id, &l, c->sess.tenant, c->sess.tenant, &p, msg);
    if (rc != KV_OK) {
        return rc;
    }
    uint32_t pool_id = p->pool_id;
    /* The same model in the tenant's other domains, in lookup order. Opening pools moves
     * s->pools, so pools are named by id from here on. A domain whose pool cannot be had now
     * (pool-memory spent) is left out of this attach's links, which the reply lists. */
    uint32_t commons_id = 0;
    for (uint32_t i = 1; i < ndoms; i++) {
        char lmsg[KVD_ERRMSG];
        kvd_srv_pool *lp;
        if (pool_open(s, a->model_id, &l, doms[i], c->sess.tenant, &lp, lmsg) != KV_OK) {
            KV_LOG(WARN, "KVD-POOL-LINK", "session %llu: no pool in domain %u: %s",
                   (unsigned long long)c->sess.id, doms[i], lmsg);
            continue;
        }
        links[nlinks++] = lp->pool_id;
        if (doms[i] == KVD_DOMAIN_COMMONS) {
            commons_id = lp->pool_id;
        }
        kvd_session_pool *lsp;
        int known = kvd_session_find_pool(&c->sess, lp->pool_id) != NULL;
        rc = kvd_session_add_pool(&c->sess, lp->pool_id, lp->pool, &lsp);
        if (rc != KV_OK) {
            FAIL(rc, "no memory to attach the pool");
        }
        lp->nsessions += !known;
    }
    for (uint32_t i = 0; i < nlinks; i++) {
        kvd_srv_pool *lp = pool_by_id(s, links[i]);
        if (lp->domain != KVD_DOMAIN_COMMONS) {
            lp->commons_id = commons_id; /* group commits count toward the commons too */
        }
    }
    p = pool_by_id(s, pool_id);
    memcpy(p->links, links, sizeof(links[0]) * nlinks);
    p->nlinks = nlinks;
    p->commons_id = commons_id;
    budget_apply(s, p);
    kvd_session_pool *sp;
    int known = kvd_session_find_pool(&c->sess, p->pool_id) != NULL;
    rc = kvd_session_add_pool(&c->sess, p->pool_id, p->pool, &sp);
    if (rc != KV_OK) {
        FAIL(rc, "no memory to attach the pool");
    }
    p->nsessions += !known;
    /* A repeated attach sends every segment again (the client remaps them all). */
    kvd_session_pool_forget_sent(sp);
    return send_segments_reply(c, id, sp, p, 0, 1);
}

static kv_err on_map(kvd_conn *c, uint64_t id, const Kvd__MapSegments *m, char *msg) {
    kvd_session_pool *sp;
    kvd_srv_pool *p;
    kv_err rc = session_pool(c, m->pool_id, &sp, &p, msg);
    if (rc != KV_OK) {
        return rc;
    }
    return send_segments_reply(c, id, sp, p, m->first_index, 0);
}

/* Queues a LookupReply (lookup) or AllocateReply with refs[0..n): as blocks_packed when the
 * client said it reads packed lists (Hello.features), else as BlockRef messages. */
static kv_err send_blocks_reply(kvd_conn *c, uint64_t id, const kvd_block_ref *refs, size_t n,
                                uint32_t nsf, int lookup, uint32_t *pool_ids,
                                Kvd__SegmentNotice **notices, size_t nnotices) {
    Kvd__BlockRef *v = NULL, **pv = NULL;
    ProtobufCBinaryData packed = {0, NULL};
    if (c->features & KV_FEATURE_PACKED) {
        packed.data = kvd_conn_scratch(c, n * KV_WIRE_BLOCK_BYTES);
        if (packed.data == NULL) {
            return KV_ENOMEM;
        }
        packed.len = n * KV_WIRE_BLOCK_BYTES;
        for (size_t i = 0; i < n; i++) {
            kv_wire_block_put(packed.data, i, refs[i].id, refs[i].gen);
        }
    } else {
        v = kvd_conn_scratch(c, n * sizeof(*v));
        pv = kvd_conn_scratch(c, n * sizeof(*pv));
        if (v == NULL || pv == NULL) {
            return KV_ENOMEM;
        }
        for (size_t i = 0; i < n; i++) {
            kvd__block_ref__init(&v[i]);
            v[i].id = refs[i].id;
            v[i].gen = refs[i].gen;
            pv[i] = &v[i];
        }
    }
    size_t nref = packed.data != NULL ? 0 : n;
    Kvd__Envelope env;
    env_init(c, &env, id);
    Kvd__LookupReply lr = KVD__LOOKUP_REPLY__INIT;
    Kvd__AllocateReply ar = KVD__ALLOCATE_REPLY__INIT;
    if (lookup) {
        lr.n_blocks = nref;
        lr.blocks = pv;
        lr.blocks_packed = packed;
        lr.new_segments_from = nsf;
        lr.n_pool_ids = pool_ids != NULL ? n : 0;
        lr.pool_ids = pool_ids;
        lr.n_linked_segments = nnotices;
        lr.linked_segments = notices;
        env.body_case = KVD__ENVELOPE__BODY_LOOKUP_REPLY;
        env.lookup_reply = &lr;
    } else {
        ar.n_blocks = nref;
        ar.blocks = pv;
        ar.blocks_packed = packed;
        ar.new_segments_from = nsf;
        env.body_case = KVD__ENVELOPE__BODY_ALLOCATE_REPLY;
        env.allocate_reply = &ar;
    }
    return kvd_conn_send(c, &env, NULL, 0);
}

/* Records n new references of the session; on ENOMEM gives them back to the pool. */
static kv_err hold_refs(kvd_conn *c, kvd_session_pool *sp, const kvd_block_ref *refs, size_t n,
                        char *msg) {
    for (size_t i = 0; i < n; i++) {
        if (kvd_refs_add(&sp->refs, refs[i].id, refs[i].gen, 1) != KV_OK) {
            for (size_t j = 0; j < i; j++) {
                (void)kvd_refs_sub(&sp->refs, refs[j].id, 1);
            }
            (void)kvd_pool_release(sp->pool, c->sess.id, c->sess.tenant, refs, n);
            FAIL(KV_ENOMEM, "no memory to record %zu references", n);
        }
    }
    return KV_OK;
}

/* Bytes other pools could give back by parking (their idle segments, guarantees kept): what
 * make_room can find, counted without changing anything. O(segments of other pools). */
static uint64_t parkable_elsewhere(kvd_server *s, const kvd_srv_pool *self) {
    uint64_t bytes = 0;
    uint64_t now = uv_now(s->loop);
    for (uint32_t i = 0; i < s->npools; i++) {
        kvd_srv_pool *vp = &s->pools[i];
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
static void make_room_for(kvd_server *s, kvd_srv_pool *p, uint32_t n) {
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

static kv_err on_allocate(kvd_conn *c, uint64_t id, const Kvd__Allocate *a, char *msg) {
    kvd_session_pool *sp;
    kvd_srv_pool *p;
    kv_err rc = session_pool(c, a->pool_id, &sp, &p, msg);
    if (rc != KV_OK) {
        return rc;
    }
    rc = kvd_validate_allocate(a, c->srv->cfg.max_blocks_per_request, msg, KVD_ERRMSG);
    if (rc != KV_OK) {
        return rc;
    }
    if (!kvd_tenants_domain_writable(c->srv->tenants, c->sess.tenant, p->domain)) {
        FAIL(KV_EPERM, "pool %u is read-only for tenant %s (only the daemon writes the commons)",
             p->pool_id, kvd_tenants_name(c->srv->tenants, c->sess.tenant));
    }
    rc = need_segment0(sp, msg);
    if (rc != KV_OK) {
        return rc;
    }
    uint64_t max_held = kvd_tenants_quota(c->srv->tenants, c->sess.tenant)->max_held;
    uint64_t held = kvd_pool_tenant_usage(p->pool, c->sess.tenant).held;
    if (max_held != 0 && held + a->count > max_held) {
        FAIL(KV_EQUOTA,
             "tenant %s: quota max-held is %llu blocks per pool; pool %u holds %llu, asked %u",
             kvd_tenants_name(c->srv->tenants, c->sess.tenant), (unsigned long long)max_held,
             p->pool_id, (unsigned long long)held, a->count);
    }
    /* Decide before anything changes: free blocks, evictable cached ones, and segments the
     * budget holds now or after parking other pools' idle segments. A refused Allocate parks,
     * grows and evicts nothing. */
    kvd_pool_counts acc = kvd_pool_counts_get(p->pool);
    uint64_t bps = kvd_pool_config_get(p->pool)->blocks_per_segment;
    uint64_t left = budget_left(c->srv);
    uint64_t idle = acc.free + acc.evictable >= a->count ? 0 : parkable_elsewhere(c->srv, p);
    uint64_t room = segments_for(p, left + idle);
    uint32_t slots = KVD_MAX_SEGMENTS - kvd_pool_resident_segments(p->pool);
    if (room > slots) {
        room = slots;
    }
    uint64_t could = acc.free + acc.evictable + room * bps;
    if (could < a->count) {
        FAIL(KV_ENOSPC,
             "pool %u exhausted: asked %u blocks, %llu could be had (%llu free, %llu evictable "
             "cached, %llu pinned, room for %llu more segments of %llu blocks: %llu bytes of "
             "pool-memory left, %llu idle in other pools); release blocks or raise pool-memory",
             p->pool_id, a->count, (unsigned long long)could, (unsigned long long)acc.free,
             (unsigned long long)acc.evictable, (unsigned long long)acc.pinned,
             (unsigned long long)room, (unsigned long long)bps, (unsigned long long)left,
             (unsigned long long)idle);
    }
    make_room_for(c->srv, p, a->count);
    budget_apply(c->srv, p);
    kvd_block_ref *refs = malloc(sizeof(*refs) * a->count);
    if (refs == NULL) {
        FAIL(KV_ENOMEM, "no memory for %u handles", a->count);
    }
    uint64_t evicted_before = kvd_pool_evictions(p->pool, KVD_EVICT_CAPACITY);
    rc = kvd_pool_allocate(p->pool, a->count, c->sess.id, c->sess.tenant, refs);
    kvd_events_note_evictions(&c->srv->events, p->pool, c->sess.tenant, KVD_EVICT_CAPACITY,
                              evicted_before, "allocate");
    if (rc == KV_ENOSPC) {
        /* The estimate above said it could (a bug or a backend that failed to grow). */
        acc = kvd_pool_counts_get(p->pool);
        snprintf(msg, KVD_ERRMSG,
                 "pool %u exhausted: asked %u blocks; %llu free, %llu evictable; the pool could "
                 "not grow as the memory budget allowed (see the daemon log)",
                 p->pool_id, a->count, (unsigned long long)acc.free,
                 (unsigned long long)acc.evictable);
        goto cleanup;
    }
    if (rc != KV_OK) {
        snprintf(msg, KVD_ERRMSG, "allocate failed: %s", kv_strerror(rc));
        goto cleanup;
    }
    rc = hold_refs(c, sp, refs, a->count, msg);
    if (rc != KV_OK) {
        goto cleanup;
    }
    uint32_t nsf = new_segments_from(sp);
    check_announced(sp, refs, a->count, nsf);
    rc = send_blocks_reply(c, id, refs, a->count, nsf, 0, NULL, NULL, 0);
cleanup:
    free(refs);
    return rc;
}

static kv_err on_lookup(kvd_conn *c, uint64_t id, const Kvd__Lookup *l, char *msg) {
    kvd_session_pool *sp;
    kvd_srv_pool *p;
    kv_err rc = session_pool(c, l->pool_id, &sp, &p, msg);
    if (rc != KV_OK) {
        return rc;
    }
    /* PROTOCOL.md §7 step 3: EINVAL, then ETOOBIG (either list too long), then EPROTO (a packed
     * list that is not whole entries, or both forms at once). */
    size_t n;
    rc = kvd_validate_lookup(l, c->srv->cfg.max_blocks_per_request, msg, KVD_ERRMSG);
    if (rc == KV_OK) {
        rc =
            kvd_validate_list(l->hashes_packed.len / KV_WIRE_HASH_BYTES,
                              c->srv->cfg.max_blocks_per_request, "hashes_packed", msg, KVD_ERRMSG);
    }
    if (rc == KV_OK &&
        kv_wire_list_count(l->n_hashes, l->hashes_packed.len, KV_WIRE_HASH_BYTES, &n) != KV_OK) {
        FAIL(KV_EPROTO,
             "hashes_packed of %zu bytes: not a multiple of %d, or sent together with hashes",
             l->hashes_packed.len, KV_WIRE_HASH_BYTES);
    }
    if (rc == KV_OK) {
        rc = need_segment0(sp, msg);
    }
    if (rc != KV_OK) {
        return rc;
    }
    /* Scratch lives in the request arena: nothing to free. */
    kv_hash128 *hashes = kvd_conn_scratch(c, sizeof(*hashes) * n);
    kvd_block_ref *refs = kvd_conn_scratch(c, sizeof(*refs) * n);
    uint32_t *pool_of = kvd_conn_scratch(c, sizeof(*pool_of) * n);
    size_t nhit = 0;
    if (hashes == NULL || refs == NULL || pool_of == NULL) {
        FAIL(KV_ENOMEM, "no memory for %zu hashes", n);
    }
    for (size_t i = 0; i < n; i++) {
        if (l->n_hashes > 0) {
            hashes[i].lo = l->hashes[i]->lo;
            hashes[i].hi = l->hashes[i]->hi;
        } else {
            kv_wire_hash_get(l->hashes_packed.data, i, &hashes[i].lo, &hashes[i].hi);
        }
    }
    /* Pools searched, in order: the named one, then with search_domains its links (the same
     * model in the tenant's groups and the commons). Each position takes the first pool that
     * has it; a run continues in that pool. max-held caps the references a lookup may add. */
    kvd_session_pool *order[1 + KVD_MAX_DOMAINS_PER_TENANT];
    uint32_t norder = 0;
    order[norder++] = sp;
    for (uint32_t i = 0; l->search_domains && i < p->nlinks; i++) {
        kvd_session_pool *lsp = kvd_session_find_pool(&c->sess, p->links[i]);
        if (lsp != NULL) {
            kvd_pool_set_now(lsp->pool, uv_now(c->srv->loop));
            order[norder++] = lsp;
        }
    }
    uint64_t max_held = kvd_tenants_quota(c->srv->tenants, c->sess.tenant)->max_held;
    while (nhit < n) {
        size_t got = 0;
        int room[1 + KVD_MAX_DOMAINS_PER_TENANT];
        for (uint32_t k = 0; k < norder && got == 0; k++) {
            size_t m = n - nhit;
            if (max_held != 0) {
                uint64_t held = kvd_pool_tenant_usage(order[k]->pool, c->sess.tenant).held;
                uint64_t left = held < max_held ? max_held - held : 0;
                m = left < m ? (size_t)left : m;
            }
            room[k] = m > 0;
            if (m == 0) {
                continue;
            }
            /* Each position takes the first pool (this one, groups, commons) that has it: a
             * run found in a later pool stops where an earlier pool has the next block. */
            for (size_t t = 1; k > 0 && t < m; t++) {
                int earlier = 0;
                for (uint32_t e = 0; e < k && !earlier; e++) {
                    earlier = room[e] && kvd_pool_has(order[e]->pool, hashes[nhit + t]);
                }
                if (earlier) {
                    m = t;
                }
            }
            rc = kvd_pool_lookup(order[k]->pool, c->sess.tenant, hashes + nhit, m, refs + nhit,
                                 &got);
            if (rc == KV_OK && got > 0) {
                rc = hold_refs(c, order[k], refs + nhit, got, msg);
            }
            if (rc != KV_OK) {
                /* Give back the runs of earlier pools (hold_refs gave back its own). */
                for (size_t j = 0; j < nhit; j++) {
                    kvd_session_pool *q = kvd_session_find_pool(&c->sess, pool_of[j]);
                    KV_ASSERT(q != NULL && kvd_refs_sub(&q->refs, refs[j].id, 1) == KV_OK);
                    (void)kvd_pool_release(q->pool, c->sess.id, c->sess.tenant, &refs[j], 1);
                }
                if (msg[0] == '\0') {
                    snprintf(msg, KVD_ERRMSG, "lookup failed: %s", kv_strerror(rc));
                }
                goto cleanup;
            }
            for (size_t j = nhit; j < nhit + got; j++) {
                pool_of[j] = order[k]->pool_id;
            }
        }
        nhit += got;
        if (got == 0 || norder == 1) {
            break;
        }
    }
    kvd_tenant_counters *tc = kvd_events_tenant(&c->srv->events, c->sess.tenant);
    tc->queries++;
    tc->query_blocks += n;
    tc->hit_blocks += nhit;
    tc->hit_tokens += (uint64_t)nhit * p->layout.tokens_per_block;
    /* Announce, per searched pool, the segments this session was not sent: a hit may lie in
     * one (PROTOCOL.md §6, Segments a reply hands out). */
    uint32_t nsf = new_segments_from(sp);
    Kvd__SegmentNotice notice[KVD_MAX_DOMAINS_PER_TENANT], *notices[KVD_MAX_DOMAINS_PER_TENANT];
    size_t nnotices = 0;
    for (uint32_t k = 1; k < norder; k++) {
        uint32_t h = kvd_session_pool_first_unsent(order[k]);
        if (h != KVD_NO_SEGMENT) {
            kvd__segment_notice__init(&notice[nnotices]);
            notice[nnotices].pool_id = order[k]->pool_id;
            notice[nnotices].first_index = h;
            notices[nnotices] = &notice[nnotices];
            nnotices++;
        }
    }
#ifndef NDEBUG
    for (size_t j = 0; j < nhit; j++) {
        if (pool_of[j] == sp->pool_id) {
            check_announced(sp, &refs[j], 1, nsf);
        } else {
            kvd_session_pool *q = kvd_session_find_pool(&c->sess, pool_of[j]);
            uint32_t seg = refs[j].id / kvd_pool_config_get(q->pool)->blocks_per_segment;
            int announced = 0;
            for (size_t k = 0; k < nnotices; k++) {
                announced |= notice[k].pool_id == pool_of[j] && notice[k].first_index <= seg;
            }
            KV_ASSERT(kvd_session_pool_was_sent(q, seg) || announced);
        }
    }
#endif
    rc = send_blocks_reply(c, id, refs, nhit, nsf, 1, l->search_domains ? pool_of : NULL, notices,
                           nnotices);
cleanup:
    return rc;
}

/* Checks a handle the session says it holds `times` times, faults in this order (PROTOCOL.md §7,
 * "Which error"): ENOENT for an id that names no block of the pool; EPERM when the session holds
 * no reference on that id (whatever the generation: a block it never received is not its to
 * name); ESTALE when it holds the id at another generation; EPERM when it holds fewer than
 * `times` references. */
static kv_err check_held(kvd_session_pool *sp, kvd_block_ref r, uint32_t times, const char *what,
                         size_t i, char *msg) {
    kvd_block_info info;
    if (kvd_pool_block_info(sp->pool, r.id, &info) != KV_OK) {
        FAIL(KV_ENOENT, "%s[%zu]: block %u does not exist in pool %u", what, i, r.id, sp->pool_id);
    }
    uint32_t gen = 0;
    uint32_t held = kvd_refs_count(&sp->refs, r.id, &gen);
    if (held == 0) {
        FAIL(KV_EPERM, "%s[%zu]: block %u is not held by this session", what, i, r.id);
    }
    if (gen != r.gen) {
        FAIL(KV_ESTALE, "%s[%zu]: block %u generation %u is stale (this session holds %u)", what, i,
             r.id, r.gen, gen);
    }
    if (held < times) {
        FAIL(KV_EPERM, "%s[%zu]: block %u is held %u times by this session, not %u", what, i, r.id,
             held, times);
    }
    return KV_OK;
}

static kv_err on_commit(kvd_conn *c, uint64_t id, const Kvd__Commit *cm, char *msg) {
    kvd_session_pool *sp;
    kvd_srv_pool *p;
    kv_err rc = session_pool(c, cm->pool_id, &sp, &p, msg);
    if (rc != KV_OK) {
        return rc;
    }
    rc = kvd_validate_commit(cm, c->srv->cfg.max_blocks_per_request, msg, KVD_ERRMSG);
    if (rc != KV_OK) {
        return rc;
    }
    if (!kvd_tenants_domain_writable(c->srv->tenants, c->sess.tenant, p->domain)) {
        FAIL(KV_EPERM, "pool %u is read-only for tenant %s (only the daemon writes the commons)",
             p->pool_id, kvd_tenants_name(c->srv->tenants, c->sess.tenant));
    }
    rc = need_segment0(sp, msg);
    if (rc != KV_OK) {
        return rc;
    }
    size_t n = cm->n_entries;
    kvd_refs seen;
    kvd_refs_init(&seen);
    kvd_block_ref *canon = calloc(n > 0 ? n : 1, sizeof(*canon));
    Kvd__BlockRef *v = calloc(n > 0 ? n : 1, sizeof(*v));
    Kvd__BlockRef **pv = calloc(n > 0 ? n : 1, sizeof(*pv));
    if (canon == NULL || v == NULL || pv == NULL) {
        snprintf(msg, KVD_ERRMSG, "no memory for %zu entries", n);
        rc = KV_ENOMEM;
        goto cleanup;
    }
    /* Check everything first: the commit itself must not fail half way. */
    for (size_t i = 0; i < n; i++) {
        const Kvd__CommitEntry *e = cm->entries[i];
        kvd_block_ref r = {e->block->id, e->block->gen};
        rc = check_held(sp, r, 1, "entries", i, msg);
        if (rc != KV_OK) {
            goto cleanup;
        }
        kvd_block_info info;
        rc = kvd_pool_block_info(p->pool, r.id, &info);
        if (rc != KV_OK || info.state != KVD_BLOCK_WRITING || info.owner_session != c->sess.id) {
            snprintf(msg, KVD_ERRMSG, "entries[%zu]: block %u is not WRITING under this session", i,
                     r.id);
            rc = KV_ESTATE;
            goto cleanup;
        }
        if (kvd_refs_count(&seen, r.id, NULL) > 0) {
            snprintf(msg, KVD_ERRMSG, "entries[%zu]: block %u is listed twice", i, r.id);
            rc = KV_ESTATE;
            goto cleanup;
        }
        /* A valid parent: none (KVD_NO_BLOCK), an earlier entry of this request, or a
         * COMMITTED block of this pool the session holds; never the block itself. */
        if (e->parent != KVD_NO_BLOCK && kvd_refs_count(&seen, e->parent, NULL) == 0) {
            const char *why = NULL;
            kvd_block_info pinfo;
            if (e->parent == r.id) {
                why = "is the block itself";
            } else if (kvd_pool_block_info(p->pool, e->parent, &pinfo) != KV_OK) {
                why = "does not exist in this pool";
            } else if (kvd_refs_count(&sp->refs, e->parent, NULL) == 0) {
                why = "is not held by this session";
            } else if (pinfo.state != KVD_BLOCK_COMMITTED) {
                why = "is not committed (and not an earlier entry of this request)";
            }
            if (why != NULL) {
                snprintf(msg, KVD_ERRMSG,
                         "entries[%zu]: parent block %u %s; a parent is a committed block this "
                         "session holds or an earlier entry of the same Commit",
                         i, e->parent, why);
                rc = KV_EINVAL;
                goto cleanup;
            }
        }
        rc = kvd_refs_add(&seen, r.id, r.gen, 1);
        if (rc != KV_OK) {
            snprintf(msg, KVD_ERRMSG, "no memory");
            goto cleanup;
        }
    }
    for (size_t i = 0; i < n; i++) {
        const Kvd__CommitEntry *e = cm->entries[i];
        kvd_block_ref r = {e->block->id, e->block->gen};
        kv_hash128 h = {e->hash->lo, e->hash->hi};
        uint32_t parent = e->parent;
        /* A parent committed earlier in this request may have been replaced by a duplicate. */
        for (size_t j = 0; j < i && parent != KVD_NO_BLOCK; j++) {
            if (cm->entries[j]->block->id == parent) {
                parent = canon[j].id;
                break;
            }
        }
        rc = kvd_pool_commit(p->pool, c->sess.id, r, h, parent, &canon[i]);
        if (rc != KV_OK) {
            KV_LOG(ERROR, "KVD-COMMIT", "session %llu: commit of checked block %u failed: %s",
                   (unsigned long long)c->sess.id, r.id, kv_strerror(rc));
            snprintf(msg, KVD_ERRMSG, "internal: entries[%zu] failed after %zu were committed: %s",
                     i, i, kv_strerror(rc));
            rc = KV_EINTERNAL;
            goto cleanup;
        }
        if (canon[i].id != r.id) {
            /* Our block was freed; the reference now lives on the canonical one. */
            KV_ASSERT(kvd_refs_sub(&sp->refs, r.id, 1) == KV_OK);
            if (kvd_refs_add(&sp->refs, canon[i].id, canon[i].gen, 1) != KV_OK) {
                (void)kvd_pool_release(p->pool, c->sess.id, c->sess.tenant, &canon[i], 1);
                snprintf(msg, KVD_ERRMSG, "no memory to record a reference");
                rc = KV_ENOMEM;
                goto cleanup;
            }
        }
        kvd__block_ref__init(&v[i]);
        v[i].id = canon[i].id;
        v[i].gen = canon[i].gen;
        pv[i] = &v[i];
    }
    Kvd__Envelope env;
    env_init(c, &env, id);
    kvd_events_tenant(&c->srv->events, c->sess.tenant)->commits += n;
    Kvd__CommitReply cr = KVD__COMMIT_REPLY__INIT;
    cr.n_canonical = n;
    cr.canonical = pv;
    /* A duplicate's canonical block may lie in a segment grown by another session. */
    cr.new_segments_from = new_segments_from(sp);
    check_announced(sp, canon, n, cr.new_segments_from);
    env.body_case = KVD__ENVELOPE__BODY_COMMIT_REPLY;
    env.commit_reply = &cr;
    rc = kvd_conn_send(c, &env, NULL, 0);
    /* After the reply is queued: a promotion into the commons changes no state of this
     * session, and its failure (budget) is not this request's. */
    for (size_t i = 0; i < n && p->commons_id != 0; i++) {
        kv_hash128 h = {cm->entries[i]->hash->lo, cm->entries[i]->hash->hi};
        kvd_tenancy_count_commit(c->srv, cm->pool_id, c->sess.tenant, canon[i], h);
    }
cleanup:
    kvd_refs_fini(&seen);
    free(canon);
    free(v);
    free(pv);
    return rc;
}

/* Occurrences of block ids among one request's list: open addressing in the request arena,
 * sized for the list (load <= 1/2), so counting repeats costs no malloc and no rehash. */
typedef struct seen_tab {
    uint32_t *ids;    /* key per slot; KVD_NO_BLOCK = empty */
    uint32_t *counts; /* occurrences per slot */
    uint32_t mask;    /* slots - 1 (a power of two) */
} seen_tab;

static kv_err seen_init(kvd_conn *c, seen_tab *t, size_t n) {
    size_t cap = 16;
    while (cap < 2 * n) {
        cap *= 2;
    }
    t->ids = kvd_conn_scratch(c, cap * sizeof(uint32_t));
    t->counts = kvd_conn_scratch(c, cap * sizeof(uint32_t));
    if (t->ids == NULL || t->counts == NULL) {
        return KV_ENOMEM;
    }
    memset(t->ids, 0xff, cap * sizeof(uint32_t));
    t->mask = (uint32_t)(cap - 1);
    return KV_OK;
}

/* Counts one more occurrence of id (!= KVD_NO_BLOCK) and returns how many there were. */
static uint32_t seen_add(seen_tab *t, uint32_t id) {
    uint32_t i = (id * 2654435761u) & t->mask;
    while (t->ids[i] != id && t->ids[i] != KVD_NO_BLOCK) {
        i = (i + 1) & t->mask;
    }
    if (t->ids[i] == KVD_NO_BLOCK) {
        t->ids[i] = id;
        t->counts[i] = 0;
    }
    return ++t->counts[i];
}

/* Release and Rewind: the list comes as nrep BlockRefs or as packed (8 bytes a block). */
static kv_err on_release(kvd_conn *c, uint64_t id, uint32_t pool_id, size_t nrep,
                         Kvd__BlockRef *const *blocks, const ProtobufCBinaryData *packed,
                         int rewind, char *msg) {
    kvd_session_pool *sp;
    kv_err rc = session_pool(c, pool_id, &sp, NULL, msg);
    if (rc != KV_OK) {
        return rc;
    }
    /* EINVAL, ETOOBIG, then EPROTO, as for Lookup. */
    size_t n;
    rc = kvd_validate_refs(nrep, blocks, c->srv->cfg.max_blocks_per_request, msg, KVD_ERRMSG);
    if (rc == KV_OK) {
        rc =
            kvd_validate_list(packed->len / KV_WIRE_BLOCK_BYTES, c->srv->cfg.max_blocks_per_request,
                              "blocks_packed", msg, KVD_ERRMSG);
    }
    if (rc != KV_OK) {
        return rc;
    }
    if (kv_wire_list_count(nrep, packed->len, KV_WIRE_BLOCK_BYTES, &n) != KV_OK) {
        FAIL(KV_EPROTO,
             "blocks_packed of %zu bytes: not a multiple of %d, or sent together with blocks",
             packed->len, KV_WIRE_BLOCK_BYTES);
    }
    seen_tab times;
    kvd_block_ref *refs = kvd_conn_scratch(c, sizeof(*refs) * n);
    if (refs == NULL || seen_init(c, &times, n) != KV_OK) {
        snprintf(msg, KVD_ERRMSG, "no memory");
        rc = KV_ENOMEM;
        goto cleanup;
    }
    for (size_t i = 0; i < n; i++) {
        /* Checked from the local: reading refs[i] back right after its two 4-byte stores
         * misses store forwarding (it cost as much as the rest of the loop). */
        kvd_block_ref r;
        if (nrep > 0) {
            r.id = blocks[i]->id;
            r.gen = blocks[i]->gen;
        } else {
            kv_wire_block_get(packed->data, i, &r.id, &r.gen);
        }
        refs[i] = r;
        /* Count repeats so that a block listed k times needs k references. */
        uint32_t k = r.id != KVD_NO_BLOCK ? seen_add(&times, r.id) : 1;
        rc = check_held(sp, r, k, "blocks", i, msg);
        if (rc != KV_OK) {
            goto cleanup;
        }
    }
    rc = kvd_pool_release(sp->pool, c->sess.id, c->sess.tenant, refs, n);
    if (rc != KV_OK) {
        snprintf(msg, KVD_ERRMSG, "release failed: %s", kv_strerror(rc));
        goto cleanup;
    }
    for (size_t i = 0; i < n; i++) {
        KV_ASSERT(kvd_refs_sub(&sp->refs, refs[i].id, 1) == KV_OK);
    }
    Kvd__Envelope env;
    env_init(c, &env, id);
    Kvd__ReleaseReply rr = KVD__RELEASE_REPLY__INIT;
    Kvd__RewindReply wr = KVD__REWIND_REPLY__INIT;
    if (rewind) {
        env.body_case = KVD__ENVELOPE__BODY_REWIND_REPLY;
        env.rewind_reply = &wr;
    } else {
        env.body_case = KVD__ENVELOPE__BODY_RELEASE_REPLY;
        env.release_reply = &rr;
    }
    rc = kvd_conn_send(c, &env, NULL, 0);
cleanup:
    return rc;
}

static kv_err on_pin(kvd_conn *c, uint64_t id, const Kvd__Pin *pin, char *msg) {
    kvd_session_pool *sp;
    kv_err rc = session_pool(c, pin->pool_id, &sp, NULL, msg);
    if (rc != KV_OK) {
        return rc;
    }
    rc = kvd_validate_pin(pin, c->srv->cfg.max_blocks_per_request, msg, KVD_ERRMSG);
    if (rc != KV_OK) {
        return rc;
    }
    if (kvd_pool_config_get(sp->pool)->domain == KVD_DOMAIN_COMMONS) {
        FAIL(KV_EPERM, "pool %u is the commons: its blocks cannot be pinned by a tenant",
             pin->pool_id);
    }
    /* A block listed twice is pinned once and costs one unit of max-pinned; retention 0 pins
     * nothing, so it costs nothing. */
    uint64_t new_pins = 0;
    seen_tab once;
    if (seen_init(c, &once, pin->n_blocks) != KV_OK) {
        FAIL(KV_ENOMEM, "no memory");
    }
    for (size_t i = 0; i < pin->n_blocks; i++) {
        kvd_block_ref r = {pin->blocks[i]->id, pin->blocks[i]->gen};
        uint32_t k = r.id != KVD_NO_BLOCK ? seen_add(&once, r.id) : 1;
        rc = check_held(sp, r, 1, "blocks", i, msg);
        if (rc != KV_OK) {
            return rc;
        }
        kvd_block_info info;
        if (kvd_pool_block_info(sp->pool, r.id, &info) != KV_OK ||
            (info.state != KVD_BLOCK_COMMITTED && info.state != KVD_BLOCK_CACHED)) {
            FAIL(KV_ESTATE, "blocks[%zu]: block %u is not committed", i, r.id);
        }
        new_pins += !info.pinned && k == 1;
    }
    uint64_t max_pinned = kvd_tenants_quota(c->srv->tenants, c->sess.tenant)->max_pinned;
    uint64_t pinned = kvd_pool_tenant_usage(sp->pool, c->sess.tenant).pinned;
    if (!pin->unpin && pin->retention_ms != 0 && max_pinned != 0 &&
        pinned + new_pins > max_pinned) {
        FAIL(KV_EQUOTA,
             "tenant %s: quota max-pinned is %llu blocks per pool; %llu pinned, %llu more asked",
             kvd_tenants_name(c->srv->tenants, c->sess.tenant), (unsigned long long)max_pinned,
             (unsigned long long)pinned, (unsigned long long)new_pins);
    }
    for (size_t i = 0; i < pin->n_blocks; i++) {
        kvd_block_ref r = {pin->blocks[i]->id, pin->blocks[i]->gen};
        rc = pin->unpin ? kvd_pool_unpin(sp->pool, r)
                        : kvd_pool_pin(sp->pool, r, pin->retention_ms, (uint8_t)pin->priority,
                                       c->sess.tenant);
        if (rc != KV_OK) {
            FAIL(rc, "blocks[%zu]: %s", i, kv_strerror(rc));
        }
    }
    Kvd__Envelope env;
    env_init(c, &env, id);
    Kvd__PinReply pr = KVD__PIN_REPLY__INIT;
    env.body_case = KVD__ENVELOPE__BODY_PIN_REPLY;
    env.pin_reply = &pr;
    return kvd_conn_send(c, &env, NULL, 0);
}

typedef struct stat_list {
    Kvd__Stat *v;       /* stats */
    char (*names)[64];  /* their names */
    size_t n, cap;      /* used, allocated */
    const char *prefix; /* prepended to names from a sink */
} stat_list;

static void stat_add(void *arg, const char *name, uint64_t value) {
    stat_list *l = arg;
    if (l->n == l->cap) {
        return;
    }
    kvd__stat__init(&l->v[l->n]);
    snprintf(l->names[l->n], sizeof(l->names[0]), "%s%s", l->prefix, name);
    l->v[l->n].name = l->names[l->n];
    l->v[l->n].value = value;
    l->n++;
}

static kv_err on_stats(kvd_conn *c, uint64_t id, const Kvd__Stats *st, char *msg) {
    kvd_server *s = c->srv;
    kvd_session_pool *sp = NULL;
    if (st->pool_id != 0) {
        kv_err rc = session_pool(c, st->pool_id, &sp, NULL, msg);
        if (rc != KV_OK) {
            return rc;
        }
    }
    stat_list l;
    l.cap = 64;
    l.n = 0;
    l.prefix = "";
    l.v = calloc(l.cap, sizeof(*l.v));
    l.names = calloc(l.cap, sizeof(*l.names));
    Kvd__Stat **pv = calloc(l.cap, sizeof(*pv));
    kv_err rc = KV_ENOMEM;
    if (l.v == NULL || l.names == NULL || pv == NULL) {
        snprintf(msg, KVD_ERRMSG, "no memory for stats");
        goto cleanup;
    }
    stat_add(&l, "daemon.sessions", s->nconns);
    stat_add(&l, "daemon.pools", s->npools);
    stat_add(&l, "daemon.pool_memory_bytes", s->cfg.pool_memory);
    stat_add(&l, "daemon.pool_memory_used", budget_used(s));
    stat_add(&l, "daemon.buffer_bytes", s->buf_bytes);
    stat_add(&l, "daemon.conns_paused", s->npaused);
    stat_add(&l, "session.id", c->sess.id);
    stat_add(&l, "session.requests", c->sess.requests);
    stat_add(&l, "session.errors", c->sess.errors);
    stat_add(&l, "session.pools_attached", c->sess.npools);
    stat_add(&l, "session.refs_held", kvd_session_refs_held(&c->sess));
    if (sp != NULL) {
        stat_add(&l, "pool.id", sp->pool_id);
        l.prefix = "pool.";
        kvd_pool_stats(sp->pool, stat_add, &l);
        l.prefix = "";
        stat_add(&l, "pool.session_refs", sp->refs.total);
    }
    for (size_t i = 0; i < l.n; i++) {
        pv[i] = &l.v[i];
    }
    Kvd__Envelope env;
    env_init(c, &env, id);
    Kvd__StatsReply sr = KVD__STATS_REPLY__INIT;
    sr.n_stats = l.n;
    sr.stats = pv;
    env.body_case = KVD__ENVELOPE__BODY_STATS_REPLY;
    env.stats_reply = &sr;
    rc = kvd_conn_send(c, &env, NULL, 0);
cleanup:
    free(l.v);
    free(l.names);
    free(pv);
    return rc;
}

static kv_err on_ping(kvd_conn *c, uint64_t id, const Kvd__Ping *p, char *msg) {
    kv_err rc = kvd_validate_ping(p, c->srv->cfg.max_frame_bytes, msg, KVD_ERRMSG);
    if (rc != KV_OK) {
        return rc;
    }
    Kvd__Envelope env;
    env_init(c, &env, id);
    Kvd__Pong pong = KVD__PONG__INIT;
    pong.nonce = p->nonce;
    pong.payload = p->payload;
    env.body_case = KVD__ENVELOPE__BODY_PONG;
    env.pong = &pong;
    return kvd_conn_send(c, &env, NULL, 0);
}

static kv_err on_goodbye(kvd_conn *c, uint64_t id) {
    Kvd__Envelope env;
    env_init(c, &env, id);
    Kvd__GoodbyeReply gr = KVD__GOODBYE_REPLY__INIT;
    env.body_case = KVD__ENVELOPE__BODY_GOODBYE_REPLY;
    env.goodbye_reply = &gr;
    kv_err rc = kvd_conn_send(c, &env, NULL, 0);
    c->close_after_flush = 1;
    return rc;
}

void kvd_handle_request(kvd_conn *c, const Kvd__Envelope *env) {
    char msg[KVD_ERRMSG];
    msg[0] = '\0';
    kv_err rc;
    c->sess.requests++;
    if (env->boot_epoch != 0 && env->boot_epoch != c->srv->boot_epoch) {
        snprintf(msg, sizeof(msg),
                 "request is for boot epoch %016llx; this daemon is %016llx: re-attach",
                 (unsigned long long)env->boot_epoch, (unsigned long long)c->srv->boot_epoch);
        rc = KV_EEPOCH;
        goto error;
    }
    if (!c->sess.hello && env->body_case != KVD__ENVELOPE__BODY_HELLO) {
        snprintf(msg, sizeof(msg), "Hello must be the first request");
        rc = KV_EPROTO;
        goto error;
    }
    switch (env->body_case) {
        case KVD__ENVELOPE__BODY_HELLO:
            rc = on_hello(c, env->id, env->hello, msg);
            break;
        case KVD__ENVELOPE__BODY_ATTACH_POOL:
            rc = on_attach(c, env->id, env->attach_pool, msg);
            break;
        case KVD__ENVELOPE__BODY_MAP_SEGMENTS:
            rc = on_map(c, env->id, env->map_segments, msg);
            break;
        case KVD__ENVELOPE__BODY_LOOKUP:
            rc = on_lookup(c, env->id, env->lookup, msg);
            break;
        case KVD__ENVELOPE__BODY_ALLOCATE:
            rc = on_allocate(c, env->id, env->allocate, msg);
            break;
        case KVD__ENVELOPE__BODY_COMMIT:
            rc = on_commit(c, env->id, env->commit, msg);
            break;
        case KVD__ENVELOPE__BODY_RELEASE:
            rc = on_release(c, env->id, env->release->pool_id, env->release->n_blocks,
                            env->release->blocks, &env->release->blocks_packed, 0, msg);
            break;
        case KVD__ENVELOPE__BODY_REWIND:
            rc = on_release(c, env->id, env->rewind->pool_id, env->rewind->n_blocks,
                            env->rewind->blocks, &env->rewind->blocks_packed, 1, msg);
            break;
        case KVD__ENVELOPE__BODY_PIN:
            rc = on_pin(c, env->id, env->pin, msg);
            break;
        case KVD__ENVELOPE__BODY_STATS:
            rc = on_stats(c, env->id, env->stats, msg);
            break;
        case KVD__ENVELOPE__BODY_PING:
            rc = on_ping(c, env->id, env->ping, msg);
            break;
        case KVD__ENVELOPE__BODY_GOODBYE:
            rc = on_goodbye(c, env->id);
            break;
        default:
            snprintf(msg, sizeof(msg), "body %d is not a request", (int)env->body_case);
            rc = KV_EPROTO;
            break;
    }
    if (rc == KV_OK || rc == KV_ECLOSED) {
        return;
    }
error:
    if (rc == KV_EPROTO) {
        kvd_conn_log_proto(c, msg, NULL, 0);
    }
    kvd_conn_send_error(c, env->id, rc, msg);
}
