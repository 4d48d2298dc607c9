/* kvk_dtype: element conversions between float32 and the KV dtypes, shared by the CPU twins and
 * the CUDA kernels (compiled for both host and device), so both sides round the same way.
 *
 * fp16 is IEEE binary16; bf16 is the top half of binary32; fp8-e4m3 follows the OCP 8-bit
 * floating point spec (v1.0): bias 7, no infinities, one NaN per sign (S.1111.111), largest
 * finite 448. Float-to-small conversions round to nearest even. fp16 and bf16 keep infinities
 * and turn NaN into a quiet NaN of the same sign; fp8-e4m3 saturates: anything beyond +-448,
 * infinities included, becomes +-448 (NVIDIA's __NV_SATFINITE), and NaN stays NaN (0x7F/0xFF).
 * Pure functions; any thread.
 */
#ifndef KVK_DTYPE_H
#define KVK_DTYPE_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "common/kv_layout.h"

#ifdef __CUDACC__
#define KVK_HD __host__ __device__ __forceinline__
#else
#define KVK_HD static inline
#endif

/* Largest finite magnitudes of the 8-bit dtypes; quantization maps absmax onto these. */
#define KVK_FP8_E4M3_MAX 448.0f
#define KVK_INT8_MAX 127.0f

KVK_HD uint32_t kvk_f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    return u;
}

KVK_HD float kvk_bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

/* Bytes of one element of d; 0 for an unknown dtype. */
KVK_HD uint32_t kvk_elem_bytes(kv_dtype d) {
    switch (d) {
        case KV_DTYPE_FP16:
        case KV_DTYPE_BF16:
            return 2;
        case KV_DTYPE_FP32:
            return 4;
        case KV_DTYPE_FP8_E4M3:
        case KV_DTYPE_INT8:
            return 1;
    }
    return 0;
}

/* fp16 -> float: exact. */
KVK_HD float kvk_fp16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1fu;
    uint32_t m = h & 0x3ffu;
    if (e == 0) {
        /* zero or subnormal: m * 2^-24, exact in float */
        float v = (float)m * 5.9604644775390625e-8f;
        return kvk_bits_f32(kvk_f32_bits(v) | sign);
    }
    if (e == 31) {
        return kvk_bits_f32(sign | 0x7f800000u | (m << 13));
    }
    return kvk_bits_f32(sign | ((e + 112u) << 23) | (m << 13));
}

/* float -> fp16, round to nearest even; overflow gives infinity. */
KVK_HD uint16_t kvk_f32_to_fp16(float f) {
    uint32_t x = kvk_f32_bits(f);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    x &= 0x7fffffffu;
    if (x > 0x7f800000u) {
        return (uint16_t)(sign | 0x7e00u | ((x >> 13) & 0x3ffu)); /* quiet NaN */
    }
    if (x >= 0x477ff000u) { /* >= 65520 rounds past 65504 */
        return (uint16_t)(sign | 0x7c00u);
    }
    if (x < 0x38800000u) { /* below 2^-14: subnormal; scaling by 2^24 is exact */
        float a = kvk_bits_f32(x) * 16777216.0f;
        return (uint16_t)(sign | (uint16_t)rintf(a));
    }
    uint32_t h = ((x >> 23) - 112u) << 10 | ((x >> 13) & 0x3ffu);
    uint32_t rem = x & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) {
        h++; /* a carry into the exponent is the right answer */
    }
    return (uint16_t)(sign | h);
}

/* bf16 -> float: exact. */
KVK_HD float kvk_bf16_to_f32(uint16_t b) {
    return kvk_bits_f32((uint32_t)b << 16);
}

/* float -> bf16, round to nearest even. */
KVK_HD uint16_t kvk_f32_to_bf16(float f) {
    uint32_t x = kvk_f32_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) {
        return (uint16_t)((x >> 16) | 0x40u); /* quiet NaN */
    }
    x += 0x7fffu + ((x >> 16) & 1u);
    return (uint16_t)(x >> 16);
}

/* fp8-e4m3 -> float: exact. */
KVK_HD float kvk_fp8e4m3_to_f32(uint8_t q) {
    uint32_t sign = (uint32_t)(q & 0x80u) << 24;
    uint32_t e = (q >> 3) & 0xfu;
    uint32_t m = q & 0x7u;
    if (e == 15 && m == 7) {
        return kvk_bits_f32(sign | 0x7fc00000u);
    }
    if (e == 0) {
        float v = (float)m * 0.001953125f; /* m * 2^-9 */
        return kvk_bits_f32(kvk_f32_bits(v) | sign);
    }
    return kvk_bits_f32(sign | ((e + 120u) << 23) | (m << 20));
}

/* float -> fp8-e4m3, round to nearest even, saturating to +-448; NaN -> NaN. */
KVK_HD uint8_t kvk_f32_to_fp8e4m3(float f) {
    uint32_t x = kvk_f32_bits(f);
    uint8_t sign = (uint8_t)((x >> 24) & 0x80u);
    x &= 0x7fffffffu;
    if (x > 0x7f800000u) {
        return (uint8_t)(sign | 0x7fu);
    }
    if (x >= 0x43e00000u) { /* >= 448, infinity included */
        return (uint8_t)(sign | 0x7eu);
    }
    if (x < 0x3c800000u) { /* below 2^-6: subnormal; 8 * 2^-9 continues into the normals */
        float a = kvk_bits_f32(x) * 512.0f;
        return (uint8_t)(sign | (uint8_t)rintf(a));
    }
    uint32_t q = ((x >> 23) - 120u) << 3 | ((x >> 20) & 0x7u);
    uint32_t rem = x & 0xfffffu;
    if (rem > 0x80000u || (rem == 0x80000u && (q & 1u))) {
        q++; /* below 448 this never reaches the NaN code 0x7f */
    }
    return (uint8_t)(sign | q);
}

/* float -> int8 code for x already divided by its scale: rint, clamped to +-127. NaN -> 0. */
KVK_HD int8_t kvk_f32_to_int8(float x) {
    if (!(x == x)) {
        return 0;
    }
    float r = rintf(x);
    r = r > KVK_INT8_MAX ? KVK_INT8_MAX : r;
    r = r < -KVK_INT8_MAX ? -KVK_INT8_MAX : r;
    return (int8_t)r;
}

/* Reads element i of an array of dtype d as float (8-bit: the code, unscaled). */
KVK_HD float kvk_load_f32(kv_dtype d, const void *p, uint64_t i) {
    switch (d) {
        case KV_DTYPE_FP16:
            return kvk_fp16_to_f32(((const uint16_t *)p)[i]);
        case KV_DTYPE_BF16:
            return kvk_bf16_to_f32(((const uint16_t *)p)[i]);
        case KV_DTYPE_FP32:
            return ((const float *)p)[i];
        case KV_DTYPE_FP8_E4M3:
            return kvk_fp8e4m3_to_f32(((const uint8_t *)p)[i]);
        case KV_DTYPE_INT8:
            return (float)((const int8_t *)p)[i];
    }
    return 0.0f;
}

/* Writes v as element i of an array of dtype d (8-bit: v must already be divided by the scale). */
KVK_HD void kvk_store_f32(kv_dtype d, void *p, uint64_t i, float v) {
    switch (d) {
        case KV_DTYPE_FP16:
            ((uint16_t *)p)[i] = kvk_f32_to_fp16(v);
            break;
        case KV_DTYPE_BF16:
            ((uint16_t *)p)[i] = kvk_f32_to_bf16(v);
            break;
        case KV_DTYPE_FP32:
            ((float *)p)[i] = v;
            break;
        case KV_DTYPE_FP8_E4M3:
            ((uint8_t *)p)[i] = kvk_f32_to_fp8e4m3(v);
            break;
        case KV_DTYPE_INT8:
            ((int8_t *)p)[i] = kvk_f32_to_int8(v);
            break;
    }
}

#endif
