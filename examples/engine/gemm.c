/* gemm: blocked, vectorised, threaded matmul of the example engine (see gemm.h).
 *
 * Loop nest per thread: its share of output columns is cut into blocks of weight rows that fit
 * in L2; every 4-row tile of x goes through a block before the next block is read, so the
 * weights stream from memory once per call however many rows the batch holds (a decode step
 * reads them once for the whole batch, as a GPU does). The micro-kernel keeps a 4 x 3 tile of
 * dot products in registers over the whole of nin (AVX-512: 4 x 6, its 32 registers hold it; a
 * row tail of 2 or 3 gets its own 2- or 3-row tile, so it too reads each weight once). Every
 * element has its own accumulator and the same reduction in every tile shape, so the tiling, the
 * thread split and the batch never change a result bit. The AVX2 and AVX-512 kernels are compiled
 * with target attributes, so the file needs no -m flags and the binary runs on any x86-64 (or
 * other) CPU.
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

/* ---- Vector kernels: examples/engine/gemm_tiles.h, written once and compiled per set. ----
 * AVX2 + FMA: 8 lanes per element (i = 8j + lane, FMA in order of j), hsum8, then the tail in
 * order. AVX-512F: 16 lanes, folded 16 -> 8 (lane l + lane l + 8), then as hsum8 does, then
 * the tail. Each set's reduction is the same in every one of its tiles. */

#if GEMM_HAVE_AVX2
static inline __attribute__((always_inline, target("avx2,fma"))) float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

#define GT_FN __attribute__((target("avx2,fma")))
#define GT_NAME(x) x##_avx2
#define GT_W 8
#define GT_VEC __m256
#define GT_ZERO() _mm256_setzero_ps()
#define GT_LOAD(p) _mm256_loadu_ps(p)
#define GT_FMA(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#define GT_HSUM(v) hsum8(v)
#include "examples/engine/gemm_tiles.h"

#define GT_FN __attribute__((target("avx512f,avx2,fma")))
#define GT_NAME(x) x##_avx512
#define GT_W 16
#define GT_VEC __m512
#define GT_ZERO() _mm512_setzero_ps()
#define GT_LOAD(p) _mm512_loadu_ps(p)
#define GT_FMA(a, b, c) _mm512_fmadd_ps((a), (b), (c))
#define GT_HSUM(v)                                                                                 \
    hsum8(_mm256_add_ps(_mm512_castps512_ps256(v),                                                 \
                        _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))))
#include "examples/engine/gemm_tiles.h"
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

/* Columns per tile call of a set: AVX-512's kernel takes 6 (a 4 x 6 tile: 10 loads for 24
 * FMAs in its 32 registers), the others 3. A multiple of TILE_C, the unit threads split by. */
static int span_for(kve_gemm_isa isa) {
    return isa == KVE_GEMM_AVX512 ? 2 * TILE_C : TILE_C;
}

/* Columns [c0, c1) of the product, blocked: a block of weight rows, then every row tile; tile
 * calls of `span` columns (fewer at a block's end). */
static void gemm_cols(tile_fn tile, int span, float *out, const float *x, const float *w, int n,
                      int nin, int nout, int c0, int c1) {
    int bc = (int)(BLOCK_BYTES / ((size_t)nin * sizeof(float)));
    bc = bc < span ? span : bc - bc % span;
    for (int b0 = c0; b0 < c1; b0 += bc) {
        int b1 = b0 + bc < c1 ? b0 + bc : c1;
        for (int r = 0; r < n; r += TILE_R) {
            int R = n - r < TILE_R ? n - r : TILE_R;
            for (int c = b0; c < b1; c += span) {
                int C = b1 - c < span ? b1 - c : span;
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
    int span;            /* columns per tile call (span_for) */
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
        gemm_cols(g->tile, g->span, j->out, j->x, j->w, j->n, j->nin, j->nout, c0, c1);
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
    g->span = span_for(g->isa);
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
static int auto_span;

static void auto_init(void) {
    kve_gemm_isa isa = kve_gemm_detect();
    auto_tile = tile_for(isa);
    auto_span = span_for(isa);
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
        gemm_cols(auto_tile, auto_span, out, x, w, n, nin, nout, 0, nout);
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
