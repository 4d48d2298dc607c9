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

/* The envelope is a oneof of ~30 bodies: protobuf-c's generic pack and size walk every field
 * descriptor of it per frame (~1700 instructions for a Ping, callgrind). The envelope's own
 * fields are few and fixed, so they are written here (varint id, fixed64 boot_epoch, the body's
 * tag and length, each omitted as protobuf-c omits it) and only the body goes through protobuf-c:
 * the bytes are identical. Anything unusual (unknown fields, no body) takes the generic path. */
static const ProtobufCMessage *env_body(const Kvd__Envelope *env, uint32_t *field) {
    if (env->body_case == KVD__ENVELOPE__BODY__NOT_SET || env->base.n_unknown_fields != 0 ||
        env->hello == NULL) {
        return NULL; /* protobuf-c omits a NULL body: the generic path does the same */
    }
    /* Every member of the body oneof is a message, the case is its field number, and the
     * members share the union's storage: no descriptor search is needed. */
    *field = (uint32_t)env->body_case;
    return (const ProtobufCMessage *)env->hello;
}

static size_t varint_size(uint64_t v) {
    size_t n = 1;
    while (v >= 0x80) {
        v >>= 7;
        n++;
    }
    return n;
}

static size_t put_varint(uint8_t *p, uint64_t v) {
    size_t n = 0;
    while (v >= 0x80) {
        p[n++] = (uint8_t)(v | 0x80);
        v >>= 7;
    }
    p[n++] = (uint8_t)v;
    return n;
}

/* Bytes of the envelope's own fields and body header, for a body of blen bytes. */
/* ---- Ping and Pong by hand ------------------------------------------------------------------
 * The hottest bodies (a Ping is a whole request: a client's liveness check, a benchmark's
 * floor), both {uint64 nonce = 1; bytes payload = 2;}: protobuf-c's generic pack, size and
 * unpack walk their descriptors for several hundred instructions each. These give the same
 * bytes and the same unpacked message (kv_wire_test checks both against protobuf-c, mutations
 * included); any other shape of bytes goes to protobuf-c. */
static int ping_shaped(const ProtobufCMessageDescriptor *d) {
    return d == &kvd__ping__descriptor || d == &kvd__pong__descriptor;
}

/* The two fields of a Ping or Pong (the structs are laid out alike; asserted in the test). */
static uint64_t *ping_nonce(ProtobufCMessage *m) {
    return &((Kvd__Ping *)m)->nonce;
}
static ProtobufCBinaryData *ping_payload(ProtobufCMessage *m) {
    return &((Kvd__Ping *)m)->payload;
}

static size_t ping_size(const ProtobufCMessage *m) {
    const Kvd__Ping *q = (const Kvd__Ping *)m;
    return (q->nonce != 0 ? 1 + varint_size(q->nonce) : 0) +
           (q->payload.len != 0 ? 1 + varint_size(q->payload.len) + q->payload.len : 0);
}

static size_t ping_pack(const ProtobufCMessage *m, uint8_t *out) {
    const Kvd__Ping *q = (const Kvd__Ping *)m;
    uint8_t *p = out;
    if (q->nonce != 0) {
        *p++ = 1 << 3 | 0;
        p += put_varint(p, q->nonce);
    }
    if (q->payload.len != 0) {
        *p++ = 2 << 3 | 2;
        p += put_varint(p, q->payload.len);
        memcpy(p, q->payload.data, q->payload.len);
        p += q->payload.len;
    }
    return (size_t)(p - out);
}

static size_t body_size(const ProtobufCMessage *m) {
    return ping_shaped(m->descriptor) ? ping_size(m) : protobuf_c_message_get_packed_size(m);
}

static size_t body_pack(const ProtobufCMessage *m, uint8_t *out) {
    return ping_shaped(m->descriptor) ? ping_pack(m, out) : protobuf_c_message_pack(m, out);
}

static size_t env_head_size(const Kvd__Envelope *env, uint32_t field, size_t blen) {
    return (env->id != 0 ? 1 + varint_size(env->id) : 0) + (env->boot_epoch != 0 ? 9 : 0) +
           varint_size((uint64_t)field << 3 | 2) + varint_size(blen);
}

size_t kv_wire_frame_measure(const Kvd__Envelope *env, size_t *body_len) {
    uint32_t field;
    const ProtobufCMessage *b = env_body(env, &field);
    if (b == NULL) {
        *body_len = SIZE_MAX;
        return KV_WIRE_HEADER_BYTES + kvd__envelope__get_packed_size(env);
    }
    size_t blen = body_size(b);
    *body_len = blen;
    return KV_WIRE_HEADER_BYTES + env_head_size(env, field, blen) + blen;
}

size_t kv_wire_frame_size(const Kvd__Envelope *env) {
    size_t blen;
    return kv_wire_frame_measure(env, &blen);
}

size_t kv_wire_encode_measured(const Kvd__Envelope *env, size_t body_len, uint8_t *buf) {
    uint32_t field;
    const ProtobufCMessage *b = env_body(env, &field);
    if (b == NULL || body_len == SIZE_MAX) {
        size_t body = kvd__envelope__pack(env, buf + KV_WIRE_HEADER_BYTES);
        put_le32(buf, (uint32_t)body);
        return KV_WIRE_HEADER_BYTES + body;
    }
    uint8_t *p = buf + KV_WIRE_HEADER_BYTES;
    if (env->id != 0) {
        *p++ = 1 << 3 | 0;
        p += put_varint(p, env->id);
    }
    if (env->boot_epoch != 0) {
        *p++ = 2 << 3 | 1;
        put_le32(p, (uint32_t)env->boot_epoch);
        put_le32(p + 4, (uint32_t)(env->boot_epoch >> 32));
        p += 8;
    }
    p += put_varint(p, (uint64_t)field << 3 | 2);
    p += put_varint(p, body_len);
    p += body_pack(b, p);
    size_t body = (size_t)(p - (buf + KV_WIRE_HEADER_BYTES));
    put_le32(buf, (uint32_t)body);
    return KV_WIRE_HEADER_BYTES + body;
}

size_t kv_wire_encode_into(const Kvd__Envelope *env, uint8_t *buf) {
    uint32_t field;
    const ProtobufCMessage *b = env_body(env, &field);
    return kv_wire_encode_measured(env, b != NULL ? body_size(b) : SIZE_MAX, buf);
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

static Kvd__Envelope *env_unpack_fast(ProtobufCAllocator *alloc, const uint8_t *p, size_t n,
                                      const ProtobufCFieldDescriptor **body, const uint8_t **bp,
                                      size_t *blen);

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
    const ProtobufCFieldDescriptor *bf;
    const uint8_t *bp;
    size_t blen;
    Kvd__Envelope *e = env_unpack_fast(alloc, buf + KV_WIRE_HEADER_BYTES, body, &bf, &bp, &blen);
    if (e == NULL) {
        e = kvd__envelope__unpack(alloc, body, buf + KV_WIRE_HEADER_BYTES);
    }
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

static void *a_alloc(ProtobufCAllocator *alloc, size_t n) {
    return alloc != NULL ? alloc->alloc(alloc->allocator_data, n) : malloc(n);
}

/* A Ping or Pong of d from p[0..n): each field at most once, in any order; NULL for anything
 * else (protobuf-c then decides) or for want of memory. */
static ProtobufCMessage *ping_unpack(const ProtobufCMessageDescriptor *d, ProtobufCAllocator *alloc,
                                     size_t n, const uint8_t *p) {
    const uint8_t *end = p + n, *pay = NULL;
    uint64_t nonce = 0, plen = 0;
    int have_nonce = 0, have_pay = 0;
    while (p < end) {
        uint8_t tag = *p++;
        if (tag == (1 << 3 | 0) && !have_nonce) {
            if (!read_varint(&p, end, &nonce)) {
                return NULL;
            }
            have_nonce = 1;
        } else if (tag == (2 << 3 | 2) && !have_pay) {
            /* A length of at most 4 varint bytes: protobuf-c reads 5 and cuts the value to 32
             * bits, longer ones it refuses; those go to it. */
            const uint8_t *at = p;
            if (!read_varint(&p, end, &plen) || p - at > 4 || plen > (uint64_t)(end - p)) {
                return NULL;
            }
            pay = p;
            p += plen;
            have_pay = 1;
        } else {
            return NULL;
        }
    }
    ProtobufCMessage *m = a_alloc(alloc, d->sizeof_message);
    if (m == NULL) {
        return NULL;
    }
    d->message_init(m);
    *ping_nonce(m) = nonce;
    if (plen > 0) {
        uint8_t *data = a_alloc(alloc, (size_t)plen);
        if (data == NULL) {
            protobuf_c_message_free_unpacked(m, alloc);
            return NULL;
        }
        memcpy(data, pay, (size_t)plen);
        ping_payload(m)->data = data;
        ping_payload(m)->len = (size_t)plen;
    }
    return m;
}

static ProtobufCMessage *body_unpack(const ProtobufCMessageDescriptor *d, ProtobufCAllocator *alloc,
                                     size_t n, const uint8_t *p) {
    if (ping_shaped(d)) {
        ProtobufCMessage *m = ping_unpack(d, alloc, n, p);
        if (m != NULL) {
            return m;
        }
    }
    return protobuf_c_message_unpack(d, alloc, n, p);
}

/* The usual request: id, boot_epoch and one body, nothing else. protobuf-c's generic unpack of
 * the envelope costs ~1300 instructions for a Ping (it initialises and scans ~30 oneof fields);
 * this reads the envelope's fields by hand and unpacks only the body, into the same allocator,
 * giving the message the generic unpack gives. Returns NULL for any other shape (a field twice,
 * an unknown field, no body, a bad varint, an oversized tag, a body that does not unpack): the
 * caller then takes the generic path, which decides what is wrong. *body is the body's field. */
static Kvd__Envelope *env_unpack_fast(ProtobufCAllocator *alloc, const uint8_t *p, size_t n,
                                      const ProtobufCFieldDescriptor **body, const uint8_t **bp,
                                      size_t *blen) {
    const uint8_t *end = p + n;
    uint64_t id = 0, epoch = 0;
    int have_id = 0, have_epoch = 0;
    const ProtobufCFieldDescriptor *bf = NULL;
    while (p < end) {
        uint64_t tag;
        if (p[0] < 0x80) {
            tag = *p++;
        } else if (end - p >= 2 && p[1] < 0x80) {
            tag = (uint64_t)(p[0] & 0x7f) | (uint64_t)p[1] << 7;
            p += 2;
        } else {
            return NULL;
        }
        if (tag == (1 << 3 | 0) && !have_id) {
            if (!read_varint(&p, end, &id)) {
                return NULL;
            }
            have_id = 1;
        } else if (tag == (2 << 3 | 1) && !have_epoch) {
            if (end - p < 8) {
                return NULL;
            }
            epoch = (uint64_t)get_le32(p) | (uint64_t)get_le32(p + 4) << 32;
            p += 8;
            have_epoch = 1;
        } else if ((tag & 7) == 2 && bf == NULL) {
            uint64_t len;
            bf = protobuf_c_message_descriptor_get_field(&kvd__envelope__descriptor,
                                                         (unsigned)(tag >> 3));
            if (bf == NULL || bf->type != PROTOBUF_C_TYPE_MESSAGE ||
                (bf->flags & PROTOBUF_C_FIELD_FLAG_ONEOF) == 0 || !read_varint(&p, end, &len) ||
                len > (uint64_t)(end - p)) {
                return NULL;
            }
            *bp = p;
            *blen = (size_t)len;
            p += len;
        } else {
            return NULL;
        }
    }
    if (bf == NULL) {
        return NULL;
    }
    ProtobufCMessage *m = body_unpack(bf->descriptor, alloc, *blen, *bp);
    if (m == NULL) {
        return NULL;
    }
    Kvd__Envelope *e =
        alloc != NULL ? alloc->alloc(alloc->allocator_data, sizeof(*e)) : malloc(sizeof(*e));
    if (e == NULL) {
        protobuf_c_message_free_unpacked(m, alloc);
        return NULL;
    }
    kvd__envelope__init(e);
    e->id = id;
    e->boot_epoch = epoch;
    e->body_case = (Kvd__Envelope__BodyCase)bf->id;
    *(ProtobufCMessage **)((char *)e + bf->offset) = m;
    *body = bf;
    return e;
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
    const ProtobufCFieldDescriptor *bf = NULL;
    const uint8_t *bp = NULL;
    size_t blen = 0;
    Kvd__Envelope *e = env_unpack_fast(alloc, b, body, &bf, &bp, &blen);
    if (e == NULL) {
        bf = NULL;
        e = kvd__envelope__unpack(alloc, body, b);
    }
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
    } else if (bf != NULL ? has_strings(bf->descriptor, 0) &&
                                !strings_ok(bf->descriptor, bp, bp + blen, &bad_msg, &bad_field, 1)
                          : !strings_ok(&kvd__envelope__descriptor, b, b + body, &bad_msg,
                                        &bad_field, 0)) {
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
