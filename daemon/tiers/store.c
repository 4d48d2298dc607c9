/* kvd_tstore: lower-tier entries of one pool (see store.h). */
#include "daemon/tiers/store.h"

#include <stdlib.h>
#include <string.h>

#include "common/kv_log.h"

static inline uint32_t bucket_of(const kvd_tstore *s, kv_hash128 h) {
    return (uint32_t)(h.lo ^ (h.hi >> 7)) & (s->nbuckets - 1);
}

void kvd_tstore_init(kvd_tstore *s) {
    memset(s, 0, sizeof(*s));
    s->free_head = KVD_TNONE;
    for (int t = 0; t < 2; t++) {
        s->head[t] = s->tail[t] = KVD_TNONE;
    }
}

static void free_t1(kvd_tstore *s, uint8_t *b) {
    if (b == NULL) {
        return;
    }
    if (s->free1 != NULL) {
        s->free1(s->free1_arg, b);
    } else {
        free(b);
    }
}

void kvd_tstore_fini(kvd_tstore *s) {
    if (s == NULL) {
        return;
    }
    for (uint32_t i = 0; i < s->cap; i++) {
        free_t1(s, s->e[i].t1);
        free(s->e[i].summ);
    }
    free(s->e);
    free(s->buckets);
    free(s->free2);
    free(s->own);
    kvd_tstore_init(s);
}

uint32_t kvd_tstore_find(const kvd_tstore *s, kv_hash128 h) {
    if (s->nbuckets == 0) {
        return KVD_TNONE;
    }
    for (uint32_t i = s->buckets[bucket_of(s, h)]; i != KVD_TNONE; i = s->e[i].hnext) {
        if (s->e[i].hash.lo == h.lo && s->e[i].hash.hi == h.hi) {
            return i;
        }
    }
    return KVD_TNONE;
}

static kv_err rehash(kvd_tstore *s, uint32_t nb) {
    uint32_t *b = malloc((size_t)nb * sizeof(*b));
    if (b == NULL) {
        return KV_ENOMEM;
    }
    for (uint32_t k = 0; k < nb; k++) {
        b[k] = KVD_TNONE;
    }
    free(s->buckets);
    s->buckets = b;
    s->nbuckets = nb;
    for (uint32_t i = 0; i < s->cap; i++) {
        if (s->e[i].used) {
            uint32_t k = bucket_of(s, s->e[i].hash);
            s->e[i].hnext = b[k];
            b[k] = i;
        }
    }
    return KV_OK;
}

kv_err kvd_tstore_get(kvd_tstore *s, kv_hash128 h, kv_hash128 parent, uint32_t *out) {
    uint32_t i = kvd_tstore_find(s, h);
    if (i != KVD_TNONE) {
        *out = i;
        return KV_OK;
    }
    if (s->free_head == KVD_TNONE) {
        uint32_t ncap = s->cap == 0 ? 256 : s->cap * 2;
        if (ncap <= s->cap || ncap >= KVD_TNONE) {
            return KV_ENOMEM;
        }
        kvd_tentry *ne = realloc(s->e, (size_t)ncap * sizeof(*ne));
        if (ne == NULL) {
            return KV_ENOMEM;
        }
        memset(ne + s->cap, 0, (size_t)(ncap - s->cap) * sizeof(*ne));
        s->e = ne;
        for (uint32_t k = ncap; k-- > s->cap;) {
            ne[k].hnext = s->free_head;
            s->free_head = k;
        }
        s->cap = ncap;
    }
    if (s->n + 1 > s->nbuckets) {
        /* Before the new entry is linked, so rehash sees only used ones. */
        if (rehash(s, s->nbuckets == 0 ? 256 : s->nbuckets * 2) != KV_OK) {
            return KV_ENOMEM;
        }
    }
    i = s->free_head;
    kvd_tentry *e = &s->e[i];
    s->free_head = e->hnext;
    memset(e, 0, sizeof(*e));
    e->hash = h;
    e->parent = parent;
    e->used = 1;
    e->owner = KVD_TNOOWNER;
    for (int t = 0; t < 2; t++) {
        e->prev[t] = e->next[t] = KVD_TNONE;
        e->oprev[t] = e->onext[t] = KVD_TNONE;
    }
    uint32_t k = bucket_of(s, h);
    e->hnext = s->buckets[k];
    s->buckets[k] = i;
    s->n++;
    *out = i;
    return KV_OK;
}

int kvd_tstore_in(const kvd_tstore *s, uint32_t i, int tier) {
    const kvd_tentry *e = &s->e[i];
    return tier == 1 ? e->t1 != NULL : e->in2 != 0;
}

/* The owner's list of tier t (an entry with an owner is on it while present in t). */
static void own_unlink(kvd_tstore *s, uint32_t i, int t) {
    kvd_tentry *e = &s->e[i];
    if (e->owner == KVD_TNOOWNER) {
        return;
    }
    kvd_towner *o = &s->own[e->owner];
    if (e->oprev[t] != KVD_TNONE) {
        s->e[e->oprev[t]].onext[t] = e->onext[t];
    } else {
        o->head[t] = e->onext[t];
    }
    if (e->onext[t] != KVD_TNONE) {
        s->e[e->onext[t]].oprev[t] = e->oprev[t];
    } else {
        o->tail[t] = e->oprev[t];
    }
    e->oprev[t] = e->onext[t] = KVD_TNONE;
    o->count[t]--;
    if (t == 0) {
        o->bytes1 -= e->len1;
    }
}

static void own_push(kvd_tstore *s, uint32_t i, int t) {
    kvd_tentry *e = &s->e[i];
    if (e->owner == KVD_TNOOWNER) {
        return;
    }
    kvd_towner *o = &s->own[e->owner];
    e->onext[t] = KVD_TNONE;
    e->oprev[t] = o->tail[t];
    if (o->tail[t] != KVD_TNONE) {
        s->e[o->tail[t]].onext[t] = i;
    } else {
        o->head[t] = i;
    }
    o->tail[t] = i;
    o->count[t]++;
    if (t == 0) {
        o->bytes1 += e->len1;
    }
}

static void lru_unlink(kvd_tstore *s, uint32_t i, int t) {
    own_unlink(s, i, t);
    kvd_tentry *e = &s->e[i];
    if (e->prev[t] != KVD_TNONE) {
        s->e[e->prev[t]].next[t] = e->next[t];
    } else {
        s->head[t] = e->next[t];
    }
    if (e->next[t] != KVD_TNONE) {
        s->e[e->next[t]].prev[t] = e->prev[t];
    } else {
        s->tail[t] = e->prev[t];
    }
    e->prev[t] = e->next[t] = KVD_TNONE;
}

static void lru_push(kvd_tstore *s, uint32_t i, int t) {
    kvd_tentry *e = &s->e[i];
    e->next[t] = KVD_TNONE;
    e->prev[t] = s->tail[t];
    if (s->tail[t] != KVD_TNONE) {
        s->e[s->tail[t]].next[t] = i;
    } else {
        s->head[t] = i;
    }
    s->tail[t] = i;
    own_push(s, i, t);
}

static void tell(kvd_tstore *s, const kvd_tentry *e, int tier, int present) {
    if (s->on_tier != NULL) {
        s->on_tier(s->on_tier_arg, e, tier, present);
    }
}

void kvd_tstore_set1(kvd_tstore *s, uint32_t i, uint8_t *bytes, uint64_t len, uint8_t fmt) {
    kvd_tentry *e = &s->e[i];
    KV_ASSERT(e->used && e->t1 == NULL && bytes != NULL);
    e->t1 = bytes;
    e->len1 = len;
    e->fmt1 = fmt;
    lru_push(s, i, 0);
    s->count[0]++;
    s->bytes[0] += len;
    tell(s, e, 1, 1);
}

void kvd_tstore_set2(kvd_tstore *s, uint32_t i, uint64_t slot, uint64_t len, uint8_t fmt,
                     uint64_t seq, uint64_t slot_bytes) {
    kvd_tentry *e = &s->e[i];
    KV_ASSERT(e->used && !e->in2);
    e->in2 = 1;
    e->slot2 = slot;
    e->len2 = len;
    e->fmt2 = fmt;
    e->seq = seq;
    lru_push(s, i, 1);
    s->count[1]++;
    s->bytes[1] += slot_bytes;
    if (slot >= s->next_slot2) {
        s->next_slot2 = slot + 1; /* a record found by a restart's scan */
    }
    tell(s, e, 2, 1);
}

void kvd_tstore_forget(kvd_tstore *s, uint32_t i) {
    kvd_tentry *e = &s->e[i];
    KV_ASSERT(e->used && e->t1 == NULL && !e->in2 && e->busy == 0 && e->pending == 0);
    uint32_t k = bucket_of(s, e->hash);
    uint32_t *pp = &s->buckets[k];
    while (*pp != i) {
        KV_ASSERT(*pp != KVD_TNONE);
        pp = &s->e[*pp].hnext;
    }
    *pp = e->hnext;
    free(e->summ);
    e->summ = NULL;
    e->used = 0;
    e->hnext = s->free_head;
    s->free_head = i;
    s->n--;
}

void kvd_tstore_slot2_back(kvd_tstore *s, uint64_t slot) {
    if (slot >= s->next_slot2) {
        /* A slot no record counted yet (a restart's scan found an older duplicate there):
         * the never-used run starts after it, so it is handed out once, from the list. */
        s->next_slot2 = slot + 1;
    }
    if (s->nfree2 == s->free2_cap) {
        uint64_t nc = s->free2_cap == 0 ? 64 : s->free2_cap * 2;
        uint64_t *nf = realloc(s->free2, (size_t)nc * sizeof(*nf));
        if (nf == NULL) {
            return; /* the slot stays unused until a restart: a leak of disk, not of data */
        }
        s->free2 = nf;
        s->free2_cap = nc;
    }
    s->free2[s->nfree2++] = slot;
}

void kvd_tstore_drop(kvd_tstore *s, uint32_t i, int tier, uint64_t slot_bytes) {
    kvd_tentry *e = &s->e[i];
    KV_ASSERT(e->used && e->busy == 0);
    if (tier == 1 && e->t1 != NULL) {
        lru_unlink(s, i, 0);
        s->count[0]--;
        s->bytes[0] -= e->len1;
        free_t1(s, e->t1);
        e->t1 = NULL;
        e->len1 = 0;
        tell(s, e, 1, 0);
    } else if (tier == 2 && e->in2) {
        lru_unlink(s, i, 1);
        s->count[1]--;
        s->bytes[1] -= slot_bytes;
        e->in2 = 0;
        kvd_tstore_slot2_back(s, e->slot2);
        tell(s, e, 2, 0);
    }
    if (e->t1 == NULL && !e->in2 && e->pending == 0) {
        kvd_tstore_forget(s, i);
    }
}

uint8_t *kvd_tstore_take1(kvd_tstore *s, uint32_t i) {
    kvd_tentry *e = &s->e[i];
    KV_ASSERT(e->used && e->busy == 0 && e->t1 != NULL);
    uint8_t *b = e->t1;
    lru_unlink(s, i, 0);
    s->count[0]--;
    s->bytes[0] -= e->len1;
    e->t1 = NULL;
    e->len1 = 0;
    tell(s, e, 1, 0);
    if (!e->in2 && e->pending == 0) {
        kvd_tstore_forget(s, i);
    }
    return b;
}

uint64_t kvd_tstore_unlink2(kvd_tstore *s, uint32_t i, uint64_t slot_bytes) {
    kvd_tentry *e = &s->e[i];
    KV_ASSERT(e->used && e->busy == 0 && e->in2);
    lru_unlink(s, i, 1);
    s->count[1]--;
    s->bytes[1] -= slot_bytes;
    e->in2 = 0;
    uint64_t slot = e->slot2;
    tell(s, e, 2, 0);
    if (e->t1 == NULL && e->pending == 0) {
        kvd_tstore_forget(s, i);
    }
    return slot;
}

void kvd_tstore_touch(kvd_tstore *s, uint32_t i) {
    kvd_tentry *e = &s->e[i];
    if (e->t1 != NULL) {
        lru_unlink(s, i, 0);
        lru_push(s, i, 0);
    }
    if (e->in2) {
        lru_unlink(s, i, 1);
        lru_push(s, i, 1);
    }
    if (e->hits < UINT32_MAX) {
        e->hits++;
    }
}

uint32_t kvd_tstore_oldest(const kvd_tstore *s, int tier) {
    int t = tier - 1;
    for (uint32_t i = s->head[t]; i != KVD_TNONE; i = s->e[i].next[t]) {
        if (s->e[i].busy == 0) {
            return i;
        }
    }
    return KVD_TNONE;
}

kv_err kvd_tstore_slot2(kvd_tstore *s, uint64_t *slot) {
    if (s->nfree2 > 0) {
        *slot = s->free2[--s->nfree2];
        return KV_OK;
    }
    *slot = s->next_slot2++;
    return KV_OK;
}

static const kvd_towner *owner_of(const kvd_tstore *s, uint32_t tenant) {
    for (uint32_t k = 0; k < s->nown; k++) {
        if (s->own[k].tenant == tenant) {
            return &s->own[k];
        }
    }
    return NULL;
}

kv_err kvd_tstore_own(kvd_tstore *s, uint32_t i, uint32_t tenant) {
    kvd_tentry *e = &s->e[i];
    if (e->t1 != NULL || e->in2) {
        return KV_OK; /* present: keeps its owner (and its place on that owner's lists) */
    }
    const kvd_towner *o = owner_of(s, tenant);
    if (o == NULL) {
        if (s->nown == KVD_TNOOWNER) {
            e->owner = KVD_TNOOWNER;
            return KV_ENOMEM;
        }
        if (s->nown == s->own_cap) {
            uint32_t nc = s->own_cap == 0 ? 4 : s->own_cap * 2;
            kvd_towner *no = realloc(s->own, (size_t)nc * sizeof(*no));
            if (no == NULL) {
                e->owner = KVD_TNOOWNER;
                return KV_ENOMEM;
            }
            s->own = no;
            s->own_cap = nc;
        }
        kvd_towner *n = &s->own[s->nown++];
        n->tenant = tenant;
        n->head[0] = n->head[1] = n->tail[0] = n->tail[1] = KVD_TNONE;
        n->count[0] = n->count[1] = 0;
        n->bytes1 = 0;
        o = n;
    }
    e->owner = (uint16_t)(o - s->own);
    return KV_OK;
}

uint32_t kvd_tstore_owner(const kvd_tstore *s, uint32_t i) {
    const kvd_tentry *e = &s->e[i];
    return e->owner == KVD_TNOOWNER ? UINT32_MAX : s->own[e->owner].tenant;
}

uint64_t kvd_tstore_owned(const kvd_tstore *s, uint32_t tenant, int tier) {
    const kvd_towner *o = owner_of(s, tenant);
    return o != NULL ? o->count[tier - 1] : 0;
}

uint64_t kvd_tstore_owned_bytes1(const kvd_tstore *s, uint32_t tenant) {
    const kvd_towner *o = owner_of(s, tenant);
    return o != NULL ? o->bytes1 : 0;
}

uint32_t kvd_tstore_oldest_of(const kvd_tstore *s, uint32_t tenant, int tier) {
    const kvd_towner *o = owner_of(s, tenant);
    int t = tier - 1;
    for (uint32_t i = o != NULL ? o->head[t] : KVD_TNONE; i != KVD_TNONE; i = s->e[i].onext[t]) {
        if (s->e[i].busy == 0) {
            return i;
        }
    }
    return KVD_TNONE;
}
