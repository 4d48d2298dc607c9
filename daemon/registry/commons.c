/* kvd_commons: blocks enter the commons once min-tenants distinct tenants committed them.
 *
 * The commons counter is a direct-mapped table keyed by (model and layout, block hash) holding
 * the distinct tenants seen so far; a colliding key overwrites the slot. That bounds memory
 * (COMMONS_SLOTS * 56 bytes) whatever clients commit, and can only delay a promotion.
 */
#include "daemon/registry/commons.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/kv_log.h"
#include "daemon/mem/backend_cuda.h"

#define COMMONS_SLOTS (1u << 16)

typedef struct commons_slot {
    kv_hash128 h;                        /* block hash */
    kv_hash128 model;                    /* the pools' model_key (model, layout, flags), not a
                                          * pool id: counts outlive a commons pool freed while
                                          * idle; not the seed, which hash-mode vllm gives every
                                          * model alike (its hashes do not name the model) */
    uint32_t used;                       /* 0 = empty slot */
    uint16_t n;                          /* distinct tenants in tenants[] */
    uint16_t tenants[KVD_COMMONS_MAX_K]; /* who committed h (tenant ids < 4096) */
} commons_slot;

struct kvd_commons {
    commons_slot *slots; /* COMMONS_SLOTS entries */
};

/* The registry's destructor for its commons pointer (kvd_registry.commons_free). */
static void commons_free(struct kvd_commons *c) {
    free(c->slots);
    free(c);
}

/* The one primitive that differs between host and GPU pools: copy n bytes between two segment
 * addresses (kvd_segment_mem.base + offset). ctx is copy_block's. */
typedef kv_err (*copy_fn)(void *ctx, void *dst, const void *src, uint64_t n);

static kv_err copy_host(void *ctx, void *dst, const void *src, uint64_t n) {
    (void)ctx;
    memcpy(dst, src, (size_t)n);
    return KV_OK;
}

/* base is a device address: a device-to-device copy with the daemon's context current (the
 * backend sets it; this is the loop thread, which opened the backend). */
static kv_err copy_device(void *ctx, void *dst, const void *src, uint64_t n) {
    return kvd_backend_cuda_copy(ctx, dst, src, n);
}

/* Copies block src of pool a into block dst of pool b (same layout): every layer's K and V run
 * and, for 8-bit dtypes, every scale, at the offsets of each pool's arrangement (layer-major or
 * block-major) and blocks per segment, each run with copy(ctx, ...). Both segments must be
 * resident (base not NULL: a host mapping or a device address). */
static kv_err copy_block(const kvd_pool *a, uint32_t src, kvd_pool *b, uint32_t dst, copy_fn copy,
                         void *ctx) {
    const kvd_pool_config *ca = kvd_pool_config_get(a);
    const kvd_pool_config *cb = kvd_pool_config_get(b);
    const kvd_segment_mem *ma = kvd_pool_segment(a, src / ca->blocks_per_segment);
    const kvd_segment_mem *mb = kvd_pool_segment(b, dst / cb->blocks_per_segment);
    if (ma == NULL || mb == NULL || ma->base == NULL || mb->base == NULL) {
        return KV_ESTATE;
    }
    const kv_layout *l = &ca->layout;
    uint32_t sa = src % ca->blocks_per_segment, sb = dst % cb->blocks_per_segment;
    kv_err rc = KV_OK;
    for (uint32_t layer = 0; rc == KV_OK && layer < l->num_layers; layer++) {
        for (int kv = KV_K; rc == KV_OK && kv <= KV_V; kv++) {
            uint64_t oa = kv_layout_offset(l, ca->blocks_per_segment, sa, layer, kv, 0, 0);
            uint64_t ob = kv_layout_offset(l, cb->blocks_per_segment, sb, layer, kv, 0, 0);
            rc = copy(ctx, (uint8_t *)mb->base + ob, (const uint8_t *)ma->base + oa,
                      l->kv_block_bytes);
            for (uint32_t h = 0; rc == KV_OK && l->scale_bytes != 0 && h < l->num_kv_heads; h++) {
                uint64_t xa = kv_layout_scale_offset(l, ca->blocks_per_segment, sa, layer, kv, h);
                uint64_t xb = kv_layout_scale_offset(l, cb->blocks_per_segment, sb, layer, kv, h);
                rc = copy(ctx, (uint8_t *)mb->base + xb, (const uint8_t *)ma->base + xa,
                          sizeof(float));
            }
        }
    }
    return rc;
}

/* Copies a promoted block with the server's backend. GPU pools: the segment bases are device
 * addresses, so each run is a cuMemcpyDtoD and one cuCtxSynchronize ends the block before it is
 * committed (a hit may be read at once by another process). Cost, on the loop thread, which
 * blocks meanwhile: 2 * num_layers copies of kv_block_bytes, plus 2 * num_layers * num_kv_heads
 * 4-byte scale copies for 8-bit dtypes, each a driver call of some microseconds, then the
 * synchronize (which also waits for other work queued on the daemon's context; it has none).
 * Estimated, not measured: 32 layers, 8 KV heads, fp16: 64 calls, well under a millisecond; int8:
 * 576 calls, a few milliseconds. It happens once per hash, when the min-tenants-th tenant commits
 * it. */
static kv_err promote_copy(kvd_registry *s, const kvd_pool *a, uint32_t src, kvd_pool *b,
                           uint32_t dst) {
    kvd_backend_cuda_ctx *gpu = s->sel->cuda;
    if (gpu == NULL) {
        return copy_block(a, src, b, dst, copy_host, NULL);
    }
    kv_err rc = copy_block(a, src, b, dst, copy_device, gpu);
    kv_err sync = kvd_backend_cuda_sync(gpu); /* also after a failed copy: nothing in flight */
    return rc != KV_OK ? rc : sync;
}

/* 1 when h entered the commons now (a new block; *ph, *has_parent: its commons parent). */
static int promote(kvd_registry *s, kvd_reg_pool *src, kvd_reg_pool *com, kvd_block_ref blk,
                   kv_hash128 h, kv_hash128 *ph, int *has_parent) {
    int entered = 0;
    *has_parent = 0;
    if (kvd_pool_has(com->pool, h)) {
        return 0; /* already in the commons */
    }
    kvd_block_info info;
    if (kvd_pool_block_info(src->pool, blk.id, &info) != KV_OK || info.gen != blk.gen ||
        (info.state != KVD_BLOCK_COMMITTED && info.state != KVD_BLOCK_CACHED)) {
        return 0;
    }
    if (s->cfg->verify_blocks && kvd_registry_verify_hits(s, src, &blk, 1) == 0) {
        return 0; /* its bytes changed since the commit: quarantined, not promoted */
    }
    /* The commons copy of the parent is held for the promotion: otherwise the Allocate below
     * could evict it and reuse its slot, and the new block would name a stranger as parent. The
     * hold counts as no query and no hit of the commons. */
    kvd_block_ref parent = {KVD_NO_BLOCK, 0};
    kvd_block_info pinfo;
    if (info.parent != KVD_NO_BLOCK &&
        kvd_pool_block_info(src->pool, info.parent, &pinfo) == KV_OK &&
        (pinfo.state == KVD_BLOCK_COMMITTED || pinfo.state == KVD_BLOCK_CACHED) &&
        kvd_pool_hold_hash(com->pool, KVD_COMMONS_TENANT, pinfo.hash, &parent) != KV_OK) {
        parent.id = KVD_NO_BLOCK;
    }
    kvd_registry_budget_apply(s, com);
    kvd_block_ref nb, canon;
    kv_err rc = kvd_pool_allocate(com->pool, 1, 0, KVD_COMMONS_TENANT, &nb);
    if (rc != KV_OK) {
        KV_LOG(DEBUG, "KVD-COMMONS", "pool %u: no block for a promotion: %s", com->pool_id,
               kv_strerror(rc));
        goto done;
    }
    rc = promote_copy(s, src->pool, blk.id, com->pool, nb.id);
    if (rc != KV_OK) {
        KV_LOG(DEBUG, "KVD-COMMONS", "pool %u: copying a promoted block failed: %s", com->pool_id,
               kv_strerror(rc));
        (void)kvd_pool_release(com->pool, 0, KVD_COMMONS_TENANT, &nb, 1);
        goto done;
    }
    rc = kvd_pool_commit(com->pool, 0, nb, h, parent.id, &canon);
    if (rc != KV_OK) {
        KV_LOG(ERROR, "KVD-COMMONS", "pool %u: commit of a promoted block failed: %s", com->pool_id,
               kv_strerror(rc));
        (void)kvd_pool_release(com->pool, 0, KVD_COMMONS_TENANT, &nb, 1);
        goto done;
    }
    if (s->cfg->verify_blocks && canon.id == nb.id) {
        kvd_registry_verify_commit(s, com, canon);
    }
    if (canon.id == nb.id && (com->flags & KVD_POOL_SUMMARIES)) {
        /* The page summary goes with the block (the source's, or one computed from the copy),
         * as at a Commit: a summary beside every committed block (docs/ICECACHE.md). */
        kv_err src_rc = kvd_summaries_set(&com->summ, s->be, s->be_ctx, com->pool, canon,
                                          kvd_summaries_get(&src->summ, blk));
        if (src_rc != KV_OK) {
            KV_LOG(WARN, "KVD-SUMMARY", "pool %u block %u: no page summary: %s", com->pool_id,
                   canon.id, kv_strerror(src_rc));
        }
    }
    entered = canon.id == nb.id;
    if (entered && parent.id != KVD_NO_BLOCK) {
        *ph = pinfo.hash;
        *has_parent = 1;
    }
    (void)kvd_pool_release(com->pool, 0, KVD_COMMONS_TENANT, &canon, 1);
    KV_LOG(DEBUG, "KVD-COMMONS", "pool %u: block %u entered the commons from pool %u", com->pool_id,
           canon.id, src->pool_id);
done:
    if (parent.id != KVD_NO_BLOCK) {
        (void)kvd_pool_release(com->pool, 0, KVD_COMMONS_TENANT, &parent, 1);
    }
    return entered;
}

kvd_reg_pool *kvd_commons_count_commit(kvd_registry *s, uint32_t pool_id, uint32_t tenant,
                                       kvd_block_ref blk, kv_hash128 h, kv_hash128 *parent,
                                       int *has_parent) {
    *has_parent = 0;
    uint32_t k = kvd_tenants_commons_k(s->tenants);
    kvd_reg_pool *src = kvd_registry_pool(s, pool_id);
    if (k == 0 || src == NULL || src->commons_id == 0 || tenant >= KVD_MAX_TENANTS) {
        return NULL;
    }
    if (s->commons == NULL) {
        s->commons = calloc(1, sizeof(*s->commons));
        if (s->commons == NULL) {
            return NULL;
        }
        s->commons->slots = calloc(COMMONS_SLOTS, sizeof(commons_slot));
        if (s->commons->slots == NULL) {
            free(s->commons);
            s->commons = NULL;
            return NULL;
        }
        s->commons_free = commons_free;
    }
    uint32_t cid = src->commons_id;
    const kv_hash128 m = src->model_key;
    uint64_t x = h.lo ^ (h.hi * 0x9E3779B97F4A7C15ull) ^ (m.lo * 0xC2B2AE3D27D4EB4Full) ^ m.hi;
    commons_slot *e = &s->commons->slots[(x ^ (x >> 29)) & (COMMONS_SLOTS - 1)];
    if (!e->used || e->model.lo != m.lo || e->model.hi != m.hi || e->h.lo != h.lo ||
        e->h.hi != h.hi) {
        memset(e, 0, sizeof(*e));
        e->used = 1;
        e->model = m;
        e->h = h;
    }
    int seen = 0;
    for (uint32_t i = 0; i < e->n; i++) {
        seen |= e->tenants[i] == tenant;
    }
    if (!seen && e->n < KVD_COMMONS_MAX_K) {
        e->tenants[e->n++] = (uint16_t)tenant;
    }
    if (e->n < k) {
        return NULL;
    }
    kvd_reg_pool *com = kvd_registry_pool(s, cid);
    return com != NULL && promote(s, src, com, blk, h, parent, has_parent) ? com : NULL;
}
