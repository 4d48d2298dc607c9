/* fake_cuda: a stand-in libcuda.so.1 for tests on machines without a GPU (KV_CUDA_LIBRARY points
 * kv_cuda_load at it). NOT a driver: "device memory" is host memory, so the daemon's and the
 * client's real code paths (dlopen, every entry point, fds over SCM_RIGHTS, IPC handles,
 * section mapping at offsets) run end to end and tests can check bytes with plain loads.
 *
 *  - cuMemCreate makes a memfd; the allocation handle is the fd. Export dups it, import dups the
 *    received fd, release closes it: as with the real driver, memory lives while any handle or
 *    mapping does.
 *  - cuMemAddressReserve reserves PROT_NONE address space; cuMemMap maps the memfd there at the
 *    given offset (MAP_FIXED); cuMemUnmap puts PROT_NONE back. Offsets and sizes must be
 *    granularity multiples (64 KiB here), as the real driver demands.
 *  - cuMemAlloc maps a memfd; cuIpcGetMemHandle writes (magic, pid, fd, bytes) into the 64
 *    bytes and cuIpcOpenMemHandle opens /proc/PID/fd/FD of the exporter (same uid only).
 * Environment: FAKE_CUDA_NO_DEVICE=1 makes cuInit fail with CUDA_ERROR_NO_DEVICE,
 * FAKE_CUDA_NO_VMM=1 reports no VMM support. Single-threaded use is enough for tests.
 */
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "daemon/cuda_driver.h"

#define FAKE_GRANULARITY (64u << 10)
#define FAKE_IPC_MAGIC 0x6b766466616b6531ull /* "kvdfake1" */
#define FAKE_MAX_ALLOCS 4096

#define EXPORT __attribute__((visibility("default")))

/* cuMemAlloc and cuIpcOpenMemHandle mappings: address -> bytes (and fd for cuMemAlloc). */
static struct {
    uintptr_t p;
    size_t bytes;
    int fd;
} allocs[FAKE_MAX_ALLOCS];

static int env_set(const char *name) {
    const char *v = getenv(name);
    return v != NULL && v[0] == '1';
}

static int track(uintptr_t p, size_t bytes, int fd) {
    for (int i = 0; i < FAKE_MAX_ALLOCS; i++) {
        if (allocs[i].p == 0) {
            allocs[i].p = p;
            allocs[i].bytes = bytes;
            allocs[i].fd = fd;
            return 0;
        }
    }
    return -1;
}

static int untrack(uintptr_t p, size_t *bytes, int *fd) {
    for (int i = 0; i < FAKE_MAX_ALLOCS; i++) {
        if (allocs[i].p == p) {
            *bytes = allocs[i].bytes;
            *fd = allocs[i].fd;
            allocs[i].p = 0;
            return 0;
        }
    }
    return -1;
}

EXPORT kv_cu_result cuInit(unsigned flags) {
    (void)flags;
    return env_set("FAKE_CUDA_NO_DEVICE") ? KV_CU_ERROR_NO_DEVICE : KV_CU_SUCCESS;
}

EXPORT kv_cu_result cuDriverGetVersion(int *v) {
    *v = 13000;
    return KV_CU_SUCCESS;
}

EXPORT kv_cu_result cuGetErrorName(kv_cu_result r, const char **s) {
    switch (r) {
        case KV_CU_SUCCESS:
            *s = "CUDA_SUCCESS";
            return KV_CU_SUCCESS;
        case KV_CU_ERROR_OUT_OF_MEMORY:
            *s = "CUDA_ERROR_OUT_OF_MEMORY";
            return KV_CU_SUCCESS;
        case KV_CU_ERROR_NO_DEVICE:
            *s = "CUDA_ERROR_NO_DEVICE";
            return KV_CU_SUCCESS;
        case KV_CU_ERROR_INVALID_DEVICE:
            *s = "CUDA_ERROR_INVALID_DEVICE";
            return KV_CU_SUCCESS;
        default:
            *s = "CUDA_ERROR_UNKNOWN";
            return KV_CU_SUCCESS;
    }
}

EXPORT kv_cu_result cuGetErrorString(kv_cu_result r, const char **s) {
    *s = r == KV_CU_ERROR_NO_DEVICE ? "no CUDA-capable device is detected" : "fake driver error";
    return KV_CU_SUCCESS;
}

EXPORT kv_cu_result cuDeviceGetCount(int *n) {
    *n = 1;
    return KV_CU_SUCCESS;
}

EXPORT kv_cu_result cuDeviceGet(kv_cu_device *d, int ordinal) {
    if (ordinal != 0) {
        return KV_CU_ERROR_INVALID_DEVICE;
    }
    *d = 0;
    return KV_CU_SUCCESS;
}

EXPORT kv_cu_result cuDeviceGetAttribute(int *v, int attr, kv_cu_device d) {
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
    (void)d;
    snprintf(name, (size_t)len, "kvd fake GPU");
    return KV_CU_SUCCESS;
}

static int primary_ctx; /* its address is the fake context */

EXPORT kv_cu_result cuDevicePrimaryCtxRetain(kv_cu_context *ctx, kv_cu_device d) {
    (void)d;
    *ctx = (kv_cu_context)(void *)&primary_ctx;
    return KV_CU_SUCCESS;
}

EXPORT kv_cu_result cuDevicePrimaryCtxRelease_v2(kv_cu_device d) {
    (void)d;
    return KV_CU_SUCCESS;
}

static kv_cu_context current;

EXPORT kv_cu_result cuCtxSetCurrent(kv_cu_context ctx) {
    current = ctx;
    return KV_CU_SUCCESS;
}

EXPORT kv_cu_result cuCtxGetCurrent(kv_cu_context *ctx) {
    *ctx = current;
    return KV_CU_SUCCESS;
}

EXPORT kv_cu_result cuCtxGetDevice(kv_cu_device *d) {
    *d = 0;
    return current != NULL ? KV_CU_SUCCESS : KV_CU_ERROR_NOT_INITIALIZED;
}

EXPORT kv_cu_result cuCtxSynchronize(void) {
    return KV_CU_SUCCESS;
}

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

EXPORT kv_cu_result cuMemAlloc_v2(kv_cu_deviceptr *p, size_t bytes) {
    int fd = new_memfd(bytes);
    if (fd < 0) {
        return KV_CU_ERROR_OUT_OF_MEMORY;
    }
    void *m = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED || track((uintptr_t)m, bytes, fd) != 0) {
        close(fd);
        return KV_CU_ERROR_OUT_OF_MEMORY;
    }
    *p = (kv_cu_deviceptr)(uintptr_t)m;
    return KV_CU_SUCCESS;
}

EXPORT kv_cu_result cuMemFree_v2(kv_cu_deviceptr p) {
    size_t bytes;
    int fd;
    if (untrack((uintptr_t)p, &bytes, &fd) != 0 || fd < 0) {
        return KV_CU_ERROR_NOT_SUPPORTED;
    }
    munmap((void *)(uintptr_t)p, bytes);
    close(fd);
    return KV_CU_SUCCESS;
}

EXPORT kv_cu_result cuMemsetD8_v2(kv_cu_deviceptr p, unsigned char v, size_t n) {
    memset((void *)(uintptr_t)p, v, n);
    return KV_CU_SUCCESS;
}

EXPORT kv_cu_result cuMemcpyHtoD_v2(kv_cu_deviceptr dst, const void *src, size_t n) {
    memcpy((void *)(uintptr_t)dst, src, n);
    return KV_CU_SUCCESS;
}

EXPORT kv_cu_result cuMemcpyDtoH_v2(void *dst, kv_cu_deviceptr src, size_t n) {
    memcpy(dst, (const void *)(uintptr_t)src, n);
    return KV_CU_SUCCESS;
}

/* Bytes cuMemcpyDtoD copied so far: tests read it with dlsym to see that the device path ran. */
EXPORT unsigned long long fake_cuda_dtod_bytes;

/* Synchronous here; the real driver may return before a device-to-device copy completes. */
EXPORT kv_cu_result cuMemcpyDtoD_v2(kv_cu_deviceptr dst, kv_cu_deviceptr src, size_t n) {
    memcpy((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, n);
    fake_cuda_dtod_bytes += n;
    return KV_CU_SUCCESS;
}

EXPORT kv_cu_result cuMemCreate(kv_cu_mem_handle *h, size_t bytes, const kv_cu_alloc_prop *prop,
                                unsigned long long flags) {
    (void)flags;
    if (bytes == 0 || bytes % FAKE_GRANULARITY != 0 ||
        prop->type != KV_CU_MEM_ALLOCATION_TYPE_PINNED) {
        return KV_CU_ERROR_NOT_SUPPORTED;
    }
    int fd = new_memfd(bytes);
    if (fd < 0) {
        return KV_CU_ERROR_OUT_OF_MEMORY;
    }
    *h = (kv_cu_mem_handle)fd;
    return KV_CU_SUCCESS;
}

EXPORT kv_cu_result cuMemRelease(kv_cu_mem_handle h) {
    close((int)h);
    return KV_CU_SUCCESS;
}

EXPORT kv_cu_result cuMemExportToShareableHandle(void *shareable, kv_cu_mem_handle h, int type,
                                                 unsigned long long flags) {
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
    if (type != KV_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR) {
        return KV_CU_ERROR_NOT_SUPPORTED;
    }
    int fd = fcntl((int)(intptr_t)os_handle, F_DUPFD_CLOEXEC, 3);
    if (fd < 0) {
        return KV_CU_ERROR_NOT_SUPPORTED;
    }
    *h = (kv_cu_mem_handle)fd;
    return KV_CU_SUCCESS;
}

EXPORT kv_cu_result cuMemAddressReserve(kv_cu_deviceptr *p, size_t bytes, size_t align,
                                        kv_cu_deviceptr addr, unsigned long long flags) {
    (void)addr;
    (void)flags;
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
    munmap((void *)(uintptr_t)p, bytes);
    return KV_CU_SUCCESS;
}

EXPORT kv_cu_result cuMemMap(kv_cu_deviceptr p, size_t bytes, size_t offset, kv_cu_mem_handle h,
                             unsigned long long flags) {
    (void)flags;
    if (bytes % FAKE_GRANULARITY != 0 || offset % FAKE_GRANULARITY != 0 ||
        p % FAKE_GRANULARITY != 0) {
        return KV_CU_ERROR_NOT_SUPPORTED;
    }
    /* PROT_NONE until cuMemSetAccess, as with the real driver. */
    void *m =
        mmap((void *)(uintptr_t)p, bytes, PROT_NONE, MAP_SHARED | MAP_FIXED, (int)h, (off_t)offset);
    return m == MAP_FAILED ? KV_CU_ERROR_OUT_OF_MEMORY : KV_CU_SUCCESS;
}

EXPORT kv_cu_result cuMemUnmap(kv_cu_deviceptr p, size_t bytes) {
    void *m = mmap((void *)(uintptr_t)p, bytes, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
    return m == MAP_FAILED ? KV_CU_ERROR_NOT_SUPPORTED : KV_CU_SUCCESS;
}

EXPORT kv_cu_result cuMemSetAccess(kv_cu_deviceptr p, size_t bytes, const kv_cu_access_desc *d,
                                   size_t count) {
    if (count != 1) {
        return KV_CU_ERROR_NOT_SUPPORTED;
    }
    int prot =
        d->flags == KV_CU_MEM_ACCESS_FLAGS_PROT_READWRITE ? PROT_READ | PROT_WRITE : PROT_READ;
    return mprotect((void *)(uintptr_t)p, bytes, prot) == 0 ? KV_CU_SUCCESS
                                                            : KV_CU_ERROR_NOT_SUPPORTED;
}

EXPORT kv_cu_result cuMemGetAllocationGranularity(size_t *g, const kv_cu_alloc_prop *prop,
                                                  int option) {
    (void)prop;
    (void)option;
    *g = FAKE_GRANULARITY;
    return KV_CU_SUCCESS;
}

typedef struct fake_ipc {
    uint64_t magic;
    int64_t pid;
    int64_t fd;
    uint64_t bytes;
} fake_ipc;

EXPORT kv_cu_result cuIpcGetMemHandle(kv_cu_ipc_mem_handle *h, kv_cu_deviceptr p) {
    for (int i = 0; i < FAKE_MAX_ALLOCS; i++) {
        if (allocs[i].p == (uintptr_t)p && allocs[i].fd >= 0) {
            fake_ipc f = {FAKE_IPC_MAGIC, getpid(), allocs[i].fd, allocs[i].bytes};
            memset(h, 0, sizeof(*h));
            memcpy(h->reserved, &f, sizeof(f));
            return KV_CU_SUCCESS;
        }
    }
    return KV_CU_ERROR_NOT_SUPPORTED;
}

EXPORT kv_cu_result cuIpcOpenMemHandle_v2(kv_cu_deviceptr *p, kv_cu_ipc_mem_handle h,
                                          unsigned flags) {
    (void)flags;
    fake_ipc f;
    memcpy(&f, h.reserved, sizeof(f));
    if (f.magic != FAKE_IPC_MAGIC) {
        return KV_CU_ERROR_NOT_SUPPORTED;
    }
    char path[64];
    snprintf(path, sizeof(path), "/proc/%lld/fd/%lld", (long long)f.pid, (long long)f.fd);
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0) {
        return KV_CU_ERROR_NOT_SUPPORTED;
    }
    void *m = mmap(NULL, f.bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED || track((uintptr_t)m, f.bytes, -1) != 0) {
        return KV_CU_ERROR_OUT_OF_MEMORY;
    }
    *p = (kv_cu_deviceptr)(uintptr_t)m;
    return KV_CU_SUCCESS;
}

EXPORT kv_cu_result cuIpcCloseMemHandle(kv_cu_deviceptr p) {
    size_t bytes;
    int fd;
    if (untrack((uintptr_t)p, &bytes, &fd) != 0 || fd >= 0) {
        return KV_CU_ERROR_NOT_SUPPORTED;
    }
    munmap((void *)(uintptr_t)p, bytes);
    return KV_CU_SUCCESS;
}
