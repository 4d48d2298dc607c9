/* park_test: parking moves memory out of a pool without invalidating anything a client holds.
 * A segment parks only when every block is FREE or CACHED unpinned; parking evicts its cached
 * blocks, takes its blocks out of allocation and calls the backend's segment_discard; parked
 * segments do not count against max_segments and allocate unparks them before growing; the
 * invariant check covers parked blocks. With the host backend, a client's mapping of a parked
 * memfd stays valid, reads zeros, and the memfd's allocated pages really go back. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "daemon/mem/backend_host.h"
#include "daemon/core/pool.h"

/* A malloc backend that counts discards (and can be told to refuse them). */
typedef struct counting_ctx {
    int discards; /* successful segment_discard calls */
    int refuse;   /* nonzero: segment_discard fails with KV_ESYS */
    int restores; /* segment_restore calls */
    int no_pages; /* nonzero: segment_restore fails with KV_ENOMEM (huge pages taken) */
} counting_ctx;

static kv_err counting_restore(void *ctx, kvd_segment_mem *mem) {
    (void)mem;
    counting_ctx *c = ctx;
    c->restores++;
    return c->no_pages ? KV_ENOMEM : KV_OK;
}

static kv_err counting_discard(void *ctx, kvd_segment_mem *mem) {
    counting_ctx *c = ctx;
    if (c->refuse) {
        return KV_ESYS;
    }
    memset(mem->base, 0, mem->bytes);
    c->discards++;
    return KV_OK;
}

static kv_err counting_alloc(void *ctx, uint64_t bytes, kvd_segment_mem *out) {
    return kvd_backend_malloc.segment_alloc(ctx, bytes, out);
}

static void counting_free(void *ctx, kvd_segment_mem *mem) {
    kvd_backend_malloc.segment_free(ctx, mem);
}

static const kvd_backend_ops counting_backend = {
    .name = "counting",
    .segment_alloc = counting_alloc,
    .segment_free = counting_free,
    .segment_discard = counting_discard,
    .segment_restore = counting_restore,
};

typedef struct fixture {
    kvd_index *idx;
    kvd_pool *pool;
    counting_ctx be;
} fixture;

static kv_hash128 H(uint64_t k) {
    kv_hash128 h = {k * 0x9E3779B97F4A7C15ull + 11, k ^ 0x5555};
    return h;
}

static void make(fixture *f, const kvd_backend_ops *be, void *ctx, uint32_t bps, uint32_t maxseg) {
    memset(f, 0, sizeof(*f));
    kvd_pool_config cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.pool_id = 3;
    assert_int_equal(kv_layout_init(2, 2, 64, 16, KV_DTYPE_FP16, KV_LAYER_MAJOR, &cfg.layout),
                     KV_OK);
    cfg.blocks_per_segment = bps;
    cfg.max_segments = maxseg;
    cfg.policy = KVD_EVICT_LRU;
    assert_int_equal(kvd_index_alloc(4096, &f->idx), KV_OK);
    if (be == NULL) {
        be = &counting_backend;
        ctx = &f->be;
    }
    assert_int_equal(kvd_pool_alloc(&cfg, f->idx, be, ctx, &f->pool), KV_OK);
}

static void drop(fixture *f) {
    assert_int_equal(kvd_pool_check(f->pool), KV_OK);
    kvd_pool_free(f->pool);
    assert_int_equal(kvd_index_count(f->idx), 0);
    kvd_index_free(f->idx);
}

typedef struct stats {
    uint64_t free, cached, parked, segs_parked, segs, bytes;
} stats;

static void sink(void *arg, const char *name, uint64_t v) {
    stats *s = arg;
    if (strcmp(name, "blocks_free") == 0) {
        s->free = v;
    } else if (strcmp(name, "blocks_cached") == 0) {
        s->cached = v;
    } else if (strcmp(name, "blocks_parked") == 0) {
        s->parked = v;
    } else if (strcmp(name, "segments_parked") == 0) {
        s->segs_parked = v;
    } else if (strcmp(name, "segments") == 0) {
        s->segs = v;
    } else if (strcmp(name, "bytes") == 0) {
        s->bytes = v;
    }
}

static stats get_stats(kvd_pool *p) {
    stats s;
    memset(&s, 0, sizeof(s));
    kvd_pool_stats(p, sink, &s);
    /* The O(1) running counts the daemon's allocate path reads agree with the full report. */
    kvd_pool_counts c = kvd_pool_counts_get(p);
    assert_int_equal(kvd_pool_resident_bytes(p), s.bytes);
    assert_int_equal(c.free, s.free);
    assert_int_equal(c.cached, s.cached);
    assert_int_equal(kvd_pool_check(p), KV_OK);
    return s;
}

/* Allocates n blocks for session 1 and commits them as a chain keyed base.. */
static void commit_n(kvd_pool *p, uint64_t base, uint32_t n, kvd_block_ref *refs) {
    assert_int_equal(kvd_pool_allocate(p, n, 1, 0, refs), KV_OK);
    for (uint32_t i = 0; i < n; i++) {
        kvd_block_ref canon;
        assert_int_equal(kvd_pool_commit(p, 1, refs[i], H(base + i),
                                         i == 0 ? KVD_NO_BLOCK : refs[i - 1].id, &canon),
                         KV_OK);
    }
}

static uint32_t seg_of_id(uint32_t id, uint32_t bps) {
    return id / bps;
}

/* Only idle segments park; parking evicts cached blocks and takes the blocks out of allocation. */
static void test_park_rules(void **state) {
    (void)state;
    fixture f;
    make(&f, NULL, NULL, 4, 2);
    kvd_block_ref r[8];
    commit_n(f.pool, 100, 8, r); /* both segments, all COMMITTED (referenced) */
    kvd_park_candidate c;
    assert_int_equal(kvd_pool_park_candidate(f.pool, &c), KV_ENOENT);
    assert_int_equal(kvd_pool_park(f.pool, 0), KV_ESTATE);
    assert_int_equal(kvd_pool_park(f.pool, 7), KV_ENOENT);
    /* Release segment 1's blocks: cached, so segment 1 is idle. */
    uint32_t s1 = seg_of_id(r[4].id, 4);
    kvd_block_ref hi[4], lo[4];
    uint32_t nh = 0, nl = 0;
    for (int i = 0; i < 8; i++) {
        if (seg_of_id(r[i].id, 4) == s1) {
            hi[nh++] = r[i];
        } else {
            lo[nl++] = r[i];
        }
    }
    assert_int_equal(nh, 4);
    assert_int_equal(kvd_pool_release(f.pool, 1, 0, hi, nh), KV_OK);
    /* A pinned block keeps its segment resident. */
    assert_int_equal(kvd_pool_pin(f.pool, hi[0], 100000, 1, KVD_PIN_OWNER), KV_OK);
    assert_int_equal(kvd_pool_park(f.pool, s1), KV_ESTATE);
    assert_int_equal(kvd_pool_unpin(f.pool, hi[0]), KV_OK);
    assert_int_equal(kvd_pool_park_candidate(f.pool, &c), KV_OK);
    assert_int_equal(c.seg, s1);
    assert_int_equal(c.cached, 4);
    assert_int_equal(c.parkable, 1);
    assert_int_equal(kvd_pool_park(f.pool, s1), KV_OK);
    assert_int_equal(kvd_pool_park(f.pool, s1), KV_EEXIST);
    assert_int_equal(f.be.discards, 1);
    assert_true(kvd_pool_segment_parked(f.pool, s1));
    assert_false(kvd_pool_segment_parked(f.pool, 1 - s1));
    assert_int_equal(kvd_pool_check(f.pool), KV_OK);
    /* Its blocks left the index, and the handles are stale or FREE. */
    for (uint32_t i = 0; i < nh; i++) {
        uint64_t v;
        assert_int_equal(kvd_index_find(f.idx, 3, H(100 + (hi[i].id - r[0].id)), &v), KV_ENOENT);
        assert_int_equal(kvd_pool_hold(f.pool, 0, hi[i]), KV_ESTALE);
    }
    kvd_block_ref tmp[8];
    size_t nhit = 99;
    kv_hash128 hs[8];
    for (int i = 0; i < 8; i++) {
        hs[i] = H(100 + i);
    }
    assert_int_equal(kvd_pool_lookup(f.pool, 0, hs, 8, tmp, &nhit), KV_OK);
    assert_int_equal(nhit, 4); /* the still-referenced first half */
    assert_int_equal(kvd_pool_release(f.pool, 1, 0, tmp, nhit), KV_OK);
    /* The segment still exists (its memory object stays for clients' mappings). */
    assert_non_null(kvd_pool_segment(f.pool, s1));
    stats st = get_stats(f.pool);
    assert_int_equal(st.parked, 4);
    assert_int_equal(st.segs_parked, 1);
    assert_int_equal(st.segs, 2);
    assert_int_equal(st.free, 0);
    assert_int_equal(kvd_pool_resident_segments(f.pool), 1);
    assert_int_equal(kvd_pool_release(f.pool, 1, 0, lo, nl), KV_OK);
    drop(&f);
}

/* A parked segment is not allocatable until unparked; allocate unparks before it grows, and
 * parked segments do not count against max_segments. */
static void test_allocate_unparks(void **state) {
    (void)state;
    fixture f;
    make(&f, NULL, NULL, 4, 2);
    kvd_block_ref r[8];
    assert_int_equal(kvd_pool_allocate(f.pool, 8, 1, 0, r), KV_OK);
    assert_int_equal(kvd_pool_release(f.pool, 1, 0, r, 8), KV_OK);
    assert_int_equal(kvd_pool_park(f.pool, 0), KV_OK);
    assert_int_equal(kvd_pool_park(f.pool, 1), KV_OK);
    assert_int_equal(kvd_pool_check(f.pool), KV_OK);
    /* With a budget of nothing resident, nothing can be had. */
    kvd_pool_set_max_segments(f.pool, 0 + 1);
    kvd_block_ref a[8];
    assert_int_equal(kvd_pool_allocate(f.pool, 5, 1, 0, a), KV_ENOSPC);
    assert_int_equal(kvd_pool_check(f.pool), KV_OK);
    assert_int_equal(kvd_pool_resident_segments(f.pool), 0); /* refused: nothing unparked */
    assert_int_equal(kvd_pool_allocate(f.pool, 4, 1, 0, a), KV_OK);
    assert_int_equal(kvd_pool_resident_segments(f.pool), 1);
    assert_int_equal(kvd_pool_segment_slots(f.pool), 2); /* no new slot: reused a parked one */
    assert_int_equal(kvd_pool_unpark(f.pool, 0),
                     kvd_pool_segment_parked(f.pool, 0) ? KV_ENOSPC : KV_ENOENT);
    /* A segment whose memory cannot be had back (huge pages taken meanwhile) stays parked, and
     * the allocation that needed it is refused instead of handing out blocks that would fault. */
    kvd_pool_set_max_segments(f.pool, 2);
    f.be.no_pages = 1;
    int restores = f.be.restores;
    assert_int_equal(kvd_pool_allocate(f.pool, 4, 1, 0, a + 4), KV_ENOMEM);
    assert_int_equal(f.be.restores, restores + 1);
    assert_true(kvd_pool_segment_parked(f.pool, 0) || kvd_pool_segment_parked(f.pool, 1));
    assert_int_equal(kvd_pool_check(f.pool), KV_OK);
    f.be.no_pages = 0;
    assert_int_equal(kvd_pool_allocate(f.pool, 4, 1, 0, a + 4), KV_OK);
    assert_int_equal(kvd_pool_segment_slots(f.pool), 2);
    assert_int_equal(get_stats(f.pool).segs_parked, 0);
    assert_int_equal(kvd_pool_check(f.pool), KV_OK);
    assert_int_equal(kvd_pool_release(f.pool, 1, 0, a, 8), KV_OK);
    drop(&f);
}

/* The candidate is the idle segment with the fewest cached blocks, then the least recent. */
static void test_candidate_order(void **state) {
    (void)state;
    fixture f;
    make(&f, NULL, NULL, 4, 3);
    kvd_block_ref r[12];
    kvd_pool_set_now(f.pool, 10);
    commit_n(f.pool, 1, 12, r);
    /* Release per segment at different times: seg of r[0..3] at 20, r[4..7] at 30; r[8..11]
     * leased blocks stay referenced. */
    kvd_block_ref by_seg[3][4];
    uint32_t cnt[3] = {0, 0, 0};
    for (int i = 0; i < 12; i++) {
        uint32_t s = seg_of_id(r[i].id, 4);
        by_seg[s][cnt[s]++] = r[i];
    }
    kvd_pool_set_now(f.pool, 30);
    assert_int_equal(kvd_pool_release(f.pool, 1, 0, by_seg[0], 4), KV_OK);
    kvd_pool_set_now(f.pool, 20);
    assert_int_equal(kvd_pool_release(f.pool, 1, 0, by_seg[1], 4), KV_OK);
    kvd_park_candidate c;
    assert_int_equal(kvd_pool_park_candidate(f.pool, &c), KV_OK);
    assert_int_equal(c.parkable, 2);
    assert_int_equal(c.seg, 1); /* equal cached counts: the one released at 20 */
    assert_int_equal(c.last_access, 20);
    /* Evict two of segment 0's cached blocks: fewer cached wins over recency. */
    kvd_pool_set_now(f.pool, 40);
    size_t ev = 0;
    assert_int_equal(kvd_pool_evict(f.pool, 6, 0, KVD_EVICT_ADMIN, 0, NULL, &ev), KV_OK);
    assert_int_equal(ev, 6);
    assert_int_equal(kvd_pool_park_candidate(f.pool, &c), KV_OK);
    stats st = get_stats(f.pool);
    assert_int_equal(st.cached, 2);
    assert_int_equal(c.cached, 0);
    assert_int_equal(kvd_pool_release(f.pool, 1, 0, by_seg[2], 4), KV_OK);
    drop(&f);
}

/* A refused discard leaves the segment resident and its blocks allocatable. */
static void test_discard_refused(void **state) {
    (void)state;
    fixture f;
    make(&f, NULL, NULL, 4, 1);
    kvd_block_ref r[4];
    commit_n(f.pool, 50, 4, r);
    assert_int_equal(kvd_pool_release(f.pool, 1, 0, r, 4), KV_OK);
    f.be.refuse = 1;
    assert_int_equal(kvd_pool_park(f.pool, 0), KV_ESYS);
    assert_false(kvd_pool_segment_parked(f.pool, 0));
    assert_int_equal(kvd_pool_check(f.pool), KV_OK);
    assert_int_equal(get_stats(f.pool).free, 4);
    assert_int_equal(kvd_pool_allocate(f.pool, 4, 1, 0, r), KV_OK);
    assert_int_equal(kvd_pool_release(f.pool, 1, 0, r, 4), KV_OK);
    drop(&f);
}

/* Without segment_discard (malloc, CUDA) nothing parks. */
static void test_no_discard(void **state) {
    (void)state;
    fixture f;
    make(&f, &kvd_backend_malloc, NULL, 4, 1);
    kvd_block_ref r[4];
    assert_int_equal(kvd_pool_allocate(f.pool, 4, 1, 0, r), KV_OK);
    assert_int_equal(kvd_pool_release(f.pool, 1, 0, r, 4), KV_OK);
    kvd_park_candidate c;
    assert_int_equal(kvd_pool_park_candidate(f.pool, &c), KV_ENOTSUP);
    assert_int_equal(kvd_pool_park(f.pool, 0), KV_ENOTSUP);
    drop(&f);
}

/* Shrink frees a parked segment too. */
static void test_shrink_parked(void **state) {
    (void)state;
    fixture f;
    make(&f, NULL, NULL, 4, 2);
    kvd_block_ref r[8];
    assert_int_equal(kvd_pool_allocate(f.pool, 8, 1, 0, r), KV_OK);
    assert_int_equal(kvd_pool_release(f.pool, 1, 0, r + 4, 4), KV_OK);
    uint32_t s = seg_of_id(r[4].id, 4);
    assert_int_equal(kvd_pool_park(f.pool, s), KV_OK);
    uint32_t got = 99;
    assert_int_equal(kvd_pool_shrink(f.pool, &got), KV_OK);
    assert_int_equal(got, s);
    assert_null(kvd_pool_segment(f.pool, s));
    assert_int_equal(get_stats(f.pool).segs_parked, 0);
    assert_int_equal(kvd_pool_check(f.pool), KV_OK);
    assert_int_equal(kvd_pool_release(f.pool, 1, 0, r, 4), KV_OK);
    drop(&f);
}

/* Host memfds: a client mapping survives parking, reads zeros, the pages go back to the system,
 * and after unparking writes through either mapping are seen by the other. */
static void test_host_memfd(void **state) {
    (void)state;
    kvd_backend_host_ctx hctx;
    memset(&hctx, 0, sizeof(hctx));
    fixture f;
    make(&f, &kvd_backend_host, &hctx, 16, 1);
    kvd_block_ref r[16];
    assert_int_equal(kvd_pool_allocate(f.pool, 16, 1, 0, r), KV_OK);
    const kvd_segment_mem *m = kvd_pool_segment(f.pool, 0);
    assert_non_null(m);
    uint8_t *client = mmap(NULL, m->bytes, PROT_READ | PROT_WRITE, MAP_SHARED, m->fd, 0);
    assert_true(client != MAP_FAILED);
    memset(client, 0xab, m->bytes);
    struct stat st;
    assert_int_equal(fstat(m->fd, &st), 0);
    assert_true((uint64_t)st.st_blocks * 512 >= m->bytes);
    assert_int_equal(kvd_pool_release(f.pool, 1, 0, r, 16), KV_OK);
    assert_int_equal(kvd_pool_park(f.pool, 0), KV_OK);
    assert_int_equal(fstat(m->fd, &st), 0);
    assert_int_equal(st.st_blocks, 0);
    assert_int_equal(st.st_size, (off_t)m->bytes); /* size and seals unchanged */
    assert_int_equal(client[0], 0);
    assert_int_equal(client[m->bytes - 1], 0);
    assert_int_equal(kvd_pool_allocate(f.pool, 16, 1, 0, r), KV_OK); /* unparks */
    assert_false(kvd_pool_segment_parked(f.pool, 0));
    assert_ptr_equal(kvd_pool_segment(f.pool, 0), m); /* the same memory object */
    ((uint8_t *)m->base)[100] = 0x77;
    assert_int_equal(client[100], 0x77);
    client[200] = 0x66;
    assert_int_equal(((uint8_t *)m->base)[200], 0x66);
    munmap(client, m->bytes);
    assert_int_equal(kvd_pool_release(f.pool, 1, 0, r, 16), KV_OK);
    drop(&f);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_park_rules),      cmocka_unit_test(test_allocate_unparks),
        cmocka_unit_test(test_candidate_order), cmocka_unit_test(test_discard_refused),
        cmocka_unit_test(test_no_discard),      cmocka_unit_test(test_shrink_parked),
        cmocka_unit_test(test_host_memfd),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
