/* kvk_testutil: shared by the kernel tests and benchmark: a seeded random generator, caches
 * built from kv_layout segments, random contents, ragged page tables, and the naive dense
 * attention oracle (double precision over the values the cache actually holds).
 * Header-only, static functions; tests are single-threaded.
 */
#ifndef KVK_TESTUTIL_H
#define KVK_TESTUTIL_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kvk.h"
#include "kernels/kvk_dtype.h"

static uint64_t tu_rng = 0x9e3779b97f4a7c15ull;

static inline uint32_t tu_rand(void) {
    tu_rng ^= tu_rng << 13;
    tu_rng ^= tu_rng >> 7;
    tu_rng ^= tu_rng << 17;
    return (uint32_t)(tu_rng >> 11);
}

/* Uniform in [-1, 1). */
static inline float tu_randf(void) {
    return (float)(tu_rand() % 2000001u) / 1000000.0f - 1.0f;
}

/* Fills n elements of dtype d with random values in [-amp, amp) (8-bit: random codes). */
static inline void tu_fill(kv_dtype d, void *p, uint64_t n, float amp) {
    for (uint64_t i = 0; i < n; i++) {
        float x = tu_randf() * amp;
        if (d == KV_DTYPE_FP8_E4M3) {
            x = tu_randf() * 400.0f;
        } else if (d == KV_DTYPE_INT8) {
            x = tu_randf() * 127.0f;
        }
        kvk_store_f32(d, p, i, x);
    }
}

/* A segment of nblocks blocks with random data and (8-bit) random positive scales. */
typedef struct tu_seg {
    kv_layout l;
    uint32_t nblocks;
    uint8_t *mem;
    kvk_cache c;
} tu_seg;

static inline void tu_seg_init(tu_seg *s, uint32_t layers, uint32_t heads, uint32_t dim,
                               uint32_t tpb, kv_dtype dt, kv_arrangement arr, uint32_t nblocks) {
    memset(s, 0, sizeof(*s));
    if (kv_layout_init(layers, heads, dim, tpb, dt, arr, &s->l) != KV_OK) {
        abort();
    }
    s->nblocks = nblocks;
    uint64_t bytes = kv_layout_segment_bytes(&s->l, nblocks);
    s->mem = aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (s->mem == NULL) {
        abort();
    }
    memset(s->mem, 0, bytes);
    if (kvk_cache_from_segment(&s->l, (uintptr_t)s->mem, nblocks, &s->c) != KV_OK) {
        abort();
    }
    /* Fill through the descriptor so both arrangements get data and scales in their places. */
    uint64_t chunk = (uint64_t)tpb * heads * dim;
    for (uint32_t b = 0; b < nblocks; b++) {
        for (uint32_t sec = 0; sec < s->c.num_sections; sec++) {
            tu_fill(dt, (char *)s->c.data + b * s->c.block_stride + sec * s->c.section_stride,
                    chunk, 1.0f);
            if (s->l.scale_bytes == 0) {
                continue;
            }
            float *sc = (float *)((char *)s->c.scales + b * s->c.scale_block_stride +
                                  sec * s->c.scale_section_stride);
            for (uint32_t h = 0; h < heads; h++) {
                /* Scales keep dequantized values near [-1, 1] (fp8 codes reach 400 here). */
                sc[h] = (0.5f + (float)(tu_rand() % 1000) / 1000.0f) /
                        (dt == KV_DTYPE_INT8 ? 127.0f : 400.0f);
            }
        }
    }
}

static inline void tu_seg_fini(tu_seg *s) {
    free(s->mem);
    s->mem = NULL;
}

/* Dequantized element (block, section, token, head, d) of a cache in host memory. */
static inline float tu_cache_elem(const kvk_cache *c, uint32_t block, uint32_t section,
                                  uint32_t token, uint32_t head, uint32_t d) {
    const char *base = (const char *)c->data + (int64_t)block * c->block_stride +
                       (int64_t)section * c->section_stride;
    float x =
        kvk_load_f32(c->dtype, base, ((uint64_t)token * c->num_kv_heads + head) * c->head_dim + d);
    if (c->dtype == KV_DTYPE_FP8_E4M3 || c->dtype == KV_DTYPE_INT8) {
        const float *s =
            (const float *)((const char *)c->scales + (int64_t)block * c->scale_block_stride +
                            (int64_t)section * c->scale_section_stride);
        x *= s[head];
    }
    return x;
}

/* A ragged page table over nblocks blocks: lens[i] tokens for request i, pages drawn without
 * replacement in random order. Arrays malloc'd; free with tu_pt_fini. */
typedef struct tu_pt {
    kvk_page_table pt;
    int32_t *indptr, *indices, *last;
} tu_pt;

static inline int tu_pt_init(tu_pt *t, const uint32_t *lens, uint32_t batch, uint32_t page_size,
                             uint32_t nblocks) {
    t->indptr = calloc(batch + 1, sizeof(int32_t));
    t->last = calloc(batch ? batch : 1, sizeof(int32_t));
    uint32_t total = 0;
    for (uint32_t i = 0; i < batch; i++) {
        total += (lens[i] + page_size - 1) / page_size;
    }
    if (total > nblocks) {
        return -1;
    }
    t->indices = calloc(total ? total : 1, sizeof(int32_t));
    int32_t *perm = malloc(nblocks * sizeof(int32_t));
    for (uint32_t i = 0; i < nblocks; i++) {
        perm[i] = (int32_t)i;
    }
    for (uint32_t i = nblocks; i > 1; i--) {
        uint32_t j = tu_rand() % i;
        int32_t x = perm[i - 1];
        perm[i - 1] = perm[j];
        perm[j] = x;
    }
    uint32_t k = 0;
    for (uint32_t i = 0; i < batch; i++) {
        uint32_t np = (lens[i] + page_size - 1) / page_size;
        for (uint32_t p = 0; p < np; p++, k++) {
            t->indices[k] = perm[k];
        }
        t->indptr[i + 1] = (int32_t)k;
        t->last[i] = np == 0 ? 0 : (int32_t)(lens[i] - (np - 1) * page_size);
    }
    free(perm);
    t->pt.indptr = t->indptr;
    t->pt.indices = t->indices;
    t->pt.last_page_len = t->last;
    t->pt.batch = batch;
    return 0;
}

static inline void tu_pt_fini(tu_pt *t) {
    free(t->indptr);
    free(t->indices);
    free(t->last);
}

/* Naive dense decode attention in double: gathers each request's K and V rows in token order,
 * then softmax(q.K * scale) V. out and lse are double [batch][qo_heads][dim] / [..]. */
static inline void tu_naive_attention(const kvk_cache *c, uint32_t layer, const tu_pt *t,
                                      const void *q, kv_dtype qdt, uint32_t qo_heads,
                                      float sm_scale, double *out, double *lse) {
    uint32_t dim = c->head_dim;
    uint32_t group = qo_heads / c->num_kv_heads;
    for (uint32_t i = 0; i < t->pt.batch; i++) {
        uint32_t np = (uint32_t)(t->indptr[i + 1] - t->indptr[i]);
        uint32_t len = np == 0 ? 0 : (np - 1) * c->tokens_per_block + (uint32_t)t->last[i];
        double *sc = malloc((len + 1) * sizeof(double));
        for (uint32_t h = 0; h < qo_heads; h++) {
            uint32_t kvh = h / group;
            uint64_t row = (uint64_t)i * qo_heads + h;
            double m = -INFINITY;
            for (uint32_t tok = 0; tok < len; tok++) {
                uint32_t blk = (uint32_t)t->indices[t->indptr[i] + tok / c->tokens_per_block];
                double dot = 0;
                for (uint32_t d = 0; d < dim; d++) {
                    dot += (double)kvk_load_f32(qdt, q, row * dim + d) *
                           tu_cache_elem(c, blk, layer * 2, tok % c->tokens_per_block, kvh, d);
                }
                sc[tok] = dot * sm_scale;
                m = sc[tok] > m ? sc[tok] : m;
            }
            double l = 0;
            for (uint32_t tok = 0; tok < len; tok++) {
                l += exp(sc[tok] - m);
            }
            for (uint32_t d = 0; d < dim; d++) {
                double acc = 0;
                for (uint32_t tok = 0; tok < len; tok++) {
                    uint32_t blk = (uint32_t)t->indices[t->indptr[i] + tok / c->tokens_per_block];
                    acc += exp(sc[tok] - m) *
                           tu_cache_elem(c, blk, layer * 2 + 1, tok % c->tokens_per_block, kvh, d);
                }
                out[row * dim + d] = len == 0 ? 0.0 : acc / l;
            }
            lse[row] = len == 0 ? -INFINITY : m + log(l);
        }
        free(sc);
    }
}

/* Tolerance of a value rounded to dtype d: half an ulp relative (fp32: accumulation only). */
static inline double tu_rel_tol(kv_dtype d) {
    switch (d) {
        case KV_DTYPE_FP16:
            return 1.0 / 1024;
        case KV_DTYPE_BF16:
            return 1.0 / 128;
        default:
            return 1e-5;
    }
}

#endif
