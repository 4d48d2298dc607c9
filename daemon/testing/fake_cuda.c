/* fake_cuda: a stand-in libcuda.so.1 for tests on machines without a GPU (KV_CUDA_LIBRARY points
 * kv_cuda_load at it). NOT a driver, but as strict as one where the daemon and the client could
 * get it wrong, so that code which works here does not break on the first real GPU:
 *
 *  - "Device" memory is not host memory: every device address range the fake hands out
 *    (cuMemMap, cuMemAlloc, cuIpcOpenMemHandle) is PROT_NONE to the host, so a host load or store
 *    through a device pointer faults as it would on a GPU. The bytes live in a shadow mapping of
 *    the same memfd that only the fake's own copy and memset calls touch.
 *  - Copies and memsets that CUDA runs asynchronously to the host (cuMemsetD8, cuMemcpyDtoD and
 *    cuMemcpyHtoD from pageable memory, whose DMA may finish after the call returns) complete only
 *    at cuCtxSynchronize, or before a cuMemcpyDtoH, cuMemUnmap or cuMemFree of the context (which
 *    order after them). A process that commits a block without synchronizing publishes stale
 *    bytes here too.
 *  - Streams (cuStreamCreate): cuMemcpyHtoDAsync and cuMemcpyDtoHAsync on a stream complete at
 *    that stream's cuStreamSynchronize (or a cuCtxSynchronize). Where the host side is
 *    page-locked memory (cuMemHostAlloc, cuMemAllocHost) the DMA reads or writes it only then:
 *    a DtoH copy's bytes are not in the host buffer before the synchronize, and a host buffer
 *    changed before it goes to the device changed. Where the host side is pageable, as the driver
 *    does, DtoH is synchronous and HtoD takes the source's bytes at the call. Page-locked memory
 *    is an anonymous mapping of the fake's, so free() of it fails as free() of the driver's does.
 *  - CUDA state does not survive fork: cuInit records the pid, and every call from another
 *    process (a child forked after cuInit, without exec) fails with CUDA_ERROR_NOT_INITIALIZED.
 *  - VMM granularity is 2 MiB (current GPUs); sizes, offsets and addresses must be multiples.
 *  - cuMemCreate makes a memfd and the allocation handle is the fd; export dups it, import dups
 *    the received fd, release closes it: memory lives while any handle or mapping does.
 *  - cuIpcGetMemHandle writes (magic, pid, fd, bytes) into the 64 bytes and cuIpcOpenMemHandle
 *    opens /proc/PID/fd/FD of the exporter (same uid only).
 * Environment switches: FAKE_CUDA_NO_DEVICE=1 (cuInit fails with CUDA_ERROR_NO_DEVICE),
 * FAKE_CUDA_NO_VMM=1 (no VMM support), FAKE_CUDA_NO_PINNED=1 (cuMemHostAlloc and cuMemAllocHost
 * fail with CUDA_ERROR_OUT_OF_MEMORY, as they do where page-locked memory runs out),
 * FAKE_CUDA_NO_MAP_OFFSET=1 (cuMemMap refuses a non-zero offset, as cuda.h's "currently must be
 * zero" allows a driver to), FAKE_CUDA_HOST_ACCESS=1 (cuMemSetAccess also opens device ranges to
 * host loads: for tests that run the kernels' CPU twins over "device" memory), FAKE_CUDA_UUID=<32
 * hex digits> (the device's UUID). Thread-safe as a real driver is: one recursive lock guards the
 * fake's state in every entry point (in-process tests call it from the test thread and the daemon's
 * loop thread at once).
 */
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/kv_cuda.h"

#define FAKE_GRANULARITY (2u << 20)
#define FAKE_IPC_MAGIC 0x6b766466616b6531ull /* "kvdfake1" */
#define FAKE_MAX_RANGES 8192
#define FAKE_MAX_PENDING 65536
#define KV_CU_ERROR_INVALID_VALUE 1
#define KV_CU_ERROR_INVALID_HANDLE 400
#define FAKE_MAX_STREAMS 256

#define EXPORT __attribute__((visibility("default")))

/* Every entry point holds the fake's lock until it returns (cleanup attribute). */
static pthread_mutex_t fake_lock = PTHREAD_RECURSIVE_MUTEX_INITIALIZER_NP;

static int guard_enter(void) {
    pthread_mutex_lock(&fake_lock);
    return 0;
}

static void guard_leave(int *unused) {
    (void)unused;
    pthread_mutex_unlock(&fake_lock);
}

#define GUARD() int guard_ __attribute__((cleanup(guard_leave), unused)) = guard_enter()

static int env_set(const char *name) {
    const char *v = getenv(name);
    return v != NULL && v[0] == '1';
}

/* ---- the process that initialised CUDA ---------------------------------------------------- */

static pid_t init_pid; /* 0 before cuInit; a forked child inherits the parent's */

#define CHECK_PROC()                                                                               \
    do {                                                                                           \
        if (init_pid == 0 || getpid() != init_pid) {                                               \
            return KV_CU_ERROR_NOT_INITIALIZED;                                                    \
        }                                                                                          \
    } while (0)

/* ---- device address ranges and their shadows ----------------------------------------------- */

typedef struct range {
    uintptr_t va;    /* device address (PROT_NONE to the host unless FAKE_CUDA_HOST_ACCESS) */
    size_t bytes;    /* length */
    uint8_t *shadow; /* the fake's own read-write view of the same pages */
    int owner_fd;    /* cuMemAlloc: its memfd (closed by cuMemFree); else -1 */
    int kind;        /* RANGE_MAP (cuMemMap), RANGE_ALLOC (cuMemAlloc), RANGE_IPC */
} range;

enum { RANGE_FREE = 0, RANGE_MAP = 1, RANGE_ALLOC = 2, RANGE_IPC = 3 };

static range ranges[FAKE_MAX_RANGES];

static range *range_add(uintptr_t va, size_t bytes, uint8_t *shadow, int owner_fd, int kind) {
    for (int i = 0; i < FAKE_MAX_RANGES; i++) {
        if (ranges[i].kind == RANGE_FREE) {
            ranges[i] = (range){va, bytes, shadow, owner_fd, kind};
            return &ranges[i];
        }
    }
    return NULL;
}

/* The range holding device address p, or NULL. */
static range *range_of(uintptr_t p) {
    for (int i = 0; i < FAKE_MAX_RANGES; i++) {
        if (ranges[i].kind != RANGE_FREE && p >= ranges[i].va &&
            p < ranges[i].va + ranges[i].bytes) {
            return &ranges[i];
        }
    }
    return NULL;
}

/* The shadow address of device range [p, p + n) when it lies in one range, else NULL. A copy
 * across ranges (a segment made of parts mapped back to back) is split by the callers. */
static uint8_t *shadow_of(uintptr_t p, size_t n, size_t *in_range) {
    range *r = range_of(p);
    if (r == NULL) {
        return NULL;
    }
    size_t left = r->va + r->bytes - p;
    *in_range = n < left ? n : left;
    return r->shadow + (p - r->va);
}

/* ---- operations that complete at a synchronize --------------------------------------------- */

typedef struct pending {
    int op;        /* OP_SET, OP_COPY, OP_TOHOST */
    uintptr_t dst; /* device address (OP_TOHOST: unused) */
    uintptr_t src; /* OP_COPY from device: device address; 0 when data or pinned holds them */
    uint8_t *data; /* OP_COPY from pageable host: a copy of the source taken at the call;
                      OP_TOHOST: the device bytes, read when the copy was queued */
    const uint8_t *pinned; /* OP_COPY from page-locked host memory: read at completion */
    uint8_t *host;         /* OP_TOHOST: the page-locked destination, written at completion */
    size_t n;              /* bytes */
    unsigned char v;       /* OP_SET value */
    uintptr_t stream;      /* 0: the legacy stream (completes at any synchronize) */
} pending;

enum { OP_SET = 1, OP_COPY = 2, OP_TOHOST = 3 };

static pending queue[FAKE_MAX_PENDING];
static size_t nqueue;

/* Device-to-device or host-to-device bytes, piecewise over ranges. */
static int dev_write(uintptr_t dst, const uint8_t *src_host, uintptr_t src_dev, size_t n, int set,
                     unsigned char v) {
    while (n > 0) {
        size_t k = 0;
        uint8_t *d = shadow_of(dst, n, &k);
        if (d == NULL) {
            return -1;
        }
        if (set) {
            memset(d, v, k);
        } else if (src_host != NULL) {
            memcpy(d, src_host, k);
            src_host += k;
        } else {
            size_t done = 0;
            while (done < k) {
                size_t j = 0;
                const uint8_t *s = shadow_of(src_dev, k - done, &j);
                if (s == NULL) {
                    return -1;
                }
                memmove(d + done, s, j);
                done += j;
                src_dev += j;
            }
        }
        dst += k;
        n -= k;
    }
    return 0;
}

static void complete(pending *q) {
    if (q->op == OP_TOHOST) {
        memcpy(q->host, q->data, q->n);
    } else {
        (void)dev_write(q->dst, q->pinned != NULL ? q->pinned : q->data, q->src, q->n,
                        q->op == OP_SET, q->v);
    }
    free(q->data);
}

/* Completes the queued work of every stream, in the order it was queued. */
static void drain(void) {
    for (size_t i = 0; i < nqueue; i++) {
        complete(&queue[i]);
    }
    nqueue = 0;
}

/* Completes the queued work of stream s (in order); the rest stays queued. */
static void drain_stream(uintptr_t s) {
    size_t k = 0;
    for (size_t i = 0; i < nqueue; i++) {
        if (queue[i].stream == s) {
            complete(&queue[i]);
        } else {
            queue[k++] = queue[i];
        }
    }
    nqueue = k;
}

/* Copies device bytes [src, src + n) (device memory, checked by the caller) to host dst,
 * piecewise over ranges. */
static void dev_read(uint8_t *dst, uintptr_t src, size_t n) {
    while (n > 0) {
        size_t k = 0;
        const uint8_t *sh = shadow_of(src, n, &k);
        memcpy(dst, sh, k);
        dst += k;
        src += k;
        n -= k;
    }
}

/* Checks that [p, p + n) is device memory (piecewise), without touching it. */
static int dev_range_ok(uintptr_t p, size_t n) {
    while (n > 0) {
        size_t k = 0;
        if (shadow_of(p, n, &k) == NULL) {
            return 0;
        }
        p += k;
        n -= k;
    }
    return 1;
}

/* A new queue slot (completing everything when the queue is full). */
static pending *queue_slot(void) {
    if (nqueue == FAKE_MAX_PENDING) {
        drain();
    }
    pending *q = &queue[nqueue];
    memset(q, 0, sizeof(*q));
    return q;
}

static kv_cu_result enqueue(int op, uintptr_t dst, uintptr_t src, const void *host, size_t n,
                            unsigned char v) {
    if (!dev_range_ok(dst, n) || (op == OP_COPY && host == NULL && !dev_range_ok(src, n))) {
        return KV_CU_ERROR_INVALID_VALUE;
    }
    pending *q = queue_slot();
    q->op = op;
    q->dst = dst;
    q->src = src;
    q->n = n;
    q->v = v;
    if (host != NULL) {
        q->data = malloc(n > 0 ? n : 1);
        if (q->data == NULL) {
            return KV_CU_ERROR_OUT_OF_MEMORY;
        }
        memcpy(q->data, host, n);
    }
    nqueue++;
    return KV_CU_SUCCESS;
}

/* ---- initialisation, devices, contexts ------------------------------------------------------ */

EXPORT kv_cu_result cuInit(unsigned flags) {
    GUARD();
    (void)flags;
    if (init_pid != 0 && init_pid != getpid()) {
        return KV_CU_ERROR_NOT_INITIALIZED; /* forked after cuInit, without exec */
    }
    if (env_set("FAKE_CUDA_NO_DEVICE")) {
        return KV_CU_ERROR_NO_DEVICE;
    }
    init_pid = getpid();
    return KV_CU_SUCCESS;
}

EXPORT kv_cu_result cuDriverGetVersion(int *v) {
    GUARD();
    *v = 13000;
    return KV_CU_SUCCESS;
}

EXPORT kv_cu_result cuGetErrorName(kv_cu_result r, const char **s) {
    GUARD();
    switch (r) {
        case KV_CU_SUCCESS:
            *s = "CUDA_SUCCESS";
            return KV_CU_SUCCESS;
        case KV_CU_ERROR_INVALID_VALUE:
            *s = "CUDA_ERROR_INVALID_VALUE";
            return KV_CU_SUCCESS;
        case KV_CU_ERROR_OUT_OF_MEMORY:
            *s = "CUDA_ERROR_OUT_OF_MEMORY";
            return KV_CU_SUCCESS;
        case KV_CU_ERROR_NOT_INITIALIZED:
            *s = "CUDA_ERROR_NOT_INITIALIZED";
            return KV_CU_SUCCESS;
        case KV_CU_ERROR_NO_DEVICE:
            *s = "CUDA_ERROR_NO_DEVICE";
            return KV_CU_SUCCESS;
        case KV_CU_ERROR_INVALID_DEVICE:
            *s = "CUDA_ERROR_INVALID_DEVICE";
            return KV_CU_SUCCESS;
        case KV_CU_ERROR_NOT_SUPPORTED:
            *s = "CUDA_ERROR_NOT_SUPPORTED";
            return KV_CU_SUCCESS;
        default:
            *s = "CUDA_ERROR_UNKNOWN";
            return KV_CU_SUCCESS;
    }
}

EXPORT kv_cu_result cuGetErrorString(kv_cu_result r, const char **s) {
    GUARD();
    *s = r == KV_CU_ERROR_NO_DEVICE         ? "no CUDA-capable device is detected"
         : r == KV_CU_ERROR_NOT_INITIALIZED ? "initialization error (CUDA used after fork?)"
                                            : "fake driver error";
    return KV_CU_SUCCESS;
}

EXPORT kv_cu_result cuDeviceGetCount(int *n) {
    GUARD();
    CHECK_PROC();
    *n = 1;
    return KV_CU_SUCCESS;
}

EXPORT kv_cu_result cuDeviceGet(kv_cu_device *d, int ordinal) {
    GUARD();
    CHECK_PROC();
    if (ordinal != 0) {
        return KV_CU_ERROR_INVALID_DEVICE;
    }
    *d = 0;
    return KV_CU_SUCCESS;
}

EXPORT kv_cu_result cuDeviceGetAttribute(int *v, int attr, kv_cu_device d) {
    GUARD();
    CHECK_PROC();
    (void)d;
    if (attr == KV_CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED ||
        attr == KV_CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED) {
        *v = env_set("FAKE_CUDA_NO_VMM") ? 0 : 1;
        return KV_CU_SUCCESS;
    }
    *v = 0;
    return KV_CU_SUCCESS;
}

EXPORT kv_cu_result cuDeviceGetName(char *name, int len, kv_cu_device d) {
    GUARD();
    CHECK_PROC();
    (void)d;
    snprintf(name, (size_t)len, "kvd fake GPU");
    return KV_CU_SUCCESS;
}

EXPORT kv_cu_result cuDeviceGetUuid_v2(kv_cu_uuid *uuid, kv_cu_device d) {
    GUARD();
    CHECK_PROC();
    (void)d;
    static const unsigned char def[16] = {0x6b, 0x76, 0x64, 0x2d, 0x66, 0x61, 0x6b, 0x65,
                                          0x2d, 0x67, 0x70, 0x75, 0x2d, 0x30, 0x30, 0x30};
    memcpy(uuid->bytes, def, 16);
    const char *hex = getenv("FAKE_CUDA_UUID");
    for (int i = 0; hex != NULL && strlen(hex) >= 32 && i < 16; i++) {
        unsigned b = 0;
        if (sscanf(hex + 2 * i, "%2x", &b) == 1) {
            uuid->bytes[i] = (unsigned char)b;
        }
    }
    return KV_CU_SUCCESS;
}

static int primary_ctx; /* its address is the fake context */

EXPORT kv_cu_result cuDevicePrimaryCtxRetain(kv_cu_context *ctx, kv_cu_device d) {
    GUARD();
    CHECK_PROC();
    (void)d;
    *ctx = (kv_cu_context)(void *)&primary_ctx;
    return KV_CU_SUCCESS;
}

EXPORT kv_cu_result cuDevicePrimaryCtxRelease_v2(kv_cu_device d) {
    GUARD();
    CHECK_PROC();
    (void)d;
    return KV_CU_SUCCESS;
}

static kv_cu_context current;

EXPORT kv_cu_result cuCtxSetCurrent(kv_cu_context ctx) {
    GUARD();
    CHECK_PROC();
    current = ctx;
    return KV_CU_SUCCESS;
}

EXPORT kv_cu_result cuCtxGetCurrent(kv_cu_context *ctx) {
    GUARD();
    CHECK_PROC();
    *ctx = current;
    return KV_CU_SUCCESS;
}

EXPORT kv_cu_result cuCtxGetDevice(kv_cu_device *d) {
    GUARD();
    CHECK_PROC();
    *d = 0;
    return current != NULL ? KV_CU_SUCCESS : KV_CU_ERROR_NOT_INITIALIZED;
}

EXPORT kv_cu_result cuCtxSynchronize(void) {
    GUARD();
    CHECK_PROC();
    drain();
    return KV_CU_SUCCESS;
}

/* ---- memory ---------------------------------------------------------------------------------- */

static int new_memfd(size_t bytes) {
    int fd = memfd_create("fake-cuda", MFD_CLOEXEC);
    if (fd < 0) {
        return -1;
    }
    if (ftruncate(fd, (off_t)bytes) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

/* Maps fd[off, off + bytes) as a device range (at va, or anywhere when va is 0) and its shadow. */
static kv_cu_result map_device(uintptr_t *va, size_t bytes, int fd, off_t off, int owner_fd,
                               int kind) {
    int host = env_set("FAKE_CUDA_HOST_ACCESS") && kind != RANGE_MAP; /* MAP: at cuMemSetAccess */
    int prot = host ? PROT_READ | PROT_WRITE : PROT_NONE;
    void *m = mmap((void *)*va, bytes, prot, MAP_SHARED | (*va != 0 ? MAP_FIXED : 0), fd, off);
    if (m == MAP_FAILED) {
        return KV_CU_ERROR_OUT_OF_MEMORY;
    }
    uint8_t *sh = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, off);
    if (sh == MAP_FAILED) {
        munmap(m, bytes);
        return KV_CU_ERROR_OUT_OF_MEMORY;
    }
    if (range_add((uintptr_t)m, bytes, sh, owner_fd, kind) == NULL) {
        munmap(sh, bytes);
        munmap(m, bytes);
        return KV_CU_ERROR_OUT_OF_MEMORY;
    }
    *va = (uintptr_t)m;
    return KV_CU_SUCCESS;
}

static void range_drop(range *r) {
    munmap(r->shadow, r->bytes);
    r->kind = RANGE_FREE;
}

EXPORT kv_cu_result cuMemAlloc_v2(kv_cu_deviceptr *p, size_t bytes) {
    GUARD();
    CHECK_PROC();
    int fd = new_memfd(bytes);
    if (fd < 0) {
        return KV_CU_ERROR_OUT_OF_MEMORY;
    }
    uintptr_t va = 0;
    kv_cu_result r = map_device(&va, bytes, fd, 0, fd, RANGE_ALLOC);
    if (r != KV_CU_SUCCESS) {
        close(fd);
        return r;
    }
    *p = (kv_cu_deviceptr)va;
    return KV_CU_SUCCESS;
}

EXPORT kv_cu_result cuMemFree_v2(kv_cu_deviceptr p) {
    GUARD();
    CHECK_PROC();
    range *r = range_of((uintptr_t)p);
    if (r == NULL || r->va != (uintptr_t)p || r->kind != RANGE_ALLOC) {
        return KV_CU_ERROR_INVALID_VALUE;
    }
    drain(); /* cuMemFree orders after the work queued before it */
    munmap((void *)r->va, r->bytes);
    close(r->owner_fd);
    range_drop(r);
    return KV_CU_SUCCESS;
}

EXPORT kv_cu_result cuMemsetD8_v2(kv_cu_deviceptr p, unsigned char v, size_t n) {
    GUARD();
    CHECK_PROC();
    return enqueue(OP_SET, (uintptr_t)p, 0, NULL, n, v);
}

EXPORT kv_cu_result cuMemcpyHtoD_v2(kv_cu_deviceptr dst, const void *src, size_t n) {
    GUARD();
    CHECK_PROC();
    return enqueue(OP_COPY, (uintptr_t)dst, 0, src, n, 0);
}

EXPORT kv_cu_result cuMemcpyDtoH_v2(void *dst, kv_cu_deviceptr src, size_t n) {
    GUARD();
    CHECK_PROC();
    if (!dev_range_ok((uintptr_t)src, n)) {
        return KV_CU_ERROR_INVALID_VALUE;
    }
    drain(); /* a DtoH copy waits for the work queued before it */
    dev_read(dst, (uintptr_t)src, n);
    return KV_CU_SUCCESS;
}

/* Bytes cuMemcpyDtoD copied so far: tests read it with dlsym to see that the device path ran. */
EXPORT unsigned long long fake_cuda_dtod_bytes;

EXPORT kv_cu_result cuMemcpyDtoD_v2(kv_cu_deviceptr dst, kv_cu_deviceptr src, size_t n) {
    GUARD();
    CHECK_PROC();
    kv_cu_result r = enqueue(OP_COPY, (uintptr_t)dst, (uintptr_t)src, NULL, n, 0);
    if (r == KV_CU_SUCCESS) {
        fake_cuda_dtod_bytes += n;
    }
    return r;
}

EXPORT kv_cu_result cuMemCreate(kv_cu_mem_handle *h, size_t bytes, const kv_cu_alloc_prop *prop,
                                unsigned long long flags) {
    GUARD();
    CHECK_PROC();
    (void)flags;
    if (bytes == 0 || bytes % FAKE_GRANULARITY != 0 ||
        prop->type != KV_CU_MEM_ALLOCATION_TYPE_PINNED) {
        return KV_CU_ERROR_INVALID_VALUE;
    }
    int fd = new_memfd(bytes);
    if (fd < 0) {
        return KV_CU_ERROR_OUT_OF_MEMORY;
    }
    *h = (kv_cu_mem_handle)fd;
    return KV_CU_SUCCESS;
}

EXPORT kv_cu_result cuMemRelease(kv_cu_mem_handle h) {
    GUARD();
    CHECK_PROC();
    close((int)h);
    return KV_CU_SUCCESS;
}

EXPORT kv_cu_result cuMemExportToShareableHandle(void *shareable, kv_cu_mem_handle h, int type,
                                                 unsigned long long flags) {
    GUARD();
    CHECK_PROC();
    (void)flags;
    if (type != KV_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) {
        return KV_CU_ERROR_NOT_SUPPORTED;
    }
    int fd = fcntl((int)h, F_DUPFD_CLOEXEC, 3);
    if (fd < 0) {
        return KV_CU_ERROR_OUT_OF_MEMORY;
    }
    *(int *)shareable = fd;
    return KV_CU_SUCCESS;
}

EXPORT kv_cu_result cuMemImportFromShareableHandle(kv_cu_mem_handle *h, void *os_handle, int type) {
    GUARD();
    CHECK_PROC();
    if (type != KV_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) {
        return KV_CU_ERROR_NOT_SUPPORTED;
    }
    int fd = fcntl((int)(intptr_t)os_handle, F_DUPFD_CLOEXEC, 3);
    if (fd < 0) {
        return KV_CU_ERROR_INVALID_VALUE;
    }
    *h = (kv_cu_mem_handle)fd;
    return KV_CU_SUCCESS;
}

EXPORT kv_cu_result cuMemAddressReserve(kv_cu_deviceptr *p, size_t bytes, size_t align,
                                        kv_cu_deviceptr addr, unsigned long long flags) {
    GUARD();
    CHECK_PROC();
    (void)addr;
    (void)flags;
    if (bytes == 0 || bytes % FAKE_GRANULARITY != 0) {
        return KV_CU_ERROR_INVALID_VALUE;
    }
    if (align < FAKE_GRANULARITY) {
        align = FAKE_GRANULARITY;
    }
    /* Over-reserve, then trim to an aligned range. */
    size_t span = bytes + align;
    uint8_t *m = mmap(NULL, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) {
        return KV_CU_ERROR_OUT_OF_MEMORY;
    }
    uintptr_t start = ((uintptr_t)m + align - 1) / align * align;
    if (start > (uintptr_t)m) {
        munmap(m, start - (uintptr_t)m);
    }
    size_t tail = (size_t)((uintptr_t)m + span - (start + bytes));
    if (tail > 0) {
        munmap((void *)(start + bytes), tail);
    }
    *p = (kv_cu_deviceptr)start;
    return KV_CU_SUCCESS;
}

EXPORT kv_cu_result cuMemAddressFree(kv_cu_deviceptr p, size_t bytes) {
    GUARD();
    CHECK_PROC();
    munmap((void *)(uintptr_t)p, bytes);
    return KV_CU_SUCCESS;
}

EXPORT kv_cu_result cuMemMap(kv_cu_deviceptr p, size_t bytes, size_t offset, kv_cu_mem_handle h,
                             unsigned long long flags) {
    GUARD();
    CHECK_PROC();
    (void)flags;
    if (bytes == 0 || bytes % FAKE_GRANULARITY != 0 || offset % FAKE_GRANULARITY != 0 ||
        p % FAKE_GRANULARITY != 0) {
        return KV_CU_ERROR_INVALID_VALUE;
    }
    if (offset != 0 && env_set("FAKE_CUDA_NO_MAP_OFFSET")) {
        return KV_CU_ERROR_INVALID_VALUE; /* cuda.h: "offset ... currently must be zero" */
    }
    if (range_of((uintptr_t)p) != NULL) {
        return KV_CU_ERROR_ALREADY_MAPPED;
    }
    uintptr_t va = (uintptr_t)p;
    return map_device(&va, bytes, (int)h, (off_t)offset, -1, RANGE_MAP);
}

EXPORT kv_cu_result cuMemUnmap(kv_cu_deviceptr p, size_t bytes) {
    GUARD();
    CHECK_PROC();
    drain();
    int found = 0;
    for (int i = 0; i < FAKE_MAX_RANGES; i++) {
        range *r = &ranges[i];
        if (r->kind == RANGE_MAP && r->va >= (uintptr_t)p &&
            r->va + r->bytes <= (uintptr_t)p + bytes) {
            range_drop(r);
            found = 1;
        }
    }
    void *m = mmap((void *)(uintptr_t)p, bytes, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
    return m == MAP_FAILED || !found ? KV_CU_ERROR_INVALID_VALUE : KV_CU_SUCCESS;
}

EXPORT kv_cu_result cuMemSetAccess(kv_cu_deviceptr p, size_t bytes, const kv_cu_access_desc *d,
                                   size_t count) {
    GUARD();
    CHECK_PROC();
    if (count != 1 || !dev_range_ok((uintptr_t)p, bytes)) {
        return KV_CU_ERROR_INVALID_VALUE;
    }
    if (!env_set("FAKE_CUDA_HOST_ACCESS")) {
        return KV_CU_SUCCESS; /* device access only: the host still faults */
    }
    int prot =
        d->flags == KV_CU_MEM_ACCESS_FLAGS_PROT_READWRITE ? PROT_READ | PROT_WRITE : PROT_READ;
    return mprotect((void *)(uintptr_t)p, bytes, prot) == 0 ? KV_CU_SUCCESS
                                                            : KV_CU_ERROR_NOT_SUPPORTED;
}

EXPORT kv_cu_result cuMemGetAllocationGranularity(size_t *g, const kv_cu_alloc_prop *prop,
                                                  int option) {
    GUARD();
    CHECK_PROC();
    (void)prop;
    (void)option;
    *g = FAKE_GRANULARITY;
    return KV_CU_SUCCESS;
}

/* ---- legacy IPC ------------------------------------------------------------------------------ */

typedef struct fake_ipc {
    uint64_t magic;
    int64_t pid;
    int64_t fd;
    uint64_t bytes;
} fake_ipc;

EXPORT kv_cu_result cuIpcGetMemHandle(kv_cu_ipc_mem_handle *h, kv_cu_deviceptr p) {
    GUARD();
    CHECK_PROC();
    range *r = range_of((uintptr_t)p);
    if (r == NULL || r->va != (uintptr_t)p || r->kind != RANGE_ALLOC) {
        return KV_CU_ERROR_INVALID_VALUE;
    }
    fake_ipc f = {FAKE_IPC_MAGIC, getpid(), r->owner_fd, r->bytes};
    memset(h, 0, sizeof(*h));
    memcpy(h->reserved, &f, sizeof(f));
    return KV_CU_SUCCESS;
}

EXPORT kv_cu_result cuIpcOpenMemHandle_v2(kv_cu_deviceptr *p, kv_cu_ipc_mem_handle h,
                                          unsigned flags) {
    GUARD();
    CHECK_PROC();
    (void)flags;
    fake_ipc f;
    memcpy(&f, h.reserved, sizeof(f));
    if (f.magic != FAKE_IPC_MAGIC) {
        return KV_CU_ERROR_INVALID_VALUE;
    }
    char path[64];
    snprintf(path, sizeof(path), "/proc/%lld/fd/%lld", (long long)f.pid, (long long)f.fd);
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0) {
        return KV_CU_ERROR_INVALID_VALUE;
    }
    uintptr_t va = 0;
    kv_cu_result r = map_device(&va, (size_t)f.bytes, fd, 0, -1, RANGE_IPC);
    close(fd);
    if (r != KV_CU_SUCCESS) {
        return r;
    }
    *p = (kv_cu_deviceptr)va;
    return KV_CU_SUCCESS;
}

EXPORT kv_cu_result cuIpcCloseMemHandle(kv_cu_deviceptr p) {
    GUARD();
    CHECK_PROC();
    range *r = range_of((uintptr_t)p);
    if (r == NULL || r->va != (uintptr_t)p || r->kind != RANGE_IPC) {
        return KV_CU_ERROR_INVALID_VALUE;
    }
    drain();
    munmap((void *)r->va, r->bytes);
    range_drop(r);
    return KV_CU_SUCCESS;
}

/* ---- page-locked host memory ---------------------------------------------------------------- */

/* Host memory a host may touch, as the driver's is: an anonymous mapping of its own (free() of it
 * fails), freed only by cuMemFreeHost (a pointer the fake did not hand out is refused, as the
 * driver refuses it). */
typedef struct hostblock {
    uint8_t *p;
    size_t bytes; /* mapped length (whole pages) */
} hostblock;

static hostblock *hosts;
static size_t nhosts, hosts_cap;

/* Whether [p, p + n) lies in one page-locked block. */
static int pinned_range(const void *p, size_t n) {
    uintptr_t a = (uintptr_t)p;
    for (size_t i = 0; i < nhosts; i++) {
        uintptr_t b = (uintptr_t)hosts[i].p;
        if (a >= b && a - b <= hosts[i].bytes && n <= hosts[i].bytes - (a - b)) {
            return 1;
        }
    }
    return 0;
}

static kv_cu_result host_alloc(void **p, size_t bytes) {
    if (p == NULL || bytes == 0) {
        return KV_CU_ERROR_INVALID_VALUE;
    }
    if (env_set("FAKE_CUDA_NO_PINNED")) {
        return KV_CU_ERROR_OUT_OF_MEMORY;
    }
    if (nhosts == hosts_cap) {
        size_t nc = hosts_cap == 0 ? 64 : hosts_cap * 2;
        hostblock *nh = realloc(hosts, sizeof(*nh) * nc);
        if (nh == NULL) {
            return KV_CU_ERROR_OUT_OF_MEMORY;
        }
        hosts = nh;
        hosts_cap = nc;
    }
    size_t len = (bytes + 4095) / 4096 * 4096;
    void *m = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) {
        return KV_CU_ERROR_OUT_OF_MEMORY;
    }
    hosts[nhosts++] = (hostblock){m, len};
    *p = m;
    return KV_CU_SUCCESS;
}

EXPORT kv_cu_result cuMemAllocHost_v2(void **p, size_t bytes) {
    GUARD();
    CHECK_PROC();
    return host_alloc(p, bytes);
}

EXPORT kv_cu_result cuMemHostAlloc(void **p, size_t bytes, unsigned flags) {
    GUARD();
    CHECK_PROC();
    if ((flags & ~0x7u) != 0) { /* PORTABLE, DEVICEMAP, WRITECOMBINED */
        return KV_CU_ERROR_INVALID_VALUE;
    }
    return host_alloc(p, bytes);
}

EXPORT kv_cu_result cuMemFreeHost(void *p) {
    GUARD();
    CHECK_PROC();
    for (size_t i = 0; i < nhosts; i++) {
        if (hosts[i].p == p) {
            drain(); /* the driver waits for copies still using the memory */
            munmap(p, hosts[i].bytes);
            hosts[i] = hosts[--nhosts];
            return KV_CU_SUCCESS;
        }
    }
    return KV_CU_ERROR_INVALID_VALUE;
}

/* ---- streams -----------------------------------------------------------------------------------
 */

static uintptr_t streams[FAKE_MAX_STREAMS]; /* live stream handles; 0: a free slot */
static uintptr_t next_stream = 0x5000;

static int stream_ok(kv_cu_stream s) {
    if (s == NULL) {
        return 1; /* the legacy stream */
    }
    for (int i = 0; i < FAKE_MAX_STREAMS; i++) {
        if (streams[i] == (uintptr_t)s) {
            return 1;
        }
    }
    return 0;
}

EXPORT kv_cu_result cuStreamCreate(kv_cu_stream *s, unsigned flags) {
    GUARD();
    CHECK_PROC();
    if (s == NULL || (flags & ~1u) != 0) {
        return KV_CU_ERROR_INVALID_VALUE;
    }
    for (int i = 0; i < FAKE_MAX_STREAMS; i++) {
        if (streams[i] == 0) {
            streams[i] = next_stream;
            next_stream += 0x10;
            *s = (kv_cu_stream)streams[i];
            return KV_CU_SUCCESS;
        }
    }
    return KV_CU_ERROR_OUT_OF_MEMORY;
}

EXPORT kv_cu_result cuStreamDestroy_v2(kv_cu_stream s) {
    GUARD();
    CHECK_PROC();
    for (int i = 0; i < FAKE_MAX_STREAMS; i++) {
        if (s != NULL && streams[i] == (uintptr_t)s) {
            drain_stream((uintptr_t)s); /* its work still completes, as the driver's does */
            streams[i] = 0;
            return KV_CU_SUCCESS;
        }
    }
    return KV_CU_ERROR_INVALID_HANDLE;
}

EXPORT kv_cu_result cuStreamSynchronize(kv_cu_stream s) {
    GUARD();
    CHECK_PROC();
    if (!stream_ok(s)) {
        return KV_CU_ERROR_INVALID_HANDLE;
    }
    if (s == NULL) {
        drain(); /* the legacy stream waits for every blocking stream */
    } else {
        drain_stream((uintptr_t)s);
    }
    return KV_CU_SUCCESS;
}

EXPORT kv_cu_result cuMemcpyHtoDAsync_v2(kv_cu_deviceptr dst, const void *src, size_t n,
                                         kv_cu_stream s) {
    GUARD();
    CHECK_PROC();
    if (!stream_ok(s)) {
        return KV_CU_ERROR_INVALID_HANDLE;
    }
    if (!pinned_range(src, n)) { /* pageable: staged at the call, lands later */
        kv_cu_result r = enqueue(OP_COPY, (uintptr_t)dst, 0, src, n, 0);
        if (r == KV_CU_SUCCESS) {
            queue[nqueue - 1].stream = (uintptr_t)s;
        }
        return r;
    }
    if (!dev_range_ok((uintptr_t)dst, n)) {
        return KV_CU_ERROR_INVALID_VALUE;
    }
    pending *q = queue_slot();
    q->op = OP_COPY;
    q->dst = (uintptr_t)dst;
    q->pinned = src; /* the DMA reads it when it runs */
    q->n = n;
    q->stream = (uintptr_t)s;
    nqueue++;
    return KV_CU_SUCCESS;
}

EXPORT kv_cu_result cuMemcpyDtoHAsync_v2(void *dst, kv_cu_deviceptr src, size_t n, kv_cu_stream s) {
    GUARD();
    CHECK_PROC();
    if (!stream_ok(s)) {
        return KV_CU_ERROR_INVALID_HANDLE;
    }
    if (!pinned_range(dst, n)) {
        return cuMemcpyDtoH_v2(dst, src, n); /* pageable: synchronous, as the driver's */
    }
    if (!dev_range_ok((uintptr_t)src, n)) {
        return KV_CU_ERROR_INVALID_VALUE;
    }
    /* Ordered after the work queued before it on its own stream and the legacy one (not other
     * streams': a copy thread that did not wait for its own copies must not be saved by
     * another's). */
    drain_stream(0);
    drain_stream((uintptr_t)s);
    pending *q = queue_slot();
    q->data = malloc(n > 0 ? n : 1);
    if (q->data == NULL) {
        return KV_CU_ERROR_OUT_OF_MEMORY;
    }
    dev_read(q->data, (uintptr_t)src, n); /* the bytes as of now, in stream order */
    q->op = OP_TOHOST;
    q->host = dst; /* written when the stream is synchronized */
    q->n = n;
    q->stream = (uintptr_t)s;
    nqueue++;
    return KV_CU_SUCCESS;
}
