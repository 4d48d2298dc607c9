/* Tests of the vector CPU kernels against the scalar twins they replace (kvk__*_ref), for every
 * instruction set this CPU has (AVX2, AVX-512) and 1 and 2 threads:
 *  - element conversions: every fp16/bf16 code, every 8-bit code, and 2^20 random float bit
 *    patterns plus the special values, bitwise against kvk_dtype.h;
 *  - reshape_and_cache, quantize_blocks, dequantize_blocks: byte-exact, NaN, infinities,
 *    subnormals, ties and saturating values included, with head_dims that leave vector tails;
 *  - decode and prefill attention (causal or not): page sizes 1/16/64, GQA 1/4/8, every cache
 *    dtype, fp16/bf16/fp32 queries, ragged batches with empty requests and lengths that are not a
 *    multiple of the 8-token tile, head_dim 32/40/128, both arrangements; outputs are bitwise the
 *    same for 1 and 2 threads, and the scalar fallback (KVK_SIMD=scalar) is the twin itself.
 *
 * Attention tolerance against the twin (float sums in another order; output rounding may land on
 * the neighbouring code): |simd - twin| <= 1e-5 + u * max(1, |twin|) with u the output dtype's
 * unit (fp16 2^-10, bf16 2^-7, fp32 1e-5), and |lse - twin| <= 1e-5 * max(1, |twin|).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <pthread.h>
#include <unistd.h>

#include <cmocka.h>

#include "kernels/kvk_internal.h"
#include "kernels/kvk_testutil.h"

static const kv_dtype all_dts[] = {KV_DTYPE_FP16, KV_DTYPE_BF16, KV_DTYPE_FP32, KV_DTYPE_FP8_E4M3,
                                   KV_DTYPE_INT8};
static const kv_dtype wide_dts[] = {KV_DTYPE_FP16, KV_DTYPE_BF16, KV_DTYPE_FP32};

static int best_level;
static const char *self_path;

/* The vector levels to test: AVX2 and, where present, AVX-512. */
static int levels(int *out) {
    int n = 0;
    for (int l = KVK__SIMD_AVX2; l <= best_level; l++) {
        out[n++] = l;
    }
    return n;
}

static const kvk__simd_ops *ops_of(int level) {
    return level == KVK__SIMD_AVX512 ? &kvk__simd_avx512 : &kvk__simd_avx2;
}

/* Floats that exercise every rounding branch: NaN, infinities, the fp16/fp8 thresholds, ties. */
static float special(uint32_t i) {
    static const uint32_t bits[] = {
        0x7fc00000u, 0xffc00001u, 0x7f800001u, 0x7f800000u, 0xff800000u, 0x00000000u, 0x80000000u,
        0x00000001u, 0x807fffffu, 0x477ff000u, 0x477fefffu, 0x38800000u, 0x387fffffu, 0x33800000u,
        0x33000000u, 0x43e00000u, 0x43dfffffu, 0x3c800000u, 0x3c7fffffu, 0x3b000000u, 0x3a800000u,
        0x3f880000u, 0x3f980000u, 0x3f808000u, 0x3f818000u, 0x42fe0000u, 0x42ff0000u, 0xc2ff0000u,
        0x3f000000u, 0x3fc00000u, 0x40200000u, 0xbf000000u, 0x3effffffu, 0x4b000001u,
    };
    uint32_t n = sizeof(bits) / sizeof(bits[0]);
    return i < n ? kvk_bits_f32(bits[i]) : kvk_bits_f32(tu_rand() ^ (tu_rand() << 21));
}

static void test_conversions_exact(void **state) {
    (void)state;
    int lv[2];
    int nl = levels(lv);
    if (nl == 0) {
        skip();
    }
    enum { N = 1 << 16 };
    static uint16_t codes16[N];
    static uint8_t codes8[256];
    static float got[N], want[N], src[N];
    static uint8_t out_got[4 * N], out_want[4 * N];
    for (uint32_t i = 0; i < N; i++) {
        codes16[i] = (uint16_t)i;
    }
    for (uint32_t i = 0; i < 256; i++) {
        codes8[i] = (uint8_t)i;
    }
    for (int li = 0; li < nl; li++) {
        const kvk__simd_ops *ops = ops_of(lv[li]);
        /* to_f32: every code of every dtype (8-bit with a scale), bitwise. */
        for (int d = 0; d < 5; d++) {
            kv_dtype dt = all_dts[d];
            uint32_t n = dt == KV_DTYPE_FP32 ? N / 2 : kvk_elem_bytes(dt) == 2 ? N : 256;
            const void *p = kvk_elem_bytes(dt) == 2 ? (const void *)codes16 : (const void *)codes8;
            if (dt == KV_DTYPE_FP32) {
                for (uint32_t i = 0; i < n; i++) {
                    src[i] = special(i);
                }
                p = src;
            }
            float mul = kvk__is_scaled(dt) ? 0.0371f : 1.0f;
            ops->to_f32(dt, p, n, mul, got);
            for (uint32_t i = 0; i < n; i++) {
                want[i] = mul != 1.0f ? kvk_load_f32(dt, p, i) * mul : kvk_load_f32(dt, p, i);
                if (kvk_f32_bits(got[i]) != kvk_f32_bits(want[i])) {
                    fail_msg("%s to_f32 %s code %u: %08x, twin %08x", ops->name, kv_dtype_name(dt),
                             i, kvk_f32_bits(got[i]), kvk_f32_bits(want[i]));
                }
            }
        }
        /* from_f32: specials and random bit patterns, with and without a divisor. */
        for (int rep = 0; rep < 16; rep++) {
            for (uint32_t i = 0; i < N; i++) {
                src[i] = special(rep == 0 ? i : 1000);
            }
            /* Odd lengths leave a scalar tail after the 8-lane groups. */
            uint32_t n = N - (uint32_t)rep;
            for (int d = 0; d < 5; d++) {
                kv_dtype dt = all_dts[d];
                float div = rep % 2 ? 0.0078125f * (float)(rep + 1) : 1.0f;
                ops->from_f32(dt, src, n, div, out_got);
                for (uint32_t i = 0; i < n; i++) {
                    kvk_store_f32(dt, out_want, i, div != 1.0f ? src[i] / div : src[i]);
                }
                uint32_t eb = kvk_elem_bytes(dt);
                for (uint32_t i = 0; i < n; i++) {
                    if (memcmp(out_got + i * eb, out_want + i * eb, eb) != 0) {
                        fail_msg("%s from_f32 %s of %08x / %g differs from the twin", ops->name,
                                 kv_dtype_name(dt), kvk_f32_bits(src[i]), div);
                    }
                }
            }
        }
    }
}

static void test_reshape_exact(void **state) {
    (void)state;
    int lv[2];
    int nl = levels(lv);
    const uint32_t dims[] = {8, 36, 128};
    for (int li = 0; li < nl; li++) {
        for (int di = 0; di < 3; di++) {
            for (int d = 0; d < 5; d++) {
                for (int w = 0; w < 3; w++) {
                    uint32_t dim = dims[di], heads = 3, tpb = 4;
                    tu_seg a, b;
                    tu_seg_init(&a, 2, heads, dim, tpb, all_dts[d], KV_LAYER_MAJOR, 6);
                    tu_seg_init(&b, 2, heads, dim, tpb, all_dts[d], KV_LAYER_MAJOR, 6);
                    memcpy(b.mem, a.mem, kv_layout_segment_bytes(&a.l, 6));
                    enum { N = 9 };
                    uint64_t elems = (uint64_t)N * heads * dim;
                    float *k = malloc(elems * 4), *v = malloc(elems * 4);
                    for (uint64_t i = 0; i < elems; i++) {
                        float x = special((uint32_t)(i % 97 == 0 ? i / 97 : 1000));
                        k[i] = i % 97 == 0 ? x : tu_randf() * 3.0f;
                        v[i] = tu_randf() * 500.0f;
                    }
                    /* Wide sources: round the floats to the source dtype in place. */
                    void *ks = malloc(elems * 4), *vs = malloc(elems * 4);
                    for (uint64_t i = 0; i < elems; i++) {
                        kvk_store_f32(wide_dts[w], ks, i, k[i]);
                        kvk_store_f32(wide_dts[w], vs, i, v[i]);
                    }
                    const float ksc[3] = {0.02f, 1.0f, 0.005f}, vsc[3] = {1.5f, 0.25f, 3.0f};
                    const int64_t slots[N] = {0, 5, -1, 19, 7, 12, 3, 23, 8};
                    kvk_tokens t = {
                        ks,          vs,  (int64_t)heads * dim * kvk_elem_bytes(wide_dts[w]),
                        wide_dts[w], ksc, vsc};
                    assert_int_equal(kvk__simd_force(lv[li]), lv[li]);
                    assert_int_equal(kvk_reshape_and_cache_cpu(&a.c, 1, &t, slots, N), KV_OK);
                    kvk__reshape_ref(&b.c, 1, &t, slots, N);
                    uint64_t bytes = kv_layout_segment_bytes(&a.l, 6);
                    for (uint64_t i = 0; i < bytes; i++) {
                        if (a.mem[i] != b.mem[i]) {
                            fail_msg("%s reshape %s -> %s dim %u: byte %llu is %02x, twin %02x",
                                     ops_of(lv[li])->name, kv_dtype_name(wide_dts[w]),
                                     kv_dtype_name(all_dts[d]), dim, (unsigned long long)i,
                                     a.mem[i], b.mem[i]);
                        }
                    }
                    free(k);
                    free(v);
                    free(ks);
                    free(vs);
                    tu_seg_fini(&a);
                    tu_seg_fini(&b);
                }
            }
        }
    }
    kvk__simd_force(best_level);
}

/* kvk_copy_stream at every level (and the SSE2 fallback): sizes around the 4 KiB threshold,
 * the 512-byte quarter step and its tail, both buffers at every offset mod 64; the bytes
 * around the destination untouched. */
static void test_copy_stream_exact(void **state) {
    (void)state;
    int lv[2];
    int nl = levels(lv);
    int all[3] = {KVK__SIMD_SCALAR, 0, 0};
    for (int i = 0; i < nl; i++) {
        all[i + 1] = lv[i];
    }
    const size_t sizes[] = {0, 1, 63, 4095, 4096, 4097, 4607, 8192 + 31, 32768, 100003, 1 << 20};
    size_t cap = (1 << 20) + 256;
    uint8_t *src = malloc(cap), *dst = malloc(cap), *want = malloc(cap);
    assert_non_null(src);
    assert_non_null(dst);
    assert_non_null(want);
    for (size_t i = 0; i < cap; i++) {
        src[i] = (uint8_t)(i * 131 + (i >> 9));
    }
    for (int li = 0; li < nl + 1; li++) {
        assert_int_equal(kvk__simd_force(all[li]), all[li]);
        for (size_t si = 0; si < sizeof(sizes) / sizeof(sizes[0]); si++) {
            /* (offsets 0..63 in steps that meet every alignment class of 16 and 32) */
            for (size_t so = 0; so < 64; so += 7) {
                for (size_t d0 = 0; d0 < 64; d0 += 5) {
                    size_t n = sizes[si], span = n + 128;
                    memset(dst, 0xA5, span);
                    memset(want, 0xA5, span);
                    memcpy(want + d0, src + so, n);
                    kvk_copy_stream(dst + d0, src + so, n);
                    if (memcmp(dst, want, span) != 0) {
                        fail_msg("level %d: copy of %zu bytes (src +%zu, dst +%zu) differs",
                                 all[li], n, so, d0);
                    }
                }
            }
        }
    }
    free(src);
    free(dst);
    free(want);
    kvk__simd_force(best_level);
}

static void test_quantize_exact(void **state) {
    (void)state;
    int lv[2];
    int nl = levels(lv);
    const uint32_t dims[] = {16, 40, 13};
    const uint32_t toks[] = {1, 16};
    for (int li = 0; li < nl; li++) {
        assert_int_equal(kvk__simd_force(lv[li]), lv[li]);
        for (uint32_t th = 1; th <= 2; th++) {
            assert_int_equal(kvk_set_threads(th), KV_OK);
            for (int di = 0; di < 3; di++) {
                for (int ti = 0; ti < 2; ti++) {
                    for (int w = 0; w < 3; w++) {
                        for (int nq = 3; nq < 5; nq++) {
                            uint32_t dim = dims[di], tokens = toks[ti], heads = 3, groups = 5;
                            uint64_t n = (uint64_t)groups * tokens * heads * dim;
                            float *x = malloc(n * 4);
                            void *src = malloc(n * 4);
                            uint8_t *q1 = malloc(n), *q2 = malloc(n);
                            float *s1 = malloc(groups * heads * 4),
                                  *s2 = malloc(groups * heads * 4);
                            void *b1 = malloc(n * 4), *b2 = malloc(n * 4);
                            for (uint64_t i = 0; i < n; i++) {
                                x[i] = tu_randf() * 4.0f;
                                if (i % 101 == 7) {
                                    x[i] = kvk_bits_f32(tu_rand() & 0x807fffffu); /* subnormal */
                                }
                            }
                            /* A group of all zeros: scale 1. */
                            memset(x, 0, (size_t)tokens * heads * dim * 4);
                            for (uint64_t i = 0; i < n; i++) {
                                kvk_store_f32(wide_dts[w], src, i, x[i]);
                            }
                            kv_dtype nd = all_dts[nq];
                            assert_int_equal(kvk_quantize_blocks_cpu(wide_dts[w], src, nd, q1, s1,
                                                                     groups, tokens, heads, dim),
                                             KV_OK);
                            kvk__quantize_ref(wide_dts[w], src, nd, q2, s2, groups, tokens, heads,
                                              dim);
                            assert_memory_equal(s1, s2, groups * heads * 4);
                            assert_memory_equal(q1, q2, n);
                            assert_int_equal(kvk_dequantize_blocks_cpu(nd, q1, s1, wide_dts[w], b1,
                                                                       groups, tokens, heads, dim),
                                             KV_OK);
                            kvk__dequantize_ref(nd, q1, s1, wide_dts[w], b2, groups, tokens, heads,
                                                dim);
                            assert_memory_equal(b1, b2, n * kvk_elem_bytes(wide_dts[w]));
                            free(x);
                            free(src);
                            free(q1);
                            free(q2);
                            free(s1);
                            free(s2);
                            free(b1);
                            free(b2);
                        }
                    }
                }
            }
        }
    }
    kvk_set_threads(1);
    kvk__simd_force(best_level);
}

/* One attention configuration: the vector kernels (every level, 1 and 2 threads) against the
 * twin; prefill when rows != NULL (rows[i] query rows for request i). */
static void check_attention(uint32_t page, uint32_t gqa, uint32_t dim, kv_dtype kdt, kv_dtype qdt,
                            kv_arrangement arr, const uint32_t *lens, const uint32_t *rows,
                            uint32_t batch, int causal) {
    const uint32_t kv_heads = 2, qo_heads = kv_heads * gqa;
    uint32_t pages = 0, nrows = 0;
    int32_t qo_indptr[16];
    qo_indptr[0] = 0;
    for (uint32_t i = 0; i < batch; i++) {
        pages += (lens[i] + page - 1) / page;
        nrows += rows != NULL ? rows[i] : 1;
        qo_indptr[i + 1] = (int32_t)nrows;
    }
    tu_seg s;
    tu_seg_init(&s, 2, kv_heads, dim, page, kdt, arr, pages + 2);
    tu_pt t;
    assert_int_equal(tu_pt_init(&t, lens, batch, page, pages + 2), 0);
    uint64_t qn = (uint64_t)nrows * qo_heads * dim;
    void *q = malloc(qn * 4), *want = malloc(qn * 4), *got = malloc(qn * 4), *got1 = malloc(qn * 4);
    float *wl = malloc(nrows * qo_heads * 4), *gl = malloc(nrows * qo_heads * 4);
    float *gl1 = malloc(nrows * qo_heads * 4);
    tu_fill(qdt, q, qn, 2.0f);
    float sm = 1.0f / sqrtf((float)dim);
    kvk_decode_args da = {q, want, wl, qdt, qo_heads, sm};
    kvk_prefill_args pa = {qo_indptr, q, want, wl, qdt, qo_heads, sm, causal};
    if (rows == NULL) {
        assert_int_equal(kvk__decode_ref(&s.c, 1, &t.pt, &da), KV_OK);
    } else {
        assert_int_equal(kvk__prefill_ref(&s.c, 1, &t.pt, &pa), KV_OK);
    }
    int lv[2];
    int nl = levels(lv);
    for (int li = 0; li < nl; li++) {
        assert_int_equal(kvk__simd_force(lv[li]), lv[li]);
        for (uint32_t th = 1; th <= 2; th++) {
            assert_int_equal(kvk_set_threads(th), KV_OK);
            void *o = th == 1 ? got1 : got;
            float *l = th == 1 ? gl1 : gl;
            memset(o, 0x55, qn * 4);
            da.out = pa.out = o;
            da.lse = pa.lse = l;
            if (rows == NULL) {
                assert_int_equal(kvk_paged_decode_attention_cpu(&s.c, 1, &t.pt, &da), KV_OK);
            } else {
                assert_int_equal(kvk_paged_prefill_attention_cpu(&s.c, 1, &t.pt, &pa), KV_OK);
            }
        }
        /* Threads change nothing, bit for bit. */
        assert_memory_equal(got, got1, qn * kvk_elem_bytes(qdt));
        assert_memory_equal(gl, gl1, nrows * qo_heads * 4);
        for (uint64_t i = 0; i < qn; i++) {
            double g = kvk_load_f32(qdt, got, i), w = kvk_load_f32(qdt, want, i);
            if (!(fabs(g - w) <= 1e-5 + tu_rel_tol(qdt) * fmax(1.0, fabs(w)))) {
                fail_msg("%s page %u gqa %u dim %u kv %s qo %s %s: out[%llu] = %g, twin %g",
                         ops_of(lv[li])->name, page, gqa, dim, kv_dtype_name(kdt),
                         kv_dtype_name(qdt), rows ? (causal ? "causal" : "prefill") : "decode",
                         (unsigned long long)i, g, w);
            }
        }
        for (uint32_t r = 0; r < nrows * qo_heads; r++) {
            if (isinf(wl[r])) {
                assert_true(isinf(gl[r]) && gl[r] < 0);
                continue;
            }
            if (!(fabs(gl[r] - wl[r]) <= 1e-5 * fmax(1.0, fabs(wl[r])))) {
                fail_msg("%s lse[%u] = %g, twin %g", ops_of(lv[li])->name, r, gl[r], wl[r]);
            }
        }
    }
    kvk_set_threads(1);
    kvk__simd_force(best_level);
    free(q);
    free(want);
    free(got);
    free(got1);
    free(wl);
    free(gl);
    free(gl1);
    tu_pt_fini(&t);
    tu_seg_fini(&s);
}

static void test_decode_vs_twin(void **state) {
    (void)state;
    if (best_level == KVK__SIMD_SCALAR) {
        skip();
    }
    const uint32_t pages[] = {1, 16, 64};
    const uint32_t gqas[] = {1, 4, 8};
    const uint32_t dims[] = {36, 40, 128};
    const uint32_t lens[] = {1, 17, 0, 64, 130, 7, 9};
    int n = 0;
    for (int p = 0; p < 3; p++) {
        for (int g = 0; g < 3; g++) {
            for (int k = 0; k < 5; k++) {
                for (int q = 0; q < 3; q++) {
                    check_attention(pages[p], gqas[g], dims[n % 3], all_dts[k], wide_dts[q],
                                    n % 2 ? KV_BLOCK_MAJOR : KV_LAYER_MAJOR, lens, NULL, 7, 0);
                    n++;
                }
            }
        }
    }
}

/* Many query heads on one KV head (cascade's shared prefix: every row's heads as one request;
 * 128 is more than one task's chunk): the query-vectorised path, with ragged lengths. */
static void test_wide_groups_vs_twin(void **state) {
    (void)state;
    if (best_level == KVK__SIMD_SCALAR) {
        skip();
    }
    const uint32_t gqas[] = {12, 16, 128};
    const uint32_t dims[] = {32, 36, 128};
    const uint32_t lens[] = {1, 17, 0, 64, 130};
    int n = 0;
    for (int g = 0; g < 3; g++) {
        for (int k = 0; k < 5; k++) {
            check_attention(n % 2 ? 16 : 1, gqas[g], dims[n % 3], all_dts[k], wide_dts[n % 3],
                            n % 2 ? KV_BLOCK_MAJOR : KV_LAYER_MAJOR, lens, NULL, 5, 0);
            n++;
        }
    }
}

static void test_prefill_vs_twin(void **state) {
    (void)state;
    if (best_level == KVK__SIMD_SCALAR) {
        skip();
    }
    const uint32_t pages[] = {1, 16, 64};
    const uint32_t gqas[] = {1, 4, 8};
    /* Request 3 has more rows than tokens: under the causal mask its first rows see nothing. */
    const uint32_t lens[] = {33, 0, 70, 3, 16};
    const uint32_t rows[] = {5, 0, 17, 6, 1};
    int n = 0;
    for (int p = 0; p < 3; p++) {
        for (int g = 0; g < 3; g++) {
            for (int k = 0; k < 5; k++) {
                check_attention(pages[p], gqas[g], n % 2 ? 36 : 64, all_dts[k], wide_dts[n % 3],
                                n % 2 ? KV_BLOCK_MAJOR : KV_LAYER_MAJOR, lens, rows, 5, n % 2);
                n++;
            }
        }
    }
}

/* The twin of prefill itself: the last causal row of each request is that request's decode, and
 * a non-causal row is too (bitwise: the same scalar loop). */
static void test_prefill_twin_is_decode(void **state) {
    (void)state;
    const uint32_t lens[] = {20, 5, 0};
    const uint32_t rows[] = {4, 1, 2};
    const uint32_t heads = 2, gqa = 4, dim = 16, qo = heads * gqa;
    tu_seg s;
    tu_seg_init(&s, 1, heads, dim, 4, KV_DTYPE_FP16, KV_LAYER_MAJOR, 12);
    tu_pt t;
    assert_int_equal(tu_pt_init(&t, lens, 3, 4, 12), 0);
    int32_t qo_indptr[4] = {0, 4, 5, 7};
    float q[7 * 8 * 16], out[7 * 8 * 16], lse[7 * 8];
    float dq[3 * 8 * 16], dout[3 * 8 * 16], dlse[3 * 8];
    tu_fill(KV_DTYPE_FP32, q, 7 * qo * dim, 1.0f);
    for (int causal = 0; causal < 2; causal++) {
        kvk_prefill_args pa = {qo_indptr, q, out, lse, KV_DTYPE_FP32, qo, 0.25f, causal};
        assert_int_equal(kvk__prefill_ref(&s.c, 0, &t.pt, &pa), KV_OK);
        for (int i = 0; i < 3; i++) {
            int last = qo_indptr[i] + (int)rows[i] - 1;
            memcpy(dq + i * qo * dim, q + last * qo * dim, qo * dim * 4);
        }
        kvk_decode_args da = {dq, dout, dlse, KV_DTYPE_FP32, qo, 0.25f};
        assert_int_equal(kvk__decode_ref(&s.c, 0, &t.pt, &da), KV_OK);
        for (int i = 0; i < 3; i++) {
            int last = qo_indptr[i] + (int)rows[i] - 1;
            assert_memory_equal(out + last * qo * dim, dout + i * qo * dim, qo * dim * 4);
            assert_memory_equal(lse + last * qo, dlse + i * qo, qo * 4);
        }
        if (causal) {
            /* Row 0 of request 0 sees 20 - 4 + 1 = 17 tokens: not the decode of 20. */
            assert_memory_not_equal(out, dout, qo * dim * 4);
        }
    }
    kvk_prefill_args bad = {NULL, q, out, lse, KV_DTYPE_FP32, qo, 0.25f, 1};
    assert_int_equal(kvk_paged_prefill_attention_cpu(&s.c, 0, &t.pt, &bad), KV_EINVAL);
    int32_t dec[4] = {0, 4, 3, 7};
    bad.qo_indptr = dec;
    assert_int_equal(kvk_paged_prefill_attention_cpu(&s.c, 0, &t.pt, &bad), KV_EINVAL);
    tu_pt_fini(&t);
    tu_seg_fini(&s);
}

/* Two application threads in the kernels at once while the pool has 2 threads: one of them runs
 * alone (the pool is busy), and both get the serial results. */
typedef struct conc_arg {
    const kvk_cache *c;
    const kvk_page_table *pt;
    kvk_decode_args a;
    int reps;
    int ok;
} conc_arg;

static void *conc_main(void *p) {
    conc_arg *x = p;
    x->ok = 1;
    for (int r = 0; r < x->reps; r++) {
        x->ok &= kvk_paged_decode_attention_cpu(x->c, 0, x->pt, &x->a) == KV_OK;
    }
    return NULL;
}

static void test_threads_concurrent_callers(void **state) {
    (void)state;
    const uint32_t lens[] = {200, 31, 77, 128};
    tu_seg s;
    tu_seg_init(&s, 1, 4, 64, 16, KV_DTYPE_BF16, KV_BLOCK_MAJOR, 40);
    tu_pt t;
    assert_int_equal(tu_pt_init(&t, lens, 4, 16, 40), 0);
    enum { QN = 4 * 16 * 64 };
    static float q[QN], ref[QN], o1[QN], o2[QN];
    tu_fill(KV_DTYPE_FP32, q, QN, 1.0f);
    kvk_decode_args a = {q, ref, NULL, KV_DTYPE_FP32, 16, 0.125f};
    assert_int_equal(kvk_set_threads(1), KV_OK);
    assert_int_equal(kvk_paged_decode_attention_cpu(&s.c, 0, &t.pt, &a), KV_OK);
    assert_int_equal(kvk_set_threads(2), KV_OK);
    assert_int_equal(kvk_threads(), 2);
    conc_arg x1 = {&s.c, &t.pt, {q, o1, NULL, KV_DTYPE_FP32, 16, 0.125f}, 50, 0};
    conc_arg x2 = {&s.c, &t.pt, {q, o2, NULL, KV_DTYPE_FP32, 16, 0.125f}, 50, 0};
    pthread_t th1, th2;
    assert_int_equal(pthread_create(&th1, NULL, conc_main, &x1), 0);
    assert_int_equal(pthread_create(&th2, NULL, conc_main, &x2), 0);
    pthread_join(th1, NULL);
    pthread_join(th2, NULL);
    assert_true(x1.ok && x2.ok);
    assert_memory_equal(o1, ref, sizeof(ref));
    assert_memory_equal(o2, ref, sizeof(ref));
    /* Shrinking and growing the pool between calls. */
    const uint32_t counts[] = {3, 1, 2, 1};
    for (int i = 0; i < 4; i++) {
        assert_int_equal(kvk_set_threads(counts[i]), KV_OK);
        memset(o1, 0, sizeof(o1));
        a.out = o1;
        assert_int_equal(kvk_paged_decode_attention_cpu(&s.c, 0, &t.pt, &a), KV_OK);
        assert_memory_equal(o1, ref, sizeof(ref));
    }
    assert_int_equal(kvk_set_threads(0), KV_EINVAL);
    assert_int_equal(kvk_set_threads(KVK_MAX_THREADS + 1), KV_EINVAL);
    assert_int_equal(kvk_threads(), 1);
    tu_pt_fini(&t);
    tu_seg_fini(&s);
}

/* KVK_SIMD=scalar (read once, at the first call) selects the twins: checked in a child process
 * of this binary started with the variable set; and forcing scalar here makes the public calls
 * the twins bit for bit. */
static void test_scalar_fallback(void **state) {
    (void)state;
    char cmd[512];
    snprintf(cmd, sizeof(cmd), "KVK_SIMD=scalar KVK_THREADS=2 '%s' --print-simd", self_path);
    FILE *f = popen(cmd, "r");
    assert_non_null(f);
    char line[64] = {0};
    assert_non_null(fgets(line, sizeof(line), f));
    assert_int_equal(pclose(f), 0);
    assert_string_equal(line, "scalar 2\n");

    assert_int_equal(kvk__simd_force(KVK__SIMD_SCALAR), KVK__SIMD_SCALAR);
    assert_string_equal(kvk_simd_name(), "scalar");
    const uint32_t lens[] = {40, 3};
    tu_seg s;
    tu_seg_init(&s, 1, 2, 24, 16, KV_DTYPE_FP8_E4M3, KV_LAYER_MAJOR, 6);
    tu_pt t;
    assert_int_equal(tu_pt_init(&t, lens, 2, 16, 6), 0);
    uint16_t q[2 * 8 * 24], o1[2 * 8 * 24], o2[2 * 8 * 24];
    tu_fill(KV_DTYPE_FP16, q, 2 * 8 * 24, 1.0f);
    kvk_decode_args a = {q, o1, NULL, KV_DTYPE_FP16, 8, 0.2f};
    assert_int_equal(kvk_paged_decode_attention_cpu(&s.c, 0, &t.pt, &a), KV_OK);
    a.out = o2;
    assert_int_equal(kvk__decode_ref(&s.c, 0, &t.pt, &a), KV_OK);
    assert_memory_equal(o1, o2, sizeof(o1));
    kvk__simd_force(best_level);
    tu_pt_fini(&t);
    tu_seg_fini(&s);
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "--print-simd") == 0) {
        printf("%s %u\n", kvk_simd_name(), kvk_threads());
        return 0;
    }
    self_path = argv[0];
    best_level = kvk__simd_force(KVK__SIMD_AVX512);
    printf("# vector level on this CPU: %s\n", kvk_simd_name());
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_conversions_exact),
        cmocka_unit_test(test_reshape_exact),
        cmocka_unit_test(test_quantize_exact),
        cmocka_unit_test(test_copy_stream_exact),
        cmocka_unit_test(test_decode_vs_twin),
        cmocka_unit_test(test_wide_groups_vs_twin),
        cmocka_unit_test(test_prefill_vs_twin),
        cmocka_unit_test(test_prefill_twin_is_decode),
        cmocka_unit_test(test_threads_concurrent_callers),
        cmocka_unit_test(test_scalar_fallback),
    };
    return cmocka_run_group_tests_name("kvk_simd", tests, NULL, NULL);
}
