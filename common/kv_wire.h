/* kv_wire: framing of the client protocol, as pure functions (bytes in, message or error out),
 * shared by kvd and libkvclient and fuzzed on their own.
 *
 * A frame is a 4-byte little-endian length L followed by L bytes of one protobuf-c
 * kvd.Envelope. File descriptors travel beside the frame as SCM_RIGHTS (the transport's job,
 * not this module's). Any thread; no state.
 */
#ifndef KV_WIRE_H
#define KV_WIRE_H

#include <stddef.h>
#include <stdint.h>

#include "common/kv_err.h"
#include "proto/kvd.pb-c.h"

#define KV_WIRE_HEADER_BYTES 4
#define KV_WIRE_DEFAULT_MAX_FRAME (1u << 20) /* 1 MiB, configurable in kvd */
#define KV_PROTOCOL_VERSION 1

/* Bytes the framed envelope takes (header included). */
size_t kv_wire_frame_size(const Kvd__Envelope *env);

/* Writes the frame of env into buf, which has room for kv_wire_frame_size(env) bytes; returns
 * the bytes written. */
size_t kv_wire_encode_into(const Kvd__Envelope *env, uint8_t *buf);

/* Frames env into a malloc'd buffer (*buf, caller frees). KV_ETOOBIG when larger than
 * max_frame, KV_ENOMEM. Writes outputs only on success. */
kv_err kv_wire_encode(const Kvd__Envelope *env, uint32_t max_frame, uint8_t **buf, size_t *len);

/* Looks at the start of buf[0..len): if a whole frame is there, unpacks it into *env (free with
 * kv_wire_free) and sets *consumed to its size. If more bytes are needed, returns KV_OK with
 * *env = NULL and *consumed = 0. Errors (the stream cannot continue): KV_ETOOBIG when the
 * length exceeds max_frame, KV_EPROTO when the body does not unpack or has no body. */
kv_err kv_wire_decode(const uint8_t *buf, size_t len, uint32_t max_frame, Kvd__Envelope **env,
                      size_t *consumed);

/* Frees an envelope from kv_wire_decode; accepts NULL. */
void kv_wire_free(Kvd__Envelope *env);

#endif
