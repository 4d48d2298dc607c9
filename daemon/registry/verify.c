/* kvd_verify: checksums of committed blocks, checked on hits (see verify.h). */
#include "daemon/registry/verify.h"

#include <stdlib.h>
#include <string.h>

#include <xxhash.h>

#include "common/kv_hash.h"
#include "common/kv_layout.h"
#include "common/kv_log.h"

/* Sums one run of a segment into st, through a bounce buffer (device memory is reached only
 * with the backend's copies). */
static kv_err sum_run(XXH3_state_t *st, const kvd_backend_ops *be, void *ctx,
                      const kvd_segment_mem *m, uint64_t off, uint64_t n, uint8_t *buf,
                      size_t cap) {
    while (n > 0) {
        size_t k = n < cap ? (size_t)n : cap;
        kv_err rc = kvd_segment_read(be, ctx, m, off, buf, k);
        if (rc != KV_OK) {
            return rc;
        }
        (void)XXH3_64bits_update(st, buf, k);
        off += k;
        n -= k;
    }
    return KV_OK;
}

kv_err kvd_verify_block_sum(const kvd_backend_ops *be, void *ctx, const kvd_pool *pool, uint32_t id,
                            uint64_t *out) {
    const kvd_pool_config *pc = kvd_pool_config_get(pool);
    const kv_layout *l = &pc->layout;
    uint32_t bps = pc->blocks_per_segment;
    const kvd_segment_mem *m = kvd_pool_segment(pool, id / bps);
    if (m == NULL) {
        return KV_ENOENT;
    }
    uint32_t b = id % bps;
    enum { CAP = 64 * 1024 };
    uint8_t *buf = malloc(CAP);
    XXH3_state_t *st = XXH3_createState();
    kv_err rc = buf == NULL || st == NULL ? KV_ENOMEM : KV_OK;
    if (rc == KV_OK) {
        (void)XXH3_64bits_reset(st);
    }
    if (rc == KV_OK && l->arrangement == KV_BLOCK_MAJOR) {
        /* One run: the block's elements, then its scales. */
        rc = sum_run(st, be, ctx, m, kv_layout_offset(l, bps, b, 0, KV_K, 0, 0), l->block_bytes,
                     buf, CAP);
    }
    for (uint32_t layer = 0;
         rc == KV_OK && l->arrangement == KV_LAYER_MAJOR && layer < l->num_layers; layer++) {
        for (int kv = KV_K; rc == KV_OK && kv <= KV_V; kv++) {
            rc = sum_run(st, be, ctx, m, kv_layout_offset(l, bps, b, layer, kv, 0, 0),
                         l->kv_block_bytes, buf, CAP);
            if (rc == KV_OK && l->scale_bytes != 0) {
                rc = sum_run(st, be, ctx, m, kv_layout_scale_offset(l, bps, b, layer, kv, 0),
                             (uint64_t)l->num_kv_heads * sizeof(float), buf, CAP);
            }
        }
    }
    if (rc == KV_OK) {
        *out = XXH3_64bits_digest(st);
    }
    XXH3_freeState(st);
    free(buf);
    return rc;
}

static kv_err ensure_cap(kvd_verify *v, uint32_t id) {
    if (id < v->cap) {
        return KV_OK;
    }
    uint32_t cap = v->cap ? v->cap : 1024;
    while (cap <= id) {
        cap = cap > UINT32_MAX / 2 ? UINT32_MAX : cap * 2;
    }
    kvd_verify_sum *s = realloc(v->sums, (size_t)cap * sizeof(*s));
    if (s == NULL) {
        return KV_ENOMEM;
    }
    memset(s + v->cap, 0, (size_t)(cap - v->cap) * sizeof(*s));
    v->sums = s;
    v->cap = cap;
    return KV_OK;
}

kv_err kvd_verify_commit(kvd_verify *v, const kvd_backend_ops *be, void *ctx, const kvd_pool *pool,
                         kvd_block_ref blk) {
    kv_err rc = ensure_cap(v, blk.id);
    uint64_t sum = 0;
    if (rc == KV_OK) {
        rc = kvd_verify_block_sum(be, ctx, pool, blk.id, &sum);
    }
    if (rc != KV_OK) {
        return rc;
    }
    v->sums[blk.id] = (kvd_verify_sum){sum, blk.gen, 1};
    return KV_OK;
}

size_t kvd_verify_hits(kvd_verify *v, const kvd_backend_ops *be, void *ctx, kvd_pool *pool,
                       uint32_t pool_id, const kvd_block_ref *hits, size_t n) {
    size_t checked = 0;
    for (size_t i = 0; i < n; i++) {
        kvd_block_ref r = hits[i];
        if (r.id >= v->cap || !v->sums[r.id].set || v->sums[r.id].gen != r.gen) {
            continue; /* committed while the mode was off */
        }
        uint64_t now;
        kv_err rc = kvd_verify_block_sum(be, ctx, pool, r.id, &now);
        if (rc != KV_OK) {
            KV_LOG(WARN, "KVD-VERIFY", "pool %u block %u: cannot read its bytes to verify: %s",
                   pool_id, r.id, kv_strerror(rc));
            continue;
        }
        checked++;
        if (now == v->sums[r.id].sum) {
            continue;
        }
        kvd_block_info info;
        char hex[33] = "?";
        if (kvd_pool_block_info(pool, r.id, &info) == KV_OK) {
            kv_hash_hex(info.hash, hex);
        }
        KV_LOG(ERROR, "KVD-VERIFY",
               "pool %u block %u (hash %s): its bytes changed after the commit (checksum "
               "%016llx, now %016llx): a worker wrote to it after Release or into a block it "
               "only read; quarantined, the Lookup ends before it",
               pool_id, r.id, hex, (unsigned long long)v->sums[r.id].sum, (unsigned long long)now);
        (void)kvd_pool_quarantine(pool, r);
        v->sums[r.id].set = 0;
        kvd_pool_count_verified(pool, checked);
        return i;
    }
    kvd_pool_count_verified(pool, checked);
    return n;
}

void kvd_verify_free(kvd_verify *v) {
    free(v->sums);
    v->sums = NULL;
    v->cap = 0;
}
