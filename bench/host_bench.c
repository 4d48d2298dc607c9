/* host_bench: the two host-memory targets of DESIGN.md, measured through a real kvd.
 *
 *  1. Tier copies >= 90% of memcpy bandwidth (host). kvk_copy_blocks_cpu gathers the leased
 *     blocks of one layer of kvd's host pool, in shuffled order, into the worker's own memory
 *     (same layer-major layout, and converted to block-major), and scatters them back. Baseline:
 *     one memcpy of the same number of bytes between two buffers of the worker's, in the same
 *     run. Both sides are faulted in before timing.
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
 */
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench/benchutil.h"
#include "kernels/kvk.h"
#include "kernels/kvk_dtype.h"
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
                        BATCH * SEQ_PAGES <= NBLOCKS. The CPU twin is compute-bound (~0.2 GFLOP/s
                        of fp16 attention here), so this is sized for seconds, not bandwidth. */
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

int main(int argc, char **argv) {
    const char *kvd = "bazel-bin/daemon/kvd";
    int reps = 9;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--kvd") == 0 && i + 1 < argc) {
            kvd = argv[++i];
        } else if (strcmp(argv[i], "--reps") == 0 && i + 1 < argc) {
            reps = atoi(argv[++i]);
        } else {
            bench_die("usage: host_bench [--kvd PATH] [--reps N (1..%d)]", MAX_REPS);
        }
    }
    if (reps < 1 || reps > MAX_REPS) {
        bench_die("--reps must be 1..%d", MAX_REPS);
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
