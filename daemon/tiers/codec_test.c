/* Tests of kvd_codec: names, round trips of every format on float-like and compressible data,
 * the RAW fallback, and rejection of truncated, garbage and mislabelled input. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include <math.h>

#include "daemon/tiers/codec.h"
#include "kernels/kvk_dtype.h"

#define N (64 * 1024)

static uint64_t rng_next(uint64_t *s) {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

/* fp16-looking activations: random mantissas, exponents in a narrow band, as KV data is. */
static void fill_floats(uint8_t *p, size_t n, uint64_t seed) {
    uint64_t s = seed | 1;
    for (size_t i = 0; i + 1 < n; i += 2) {
        uint64_t r = rng_next(&s);
        uint16_t h =
            (uint16_t)(((r >> 20) & 1) << 15 | (uint16_t)(12 + (r >> 10) % 5) << 10 | (r & 0x3FF));
        p[i] = (uint8_t)h;
        p[i + 1] = (uint8_t)(h >> 8);
    }
}

static void fill_random(uint8_t *p, size_t n, uint64_t seed) {
    uint64_t s = seed | 1;
    for (size_t i = 0; i < n; i++) {
        p[i] = (uint8_t)(rng_next(&s) >> 24);
    }
}

/* Mostly zeros with a repeating pattern: compresses well in every format. */
static void fill_compressible(uint8_t *p, size_t n) {
    for (size_t i = 0; i < n; i++) {
        p[i] = (i % 512) < 16 ? (uint8_t)(i % 7) : 0;
    }
}

/* Encodes src in f, checks the chosen format against the saving rule, decodes and compares. */
static kvd_tier_format round_trip(kvd_tier_format f, const uint8_t *src, size_t n) {
    size_t cap = kvd_codec_bound(f, n);
    assert_true(cap >= n);
    uint8_t *enc = malloc(cap + 1);
    uint8_t *dec = malloc(n + 1);
    assert_non_null(enc);
    assert_non_null(dec);
    size_t len = 0;
    kvd_tier_format used = KVD_TF_COUNT;
    assert_int_equal(kvd_codec_encode(f, src, n, enc, cap, &len, &used), KV_OK);
    assert_true(len <= cap);
    if (used == KVD_TF_RAW) {
        assert_int_equal(len, n);
        assert_memory_equal(enc, src, n);
    } else {
        assert_int_equal(used, f);
        assert_true(n - len >= n / 16);
    }
    memset(dec, 0xA5, n + 1);
    assert_int_equal(kvd_codec_decode(used, enc, len, dec, n), KV_OK);
    assert_memory_equal(dec, src, n);
    assert_int_equal(dec[n], 0xA5);
    free(enc);
    free(dec);
    return used;
}

static void test_names(void **state) {
    (void)state;
    kvd_tier_format f;
    for (int i = 0; i < KVD_TF_COUNT; i++) {
        assert_int_equal(kvd_tier_format_parse(kvd_tier_format_name((kvd_tier_format)i), &f),
                         KV_OK);
        assert_int_equal(f, i);
    }
    assert_string_equal(kvd_tier_format_name(KVD_TF_RAW), "raw");
    assert_string_equal(kvd_tier_format_name(KVD_TF_LZ4), "lz4");
    assert_string_equal(kvd_tier_format_name(KVD_TF_ZSTD), "zstd");
    assert_string_equal(kvd_tier_format_name(KVD_TF_COUNT), "?");
    assert_string_equal(kvd_tier_format_name((kvd_tier_format)-1), "?");
    f = KVD_TF_ZSTD;
    assert_int_equal(kvd_tier_format_parse("LZ4", &f), KV_EINVAL);
    assert_int_equal(kvd_tier_format_parse("", &f), KV_EINVAL);
    assert_int_equal(kvd_tier_format_parse(NULL, &f), KV_EINVAL);
    assert_int_equal(f, KVD_TF_ZSTD);
}

static void test_round_trip_floats(void **state) {
    (void)state;
    uint8_t *src = malloc(N);
    assert_non_null(src);
    for (uint64_t seed = 1; seed <= 3; seed++) {
        fill_floats(src, N, seed);
        for (int f = 0; f <= KVD_TF_ZSTD; f++ /* the lossless ones */) {
            round_trip((kvd_tier_format)f, src, N);
            round_trip((kvd_tier_format)f, src, 1000 + (size_t)seed); /* odd sizes */
        }
    }
    assert_int_equal(round_trip(KVD_TF_RAW, src, N), KVD_TF_RAW);
    free(src);
}

static void test_round_trip_compressible(void **state) {
    (void)state;
    uint8_t *src = malloc(N);
    assert_non_null(src);
    fill_compressible(src, N);
    assert_int_equal(round_trip(KVD_TF_RAW, src, N), KVD_TF_RAW);
    assert_int_equal(round_trip(KVD_TF_LZ4, src, N), KVD_TF_LZ4);
    assert_int_equal(round_trip(KVD_TF_ZSTD, src, N), KVD_TF_ZSTD);
    free(src);
}

static void test_incompressible_falls_back(void **state) {
    (void)state;
    uint8_t *src = malloc(N);
    assert_non_null(src);
    fill_random(src, N, 7);
    assert_int_equal(round_trip(KVD_TF_LZ4, src, N), KVD_TF_RAW);
    assert_int_equal(round_trip(KVD_TF_ZSTD, src, N), KVD_TF_RAW);
    /* Tiny and empty inputs cannot save anything either. */
    assert_int_equal(round_trip(KVD_TF_LZ4, src, 1), KVD_TF_RAW);
    assert_int_equal(round_trip(KVD_TF_ZSTD, src, 1), KVD_TF_RAW);
    assert_int_equal(round_trip(KVD_TF_LZ4, src, 0), KVD_TF_RAW);
    assert_int_equal(round_trip(KVD_TF_ZSTD, src, 0), KVD_TF_RAW);
    free(src);
}

static void test_bad_arguments(void **state) {
    (void)state;
    uint8_t src[256], dst[1024];
    fill_compressible(src, sizeof(src));
    size_t len = 77;
    kvd_tier_format used = KVD_TF_ZSTD;
    assert_int_equal(
        kvd_codec_encode(KVD_TF_COUNT, src, sizeof(src), dst, sizeof(dst), &len, &used), KV_EINVAL);
    assert_int_equal(
        kvd_codec_encode((kvd_tier_format)-1, src, sizeof(src), dst, sizeof(dst), &len, &used),
        KV_EINVAL);
    size_t bound = kvd_codec_bound(KVD_TF_LZ4, sizeof(src));
    assert_int_equal(kvd_codec_encode(KVD_TF_LZ4, src, sizeof(src), dst, bound - 1, &len, &used),
                     KV_EINVAL);
    assert_int_equal(
        kvd_codec_encode(KVD_TF_RAW, src, sizeof(src), dst, sizeof(src) - 1, &len, &used),
        KV_EINVAL);
    assert_int_equal(kvd_codec_encode(KVD_TF_RAW, src, sizeof(src), dst, sizeof(dst), NULL, &used),
                     KV_EINVAL);
    assert_int_equal(len, 77);
    assert_int_equal(used, KVD_TF_ZSTD);
    assert_int_equal(kvd_codec_decode(KVD_TF_COUNT, src, sizeof(src), dst, sizeof(src)), KV_EINVAL);
    assert_int_equal(kvd_codec_decode((kvd_tier_format)7, src, sizeof(src), dst, sizeof(src)),
                     KV_EINVAL);
    for (int f = 0; f <= KVD_TF_ZSTD; f++ /* the lossless ones */) {
        assert_true(kvd_codec_bound((kvd_tier_format)f, 12345) >= 12345);
    }
    assert_int_equal(kvd_codec_bound(KVD_TF_RAW, 0), 0);
    assert_int_equal(kvd_codec_bound(KVD_TF_RAW, 12345), 12345);
    assert_int_equal(kvd_codec_bound(KVD_TF_COUNT, 12345), 12345);
}

static void test_corrupt_input(void **state) {
    (void)state;
    uint8_t *src = malloc(N);
    uint8_t *dec = malloc(N);
    assert_non_null(src);
    assert_non_null(dec);
    fill_compressible(src, N);
    for (int f = KVD_TF_LZ4; f <= KVD_TF_ZSTD; f++ /* the lossless ones */) {
        size_t cap = kvd_codec_bound((kvd_tier_format)f, N);
        uint8_t *enc = malloc(cap);
        assert_non_null(enc);
        size_t len;
        kvd_tier_format used;
        assert_int_equal(kvd_codec_encode((kvd_tier_format)f, src, N, enc, cap, &len, &used),
                         KV_OK);
        assert_int_equal(used, f);
        /* Truncated at several points. */
        size_t cuts[] = {0, 1, len / 2, len - 1};
        for (size_t i = 0; i < sizeof(cuts) / sizeof(cuts[0]); i++) {
            assert_int_equal(kvd_codec_decode(used, enc, cuts[i], dec, N), KV_ECORRUPT);
        }
        /* Valid stream, wrong expected size either way. */
        assert_int_equal(kvd_codec_decode(used, enc, len, dec, N - 1), KV_ECORRUPT);
        assert_int_equal(kvd_codec_decode(used, enc, len, dec, N / 2), KV_ECORRUPT);
        uint8_t *big = malloc(N + 1);
        assert_non_null(big);
        assert_int_equal(kvd_codec_decode(used, enc, len, big, N + 1), KV_ECORRUPT);
        free(big);
        /* Garbage of the same length. */
        fill_random(enc, len, 99 + (uint64_t)f);
        assert_int_equal(kvd_codec_decode(used, enc, len, dec, N), KV_ECORRUPT);
        free(enc);
    }
    /* RAW whose length is not n; and the other formats given raw bytes. */
    assert_int_equal(kvd_codec_decode(KVD_TF_RAW, src, N - 1, dec, N), KV_ECORRUPT);
    assert_int_equal(kvd_codec_decode(KVD_TF_RAW, src, N, dec, N - 1), KV_ECORRUPT);
    fill_random(src, N, 5);
    assert_int_equal(kvd_codec_decode(KVD_TF_LZ4, src, N, dec, N), KV_ECORRUPT);
    assert_int_equal(kvd_codec_decode(KVD_TF_ZSTD, src, N, dec, N), KV_ECORRUPT);
    free(src);
    free(dec);
}

/* Lossy formats: every element comes back within the quantization step of its (layer, K|V,
 * head) group: int8 half a step (absmax / 127 / 2), fp8-e4m3 one part in 16 of the value plus
 * half its smallest step; then the pool dtype's own rounding. */
static void lossy_case(kv_dtype dt, kv_arrangement arr, kvd_tier_format f) {
    kv_layout l;
    assert_int_equal(kv_layout_init(3, 2, 8, 4, dt, arr, &l), KV_OK);
    size_t qb = kvd_codec_quantized_bytes(f, &l);
    assert_true(qb > 0 && qb < l.block_bytes);
    uint64_t n = l.block_bytes / l.elem_bytes;
    uint8_t *img = malloc(l.block_bytes), *back = malloc(l.block_bytes), *q = malloc(qb);
    assert_non_null(img);
    assert_non_null(back);
    assert_non_null(q);
    uint64_t x = 12345;
    for (uint64_t i = 0; i < n; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        float v = ((float)(x >> 40) / (float)(1u << 24) - 0.5f) * 8.0f;
        if (dt == KV_DTYPE_FP16) {
            ((uint16_t *)img)[i] = kvk_f32_to_fp16(v);
        } else if (dt == KV_DTYPE_BF16) {
            ((uint16_t *)img)[i] = kvk_f32_to_bf16(v);
        } else {
            ((float *)img)[i] = v;
        }
    }
    assert_int_equal(kvd_codec_quantize(f, &l, img, q), KV_OK);
    assert_int_equal(kvd_codec_dequantize(f, &l, q, qb, back), KV_OK);
    /* The image is 2 * layers groups of [tokens][heads][dim]. */
    uint32_t t = l.tokens_per_block, h = l.num_kv_heads, d = l.head_dim;
    for (uint64_t g = 0; g < (uint64_t)l.num_layers * 2; g++) {
        for (uint32_t hd = 0; hd < h; hd++) {
            float amax = 0;
            for (uint32_t tk = 0; tk < t; tk++) {
                for (uint32_t e = 0; e < d; e++) {
                    uint64_t i = ((g * t + tk) * h + hd) * d + e;
                    float a = fabsf(kvk_load_f32(dt, img, i));
                    amax = a > amax ? a : amax;
                }
            }
            float step = amax / (f == KVD_TF_INT8 ? 127.0f : 448.0f);
            for (uint32_t tk = 0; tk < t; tk++) {
                for (uint32_t e = 0; e < d; e++) {
                    uint64_t i = ((g * t + tk) * h + hd) * d + e;
                    float a = kvk_load_f32(dt, img, i), b = kvk_load_f32(dt, back, i);
                    float bound = f == KVD_TF_INT8 ? step * 0.5f : fabsf(a) / 16.0f + step;
                    bound += fabsf(a) * (dt == KV_DTYPE_BF16 ? 1.0f / 128 : 1.0f / 1024) + 1e-6f;
                    assert_true(fabsf(a - b) <= bound);
                }
            }
        }
    }
    /* A payload of another size is refused, never decoded. */
    assert_int_equal(kvd_codec_dequantize(f, &l, q, qb - 1, back), KV_ECORRUPT);
    free(img);
    free(back);
    free(q);
}

static void test_lossy_round_trip_within_bound(void **state) {
    (void)state;
    const kv_dtype dts[] = {KV_DTYPE_FP16, KV_DTYPE_BF16, KV_DTYPE_FP32};
    for (int i = 0; i < 3; i++) {
        for (int a = 0; a < 2; a++) {
            lossy_case(dts[i], a ? KV_BLOCK_MAJOR : KV_LAYER_MAJOR, KVD_TF_INT8);
            lossy_case(dts[i], a ? KV_BLOCK_MAJOR : KV_LAYER_MAJOR, KVD_TF_FP8);
        }
    }
}

static void test_lossy_refusals(void **state) {
    (void)state;
    kv_layout l;
    assert_int_equal(kv_layout_init(1, 1, 4, 2, KV_DTYPE_INT8, KV_LAYER_MAJOR, &l), KV_OK);
    assert_int_equal(kvd_codec_quantized_bytes(KVD_TF_INT8, &l), 0); /* 8-bit pools stay */
    uint8_t buf[256];
    assert_int_equal(kvd_codec_quantize(KVD_TF_INT8, &l, buf, buf), KV_EINVAL);
    assert_int_equal(kv_layout_init(1, 1, 4, 2, KV_DTYPE_FP16, KV_LAYER_MAJOR, &l), KV_OK);
    assert_int_equal(kvd_codec_quantized_bytes(KVD_TF_ZSTD, &l), 0);
    assert_int_equal(kvd_codec_quantize(KVD_TF_RAW, &l, buf, buf), KV_EINVAL);
    /* The lossless entry points refuse the lossy formats (they need the layout). */
    size_t len;
    kvd_tier_format used;
    assert_int_equal(kvd_codec_encode(KVD_TF_INT8, buf, 16, buf + 64, 64, &len, &used), KV_EINVAL);
    assert_int_equal(kvd_codec_decode(KVD_TF_FP8, buf, 16, buf + 64, 16), KV_EINVAL);
    assert_true(kvd_tier_format_lossy(KVD_TF_INT8) && kvd_tier_format_lossy(KVD_TF_FP8));
    assert_false(kvd_tier_format_lossy(KVD_TF_ZSTD));
    kvd_tier_format f;
    assert_int_equal(kvd_tier_format_parse("fp8", &f), KV_OK);
    assert_int_equal(f, KVD_TF_FP8);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_names),
        cmocka_unit_test(test_round_trip_floats),
        cmocka_unit_test(test_round_trip_compressible),
        cmocka_unit_test(test_incompressible_falls_back),
        cmocka_unit_test(test_bad_arguments),
        cmocka_unit_test(test_corrupt_input),
        cmocka_unit_test(test_lossy_round_trip_within_bound),
        cmocka_unit_test(test_lossy_refusals),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
