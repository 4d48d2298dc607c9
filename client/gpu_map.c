/* gpu_map: CUDA_VMM and CUDA_IPC segments in libkvclient. The driver table is loaded once per
 * process and never unloaded (engines keep CUDA loaded anyway; unloading under live mappings
 * would be worse). */
#include "client/gpu_map.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "client/diag.h"
#include "client/map.h"
#include "common/kv_cuda.h"

#define GPU_MAX_RESERVE (4ull << 40) /* device address space reserved per pool at most */

/* One mapped GPU segment. */
typedef struct gpu_seg {
    kv_cu_deviceptr va;     /* VMM: reserved and mapped range; IPC: opened pointer; 0: none */
    uint64_t bytes;         /* size of the mapping */
    uint64_t *parts;        /* VMM made of parts: [nparts] their sizes, mapped back to back */
    size_t nparts;          /* entries of parts; 0: one allocation */
    int layers_mapped;      /* VMM: its sections are mapped into the layer ranges */
    uint8_t ipc_handle[64]; /* IPC: the handle it was opened from */
} gpu_seg;

struct kvc__gpu_pool {
    uint32_t kind;              /* KVD__MEMORY_KIND__CUDA_VMM or __CUDA_IPC */
    kv_cu_context ctx;          /* the context the mappings live in */
    kv_cu_device dev;           /* its device */
    int own_primary;            /* ctx is a primary context this pool retained */
    uint64_t gran;              /* VMM granularity of dev (POSIX-fd allocations) */
    gpu_seg *segs;              /* [p->max_segments] */
    kv_cu_deviceptr *layer_va;  /* VMM LAYER_MAJOR: [layers * 2] reserved ranges, or NULL */
    uint64_t layer_range_bytes; /* bytes of each range */
};

typedef struct kvc__gpu_pool gpu_pool;

static pthread_once_t load_once = PTHREAD_ONCE_INIT;
static kv_cuda driver;       /* read-only once loaded */
static kv_err driver_rc;     /* result of the one load */
static char driver_why[256]; /* why it failed */

static void load_driver(void) {
    driver_rc = kv_cuda_load(NULL, &driver, driver_why, sizeof(driver_why));
}

static kv_err cu_fail(kvc_pool *p, kv_cu_result r, const char *what, uint32_t seg) {
    char buf[160];
    return kvc__fail(p->diag, r == KV_CU_ERROR_OUT_OF_MEMORY ? KV_ENOMEM : KV_ESYS,
                     "segment %u: %s failed: %s", seg, what,
                     kv_cuda_strerror(&driver, r, buf, sizeof(buf)));
}

/* Makes g's context current; *prev gets the caller's to restore. */
static void ctx_enter(const gpu_pool *g, kv_cu_context *prev) {
    if (driver.ctx_get_current(prev) != KV_CU_SUCCESS) {
        *prev = NULL;
    }
    if (*prev != g->ctx) {
        driver.ctx_set_current(g->ctx);
    }
}

static void ctx_leave(const gpu_pool *g, kv_cu_context prev) {
    if (prev != g->ctx) {
        driver.ctx_set_current(prev);
    }
}

static uint64_t section_stride(const kvc_pool *p) {
    return (uint64_t)p->blocks_per_segment * p->layout.kv_block_bytes;
}

/* Unmaps seg's sections from the layer ranges. */
static void unmap_sections(kvc_pool *p, gpu_pool *g, uint32_t seg) {
    gpu_seg *s = &g->segs[seg];
    if (!s->layers_mapped || g->layer_va == NULL) {
        s->layers_mapped = 0;
        return;
    }
    uint64_t stride = section_stride(p);
    uint64_t len = (uint64_t)p->segs[seg].nblocks * p->layout.kv_block_bytes;
    for (uint32_t i = 0; i < p->layout.num_layers * 2; i++) {
        driver.mem_unmap(g->layer_va[i] + (uint64_t)seg * stride, (size_t)len);
    }
    s->layers_mapped = 0;
}

/* Drops the layer tensors (a section could not be mapped): every section and every range. */
static void drop_gpu_layers(kvc_pool *p, gpu_pool *g) {
    if (g->layer_va == NULL) {
        return;
    }
    for (uint32_t seg = 0; seg < p->max_segments; seg++) {
        unmap_sections(p, g, seg);
    }
    for (uint32_t i = 0; i < p->layout.num_layers * 2; i++) {
        if (g->layer_va[i] != 0) {
            driver.mem_address_free(g->layer_va[i], (size_t)g->layer_range_bytes);
        }
    }
    free(g->layer_va);
    g->layer_va = NULL;
    free(p->layer_base);
    p->layer_base = NULL;
    p->layer_range_bytes = 0;
}

/* VMM LAYER_MAJOR: reserves one device range per (layer, K|V) for as many segments as the
 * address space allows (at least up to need segments); leaves layer tensors off otherwise. */
static void reserve_gpu_layers(kvc_pool *p, gpu_pool *g, uint32_t need) {
    const kv_layout *l = &p->layout;
    uint64_t stride = section_stride(p);
    if (l->arrangement != KV_LAYER_MAJOR || stride % g->gran != 0) {
        kvc__log(p->diag, KVC_LOG_WARN, "KVC-GPU-ALIGN",
                 "pool %u: layer sections (%llu bytes) are not multiples of the GPU granularity "
                 "(%llu); layer tensors off, use kvc_pool_addr",
                 p->pool_id, (unsigned long long)stride, (unsigned long long)g->gran);
        return;
    }
    uint32_t nranges = l->num_layers * 2;
    for (uint32_t segs = p->max_segments; segs >= need && segs > 0; segs /= 2) {
        uint64_t range = stride * segs;
        if (range * nranges > GPU_MAX_RESERVE) {
            continue;
        }
        kv_cu_deviceptr *va = calloc(nranges, sizeof(*va));
        uint8_t **bases = calloc(nranges, sizeof(*bases));
        if (va == NULL || bases == NULL) {
            free(va);
            free(bases);
            return;
        }
        uint32_t i = 0;
        for (; i < nranges; i++) {
            if (driver.mem_address_reserve(&va[i], (size_t)range, (size_t)g->gran, 0, 0) !=
                KV_CU_SUCCESS) {
                break;
            }
            bases[i] = (uint8_t *)(uintptr_t)va[i];
        }
        if (i == nranges) {
            g->layer_va = va;
            g->layer_range_bytes = range;
            p->layer_base = bases;
            p->layer_range_bytes = range;
            return;
        }
        for (uint32_t j = 0; j < i; j++) {
            driver.mem_address_free(va[j], (size_t)range);
        }
        free(va);
        free(bases);
    }
    kvc__log(p->diag, KVC_LOG_WARN, "KVC-GPU-RESERVE",
             "pool %u: cannot reserve device address space for layer tensors; use kvc_pool_addr",
             p->pool_id);
}

/* Turns p into a GPU pool of kind on the first GPU segment. */
static kv_err gpu_pool_init(kvc_pool *p, uint32_t kind, const unsigned char *device_uuid) {
    pthread_once(&load_once, load_driver);
    if (driver_rc != KV_OK) {
        return kvc__fail(p->diag, KV_ENOGPU, "pool %u has GPU segments but %s", p->pool_id,
                         driver_why);
    }
    gpu_pool *g = calloc(1, sizeof(*g));
    if (g == NULL) {
        return kvc__fail(p->diag, KV_ENOMEM, "out of memory for a GPU pool");
    }
    g->kind = kind;
    g->segs = calloc(p->max_segments, sizeof(*g->segs));
    if (g->segs == NULL) {
        free(g);
        return kvc__fail(p->diag, KV_ENOMEM, "out of memory for %u GPU segments", p->max_segments);
    }
    /* The device: the one of the caller's current context, else KVC_CUDA_DEVICE (default 0).
     * The mappings always live in that device's primary context (retained here): IPC handles
     * opened in another context (one of several per device) would be that context's only, and
     * the engine's kernels run in the primary one. The caller's current context is left as it
     * was (none stays none). */
    kv_cu_context cur = NULL;
    if (driver.ctx_get_current(&cur) != KV_CU_SUCCESS) {
        cur = NULL;
    }
    kv_cuda_device d;
    char why[256];
    int have_dev = cur != NULL && driver.ctx_get_device(&g->dev) == KV_CU_SUCCESS;
    kv_err drc;
    if (have_dev) {
        int ordinal = (int)g->dev;
        drc = kv_cuda_device_open(&driver, ordinal, &d, why, sizeof(why));
    } else {
        const char *env = getenv("KVC_CUDA_DEVICE");
        drc = kv_cuda_device_open(&driver, env != NULL ? atoi(env) : 0, &d, why, sizeof(why));
    }
    driver.ctx_set_current(cur); /* kv_cuda_device_open made the primary context current */
    if (drc != KV_OK) {
        free(g->segs);
        free(g);
        return kvc__fail(p->diag, KV_ENOGPU, "pool %u: %s", p->pool_id, why);
    }
    g->ctx = d.ctx;
    g->dev = d.dev;
    g->own_primary = 1;
    /* The daemon's segments live on one GPU: mapping them from another would work (over NVLink
     * or PCIe) and quietly run attention at a fraction of its speed. */
    if (device_uuid != NULL && memcmp(device_uuid, d.uuid.bytes, 16) != 0) {
        char mine[48], theirs[48];
        kv_cu_uuid u;
        memcpy(u.bytes, device_uuid, 16);
        kv_cuda_uuid_str(&d.uuid, mine, sizeof(mine));
        kv_cuda_uuid_str(&u, theirs, sizeof(theirs));
        driver.primary_ctx_release(g->dev);
        free(g->segs);
        free(g);
        return kvc__fail(p->diag, KV_ENOGPU,
                         "pool %u lives on GPU %s (kvd --device), but this process uses GPU %s "
                         "(device %d): run the worker on kvd's GPU (CUDA_VISIBLE_DEVICES / "
                         "KVC_CUDA_DEVICE) or start kvd on this one",
                         p->pool_id, theirs, mine, (int)d.dev);
    }
    kv_cu_alloc_prop prop;
    memset(&prop, 0, sizeof(prop));
    prop.type = KV_CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.requested_handle_types = KV_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    prop.location.type = KV_CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = g->dev;
    size_t gran = 0;
    if (kind == KVD__MEMORY_KIND__CUDA_VMM &&
        (driver.mem_get_granularity(&gran, &prop, KV_CU_MEM_ALLOC_GRANULARITY_MINIMUM) !=
             KV_CU_SUCCESS ||
         gran == 0)) {
        if (g->own_primary) {
            driver.primary_ctx_release(g->dev);
        }
        free(g->segs);
        free(g);
        return kvc__fail(p->diag, KV_ENOGPU, "pool %u: the device cannot map VMM memory",
                         p->pool_id);
    }
    g->gran = gran;
    kvc__pool_drop_layers(p); /* host PROT_NONE ranges of kvc__pool_init_geometry */
    p->gpu = g;
    return KV_OK;
}

/* Unmaps segment seg (both kinds). Context current. */
static void unmap_seg(kvc_pool *p, gpu_pool *g, uint32_t seg) {
    gpu_seg *s = &g->segs[seg];
    if (s->va == 0) {
        return;
    }
    if (g->kind == KVD__MEMORY_KIND__CUDA_VMM) {
        unmap_sections(p, g, seg);
        if (s->nparts == 0) {
            driver.mem_unmap(s->va, (size_t)s->bytes);
        }
        uint64_t off = 0;
        for (size_t k = 0; k < s->nparts; k++) {
            driver.mem_unmap(s->va + off, (size_t)s->parts[k]); /* each mapping on its own */
            off += s->parts[k];
        }
        free(s->parts);
        driver.mem_address_free(s->va, (size_t)s->bytes);
    } else {
        driver.ipc_close_mem_handle(s->va);
    }
    memset(s, 0, sizeof(*s));
    p->segs[seg].base = NULL;
}

static kv_err set_access(gpu_pool *g, kv_cu_deviceptr va, uint64_t bytes) {
    kv_cu_access_desc acc;
    memset(&acc, 0, sizeof(acc));
    acc.location.type = KV_CU_MEM_LOCATION_TYPE_DEVICE;
    acc.location.id = g->dev;
    acc.flags = KV_CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    return driver.mem_set_access(va, (size_t)bytes, &acc, 1) == KV_CU_SUCCESS ? KV_OK : KV_ESYS;
}

/* Maps seg's (layer, K|V) sections into the layer ranges; turns layer tensors off on failure. */
static void map_sections(kvc_pool *p, gpu_pool *g, uint32_t seg, kv_cu_mem_handle h,
                         uint32_t nblocks) {
    const kv_layout *l = &p->layout;
    if (g->layer_va == NULL) {
        return;
    }
    uint64_t stride = section_stride(p);
    if ((uint64_t)(seg + 1) * stride > g->layer_range_bytes) {
        return; /* beyond the reserved ranges: reachable through kvc_pool_addr only */
    }
    uint64_t len = (uint64_t)nblocks * l->kv_block_bytes;
    for (uint32_t layer = 0; layer < l->num_layers; layer++) {
        for (int kv = KV_K; kv <= KV_V; kv++) {
            uint64_t off = kv_layout_offset(l, nblocks, 0, layer, kv, 0, 0);
            kv_cu_deviceptr dst = g->layer_va[layer * 2 + (uint32_t)kv] + (uint64_t)seg * stride;
            if (off % g->gran != 0 || len % g->gran != 0 ||
                driver.mem_map(dst, (size_t)len, (size_t)off, h, 0) != KV_CU_SUCCESS) {
                goto fail;
            }
            g->segs[seg].layers_mapped = 1; /* at least partly: unmap_sections undoes */
            if (set_access(g, dst, len) != KV_OK) {
                goto fail;
            }
        }
    }
    return;
fail:
    kvc__log(p->diag, KVC_LOG_WARN, "KVC-GPU-ALIGN",
             "pool %u segment %u: a layer section cannot be mapped at its offset; layer tensors "
             "off, use kvc_pool_addr",
             p->pool_id, seg);
    /* Unmap exactly what was mapped: sections before the failing one. */
    for (uint32_t i = 0; i < l->num_layers * 2; i++) {
        kv_cu_deviceptr dst = g->layer_va[i] + (uint64_t)seg * stride;
        driver.mem_unmap(dst, (size_t)len); /* an unmapped range only returns an error */
    }
    g->segs[seg].layers_mapped = 0;
    drop_gpu_layers(p, g);
}

/* Maps the allocation of fd (size bytes) at va (offset 0) and opens it to the device. */
static kv_err map_part(kvc_pool *p, gpu_pool *g, uint32_t seg, int fd, kv_cu_deviceptr va,
                       uint64_t bytes, kv_cu_mem_handle *h_out) {
    kv_cu_mem_handle h;
    kv_cu_result r =
        driver.mem_import(&h, (void *)(intptr_t)fd, KV_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    if (r != KV_CU_SUCCESS) {
        return cu_fail(p, r, "cuMemImportFromShareableHandle", seg);
    }
    r = driver.mem_map(va, (size_t)bytes, 0, h, 0);
    if (r != KV_CU_SUCCESS) {
        driver.mem_release(h);
        return cu_fail(p, r, "cuMemMap", seg);
    }
    if (set_access(g, va, bytes) != KV_OK) {
        driver.mem_unmap(va, (size_t)bytes);
        driver.mem_release(h);
        return kvc__fail(p->diag, KV_ESYS, "segment %u: cuMemSetAccess failed", seg);
    }
    *h_out = h;
    return KV_OK;
}

/* A segment made of parts (one allocation per (layer, K|V) section, then the scales): each part
 * is mapped at offset 0 of its own allocation, back to back for the segment view, and each
 * section part once more into its layer tensor. No mapping at a non-zero offset, so layer
 * tensors do not depend on what the driver allows there. */
static kv_err map_vmm_parts(kvc_pool *p, gpu_pool *g, const Kvd__Segment *s, const int *fds,
                            size_t nfds) {
    const kv_layout *l = &p->layout;
    uint64_t sum = 0;
    for (size_t k = 0; k < s->n_part_bytes; k++) {
        if (s->part_bytes[k] == 0 || s->part_bytes[k] % g->gran != 0) {
            return kvc__fail(p->diag, KV_EPROTO, "segment %u: part %zu of %llu bytes", s->index, k,
                             (unsigned long long)s->part_bytes[k]);
        }
        sum += s->part_bytes[k];
    }
    if (sum != s->bytes || s->fd_index + s->n_part_bytes > nfds) {
        return kvc__fail(p->diag, KV_EPROTO,
                         "segment %u: %zu parts of %llu bytes for a %llu-byte segment, %zu fds",
                         s->index, s->n_part_bytes, (unsigned long long)sum,
                         (unsigned long long)s->bytes, nfds);
    }
    if (g->layer_va == NULL && l->arrangement == KV_LAYER_MAJOR && p->nsegs == 0) {
        reserve_gpu_layers(p, g, s->index + 1);
    }
    kv_cu_deviceptr va = 0;
    kv_cu_result r = driver.mem_address_reserve(&va, (size_t)s->bytes, (size_t)g->gran, 0, 0);
    if (r != KV_CU_SUCCESS) {
        return cu_fail(p, r, "cuMemAddressReserve", s->index);
    }
    uint64_t stride = section_stride(p);
    uint32_t nsec = l->arrangement == KV_LAYER_MAJOR ? l->num_layers * 2 : 0;
    int layers = g->layer_va != NULL && (uint64_t)(s->index + 1) * stride <= g->layer_range_bytes &&
                 nsec <= s->n_part_bytes;
    uint64_t off = 0;
    size_t done = 0;
    kv_err rc = KV_OK;
    for (; done < s->n_part_bytes; done++) {
        kv_cu_mem_handle h = 0;
        rc = map_part(p, g, s->index, fds[s->fd_index + done], va + off, s->part_bytes[done], &h);
        if (rc != KV_OK) {
            break;
        }
        if (layers && done < nsec) {
            if (s->part_bytes[done] != (uint64_t)s->nblocks * l->kv_block_bytes) {
                layers = 0; /* not one section a part: segment view only */
            } else {
                kv_cu_deviceptr dst = g->layer_va[done] + (uint64_t)s->index * stride;
                if (driver.mem_map(dst, (size_t)s->part_bytes[done], 0, h, 0) != KV_CU_SUCCESS ||
                    set_access(g, dst, s->part_bytes[done]) != KV_OK) {
                    layers = 0;
                } else {
                    g->segs[s->index].layers_mapped = 1; /* unmap_sections undoes */
                }
            }
        }
        driver.mem_release(h); /* the mappings hold the memory now */
        off += s->part_bytes[done];
    }
    gpu_seg *gs = &g->segs[s->index];
    gs->va = va;
    gs->bytes = s->bytes;
    p->segs[s->index].nblocks = s->nblocks;
    if (rc != KV_OK) {
        /* Unmap what was mapped: the segment view part by part, then the layer sections. */
        uint64_t o = 0;
        for (size_t k = 0; k < done; k++) {
            driver.mem_unmap(va + o, (size_t)s->part_bytes[k]);
            o += s->part_bytes[k];
        }
        unmap_sections(p, g, s->index);
        driver.mem_address_free(va, (size_t)s->bytes);
        memset(gs, 0, sizeof(*gs));
        return rc;
    }
    gs->parts = malloc(sizeof(*gs->parts) * s->n_part_bytes);
    if (gs->parts == NULL) {
        unmap_seg(p, g, s->index);
        return kvc__fail(p->diag, KV_ENOMEM, "segment %u: out of memory", s->index);
    }
    memcpy(gs->parts, s->part_bytes, sizeof(*gs->parts) * s->n_part_bytes);
    gs->nparts = s->n_part_bytes;
    if (!layers && g->layer_va != NULL && l->arrangement == KV_LAYER_MAJOR) {
        kvc__log(p->diag, KVC_LOG_WARN, "KVC-GPU-ALIGN",
                 "pool %u segment %u: a layer section could not be mapped; layer tensors off, "
                 "use kvc_pool_addr",
                 p->pool_id, s->index);
        drop_gpu_layers(p, g);
    }
    return KV_OK;
}

static kv_err map_vmm(kvc_pool *p, gpu_pool *g, const Kvd__Segment *s, int fd) {
    if (s->bytes % g->gran != 0) {
        return kvc__fail(p->diag, KV_EPROTO,
                         "segment %u: %llu bytes is not a multiple of the GPU granularity %llu",
                         s->index, (unsigned long long)s->bytes, (unsigned long long)g->gran);
    }
    if (g->layer_va == NULL && p->layout.arrangement == KV_LAYER_MAJOR && p->nsegs == 0) {
        reserve_gpu_layers(p, g, s->index + 1);
    }
    kv_cu_mem_handle h;
    kv_cu_result r =
        driver.mem_import(&h, (void *)(intptr_t)fd, KV_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    if (r != KV_CU_SUCCESS) {
        return cu_fail(p, r, "cuMemImportFromShareableHandle", s->index);
    }
    kv_err rc;
    kv_cu_deviceptr va = 0;
    r = driver.mem_address_reserve(&va, (size_t)s->bytes, (size_t)g->gran, 0, 0);
    if (r != KV_CU_SUCCESS) {
        rc = cu_fail(p, r, "cuMemAddressReserve", s->index);
        goto cleanup_handle;
    }
    r = driver.mem_map(va, (size_t)s->bytes, 0, h, 0);
    if (r != KV_CU_SUCCESS) {
        rc = cu_fail(p, r, "cuMemMap", s->index);
        goto cleanup_va;
    }
    if (set_access(g, va, s->bytes) != KV_OK) {
        rc = kvc__fail(p->diag, KV_ESYS, "segment %u: cuMemSetAccess failed", s->index);
        goto cleanup_map;
    }
    gpu_seg *gs = &g->segs[s->index];
    gs->va = va;
    gs->bytes = s->bytes;
    p->segs[s->index].nblocks = s->nblocks;
    map_sections(p, g, s->index, h, s->nblocks);
    /* The mappings hold the memory now. */
    driver.mem_release(h);
    return KV_OK;
cleanup_map:
    driver.mem_unmap(va, (size_t)s->bytes);
cleanup_va:
    driver.mem_address_free(va, (size_t)s->bytes);
cleanup_handle:
    driver.mem_release(h);
    return rc;
}

static kv_err map_ipc(kvc_pool *p, gpu_pool *g, const Kvd__Segment *s) {
    if (s->ipc_handle.len != KV_CU_IPC_HANDLE_SIZE) {
        return kvc__fail(p->diag, KV_EPROTO, "segment %u: CUDA_IPC handle of %zu bytes, not 64",
                         s->index, s->ipc_handle.len);
    }
    kv_cu_ipc_mem_handle h;
    memcpy(h.reserved, s->ipc_handle.data, KV_CU_IPC_HANDLE_SIZE);
    kv_cu_deviceptr va = 0;
    kv_cu_result r = driver.ipc_open_mem_handle(&va, h, KV_CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
    if (r != KV_CU_SUCCESS) {
        return cu_fail(p, r, "cuIpcOpenMemHandle", s->index);
    }
    gpu_seg *gs = &g->segs[s->index];
    gs->va = va;
    gs->bytes = s->bytes;
    memcpy(gs->ipc_handle, h.reserved, sizeof(gs->ipc_handle));
    return KV_OK;
}

static kv_err gpu_map_segment(kvc_pool *p, const Kvd__Segment *s, const int *fds, size_t nfds,
                              const unsigned char *device_uuid) {
    const kv_layout *l = &p->layout;
    uint32_t kind = (uint32_t)s->kind;
    if (s->index >= p->max_segments || s->nblocks == 0 || s->nblocks > p->blocks_per_segment ||
        s->bytes < kv_layout_segment_bytes(l, s->nblocks) || s->bytes > SIZE_MAX) {
        return kvc__fail(p->diag, KV_EPROTO, "segment %u: bad geometry (%u blocks, %llu bytes)",
                         s->index, s->nblocks, (unsigned long long)s->bytes);
    }
    if (kind == KVD__MEMORY_KIND__CUDA_VMM && s->fd_index >= nfds) {
        return kvc__fail(p->diag, KV_EPROTO, "segment %u names fd %u of %zu", s->index, s->fd_index,
                         nfds);
    }
    if (p->gpu == NULL) {
        if (p->nsegs != 0) {
            return kvc__fail(p->diag, KV_EPROTO, "segment %u is GPU memory in a host pool",
                             s->index);
        }
        kv_err rc = gpu_pool_init(p, kind, device_uuid);
        if (rc != KV_OK) {
            return rc;
        }
    }
    gpu_pool *g = p->gpu;
    if (g->kind != kind) {
        return kvc__fail(p->diag, KV_EPROTO, "segment %u: memory kind %u in a pool of kind %u",
                         s->index, kind, g->kind);
    }
    gpu_seg *gs = &g->segs[s->index];
    if (kind == KVD__MEMORY_KIND__CUDA_IPC && gs->va != 0 &&
        memcmp(gs->ipc_handle, s->ipc_handle.data, sizeof(gs->ipc_handle)) == 0) {
        return KV_OK; /* sent again (a repeated attach): each handle is opened once */
    }
    kv_cu_context prev;
    ctx_enter(g, &prev);
    /* The daemon freed this segment and grew a new one at the same index. */
    unmap_seg(p, g, s->index);
    kv_err rc = kind == KVD__MEMORY_KIND__CUDA_IPC ? map_ipc(p, g, s)
                : s->n_part_bytes > 0              ? map_vmm_parts(p, g, s, fds, nfds)
                                                   : map_vmm(p, g, s, fds[s->fd_index]);
    ctx_leave(g, prev);
    if (rc != KV_OK) {
        return rc;
    }
    kvc__segment *ps = &p->segs[s->index];
    ps->base = (uint8_t *)(uintptr_t)gs->va;
    ps->bytes = s->bytes;
    ps->nblocks = s->nblocks;
    ps->read_only = s->read_only; /* advisory: GPU mappings cannot enforce it */
    if (s->index + 1 > p->nsegs) {
        p->nsegs = s->index + 1;
    }
    return KV_OK;
}

static void gpu_pool_unmap(kvc_pool *p) {
    if (p == NULL || p->gpu == NULL) {
        return;
    }
    gpu_pool *g = p->gpu;
    kv_cu_context prev;
    ctx_enter(g, &prev);
    if (g->segs != NULL) {
        for (uint32_t i = 0; i < p->max_segments; i++) {
            unmap_seg(p, g, i);
        }
    }
    drop_gpu_layers(p, g);
    ctx_leave(g, prev == g->ctx && g->own_primary ? NULL : prev);
    if (g->own_primary) {
        driver.primary_ctx_release(g->dev);
    }
    free(g->segs);
    free(g);
    p->gpu = NULL;
}

static int gpu_pool_device(const kvc_pool *p) {
    return (int)p->gpu->dev;
}

const kvc__gpu_ops kvc__gpu_mapper = {
    .map_segment = gpu_map_segment,
    .unmap = gpu_pool_unmap,
    .device = gpu_pool_device,
};
