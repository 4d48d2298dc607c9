/* kvd_backend_cuda: GPU segment memory, and the choice of backend at start.
 *
 * Two backends over the driver API (common/kv_cuda.h, loaded at run time):
 *  - cuda-vmm: each segment is one cuMemCreate allocation (pinned device memory, POSIX file
 *    descriptor handle type), its size a multiple of the device's allocation granularity. The
 *    fd from cuMemExportToShareableHandle travels to clients as SCM_RIGHTS like a memfd; the
 *    client imports, reserves, maps and sets access. No hostIPC / shared PID namespace needed.
 *    The allocation lives until the daemon and every importer released it, so freeing a segment
 *    in the daemon never pulls memory from under a client that still maps it.
 *  - cuda-ipc (legacy): each segment is one cuMemAlloc allocation (the driver's cudaMalloc),
 *    exported with cuIpcGetMemHandle; the 64 handle bytes travel in Segment.ipc_handle and no
 *    fd is sent. Freeing such memory while an importer has it open is undefined in CUDA, so a
 *    cuda-ipc daemon frees no pool while it runs (daemon/registry) and waits for its sessions
 *    at shutdown (shutdown-grace-ms).
 * The daemon keeps its own mapping of every segment (kvd_segment_mem.base is a device address)
 * and zeroes new segments, so no bytes of an earlier owner of the memory reach a tenant.
 *
 * Loop thread only (the thread that opened the backend: the driver's current context is per
 * thread, and every call sets it again), but for the ops' copy_to_host / copy_to_device /
 * copy_sync / host_alloc / host_free, which the tiers' copy threads call (each call makes the
 * context current on its thread; the driver is thread-safe): a GPU pool's blocks go down to host
 * memory and disk and come back with async driver copies, each calling thread on a stream of its
 * own (non-blocking, made at its first copy, destroyed at close), into and out of page-locked
 * host memory where the tiers have it.
 */
#ifndef KVD_BACKEND_CUDA_H
#define KVD_BACKEND_CUDA_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "common/kv_err.h"
#include "daemon/core/backend.h"
#include "daemon/mem/backend_host.h"
#include "common/kv_cuda.h"

#define KVD_CUDA_STREAMS 16 /* copy streams per context (threads beyond share them) */

/* The ctx of both GPU backends. */
typedef struct kvd_backend_cuda_ctx {
    kv_cuda cu;          /* the loaded driver */
    kv_cuda_device dev;  /* the device segments live on; primary context retained */
    uint32_t kind;       /* KVD_MEM_CUDA_VMM or KVD_MEM_CUDA_IPC */
    uint64_t align;      /* segment and section granularity (bytes, power of two) */
    uint64_t segments;   /* live segments */
    uint64_t bytes;      /* their bytes */
    pthread_mutex_t smu; /* guards streams (copy threads make them) */
    kv_cu_stream streams[KVD_CUDA_STREAMS]; /* a copy thread's: streams[its slot] */
} kvd_backend_cuda_ctx;

/* Loads the driver (lib NULL: kv_cuda_library_name()), opens device and checks that it can do
 * kind (KVD_MEM_CUDA_VMM needs VMM and POSIX-fd handles). Fills *ctx only on success; on
 * failure returns KV_ENOGPU (KV_EINVAL for a kind that is not a GPU kind) with a sentence in
 * why, and nothing stays loaded. Loop thread. */
kv_err kvd_backend_cuda_open(kvd_backend_cuda_ctx *ctx, uint32_t kind, int device, const char *lib,
                             char *why, size_t why_len);

/* Releases the context and unloads the driver; every segment must be freed first. Accepts NULL
 * and a zeroed ctx. */
void kvd_backend_cuda_close(kvd_backend_cuda_ctx *ctx);

/* segment_alloc: KV_ENOMEM when the device is full, KV_ESYS for other driver errors (logged
 * with the driver's error name), KV_EINVAL for 0 bytes. segment_free: unmaps and releases;
 * accepts a zeroed segment. ctx is a kvd_backend_cuda_ctx opened with the matching kind. */
extern const kvd_backend_ops kvd_backend_cuda_vmm;
extern const kvd_backend_ops kvd_backend_cuda_ipc;

/* Copies n bytes from device address src to device address dst (segment bases of this backend
 * plus offsets; the ranges must not overlap) with cuMemcpyDtoD, after making the context
 * current. The copy may still be in flight on return: call kvd_backend_cuda_sync before the
 * bytes are published. KV_ESYS for a driver error (logged). Loop thread. */
kv_err kvd_backend_cuda_copy(kvd_backend_cuda_ctx *ctx, void *dst, const void *src, uint64_t n);

/* Waits (cuCtxSynchronize) until every copy queued on the context has completed. KV_ESYS for a
 * driver error (logged; a failed copy surfaces here). Loop thread. */
kv_err kvd_backend_cuda_sync(kvd_backend_cuda_ctx *ctx);

/* The backend kvd runs with, chosen once at start. */
typedef struct kvd_backend_sel {
    const kvd_backend_ops *ops; /* the table pools use */
    void *ctx;                  /* its ctx: the caller's host ctx, or cuda */
    kvd_backend_cuda_ctx *cuda; /* heap, owned; NULL for host */
    char reason[320];           /* one line: what was chosen and why (logged at start) */
} kvd_backend_sel;

/* Chooses the backend named name ("auto", "host", "cuda-vmm", "cuda-ipc") on GPU ordinal
 * device. "auto" takes cuda-vmm when the device supports it, else cuda-ipc, else host, and the
 * reason says why ("backend host: no usable GPU: libcuda.so.1 not found (...)"). An explicit GPU
 * backend that cannot be had is KV_ENOGPU with the reason in why; an unknown name KV_EINVAL.
 * host is the caller's host ctx (borrowed; must outlive the selection). lib as for
 * kvd_backend_cuda_open. Writes *out only on success. Loop thread. */
kv_err kvd_backend_select(const char *name, int device, const char *lib, kvd_backend_host_ctx *host,
                          kvd_backend_sel *out, char *why, size_t why_len);

/* Closes the GPU backend of a selection (after every pool is freed). Accepts NULL and zeroed. */
void kvd_backend_sel_fini(kvd_backend_sel *sel);

#endif
