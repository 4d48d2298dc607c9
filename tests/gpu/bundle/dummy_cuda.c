/* A stand-in libcuda.so.1 for a machine without a GPU: every entry point kvd resolves exists,
 * and cuInit answers CUDA_ERROR_NO_DEVICE (100), as the real driver does where no device is
 * visible. tests/gpu/bundle/bundle_test.sh puts it in a chroot beside the bundle to show that
 * run.sh gets as far as "no GPU visible" with nothing but the bundle and the C/C++ runtime.
 * Generated from common/kv_cuda.c's symbol table (keep the list in step with it). */
#include <stddef.h>

#define NO_DEVICE 100

int cuGetErrorName(int r, const char **s) {
    *s = r == NO_DEVICE ? "CUDA_ERROR_NO_DEVICE" : "CUDA_ERROR_UNKNOWN";
    return 0;
}

int cuGetErrorString(int r, const char **s) {
    *s = r == NO_DEVICE ? "no CUDA-capable device is detected" : "unknown error";
    return 0;
}

int cuDriverGetVersion(int *v) {
    *v = 13000;
    return 0;
}

int cuInit(void) {
    return NO_DEVICE;
}

int cuDeviceGetCount(void) {
    return NO_DEVICE;
}

int cuDeviceGet(void) {
    return NO_DEVICE;
}

int cuDeviceGetAttribute(void) {
    return NO_DEVICE;
}

int cuDeviceGetName(void) {
    return NO_DEVICE;
}

int cuDeviceGetUuid_v2(void) {
    return NO_DEVICE;
}

int cuDevicePrimaryCtxRetain(void) {
    return NO_DEVICE;
}

int cuDevicePrimaryCtxRelease_v2(void) {
    return NO_DEVICE;
}

int cuCtxSetCurrent(void) {
    return NO_DEVICE;
}

int cuCtxGetCurrent(void) {
    return NO_DEVICE;
}

int cuCtxGetDevice(void) {
    return NO_DEVICE;
}

int cuCtxSynchronize(void) {
    return NO_DEVICE;
}

int cuMemAlloc_v2(void) {
    return NO_DEVICE;
}

int cuMemFree_v2(void) {
    return NO_DEVICE;
}

int cuMemsetD8_v2(void) {
    return NO_DEVICE;
}

int cuMemcpyHtoD_v2(void) {
    return NO_DEVICE;
}

int cuMemcpyDtoH_v2(void) {
    return NO_DEVICE;
}

int cuMemcpyDtoD_v2(void) {
    return NO_DEVICE;
}

int cuMemCreate(void) {
    return NO_DEVICE;
}

int cuMemRelease(void) {
    return NO_DEVICE;
}

int cuMemExportToShareableHandle(void) {
    return NO_DEVICE;
}

int cuMemImportFromShareableHandle(void) {
    return NO_DEVICE;
}

int cuMemAddressReserve(void) {
    return NO_DEVICE;
}

int cuMemAddressFree(void) {
    return NO_DEVICE;
}

int cuMemMap(void) {
    return NO_DEVICE;
}

int cuMemUnmap(void) {
    return NO_DEVICE;
}

int cuMemSetAccess(void) {
    return NO_DEVICE;
}

int cuMemGetAllocationGranularity(void) {
    return NO_DEVICE;
}

int cuIpcGetMemHandle(void) {
    return NO_DEVICE;
}

int cuIpcOpenMemHandle_v2(void) {
    return NO_DEVICE;
}

int cuIpcCloseMemHandle(void) {
    return NO_DEVICE;
}

int cuMemAllocHost_v2(void) {
    return NO_DEVICE;
}

int cuMemFreeHost(void) {
    return NO_DEVICE;
}

int cuMemHostAlloc(void) {
    return NO_DEVICE;
}

int cuStreamCreate(void) {
    return NO_DEVICE;
}

int cuStreamDestroy_v2(void) {
    return NO_DEVICE;
}

int cuStreamSynchronize(void) {
    return NO_DEVICE;
}

int cuMemcpyDtoHAsync_v2(void) {
    return NO_DEVICE;
}

int cuMemcpyHtoDAsync_v2(void) {
    return NO_DEVICE;
}
