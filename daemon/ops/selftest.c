/* kvd_selftest: the isolation self-test drives the same pool, index and session-table code the
 * request handlers use, with in-memory sessions of two internal tenants, on the live server.
 */
#include "daemon/ops/selftest.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "common/kv_log.h"
#include "daemon/registry/registry.h"
#include "daemon/tiers/tiers.h"

#define ST_BLOCKS 2

typedef struct st_report {
    char *buf;    /* the caller's report */
    size_t len;   /* its capacity */
    size_t off;   /* bytes written */
    int failures; /* checks that did not hold */
} st_report;

static void note(st_report *r, int ok, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

static void note(st_report *r, int ok, const char *fmt, ...) {
    if (!ok) {
        r->failures++;
    }
    if (r->off + 1 >= r->len) {
        return;
    }
    int n = snprintf(r->buf + r->off, r->len - r->off, "%s ", ok ? "ok" : "FAIL");
    if (n > 0) {
        r->off += (size_t)n < r->len - r->off ? (size_t)n : r->len - r->off - 1;
    }
    va_list ap;
    va_start(ap, fmt);
    n = vsnprintf(r->buf + r->off, r->len - r->off, fmt, ap);
    va_end(ap);
    if (n > 0) {
        r->off += (size_t)n < r->len - r->off ? (size_t)n : r->len - r->off - 1;
    }
    if (r->off + 1 < r->len) {
        r->buf[r->off++] = '\n';
        r->buf[r->off] = '\0';
    }
}

/* Fills (write) or reads the K run of layer 0 of block id through the backend: on GPU backends
 * segment bases are device addresses, reached only with the driver's copies. */
static kv_err block_io(kvd_ops *s, kvd_pool *pool, uint32_t id, uint8_t *buf, size_t n, int write) {
    const kvd_pool_config *pc = kvd_pool_config_get(pool);
    const kvd_segment_mem *m = kvd_pool_segment(pool, id / pc->blocks_per_segment);
    if (m == NULL) {
        return KV_ENOENT;
    }
    uint64_t off = kv_layout_offset(&pc->layout, pc->blocks_per_segment,
                                    id % pc->blocks_per_segment, 0, KV_K, 0, 0);
    return write ? kvd_segment_write(s->reg->be, s->reg->be_ctx, m, off, buf, n)
                 : kvd_segment_read(s->reg->be, s->reg->be_ctx, m, off, buf, n);
}

kv_err kvd_selftest_isolation(kvd_ops *s, char *report, size_t len) {
    st_report r = {report, len, 0, 0};
    if (len > 0) {
        report[0] = '\0';
    }
    uint32_t ta, tb;
    kv_err rc = kvd_tenants_add_internal(s->reg->tenants, "selftest:a", &ta);
    if (rc == KV_OK) {
        rc = kvd_tenants_add_internal(s->reg->tenants, "selftest:b", &tb);
    }
    if (rc != KV_OK) {
        note(&r, 0, "cannot make the throwaway tenants: %s", kv_strerror(rc));
        return rc;
    }
    kv_layout l;
    KV_ASSERT(kv_layout_init(1, 1, 64, 16, KV_DTYPE_FP16, KV_LAYER_MAJOR, &l) == KV_OK);
    KV_ASSERT(l.kv_block_bytes == 16 * 64 * 2); /* block_io's runs */
    char model[64];
    snprintf(model, sizeof(model), "kvd-selftest-%016llx", (unsigned long long)s->boot_epoch);
    char msg[KV_ERRMSG];
    uint32_t pa, pb;
    rc = kvd_registry_pool_open(s->reg, model, &l, ta, &pa, msg);
    if (rc != KV_OK) {
        note(&r, 0, "no pool for tenant selftest:a: %s", msg);
        return rc;
    }
    rc = kvd_registry_pool_open(s->reg, model, &l, tb, &pb, msg);
    if (rc != KV_OK) {
        note(&r, 0, "no pool for tenant selftest:b: %s", msg);
        kvd_registry_pool_close(s->reg, pa);
        return rc;
    }
    kvd_pool *poola = kvd_registry_pool(s->reg, pa)->pool;
    kvd_pool *poolb = kvd_registry_pool(s->reg, pb)->pool;
    note(&r, pa != pb, "different tenants get different pools (%u, %u)", pa, pb);

    kvd_session a1, a2, b1;
    kvd_session_init(&a1, kvd_server_take_session_id(s->srv), 0, 0, 0);
    kvd_session_init(&a2, kvd_server_take_session_id(s->srv), 0, 0, 0);
    kvd_session_init(&b1, kvd_server_take_session_id(s->srv), 0, 0, 0);
    a1.tenant = a2.tenant = ta;
    b1.tenant = tb;
    a1.hello = a2.hello = b1.hello = 1;
    kvd_session_pool *spa1, *spa2, *spb1;
    kv_hash128 h[ST_BLOCKS];
    kvd_block_ref w[ST_BLOCKS], canon[ST_BLOCKS], hit[ST_BLOCKS];
    size_t nhit = 0;
    rc = kvd_session_add_pool(&a1, pa, poola, &spa1);
    if (rc == KV_OK) {
        rc = kvd_session_add_pool(&a2, pa, poola, &spa2);
    }
    if (rc == KV_OK) {
        rc = kvd_session_add_pool(&b1, pb, poolb, &spb1);
    }
    if (rc != KV_OK) {
        note(&r, 0, "no memory for the sessions");
        goto cleanup;
    }
    /* a1 writes and commits a two-block prefix with hashes nobody else uses. */
    rc = kvd_pool_allocate(poola, ST_BLOCKS, a1.id, ta, w);
    if (rc != KV_OK) {
        note(&r, 0, "allocate in selftest:a's pool: %s", kv_strerror(rc));
        goto cleanup;
    }
    for (uint32_t i = 0; i < ST_BLOCKS; i++) {
        KV_ASSERT(kvd_refs_add(&spa1->refs, w[i].id, w[i].gen, 1) == KV_OK);
        uint8_t run[16 * 64 * 2]; /* l.kv_block_bytes: 16 tokens x 1 head x 64 x fp16 */
        memset(run, 0xA0 + (int)i, sizeof(run));
        rc = block_io(s, poola, w[i].id, run, sizeof(run), 1);
        if (rc != KV_OK) {
            note(&r, 0, "writing selftest:a's block %u: %s", w[i].id, kv_strerror(rc));
            goto cleanup;
        }
        h[i].lo = s->boot_epoch ^ (0x5e1f7e57ull + i);
        h[i].hi = (uint64_t)pa << 32 | (uint64_t)b1.id;
        rc = kvd_pool_commit(poola, a1.id, w[i], h[i], i == 0 ? KVD_NO_BLOCK : canon[i - 1].id,
                             &canon[i]);
        if (rc != KV_OK) {
            note(&r, 0, "commit in selftest:a's pool: %s", kv_strerror(rc));
            goto cleanup;
        }
    }
    note(&r, 1, "selftest:a committed %d blocks in pool %u", ST_BLOCKS, pa);

    /* Different domain: b's lookup of the same hashes in its own pool finds nothing. */
    rc = kvd_pool_lookup(poolb, tb, h, ST_BLOCKS, hit, &nhit);
    note(&r, rc == KV_OK && nhit == 0, "different domain -> no hit (selftest:b got %zu of %d)",
         nhit, ST_BLOCKS);
    if (rc == KV_OK && nhit > 0) {
        (void)kvd_pool_release(poolb, b1.id, tb, hit, nhit);
    }
    note(&r, kvd_session_find_pool(&b1, pa) == NULL, "selftest:b cannot name selftest:a's pool %u",
         pa);
    uint64_t v;
    note(&r, kvd_index_find(s->reg->index, pb, h[0], &v) == KV_ENOENT,
         "the index has no entry for the hash under selftest:b's pool");

    /* Same domain: a second session of a hits both blocks and reads a1's bytes. */
    nhit = 0;
    rc = kvd_pool_lookup(poola, ta, h, ST_BLOCKS, hit, &nhit);
    int same = rc == KV_OK && nhit == ST_BLOCKS;
    for (size_t i = 0; i < nhit; i++) {
        same &= hit[i].id == canon[i].id && hit[i].gen == canon[i].gen;
        KV_ASSERT(kvd_refs_add(&spa2->refs, hit[i].id, hit[i].gen, 1) == KV_OK);
        uint8_t run[16 * 64 * 2];
        same &= block_io(s, poola, hit[i].id, run, sizeof(run), 0) == KV_OK && run[0] == 0xA0 + i &&
                run[sizeof(run) - 1] == 0xA0 + i;
    }
    note(&r, same, "same domain -> hit (selftest:a's second session got %zu of %d, same bytes)",
         nhit, ST_BLOCKS);
    if (nhit > 0) {
        (void)kvd_pool_release(poola, a2.id, ta, hit, nhit);
        for (size_t i = 0; i < nhit; i++) {
            (void)kvd_refs_sub(&spa2->refs, hit[i].id, 1);
        }
    }

    /* Lower tiers: a's blocks copied into tier 1 and evicted from T0 are found below T0 by a,
     * never by b; each domain's tier-2 file is its own. */
    if (kvd_tiers_on(s->tiers)) {
        kvd_reg_pool *rpa = kvd_registry_pool(s->reg, pa);
        kv_err trc = KV_OK;
        for (uint32_t i = 0; trc == KV_OK && i < ST_BLOCKS; i++) {
            trc = kvd_tiers_selftest_put(s->tiers, rpa, canon[i], h[i]);
        }
        if (trc == KV_OK) {
            (void)kvd_pool_release(poola, a1.id, ta, canon, ST_BLOCKS);
            for (uint32_t i = 0; i < ST_BLOCKS; i++) {
                (void)kvd_refs_sub(&spa1->refs, canon[i].id, 1);
            }
            size_t ne = 0;
            (void)kvd_pool_evict(poola, ST_BLOCKS, -1, KVD_EVICT_ADMIN, 0, NULL, &ne);
            kvd_tier_run ra, rb;
            kvd_tiers_probe(s->tiers, rpa, h, ST_BLOCKS, &ra);
            kvd_tiers_probe(s->tiers, kvd_registry_pool(s->reg, pb), h, ST_BLOCKS, &rb);
            note(&r, ne == ST_BLOCKS && ra.t1 == ST_BLOCKS,
                 "tier 1: selftest:a's evicted blocks are found below T0 by a (%u of %d)", ra.t1,
                 ST_BLOCKS);
            note(&r, rb.fetchable == 0,
                 "tier 1: selftest:b's pool finds none of them (%u of %d below T0)", rb.fetchable,
                 ST_BLOCKS);
        } else if (trc == KV_ENOTSUP) {
            note(&r, 1, "tier 1 is off: not checked");
        } else {
            note(&r, 0, "tier 1: cannot copy selftest:a's blocks: %s", kv_strerror(trc));
        }
        char fa[1400], fb[1400];
        kvd_tiers_t2_file(s->tiers, rpa, "selftest:a", fa, sizeof(fa));
        kvd_tiers_t2_file(s->tiers, kvd_registry_pool(s->reg, pb), "selftest:b", fb, sizeof(fb));
        if (fa[0] != '\0') {
            note(&r,
                 strcmp(fa, fb) != 0 && strchr(fa + strlen(s->cfg->tier2_path) + 1, '/') != NULL,
                 "tier 2: each domain has its own directory and file (%s, %s)", fa, fb);
        } else {
            note(&r, 1, "tier 2 is off: not checked");
        }
    }
    rc = r.failures == 0 ? KV_OK : KV_EINTERNAL;
cleanup:
    kvd_session_fini(&a1);
    kvd_session_fini(&a2);
    kvd_session_fini(&b1);
    kvd_registry_pool_close(s->reg, pa);
    kvd_registry_pool_close(s->reg, pb);
    if (rc == KV_EINTERNAL) {
        KV_LOG(ERROR, "KVD-SELFTEST", "isolation self-test failed:\n%s", report);
    }
    return rc;
}
