/* seq: one sequence's tokens, block hashes and block table, for engines.
 *
 * Invariants: the table holds ceil(length / tokens_per_block) blocks; blocks [0, ncommitted)
 * are committed (looked up or committed by us) and the rest are WRITING leases of this session;
 * blocks [nblocks, nheld) are reserved: WRITING leases of the sequence's own pool past its
 * length (a reservation, kvc_seq_reserve, or lookahead slots, kvc_seq_set_lookahead), taken
 * first when the sequence grows; hashes [0, nhashes) are the chain hashes of the full blocks.
 * Committed blocks are a prefix of the table because commits only ever cover leading full blocks.
 * The lookup of a prompt is capped at n-1 tokens so the engine always computes the last prompt
 * token (it needs its logits), which is how vLLM's prefix cache does it.
 *
 * Shared domains: prefill searches the linked pools by default, so looked-up blocks may live in
 * group or commons pools (bpool[i]); blocks the sequence allocates are always in its own pool.
 * Each block goes back to the pool it lives in, and a commit's parent is only named when the
 * previous block is in the same pool (ids of other pools mean other blocks here).
 *
 * Compressed (Zipage): after kvc_seq_compact every block of the table is a private block of the
 * own pool (never committed, never hashed: ncommitted = nhashes = 0 from then on), tokens[]
 * holds the kept tokens in slot order, and `dropped` counts the tokens compaction removed, so
 * the next token's position is len + dropped. A block budget caps nheld.
 */
#include <stdlib.h>
#include <string.h>

#include "client/conn.h"
#include "client/diag.h"
#include "client/map.h"
#include "common/kv_vllm_hash.h"

struct kvc_seq {
    kvc_pool *pool;                   /* pool the blocks live in */
    size_t max_tokens;                /* capacity of tokens */
    size_t max_blocks;                /* capacity of blocks and hashes */
    uint32_t *tokens;                 /* [max_tokens] */
    size_t len;                       /* tokens in the sequence */
    kvc_block *blocks;                /* [max_blocks] the block table */
    kvc_pool **bpool;                 /* [max_blocks] the pool each block lives in */
    int search_domains;               /* prefill searches the linked pools too */
    size_t nblocks;                   /* ceil(len / tokens_per_block) */
    size_t nheld;                     /* blocks held: the table and the reserved ones after it */
    size_t reserve_tokens;            /* kvc_seq_reserve: keep blocks for this many tokens */
    size_t lookahead;                 /* kvc_seq_set_lookahead: slots kept past the length */
    size_t ncommitted;                /* leading committed blocks */
    kv_hash128 *hashes;               /* [max_blocks] chain hashes of full blocks */
    uint8_t (*full)[32];              /* KVC_HASH_VLLM pools: [max_blocks] their digests */
    size_t nhashes;                   /* full blocks hashed */
    uint8_t extra[KV_HASH_MAX_EXTRA]; /* extra key mixed into every block hash */
    size_t extra_len;                 /* its bytes */
    size_t promoted;                  /* blocks prefills fetched from lower tiers */
    size_t budget;                    /* kvc_seq_set_block_budget: most blocks held; 0: none */
    int compressed;                   /* kvc_seq_compact ran: private blocks, no hashes */
    size_t dropped;                   /* tokens compaction removed (positions past len) */
};

static uint32_t tpb(const kvc_seq *s) {
    return s->pool->layout.tokens_per_block;
}

static size_t blocks_for(const kvc_seq *s, size_t ntokens) {
    return (ntokens + tpb(s) - 1) / tpb(s);
}

/* The pool is being destroyed (detach or connection close): the sequence becomes an empty shell
 * whose references the daemon already dropped. */
static void seq_orphan(void *user) {
    kvc_seq *s = user;
    s->pool = NULL;
    s->len = s->nblocks = s->nheld = s->ncommitted = s->nhashes = s->dropped = 0;
    s->compressed = 0;
}

/* KV_EQUOTA when growing to ntokens would take more blocks than the budget. */
static kv_err check_budget(kvc_seq *s, size_t ntokens) {
    if (s->budget == 0 || blocks_for(s, ntokens) <= s->budget) {
        return KV_OK;
    }
    return kvc__fail(s->pool->diag, KV_EQUOTA,
                     "sequence of %zu tokens would need %zu blocks; its block budget is %zu: "
                     "compact it first (kvc_seq_compact)",
                     ntokens, blocks_for(s, ntokens), s->budget);
}

kv_err kvc_seq_alloc(kvc_pool *p, size_t max_tokens, const void *extra, size_t extra_len,
                     kvc_seq **out) {
    if (p == NULL || max_tokens == 0 || extra_len > KV_HASH_MAX_EXTRA ||
        (extra_len > 0 && extra == NULL)) {
        return kvc__fail(p != NULL ? p->diag : NULL, KV_EINVAL,
                         "sequence: needs a pool, max_tokens >= 1 and extra of at most %d bytes",
                         KV_HASH_MAX_EXTRA);
    }
    kvc_seq *s = calloc(1, sizeof(*s));
    if (s == NULL) {
        return kvc__fail(p->diag, KV_ENOMEM, "out of memory for a sequence");
    }
    s->pool = p;
    s->max_tokens = max_tokens;
    s->max_blocks = blocks_for(s, max_tokens);
    s->tokens = malloc(max_tokens * sizeof(*s->tokens));
    s->blocks = malloc(s->max_blocks * sizeof(*s->blocks));
    s->hashes = malloc(s->max_blocks * sizeof(*s->hashes));
    s->bpool = malloc(s->max_blocks * sizeof(*s->bpool));
    if (p->hash_algo == KVC_HASH_VLLM) {
        s->full = malloc(s->max_blocks * sizeof(*s->full));
    }
    if (s->tokens == NULL || s->blocks == NULL || s->hashes == NULL || s->bpool == NULL ||
        (p->hash_algo == KVC_HASH_VLLM && s->full == NULL)) {
        free(s->full);
        free(s->tokens);
        free(s->blocks);
        free(s->hashes);
        free(s->bpool);
        free(s);
        return kvc__fail(p->diag, KV_ENOMEM, "out of memory for a sequence of %zu tokens",
                         max_tokens);
    }
    s->search_domains = 0; /* one page table per sequence unless asked (kvclient.h) */
    if (kvc__pool_add_user(p, s, seq_orphan) != KV_OK) {
        free(s->full);
        free(s->tokens);
        free(s->blocks);
        free(s->hashes);
        free(s->bpool);
        free(s);
        return KV_ENOMEM;
    }
    if (extra_len > 0) {
        memcpy(s->extra, extra, extra_len);
    }
    s->extra_len = extra_len;
    *out = s;
    return KV_OK;
}

void kvc_seq_free(kvc_seq *s) {
    if (s == NULL) {
        return;
    }
    if (s->pool != NULL) {
        if (s->nheld > 0 && !kvc_pool_stale(s->pool)) {
            (void)kvc_seq_release(s);
        }
        kvc__pool_forget_user(s->pool, s);
    }
    free(s->full);
    free(s->tokens);
    free(s->blocks);
    free(s->hashes);
    free(s->bpool);
    free(s);
}

void kvc_seq_set_search_domains(kvc_seq *s, int on) {
    /* Off by default: a table in one pool is one page table (kvc_seq_export_csr never fails). */
    s->search_domains = on != 0;
}

/* Hashes every full block not hashed yet. */
static kv_err hash_full_blocks(kvc_seq *s) {
    while (!s->compressed && (s->nhashes + 1) * tpb(s) <= s->len) {
        kv_err err;
        if (s->full != NULL) {
            err = kvc_pool_vllm_hash_next(s->pool, s->nhashes == 0 ? NULL : s->full[s->nhashes - 1],
                                          s->extra, s->extra_len, s->tokens + s->nhashes * tpb(s),
                                          s->full[s->nhashes]);
            if (err == KV_OK) {
                s->hashes[s->nhashes] = kv_vllm_hash_key(s->full[s->nhashes]);
            }
        } else {
            kv_hash128 parent = s->nhashes == 0 ? s->pool->seed : s->hashes[s->nhashes - 1];
            err = kvc_pool_hash_next(s->pool, parent, s->extra, s->extra_len,
                                     s->tokens + s->nhashes * tpb(s), &s->hashes[s->nhashes]);
        }
        if (err != KV_OK) {
            return err;
        }
        s->nhashes++;
    }
    return KV_OK;
}

/* Allocates n blocks after the held ones, in requests of at most the daemon's list limit. */
static kv_err alloc_blocks(kvc_seq *s, size_t n) {
    size_t limit = s->pool->conn->max_blocks;
    size_t done = 0;
    while (done < n) {
        size_t k = n - done < limit ? n - done : limit;
        kv_err err = s->compressed
                         ? kvc_allocate_private(s->pool, (uint32_t)k, s->blocks + s->nheld + done)
                         : kvc_allocate(s->pool, (uint32_t)k, s->blocks + s->nheld + done);
        if (err != KV_OK) {
            if (done > 0) {
                (void)kvc_release(s->pool, s->blocks + s->nheld, done);
            }
            return err;
        }
        done += k;
    }
    for (size_t i = 0; i < n; i++) {
        s->bpool[s->nheld + i] = s->pool;
    }
    s->nheld += n;
    return KV_OK;
}

/* Blocks the sequence keeps held for ntokens tokens plus its lookahead and reservation. */
static size_t held_target(const kvc_seq *s, size_t ntokens) {
    size_t t = ntokens + s->lookahead;
    if (t < s->reserve_tokens) {
        t = s->reserve_tokens;
    }
    if (t > s->max_tokens) {
        t = s->max_tokens;
    }
    size_t b = blocks_for(s, t);
    size_t floor = blocks_for(s, ntokens);
    if (s->budget != 0 && b > s->budget) {
        b = s->budget > floor ? s->budget : floor;
    }
    return b;
}

/* Makes sure blocks for ntokens tokens (and the lookahead and reservation) are held. */
static kv_err ensure_held(kvc_seq *s, size_t ntokens) {
    size_t want = held_target(s, ntokens);
    return want > s->nheld ? alloc_blocks(s, want - s->nheld) : KV_OK;
}

/* Gives blocks[from, from + n) back to their pools with Release or Rewind (one round trip;
 * kvc_release_multi splits runs at the list limit). */
static kv_err drop_blocks(kvc_seq *s, size_t from, size_t n, int rewind) {
    return rewind ? kvc_rewind_multi(s->bpool + from, s->blocks + from, n)
                  : kvc_release_multi(s->bpool + from, s->blocks + from, n);
}

kv_err kvc_seq_prefill(kvc_seq *s, const uint32_t *tokens, size_t n, size_t *cached_tokens) {
    if (s->pool == NULL) {
        return kvc__fail(NULL, KV_ESTATE, "the sequence's pool was detached");
    }
    kvc_conn *c = s->pool->conn;
    if (s->len != 0 || s->nblocks != 0) {
        return kvc__fail(&c->diag, KV_ESTATE, "prefill of a sequence that is not empty");
    }
    if (n == 0 || tokens == NULL) {
        return kvc__fail(&c->diag, KV_EINVAL, "prefill needs at least one token");
    }
    if (n > s->max_tokens) {
        return kvc__fail(&c->diag, KV_ETOOBIG, "prompt of %zu tokens exceeds the sequence's %zu", n,
                         s->max_tokens);
    }
    /* An empty sequence is an ordinary one again, even one rewound to 0 after a compaction: the
     * private blocks it kept held (a reservation, a lookahead) go back, since a private block
     * is never committed; ordinary ones are allocated below. */
    if (s->compressed && s->nheld > 0) {
        (void)kvc_release(s->pool, s->blocks, s->nheld);
        s->nheld = 0;
    }
    s->compressed = 0;
    s->dropped = 0;
    memcpy(s->tokens, tokens, n * sizeof(*tokens));
    s->len = n;
    s->nhashes = 0;
    /* Reserved blocks (held while empty) move behind the cached prefix the lookup returns. */
    size_t nres = s->nheld;
    kvc_block *res = NULL;
    if (nres > 0) {
        res = malloc(nres * sizeof(*res));
        if (res == NULL) {
            s->len = 0;
            return kvc__fail(&c->diag, KV_ENOMEM, "out of memory for %zu reserved blocks", nres);
        }
        memcpy(res, s->blocks, nres * sizeof(*res));
    }
    s->nheld = 0;
    kv_err err = hash_full_blocks(s);
    if (err != KV_OK) {
        goto fail;
    }
    size_t want = (n - 1) / tpb(s);
    if (want > c->max_blocks) {
        want = c->max_blocks;
    }
    size_t nhit = 0;
    if (want > 0) {
        /* Without linked pools the plain lookup is the same search, minus pool_ids. */
        if (s->search_domains && s->pool->nlinked > 0) {
            err = kvc_lookup_domains(s->pool, s->hashes, want, s->blocks, s->bpool, &nhit);
        } else if (kvc_conn_has_tiers(c)) {
            /* Lower tiers: a Fetch is the lookup, plus the blocks below T0 copied up when their
             * run is worth it (fetch-min-tokens); a shorter run is recomputed, as a miss. */
            kvc_fetch_result fr;
            err = kvc_fetch(s->pool, s->hashes, want, 0, s->blocks, &fr);
            nhit = err == KV_OK ? fr.nblocks : 0;
            s->promoted += err == KV_OK ? fr.promoted : 0;
            for (size_t i = 0; err == KV_OK && i < nhit; i++) {
                s->bpool[i] = s->pool;
            }
        } else {
            err = kvc_lookup(s->pool, s->hashes, want, s->blocks, &nhit);
            for (size_t i = 0; err == KV_OK && i < nhit; i++) {
                s->bpool[i] = s->pool;
            }
        }
        if (err != KV_OK) {
            goto fail;
        }
    }
    s->ncommitted = nhit;
    s->nheld = nhit;
    /* Behind the hits, as many reserved blocks as the sequence keeps now (the hits stand for
     * part of the reservation); the rest go back once the prefill stands (the table holds at
     * most max_blocks: all of them behind the hits could run past it). */
    size_t target = held_target(s, n);
    size_t keep = target > nhit ? target - nhit : 0;
    keep = keep < nres ? keep : nres;
    for (size_t i = 0; i < keep; i++) {
        s->blocks[s->nheld] = res[i];
        s->bpool[s->nheld++] = s->pool;
    }
    err = ensure_held(s, n);
    if (err != KV_OK) {
        if (nhit > 0) {
            (void)kvc_release_multi(s->bpool, s->blocks, nhit);
        }
        goto fail; /* the reserved blocks, all of them, go back into the table below */
    }
    if (keep < nres) {
        (void)kvc_release(s->pool, res + keep, nres - keep);
    }
    s->nblocks = blocks_for(s, n);
    free(res);
    *cached_tokens = nhit * tpb(s);
    return KV_OK;
fail:
    if (nres > 0) {
        memcpy(s->blocks, res, nres * sizeof(*res));
        for (size_t i = 0; i < nres; i++) {
            s->bpool[i] = s->pool;
        }
        s->nheld = nres;
    }
    free(res);
    s->len = 0;
    s->nblocks = 0;
    s->ncommitted = 0;
    s->nhashes = 0;
    return err;
}

kv_err kvc_seq_append(kvc_seq *s, const uint32_t *tokens, size_t n) {
    if (s->pool == NULL) {
        return kvc__fail(NULL, KV_ESTATE, "the sequence's pool was detached");
    }
    kvc_conn *c = s->pool->conn;
    if (n == 0) {
        return KV_OK;
    }
    if (tokens == NULL) {
        return kvc__fail(&c->diag, KV_EINVAL, "NULL tokens");
    }
    if (n > s->max_tokens - s->len) {
        return kvc__fail(&c->diag, KV_ETOOBIG, "sequence would exceed its %zu tokens",
                         s->max_tokens);
    }
    kv_err err = check_budget(s, s->len + n);
    if (err != KV_OK) {
        return err;
    }
    err = ensure_held(s, s->len + n);
    if (err != KV_OK) {
        return err;
    }
    memcpy(s->tokens + s->len, tokens, n * sizeof(*tokens));
    s->len += n;
    s->nblocks = blocks_for(s, s->len);
    return hash_full_blocks(s);
}

kv_err kvc_seq_commit(kvc_seq *s, size_t n_final, size_t *ncommitted) {
    if (s->pool == NULL) {
        return kvc__fail(NULL, KV_ESTATE, "the sequence's pool was detached");
    }
    kvc_conn *c = s->pool->conn;
    if (n_final > s->len) {
        return kvc__fail(&c->diag, KV_EINVAL, "commit of %zu tokens; the sequence has %zu", n_final,
                         s->len);
    }
    if (s->compressed) {
        /* Compressed KV has no prefix identity: nothing is ever published. */
        if (ncommitted != NULL) {
            *ncommitted = 0;
        }
        return KV_OK;
    }
    size_t full = n_final / tpb(s);
    size_t limit = c->max_blocks;
    size_t before = s->ncommitted;
    kvc_commit_entry *e = NULL;
    kvc_block *canon = NULL;
    kv_err err = KV_OK;
    if (full > s->ncommitted) {
        size_t chunk = full - s->ncommitted < limit ? full - s->ncommitted : limit;
        e = malloc(chunk * sizeof(*e));
        canon = malloc(chunk * sizeof(*canon));
        if (e == NULL || canon == NULL) {
            err = kvc__fail(&c->diag, KV_ENOMEM, "out of memory committing %zu blocks", chunk);
            goto cleanup;
        }
    }
    while (s->ncommitted < full) {
        size_t first = s->ncommitted;
        size_t k = full - first < limit ? full - first : limit;
        for (size_t i = 0; i < k; i++) {
            size_t b = first + i;
            e[i].block = s->blocks[b];
            e[i].hash = s->hashes[b];
            /* Within one request the daemon rewrites a parent naming an earlier entry to that
             * entry's canonical block; across requests ours is already canonical. A parent in
             * another pool (a group or commons hit) has no id in this one. */
            e[i].parent =
                b == 0 || s->bpool[b - 1] != s->pool ? KVC_NO_PARENT : s->blocks[b - 1].id;
        }
        /* vLLM pools send each digest, and the tokens for the KV events' BlockStored. */
        err = s->full != NULL ? kvc_commit_ex(s->pool, e, k, s->full + first,
                                              first > 0 ? s->full[first - 1] : NULL,
                                              s->tokens + first * tpb(s), canon)
                              : kvc_commit(s->pool, e, k, canon);
        if (err != KV_OK) {
            goto cleanup;
        }
        memcpy(s->blocks + first, canon, k * sizeof(*canon));
        s->ncommitted += k;
    }
cleanup:
    free(e);
    free(canon);
    if (err == KV_OK && ncommitted != NULL) {
        *ncommitted = s->ncommitted - before;
    }
    return err;
}

/* Gives back blocks [from, nheld) except own-pool WRITING ones that the reservation (up to
 * `hold` blocks held in all) keeps; the kept ones move to [from, ...). One round trip. */
static kv_err shrink_held(kvc_seq *s, size_t from, size_t hold) {
    size_t n = s->nheld - from;
    if (n == 0) {
        return KV_OK;
    }
    kvc_pool **dp = malloc(n * sizeof(*dp));
    kvc_block *db = malloc(n * sizeof(*db));
    if (dp == NULL || db == NULL) {
        free(dp);
        free(db);
        return kvc__fail(s->pool->diag, KV_ENOMEM, "out of memory giving back %zu blocks", n);
    }
    size_t nd = 0, kept = from;
    for (size_t i = from; i < s->nheld; i++) {
        int writing_own = i >= s->ncommitted && s->bpool[i] == s->pool;
        if (writing_own && kept < hold) {
            s->blocks[kept] = s->blocks[i];
            s->bpool[kept++] = s->pool;
        } else {
            dp[nd] = s->bpool[i];
            db[nd++] = s->blocks[i];
        }
    }
    kv_err err = nd > 0 ? kvc_rewind_multi(dp, db, nd) : KV_OK;
    free(dp);
    free(db);
    s->nheld = kept;
    return err;
}

kv_err kvc_seq_rewind(kvc_seq *s, size_t n, size_t *valid_tokens) {
    if (s->pool == NULL) {
        return kvc__fail(NULL, KV_ESTATE, "the sequence's pool was detached");
    }
    kvc_conn *c = s->pool->conn;
    if (n > s->len) {
        return kvc__fail(&c->diag, KV_EINVAL, "rewind to %zu tokens; the sequence has %zu", n,
                         s->len);
    }
    size_t keep = blocks_for(s, n);
    size_t valid = n;
    int replace = n % tpb(s) != 0 && keep - 1 < s->ncommitted;
    if (replace) {
        /* The cut lands inside an immutable block: give it back and recompute from its start
         * in a fresh one. */
        keep--;
        valid = keep * tpb(s);
    }
    if (s->ncommitted > keep) {
        /* Committed blocks past the cut are shared and immutable: they always go back. */
        size_t nc = s->ncommitted - keep;
        kv_err err = kvc_rewind_multi(s->bpool + keep, s->blocks + keep, nc);
        if (err != KV_OK) {
            return err;
        }
        memmove(s->blocks + keep, s->blocks + s->ncommitted,
                (s->nheld - s->ncommitted) * sizeof(*s->blocks));
        memmove(s->bpool + keep, s->bpool + s->ncommitted,
                (s->nheld - s->ncommitted) * sizeof(*s->bpool));
        s->nheld -= nc;
        s->ncommitted = keep;
    }
    /* WRITING blocks past the cut stay held as far as the lookahead and reservation want. */
    kv_err err = shrink_held(s, keep, held_target(s, n));
    if (err != KV_OK) {
        return err;
    }
    s->nblocks = keep;
    s->len = n;
    if (s->nhashes > n / tpb(s)) {
        s->nhashes = n / tpb(s);
    }
    if (replace) {
        /* A held WRITING block (reserved, or fresh) takes the replaced block's place. */
        err = s->nheld > keep ? KV_OK : alloc_blocks(s, 1);
        if (err != KV_OK) {
            /* Keep the invariant: the table must cover the tokens. */
            s->len = valid;
            s->nhashes = valid / tpb(s);
            return err;
        }
        s->nblocks = keep + 1;
    }
    if (valid_tokens != NULL) {
        *valid_tokens = valid;
    }
    return KV_OK;
}

kv_err kvc_seq_release(kvc_seq *s) {
    if (s->pool == NULL) {
        s->len = s->nblocks = s->nheld = s->ncommitted = s->nhashes = 0;
        return kvc__fail(NULL, KV_ESTATE, "the sequence's pool was detached");
    }
    kv_err err = KV_OK;
    if (s->nheld > 0) {
        err = drop_blocks(s, 0, s->nheld, 0);
    }
    s->len = 0;
    s->nblocks = 0;
    s->nheld = 0;
    s->ncommitted = 0;
    s->nhashes = 0;
    s->reserve_tokens = 0;
    s->compressed = 0;
    s->dropped = 0;
    return err;
}

kv_err kvc_seq_set_block_budget(kvc_seq *s, size_t nblocks) {
    if (s->pool == NULL) {
        return kvc__fail(NULL, KV_ESTATE, "the sequence's pool was detached");
    }
    if (nblocks != 0 && nblocks < s->nblocks) {
        return kvc__fail(s->pool->diag, KV_EQUOTA,
                         "block budget %zu is below the %zu blocks the sequence uses: compact it "
                         "first",
                         nblocks, s->nblocks);
    }
    s->budget = nblocks;
    return shrink_held(s, s->nblocks, held_target(s, s->len));
}

size_t kvc_seq_block_budget(const kvc_seq *s) {
    return s->budget;
}

int kvc_seq_compressed(const kvc_seq *s) {
    return s->compressed;
}

size_t kvc_seq_position(const kvc_seq *s) {
    return s->len + s->dropped;
}

/* Makes fresh[0..nfresh) (private blocks holding tokens[0..ntokens)) the whole table of a
 * compressed sequence whose positions run `dropped` ahead of its length. tokens may alias
 * s->tokens. */
static void install_compressed(kvc_seq *s, const uint32_t *tokens, size_t ntokens, size_t dropped,
                               const kvc_block *fresh, size_t nfresh) {
    memcpy(s->blocks, fresh, nfresh * sizeof(*fresh));
    for (size_t i = 0; i < nfresh; i++) {
        s->bpool[i] = s->pool;
    }
    memmove(s->tokens, tokens, ntokens * sizeof(*tokens));
    s->len = ntokens;
    s->dropped = dropped;
    s->nblocks = s->nheld = nfresh;
    s->ncommitted = s->nhashes = 0;
    s->compressed = 1;
}

kv_err kvc_seq_adopt(kvc_seq *s, const uint32_t *tokens, size_t ntokens, size_t position,
                     const kvc_block *fresh, size_t nfresh) {
    if (s->pool == NULL) {
        return kvc__fail(NULL, KV_ESTATE, "the sequence's pool was detached");
    }
    kvc_conn *c = s->pool->conn;
    if (s->len != 0 || s->nheld != 0) {
        return kvc__fail(&c->diag, KV_ESTATE, "adopt into a sequence that is not empty");
    }
    if (ntokens == 0 || tokens == NULL || fresh == NULL || position < ntokens ||
        ntokens > s->max_tokens || nfresh != blocks_for(s, ntokens) || nfresh > s->max_blocks) {
        return kvc__fail(&c->diag, KV_EINVAL,
                         "adopt of %zu tokens at position %zu into %zu blocks: counts do not match",
                         ntokens, position, nfresh);
    }
    if (s->budget != 0 && nfresh > s->budget) {
        return kvc__fail(&c->diag, KV_EQUOTA, "%zu blocks exceed the block budget of %zu", nfresh,
                         s->budget);
    }
    install_compressed(s, tokens, ntokens, position - ntokens, fresh, nfresh);
    return KV_OK;
}

kv_err kvc_seq_compact(kvc_seq *s, const uint32_t *kept, size_t nkept, const kvc_block *fresh,
                       size_t nfresh) {
    if (s->pool == NULL) {
        return kvc__fail(NULL, KV_ESTATE, "the sequence's pool was detached");
    }
    kvc_conn *c = s->pool->conn;
    if (nkept == 0 || nkept > s->len || kept == NULL || fresh == NULL) {
        return kvc__fail(&c->diag, KV_EINVAL,
                         "compact keeps 1..%zu tokens with their token ids and fresh blocks; got "
                         "%zu",
                         s->len, nkept);
    }
    if (nfresh != blocks_for(s, nkept) || nfresh > s->max_blocks) {
        return kvc__fail(&c->diag, KV_EINVAL, "%zu kept tokens fill %zu blocks, not %zu", nkept,
                         blocks_for(s, nkept), nfresh);
    }
    if (s->budget != 0 && nfresh > s->budget) {
        return kvc__fail(&c->diag, KV_EQUOTA, "%zu fresh blocks exceed the block budget of %zu",
                         nfresh, s->budget);
    }
    /* The old table (committed blocks shared with others are only de-referenced, never
     * written) and every reserved block go back in one round trip; the fresh ones take their
     * place whether or not that succeeds (the daemon frees a dead session's leases anyway). */
    kv_err err = s->nheld > 0 ? drop_blocks(s, 0, s->nheld, 0) : KV_OK;
    install_compressed(s, kept, nkept, s->dropped + s->len - nkept, fresh, nfresh);
    return err;
}

kv_err kvc_seq_reserve(kvc_seq *s, size_t ntokens) {
    if (s->pool == NULL) {
        return kvc__fail(NULL, KV_ESTATE, "the sequence's pool was detached");
    }
    if (ntokens > s->max_tokens) {
        return kvc__fail(s->pool->diag, KV_ETOOBIG,
                         "reservation of %zu tokens exceeds the sequence's %zu", ntokens,
                         s->max_tokens);
    }
    size_t old = s->reserve_tokens;
    s->reserve_tokens = ntokens;
    kv_err err = ensure_held(s, s->len);
    if (err != KV_OK) {
        s->reserve_tokens = old;
        return err;
    }
    /* A smaller reservation gives back what it no longer keeps. */
    return shrink_held(s, s->nblocks, held_target(s, s->len));
}

kv_err kvc_seq_set_lookahead(kvc_seq *s, size_t ntokens) {
    if (s->pool == NULL) {
        return kvc__fail(NULL, KV_ESTATE, "the sequence's pool was detached");
    }
    size_t old = s->lookahead;
    s->lookahead = ntokens;
    kv_err err = ensure_held(s, s->len);
    if (err != KV_OK) {
        s->lookahead = old;
        return err;
    }
    return shrink_held(s, s->nblocks, held_target(s, s->len));
}

kv_err kvc_seq_fork(kvc_seq *src, kvc_seq **out, int32_t *copy_src, int32_t *copy_dst,
                    size_t max_copies, size_t *ncopies) {
    if (src == NULL || out == NULL) {
        return kvc__fail(NULL, KV_EINVAL, "fork: NULL sequence or output");
    }
    if (src->pool == NULL) {
        return kvc__fail(NULL, KV_ESTATE, "fork: the sequence's pool was detached");
    }
    kvc_conn *c = src->pool->conn;
    if (src->compressed) {
        return kvc__fail(&c->diag, KV_ENOTSUP,
                         "fork of a compressed sequence: its private blocks cannot be shared");
    }
    size_t nshare = src->ncommitted;
    size_t ncopy = src->nblocks - nshare;
    if (ncopy > 0 && (copy_src == NULL || copy_dst == NULL || max_copies < ncopy)) {
        return kvc__fail(&c->diag, KV_ETOOBIG,
                         "fork: %zu blocks must be copied (uncommitted), room for %zu given", ncopy,
                         copy_src == NULL || copy_dst == NULL ? 0 : max_copies);
    }
    kvc_seq *d;
    kv_err err = kvc_seq_alloc(src->pool, src->max_tokens, src->extra, src->extra_len, &d);
    if (err != KV_OK) {
        return err;
    }
    d->search_domains = src->search_domains;
    d->lookahead = src->lookahead;
    memcpy(d->tokens, src->tokens, src->len * sizeof(*src->tokens));
    memcpy(d->hashes, src->hashes, src->nhashes * sizeof(*src->hashes));
    if (src->full != NULL) {
        memcpy(d->full, src->full, src->nhashes * sizeof(*src->full));
    }
    d->nhashes = src->nhashes;
    /* Shared blocks: one more reference on each committed block, taken by looking their hashes
     * up (the source holds them, so each is found, and found as the same block). */
    size_t limit = c->max_blocks;
    while (err == KV_OK && d->nheld < nshare) {
        size_t at = d->nheld;
        size_t k = nshare - at < limit ? nshare - at : limit;
        size_t nhit = 0;
        if (src->search_domains && src->pool->nlinked > 0) {
            err = kvc_lookup_domains(src->pool, d->hashes + at, k, d->blocks + at, d->bpool + at,
                                     &nhit);
        } else {
            err = kvc_lookup(src->pool, d->hashes + at, k, d->blocks + at, &nhit);
            for (size_t i = at; err == KV_OK && i < at + nhit; i++) {
                d->bpool[i] = src->pool;
            }
        }
        if (err != KV_OK) {
            break;
        }
        size_t same = 0;
        while (same < nhit && d->blocks[at + same].id == src->blocks[at + same].id &&
               d->blocks[at + same].gen == src->blocks[at + same].gen &&
               d->bpool[at + same] == src->bpool[at + same]) {
            same++;
        }
        d->nheld += same;
        if (same < k) {
            /* Only a block the daemon quarantined (verify-blocks) or a broken invariant. */
            if (nhit > same) {
                (void)kvc_release_multi(d->bpool + at + same, d->blocks + at + same, nhit - same);
            }
            err = kvc__fail(&c->diag, KV_ESTATE,
                            "fork: committed block %zu of the sequence is no longer indexed as "
                            "it (quarantined?): release the sequence and prefill again",
                            at + same);
        }
    }
    d->ncommitted = d->nheld;
    d->len = src->len;
    d->nblocks = src->nblocks;
    if (err == KV_OK) {
        err = ensure_held(d, d->len); /* the blocks to copy into, and the lookahead */
    }
    if (err != KV_OK) {
        d->nblocks = d->nheld < d->nblocks ? d->nheld : d->nblocks;
        kvc_seq_free(d);
        return err;
    }
    for (size_t j = 0; j < ncopy; j++) {
        copy_src[j] = (int32_t)src->blocks[nshare + j].id;
        copy_dst[j] = (int32_t)d->blocks[nshare + j].id;
    }
    if (ncopies != NULL) {
        *ncopies = ncopy;
    }
    *out = d;
    return KV_OK;
}

size_t kvc_seq_capacity(const kvc_seq *s) {
    size_t t = s->nheld * (s->pool != NULL ? tpb(s) : 0);
    return t < s->max_tokens ? t : s->max_tokens;
}

size_t kvc_seq_length(const kvc_seq *s) {
    return s->len;
}

size_t kvc_seq_promoted(const kvc_seq *s) {
    return s->promoted;
}

size_t kvc_seq_nblocks(const kvc_seq *s) {
    return s->nblocks;
}

size_t kvc_seq_ncommitted(const kvc_seq *s) {
    return s->ncommitted;
}

kvc_block kvc_seq_block(const kvc_seq *s, size_t i) {
    kvc_block none = {UINT32_MAX, 0};
    return i < s->nheld ? s->blocks[i] : none;
}

kvc_pool *kvc_seq_block_pool(const kvc_seq *s, size_t i) {
    return i < s->nheld ? s->bpool[i] : NULL;
}

int kvc_seq_mixed(const kvc_seq *s) {
    for (size_t i = 1; i < s->nblocks; i++) {
        if (s->bpool[i] != s->bpool[0]) {
            return 1;
        }
    }
    return 0;
}

/* Tokens held by block b of s: a full block except the sequence's last. */
static int32_t block_tokens(const kvc_seq *s, size_t b) {
    return b + 1 < s->nblocks ? (int32_t)tpb(s) : (int32_t)(s->len - (s->nblocks - 1) * tpb(s));
}

/* The CSR export of seqs' blocks in pool, or of every block (pool NULL: each sequence must then
 * lie in one pool). */
/* Where an export reports its errors: the first sequence's connection (and the thread). */
static kvc__diag *seqs_diag(kvc_seq *const *seqs, size_t nseqs) {
    return nseqs > 0 && seqs != NULL && seqs[0] != NULL && seqs[0]->pool != NULL
               ? seqs[0]->pool->diag
               : NULL;
}

static kv_err export_csr(kvc_seq *const *seqs, size_t nseqs, const kvc_pool *pool, int32_t *indptr,
                         size_t indptr_cap, int32_t *indices, size_t indices_cap,
                         int32_t *last_page_len, size_t last_cap, size_t *nindices) {
    kvc__diag *d = seqs_diag(seqs, nseqs);
    if ((nseqs > 0 && seqs == NULL) || indptr == NULL || (nseqs > 0 && last_page_len == NULL)) {
        return kvc__fail(d, KV_EINVAL, "CSR export: NULL sequences, indptr or last_page_len");
    }
    if (indptr_cap < nseqs + 1 || last_cap < nseqs) {
        return kvc__fail(d, KV_ETOOBIG,
                         "CSR export of %zu sequences needs indptr[%zu] and last_page_len[%zu]; "
                         "got %zu and %zu",
                         nseqs, nseqs + 1, nseqs, indptr_cap, last_cap);
    }
    size_t total = 0;
    for (size_t i = 0; i < nseqs; i++) {
        const kvc_seq *s = seqs[i];
        if (pool == NULL && kvc_seq_mixed(s)) {
            return kvc__fail(s->pool->diag, KV_ENOTSUP,
                             "sequence %zu has blocks in more than one pool (shared-domain hits); "
                             "export one table per pool with kvc_seq_export_csr_pool",
                             i);
        }
        for (size_t b = 0; b < s->nblocks; b++) {
            total += pool == NULL || s->bpool[b] == pool;
        }
    }
    if (total > indices_cap || total > INT32_MAX) {
        return kvc__fail(d, KV_ETOOBIG, "CSR export needs indices[%zu]; got %zu", total,
                         indices_cap);
    }
    if (total > 0 && indices == NULL) {
        return kvc__fail(d, KV_EINVAL, "CSR export: NULL indices");
    }
    size_t k = 0;
    indptr[0] = 0;
    for (size_t i = 0; i < nseqs; i++) {
        const kvc_seq *s = seqs[i];
        int32_t last = 0;
        for (size_t b = 0; b < s->nblocks; b++) {
            if (pool != NULL && s->bpool[b] != pool) {
                continue;
            }
            if (s->blocks[b].id > INT32_MAX) {
                return kvc__fail(d, KV_ETOOBIG, "block id %u does not fit int32", s->blocks[b].id);
            }
            indices[k++] = (int32_t)s->blocks[b].id;
            last = block_tokens(s, b);
        }
        indptr[i + 1] = (int32_t)k;
        last_page_len[i] = last;
    }
    if (nindices != NULL) {
        *nindices = k;
    }
    return KV_OK;
}

kv_err kvc_seq_export_csr_pool(kvc_seq *const *seqs, size_t nseqs, const kvc_pool *pool,
                               int32_t *indptr, size_t indptr_cap, int32_t *indices,
                               size_t indices_cap, int32_t *last_page_len, size_t last_cap,
                               size_t *nindices) {
    if (pool == NULL) {
        return kvc__fail(seqs_diag(seqs, nseqs), KV_EINVAL, "CSR export per pool: NULL pool");
    }
    return export_csr(seqs, nseqs, pool, indptr, indptr_cap, indices, indices_cap, last_page_len,
                      last_cap, nindices);
}

kv_err kvc_seq_export_csr(kvc_seq *const *seqs, size_t nseqs, int32_t *indptr, size_t indptr_cap,
                          int32_t *indices, size_t indices_cap, int32_t *last_page_len,
                          size_t last_cap, size_t *nindices) {
    return export_csr(seqs, nseqs, NULL, indptr, indptr_cap, indices, indices_cap, last_page_len,
                      last_cap, nindices);
}

kv_err kvc_seq_export_slots(const kvc_seq *s, size_t from, size_t to, int64_t *slots, size_t cap) {
    if (s->pool == NULL) {
        return kvc__fail(NULL, KV_ESTATE, "the sequence's pool was detached");
    }
    size_t limit = s->nheld * tpb(s);
    if (from > to || to > limit) {
        return kvc__fail(s->pool->diag, KV_EINVAL,
                         "slots of tokens [%zu, %zu): the sequence holds blocks for %zu tokens",
                         from, to, limit);
    }
    if (to - from > cap || (to > from && slots == NULL)) {
        return kvc__fail(s->pool->diag, KV_ETOOBIG, "slots of %zu tokens; room for %zu", to - from,
                         cap);
    }
    for (size_t t = from; t < to; t++) {
        size_t b = t / tpb(s);
        if (s->bpool[b] != s->pool) {
            return kvc__fail(s->pool->diag, KV_ENOTSUP,
                             "token %zu lies in a block of a linked pool (a cached prefix): its "
                             "K/V are written already and have no slot in this pool",
                             t);
        }
        slots[t - from] = (int64_t)s->blocks[b].id * tpb(s) + (int64_t)(t % tpb(s));
    }
    return KV_OK;
}

kv_err kvc_seq_export_table(kvc_seq *const *seqs, size_t nseqs, int32_t *table, size_t width,
                            int32_t pad, size_t *max_used) {
    kvc__diag *d = seqs_diag(seqs, nseqs);
    if (nseqs > 0 && (seqs == NULL || table == NULL)) {
        return kvc__fail(d, KV_EINVAL, "block table export: NULL sequences or table");
    }
    size_t used = 0;
    for (size_t i = 0; i < nseqs; i++) {
        const kvc_seq *s = seqs[i];
        if (s->nblocks > width) {
            return kvc__fail(d, KV_ETOOBIG, "sequence %zu has %zu blocks; the table is %zu wide", i,
                             s->nblocks, width);
        }
        if (kvc_seq_mixed(s)) {
            return kvc__fail(d, KV_ENOTSUP,
                             "sequence %zu has blocks in more than one pool; export one table "
                             "per pool (kvc_seq_export_csr_pool)",
                             i);
        }
        used = s->nblocks > used ? s->nblocks : used;
    }
    for (size_t i = 0; i < nseqs; i++) {
        const kvc_seq *s = seqs[i];
        int32_t *row = table + i * width;
        for (size_t b = 0; b < width; b++) {
            if (b < s->nblocks && s->blocks[b].id > INT32_MAX) {
                return kvc__fail(d, KV_ETOOBIG, "block id %u does not fit int32", s->blocks[b].id);
            }
            row[b] = b < s->nblocks ? (int32_t)s->blocks[b].id : pad;
        }
    }
    if (max_used != NULL) {
        *max_used = used;
    }
    return KV_OK;
}

/* One pool's share of a batched append: the sequences that need blocks from it. */
typedef struct pool_need {
    kvc_pool *pool;
    size_t total;       /* blocks wanted */
    kvc_block *got;     /* [total] */
    size_t first_index; /* its first request in the batch */
    size_t nrequests;   /* requests (chunks of the daemon's list limit) */
    kv_err status;      /* KV_OK when every chunk was allocated */
} pool_need;

kv_err kvc_seq_append_many(kvc_seq *const *seqs, size_t nseqs, const uint32_t *const *tokens,
                           const size_t *counts, kv_err *status) {
    kvc__diag *d = seqs_diag(seqs, nseqs);
    if (nseqs == 0) {
        return KV_OK;
    }
    if (seqs == NULL || tokens == NULL || counts == NULL) {
        return kvc__fail(d, KV_EINVAL, "append_many: NULL sequences, tokens or counts");
    }
    kv_err first = KV_OK;
    size_t *need = calloc(nseqs, sizeof(*need));
    kv_err *st = calloc(nseqs, sizeof(*st));
    pool_need *pn = calloc(nseqs, sizeof(*pn));
    size_t npn = 0;
    if (need == NULL || st == NULL || pn == NULL) {
        free(need);
        free(st);
        free(pn);
        return kvc__fail(d, KV_ENOMEM, "out of memory for a step of %zu sequences", nseqs);
    }
    /* What each sequence needs, and from which pool. */
    for (size_t i = 0; i < nseqs; i++) {
        kvc_seq *s = seqs[i];
        if (s == NULL || s->pool == NULL) {
            st[i] = kvc__fail(d, KV_ESTATE, "sequence %zu: no pool (detached)", i);
            continue;
        }
        if (counts[i] > 0 && tokens[i] == NULL) {
            st[i] = kvc__fail(s->pool->diag, KV_EINVAL, "sequence %zu: NULL tokens", i);
            continue;
        }
        if (counts[i] > s->max_tokens - s->len) {
            st[i] = kvc__fail(s->pool->diag, KV_ETOOBIG, "sequence %zu would exceed its %zu tokens",
                              i, s->max_tokens);
            continue;
        }
        st[i] = check_budget(s, s->len + counts[i]);
        if (st[i] != KV_OK) {
            continue;
        }
        size_t want = held_target(s, s->len + counts[i]);
        need[i] = want > s->nheld ? want - s->nheld : 0;
        if (need[i] > 0 && s->compressed) {
            /* Private blocks come from their own Allocate (at most one per tokens_per_block
             * tokens of a compressed sequence). */
            st[i] = alloc_blocks(s, need[i]);
            need[i] = 0;
        }
        if (need[i] == 0) {
            continue;
        }
        size_t k = 0;
        while (k < npn && pn[k].pool != s->pool) {
            k++;
        }
        if (k == npn) {
            pn[npn++].pool = s->pool;
        }
        pn[k].total += need[i];
    }
    /* One batch per connection: every pool's Allocate requests leave back to back, one round
     * trip for the whole step. */
    for (size_t k = 0; k < npn; k++) {
        pn[k].got = malloc(pn[k].total * sizeof(*pn[k].got));
        if (pn[k].got == NULL) {
            pn[k].status =
                kvc__fail(pn[k].pool->diag, KV_ENOMEM, "out of memory for %zu blocks", pn[k].total);
        }
    }
    for (size_t k = 0; k < npn; k++) {
        kvc_conn *c = pn[k].pool->conn;
        int first_of_conn = 1;
        for (size_t j = 0; j < k; j++) {
            first_of_conn &= pn[j].pool->conn != c;
        }
        if (!first_of_conn) {
            continue;
        }
        kvc_batch *b = NULL;
        kv_err err = kvc_batch_alloc(c, &b);
        for (size_t j = k; j < npn && err == KV_OK; j++) {
            if (pn[j].pool->conn != c || pn[j].status != KV_OK) {
                continue;
            }
            size_t limit = c->max_blocks;
            pn[j].first_index = kvc_batch_count(b);
            for (size_t done = 0; done < pn[j].total && pn[j].status == KV_OK;) {
                size_t n = pn[j].total - done < limit ? pn[j].total - done : limit;
                pn[j].status =
                    kvc_batch_allocate(b, pn[j].pool, (uint32_t)n, pn[j].got + done, NULL);
                done += n;
                pn[j].nrequests++;
            }
        }
        if (err == KV_OK) {
            err = kvc_batch_run(b);
        }
        for (size_t j = k; j < npn; j++) {
            if (pn[j].pool->conn != c || pn[j].status != KV_OK) {
                continue;
            }
            if (err != KV_OK) {
                pn[j].status = err;
                continue;
            }
            /* All chunks or none: a pool that got only some gives each granted chunk back. */
            kv_err ps = KV_OK;
            for (size_t r = 0; r < pn[j].nrequests && ps == KV_OK; r++) {
                ps = kvc_batch_status(b, pn[j].first_index + r);
            }
            for (size_t r = 0; r < pn[j].nrequests && ps != KV_OK; r++) {
                size_t off = r * c->max_blocks;
                size_t n = pn[j].total - off < c->max_blocks ? pn[j].total - off : c->max_blocks;
                if (kvc_batch_status(b, pn[j].first_index + r) == KV_OK) {
                    (void)kvc_release(pn[j].pool, pn[j].got + off, n);
                }
            }
            pn[j].status = ps;
        }
        kvc_batch_free(b);
    }
    /* Hand the blocks out in sequence order and append the tokens. */
    for (size_t k = 0; k < npn; k++) {
        pn[k].total = 0; /* from here: blocks handed out */
    }
    for (size_t i = 0; i < nseqs; i++) {
        kvc_seq *s = seqs[i];
        if (st[i] == KV_OK && need[i] > 0) {
            size_t k = 0;
            while (pn[k].pool != s->pool) {
                k++;
            }
            if (pn[k].status != KV_OK) {
                st[i] = pn[k].status;
            } else {
                for (size_t j = 0; j < need[i]; j++) {
                    s->blocks[s->nheld] = pn[k].got[pn[k].total++];
                    s->bpool[s->nheld++] = s->pool;
                }
            }
        }
        if (st[i] == KV_OK && counts[i] > 0) {
            memcpy(s->tokens + s->len, tokens[i], counts[i] * sizeof(*tokens[i]));
            s->len += counts[i];
            s->nblocks = blocks_for(s, s->len);
            st[i] = hash_full_blocks(s);
        }
        if (status != NULL) {
            status[i] = st[i];
        }
        if (first == KV_OK && st[i] != KV_OK) {
            first = st[i];
        }
    }
    for (size_t k = 0; k < npn; k++) {
        free(pn[k].got);
    }
    free(pn);
    free(need);
    free(st);
    return first;
}
