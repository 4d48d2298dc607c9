/* rpc_bench: round-trip latency and throughput of kvd's client protocol through libkvclient,
 * beside two baselines measured in the same run on the same machine:
 *  - echo: a raw Unix-socket echo between two processes that sends and returns exactly the
 *    bytes of the kvd request and reply frames (the floor any Unix-socket RPC can reach);
 *  - redis: redis-server on a Unix socket (started here with a temporary config), PING for
 *    Ping and MGET of 128 keys (a prefix index kept in Redis) for Lookup, speaking RESP.
 * Operations: Ping, and Lookup of a 128-block cached prefix followed by its Release (the
 * latency column is the Lookup round trip; throughput counts lookups, releases included).
 * Each is run on 1 and 8 connections (one thread per connection), one request at a time
 * ("sync") and DEPTH requests in flight ("pipelined": latency is then per batch).
 * Prints markdown (bench/run.sh records it under "rpc" in bench/RESULTS.md).
 *
 *   rpc_bench --kvd bazel-bin/daemon/kvd [--redis redis-server] [--seconds 0.3]
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "bench/benchutil.h"
#include "common/kv_wire.h"
#include "daemon/core/duel.h"
#include "kvclient.h"

#define NBLK 128         /* blocks in the looked-up prefix */
#define DEPTH 32         /* requests in flight when pipelined */
#define MAXLAT (1 << 20) /* latencies kept per thread */
#define NCONN_MAX 8
#define REPS 5 /* runs per row; the best is kept */

enum { SYS_KVD, SYS_ECHO, SYS_REDIS, NSYS };
enum { OP_PING, OP_LOOKUP, OP_LOOKUP_D, NOP };
static const char *const sys_name[NSYS] = {"kvd", "echo", "redis"};
static const char *const op_name[NOP] = {"Ping", "Lookup 128", "Lookup 128 (deferred Release)"};
static const char *const redis_op[NOP] = {"PING", "MGET 128", "MGET 128"};

static double g_seconds = 0.3;
static char g_dir[64];
static char g_kvd_sock[100], g_echo_sock[100], g_redis_sock[100];
static kv_hash128 g_hashes[NBLK];
/* The duel rows: a second chain, g_hashes forked at its last block, so that exactly one of the
 * two is a request kvd's eviction duel picks (daemon/core/duel.h); the Lookups alternate them. */
static kv_hash128 g_fork[NBLK];
static int g_two_chains;
/* The duel rows: the first daemon of each pair runs with g_first_extra (NULL: none), and after a
 * pair's runs the second daemon's admin `stats` is read for its duel's counters. */
static const char *g_first_extra;
static uint64_t g_duel_sampled[2], g_duel_dropped[2]; /* [sync, pipelined] */

/* The duel's counters (sampled, dropped) of the daemon whose admin socket is path. */
static void duel_counts(const char *path, uint64_t *sampled, uint64_t *dropped) {
    if (bench_admin_stat(path, "duel", "sampled", sampled) != 0 ||
        bench_admin_stat(path, "duel", "dropped", dropped) != 0) {
        bench_die("duel: no duel in the daemon's admin stats");
    }
}
static size_t g_kvd_req[NOP], g_kvd_rep[NOP]; /* frame sizes, for the echo */
static size_t g_rel_req, g_rel_rep;           /* Release of the 128 blocks, and its reply */
static char *g_mget;                          /* RESP MGET command */
static size_t g_mget_len, g_mget_reply_len;

static void write_all(int fd, const void *b, size_t n) {
    const char *p = b;
    while (n > 0) {
        ssize_t k = write(fd, p, n);
        if (k <= 0) {
            if (k < 0 && errno == EINTR) {
                continue;
            }
            bench_die("write failed");
        }
        p += k;
        n -= (size_t)k;
    }
}

static void read_all(int fd, void *b, size_t n) {
    char *p = b;
    while (n > 0) {
        ssize_t k = read(fd, p, n);
        if (k <= 0) {
            if (k < 0 && errno == EINTR) {
                continue;
            }
            bench_die("read failed");
        }
        p += k;
        n -= (size_t)k;
    }
}

/* ---- echo server: reads [u32 request bytes][u32 reply bytes][payload], writes the reply */

static void echo_conn(int fd) {
    /* Reads what is there, answers every whole request in one write: a pipelining peer gets
     * its replies in bulk, as from any server that batches its output. */
    static char in[1 << 16], out[1 << 20];
    size_t len = 0;
    for (;;) {
        ssize_t k = read(fd, in + len, sizeof(in) - len);
        if (k <= 0) {
            return;
        }
        len += (size_t)k;
        size_t off = 0, olen = 0;
        while (len - off >= 8) {
            uint32_t hdr[2];
            memcpy(hdr, in + off, sizeof(hdr));
            if (len - off < hdr[0] || olen + hdr[1] > sizeof(out)) {
                break;
            }
            memset(out + olen, 0, hdr[1]);
            olen += hdr[1];
            off += hdr[0];
        }
        memmove(in, in + off, len - off);
        len -= off;
        if (olen > 0) {
            write_all(fd, out, olen);
        }
    }
}

static pid_t echo_start(void) {
    int lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", g_echo_sock);
    if (lfd < 0 || bind(lfd, (struct sockaddr *)&sa, sizeof(sa)) < 0 || listen(lfd, 64) < 0) {
        bench_die("echo: cannot listen");
    }
    pid_t pid = fork();
    if (pid == 0) {
        signal(SIGCHLD, SIG_IGN);
        for (;;) {
            int c = accept(lfd, NULL, NULL);
            if (c < 0) {
                continue;
            }
            if (fork() == 0) {
                echo_conn(c);
                _exit(0);
            }
            close(c);
        }
    }
    close(lfd);
    bench_track(pid);
    return pid;
}

/* ---- servers ------------------------------------------------------------------------ */

/* ---- per-connection clients ----------------------------------------------------------- */

typedef struct client {
    int sys, op, pipelined;
    kvc_conn *conn;   /* kvd */
    kvc_pool *pool;   /* kvd */
    kvc_batch *batch; /* kvd, pipelined */
    kvc_block hits[DEPTH][NBLK];
    size_t nhit[DEPTH];
    int fd;                  /* echo, redis */
    char *req, *rep;         /* echo/redis request (repeated DEPTH times) and reply buffer */
    size_t req_len, rep_len; /* one request, one reply */
    float *lat;              /* latencies in microseconds */
    size_t nlat;
    uint64_t ops;
} client;

static void kvd_open(client *c) {
    kvc_options o;
    kvc_options_init(&o);
    o.socket_path = g_kvd_sock;
    o.client_name = "rpc_bench";
    kv_layout l = {.num_layers = 4,
                   .num_kv_heads = 8,
                   .head_dim = 128,
                   .tokens_per_block = 16,
                   .dtype = KV_DTYPE_FP16,
                   .arrangement = KV_LAYER_MAJOR};
    if (kvc_conn_open(&o, &c->conn) != KV_OK || kvc_pool_attach(c->conn, "bench", &l, &c->pool) ||
        kvc_batch_alloc(c->conn, &c->batch) != KV_OK) {
        bench_die("cannot open a kvd session");
    }
}

static void client_open(client *c) {
    if (c->sys == SYS_KVD) {
        kvd_open(c);
        return;
    }
    c->fd = bench_unix_connect(c->sys == SYS_ECHO ? g_echo_sock : g_redis_sock);
    if (c->fd < 0) {
        bench_die("cannot connect to a baseline server");
    }
    const char *one = NULL;
    uint32_t hdr[2] = {(uint32_t)g_kvd_req[c->op], (uint32_t)g_kvd_rep[c->op]};
    if (c->sys == SYS_ECHO) {
        c->req_len = g_kvd_req[c->op];
        c->rep_len = g_kvd_rep[c->op];
    } else if (c->op == OP_PING) {
        one = "*1\r\n$4\r\nPING\r\n";
        c->req_len = strlen(one);
        c->rep_len = strlen("+PONG\r\n");
    } else {
        one = g_mget;
        c->req_len = g_mget_len;
        c->rep_len = g_mget_reply_len;
    }
    c->req = calloc(DEPTH, c->req_len);
    c->rep = malloc(c->rep_len * DEPTH);
    for (int i = 0; i < DEPTH; i++) {
        if (one != NULL) {
            memcpy(c->req + (size_t)i * c->req_len, one, c->req_len);
        } else {
            memcpy(c->req + (size_t)i * c->req_len, hdr, sizeof(hdr));
        }
    }
}

static void client_close(client *c) {
    if (c->sys == SYS_KVD) {
        kvc_batch_free(c->batch);
        kvc_conn_close(c->conn);
    } else {
        close(c->fd);
        free(c->req);
        free(c->rep);
    }
}

/* One round (1 op, or DEPTH pipelined); returns ops done. */
static int round_once(client *c) {
    int n = c->pipelined ? DEPTH : 1;
    if (c->sys != SYS_KVD) {
        write_all(c->fd, c->req, c->req_len * (size_t)n);
        read_all(c->fd, c->rep, c->rep_len * (size_t)n);
        return n;
    }
    if (!c->pipelined) {
        if (c->op == OP_PING) {
            if (kvc_ping(c->conn, NULL, 0) != KV_OK) {
                bench_die("ping failed");
            }
            return 1;
        }
        if (kvc_lookup(c->pool, g_hashes, NBLK, c->hits[0], &c->nhit[0]) != KV_OK ||
            c->nhit[0] != NBLK) {
            bench_die("lookup failed or missed");
        }
        return 1;
    }
    kvc_batch_reset(c->batch);
    for (int i = 0; i < n; i++) {
        kv_err err = c->op == OP_PING ? kvc_batch_ping(c->batch, NULL, 0, NULL)
                                      : kvc_batch_lookup(c->batch, c->pool, g_hashes, NBLK,
                                                         c->hits[i], &c->nhit[i], NULL);
        if (err != KV_OK) {
            bench_die("queue failed");
        }
    }
    if (kvc_batch_run(c->batch) != KV_OK) {
        bench_die("batch failed");
    }
    for (int i = 0; i < n; i++) {
        if (kvc_batch_status(c->batch, (size_t)i) != KV_OK) {
            bench_die("batched request failed");
        }
    }
    return n;
}

/* Lookups are followed by their releases (not part of the latency, part of throughput).
 * OP_LOOKUP_D defers them (kvc_release_deferred): each rides ahead of the next round's first
 * request, whose latency therefore includes it (pipelined: kvc_batch_send sends them first in
 * a round trip of their own, as the batch of releases does). */
static void after_round(client *c) {
    if (c->sys != SYS_KVD || c->op == OP_PING) {
        return;
    }
    if (c->op == OP_LOOKUP_D) {
        for (int i = 0; i < (c->pipelined ? DEPTH : 1); i++) {
            if (kvc_release_deferred(c->pool, c->hits[i], c->nhit[i]) != KV_OK) {
                bench_die("deferred release failed");
            }
        }
        return;
    }
    if (!c->pipelined) {
        if (kvc_release(c->pool, c->hits[0], c->nhit[0]) != KV_OK) {
            bench_die("release failed");
        }
        return;
    }
    kvc_batch_reset(c->batch);
    for (int i = 0; i < DEPTH; i++) {
        if (kvc_batch_release(c->batch, c->pool, c->hits[i], c->nhit[i], NULL) != KV_OK) {
            bench_die("queue release failed");
        }
    }
    if (kvc_batch_run(c->batch) != KV_OK) {
        bench_die("release batch failed");
    }
}

static pthread_barrier_t g_barrier;

static void *client_run(void *arg) {
    client *c = arg;
    client_open(c);
    for (int i = 0; i < 50; i++) { /* warm up */
        round_once(c);
        after_round(c);
    }
    pthread_barrier_wait(&g_barrier);
    double end = bench_now_s() + g_seconds;
    double t0 = bench_now_s();
    while (t0 < end) {
        int n = round_once(c);
        double t1 = bench_now_s();
        after_round(c);
        if (c->nlat < MAXLAT) {
            c->lat[c->nlat++] = (float)((t1 - t0) * 1e6);
        }
        c->ops += (uint64_t)n;
        t0 = bench_now_s();
    }
    client_close(c);
    return NULL;
}

static int cmp_float(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

typedef struct result {
    double p50, p99, ops_per_s;
} result;

static result measure(int sys, int op, int nconn, int pipelined) {
    client cs[NCONN_MAX];
    pthread_t th[NCONN_MAX];
    memset(cs, 0, sizeof(cs));
    pthread_barrier_init(&g_barrier, NULL, (unsigned)nconn + 1);
    for (int i = 0; i < nconn; i++) {
        cs[i].sys = sys;
        cs[i].op = op;
        cs[i].pipelined = pipelined;
        cs[i].lat = malloc(MAXLAT * sizeof(float));
        pthread_create(&th[i], NULL, client_run, &cs[i]);
    }
    pthread_barrier_wait(&g_barrier);
    double t0 = bench_now_s();
    for (int i = 0; i < nconn; i++) {
        pthread_join(th[i], NULL);
    }
    double dt = bench_now_s() - t0;
    pthread_barrier_destroy(&g_barrier);
    size_t total = 0;
    uint64_t ops = 0;
    for (int i = 0; i < nconn; i++) {
        total += cs[i].nlat;
        ops += cs[i].ops;
    }
    float *all = malloc((total ? total : 1) * sizeof(float));
    size_t k = 0;
    for (int i = 0; i < nconn; i++) {
        memcpy(all + k, cs[i].lat, cs[i].nlat * sizeof(float));
        k += cs[i].nlat;
        free(cs[i].lat);
    }
    qsort(all, total, sizeof(float), cmp_float);
    result r = {0};
    if (total > 0) {
        r.p50 = all[total / 2];
        r.p99 = all[(size_t)((double)total * 0.99)];
    }
    r.ops_per_s = (double)ops / dt;
    free(all);
    return r;
}

/* ---- setup ---------------------------------------------------------------------------- */

/* Commits the 128-block prefix every Lookup finds, and measures kvd's frame sizes. */
static void kvd_prepare(void) {
    client c = {0};
    kvd_open(&c);
    uint32_t tok[NBLK * 16];
    for (int i = 0; i < NBLK * 16; i++) {
        tok[i] = 17 + (uint32_t)i * 13;
    }
    size_t nh;
    kvc_block b[NBLK], canon[NBLK];
    kvc_commit_entry e[NBLK];
    if (kvc_pool_hash_tokens(c.pool, NULL, 0, tok, NBLK * 16, g_hashes, NBLK, &nh) != KV_OK ||
        kvc_allocate(c.pool, NBLK, b) != KV_OK) {
        bench_die("prepare: allocate failed");
    }
    for (int i = 0; i < NBLK; i++) {
        e[i].block = b[i];
        e[i].hash = g_hashes[i];
        e[i].parent = i == 0 ? KVC_NO_PARENT : b[i - 1].id;
    }
    if (kvc_commit(c.pool, e, NBLK, canon) != KV_OK || kvc_release(c.pool, canon, NBLK)) {
        bench_die("prepare: commit failed");
    }
    /* Frame sizes as the library sends and the daemon answers them. */
    uint64_t epoch = kvc_conn_boot_epoch(c.conn);
    Kvd__Envelope env = KVD__ENVELOPE__INIT;
    env.id = 1000000;
    env.boot_epoch = epoch;
    Kvd__Ping ping = KVD__PING__INIT;
    ping.nonce = 0x9e3779b97f4a7c15ull;
    env.body_case = KVD__ENVELOPE__BODY_PING;
    env.ping = &ping;
    g_kvd_req[OP_PING] = kv_wire_frame_size(&env);
    Kvd__Pong pong = KVD__PONG__INIT;
    pong.nonce = ping.nonce;
    env.body_case = KVD__ENVELOPE__BODY_PONG;
    env.pong = &pong;
    g_kvd_rep[OP_PING] = kv_wire_frame_size(&env);
    /* libkvclient and kvd exchange packed lists (PROTOCOL.md 6, Packed lists). */
    uint8_t hp[NBLK * KV_WIRE_HASH_BYTES], rp[NBLK * KV_WIRE_BLOCK_BYTES];
    for (int i = 0; i < NBLK; i++) {
        kv_wire_hash_put(hp, (size_t)i, g_hashes[i].lo, g_hashes[i].hi);
        kv_wire_block_put(rp, (size_t)i, canon[i].id, canon[i].gen);
    }
    Kvd__Lookup lk = KVD__LOOKUP__INIT;
    lk.pool_id = kvc_pool_id(c.pool);
    lk.hashes_packed.data = hp;
    lk.hashes_packed.len = sizeof(hp);
    env.body_case = KVD__ENVELOPE__BODY_LOOKUP;
    env.lookup = &lk;
    g_kvd_req[OP_LOOKUP] = kv_wire_frame_size(&env);
    Kvd__LookupReply lr = KVD__LOOKUP_REPLY__INIT;
    lr.blocks_packed.data = rp;
    lr.blocks_packed.len = sizeof(rp);
    env.body_case = KVD__ENVELOPE__BODY_LOOKUP_REPLY;
    env.lookup_reply = &lr;
    g_kvd_rep[OP_LOOKUP] = kv_wire_frame_size(&env);
    Kvd__Release rl = KVD__RELEASE__INIT;
    rl.pool_id = lk.pool_id;
    rl.blocks_packed.data = rp;
    rl.blocks_packed.len = sizeof(rp);
    env.body_case = KVD__ENVELOPE__BODY_RELEASE;
    env.release = &rl;
    g_rel_req = kv_wire_frame_size(&env);
    Kvd__ReleaseReply rr = KVD__RELEASE_REPLY__INIT;
    env.body_case = KVD__ENVELOPE__BODY_RELEASE_REPLY;
    env.release_reply = &rr;
    g_rel_rep = kv_wire_frame_size(&env);
    /* The echo of a deferred round moves the Release and the Lookup in one round trip. */
    g_kvd_req[OP_LOOKUP_D] = g_kvd_req[OP_LOOKUP] + g_rel_req;
    g_kvd_rep[OP_LOOKUP_D] = g_kvd_rep[OP_LOOKUP] + g_rel_rep;
    client_close(&c);
}

/* Keys are the hex block hashes, values 8-byte block handles, as a Redis-kept index would. */
static void redis_prepare(void) {
    int fd = bench_unix_connect(g_redis_sock);
    if (fd < 0) {
        bench_die("redis: cannot connect");
    }
    size_t cap = 64 + NBLK * 64;
    g_mget = malloc(cap);
    int n = snprintf(g_mget, cap, "*%d\r\n$4\r\nMGET\r\n", NBLK + 1);
    char cmd[256];
    for (int i = 0; i < NBLK; i++) {
        char key[33];
        kv_hash_hex(g_hashes[i], key);
        n += snprintf(g_mget + n, cap - (size_t)n, "$32\r\n%s\r\n", key);
        int m =
            snprintf(cmd, sizeof(cmd), "*3\r\n$3\r\nSET\r\n$32\r\n%s\r\n$8\r\n%08d\r\n", key, i);
        write_all(fd, cmd, (size_t)m);
        char ok[5];
        read_all(fd, ok, 5); /* +OK\r\n */
        if (memcmp(ok, "+OK\r\n", 5) != 0) {
            bench_die("redis: SET failed");
        }
    }
    g_mget_len = (size_t)n;
    /* *128\r\n then 128 x ($8\r\n + 8 bytes + \r\n) */
    g_mget_reply_len = strlen("*128\r\n") + NBLK * (4 + 8 + 2);
    write_all(fd, g_mget, g_mget_len);
    char *rep = malloc(g_mget_reply_len);
    read_all(fd, rep, g_mget_reply_len);
    if (memcmp(rep, "*128\r\n$8\r\n00000000\r\n", 20) != 0) {
        bench_die("redis: MGET reply is not what the benchmark expects");
    }
    free(rep);
    close(fd);
}

/* ---- tenancy: cost of the tenancy checks (owner: tenancy; docs/TENANCY.md) ------------------
 * Two more kvd instances: one with no tenants file (every session is tenant uid-N, one tenant),
 * one with a tenants file of 100 token tenants, each with a quota line, and 100 sessions open
 * (one per tenant, each with its own pool holding the prefix). The measured session does sync and
 * pipelined Lookup-128 + Release on its own pool in both, so the difference is what 100 tenants,
 * 100 pools and the quota checks cost a request. Measured on TEN_PAIRS fresh pairs of such
 * instances; the figure is the median of the pairs' ratios. */

#define TEN_N 100
#define TEN_PAIRS 5 /* fresh daemon pairs */

typedef struct ten_result {
    double one[2], many[2];          /* [sync, pipelined]: median over pairs of best ops/s */
    double ratio[2];                 /* median over pairs of many / one */
    double pair_ratio[2][TEN_PAIRS]; /* each pair's many / one */
} ten_result;

static void ten_open(const char *sock, int tenant, kvc_conn **conn, kvc_pool **pool) {
    char tok[64];
    snprintf(tok, sizeof(tok), "rpc-bench-tenant-token-%03d-xxxxxxxx", tenant);
    kvc_options o;
    kvc_options_init(&o);
    o.socket_path = sock;
    o.client_name = "rpc_bench_tenancy";
    if (tenant >= 0) {
        o.token = tok;
        o.token_len = strlen(tok);
    }
    kv_layout l = {.num_layers = 4,
                   .num_kv_heads = 8,
                   .head_dim = 128,
                   .tokens_per_block = 16,
                   .dtype = KV_DTYPE_FP16,
                   .arrangement = KV_LAYER_MAJOR};
    if (kvc_conn_open(&o, conn) != KV_OK || kvc_pool_attach(*conn, "bench", &l, pool) != KV_OK) {
        bench_die("tenancy: cannot open a kvd session");
    }
    kvc_block b[NBLK], canon[NBLK];
    kvc_commit_entry e[NBLK];
    if (kvc_allocate(*pool, NBLK, b) != KV_OK) {
        bench_die("tenancy: allocate failed");
    }
    for (int i = 0; i < NBLK; i++) {
        e[i].block = b[i];
        e[i].hash = g_hashes[i];
        e[i].parent = i == 0 ? KVC_NO_PARENT : b[i - 1].id;
    }
    if (kvc_commit(*pool, e, NBLK, canon) != KV_OK || kvc_release(*pool, canon, NBLK) != KV_OK) {
        bench_die("tenancy: commit failed");
    }
    if (g_two_chains) { /* the fork's last block, its parent the chain's last but one */
        kvc_block hit[NBLK], nb;
        size_t nhit = 0;
        if (kvc_lookup(*pool, g_fork, NBLK - 1, hit, &nhit) != KV_OK || nhit != NBLK - 1 ||
            kvc_allocate(*pool, 1, &nb) != KV_OK) {
            bench_die("duel: fork lookup failed");
        }
        kvc_commit_entry fe = {.block = nb, .hash = g_fork[NBLK - 1], .parent = hit[NBLK - 2].id};
        kvc_block fc;
        if (kvc_commit(*pool, &fe, 1, &fc) != KV_OK || kvc_release(*pool, &fc, 1) != KV_OK ||
            kvc_release(*pool, hit, NBLK - 1) != KV_OK) {
            bench_die("duel: fork commit failed");
        }
    }
}

/* Lookup-128 + Release for g_seconds; sync or DEPTH pipelined. Returns ops/s. */
static double ten_run(kvc_conn *conn, kvc_pool *pool, int pipelined) {
    static kvc_block hits[DEPTH][NBLK];
    size_t nhit[DEPTH];
    kvc_batch *b;
    if (kvc_batch_alloc(conn, &b) != KV_OK) {
        bench_die("tenancy: batch");
    }
    uint64_t ops = 0;
    double t0 = bench_now_s(), t = t0;
    while (t - t0 < g_seconds) {
        int n = pipelined ? DEPTH : 1;
        kvc_batch_reset(b);
        for (int i = 0; i < n; i++) {
            const kv_hash128 *hs = g_two_chains && (ops + (uint64_t)i) % 2 ? g_fork : g_hashes;
            if (kvc_batch_lookup(b, pool, hs, NBLK, hits[i], &nhit[i], NULL) != KV_OK) {
                bench_die("tenancy: lookup");
            }
        }
        if (kvc_batch_run(b) != KV_OK) {
            bench_die("tenancy: lookup batch");
        }
        kvc_batch_reset(b);
        for (int i = 0; i < n; i++) {
            if (nhit[i] != NBLK || kvc_batch_release(b, pool, hits[i], NBLK, NULL) != KV_OK) {
                bench_die("tenancy: lookup missed");
            }
        }
        if (kvc_batch_run(b) != KV_OK) {
            bench_die("tenancy: release batch");
        }
        ops += (uint64_t)n;
        t = bench_now_s();
    }
    kvc_batch_free(b);
    return (double)ops / (t - t0);
}

/* One pair of fresh daemons, the second with the flags extra[0..2) (NULL entries: none):
 * best of REPS interleaved runs per mode of one session of each into one[2], many[2]. With
 * tenants, the second daemon gets TEN_N token tenants with quotas, each with a session and a
 * pool, and the last one made is measured; else one session. */
static void pair_run(const char *kvd, int pair, const char *tag, const char *const extra[2],
                     int tenants, double one[2], double many[2]) {
    char sock1[100], sockn[100], f1[160], fn[160];
    snprintf(sock1, sizeof(sock1), "%s/kvd-a-%s-%d.sock", g_dir, tag, pair);
    snprintf(sockn, sizeof(sockn), "%s/kvd-b-%s-%d.sock", g_dir, tag, pair);
    snprintf(f1, sizeof(f1), "--socket=%s", sock1);
    snprintf(fn, sizeof(fn), "--socket=%s", sockn);
    char a1[160], an[160]; /* each daemon's admin socket, beside its client socket */
    snprintf(a1, sizeof(a1), "--admin-socket=%s/admin-a-%s-%d.sock", g_dir, tag, pair);
    snprintf(an, sizeof(an), "--admin-socket=%s/admin-b-%s-%d.sock", g_dir, tag, pair);
    char *argv1[] = {(char *)kvd,        f1, "--log-level=warn",    "--segment-bytes=4M",
                     "--pool-memory=4G", a1, (char *)g_first_extra, NULL};
    char *argvn[] = {
        (char *)kvd, fn,  "--log-level=warn", "--segment-bytes=4M", "--pool-memory=4G", an, NULL,
        NULL,        NULL};
    for (int i = 0, at = 6; i < 2; i++) {
        if (extra[i] != NULL) {
            argvn[at++] = (char *)extra[i];
        }
    }
    /* Same placement for both daemons: they run on the last CPU (inherited from this process at
     * fork) and the measuring client on CPU 0. Unpinned, the scheduler's sticky choice of
     * sharing a core with the client or not moved one pair's sync ratio by 10-15%. */
    cpu_set_t all, last, first;
    int pinned = sched_getaffinity(0, sizeof(all), &all) == 0 && CPU_COUNT(&all) >= 2;
    if (pinned) {
        int lo = -1, hi = -1;
        for (int cpu = 0; cpu < CPU_SETSIZE; cpu++) {
            if (CPU_ISSET(cpu, &all)) {
                lo = lo < 0 ? cpu : lo;
                hi = cpu;
            }
        }
        CPU_ZERO(&last);
        CPU_SET(hi, &last);
        CPU_ZERO(&first);
        CPU_SET(lo, &first);
        pinned = sched_setaffinity(0, sizeof(last), &last) == 0;
    }
    pid_t p1, pn; /* which starts first alternates too */
    if (pair % 2 == 0) {
        p1 = bench_spawn(argv1);
        pn = bench_spawn(argvn);
    } else {
        pn = bench_spawn(argvn);
        p1 = bench_spawn(argv1);
    }
    if (pinned && sched_setaffinity(0, sizeof(first), &first) != 0) {
        bench_die("tenancy: sched_setaffinity: %s", strerror(errno));
    }
    bench_wait_socket(sock1, p1);
    bench_wait_socket(sockn, pn);
    kvc_conn *c1, *cn[TEN_N];
    kvc_pool *q1, *qn[TEN_N];
    ten_open(sock1, -1, &c1, &q1);
    int nb = tenants ? TEN_N : 1;
    for (int i = 0; i < nb; i++) {
        ten_open(sockn, tenants ? i : -1, &cn[i], &qn[i]);
    }
    /* Interleaved, best of REPS, as the rows above; the measured tenant is the last one made.
     * Which daemon runs first alternates: on this machine the order alone moved the ratio by
     * 5-10% either way. */
    for (int pl = 0; pl < 2; pl++) {
        one[pl] = many[pl] = 0;
    }
    uint64_t duel_seen[2] = {0, 0}; /* the duel's counters after the last run */
    if (g_two_chains) {
        duel_counts(an + strlen("--admin-socket="), &duel_seen[0], &duel_seen[1]);
    }
    for (int rep = 0; rep < REPS; rep++) {
        for (int pl = 0; pl < 2; pl++) {
            double a, b;
            if ((rep + pair) % 2 == 0) {
                a = ten_run(c1, q1, pl);
                b = ten_run(cn[nb - 1], qn[nb - 1], pl);
            } else {
                b = ten_run(cn[nb - 1], qn[nb - 1], pl);
                a = ten_run(c1, q1, pl);
            }
            one[pl] = a > one[pl] ? a : one[pl];
            many[pl] = b > many[pl] ? b : many[pl];
            if (g_two_chains) { /* what the second daemon's duel did in this mode's runs */
                uint64_t sa, dr;
                duel_counts(an + strlen("--admin-socket="), &sa, &dr);
                g_duel_sampled[pl] += sa - duel_seen[0];
                g_duel_dropped[pl] += dr - duel_seen[1];
                duel_seen[0] = sa;
                duel_seen[1] = dr;
            }
        }
    }
    kvc_conn_close(c1);
    for (int i = 0; i < nb; i++) {
        kvc_conn_close(cn[i]);
    }
    bench_stop(p1);
    bench_stop(pn);
    if (pinned) {
        sched_setaffinity(0, sizeof(all), &all);
    }
}

/* TEN_PAIRS fresh pairs of daemons (pair_run): per mode, the medians over the pairs. */
static void pairs_loop(const char *kvd, const char *tag, const char *const extra[2], int tenants,
                       ten_result *t) {
    double one[2][TEN_PAIRS], many[2][TEN_PAIRS];
    for (int pair = 0; pair < TEN_PAIRS; pair++) {
        double o[2], m[2];
        pair_run(kvd, pair, tag, extra, tenants, o, m);
        for (int pl = 0; pl < 2; pl++) {
            one[pl][pair] = o[pl];
            many[pl][pair] = m[pl];
            t->pair_ratio[pl][pair] = m[pl] / o[pl];
        }
    }
    for (int pl = 0; pl < 2; pl++) {
        double r[TEN_PAIRS];
        memcpy(r, t->pair_ratio[pl], sizeof(r));
        t->ratio[pl] = bench_median(r, TEN_PAIRS);
        t->one[pl] = bench_median(one[pl], TEN_PAIRS);
        t->many[pl] = bench_median(many[pl], TEN_PAIRS);
    }
}

/* Two daemon processes differ by where the system places them (core, cache sets) as much as by
 * their work (callgrind counts the same instructions per Lookup in both), so the ratio is taken
 * over TEN_PAIRS fresh pairs and the median reported. */
static void tenancy_bench(const char *kvd, ten_result *t) {
    char tenants[128];
    snprintf(tenants, sizeof(tenants), "%s/tenants", g_dir);
    FILE *f = fopen(tenants, "w");
    if (f == NULL) {
        bench_die("tenancy: cannot write the tenants file");
    }
    for (int i = 0; i < TEN_N; i++) {
        char path[128];
        snprintf(path, sizeof(path), "%s/t%03d.token", g_dir, i);
        FILE *tok = fopen(path, "w");
        if (tok == NULL) {
            bench_die("tenancy: cannot write a token file");
        }
        fprintf(tok, "rpc-bench-tenant-token-%03d-xxxxxxxx\n", i);
        fclose(tok);
        fprintf(f, "tenant t%03d token-file=%s\n", i, path);
        fprintf(f, "quota t%03d max-held=100000 guarantee=64 max-pinned=1000 max-sessions=16\n", i);
    }
    fclose(f);
    const char *tf_extra[2] = {NULL, NULL};
    char tf[200];
    snprintf(tf, sizeof(tf), "--tenants-file=%s", tenants);
    tf_extra[0] = tf;
    pairs_loop(kvd, "ten", tf_extra, 1, t);
}

/* Each pair's ratio of mode pl, comma-separated, into out; returns the worst (lowest). */
static double pair_list(const ten_result *t, int pl, char *out, size_t len) {
    size_t at = 0;
    double worst = t->pair_ratio[pl][0];
    out[0] = '\0';
    for (int i = 0; i < TEN_PAIRS && at < len; i++) {
        worst = t->pair_ratio[pl][i] < worst ? t->pair_ratio[pl][i] : worst;
        at += (size_t)snprintf(out + at, len - at, "%s%.3f", i ? ", " : "", t->pair_ratio[pl][i]);
    }
    return worst;
}

static void tenancy_print(const ten_result *t) {
    printf("\nTenancy checks (Lookup-128 + Release on one session, 1 conn): one tenant vs %d "
           "token tenants with quotas, %d sessions and %d pools open. %d fresh pairs of daemons, "
           "each best of %d interleaved runs; kops/s and the ratio are medians over the pairs.\n\n",
           TEN_N, TEN_N, TEN_N, TEN_PAIRS, REPS);
    printf(
        "| mode | 1 tenant kops/s | %d tenants kops/s | ratio | each pair's ratio | within 5%% |\n",
        TEN_N);
    printf("|---|---:|---:|---:|---|---|\n");
    for (int pl = 0; pl < 2; pl++) {
        char pairs[96];
        (void)pair_list(t, pl, pairs, sizeof(pairs));
        printf("| %s | %.1f | %.1f | %.3f | %s | %s |\n", pl ? "pipelined" : "sync",
               t->one[pl] / 1e3, t->many[pl] / 1e3, t->ratio[pl], pairs,
               t->ratio[pl] >= 0.95 ? "yes" : "no");
    }
}

/* Lower tiers on (T1 and T2 configured, nothing demoted: the Lookups hit T0) against off: the
 * cost the tiers add to the Lookup path (issue 14's target: within 3%). */
static void tiers_rpc_bench(const char *kvd, ten_result *t) {
    char t2[200];
    snprintf(t2, sizeof(t2), "--tier2-path=%s/t2", g_dir);
    const char *extra[2] = {"--tier1-memory=1G", t2};
    pairs_loop(kvd, "tiers", extra, 0, t);
}

static void tiers_rpc_print(const ten_result *t) {
    printf("\nLower tiers (Lookup-128 + Release on one session, 1 conn): tiers off vs T1 and T2 "
           "on with nothing demoted (every Lookup hits T0). %d fresh pairs of daemons, each best "
           "of %d interleaved runs; kops/s and the ratio are medians over the pairs.\n\n",
           TEN_PAIRS, REPS);
    printf("| mode | tiers off kops/s | tiers on kops/s | ratio | each pair's ratio | within 3%% "
           "(worst pair) |\n");
    printf("|---|---:|---:|---:|---|---|\n");
    for (int pl = 0; pl < 2; pl++) {
        char pairs[96];
        double worst = pair_list(t, pl, pairs, sizeof(pairs));
        printf("| %s | %.1f | %.1f | %.3f | %s | %s |\n", pl ? "pipelined" : "sync",
               t->one[pl] / 1e3, t->many[pl] / 1e3, t->ratio[pl], pairs,
               worst >= 0.97 ? "yes" : "no");
    }
}

/* The eviction duel (evict-duel, on by default) against off: Lookups alternate two chains of which
 * the duel picks one, as it picks half of a real mix. Each pair: the first daemon without the
 * duel, the second with it (the ratio is on / off); the second's admin stats say how many picked
 * Lookups its loop ran through the minis and how many it dropped (the loop runs one a turn). */
static void duel_rpc_bench(const char *kvd, ten_result *t) {
    memcpy(g_fork, g_hashes, sizeof(g_fork));
    while (kvd_duel_picks(g_fork[NBLK - 1]) == kvd_duel_picks(g_hashes[NBLK - 1])) {
        g_fork[NBLK - 1].lo++;
    }
    g_two_chains = 1;
    g_first_extra = "--evict-duel=false";
    memset(g_duel_sampled, 0, sizeof(g_duel_sampled));
    memset(g_duel_dropped, 0, sizeof(g_duel_dropped));
    const char *extra[2] = {NULL, NULL};
    pairs_loop(kvd, "duel", extra, 0, t);
    g_first_extra = NULL;
    g_two_chains = 0;
}

static void duel_rpc_print(const ten_result *t) {
    printf("\nEviction duel (Lookup-128 + Release on one session, 1 conn; the Lookups alternate "
           "two chains of which the duel picks one, as it picks half of a real mix): evict-duel "
           "off vs on (the default: picked Lookups wait in a queue and the loop runs one a turn "
           "through the pool's two miniature pools). %d fresh pairs of daemons, each best of %d "
           "interleaved runs; kops/s and the ratio are medians over the pairs.\n\n",
           TEN_PAIRS, REPS);
    printf("| mode | duel off kops/s | duel on kops/s | on / off | each pair's on / off | worst "
           "pair |\n");
    printf("|---|---:|---:|---:|---|---:|\n");
    for (int pl = 0; pl < 2; pl++) {
        char pairs[96];
        double worst = pair_list(t, pl, pairs, sizeof(pairs));
        printf("| %s | %.1f | %.1f | %.3f | %s | %.3f |\n", pl ? "pipelined" : "sync",
               t->one[pl] / 1e3, t->many[pl] / 1e3, t->ratio[pl], pairs, worst);
    }
    printf("\nPicked Lookups of the duel-on daemons over all their runs (a waiting one runs in the "
           "loop runs one waiting a turn; past the queue's %d one is dropped):\n\n",
           KVD_DUEL_QUEUE);
    printf("| mode | picked | ran through the minis | dropped |\n|---|---:|---:|---:|\n");
    for (int pl = 0; pl < 2; pl++) {
        uint64_t picked = g_duel_sampled[pl] + g_duel_dropped[pl];
        printf("| %s | %llu | %llu (%.1f%%) | %llu |\n", pl ? "pipelined" : "sync",
               (unsigned long long)picked, (unsigned long long)g_duel_sampled[pl],
               picked ? 100.0 * (double)g_duel_sampled[pl] / (double)picked : 0.0,
               (unsigned long long)g_duel_dropped[pl]);
    }
}

/* ---- the Commit path: Allocate + Commit + Release of chains, pipelined ------------------- */

#define CP_CHAIN 32 /* blocks a chain */
#define CP_DEPTH 8  /* chains a round: 8 Allocates, then 8 Commits, then 8 Releases in flight */
#define CP_CONNS 2

/* Frame sizes (request, reply) of the round's three phases as libkvclient and kvd exchange
 * them: packed lists and the packed Commit (PROTOCOL.md 6). */
static size_t g_cp_req[3], g_cp_rep[3];
static _Atomic uint64_t g_cp_seq = (uint64_t)1 << 40; /* each connection's hashes start here */

typedef struct cp_client {
    int sys; /* SYS_KVD or SYS_ECHO */
    double secs;
    uint64_t blocks;
} cp_client;

static void cp_sizes(void) {
    uint8_t blocks[CP_CHAIN * KV_WIRE_BLOCK_BYTES], ents[CP_CHAIN * KV_WIRE_COMMIT_BYTES];
    memset(blocks, 0x5a, sizeof(blocks));
    memset(ents, 0x5a, sizeof(ents));
    Kvd__Envelope env = KVD__ENVELOPE__INIT;
    env.id = 1000000;
    env.boot_epoch = 0x123456789abcdefull;
    Kvd__Allocate a = KVD__ALLOCATE__INIT;
    a.pool_id = 1;
    a.count = CP_CHAIN;
    env.body_case = KVD__ENVELOPE__BODY_ALLOCATE;
    env.allocate = &a;
    g_cp_req[0] = kv_wire_frame_size(&env);
    Kvd__AllocateReply ar = KVD__ALLOCATE_REPLY__INIT;
    ar.blocks_packed.data = blocks;
    ar.blocks_packed.len = sizeof(blocks);
    env.body_case = KVD__ENVELOPE__BODY_ALLOCATE_REPLY;
    env.allocate_reply = &ar;
    g_cp_rep[0] = kv_wire_frame_size(&env);
    Kvd__Commit c = KVD__COMMIT__INIT;
    c.pool_id = 1;
    c.entries_packed.data = ents;
    c.entries_packed.len = sizeof(ents);
    env.body_case = KVD__ENVELOPE__BODY_COMMIT;
    env.commit = &c;
    g_cp_req[1] = kv_wire_frame_size(&env);
    Kvd__CommitReply cr = KVD__COMMIT_REPLY__INIT;
    cr.canonical_packed.data = blocks;
    cr.canonical_packed.len = sizeof(blocks);
    env.body_case = KVD__ENVELOPE__BODY_COMMIT_REPLY;
    env.commit_reply = &cr;
    g_cp_rep[1] = kv_wire_frame_size(&env);
    Kvd__Release r = KVD__RELEASE__INIT;
    r.pool_id = 1;
    r.blocks_packed.data = blocks;
    r.blocks_packed.len = sizeof(blocks);
    env.body_case = KVD__ENVELOPE__BODY_RELEASE;
    env.release = &r;
    g_cp_req[2] = kv_wire_frame_size(&env);
    Kvd__ReleaseReply rr = KVD__RELEASE_REPLY__INIT;
    env.body_case = KVD__ENVELOPE__BODY_RELEASE_REPLY;
    env.release_reply = &rr;
    g_cp_rep[2] = kv_wire_frame_size(&env);
}

/* One round of the echo: each phase's CP_DEPTH frames in one write, their replies read back. */
static void cp_echo_round(int fd, char *const req[3], char *rep) {
    for (int ph = 0; ph < 3; ph++) {
        write_all(fd, req[ph], g_cp_req[ph] * CP_DEPTH);
        read_all(fd, rep, g_cp_rep[ph] * CP_DEPTH);
    }
}

/* One round through kvd: CP_DEPTH new chains allocated, committed (each block's parent the one
 * before) and released, each phase one batch. */
static void cp_kvd_round(kvc_pool *p, kvc_batch *b, uint64_t *seq) {
    static __thread kvc_block blk[CP_DEPTH][CP_CHAIN], can[CP_DEPTH][CP_CHAIN];
    static __thread kvc_commit_entry e[CP_DEPTH][CP_CHAIN];
    kvc_batch_reset(b);
    for (int k = 0; k < CP_DEPTH; k++) {
        if (kvc_batch_allocate(b, p, CP_CHAIN, blk[k], NULL) != KV_OK) {
            bench_die("commit path: queue allocate failed");
        }
    }
    if (kvc_batch_run(b) != KV_OK) {
        bench_die("commit path: allocate failed");
    }
    kvc_batch_reset(b);
    for (int k = 0; k < CP_DEPTH; k++) {
        for (int i = 0; i < CP_CHAIN; i++) {
            e[k][i].block = blk[k][i];
            e[k][i].hash.lo = ++*seq;
            e[k][i].hash.hi = 0x636f6d6d6974ull; /* new hashes: every Commit stores */
            e[k][i].parent = i == 0 ? KVC_NO_PARENT : blk[k][i - 1].id;
        }
        if (kvc_batch_commit(b, p, e[k], CP_CHAIN, can[k], NULL) != KV_OK) {
            bench_die("commit path: queue commit failed");
        }
    }
    if (kvc_batch_run(b) != KV_OK) {
        bench_die("commit path: commit failed");
    }
    kvc_batch_reset(b);
    for (int k = 0; k < CP_DEPTH; k++) {
        if (kvc_batch_release(b, p, can[k], CP_CHAIN, NULL) != KV_OK) {
            bench_die("commit path: queue release failed");
        }
    }
    if (kvc_batch_run(b) != KV_OK) {
        bench_die("commit path: release failed");
    }
}

static void *cp_run(void *arg) {
    cp_client *c = arg;
    client k = {0};
    char *req[3] = {NULL, NULL, NULL}, *rep = NULL;
    int fd = -1;
    if (c->sys == SYS_KVD) {
        kvd_open(&k);
    } else {
        fd = bench_unix_connect(g_echo_sock);
        if (fd < 0) {
            bench_die("commit path: cannot connect to the echo");
        }
        size_t most = 0;
        for (int ph = 0; ph < 3; ph++) {
            req[ph] = calloc(CP_DEPTH, g_cp_req[ph]);
            for (int i = 0; i < CP_DEPTH; i++) {
                uint32_t hdr[2] = {(uint32_t)g_cp_req[ph], (uint32_t)g_cp_rep[ph]};
                memcpy(req[ph] + (size_t)i * g_cp_req[ph], hdr, sizeof(hdr));
            }
            most = g_cp_rep[ph] > most ? g_cp_rep[ph] : most;
        }
        rep = malloc(most * CP_DEPTH);
    }
    uint64_t seq = atomic_fetch_add(&g_cp_seq, (uint64_t)1 << 40); /* hashes no run made */
    for (int i = 0; i < 20; i++) { /* warm up: the pool fills, Allocates start evicting */
        if (c->sys == SYS_KVD) {
            cp_kvd_round(k.pool, k.batch, &seq);
        } else {
            cp_echo_round(fd, req, rep);
        }
    }
    pthread_barrier_wait(&g_barrier);
    double t0 = bench_now_s(), end = t0 + g_seconds, t = t0;
    while (t < end) {
        if (c->sys == SYS_KVD) {
            cp_kvd_round(k.pool, k.batch, &seq);
        } else {
            cp_echo_round(fd, req, rep);
        }
        c->blocks += CP_DEPTH * CP_CHAIN;
        t = bench_now_s();
    }
    c->secs = t - t0;
    if (c->sys == SYS_KVD) {
        kvc_batch_free(k.batch);
        kvc_conn_close(k.conn);
    } else {
        close(fd);
        for (int ph = 0; ph < 3; ph++) {
            free(req[ph]);
        }
        free(rep);
    }
    return NULL;
}

/* Blocks per second through sys over CP_CONNS connections. */
static double cp_measure(int sys) {
    cp_client cs[CP_CONNS];
    pthread_t th[CP_CONNS];
    memset(cs, 0, sizeof(cs));
    pthread_barrier_init(&g_barrier, NULL, CP_CONNS + 1);
    for (int i = 0; i < CP_CONNS; i++) {
        cs[i].sys = sys;
        pthread_create(&th[i], NULL, cp_run, &cs[i]);
    }
    pthread_barrier_wait(&g_barrier);
    double rate = 0;
    for (int i = 0; i < CP_CONNS; i++) {
        pthread_join(th[i], NULL);
        rate += (double)cs[i].blocks / cs[i].secs;
    }
    pthread_barrier_destroy(&g_barrier);
    return rate;
}

typedef struct cp_result {
    double kvd[REPS], echo[REPS];
} cp_result;

static void commit_path_bench(cp_result *r) {
    cp_sizes();
    for (int rep = 0; rep < REPS; rep++) {
        r->kvd[rep] = cp_measure(SYS_KVD);
        r->echo[rep] = cp_measure(SYS_ECHO);
    }
}

static void commit_path_print(const cp_result *r) {
    double ratio[REPS], k[REPS], e[REPS], lo = 1e9, hi = 0, klo = 1e18, khi = 0, elo = 1e18,
                                          ehi = 0;
    for (int i = 0; i < REPS; i++) {
        k[i] = r->kvd[i] / 1e3;
        e[i] = r->echo[i] / 1e3;
        ratio[i] = r->kvd[i] / r->echo[i];
        lo = ratio[i] < lo ? ratio[i] : lo;
        hi = ratio[i] > hi ? ratio[i] : hi;
        klo = k[i] < klo ? k[i] : klo;
        khi = k[i] > khi ? k[i] : khi;
        elo = e[i] < elo ? e[i] : elo;
        ehi = e[i] > ehi ? e[i] : ehi;
    }
    printf("\n#### The Commit path (Allocate + Commit + Release of %d-block chains)\n\n", CP_CHAIN);
    printf("%d connections, each %d chains a round: their %d Allocates in flight together, then "
           "the %d Commits (each block's parent the one before; new hashes, so every Commit "
           "stores and, the pool being full, every Allocate evicts), then the %d Releases. The "
           "echo moves the same frames in the same three round trips (%zu/%zu, %zu/%zu, %zu/%zu "
           "B a request/reply: packed lists and the packed Commit, PROTOCOL.md 6). %d "
           "interleaved runs of %.1f s; median (min-max).\n\n",
           CP_CONNS, CP_DEPTH, CP_DEPTH, CP_DEPTH, CP_DEPTH, g_cp_req[0], g_cp_rep[0], g_cp_req[1],
           g_cp_rep[1], g_cp_req[2], g_cp_rep[2], REPS, g_seconds);
    printf("| system | k blocks/s | x echo |\n|---|---:|---:|\n");
    printf("| kvd | %.0f (%.0f-%.0f) | %.2f (%.2f-%.2f) |\n", bench_median(k, REPS), klo, khi,
           bench_median(ratio, REPS), lo, hi);
    printf("| echo | %.0f (%.0f-%.0f) | 1 |\n", bench_median(e, REPS), elo, ehi);
}

/* Stops the three servers and removes the bench's directory. */
static void stop_servers(pid_t kvd_pid, pid_t redis_pid, pid_t echo_pid) {
    bench_stop(kvd_pid);
    bench_stop(redis_pid);
    bench_stop(echo_pid); /* killed by the signal: no exit status to check */
    char cmd[160];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", g_dir);
    if (system(cmd) != 0) {
        fprintf(stderr, "rpc_bench: could not remove %s\n", g_dir);
    }
}

int main(int argc, char **argv) {
    const char *kvd = "bazel-bin/daemon/kvd";
    const char *redis = "redis-server";
    const char *only = NULL;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (strcmp(argv[i], "--kvd") == 0) {
            kvd = argv[i + 1];
        } else if (strcmp(argv[i], "--redis") == 0) {
            redis = argv[i + 1];
        } else if (strcmp(argv[i], "--only") == 0) {
            only = argv[i + 1]; /* for profiling: measure one system, print its rows */
        } else if (strcmp(argv[i], "--seconds") == 0) {
            g_seconds = atof(argv[i + 1]);
        } else {
            bench_die("usage: rpc_bench [--kvd PATH] [--redis PATH] [--seconds S] [--only "
                      "kvd|echo|redis|tiers|commit|duel]");
        }
    }
    signal(SIGPIPE, SIG_IGN);
    snprintf(g_dir, sizeof(g_dir), "/tmp/rpc-bench-XXXXXX");
    if (mkdtemp(g_dir) == NULL) {
        bench_die("mkdtemp failed");
    }
    snprintf(g_kvd_sock, sizeof(g_kvd_sock), "%s/kvd.sock", g_dir);
    snprintf(g_echo_sock, sizeof(g_echo_sock), "%s/echo.sock", g_dir);
    snprintf(g_redis_sock, sizeof(g_redis_sock), "%s/redis.sock", g_dir);
    char conf[128];
    snprintf(conf, sizeof(conf), "%s/redis.conf", g_dir);
    FILE *f = fopen(conf, "w");
    if (f == NULL) {
        bench_die("cannot write the redis config");
    }
    fprintf(f,
            "port 0\nunixsocket %s\nunixsocketperm 700\nsave \"\"\nappendonly no\n"
            "dir %s\nlogfile \"\"\nloglevel warning\n",
            g_redis_sock, g_dir);
    fclose(f);

    char sockflag[160];
    snprintf(sockflag, sizeof(sockflag), "--socket=%s", g_kvd_sock);
    char *kvd_argv[] = {(char *)kvd, sockflag, "--log-level=warn", NULL};
    char *redis_argv[] = {(char *)redis, conf, NULL};
    pid_t kvd_pid = bench_spawn(kvd_argv);
    pid_t redis_pid = bench_spawn(redis_argv);
    pid_t echo_pid = echo_start();
    bench_wait_socket(g_kvd_sock, kvd_pid);
    bench_wait_socket(g_redis_sock, redis_pid);
    kvd_prepare();
    if (only != NULL &&
        (strcmp(only, "commit") == 0 || strcmp(only, "duel") == 0 || strcmp(only, "tiers") == 0)) {
        /* One section alone (its rows are in the full run's output too; tiers_bench.py records
         * the tiers comparison in the tiers section). */
        if (strcmp(only, "commit") == 0) {
            cp_result cp;
            commit_path_bench(&cp);
            commit_path_print(&cp);
        } else {
            ten_result t;
            if (strcmp(only, "duel") == 0) {
                duel_rpc_bench(kvd, &t);
                duel_rpc_print(&t);
            } else {
                tiers_rpc_bench(kvd, &t);
                tiers_rpc_print(&t);
            }
        }
        stop_servers(kvd_pid, redis_pid, echo_pid);
        return 0;
    }
    redis_prepare();

    static const int conns[2] = {1, 8};
    result r[NSYS][NOP][2][2];
    memset(r, 0, sizeof(r));
    /* Each run's kvd / Redis throughput, per row: the spread the table's best-of hides. */
    static double vs_redis[NOP][2][2][REPS];
    /* Shared build machines are noisy: every row runs REPS times, interleaved with the others,
     * and keeps its best run (highest throughput, with that run's latencies). */
    for (int rep = 0; rep < REPS; rep++) {
        for (int op = 0; op < NOP; op++) {
            for (int ci = 0; ci < 2; ci++) {
                for (int pl = 0; pl < 2; pl++) {
                    double run_ops[NSYS];
                    for (int sys = 0; sys < NSYS; sys++) {
                        result x = {1, 1, 1};
                        if (only == NULL || strcmp(only, sys_name[sys]) == 0) {
                            x = measure(sys, op, conns[ci], pl);
                        }
                        run_ops[sys] = x.ops_per_s;
                        if (x.ops_per_s > r[sys][op][ci][pl].ops_per_s) {
                            r[sys][op][ci][pl] = x;
                        }
                    }
                    vs_redis[op][ci][pl][rep] = run_ops[SYS_KVD] / run_ops[SYS_REDIS];
                }
            }
        }
    }
    ten_result ten, tiers, duel; /* tenancy, tiers and duel sections (below the tables) */
    cp_result cp;
    if (only == NULL || strcmp(only, "kvd") == 0) {
        commit_path_bench(&cp);
        tenancy_bench(kvd, &ten);
        tiers_rpc_bench(kvd, &tiers);
        duel_rpc_bench(kvd, &duel);
    }
    stop_servers(kvd_pid, redis_pid, echo_pid);

    printf("Frames: Ping %zu B request / %zu B reply; Lookup of %d hashes %zu B / %zu B reply; "
           "Release of its blocks %zu B / %zu B (the echo moves exactly these: for the deferred "
           "rows a Release and a Lookup in one round trip). Redis: PING, and MGET of %d 32-byte "
           "keys with 8-byte values (%zu B / %zu B). Pipelined = %d requests in flight; its "
           "latency is per batch. Lookup throughput includes each lookup's Release (kvd only): "
           "a round trip of its own (kvc_release), or sent ahead of the next Lookup in the same "
           "write (kvc_release_deferred; pipelined, ahead of the next batch in a round trip of "
           "its own). Each row: best of %d runs of %.1f s, interleaved. kvd runs with its "
           "defaults: its eviction duel (evict-duel) %s this chain, so %s.\n\n",
           g_kvd_req[OP_PING], g_kvd_rep[OP_PING], NBLK, g_kvd_req[OP_LOOKUP], g_kvd_rep[OP_LOOKUP],
           g_rel_req, g_rel_rep, NBLK, g_mget_len, g_mget_reply_len, DEPTH, REPS, g_seconds,
           kvd_duel_picks(g_hashes[NBLK - 1]) ? "picks" : "does not pick",
           kvd_duel_picks(g_hashes[NBLK - 1])
               ? "every Lookup of these rows also runs through its two miniature pools (a real "
                 "mix: half of them; the duel rows below)"
               : "no Lookup of these rows runs through its miniature pools (a real mix: half of "
                 "them; the duel rows below)");
    printf("| op | conns | mode | system | p50 us | p99 us | kops/s | x echo ops/s |\n");
    printf("|---|---:|---|---|---:|---:|---:|---:|\n");
    for (int op = 0; op < NOP; op++) {
        for (int ci = 0; ci < 2; ci++) {
            for (int pl = 0; pl < 2; pl++) {
                for (int sys = 0; sys < NSYS; sys++) {
                    result x = r[sys][op][ci][pl];
                    printf("| %s | %d | %s | %s | %.1f | %.1f | %.1f | %.2f |\n",
                           sys == SYS_REDIS ? redis_op[op] : op_name[op], conns[ci],
                           pl ? "pipelined" : "sync", sys_name[sys], x.p50, x.p99,
                           x.ops_per_s / 1e3, x.ops_per_s / r[SYS_ECHO][op][ci][pl].ops_per_s);
                }
            }
        }
    }
    /* kvd against Redis run by run (issue 19: kvd ahead on every row, the worse runs too). */
    printf("\nkvd / Redis throughput in each of the %d runs (the same runs as above, each kvd run "
           "beside the Redis run next to it):\n\n",
           REPS);
    printf("| op | conns | mode | median (min-max) | each run | ahead in every run |\n");
    printf("|---|---:|---|---|---|---|\n");
    int all_ahead = 1;
    for (int op = 0; op < NOP; op++) {
        for (int ci = 0; ci < 2; ci++) {
            for (int pl = 0; pl < 2; pl++) {
                double v[REPS], lo = 1e9, hi = 0;
                char each[REPS * 8 + 8] = "";
                size_t at = 0;
                for (int k = 0; k < REPS; k++) {
                    v[k] = vs_redis[op][ci][pl][k];
                    lo = v[k] < lo ? v[k] : lo;
                    hi = v[k] > hi ? v[k] : hi;
                    at += (size_t)snprintf(each + at, sizeof(each) - at, "%s%.2f", k ? ", " : "",
                                           v[k]);
                }
                all_ahead = all_ahead && lo > 1.0;
                printf("| %s | %d | %s | %.2f (%.2f-%.2f) | %s | %s |\n", op_name[op], conns[ci],
                       pl ? "pipelined" : "sync", bench_median(v, REPS), lo, hi, each,
                       lo > 1.0 ? "yes" : "no");
            }
        }
    }
    printf("\nkvd ahead of Redis on every row in every run: %s.\n", all_ahead ? "yes" : "no");
    result lk = r[SYS_KVD][OP_LOOKUP][0][0], le = r[SYS_ECHO][OP_LOOKUP][0][0],
           lr = r[SYS_REDIS][OP_LOOKUP][0][0];
    result tk = r[SYS_KVD][OP_LOOKUP][1][1], tr = r[SYS_REDIS][OP_LOOKUP][1][1];
    printf("\n| target | measured | ratio | met |\n|---|---|---:|---|\n");
    printf("| Lookup p50 <= 1.3x echo floor (1 conn, sync) | %.1f us vs %.1f us | %.2fx | %s |\n",
           lk.p50, le.p50, lk.p50 / le.p50, lk.p50 <= 1.3 * le.p50 ? "yes" : "no");
    printf("| Lookup p50 below Redis MGET-128 (1 conn, sync) | %.1f us vs %.1f us | %.2fx | %s "
           "|\n",
           lk.p50, lr.p50, lk.p50 / lr.p50, lk.p50 < lr.p50 ? "yes" : "no");
    printf("| Lookup throughput >= 2x Redis MGET-128 (8 conns, pipelined) | %.1f vs %.1f kops/s "
           "| %.2fx | %s |\n",
           tk.ops_per_s / 1e3, tr.ops_per_s / 1e3, tk.ops_per_s / tr.ops_per_s,
           tk.ops_per_s >= 2 * tr.ops_per_s ? "yes" : "no");
    if (only == NULL || strcmp(only, "kvd") == 0) {
        commit_path_print(&cp);
        tenancy_print(&ten);
        tiers_rpc_print(&tiers);
        duel_rpc_print(&duel);
    }
    return 0;
}
