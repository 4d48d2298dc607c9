/* consumer: the smallest engine outside the kvd source tree. It includes only the installed
 * kvclient.h and is built against the installed library with plain cc and pkg-config:
 *
 *   cc -o consumer consumer.c $(pkg-config --cflags --libs kvclient)
 *   cc -o consumer consumer.c $(pkg-config --static --cflags --libs kvclient) -static-libgcc \
 *      -Wl,-Bstatic -lkvclient -Wl,-Bdynamic      (or link libkvclient.a by path)
 *
 *   consumer SOCKET write|read [SEED]
 *
 * write computes a 4-block prompt's KV (a byte pattern from SEED) into leased blocks through
 * the mapping and commits it; read, in another process, looks the same prompt up and checks every
 * byte it maps. Exit 0 when all went as expected, 1 otherwise (the reason on stderr). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvclient.h"

#define NBLOCKS 4
#define TOKENS 16

static int fail(const char *what, kvc_err e) {
    fprintf(stderr, "consumer: %s: %s (%s)\n", what, kvc_err_name(e), kvc_last_error(NULL));
    return 1;
}

/* The value every (block, layer, kv, token, head, d) of the prompt holds. */
static uint16_t pattern(unsigned seed, uint32_t b, uint32_t l, int kv, uint32_t t, uint32_t h,
                        uint32_t d) {
    return (uint16_t)(seed * 7919u + b * 1009u + l * 101u + (unsigned)kv * 53u + t * 17u + h * 5u +
                      d);
}

int main(int argc, char **argv) {
    if (argc < 3 || (strcmp(argv[2], "write") != 0 && strcmp(argv[2], "read") != 0)) {
        fprintf(stderr, "usage: consumer SOCKET write|read [SEED]\n");
        return 2;
    }
    int writer = strcmp(argv[2], "write") == 0;
    unsigned seed = argc > 3 ? (unsigned)strtoul(argv[3], NULL, 10) : 1;
    kvc_options o;
    kvc_options_init(&o);
    o.socket_path = argv[1];
    o.client_name = writer ? "consumer-writer" : "consumer-reader";
    kvc_conn *c;
    kvc_err e = kvc_conn_open(&o, &c);
    if (e != KV_OK) {
        return fail("connect", e);
    }
    kvc_layout want = {.num_layers = 2,
                       .num_kv_heads = 2,
                       .head_dim = 64,
                       .tokens_per_block = TOKENS,
                       .dtype = KV_DTYPE_FP16,
                       .arrangement = KV_LAYER_MAJOR};
    kvc_pool *p;
    if ((e = kvc_pool_attach(c, "consumer-model", &want, &p)) != KV_OK) {
        return fail("attach", e);
    }
    const kvc_layout *ly = kvc_pool_layout(p);
    uint32_t tokens[NBLOCKS * TOKENS];
    for (uint32_t i = 0; i < NBLOCKS * TOKENS; i++) {
        tokens[i] = seed * 100000u + i;
    }
    kvc_hash128 hashes[NBLOCKS];
    size_t nh = 0;
    if ((e = kvc_pool_hash_tokens(p, NULL, 0, tokens, NBLOCKS * TOKENS, hashes, NBLOCKS, &nh)) !=
        KV_OK) {
        return fail("hash", e);
    }
    kvc_block blocks[NBLOCKS];
    size_t hit = 0;
    if ((e = kvc_lookup(p, hashes, nh, blocks, &hit)) != KV_OK) {
        return fail("lookup", e);
    }
    int bad = 0;
    if (writer) {
        if (hit != 0) {
            fprintf(stderr, "consumer: the prompt is already cached (%zu blocks)\n", hit);
            return 1;
        }
        if ((e = kvc_allocate(p, NBLOCKS, blocks)) != KV_OK) {
            return fail("allocate", e);
        }
    } else if (hit != NBLOCKS) {
        fprintf(stderr, "consumer: expected %d cached blocks, got %zu\n", NBLOCKS, hit);
        return 1;
    }
    for (uint32_t b = 0; b < NBLOCKS; b++) {
        for (uint32_t l = 0; l < ly->num_layers; l++) {
            for (int kv = KV_K; kv <= KV_V; kv++) {
                for (uint32_t t = 0; t < TOKENS; t++) {
                    for (uint32_t h = 0; h < ly->num_kv_heads; h++) {
                        uint16_t *x = kvc_pool_addr(p, blocks[b].id, l, kv, t, h);
                        if (x == NULL) {
                            fprintf(stderr, "consumer: block %u is not mapped\n", blocks[b].id);
                            return 1;
                        }
                        for (uint32_t d = 0; d < ly->head_dim; d++) {
                            uint16_t v = pattern(seed, b, l, kv, t, h, d);
                            if (writer) {
                                x[d] = v;
                            } else if (x[d] != v) {
                                bad++;
                            }
                        }
                    }
                }
            }
        }
    }
    if (writer) {
        kvc_commit_entry ent[NBLOCKS];
        for (uint32_t b = 0; b < NBLOCKS; b++) {
            ent[b].block = blocks[b];
            ent[b].hash = hashes[b];
            ent[b].parent = b == 0 ? KVC_NO_PARENT : blocks[b - 1].id;
        }
        kvc_block canonical[NBLOCKS];
        if ((e = kvc_commit(p, ent, NBLOCKS, canonical)) != KV_OK) {
            return fail("commit", e);
        }
    }
    if ((e = kvc_release(p, blocks, NBLOCKS)) != KV_OK) {
        return fail("release", e);
    }
    kvc_conn_close(c);
    if (bad != 0) {
        fprintf(stderr, "consumer: %d values differ from what the writer wrote\n", bad);
        return 1;
    }
    printf("consumer %s: %d blocks, %s\n", argv[2], NBLOCKS,
           writer ? "written and committed" : "hit, every byte as written");
    return 0;
}
