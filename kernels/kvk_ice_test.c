/* kvk_ice tests: page summaries equal a naive min/max for every dtype (full and partial pages);
 * selection's bound is at least every logit of the page (random pages); with exact scores
 * (pages whose keys are all equal) selection returns the true top-k pages per KV head; refusals.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>

#include <cmocka.h>

#include "kernels/kvk_internal.h"
#include "kernels/kvk_testutil.h"

static const kv_dtype dtypes[] = {KV_DTYPE_FP32, KV_DTYPE_FP16, KV_DTYPE_BF16, KV_DTYPE_INT8,
                                  KV_DTYPE_FP8_E4M3};

static void test_summaries_naive(void **state) {
    (void)state;
    for (size_t d = 0; d < sizeof(dtypes) / sizeof(dtypes[0]); d++) {
        for (int arr = 0; arr < 2; arr++) {
            const uint32_t L = 3, H = 2, D = 8, T = 16;
            tu_seg s;
            tu_seg_init(&s, L, H, D, T, dtypes[d], arr ? KV_BLOCK_MAJOR : KV_LAYER_MAJOR, 6);
            int32_t blocks[3] = {4, 0, 5};
            uint32_t ntok[3] = {16, 5, 0};
            size_t per = KVK_SUMMARY_FLOATS(L, H, D);
            float out[3 * 3 * 2 * 3 * 8];
            assert_int_equal(kvk_page_summaries_cpu(&s.c, blocks, ntok, 3, out), KV_OK);
            for (uint32_t i = 0; i < 3; i++) {
                for (uint32_t l = 0; l < L; l++) {
                    for (uint32_t h = 0; h < H; h++) {
                        const float *mn = out + i * per + ((size_t)l * H + h) * 3 * D;
                        for (uint32_t e = 0; e < D; e++) {
                            float lo = INFINITY, hi = -INFINITY;
                            double sum = 0;
                            for (uint32_t t = 0; t < ntok[i]; t++) {
                                float x = tu_cache_elem(&s.c, (uint32_t)blocks[i], l * 2, t, h, e);
                                lo = x < lo ? x : lo;
                                hi = x > hi ? x : hi;
                                sum += x;
                            }
                            assert_true(mn[e] == lo);
                            assert_true(mn[D + e] == hi);
                            double mean = ntok[i] > 0 ? sum / ntok[i] : 0.0;
                            assert_true(fabs(mn[2 * D + e] - mean) <= 1e-5 * (1 + fabs(mean)));
                        }
                    }
                }
            }
            /* ntok NULL: whole pages. */
            assert_int_equal(kvk_page_summaries_cpu(&s.c, blocks, NULL, 1, out), KV_OK);
            tu_seg_fini(&s);
        }
    }
}

/* The bound of every page is >= the logit of every key the page holds, for every query head. */
static void test_bound_holds(void **state) {
    (void)state;
    const uint32_t L = 2, H = 2, D = 16, T = 16, NB = 10, QH = 4;
    tu_seg s;
    tu_seg_init(&s, L, H, D, T, KV_DTYPE_FP16, KV_LAYER_MAJOR, NB);
    int32_t blocks[10];
    for (uint32_t i = 0; i < NB; i++) {
        blocks[i] = (int32_t)i;
    }
    float *summ = malloc(NB * KVK_SUMMARY_FLOATS(L, H, D) * sizeof(float));
    assert_int_equal(kvk_page_summaries_cpu(&s.c, blocks, NULL, NB, summ), KV_OK);
    float q[4 * 16];
    for (int i = 0; i < 64; i++) {
        q[i] = tu_randf();
    }
    kvk_select_args a = {.summaries = summ,
                         .npages = NB,
                         .num_layers = L,
                         .layer = 1,
                         .num_kv_heads = H,
                         .head_dim = D,
                         .q = q,
                         .num_qo_heads = QH,
                         .k = 3};
    int32_t out[2 * 3];
    float score[2 * 10];
    assert_int_equal(kvk_page_select_cpu(&a, out, score), KV_OK);
    for (uint32_t g = 0; g < H; g++) {
        for (uint32_t p = 0; p < NB; p++) {
            for (uint32_t j = 0; j < QH / H; j++) {
                for (uint32_t t = 0; t < T; t++) {
                    double dot = 0;
                    for (uint32_t e = 0; e < D; e++) {
                        dot += (double)q[(g * (QH / H) + j) * D + e] *
                               tu_cache_elem(&s.c, p, 2, t, g, e);
                    }
                    assert_true(score[g * NB + p] >= dot - 1e-4);
                }
            }
        }
        /* The chosen pages are the k best bounds, in page order. */
        for (int r = 1; r < 3; r++) {
            assert_true(out[g * 3 + r - 1] < out[g * 3 + r]);
        }
        for (uint32_t p = 0; p < NB; p++) {
            int chosen = 0;
            for (int r = 0; r < 3; r++) {
                chosen |= out[g * 3 + r] == (int32_t)p;
            }
            if (!chosen) {
                for (int r = 0; r < 3; r++) {
                    assert_true(score[g * NB + p] <= score[g * NB + out[g * 3 + r]]);
                }
            }
        }
    }
    free(summ);
    tu_seg_fini(&s);
}

/* Pages whose keys are all one vector: the bound is the exact logit, and selection must return
 * exactly the pages with the k largest exact scores (distinct by construction). */
static void test_exact_topk(void **state) {
    (void)state;
    const uint32_t L = 1, H = 2, D = 8, T = 4, NB = 40, QH = 2, K = 7;
    tu_seg s;
    tu_seg_init(&s, L, H, D, T, KV_DTYPE_FP32, KV_BLOCK_MAJOR, NB);
    float q[2 * 8];
    for (int i = 0; i < 16; i++) {
        q[i] = i % 8 == 0 ? 1.0f : 0.0f; /* the logit is the key's channel 0 */
    }
    double exact[2][40];
    for (uint32_t p = 0; p < NB; p++) {
        for (uint32_t g = 0; g < H; g++) {
            float v = (float)((p * 37 + g * 11) % NB) / 8.0f; /* distinct per head */
            for (uint32_t t = 0; t < T; t++) {
                for (uint32_t e = 0; e < D; e++) {
                    float *x = (float *)((char *)s.c.data + (int64_t)p * s.c.block_stride) +
                               ((size_t)t * H + g) * D + e;
                    *x = e == 0 ? v : tu_randf();
                }
            }
            exact[g][p] = v;
        }
    }
    /* Channels other than 0 vary across the page but q is 0 there: the bound is exact. */
    int32_t blocks[40];
    for (uint32_t i = 0; i < NB; i++) {
        blocks[i] = (int32_t)i;
    }
    float *summ = malloc(NB * KVK_SUMMARY_FLOATS(L, H, D) * sizeof(float));
    assert_int_equal(kvk_page_summaries_cpu(&s.c, blocks, NULL, NB, summ), KV_OK);
    kvk_select_args a = {.summaries = summ,
                         .npages = NB,
                         .num_layers = L,
                         .layer = 0,
                         .num_kv_heads = H,
                         .head_dim = D,
                         .q = q,
                         .num_qo_heads = QH,
                         .k = K};
    int32_t out[2 * 7];
    for (a.mode = KVK_SELECT_BOUND; a.mode <= KVK_SELECT_CENTROID; a.mode++) {
        assert_int_equal(kvk_page_select_cpu(&a, out, NULL), KV_OK);
        for (uint32_t g = 0; g < H; g++) {
            for (uint32_t r = 0; r < K; r++) {
                uint32_t above = 0;
                for (uint32_t p = 0; p < NB; p++) {
                    above += exact[g][p] > exact[g][out[g * K + r]];
                }
                assert_true(above < K); /* each chosen page is among the K largest */
            }
        }
    }
    free(summ);
    tu_seg_fini(&s);
}

/* An empty page (0 tokens: min +inf, max -inf) scores -inf in both modes and is taken only when
 * nothing else is left; an infinite key never makes a score NaN. */
static void test_empty_and_infinite_pages(void **state) {
    (void)state;
    const uint32_t D = 4, NP = 5;
    float summ[5 * 3 * 4];
    for (uint32_t p = 0; p < NP; p++) {
        for (uint32_t d = 0; d < D; d++) {
            float v = (float)p + 1.0f;
            summ[p * 12 + d] = p == 1 ? INFINITY : v;      /* min */
            summ[p * 12 + 4 + d] = p == 1 ? -INFINITY : v; /* max */
            summ[p * 12 + 8 + d] = p == 1 ? 0.0f : v;      /* mean */
        }
    }
    summ[3 * 12 + 4 + 2] = INFINITY; /* page 3: an infinite max in channel 2 */
    float q[4] = {1.0f, 0.5f, 0.0f, 0.25f};
    kvk_select_args a = {.summaries = summ,
                         .npages = NP,
                         .num_layers = 1,
                         .layer = 0,
                         .num_kv_heads = 1,
                         .head_dim = D,
                         .q = q,
                         .num_qo_heads = 1,
                         .k = 4};
    int32_t out[5];
    float sc[5];
    for (a.mode = KVK_SELECT_BOUND; a.mode <= KVK_SELECT_CENTROID; a.mode++) {
        assert_int_equal(kvk_page_select_cpu(&a, out, sc), KV_OK);
        assert_true(sc[1] == -INFINITY);
        for (uint32_t p = 0; p < NP; p++) {
            assert_false(isnan(sc[p]));
        }
        /* The four real pages, not the empty one (page 3's infinite channel meets q = 0). */
        assert_int_equal(out[0], 0);
        assert_int_equal(out[1], 2);
        assert_int_equal(out[2], 3);
        assert_int_equal(out[3], 4);
    }
    a.k = 5;
    a.mode = KVK_SELECT_BOUND;
    assert_int_equal(kvk_page_select_cpu(&a, out, sc), KV_OK);
    assert_int_equal(out[1], 1); /* taken last, when nothing else is left */
}

/* The vectorised scoring (8 pages at once) gives the scalar scores bit for bit: random pages,
 * a count that is not a multiple of 8, empty pages and infinite keys among them. */
static void test_simd_equals_scalar(void **state) {
    (void)state;
    const uint32_t L = 2, H = 4, D = 32, NP = 45, QH = 8;
    size_t per = KVK_SUMMARY_FLOATS(L, H, D);
    float *summ = malloc(NP * per * sizeof(float));
    for (size_t i = 0; i < NP * per; i++) {
        summ[i] = tu_randf() * 3.0f;
    }
    for (uint32_t p = 0; p < NP; p += 7) { /* every 7th page empty in (layer 1, head 2) */
        float *m = summ + p * per + ((size_t)1 * H + 2) * 3 * D;
        m[0] = INFINITY;
        m[D] = -INFINITY;
    }
    summ[9 * per + 5] = INFINITY;
    float q[8 * 32];
    for (int i = 0; i < 8 * 32; i++) {
        q[i] = i % 5 == 0 ? 0.0f : tu_randf();
    }
    float vec[4 * 45], sca[4 * 45];
    int32_t ov[4 * 6], os[4 * 6];
    for (int mode = KVK_SELECT_BOUND; mode <= KVK_SELECT_CENTROID; mode++) {
        for (uint32_t layer = 0; layer < L; layer++) {
            kvk_select_args a = {.summaries = summ,
                                 .npages = NP,
                                 .num_layers = L,
                                 .layer = layer,
                                 .num_kv_heads = H,
                                 .head_dim = D,
                                 .q = q,
                                 .num_qo_heads = QH,
                                 .k = 6,
                                 .mode = mode};
            int level = kvk__simd_force(KVK__SIMD_AVX512); /* capped at what the CPU has */
            assert_int_equal(kvk_page_select_cpu(&a, ov, vec), KV_OK);
            kvk__simd_force(KVK__SIMD_SCALAR);
            assert_int_equal(kvk_page_select_cpu(&a, os, sca), KV_OK);
            kvk__simd_force(level);
            assert_memory_equal(vec, sca, sizeof(vec));
            assert_memory_equal(ov, os, sizeof(ov));
        }
    }
    free(summ);
}

static void test_refusals(void **state) {
    (void)state;
    tu_seg s;
    tu_seg_init(&s, 1, 1, 4, 4, KV_DTYPE_FP16, KV_LAYER_MAJOR, 2);
    int32_t bad[1] = {2};
    uint32_t many[1] = {5};
    int32_t ok[1] = {1};
    float out[12];
    assert_int_equal(kvk_page_summaries_cpu(&s.c, bad, NULL, 1, out), KV_EINVAL);
    assert_int_equal(kvk_page_summaries_cpu(&s.c, ok, many, 1, out), KV_EINVAL);
    assert_int_equal(kvk_page_summaries_cpu(&s.c, ok, NULL, 1, out), KV_OK);
    float q[4] = {1, 0, 0, 0};
    int32_t sel[2];
    kvk_select_args a = {.summaries = out,
                         .npages = 1,
                         .num_layers = 1,
                         .layer = 0,
                         .num_kv_heads = 1,
                         .head_dim = 4,
                         .q = q,
                         .num_qo_heads = 1,
                         .k = 2};
    assert_int_equal(kvk_page_select_cpu(&a, sel, NULL), KV_EINVAL); /* k > npages */
    a.k = 1;
    a.layer = 1;
    assert_int_equal(kvk_page_select_cpu(&a, sel, NULL), KV_EINVAL);
    a.layer = 0;
    a.mode = 7;
    assert_int_equal(kvk_page_select_cpu(&a, sel, NULL), KV_EINVAL);
    a.mode = KVK_SELECT_BOUND;
    assert_int_equal(kvk_page_select_cpu(&a, sel, NULL), KV_OK);
    assert_int_equal(sel[0], 0);
    tu_seg_fini(&s);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_summaries_naive),    cmocka_unit_test(test_bound_holds),
        cmocka_unit_test(test_exact_topk),         cmocka_unit_test(test_empty_and_infinite_pages),
        cmocka_unit_test(test_simd_equals_scalar), cmocka_unit_test(test_refusals),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
