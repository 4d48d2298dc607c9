/* kvk_simd_body: the vector CPU kernels, written once and compiled per instruction set by
 * kvk_simd_avx2.c (KVK_W 8: __m256) and kvk_simd_avx512.c (KVK_W 16: __m512), each of which
 * includes this file between `#pragma GCC target` push/pop and exports one kvk__simd_ops table.
 * Nothing else may include it.
 *
 * Element conversions work 8 lanes at a time in both builds (they are bound by memory, not by
 * width) and are byte-exact against kvk_dtype.h: fp16 through F16C, bf16 and fp8-e4m3 encoding
 * with integer lanes that repeat the scalar rounding step for step, fp8 decoding by moving the
 * code's bits into an fp16 (exponent and mantissa line up after a shift; the missing 2^8 of the
 * bias difference is an exact multiply), so no float subnormal is ever an operand.
 *
 * Attention (kvk__attn_task): a tile of 8 tokens at a time, each K and V row converted once to
 * float32 (times its block's scale) and then used by every query vector of the task (the GQA group,
 * times the query rows in prefill), scores in base 2 with an online softmax per query vector.
 * That path is vectorised across the query vectors (one lane each, KVK_W of them per vector):
 * the queries and the output accumulators are kept transposed ([dim][query]), so a score is an
 * FMA of a broadcast K element with a vector of query elements, summed over the dims in order,
 * the softmax's max, rescale and sum are lane-wise, and V goes in the same way. No horizontal
 * sum, no per-query scalar softmax: the work per (query, token) is what a matmul does.
 * Decode-sized tasks (<= KVK__ATTN_DIRECT_NQ query vectors per KV head, head_dim a multiple of
 * KVK_W) take the direct path instead (attend_direct): no float32 copy of K or V, the 8-bit scale
 * applied per dot product, and several KV heads per task so each token's rows are one run.
 */
#ifndef KVK_W
#error "kvk_simd_body.h is included by kvk_simd_avx2.c / kvk_simd_avx512.c only"
#endif

#if KVK_W == 8
typedef __m256 vf;
#define VLOAD(p) _mm256_load_ps(p)
#define VSTORE(p, v) _mm256_store_ps((p), (v))
#define VFMA(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#define VMUL(a, b) _mm256_mul_ps((a), (b))
#define VSET1(x) _mm256_set1_ps(x)
#define VZERO() _mm256_setzero_ps()
#define VTO8(v) (v)
typedef __m256i vi;
#define VILOAD(p) _mm256_load_si256((const __m256i *)(p))
#define VISET1(x) _mm256_set1_epi32(x)
/* (a < b lane by lane, int32) ? x : y */
#define VSEL_LT(a, b, x, y)                                                                        \
    _mm256_blendv_ps((y), (x), _mm256_castsi256_ps(_mm256_cmpgt_epi32((b), (a))))
#define VMAX(a, b) _mm256_max_ps((a), (b))
#define VSUB(a, b) _mm256_sub_ps((a), (b))
#define VADD(a, b) _mm256_add_ps((a), (b))
#else
typedef __m512 vf;
#define VLOAD(p) _mm512_load_ps(p)
#define VSTORE(p, v) _mm512_store_ps((p), (v))
#define VFMA(a, b, c) _mm512_fmadd_ps((a), (b), (c))
#define VMUL(a, b) _mm512_mul_ps((a), (b))
#define VSET1(x) _mm512_set1_ps(x)
#define VZERO() _mm512_setzero_ps()
typedef __m512i vi;
#define VILOAD(p) _mm512_load_si512((const void *)(p))
#define VISET1(x) _mm512_set1_epi32(x)
#define VSEL_LT(a, b, x, y) _mm512_mask_blend_ps(_mm512_cmpgt_epi32_mask((b), (a)), (y), (x))
#define VMAX(a, b) _mm512_max_ps((a), (b))
#define VSUB(a, b) _mm512_sub_ps((a), (b))
#define VADD(a, b) _mm512_add_ps((a), (b))
/* Folds 16 lanes into 8 (sums of lane pairs i, i + 8). */
#define VTO8(v)                                                                                    \
    _mm256_add_ps(_mm512_castps512_ps256(v),                                                       \
                  _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)))
#endif

/* ---- 8-lane helpers -------------------------------------------------------------------------- */

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float hmax8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The four horizontal sums of a0..a3 in one __m128. */
static inline __m128 hsum4x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* 2^x for x <= 0 (scores minus their running max); 0 below -126, for -inf and for NaN.
 * Degree-7 Taylor polynomial of 2^f on |f| <= 1/2: relative error below 1e-8 before rounding. */
static inline __m256 exp2_8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-126.0f);
    __m256 xc = _mm256_max_ps(x, lo);
    __m256 n = _mm256_round_ps(xc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 f = _mm256_sub_ps(xc, n);
    __m256 p = _mm256_set1_ps(1.5252733804059841e-05f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.5403530393381606e-04f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.3333558146428443e-03f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(9.6181291076284772e-03f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(5.5504108664821580e-02f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(2.4022650695910071e-01f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(6.9314718055994531e-01f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    __m256i e =
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    __m256 r = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
    return _mm256_and_ps(r, _mm256_cmp_ps(x, lo, _CMP_GE_OQ));
}

/* exp2_8 at the full vector width (the same polynomial, so the same values lane by lane). */
#if KVK_W == 8
static inline vf exp2_v(vf x) {
    return exp2_8(x);
}
#else
static inline vf exp2_v(vf x) {
    const __m512 lo = _mm512_set1_ps(-126.0f);
    __m512 xc = _mm512_max_ps(x, lo);
    __m512 n = _mm512_roundscale_ps(xc, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(xc, n);
    __m512 p = _mm512_set1_ps(1.5252733804059841e-05f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530393381606e-04f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-03f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-03f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-02f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    __m512i e =
        _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    __m512 r = _mm512_mul_ps(p, _mm512_castsi512_ps(e));
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ), r);
}
#endif

/* Eight fp8-e4m3 codes as the fp16 numbers code / 256 (exact); NaN codes as fp16 NaN 0x7e00. */
static inline __m128i fp8_to_half8(const void *p) {
    __m128i x = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p));
    __m128i mag = _mm_and_si128(x, _mm_set1_epi16(0x7f));
    __m128i sign = _mm_slli_epi16(_mm_and_si128(x, _mm_set1_epi16(0x80)), 8);
    __m128i h = _mm_slli_epi16(mag, 7);
    __m128i nan = _mm_cmpeq_epi16(mag, _mm_set1_epi16(0x7f));
    h = _mm_or_si128(_mm_andnot_si128(nan, h), _mm_and_si128(nan, _mm_set1_epi16(0x7e00)));
    return _mm_or_si128(h, sign);
}

/* Eight 32-bit lanes holding values 0..255 (u8) or -128..127 (s8), stored as 8 bytes. */
static inline void store_bytes8(void *p, __m256i v, int is_signed) {
    __m256i w = is_signed ? _mm256_packs_epi32(v, v) : _mm256_packus_epi32(v, v);
    w = is_signed ? _mm256_packs_epi16(w, w) : _mm256_packus_epi16(w, w);
    __m128i r = _mm_unpacklo_epi32(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
    _mm_storel_epi64((__m128i *)p, r);
}

/* float -> bf16, as kvk_f32_to_bf16. */
static inline __m128i f32_to_bf16_8(__m256 x) {
    __m256i xi = _mm256_castps_si256(x);
    __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(xi, _mm256_set1_epi32(0x7fffffff)),
                                     _mm256_set1_epi32(0x7f800000));
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(xi, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(xi, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd));
    r = _mm256_srli_epi32(r, 16);
    __m256i q = _mm256_or_si256(_mm256_srli_epi32(xi, 16), _mm256_set1_epi32(0x40));
    r = _mm256_blendv_epi8(r, q, nan);
    r = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    return _mm256_castsi256_si128(r);
}

/* float -> fp8-e4m3 codes in 32-bit lanes, as kvk_f32_to_fp8e4m3. */
static inline __m256i f32_to_fp8_8(__m256 x) {
    __m256i xi = _mm256_castps_si256(x);
    __m256i sign = _mm256_and_si256(_mm256_srli_epi32(xi, 24), _mm256_set1_epi32(0x80));
    __m256i a = _mm256_and_si256(xi, _mm256_set1_epi32(0x7fffffff));
    __m256i nan = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7f800000));
    __m256i sat = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x43dfffff));
    __m256i sub = _mm256_cmpgt_epi32(_mm256_set1_epi32(0x3c800000), a);
    /* Subnormal codes: a * 2^9 rounded to nearest even (the current rounding mode, as rintf). */
    __m256i subc =
        _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_castsi256_ps(a), _mm256_set1_ps(512.0f)));
    __m256i q = _mm256_or_si256(
        _mm256_slli_epi32(_mm256_sub_epi32(_mm256_srli_epi32(a, 23), _mm256_set1_epi32(120)), 3),
        _mm256_and_si256(_mm256_srli_epi32(a, 20), _mm256_set1_epi32(7)));
    __m256i rem = _mm256_and_si256(a, _mm256_set1_epi32(0xfffff));
    __m256i half = _mm256_set1_epi32(0x80000);
    __m256i one = _mm256_set1_epi32(1);
    __m256i up =
        _mm256_or_si256(_mm256_cmpgt_epi32(rem, half),
                        _mm256_and_si256(_mm256_cmpeq_epi32(rem, half),
                                         _mm256_cmpeq_epi32(_mm256_and_si256(q, one), one)));
    q = _mm256_sub_epi32(q, up); /* up is all ones: + 1 */
    q = _mm256_blendv_epi8(q, subc, sub);
    q = _mm256_blendv_epi8(q, _mm256_set1_epi32(0x7e), sat);
    q = _mm256_blendv_epi8(q, _mm256_set1_epi32(0x7f), nan);
    return _mm256_or_si256(q, sign);
}

/* float (already divided by the scale) -> int8 codes in 32-bit lanes, as kvk_f32_to_int8. */
static inline __m256i f32_to_int8_8(__m256 x) {
    __m256 r = _mm256_round_ps(x, _MM_FROUND_CUR_DIRECTION);
    r = _mm256_max_ps(r, _mm256_set1_ps(-KVK_INT8_MAX));
    r = _mm256_min_ps(r, _mm256_set1_ps(KVK_INT8_MAX));
    r = _mm256_and_ps(r, _mm256_cmp_ps(x, x, _CMP_ORD_Q)); /* NaN -> 0 */
    return _mm256_cvttps_epi32(r);
}

/* ---- Conversions (kvk__simd_ops) ------------------------------------------------------------- */

/* Stores x * m, or x itself when m is 1 (a multiply would quiet a signalling NaN, and the
 * twins never multiply then). */
#define STORE_MUL(p, x) _mm256_storeu_ps((p), scale ? _mm256_mul_ps((x), m) : (x))

/* F16C quiets a signalling fp16 NaN; the twin keeps it signalling. Clears the quiet bit of the
 * lanes whose fp16 input h was a signalling NaN (exact conversions only). */
static inline __m256 keep_snan(__m256 x, __m128i h) {
    __m128i e = _mm_cmpeq_epi16(_mm_and_si128(h, _mm_set1_epi16(0x7e00)), _mm_set1_epi16(0x7c00));
    __m128i m = _mm_andnot_si128(
        _mm_cmpeq_epi16(_mm_and_si128(h, _mm_set1_epi16(0x1ff)), _mm_setzero_si128()), e);
    __m256i w = _mm256_and_si256(_mm256_cvtepi16_epi32(m), _mm256_set1_epi32(0x00400000));
    return _mm256_castsi256_ps(_mm256_andnot_si256(w, _mm256_castps_si256(x)));
}

/* dst = src * mul (see kvk__simd_ops.to_f32); exact: NaN payloads as the twin's too. */
static inline void load_row(kv_dtype d, const void *src, uint64_t n, float mul, float *dst,
                            int exact) {
    uint64_t i = 0;
    const char *s = src;
    int scale = mul != 1.0f;
    __m256 m = _mm256_set1_ps(mul);
    switch (d) {
        case KV_DTYPE_FP32:
            for (; i + 8 <= n; i += 8) {
                STORE_MUL(dst + i, _mm256_loadu_ps((const float *)s + i));
            }
            break;
        case KV_DTYPE_FP16:
            for (; i + 8 <= n; i += 8) {
                __m128i h = _mm_loadu_si128((const __m128i *)(s + 2 * i));
                __m256 x = _mm256_cvtph_ps(h);
                STORE_MUL(dst + i, exact ? keep_snan(x, h) : x);
            }
            break;
        case KV_DTYPE_BF16:
            for (; i + 8 <= n; i += 8) {
                __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(s + 2 * i)));
                STORE_MUL(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
            }
            break;
        case KV_DTYPE_INT8:
            for (; i + 8 <= n; i += 8) {
                __m256i w = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(s + i)));
                STORE_MUL(dst + i, _mm256_cvtepi32_ps(w));
            }
            break;
        case KV_DTYPE_FP8_E4M3: {
            /* code = half * 256 exactly; (half * 256) * mul == half * (256 * mul): one rounding
             * (NaN codes give the twin's 0x7fc00000 either way). */
            __m256 m256 = _mm256_set1_ps(mul * 256.0f);
            for (; i + 8 <= n; i += 8) {
                __m256 x = _mm256_cvtph_ps(fp8_to_half8(s + i));
                _mm256_storeu_ps(dst + i, _mm256_mul_ps(x, m256));
            }
            break;
        }
    }
    for (; i < n; i++) {
        float x = kvk_load_f32(d, src, i);
        dst[i] = scale ? x * mul : x;
    }
}
#undef STORE_MUL

static void simd_to_f32(kv_dtype d, const void *src, uint64_t n, float mul, float *dst) {
    load_row(d, src, n, mul, dst, 1);
}

static void simd_from_f32(kv_dtype d, const float *src, uint64_t n, float div, void *dst) {
    uint64_t i = 0;
    char *o = dst;
    int divide = div != 1.0f;
    __m256 dv = _mm256_set1_ps(div);
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_loadu_ps(src + i);
        if (divide) {
            x = _mm256_div_ps(x, dv); /* divide, not multiply by 1/div: the twins divide */
        }
        switch (d) {
            case KV_DTYPE_FP32:
                _mm256_storeu_ps((float *)o + i, x);
                break;
            case KV_DTYPE_FP16:
                _mm_storeu_si128((__m128i *)(o + 2 * i),
                                 _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
                break;
            case KV_DTYPE_BF16:
                _mm_storeu_si128((__m128i *)(o + 2 * i), f32_to_bf16_8(x));
                break;
            case KV_DTYPE_INT8:
                store_bytes8(o + i, f32_to_int8_8(x), 1);
                break;
            case KV_DTYPE_FP8_E4M3:
                store_bytes8(o + i, f32_to_fp8_8(x), 0);
                break;
        }
    }
    for (; i < n; i++) {
        kvk_store_f32(d, dst, i, divide ? src[i] / div : src[i]);
    }
}

static float simd_absmax(const float *src, uint64_t n) {
    uint64_t i = 0;
    __m256 m = _mm256_setzero_ps();
    const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (; i + 8 <= n; i += 8) {
        /* max(x, m) gives m when x is NaN: NaN is skipped, as the twin's x > m test does. */
        m = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(src + i), abs), m);
    }
    float r = hmax8(m);
    for (; i < n; i++) {
        float x = fabsf(src[i]);
        r = x > r ? x : r;
    }
    return r;
}

/* kvk__simd_ops.copy_nt: 32-byte loads and non-temporal stores (256-bit in both builds: 512-bit
 * stores measured no faster here), the aligned middle in four interleaved quarters of 128-byte
 * steps (docs/KERNELS.md, "Tier copies"); the unaligned head and the tail through memcpy. */
static void simd_copy_nt(void *to_, const void *from_, size_t n) {
    char *to = to_;
    const char *from = from_;
    size_t head = (32 - ((uintptr_t)to & 31)) & 31;
    head = head < n ? head : n;
    memcpy(to, from, head);
    to += head;
    from += head;
    n -= head;
    size_t q = n / 512 * 128; /* each quarter: a multiple of 128 bytes */
    for (size_t o = 0; o < q; o += 128) {
        for (int k = 0; k < 4; k++) {
            const char *f = from + (size_t)k * q + o;
            char *t = to + (size_t)k * q + o;
            __builtin_prefetch(f + 512);
            __builtin_prefetch(f + 576);
            __m256i a = _mm256_loadu_si256((const __m256i *)f);
            __m256i b = _mm256_loadu_si256((const __m256i *)(f + 32));
            __m256i c = _mm256_loadu_si256((const __m256i *)(f + 64));
            __m256i d = _mm256_loadu_si256((const __m256i *)(f + 96));
            _mm256_stream_si256((__m256i *)t, a);
            _mm256_stream_si256((__m256i *)(t + 32), b);
            _mm256_stream_si256((__m256i *)(t + 64), c);
            _mm256_stream_si256((__m256i *)(t + 96), d);
        }
    }
    memcpy(to + 4 * q, from + 4 * q, n - 4 * q);
}

/* ---- Attention (kvk__simd_ops.attend) ---------------------------------------------------------
 */

/* ---- Direct attention path: K and V converted in registers ------------------------------------
 * Used when head_dim is a multiple of the vector width and a task has at most 8 query vectors
 * (decode with GQA <= 8): the query vectors stay in L1 and every K or V vector is converted
 * from the cache straight into a register, used by up to 4 query vectors, and never stored.
 * The 8-bit scale is applied once per (token, query vector) to the finished dot product, and
 * folded into the probability for V, instead of once per element. fp8 converts to code / 256
 * (the fp16 trick of fp8_to_half8, no multiply); the 256 goes into that scale. */

#define KVK_ALWAYS_INLINE inline __attribute__((always_inline))

#if KVK_W == 16
/* Sixteen fp8-e4m3 codes as the fp16 numbers code / 256 (the bits of fp8_to_half8; NaN codes
 * as fp16 NaN 0x7f80 with the code's sign). The code in the high byte of a 16-bit lane, shifted
 * right arithmetically by one, is sign.sign.magnitude.0000000: clearing bit 14 leaves the fp16. */
static KVK_ALWAYS_INLINE __m256i fp8_to_half16(const void *p) {
    __m256i x = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
    __m256i h = _mm256_and_si256(_mm256_srai_epi16(_mm256_slli_epi16(x, 8), 1),
                                 _mm256_set1_epi16((short)0xbfff));
    __m256i nan = _mm256_cmpeq_epi16(_mm256_and_si256(h, _mm256_set1_epi16(0x3f80)),
                                     _mm256_set1_epi16(0x3f80));
    return _mm256_or_si256(h, _mm256_and_si256(nan, _mm256_set1_epi16(0x7e00)));
}
#endif

/* KVK_W elements of dtype d at p as floats (8-bit: the code; fp8: code / 256). */
static KVK_ALWAYS_INLINE vf load_conv(kv_dtype d, const char *p) {
#if KVK_W == 16
    switch (d) {
        case KV_DTYPE_FP16:
            return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
        case KV_DTYPE_BF16:
            return _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
        case KV_DTYPE_INT8:
            return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
        case KV_DTYPE_FP8_E4M3:
            return _mm512_cvtph_ps(fp8_to_half16(p));
        default:
            return _mm512_loadu_ps((const float *)p);
    }
#else
    switch (d) {
        case KV_DTYPE_FP16:
            return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
        case KV_DTYPE_BF16:
            return _mm256_castsi256_ps(
                _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
        case KV_DTYPE_INT8:
            return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
        case KV_DTYPE_FP8_E4M3:
            return _mm256_cvtph_ps(fp8_to_half8(p));
        default:
            return _mm256_loadu_ps((const float *)p);
    }
#endif
}

/* Scores of query vectors q (nb of them, rows dimp apart) with the tile's ntok K rows, times
 * ks[t] when scaled: sp[b * T + t]. Two tokens at a time share each query load. */
static KVK_ALWAYS_INLINE void scores_direct(kv_dtype d, uint32_t nb, const char *const *krow,
                                            const float *ks, int scaled, uint32_t ntok,
                                            const float *q, uint32_t dimp, uint32_t dim,
                                            float *sp) {
    enum { T = KVK__ATTN_TILE };
    const uint32_t eb = kvk_elem_bytes(d);
    uint32_t t = 0;
    for (; t + 2 <= ntok; t += 2) {
        vf a0[4], a1[4];
#pragma GCC unroll 4
        for (uint32_t b = 0; b < nb; b++) {
            a0[b] = VZERO();
            a1[b] = VZERO();
        }
        const char *k0 = krow[t], *k1 = krow[t + 1];
        for (uint32_t j = 0; j < dim; j += KVK_W) {
            vf x0 = load_conv(d, k0 + j * eb), x1 = load_conv(d, k1 + j * eb);
#pragma GCC unroll 4
            for (uint32_t b = 0; b < nb; b++) {
                vf qv = VLOAD(q + b * dimp + j);
                a0[b] = VFMA(qv, x0, a0[b]);
                a1[b] = VFMA(qv, x1, a1[b]);
            }
        }
        float d0[4], d1[4];
        if (nb == 4) {
            __m128 s0 = hsum4x8(VTO8(a0[0]), VTO8(a0[1]), VTO8(a0[2]), VTO8(a0[3]));
            __m128 s1 = hsum4x8(VTO8(a1[0]), VTO8(a1[1]), VTO8(a1[2]), VTO8(a1[3]));
            if (scaled) {
                s0 = _mm_mul_ps(s0, _mm_set1_ps(ks[t]));
                s1 = _mm_mul_ps(s1, _mm_set1_ps(ks[t + 1]));
            }
            _mm_storeu_ps(d0, s0);
            _mm_storeu_ps(d1, s1);
        } else {
#pragma GCC unroll 4
            for (uint32_t b = 0; b < nb; b++) {
                d0[b] = hsum8(VTO8(a0[b]));
                d1[b] = hsum8(VTO8(a1[b]));
                if (scaled) {
                    d0[b] *= ks[t];
                    d1[b] *= ks[t + 1];
                }
            }
        }
#pragma GCC unroll 4
        for (uint32_t b = 0; b < nb; b++) {
            sp[b * T + t] = d0[b];
            sp[b * T + t + 1] = d1[b];
        }
    }
    if (t < ntok) {
        vf a0[4];
#pragma GCC unroll 4
        for (uint32_t b = 0; b < nb; b++) {
            a0[b] = VZERO();
        }
        for (uint32_t j = 0; j < dim; j += KVK_W) {
            vf x0 = load_conv(d, krow[t] + j * eb);
#pragma GCC unroll 4
            for (uint32_t b = 0; b < nb; b++) {
                a0[b] = VFMA(VLOAD(q + b * dimp + j), x0, a0[b]);
            }
        }
#pragma GCC unroll 4
        for (uint32_t b = 0; b < nb; b++) {
            float s = hsum8(VTO8(a0[b]));
            sp[b * T + t] = scaled ? s * ks[t] : s;
        }
    }
}

/* acc[b] = acc[b] * alpha[b] + sum over t < ntok of pw[b][t] * v[t] for nb query vectors, V
 * converted in registers (pw: probabilities times the V scale). */
static KVK_ALWAYS_INLINE void values_direct(kv_dtype d, uint32_t nb, float *acc, const float *alpha,
                                            const float *pw, const char *const *vrow, uint32_t ntok,
                                            uint32_t dimp, uint32_t dim) {
    enum { T = KVK__ATTN_TILE };
    const uint32_t eb = kvk_elem_bytes(d);
    vf s[4];
#pragma GCC unroll 4
    for (uint32_t b = 0; b < nb; b++) {
        s[b] = VSET1(alpha[b]);
    }
    for (uint32_t j = 0; j < dim; j += KVK_W) {
        vf a[4];
#pragma GCC unroll 4
        for (uint32_t b = 0; b < nb; b++) {
            a[b] = VMUL(VLOAD(acc + b * dimp + j), s[b]);
        }
        for (uint32_t t = 0; t < ntok; t++) {
            vf v = load_conv(d, vrow[t] + j * eb);
#pragma GCC unroll 4
            for (uint32_t b = 0; b < nb; b++) {
                a[b] = VFMA(VSET1(pw[b * T + t]), v, a[b]);
            }
        }
#pragma GCC unroll 4
        for (uint32_t b = 0; b < nb; b++) {
            VSTORE(acc + b * dimp + j, a[b]);
        }
    }
}

/* One instance per (dtype, group of nb query vectors), so every switch above folds away. */
#define KVK_DIRECT_NB(d, nb, call)                                                                 \
    switch (nb) {                                                                                  \
        case 1:                                                                                    \
            call(d, 1);                                                                            \
            break;                                                                                 \
        case 2:                                                                                    \
            call(d, 2);                                                                            \
            break;                                                                                 \
        case 3:                                                                                    \
            call(d, 3);                                                                            \
            break;                                                                                 \
        default:                                                                                   \
            call(d, 4);                                                                            \
            break;                                                                                 \
    }
#define KVK_DIRECT(dt, nb, call)                                                                   \
    switch (dt) {                                                                                  \
        case KV_DTYPE_FP16:                                                                        \
            KVK_DIRECT_NB(KV_DTYPE_FP16, nb, call);                                                \
            break;                                                                                 \
        case KV_DTYPE_BF16:                                                                        \
            KVK_DIRECT_NB(KV_DTYPE_BF16, nb, call);                                                \
            break;                                                                                 \
        case KV_DTYPE_INT8:                                                                        \
            KVK_DIRECT_NB(KV_DTYPE_INT8, nb, call);                                                \
            break;                                                                                 \
        case KV_DTYPE_FP8_E4M3:                                                                    \
            KVK_DIRECT_NB(KV_DTYPE_FP8_E4M3, nb, call);                                            \
            break;                                                                                 \
        default:                                                                                   \
            KVK_DIRECT_NB(KV_DTYPE_FP32, nb, call);                                                \
            break;                                                                                 \
    }

static void scores_tile(kv_dtype dt, uint32_t nb, const char *const *krow, const float *ks,
                        int scaled, uint32_t ntok, const float *q, uint32_t dimp, uint32_t dim,
                        float *sp) {
#define KVK_SC(d, n) scores_direct(d, n, krow, ks, scaled, ntok, q, dimp, dim, sp)
    KVK_DIRECT(dt, nb, KVK_SC);
#undef KVK_SC
}

static void values_tile(kv_dtype dt, uint32_t nb, float *acc, const float *alpha, const float *pw,
                        const char *const *vrow, uint32_t ntok, uint32_t dimp, uint32_t dim) {
#define KVK_VA(d, n) values_direct(d, n, acc, alpha, pw, vrow, ntok, dimp, dim)
    KVK_DIRECT(dt, nb, KVK_VA);
#undef KVK_VA
}

/* One tile of the online softmax for n query vectors (both attention paths): the scores
 * sp[k * T .. k * T + T) of tokens t0.., ntok of them real, become 2^(s - max) with the tokens
 * past each vector's length masked; mx and sum carry each vector's running max and sum, and
 * alpha[k] gets the factor its accumulator is rescaled by. */
static inline void softmax_tile(float *sp, uint32_t n, const uint32_t *lens, uint32_t t0,
                                uint32_t ntok, float *mx, float *sum, float *alpha) {
    enum { T = KVK__ATTN_TILE };
    for (uint32_t k = 0; k < n; k++) {
        float *s = sp + (size_t)k * T;
        uint32_t see = lens[k] <= t0 ? 0 : lens[k] - t0;
        see = see < ntok ? see : ntok;
        for (uint32_t t = see; t < T; t++) {
            s[t] = -INFINITY;
        }
        if (see == 0) {
            alpha[k] = 1.0f; /* p is all zeros: acc unchanged */
            _mm256_storeu_ps(s, _mm256_setzero_ps());
            continue;
        }
        __m256 sv = _mm256_loadu_ps(s);
        float mnew = hmax8(sv);
        mnew = mnew > mx[k] ? mnew : mx[k];
        /* The max seldom moves after the first tiles: 2^0 is 1 without the call. */
        float a = mx[k] == -INFINITY ? 0.0f : mnew == mx[k] ? 1.0f : exp2f(mx[k] - mnew);
        __m256 pv = exp2_8(_mm256_sub_ps(sv, _mm256_set1_ps(mnew)));
        _mm256_storeu_ps(s, pv);
        sum[k] = sum[k] * a + hsum8(pv);
        mx[k] = mnew;
        alpha[k] = a;
    }
}

/* The direct path: tasks of up to KVK__ATTN_DIRECT_NQ query vectors per KV head and
 * tk->nheads consecutive KV heads (nheads * nq <= KVK__ATTN_QMAX), K and V converted in registers
 * (scores_direct, values_direct). The heads are processed tile by tile together, so each
 * token's rows of those heads are read as one contiguous run and every block is walked front to
 * back: the hardware prefetcher follows that, where it cannot follow one head's rows a token
 * stride apart. Per head, the arithmetic is the same whatever nheads is. */
static void attend_direct(const kvk__attn_job *jb, const kvk__attn_task *tk, float *scratch) {
    enum { T = KVK__ATTN_TILE, QM = KVK__ATTN_QMAX };
    const kvk_cache *c = jb->c;
    const kvk_page_table *pt = jb->pt;
    const uint32_t dim = c->head_dim, dimp = jb->dimp, G = jb->group, nq = tk->nq;
    const uint32_t kvh0 = tk->kv_head, nh = tk->nheads < 1 ? 1 : tk->nheads;
    const uint32_t nv = nh * nq, heads = c->num_kv_heads, tpb = c->tokens_per_block;
    const uint32_t eb = kvk_elem_bytes(c->dtype), qeb = kvk_elem_bytes(jb->qo_dtype);
    const int scaled = kvk__is_scaled(c->dtype);
    float *qf = scratch;                 /* [QM][dimp] queries times sm_scale * log2(e) */
    float *acc = qf + (size_t)QM * dimp; /* [QM][dimp] unnormalised outputs */
    float *sp = acc + (size_t)QM * dimp + 2 * (size_t)T * dimp; /* [QM][T] scores, then p */
    float *mx = sp + (size_t)QM * T;                            /* [QM] running max (base 2) */
    float *sum = mx + QM;                      /* [QM] running sum of 2^(s - max) */
    float *alpha = sum + QM;                   /* [QM] this tile's rescale of acc */
    uint32_t *lens = (uint32_t *)(alpha + QM); /* [QM] tokens each query vector sees */

    int32_t p0 = pt->indptr[tk->req];
    int32_t npages = pt->indptr[tk->req + 1] - p0;
    uint64_t len =
        npages == 0 ? 0 : (uint64_t)(npages - 1) * tpb + (uint64_t)pt->last_page_len[tk->req];
    const int32_t *pages = pt->indices + (npages == 0 ? 0 : p0);
    uint64_t row0 = jb->qo_indptr != NULL ? (uint64_t)jb->qo_indptr[tk->req] : tk->req;
    uint64_t nrows =
        jb->qo_indptr != NULL ? (uint64_t)(jb->qo_indptr[tk->req + 1] - jb->qo_indptr[tk->req]) : 1;
    uint32_t maxlen = 0;
    /* State row r: KV head kvh0 + r / nq, query vector qi0 + r % nq. */
    for (uint32_t r = 0; r < nv; r++) {
        uint32_t h = kvh0 + r / nq, qi = tk->qi0 + r % nq;
        uint64_t row = row0 + qi / G;
        uint64_t e0 = (row * jb->num_qo_heads + (uint64_t)h * G + qi % G) * dim;
        load_row(jb->qo_dtype, (const char *)jb->q + e0 * qeb, dim, jb->q_mul,
                 qf + (size_t)r * dimp, 0);
        memset(acc + (size_t)r * dimp, 0, dimp * sizeof(float));
        int64_t see = (int64_t)len;
        if (jb->causal) {
            see = (int64_t)len - (int64_t)nrows + (int64_t)(qi / G) + 1;
            see = see < 0 ? 0 : see;
        }
        lens[r] = (uint32_t)see;
        maxlen = lens[r] > maxlen ? lens[r] : maxlen;
        mx[r] = -INFINITY;
        sum[r] = 0.0f;
    }
    const uint32_t sec = jb->layer * 2; /* K; V is the next section */
    const int64_t tok_bytes = (int64_t)heads * dim * eb;
    const uint64_t row_bytes = (uint64_t)dim * eb, run = nh * row_bytes;
    /* Direct fp8 vectors are code / 256: the 256 joins the scale. */
    const float unit = c->dtype == KV_DTYPE_FP8_E4M3 ? 256.0f : 1.0f;
    for (uint32_t t0 = 0; t0 < maxlen; t0 += T) {
        uint32_t ntok = maxlen - t0 < T ? maxlen - t0 : T;
        const char *kbase[T]; /* token t's K row of head kvh0 */
        const float *ksc[T];  /* its block's K scales (8-bit dtypes) */
        for (uint32_t t = 0; t < ntok; t++) {
            uint32_t tok = t0 + t;
            int64_t blk = pages[tok / tpb];
            kbase[t] = (const char *)c->data + blk * c->block_stride +
                       (int64_t)sec * c->section_stride + (int64_t)(tok % tpb) * tok_bytes +
                       (int64_t)kvh0 * row_bytes;
            ksc[t] = scaled
                         ? (const float *)((const char *)c->scales + blk * c->scale_block_stride +
                                           (int64_t)sec * c->scale_section_stride)
                         : NULL;
            /* Pages lie anywhere in memory: start loading the next tile's rows now, so they
             * arrive while this tile is computed. */
            if (tok + T < maxlen) {
                uint32_t nt = tok + T;
                const char *nk = (const char *)c->data + pages[nt / tpb] * c->block_stride +
                                 (int64_t)sec * c->section_stride +
                                 (int64_t)(nt % tpb) * tok_bytes + (int64_t)kvh0 * row_bytes;
                for (uint64_t b = 0; b < run; b += 64) {
                    __builtin_prefetch(nk + b);
                    __builtin_prefetch(nk + c->section_stride + b);
                }
            }
        }
        for (uint32_t h = 0; h < nh; h++) {
            const char *krow[T];
            float ks[T];
            for (uint32_t t = 0; t < ntok; t++) {
                krow[t] = kbase[t] + h * row_bytes;
                ks[t] = scaled ? ksc[t][kvh0 + h] * unit : 1.0f;
            }
            for (uint32_t k = 0; k < nq; k += 4) {
                uint32_t nb = nq - k < 4 ? nq - k : 4, r = h * nq + k;
                scores_tile(c->dtype, nb, krow, ks, scaled, ntok, qf + (size_t)r * dimp, dimp, dim,
                            sp + (size_t)r * T);
            }
        }
        /* Online softmax: mask tokens beyond each vector's length, rescale by the new max. */
        softmax_tile(sp, nv, lens, t0, ntok, mx, sum, alpha);
        for (uint32_t h = 0; h < nh; h++) {
            const char *vrow[T];
            float vs[T] = {0};
            for (uint32_t t = 0; t < ntok; t++) {
                vrow[t] = kbase[t] + h * row_bytes + c->section_stride;
                vs[t] = scaled ? ((const float *)((const char *)ksc[t] +
                                                  c->scale_section_stride))[kvh0 + h] *
                                     unit
                               : 1.0f;
            }
            for (uint32_t k = 0; k < nq; k += 4) {
                uint32_t nb = nq - k < 4 ? nq - k : 4, r = h * nq + k;
                float pw[4 * T];
                const float *p = sp + (size_t)r * T;
                if (scaled) {
                    __m256 v8 = _mm256_loadu_ps(vs);
                    for (uint32_t i = 0; i < nb; i++) {
                        _mm256_storeu_ps(pw + i * T, _mm256_mul_ps(_mm256_loadu_ps(p + i * T), v8));
                    }
                    p = pw;
                }
                values_tile(c->dtype, nb, acc + (size_t)r * dimp, alpha + r, p, vrow, ntok, dimp,
                            dim);
            }
        }
    }
    for (uint32_t k = 0; k < nv; k++) {
        uint32_t h = kvh0 + k / nq, qi = tk->qi0 + k % nq;
        uint64_t row = row0 + qi / G;
        uint64_t r = row * jb->num_qo_heads + (uint64_t)h * G + qi % G;
        char *o = (char *)jb->out + r * dim * qeb;
        if (lens[k] == 0) {
            memset(acc + (size_t)k * dimp, 0, dim * sizeof(float));
            simd_from_f32(jb->qo_dtype, acc + (size_t)k * dimp, dim, 1.0f, o);
        } else {
            simd_from_f32(jb->qo_dtype, acc + (size_t)k * dimp, dim, sum[k], o);
        }
        if (jb->lse != NULL) {
            jb->lse[r] = lens[k] == 0 ? -INFINITY : (mx[k] + log2f(sum[k])) * 0.69314718055994531f;
        }
    }
}

static void simd_attend(const kvk__attn_job *jb, const kvk__attn_task *tk, float *scratch) {
    enum { T = KVK__ATTN_TILE, QM = KVK__ATTN_QMAX };
    if (jb->c->head_dim % KVK_W == 0 && tk->nq <= KVK__ATTN_DIRECT_NQ) {
        attend_direct(jb, tk, scratch);
        return;
    }
    if (tk->nheads > 1) {
        for (uint32_t h = 0; h < tk->nheads; h++) {
            kvk__attn_task one = *tk;
            one.kv_head = tk->kv_head + h;
            one.nheads = 1;
            simd_attend(jb, &one, scratch);
        }
        return;
    }
    const kvk_cache *c = jb->c;
    const kvk_page_table *pt = jb->pt;
    const uint32_t dim = c->head_dim, dimp = jb->dimp, G = jb->group, nq = tk->nq;
    const uint32_t kvh = tk->kv_head, heads = c->num_kv_heads, tpb = c->tokens_per_block;
    const uint32_t eb = kvk_elem_bytes(c->dtype), qeb = kvk_elem_bytes(jb->qo_dtype);
    const uint32_t nc = (nq + KVK_W - 1) / KVK_W; /* vectors of query vectors */
    const int scaled = kvk__is_scaled(c->dtype);
    float *qt = scratch;                 /* [dimp][QM] queries (times q_mul), transposed */
    float *acc = qt + (size_t)QM * dimp; /* [dimp][QM] unnormalised outputs, transposed */
    float *kt = acc + (size_t)QM * dimp; /* [T][dimp] the tile's K rows, dequantized */
    float *vt = kt + (size_t)T * dimp;   /* [T][dimp] its V rows */
    /* The layout's [QM][T] scores (the direct path's) are not used here: they stay in registers. */
    float *mx = vt + (size_t)T * dimp + (size_t)QM * T; /* [QM] running max (base 2) */
    float *sum = mx + QM;                               /* [QM] running sum of 2^(s - max) */
    int32_t *lens = (int32_t *)(sum + 2 * QM);          /* [QM] tokens each query vector sees */

    int32_t p0 = pt->indptr[tk->req];
    int32_t npages = pt->indptr[tk->req + 1] - p0;
    uint64_t len =
        npages == 0 ? 0 : (uint64_t)(npages - 1) * tpb + (uint64_t)pt->last_page_len[tk->req];
    const int32_t *pages = pt->indices + (npages == 0 ? 0 : p0);
    uint64_t row0 = jb->qo_indptr != NULL ? (uint64_t)jb->qo_indptr[tk->req] : tk->req;
    uint64_t nrows =
        jb->qo_indptr != NULL ? (uint64_t)(jb->qo_indptr[tk->req + 1] - jb->qo_indptr[tk->req]) : 1;
    uint32_t maxlen = 0;
    /* Lanes past nq (the last vector's tail) see no token: their state stays zero. */
    memset(qt, 0, (size_t)dim * QM * sizeof(float));
    memset(acc, 0, (size_t)dim * QM * sizeof(float));
    for (uint32_t k = 0; k < nc * KVK_W; k++) {
        lens[k] = 0;
        mx[k] = -INFINITY;
        sum[k] = 0.0f;
    }
    for (uint32_t k = 0; k < nq; k++) {
        uint32_t qi = tk->qi0 + k;
        uint64_t row = row0 + qi / G;
        uint64_t e0 = (row * jb->num_qo_heads + (uint64_t)kvh * G + qi % G) * dim;
        load_row(jb->qo_dtype, (const char *)jb->q + e0 * qeb, dim, jb->q_mul, kt, 0);
        for (uint32_t d = 0; d < dim; d++) {
            qt[(size_t)d * QM + k] = kt[d];
        }
        int64_t see = (int64_t)len;
        if (jb->causal) {
            see = (int64_t)len - (int64_t)nrows + (int64_t)(qi / G) + 1;
            see = see < 0 ? 0 : see;
        }
        lens[k] = (int32_t)see;
        maxlen = (uint32_t)see > maxlen ? (uint32_t)see : maxlen;
    }
    const uint32_t sec = jb->layer * 2; /* K; V is the next section */
    const int64_t head_off = (int64_t)kvh * dim * eb;
    const int64_t tok_bytes = (int64_t)heads * dim * eb;
    const uint64_t row_bytes = (uint64_t)dim * eb;
    for (uint32_t t0 = 0; t0 < maxlen; t0 += T) {
        uint32_t ntok = maxlen - t0 < T ? maxlen - t0 : T;
        for (uint32_t t = 0; t < ntok; t++) {
            uint32_t tok = t0 + t;
            int64_t blk = pages[tok / tpb];
            const char *krow = (const char *)c->data + blk * c->block_stride +
                               (int64_t)sec * c->section_stride + (int64_t)(tok % tpb) * tok_bytes +
                               head_off;
            const char *vrow = krow + c->section_stride;
            float ks = 1.0f;
            float vscale = 1.0f;
            if (scaled) {
                const float *sc =
                    (const float *)((const char *)c->scales + blk * c->scale_block_stride +
                                    (int64_t)sec * c->scale_section_stride);
                ks = sc[kvh];
                vscale = ((const float *)((const char *)sc + c->scale_section_stride))[kvh];
            }
            /* Rows come from pages anywhere in memory, which no hardware prefetcher follows:
             * start loading the next tile's K and V rows now. */
            if (tok + T < maxlen) {
                uint32_t nt = tok + T;
                const char *nk = (const char *)c->data + pages[nt / tpb] * c->block_stride +
                                 (int64_t)sec * c->section_stride +
                                 (int64_t)(nt % tpb) * tok_bytes + head_off;
                for (uint64_t b = 0; b < row_bytes; b += 64) {
                    __builtin_prefetch(nk + b);
                    __builtin_prefetch(nk + c->section_stride + b);
                }
            }
            load_row(c->dtype, krow, dim, ks, kt + (size_t)t * dimp, 0);
            load_row(c->dtype, vrow, dim, vscale, vt + (size_t)t * dimp, 0);
        }
        /* The last tile's missing rows are zeros: their probabilities are zero, and 0 * V must
         * not meet a stale NaN. */
        for (uint32_t t = ntok; t < T; t++) {
            memset(kt + (size_t)t * dimp, 0, dim * sizeof(float));
            memset(vt + (size_t)t * dimp, 0, dim * sizeof(float));
        }
        for (uint32_t ci = 0; ci < nc; ci++) {
            const size_t c0 = (size_t)ci * KVK_W;
            /* Scores of KVK_W query vectors with the tile's 8 tokens: one vector per token,
             * summed over the head's dims (each K element broadcast, every query's element
             * from one load). */
            _Static_assert(KVK__ATTN_TILE == 8, "the tile's tokens are eight named vectors");
            vf s[T];
            {
                /* Eight named accumulators: GCC keeps an array of vectors in memory here. */
                vf a0 = VZERO(), a1 = VZERO(), a2 = VZERO(), a3 = VZERO();
                vf a4 = VZERO(), a5 = VZERO(), a6 = VZERO(), a7 = VZERO();
                const float *k0 = kt;
                for (uint32_t d = 0; d < dim; d++, k0++) {
                    vf qv = VLOAD(qt + (size_t)d * QM + c0);
                    a0 = VFMA(VSET1(k0[0]), qv, a0);
                    a1 = VFMA(VSET1(k0[dimp]), qv, a1);
                    a2 = VFMA(VSET1(k0[2 * dimp]), qv, a2);
                    a3 = VFMA(VSET1(k0[3 * dimp]), qv, a3);
                    a4 = VFMA(VSET1(k0[4 * dimp]), qv, a4);
                    a5 = VFMA(VSET1(k0[5 * dimp]), qv, a5);
                    a6 = VFMA(VSET1(k0[6 * dimp]), qv, a6);
                    a7 = VFMA(VSET1(k0[7 * dimp]), qv, a7);
                }
                s[0] = a0, s[1] = a1, s[2] = a2, s[3] = a3;
                s[4] = a4, s[5] = a5, s[6] = a6, s[7] = a7;
            }
            /* Online softmax, one lane per query vector: tokens past a vector's length are
             * -inf; 2^(-inf - -inf) is NaN, which exp2_v turns into 0 as it does -inf. */
            vi lv = VILOAD(lens + c0);
            vf m0 = VLOAD(mx + c0), mnew = m0;
            for (uint32_t t = 0; t < T; t++) {
                s[t] = VSEL_LT(VISET1((int32_t)(t0 + t)), lv, s[t], VSET1(-INFINITY));
                mnew = VMAX(mnew, s[t]);
            }
            vf alpha = exp2_v(VSUB(m0, mnew));
            vf tot = VZERO();
            for (uint32_t t = 0; t < T; t++) {
                s[t] = exp2_v(VSUB(s[t], mnew));
                tot = VADD(tot, s[t]);
            }
            VSTORE(sum + c0, VFMA(VLOAD(sum + c0), alpha, tot));
            VSTORE(mx + c0, mnew);
            /* acc = acc * alpha + sum over t of p[t] * V[t], one dim at a time. */
            {
                const vf p0 = s[0], p1 = s[1], p2 = s[2], p3 = s[3];
                const vf p4 = s[4], p5 = s[5], p6 = s[6], p7 = s[7];
                const float *v0 = vt;
                for (uint32_t d = 0; d < dim; d++, v0++) {
                    float *ad = acc + (size_t)d * QM + c0;
                    vf a = VMUL(VLOAD(ad), alpha);
                    vf b = VMUL(VSET1(v0[0]), p0);
                    a = VFMA(VSET1(v0[dimp]), p1, a);
                    b = VFMA(VSET1(v0[2 * dimp]), p2, b);
                    a = VFMA(VSET1(v0[3 * dimp]), p3, a);
                    b = VFMA(VSET1(v0[4 * dimp]), p4, b);
                    a = VFMA(VSET1(v0[5 * dimp]), p5, a);
                    b = VFMA(VSET1(v0[6 * dimp]), p6, b);
                    a = VFMA(VSET1(v0[7 * dimp]), p7, a);
                    VSTORE(ad, VADD(a, b));
                }
            }
        }
    }
    for (uint32_t k = 0; k < nq; k++) {
        uint32_t qi = tk->qi0 + k;
        uint64_t row = row0 + qi / G;
        uint64_t r = row * jb->num_qo_heads + (uint64_t)kvh * G + qi % G;
        char *o = (char *)jb->out + r * dim * qeb;
        for (uint32_t d = 0; d < dim; d++) {
            kt[d] = lens[k] == 0 ? 0.0f : acc[(size_t)d * QM + k];
        }
        simd_from_f32(jb->qo_dtype, kt, dim, lens[k] == 0 ? 1.0f : sum[k], o);
        if (jb->lse != NULL) {
            jb->lse[r] = lens[k] == 0 ? -INFINITY : (mx[k] + log2f(sum[k])) * 0.69314718055994531f;
        }
    }
}
