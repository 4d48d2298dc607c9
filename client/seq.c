/* seq: one sequence's tokens, block hashes and block table, for engines.
 *
 * Invariants: the table holds ceil(length / tokens_per_block) blocks; blocks [0, ncommitted)
 * are committed (looked up or committed by us) and the rest are WRITING leases of this session;
 * hashes [0, nhashes) are the chain hashes of the full blocks of the tokens. Committed blocks are
 * a prefix of the table because commits only ever cover leading full blocks. The lookup of a
 * prompt is capped at n-1 tokens so the engine always computes the last prompt token (it needs
 * its logits), which is how vLLM's prefix cache does it.
 *
 * Shared domains: prefill searches the linked pools by default, so looked-up blocks may live in
 * group or commons pools (bpool[i]); blocks the sequence allocates are always in its own pool.
 * Each block goes back to the pool it lives in, and a commit's parent is only named when the
 * previous block is in the same pool (ids of other pools mean other blocks here).
 */
#include <stdlib.h>
#include <string.h>

#include "client/conn.h"
#include "client/diag.h"
#include "client/map.h"

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
    size_t ncommitted;                /* leading committed blocks */
    kv_hash128 *hashes;               /* [max_blocks] chain hashes of full blocks */
    size_t nhashes;                   /* full blocks hashed */
    uint8_t extra[KV_HASH_MAX_EXTRA]; /* extra key mixed into every block hash */
    size_t extra_len;                 /* its bytes */
};

static uint32_t tpb(const kvc_seq *s) {
    return s->pool->layout.tokens_per_block;
}

static size_t blocks_for(const kvc_seq *s, size_t ntokens) {
    return (ntokens + tpb(s) - 1) / tpb(s);
}

kv_err kvc_seq_alloc(kvc_pool *p, size_t max_tokens, const void *extra, size_t extra_len,
                     kvc_seq **out) {
    if (p == NULL || max_tokens == 0 || extra_len > KV_HASH_MAX_EXTRA ||
        (extra_len > 0 && extra == NULL)) {
        return KV_EINVAL;
    }
    kvc_seq *s = calloc(1, sizeof(*s));
    if (s == NULL) {
        return KV_ENOMEM;
    }
    s->pool = p;
    s->max_tokens = max_tokens;
    s->max_blocks = blocks_for(s, max_tokens);
    s->tokens = malloc(max_tokens * sizeof(*s->tokens));
    s->blocks = malloc(s->max_blocks * sizeof(*s->blocks));
    s->hashes = malloc(s->max_blocks * sizeof(*s->hashes));
    s->bpool = malloc(s->max_blocks * sizeof(*s->bpool));
    if (s->tokens == NULL || s->blocks == NULL || s->hashes == NULL || s->bpool == NULL) {
        free(s->tokens);
        free(s->blocks);
        free(s->hashes);
        free(s->bpool);
        free(s);
        return KV_ENOMEM;
    }
    s->search_domains = 1;
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
    if (s->nblocks > 0 && !kvc_pool_stale(s->pool)) {
        (void)kvc_seq_release(s);
    }
    free(s->tokens);
    free(s->blocks);
    free(s->hashes);
    free(s->bpool);
    free(s);
}

void kvc_seq_set_search_domains(kvc_seq *s, int on) {
    s->search_domains = on != 0;
}

/* Hashes every full block not hashed yet. */
static kv_err hash_full_blocks(kvc_seq *s) {
    while ((s->nhashes + 1) * tpb(s) <= s->len) {
        kv_hash128 parent = s->nhashes == 0 ? s->pool->seed : s->hashes[s->nhashes - 1];
        kv_err err = kvc_pool_hash_next(s->pool, parent, s->extra, s->extra_len,
                                        s->tokens + s->nhashes * tpb(s), &s->hashes[s->nhashes]);
        if (err != KV_OK) {
            return err;
        }
        s->nhashes++;
    }
    return KV_OK;
}

/* Allocates n blocks into the table's end, in requests of at most the daemon's list limit. */
static kv_err alloc_blocks(kvc_seq *s, size_t n) {
    size_t limit = s->pool->conn->max_blocks;
    size_t done = 0;
    while (done < n) {
        size_t k = n - done < limit ? n - done : limit;
        kv_err err = kvc_allocate(s->pool, (uint32_t)k, s->blocks + s->nblocks + done);
        if (err != KV_OK) {
            if (done > 0) {
                (void)kvc_release(s->pool, s->blocks + s->nblocks, done);
            }
            return err;
        }
        done += k;
    }
    for (size_t i = 0; i < n; i++) {
        s->bpool[s->nblocks + i] = s->pool;
    }
    s->nblocks += n;
    return KV_OK;
}

/* Gives blocks[from, from + n) back to their pools with Release or Rewind (one round trip;
 * kvc_release_multi splits runs at the list limit). */
static kv_err drop_blocks(kvc_seq *s, size_t from, size_t n, int rewind) {
    return rewind ? kvc_rewind_multi(s->bpool + from, s->blocks + from, n)
                  : kvc_release_multi(s->bpool + from, s->blocks + from, n);
}

kv_err kvc_seq_prefill(kvc_seq *s, const uint32_t *tokens, size_t n, size_t *cached_tokens) {
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
    memcpy(s->tokens, tokens, n * sizeof(*tokens));
    s->len = n;
    s->nhashes = 0;
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
    s->nblocks = nhit;
    s->ncommitted = nhit;
    err = alloc_blocks(s, blocks_for(s, n) - nhit);
    if (err != KV_OK) {
        if (nhit > 0) {
            (void)kvc_release_multi(s->bpool, s->blocks, nhit);
        }
        goto fail;
    }
    *cached_tokens = nhit * tpb(s);
    return KV_OK;
fail:
    s->len = 0;
    s->nblocks = 0;
    s->ncommitted = 0;
    s->nhashes = 0;
    return err;
}

kv_err kvc_seq_append(kvc_seq *s, const uint32_t *tokens, size_t n) {
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
    size_t need = blocks_for(s, s->len + n) - s->nblocks;
    if (need > 0) {
        kv_err err = alloc_blocks(s, need);
        if (err != KV_OK) {
            return err;
        }
    }
    memcpy(s->tokens + s->len, tokens, n * sizeof(*tokens));
    s->len += n;
    return hash_full_blocks(s);
}

kv_err kvc_seq_commit(kvc_seq *s, size_t n_final, size_t *ncommitted) {
    kvc_conn *c = s->pool->conn;
    if (n_final > s->len) {
        return kvc__fail(&c->diag, KV_EINVAL, "commit of %zu tokens; the sequence has %zu", n_final,
                         s->len);
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
        err = kvc_commit(s->pool, e, k, canon);
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

kv_err kvc_seq_rewind(kvc_seq *s, size_t n, size_t *valid_tokens) {
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
    kv_err err = KV_OK;
    if (s->nblocks > keep) {
        err = drop_blocks(s, keep, s->nblocks - keep, 1);
        if (err != KV_OK) {
            return err;
        }
        s->nblocks = keep;
    }
    if (s->ncommitted > keep) {
        s->ncommitted = keep;
    }
    s->len = n;
    if (s->nhashes > n / tpb(s)) {
        s->nhashes = n / tpb(s);
    }
    if (replace) {
        err = alloc_blocks(s, 1);
        if (err != KV_OK) {
            /* Keep the invariant: the table must cover the tokens. */
            s->len = valid;
            s->nhashes = valid / tpb(s);
            return err;
        }
    }
    if (valid_tokens != NULL) {
        *valid_tokens = valid;
    }
    return KV_OK;
}

kv_err kvc_seq_release(kvc_seq *s) {
    kv_err err = KV_OK;
    if (s->nblocks > 0) {
        err = drop_blocks(s, 0, s->nblocks, 0);
    }
    s->len = 0;
    s->nblocks = 0;
    s->ncommitted = 0;
    s->nhashes = 0;
    return err;
}

size_t kvc_seq_length(const kvc_seq *s) {
    return s->len;
}

size_t kvc_seq_nblocks(const kvc_seq *s) {
    return s->nblocks;
}

size_t kvc_seq_ncommitted(const kvc_seq *s) {
    return s->ncommitted;
}

kvc_block kvc_seq_block(const kvc_seq *s, size_t i) {
    kvc_block none = {UINT32_MAX, 0};
    return i < s->nblocks ? s->blocks[i] : none;
}

kvc_pool *kvc_seq_block_pool(const kvc_seq *s, size_t i) {
    return i < s->nblocks ? s->bpool[i] : NULL;
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
static kv_err export_csr(kvc_seq *const *seqs, size_t nseqs, const kvc_pool *pool, int32_t *indptr,
                         size_t indptr_cap, int32_t *indices, size_t indices_cap,
                         int32_t *last_page_len, size_t last_cap, size_t *nindices) {
    if ((nseqs > 0 && seqs == NULL) || indptr == NULL || (nseqs > 0 && last_page_len == NULL)) {
        return KV_EINVAL;
    }
    if (indptr_cap < nseqs + 1 || last_cap < nseqs) {
        return KV_ETOOBIG;
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
        return KV_ETOOBIG;
    }
    if (total > 0 && indices == NULL) {
        return KV_EINVAL;
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
                return KV_ETOOBIG;
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
        return KV_EINVAL;
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
