/* kv_wire: length-prefixed protobuf-c envelopes. Decoding never trusts the length beyond
 * max_frame and never allocates before the whole frame is present. */
#include "common/kv_wire.h"

#include <stdlib.h>

static void put_le32(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
    p[2] = (uint8_t)(v >> 16);
    p[3] = (uint8_t)(v >> 24);
}

static uint32_t get_le32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

size_t kv_wire_frame_size(const Kvd__Envelope *env) {
    return KV_WIRE_HEADER_BYTES + kvd__envelope__get_packed_size(env);
}

size_t kv_wire_encode_into(const Kvd__Envelope *env, uint8_t *buf) {
    size_t body = kvd__envelope__pack(env, buf + KV_WIRE_HEADER_BYTES);
    put_le32(buf, (uint32_t)body);
    return KV_WIRE_HEADER_BYTES + body;
}

kv_err kv_wire_encode(const Kvd__Envelope *env, uint32_t max_frame, uint8_t **buf, size_t *len) {
    size_t body = kvd__envelope__get_packed_size(env);
    if (body > max_frame) {
        return KV_ETOOBIG;
    }
    uint8_t *b = malloc(KV_WIRE_HEADER_BYTES + body);
    if (b == NULL) {
        return KV_ENOMEM;
    }
    *len = kv_wire_encode_into(env, b);
    *buf = b;
    return KV_OK;
}

kv_err kv_wire_decode(const uint8_t *buf, size_t len, uint32_t max_frame, Kvd__Envelope **env,
                      size_t *consumed) {
    return kv_wire_decode_with(buf, len, max_frame, NULL, env, consumed);
}

kv_err kv_wire_decode_with(const uint8_t *buf, size_t len, uint32_t max_frame,
                           ProtobufCAllocator *alloc, Kvd__Envelope **env, size_t *consumed) {
    *env = NULL;
    *consumed = 0;
    if (len < KV_WIRE_HEADER_BYTES) {
        return KV_OK;
    }
    uint32_t body = get_le32(buf);
    if (body > max_frame) {
        return KV_ETOOBIG;
    }
    if (len - KV_WIRE_HEADER_BYTES < body) {
        return KV_OK;
    }
    Kvd__Envelope *e = kvd__envelope__unpack(alloc, body, buf + KV_WIRE_HEADER_BYTES);
    if (e == NULL) {
        return KV_EPROTO;
    }
    if (e->body_case == KVD__ENVELOPE__BODY__NOT_SET) {
        kvd__envelope__free_unpacked(e, alloc);
        return KV_EPROTO;
    }
    *env = e;
    *consumed = KV_WIRE_HEADER_BYTES + body;
    return KV_OK;
}

void kv_wire_free(Kvd__Envelope *env) {
    if (env != NULL) {
        kvd__envelope__free_unpacked(env, NULL);
    }
}

void kv_wire_free_with(Kvd__Envelope *env, ProtobufCAllocator *alloc) {
    if (env != NULL) {
        kvd__envelope__free_unpacked(env, alloc);
    }
}

kv_err kv_wire_packed_count(size_t len, size_t unit, size_t *n) {
    if (unit == 0 || len % unit != 0) {
        return KV_EPROTO;
    }
    *n = len / unit;
    return KV_OK;
}

kv_err kv_wire_list_count(size_t n_repeated, size_t packed_len, size_t unit, size_t *n) {
    if (n_repeated > 0 && packed_len > 0) {
        return KV_EPROTO;
    }
    if (packed_len == 0) {
        *n = n_repeated;
        return KV_OK;
    }
    return kv_wire_packed_count(packed_len, unit, n);
}
