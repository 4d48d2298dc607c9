/* cluster_bench: what kvd costs beyond one node (issue 17).
 *
 * Remote tier: node A (a kvd) writes chains of 256 KiB blocks (--block-layers 32: 2 MiB) through
 * its tier 1 into one redis-server; node B (another kvd, same tenant) Fetches each chain (1, 8,
 * 64 blocks) from Redis into its T0 through libkvclient. The baseline, same run, same server: a
 * raw libhiredis client doing a pipelined GET of the same keys (the same value sizes). B's rate /
 * raw rate is the figure (target >= 0.8 on the worse runs); kvd's includes the request to kvd,
 * the T0 allocation, the value checks (XXH3-64), the commit and the reply.
 *
 * KV events: the price of publishing KV events in vLLM's format on the Commit path.
 *
 * Two daemons run side by side, both in hash-mode vllm: one without events, one publishing every
 * BlockStored and BlockRemoved (token ids on, the costliest form) to a ZMQ SUB that a thread of
 * this process drains. One client loop per daemon does what an engine does after a prefill:
 * Allocate 32 blocks, Commit them as one chain with their vLLM digests and token ids
 * (kvc_commit_ex), Release them; every chain is new, so every Commit stores 32 blocks and, once
 * the pool is full, every Allocate evicts 32 (BlockRemoved). The two loops alternate, RUNS times,
 * so both see the same machine (daemons on the last CPU, client and subscriber on the first); the
 * ratio of their rates is one figure (>= 0.95 is the target), and the ratio of the daemons' CPU
 * time per block (the scheduler's ns count of the loop thread, and of all threads) the other:
 * round trips bound these sync loops, so their rates swing with the machine (0.80-1.34 between
 * runs) while the CPU a block costs is what events add to the Commit path (<= 1.05 is the
 * target). The daemons have one CPU, so kv-events-thread auto keeps the events on their loop
 * thread; a fourth table has them on a thread of their own (on). Prints markdown (bench/run.sh
 * records it under "cluster" in bench/RESULTS.md).
 *
 *   cluster_bench --kvd bazel-bin/daemon/kvd [--runs 5] [--chains 1500] [--block-layers 4]
 */
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <hiredis/hiredis.h>
#include <zmq.h>

#include "bench/benchutil.h"
#include "common/kv_vllm_hash.h"
#include "kvclient.h"

#define CHAIN 32 /* blocks per Commit */
#define TPB 16

typedef struct node {
    char sock[160];
    pid_t pid;
} node;

static const char *g_kvd;
static char g_dir[64];
static volatile int g_sub_stop;
static const char *g_sub_ep; /* the endpoint the subscriber drains */
static unsigned long g_sub_msgs;

/* ---- remote tier ------------------------------------------------------------------------ */

/* Layers of the remote pools' blocks (--block-layers): x 8 heads x 128 dim x 16 tokens, fp16,
 * 64 KiB a layer; 4 (256 KiB a block) by default, 32 a Llama-3-8B-sized block (2 MiB). */
static uint32_t g_layers = 4;
static const size_t g_rsizes[3] = {1, 8, 64};

/* extra: one more kvd flag, or NULL. */
static void start_remote_node(node *d, const char *name, int port, const char *pool_mem,
                              const char *t1_mem, const char *cpu, const char *extra) {
    snprintf(d->sock, sizeof(d->sock), "%s/%s.sock", g_dir, name);
    char sockopt[200], redis[64], pm[64], t1[64];
    snprintf(sockopt, sizeof(sockopt), "--socket=%s", d->sock);
    snprintf(redis, sizeof(redis), "--remote-redis=127.0.0.1:%d", port);
    snprintf(pm, sizeof(pm), "--pool-memory=%s", pool_mem);
    snprintf(t1, sizeof(t1), "--tier1-memory=%s", t1_mem);
    char *argv[] = {"taskset",
                    "-c",
                    (char *)cpu,
                    (char *)g_kvd,
                    "--backend=host",
                    sockopt,
                    pm,
                    "--segment-bytes=16M",
                    t1,
                    "--tier-write=write-through",
                    "--fetch-min-tokens=0",
                    "--log-level=error",
                    "--remote-timeout-ms=2000",
                    redis,
                    (char *)extra,
                    NULL};
    d->pid = bench_spawn(argv);
    bench_wait_socket(d->sock, d->pid);
}

/* A session on sock with pool model of layout lay (fp16, TPB tokens a block) attached. */
static void open_pool(const char *sock, const char *model, uint32_t layers, uint32_t heads,
                      uint32_t dim, kv_arrangement arr, kvc_conn **c, kvc_pool **p) {
    kvc_options o;
    kvc_options_init(&o);
    o.socket_path = sock;
    o.client_name = "cluster_bench";
    kv_layout lay = {.num_layers = layers,
                     .num_kv_heads = heads,
                     .head_dim = dim,
                     .tokens_per_block = TPB,
                     .dtype = KV_DTYPE_FP16,
                     .arrangement = arr};
    if (kvc_conn_open(&o, c) != KV_OK || kvc_pool_attach(*c, model, &lay, p) != KV_OK) {
        bench_die("cannot open a session on %s: %s", sock, kvc_last_error(NULL));
    }
}

/* The remote tier's pools: 256 KiB blocks, block-major (a block is one contiguous run). */
static void open_remote_pool(const char *sock, kvc_conn **c, kvc_pool **p) {
    open_pool(sock, "remote-model", g_layers, 8, 128, KV_BLOCK_MAJOR, c, p);
}

/* The keys node A wrote, in Redis (KEYS: a benchmark's own server). */
static char **redis_keys(redisContext *rc, size_t *n) {
    redisReply *r = redisCommand(rc, "KEYS kvd:*");
    if (r == NULL || r->type != REDIS_REPLY_ARRAY) {
        bench_die("KEYS failed");
    }
    char **k = malloc(sizeof(*k) * (r->elements + 1));
    for (size_t i = 0; i < r->elements; i++) {
        k[i] = strdup(r->element[i]->str);
    }
    *n = r->elements;
    freeReplyObject(r);
    return k;
}

/* Waits (up to 30 s) until Redis holds n keys. */
static void wait_dbsize(redisContext *rc, size_t n) {
    for (int i = 0; i < 600; i++) {
        redisReply *r = redisCommand(rc, "DBSIZE");
        long long k = r != NULL ? r->integer : 0;
        if (r != NULL) {
            freeReplyObject(r);
        }
        if ((size_t)k >= n) {
            return;
        }
        usleep(50000);
    }
}

static double raw_get(redisContext *rc, char **keys, size_t n, size_t *bytes) {
    double t0 = bench_now_s();
    for (size_t i = 0; i < n; i++) {
        redisAppendCommand(rc, "GET %s", keys[i]);
    }
    *bytes = 0;
    for (size_t i = 0; i < n; i++) {
        void *rep;
        if (redisGetReply(rc, &rep) != REDIS_OK) {
            bench_die("raw GET failed");
        }
        *bytes += ((redisReply *)rep)->len;
        freeReplyObject(rep);
    }
    return bench_now_s() - t0;
}

/* Fetches of n blocks per measured sample: at least 32 blocks' worth, so that one sample of a
 * 1-block prefix is not one scheduler tick. */
static size_t reps_of(size_t n) {
    return n >= 32 ? 1 : 32 / n;
}

/* A raw pipeline of STRLENs of keys[0..n): seconds. */
static double raw_strlen(redisContext *rc, char **keys, size_t n) {
    double t0 = bench_now_s();
    for (size_t i = 0; i < n; i++) {
        redisAppendCommand(rc, "STRLEN %s", keys[i]);
    }
    for (size_t i = 0; i < n; i++) {
        void *rep;
        if (redisGetReply(rc, &rep) != REDIS_OK) {
            bench_die("raw STRLEN failed");
        }
        freeReplyObject(rep);
    }
    return bench_now_s() - t0;
}

/* Lookup.remote (kvc_lookup_remote) of prefixes node B holds nowhere locally (hashes: 8 chains
 * of 64 blocks node A wrote and B never fetched) against a plain Lookup of the same prefix plus
 * a raw STRLEN pipeline of as many keys: what asking Redis at Lookup time adds to a Lookup. */
static void lookup_remote_table(redisContext *rc, kvc_pool *pb, kvc_conn *cb,
                                const kv_hash128 *hashes, char **keys, int runs) {
    printf("#### Lookup.remote: how far a prefix goes on in Redis, asked at Lookup time\n\n");
    printf("Node B asks about prefixes of 8 chains node A wrote and B never fetched: "
           "kvc_lookup_remote (one pipelined STRLEN per key on the remote thread, the reply "
           "deferred until Redis answers) vs a plain kvc_lookup of the same prefix and a raw "
           "hiredis STRLEN pipeline of as many keys, alternating; a sample is the median of 32 "
           "calls; %d samples.\n\n",
           runs);
    printf("| prefix blocks | Lookup.remote us | plain Lookup us | raw STRLEN pipeline us | "
           "remote / (plain + raw) (median) | worst |\n|---:|---:|---:|---:|---:|---:|\n");
    kvc_block blk[64];
    for (int s = 0; s < 3; s++) {
        size_t n = g_rsizes[s];
        double lr[64], lp[64], lw[64], ratio[64];
        for (int r = 0; r < runs; r++) {
            double a[32], b[32], c[32];
            for (int q = 0; q < 32; q++) {
                const kv_hash128 *h = hashes + 64 * (size_t)((r * 32 + q) % 8);
                size_t nhit = 0;
                kvc_tier_hits th;
                kvc_remote_hits rh;
                double t0 = bench_now_s();
                kv_err err = kvc_lookup_remote(pb, h, n, blk, &nhit, &th, &rh);
                a[q] = bench_now_s() - t0;
                if (err != KV_OK || nhit != 0 || th.fetchable != 0 || rh.blocks != n ||
                    rh.failure != KV_OK) {
                    bench_die("Lookup.remote of %zu blocks: %s (hits %zu, below %u, remote %u, "
                              "%s)",
                              n, kv_strerror(err), nhit, th.fetchable, rh.blocks,
                              kv_strerror(rh.failure));
                }
                t0 = bench_now_s();
                err = kvc_lookup(pb, h, n, blk, &nhit);
                b[q] = bench_now_s() - t0;
                if (err != KV_OK || nhit != 0) {
                    bench_die("plain Lookup: %s", kvc_last_error(cb));
                }
                c[q] = raw_strlen(rc, keys, n);
            }
            lr[r] = bench_median(a, 32) * 1e6;
            lp[r] = bench_median(b, 32) * 1e6;
            lw[r] = bench_median(c, 32) * 1e6;
            ratio[r] = lr[r] / (lp[r] + lw[r]);
        }
        double worst = ratio[0];
        for (int r = 1; r < runs; r++) {
            worst = ratio[r] > worst ? ratio[r] : worst;
        }
        printf("| %zu | %.1f | %.1f | %.1f | %.2f | %.2f |\n", n, bench_median(lr, (size_t)runs),
               bench_median(lp, (size_t)runs), bench_median(lw, (size_t)runs),
               bench_median(ratio, (size_t)runs), worst);
    }
    printf("\nNo target in the issue; 1.0 would be a Lookup and a Redis round trip back to back "
           "with nothing between them (the remote thread's hand-offs are what is above it).\n\n");
}

/* redis-server on loopback port, pinned to cpu, no persistence; *rc connected to it. */
static pid_t start_redis(int port, const char *cpu, redisContext **rc) {
    char port_s[16];
    snprintf(port_s, sizeof(port_s), "%d", port);
    char *rargv[] = {"taskset",      "-c",     (char *)cpu, "redis-server", "--port",
                     port_s,         "--bind", "127.0.0.1", "--save",       "",
                     "--appendonly", "no",     "--dir",     g_dir,          NULL};
    pid_t rpid = bench_spawn(rargv);
    *rc = NULL;
    for (int i = 0; i < 100 && (*rc == NULL || (*rc)->err); i++) {
        if (*rc != NULL) {
            redisFree(*rc);
        }
        usleep(50000);
        *rc = redisConnect("127.0.0.1", port);
    }
    if (*rc == NULL || (*rc)->err) {
        bench_die("cannot reach redis-server on port %d", port);
    }
    return rpid;
}

static void bench_remote(int runs) {
    int port = 20000 + (int)(getpid() % 20000);
    /* Placement: redis-server (and node A, idle while B is measured) on the last CPU; node B
     * and this process (the raw client, B's client) on the first. The raw pipeline's client
     * side and everything kvd does for a Fetch then run on the same one CPU, and Redis on the
     * other in both; unpinned, where the scheduler put the raw client and Redis moved the raw
     * figure by 2x from run to run. */
    char last[24];
    snprintf(last, sizeof(last), "%ld", sysconf(_SC_NPROCESSORS_ONLN) - 1);
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(0, &set);
    sched_setaffinity(0, sizeof(set), &set);
    redisContext *rc;
    pid_t rpid = start_redis(port, last, &rc);
    node a, b;
    /* B is small (T0 four 64-block Fetches' worth, T1 two): its warm-up Fetches recycle every
     * buffer, so the measured ones run on memory a busy node has touched already. */
    uint64_t blk_kib = 64u * g_layers; /* a block */
    char t0[32], b1[32];
    /* Both: T0 for 256 blocks. A: T1 1 GiB (its write-through queue to Redis: 256 MiB, paced
     * below at 64 MiB); B: T1 for 128 blocks. */
    snprintf(t0, sizeof(t0), "%lluM", (unsigned long long)(blk_kib * 256 / 1024));
    snprintf(b1, sizeof(b1), "%lluM", (unsigned long long)(blk_kib * 128 / 1024));
    start_remote_node(&a, "ra", port, t0, "1024M", last, NULL);
    start_remote_node(&b, "rb", port, t0, b1, "0", NULL);
    kvc_conn *ca, *cb;
    kvc_pool *pa, *pb;
    open_remote_pool(a.sock, &ca, &pa);
    open_remote_pool(b.sock, &cb, &pb);
    size_t bb = kvc_pool_layout(pa)->block_bytes;
    /* Node A: runs chains of each size, every block new (its own tokens). */
    enum { WARM = 8 }; /* chains of 64 blocks B Fetches first, unmeasured */
    /* Chains of 64 blocks B never fetches, for the Lookup.remote table. */
    size_t look = getenv("CLUSTER_NO_LOOKUP") == NULL ? 8 : 0;
    size_t total = (WARM + look) * 64;
    for (int s = 0; s < 3; s++) {
        total += g_rsizes[s] * reps_of(g_rsizes[s]) * (size_t)runs;
    }
    kv_hash128 *hashes = malloc(sizeof(*hashes) * total);
    uint32_t *tok = malloc(sizeof(uint32_t) * 64 * TPB);
    kvc_block blk[64], canon[64];
    kvc_commit_entry e[64];
    size_t at = 0, paced = 0;
    for (int s = -1; s < 4; s++) { /* warm-up, the three sizes, the Lookup.remote chains */
        size_t chains = s < 0 ? WARM : s == 3 ? look : (size_t)runs * reps_of(g_rsizes[s]);
        for (size_t r = 0; r < chains; r++) {
            size_t n = s < 0 || s == 3 ? 64 : g_rsizes[s], nh;
            for (size_t i = 0; i < n * TPB; i++) {
                tok[i] = (uint32_t)(at * 7919 + i * 31 + 1);
            }
            if (kvc_pool_hash_tokens(pa, NULL, 0, tok, n * TPB, hashes + at, n, &nh) != KV_OK ||
                kvc_allocate(pa, (uint32_t)n, blk) != KV_OK) {
                bench_die("node A: %s", kvc_last_error(ca));
            }
            for (size_t i = 0; i < n; i++) {
                memset(kvc_pool_addr(pa, blk[i].id, 0, KV_K, 0, 0), (int)(at + i) & 0xff, bb);
                e[i].block = blk[i];
                e[i].hash = hashes[at + i];
                e[i].parent = i == 0 ? KVC_NO_PARENT : blk[i - 1].id;
            }
            if (kvc_commit(pa, e, n, canon) != KV_OK || kvc_release(pa, canon, n) != KV_OK) {
                bench_die("node A commit: %s", kvc_last_error(ca));
            }
            at += n;
            if ((at - paced) * bb >= (64u << 20)) { /* A's queue holds 256 MiB: never full */
                wait_dbsize(rc, at);
                paced = at;
            }
        }
    }
    wait_dbsize(rc, total); /* every block in Redis */
    size_t nkeys;
    char **keys = redis_keys(rc, &nkeys); /* the raw client GETs the same value sizes */
    if (nkeys < total) {
        bench_die("only %zu of %zu blocks reached Redis", nkeys, total);
    }
    printf("### Remote tier, %zu KiB blocks: Fetch from Redis vs a raw hiredis GET of the same "
           "bytes\n\n",
           bb >> 10);
    printf("Node A wrote %zu blocks of %zu KiB through its tier 1 into one redis-server "
           "(loopback TCP); node B (T0 of 256 blocks, T1 of 128, warmed by %d unmeasured 64-block "
           "Fetches that recycle all of it) Fetches each chain once into its T0 (libkvclient "
           "kvc_fetch: T0 blocks allocated, pipelined GETs read straight into them, value checks, "
           "commit, reply). Raw: a "
           "libhiredis pipeline of GETs of as many keys of the same size. redis-server (and "
           "node A) on the last CPU, node B and this process (both clients) on the first. Raw "
           "and kvd alternate fetch by fetch; a sample is 32 fetches of 1 block, 4 of 8, 1 of 64 "
           "(each key once); %d samples per size, the ratio taken per sample.\n\n",
           total, bb >> 10, (int)WARM, runs);
    printf(
        "| prefix blocks | raw GET MB/s (median) | kvd Fetch MB/s (median) | kvd / raw (median) "
        "| lower quartile | worst | Fetch ms (median) |\n|---:|---:|---:|---:|---:|---:|---:|\n");
    /* B's warm-up: the first chains, through every block of its pool and its T1. */
    for (int w = 0; w < WARM; w++) {
        kvc_fetch_result fr;
        if (kvc_fetch(pb, hashes + 64 * w, 64, 0, blk, &fr) != KV_OK || fr.nblocks != 64) {
            bench_die("node B warm-up fetched %zu of 64: %s", fr.nblocks, kvc_last_error(cb));
        }
        (void)kvc_release(pb, blk, fr.nblocks);
    }
    at = WARM * 64;
    size_t kused = 0;
    double worst_all = 1e9, q1_all = 1e9;
    for (int s = 0; s < 3; s++) {
        size_t n = g_rsizes[s];
        double rawv[64], kv[64], ratio[64], ms[64];
        size_t reps = reps_of(n);
        for (int r = 0; r < runs; r++) {
            size_t bytes = 0;
            double traw = 0, tk = 0;
            for (size_t q = 0; q < reps; q++) { /* raw and kvd alternate, fetch by fetch */
                size_t b1;
                traw += raw_get(rc, keys + kused, n, &b1);
                bytes += b1;
                kused += n;
                kvc_fetch_result fr;
                double t0 = bench_now_s();
                kv_err err = kvc_fetch(pb, hashes + at, n, 0, blk, &fr);
                tk += bench_now_s() - t0;
                if (err != KV_OK || fr.nblocks != n) {
                    bench_die("node B fetched %zu of %zu blocks: %s", fr.nblocks, n,
                              kvc_last_error(cb));
                }
                for (size_t i = 0; i < n; i++) {
                    const uint8_t *d = kvc_pool_addr(pb, blk[i].id, 0, KV_K, 0, 0);
                    if (d[0] != (uint8_t)((at + i) & 0xff) || d[bb - 1] != d[0]) {
                        bench_die("node B read other bytes than node A wrote");
                    }
                }
                (void)kvc_release(pb, blk, n);
                at += n;
            }
            rawv[r] = (double)bytes / traw / 1e6;
            kv[r] = (double)(reps * n * bb) / tk / 1e6;
            ratio[r] = kv[r] / rawv[r];
            ms[r] = tk * 1e3 / (double)reps;
            worst_all = ratio[r] < worst_all ? ratio[r] : worst_all;
        }
        double worst = ratio[0];
        for (int r = 1; r < runs; r++) {
            worst = ratio[r] < worst ? ratio[r] : worst;
        }
        double q1 = bench_lower_quartile(ratio, (size_t)runs);
        q1_all = q1 < q1_all ? q1 : q1_all;
        printf("| %zu | %.0f | %.0f | %.2f | %.2f | %.2f | %.2f |\n", n,
               bench_median(rawv, (size_t)runs), bench_median(kv, (size_t)runs),
               bench_median(ratio, (size_t)runs), q1, worst, bench_median(ms, (size_t)runs));
    }
    printf("\nLowest lower quartile of kvd / raw over the rows: %.2f (target >= 0.8, met when the "
           "worse quartile of the samples meets it: %s); the worst single sample: %.2f. LMCache "
           "reports about 10 GB/s for its Redis L2 client on its own hardware (a different "
           "machine: not comparable with these loopback figures).\n\n",
           q1_all, q1_all >= 0.8 ? "met" : "not met", worst_all);
    if (look > 0) { /* (what a probe costs is not a value size's: one table a run) */
        lookup_remote_table(rc, pb, cb, hashes + total - look * 64, keys, runs);
    }
    for (size_t i = 0; i < nkeys; i++) {
        free(keys[i]);
    }
    free(keys);
    free(hashes);
    free(tok);
    kvc_conn_close(ca);
    kvc_conn_close(cb);
    redisFree(rc);
    bench_stop(a.pid);
    bench_stop(b.pid);
    bench_stop(rpid);
}

/* ---- remote writes: write-through vs write-back ----------------------------------------- */

static uint64_t stat_of(kvc_conn *c, const char *name) {
    uint64_t v = 0;
    if (kvc_stat_get(c, 0, name, &v) != KV_OK) {
        bench_die("stat %s: %s", name, kvc_last_error(c));
    }
    return v;
}

/* One node serves NREQ requests over NCHAINS chains of 8 blocks drawn with Zipf-like weights
 * (1/rank), the same sequence in each mode: each request Fetches its chain (T0, T1 or Redis),
 * then allocates, fills and commits what the Fetch did not bring. T0 holds 256 blocks, T1 512,
 * the chains 2048: the same work, counted in Redis writes and in what another node could fetch
 * at the end (the chains' blocks in Redis). */
#define WB_CHAINS 256
#define WB_LEN 8
#define WB_REQS 3000

static void remote_write_mode(const char *mode, int port, const char *last, redisContext *rc,
                              uint64_t seed, double out[6]) {
    node a;
    uint64_t blk_kib = 64u * g_layers;
    char t0[32], t1[32], flag[64];
    snprintf(t0, sizeof(t0), "%lluM", (unsigned long long)(blk_kib * 256 / 1024));
    snprintf(t1, sizeof(t1), "%lluM", (unsigned long long)(blk_kib * 512 / 1024));
    snprintf(flag, sizeof(flag), "--remote-write=%s", mode);
    freeReplyObject(redisCommand(rc, "FLUSHALL"));
    start_remote_node(&a, "wa", port, t0, t1, last, flag);
    kvc_conn *c;
    kvc_pool *p;
    open_remote_pool(a.sock, &c, &p);
    size_t bb = kvc_pool_layout(p)->block_bytes;
    static kv_hash128 hashes[WB_CHAINS][WB_LEN];
    static uint32_t tok[WB_LEN * TPB];
    for (size_t k = 0; k < WB_CHAINS; k++) {
        for (size_t i = 0; i < WB_LEN * TPB; i++) {
            tok[i] = (uint32_t)(seed * 1000003u + k * 7919u + i * 31u + 1u);
        }
        size_t nh;
        if (kvc_pool_hash_tokens(p, NULL, 0, tok, WB_LEN * TPB, hashes[k], WB_LEN, &nh) != KV_OK) {
            bench_die("hash: %s", kvc_last_error(c));
        }
    }
    double wsum = 0, w[WB_CHAINS];
    for (size_t k = 0; k < WB_CHAINS; k++) {
        wsum += w[k] = 1.0 / (double)(k + 1);
    }
    uint64_t rng = seed * 0x9E3779B97F4A7C15ull + 1;
    uint64_t asked = 0, hit = 0, committed = 0;
    kvc_block blk[WB_LEN], canon[WB_LEN];
    kvc_commit_entry e[WB_LEN];
    for (int r = 0; r < WB_REQS; r++) {
        rng = rng * 6364136223846793005ull + 1442695040888963407ull;
        double u = (double)(rng >> 11) / 9007199254740992.0 * wsum;
        size_t k = 0;
        while (k + 1 < WB_CHAINS && u >= w[k]) {
            u -= w[k++];
        }
        kvc_fetch_result fr;
        if (kvc_fetch(p, hashes[k], WB_LEN, 0, blk, &fr) != KV_OK) {
            bench_die("fetch: %s", kvc_last_error(c));
        }
        size_t got = fr.nblocks, need = WB_LEN - got;
        asked += WB_LEN;
        hit += got;
        if (need > 0) {
            if (kvc_allocate(p, (uint32_t)need, blk + got) != KV_OK) {
                bench_die("allocate: %s", kvc_last_error(c));
            }
            for (size_t i = 0; i < need; i++) {
                memset(kvc_pool_addr(p, blk[got + i].id, 0, KV_K, 0, 0), (int)(k + i) & 0xff, bb);
                e[i].block = blk[got + i];
                e[i].hash = hashes[k][got + i];
                e[i].parent = got + i == 0 ? KVC_NO_PARENT : blk[got + i - 1].id;
            }
            if (kvc_commit(p, e, need, canon) != KV_OK) {
                bench_die("commit: %s", kvc_last_error(c));
            }
            memcpy(blk + got, canon, need * sizeof(*canon));
            committed += need;
        }
        (void)kvc_release(p, blk, WB_LEN);
    }
    /* The writes still out land (a second of quiet). */
    uint64_t puts = 0;
    for (int i = 0; i < 50; i++) {
        uint64_t now = stat_of(c, "tiers.remote_puts");
        if (i > 0 && now == puts) {
            break;
        }
        puts = now;
        usleep(100000);
    }
    redisReply *rep = redisCommand(rc, "DBSIZE");
    uint64_t keys = rep != NULL && rep->type == REDIS_REPLY_INTEGER ? (uint64_t)rep->integer : 0;
    freeReplyObject(rep);
    out[0] = (double)committed;
    out[1] = (double)puts;
    out[2] = (double)stat_of(c, "tiers.remote_put_bytes") / 1e6;
    out[3] = (double)hit / (double)asked;
    out[4] = (double)keys / (double)(WB_CHAINS * WB_LEN);
    out[5] = (double)stat_of(c, "tiers.remote_dirty_drops");
    kvc_conn_close(c);
    bench_stop(a.pid);
}

static void bench_remote_write(void) {
    int port = 20000 + (int)((getpid() + 7) % 20000);
    char last[24];
    snprintf(last, sizeof(last), "%ld", sysconf(_SC_NPROCESSORS_ONLN) - 1);
    redisContext *rc;
    pid_t rpid = start_redis(port, last, &rc);
    printf("### Remote writes: write-through vs write-back (remote-write)\n\n");
    printf("One node (T0 256 blocks, T1 512, blocks of %zu KiB) serves %d requests over %d chains "
           "of %d blocks (2048 blocks; a chain drawn with weight 1/rank, the same sequence in "
           "both modes): each Fetches its chain (from T0, T1 or Redis) and commits what did not "
           "come. Redis writes, and the share of the chains' blocks Redis holds at the end "
           "(what another node could fetch before this one stops). One row per seed.\n\n",
           (size_t)(64u * g_layers), WB_REQS, WB_CHAINS, WB_LEN);
    printf("| seed | mode | blocks committed | Redis writes | MB written | writes / committed "
           "| hit rate (T0+T1+Redis) | blocks in Redis at the end | remote dirty drops "
           "|\n|---:|---|---:|---:|---:|---:|---:|---:|---:|\n");
    for (uint64_t seed = 1; seed <= 3; seed++) {
        static const char *modes[2] = {"write-through", "write-back"};
        for (int m = 0; m < 2; m++) {
            double o[6];
            remote_write_mode(modes[m], port, last, rc, seed, o);
            printf("| %llu | %s | %.0f | %.0f | %.0f | %.2f | %.3f | %.0f%% | %.0f |\n",
                   (unsigned long long)seed, modes[m], o[0], o[1], o[2],
                   o[0] > 0 ? o[1] / o[0] : 0.0, o[3], o[4] * 100, o[5]);
        }
    }
    printf("\n");
    redisFree(rc);
    bench_stop(rpid);
}

static void start(node *d, const char *name, const char *events, int token_ids,
                  const char *thread) {
    snprintf(d->sock, sizeof(d->sock), "%s/%s.sock", g_dir, name);
    char sockopt[200], evopt[200], thopt[64];
    snprintf(thopt, sizeof(thopt), "--kv-events-thread=%s", thread);
    snprintf(sockopt, sizeof(sockopt), "--socket=%s", d->sock);
    snprintf(evopt, sizeof(evopt), "--kv-events-endpoint=%s", events != NULL ? events : "");
    /* The daemons on the last CPU, this process (client loop, subscriber) on the first: the
     * same placement for both, whatever the scheduler would do with the events' threads. */
    char cpu[24];
    snprintf(cpu, sizeof(cpu), "%ld", sysconf(_SC_NPROCESSORS_ONLN) - 1);
    char *argv[] = {"taskset",
                    "-c",
                    cpu,
                    (char *)g_kvd,
                    "--backend=host",
                    sockopt,
                    "--pool-memory=32M",
                    "--segment-bytes=1M",
                    "--log-level=error",
                    "--hash-mode=vllm",
                    "--vllm-hash-seed=0",
                    token_ids ? "--kv-events-token-ids=true" : "--kv-events-token-ids=false",
                    evopt,
                    thopt,
                    NULL};
    d->pid = bench_spawn(argv);
    bench_wait_socket(d->sock, d->pid);
}

static void *subscriber(void *arg) {
    void *sub = zmq_socket(arg, ZMQ_SUB);
    zmq_setsockopt(sub, ZMQ_SUBSCRIBE, "", 0);
    int to = 50;
    zmq_setsockopt(sub, ZMQ_RCVTIMEO, &to, sizeof(to));
    zmq_connect(sub, g_sub_ep);
    char buf[1 << 16];
    while (!g_sub_stop) {
        if (zmq_recv(sub, buf, sizeof(buf), 0) >= 0) {
            int more = 0;
            size_t ml = sizeof(more);
            zmq_getsockopt(sub, ZMQ_RCVMORE, &more, &ml);
            if (!more) {
                g_sub_msgs++;
            }
        }
    }
    zmq_close(sub);
    return NULL;
}

typedef struct work {
    uint32_t *tokens;    /* [chains * CHAIN * TPB] */
    uint8_t (*full)[32]; /* [chains * CHAIN] */
    kv_hash128 *keys;
    size_t chains;
} work;

/* Unique chains for one run on one daemon (salt keeps every run's blocks new). */
static void make_work(work *w, size_t chains, uint32_t salt) {
    size_t nb = chains * CHAIN;
    w->chains = chains;
    w->tokens = malloc(nb * TPB * sizeof(uint32_t));
    w->full = malloc(nb * 32);
    w->keys = malloc(nb * sizeof(kv_hash128));
    if (w->tokens == NULL || w->full == NULL || w->keys == NULL) {
        bench_die("out of memory");
    }
    uint8_t none[32];
    kv_vllm_none_hash("0", 1, none);
    for (size_t c = 0; c < chains; c++) {
        uint32_t *t = w->tokens + c * CHAIN * TPB;
        t[0] = salt;
        t[1] = (uint32_t)c;
        for (size_t i = 2; i < CHAIN * TPB; i++) {
            t[i] = (uint32_t)(i * 2654435761u) % 128000;
        }
        size_t n;
        if (kv_vllm_hash_chain(none, t, CHAIN * TPB, TPB, NULL, 0, w->full + c * CHAIN, CHAIN,
                               &n) != KV_OK) {
            bench_die("hashing failed");
        }
        for (size_t i = 0; i < CHAIN; i++) {
            w->keys[c * CHAIN + i] = kv_vllm_hash_key(w->full[c * CHAIN + i]);
        }
    }
}

static void free_work(work *w) {
    free(w->tokens);
    free(w->full);
    free(w->keys);
}

/* Commits every chain of w through d; returns blocks committed per second. */
/* A session on a daemon that runs a work's chains, a slice at a time. */
typedef struct runner {
    kvc_conn *c;
    kvc_pool *p;
    const work *w;
    const node *d;
    size_t at;            /* chains done */
    double secs;          /* spent in slices */
    uint64_t loop0, all0; /* the daemon's CPU ns at the start: loop thread, all threads */
} runner;

/* The daemon's CPU time per block of a run. */
typedef struct cpu_cost {
    double loop_us; /* its loop thread's (the Commit path) */
    double all_us;  /* all its threads' (ZMQ's I/O thread sends the batches) */
} cpu_cost;

static void runner_open(runner *r, node *d, const work *w) {
    memset(r, 0, sizeof(*r));
    open_pool(d->sock, "bench-model", 2, 2, 64, KV_LAYER_MAJOR, &r->c, &r->p);
    r->w = w;
    r->d = d;
    r->loop0 = bench_cpu_ns(d->pid, 1);
    r->all0 = bench_cpu_ns(d->pid, 0);
}

/* Runs the next n chains (Allocate + Commit + Release each), timed. */
static void runner_slice(runner *r, size_t n) {
    kvc_block b[CHAIN], canon[CHAIN];
    kvc_commit_entry e[CHAIN];
    const work *w = r->w;
    double t0 = bench_now_s();
    for (size_t ch = r->at; ch < r->at + n && ch < w->chains; ch++) {
        if (kvc_allocate(r->p, CHAIN, b) != KV_OK) {
            bench_die("allocate failed: %s", kvc_last_error(r->c));
        }
        for (int i = 0; i < CHAIN; i++) {
            e[i].block = b[i];
            e[i].hash = w->keys[ch * CHAIN + i];
            e[i].parent = i == 0 ? KVC_NO_PARENT : b[i - 1].id;
        }
        if (kvc_commit_ex(r->p, e, CHAIN, w->full + ch * CHAIN, NULL, w->tokens + ch * CHAIN * TPB,
                          canon) != KV_OK ||
            kvc_release(r->p, canon, CHAIN) != KV_OK) {
            bench_die("commit failed: %s", kvc_last_error(r->c));
        }
    }
    r->secs += bench_now_s() - t0;
    r->at = r->at + n < w->chains ? r->at + n : w->chains;
}

/* Blocks per second of a runner's chains; *cost: the daemon's CPU per block over the run (its
 * work between the slices too: the last events flush 1 ms after a Commit). */
static double runner_close(runner *r, cpu_cost *cost) {
    kvc_conn_close(r->c);
    usleep(20000); /* the last batch's flush */
    double blocks = (double)(r->at * CHAIN);
    cost->loop_us = (double)(bench_cpu_ns(r->d->pid, 1) - r->loop0) / 1e3 / blocks;
    cost->all_us = (double)(bench_cpu_ns(r->d->pid, 0) - r->all0) / 1e3 / blocks;
    return blocks / r->secs;
}

/* Both daemons' works, alternated slice by slice (SLICE chains, the first of each pair
 * alternating too): a minute's drift on a shared machine reaches both alike. */
#define SLICE 50
static void run_pair(node *off, node *on, const work *w1, const work *w2, double *r_off,
                     double *r_on, cpu_cost *c_off, cpu_cost *c_on) {
    runner a, b;
    runner_open(&a, off, w1);
    runner_open(&b, on, w2);
    for (size_t k = 0; a.at < w1->chains || b.at < w2->chains; k++) {
        if (k % 2 == 0) {
            runner_slice(&a, SLICE);
            runner_slice(&b, SLICE);
        } else {
            runner_slice(&b, SLICE);
            runner_slice(&a, SLICE);
        }
    }
    *r_off = runner_close(&a, c_off);
    *r_on = runner_close(&b, c_on);
}

/* Alternated runs of both daemons; prints one table. with_sub: a SUB in this process (on the
 * client's CPU) drains the events, as a router on the same node would; without one, ZMQ drops
 * each batch at once and the figure is kvd's own encoding cost. */
static void measure(node *off, node *on, void *zctx, int with_sub, int runs, size_t chains,
                    uint32_t salt, const char *title) {
    pthread_t th;
    g_sub_stop = 0;
    g_sub_msgs = 0;
    if (with_sub) {
        pthread_create(&th, NULL, subscriber, zctx);
        usleep(200000); /* the SUB joins before the first event */
    }
    double r_off[64] = {0}, r_on[64] = {0}, ratio[64] = {0};
    cpu_cost c_off[64], c_on[64];
    double cl[64] = {0}, ca[64] = {0}; /* CPU per block, on / off: loop thread, all threads */
    for (int r = 0; r < runs; r++) {
        work w1, w2;
        make_work(&w1, chains, salt * 1000u + 2u * (uint32_t)r);
        make_work(&w2, chains, salt * 1000u + 2u * (uint32_t)r + 1u);
        run_pair(off, on, &w1, &w2, &r_off[r], &r_on[r], &c_off[r], &c_on[r]);
        ratio[r] = r_on[r] / r_off[r];
        cl[r] = c_on[r].loop_us / c_off[r].loop_us;
        ca[r] = c_on[r].all_us / c_off[r].all_us;
        free_work(&w1);
        free_work(&w2);
    }
    if (with_sub) {
        usleep(200000);
        g_sub_stop = 1;
        pthread_join(th, NULL);
    }
    double worst = ratio[0], worst_cl = cl[0], worst_ca = ca[0];
    for (int r = 1; r < runs; r++) {
        worst = ratio[r] < worst ? ratio[r] : worst;
        worst_cl = cl[r] > worst_cl ? cl[r] : worst_cl;
        worst_ca = ca[r] > worst_ca ? ca[r] : worst_ca;
    }
    double sorted[64];
    memcpy(sorted, ratio, sizeof(double) * (size_t)runs);
    double med = bench_median(sorted, (size_t)runs);
    memcpy(sorted, cl, sizeof(double) * (size_t)runs);
    double med_cl = bench_median(sorted, (size_t)runs);
    memcpy(sorted, ca, sizeof(double) * (size_t)runs);
    double med_ca = bench_median(sorted, (size_t)runs);
    printf("%s\n\n", title);
    printf("| run | blocks/s, events off | blocks/s, events on | on / off | loop CPU us/block, "
           "off | on | on / off | all threads' CPU us/block, off | on | on / off |\n");
    printf("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n");
    for (int r = 0; r < runs; r++) {
        printf("| %d | %.0f | %.0f | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f | %.3f |\n", r + 1,
               r_off[r], r_on[r], ratio[r], c_off[r].loop_us, c_on[r].loop_us, cl[r],
               c_off[r].all_us, c_on[r].all_us, ca[r]);
    }
    printf("\nThroughput on / off: median %.3f, worst %.3f (target: worst >= 0.95). The daemon's "
           "CPU per block, on / off: loop thread median %.3f, worst %.3f; all threads median "
           "%.3f, worst %.3f (target: worst <= 1.05). %lu batches received.\n\n",
           med, worst, med_cl, worst_cl, med_ca, worst_ca, g_sub_msgs);
}

int main(int argc, char **argv) {
    int runs = 5, remote_runs = 0; /* 0: runs */
    size_t chains = 1500;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--kvd") == 0 && i + 1 < argc) {
            g_kvd = argv[++i];
        } else if (strcmp(argv[i], "--runs") == 0 && i + 1 < argc) {
            runs = atoi(argv[++i]);
        } else if (strcmp(argv[i], "--remote-runs") == 0 && i + 1 < argc) {
            remote_runs = atoi(argv[++i]);
        } else if (strcmp(argv[i], "--block-layers") == 0 && i + 1 < argc) {
            g_layers = (uint32_t)atoi(argv[++i]);
        } else if (strcmp(argv[i], "--chains") == 0 && i + 1 < argc) {
            chains = (size_t)atol(argv[++i]);
        } else {
            fprintf(stderr, "usage: cluster_bench --kvd PATH [--runs N] [--remote-runs N] "
                            "[--chains N] [--block-layers N]\n");
            return 2;
        }
    }
    if (remote_runs == 0) {
        remote_runs = runs;
    }
    if (g_kvd == NULL || runs < 1 || runs > 64 || remote_runs < 1 || remote_runs > 64 ||
        chains < 1 || g_layers < 1 || g_layers > 64) {
        fprintf(stderr, "cluster_bench: --kvd is required; runs and remote-runs 1..64, chains "
                        ">= 1, block-layers 1..64\n");
        return 2;
    }
    snprintf(g_dir, sizeof(g_dir), "/tmp/kvclb.XXXXXX");
    if (mkdtemp(g_dir) == NULL) {
        bench_die("mkdtemp: %s", strerror(errno));
    }
    if (getenv("CLUSTER_NO_REMOTE") == NULL) {
        bench_remote(remote_runs); /* pins itself (see there) */
    }
    if (getenv("CLUSTER_NO_WRITE") == NULL) {
        bench_remote_write();
    }
    if (getenv("CLUSTER_NO_EVENTS") != NULL) {
        return 0;
    }
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(0, &set);
    sched_setaffinity(0, sizeof(set), &set); /* the events part; threads made later inherit it */
    node off, on, nt, th;
    char ep[128], ep2[128], ep3[128];
    snprintf(ep, sizeof(ep), "ipc://%s/ev", g_dir);
    snprintf(ep2, sizeof(ep2), "ipc://%s/ev2", g_dir);
    snprintf(ep3, sizeof(ep3), "ipc://%s/ev3", g_dir);
    start(&off, "off", NULL, 1, "auto");
    start(&on, "on", ep, 1, "auto");
    start(&nt, "nt", ep2, 0, "auto");
    start(&th, "th", ep3, 1, "on");
    g_sub_ep = ep;
    void *zctx = zmq_ctx_new();
    /* One uncounted run each: the pools grow their segments and fill. */
    {
        work w1, w2;
        make_work(&w1, chains, 7u);
        make_work(&w2, chains, 8u);
        double x, y;
        cpu_cost cx, cy;
        run_pair(&off, &on, &w1, &w2, &x, &y, &cx, &cy);
        free_work(&w1);
        free_work(&w2);
        make_work(&w1, chains, 9u);
        make_work(&w2, chains, 10u);
        run_pair(&off, &nt, &w1, &w2, &x, &y, &cx, &cy);
        free_work(&w1);
        free_work(&w2);
        make_work(&w1, chains, 11u);
        make_work(&w2, chains, 12u);
        run_pair(&off, &th, &w1, &w2, &x, &y, &cx, &cy);
        free_work(&w1);
        free_work(&w2);
    }
    printf("### KV events on the Commit path (hash-mode vllm)\n\n");
    printf("Allocate(%d) + Commit(%d, digests and token ids) + Release per chain, %zu new chains "
           "per run; the pool (32 MiB, 16 KiB blocks) is full, so every Allocate evicts and "
           "publishes BlockRemoved too. kv-events-flush-ms 1 (the default). Events off vs on: "
           "%d runs, each alternating the two daemons every 50 chains; the daemons on the last "
           "CPU, the client on the first. Every daemon gets the same Commits (token ids "
           "included); the events-on daemon publishes them with token ids "
           "(kv-events-token-ids, opt-in), a third one without (the default). With one CPU "
           "each, kv-events-thread auto runs the events on the loop thread; a fourth daemon "
           "has them on a thread of their own (on), which here takes turns with its loop "
           "thread on the one CPU.\n\n",
           CHAIN, CHAIN, chains, runs);
    measure(&off, &on, zctx, 1, runs, chains, 100,
            "Token ids on, with a subscriber draining the stream (this process):");
    measure(&off, &on, zctx, 0, runs, chains, 200,
            "Token ids on, without a subscriber (ZMQ drops each batch; kvd's own cost):");
    g_sub_ep = ep2;
    measure(&off, &nt, zctx, 1, runs, chains, 300,
            "Token ids off (kv-events-token-ids' default: no prompt text leaves the node), with a "
            "subscriber:");
    g_sub_ep = ep3;
    measure(&off, &th, zctx, 1, runs, chains, 400,
            "Token ids on, with a subscriber, the events on a thread of their own "
            "(kv-events-thread on):");
    zmq_ctx_term(zctx);
    bench_stop(off.pid);
    bench_stop(on.pid);
    bench_stop(nt.pid);
    bench_stop(th.pid);
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", g_dir);
    if (system(cmd) != 0) {
        fprintf(stderr, "cluster_bench: could not remove %s\n", g_dir);
    }
    return 0;
}
