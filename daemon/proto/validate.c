/* kvd_validate: range checks only; every error names the field and the limit. */
#include "daemon/proto/validate.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "common/kv_wire.h"

static kv_err fail(kv_err rc, char *msg, size_t msglen, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

static kv_err fail(kv_err rc, char *msg, size_t msglen, const char *fmt, ...) {
    if (msg != NULL && msglen > 0) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(msg, msglen, fmt, ap);
        va_end(ap);
    }
    return rc;
}

kv_err kvd_validate_hello(const Kvd__Hello *h, char *msg, size_t msglen) {
    if (h->protocol_version != 1) {
        return fail(KV_EVERSION, msg, msglen,
                    "protocol_version %u is not supported; this daemon speaks 1",
                    h->protocol_version);
    }
    if (h->client_name != NULL && strlen(h->client_name) > KV_WIRE_MAX_CLIENT_NAME) {
        return fail(KV_EINVAL, msg, msglen, "client_name is %zu bytes; at most %d",
                    strlen(h->client_name), KV_WIRE_MAX_CLIENT_NAME);
    }
    if (h->token.len > KV_WIRE_MAX_TOKEN) {
        return fail(KV_EINVAL, msg, msglen, "token is %zu bytes; at most %d", h->token.len,
                    KV_WIRE_MAX_TOKEN);
    }
    return KV_OK;
}

kv_err kvd_validate_attach(const Kvd__AttachPool *a, kv_layout *out, char *msg, size_t msglen) {
    size_t n = a->model_id != NULL ? strlen(a->model_id) : 0;
    if (n == 0 || n > KV_WIRE_MAX_MODEL_ID) {
        return fail(KV_EINVAL, msg, msglen, "model_id is %zu bytes; it must be 1..%d", n,
                    KV_WIRE_MAX_MODEL_ID);
    }
    const Kvd__Layout *l = a->layout;
    if (l == NULL) {
        return fail(KV_EINVAL, msg, msglen, "layout is missing");
    }
    const char *why =
        kv_layout_check_msg(l->num_layers, l->num_kv_heads, l->head_dim, l->tokens_per_block,
                            (kv_dtype)l->dtype, (kv_arrangement)l->arrangement);
    if (why != NULL) {
        return fail(KV_EINVAL, msg, msglen, "layout: %s", why);
    }
    kv_layout lay;
    if (kv_layout_init(l->num_layers, l->num_kv_heads, l->head_dim, l->tokens_per_block,
                       (kv_dtype)l->dtype, (kv_arrangement)l->arrangement, &lay) != KV_OK) {
        return fail(KV_EINVAL, msg, msglen, "layout is invalid");
    }
    *out = lay;
    return KV_OK;
}

kv_err kvd_validate_list(size_t n, uint64_t max, const char *what, char *msg, size_t msglen) {
    if (n > max) {
        return fail(KV_ETOOBIG, msg, msglen,
                    "%s has %zu entries; at most %llu per request (max-blocks-per-request)", what,
                    n, (unsigned long long)max);
    }
    return KV_OK;
}

kv_err kvd_validate_allocate(const Kvd__Allocate *a, uint64_t max, char *msg, size_t msglen) {
    if (a->count == 0) {
        return fail(KV_EINVAL, msg, msglen, "count is 0; ask for at least one block");
    }
    return kvd_validate_list(a->count, max, "count", msg, msglen);
}

kv_err kvd_validate_commit(const Kvd__Commit *c, uint64_t max, char *msg, size_t msglen) {
    kv_err rc = kvd_validate_list(c->n_entries, max, "entries", msg, msglen);
    if (rc != KV_OK) {
        return rc;
    }
    for (size_t i = 0; i < c->n_entries; i++) {
        if (c->entries[i] == NULL || c->entries[i]->block == NULL || c->entries[i]->hash == NULL) {
            return fail(KV_EINVAL, msg, msglen, "entries[%zu] lacks its block or hash", i);
        }
    }
    return KV_OK;
}

kv_err kvd_validate_hashes(size_t n, Kvd__Hash128 *const *hashes, uint64_t max, char *msg,
                           size_t msglen) {
    kv_err rc = kvd_validate_list(n, max, "hashes", msg, msglen);
    if (rc != KV_OK) {
        return rc;
    }
    for (size_t i = 0; i < n; i++) {
        if (hashes[i] == NULL) {
            return fail(KV_EINVAL, msg, msglen, "hashes[%zu] is empty", i);
        }
    }
    return KV_OK;
}

kv_err kvd_validate_lookup(const Kvd__Lookup *l, uint64_t max, char *msg, size_t msglen) {
    return kvd_validate_hashes(l->n_hashes, l->hashes, max, msg, msglen);
}

kv_err kvd_validate_refs(size_t n, Kvd__BlockRef *const *refs, uint64_t max, char *msg,
                         size_t msglen) {
    kv_err rc = kvd_validate_list(n, max, "blocks", msg, msglen);
    if (rc != KV_OK) {
        return rc;
    }
    for (size_t i = 0; i < n; i++) {
        if (refs[i] == NULL) {
            return fail(KV_EINVAL, msg, msglen, "blocks[%zu] is empty", i);
        }
    }
    return KV_OK;
}

kv_err kvd_validate_pin(const Kvd__Pin *p, uint64_t max, char *msg, size_t msglen) {
    kv_err rc = kvd_validate_refs(p->n_blocks, p->blocks, max, msg, msglen);
    if (rc != KV_OK) {
        return rc;
    }
    if (!p->unpin && p->retention_ms > KV_WIRE_MAX_RETENTION_MS) {
        return fail(KV_EINVAL, msg, msglen, "retention_ms %llu is longer than 7 days (%llu ms)",
                    (unsigned long long)p->retention_ms, KV_WIRE_MAX_RETENTION_MS);
    }
    if (!p->unpin && p->priority > 255) {
        return fail(KV_EINVAL, msg, msglen, "priority %u is above 255", p->priority);
    }
    return KV_OK;
}

kv_err kvd_validate_ping(const Kvd__Ping *p, uint64_t max_frame, char *msg, size_t msglen) {
    if (p->payload.len + KV_WIRE_PING_SLACK > max_frame) {
        return fail(KV_ETOOBIG, msg, msglen, "ping payload of %zu bytes exceeds %llu",
                    p->payload.len, (unsigned long long)(max_frame - KV_WIRE_PING_SLACK));
    }
    return KV_OK;
}

/* ---- Commit in either form ------------------------------------------------------------- */

static void *alloc_of(ProtobufCAllocator *a, size_t n) {
    return a->alloc(a->allocator_data, n > 0 ? n : 1);
}

kv_err kvd_validate_commit_any(const Kvd__Commit *c, uint64_t max, uint32_t tpb,
                               ProtobufCAllocator *alloc, const Kvd__Commit **out, char *msg,
                               size_t msglen) {
    *out = c;
    kv_err rc = kvd_validate_commit(c, max, msg, msglen);
    if (rc != KV_OK) {
        return rc;
    }
    if (c->entries_packed.len == 0) {
        if (c->hash_full_packed.len != 0 || c->token_ids_packed.len != 0 ||
            c->parent_hash_full.len != 0) {
            return fail(KV_EPROTO, msg, msglen,
                        "hash_full_packed, token_ids_packed and parent_hash_full go with "
                        "entries_packed only (the repeated form has them in each entry)");
        }
        return KV_OK;
    }
    size_t n = c->entries_packed.len / KV_WIRE_COMMIT_BYTES;
    rc = kvd_validate_list(n, max, "entries_packed", msg, msglen);
    if (rc != KV_OK) {
        return rc;
    }
    if (c->n_entries != 0 || c->entries_packed.len % KV_WIRE_COMMIT_BYTES != 0) {
        return fail(KV_EPROTO, msg, msglen,
                    "entries_packed of %zu bytes: not a multiple of %d, or sent together with "
                    "entries",
                    c->entries_packed.len, KV_WIRE_COMMIT_BYTES);
    }
    if (c->hash_full_packed.len != 0 && c->hash_full_packed.len != n * KV_WIRE_DIGEST_BYTES) {
        return fail(KV_EPROTO, msg, msglen,
                    "hash_full_packed of %zu bytes for %zu entries: %d bytes an entry, or none",
                    c->hash_full_packed.len, n, KV_WIRE_DIGEST_BYTES);
    }
    if (c->token_ids_packed.len != 0 && c->token_ids_packed.len != n * (size_t)tpb * 4) {
        return fail(KV_EPROTO, msg, msglen,
                    "token_ids_packed of %zu bytes for %zu entries: %u token ids of 4 bytes an "
                    "entry, or none",
                    c->token_ids_packed.len, n, tpb);
    }
    Kvd__Commit *x = alloc_of(alloc, sizeof(*x));
    Kvd__CommitEntry *e = alloc_of(alloc, n * sizeof(*e));
    Kvd__CommitEntry **ep = alloc_of(alloc, n * sizeof(*ep));
    Kvd__BlockRef *b = alloc_of(alloc, n * sizeof(*b));
    Kvd__Hash128 *h = alloc_of(alloc, n * sizeof(*h));
    int tokens = c->token_ids_packed.len != 0;
    uint32_t *tok = tokens ? alloc_of(alloc, n * tpb * sizeof(*tok)) : NULL;
    if (x == NULL || e == NULL || ep == NULL || b == NULL || h == NULL || (tokens && tok == NULL)) {
        return fail(KV_ENOMEM, msg, msglen, "no memory for %zu entries", n);
    }
    for (size_t i = 0; tokens && i < n * tpb; i++) {
        tok[i] = kv_wire_le32(c->token_ids_packed.data + 4 * i);
    }
    for (size_t i = 0; i < n; i++) {
        kv_wire_commit w = kv_wire_commit_get(c->entries_packed.data, i);
        kvd__commit_entry__init(&e[i]);
        kvd__block_ref__init(&b[i]);
        kvd__hash128__init(&h[i]);
        b[i].id = w.id;
        b[i].gen = w.gen;
        h[i].lo = w.lo;
        h[i].hi = w.hi;
        e[i].block = &b[i];
        e[i].hash = &h[i];
        e[i].parent = w.parent;
        if (c->hash_full_packed.len != 0) {
            e[i].hash_full.data = c->hash_full_packed.data + i * KV_WIRE_DIGEST_BYTES;
            e[i].hash_full.len = KV_WIRE_DIGEST_BYTES;
        }
        if (tokens) {
            e[i].n_token_ids = tpb;
            e[i].token_ids = tok + i * tpb;
        }
        ep[i] = &e[i];
    }
    if (n > 0) {
        e[0].parent_hash_full = c->parent_hash_full;
    }
    *x = *c;
    x->n_entries = n;
    x->entries = ep;
    x->entries_packed.len = 0; /* one form: the repeated one */
    x->entries_packed.data = NULL;
    x->hash_full_packed.len = 0;
    x->hash_full_packed.data = NULL;
    x->token_ids_packed.len = 0;
    x->token_ids_packed.data = NULL;
    x->parent_hash_full.len = 0;
    x->parent_hash_full.data = NULL;
    *out = x;
    return KV_OK;
}
