/* gemm: the example engine's batched matmul, out[r][o] = sum_i w[o][i] * x[r][i], one pass over
 * the weights per call for every row of the batch.
 *
 * Blocked (a block of weight rows stays in cache while every row tile of x goes through it),
 * vectorised (AVX-512F or AVX2+FMA, picked at run time by CPUID; a scalar path for other CPUs, kept
 * as the reference the tests compare against) and threaded (the output columns are split between a
 * caller-owned pool of threads). Each output element is one dot product whose summation order
 * depends only on nin and the instruction set, never on the batch size, the row's place in the
 * batch, the blocking or the thread count: the engine relies on that for its bit-identical
 * cached / batched / speculated runs (see model.h).
 */
#ifndef KVE_GEMM_H
#define KVE_GEMM_H

#include "common/kv_err.h"

typedef struct kve_gemm kve_gemm;

typedef enum kve_gemm_isa {
    KVE_GEMM_AUTO = 0,   /* the best this CPU runs */
    KVE_GEMM_SCALAR = 1, /* plain C, one sequential sum per element */
    KVE_GEMM_AVX2 = 2,   /* AVX2 + FMA: 8 lanes per element, then a fixed reduction */
    KVE_GEMM_AVX512 = 3, /* AVX-512F: 16 lanes per element, then a fixed reduction */
} kve_gemm_isa;

/* The instruction set KVE_GEMM_AUTO resolves to on this CPU: AVX-512 where CPUID reports
 * AVX-512F (with AVX2 and FMA), else AVX2 where it reports AVX2 and FMA; the environment's
 * KVE_GEMM=scalar (how the tests run the scalar path through the whole engine) or KVE_GEMM=avx2
 * caps it. Each set sums in its own fixed order, so runs compare bit for bit only under one set.
 * Any thread. */
kve_gemm_isa kve_gemm_detect(void);

/* 1 when this CPU runs isa (AUTO and SCALAR always), else 0. Any thread. */
int kve_gemm_supported(kve_gemm_isa isa);

/* Name of an instruction set ("scalar", "avx2", "avx512"). */
const char *kve_gemm_isa_name(kve_gemm_isa isa);

/* A pool of `threads` threads in all (the caller's included; 1: no thread is started) running
 * kernels of `isa` (AUTO, or a set this CPU lacks: kve_gemm_detect()).
 * KV_EINVAL for threads < 1 or > 64, KV_ENOMEM, KV_ESYS when a thread cannot start. *out written
 * on success; free with kve_gemm_free. */
kv_err kve_gemm_alloc(int threads, kve_gemm_isa isa, kve_gemm **out);

/* Stops and joins the threads; accepts NULL. */
void kve_gemm_free(kve_gemm *g);

/* What a pool runs: its instruction set after fallback, and its thread count. */
kve_gemm_isa kve_gemm_isa_of(const kve_gemm *g);
int kve_gemm_threads(const kve_gemm *g);

/* out[r][o] = sum_i w[o][i] * x[r][i] for r < n, o < nout; w is [nout][nin], x [n][nin], out
 * [n][nout] (not overlapping x or w). g NULL: the calling thread alone with KVE_GEMM_AUTO. Calls
 * on one pool come from one thread at a time (the pool's owner); different pools are
 * independent. Small products run on the calling thread alone (same numbers either way). */
void kve_gemm_run(kve_gemm *g, float *out, const float *x, const float *w, int n, int nin,
                  int nout);

#endif
