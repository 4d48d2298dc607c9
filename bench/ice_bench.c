/* ice_bench: IceCache's page selection, at kernel level on synthetic attention (no model, no
 * daemon). Printed after compress_bench's Zipage figures by `./dev bench compress`.
 *
 * 1. Retrieval of attention itself: 8192 keys drawn around 64 cluster centres in random order,
 *    with 48 keys planted near the query's direction at random positions. Pages of 16 tokens,
 *    either in token order or packed by key similarity (examples/engine/icecache.h); the
 *    top-k pages by kvk_page_select's bound. Share of the full attention mass the selected pages
 *    hold, and the relative error of the attention output over them, at 64 / 256 / 1024-token
 *    budgets; the best any 16-token selection could do (the top tokens themselves) beside.
 * 2. Decode step time of one layer (32 query / 8 KV heads, head_dim 128, fp16, one thread) at
 *    8K and 32K context: full attention over every page vs IceCache (selection of 16 pages per
 *    KV head from the summaries + one copy of the union of the selected pages from the offload
 *    buffer into the working set + attention over 2 sink, 2 window and the selected pages); the
 *    bytes moved per step.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench/benchutil.h"
#include "examples/engine/icecache.h"
#include "kernels/kvk.h"
#include "kernels/kvk_dtype.h"

static uint64_t rng = 0x2545F4914F6CDD1Dull;
static double urand(void) {
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (double)(rng >> 11) / 9007199254740992.0;
}
static float gauss(void) {
    double u = urand() + 1e-12, v = urand();
    return (float)(sqrt(-2 * log(u)) * cos(2 * M_PI * v));
}

enum { N = 8192, D = 64, P = 16, CL = 64, PLANT = 48, TRIALS = 8 };

/* A one-layer, one-head fp32 cache over keys/values in slot order. */
static kvk_cache cache_of(float *kv, uint32_t nblocks) {
    kvk_cache c = {.data = (uintptr_t)kv,
                   .block_stride = (int64_t)P * D * 4,
                   .section_stride = (int64_t)nblocks * P * D * 4,
                   .num_blocks = nblocks,
                   .num_sections = 2,
                   .tokens_per_block = P,
                   .num_kv_heads = 1,
                   .head_dim = D,
                   .dtype = KV_DTYPE_FP32};
    return c;
}

static void retrieval(void) {
    const uint32_t budgets[] = {64, 256, 1024};
    /* [budget][order+bound, order+centroid, packed+bound, packed+centroid, best tokens] */
    double mass[3][5] = {{0}}, err[3][5] = {{0}};
    float *keys = malloc((size_t)N * D * 4), *vals = malloc((size_t)N * D * 4);
    float *kv = malloc((size_t)2 * N * D * 4), *centres = malloc((size_t)CL * D * 4);
    float *summ = malloc((size_t)(N / P) * KVK_SUMMARY_FLOATS(1, 1, D) * 4);
    uint32_t *order = malloc(N * 4);
    double *p = malloc(N * sizeof(double));
    int32_t blocks[N / P], sel[N / P];
    for (int i = 0; i < N / P; i++) {
        blocks[i] = i;
    }
    for (int trial = 0; trial < TRIALS; trial++) {
        float q[D];
        for (int d = 0; d < D; d++) {
            q[d] = gauss();
        }
        for (int c = 0; c < CL * D; c++) {
            centres[c] = gauss();
        }
        for (int t = 0; t < N; t++) {
            int c = (int)(urand() * CL);
            for (int d = 0; d < D; d++) {
                keys[t * D + d] = centres[c * D + d] + 0.35f * gauss();
                vals[t * D + d] = gauss();
            }
        }
        for (int m = 0; m < PLANT; m++) {
            int t = (int)(urand() * N);
            for (int d = 0; d < D; d++) {
                keys[t * D + d] = 0.8f * q[d] + 0.35f * gauss();
            }
        }
        /* Full attention: probabilities and output. */
        double mx = -INFINITY, z = 0, full[D] = {0};
        for (int t = 0; t < N; t++) {
            double s = 0;
            for (int d = 0; d < D; d++) {
                s += (double)q[d] * keys[t * D + d];
            }
            p[t] = s / sqrt((double)D);
            mx = p[t] > mx ? p[t] : mx;
        }
        for (int t = 0; t < N; t++) {
            p[t] = exp(p[t] - mx);
            z += p[t];
        }
        for (int t = 0; t < N; t++) {
            p[t] /= z;
            for (int d = 0; d < D; d++) {
                full[d] += p[t] * vals[t * D + d];
            }
        }
        double fn = 0;
        for (int d = 0; d < D; d++) {
            fn += full[d] * full[d];
        }
        for (int packed = 0; packed < 2; packed++) {
            if (packed) {
                if (kve_ice_pack(keys, N, D, P, order) != KV_OK) {
                    bench_die("pack");
                }
            } else {
                for (int t = 0; t < N; t++) {
                    order[t] = (uint32_t)t;
                }
            }
            for (int i = 0; i < N; i++) {
                memcpy(kv + (size_t)i * D, keys + (size_t)order[i] * D, D * 4);
                memcpy(kv + (size_t)(N + i) * D, vals + (size_t)order[i] * D, D * 4);
            }
            kvk_cache c = cache_of(kv, N / P);
            if (kvk_page_summaries_cpu(&c, blocks, NULL, N / P, summ) != KV_OK) {
                bench_die("summaries: %s", kvk_last_error());
            }
            for (int v = 0; v < 6; v++) {
                int b = v % 3, mode = v / 3, col = packed * 2 + mode;
                kvk_select_args a = {.summaries = summ,
                                     .npages = N / P,
                                     .num_layers = 1,
                                     .layer = 0,
                                     .num_kv_heads = 1,
                                     .head_dim = D,
                                     .q = q,
                                     .num_qo_heads = 1,
                                     .k = budgets[b] / P,
                                     .mode = mode};
                if (kvk_page_select_cpu(&a, sel, NULL) != KV_OK) {
                    bench_die("select: %s", kvk_last_error());
                }
                double m = 0, o[D] = {0};
                for (uint32_t j = 0; j < a.k; j++) {
                    for (int i = sel[j] * P; i < (sel[j] + 1) * P; i++) {
                        m += p[order[i]];
                        for (int d = 0; d < D; d++) {
                            o[d] += p[order[i]] * vals[(size_t)order[i] * D + d];
                        }
                    }
                }
                double e = 0;
                for (int d = 0; d < D; d++) {
                    e += (o[d] / m - full[d]) * (o[d] / m - full[d]);
                }
                mass[b][col] += m / TRIALS;
                err[b][col] += sqrt(e / fn) / TRIALS;
            }
        }
        /* The best possible: the budget's largest probabilities themselves. */
        double *sorted = malloc(N * sizeof(double));
        memcpy(sorted, p, N * sizeof(double));
        for (int b = 0; b < 3; b++) {
            /* partial selection sort of the top budget (budget <= 1024) */
            double m = 0;
            for (uint32_t j = 0; j < budgets[b]; j++) {
                int best = (int)j;
                for (int t = (int)j + 1; t < N; t++) {
                    best = sorted[t] > sorted[best] ? t : best;
                }
                double x = sorted[j];
                sorted[j] = sorted[best];
                sorted[best] = x;
                m += sorted[j];
            }
            mass[b][4] += m / TRIALS;
            memcpy(sorted, p, N * sizeof(double));
        }
        free(sorted);
    }
    printf("### IceCache: retrieval of attention (synthetic, %d keys, %d planted matches)\n\n", N,
           PLANT);
    printf("Keys around %d cluster centres in random order plus %d keys near the query's "
           "direction at random positions; head_dim %d, pages of %d tokens, top-k pages by the "
           "summary bound; mean of %d queries.\n\n",
           CL, PLANT, D, P, TRIALS);
    printf("Attention mass the selected pages hold (output error relative to full attention "
           "in brackets):\n\n");
    printf("| budget (tokens) | token order, bound | token order, centroid | packed, bound | "
           "packed, centroid | best tokens |\n");
    printf("|---|---|---|---|---|---|\n");
    for (int b = 0; b < 3; b++) {
        printf("| %u | %.3f (%.3f) | %.3f (%.3f) | %.3f (%.3f) | %.3f (%.3f) | %.3f |\n",
               budgets[b], mass[b][0], err[b][0], mass[b][1], err[b][1], mass[b][2], err[b][2],
               mass[b][3], err[b][3], mass[b][4]);
    }
    printf("\n(\"best\" is the budget's largest attention probabilities themselves: the ceiling "
           "of any selection of that many tokens.)\n\n");
    free(keys), free(vals), free(kv), free(centres), free(summ), free(order), free(p);
}

/* 2. Decode step time of one layer. */
static void step_time(void) {
    enum { KH = 8, QH = 32, HD = 128, SINK = 2, WIN = 2, KSEL = 16, REPS = 9 };
    const uint32_t ctxs[] = {8192, 32768};
    printf("### IceCache: decode step time of one layer (%d query / %d KV heads, head_dim %d, "
           "fp16, 16-token pages, one thread)\n\n",
           QH, KH, HD);
    printf("| context | full attention | IceCache: select | copy | attention | total | speed-up | "
           "pages moved | bytes moved per step |\n");
    printf("|---|---|---|---|---|---|---|---|---|\n");
    kv_layout l;
    if (kv_layout_init(1, KH, HD, P, KV_DTYPE_FP16, KV_BLOCK_MAJOR, &l) != KV_OK) {
        bench_die("layout");
    }
    for (int ci = 0; ci < 2; ci++) {
        uint32_t np = ctxs[ci] / P, nw = SINK + WIN + KH * KSEL;
        /* The offload buffer (T1: every page) and the working set (sinks, window, staging). */
        uint8_t *off = aligned_alloc(64, (size_t)np * l.block_bytes);
        uint8_t *work = aligned_alloc(64, (size_t)nw * l.block_bytes);
        for (size_t i = 0; i < (size_t)np * l.block_bytes / 2; i++) {
            ((uint16_t *)off)[i] = kvk_f32_to_fp16(gauss() * 0.5f);
        }
        kvk_cache co, cw;
        kvk_cache_from_segment(&l, (uintptr_t)off, np, &co);
        kvk_cache_from_segment(&l, (uintptr_t)work, nw, &cw);
        int32_t *all = malloc(np * 4);
        for (uint32_t i = 0; i < np; i++) {
            all[i] = (int32_t)i;
        }
        float *summ = malloc((size_t)np * KVK_SUMMARY_FLOATS(1, KH, HD) * 4);
        kvk_page_summaries_cpu(&co, all, NULL, np, summ);
        float *q = malloc((size_t)QH * HD * 4), *out = malloc((size_t)QH * HD * 4);
        for (int i = 0; i < QH * HD; i++) {
            q[i] = gauss();
        }
        int32_t indptr[2] = {0, (int32_t)np}, last[1] = {P};
        kvk_page_table pt = {.indptr = indptr, .indices = all, .last_page_len = last, .batch = 1};
        kvk_decode_args da = {.q = q,
                              .out = out,
                              .qo_dtype = KV_DTYPE_FP32,
                              .num_qo_heads = QH,
                              .sm_scale = 1.0f / sqrtf(HD)};
        double tf[REPS], ts[REPS], tc[REPS], ta[REPS];
        int32_t sel[KH * KSEL], src[KH * KSEL], dst[KH * KSEL], widx[SINK + WIN + KH * KSEL];
        uint32_t moved = 0;
        for (int r = 0; r < REPS; r++) {
            double t0 = bench_now_s();
            if (kvk_paged_decode_attention_cpu(&co, 0, &pt, &da) != KV_OK) {
                bench_die("attention: %s", kvk_last_error());
            }
            double t1 = bench_now_s();
            kvk_select_args sa = {.summaries = summ,
                                  .npages = np - SINK - WIN,
                                  .num_layers = 1,
                                  .layer = 0,
                                  .num_kv_heads = KH,
                                  .head_dim = HD,
                                  .q = q,
                                  .num_qo_heads = QH,
                                  .k = KSEL,
                                  .mode = KVK_SELECT_CENTROID};
            sa.summaries = summ + (size_t)SINK * KVK_SUMMARY_FLOATS(1, KH, HD);
            kvk_page_select_cpu(&sa, sel, NULL);
            /* The union of the heads' pages (the attention kernel takes one table per request). */
            uint8_t *seen = calloc(np, 1);
            uint32_t nu = 0;
            for (int i = 0; i < KH * KSEL; i++) {
                uint32_t pg = (uint32_t)sel[i] + SINK;
                if (!seen[pg]) {
                    seen[pg] = 1;
                    src[nu] = (int32_t)pg;
                    dst[nu] = (int32_t)(SINK + WIN + nu);
                    nu++;
                }
            }
            free(seen);
            double t2 = bench_now_s();
            kvk_copy_blocks_cpu(&co, &cw, src, dst, nu);
            double t3 = bench_now_s();
            uint32_t nidx = 0;
            for (uint32_t i = 0; i < SINK + WIN; i++) {
                widx[nidx++] = (int32_t)i; /* sinks and window are resident in the working set */
            }
            for (uint32_t i = 0; i < nu; i++) {
                widx[nidx++] = dst[i];
            }
            int32_t ip2[2] = {0, (int32_t)nidx};
            kvk_page_table wpt = {
                .indptr = ip2, .indices = widx, .last_page_len = last, .batch = 1};
            kvk_paged_decode_attention_cpu(&cw, 0, &wpt, &da);
            double t4 = bench_now_s();
            tf[r] = (t1 - t0) * 1e3, ts[r] = (t2 - t1) * 1e3, tc[r] = (t3 - t2) * 1e3;
            ta[r] = (t4 - t3) * 1e3;
            moved = nu;
        }
        double f = bench_median(tf, REPS), s = bench_median(ts, REPS), c = bench_median(tc, REPS),
               a = bench_median(ta, REPS);
        printf("| %uK | %.3f ms | %.3f ms | %.3f ms | %.3f ms | %.3f ms | %.1fx | %u of %u | "
               "%.2f MiB (full attention reads %.1f MiB) |\n",
               ctxs[ci] / 1024, f, s, c, a, s + c + a, f / (s + c + a), moved, np,
               (double)moved * l.block_bytes / 1048576.0, (double)np * l.block_bytes / 1048576.0);
        free(off), free(work), free(all), free(summ), free(q), free(out);
    }
    printf("\nMedians of %d steps. Selection is per KV head (16 pages each); the copy moves the "
           "union of the heads' pages, since kvd blocks hold every head of a token.\n\n",
           REPS);
}

int main(void) {
    retrieval();
    step_time();
    return 0;
}
