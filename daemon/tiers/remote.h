/* kvd_remote: the remote tier's Redis client (docs/TIERS.md, "Remote tier"). One Redis server or
 * a Redis Cluster (slot map from CLUSTER SLOTS, MOVED and ASK followed, the map read again after
 * a connection fails or a redirection), spoken to by one thread of its own through Debian's
 * libhiredis, so that the loop thread never waits on Redis: it queues requests and gets their
 * completions back on the loop (a uv_async), in order per kind.
 *
 * A value is the block's bytes behind a 56-byte header (all integers little-endian):
 *   "KVDR" | version u16 (1) | format u8 (kvd_tier_format) | flags u8 | layout key (16) |
 *   block hash (16: lo, hi) | body length u64 | XXH3-64 of the body u64 | body
 * where the body is the payload, or with flag KVD_REMOTE_F_TAIL (hash-mode vllm) the last 16
 * bytes of the block's 32-byte vLLM digest (the first 16 are the hash) and then the payload.
 * The thread builds the header of a put and checks every field of a value it gets against what
 * the caller expects (the layout key and hash): a value that fails a check is reported BAD and
 * never handed on. A key that is missing (never written, TTL expired, evicted by Redis's own
 * maxmemory policy) is a miss.
 *
 * A get pipeline's replies are read by this module itself, straight from the socket into the
 * caller's destinations (T0 blocks: kvd_remote_dst) or into buffers of their own (libhiredis's
 * reader would copy every byte twice more); every other command and reply goes through
 * libhiredis.
 *
 * Faults: connect and command timeouts (timeout_ms), a node that fails is closed and retried
 * after a backoff (100 ms doubling to backoff_max_ms, 5 s by default); while every node is down
 * a request fails at once.
 * Nothing here ever blocks the loop thread. The password comes from the caller (a file the
 * daemon read); TLS is not offered (Debian's libhiredis 0.14 has none).
 */
#ifndef KVD_REMOTE_H
#define KVD_REMOTE_H

#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#include <uv.h>

#include "common/kv_err.h"
#include "common/kv_hash.h"

#define KVD_REMOTE_HEADER 56
#define KVD_REMOTE_VERSION 1
#define KVD_REMOTE_F_TAIL 0x01 /* flags: a 16-byte digest tail opens the body */
#define KVD_REMOTE_TAIL 16

typedef struct kvd_remote kvd_remote;

typedef struct kvd_remote_cfg {
    const char *seeds;       /* "HOST:PORT[,HOST:PORT...]" */
    const char *password;    /* AUTH password, or "" */
    uint64_t timeout_ms;     /* connect and command timeout */
    uint64_t backoff_max_ms; /* longest wait before a failed node is tried again; 0: 5000 */
    uint64_t ttl_s;          /* SET ... EX ttl_s; 0: no TTL */
    uint64_t queue_bytes;    /* bytes of puts queued at most (more are refused: KV_EBUSY) */
} kvd_remote_cfg;

/* A seed list, "HOST:PORT[,HOST:PORT...]" as remote-redis takes it: up to KVD_REMOTE_SEEDS_MAX
 * seeds, HOST under KVD_REMOTE_HOST_MAX bytes. KV_EINVAL with msg (naming remote-redis) for a
 * malformed list, an empty one or too many seeds. */
#define KVD_REMOTE_SEEDS_MAX 64
#define KVD_REMOTE_HOST_MAX 256
typedef struct kvd_remote_seed {
    char host[KVD_REMOTE_HOST_MAX];
    int port;
} kvd_remote_seed;
kv_err kvd_remote_parse_seeds(const char *seeds, kvd_remote_seed *out, int *n, char *msg,
                              size_t len);

/* Parses the seeds and starts the thread (which connects on its own: alloc never waits on the
 * network). KV_EINVAL with msg for a bad seed list; KV_ENOMEM; KV_ESYS (thread). */
kv_err kvd_remote_alloc(uv_loop_t *loop, const kvd_remote_cfg *cfg, kvd_remote **out, char *msg,
                        size_t len);

/* Stops the thread (waits for the request it is on: at most about timeout_ms), completes every
 * queued request with KV_ECLOSED (callbacks run here), and closes the loop handle. Loop
 * thread; once. Accepts NULL. */
void kvd_remote_close(kvd_remote *r);

/* Frees everything (after close, after the loop ran its close callbacks). Accepts NULL. */
void kvd_remote_free(kvd_remote *r);

/* What a value says about its block. */
typedef struct kvd_remote_meta {
    kv_hash128 layout_key; /* the pool's model and layout (two pools share values only if equal) */
    kv_hash128 hash;       /* the block's chain hash */
    uint8_t format;        /* kvd_tier_format of the payload */
    const uint8_t *tail;   /* put: the digest's last 16 bytes (copied at once), or NULL */
} kvd_remote_meta;

/* SET key (header, payload) [EX ttl]. key and payload are borrowed until done runs (on the loop
 * thread; rc KV_OK, KV_EQUOTA when Redis refused it (OOM: full), KV_ESYS when it failed
 * (timeout, connection), KV_ECLOSED at close). KV_EBUSY (done never runs) when the queue is
 * full or every node is down. */
typedef void (*kvd_remote_put_done)(void *arg, kv_err rc);
kv_err kvd_remote_put(kvd_remote *r, const char *key, const kvd_remote_meta *meta,
                      const uint8_t *payload, size_t plen, kvd_remote_put_done done, void *arg);

/* DEL key (a block that was quarantined: its value must not be served by any node). It runs after
 * the puts queued before it have been answered, and before the gets and probes queued after it.
 * One that fails is kept and tried again every 0.5 s (at most 1024 wait; the oldest is then given
 * up with a warning), and until it lands a get or probe of the key is a miss; a stop gives up the
 * ones left, with a warning. No completion; KV_EBUSY at stop, KV_ENOMEM. */
kv_err kvd_remote_del(kvd_remote *r, const char *key);

/* One key's answer to a get. */
typedef enum kvd_remote_status {
    KVD_REMOTE_MISS = 0, /* no such key (or the request failed: rc says) */
    KVD_REMOTE_HIT = 1,  /* data[off..off+len) is the payload, format its format */
    KVD_REMOTE_BAD = 2,  /* a value that failed a check (why: a static string) */
} kvd_remote_status;

/* Where a get may put one key's payload itself (the direct path): memory the caller owns and
 * does not touch until done runs — the runs of a T0 block, in the block's stored order. A value
 * whose header says format `format` and whose payload is exactly `bytes` long is read from the
 * socket straight into iov[0..niov) and checked there; any other value (another format, another
 * length, one read through a redirection) comes in a buffer of its own as without a
 * destination. Bytes written into a destination by a value that then fails a check are left
 * there (the caller never serves them: its status is BAD). */
typedef struct kvd_remote_dst {
    const struct iovec *iov; /* NULL: none for this key */
    int niov;
    size_t bytes;   /* the sum of iov[].iov_len */
    uint8_t format; /* the one format it takes (kvd_tier_format) */
} kvd_remote_dst;

typedef struct kvd_remote_val {
    kvd_remote_status status;
    int direct;      /* HIT: the payload is in the key's destination (data is NULL) */
    uint8_t *data;   /* HIT: the payload at data + off (malloc'd; the callback may take it:
                        set NULL; off is 0) */
    size_t off, len; /* HIT: where the payload is */
    uint8_t format;  /* HIT: kvd_tier_format */
    const char *why; /* BAD: which check failed */
    int has_tail;    /* HIT: the value carried the digest's tail */
    uint8_t tail[KVD_REMOTE_TAIL];
} kvd_remote_val;

/* GET of keys[0..n) (pipelined per node), each checked against want[i] (layout key and hash;
 * the format is not compared); dst: NULL, or [n] destinations (kvd_remote_dst; an entry with
 * iov NULL has none). keys, want and dst are borrowed until done runs on the loop thread
 * with vals[0..n) (owned by kvd_remote; data not taken is freed after the callback) and rc:
 * KV_OK, or KV_ESYS when some node failed (its keys are misses), KV_ECLOSED at close.
 * KV_EBUSY (done never runs) when every node is down. */
typedef void (*kvd_remote_get_done)(void *arg, kv_err rc, kvd_remote_val *vals, size_t n);
kv_err kvd_remote_get(kvd_remote *r, const char *const *keys, const kvd_remote_meta *want,
                      const kvd_remote_dst *dst, size_t n, kvd_remote_get_done done, void *arg);

/* Whether keys[0..n) hold values (pipelined per node, queued with the gets and served as one:
 * one timeout for all its nodes, the map read again once after a failover): STRLEN of each key,
 * a key counting as there when its value is longer than a header. No value is read, so a value
 * that is there but fails a check when a get reads it counts here (a Fetch finds that out, and
 * serves nothing of it). keys are borrowed until done runs on the loop thread with present[0..n)
 * (1: there, 0: no such key or not asked) and rc: KV_OK, KV_ESYS when some node failed or the
 * time ran out (its keys are 0), KV_ECLOSED at close, KV_ENOMEM (present NULL, n 0). KV_EBUSY (done
 * never runs) at stop; KV_ENOMEM. */
typedef void (*kvd_remote_probe_done)(void *arg, kv_err rc, const uint8_t *present, size_t n);
kv_err kvd_remote_probe(kvd_remote *r, const char *const *keys, size_t n,
                        kvd_remote_probe_done done, void *arg);

/* Counters and state (loop thread; read under the thread's lock). */
typedef struct kvd_remote_stats {
    uint64_t state; /* 1 up (some node answers), 2 down (none does, or none tried yet) */
    uint64_t puts, put_bytes, put_errors, put_drops;
    uint64_t gets, hits, misses, bad;
    uint64_t probes, probe_hits; /* keys asked by kvd_remote_probe, and found there */
    uint64_t errors, reconnects, redirects;
    uint64_t dels_pending; /* DELs of quarantined values that failed, waiting to be tried again */
    int cluster;           /* a Redis Cluster was found */
    int nnodes;            /* nodes known */
    char last_error[600];
} kvd_remote_stats;
void kvd_remote_get_stats(kvd_remote *r, kvd_remote_stats *out);

/* The Redis Cluster key slot of key (CRC16/XMODEM of the key or of its {hash tag}, mod 16384). */
uint32_t kvd_remote_slot(const char *key, size_t len);

#endif
