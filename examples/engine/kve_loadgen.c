/* kve_loadgen: writes workload files and runs N engine processes against one kvd.
 *
 *   kve_loadgen gen --kind system|chat|fewshot [--requests R] [--vocab V] [--shared T]
 *                   [--unique T] [--turns K] [--max-new M] [--gap-ms G] [--seed S] > FILE
 *   kve_loadgen run --engine PATH --procs N --workload FILE -- <kve_run options>
 *
 * `run` starts N kve_run processes with --shard i/N (request id modulo N picks the process),
 * waits for them and prints their summed STATS as one "TOTAL" line: the hit rate and tokens
 * saved across processes, computed tokens and the longest process's wall time.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "examples/engine/workload.h"

static int gen(int argc, char **argv) {
    kve_gen g = {.kind = "system",
                 .requests = 32,
                 .vocab = 64,
                 .shared = 256,
                 .unique = 32,
                 .turns = 4,
                 .max_new = 8,
                 .gap_ms = 2,
                 .seed = 1};
    for (int i = 0; i + 1 < argc; i += 2) {
        const char *a = argv[i], *v = argv[i + 1];
        if (strcmp(a, "--kind") == 0) {
            g.kind = v;
        } else if (strcmp(a, "--requests") == 0) {
            g.requests = (uint32_t)strtoul(v, NULL, 10);
        } else if (strcmp(a, "--vocab") == 0) {
            g.vocab = (uint32_t)strtoul(v, NULL, 10);
        } else if (strcmp(a, "--shared") == 0) {
            g.shared = (uint32_t)strtoul(v, NULL, 10);
        } else if (strcmp(a, "--unique") == 0) {
            g.unique = (uint32_t)strtoul(v, NULL, 10);
        } else if (strcmp(a, "--turns") == 0) {
            g.turns = (uint32_t)strtoul(v, NULL, 10);
        } else if (strcmp(a, "--max-new") == 0) {
            g.max_new = (uint32_t)strtoul(v, NULL, 10);
        } else if (strcmp(a, "--gap-ms") == 0) {
            g.gap_ms = strtod(v, NULL);
        } else if (strcmp(a, "--seed") == 0) {
            g.seed = strtoull(v, NULL, 10);
        } else {
            fprintf(stderr, "kve_loadgen gen: unknown option %s\n", a);
            return 2;
        }
    }
    kv_err rc = kve_workload_generate(&g, stdout);
    if (rc != KV_OK) {
        fprintf(stderr, "kve_loadgen gen: %s\n", kv_strerror(rc));
        return 2;
    }
    return 0;
}

/* Adds every key=value of a STATS line into sums (fixed key order of kve_run). */
#define NKEYS 17
static const char *const keys[NKEYS] = {"requests",        "ok",
                                        "prompt_tokens",   "cached_tokens",
                                        "computed_tokens", "generated",
                                        "preemptions",     "steps",
                                        "spec_proposed",   "spec_accepted",
                                        "draft_rows",      "cascade_groups",
                                        "slots_allocated", "slots_used",
                                        "elapsed_ms",      "ttft_sum_ms",
                                        "latency_sum_ms"};

static void add_stats(const char *line, double *sum, double *max_elapsed) {
    for (int k = 0; k < NKEYS; k++) {
        char pat[40];
        snprintf(pat, sizeof(pat), " %s=", keys[k]);
        const char *p = strstr(line, pat);
        if (p != NULL) {
            double v = strtod(p + strlen(pat), NULL);
            sum[k] += v;
            if (strcmp(keys[k], "elapsed_ms") == 0 && v > *max_elapsed) {
                *max_elapsed = v;
            }
        }
    }
}

static int run(int argc, char **argv) {
    const char *engine = NULL, *wl = NULL;
    int procs = 1, i = 0;
    for (; i < argc; i += 2) {
        if (strcmp(argv[i], "--") == 0) {
            i++;
            break;
        }
        if (i + 1 >= argc) {
            return 2;
        }
        if (strcmp(argv[i], "--engine") == 0) {
            engine = argv[i + 1];
        } else if (strcmp(argv[i], "--procs") == 0) {
            procs = atoi(argv[i + 1]);
        } else if (strcmp(argv[i], "--workload") == 0) {
            wl = argv[i + 1];
        } else {
            fprintf(stderr, "kve_loadgen run: unknown option %s\n", argv[i]);
            return 2;
        }
    }
    if (engine == NULL || wl == NULL || procs < 1 || procs > 256) {
        fprintf(stderr, "kve_loadgen run: --engine, --workload and 1..256 --procs are needed\n");
        return 2;
    }
    int nextra = argc - i;
    FILE **outs = calloc((size_t)procs, sizeof(FILE *));
    pid_t *pids = calloc((size_t)procs, sizeof(pid_t));
    if (outs == NULL || pids == NULL) {
        return 1;
    }
    for (int p = 0; p < procs; p++) {
        int fd[2];
        if (pipe(fd) != 0) {
            perror("pipe");
            return 1;
        }
        pid_t pid = fork();
        if (pid == 0) {
            char shard[32];
            snprintf(shard, sizeof(shard), "%d/%d", p, procs);
            char **av = calloc((size_t)nextra + 8, sizeof(char *));
            int k = 0;
            av[k++] = (char *)engine;
            av[k++] = "--workload";
            av[k++] = (char *)wl;
            av[k++] = "--shard";
            av[k++] = shard;
            for (int j = 0; j < nextra; j++) {
                av[k++] = argv[i + j];
            }
            dup2(fd[1], 1);
            close(fd[0]);
            close(fd[1]);
            execv(engine, av);
            perror("execv");
            _exit(127);
        }
        close(fd[1]);
        pids[p] = pid;
        outs[p] = fdopen(fd[0], "r");
    }
    double sum[NKEYS] = {0}, max_elapsed = 0;
    int failed = 0;
    char line[1 << 16];
    for (int p = 0; p < procs; p++) {
        while (outs[p] != NULL && fgets(line, sizeof(line), outs[p]) != NULL) {
            if (strncmp(line, "STATS", 5) == 0) {
                add_stats(line, sum, &max_elapsed);
            }
            fputs(line, stderr);
        }
        if (outs[p] != NULL) {
            fclose(outs[p]);
        }
        int st = 0;
        waitpid(pids[p], &st, 0);
        failed += !(WIFEXITED(st) && WEXITSTATUS(st) == 0);
    }
    printf("TOTAL procs=%d failed=%d", procs, failed);
    for (int k = 0; k < NKEYS; k++) {
        printf(" %s=%.3f", keys[k], sum[k]);
    }
    printf(" max_elapsed_ms=%.3f hit_rate=%.4f\n", max_elapsed, sum[2] > 0 ? sum[3] / sum[2] : 0.0);
    free(outs);
    free(pids);
    return failed == 0 ? 0 : 1;
}

int main(int argc, char **argv) {
    if (argc >= 2 && strcmp(argv[1], "gen") == 0) {
        return gen(argc - 2, argv + 2);
    }
    if (argc >= 2 && strcmp(argv[1], "run") == 0) {
        return run(argc - 2, argv + 2);
    }
    fprintf(stderr,
            "usage: kve_loadgen gen ... | run --engine PATH --procs N --workload F -- ...\n");
    return 2;
}
