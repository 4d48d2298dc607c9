/* kvk_bench: GPU kernel benchmarks, printed as a markdown report (figures, not assertions).
 *  - copy_blocks device->device (layer-major -> block-major) vs cudaMemcpy D2D of the same bytes;
 *  - copy_blocks pinned host -> device (block-major host tier -> layer-major pool, read over UVA)
 *    vs cudaMemcpy H2D from pinned memory;
 *  - paged_decode_attention, batch 64 x 4096 tokens, 8 KV heads, 128 dim, 32 query heads, fp16,
 *    page size 16: effective bandwidth (K and V bytes read / time) vs the device's peak.
 * Not measured here: attention over daemon-exported (cuda-vmm) memory vs the worker's own; that
 * is tests/gpu/zero_copy_bench.c, which the GPU check bundle (tests/gpu/bundle/run.sh) runs as its
 * own step. Without a GPU it prints why and exits 0.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kvk_testutil.h"

#define CHECK(call)                                                                                \
    do {                                                                                           \
        kv_err rc_ = (call);                                                                       \
        if (rc_ != KV_OK) {                                                                        \
            fprintf(stderr, "%s: %s (%s)\n", #call, kv_err_name(rc_), kvk_last_error());           \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

enum { REPS = 20 };

/* Average milliseconds of REPS runs of body after one warm-up. */
#define TIME_MS(out_ms, body)                                                                      \
    do {                                                                                           \
        body;                                                                                      \
        CHECK(kvk_dev_sync());                                                                     \
        CHECK(kvk_timer_start(NULL));                                                              \
        for (int r_ = 0; r_ < REPS; r_++) {                                                        \
            body;                                                                                  \
        }                                                                                          \
        float ms_;                                                                                 \
        CHECK(kvk_timer_stop(NULL, &ms_));                                                         \
        (out_ms) = ms_ / REPS;                                                                     \
    } while (0)

static double gbps(double bytes, double ms) {
    return bytes / (ms * 1e-3) / 1e9;
}

static void bench_copy(void) {
    /* A 32-layer model, 8 KV heads of 128, fp16, 16-token blocks: 2 MiB per block. */
    kv_layout lm, bm;
    CHECK(kv_layout_init(32, 8, 128, 16, KV_DTYPE_FP16, KV_LAYER_MAJOR, &lm));
    CHECK(kv_layout_init(32, 8, 128, 16, KV_DTYPE_FP16, KV_BLOCK_MAJOR, &bm));
    const uint32_t nblocks = 320, ncopy = 256;
    uint64_t seg = kv_layout_segment_bytes(&lm, nblocks);
    uint64_t bytes = (uint64_t)ncopy * lm.block_bytes;
    void *a = NULL, *b = NULL, *h = NULL;
    CHECK(kvk_dev_alloc(seg, &a));
    CHECK(kvk_dev_alloc(seg, &b));
    CHECK(kvk_host_alloc_pinned(seg, &h));
    memset(h, 1, seg);
    CHECK(kvk_dev_memcpy(a, h, seg, KVK_H2D));
    int32_t ids[256], perm[256];
    for (uint32_t i = 0; i < ncopy; i++) {
        ids[i] = (int32_t)i;
        perm[i] = (int32_t)((i * 97) % ncopy); /* scattered destinations */
    }
    int32_t *dids = NULL, *dperm = NULL;
    CHECK(kvk_dev_alloc(sizeof(ids), (void **)&dids));
    CHECK(kvk_dev_alloc(sizeof(perm), (void **)&dperm));
    CHECK(kvk_dev_memcpy(dids, ids, sizeof(ids), KVK_H2D));
    CHECK(kvk_dev_memcpy(dperm, perm, sizeof(perm), KVK_H2D));
    kvk_cache ca, cb, chost;
    CHECK(kvk_cache_from_segment(&lm, (uintptr_t)a, nblocks, &ca));
    CHECK(kvk_cache_from_segment(&bm, (uintptr_t)b, nblocks, &cb));
    CHECK(kvk_cache_from_segment(&bm, (uintptr_t)h, nblocks, &chost));
    float t_kd, t_md, t_kh, t_mh;
    TIME_MS(t_kd, CHECK(kvk_copy_blocks_cuda(&ca, &cb, dids, dperm, ncopy, NULL)));
    TIME_MS(t_md, CHECK(kvk_dev_memcpy_async(b, a, bytes, KVK_D2D, NULL)));
    TIME_MS(t_kh, CHECK(kvk_copy_blocks_cuda(&chost, &ca, dids, dperm, ncopy, NULL)));
    TIME_MS(t_mh, CHECK(kvk_dev_memcpy_async(a, h, bytes, KVK_H2D, NULL)));
    printf("## copy_blocks\n\n");
    printf("%u blocks of %.1f MiB (32 layers, 8x128 fp16, 16 tokens), %.0f MiB per run, mean of "
           "%d runs. Bandwidth counts bytes copied once (read + write = 2x traffic on D2D).\n\n",
           ncopy, lm.block_bytes / 1048576.0, bytes / 1048576.0, REPS);
    printf("| path | copy_blocks GB/s | cudaMemcpy GB/s | ratio |\n|---|---|---|---|\n");
    printf("| device->device, layer-major -> block-major | %.1f | %.1f (D2D) | %.2f |\n",
           gbps(bytes, t_kd), gbps(bytes, t_md), t_md / t_kd);
    printf("| pinned host -> device, block-major -> layer-major | %.1f | %.1f (H2D pinned) | "
           "%.2f |\n\n",
           gbps(bytes, t_kh), gbps(bytes, t_mh), t_mh / t_kh);
    kvk_dev_free(a);
    kvk_dev_free(b);
    kvk_dev_free(dids);
    kvk_dev_free(dperm);
    kvk_host_free_pinned(h);
}

static void bench_decode(double peak) {
    const uint32_t batch = 64, len = 4096, page = 16, kvh = 8, dim = 128, qo = 32;
    const uint32_t pages_per = len / page, nblocks = batch * pages_per;
    kv_layout l;
    CHECK(kv_layout_init(1, kvh, dim, page, KV_DTYPE_FP16, KV_LAYER_MAJOR, &l));
    uint64_t seg = kv_layout_segment_bytes(&l, nblocks);
    void *mem = NULL;
    CHECK(kvk_dev_alloc(seg, &mem));
    /* Random contents: upload a random host chunk repeatedly. */
    uint64_t chunk = 64ull << 20;
    uint16_t *hbuf = malloc(chunk);
    tu_fill(KV_DTYPE_FP16, hbuf, chunk / 2, 1.0f);
    for (uint64_t o = 0; o < seg; o += chunk) {
        CHECK(kvk_dev_memcpy((char *)mem + o, hbuf, seg - o < chunk ? seg - o : chunk, KVK_H2D));
    }
    free(hbuf);
    kvk_cache c;
    CHECK(kvk_cache_from_segment(&l, (uintptr_t)mem, nblocks, &c));
    uint32_t lens[64];
    for (uint32_t i = 0; i < batch; i++) {
        lens[i] = len;
    }
    tu_pt t;
    if (tu_pt_init(&t, lens, batch, page, nblocks) != 0) {
        exit(1);
    }
    int32_t *d_indptr = NULL, *d_idx = NULL, *d_last = NULL;
    CHECK(kvk_dev_alloc((batch + 1) * 4, (void **)&d_indptr));
    CHECK(kvk_dev_alloc(nblocks * 4, (void **)&d_idx));
    CHECK(kvk_dev_alloc(batch * 4, (void **)&d_last));
    CHECK(kvk_dev_memcpy(d_indptr, t.indptr, (batch + 1) * 4, KVK_H2D));
    CHECK(kvk_dev_memcpy(d_idx, t.indices, nblocks * 4, KVK_H2D));
    CHECK(kvk_dev_memcpy(d_last, t.last, batch * 4, KVK_H2D));
    kvk_page_table pt = {d_indptr, d_idx, d_last, batch};
    uint64_t qn = (uint64_t)batch * qo * dim;
    void *q = NULL, *out = NULL, *ws = NULL;
    float *lse = NULL;
    CHECK(kvk_dev_alloc(qn * 2, &q));
    CHECK(kvk_dev_alloc(qn * 2, &out));
    CHECK(kvk_dev_alloc(batch * qo * 4, (void **)&lse));
    size_t wsb = kvk_paged_decode_attention_workspace_bytes(batch, qo, dim, 16);
    CHECK(kvk_dev_alloc(wsb, &ws));
    uint16_t *hq = malloc(qn * 2);
    tu_fill(KV_DTYPE_FP16, hq, qn, 1.0f);
    CHECK(kvk_dev_memcpy(q, hq, qn * 2, KVK_H2D));
    free(hq);
    kvk_decode_args a = {q, out, lse, KV_DTYPE_FP16, qo, 1.0f / sqrtf((float)dim)};
    float ms;
    TIME_MS(ms, CHECK(kvk_paged_decode_attention_cuda(&c, 0, &pt, &a, ws, wsb, NULL)));
    double kv_bytes = 2.0 * batch * len * kvh * dim * 2;
    double bw = gbps(kv_bytes, ms);
    printf("## paged_decode_attention\n\n");
    printf("batch %u x %u tokens, %u KV heads x %u dim, %u query heads (GQA %u), fp16, page %u, "
           "pages shuffled; %.0f MiB of K and V per call, mean of %d calls.\n\n",
           batch, len, kvh, dim, qo, qo / kvh, page, kv_bytes / 1048576.0, REPS);
    printf("| time per call | effective bandwidth | device peak | share of peak | share of "
           "4800 GB/s (H200 HBM3e) |\n|---|---|---|---|---|\n");
    printf("| %.3f ms | %.0f GB/s | %.0f GB/s | %.0f%% | %.0f%% |\n\n", ms, bw, peak,
           peak > 0 ? 100.0 * bw / peak : 0.0, 100.0 * bw / 4800.0);
    tu_pt_fini(&t);
    kvk_dev_free(mem);
    kvk_dev_free(d_indptr);
    kvk_dev_free(d_idx);
    kvk_dev_free(d_last);
    kvk_dev_free(q);
    kvk_dev_free(out);
    kvk_dev_free(lse);
    kvk_dev_free(ws);
}

int main(void) {
    char why[256];
    if (kvk_gpu_probe(why, sizeof(why)) == 0) {
        printf("kvk_bench: %s; nothing measured\n", why);
        return 0;
    }
    int sms = 0;
    double peak = 0;
    char name[128];
    CHECK(kvk_dev_info(&sms, &peak, name, sizeof(name)));
    printf("# Kernel benchmarks\n\nDevice: %s, %d SMs, peak memory bandwidth %.0f GB/s (from the "
           "reported memory clock and bus width).\n\n",
           name, sms, peak);
    bench_copy();
    bench_decode(peak);
    return 0;
}
