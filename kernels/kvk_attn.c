/* kvk_attn: CPU paged decode and prefill attention and the log-sum-exp merge of attention
 * states, plus the argument checks the CUDA launchers share.
 *
 * Two implementations behind one entry point. The reference twin (attend_ref) is written for
 * clarity, not speed: per (row, query head) every score in float32, then an exact softmax and
 * the weighted sum of V; it is the oracle of the GPU kernels and of the vector kernels, and what
 * runs without AVX2 or with KVK_SIMD=scalar. The vector path (attend_simd) cuts the call into
 * tasks of (request, KV head, query vectors) run on kvk_threads() threads by the kernels of
 * kvk_simd_body.h, which read each K/V row once per task with an online softmax.
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

/* The reference twin of decode and prefill attention: per (row, query head), every score in
 * float32, then an exact softmax (max, sum of exponentials) and the weighted sum of V. Decode is
 * qo_indptr == NULL (row i = request i). */
static kv_err attend_ref(const kvk_cache *cache, uint32_t layer, const kvk_page_table *pt,
                         const int32_t *qo_indptr, const void *q, void *out, float *lse,
                         kv_dtype qo_dtype, uint32_t num_qo_heads, float sm_scale, int causal,
                         uint64_t max_len) {
    uint32_t dim = cache->head_dim;
    uint32_t group = num_qo_heads / cache->num_kv_heads;
    float *scores = malloc((max_len + 1) * sizeof(float));
    float *acc = malloc((size_t)dim * sizeof(float));
    kv_err rc = KV_OK;
    if (scores == NULL || acc == NULL) {
        rc = kvk__fail(KV_ENOMEM, "paged attention: no memory for %llu scores",
                       (unsigned long long)max_len);
        goto cleanup;
    }
    for (uint32_t i = 0; i < pt->batch; i++) {
        int32_t p0 = pt->indptr[i];
        int32_t npages = pt->indptr[i + 1] - p0;
        uint64_t full = npages == 0 ? 0
                                    : (uint64_t)(npages - 1) * cache->tokens_per_block +
                                          (uint64_t)pt->last_page_len[i];
        const int32_t *pages = npages == 0 ? NULL : pt->indices + p0;
        int64_t r0 = qo_indptr == NULL ? (int64_t)i : qo_indptr[i];
        int64_t nrows = qo_indptr == NULL ? 1 : qo_indptr[i + 1] - qo_indptr[i];
        for (int64_t j = 0; j < nrows; j++) {
            int64_t see = causal ? (int64_t)full - nrows + j + 1 : (int64_t)full;
            uint64_t len = see < 0 ? 0 : (uint64_t)see;
            for (uint32_t qh = 0; qh < num_qo_heads; qh++) {
                uint32_t kvh = qh / group;
                uint64_t row = (uint64_t)(r0 + j) * num_qo_heads + qh;
                float m = -INFINITY;
                for (uint64_t t = 0; t < len; t++) {
                    float dot = 0.0f;
                    for (uint32_t d = 0; d < dim; d++) {
                        float qv = kvk_load_f32(qo_dtype, q, row * dim + d);
                        dot += qv * cache_elem(cache, pages, layer * 2 + KV_K, t, kvh, d);
                    }
                    scores[t] = dot * sm_scale;
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
                    kvk_store_f32(qo_dtype, out, row * dim + d, len == 0 ? 0.0f : acc[d] / l);
                }
                if (lse != NULL) {
                    lse[row] = len == 0 ? -INFINITY : m + logf(l);
                }
            }
        }
    }
cleanup:
    free(acc);
    free(scores);
    return rc;
}

size_t kvk__attn_scratch_floats(const kvk__attn_job *j) {
    size_t n = 2 * (size_t)KVK__ATTN_QMAX * j->dimp + 2 * (size_t)KVK__ATTN_TILE * j->dimp +
               (size_t)KVK__ATTN_QMAX * KVK__ATTN_TILE + 4 * (size_t)KVK__ATTN_QMAX;
    return (n + 15) / 16 * 16; /* each worker's part starts 64-byte aligned */
}

typedef struct attn_run {
    const kvk__simd_ops *ops;
    kvk__attn_job job;
    kvk__attn_task *tasks;
    float *scratch;
    size_t per_worker; /* floats */
} attn_run;

static void attn_task(void *ctx, uint64_t i, uint32_t worker) {
    attn_run *x = ctx;
    x->ops->attend(&x->job, &x->tasks[i], x->scratch + worker * x->per_worker);
}

/* The vector path: one task per (request, KV head, chunk of at most KVK__ATTN_QMAX query
 * vectors), so each K/V row is read once per chunk (decode: once per GQA group), on the pool. */
static kv_err attend_simd(const kvk__simd_ops *ops, const kvk_cache *cache, uint32_t layer,
                          const kvk_page_table *pt, const int32_t *qo_indptr, const void *q,
                          void *out, float *lse, kv_dtype qo_dtype, uint32_t num_qo_heads,
                          float sm_scale, int causal) {
    attn_run x = {
        .ops = ops,
        .job = {.c = cache,
                .layer = layer,
                .pt = pt,
                .qo_indptr = qo_indptr,
                .q = q,
                .out = out,
                .lse = lse,
                .qo_dtype = qo_dtype,
                .num_qo_heads = num_qo_heads,
                .group = num_qo_heads / cache->num_kv_heads,
                .dimp = (cache->head_dim + 15) / 16 * 16,
                .q_mul = sm_scale * 1.4426950408889634f,
                .causal = causal},
    };
    uint32_t g = x.job.group;
    uint32_t chunk = g <= KVK__ATTN_QMAX ? KVK__ATTN_QMAX / g * g : KVK__ATTN_QMAX;
    uint32_t workers = kvk__workers();
    /* Decode-sized requests (at most KVK__ATTN_DIRECT_NQ query vectors per KV head) take several
     * KV heads per task, so a task reads each token's rows of those heads as one contiguous run;
     * as many as fit the task's scratch, but few enough to leave >= 4 tasks per worker. The
     * grouping changes no result (each head is computed alike), only the order of reads. */
    uint32_t heads = cache->num_kv_heads, hp = 1;
    if (cache->head_dim % 16 == 0) {
        uint64_t small = 0, widest = 1;
        for (uint32_t i = 0; i < pt->batch; i++) {
            uint64_t nvec = (uint64_t)(qo_indptr == NULL ? 1 : qo_indptr[i + 1] - qo_indptr[i]) * g;
            if (nvec <= KVK__ATTN_DIRECT_NQ) {
                small++;
                widest = nvec > widest ? nvec : widest;
            }
        }
        uint64_t cap = small * heads / (4 * (uint64_t)workers);
        hp = KVK__ATTN_QMAX / (uint32_t)widest; /* nheads * nq fits the scratch */
        hp = hp < heads ? hp : heads;
        hp = cap < hp ? (uint32_t)(cap < 1 ? 1 : cap) : hp;
    }
    uint64_t ntasks = 0;
    for (uint32_t i = 0; i < pt->batch; i++) {
        uint64_t nvec = (uint64_t)(qo_indptr == NULL ? 1 : qo_indptr[i + 1] - qo_indptr[i]) * g;
        uint32_t per = nvec <= KVK__ATTN_DIRECT_NQ ? hp : 1;
        ntasks += (nvec + chunk - 1) / chunk * ((heads + per - 1) / per);
    }
    if (ntasks == 0) {
        return KV_OK;
    }
    x.per_worker = kvk__attn_scratch_floats(&x.job);
    x.tasks = malloc(ntasks * sizeof(*x.tasks));
    x.scratch = aligned_alloc(64, workers * x.per_worker * sizeof(float));
    kv_err rc = KV_OK;
    if (x.tasks == NULL || x.scratch == NULL) {
        rc = kvk__fail(KV_ENOMEM, "paged attention: no memory for %llu tasks",
                       (unsigned long long)ntasks);
        goto cleanup;
    }
    uint64_t k = 0;
    for (uint32_t i = 0; i < pt->batch; i++) {
        uint64_t nvec = (uint64_t)(qo_indptr == NULL ? 1 : qo_indptr[i + 1] - qo_indptr[i]) * g;
        uint32_t per = nvec <= KVK__ATTN_DIRECT_NQ ? hp : 1;
        for (uint64_t qi = 0; qi < nvec; qi += chunk) {
            for (uint32_t h = 0; h < heads; h += per) {
                x.tasks[k++] =
                    (kvk__attn_task){.req = i,
                                     .kv_head = h,
                                     .qi0 = (uint32_t)qi,
                                     .nq = (uint32_t)(nvec - qi < chunk ? nvec - qi : chunk),
                                     .nheads = heads - h < per ? heads - h : per};
            }
        }
    }
    kvk__parallel_for(ntasks, workers, attn_task, &x);
cleanup:
    free(x.scratch);
    free(x.tasks);
    return rc;
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
    const kvk__simd_ops *ops = kvk__ops();
    if (ops != NULL) {
        return attend_simd(ops, cache, layer, pt, NULL, a->q, a->out, a->lse, a->qo_dtype,
                           a->num_qo_heads, a->sm_scale, 0);
    }
    return attend_ref(cache, layer, pt, NULL, a->q, a->out, a->lse, a->qo_dtype, a->num_qo_heads,
                      a->sm_scale, 0, max_len);
}

kv_err kvk__decode_ref(const kvk_cache *cache, uint32_t layer, const kvk_page_table *pt,
                       const kvk_decode_args *a) {
    uint64_t max_len = 0;
    kv_err rc = check_page_table(cache, pt, &max_len);
    if (rc != KV_OK) {
        return rc;
    }
    return attend_ref(cache, layer, pt, NULL, a->q, a->out, a->lse, a->qo_dtype, a->num_qo_heads,
                      a->sm_scale, 0, max_len);
}

/* Checks a prefill call (decode's checks on the shared fields, then qo_indptr). */
static kv_err check_prefill(const kvk_cache *c, uint32_t layer, const kvk_page_table *pt,
                            const kvk_prefill_args *a, uint64_t *max_len) {
    if (a == NULL) {
        return kvk__fail(KV_EINVAL, "paged_prefill_attention: null args");
    }
    kvk_decode_args d = {a->q, a->out, a->lse, a->qo_dtype, a->num_qo_heads, a->sm_scale};
    kv_err rc = kvk__check_decode(c, layer, pt, &d);
    if (rc != KV_OK) {
        return rc;
    }
    if (a->qo_indptr == NULL || a->qo_indptr[0] < 0) {
        return kvk__fail(KV_EINVAL, "paged_prefill_attention: null or negative qo_indptr");
    }
    for (uint32_t i = 0; i < pt->batch; i++) {
        if (a->qo_indptr[i + 1] < a->qo_indptr[i]) {
            return kvk__fail(KV_EINVAL, "paged_prefill_attention: qo_indptr decreases at %u", i);
        }
    }
    return check_page_table(c, pt, max_len);
}

kv_err kvk_paged_prefill_attention_cpu(const kvk_cache *cache, uint32_t layer,
                                       const kvk_page_table *pt, const kvk_prefill_args *a) {
    uint64_t max_len = 0;
    kv_err rc = check_prefill(cache, layer, pt, a, &max_len);
    if (rc != KV_OK) {
        return rc;
    }
    const kvk__simd_ops *ops = kvk__ops();
    if (ops != NULL) {
        return attend_simd(ops, cache, layer, pt, a->qo_indptr, a->q, a->out, a->lse, a->qo_dtype,
                           a->num_qo_heads, a->sm_scale, a->causal);
    }
    return attend_ref(cache, layer, pt, a->qo_indptr, a->q, a->out, a->lse, a->qo_dtype,
                      a->num_qo_heads, a->sm_scale, a->causal, max_len);
}

kv_err kvk__prefill_ref(const kvk_cache *cache, uint32_t layer, const kvk_page_table *pt,
                        const kvk_prefill_args *a) {
    uint64_t max_len = 0;
    kv_err rc = check_prefill(cache, layer, pt, a, &max_len);
    if (rc != KV_OK) {
        return rc;
    }
    return attend_ref(cache, layer, pt, a->qo_indptr, a->q, a->out, a->lse, a->qo_dtype,
                      a->num_qo_heads, a->sm_scale, a->causal, max_len);
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
