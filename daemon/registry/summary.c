/* kvd_summaries: page summaries of T0 blocks (see summary.h). */
#include "daemon/registry/summary.h"

#include <stdlib.h>
#include <string.h>

#include "kernels/kvk.h"

size_t kvd_summary_floats(const kv_layout *l) {
    return KVK_SUMMARY_FLOATS(l->num_layers, l->num_kv_heads, l->head_dim);
}

kv_err kvd_summary_compute(const kvd_backend_ops *be, void *ctx, const kvd_pool *pool, uint32_t id,
                           float *out) {
    const kvd_pool_config *pc = kvd_pool_config_get(pool);
    const kv_layout *l = &pc->layout;
    uint32_t bps = pc->blocks_per_segment;
    const kvd_segment_mem *m = kvd_pool_segment(pool, id / bps);
    if (m == NULL) {
        return KV_ENOENT;
    }
    uint32_t b = id % bps;
    /* The block's K runs (and their scales) side by side: section 2 * layer of a one-block
     * cache whose section stride is one run. V is not read (summaries are of keys). */
    uint64_t run = l->kv_block_bytes, sc = (uint64_t)l->num_kv_heads * sizeof(float);
    uint8_t *img = malloc((size_t)(run * 2 * l->num_layers));
    float *scales = l->scale_bytes != 0 ? malloc((size_t)(sc * 2 * l->num_layers)) : NULL;
    kv_err rc = img == NULL || (l->scale_bytes != 0 && scales == NULL) ? KV_ENOMEM : KV_OK;
    for (uint32_t layer = 0; rc == KV_OK && layer < l->num_layers; layer++) {
        rc = kvd_segment_read(be, ctx, m, kv_layout_offset(l, bps, b, layer, KV_K, 0, 0),
                              img + run * 2 * layer, run);
        if (rc == KV_OK && scales != NULL) {
            rc = kvd_segment_read(be, ctx, m, kv_layout_scale_offset(l, bps, b, layer, KV_K, 0),
                                  (uint8_t *)scales + sc * 2 * layer, sc);
        }
    }
    if (rc == KV_OK) {
        kvk_cache c = {.data = (uintptr_t)img,
                       .block_stride = (int64_t)(run * 2 * l->num_layers),
                       .section_stride = (int64_t)run,
                       .scales = (uintptr_t)scales,
                       .scale_block_stride = (int64_t)(sc * 2 * l->num_layers),
                       .scale_section_stride = (int64_t)sc,
                       .num_blocks = 1,
                       .num_sections = 2 * l->num_layers,
                       .tokens_per_block = l->tokens_per_block,
                       .num_kv_heads = l->num_kv_heads,
                       .head_dim = l->head_dim,
                       .dtype = l->dtype};
        int32_t zero = 0;
        rc = kvk_page_summaries_cpu(&c, &zero, NULL, 1, out) == KV_OK ? KV_OK : KV_EINTERNAL;
    }
    free(img);
    free(scales);
    return rc;
}

static kv_err grow(kvd_summaries *s, uint32_t id) {
    if (id < s->cap) {
        return KV_OK;
    }
    uint32_t nc = s->cap == 0 ? 256 : s->cap;
    while (nc <= id) {
        nc *= 2;
    }
    float *nv = realloc(s->v, (size_t)nc * s->per * sizeof(float));
    if (nv == NULL) {
        return KV_ENOMEM;
    }
    s->v = nv;
    uint32_t *ng = realloc(s->gen, (size_t)nc * sizeof(uint32_t));
    if (ng == NULL) {
        return KV_ENOMEM;
    }
    memset(ng + s->cap, 0, (size_t)(nc - s->cap) * sizeof(uint32_t));
    s->gen = ng;
    s->cap = nc;
    return KV_OK;
}

kv_err kvd_summaries_set(kvd_summaries *s, const kvd_backend_ops *be, void *ctx,
                         const kvd_pool *pool, kvd_block_ref blk, const float *src) {
    if (s->per == 0) {
        s->per = kvd_summary_floats(&kvd_pool_config_get(pool)->layout);
    }
    kv_err rc = grow(s, blk.id);
    if (rc != KV_OK) {
        return rc;
    }
    float *dst = s->v + (size_t)blk.id * s->per;
    s->gen[blk.id] = 0;
    if (src != NULL) {
        memcpy(dst, src, s->per * sizeof(float));
    } else {
        rc = kvd_summary_compute(be, ctx, pool, blk.id, dst);
        if (rc != KV_OK) {
            return rc;
        }
    }
    s->gen[blk.id] = blk.gen + 1;
    return KV_OK;
}

const float *kvd_summaries_get(const kvd_summaries *s, kvd_block_ref blk) {
    if (blk.id >= s->cap || s->gen[blk.id] != blk.gen + 1) {
        return NULL;
    }
    return s->v + (size_t)blk.id * s->per;
}

void kvd_summaries_free(kvd_summaries *s) {
    free(s->v);
    free(s->gen);
    memset(s, 0, sizeof(*s));
}
