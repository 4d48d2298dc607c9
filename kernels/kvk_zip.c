/* kvk_zip: the CPU twins of Zipage's two kernels (kernels/kvk.h, docs/ZIPAGE.md): token scores
 * from a sequence's last queries, and the compaction that gathers kept token rows into fresh
 * blocks. Both are plain scalar loops over kvk_dtype.h's conversions: compaction is a memcpy per
 * (token, section) row, scoring is a few thousand dot products per compression, neither is on
 * the per-token path.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kvk_dtype.h"
#include "kernels/kvk_internal.h"

static float scale_at(const kvk_cache *c, uint32_t blk, uint32_t sec, uint32_t head) {
    const char *p = (const char *)c->scales + (int64_t)blk * c->scale_block_stride +
                    (int64_t)sec * c->scale_section_stride;
    float f;
    memcpy(&f, p + (size_t)head * sizeof(float), sizeof(f));
    return f;
}

static char *row_at(const kvk_cache *c, uint32_t blk, uint32_t sec, uint32_t off) {
    uint64_t row = (uint64_t)c->num_kv_heads * c->head_dim * kvk_elem_bytes(c->dtype);
    return (char *)c->data + (int64_t)blk * c->block_stride + (int64_t)sec * c->section_stride +
           (int64_t)(off * row);
}

kv_err kvk__check_compact(const kvk_cache *src, const kvk_cache *dst, const void *src_slots,
                          uint32_t nkept, const void *dst_blocks) {
    kv_err rc = kvk__check_cache(src, "compact_tokens src");
    if (rc == KV_OK) {
        rc = kvk__check_cache(dst, "compact_tokens dst");
    }
    if (rc != KV_OK) {
        return rc;
    }
    if (src->num_sections != dst->num_sections || src->tokens_per_block != dst->tokens_per_block ||
        src->num_kv_heads != dst->num_kv_heads || src->head_dim != dst->head_dim ||
        src->dtype != dst->dtype) {
        return kvk__fail(KV_EINVAL, "compact_tokens: src and dst differ in shape or dtype");
    }
    if (nkept > 0 && (src_slots == NULL || dst_blocks == NULL)) {
        return kvk__fail(KV_EINVAL, "compact_tokens: null slot or block list");
    }
    return KV_OK;
}

kv_err kvk_compact_tokens_cpu(const kvk_cache *src, const kvk_cache *dst, const int64_t *src_slots,
                              uint32_t nkept, const int32_t *dst_blocks) {
    kv_err rc = kvk__check_compact(src, dst, src_slots, nkept, dst_blocks);
    if (rc != KV_OK || nkept == 0) {
        return rc;
    }
    const uint32_t tpb = src->tokens_per_block;
    const uint32_t ndst = (nkept + tpb - 1) / tpb;
    const uint64_t src_slots_max = (uint64_t)src->num_blocks * tpb;
    for (uint32_t i = 0; i < nkept; i++) {
        if (src_slots[i] < 0 || (uint64_t)src_slots[i] >= src_slots_max) {
            return kvk__fail(KV_EINVAL, "compact_tokens: src_slots[%u] = %lld out of range", i,
                             (long long)src_slots[i]);
        }
    }
    for (uint32_t j = 0; j < ndst; j++) {
        if (dst_blocks[j] < 0 || (uint32_t)dst_blocks[j] >= dst->num_blocks) {
            return kvk__fail(KV_EINVAL, "compact_tokens: dst_blocks[%u] = %d out of range", j,
                             dst_blocks[j]);
        }
    }
    if (src->data == dst->data) {
        /* One cache: a fresh block must not be one the gather reads. */
        uint8_t *mark = calloc((dst->num_blocks + 7) / 8, 1);
        if (mark == NULL) {
            return kvk__fail(KV_ENOMEM, "compact_tokens: no memory for the overlap check");
        }
        for (uint32_t j = 0; j < ndst; j++) {
            mark[dst_blocks[j] / 8] |= (uint8_t)(1u << (dst_blocks[j] % 8));
        }
        for (uint32_t i = 0; i < nkept; i++) {
            uint32_t b = (uint32_t)(src_slots[i] / tpb);
            if (b < dst->num_blocks && (mark[b / 8] >> (b % 8) & 1u)) {
                free(mark);
                return kvk__fail(KV_EINVAL,
                                 "compact_tokens: block %u is both read (src_slots[%u]) and "
                                 "written",
                                 b, i);
            }
        }
        free(mark);
    }
    const uint32_t heads = src->num_kv_heads, dim = src->head_dim;
    const size_t head_bytes = (size_t)dim * kvk_elem_bytes(src->dtype);
    const int scaled = kvk__is_scaled(src->dtype);
    for (uint32_t i = 0; i < nkept; i++) {
        uint32_t sb = (uint32_t)(src_slots[i] / tpb), so = (uint32_t)(src_slots[i] % tpb);
        uint32_t db = (uint32_t)dst_blocks[i / tpb], dof = i % tpb;
        uint32_t fb = (uint32_t)(src_slots[(i / tpb) * tpb] / tpb); /* first token's block */
        for (uint32_t sec = 0; sec < src->num_sections; sec++) {
            const char *from = row_at(src, sb, sec, so);
            char *to = row_at(dst, db, sec, dof);
            if (!scaled) {
                memcpy(to, from, head_bytes * heads);
                continue;
            }
            for (uint32_t h = 0; h < heads; h++) {
                float s_src = scale_at(src, sb, sec, h), s_dst = scale_at(src, fb, sec, h);
                if (dof == 0) {
                    char *sp = (char *)dst->scales + (int64_t)db * dst->scale_block_stride +
                               (int64_t)sec * dst->scale_section_stride;
                    memcpy(sp + (size_t)h * sizeof(float), &s_dst, sizeof(float));
                }
                if (memcmp(&s_src, &s_dst, sizeof(float)) == 0) {
                    memcpy(to + h * head_bytes, from + h * head_bytes, head_bytes);
                    continue;
                }
                float ratio = s_dst != 0.0f ? s_src / s_dst : 0.0f;
                for (uint32_t e = 0; e < dim; e++) {
                    uint64_t k = (uint64_t)h * dim + e;
                    kvk_store_f32(src->dtype, to, k, kvk_load_f32(src->dtype, from, k) * ratio);
                }
            }
        }
    }
    return KV_OK;
}

kv_err kvk__check_scores(const kvk_cache *c, uint32_t layer, const void *pages, uint32_t ntokens,
                         const kvk_score_args *a, const void *scores) {
    kv_err rc = kvk__check_cache(c, "token_scores");
    if (rc != KV_OK) {
        return rc;
    }
    if (a == NULL || a->q == NULL || pages == NULL || scores == NULL) {
        return kvk__fail(KV_EINVAL, "token_scores: null arguments");
    }
    if (layer * 2 + 1 >= c->num_sections) {
        return kvk__fail(KV_EINVAL, "token_scores: layer %u out of range", layer);
    }
    if (!kvk__is_wide(a->q_dtype)) {
        return kvk__fail(KV_EINVAL, "token_scores: q dtype must be fp16, bf16 or fp32");
    }
    if (a->nq == 0 || a->nq > KVK_SCORE_MAX_Q) {
        return kvk__fail(KV_EINVAL, "token_scores: nq %u outside 1..%d", a->nq, KVK_SCORE_MAX_Q);
    }
    if (a->num_qo_heads == 0 || a->num_qo_heads % c->num_kv_heads != 0) {
        return kvk__fail(KV_EINVAL, "token_scores: %u query heads for %u KV heads", a->num_qo_heads,
                         c->num_kv_heads);
    }
    if (ntokens == 0) {
        return kvk__fail(KV_EINVAL, "token_scores: no tokens");
    }
    return KV_OK;
}

kv_err kvk_token_scores_cpu(const kvk_cache *c, uint32_t layer, const int32_t *pages,
                            uint32_t ntokens, const kvk_score_args *a, float *scores) {
    kv_err rc = kvk__check_scores(c, layer, pages, ntokens, a, scores);
    if (rc != KV_OK) {
        return rc;
    }
    const uint32_t tpb = c->tokens_per_block, dim = c->head_dim;
    const uint32_t npages = (ntokens + tpb - 1) / tpb;
    for (uint32_t p = 0; p < npages; p++) {
        if (pages[p] < 0 || (uint32_t)pages[p] >= c->num_blocks) {
            return kvk__fail(KV_EINVAL, "token_scores: pages[%u] = %d out of range", p, pages[p]);
        }
    }
    float *logit = malloc((size_t)ntokens * sizeof(float));
    float *qv = malloc((size_t)dim * sizeof(float));
    float *kv = malloc((size_t)ntokens * dim * sizeof(float));
    if (logit == NULL || qv == NULL || kv == NULL) {
        free(logit), free(qv), free(kv);
        return kvk__fail(KV_ENOMEM, "token_scores: no memory for %u tokens", ntokens);
    }
    const uint32_t group = a->num_qo_heads / c->num_kv_heads;
    const uint32_t sec = layer * 2; /* K */
    const int scaled = kvk__is_scaled(c->dtype);
    const float w = 1.0f / ((float)a->nq * (float)a->num_qo_heads);
    for (uint32_t g = 0; g < c->num_kv_heads; g++) {
        /* This KV head's keys as floats, once for the whole group. */
        for (uint32_t t = 0; t < ntokens; t++) {
            uint32_t blk = (uint32_t)pages[t / tpb];
            const char *row = row_at(c, blk, sec, t % tpb);
            float s = scaled ? scale_at(c, blk, sec, g) : 1.0f;
            for (uint32_t e = 0; e < dim; e++) {
                kv[(size_t)t * dim + e] = kvk_load_f32(c->dtype, row, (uint64_t)g * dim + e) * s;
            }
        }
        for (uint32_t j = 0; j < a->nq; j++) {
            int64_t visible = a->causal ? (int64_t)ntokens - a->nq + j + 1 : (int64_t)ntokens;
            if (visible <= 0) {
                continue;
            }
            for (uint32_t h = g * group; h < (g + 1) * group; h++) {
                uint64_t qoff = ((uint64_t)j * a->num_qo_heads + h) * dim;
                for (uint32_t e = 0; e < dim; e++) {
                    qv[e] = kvk_load_f32(a->q_dtype, a->q, qoff + e);
                }
                float m = -INFINITY;
                for (int64_t t = 0; t < visible; t++) {
                    float d = 0.0f;
                    for (uint32_t e = 0; e < dim; e++) {
                        d += qv[e] * kv[(size_t)t * dim + e];
                    }
                    logit[t] = d * a->sm_scale;
                    m = logit[t] > m ? logit[t] : m;
                }
                float z = 0.0f;
                for (int64_t t = 0; t < visible; t++) {
                    logit[t] = expf(logit[t] - m);
                    z += logit[t];
                }
                for (int64_t t = 0; t < visible; t++) {
                    scores[t] += logit[t] / z * w;
                }
            }
        }
    }
    free(logit);
    free(qv);
    free(kv);
    return KV_OK;
}
