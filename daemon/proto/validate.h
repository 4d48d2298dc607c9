/* kvd_validate: field checks of client requests as pure functions (message in, verdict and a
 * human sentence out), so they can be unit-tested and fuzzed without a server. Checks that need
 * state (does the session hold this block?) live in the handlers. Any thread.
 */
#ifndef KVD_VALIDATE_H
#define KVD_VALIDATE_H

#include <stddef.h>
#include <stdint.h>

#include "common/kv_err.h"
#include "common/kv_limits.h"
#include "common/kv_layout.h"
#include "proto/kvd.pb-c.h"

/* Hello: version 1 (KV_EVERSION), client_name <= 64 bytes (KV_EINVAL), token <= KV_WIRE_MAX_TOKEN
 * bytes (KV_EINVAL; whether it names a tenant is the tenant table's check). msg gets a sentence
 * on error. */
kv_err kvd_validate_hello(const Kvd__Hello *h, char *msg, size_t msglen);

/* AttachPool: model_id 1..128 bytes, layout present and valid; *out gets the layout (derived
 * fields filled) on success. KV_EINVAL with the field named in msg. */
kv_err kvd_validate_attach(const Kvd__AttachPool *a, kv_layout *out, char *msg, size_t msglen);

/* A list of n entries against max: KV_ETOOBIG when longer. what names the list in msg. */
kv_err kvd_validate_list(size_t n, uint64_t max, const char *what, char *msg, size_t msglen);

/* Allocate.count: 1..max (KV_EINVAL for 0, KV_ETOOBIG above max). */
kv_err kvd_validate_allocate(const Kvd__Allocate *a, uint64_t max, char *msg, size_t msglen);

/* Commit: list length, every entry has a block and a hash (KV_EINVAL). */
kv_err kvd_validate_commit(const Kvd__Commit *c, uint64_t max, char *msg, size_t msglen);

/* A Commit in either form (PROTOCOL.md §6, "Packed lists") as the repeated one, for a pool of
 * tpb tokens a block. In field order: the repeated entries (kvd_validate_commit: KV_ETOOBIG,
 * KV_EINVAL), then entries_packed past max records (KV_ETOOBIG), then KV_EPROTO: a packed field
 * that is not whole records (entries_packed KV_WIRE_COMMIT_BYTES an entry; hash_full_packed 32
 * and token_ids_packed tpb * 4 bytes an entry, or empty), both forms at once, or
 * hash_full_packed, token_ids_packed or parent_hash_full without entries_packed. On success
 * *out is c itself (no packed field) or a Commit allocated from alloc (an arena: nothing is
 * freed here) holding only repeated entries, whose hash_full and parent_hash_full point into
 * c's bytes (c must outlive it) and whose token ids are copied. KV_ENOMEM when alloc fails. *out
 * is c on every error. */
kv_err kvd_validate_commit_any(const Kvd__Commit *c, uint64_t max, uint32_t tpb,
                               ProtobufCAllocator *alloc, const Kvd__Commit **out, char *msg,
                               size_t msglen);

/* A list of repeated hashes (Lookup's, Fetch's): its length (KV_ETOOBIG), every hash present
 * (KV_EINVAL). */
kv_err kvd_validate_hashes(size_t n, Kvd__Hash128 *const *hashes, uint64_t max, char *msg,
                           size_t msglen);

/* Lookup: list length, every hash present (KV_EINVAL). */
kv_err kvd_validate_lookup(const Kvd__Lookup *l, uint64_t max, char *msg, size_t msglen);

/* A BlockRef list (Release, Rewind, Pin): length, no NULL entries. */
kv_err kvd_validate_refs(size_t n, Kvd__BlockRef *const *refs, uint64_t max, char *msg,
                         size_t msglen);

/* Pin: refs as above; unless unpin, retention_ms <= 7 days and priority <= 255 (KV_EINVAL). */
kv_err kvd_validate_pin(const Kvd__Pin *p, uint64_t max, char *msg, size_t msglen);

/* Ping: payload <= max_frame - KV_WIRE_PING_SLACK (KV_ETOOBIG). */
kv_err kvd_validate_ping(const Kvd__Ping *p, uint64_t max_frame, char *msg, size_t msglen);

#endif
