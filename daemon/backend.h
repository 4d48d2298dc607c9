/* kvd_backend: where segment memory comes from. One const table of functions per backend
 * (host memfd, malloc for tests, cuda-vmm, cuda-ipc); pools call it only to create and destroy
 * segments, never per block. Called on the loop thread only.
 */
#ifndef KVD_BACKEND_H
#define KVD_BACKEND_H

#include <stdint.h>

#include "common/kv_err.h"

/* One memory object holding a run of blocks. */
typedef struct kvd_segment_mem {
    void *base;     /* daemon's own mapping (host) or device pointer (GPU); NULL if none */
    int fd;         /* shareable fd sent to clients (memfd, VMM fd), or -1 */
    uint64_t bytes; /* size of the object */
    void *priv;     /* backend's own state */
} kvd_segment_mem;

typedef struct kvd_backend_ops {
    const char *name; /* "host", "malloc", "cuda-vmm", "cuda-ipc" */
    /* Creates a segment of at least bytes; writes *out only on success. */
    kv_err (*segment_alloc)(void *ctx, uint64_t bytes, kvd_segment_mem *out);
    /* Destroys a segment made by segment_alloc; accepts a zeroed one. */
    void (*segment_free)(void *ctx, kvd_segment_mem *mem);
} kvd_backend_ops;

/* Plain malloc, fd = -1: for unit tests and benchmarks of the core. ctx is unused. */
extern const kvd_backend_ops kvd_backend_malloc;

#endif
