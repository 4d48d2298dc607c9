/* core_bench: figures for the core library, printed as markdown (bench/run.sh core records them
 * in bench/RESULTS.md).
 *
 * Each figure stands beside a baseline measured in the same run on the same machine (memcpy of
 * the same bytes, malloc+free, a cache-resident index, Belady's optimum), because the machines
 * are shared and absolute numbers move from run to run; the ratios move much less.
 * Usage: core_bench [--quick]   (--quick: smaller sizes, for a smoke run)
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/kv_hash.h"
#include "daemon/testing/evict_trace.h"
#include "daemon/core/index.h"
#include "daemon/core/pool.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static uint64_t mix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

static volatile uint64_t sink_u64; /* keeps results alive */

static void die(const char *what, kv_err err) {
    fprintf(stderr, "core_bench: %s: %s\n", what, kv_strerror(err));
    exit(1);
}

/* ---- hashing ---------------------------------------------------------------------------- */

static double hash_ns_per_token(kv_hash_algo algo, const uint32_t *tokens, size_t ntok,
                                kv_hash128 *out, double min_s) {
    kv_hash128 seed = {1, 2};
    size_t nout = 0;
    size_t reps = 0;
    double t0 = now_s(), t;
    do {
        kv_err err = kv_hash_chain(algo, seed, NULL, 0, tokens, ntok, 16, out, ntok / 16, &nout);
        if (err != KV_OK) {
            die("kv_hash_chain", err);
        }
        sink_u64 += out[nout - 1].lo;
        reps++;
        t = now_s() - t0;
    } while (t < min_s);
    return t * 1e9 / ((double)reps * (double)ntok);
}

static double memcpy_ns_per_token(uint32_t *dst, const uint32_t *src, size_t ntok, double min_s) {
    size_t reps = 0;
    double t0 = now_s(), t;
    do {
        memcpy(dst, src, ntok * sizeof(uint32_t));
        __asm__ volatile("" : : "r"(dst) : "memory");
        reps++;
        t = now_s() - t0;
    } while (t < min_s);
    return t * 1e9 / ((double)reps * (double)ntok);
}

static void bench_hash(int quick) {
    size_t ntok = (size_t)1 << 16; /* 256 KiB of tokens: one prompt batch, cache-resident */
    uint32_t *tok = malloc(ntok * sizeof(uint32_t));
    uint32_t *dst = malloc(ntok * sizeof(uint32_t));
    kv_hash128 *out = malloc(ntok / 16 * sizeof(kv_hash128));
    if (!tok || !dst || !out) {
        die("malloc", KV_ENOMEM);
    }
    for (size_t i = 0; i < ntok; i++) {
        tok[i] = (uint32_t)mix64(i) % 128000;
    }
    double min_s = quick ? 0.05 : 0.4;
    double mc = memcpy_ns_per_token(dst, tok, ntok, min_s);
    double xx = hash_ns_per_token(KV_HASH_XXH3_128, tok, ntok, out, min_s);
    double sha = hash_ns_per_token(KV_HASH_SHA256_128, tok, ntok, out, min_s);
    printf("### Block hashing (16-token blocks, %zu tokens per chain)\n\n", ntok);
    printf("| method | ns/token | x memcpy of the same bytes | target |\n");
    printf("|---|---:|---:|---|\n");
    printf("| memcpy (baseline) | %.3f | 1.0 | |\n", mc);
    printf("| XXH3-128 chain | %.3f | %.1f | <= 1 ns/token |\n", xx, xx / mc);
    printf("| SHA-256 chain | %.3f | %.1f | <= 30 ns/token |\n\n", sha, sha / mc);
    free(tok);
    free(dst);
    free(out);
}

/* ---- index probes ----------------------------------------------------------------------- */

#define CHAIN 128

static void bench_index(int quick) {
    size_t sizes[4] = {10000, 100000, 1000000, 10000000};
    int nsizes = quick ? 3 : 4;
    double base_rate = 0;
    printf("### Prefix index: batched probes of %d-block prefixes (all hits)\n\n", CHAIN);
    printf("| blocks indexed | index MiB | B/entry | insert M/s | probe M/s | ns/probe | "
           "x cost of 1e4 |\n");
    printf("|---:|---:|---:|---:|---:|---:|---:|\n");
    for (int s = 0; s < nsizes; s++) {
        size_t n = sizes[s] / CHAIN * CHAIN;
        kvd_index *idx;
        kv_err err = kvd_index_alloc(n, &idx);
        if (err != KV_OK) {
            die("kvd_index_alloc", err);
        }
        kv_hash128 *hs = malloc(n * sizeof(kv_hash128));
        uint64_t *vals = malloc(CHAIN * sizeof(uint64_t));
        if (!hs || !vals) {
            die("malloc", KV_ENOMEM);
        }
        for (size_t i = 0; i < n; i++) {
            hs[i].lo = mix64(i * 2);
            hs[i].hi = mix64(i * 2 + 1);
        }
        double t0 = now_s();
        for (size_t i = 0; i < n; i++) {
            err = kvd_index_insert(idx, 1, hs[i], i, NULL);
            if (err != KV_OK) {
                die("kvd_index_insert", err);
            }
        }
        double ins = now_s() - t0;
        size_t nchains = n / CHAIN;
        size_t probes = 0;
        uint64_t r = 12345;
        double min_s = quick ? 0.1 : 0.5;
        t0 = now_s();
        double t;
        do {
            for (int k = 0; k < 256; k++) {
                r = mix64(r);
                size_t c = r % nchains;
                size_t got = kvd_index_probe_prefix(idx, 1, hs + c * CHAIN, CHAIN, vals);
                if (got != CHAIN) {
                    die("probe missed", KV_EINTERNAL);
                }
                sink_u64 += vals[CHAIN - 1];
                probes += CHAIN;
            }
            t = now_s() - t0;
        } while (t < min_s);
        double rate = (double)probes / t;
        if (s == 0) {
            base_rate = rate;
        }
        printf("| %zu | %.0f | %.1f | %.1f | %.1f | %.1f | %.2f |\n", n,
               (double)kvd_index_bytes(idx) / (1 << 20), (double)kvd_index_bytes(idx) / (double)n,
               (double)n / ins / 1e6, rate / 1e6, 1e9 / rate, base_rate / rate);
        fflush(stdout);
        free(hs);
        free(vals);
        kvd_index_free(idx);
    }
    printf("\nTarget: >= 20 M probes/s/core with 1e7 blocks indexed.\n\n");
}

/* ---- allocate + free -------------------------------------------------------------------- */

static kvd_pool *bench_pool(kvd_index *idx, uint32_t bps, uint32_t segs, kvd_evict_policy pol) {
    kvd_pool_config cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.pool_id = 1;
    kv_err err = kv_layout_init(1, 1, 8, 16, KV_DTYPE_FP16, KV_BLOCK_MAJOR, &cfg.layout);
    if (err != KV_OK) {
        die("kv_layout_init", err);
    }
    cfg.blocks_per_segment = bps;
    cfg.max_segments = segs;
    cfg.policy = pol;
    kvd_pool *p;
    err = kvd_pool_alloc(&cfg, idx, &kvd_backend_malloc, NULL, &p);
    if (err != KV_OK) {
        die("kvd_pool_alloc", err);
    }
    return p;
}

static void bench_alloc(int quick) {
    kvd_index *idx;
    kv_err err = kvd_index_alloc(1 << 16, &idx);
    if (err != KV_OK) {
        die("kvd_index_alloc", err);
    }
    kvd_pool *p = bench_pool(idx, 4096, 16, KVD_EVICT_LRU);
    size_t iters = quick ? 2000000 : 20000000;
    /* Warm: touch every segment once. */
    kvd_block_ref warm[4096];
    for (int s = 0; s < 16; s++) {
        if ((err = kvd_pool_allocate(p, 4096, 1, 0, warm)) != KV_OK) {
            die("allocate", err);
        }
    }
    printf("### Allocator\n\n");
    printf("| operation | M pairs/s | ns/pair | x malloc(64)+free |\n");
    printf("|---|---:|---:|---:|\n");
    /* Baseline: glibc malloc+free of a block-record-sized object. */
    double t0 = now_s();
    for (size_t i = 0; i < iters; i++) {
        void *x = malloc(64);
        __asm__ volatile("" : : "r"(x) : "memory");
        free(x);
    }
    double tm = now_s() - t0;
    /* Release the warm-up blocks (WRITING -> FREE). */
    kvd_pool_free(p);
    p = bench_pool(idx, 4096, 16, KVD_EVICT_LRU);
    kvd_block_ref r;
    t0 = now_s();
    for (size_t i = 0; i < iters; i++) {
        kvd_pool_allocate(p, 1, 1, 0, &r);
        kvd_pool_release(p, 1, 0, &r, 1);
    }
    double t1 = now_s() - t0;
    kvd_block_ref batch[32];
    t0 = now_s();
    for (size_t i = 0; i < iters / 32; i++) {
        kvd_pool_allocate(p, 32, 1, 0, batch);
        kvd_pool_release(p, 1, 0, batch, 32);
    }
    double t32 = now_s() - t0;
    printf("| malloc(64)+free (baseline) | %.1f | %.1f | 1.0 |\n", iters / tm / 1e6,
           tm * 1e9 / iters);
    printf("| allocate(1)+release(1) | %.1f | %.1f | %.2f |\n", iters / t1 / 1e6, t1 * 1e9 / iters,
           t1 / tm);
    printf("| allocate(32)+release(32), per block | %.1f | %.1f | %.2f |\n\n",
           (iters / 32 * 32) / t32 / 1e6, t32 * 1e9 / (iters / 32 * 32),
           (t32 / (iters / 32 * 32)) / (tm / iters));
    printf("Target: >= 50 M pairs/s. Metadata: %zu bytes per block (limit 64).\n\n",
           kvd_pool_meta_bytes_per_block());
    if (kvd_pool_check(p) != KV_OK) {
        die("kvd_pool_check", KV_EINTERNAL);
    }
    kvd_pool_free(p);
    kvd_index_free(idx);
}

/* ---- hit rates on traces ---------------------------------------------------------------- */

static void bench_traces(int quick) {
    uint32_t nreq = quick ? 4000 : 30000;
    static const struct {
        kvd_trace_kind kind;
        const char *name;
    } kinds[4] = {{KVD_TRACE_CHAT, "multi-turn chat"},
                  {KVD_TRACE_SYSPROMPT, "shared system prompt"},
                  {KVD_TRACE_SESSIONS, "chat sessions, heavy-tailed gaps"},
                  {KVD_TRACE_FEWSHOT, "few-shot from shared examples"}};
    static const double frac[3] = {0.003, 0.01, 0.03};
    printf("### Eviction: block hit rate (prefix hits / blocks asked), %u requests per trace\n\n",
           nreq);
    printf("| trace | cache blocks | %% of distinct blocks | LRU | S3-FIFO | PREFIX_LRU | Belady "
           "(MIN) | S3-FIFO / LRU | PREFIX_LRU / LRU | LRU / MIN | PREFIX_LRU / MIN |\n");
    printf("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    for (int k = 0; k < 4; k++) {
        kvd_trace t;
        kv_err err = kvd_trace_gen(kinds[k].kind, 20240601 + (uint64_t)k, nreq, &t);
        if (err != KV_OK) {
            die("kvd_trace_gen", err);
        }
        for (int f = 0; f < 3; f++) {
            uint32_t cap = (uint32_t)(t.nkeys * frac[f]);
            if (cap < t.max_len) {
                cap = t.max_len;
            }
            kvd_trace_result lru, s3, pl, opt;
            if ((err = kvd_trace_replay(&t, KVD_EVICT_LRU, cap, 0, &lru)) != KV_OK ||
                (err = kvd_trace_replay(&t, KVD_EVICT_S3FIFO, cap, 0, &s3)) != KV_OK ||
                (err = kvd_trace_replay(&t, KVD_EVICT_PREFIX_LRU, cap, 0, &pl)) != KV_OK ||
                (err = kvd_trace_belady(&t, cap, &opt)) != KV_OK) {
                die("trace replay", err);
            }
            double hl = (double)lru.hit_blocks / (double)lru.query_blocks;
            double hs = (double)s3.hit_blocks / (double)s3.query_blocks;
            double hp = (double)pl.hit_blocks / (double)pl.query_blocks;
            double ho = (double)opt.hit_blocks / (double)opt.query_blocks;
            printf("| %s | %u | %.1f | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f | %.2f | %.2f |\n",
                   kinds[k].name, cap, 100.0 * cap / t.nkeys, hl, hs, hp, ho, hs / hl, hp / hl,
                   hl / ho, hp / ho);
            fflush(stdout);
        }
        kvd_trace_fini(&t);
    }
    printf(
        "\nTraces (daemon/evict_trace.c, seeded): *multi-turn chat*: 256 open conversations, each\n"
        "request continues one picked by recency rank (square of a uniform, so recent ones are\n"
        "likelier), re-sending its history plus 2..8 blocks; 8%% of turns start a new one.\n"
        "*shared system prompt*: 64 Zipf(1)-popular prompts of 8..32 blocks plus 1..8 blocks of\n"
        "one-off user text; a quarter of requests follow up one of the last 64 requests.\n"
        "*chat sessions*: conversations arrive as a Poisson process, run floor(Pareto(1, 1.2))\n"
        "turns (56%% single-turn, at most 40) and return after Pareto(2, 1.1) time units; each "
        "turn\n"
        "adds 1..4 user and 1..12 answer blocks. *few-shot*: one of 16 Zipf-popular task\n"
        "instructions (2..6 blocks), 4 examples drawn from the task's 64 Zipf-popular shared\n"
        "examples (1..3 blocks, in pool order), a one-off query of 1..4 blocks.\n\n"
        "PREFIX_LRU is LRU (tail of a prefix first) except that a block which is the prefix of\n"
        "two or more cached continuations (a branch point or its ancestor) gets one more round\n"
        "per reuse: shared prompts outlive bursts of one-off text, while a conversation's own\n"
        "history (a chain without branches) keeps LRU's order, which is what chat needs.\n"
        "S3-FIFO's small FIFO drops blocks that are not reused soon after their first use: it\n"
        "wins most where one-off text follows shared prompts or examples and loses where nearly\n"
        "every new block is reused once the conversation returns (multi-turn chat).\n\n");
}

int main(int argc, char **argv) {
    int quick = argc > 1 && strcmp(argv[1], "--quick") == 0;
    bench_hash(quick);
    bench_alloc(quick);
    bench_traces(quick);
    bench_index(quick);
    return 0;
}
