/* kvd_backend: where segment memory comes from. One const table of functions per backend
 * (host memfd, malloc for tests, cuda-vmm, cuda-ipc); pools call it only to create and destroy
 * segments, never per block. Called on the loop thread only, but for the copy_* entries (the
 * tiers' copy threads move GPU blocks with them).
 */
#ifndef KVD_BACKEND_H
#define KVD_BACKEND_H

#include <stdint.h>

#include "common/kv_err.h"

#define KVD_MAX_SEGMENT_PARTS 4096 /* allocations one segment may be made of */

/* One segment: the memory of a run of blocks. Usually one memory object (one fd); a cuda-vmm
 * segment of a LAYER_MAJOR pool is made of parts, one allocation per (layer, K|V) section plus
 * one for the scales, mapped back to back, so that clients can map every section into its
 * layer tensor at offset 0 of its own allocation (cuda.h says cuMemMap's offset "currently must
 * be zero"; no driver's answer about non-zero offsets matters then). */
typedef struct kvd_segment_mem {
    void *base;             /* daemon's own mapping (host) or device pointer (GPU); NULL if none */
    int fd;                 /* shareable fd sent to clients (memfd, VMM fd), or -1; parts: -1 */
    uint64_t bytes;         /* size of the object (parts: their sum) */
    void *priv;             /* backend's own state */
    uint8_t ipc_handle[64]; /* CUDA_IPC backends: the exported cuIpcGetMemHandle bytes */
    uint32_t nparts;        /* 0: one object (fd); else the allocations it is made of */
    int *part_fds;          /* [nparts] their shareable fds, in address order */
    uint64_t *part_bytes;   /* [nparts] their sizes; they add up to bytes */
} kvd_segment_mem;

/* kvd.MemoryKind numbers (proto/kvd.proto): how a backend's segments travel to clients. */
#define KVD_MEM_NONE 0       /* not shareable (malloc) */
#define KVD_MEM_HOST_MEMFD 1 /* fd over SCM_RIGHTS; mmap */
#define KVD_MEM_CUDA_VMM 2   /* fd over SCM_RIGHTS; cuMemImportFromShareableHandle */
#define KVD_MEM_CUDA_IPC 3   /* ipc_handle bytes; cuIpcOpenMemHandle */

typedef struct kvd_backend_ops {
    const char *name; /* "host", "malloc", "cuda-vmm", "cuda-ipc" */
    /* Creates a segment of at least bytes; writes *out only on success. */
    kv_err (*segment_alloc)(void *ctx, uint64_t bytes, kvd_segment_mem *out);
    /* Destroys a segment made by segment_alloc; accepts a zeroed one. */
    void (*segment_free)(void *ctx, kvd_segment_mem *mem);
    uint32_t kind; /* KVD_MEM_*: what Segment.kind says; 0 (NONE) for malloc */
    /* The size segments and, in LAYER_MAJOR pools, each (layer, K|V) section of a segment must
     * be a multiple of so that clients can map sections at offsets (CUDA VMM granularity).
     * NULL: the page size. A power of two. */
    uint64_t (*align)(void *ctx);
    /* Optional: copies n bytes into (write) or out of (read) segment mem at byte offset off, and
     * returns when the bytes are in place (a device copy is synchronized). NULL: the segment's
     * base is host memory the daemon may touch directly (kvd_segment_write/read do). */
    kv_err (*segment_write)(void *ctx, const kvd_segment_mem *mem, uint64_t off, const void *src,
                            uint64_t n);
    kv_err (*segment_read)(void *ctx, const kvd_segment_mem *mem, uint64_t off, void *dst,
                           uint64_t n);
    /* Optional: creates a segment of nparts allocations of part_bytes[i] bytes each, back to back
     * (base covers them all); writes *out only on success. NULL where the backend has only
     * whole segments. */
    kv_err (*segment_alloc_parts)(void *ctx, const uint64_t *part_bytes, uint32_t nparts,
                                  kvd_segment_mem *out);
    /* Releases the physical memory of a segment while the memory object, its fd and every
     * mapping of it (the daemon's and clients') stay valid; pages read as zeros afterwards and
     * fault in fresh when written. Pools park idle segments with it (kvd_pool_park). NULL where
     * the backend cannot (malloc, cuda-vmm, cuda-ipc: a CUDA allocation cannot give back part of
     * its physical memory while it stays mapped), and then memory does not move between pools.
     * KV_ESYS when the system refuses. */
    kv_err (*segment_discard)(void *ctx, kvd_segment_mem *mem);
    /* Optional, with segment_discard: takes a discarded segment's memory back before its blocks
     * are handed out again (kvd_pool_unpark), where a page faulted in later could be missing:
     * huge pages another user took meanwhile, whose first touch would be SIGBUS in a worker or
     * in kvd. KV_ENOMEM when the system has none now (the segment stays parked). NULL: pages
     * fault in fresh when written (tmpfs). */
    kv_err (*segment_restore)(void *ctx, kvd_segment_mem *mem);
    /* Optional, for GPU backends, and the only calls here that any thread may make (the tiers'
     * copy threads): copies n bytes between a device address inside one of this backend's
     * segments (a segment's base plus an offset) and host memory, on the calling thread's own
     * copy stream. Either may return before the copy has landed: dst of copy_to_host must not be
     * read, and src of copy_to_device not changed or freed, until copy_sync on the same thread
     * has returned; copy_sync waits for every copy the calling thread started (only those). Host
     * memory from host_alloc moves asynchronously at the link's full rate; pageable memory goes
     * through the driver's staging buffers (copy_to_host then returns with the bytes in dst, and
     * copy_to_device has taken src's bytes when it returns).
     * NULL where segment memory is host memory the daemon maps itself (memcpy does). KV_ESYS on
     * a driver error (logged). */
    kv_err (*copy_to_host)(void *ctx, void *dst, const void *src_dev, uint64_t n);
    kv_err (*copy_to_device)(void *ctx, void *dst_dev, const void *src, uint64_t n);
    kv_err (*copy_sync)(void *ctx);
    /* Optional, GPU backends, any thread: page-locked host memory of at least n bytes that every
     * context of the process may copy to and from (cuMemHostAlloc, portable), or NULL when the
     * driver has none to give (the caller falls back to malloc). host_free gives it back (never
     * free()); it waits for copies still using it, so the tiers call it off the loop thread. */
    void *(*host_alloc)(void *ctx, uint64_t n);
    void (*host_free)(void *ctx, void *p);
} kvd_backend_ops;

/* Writes or reads n bytes of a segment at offset off through the backend: on GPU backends the
 * base is a device address no host load may touch (the driver copies), on the others it is the
 * daemon's own mapping. KV_EINVAL for a range outside the segment; backend errors pass through.
 * Loop thread. */
kv_err kvd_segment_write(const kvd_backend_ops *be, void *ctx, const kvd_segment_mem *mem,
                         uint64_t off, const void *src, uint64_t n);
kv_err kvd_segment_read(const kvd_backend_ops *be, void *ctx, const kvd_segment_mem *mem,
                        uint64_t off, void *dst, uint64_t n);

/* Plain malloc, fd = -1: for unit tests and benchmarks of the core. ctx is unused. */
extern const kvd_backend_ops kvd_backend_malloc;

#endif
