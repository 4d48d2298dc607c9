/* python_c_baseline: the C side of bench/python_bench.py. It runs, through libkvclient, exactly
 * the loop the Python binding runs there, so that the ratio of the two is the binding's cost:
 *   single: kvc_lookup of a cached 128-block prefix, then kvc_release of the hits (two
 *           synchronous round trips per iteration);
 *   batch:  a kvc_batch of 32 such lookups (one run), then a batch of their 32 releases (one
 *           run), every request's status checked.
 * The prefix is published first (allocate, commit, release) if it is not cached yet, so the
 * Python and C sides, attached to the same pool, look up the same blocks. Prints one line,
 * "ns_per_iter N", the mean over the timed iterations after a warm-up.
 *
 *   python_c_baseline SOCKET MODEL_ID single|batch ITERATIONS
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvclient.h"

#define NBLK 128  /* blocks in the prefix */
#define TPB 16    /* tokens per block */
#define NBATCH 32 /* lookups per batch */

static void die(kvc_conn *c, const char *what, kv_err err) {
    fprintf(stderr, "python_c_baseline: %s: %s (%s)\n", what, kvc_err_name(err), kvc_last_error(c));
    exit(1);
}

static double now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

/* Publishes the prefix unless the daemon has it already. */
static void publish(kvc_conn *c, kvc_pool *p, const kv_hash128 *h) {
    kvc_block hit[NBLK], b[NBLK], canon[NBLK];
    size_t nhit;
    kv_err err = kvc_lookup(p, h, NBLK, hit, &nhit);
    if (err != KV_OK) {
        die(c, "lookup", err);
    }
    if (nhit > 0 && (err = kvc_release(p, hit, nhit)) != KV_OK) {
        die(c, "release", err);
    }
    if (nhit == NBLK) {
        return;
    }
    if ((err = kvc_allocate(p, NBLK, b)) != KV_OK) {
        die(c, "allocate", err);
    }
    kvc_commit_entry e[NBLK];
    for (size_t i = 0; i < NBLK; i++) {
        e[i].block = b[i];
        e[i].hash = h[i];
        e[i].parent = i == 0 ? KVC_NO_PARENT : b[i - 1].id;
    }
    if ((err = kvc_commit(p, e, NBLK, canon)) != KV_OK) {
        die(c, "commit", err);
    }
    if ((err = kvc_release(p, canon, NBLK)) != KV_OK) {
        die(c, "release", err);
    }
}

static void single_iter(kvc_conn *c, kvc_pool *p, const kv_hash128 *h, kvc_block *out) {
    size_t nhit;
    kv_err err = kvc_lookup(p, h, NBLK, out, &nhit);
    if (err != KV_OK) {
        die(c, "lookup", err);
    }
    if ((err = kvc_release(p, out, nhit)) != KV_OK) {
        die(c, "release", err);
    }
}

static kvc_block g_out[NBATCH][NBLK];
static size_t g_nhit[NBATCH];

static void batch_iter(kvc_conn *c, kvc_batch *b, kvc_pool *p, const kv_hash128 *h) {
    size_t idx[NBATCH];
    kv_err err;
    kvc_batch_reset(b);
    for (int i = 0; i < NBATCH; i++) {
        if ((err = kvc_batch_lookup(b, p, h, NBLK, g_out[i], &g_nhit[i], &idx[i])) != KV_OK) {
            die(c, "batch lookup", err);
        }
    }
    if ((err = kvc_batch_run(b)) != KV_OK) {
        die(c, "batch run", err);
    }
    for (int i = 0; i < NBATCH; i++) {
        if ((err = kvc_batch_status(b, idx[i])) != KV_OK) {
            die(c, "lookup status", err);
        }
    }
    kvc_batch_reset(b);
    for (int i = 0; i < NBATCH; i++) {
        if ((err = kvc_batch_release(b, p, g_out[i], g_nhit[i], &idx[i])) != KV_OK) {
            die(c, "batch release", err);
        }
    }
    if ((err = kvc_batch_run(b)) != KV_OK) {
        die(c, "batch run", err);
    }
    for (int i = 0; i < NBATCH; i++) {
        if ((err = kvc_batch_status(b, idx[i])) != KV_OK) {
            die(c, "release status", err);
        }
    }
}

int main(int argc, char **argv) {
    if (argc != 5 || (strcmp(argv[3], "single") != 0 && strcmp(argv[3], "batch") != 0)) {
        fprintf(stderr, "usage: python_c_baseline SOCKET MODEL_ID single|batch ITERATIONS\n");
        return 2;
    }
    int batch = strcmp(argv[3], "batch") == 0;
    long iters = atol(argv[4]);
    kvc_options o;
    kvc_options_init(&o);
    o.socket_path = argv[1];
    o.client_name = "python_c_baseline";
    kvc_conn *c;
    kv_err err = kvc_conn_open(&o, &c);
    if (err != KV_OK) {
        die(NULL, "connect", err);
    }
    /* The layout python_bench.py attaches. */
    kv_layout shape = {.num_layers = 2,
                       .num_kv_heads = 2,
                       .head_dim = 64,
                       .tokens_per_block = TPB,
                       .dtype = KV_DTYPE_FP16,
                       .arrangement = KV_LAYER_MAJOR};
    kvc_pool *p;
    if ((err = kvc_pool_attach(c, argv[2], &shape, &p)) != KV_OK) {
        die(c, "attach", err);
    }
    static uint32_t tokens[NBLK * TPB];
    for (uint32_t i = 0; i < NBLK * TPB; i++) {
        tokens[i] = i * 7 + 3; /* python_bench.py's prompt */
    }
    kv_hash128 h[NBLK];
    size_t nh;
    if ((err = kvc_pool_hash_tokens(p, NULL, 0, tokens, NBLK * TPB, h, NBLK, &nh)) != KV_OK) {
        die(c, "hash", err);
    }
    publish(c, p, h);
    kvc_batch *b = NULL;
    if (batch && (err = kvc_batch_alloc(c, &b)) != KV_OK) {
        die(c, "batch", err);
    }
    static kvc_block out[NBLK];
    long warm = iters / 10 + 1;
    double t0 = 0;
    for (long i = 0; i < warm + iters; i++) {
        if (i == warm) {
            t0 = now_ns();
        }
        if (batch) {
            batch_iter(c, b, p, h);
        } else {
            single_iter(c, p, h, out);
        }
    }
    double ns = (now_ns() - t0) / (double)iters;
    printf("ns_per_iter %.0f\n", ns);
    kvc_batch_free(b);
    kvc_pool_detach(p);
    kvc_conn_close(c);
    return 0;
}
