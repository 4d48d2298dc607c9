/* kv_layout: validation, derived sizes and element offsets for the two arrangements.
 *
 * Everything is plain 64-bit arithmetic on the derived sizes, so the offset functions are cheap
 * enough for per-block address computation. The limits in kv_layout.h bound one block at
 * 2^45 bytes, so the derived sizes never overflow; only segment sizes (times nblocks) can, and
 * kv_layout_segment_bytes saturates instead of wrapping.
 */
#include "common/kv_layout.h"

#include <stddef.h>
#include <string.h>

#include "common/kv_log.h"

static uint32_t dtype_bytes(kv_dtype d) {
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

static int dtype_scaled(kv_dtype d) {
    return d == KV_DTYPE_FP8_E4M3 || d == KV_DTYPE_INT8;
}

const char *kv_layout_check_msg(uint32_t num_layers, uint32_t num_kv_heads, uint32_t head_dim,
                                uint32_t tokens_per_block, kv_dtype dtype,
                                kv_arrangement arrangement) {
    if (num_layers == 0 || num_layers > KV_LAYOUT_MAX_LAYERS) {
        return "num_layers must be 1..1024";
    }
    if (num_kv_heads == 0 || num_kv_heads > KV_LAYOUT_MAX_HEADS) {
        return "num_kv_heads must be 1..1024";
    }
    if (head_dim == 0 || head_dim > KV_LAYOUT_MAX_HEAD_DIM) {
        return "head_dim must be 1..4096";
    }
    if (tokens_per_block == 0 || tokens_per_block > KV_LAYOUT_MAX_TOKENS_PER_BLOCK) {
        return "tokens_per_block must be 1..1024";
    }
    if (dtype_bytes(dtype) == 0) {
        return "dtype is unknown (fp16, bf16, fp32, fp8_e4m3, int8)";
    }
    if (dtype_scaled(dtype) && head_dim % 4 != 0) {
        return "head_dim must be a multiple of 4 for 8-bit dtypes (keeps float32 scales aligned)";
    }
    if (arrangement != KV_LAYER_MAJOR && arrangement != KV_BLOCK_MAJOR) {
        return "arrangement is unknown (layer_major, block_major)";
    }
    return NULL;
}

kv_err kv_layout_init(uint32_t num_layers, uint32_t num_kv_heads, uint32_t head_dim,
                      uint32_t tokens_per_block, kv_dtype dtype, kv_arrangement arrangement,
                      kv_layout *out) {
    if (out == NULL || kv_layout_check_msg(num_layers, num_kv_heads, head_dim, tokens_per_block,
                                           dtype, arrangement) != NULL) {
        return KV_EINVAL;
    }
    kv_layout l;
    memset(&l, 0, sizeof(l));
    l.num_layers = num_layers;
    l.num_kv_heads = num_kv_heads;
    l.head_dim = head_dim;
    l.tokens_per_block = tokens_per_block;
    l.dtype = dtype;
    l.arrangement = arrangement;
    l.elem_bytes = dtype_bytes(dtype);
    l.token_bytes = (uint64_t)num_kv_heads * head_dim * l.elem_bytes;
    l.kv_block_bytes = (uint64_t)tokens_per_block * l.token_bytes;
    l.data_bytes = (uint64_t)num_layers * 2 * l.kv_block_bytes;
    l.scale_bytes =
        dtype_scaled(dtype) ? (uint64_t)num_layers * 2 * num_kv_heads * sizeof(float) : 0;
    l.block_bytes = l.data_bytes + l.scale_bytes;
    *out = l;
    return KV_OK;
}

uint64_t kv_layout_segment_bytes(const kv_layout *l, uint32_t nblocks) {
    KV_ASSERT(l != NULL);
    if (nblocks != 0 && l->block_bytes > UINT64_MAX / nblocks) {
        return UINT64_MAX;
    }
    return (uint64_t)nblocks * l->block_bytes;
}

uint64_t kv_layout_offset(const kv_layout *l, uint32_t nblocks, uint32_t block, uint32_t layer,
                          int kv, uint32_t token, uint32_t head) {
    KV_ASSERT(l != NULL && block < nblocks && layer < l->num_layers && (kv == KV_K || kv == KV_V) &&
              token < l->tokens_per_block && head < l->num_kv_heads);
    uint64_t section = (uint64_t)layer * 2 + (uint64_t)kv; /* (layer, K|V) */
    uint64_t inner =
        (uint64_t)token * l->token_bytes + (uint64_t)head * l->head_dim * l->elem_bytes;
    if (l->arrangement == KV_LAYER_MAJOR) {
        /* Section (layer, kv) is the tensor [nblocks][tokens][heads][dim]. */
        return (section * nblocks + block) * l->kv_block_bytes + inner;
    }
    /* Block run: [layers][K,V][tokens][heads][dim], then the block's scales. */
    return (uint64_t)block * l->block_bytes + section * l->kv_block_bytes + inner;
}

uint64_t kv_layout_scale_offset(const kv_layout *l, uint32_t nblocks, uint32_t block,
                                uint32_t layer, int kv, uint32_t head) {
    KV_ASSERT(l != NULL && l->scale_bytes != 0 && block < nblocks && layer < l->num_layers &&
              (kv == KV_K || kv == KV_V) && head < l->num_kv_heads);
    uint64_t section = (uint64_t)layer * 2 + (uint64_t)kv;
    if (l->arrangement == KV_LAYER_MAJOR) {
        /* After all element data of the segment: [layers][K,V][nblocks][heads] floats. */
        return (uint64_t)nblocks * l->data_bytes +
               ((section * nblocks + block) * l->num_kv_heads + head) * sizeof(float);
    }
    /* End of the block's run: [layers][K,V][heads] floats. */
    return (uint64_t)block * l->block_bytes + l->data_bytes +
           (section * l->num_kv_heads + head) * sizeof(float);
}

static const struct {
    kv_dtype dtype;
    const char *name;
} dtype_names[] = {
    {KV_DTYPE_FP16, "fp16"},         {KV_DTYPE_BF16, "bf16"}, {KV_DTYPE_FP32, "fp32"},
    {KV_DTYPE_FP8_E4M3, "fp8_e4m3"}, {KV_DTYPE_INT8, "int8"},
};

static const struct {
    kv_arrangement arrangement;
    const char *name;
} arrangement_names[] = {
    {KV_LAYER_MAJOR, "layer_major"},
    {KV_BLOCK_MAJOR, "block_major"},
};

#define COUNT(a) (sizeof(a) / sizeof((a)[0]))

const char *kv_dtype_name(kv_dtype d) {
    for (size_t i = 0; i < COUNT(dtype_names); i++) {
        if (dtype_names[i].dtype == d) {
            return dtype_names[i].name;
        }
    }
    return "unknown";
}

kv_err kv_dtype_parse(const char *s, kv_dtype *out) {
    if (s == NULL || out == NULL) {
        return KV_EINVAL;
    }
    for (size_t i = 0; i < COUNT(dtype_names); i++) {
        if (strcmp(dtype_names[i].name, s) == 0) {
            *out = dtype_names[i].dtype;
            return KV_OK;
        }
    }
    return KV_EINVAL;
}

const char *kv_arrangement_name(kv_arrangement a) {
    for (size_t i = 0; i < COUNT(arrangement_names); i++) {
        if (arrangement_names[i].arrangement == a) {
            return arrangement_names[i].name;
        }
    }
    return "unknown";
}

kv_err kv_arrangement_parse(const char *s, kv_arrangement *out) {
    if (s == NULL || out == NULL) {
        return KV_EINVAL;
    }
    for (size_t i = 0; i < COUNT(arrangement_names); i++) {
        if (strcmp(arrangement_names[i].name, s) == 0) {
            *out = arrangement_names[i].arrangement;
            return KV_OK;
        }
    }
    return KV_EINVAL;
}
