/* fuzz_validate: every request's field checks (daemon/validate) on any decodable Envelope.
 * Input: one parameter byte (bit 7 set: the default list limit 4096, else a limit of 1..64 so
 * ETOOBIG is reached), then one protobuf-encoded kvd.Envelope body. The request in the body is
 * handed to its validator. Properties: only the documented codes come back; every refusal has a
 * non-empty message; a refused AttachPool leaves the output layout untouched; an accepted one
 * yields a layout whose every element lies inside its block; accepted lists are within the
 * limit and hold no NULL entries; Allocate accepts exactly 1..limit; a Commit in its packed form
 * expands to exactly its records. */
#include <string.h>

#include "common/kv_arena.h"
#include "common/kv_layout.h"
#include "common/kv_wire.h"
#include "daemon/proto/validate.h"
#include "tests/fuzz/fuzz.h"

#define FUZZ_MAX_FRAME 4096u

static void check_msg(kv_err rc, const char *msg) {
    if (rc != KV_OK) {
        FUZZ_CHECK(memchr(msg, '\0', 256) != NULL);
        FUZZ_CHECK(msg[0] != '\0');
    }
}

static void check_layout(const kv_layout *l) {
    FUZZ_CHECK(l->block_bytes == l->data_bytes + l->scale_bytes);
    FUZZ_CHECK(l->kv_block_bytes == (uint64_t)l->tokens_per_block * l->token_bytes);
    FUZZ_CHECK(kv_layout_segment_bytes(l, 1) == l->block_bytes);
    /* The last element of the last layer's V lies inside a one-block segment. */
    uint64_t off = kv_layout_offset(l, 1, 0, l->num_layers - 1, KV_V, l->tokens_per_block - 1,
                                    l->num_kv_heads - 1);
    FUZZ_CHECK(off + (uint64_t)l->head_dim * l->elem_bytes <= l->block_bytes);
    if (l->scale_bytes != 0) {
        uint64_t s = kv_layout_scale_offset(l, 1, 0, l->num_layers - 1, KV_V, l->num_kv_heads - 1);
        FUZZ_CHECK(s % 4 == 0 && s + 4 <= l->block_bytes);
    }
}

static void check_refs(kv_err rc, size_t n, Kvd__BlockRef *const *refs, uint64_t max) {
    FUZZ_CHECK(rc == KV_OK || rc == KV_ETOOBIG || rc == KV_EINVAL);
    if (rc == KV_OK) {
        FUZZ_CHECK(n <= max);
        for (size_t i = 0; i < n; i++) {
            FUZZ_CHECK(refs[i] != NULL);
        }
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) {
        return 0;
    }
    uint64_t max = (data[0] & 0x80) ? 4096 : (uint64_t)(data[0] & 0x3f) + 1;
    Kvd__Envelope *e = kvd__envelope__unpack(NULL, size - 1, data + 1);
    if (e == NULL) {
        return 0;
    }
    char msg[256];
    memset(msg, 0x55, sizeof(msg));
    msg[sizeof(msg) - 1] = '\0';
    kv_err rc = KV_OK;
    switch (e->body_case) {
        case KVD__ENVELOPE__BODY_HELLO:
            rc = kvd_validate_hello(e->hello, msg, sizeof(msg));
            FUZZ_CHECK(rc == KV_OK || rc == KV_EVERSION || rc == KV_EINVAL || rc == KV_ENOTSUP);
            if (rc == KV_OK) {
                FUZZ_CHECK(e->hello->protocol_version == 1);
                FUZZ_CHECK(strlen(e->hello->client_name) <= KV_WIRE_MAX_CLIENT_NAME);
            }
            break;
        case KVD__ENVELOPE__BODY_ATTACH_POOL: {
            kv_layout out, before;
            memset(&out, 0xa5, sizeof(out));
            before = out;
            rc = kvd_validate_attach(e->attach_pool, &out, msg, sizeof(msg));
            FUZZ_CHECK(rc == KV_OK || rc == KV_EINVAL);
            if (rc == KV_OK) {
                size_t n = strlen(e->attach_pool->model_id);
                FUZZ_CHECK(n >= 1 && n <= KV_WIRE_MAX_MODEL_ID);
                check_layout(&out);
            } else {
                FUZZ_CHECK(memcmp(&out, &before, sizeof(out)) == 0);
            }
            break;
        }
        case KVD__ENVELOPE__BODY_ALLOCATE:
            rc = kvd_validate_allocate(e->allocate, max, msg, sizeof(msg));
            FUZZ_CHECK((rc == KV_OK) == (e->allocate->count >= 1 && e->allocate->count <= max));
            FUZZ_CHECK(rc == KV_OK || rc == KV_EINVAL || rc == KV_ETOOBIG);
            break;
        case KVD__ENVELOPE__BODY_COMMIT: {
            /* Either form, the packed one expanded: the entries it yields are exactly the
             * records, with a digest and tpb token ids each or none. */
            uint32_t tpb = (uint32_t)(e->id % 64) + 1;
            const Kvd__Commit *any = NULL;
            kv_arena a;
            kv_arena_init(&a);
            rc = kvd_validate_commit_any(e->commit, max, tpb, kv_arena_allocator(&a), &any, msg,
                                         sizeof(msg));
            FUZZ_CHECK(rc == KV_OK || rc == KV_EINVAL || rc == KV_ETOOBIG || rc == KV_EPROTO ||
                       rc == KV_ENOMEM);
            check_msg(rc, msg);
            FUZZ_CHECK(any != NULL);
            if (rc != KV_OK) {
                FUZZ_CHECK(any == e->commit);
            } else if (any != e->commit) {
                const Kvd__Commit *c = e->commit;
                FUZZ_CHECK(c->n_entries == 0 && c->entries_packed.len % KV_WIRE_COMMIT_BYTES == 0);
                FUZZ_CHECK(any->n_entries == c->entries_packed.len / KV_WIRE_COMMIT_BYTES);
                FUZZ_CHECK(any->n_entries <= max);
                for (size_t i = 0; i < any->n_entries; i++) {
                    const Kvd__CommitEntry *x = any->entries[i];
                    kv_wire_commit w = kv_wire_commit_get(c->entries_packed.data, i);
                    FUZZ_CHECK(x->block->id == w.id && x->block->gen == w.gen);
                    FUZZ_CHECK(x->hash->lo == w.lo && x->hash->hi == w.hi);
                    FUZZ_CHECK(x->parent == w.parent);
                    FUZZ_CHECK(x->hash_full.len == (c->hash_full_packed.len ? 32u : 0u));
                    FUZZ_CHECK(x->n_token_ids == (c->token_ids_packed.len ? tpb : 0u));
                    for (size_t t = 0; t < x->n_token_ids; t++) {
                        FUZZ_CHECK(x->token_ids[t] ==
                                   kv_wire_le32(c->token_ids_packed.data + 4 * (i * tpb + t)));
                    }
                }
            } else {
                FUZZ_CHECK(e->commit->entries_packed.len == 0);
            }
            kv_arena_fini(&a);
            rc = kvd_validate_commit(e->commit, max, msg, sizeof(msg));
            FUZZ_CHECK(rc == KV_OK || rc == KV_EINVAL || rc == KV_ETOOBIG);
            if (rc == KV_OK) {
                FUZZ_CHECK(e->commit->n_entries <= max);
                for (size_t i = 0; i < e->commit->n_entries; i++) {
                    FUZZ_CHECK(e->commit->entries[i] != NULL);
                    FUZZ_CHECK(e->commit->entries[i]->block != NULL);
                    FUZZ_CHECK(e->commit->entries[i]->hash != NULL);
                }
            }
            break;
        }
        case KVD__ENVELOPE__BODY_LOOKUP:
            rc = kvd_validate_lookup(e->lookup, max, msg, sizeof(msg));
            FUZZ_CHECK(rc == KV_OK || rc == KV_EINVAL || rc == KV_ETOOBIG);
            if (rc == KV_OK) {
                FUZZ_CHECK(e->lookup->n_hashes <= max);
                for (size_t i = 0; i < e->lookup->n_hashes; i++) {
                    FUZZ_CHECK(e->lookup->hashes[i] != NULL);
                }
            }
            break;
        case KVD__ENVELOPE__BODY_RELEASE:
            rc = kvd_validate_refs(e->release->n_blocks, e->release->blocks, max, msg, sizeof(msg));
            check_refs(rc, e->release->n_blocks, e->release->blocks, max);
            break;
        case KVD__ENVELOPE__BODY_REWIND:
            rc = kvd_validate_refs(e->rewind->n_blocks, e->rewind->blocks, max, msg, sizeof(msg));
            check_refs(rc, e->rewind->n_blocks, e->rewind->blocks, max);
            break;
        case KVD__ENVELOPE__BODY_PIN:
            rc = kvd_validate_pin(e->pin, max, msg, sizeof(msg));
            check_refs(rc, e->pin->n_blocks, e->pin->blocks, max);
            if (rc == KV_OK && !e->pin->unpin) {
                FUZZ_CHECK(e->pin->retention_ms <= KV_WIRE_MAX_RETENTION_MS);
                FUZZ_CHECK(e->pin->priority <= 255);
            }
            break;
        case KVD__ENVELOPE__BODY_PING:
            rc = kvd_validate_ping(e->ping, FUZZ_MAX_FRAME, msg, sizeof(msg));
            FUZZ_CHECK(rc == KV_OK || rc == KV_ETOOBIG);
            FUZZ_CHECK((rc == KV_OK) ==
                       (e->ping->payload.len <= FUZZ_MAX_FRAME - KV_WIRE_PING_SLACK));
            break;
        default: {
            /* Requests without fields to check, and reply bodies sent as requests: the generic
             * list check still has to hold for any length. */
            size_t n = (size_t)e->id;
            rc = kvd_validate_list(n, max, "list", msg, sizeof(msg));
            FUZZ_CHECK((rc == KV_OK) == (n <= max));
            break;
        }
    }
    check_msg(rc, msg);
    kvd__envelope__free_unpacked(e, NULL);
    return 0;
}
