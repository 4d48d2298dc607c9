/* kvk_zip tests: compact_tokens against a naive gather for every dtype, page size and arrangement
 * (bit for bit where scales agree, the requantization formula where they do not), its refusals
 * (ids out of range, a fresh block that is also read), and token_scores against a
 * double-precision softmax oracle (each (query, head)'s probabilities sum to 1, so one call adds
 * exactly 1 in all), causal and not, with GQA.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>

#include <cmocka.h>

#include "kernels/kvk_testutil.h"

static const kv_dtype dtypes[] = {KV_DTYPE_FP32, KV_DTYPE_FP16, KV_DTYPE_BF16, KV_DTYPE_INT8,
                                  KV_DTYPE_FP8_E4M3};
static const uint32_t page_sizes[] = {1, 3, 16, 32};

static float *scale_ptr(const kvk_cache *c, uint32_t b, uint32_t sec) {
    return (float *)((char *)c->scales + (int64_t)b * c->scale_block_stride +
                     (int64_t)sec * c->scale_section_stride);
}

static const char *row_ptr(const kvk_cache *c, uint32_t b, uint32_t sec, uint32_t off) {
    uint64_t row = (uint64_t)c->num_kv_heads * c->head_dim * kvk_dtype_bytes(c->dtype);
    return (const char *)c->data + (int64_t)b * c->block_stride + (int64_t)sec * c->section_stride +
           off * row;
}

/* Keeps a random subset of the tokens of source blocks [0, nsrc) in token order and gathers
 * them into fresh blocks [nsrc, ...) of the same cache; checks every row and scale. With
 * same_scales, every block of a section/head shares one scale, so every row must be copied bit
 * for bit. */
static void check_compact(kv_dtype dt, uint32_t tpb, kv_arrangement arr, int same_scales) {
    const uint32_t layers = 2, heads = 2, dim = 8, nsrc = 6, nblocks = 12;
    tu_seg s;
    tu_seg_init(&s, layers, heads, dim, tpb, dt, arr, nblocks);
    int scaled = dt == KV_DTYPE_INT8 || dt == KV_DTYPE_FP8_E4M3;
    if (scaled && same_scales) {
        for (uint32_t b = 1; b < nblocks; b++) {
            for (uint32_t sec = 0; sec < s.c.num_sections; sec++) {
                memcpy(scale_ptr(&s.c, b, sec), scale_ptr(&s.c, 0, sec), heads * sizeof(float));
            }
        }
    }
    int64_t slots[6 * 32];
    uint32_t n = 0;
    for (uint32_t t = 0; t < nsrc * tpb; t++) {
        if (t < 2 || tu_rand() % 3 != 0) {
            slots[n++] = (int64_t)t;
        }
    }
    uint32_t ndst = (n + tpb - 1) / tpb;
    assert_true(nsrc + ndst <= nblocks);
    int32_t dstb[12];
    for (uint32_t j = 0; j < ndst; j++) {
        dstb[j] = (int32_t)(nblocks - 1 - j); /* fresh blocks, in reverse order */
    }
    uint8_t *before = malloc(kv_layout_segment_bytes(&s.l, nblocks));
    memcpy(before, s.mem, kv_layout_segment_bytes(&s.l, nblocks));
    assert_int_equal(kvk_compact_tokens_cpu(&s.c, &s.c, slots, n, dstb), KV_OK);
    size_t eb = kvk_dtype_bytes(dt);
    for (uint32_t i = 0; i < n; i++) {
        uint32_t sb = (uint32_t)(slots[i] / tpb), so = (uint32_t)(slots[i] % tpb);
        uint32_t db = (uint32_t)dstb[i / tpb], dof = i % tpb;
        uint32_t fb = (uint32_t)(slots[(i / tpb) * tpb] / tpb);
        for (uint32_t sec = 0; sec < s.c.num_sections; sec++) {
            const char *from = row_ptr(&s.c, sb, sec, so);
            const char *to = row_ptr(&s.c, db, sec, dof);
            for (uint32_t h = 0; h < heads; h++) {
                float ss = scaled ? scale_ptr(&s.c, sb, sec)[h] : 1.0f;
                float sd = scaled ? scale_ptr(&s.c, fb, sec)[h] : 1.0f;
                if (scaled) {
                    assert_true(memcmp(&scale_ptr(&s.c, db, sec)[h], &sd, sizeof(float)) == 0);
                }
                if (!scaled || ss == sd) {
                    assert_memory_equal(to + h * dim * eb, from + h * dim * eb, dim * eb);
                    continue;
                }
                /* Requantized: the stored code is the source value re-expressed in the fresh
                 * block's scale, rounded as the dtype rounds. */
                for (uint32_t e = 0; e < dim; e++) {
                    uint8_t want = 0;
                    float x = kvk_load_f32(dt, from, (uint64_t)h * dim + e) * (ss / sd);
                    kvk_store_f32(dt, &want, 0, x);
                    assert_int_equal((uint8_t)to[h * dim + e], want);
                }
            }
        }
    }
    /* The source blocks are untouched (the shared-prefix rule: compaction only reads them). */
    for (uint32_t b = 0; b < nsrc; b++) {
        for (uint32_t sec = 0; sec < s.c.num_sections; sec++) {
            size_t off = (size_t)((uintptr_t)row_ptr(&s.c, b, sec, 0) - (uintptr_t)s.mem);
            assert_memory_equal(s.mem + off, before + off, (size_t)tpb * heads * dim * eb);
        }
    }
    free(before);
    tu_seg_fini(&s);
}

static void test_compact_equals_gather(void **state) {
    (void)state;
    for (size_t d = 0; d < sizeof(dtypes) / sizeof(dtypes[0]); d++) {
        for (size_t p = 0; p < sizeof(page_sizes) / sizeof(page_sizes[0]); p++) {
            for (int arr = 0; arr < 2; arr++) {
                check_compact(dtypes[d], page_sizes[p], arr ? KV_BLOCK_MAJOR : KV_LAYER_MAJOR, 1);
                check_compact(dtypes[d], page_sizes[p], arr ? KV_BLOCK_MAJOR : KV_LAYER_MAJOR, 0);
            }
        }
    }
}

static void test_compact_refuses(void **state) {
    (void)state;
    tu_seg s;
    tu_seg_init(&s, 1, 1, 4, 4, KV_DTYPE_FP16, KV_LAYER_MAJOR, 4);
    int64_t slots[2] = {0, 1};
    int32_t dst[1] = {3};
    int32_t bad[1] = {4};
    int32_t self[1] = {0};
    int64_t far[2] = {0, 16};
    assert_int_equal(kvk_compact_tokens_cpu(&s.c, &s.c, slots, 2, bad), KV_EINVAL);
    assert_int_equal(kvk_compact_tokens_cpu(&s.c, &s.c, far, 2, dst), KV_EINVAL);
    assert_int_equal(kvk_compact_tokens_cpu(&s.c, &s.c, slots, 2, self), KV_EINVAL);
    assert_non_null(strstr(kvk_last_error(), "both read"));
    assert_int_equal(kvk_compact_tokens_cpu(&s.c, &s.c, NULL, 2, dst), KV_EINVAL);
    assert_int_equal(kvk_compact_tokens_cpu(&s.c, &s.c, slots, 0, NULL), KV_OK);
    tu_seg s8;
    tu_seg_init(&s8, 1, 1, 4, 4, KV_DTYPE_FP32, KV_LAYER_MAJOR, 4);
    assert_int_equal(kvk_compact_tokens_cpu(&s.c, &s8.c, slots, 2, dst), KV_EINVAL);
    tu_seg_fini(&s8);
    tu_seg_fini(&s);
}

/* The oracle: double-precision softmax of each (query, head) over its visible tokens. */
static void scores_oracle(const tu_seg *s, uint32_t layer, const int32_t *pages, uint32_t n,
                          const float *q, uint32_t nq, uint32_t qh, int causal, double *out) {
    const kvk_cache *c = &s->c;
    uint32_t tpb = c->tokens_per_block, dim = c->head_dim, group = qh / c->num_kv_heads;
    double *l = malloc(n * sizeof(double));
    for (uint32_t t = 0; t < n; t++) {
        out[t] = 0.0;
    }
    for (uint32_t j = 0; j < nq; j++) {
        int64_t vis = causal ? (int64_t)n - nq + j + 1 : (int64_t)n;
        for (uint32_t h = 0; h < qh && vis > 0; h++) {
            double m = -INFINITY, z = 0.0;
            for (int64_t t = 0; t < vis; t++) {
                double d = 0.0;
                for (uint32_t e = 0; e < dim; e++) {
                    d += (double)q[((size_t)j * qh + h) * dim + e] *
                         tu_cache_elem(c, (uint32_t)pages[t / tpb], layer * 2, (uint32_t)t % tpb,
                                       h / group, e);
                }
                l[t] = d / sqrt((double)dim);
                m = l[t] > m ? l[t] : m;
            }
            for (int64_t t = 0; t < vis; t++) {
                z += exp(l[t] - m);
            }
            for (int64_t t = 0; t < vis; t++) {
                out[t] += exp(l[t] - m) / z / (double)(nq * qh);
            }
        }
    }
    free(l);
}

static void test_scores_match_oracle(void **state) {
    (void)state;
    for (size_t d = 0; d < sizeof(dtypes) / sizeof(dtypes[0]); d++) {
        for (int causal = 0; causal < 2; causal++) {
            const uint32_t tpb = 16, heads = 2, dim = 16, qh = 4, nq = 5, n = 70;
            tu_seg s;
            tu_seg_init(&s, 2, heads, dim, tpb, dtypes[d], KV_BLOCK_MAJOR, 8);
            int32_t pages[5] = {6, 2, 0, 7, 3};
            float q[5 * 4 * 16];
            for (size_t i = 0; i < sizeof(q) / sizeof(q[0]); i++) {
                q[i] = tu_randf() * 2.0f;
            }
            kvk_score_args a = {.q = q,
                                .q_dtype = KV_DTYPE_FP32,
                                .nq = nq,
                                .num_qo_heads = qh,
                                .sm_scale = 1.0f / sqrtf((float)dim),
                                .causal = causal};
            float scores[70] = {0};
            double want[70];
            assert_int_equal(kvk_token_scores_cpu(&s.c, 1, pages, n, &a, scores), KV_OK);
            scores_oracle(&s, 1, pages, n, q, nq, qh, causal, want);
            double sum = 0.0;
            for (uint32_t t = 0; t < n; t++) {
                assert_true(fabs(scores[t] - want[t]) <= 1e-5 + 1e-4 * want[t]);
                sum += scores[t];
            }
            assert_true(fabs(sum - 1.0) < 1e-4);
            /* Accumulates: a second call adds the same again. */
            assert_int_equal(kvk_token_scores_cpu(&s.c, 1, pages, n, &a, scores), KV_OK);
            for (uint32_t t = 0; t < n; t++) {
                assert_true(fabs(scores[t] - 2.0 * want[t]) <= 2e-5 + 2e-4 * want[t]);
            }
            tu_seg_fini(&s);
        }
    }
}

static void test_scores_refuse(void **state) {
    (void)state;
    tu_seg s;
    tu_seg_init(&s, 1, 2, 8, 4, KV_DTYPE_FP32, KV_LAYER_MAJOR, 2);
    float q[8 * 4] = {0};
    float out[8] = {0};
    int32_t pages[2] = {0, 2};
    kvk_score_args a = {
        .q = q, .q_dtype = KV_DTYPE_FP32, .nq = 1, .num_qo_heads = 4, .sm_scale = 1.0f};
    assert_int_equal(kvk_token_scores_cpu(&s.c, 0, pages, 8, &a, out), KV_EINVAL); /* page 2 */
    pages[1] = 1;
    assert_int_equal(kvk_token_scores_cpu(&s.c, 1, pages, 8, &a, out), KV_EINVAL); /* layer */
    a.num_qo_heads = 3;
    assert_int_equal(kvk_token_scores_cpu(&s.c, 0, pages, 8, &a, out), KV_EINVAL);
    a.num_qo_heads = 4;
    a.nq = 0;
    assert_int_equal(kvk_token_scores_cpu(&s.c, 0, pages, 8, &a, out), KV_EINVAL);
    a.nq = 1;
    assert_int_equal(kvk_token_scores_cpu(&s.c, 0, pages, 8, &a, out), KV_OK);
    tu_seg_fini(&s);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_compact_equals_gather),
        cmocka_unit_test(test_compact_refuses),
        cmocka_unit_test(test_scores_match_oracle),
        cmocka_unit_test(test_scores_refuse),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
