/* host_bench: the two host-memory targets of DESIGN.md, measured through a real kvd.
 *
 *  1. Tier copies >= 90% of memcpy bandwidth (host). kvk_copy_blocks_cpu gathers the leased
 *     blocks of one layer of kvd's host pool, in shuffled order, into the worker's own memory
 *     (same layer-major layout, and converted to block-major), and scatters them back. Baseline:
 *     one memcpy of the same number of bytes between two buffers of the worker's, in the same
 *     run. Both sides are faulted in before timing.
 *  3. CPU decode attention near memory speed (issue 19): kvk_paged_decode_attention_cpu per KV
 *     dtype (fp32, fp16, bf16, int8, fp8) and 1 and 2 threads over 1 GiB of K/V in the worker's
 *     own memory (1 GiB, more than the L3 of the CPUs it runs on, so every row comes from DRAM),
 * against memcpy of the same 1 GiB interleaved in the same run, and against the arithmetic bound of
 * one thread (its FMA instructions per second, measured in the same run, over the FMAs a token
 *     costs); then the other CPU kernels (prefill attention, reshape_and_cache, quantize,
 *     dequantize) against their scalar twins.
 *  2. Zero-copy: attention over daemon blocks as fast as over memory the worker allocated
 *     itself (DESIGN.md; target within 3%). kvk_paged_decode_attention_cpu over the layer's
 *     blocks as mapped from kvd's memfd segments, and over the worker's malloc'd copy of the same
 *     blocks at the same ids, with one shuffled CSR page table. The two outputs must be bitwise
 *     equal (the twin sums in a fixed order); that is asserted, the timings are figures.
 *
 * Every figure is the median of interleaved repetitions. kvd runs with its default host backend
 * (memfd segments, mapped MAP_SHARED by libkvclient). Prints markdown (bench/run.sh records it
 * under "host" in bench/RESULTS.md); exits 1 when a check fails.
 *
 *   host_bench --kvd bazel-bin/daemon/kvd [--reps 9]
 *   host_bench --kernels [--reps 9]    (section 3 only, no daemon: for kernel work)
 */
#include <errno.h>
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench/benchutil.h"
#include "kernels/kvk.h"
#include "kernels/kvk_dtype.h"
#include "kernels/kvk_internal.h"
#include "kvclient.h"

enum {
    LAYERS = 4,     /* of the pool; one layer is copied and attended over */
    KV_HEADS = 8,   /* Llama-3-8B */
    HEAD_DIM = 128, /* Llama-3-8B */
    QO_HEADS = 32,  /* Llama-3-8B */
    PAGE = 16,      /* tokens per block: 32 KiB per (block, layer, K|V) in fp16 */
    NBLOCKS = 4096, /* leased: 128 MiB of K and V per layer, far beyond the caches */
    ALLOC_CHUNK = 4096,
    BATCH = 8,       /* decode requests */
    SEQ_PAGES = 128, /* pages per request: 2048 tokens (64 MiB of the layer's K and V in all);
                        BATCH * SEQ_PAGES <= NBLOCKS. */
    MAX_REPS = 31,
    LAYER = 1, /* the layer measured */
};

static uint64_t rng = 0x9e3779b97f4a7c15ull;

static uint32_t rnd(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)(rng >> 11);
}

static void shuffle(int32_t *v, uint32_t n) {
    for (uint32_t i = n - 1; i > 0; i--) {
        uint32_t j = rnd() % (i + 1);
        int32_t t = v[i];
        v[i] = v[j];
        v[j] = t;
    }
}

static void *xmalloc(size_t n) {
    void *p = malloc(n);
    if (p == NULL) {
        bench_die("out of memory (%zu bytes)", n);
    }
    memset(p, 0, n); /* fault every page in before anything is timed */
    return p;
}

/* One layer (K and V sections) over kvd's per-layer tensors: K and V are separately mapped
 * ranges, so the section stride is their distance. */
static kvk_cache daemon_layer(kvc_pool *pool, const kv_layout *l, uint32_t nblocks) {
    uintptr_t k = (uintptr_t)kvc_pool_layer_base(pool, LAYER, KV_K);
    uintptr_t v = (uintptr_t)kvc_pool_layer_base(pool, LAYER, KV_V);
    if (k == 0 || v == 0) {
        bench_die("kvc_pool_layer_base gave no tensor for layer %d", LAYER);
    }
    kvk_cache c = {.data = k,
                   .block_stride = (int64_t)l->kv_block_bytes,
                   .section_stride = (int64_t)(v - k),
                   .num_blocks = nblocks,
                   .num_sections = 2,
                   .tokens_per_block = PAGE,
                   .num_kv_heads = KV_HEADS,
                   .head_dim = HEAD_DIM,
                   .dtype = KV_DTYPE_FP16};
    return c;
}

/* The worker's own memory for one layer of nblocks blocks: layer-major (all K blocks, then all
 * V blocks, as engines keep their per-layer tensors) or block-major ([block][K|V]). */
static kvk_cache own_layer(void *mem, const kv_layout *l, uint32_t nblocks, int block_major) {
    kvk_cache c = {.data = (uintptr_t)mem,
                   .block_stride = (int64_t)l->kv_block_bytes * (block_major ? 2 : 1),
                   .section_stride = (int64_t)l->kv_block_bytes * (block_major ? 1 : nblocks),
                   .num_blocks = nblocks,
                   .num_sections = 2,
                   .tokens_per_block = PAGE,
                   .num_kv_heads = KV_HEADS,
                   .head_dim = HEAD_DIM,
                   .dtype = KV_DTYPE_FP16};
    return c;
}

static void check(kv_err rc, const char *what) {
    if (rc != KV_OK) {
        bench_die("%s: %s (%s)", what, kv_err_name(rc), kvk_last_error());
    }
}

/* Median and range of v[0..n). */
typedef struct spread {
    double med, lo, hi;
} spread;

static spread spread_of(const double *v, int n) {
    double tmp[MAX_REPS];
    spread s = {0, v[0], v[0]};
    for (int i = 0; i < n; i++) {
        tmp[i] = v[i];
        s.lo = fmin(s.lo, v[i]);
        s.hi = fmax(s.hi, v[i]);
    }
    s.med = bench_median(tmp, (size_t)n);
    return s;
}

enum {
    KB_BYTES = 1 << 30, /* K/V bytes each dtype's decode reads: more than the L3 */
    KB_BATCH = 64,      /* requests; tokens per request follow from the dtype */
};

/* A layer of one dtype in the worker's memory: nblocks blocks, layer-major (K then V), random
 * contents, scales near 1/127 (int8) or 1/400 (fp8). */
static kvk_cache kb_cache(kv_dtype dt, uint32_t nblocks, void **mem) {
    uint64_t chunk = (uint64_t)PAGE * KV_HEADS * HEAD_DIM * kvk_dtype_bytes(dt);
    uint64_t data = (uint64_t)nblocks * chunk * 2;
    uint64_t sc = (uint64_t)nblocks * 2 * KV_HEADS * sizeof(float);
    char *m = aligned_alloc(64, (data + sc + 63) / 64 * 64);
    if (m == NULL) {
        bench_die("out of memory (%llu bytes)", (unsigned long long)(data + sc));
    }
    /* Values in [-1, 1) (8-bit: codes within +-120): random bytes would make subnormal floats,
     * which cost this CPU a microcode assist per operation, and real K/V has none. A 64 KiB
     * pattern is repeated (still far beyond any cache as a whole). */
    enum { PAT = 1 << 16 };
    static char pat[PAT];
    uint32_t eb = kvk_dtype_bytes(dt);
    for (uint32_t i = 0; i < PAT / eb; i++) {
        float x = (float)(rnd() % 2001u) / 1000.0f - 1.0f;
        kvk_store_f32(dt, pat, i, kvk__is_scaled(dt) ? x * 120.0f : x);
    }
    for (uint64_t i = 0; i < data; i += PAT) {
        memcpy(m + i, pat, data - i < PAT ? data - i : PAT);
    }
    float *scales = (float *)(m + data);
    for (uint64_t i = 0; i < (uint64_t)nblocks * 2 * KV_HEADS; i++) {
        scales[i] = dt == KV_DTYPE_INT8 ? 1.0f / 127 : 1.0f / 400;
    }
    *mem = m;
    kvk_cache c = {.data = (uintptr_t)m,
                   .block_stride = (int64_t)chunk,
                   .section_stride = (int64_t)(chunk * nblocks),
                   .scales = kvk__is_scaled(dt) ? (uintptr_t)scales : 0,
                   .scale_block_stride = KV_HEADS * sizeof(float),
                   .scale_section_stride = (int64_t)nblocks * KV_HEADS * sizeof(float),
                   .num_blocks = nblocks,
                   .num_sections = 2,
                   .tokens_per_block = PAGE,
                   .num_kv_heads = KV_HEADS,
                   .head_dim = HEAD_DIM,
                   .dtype = dt};
    return c;
}

/* A page table over every block: KB_BATCH requests of nblocks / KB_BATCH pages, shuffled. */
static kvk_page_table kb_table(uint32_t nblocks, uint32_t batch, int32_t **indptr,
                               int32_t **indices, int32_t **last) {
    uint32_t per = nblocks / KB_BATCH;
    *indptr = malloc((batch + 1) * sizeof(int32_t));
    *indices = malloc((size_t)nblocks * sizeof(int32_t));
    *last = malloc(batch * sizeof(int32_t));
    if (*indptr == NULL || *indices == NULL || *last == NULL) {
        bench_die("out of memory");
    }
    for (uint32_t i = 0; i < nblocks; i++) {
        (*indices)[i] = (int32_t)i;
    }
    shuffle(*indices, nblocks);
    for (uint32_t b = 0; b <= batch; b++) {
        (*indptr)[b] = (int32_t)(b * per);
    }
    for (uint32_t b = 0; b < batch; b++) {
        (*last)[b] = PAGE;
    }
    kvk_page_table pt = {*indptr, *indices, *last, batch};
    return pt;
}

/* FMA instructions per second one thread issues (12 independent chains, so latency never
 * limits it): the 512-bit kind when the kernels run AVX-512, else 256-bit. What the vector
 * decode kernel can do at most: every K and V element is one lane of an FMA per query head of
 * its group, whatever its dtype. */
__attribute__((target("avx512f"))) static double fma_rate_512(long n) {
    __m512 a[12];
    for (int i = 0; i < 12; i++) {
        a[i] = _mm512_set1_ps((float)i * 0.001f);
    }
    __m512 b = _mm512_set1_ps(0.9999f), c = _mm512_set1_ps(0.0001f);
    double t0 = bench_now_s();
    for (long k = 0; k < n; k++) {
        for (int i = 0; i < 12; i++) {
            a[i] = _mm512_fmadd_ps(a[i], b, c);
        }
    }
    double t = bench_now_s() - t0;
    __m512 sum = a[0];
    for (int i = 1; i < 12; i++) {
        sum = _mm512_add_ps(sum, a[i]);
    }
    volatile float sink = _mm512_reduce_add_ps(sum);
    (void)sink;
    return 12.0 * (double)n / t;
}

__attribute__((target("avx2,fma"))) static double fma_rate_256(long n) {
    __m256 a[12];
    for (int i = 0; i < 12; i++) {
        a[i] = _mm256_set1_ps((float)i * 0.001f);
    }
    __m256 b = _mm256_set1_ps(0.9999f), c = _mm256_set1_ps(0.0001f);
    double t0 = bench_now_s();
    for (long k = 0; k < n; k++) {
        for (int i = 0; i < 12; i++) {
            a[i] = _mm256_fmadd_ps(a[i], b, c);
        }
    }
    double t = bench_now_s() - t0;
    float o[8];
    __m256 sum = a[0];
    for (int i = 1; i < 12; i++) {
        sum = _mm256_add_ps(sum, a[i]);
    }
    _mm256_storeu_ps(o, sum);
    volatile float sink = o[0];
    (void)sink;
    return 12.0 * (double)n / t;
}

static double time_decode(const kvk_cache *c, const kvk_page_table *pt, kvk_decode_args *a) {
    double t0 = bench_now_s();
    check(kvk_paged_decode_attention_cpu(c, 0, pt, a), "attention");
    return bench_now_s() - t0;
}

/* Section 3: decode attention per dtype x threads against memcpy of the same bytes, then the
 * other kernels against their scalar twins. */

/* The L3 this CPU shares, in MiB, as the kernel reports it (sysfs; else sysconf, which on some
 * virtual machines gives the whole host socket's; 0 where neither says). */
static long l3_mib(void) {
    FILE *f = fopen("/sys/devices/system/cpu/cpu0/cache/index3/size", "r");
    long kib = 0;
    if (f != NULL) {
        if (fscanf(f, "%ldK", &kib) != 1) {
            kib = 0;
        }
        fclose(f);
    }
    if (kib > 0) {
        return kib >> 10;
    }
    long b = sysconf(_SC_LEVEL3_CACHE_SIZE);
    return b > 0 ? b >> 20 : 0;
}

static void bench_kernels(int reps) {
    static const kv_dtype dts[] = {KV_DTYPE_FP32, KV_DTYPE_FP16, KV_DTYPE_BF16, KV_DTYPE_INT8,
                                   KV_DTYPE_FP8_E4M3};
    enum { NDT = 5 };
    int simd = kvk__simd_force(KVK__SIMD_AVX512);
    const char *simd_name = kvk_simd_name();
    char *mc_src = xmalloc(KB_BYTES), *mc_dst = xmalloc(KB_BYTES);
    memset(mc_src, 3, KB_BYTES);
    size_t qn = (size_t)KB_BATCH * QO_HEADS * HEAD_DIM;
    uint16_t *q = malloc(qn * 2), *out = malloc(qn * 2);
    if (q == NULL || out == NULL) {
        bench_die("out of memory");
    }
    for (size_t e = 0; e < qn; e++) {
        kvk_store_f32(KV_DTYPE_FP16, q, e, (float)(rnd() % 2001u) / 1000.0f - 1.0f);
    }
    printf("\n### CPU decode attention vs memcpy of the same bytes (issue 19)\n\n");
    printf("kvk_paged_decode_attention_cpu (%s kernels), %u requests, %u query heads over %u KV "
           "heads (GQA %u) x %u dim, %u-token pages in shuffled order, fp16 queries: each call "
           "reads %d MiB of K and V (this CPU's L3: %ld MiB) in the worker's own memory; the "
           "baseline memcpy moves the same %d MiB between two buffers, interleaved with the "
           "attention calls (one memcpy, then each thread count, per repetition). Median "
           "[min-max] of %d repetitions; the ratio is taken per repetition.\n\n",
           simd_name, KB_BATCH, QO_HEADS, KV_HEADS, QO_HEADS / KV_HEADS, HEAD_DIM, PAGE,
           KB_BYTES >> 20, l3_mib(), KB_BYTES >> 20, reps);
    printf("| KV dtype | tokens per request | threads | attention GB/s of K/V | memcpy GB/s | x "
           "memcpy | M tokens/s (x fp32) |\n|---|---:|---:|---:|---:|---:|---:|\n");
    double fp32_tok[2] = {0, 0};
    double worst1 = 1e9, worst1_lo = 1e9;
    double att1[NDT], mc1[NDT]; /* 1 thread: attention GB/s, memcpy GB/s (medians) */
    double scalar_gbps[MAX_REPS];
    for (int d = 0; d < NDT; d++) {
        uint64_t chunk = (uint64_t)PAGE * KV_HEADS * HEAD_DIM * kvk_dtype_bytes(dts[d]);
        uint32_t nblocks = (uint32_t)(KB_BYTES / (2 * chunk)) / KB_BATCH * KB_BATCH;
        double bytes = (double)nblocks * 2 * (double)chunk;
        void *mem = NULL;
        kvk_cache c = kb_cache(dts[d], nblocks, &mem);
        int32_t *indptr, *indices, *last;
        kvk_page_table pt = kb_table(nblocks, KB_BATCH, &indptr, &indices, &last);
        kvk_decode_args a = {q, out, NULL, KV_DTYPE_FP16, QO_HEADS, 1.0f / sqrtf(HEAD_DIM)};
        double tm[MAX_REPS], ta[2][MAX_REPS], gb[2][MAX_REPS], mg[MAX_REPS], ratio[2][MAX_REPS];
        check(kvk_set_threads(2), "threads");
        time_decode(&c, &pt, &a); /* warm-up: faults the helper thread in */
        for (int r = 0; r < reps; r++) {
            double t0 = bench_now_s();
            memcpy(mc_dst, mc_src, (size_t)bytes);
            tm[r] = bench_now_s() - t0;
            mg[r] = bytes / tm[r] / 1e9;
            for (int th = 0; th < 2; th++) {
                check(kvk_set_threads((uint32_t)th + 1), "threads");
                ta[th][r] = time_decode(&c, &pt, &a);
                gb[th][r] = bytes / ta[th][r] / 1e9;
                ratio[th][r] = tm[r] / ta[th][r];
            }
            if (dts[d] == KV_DTYPE_FP16) {
                /* The scalar twin on 2 of the 64 requests (it is ~100x slower). */
                kvk_page_table two = pt;
                two.batch = 2;
                kvk__simd_force(KVK__SIMD_SCALAR);
                check(kvk_set_threads(1), "threads");
                double t = time_decode(&c, &two, &a);
                scalar_gbps[r] = bytes * 2 / KB_BATCH / t / 1e9;
                kvk__simd_force(simd);
            }
        }
        uint64_t tokens = (uint64_t)nblocks / KB_BATCH * PAGE;
        spread m = spread_of(mg, reps);
        for (int th = 0; th < 2; th++) {
            spread g = spread_of(gb[th], reps), x = spread_of(ratio[th], reps);
            double mtok = (double)tokens * KB_BATCH / spread_of(ta[th], reps).med / 1e6;
            if (dts[d] == KV_DTYPE_FP32) {
                fp32_tok[th] = mtok;
            }
            if (th == 0) {
                worst1 = fmin(worst1, x.med);
                worst1_lo = fmin(worst1_lo, x.lo);
                att1[d] = g.med;
                mc1[d] = m.med;
            }
            printf("| %s | %llu | %d | %.2f [%.2f-%.2f] | %.2f [%.2f-%.2f] | %.2f [%.2f-%.2f] | "
                   "%.1f (%.2f) |\n",
                   kv_dtype_name(dts[d]), (unsigned long long)tokens, th + 1, g.med, g.lo, g.hi,
                   m.med, m.lo, m.hi, x.med, x.lo, x.hi, mtok, mtok / fp32_tok[th]);
        }
        if (dts[d] == KV_DTYPE_FP16) {
            spread sg = spread_of(scalar_gbps, reps);
            printf("| fp16, scalar twin (KVK_SIMD=scalar; 2 requests) | %llu | 1 | %.3f "
                   "[%.3f-%.3f] | | | |\n",
                   (unsigned long long)tokens, sg.med, sg.lo, sg.hi);
        }
        free(indptr);
        free(indices);
        free(last);
        free(mem);
    }
    printf("\nTarget: >= 0.5x memcpy on one thread for every dtype. Worst dtype: %.2fx median, "
           "%.2fx its worst repetition (%s).\n",
           worst1, worst1_lo, worst1 >= 0.5 ? "met" : "not met");
    /* The arithmetic bound: each K and V element is one FMA lane per query head of its group. */
    int w512 = simd == KVK__SIMD_AVX512;
    double fr[5];
    for (int r = 0; r < 5; r++) {
        fr[r] = w512 ? fma_rate_512(20000000) : fma_rate_256(20000000);
    }
    spread f = spread_of(fr, 5);
    double lanes = w512 ? 16 : 8, per_th = 2.0 * (QO_HEADS / KV_HEADS) * HEAD_DIM / lanes;
    printf("\nThe arithmetic bound of one thread (same run): %u-bit FMA instructions per second "
           "on this core, %.2f G [%.2f-%.2f] (12 independent chains, 5 runs). A token of one "
           "KV head costs %.0f of them (K and V, %u dims, %u query heads per KV head, %.0f lanes), "
           "whatever the dtype, so the kernel can read at most FMA/s / %.0f tokens of a head per "
           "second: bytes per token-head x that.\n\n",
           w512 ? 512u : 256u, f.med / 1e9, f.lo / 1e9, f.hi / 1e9, per_th, HEAD_DIM,
           QO_HEADS / KV_HEADS, lanes, per_th);
    printf(
        "| KV dtype | bytes per token-head | FMA bound GB/s | attention GB/s, 1 thread | x bound "
        "| 0.5x memcpy GB/s | bound / (0.5x memcpy) |\n|---|---:|---:|---:|---:|---:|---:|\n");
    for (int d = 0; d < NDT; d++) {
        double tb = 2.0 * HEAD_DIM * kvk_dtype_bytes(dts[d]);
        double bound = f.med / per_th * tb / 1e9;
        printf("| %s | %.0f | %.2f | %.2f | %.2f | %.2f | %.2f |\n", kv_dtype_name(dts[d]), tb,
               bound, att1[d], att1[d] / bound, 0.5 * mc1[d], bound / (0.5 * mc1[d]));
    }
    free(mc_src);
    free(mc_dst);

    /* ---- the other kernels vs their scalar twins ---- */
    printf("\n### Other CPU kernels vs their scalar twins\n\n");
    printf("Same process, interleaved; median [min-max] ms of %d repetitions (the scalar twin "
           "of prefill: 1 run per repetition of its first request only, scaled).\n\n",
           reps);
    printf("| kernel | scalar twin ms | vector ms, 1 thread | vector ms, 2 threads | speedup 1 "
           "thread | speedup 2 threads |\n|---|---:|---:|---:|---:|---:|\n");
    enum { K_PREFILL, K_RESHAPE16, K_RESHAPE8, K_QUANT, K_DEQUANT, NK };
    static const char *const kname[NK] = {
        "prefill attention, causal, 4 x 16 rows over 1024 tokens, fp16 (GQA 4)",
        "reshape_and_cache, 4096 fp32 tokens -> fp16 cache",
        "reshape_and_cache, 4096 fp32 tokens -> int8 cache",
        "quantize_blocks fp16 -> int8, 1024 blocks of 16 tokens",
        "dequantize_blocks int8 -> fp16, 1024 blocks of 16 tokens",
    };
    /* Shared inputs. */
    enum { NTOK = 4096, PF_REQ = 4, PF_ROWS = 16, PF_LEN = 1024, QB = 1024 };
    void *m16 = NULL, *m8 = NULL;
    kvk_cache c16 = kb_cache(KV_DTYPE_FP16, NTOK / PAGE, &m16);
    kvk_cache c8 = kb_cache(KV_DTYPE_INT8, NTOK / PAGE, &m8);
    size_t row = (size_t)KV_HEADS * HEAD_DIM;
    float *kx = malloc(NTOK * row * 4), *vx = malloc(NTOK * row * 4);
    int64_t *slots = malloc(NTOK * sizeof(int64_t));
    float ks[KV_HEADS], vs[KV_HEADS];
    size_t qelems = (size_t)QB * PAGE * row;
    uint16_t *wide = malloc(qelems * 2), *back = malloc(qelems * 2);
    int8_t *codes = malloc(qelems);
    float *qscales = malloc((size_t)QB * KV_HEADS * 4);
    size_t pq = (size_t)PF_REQ * PF_ROWS * QO_HEADS * HEAD_DIM;
    uint16_t *pfq = malloc(pq * 2), *pfo = malloc(pq * 2);
    if (kx == NULL || vx == NULL || slots == NULL || wide == NULL || back == NULL ||
        codes == NULL || qscales == NULL || pfq == NULL || pfo == NULL) {
        bench_die("out of memory");
    }
    for (size_t i = 0; i < NTOK * row; i++) {
        kx[i] = (float)(rnd() % 2001u) / 1000.0f - 1.0f;
        vx[i] = (float)(rnd() % 2001u) / 1000.0f - 1.0f;
    }
    for (uint32_t i = 0; i < NTOK; i++) {
        slots[i] = (int64_t)((i * 7919u) % NTOK);
    }
    for (int h = 0; h < KV_HEADS; h++) {
        ks[h] = vs[h] = 1.0f / 127;
    }
    for (size_t i = 0; i < qelems; i++) {
        kvk_store_f32(KV_DTYPE_FP16, wide, i, (float)(rnd() % 2001u) / 500.0f - 2.0f);
    }
    for (size_t i = 0; i < pq; i++) {
        kvk_store_f32(KV_DTYPE_FP16, pfq, i, (float)(rnd() % 2001u) / 1000.0f - 1.0f);
    }
    int32_t pf_qo[PF_REQ + 1], pf_ip[PF_REQ + 1], pf_ix[PF_REQ * PF_LEN / PAGE], pf_last[PF_REQ];
    for (int i = 0; i <= PF_REQ; i++) {
        pf_qo[i] = i * PF_ROWS;
        pf_ip[i] = i * (PF_LEN / PAGE);
    }
    for (int i = 0; i < PF_REQ * PF_LEN / PAGE; i++) {
        pf_ix[i] = (int32_t)((i * 37) % (NTOK / PAGE));
    }
    for (int i = 0; i < PF_REQ; i++) {
        pf_last[i] = PAGE;
    }
    kvk_page_table pf_pt = {pf_ip, pf_ix, pf_last, PF_REQ};
    kvk_tokens tk = {kx, vx, (int64_t)(row * 4), KV_DTYPE_FP32, ks, vs};
    double tk_ms[NK][3][MAX_REPS];
    for (int r = 0; r < reps; r++) {
        for (int k = 0; k < NK; k++) {
            for (int mode = 0; mode < 3; mode++) { /* scalar, vector x1, vector x2 */
                kvk__simd_force(mode == 0 ? KVK__SIMD_SCALAR : simd);
                check(kvk_set_threads(mode == 2 ? 2 : 1), "threads");
                double scale = 1.0;
                double t0 = bench_now_s();
                switch (k) {
                    case K_PREFILL: {
                        kvk_page_table one = pf_pt;
                        if (mode == 0) {
                            one.batch = 1; /* the twin on one request, scaled below */
                            scale = PF_REQ;
                        }
                        kvk_prefill_args pa = {
                            pf_qo, pfq, pfo, NULL, KV_DTYPE_FP16, QO_HEADS, 1.0f / sqrtf(HEAD_DIM),
                            1};
                        check(kvk_paged_prefill_attention_cpu(&c16, 0, &one, &pa), "prefill");
                        break;
                    }
                    case K_RESHAPE16:
                        check(kvk_reshape_and_cache_cpu(&c16, 0, &tk, slots, NTOK), "reshape");
                        break;
                    case K_RESHAPE8:
                        check(kvk_reshape_and_cache_cpu(&c8, 0, &tk, slots, NTOK), "reshape");
                        break;
                    case K_QUANT:
                        check(kvk_quantize_blocks_cpu(KV_DTYPE_FP16, wide, KV_DTYPE_INT8, codes,
                                                      qscales, QB, PAGE, KV_HEADS, HEAD_DIM),
                              "quantize");
                        break;
                    default:
                        check(kvk_dequantize_blocks_cpu(KV_DTYPE_INT8, codes, qscales,
                                                        KV_DTYPE_FP16, back, QB, PAGE, KV_HEADS,
                                                        HEAD_DIM),
                              "dequantize");
                        break;
                }
                tk_ms[k][mode][r] = (bench_now_s() - t0) * 1e3 * scale;
            }
        }
    }
    kvk__simd_force(simd);
    check(kvk_set_threads(1), "threads");
    for (int k = 0; k < NK; k++) {
        spread s0 = spread_of(tk_ms[k][0], reps), s1 = spread_of(tk_ms[k][1], reps),
               s2 = spread_of(tk_ms[k][2], reps);
        printf("| %s | %.2f [%.2f-%.2f] | %.3f [%.3f-%.3f] | %.3f [%.3f-%.3f] | %.1f | %.1f |\n",
               kname[k], s0.med, s0.lo, s0.hi, s1.med, s1.lo, s1.hi, s2.med, s2.lo, s2.hi,
               s0.med / s1.med, s0.med / s2.med);
    }
    free(m16);
    free(m8);
    free(kx);
    free(vx);
    free(slots);
    free(wide);
    free(back);
    free(codes);
    free(qscales);
    free(pfq);
    free(pfo);
    free(q);
    free(out);
}

int main(int argc, char **argv) {
    const char *kvd = "bazel-bin/daemon/kvd";
    int reps = 9, kernels_only = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--kvd") == 0 && i + 1 < argc) {
            kvd = argv[++i];
        } else if (strcmp(argv[i], "--reps") == 0 && i + 1 < argc) {
            reps = atoi(argv[++i]);
        } else if (strcmp(argv[i], "--kernels") == 0) {
            kernels_only = 1;
        } else {
            bench_die("usage: host_bench [--kvd PATH] [--reps N (1..%d)] [--kernels: the CPU "
                      "kernel tables only, no daemon]",
                      MAX_REPS);
        }
    }
    if (reps < 1 || reps > MAX_REPS) {
        bench_die("--reps must be 1..%d", MAX_REPS);
    }
    if (kernels_only) {
        bench_kernels(reps);
        return 0;
    }

    /* kvd on its default host backend, with room for the blocks. */
    char dir[] = "/tmp/kvd-host-bench-XXXXXX", sock[128], sockflag[160];
    if (mkdtemp(dir) == NULL) {
        bench_die("mkdtemp: %s", strerror(errno));
    }
    snprintf(sock, sizeof(sock), "%s/kvd.sock", dir);
    snprintf(sockflag, sizeof(sockflag), "--socket=%s", sock);
    /* Host memory pinned: the benchmark reads blocks with the CPU (on a GPU machine `auto` would
     * give device memory). */
    char *kargv[] = {(char *)kvd,        sockflag,         "--log-level=warn",
                     "--pool-memory=2G", "--backend=host", NULL};
    pid_t pid = bench_spawn(kargv);
    bench_wait_socket(sock, pid);

    kvc_options o;
    kvc_options_init(&o);
    o.socket_path = sock;
    o.client_name = "host_bench";
    kv_layout want = {.num_layers = LAYERS,
                      .num_kv_heads = KV_HEADS,
                      .head_dim = HEAD_DIM,
                      .tokens_per_block = PAGE,
                      .dtype = KV_DTYPE_FP16,
                      .arrangement = KV_LAYER_MAJOR};
    kvc_conn *conn = NULL;
    kvc_pool *pool = NULL;
    if (kvc_conn_open(&o, &conn) != KV_OK || kvc_pool_attach(conn, "host-bench", &want, &pool)) {
        bench_die("cannot attach a pool: %s", conn ? kvc_last_error(conn) : "no connection");
    }
    const kv_layout *l = kvc_pool_layout(pool);
    kvc_block *blocks = calloc(NBLOCKS, sizeof(*blocks));
    if (blocks == NULL) {
        bench_die("out of memory");
    }
    for (uint32_t i = 0; i < NBLOCKS; i += ALLOC_CHUNK) {
        if (kvc_allocate(pool, ALLOC_CHUNK, blocks + i) != KV_OK) {
            bench_die("kvc_allocate: %s", kvc_last_error(conn));
        }
    }
    uint32_t max_id = 0;
    for (uint32_t i = 0; i < NBLOCKS; i++) {
        max_id = blocks[i].id > max_id ? blocks[i].id : max_id;
    }
    uint32_t ids_n = max_id + 1; /* block id range both caches cover */
    kvk_cache dc = daemon_layer(pool, l, ids_n);

    /* Random K and V in the daemon's blocks (values in [-1, 1]). */
    uint64_t elems = l->kv_block_bytes / 2;
    for (uint32_t i = 0; i < NBLOCKS; i++) {
        for (int s = 0; s < 2; s++) {
            uint16_t *p =
                (uint16_t *)(dc.data + blocks[i].id * dc.block_stride + s * dc.section_stride);
            for (uint64_t e = 0; e < elems; e++) {
                kvk_store_f32(KV_DTYPE_FP16, p, e, (float)(rnd() % 2001u) / 1000.0f - 1.0f);
            }
        }
    }

    /* ---- 1. tier copies vs memcpy --------------------------------------------------------- */
    uint64_t bytes = (uint64_t)NBLOCKS * 2 * l->kv_block_bytes; /* one layer's K and V */
    void *own_lm = xmalloc((size_t)ids_n * 2 * l->kv_block_bytes);
    void *own_bm = xmalloc((size_t)ids_n * 2 * l->kv_block_bytes);
    void *mc_src = xmalloc(bytes), *mc_dst = xmalloc(bytes);
    memset(mc_src, 1, bytes);
    kvk_cache lm = own_layer(own_lm, l, ids_n, 0), bm = own_layer(own_bm, l, ids_n, 1);
    int32_t *src_ids = malloc(NBLOCKS * sizeof(int32_t));
    int32_t *dst_ids = malloc(NBLOCKS * sizeof(int32_t));
    if (src_ids == NULL || dst_ids == NULL) {
        bench_die("out of memory");
    }
    for (uint32_t i = 0; i < NBLOCKS; i++) {
        src_ids[i] = (int32_t)blocks[i].id;
    }
    shuffle(src_ids, NBLOCKS);
    memcpy(dst_ids, src_ids, NBLOCKS * sizeof(int32_t)); /* same id on both sides */

    enum { C_MEMCPY, C_GATHER, C_GATHER_BM, C_SCATTER, NCOPY };
    static const char *const copy_name[NCOPY] = {
        "memcpy of the same bytes (baseline)",
        "copy_blocks: kvd pool -> worker, layer-major (gather)",
        "copy_blocks: kvd pool -> worker, converted to block-major",
        "copy_blocks: worker -> kvd pool, layer-major (scatter)",
    };
    double t[NCOPY][MAX_REPS];
    for (int r = 0; r < reps; r++) {
        for (int c = 0; c < NCOPY; c++) {
            double t0 = bench_now_s();
            switch (c) {
                case C_MEMCPY:
                    memcpy(mc_dst, mc_src, bytes);
                    break;
                case C_GATHER:
                    check(kvk_copy_blocks_cpu(&dc, &lm, src_ids, dst_ids, NBLOCKS), "gather");
                    break;
                case C_GATHER_BM:
                    check(kvk_copy_blocks_cpu(&dc, &bm, src_ids, dst_ids, NBLOCKS), "convert");
                    break;
                default:
                    check(kvk_copy_blocks_cpu(&lm, &dc, dst_ids, src_ids, NBLOCKS), "scatter");
                    break;
            }
            t[c][r] = bench_now_s() - t0;
        }
    }
    /* The copies must be exact: the block-major copy equals the daemon's blocks byte for byte. */
    long bad = 0;
    for (uint32_t i = 0; i < NBLOCKS; i++) {
        for (int s = 0; s < 2; s++) {
            const void *a =
                (const void *)(dc.data + blocks[i].id * dc.block_stride + s * dc.section_stride);
            const void *b =
                (const void *)(bm.data + blocks[i].id * bm.block_stride + s * bm.section_stride);
            bad += memcmp(a, b, l->kv_block_bytes) != 0;
        }
    }
    if (bad != 0) {
        bench_die("%ld (block, K|V) copies differ from the daemon's bytes", bad);
    }
    double med[NCOPY];
    for (int c = 0; c < NCOPY; c++) {
        med[c] = bench_median(t[c], (size_t)reps);
    }
    printf("Host backend (memfd segments mapped by libkvclient), fp16, %u KV heads x %u dim, "
           "%u-token blocks: %u blocks of one layer (%.0f MiB of K and V, %llu KiB per block "
           "and K|V), in shuffled order. Median of %d interleaved runs.\n\n",
           KV_HEADS, HEAD_DIM, PAGE, NBLOCKS, (double)bytes / (1 << 20),
           (unsigned long long)(l->kv_block_bytes >> 10), reps);
    printf("### Tier copies (kvk_copy_blocks_cpu) vs memcpy\n\n");
    printf("| copy | ms | GB/s | x memcpy |\n|---|---:|---:|---:|\n");
    for (int c = 0; c < NCOPY; c++) {
        printf("| %s | %.2f | %.2f | %.2f |\n", copy_name[c], med[c] * 1e3,
               (double)bytes / med[c] / 1e9, med[C_MEMCPY] / med[c]);
    }
    double worst = med[C_MEMCPY] / med[C_GATHER];
    for (int c = C_GATHER_BM; c < NCOPY; c++) {
        worst = fmin(worst, med[C_MEMCPY] / med[c]);
    }
    printf("\nTarget: >= 0.90x memcpy. Worst copy: %.2fx (%s).\n\n", worst,
           worst >= 0.90 ? "met" : "not met");

    /* ---- 2. zero-copy attention ----------------------------------------------------------- */
    const uint32_t npages = BATCH * SEQ_PAGES;
    int32_t *indptr = malloc((BATCH + 1) * sizeof(int32_t)), last[BATCH];
    int32_t *indices = malloc(npages * sizeof(int32_t));
    uint16_t *q = malloc((size_t)BATCH * QO_HEADS * HEAD_DIM * 2);
    uint16_t *out[2] = {malloc((size_t)BATCH * QO_HEADS * HEAD_DIM * 2),
                        malloc((size_t)BATCH * QO_HEADS * HEAD_DIM * 2)};
    float *lse[2] = {malloc(BATCH * QO_HEADS * sizeof(float)),
                     malloc(BATCH * QO_HEADS * sizeof(float))};
    if (indptr == NULL || indices == NULL || q == NULL || out[0] == NULL || out[1] == NULL ||
        lse[0] == NULL || lse[1] == NULL) {
        bench_die("out of memory");
    }
    for (uint32_t i = 0; i < npages; i++) {
        indices[i] = src_ids[i]; /* already shuffled */
    }
    for (uint32_t b = 0; b <= BATCH; b++) {
        indptr[b] = (int32_t)(b * SEQ_PAGES);
    }
    for (uint32_t b = 0; b < BATCH; b++) {
        last[b] = PAGE;
    }
    for (uint64_t e = 0; e < (uint64_t)BATCH * QO_HEADS * HEAD_DIM; e++) {
        kvk_store_f32(KV_DTYPE_FP16, q, e, (float)(rnd() % 2001u) / 1000.0f - 1.0f);
    }
    /* The worker's copy of the layer (layer-major, same ids) is fresh from the gather. */
    check(kvk_copy_blocks_cpu(&dc, &lm, src_ids, dst_ids, NBLOCKS), "copy for attention");
    kvk_page_table pt = {indptr, indices, last, BATCH};
    const kvk_cache *mem[2] = {&dc, &lm};
    double ta[2][MAX_REPS];
    for (int r = 0; r < reps; r++) {
        for (int m = 0; m < 2; m++) {
            int which = (r % 2) ? 1 - m : m; /* alternate which goes first */
            kvk_decode_args a = {
                q, out[which], lse[which], KV_DTYPE_FP16, QO_HEADS, 1.0f / sqrtf((float)HEAD_DIM)};
            double t0 = bench_now_s();
            check(kvk_paged_decode_attention_cpu(mem[which], 0, &pt, &a), "attention");
            ta[which][r] = bench_now_s() - t0;
        }
    }
    if (memcmp(out[0], out[1], (size_t)BATCH * QO_HEADS * HEAD_DIM * 2) != 0 ||
        memcmp(lse[0], lse[1], BATCH * QO_HEADS * sizeof(float)) != 0) {
        bench_die("attention over daemon memory and over the worker's copy differ");
    }
    double am[2] = {bench_median(ta[0], (size_t)reps), bench_median(ta[1], (size_t)reps)};
    double kv_bytes = (double)npages * 2 * (double)l->kv_block_bytes;
    printf(
        "### Zero-copy: decode attention (kvk_paged_decode_attention_cpu) over kvd's blocks\n\n");
    printf("%u requests x %u tokens, %u query heads (GQA %u), one shuffled CSR page table; "
           "outputs and log-sum-exps bitwise equal (checked).\n\n",
           BATCH, SEQ_PAGES * PAGE, QO_HEADS, QO_HEADS / KV_HEADS);
    printf("| K/V memory | ms | GB/s of K/V read | x worker's own |\n|---|---:|---:|---:|\n");
    printf("| worker's own malloc (baseline) | %.2f | %.2f | 1.00 |\n", am[1] * 1e3,
           kv_bytes / am[1] / 1e9);
    printf("| kvd pool, mapped from its memfd | %.2f | %.2f | %.3f |\n", am[0] * 1e3,
           kv_bytes / am[0] / 1e9, am[1] / am[0]);
    double gap = fabs(am[0] / am[1] - 1.0);
    printf("\nTarget: daemon memory as fast as the worker's own (within 3%%): %.1f%% apart (%s).\n",
           gap * 100, gap <= 0.03 ? "met" : "not met");

    bench_kernels(reps);

    for (uint32_t i = 0; i < NBLOCKS; i += ALLOC_CHUNK) {
        kvc_release(pool, blocks + i, ALLOC_CHUNK);
    }
    kvc_pool_detach(pool);
    kvc_conn_close(conn);
    int st = bench_stop(pid);
    unlink(sock);
    rmdir(dir);
    free(blocks);
    free(own_lm);
    free(own_bm);
    free(mc_src);
    free(mc_dst);
    free(src_ids);
    free(dst_ids);
    free(indptr);
    free(indices);
    free(q);
    for (int m = 0; m < 2; m++) {
        free(out[m]);
        free(lse[m]);
    }
    if (st != 0) {
        bench_die("kvd exited with status %d", st);
    }
    return 0;
}
