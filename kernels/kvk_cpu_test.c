/* Tests of the CPU twins: cache descriptors agree with common/kv_layout's offsets; copy_blocks
 * converts between arrangements; reshape_and_cache writes exactly the slots asked; decode
 * attention matches naive dense attention (double precision) for page sizes 1, 16, 64, GQA
 * ratios 1, 4, 8, ragged batches and every cache dtype; merge_states of partial attentions equals
 * attention over the union; quantize/dequantize stay within half a quantization step.
 *
 * Tolerances (decode attention): |out - ref| <= 1e-4 + u(qo) * max(1, |ref|) where u is the
 * output dtype's unit roundoff (fp16 2^-10, bf16 2^-7, fp32 1e-5), and
 * |lse - ref| <= 1e-4 * max(1, |ref|); the reference runs over the values the cache holds, so
 * these bound float32 accumulation and output rounding only.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>

#include <cmocka.h>

#include "kernels/kvk_testutil.h"

static void test_cache_matches_layout(void **state) {
    (void)state;
    const kv_dtype dts[] = {KV_DTYPE_FP16, KV_DTYPE_INT8};
    const kv_arrangement arrs[] = {KV_LAYER_MAJOR, KV_BLOCK_MAJOR};
    for (int a = 0; a < 2; a++) {
        for (int d = 0; d < 2; d++) {
            kv_layout l;
            assert_int_equal(kv_layout_init(3, 4, 32, 16, dts[d], arrs[a], &l), KV_OK);
            kvk_cache c;
            const uintptr_t base = 0x100000;
            assert_int_equal(kvk_cache_from_segment(&l, base, 5, &c), KV_OK);
            assert_int_equal(c.num_sections, 6);
            for (uint32_t b = 0; b < 5; b++) {
                for (uint32_t layer = 0; layer < 3; layer++) {
                    for (int kv = 0; kv < 2; kv++) {
                        uint32_t s = layer * 2 + (uint32_t)kv;
                        uint32_t tok = (b * 7 + layer) % 16, h = (b + (uint32_t)kv) % 4;
                        uintptr_t got = c.data +
                                        (uintptr_t)(b * c.block_stride + s * c.section_stride) +
                                        ((uintptr_t)tok * 4 + h) * 32 * l.elem_bytes;
                        assert_int_equal(got, base + kv_layout_offset(&l, 5, b, layer, kv, tok, h));
                        if (l.scale_bytes != 0) {
                            uintptr_t sg =
                                c.scales +
                                (uintptr_t)(b * c.scale_block_stride + s * c.scale_section_stride) +
                                h * 4;
                            assert_int_equal(sg,
                                             base + kv_layout_scale_offset(&l, 5, b, layer, kv, h));
                        }
                    }
                }
            }
        }
    }
    kv_layout bad = {0};
    kvk_cache c;
    assert_int_equal(kvk_cache_from_segment(&bad, 0x1000, 1, &c), KV_EINVAL);
}

static void test_copy_blocks_converts(void **state) {
    (void)state;
    const kv_dtype dts[] = {KV_DTYPE_BF16, KV_DTYPE_FP8_E4M3};
    for (int d = 0; d < 2; d++) {
        tu_seg lm, bm, back;
        tu_seg_init(&lm, 2, 2, 16, 4, dts[d], KV_LAYER_MAJOR, 8);
        tu_seg_init(&bm, 2, 2, 16, 4, dts[d], KV_BLOCK_MAJOR, 6);
        tu_seg_init(&back, 2, 2, 16, 4, dts[d], KV_LAYER_MAJOR, 8);
        const int32_t src[] = {7, 0, 3, 5};
        const int32_t dst[] = {0, 5, 2, 1};
        assert_int_equal(kvk_copy_blocks_cpu(&lm.c, &bm.c, src, dst, 4), KV_OK);
        for (int i = 0; i < 4; i++) {
            for (uint32_t s = 0; s < 4; s++) {
                for (uint32_t t = 0; t < 4; t++) {
                    for (uint32_t h = 0; h < 2; h++) {
                        for (uint32_t e = 0; e < 16; e++) {
                            assert_true(tu_cache_elem(&lm.c, (uint32_t)src[i], s, t, h, e) ==
                                        tu_cache_elem(&bm.c, (uint32_t)dst[i], s, t, h, e));
                        }
                    }
                }
            }
        }
        /* And back into a second layer-major segment: byte-identical blocks. */
        assert_int_equal(kvk_copy_blocks_cpu(&bm.c, &back.c, dst, src, 4), KV_OK);
        for (int i = 0; i < 4; i++) {
            for (uint32_t layer = 0; layer < 2; layer++) {
                for (int kv = 0; kv < 2; kv++) {
                    uint64_t o = kv_layout_offset(&lm.l, 8, (uint32_t)src[i], layer, kv, 0, 0);
                    assert_memory_equal(lm.mem + o, back.mem + o, lm.l.kv_block_bytes);
                    if (lm.l.scale_bytes != 0) {
                        o = kv_layout_scale_offset(&lm.l, 8, (uint32_t)src[i], layer, kv, 0);
                        assert_memory_equal(lm.mem + o, back.mem + o, 2 * sizeof(float));
                    }
                }
            }
        }
        /* A bad id copies nothing; a shape mismatch is refused. */
        uint64_t bytes = kv_layout_segment_bytes(&bm.l, 6);
        uint8_t *snap = malloc(bytes);
        memcpy(snap, bm.mem, bytes);
        const int32_t bad_dst[] = {1, 6};
        const int32_t src2[] = {2, 4};
        assert_int_equal(kvk_copy_blocks_cpu(&lm.c, &bm.c, src2, bad_dst, 2), KV_EINVAL);
        assert_memory_equal(snap, bm.mem, bytes);
        kvk_cache other = bm.c;
        other.head_dim = 8;
        assert_int_equal(kvk_copy_blocks_cpu(&lm.c, &other, src2, src2, 2), KV_EINVAL);
        free(snap);
        tu_seg_fini(&lm);
        tu_seg_fini(&bm);
        tu_seg_fini(&back);
    }
}

/* A copy larger than the streaming threshold (4 MiB) takes the non-temporal store path: the
 * blocks must still arrive byte for byte, also into a destination that is not 16-byte aligned
 * (head and tail of each chunk through memcpy), and the blocks not named stay untouched. */
static void test_copy_blocks_streams_large(void **state) {
    (void)state;
    for (int misalign = 0; misalign < 2; misalign++) {
        tu_seg src;
        tu_seg_init(&src, 2, 4, 72, 16, KV_DTYPE_FP16, KV_LAYER_MAJOR, 600); /* 9 KiB chunks */
        const kv_layout *l = &src.l;
        uint64_t bytes = kv_layout_segment_bytes(l, 600);
        uint8_t *raw = malloc(bytes + 64);
        assert_non_null(raw);
        memset(raw, 0xA5, bytes + 64);
        uint8_t *dmem = raw + 16 + (misalign ? 8 : 0);
        kvk_cache dst;
        assert_int_equal(kvk_cache_from_segment(l, (uintptr_t)dmem, 600, &dst), KV_OK);
        int32_t ids[590];
        for (int i = 0; i < 590; i++) {
            ids[i] = (i * 7) % 590; /* a permutation of 0..589: blocks 590..599 not copied */
        }
        assert_true((uint64_t)590 * 4 * l->kv_block_bytes >= (4u << 20));
        assert_int_equal(kvk_copy_blocks_cpu(&src.c, &dst, ids, ids, 590), KV_OK);
        for (uint32_t b = 0; b < 600; b++) {
            for (uint32_t layer = 0; layer < 2; layer++) {
                for (int kv = 0; kv < 2; kv++) {
                    uint64_t o = kv_layout_offset(l, 600, b, layer, kv, 0, 0);
                    if (b < 590) {
                        assert_memory_equal(src.mem + o, dmem + o, l->kv_block_bytes);
                    } else {
                        for (uint64_t e = 0; e < l->kv_block_bytes; e++) {
                            assert_int_equal(dmem[o + e], 0xA5);
                        }
                    }
                }
            }
        }
        free(raw);
        tu_seg_fini(&src);
    }
}

static void test_reshape_and_cache(void **state) {
    (void)state;
    const kv_dtype dts[] = {KV_DTYPE_FP16, KV_DTYPE_BF16, KV_DTYPE_FP32, KV_DTYPE_FP8_E4M3,
                            KV_DTYPE_INT8};
    for (int d = 0; d < 5; d++) {
        for (int arr = KV_LAYER_MAJOR; arr <= KV_BLOCK_MAJOR; arr++) {
            tu_seg s;
            tu_seg_init(&s, 2, 3, 8, 4, dts[d], (kv_arrangement)arr, 5);
            enum { N = 7 };
            float k[N][3][8], v[N][3][8];
            tu_fill(KV_DTYPE_FP32, k, sizeof(k) / 4, 2.0f);
            tu_fill(KV_DTYPE_FP32, v, sizeof(v) / 4, 2.0f);
            const float ks[3] = {0.02f, 0.01f, 0.005f}, vs[3] = {0.03f, 0.02f, 0.01f};
            const int64_t slots[N] = {0, 5, -1, 19, 7, 12, 3};
            kvk_tokens t = {k, v, sizeof(k[0]), KV_DTYPE_FP32, ks, vs};
            uint64_t bytes = kv_layout_segment_bytes(&s.l, 5);
            uint8_t *before = malloc(bytes);
            memcpy(before, s.mem, bytes);
            assert_int_equal(kvk_reshape_and_cache_cpu(&s.c, 1, &t, slots, N), KV_OK);
            int scaled = dts[d] == KV_DTYPE_FP8_E4M3 || dts[d] == KV_DTYPE_INT8;
            for (int i = 0; i < N; i++) {
                if (slots[i] < 0) {
                    continue;
                }
                uint32_t b = (uint32_t)slots[i] / 4, off = (uint32_t)slots[i] % 4;
                for (int kv = 0; kv < 2; kv++) {
                    for (uint32_t h = 0; h < 3; h++) {
                        float sc = kv == 0 ? ks[h] : vs[h];
                        for (uint32_t e = 0; e < 8; e++) {
                            float x = kv == 0 ? k[i][h][e] : v[i][h][e];
                            uint8_t want[4];
                            kvk_store_f32(dts[d], want, 0, scaled ? x / sc : x);
                            uint64_t o =
                                kv_layout_offset(&s.l, 5, b, 1, kv, off, h) + e * s.l.elem_bytes;
                            assert_memory_equal(s.mem + o, want, s.l.elem_bytes);
                            memcpy(before + o, want, s.l.elem_bytes);
                        }
                        if (scaled) {
                            uint64_t o = kv_layout_scale_offset(&s.l, 5, b, 1, kv, h);
                            float got;
                            memcpy(&got, s.mem + o, 4);
                            assert_true(got == sc);
                            memcpy(before + o, &sc, 4);
                        }
                    }
                }
            }
            /* Nothing else changed. */
            assert_memory_equal(before, s.mem, bytes);
            const int64_t bad[1] = {20};
            assert_int_equal(kvk_reshape_and_cache_cpu(&s.c, 1, &t, bad, 1), KV_EINVAL);
            assert_int_equal(kvk_reshape_and_cache_cpu(&s.c, 2, &t, slots, N), KV_EINVAL);
            assert_memory_equal(before, s.mem, bytes);
            free(before);
            tu_seg_fini(&s);
        }
    }
}

/* Runs the twin and the oracle for one configuration and checks the stated tolerances. */
static void check_decode(uint32_t page_size, uint32_t gqa, kv_dtype kdt, kv_dtype qdt,
                         kv_arrangement arr) {
    const uint32_t kv_heads = 2, dim = 32, qo_heads = kv_heads * gqa;
    const uint32_t lens[] = {1, 17, 0, 64, 130, 5};
    const uint32_t batch = 6;
    uint32_t pages = 0;
    for (uint32_t i = 0; i < batch; i++) {
        pages += (lens[i] + page_size - 1) / page_size;
    }
    tu_seg s;
    tu_seg_init(&s, 2, kv_heads, dim, page_size, kdt, arr, pages + 3);
    tu_pt t;
    assert_int_equal(tu_pt_init(&t, lens, batch, page_size, pages + 3), 0);
    uint64_t qn = (uint64_t)batch * qo_heads * dim;
    void *q = malloc(qn * 4);
    void *out = malloc(qn * 4);
    float *lse = malloc(batch * qo_heads * sizeof(float));
    double *ref = malloc(qn * sizeof(double));
    double *ref_lse = malloc(batch * qo_heads * sizeof(double));
    tu_fill(qdt, q, qn, 1.0f);
    float sm_scale = 1.0f / sqrtf((float)dim);
    kvk_decode_args a = {q, out, lse, qdt, qo_heads, sm_scale};
    assert_int_equal(kvk_paged_decode_attention_cpu(&s.c, 1, &t.pt, &a), KV_OK);
    tu_naive_attention(&s.c, 1, &t, q, qdt, qo_heads, sm_scale, ref, ref_lse);
    for (uint64_t i = 0; i < qn; i++) {
        double got = kvk_load_f32(qdt, out, i);
        double tol = 1e-4 + tu_rel_tol(qdt) * fmax(1.0, fabs(ref[i]));
        if (fabs(got - ref[i]) > tol) {
            fail_msg("page %u gqa %u kv %s qo %s: out[%llu] = %g, naive %g", page_size, gqa,
                     kv_dtype_name(kdt), kv_dtype_name(qdt), (unsigned long long)i, got, ref[i]);
        }
    }
    for (uint32_t r = 0; r < batch * qo_heads; r++) {
        if (isinf(ref_lse[r])) {
            assert_true(isinf(lse[r]) && lse[r] < 0);
            continue;
        }
        assert_true(fabs(lse[r] - ref_lse[r]) <= 1e-4 * fmax(1.0, fabs(ref_lse[r])));
    }
    free(q);
    free(out);
    free(lse);
    free(ref);
    free(ref_lse);
    tu_pt_fini(&t);
    tu_seg_fini(&s);
}

static void test_decode_matches_naive(void **state) {
    (void)state;
    const uint32_t pages[] = {1, 16, 64};
    const uint32_t gqas[] = {1, 4, 8};
    const kv_dtype kdts[] = {KV_DTYPE_FP16, KV_DTYPE_BF16, KV_DTYPE_FP32, KV_DTYPE_FP8_E4M3,
                             KV_DTYPE_INT8};
    const kv_dtype qdts[] = {KV_DTYPE_FP16, KV_DTYPE_BF16, KV_DTYPE_FP32};
    int n = 0;
    for (int p = 0; p < 3; p++) {
        for (int g = 0; g < 3; g++) {
            for (int k = 0; k < 5; k++) {
                check_decode(pages[p], gqas[g], kdts[k], qdts[n % 3],
                             n % 2 ? KV_BLOCK_MAJOR : KV_LAYER_MAJOR);
                n++;
            }
        }
    }
}

static void test_decode_rejects_bad_tables(void **state) {
    (void)state;
    tu_seg s;
    tu_seg_init(&s, 1, 2, 16, 4, KV_DTYPE_FP16, KV_LAYER_MAJOR, 4);
    int32_t indptr[3] = {0, 2, 3}, indices[3] = {0, 1, 2}, last[2] = {4, 1};
    uint16_t q[2 * 4 * 16] = {0}, out[2 * 4 * 16];
    kvk_page_table pt = {indptr, indices, last, 2};
    kvk_decode_args a = {q, out, NULL, KV_DTYPE_FP16, 4, 0.25f};
    assert_int_equal(kvk_paged_decode_attention_cpu(&s.c, 0, &pt, &a), KV_OK);
    last[1] = 5; /* longer than a page */
    assert_int_equal(kvk_paged_decode_attention_cpu(&s.c, 0, &pt, &a), KV_EINVAL);
    last[1] = 1;
    indices[2] = 4; /* beyond the cache */
    assert_int_equal(kvk_paged_decode_attention_cpu(&s.c, 0, &pt, &a), KV_EINVAL);
    indices[2] = 2;
    indptr[1] = 4; /* decreasing */
    assert_int_equal(kvk_paged_decode_attention_cpu(&s.c, 0, &pt, &a), KV_EINVAL);
    indptr[1] = 2;
    a.num_qo_heads = 3; /* not a multiple of 2 kv heads */
    assert_int_equal(kvk_paged_decode_attention_cpu(&s.c, 0, &pt, &a), KV_EINVAL);
    assert_non_null(strstr(kvk_last_error(), "kv heads"));
    a.num_qo_heads = 4;
    assert_int_equal(kvk_paged_decode_attention_cpu(&s.c, 1, &pt, &a), KV_EINVAL); /* layer */
    tu_seg_fini(&s);
}

/* Attention over a request's pages split in three parts, merged, equals attention over all. */
static void test_merge_states_cascade(void **state) {
    (void)state;
    const uint32_t kv_heads = 2, dim = 16, qo = 8, ps = 4;
    const uint32_t lens[] = {37, 9};
    tu_seg s;
    tu_seg_init(&s, 1, kv_heads, dim, ps, KV_DTYPE_FP16, KV_LAYER_MAJOR, 20);
    tu_pt full;
    assert_int_equal(tu_pt_init(&full, lens, 2, ps, 20), 0);
    float q[2 * 8 * 16];
    tu_fill(KV_DTYPE_FP32, q, 2 * qo * dim, 1.0f);
    float out_full[2 * 8 * 16], lse_full[16];
    kvk_decode_args a = {q, out_full, lse_full, KV_DTYPE_FP32, qo, 0.25f};
    assert_int_equal(kvk_paged_decode_attention_cpu(&s.c, 0, &full.pt, &a), KV_OK);
    /* Parts: request 0 pages [0,3) [3,7) [7,10); request 1 pages [0,1) [1,3) and nothing. */
    const int32_t cut[2][4] = {{0, 3, 7, 10}, {0, 1, 3, 3}};
    float parts[3][2 * 8 * 16], plse[3][16];
    for (int j = 0; j < 3; j++) {
        int32_t indptr[3], idx[16], last[2];
        int32_t k = 0;
        indptr[0] = 0;
        for (int i = 0; i < 2; i++) {
            for (int32_t p = cut[i][j]; p < cut[i][j + 1]; p++) {
                idx[k++] = full.indices[full.indptr[i] + p];
            }
            indptr[i + 1] = k;
            int32_t np = full.indptr[i + 1] - full.indptr[i];
            last[i] = cut[i][j + 1] == np ? full.last[i] : (int32_t)ps;
        }
        kvk_page_table pt = {indptr, idx, last, 2};
        kvk_decode_args pa = {q, parts[j], plse[j], KV_DTYPE_FP32, qo, 0.25f};
        assert_int_equal(kvk_paged_decode_attention_cpu(&s.c, 0, &pt, &pa), KV_OK);
    }
    const void *vs[3] = {parts[0], parts[1], parts[2]};
    const float *ss[3] = {plse[0], plse[1], plse[2]};
    float merged_lse[16];
    /* out aliases v[0]: allowed. */
    assert_int_equal(kvk_merge_states_cpu(KV_DTYPE_FP32, vs, ss, 3, 16, dim, parts[0], merged_lse),
                     KV_OK);
    for (int i = 0; i < 2 * 8 * 16; i++) {
        assert_true(fabsf(parts[0][i] - out_full[i]) <= 1e-5f);
    }
    for (int r = 0; r < 16; r++) {
        assert_true(fabsf(merged_lse[r] - lse_full[r]) <= 1e-5f * fmaxf(1.0f, fabsf(lse_full[r])));
    }
    /* All states empty: zeros and -inf. */
    float e1[16] = {0}, e2[16] = {0}, sinf[1] = {-INFINITY}, o[16], so[1];
    const void *ev[2] = {e1, e2};
    const float *es[2] = {sinf, sinf};
    assert_int_equal(kvk_merge_states_cpu(KV_DTYPE_FP32, ev, es, 2, 1, 16, o, so), KV_OK);
    assert_true(o[3] == 0.0f && isinf(so[0]) && so[0] < 0);
    assert_int_equal(kvk_merge_states_cpu(KV_DTYPE_INT8, ev, es, 2, 1, 16, o, so), KV_EINVAL);
    assert_int_equal(kvk_merge_states_cpu(KV_DTYPE_FP32, ev, es, 0, 1, 16, o, so), KV_EINVAL);
    tu_pt_fini(&full);
    tu_seg_fini(&s);
}

static void test_quantize_roundtrip(void **state) {
    (void)state;
    enum { N = 3, T = 16, H = 4, D = 32 };
    const uint32_t group_tokens[] = {1, T};
    const kv_dtype wides[] = {KV_DTYPE_FP16, KV_DTYPE_BF16};
    const kv_dtype narrows[] = {KV_DTYPE_INT8, KV_DTYPE_FP8_E4M3};
    static uint16_t src[N * T * H * D], back[N * T * H * D];
    static uint8_t q[N * T * H * D];
    static float scales[N * T * H];
    for (int w = 0; w < 2; w++) {
        tu_fill(wides[w], src, N * T * H * D, 3.0f);
        for (int nq = 0; nq < 2; nq++) {
            for (int gt = 0; gt < 2; gt++) {
                uint32_t tokens = group_tokens[gt];
                uint64_t groups = (uint64_t)N * T / tokens;
                assert_int_equal(kvk_quantize_blocks_cpu(wides[w], src, narrows[nq], q, scales,
                                                         groups, tokens, H, D),
                                 KV_OK);
                assert_int_equal(kvk_dequantize_blocks_cpu(narrows[nq], q, scales, wides[w], back,
                                                           groups, tokens, H, D),
                                 KV_OK);
                float qmax = narrows[nq] == KV_DTYPE_INT8 ? 127.0f : 448.0f;
                for (uint64_t g = 0; g < groups; g++) {
                    for (uint32_t h = 0; h < H; h++) {
                        float absmax = 0;
                        for (uint32_t t = 0; t < tokens; t++) {
                            for (uint32_t d = 0; d < D; d++) {
                                uint64_t e = ((g * tokens + t) * H + h) * D + d;
                                absmax = fmaxf(absmax, fabsf(kvk_load_f32(wides[w], src, e)));
                            }
                        }
                        float sc = scales[g * H + h];
                        assert_true(sc == absmax / qmax);
                        for (uint32_t t = 0; t < tokens; t++) {
                            for (uint32_t d = 0; d < D; d++) {
                                uint64_t e = ((g * tokens + t) * H + h) * D + d;
                                float x = kvk_load_f32(wides[w], src, e);
                                float y = kvk_load_f32(wides[w], back, e);
                                /* int8: half a step; fp8: half an ulp of 3 mantissa bits, or half
                                 * the subnormal step; plus the wide dtype's own rounding. */
                                float bound = narrows[nq] == KV_DTYPE_INT8
                                                  ? 0.5f * sc
                                                  : fmaxf(fabsf(x) / 16.0f, sc / 1024.0f);
                                bound += fabsf(x) * (float)tu_rel_tol(wides[w]) + 1e-7f;
                                if (fabsf(x - y) > bound) {
                                    fail_msg("%s->%s tokens %u: %g came back %g (scale %g)",
                                             kv_dtype_name(wides[w]), kv_dtype_name(narrows[nq]),
                                             tokens, x, y, sc);
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    assert_int_equal(
        kvk_quantize_blocks_cpu(KV_DTYPE_INT8, src, KV_DTYPE_FP16, q, scales, 1, 1, 1, 1),
        KV_EINVAL);
    assert_int_equal(
        kvk_quantize_blocks_cpu(KV_DTYPE_FP16, src, KV_DTYPE_INT8, q, scales, 1, 0, 1, 1),
        KV_EINVAL);
    /* All-zero group: scale 1, codes 0. */
    uint16_t z[8] = {0};
    assert_int_equal(
        kvk_quantize_blocks_cpu(KV_DTYPE_FP16, z, KV_DTYPE_INT8, q, scales, 1, 1, 1, 8), KV_OK);
    assert_true(scales[0] == 1.0f && q[0] == 0 && q[7] == 0);
}

/* Here (no GPU, or built without CUDA) every launcher answers KV_ENOGPU and says why. */
static void test_cuda_launchers_without_gpu(void **state) {
    (void)state;
    char why[128];
    if (kvk_gpu_probe(why, sizeof(why)) > 0) {
        skip(); /* a GPU machine: kvk_cuda_test covers the launchers */
    }
    tu_seg s;
    tu_seg_init(&s, 1, 1, 16, 4, KV_DTYPE_FP16, KV_LAYER_MAJOR, 2);
    int32_t ids[1] = {0};
    kv_err rc = kvk_copy_blocks_cuda(&s.c, &s.c, ids, ids, 1, NULL);
    assert_int_equal(rc, KV_ENOGPU);
    assert_true(strlen(kvk_last_error()) > 0);
    if (!kvk_built_with_cuda()) {
        assert_non_null(strstr(kvk_last_error(), "built without CUDA"));
    }
    void *p = NULL;
    assert_int_equal(kvk_dev_alloc(64, &p), KV_ENOGPU);
    assert_null(p);
    float o[16] = {0}, sl[1] = {0};
    const void *v[1] = {o};
    const float *sv[1] = {sl};
    assert_int_equal(kvk_merge_states_cuda(KV_DTYPE_FP32, v, sv, 1, 1, 16, o, NULL, NULL),
                     KV_ENOGPU);
    tu_seg_fini(&s);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cache_matches_layout),
        cmocka_unit_test(test_copy_blocks_converts),
        cmocka_unit_test(test_copy_blocks_streams_large),
        cmocka_unit_test(test_reshape_and_cache),
        cmocka_unit_test(test_decode_matches_naive),
        cmocka_unit_test(test_decode_rejects_bad_tables),
        cmocka_unit_test(test_merge_states_cascade),
        cmocka_unit_test(test_quantize_roundtrip),
        cmocka_unit_test(test_cuda_launchers_without_gpu),
    };
    return cmocka_run_group_tests_name("kvk_cpu", tests, NULL, NULL);
}
