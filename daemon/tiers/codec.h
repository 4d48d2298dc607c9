/* kvd_codec: how a block's bytes are stored in a lower tier (T1 host memory, T2 disk).
 *
 * RAW keeps the bytes as T0 has them (lossless, the default). LZ4 and ZSTD compress them
 * losslessly with Debian's liblz4 / libzstd; KV data (floating-point activations) compresses
 * poorly, so an encoding that does not save at least 1/16 of the bytes is stored RAW instead and
 * the caller is told which format it got. Lossy quantized formats (fp16/bf16 -> int8/fp8 with
 * per-block scales) are not built yet (issue 14, unfinished).
 * Pure functions over caller buffers; any thread.
 */
#ifndef KVD_CODEC_H
#define KVD_CODEC_H

#include <stddef.h>
#include <stdint.h>

#include "common/kv_err.h"

typedef enum kvd_tier_format {
    KVD_TF_RAW = 0,  /* the bytes as stored in T0 */
    KVD_TF_LZ4 = 1,  /* LZ4 block format (lossless) */
    KVD_TF_ZSTD = 2, /* Zstandard frame, level 1 (lossless) */
    KVD_TF_COUNT = 3,
} kvd_tier_format;

/* The one table of names, as the `tier-format` option spells them: "raw", "lz4", "zstd".
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

#endif
