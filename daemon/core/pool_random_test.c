/* Randomized test of kvd_pool against a simple reference model: a million mixed operations
 * (allocate, commit, lookup, hold, release, pin, unpin, clock, admin evict, shrink, guarantees,
 * stale handles), seeded and reproducible. Every result is checked against the model's
 * prediction; every CHECK_EVERY operations the model and the pool are compared block by block
 * and kvd_pool_check walks the invariants. The model knows counts and states, not the policy's
 * order: for evictions it checks that each victim was evictable, and how many went. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "daemon/core/pool.h"

#define BPS 16
#define MAXSEG 4
#define NBLK (BPS * MAXSEG)
#define NKEYS 160
#define NTENANTS 4
#define MAXHELD 256
#define NSTALE 64
#define OPS 550000
#define CHECK_EVERY 4096

typedef struct mblock {
    kvd_block_state state;
    uint32_t refcount;
    uint32_t gen;       /* generation of the current life (valid unless FREE) */
    int key;            /* committed key or -1 */
    uint64_t session;   /* WRITING owner */
    uint32_t tenant;    /* allocating tenant */
    uint64_t pin_until; /* active while > now */
} mblock;

typedef struct held_ref {
    kvd_block_ref ref; /* the handle */
    uint64_t session;  /* session that holds it */
    uint32_t tenant;   /* tenant charged */
} held_ref;

typedef struct model {
    kvd_pool *pool;
    kvd_index *idx;
    uint64_t rng;
    uint64_t now;
    int live[MAXSEG];
    mblock b[NBLK];
    int key_blk[NKEYS];
    held_ref held[MAXHELD];
    int nheld;
    kvd_block_ref stale[NSTALE];
    int nstale;
    uint64_t tenant_held[NTENANTS];
    uint64_t guarantee[NTENANTS]; /* kvd_pool_set_guarantee's last word per tenant */
} model;

static uint64_t rnd(model *m) {
    uint64_t z = (m->rng += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static uint32_t below(model *m, uint32_t n) {
    return (uint32_t)(rnd(m) % n);
}

static kv_hash128 key_hash(int k) {
    kv_hash128 h = {(uint64_t)k * 0x9E3779B97F4A7C15ull ^ 0x5555, (uint64_t)k + 1};
    return h;
}

static int evictable(const model *m, int id) {
    return m->live[id / BPS] && m->b[id].state == KVD_BLOCK_CACHED && m->b[id].pin_until <= m->now;
}

static void to_free(model *m, int id) {
    mblock *b = &m->b[id];
    if (b->state != KVD_BLOCK_FREE) {
        kvd_block_ref old = {(uint32_t)id, b->gen};
        m->stale[m->nstale++ % NSTALE] = old;
    }
    if (b->key >= 0) {
        m->key_blk[b->key] = -1;
    }
    b->state = KVD_BLOCK_FREE;
    b->refcount = 0;
    b->key = -1;
    b->pin_until = 0;
}

static void add_held(model *m, kvd_block_ref r, uint64_t session, uint32_t tenant) {
    assert_true(m->nheld < MAXHELD);
    held_ref h = {r, session, tenant};
    m->held[m->nheld++] = h;
    m->tenant_held[tenant]++;
}

static void drop_held(model *m, int i) {
    m->tenant_held[m->held[i].tenant]--;
    m->held[i] = m->held[--m->nheld];
}

/* Takes a reference as lookup and hold do. */
static void model_ref(model *m, int id) {
    mblock *b = &m->b[id];
    assert_true(b->state == KVD_BLOCK_COMMITTED || b->state == KVD_BLOCK_CACHED);
    b->state = KVD_BLOCK_COMMITTED;
    b->refcount++;
}

static void op_allocate(model *m) {
    uint32_t n = 1 + below(m, 4);
    if (m->nheld + (int)n > MAXHELD) {
        return;
    }
    uint64_t session = 1 + below(m, 3);
    uint32_t tenant = below(m, NTENANTS);
    int nfree = 0, nevict = 0, nlive = 0;
    for (int id = 0; id < NBLK; id++) {
        nfree += m->live[id / BPS] && m->b[id].state == KVD_BLOCK_FREE;
        nevict += evictable(m, id);
    }
    for (int s = 0; s < MAXSEG; s++) {
        nlive += m->live[s];
    }
    /* The pool grows (lowest empty slot first) before it evicts. */
    while (nfree < (int)n && nlive < MAXSEG) {
        int s = 0;
        while (m->live[s]) {
            s++;
        }
        m->live[s] = 1;
        nlive++;
        nfree += BPS;
        for (int i = 0; i < BPS; i++) {
            m->b[s * BPS + i].state = KVD_BLOCK_FREE;
        }
    }
    int must_evict = (int)n > nfree ? (int)n - nfree : 0;
    uint64_t cached[NTENANTS] = {0}, taken[NTENANTS] = {0};
    for (int id = 0; id < NBLK; id++) {
        if (m->live[id / BPS] && m->b[id].state == KVD_BLOCK_CACHED) {
            cached[m->b[id].tenant]++;
        }
    }
    kvd_block_ref out[4];
    kv_err err = kvd_pool_allocate(m->pool, n, session, tenant, out);
    if (must_evict > nevict) {
        assert_int_equal(err, KV_ENOSPC);
        return;
    }
    assert_int_equal(err, KV_OK);
    int evicted = 0;
    for (uint32_t i = 0; i < n; i++) {
        int id = (int)out[i].id;
        assert_true(id < NBLK && m->live[id / BPS]);
        for (uint32_t j = 0; j < i; j++) {
            assert_int_not_equal(out[j].id, out[i].id);
        }
        mblock *b = &m->b[id];
        if (b->state == KVD_BLOCK_CACHED) {
            assert_true(evictable(m, id)); /* never a referenced or pinned block */
            assert_int_not_equal(out[i].gen, b->gen);
            evicted++;
            taken[b->tenant]++;
            to_free(m, id);
        }
        assert_int_equal(b->state, KVD_BLOCK_FREE);
        b->state = KVD_BLOCK_WRITING;
        b->refcount = 1;
        b->gen = out[i].gen;
        b->session = session;
        b->tenant = tenant;
        b->key = -1;
        add_held(m, out[i], session, tenant);
    }
    assert_int_equal(evicted, must_evict);
    /* Guaranteed shares: a tenant goes below min(its cached blocks, its guarantee) only when
     * nothing unprotected was left, and a tenant only becomes protected during an allocation,
     * so then every tenant with an evictable block left is at or under its guarantee. */
    int broken = 0;
    for (uint32_t t = 0; t < NTENANTS; t++) {
        uint64_t g = m->guarantee[t], floor = cached[t] < g ? cached[t] : g;
        broken |= g != 0 && cached[t] - taken[t] < floor;
    }
    for (int id = 0; broken && id < NBLK; id++) {
        if (evictable(m, id)) {
            uint32_t t = m->b[id].tenant;
            assert_true(m->guarantee[t] != 0 && cached[t] - taken[t] <= m->guarantee[t]);
        }
    }
}

static int pick_held(model *m, int want_writing) {
    if (m->nheld == 0) {
        return -1;
    }
    int start = (int)below(m, (uint32_t)m->nheld);
    for (int k = 0; k < m->nheld; k++) {
        int i = (start + k) % m->nheld;
        int w = m->b[m->held[i].ref.id].state == KVD_BLOCK_WRITING;
        if (want_writing < 0 || w == want_writing) {
            return i;
        }
    }
    return -1;
}

static void op_commit(model *m) {
    int i = pick_held(m, 1);
    if (i < 0) {
        return;
    }
    held_ref h = m->held[i];
    int key = (int)below(m, NKEYS);
    kvd_block_ref c;
    if (below(m, 16) == 0) {
        /* Another session's lease. */
        assert_int_equal(
            kvd_pool_commit(m->pool, h.session + 10, h.ref, key_hash(key), KVD_NO_BLOCK, &c),
            KV_EPERM);
        return;
    }
    uint32_t slots = kvd_pool_segment_slots(m->pool);
    uint32_t parent = below(m, 2) ? KVD_NO_BLOCK : below(m, slots * BPS);
    if (parent == h.ref.id) {
        parent = KVD_NO_BLOCK;
    }
    assert_int_equal(kvd_pool_commit(m->pool, h.session, h.ref, key_hash(key), parent, &c), KV_OK);
    int e = m->key_blk[key];
    if (e >= 0) {
        assert_int_equal(c.id, (uint32_t)e);
        assert_int_equal(c.gen, m->b[e].gen);
        model_ref(m, e);
        m->b[h.ref.id].refcount = 0;
        to_free(m, (int)h.ref.id);
        m->held[i].ref = c;
    } else {
        assert_int_equal(c.id, h.ref.id);
        assert_int_equal(c.gen, h.ref.gen);
        mblock *b = &m->b[h.ref.id];
        b->state = KVD_BLOCK_COMMITTED;
        b->key = key;
        m->key_blk[key] = (int)h.ref.id;
    }
    /* Committing it again is a state error. */
    assert_int_equal(kvd_pool_commit(m->pool, h.session, c, key_hash(key), KVD_NO_BLOCK, &c),
                     KV_ESTATE);
}

static void op_lookup(model *m) {
    uint32_t n = 1 + below(m, 6);
    if (m->nheld + (int)n > MAXHELD) {
        return;
    }
    uint32_t tenant = below(m, NTENANTS);
    int start = (int)below(m, NKEYS);
    kv_hash128 hs[6];
    size_t want = 0;
    int stop = 0;
    for (uint32_t i = 0; i < n; i++) {
        int k = (start + (int)i) % NKEYS;
        hs[i] = key_hash(k);
        if (!stop && m->key_blk[k] >= 0) {
            want++;
        } else {
            stop = 1;
        }
    }
    kvd_block_ref out[6];
    size_t nhit = 99;
    assert_int_equal(kvd_pool_lookup(m->pool, tenant, hs, n, out, &nhit), KV_OK);
    assert_int_equal(nhit, want);
    for (size_t i = 0; i < nhit; i++) {
        int e = m->key_blk[(start + (int)i) % NKEYS];
        assert_int_equal(out[i].id, (uint32_t)e);
        assert_int_equal(out[i].gen, m->b[e].gen);
        model_ref(m, e);
        add_held(m, out[i], 0, tenant);
    }
}

static void op_hold(model *m) {
    int i = pick_held(m, 0);
    if (i < 0 || m->nheld >= MAXHELD) {
        return;
    }
    uint32_t tenant = below(m, NTENANTS);
    kvd_block_ref r = m->held[i].ref;
    assert_int_equal(kvd_pool_hold(m->pool, tenant, r), KV_OK);
    model_ref(m, (int)r.id);
    add_held(m, r, 0, tenant);
}

static void op_release(model *m) {
    int first = pick_held(m, -1);
    if (first < 0) {
        return;
    }
    held_ref h0 = m->held[first];
    /* Up to 5 references of the same tenant and session, in random order. */
    int pick[5];
    int np = 0;
    pick[np++] = first;
    for (int k = 0; k < m->nheld && np < 5; k++) {
        int i = (first + 1 + k) % m->nheld;
        if (i != first && m->held[i].tenant == h0.tenant && m->held[i].session == h0.session &&
            below(m, 2)) {
            pick[np++] = i;
        }
    }
    kvd_block_ref refs[6];
    for (int k = 0; k < np; k++) {
        refs[k] = m->held[pick[k]].ref;
    }
    if (m->nstale > 0 && below(m, 20) == 0) {
        /* A stale handle among them: refused, nothing changes. */
        kvd_block_ref st = m->stale[below(m, m->nstale < NSTALE ? (uint32_t)m->nstale : NSTALE)];
        refs[np] = st;
        kv_err err = kvd_pool_release(m->pool, h0.session, h0.tenant, refs, (size_t)np + 1);
        assert_true(err == KV_ESTALE || err == KV_ENOENT || err == KV_EINVAL);
        return;
    }
    assert_int_equal(kvd_pool_release(m->pool, h0.session, h0.tenant, refs, (size_t)np), KV_OK);
    for (int k = np; k-- > 0;) {
        mblock *b = &m->b[refs[k].id];
        assert_true(b->refcount > 0);
        b->refcount--;
    }
    for (int k = 0; k < np; k++) {
        int id = (int)refs[k].id;
        mblock *b = &m->b[id];
        if (b->refcount == 0 && b->state == KVD_BLOCK_WRITING) {
            to_free(m, id);
        } else if (b->refcount == 0 && b->state == KVD_BLOCK_COMMITTED) {
            b->state = KVD_BLOCK_CACHED;
        }
    }
    /* Remove picks from the held list, highest index first so swaps don't disturb the rest. */
    for (int a = 0; a < np; a++) {
        for (int c = a + 1; c < np; c++) {
            if (pick[c] > pick[a]) {
                int t = pick[a];
                pick[a] = pick[c];
                pick[c] = t;
            }
        }
    }
    for (int k = 0; k < np; k++) {
        drop_held(m, pick[k]);
    }
}

static int random_indexed(model *m) {
    int start = (int)below(m, NKEYS);
    for (int k = 0; k < NKEYS; k++) {
        int e = m->key_blk[(start + k) % NKEYS];
        if (e >= 0) {
            return e;
        }
    }
    return -1;
}

static void op_pin(model *m) {
    int e = random_indexed(m);
    if (e < 0) {
        return;
    }
    kvd_block_ref r = {(uint32_t)e, m->b[e].gen};
    if (below(m, 3) == 0) {
        assert_int_equal(kvd_pool_unpin(m->pool, r), KV_OK);
        m->b[e].pin_until = 0;
        return;
    }
    uint64_t ret = below(m, 40);
    assert_int_equal(kvd_pool_pin(m->pool, r, ret, (uint8_t)below(m, 4), KVD_PIN_OWNER), KV_OK);
    if (m->b[e].pin_until > m->now || ret > 0) {
        if (m->now + ret > m->b[e].pin_until) {
            m->b[e].pin_until = m->now + ret;
        }
    }
}

static void op_evict(model *m) {
    size_t max = 1 + below(m, 5);
    int64_t tenant = below(m, 2) ? -1 : (int64_t)below(m, NTENANTS);
    int dry = below(m, 4) == 0;
    int avail = 0;
    for (int id = 0; id < NBLK; id++) {
        avail += evictable(m, id) && (tenant < 0 || m->b[id].tenant == (uint32_t)tenant);
    }
    kvd_block_ref out[5];
    size_t n = 99;
    assert_int_equal(kvd_pool_evict(m->pool, max, tenant, KVD_EVICT_ADMIN, dry, out, &n), KV_OK);
    assert_int_equal(n, (size_t)avail < max ? (size_t)avail : max);
    for (size_t i = 0; i < n; i++) {
        int id = (int)out[i].id;
        assert_true(evictable(m, id));
        assert_int_equal(out[i].gen, m->b[id].gen);
        if (tenant >= 0) {
            assert_int_equal(m->b[id].tenant, (uint32_t)tenant);
        }
        if (!dry) {
            to_free(m, id);
        }
    }
}

static void op_shrink(model *m) {
    int want = -1;
    /* Segment 0 is never freed (pool.h). */
    for (int s = MAXSEG - 1; s >= 1 && want < 0; s--) {
        if (!m->live[s]) {
            continue;
        }
        int ok = 1;
        for (int i = 0; i < BPS; i++) {
            int id = s * BPS + i;
            ok &= m->b[id].state == KVD_BLOCK_FREE || evictable(m, id);
        }
        if (ok) {
            want = s;
        }
    }
    uint32_t seg = 99;
    kv_err err = kvd_pool_shrink(m->pool, &seg);
    if (want < 0) {
        assert_int_equal(err, KV_ENOENT);
        return;
    }
    assert_int_equal(err, KV_OK);
    assert_int_equal(seg, (uint32_t)want);
    for (int i = 0; i < BPS; i++) {
        to_free(m, want * BPS + i);
    }
    m->live[want] = 0;
}

static void op_stale(model *m) {
    if (m->nstale == 0) {
        return;
    }
    kvd_block_ref st = m->stale[below(m, m->nstale < NSTALE ? (uint32_t)m->nstale : NSTALE)];
    kv_err err = kvd_pool_check_ref(m->pool, st);
    if (!m->live[st.id / BPS]) {
        assert_int_equal(err, KV_ENOENT);
    } else if (m->b[st.id].state == KVD_BLOCK_FREE || m->b[st.id].gen != st.gen) {
        assert_int_equal(err, KV_ESTALE);
        assert_int_equal(kvd_pool_hold(m->pool, 0, st), KV_ESTALE);
    }
}

/* Advances the clock; pins expire exactly at their end, not a moment before or after. */
static void op_clock(model *m) {
    m->now += below(m, 8);
    kvd_pool_set_now(m->pool, m->now);
    for (int id = 0; id < NBLK; id++) {
        kvd_block_info info;
        if (m->live[id / BPS] && m->b[id].key >= 0) {
            assert_int_equal(kvd_pool_block_info(m->pool, (uint32_t)id, &info), KV_OK);
            assert_int_equal(info.pinned, m->b[id].pin_until > m->now);
        }
    }
}

/* kvd_pool_park_candidate against a walk of every block: idle segments (every block FREE or
 * CACHED unpinned), none holding a cached block of a tenant with a guarantee while some tenant
 * is at or under its own; fewest cached blocks first (the newest-access tie break is checked
 * by kvd_pool_check: each segment's count equals its blocks' newest access). */
static void check_park_choice(model *m) {
    uint64_t cached[NTENANTS] = {0};
    int any_protected = 0;
    for (int id = 0; id < NBLK; id++) {
        if (m->live[id / BPS] && m->b[id].state == KVD_BLOCK_CACHED) {
            cached[m->b[id].tenant]++;
        }
    }
    for (uint32_t t = 0; t < NTENANTS; t++) {
        any_protected |= m->guarantee[t] != 0 && cached[t] <= m->guarantee[t];
    }
    uint32_t parkable = 0, fewest = UINT32_MAX;
    int ok[MAXSEG] = {0};
    uint32_t ncached[MAXSEG] = {0};
    for (int s = 0; s < MAXSEG; s++) {
        if (!m->live[s]) {
            continue;
        }
        int idle = 1, guarded = 0;
        for (int i = 0; i < BPS; i++) {
            const mblock *b = &m->b[s * BPS + i];
            idle &= b->state == KVD_BLOCK_FREE ||
                    (b->state == KVD_BLOCK_CACHED && b->pin_until <= m->now);
            guarded |=
                b->state == KVD_BLOCK_CACHED && any_protected && m->guarantee[b->tenant] != 0;
            ncached[s] += b->state == KVD_BLOCK_CACHED;
        }
        if (idle && !guarded) {
            ok[s] = 1;
            parkable++;
            if (ncached[s] < fewest) {
                fewest = ncached[s];
            }
        }
    }
    kvd_park_candidate c;
    kv_err err = kvd_pool_park_candidate(m->pool, &c);
    if (parkable == 0) {
        assert_int_equal(err, KV_ENOENT);
        return;
    }
    assert_int_equal(err, KV_OK);
    assert_int_equal(c.parkable, parkable);
    assert_true(c.seg < MAXSEG && ok[c.seg]);
    assert_int_equal(c.cached, fewest);
    assert_int_equal(ncached[c.seg], fewest);
}

static void compare(model *m) {
    assert_int_equal(kvd_pool_check(m->pool), KV_OK);
    check_park_choice(m);
    for (int id = 0; id < NBLK; id++) {
        kvd_block_info info;
        kv_err err = kvd_pool_block_info(m->pool, (uint32_t)id, &info);
        if (!m->live[id / BPS]) {
            assert_int_equal(err, KV_ENOENT);
            continue;
        }
        assert_int_equal(err, KV_OK);
        mblock *b = &m->b[id];
        assert_int_equal(info.state, b->state);
        assert_int_equal(info.refcount, b->refcount);
        if (b->state != KVD_BLOCK_FREE) {
            assert_int_equal(info.gen, b->gen);
            assert_int_equal(info.tenant, b->tenant);
        }
        if (b->state == KVD_BLOCK_WRITING) {
            assert_int_equal(info.owner_session, b->session);
        }
        if (b->key >= 0) {
            assert_true(kv_hash_eq(info.hash, key_hash(b->key)));
            assert_int_equal(info.pinned, b->pin_until > m->now);
        }
    }
    for (uint32_t t = 0; t < NTENANTS; t++) {
        assert_int_equal(kvd_pool_tenant_usage(m->pool, t).held, m->tenant_held[t]);
    }
}

static kv_err keep_discard(void *ctx, kvd_segment_mem *mem) {
    (void)ctx;
    (void)mem;
    return KV_OK;
}

static void run(kvd_evict_policy policy, uint64_t seed) {
    static model m;
    memset(&m, 0, sizeof(m));
    m.rng = seed;
    for (int k = 0; k < NKEYS; k++) {
        m.key_blk[k] = -1;
    }
    for (int id = 0; id < NBLK; id++) {
        m.b[id].key = -1;
    }
    kvd_pool_config cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.pool_id = 3;
    assert_int_equal(kv_layout_init(1, 1, 8, 16, KV_DTYPE_FP16, KV_LAYER_MAJOR, &cfg.layout),
                     KV_OK);
    cfg.blocks_per_segment = BPS;
    cfg.max_segments = MAXSEG;
    cfg.policy = policy;
    assert_int_equal(kvd_index_alloc(NBLK * 4, &m.idx), KV_OK);
    /* The malloc backend with a discard (nothing here parks: it lets park_candidate answer). */
    static kvd_backend_ops be;
    be = kvd_backend_malloc;
    be.segment_discard = keep_discard;
    assert_int_equal(kvd_pool_alloc(&cfg, m.idx, &be, NULL, &m.pool), KV_OK);
    for (int op = 0; op < OPS; op++) {
        uint32_t r = below(&m, 100);
        if (r < 18) {
            op_allocate(&m);
        } else if (r < 36) {
            op_commit(&m);
        } else if (r < 52) {
            op_lookup(&m);
        } else if (r < 56) {
            op_hold(&m);
        } else if (r < 84) {
            op_release(&m);
        } else if (r < 88) {
            op_pin(&m);
        } else if (r < 92) {
            op_clock(&m);
        } else if (r < 95) {
            op_evict(&m);
        } else if (r < 96) {
            op_shrink(&m);
        } else if (r < 97) {
            uint32_t t = below(&m, NTENANTS);
            m.guarantee[t] = below(&m, 12);
            kvd_pool_set_guarantee(m.pool, t, m.guarantee[t]);
        } else {
            op_stale(&m);
        }
        if ((op + 1) % CHECK_EVERY == 0) {
            compare(&m);
        }
    }
    compare(&m);
    /* Release everything: every block ends FREE or CACHED, nothing held. */
    while (m.nheld > 0) {
        held_ref h = m.held[m.nheld - 1];
        assert_int_equal(kvd_pool_release(m.pool, h.session, h.tenant, &h.ref, 1), KV_OK);
        mblock *b = &m.b[h.ref.id];
        if (--b->refcount == 0) {
            if (b->state == KVD_BLOCK_WRITING) {
                to_free(&m, (int)h.ref.id);
            } else {
                b->state = KVD_BLOCK_CACHED;
            }
        }
        drop_held(&m, m.nheld - 1);
    }
    compare(&m);
    kvd_pool_free(m.pool);
    assert_int_equal(kvd_index_count(m.idx), 0);
    kvd_index_free(m.idx);
}

static void test_random_lru(void **state) {
    (void)state;
    run(KVD_EVICT_LRU, 0x5EED0001);
}

static void test_random_s3fifo(void **state) {
    (void)state;
    run(KVD_EVICT_S3FIFO, 0x5EED0002);
}

/* Parents are random ids here (live, free, the block's own descendants): the child counts and
 * shared marks are hints that must never break an invariant, whatever the client names. */
static void test_random_prefix_lru(void **state) {
    (void)state;
    run(KVD_EVICT_PREFIX_LRU, 0x5EED0003);
}

/* Random parents again: the leaf policy's inner list follows child counts that may be off,
 * and every invariant (a block is on the inner list exactly while it counts children) holds. */
static void test_random_adaptive(void **state) {
    (void)state;
    run(KVD_EVICT_ADAPTIVE, 0x5EED0004);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_random_lru),
        cmocka_unit_test(test_random_adaptive),
        cmocka_unit_test(test_random_s3fifo),
        cmocka_unit_test(test_random_prefix_lru),
    };
    return cmocka_run_group_tests_name("kvd_pool_random", tests, NULL, NULL);
}
