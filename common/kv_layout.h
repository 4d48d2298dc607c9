/* kv_layout: the shape of one model's KV cache, and where each element lives in a segment.
 *
 * A pool serves one layout. A segment holds `nblocks` blocks; a block id means the same slot in
 * every layer (vLLM and FlashInfer need this). Two arrangements:
 *  - LAYER_MAJOR: for each layer, K then V, each an ordinary paged tensor
 *    [nblocks][tokens_per_block][kv_heads][head_dim]; engines index it directly.
 *  - BLOCK_MAJOR: each block is one contiguous run [layers][K,V][tokens][heads][dim]; best for
 *    transfers between tiers.
 * For the 8-bit dtypes (fp8-e4m3, int8) each block carries float32 scales per (layer, K|V,
 * head). LAYER_MAJOR keeps them after all element data of the segment, as
 * [layers][K,V][nblocks][heads]; BLOCK_MAJOR ends each block's run with [layers][K,V][heads].
 * In LAYER_MAJOR the (layer, K|V) section of a segment is nblocks * kv_block_bytes long, so a
 * client can map each section next to the same section of the previous segment and hand the
 * engine one tensor per layer (the daemon picks nblocks to make sections page multiples).
 * For the 8-bit dtypes head_dim must be a multiple of 4, so data sizes are multiples of 8 and
 * every float32 scale is 4-byte aligned in both arrangements; all elements are aligned to their
 * size.
 * Pure functions; any thread.
 */
#ifndef KV_LAYOUT_H
#define KV_LAYOUT_H

#include <stdint.h>

#include "common/kv_err.h"

typedef enum kv_dtype {
    KV_DTYPE_FP16 = 1,
    KV_DTYPE_BF16 = 2,
    KV_DTYPE_FP32 = 3,
    KV_DTYPE_FP8_E4M3 = 4, /* with per (block, layer, K|V, head) float32 scales */
    KV_DTYPE_INT8 = 5,     /* with per (block, layer, K|V, head) float32 scales */
} kv_dtype;

typedef enum kv_arrangement {
    KV_LAYER_MAJOR = 1,
    KV_BLOCK_MAJOR = 2,
} kv_arrangement;

enum { KV_K = 0, KV_V = 1 };

/* Limits checked by kv_layout_init (each field 1..limit). */
#define KV_LAYOUT_MAX_LAYERS 1024
#define KV_LAYOUT_MAX_HEADS 1024
#define KV_LAYOUT_MAX_HEAD_DIM 4096
#define KV_LAYOUT_MAX_TOKENS_PER_BLOCK 1024

typedef struct kv_layout {
    uint32_t num_layers;        /* transformer layers */
    uint32_t num_kv_heads;      /* KV heads (GQA: fewer than query heads) */
    uint32_t head_dim;          /* elements per head */
    uint32_t tokens_per_block;  /* 1..1024 */
    kv_dtype dtype;             /* element type */
    kv_arrangement arrangement; /* LAYER_MAJOR or BLOCK_MAJOR */
    /* Derived by kv_layout_init: */
    uint32_t elem_bytes;     /* bytes per element */
    uint64_t token_bytes;    /* one token of one layer's K (or V): heads * dim * elem */
    uint64_t kv_block_bytes; /* one block of one layer's K (or V): tokens * token_bytes */
    uint64_t data_bytes;     /* element bytes of one block over all layers, K and V */
    uint64_t scale_bytes;    /* scale bytes of one block (0 for 16/32-bit dtypes) */
    uint64_t block_bytes;    /* data_bytes + scale_bytes: what one block costs */
} kv_layout;

/* Validates the shape and fills the derived fields. KV_EINVAL names nothing; callers report
 * which field with kv_layout_check_msg. KV_EINVAL also for out NULL. Writes *out only on
 * success. Within the limits no derived field overflows (a block is at most 2^45 bytes). */
kv_err kv_layout_init(uint32_t num_layers, uint32_t num_kv_heads, uint32_t head_dim,
                      uint32_t tokens_per_block, kv_dtype dtype, kv_arrangement arrangement,
                      kv_layout *out);

/* Like kv_layout_init's check, but returns a static message saying what is wrong, or NULL. The
 * message starts with the offending field's name ("num_layers", "num_kv_heads", "head_dim",
 * "tokens_per_block", "dtype", "arrangement"). */
const char *kv_layout_check_msg(uint32_t num_layers, uint32_t num_kv_heads, uint32_t head_dim,
                                uint32_t tokens_per_block, kv_dtype dtype,
                                kv_arrangement arrangement);

/* Bytes of a segment of nblocks blocks: nblocks * block_bytes, or UINT64_MAX if that overflows.
 * l must be initialised by kv_layout_init. */
uint64_t kv_layout_segment_bytes(const kv_layout *l, uint32_t nblocks);

/* Byte offset, inside a segment of nblocks blocks, of element (token, head, 0) of layer's K or
 * V (kv = KV_K or KV_V) in block (segment-local index). Element d of that head follows at
 * + d * elem_bytes. Arguments must be in range (the caller validates peer input first): an
 * out-of-range argument is a broken invariant and aborts through KV_ASSERT. */
uint64_t kv_layout_offset(const kv_layout *l, uint32_t nblocks, uint32_t block, uint32_t layer,
                          int kv, uint32_t token, uint32_t head);

/* Byte offset of the float32 scale of (block, layer, kv, head); only for 8-bit dtypes
 * (scale_bytes != 0). Arguments must be in range, as for kv_layout_offset. */
uint64_t kv_layout_scale_offset(const kv_layout *l, uint32_t nblocks, uint32_t block,
                                uint32_t layer, int kv, uint32_t head);

/* Names and parsing for config and admin: "fp16", "bf16", "fp32", "fp8_e4m3", "int8";
 * "layer_major", "block_major" (exact, lower case). name returns "unknown" for a value outside
 * the enum; parse returns KV_EINVAL on an unknown name and writes *out only on success. */
const char *kv_dtype_name(kv_dtype d);
kv_err kv_dtype_parse(const char *s, kv_dtype *out);
const char *kv_arrangement_name(kv_arrangement a);
kv_err kv_arrangement_parse(const char *s, kv_arrangement *out);

#endif
