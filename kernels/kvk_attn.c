/* kvk_attn: CPU twins of paged decode attention and of the log-sum-exp merge of attention
 * states, plus the argument checks the CUDA launchers share.
 *
 * The twin is written for clarity, not speed: per (request, query head) it computes every score
 * in float32, then an exact softmax (max, sum of exponentials) and the weighted sum of V. It is
 * the oracle the GPU kernels are compared against.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kvk_dtype.h"
#include "kernels/kvk_internal.h"

kv_err kvk__check_decode(const kvk_cache *c, uint32_t layer, const kvk_page_table *pt,
                         const kvk_decode_args *a) {
    kv_err rc = kvk__check_cache(c, "paged_decode_attention");
    if (rc != KV_OK) {
        return rc;
    }
    if (pt == NULL || a == NULL || pt->indptr == NULL || pt->last_page_len == NULL ||
        a->q == NULL || a->out == NULL) {
        return kvk__fail(KV_EINVAL, "paged_decode_attention: null page table, q or out");
    }
    if ((uint64_t)layer * 2 + 1 >= c->num_sections) {
        return kvk__fail(KV_EINVAL, "paged_decode_attention: layer %u out of range", layer);
    }
    if (!kvk__is_wide(a->qo_dtype)) {
        return kvk__fail(KV_EINVAL, "paged_decode_attention: q/out dtype must be fp16/bf16/fp32");
    }
    if (a->num_qo_heads == 0 || a->num_qo_heads % c->num_kv_heads != 0) {
        return kvk__fail(KV_EINVAL,
                         "paged_decode_attention: %u query heads is not a multiple of "
                         "%u kv heads",
                         a->num_qo_heads, c->num_kv_heads);
    }
    return KV_OK;
}

/* Checks the host-resident page table of the CPU twin; writes the longest sequence. */
static kv_err check_page_table(const kvk_cache *c, const kvk_page_table *pt, uint64_t *max_len) {
    uint64_t longest = 0;
    if (pt->indptr[0] < 0) {
        return kvk__fail(KV_EINVAL, "paged_decode_attention: indptr[0] is negative");
    }
    /* indptr first: indices holds indptr[batch] entries only if indptr never decreases. */
    for (uint32_t i = 0; i < pt->batch; i++) {
        if (pt->indptr[i + 1] < pt->indptr[i]) {
            return kvk__fail(KV_EINVAL, "paged_decode_attention: indptr decreases at %u", i);
        }
    }
    for (uint32_t i = 0; i < pt->batch; i++) {
        int32_t p0 = pt->indptr[i];
        int32_t p1 = pt->indptr[i + 1];
        if (p1 == p0) {
            continue;
        }
        if (pt->indices == NULL) {
            return kvk__fail(KV_EINVAL, "paged_decode_attention: null indices");
        }
        int32_t last = pt->last_page_len[i];
        if (last < 1 || (uint32_t)last > c->tokens_per_block) {
            return kvk__fail(KV_EINVAL, "paged_decode_attention: last_page_len[%u] = %d", i, last);
        }
        for (int32_t p = p0; p < p1; p++) {
            if (pt->indices[p] < 0 || (uint32_t)pt->indices[p] >= c->num_blocks) {
                return kvk__fail(KV_EINVAL, "paged_decode_attention: page id %d out of range",
                                 pt->indices[p]);
            }
        }
        uint64_t len = (uint64_t)(p1 - p0 - 1) * c->tokens_per_block + (uint64_t)last;
        longest = len > longest ? len : longest;
    }
    *max_len = longest;
    return KV_OK;
}

/* Reads element (token t of the request's pages, head, dim d) of section, dequantized. */
static float cache_elem(const kvk_cache *c, const int32_t *pages, uint32_t section, uint64_t t,
                        uint32_t head, uint32_t d) {
    int64_t block = pages[t / c->tokens_per_block];
    uint64_t off = t % c->tokens_per_block;
    const char *base =
        (const char *)c->data + block * c->block_stride + (int64_t)section * c->section_stride;
    uint64_t e = (off * c->num_kv_heads + head) * c->head_dim + d;
    float x = kvk_load_f32(c->dtype, base, e);
    if (kvk__is_scaled(c->dtype)) {
        const float *s = (const float *)((const char *)c->scales + block * c->scale_block_stride +
                                         (int64_t)section * c->scale_section_stride);
        x *= s[head];
    }
    return x;
}

kv_err kvk_paged_decode_attention_cpu(const kvk_cache *cache, uint32_t layer,
                                      const kvk_page_table *pt, const kvk_decode_args *a) {
    kv_err rc = kvk__check_decode(cache, layer, pt, a);
    if (rc != KV_OK) {
        return rc;
    }
    uint64_t max_len = 0;
    rc = check_page_table(cache, pt, &max_len);
    if (rc != KV_OK) {
        return rc;
    }
    uint32_t dim = cache->head_dim;
    uint32_t group = a->num_qo_heads / cache->num_kv_heads;
    float *scores = malloc((max_len + 1) * sizeof(float));
    float *acc = malloc((size_t)dim * sizeof(float));
    if (scores == NULL || acc == NULL) {
        rc = kvk__fail(KV_ENOMEM, "paged_decode_attention: no memory for %llu scores",
                       (unsigned long long)max_len);
        goto cleanup;
    }
    for (uint32_t i = 0; i < pt->batch; i++) {
        int32_t p0 = pt->indptr[i];
        int32_t npages = pt->indptr[i + 1] - p0;
        uint64_t len = npages == 0 ? 0
                                   : (uint64_t)(npages - 1) * cache->tokens_per_block +
                                         (uint64_t)pt->last_page_len[i];
        const int32_t *pages = npages == 0 ? NULL : pt->indices + p0;
        for (uint32_t qh = 0; qh < a->num_qo_heads; qh++) {
            uint32_t kvh = qh / group;
            uint64_t row = (uint64_t)i * a->num_qo_heads + qh;
            float m = -INFINITY;
            for (uint64_t t = 0; t < len; t++) {
                float dot = 0.0f;
                for (uint32_t d = 0; d < dim; d++) {
                    float q = kvk_load_f32(a->qo_dtype, a->q, row * dim + d);
                    dot += q * cache_elem(cache, pages, layer * 2 + KV_K, t, kvh, d);
                }
                scores[t] = dot * a->sm_scale;
                m = scores[t] > m ? scores[t] : m;
            }
            float l = 0.0f;
            memset(acc, 0, (size_t)dim * sizeof(float));
            for (uint64_t t = 0; t < len; t++) {
                float p = expf(scores[t] - m);
                l += p;
                for (uint32_t d = 0; d < dim; d++) {
                    acc[d] += p * cache_elem(cache, pages, layer * 2 + KV_V, t, kvh, d);
                }
            }
            for (uint32_t d = 0; d < dim; d++) {
                kvk_store_f32(a->qo_dtype, a->out, row * dim + d, len == 0 ? 0.0f : acc[d] / l);
            }
            if (a->lse != NULL) {
                a->lse[row] = len == 0 ? -INFINITY : m + logf(l);
            }
        }
    }
    rc = KV_OK;
cleanup:
    free(acc);
    free(scores);
    return rc;
}

size_t kvk_paged_decode_attention_workspace_bytes(uint32_t batch, uint32_t num_qo_heads,
                                                  uint32_t head_dim, uint32_t max_splits) {
    /* Per (split, request, query head): head_dim partial outputs and one lse, all float32. */
    return (size_t)max_splits * batch * num_qo_heads * ((size_t)head_dim + 1) * sizeof(float);
}

kv_err kvk_merge_states_cpu(kv_dtype dtype, const void *const *v, const float *const *s,
                            uint32_t num_states, uint64_t rows, uint32_t head_dim, void *out,
                            float *s_out) {
    if (!kvk__is_wide(dtype) || v == NULL || s == NULL || out == NULL || head_dim == 0 ||
        num_states == 0 || num_states > KVK_MAX_MERGE_STATES) {
        return kvk__fail(KV_EINVAL, "merge_states: bad dtype, null array or %u states", num_states);
    }
    for (uint32_t j = 0; j < num_states; j++) {
        if (v[j] == NULL || s[j] == NULL) {
            return kvk__fail(KV_EINVAL, "merge_states: state %u is null", j);
        }
    }
    float *acc = malloc((size_t)head_dim * sizeof(float));
    if (acc == NULL) {
        return kvk__fail(KV_ENOMEM, "merge_states: no memory");
    }
    for (uint64_t r = 0; r < rows; r++) {
        float m = -INFINITY;
        for (uint32_t j = 0; j < num_states; j++) {
            m = s[j][r] > m ? s[j][r] : m;
        }
        memset(acc, 0, (size_t)head_dim * sizeof(float));
        float sum = 0.0f;
        if (m != -INFINITY) {
            for (uint32_t j = 0; j < num_states; j++) {
                float w = expf(s[j][r] - m);
                sum += w;
                for (uint32_t d = 0; d < head_dim; d++) {
                    acc[d] += w * kvk_load_f32(dtype, v[j], r * head_dim + d);
                }
            }
        }
        for (uint32_t d = 0; d < head_dim; d++) {
            kvk_store_f32(dtype, out, r * head_dim + d, sum > 0.0f ? acc[d] / sum : 0.0f);
        }
        if (s_out != NULL) {
            s_out[r] = m == -INFINITY ? -INFINITY : m + logf(sum);
        }
    }
    free(acc);
    return KV_OK;
}
