// kvk_probe: asks the CUDA runtime (linked statically; it loads libcuda.so.1 itself at run time)
// how many devices are usable. On a machine without a GPU or driver it reports why and returns 0.
#include <cuda_runtime.h>
#include <stdio.h>

extern "C" {
#include "kernels/kvk.h"
}

__global__ void kvk_probe_kernel(int *out) {
    *out = 42;
}

extern "C" int kvk_built_with_cuda(void) {
    return 1;
}

extern "C" int kvk_gpu_probe(char *why, size_t why_len) {
    int n = 0;
    cudaError_t rc = cudaGetDeviceCount(&n);
    if (rc != cudaSuccess) {
        snprintf(why, why_len, "no usable GPU: %s", cudaGetErrorString(rc));
        return 0;
    }
    if (n == 0) {
        snprintf(why, why_len, "no usable GPU: the driver reports no devices");
        return 0;
    }
    // Run a trivial kernel so "usable" means a launch really works.
    int *d = nullptr;
    int h = 0;
    if (cudaMalloc(&d, sizeof(int)) != cudaSuccess) {
        snprintf(why, why_len, "no usable GPU: cudaMalloc failed");
        return 0;
    }
    kvk_probe_kernel<<<1, 1>>>(d);
    rc = cudaMemcpy(&h, d, sizeof(int), cudaMemcpyDeviceToHost);
    cudaFree(d);
    if (rc != cudaSuccess || h != 42) {
        snprintf(why, why_len, "no usable GPU: test kernel failed (%s)", cudaGetErrorString(rc));
        return 0;
    }
    snprintf(why, why_len, "%d CUDA device(s) usable", n);
    return n;
}
