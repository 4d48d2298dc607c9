/* Tests of kvd_pool, one invariant or rule per test: lifecycle and states, generations on
 * reuse, duplicate commits, refcounts that never go negative, referenced blocks never evicted,
 * eviction order (tail of a prefix first), pins, guarantees, grow/shrink, tenant accounting. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include "daemon/core/pool.h"

typedef struct fixture {
    kvd_index *idx;
    kvd_pool *pool;
} fixture;

static kv_hash128 H(uint64_t k) {
    kv_hash128 h = {k * 0x9E3779B97F4A7C15ull + 7, k};
    return h;
}

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
    return f->pool;
}

static void drop(fixture *f) {
    assert_int_equal(kvd_pool_check(f->pool), KV_OK);
    kvd_pool_free(f->pool);
    assert_int_equal(kvd_index_count(f->idx), 0);
    kvd_index_free(f->idx);
}

static kvd_block_state state_of(kvd_pool *p, uint32_t id) {
    kvd_block_info info;
    assert_int_equal(kvd_pool_block_info(p, id, &info), KV_OK);
    return info.state;
}

static uint32_t refs_of(kvd_pool *p, uint32_t id) {
    kvd_block_info info;
    assert_int_equal(kvd_pool_block_info(p, id, &info), KV_OK);
    return info.refcount;
}

/* Allocates n blocks and commits them as a chain with keys base, base+1, ... */
static void commit_chain(kvd_pool *p, uint64_t session, uint32_t tenant, uint64_t base, uint32_t n,
                         kvd_block_ref *refs) {
    assert_int_equal(kvd_pool_allocate(p, n, session, tenant, refs), KV_OK);
    uint32_t parent = KVD_NO_BLOCK;
    for (uint32_t i = 0; i < n; i++) {
        kvd_block_ref c;
        assert_int_equal(kvd_pool_commit(p, session, refs[i], H(base + i), parent, &c), KV_OK);
        refs[i] = c;
        parent = c.id;
    }
}

static void test_lifecycle(void **state) {
    (void)state;
    fixture f;
    kvd_pool *p = make_pool(&f, 8, 2, KVD_EVICT_LRU);
    kvd_block_ref r[3];
    assert_int_equal(kvd_pool_allocate(p, 3, 100, 4, r), KV_OK);
    assert_int_equal(kvd_pool_segment_slots(p), 1);
    assert_non_null(kvd_pool_segment(p, 0));
    for (int i = 0; i < 3; i++) {
        assert_int_equal(state_of(p, r[i].id), KVD_BLOCK_WRITING);
        kvd_block_info info;
        assert_int_equal(kvd_pool_block_info(p, r[i].id, &info), KV_OK);
        assert_int_equal(info.owner_session, 100);
        assert_int_equal(info.tenant, 4);
    }
    assert_int_equal(kvd_pool_tenant_usage(p, 4).held, 3);
    kvd_block_ref c;
    assert_int_equal(kvd_pool_commit(p, 100, r[0], H(1), KVD_NO_BLOCK, &c), KV_OK);
    assert_int_equal(c.id, r[0].id);
    assert_int_equal(state_of(p, r[0].id), KVD_BLOCK_COMMITTED);
    /* Committing twice, or another session's lease, is refused. */
    assert_int_equal(kvd_pool_commit(p, 100, r[0], H(2), KVD_NO_BLOCK, &c), KV_ESTATE);
    assert_int_equal(kvd_pool_commit(p, 101, r[1], H(2), r[0].id, &c), KV_EPERM);
    assert_int_equal(kvd_pool_commit(p, 100, r[1], H(2), r[0].id, &c), KV_OK);
    /* Release: committed -> CACHED, writing -> FREE with a new generation. */
    assert_int_equal(kvd_pool_release(p, 101, 4, &r[2], 1), KV_EPERM);
    assert_int_equal(kvd_pool_release(p, 100, 4, r, 3), KV_OK);
    assert_int_equal(state_of(p, r[0].id), KVD_BLOCK_CACHED);
    assert_int_equal(state_of(p, r[1].id), KVD_BLOCK_CACHED);
    assert_int_equal(state_of(p, r[2].id), KVD_BLOCK_FREE);
    assert_int_equal(kvd_pool_check_ref(p, r[2]), KV_ESTALE);
    assert_int_equal(kvd_pool_tenant_usage(p, 4).held, 0);
    assert_int_equal(kvd_pool_tenant_usage(p, 4).cached, 2);
    /* Lookup finds the chain, takes references, counts. */
    kv_hash128 q[3] = {H(1), H(2), H(3)};
    kvd_block_ref got[3];
    size_t nhit = 99;
    assert_int_equal(kvd_pool_lookup(p, 5, q, 3, got, &nhit), KV_OK);
    assert_int_equal(nhit, 2);
    assert_int_equal(got[0].id, r[0].id);
    assert_int_equal(got[1].id, r[1].id);
    assert_int_equal(state_of(p, r[0].id), KVD_BLOCK_COMMITTED);
    assert_int_equal(refs_of(p, r[0].id), 1);
    assert_int_equal(kvd_pool_tenant_usage(p, 5).held, 2);
    assert_int_equal(kvd_pool_tenant_usage(p, 4).cached, 0);
    kvd_block_info info;
    assert_int_equal(kvd_pool_block_info(p, r[1].id, &info), KV_OK);
    assert_int_equal(info.hits, 1);
    assert_int_equal(info.parent, r[0].id);
    assert_int_equal(kvd_pool_check(p), KV_OK);
    assert_int_equal(kvd_pool_release(p, 0, 5, got, 2), KV_OK);
    assert_int_equal(kvd_pool_block_info(p, 8 * 4096, &info), KV_ENOENT);
    drop(&f);
}

static void test_generation_changes_on_reuse(void **state) {
    (void)state;
    fixture f;
    kvd_pool *p = make_pool(&f, 4, 1, KVD_EVICT_LRU);
    kvd_block_ref first[4], again[4];
    commit_chain(p, 1, 0, 10, 4, first);
    assert_int_equal(kvd_pool_release(p, 1, 0, first, 4), KV_OK);
    /* The pool is full of CACHED blocks: the next allocation evicts and reuses them. */
    assert_int_equal(kvd_pool_allocate(p, 4, 2, 0, again), KV_OK);
    for (int i = 0; i < 4; i++) {
        int found = 0;
        for (int j = 0; j < 4; j++) {
            if (again[i].id == first[j].id) {
                found = 1;
                assert_int_not_equal(again[i].gen, first[j].gen);
                assert_int_equal(kvd_pool_check_ref(p, first[j]), KV_ESTALE);
                assert_int_equal(kvd_pool_hold(p, 0, first[j]), KV_ESTALE);
            }
        }
        assert_true(found);
    }
    /* Evicted hashes are gone from the index. */
    kv_hash128 q = H(10);
    kvd_block_ref got;
    size_t nhit;
    assert_int_equal(kvd_pool_lookup(p, 0, &q, 1, &got, &nhit), KV_OK);
    assert_int_equal(nhit, 0);
    assert_int_equal(kvd_pool_release(p, 2, 0, again, 4), KV_OK);
    drop(&f);
}

static void test_duplicate_commit(void **state) {
    (void)state;
    fixture f;
    kvd_pool *p = make_pool(&f, 8, 1, KVD_EVICT_LRU);
    kvd_block_ref a, b, c;
    assert_int_equal(kvd_pool_allocate(p, 1, 1, 1, &a), KV_OK);
    assert_int_equal(kvd_pool_allocate(p, 1, 2, 2, &b), KV_OK);
    assert_int_equal(kvd_pool_commit(p, 1, a, H(42), KVD_NO_BLOCK, &c), KV_OK);
    assert_int_equal(kvd_pool_release(p, 1, 1, &c, 1), KV_OK);
    assert_int_equal(state_of(p, a.id), KVD_BLOCK_CACHED);
    /* Same hash from another worker: keeps the existing block, frees the duplicate. */
    assert_int_equal(kvd_pool_commit(p, 2, b, H(42), KVD_NO_BLOCK, &c), KV_OK);
    assert_int_equal(c.id, a.id);
    assert_int_equal(c.gen, a.gen);
    assert_int_equal(state_of(p, a.id), KVD_BLOCK_COMMITTED);
    assert_int_equal(refs_of(p, a.id), 1);
    assert_int_equal(state_of(p, b.id), KVD_BLOCK_FREE);
    assert_int_equal(kvd_pool_check_ref(p, b), KV_ESTALE);
    assert_int_equal(kvd_pool_tenant_usage(p, 2).held, 1);
    assert_int_equal(kvd_index_count(f.idx), 1); /* no block indexed twice */
    assert_int_equal(kvd_pool_check(p), KV_OK);
    assert_int_equal(kvd_pool_release(p, 2, 2, &c, 1), KV_OK);
    drop(&f);
}

static void test_refcount_never_negative(void **state) {
    (void)state;
    fixture f;
    kvd_pool *p = make_pool(&f, 8, 1, KVD_EVICT_LRU);
    kvd_block_ref r[2];
    commit_chain(p, 1, 0, 1, 2, r);
    assert_int_equal(kvd_pool_hold(p, 0, r[0]), KV_OK);
    assert_int_equal(refs_of(p, r[0].id), 2);
    /* r[1] listed twice but referenced once: refused, nothing changes. */
    kvd_block_ref twice[3] = {r[0], r[1], r[1]};
    assert_int_equal(kvd_pool_release(p, 1, 0, twice, 3), KV_ESTATE);
    assert_int_equal(refs_of(p, r[0].id), 2);
    assert_int_equal(refs_of(p, r[1].id), 1);
    assert_int_equal(kvd_pool_check(p), KV_OK);
    /* r[0] listed twice with two references is fine. */
    kvd_block_ref ok[3] = {r[0], r[1], r[0]};
    assert_int_equal(kvd_pool_release(p, 1, 0, ok, 3), KV_OK);
    assert_int_equal(state_of(p, r[0].id), KVD_BLOCK_CACHED);
    assert_int_equal(refs_of(p, r[0].id), 0);
    assert_int_equal(kvd_pool_release(p, 1, 0, r, 1), KV_EINVAL); /* tenant holds nothing */
    assert_int_equal(kvd_pool_hold(p, 3, r[0]), KV_OK);
    assert_int_equal(kvd_pool_release(p, 1, 3, r, 1), KV_OK);
    assert_int_equal(kvd_pool_hold(p, 3, r[0]), KV_OK);
    assert_int_equal(kvd_pool_release(p, 1, 3, &r[1], 1), KV_ESTATE); /* CACHED: no ref */
    assert_int_equal(kvd_pool_release(p, 1, 3, r, 1), KV_OK);
    drop(&f);
}

static void test_referenced_never_evicted(void **state) {
    (void)state;
    fixture f;
    kvd_pool *p = make_pool(&f, 4, 2, KVD_EVICT_LRU);
    kvd_block_ref r[8], x;
    commit_chain(p, 1, 0, 100, 8, r);
    /* Everything referenced: nothing to evict, allocation fails and leases nothing. */
    assert_int_equal(kvd_pool_allocate(p, 1, 2, 0, &x), KV_ENOSPC);
    assert_int_equal(kvd_pool_tenant_usage(p, 0).held, 8);
    /* Release half; hold one of them again: only the three unreferenced can go. */
    assert_int_equal(kvd_pool_release(p, 1, 0, r, 4), KV_OK);
    assert_int_equal(kvd_pool_hold(p, 0, r[1]), KV_OK);
    kvd_block_ref y[4];
    assert_int_equal(kvd_pool_allocate(p, 4, 2, 0, y), KV_ENOSPC);
    assert_int_equal(kvd_pool_allocate(p, 3, 2, 0, y), KV_OK);
    assert_int_equal(state_of(p, r[1].id), KVD_BLOCK_COMMITTED);
    assert_int_equal(kvd_pool_check_ref(p, r[1]), KV_OK);
    for (int i = 0; i < 3; i++) {
        assert_int_not_equal(y[i].id, r[1].id);
    }
    assert_int_equal(kvd_pool_release(p, 2, 0, y, 3), KV_OK);
    assert_int_equal(kvd_pool_release(p, 1, 0, &r[1], 1), KV_OK);
    assert_int_equal(kvd_pool_release(p, 1, 0, r + 4, 4), KV_OK);
    drop(&f);
}

static void test_lru_tail_first(void **state) {
    (void)state;
    fixture f;
    kvd_pool *p = make_pool(&f, 8, 1, KVD_EVICT_LRU);
    kvd_block_ref a[3], b[3];
    commit_chain(p, 1, 0, 1, 3, a);
    commit_chain(p, 1, 0, 11, 3, b);
    assert_int_equal(kvd_pool_release(p, 1, 0, a, 3), KV_OK);
    assert_int_equal(kvd_pool_release(p, 1, 0, b, 3), KV_OK);
    kvd_block_ref order[6];
    size_t n;
    assert_int_equal(kvd_pool_evict(p, 6, -1, KVD_EVICT_ADMIN, 1, order, &n), KV_OK);
    assert_int_equal(n, 6);
    uint32_t want[6] = {a[2].id, a[1].id, a[0].id, b[2].id, b[1].id, b[0].id};
    for (int i = 0; i < 6; i++) {
        assert_int_equal(order[i].id, want[i]);
    }
    assert_int_equal(state_of(p, a[2].id), KVD_BLOCK_CACHED); /* dry run changed nothing */
    /* A hit on a's first block makes it most recent. */
    kv_hash128 q = H(1);
    kvd_block_ref got;
    size_t nhit;
    assert_int_equal(kvd_pool_lookup(p, 0, &q, 1, &got, &nhit), KV_OK);
    assert_int_equal(nhit, 1);
    assert_int_equal(kvd_pool_release(p, 1, 0, &got, 1), KV_OK);
    assert_int_equal(kvd_pool_evict(p, 2, -1, KVD_EVICT_ADMIN, 0, order, &n), KV_OK);
    assert_int_equal(n, 2);
    assert_int_equal(order[0].id, a[2].id);
    assert_int_equal(order[1].id, a[1].id);
    assert_int_equal(kvd_pool_evict(p, 6, -1, KVD_EVICT_ADMIN, 1, order, &n), KV_OK);
    assert_int_equal(n, 4);
    assert_int_equal(order[3].id, a[0].id);
    drop(&f);
}

static void test_s3fifo_prefers_reused(void **state) {
    (void)state;
    fixture f;
    kvd_pool *p = make_pool(&f, 40, 1, KVD_EVICT_S3FIFO);
    kvd_block_ref hot[4], cold[36], tmp[4];
    commit_chain(p, 1, 0, 1, 4, hot);
    assert_int_equal(kvd_pool_release(p, 1, 0, hot, 4), KV_OK);
    /* Hit the hot chain once: it moves to the main queue on release. */
    kv_hash128 q[4] = {H(1), H(2), H(3), H(4)};
    size_t nhit;
    assert_int_equal(kvd_pool_lookup(p, 0, q, 4, tmp, &nhit), KV_OK);
    assert_int_equal(nhit, 4);
    assert_int_equal(kvd_pool_release(p, 1, 0, tmp, 4), KV_OK);
    commit_chain(p, 1, 0, 100, 36, cold);
    assert_int_equal(kvd_pool_release(p, 1, 0, cold, 36), KV_OK);
    /* A one-time scan of 16 new blocks: the hot chain survives (LRU would evict it first, it
     * was released before the cold blocks), the cold one-hit blocks in the small queue go. */
    kvd_block_ref scan[16];
    commit_chain(p, 2, 0, 1000, 16, scan);
    for (int i = 0; i < 4; i++) {
        assert_int_equal(kvd_pool_check_ref(p, hot[i]), KV_OK);
        assert_int_equal(state_of(p, hot[i].id), KVD_BLOCK_CACHED);
    }
    assert_int_equal(kvd_pool_release(p, 2, 0, scan, 16), KV_OK);
    drop(&f);
}

/* Commits key base..base+n-1 as the continuation of parent_ref's block (already referenced by
 * the caller): a branch off a cached prefix. */
static void commit_branch(kvd_pool *p, uint32_t parent, uint64_t base, uint32_t n,
                          kvd_block_ref *refs) {
    assert_int_equal(kvd_pool_allocate(p, n, 1, 0, refs), KV_OK);
    for (uint32_t i = 0; i < n; i++) {
        kvd_block_ref c;
        assert_int_equal(kvd_pool_commit(p, 1, refs[i], H(base + i), parent, &c), KV_OK);
        refs[i] = c;
        parent = c.id;
    }
}

/* A 4-block prefix continued two ways (branches A and B), looked up again, then 8 newer cold
 * blocks; 6 more are needed. Returns how many of the prefix blocks survive. */
static int shared_prefix_survivors(kvd_evict_policy policy) {
    fixture f;
    kvd_pool *p = make_pool(&f, 16, 1, policy);
    kvd_block_ref s[4], a[2], b[2], cold[8], got[4], scan[6];
    kv_hash128 q[4] = {H(1), H(2), H(3), H(4)};
    size_t nhit;
    commit_chain(p, 1, 0, 1, 4, s);
    commit_branch(p, s[3].id, 10, 2, a);
    assert_int_equal(kvd_pool_release(p, 1, 0, a, 2), KV_OK);
    assert_int_equal(kvd_pool_release(p, 1, 0, s, 4), KV_OK);
    assert_int_equal(kvd_pool_lookup(p, 0, q, 4, got, &nhit), KV_OK);
    assert_int_equal(nhit, 4);
    commit_branch(p, got[3].id, 20, 2, b); /* second child: the prefix is shared */
    assert_int_equal(kvd_pool_release(p, 1, 0, b, 2), KV_OK);
    assert_int_equal(kvd_pool_release(p, 1, 0, got, 4), KV_OK);
    commit_chain(p, 1, 0, 100, 8, cold);
    assert_int_equal(kvd_pool_release(p, 1, 0, cold, 8), KV_OK);
    /* The pool is full (16 CACHED); the prefix is older than the cold chain. */
    commit_chain(p, 2, 0, 1000, 6, scan);
    int alive = 0;
    for (int i = 0; i < 4; i++) {
        alive += kvd_pool_check_ref(p, s[i]) == KV_OK;
    }
    /* Branch A went first either way: it is the least recently used. */
    assert_int_equal(kvd_pool_check_ref(p, a[1]), KV_ESTALE);
    assert_int_equal(kvd_pool_release(p, 2, 0, scan, 6), KV_OK);
    drop(&f);
    return alive;
}

static void test_prefix_lru_keeps_shared_prefix(void **state) {
    (void)state;
    /* LRU takes A, B and then the prefix's tail; PREFIX_LRU gives the reused shared prefix
     * another round and takes two cold blocks instead. */
    assert_int_equal(shared_prefix_survivors(KVD_EVICT_LRU), 2);
    assert_int_equal(shared_prefix_survivors(KVD_EVICT_PREFIX_LRU), 4);
    /* ADAPTIVE gives the same round on the leaves: the prefix waits as inner blocks while its
     * branches live, then its reused shared tail gets a round past the cold chain's. */
    assert_int_equal(shared_prefix_survivors(KVD_EVICT_ADAPTIVE), 4);
}

/* ADAPTIVE: a reused shared prefix gets one round past newer cold blocks, and its shared
 * blocks spend that round together: once the tail has had it, the block above goes as soon as
 * it is the oldest leaf, not after a round of its own. */
static void test_adaptive_shared_chain_rounds(void **state) {
    (void)state;
    fixture f;
    kvd_pool *p = make_pool(&f, 16, 1, KVD_EVICT_ADAPTIVE);
    kvd_block_ref s[4], a[2], b[2], cold[8], got[4], x[6], y[4], z[4];
    kv_hash128 q[4] = {H(1), H(2), H(3), H(4)};
    size_t nhit;
    kvd_pool_set_now(p, 1);
    commit_chain(p, 1, 0, 1, 4, s);
    commit_branch(p, s[3].id, 10, 2, a);
    assert_int_equal(kvd_pool_release(p, 1, 0, a, 2), KV_OK);
    assert_int_equal(kvd_pool_release(p, 1, 0, s, 4), KV_OK);
    kvd_pool_set_now(p, 2);
    assert_int_equal(kvd_pool_lookup(p, 0, q, 4, got, &nhit), KV_OK);
    assert_int_equal(nhit, 4);
    commit_branch(p, got[3].id, 20, 2, b); /* second child: the prefix is shared */
    assert_int_equal(kvd_pool_release(p, 1, 0, b, 2), KV_OK);
    assert_int_equal(kvd_pool_release(p, 1, 0, got, 4), KV_OK);
    kvd_pool_set_now(p, 3);
    commit_chain(p, 1, 0, 100, 8, cold);
    assert_int_equal(kvd_pool_release(p, 1, 0, cold, 8), KV_OK);
    /* Full. Six go: both branches, then the prefix's tail is the oldest leaf but has a round,
     * so the cold chain's tail goes instead. */
    kvd_pool_set_now(p, 4);
    commit_chain(p, 2, 0, 1000, 6, x);
    kvd_pool_set_now(p, 5);
    assert_int_equal(kvd_pool_release(p, 2, 0, x, 6), KV_OK);
    for (int i = 0; i < 4; i++) {
        assert_int_equal(kvd_pool_check_ref(p, s[i]), KV_OK);
    }
    assert_int_equal(kvd_pool_check_ref(p, b[0]), KV_ESTALE);
    assert_int_equal(kvd_pool_check_ref(p, cold[7]), KV_ESTALE);
    assert_int_equal(kvd_pool_check_ref(p, cold[6]), KV_ESTALE);
    assert_int_equal(kvd_pool_check_ref(p, cold[5]), KV_OK);
    /* Four more: the rest of the cold chain is older than the prefix's tail (its round ran
     * from now = 4). */
    kvd_pool_set_now(p, 6);
    commit_chain(p, 2, 0, 2000, 4, y);
    assert_int_equal(kvd_pool_release(p, 2, 0, y, 4), KV_OK);
    assert_int_equal(kvd_pool_check_ref(p, cold[2]), KV_ESTALE);
    assert_int_equal(kvd_pool_check_ref(p, cold[1]), KV_OK);
    /* Four more: the cold chain's last two, then the prefix's tail (its round is spent, and
     * it is older than the chain released at 5) and the block above it, whose round was spent
     * with it (had it kept its own, it would have gone round again and taken x's tail); the
     * first two stay. */
    kvd_pool_set_now(p, 7);
    commit_chain(p, 2, 0, 3000, 4, z);
    assert_int_equal(kvd_pool_check_ref(p, cold[0]), KV_ESTALE);
    assert_int_equal(kvd_pool_check_ref(p, s[3]), KV_ESTALE);
    assert_int_equal(kvd_pool_check_ref(p, s[2]), KV_ESTALE);
    assert_int_equal(kvd_pool_check_ref(p, s[1]), KV_OK);
    assert_int_equal(kvd_pool_check_ref(p, s[0]), KV_OK);
    for (int i = 0; i < 6; i++) {
        assert_int_equal(kvd_pool_check_ref(p, x[i]), KV_OK);
    }
    assert_int_equal(kvd_pool_release(p, 2, 0, z, 4), KV_OK);
    assert_int_equal(kvd_pool_check(p), KV_OK);
    drop(&f);
}

/* Leaf order: a reused chain A (older) and a never-reused chain B (newer) compete. By age (the
 * default) A's blocks go first; with UNREUSED_FIRST B's do, and A stays. */
/* The two leaf orders; the pool's clock either moves (1..5 ms), stands still (every request in
 * the same ms, as in one turn of kvd's loop: ages are then the requests' order), or stands still
 * across a million requests in that ms (the ages carry into the next ms, never back). */
static void test_adaptive_leaf_order(void **state) {
    (void)state;
    for (int clock = 0; clock < 3; clock++) {
        for (int order = 0; order < 2; order++) {
            fixture f;
            kvd_pool *p = make_pool(&f, 8, 1, KVD_EVICT_ADAPTIVE);
            kvd_pool_set_leaf_order(p, order ? KVD_LEAF_ORDER_UNREUSED_FIRST : KVD_LEAF_ORDER_AGE);
            kvd_block_ref a[2], b[2], c[4], d[2], got[2];
            kv_hash128 q[2] = {H(1), H(2)};
            size_t nhit;
            uint64_t ms[6] = {0, 1, 2, 3, 4, 5};
            if (clock > 0) {
                for (int i = 1; i < 6; i++) {
                    ms[i] = 7;
                }
            }
            if (clock == 2) { /* A's ages just below the carry, B's and later past it */
                for (uint32_t i = 0; i < (1u << 20) - 2; i++) {
                    kvd_pool_set_now(p, 7);
                }
            }
            kvd_pool_set_now(p, ms[1]);
            commit_chain(p, 1, 0, 1, 2, a);
            assert_int_equal(kvd_pool_release(p, 1, 0, a, 2), KV_OK);
            kvd_pool_set_now(p, ms[2]);
            assert_int_equal(kvd_pool_lookup(p, 0, q, 2, got, &nhit), KV_OK); /* A is reused */
            assert_int_equal(nhit, 2);
            assert_int_equal(kvd_pool_release(p, 1, 0, got, 2), KV_OK);
            kvd_pool_set_now(p, ms[3]);
            commit_chain(p, 1, 0, 10, 2, b);
            assert_int_equal(kvd_pool_release(p, 1, 0, b, 2), KV_OK);
            kvd_pool_set_now(p, ms[4]);
            commit_chain(p, 1, 0, 20, 4, c);
            assert_int_equal(kvd_pool_release(p, 1, 0, c, 4), KV_OK);
            kvd_pool_set_now(p, ms[5]); /* full: two must go */
            commit_chain(p, 1, 0, 30, 2, d);
            kvd_block_ref *gone = order ? b : a, *kept = order ? a : b;
            for (int i = 0; i < 2; i++) {
                assert_int_equal(kvd_pool_check_ref(p, gone[i]), KV_ESTALE);
                assert_int_equal(kvd_pool_check_ref(p, kept[i]), KV_OK);
            }
            for (int i = 0; i < 4; i++) {
                assert_int_equal(kvd_pool_check_ref(p, c[i]), KV_OK);
            }
            assert_int_equal(kvd_pool_release(p, 1, 0, d, 2), KV_OK);
            assert_int_equal(kvd_pool_check(p), KV_OK);
            drop(&f);
        }
    }
}

/* A chain without branches (a conversation's own history) gets no extra rounds however often
 * it is reused: PREFIX_LRU evicts it in LRU order, tail first. */
static void test_prefix_lru_linear_chain_is_lru(void **state) {
    (void)state;
    fixture f;
    kvd_pool *p = make_pool(&f, 8, 1, KVD_EVICT_PREFIX_LRU);
    kvd_block_ref x[4], got[4], y[4], z[2];
    kv_hash128 q[4] = {H(1), H(2), H(3), H(4)};
    size_t nhit;
    commit_chain(p, 1, 0, 1, 4, x);
    assert_int_equal(kvd_pool_release(p, 1, 0, x, 4), KV_OK);
    for (int r = 0; r < 3; r++) {
        assert_int_equal(kvd_pool_lookup(p, 0, q, 4, got, &nhit), KV_OK);
        assert_int_equal(nhit, 4);
        assert_int_equal(kvd_pool_release(p, 1, 0, got, 4), KV_OK);
    }
    commit_chain(p, 1, 0, 50, 4, y);
    assert_int_equal(kvd_pool_release(p, 1, 0, y, 4), KV_OK);
    commit_chain(p, 2, 0, 90, 2, z);
    assert_int_equal(kvd_pool_check_ref(p, x[3]), KV_ESTALE);
    assert_int_equal(kvd_pool_check_ref(p, x[2]), KV_ESTALE);
    assert_int_equal(kvd_pool_check_ref(p, x[1]), KV_OK);
    assert_int_equal(kvd_pool_check_ref(p, x[0]), KV_OK);
    for (int i = 0; i < 4; i++) {
        assert_int_equal(kvd_pool_check_ref(p, y[i]), KV_OK);
    }
    assert_int_equal(kvd_pool_release(p, 2, 0, z, 2), KV_OK);
    /* Explicit eviction follows the same order, and a dry run reports it first. */
    kvd_block_ref out[2];
    size_t n = 0;
    assert_int_equal(kvd_pool_evict(p, 2, -1, KVD_EVICT_ADMIN, 1, out, &n), KV_OK);
    assert_int_equal(n, 2);
    assert_int_equal(out[0].id, x[1].id);
    assert_int_equal(out[1].id, x[0].id);
    assert_int_equal(kvd_pool_evict(p, 8, -1, KVD_EVICT_ADMIN, 0, NULL, &n), KV_OK);
    assert_int_equal(n, 8);
    drop(&f);
}

static void test_pins(void **state) {
    (void)state;
    fixture f;
    kvd_pool *p = make_pool(&f, 4, 1, KVD_EVICT_LRU);
    kvd_pool_set_now(p, 1000);
    kvd_block_ref r[4], x[4];
    commit_chain(p, 1, 7, 1, 4, r);
    assert_int_equal(kvd_pool_pin(p, r[0], 500, 1, KVD_PIN_OWNER), KV_OK);
    assert_int_equal(kvd_pool_pin(p, r[1], 5000, 9, KVD_PIN_OWNER), KV_OK);
    assert_int_equal(kvd_pool_release(p, 1, 7, r, 4), KV_OK);
    assert_int_equal(kvd_pool_tenant_usage(p, 7).pinned, 2);
    kvd_block_info info;
    assert_int_equal(kvd_pool_block_info(p, r[0].id, &info), KV_OK);
    assert_true(info.pinned);
    /* Two evictable, two pinned. */
    assert_int_equal(kvd_pool_allocate(p, 3, 2, 7, x), KV_ENOSPC);
    assert_int_equal(kvd_pool_allocate(p, 2, 2, 7, x), KV_OK);
    assert_int_equal(kvd_pool_release(p, 2, 7, x, 2), KV_OK);
    assert_int_equal(kvd_pool_allocate(p, 3, 2, 7, x), KV_ENOSPC);
    /* r[0]'s pin expires at 1500. */
    kvd_pool_set_now(p, 1500);
    assert_int_equal(kvd_pool_tenant_usage(p, 7).pinned, 1);
    assert_int_equal(kvd_pool_allocate(p, 3, 2, 7, x), KV_OK);
    assert_int_equal(kvd_pool_check_ref(p, r[0]), KV_ESTALE);
    assert_int_equal(kvd_pool_check_ref(p, r[1]), KV_OK);
    assert_int_equal(kvd_pool_release(p, 2, 7, x, 3), KV_OK);
    /* Unpinning the last pin frees its block for allocation. */
    assert_int_equal(kvd_pool_unpin(p, r[1]), KV_OK);
    assert_int_equal(kvd_pool_tenant_usage(p, 7).pinned, 0);
    assert_int_equal(kvd_pool_allocate(p, 4, 2, 7, x), KV_OK);
    assert_int_equal(kvd_pool_release(p, 2, 7, x, 4), KV_OK);
    /* Pin and unpin of a free block are state errors. */
    assert_int_equal(kvd_pool_pin(p, x[0], 10, 0, KVD_PIN_OWNER), KV_ESTALE);
    drop(&f);
}

static void test_pin_expires_while_referenced(void **state) {
    (void)state;
    fixture f;
    kvd_pool *p = make_pool(&f, 2, 1, KVD_EVICT_LRU);
    kvd_block_ref r[2], x[2];
    commit_chain(p, 1, 0, 1, 2, r);
    assert_int_equal(kvd_pool_pin(p, r[0], 100, 0, KVD_PIN_OWNER), KV_OK);
    assert_int_equal(kvd_pool_pin(p, r[1], 100, 0, KVD_PIN_OWNER), KV_OK);
    assert_int_equal(kvd_pool_unpin(p, r[1]), KV_OK);
    kvd_pool_set_now(p, 200);
    assert_int_equal(kvd_pool_release(p, 1, 0, r, 2), KV_OK);
    assert_int_equal(kvd_pool_tenant_usage(p, 0).pinned, 0);
    assert_int_equal(kvd_pool_allocate(p, 2, 1, 0, x), KV_OK);
    assert_int_equal(kvd_pool_release(p, 1, 0, x, 2), KV_OK);
    drop(&f);
}

static void test_guarantee(void **state) {
    (void)state;
    fixture f;
    kvd_pool *p = make_pool(&f, 8, 1, KVD_EVICT_LRU);
    kvd_block_ref a[4], b[4], x[4];
    commit_chain(p, 1, 1, 1, 4, a); /* tenant 1: older, would go first under LRU */
    assert_int_equal(kvd_pool_release(p, 1, 1, a, 4), KV_OK);
    commit_chain(p, 2, 2, 100, 4, b);
    assert_int_equal(kvd_pool_release(p, 2, 2, b, 4), KV_OK);
    kvd_pool_set_guarantee(p, 1, 4);
    assert_int_equal(kvd_pool_allocate(p, 3, 3, 3, x), KV_OK);
    for (int i = 0; i < 4; i++) {
        assert_int_equal(kvd_pool_check_ref(p, a[i]), KV_OK);
    }
    assert_int_equal(kvd_pool_tenant_usage(p, 2).cached, 1);
    assert_int_equal(kvd_pool_release(p, 3, 3, x, 3), KV_OK);
    /* With nothing else evictable the guarantee yields. */
    kvd_block_ref y[5];
    assert_int_equal(kvd_pool_allocate(p, 5, 3, 3, y), KV_OK);
    assert_int_equal(kvd_pool_tenant_usage(p, 1).cached, 3);
    assert_int_equal(kvd_pool_release(p, 3, 3, y, 5), KV_OK);
    /* Admin eviction of one tenant takes only its blocks. */
    commit_chain(p, 1, 1, 1000, 2, a);
    assert_int_equal(kvd_pool_release(p, 1, 1, a, 2), KV_OK);
    uint64_t c1 = kvd_pool_tenant_usage(p, 1).cached;
    size_t n;
    assert_int_equal(kvd_pool_evict(p, 100, 1, KVD_EVICT_ADMIN, 0, NULL, &n), KV_OK);
    assert_int_equal(n, c1);
    assert_int_equal(kvd_pool_tenant_usage(p, 1).cached, 0);
    kvd_pool_set_guarantee(p, 1, 0);
    drop(&f);
}

/* Guaranteed shares hold under every policy: a tenant with guarantee 5 keeps at least 5 cached
 * blocks however long another tenant floods the pool, while unprotected blocks exist. S3-FIFO
 * once rotated the protected head of one queue and spent its skip budget on both queues, then
 * evicted a protected block although the other queue held unprotected ones (kept 2 or 3). */
static void test_guarantee_every_policy(void **state) {
    (void)state;
    const kvd_evict_policy pols[] = {KVD_EVICT_LRU, KVD_EVICT_S3FIFO, KVD_EVICT_PREFIX_LRU,
                                     KVD_EVICT_ADAPTIVE};
    for (int k = 0; k < 4; k++) {
        fixture f;
        kvd_pool *p = make_pool(&f, 8, 4, pols[k]); /* 32 blocks */
        kvd_pool_set_guarantee(p, 1, 5);
        kvd_block_ref r[8];
        commit_chain(p, 1, 1, 1000, 8, r);
        assert_int_equal(kvd_pool_release(p, 1, 1, r, 8), KV_OK);
        for (uint64_t round = 0; round < 200; round++) {
            kvd_block_ref x[6];
            commit_chain(p, 2, 2, 10000 + round * 16, 6, x);
            /* Hit some of the flood again so S3-FIFO moves blocks to its main queue. */
            if (round % 3 == 0) {
                kvd_block_ref h[2];
                size_t nh = 0;
                kv_hash128 hs[2] = {H(10000 + round * 16), H(10000 + round * 16 + 1)};
                assert_int_equal(kvd_pool_release(p, 2, 2, x, 6), KV_OK);
                assert_int_equal(kvd_pool_lookup(p, 2, hs, 2, h, &nh), KV_OK);
                assert_int_equal(kvd_pool_release(p, 2, 2, h, nh), KV_OK);
            } else {
                assert_int_equal(kvd_pool_release(p, 2, 2, x, 6), KV_OK);
            }
            if (kvd_pool_tenant_usage(p, 1).cached < 5) {
                fail_msg("policy %d, round %llu: tenant 1 keeps %llu cached blocks, guarantee 5",
                         (int)pols[k], (unsigned long long)round,
                         (unsigned long long)kvd_pool_tenant_usage(p, 1).cached);
            }
            assert_int_equal(kvd_pool_check(p), KV_OK);
        }
        /* The guarantee ends: the blocks it kept (set aside) are the oldest and go first. */
        kvd_pool_set_guarantee(p, 1, 0);
        assert_int_equal(kvd_pool_check(p), KV_OK);
        for (uint64_t round = 0; round < 8; round++) {
            kvd_block_ref x[6];
            kvd_pool_set_now(p, 1000 + round); /* ADAPTIVE compares ages */
            commit_chain(p, 2, 2, 50000 + round * 16, 6, x);
            assert_int_equal(kvd_pool_release(p, 2, 2, x, 6), KV_OK);
            assert_int_equal(kvd_pool_check(p), KV_OK);
        }
        /* (S3-FIFO keeps a block in its main queue while the small one holds 10%.) */
        if (pols[k] != KVD_EVICT_S3FIFO && kvd_pool_tenant_usage(p, 1).cached != 0) {
            fail_msg("policy %d: tenant 1 keeps %llu cached blocks without a guarantee",
                     (int)pols[k], (unsigned long long)kvd_pool_tenant_usage(p, 1).cached);
        }
        drop(&f);
    }
}

/* A protected block is skipped once, not at every pick: the other tenant's one cached block is
 * the victim of each single-block Allocate (the pick rotated the 4 protected blocks past the
 * head every time, O(protected) per block), and the skipped blocks keep their order: once
 * their tenant is over its share its oldest goes first, and when the guarantee ends they are
 * the head of the order again. */
static void test_guarantee_skips_once(void **state) {
    (void)state;
    const kvd_evict_policy pols[] = {KVD_EVICT_LRU, KVD_EVICT_PREFIX_LRU};
    for (int k = 0; k < 2; k++) {
        fixture f;
        kvd_pool *p = make_pool(&f, 8, 4, pols[k]); /* 32 blocks */
        kvd_block_ref a[4], rest[27], u, prev = {KVD_NO_BLOCK, 0};
        commit_chain(p, 1, 1, 1, 4, a); /* enters tail first: a[3] is the oldest */
        assert_int_equal(kvd_pool_release(p, 1, 1, a, 4), KV_OK);
        kvd_pool_set_guarantee(p, 1, 4);
        assert_int_equal(kvd_pool_allocate(p, 27, 3, 3, rest), KV_OK); /* one block left */
        for (uint64_t i = 0; i < 20; i++) {
            commit_chain(p, 2, 2, 100 + i, 1, &u);
            assert_int_equal(kvd_pool_release(p, 2, 2, &u, 1), KV_OK);
            if (prev.id != KVD_NO_BLOCK) {
                assert_int_equal(kvd_pool_check_ref(p, prev), KV_ESTALE); /* the victim */
            }
            for (int j = 0; j < 4; j++) {
                assert_int_equal(kvd_pool_check_ref(p, a[j]), KV_OK);
            }
            assert_int_equal(kvd_pool_check(p), KV_OK);
            prev = u;
        }
        /* Tenant 1 over its share (5 > 4): its oldest block, a[3], goes before its newer ones
         * and before tenant 2's. */
        kvd_block_ref a5;
        commit_chain(p, 1, 1, 50, 1, &a5); /* evicts tenant 2's block */
        assert_int_equal(kvd_pool_release(p, 1, 1, &a5, 1), KV_OK);
        assert_int_equal(kvd_pool_check_ref(p, u), KV_ESTALE);
        commit_chain(p, 2, 2, 200, 1, &u);
        assert_int_equal(kvd_pool_check_ref(p, a[3]), KV_ESTALE);
        assert_int_equal(kvd_pool_check_ref(p, a[2]), KV_OK);
        assert_int_equal(kvd_pool_check_ref(p, a5), KV_OK);
        assert_int_equal(kvd_pool_release(p, 2, 2, &u, 1), KV_OK);
        assert_int_equal(kvd_pool_check(p), KV_OK);
        /* Protected again at 4: tenant 2's block goes. */
        kvd_block_ref v;
        commit_chain(p, 2, 2, 300, 1, &v);
        assert_int_equal(kvd_pool_check_ref(p, u), KV_ESTALE);
        assert_int_equal(kvd_pool_release(p, 2, 2, &v, 1), KV_OK);
        /* The guarantee ends: the order is a[2], a[1], a[0] (set aside, oldest first), then
         * the blocks released after them. */
        kvd_pool_set_guarantee(p, 1, 0);
        kvd_block_ref out[5];
        size_t n = 0;
        assert_int_equal(kvd_pool_evict(p, 5, -1, KVD_EVICT_ADMIN, 1, out, &n), KV_OK);
        assert_int_equal(n, 5);
        assert_int_equal(out[0].id, a[2].id);
        assert_int_equal(out[1].id, a[1].id);
        assert_int_equal(out[2].id, a[0].id);
        assert_int_equal(kvd_pool_check(p), KV_OK);
        assert_int_equal(kvd_pool_release(p, 3, 3, rest, 27), KV_OK);
        drop(&f);
    }
}

/* A malloc backend that can park (the choice is what is tested). */
static kv_err keep_discard(void *ctx, kvd_segment_mem *mem) {
    (void)ctx;
    (void)mem;
    return KV_OK;
}

/* The park choice from the segments' counts: idle segments only, fewest cached blocks, then the
 * least recently used; never one holding a cached block of a tenant at its guarantee, and the
 * counts follow a guarantee that starts or ends (recounted), a pin, a hit. */
static void test_park_choice(void **state) {
    (void)state;
    fixture f;
    kvd_pool_config cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.pool_id = 1;
    assert_int_equal(kv_layout_init(2, 2, 8, 16, KV_DTYPE_FP16, KV_LAYER_MAJOR, &cfg.layout),
                     KV_OK);
    cfg.blocks_per_segment = 4;
    cfg.max_segments = 4;
    cfg.policy = KVD_EVICT_LRU;
    static kvd_backend_ops be;
    be = kvd_backend_malloc;
    be.segment_discard = keep_discard;
    assert_int_equal(kvd_index_alloc(4096, &f.idx), KV_OK);
    assert_int_equal(kvd_pool_alloc(&cfg, f.idx, &be, NULL, &f.pool), KV_OK);
    kvd_pool *p = f.pool;
    for (int s = 0; s < 4; s++) {
        assert_int_equal(kvd_pool_grow(p, NULL), KV_OK);
    }
    /* Segment s gets the next 4 free blocks (grown in id order): cached chains of 1, 2, 1 and 1
     * blocks (segment 0's tenant 1's), at clock 10, 20, 30, 40; the rest freed. */
    static const uint32_t ncached[4] = {1, 2, 1, 1};
    kvd_block_ref seg_blocks[4][4];
    for (uint32_t s = 0; s < 4; s++) {
        uint32_t t = s == 0 ? 1 : 2;
        kvd_pool_set_now(p, 10 * (s + 1));
        kvd_block_ref *x = seg_blocks[s];
        assert_int_equal(kvd_pool_allocate(p, 4, t, t, x), KV_OK);
        for (uint32_t i = 0; i < 4; i++) {
            assert_int_equal(x[i].id / 4, s);
        }
        uint32_t parent = KVD_NO_BLOCK;
        for (uint32_t i = 0; i < ncached[s]; i++) {
            assert_int_equal(kvd_pool_commit(p, t, x[i], H(100 * s + i), parent, &x[i]), KV_OK);
            parent = x[i].id;
        }
        assert_int_equal(kvd_pool_release(p, t, t, x, ncached[s]), KV_OK);
    }
    for (uint32_t s = 0; s < 4; s++) {
        uint32_t t = s == 0 ? 1 : 2;
        assert_int_equal(kvd_pool_release(p, t, t, seg_blocks[s] + ncached[s], 4 - ncached[s]),
                         KV_OK);
    }
    kvd_pool_set_now(p, 100);
    kvd_park_candidate c;
    assert_int_equal(kvd_pool_park_candidate(p, &c), KV_OK);
    assert_int_equal(c.seg, 0); /* one cached block, least recently used */
    assert_int_equal(c.cached, 1);
    assert_int_equal(c.last_access, 10);
    assert_int_equal(c.parkable, 4);
    /* Tenant 1 at its guarantee: segment 0 stays; segment 2 is next (1 cached, at 30). */
    kvd_pool_set_guarantee(p, 1, 1);
    assert_int_equal(kvd_pool_check(p), KV_OK);
    assert_int_equal(kvd_pool_park_candidate(p, &c), KV_OK);
    assert_int_equal(c.seg, 2);
    assert_int_equal(c.last_access, 30);
    assert_int_equal(c.parkable, 3);
    /* A hit makes segment 2 the most recently used: segment 3 is chosen. */
    kvd_block_ref h;
    size_t nh = 0;
    kv_hash128 k2 = H(200);
    assert_int_equal(kvd_pool_lookup(p, 2, &k2, 1, &h, &nh), KV_OK);
    assert_int_equal(nh, 1);
    assert_int_equal(kvd_pool_park_candidate(p, &c), KV_OK);
    assert_int_equal(c.seg, 3); /* segment 2 is in use while the hit holds it */
    assert_int_equal(c.parkable, 2);
    assert_int_equal(kvd_pool_release(p, 2, 2, &h, 1), KV_OK);
    assert_int_equal(kvd_pool_park_candidate(p, &c), KV_OK);
    assert_int_equal(c.seg, 3);
    assert_int_equal(c.last_access, 40);
    /* A pin keeps segment 3 (not idle): segment 2 again, then segment 1 (2 cached). */
    assert_int_equal(kvd_pool_pin(p, seg_blocks[3][0], 1000, 0, 2), KV_OK);
    assert_int_equal(kvd_pool_park_candidate(p, &c), KV_OK);
    assert_int_equal(c.seg, 2);
    assert_int_equal(c.parkable, 2);
    assert_int_equal(kvd_pool_park(p, 2), KV_OK);
    assert_int_equal(kvd_pool_park_candidate(p, &c), KV_OK);
    assert_int_equal(c.seg, 1);
    assert_int_equal(c.cached, 2);
    /* The guarantee ends: segment 0 can go again (recounted), and back when it returns. */
    kvd_pool_set_guarantee(p, 1, 0);
    assert_int_equal(kvd_pool_check(p), KV_OK);
    assert_int_equal(kvd_pool_park_candidate(p, &c), KV_OK);
    assert_int_equal(c.seg, 0);
    kvd_pool_set_guarantee(p, 1, 5);
    assert_int_equal(kvd_pool_check(p), KV_OK);
    assert_int_equal(kvd_pool_park_candidate(p, &c), KV_OK);
    assert_int_equal(c.seg, 1);
    assert_int_equal(kvd_pool_unpin(p, seg_blocks[3][0]), KV_OK);
    assert_int_equal(kvd_pool_unpark(p, 2), KV_OK);
    kvd_pool_set_guarantee(p, 1, 0);
    drop(&f);
}

/* When every evictable block is protected, a victim pick does not walk them: a 2048-block
 * allocation over 32768 protected cached blocks is cheap (it rotated all of them once per block:
 * 0.9 s). The test bounds the work by the clock loosely; the cost itself is in bench/. */
static void test_guarantee_all_protected(void **state) {
    (void)state;
    fixture f;
    kvd_pool *p = make_pool(&f, 1024, 40, KVD_EVICT_LRU);
    kvd_pool_set_guarantee(p, 1, 1u << 20);
    static kvd_block_ref r[32768];
    assert_int_equal(kvd_pool_allocate(p, 32768, 1, 1, r), KV_OK);
    for (uint32_t i = 0; i < 32768; i++) {
        kvd_block_ref c;
        assert_int_equal(kvd_pool_commit(p, 1, r[i], H(i), KVD_NO_BLOCK, &c), KV_OK);
        r[i] = c;
    }
    assert_int_equal(kvd_pool_release(p, 1, 1, r, 32768), KV_OK);
    kvd_pool_set_max_segments(p, 32);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    static kvd_block_ref x[2048];
    assert_int_equal(kvd_pool_allocate(p, 2048, 2, 2, x), KV_OK);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double s = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9;
    assert_true(s < 0.1); /* O(blocks asked), not O(blocks asked x protected blocks) */
    assert_int_equal(kvd_pool_release(p, 2, 2, x, 2048), KV_OK);
    drop(&f);
}

/* An expired pin stops counting at once, also on a referenced (COMMITTED) block: pinned counts
 * and the tenant's usage drop at the next clock step (the sweep walked CACHED pins only). */
static void test_pin_expiry_counts_at_once(void **state) {
    (void)state;
    fixture f;
    kvd_pool *p = make_pool(&f, 8, 2, KVD_EVICT_LRU);
    kvd_block_ref r[2];
    commit_chain(p, 1, 3, 500, 2, r);
    kvd_pool_set_now(p, 1000);
    assert_int_equal(kvd_pool_pin(p, r[0], 1, 0, 3), KV_OK);
    assert_int_equal(kvd_pool_tenant_usage(p, 3).pinned, 1);
    assert_int_equal(kvd_pool_counts_get(p).pinned, 1);
    assert_int_equal(kvd_pool_check(p), KV_OK);
    kvd_pool_set_now(p, 1002); /* still referenced */
    assert_int_equal(kvd_pool_tenant_usage(p, 3).pinned, 0);
    assert_int_equal(kvd_pool_counts_get(p).pinned, 0);
    kvd_block_info info;
    assert_int_equal(kvd_pool_block_info(p, r[0].id, &info), KV_OK);
    assert_false(info.pinned);
    assert_int_equal(kvd_pool_check(p), KV_OK);
    /* A pin on a referenced block that outlives the reference moves with it. */
    assert_int_equal(kvd_pool_pin(p, r[1], 100, 0, 3), KV_OK);
    assert_int_equal(kvd_pool_release(p, 1, 3, r, 2), KV_OK);
    assert_int_equal(kvd_pool_counts_get(p).evictable, 1);
    assert_int_equal(kvd_pool_check(p), KV_OK);
    kvd_pool_set_now(p, 1200);
    assert_int_equal(kvd_pool_counts_get(p).evictable, 2);
    assert_int_equal(kvd_pool_tenant_usage(p, 3).pinned, 0);
    drop(&f);
}

/* A pin is charged to the tenant that pinned, not to the block's allocator (in a group pool one
 * member pinned another's blocks and used up her max-pinned). */
static void test_pin_charged_to_pinner(void **state) {
    (void)state;
    fixture f;
    kvd_pool *p = make_pool(&f, 8, 2, KVD_EVICT_LRU);
    kvd_block_ref r[3];
    commit_chain(p, 1, 7, 700, 3, r); /* allocated by tenant 7 */
    for (int i = 0; i < 3; i++) {
        assert_int_equal(kvd_pool_pin(p, r[i], 10000, 0, 8), KV_OK); /* pinned by tenant 8 */
    }
    assert_int_equal(kvd_pool_tenant_usage(p, 8).pinned, 3);
    assert_int_equal(kvd_pool_tenant_usage(p, 7).pinned, 0);
    assert_int_equal(kvd_pool_pin(p, r[0], 10000, 0, 99999), KV_EINVAL);
    assert_int_equal(kvd_pool_check(p), KV_OK);
    assert_int_equal(kvd_pool_unpin(p, r[1]), KV_OK);
    assert_int_equal(kvd_pool_tenant_usage(p, 8).pinned, 2);
    assert_int_equal(kvd_pool_release(p, 1, 7, r, 3), KV_OK);
    assert_int_equal(kvd_pool_check(p), KV_OK);
    drop(&f);
}

static void test_grow_shrink(void **state) {
    (void)state;
    fixture f;
    kvd_pool *p = make_pool(&f, 4, 3, KVD_EVICT_LRU);
    kvd_block_ref r[12], x;
    commit_chain(p, 1, 0, 1, 12, r);
    assert_int_equal(kvd_pool_segment_slots(p), 3);
    assert_int_equal(kvd_pool_allocate(p, 1, 1, 0, &x), KV_ENOSPC);
    uint32_t seg;
    assert_int_equal(kvd_pool_shrink(p, &seg), KV_ENOENT);
    /* Release the last segment's blocks: it can go; its handles become invalid. */
    assert_int_equal(kvd_pool_release(p, 1, 0, r + 8, 4), KV_OK);
    assert_int_equal(kvd_pool_shrink(p, &seg), KV_OK);
    assert_int_equal(seg, 2);
    assert_int_equal(kvd_pool_segment_slots(p), 2);
    assert_null(kvd_pool_segment(p, 2));
    assert_int_equal(kvd_pool_check_ref(p, r[8]), KV_ENOENT);
    assert_int_equal(kvd_pool_check(p), KV_OK);
    /* Growing again reuses the slot with new generations: old handles stay stale. */
    kvd_pool_set_max_segments(p, 3);
    assert_int_equal(kvd_pool_grow(p, &seg), KV_OK);
    assert_int_equal(seg, 2);
    assert_int_equal(kvd_pool_check_ref(p, r[8]), KV_ESTALE);
    assert_int_equal(kvd_pool_grow(p, &seg), KV_ENOSPC);
    /* Shrink a middle segment after releasing it; slots stay 3. */
    assert_int_equal(kvd_pool_release(p, 1, 0, r + 4, 4), KV_OK);
    assert_int_equal(kvd_pool_shrink(p, &seg), KV_OK);
    assert_int_equal(seg, 2); /* the regrown, all-FREE segment goes first */
    assert_int_equal(kvd_pool_shrink(p, &seg), KV_OK);
    assert_int_equal(seg, 1);
    assert_int_equal(kvd_pool_segment_slots(p), 1);
    assert_int_equal(kvd_pool_release(p, 1, 0, r, 4), KV_OK);
    drop(&f);
}

static void count_stat(void *arg, const char *name, uint64_t value) {
    uint64_t *seen = arg;
    if (strcmp(name, "hit_blocks") == 0) {
        seen[0] = value;
    } else if (strcmp(name, "commits_duplicate") == 0) {
        seen[1] = value;
    }
    seen[2]++;
}

typedef struct stat_find {
    const char *name;
    uint64_t value;
} stat_find;

static void stat_sink(void *arg, const char *name, uint64_t value) {
    stat_find *f = arg;
    if (strcmp(f->name, name) == 0) {
        f->value = value;
    }
}

static uint64_t stat_of(kvd_pool *p, const char *name) {
    stat_find f = {name, UINT64_MAX};
    kvd_pool_stats(p, stat_sink, &f);
    assert_true(f.value != UINT64_MAX);
    return f.value;
}

/* kvd_pool_quarantine (verify-blocks): a quarantined block is found by no Lookup, a new commit
 * of its hash makes a fresh block, the holder keeps reading it until its last release frees
 * it (not cached), a CACHED one (pinned too) goes at once, and no eviction is counted. Under
 * every policy. */
static void test_quarantine(void **state) {
    (void)state;
    kvd_evict_policy pols[] = {KVD_EVICT_LRU, KVD_EVICT_S3FIFO, KVD_EVICT_PREFIX_LRU};
    for (size_t k = 0; k < sizeof(pols) / sizeof(pols[0]); k++) {
        fixture f;
        kvd_pool *p = make_pool(&f, 16, 2, pols[k]);
        kvd_block_ref r[3], hit[3];
        size_t nhit;
        commit_chain(p, 1, 0, 100, 3, r);
        assert_int_equal(kvd_pool_quarantine(p, r[1]), KV_OK); /* held: COMMITTED */
        assert_int_equal(kvd_pool_quarantine(p, r[1]), KV_OK); /* again: nothing changes */
        assert_int_equal(kvd_pool_check(p), KV_OK);
        kv_hash128 hs[3] = {H(100), H(101), H(102)};
        assert_int_equal(kvd_pool_lookup(p, 0, hs, 3, hit, &nhit), KV_OK);
        assert_int_equal(nhit, 1); /* the prefix ends at the quarantined block */
        assert_int_equal(kvd_pool_release(p, 1, 0, hit, 1), KV_OK);
        /* A fresh commit of the same hash is a new block, not a duplicate. */
        kvd_block_ref w, c;
        assert_int_equal(kvd_pool_allocate(p, 1, 2, 0, &w), KV_OK);
        assert_int_equal(kvd_pool_commit(p, 2, w, H(101), r[0].id, &c), KV_OK);
        assert_int_equal(c.id, w.id);
        assert_int_equal(kvd_pool_release(p, 1, 0, r, 3), KV_OK);
        assert_int_equal(state_of(p, r[1].id), KVD_BLOCK_FREE); /* freed, not cached */
        assert_int_equal(state_of(p, r[0].id), KVD_BLOCK_CACHED);
        /* CACHED and pinned: freed at once, no eviction counted. */
        assert_int_equal(kvd_pool_pin(p, r[0], 100000, 0, 0), KV_OK);
        assert_int_equal(kvd_pool_quarantine(p, r[0]), KV_OK);
        assert_int_equal(state_of(p, r[0].id), KVD_BLOCK_FREE);
        assert_int_equal(stat_of(p, "blocks_pinned"), 0);
        assert_int_equal(stat_of(p, "evictions_admin") + stat_of(p, "evictions_capacity"), 0);
        assert_int_equal(stat_of(p, "quarantines"), 2);
        assert_int_equal(kvd_pool_quarantine(p, r[0]), KV_ESTALE);
        kvd_block_ref w2;
        assert_int_equal(kvd_pool_allocate(p, 1, 2, 0, &w2), KV_OK);
        assert_int_equal(kvd_pool_quarantine(p, w2), KV_ESTATE); /* WRITING */
        assert_int_equal(kvd_pool_release(p, 2, 0, &w2, 1), KV_OK);
        assert_int_equal(kvd_pool_release(p, 2, 0, &c, 1), KV_OK);
        drop(&f);
    }
}

static void test_stats_and_bad_config(void **state) {
    (void)state;
    fixture f;
    kvd_pool *p = make_pool(&f, 4, 1, KVD_EVICT_LRU);
    kvd_block_ref r[2], got[2];
    commit_chain(p, 1, 0, 1, 2, r);
    kv_hash128 q[2] = {H(1), H(2)};
    size_t nhit;
    assert_int_equal(kvd_pool_lookup(p, 0, q, 2, got, &nhit), KV_OK);
    uint64_t seen[3] = {0, 0, 0};
    kvd_pool_stats(p, count_stat, seen);
    assert_int_equal(seen[0], 2);
    assert_int_equal(seen[1], 0);
    size_t ndesc;
    (void)kvd_pool_stat_descs(&ndesc);
    assert_int_equal(seen[2], ndesc); /* every statistic of the table, once */
    assert_int_equal(ndesc, 24);
    assert_true(kvd_pool_meta_bytes_per_block() <= 64);
    assert_int_equal(kvd_pool_release(p, 1, 0, r, 2), KV_OK);
    assert_int_equal(kvd_pool_release(p, 1, 0, got, 2), KV_OK);
    kvd_pool_config cfg = *kvd_pool_config_get(p);
    kvd_pool *bad = NULL;
    cfg.blocks_per_segment = 0;
    assert_int_equal(kvd_pool_alloc(&cfg, f.idx, &kvd_backend_malloc, NULL, &bad), KV_EINVAL);
    cfg.blocks_per_segment = 4;
    cfg.policy = 0;
    assert_int_equal(kvd_pool_alloc(&cfg, f.idx, &kvd_backend_malloc, NULL, &bad), KV_EINVAL);
    cfg.policy = (kvd_evict_policy)(KVD_EVICT_ADAPTIVE + 1);
    assert_int_equal(kvd_pool_alloc(&cfg, f.idx, &kvd_backend_malloc, NULL, &bad), KV_EINVAL);
    assert_null(bad);
    kvd_pool_free(NULL);
    drop(&f);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_lifecycle),
        cmocka_unit_test(test_generation_changes_on_reuse),
        cmocka_unit_test(test_duplicate_commit),
        cmocka_unit_test(test_refcount_never_negative),
        cmocka_unit_test(test_referenced_never_evicted),
        cmocka_unit_test(test_lru_tail_first),
        cmocka_unit_test(test_s3fifo_prefers_reused),
        cmocka_unit_test(test_prefix_lru_keeps_shared_prefix),
        cmocka_unit_test(test_prefix_lru_linear_chain_is_lru),
        cmocka_unit_test(test_adaptive_shared_chain_rounds),
        cmocka_unit_test(test_adaptive_leaf_order),
        cmocka_unit_test(test_pins),
        cmocka_unit_test(test_pin_expires_while_referenced),
        cmocka_unit_test(test_guarantee),
        cmocka_unit_test(test_guarantee_every_policy),
        cmocka_unit_test(test_guarantee_all_protected),
        cmocka_unit_test(test_guarantee_skips_once),
        cmocka_unit_test(test_park_choice),
        cmocka_unit_test(test_pin_expiry_counts_at_once),
        cmocka_unit_test(test_pin_charged_to_pinner),
        cmocka_unit_test(test_grow_shrink),
        cmocka_unit_test(test_stats_and_bad_config),
        cmocka_unit_test(test_quarantine),
    };
    return cmocka_run_group_tests_name("kvd_pool", tests, NULL, NULL);
}
