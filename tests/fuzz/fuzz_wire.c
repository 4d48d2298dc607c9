/* fuzz_wire: the frame decoder (common/kv_wire) on any byte stream. The input is what a client
 * could write to the socket: frames are decoded one after another, as the server's input buffer
 * does, with a small max_frame so the ETOOBIG path is reached. Properties: decode never reads
 * past len, consumes at most len, reports "need more" only for a true prefix, and an envelope it
 * returns encodes to a frame that decodes to the same bytes again (encode is a fixed point after
 * one round) unless the input carried unknown fields: protobuf-c keeps those and writes them back
 * as they were parsed, and it accepts a non-minimal tag varint naming field 0 ("\x82\x00") that
 * it then writes as "\x02" and refuses to read (crashes/wire/unknown-field-zero-tag). kvd never
 * re-encodes a client's message, so that quirk cannot reach a peer. */
#include <string.h>

#include "common/kv_wire.h"
#include "tests/fuzz/fuzz.h"

#define FUZZ_MAX_FRAME 4096u

/* Whether m or any message inside it holds fields protobuf-c did not know. */
static int has_unknown(const ProtobufCMessage *m) {
    if (m == NULL) {
        return 0;
    }
    if (m->n_unknown_fields != 0) {
        return 1;
    }
    const ProtobufCMessageDescriptor *d = m->descriptor;
    for (unsigned i = 0; i < d->n_fields; i++) {
        const ProtobufCFieldDescriptor *f = &d->fields[i];
        if (f->type != PROTOBUF_C_TYPE_MESSAGE) {
            continue;
        }
        const char *base = (const char *)m + f->offset;
        if (f->label == PROTOBUF_C_LABEL_REPEATED) {
            size_t n = *(const size_t *)((const char *)m + f->quantifier_offset);
            ProtobufCMessage *const *v = *(ProtobufCMessage *const *const *)base;
            for (size_t k = 0; k < n; k++) {
                if (has_unknown(v[k])) {
                    return 1;
                }
            }
            continue;
        }
        if ((f->flags & PROTOBUF_C_FIELD_FLAG_ONEOF) &&
            *(const uint32_t *)((const char *)m + f->quantifier_offset) != f->id) {
            continue; /* another member of the oneof is set */
        }
        if (has_unknown(*(ProtobufCMessage *const *)base)) {
            return 1;
        }
    }
    return 0;
}

static void check_roundtrip(const Kvd__Envelope *env) {
    if (has_unknown(&env->base)) {
        return;
    }
    uint8_t *a = NULL;
    size_t alen = 0;
    kv_err rc = kv_wire_encode(env, FUZZ_MAX_FRAME * 2, &a, &alen);
    if (rc == KV_ETOOBIG) {
        return; /* unknown fields kept by protobuf-c can make it longer than the input */
    }
    FUZZ_CHECK(rc == KV_OK);
    FUZZ_CHECK(alen == kv_wire_frame_size(env));
    Kvd__Envelope *again = NULL;
    size_t used = 0;
    rc = kv_wire_decode(a, alen, FUZZ_MAX_FRAME * 2, &again, &used);
    FUZZ_CHECK(rc == KV_OK && again != NULL && used == alen);
    FUZZ_CHECK(again->body_case == env->body_case && again->id == env->id);
    uint8_t *b = NULL;
    size_t blen = 0;
    FUZZ_CHECK(kv_wire_encode(again, FUZZ_MAX_FRAME * 2, &b, &blen) == KV_OK);
    FUZZ_CHECK(blen == alen && memcmp(a, b, alen) == 0);
    /* A truncated frame is "need more", never an error or a message. */
    Kvd__Envelope *none = NULL;
    rc = kv_wire_decode(a, alen - 1, FUZZ_MAX_FRAME * 2, &none, &used);
    FUZZ_CHECK(rc == KV_OK && none == NULL && used == 0);
    kv_wire_free(again);
    free(a);
    free(b);
}

/* The daemon's request decoder on the same bytes: it agrees with kv_wire_decode on what is a
 * frame, skips exactly the frames it refuses, and what it accepts has only UTF-8 strings without
 * NUL bytes. */
static void check_request_decoder(const uint8_t *buf, size_t size) {
    size_t off = 0;
    for (;;) {
        Kvd__Envelope *env = (Kvd__Envelope *)1;
        size_t used = 7;
        uint64_t id = 1;
        char why[256];
        kv_err rc = kv_wire_decode_request(buf + off, size - off, FUZZ_MAX_FRAME, 0, NULL, &env,
                                           &used, &id, why, sizeof(why));
        if (rc == KV_ETOOBIG) {
            FUZZ_CHECK(env == NULL);
            break;
        }
        if (rc != KV_OK) {
            FUZZ_CHECK(rc == KV_EPROTO || rc == KV_ENOTSUP || rc == KV_EINVAL);
            FUZZ_CHECK(env == NULL && used >= KV_WIRE_HEADER_BYTES && used <= size - off);
            FUZZ_CHECK(why[0] != '\0');
            off += used;
            continue;
        }
        if (env == NULL) {
            FUZZ_CHECK(used == 0);
            break;
        }
        FUZZ_CHECK(used >= KV_WIRE_HEADER_BYTES && used <= size - off);
        if (env->body_case == KVD__ENVELOPE__BODY_HELLO && env->hello->client_name != NULL) {
            size_t n = strlen(env->hello->client_name);
            FUZZ_CHECK(kv_utf8_prefix(env->hello->client_name, n) == n);
        }
        if (env->body_case == KVD__ENVELOPE__BODY_ATTACH_POOL &&
            env->attach_pool->model_id != NULL) {
            size_t n = strlen(env->attach_pool->model_id);
            FUZZ_CHECK(kv_utf8_prefix(env->attach_pool->model_id, n) == n);
        }
        kv_wire_free(env);
        off += used;
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    /* Copy to an exact-size heap buffer so ASan sees any read past the end. */
    uint8_t *buf = malloc(size > 0 ? size : 1);
    if (buf == NULL) {
        return 0;
    }
    memcpy(buf, data, size);
    size_t off = 0;
    for (;;) {
        Kvd__Envelope *env = (Kvd__Envelope *)1; /* must be overwritten */
        size_t used = 7;
        kv_err rc = kv_wire_decode(buf + off, size - off, FUZZ_MAX_FRAME, &env, &used);
        if (rc != KV_OK) {
            FUZZ_CHECK(rc == KV_ETOOBIG || rc == KV_EPROTO);
            FUZZ_CHECK(env == NULL && used == 0);
            if (rc == KV_EPROTO && size - off >= KV_WIRE_HEADER_BYTES) {
                /* The length was valid, so the stream stays in sync: skip the bad body as
                 * the server does and go on. */
                uint32_t l = (uint32_t)buf[off] | (uint32_t)buf[off + 1] << 8 |
                             (uint32_t)buf[off + 2] << 16 | (uint32_t)buf[off + 3] << 24;
                FUZZ_CHECK(l <= FUZZ_MAX_FRAME && l <= size - off - KV_WIRE_HEADER_BYTES);
                off += KV_WIRE_HEADER_BYTES + l;
                continue;
            }
            break;
        }
        if (env == NULL) {
            FUZZ_CHECK(used == 0);
            break; /* needs more bytes */
        }
        FUZZ_CHECK(used >= KV_WIRE_HEADER_BYTES && used <= size - off);
        FUZZ_CHECK(env->body_case != KVD__ENVELOPE__BODY__NOT_SET);
        check_roundtrip(env);
        kv_wire_free(env);
        off += used;
    }
    check_request_decoder(buf, size);
    free(buf);
    return 0;
}
