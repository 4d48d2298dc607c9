/* GPU tests (tag requires-gpu): every CUDA kernel against its CPU twin on the same inputs.
 * Copies, cache writes and (de)quantization must match byte for byte (they share kvk_dtype.h's
 * rounding); decode attention and merge_states within |gpu - cpu| <= 2e-3 + 2 u(out dtype) *
 * max(1, |cpu|) for outputs and 1e-3 * max(1, |cpu|) for lse (float summation order differs).
 * Decode attention run twice on the same inputs must give bitwise-equal output and lse.
 * On a machine without a GPU every test skips.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>

#include <cmocka.h>

#include "kernels/kvk_testutil.h"

static int have_gpu(void) {
    char why[256];
    int n = kvk_gpu_probe(why, sizeof(why));
    if (n == 0) {
        const char *expect = getenv("KVD_EXPECT_GPU");
        if (expect != NULL && strcmp(expect, "1") == 0) {
            fail_msg("KVD_EXPECT_GPU=1 but %s", why);
        }
        printf("skipping: %s\n", why);
    }
    return n > 0;
}

#define OK(call)                                                                                   \
    do {                                                                                           \
        kv_err rc_ = (call);                                                                       \
        if (rc_ != KV_OK) {                                                                        \
            fail_msg("%s: %s (%s)", #call, kv_err_name(rc_), kvk_last_error());                    \
        }                                                                                          \
    } while (0)

/* Copies n bytes of host memory to a new device buffer. */
static void *to_dev(const void *h, size_t n) {
    void *d = NULL;
    OK(kvk_dev_alloc(n ? n : 16, &d));
    if (n) {
        OK(kvk_dev_memcpy(d, h, n, KVK_H2D));
    }
    return d;
}

/* A device copy of a host segment with its own descriptor. */
typedef struct dev_seg {
    void *mem;
    kvk_cache c;
    uint64_t bytes;
} dev_seg;

static void dev_seg_init(dev_seg *d, const tu_seg *s) {
    d->bytes = kv_layout_segment_bytes(&s->l, s->nblocks);
    d->mem = to_dev(s->mem, d->bytes);
    OK(kvk_cache_from_segment(&s->l, (uintptr_t)d->mem, s->nblocks, &d->c));
}

static void dev_seg_check_equal(const dev_seg *d, const tu_seg *s) {
    uint8_t *h = malloc(d->bytes);
    OK(kvk_dev_memcpy(h, d->mem, d->bytes, KVK_D2H));
    assert_memory_equal(h, s->mem, d->bytes);
    free(h);
}

static void test_copy_blocks_gpu(void **state) {
    (void)state;
    if (!have_gpu()) {
        skip();
    }
    const kv_dtype dts[] = {KV_DTYPE_FP16, KV_DTYPE_INT8};
    for (int i = 0; i < 2; i++) {
        tu_seg lm, bm;
        tu_seg_init(&lm, 3, 4, 64, 16, dts[i], KV_LAYER_MAJOR, 10);
        tu_seg_init(&bm, 3, 4, 64, 16, dts[i], KV_BLOCK_MAJOR, 7);
        dev_seg dlm, dbm;
        dev_seg_init(&dlm, &lm);
        dev_seg_init(&dbm, &bm);
        const int32_t src[] = {9, 0, 4, 2, 7};
        const int32_t dst[] = {0, 6, 3, 1, 2};
        int32_t *ds = to_dev(src, sizeof(src)), *dd = to_dev(dst, sizeof(dst));
        OK(kvk_copy_blocks_cpu(&lm.c, &bm.c, src, dst, 5));
        OK(kvk_copy_blocks_cuda(&dlm.c, &dbm.c, ds, dd, 5, NULL));
        OK(kvk_dev_sync());
        dev_seg_check_equal(&dbm, &bm);
        /* and back, block-major to layer-major */
        OK(kvk_copy_blocks_cpu(&bm.c, &lm.c, dst, src, 5));
        OK(kvk_copy_blocks_cuda(&dbm.c, &dlm.c, dd, ds, 5, NULL));
        OK(kvk_dev_sync());
        dev_seg_check_equal(&dlm, &lm);
        kvk_dev_free(ds);
        kvk_dev_free(dd);
        kvk_dev_free(dlm.mem);
        kvk_dev_free(dbm.mem);
        tu_seg_fini(&lm);
        tu_seg_fini(&bm);
    }
}

static void test_reshape_and_cache_gpu(void **state) {
    (void)state;
    if (!have_gpu()) {
        skip();
    }
    const kv_dtype dts[] = {KV_DTYPE_FP16, KV_DTYPE_BF16, KV_DTYPE_FP32, KV_DTYPE_FP8_E4M3,
                            KV_DTYPE_INT8};
    for (int i = 0; i < 5; i++) {
        tu_seg s;
        tu_seg_init(&s, 2, 4, 128, 16, dts[i], i % 2 ? KV_BLOCK_MAJOR : KV_LAYER_MAJOR, 6);
        dev_seg d;
        dev_seg_init(&d, &s);
        enum { N = 40 };
        static uint16_t k[N * 4 * 128], v[N * 4 * 128];
        tu_fill(KV_DTYPE_BF16, k, N * 4 * 128, 2.0f);
        tu_fill(KV_DTYPE_BF16, v, N * 4 * 128, 2.0f);
        int64_t slots[N];
        for (int t = 0; t < N; t++) {
            slots[t] = t % 7 == 3 ? -1 : (int64_t)((t * 37) % 96);
        }
        const float ks[4] = {0.01f, 0.02f, 0.03f, 0.04f}, vs[4] = {0.05f, 0.01f, 0.02f, 0.03f};
        kvk_tokens t = {k, v, 4 * 128 * 2, KV_DTYPE_BF16, ks, vs};
        OK(kvk_reshape_and_cache_cpu(&s.c, 1, &t, slots, N));
        kvk_tokens td = {to_dev(k, sizeof(k)), to_dev(v, sizeof(v)),   4 * 128 * 2,
                         KV_DTYPE_BF16,        to_dev(ks, sizeof(ks)), to_dev(vs, sizeof(vs))};
        int64_t *dslots = to_dev(slots, sizeof(slots));
        OK(kvk_reshape_and_cache_cuda(&d.c, 1, &td, dslots, N, NULL));
        OK(kvk_dev_sync());
        dev_seg_check_equal(&d, &s);
        kvk_dev_free((void *)td.k);
        kvk_dev_free((void *)td.v);
        kvk_dev_free((void *)td.k_scale);
        kvk_dev_free((void *)td.v_scale);
        kvk_dev_free(dslots);
        kvk_dev_free(d.mem);
        tu_seg_fini(&s);
    }
}

static void check_decode_arr(uint32_t page, uint32_t kv_heads, uint32_t gqa, uint32_t dim,
                             kv_dtype kdt, kv_dtype qdt, int split, kv_arrangement arr) {
    const uint32_t qo = kv_heads * gqa;
    const uint32_t lens[] = {1, 300, 0, 64, 1000, 17, 2048};
    const uint32_t batch = 7;
    uint32_t pages = 0;
    for (uint32_t i = 0; i < batch; i++) {
        pages += (lens[i] + page - 1) / page;
    }
    tu_seg s;
    tu_seg_init(&s, 2, kv_heads, dim, page, kdt, arr, pages + 2);
    tu_pt t;
    assert_int_equal(tu_pt_init(&t, lens, batch, page, pages + 2), 0);
    dev_seg d;
    dev_seg_init(&d, &s);
    uint64_t qn = (uint64_t)batch * qo * dim;
    void *q = malloc(qn * 4), *out = malloc(qn * 4), *gout = malloc(qn * 4);
    float *lse = malloc(batch * qo * 4), *glse = malloc(batch * qo * 4);
    tu_fill(qdt, q, qn, 1.0f);
    float sm = 1.0f / sqrtf((float)dim);
    kvk_decode_args a = {q, out, lse, qdt, qo, sm};
    OK(kvk_paged_decode_attention_cpu(&s.c, 1, &t.pt, &a));
    size_t ws_bytes = kvk_paged_decode_attention_workspace_bytes(batch, qo, dim, 16);
    void *ws = NULL;
    if (split) {
        OK(kvk_dev_alloc(ws_bytes, &ws));
    }
    uint32_t np = (uint32_t)t.indptr[batch];
    kvk_page_table dpt = {to_dev(t.indptr, (batch + 1) * 4), to_dev(t.indices, np * 4),
                          to_dev(t.last, batch * 4), batch};
    void *dq = to_dev(q, qn * 4), *dout = NULL;
    float *dlse = NULL;
    OK(kvk_dev_alloc(qn * 4, &dout));
    OK(kvk_dev_alloc(batch * qo * 4, (void **)&dlse));
    kvk_decode_args da = {dq, dout, dlse, qdt, qo, sm};
    OK(kvk_paged_decode_attention_cuda(&d.c, 1, &dpt, &da, ws, split ? ws_bytes : 0, NULL));
    OK(kvk_dev_sync());
    OK(kvk_dev_memcpy(gout, dout, qn * 4, KVK_D2H));
    OK(kvk_dev_memcpy(glse, dlse, batch * qo * 4, KVK_D2H));
    for (uint64_t i = 0; i < qn; i++) {
        double c = kvk_load_f32(qdt, out, i), g = kvk_load_f32(qdt, gout, i);
        if (fabs(c - g) > 2e-3 + 2 * tu_rel_tol(qdt) * fmax(1.0, fabs(c))) {
            fail_msg("page %u kv heads %u gqa %u dim %u kv %s split %d %s: out[%llu] gpu %g cpu %g",
                     page, kv_heads, gqa, dim, kv_dtype_name(kdt), split, kv_arrangement_name(arr),
                     (unsigned long long)i, g, c);
        }
    }
    for (uint32_t r = 0; r < batch * qo; r++) {
        if (isinf(lse[r])) {
            assert_true(isinf(glse[r]) && glse[r] < 0);
        } else if (fabsf(lse[r] - glse[r]) > 1e-3f * fmaxf(1.0f, fabsf(lse[r]))) {
            fail_msg("lse[%u] gpu %g cpu %g", r, glse[r], lse[r]);
        }
    }
    /* The merges run in a fixed order: a second run on the same inputs, into fresh buffers, is
     * bitwise equal to the first. */
    void *dout2 = NULL, *gout2 = malloc(qn * 4);
    float *dlse2 = NULL, *glse2 = malloc(batch * qo * 4);
    OK(kvk_dev_alloc(qn * 4, &dout2));
    OK(kvk_dev_alloc(batch * qo * 4, (void **)&dlse2));
    kvk_decode_args da2 = {dq, dout2, dlse2, qdt, qo, sm};
    OK(kvk_paged_decode_attention_cuda(&d.c, 1, &dpt, &da2, ws, split ? ws_bytes : 0, NULL));
    OK(kvk_dev_sync());
    OK(kvk_dev_memcpy(gout2, dout2, qn * 4, KVK_D2H));
    OK(kvk_dev_memcpy(glse2, dlse2, batch * qo * 4, KVK_D2H));
    assert_memory_equal(gout, gout2, qn * kvk_elem_bytes(qdt));
    assert_memory_equal(glse, glse2, batch * qo * 4);
    kvk_dev_free(dout2);
    kvk_dev_free(dlse2);
    free(gout2);
    free(glse2);
    kvk_dev_free((void *)dpt.indptr);
    kvk_dev_free((void *)dpt.indices);
    kvk_dev_free((void *)dpt.last_page_len);
    kvk_dev_free(dq);
    kvk_dev_free(dout);
    kvk_dev_free(dlse);
    kvk_dev_free(ws);
    kvk_dev_free(d.mem);
    free(q);
    free(out);
    free(gout);
    free(lse);
    free(glse);
    tu_pt_fini(&t);
    tu_seg_fini(&s);
}

static void check_decode_gpu(uint32_t page, uint32_t gqa, uint32_t dim, kv_dtype kdt, kv_dtype qdt,
                             int split) {
    check_decode_arr(page, 2, gqa, dim, kdt, qdt, split, split ? KV_BLOCK_MAJOR : KV_LAYER_MAJOR);
}

static void test_decode_gpu(void **state) {
    (void)state;
    if (!have_gpu()) {
        skip();
    }
    const uint32_t pages[] = {1, 16, 64};
    const uint32_t gqas[] = {1, 4, 8};
    const uint32_t dims[] = {64, 128, 256};
    const kv_dtype kdts[] = {KV_DTYPE_FP16, KV_DTYPE_BF16, KV_DTYPE_FP32, KV_DTYPE_FP8_E4M3,
                             KV_DTYPE_INT8};
    const kv_dtype qdts[] = {KV_DTYPE_FP16, KV_DTYPE_BF16, KV_DTYPE_FP32};
    int n = 0;
    for (int p = 0; p < 3; p++) {
        for (int g = 0; g < 3; g++) {
            for (int k = 0; k < 5; k++) {
                uint32_t dim = dims[(p + g + k) % 3];
                if (kdts[k] == KV_DTYPE_FP32 && dim == 256) {
                    dim = 128;
                }
                check_decode_gpu(pages[p], gqas[g], dim, kdts[k], qdts[n % 3], n % 2);
                n++;
            }
        }
    }
    /* GQA 16 runs as two head chunks of 8. */
    check_decode_gpu(16, 16, 128, KV_DTYPE_FP16, KV_DTYPE_FP16, 1);
    /* Split-K over layer-major caches, KV head counts other than 2, and the GQA groups that do
     * not fill a head chunk (2, 3 in the 4-row variant; 5, 6, 7 in the 8-row one). */
    const uint32_t heads[] = {1, 3, 8};
    const uint32_t groups[] = {2, 3, 5, 6, 7};
    for (int h = 0; h < 3; h++) {
        for (int g = 0; g < 5; g++) {
            check_decode_arr(16, heads[h], groups[g], 128, g % 2 ? KV_DTYPE_BF16 : KV_DTYPE_FP16,
                             KV_DTYPE_FP16, 1, KV_LAYER_MAJOR);
        }
    }
    check_decode_arr(64, 4, 4, 64, KV_DTYPE_INT8, KV_DTYPE_BF16, 1, KV_LAYER_MAJOR);
}

static void test_merge_states_gpu(void **state) {
    (void)state;
    if (!have_gpu()) {
        skip();
    }
    enum { S = 5, R = 300, D = 128 };
    static uint16_t v[S][R * D], out[R * D], gout[R * D];
    static float s[S][R], so[R], gso[R];
    const void *vp[S], *dvp[S];
    const float *sp[S], *dsp[S];
    for (int j = 0; j < S; j++) {
        tu_fill(KV_DTYPE_FP16, v[j], R * D, 1.0f);
        for (int r = 0; r < R; r++) {
            /* Some states empty per row, and every 13th row empty in all states. */
            s[j][r] = (r + j) % 11 == 0 || r % 13 == 0 ? -INFINITY : tu_randf() * 10.0f;
        }
        vp[j] = v[j];
        sp[j] = s[j];
        dvp[j] = to_dev(v[j], sizeof(v[j]));
        dsp[j] = to_dev(s[j], sizeof(s[j]));
    }
    OK(kvk_merge_states_cpu(KV_DTYPE_FP16, vp, sp, S, R, D, out, so));
    void *dout = NULL, *dso = NULL;
    OK(kvk_dev_alloc(sizeof(out), &dout));
    OK(kvk_dev_alloc(sizeof(so), &dso));
    OK(kvk_merge_states_cuda(KV_DTYPE_FP16, dvp, dsp, S, R, D, dout, dso, NULL));
    OK(kvk_dev_sync());
    OK(kvk_dev_memcpy(gout, dout, sizeof(out), KVK_D2H));
    OK(kvk_dev_memcpy(gso, dso, sizeof(so), KVK_D2H));
    for (int i = 0; i < R * D; i++) {
        float c = kvk_fp16_to_f32(out[i]), g = kvk_fp16_to_f32(gout[i]);
        assert_true(fabsf(c - g) <= 2e-3f + 2.0f / 1024 * fmaxf(1.0f, fabsf(c)));
    }
    for (int r = 0; r < R; r++) {
        if (r % 13 == 0) {
            assert_true(isinf(gso[r]) && gso[r] < 0); /* all empty: -inf, and out is 0 */
            for (int d = 0; d < D; d++) {
                assert_int_equal(gout[r * D + d] & 0x7fff, 0);
            }
            continue;
        }
        assert_true(fabsf(so[r] - gso[r]) <= 1e-3f * fmaxf(1.0f, fabsf(so[r])));
    }
    /* In place: out aliases v[0] and s_out aliases s[0] (the cascade merge of a shared prefix
     * into the first state); same results as into separate buffers. */
    OK(kvk_merge_states_cuda(KV_DTYPE_FP16, dvp, dsp, S, R, D, (void *)dvp[0], (float *)dsp[0],
                             NULL));
    OK(kvk_dev_sync());
    static uint16_t iout[R * D];
    static float iso[R];
    OK(kvk_dev_memcpy(iout, dvp[0], sizeof(iout), KVK_D2H));
    OK(kvk_dev_memcpy(iso, dsp[0], sizeof(iso), KVK_D2H));
    assert_memory_equal(iout, gout, sizeof(iout));
    for (int r = 0; r < R; r++) {
        assert_true((isinf(iso[r]) && isinf(gso[r])) || iso[r] == gso[r]);
    }
    for (int j = 0; j < S; j++) {
        kvk_dev_free((void *)dvp[j]);
        kvk_dev_free((void *)dsp[j]);
    }
    kvk_dev_free(dout);
    kvk_dev_free(dso);
}

static void test_quantize_gpu(void **state) {
    (void)state;
    if (!have_gpu()) {
        skip();
    }
    enum { N = 5, T = 16, H = 8, D = 128, E = N * T * H * D };
    static uint16_t src[E], back[E], gback[E];
    static uint8_t q[E], gq[E];
    static float sc[N * T * H], gsc[N * T * H];
    const kv_dtype narrows[] = {KV_DTYPE_INT8, KV_DTYPE_FP8_E4M3};
    const uint32_t toks[] = {1, T};
    tu_fill(KV_DTYPE_FP16, src, E, 5.0f);
    void *dsrc = to_dev(src, sizeof(src)), *dq = NULL, *dsc = NULL, *dback = NULL;
    OK(kvk_dev_alloc(sizeof(q), &dq));
    OK(kvk_dev_alloc(sizeof(sc), &dsc));
    OK(kvk_dev_alloc(sizeof(back), &dback));
    for (int nq = 0; nq < 2; nq++) {
        for (int t = 0; t < 2; t++) {
            uint64_t groups = (uint64_t)N * T / toks[t];
            size_t nsc = groups * H * sizeof(float);
            OK(kvk_quantize_blocks_cpu(KV_DTYPE_FP16, src, narrows[nq], q, sc, groups, toks[t], H,
                                       D));
            OK(kvk_dequantize_blocks_cpu(narrows[nq], q, sc, KV_DTYPE_FP16, back, groups, toks[t],
                                         H, D));
            OK(kvk_quantize_blocks_cuda(KV_DTYPE_FP16, dsrc, narrows[nq], dq, dsc, groups, toks[t],
                                        H, D, NULL));
            OK(kvk_dequantize_blocks_cuda(narrows[nq], dq, dsc, KV_DTYPE_FP16, dback, groups,
                                          toks[t], H, D, NULL));
            OK(kvk_dev_sync());
            OK(kvk_dev_memcpy(gq, dq, sizeof(q), KVK_D2H));
            OK(kvk_dev_memcpy(gsc, dsc, nsc, KVK_D2H));
            OK(kvk_dev_memcpy(gback, dback, sizeof(back), KVK_D2H));
            assert_memory_equal(sc, gsc, nsc);
            assert_memory_equal(q, gq, sizeof(q));
            assert_memory_equal(back, gback, sizeof(back));
        }
    }
    kvk_dev_free(dsrc);
    kvk_dev_free(dq);
    kvk_dev_free(dsc);
    kvk_dev_free(dback);
}

/* Zipage's compaction: byte for byte the twin's output (mixed scales requantize alike). */
static void test_compact_tokens_gpu(void **state) {
    (void)state;
    if (!have_gpu()) {
        skip();
    }
    const kv_dtype dts[] = {KV_DTYPE_FP16, KV_DTYPE_BF16, KV_DTYPE_FP32, KV_DTYPE_INT8,
                            KV_DTYPE_FP8_E4M3};
    for (int i = 0; i < 5; i++) {
        tu_seg s;
        tu_seg_init(&s, 3, 2, 64, 16, dts[i], i % 2 ? KV_BLOCK_MAJOR : KV_LAYER_MAJOR, 10);
        dev_seg d;
        dev_seg_init(&d, &s);
        int64_t slots[40];
        for (int t = 0; t < 40; t++) {
            slots[t] = (int64_t)(t * 2 + (t % 3)); /* blocks 0..5, skipping tokens */
        }
        const int32_t dst[] = {9, 7, 8};
        int64_t *dsl = to_dev(slots, sizeof(slots));
        int32_t *dd = to_dev(dst, sizeof(dst));
        OK(kvk_compact_tokens_cpu(&s.c, &s.c, slots, 40, dst));
        OK(kvk_compact_tokens_cuda(&d.c, &d.c, dsl, 40, dd, NULL));
        OK(kvk_dev_sync());
        dev_seg_check_equal(&d, &s);
        kvk_dev_free(dsl);
        kvk_dev_free(dd);
        kvk_dev_free(d.mem);
        tu_seg_fini(&s);
    }
}

/* Token scores: within 1e-5 + 1e-3 relative of the twin, and bitwise-equal on a second run. */
static void test_token_scores_gpu(void **state) {
    (void)state;
    if (!have_gpu()) {
        skip();
    }
    const kv_dtype dts[] = {KV_DTYPE_FP16, KV_DTYPE_INT8};
    for (int i = 0; i < 2; i++) {
        for (int causal = 0; causal < 2; causal++) {
            tu_seg s;
            tu_seg_init(&s, 2, 2, 64, 16, dts[i], KV_LAYER_MAJOR, 12);
            dev_seg d;
            dev_seg_init(&d, &s);
            const uint32_t n = 150, nq = 16, qh = 8;
            int32_t pages[10] = {3, 1, 11, 0, 5, 6, 2, 9, 8, 10};
            float *q = malloc(sizeof(float) * nq * qh * 64);
            for (uint32_t k = 0; k < nq * qh * 64; k++) {
                q[k] = tu_randf();
            }
            kvk_score_args a = {.q = q,
                                .q_dtype = KV_DTYPE_FP32,
                                .nq = nq,
                                .num_qo_heads = qh,
                                .sm_scale = 0.125f,
                                .causal = causal};
            float cpu[150] = {0}, gpu[150], gpu2[150];
            OK(kvk_token_scores_cpu(&s.c, 1, pages, n, &a, cpu));
            size_t wsb = kvk_token_scores_workspace_bytes(nq, qh);
            void *ws = NULL;
            OK(kvk_dev_alloc(wsb, &ws));
            float zero[150] = {0};
            int32_t *dp = to_dev(pages, sizeof(pages));
            float *dsc = to_dev(zero, sizeof(zero));
            kvk_score_args da = a;
            da.q = to_dev(q, sizeof(float) * nq * qh * 64);
            OK(kvk_token_scores_cuda(&d.c, 1, dp, n, &da, dsc, ws, wsb, NULL));
            OK(kvk_dev_memcpy(gpu, dsc, sizeof(gpu), KVK_D2H));
            OK(kvk_dev_memcpy(dsc, zero, sizeof(zero), KVK_H2D));
            OK(kvk_token_scores_cuda(&d.c, 1, dp, n, &da, dsc, ws, wsb, NULL));
            OK(kvk_dev_memcpy(gpu2, dsc, sizeof(gpu2), KVK_D2H));
            for (uint32_t t = 0; t < n; t++) {
                assert_true(fabsf(gpu[t] - cpu[t]) <= 1e-5f + 1e-3f * cpu[t]);
            }
            assert_memory_equal(gpu, gpu2, sizeof(gpu));
            kvk_dev_free((void *)da.q);
            kvk_dev_free(dp);
            kvk_dev_free(dsc);
            kvk_dev_free(ws);
            kvk_dev_free(d.mem);
            free(q);
            tu_seg_fini(&s);
        }
    }
}

/* IceCache: summaries byte for byte, and selection equal to the twin (same bounds, same pages). */
static void test_ice_gpu(void **state) {
    (void)state;
    if (!have_gpu()) {
        skip();
    }
    const kv_dtype dts[] = {KV_DTYPE_FP16, KV_DTYPE_INT8};
    for (int i = 0; i < 2; i++) {
        const uint32_t L = 3, H = 2, D = 64, NB = 300, QH = 8, K = 16;
        tu_seg s;
        tu_seg_init(&s, L, H, D, 16, dts[i], KV_LAYER_MAJOR, NB);
        dev_seg d;
        dev_seg_init(&d, &s);
        int32_t *blocks = malloc(NB * sizeof(int32_t));
        for (uint32_t b = 0; b < NB; b++) {
            blocks[b] = (int32_t)((b * 7) % NB);
        }
        size_t sb = NB * KVK_SUMMARY_FLOATS(L, H, D) * sizeof(float);
        float *cpu = malloc(sb), *gpu = malloc(sb);
        OK(kvk_page_summaries_cpu(&s.c, blocks, NULL, NB, cpu));
        int32_t *db = to_dev(blocks, NB * sizeof(int32_t));
        float *ds = NULL;
        OK(kvk_dev_alloc(sb, (void **)&ds));
        OK(kvk_page_summaries_cuda(&d.c, db, NULL, NB, ds, NULL));
        OK(kvk_dev_memcpy(gpu, ds, sb, KVK_D2H));
        assert_memory_equal(gpu, cpu, sb);
        float q[8 * 64];
        for (uint32_t k = 0; k < QH * D; k++) {
            q[k] = tu_randf();
        }
        float *dq = to_dev(q, sizeof(q));
        kvk_select_args a = {.summaries = cpu,
                             .npages = NB,
                             .num_layers = L,
                             .layer = 2,
                             .num_kv_heads = H,
                             .head_dim = D,
                             .q = q,
                             .num_qo_heads = QH,
                             .k = K};
        int32_t sel_c[2 * 16], sel_g[2 * 16];
        float sc_c[2 * 300], sc_g[2 * 300];
        int32_t *dsel = NULL;
        float *dsc = NULL;
        OK(kvk_dev_alloc(sizeof(sel_g), (void **)&dsel));
        OK(kvk_dev_alloc(sizeof(sc_g), (void **)&dsc));
        for (int mode = KVK_SELECT_BOUND; mode <= KVK_SELECT_CENTROID; mode++) {
            a.mode = mode;
            OK(kvk_page_select_cpu(&a, sel_c, sc_c));
            kvk_select_args ga = a;
            ga.summaries = ds;
            ga.q = dq;
            OK(kvk_page_select_cuda(&ga, dsel, dsc, NULL));
            OK(kvk_dev_memcpy(sel_g, dsel, sizeof(sel_g), KVK_D2H));
            OK(kvk_dev_memcpy(sc_g, dsc, sizeof(sc_g), KVK_D2H));
            assert_memory_equal(sel_g, sel_c, sizeof(sel_c));
            assert_memory_equal(sc_g, sc_c, sizeof(sc_c));
        }
        kvk_dev_free(db), kvk_dev_free(ds), kvk_dev_free(dq), kvk_dev_free(dsel);
        kvk_dev_free(dsc), kvk_dev_free(d.mem);
        free(blocks), free(cpu), free(gpu);
        tu_seg_fini(&s);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_copy_blocks_gpu),  cmocka_unit_test(test_reshape_and_cache_gpu),
        cmocka_unit_test(test_decode_gpu),       cmocka_unit_test(test_merge_states_gpu),
        cmocka_unit_test(test_quantize_gpu),     cmocka_unit_test(test_compact_tokens_gpu),
        cmocka_unit_test(test_token_scores_gpu), cmocka_unit_test(test_ice_gpu),
    };
    return cmocka_run_group_tests_name("kvk_cuda", tests, NULL, NULL);
}
