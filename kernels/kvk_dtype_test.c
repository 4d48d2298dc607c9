/* Exhaustive tests of the dtype conversions in kvk_dtype.h: every fp16, bf16 and fp8-e4m3 code
 * decodes to the value its fields say and encodes back to itself; midpoints between neighbours
 * round to the even code; fp8-e4m3 saturates and keeps NaN as the OCP FP8 spec (v1.0) and
 * NVIDIA's __NV_SATFINITE conversion define. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "kernels/kvk_dtype.h"

/* Value of a code with e exponent bits (bias b), m mantissa bits, computed with ldexp. */
static double decode_ref(uint32_t code, int ebits, int mbits, int bias) {
    uint32_t s = code >> (ebits + mbits);
    uint32_t e = (code >> mbits) & ((1u << ebits) - 1);
    uint32_t m = code & ((1u << mbits) - 1);
    double v = e == 0 ? ldexp((double)m, 1 - bias - mbits)
                      : ldexp((double)(m + (1u << mbits)), (int)e - bias - mbits);
    return s ? -v : v;
}

static void test_fp16_exhaustive(void **state) {
    (void)state;
    for (uint32_t h = 0; h < 65536; h++) {
        float f = kvk_fp16_to_f32((uint16_t)h);
        uint32_t e = (h >> 10) & 0x1f;
        if (e == 31) {
            if (h & 0x3ff) {
                assert_true(isnan(f));
                assert_true(isnan(kvk_fp16_to_f32(kvk_f32_to_fp16(f))));
            } else {
                assert_true(isinf(f));
                assert_int_equal(kvk_f32_to_fp16(f), h);
            }
            continue;
        }
        assert_true((double)f == decode_ref(h, 5, 10, 15));
        assert_int_equal(kvk_f32_to_fp16(f), h);
    }
}

static void test_fp16_rounding(void **state) {
    (void)state;
    /* Between each pair of neighbouring positive finite codes: the midpoint goes to the even
     * code, a hair above it to the upper code, a hair below to the lower. */
    for (uint32_t h = 0; h < 0x7bff; h++) {
        double lo = decode_ref(h, 5, 10, 15);
        double hi = decode_ref(h + 1, 5, 10, 15);
        float mid = (float)((lo + hi) / 2); /* exact in float */
        uint16_t even = (h & 1) ? (uint16_t)(h + 1) : (uint16_t)h;
        assert_int_equal(kvk_f32_to_fp16(mid), even);
        assert_int_equal(kvk_f32_to_fp16(nextafterf(mid, INFINITY)), h + 1);
        assert_int_equal(kvk_f32_to_fp16(nextafterf(mid, 0)), h);
        assert_int_equal(kvk_f32_to_fp16(-mid), even | 0x8000);
    }
    assert_int_equal(kvk_f32_to_fp16(65504.0f), 0x7bff);
    assert_int_equal(kvk_f32_to_fp16(65519.99f), 0x7bff);
    assert_int_equal(kvk_f32_to_fp16(65520.0f), 0x7c00);
    assert_int_equal(kvk_f32_to_fp16(1e30f), 0x7c00);
    assert_int_equal(kvk_f32_to_fp16(-1e30f), 0xfc00);
    assert_int_equal(kvk_f32_to_fp16(1e-30f), 0x0000);
    assert_int_equal(kvk_f32_to_fp16(-0.0f), 0x8000);
    assert_true(isnan(kvk_fp16_to_f32(kvk_f32_to_fp16(NAN))));
}

static void test_bf16_exhaustive(void **state) {
    (void)state;
    for (uint32_t b = 0; b < 65536; b++) {
        float f = kvk_bf16_to_f32((uint16_t)b);
        if (isnan(f)) {
            assert_true(isnan(kvk_bf16_to_f32(kvk_f32_to_bf16(f))));
            continue;
        }
        assert_int_equal(kvk_f32_to_bf16(f), b);
        if (!isinf(f)) {
            assert_true((double)f == decode_ref(b, 8, 7, 127));
        }
    }
    /* 1 + 2^-8 is the midpoint of 1 (even) and 1 + 2^-7. */
    assert_int_equal(kvk_f32_to_bf16(1.00390625f), 0x3f80);
    assert_int_equal(kvk_f32_to_bf16(nextafterf(1.00390625f, 2.0f)), 0x3f81);
    assert_int_equal(kvk_f32_to_bf16(1.01171875f), 0x3f82); /* midpoint of 0x3f81, 0x3f82 */
    assert_int_equal(kvk_f32_to_bf16(3.4e38f), 0x7f80);     /* rounds past the largest finite */
}

static void test_fp8_e4m3_codes(void **state) {
    (void)state;
    for (uint32_t q = 0; q < 256; q++) {
        float f = kvk_fp8e4m3_to_f32((uint8_t)q);
        if ((q & 0x7f) == 0x7f) {
            assert_true(isnan(f)); /* S.1111.111 is the only NaN; no infinities */
            assert_int_equal(kvk_f32_to_fp8e4m3(f) & 0x7f, 0x7f);
            continue;
        }
        assert_true((double)f == decode_ref(q, 4, 3, 7));
        assert_int_equal(kvk_f32_to_fp8e4m3(f), q);
    }
    assert_true(kvk_fp8e4m3_to_f32(0x7e) == 448.0f);
    assert_true(kvk_fp8e4m3_to_f32(0x01) == 0.001953125f); /* 2^-9 */
    assert_true(kvk_fp8e4m3_to_f32(0x08) == 0.015625f);    /* 2^-6, smallest normal */
}

static void test_fp8_e4m3_rounding_and_saturation(void **state) {
    (void)state;
    for (uint32_t q = 0; q < 0x7e; q++) {
        double lo = decode_ref(q, 4, 3, 7);
        double hi = decode_ref(q + 1, 4, 3, 7);
        float mid = (float)((lo + hi) / 2);
        uint8_t even = (q & 1) ? (uint8_t)(q + 1) : (uint8_t)q;
        assert_int_equal(kvk_f32_to_fp8e4m3(mid), even);
        assert_int_equal(kvk_f32_to_fp8e4m3(nextafterf(mid, INFINITY)), q + 1);
        assert_int_equal(kvk_f32_to_fp8e4m3(nextafterf(mid, 0)), q);
        assert_int_equal(kvk_f32_to_fp8e4m3(-mid), even | 0x80);
    }
    /* Saturation: beyond 448 (even past the 464 midpoint towards 480) is 448. */
    assert_int_equal(kvk_f32_to_fp8e4m3(448.0f), 0x7e);
    assert_int_equal(kvk_f32_to_fp8e4m3(449.0f), 0x7e);
    assert_int_equal(kvk_f32_to_fp8e4m3(464.0f), 0x7e);
    assert_int_equal(kvk_f32_to_fp8e4m3(1e9f), 0x7e);
    assert_int_equal(kvk_f32_to_fp8e4m3(INFINITY), 0x7e);
    assert_int_equal(kvk_f32_to_fp8e4m3(-INFINITY), 0xfe);
    assert_int_equal(kvk_f32_to_fp8e4m3(-500.0f), 0xfe);
    assert_int_equal(kvk_f32_to_fp8e4m3(NAN), 0x7f);
    assert_int_equal(kvk_f32_to_fp8e4m3(-NAN), 0xff);
    /* Underflow: below half of 2^-9 is zero, the midpoint rounds to even (zero). */
    assert_int_equal(kvk_f32_to_fp8e4m3(0.0009765625f), 0x00);
    assert_int_equal(kvk_f32_to_fp8e4m3(0.001f), 0x01);
    assert_int_equal(kvk_f32_to_fp8e4m3(-0.0f), 0x80);
}

static void test_int8_codes(void **state) {
    (void)state;
    assert_int_equal(kvk_f32_to_int8(0.5f), 0); /* ties to even */
    assert_int_equal(kvk_f32_to_int8(1.5f), 2);
    assert_int_equal(kvk_f32_to_int8(-2.5f), -2);
    assert_int_equal(kvk_f32_to_int8(126.6f), 127);
    assert_int_equal(kvk_f32_to_int8(1000.0f), 127);
    assert_int_equal(kvk_f32_to_int8(-1000.0f), -127);
    assert_int_equal(kvk_f32_to_int8(NAN), 0);
    for (int i = -127; i <= 127; i++) {
        assert_int_equal(kvk_f32_to_int8((float)i), i);
        assert_true(kvk_load_f32(KV_DTYPE_INT8, &(int8_t){(int8_t)i}, 0) == (float)i);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fp16_exhaustive),
        cmocka_unit_test(test_fp16_rounding),
        cmocka_unit_test(test_bf16_exhaustive),
        cmocka_unit_test(test_fp8_e4m3_codes),
        cmocka_unit_test(test_fp8_e4m3_rounding_and_saturation),
        cmocka_unit_test(test_int8_codes),
    };
    return cmocka_run_group_tests_name("kvk_dtype", tests, NULL, NULL);
}
