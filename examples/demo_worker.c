/* demo_worker: a pretend inference worker that shares a prompt prefix through kvd.
 *
 * It builds a prompt (a shared prefix, then a suffix of its own), prefills a kvc_seq (lookup of
 * the cached prefix, allocation of the rest), checks every cached K/V byte against the values
 * the worker that computed them must have written, writes K/V for the tokens it "computes",
 * commits the full blocks and releases the sequence. K/V values are a pure function of
 * (token id, position, layer, K|V, head, dim), so any worker can verify any other's bytes.
 * Exit status: 0 when every byte matched and the hit count is what --expect-hit-blocks says.
 * With --gpu 1 the pool is GPU memory (kvd --backend=cuda-vmm or cuda-ipc): the worker reaches it
 * as an engine would, through the CUDA driver (cuMemcpyDtoH / cuMemcpyHtoD of each block's
 * (layer, K|V) run; device addresses are never touched from the host), and synchronizes before
 * it commits, so its writes are in device memory before any other worker can hit them.
 *
 *   demo_worker --socket PATH --name B --prefix 512 --suffix 100 --suffix-seed 2
 *               [--expect-hit-blocks 32] [--gpu 1]
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/kv_cuda.h"
#include "kvclient.h"

#define LAYERS 4
#define HEADS 4
#define DIM 64
#define TPB 16

static void log_line(void *arg, int level, const char *id, const char *msg) {
    const char *name = arg;
    static const char *const lv[] = {"error", "warn", "info", "debug"};
    fprintf(stderr, "[%s] libkvclient %s %s %s\n", name, lv[level & 3], id, msg);
}

/* The value worker X writes for one element: deterministic in what defines the element. */
static uint16_t kv_value(uint32_t token, uint32_t pos, uint32_t layer, int kv, uint32_t head,
                         uint32_t d) {
    uint64_t x = (uint64_t)token * 0x9e3779b97f4a7c15ull ^ (uint64_t)pos << 32 ^
                 (uint64_t)layer << 24 ^ (uint64_t)kv << 20 ^ (uint64_t)head << 12 ^ d;
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    return (uint16_t)x;
}

static uint32_t prefix_token(uint32_t i) {
    return 1000 + (i * 7919u) % 30000u;
}

static uint32_t suffix_token(uint32_t seed, uint32_t i) {
    return 40000 + (seed * 104729u + i * 31u) % 20000u;
}

/* Address of (pos's block, layer, kv, token-in-block, head) through the engine's view: the
 * per-layer tensor when the pool has one, else the segment mapping. */
static uint16_t *elem(const kvc_pool *p, const kvc_seq *s, uint32_t pos, uint32_t layer, int kv,
                      uint32_t head) {
    const kv_layout *l = kvc_pool_layout(p);
    kvc_block b = kvc_seq_block(s, pos / TPB);
    uint8_t *base = kvc_pool_layer_base(p, layer, kv);
    if (base != NULL) {
        return (uint16_t *)(void *)(base + (uint64_t)b.id * l->kv_block_bytes +
                                    (pos % TPB) * l->token_bytes +
                                    (uint64_t)head * DIM * sizeof(uint16_t));
    }
    return kvc_pool_addr(p, b.id, layer, kv, pos % TPB, head);
}

/* The GPU mode's driver (loaded once, device 0's primary context current). */
static kv_cuda cu;

/* Verifies (pos < cached) and writes (cached <= pos < n) the K/V of one (block, layer, kv) run
 * through a host copy: the run is kv_block_bytes of device memory at dev. */
static int gpu_run(uint8_t *dev, const kvc_pool *p, const uint32_t *prompt, uint32_t first,
                   uint32_t cached, uint32_t n, uint32_t layer, int kv, uint64_t *checked,
                   uint64_t *bad) {
    const kv_layout *l = kvc_pool_layout(p);
    uint16_t run[TPB * HEADS * DIM];
    if (cu.memcpy_dtoh(run, (kv_cu_deviceptr)(uintptr_t)dev, l->kv_block_bytes) != KV_CU_SUCCESS) {
        return -1;
    }
    int dirty = 0;
    for (uint32_t t = 0; t < TPB && first + t < n; t++) {
        uint32_t pos = first + t;
        for (uint32_t h = 0; h < HEADS; h++) {
            uint16_t *e = run + ((uint64_t)t * HEADS + h) * DIM;
            for (uint32_t d = 0; d < DIM; d++) {
                uint16_t want = kv_value(prompt[pos], pos, layer, kv, h, d);
                if (pos < cached) {
                    *bad += e[d] != want;
                    *checked += sizeof(uint16_t);
                } else {
                    e[d] = want;
                    dirty = 1;
                }
            }
        }
    }
    if (dirty &&
        cu.memcpy_htod((kv_cu_deviceptr)(uintptr_t)dev, run, l->kv_block_bytes) != KV_CU_SUCCESS) {
        return -1;
    }
    return 0;
}

int main(int argc, char **argv) {
    const char *sock = NULL;
    const char *name = "worker";
    uint32_t prefix = 512, suffix = 100, seed = 1;
    long expect_hits = -1;
    int gpu = 0;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (strcmp(argv[i], "--socket") == 0) {
            sock = argv[i + 1];
        } else if (strcmp(argv[i], "--name") == 0) {
            name = argv[i + 1];
        } else if (strcmp(argv[i], "--prefix") == 0) {
            prefix = (uint32_t)strtoul(argv[i + 1], NULL, 10);
        } else if (strcmp(argv[i], "--suffix") == 0) {
            suffix = (uint32_t)strtoul(argv[i + 1], NULL, 10);
        } else if (strcmp(argv[i], "--suffix-seed") == 0) {
            seed = (uint32_t)strtoul(argv[i + 1], NULL, 10);
        } else if (strcmp(argv[i], "--expect-hit-blocks") == 0) {
            expect_hits = strtol(argv[i + 1], NULL, 10);
        } else if (strcmp(argv[i], "--gpu") == 0) {
            gpu = atoi(argv[i + 1]) != 0;
        } else {
            fprintf(stderr, "usage: demo_worker --socket PATH [--name N] [--prefix T] "
                            "[--suffix T] [--suffix-seed S] [--expect-hit-blocks B] [--gpu 1]\n");
            return 2;
        }
    }
    if (gpu) {
        char why[256];
        kv_cuda_device dev;
        if (kv_cuda_load(NULL, &cu, why, sizeof(why)) != KV_OK ||
            kv_cuda_device_open(&cu, 0, &dev, why, sizeof(why)) != KV_OK) {
            fprintf(stderr, "[%s] --gpu: %s\n", name, why);
            return 1;
        }
    }
    uint32_t n = prefix + suffix;
    if (n == 0) {
        fprintf(stderr, "[%s] empty prompt\n", name);
        return 2;
    }
    uint32_t *prompt = malloc(n * sizeof(*prompt));
    if (prompt == NULL) {
        return 1;
    }
    for (uint32_t i = 0; i < n; i++) {
        prompt[i] = i < prefix ? prefix_token(i) : suffix_token(seed, i - prefix);
    }

    int rc = 1;
    kvc_options o;
    kvc_options_init(&o);
    o.socket_path = sock;
    o.client_name = name;
    o.log = log_line;
    o.log_arg = (void *)name;
    kvc_conn *c = NULL;
    kvc_pool *p = NULL;
    kvc_seq *s = NULL;
    kv_err err = kvc_conn_open(&o, &c);
    if (err != KV_OK) {
        fprintf(stderr, "[%s] cannot connect: %s\n", name, kv_strerror(err));
        goto out;
    }
    kv_layout l = {.num_layers = LAYERS,
                   .num_kv_heads = HEADS,
                   .head_dim = DIM,
                   .tokens_per_block = TPB,
                   .dtype = KV_DTYPE_FP16,
                   .arrangement = KV_LAYER_MAJOR};
    err = kvc_pool_attach(c, "demo-model", &l, &p);
    if (err == KV_OK) {
        err = kvc_seq_alloc(p, n, NULL, 0, &s);
    }
    size_t cached = 0;
    if (err == KV_OK) {
        err = kvc_seq_prefill(s, prompt, n, &cached);
    }
    if (err != KV_OK) {
        fprintf(stderr, "[%s] %s: %s\n", name, kv_err_name(err), kvc_last_error(c));
        goto out;
    }

    /* Verify the cached prefix byte for byte: another process wrote it into shared memory. */
    uint64_t checked = 0, bad = 0;
    for (uint32_t first = 0; gpu && first < n; first += TPB) {
        for (uint32_t layer = 0; layer < LAYERS; layer++) {
            for (int kv = KV_K; kv <= KV_V; kv++) {
                uint8_t *dev = (uint8_t *)elem(p, s, first, layer, kv, 0);
                if (dev == NULL || gpu_run(dev, p, prompt, first, (uint32_t)cached, n, layer, kv,
                                           &checked, &bad) != 0) {
                    fprintf(stderr, "[%s] a device copy of block %u failed\n", name, first / TPB);
                    goto out;
                }
            }
        }
    }
    /* The copies may still be in flight: they must be in device memory before the Commit lets
     * another worker hit these blocks (docs/GPU.md). */
    if (gpu && cu.ctx_synchronize() != KV_CU_SUCCESS) {
        fprintf(stderr, "[%s] cuCtxSynchronize failed\n", name);
        goto out;
    }
    for (uint32_t pos = 0; !gpu && pos < cached; pos++) {
        for (uint32_t layer = 0; layer < LAYERS; layer++) {
            for (int kv = KV_K; kv <= KV_V; kv++) {
                for (uint32_t h = 0; h < HEADS; h++) {
                    const uint16_t *e = elem(p, s, pos, layer, kv, h);
                    for (uint32_t d = 0; d < DIM; d++) {
                        bad += e[d] != kv_value(prompt[pos], pos, layer, kv, h, d);
                        checked += sizeof(uint16_t);
                    }
                }
            }
        }
    }
    /* "Compute" the rest: write K/V of tokens [cached, n). */
    for (uint32_t pos = (uint32_t)cached; !gpu && pos < n; pos++) {
        for (uint32_t layer = 0; layer < LAYERS; layer++) {
            for (int kv = KV_K; kv <= KV_V; kv++) {
                for (uint32_t h = 0; h < HEADS; h++) {
                    uint16_t *e = elem(p, s, pos, layer, kv, h);
                    for (uint32_t d = 0; d < DIM; d++) {
                        e[d] = kv_value(prompt[pos], pos, layer, kv, h, d);
                    }
                }
            }
        }
    }
    size_t hit_blocks = cached / TPB;
    size_t total_blocks = kvc_seq_nblocks(s);
    size_t committed = 0;
    err = kvc_seq_commit(s, n, &committed);
    if (err != KV_OK) {
        fprintf(stderr, "[%s] commit: %s: %s\n", name, kv_err_name(err), kvc_last_error(c));
        goto out;
    }
    uint64_t pool_hits = 0;
    (void)kvc_stat_get(c, kvc_pool_id(p), "pool.hit_blocks", &pool_hits);
    printf("[%s] prompt %u tokens (%zu blocks): blocks hit %zu, tokens saved %zu, allocated %zu, "
           "committed %zu; verified %" PRIu64 " shared bytes: %s (pool hit_blocks so far %" PRIu64
           ")\n",
           name, n, total_blocks, hit_blocks, cached, total_blocks - hit_blocks, committed, checked,
           bad == 0 ? "all matched" : "MISMATCH", pool_hits);
    if (bad != 0) {
        fprintf(stderr, "[%s] %" PRIu64 " of %" PRIu64 " shared elements differ\n", name, bad,
                checked / 2);
        goto out;
    }
    if (expect_hits >= 0 && (size_t)expect_hits != hit_blocks) {
        fprintf(stderr, "[%s] expected %ld hit blocks, got %zu\n", name, expect_hits, hit_blocks);
        goto out;
    }
    err = kvc_seq_release(s);
    if (err != KV_OK) {
        fprintf(stderr, "[%s] release: %s: %s\n", name, kv_err_name(err), kvc_last_error(c));
        goto out;
    }
    rc = 0;
out:
    kvc_seq_free(s);
    kvc_pool_detach(p);
    kvc_conn_close(c);
    free(prompt);
    return rc;
}
