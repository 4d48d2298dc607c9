/* engine: a tiny serving engine whose KV cache lives only in kvd blocks.
 *
 * One kve_engine is one worker process's engine: a libkvclient connection, the pool for the
 * model's KV shape (attached once; every block is mapped zero-copy) and a scheduler. Requests
 * (prompt, max new tokens, arrival time) run with iteration-level scheduling: at every step
 * requests join and leave the running batch, prefill is chunked under a token budget, blocks are
 * allocated as sequences grow, and when blocks run out the newest request is preempted (its
 * committed prefix stays cached in kvd, so its recompute is mostly hits). Prompts are hashed
 * into blocks and looked up in kvd's shared index: cached blocks are not recomputed. Only
 * verified, full blocks are committed. Options add speculative decoding (the draft is the
 * target's first layers, which writes the same K/V as the target in those layers, so it reads
 * and writes the target's own blocks), shared-prefix (cascade) attention merged by log-sum-exp,
 * and 8-bit (int8, fp8-e4m3) KV pools with calibrated per-(layer, head) scales. The Zipage mode
 * (zip_budget) keeps every sequence within a fixed number of blocks: at the block boundary a
 * sequence at its budget is compressed (its kept tokens' K/V gathered into fresh private blocks,
 * docs/ZIPAGE.md) on a worker thread while the other sequences decode, and a compressed sequence
 * that is preempted is swapped out and requeued, never recomputed. The IceCache mode
 * (ice_budget) keeps only sink and window pages of a decoding sequence in its table: the rest
 * is packed by key similarity into pages committed to kvd (and so demoted to its lower tiers)
 * with daemon-kept summaries, and each decode step fetches, per layer, the top-k pages for the
 * step's query (docs/ICECACHE.md).
 *
 * K/V of new tokens are written with kvk_reshape_and_cache_cpu and read with
 * kvk_paged_decode_attention_cpu over the CSR block tables of kvc_seq (a prefill token is a
 * decode query whose table ends at its own position), so every token's numbers come from the
 * same code whichever way it was scheduled: cached, batched, preempted or speculated runs give
 * the tokens of a plain greedy run.
 *
 * Thread: one engine is used by one thread. Errors are kv_err; kve_engine_error() says why.
 */
#ifndef KVE_ENGINE_H
#define KVE_ENGINE_H

#include <stddef.h>
#include <stdint.h>

#include "common/kv_err.h"
#include "common/kv_layout.h"
#include "examples/engine/model.h"

typedef struct kve_engine kve_engine;

typedef struct kve_options {
    const char *socket_path;   /* kvd socket; NULL: libkvclient's default */
    const char *model_id;      /* pool model id; NULL: "kve-<hash of the weights>" */
    kv_dtype kv_dtype;         /* pool dtype: fp32 (default), fp16, bf16, int8, fp8_e4m3 */
    uint32_t tokens_per_block; /* block size in tokens; default 16 */
    int prefix_cache;          /* 1 (default): look up and commit blocks; 0: compute all */
    uint32_t token_budget;     /* tokens computed per step at most (chunked prefill); 256 */
    uint32_t max_batch;        /* running requests at most; 64 */
    uint32_t block_budget;     /* blocks this engine may hold at once; 0: only kvd's limit */
    int static_batching;       /* 1: admit a batch only when none runs, reserving each request's
                                  prompt + max_new blocks up front, whole prompts per step */
    int spec_k;                /* draft tokens proposed per step; 0: no speculative decoding */
    int draft_layers;          /* layers of the draft model (the target's first layers); 1 */
    int cascade;               /* 1: shared-prefix attention once per group + merge_states */
    int keep_logits;           /* 1: keep every generated token's logits in its request */
    int threads;               /* matmul threads in all, the caller's included (1..64); 1 */
    /* Zipage (docs/ZIPAGE.md); the paper's defaults where it has one. Not with spec_k or
     * static_batching. */
    uint32_t zip_budget;       /* blocks per sequence at most; 0: Zipage off (paper: 8) */
    uint32_t zip_keep;         /* tokens a compression keeps; 0: (zip_budget - 1) blocks' worth */
    uint32_t zip_queries;      /* last queries kept per sequence for scoring; 16 */
    uint32_t zip_sinks;        /* first tokens always kept; 4 */
    uint32_t zip_window;       /* last tokens always kept; 0: zip_queries */
    uint32_t zip_pool;         /* max-pooling width of the scores; 5 */
    float zip_decay;           /* weight of the carried (decayed) global score; 0.8 */
    float zip_lambda;          /* weight of the redundancy term; 0.2 */
    float zip_temp;            /* temperature of the redundancy softmax; 0.4 */
    uint32_t zip_batch_blocks; /* blocks one compression job covers at most; 600 */
    int zip_sync;              /* 1: compress on the scheduler thread (no overlap) */
    /* IceCache (docs/ICECACHE.md); the paper's defaults. Not with spec_k, static_batching,
     * cascade or Zipage. */
    uint32_t ice_budget; /* pages selected per layer and KV head; 0: IceCache off (paper: 16) */
    uint32_t ice_sinks;  /* first pages kept resident; 2 */
    uint32_t ice_window; /* last pages kept resident; 2 */
    uint32_t ice_reuse;  /* layers that share the selection of the first of them; 1 */
    int ice_centroid;    /* 1: pages scored by q . centroid; 0: by the upper bound (default) */
    int ice_no_pack;     /* 1: offload pages in token order (the benchmark's baseline) */
    uint32_t ice_offload_min; /* offload once the middle holds more pages; 0: ice_budget */
} kve_options;

/* Fills o with the defaults above. */
void kve_options_init(kve_options *o);

typedef struct kve_request {
    uint32_t id;            /* caller's id */
    double arrival_ms;      /* when it arrives, ms after kve_engine_run starts */
    const uint32_t *prompt; /* borrowed until kve_engine_run returns */
    size_t prompt_len;      /* >= 1 */
    uint32_t max_new;       /* tokens to generate (greedy); >= 1 */
    const uint32_t *forced; /* NULL, or max_new tokens appended in place of the greedy choice
                               (teacher forcing: perplexity with keep_logits); borrowed */
    /* Results, written by kve_engine_run (free with kve_request_fini): */
    uint32_t *out;          /* generated tokens [nout] */
    size_t nout;            /* generated so far */
    float *logits;          /* keep_logits: [nout][vocab] logits each token was chosen from */
    size_t cached_tokens;   /* prompt tokens found in kvd at first admission */
    size_t computed_tokens; /* token rows computed for it (recomputes included) */
    uint32_t preemptions;   /* times it was preempted */
    size_t peak_blocks;     /* most blocks its sequence held at once */
    uint32_t compressions;  /* Zipage compressions of its sequence */
    double ttft_ms;         /* first token time minus arrival */
    double finish_ms;       /* last token time minus arrival */
    kv_err status;          /* KV_OK once finished */
} kve_request;

/* Frees a request's results (out, logits); accepts NULL. */
void kve_request_fini(kve_request *r);

typedef struct kve_stats {
    uint64_t steps;           /* scheduler iterations */
    uint64_t prompt_tokens;   /* prompt tokens of all requests */
    uint64_t cached_tokens;   /* prompt tokens that were kvd hits at first admission */
    uint64_t computed_tokens; /* token rows through the full model (recomputes included) */
    uint64_t generated;       /* tokens generated */
    uint64_t preemptions;     /* requests preempted */
    uint64_t spec_steps;      /* request-steps that speculated */
    uint64_t spec_proposed;   /* draft tokens proposed */
    uint64_t spec_accepted;   /* draft tokens the target accepted */
    uint64_t draft_rows;      /* token rows through the draft */
    uint64_t cascade_groups;  /* shared-prefix groups attended once */
    uint64_t peak_running;    /* most requests running at once */
    uint64_t compressions;    /* Zipage: sequences compressed */
    uint64_t zip_jobs;        /* Zipage: compression jobs (a batch of sequences each) */
    uint64_t zip_dropped;     /* Zipage: tokens compressions dropped */
    uint64_t zip_swaps;       /* Zipage: compressed sequences preempted (swapped, not recomputed) */
    double zip_job_ms;        /* Zipage: time compression jobs ran (on their thread) */
    double zip_wait_ms;       /* Zipage: time the scheduler waited with nothing else to run */
    uint64_t ice_offloads;    /* IceCache: sequences whose middle was packed and offloaded */
    uint64_t ice_pages_out;   /* IceCache: pages committed to kvd for offload */
    uint64_t ice_selections;  /* IceCache: (row, layer) selections */
    uint64_t ice_pages_fetched;  /* IceCache: pages fetched for attention (T0 hits included) */
    uint64_t ice_pages_promoted; /* IceCache: of them, copied up from a lower tier */
    uint64_t ice_pages_missing;  /* IceCache: selected pages kvd no longer had (skipped) */
    double ice_pack_ms;          /* IceCache: packing and offload time (prefill indexing) */
    double ice_step_ms;          /* IceCache: selection and fetch time */
    double slots_allocated;      /* sum over steps of slots held (blocks * tokens per block) */
    double slots_used;           /* sum over steps of slots holding a token */
    double elapsed_ms;           /* wall time of the last kve_engine_run */
} kve_stats;

/* Connects to kvd, attaches the pool for m's KV shape and (8-bit dtypes) calibrates scales. m is
 * borrowed and must outlive the engine. Errors: libkvclient's (KV_ESYS: no daemon, ...),
 * KV_EINVAL for bad options, KV_ENOMEM. *out written on success. */
kv_err kve_engine_open(const kve_model *m, const kve_options *o, kve_engine **out);

/* Releases every block, detaches and disconnects. Accepts NULL. */
void kve_engine_close(kve_engine *e);

/* Runs reqs[0..n) to completion (greedy decoding), honouring arrival times. Each request's
 * results are written into it; a request that cannot run (its prompt needs more blocks than the
 * budget, ...) gets status != KV_OK and the others go on. Returns KV_OK, or the error that made
 * the engine stop (a transport error, KV_ENOMEM). */
kv_err kve_engine_run(kve_engine *e, kve_request *reqs, size_t n);

/* Counters since open; the pool layout (derived fields filled); the message of the last error. */
const kve_stats *kve_engine_stats(const kve_engine *e);
const kv_layout *kve_engine_layout(const kve_engine *e);
const char *kve_engine_error(const kve_engine *e);

#endif
