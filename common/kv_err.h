/* kv_err: the one error enum shared by kvd, libkvclient and the wire protocol.
 *
 * Codes are generated from one X-macro list so the enum, kv_strerror() and kv_err_name() can
 * never disagree. Numbers are explicit and never reused: proto/kvd.proto's ErrorCode mirrors
 * them (tests/proto check it) and they travel on the wire. Add new codes at the end.
 */
#ifndef KV_ERR_H
#define KV_ERR_H

#define KV_ERR_MAP(X)                                                                              \
    X(OK, 0, "success")                                                                            \
    X(EINVAL, 1, "invalid argument")                                                               \
    X(ENOMEM, 2, "out of memory")                                                                  \
    X(ENOSPC, 3, "pool exhausted: no free or evictable block")                                     \
    X(ENOENT, 4, "no such object")                                                                 \
    X(ESTALE, 5, "stale handle: block generation changed")                                         \
    X(EPERM, 6, "not permitted: object belongs to another session or tenant")                      \
    X(ESTATE, 7, "object is in the wrong state for this operation")                                \
    X(EQUOTA, 8, "quota exceeded")                                                                 \
    X(EPROTO, 9, "protocol error: malformed frame or message")                                     \
    X(ETOOBIG, 10, "message or list exceeds its limit")                                            \
    X(EVERSION, 11, "unsupported protocol version")                                                \
    X(EEPOCH, 12, "daemon restarted: boot epoch changed, re-attach")                               \
    X(ESYS, 13, "operating system error")                                                          \
    X(ECLOSED, 14, "connection closed")                                                            \
    X(EBUSY, 15, "too many requests or connections")                                               \
    X(EEXIST, 16, "already exists")                                                                \
    X(EDRAINING, 17, "daemon is draining: not accepting new work")                                 \
    X(ENOTSUP, 18, "not supported")                                                                \
    X(EAUTH, 19, "authentication failed")                                                          \
    X(ENOGPU, 20, "no usable GPU")                                                                 \
    X(ETIMEDOUT, 21, "timed out")                                                                  \
    X(EINTERNAL, 22, "internal error")                                                             \
    X(ECORRUPT, 23, "stored data failed its checksum or format check")

typedef enum kv_err {
#define KV_ERR_ENUM(name, num, msg) KV_##name = num,
    KV_ERR_MAP(KV_ERR_ENUM)
#undef KV_ERR_ENUM
} kv_err;

/* Number of codes; codes run 0..KV_ERR_COUNT-1 without gaps. */
#define KV_ERR_COUNT 24

/* Bytes of an error sentence: the messages of Error replies and of functions that explain a
 * refusal (daemon and client). */
#define KV_ERRMSG 256

/* A fixed English sentence for err; "unknown error" for a number not in the map. Any thread. */
const char *kv_strerror(int err);

/* The code's name without prefix ("ENOSPC"); "UNKNOWN" for a number not in the map. */
const char *kv_err_name(int err);

#endif
