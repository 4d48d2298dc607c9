/* segment_gap_test: a worker must never be handed a block in a segment it has not mapped, and
 * must never publish bytes it did not write (issue: "a hole in the segment map").
 *
 * The sequence that broke it, made deterministic: worker A has segment 0; worker B grows the pool
 * by three segments (1, 2, 3) and commits hashes into blocks of 1, 2 and 3; A commits B's hash of
 * segment 3 as a duplicate, so its canonical block lies in segment 3. A daemon that kept one
 * high-water mark per session sent A segment 3 alone and marked 0..3 as sent; segments 1 and 2
 * were never announced again, so A's hits and allocations there had no address, and a commit of
 * such an unwritten block published whatever the slot held. Here every block A is handed must
 * be addressable when the call returns, hold B's bytes, and what A writes in a former hole must
 * be what B reads. The same for a group (linked) pool, where Lookup hits and Allocate come from
 * a pool of another domain. Real kvd, libkvclient, small segments. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "tests/integration/kvd_harness.h"

#define SEG_BLOCKS 64 /* 1 MiB segments of the harness layout's 16 KiB blocks */

/* Fills every K and V run of block b with words derived from seed. */
static void fill(kvc_pool *p, kvc_block b, uint64_t seed) {
    const kv_layout *l = kvc_pool_layout(p);
    for (uint32_t layer = 0; layer < l->num_layers; layer++) {
        for (int kv = KV_K; kv <= KV_V; kv++) {
            uint64_t *w = kvc_pool_addr(p, b.id, layer, kv, 0, 0);
            if (w == NULL) {
                fail_msg("block %u (segment %u) has no address in pool %u", b.id, b.id / SEG_BLOCKS,
                         kvc_pool_id(p));
            }
            for (size_t i = 0; i < l->kv_block_bytes / 8; i++) {
                w[i] = seed ^ ((uint64_t)layer << 48) ^ ((uint64_t)kv << 40) ^ i;
            }
        }
    }
}

/* Fails unless block b of p is addressable and holds what fill(seed) wrote. */
static void expect_holds(kvc_pool *p, kvc_block b, uint64_t seed) {
    const kv_layout *l = kvc_pool_layout(p);
    for (uint32_t layer = 0; layer < l->num_layers; layer++) {
        for (int kv = KV_K; kv <= KV_V; kv++) {
            const uint64_t *w = kvc_pool_addr(p, b.id, layer, kv, 0, 0);
            if (w == NULL) {
                fail_msg("block %u (segment %u) has no address in pool %u", b.id, b.id / SEG_BLOCKS,
                         kvc_pool_id(p));
            }
            for (size_t i = 0; i < l->kv_block_bytes / 8; i++) {
                if (w[i] != (seed ^ ((uint64_t)layer << 48) ^ ((uint64_t)kv << 40) ^ i)) {
                    fail_msg("block %u: word %zu of layer %u %s is %llx, not what was written",
                             b.id, i, layer, kv == KV_K ? "K" : "V", (unsigned long long)w[i]);
                }
            }
        }
    }
}

static uint8_t g_committed[4 * SEG_BLOCKS]; /* B's committed blocks, by id (grow_three) */

static kv_hash128 hash_of(uint64_t k) {
    kv_hash128 h = {0x9e3779b97f4a7c15ull * (k + 1), 0xc2b2ae3d27d4eb4full ^ k};
    return h;
}

/* B's side of the sequence in pool pb: B takes the free rest of segment 0 (taken0 blocks of it
 * are held by others) and all of segments 1..3, then commits one block of each of segments 1, 2
 * and 3 as hashes 1, 2, 3 (seeds 101..103). Fills *held with every block B holds. */
static void grow_three(kvc_pool *pb, uint32_t taken0, kvc_block *held, uint32_t *nheld) {
    uint32_t n = SEG_BLOCKS - taken0 + 3 * SEG_BLOCKS;
    assert_int_equal(kvd_harness_alloc_all(pb, held, n, n), KV_OK);
    *nheld = n;
    memset(g_committed, 0, sizeof(g_committed));
    for (uint32_t k = 1; k <= 3; k++) {
        kvc_block *b = NULL;
        for (uint32_t i = 0; i < n && b == NULL; i++) {
            if (held[i].id / SEG_BLOCKS == k) {
                b = &held[i];
            }
        }
        assert_non_null(b);
        fill(pb, *b, 100 + k);
        kvc_commit_entry e = {.block = *b, .hash = hash_of(k), .parent = KVC_NO_PARENT};
        kvc_block canon;
        assert_int_equal(kvc_commit(pb, &e, 1, &canon), KV_OK);
        assert_int_equal(canon.id, b->id);
        g_committed[b->id] = 1;
    }
}

/* A's side, in pool pa (A holds block a0 of segment 0, written with seed 7): A commits hash 3 as
 * a duplicate (canonical in segment 3), then looks up hashes 1 and 2 (segments 1 and 2); every
 * block must be addressable with B's bytes. A then releases its blocks, B releases some blocks of
 * segments 1 and 2, A allocates there, writes, commits hash 50, and B reads A's bytes. */
static void a_side(kvc_pool *pa, kvc_block a0, kvc_pool *pb, kvc_block *held, uint32_t nheld) {
    fill(pa, a0, 103); /* A computed the same block as B's hash 3 */
    kvc_commit_entry e = {.block = a0, .hash = hash_of(3), .parent = KVC_NO_PARENT};
    kvc_block canon;
    assert_int_equal(kvc_commit(pa, &e, 1, &canon), KV_OK);
    assert_int_equal(canon.id / SEG_BLOCKS, 3);
    expect_holds(pa, canon, 103);
    for (uint64_t k = 1; k <= 2; k++) {
        kv_hash128 h = hash_of(k);
        kvc_block hit;
        size_t nhit = 0;
        assert_int_equal(kvc_lookup(pa, &h, 1, &hit, &nhit), KV_OK);
        assert_int_equal(nhit, 1);
        assert_int_equal(hit.id / SEG_BLOCKS, k);
        expect_holds(pa, hit, 100 + k);
        assert_int_equal(kvc_release(pa, &hit, 1), KV_OK);
    }
    assert_int_equal(kvc_release(pa, &canon, 1), KV_OK);
    /* B gives back its uncommitted blocks of segments 1 and 2 (WRITING -> FREE). */
    kvc_block back[2 * SEG_BLOCKS];
    uint32_t nback = 0;
    for (uint32_t i = 0; i < nheld; i++) {
        uint32_t seg = held[i].id / SEG_BLOCKS;
        if ((seg == 1 || seg == 2) && !g_committed[held[i].id]) {
            back[nback++] = held[i];
        }
    }
    assert_true(nback > 0);
    assert_int_equal(kvc_release(pb, back, nback), KV_OK);
    kvc_block mine[8];
    assert_int_equal(kvc_allocate(pa, 8, mine), KV_OK);
    int in_hole = 0;
    for (int i = 0; i < 8; i++) {
        in_hole |= mine[i].id / SEG_BLOCKS == 1 || mine[i].id / SEG_BLOCKS == 2;
        fill(pa, mine[i], 1000 + (uint64_t)i);
    }
    assert_true(in_hole);
    kvc_commit_entry ce[8];
    for (int i = 0; i < 8; i++) {
        ce[i].block = mine[i];
        ce[i].hash = hash_of(50 + (uint64_t)i);
        ce[i].parent = i == 0 ? KVC_NO_PARENT : mine[i - 1].id;
    }
    kvc_block mc[8];
    assert_int_equal(kvc_commit(pa, ce, 8, mc), KV_OK);
    kv_hash128 hs[8];
    for (int i = 0; i < 8; i++) {
        hs[i] = hash_of(50 + (uint64_t)i);
    }
    kvc_block bh[8];
    size_t nbh = 0;
    assert_int_equal(kvc_lookup(pb, hs, 8, bh, &nbh), KV_OK);
    assert_int_equal(nbh, 8);
    for (int i = 0; i < 8; i++) {
        expect_holds(pb, bh[i], 1000 + (uint64_t)i);
    }
    assert_int_equal(kvc_release(pb, bh, 8), KV_OK);
    assert_int_equal(kvc_release(pa, mc, 8), KV_OK);
}

/* Releases every block B still holds (those not given back in a_side). */
static void b_release_rest(kvc_pool *pb, kvc_block *held, uint32_t nheld) {
    kvc_block rest[4 * SEG_BLOCKS];
    uint32_t n = 0;
    for (uint32_t i = 0; i < nheld; i++) {
        uint32_t seg = held[i].id / SEG_BLOCKS;
        if (!((seg == 1 || seg == 2) && !g_committed[held[i].id])) {
            rest[n++] = held[i];
        }
    }
    assert_int_equal(kvc_release(pb, rest, n), KV_OK);
}

static void test_own_pool_gap(void **state) {
    (void)state;
    kvd_harness h;
    static const char *const flags[] = {"--segment-bytes=1M", "--pool-memory=16M", NULL};
    assert_int_equal(kvd_harness_start(&h, flags), 0);
    kv_layout l = kvd_harness_layout();
    kvc_conn *ca, *cb;
    kvc_pool *pa, *pb;
    assert_int_equal(kvd_harness_connect(&h, "a", &ca), KV_OK);
    assert_int_equal(kvc_pool_attach(ca, "gap", &l, &pa), KV_OK);
    assert_int_equal(kvc_pool_blocks_per_segment(pa), SEG_BLOCKS);
    kvc_block a0;
    assert_int_equal(kvc_allocate(pa, 1, &a0), KV_OK);
    assert_int_equal(a0.id / SEG_BLOCKS, 0);
    assert_int_equal(kvd_harness_connect(&h, "b", &cb), KV_OK);
    assert_int_equal(kvc_pool_attach(cb, "gap", &l, &pb), KV_OK);
    static kvc_block held[4 * SEG_BLOCKS];
    uint32_t nheld;
    grow_three(pb, 1, held, &nheld);
    assert_int_equal(kvc_pool_segments(pa), 1); /* A has heard of nothing yet */
    a_side(pa, a0, pb, held, nheld);
    b_release_rest(pb, held, nheld);
    assert_int_equal(kvd_harness_stat(ca, 0, "session.refs_held"), 0);
    assert_int_equal(kvd_harness_stat(cb, 0, "session.refs_held"), 0);
    kvc_pool_detach(pa);
    kvc_pool_detach(pb);
    kvc_conn_close(ca);
    kvc_conn_close(cb);
    assert_int_equal(kvd_harness_finish(&h), 0);
}

/* Tenants a and b share group "team"; each has a private pool and the group pool linked. */
typedef struct tenants {
    kvd_harness h;
    char dir[80];
    char flag[128];
} tenants;

static void token_of(const char *name, char *out, size_t cap) {
    snprintf(out, cap, "gap-token-%s-0123456789abcdef", name);
}

static void write_file(const char *dir, const char *name, const char *text) {
    char path[200];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    assert_true(fputs(text, f) >= 0);
    assert_int_equal(fclose(f), 0);
}

static kvc_conn *connect_as(tenants *t, const char *name, kvc_pool **pool) {
    char tok[64];
    token_of(name, tok, sizeof(tok));
    kvc_options o;
    kvc_options_init(&o);
    o.socket_path = t->h.sock;
    o.client_name = name;
    o.token = tok;
    o.token_len = strlen(tok);
    o.timeout_ms = 5000;
    kvc_conn *c;
    assert_int_equal(kvc_conn_open(&o, &c), KV_OK);
    kv_layout l = kvd_harness_layout();
    assert_int_equal(kvc_pool_attach(c, "gap-linked", &l, pool), KV_OK);
    return c;
}

static kvc_pool *group_of(kvc_pool *p) {
    for (uint32_t i = 0; i < kvc_pool_nlinked(p); i++) {
        if (strcmp(kvc_pool_domain(kvc_pool_linked(p, i)), "group:team") == 0) {
            return kvc_pool_linked(p, i);
        }
    }
    fail_msg("no group pool");
    return NULL;
}

static void test_linked_pool_gap(void **state) {
    (void)state;
    tenants t;
    memset(&t, 0, sizeof(t));
    const char *tmp = getenv("TEST_TMPDIR");
    snprintf(t.dir, sizeof(t.dir), "%s/kvd-gap-XXXXXX", tmp && strlen(tmp) < 50 ? tmp : "/tmp");
    assert_non_null(mkdtemp(t.dir));
    char text[512] = "", tok[64], line[200];
    const char *names[] = {"a", "b"};
    for (int i = 0; i < 2; i++) {
        char file[32];
        token_of(names[i], tok, sizeof(tok));
        snprintf(file, sizeof(file), "%s.token", names[i]);
        write_file(t.dir, file, tok);
        snprintf(line, sizeof(line), "tenant %s token-file=%s/%s\n", names[i], t.dir, file);
        strcat(text, line);
    }
    strcat(text, "group team members=a,b\n");
    write_file(t.dir, "tenants", text);
    snprintf(t.flag, sizeof(t.flag), "--tenants-file=%s/tenants", t.dir);
    const char *flags[] = {t.flag, "--segment-bytes=1M", "--pool-memory=32M", NULL};
    assert_int_equal(kvd_harness_start(&t.h, flags), 0);

    kvc_pool *pa, *pb;
    kvc_conn *ca = connect_as(&t, "a", &pa);
    kvc_conn *cb = connect_as(&t, "b", &pb);
    kvc_pool *ga = group_of(pa), *gb = group_of(pb);
    assert_int_equal(kvc_pool_id(ga), kvc_pool_id(gb));
    kvc_block a0;
    assert_int_equal(kvc_allocate(ga, 1, &a0), KV_OK);
    assert_int_equal(a0.id / SEG_BLOCKS, 0);
    static kvc_block held[4 * SEG_BLOCKS];
    uint32_t nheld;
    grow_three(gb, 1, held, &nheld);
    assert_int_equal(kvc_pool_segments(ga), 1);
    /* Lookup from A's private pool with the domain search: hits in the group's segments 3, 1. */
    kv_hash128 h3 = hash_of(3);
    kvc_block hit;
    kvc_pool *hp;
    size_t nhit = 0;
    assert_int_equal(kvc_lookup_domains(pa, &h3, 1, &hit, &hp, &nhit), KV_OK);
    assert_int_equal(nhit, 1);
    assert_ptr_equal(hp, ga);
    expect_holds(ga, hit, 103);
    assert_int_equal(kvc_release(ga, &hit, 1), KV_OK);
    /* The group pool used directly: duplicate commit, hits, and allocation in former holes. */
    a_side(ga, a0, gb, held, nheld);
    b_release_rest(gb, held, nheld);
    assert_int_equal(kvd_harness_stat(ca, 0, "session.refs_held"), 0);
    assert_int_equal(kvd_harness_stat(cb, 0, "session.refs_held"), 0);
    kvc_pool_detach(pa);
    kvc_pool_detach(pb);
    kvc_conn_close(ca);
    kvc_conn_close(cb);
    assert_int_equal(kvd_harness_finish(&t.h), 0);
    snprintf(line, sizeof(line), "rm -rf '%s'", t.dir);
    assert_int_equal(system(line), 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_own_pool_gap),
        cmocka_unit_test(test_linked_pool_gap),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
