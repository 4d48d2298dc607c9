/* kvd_validate: range checks only; every error names the field and the limit. */
#include "daemon/proto/validate.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

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
