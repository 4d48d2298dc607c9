/* Checks kv_layout: derived sizes, that the offsets of every element and scale of a small
 * segment tile it exactly (distinct, in range, no overlap, no gap), the shape of each
 * arrangement, limits with their messages, and the names. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "common/kv_layout.h"

static const kv_dtype ALL_DTYPES[] = {KV_DTYPE_FP16, KV_DTYPE_BF16, KV_DTYPE_FP32,
                                      KV_DTYPE_FP8_E4M3, KV_DTYPE_INT8};
static const kv_arrangement ALL_ARR[] = {KV_LAYER_MAJOR, KV_BLOCK_MAJOR};
#define NDT (sizeof(ALL_DTYPES) / sizeof(ALL_DTYPES[0]))

/* A small, deliberately uneven shape. */
enum { LAYERS = 3, HEADS = 2, DIM = 4, TPB = 5, NBLOCKS = 3 };

static int is_8bit(kv_dtype d) {
    return d == KV_DTYPE_FP8_E4M3 || d == KV_DTYPE_INT8;
}

static void test_derived_sizes(void **state) {
    (void)state;
    static const uint32_t elem[] = {2, 2, 4, 1, 1};
    for (size_t i = 0; i < NDT; i++) {
        for (size_t a = 0; a < 2; a++) {
            kv_layout l;
            assert_int_equal(kv_layout_init(LAYERS, HEADS, DIM, TPB, ALL_DTYPES[i], ALL_ARR[a], &l),
                             KV_OK);
            assert_int_equal(l.num_layers, LAYERS);
            assert_int_equal(l.elem_bytes, elem[i]);
            assert_int_equal(l.token_bytes, HEADS * DIM * elem[i]);
            assert_int_equal(l.kv_block_bytes, TPB * HEADS * DIM * elem[i]);
            assert_int_equal(l.data_bytes, LAYERS * 2 * TPB * HEADS * DIM * elem[i]);
            assert_int_equal(l.scale_bytes, is_8bit(ALL_DTYPES[i]) ? LAYERS * 2 * HEADS * 4 : 0);
            assert_int_equal(l.block_bytes, l.data_bytes + l.scale_bytes);
            assert_int_equal(kv_layout_segment_bytes(&l, NBLOCKS), NBLOCKS * l.block_bytes);
            assert_int_equal(kv_layout_segment_bytes(&l, 0), 0);
        }
    }
    /* A real model: Llama-3-8B, fp16, 16-token blocks = 2 MiB per block. */
    kv_layout l;
    assert_int_equal(kv_layout_init(32, 8, 128, 16, KV_DTYPE_FP16, KV_LAYER_MAJOR, &l), KV_OK);
    assert_int_equal(l.block_bytes, 2u * 1024 * 1024);
}

/* Marks [off, off+len) in owner[], failing on any byte outside the segment or already owned. */
static void mark(unsigned char *owner, uint64_t seg, uint64_t off, uint64_t len) {
    assert_true(off + len <= seg);
    for (uint64_t i = off; i < off + len; i++) {
        assert_int_equal(owner[i], 0);
        owner[i] = 1;
    }
}

static void test_offsets_tile_segment(void **state) {
    (void)state;
    for (size_t i = 0; i < NDT; i++) {
        for (size_t a = 0; a < 2; a++) {
            kv_layout l;
            assert_int_equal(kv_layout_init(LAYERS, HEADS, DIM, TPB, ALL_DTYPES[i], ALL_ARR[a], &l),
                             KV_OK);
            uint64_t seg = kv_layout_segment_bytes(&l, NBLOCKS);
            unsigned char *owner = calloc(seg, 1);
            assert_non_null(owner);
            uint64_t head_bytes = (uint64_t)DIM * l.elem_bytes;
            for (uint32_t b = 0; b < NBLOCKS; b++) {
                uint64_t lo = UINT64_MAX, hi = 0; /* span of block b's bytes */
                for (uint32_t ly = 0; ly < LAYERS; ly++) {
                    for (int kv = KV_K; kv <= KV_V; kv++) {
                        for (uint32_t t = 0; t < TPB; t++) {
                            for (uint32_t h = 0; h < HEADS; h++) {
                                uint64_t off = kv_layout_offset(&l, NBLOCKS, b, ly, kv, t, h);
                                /* Elements are aligned to their own size. */
                                assert_int_equal(off % l.elem_bytes, 0);
                                mark(owner, seg, off, head_bytes);
                                lo = off < lo ? off : lo;
                                hi = off + head_bytes > hi ? off + head_bytes : hi;
                            }
                        }
                        if (l.scale_bytes == 0) {
                            continue;
                        }
                        for (uint32_t h = 0; h < HEADS; h++) {
                            uint64_t off = kv_layout_scale_offset(&l, NBLOCKS, b, ly, kv, h);
                            assert_int_equal(off % sizeof(float), 0);
                            mark(owner, seg, off, sizeof(float));
                            lo = off < lo ? off : lo;
                            hi = off + sizeof(float) > hi ? off + sizeof(float) : hi;
                        }
                    }
                }
                if (ALL_ARR[a] == KV_BLOCK_MAJOR) {
                    /* One block is one contiguous run of block_bytes, scales included. */
                    assert_int_equal(lo, (uint64_t)b * l.block_bytes);
                    assert_int_equal(hi - lo, l.block_bytes);
                }
            }
            /* Every byte of the segment belongs to exactly one element or scale. */
            for (uint64_t k = 0; k < seg; k++) {
                assert_int_equal(owner[k], 1);
            }
            free(owner);
        }
    }
}

static void test_layer_major_tensor_shape(void **state) {
    (void)state;
    for (size_t i = 0; i < NDT; i++) {
        kv_layout l;
        assert_int_equal(kv_layout_init(LAYERS, HEADS, DIM, TPB, ALL_DTYPES[i], KV_LAYER_MAJOR, &l),
                         KV_OK);
        uint64_t section = (uint64_t)NBLOCKS * l.kv_block_bytes;
        for (uint32_t ly = 0; ly < LAYERS; ly++) {
            for (int kv = KV_K; kv <= KV_V; kv++) {
                /* Section (layer, kv) starts where the previous one ends: K then V per layer. */
                uint64_t base = kv_layout_offset(&l, NBLOCKS, 0, ly, kv, 0, 0);
                assert_int_equal(base, ((uint64_t)ly * 2 + (uint64_t)kv) * section);
                for (uint32_t b = 0; b < NBLOCKS; b++) {
                    for (uint32_t t = 0; t < TPB; t++) {
                        for (uint32_t h = 0; h < HEADS; h++) {
                            /* [nblocks][tpb][heads][dim] with dim innermost. */
                            uint64_t want =
                                base + (((uint64_t)b * TPB + t) * HEADS + h) * DIM * l.elem_bytes;
                            assert_int_equal(kv_layout_offset(&l, NBLOCKS, b, ly, kv, t, h), want);
                        }
                    }
                }
            }
        }
        if (is_8bit(ALL_DTYPES[i])) {
            /* Scales after all element data, as [layers][K,V][nblocks][heads]. */
            uint64_t data = (uint64_t)NBLOCKS * l.data_bytes;
            assert_int_equal(kv_layout_scale_offset(&l, NBLOCKS, 0, 0, KV_K, 0), data);
            assert_int_equal(kv_layout_scale_offset(&l, NBLOCKS, 2, 1, KV_V, 1),
                             data + (((1 * 2 + 1) * NBLOCKS + 2) * HEADS + 1) * 4);
        }
    }
}

static void test_block_major_shape(void **state) {
    (void)state;
    kv_layout l;
    assert_int_equal(kv_layout_init(LAYERS, HEADS, DIM, TPB, KV_DTYPE_INT8, KV_BLOCK_MAJOR, &l),
                     KV_OK);
    /* [layers][K,V][tokens][heads][dim], then [layers][K,V][heads] floats. */
    uint64_t want = 1 * l.block_bytes + ((2 * 2 + 1) * TPB + 4) * l.token_bytes + 1 * DIM;
    assert_int_equal(kv_layout_offset(&l, NBLOCKS, 1, 2, KV_V, 4, 1), want);
    assert_int_equal(kv_layout_scale_offset(&l, NBLOCKS, 1, 2, KV_V, 1),
                     1 * l.block_bytes + l.data_bytes + ((2 * 2 + 1) * HEADS + 1) * 4);
    /* Offsets in BLOCK_MAJOR do not depend on the segment's block count. */
    assert_int_equal(kv_layout_offset(&l, 100, 1, 2, KV_V, 4, 1), want);
}

static void test_limits_rejected_with_field_named(void **state) {
    (void)state;
    kv_layout l;
    memset(&l, 0xab, sizeof(l));
    kv_layout before = l;
    struct {
        uint32_t layers, heads, dim, tpb;
        kv_dtype dtype;
        kv_arrangement arr;
        const char *field;
    } bad[] = {
        {0, 8, 128, 16, KV_DTYPE_FP16, KV_LAYER_MAJOR, "num_layers"},
        {1025, 8, 128, 16, KV_DTYPE_FP16, KV_LAYER_MAJOR, "num_layers"},
        {32, 0, 128, 16, KV_DTYPE_FP16, KV_LAYER_MAJOR, "num_kv_heads"},
        {32, 1025, 128, 16, KV_DTYPE_FP16, KV_LAYER_MAJOR, "num_kv_heads"},
        {32, 8, 0, 16, KV_DTYPE_FP16, KV_LAYER_MAJOR, "head_dim"},
        {32, 8, 4097, 16, KV_DTYPE_FP16, KV_LAYER_MAJOR, "head_dim"},
        {32, 8, 128, 0, KV_DTYPE_FP16, KV_LAYER_MAJOR, "tokens_per_block"},
        {32, 8, 128, 1025, KV_DTYPE_FP16, KV_LAYER_MAJOR, "tokens_per_block"},
        {32, 8, 128, 16, (kv_dtype)0, KV_LAYER_MAJOR, "dtype"},
        {32, 8, 128, 16, (kv_dtype)6, KV_LAYER_MAJOR, "dtype"},
        {32, 8, 126, 16, KV_DTYPE_INT8, KV_LAYER_MAJOR, "head_dim"},
        {32, 8, 128, 16, KV_DTYPE_FP16, (kv_arrangement)0, "arrangement"},
        {32, 8, 128, 16, KV_DTYPE_FP16, (kv_arrangement)3, "arrangement"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        assert_int_equal(kv_layout_init(bad[i].layers, bad[i].heads, bad[i].dim, bad[i].tpb,
                                        bad[i].dtype, bad[i].arr, &l),
                         KV_EINVAL);
        assert_memory_equal(&l, &before, sizeof(l));
        const char *msg = kv_layout_check_msg(bad[i].layers, bad[i].heads, bad[i].dim, bad[i].tpb,
                                              bad[i].dtype, bad[i].arr);
        assert_non_null(msg);
        /* The message starts with the field's name. */
        assert_int_equal(strncmp(msg, bad[i].field, strlen(bad[i].field)), 0);
    }
    /* The edges of each range are accepted. */
    assert_null(kv_layout_check_msg(1, 1, 1, 1, KV_DTYPE_FP16, KV_LAYER_MAJOR));
    assert_null(kv_layout_check_msg(1024, 1024, 4096, 1024, KV_DTYPE_FP32, KV_BLOCK_MAJOR));
    assert_int_equal(kv_layout_init(1024, 1024, 4096, 1024, KV_DTYPE_FP32, KV_BLOCK_MAJOR, &l),
                     KV_OK);
    assert_int_equal(l.block_bytes, 1024ull * 2 * 1024 * 1024 * 4096 * 4);
    assert_int_equal(kv_layout_segment_bytes(&l, UINT32_MAX), UINT64_MAX); /* saturates */
    assert_int_equal(kv_layout_init(32, 8, 128, 16, KV_DTYPE_FP16, KV_LAYER_MAJOR, NULL),
                     KV_EINVAL);
}

static void test_names_round_trip(void **state) {
    (void)state;
    static const char *dn[] = {"fp16", "bf16", "fp32", "fp8_e4m3", "int8"};
    for (size_t i = 0; i < NDT; i++) {
        assert_string_equal(kv_dtype_name(ALL_DTYPES[i]), dn[i]);
        kv_dtype d = (kv_dtype)0;
        assert_int_equal(kv_dtype_parse(dn[i], &d), KV_OK);
        assert_int_equal(d, ALL_DTYPES[i]);
    }
    assert_string_equal(kv_arrangement_name(KV_LAYER_MAJOR), "layer_major");
    assert_string_equal(kv_arrangement_name(KV_BLOCK_MAJOR), "block_major");
    kv_arrangement a = (kv_arrangement)0;
    assert_int_equal(kv_arrangement_parse("block_major", &a), KV_OK);
    assert_int_equal(a, KV_BLOCK_MAJOR);
    assert_int_equal(kv_arrangement_parse("layer_major", &a), KV_OK);
    assert_int_equal(a, KV_LAYER_MAJOR);

    kv_dtype d = KV_DTYPE_FP32;
    assert_int_equal(kv_dtype_parse("fp8", &d), KV_EINVAL);
    assert_int_equal(kv_dtype_parse("FP16", &d), KV_EINVAL);
    assert_int_equal(kv_dtype_parse("", &d), KV_EINVAL);
    assert_int_equal(kv_dtype_parse(NULL, &d), KV_EINVAL);
    assert_int_equal(d, KV_DTYPE_FP32);
    assert_int_equal(kv_arrangement_parse("row_major", &a), KV_EINVAL);
    assert_int_equal(a, KV_LAYER_MAJOR);
    assert_string_equal(kv_dtype_name((kv_dtype)42), "unknown");
    assert_string_equal(kv_arrangement_name((kv_arrangement)42), "unknown");
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_derived_sizes),
        cmocka_unit_test(test_offsets_tile_segment),
        cmocka_unit_test(test_layer_major_tensor_shape),
        cmocka_unit_test(test_block_major_shape),
        cmocka_unit_test(test_limits_rejected_with_field_named),
        cmocka_unit_test(test_names_round_trip),
    };
    return cmocka_run_group_tests_name("kv_layout", tests, NULL, NULL);
}
