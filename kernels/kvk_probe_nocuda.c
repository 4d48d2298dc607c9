/* kvk_probe without CUDA: the build machine had no nvcc (or --config=nocuda). */
#include <stdio.h>

#include "kernels/kvk.h"

int kvk_built_with_cuda(void) {
    return 0;
}

int kvk_gpu_probe(char *why, size_t why_len) {
    snprintf(why, why_len, "no usable GPU: this binary was built without CUDA");
    return 0;
}
