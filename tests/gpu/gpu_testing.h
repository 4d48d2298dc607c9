/* gpu_testing: what the GPU tests (tests/gpu) share: pointing the driver loader at the test
 * driver among the runfiles, and probing for a usable GPU without initialising CUDA in the
 * calling process (CUDA state does not survive fork, and these tests fork their workers).
 * Test code only; not thread-safe.
 */
#ifndef KVD_GPU_TESTING_H
#define KVD_GPU_TESTING_H

#include <stddef.h>

/* Sets KV_CUDA_LIBRARY (inherited by kvd and the workers) to the test driver
 * daemon/testing/libfakecuda.so in the runfiles ($TEST_SRCDIR/$TEST_WORKSPACE, else the current
 * directory). */
void kvd_gpu_test_use_fake_driver(void);

/* Loads the driver in a child that exits at once: 0 when a GPU (or the test driver) is usable;
 * -1 otherwise, with the loader's reason (or what failed here) in why (len bytes). */
int kvd_gpu_test_probe(char *why, size_t len);

#endif
