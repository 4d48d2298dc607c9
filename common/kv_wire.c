/* kv_wire: length-prefixed protobuf-c envelopes. Decoding never trusts the length beyond
 * max_frame and never allocates before the whole frame is present. */
#include "common/kv_wire.h"

#include <stdio.h>
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

/* Whether buf holds a whole frame: KV_OK with *body its length (*whole 1), KV_OK with *whole 0
 * while bytes are missing, KV_ETOOBIG when the length exceeds max_frame. */
static kv_err frame_of(const uint8_t *buf, size_t len, uint32_t max_frame, uint32_t *body,
                       int *whole) {
    *whole = 0;
    if (len < KV_WIRE_HEADER_BYTES) {
        return KV_OK;
    }
    *body = get_le32(buf);
    if (*body > max_frame) {
        return KV_ETOOBIG;
    }
    *whole = len - KV_WIRE_HEADER_BYTES >= *body;
    return KV_OK;
}

kv_err kv_wire_decode_with(const uint8_t *buf, size_t len, uint32_t max_frame,
                           ProtobufCAllocator *alloc, Kvd__Envelope **env, size_t *consumed) {
    *env = NULL;
    *consumed = 0;
    uint32_t body;
    int whole;
    kv_err rc = frame_of(buf, len, max_frame, &body, &whole);
    if (rc != KV_OK || !whole) {
        return rc;
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

size_t kv_utf8_prefix(const char *s, size_t n) {
    const unsigned char *p = (const unsigned char *)s;
    size_t i = 0;
    while (i < n) {
        unsigned c = p[i];
        size_t len;
        unsigned min;
        if (c < 0x80) {
            i++;
            continue;
        } else if (c >= 0xc2 && c <= 0xdf) {
            len = 2;
            min = 0x80;
        } else if (c >= 0xe0 && c <= 0xef) {
            len = 3;
            min = 0x800;
        } else if (c >= 0xf0 && c <= 0xf4) {
            len = 4;
            min = 0x10000;
        } else {
            return i;
        }
        if (i + len > n) {
            return i;
        }
        unsigned cp = c & (0xffu >> (len + 1));
        for (size_t k = 1; k < len; k++) {
            if ((p[i + k] & 0xc0) != 0x80) {
                return i;
            }
            cp = cp << 6 | (p[i + k] & 0x3f);
        }
        if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) {
            return i; /* overlong, out of range, or a surrogate */
        }
        i += len;
    }
    return n;
}

/* Reads a varint at *p (below end); 0 when it runs past end or past 10 bytes. */
static int read_varint(const uint8_t **p, const uint8_t *end, uint64_t *v) {
    uint64_t x = 0;
    for (int shift = 0; shift < 70 && *p < end; shift += 7) {
        uint8_t b = *(*p)++;
        x |= (uint64_t)(b & 0x7f) << shift;
        if ((b & 0x80) == 0) {
            *v = x;
            return 1;
        }
    }
    return 0;
}

static const ProtobufCFieldDescriptor *field_of(const ProtobufCMessageDescriptor *d, uint64_t id) {
    for (unsigned i = 0; i < d->n_fields; i++) {
        if (d->fields[i].id == id) {
            return &d->fields[i];
        }
    }
    return NULL;
}

/* 1 when messages of d can hold a string (directly or in a submessage). */
static int has_strings(const ProtobufCMessageDescriptor *d, int depth) {
    for (unsigned i = 0; depth < 8 && i < d->n_fields; i++) {
        const ProtobufCFieldDescriptor *f = &d->fields[i];
        if (f->type == PROTOBUF_C_TYPE_STRING ||
            (f->type == PROTOBUF_C_TYPE_MESSAGE && has_strings(f->descriptor, depth + 1))) {
            return 1;
        }
    }
    return 0;
}

/* Walks the wire form of one message of d: every string field must be UTF-8 without a NUL byte.
 * On a bad one names it in *bad ("Message.field") and returns 0. The bytes unpacked already, so
 * they are well formed; a surprise is treated as "nothing to check". */
static int strings_ok(const ProtobufCMessageDescriptor *d, const uint8_t *p, const uint8_t *end,
                      const char **bad_msg, const char **bad_field, int depth) {
    while (p < end && depth < 8) {
        uint64_t tag, len;
        if (!read_varint(&p, end, &tag)) {
            return 1;
        }
        switch (tag & 7) {
            case 0:
                if (!read_varint(&p, end, &len)) {
                    return 1;
                }
                continue;
            case 1:
                p += 8;
                continue;
            case 5:
                p += 4;
                continue;
            case 2:
                break;
            default:
                return 1;
        }
        if (!read_varint(&p, end, &len) || len > (uint64_t)(end - p)) {
            return 1;
        }
        const ProtobufCFieldDescriptor *f = field_of(d, tag >> 3);
        if (f != NULL && f->type == PROTOBUF_C_TYPE_STRING) {
            if (memchr(p, 0, (size_t)len) != NULL ||
                kv_utf8_prefix((const char *)p, (size_t)len) != len) {
                *bad_msg = d->short_name;
                *bad_field = f->name;
                return 0;
            }
        } else if (f != NULL && f->type == PROTOBUF_C_TYPE_MESSAGE &&
                   has_strings(f->descriptor, 0) &&
                   !strings_ok(f->descriptor, p, p + len, bad_msg, bad_field, depth + 1)) {
            return 0;
        }
        p += len;
    }
    return 1;
}

kv_err kv_wire_decode_request(const uint8_t *buf, size_t len, uint32_t max_frame, uint64_t epoch,
                              ProtobufCAllocator *alloc, Kvd__Envelope **env, size_t *consumed,
                              uint64_t *id, char *why, size_t whylen) {
    *env = NULL;
    *consumed = 0;
    *id = 0;
    uint32_t body;
    int whole;
    kv_err frc = frame_of(buf, len, max_frame, &body, &whole);
    if (frc != KV_OK || !whole) {
        return frc;
    }
    const uint8_t *b = buf + KV_WIRE_HEADER_BYTES;
    *consumed = KV_WIRE_HEADER_BYTES + body;
    Kvd__Envelope *e = kvd__envelope__unpack(alloc, body, b);
    if (e == NULL) {
        snprintf(why, whylen, "frame body is not a kvd.Envelope; frame skipped");
        return KV_EPROTO;
    }
    *id = e->id;
    kv_err rc = KV_OK;
    const char *bad_msg = NULL, *bad_field = NULL;
    if (epoch != 0 && e->boot_epoch != 0 && e->boot_epoch != epoch) {
        /* Before everything else (PROTOCOL.md §4): a request for another boot is void whatever
         * else is wrong with it. */
        snprintf(why, whylen,
                 "request is for boot epoch %016llx; this daemon is %016llx: re-attach",
                 (unsigned long long)e->boot_epoch, (unsigned long long)epoch);
        rc = KV_EEPOCH;
    } else if (e->body_case == KVD__ENVELOPE__BODY__NOT_SET && e->base.n_unknown_fields > 0) {
        snprintf(why, whylen,
                 "the request's body is of a type this daemon does not know (protocol %d)",
                 KV_PROTOCOL_VERSION);
        rc = KV_ENOTSUP;
    } else if (e->body_case == KVD__ENVELOPE__BODY__NOT_SET) {
        snprintf(why, whylen, "the envelope has no body");
        rc = KV_EPROTO;
    } else if (!strings_ok(&kvd__envelope__descriptor, b, b + body, &bad_msg, &bad_field, 0)) {
        snprintf(why, whylen,
                 "%s.%s is not UTF-8 text without NUL bytes (kvd.proto declares it a string)",
                 bad_msg, bad_field);
        rc = KV_EINVAL;
    }
    if (rc != KV_OK) {
        kvd__envelope__free_unpacked(e, alloc);
        return rc;
    }
    *env = e;
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
