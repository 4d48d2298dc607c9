/* fuzz: what every kvd fuzz harness shares. Each harness is one file with a libFuzzer entry
 * point (LLVMFuzzerTestOneInput) that must never crash, leak or hit undefined behaviour on any
 * input, and checks properties of the code under test with FUZZ_CHECK. The same file is built
 * twice: by tests/fuzz/build.sh with clang -fsanitize=fuzzer,address,undefined (the fuzzer),
 * and by Bazel with replay_test.c's main (the regression test that feeds every committed corpus
 * and crash input). Single-threaded.
 */
#ifndef KV_FUZZ_H
#define KV_FUZZ_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

/* Runs the harness on one input; returns 0 (libFuzzer's contract). Any thread, one at a time. */
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* A broken property of the code under test: print where and abort, so libFuzzer saves the input
 * and the replay test fails. */
#define FUZZ_CHECK(cond)                                                                           \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "%s:%d: fuzz property failed: %s\n", __FILE__, __LINE__, #cond);       \
            abort();                                                                               \
        }                                                                                          \
    } while (0)

#endif
