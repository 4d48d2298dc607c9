/* Tests of what the tiers use of kvd_pool: tier leases (kvd_pool_lease / kvd_pool_unlease) and the
 * drop hook, under every eviction policy. A lease keeps a block from eviction without charging a
 * tenant or counting an access; a cold unlease puts the block back by its old age; the hook hears
 * of every indexed block that leaves (evictions with their reason, quarantines) and nothing of
 * kvd_pool_free. kvd_pool_check runs after every step. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "daemon/core/pool.h"

#define TENANT 1
#define SESSION 7

typedef struct fixture {
    kvd_index *idx;
    kvd_pool *pool;
} fixture;

static kv_hash128 H(uint64_t k) {
    kv_hash128 h = {k * 0x9E3779B97F4A7C15ull + 7, k};
    return h;
}

static const kv_hash128 ZERO = {0, 0};

#define CHECK_POOL(p) assert_int_equal(kvd_pool_check(p), KV_OK)

static kvd_pool *make_pool(fixture *f, uint32_t bps, uint32_t max_segments,
                           kvd_evict_policy policy) {
    kvd_pool_config cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.pool_id = 1;
    assert_int_equal(kv_layout_init(2, 2, 8, 16, KV_DTYPE_FP16, KV_LAYER_MAJOR, &cfg.layout),
                     KV_OK);
    cfg.blocks_per_segment = bps;
    cfg.max_segments = max_segments;
    cfg.policy = policy;
    assert_int_equal(kvd_index_alloc(4096, &f->idx), KV_OK);
    assert_int_equal(kvd_pool_alloc(&cfg, f->idx, &kvd_backend_malloc, NULL, &f->pool), KV_OK);
    CHECK_POOL(f->pool);
    return f->pool;
}

static void drop(fixture *f) {
    CHECK_POOL(f->pool);
    kvd_pool_free(f->pool);
    assert_int_equal(kvd_index_count(f->idx), 0);
    kvd_index_free(f->idx);
}

static kvd_block_info info_of(kvd_pool *p, uint32_t id) {
    kvd_block_info info;
    assert_int_equal(kvd_pool_block_info(p, id, &info), KV_OK);
    return info;
}

static kvd_block_state state_of(kvd_pool *p, uint32_t id) {
    return info_of(p, id).state;
}

/* Commits block `key` (hash H(key)) under parent id, held by SESSION for TENANT. */
static kvd_block_ref commit_one(kvd_pool *p, uint64_t key, uint32_t parent) {
    kvd_block_ref r, c;
    assert_int_equal(kvd_pool_allocate(p, 1, SESSION, TENANT, &r), KV_OK);
    assert_int_equal(kvd_pool_commit(p, SESSION, r, H(key), parent, &c), KV_OK);
    assert_int_equal(c.id, r.id);
    CHECK_POOL(p);
    return c;
}

/* A CACHED block `key`: committed and released. */
static kvd_block_ref cached_one(kvd_pool *p, uint64_t key, uint32_t parent) {
    kvd_block_ref r = commit_one(p, key, parent);
    assert_int_equal(kvd_pool_release(p, SESSION, TENANT, &r, 1), KV_OK);
    assert_int_equal(state_of(p, r.id), KVD_BLOCK_CACHED);
    CHECK_POOL(p);
    return r;
}

/* A CACHED chain keys base.. base+n-1, released together (tail first). */
static void cached_chain(kvd_pool *p, uint64_t base, uint32_t n, kvd_block_ref *refs) {
    uint32_t parent = KVD_NO_BLOCK;
    for (uint32_t i = 0; i < n; i++) {
        refs[i] = commit_one(p, base + i, parent);
        parent = refs[i].id;
    }
    assert_int_equal(kvd_pool_release(p, SESSION, TENANT, refs, n), KV_OK);
    CHECK_POOL(p);
}

static size_t evict_all(kvd_pool *p, kvd_evict_reason reason) {
    size_t n = 0;
    assert_int_equal(kvd_pool_evict(p, 1000, -1, reason, 0, NULL, &n), KV_OK);
    CHECK_POOL(p);
    return n;
}

/* The eviction order as it stands (kvd_pool_evict's dry run). */
static size_t evict_order(kvd_pool *p, kvd_block_ref *out, size_t max) {
    size_t n = 0;
    assert_int_equal(kvd_pool_evict(p, max, -1, KVD_EVICT_ADMIN, 1, out, &n), KV_OK);
    CHECK_POOL(p);
    return n;
}

static int in_order(const kvd_block_ref *order, size_t n, uint32_t id) {
    for (size_t i = 0; i < n; i++) {
        if (order[i].id == id) {
            return 1;
        }
    }
    return 0;
}

/* ---- the drop hook's recorder ---------------------------------------------------------- */

#define MAX_DROPS 64

typedef struct drops {
    kvd_pool *pool;
    int n;
    kv_hash128 hash[MAX_DROPS];
    kv_hash128 parent[MAX_DROPS];
    int reason[MAX_DROPS];
} drops;

static void on_drop(void *arg, kvd_pool *pool, kv_hash128 hash, kv_hash128 parent, int reason) {
    drops *d = arg;
    assert_ptr_equal(pool, d->pool);
    assert_true(d->n < MAX_DROPS);
    d->hash[d->n] = hash;
    d->parent[d->n] = parent;
    d->reason[d->n] = reason;
    d->n++;
}

static int dropped_before(const drops *d, int upto, kv_hash128 h) {
    for (int i = 0; i < upto; i++) {
        if (kv_hash_eq(d->hash[i], h)) {
            return 1;
        }
    }
    return 0;
}

/* Checks drops [from, d->n): each is a key of keys[] (with parent key pkeys[], or UINT64_MAX for
 * a first block) dropped once, with its parent's hash while the parent was still there (dropped
 * by no earlier call), zero otherwise, and the reason given. */
static void check_drops(const drops *d, int from, const uint64_t *keys, const uint64_t *pkeys,
                        int nkeys, int reason) {
    for (int i = from; i < d->n; i++) {
        int k = 0;
        while (k < nkeys && !kv_hash_eq(d->hash[i], H(keys[k]))) {
            k++;
        }
        assert_true(k < nkeys);
        assert_false(dropped_before(d, i, d->hash[i]));
        assert_int_equal(d->reason[i], reason);
        kv_hash128 want =
            pkeys[k] != UINT64_MAX && !dropped_before(d, i, H(pkeys[k])) ? H(pkeys[k]) : ZERO;
        assert_true(kv_hash_eq(d->parent[i], want));
    }
}

/* ---- tests, one policy each (the state is the policy) ------------------------------------- */

static kvd_evict_policy policy_of(void **state) {
    return *(const kvd_evict_policy *)*state;
}

static void test_lease_cached_unevictable(void **state) {
    fixture f;
    kvd_pool *p = make_pool(&f, 8, 1, policy_of(state));
    kvd_block_ref c[3];
    cached_chain(p, 10, 3, c);
    kvd_block_ref s = cached_one(p, 20, KVD_NO_BLOCK);
    kvd_pool_counts before = kvd_pool_counts_get(p);
    assert_int_equal(before.cached, 4);
    assert_int_equal(before.evictable, 4);
    kvd_tenant_usage u0 = kvd_pool_tenant_usage(p, TENANT);
    assert_int_equal(u0.held, 0);
    assert_int_equal(u0.cached, 4);
    uint32_t hits = info_of(p, c[1].id).hits;

    /* The middle of the chain and the single block: COMMITTED, charged to no tenant. */
    assert_int_equal(kvd_pool_lease(p, c[1]), KV_OK);
    CHECK_POOL(p);
    assert_int_equal(kvd_pool_lease(p, s), KV_OK);
    CHECK_POOL(p);
    kvd_block_info bi = info_of(p, c[1].id);
    assert_int_equal(bi.state, KVD_BLOCK_COMMITTED);
    assert_int_equal(bi.refcount, 1);
    assert_int_equal(bi.gen, c[1].gen);
    assert_int_equal(bi.hits, hits); /* a lease is no access */
    kvd_pool_counts during = kvd_pool_counts_get(p);
    assert_int_equal(during.cached, 2);
    assert_int_equal(during.evictable, 2);
    kvd_tenant_usage u1 = kvd_pool_tenant_usage(p, TENANT);
    assert_int_equal(u1.held, u0.held);
    assert_int_equal(u1.cached, 2);
    assert_int_equal(kvd_pool_tenant_usage(p, 0).held, 0);
    kvd_block_ref order[8];
    size_t n = evict_order(p, order, 8);
    assert_int_equal(n, 2);
    assert_false(in_order(order, n, c[1].id));
    assert_false(in_order(order, n, s.id));

    /* Capacity cannot take them: 8 blocks, 2 leased. */
    kvd_block_ref w[8];
    assert_int_equal(kvd_pool_allocate(p, 7, SESSION, TENANT, w), KV_ENOSPC);
    CHECK_POOL(p);
    assert_int_equal(kvd_pool_allocate(p, 6, SESSION, TENANT, w), KV_OK);
    CHECK_POOL(p);
    assert_int_equal(state_of(p, c[1].id), KVD_BLOCK_COMMITTED);
    assert_int_equal(state_of(p, s.id), KVD_BLOCK_COMMITTED);
    assert_int_equal(kvd_pool_release(p, SESSION, TENANT, w, 6), KV_OK);
    CHECK_POOL(p);
    /* Nor can an operator's eviction of everything. */
    assert_int_equal(evict_all(p, KVD_EVICT_ADMIN), 0);
    assert_int_equal(kvd_pool_check_ref(p, c[1]), KV_OK);
    assert_int_equal(kvd_pool_check_ref(p, s), KV_OK);
    assert_true(kvd_pool_has(p, H(11)));
    assert_true(kvd_pool_has(p, H(20)));
    assert_false(kvd_pool_has(p, H(10)));
    assert_false(kvd_pool_has(p, H(12)));
    assert_int_equal(kvd_pool_tenant_usage(p, TENANT).held, 0);

    /* Unleased (warm): CACHED and evictable again. */
    assert_int_equal(kvd_pool_unlease(p, c[1], 0), KV_OK);
    CHECK_POOL(p);
    assert_int_equal(state_of(p, c[1].id), KVD_BLOCK_CACHED);
    assert_int_equal(info_of(p, c[1].id).refcount, 0);
    assert_int_equal(kvd_pool_counts_get(p).evictable, 1);
    assert_int_equal(kvd_pool_tenant_usage(p, TENANT).cached, 1);
    n = evict_order(p, order, 8);
    assert_int_equal(n, 1);
    assert_int_equal(order[0].id, c[1].id);
    assert_int_equal(evict_all(p, KVD_EVICT_ADMIN), 1);
    assert_int_equal(kvd_pool_check_ref(p, c[1]), KV_ESTALE);
    assert_int_equal(kvd_pool_unlease(p, s, 1), KV_OK);
    CHECK_POOL(p);
    assert_int_equal(state_of(p, s.id), KVD_BLOCK_CACHED);
    assert_int_equal(evict_all(p, KVD_EVICT_ADMIN), 1);
    assert_int_equal(kvd_pool_counts_get(p).free, 8);
    drop(&f);
}

static void test_lease_twice(void **state) {
    fixture f;
    kvd_pool *p = make_pool(&f, 8, 1, policy_of(state));
    kvd_block_ref a = cached_one(p, 1, KVD_NO_BLOCK);
    assert_int_equal(kvd_pool_lease(p, a), KV_OK);
    CHECK_POOL(p);
    /* One lease per block: a second is refused and changes nothing. */
    assert_int_equal(kvd_pool_lease(p, a), KV_EBUSY);
    CHECK_POOL(p);
    assert_int_equal(info_of(p, a.id).refcount, 1);
    assert_int_equal(evict_all(p, KVD_EVICT_ADMIN), 0);
    assert_int_equal(kvd_pool_unlease(p, a, 0), KV_OK);
    CHECK_POOL(p);
    assert_int_equal(state_of(p, a.id), KVD_BLOCK_CACHED);
    /* A second unlease has no lease to drop. */
    assert_int_equal(kvd_pool_unlease(p, a, 0), KV_ESTATE);
    CHECK_POOL(p);
    assert_int_equal(state_of(p, a.id), KVD_BLOCK_CACHED);
    /* Another block's lease does not let this one be unleased (per-block, not a pool count). */
    kvd_block_ref b = cached_one(p, 2, KVD_NO_BLOCK);
    assert_int_equal(kvd_pool_lease(p, b), KV_OK);
    assert_int_equal(kvd_pool_hold(p, TENANT, a), KV_OK);
    assert_int_equal(kvd_pool_unlease(p, a, 0), KV_ESTATE);
    CHECK_POOL(p);
    assert_int_equal(kvd_pool_unlease(p, b, 0), KV_OK);
    assert_int_equal(kvd_pool_release(p, SESSION, TENANT, &a, 1), KV_OK);
    CHECK_POOL(p);
    drop(&f);
}

/* A (oldest), B, C released at increasing pool times; A and B leased (a copy ahead of eviction)
 * and given back cold, in the order `b_first`: the eviction order is still A, B, C. */
static void cold_order(kvd_evict_policy policy, int b_first) {
    fixture f;
    kvd_pool *p = make_pool(&f, 8, 1, policy);
    kvd_pool_set_now(p, 10);
    kvd_block_ref a = cached_one(p, 1, KVD_NO_BLOCK);
    kvd_pool_set_now(p, 20);
    kvd_block_ref b = cached_one(p, 2, KVD_NO_BLOCK);
    kvd_pool_set_now(p, 30);
    kvd_block_ref c = cached_one(p, 3, KVD_NO_BLOCK);
    kvd_block_ref order[8];
    assert_int_equal(evict_order(p, order, 8), 3);
    assert_int_equal(order[0].id, a.id);
    assert_int_equal(order[1].id, b.id);
    assert_int_equal(order[2].id, c.id);
    /* The clock stays at 30 (C's release) through the copy: with it moved on, a cold unlease
     * breaks kvd_pool_check (test_unlease_cold_clock_moved). A warm unlease would still make A
     * and B the newest (C, B, A), so the order below is the cold path's. */
    assert_int_equal(kvd_pool_lease(p, a), KV_OK);
    CHECK_POOL(p);
    assert_int_equal(kvd_pool_lease(p, b), KV_OK);
    CHECK_POOL(p);
    assert_int_equal(evict_order(p, order, 8), 1);
    assert_int_equal(order[0].id, c.id);
    kvd_block_ref first = b_first ? b : a, second = b_first ? a : b;
    assert_int_equal(kvd_pool_unlease(p, first, 1), KV_OK);
    CHECK_POOL(p);
    assert_int_equal(kvd_pool_unlease(p, second, 1), KV_OK);
    CHECK_POOL(p);
    assert_int_equal(state_of(p, a.id), KVD_BLOCK_CACHED);
    assert_int_equal(state_of(p, b.id), KVD_BLOCK_CACHED);
    assert_int_equal(evict_order(p, order, 8), 3);
    assert_int_equal(order[0].id, a.id);
    assert_int_equal(order[1].id, b.id);
    assert_int_equal(order[2].id, c.id);
    /* And eviction itself takes them so. */
    kvd_block_ref w;
    for (int k = 0; k < 8 - 3; k++) {
        assert_int_equal(kvd_pool_allocate(p, 1, SESSION, TENANT, &w), KV_OK);
    }
    CHECK_POOL(p);
    assert_int_equal(kvd_pool_allocate(p, 1, SESSION, TENANT, &w), KV_OK);
    CHECK_POOL(p);
    assert_int_equal(w.id, a.id);
    assert_int_equal(kvd_pool_check_ref(p, b), KV_OK);
    assert_int_equal(kvd_pool_allocate(p, 1, SESSION, TENANT, &w), KV_OK);
    CHECK_POOL(p);
    assert_int_equal(w.id, b.id);
    assert_int_equal(kvd_pool_check_ref(p, c), KV_OK);
    drop(&f);
}

static void test_unlease_cold_keeps_age(void **state) {
    cold_order(policy_of(state), 1);
    cold_order(policy_of(state), 0);
}

/* A cold unlease after the clock moved: the block goes back to its old age, and nothing may
 * say that its segment was used now (a tier copy is no access; kvd_pool_check compares). */
static void test_unlease_cold_clock_moved(void **state) {
    fixture f;
    kvd_pool *p = make_pool(&f, 8, 1, policy_of(state));
    kvd_pool_set_now(p, 10);
    kvd_block_ref a = cached_one(p, 1, KVD_NO_BLOCK);
    kvd_pool_set_now(p, 20);
    assert_int_equal(kvd_pool_lease(p, a), KV_OK);
    CHECK_POOL(p);
    kvd_pool_set_now(p, 50);
    assert_int_equal(kvd_pool_unlease(p, a, 1), KV_OK);
    CHECK_POOL(p);
    assert_int_equal(state_of(p, a.id), KVD_BLOCK_CACHED);
    drop(&f);
}

/* Warm, the same unleases make A and B the newest: C goes first. */
/* A chain released together shares one age and is evicted tail first; leasing all of it and
 * unleasing cold in any order keeps that order (a child before its parents). */
static void test_unlease_cold_chain_order(void **state) {
    static const int orders[6][3] = {{0, 1, 2}, {0, 2, 1}, {1, 0, 2},
                                     {1, 2, 0}, {2, 0, 1}, {2, 1, 0}};
    for (int o = 0; o < 6; o++) {
        fixture f;
        kvd_pool *p = make_pool(&f, 8, 1, policy_of(state));
        kvd_pool_set_now(p, 10);
        kvd_block_ref c[3];
        cached_chain(p, 100, 3, c);
        kvd_block_ref before[8], after[8];
        size_t nb = evict_order(p, before, 8);
        for (int i = 0; i < 3; i++) {
            assert_int_equal(kvd_pool_lease(p, c[i]), KV_OK);
        }
        kvd_pool_set_now(p, 40);
        for (int i = 0; i < 3; i++) {
            assert_int_equal(kvd_pool_unlease(p, c[orders[o][i]], 1), KV_OK);
            CHECK_POOL(p);
        }
        size_t na = evict_order(p, after, 8);
        assert_int_equal(na, nb);
        for (size_t i = 0; i < na; i++) {
            assert_int_equal(after[i].id, before[i].id);
        }
        drop(&f);
    }
}

static void test_unlease_warm_is_newest(void **state) {
    fixture f;
    kvd_pool *p = make_pool(&f, 8, 1, policy_of(state));
    kvd_pool_set_now(p, 10);
    kvd_block_ref a = cached_one(p, 1, KVD_NO_BLOCK);
    kvd_pool_set_now(p, 20);
    kvd_block_ref b = cached_one(p, 2, KVD_NO_BLOCK);
    kvd_pool_set_now(p, 30);
    kvd_block_ref c = cached_one(p, 3, KVD_NO_BLOCK);
    kvd_pool_set_now(p, 40);
    assert_int_equal(kvd_pool_lease(p, a), KV_OK);
    assert_int_equal(kvd_pool_lease(p, b), KV_OK);
    CHECK_POOL(p);
    kvd_pool_set_now(p, 50);
    assert_int_equal(kvd_pool_unlease(p, b, 0), KV_OK);
    CHECK_POOL(p);
    assert_int_equal(kvd_pool_unlease(p, a, 0), KV_OK);
    CHECK_POOL(p);
    kvd_block_ref order[8];
    assert_int_equal(evict_order(p, order, 8), 3);
    assert_int_equal(order[0].id, c.id);
    assert_int_equal(order[1].id, b.id);
    assert_int_equal(order[2].id, a.id);
    drop(&f);
}

static void test_lease_errors(void **state) {
    fixture f;
    kvd_pool *p = make_pool(&f, 8, 1, policy_of(state));
    kvd_block_ref cached = cached_one(p, 1, KVD_NO_BLOCK);
    kvd_block_ref held = commit_one(p, 2, KVD_NO_BLOCK);
    kvd_block_ref writing;
    assert_int_equal(kvd_pool_allocate(p, 1, SESSION, TENANT, &writing), KV_OK);
    CHECK_POOL(p);
    /* A FREE block, with its current generation. */
    uint32_t free_id = 7;
    assert_int_equal(state_of(p, free_id), KVD_BLOCK_FREE);
    kvd_block_ref fr = {free_id, info_of(p, free_id).gen};
    assert_int_equal(kvd_pool_lease(p, fr), KV_ESTATE);
    CHECK_POOL(p);
    assert_int_equal(kvd_pool_unlease(p, fr, 0), KV_ESTATE);
    CHECK_POOL(p);
    assert_int_equal(state_of(p, free_id), KVD_BLOCK_FREE);
    /* WRITING. */
    assert_int_equal(kvd_pool_lease(p, writing), KV_ESTATE);
    CHECK_POOL(p);
    assert_int_equal(kvd_pool_unlease(p, writing, 1), KV_ESTATE);
    CHECK_POOL(p);
    assert_int_equal(state_of(p, writing.id), KVD_BLOCK_WRITING);
    assert_int_equal(info_of(p, writing.id).refcount, 1);
    /* Unlease without a lease: CACHED, and COMMITTED held only by a session. */
    assert_int_equal(kvd_pool_unlease(p, cached, 0), KV_ESTATE);
    CHECK_POOL(p);
    assert_int_equal(state_of(p, cached.id), KVD_BLOCK_CACHED);
    assert_int_equal(kvd_pool_unlease(p, held, 0), KV_ESTATE);
    CHECK_POOL(p);
    assert_int_equal(state_of(p, held.id), KVD_BLOCK_COMMITTED);
    assert_int_equal(info_of(p, held.id).refcount, 1);
    assert_int_equal(kvd_pool_tenant_usage(p, TENANT).held, 2);
    /* Bad ids. */
    kvd_block_ref far = {8 * 100, 0};
    assert_int_equal(kvd_pool_lease(p, far), KV_ENOENT);
    assert_int_equal(kvd_pool_unlease(p, far, 0), KV_ENOENT);
    /* A quarantined block (COMMITTED, still held): no lease. */
    assert_int_equal(kvd_pool_quarantine(p, held), KV_OK);
    CHECK_POOL(p);
    assert_int_equal(kvd_pool_lease(p, held), KV_ESTATE);
    CHECK_POOL(p);
    assert_int_equal(info_of(p, held.id).refcount, 1);
    assert_int_equal(kvd_pool_release(p, SESSION, TENANT, &held, 1), KV_OK);
    CHECK_POOL(p);
    assert_int_equal(state_of(p, held.id), KVD_BLOCK_FREE);
    /* Stale generation: the block was evicted (and its record reused) since. */
    assert_int_equal(evict_all(p, KVD_EVICT_ADMIN), 1);
    assert_int_equal(kvd_pool_lease(p, cached), KV_ESTALE);
    assert_int_equal(kvd_pool_unlease(p, cached, 0), KV_ESTALE);
    assert_int_equal(kvd_pool_lease(p, held), KV_ESTALE);
    kvd_block_ref again = cached_one(p, 1, KVD_NO_BLOCK);
    if (again.id == cached.id) {
        assert_int_not_equal(again.gen, cached.gen);
    }
    assert_int_equal(kvd_pool_lease(p, cached), KV_ESTALE);
    CHECK_POOL(p);
    /* A lease from before an eviction cannot be given back on the new block either. */
    assert_int_equal(kvd_pool_lease(p, again), KV_OK);
    CHECK_POOL(p);
    kvd_block_ref stale = {again.id, again.gen - 1};
    assert_int_equal(kvd_pool_unlease(p, stale, 0), KV_ESTALE);
    CHECK_POOL(p);
    assert_int_equal(kvd_pool_unlease(p, again, 0), KV_OK);
    CHECK_POOL(p);
    assert_int_equal(kvd_pool_release(p, SESSION, TENANT, &writing, 1), KV_OK);
    drop(&f);
}

static void test_lease_committed_held(void **state) {
    fixture f;
    kvd_pool *p = make_pool(&f, 8, 1, policy_of(state));
    kvd_block_ref a = commit_one(p, 1, KVD_NO_BLOCK);
    assert_int_equal(kvd_pool_tenant_usage(p, TENANT).held, 1);
    assert_int_equal(kvd_pool_lease(p, a), KV_OK);
    CHECK_POOL(p);
    assert_int_equal(info_of(p, a.id).refcount, 2);
    assert_int_equal(kvd_pool_tenant_usage(p, TENANT).held, 1);
    /* The session lets go: the lease's reference keeps it COMMITTED. */
    assert_int_equal(kvd_pool_release(p, SESSION, TENANT, &a, 1), KV_OK);
    CHECK_POOL(p);
    assert_int_equal(state_of(p, a.id), KVD_BLOCK_COMMITTED);
    assert_int_equal(info_of(p, a.id).refcount, 1);
    assert_int_equal(kvd_pool_tenant_usage(p, TENANT).held, 0);
    assert_int_equal(kvd_pool_tenant_usage(p, TENANT).cached, 0);
    assert_int_equal(kvd_pool_counts_get(p).evictable, 0);
    assert_int_equal(evict_all(p, KVD_EVICT_ADMIN), 0);
    assert_int_equal(kvd_pool_unlease(p, a, 0), KV_OK);
    CHECK_POOL(p);
    assert_int_equal(state_of(p, a.id), KVD_BLOCK_CACHED);
    assert_int_equal(kvd_pool_tenant_usage(p, TENANT).cached, 1);
    assert_int_equal(kvd_pool_counts_get(p).evictable, 1);

    /* The other way round: the lease goes first, the session's release makes it CACHED. */
    kvd_block_ref b = commit_one(p, 2, KVD_NO_BLOCK);
    assert_int_equal(kvd_pool_lease(p, b), KV_OK);
    CHECK_POOL(p);
    assert_int_equal(kvd_pool_unlease(p, b, 1), KV_OK);
    CHECK_POOL(p);
    assert_int_equal(state_of(p, b.id), KVD_BLOCK_COMMITTED);
    assert_int_equal(info_of(p, b.id).refcount, 1);
    assert_int_equal(kvd_pool_tenant_usage(p, TENANT).held, 1);
    assert_int_equal(kvd_pool_release(p, SESSION, TENANT, &b, 1), KV_OK);
    CHECK_POOL(p);
    assert_int_equal(state_of(p, b.id), KVD_BLOCK_CACHED);
    assert_int_equal(kvd_pool_tenant_usage(p, TENANT).held, 0);

    /* A session's reference on a leased CACHED block (a lookup during the copy). */
    assert_int_equal(kvd_pool_lease(p, a), KV_OK);
    CHECK_POOL(p);
    kv_hash128 q = H(1);
    kvd_block_ref got;
    size_t nhit = 0;
    assert_int_equal(kvd_pool_lookup(p, TENANT, &q, 1, &got, &nhit), KV_OK);
    assert_int_equal(nhit, 1);
    assert_int_equal(got.id, a.id);
    CHECK_POOL(p);
    assert_int_equal(info_of(p, a.id).refcount, 2);
    assert_int_equal(kvd_pool_tenant_usage(p, TENANT).held, 1);
    assert_int_equal(kvd_pool_unlease(p, a, 1), KV_OK);
    CHECK_POOL(p);
    assert_int_equal(state_of(p, a.id), KVD_BLOCK_COMMITTED);
    assert_int_equal(kvd_pool_release(p, SESSION, TENANT, &got, 1), KV_OK);
    CHECK_POOL(p);
    assert_int_equal(state_of(p, a.id), KVD_BLOCK_CACHED);
    drop(&f);
}

static void test_lease_pinned(void **state) {
    fixture f;
    kvd_pool *p = make_pool(&f, 8, 1, policy_of(state));
    kvd_block_ref a = cached_one(p, 1, KVD_NO_BLOCK);
    assert_int_equal(kvd_pool_pin(p, a, 1000, 1, KVD_PIN_OWNER), KV_OK);
    CHECK_POOL(p);
    assert_int_equal(kvd_pool_lease(p, a), KV_OK);
    CHECK_POOL(p);
    assert_int_equal(state_of(p, a.id), KVD_BLOCK_COMMITTED);
    assert_true(info_of(p, a.id).pinned);
    assert_int_equal(kvd_pool_counts_get(p).pinned, 1);
    assert_int_equal(kvd_pool_unlease(p, a, 1), KV_OK);
    CHECK_POOL(p);
    assert_int_equal(state_of(p, a.id), KVD_BLOCK_CACHED);
    assert_true(info_of(p, a.id).pinned);
    assert_int_equal(kvd_pool_counts_get(p).evictable, 0);
    assert_int_equal(evict_all(p, KVD_EVICT_ADMIN), 0);
    /* The pin expires while leased: back in the eviction order at the unlease. */
    assert_int_equal(kvd_pool_lease(p, a), KV_OK);
    CHECK_POOL(p);
    kvd_pool_set_now(p, 2000);
    CHECK_POOL(p);
    assert_false(info_of(p, a.id).pinned);
    /* Warm: a cold unlease with the clock moved fails kvd_pool_check today
     * (test_unlease_cold_clock_moved). */
    assert_int_equal(kvd_pool_unlease(p, a, 0), KV_OK);
    CHECK_POOL(p);
    assert_int_equal(kvd_pool_counts_get(p).evictable, 1);
    assert_int_equal(evict_all(p, KVD_EVICT_ADMIN), 1);
    drop(&f);
}

static void test_drop_hook_evictions(void **state) {
    fixture f;
    kvd_pool *p = make_pool(&f, 8, 1, policy_of(state));
    drops d;
    memset(&d, 0, sizeof(d));
    d.pool = p;
    kvd_pool_set_drop_hook(p, KVD_DROP_HOOK_TIERS, on_drop, &d);
    /* A chain 100 <- 101 <- 102 and five first blocks: the pool is full. */
    const uint64_t keys[8] = {100, 101, 102, 200, 201, 202, 203, 204};
    const uint64_t pkeys[8] = {UINT64_MAX, 100,        101,        UINT64_MAX,
                               UINT64_MAX, UINT64_MAX, UINT64_MAX, UINT64_MAX};
    kvd_block_ref c[3];
    cached_chain(p, 100, 3, c);
    for (uint64_t k = 200; k < 205; k++) {
        (void)cached_one(p, k, KVD_NO_BLOCK);
    }
    assert_int_equal(kvd_pool_counts_get(p).free, 0);
    assert_int_equal(d.n, 0); /* commits and releases drop nothing */
    /* A dry run drops nothing. */
    kvd_block_ref order[8];
    assert_int_equal(evict_order(p, order, 8), 8);
    assert_int_equal(d.n, 0);
    /* Capacity: an allocation of two evicts two, each told once. */
    kvd_block_ref w[2];
    assert_int_equal(kvd_pool_allocate(p, 2, SESSION, TENANT, w), KV_OK);
    CHECK_POOL(p);
    assert_int_equal(d.n, 2);
    assert_int_equal(kvd_pool_evictions(p, KVD_EVICT_CAPACITY), 2);
    check_drops(&d, 0, keys, pkeys, 8, KVD_EVICT_CAPACITY);
    for (int i = 0; i < d.n; i++) {
        assert_false(kvd_pool_has(p, d.hash[i]));
    }
    assert_int_equal(kvd_pool_release(p, SESSION, TENANT, w, 2), KV_OK);
    CHECK_POOL(p);
    assert_int_equal(d.n, 2); /* WRITING blocks freed are not indexed: nothing to tell */
    /* A leased block is not evicted, so not told of. */
    int leased = -1;
    for (int k = 0; k < 8 && leased < 0; k++) {
        if (kvd_pool_has(p, H(keys[k]))) {
            leased = k;
        }
    }
    assert_true(leased >= 0);
    kvd_block_ref lr;
    assert_int_equal(kvd_pool_hold_hash(p, TENANT, H(keys[leased]), &lr), KV_OK);
    assert_int_equal(kvd_pool_lease(p, lr), KV_OK);
    assert_int_equal(kvd_pool_release(p, SESSION, TENANT, &lr, 1), KV_OK);
    CHECK_POOL(p);
    /* An operator's eviction: the other five, reason ADMIN. */
    assert_int_equal(evict_all(p, KVD_EVICT_ADMIN), 5);
    assert_int_equal(d.n, 7);
    assert_int_equal(kvd_pool_evictions(p, KVD_EVICT_ADMIN), 5);
    check_drops(&d, 2, keys, pkeys, 8, KVD_EVICT_ADMIN);
    assert_false(dropped_before(&d, d.n, H(keys[leased])));
    assert_int_equal(kvd_pool_unlease(p, lr, 1), KV_OK);
    CHECK_POOL(p);
    assert_int_equal(d.n, 7);
    assert_int_equal(evict_all(p, KVD_EVICT_ADMIN), 1);
    assert_int_equal(d.n, 8);
    check_drops(&d, 7, keys, pkeys, 8, KVD_EVICT_ADMIN);
    /* Every block told of exactly once. */
    for (int k = 0; k < 8; k++) {
        int seen = 0;
        for (int i = 0; i < d.n; i++) {
            seen += kv_hash_eq(d.hash[i], H(keys[k]));
        }
        assert_int_equal(seen, 1);
    }
    assert_int_equal(kvd_pool_evictions(p, KVD_EVICT_SHRINK), 0);
    drop(&f);
}

/* The parent's hash exactly: the chain evicted tail first names the parents still there. */
static void test_drop_hook_parent(void **state) {
    fixture f;
    kvd_pool *p = make_pool(&f, 8, 1, policy_of(state));
    drops d;
    memset(&d, 0, sizeof(d));
    d.pool = p;
    kvd_pool_set_drop_hook(p, KVD_DROP_HOOK_TIERS, on_drop, &d);
    kvd_block_ref c[3];
    cached_chain(p, 1, 3, c);
    /* The tail goes alone first (the tenant-filtered walk takes the eviction order as it
     * stands; one block of it). */
    size_t n = 0;
    assert_int_equal(kvd_pool_evict(p, 1, TENANT, KVD_EVICT_ADMIN, 0, NULL, &n), KV_OK);
    CHECK_POOL(p);
    assert_int_equal(n, 1);
    assert_int_equal(d.n, 1);
    assert_true(kv_hash_eq(d.hash[0], H(3)));
    assert_true(kv_hash_eq(d.parent[0], H(2)));
    assert_int_equal(d.reason[0], KVD_EVICT_ADMIN);
    assert_int_equal(evict_all(p, KVD_EVICT_ADMIN), 2);
    assert_int_equal(d.n, 3);
    assert_true(kv_hash_eq(d.hash[1], H(2)));
    assert_true(kv_hash_eq(d.parent[1], H(1)));
    assert_true(kv_hash_eq(d.hash[2], H(1)));
    assert_true(kv_hash_eq(d.parent[2], ZERO));
    /* No hook: evictions go on, nobody told. */
    kvd_pool_set_drop_hook(p, KVD_DROP_HOOK_TIERS, NULL, NULL);
    (void)cached_one(p, 9, KVD_NO_BLOCK);
    assert_int_equal(evict_all(p, KVD_EVICT_ADMIN), 1);
    assert_int_equal(d.n, 3);
    drop(&f);
}

static void test_drop_hook_shrink(void **state) {
    fixture f;
    kvd_pool *p = make_pool(&f, 4, 2, policy_of(state));
    drops d;
    memset(&d, 0, sizeof(d));
    d.pool = p;
    kvd_pool_set_drop_hook(p, KVD_DROP_HOOK_TIERS, on_drop, &d);
    kvd_block_ref w[4];
    assert_int_equal(kvd_pool_allocate(p, 4, SESSION, TENANT, w), KV_OK); /* segment 0 */
    CHECK_POOL(p);
    const uint64_t keys[4] = {1, 2, 3, 4};
    const uint64_t pkeys[4] = {UINT64_MAX, UINT64_MAX, UINT64_MAX, UINT64_MAX};
    for (int k = 0; k < 4; k++) {
        kvd_block_ref r = cached_one(p, keys[k], KVD_NO_BLOCK);
        assert_int_equal(r.id / 4, 1); /* segment 1 */
    }
    uint32_t seg = 0;
    assert_int_equal(kvd_pool_shrink(p, &seg), KV_OK);
    CHECK_POOL(p);
    assert_int_equal(seg, 1);
    assert_int_equal(d.n, 4);
    check_drops(&d, 0, keys, pkeys, 4, KVD_EVICT_SHRINK);
    assert_int_equal(kvd_pool_evictions(p, KVD_EVICT_SHRINK), 4);
    assert_int_equal(kvd_pool_release(p, SESSION, TENANT, w, 4), KV_OK);
    drop(&f);
}

static void test_drop_hook_quarantine(void **state) {
    fixture f;
    kvd_pool *p = make_pool(&f, 8, 1, policy_of(state));
    drops d;
    memset(&d, 0, sizeof(d));
    d.pool = p;
    kvd_pool_set_drop_hook(p, KVD_DROP_HOOK_TIERS, on_drop, &d);
    kvd_block_ref c[2];
    cached_chain(p, 1, 2, c);
    kvd_block_ref held = commit_one(p, 5, KVD_NO_BLOCK);
    kvd_block_ref leased = cached_one(p, 6, KVD_NO_BLOCK);
    /* A CACHED block: told, then freed at once, not counted as an eviction. */
    assert_int_equal(kvd_pool_quarantine(p, c[1]), KV_OK);
    CHECK_POOL(p);
    assert_int_equal(d.n, 1);
    assert_true(kv_hash_eq(d.hash[0], H(2)));
    assert_int_equal(d.reason[0], KVD_DROP_QUARANTINE);
    assert_int_equal(state_of(p, c[1].id), KVD_BLOCK_FREE);
    assert_false(kvd_pool_has(p, H(2)));
    assert_int_equal(kvd_pool_quarantine(p, c[1]), KV_ESTALE);
    assert_int_equal(d.n, 1);
    /* A COMMITTED one: told once, again is a no-op, its last release frees it silently. */
    assert_int_equal(kvd_pool_quarantine(p, held), KV_OK);
    CHECK_POOL(p);
    assert_int_equal(d.n, 2);
    assert_true(kv_hash_eq(d.hash[1], H(5)));
    assert_int_equal(d.reason[1], KVD_DROP_QUARANTINE);
    assert_int_equal(kvd_pool_quarantine(p, held), KV_OK);
    CHECK_POOL(p);
    assert_int_equal(d.n, 2);
    assert_int_equal(kvd_pool_release(p, SESSION, TENANT, &held, 1), KV_OK);
    CHECK_POOL(p);
    assert_int_equal(state_of(p, held.id), KVD_BLOCK_FREE);
    assert_int_equal(d.n, 2);
    /* A leased one (a copy in flight): told; no new lease; the unlease frees it silently. */
    assert_int_equal(kvd_pool_lease(p, leased), KV_OK);
    CHECK_POOL(p);
    assert_int_equal(kvd_pool_quarantine(p, leased), KV_OK);
    CHECK_POOL(p);
    assert_int_equal(d.n, 3);
    assert_true(kv_hash_eq(d.hash[2], H(6)));
    assert_int_equal(d.reason[2], KVD_DROP_QUARANTINE);
    assert_int_equal(kvd_pool_lease(p, leased), KV_ESTATE);
    CHECK_POOL(p);
    assert_int_equal(kvd_pool_unlease(p, leased, 1), KV_OK);
    CHECK_POOL(p);
    assert_int_equal(state_of(p, leased.id), KVD_BLOCK_FREE);
    assert_int_equal(kvd_pool_check_ref(p, leased), KV_ESTALE);
    assert_false(kvd_pool_has(p, H(6)));
    assert_int_equal(d.n, 3);
    for (int r = 0; r < KVD_EVICT_REASONS; r++) {
        assert_int_equal(kvd_pool_evictions(p, (kvd_evict_reason)r), 0);
    }
    /* The first block is left: evicted, told as an eviction. */
    assert_int_equal(evict_all(p, KVD_EVICT_ADMIN), 1);
    assert_int_equal(d.n, 4);
    assert_true(kv_hash_eq(d.hash[3], H(1)));
    assert_int_equal(d.reason[3], KVD_EVICT_ADMIN);
    drop(&f);
}

static void test_free_tells_nothing(void **state) {
    fixture f;
    kvd_pool *p = make_pool(&f, 8, 1, policy_of(state));
    drops d;
    memset(&d, 0, sizeof(d));
    d.pool = p;
    kvd_pool_set_drop_hook(p, KVD_DROP_HOOK_TIERS, on_drop, &d);
    kvd_block_ref c[3];
    cached_chain(p, 1, 3, c);
    kvd_block_ref held = commit_one(p, 10, KVD_NO_BLOCK);
    kvd_block_ref leased = cached_one(p, 11, KVD_NO_BLOCK);
    assert_int_equal(kvd_pool_lease(p, leased), KV_OK);
    assert_int_equal(kvd_pool_lease(p, c[0]), KV_OK);
    CHECK_POOL(p);
    (void)held;
    assert_int_equal(d.n, 0);
    drop(&f); /* kvd_pool_free with cached, committed and leased blocks */
    assert_int_equal(d.n, 0);
}

/* Private blocks (Zipage) and Unshare: a private block is never committed and counts as
 * WRITING; Unshare takes a committed leaf held once out of the index (its cached parent goes
 * back to being a leaf where the policy counts children) and refuses every block another
 * reader could see; the invariants hold after each step under every policy. */
static void test_private_and_unshare(void **state) {
    fixture f;
    kvd_evict_policy pol = policy_of(state);
    kvd_pool *p = make_pool(&f, 8, 2, pol);
    kvd_block_ref w, c;
    assert_int_equal(kvd_pool_allocate(p, 1, SESSION, TENANT, &w), KV_OK);
    assert_int_equal(kvd_pool_make_private(p, SESSION + 1, w), KV_EPERM);
    assert_int_equal(kvd_pool_make_private(p, SESSION, w), KV_OK);
    assert_int_equal(kvd_pool_make_private(p, SESSION, w), KV_OK); /* again: no double count */
    assert_true(info_of(p, w.id).is_private);
    assert_int_equal(kvd_pool_commit(p, SESSION, w, H(99), KVD_NO_BLOCK, &c), KV_EPERM);
    CHECK_POOL(p);
    assert_int_equal(kvd_pool_release(p, SESSION, TENANT, &w, 1), KV_OK);
    CHECK_POOL(p);
    /* A cached parent and a held child: unshare the child. */
    kvd_block_ref parent = cached_one(p, 1, KVD_NO_BLOCK);
    kvd_block_ref child = commit_one(p, 2, parent.id);
    const char *why;
    assert_int_equal(kvd_pool_unshare_check(p, parent, &why), KV_ESTATE); /* cached */
    assert_int_equal(kvd_pool_hold(p, TENANT, child), KV_OK);
    assert_int_equal(kvd_pool_unshare(p, SESSION, TENANT, child), KV_EBUSY); /* two refs */
    assert_int_equal(kvd_pool_release(p, SESSION, TENANT, &child, 1), KV_OK);
    assert_int_equal(kvd_pool_pin(p, child, 1000, 0, TENANT), KV_OK);
    assert_int_equal(kvd_pool_unshare(p, SESSION, TENANT, child), KV_EBUSY); /* pinned */
    assert_int_equal(kvd_pool_unpin(p, child), KV_OK);
    assert_int_equal(kvd_pool_lease(p, child), KV_OK);
    assert_int_equal(kvd_pool_unshare_check(p, child, &why), KV_EBUSY); /* a copy reads it */
    assert_non_null(strstr(why, "lower tier"));
    assert_int_equal(kvd_pool_unlease(p, child, 0), KV_OK);
    CHECK_POOL(p);
    kvd_pool_set_now(p, 5000); /* the clock moved since the commit: the segment's age follows */
    assert_int_equal(kvd_pool_unshare(p, SESSION, TENANT, child), KV_OK);
    CHECK_POOL(p);
    kvd_block_info ci = info_of(p, child.id);
    assert_int_equal(ci.state, KVD_BLOCK_WRITING);
    assert_true(ci.is_private);
    assert_int_equal(ci.owner_session, SESSION);
    assert_int_equal(kvd_pool_has(p, H(2)), 0);
    assert_int_equal(kvd_pool_has(p, H(1)), 1);
    assert_int_equal(kvd_pool_commit(p, SESSION, child, H(2), parent.id, &c), KV_EPERM);
    /* The parent can be evicted like any leaf now. */
    size_t n = 0;
    assert_int_equal(kvd_pool_evict(p, 8, -1, KVD_EVICT_ADMIN, 0, NULL, &n), KV_OK);
    assert_int_equal(n, 1);
    assert_int_equal(kvd_pool_has(p, H(1)), 0);
    assert_int_equal(kvd_pool_release(p, SESSION, TENANT, &child, 1), KV_OK);
    CHECK_POOL(p);
    /* A committed parent with a committed child: refused where children are counted. */
    kvd_block_ref a = commit_one(p, 5, KVD_NO_BLOCK);
    kvd_block_ref b = commit_one(p, 6, a.id);
    kv_err want = pol == KVD_EVICT_LRU ? KV_OK : KV_EBUSY;
    assert_int_equal(kvd_pool_unshare(p, SESSION, TENANT, a), want);
    CHECK_POOL(p);
    kvd_block_ref both[2] = {a, b};
    assert_int_equal(kvd_pool_release(p, SESSION, TENANT, both, 2), KV_OK);
    drop(&f);
}

static kvd_evict_policy P_LRU = KVD_EVICT_LRU;
static kvd_evict_policy P_PLRU = KVD_EVICT_PREFIX_LRU;
static kvd_evict_policy P_S3 = KVD_EVICT_S3FIFO;
static kvd_evict_policy P_AD = KVD_EVICT_ADAPTIVE;

#define ONE(fn, tag, pol)                                                                          \
    { #fn "/" tag, fn, NULL, NULL, &pol }
#define ALL_POLICIES(fn)                                                                           \
    ONE(fn, "lru", P_LRU), ONE(fn, "prefix-lru", P_PLRU), ONE(fn, "s3fifo", P_S3),                 \
        ONE(fn, "adaptive", P_AD)

int main(void) {
    const struct CMUnitTest tests[] = {
        ALL_POLICIES(test_lease_cached_unevictable),
        ALL_POLICIES(test_lease_twice),
        ALL_POLICIES(test_unlease_cold_chain_order),
        ALL_POLICIES(test_unlease_cold_keeps_age),
        ALL_POLICIES(test_unlease_cold_clock_moved),
        ALL_POLICIES(test_unlease_warm_is_newest),
        ALL_POLICIES(test_lease_errors),
        ALL_POLICIES(test_lease_committed_held),
        ALL_POLICIES(test_lease_pinned),
        ALL_POLICIES(test_drop_hook_evictions),
        ALL_POLICIES(test_drop_hook_parent),
        ALL_POLICIES(test_drop_hook_shrink),
        ALL_POLICIES(test_drop_hook_quarantine),
        ALL_POLICIES(test_free_tells_nothing),
        ALL_POLICIES(test_private_and_unshare),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
