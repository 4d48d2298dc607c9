/* kvd_backend_cuda: cuda-vmm and cuda-ipc segments, and backend selection. Every driver call
 * first makes the backend's context current: the loop thread may have run other CUDA code. */
#include "daemon/mem/backend_cuda.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/kv_log.h"

#define IPC_ALIGN (2ull << 20) /* cuMemAlloc hands out 2 MiB pages for large allocations */

/* cuda-vmm segment state: its allocations (one, or one per part) and the daemon's own mapping
 * of them back to back. */
typedef struct vmm_seg {
    uint32_t n;               /* allocations */
    kv_cu_mem_handle *handle; /* [n] cuMemCreate */
    uint64_t *bytes;          /* [n] their sizes */
    int *fds;                 /* [n] exported fds */
    kv_cu_deviceptr va;       /* reserved range of total bytes */
    uint64_t total;           /* sum of bytes */
    uint32_t mapped;          /* allocations mapped into va so far */
    uint32_t made;            /* allocations created so far */
} vmm_seg;

static kv_err driver_err(kvd_backend_cuda_ctx *c, kv_cu_result r, const char *what,
                         uint64_t bytes) {
    char buf[160];
    KV_LOG(ERROR, "KVD-CUDA-SEGMENT", "%s of a %llu-byte segment on device %d failed: %s", what,
           (unsigned long long)bytes, c->dev.ordinal,
           kv_cuda_strerror(&c->cu, r, buf, sizeof(buf)));
    return r == KV_CU_ERROR_OUT_OF_MEMORY ? KV_ENOMEM : KV_ESYS;
}

static uint64_t round_up(uint64_t v, uint64_t a) {
    return (v + a - 1) / a * a;
}

static kv_err make_current(kvd_backend_cuda_ctx *c) {
    kv_cu_result r = c->cu.ctx_set_current(c->dev.ctx);
    return r == KV_CU_SUCCESS ? KV_OK : driver_err(c, r, "cuCtxSetCurrent", 0);
}

/* Zeroes a new segment: device memory is not promised to be clean, and a segment may go to a
 * tenant other than whoever used the memory before. */
static kv_err zero(kvd_backend_cuda_ctx *c, kv_cu_deviceptr p, uint64_t bytes) {
    kv_cu_result r = c->cu.memset_d8(p, 0, (size_t)bytes);
    if (r == KV_CU_SUCCESS) {
        r = c->cu.ctx_synchronize();
    }
    return r == KV_CU_SUCCESS ? KV_OK : driver_err(c, r, "zeroing", bytes);
}

/* Undoes what vmm_make made of s (in reverse), and frees s. Context current. */
static void vmm_unmake(kvd_backend_cuda_ctx *c, vmm_seg *s) {
    uint64_t off = 0;
    for (uint32_t i = 0; i < s->mapped; i++) {
        c->cu.mem_unmap(s->va + off, (size_t)s->bytes[i]);
        off += s->bytes[i];
    }
    if (s->va != 0) {
        c->cu.mem_address_free(s->va, (size_t)s->total);
    }
    for (uint32_t i = 0; i < s->made; i++) {
        if (s->fds[i] > 2) {
            close(s->fds[i]);
        }
        c->cu.mem_release(s->handle[i]);
    }
    free(s->handle);
    free(s->bytes);
    free(s->fds);
    free(s);
}

/* Creates n allocations of sizes[i] (granularity multiples), exports each as a POSIX fd and maps
 * them back to back into one range the daemon reads and writes through; zeroes it. Unmapping
 * drops only the daemon's use: the physical memory stays while an importer holds it. */
static kv_err vmm_make(kvd_backend_cuda_ctx *c, const uint64_t *sizes, uint32_t n, vmm_seg **out) {
    kv_err rc = make_current(c);
    if (rc != KV_OK) {
        return rc;
    }
    vmm_seg *s = calloc(1, sizeof(*s));
    if (s == NULL) {
        return KV_ENOMEM;
    }
    s->n = n;
    s->handle = calloc(n, sizeof(*s->handle));
    s->bytes = calloc(n, sizeof(*s->bytes));
    s->fds = calloc(n, sizeof(*s->fds));
    if (s->handle == NULL || s->bytes == NULL || s->fds == NULL) {
        vmm_unmake(c, s);
        return KV_ENOMEM;
    }
    kv_cu_alloc_prop prop;
    memset(&prop, 0, sizeof(prop));
    prop.type = KV_CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requested_handle_types = KV_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    prop.location.type = KV_CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = c->dev.dev;
    for (uint32_t i = 0; i < n; i++) {
        s->bytes[i] = sizes[i];
        s->total += sizes[i];
        s->fds[i] = -1;
        kv_cu_result r = c->cu.mem_create(&s->handle[i], (size_t)sizes[i], &prop, 0);
        if (r != KV_CU_SUCCESS) {
            rc = driver_err(c, r, "cuMemCreate", sizes[i]);
            goto fail;
        }
        s->made++;
        r = c->cu.mem_export(&s->fds[i], s->handle[i], KV_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                             0);
        if (r != KV_CU_SUCCESS || s->fds[i] < 0) {
            rc = driver_err(c, r, "cuMemExportToShareableHandle", sizes[i]);
            goto fail;
        }
    }
    kv_cu_result r = c->cu.mem_address_reserve(&s->va, (size_t)s->total, (size_t)c->align, 0, 0);
    if (r != KV_CU_SUCCESS) {
        s->va = 0;
        rc = driver_err(c, r, "cuMemAddressReserve", s->total);
        goto fail;
    }
    kv_cu_access_desc acc;
    memset(&acc, 0, sizeof(acc));
    acc.location.type = KV_CU_MEM_LOCATION_TYPE_DEVICE;
    acc.location.id = c->dev.dev;
    acc.flags = KV_CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    uint64_t off = 0;
    for (uint32_t i = 0; i < n; i++) {
        /* Offset 0 of each allocation: what every driver supports. */
        r = c->cu.mem_map(s->va + off, (size_t)s->bytes[i], 0, s->handle[i], 0);
        if (r != KV_CU_SUCCESS) {
            rc = driver_err(c, r, "cuMemMap", s->bytes[i]);
            goto fail;
        }
        s->mapped++;
        r = c->cu.mem_set_access(s->va + off, (size_t)s->bytes[i], &acc, 1);
        if (r != KV_CU_SUCCESS) {
            rc = driver_err(c, r, "cuMemSetAccess", s->bytes[i]);
            goto fail;
        }
        rc = zero(c, s->va + off, s->bytes[i]);
        if (rc != KV_OK) {
            goto fail;
        }
        off += s->bytes[i];
    }
    *out = s;
    return KV_OK;
fail:
    vmm_unmake(c, s);
    return rc;
}

static void vmm_out(kvd_backend_cuda_ctx *c, vmm_seg *s, int parts, kvd_segment_mem *out) {
    memset(out, 0, sizeof(*out));
    out->base = (void *)(uintptr_t)s->va;
    out->bytes = s->total;
    out->priv = s;
    out->fd = parts ? -1 : s->fds[0];
    out->nparts = parts ? s->n : 0;
    out->part_fds = parts ? s->fds : NULL;
    out->part_bytes = parts ? s->bytes : NULL;
    c->segments++;
    c->bytes += s->total;
}

static kv_err vmm_alloc(void *ctx, uint64_t bytes, kvd_segment_mem *out) {
    kvd_backend_cuda_ctx *c = ctx;
    if (bytes == 0) {
        return KV_EINVAL;
    }
    uint64_t size = round_up(bytes, c->align);
    vmm_seg *s;
    kv_err rc = vmm_make(c, &size, 1, &s);
    if (rc == KV_OK) {
        vmm_out(c, s, 0, out);
    }
    return rc;
}

static kv_err vmm_alloc_parts(void *ctx, const uint64_t *part_bytes, uint32_t nparts,
                              kvd_segment_mem *out) {
    kvd_backend_cuda_ctx *c = ctx;
    if (nparts == 0 || nparts > KVD_MAX_SEGMENT_PARTS) {
        return KV_EINVAL;
    }
    uint64_t *sizes = calloc(nparts, sizeof(*sizes));
    if (sizes == NULL) {
        return KV_ENOMEM;
    }
    for (uint32_t i = 0; i < nparts; i++) {
        if (part_bytes[i] == 0) {
            free(sizes);
            return KV_EINVAL;
        }
        sizes[i] = round_up(part_bytes[i], c->align);
    }
    vmm_seg *s;
    kv_err rc = vmm_make(c, sizes, nparts, &s);
    free(sizes);
    if (rc == KV_OK) {
        vmm_out(c, s, 1, out);
    }
    return rc;
}

static void vmm_free(void *ctx, kvd_segment_mem *mem) {
    kvd_backend_cuda_ctx *c = ctx;
    if (mem == NULL || mem->priv == NULL) {
        return;
    }
    vmm_seg *s = mem->priv;
    c->segments--;
    c->bytes -= s->total;
    if (make_current(c) == KV_OK) {
        vmm_unmake(c, s);
    }
    memset(mem, 0, sizeof(*mem));
    mem->fd = -1;
}

static kv_err ipc_alloc(void *ctx, uint64_t bytes, kvd_segment_mem *out) {
    kvd_backend_cuda_ctx *c = ctx;
    if (bytes == 0) {
        return KV_EINVAL;
    }
    kv_err rc = make_current(c);
    if (rc != KV_OK) {
        return rc;
    }
    uint64_t size = round_up(bytes, c->align);
    kv_cu_deviceptr p = 0;
    kv_cu_result r = c->cu.mem_alloc(&p, (size_t)size);
    if (r != KV_CU_SUCCESS) {
        return driver_err(c, r, "cuMemAlloc", size);
    }
    kv_cu_ipc_mem_handle h;
    r = c->cu.ipc_get_mem_handle(&h, p);
    if (r != KV_CU_SUCCESS) {
        rc = driver_err(c, r, "cuIpcGetMemHandle", size);
        goto cleanup_mem;
    }
    rc = zero(c, p, size);
    if (rc != KV_OK) {
        goto cleanup_mem;
    }
    memset(out, 0, sizeof(*out));
    out->base = (void *)(uintptr_t)p;
    out->fd = -1;
    out->bytes = size;
    out->priv = NULL;
    memcpy(out->ipc_handle, h.reserved, sizeof(out->ipc_handle));
    c->segments++;
    c->bytes += size;
    return KV_OK;
cleanup_mem:
    c->cu.mem_free(p);
    return rc;
}

static void ipc_free(void *ctx, kvd_segment_mem *mem) {
    kvd_backend_cuda_ctx *c = ctx;
    if (mem == NULL || mem->base == NULL) {
        return;
    }
    if (make_current(c) == KV_OK) {
        c->cu.mem_free((kv_cu_deviceptr)(uintptr_t)mem->base);
    }
    c->segments--;
    c->bytes -= mem->bytes;
    mem->base = NULL;
    mem->bytes = 0;
    memset(mem->ipc_handle, 0, sizeof(mem->ipc_handle));
}

kv_err kvd_backend_cuda_copy(kvd_backend_cuda_ctx *ctx, void *dst, const void *src, uint64_t n) {
    kv_err rc = make_current(ctx);
    if (rc != KV_OK) {
        return rc;
    }
    kv_cu_result r = ctx->cu.memcpy_dtod((kv_cu_deviceptr)(uintptr_t)dst,
                                         (kv_cu_deviceptr)(uintptr_t)src, (size_t)n);
    if (r != KV_CU_SUCCESS) {
        char buf[160];
        KV_LOG(ERROR, "KVD-CUDA-SEGMENT", "cuMemcpyDtoD of %llu bytes on device %d failed: %s",
               (unsigned long long)n, ctx->dev.ordinal,
               kv_cuda_strerror(&ctx->cu, r, buf, sizeof(buf)));
        return KV_ESYS;
    }
    return KV_OK;
}

kv_err kvd_backend_cuda_sync(kvd_backend_cuda_ctx *ctx) {
    kv_err rc = make_current(ctx);
    if (rc != KV_OK) {
        return rc;
    }
    kv_cu_result r = ctx->cu.ctx_synchronize();
    if (r != KV_CU_SUCCESS) {
        char buf[160];
        KV_LOG(ERROR, "KVD-CUDA-SEGMENT", "cuCtxSynchronize after copies on device %d failed: %s",
               ctx->dev.ordinal, kv_cuda_strerror(&ctx->cu, r, buf, sizeof(buf)));
        return KV_ESYS;
    }
    return KV_OK;
}

static kv_err cuda_seg_write(void *ctx, const kvd_segment_mem *mem, uint64_t off, const void *src,
                             uint64_t n) {
    kvd_backend_cuda_ctx *c = ctx;
    kv_err rc = make_current(c);
    if (rc != KV_OK) {
        return rc;
    }
    kv_cu_result r = c->cu.memcpy_htod((kv_cu_deviceptr)(uintptr_t)mem->base + off, src, (size_t)n);
    if (r == KV_CU_SUCCESS) {
        r = c->cu.ctx_synchronize(); /* the bytes are in place when this returns */
    }
    return r == KV_CU_SUCCESS ? KV_OK : driver_err(c, r, "cuMemcpyHtoD into", mem->bytes);
}

static kv_err cuda_seg_read(void *ctx, const kvd_segment_mem *mem, uint64_t off, void *dst,
                            uint64_t n) {
    kvd_backend_cuda_ctx *c = ctx;
    kv_err rc = make_current(c);
    if (rc != KV_OK) {
        return rc;
    }
    kv_cu_result r = c->cu.memcpy_dtoh(dst, (kv_cu_deviceptr)(uintptr_t)mem->base + off, (size_t)n);
    return r == KV_CU_SUCCESS ? KV_OK : driver_err(c, r, "cuMemcpyDtoH out of", mem->bytes);
}

/* The tiers' copies (backend.h, copy_*): any thread; make_current sets the context on the
 * calling copy thread each time (the driver's current context is per thread). */
static kv_err cuda_copy_err(kvd_backend_cuda_ctx *c, kv_cu_result r, const char *what, uint64_t n) {
    char buf[160];
    KV_LOG(ERROR, "KVD-CUDA-COPY", "%s of %llu bytes on device %d failed: %s", what,
           (unsigned long long)n, c->dev.ordinal, kv_cuda_strerror(&c->cu, r, buf, sizeof(buf)));
    return KV_ESYS;
}

/* The calling thread's copy stream of c (made at its first copy). Threads take slots in turn,
 * process-wide; past KVD_CUDA_STREAMS they share (correct: a stream's sync then also waits for
 * the other thread's copies). Context current. */
static atomic_uint next_slot;
static __thread int tls_slot = -1;

static kv_err thread_stream(kvd_backend_cuda_ctx *c, kv_cu_stream *out) {
    if (tls_slot < 0) {
        tls_slot = (int)(atomic_fetch_add(&next_slot, 1u) % KVD_CUDA_STREAMS);
    }
    kv_err rc = KV_OK;
    pthread_mutex_lock(&c->smu);
    kv_cu_stream s = c->streams[tls_slot];
    if (s == NULL) {
        kv_cu_result r = c->cu.stream_create(&s, KV_CU_STREAM_NON_BLOCKING);
        if (r == KV_CU_SUCCESS) {
            c->streams[tls_slot] = s;
        } else {
            rc = cuda_copy_err(c, r, "cuStreamCreate (tier copies)", 0);
        }
    }
    pthread_mutex_unlock(&c->smu);
    *out = s;
    return rc;
}

/* The context made current on this thread, and its copy stream. */
static kv_err copy_begin(kvd_backend_cuda_ctx *c, kv_cu_stream *s) {
    kv_err rc = make_current(c);
    return rc == KV_OK ? thread_stream(c, s) : rc;
}

static kv_err cuda_copy_to_host(void *ctx, void *dst, const void *src_dev, uint64_t n) {
    kvd_backend_cuda_ctx *c = ctx;
    kv_cu_stream s = NULL;
    kv_err rc = copy_begin(c, &s);
    if (rc != KV_OK) {
        return rc;
    }
    kv_cu_result r =
        c->cu.memcpy_dtoh_async(dst, (kv_cu_deviceptr)(uintptr_t)src_dev, (size_t)n, s);
    return r == KV_CU_SUCCESS ? KV_OK : cuda_copy_err(c, r, "cuMemcpyDtoHAsync (tier copy)", n);
}

static kv_err cuda_copy_to_device(void *ctx, void *dst_dev, const void *src, uint64_t n) {
    kvd_backend_cuda_ctx *c = ctx;
    kv_cu_stream s = NULL;
    kv_err rc = copy_begin(c, &s);
    if (rc != KV_OK) {
        return rc;
    }
    kv_cu_result r =
        c->cu.memcpy_htod_async((kv_cu_deviceptr)(uintptr_t)dst_dev, src, (size_t)n, s);
    return r == KV_CU_SUCCESS ? KV_OK : cuda_copy_err(c, r, "cuMemcpyHtoDAsync (tier copy)", n);
}

static kv_err cuda_copy_sync(void *ctx) {
    kvd_backend_cuda_ctx *c = ctx;
    kv_cu_stream s = NULL;
    kv_err rc = copy_begin(c, &s);
    if (rc != KV_OK) {
        return rc;
    }
    kv_cu_result r = c->cu.stream_synchronize(s);
    return r == KV_CU_SUCCESS ? KV_OK : cuda_copy_err(c, r, "cuStreamSynchronize (tier copies)", 0);
}

static void *cuda_host_alloc(void *ctx, uint64_t n) {
    kvd_backend_cuda_ctx *c = ctx;
    void *p = NULL;
    if (make_current(c) != KV_OK ||
        c->cu.mem_host_alloc(&p, (size_t)n, KV_CU_MEMHOSTALLOC_PORTABLE) != KV_CU_SUCCESS) {
        return NULL; /* the caller falls back to pageable memory and counts it */
    }
    return p;
}

static void cuda_host_free(void *ctx, void *p) {
    kvd_backend_cuda_ctx *c = ctx;
    if (p == NULL || make_current(c) != KV_OK) {
        return;
    }
    kv_cu_result r = c->cu.mem_free_host(p);
    if (r != KV_CU_SUCCESS) {
        (void)cuda_copy_err(c, r, "cuMemFreeHost (tier-1 buffer)", 0);
    }
}

static uint64_t cuda_align(void *ctx) {
    const kvd_backend_cuda_ctx *c = ctx;
    return c->align;
}

const kvd_backend_ops kvd_backend_cuda_vmm = {
    .name = "cuda-vmm",
    .segment_alloc = vmm_alloc,
    .segment_free = vmm_free,
    .kind = KVD_MEM_CUDA_VMM,
    .align = cuda_align,
    .segment_write = cuda_seg_write,
    .segment_read = cuda_seg_read,
    .segment_alloc_parts = vmm_alloc_parts,
    .copy_to_host = cuda_copy_to_host,
    .copy_to_device = cuda_copy_to_device,
    .copy_sync = cuda_copy_sync,
    .host_alloc = cuda_host_alloc,
    .host_free = cuda_host_free,
    /* No segment_discard: clients import the whole allocation (one physical handle), which cannot
     * shrink while they hold it, so cuda-vmm pools never park and memory does not move between
     * them (a new pool gets ENOSPC once pool-memory is spent). */
    .segment_discard = NULL,
};

const kvd_backend_ops kvd_backend_cuda_ipc = {
    .name = "cuda-ipc",
    .segment_alloc = ipc_alloc,
    .segment_free = ipc_free,
    .kind = KVD_MEM_CUDA_IPC,
    .align = cuda_align,
    .segment_write = cuda_seg_write,
    .segment_read = cuda_seg_read,
    .copy_to_host = cuda_copy_to_host,
    .copy_to_device = cuda_copy_to_device,
    .copy_sync = cuda_copy_sync,
    .host_alloc = cuda_host_alloc,
    .host_free = cuda_host_free,
    /* No segment_discard: a cuMemAlloc block opened by clients with cuIpcOpenMemHandle cannot
     * release part of its memory, so cuda-ipc pools never park (see cuda-vmm). */
    .segment_discard = NULL,
};

kv_err kvd_backend_cuda_open(kvd_backend_cuda_ctx *ctx, uint32_t kind, int device, const char *lib,
                             char *why, size_t why_len) {
    if (kind != KVD_MEM_CUDA_VMM && kind != KVD_MEM_CUDA_IPC) {
        snprintf(why, why_len, "memory kind %u is not a GPU kind", kind);
        return KV_EINVAL;
    }
    kvd_backend_cuda_ctx c;
    memset(&c, 0, sizeof(c));
    c.kind = kind;
    kv_err rc = kv_cuda_load(lib, &c.cu, why, why_len);
    if (rc != KV_OK) {
        return rc;
    }
    rc = kv_cuda_device_open(&c.cu, device, &c.dev, why, why_len);
    if (rc != KV_OK) {
        goto cleanup_driver;
    }
    if (kind == KVD_MEM_CUDA_VMM) {
        if (!c.dev.vmm || !c.dev.posix_fd || c.dev.granularity == 0) {
            snprintf(why, why_len,
                     "device %d (%s) cannot export VMM memory as file descriptors (virtual memory "
                     "management %s, POSIX fd handles %s); use cuda-ipc",
                     device, c.dev.name, c.dev.vmm ? "yes" : "no", c.dev.posix_fd ? "yes" : "no");
            rc = KV_ENOGPU;
            goto cleanup_device;
        }
        c.align = c.dev.granularity;
    } else {
        c.align = IPC_ALIGN;
    }
    *ctx = c;
    pthread_mutex_init(&ctx->smu, NULL);
    return KV_OK;
cleanup_device:
    kv_cuda_device_close(&c.cu, &c.dev);
cleanup_driver:
    kv_cuda_unload(&c.cu);
    return rc;
}

void kvd_backend_cuda_close(kvd_backend_cuda_ctx *ctx) {
    if (ctx == NULL || ctx->cu.lib == NULL) {
        return;
    }
    KV_ASSERT(ctx->segments == 0);
    if (make_current(ctx) == KV_OK) {
        for (int i = 0; i < KVD_CUDA_STREAMS; i++) {
            if (ctx->streams[i] != NULL) {
                (void)ctx->cu.stream_destroy(ctx->streams[i]); /* the copy threads are done */
            }
        }
    }
    pthread_mutex_destroy(&ctx->smu);
    kv_cuda_device_close(&ctx->cu, &ctx->dev);
    kv_cuda_unload(&ctx->cu);
    memset(ctx, 0, sizeof(*ctx));
}

/* Opens the GPU backend of kind into a heap ctx; on success fills sel. */
static kv_err select_gpu(uint32_t kind, int device, const char *lib, kvd_backend_sel *sel,
                         char *why, size_t why_len) {
    kvd_backend_cuda_ctx *c = calloc(1, sizeof(*c));
    if (c == NULL) {
        snprintf(why, why_len, "out of memory");
        return KV_ENOMEM;
    }
    kv_err rc = kvd_backend_cuda_open(c, kind, device, lib, why, why_len);
    if (rc != KV_OK) {
        free(c);
        return rc;
    }
    sel->ops = kind == KVD_MEM_CUDA_VMM ? &kvd_backend_cuda_vmm : &kvd_backend_cuda_ipc;
    sel->ctx = c;
    sel->cuda = c;
    snprintf(sel->reason, sizeof(sel->reason),
             "backend %s: device %d (%s), driver %d.%d, segment granularity %llu bytes",
             sel->ops->name, device, c->dev.name, c->cu.driver_version / 1000,
             c->cu.driver_version % 1000 / 10, (unsigned long long)c->align);
    return KV_OK;
}

kv_err kvd_backend_select(const char *name, int device, const char *lib, kvd_backend_host_ctx *host,
                          kvd_backend_sel *out, char *why, size_t why_len) {
    kvd_backend_sel sel;
    memset(&sel, 0, sizeof(sel));
    char gpu_why[256] = "";
    kv_err rc;
    if (strcmp(name, "host") == 0) {
        sel.ops = &kvd_backend_host;
        sel.ctx = host;
        snprintf(sel.reason, sizeof(sel.reason), "backend host: chosen by the backend option");
    } else if (strcmp(name, "cuda-vmm") == 0 || strcmp(name, "cuda-ipc") == 0) {
        uint32_t kind = name[5] == 'v' ? KVD_MEM_CUDA_VMM : KVD_MEM_CUDA_IPC;
        rc = select_gpu(kind, device, lib, &sel, gpu_why, sizeof(gpu_why));
        if (rc != KV_OK) {
            snprintf(why, why_len, "backend %s: no usable GPU: %s", name, gpu_why);
            return rc;
        }
    } else if (strcmp(name, "auto") == 0) {
        rc = select_gpu(KVD_MEM_CUDA_VMM, device, lib, &sel, gpu_why, sizeof(gpu_why));
        if (rc != KV_OK && strstr(gpu_why, "cannot export VMM memory") != NULL) {
            /* The GPU works but cannot share VMM memory as fds: the legacy path still can. */
            rc = select_gpu(KVD_MEM_CUDA_IPC, device, lib, &sel, gpu_why, sizeof(gpu_why));
        }
        if (rc == KV_ENOMEM) {
            snprintf(why, why_len, "backend auto: out of memory");
            return rc;
        }
        if (rc != KV_OK) {
            sel.ops = &kvd_backend_host;
            sel.ctx = host;
            snprintf(sel.reason, sizeof(sel.reason), "backend host: no usable GPU: %s", gpu_why);
        }
    } else {
        snprintf(why, why_len, "unknown backend '%s' (auto, host, cuda-vmm or cuda-ipc)", name);
        return KV_EINVAL;
    }
    *out = sel;
    return KV_OK;
}

void kvd_backend_sel_fini(kvd_backend_sel *sel) {
    if (sel == NULL) {
        return;
    }
    if (sel->cuda != NULL) {
        kvd_backend_cuda_close(sel->cuda);
        free(sel->cuda);
    }
    memset(sel, 0, sizeof(*sel));
}
