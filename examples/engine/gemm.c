/* gemm: blocked, vectorised, threaded matmul of the example engine (see gemm.h).
 *
 * Loop nest per thread: its share of output columns is cut into blocks of weight rows that fit
 * in L2; every 4-row tile of x goes through a block before the next block is read, so the
 * weights stream from memory once per call however many rows the batch holds (a decode step
 * reads them once for the whole batch, as a GPU does). The micro-kernel keeps a 4 x 3 tile of
 * dot products in registers over the whole of nin (a row tail of 2 or 3 gets its own 2 x 3 or 3 x 3
 * tile, so it too reads each weight once). Every element has its own accumulator and the
 * same reduction in every tile shape, so the tiling, the thread split and the batch never change
 * a result bit. The AVX2 and AVX-512 kernels are compiled with target attributes, so the file
 * needs no -m flags and the binary runs on any x86-64 (or other) CPU.
 */
#include "examples/engine/gemm.h"

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#define GEMM_HAVE_AVX2 1
#include <immintrin.h>
#else
#define GEMM_HAVE_AVX2 0
#endif

enum {
    TILE_R = 4,                 /* x rows per micro-tile */
    TILE_C = 3,                 /* weight rows (output columns) per micro-tile */
    BLOCK_BYTES = 256 * 1024,   /* weights of one column block: stays in L2 */
    SPLIT_MIN_MACS = 32 * 1024, /* below this per thread, one thread does all */
    MAX_THREADS = 64,           /* kve_gemm_alloc's limit */
};

typedef void (*tile_fn)(float *out, const float *x, const float *w, int nin, int nout, int R,
                        int C);

/* ---- Scalar kernel: one sequential sum per element (the reference). ---- */

static void tile_scalar(float *out, const float *x, const float *w, int nin, int nout, int R,
                        int C) {
    for (int r = 0; r < R; r++) {
        const float *xr = x + (size_t)r * nin;
        for (int c = 0; c < C; c++) {
            const float *wc = w + (size_t)c * nin;
            float acc = 0.0f;
            for (int i = 0; i < nin; i++) {
                acc += wc[i] * xr[i];
            }
            out[(size_t)r * nout + c] = acc;
        }
    }
}

/* ---- AVX2 + FMA kernel: 8 lanes per element, a fixed reduction, then the tail in order. ---- */

#if GEMM_HAVE_AVX2
#define AVX2_FN __attribute__((target("avx2,fma")))

static inline __attribute__((always_inline)) AVX2_FN float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

/* Every element's sum, whatever the tile: lanes accumulate i = 8j + lane by FMA in order of j,
 * hsum8 reduces them, then the tail i >= 8 * (nin / 8) is added in order by scalar FMA. The
 * tiles below spell that out with named registers (GCC keeps arrays of vectors in memory). */
static inline __attribute__((always_inline)) AVX2_FN float finish(__m256 acc, const float *w,
                                                                  const float *x, int i, int nin) {
    float s = hsum8(acc);
    for (int j = i; j < nin; j++) {
        s = __builtin_fmaf(w[j], x[j], s);
    }
    return s;
}

/* R rows x 3 columns, R = 2, 3 or 4 (a constant at every call, so the rows past R compile
 * away): 3R accumulators, 3 weight registers, x read as a memory operand. Row tails of 2 or 3
 * thus read each weight once, as a full tile does. */
static inline __attribute__((always_inline)) AVX2_FN void
tile_avx2_rx3(float *out, const float *x, const float *w, int nin, int nout, const int R) {
    const float *w0 = w, *w1 = w + nin, *w2 = w + 2 * (size_t)nin;
    const float *x0 = x, *x1 = x + nin;
    const float *x2 = R > 2 ? x + 2 * (size_t)nin : x, *x3 = R > 3 ? x + 3 * (size_t)nin : x;
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a10 = a00, a11 = a00, a12 = a00;
    __m256 a20 = a00, a21 = a00, a22 = a00, a30 = a00, a31 = a00, a32 = a00;
    int i = 0;
    for (; i + 8 <= nin; i += 8) {
        __m256 v0 = _mm256_loadu_ps(w0 + i), v1 = _mm256_loadu_ps(w1 + i);
        __m256 v2 = _mm256_loadu_ps(w2 + i), xv;
        xv = _mm256_loadu_ps(x0 + i);
        a00 = _mm256_fmadd_ps(v0, xv, a00), a01 = _mm256_fmadd_ps(v1, xv, a01);
        a02 = _mm256_fmadd_ps(v2, xv, a02);
        xv = _mm256_loadu_ps(x1 + i);
        a10 = _mm256_fmadd_ps(v0, xv, a10), a11 = _mm256_fmadd_ps(v1, xv, a11);
        a12 = _mm256_fmadd_ps(v2, xv, a12);
        if (R > 2) {
            xv = _mm256_loadu_ps(x2 + i);
            a20 = _mm256_fmadd_ps(v0, xv, a20), a21 = _mm256_fmadd_ps(v1, xv, a21);
            a22 = _mm256_fmadd_ps(v2, xv, a22);
        }
        if (R > 3) {
            xv = _mm256_loadu_ps(x3 + i);
            a30 = _mm256_fmadd_ps(v0, xv, a30), a31 = _mm256_fmadd_ps(v1, xv, a31);
            a32 = _mm256_fmadd_ps(v2, xv, a32);
        }
    }
    float *o0 = out, *o1 = out + nout;
    o0[0] = finish(a00, w0, x0, i, nin), o0[1] = finish(a01, w1, x0, i, nin);
    o0[2] = finish(a02, w2, x0, i, nin);
    o1[0] = finish(a10, w0, x1, i, nin), o1[1] = finish(a11, w1, x1, i, nin);
    o1[2] = finish(a12, w2, x1, i, nin);
    if (R > 2) {
        float *o2 = out + 2 * (size_t)nout;
        o2[0] = finish(a20, w0, x2, i, nin), o2[1] = finish(a21, w1, x2, i, nin);
        o2[2] = finish(a22, w2, x2, i, nin);
    }
    if (R > 3) {
        float *o3 = out + 3 * (size_t)nout;
        o3[0] = finish(a30, w0, x3, i, nin), o3[1] = finish(a31, w1, x3, i, nin);
        o3[2] = finish(a32, w2, x3, i, nin);
    }
}

static AVX2_FN void tile_avx2_4x3(float *out, const float *x, const float *w, int nin, int nout) {
    tile_avx2_rx3(out, x, w, nin, nout, 4);
}

static AVX2_FN void tile_avx2_3x3(float *out, const float *x, const float *w, int nin, int nout) {
    tile_avx2_rx3(out, x, w, nin, nout, 3);
}

static AVX2_FN void tile_avx2_2x3(float *out, const float *x, const float *w, int nin, int nout) {
    tile_avx2_rx3(out, x, w, nin, nout, 2);
}

/* 1 row x 3 columns (one-row decode steps). */
static AVX2_FN void tile_avx2_1x3(float *out, const float *x, const float *w, int nin) {
    const float *w0 = w, *w1 = w + nin, *w2 = w + 2 * (size_t)nin;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0;
    int i = 0;
    for (; i + 8 <= nin; i += 8) {
        __m256 xv = _mm256_loadu_ps(x + i);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + i), xv, a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w1 + i), xv, a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w2 + i), xv, a2);
    }
    out[0] = finish(a0, w0, x, i, nin);
    out[1] = finish(a1, w1, x, i, nin);
    out[2] = finish(a2, w2, x, i, nin);
}

/* 1 x 1 (column tails). */
static AVX2_FN void tile_avx2_1x1(float *out, const float *x, const float *w, int nin) {
    __m256 a = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= nin; i += 8) {
        a = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(x + i), a);
    }
    out[0] = finish(a, w, x, i, nin);
}

static void tile_avx2(float *out, const float *x, const float *w, int nin, int nout, int R, int C) {
    if (C == TILE_C && R > 1) { /* a row tail of 2 or 3 reads the weights once, as a full tile */
        if (R == TILE_R) {
            tile_avx2_4x3(out, x, w, nin, nout);
        } else if (R == 3) {
            tile_avx2_3x3(out, x, w, nin, nout);
        } else {
            tile_avx2_2x3(out, x, w, nin, nout);
        }
        return;
    }
    for (int r = 0; r < R; r++) {
        const float *xr = x + (size_t)r * nin;
        float *o = out + (size_t)r * nout;
        if (C == TILE_C) {
            tile_avx2_1x3(o, xr, w, nin);
            continue;
        }
        for (int c = 0; c < C; c++) {
            tile_avx2_1x1(o + c, xr, w + (size_t)c * nin, nin);
        }
    }
}

/* ---- AVX-512F kernel: 16 lanes per element (i = 16j + lane, FMA in order of j), the lanes
 * folded 16 -> 8 (lane l + lane l + 8) and then reduced as hsum8 does, then the tail in order.
 * The same tiles as AVX2's; 32 registers would hold more, but 4 x 3 already loads 7 vectors
 * for 12 FMAs, under the two loads a cycle of the cores it was measured on. ---- */

#define AVX512_FN __attribute__((target("avx512f,avx2,fma")))

static inline __attribute__((always_inline)) AVX512_FN float
finish16(__m512 acc, const float *w, const float *x, int i, int nin) {
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(acc),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1)));
    __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    s4 = _mm_add_ss(s4, _mm_shuffle_ps(s4, s4, 1));
    float s = _mm_cvtss_f32(s4);
    for (int j = i; j < nin; j++) {
        s = __builtin_fmaf(w[j], x[j], s);
    }
    return s;
}

static inline __attribute__((always_inline)) AVX512_FN void
tile_avx512_rx3(float *out, const float *x, const float *w, int nin, int nout, const int R) {
    const float *w0 = w, *w1 = w + nin, *w2 = w + 2 * (size_t)nin;
    const float *x0 = x, *x1 = x + nin;
    const float *x2 = R > 2 ? x + 2 * (size_t)nin : x, *x3 = R > 3 ? x + 3 * (size_t)nin : x;
    __m512 a00 = _mm512_setzero_ps(), a01 = a00, a02 = a00, a10 = a00, a11 = a00, a12 = a00;
    __m512 a20 = a00, a21 = a00, a22 = a00, a30 = a00, a31 = a00, a32 = a00;
    int i = 0;
    for (; i + 16 <= nin; i += 16) {
        __m512 v0 = _mm512_loadu_ps(w0 + i), v1 = _mm512_loadu_ps(w1 + i);
        __m512 v2 = _mm512_loadu_ps(w2 + i), xv;
        xv = _mm512_loadu_ps(x0 + i);
        a00 = _mm512_fmadd_ps(v0, xv, a00), a01 = _mm512_fmadd_ps(v1, xv, a01);
        a02 = _mm512_fmadd_ps(v2, xv, a02);
        xv = _mm512_loadu_ps(x1 + i);
        a10 = _mm512_fmadd_ps(v0, xv, a10), a11 = _mm512_fmadd_ps(v1, xv, a11);
        a12 = _mm512_fmadd_ps(v2, xv, a12);
        if (R > 2) {
            xv = _mm512_loadu_ps(x2 + i);
            a20 = _mm512_fmadd_ps(v0, xv, a20), a21 = _mm512_fmadd_ps(v1, xv, a21);
            a22 = _mm512_fmadd_ps(v2, xv, a22);
        }
        if (R > 3) {
            xv = _mm512_loadu_ps(x3 + i);
            a30 = _mm512_fmadd_ps(v0, xv, a30), a31 = _mm512_fmadd_ps(v1, xv, a31);
            a32 = _mm512_fmadd_ps(v2, xv, a32);
        }
    }
    float *o0 = out, *o1 = out + nout;
    o0[0] = finish16(a00, w0, x0, i, nin), o0[1] = finish16(a01, w1, x0, i, nin);
    o0[2] = finish16(a02, w2, x0, i, nin);
    o1[0] = finish16(a10, w0, x1, i, nin), o1[1] = finish16(a11, w1, x1, i, nin);
    o1[2] = finish16(a12, w2, x1, i, nin);
    if (R > 2) {
        float *o2 = out + 2 * (size_t)nout;
        o2[0] = finish16(a20, w0, x2, i, nin), o2[1] = finish16(a21, w1, x2, i, nin);
        o2[2] = finish16(a22, w2, x2, i, nin);
    }
    if (R > 3) {
        float *o3 = out + 3 * (size_t)nout;
        o3[0] = finish16(a30, w0, x3, i, nin), o3[1] = finish16(a31, w1, x3, i, nin);
        o3[2] = finish16(a32, w2, x3, i, nin);
    }
}

static AVX512_FN void tile_avx512_4x3(float *out, const float *x, const float *w, int nin,
                                      int nout) {
    tile_avx512_rx3(out, x, w, nin, nout, 4);
}

static AVX512_FN void tile_avx512_3x3(float *out, const float *x, const float *w, int nin,
                                      int nout) {
    tile_avx512_rx3(out, x, w, nin, nout, 3);
}

static AVX512_FN void tile_avx512_2x3(float *out, const float *x, const float *w, int nin,
                                      int nout) {
    tile_avx512_rx3(out, x, w, nin, nout, 2);
}

static AVX512_FN void tile_avx512_1x3(float *out, const float *x, const float *w, int nin) {
    const float *w0 = w, *w1 = w + nin, *w2 = w + 2 * (size_t)nin;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0;
    int i = 0;
    for (; i + 16 <= nin; i += 16) {
        __m512 xv = _mm512_loadu_ps(x + i);
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(w0 + i), xv, a0);
        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(w1 + i), xv, a1);
        a2 = _mm512_fmadd_ps(_mm512_loadu_ps(w2 + i), xv, a2);
    }
    out[0] = finish16(a0, w0, x, i, nin);
    out[1] = finish16(a1, w1, x, i, nin);
    out[2] = finish16(a2, w2, x, i, nin);
}

static AVX512_FN void tile_avx512_1x1(float *out, const float *x, const float *w, int nin) {
    __m512 a = _mm512_setzero_ps();
    int i = 0;
    for (; i + 16 <= nin; i += 16) {
        a = _mm512_fmadd_ps(_mm512_loadu_ps(w + i), _mm512_loadu_ps(x + i), a);
    }
    out[0] = finish16(a, w, x, i, nin);
}

static void tile_avx512(float *out, const float *x, const float *w, int nin, int nout, int R,
                        int C) {
    if (C == TILE_C && R > 1) {
        if (R == TILE_R) {
            tile_avx512_4x3(out, x, w, nin, nout);
        } else if (R == 3) {
            tile_avx512_3x3(out, x, w, nin, nout);
        } else {
            tile_avx512_2x3(out, x, w, nin, nout);
        }
        return;
    }
    for (int r = 0; r < R; r++) {
        const float *xr = x + (size_t)r * nin;
        float *o = out + (size_t)r * nout;
        if (C == TILE_C) {
            tile_avx512_1x3(o, xr, w, nin);
            continue;
        }
        for (int c = 0; c < C; c++) {
            tile_avx512_1x1(o + c, xr, w + (size_t)c * nin, nin);
        }
    }
}
#endif

int kve_gemm_supported(kve_gemm_isa isa) {
    switch (isa) {
        case KVE_GEMM_AUTO:
        case KVE_GEMM_SCALAR:
            return 1;
#if GEMM_HAVE_AVX2
        case KVE_GEMM_AVX2:
            __builtin_cpu_init();
            return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
        case KVE_GEMM_AVX512:
            __builtin_cpu_init();
            return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx2") &&
                   __builtin_cpu_supports("fma");
#endif
        default:
            return 0;
    }
}

kve_gemm_isa kve_gemm_detect(void) {
#if GEMM_HAVE_AVX2
    const char *env = getenv("KVE_GEMM");
    if (env != NULL && strcmp(env, "scalar") == 0) {
        return KVE_GEMM_SCALAR;
    }
    int cap_avx2 = env != NULL && strcmp(env, "avx2") == 0;
    if (!cap_avx2 && kve_gemm_supported(KVE_GEMM_AVX512)) {
        return KVE_GEMM_AVX512;
    }
    if (kve_gemm_supported(KVE_GEMM_AVX2)) {
        return KVE_GEMM_AVX2;
    }
#endif
    return KVE_GEMM_SCALAR;
}

const char *kve_gemm_isa_name(kve_gemm_isa isa) {
    switch (isa) {
        case KVE_GEMM_SCALAR:
            return "scalar";
        case KVE_GEMM_AVX2:
            return "avx2";
        case KVE_GEMM_AVX512:
            return "avx512";
        default:
            return "auto";
    }
}

static tile_fn tile_for(kve_gemm_isa isa) {
#if GEMM_HAVE_AVX2
    if (isa == KVE_GEMM_AVX2) {
        return tile_avx2;
    }
    if (isa == KVE_GEMM_AVX512) {
        return tile_avx512;
    }
#endif
    (void)isa;
    return tile_scalar;
}

/* Columns [c0, c1) of the product, blocked: a block of weight rows, then every row tile. */
static void gemm_cols(tile_fn tile, float *out, const float *x, const float *w, int n, int nin,
                      int nout, int c0, int c1) {
    int bc = (int)(BLOCK_BYTES / ((size_t)nin * sizeof(float)));
    bc = bc < TILE_C ? TILE_C : bc - bc % TILE_C;
    for (int b0 = c0; b0 < c1; b0 += bc) {
        int b1 = b0 + bc < c1 ? b0 + bc : c1;
        for (int r = 0; r < n; r += TILE_R) {
            int R = n - r < TILE_R ? n - r : TILE_R;
            for (int c = b0; c < b1; c += TILE_C) {
                int C = b1 - c < TILE_C ? b1 - c : TILE_C;
                tile(out + (size_t)r * nout + c, x + (size_t)r * nin, w + (size_t)c * nin, nin,
                     nout, R, C);
            }
        }
    }
}

/* ---- Thread pool: part t of a call is a contiguous range of column tiles. ---- */

typedef struct gemm_job {
    float *out;       /* product */
    const float *x;   /* rows */
    const float *w;   /* weights */
    int n, nin, nout; /* shape */
    int parts;        /* threads taking part (<= threads) */
} gemm_job;

struct kve_gemm {
    int threads;         /* threads in all, the caller's included */
    kve_gemm_isa isa;    /* resolved instruction set */
    tile_fn tile;        /* its micro-kernel */
    pthread_t *tid;      /* threads[1..): workers */
    int started;         /* workers started */
    pthread_mutex_t mu;  /* guards everything below */
    pthread_cond_t go;   /* gen changed or stop */
    pthread_cond_t done; /* pending reached 0 */
    uint64_t gen;        /* call counter */
    int pending;         /* workers still computing the current call */
    int stop;            /* 1: workers exit */
    gemm_job job;        /* the current call */
};

typedef struct worker_arg {
    kve_gemm *g; /* pool */
    int t;       /* part index (1-based among workers) */
} worker_arg;

static void run_part(kve_gemm *g, const gemm_job *j, int t) {
    int tiles = (j->nout + TILE_C - 1) / TILE_C;
    int t0 = (int)((int64_t)tiles * t / j->parts), t1 = (int)((int64_t)tiles * (t + 1) / j->parts);
    int c0 = t0 * TILE_C, c1 = t1 * TILE_C < j->nout ? t1 * TILE_C : j->nout;
    if (c0 < c1) {
        gemm_cols(g->tile, j->out, j->x, j->w, j->n, j->nin, j->nout, c0, c1);
    }
}

static void *worker(void *arg) {
    worker_arg *wa = arg;
    kve_gemm *g = wa->g;
    int t = wa->t;
    free(wa);
    uint64_t seen = 0;
    pthread_mutex_lock(&g->mu);
    for (;;) {
        while (!g->stop && g->gen == seen) {
            pthread_cond_wait(&g->go, &g->mu);
        }
        if (g->stop) {
            break;
        }
        seen = g->gen;
        gemm_job j = g->job;
        if (t >= j.parts) {
            continue; /* not part of this call (not counted in pending) */
        }
        pthread_mutex_unlock(&g->mu);
        run_part(g, &j, t);
        pthread_mutex_lock(&g->mu);
        if (--g->pending == 0) {
            pthread_cond_signal(&g->done);
        }
    }
    pthread_mutex_unlock(&g->mu);
    return NULL;
}

kv_err kve_gemm_alloc(int threads, kve_gemm_isa isa, kve_gemm **out) {
    if (threads < 1 || threads > MAX_THREADS) {
        return KV_EINVAL;
    }
    kve_gemm *g = calloc(1, sizeof(*g));
    if (g == NULL) {
        return KV_ENOMEM;
    }
    /* AUTO, or a set this CPU lacks: the best it has (scalar at least). */
    g->isa = isa == KVE_GEMM_AUTO || !kve_gemm_supported(isa) ? kve_gemm_detect() : isa;
    g->tile = tile_for(g->isa);
    g->threads = threads;
    pthread_mutex_init(&g->mu, NULL);
    pthread_cond_init(&g->go, NULL);
    pthread_cond_init(&g->done, NULL);
    g->tid = calloc((size_t)threads, sizeof(pthread_t));
    if (g->tid == NULL) {
        kve_gemm_free(g);
        return KV_ENOMEM;
    }
    for (int t = 1; t < threads; t++) {
        worker_arg *wa = malloc(sizeof(*wa));
        if (wa == NULL) {
            kve_gemm_free(g);
            return KV_ENOMEM;
        }
        *wa = (worker_arg){g, t};
        if (pthread_create(&g->tid[t], NULL, worker, wa) != 0) {
            free(wa);
            kve_gemm_free(g);
            return KV_ESYS;
        }
        g->started = t;
    }
    *out = g;
    return KV_OK;
}

void kve_gemm_free(kve_gemm *g) {
    if (g == NULL) {
        return;
    }
    if (g->tid != NULL) {
        pthread_mutex_lock(&g->mu);
        g->stop = 1;
        pthread_cond_broadcast(&g->go);
        pthread_mutex_unlock(&g->mu);
        for (int t = 1; t <= g->started; t++) {
            pthread_join(g->tid[t], NULL);
        }
        pthread_mutex_destroy(&g->mu);
        pthread_cond_destroy(&g->go);
        pthread_cond_destroy(&g->done);
    }
    free(g->tid);
    free(g);
}

kve_gemm_isa kve_gemm_isa_of(const kve_gemm *g) {
    return g->isa;
}

int kve_gemm_threads(const kve_gemm *g) {
    return g->threads;
}

static pthread_once_t auto_once = PTHREAD_ONCE_INIT;
static tile_fn auto_tile; /* the kernel of g == NULL calls, set once */

static void auto_init(void) {
    auto_tile = tile_for(kve_gemm_detect());
}

void kve_gemm_run(kve_gemm *g, float *out, const float *x, const float *w, int n, int nin,
                  int nout) {
    if (n <= 0 || nout <= 0) {
        return;
    }
    if (nin <= 0) {
        for (int r = 0; r < n; r++) {
            memset(out + (size_t)r * nout, 0, (size_t)nout * sizeof(float));
        }
        return;
    }
    if (g == NULL) {
        pthread_once(&auto_once, auto_init);
        gemm_cols(auto_tile, out, x, w, n, nin, nout, 0, nout);
        return;
    }
    int64_t macs = (int64_t)n * nin * nout;
    int tiles = (nout + TILE_C - 1) / TILE_C;
    int parts = (int)(macs / SPLIT_MIN_MACS);
    parts = parts > g->threads ? g->threads : parts;
    parts = parts > tiles ? tiles : parts;
    gemm_job j = {out, x, w, n, nin, nout, parts < 1 ? 1 : parts};
    if (j.parts == 1) {
        run_part(g, &j, 0);
        return;
    }
    pthread_mutex_lock(&g->mu);
    g->job = j;
    g->pending = j.parts - 1;
    g->gen++;
    pthread_cond_broadcast(&g->go);
    pthread_mutex_unlock(&g->mu);
    run_part(g, &j, 0);
    pthread_mutex_lock(&g->mu);
    while (g->pending > 0) {
        pthread_cond_wait(&g->done, &g->mu);
    }
    pthread_mutex_unlock(&g->mu);
}
