/* Tests of kvd_tstore, one rule per test: lookups on an empty store, get's find-or-make, growth
 * and rehash with thousands of entries, the per-tier counts and bytes of set/drop, take1's
 * hand-back of T1 bytes, T2 slot reuse, when an entry is freed (neither tier, not pending) and
 * when it is kept, LRU order under touch, busy entries skipped by oldest, unlink2, forget, and
 * next_slot2 after a restart's set2. T1 buffers are malloc'd because the store frees them;
 * ASan's leak check sees any it loses. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "daemon/tiers/store.h"

#define SLOT_BYTES 4096u

static kv_hash128 H(uint64_t k) {
    kv_hash128 h = {k * 0x9E3779B97F4A7C15ull + 7, k};
    return h;
}

static uint64_t rng_next(uint64_t *s) {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

/* A T1 buffer of len bytes (at least one, so malloc never returns NULL for 0). */
static uint8_t *buf(uint64_t len) {
    uint8_t *b = malloc(len > 0 ? len : 1);
    assert_non_null(b);
    memset(b, 0xA5, len);
    return b;
}

static uint32_t get(kvd_tstore *s, uint64_t k) {
    uint32_t i = KVD_TNONE;
    assert_int_equal(kvd_tstore_get(s, H(k), H(k + 1000000), &i), KV_OK);
    assert_int_not_equal(i, KVD_TNONE);
    return i;
}

static void test_empty(void **state) {
    (void)state;
    kvd_tstore s;
    kvd_tstore_init(&s);
    assert_int_equal(kvd_tstore_find(&s, H(1)), KVD_TNONE);
    assert_int_equal(kvd_tstore_oldest(&s, 1), KVD_TNONE);
    assert_int_equal(kvd_tstore_oldest(&s, 2), KVD_TNONE);
    assert_int_equal(s.n, 0);
    assert_int_equal(s.count[0] + s.count[1] + s.bytes[0] + s.bytes[1], 0);
    kvd_tstore_fini(&s);
    kvd_tstore_fini(&s); /* fini leaves an empty store */
    assert_int_equal(kvd_tstore_find(&s, H(1)), KVD_TNONE);
    /* fini accepts zeroed memory and NULL. */
    kvd_tstore z;
    memset(&z, 0, sizeof(z));
    kvd_tstore_fini(&z);
    kvd_tstore_fini(NULL);
}

static void test_get_makes_then_finds(void **state) {
    (void)state;
    kvd_tstore s;
    kvd_tstore_init(&s);
    uint32_t i = KVD_TNONE;
    assert_int_equal(kvd_tstore_get(&s, H(1), H(2), &i), KV_OK);
    assert_int_not_equal(i, KVD_TNONE);
    assert_int_equal(s.n, 1);
    assert_int_equal(kvd_tstore_find(&s, H(1)), i);
    kvd_tentry *e = kvd_tstore_at(&s, i);
    assert_true(kv_hash_eq(e->hash, H(1)));
    assert_true(kv_hash_eq(e->parent, H(2)));
    assert_true(e->used);
    assert_null(e->t1);
    assert_false(e->in2);
    assert_int_equal(e->busy + e->pending + e->hits + e->doomed, 0);
    assert_false(kvd_tstore_in(&s, i, 1));
    assert_false(kvd_tstore_in(&s, i, 2));
    /* Again: the same entry, nothing made, the first parent kept. */
    uint32_t j = KVD_TNONE;
    assert_int_equal(kvd_tstore_get(&s, H(1), H(3), &j), KV_OK);
    assert_int_equal(j, i);
    assert_int_equal(s.n, 1);
    assert_true(kv_hash_eq(kvd_tstore_at(&s, j)->parent, H(2)));
    /* Another hash is another entry; hashes that share lo (or hi) are still apart. */
    uint32_t k = get(&s, 5);
    assert_int_not_equal(k, i);
    kv_hash128 a = {77, 1}, b = {77, 2}, c = {78, 1};
    uint32_t ia, ib, ic;
    assert_int_equal(kvd_tstore_get(&s, a, H(0), &ia), KV_OK);
    assert_int_equal(kvd_tstore_get(&s, b, H(0), &ib), KV_OK);
    assert_int_equal(kvd_tstore_get(&s, c, H(0), &ic), KV_OK);
    assert_int_not_equal(ia, ib);
    assert_int_not_equal(ia, ic);
    assert_int_not_equal(ib, ic);
    assert_int_equal(kvd_tstore_find(&s, a), ia);
    assert_int_equal(kvd_tstore_find(&s, b), ib);
    assert_int_equal(kvd_tstore_find(&s, c), ic);
    assert_int_equal(s.n, 5);
    kvd_tstore_fini(&s);
}

#define MANY 5000

static void test_many_survive_growth(void **state) {
    (void)state;
    kvd_tstore s;
    kvd_tstore_init(&s);
    kv_hash128 *h = malloc(MANY * sizeof(*h));
    uint32_t *idx = malloc(MANY * sizeof(*idx));
    assert_non_null(h);
    assert_non_null(idx);
    uint64_t r = 0x243F6A8885A308D3ull;
    for (int k = 0; k < MANY; k++) {
        h[k].lo = rng_next(&r);
        h[k].hi = rng_next(&r);
    }
    uint32_t cap0 = 0, grows = 0, nb0 = 0, rehashes = 0;
    for (int k = 0; k < MANY; k++) {
        kv_hash128 parent = k > 0 ? h[k - 1] : (kv_hash128){0, 0};
        assert_int_equal(kvd_tstore_find(&s, h[k]), KVD_TNONE);
        assert_int_equal(kvd_tstore_get(&s, h[k], parent, &idx[k]), KV_OK);
        grows += s.cap != cap0;
        rehashes += s.nbuckets != nb0;
        cap0 = s.cap;
        nb0 = s.nbuckets;
        /* T1 on every third entry, T2 on every fifth: the LRU links survive growth too. */
        if (k % 3 == 0) {
            kvd_tstore_set1(&s, idx[k], buf(16), 16, 1);
        }
        if (k % 5 == 0) {
            uint64_t slot;
            assert_int_equal(kvd_tstore_slot2(&s, &slot), KV_OK);
            kvd_tstore_set2(&s, idx[k], slot, 100, 2, (uint64_t)k, SLOT_BYTES);
        }
    }
    assert_true(grows >= 5); /* 256 -> 512 -> ... -> 8192 */
    assert_true(rehashes >= 5);
    assert_int_equal(s.n, MANY);
    assert_true(s.nbuckets >= s.n);
    assert_int_equal(s.nbuckets & (s.nbuckets - 1), 0);
    assert_int_equal(s.count[0], (MANY + 2) / 3);
    assert_int_equal(s.bytes[0], 16ull * ((MANY + 2) / 3));
    assert_int_equal(s.count[1], MANY / 5);
    assert_int_equal(s.bytes[1], (uint64_t)SLOT_BYTES * (MANY / 5));
    for (int k = 0; k < MANY; k++) {
        uint32_t i = kvd_tstore_find(&s, h[k]);
        assert_int_equal(i, idx[k]);
        const kvd_tentry *e = kvd_tstore_at(&s, i);
        assert_true(kv_hash_eq(e->hash, h[k]));
        assert_true(kv_hash_eq(e->parent, k > 0 ? h[k - 1] : (kv_hash128){0, 0}));
        assert_int_equal(kvd_tstore_in(&s, i, 1), k % 3 == 0);
        assert_int_equal(kvd_tstore_in(&s, i, 2), k % 5 == 0);
        uint32_t again;
        assert_int_equal(kvd_tstore_get(&s, h[k], (kv_hash128){0, 0}, &again), KV_OK);
        assert_int_equal(again, i);
    }
    assert_int_equal(s.n, MANY);
    /* Each tier's LRU holds its entries in the order they entered. */
    int t1 = 0, t2 = 0;
    for (int k = 0; k < MANY; k++) {
        if (k % 3 == 0) {
            assert_int_equal(kvd_tstore_oldest(&s, 1), idx[k]);
            kvd_tstore_drop(&s, idx[k], 1, SLOT_BYTES);
            t1++;
        }
        if (k % 5 == 0) {
            assert_int_equal(kvd_tstore_oldest(&s, 2), idx[k]);
            kvd_tstore_drop(&s, idx[k], 2, SLOT_BYTES);
            t2++;
        }
    }
    assert_int_equal(kvd_tstore_oldest(&s, 1), KVD_TNONE);
    assert_int_equal(kvd_tstore_oldest(&s, 2), KVD_TNONE);
    assert_int_equal(s.count[0] + s.count[1] + s.bytes[0] + s.bytes[1], 0);
    /* Dropped from their last tier, those entries are gone; the others (in no tier, never
     * dropped) stay. */
    int left = 0;
    for (int k = 0; k < MANY; k++) {
        int gone = k % 3 == 0 || k % 5 == 0;
        assert_int_equal(kvd_tstore_find(&s, h[k]) == KVD_TNONE, gone);
        left += !gone;
    }
    assert_int_equal(s.n, (uint32_t)left);
    assert_true(t1 > 0 && t2 > 0);
    free(h);
    free(idx);
    kvd_tstore_fini(&s);
}

static void test_set1_drop1(void **state) {
    (void)state;
    kvd_tstore s;
    kvd_tstore_init(&s);
    uint32_t a = get(&s, 1), b = get(&s, 2);
    uint8_t *ba = buf(100);
    kvd_tstore_set1(&s, a, ba, 100, 3);
    kvd_tstore_set1(&s, b, buf(250), 250, 4);
    assert_int_equal(s.count[0], 2);
    assert_int_equal(s.bytes[0], 350);
    assert_int_equal(s.count[1] + s.bytes[1], 0);
    assert_true(kvd_tstore_in(&s, a, 1));
    assert_false(kvd_tstore_in(&s, a, 2));
    const kvd_tentry *e = kvd_tstore_at(&s, a);
    assert_ptr_equal(e->t1, ba);
    assert_int_equal(e->len1, 100);
    assert_int_equal(e->fmt1, 3);
    /* Dropping from T2 an entry not in T2 changes no count; the entry (in T1) stays. */
    kvd_tstore_drop(&s, a, 2, SLOT_BYTES);
    assert_int_equal(s.count[0], 2);
    assert_int_equal(s.bytes[0], 350);
    assert_int_equal(s.nfree2, 0);
    assert_int_equal(kvd_tstore_find(&s, H(1)), a);
    /* Out of T1 and in no other tier: its bytes are freed and so is the entry. */
    kvd_tstore_drop(&s, a, 1, SLOT_BYTES);
    assert_int_equal(s.count[0], 1);
    assert_int_equal(s.bytes[0], 250);
    assert_int_equal(kvd_tstore_find(&s, H(1)), KVD_TNONE);
    assert_int_equal(s.n, 1);
    kvd_tstore_drop(&s, b, 1, SLOT_BYTES);
    assert_int_equal(s.count[0] + s.bytes[0], 0);
    assert_int_equal(s.n, 0);
    /* A zero-length T1 copy still counts as present. */
    uint32_t c = get(&s, 3);
    kvd_tstore_set1(&s, c, buf(0), 0, 0);
    assert_true(kvd_tstore_in(&s, c, 1));
    assert_int_equal(s.count[0], 1);
    assert_int_equal(s.bytes[0], 0);
    kvd_tstore_fini(&s); /* frees c's buffer */
}

static void test_take1(void **state) {
    (void)state;
    kvd_tstore s;
    kvd_tstore_init(&s);
    /* Only in T1: the bytes come back (the caller owns them) and the entry goes. */
    uint32_t a = get(&s, 1);
    uint8_t *ba = buf(64);
    kvd_tstore_set1(&s, a, ba, 64, 0);
    assert_ptr_equal(kvd_tstore_take1(&s, a), ba);
    assert_int_equal(s.count[0] + s.bytes[0], 0);
    assert_int_equal(kvd_tstore_find(&s, H(1)), KVD_TNONE);
    assert_int_equal(kvd_tstore_oldest(&s, 1), KVD_TNONE);
    free(ba);
    /* Also in T2, or pending: the entry stays, out of T1's LRU. */
    uint32_t b = get(&s, 2), c = get(&s, 3), d = get(&s, 4);
    uint8_t *bb = buf(10), *bc = buf(20);
    kvd_tstore_set1(&s, b, bb, 10, 0);
    kvd_tstore_set1(&s, c, bc, 20, 0);
    kvd_tstore_set1(&s, d, buf(30), 30, 0);
    kvd_tstore_set2(&s, b, 0, 10, 0, 1, SLOT_BYTES);
    kvd_tstore_at(&s, c)->pending = KVD_TPEND_T2;
    assert_ptr_equal(kvd_tstore_take1(&s, b), bb);
    assert_ptr_equal(kvd_tstore_take1(&s, c), bc);
    free(bb);
    free(bc);
    assert_int_equal(kvd_tstore_find(&s, H(2)), b);
    assert_int_equal(kvd_tstore_find(&s, H(3)), c);
    assert_false(kvd_tstore_in(&s, b, 1));
    assert_true(kvd_tstore_in(&s, b, 2));
    assert_int_equal(kvd_tstore_at(&s, b)->len1, 0);
    assert_int_equal(s.count[0], 1);
    assert_int_equal(s.bytes[0], 30);
    assert_int_equal(kvd_tstore_oldest(&s, 1), d);
    assert_int_equal(s.tail[0], d);
    assert_int_equal(s.count[1], 1);
    kvd_tstore_at(&s, c)->pending = 0;
    kvd_tstore_forget(&s, c);
    kvd_tstore_fini(&s); /* frees d's buffer */
}

static void test_set2_drop2_slot_reuse(void **state) {
    (void)state;
    kvd_tstore s;
    kvd_tstore_init(&s);
    uint64_t s0, s1, s2;
    assert_int_equal(kvd_tstore_slot2(&s, &s0), KV_OK);
    assert_int_equal(kvd_tstore_slot2(&s, &s1), KV_OK);
    assert_int_equal(s0, 0);
    assert_int_equal(s1, 1);
    assert_int_equal(s.next_slot2, 2);
    uint32_t a = get(&s, 1), b = get(&s, 2);
    kvd_tstore_set2(&s, a, s0, 1000, 2, 41, SLOT_BYTES);
    kvd_tstore_set2(&s, b, s1, 2000, 1, 42, SLOT_BYTES);
    assert_int_equal(s.count[1], 2);
    assert_int_equal(s.bytes[1], 2 * SLOT_BYTES);
    assert_int_equal(s.count[0] + s.bytes[0], 0);
    const kvd_tentry *e = kvd_tstore_at(&s, b);
    assert_true(e->in2);
    assert_int_equal(e->slot2, 1);
    assert_int_equal(e->len2, 2000);
    assert_int_equal(e->fmt2, 1);
    assert_int_equal(e->seq, 42);
    assert_true(kvd_tstore_in(&s, b, 2));
    assert_false(kvd_tstore_in(&s, b, 1));
    /* Drop from T2: the slot goes back and is handed out before a never-used one. */
    kvd_tstore_drop(&s, a, 2, SLOT_BYTES);
    assert_int_equal(s.count[1], 1);
    assert_int_equal(s.bytes[1], SLOT_BYTES);
    assert_int_equal(s.nfree2, 1);
    assert_int_equal(kvd_tstore_find(&s, H(1)), KVD_TNONE);
    assert_int_equal(kvd_tstore_slot2(&s, &s2), KV_OK);
    assert_int_equal(s2, 0);
    assert_int_equal(s.nfree2, 0);
    assert_int_equal(kvd_tstore_slot2(&s, &s2), KV_OK);
    assert_int_equal(s2, 2);
    /* Slots given back by hand (writes that failed) are reused first, all of them, then the
     * never-used ones go on from where they were. */
    kvd_tstore_slot2_back(&s, 2);
    kvd_tstore_slot2_back(&s, 0);
    uint64_t x, y, z;
    assert_int_equal(kvd_tstore_slot2(&s, &x), KV_OK);
    assert_int_equal(kvd_tstore_slot2(&s, &y), KV_OK);
    assert_int_equal(kvd_tstore_slot2(&s, &z), KV_OK);
    assert_true((x == 0 && y == 2) || (x == 2 && y == 0));
    assert_int_equal(z, 3);
    /* Many slots given back (the free list grows). */
    for (uint64_t k = 0; k < 200; k++) {
        kvd_tstore_slot2_back(&s, 1000 + k);
    }
    assert_int_equal(s.nfree2, 200);
    for (int k = 0; k < 200; k++) {
        assert_int_equal(kvd_tstore_slot2(&s, &x), KV_OK);
        assert_true(x >= 1000 && x < 1200);
    }
    /* A slot given back at or past the never-used run (a restart's scan found an older
     * duplicate there) moves the run past it, so no slot is handed out twice. */
    assert_int_equal(kvd_tstore_slot2(&s, &x), KV_OK);
    assert_int_equal(x, 1200);
    kvd_tstore_drop(&s, b, 2, SLOT_BYTES);
    assert_int_equal(s.count[1] + s.bytes[1], 0);
    assert_int_equal(s.n, 0);
    kvd_tstore_fini(&s);
}

static void test_drop_frees_unless_pending(void **state) {
    (void)state;
    kvd_tstore s;
    kvd_tstore_init(&s);
    /* In both tiers: dropping one keeps the entry, dropping the other frees it. */
    uint32_t a = get(&s, 1);
    kvd_tstore_set1(&s, a, buf(10), 10, 0);
    kvd_tstore_set2(&s, a, 0, 10, 0, 1, SLOT_BYTES);
    kvd_tstore_drop(&s, a, 1, SLOT_BYTES);
    assert_int_equal(kvd_tstore_find(&s, H(1)), a);
    assert_false(kvd_tstore_in(&s, a, 1));
    assert_true(kvd_tstore_in(&s, a, 2));
    kvd_tstore_drop(&s, a, 2, SLOT_BYTES);
    assert_int_equal(kvd_tstore_find(&s, H(1)), KVD_TNONE);
    assert_int_equal(s.n, 0);
    /* Its index is the next one made. */
    uint32_t b = get(&s, 2);
    assert_int_equal(b, a);
    assert_true(kv_hash_eq(kvd_tstore_at(&s, b)->hash, H(2)));
    assert_int_equal(kvd_tstore_find(&s, H(1)), KVD_TNONE);
    /* Pending: a copy is in flight, so the entry stays though it is in neither tier. */
    kvd_tstore_set1(&s, b, buf(20), 20, 0);
    kvd_tstore_at(&s, b)->pending = KVD_TPEND_T2;
    kvd_tstore_drop(&s, b, 1, SLOT_BYTES);
    assert_int_equal(kvd_tstore_find(&s, H(2)), b);
    assert_true(kvd_tstore_at(&s, b)->used);
    assert_int_equal(s.count[0] + s.bytes[0], 0);
    assert_int_equal(s.n, 1);
    /* Another get does not take its index. */
    uint32_t c = get(&s, 3);
    assert_int_not_equal(c, b);
    /* The copy landed in T2, then that goes too: now the entry is freed. */
    kvd_tstore_at(&s, b)->pending = 0;
    kvd_tstore_set2(&s, b, 7, 20, 0, 2, SLOT_BYTES);
    kvd_tstore_drop(&s, b, 2, SLOT_BYTES);
    assert_int_equal(kvd_tstore_find(&s, H(2)), KVD_TNONE);
    assert_int_equal(s.n, 1);
    /* Pending with no copy at all: a drop of a tier it is not in keeps it; cleared, the same
     * drop frees it. */
    kvd_tstore_at(&s, c)->pending = KVD_TPEND_T1;
    kvd_tstore_drop(&s, c, 1, SLOT_BYTES);
    assert_int_equal(kvd_tstore_find(&s, H(3)), c);
    kvd_tstore_at(&s, c)->pending = 0;
    kvd_tstore_drop(&s, c, 1, SLOT_BYTES);
    assert_int_equal(kvd_tstore_find(&s, H(3)), KVD_TNONE);
    assert_int_equal(s.n, 0);
    /* Freed indices are reused before the array grows. */
    uint32_t cap = s.cap;
    uint32_t d = get(&s, 4), f = get(&s, 5);
    assert_true((d == b && f == c) || (d == c && f == b));
    assert_int_equal(s.cap, cap);
    kvd_tstore_fini(&s);
}

/* Entries of tier in LRU order, oldest first, from the store's links. */
static int lru_order(const kvd_tstore *s, int tier, uint32_t *out, int max) {
    int n = 0;
    for (uint32_t i = s->head[tier - 1]; i != KVD_TNONE && n < max; i = s->e[i].next[tier - 1]) {
        out[n++] = i;
    }
    return n;
}

static void test_touch_moves_to_newest(void **state) {
    (void)state;
    kvd_tstore s;
    kvd_tstore_init(&s);
    uint32_t a = get(&s, 1), b = get(&s, 2), c = get(&s, 3), d = get(&s, 4);
    /* T1 order a, b, c; T2 order c, a, b; d only in T2, after them. */
    kvd_tstore_set1(&s, a, buf(1), 1, 0);
    kvd_tstore_set1(&s, b, buf(1), 1, 0);
    kvd_tstore_set1(&s, c, buf(1), 1, 0);
    kvd_tstore_set2(&s, c, 0, 1, 0, 1, SLOT_BYTES);
    kvd_tstore_set2(&s, a, 1, 1, 0, 2, SLOT_BYTES);
    kvd_tstore_set2(&s, b, 2, 1, 0, 3, SLOT_BYTES);
    kvd_tstore_set2(&s, d, 3, 1, 0, 4, SLOT_BYTES);
    assert_int_equal(kvd_tstore_oldest(&s, 1), a);
    assert_int_equal(kvd_tstore_oldest(&s, 2), c);
    /* Touching a: newest of both its tiers. */
    kvd_tstore_touch(&s, a);
    assert_int_equal(kvd_tstore_at(&s, a)->hits, 1);
    uint32_t o[8];
    assert_int_equal(lru_order(&s, 1, o, 8), 3);
    assert_int_equal(o[0], b);
    assert_int_equal(o[1], c);
    assert_int_equal(o[2], a);
    assert_int_equal(s.tail[0], a);
    assert_int_equal(lru_order(&s, 2, o, 8), 4);
    assert_int_equal(o[0], c);
    assert_int_equal(o[1], b);
    assert_int_equal(o[2], d);
    assert_int_equal(o[3], a);
    assert_int_equal(s.tail[1], a);
    /* Touching d (only in T2) leaves T1 alone. */
    kvd_tstore_touch(&s, d);
    assert_int_equal(lru_order(&s, 1, o, 8), 3);
    assert_int_equal(o[0], b);
    assert_int_equal(o[2], a);
    assert_int_equal(s.count[0], 3);
    assert_int_equal(s.tail[1], d);
    /* Touching the newest keeps it newest; touching the oldest makes the next one oldest. */
    kvd_tstore_touch(&s, d);
    assert_int_equal(s.tail[1], d);
    assert_int_equal(kvd_tstore_at(&s, d)->hits, 2);
    kvd_tstore_touch(&s, c);
    assert_int_equal(kvd_tstore_oldest(&s, 1), b);
    assert_int_equal(kvd_tstore_oldest(&s, 2), b);
    /* Taking the oldest one at a time gives the whole order: T1 b, a, c; T2 b, a, d, c. */
    uint32_t want1[3] = {b, a, c};
    for (int k = 0; k < 3; k++) {
        uint32_t v = kvd_tstore_oldest(&s, 1);
        assert_int_equal(v, want1[k]);
        kvd_tstore_drop(&s, v, 1, SLOT_BYTES);
    }
    assert_int_equal(kvd_tstore_oldest(&s, 1), KVD_TNONE);
    uint32_t want2[4] = {b, a, d, c};
    for (int k = 0; k < 4; k++) {
        uint32_t v = kvd_tstore_oldest(&s, 2);
        assert_int_equal(v, want2[k]);
        kvd_tstore_drop(&s, v, 2, SLOT_BYTES);
    }
    assert_int_equal(kvd_tstore_oldest(&s, 2), KVD_TNONE);
    assert_int_equal(s.n, 0);
    /* Hits saturate. */
    uint32_t e = get(&s, 9);
    kvd_tstore_set1(&s, e, buf(1), 1, 0);
    kvd_tstore_at(&s, e)->hits = UINT32_MAX - 1;
    kvd_tstore_touch(&s, e);
    kvd_tstore_touch(&s, e);
    assert_int_equal(kvd_tstore_at(&s, e)->hits, UINT32_MAX);
    kvd_tstore_fini(&s);
}

static void test_oldest_skips_busy(void **state) {
    (void)state;
    kvd_tstore s;
    kvd_tstore_init(&s);
    uint32_t a = get(&s, 1), b = get(&s, 2), c = get(&s, 3);
    for (uint32_t i = 0; i < 3; i++) {
        uint32_t v = i == 0 ? a : i == 1 ? b : c;
        kvd_tstore_set1(&s, v, buf(8), 8, 0);
        kvd_tstore_set2(&s, v, i, 8, 0, i, SLOT_BYTES);
    }
    kvd_tstore_at(&s, a)->busy = 1;
    assert_int_equal(kvd_tstore_oldest(&s, 1), b);
    assert_int_equal(kvd_tstore_oldest(&s, 2), b);
    kvd_tstore_at(&s, b)->busy = 2;
    assert_int_equal(kvd_tstore_oldest(&s, 1), c);
    assert_int_equal(kvd_tstore_oldest(&s, 2), c);
    kvd_tstore_at(&s, c)->busy = 1;
    assert_int_equal(kvd_tstore_oldest(&s, 1), KVD_TNONE);
    assert_int_equal(kvd_tstore_oldest(&s, 2), KVD_TNONE);
    /* Busy entries keep their place: not busy again, a is the oldest again. */
    kvd_tstore_at(&s, a)->busy = 0;
    kvd_tstore_at(&s, b)->busy = 0;
    kvd_tstore_at(&s, c)->busy = 0;
    assert_int_equal(kvd_tstore_oldest(&s, 1), a);
    assert_int_equal(kvd_tstore_oldest(&s, 2), a);
    /* The middle one busy: the oldest is still the head. */
    kvd_tstore_at(&s, b)->busy = 1;
    assert_int_equal(kvd_tstore_oldest(&s, 1), a);
    kvd_tstore_drop(&s, a, 1, SLOT_BYTES);
    assert_int_equal(kvd_tstore_oldest(&s, 1), c);
    assert_int_equal(kvd_tstore_oldest(&s, 2), a);
    kvd_tstore_at(&s, b)->busy = 0;
    kvd_tstore_fini(&s);
}

static void test_unlink2_keeps_slot(void **state) {
    (void)state;
    kvd_tstore s;
    kvd_tstore_init(&s);
    uint32_t a = get(&s, 1), b = get(&s, 2);
    kvd_tstore_set2(&s, a, 5, 10, 0, 1, SLOT_BYTES);
    kvd_tstore_set1(&s, b, buf(30), 30, 0);
    kvd_tstore_set2(&s, b, 6, 10, 0, 2, SLOT_BYTES);
    assert_int_equal(s.next_slot2, 7);
    /* Only in T2: out of the store at once, the slot returned, not on the free list. */
    assert_int_equal(kvd_tstore_unlink2(&s, a, SLOT_BYTES), 5);
    assert_int_equal(kvd_tstore_find(&s, H(1)), KVD_TNONE);
    assert_int_equal(s.count[1], 1);
    assert_int_equal(s.bytes[1], SLOT_BYTES);
    assert_int_equal(s.nfree2, 0);
    uint64_t x;
    assert_int_equal(kvd_tstore_slot2(&s, &x), KV_OK);
    assert_int_equal(x, 7);
    /* Also in T1: the entry stays there. */
    assert_int_equal(kvd_tstore_unlink2(&s, b, SLOT_BYTES), 6);
    assert_int_equal(kvd_tstore_find(&s, H(2)), b);
    assert_true(kvd_tstore_in(&s, b, 1));
    assert_false(kvd_tstore_in(&s, b, 2));
    assert_int_equal(kvd_tstore_oldest(&s, 2), KVD_TNONE);
    assert_int_equal(s.count[1] + s.bytes[1], 0);
    assert_int_equal(s.count[0], 1);
    assert_int_equal(s.nfree2, 0);
    /* Pending and only in T2: kept. */
    uint32_t c = get(&s, 3);
    kvd_tstore_set2(&s, c, 8, 10, 0, 3, SLOT_BYTES);
    kvd_tstore_at(&s, c)->pending = KVD_TPEND_T1;
    assert_int_equal(kvd_tstore_unlink2(&s, c, SLOT_BYTES), 8);
    assert_int_equal(kvd_tstore_find(&s, H(3)), c);
    kvd_tstore_at(&s, c)->pending = 0;
    kvd_tstore_forget(&s, c);
    /* The caller zeroed the slots and gives them back: now they are reused. */
    kvd_tstore_slot2_back(&s, 5);
    kvd_tstore_slot2_back(&s, 6);
    assert_int_equal(s.nfree2, 2);
    uint64_t y;
    assert_int_equal(kvd_tstore_slot2(&s, &x), KV_OK);
    assert_int_equal(kvd_tstore_slot2(&s, &y), KV_OK);
    assert_true((x == 5 && y == 6) || (x == 6 && y == 5));
    kvd_tstore_fini(&s);
}

static void test_forget(void **state) {
    (void)state;
    kvd_tstore s;
    kvd_tstore_init(&s);
    uint32_t a = get(&s, 1), b = get(&s, 2), c = get(&s, 3);
    assert_int_equal(s.n, 3);
    kvd_tstore_forget(&s, b);
    assert_int_equal(s.n, 2);
    assert_int_equal(kvd_tstore_find(&s, H(2)), KVD_TNONE);
    assert_int_equal(kvd_tstore_find(&s, H(1)), a);
    assert_int_equal(kvd_tstore_find(&s, H(3)), c);
    assert_false(kvd_tstore_at(&s, b)->used);
    /* Its index comes back with the next entry made. */
    assert_int_equal(get(&s, 4), b);
    kvd_tstore_forget(&s, a);
    kvd_tstore_forget(&s, c);
    kvd_tstore_forget(&s, b);
    assert_int_equal(s.n, 0);
    for (uint64_t k = 1; k <= 4; k++) {
        assert_int_equal(kvd_tstore_find(&s, H(k)), KVD_TNONE);
    }
    kvd_tstore_fini(&s);
}

static void test_set2_moves_next_slot2(void **state) {
    (void)state;
    kvd_tstore s;
    kvd_tstore_init(&s);
    assert_int_equal(s.next_slot2, 0);
    /* A restart's scan records slots it found: the never-used ones start after the highest. */
    uint32_t a = get(&s, 1), b = get(&s, 2), c = get(&s, 3);
    kvd_tstore_set2(&s, a, 10, 1, 0, 1, SLOT_BYTES);
    assert_int_equal(s.next_slot2, 11);
    kvd_tstore_set2(&s, b, 3, 1, 0, 2, SLOT_BYTES);
    assert_int_equal(s.next_slot2, 11);
    uint64_t x;
    assert_int_equal(kvd_tstore_slot2(&s, &x), KV_OK);
    assert_int_equal(x, 11);
    assert_int_equal(s.next_slot2, 12);
    kvd_tstore_set2(&s, c, 12, 1, 0, 3, SLOT_BYTES);
    assert_int_equal(s.next_slot2, 13);
    assert_int_equal(kvd_tstore_slot2(&s, &x), KV_OK);
    assert_int_equal(x, 13);
    assert_int_equal(s.count[1], 3);
    assert_int_equal(s.bytes[1], 3 * SLOT_BYTES);
    kvd_tstore_fini(&s);
}

/* Owners: each tenant's entries are counted and ordered per tier apart from the others; an
 * entry in a tier keeps its owner; busy entries are skipped; the owner table grows. */
static void test_owners(void **state) {
    (void)state;
    kvd_tstore s;
    kvd_tstore_init(&s);
    uint32_t a = get(&s, 1), b = get(&s, 2), c = get(&s, 3), d = get(&s, 4);
    assert_int_equal(kvd_tstore_owner(&s, a), UINT32_MAX); /* none until charged */
    assert_int_equal(kvd_tstore_own(&s, a, 7), KV_OK);
    assert_int_equal(kvd_tstore_own(&s, b, 7), KV_OK);
    assert_int_equal(kvd_tstore_own(&s, c, 9), KV_OK);
    kvd_tstore_set1(&s, a, buf(1), 1, 0);
    kvd_tstore_set1(&s, c, buf(1), 1, 0);
    kvd_tstore_set1(&s, b, buf(1), 1, 0);
    kvd_tstore_set1(&s, d, buf(1), 1, 0);
    assert_int_equal(kvd_tstore_owner(&s, a), 7);
    assert_int_equal(kvd_tstore_owner(&s, c), 9);
    assert_int_equal(kvd_tstore_owner(&s, d), UINT32_MAX);
    assert_int_equal(kvd_tstore_owned(&s, 7, 1), 2);
    assert_int_equal(kvd_tstore_owned(&s, 9, 1), 1);
    assert_int_equal(kvd_tstore_owned(&s, 5, 1), 0);
    assert_int_equal(kvd_tstore_owned(&s, 7, 2), 0);
    assert_int_equal(kvd_tstore_oldest_of(&s, 7, 1), a);
    assert_int_equal(kvd_tstore_oldest_of(&s, 9, 1), c);
    assert_int_equal(kvd_tstore_oldest_of(&s, 5, 1), KVD_TNONE);
    /* A present entry keeps its owner. */
    assert_int_equal(kvd_tstore_own(&s, c, 7), KV_OK);
    assert_int_equal(kvd_tstore_owner(&s, c), 9);
    /* Touch moves it to its owner's newest too; busy ones are skipped. */
    kvd_tstore_touch(&s, a);
    assert_int_equal(kvd_tstore_oldest_of(&s, 7, 1), b);
    kvd_tstore_at(&s, b)->busy = 1;
    assert_int_equal(kvd_tstore_oldest_of(&s, 7, 1), a);
    kvd_tstore_at(&s, b)->busy = 0;
    /* T2 is counted apart; leaving T1 keeps the T2 count. */
    kvd_tstore_set2(&s, a, 0, 1, 0, 1, SLOT_BYTES);
    assert_int_equal(kvd_tstore_owned(&s, 7, 2), 1);
    free(kvd_tstore_take1(&s, a));
    assert_int_equal(kvd_tstore_owned(&s, 7, 1), 1);
    assert_int_equal(kvd_tstore_owned(&s, 7, 2), 1);
    assert_int_equal(kvd_tstore_oldest_of(&s, 7, 2), a);
    assert_int_equal(kvd_tstore_unlink2(&s, a, SLOT_BYTES), 0);
    assert_int_equal(kvd_tstore_owned(&s, 7, 2), 0);
    assert_int_equal(kvd_tstore_oldest_of(&s, 7, 2), KVD_TNONE);
    kvd_tstore_drop(&s, b, 1, SLOT_BYTES);
    assert_int_equal(kvd_tstore_owned(&s, 7, 1), 0);
    assert_int_equal(kvd_tstore_oldest_of(&s, 7, 1), KVD_TNONE);
    /* Many owners: the table grows, each keeps its entries. */
    uint32_t many[40];
    for (uint32_t k = 0; k < 40; k++) {
        many[k] = get(&s, 100 + k);
        assert_int_equal(kvd_tstore_own(&s, many[k], 1000 + k % 20), KV_OK);
        kvd_tstore_set1(&s, many[k], buf(1), 1, 0);
    }
    for (uint32_t k = 0; k < 20; k++) {
        assert_int_equal(kvd_tstore_owned(&s, 1000 + k, 1), 2);
        assert_int_equal(kvd_tstore_oldest_of(&s, 1000 + k, 1), many[k]);
    }
    assert_int_equal(kvd_tstore_owned(&s, 9, 1), 1);
    kvd_tstore_fini(&s);
}

/* An owner's T1 bytes follow its entries' len1 through set1, touch, take1 and drop; entries of
 * nobody and T2 records are not in it. */
static void test_owner_bytes(void **state) {
    (void)state;
    kvd_tstore s;
    kvd_tstore_init(&s);
    uint32_t a = get(&s, 1), b = get(&s, 2), c = get(&s, 3), d = get(&s, 4);
    assert_int_equal(kvd_tstore_own(&s, a, 7), KV_OK);
    assert_int_equal(kvd_tstore_own(&s, b, 7), KV_OK);
    assert_int_equal(kvd_tstore_own(&s, c, 9), KV_OK);
    kvd_tstore_set1(&s, a, buf(100), 100, 0);
    kvd_tstore_set1(&s, b, buf(300), 300, 0);
    kvd_tstore_set1(&s, c, buf(50), 50, 0);
    kvd_tstore_set1(&s, d, buf(70), 70, 0); /* nobody's */
    assert_int_equal(kvd_tstore_owned_bytes1(&s, 7), 400);
    assert_int_equal(kvd_tstore_owned_bytes1(&s, 9), 50);
    assert_int_equal(kvd_tstore_owned_bytes1(&s, 5), 0);
    kvd_tstore_touch(&s, a);
    assert_int_equal(kvd_tstore_owned_bytes1(&s, 7), 400);
    kvd_tstore_set2(&s, b, 0, 300, 0, 1, SLOT_BYTES);
    assert_int_equal(kvd_tstore_owned_bytes1(&s, 7), 400);
    free(kvd_tstore_take1(&s, b));
    assert_int_equal(kvd_tstore_owned_bytes1(&s, 7), 100);
    kvd_tstore_drop(&s, a, 1, SLOT_BYTES);
    assert_int_equal(kvd_tstore_owned_bytes1(&s, 7), 0);
    kvd_tstore_drop(&s, c, 1, SLOT_BYTES);
    assert_int_equal(kvd_tstore_owned_bytes1(&s, 9), 0);
    assert_int_equal(s.bytes[0], 70);
    kvd_tstore_fini(&s);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_empty),
        cmocka_unit_test(test_get_makes_then_finds),
        cmocka_unit_test(test_many_survive_growth),
        cmocka_unit_test(test_set1_drop1),
        cmocka_unit_test(test_take1),
        cmocka_unit_test(test_set2_drop2_slot_reuse),
        cmocka_unit_test(test_drop_frees_unless_pending),
        cmocka_unit_test(test_touch_moves_to_newest),
        cmocka_unit_test(test_oldest_skips_busy),
        cmocka_unit_test(test_unlink2_keeps_slot),
        cmocka_unit_test(test_forget),
        cmocka_unit_test(test_owners),
        cmocka_unit_test(test_owner_bytes),
        cmocka_unit_test(test_set2_moves_next_slot2),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
