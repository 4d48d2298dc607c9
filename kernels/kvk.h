/* kvk: the KV kernels' plain C ABI. No CUDA types appear here, so C code links these whether or
 * not the build had nvcc; each GPU kernel has a CPU reference twin with the same arguments.
 */
#ifndef KVK_H
#define KVK_H

#include <stddef.h>

/* Reports how many CUDA devices this process can use (0 when none, when the driver is missing,
 * or when the build had no nvcc) and writes a one-line reason into why (always NUL-terminated).
 * Never fails and never aborts; safe to call on a machine without a GPU. Any thread. */
int kvk_gpu_probe(char *why, size_t why_len);

/* 1 when this binary contains compiled CUDA kernels, else 0. */
int kvk_built_with_cuda(void);

#endif
