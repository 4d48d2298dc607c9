/* workload: reading and generating the engine's request files (format in workload.h). */
#include "examples/engine/workload.h"

#include <stdlib.h>
#include <string.h>

kv_err kve_workload_read(const char *path, uint32_t shard, uint32_t nshards, uint32_t vocab,
                         kve_workload *out) {
    FILE *f = fopen(path, "r");
    if (f == NULL) {
        return KV_ESYS;
    }
    kve_workload w = {0};
    size_t cap = 0, tcap = 0, ntok = 0;
    size_t *offs = NULL;
    kv_err rc = KV_OK;
    char line[16];
    for (;;) {
        int ch = fgetc(f);
        if (ch == EOF) {
            break;
        }
        if (ch == '#' || ch == '\n') {
            while (ch != '\n' && ch != EOF) {
                ch = fgetc(f);
            }
            continue;
        }
        ungetc(ch, f);
        unsigned id, max_new;
        double arr;
        size_t n;
        if (fscanf(f, "%u %lf %u %zu", &id, &arr, &max_new, &n) != 4 || n == 0 || n > (1u << 24)) {
            rc = KV_EINVAL;
            goto fail;
        }
        int keep = nshards == 0 || id % nshards == shard;
        if (keep && w.n == cap) {
            cap = cap ? cap * 2 : 64;
            kve_request *r = realloc(w.reqs, cap * sizeof(*r));
            size_t *o = realloc(offs, cap * sizeof(*o));
            if (r == NULL || o == NULL) {
                free(r ? r : w.reqs);
                w.reqs = NULL;
                offs = o ? o : offs;
                rc = KV_ENOMEM;
                goto fail;
            }
            w.reqs = r, offs = o;
        }
        if (keep && ntok + n > tcap) {
            tcap = (ntok + n) * 2;
            uint32_t *t = realloc(w.tokens, tcap * sizeof(*t));
            if (t == NULL) {
                rc = KV_ENOMEM;
                goto fail;
            }
            w.tokens = t;
        }
        for (size_t i = 0; i < n; i++) {
            unsigned t;
            if (fscanf(f, "%u", &t) != 1 || t >= vocab) {
                rc = KV_EINVAL;
                goto fail;
            }
            if (keep) {
                w.tokens[ntok + i] = t;
            }
        }
        if (keep) {
            memset(&w.reqs[w.n], 0, sizeof(w.reqs[w.n]));
            w.reqs[w.n] =
                (kve_request){.id = id, .arrival_ms = arr, .prompt_len = n, .max_new = max_new};
            offs[w.n++] = ntok;
            ntok += n;
        }
    }
    (void)line;
    for (size_t i = 0; i < w.n; i++) {
        w.reqs[i].prompt = w.tokens + offs[i];
    }
    free(offs);
    fclose(f);
    *out = w;
    return KV_OK;
fail:
    free(offs);
    fclose(f);
    kve_workload_fini(&w);
    return rc;
}

void kve_workload_fini(kve_workload *w) {
    if (w == NULL) {
        return;
    }
    for (size_t i = 0; w->reqs != NULL && i < w->n; i++) {
        kve_request_fini(&w->reqs[i]);
    }
    free(w->reqs);
    free(w->tokens);
    memset(w, 0, sizeof(*w));
}

static uint64_t rnd(uint64_t *s) {
    uint64_t x = (*s += 0x9e3779b97f4a7c15ull);
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static void put_tokens(FILE *f, const uint32_t *t, size_t n) {
    for (size_t i = 0; i < n; i++) {
        fprintf(f, " %u", t[i]);
    }
}

kv_err kve_workload_generate(const kve_gen *g, FILE *f) {
    if (g->requests == 0 || g->vocab < 2 || g->max_new == 0 || g->unique == 0) {
        return KV_EINVAL;
    }
    uint64_t s = g->seed;
    double t = 0;
    fprintf(f, "# kind=%s requests=%u shared=%u unique=%u turns=%u max_new=%u seed=%llu\n", g->kind,
            g->requests, g->shared, g->unique, g->turns, g->max_new, (unsigned long long)g->seed);
    if (strcmp(g->kind, "system") == 0) {
        uint32_t *sys = malloc(((size_t)g->shared + 1) * sizeof(uint32_t));
        if (sys == NULL) {
            return KV_ENOMEM;
        }
        for (uint32_t i = 0; i < g->shared; i++) {
            sys[i] = (uint32_t)(rnd(&s) % g->vocab);
        }
        for (uint32_t r = 0; r < g->requests; r++) {
            fprintf(f, "%u %.1f %u %u", r, t, g->max_new, g->shared + g->unique);
            put_tokens(f, sys, g->shared);
            for (uint32_t i = 0; i < g->unique; i++) {
                fprintf(f, " %u", (uint32_t)(rnd(&s) % g->vocab));
            }
            fputc('\n', f);
            t += g->gap_ms * (double)(rnd(&s) % 2000) / 1000.0;
        }
        free(sys);
        return KV_OK;
    }
    if (strcmp(g->kind, "chat") == 0) {
        /* Each conversation resends its history: turn k's prompt = turn k-1's prompt + a reply
         * placeholder of max_new tokens + the user's new message. */
        uint32_t turns = g->turns ? g->turns : 4;
        uint32_t convs = (g->requests + turns - 1) / turns;
        size_t cap = (size_t)turns * (g->unique + g->max_new) + 1;
        uint32_t *hist = malloc(cap * sizeof(uint32_t));
        if (hist == NULL) {
            return KV_ENOMEM;
        }
        uint32_t id = 0;
        for (uint32_t c = 0; c < convs; c++) {
            size_t n = 0;
            double tc = t;
            for (uint32_t k = 0; k < turns && id < g->requests; k++) {
                if (k > 0) {
                    for (uint32_t i = 0; i < g->max_new; i++) {
                        hist[n++] = (uint32_t)(rnd(&s) % g->vocab);
                    }
                }
                for (uint32_t i = 0; i < g->unique; i++) {
                    hist[n++] = (uint32_t)(rnd(&s) % g->vocab);
                }
                fprintf(f, "%u %.1f %u %zu", id++, tc, g->max_new, n);
                put_tokens(f, hist, n);
                fputc('\n', f);
                tc += g->gap_ms * 4;
            }
            t += g->gap_ms;
        }
        free(hist);
        return KV_OK;
    }
    if (strcmp(g->kind, "fewshot") == 0) {
        uint32_t pool = 8, per = g->turns ? g->turns : 3;
        size_t ex = g->shared ? g->shared : 64;
        uint32_t *ex_tok = malloc(pool * ex * sizeof(uint32_t));
        if (ex_tok == NULL) {
            return KV_ENOMEM;
        }
        for (size_t i = 0; i < pool * ex; i++) {
            ex_tok[i] = (uint32_t)(rnd(&s) % g->vocab);
        }
        for (uint32_t r = 0; r < g->requests; r++) {
            /* A task picks its examples in a fixed order from a small pool: prompts of one task
             * share their whole example prefix. */
            uint32_t task = (uint32_t)(rnd(&s) % 3);
            fprintf(f, "%u %.1f %u %zu", r, t, g->max_new, per * ex + g->unique);
            for (uint32_t k = 0; k < per; k++) {
                put_tokens(f, ex_tok + ((task * 3 + k * 5) % pool) * ex, ex);
            }
            for (uint32_t i = 0; i < g->unique; i++) {
                fprintf(f, " %u", (uint32_t)(rnd(&s) % g->vocab));
            }
            fputc('\n', f);
            t += g->gap_ms * (double)(rnd(&s) % 2000) / 1000.0;
        }
        free(ex_tok);
        return KV_OK;
    }
    return KV_EINVAL;
}
