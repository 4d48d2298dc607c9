/* workload: request lists for the example engine, as text files, and their generators.
 *
 * File format, one request per line ('#' starts a comment line):
 *     <id> <arrival_ms> <max_new> <n> <tok_1> ... <tok_n>
 * Generators model the three sharing patterns of serving traffic: many users behind one long
 * system prompt, multi-turn chats that resend their whole history each turn, and few-shot
 * prompts assembled from a shared pool of examples. Deterministic in their seed.
 * Not thread-safe per workload; different workloads on different threads are fine.
 */
#ifndef KVE_WORKLOAD_H
#define KVE_WORKLOAD_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "common/kv_err.h"
#include "examples/engine/engine.h"

typedef struct kve_workload {
    kve_request *reqs; /* requests; prompts point into tokens */
    size_t n;          /* requests */
    uint32_t *tokens;  /* every prompt's tokens */
} kve_workload;

/* Reads a workload file, keeping requests with id % nshards == shard. KV_ESYS (cannot open),
 * KV_EINVAL (a malformed line, a token >= vocab), KV_ENOMEM. *out written on success. */
kv_err kve_workload_read(const char *path, uint32_t shard, uint32_t nshards, uint32_t vocab,
                         kve_workload *out);

/* Frees the workload and each request's results. Accepts NULL and zeroed workloads. */
void kve_workload_fini(kve_workload *w);

typedef struct kve_gen {
    const char *kind;  /* "system", "chat" or "fewshot" */
    uint32_t requests; /* requests (chat: conversations x turns) */
    uint32_t vocab;    /* token ids < vocab */
    uint32_t shared;   /* system: system prompt tokens; fewshot: tokens per example */
    uint32_t unique;   /* tokens of each request's own part */
    uint32_t turns;    /* chat: turns per conversation; fewshot: examples per prompt */
    uint32_t max_new;  /* tokens to generate */
    double gap_ms;     /* mean gap between arrivals */
    uint64_t seed;     /* generator seed */
} kve_gen;

/* Writes a generated workload to f. KV_EINVAL for an unknown kind or zero sizes. */
kv_err kve_workload_generate(const kve_gen *g, FILE *f);

#endif
