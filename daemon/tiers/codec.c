/* kvd_codec: RAW / LZ4 / ZSTD encoding of a block for T1 and T2.
 *
 * Each call compresses straight into the caller's buffer (cap >= bound, so the compressor never
 * runs out of room) and falls back to a plain copy when the result does not save n/16 bytes.
 * ZSTD_compress makes and frees its own context per call: simple and thread-safe; a per-thread
 * context would save its setup if profiles ever show it.
 */
#include "daemon/tiers/codec.h"

#include <limits.h>
#include <string.h>

#include <lz4.h>
#include <zstd.h>
#include <zstd_errors.h>

#include "common/kv_layout.h"
#include "kernels/kvk.h"

#define ZSTD_LEVEL 1

/* Indexed by kvd_tier_format; the spellings of the `tier-format` option. */
static const char *const format_names[KVD_TF_COUNT] = {
    [KVD_TF_RAW] = "raw",   [KVD_TF_LZ4] = "lz4", [KVD_TF_ZSTD] = "zstd",
    [KVD_TF_INT8] = "int8", [KVD_TF_FP8] = "fp8",
};

const char *kvd_tier_format_name(kvd_tier_format f) {
    if ((unsigned)f >= KVD_TF_COUNT) {
        return "?";
    }
    return format_names[f];
}

kv_err kvd_tier_format_parse(const char *name, kvd_tier_format *out) {
    if (name == NULL || out == NULL) {
        return KV_EINVAL;
    }
    for (unsigned i = 0; i < KVD_TF_COUNT; i++) {
        if (strcmp(name, format_names[i]) == 0) {
            *out = (kvd_tier_format)i;
            return KV_OK;
        }
    }
    return KV_EINVAL;
}

/* LZ4's block API takes int sizes and refuses more than LZ4_MAX_INPUT_SIZE: larger inputs are
 * stored RAW, so their bound is n. */
static int codec_lz4_fits(size_t n) {
    return n <= (size_t)LZ4_MAX_INPUT_SIZE;
}

size_t kvd_codec_bound(kvd_tier_format f, size_t n) {
    size_t b = n;
    switch (f) {
        case KVD_TF_LZ4:
            if (codec_lz4_fits(n)) {
                b = (size_t)LZ4_compressBound((int)n);
            }
            break;
        case KVD_TF_ZSTD: {
            size_t z = ZSTD_compressBound(n);
            if (!ZSTD_isError(z)) {
                b = z;
            }
            break;
        }
        default:
            break;
    }
    return b > n ? b : n;
}

/* Worth keeping: saves at least n/16 bytes. */
static int codec_saves(size_t n, size_t clen) {
    return clen <= n && n - clen >= n / 16;
}

kv_err kvd_codec_encode(kvd_tier_format f, const void *src, size_t n, void *dst, size_t cap,
                        size_t *len, kvd_tier_format *used) {
    if ((unsigned)f >= KVD_TF_COUNT || kvd_tier_format_lossy(f) || len == NULL || used == NULL ||
        cap < kvd_codec_bound(f, n) || (n > 0 && (src == NULL || dst == NULL))) {
        return KV_EINVAL;
    }
    size_t clen = 0;
    int compressed = 0;
    if (f == KVD_TF_LZ4 && n > 0 && codec_lz4_fits(n)) {
        int capi = cap > (size_t)INT_MAX ? INT_MAX : (int)cap;
        int r = LZ4_compress_default(src, dst, (int)n, capi);
        /* 0 means it did not fit, which cap >= bound rules out; a plain copy is still right. */
        if (r > 0) {
            clen = (size_t)r;
            compressed = 1;
        }
    } else if (f == KVD_TF_ZSTD && n > 0) {
        size_t r = ZSTD_compress(dst, cap, src, n, ZSTD_LEVEL);
        if (ZSTD_isError(r)) {
            if (ZSTD_getErrorCode(r) == ZSTD_error_memory_allocation) {
                return KV_ENOMEM;
            }
            /* Nothing else can fail with cap >= bound and a valid level. */
            return KV_EINTERNAL;
        }
        clen = r;
        compressed = 1;
    }
    if (compressed && codec_saves(n, clen)) {
        *len = clen;
        *used = f;
        return KV_OK;
    }
    if (n > 0) {
        memcpy(dst, src, n);
    }
    *len = n;
    *used = KVD_TF_RAW;
    return KV_OK;
}

kv_err kvd_codec_decode(kvd_tier_format f, const void *src, size_t len, void *dst, size_t n) {
    if ((unsigned)f >= KVD_TF_COUNT || kvd_tier_format_lossy(f)) {
        return KV_EINVAL;
    }
    if ((len > 0 && src == NULL) || (n > 0 && dst == NULL)) {
        return KV_EINVAL;
    }
    switch (f) {
        case KVD_TF_RAW:
            if (len != n) {
                return KV_ECORRUPT;
            }
            if (n > 0) {
                memcpy(dst, src, n);
            }
            return KV_OK;
        case KVD_TF_LZ4: {
            /* The encoder never stores more than LZ4_MAX_INPUT_SIZE bytes as LZ4. */
            if (len == 0 || len > (size_t)INT_MAX || !codec_lz4_fits(n)) {
                return KV_ECORRUPT;
            }
            int r = LZ4_decompress_safe(src, dst, (int)len, (int)n);
            return r >= 0 && (size_t)r == n ? KV_OK : KV_ECORRUPT;
        }
        case KVD_TF_ZSTD: {
            size_t r = ZSTD_decompress(dst, n, src, len);
            if (ZSTD_isError(r)) {
                /* Out of memory says nothing about the data: do not let it be quarantined. */
                return ZSTD_getErrorCode(r) == ZSTD_error_memory_allocation ? KV_ENOMEM
                                                                            : KV_ECORRUPT;
            }
            return r == n ? KV_OK : KV_ECORRUPT;
        }
        default:
            return KV_EINVAL;
    }
}

/* ---- lossy: quantized blocks ----------------------------------------------------------- */

int kvd_tier_format_lossy(kvd_tier_format f) {
    return f == KVD_TF_INT8 || f == KVD_TF_FP8;
}

static int quantizable(const kv_layout *l) {
    return l->dtype == KV_DTYPE_FP16 || l->dtype == KV_DTYPE_BF16 || l->dtype == KV_DTYPE_FP32;
}

/* Groups of the image (one per layer and K|V) and their elements. */
static uint64_t q_groups(const kv_layout *l) {
    return (uint64_t)l->num_layers * 2;
}

static uint64_t q_elems(const kv_layout *l) {
    return q_groups(l) * l->tokens_per_block * l->num_kv_heads * l->head_dim;
}

/* Where the scales start: after the elements, 8-aligned (so the float32s are aligned). */
static uint64_t q_scales_at(const kv_layout *l) {
    return (q_elems(l) + 7) & ~(uint64_t)7;
}

size_t kvd_codec_quantized_bytes(kvd_tier_format f, const kv_layout *l) {
    if (!kvd_tier_format_lossy(f) || !quantizable(l)) {
        return 0;
    }
    return (size_t)(q_scales_at(l) + q_groups(l) * l->num_kv_heads * sizeof(float));
}

kv_err kvd_codec_quantize(kvd_tier_format f, const kv_layout *l, const void *img, void *dst) {
    if (kvd_codec_quantized_bytes(f, l) == 0 || img == NULL || dst == NULL) {
        return KV_EINVAL;
    }
    uint8_t *q = dst;
    float *scales = (float *)(void *)(q + q_scales_at(l));
    memset(q + q_elems(l), 0, (size_t)(q_scales_at(l) - q_elems(l)));
    return kvk_quantize_blocks_cpu(l->dtype, img,
                                   f == KVD_TF_INT8 ? KV_DTYPE_INT8 : KV_DTYPE_FP8_E4M3, q, scales,
                                   q_groups(l), l->tokens_per_block, l->num_kv_heads, l->head_dim);
}

kv_err kvd_codec_dequantize(kvd_tier_format f, const kv_layout *l, const void *src, size_t len,
                            void *img) {
    size_t need = kvd_codec_quantized_bytes(f, l);
    if (need == 0 || src == NULL || img == NULL) {
        return KV_EINVAL;
    }
    if (len != need) {
        return KV_ECORRUPT;
    }
    const uint8_t *q = src;
    const float *scales = (const float *)(const void *)(q + q_scales_at(l));
    return kvk_dequantize_blocks_cpu(f == KVD_TF_INT8 ? KV_DTYPE_INT8 : KV_DTYPE_FP8_E4M3, q,
                                     scales, l->dtype, img, q_groups(l), l->tokens_per_block,
                                     l->num_kv_heads, l->head_dim);
}
