/* kve_run: one engine process. Loads or generates the model, connects to kvd, runs a workload
 * file (or one prompt) to completion and prints one line per request and one STATS line, which
 * kve_loadgen and the benchmark parse.
 *
 *   kve_run --socket PATH [--model tiny|small|bench|big] [--seed S] [--checkpoint FILE]
 *           [--kv-dtype fp32|fp16|bf16|int8|fp8_e4m3] [--tpb 16] [--no-cache]
 *           [--budget 256] [--max-batch 64] [--block-budget B] [--static]
 *           [--spec K --draft-layers L] [--cascade] [--threads T] [--print-tokens]
 *           [--zip-budget B [--zip-keep N] [--zip-queries 16] [--zip-sinks 4] [--zip-window W]
 *            [--zip-pool 5] [--zip-decay 0.8] [--zip-lambda 0.2] [--zip-temp 0.4]
 *            [--zip-batch-blocks 600] [--zip-sync]]
 *           [--ice-budget K [--ice-sinks 2] [--ice-window 2] [--ice-reuse 1] [--ice-centroid]
 *            [--ice-no-pack]]
 *           (--workload FILE [--shard I/N] | --prompt-len N --prompt-seed S --max-new M)
 *   kve_run --print-gemm    (prints the matmul instruction set this CPU runs: avx2, scalar)
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "examples/engine/engine.h"
#include "examples/engine/gemm.h"
#include "examples/engine/model.h"
#include "examples/engine/workload.h"

static int preset(const char *name, kve_config *c) {
    if (strcmp(name, "tiny") == 0) {
        *c = (kve_config){32, 96, 3, 4, 2, 64, 4096};
    } else if (strcmp(name, "small") == 0) {
        *c = (kve_config){64, 176, 4, 4, 2, 256, 8192};
    } else if (strcmp(name, "bench") == 0) {
        *c = (kve_config){64, 128, 2, 2, 1, 256, 8192};
    } else if (strcmp(name, "big") == 0) {
        /* 150 M parameters, 600 MB of float32 weights: more than this machine's 480 MiB L3, so
         * a decode step streams the weights from DRAM (memory-bound, as on a GPU). */
        *c = (kve_config){1024, 2816, 12, 16, 4, 8192, 8192};
    } else {
        return -1;
    }
    return 0;
}

static void usage(void) {
    fprintf(stderr,
            "usage: kve_run --socket PATH [--model tiny|small|bench|big] [--seed S] "
            "[--checkpoint FILE] [--layers L] [--kv-dtype D] [--tpb T] [--no-cache] "
            "[--budget T] [--max-batch B] [--block-budget B] [--static] [--spec K] "
            "[--draft-layers L] [--cascade] [--threads T] [--print-tokens] [--zip-budget B "
            "[--zip-keep N] [--zip-queries Q] [--zip-sinks S] [--zip-window W] [--zip-pool P] "
            "[--zip-decay D] [--zip-lambda L] [--zip-temp T] [--zip-batch-blocks N] "
            "[--zip-sync]] [--ice-budget K [--ice-sinks S] [--ice-window W] [--ice-reuse N] "
            "[--ice-centroid] [--ice-no-pack]] (--workload FILE "
            "[--shard I/N] | --prompt-len N [--prompt-seed S] [--max-new M])\n");
}

int main(int argc, char **argv) {
    kve_options o;
    kve_options_init(&o);
    kve_config cfg;
    preset("tiny", &cfg);
    const char *ckpt = NULL, *wl_path = NULL;
    uint64_t seed = 1;
    unsigned shard = 0, nshards = 1;
    size_t prompt_len = 0;
    unsigned prompt_seed = 1, max_new = 16;
    int print_tokens = 0, layers = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        int used = 1;
        if (strcmp(a, "--no-cache") == 0) {
            o.prefix_cache = 0, used = 0;
        } else if (strcmp(a, "--static") == 0) {
            o.static_batching = 1, used = 0;
        } else if (strcmp(a, "--cascade") == 0) {
            o.cascade = 1, used = 0;
        } else if (strcmp(a, "--print-gemm") == 0) {
            printf("%s\n", kve_gemm_isa_name(kve_gemm_detect()));
            return 0;
        } else if (strcmp(a, "--print-tokens") == 0) {
            print_tokens = 1, used = 0;
        } else if (strcmp(a, "--zip-sync") == 0) {
            o.zip_sync = 1, used = 0;
        } else if (strcmp(a, "--ice-centroid") == 0) {
            o.ice_centroid = 1, used = 0;
        } else if (strcmp(a, "--ice-no-pack") == 0) {
            o.ice_no_pack = 1, used = 0;
        } else if (v == NULL) {
            usage();
            return 2;
        } else if (strcmp(a, "--socket") == 0) {
            o.socket_path = v;
        } else if (strcmp(a, "--model") == 0) {
            if (preset(v, &cfg) != 0) {
                usage();
                return 2;
            }
        } else if (strcmp(a, "--seed") == 0) {
            seed = strtoull(v, NULL, 10);
        } else if (strcmp(a, "--layers") == 0) {
            layers = atoi(v);
        } else if (strcmp(a, "--checkpoint") == 0) {
            ckpt = v;
        } else if (strcmp(a, "--kv-dtype") == 0) {
            if (kv_dtype_parse(v, &o.kv_dtype) != KV_OK) {
                usage();
                return 2;
            }
        } else if (strcmp(a, "--tpb") == 0) {
            o.tokens_per_block = (uint32_t)strtoul(v, NULL, 10);
        } else if (strcmp(a, "--budget") == 0) {
            o.token_budget = (uint32_t)strtoul(v, NULL, 10);
        } else if (strcmp(a, "--max-batch") == 0) {
            o.max_batch = (uint32_t)strtoul(v, NULL, 10);
        } else if (strcmp(a, "--block-budget") == 0) {
            o.block_budget = (uint32_t)strtoul(v, NULL, 10);
        } else if (strcmp(a, "--spec") == 0) {
            o.spec_k = atoi(v);
        } else if (strcmp(a, "--threads") == 0) {
            o.threads = atoi(v);
        } else if (strcmp(a, "--draft-layers") == 0) {
            o.draft_layers = atoi(v);
        } else if (strcmp(a, "--zip-budget") == 0) {
            o.zip_budget = (uint32_t)strtoul(v, NULL, 10);
        } else if (strcmp(a, "--zip-keep") == 0) {
            o.zip_keep = (uint32_t)strtoul(v, NULL, 10);
        } else if (strcmp(a, "--zip-queries") == 0) {
            o.zip_queries = (uint32_t)strtoul(v, NULL, 10);
        } else if (strcmp(a, "--zip-sinks") == 0) {
            o.zip_sinks = (uint32_t)strtoul(v, NULL, 10);
        } else if (strcmp(a, "--zip-window") == 0) {
            o.zip_window = (uint32_t)strtoul(v, NULL, 10);
        } else if (strcmp(a, "--zip-pool") == 0) {
            o.zip_pool = (uint32_t)strtoul(v, NULL, 10);
        } else if (strcmp(a, "--zip-decay") == 0) {
            o.zip_decay = strtof(v, NULL);
        } else if (strcmp(a, "--zip-lambda") == 0) {
            o.zip_lambda = strtof(v, NULL);
        } else if (strcmp(a, "--zip-temp") == 0) {
            o.zip_temp = strtof(v, NULL);
        } else if (strcmp(a, "--zip-batch-blocks") == 0) {
            o.zip_batch_blocks = (uint32_t)strtoul(v, NULL, 10);
        } else if (strcmp(a, "--ice-budget") == 0) {
            o.ice_budget = (uint32_t)strtoul(v, NULL, 10);
        } else if (strcmp(a, "--ice-sinks") == 0) {
            o.ice_sinks = (uint32_t)strtoul(v, NULL, 10);
        } else if (strcmp(a, "--ice-window") == 0) {
            o.ice_window = (uint32_t)strtoul(v, NULL, 10);
        } else if (strcmp(a, "--ice-offload-min") == 0) {
            o.ice_offload_min = (uint32_t)strtoul(v, NULL, 10);
        } else if (strcmp(a, "--ice-reuse") == 0) {
            o.ice_reuse = (uint32_t)strtoul(v, NULL, 10);
        } else if (strcmp(a, "--workload") == 0) {
            wl_path = v;
        } else if (strcmp(a, "--shard") == 0) {
            if (sscanf(v, "%u/%u", &shard, &nshards) != 2 || nshards == 0 || shard >= nshards) {
                usage();
                return 2;
            }
        } else if (strcmp(a, "--prompt-len") == 0) {
            prompt_len = strtoul(v, NULL, 10);
        } else if (strcmp(a, "--prompt-seed") == 0) {
            prompt_seed = (unsigned)strtoul(v, NULL, 10);
        } else if (strcmp(a, "--max-new") == 0) {
            max_new = (unsigned)strtoul(v, NULL, 10);
        } else {
            usage();
            return 2;
        }
        i += used;
    }
    if (layers > 0) {
        cfg.n_layers = layers;
    }
    kve_model m;
    kv_err rc = ckpt ? kve_model_load(ckpt, &m) : kve_model_random(&cfg, seed, 0, &m);
    if (rc != KV_OK) {
        fprintf(stderr, "kve_run: model: %s\n", kv_strerror(rc));
        return 1;
    }
    kve_workload w = {0};
    uint32_t *one = NULL;
    kve_request single = {0};
    if (wl_path != NULL) {
        rc = kve_workload_read(wl_path, shard, nshards, (uint32_t)m.cfg.vocab_size, &w);
        if (rc != KV_OK) {
            fprintf(stderr, "kve_run: workload %s: %s\n", wl_path, kv_strerror(rc));
            kve_model_fini(&m);
            return 1;
        }
    } else if (prompt_len > 0) {
        /* The prompt is a pure function of (prompt_seed, position): two processes given the same
         * seed build the same prompt; a different seed changes only the last 8 tokens. */
        one = malloc(prompt_len * sizeof(*one));
        if (one == NULL) {
            return 1;
        }
        for (size_t i = 0; i < prompt_len; i++) {
            uint32_t salt = i + 8 >= prompt_len ? prompt_seed : 0;
            one[i] =
                (uint32_t)((i * 2654435761u + salt * 40503u + 17) % (uint32_t)m.cfg.vocab_size);
        }
        single =
            (kve_request){.id = 0, .prompt = one, .prompt_len = prompt_len, .max_new = max_new};
        w.reqs = &single;
        w.n = 1;
    } else {
        usage();
        return 2;
    }
    kve_engine *e = NULL;
    int status = 1;
    rc = kve_engine_open(&m, &o, &e);
    if (rc != KV_OK) {
        goto out;
    }
    rc = kve_engine_run(e, w.reqs, w.n);
    if (rc != KV_OK) {
        fprintf(stderr, "kve_run: %s: %s\n", kv_strerror(rc), kve_engine_error(e));
        goto out;
    }
    double ttft = 0, lat = 0;
    size_t ok = 0;
    for (size_t i = 0; i < w.n; i++) {
        kve_request *r = &w.reqs[i];
        printf("REQ id=%u status=%s prompt=%zu cached=%zu computed=%zu preempted=%u "
               "ttft_ms=%.3f finish_ms=%.3f peak_blocks=%zu compressions=%u",
               r->id, kv_err_name(r->status), r->prompt_len, r->cached_tokens, r->computed_tokens,
               r->preemptions, r->ttft_ms, r->finish_ms, r->peak_blocks, r->compressions);
        if (print_tokens) {
            printf(" tokens=");
            for (size_t j = 0; j < r->nout; j++) {
                printf("%s%u", j ? "," : "", r->out[j]);
            }
        }
        printf("\n");
        if (r->status == KV_OK) {
            ok++;
            ttft += r->ttft_ms;
            lat += r->finish_ms;
        }
    }
    const kve_stats *st = kve_engine_stats(e);
    const kv_layout *ly = kve_engine_layout(e);
    printf("STATS requests=%zu ok=%zu prompt_tokens=%" PRIu64 " cached_tokens=%" PRIu64
           " computed_tokens=%" PRIu64 " generated=%" PRIu64 " preemptions=%" PRIu64
           " steps=%" PRIu64 " spec_proposed=%" PRIu64 " spec_accepted=%" PRIu64
           " draft_rows=%" PRIu64 " cascade_groups=%" PRIu64
           " slots_allocated=%.0f slots_used=%.0f elapsed_ms=%.3f ttft_sum_ms=%.3f"
           " latency_sum_ms=%.3f bytes_per_token=%.1f compressions=%" PRIu64 " zip_jobs=%" PRIu64
           " zip_dropped=%" PRIu64 " zip_swaps=%" PRIu64 " zip_job_ms=%.3f zip_wait_ms=%.3f"
           " ice_offloads=%" PRIu64 " ice_pages_out=%" PRIu64 " ice_selections=%" PRIu64
           " ice_pages_fetched=%" PRIu64 " ice_pages_promoted=%" PRIu64
           " ice_pages_missing=%" PRIu64 " ice_pack_ms=%.3f ice_step_ms=%.3f\n",
           w.n, ok, st->prompt_tokens, st->cached_tokens, st->computed_tokens, st->generated,
           st->preemptions, st->steps, st->spec_proposed, st->spec_accepted, st->draft_rows,
           st->cascade_groups, st->slots_allocated, st->slots_used, st->elapsed_ms, ttft, lat,
           (double)ly->block_bytes / ly->tokens_per_block, st->compressions, st->zip_jobs,
           st->zip_dropped, st->zip_swaps, st->zip_job_ms, st->zip_wait_ms, st->ice_offloads,
           st->ice_pages_out, st->ice_selections, st->ice_pages_fetched, st->ice_pages_promoted,
           st->ice_pages_missing, st->ice_pack_ms, st->ice_step_ms);
    status = ok == w.n ? 0 : 1;
out:
    kve_engine_close(e);
    if (wl_path != NULL) {
        kve_workload_fini(&w);
    } else {
        kve_request_fini(&single);
    }
    free(one);
    kve_model_fini(&m);
    return status;
}
