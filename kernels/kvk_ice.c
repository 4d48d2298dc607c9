/* kvk_ice: the CPU twins of IceCache's kernels (kernels/kvk.h, docs/ICECACHE.md): per-page key
 * summaries (per channel min and max) and top-k page selection by the upper bound they give.
 * Selection's bound is summed in channel order with separate multiply and add (no contraction
 * into fused multiply-adds, whatever the target), which the GPU twin repeats exactly.
 */
#pragma GCC optimize("fp-contract=off")
#include <immintrin.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kvk_dtype.h"
#include "kernels/kvk_internal.h"

kv_err kvk__check_summaries(const kvk_cache *c, const void *blocks, uint32_t n, const void *out) {
    kv_err rc = kvk__check_cache(c, "page_summaries");
    if (rc != KV_OK) {
        return rc;
    }
    if (n > 0 && (blocks == NULL || out == NULL)) {
        return kvk__fail(KV_EINVAL, "page_summaries: null block list or output");
    }
    return KV_OK;
}

kv_err kvk_page_summaries_cpu(const kvk_cache *c, const int32_t *blocks, const uint32_t *ntok,
                              uint32_t n, float *out) {
    kv_err rc = kvk__check_summaries(c, blocks, n, out);
    if (rc != KV_OK) {
        return rc;
    }
    for (uint32_t i = 0; i < n; i++) {
        if (blocks[i] < 0 || (uint32_t)blocks[i] >= c->num_blocks ||
            (ntok != NULL && ntok[i] > c->tokens_per_block)) {
            return kvk__fail(KV_EINVAL, "page_summaries: entry %u (block %d) out of range", i,
                             blocks[i]);
        }
    }
    const uint32_t L = c->num_sections / 2, H = c->num_kv_heads, D = c->head_dim;
    const uint64_t eb = kvk_elem_bytes(c->dtype), row = (uint64_t)H * D * eb;
    const int scaled = kvk__is_scaled(c->dtype);
    for (uint32_t i = 0; i < n; i++) {
        uint32_t b = (uint32_t)blocks[i], nt = ntok != NULL ? ntok[i] : c->tokens_per_block;
        float *o = out + (size_t)i * KVK_SUMMARY_FLOATS(L, H, D);
        for (uint32_t l = 0; l < L; l++) {
            const char *base = (const char *)c->data + (int64_t)b * c->block_stride +
                               (int64_t)(l * 2) * c->section_stride;
            for (uint32_t h = 0; h < H; h++) {
                float s = 1.0f;
                if (scaled) {
                    memcpy(&s,
                           (const char *)c->scales + (int64_t)b * c->scale_block_stride +
                               (int64_t)(l * 2) * c->scale_section_stride + h * sizeof(float),
                           sizeof(float));
                }
                float *mn = o + ((size_t)l * H + h) * KVK_SUMMARY_PARTS * D, *mx = mn + D,
                      *me = mx + D;
                for (uint32_t d = 0; d < D; d++) {
                    mn[d] = INFINITY;
                    mx[d] = -INFINITY;
                    me[d] = 0.0f;
                }
                for (uint32_t t = 0; t < nt; t++) {
                    const char *r = base + t * row;
                    for (uint32_t d = 0; d < D; d++) {
                        float x = kvk_load_f32(c->dtype, r, (uint64_t)h * D + d) * s;
                        mn[d] = x < mn[d] ? x : mn[d];
                        mx[d] = x > mx[d] ? x : mx[d];
                        me[d] = me[d] + x;
                    }
                }
                for (uint32_t d = 0; d < D && nt > 0; d++) {
                    me[d] = me[d] / (float)nt;
                }
            }
        }
    }
    return KV_OK;
}

kv_err kvk__check_select(const kvk_select_args *a, const void *out) {
    if (a == NULL || a->summaries == NULL || a->q == NULL || out == NULL) {
        return kvk__fail(KV_EINVAL, "page_select: null arguments");
    }
    if (a->num_kv_heads == 0 || a->head_dim == 0 || a->num_layers == 0 ||
        a->layer >= a->num_layers || a->num_qo_heads == 0 ||
        a->num_qo_heads % a->num_kv_heads != 0) {
        return kvk__fail(KV_EINVAL, "page_select: bad shape");
    }
    if (a->mode != KVK_SELECT_BOUND && a->mode != KVK_SELECT_CENTROID) {
        return kvk__fail(KV_EINVAL, "page_select: unknown mode %d", a->mode);
    }
    if (a->k == 0 || a->k > a->npages) {
        return kvk__fail(KV_EINVAL, "page_select: k = %u of %u pages", a->k, a->npages);
    }
    return KV_OK;
}

/* The bound of page p for KV head g (the twin's exact summation order). */
static float bound(const kvk_select_args *a, uint32_t p, uint32_t g) {
    const uint32_t D = a->head_dim, G = a->num_qo_heads / a->num_kv_heads;
    const float *mn = a->summaries +
                      (size_t)p * KVK_SUMMARY_FLOATS(a->num_layers, a->num_kv_heads, D) +
                      ((size_t)a->layer * a->num_kv_heads + g) * KVK_SUMMARY_PARTS * D;
    const float *mx = mn + D, *me = mx + D;
    float best = -INFINITY;
    if (mn[0] > mx[0]) {
        return -INFINITY; /* an empty page (no token summarised): never better than any */
    }
    for (uint32_t j = 0; j < G; j++) {
        const float *q = a->q + (size_t)(g * G + j) * D;
        float s = 0.0f;
        for (uint32_t d = 0; d < D; d++) {
            if (q[d] == 0.0f) {
                continue; /* contributes 0 whatever the key (never 0 * inf) */
            }
            if (a->mode == KVK_SELECT_CENTROID) {
                s = s + q[d] * me[d];
            } else {
                float x = q[d] * mn[d], y = q[d] * mx[d];
                s = s + (x > y ? x : y);
            }
        }
        best = s > best ? s : best; /* a NaN (0 * inf) never wins here */
    }
    return best;
}

/* bound() for pages p .. p+7 at once (AVX2; no FMA): each lane does exactly bound()'s
 * operations in bound()'s order (_mm256_max_ps(x, y) is x > y ? x : y, NaN included), so the
 * scores are bitwise the scalar ones. */
__attribute__((target("avx2"))) static void bound8(const kvk_select_args *a, uint32_t p, uint32_t g,
                                                   float *out) {
    const uint32_t D = a->head_dim, G = a->num_qo_heads / a->num_kv_heads;
    const size_t per = KVK_SUMMARY_FLOATS(a->num_layers, a->num_kv_heads, D);
    const float *mn = a->summaries + (size_t)p * per +
                      ((size_t)a->layer * a->num_kv_heads + g) * KVK_SUMMARY_PARTS * D;
    const __m256i idx =
        _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32((int)per));
    __m256 best = _mm256_set1_ps(-INFINITY);
    for (uint32_t j = 0; j < G; j++) {
        const float *q = a->q + (size_t)(g * G + j) * D;
        __m256 s = _mm256_setzero_ps();
        for (uint32_t d = 0; d < D; d++) {
            if (q[d] == 0.0f) {
                continue;
            }
            __m256 qd = _mm256_set1_ps(q[d]);
            if (a->mode == KVK_SELECT_CENTROID) {
                __m256 me = _mm256_i32gather_ps(mn + 2 * D + d, idx, 4);
                s = _mm256_add_ps(s, _mm256_mul_ps(qd, me));
            } else {
                __m256 x = _mm256_mul_ps(qd, _mm256_i32gather_ps(mn + d, idx, 4));
                __m256 y = _mm256_mul_ps(qd, _mm256_i32gather_ps(mn + D + d, idx, 4));
                s = _mm256_add_ps(s, _mm256_max_ps(x, y));
            }
        }
        best = _mm256_max_ps(s, best);
    }
    _mm256_storeu_ps(out, best);
    for (uint32_t l = 0; l < 8; l++) {
        const float *m = mn + (size_t)l * per;
        if (m[0] > m[D]) {
            out[l] = -INFINITY; /* an empty page */
        }
    }
}

kv_err kvk_page_select_cpu(const kvk_select_args *a, int32_t *out, float *score) {
    kv_err rc = kvk__check_select(a, out);
    if (rc != KV_OK) {
        return rc;
    }
    float *sc = score != NULL ? score : malloc((size_t)a->num_kv_heads * a->npages * sizeof(float));
    uint8_t *taken = malloc(a->npages);
    if (sc == NULL || taken == NULL) {
        if (score == NULL) {
            free(sc);
        }
        free(taken);
        return kvk__fail(KV_ENOMEM, "page_select: no memory for %u pages", a->npages);
    }
    for (uint32_t g = 0; g < a->num_kv_heads; g++) {
        float *s = sc + (size_t)g * a->npages;
        uint32_t p = 0;
        size_t per = KVK_SUMMARY_FLOATS(a->num_layers, a->num_kv_heads, a->head_dim);
        if (kvk__ops() != NULL && per * 8 < (size_t)INT32_MAX) {
            for (; p + 8 <= a->npages; p += 8) {
                bound8(a, p, g, s + p); /* AVX2 is there when kvk__ops() is (kvk_cpu.c) */
            }
        }
        for (; p < a->npages; p++) {
            s[p] = bound(a, p, g);
        }
        /* k rounds of "the best page not taken" (the lower page on ties), then page order. */
        memset(taken, 0, a->npages);
        int32_t *o = out + (size_t)g * a->k;
        for (uint32_t r = 0; r < a->k; r++) {
            uint32_t best = UINT32_MAX;
            for (uint32_t p = 0; p < a->npages; p++) {
                if (!taken[p] && (best == UINT32_MAX || s[p] > s[best])) {
                    best = p;
                }
            }
            taken[best] = 1;
        }
        uint32_t k = 0;
        for (uint32_t p = 0; p < a->npages; p++) {
            if (taken[p]) {
                o[k++] = (int32_t)p;
            }
        }
    }
    if (score == NULL) {
        free(sc);
    }
    free(taken);
    return KV_OK;
}
