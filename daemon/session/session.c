/* kvd_session: reference tables are linear-probing maps with backward-shift deletion, so the
 * common path (add on allocate/lookup, sub on release) is O(1) with no tombstones. */
#include "daemon/session/session.h"

#include <stdlib.h>
#include <string.h>

#include "common/kv_log.h"

static uint32_t slot_of(uint32_t id, uint32_t cap) {
    /* Fibonacci hashing: block ids are dense, so spread them. */
    return (uint32_t)(((uint64_t)id * 0x9E3779B97F4A7C15ull) >> 32) & (cap - 1);
}

void kvd_refs_init(kvd_refs *r) {
    memset(r, 0, sizeof(*r));
}

void kvd_refs_fini(kvd_refs *r) {
    if (r == NULL) {
        return;
    }
    free(r->ids);
    free(r->gens);
    free(r->counts);
    memset(r, 0, sizeof(*r));
}

static int64_t find_slot(const kvd_refs *r, uint32_t id) {
    if (r->cap == 0) {
        return -1;
    }
    for (uint32_t i = slot_of(id, r->cap);; i = (i + 1) & (r->cap - 1)) {
        if (r->ids[i] == id) {
            return i;
        }
        if (r->ids[i] == KVD_NO_BLOCK) {
            return -1;
        }
    }
}

static void put(kvd_refs *r, uint32_t id, uint32_t gen, uint32_t count) {
    uint32_t i = slot_of(id, r->cap);
    while (r->ids[i] != KVD_NO_BLOCK) {
        i = (i + 1) & (r->cap - 1);
    }
    r->ids[i] = id;
    r->gens[i] = gen;
    r->counts[i] = count;
}

static kv_err grow(kvd_refs *r) {
    uint32_t ncap = r->cap == 0 ? 64 : r->cap * 2;
    kvd_refs n = {0};
    n.ids = malloc(sizeof(uint32_t) * ncap);
    n.gens = malloc(sizeof(uint32_t) * ncap);
    n.counts = malloc(sizeof(uint32_t) * ncap);
    if (n.ids == NULL || n.gens == NULL || n.counts == NULL) {
        kvd_refs_fini(&n);
        return KV_ENOMEM;
    }
    memset(n.ids, 0xff, sizeof(uint32_t) * ncap);
    n.cap = ncap;
    for (uint32_t i = 0; i < r->cap; i++) {
        if (r->ids[i] != KVD_NO_BLOCK) {
            put(&n, r->ids[i], r->gens[i], r->counts[i]);
        }
    }
    n.used = r->used;
    n.total = r->total;
    kvd_refs_fini(r);
    *r = n;
    return KV_OK;
}

kv_err kvd_refs_add(kvd_refs *r, uint32_t id, uint32_t gen, uint32_t n) {
    KV_ASSERT(id != KVD_NO_BLOCK);
    /* One probe finds the id or the empty slot where it goes (the common case on Lookup and
     * Allocate: a block the session does not hold yet), so a new id costs no second probe. */
    if (r->cap != 0) {
        uint32_t mask = r->cap - 1;
        uint32_t i = slot_of(id, r->cap);
        while (r->ids[i] != id && r->ids[i] != KVD_NO_BLOCK) {
            i = (i + 1) & mask;
        }
        if (r->ids[i] == id) {
            KV_ASSERT(r->gens[i] == gen);
            r->counts[i] += n;
            r->total += n;
            return KV_OK;
        }
        if ((uint64_t)(r->used + 1) * 2 <= r->cap) {
            r->ids[i] = id;
            r->gens[i] = gen;
            r->counts[i] = n;
            r->used++;
            r->total += n;
            return KV_OK;
        }
    }
    /* Keep the load at or below 1/2 so probes stay short. */
    kv_err rc = grow(r);
    if (rc != KV_OK) {
        return rc;
    }
    put(r, id, gen, n);
    r->used++;
    r->total += n;
    return KV_OK;
}

uint32_t kvd_refs_count(const kvd_refs *r, uint32_t id, uint32_t *gen) {
    int64_t s = find_slot(r, id);
    if (s < 0) {
        return 0;
    }
    if (gen != NULL) {
        *gen = r->gens[s];
    }
    return r->counts[s];
}

kv_err kvd_refs_sub(kvd_refs *r, uint32_t id, uint32_t n) {
    int64_t s = find_slot(r, id);
    if (s < 0 || r->counts[s] < n) {
        return KV_EPERM;
    }
    r->counts[s] -= n;
    r->total -= n;
    if (r->counts[s] > 0) {
        return KV_OK;
    }
    /* Backward-shift deletion: pull later entries of the probe run into the hole. */
    uint32_t hole = (uint32_t)s;
    uint32_t mask = r->cap - 1;
    for (uint32_t j = (hole + 1) & mask; r->ids[j] != KVD_NO_BLOCK; j = (j + 1) & mask) {
        uint32_t home = slot_of(r->ids[j], r->cap);
        /* j may move to hole when home is not cyclically in (hole, j]. */
        if (((j - home) & mask) >= ((j - hole) & mask)) {
            r->ids[hole] = r->ids[j];
            r->gens[hole] = r->gens[j];
            r->counts[hole] = r->counts[j];
            hole = j;
        }
    }
    r->ids[hole] = KVD_NO_BLOCK;
    r->used--;
    return KV_OK;
}

void kvd_refs_each(const kvd_refs *r,
                   void (*fn)(void *arg, uint32_t id, uint32_t gen, uint32_t count), void *arg) {
    for (uint32_t i = 0; i < r->cap; i++) {
        if (r->ids[i] != KVD_NO_BLOCK) {
            fn(arg, r->ids[i], r->gens[i], r->counts[i]);
        }
    }
}

void kvd_session_init(kvd_session *s, uint64_t id, pid_t pid, uid_t uid, gid_t gid) {
    memset(s, 0, sizeof(*s));
    s->id = id;
    s->pid = pid;
    s->uid = uid;
    s->gid = gid;
}

void kvd_session_fini(kvd_session *s) {
    if (s == NULL) {
        return;
    }
    kvd_session_release_all(s);
    for (uint32_t i = 0; i < s->npools; i++) {
        kvd_refs_fini(&s->pools[i].refs);
        free(s->pools[i].sent);
    }
    free(s->pools);
    s->pools = NULL;
    s->npools = s->cap = 0;
}

kvd_session_pool *kvd_session_find_pool(kvd_session *s, uint32_t pool_id) {
    for (uint32_t i = 0; i < s->npools; i++) {
        if (s->pools[i].pool_id == pool_id) {
            return &s->pools[i];
        }
    }
    return NULL;
}

kv_err kvd_session_add_pool(kvd_session *s, uint32_t pool_id, kvd_pool *pool,
                            kvd_session_pool **out) {
    kvd_session_pool *sp = kvd_session_find_pool(s, pool_id);
    if (sp != NULL) {
        *out = sp;
        return KV_OK;
    }
    if (s->npools == s->cap) {
        uint32_t ncap = s->cap == 0 ? 4 : s->cap * 2;
        kvd_session_pool *n = realloc(s->pools, sizeof(*n) * ncap);
        if (n == NULL) {
            return KV_ENOMEM;
        }
        s->pools = n;
        s->cap = ncap;
    }
    sp = &s->pools[s->npools++];
    memset(sp, 0, sizeof(*sp));
    sp->pool_id = pool_id;
    sp->pool = pool;
    sp->serial = ++s->attaches;
    kvd_refs_init(&sp->refs);
    *out = sp;
    return KV_OK;
}

kv_err kvd_session_pool_reserve(kvd_session_pool *sp, uint32_t slots) {
    if (slots <= sp->nsent) {
        return KV_OK;
    }
    uint32_t n = sp->nsent == 0 ? 16 : sp->nsent;
    while (n < slots) {
        n *= 2;
    }
    uint32_t *v = realloc(sp->sent, sizeof(*v) * n);
    if (v == NULL) {
        return KV_ENOMEM;
    }
    memset(v + sp->nsent, 0, sizeof(*v) * (n - sp->nsent));
    sp->sent = v;
    sp->nsent = n;
    return KV_OK;
}

void kvd_session_pool_mark_sent(kvd_session_pool *sp, uint32_t seg) {
    KV_ASSERT(seg < sp->nsent);
    sp->sent[seg] = kvd_pool_segment_serial(sp->pool, seg);
}

int kvd_session_pool_was_sent(const kvd_session_pool *sp, uint32_t seg) {
    uint32_t serial = kvd_pool_segment_serial(sp->pool, seg);
    return serial != 0 && seg < sp->nsent && sp->sent[seg] == serial;
}

uint32_t kvd_session_pool_first_unsent(kvd_session_pool *sp) {
    uint32_t reuses = kvd_pool_slot_reuses(sp->pool);
    if (reuses != sp->hole_reuses) {
        sp->hole = 0; /* a slot below the hint was regrown: its new segment was never sent */
        sp->hole_reuses = reuses;
    }
    uint32_t slots = kvd_pool_segment_slots(sp->pool);
    while (sp->hole < slots) {
        uint32_t serial = kvd_pool_segment_serial(sp->pool, sp->hole);
        if (serial != 0 && (sp->hole >= sp->nsent || sp->sent[sp->hole] != serial)) {
            return sp->hole;
        }
        sp->hole++;
    }
    return KVD_NO_SEGMENT;
}

void kvd_session_pool_forget_sent(kvd_session_pool *sp) {
    if (sp->sent != NULL) {
        memset(sp->sent, 0, sizeof(*sp->sent) * sp->nsent);
    }
    sp->hole = 0;
}

typedef struct collect {
    kvd_block_ref *v; /* refs, one per reference */
    size_t n;         /* filled */
} collect;

static void collect_one(void *arg, uint32_t id, uint32_t gen, uint32_t count) {
    collect *c = arg;
    for (uint32_t k = 0; k < count; k++) {
        c->v[c->n].id = id;
        c->v[c->n].gen = gen;
        c->n++;
    }
}

/* Releases every reference the session holds in sp (pool refcounts and ledger). */
static uint64_t release_pool(kvd_session *s, kvd_session_pool *sp) {
    if (sp->refs.total == 0) {
        return 0;
    }
    collect c = {calloc(sp->refs.total, sizeof(kvd_block_ref)), 0};
    if (c.v != NULL) {
        kvd_refs_each(&sp->refs, collect_one, &c);
        kv_err rc = kvd_pool_release(sp->pool, s->id, s->tenant, c.v, c.n);
        if (rc != KV_OK) {
            /* The batch is all or nothing; one bad entry (a bug) must not leak the rest. */
            KV_LOG(ERROR, "KVD-SESSION-RELEASE",
                   "session %llu: releasing %zu references in pool %u failed: %s; "
                   "releasing one by one",
                   (unsigned long long)s->id, c.n, sp->pool_id, kv_strerror(rc));
            for (size_t k = 0; k < c.n; k++) {
                (void)kvd_pool_release(sp->pool, s->id, s->tenant, &c.v[k], 1);
            }
        }
    } else {
        /* No memory for one batch: release block by block (slower, but nothing leaks). */
        for (uint32_t j = 0; j < sp->refs.cap; j++) {
            if (sp->refs.ids[j] == KVD_NO_BLOCK) {
                continue;
            }
            kvd_block_ref r = {sp->refs.ids[j], sp->refs.gens[j]};
            for (uint32_t k = 0; k < sp->refs.counts[j]; k++) {
                (void)kvd_pool_release(sp->pool, s->id, s->tenant, &r, 1);
            }
        }
    }
    uint64_t dropped = sp->refs.total;
    free(c.v);
    kvd_refs_fini(&sp->refs);
    kvd_refs_init(&sp->refs);
    return dropped;
}

uint64_t kvd_session_release_all(kvd_session *s) {
    uint64_t dropped = 0;
    for (uint32_t i = 0; i < s->npools; i++) {
        dropped += release_pool(s, &s->pools[i]);
    }
    return dropped;
}

uint64_t kvd_session_drop_pool(kvd_session *s, uint32_t pool_id) {
    kvd_session_pool *sp = kvd_session_find_pool(s, pool_id);
    if (sp == NULL) {
        return 0;
    }
    uint64_t dropped = release_pool(s, sp);
    kvd_refs_fini(&sp->refs);
    free(sp->sent);
    uint32_t i = (uint32_t)(sp - s->pools);
    memmove(&s->pools[i], &s->pools[i + 1], sizeof(s->pools[0]) * (s->npools - i - 1));
    s->npools--;
    return dropped;
}

uint64_t kvd_session_refs_held(const kvd_session *s) {
    uint64_t n = 0;
    for (uint32_t i = 0; i < s->npools; i++) {
        n += s->pools[i].refs.total;
    }
    return n;
}

kv_err kvd_session_hold(kvd_session *s, kvd_session_pool *sp, const kvd_block_ref *refs, size_t n) {
    for (size_t i = 0; i < n; i++) {
        if (kvd_refs_add(&sp->refs, refs[i].id, refs[i].gen, 1) != KV_OK) {
            for (size_t j = 0; j < i; j++) {
                (void)kvd_refs_sub(&sp->refs, refs[j].id, 1);
            }
            (void)kvd_pool_release(sp->pool, s->id, s->tenant, refs, n);
            return KV_ENOMEM;
        }
    }
    return KV_OK;
}

void kvd_session_unhold(kvd_session *s, kvd_session_pool *sp, const kvd_block_ref *refs, size_t n) {
    for (size_t i = 0; i < n; i++) {
        kv_err rc = kvd_refs_sub(&sp->refs, refs[i].id, 1);
        KV_ASSERT(rc == KV_OK);
        (void)rc;
    }
    (void)kvd_pool_release(sp->pool, s->id, s->tenant, refs, n);
}

void kvd_session_unhold_held(kvd_session *s, kvd_session_pool *sp, const kvd_block_ref *refs,
                             size_t n) {
    for (size_t i = 0; i < n; i++) {
        uint32_t gen = 0;
        if (kvd_refs_count(&sp->refs, refs[i].id, &gen) > 0 && gen == refs[i].gen &&
            kvd_refs_sub(&sp->refs, refs[i].id, 1) == KV_OK) {
            (void)kvd_pool_release(sp->pool, s->id, s->tenant, &refs[i], 1);
        }
    }
}

kv_err kvd_session_move_ref(kvd_session *s, kvd_session_pool *sp, uint32_t from, kvd_block_ref to) {
    kv_err rc = kvd_refs_sub(&sp->refs, from, 1);
    KV_ASSERT(rc == KV_OK);
    if (kvd_refs_add(&sp->refs, to.id, to.gen, 1) != KV_OK) {
        (void)kvd_pool_release(sp->pool, s->id, s->tenant, &to, 1);
        return KV_ENOMEM;
    }
    return rc;
}
