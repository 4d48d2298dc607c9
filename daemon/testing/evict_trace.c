/* kvd_trace: synthetic traces, replay against a pool, Belady's optimum (see evict_trace.h).
 *
 * Generators use their own splitmix64 stream so a seed means the same trace everywhere. Belady
 * runs on a max-heap of (next use, key) with lazy deletion: a key's entry is current only while
 * its recorded next use matches.
 */
#include "daemon/testing/evict_trace.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

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

kv_err kvd_trace_gen(kvd_trace_kind kind, uint64_t seed, uint32_t nreq, kvd_trace *out) {
    if (nreq == 0 || kind < KVD_TRACE_CHAT || kind > KVD_TRACE_FEWSHOT) {
        return KV_EINVAL;
    }
    trace_rng r = {seed};
    trace_buf b;
    memset(&b, 0, sizeof(b));
    kv_err err = kind == KVD_TRACE_CHAT        ? gen_chat(&r, nreq, &b)
                 : kind == KVD_TRACE_SYSPROMPT ? gen_sysprompt(&r, nreq, &b)
                 : kind == KVD_TRACE_SESSIONS  ? gen_sessions(&r, nreq, &b)
                                               : gen_fewshot(&r, nreq, &b);
    if (err != KV_OK) {
        kvd_trace_fini(&b.t);
        return err;
    }
    *out = b.t;
    return KV_OK;
}

void kvd_trace_fini(kvd_trace *t) {
    if (t == NULL) {
        return;
    }
    free(t->off);
    free(t->keys);
    memset(t, 0, sizeof(*t));
}

kv_err kvd_trace_replay(const kvd_trace *t, kvd_evict_policy policy, uint32_t capacity_blocks,
                        uint32_t check_every, kvd_trace_result *out) {
    if (capacity_blocks < t->max_len || capacity_blocks == 0) {
        return KV_EINVAL;
    }
    kvd_trace_result res = {0, 0, 0};
    kvd_pool_config cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.pool_id = 1;
    kv_err err = kv_layout_init(1, 1, 8, 16, KV_DTYPE_FP16, KV_BLOCK_MAJOR, &cfg.layout);
    if (err != KV_OK) {
        return err;
    }
    cfg.blocks_per_segment = capacity_blocks;
    cfg.max_segments = 1;
    cfg.policy = policy;
    kvd_index *idx = NULL;
    kvd_pool *pool = NULL;
    kv_hash128 *hs = calloc(t->max_len, sizeof(kv_hash128));
    kvd_block_ref *refs = calloc(t->max_len, sizeof(kvd_block_ref));
    if (hs == NULL || refs == NULL) {
        err = KV_ENOMEM;
        goto cleanup;
    }
    err = kvd_index_alloc(capacity_blocks, &idx);
    if (err != KV_OK) {
        goto cleanup;
    }
    err = kvd_pool_alloc(&cfg, idx, &kvd_backend_malloc, NULL, &pool);
    if (err != KV_OK) {
        goto cleanup;
    }
    for (uint32_t q = 0; q < t->nreq; q++) {
        const uint32_t *keys = t->keys + t->off[q];
        uint32_t n = t->off[q + 1] - t->off[q];
        for (uint32_t i = 0; i < n; i++) {
            hs[i] = kvd_trace_hash(keys[i]);
        }
        kvd_pool_set_now(pool, q);
        size_t nhit = 0;
        err = kvd_pool_lookup(pool, 0, hs, n, refs, &nhit);
        if (err != KV_OK) {
            goto cleanup;
        }
        for (size_t i = 0; i < nhit; i++) {
            kvd_block_info info;
            if (kvd_pool_block_info(pool, refs[i].id, &info) != KV_OK ||
                !kv_hash_eq(info.hash, hs[i]) || info.state != KVD_BLOCK_COMMITTED ||
                info.gen != refs[i].gen) {
                err = KV_EINTERNAL;
                goto cleanup;
            }
        }
        res.query_blocks += n;
        res.hit_blocks += nhit;
        uint32_t need = n - (uint32_t)nhit;
        if (need > 0) {
            err = kvd_pool_allocate(pool, need, 1, 0, refs + nhit);
            if (err != KV_OK) {
                err = KV_EINTERNAL; /* every other block is released: it must fit */
                goto cleanup;
            }
        }
        for (uint32_t i = (uint32_t)nhit; i < n; i++) {
            uint32_t parent = i == 0 ? KVD_NO_BLOCK : refs[i - 1].id;
            kvd_block_ref c;
            err = kvd_pool_commit(pool, 1, refs[i], hs[i], parent, &c);
            if (err != KV_OK) {
                goto cleanup;
            }
            if (c.id != refs[i].id) {
                res.duplicates++;
            }
            refs[i] = c;
        }
        err = kvd_pool_release(pool, 1, 0, refs, n);
        if (err != KV_OK) {
            goto cleanup;
        }
        if (check_every != 0 && (q + 1) % check_every == 0) {
            err = kvd_pool_check(pool);
            if (err != KV_OK) {
                goto cleanup;
            }
        }
    }
    err = kvd_pool_check(pool);
    if (err == KV_OK) {
        *out = res;
    }
cleanup:
    kvd_pool_free(pool);
    kvd_index_free(idx);
    free(hs);
    free(refs);
    return err;
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
    uint32_t *in_req = calloc((size_t)t->nkeys + 1, sizeof(uint32_t)); /* request + 1 */
    /* Every access pushes one entry, and so can each set-aside entry per request. */
    heap_ent *heap = malloc((total + (size_t)t->max_len + 1) * sizeof(heap_ent));
    heap_ent *aside = malloc(((size_t)t->max_len + 1) * sizeof(heap_ent));
    kvd_trace_result res = {0, 0, 0};
    if (!next || !last || !cur || !cached || !in_req || !heap || !aside) {
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
            in_req[t->keys[p]] = q + 1;
        }
        for (uint32_t p = lo; p < hi; p++) {
            uint32_t k = t->keys[p];
            if (!cached[k]) {
                if (ncached == capacity_blocks) {
                    size_t na = 0;
                    for (;;) {
                        heap_ent e = heap_pop(heap, &hn);
                        if (!cached[e.key] || cur[e.key] != e.next) {
                            continue; /* stale */
                        }
                        if (in_req[e.key] == q + 1) {
                            aside[na++] = e; /* in use by this request */
                            continue;
                        }
                        cached[e.key] = 0;
                        ncached--;
                        break;
                    }
                    for (size_t i = 0; i < na; i++) {
                        heap_push(heap, &hn, aside[i]);
                    }
                }
                cached[k] = 1;
                ncached++;
            }
            cur[k] = next[p];
            heap_ent e = {next[p], k};
            heap_push(heap, &hn, e);
            if (hn > total) {
                /* Compact: keep only current entries. */
                size_t w = 0;
                for (size_t i = 0; i < hn; i++) {
                    if (cached[heap[i].key] && cur[heap[i].key] == heap[i].next) {
                        heap[w++] = heap[i];
                    }
                }
                size_t m = w;
                hn = 0;
                for (size_t i = 0; i < m; i++) {
                    heap_push(heap, &hn, heap[i]);
                }
            }
        }
    }
    *out = res;
cleanup:
    free(next);
    free(last);
    free(cur);
    free(cached);
    free(in_req);
    free(heap);
    free(aside);
    return err;
}
