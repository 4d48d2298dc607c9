/* kvd_trace_replay_kvc: a trace through kvd over libkvclient (trace_kvc.h). */
#include "daemon/testing/trace_kvc.h"

#include <stdio.h>
#include <stdlib.h>

kv_layout kvd_trace_kvc_layout(void) {
    kv_layout l = {.num_layers = 1,
                   .num_kv_heads = 1,
                   .head_dim = 64,
                   .tokens_per_block = 16,
                   .dtype = KV_DTYPE_FP16,
                   .arrangement = KV_BLOCK_MAJOR};
    return l;
}

void kvd_trace_kvc_flags(uint32_t cap, char seg[64], char mem[64]) {
    snprintf(seg, 64, "--segment-bytes=%llu", (unsigned long long)cap * 4096);
    /* The segment, 64 bytes of block record a block, a ghost slot or two, the pool's own. */
    snprintf(mem, 64, "--pool-memory=%llu", (unsigned long long)cap * (4096 + 96) + 65536);
}

kv_err kvd_trace_replay_kvc(kvc_pool *pool, const kvd_trace *t, kvd_trace_result *out) {
    kvd_trace_result res = {0, 0, 0};
    kv_hash128 *hs = calloc(t->max_len + 1, sizeof(*hs));
    kvc_block *b = calloc(t->max_len + 1, sizeof(*b));
    kvc_commit_entry *e = calloc(t->max_len + 1, sizeof(*e));
    kv_err err = hs == NULL || b == NULL || e == NULL ? KV_ENOMEM : KV_OK;
    for (uint32_t q = 0; q < t->nreq && err == KV_OK; q++) {
        uint32_t n = t->off[q + 1] - t->off[q];
        for (uint32_t i = 0; i < n; i++) {
            hs[i] = kvd_trace_hash(t->keys[t->off[q] + i]);
        }
        size_t nhit = 0;
        err = kvc_lookup(pool, hs, n, b, &nhit);
        if (err != KV_OK) {
            break;
        }
        res.query_blocks += n;
        res.hit_blocks += nhit;
        uint32_t need = n - (uint32_t)nhit;
        if (need > 0) {
            err = kvc_allocate(pool, need, b + nhit);
            for (uint32_t i = 0; i < need && err == KV_OK; i++) {
                uint32_t j = (uint32_t)nhit + i;
                e[i].block = b[j];
                e[i].hash = hs[j];
                e[i].parent = j == 0 ? KVC_NO_PARENT : b[j - 1].id;
            }
            if (err == KV_OK) {
                err = kvc_commit(pool, e, need, b + nhit);
            }
            for (uint32_t i = 0; i < need && err == KV_OK; i++) {
                res.duplicates += b[nhit + i].id != e[i].block.id;
            }
        }
        if (err == KV_OK) {
            err = kvc_release(pool, b, n);
        }
    }
    if (err == KV_OK) {
        *out = res;
    }
    free(hs);
    free(b);
    free(e);
    return err;
}
