/* kvd_backend_malloc: segments from aligned_alloc, no shareable fd. For unit tests and
 * benchmarks of the core, where no worker maps the memory. */
#include <stdlib.h>

#include "daemon/backend.h"

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
