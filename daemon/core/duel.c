/* kvd_duel: two miniature ADAPTIVE pools that pick a pool's leaf order (duel.h). */
#include "daemon/core/duel.h"

#include <stdlib.h>
#include <string.h>

#include "common/kv_layout.h"
#include "daemon/core/backend.h"
#include "daemon/core/index.h"

typedef struct mini {
    kvd_pool *pool;
    kvd_index *idx;
} mini;

/* A picked request waiting for kvd_duel_step. */
typedef struct queued {
    kv_hash128 *h; /* malloc'ed copy */
    uint32_t n;
    uint64_t now;
} queued;

struct kvd_duel {
    mini m[2];                /* [0] leaf order AGE, [1] UNREUSED_FIRST; pool NULL until made */
    queued q[KVD_DUEL_QUEUE]; /* ring: q[head .. head + nq) */
    uint32_t head, nq;
    uint64_t q_blocks; /* blocks of the waiting requests */
    uint64_t dropped;
    uint32_t bps;        /* blocks of one mini segment */
    kvd_block_ref *refs; /* one request's references */
    size_t refs_cap;
    double score[2];
    kvd_leaf_order order;
    uint64_t sampled, skipped, switches;
    uint64_t picked;      /* picked requests stepped (fed or skipped) */
    uint64_t too_long_at; /* picked (1-based) when one last was too long for the minis; 0 never */
    uint32_t limit;       /* segments each mini may have now */
};

kv_err kvd_duel_alloc(kvd_duel **out) {
    kvd_duel *d = calloc(1, sizeof(*d));
    if (d == NULL) {
        return KV_ENOMEM;
    }
    d->order = KVD_LEAF_ORDER_AGE;
    *out = d;
    return KV_OK;
}

static void mini_close(mini *m) {
    kvd_pool_free(m->pool);
    kvd_index_free(m->idx);
    memset(m, 0, sizeof(*m));
}

void kvd_duel_free(kvd_duel *d) {
    if (d == NULL) {
        return;
    }
    for (uint32_t i = 0; i < d->nq; i++) {
        free(d->q[(d->head + i) % KVD_DUEL_QUEUE].h);
    }
    mini_close(&d->m[0]);
    mini_close(&d->m[1]);
    free(d->refs);
    free(d);
}

/* A mini of segments of bps blocks, at most limit of them, with leaf order `order`. The layout
 * is the smallest there is: the policy never looks at bytes. */
static kv_err mini_open(mini *m, uint32_t bps, uint32_t limit, kvd_leaf_order order) {
    memset(m, 0, sizeof(*m));
    kvd_pool_config cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.pool_id = 1;
    kv_err err = kv_layout_init(1, 1, 1, 1, KV_DTYPE_FP16, KV_BLOCK_MAJOR, &cfg.layout);
    if (err != KV_OK) {
        return err;
    }
    cfg.blocks_per_segment = bps;
    cfg.max_segments = limit;
    cfg.policy = KVD_EVICT_ADAPTIVE;
    err = kvd_index_alloc(bps, &m->idx);
    if (err == KV_OK) {
        err = kvd_pool_alloc(&cfg, m->idx, &kvd_backend_malloc, NULL, &m->pool);
    }
    if (err != KV_OK) {
        mini_close(m);
        return err;
    }
    kvd_pool_set_leaf_order(m->pool, order);
    return KV_OK;
}

/* The minis made (first time) and fitted to the pool's capacity now: each may have as many
 * segments as the pool has resident plus may still add. */
static kv_err fit_minis(kvd_duel *d, kvd_pool *pool) {
    uint64_t limit = (uint64_t)kvd_pool_resident_segments(pool) + kvd_pool_growable_segments(pool);
    /* Mini segments are pool segments / KVD_DUEL_SAMPLE; a pool whose segments hold fewer
     * blocks than that gets minis of one-block segments, as many as its blocks / SAMPLE. */
    uint32_t pbps = kvd_pool_config_get(pool)->blocks_per_segment;
    if (pbps < KVD_DUEL_SAMPLE) {
        limit = (limit * pbps + KVD_DUEL_SAMPLE - 1) / KVD_DUEL_SAMPLE;
    }
    if (limit == 0) {
        limit = 1;
    }
    if (limit > KVD_MAX_SEGMENTS) {
        limit = KVD_MAX_SEGMENTS;
    }
    if (d->m[0].pool == NULL || d->m[1].pool == NULL) {
        uint32_t bps = pbps / KVD_DUEL_SAMPLE;
        d->bps = bps == 0 ? 1 : bps;
        d->score[0] = d->score[1] = 0; /* new minis: what the old ones scored is gone */
        for (int k = 0; k < 2; k++) {
            mini_close(&d->m[k]);
            kv_err err = mini_open(&d->m[k], d->bps, (uint32_t)limit,
                                   k == 0 ? KVD_LEAF_ORDER_AGE : KVD_LEAF_ORDER_UNREUSED_FIRST);
            if (err != KV_OK) {
                mini_close(&d->m[0]);
                return err;
            }
        }
        d->limit = (uint32_t)limit;
        return KV_OK;
    }
    if (limit != d->limit) {
        for (int k = 0; k < 2; k++) {
            kvd_pool_set_max_segments(d->m[k].pool, (uint32_t)limit);
            /* Fewer segments allowed: give back trailing ones (no request holds a reference
             * between calls, so every segment can go but the first). */
            while (kvd_pool_resident_segments(d->m[k].pool) > limit &&
                   kvd_pool_shrink(d->m[k].pool, NULL) == KV_OK) {
            }
        }
        d->limit = (uint32_t)limit;
    }
    return KV_OK;
}

/* One request through one mini: looks its prefix up, allocates and commits the rest, releases
 * everything. *hits gets the leading hits. */
static kv_err mini_request(kvd_duel *d, mini *m, const kv_hash128 *h, uint32_t n, uint64_t now,
                           uint64_t *hits) {
    kvd_block_ref *refs = d->refs;
    kvd_pool_set_now(m->pool, now);
    size_t nhit = 0;
    kv_err err = kvd_pool_lookup(m->pool, 0, h, n, refs, &nhit);
    if (err != KV_OK) {
        return err;
    }
    *hits = nhit;
    uint32_t need = n - (uint32_t)nhit;
    if (need > 0) {
        kvd_pool_set_now(m->pool, now); /* each call its own age, as in kvd's pools */
        err = kvd_pool_allocate(m->pool, need, 1, 0, refs + nhit);
        if (err != KV_OK) {
            (void)kvd_pool_release(m->pool, 1, 0, refs, nhit);
            return err;
        }
    }
    kvd_pool_set_now(m->pool, now);
    for (uint32_t i = (uint32_t)nhit; i < n && err == KV_OK; i++) {
        uint32_t parent = i == 0 ? KVD_NO_BLOCK : refs[i - 1].id;
        kvd_block_ref c;
        err = kvd_pool_commit(m->pool, 1, refs[i], h[i], parent, &c);
        if (err == KV_OK) {
            refs[i] = c;
        }
    }
    kvd_pool_set_now(m->pool, now);
    kv_err rerr = kvd_pool_release(m->pool, 1, 0, refs, n);
    return err != KV_OK ? err : rerr;
}

int kvd_duel_picks(kv_hash128 last) {
    return ((last.lo * 0x9E3779B97F4A7C15ull) >> 40) % KVD_DUEL_SAMPLE == 0;
}

kv_err kvd_duel_observe(kvd_duel *d, const kv_hash128 *h, size_t n, uint64_t now) {
    if (n > 0 && h == NULL) {
        return KV_EINVAL;
    }
    if (n == 0 || !kvd_duel_picks(h[n - 1])) {
        return KV_OK;
    }
    if (n > KVD_DUEL_QUEUE_BLOCKS) {
        d->skipped++; /* longer than the queue holds: never fed */
        return KV_OK;
    }
    if (d->nq == KVD_DUEL_QUEUE || d->q_blocks + n > KVD_DUEL_QUEUE_BLOCKS) {
        d->dropped++;
        return KV_OK;
    }
    kv_hash128 *copy = malloc(n * sizeof(*copy));
    if (copy == NULL) {
        d->dropped++;
        return KV_ENOMEM;
    }
    memcpy(copy, h, n * sizeof(*copy));
    queued *e = &d->q[(d->head + d->nq) % KVD_DUEL_QUEUE];
    e->h = copy;
    e->n = (uint32_t)n;
    e->now = now;
    d->nq++;
    d->q_blocks += n;
    return KV_OK;
}

size_t kvd_duel_pending(const kvd_duel *d) {
    return d->nq;
}

static void set_order(kvd_duel *d, kvd_pool *pool, kvd_leaf_order order) {
    if (order != d->order) {
        d->switches++;
        d->order = order;
    }
    kvd_pool_set_leaf_order(pool, order);
}

/* One picked request through both minis; scores and pool's leaf order follow. */
static kv_err feed(kvd_duel *d, kvd_pool *pool, const kv_hash128 *h, size_t n, uint64_t now) {
    d->picked++;
    kv_err err = fit_minis(d, pool);
    if (err != KV_OK) {
        d->skipped++;
        return err;
    }
    if (n > (uint64_t)d->limit * d->bps / KVD_DUEL_MIN_REQS) {
        /* Minis that cannot hold two of this request see little but the prefixes shared by
         * the longer ones: their scores are not to be trusted until KVD_DUEL_DECAY picked
         * requests in a row fit. */
        d->skipped++;
        d->too_long_at = d->picked;
        set_order(d, pool, KVD_LEAF_ORDER_AGE);
        return KV_OK;
    }
    if (n > d->refs_cap) {
        kvd_block_ref *r = realloc(d->refs, n * sizeof(*r));
        if (r == NULL) {
            d->skipped++;
            return KV_ENOMEM;
        }
        d->refs = r;
        d->refs_cap = n;
    }
    uint64_t hits[2] = {0, 0};
    for (int k = 0; k < 2; k++) {
        err = mini_request(d, &d->m[k], h, (uint32_t)n, now, &hits[k]);
        if (err != KV_OK) {
            /* A mini that cannot take the request (out of memory growing) is not comparable
             * with the other any more: both start again from empty. */
            mini_close(&d->m[0]);
            mini_close(&d->m[1]);
            d->skipped++;
            return err;
        }
    }
    for (int k = 0; k < 2; k++) {
        d->score[k] = d->score[k] * (1.0 - 1.0 / KVD_DUEL_DECAY) + (double)hits[k];
    }
    d->sampled++;
    int trusted = d->too_long_at == 0 || d->picked - d->too_long_at >= (uint64_t)KVD_DUEL_DECAY;
    set_order(d, pool,
              trusted && d->score[1] > d->score[0] * (1.0 + KVD_DUEL_MARGIN)
                  ? KVD_LEAF_ORDER_UNREUSED_FIRST
                  : KVD_LEAF_ORDER_AGE);
    return KV_OK;
}

kv_err kvd_duel_step(kvd_duel *d, kvd_pool *pool) {
    if (d->nq == 0) {
        return KV_OK;
    }
    queued e = d->q[d->head];
    d->head = (d->head + 1) % KVD_DUEL_QUEUE;
    d->nq--;
    d->q_blocks -= e.n;
    kv_err err = feed(d, pool, e.h, e.n, e.now);
    free(e.h);
    return err;
}

void kvd_duel_stats_get(const kvd_duel *d, kvd_duel_stats *out) {
    memset(out, 0, sizeof(*out));
    out->sampled = d->sampled;
    out->skipped = d->skipped;
    out->switches = d->switches;
    out->dropped = d->dropped;
    out->queued = d->nq;
    out->order = d->order;
    out->score[0] = d->score[0];
    out->score[1] = d->score[1];
    out->bytes =
        sizeof(*d) + d->refs_cap * sizeof(kvd_block_ref) + d->q_blocks * sizeof(kv_hash128);
    if (d->m[0].pool != NULL) {
        out->mini_blocks = (uint64_t)d->limit * d->bps;
        for (int k = 0; k < 2; k++) {
            out->bytes += kvd_pool_meta_bytes(d->m[k].pool) +
                          kvd_pool_resident_bytes(d->m[k].pool) + kvd_index_bytes(d->m[k].idx);
        }
    }
}

kv_err kvd_duel_check(const kvd_duel *d) {
    kv_err err = KV_OK;
    for (int k = 0; k < 2 && err == KV_OK && d->m[k].pool != NULL; k++) {
        err = kvd_pool_check(d->m[k].pool);
    }
    return err;
}
