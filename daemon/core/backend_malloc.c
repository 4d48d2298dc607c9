/* kvd_backend_malloc: segments from aligned_alloc, no shareable fd. For unit tests and
 * benchmarks of the core, where no worker maps the memory. */
#include <stdlib.h>
#include <string.h>

#include "daemon/core/backend.h"

static kv_err malloc_segment_alloc(void *ctx, uint64_t bytes, kvd_segment_mem *out) {
    (void)ctx;
    /* aligned_alloc wants a size that is a multiple of the alignment. */
    uint64_t rounded = (bytes + 4095u) & ~(uint64_t)4095u;
    if (rounded == 0) {
        rounded = 4096;
    }
    void *base = aligned_alloc(4096, (size_t)rounded);
    if (base == NULL) {
        return KV_ENOMEM;
    }
    memset(out, 0, sizeof(*out));
    out->base = base;
    out->fd = -1;
    out->bytes = bytes;
    out->priv = NULL;
    return KV_OK;
}

static void malloc_segment_free(void *ctx, kvd_segment_mem *mem) {
    (void)ctx;
    if (mem == NULL) {
        return;
    }
    free(mem->base);
    mem->base = NULL;
    mem->bytes = 0;
}

const kvd_backend_ops kvd_backend_malloc = {
    .name = "malloc",
    .segment_alloc = malloc_segment_alloc,
    .segment_free = malloc_segment_free,
};

kv_err kvd_segment_write(const kvd_backend_ops *be, void *ctx, const kvd_segment_mem *mem,
                         uint64_t off, const void *src, uint64_t n) {
    if (mem == NULL || mem->base == NULL || off > mem->bytes || n > mem->bytes - off) {
        return KV_EINVAL;
    }
    if (be->segment_write != NULL) {
        return be->segment_write(ctx, mem, off, src, n);
    }
    memcpy((uint8_t *)mem->base + off, src, (size_t)n);
    return KV_OK;
}

kv_err kvd_segment_read(const kvd_backend_ops *be, void *ctx, const kvd_segment_mem *mem,
                        uint64_t off, void *dst, uint64_t n) {
    if (mem == NULL || mem->base == NULL || off > mem->bytes || n > mem->bytes - off) {
        return KV_EINVAL;
    }
    if (be->segment_read != NULL) {
        return be->segment_read(ctx, mem, off, dst, n);
    }
    memcpy(dst, (const uint8_t *)mem->base + off, (size_t)n);
    return KV_OK;
}
