/* The engine's batched matmul (examples/engine/gemm.h): both instruction sets against a double
 * precision reference on ragged shapes (nin not a multiple of 8, row and column tails), and the
 * properties the engine's bit-identical runs rest on, checked with 0 tolerance: a row's result
 * does not depend on the batch it is in or its place there, nor on the thread count, and the
 * g == NULL path equals a one-thread pool. The AVX2 and AVX-512 cases are skipped on a CPU
 * without them; both are compared with the scalar path, and AUTO picks the widest. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "examples/engine/gemm.h"

static uint64_t rng = 88172645463325252ull;

static float frand(void) {
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (float)((double)(rng >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

static float *randv(size_t n) {
    float *p = malloc(n * sizeof(float) + 1);
    assert_non_null(p);
    for (size_t i = 0; i < n; i++) {
        p[i] = frand();
    }
    return p;
}

static const kve_gemm_isa ISAS[] = {KVE_GEMM_SCALAR, KVE_GEMM_AVX2, KVE_GEMM_AVX512};
enum { NISA = sizeof(ISAS) / sizeof(ISAS[0]) };

static int have(kve_gemm_isa isa) {
    return kve_gemm_supported(isa);
}

/* Every element within a few ulps of the dot product's magnitude. */
static void check_ref(const float *out, const float *x, const float *w, int n, int nin, int nout) {
    for (int r = 0; r < n; r++) {
        for (int o = 0; o < nout; o++) {
            double s = 0, mag = 0;
            for (int i = 0; i < nin; i++) {
                s += (double)w[(size_t)o * nin + i] * x[(size_t)r * nin + i];
                mag += fabs((double)w[(size_t)o * nin + i] * x[(size_t)r * nin + i]);
            }
            double got = out[(size_t)r * nout + o];
            if (fabs(got - s) > 1.2e-7 * (nin + 8) * mag + 1e-30) { /* float sum bound */
                fail_msg("n=%d nin=%d nout=%d: [%d][%d] = %.9g, want %.9g", n, nin, nout, r, o, got,
                         s);
            }
        }
    }
}

static void test_against_reference(void **state) {
    (void)state;
    static const int ns[] = {1, 2, 3, 4, 5, 7, 8, 13};
    static const int nins[] = {1, 7, 8, 9, 16, 33, 100};
    static const int nouts[] = {1, 2, 3, 4, 5, 7, 31};
    for (size_t k = 0; k < NISA; k++) {
        if (!have(ISAS[k])) {
            continue;
        }
        kve_gemm *g = NULL;
        assert_int_equal(kve_gemm_alloc(1, ISAS[k], &g), KV_OK);
        assert_int_equal(kve_gemm_isa_of(g), ISAS[k]);
        for (size_t a = 0; a < sizeof(ns) / sizeof(ns[0]); a++) {
            for (size_t b = 0; b < sizeof(nins) / sizeof(nins[0]); b++) {
                for (size_t c = 0; c < sizeof(nouts) / sizeof(nouts[0]); c++) {
                    int n = ns[a], nin = nins[b], nout = nouts[c];
                    float *x = randv((size_t)n * nin), *w = randv((size_t)nout * nin);
                    float *out = randv((size_t)n * nout);
                    kve_gemm_run(g, out, x, w, n, nin, nout);
                    check_ref(out, x, w, n, nin, nout);
                    free(x), free(w), free(out);
                }
            }
        }
        kve_gemm_free(g);
    }
}

/* A large enough product that pools split it between their threads, with ragged edges. */
enum { N = 37, NIN = 203, NOUT = 1001 };

static void test_batch_and_thread_invariance(void **state) {
    (void)state;
    float *x = randv((size_t)N * NIN), *w = randv((size_t)NOUT * NIN);
    float *ref = malloc((size_t)N * NOUT * sizeof(float));
    float *out = malloc((size_t)N * NOUT * sizeof(float));
    assert_non_null(ref);
    assert_non_null(out);
    for (size_t k = 0; k < NISA; k++) {
        if (!have(ISAS[k])) {
            continue;
        }
        kve_gemm *g1 = NULL;
        assert_int_equal(kve_gemm_alloc(1, ISAS[k], &g1), KV_OK);
        kve_gemm_run(g1, ref, x, w, N, NIN, NOUT);
        check_ref(ref, x, w, N, NIN, NOUT);
        /* Each row alone, and every sub-batch [r0, r0 + len): the same bits. */
        for (int r0 = 0; r0 < N; r0 += 5) {
            for (int len = 1; r0 + len <= N && len <= 9; len += 2) {
                kve_gemm_run(g1, out, x + (size_t)r0 * NIN, w, len, NIN, NOUT);
                assert_memory_equal(out, ref + (size_t)r0 * NOUT, (size_t)len * NOUT * 4);
            }
        }
        /* 2, 3 and 8 threads (more than cores: still the same numbers); calls repeated. */
        static const int th[] = {2, 3, 8};
        for (size_t t = 0; t < 3; t++) {
            kve_gemm *g = NULL;
            assert_int_equal(kve_gemm_alloc(th[t], ISAS[k], &g), KV_OK);
            assert_int_equal(kve_gemm_threads(g), th[t]);
            for (int rep = 0; rep < 20; rep++) {
                memset(out, 0xff, (size_t)N * NOUT * sizeof(float));
                int n = rep % 2 ? N : 1 + rep % 7;
                kve_gemm_run(g, out, x, w, n, NIN, NOUT);
                assert_memory_equal(out, ref, (size_t)n * NOUT * sizeof(float));
            }
            kve_gemm_free(g);
        }
        kve_gemm_free(g1);
    }
    /* g == NULL runs the best instruction set on the calling thread. */
    kve_gemm *ga = NULL;
    assert_int_equal(kve_gemm_alloc(1, KVE_GEMM_AUTO, &ga), KV_OK);
    kve_gemm_run(ga, ref, x, w, N, NIN, NOUT);
    kve_gemm_run(NULL, out, x, w, N, NIN, NOUT);
    assert_memory_equal(out, ref, (size_t)N * NOUT * sizeof(float));
    kve_gemm_free(ga);
    free(x), free(w), free(ref), free(out);
}

static void test_scalar_vs_vector(void **state) {
    (void)state;
    for (size_t k = 1; k < NISA; k++) {
        if (!have(ISAS[k])) {
            continue;
        }
        float *x = randv((size_t)N * NIN), *w = randv((size_t)NOUT * NIN);
        float *a = malloc((size_t)N * NOUT * sizeof(float));
        float *b = malloc((size_t)N * NOUT * sizeof(float));
        assert_non_null(a);
        assert_non_null(b);
        kve_gemm *gs = NULL, *gv = NULL;
        assert_int_equal(kve_gemm_alloc(2, KVE_GEMM_SCALAR, &gs), KV_OK);
        assert_int_equal(kve_gemm_alloc(2, ISAS[k], &gv), KV_OK);
        assert_int_equal(kve_gemm_isa_of(gv), ISAS[k]);
        kve_gemm_run(gs, a, x, w, N, NIN, NOUT);
        kve_gemm_run(gv, b, x, w, N, NIN, NOUT);
        for (size_t i = 0; i < (size_t)N * NOUT; i++) {
            assert_true(fabsf(a[i] - b[i]) <= 1e-5f * (1.0f + fabsf(a[i])));
        }
        kve_gemm_free(gs);
        kve_gemm_free(gv);
        free(x), free(w), free(a), free(b);
    }
    /* AUTO is the widest set this CPU has (unless KVE_GEMM caps it). */
    if (getenv("KVE_GEMM") != NULL) {
        return;
    }
    kve_gemm_isa best = have(KVE_GEMM_AVX512) ? KVE_GEMM_AVX512
                        : have(KVE_GEMM_AVX2) ? KVE_GEMM_AVX2
                                              : KVE_GEMM_SCALAR;
    assert_int_equal(kve_gemm_detect(), best);
}

static void test_bad_arguments(void **state) {
    (void)state;
    kve_gemm *g = (kve_gemm *)0x1;
    assert_int_equal(kve_gemm_alloc(0, KVE_GEMM_AUTO, &g), KV_EINVAL);
    assert_int_equal(kve_gemm_alloc(65, KVE_GEMM_AUTO, &g), KV_EINVAL);
    assert_ptr_equal(g, (kve_gemm *)0x1); /* untouched on failure */
    kve_gemm_free(NULL);
    /* Empty products write nothing; nin == 0 writes zeros. */
    float out[4] = {1, 2, 3, 4};
    kve_gemm_run(NULL, out, NULL, NULL, 0, 3, 4);
    assert_true(out[0] == 1.0f);
    kve_gemm_run(NULL, out, NULL, NULL, 1, 0, 4);
    assert_true(out[0] == 0.0f && out[3] == 0.0f);
    assert_string_equal(kve_gemm_isa_name(KVE_GEMM_SCALAR), "scalar");
    assert_string_equal(kve_gemm_isa_name(KVE_GEMM_AVX2), "avx2");
    assert_string_equal(kve_gemm_isa_name(KVE_GEMM_AVX512), "avx512");
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_against_reference),
        cmocka_unit_test(test_batch_and_thread_invariance),
        cmocka_unit_test(test_scalar_vs_vector),
        cmocka_unit_test(test_bad_arguments),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
