/* kvk_simd_avx512: the vector CPU kernels of kvk_simd_body.h compiled for AVX-512F (16 float lanes
 * for the dot products and the V sums; conversions as in the AVX2 build). Only the functions of
 * this file are built for that instruction set (GCC target pragma), so the rest of the binary runs
 * on any x86-64; kvk_cpu.c calls this table only when CPUID has it.
 */
#if defined(__x86_64__) && defined(__GNUC__)
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kernels/kvk_dtype.h"
#include "kernels/kvk_internal.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma,f16c")
#include <immintrin.h>

#define KVK_W 16
#include "kernels/kvk_simd_body.h"

#pragma GCC pop_options

const kvk__simd_ops kvk__simd_avx512 = {
    .name = "avx512",
    .to_f32 = simd_to_f32,
    .from_f32 = simd_from_f32,
    .absmax = simd_absmax,
    .attend = simd_attend,
    .copy_nt = simd_copy_nt,
};
#endif
