/* kvd_pool: blocks, their lifecycle and eviction (see pool.h).
 *
 * Every block has one 64-byte record in its segment's record array. A block sits on at most
 * one intrusive doubly linked list, named by its `list` field: the free list (LIFO, so hot
 * records are reused), the eviction order of the policy (LRU and PREFIX_LRU: one list each;
 * S3-FIFO: small and main queues), the list of pinned CACHED blocks, or the list of pinned
 * COMMITTED blocks (so that expiry finds every pin, referenced or not). Other referenced blocks
 * (WRITING, COMMITTED) are on no list; no referenced block is on an eviction list, which is what
 * keeps it out of eviction's reach. Counts
 * per state, per segment and per tenant are kept exactly, so allocation knows in O(1) whether it
 * can succeed and kvd_pool_check can compare them with a full walk.
 *
 * PREFIX_LRU keeps, per block, how many committed or cached blocks name it as their parent.
 * When a block gets its second child it is a branch point: it and its ancestors are marked
 * SHARED (the walk stops at the first one already marked, so each block is marked at most once
 * per life: amortized O(1) per commit). At the head of the LRU list a SHARED block that was
 * reused since it entered the cache gets another round instead of being evicted, one per
 * reuse up to FREQ_MAX (the S3-FIFO main queue's rule, applied only to shared prefixes). A
 * conversation's own history is a chain without branches, so it is evicted in plain LRU order;
 * a system prompt or few-shot preamble that many requests continue differently outlives a burst
 * of one-off prompts.
 *
 * S3-FIFO and ADAPTIVE count children too and keep a block with any on LIST_INNER: only leaves
 * are on their queues, so they evict tails of cached prefixes only (leaf_policy). ADAPTIVE marks
 * SHARED blocks as PREFIX_LRU does and gives them its rounds on the leaves; see the ADAPTIVE
 * section below.
 */
#include "daemon/core/pool.h"

#include <stdlib.h>
#include <string.h>

#include "common/kv_log.h"

enum {
    LIST_NONE = 0,   /* referenced: WRITING or COMMITTED */
    LIST_FREE = 1,   /* FREE */
    LIST_LRU = 2,    /* CACHED, unpinned, LRU policy */
    LIST_SMALL = 3,  /* CACHED, unpinned, S3-FIFO probationary queue */
    LIST_MAIN = 4,   /* CACHED, unpinned, S3-FIFO main queue */
    LIST_PINNED = 5, /* CACHED, pinned */
    LIST_PLRU = 6,   /* CACHED, unpinned, PREFIX_LRU policy */
    LIST_PINREF = 7, /* COMMITTED (referenced), pinned: only so that expiry finds its pin */
    LIST_INNER = 8,  /* CACHED, unpinned, with a cached child: leaf policies evict it last */
    LIST_AREC = 9,   /* CACHED, unpinned leaf, ADAPTIVE: not reused since it entered */
    LIST_AFREQ = 10, /* CACHED, unpinned leaf, ADAPTIVE: reused (or a ghost hit) */
    LIST_COUNT = 11, /* the pool-wide lists (lists[]); the aside lists follow, per tenant */
    /* CACHED, unpinned, skipped for its tenant's guarantee at the head of eviction queue 0, 1
     * or 2 (evict_queue): on the tenant's own aside list for that queue (aside[]) */
    LIST_ASIDE0 = 11,
    LIST_ASIDE1 = 12,
    LIST_ASIDE2 = 13,
    LIST_ALL = 14,
};

#define BLOCK_PINNED 0x01u  /* flags: pin set (may have expired if the block is referenced) */
#define BLOCK_SHARED 0x02u  /* flags: PREFIX_LRU: prefix of two or more cached continuations */
#define BLOCK_CORRUPT 0x04u /* flags: quarantined (out of the index; FREE at its last release) */
#define BLOCK_HOME2 0x08u   /* flags: on LIST_INNER, belongs to the second queue (main, AFREQ) */
#define BLOCK_LEASED 0x10u  /* flags: holds a tier lease (kvd_pool_lease; one at a time) */
#define BLOCK_PRIVATE 0x20u /* flags: WRITING and never committed (kvd_pool_make_private) */
#define FREQ_MAX 3          /* S3-FIFO's two-bit access counter */
#define NQUEUE 3            /* eviction queues counted per tenant (evict_queue) */

typedef struct pool_block {
    uint64_t hlo;         /* chain hash, low half (COMMITTED/CACHED) */
    uint64_t hhi;         /* chain hash, high half */
    uint64_t aux;         /* WRITING: owner session; pinned: retention end (pool ms) */
    uint64_t last_access; /* pool stamp (kvd_pool.stamp) of the last allocate, hit, hold or
                             release */
    uint32_t prev;        /* list links (block ids), KVD_NO_BLOCK at the ends */
    uint32_t next;
    uint32_t parent;     /* parent block id or KVD_NO_BLOCK */
    uint32_t gen;        /* bumped each time the block returns to FREE */
    uint32_t refcount;   /* WRITING: 1 (the lease); COMMITTED: >= 1; FREE/CACHED: 0 */
    uint16_t hits;       /* lookups that returned it, saturating */
    uint16_t pin_tenant; /* pinned: the tenant the pin is charged to (max-pinned) */
    uint16_t tenant;     /* tenant that allocated it */
    uint8_t state;       /* kvd_block_state */
    uint8_t flags;       /* BLOCK_PINNED */
    uint8_t pin_prio;    /* highest priority of the current pin */
    uint8_t freq;        /* S3-FIFO access count since it entered the cache, 0..FREQ_MAX */
    uint8_t list;        /* LIST_* it is on */
    uint8_t nchild;      /* PREFIX_LRU, S3-FIFO, ADAPTIVE: COMMITTED/CACHED blocks naming it
                            parent, sticky at 255 */
} pool_block;

_Static_assert(sizeof(pool_block) <= 64, "block metadata must fit 64 bytes");
_Static_assert(KVD_MAX_TENANTS <= 65536, "tenant ids are stored in 16 bits");

typedef struct pool_list {
    uint32_t head; /* first block (next to evict / next to allocate) */
    uint32_t tail; /* last block */
    uint64_t len;  /* blocks on the list */
} pool_list;

typedef struct pool_segment {
    pool_block *blocks;   /* blocks_per_segment records; NULL for an empty slot */
    kvd_segment_mem mem;  /* backend memory */
    uint32_t nfree;       /* FREE blocks */
    uint32_t nevict;      /* CACHED unpinned blocks */
    uint32_t ngcached;    /* of them, blocks of tenants with a guarantee (park_candidate) */
    uint64_t last_access; /* newest last_access of its blocks since it was grown */
    uint32_t next_gen;    /* first generation of the slot's blocks when grown again */
    uint32_t serial;      /* which segment of the pool's life this is (kvd_pool_segment_serial) */
    int parked;           /* memory discarded, blocks FREE on no list (kvd_pool_park) */
} pool_segment;

struct kvd_pool {
    kvd_pool_config cfg;         /* copy of the caller's config */
    kvd_index *idx;              /* borrowed prefix index */
    const kvd_backend_ops *be;   /* borrowed backend */
    void *be_ctx;                /* backend context */
    pool_segment **segs;         /* [segcap] one record per slot (allocated for every slot) */
    pool_block **blkv;           /* [segcap] segs[i]->blocks, for the hot path's block lookup */
    uint32_t segcap;             /* slots allocated (grows with nslots, at most MAX_SEGMENTS) */
    uint32_t nslots;             /* highest live slot + 1 */
    uint32_t nsegs;              /* live segments, parked ones included */
    uint32_t nparked;            /* live segments that are parked */
    uint32_t next_serial;        /* serial of the next segment grown (from 1) */
    uint32_t slot_reuses;        /* segments grown into a slot below nslots (after a shrink) */
    uint64_t resident_bytes;     /* memory of the live segments that are not parked */
    uint32_t bps;                /* blocks per segment */
    uint32_t bps_log;            /* log2(bps) when bps is a power of two, else UINT32_MAX */
    uint64_t now;                /* pool clock, ms */
    uint64_t stamp;              /* blocks' and segments' ages: now << 20, one more for each
                                    kvd_pool_set_now within a millisecond (so requests in one
                                    ms keep their order; the blocks of one call share it) */
    uint64_t min_pin_expiry;     /* no pin on the pinned list expires before this */
    pool_list lists[LIST_COUNT]; /* indexed by LIST_*; LIST_NONE unused */
    uint64_t n_writing;          /* blocks by state (FREE is lists[LIST_FREE].len) */
    uint64_t n_committed;
    uint64_t n_cached;
    uint64_t n_pinned;         /* blocks with BLOCK_PINNED */
    kvd_tenant_usage *tenants; /* [ntcap] per tenant id (grown on first use of a tenant id) */
    uint64_t *guarantee;       /* [ntcap]; 0 = none */
    uint32_t *tevict;          /* [ntcap * NQUEUE] evictable blocks per tenant and queue
                                  (evict_queue) */
    uint16_t *gtenants;        /* [ntcap] the first nguarantee: tenants with a guarantee */
    pool_list *aside;          /* [ntcap * NQUEUE] blocks skipped for the tenant's guarantee,
                                  per queue, in the order they reached the head (pick_victim) */
    uint64_t n_aside[NQUEUE];  /* blocks on the aside lists, per queue */
    uint32_t ntcap;            /* tenant ids the arrays cover */
    kvd_pool_drop_fn drop_fn[KVD_DROP_HOOKS]; /* told of every indexed block that leaves */
    void *drop_arg[KVD_DROP_HOOKS];           /* drop_fn's arguments */
    uint64_t n_leased;                        /* tier leases: references charged to no tenant */
    uint32_t nguarantee;                      /* tenants with a guarantee */
    uint64_t *ghost;                          /* S3-FIFO ghost: tag << 32 | eviction sequence */
    size_t ghost_mask;                        /* ghost slots - 1 */
    uint32_t ghost_seq;                       /* evictions recorded in the ghost so far (wraps) */
    uint64_t inner_home[2];    /* LIST_INNER blocks by home queue (0: small/AREC, 1: main/AFREQ) */
    int defer_leaves;          /* an admin walk runs: child_removed leaves inner blocks be */
    kvd_leaf_order leaf_order; /* ADAPTIVE: how the two sides' oldest leaves are chosen */
    uint64_t queries;          /* lookups */
    uint64_t query_blocks;     /* hashes asked */
    uint64_t hit_blocks;       /* hashes found */
    uint64_t commits;          /* commits, duplicates included */
    uint64_t commits_duplicate;
    uint64_t quarantines;   /* blocks kvd_pool_quarantine took out of the index */
    uint64_t verified;      /* hits verify-blocks checked (kvd_pool_count_verified) */
    uint64_t n_quarantined; /* of them, COMMITTED ones still held (BLOCK_CORRUPT) */
    uint64_t rewinds;       /* blocks given back by Rewind (kvd_pool_count_rewind) */
    uint64_t n_private;     /* WRITING blocks marked private */
    uint64_t unshares;      /* COMMITTED blocks turned back into private ones */
    uint64_t evictions[KVD_EVICT_REASONS];
};

/* ---- records and lists ---------------------------------------------------------------- */

static inline pool_block *blk_at(const kvd_pool *p, uint32_t id) {
    if (p->bps_log != UINT32_MAX) {
        return &p->blkv[id >> p->bps_log][id & (p->bps - 1)];
    }
    return &p->blkv[id / p->bps][id % p->bps];
}

static inline pool_segment *seg_of(const kvd_pool *p, uint32_t id) {
    return p->segs[p->bps_log != UINT32_MAX ? id >> p->bps_log : id / p->bps];
}

/* Grows the per-slot arrays to cover slots [0, n) (doubling; every slot gets its record).
 * KV_ENOMEM leaves them as they were. Records never move once made (kvd_pool_segment hands out
 * pointers into them). */
static kv_err slots_reserve(kvd_pool *p, uint32_t n) {
    if (n <= p->segcap) {
        return KV_OK;
    }
    uint32_t cap = p->segcap == 0 ? 4 : p->segcap;
    while (cap < n) {
        cap *= 2;
    }
    if (cap > KVD_MAX_SEGMENTS) {
        cap = KVD_MAX_SEGMENTS;
    }
    pool_segment **segs = realloc(p->segs, sizeof(*segs) * cap);
    if (segs == NULL) {
        return KV_ENOMEM;
    }
    p->segs = segs;
    pool_block **blkv = realloc(p->blkv, sizeof(*blkv) * cap);
    if (blkv == NULL) {
        return KV_ENOMEM;
    }
    p->blkv = blkv;
    for (uint32_t i = p->segcap; i < cap; i++) {
        p->segs[i] = calloc(1, sizeof(pool_segment));
        if (p->segs[i] == NULL) {
            for (uint32_t j = p->segcap; j < i; j++) {
                free(p->segs[j]);
            }
            return KV_ENOMEM;
        }
        p->blkv[i] = NULL;
    }
    p->segcap = cap;
    return KV_OK;
}

/* Grows the per-tenant arrays to cover tenant id t (a power of two at least 16). KV_EINVAL for
 * an id out of range, KV_ENOMEM (arrays unchanged). Memory grows with the tenants a pool meets,
 * not with KVD_MAX_TENANTS (a private pool sees one). */
static kv_err tenant_grow(kvd_pool *p, uint32_t t);

static inline kv_err tenant_room(kvd_pool *p, uint32_t t) {
    return t < p->ntcap ? KV_OK : tenant_grow(p, t);
}

static kv_err tenant_grow(kvd_pool *p, uint32_t t) {
    if (t >= KVD_MAX_TENANTS) {
        return KV_EINVAL;
    }
    uint32_t cap = p->ntcap == 0 ? 16 : p->ntcap;
    while (cap <= t) {
        cap *= 2;
    }
    kvd_tenant_usage *u = realloc(p->tenants, sizeof(*u) * cap);
    if (u == NULL) {
        return KV_ENOMEM;
    }
    p->tenants = u;
    uint64_t *g = realloc(p->guarantee, sizeof(*g) * cap);
    if (g == NULL) {
        return KV_ENOMEM;
    }
    p->guarantee = g;
    uint32_t *e = realloc(p->tevict, sizeof(*e) * cap * NQUEUE);
    if (e == NULL) {
        return KV_ENOMEM;
    }
    p->tevict = e;
    uint16_t *gt = realloc(p->gtenants, sizeof(*gt) * cap);
    if (gt == NULL) {
        return KV_ENOMEM;
    }
    p->gtenants = gt;
    pool_list *al = realloc(p->aside, sizeof(*al) * cap * NQUEUE);
    if (al == NULL) {
        return KV_ENOMEM;
    }
    p->aside = al;
    for (uint32_t i = p->ntcap * NQUEUE; i < cap * NQUEUE; i++) {
        al[i].head = al[i].tail = KVD_NO_BLOCK;
        al[i].len = 0;
    }
    memset(u + p->ntcap, 0, sizeof(*u) * (cap - p->ntcap));
    memset(g + p->ntcap, 0, sizeof(*g) * (cap - p->ntcap));
    memset(e + p->ntcap * NQUEUE, 0, sizeof(*e) * (cap - p->ntcap) * NQUEUE);
    p->ntcap = cap;
    return KV_OK;
}

static inline uint32_t blk_id(const kvd_pool *p, uint32_t seg, uint32_t slot) {
    return seg * p->bps + slot;
}

static inline uint64_t pack_ref(uint32_t id, uint32_t gen) {
    return (uint64_t)gen << 32 | id;
}

static inline kv_hash128 blk_hash(const pool_block *b) {
    kv_hash128 h = {b->hlo, b->hhi};
    return h;
}

/* Eviction lists count their blocks per tenant, so that a victim pick knows in O(guaranteed
 * tenants) whether an unprotected block is left in a queue (pick_victim). Queue 0: the first
 * queue of a two-queue policy (S3-FIFO small, ADAPTIVE recency); 1: the other eviction lists;
 * 2: the inner blocks of the leaf policies. */
static inline int evict_queue(int which) {
    switch (which) {
        case LIST_SMALL:
        case LIST_AREC:
            return 0;
        case LIST_LRU:
        case LIST_MAIN:
        case LIST_PLRU:
        case LIST_AFREQ:
            return 1;
        case LIST_INNER:
            return 2;
        case LIST_ASIDE0:
        case LIST_ASIDE1:
        case LIST_ASIDE2:
            return which - LIST_ASIDE0;
        default:
            return -1;
    }
}

static inline void tevict_add(kvd_pool *p, int which, const pool_block *b, int delta) {
    int q = evict_queue(which);
    if (q >= 0) {
        p->tevict[(uint32_t)b->tenant * NQUEUE + (uint32_t)q] += (uint32_t)delta;
    }
    if (which == LIST_INNER || which == LIST_ASIDE2) {
        p->inner_home[(b->flags & BLOCK_HOME2) ? 1 : 0] += (uint64_t)(int64_t)delta;
    }
    if (which >= LIST_ASIDE0) {
        p->n_aside[which - LIST_ASIDE0] += (uint64_t)(int64_t)delta;
    }
}

/* The list a block of tenant b->tenant on list `which` is linked on. */
static inline pool_list *list_of(kvd_pool *p, int which, const pool_block *b) {
    if (which < LIST_COUNT) {
        return &p->lists[which];
    }
    return &p->aside[(uint32_t)b->tenant * NQUEUE + (uint32_t)(which - LIST_ASIDE0)];
}

static void list_push_tail(kvd_pool *p, int which, uint32_t id, pool_block *b) {
    tevict_add(p, which, b, 1);
    pool_list *l = list_of(p, which, b);
    b->list = (uint8_t)which;
    b->next = KVD_NO_BLOCK;
    b->prev = l->tail;
    if (l->tail != KVD_NO_BLOCK) {
        blk_at(p, l->tail)->next = id;
    } else {
        l->head = id;
    }
    l->tail = id;
    l->len++;
}

/* Links block id at the head of list l (numbered which); no counts. */
static inline void link_head(kvd_pool *p, pool_list *l, int which, uint32_t id, pool_block *b) {
    b->list = (uint8_t)which;
    b->prev = KVD_NO_BLOCK;
    b->next = l->head;
    if (l->head != KVD_NO_BLOCK) {
        blk_at(p, l->head)->prev = id;
    } else {
        l->tail = id;
    }
    l->head = id;
    l->len++;
}

static inline void list_push_head(kvd_pool *p, int which, uint32_t id, pool_block *b) {
    tevict_add(p, which, b, 1);
    link_head(p, list_of(p, which, b), which, id, b);
}

static void list_remove(kvd_pool *p, uint32_t id, pool_block *b) {
    pool_list *l = list_of(p, b->list, b);
    KV_ASSERT(b->list != LIST_NONE && l->len > 0);
    tevict_add(p, b->list, b, -1);
    if (b->prev != KVD_NO_BLOCK) {
        blk_at(p, b->prev)->next = b->next;
    } else {
        l->head = b->next;
    }
    if (b->next != KVD_NO_BLOCK) {
        blk_at(p, b->next)->prev = b->prev;
    } else {
        l->tail = b->prev;
    }
    l->len--;
    b->list = LIST_NONE;
    b->prev = b->next = KVD_NO_BLOCK;
    b->flags &= (uint8_t)~BLOCK_HOME2;
    (void)id;
}

/* Takes the head of the free list (list_remove specialised to the head, which has no prev). */
static inline pool_block *free_pop(kvd_pool *p, uint32_t *id_out) {
    pool_list *l = &p->lists[LIST_FREE];
    uint32_t id = l->head;
    pool_block *b = blk_at(p, id);
    KV_ASSERT(l->len > 0 && b->list == LIST_FREE && b->prev == KVD_NO_BLOCK);
    uint32_t nx = b->next;
    if (nx != KVD_NO_BLOCK) {
        blk_at(p, nx)->prev = KVD_NO_BLOCK;
    } else {
        l->tail = KVD_NO_BLOCK;
    }
    l->head = nx;
    l->len--;
    b->list = LIST_NONE;
    b->next = KVD_NO_BLOCK;
    *id_out = id;
    return b;
}

static uint64_t evictable_count(const kvd_pool *p) {
    return p->lists[LIST_LRU].len + p->lists[LIST_SMALL].len + p->lists[LIST_MAIN].len +
           p->lists[LIST_PLRU].len + p->lists[LIST_INNER].len + p->lists[LIST_AREC].len +
           p->lists[LIST_AFREQ].len + p->n_aside[0] + p->n_aside[1] + p->n_aside[2];
}

/* S3-FIFO and ADAPTIVE evict only leaves of the cached prefix tree: a block that a cached or
 * committed block names as its parent waits on LIST_INNER (evicted only when no leaf is left,
 * i.e. when every leaf below it is pinned or referenced), so a lookup never finds a prefix
 * with a hole and its tail still cached. */
static inline int leaf_policy(const kvd_pool *p) {
    return p->cfg.policy == KVD_EVICT_S3FIFO || p->cfg.policy == KVD_EVICT_ADAPTIVE;
}

/* Policies that count each block's children (nchild). */
static inline int counts_children(const kvd_pool *p) {
    return leaf_policy(p) || p->cfg.policy == KVD_EVICT_PREFIX_LRU;
}

/* The leaf list of a two-queue policy: home 0 (S3-FIFO small, ADAPTIVE recency) or 1. */
static inline int home_list(const kvd_pool *p, int home) {
    if (p->cfg.policy == KVD_EVICT_S3FIFO) {
        return home ? LIST_MAIN : LIST_SMALL;
    }
    return home ? LIST_AFREQ : LIST_AREC;
}

/* ---- S3-FIFO ghost ---------------------------------------------------------------------- */

/* A 64-bit fingerprint of the block's hash, mixed (splitmix64's finalizer) so that structured
 * hashes, not only random ones, spread over the ghost's slots and tags. */
static inline uint64_t ghost_fp(const pool_block *b) {
    uint64_t x = b->hlo ^ (b->hhi * 0xC2B2AE3D27D4EB4Full);
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

/* Tag bit 0 marks a used slot. */
static void ghost_insert(kvd_pool *p, const pool_block *b) {
    if (p->ghost == NULL) {
        return;
    }
    uint64_t fp = ghost_fp(b);
    uint64_t tag = (fp >> 32) | 1u;
    p->ghost[fp & p->ghost_mask] = tag << 32 | p->ghost_seq++;
}

/* A ghost entry counts while fewer evictions than the pool has blocks happened since. */
static int ghost_has(const kvd_pool *p, const pool_block *b) {
    if (p->ghost == NULL) {
        return 0;
    }
    uint64_t fp = ghost_fp(b);
    uint64_t e = p->ghost[fp & p->ghost_mask];
    uint32_t age = p->ghost_seq - (uint32_t)e;
    return (e >> 32) == ((fp >> 32) | 1u) && (uint64_t)age <= (uint64_t)p->nsegs * p->bps;
}

/* Sizes the ghost to the pool (a power of two >= blocks); keeps the old one when out of memory
 * (the ghost is a hint, never a correctness matter). */
static void ghost_resize(kvd_pool *p) {
    if (!leaf_policy(p)) {
        return;
    }
    size_t want = 64;
    while (want < (size_t)p->nsegs * p->bps) {
        want <<= 1;
    }
    if (p->ghost != NULL && want == p->ghost_mask + 1) {
        return;
    }
    uint64_t *g = calloc(want, sizeof(uint64_t));
    if (g == NULL) {
        return;
    }
    free(p->ghost);
    p->ghost = g;
    p->ghost_mask = want - 1;
}

/* ---- ADAPTIVE: PREFIX_LRU's rounds on the leaves of the prefix tree --------------------
 * Leaves are evicted in LRU order, tail of a prefix first, from two sides kept in that order
 * (recency: not reused since the block entered the cache; frequency: reused, or committed
 * again while the ghost remembered it) whose oldest leaves are compared by age. A leaf that is
 * a branch point of the prefix tree or an ancestor of one (BLOCK_SHARED, as PREFIX_LRU marks
 * them) and was reused gets one more round per reuse (freq, at most FREQ_MAX) when it is the
 * oldest, and its shared ancestors, which wait as inner blocks for it, spend a round with it:
 * a shared chain lives as many rounds as its most reused block, not one per block in turn. A
 * commit found in the ghost counts as a reuse (a block evicted and wanted again within one
 * pool's worth of evictions earns its round). */

/* A block was just committed: a ghost hit counts as a reuse. */
static void adaptive_admit(kvd_pool *p, pool_block *b) {
    if (ghost_has(p, b)) {
        b->freq = 1;
    }
}

/* ---- state transitions ------------------------------------------------------------------ */

static int tenant_protected(const kvd_pool *p, const pool_block *b) {
    if (p->nguarantee == 0) {
        return 0;
    }
    uint64_t g = p->guarantee[b->tenant];
    return g != 0 && p->tenants[b->tenant].cached <= g;
}

/* A block of seg goes onto (delta 1) or off (-1) the eviction order: the segment's counts that
 * kvd_pool_park_candidate decides on without walking its blocks. */
static inline void seg_evictable(kvd_pool *p, pool_segment *seg, const pool_block *b, int delta) {
    seg->nevict += (uint32_t)delta;
    if (p->nguarantee > 0 && p->guarantee[b->tenant] != 0) {
        seg->ngcached += (uint32_t)delta;
    }
}

/* A block of seg was used now (its last_access set): the segment's newest access. */
static inline void seg_touch(const kvd_pool *p, pool_segment *seg) {
    if (p->stamp > seg->last_access) {
        seg->last_access = p->stamp;
    }
}

/* Puts an unpinned block that just became CACHED (or was unpinned) into the eviction order. */
static void evict_order_insert(kvd_pool *p, uint32_t id, pool_block *b) {
    seg_evictable(p, seg_of(p, id), b, 1);
    if (p->cfg.policy == KVD_EVICT_LRU) {
        list_push_tail(p, LIST_LRU, id, b);
        return;
    }
    if (p->cfg.policy == KVD_EVICT_PREFIX_LRU) {
        list_push_tail(p, LIST_PLRU, id, b);
        return;
    }
    /* S3-FIFO: reused since it entered the cache, or evicted from the small queue recently:
     * proven reuse goes straight to the main queue. ADAPTIVE: reused (a lookup hit it, or its
     * commit found it in the ghost) goes to the frequency side. */
    int home = b->freq > 0 || (p->cfg.policy == KVD_EVICT_S3FIFO && ghost_has(p, b));
    if (b->nchild > 0) {
        if (home) {
            b->flags |= BLOCK_HOME2; /* before the push: the inner count goes by it */
        }
        list_push_tail(p, LIST_INNER, id, b);
        return;
    }
    list_push_tail(p, home_list(p, home), id, b);
}

/* Leaf policies: a block on LIST_INNER lost its last child and becomes a leaf. It goes to the
 * head of its queue: every request that used it used a child too (or ended at it), so it is as
 * old as the leaf just evicted below it and the next to go in LRU order. */
static void inner_to_leaf(kvd_pool *p, uint32_t id, pool_block *b) {
    int home = (b->flags & BLOCK_HOME2) != 0;
    list_remove(p, id, b);
    list_push_head(p, home_list(p, home), id, b);
}

/* Leaf policies: a CACHED leaf got a child (a commit named it parent): it waits on the inner
 * list from now on, keeping its queue. */
static void leaf_to_inner(kvd_pool *p, uint32_t id, pool_block *b) {
    int home = b->list == LIST_MAIN || b->list == LIST_AFREQ || b->list == LIST_ASIDE1;
    list_remove(p, id, b);
    if (home) {
        b->flags |= BLOCK_HOME2;
    }
    list_push_tail(p, LIST_INNER, id, b);
}

/* Returns a block (any state but FREE, on no list) to FREE with a new generation. */
static inline void block_to_free(kvd_pool *p, uint32_t id, pool_block *b) {
    KV_ASSERT(b->list == LIST_NONE && b->refcount == 0);
    b->state = KVD_BLOCK_FREE;
    b->gen++;
    b->flags = 0;
    b->freq = 0;
    b->nchild = 0;
    b->hits = 0;
    b->pin_tenant = 0;
    b->aux = 0;
    b->hlo = b->hhi = 0;
    b->parent = KVD_NO_BLOCK;
    seg_of(p, id)->nfree++;
    link_head(p, &p->lists[LIST_FREE], LIST_FREE, id, b); /* no eviction count covers FREE */
}

static void unpin_block(kvd_pool *p, uint32_t id, pool_block *b) {
    KV_ASSERT(b->flags & BLOCK_PINNED);
    b->flags &= (uint8_t)~BLOCK_PINNED;
    b->pin_prio = 0;
    b->aux = 0;
    p->n_pinned--;
    p->tenants[b->pin_tenant].pinned--;
    b->pin_tenant = 0;
    list_remove(p, id, b); /* LIST_PINNED (CACHED) or LIST_PINREF (COMMITTED) */
    if (b->state == KVD_BLOCK_CACHED) {
        evict_order_insert(p, id, b);
    }
}

/* PREFIX_LRU: the record of a block's parent while that is COMMITTED or CACHED, else NULL. The
 * parent id is the committing client's word and the parent may have been evicted and its
 * record reused since, so this is a hint for the eviction order, never more. */
static pool_block *parent_of(const kvd_pool *p, const pool_block *b) {
    if (b->parent == KVD_NO_BLOCK || b->parent >= p->nslots * p->bps ||
        seg_of(p, b->parent)->blocks == NULL) {
        return NULL;
    }
    pool_block *pb = blk_at(p, b->parent);
    if (pb->state != KVD_BLOCK_COMMITTED && pb->state != KVD_BLOCK_CACHED) {
        return NULL;
    }
    return pb;
}

/* A block was just committed under its parent. PREFIX_LRU: a parent with two children is a
 * branch point: it and its ancestors become SHARED. The walk stops at a block already marked
 * (and so it ends even on a cycle of stale parent ids), so it costs amortized O(1). Leaf
 * policies: a cached parent stops being a leaf. */
static void child_added(kvd_pool *p, pool_block *b) {
    if (!counts_children(p)) {
        return;
    }
    pool_block *pb = parent_of(p, b);
    if (pb == NULL) {
        return;
    }
    if (pb->nchild < UINT8_MAX) {
        pb->nchild++;
    }
    if (p->cfg.policy == KVD_EVICT_PREFIX_LRU || p->cfg.policy == KVD_EVICT_ADAPTIVE) {
        for (pool_block *x = pb->nchild >= 2 ? pb : NULL; x != NULL && !(x->flags & BLOCK_SHARED);
             x = parent_of(p, x)) {
            x->flags |= BLOCK_SHARED;
        }
    }
    if (leaf_policy(p) && pb->nchild == 1 && pb->state == KVD_BLOCK_CACHED &&
        pb->list != LIST_PINNED) {
        leaf_to_inner(p, b->parent, pb);
    }
}

/* A committed block is going away (an exact count unless it saturated; the parent id is the
 * client's word, so after a parent was evicted with children left, which only shrink, park,
 * admin eviction and an eviction forced past the leaves do, a count can be off: the order is
 * a hint, never a correctness matter). Leaf policies: a parent left without children becomes
 * a leaf (unless an admin walk is running: it fixes them up at its end). */
static void child_removed(kvd_pool *p, pool_block *b) {
    if (!counts_children(p)) {
        return;
    }
    pool_block *pb = parent_of(p, b);
    if (pb == NULL || pb->nchild == 0 || pb->nchild == UINT8_MAX) {
        return;
    }
    if (--pb->nchild == 0 && (pb->list == LIST_INNER || pb->list == LIST_ASIDE2) &&
        !p->defer_leaves) {
        inner_to_leaf(p, b->parent, pb);
    }
}

/* Takes a CACHED unpinned block out of the index and the eviction order, back to FREE. */
static void drop_cached(kvd_pool *p, uint32_t id, pool_block *b) {
    KV_ASSERT(b->state == KVD_BLOCK_CACHED && !(b->flags & BLOCK_PINNED));
    int ghosted =
        p->cfg.policy == KVD_EVICT_ADAPTIVE ||
        (p->cfg.policy == KVD_EVICT_S3FIFO && (b->list == LIST_SMALL || b->list == LIST_ASIDE0));
    list_remove(p, id, b);
    kv_err err = kvd_index_remove(p->idx, p->cfg.pool_id, blk_hash(b));
    KV_ASSERT(err == KV_OK);
    if (ghosted) {
        ghost_insert(p, b);
    }
    child_removed(p, b);
    seg_evictable(p, seg_of(p, id), b, -1);
    p->n_cached--;
    p->tenants[b->tenant].cached--;
    block_to_free(p, id, b);
}

/* Tells the drop hooks, in slot order. */
static void drop_tell(kvd_pool *p, kv_hash128 h, kv_hash128 parent, int reason) {
    for (int i = 0; i < KVD_DROP_HOOKS; i++) {
        if (p->drop_fn[i] != NULL) {
            p->drop_fn[i](p->drop_arg[i], p, h, parent, reason);
        }
    }
}

/* Evicts a CACHED unpinned block (drop_cached), counted under reason. */
static void evict_block(kvd_pool *p, uint32_t id, pool_block *b, kvd_evict_reason reason) {
    if (p->drop_fn[0] != NULL || p->drop_fn[1] != NULL) {
        const pool_block *pb = parent_of(p, b);
        drop_tell(p, blk_hash(b), pb != NULL ? blk_hash(pb) : (kv_hash128){0, 0}, (int)reason);
    }
    drop_cached(p, id, b);
    p->evictions[reason]++;
}

/* Takes a reference on a COMMITTED or CACHED block for tenant. */
static void take_ref(kvd_pool *p, uint32_t id, pool_block *b, uint32_t tenant) {
    pool_segment *seg = seg_of(p, id);
    if (b->state == KVD_BLOCK_CACHED) {
        if (b->list != LIST_PINNED) {
            seg_evictable(p, seg, b, -1);
        }
        list_remove(p, id, b);
        b->state = KVD_BLOCK_COMMITTED;
        p->n_cached--;
        p->n_committed++;
        p->tenants[b->tenant].cached--;
        if (b->flags & BLOCK_PINNED) {
            list_push_tail(p, LIST_PINREF, id, b); /* its pin keeps expiring while referenced */
        }
    }
    b->refcount++;
    if (b->freq < FREQ_MAX) {
        b->freq++;
    }
    b->last_access = p->stamp;
    seg_touch(p, seg);
    p->tenants[tenant].held++;
}

/* A COMMITTED block's last reference went away. */
static void block_to_cached(kvd_pool *p, uint32_t id, pool_block *b) {
    if (b->flags & BLOCK_CORRUPT) {
        /* Quarantined (kvd_pool_quarantine): out of the index already, so it is not cached
         * but freed; a pin it had goes with it. */
        if (b->flags & BLOCK_PINNED) {
            unpin_block(p, id, b);
        }
        p->n_committed--;
        p->n_quarantined--;
        block_to_free(p, id, b);
        return;
    }
    b->state = KVD_BLOCK_CACHED;
    b->last_access = p->stamp;
    seg_touch(p, seg_of(p, id));
    p->n_committed--;
    p->n_cached++;
    p->tenants[b->tenant].cached++;
    if (b->flags & BLOCK_PINNED) {
        list_remove(p, id, b); /* LIST_PINREF */
        if (b->aux > p->now) {
            list_push_tail(p, LIST_PINNED, id, b);
            if (b->aux < p->min_pin_expiry) {
                p->min_pin_expiry = b->aux;
            }
            return;
        }
        /* Its pin expired since the last sweep (the clock moved without a sweep). */
        b->flags &= (uint8_t)~BLOCK_PINNED;
        b->pin_prio = 0;
        b->aux = 0;
        p->n_pinned--;
        p->tenants[b->pin_tenant].pinned--;
        b->pin_tenant = 0;
    }
    evict_order_insert(p, id, b);
}

/* Removes every expired pin, on CACHED and COMMITTED blocks alike (an expired pin must stop
 * counting against max-pinned and blocks_pinned at once, referenced or not). */
static void pin_sweep(kvd_pool *p) {
    uint64_t next = UINT64_MAX;
    static const int lists[] = {LIST_PINNED, LIST_PINREF};
    for (int k = 0; k < 2; k++) {
        uint32_t id = p->lists[lists[k]].head;
        while (id != KVD_NO_BLOCK) {
            pool_block *b = blk_at(p, id);
            uint32_t nx = b->next;
            if (b->aux <= p->now) {
                unpin_block(p, id, b);
            } else if (b->aux < next) {
                next = b->aux;
            }
            id = nx;
        }
    }
    p->min_pin_expiry = next;
}

/* Moves the head of list `which` to the tail of list `to` (a second chance). */
static void list_rotate(kvd_pool *p, int which, int to) {
    uint32_t id = p->lists[which].head;
    pool_block *b = blk_at(p, id);
    list_remove(p, id, b);
    list_push_tail(p, to, id, b);
}

/* A block of a tenant under its guaranteed share reached the head of eviction list `which`: it
 * moves to the tenant's aside list for that queue, where no later pick meets it again while
 * the tenant stays protected (each block is skipped once, not once per pick: O(1) amortized). */
static void move_aside(kvd_pool *p, int which, uint32_t id, pool_block *b) {
    int home2 = (b->flags & BLOCK_HOME2) != 0;
    int q = evict_queue(which);
    list_remove(p, id, b);
    if (home2) {
        b->flags |= BLOCK_HOME2; /* before the push: the inner count goes by it */
    }
    list_push_tail(p, LIST_ASIDE0 + q, id, b);
}

/* Evictable blocks of protected tenants (under their guaranteed share) per queue: all of them
 * (prot) and those on the pool-wide lists (main: prot less their aside lists). O(tenants with
 * a guarantee). */
static void protected_counts(const kvd_pool *p, uint64_t prot[NQUEUE], uint64_t main[NQUEUE]) {
    for (int q = 0; q < NQUEUE; q++) {
        prot[q] = main[q] = 0;
    }
    for (uint32_t i = 0; i < p->nguarantee; i++) {
        uint32_t t = p->gtenants[i];
        if (p->tenants[t].cached <= p->guarantee[t]) {
            for (int q = 0; q < NQUEUE; q++) {
                prot[q] += p->tevict[t * NQUEUE + q];
                main[q] += p->tevict[t * NQUEUE + q] - p->aside[t * NQUEUE + q].len;
            }
        }
    }
}

/* The oldest head (by last access) of the aside lists of queues [q0, q1] of the tenants with a
 * guarantee, only of unprotected ones with `unprotected_only`; KVD_NO_BLOCK when there is none.
 * Aside blocks reached the head of their queue before every block now in it, so they go first
 * once their tenant may lose them. O(tenants with a guarantee). */
static uint32_t aside_oldest(const kvd_pool *p, int q0, int q1, int unprotected_only) {
    uint32_t best = KVD_NO_BLOCK;
    uint64_t best_at = 0;
    for (uint32_t i = 0; i < p->nguarantee; i++) {
        uint32_t t = p->gtenants[i];
        if (unprotected_only && p->tenants[t].cached <= p->guarantee[t]) {
            continue;
        }
        for (int q = q0; q <= q1; q++) {
            uint32_t id = p->aside[t * NQUEUE + (uint32_t)q].head;
            if (id != KVD_NO_BLOCK &&
                (best == KVD_NO_BLOCK || blk_at(p, id)->last_access < best_at)) {
                best = id;
                best_at = blk_at(p, id)->last_access;
            }
        }
    }
    return best;
}

/* The next block the policy evicts. With honour, a block of a tenant under its guaranteed share
 * is skipped while any unprotected block is evictable, in any queue: it moves to its tenant's
 * aside list (move_aside), from which it goes first once the tenant is over its share again, or
 * when every evictable block is protected (then protected blocks go in policy order). The
 * per-tenant queue counts make "is any unprotected block left" O(guaranteed tenants), and each
 * block is skipped once, so a pick costs O(1) amortized plus O(guaranteed tenants).
 * Requires a candidate. */
static uint32_t pick_victim(kvd_pool *p, int honour) {
    uint64_t budget = evictable_count(p);
    KV_ASSERT(budget > 0);
    uint64_t prot[NQUEUE] = {0, 0, 0}, protm[NQUEUE] = {0, 0, 0};
    if (p->nguarantee > 0) {
        protected_counts(p, prot, protm);
        honour = honour && budget > prot[0] + prot[1] + prot[2];
        /* Leaves set aside first (inner ones only where an inner block would go). */
        uint32_t id = aside_oldest(p, 0, 1, honour);
        if (id != KVD_NO_BLOCK) {
            return id;
        }
    } else {
        honour = 0;
    }
    if (p->cfg.policy == KVD_EVICT_LRU || p->cfg.policy == KVD_EVICT_PREFIX_LRU) {
        int which = p->cfg.policy == KVD_EVICT_LRU ? LIST_LRU : LIST_PLRU;
        for (;;) {
            uint32_t id = p->lists[which].head;
            KV_ASSERT(id != KVD_NO_BLOCK);
            pool_block *b = blk_at(p, id);
            if (which == LIST_PLRU && (b->flags & BLOCK_SHARED) && b->freq > 0) {
                /* A reused shared prefix: one more round per reuse (freq only grows on hits,
                 * so rotations are paid for by the hits before them). */
                b->freq--;
                list_rotate(p, LIST_PLRU, LIST_PLRU);
                continue;
            }
            if (honour && tenant_protected(p, b)) {
                move_aside(p, which, id, b);
                continue;
            }
            return id;
        }
    }
    /* The leaf policies. S3-FIFO: evict from the small queue while it holds >= 10% of the
     * pool's blocks (its inner and aside blocks included), else from the main queue, whose
     * blocks get one more round per access (at most FREQ_MAX). ADAPTIVE: the older of the two
     * sides' oldest leaves (leaf order UNREUSED_FIRST: the recency side's while it has one), a
     * reused shared one getting another round. A queue whose evictable
     * leaves are all protected yields to the other one; when no leaf is left (every leaf below
     * the inner blocks is pinned or referenced) or all are protected, inner blocks go, oldest
     * first. */
    uint64_t small_target = ((uint64_t)p->nsegs * p->bps) / 10;
    if (small_target == 0) {
        small_target = 1;
    }
    int q0 = home_list(p, 0), q1 = home_list(p, 1);
    for (;;) {
        pool_list *s = &p->lists[q0];
        pool_list *m = &p->lists[q1];
        uint64_t us = s->len, um = m->len;
        if (honour) {
            us -= protm[0];
            um -= protm[1];
        }
        uint64_t first = s->len + p->inner_home[0] + p->n_aside[0];
        int which;
        if (us > 0 && (um == 0 || (p->cfg.policy == KVD_EVICT_S3FIFO
                                       ? first >= small_target
                                       : p->leaf_order == KVD_LEAF_ORDER_UNREUSED_FIRST ||
                                             blk_at(p, s->head)->last_access <=
                                                 blk_at(p, m->head)->last_access))) {
            which = q0;
        } else if (um > 0) {
            which = q1;
        } else {
            /* No (unprotected) leaf: an inner block goes, one set aside first (unprotected
             * ones exist then, since honouring means some block is unprotected). */
            if (p->nguarantee > 0) {
                uint32_t id = aside_oldest(p, 2, 2, honour);
                if (id != KVD_NO_BLOCK) {
                    return id;
                }
            }
            which = LIST_INNER;
        }
        uint32_t id = p->lists[which].head;
        KV_ASSERT(id != KVD_NO_BLOCK);
        pool_block *b = blk_at(p, id);
        if (p->cfg.policy == KVD_EVICT_S3FIFO && which == LIST_SMALL && b->freq > 0) {
            b->freq = 0;
            list_rotate(p, LIST_SMALL, LIST_MAIN);
            if (honour && tenant_protected(p, b)) {
                protm[0]--, protm[1]++;
            }
            continue;
        }
        if (p->cfg.policy == KVD_EVICT_ADAPTIVE && which != LIST_INNER &&
            (b->flags & BLOCK_SHARED) && b->freq > 0) {
            /* A reused shared leaf: one more round; the shared ancestors waiting for it spend
             * one with it (each decrement is paid for by the hit that raised freq, so the walk
             * is O(1) amortized). */
            for (pool_block *x = b; x != NULL && x->freq > 0 && (x->flags & BLOCK_SHARED);
                 x = parent_of(p, x)) {
                x->freq--;
            }
            b->last_access = p->stamp;
            seg_touch(p, seg_of(p, id));
            list_rotate(p, which, which);
            continue;
        }
        if (p->cfg.policy == KVD_EVICT_S3FIFO && which == LIST_MAIN && b->freq > 0) {
            b->freq--;
            list_rotate(p, LIST_MAIN, LIST_MAIN);
            continue;
        }
        if (honour && tenant_protected(p, b)) {
            move_aside(p, which, id, b);
            protm[evict_queue(which)]--;
            continue;
        }
        return id;
    }
}

/* A tenant's guarantee ended: its aside blocks go back to the heads of their queues in their
 * order (they were the oldest there), and no aside list holds a block of a tenant without a
 * guarantee. O(its aside blocks). */
static void aside_flush(kvd_pool *p, uint32_t t) {
    for (int q = 0; q < NQUEUE; q++) {
        pool_list *l = &p->aside[t * NQUEUE + (uint32_t)q];
        while (l->tail != KVD_NO_BLOCK) {
            uint32_t id = l->tail;
            pool_block *b = blk_at(p, id);
            int home2 = (b->flags & BLOCK_HOME2) != 0;
            list_remove(p, id, b);
            int to = q == 2                                  ? LIST_INNER
                     : p->cfg.policy == KVD_EVICT_LRU        ? LIST_LRU
                     : p->cfg.policy == KVD_EVICT_PREFIX_LRU ? LIST_PLRU
                                                             : home_list(p, q);
            if (home2) {
                b->flags |= BLOCK_HOME2;
            }
            list_push_head(p, to, id, b);
        }
    }
}

/* The segments' counts of guaranteed tenants' evictable blocks after tenant t's guarantee began
 * or ended (seg_evictable keeps them from then on). O(blocks), on a configuration change. */
static void seg_recount_guaranteed(kvd_pool *p) {
    for (uint32_t s = 0; s < p->nslots; s++) {
        pool_segment *seg = p->segs[s];
        seg->ngcached = 0;
        if (seg->blocks == NULL || seg->parked || p->nguarantee == 0 || seg->nevict == 0) {
            continue;
        }
        for (uint32_t i = 0; i < p->bps; i++) {
            const pool_block *b = &seg->blocks[i];
            if (b->state == KVD_BLOCK_CACHED && !(b->flags & BLOCK_PINNED) &&
                p->guarantee[b->tenant] != 0) {
                seg->ngcached++;
            }
        }
    }
}

/* Validates a handle and returns its record. */
static inline kv_err get_block(const kvd_pool *p, kvd_block_ref ref, pool_block **out) {
    if (ref.id >= p->nslots * p->bps) {
        return KV_ENOENT;
    }
    pool_block *blocks = seg_of(p, ref.id)->blocks; /* one segment lookup serves both */
    if (blocks == NULL) {
        return KV_ENOENT;
    }
    pool_block *b = &blocks[p->bps_log != UINT32_MAX ? ref.id & (p->bps - 1) : ref.id % p->bps];
    if (b->gen != ref.gen) {
        return KV_ESTALE;
    }
    *out = b;
    return KV_OK;
}

/* ---- lifecycle of the pool -------------------------------------------------------------- */

kv_err kvd_pool_alloc(const kvd_pool_config *cfg, kvd_index *idx, const kvd_backend_ops *be,
                      void *be_ctx, kvd_pool **out) {
    if (cfg == NULL || idx == NULL || be == NULL || out == NULL) {
        return KV_EINVAL;
    }
    if (cfg->blocks_per_segment == 0 || cfg->max_segments == 0 ||
        cfg->max_segments > KVD_MAX_SEGMENTS || cfg->layout.block_bytes == 0) {
        return KV_EINVAL;
    }
    /* Every id of every possible segment must stay below KVD_NO_BLOCK. */
    if ((uint64_t)cfg->blocks_per_segment * KVD_MAX_SEGMENTS >= KVD_NO_BLOCK) {
        return KV_EINVAL;
    }
    if (cfg->policy != KVD_EVICT_LRU && cfg->policy != KVD_EVICT_S3FIFO &&
        cfg->policy != KVD_EVICT_PREFIX_LRU && cfg->policy != KVD_EVICT_ADAPTIVE) {
        return KV_EINVAL;
    }
    kvd_pool *p = calloc(1, sizeof(*p));
    if (p == NULL) {
        return KV_ENOMEM;
    }
    if (slots_reserve(p, 1) != KV_OK || tenant_room(p, 0) != KV_OK) {
        goto fail_free;
    }
    p->cfg = *cfg;
    p->idx = idx;
    p->be = be;
    p->be_ctx = be_ctx;
    p->bps = cfg->blocks_per_segment;
    p->bps_log = UINT32_MAX;
    if ((p->bps & (p->bps - 1)) == 0) {
        p->bps_log = (uint32_t)__builtin_ctz(p->bps);
    }
    p->min_pin_expiry = UINT64_MAX;
    p->next_serial = 1;
    for (int i = 0; i < LIST_COUNT; i++) {
        p->lists[i].head = p->lists[i].tail = KVD_NO_BLOCK;
    }
    *out = p;
    return KV_OK;

fail_free:
    for (uint32_t i = 0; i < p->segcap; i++) {
        free(p->segs[i]);
    }
    free(p->segs);
    free(p->blkv);
    free(p->tenants);
    free(p->guarantee);
    free(p->gtenants);
    free(p->tevict);
    free(p->aside);
    free(p);
    return KV_ENOMEM;
}

void kvd_pool_free(kvd_pool *p) {
    if (p == NULL) {
        return;
    }
    for (uint32_t s = 0; s < p->nslots; s++) {
        pool_segment *seg = p->segs[s];
        if (seg->blocks == NULL) {
            continue;
        }
        for (uint32_t i = 0; i < p->bps; i++) {
            pool_block *b = &seg->blocks[i];
            if ((b->state == KVD_BLOCK_COMMITTED || b->state == KVD_BLOCK_CACHED) &&
                !(b->flags & BLOCK_CORRUPT)) {
                (void)kvd_index_remove(p->idx, p->cfg.pool_id, blk_hash(b));
            }
        }
        p->be->segment_free(p->be_ctx, &seg->mem);
        kvd_index_unreserve(p->idx, p->bps);
        free(seg->blocks);
    }
    for (uint32_t i = 0; i < p->segcap; i++) {
        free(p->segs[i]);
    }
    free(p->segs);
    free(p->blkv);
    free(p->tenants);
    free(p->guarantee);
    free(p->gtenants);
    free(p->tevict);
    free(p->aside);
    free(p->ghost);
    free(p);
}

const kvd_pool_config *kvd_pool_config_get(const kvd_pool *p) {
    return &p->cfg;
}

kv_err kvd_pool_grow(kvd_pool *p, uint32_t *seg_out) {
    if (p->nsegs - p->nparked >= p->cfg.max_segments) {
        return KV_ENOSPC;
    }
    uint32_t s = 0;
    while (s < p->segcap && p->segs[s]->blocks != NULL) {
        s++;
    }
    if (s >= KVD_MAX_SEGMENTS) {
        return KV_ENOSPC;
    }
    if (slots_reserve(p, s + 1) != KV_OK) {
        return KV_ENOMEM;
    }
    pool_segment *seg = p->segs[s];
    size_t rec_bytes = ((size_t)p->bps * sizeof(pool_block) + 63u) & ~(size_t)63u;
    pool_block *blocks = aligned_alloc(64, rec_bytes);
    if (blocks == NULL) {
        return KV_ENOMEM;
    }
    /* Every block this segment adds can be indexed: the index makes room now or never. */
    kv_err err = kvd_index_reserve(p->idx, p->bps);
    if (err != KV_OK) {
        free(blocks);
        return err;
    }
    kvd_segment_mem mem;
    memset(&mem, 0, sizeof(mem)); /* backends fill what they have; the rest (parts) stays 0 */
    const kv_layout *l = &p->cfg.layout;
    uint32_t nparts = l->num_layers * 2 + (l->scale_bytes != 0);
    if (p->be->segment_alloc_parts != NULL && l->arrangement == KV_LAYER_MAJOR &&
        nparts <= KVD_SEGMENT_PARTS_MAX) {
        /* One allocation per (layer, K|V) section, then the scales: see kvd_segment_mem. */
        uint64_t sizes[KVD_SEGMENT_PARTS_MAX];
        for (uint32_t i = 0; i < l->num_layers * 2; i++) {
            sizes[i] = (uint64_t)p->bps * l->kv_block_bytes;
        }
        if (l->scale_bytes != 0) {
            sizes[nparts - 1] = (uint64_t)p->bps * l->scale_bytes;
        }
        err = p->be->segment_alloc_parts(p->be_ctx, sizes, nparts, &mem);
    } else {
        err = p->be->segment_alloc(p->be_ctx, kv_layout_segment_bytes(l, p->bps), &mem);
    }
    if (err != KV_OK) {
        KV_LOG(WARN, "KVD-POOL-GROW", "pool %u: backend %s could not create a segment: %s",
               p->cfg.pool_id, p->be->name, kv_strerror(err));
        kvd_index_unreserve(p->idx, p->bps);
        free(blocks);
        return err;
    }
    memset(blocks, 0, rec_bytes);
    seg->blocks = blocks;
    p->blkv[s] = blocks;
    seg->mem = mem;
    seg->serial = p->next_serial++;
    if (s < p->nslots) {
        p->slot_reuses++; /* a session's "every slot below k was sent" may be stale now */
    }
    seg->nfree = 0;
    seg->nevict = 0;
    seg->ngcached = 0;
    seg->last_access = 0;
    /* New blocks go behind the free blocks already there, in id order: recently freed records
     * are reused first, and fresh segments fill only when the others are used up. */
    for (uint32_t i = 0; i < p->bps; i++) {
        pool_block *b = &blocks[i];
        b->gen = seg->next_gen;
        b->parent = KVD_NO_BLOCK;
        b->state = KVD_BLOCK_FREE;
        seg->nfree++;
        list_push_tail(p, LIST_FREE, blk_id(p, s, i), b);
    }
    p->nsegs++;
    p->resident_bytes += seg->mem.bytes;
    if (s >= p->nslots) {
        p->nslots = s + 1;
    }
    ghost_resize(p);
    if (seg_out != NULL) {
        *seg_out = s;
    }
    return KV_OK;
}

kv_err kvd_pool_shrink(kvd_pool *p, uint32_t *seg_out) {
    uint32_t s = p->nslots;
    for (;;) {
        /* Segment 0 lives as long as the pool: a client that attached has it, so
         * new_segments_from = 0 can keep meaning "nothing new" (PROTOCOL.md, MapSegments). */
        if (s <= 1) {
            return KV_ENOENT;
        }
        s--;
        pool_segment *seg = p->segs[s];
        if (seg->blocks != NULL && (seg->parked || seg->nfree + seg->nevict == p->bps)) {
            break;
        }
    }
    pool_segment *seg = p->segs[s];
    uint32_t max_gen = 0;
    for (uint32_t i = 0; i < p->bps; i++) {
        pool_block *b = &seg->blocks[i];
        uint32_t id = blk_id(p, s, i);
        if (b->state == KVD_BLOCK_CACHED) {
            evict_block(p, id, b, KVD_EVICT_SHRINK);
        }
        KV_ASSERT(b->state == KVD_BLOCK_FREE);
        if (!seg->parked) {
            list_remove(p, id, b);
        }
        if (b->gen > max_gen) {
            max_gen = b->gen;
        }
    }
    /* A later segment in this slot starts past every generation handed out here, so handles
     * into the old segment stay stale. */
    seg->next_gen = max_gen + 1;
    if (seg->parked) {
        seg->parked = 0;
        p->nparked--;
    } else {
        p->resident_bytes -= seg->mem.bytes;
    }
    p->be->segment_free(p->be_ctx, &seg->mem);
    kvd_index_unreserve(p->idx, p->bps);
    free(seg->blocks);
    seg->blocks = NULL;
    p->blkv[s] = NULL;
    seg->nfree = seg->nevict = seg->ngcached = 0;
    p->nsegs--;
    while (p->nslots > 0 && p->segs[p->nslots - 1]->blocks == NULL) {
        p->nslots--;
    }
    ghost_resize(p);
    if (seg_out != NULL) {
        *seg_out = s;
    }
    return KV_OK;
}

void kvd_pool_set_max_segments(kvd_pool *p, uint32_t max_segments) {
    if (max_segments > KVD_MAX_SEGMENTS) {
        max_segments = KVD_MAX_SEGMENTS;
    }
    p->cfg.max_segments = max_segments;
}

uint32_t kvd_pool_segment_slots(const kvd_pool *p) {
    return p->nslots;
}

const kvd_segment_mem *kvd_pool_segment(const kvd_pool *p, uint32_t seg) {
    if (seg >= p->nslots || p->segs[seg]->blocks == NULL) {
        return NULL;
    }
    return &p->segs[seg]->mem;
}

uint32_t kvd_pool_segment_serial(const kvd_pool *p, uint32_t seg) {
    if (seg >= p->nslots || p->segs[seg]->blocks == NULL) {
        return 0;
    }
    return p->segs[seg]->serial;
}

uint32_t kvd_pool_slot_reuses(const kvd_pool *p) {
    return p->slot_reuses;
}

/* ---- parking ---------------------------------------------------------------------------- */

/* Every block of seg is FREE or CACHED unpinned (so none is leased, referenced or pinned). */
static int seg_idle(const kvd_pool *p, const pool_segment *seg) {
    return seg->blocks != NULL && !seg->parked && seg->nfree + seg->nevict == p->bps;
}

kv_err kvd_pool_park_candidate(const kvd_pool *p, kvd_park_candidate *out) {
    if (p->be->segment_discard == NULL) {
        return KV_ENOTSUP;
    }
    /* Parking for another pool never takes a guaranteed share (PROTOCOL.md, TENANCY.md): while
     * a tenant is at or under its guarantee here, a segment holding a cached block of a tenant
     * with a guarantee stays (exact with one such tenant, the private pool's owner; with several
     * it may keep a segment of one over its share). The segments' counts make it O(segments). */
    int any_protected = 0;
    for (uint32_t i = 0; i < p->nguarantee && !any_protected; i++) {
        uint32_t t = p->gtenants[i];
        any_protected = p->tenants[t].cached <= p->guarantee[t];
    }
    kvd_park_candidate best = {0, 0, 0, 0};
    for (uint32_t s = 0; s < p->nslots; s++) {
        const pool_segment *seg = p->segs[s];
        if (!seg_idle(p, seg) || (any_protected && seg->ngcached > 0)) {
            continue;
        }
        uint32_t cached = seg->nevict;
        if (best.parkable == 0 || cached < best.cached ||
            (cached == best.cached && seg->last_access < best.last_access)) {
            best.seg = s;
            best.cached = cached;
            best.last_access = seg->last_access;
        }
        best.parkable++;
    }
    if (best.parkable == 0) {
        return KV_ENOENT;
    }
    best.last_access >>= 20; /* stamps (see kvd_pool.stamp) to ms: pools compare by ms */
    *out = best;
    return KV_OK;
}

kv_err kvd_pool_park(kvd_pool *p, uint32_t s) {
    if (p->be->segment_discard == NULL) {
        return KV_ENOTSUP;
    }
    if (s >= p->nslots || p->segs[s]->blocks == NULL) {
        return KV_ENOENT;
    }
    pool_segment *seg = p->segs[s];
    if (seg->parked) {
        return KV_EEXIST;
    }
    if (p->now >= p->min_pin_expiry) {
        pin_sweep(p);
    }
    if (!seg_idle(p, seg)) {
        return KV_ESTATE;
    }
    for (uint32_t i = 0; i < p->bps; i++) {
        pool_block *b = &seg->blocks[i];
        if (b->state == KVD_BLOCK_CACHED) {
            evict_block(p, blk_id(p, s, i), b, KVD_EVICT_SHRINK);
        }
    }
    /* Evicted first, discarded after: a failed discard leaves FREE blocks, never lost data of
     * indexed ones. */
    kv_err err = p->be->segment_discard(p->be_ctx, &seg->mem);
    if (err != KV_OK) {
        return err;
    }
    for (uint32_t i = 0; i < p->bps; i++) {
        pool_block *b = &seg->blocks[i];
        KV_ASSERT(b->state == KVD_BLOCK_FREE && b->list == LIST_FREE);
        list_remove(p, blk_id(p, s, i), b);
    }
    seg->nfree = 0;
    seg->parked = 1;
    p->nparked++;
    p->resident_bytes -= seg->mem.bytes;
    return KV_OK;
}

kv_err kvd_pool_unpark(kvd_pool *p, uint32_t s) {
    if (s >= p->nslots || p->segs[s]->blocks == NULL || !p->segs[s]->parked) {
        return KV_ENOENT;
    }
    if (p->nsegs - p->nparked >= p->cfg.max_segments) {
        return KV_ENOSPC;
    }
    pool_segment *seg = p->segs[s];
    if (p->be->segment_restore != NULL) {
        kv_err rc = p->be->segment_restore(p->be_ctx, &seg->mem);
        if (rc != KV_OK) {
            return rc; /* still parked: nothing changed */
        }
    }
    /* Like a grown segment: behind the free blocks already there, in id order. */
    for (uint32_t i = 0; i < p->bps; i++) {
        pool_block *b = &seg->blocks[i];
        KV_ASSERT(b->state == KVD_BLOCK_FREE && b->list == LIST_NONE);
        list_push_tail(p, LIST_FREE, blk_id(p, s, i), b);
    }
    seg->nfree = p->bps;
    seg->parked = 0;
    p->nparked--;
    p->resident_bytes += seg->mem.bytes;
    return KV_OK;
}

/* Unparks the lowest-numbered parked segment (allocate's growth). */
static kv_err unpark_any(kvd_pool *p) {
    for (uint32_t s = 0; s < p->nslots; s++) {
        if (p->segs[s]->blocks != NULL && p->segs[s]->parked) {
            return kvd_pool_unpark(p, s);
        }
    }
    return KV_ENOENT;
}

int kvd_pool_segment_parked(const kvd_pool *p, uint32_t s) {
    return s < p->nslots && p->segs[s]->blocks != NULL && p->segs[s]->parked;
}

uint32_t kvd_pool_resident_segments(const kvd_pool *p) {
    return p->nsegs - p->nparked;
}

int kvd_pool_in_use(const kvd_pool *p) {
    return p->n_writing + p->n_committed + p->n_cached > 0;
}

uint32_t kvd_pool_parked_segments(const kvd_pool *p) {
    return p->nparked;
}

uint32_t kvd_pool_growable_segments(const kvd_pool *p) {
    uint32_t resident = p->nsegs - p->nparked;
    uint32_t room = p->cfg.max_segments > resident ? p->cfg.max_segments - resident : 0;
    uint32_t slots = p->nparked + (KVD_MAX_SEGMENTS - p->nsegs);
    return room < slots ? room : slots;
}

uint64_t kvd_pool_resident_bytes(const kvd_pool *p) {
    return p->resident_bytes;
}

kvd_pool_counts kvd_pool_counts_get(const kvd_pool *p) {
    kvd_pool_counts c = {p->lists[LIST_FREE].len, p->n_cached, p->n_pinned, evictable_count(p)};
    return c;
}

uint64_t kvd_pool_evictions(const kvd_pool *p, kvd_evict_reason reason) {
    return (unsigned)reason < KVD_EVICT_REASONS ? p->evictions[reason] : 0;
}

/* ---- block operations ------------------------------------------------------------------- */

/* Allocate's slow part: grows, unparks or evicts until the free list holds n blocks; fails
 * with KV_ENOSPC before anything changes when the pool cannot hold n, or with the growth's
 * error. Kept out of line: the common allocation finds its blocks on the free list. */
static __attribute__((noinline)) kv_err make_free(kvd_pool *p, uint32_t n) {
    pool_list *fl = &p->lists[LIST_FREE];
    /* Decide before anything changes: a refused allocation grows and evicts nothing. */
    if (fl->len + (uint64_t)kvd_pool_growable_segments(p) * p->bps + evictable_count(p) < n) {
        return KV_ENOSPC;
    }
    kv_err grow_err = KV_OK;
    while (fl->len < n && p->nsegs - p->nparked < p->cfg.max_segments) {
        grow_err = p->nparked > 0 ? unpark_any(p) : kvd_pool_grow(p, NULL);
        if (grow_err != KV_OK) {
            break;
        }
    }
    if (fl->len < n) {
        uint64_t need = n - fl->len;
        if (evictable_count(p) < need) {
            return grow_err != KV_OK && grow_err != KV_ENOSPC ? grow_err : KV_ENOSPC;
        }
        for (uint64_t i = 0; i < need; i++) {
            uint32_t id = pick_victim(p, 1);
            evict_block(p, id, blk_at(p, id), KVD_EVICT_CAPACITY);
        }
    }
    return KV_OK;
}

kv_err kvd_pool_allocate(kvd_pool *p, uint32_t n, uint64_t session, uint32_t tenant,
                         kvd_block_ref *out) {
    if (n > 0 && out == NULL) {
        return KV_EINVAL;
    }
    kv_err terr = tenant_room(p, tenant);
    if (terr != KV_OK) {
        return terr;
    }
    pool_list *fl = &p->lists[LIST_FREE];
    if (p->now >= p->min_pin_expiry) {
        pin_sweep(p);
    }
    if (fl->len < n) {
        kv_err err = make_free(p, n);
        if (err != KV_OK) {
            return err;
        }
    }
    for (uint32_t i = 0; i < n; i++) {
        uint32_t id;
        pool_block *b = free_pop(p, &id);
        pool_segment *seg = seg_of(p, id);
        seg->nfree--;
        seg_touch(p, seg);
        b->state = KVD_BLOCK_WRITING;
        b->refcount = 1;
        b->aux = session;
        b->tenant = (uint16_t)tenant;
        b->last_access = p->stamp;
        out[i].id = id;
        out[i].gen = b->gen;
    }
    p->n_writing += n;
    p->tenants[tenant].held += n;
    return KV_OK;
}

kv_err kvd_pool_commit(kvd_pool *p, uint64_t session, kvd_block_ref blk, kv_hash128 hash,
                       uint32_t parent, kvd_block_ref *canonical) {
    pool_block *b;
    kv_err err = get_block(p, blk, &b);
    if (err != KV_OK) {
        return err;
    }
    if (b->state != KVD_BLOCK_WRITING) {
        return KV_ESTATE;
    }
    if (b->aux != session || (b->flags & BLOCK_PRIVATE)) {
        return KV_EPERM;
    }
    if (parent != KVD_NO_BLOCK && (parent >= p->nslots * p->bps || parent == blk.id)) {
        return KV_EINVAL;
    }
    uint64_t existing = 0;
    err = kvd_index_insert(p->idx, p->cfg.pool_id, hash, pack_ref(blk.id, blk.gen), &existing);
    if (err == KV_OK) {
        b->state = KVD_BLOCK_COMMITTED;
        b->hlo = hash.lo;
        b->hhi = hash.hi;
        b->parent = parent;
        b->aux = 0;
        b->last_access = p->stamp;
        seg_touch(p, seg_of(p, blk.id));
        child_added(p, b);
        if (p->cfg.policy == KVD_EVICT_ADAPTIVE) {
            adaptive_admit(p, b);
        }
        p->n_writing--;
        p->n_committed++;
        p->commits++;
        if (canonical != NULL) {
            *canonical = blk;
        }
        return KV_OK;
    }
    if (err != KV_EEXIST) {
        return err;
    }
    /* Another worker committed the same block first: the caller's lease becomes a reference
     * on that one, charged to the same tenant, and its own copy is freed. */
    kvd_block_ref e = {(uint32_t)existing, (uint32_t)(existing >> 32)};
    pool_block *eb;
    KV_ASSERT(get_block(p, e, &eb) == KV_OK);
    KV_ASSERT(eb->state == KVD_BLOCK_COMMITTED || eb->state == KVD_BLOCK_CACHED);
    if (eb->refcount == UINT32_MAX) {
        return KV_EBUSY;
    }
    uint32_t tenant = b->tenant;
    p->tenants[tenant].held--; /* take_ref charges it again */
    take_ref(p, e.id, eb, tenant);
    b->refcount = 0;
    p->n_writing--;
    block_to_free(p, blk.id, b);
    p->commits++;
    p->commits_duplicate++;
    if (canonical != NULL) {
        *canonical = e;
    }
    return KV_OK;
}

#define LOOKUP_CHUNK 256

kv_err kvd_pool_lookup(kvd_pool *p, uint32_t tenant, const kv_hash128 *hashes, size_t n,
                       kvd_block_ref *out, size_t *nhit) {
    if (n > 0 && (hashes == NULL || out == NULL)) {
        return KV_EINVAL;
    }
    kv_err terr = tenant_room(p, tenant);
    if (terr != KV_OK) {
        return terr;
    }
    uint64_t vals[LOOKUP_CHUNK];
    size_t total = 0;
    while (total < n) {
        size_t chunk = n - total < LOOKUP_CHUNK ? n - total : LOOKUP_CHUNK;
        size_t k = kvd_index_probe_prefix(p->idx, p->cfg.pool_id, hashes + total, chunk, vals);
        for (size_t j = 0; j < k; j++) {
            kvd_block_ref r = {(uint32_t)vals[j], (uint32_t)(vals[j] >> 32)};
            pool_block *b;
            KV_ASSERT(get_block(p, r, &b) == KV_OK);
            KV_ASSERT(b->state == KVD_BLOCK_COMMITTED || b->state == KVD_BLOCK_CACHED);
            if (b->refcount == UINT32_MAX) {
                k = j; /* cannot count one more reference: the prefix ends here */
                break;
            }
            take_ref(p, r.id, b, tenant);
            if (b->hits < UINT16_MAX) {
                b->hits++;
            }
            out[total + j] = r;
        }
        total += k;
        if (k < chunk) {
            break;
        }
    }
    p->queries++;
    p->query_blocks += n;
    p->hit_blocks += total;
    if (nhit != NULL) {
        *nhit = total;
    }
    return KV_OK;
}

kv_err kvd_pool_hold(kvd_pool *p, uint32_t tenant, kvd_block_ref blk) {
    kv_err terr = tenant_room(p, tenant);
    if (terr != KV_OK) {
        return terr;
    }
    pool_block *b;
    kv_err err = get_block(p, blk, &b);
    if (err != KV_OK) {
        return err;
    }
    if (b->state != KVD_BLOCK_COMMITTED && b->state != KVD_BLOCK_CACHED) {
        return KV_ESTATE;
    }
    if (b->refcount == UINT32_MAX) {
        return KV_EBUSY;
    }
    take_ref(p, blk.id, b, tenant);
    return KV_OK;
}

kv_err kvd_pool_hold_hash(kvd_pool *p, uint32_t tenant, kv_hash128 h, kvd_block_ref *out) {
    kv_err terr = tenant_room(p, tenant);
    if (terr != KV_OK) {
        return terr;
    }
    uint64_t v;
    if (kvd_index_find(p->idx, p->cfg.pool_id, h, &v) != KV_OK) {
        return KV_ENOENT;
    }
    kvd_block_ref r = {(uint32_t)v, (uint32_t)(v >> 32)};
    kv_err err = kvd_pool_hold(p, tenant, r);
    if (err == KV_OK) {
        *out = r;
    }
    return err;
}

void kvd_pool_set_drop_hook(kvd_pool *p, int slot, kvd_pool_drop_fn fn, void *arg) {
    KV_ASSERT(slot >= 0 && slot < KVD_DROP_HOOKS);
    p->drop_fn[slot] = fn;
    p->drop_arg[slot] = arg;
}

kv_err kvd_pool_lease(kvd_pool *p, kvd_block_ref blk) {
    pool_block *b;
    kv_err err = get_block(p, blk, &b);
    if (err != KV_OK) {
        return err;
    }
    if ((b->state != KVD_BLOCK_COMMITTED && b->state != KVD_BLOCK_CACHED) ||
        (b->flags & BLOCK_CORRUPT)) {
        return KV_ESTATE;
    }
    if (b->refcount == UINT32_MAX || (b->flags & BLOCK_LEASED)) {
        return KV_EBUSY;
    }
    /* take_ref without what makes it an access: no tenant is charged, and neither the reuse
     * count nor the age moves (a copy to a lower tier is not a use). */
    if (b->state == KVD_BLOCK_CACHED) {
        if (b->list != LIST_PINNED) {
            seg_evictable(p, seg_of(p, blk.id), b, -1);
        }
        list_remove(p, blk.id, b);
        b->state = KVD_BLOCK_COMMITTED;
        p->n_cached--;
        p->n_committed++;
        p->tenants[b->tenant].cached--;
        if (b->flags & BLOCK_PINNED) {
            list_push_tail(p, LIST_PINREF, blk.id, b);
        }
    }
    b->refcount++;
    b->flags |= BLOCK_LEASED;
    p->n_leased++;
    return KV_OK;
}

/* 1 when block `anc` is an ancestor of b within `limit` steps of parents of b's own age: the
 * blocks of one release share an age, and among them a child goes before its parents. */
static int older_kin(const kvd_pool *p, const pool_block *b, uint32_t anc, int limit) {
    const pool_block *x = b;
    while (limit-- > 0 && x->parent != KVD_NO_BLOCK) {
        if (x->parent == anc) {
            return 1;
        }
        const pool_block *px = parent_of(p, x);
        if (px == NULL || px->last_access != b->last_access) {
            return 0;
        }
        x = px;
    }
    return 0;
}

kv_err kvd_pool_unlease(kvd_pool *p, kvd_block_ref blk, int cold) {
    pool_block *b;
    kv_err err = get_block(p, blk, &b);
    if (err != KV_OK) {
        return err;
    }
    if (b->state != KVD_BLOCK_COMMITTED || b->refcount == 0 || !(b->flags & BLOCK_LEASED)) {
        return KV_ESTATE;
    }
    b->flags &= (uint8_t)~BLOCK_LEASED;
    p->n_leased--;
    if (--b->refcount != 0) {
        return KV_OK;
    }
    uint64_t age = b->last_access;
    pool_segment *seg = seg_of(p, blk.id);
    uint64_t seg_age = seg->last_access;
    block_to_cached(p, blk.id, b);
    if (!cold || b->state != KVD_BLOCK_CACHED) {
        return KV_OK;
    }
    /* Nothing was used: the block and its segment keep the ages they had (park and the
     * policies read them). */
    b->last_access = age;
    seg->last_access = seg_age;
    int which = b->list;
    if (which == LIST_LRU || which == LIST_PLRU || which == LIST_SMALL || which == LIST_MAIN ||
        which == LIST_AREC || which == LIST_AFREQ || which == LIST_INNER) {
        /* Back where the lease took it from: among the oldest of its queue, before the first
         * block younger than it or, of its own age, before its parents (a copy ahead of
         * eviction leases blocks near the head, so the walk is short), so copies do not
         * reorder what eviction takes. */
        uint8_t home2 = b->flags & BLOCK_HOME2; /* an inner block keeps its queue */
        list_remove(p, blk.id, b);
        b->flags |= home2;
        pool_list *l = list_of(p, which, b);
        uint32_t at = l->head;
        while (at != KVD_NO_BLOCK) {
            const pool_block *ab = blk_at(p, at);
            if (ab->last_access > age || (ab->last_access == age && older_kin(p, b, at, 64))) {
                break;
            }
            at = ab->next;
        }
        if (at == KVD_NO_BLOCK) {
            list_push_tail(p, which, blk.id, b);
        } else if (at == l->head) {
            list_push_head(p, which, blk.id, b);
        } else {
            /* Between at's predecessor and at. */
            pool_block *nb = blk_at(p, at);
            tevict_add(p, which, b, 1);
            b->list = (uint8_t)which;
            b->prev = nb->prev;
            b->next = at;
            blk_at(p, nb->prev)->next = blk.id;
            nb->prev = blk.id;
            l->len++;
        }
    }
    return KV_OK;
}

int kvd_pool_has(const kvd_pool *p, kv_hash128 h) {
    uint64_t v;
    return kvd_index_find(p->idx, p->cfg.pool_id, h, &v) == KV_OK;
}

kv_err kvd_pool_quarantine(kvd_pool *p, kvd_block_ref blk) {
    pool_block *b;
    kv_err err = get_block(p, blk, &b);
    if (err != KV_OK) {
        return err;
    }
    if (b->state != KVD_BLOCK_COMMITTED && b->state != KVD_BLOCK_CACHED) {
        return KV_ESTATE;
    }
    if (b->flags & BLOCK_CORRUPT) {
        return KV_OK;
    }
    p->quarantines++;
    /* Before it leaves the index: a lower tier's copy of these bytes must go too. */
    drop_tell(p, blk_hash(b), (kv_hash128){0, 0}, KVD_DROP_QUARANTINE);
    if (b->state == KVD_BLOCK_CACHED) {
        /* Nobody holds it: it goes at once, like an eviction that is not counted as one. */
        if (b->flags & BLOCK_PINNED) {
            unpin_block(p, blk.id, b); /* onto the eviction order */
        }
        drop_cached(p, blk.id, b);
        return KV_OK;
    }
    err = kvd_index_remove(p->idx, p->cfg.pool_id, blk_hash(b));
    KV_ASSERT(err == KV_OK);
    child_removed(p, b);
    b->flags |= BLOCK_CORRUPT;
    p->n_quarantined++;
    return KV_OK;
}

kv_err kvd_pool_make_private(kvd_pool *p, uint64_t session, kvd_block_ref blk) {
    pool_block *b;
    kv_err err = get_block(p, blk, &b);
    if (err != KV_OK) {
        return err;
    }
    if (b->state != KVD_BLOCK_WRITING) {
        return KV_ESTATE;
    }
    if (b->aux != session) {
        return KV_EPERM;
    }
    if (!(b->flags & BLOCK_PRIVATE)) {
        b->flags |= BLOCK_PRIVATE;
        p->n_private++;
    }
    return KV_OK;
}

kv_err kvd_pool_unshare_check(const kvd_pool *p, kvd_block_ref blk, const char **why) {
    const pool_block *b;
    kv_err err = get_block((kvd_pool *)p, blk, (pool_block **)&b);
    *why = NULL;
    if (err != KV_OK) {
        return err;
    }
    if (b->state != KVD_BLOCK_COMMITTED) {
        *why = b->state == KVD_BLOCK_WRITING ? "is WRITING (private already)"
                                             : "is not COMMITTED (nobody holds it)";
        return KV_ESTATE;
    }
    if (b->refcount != 1) {
        *why = b->flags & BLOCK_LEASED ? "is being copied to a lower tier"
                                       : "is shared: other sessions hold it";
        return KV_EBUSY;
    }
    if (b->flags & BLOCK_CORRUPT) {
        *why = "is quarantined (its bytes changed after its commit)";
        return KV_ESTATE;
    }
    if (b->flags & BLOCK_PINNED) {
        *why = "is pinned (the pin promises it stays cached)";
        return KV_EBUSY;
    }
    if (b->nchild > 0) {
        *why = "has committed children (other prefixes continue from it)";
        return KV_EBUSY;
    }
    return KV_OK;
}

kv_err kvd_pool_unshare(kvd_pool *p, uint64_t session, uint32_t tenant, kvd_block_ref blk) {
    const char *why;
    kv_err err = kvd_pool_unshare_check(p, blk, &why);
    if (err != KV_OK) {
        return err;
    }
    if (tenant >= p->ntcap) {
        return KV_EINVAL;
    }
    pool_block *b = blk_at(p, blk.id);
    drop_tell(p, blk_hash(b), (kv_hash128){0, 0}, KVD_DROP_UNSHARE);
    err = kvd_index_remove(p->idx, p->cfg.pool_id, blk_hash(b));
    KV_ASSERT(err == KV_OK);
    child_removed(p, b);
    /* The one reference stays the session's (charged to its tenant already); the block is
     * WRITING again, owned by the session, and can never be committed. A lower tier's copy of
     * the committed bytes stays valid: those bytes had that hash. */
    b->state = KVD_BLOCK_WRITING;
    b->aux = session;
    b->tenant = (uint16_t)tenant;
    b->hlo = b->hhi = 0;
    b->parent = KVD_NO_BLOCK;
    b->flags |= BLOCK_PRIVATE;
    b->hits = 0;
    b->freq = 0;
    b->last_access = p->stamp;
    seg_touch(p, seg_of(p, blk.id)); /* the segment's newest access (parking's age) with it */
    p->n_committed--;
    p->n_writing++;
    p->n_private++;
    p->unshares++;
    return KV_OK;
}

/* Whether a session may drop a reference on block b (the state, not the count). */
static inline kv_err release_allowed(const pool_block *b, uint64_t session) {
    if (b->state == KVD_BLOCK_FREE || b->state == KVD_BLOCK_CACHED) {
        return KV_ESTATE;
    }
    if (b->state == KVD_BLOCK_WRITING && b->aux != session) {
        return KV_EPERM;
    }
    return KV_OK;
}

/* Block id lost its last reference: WRITING goes back to FREE, COMMITTED becomes CACHED. */
static inline void release_last(kvd_pool *p, uint32_t id, pool_block *b) {
    if (b->state == KVD_BLOCK_WRITING) {
        p->n_writing--;
        p->n_private -= (b->flags & BLOCK_PRIVATE) != 0;
        block_to_free(p, id, b);
    } else if (b->state == KVD_BLOCK_COMMITTED) {
        block_to_cached(p, id, b);
    }
}

/* kvd_pool_release of several blocks (out of line: one block is the common release). */
static __attribute__((noinline)) kv_err release_many(kvd_pool *p, uint64_t session, uint32_t tenant,
                                                     const kvd_block_ref *blks, size_t n) {
    for (size_t i = 0; i < n; i++) {
        pool_block *b;
        kv_err err = get_block(p, blks[i], &b);
        if (err == KV_OK) {
            err = release_allowed(b, session);
        }
        if (err != KV_OK) {
            return err;
        }
    }
    /* Drop the references; a block listed more often than it is referenced undoes it all. */
    for (size_t i = 0; i < n; i++) {
        pool_block *b = blk_at(p, blks[i].id);
        if (b->refcount == 0) {
            for (size_t j = 0; j < i; j++) {
                blk_at(p, blks[j].id)->refcount++;
            }
            return KV_ESTATE;
        }
        b->refcount--;
    }
    /* Tail first: the last block of the prefix enters the eviction order first, so it is
     * evicted before its parents (a child is useless without them). */
    for (size_t i = n; i-- > 0;) {
        uint32_t id = blks[i].id;
        pool_block *b = blk_at(p, id);
        if (b->refcount == 0) {
            release_last(p, id, b);
        }
    }
    p->tenants[tenant].held -= n;
    return KV_OK;
}

kv_err kvd_pool_release(kvd_pool *p, uint64_t session, uint32_t tenant, const kvd_block_ref *blks,
                        size_t n) {
    if (n == 0) {
        return KV_OK;
    }
    if (tenant >= p->ntcap || blks == NULL || p->tenants[tenant].held < n) {
        return KV_EINVAL;
    }
    if (n == 1) {
        /* release_many's loops for one block, with its record looked up once. */
        pool_block *b;
        kv_err err = get_block(p, blks[0], &b);
        if (err == KV_OK) {
            err = release_allowed(b, session);
        }
        if (err != KV_OK) {
            return err;
        }
        if (b->refcount == 0) {
            return KV_ESTATE;
        }
        if (--b->refcount == 0) {
            release_last(p, blks[0].id, b);
        }
        p->tenants[tenant].held--;
        return KV_OK;
    }
    return release_many(p, session, tenant, blks, n);
}

kv_err kvd_pool_pin(kvd_pool *p, kvd_block_ref blk, uint64_t retention_ms, uint8_t priority,
                    uint32_t tenant) {
    if (tenant != KVD_PIN_OWNER) {
        kv_err terr = tenant_room(p, tenant);
        if (terr != KV_OK) {
            return terr;
        }
    }
    pool_block *b;
    kv_err err = get_block(p, blk, &b);
    if (err != KV_OK) {
        return err;
    }
    if (b->state != KVD_BLOCK_COMMITTED && b->state != KVD_BLOCK_CACHED) {
        return KV_ESTATE;
    }
    uint64_t until = retention_ms > UINT64_MAX - p->now ? UINT64_MAX : p->now + retention_ms;
    if (b->flags & BLOCK_PINNED) {
        if (until > p->now && until >= b->aux && tenant != KVD_PIN_OWNER &&
            tenant != b->pin_tenant) {
            /* Another tenant pins it again for at least as long: the pin is charged to it from
             * now on (a shorter pin, a zero retention included, takes nothing over: else a
             * 1 ms pin would make another tenant's pin its own to unpin). */
            p->tenants[b->pin_tenant].pinned--;
            b->pin_tenant = (uint16_t)tenant;
            p->tenants[tenant].pinned++;
        }
        if (until > b->aux) {
            b->aux = until;
        }
        if (priority > b->pin_prio) {
            b->pin_prio = priority;
        }
    } else {
        if (until <= p->now) {
            return KV_OK; /* a zero retention pins nothing */
        }
        b->flags |= BLOCK_PINNED;
        b->aux = until;
        b->pin_prio = priority;
        b->pin_tenant = (uint16_t)(tenant == KVD_PIN_OWNER ? b->tenant : tenant);
        p->n_pinned++;
        p->tenants[b->pin_tenant].pinned++;
        if (b->state == KVD_BLOCK_CACHED) {
            list_remove(p, blk.id, b);
            seg_evictable(p, seg_of(p, blk.id), b, -1);
            list_push_tail(p, LIST_PINNED, blk.id, b);
        } else {
            list_push_tail(p, LIST_PINREF, blk.id, b);
        }
    }
    if (b->aux < p->min_pin_expiry) {
        p->min_pin_expiry = b->aux;
    }
    return KV_OK;
}

kv_err kvd_pool_unpin(kvd_pool *p, kvd_block_ref blk) {
    pool_block *b;
    kv_err err = get_block(p, blk, &b);
    if (err != KV_OK) {
        return err;
    }
    if (b->state != KVD_BLOCK_COMMITTED && b->state != KVD_BLOCK_CACHED) {
        return KV_ESTATE;
    }
    if (b->flags & BLOCK_PINNED) {
        unpin_block(p, blk.id, b);
    }
    return KV_OK;
}

void kvd_pool_set_leaf_order(kvd_pool *p, kvd_leaf_order order) {
    p->leaf_order = order;
}

kvd_leaf_order kvd_pool_leaf_order(const kvd_pool *p) {
    return p->leaf_order;
}

void kvd_pool_set_now(kvd_pool *p, uint64_t now_ms) {
    p->now = now_ms;
    /* One step on, or that ms's first stamp when it is later: requests within a ms (the loop's
     * clock stands still for a turn) keep their order, and a million of them carry into the
     * next ms without ever going back. A clock set earlier than that (tests do) restarts. */
    uint64_t ms = now_ms & (UINT64_MAX >> 20);
    if (ms + 1 >= (p->stamp >> 20)) {
        p->stamp = p->stamp + 1 > ms << 20 ? p->stamp + 1 : ms << 20;
    } else {
        p->stamp = ms << 20;
    }
    if (now_ms >= p->min_pin_expiry) {
        pin_sweep(p);
    }
}

/* Walks the eviction order as it stands (S3-FIFO: small queue, then main; the rotations the
 * policy would make, S3-FIFO's and PREFIX_LRU's second rounds, are not simulated) and takes up to
 * max of tenant's blocks (any when tenant < 0), evicting them unless dry_run. */
static size_t evict_walk(kvd_pool *p, size_t max, int64_t tenant, int dry_run,
                         kvd_evict_reason reason, kvd_block_ref *out) {
    /* Each queue's blocks set aside for a guarantee first (they reached its head before the
     * rest), then the queue itself. */
    static const int order_lru[] = {LIST_ASIDE1, LIST_LRU};
    static const int order_s3[] = {LIST_ASIDE0, LIST_SMALL,  LIST_ASIDE1,
                                   LIST_MAIN,   LIST_ASIDE2, LIST_INNER};
    static const int order_plru[] = {LIST_ASIDE1, LIST_PLRU};
    static const int order_ad[] = {LIST_ASIDE0, LIST_AREC,   LIST_ASIDE1,
                                   LIST_AFREQ,  LIST_ASIDE2, LIST_INNER};
    const int *order = p->cfg.policy == KVD_EVICT_LRU        ? order_lru
                       : p->cfg.policy == KVD_EVICT_S3FIFO   ? order_s3
                       : p->cfg.policy == KVD_EVICT_ADAPTIVE ? order_ad
                                                             : order_plru;
    int norder = leaf_policy(p) ? 6 : 2;
    size_t count = 0;
    /* Leaves made by the walk's own evictions stay put until it ends (a block moving off the
     * inner list would take the walk's next pointer with it). */
    p->defer_leaves = !dry_run;
    for (int o = 0; o < norder && count < max; o++) {
        int which = order[o];
        /* An aside queue is one list per tenant with a guarantee (only those have blocks). */
        uint32_t nlists = which >= LIST_ASIDE0 ? p->nguarantee : 1;
        for (uint32_t k = 0; k < nlists && count < max; k++) {
            const pool_list *l =
                which >= LIST_ASIDE0
                    ? &p->aside[(uint32_t)p->gtenants[k] * NQUEUE + (uint32_t)(which - LIST_ASIDE0)]
                    : &p->lists[which];
            uint32_t id = l->head;
            while (id != KVD_NO_BLOCK && count < max) {
                pool_block *b = blk_at(p, id);
                uint32_t nx = b->next;
                if (tenant < 0 || b->tenant == (uint64_t)tenant) {
                    if (out != NULL) {
                        out[count].id = id;
                        out[count].gen = b->gen;
                    }
                    if (!dry_run) {
                        evict_block(p, id, b, reason);
                    }
                    count++;
                }
                id = nx;
            }
        }
    }
    p->defer_leaves = 0;
    if (!dry_run && leaf_policy(p)) {
        /* Inner blocks the walk left without children become leaves, in their order (walked
         * from the tail, each pushed to the head of its queue). */
        for (uint32_t k = 0; k <= p->nguarantee; k++) {
            pool_list *l = k < p->nguarantee ? &p->aside[(uint32_t)p->gtenants[k] * NQUEUE + 2]
                                             : &p->lists[LIST_INNER];
            uint32_t id = l->tail;
            while (id != KVD_NO_BLOCK) {
                pool_block *b = blk_at(p, id);
                uint32_t pv = b->prev;
                if (b->nchild == 0) {
                    inner_to_leaf(p, id, b);
                }
                id = pv;
            }
        }
    }
    return count;
}

kv_err kvd_pool_evict(kvd_pool *p, size_t max, int64_t tenant, kvd_evict_reason reason, int dry_run,
                      kvd_block_ref *out, size_t *nevicted) {
    if ((unsigned)reason >= KVD_EVICT_REASONS || tenant >= KVD_MAX_TENANTS) {
        return KV_EINVAL;
    }
    if (p->now >= p->min_pin_expiry) {
        pin_sweep(p);
    }
    size_t count = 0;
    if (dry_run || tenant >= 0) {
        count = evict_walk(p, max, tenant, dry_run, reason, out);
    } else {
        while (count < max && evictable_count(p) > 0) {
            uint32_t id = pick_victim(p, 0);
            pool_block *b = blk_at(p, id);
            if (out != NULL) {
                out[count].id = id;
                out[count].gen = b->gen;
            }
            evict_block(p, id, b, reason);
            count++;
        }
    }
    if (nevicted != NULL) {
        *nevicted = count;
    }
    return KV_OK;
}

void kvd_pool_set_guarantee(kvd_pool *p, uint32_t tenant, uint64_t blocks) {
    if (blocks == 0 && tenant >= p->ntcap) {
        return;
    }
    if (tenant_room(p, tenant) != KV_OK) {
        KV_LOG(WARN, "KVD-POOL-GUARANTEE", "pool %u: no memory for tenant %u's guarantee",
               p->cfg.pool_id, tenant);
        return;
    }
    int changed = (p->guarantee[tenant] == 0) != (blocks == 0);
    if (p->guarantee[tenant] == 0 && blocks != 0) {
        p->gtenants[p->nguarantee++] = (uint16_t)tenant;
    } else if (p->guarantee[tenant] != 0 && blocks == 0) {
        aside_flush(p, tenant);
        for (uint32_t i = 0; i < p->nguarantee; i++) {
            if (p->gtenants[i] == tenant) {
                p->gtenants[i] = p->gtenants[--p->nguarantee];
                break;
            }
        }
    }
    p->guarantee[tenant] = blocks;
    if (changed && p->tenants[tenant].cached > 0) {
        seg_recount_guaranteed(p);
    }
}

kv_err kvd_pool_block_info(const kvd_pool *p, uint32_t id, kvd_block_info *out) {
    if (id >= p->nslots * p->bps || seg_of(p, id)->blocks == NULL) {
        return KV_ENOENT;
    }
    const pool_block *b = blk_at(p, id);
    kvd_block_info info;
    memset(&info, 0, sizeof(info));
    info.state = (kvd_block_state)b->state;
    info.gen = b->gen;
    info.refcount = b->refcount;
    info.tenant = b->tenant;
    info.owner_session = b->state == KVD_BLOCK_WRITING ? b->aux : 0;
    info.hash = blk_hash(b);
    info.parent = b->parent;
    info.hits = b->hits;
    info.pinned = (b->flags & BLOCK_PINNED) && b->aux > p->now;
    info.pin_tenant = (b->flags & BLOCK_PINNED) ? b->pin_tenant : 0;
    info.is_private = (b->flags & BLOCK_PRIVATE) != 0;
    *out = info;
    return KV_OK;
}

kv_err kvd_pool_check_ref(const kvd_pool *p, kvd_block_ref blk) {
    pool_block *b;
    return get_block(p, blk, &b);
}

kvd_tenant_usage kvd_pool_tenant_usage(const kvd_pool *p, uint32_t tenant) {
    kvd_tenant_usage zero = {0, 0, 0};
    if (tenant >= p->ntcap) {
        return zero;
    }
    return p->tenants[tenant];
}

/* The one table of a pool's statistics, in the order kvd_pool_stats reports them. */
enum {
    PS_BLOCKS_TOTAL,
    PS_BLOCKS_FREE,
    PS_BLOCKS_WRITING,
    PS_BLOCKS_COMMITTED,
    PS_BLOCKS_CACHED,
    PS_BLOCKS_PRIVATE,
    PS_BLOCKS_PINNED,
    PS_BLOCKS_PARKED,
    PS_SEGMENTS,
    PS_SEGMENTS_PARKED,
    PS_BYTES,
    PS_QUERIES,
    PS_QUERY_BLOCKS,
    PS_HIT_BLOCKS,
    PS_HIT_TOKENS,
    PS_COMMITS,
    PS_COMMITS_DUPLICATE,
    PS_REWINDS,
    PS_EVICTIONS_CAPACITY,
    PS_EVICTIONS_ADMIN,
    PS_EVICTIONS_SHRINK,
    PS_VERIFIED,
    PS_QUARANTINES,
    PS_UNSHARES,
    PS_COUNT
};

static const kv_stat_desc pool_stats[PS_COUNT] = {
    [PS_BLOCKS_TOTAL] = {"blocks_total", "gauge", "blocks",
                         "blocks in the pool's segment slots, parked segments included",
                         "kvd_pool_capacity_blocks", "Blocks in the pool's segments.", NULL, NULL},
    [PS_BLOCKS_FREE] = {"blocks_free", "gauge", "blocks", "FREE blocks (no bytes, no hash)",
                        "kvd_pool_blocks", "Blocks of the pool by lifecycle state.", "state",
                        "free"},
    [PS_BLOCKS_WRITING] = {"blocks_writing", "gauge", "blocks",
                           "WRITING blocks (leased to a session, not committed)", "kvd_pool_blocks",
                           NULL, "state", "writing"},
    [PS_BLOCKS_PRIVATE] =
        {"blocks_private", "gauge", "blocks",
         "of the WRITING blocks, private ones (never committed: compressed KV)",
         "kvd_pool_private_blocks",
         "WRITING blocks that can never be committed (Allocate.private, Unshare).", NULL, NULL},
    [PS_BLOCKS_COMMITTED] = {"blocks_committed", "gauge", "blocks",
                             "COMMITTED blocks (indexed and referenced)", "kvd_pool_blocks", NULL,
                             "state", "committed"},
    [PS_BLOCKS_CACHED] = {"blocks_cached", "gauge", "blocks",
                          "CACHED blocks (indexed, no reference: evictable unless pinned)",
                          "kvd_pool_blocks", NULL, "state", "cached"},
    [PS_BLOCKS_PINNED] = {"blocks_pinned", "gauge", "blocks",
                          "blocks with a pin (COMMITTED or CACHED) until the pool's clock sweeps "
                          "expired ones",
                          "kvd_pool_pinned_blocks", "Pinned blocks of the pool.", NULL, NULL},
    [PS_BLOCKS_PARKED] = {"blocks_parked", "gauge", "blocks",
                          "blocks of parked segments (their memory was given to other pools)",
                          "kvd_pool_parked_blocks", "Blocks of the pool's parked segments.", NULL,
                          NULL},
    [PS_SEGMENTS] = {"segments", "gauge", "segments", "segment slots of the pool (parked included)",
                     "kvd_pool_segments", "Segments (shared memory objects) of the pool.", NULL,
                     NULL},
    [PS_SEGMENTS_PARKED] = {"segments_parked", "gauge", "segments",
                            "segments whose memory was given back (parking)",
                            "kvd_pool_parked_segments", "Parked segments of the pool.", NULL, NULL},
    [PS_BYTES] = {"bytes", "gauge", "bytes", "resident segment memory of the pool",
                  "kvd_pool_memory_bytes", "Segment memory of the pool.", NULL, NULL},
    [PS_QUERIES] = {"queries", "counter", "requests", "Lookup requests on the pool",
                    "kvd_pool_lookups_total", "Lookup requests on the pool.", NULL, NULL},
    [PS_QUERY_BLOCKS] = {"query_blocks", "counter", "blocks",
                         "blocks asked in Lookup requests (the hit rate's denominator)",
                         "kvd_pool_lookup_blocks_total",
                         "Blocks asked in Lookup requests (the hit rate's denominator).", NULL,
                         NULL},
    [PS_HIT_BLOCKS] = {"hit_blocks", "counter", "blocks", "blocks Lookup found",
                       "kvd_pool_hit_blocks_total", "Blocks Lookup found cached.", NULL, NULL},
    [PS_HIT_TOKENS] = {"hit_tokens", "counter", "tokens", "tokens of the blocks Lookup found",
                       "kvd_pool_hit_tokens_total", "Tokens of the blocks Lookup found cached.",
                       NULL, NULL},
    [PS_COMMITS] = {"commits", "counter", "blocks", "blocks committed", "kvd_pool_commits_total",
                    "Blocks committed.", NULL, NULL},
    [PS_COMMITS_DUPLICATE] = {"commits_duplicate", "counter", "blocks",
                              "commits of a hash already committed (the canonical block won)",
                              "kvd_pool_duplicate_commits_total",
                              "Commits of a block another worker had committed already.", NULL,
                              NULL},
    [PS_REWINDS] = {"rewinds", "counter", "blocks",
                    "blocks given back with Rewind (rejected speculative drafts)",
                    "kvd_pool_rewound_blocks_total",
                    "Blocks given back with Rewind (rejected speculative drafts).", NULL, NULL},
    [PS_EVICTIONS_CAPACITY] = {"evictions_capacity", "counter", "blocks",
                               "cached blocks evicted because an allocation needed room",
                               "kvd_pool_evictions_total", "Cached blocks evicted, by reason.",
                               "reason", "capacity"},
    [PS_EVICTIONS_ADMIN] = {"evictions_admin", "counter", "blocks",
                            "cached blocks an operator evicted (kvctl evict)",
                            "kvd_pool_evictions_total", NULL, "reason", "admin"},
    [PS_EVICTIONS_SHRINK] = {"evictions_shrink", "counter", "blocks",
                             "cached blocks evicted with a parked segment",
                             "kvd_pool_evictions_total", NULL, "reason", "shrink"},
    [PS_VERIFIED] = {"verified", "counter", "blocks",
                     "Lookup hits whose bytes verify-blocks checked against their commit",
                     "kvd_pool_verified_blocks_total",
                     "Lookup hits whose bytes were checked against their commit (verify-blocks).",
                     NULL, NULL},
    [PS_QUARANTINES] = {"quarantines", "counter", "blocks",
                        "committed blocks taken out of the index because their bytes changed "
                        "after the commit (verify-blocks)",
                        "kvd_pool_quarantined_blocks_total",
                        "Committed blocks whose bytes changed after the commit (verify-blocks).",
                        NULL, NULL},
    [PS_UNSHARES] = {"unshares", "counter", "blocks",
                     "committed blocks its one holder turned back into private ones (Unshare)",
                     "kvd_pool_unshared_blocks_total",
                     "Committed blocks turned back into private ones by their one holder.", NULL,
                     NULL},
};

void kvd_pool_count_rewind(kvd_pool *p, uint64_t blocks) {
    p->rewinds += blocks;
}

void kvd_pool_count_verified(kvd_pool *p, uint64_t blocks) {
    p->verified += blocks;
}

const kv_stat_desc *kvd_pool_stat_descs(size_t *n) {
    *n = PS_COUNT;
    return pool_stats;
}

void kvd_pool_stats(const kvd_pool *p, kvd_stat_sink sink, void *arg) {
    uint64_t v[PS_COUNT];
    v[PS_BLOCKS_TOTAL] = (uint64_t)p->nsegs * p->bps;
    v[PS_BLOCKS_FREE] = p->lists[LIST_FREE].len;
    v[PS_BLOCKS_WRITING] = p->n_writing;
    v[PS_BLOCKS_PRIVATE] = p->n_private;
    v[PS_BLOCKS_COMMITTED] = p->n_committed;
    v[PS_BLOCKS_CACHED] = p->n_cached;
    v[PS_BLOCKS_PINNED] = p->n_pinned;
    v[PS_BLOCKS_PARKED] = (uint64_t)p->nparked * p->bps;
    v[PS_SEGMENTS] = p->nsegs;
    v[PS_SEGMENTS_PARKED] = p->nparked;
    v[PS_BYTES] = p->resident_bytes;
    v[PS_QUERIES] = p->queries;
    v[PS_QUERY_BLOCKS] = p->query_blocks;
    v[PS_HIT_BLOCKS] = p->hit_blocks;
    v[PS_HIT_TOKENS] = p->hit_blocks * p->cfg.layout.tokens_per_block;
    v[PS_COMMITS] = p->commits;
    v[PS_COMMITS_DUPLICATE] = p->commits_duplicate;
    v[PS_REWINDS] = p->rewinds;
    v[PS_EVICTIONS_CAPACITY] = p->evictions[KVD_EVICT_CAPACITY];
    v[PS_EVICTIONS_ADMIN] = p->evictions[KVD_EVICT_ADMIN];
    v[PS_EVICTIONS_SHRINK] = p->evictions[KVD_EVICT_SHRINK];
    v[PS_VERIFIED] = p->verified;
    v[PS_QUARANTINES] = p->quarantines;
    v[PS_UNSHARES] = p->unshares;
    for (size_t i = 0; i < PS_COUNT; i++) {
        sink(arg, pool_stats[i].name, v[i]);
    }
}

uint64_t kvd_pool_meta_bytes(const kvd_pool *p) {
    uint64_t rec = ((uint64_t)p->bps * sizeof(pool_block) + 63u) & ~(uint64_t)63u;
    uint64_t ghost = p->ghost != NULL ? (uint64_t)(p->ghost_mask + 1) * sizeof(uint64_t) : 0;
    return sizeof(*p) + (uint64_t)p->segcap * (sizeof(pool_segment) + 2 * sizeof(void *)) +
           (uint64_t)p->ntcap *
               (sizeof(kvd_tenant_usage) + sizeof(uint64_t) + NQUEUE * sizeof(uint32_t) +
                sizeof(uint16_t) + NQUEUE * sizeof(pool_list)) +
           ghost + (uint64_t)p->nsegs * rec;
}

size_t kvd_pool_meta_bytes_per_block(void) {
    return sizeof(pool_block);
}

/* ---- invariant check -------------------------------------------------------------------- */

#define CHECK(cond, ...)                                                                           \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            KV_LOG(ERROR, "KVD-POOL-CHECK", __VA_ARGS__);                                          \
            err = KV_EINTERNAL;                                                                    \
            goto out;                                                                              \
        }                                                                                          \
    } while (0)

/* Walks list l (pool-wide list `which`, or tenant's aside list `which` when tenant >= 0). */
static kv_err check_list(const kvd_pool *p, const pool_list *l, int which, int64_t tenant,
                         uint64_t *walked) {
    kv_err err = KV_OK;
    uint32_t prev = KVD_NO_BLOCK;
    uint64_t n = 0;
    for (uint32_t id = l->head; id != KVD_NO_BLOCK; id = blk_at(p, id)->next) {
        CHECK(id < p->nslots * p->bps && seg_of(p, id)->blocks != NULL,
              "list %d: id %u out of range", which, id);
        const pool_block *b = blk_at(p, id);
        CHECK(b->list == which, "list %d: block %u tagged %u", which, id, b->list);
        CHECK(b->prev == prev, "list %d: block %u prev %u, want %u", which, id, b->prev, prev);
        CHECK(tenant < 0 || b->tenant == (uint64_t)tenant,
              "aside list %d of tenant %lld: block %u of tenant %u", which, (long long)tenant, id,
              b->tenant);
        CHECK(++n <= l->len, "list %d longer than %llu", which, (unsigned long long)l->len);
        prev = id;
    }
    CHECK(l->tail == prev, "list %d: tail %u, want %u", which, l->tail, prev);
    CHECK(n == l->len, "list %d: walked %llu, len %llu", which, (unsigned long long)n,
          (unsigned long long)l->len);
    *walked = n;
out:
    return err;
}

kv_err kvd_pool_check(const kvd_pool *p) {
    kv_err err = KV_OK;
    uint64_t by_state[4] = {0, 0, 0, 0};
    uint64_t by_list[LIST_ALL] = {0};
    uint64_t pinned = 0, refs = 0, held = 0, quarantined = 0, leased = 0, nprivate = 0;
    uint64_t *cached_t = calloc(p->ntcap, sizeof(uint64_t));
    uint64_t *pinned_t = calloc(p->ntcap, sizeof(uint64_t));
    uint32_t *tevict = calloc((size_t)p->ntcap * NQUEUE, sizeof(uint32_t));
    uint64_t inner_home[2] = {0, 0};
    if (cached_t == NULL || pinned_t == NULL || tevict == NULL) {
        free(cached_t);
        free(pinned_t);
        free(tevict);
        return KV_ENOMEM;
    }
    uint32_t live = 0, nparked = 0;
    uint64_t resident = 0;
    for (uint32_t s = 0; s < p->nslots; s++) {
        const pool_segment *seg = p->segs[s];
        if (seg->blocks == NULL) {
            continue;
        }
        live++;
        if (seg->parked) {
            /* Parked: every block FREE on no list (so not allocatable), unreferenced, unpinned
             * and not indexed (a FREE block never is; the index walk below finds no entry). */
            nparked++;
            CHECK(seg->nfree == 0 && seg->nevict == 0, "parked segment %u: %u free, %u evictable",
                  s, seg->nfree, seg->nevict);
            for (uint32_t i = 0; i < p->bps; i++) {
                const pool_block *b = &seg->blocks[i];
                CHECK(b->state == KVD_BLOCK_FREE && b->list == LIST_NONE && b->refcount == 0 &&
                          b->flags == 0,
                      "parked block %u: state %u list %u refcount %u flags %u", blk_id(p, s, i),
                      b->state, b->list, b->refcount, b->flags);
            }
            continue;
        }
        resident += seg->mem.bytes;
        uint32_t nfree = 0, nevict = 0, ngcached = 0;
        uint64_t last = 0;
        for (uint32_t i = 0; i < p->bps; i++) {
            uint32_t id = blk_id(p, s, i);
            const pool_block *b = &seg->blocks[i];
            CHECK(b->state <= KVD_BLOCK_CACHED, "block %u: bad state %u", id, b->state);
            by_state[b->state]++;
            by_list[b->list]++;
            refs += b->refcount;
            leased += (b->flags & BLOCK_LEASED) != 0;
            if (b->last_access > last) {
                last = b->last_access;
            }
            CHECK(b->tenant < p->ntcap && b->pin_tenant < p->ntcap, "block %u: tenant %u/%u", id,
                  b->tenant, b->pin_tenant);
            CHECK((p->cfg.policy == KVD_EVICT_PREFIX_LRU || p->cfg.policy == KVD_EVICT_ADAPTIVE ||
                   !(b->flags & BLOCK_SHARED)) &&
                      (counts_children(p) || b->nchild == 0),
                  "block %u: prefix marks under policy %d", id, (int)p->cfg.policy);
            CHECK(!(b->flags & BLOCK_HOME2) || b->list == LIST_INNER || b->list == LIST_ASIDE2,
                  "block %u: inner home mark on list %u", id, b->list);
            CHECK(b->list < LIST_ASIDE0 || p->guarantee[b->tenant] != 0,
                  "block %u: aside for tenant %u without a guarantee", id, b->tenant);
            if (b->list == LIST_INNER || b->list == LIST_ASIDE2) {
                inner_home[(b->flags & BLOCK_HOME2) ? 1 : 0]++;
            }
            if (b->flags & BLOCK_PINNED) {
                pinned++;
                pinned_t[b->pin_tenant]++;
                CHECK(b->state == KVD_BLOCK_COMMITTED || b->state == KVD_BLOCK_CACHED,
                      "block %u: pinned in state %u", id, b->state);
            }
            switch (b->state) {
                case KVD_BLOCK_FREE:
                    nfree++;
                    CHECK(b->refcount == 0 && b->list == LIST_FREE && b->flags == 0,
                          "block %u: FREE with refcount %u list %u", id, b->refcount, b->list);
                    break;
                case KVD_BLOCK_WRITING:
                    CHECK(b->refcount == 1 && b->list == LIST_NONE,
                          "block %u: WRITING with refcount %u list %u", id, b->refcount, b->list);
                    nprivate += (b->flags & BLOCK_PRIVATE) != 0;
                    break;
                case KVD_BLOCK_COMMITTED:
                    CHECK(b->refcount >= 1 &&
                              b->list == ((b->flags & BLOCK_PINNED) ? LIST_PINREF : LIST_NONE),
                          "block %u: COMMITTED with refcount %u list %u", id, b->refcount, b->list);
                    break;
                case KVD_BLOCK_CACHED:
                    cached_t[b->tenant]++;
                    CHECK(b->refcount == 0, "block %u: CACHED with refcount %u", id, b->refcount);
                    if (b->flags & BLOCK_PINNED) {
                        CHECK(b->list == LIST_PINNED, "block %u: pinned CACHED on list %u", id,
                              b->list);
                    } else {
                        nevict++;
                        ngcached += p->guarantee[b->tenant] != 0;
                        int q = evict_queue(b->list);
                        CHECK(q >= 0, "block %u: CACHED on list %u", id, b->list);
                        tevict[(uint32_t)b->tenant * NQUEUE + (uint32_t)q]++;
                        int inner = b->list == LIST_INNER || b->list == LIST_ASIDE2;
                        int ok = p->cfg.policy == KVD_EVICT_LRU
                                     ? b->list == LIST_LRU || b->list == LIST_ASIDE1
                                 : p->cfg.policy == KVD_EVICT_PREFIX_LRU
                                     ? b->list == LIST_PLRU || b->list == LIST_ASIDE1
                                     : inner == (b->nchild > 0) &&
                                           (inner || b->list == home_list(p, 0) ||
                                            b->list == home_list(p, 1) || b->list == LIST_ASIDE0 ||
                                            b->list == LIST_ASIDE1);
                        CHECK(ok, "block %u: CACHED on list %u with %u children", id, b->list,
                              b->nchild);
                    }
                    break;
            }
            if (b->flags & BLOCK_CORRUPT) {
                quarantined++;
                CHECK(b->state == KVD_BLOCK_COMMITTED, "block %u: quarantined in state %u", id,
                      b->state);
            } else if (b->state == KVD_BLOCK_COMMITTED || b->state == KVD_BLOCK_CACHED) {
                uint64_t v = 0;
                CHECK(kvd_index_find(p->idx, p->cfg.pool_id, blk_hash(b), &v) == KV_OK,
                      "block %u: hash not indexed", id);
                CHECK(v == pack_ref(id, b->gen), "block %u: index points to %u gen %u", id,
                      (uint32_t)v, (uint32_t)(v >> 32));
            }
        }
        CHECK(nfree == seg->nfree, "segment %u: %u free, counted %u", s, nfree, seg->nfree);
        CHECK(nevict == seg->nevict, "segment %u: %u evictable, counted %u", s, nevict,
              seg->nevict);
        CHECK(ngcached == seg->ngcached,
              "segment %u: %u evictable of guaranteed tenants, counted %u", s, ngcached,
              seg->ngcached);
        CHECK(last == seg->last_access, "segment %u: newest block access %llu, counted %llu", s,
              (unsigned long long)last, (unsigned long long)seg->last_access);
    }
    CHECK(live == p->nsegs, "%u live segments, counted %u", live, p->nsegs);
    CHECK(nparked == p->nparked, "%u parked segments, counted %u", nparked, p->nparked);
    CHECK(resident == p->resident_bytes, "%llu resident bytes, counted %llu",
          (unsigned long long)resident, (unsigned long long)p->resident_bytes);
    CHECK(p->nslots == 0 || p->segs[p->nslots - 1]->blocks != NULL, "slot count %u too high",
          p->nslots);
    for (int l = LIST_FREE; l < LIST_COUNT; l++) {
        uint64_t walked = 0;
        err = check_list(p, &p->lists[l], l, -1, &walked);
        if (err != KV_OK) {
            goto out;
        }
        CHECK(walked == by_list[l], "list %d: %llu linked, %llu tagged", l,
              (unsigned long long)walked, (unsigned long long)by_list[l]);
    }
    for (int q = 0; q < NQUEUE; q++) {
        uint64_t walked = 0;
        for (uint32_t t = 0; t < p->ntcap; t++) {
            uint64_t n = 0;
            err = check_list(p, &p->aside[t * NQUEUE + (uint32_t)q], LIST_ASIDE0 + q, t, &n);
            if (err != KV_OK) {
                goto out;
            }
            walked += n;
        }
        CHECK(walked == by_list[LIST_ASIDE0 + q] && walked == p->n_aside[q],
              "aside lists %d: %llu linked, %llu tagged, %llu counted", q,
              (unsigned long long)walked, (unsigned long long)by_list[LIST_ASIDE0 + q],
              (unsigned long long)p->n_aside[q]);
    }
    CHECK(by_state[KVD_BLOCK_FREE] == p->lists[LIST_FREE].len, "free count");
    CHECK(nprivate == p->n_private, "private count %llu vs %llu", (unsigned long long)nprivate,
          (unsigned long long)p->n_private);
    CHECK(by_state[KVD_BLOCK_WRITING] == p->n_writing, "writing count %llu vs %llu",
          (unsigned long long)by_state[KVD_BLOCK_WRITING], (unsigned long long)p->n_writing);
    CHECK(by_state[KVD_BLOCK_COMMITTED] == p->n_committed, "committed count");
    CHECK(by_state[KVD_BLOCK_CACHED] == p->n_cached, "cached count");
    CHECK(pinned == p->n_pinned, "pinned count");
    CHECK(quarantined == p->n_quarantined, "quarantined count %llu vs %llu",
          (unsigned long long)quarantined, (unsigned long long)p->n_quarantined);
    for (uint32_t t = 0; t < p->ntcap; t++) {
        CHECK(cached_t[t] == p->tenants[t].cached, "tenant %u: cached %llu, counted %llu", t,
              (unsigned long long)cached_t[t], (unsigned long long)p->tenants[t].cached);
        CHECK(pinned_t[t] == p->tenants[t].pinned, "tenant %u: pinned %llu, counted %llu", t,
              (unsigned long long)pinned_t[t], (unsigned long long)p->tenants[t].pinned);
        held += p->tenants[t].held;
        for (uint32_t q = 0; q < NQUEUE; q++) {
            CHECK(tevict[t * NQUEUE + q] == p->tevict[t * NQUEUE + q],
                  "tenant %u: evictable %u in queue %u, counted %u", t, tevict[t * NQUEUE + q], q,
                  p->tevict[t * NQUEUE + q]);
        }
    }
    CHECK(held + p->n_leased == refs, "references %llu, tenants hold %llu, tier leases %llu",
          (unsigned long long)refs, (unsigned long long)held, (unsigned long long)p->n_leased);
    CHECK(leased == p->n_leased, "%llu blocks leased, %llu leases counted",
          (unsigned long long)leased, (unsigned long long)p->n_leased);
    CHECK(inner_home[0] == p->inner_home[0] && inner_home[1] == p->inner_home[1],
          "inner blocks %llu/%llu, counted %llu/%llu", (unsigned long long)inner_home[0],
          (unsigned long long)inner_home[1], (unsigned long long)p->inner_home[0],
          (unsigned long long)p->inner_home[1]);
out:
    free(cached_t);
    free(pinned_t);
    free(tevict);
    return err;
}
