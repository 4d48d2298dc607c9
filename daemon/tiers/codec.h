/* kvd_codec: how a block's bytes are stored in a lower tier (T1 host memory, T2 disk).
 *
 * RAW keeps the bytes as T0 has them (lossless, the default). LZ4 and ZSTD compress them
 * losslessly with Debian's liblz4 / libzstd; KV data (floating-point activations) compresses
 * poorly, so an encoding that does not save at least 1/16 of the bytes is stored RAW instead and
 * the caller is told which format it got. INT8 and FP8 are lossy: a block of an fp16, bf16 or
 * fp32 pool is stored quantized (kernels' kvk_quantize_blocks_cpu: one float32 scale per
 * (layer, K|V, head) of the block, absmax / 127 or / 448) and comes back dequantized to the
 * pool's dtype; they need the layout (kvd_codec_quantize), and a pool gets them only when its
 * layout asked (docs/TIERS.md, lossy tiers).
 * Pure functions over caller buffers; any thread.
 */
#ifndef KVD_CODEC_H
#define KVD_CODEC_H

#include <stddef.h>
#include <stdint.h>

#include "common/kv_err.h"
#include "common/kv_layout.h"

typedef enum kvd_tier_format {
    KVD_TF_RAW = 0,  /* the bytes as stored in T0 */
    KVD_TF_LZ4 = 1,  /* LZ4 block format (lossless) */
    KVD_TF_ZSTD = 2, /* Zstandard frame, level 1 (lossless) */
    KVD_TF_INT8 = 3, /* lossy: int8 elements + float32 scales per (layer, K|V, head) */
    KVD_TF_FP8 = 4,  /* lossy: fp8-e4m3 elements + the same scales */
    KVD_TF_COUNT = 5,
} kvd_tier_format;

/* The one table of names, as the `tier-format` and `tier-lossy-format` options spell them:
 * "raw", "lz4", "zstd", "int8", "fp8".
 * name: "?" outside the table. parse: KV_EINVAL for an unknown name (writes *out on success). */
const char *kvd_tier_format_name(kvd_tier_format f);
kv_err kvd_tier_format_parse(const char *name, kvd_tier_format *out);

/* The most bytes kvd_codec_encode may write for n input bytes in format f (at least n). */
size_t kvd_codec_bound(kvd_tier_format f, size_t n);

/* Encodes src[0..n) into dst[0..cap) (cap >= kvd_codec_bound(f, n)). *used gets the format
 * actually stored: f, or KVD_TF_RAW when compressing did not save at least n/16 bytes (then dst
 * holds a plain copy). *len gets the bytes written. KV_EINVAL for a bad format or a cap below the
 * bound, KV_ENOMEM when the compressor cannot get memory. */
kv_err kvd_codec_encode(kvd_tier_format f, const void *src, size_t n, void *dst, size_t cap,
                        size_t *len, kvd_tier_format *used);

/* Decodes src[0..len) stored in format f into exactly n bytes at dst. KV_ECORRUPT when the input
 * does not decode to exactly n bytes (a RAW record whose len != n included); KV_EINVAL for a bad
 * format. dst may be written partly on error. */
kv_err kvd_codec_decode(kvd_tier_format f, const void *src, size_t len, void *dst, size_t n);

/* 1 for the lossy formats (INT8, FP8). */
int kvd_tier_format_lossy(kvd_tier_format f);

/* Bytes a block of layout l takes in lossy format f (its elements and scales), or 0 when l's
 * dtype cannot be stored so (only fp16, bf16 and fp32 pools can). */
size_t kvd_codec_quantized_bytes(kvd_tier_format f, const kv_layout *l);

/* Quantizes a block image of layout l (img: l->block_bytes, the block's runs in image order:
 * per layer K then V, each [tokens][heads][dim]) into dst (kvd_codec_quantized_bytes(f, l)
 * bytes: the elements, then the scales). KV_EINVAL for a format that is not lossy or a dtype
 * that cannot be stored so. */
kv_err kvd_codec_quantize(kvd_tier_format f, const kv_layout *l, const void *img, void *dst);

/* The inverse into img (l->block_bytes). KV_ECORRUPT when len is not the quantized size. */
kv_err kvd_codec_dequantize(kvd_tier_format f, const kv_layout *l, const void *src, size_t len,
                            void *img);

#endif
