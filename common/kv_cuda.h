/* kv_cuda: the CUDA driver API, loaded at run time with dlopen("libcuda.so.1").
 *
 * kvd and libkvclient must run on machines with no GPU, no driver and no toolkit, and the build
 * must work without cuda.h (`--config=nocuda`). So this module declares the few driver types,
 * enum values and function signatures it needs itself (values from the CUDA driver API
 * reference; they are ABI and never change), and resolves each entry point with dlsym by its
 * versioned name (cuMemAlloc_v2, cuIpcOpenMemHandle_v2, ...) exactly as cuda.h's macros would.
 * The legacy IPC path also goes through the driver (cuMemAlloc + cuIpcGetMemHandle /
 * cuIpcOpenMemHandle / cuIpcCloseMemHandle, the driver equivalents of cudaMalloc and
 * cudaIpc*MemHandle), so only libcuda is ever loaded, never libcudart.
 *
 * Shared by the daemon (daemon/backend_cuda.c) and libkvclient (client/gpu_map.c): names are
 * kv_cuda_*. A kv_cuda table is filled once and then read-only; the driver itself is thread-safe
 * but its "current context" is per thread, so callers make their context current on the thread
 * that calls (kv_cuda_device_open does it for the calling thread).
 */
#ifndef KV_CUDA_H
#define KV_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "common/kv_err.h"

/* ---- driver types (ABI of cuda.h, declared here so that cuda.h is never needed) ---------- */

typedef int kv_cu_result;                     /* CUresult; 0 = CUDA_SUCCESS */
typedef int kv_cu_device;                     /* CUdevice: an ordinal */
typedef struct kv_cu_ctx_st *kv_cu_context;   /* CUcontext */
typedef unsigned long long kv_cu_deviceptr;   /* CUdeviceptr (64-bit builds) */
typedef unsigned long long kv_cu_mem_handle;  /* CUmemGenericAllocationHandle */
typedef struct kv_cu_stream_st *kv_cu_stream; /* CUstream */

#define KV_CU_SUCCESS 0
#define KV_CU_ERROR_OUT_OF_MEMORY 2
#define KV_CU_ERROR_NOT_INITIALIZED 3
#define KV_CU_ERROR_NO_DEVICE 100
#define KV_CU_ERROR_INVALID_DEVICE 101
#define KV_CU_ERROR_ALREADY_MAPPED 208
#define KV_CU_ERROR_NOT_SUPPORTED 801

#define KV_CU_MEM_ALLOCATION_TYPE_PINNED 1            /* CUmemAllocationType */
#define KV_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR 1 /* CUmemAllocationHandleType */
#define KV_CU_MEM_LOCATION_TYPE_DEVICE 1              /* CUmemLocationType */
#define KV_CU_MEM_ACCESS_FLAGS_PROT_READ 1            /* CUmemAccess_flags */
#define KV_CU_MEM_ACCESS_FLAGS_PROT_READWRITE 3
#define KV_CU_MEM_ALLOC_GRANULARITY_MINIMUM 0 /* CUmemAllocationGranularity_flags */
#define KV_CU_MEM_ALLOC_GRANULARITY_RECOMMENDED 1
#define KV_CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS 1 /* CUipcMem_flags */
#define KV_CU_IPC_HANDLE_SIZE 64                /* CU_IPC_HANDLE_SIZE */
#define KV_CU_MEMHOSTALLOC_PORTABLE 1           /* cuMemHostAlloc: pinned for every context */
#define KV_CU_STREAM_NON_BLOCKING 1             /* CUstream_flags: no sync with stream 0 */

#define KV_CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED 102 /* CUdevice_attribute */
#define KV_CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED 103

/* CUmemLocation */
typedef struct kv_cu_mem_location {
    int type; /* KV_CU_MEM_LOCATION_TYPE_DEVICE */
    int id;   /* device ordinal */
} kv_cu_mem_location;

/* CUmemAllocationProp (v1): 32 bytes on LP64. */
typedef struct kv_cu_alloc_prop {
    int type;                    /* KV_CU_MEM_ALLOCATION_TYPE_PINNED */
    int requested_handle_types;  /* KV_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR */
    kv_cu_mem_location location; /* where the memory lives */
    void *win32_meta;            /* Windows only; NULL */
    struct {
        unsigned char compression_type; /* 0: not compressible */
        unsigned char gpu_direct_rdma;  /* 0 */
        unsigned short usage;           /* 0 */
        unsigned char reserved[4];      /* 0 */
    } alloc_flags;                      /* CUmemAllocationProp.allocFlags */
} kv_cu_alloc_prop;

/* CUmemAccessDesc */
typedef struct kv_cu_access_desc {
    kv_cu_mem_location location; /* the device that gets access */
    int flags;                   /* KV_CU_MEM_ACCESS_FLAGS_* */
} kv_cu_access_desc;

/* CUuuid: 16 bytes naming one GPU (what nvidia-smi shows as GPU-xxxxxxxx-...). */
typedef struct kv_cu_uuid {
    unsigned char bytes[16];
} kv_cu_uuid;

/* CUipcMemHandle: passed by value. */
typedef struct kv_cu_ipc_mem_handle {
    unsigned char reserved[KV_CU_IPC_HANDLE_SIZE]; /* opaque */
} kv_cu_ipc_mem_handle;

/* ---- the loaded driver ---------------------------------------------------------------- */

/* Entry points of libcuda.so.1; every one is resolved or kv_cuda_load fails. */
typedef struct kv_cuda {
    void *lib;          /* dlopen handle; NULL when not loaded */
    int driver_version; /* cuDriverGetVersion: 1000 * major + 10 * minor */
    kv_cu_result (*init)(unsigned flags);
    kv_cu_result (*driver_get_version)(int *v);
    kv_cu_result (*get_error_name)(kv_cu_result r, const char **s);
    kv_cu_result (*get_error_string)(kv_cu_result r, const char **s);
    kv_cu_result (*device_get_count)(int *n);
    kv_cu_result (*device_get)(kv_cu_device *d, int ordinal);
    kv_cu_result (*device_get_attribute)(int *v, int attr, kv_cu_device d);
    kv_cu_result (*device_get_name)(char *name, int len, kv_cu_device d);
    kv_cu_result (*device_get_uuid)(kv_cu_uuid *uuid, kv_cu_device d);
    kv_cu_result (*primary_ctx_retain)(kv_cu_context *ctx, kv_cu_device d);
    kv_cu_result (*primary_ctx_release)(kv_cu_device d);
    kv_cu_result (*ctx_set_current)(kv_cu_context ctx);
    kv_cu_result (*ctx_get_current)(kv_cu_context *ctx);
    kv_cu_result (*ctx_get_device)(kv_cu_device *d);
    kv_cu_result (*ctx_synchronize)(void);
    kv_cu_result (*mem_alloc)(kv_cu_deviceptr *p, size_t bytes);
    kv_cu_result (*mem_free)(kv_cu_deviceptr p);
    kv_cu_result (*memset_d8)(kv_cu_deviceptr p, unsigned char v, size_t n);
    kv_cu_result (*memcpy_htod)(kv_cu_deviceptr dst, const void *src, size_t n);
    kv_cu_result (*memcpy_dtoh)(void *dst, kv_cu_deviceptr src, size_t n);
    kv_cu_result (*memcpy_dtod)(kv_cu_deviceptr dst, kv_cu_deviceptr src, size_t n);
    kv_cu_result (*mem_create)(kv_cu_mem_handle *h, size_t bytes, const kv_cu_alloc_prop *prop,
                               unsigned long long flags);
    kv_cu_result (*mem_release)(kv_cu_mem_handle h);
    kv_cu_result (*mem_export)(void *shareable, kv_cu_mem_handle h, int handle_type,
                               unsigned long long flags);
    kv_cu_result (*mem_import)(kv_cu_mem_handle *h, void *os_handle, int handle_type);
    kv_cu_result (*mem_address_reserve)(kv_cu_deviceptr *p, size_t bytes, size_t align,
                                        kv_cu_deviceptr addr, unsigned long long flags);
    kv_cu_result (*mem_address_free)(kv_cu_deviceptr p, size_t bytes);
    kv_cu_result (*mem_map)(kv_cu_deviceptr p, size_t bytes, size_t offset, kv_cu_mem_handle h,
                            unsigned long long flags);
    kv_cu_result (*mem_unmap)(kv_cu_deviceptr p, size_t bytes);
    kv_cu_result (*mem_set_access)(kv_cu_deviceptr p, size_t bytes, const kv_cu_access_desc *d,
                                   size_t count);
    kv_cu_result (*mem_get_granularity)(size_t *g, const kv_cu_alloc_prop *prop, int option);
    kv_cu_result (*ipc_get_mem_handle)(kv_cu_ipc_mem_handle *h, kv_cu_deviceptr p);
    kv_cu_result (*ipc_open_mem_handle)(kv_cu_deviceptr *p, kv_cu_ipc_mem_handle h, unsigned flags);
    kv_cu_result (*ipc_close_mem_handle)(kv_cu_deviceptr p);
    kv_cu_result (*mem_alloc_host)(void **p, size_t bytes); /* page-locked host memory */
    kv_cu_result (*mem_free_host)(void *p);
    kv_cu_result (*mem_host_alloc)(void **p, size_t bytes, unsigned flags); /* page-locked */
    kv_cu_result (*stream_create)(kv_cu_stream *s, unsigned flags);
    kv_cu_result (*stream_destroy)(kv_cu_stream s);
    kv_cu_result (*stream_synchronize)(kv_cu_stream s);
    kv_cu_result (*memcpy_dtoh_async)(void *dst, kv_cu_deviceptr src, size_t n, kv_cu_stream s);
    kv_cu_result (*memcpy_htod_async)(kv_cu_deviceptr dst, const void *src, size_t n,
                                      kv_cu_stream s);
} kv_cuda;

/* The library kv_cuda_load opens when given NULL: $KV_CUDA_LIBRARY if set and non-empty (tests,
 * unusual installs), else "libcuda.so.1" (the driver's soname; the unversioned libcuda.so only
 * exists where the toolkit is installed). Any thread. */
const char *kv_cuda_library_name(void);

/* Opens the driver library (lib NULL: kv_cuda_library_name()), resolves every entry point and
 * calls cuInit(0). Writes *out only on success. On failure returns KV_ENOGPU and writes a
 * sentence into why (if not NULL) saying which step failed: "libcuda.so.1 not found (...)",
 * "libcuda.so.1 lacks cuMemCreate (driver older than CUDA 10.2?)", "cuInit failed:
 * CUDA_ERROR_NO_DEVICE (...)". Nothing is left open then. Any thread; the table is read-only
 * afterwards and may be shared between threads. */
kv_err kv_cuda_load(const char *lib, kv_cuda *out, char *why, size_t why_len);

/* Zeroes the table. The library stays loaded: a driver that ran cuInit is never unloaded (its
 * threads and atexit handlers outlive any context, and unloading it under them is undefined), so
 * a process that loads again gets the same library. Accepts NULL and a zeroed table. */
void kv_cuda_unload(kv_cuda *cu);

/* "CUDA_ERROR_OUT_OF_MEMORY (out of memory)" for r, in static or driver-owned storage; works
 * with a zeroed table ("CUresult 2"). Any thread. */
const char *kv_cuda_strerror(const kv_cuda *cu, kv_cu_result r, char *buf, size_t len);

/* What a device offers, checked at open. */
typedef struct kv_cuda_device {
    int ordinal;          /* as given (CUDA_VISIBLE_DEVICES numbering) */
    kv_cu_device dev;     /* CUdevice */
    kv_cu_context ctx;    /* the device's primary context, retained */
    int vmm;              /* CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED */
    int posix_fd;         /* CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED */
    uint64_t granularity; /* minimum VMM granularity of a POSIX-fd allocation there; 0 without */
    kv_cu_uuid uuid;      /* cuDeviceGetUuid: which GPU this is, whatever its ordinal */
    char name[96];        /* cuDeviceGetName */
} kv_cuda_device;

/* Retains ordinal's primary context, makes it current on the calling thread and reads its
 * attributes and VMM granularity. KV_ENOGPU with a reason in why when the device does not exist
 * or the context cannot be had. Writes *out only on success. */
kv_err kv_cuda_device_open(const kv_cuda *cu, int ordinal, kv_cuda_device *out, char *why,
                           size_t why_len);

/* The UUID as nvidia-smi prints it: "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" (buf >= 41 bytes).
 * Any thread. */
const char *kv_cuda_uuid_str(const kv_cu_uuid *u, char *buf, size_t len);

/* Releases the primary context. Accepts NULL and a zeroed device (ctx NULL). */
void kv_cuda_device_close(const kv_cuda *cu, kv_cuda_device *d);

#endif
