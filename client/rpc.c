/* rpc: libkvclient's requests: the session (Hello, open, reconnect, close), encoding each
 * request, completing its reply, and the synchronous and batched entry points.
 *
 * Every request is queued into a kvc_batch (a synchronous call uses a batch of one on the
 * stack), so both paths share one encoder and one reply handler per request kind. The transport
 * (client/conn.c) hands each reply to kvc__op_complete, which kvc_conn_open installs when it
 * makes the connection. Replies are checked against what was asked (a Lookup cannot return more
 * blocks than hashes, an Allocate returns exactly count blocks) because a confused daemon must
 * not make us write past a caller's buffer.
 */
#include "client/rpc.h"

#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client/conn.h"
#include "client/diag.h"
#include "client/map.h"
#include "common/kv_wire.h"

/* Packed lists are encoded straight from the caller's arrays on little-endian hosts. */
_Static_assert(sizeof(kv_hash128) == KV_WIRE_HASH_BYTES && offsetof(kv_hash128, hi) == 8,
               "kv_hash128 is not the packed hash record");
_Static_assert(sizeof(kvc_block) == KV_WIRE_BLOCK_BYTES && offsetof(kvc_block, gen) == 4,
               "kvc_block is not the packed block record");

/* ---- reply handling ------------------------------------------------------------------- */

static void blocks_out(kvc_block *out, Kvd__BlockRef *const *refs, size_t n) {
    for (size_t i = 0; i < n; i++) {
        out[i].id = refs[i]->id;
        out[i].gen = refs[i]->gen;
    }
}

/* Block count of a reply list sent as BlockRefs or packed; KV_EPROTO when malformed. */
static kv_err blocks_count(size_t nrep, const ProtobufCBinaryData *packed, size_t *n) {
    return kv_wire_list_count(nrep, packed->len, KV_WIRE_BLOCK_BYTES, n);
}

/* Copies n blocks of a reply list (either form) to out. */
static void blocks_out_any(kvc_block *out, Kvd__BlockRef *const *refs, size_t nrep,
                           const ProtobufCBinaryData *packed, size_t n) {
    if (nrep > 0) {
        blocks_out(out, refs, n);
        return;
    }
    for (size_t i = 0; i < n; i++) {
        kv_wire_block_get(packed->data, i, &out[i].id, &out[i].gen);
    }
}

/* A reply's new_segments_from: non-zero means the daemon has segments of p it never sent us. */
static void note_new_segments(kvc_pool *p, uint32_t from) {
    if (from != 0) {
        p->need_map = 1;
    }
}

/* A block handed to us in p must be addressable by the time the call returns: when its segment
 * is not mapped (whatever the reply announced), fetch from our first hole. */
static void note_block(kvc_pool *p, uint32_t id) {
    if (!kvc__pool_block_mapped(p, id)) {
        p->need_map = 1;
    }
}

static kv_err bad_reply(kvc_conn *c, const char *what) {
    kvc__log(&c->diag, KVC_LOG_ERROR, "KVC-RPC-REPLY", "malformed reply: %s", what);
    return kvc__fail(&c->diag, KV_EPROTO, "malformed reply from kvd: %s", what);
}

static kv_err complete_hello(kvc_conn *c, const Kvd__HelloReply *r) {
    if (r->protocol_version != KV_PROTOCOL_VERSION) {
        return kvc__fail(&c->diag, KV_EVERSION, "kvd speaks protocol %u, we speak %u",
                         r->protocol_version, KV_PROTOCOL_VERSION);
    }
    if (r->boot_epoch == 0 || r->max_frame_bytes < 1024) {
        return bad_reply(c, "HelloReply without epoch or frame limit");
    }
    c->session_id = r->session_id;
    snprintf(c->tenant, sizeof(c->tenant), "%s", r->tenant ? r->tenant : "");
    c->epoch = r->boot_epoch;
    c->max_frame = r->max_frame_bytes;
    c->max_inflight = r->max_inflight;
    c->max_blocks = r->max_blocks_per_request ? r->max_blocks_per_request : 4096;
    c->features = r->features; /* an older daemon sends 0: repeated lists only */
    return KV_OK;
}

/* Makes one pool object per AttachPoolReply.linked entry (same layout, seed and algorithm as
 * p: the seed is the same in every domain). Their segments are fetched after the reply
 * (kvc_pool_attach), since that takes more round trips. */
static kv_err link_pools(kvc_conn *c, kvc_pool *p, const Kvd__AttachPoolReply *r,
                         uint32_t max_segments) {
    if (r->n_linked == 0) {
        return KV_OK;
    }
    if (r->n_linked > 4096) {
        return bad_reply(c, "AttachPoolReply links too many pools");
    }
    p->linked = calloc(r->n_linked, sizeof(*p->linked));
    if (p->linked == NULL) {
        return kvc__fail(&c->diag, KV_ENOMEM, "out of memory for linked pools");
    }
    for (size_t i = 0; i < r->n_linked; i++) {
        const Kvd__LinkedPool *lk = r->linked[i];
        if (lk->pool_id == 0 || lk->pool_id == r->pool_id) {
            return bad_reply(c, "AttachPoolReply links a pool without id or itself");
        }
        for (size_t j = 0; j < i; j++) {
            if (r->linked[j]->pool_id == lk->pool_id) {
                return bad_reply(c, "AttachPoolReply links one pool twice");
            }
        }
        kvc_pool *lp = calloc(1, sizeof(*lp));
        if (lp == NULL) {
            return kvc__fail(&c->diag, KV_ENOMEM, "out of memory for a linked pool");
        }
        p->linked[p->nlinked++] = lp; /* freed with p from here on */
        lp->conn = c;
        lp->diag = p->diag;
        lp->gpu_ops = p->gpu_ops; /* maps like the pool that linked it */
        lp->owner = p;
        lp->pool_id = lk->pool_id;
        lp->read_only = lk->read_only;
        snprintf(lp->domain, sizeof(lp->domain), "%s", lk->domain ? lk->domain : "");
        uint32_t bps = lk->blocks_per_segment ? lk->blocks_per_segment : p->blocks_per_segment;
        kv_err err = kvc__pool_init_geometry(lp, &p->layout, bps, max_segments);
        if (err != KV_OK) {
            return kvc__fail(&c->diag, err, "cannot reserve address space for linked pool %u: %s",
                             lk->pool_id, kv_strerror(err));
        }
        lp->hash_algo = p->hash_algo;
        lp->seed = p->seed;
        memcpy(lp->none_hash, p->none_hash, sizeof(lp->none_hash));
        lp->epoch = p->epoch;
        lp->session = p->session;
    }
    return KV_OK;
}

static kv_err complete_attach(kvc_conn *c, kvc__op *op, const Kvd__AttachPoolReply *r,
                              const int *fds, size_t nfds) {
    kvc_pool *p = op->pool;
    const Kvd__Layout *l = r->layout;
    if (l == NULL || r->pool_id == 0 || r->blocks_per_segment == 0 || r->max_segments == 0) {
        return bad_reply(c, "AttachPoolReply without layout or geometry");
    }
    kv_layout lay;
    if (kv_layout_init(l->num_layers, l->num_kv_heads, l->head_dim, l->tokens_per_block,
                       (kv_dtype)l->dtype, (kv_arrangement)l->arrangement, &lay) != KV_OK) {
        return bad_reply(c, "AttachPoolReply layout is invalid");
    }
    if (l->block_bytes != 0 && l->block_bytes != lay.block_bytes) {
        return kvc__fail(&c->diag, KV_EPROTO,
                         "kvd's block is %llu bytes, ours %llu: layout mismatch",
                         (unsigned long long)l->block_bytes, (unsigned long long)lay.block_bytes);
    }
    uint32_t max_segments = r->max_segments;
    /* Never reserve room for fewer segments than the reply already names. */
    for (size_t i = 0; i < r->n_segments; i++) {
        if (r->segments[i]->index >= max_segments) {
            max_segments = r->segments[i]->index + 1;
        }
    }
    kv_err err = kvc__pool_init_geometry(p, &lay, r->blocks_per_segment, max_segments);
    if (err != KV_OK) {
        return kvc__fail(&c->diag, err, "cannot reserve address space for the pool: %s",
                         kv_strerror(err));
    }
    p->pool_id = r->pool_id;
    p->hash_algo = r->hash_algo ? (int)r->hash_algo : KV_HASH_XXH3_128;
    if (p->hash_algo == KV_HASH_VLLM) {
        if (r->none_hash.len != sizeof(p->none_hash)) {
            return kvc__fail(&c->diag, KV_EPROTO,
                             "AttachPoolReply: hash_algo 3 (vLLM) with a %zu-byte none_hash (32 "
                             "expected)",
                             r->none_hash.len);
        }
        memcpy(p->none_hash, r->none_hash.data, sizeof(p->none_hash));
    }
    if (r->hash_seed != NULL) {
        p->seed.lo = r->hash_seed->lo;
        p->seed.hi = r->hash_seed->hi;
    }
    p->epoch = c->epoch;
    p->session = c->session_id;
    snprintf(p->domain, sizeof(p->domain), "%s", c->tenant);
    err = link_pools(c, p, r, max_segments);
    if (err != KV_OK) {
        return err;
    }
    if (r->device_uuid.len == sizeof(p->device_uuid)) {
        memcpy(p->device_uuid, r->device_uuid.data, sizeof(p->device_uuid));
        p->has_device_uuid = 1;
    }
    if (r->layout_conflict) {
        p->layout_conflict = 1;
        kvc__log(&c->diag, KVC_LOG_WARN, "KVC-POOL-LAYOUT",
                 "pool %u: kvd has another pool of this model id with a different layout (a "
                 "second attach with other shapes makes a separate pool that shares nothing)",
                 p->pool_id);
    }
    err = kvc__pool_map_reply(p, r->segments, r->n_segments, fds, nfds);
    if (err == KV_OK && (r->more_segments || r->n_segments == KV_WIRE_MAX_FDS)) {
        p->need_map = 1; /* more follow: fetched once this reply is done */
    }
    return err;
}

/* Fills op->pools[0..n) from LookupReply.pool_ids. A daemon that sent none (it predates
 * search_domains) searched the named pool only. Every id must be the named pool or one of its
 * links: the reply names the pool a block must be released to. */
static kv_err lookup_pools(kvc_conn *c, kvc__op *op, const Kvd__LookupReply *r, size_t n) {
    if (r->n_pool_ids == 0) {
        for (size_t i = 0; i < n; i++) {
            op->pools[i] = op->pool;
        }
        return KV_OK;
    }
    if (r->n_pool_ids != n) {
        return bad_reply(c, "LookupReply pool_ids is not parallel to blocks");
    }
    for (size_t i = 0; i < n; i++) {
        kvc_pool *hp = r->pool_ids[i] == op->pool->pool_id
                           ? op->pool
                           : kvc__pool_find(op->pool, r->pool_ids[i]);
        if (hp == NULL || (hp != op->pool && hp->owner != op->pool)) {
            return bad_reply(c, "LookupReply names a pool that is not linked");
        }
        op->pools[i] = hp;
    }
    return KV_OK;
}

kv_err kvc__op_complete(kvc_conn *c, kvc__op *op, const Kvd__Envelope *env, const int *fds,
                        size_t nfds) {
    if (env->body_case == KVD__ENVELOPE__BODY_ERROR) {
        const Kvd__Error *e = env->error;
        int code = (int)e->code;
        kv_err err = code > 0 && code < KV_ERR_COUNT ? (kv_err)code : KV_EINTERNAL;
        kvc__log(&c->diag, KVC_LOG_DEBUG, "KVC-RPC-ERROR", "request %llu: %s: %s",
                 (unsigned long long)op->id, kv_err_name(code), e->message ? e->message : "");
        return kvc__fail(&c->diag, err, "%s: %s", kv_err_name(code),
                         e->message && e->message[0] ? e->message : kv_strerror(err));
    }
    switch (op->kind) {
        case KVC__OP_HELLO:
            if (env->body_case != KVD__ENVELOPE__BODY_HELLO_REPLY) {
                break;
            }
            return complete_hello(c, env->hello_reply);
        case KVC__OP_ATTACH:
            if (env->body_case != KVD__ENVELOPE__BODY_ATTACH_POOL_REPLY) {
                break;
            }
            return complete_attach(c, op, env->attach_pool_reply, fds, nfds);
        case KVC__OP_MAP: {
            if (env->body_case != KVD__ENVELOPE__BODY_MAP_SEGMENTS_REPLY) {
                break;
            }
            const Kvd__MapSegmentsReply *r = env->map_segments_reply;
            kv_err err = kvc__pool_map_reply(op->pool, r->segments, r->n_segments, fds, nfds);
            if (err == KV_OK && op->nout != NULL) {
                /* A full reply (200 segments, or fewer with more_segments: the fd limit) is one
                 * of several: the caller asks again from its last index + 1. */
                *op->nout = r->more_segments ? KV_WIRE_MAX_FDS : r->n_segments;
            }
            return err;
        }
        case KVC__OP_LOOKUP: {
            if (env->body_case != KVD__ENVELOPE__BODY_LOOKUP_REPLY) {
                break;
            }
            const Kvd__LookupReply *r = env->lookup_reply;
            size_t n;
            if (blocks_count(r->n_blocks, &r->blocks_packed, &n) != KV_OK) {
                return bad_reply(c, "LookupReply blocks_packed is malformed");
            }
            if (n > op->count) {
                return bad_reply(c, "more lookup hits than hashes");
            }
            if (op->pools != NULL) {
                kv_err err = lookup_pools(c, op, r, n);
                if (err != KV_OK) {
                    return err;
                }
            }
            note_new_segments(op->pool, r->new_segments_from);
            for (size_t i = 0; i < r->n_linked_segments; i++) {
                kvc_pool *lp = kvc__pool_find(op->pool, r->linked_segments[i]->pool_id);
                if (lp == NULL || lp == op->pool) {
                    return bad_reply(c, "LookupReply announces segments of a pool not linked");
                }
                lp->need_map = 1;
            }
            blocks_out_any(op->out, r->blocks, r->n_blocks, &r->blocks_packed, n);
            kvc_block *out = op->out;
            for (size_t i = 0; i < n; i++) {
                note_block(op->pools != NULL ? op->pools[i] : op->pool, out[i].id);
            }
            *op->nout = n;
            if (op->aux != NULL && op->aux_fetch) {
                /* A fetch sent as a Lookup (no lower tiers): the T0 hits are the answer. */
                kvc_fetch_result *fr = op->aux;
                fr->nblocks = n;
                fr->t0_hits = (uint32_t)n;
                fr->status = KVC_FETCH_DONE;
            } else if (op->aux != NULL) {
                kvc_tier_hits *th = op->aux;
                th->fetchable = r->tier_fetchable;
                th->t1 = r->tier1_hits;
                th->t2 = r->tier2_hits;
            }
            if (op->remote != NULL) {
                op->remote->blocks = r->remote_hits;
                op->remote->failure = (kv_err)r->remote_failure;
            }
            return KV_OK;
        }
        case KVC__OP_FETCH: {
            if (env->body_case != KVD__ENVELOPE__BODY_FETCH_REPLY) {
                break;
            }
            const Kvd__FetchReply *r = env->fetch_reply;
            size_t n;
            if (blocks_count(r->n_blocks, &r->blocks_packed, &n) != KV_OK) {
                return bad_reply(c, "FetchReply blocks_packed is malformed");
            }
            if (n > op->count || r->t0_hits > n || r->promoted > n) {
                return bad_reply(c, "FetchReply has more blocks than hashes");
            }
            note_new_segments(op->pool, r->new_segments_from);
            blocks_out_any(op->out, r->blocks, r->n_blocks, &r->blocks_packed, n);
            kvc_block *out = op->out;
            for (size_t i = 0; i < n; i++) {
                note_block(op->pool, out[i].id);
            }
            *op->nout = n;
            kvc_fetch_result *fr = op->aux;
            fr->nblocks = n;
            fr->t0_hits = r->t0_hits;
            fr->promoted = r->promoted;
            fr->lower_run = r->lower_run;
            fr->status = (int)r->status;
            fr->failure =
                (int)r->failure > 0 && (int)r->failure < KV_ERR_COUNT ? (kv_err)r->failure : KV_OK;
            if (fr->status == KVC_FETCH_PARTIAL || fr->status == KVC_FETCH_SHORT) {
                kvc__log(&c->diag, KVC_LOG_DEBUG, "KVC-FETCH", "request %llu: %s",
                         (unsigned long long)op->id, r->message != NULL ? r->message : "");
            }
            return KV_OK;
        }
        case KVC__OP_ALLOCATE: {
            if (env->body_case != KVD__ENVELOPE__BODY_ALLOCATE_REPLY) {
                break;
            }
            const Kvd__AllocateReply *r = env->allocate_reply;
            size_t n;
            if (blocks_count(r->n_blocks, &r->blocks_packed, &n) != KV_OK) {
                return bad_reply(c, "AllocateReply blocks_packed is malformed");
            }
            if (n != op->count) {
                return bad_reply(c, "allocate returned a different block count");
            }
            note_new_segments(op->pool, r->new_segments_from);
            blocks_out_any(op->out, r->blocks, r->n_blocks, &r->blocks_packed, n);
            kvc_block *out = op->out;
            for (size_t i = 0; i < n; i++) {
                note_block(op->pool, out[i].id);
            }
            return KV_OK;
        }
        case KVC__OP_COMMIT: {
            if (env->body_case != KVD__ENVELOPE__BODY_COMMIT_REPLY) {
                break;
            }
            const Kvd__CommitReply *r = env->commit_reply;
            size_t n;
            if (blocks_count(r->n_canonical, &r->canonical_packed, &n) != KV_OK) {
                return bad_reply(c, "malformed canonical_packed in CommitReply");
            }
            if (n != op->count) {
                return bad_reply(c, "commit returned a different entry count");
            }
            if (op->out != NULL) {
                blocks_out_any(op->out, r->canonical, r->n_canonical, &r->canonical_packed, n);
            }
            /* A duplicate's canonical block may lie in a segment another session grew. */
            note_new_segments(op->pool, r->new_segments_from);
            for (size_t i = 0; i < n; i++) {
                uint32_t id =
                    r->n_canonical > 0
                        ? r->canonical[i]->id
                        : kv_wire_le32(r->canonical_packed.data + i * KV_WIRE_BLOCK_BYTES);
                note_block(op->pool, id);
            }
            return KV_OK;
        }
        case KVC__OP_RELEASE:
            if (env->body_case != KVD__ENVELOPE__BODY_RELEASE_REPLY) {
                break;
            }
            return KV_OK;
        case KVC__OP_REWIND:
            if (env->body_case != KVD__ENVELOPE__BODY_REWIND_REPLY) {
                break;
            }
            return KV_OK;
        case KVC__OP_PIN:
            if (env->body_case != KVD__ENVELOPE__BODY_PIN_REPLY) {
                break;
            }
            return KV_OK;
        case KVC__OP_UNSHARE:
            if (env->body_case != KVD__ENVELOPE__BODY_UNSHARE_REPLY) {
                break;
            }
            return KV_OK;
        case KVC__OP_SUMMARIES: {
            if (env->body_case != KVD__ENVELOPE__BODY_SUMMARIES_REPLY) {
                break;
            }
            const Kvd__SummariesReply *r = env->summaries_reply;
            const kv_layout *l = &op->pool->layout;
            size_t per = (size_t)l->num_layers * l->num_kv_heads * 3 * l->head_dim;
            if (r->n_summaries != op->count) {
                return bad_reply(c, "summaries returned a different count");
            }
            for (size_t i = 0; i < r->n_summaries; i++) {
                size_t len = r->summaries[i].len;
                if (len != 0 && len != per * sizeof(float)) {
                    return bad_reply(c, "a summary of the wrong size");
                }
                if (len != 0) {
                    memcpy((float *)op->out + i * per, r->summaries[i].data, len);
                }
                if (op->aux != NULL) {
                    ((uint8_t *)op->aux)[i] = len != 0;
                }
            }
            return KV_OK;
        }
        case KVC__OP_STATS: {
            if (env->body_case != KVD__ENVELOPE__BODY_STATS_REPLY) {
                break;
            }
            const Kvd__StatsReply *r = env->stats_reply;
            for (size_t i = 0; i < r->n_stats; i++) {
                if (op->stat_fn != NULL && r->stats[i]->name != NULL) {
                    op->stat_fn(op->stat_arg, r->stats[i]->name, r->stats[i]->value);
                }
            }
            return KV_OK;
        }
        case KVC__OP_PING: {
            if (env->body_case != KVD__ENVELOPE__BODY_PONG) {
                break;
            }
            const Kvd__Pong *r = env->pong;
            if (r->nonce != op->nonce || r->payload.len != op->expect_len ||
                (op->expect_len > 0 && memcmp(r->payload.data, op->expect, op->expect_len))) {
                return bad_reply(c, "Pong does not echo the Ping");
            }
            return KV_OK;
        }
        case KVC__OP_GOODBYE:
            if (env->body_case != KVD__ENVELOPE__BODY_GOODBYE_REPLY) {
                break;
            }
            return KV_OK;
        case KVC__OP_DETACH:
            if (env->body_case != KVD__ENVELOPE__BODY_DETACH_POOL_REPLY) {
                break;
            }
            return KV_OK;
    }
    return bad_reply(c, "reply type does not match the request");
}

/* ---- the session: Hello, open, reconnect, close ---------------------------------------- */

/* Sends one request outside any batch of the caller's and waits for its reply; the op is tied to
 * pool and nout (either may be NULL) before it is sent. Returns the send error or the reply's
 * status. */
/* ---- deferred Releases (kvc_release_deferred) ------------------------------------------ */

#define LATER_MAX_OPS 64 /* deferred Releases queued before the next one sends them all */

/* 1 when the connection has deferred Releases for its current socket; ones queued on an older
 * socket are dropped (that session ended, and with it every reference it held). */
static int later_pending(kvc_conn *c) {
    kvc_batch *l = c->later;
    if (l == NULL || l->nops == 0) {
        return 0;
    }
    if (c->later_dial != c->dials || c->broken || c->fd < 0) {
        kvc__batch_fini(l);
        kvc__batch_init(l, c);
        return 0;
    }
    return 1;
}

/* Takes the results of the first n ops of the later batch (the deferred Releases): a refusal is
 * logged, counted and kept for kvc_flush (with msg, the daemon's message, when known). After a
 * transport failure nothing counts: the session ended and released everything it held. Then
 * empties the batch for the next ones. */
static void later_settle(kvc_conn *c, size_t n, const char *msg) {
    kvc_batch *l = c->later;
    for (size_t i = 0; i < n && !c->broken; i++) {
        kv_err st = l->ops[i].done ? l->ops[i].status : KV_ECLOSED;
        if (st == KV_OK) {
            continue;
        }
        c->later_failed++;
        kvc__log(&c->diag, KVC_LOG_WARN, "KVC-RELEASE-DEFERRED",
                 "a deferred Release of %zu block(s) failed: %s: %s", l->ops[i].count,
                 kv_err_name(st), msg);
        if (c->later_err == KV_OK) {
            c->later_err = st;
            snprintf(c->later_msg, sizeof(c->later_msg), "%s: %s", kv_err_name(st), msg);
        }
    }
    kvc__batch_fini(l);
    kvc__batch_init(l, c);
}

static kv_err grow_to(void **buf, size_t *cap, size_t need, size_t elem) {
    if (need <= *cap) {
        return KV_OK;
    }
    size_t ncap = *cap ? *cap : 8;
    while (ncap < need) {
        ncap *= 2;
    }
    void *n = realloc(*buf, ncap * elem);
    if (n == NULL) {
        return KV_ENOMEM;
    }
    *buf = n;
    *cap = ncap;
    return KV_OK;
}

/* Runs b (queued, nothing sent) and waits for all of it. Deferred Releases go first in the same
 * write: b's ops and frames are appended to the later batch, that batch is exchanged, and the
 * results are copied back into b's ops, which the caller reads as if b had run alone. */
static kv_err sync_exchange(kvc_batch *b) {
    kvc_conn *c = b->conn;
    if (c->active != NULL || b->nsent != 0 || !later_pending(c)) {
        return kvc__exchange(b, 1);
    }
    kvc_batch *l = c->later;
    size_t first = l->nops;
    size_t ocap = l->ocap;
    if (grow_to((void **)&l->ops, &l->cap, first + b->nops, sizeof(kvc__op)) != KV_OK ||
        grow_to((void **)&l->obuf, &ocap, l->olen + b->olen, 1) != KV_OK) {
        return kvc__exchange(b, 1); /* no memory to merge: they wait for the next call */
    }
    l->ocap = ocap;
    for (size_t i = 0; i < b->nops; i++) {
        l->ops[first + i] = b->ops[i];
        l->ops[first + i].frame_off += l->olen;
    }
    memcpy(l->obuf + l->olen, b->obuf, b->olen);
    l->olen += b->olen;
    l->nops += b->nops;
    kv_err err = kvc__exchange(l, 1);
    for (size_t i = 0; i < b->nops; i++) {
        kvc__op *o = &b->ops[i];
        const kvc__op *r = &l->ops[first + i];
        o->sent = r->sent;
        o->done = r->done;
        o->status = r->status;
    }
    b->nsent = b->nops;
    b->osent = b->olen;
    /* The last error message is the last failure's: theirs only when the call's ops all
     * succeeded, and it stays the call's own either way. */
    int own_failed = 0;
    for (size_t i = 0; i < b->nops; i++) {
        own_failed |= b->ops[i].status != KV_OK;
    }
    char why[sizeof(c->diag.err)];
    snprintf(why, sizeof(why), "%s", c->diag.err);
    later_settle(c, first, own_failed ? "(message lost to the call's own error)" : why);
    snprintf(c->diag.err, sizeof(c->diag.err), "%s", why);
    return err;
}

/* Sends the deferred Releases alone and waits for their replies. */
static kv_err later_flush(kvc_conn *c) {
    if (!later_pending(c)) {
        return KV_OK;
    }
    kv_err err = kvc__exchange(c->later, 1);
    later_settle(c, c->later->nops, c->diag.err);
    return err;
}

static kv_err exchange_one(kvc_conn *c, kvc__op_kind kind, Kvd__Envelope *env, kvc_pool *pool,
                           size_t *nout) {
    kvc_batch b;
    kvc__batch_init(&b, c);
    kvc__op *op;
    kv_err err = kvc__batch_add(&b, kind, env, &op);
    if (err == KV_OK) {
        op->pool = pool;
        op->nout = nout;
        err = kind == KVC__OP_HELLO ? kvc__exchange(&b, 1) : sync_exchange(&b);
    }
    if (err == KV_OK) {
        err = b.ops[0].status;
    }
    kvc__batch_fini(&b);
    return err;
}

static kv_err hello(kvc_conn *c) {
    Kvd__Hello h = KVD__HELLO__INIT;
    h.protocol_version = KV_PROTOCOL_VERSION;
    h.client_name = c->name;
    h.token.data = c->token;
    h.token.len = c->token_len;
    /* We read packed block lists (CommitReply's too) and LookupReply's tier fields, and match
     * every reply by its id (a FetchReply may come after later replies). */
    h.features = KV_FEATURE_PACKED | KV_FEATURE_TIERS | KV_FEATURE_PACKED_COMMIT;
    Kvd__Envelope env = KVD__ENVELOPE__INIT;
    env.body_case = KVD__ENVELOPE__BODY_HELLO;
    env.hello = &h;
    return exchange_one(c, KVC__OP_HELLO, &env, NULL, NULL);
}

/* Dials and says Hello; on failure the connection is left broken. */
static kv_err connect_hello(kvc_conn *c) {
    kvc__conn_break(c);
    /* Until HelloReply says otherwise, the protocol's default limit. */
    c->max_frame = KV_WIRE_DEFAULT_MAX_FRAME;
    kv_err err = kvc__conn_dial(c);
    if (err != KV_OK) {
        return err;
    }
    uint64_t old = c->epoch;
    c->epoch = 0; /* accept whatever epoch HelloReply carries */
    err = hello(c);
    if (err != KV_OK) {
        c->epoch = old;
        kvc__conn_break(c);
        return err;
    }
    c->broken = 0;
    return KV_OK;
}

kv_err kvc_conn_open(const kvc_options *opts, kvc_conn **out) {
    kvc_conn *c;
    kv_err err = kvc__conn_alloc(opts, kvc__op_complete, &c);
    if (err != KV_OK) {
        return err;
    }
    err = connect_hello(c);
    if (err != KV_OK) {
        kvc__log(&c->diag, KVC_LOG_ERROR, "KVC-CONN-OPEN", "cannot open session: %s", c->diag.err);
        kvc__conn_free(c);
        return err;
    }
    kvc__log(&c->diag, KVC_LOG_INFO, "KVC-CONN-HELLO", "session %llu tenant %s epoch %016llx",
             (unsigned long long)c->session_id, c->tenant, (unsigned long long)c->epoch);
    *out = c;
    return KV_OK;
}

kv_err kvc__rpc_ready(kvc_conn *c) {
    if (c->active != NULL) {
        return kvc__fail(&c->diag, KV_ESTATE,
                         "a batch is in flight on this connection; wait for it");
    }
    if (!c->broken && c->fd >= 0) {
        return KV_OK;
    }
    return kvc_conn_reconnect(c);
}

kv_err kvc_conn_reconnect(kvc_conn *c) {
    if (c->active != NULL) {
        return kvc__fail(&c->diag, KV_ESTATE,
                         "a batch is in flight on this connection; wait for it");
    }
    uint64_t old = c->epoch;
    kv_err err = connect_hello(c);
    if (err != KV_OK) {
        return err;
    }
    if (old != 0 && c->epoch != old) {
        kvc__log(&c->diag, KVC_LOG_WARN, "KVC-CONN-RESTART",
                 "kvd restarted (epoch %016llx -> %016llx): pools must be attached again",
                 (unsigned long long)old, (unsigned long long)c->epoch);
        return kvc__fail(&c->diag, KV_EEPOCH,
                         "kvd restarted (boot epoch changed); attach pools again");
    }
    return KV_OK;
}

void kvc_conn_close(kvc_conn *c) {
    if (c == NULL) {
        return;
    }
    while (c->pools != NULL) {
        /* Linked pools are on the list too; they go with the pool that linked them. */
        kvc__pool_destroy(kvc__pool_owner(c->pools));
    }
    kvc__conn_free(c);
}

/* ---- encoding ------------------------------------------------------------------------- */

static kv_err check_pool(kvc_conn *c, kvc_pool *p) {
    if (p == NULL) {
        return kvc__fail(&c->diag, KV_EINVAL, "no pool");
    }
    if (p->epoch != c->epoch) {
        return kvc__fail(&c->diag, KV_EEPOCH,
                         "pool %u belongs to a previous kvd instance; attach again", p->pool_id);
    }
    if (p->session != c->session_id) {
        /* Same daemon, new session after a lost connection: the daemon dropped every
         * reference and attachment of the old one, so its handles mean nothing now. */
        return kvc__fail(&c->diag, KV_ECLOSED,
                         "pool %u was attached in a session that ended (connection lost); "
                         "attach again",
                         p->pool_id);
    }
    return KV_OK;
}

static kv_err check_list(kvc_conn *c, size_t n, const void *ptr) {
    if (n > 0 && ptr == NULL) {
        return kvc__fail(&c->diag, KV_EINVAL, "NULL list");
    }
    if (n > c->max_blocks) {
        return kvc__fail(&c->diag, KV_ETOOBIG, "list of %zu exceeds the daemon's %u per request", n,
                         c->max_blocks);
    }
    return KV_OK;
}

/* Builds BlockRef messages for blocks[0..n) in caller-freed arrays. */
static kv_err refs_build(kvc_conn *c, const kvc_block *blocks, size_t n, Kvd__BlockRef **msgs,
                         Kvd__BlockRef ***ptrs) {
    Kvd__BlockRef *m = malloc((n ? n : 1) * sizeof(*m));
    Kvd__BlockRef **p = malloc((n ? n : 1) * sizeof(*p));
    if (m == NULL || p == NULL) {
        free(m);
        free(p);
        return kvc__fail(&c->diag, KV_ENOMEM, "out of memory encoding %zu blocks", n);
    }
    for (size_t i = 0; i < n; i++) {
        kvd__block_ref__init(&m[i]);
        m[i].id = blocks[i].id;
        m[i].gen = blocks[i].gen;
        p[i] = &m[i];
    }
    *msgs = m;
    *ptrs = p;
    return KV_OK;
}

static kv_err q_ping(kvc_batch *b, const void *payload, size_t len, size_t *index) {
    kvc_conn *c = b->conn;
    if (len > 0 && payload == NULL) {
        return kvc__fail(&c->diag, KV_EINVAL, "NULL payload");
    }
    Kvd__Ping m = KVD__PING__INIT;
    m.nonce = c->next_id * 0x9e3779b97f4a7c15ull + 1;
    m.payload.data = (uint8_t *)payload;
    m.payload.len = len;
    Kvd__Envelope env = KVD__ENVELOPE__INIT;
    env.body_case = KVD__ENVELOPE__BODY_PING;
    env.ping = &m;
    kvc__op *op;
    kv_err err = kvc__batch_add(b, KVC__OP_PING, &env, &op);
    if (err != KV_OK) {
        return err;
    }
    op->nonce = m.nonce;
    op->expect = payload;
    op->expect_len = len;
    if (index != NULL) {
        *index = b->nops - 1;
    }
    return KV_OK;
}

/* Lookup, or Fetch (fetch != NULL): one encoder for both lists of hashes. A daemon without
 * lower tiers gets a Lookup for a fetch, and the result says FETCH_DONE with the T0 hits. */
static kv_err q_hashes(kvc_batch *b, kvc_pool *p, const kv_hash128 *hashes, size_t n,
                       kvc_block *out, kvc_pool **pools, size_t *nhit, size_t *index,
                       kvc_tier_hits *tiers, kvc_fetch_result *fetch, uint32_t min_tokens,
                       kvc_remote_hits *remote) {
    kvc_conn *c = b->conn;
    kv_err err = check_pool(c, p);
    if (err == KV_OK) {
        err = check_list(c, n, hashes);
    }
    if (err == KV_OK && ((n > 0 && out == NULL) || nhit == NULL)) {
        err = kvc__fail(&c->diag, KV_EINVAL, "NULL output");
    }
    if (err != KV_OK) {
        return err;
    }
    int as_fetch = fetch != NULL && (c->features & KV_FEATURE_TIERS);
    Kvd__Hash128 *m = NULL, **ptrs = NULL;
    uint8_t *packed = NULL;
    ProtobufCBinaryData hp = {0, NULL};
    size_t nrep = 0;
    if (c->features & KV_FEATURE_PACKED) {
        /* 16 bytes a hash instead of a 20-byte submessage, and no unpacking in kvd. */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
        /* kv_hash128 {lo, hi} in memory is the packed layout already: encode from the
         * caller's array (kvc__batch_add copies it into the batch). */
        hp.data = (uint8_t *)hashes;
#else
        packed = malloc(n * KV_WIRE_HASH_BYTES + 1);
        if (packed == NULL) {
            err = kvc__fail(&c->diag, KV_ENOMEM, "out of memory encoding %zu hashes", n);
            goto cleanup;
        }
        for (size_t i = 0; i < n; i++) {
            kv_wire_hash_put(packed, i, hashes[i].lo, hashes[i].hi);
        }
        hp.data = packed;
#endif
        hp.len = n * KV_WIRE_HASH_BYTES;
    } else {
        m = malloc((n ? n : 1) * sizeof(*m));
        ptrs = malloc((n ? n : 1) * sizeof(*ptrs));
        if (m == NULL || ptrs == NULL) {
            err = kvc__fail(&c->diag, KV_ENOMEM, "out of memory encoding %zu hashes", n);
            goto cleanup;
        }
        for (size_t i = 0; i < n; i++) {
            kvd__hash128__init(&m[i]);
            m[i].lo = hashes[i].lo;
            m[i].hi = hashes[i].hi;
            ptrs[i] = &m[i];
        }
        nrep = n;
    }
    Kvd__Envelope env = KVD__ENVELOPE__INIT;
    Kvd__Lookup req = KVD__LOOKUP__INIT;
    Kvd__Fetch freq = KVD__FETCH__INIT;
    if (as_fetch) {
        freq.pool_id = p->pool_id;
        freq.hashes_packed = hp;
        freq.n_hashes = nrep;
        freq.hashes = ptrs;
        freq.min_tokens = min_tokens;
        env.body_case = KVD__ENVELOPE__BODY_FETCH;
        env.fetch = &freq;
    } else {
        req.pool_id = p->pool_id;
        req.search_domains = pools != NULL;
        req.remote = remote != NULL;
        req.hashes_packed = hp;
        req.n_hashes = nrep;
        req.hashes = ptrs;
        env.body_case = KVD__ENVELOPE__BODY_LOOKUP;
        env.lookup = &req;
    }
    kvc__op *op;
    err = kvc__batch_add(b, as_fetch ? KVC__OP_FETCH : KVC__OP_LOOKUP, &env, &op);
    if (err == KV_OK) {
        op->pool = p;
        op->count = n;
        op->out = out;
        op->nout = nhit;
        op->pools = pools;
        op->aux = fetch != NULL ? (void *)fetch : (void *)tiers;
        op->aux_fetch = fetch != NULL;
        if (fetch != NULL) {
            memset(fetch, 0, sizeof(*fetch));
        }
        if (tiers != NULL) {
            memset(tiers, 0, sizeof(*tiers));
        }
        op->remote = remote;
        if (remote != NULL) {
            memset(remote, 0, sizeof(*remote));
        }
        if (index != NULL) {
            *index = b->nops - 1;
        }
    }
cleanup:
    free(m);
    free(ptrs);
    free(packed);
    return err;
}

static kv_err q_lookup(kvc_batch *b, kvc_pool *p, const kv_hash128 *hashes, size_t n,
                       kvc_block *out, kvc_pool **pools, size_t *nhit, size_t *index) {
    return q_hashes(b, p, hashes, n, out, pools, nhit, index, NULL, NULL, 0, NULL);
}

/* Queues an op of kind for env's request (encoded by kvc__batch_add) whose reply fills
 * count blocks of out in pool p; *index (may be NULL) gets its place in the batch. */
static kv_err op_add(kvc_batch *b, kvc__op_kind kind, kvc_pool *p, Kvd__Envelope *env, size_t count,
                     kvc_block *out, size_t *index) {
    kvc__op *op;
    kv_err err = kvc__batch_add(b, kind, env, &op);
    if (err == KV_OK) {
        op->pool = p;
        op->count = count;
        op->out = out;
        if (index != NULL) {
            *index = b->nops - 1;
        }
    }
    return err;
}

static kv_err q_allocate(kvc_batch *b, kvc_pool *p, uint32_t count, int priv, kvc_block *out,
                         size_t *index) {
    kvc_conn *c = b->conn;
    kv_err err = check_pool(c, p);
    if (err == KV_OK && (count == 0 || out == NULL)) {
        err = kvc__fail(&c->diag, KV_EINVAL, "allocate needs count >= 1 and an output array");
    }
    if (err == KV_OK && priv && !(c->features & KV_FEATURE_PRIVATE)) {
        err = kvc__fail(
            &c->diag, KV_ENOTSUP,
            "the daemon has no private blocks (HelloReply.features PRIVATE): upgrade kvd");
    }
    if (err == KV_OK) {
        err = check_list(c, count, out);
    }
    if (err != KV_OK) {
        return err;
    }
    Kvd__Allocate req = KVD__ALLOCATE__INIT;
    req.pool_id = p->pool_id;
    req.count = count;
    req.private_blocks = priv != 0;
    Kvd__Envelope env = KVD__ENVELOPE__INIT;
    env.body_case = KVD__ENVELOPE__BODY_ALLOCATE;
    env.allocate = &req;
    return op_add(b, KVC__OP_ALLOCATE, p, &env, count, out, index);
}

static kv_err q_blocks(kvc_batch *b, kvc__op_kind kind, kvc_pool *p, const kvc_block *blocks,
                       size_t n, uint64_t retention_ms, uint8_t priority, int unpin, size_t *index);

/* The commit guard: a block this client cannot address was never written through its mapping,
 * so its bytes are whatever the slot held (zeros, or another prefix's evicted block), and a
 * commit would publish them under the caller's hash for every other worker. Such a commit is
 * refused (KV_ESTATE) and a Release of the unaddressable blocks is queued in b in its place, so
 * the leases go back when b runs. */
static kv_err commit_guard(kvc_batch *b, kvc_pool *p, const kvc_commit_entry *entries, size_t n) {
    kvc_conn *c = b->conn;
    size_t bad = 0;
    uint32_t first = 0;
    for (size_t i = 0; i < n; i++) {
        if (!kvc__pool_block_mapped(p, entries[i].block.id)) {
            first = bad++ == 0 ? entries[i].block.id : first;
        }
    }
    if (bad == 0) {
        return KV_OK;
    }
    kvc_block *rel = malloc(bad * sizeof(*rel));
    size_t k = 0;
    for (size_t i = 0; rel != NULL && i < n; i++) {
        if (!kvc__pool_block_mapped(p, entries[i].block.id)) {
            rel[k++] = entries[i].block;
        }
    }
    kv_err rerr = rel != NULL ? q_blocks(b, KVC__OP_RELEASE, p, rel, k, 0, 0, 0, NULL) : KV_ENOMEM;
    free(rel);
    kvc__log(&c->diag, KVC_LOG_ERROR, "KVC-COMMIT-UNMAPPED",
             "pool %u: refusing to commit %zu block(s) this client cannot address (first: block "
             "%u, segment %u)",
             p->pool_id, bad, first, first / p->blocks_per_segment);
    return kvc__fail(&c->diag, KV_ESTATE,
                     "pool %u: %zu of %zu blocks to commit lie in segments this client has not "
                     "mapped (first: block %u in segment %u), so their bytes were not written "
                     "through its mapping; nothing was committed and %s",
                     p->pool_id, bad, n, first, first / p->blocks_per_segment,
                     rerr == KV_OK ? "their leases are released" : "release them (kvc_release)");
}

/* A Commit in its packed form (HelloReply.features PACKED_COMMIT; PROTOCOL.md §6): 28 bytes an
 * entry and the digests and token ids as they come, no submessage per entry. */
static kv_err q_commit_packed(kvc_batch *b, kvc_pool *p, const kvc_commit_entry *entries, size_t n,
                              const uint8_t (*full)[32], const uint8_t *parent_full,
                              const uint32_t *tokens, kvc_block *canonical, size_t *index) {
    kvc_conn *c = b->conn;
    size_t tpb = p->layout.tokens_per_block;
    uint8_t *ent = malloc(n > 0 ? n * KV_WIRE_COMMIT_BYTES : 1);
    uint8_t *tok = tokens != NULL ? malloc(n > 0 ? n * tpb * 4 : 1) : NULL;
    kv_err err = KV_OK;
    if (ent == NULL || (tokens != NULL && tok == NULL)) {
        err = kvc__fail(&c->diag, KV_ENOMEM, "out of memory encoding %zu commits", n);
        goto cleanup;
    }
    for (size_t i = 0; i < n; i++) {
        kv_wire_commit w = {entries[i].block.id, entries[i].block.gen, entries[i].hash.lo,
                            entries[i].hash.hi, entries[i].parent};
        kv_wire_commit_put(ent, i, &w);
    }
    for (size_t i = 0; tok != NULL && i < n * tpb; i++) {
        kv_wire_put_le32(tok + 4 * i, tokens[i]);
    }
    Kvd__Commit req = KVD__COMMIT__INIT;
    req.pool_id = p->pool_id;
    req.entries_packed.data = ent;
    req.entries_packed.len = n * KV_WIRE_COMMIT_BYTES;
    if (full != NULL && n > 0) {
        req.hash_full_packed.data = (uint8_t *)full[0];
        req.hash_full_packed.len = n * 32;
    }
    if (tok != NULL) {
        req.token_ids_packed.data = tok;
        req.token_ids_packed.len = n * tpb * 4;
    }
    if (parent_full != NULL && n > 0) {
        req.parent_hash_full.data = (uint8_t *)parent_full;
        req.parent_hash_full.len = 32;
    }
    Kvd__Envelope env = KVD__ENVELOPE__INIT;
    env.body_case = KVD__ENVELOPE__BODY_COMMIT;
    env.commit = &req;
    err = op_add(b, KVC__OP_COMMIT, p, &env, n, canonical, index);
cleanup:
    free(ent);
    free(tok);
    return err;
}

static kv_err q_commit(kvc_batch *b, kvc_pool *p, const kvc_commit_entry *entries, size_t n,
                       const uint8_t (*full)[32], const uint8_t *parent_full,
                       const uint32_t *tokens, kvc_block *canonical, size_t *index) {
    kvc_conn *c = b->conn;
    kv_err err = check_pool(c, p);
    if (err == KV_OK) {
        err = check_list(c, n, entries);
    }
    if (err == KV_OK) {
        err = commit_guard(b, p, entries, n);
    }
    if (err != KV_OK) {
        return err;
    }
    if (c->features & KV_FEATURE_PACKED_COMMIT) {
        return q_commit_packed(b, p, entries, n, full, parent_full, tokens, canonical, index);
    }
    Kvd__CommitEntry *e = malloc((n ? n : 1) * sizeof(*e));
    Kvd__CommitEntry **ep = malloc((n ? n : 1) * sizeof(*ep));
    Kvd__BlockRef *r = malloc((n ? n : 1) * sizeof(*r));
    Kvd__Hash128 *h = malloc((n ? n : 1) * sizeof(*h));
    if (e == NULL || ep == NULL || r == NULL || h == NULL) {
        err = kvc__fail(&c->diag, KV_ENOMEM, "out of memory encoding %zu commits", n);
        goto cleanup;
    }
    for (size_t i = 0; i < n; i++) {
        kvd__commit_entry__init(&e[i]);
        kvd__block_ref__init(&r[i]);
        kvd__hash128__init(&h[i]);
        r[i].id = entries[i].block.id;
        r[i].gen = entries[i].block.gen;
        h[i].lo = entries[i].hash.lo;
        h[i].hi = entries[i].hash.hi;
        e[i].block = &r[i];
        e[i].hash = &h[i];
        e[i].parent = entries[i].parent;
        if (full != NULL) {
            e[i].hash_full.data = (uint8_t *)full[i];
            e[i].hash_full.len = 32;
        }
        if (i == 0 && parent_full != NULL) {
            e[i].parent_hash_full.data = (uint8_t *)parent_full;
            e[i].parent_hash_full.len = 32;
        }
        if (tokens != NULL) {
            e[i].n_token_ids = p->layout.tokens_per_block;
            e[i].token_ids = (uint32_t *)tokens + i * p->layout.tokens_per_block;
        }
        ep[i] = &e[i];
    }
    Kvd__Commit req = KVD__COMMIT__INIT;
    req.pool_id = p->pool_id;
    req.n_entries = n;
    req.entries = ep;
    Kvd__Envelope env = KVD__ENVELOPE__INIT;
    env.body_case = KVD__ENVELOPE__BODY_COMMIT;
    env.commit = &req;
    err = op_add(b, KVC__OP_COMMIT, p, &env, n, canonical, index);
cleanup:
    free(e);
    free(ep);
    free(r);
    free(h);
    return err;
}

/* Release, Rewind and Pin carry the same block list. */
static kv_err q_blocks(kvc_batch *b, kvc__op_kind kind, kvc_pool *p, const kvc_block *blocks,
                       size_t n, uint64_t retention_ms, uint8_t priority, int unpin,
                       size_t *index) {
    kvc_conn *c = b->conn;
    kv_err err = check_pool(c, p);
    if (err == KV_OK) {
        err = check_list(c, n, blocks);
    }
    if (err != KV_OK) {
        return err;
    }
    Kvd__BlockRef *m = NULL, **ptrs = NULL;
    ProtobufCBinaryData packed = {0, NULL};
    uint8_t *owned = NULL;
    if (kind != KVC__OP_PIN && kind != KVC__OP_UNSHARE && (c->features & KV_FEATURE_PACKED)) {
        /* 8 bytes a block instead of a BlockRef submessage (Pin has no packed form). */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
        /* kvc_block {id, gen} in memory is the packed record: encode from the caller's array
         * (kvc__batch_add copies it into the batch). */
        packed.data = (uint8_t *)blocks;
#else
        owned = malloc(n * KV_WIRE_BLOCK_BYTES + 1);
        if (owned == NULL) {
            return kvc__fail(&c->diag, KV_ENOMEM, "out of memory encoding %zu blocks", n);
        }
        for (size_t i = 0; i < n; i++) {
            kv_wire_block_put(owned, i, blocks[i].id, blocks[i].gen);
        }
        packed.data = owned;
#endif
        packed.len = n * KV_WIRE_BLOCK_BYTES;
        n = 0; /* no repeated entries */
    } else {
        err = refs_build(c, blocks, n, &m, &ptrs);
        if (err != KV_OK) {
            return err;
        }
    }
    size_t count = packed.len > 0 ? packed.len / KV_WIRE_BLOCK_BYTES : n;
    Kvd__Release rel = KVD__RELEASE__INIT;
    Kvd__Rewind rew = KVD__REWIND__INIT;
    Kvd__Pin pin = KVD__PIN__INIT;
    Kvd__Unshare uns = KVD__UNSHARE__INIT;
    Kvd__Envelope env = KVD__ENVELOPE__INIT;
    if (kind == KVC__OP_UNSHARE) {
        uns.pool_id = p->pool_id;
        uns.n_blocks = n;
        uns.blocks = ptrs;
        env.body_case = KVD__ENVELOPE__BODY_UNSHARE;
        env.unshare = &uns;
    } else if (kind == KVC__OP_RELEASE) {
        rel.pool_id = p->pool_id;
        rel.n_blocks = n;
        rel.blocks = ptrs;
        rel.blocks_packed = packed;
        env.body_case = KVD__ENVELOPE__BODY_RELEASE;
        env.release = &rel;
    } else if (kind == KVC__OP_REWIND) {
        rew.pool_id = p->pool_id;
        rew.n_blocks = n;
        rew.blocks = ptrs;
        rew.blocks_packed = packed;
        env.body_case = KVD__ENVELOPE__BODY_REWIND;
        env.rewind = &rew;
    } else {
        pin.pool_id = p->pool_id;
        pin.n_blocks = n;
        pin.blocks = ptrs;
        pin.retention_ms = retention_ms;
        pin.priority = priority;
        pin.unpin = unpin != 0;
        env.body_case = KVD__ENVELOPE__BODY_PIN;
        env.pin = &pin;
    }
    kvc__op *op;
    err = kvc__batch_add(b, kind, &env, &op);
    if (err == KV_OK) {
        op->pool = p;
        op->count = count;
        if (index != NULL) {
            *index = b->nops - 1;
        }
    }
    free(m);
    free(ptrs);
    free(owned);
    return err;
}

/* ---- running -------------------------------------------------------------------------- */

/* After a batch: fetch segments that replies said are new, so returned blocks are mapped. */
static kv_err map_pending(kvc_conn *c) {
    for (kvc_pool *p = c->pools; p != NULL; p = p->next) {
        if (p->need_map && !kvc__pool_stale(p)) {
            kv_err err = kvc__rpc_map_new(p);
            if (err != KV_OK) {
                return err;
            }
        }
    }
    return KV_OK;
}

/* The invariant of every build: each block a successful call hands the caller is addressable
 * (its segment is mapped) once the call returns. A daemon that breaks PROTOCOL.md's segment
 * rule (or a bug here) makes the call fail with KV_EPROTO instead of leaving the caller to
 * compute over memory it cannot see; the blocks named in the output stay the caller's to
 * release. Returns the op's status (KV_EPROTO when it changed it). */
static kv_err check_addressable(kvc_conn *c, kvc__op *op) {
    if (op->status != KV_OK || op->out == NULL || op->pool == NULL) {
        return op->status;
    }
    size_t n = op->kind == KVC__OP_LOOKUP || op->kind == KVC__OP_FETCH ? *op->nout
               : op->kind == KVC__OP_ALLOCATE                          ? op->count
               : op->kind == KVC__OP_COMMIT                            ? op->count
                                                                       : 0;
    const kvc_block *out = op->out;
    for (size_t i = 0; i < n; i++) {
        const kvc_pool *p =
            op->kind == KVC__OP_LOOKUP && op->pools != NULL ? op->pools[i] : op->pool;
        if (!kvc__pool_block_mapped(p, out[i].id)) {
            kvc__log(&c->diag, KVC_LOG_ERROR, "KVC-RPC-UNMAPPED",
                     "request %llu returned block %u of pool %u, whose segment %u was never sent "
                     "(first hole %u, %u slots)",
                     (unsigned long long)op->id, out[i].id, p->pool_id,
                     out[i].id / p->blocks_per_segment, kvc__pool_first_hole(p), p->nsegs);
            op->status = kvc__fail(&c->diag, KV_EPROTO,
                                   "kvd handed out block %u of pool %u in segment %u, which it "
                                   "never sent to this session (a daemon bug); the blocks of "
                                   "this call are still held: release them",
                                   out[i].id, p->pool_id, out[i].id / p->blocks_per_segment);
            return op->status;
        }
    }
    return KV_OK;
}

/* Runs a one-request batch synchronously and returns the request's status. */
static kv_err run_one(kvc_batch *b) {
    kv_err err = sync_exchange(b);
    if (err == KV_OK) {
        err = b->ops[0].status;
        kv_err merr = map_pending(b->conn);
        if (err == KV_OK) {
            err = merr;
        }
        if (err == KV_OK) {
            err = check_addressable(b->conn, &b->ops[0]);
        }
    }
    kvc__batch_fini(b);
    return err;
}

#define SYNC_CALL(c, queue_expr)                                                                   \
    do {                                                                                           \
        kv_err err_ = kvc__rpc_ready(c);                                                           \
        if (err_ != KV_OK) {                                                                       \
            return err_;                                                                           \
        }                                                                                          \
        kvc_batch b_;                                                                              \
        kvc__batch_init(&b_, c);                                                                   \
        kvc_batch *b = &b_;                                                                        \
        err_ = (queue_expr);                                                                       \
        if (err_ != KV_OK) {                                                                       \
            kvc__batch_fini(b);                                                                    \
            return err_;                                                                           \
        }                                                                                          \
        return run_one(b);                                                                         \
    } while (0)

kv_err kvc_ping(kvc_conn *c, const void *payload, size_t len) {
    SYNC_CALL(c, q_ping(b, payload, len, NULL));
}

kv_err kvc_lookup(kvc_pool *p, const kv_hash128 *hashes, size_t n, kvc_block *out, size_t *nhit) {
    SYNC_CALL(p->conn, q_lookup(b, p, hashes, n, out, NULL, nhit, NULL));
}

int kvc_conn_has_tiers(const kvc_conn *c) {
    return c != NULL && (c->features & KV_FEATURE_TIERS) != 0;
}

kv_err kvc_lookup_tiers(kvc_pool *p, const kv_hash128 *hashes, size_t n, kvc_block *out,
                        size_t *nhit, kvc_tier_hits *tiers) {
    if (tiers == NULL) {
        return kvc__fail(&p->conn->diag, KV_EINVAL, "NULL tiers output");
    }
    SYNC_CALL(p->conn, q_hashes(b, p, hashes, n, out, NULL, nhit, NULL, tiers, NULL, 0, NULL));
}

int kvc_conn_has_remote(const kvc_conn *c) {
    return c != NULL && (c->features & KV_FEATURE_REMOTE) != 0;
}

kv_err kvc_lookup_remote(kvc_pool *p, const kv_hash128 *hashes, size_t n, kvc_block *out,
                         size_t *nhit, kvc_tier_hits *tiers, kvc_remote_hits *remote) {
    if (tiers == NULL || remote == NULL) {
        return kvc__fail(&p->conn->diag, KV_EINVAL, "NULL tiers or remote output");
    }
    if (!kvc_conn_has_remote(p->conn)) {
        return kvc__fail(&p->conn->diag, KV_ENOTSUP,
                         "the daemon has no remote tier (HelloReply.features REMOTE)");
    }
    SYNC_CALL(p->conn, q_hashes(b, p, hashes, n, out, NULL, nhit, NULL, tiers, NULL, 0, remote));
}

kv_err kvc_fetch(kvc_pool *p, const kv_hash128 *hashes, size_t n, uint32_t min_tokens,
                 kvc_block *out, kvc_fetch_result *res) {
    if (res == NULL) {
        return kvc__fail(&p->conn->diag, KV_EINVAL, "NULL result output");
    }
    SYNC_CALL(p->conn, q_hashes(b, p, hashes, n, out, NULL, &res->nblocks, NULL, NULL, res,
                                min_tokens, NULL));
}

kv_err kvc_lookup_domains(kvc_pool *p, const kv_hash128 *hashes, size_t n, kvc_block *out,
                          kvc_pool **pools, size_t *nhit) {
    if (pools == NULL) {
        return kvc__fail(&p->conn->diag, KV_EINVAL, "NULL pools output");
    }
    SYNC_CALL(p->conn, q_lookup(b, p, hashes, n, out, pools, nhit, NULL));
}

kv_err kvc_allocate(kvc_pool *p, uint32_t count, kvc_block *out) {
    SYNC_CALL(p->conn, q_allocate(b, p, count, 0, out, NULL));
}

static kv_err q_summaries(kvc_batch *b, kvc_pool *p, const kv_hash128 *hashes, size_t n, float *out,
                          uint8_t *found) {
    kvc_conn *c = b->conn;
    kv_err err = check_pool(c, p);
    if (err == KV_OK && n > 0 && (hashes == NULL || out == NULL)) {
        err = kvc__fail(&c->diag, KV_EINVAL, "summaries needs hashes and an output array");
    }
    if (err == KV_OK) {
        err = check_list(c, n, hashes);
    }
    if (err == KV_OK && !(p->attach_flags & KVC_ATTACH_SUMMARIES)) {
        err = kvc__fail(&c->diag, KV_ENOTSUP, "pool %u was attached without KVC_ATTACH_SUMMARIES",
                        p->pool_id);
    }
    if (err != KV_OK) {
        return err;
    }
    uint8_t *packed = malloc(n * KV_WIRE_HASH_BYTES + 1);
    if (packed == NULL) {
        return kvc__fail(&c->diag, KV_ENOMEM, "out of memory encoding %zu hashes", n);
    }
    for (size_t i = 0; i < n; i++) {
        kv_wire_hash_put(packed, i, hashes[i].lo, hashes[i].hi);
    }
    Kvd__Summaries req = KVD__SUMMARIES__INIT;
    req.pool_id = p->pool_id;
    req.hashes_packed.data = packed;
    req.hashes_packed.len = n * KV_WIRE_HASH_BYTES;
    Kvd__Envelope env = KVD__ENVELOPE__INIT;
    env.body_case = KVD__ENVELOPE__BODY_SUMMARIES;
    env.summaries = &req;
    kvc__op *op;
    err = kvc__batch_add(b, KVC__OP_SUMMARIES, &env, &op);
    if (err == KV_OK) {
        op->pool = p;
        op->count = n;
        op->out = out;
        op->aux = found;
    }
    free(packed);
    return err;
}

static kv_err summaries_one(kvc_pool *p, const kv_hash128 *hashes, size_t n, float *out,
                            uint8_t *found) {
    SYNC_CALL(p->conn, q_summaries(b, p, hashes, n, out, found));
}

kv_err kvc_summaries(kvc_pool *p, const kv_hash128 *hashes, size_t n, float *out, uint8_t *found) {
    if (p == NULL || p->conn == NULL) {
        return kvc__fail(NULL, KV_EINVAL, "summaries: NULL pool");
    }
    /* One reply frame holds what the daemon's frame limit leaves (a quarter for headers). */
    const kv_layout *l = &p->layout;
    size_t per = (size_t)l->num_layers * l->num_kv_heads * 3 * l->head_dim;
    size_t room = p->conn->max_frame - p->conn->max_frame / 4;
    size_t chunk = room / (per * sizeof(float));
    chunk = chunk < p->conn->max_blocks ? chunk : p->conn->max_blocks;
    if (n > 0 && chunk == 0) {
        return kvc__fail(&p->conn->diag, KV_ETOOBIG,
                         "one summary (%zu bytes) does not fit the daemon's frame of %u bytes",
                         per * sizeof(float), p->conn->max_frame);
    }
    if (n == 0) {
        return summaries_one(p, hashes, 0, out, found);
    }
    for (size_t i = 0; i < n; i += chunk) {
        size_t k = n - i < chunk ? n - i : chunk;
        kv_err err =
            summaries_one(p, hashes + i, k, out + i * per, found != NULL ? found + i : NULL);
        if (err != KV_OK) {
            return err;
        }
    }
    return KV_OK;
}

kv_err kvc_allocate_private(kvc_pool *p, uint32_t count, kvc_block *out) {
    SYNC_CALL(p->conn, q_allocate(b, p, count, 1, out, NULL));
}

int kvc_conn_has_private(const kvc_conn *c) {
    return c != NULL && (c->features & KV_FEATURE_PRIVATE) != 0;
}

kv_err kvc_unshare(kvc_pool *p, const kvc_block *blocks, size_t n) {
    if (p != NULL && p->conn != NULL && !(p->conn->features & KV_FEATURE_PRIVATE)) {
        return kvc__fail(
            &p->conn->diag, KV_ENOTSUP,
            "the daemon has no private blocks (HelloReply.features PRIVATE): upgrade kvd");
    }
    SYNC_CALL(p->conn, q_blocks(b, KVC__OP_UNSHARE, p, blocks, n, 0, 0, 0, NULL));
}

kv_err kvc_commit(kvc_pool *p, const kvc_commit_entry *entries, size_t n, kvc_block *canonical) {
    return kvc_commit_ex(p, entries, n, NULL, NULL, NULL, canonical);
}

kv_err kvc_commit_ex(kvc_pool *p, const kvc_commit_entry *entries, size_t n,
                     const uint8_t (*full)[32], const uint8_t *parent_full, const uint32_t *tokens,
                     kvc_block *canonical) {
    kvc_conn *c = p->conn;
    kv_err err = kvc__rpc_ready(c);
    if (err != KV_OK) {
        return err;
    }
    (void)map_pending(c); /* a mapping that failed earlier may work now */
    kvc_batch b;
    kvc__batch_init(&b, c);
    err = q_commit(&b, p, entries, n, full, parent_full, tokens, canonical, NULL);
    if (err == KV_ESTATE && b.nops == 1 && b.ops[0].kind == KVC__OP_RELEASE) {
        /* The guard refused and queued the leases' Release: send it, keep the guard's error. */
        char why[sizeof(c->diag.err)];
        snprintf(why, sizeof(why), "%s", c->diag.err);
        (void)run_one(&b);
        snprintf(c->diag.err, sizeof(c->diag.err), "%s", why);
        return KV_ESTATE;
    }
    if (err != KV_OK) {
        kvc__batch_fini(&b);
        return err;
    }
    return run_one(&b);
}

kv_err kvc_release(kvc_pool *p, const kvc_block *blocks, size_t n) {
    SYNC_CALL(p->conn, q_blocks(b, KVC__OP_RELEASE, p, blocks, n, 0, 0, 0, NULL));
}

kv_err kvc_release_deferred(kvc_pool *p, const kvc_block *blocks, size_t n) {
    if (p == NULL) {
        return kvc__fail(NULL, KV_EINVAL, "no pool");
    }
    kvc_conn *c = p->conn;
    if (n == 0) {
        return KV_OK;
    }
    if (c->broken || c->fd < 0) {
        kv_err err = kvc__rpc_ready(c); /* reconnects; the stale pool is refused below */
        if (err != KV_OK) {
            return err;
        }
    }
    if (c->later == NULL) {
        c->later = calloc(1, sizeof(*c->later));
        if (c->later == NULL) {
            return kvc__fail(&c->diag, KV_ENOMEM, "out of memory for deferred releases");
        }
        kvc__batch_init(c->later, c);
    }
    if (!later_pending(c)) {
        c->later_dial = c->dials;
    } else if (c->later->nops >= LATER_MAX_OPS && c->active == NULL) {
        kv_err err = later_flush(c);
        if (err != KV_OK) {
            return err;
        }
        c->later_dial = c->dials;
    }
    return q_blocks(c->later, KVC__OP_RELEASE, p, blocks, n, 0, 0, 0, NULL);
}

kv_err kvc_flush(kvc_conn *c) {
    if (c == NULL) {
        return kvc__fail(NULL, KV_EINVAL, "no connection");
    }
    if (c->active != NULL) {
        return kvc__fail(&c->diag, KV_ESTATE,
                         "a batch is in flight on this connection; wait for it");
    }
    kv_err err = later_flush(c);
    if (err != KV_OK) {
        return err;
    }
    err = c->later_err;
    c->later_err = KV_OK;
    if (err != KV_OK) {
        return kvc__fail(&c->diag, err, "a deferred release failed: %s", c->later_msg);
    }
    return KV_OK;
}

uint64_t kvc_conn_deferred_failures(const kvc_conn *c) {
    return c != NULL ? c->later_failed : 0;
}

size_t kvc_conn_deferred_pending(kvc_conn *c) {
    return c != NULL && later_pending(c) ? c->later->nops : 0;
}

kv_err kvc_rewind(kvc_pool *p, const kvc_block *blocks, size_t n) {
    SYNC_CALL(p->conn, q_blocks(b, KVC__OP_REWIND, p, blocks, n, 0, 0, 0, NULL));
}

kv_err kvc_pin(kvc_pool *p, const kvc_block *blocks, size_t n, uint64_t retention_ms,
               uint8_t priority, int unpin) {
    SYNC_CALL(p->conn, q_blocks(b, KVC__OP_PIN, p, blocks, n, retention_ms, priority, unpin, NULL));
}

/* Release, Rewind or Pin of blocks[i] in pools[i]: one request per run of consecutive blocks in
 * one pool (at most the daemon's list limit each), all in one batch (one round trip). Returns
 * the first failure, transport or request; requests after a failed one still ran. */
static kv_err blocks_multi(kvc__op_kind kind, kvc_pool *const *pools, const kvc_block *blocks,
                           size_t n, uint64_t retention_ms, uint8_t priority, int unpin) {
    if (n == 0) {
        return KV_OK;
    }
    if (pools == NULL || blocks == NULL || pools[0] == NULL) {
        return kvc__fail(NULL, KV_EINVAL, "NULL pools or blocks");
    }
    kvc_conn *c = pools[0]->conn;
    for (size_t i = 1; i < n; i++) {
        if (pools[i] == NULL || pools[i]->conn != c) {
            return kvc__fail(&c->diag, KV_EINVAL, "pools[%zu] is not a pool of the same connection",
                             i);
        }
    }
    kv_err err = kvc__rpc_ready(c);
    if (err != KV_OK) {
        return err;
    }
    kvc_batch b;
    kvc__batch_init(&b, c);
    for (size_t i = 0; i < n;) {
        size_t k = 1;
        while (i + k < n && pools[i + k] == pools[i] && k < c->max_blocks) {
            k++;
        }
        err = q_blocks(&b, kind, pools[i], blocks + i, k, retention_ms, priority, unpin, NULL);
        if (err != KV_OK) {
            goto cleanup;
        }
        i += k;
    }
    err = sync_exchange(&b);
    for (size_t i = 0; err == KV_OK && i < b.nops; i++) {
        err = b.ops[i].status;
    }
cleanup:
    kvc__batch_fini(&b);
    return err;
}

kv_err kvc_release_multi(kvc_pool *const *pools, const kvc_block *blocks, size_t n) {
    return blocks_multi(KVC__OP_RELEASE, pools, blocks, n, 0, 0, 0);
}

kv_err kvc_rewind_multi(kvc_pool *const *pools, const kvc_block *blocks, size_t n) {
    return blocks_multi(KVC__OP_REWIND, pools, blocks, n, 0, 0, 0);
}

kv_err kvc_pin_multi(kvc_pool *const *pools, const kvc_block *blocks, size_t n,
                     uint64_t retention_ms, uint8_t priority, int unpin) {
    return blocks_multi(KVC__OP_PIN, pools, blocks, n, retention_ms, priority, unpin);
}

static kv_err q_stats(kvc_batch *b, uint32_t pool_id, kvc_stat_fn fn, void *arg) {
    Kvd__Stats req = KVD__STATS__INIT;
    req.pool_id = pool_id;
    Kvd__Envelope env = KVD__ENVELOPE__INIT;
    env.body_case = KVD__ENVELOPE__BODY_STATS;
    env.stats = &req;
    kvc__op *op;
    kv_err err = kvc__batch_add(b, KVC__OP_STATS, &env, &op);
    if (err == KV_OK) {
        op->stat_fn = fn;
        op->stat_arg = arg;
    }
    return err;
}

kv_err kvc_stats(kvc_conn *c, uint32_t pool_id, kvc_stat_fn fn, void *arg) {
    SYNC_CALL(c, q_stats(b, pool_id, fn, arg));
}

typedef struct stat_find {
    const char *name; /* wanted */
    uint64_t value;   /* found value */
    int found;        /* seen */
} stat_find;

static void stat_find_fn(void *arg, const char *name, uint64_t value) {
    stat_find *f = arg;
    if (strcmp(f->name, name) == 0) {
        f->value = value;
        f->found = 1;
    }
}

kv_err kvc_stat_get(kvc_conn *c, uint32_t pool_id, const char *name, uint64_t *value) {
    stat_find f = {.name = name};
    kv_err err = kvc_stats(c, pool_id, stat_find_fn, &f);
    if (err != KV_OK) {
        return err;
    }
    if (!f.found) {
        return kvc__fail(&c->diag, KV_ENOENT, "kvd reports no statistic named %s", name);
    }
    *value = f.value;
    return KV_OK;
}

/* MapSegments for one pool from first_index; *nsegs gets how many came back. */
static kv_err map_once(kvc_pool *p, uint32_t first_index, size_t *nsegs) {
    kvc_conn *c = p->conn;
    Kvd__MapSegments req = KVD__MAP_SEGMENTS__INIT;
    req.pool_id = p->pool_id;
    req.first_index = first_index;
    Kvd__Envelope env = KVD__ENVELOPE__INIT;
    env.body_case = KVD__ENVELOPE__BODY_MAP_SEGMENTS;
    env.map_segments = &req;
    return exchange_one(c, KVC__OP_MAP, &env, p, nsegs);
}

kv_err kvc__rpc_map_new(kvc_pool *p) {
    if (!p->need_map) {
        return KV_OK;
    }
    return kvc__rpc_map_from(p, kvc__pool_first_hole(p));
}

kv_err kvc__rpc_map_from(kvc_pool *p, uint32_t from) {
    for (;;) {
        size_t n = 0;
        /* Clear first: the MapSegments reply itself never sets it. */
        p->need_map = 0;
        kv_err err = map_once(p, from, &n);
        if (err != KV_OK) {
            p->need_map = 1;
            return err;
        }
        if (n < KV_WIRE_MAX_FDS) {
            return KV_OK;
        }
        /* A full reply: more may follow after the highest slot it named. */
        from = p->nsegs;
    }
}

kv_err kvc__rpc_attach(kvc_pool *p, const char *model_id, const kv_layout *layout) {
    kvc_conn *c = p->conn;
    Kvd__Layout l = KVD__LAYOUT__INIT;
    l.num_layers = layout->num_layers;
    l.num_kv_heads = layout->num_kv_heads;
    l.head_dim = layout->head_dim;
    l.tokens_per_block = layout->tokens_per_block;
    l.dtype = (Kvd__DType)layout->dtype;
    l.arrangement = (Kvd__Arrangement)layout->arrangement;
    l.lossy_tiers = (p->attach_flags & KVC_ATTACH_LOSSY_TIERS) != 0;
    l.summaries = (p->attach_flags & KVC_ATTACH_SUMMARIES) != 0;
    Kvd__AttachPool req = KVD__ATTACH_POOL__INIT;
    req.model_id = (char *)model_id;
    req.layout = &l;
    Kvd__Envelope env = KVD__ENVELOPE__INIT;
    env.body_case = KVD__ENVELOPE__BODY_ATTACH_POOL;
    env.attach_pool = &req;
    return exchange_one(c, KVC__OP_ATTACH, &env, p, NULL);
}

kv_err kvc__rpc_detach(kvc_pool *p) {
    kvc_conn *c = p->conn;
    if (c == NULL || c->fd < 0 || c->broken || p->epoch != c->epoch ||
        p->session != c->session_id) {
        return KV_OK; /* the session that held the references is gone: nothing to release */
    }
    Kvd__DetachPool req = KVD__DETACH_POOL__INIT;
    req.pool_id = p->pool_id;
    Kvd__Envelope env = KVD__ENVELOPE__INIT;
    env.body_case = KVD__ENVELOPE__BODY_DETACH_POOL;
    env.detach_pool = &req;
    return exchange_one(c, KVC__OP_DETACH, &env, NULL, NULL);
}

/* ---- batch API ------------------------------------------------------------------------ */

/* A batch whose connection was closed is an empty shell: every call says so. */
#define BATCH_LIVE(b)                                                                              \
    do {                                                                                           \
        if ((b)->conn == NULL) {                                                                   \
            return kvc__fail(NULL, KV_ECLOSED, "the batch's connection was closed");               \
        }                                                                                          \
    } while (0)

kv_err kvc_batch_alloc(kvc_conn *c, kvc_batch **out) {
    kvc_batch *b = malloc(sizeof(*b));
    if (b == NULL) {
        return kvc__fail(&c->diag, KV_ENOMEM, "out of memory for a batch");
    }
    kvc__batch_init(b, c);
    *out = b;
    return KV_OK;
}

void kvc_batch_free(kvc_batch *b) {
    if (b == NULL) {
        return;
    }
    kvc__batch_fini(b);
    free(b);
}

void kvc_batch_reset(kvc_batch *b) {
    if (b->conn != NULL && b->conn->active == b) {
        kvc__conn_break(b->conn);
        b->conn->active = NULL;
    }
    b->nops = 0;
    b->olen = 0;
    b->osent = 0;
    b->nsent = 0;
    b->nwait = 0;
    b->in_flight = 0;
}

size_t kvc_batch_count(const kvc_batch *b) {
    return b->nops;
}

kv_err kvc_batch_ping(kvc_batch *b, const void *payload, size_t len, size_t *index) {
    BATCH_LIVE(b);
    return q_ping(b, payload, len, index);
}

kv_err kvc_batch_lookup(kvc_batch *b, kvc_pool *p, const kv_hash128 *hashes, size_t n,
                        kvc_block *out, size_t *nhit, size_t *index) {
    BATCH_LIVE(b);
    return q_lookup(b, p, hashes, n, out, NULL, nhit, index);
}

kv_err kvc_batch_fetch(kvc_batch *b, kvc_pool *p, const kv_hash128 *hashes, size_t n,
                       uint32_t min_tokens, kvc_block *out, kvc_fetch_result *res, size_t *index) {
    BATCH_LIVE(b);
    if (res == NULL) {
        return kvc__fail(&b->conn->diag, KV_EINVAL, "NULL result output");
    }
    return q_hashes(b, p, hashes, n, out, NULL, &res->nblocks, index, NULL, res, min_tokens, NULL);
}

kv_err kvc_batch_lookup_domains(kvc_batch *b, kvc_pool *p, const kv_hash128 *hashes, size_t n,
                                kvc_block *out, kvc_pool **pools, size_t *nhit, size_t *index) {
    BATCH_LIVE(b);
    if (pools == NULL) {
        return kvc__fail(&b->conn->diag, KV_EINVAL, "NULL pools output");
    }
    return q_lookup(b, p, hashes, n, out, pools, nhit, index);
}

kv_err kvc_batch_allocate(kvc_batch *b, kvc_pool *p, uint32_t count, kvc_block *out,
                          size_t *index) {
    BATCH_LIVE(b);
    return q_allocate(b, p, count, 0, out, index);
}

kv_err kvc_batch_commit(kvc_batch *b, kvc_pool *p, const kvc_commit_entry *entries, size_t n,
                        kvc_block *canonical, size_t *index) {
    BATCH_LIVE(b);
    return q_commit(b, p, entries, n, NULL, NULL, NULL, canonical, index);
}

kv_err kvc_batch_commit_ex(kvc_batch *b, kvc_pool *p, const kvc_commit_entry *entries, size_t n,
                           const uint8_t (*full)[32], const uint8_t *parent_full,
                           const uint32_t *tokens, kvc_block *canonical, size_t *index) {
    BATCH_LIVE(b);
    return q_commit(b, p, entries, n, full, parent_full, tokens, canonical, index);
}

kv_err kvc_batch_release(kvc_batch *b, kvc_pool *p, const kvc_block *blocks, size_t n,
                         size_t *index) {
    BATCH_LIVE(b);
    return q_blocks(b, KVC__OP_RELEASE, p, blocks, n, 0, 0, 0, index);
}

/* Rolls b back to nops0 requests and olen0 bytes (the ids taken stay unused: ids of a batch
 * may have gaps) after a failure in the middle of a _many call. */
static void batch_truncate(kvc_batch *b, size_t nops0, size_t olen0) {
    b->nops = nops0;
    b->olen = olen0;
}

kv_err kvc_batch_lookup_many(kvc_batch *b, kvc_pool *p, const kv_hash128 *const *hashes,
                             const size_t *n, kvc_block *const *out, size_t *nhit, size_t count,
                             size_t *first) {
    BATCH_LIVE(b);
    if (count > 0 && (hashes == NULL || n == NULL || out == NULL || nhit == NULL)) {
        return kvc__fail(&b->conn->diag, KV_EINVAL, "NULL array");
    }
    size_t nops0 = b->nops, olen0 = b->olen;
    for (size_t i = 0; i < count; i++) {
        kv_err err = q_lookup(b, p, hashes[i], n[i], out[i], NULL, &nhit[i], NULL);
        if (err != KV_OK) {
            batch_truncate(b, nops0, olen0);
            return err;
        }
    }
    if (first != NULL) {
        *first = nops0;
    }
    return KV_OK;
}

kv_err kvc_batch_release_many(kvc_batch *b, kvc_pool *p, const kvc_block *const *blocks,
                              const size_t *n, size_t count, size_t *first) {
    BATCH_LIVE(b);
    if (count > 0 && (blocks == NULL || n == NULL)) {
        return kvc__fail(&b->conn->diag, KV_EINVAL, "NULL array");
    }
    size_t nops0 = b->nops, olen0 = b->olen;
    for (size_t i = 0; i < count; i++) {
        kv_err err = q_blocks(b, KVC__OP_RELEASE, p, blocks[i], n[i], 0, 0, 0, NULL);
        if (err != KV_OK) {
            batch_truncate(b, nops0, olen0);
            return err;
        }
    }
    if (first != NULL) {
        *first = nops0;
    }
    return KV_OK;
}

kv_err kvc_batch_rewind(kvc_batch *b, kvc_pool *p, const kvc_block *blocks, size_t n,
                        size_t *index) {
    BATCH_LIVE(b);
    return q_blocks(b, KVC__OP_REWIND, p, blocks, n, 0, 0, 0, index);
}

kv_err kvc_batch_send(kvc_batch *b) {
    BATCH_LIVE(b);
    kvc_conn *c = b->conn;
    if (!b->in_flight) {
        kv_err err = kvc__rpc_ready(c);
        if (err != KV_OK) {
            return err;
        }
        /* Frames were encoded with the epoch of queuing time; a reconnect in between means
         * they are about handles of another daemon instance and it would refuse them. */
        for (size_t i = b->nsent; i < b->nops; i++) {
            if (b->ops[i].pool != NULL && kvc__pool_stale(b->ops[i].pool)) {
                return check_pool(c, b->ops[i].pool);
            }
        }
        /* Deferred Releases go before the batch, in a round trip of their own (the batch's
         * indexes stay the caller's). */
        if (b != c->later && c->active == NULL) {
            err = later_flush(c);
            if (err != KV_OK) {
                return err;
            }
        }
    }
    return kvc__exchange(b, 0);
}

kv_err kvc_batch_wait(kvc_batch *b) {
    BATCH_LIVE(b);
    kvc_conn *c = b->conn;
    if (!b->in_flight && b->nsent < b->nops) {
        kv_err err = kvc_batch_send(b);
        if (err != KV_OK) {
            return err;
        }
    }
    kv_err err = KV_OK;
    if (b->in_flight) {
        err = kvc__exchange(b, 1);
    }
    if (err == KV_OK) {
        err = map_pending(c);
    }
    if (err == KV_OK) {
        for (size_t i = 0; i < b->nops; i++) {
            if (b->ops[i].done) {
                (void)check_addressable(c, &b->ops[i]); /* per-op status, kvc_batch_status */
            }
        }
    }
    return err;
}

kv_err kvc_batch_run(kvc_batch *b) {
    BATCH_LIVE(b);
    kv_err err = kvc_batch_send(b);
    if (err != KV_OK) {
        return err;
    }
    return kvc_batch_wait(b);
}

kv_err kvc_batch_first_error(const kvc_batch *b, size_t *index) {
    for (size_t i = 0; i < b->nops; i++) {
        kv_err st = b->ops[i].done ? b->ops[i].status : KV_ESTATE;
        if (st != KV_OK) {
            if (index != NULL) {
                *index = i;
            }
            return st;
        }
    }
    return KV_OK;
}

kv_err kvc_batch_status(const kvc_batch *b, size_t index) {
    if (index >= b->nops) {
        return KV_EINVAL;
    }
    if (!b->ops[index].done) {
        return KV_ESTATE;
    }
    return b->ops[index].status;
}
