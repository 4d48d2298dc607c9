#!/usr/bin/env bash
# demo_test: examples/demo.sh as ./dev demo runs it, on a machine where a GPU driver is present
# (the test driver daemon/testing/fake_cuda.c stands in for libcuda, as strict as a real one: device
# memory faults on host loads). The host demo must pin --backend=host (with `auto` kvd would take
# cuda-vmm and the workers, which touch blocks with the CPU, would crash), and the --gpu demo must
# work through CUDA copies alone.
set -euo pipefail
cd "${TEST_SRCDIR:-.}/${TEST_WORKSPACE:-kvd}"
export KVD_BIN_DIR=.
export KV_CUDA_LIBRARY="$PWD/daemon/testing/libfakecuda.so"
export TMPDIR=/tmp
bash examples/demo.sh
bash examples/demo.sh --gpu
