/* kvd_trace: synthetic traces, replay against a pool, Belady's optimum (see evict_trace.h).
 *
 * Generators use their own splitmix64 stream so a seed means the same trace everywhere. Belady
 * runs on a max-heap of (next use, key) with lazy deletion: a key's entry is current only while
 * its recorded next use matches.
 */
#include "daemon/testing/evict_trace.h"

#include <ctype.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/core/duel.h"

typedef struct trace_rng {
    uint64_t s; /* splitmix64 state */
} trace_rng;

static uint64_t rng_next(trace_rng *r) {
    uint64_t z = (r->s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Uniform in [lo, hi]. */
static uint32_t rng_range(trace_rng *r, uint32_t lo, uint32_t hi) {
    return lo + (uint32_t)(rng_next(r) % ((uint64_t)hi - lo + 1));
}

static double rng_unit(trace_rng *r) {
    return (double)(rng_next(r) >> 11) / 9007199254740992.0;
}

kv_hash128 kvd_trace_hash(uint32_t key) {
    trace_rng r = {(uint64_t)key * 0xD1B54A32D192ED03ull + 1};
    kv_hash128 h = {rng_next(&r), rng_next(&r)};
    return h;
}

/* Growable output of a generator. */
typedef struct trace_buf {
    kvd_trace t;      /* being filled */
    size_t cap_keys;  /* keys capacity */
    uint32_t cap_req; /* off capacity - 1 */
} trace_buf;

static kv_err buf_request(trace_buf *b, const uint32_t *keys, uint32_t n) {
    kvd_trace *t = &b->t;
    if (t->nreq == b->cap_req) {
        uint32_t nc = b->cap_req ? b->cap_req * 2 : 1024;
        uint32_t *off = realloc(t->off, ((size_t)nc + 1) * sizeof(uint32_t));
        if (off == NULL) {
            return KV_ENOMEM;
        }
        t->off = off;
        b->cap_req = nc;
    }
    size_t used = t->nreq ? t->off[t->nreq] : 0;
    if (used + n > b->cap_keys) {
        size_t nc = b->cap_keys ? b->cap_keys * 2 : 65536;
        while (nc < used + n) {
            nc *= 2;
        }
        uint32_t *k = realloc(t->keys, nc * sizeof(uint32_t));
        if (k == NULL) {
            return KV_ENOMEM;
        }
        t->keys = k;
        b->cap_keys = nc;
    }
    if (t->nreq == 0) {
        t->off[0] = 0;
    }
    memcpy(t->keys + used, keys, n * sizeof(uint32_t));
    t->off[t->nreq + 1] = (uint32_t)(used + n);
    t->nreq++;
    if (n > t->max_len) {
        t->max_len = n;
    }
    return KV_OK;
}

#define CHAT_ACTIVE 256
#define CHAT_MAX_LEN 96
#define CHAT_SYS_PROMPTS 8
#define CHAT_SYS_LEN 4

/* Multi-turn chat: CHAT_ACTIVE open conversations; each request continues one of them (recently
 * active ones are likelier), re-sending its whole history plus 2..8 new blocks. Conversations
 * end at random or at CHAT_MAX_LEN and are replaced by new ones. */
static kv_err gen_chat(trace_rng *r, uint32_t nreq, trace_buf *b) {
    uint32_t *hist = calloc((size_t)CHAT_ACTIVE * CHAT_MAX_LEN, sizeof(uint32_t));
    uint32_t len[CHAT_ACTIVE];
    uint32_t next_key = CHAT_SYS_PROMPTS * CHAT_SYS_LEN;
    kv_err err = KV_OK;
    if (hist == NULL) {
        return KV_ENOMEM;
    }
    for (uint32_t c = 0; c < CHAT_ACTIVE; c++) {
        len[c] = 0;
    }
    for (uint32_t q = 0; q < nreq && err == KV_OK; q++) {
        /* Skewed choice: the square of a uniform favours low slots; slots are reordered so a
         * conversation just served moves to the front (recency). */
        double u = rng_unit(r);
        uint32_t c = (uint32_t)(u * u * CHAT_ACTIVE);
        if (c >= CHAT_ACTIVE) {
            c = CHAT_ACTIVE - 1;
        }
        uint32_t *h = hist + (size_t)c * CHAT_MAX_LEN;
        uint32_t add = rng_range(r, 2, 8);
        if (len[c] == 0 || len[c] + add > CHAT_MAX_LEN || rng_unit(r) < 0.08) {
            /* A new conversation: a system prompt, then its first message. */
            uint32_t sp = rng_range(r, 0, CHAT_SYS_PROMPTS - 1);
            for (uint32_t i = 0; i < CHAT_SYS_LEN; i++) {
                h[i] = sp * CHAT_SYS_LEN + i;
            }
            len[c] = CHAT_SYS_LEN;
        }
        for (uint32_t i = 0; i < add; i++) {
            h[len[c]++] = next_key++;
        }
        err = buf_request(b, h, len[c]);
        /* Move slot c to the front. */
        uint32_t tmp[CHAT_MAX_LEN];
        uint32_t tl = len[c];
        memcpy(tmp, h, tl * sizeof(uint32_t));
        memmove(hist + CHAT_MAX_LEN, hist, (size_t)c * CHAT_MAX_LEN * sizeof(uint32_t));
        memmove(len + 1, len, c * sizeof(uint32_t));
        memcpy(hist, tmp, tl * sizeof(uint32_t));
        len[0] = tl;
    }
    b->t.nkeys = next_key;
    free(hist);
    return err;
}

#define SYS_PROMPTS 64
#define SYS_RECENT 64

/* Shared system prompts: a Zipf(1)-popular prompt of 8..32 blocks, then 1..8 blocks of one-off
 * user text; a quarter of requests instead follow up on one of the last SYS_RECENT requests
 * (its whole prefix plus 1..4 new blocks). */
static kv_err gen_sysprompt(trace_rng *r, uint32_t nreq, trace_buf *b) {
    uint32_t plen[SYS_PROMPTS], pbase[SYS_PROMPTS];
    double cdf[SYS_PROMPTS];
    uint32_t next_key = 0;
    double sum = 0;
    for (uint32_t i = 0; i < SYS_PROMPTS; i++) {
        plen[i] = rng_range(r, 8, 32);
        pbase[i] = next_key;
        next_key += plen[i];
        sum += 1.0 / (i + 1);
        cdf[i] = sum;
    }
    uint32_t recent_off[SYS_RECENT];
    uint32_t nrecent = 0;
    uint32_t req[32 + 8 + 4 * 16];
    kv_err err = KV_OK;
    for (uint32_t q = 0; q < nreq && err == KV_OK; q++) {
        uint32_t n = 0;
        if (nrecent > 0 && rng_unit(r) < 0.25) {
            uint32_t pr =
                recent_off[rng_range(r, 0, (nrecent < SYS_RECENT ? nrecent : SYS_RECENT) - 1)];
            uint32_t plen_r = b->t.off[pr + 1] - b->t.off[pr];
            if (plen_r + 4 <= sizeof(req) / sizeof(req[0])) {
                memcpy(req, b->t.keys + b->t.off[pr], plen_r * sizeof(uint32_t));
                n = plen_r;
            }
        }
        if (n == 0) {
            double u = rng_unit(r) * sum;
            uint32_t p = 0;
            while (p + 1 < SYS_PROMPTS && cdf[p] < u) {
                p++;
            }
            for (uint32_t i = 0; i < plen[p]; i++) {
                req[n++] = pbase[p] + i;
            }
            uint32_t user = rng_range(r, 1, 8);
            for (uint32_t i = 0; i < user; i++) {
                req[n++] = next_key++;
            }
        } else {
            uint32_t more = rng_range(r, 1, 4);
            for (uint32_t i = 0; i < more; i++) {
                req[n++] = next_key++;
            }
        }
        recent_off[nrecent++ % SYS_RECENT] = b->t.nreq;
        err = buf_request(b, req, n);
    }
    b->t.nkeys = next_key;
    return err;
}

/* Pareto(xm, alpha): heavy-tailed, P(X > x) = (xm / x)^alpha. */
static double rng_pareto(trace_rng *r, double xm, double alpha) {
    double u = 1.0 - rng_unit(r); /* (0, 1] */
    return xm / pow(u, 1.0 / alpha);
}

#define SESS_SYS_PROMPTS 8
#define SESS_SYS_LEN 4
#define SESS_MAX_LEN 128
#define SESS_MAX_TURNS 40

typedef struct sess_event {
    double when;   /* time of the conversation's next turn */
    uint32_t conv; /* index into the conversation table */
} sess_event;

typedef struct sess_conv {
    uint32_t *hist; /* SESS_MAX_LEN keys */
    uint32_t len;   /* blocks so far */
    uint32_t turns; /* turns left */
} sess_conv;

static void ev_push(sess_event *h, size_t *n, sess_event e) {
    size_t i = (*n)++;
    while (i > 0 && h[(i - 1) / 2].when > e.when) {
        h[i] = h[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    h[i] = e;
}

static sess_event ev_pop(sess_event *h, size_t *n) {
    sess_event top = h[0], last = h[--(*n)];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= *n) {
            break;
        }
        if (c + 1 < *n && h[c + 1].when < h[c].when) {
            c++;
        }
        if (h[c].when >= last.when) {
            break;
        }
        h[i] = h[c];
        i = c;
    }
    if (*n > 0) {
        h[i] = last;
    }
    return top;
}

/* Multi-turn chat sessions in time: conversations arrive as a Poisson process (one per time
 * unit), start with one of SESS_SYS_PROMPTS system prompts and run for a heavy-tailed number
 * of turns (floor of Pareto(1, 1.2): 56% single-turn, a long tail capped at SESS_MAX_TURNS);
 * the user comes back after a heavy-tailed gap (Pareto(2, 1.1) time units: most replies within
 * a few units, some after thousands). Each turn re-sends the history plus 1..4 blocks of user
 * text and 1..12 of the previous answer. Requests are emitted in time order. */
static kv_err gen_sessions(trace_rng *r, uint32_t nreq, trace_buf *b) {
    size_t cap = 1024, nconv = 0, hn = 0;
    sess_conv *conv = calloc(cap, sizeof(sess_conv));
    sess_event *heap = malloc(cap * sizeof(sess_event));
    uint32_t *free_slots = malloc(cap * sizeof(uint32_t));
    size_t nfree = 0;
    uint32_t next_key = SESS_SYS_PROMPTS * SESS_SYS_LEN;
    double next_arrival = 0;
    kv_err err = KV_OK;
    if (conv == NULL || heap == NULL || free_slots == NULL) {
        err = KV_ENOMEM;
        goto cleanup;
    }
    for (uint32_t q = 0; q < nreq && err == KV_OK;) {
        if (hn == 0 || next_arrival < heap[0].when) {
            /* A new conversation. */
            uint32_t c;
            if (nfree > 0) {
                c = free_slots[--nfree];
            } else {
                if (nconv == cap) {
                    size_t nc = cap * 2;
                    sess_conv *cv = realloc(conv, nc * sizeof(sess_conv));
                    if (cv == NULL) {
                        err = KV_ENOMEM;
                        break;
                    }
                    conv = cv;
                    memset(conv + cap, 0, (nc - cap) * sizeof(sess_conv));
                    sess_event *hp = realloc(heap, nc * sizeof(sess_event));
                    uint32_t *fs = realloc(free_slots, nc * sizeof(uint32_t));
                    if (hp != NULL) {
                        heap = hp;
                    }
                    if (fs != NULL) {
                        free_slots = fs;
                    }
                    if (hp == NULL || fs == NULL) {
                        err = KV_ENOMEM;
                        break;
                    }
                    cap = nc;
                }
                c = (uint32_t)nconv++;
                conv[c].hist = malloc(SESS_MAX_LEN * sizeof(uint32_t));
                if (conv[c].hist == NULL) {
                    err = KV_ENOMEM;
                    break;
                }
            }
            uint32_t sp = rng_range(r, 0, SESS_SYS_PROMPTS - 1);
            for (uint32_t i = 0; i < SESS_SYS_LEN; i++) {
                conv[c].hist[i] = sp * SESS_SYS_LEN + i;
            }
            conv[c].len = SESS_SYS_LEN;
            double t = rng_pareto(r, 1.0, 1.2);
            conv[c].turns = t >= SESS_MAX_TURNS ? SESS_MAX_TURNS : (uint32_t)t;
            sess_event e = {next_arrival, c};
            ev_push(heap, &hn, e);
            next_arrival += -log(1.0 - rng_unit(r)); /* exponential, mean 1 */
            continue;
        }
        sess_event e = ev_pop(heap, &hn);
        sess_conv *cv = &conv[e.conv];
        uint32_t add = rng_range(r, 1, 4) + rng_range(r, 1, 12);
        if (cv->len + add > SESS_MAX_LEN) {
            cv->turns = 0; /* the context window is full: the conversation ends */
        } else {
            for (uint32_t i = 0; i < add; i++) {
                cv->hist[cv->len++] = next_key++;
            }
            err = buf_request(b, cv->hist, cv->len);
            q++;
            cv->turns--;
        }
        if (cv->turns > 0) {
            sess_event n = {e.when + rng_pareto(r, 2.0, 1.1), e.conv};
            ev_push(heap, &hn, n);
        } else {
            free_slots[nfree++] = e.conv;
        }
    }
    b->t.nkeys = next_key;
cleanup:
    for (size_t i = 0; conv != NULL && i < nconv; i++) {
        free(conv[i].hist);
    }
    free(conv);
    free(heap);
    free(free_slots);
    return err;
}

#define FS_TASKS 16
#define FS_EXAMPLES 64 /* per task */
#define FS_SHOTS 4

/* Maps (parent key, content) to a block key, so equal prefixes get equal keys (a chain hash
 * depends on everything before it). Open addressing; the table never fills (sized to the
 * trace's blocks). */
typedef struct fs_trie {
    uint64_t *k; /* (parent + 1) << 32 | content, 0 = empty */
    uint32_t *v; /* block key */
    size_t mask; /* slots - 1 */
} fs_trie;

static uint32_t trie_key(fs_trie *t, uint32_t parent, uint32_t content, uint32_t *next_key) {
    uint64_t k = ((uint64_t)parent + 1) << 32 | content;
    size_t i = (size_t)((k * 0x9E3779B97F4A7C15ull) >> 20) & t->mask;
    while (t->k[i] != 0 && t->k[i] != k) {
        i = (i + 1) & t->mask;
    }
    if (t->k[i] == 0) {
        t->k[i] = k;
        t->v[i] = (*next_key)++;
    }
    return t->v[i];
}

/* Few-shot prompts: one of FS_TASKS task instructions (Zipf-popular, 2..6 blocks), then
 * FS_SHOTS examples drawn without repeats from the task's shared pool of FS_EXAMPLES
 * (Zipf-popular, 1..3 blocks each, placed in pool order as a retriever that sorts its hits
 * would), then a one-off query of 1..4 blocks. Two requests share blocks as far as their
 * instruction and examples agree. */
static kv_err gen_fewshot(trace_rng *r, uint32_t nreq, trace_buf *b) {
    uint32_t ilen[FS_TASKS], elen[FS_TASKS][FS_EXAMPLES];
    double tcdf[FS_TASKS], ecdf[FS_EXAMPLES];
    double tsum = 0, esum = 0;
    for (uint32_t i = 0; i < FS_TASKS; i++) {
        ilen[i] = rng_range(r, 2, 6);
        tsum += 1.0 / (i + 1);
        tcdf[i] = tsum;
        for (uint32_t e = 0; e < FS_EXAMPLES; e++) {
            elen[i][e] = rng_range(r, 1, 3);
        }
    }
    for (uint32_t e = 0; e < FS_EXAMPLES; e++) {
        esum += 1.0 / (e + 1);
        ecdf[e] = esum;
    }
    fs_trie tr;
    size_t slots = 1024;
    while (slots < (size_t)nreq * 24) {
        slots <<= 1;
    }
    tr.k = calloc(slots, sizeof(uint64_t));
    tr.v = malloc(slots * sizeof(uint32_t));
    tr.mask = slots - 1;
    uint32_t next_key = 0;
    uint32_t content = 1u << 24; /* one-off query contents */
    kv_err err = tr.k == NULL || tr.v == NULL ? KV_ENOMEM : KV_OK;
    for (uint32_t q = 0; q < nreq && err == KV_OK; q++) {
        uint32_t req[6 + FS_SHOTS * 3 + 4], n = 0, parent = UINT32_MAX;
        double u = rng_unit(r) * tsum;
        uint32_t task = 0;
        while (task + 1 < FS_TASKS && tcdf[task] < u) {
            task++;
        }
        for (uint32_t i = 0; i < ilen[task]; i++) {
            parent = req[n++] = trie_key(&tr, parent, task << 16 | i, &next_key);
        }
        uint8_t pick[FS_EXAMPLES];
        memset(pick, 0, sizeof(pick));
        for (uint32_t s = 0; s < FS_SHOTS;) {
            double v = rng_unit(r) * esum;
            uint32_t e = 0;
            while (e + 1 < FS_EXAMPLES && ecdf[e] < v) {
                e++;
            }
            if (!pick[e]) {
                pick[e] = 1;
                s++;
            }
        }
        for (uint32_t e = 0; e < FS_EXAMPLES; e++) {
            for (uint32_t i = 0; pick[e] && i < elen[task][e]; i++) {
                parent = req[n++] =
                    trie_key(&tr, parent, task << 16 | 1u << 12 | e << 4 | i, &next_key);
            }
        }
        uint32_t ql = rng_range(r, 1, 4);
        for (uint32_t i = 0; i < ql; i++) {
            parent = req[n++] = trie_key(&tr, parent, content++, &next_key);
        }
        err = buf_request(b, req, n);
    }
    b->t.nkeys = next_key;
    free(tr.k);
    free(tr.v);
    return err;
}

#define AG_TYPES 6     /* agent kinds: each has its own system prompt and tool list */
#define AG_ACTIVE 48   /* agents running at once */
#define AG_MAX_LEN 256 /* context window, in blocks */

/* Agentic tool loops: AG_ACTIVE agents (one of AG_TYPES system prompts of 8..24 blocks, then a
 * task of 1..4 blocks) each loop: the model writes a tool call (1..3 blocks), the tool answers
 * with a heavy-tailed result (floor of Pareto(2, 1.3) blocks, at most 48: most small, some
 * whole files), and the next step re-sends everything. An agent picked to step is uniform among
 * the active ones; 10% of steps fork a sub-agent that continues from a copy of the context
 * (both branches live on), an agent ends at the window or with probability 4% per step and a
 * new one takes its slot. */
static kv_err gen_agent(trace_rng *r, uint32_t nreq, trace_buf *b) {
    uint32_t *hist = malloc((size_t)AG_ACTIVE * AG_MAX_LEN * sizeof(uint32_t));
    uint32_t len[AG_ACTIVE], plen[AG_TYPES], pbase[AG_TYPES];
    uint32_t next_key = 0;
    if (hist == NULL) {
        return KV_ENOMEM;
    }
    for (uint32_t i = 0; i < AG_TYPES; i++) {
        plen[i] = rng_range(r, 8, 24);
        pbase[i] = next_key;
        next_key += plen[i];
    }
    for (uint32_t a = 0; a < AG_ACTIVE; a++) {
        len[a] = 0;
    }
    kv_err err = KV_OK;
    for (uint32_t q = 0; q < nreq && err == KV_OK; q++) {
        uint32_t a = rng_range(r, 0, AG_ACTIVE - 1);
        uint32_t *h = hist + (size_t)a * AG_MAX_LEN;
        double pr = rng_pareto(r, 2.0, 1.3);
        uint32_t add = rng_range(r, 1, 3) + (pr > 48 ? 48 : (uint32_t)pr);
        if (len[a] == 0 || len[a] + add > AG_MAX_LEN || rng_unit(r) < 0.04) {
            uint32_t ty = rng_range(r, 0, AG_TYPES - 1);
            for (uint32_t i = 0; i < plen[ty]; i++) {
                h[i] = pbase[ty] + i;
            }
            len[a] = plen[ty];
            uint32_t task = rng_range(r, 1, 4);
            for (uint32_t i = 0; i < task; i++) {
                h[len[a]++] = next_key++;
            }
        } else if (rng_unit(r) < 0.10) {
            /* Fork: a sub-agent replaces another slot with a copy of this context. */
            uint32_t c = rng_range(r, 0, AG_ACTIVE - 1);
            if (c != a) {
                memcpy(hist + (size_t)c * AG_MAX_LEN, h, len[a] * sizeof(uint32_t));
                len[c] = len[a];
            }
        }
        for (uint32_t i = 0; i < add && len[a] < AG_MAX_LEN; i++) {
            h[len[a]++] = next_key++;
        }
        err = buf_request(b, h, len[a]);
    }
    b->t.nkeys = next_key;
    free(hist);
    return err;
}

#define RAG_DOCS 2048 /* chunks in the corpus */
#define RAG_SYS_LEN 6
#define RAG_RECENT 32

/* Retrieval-augmented generation: a shared system prompt (RAG_SYS_LEN blocks), then 3..5
 * chunks of 2..6 blocks retrieved from a corpus of RAG_DOCS (Zipf(0.9)-popular, so popular
 * chunks recur, but in the order of each query's scores: random), then a question of 1..3
 * blocks. Two requests share blocks as far as their chunk lists agree in order. A fifth of the
 * requests follow up one of the last RAG_RECENT requests: its whole prefix, 2..8 answer
 * blocks and a new question. */
static kv_err gen_rag(trace_rng *r, uint32_t nreq, trace_buf *b) {
    uint32_t *clen = malloc(RAG_DOCS * sizeof(uint32_t));
    double *cdf = malloc(RAG_DOCS * sizeof(double));
    fs_trie tr;
    size_t slots = 1024;
    while (slots < (size_t)nreq * 96) {
        slots <<= 1;
    }
    tr.k = calloc(slots, sizeof(uint64_t));
    tr.v = malloc(slots * sizeof(uint32_t));
    tr.mask = slots - 1;
    kv_err err = clen == NULL || cdf == NULL || tr.k == NULL || tr.v == NULL ? KV_ENOMEM : KV_OK;
    double sum = 0;
    for (uint32_t d = 0; err == KV_OK && d < RAG_DOCS; d++) {
        clen[d] = rng_range(r, 2, 6);
        sum += pow(d + 1.0, -0.9);
        cdf[d] = sum;
    }
    uint32_t next_key = 0, content = 1u << 24, recent[RAG_RECENT], nrecent = 0;
    uint32_t req[RAG_SYS_LEN + 5 * 6 + 3 + 8 * 11];
    for (uint32_t q = 0; q < nreq && err == KV_OK; q++) {
        uint32_t n = 0, parent = UINT32_MAX;
        if (nrecent > 0 && rng_unit(r) < 0.2) {
            uint32_t pr =
                recent[rng_range(r, 0, (nrecent < RAG_RECENT ? nrecent : RAG_RECENT) - 1)];
            uint32_t pl = b->t.off[pr + 1] - b->t.off[pr];
            if (pl + 11 <= sizeof(req) / sizeof(req[0])) {
                memcpy(req, b->t.keys + b->t.off[pr], pl * sizeof(uint32_t));
                n = pl;
                parent = req[n - 1];
                uint32_t more = rng_range(r, 2, 8) + rng_range(r, 1, 3);
                for (uint32_t i = 0; i < more; i++) {
                    parent = req[n++] = trie_key(&tr, parent, content++, &next_key);
                }
            }
        }
        if (n == 0) {
            for (uint32_t i = 0; i < RAG_SYS_LEN; i++) {
                parent = req[n++] = trie_key(&tr, parent, i, &next_key);
            }
            uint32_t k = rng_range(r, 3, 5), picked[5];
            for (uint32_t j = 0; j < k;) {
                double u = rng_unit(r) * sum;
                uint32_t lo = 0, hi = RAG_DOCS - 1;
                while (lo < hi) {
                    uint32_t mid = (lo + hi) / 2;
                    if (cdf[mid] < u) {
                        lo = mid + 1;
                    } else {
                        hi = mid;
                    }
                }
                int dup = 0;
                for (uint32_t i = 0; i < j; i++) {
                    dup |= picked[i] == lo;
                }
                if (!dup) {
                    picked[j++] = lo;
                }
            }
            for (uint32_t j = 0; j < k; j++) {
                for (uint32_t i = 0; i < clen[picked[j]]; i++) {
                    parent = req[n++] =
                        trie_key(&tr, parent, 1u << 20 | picked[j] << 3 | i, &next_key);
                }
            }
            uint32_t ql = rng_range(r, 1, 3);
            for (uint32_t i = 0; i < ql; i++) {
                parent = req[n++] = trie_key(&tr, parent, content++, &next_key);
            }
        }
        recent[nrecent++ % RAG_RECENT] = b->t.nreq;
        err = buf_request(b, req, n);
    }
    b->t.nkeys = next_key;
    free(clen);
    free(cdf);
    free(tr.k);
    free(tr.v);
    return err;
}

#define PAR_PROMPTS 32 /* shared few-shot prompts some groups start with */
#define PAR_LATER 64   /* best-of-n winners waiting for their next turn */

/* Parallel sampling, beam search and best-of-n: each group is one prompt (40%: one of
 * PAR_PROMPTS shared few-shot prompts of 8..16 blocks and a one-off question of 1..4; else a
 * one-off prompt of 4..32 blocks) and n = 2..8 continuations sent one after another: parallel
 * samples (each its own 4..16 blocks) or, for a third of the groups, beams that share their
 * first 2..6 continuation blocks in pairs. The winner of a quarter of the groups comes back
 * later (1..64 groups on) with its whole text and 2..6 new blocks. */
static kv_err gen_parallel(trace_rng *r, uint32_t nreq, trace_buf *b) {
    uint32_t plen[PAR_PROMPTS], pbase[PAR_PROMPTS];
    uint32_t next_key = 0;
    for (uint32_t i = 0; i < PAR_PROMPTS; i++) {
        plen[i] = rng_range(r, 8, 16);
        pbase[i] = next_key;
        next_key += plen[i];
    }
    uint32_t later_req[PAR_LATER], later_at[PAR_LATER], nlater = 0, group = 0;
    uint32_t req[16 + 4 + 32 + 16 + 16 * 6], prompt[64], pn, shared[6], sn = 0;
    kv_err err = KV_OK;
    for (uint32_t q = 0; q < nreq && err == KV_OK; group++) {
        for (uint32_t i = 0; i < nlater && q < nreq && err == KV_OK; i++) {
            if (later_at[i] != group) {
                continue;
            }
            uint32_t pr = later_req[i], pl = b->t.off[pr + 1] - b->t.off[pr];
            if (pl + 6 <= sizeof(req) / sizeof(req[0])) {
                memcpy(req, b->t.keys + b->t.off[pr], pl * sizeof(uint32_t));
                uint32_t more = rng_range(r, 2, 6);
                for (uint32_t j = 0; j < more; j++) {
                    req[pl + j] = next_key++;
                }
                err = buf_request(b, req, pl + more);
                q++;
            }
            later_req[i] = later_req[nlater - 1];
            later_at[i] = later_at[nlater - 1];
            nlater--;
            i--;
        }
        pn = 0;
        if (rng_unit(r) < 0.4) {
            uint32_t sp = rng_range(r, 0, PAR_PROMPTS - 1);
            for (uint32_t i = 0; i < plen[sp]; i++) {
                prompt[pn++] = pbase[sp] + i;
            }
            uint32_t ql = rng_range(r, 1, 4);
            for (uint32_t i = 0; i < ql; i++) {
                prompt[pn++] = next_key++;
            }
        } else {
            uint32_t l = rng_range(r, 4, 32);
            for (uint32_t i = 0; i < l; i++) {
                prompt[pn++] = next_key++;
            }
        }
        uint32_t n = rng_range(r, 2, 8);
        int beams = rng_unit(r) < 1.0 / 3;
        uint32_t winner = rng_range(r, 0, n - 1), first = b->t.nreq;
        for (uint32_t s = 0; s < n && q < nreq && err == KV_OK; s++) {
            uint32_t m = pn;
            memcpy(req, prompt, pn * sizeof(uint32_t));
            if (beams) {
                if (s % 2 == 0) {
                    sn = rng_range(r, 2, 6);
                    for (uint32_t i = 0; i < sn; i++) {
                        shared[i] = next_key++;
                    }
                }
                memcpy(req + m, shared, sn * sizeof(uint32_t));
                m += sn;
            }
            uint32_t cl = rng_range(r, 4, 16);
            for (uint32_t i = 0; i < cl; i++) {
                req[m++] = next_key++;
            }
            err = buf_request(b, req, m);
            q++;
        }
        if (rng_unit(r) < 0.25 && nlater < PAR_LATER && first + winner < b->t.nreq) {
            later_req[nlater] = first + winner;
            later_at[nlater++] = group + rng_range(r, 1, 64);
        }
    }
    b->t.nkeys = next_key;
    return err;
}

#define SH_PROMPTS 512
#define SH_PHASES 6

/* A mix whose popular set shifts: half the requests are shared-prompt requests (a Zipf(1.1)
 * rank among SH_PROMPTS prompts of 6..20 blocks, then 1..6 one-off blocks), half continue one of
 * 64 open conversations (as multi-turn chat, picked by recency rank, 2..6 blocks a turn, at
 * most 64 blocks). The rank -> prompt map is redrawn SH_PHASES times over the trace, so what
 * was popular goes cold at once and a new set takes over; the prompts/chat share drifts from
 * 70/30 to 30/70 across the trace too. */
static kv_err gen_shift(trace_rng *r, uint32_t nreq, trace_buf *b) {
    uint32_t plen[SH_PROMPTS], pbase[SH_PROMPTS], perm[SH_PROMPTS];
    double cdf[SH_PROMPTS], sum = 0;
    uint32_t next_key = 0;
    for (uint32_t i = 0; i < SH_PROMPTS; i++) {
        plen[i] = rng_range(r, 6, 20);
        pbase[i] = next_key;
        next_key += plen[i];
        perm[i] = i;
        sum += pow(i + 1.0, -1.1);
        cdf[i] = sum;
    }
    uint32_t conv[64][64], clen[64];
    memset(clen, 0, sizeof(clen));
    uint32_t req[64];
    kv_err err = KV_OK;
    uint32_t phase_len = nreq / SH_PHASES ? nreq / SH_PHASES : 1;
    for (uint32_t q = 0; q < nreq && err == KV_OK; q++) {
        if (q % phase_len == 0) {
            for (uint32_t i = SH_PROMPTS - 1; i > 0; i--) { /* Fisher-Yates */
                uint32_t j = rng_range(r, 0, i), t = perm[i];
                perm[i] = perm[j];
                perm[j] = t;
            }
        }
        double pshare = 0.7 - 0.4 * q / nreq;
        uint32_t n = 0;
        if (rng_unit(r) < pshare) {
            double u = rng_unit(r) * sum;
            uint32_t k = 0;
            while (k + 1 < SH_PROMPTS && cdf[k] < u) {
                k++;
            }
            uint32_t pp = perm[k];
            for (uint32_t i = 0; i < plen[pp]; i++) {
                req[n++] = pbase[pp] + i;
            }
            uint32_t user = rng_range(r, 1, 6);
            for (uint32_t i = 0; i < user; i++) {
                req[n++] = next_key++;
            }
            err = buf_request(b, req, n);
            continue;
        }
        double u = rng_unit(r);
        uint32_t c = (uint32_t)(u * u * 64);
        c = c >= 64 ? 63 : c;
        uint32_t add = rng_range(r, 2, 6);
        if (clen[c] == 0 || clen[c] + add > 64 || rng_unit(r) < 0.1) {
            clen[c] = 0;
        }
        for (uint32_t i = 0; i < add; i++) {
            conv[c][clen[c]++] = next_key++;
        }
        uint32_t tl = clen[c];
        memcpy(req, conv[c], tl * sizeof(uint32_t));
        err = buf_request(b, req, tl);
        /* Move conversation c to the front (recency ranks). */
        memmove(conv[1], conv[0], (size_t)c * sizeof(conv[0]));
        memmove(clen + 1, clen, c * sizeof(uint32_t));
        memcpy(conv[0], req, tl * sizeof(uint32_t));
        clen[0] = tl;
    }
    b->t.nkeys = next_key;
    return err;
}

kv_err kvd_trace_gen(kvd_trace_kind kind, uint64_t seed, uint32_t nreq, kvd_trace *out) {
    if (nreq == 0 || kind < KVD_TRACE_CHAT || kind > KVD_TRACE_SHIFT) {
        return KV_EINVAL;
    }
    trace_rng r = {seed};
    trace_buf b;
    memset(&b, 0, sizeof(b));
    kv_err err = kind == KVD_TRACE_CHAT        ? gen_chat(&r, nreq, &b)
                 : kind == KVD_TRACE_SYSPROMPT ? gen_sysprompt(&r, nreq, &b)
                 : kind == KVD_TRACE_SESSIONS  ? gen_sessions(&r, nreq, &b)
                 : kind == KVD_TRACE_FEWSHOT   ? gen_fewshot(&r, nreq, &b)
                 : kind == KVD_TRACE_AGENT     ? gen_agent(&r, nreq, &b)
                 : kind == KVD_TRACE_RAG       ? gen_rag(&r, nreq, &b)
                 : kind == KVD_TRACE_PARALLEL  ? gen_parallel(&r, nreq, &b)
                                               : gen_shift(&r, nreq, &b);
    if (err != KV_OK) {
        kvd_trace_fini(&b.t);
        return err;
    }
    *out = b.t;
    return KV_OK;
}

/* Distinct hash strings of a trace file -> keys: open addressing over 64-bit fingerprints of
 * the text (two different hashes that collide in 64 bits would merge: 2^-64 per pair). */
typedef struct load_map {
    uint64_t *fp;  /* fingerprint | 1, 0 = empty */
    uint32_t *key; /* its key */
    size_t mask;   /* slots - 1 */
    uint32_t n;    /* keys given */
} load_map;

static kv_err map_key(load_map *m, uint64_t fp, uint32_t *key) {
    if ((size_t)m->n * 2 >= m->mask) {
        size_t nslots = (m->mask + 1) * 2;
        uint64_t *nf = calloc(nslots, sizeof(uint64_t));
        uint32_t *nk = malloc(nslots * sizeof(uint32_t));
        if (nf == NULL || nk == NULL) {
            free(nf);
            free(nk);
            return KV_ENOMEM;
        }
        for (size_t i = 0; i <= m->mask; i++) {
            if (m->fp[i] != 0) {
                size_t j = (size_t)(m->fp[i] * 0x9E3779B97F4A7C15ull >> 17) & (nslots - 1);
                while (nf[j] != 0) {
                    j = (j + 1) & (nslots - 1);
                }
                nf[j] = m->fp[i];
                nk[j] = m->key[i];
            }
        }
        free(m->fp);
        free(m->key);
        m->fp = nf;
        m->key = nk;
        m->mask = nslots - 1;
    }
    fp |= 1;
    size_t i = (size_t)(fp * 0x9E3779B97F4A7C15ull >> 17) & m->mask;
    while (m->fp[i] != 0 && m->fp[i] != fp) {
        i = (i + 1) & m->mask;
    }
    if (m->fp[i] == 0) {
        m->fp[i] = fp;
        m->key[i] = m->n++;
    }
    *key = m->key[i];
    return KV_OK;
}

kv_err kvd_trace_load(const char *path, kvd_trace *out) {
    FILE *f = fopen(path, "r");
    if (f == NULL) {
        return KV_ENOENT;
    }
    trace_buf b;
    memset(&b, 0, sizeof(b));
    load_map m = {calloc(1024, sizeof(uint64_t)), malloc(1024 * sizeof(uint32_t)), 1023, 0};
    size_t rcap = 256, n = 0;
    uint32_t *req = malloc(rcap * sizeof(uint32_t));
    char *line = NULL;
    size_t lcap = 0;
    kv_err err = m.fp == NULL || m.key == NULL || req == NULL ? KV_ENOMEM : KV_OK;
    while (err == KV_OK && getline(&line, &lcap, f) >= 0) {
        n = 0;
        char *c = line;
        while (err == KV_OK) {
            while (*c != '\0' && isspace((unsigned char)*c)) {
                c++;
            }
            if (*c == '\0' || *c == '#') {
                break;
            }
            /* One hash: hex digits (a 128-bit chain hash is 32; any length is taken). */
            uint64_t h = 0xCBF29CE484222325ull;
            size_t digits = 0;
            for (; *c != '\0' && !isspace((unsigned char)*c); c++, digits++) {
                if (!isxdigit((unsigned char)*c)) {
                    err = KV_EINVAL;
                    break;
                }
                h = (h ^ (uint64_t)tolower((unsigned char)*c)) * 0x100000001B3ull;
            }
            if (err != KV_OK || digits == 0) {
                break;
            }
            if (n == rcap) {
                uint32_t *nr = realloc(req, rcap * 2 * sizeof(uint32_t));
                if (nr == NULL) {
                    err = KV_ENOMEM;
                    break;
                }
                req = nr;
                rcap *= 2;
            }
            err = map_key(&m, h, &req[n]);
            n++;
        }
        if (err == KV_OK && n > 0) {
            err = buf_request(&b, req, (uint32_t)n);
        }
    }
    if (err == KV_OK && b.t.nreq == 0) {
        err = KV_EINVAL;
    }
    b.t.nkeys = m.n;
    free(line);
    free(req);
    free(m.fp);
    free(m.key);
    fclose(f);
    if (err != KV_OK) {
        kvd_trace_fini(&b.t);
        return err;
    }
    *out = b.t;
    return KV_OK;
}

kv_err kvd_trace_save(const kvd_trace *t, const char *path) {
    FILE *f = fopen(path, "w");
    if (f == NULL) {
        return KV_ESYS;
    }
    fprintf(f, "# kvd trace: one request per line, its block hashes in prefix order\n");
    for (uint32_t q = 0; q < t->nreq; q++) {
        for (uint32_t p = t->off[q]; p < t->off[q + 1]; p++) {
            kv_hash128 h = kvd_trace_hash(t->keys[p]);
            fprintf(f, "%s%016llx%016llx", p == t->off[q] ? "" : " ", (unsigned long long)h.hi,
                    (unsigned long long)h.lo);
        }
        fputc('\n', f);
    }
    return fclose(f) == 0 ? KV_OK : KV_ESYS;
}

void kvd_trace_fini(kvd_trace *t) {
    if (t == NULL) {
        return;
    }
    free(t->off);
    free(t->keys);
    memset(t, 0, sizeof(*t));
}

/* A pool of capacity blocks with policy, for a replay (one segment, small blocks). */
typedef struct replay_pool {
    kvd_index *idx;
    kvd_pool *pool;
    kvd_block_ref *refs; /* [max_len] */
} replay_pool;

static void replay_pool_close(replay_pool *r) {
    kvd_pool_free(r->pool);
    kvd_index_free(r->idx);
    free(r->refs);
    memset(r, 0, sizeof(*r));
}

static kv_err replay_pool_open(replay_pool *r, kvd_evict_policy policy, uint32_t capacity,
                               uint32_t max_len) {
    memset(r, 0, sizeof(*r));
    kvd_pool_config cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.pool_id = 1;
    kv_err err = kv_layout_init(1, 1, 8, 16, KV_DTYPE_FP16, KV_BLOCK_MAJOR, &cfg.layout);
    if (err != KV_OK) {
        return err;
    }
    cfg.blocks_per_segment = capacity;
    cfg.max_segments = 1;
    cfg.policy = policy;
    r->refs = calloc(max_len, sizeof(kvd_block_ref));
    if (r->refs == NULL) {
        return KV_ENOMEM;
    }
    err = kvd_index_alloc(capacity, &r->idx);
    if (err == KV_OK) {
        err = kvd_pool_alloc(&cfg, r->idx, &kvd_backend_malloc, NULL, &r->pool);
    }
    if (err != KV_OK) {
        replay_pool_close(r);
    }
    return err;
}

/* One request of n hashes at time now: looks up its prefix (checking every hit), allocates and
 * commits the rest, releases everything; adds to *res. KV_EINTERNAL on a wrong result or a
 * failed allocation (every other block is released: it must fit). The pool's clock is set
 * before each of the four calls, as kvd sets it for each request of a client: each call gets
 * its own age stamp (a block an allocation rotates is older than the blocks released after). */
static kv_err replay_request(replay_pool *r, const kv_hash128 *hs, uint32_t n, uint64_t now,
                             kvd_trace_result *res) {
    kvd_pool *pool = r->pool;
    kvd_block_ref *refs = r->refs;
    kvd_pool_set_now(pool, now);
    size_t nhit = 0;
    kv_err err = kvd_pool_lookup(pool, 0, hs, n, refs, &nhit);
    if (err != KV_OK) {
        return err;
    }
    for (size_t i = 0; i < nhit; i++) {
        kvd_block_info info;
        if (kvd_pool_block_info(pool, refs[i].id, &info) != KV_OK ||
            !kv_hash_eq(info.hash, hs[i]) || info.state != KVD_BLOCK_COMMITTED ||
            info.gen != refs[i].gen) {
            return KV_EINTERNAL;
        }
    }
    res->query_blocks += n;
    res->hit_blocks += nhit;
    uint32_t need = n - (uint32_t)nhit;
    kvd_pool_set_now(pool, now);
    if (need > 0 && kvd_pool_allocate(pool, need, 1, 0, refs + nhit) != KV_OK) {
        return KV_EINTERNAL;
    }
    kvd_pool_set_now(pool, now);
    for (uint32_t i = (uint32_t)nhit; i < n; i++) {
        uint32_t parent = i == 0 ? KVD_NO_BLOCK : refs[i - 1].id;
        kvd_block_ref c;
        err = kvd_pool_commit(pool, 1, refs[i], hs[i], parent, &c);
        if (err != KV_OK) {
            return err;
        }
        if (c.id != refs[i].id) {
            res->duplicates++;
        }
        refs[i] = c;
    }
    kvd_pool_set_now(pool, now);
    return kvd_pool_release(pool, 1, 0, refs, n);
}

/* The replay of kvd_trace_replay, with set dueling (daemon/core/duel.h) when duel is set
 * (ADAPTIVE only): see evict_trace.h. */
static kv_err replay(const kvd_trace *t, kvd_evict_policy policy, uint32_t capacity_blocks,
                     uint32_t check_every, int duel, kvd_trace_result *out) {
    if (capacity_blocks < t->max_len || capacity_blocks == 0) {
        return KV_EINVAL;
    }
    kvd_trace_result res = {0, 0, 0};
    replay_pool main;
    kvd_duel *d = NULL;
    kv_hash128 *hs = calloc(t->max_len, sizeof(kv_hash128));
    kv_err err =
        hs == NULL ? KV_ENOMEM : replay_pool_open(&main, policy, capacity_blocks, t->max_len);
    if (err != KV_OK) {
        free(hs);
        return err;
    }
    if (duel && policy == KVD_EVICT_ADAPTIVE) {
        err = kvd_duel_alloc(&d);
    }
    for (uint32_t q = 0; q < t->nreq && err == KV_OK; q++) {
        const uint32_t *keys = t->keys + t->off[q];
        uint32_t n = t->off[q + 1] - t->off[q];
        for (uint32_t i = 0; i < n; i++) {
            hs[i] = kvd_trace_hash(keys[i]);
        }
        if (d != NULL) {
            err = kvd_duel_observe(d, hs, n, q);
            while (err == KV_OK && kvd_duel_pending(d) > 0) {
                err = kvd_duel_step(d, main.pool);
            }
        }
        if (err == KV_OK) {
            err = replay_request(&main, hs, n, q, &res);
        }
        if (err == KV_OK &&
            ((check_every != 0 && (q + 1) % check_every == 0) || q + 1 == t->nreq)) {
            err = kvd_pool_check(main.pool);
            if (err == KV_OK && d != NULL) {
                err = kvd_duel_check(d);
            }
        }
    }
    if (err == KV_OK) {
        *out = res;
    }
    kvd_duel_free(d);
    replay_pool_close(&main);
    free(hs);
    return err;
}

kv_err kvd_trace_replay(const kvd_trace *t, kvd_evict_policy policy, uint32_t capacity_blocks,
                        uint32_t check_every, kvd_trace_result *out) {
    return replay(t, policy, capacity_blocks, check_every, 0, out);
}

kv_err kvd_trace_replay_duel(const kvd_trace *t, uint32_t capacity_blocks, uint32_t check_every,
                             kvd_trace_result *out) {
    return replay(t, KVD_EVICT_ADAPTIVE, capacity_blocks, check_every, 1, out);
}

typedef struct heap_ent {
    uint64_t next; /* position of the next use, UINT64_MAX for never */
    uint32_t key;
} heap_ent;

static void heap_push(heap_ent *h, size_t *n, heap_ent e) {
    size_t i = (*n)++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (h[p].next >= e.next) {
            break;
        }
        h[i] = h[p];
        i = p;
    }
    h[i] = e;
}

static heap_ent heap_pop(heap_ent *h, size_t *n) {
    heap_ent top = h[0];
    heap_ent last = h[--(*n)];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= *n) {
            break;
        }
        if (c + 1 < *n && h[c + 1].next > h[c].next) {
            c++;
        }
        if (h[c].next <= last.next) {
            break;
        }
        h[i] = h[c];
        i = c;
    }
    if (*n > 0) {
        h[i] = last;
    }
    return top;
}

/* A cached key of the request being served: its heap entries are all stale (no entry carries
 * this value), so no pop can take it, and it gets one fresh entry when the request ends. */
#define BELADY_IN_USE (UINT64_MAX - 1)

kv_err kvd_trace_belady(const kvd_trace *t, uint32_t capacity_blocks, kvd_trace_result *out) {
    if (capacity_blocks < t->max_len || capacity_blocks == 0) {
        return KV_EINVAL;
    }
    size_t total = t->nreq ? t->off[t->nreq] : 0;
    kv_err err = KV_OK;
    uint64_t *next = malloc((total + 1) * sizeof(uint64_t));
    uint64_t *last = malloc(((size_t)t->nkeys + 1) * sizeof(uint64_t));
    uint64_t *cur = malloc(((size_t)t->nkeys + 1) * sizeof(uint64_t)); /* next use if cached */
    uint8_t *cached = calloc((size_t)t->nkeys + 1, 1);
    /* One entry per access: each access pushes one, after its request. */
    heap_ent *heap = malloc((total + 1) * sizeof(heap_ent));
    kvd_trace_result res = {0, 0, 0};
    if (!next || !last || !cur || !cached || !heap) {
        err = KV_ENOMEM;
        goto cleanup;
    }
    for (size_t k = 0; k < t->nkeys; k++) {
        last[k] = UINT64_MAX;
    }
    for (size_t p = total; p-- > 0;) {
        next[p] = last[t->keys[p]];
        last[t->keys[p]] = p;
    }
    size_t hn = 0, ncached = 0;
    for (uint32_t q = 0; q < t->nreq; q++) {
        uint32_t lo = t->off[q], hi = t->off[q + 1];
        uint32_t hits = 0;
        while (lo + hits < hi && cached[t->keys[lo + hits]]) {
            hits++;
        }
        res.query_blocks += hi - lo;
        res.hit_blocks += hits;
        for (uint32_t p = lo; p < hi; p++) {
            uint32_t k = t->keys[p];
            if (cached[k]) {
                cur[k] = BELADY_IN_USE;
                continue;
            }
            if (ncached == capacity_blocks) {
                /* Farthest next use first; stale and in-use entries are dropped as met. A
                 * cached key outside the request always has a current entry, and one exists
                 * since the request (<= capacity) cannot hold every cached key and this one. */
                for (;;) {
                    heap_ent e = heap_pop(heap, &hn);
                    if (cached[e.key] && cur[e.key] == e.next) {
                        cached[e.key] = 0;
                        ncached--;
                        break;
                    }
                }
            }
            cached[k] = 1;
            cur[k] = BELADY_IN_USE;
            ncached++;
        }
        for (uint32_t p = lo; p < hi; p++) {
            cur[t->keys[p]] = next[p]; /* a key twice in a request: the later use wins */
        }
        for (uint32_t p = lo; p < hi; p++) {
            heap_ent e = {next[p], t->keys[p]};
            heap_push(heap, &hn, e);
        }
    }
    *out = res;
cleanup:
    free(next);
    free(last);
    free(cur);
    free(cached);
    free(heap);
    return err;
}
