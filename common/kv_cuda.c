/* kv_cuda: dlopen loader of the CUDA driver. Every symbol is resolved up front, so a driver too
 * old for VMM fails at load with one clear sentence instead of at the first allocation. */
#include "common/kv_cuda.h"

#include <dlfcn.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define DEFAULT_LIBRARY "libcuda.so.1"

/* The driver reads these structs by their C layout: keep them byte for byte as cuda.h's. */
_Static_assert(sizeof(kv_cu_alloc_prop) == 32, "CUmemAllocationProp is 32 bytes on LP64");
_Static_assert(sizeof(kv_cu_access_desc) == 12, "CUmemAccessDesc is 12 bytes");
_Static_assert(sizeof(kv_cu_ipc_mem_handle) == 64, "CUipcMemHandle is 64 bytes");

const char *kv_cuda_library_name(void) {
    const char *env = getenv("KV_CUDA_LIBRARY");
    return env != NULL && env[0] != '\0' ? env : DEFAULT_LIBRARY;
}

static void set_why(char *why, size_t len, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void set_why(char *why, size_t len, const char *fmt, ...) {
    if (why == NULL || len == 0) {
        return;
    }
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, len, fmt, ap);
    va_end(ap);
}

/* One entry point: the versioned name cuda.h's macros map the API name to (CUDA 13 headers). */
typedef struct sym_row {
    const char *name;  /* exported symbol */
    size_t offset;     /* function pointer in kv_cuda */
    const char *since; /* driver that added it, for the error */
} sym_row;

#define SYM(field, name, since)                                                                    \
    { name, offsetof(kv_cuda, field), since }

static const sym_row syms[] = {
    SYM(init, "cuInit", "CUDA 2.0"),
    SYM(driver_get_version, "cuDriverGetVersion", "CUDA 2.2"),
    SYM(get_error_name, "cuGetErrorName", "CUDA 6.0"),
    SYM(get_error_string, "cuGetErrorString", "CUDA 6.0"),
    SYM(device_get_count, "cuDeviceGetCount", "CUDA 2.0"),
    SYM(device_get, "cuDeviceGet", "CUDA 2.0"),
    SYM(device_get_attribute, "cuDeviceGetAttribute", "CUDA 2.0"),
    SYM(device_get_name, "cuDeviceGetName", "CUDA 2.0"),
    SYM(device_get_uuid, "cuDeviceGetUuid_v2", "CUDA 11.4"),
    SYM(primary_ctx_retain, "cuDevicePrimaryCtxRetain", "CUDA 7.0"),
    SYM(primary_ctx_release, "cuDevicePrimaryCtxRelease_v2", "CUDA 11.0"),
    SYM(ctx_set_current, "cuCtxSetCurrent", "CUDA 4.0"),
    SYM(ctx_get_current, "cuCtxGetCurrent", "CUDA 4.0"),
    SYM(ctx_get_device, "cuCtxGetDevice", "CUDA 2.0"),
    SYM(ctx_synchronize, "cuCtxSynchronize", "CUDA 2.0"),
    SYM(mem_alloc, "cuMemAlloc_v2", "CUDA 3.2"),
    SYM(mem_free, "cuMemFree_v2", "CUDA 3.2"),
    SYM(memset_d8, "cuMemsetD8_v2", "CUDA 3.2"),
    SYM(memcpy_htod, "cuMemcpyHtoD_v2", "CUDA 3.2"),
    SYM(memcpy_dtoh, "cuMemcpyDtoH_v2", "CUDA 3.2"),
    SYM(memcpy_dtod, "cuMemcpyDtoD_v2", "CUDA 3.2"),
    SYM(mem_create, "cuMemCreate", "CUDA 10.2"),
    SYM(mem_release, "cuMemRelease", "CUDA 10.2"),
    SYM(mem_export, "cuMemExportToShareableHandle", "CUDA 10.2"),
    SYM(mem_import, "cuMemImportFromShareableHandle", "CUDA 10.2"),
    SYM(mem_address_reserve, "cuMemAddressReserve", "CUDA 10.2"),
    SYM(mem_address_free, "cuMemAddressFree", "CUDA 10.2"),
    SYM(mem_map, "cuMemMap", "CUDA 10.2"),
    SYM(mem_unmap, "cuMemUnmap", "CUDA 10.2"),
    SYM(mem_set_access, "cuMemSetAccess", "CUDA 10.2"),
    SYM(mem_get_granularity, "cuMemGetAllocationGranularity", "CUDA 10.2"),
    SYM(ipc_get_mem_handle, "cuIpcGetMemHandle", "CUDA 4.1"),
    SYM(ipc_open_mem_handle, "cuIpcOpenMemHandle_v2", "CUDA 11.0"),
    SYM(ipc_close_mem_handle, "cuIpcCloseMemHandle", "CUDA 4.1"),
    SYM(mem_alloc_host, "cuMemAllocHost_v2", "CUDA 3.2"),
    SYM(mem_free_host, "cuMemFreeHost", "CUDA 2.0"),
    SYM(mem_host_alloc, "cuMemHostAlloc", "CUDA 2.2"),
    SYM(stream_create, "cuStreamCreate", "CUDA 2.0"),
    SYM(stream_destroy, "cuStreamDestroy_v2", "CUDA 4.0"),
    SYM(stream_synchronize, "cuStreamSynchronize", "CUDA 2.0"),
    SYM(memcpy_dtoh_async, "cuMemcpyDtoHAsync_v2", "CUDA 3.2"),
    SYM(memcpy_htod_async, "cuMemcpyHtoDAsync_v2", "CUDA 3.2"),
};

kv_err kv_cuda_load(const char *lib, kv_cuda *out, char *why, size_t why_len) {
    const char *name = lib != NULL ? lib : kv_cuda_library_name();
    kv_cuda cu;
    memset(&cu, 0, sizeof(cu));
    cu.lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
    if (cu.lib == NULL) {
        const char *e = dlerror();
        set_why(why, why_len, "%s not found (%s)", name, e != NULL ? e : "dlopen failed");
        return KV_ENOGPU;
    }
    for (size_t i = 0; i < sizeof(syms) / sizeof(syms[0]); i++) {
        void *f = dlsym(cu.lib, syms[i].name);
        if (f == NULL) {
            set_why(why, why_len, "%s lacks %s (a driver older than %s?)", name, syms[i].name,
                    syms[i].since);
            dlclose(cu.lib);
            return KV_ENOGPU;
        }
        /* POSIX guarantees a data pointer from dlsym converts to a function pointer. */
        memcpy((char *)&cu + syms[i].offset, &f, sizeof(f));
    }
    kv_cu_result r = cu.init(0);
    if (r != KV_CU_SUCCESS) {
        char buf[160];
        set_why(why, why_len, "cuInit failed: %s", kv_cuda_strerror(&cu, r, buf, sizeof(buf)));
        dlclose(cu.lib);
        return KV_ENOGPU;
    }
    if (cu.driver_get_version(&cu.driver_version) != KV_CU_SUCCESS) {
        cu.driver_version = 0;
    }
    *out = cu;
    return KV_OK;
}

void kv_cuda_unload(kv_cuda *cu) {
    if (cu == NULL) {
        return;
    }
    /* No dlclose: cuInit ran (kv_cuda_load only returns an initialised table). */
    memset(cu, 0, sizeof(*cu));
}

const char *kv_cuda_uuid_str(const kv_cu_uuid *u, char *buf, size_t len) {
    const unsigned char *b = u->bytes;
    snprintf(buf, len, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
             b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13],
             b[14], b[15]);
    return buf;
}

const char *kv_cuda_strerror(const kv_cuda *cu, kv_cu_result r, char *buf, size_t len) {
    const char *n = NULL;
    const char *s = NULL;
    if (cu != NULL && cu->get_error_name != NULL) {
        if (cu->get_error_name(r, &n) != KV_CU_SUCCESS) {
            n = NULL;
        }
        if (cu->get_error_string(r, &s) != KV_CU_SUCCESS) {
            s = NULL;
        }
    }
    if (n != NULL) {
        snprintf(buf, len, "%s (%s)", n, s != NULL ? s : "no description");
    } else {
        snprintf(buf, len, "CUresult %d", r);
    }
    return buf;
}

kv_err kv_cuda_device_open(const kv_cuda *cu, int ordinal, kv_cuda_device *out, char *why,
                           size_t why_len) {
    char buf[160];
    int count = 0;
    kv_cu_result r = cu->device_get_count(&count);
    if (r != KV_CU_SUCCESS) {
        set_why(why, why_len, "cuDeviceGetCount failed: %s",
                kv_cuda_strerror(cu, r, buf, sizeof(buf)));
        return KV_ENOGPU;
    }
    if (ordinal < 0 || ordinal >= count) {
        set_why(why, why_len, "device %d does not exist (%d visible)", ordinal, count);
        return KV_ENOGPU;
    }
    kv_cuda_device d;
    memset(&d, 0, sizeof(d));
    d.ordinal = ordinal;
    r = cu->device_get(&d.dev, ordinal);
    if (r != KV_CU_SUCCESS) {
        set_why(why, why_len, "cuDeviceGet(%d) failed: %s", ordinal,
                kv_cuda_strerror(cu, r, buf, sizeof(buf)));
        return KV_ENOGPU;
    }
    if (cu->device_get_name(d.name, (int)sizeof(d.name), d.dev) != KV_CU_SUCCESS) {
        snprintf(d.name, sizeof(d.name), "device %d", ordinal);
    }
    if (cu->device_get_uuid(&d.uuid, d.dev) != KV_CU_SUCCESS) {
        memset(&d.uuid, 0, sizeof(d.uuid));
    }
    r = cu->primary_ctx_retain(&d.ctx, d.dev);
    if (r != KV_CU_SUCCESS) {
        set_why(why, why_len, "cannot retain the primary context of device %d (%s): %s", ordinal,
                d.name, kv_cuda_strerror(cu, r, buf, sizeof(buf)));
        return KV_ENOGPU;
    }
    r = cu->ctx_set_current(d.ctx);
    if (r != KV_CU_SUCCESS) {
        set_why(why, why_len, "cuCtxSetCurrent on device %d failed: %s", ordinal,
                kv_cuda_strerror(cu, r, buf, sizeof(buf)));
        cu->primary_ctx_release(d.dev);
        return KV_ENOGPU;
    }
    if (cu->device_get_attribute(&d.vmm, KV_CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                                 d.dev) != KV_CU_SUCCESS) {
        d.vmm = 0;
    }
    if (cu->device_get_attribute(&d.posix_fd,
                                 KV_CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
                                 d.dev) != KV_CU_SUCCESS) {
        d.posix_fd = 0;
    }
    if (d.vmm && d.posix_fd) {
        kv_cu_alloc_prop prop;
        memset(&prop, 0, sizeof(prop));
        prop.type = KV_CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.requested_handle_types = KV_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
        prop.location.type = KV_CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = d.dev;
        size_t g = 0;
        if (cu->mem_get_granularity(&g, &prop, KV_CU_MEM_ALLOC_GRANULARITY_MINIMUM) ==
                KV_CU_SUCCESS &&
            g != 0 && (g & (g - 1)) == 0) {
            d.granularity = g;
        }
    }
    *out = d;
    return KV_OK;
}

void kv_cuda_device_close(const kv_cuda *cu, kv_cuda_device *d) {
    if (d == NULL || d->ctx == NULL || cu == NULL || cu->lib == NULL) {
        return;
    }
    cu->primary_ctx_release(d->dev);
    d->ctx = NULL;
}
