/* kvclient: the library an inference worker links to share KV-cache blocks through kvd.
 *
 * A worker opens a connection (kvc_conn) to the daemon's Unix socket, attaches a pool for its
 * model's KV layout (kvc_pool: every segment of the pool is mapped into the worker, so block
 * bytes are read and written in place, zero-copy), hashes its tokens into block hashes with the
 * pool's seed, and then looks up cached prefixes, allocates blocks for what it must compute,
 * commits full blocks and releases them. kvc_seq wraps that cycle for one sequence and exports
 * a batch's block tables in FlashInfer's CSR form.
 *
 * Shared domains (docs/TENANCY.md): attaching also maps the same model's pools in the tenant's
 * groups and the commons ("linked pools", kvc_pool_linked; the commons read-only). Block ids are
 * pool-local, so a block is named by (kvc_pool *, kvc_block): kvc_lookup_domains says which
 * pool each hit lives in, every address and block call takes that pool, and kvc_release_multi
 * gives back blocks of several pools at once. kvc_lookup searches the attached pool only.
 *
 * Calls are synchronous (one round trip each) or batched (kvc_batch: many requests are sent
 * back to back and their replies are matched by request id). No event loop, no threads.
 *
 * Threads: a kvc_conn, and the pools, sequences and batches made from it, are used by one
 * thread at a time (the library takes no locks; use one connection per thread, or serialise
 * calls on a shared one). The memory a pool maps, and the addresses kvc_pool_addr and friends
 * return, may be read and written from any thread; they stay valid until the pool is detached
 * (host pools: when kvd frees a segment and grows another at its index, the old addresses show
 * the new segment, or zeros where it could not be mapped there; never unmapped memory).
 *
 * Errors: calls return a kv_err (common/kv_err.h; KV_OK is 0; kvc_err_name and kvc_strerror
 * name and describe one). Every failing call records a sentence: the daemon's message or the
 * library's own description. kvc_last_error(c) is the last failure on connection c (of any call
 * on it or on its pools, sequences and batches), kvc_last_error(NULL) the calling thread's last
 * failure of any call (kvc_conn_open included, which has no connection to report on). Outputs
 * are written only on success. A daemon restart is reported as KV_EEPOCH: detach the pools,
 * attach again (the connection reconnects by itself on the next call).
 *
 * Logging goes through the callback in kvc_options; the library never writes to stderr.
 * This is the only header of libkvclient. In the source tree it includes the shared type
 * definitions of common/kv_err.h, kv_hash.h and kv_layout.h; the installed kvclient.h
 * (client/gen_public.py) carries those types itself and needs no other header. Their functions
 * (kv_layout_init, kv_hash_chain, ...) are not part of the library: use the kvc_ calls. Each
 * shared type also has a kvc_ name (kvc_err, kvc_layout, kvc_hash128, ...), the same type.
 *
 * Linking: `cc $(pkg-config --cflags --libs kvclient)` (libkvclient.so.1, which exports exactly
 * the KVC_EXTERN functions below and needs only libc, libm, libprotobuf-c, libxxhash, libmd),
 * or `pkg-config --static` for libkvclient.a, whose one object also defines only kvc_*.
 */
#ifndef KVCLIENT_H
#define KVCLIENT_H

#include <stddef.h>
#include <stdint.h>

#include "common/kv_err.h"
#include "common/kv_hash.h"
#include "common/kv_layout.h"

#ifdef __cplusplus
extern "C" {
#endif

/* kvc_ names of the shared types. */
typedef kv_err kvc_err;
typedef kv_hash128 kvc_hash128;
typedef kv_hash_algo kvc_hash_algo;
typedef kv_layout kvc_layout;
typedef kv_dtype kvc_dtype;
typedef kv_arrangement kvc_arrangement;

#if defined(__GNUC__)
#define KVC_EXTERN __attribute__((visibility("default")))
#else
#define KVC_EXTERN
#endif

/* ---- Connection ----------------------------------------------------------------------- */

typedef struct kvc_conn kvc_conn;
typedef struct kvc_pool kvc_pool;
typedef struct kvc_batch kvc_batch;
typedef struct kvc_seq kvc_seq;

/* A block handle: pool-local id and the generation it was issued at. */
typedef struct kvc_block {
    uint32_t id;  /* segment * blocks_per_segment + slot */
    uint32_t gen; /* a handle with an old generation is refused (KV_ESTALE) */
} kvc_block;

/* Log levels passed to kvc_log_fn (the same numbers as kv_log_level). */
enum { KVC_LOG_ERROR = 0, KVC_LOG_WARN = 1, KVC_LOG_INFO = 2, KVC_LOG_DEBUG = 3 };

/* Receives one formatted log line (no newline) with a stable message id ("KVC-CONN-EOF").
 * Called on the thread that made the call that logs. */
typedef void (*kvc_log_fn)(void *arg, int level, const char *id, const char *msg);

typedef struct kvc_options {
    const char *socket_path; /* NULL: kvc_default_socket_path() */
    const char *client_name; /* shown in daemon logs and kvctl; NULL: "kvclient" */
    const void *token;       /* optional tenant token (PROTOCOL.md, Identity), may be NULL */
    size_t token_len;        /* bytes of token */
    kvc_log_fn log;          /* NULL: no logging */
    void *log_arg;           /* passed to log */
    int log_level;           /* messages with level <= this are logged; default KVC_LOG_WARN */
    int timeout_ms;          /* longest wait for the daemon per call; < 0 forever; default 30000 */
} kvc_options;

/* Fills o with the defaults above. Any thread. */
KVC_EXTERN void kvc_options_init(kvc_options *o);

/* Writes the default socket path into buf[cap]: $KVD_SOCKET if set, else
 * $XDG_RUNTIME_DIR/kvd/kvd.sock, else /tmp/kvd-$UID/kvd.sock. KV_ETOOBIG when it does not fit.
 * Any thread. */
KVC_EXTERN kv_err kvc_default_socket_path(char *buf, size_t cap);

/* Connects to the daemon and says Hello. The options (strings included) are copied.
 * Errors: KV_ESYS (socket or connect failed; no daemon), KV_EVERSION, KV_EAUTH, KV_EPROTO,
 * KV_ETIMEDOUT, KV_ENOMEM. On error nothing is allocated; kvc_last_error(NULL) says why ("connect
 * /run/kvd/kvd.sock: No such file or directory", or that the path is kvd's admin socket) and
 * the log callback gets it too. Writes *out only on success; close it with kvc_conn_close. */
KVC_EXTERN kv_err kvc_conn_open(const kvc_options *opts, kvc_conn **out);

/* Frees every pool still attached, closes the socket and frees the connection; the daemon
 * releases every reference of the session. Sequences and batches made from it may be freed
 * before or after: afterwards they are empty shells (their calls return KV_ESTATE/KV_ECLOSED).
 * Accepts NULL. */
KVC_EXTERN void kvc_conn_close(kvc_conn *c);

/* Reconnects and says Hello again (the old session and its references are gone). Returns
 * KV_EEPOCH when the daemon restarted (its boot epoch changed): every pool of the connection is
 * then stale and must be detached and attached again. Calls reconnect by themselves when the
 * previous call found the connection broken, so this is only needed to force it. */
KVC_EXTERN kv_err kvc_conn_reconnect(kvc_conn *c);

/* The message of the last failed call on c, or with c NULL of the calling thread's last failed
 * call (never NULL; "" before any failure). Valid until the next call on c (or on the thread). */
KVC_EXTERN const char *kvc_last_error(const kvc_conn *c);

/* The name ("ENOSPC") and the one-line description of an error code, for messages and logs. */
KVC_EXTERN const char *kvc_err_name(kv_err err);
KVC_EXTERN const char *kvc_strerror(kv_err err);

/* Session id, tenant name and boot epoch from the last Hello. */
KVC_EXTERN uint64_t kvc_conn_session_id(const kvc_conn *c);
KVC_EXTERN const char *kvc_conn_tenant(const kvc_conn *c);
KVC_EXTERN uint64_t kvc_conn_boot_epoch(const kvc_conn *c);

/* The socket descriptor (for poll by applications that wait for many things); do not read or
 * write it. -1 while disconnected. */
KVC_EXTERN int kvc_conn_fd(const kvc_conn *c);

/* One round trip: sends Ping with payload[len] (may be NULL, 0) and checks the echoed Pong.
 * Errors: transport errors (KV_ECLOSED, KV_ETIMEDOUT, KV_EPROTO, KV_EEPOCH), KV_ETOOBIG. */
KVC_EXTERN kv_err kvc_ping(kvc_conn *c, const void *payload, size_t len);

/* Receives one statistic. */
typedef void (*kvc_stat_fn)(void *arg, const char *name, uint64_t value);

/* Fetches the daemon's counters: pool_id 0 for session and daemon counters only, or a pool's
 * id for its counters too. fn is called once per statistic before the call returns. */
KVC_EXTERN kv_err kvc_stats(kvc_conn *c, uint32_t pool_id, kvc_stat_fn fn, void *arg);

/* Fetches one statistic by name; KV_ENOENT when the daemon did not report it. */
KVC_EXTERN kv_err kvc_stat_get(kvc_conn *c, uint32_t pool_id, const char *name, uint64_t *value);

/* ---- Pool ----------------------------------------------------------------------------- */

/* Attaches the pool for (model_id, layout shape) and maps every segment. Only the six shape
 * fields of layout (num_layers .. arrangement) are read; the derived fields need not be set.
 * On success *out has the daemon's layout (kvc_pool_layout), the hash seed and algorithm, and
 * for LAYER_MAJOR pools one contiguous range per (layer, K|V): the engine sees one tensor
 * [blocks][tokens][heads][dim] per layer (kvc_pool_layer_base).
 * Errors: KV_EINVAL (bad shape or model_id), the daemon's codes (KV_EPERM, KV_EQUOTA, ...),
 * KV_ESYS (mmap failed), transport errors. Detach with kvc_pool_detach before kvc_conn_close or
 * let kvc_conn_close do it. */
KVC_EXTERN kv_err kvc_pool_attach(kvc_conn *c, const char *model_id, const kv_layout *layout,
                                  kvc_pool **out);

/* kvc_pool_attach with flags: KVC_ATTACH_LOSSY_TIERS lets the daemon's lower tiers keep this
 * pool's blocks quantized (int8 or fp8 with per-head scales, its option tier-lossy-format): a
 * block fetched back is close to, not equal to, what was committed (docs/TIERS.md gives the
 * bound). The flag is part of the pool's identity: clients that attach without it get another
 * pool, so a client never gets lossy bytes it did not ask for. Only fp16, bf16 and fp32 layouts
 * are stored lossy; others stay lossless. KV_EINVAL for unknown flags; else as
 * kvc_pool_attach. */
#define KVC_ATTACH_LOSSY_TIERS 1u
/* KVC_ATTACH_SUMMARIES: the daemon keeps a page summary beside every committed block of the pool
 * (IceCache, docs/ICECACHE.md; kvc_summaries reads them). Part of the pool's identity too. */
#define KVC_ATTACH_SUMMARIES 2u
KVC_EXTERN kv_err kvc_pool_attach_ex(kvc_conn *c, const char *model_id, const kv_layout *layout,
                                     uint32_t flags, kvc_pool **out);

/* Ends the session's use of the pool: tells kvd (DetachPool: every reference the session holds
 * in it and its linked pools is released, WRITING leases freed), unmaps it and frees it.
 * Addresses from the pool become invalid; sequences made on it become empty shells (free them
 * with kvc_seq_free in any order). With the connection broken or the pool stale there is
 * nothing to release. Accepts NULL. */
KVC_EXTERN void kvc_pool_detach(kvc_pool *p);

/* The pool id, the daemon's layout (derived fields filled), and the geometry. */
KVC_EXTERN uint32_t kvc_pool_id(const kvc_pool *p);
KVC_EXTERN const kv_layout *kvc_pool_layout(const kvc_pool *p);
KVC_EXTERN uint32_t kvc_pool_blocks_per_segment(const kvc_pool *p);
/* Segment slots the layer tensors of kvc_pool_layer_base span: its hard maximum, 4096, or, where
 * that much address space could not be reserved (segments of 256 MiB and more), the daemon's
 * budget at attach. The tensors span max_segments * blocks_per_segment blocks; a block of a
 * segment past them (the daemon's budget grew) is not in them: kvc_pool_addr reaches it. */
KVC_EXTERN uint32_t kvc_pool_max_segments(const kvc_pool *p);
/* Blocks the pool could hold at attach within kvd's memory budget (AttachPoolReply's
 * max_segments * blocks_per_segment): what to size the engine's own structures for. It moves
 * with the budget (Stats pool.blocks_total says what the pool has now). */
KVC_EXTERN uint64_t kvc_pool_max_blocks(const kvc_pool *p);
/* 1 when kvd reported another pool of the same model_id with a different layout (a second
 * attach with 8 instead of 32 KV heads, bf16 instead of fp16: usually a bug; logged at WARN).
 * kvd's strict-layouts option refuses such an attach instead (KV_EINVAL). */
KVC_EXTERN int kvc_pool_layout_conflict(const kvc_pool *p);
/* Segment slots mapped so far (the highest mapped index + 1). */
KVC_EXTERN uint32_t kvc_pool_segments(const kvc_pool *p);
/* 1 once the session the pool was attached in has ended: the daemon restarted (its calls then
 * return KV_EEPOCH) or the connection was lost and a new session began (KV_ECLOSED). Either way
 * every handle from the pool is void: detach and attach again. */
KVC_EXTERN int kvc_pool_stale(const kvc_pool *p);

/* Base address of segment seg's mapping (whole segment, kv_layout byte order), or NULL when
 * it is not mapped. *nblocks (if not NULL) gets its block count. */
KVC_EXTERN void *kvc_pool_segment_base(const kvc_pool *p, uint32_t seg, uint32_t *nblocks);

/* LAYER_MAJOR only: base of layer's K (kv = KV_K) or V (KV_V) tensor
 * [max_segments * blocks_per_segment][tokens][heads][dim]; block id b starts at
 * base + b * kv_block_bytes. NULL for BLOCK_MAJOR pools, for arguments out of range, and where
 * the daemon's section sizes are not page multiples (use kvc_pool_addr then). */
KVC_EXTERN void *kvc_pool_layer_base(const kvc_pool *p, uint32_t layer, int kv);

/* Address of element (token, head, 0) of layer's K or V in block (a pool-local id), through
 * the segment mapping and kv_layout's arithmetic; NULL when out of range or unmapped. */
KVC_EXTERN void *kvc_pool_addr(const kvc_pool *p, uint32_t block, uint32_t layer, int kv,
                               uint32_t token, uint32_t head);

/* Address of the float32 scale of (block, layer, kv, head) for 8-bit dtypes; NULL otherwise. */
KVC_EXTERN float *kvc_pool_scale_addr(const kvc_pool *p, uint32_t block, uint32_t layer, int kv,
                                      uint32_t head);

/* Copies every byte of blocks src[i] to dst[i] (all layers, K and V, scales) through the host
 * mapping: what an engine does with kvc_seq_fork's copy list on a host pool. Checks every pair
 * first (KV_EINVAL unmapped, KV_EPERM read-only destination: nothing copied). KV_ENOTSUP for a
 * GPU pool: copy on the device with the engine's kernel (kernels/kvk.h kvk_copy_blocks_cuda
 * takes the same two lists). */
KVC_EXTERN kv_err kvc_pool_copy_blocks(kvc_pool *p, const int32_t *src, const int32_t *dst,
                                       size_t n);

/* Where the pool's memory is: -1 for host memory (memfd; plain pointers), else the CUDA device
 * ordinal its mappings live on (addresses are device pointers, for DLPack kDLCUDA and cudaMemcpy
 * with that device current). */
KVC_EXTERN int kvc_pool_device(const kvc_pool *p);

/* 1 when the segment holding block was mapped read-only (a shared domain this tenant may only
 * read); 0 otherwise. */
KVC_EXTERN int kvc_pool_block_read_only(const kvc_pool *p, uint32_t block);

/* ---- Linked pools (shared domains) ---------------------------------------------------- */

/* kvc_pool_attach also maps the pools the daemon linked to the attached one
 * (AttachPoolReply.linked): the same model and shape in each group the tenant is a member of,
 * then the commons, in the daemon's lookup order. Each is a kvc_pool of its own, with its own
 * block ids (pool-local), segments and layer tensors: kvc_pool_id, kvc_pool_segment_base,
 * kvc_pool_layer_base, kvc_pool_addr and kvc_pool_scale_addr work on it as on the attached pool,
 * and so do kvc_release, kvc_rewind, kvc_pin, kvc_allocate and kvc_commit (the daemon refuses
 * the last three with KV_EPERM in a read-only pool, the commons). The commons is mapped
 * PROT_READ from a read-only fd: writing to it faults and it cannot be mprotect()ed writable.
 * Segments a linked pool grows later are mapped before a call that returns one of their blocks
 * returns. A linked pool belongs to the pool that linked it: kvc_pool_detach of the attached
 * pool frees it too, and kvc_pool_detach of a linked pool does nothing. Threads: the
 * connection's. */

/* Linked pools of p (0 for a linked pool or without groups and commons), and the i-th of them
 * (NULL when i >= kvc_pool_nlinked). */
KVC_EXTERN uint32_t kvc_pool_nlinked(const kvc_pool *p);
KVC_EXTERN kvc_pool *kvc_pool_linked(const kvc_pool *p, uint32_t i);

/* The attached pool a linked pool belongs to; p itself for an attached pool. */
KVC_EXTERN kvc_pool *kvc_pool_owner(const kvc_pool *p);

/* The pool with daemon id pool_id among p's owner and its linked pools, or NULL. */
KVC_EXTERN kvc_pool *kvc_pool_find(const kvc_pool *p, uint32_t pool_id);

/* The pool's domain: "group:NAME", "commons", or (the attached pool) the tenant's name. Valid
 * while the pool is. */
KVC_EXTERN const char *kvc_pool_domain(const kvc_pool *p);

/* 1 when the session may only read the pool (the commons), else 0. */
KVC_EXTERN int kvc_pool_read_only(const kvc_pool *p);

/* ---- Block hashes --------------------------------------------------------------------- */

/* The pool's hash seed and algorithm (kv_hash_algo). */
KVC_EXTERN kv_hash128 kvc_pool_hash_seed(const kvc_pool *p);
KVC_EXTERN int kvc_pool_hash_algo(const kvc_pool *p);

/* Hashes the full blocks of tokens[0..ntokens) with the pool's seed and algorithm, as
 * PROTOCOL.md specifies: floor(ntokens / tokens_per_block) hashes, at most max_out, go to
 * out; *nout gets the count. extra (NULL, 0 for none) is mixed into every block.
 * KV_EINVAL for extra longer than KV_HASH_MAX_EXTRA. */
KVC_EXTERN kv_err kvc_pool_hash_tokens(const kvc_pool *p, const void *extra, size_t extra_len,
                                       const uint32_t *tokens, size_t ntokens, kv_hash128 *out,
                                       size_t max_out, size_t *nout);

/* Hashes one more block after parent (the previous block's hash; pass kvc_pool_hash_seed for
 * the first), for engines that extend a chain token block by token block. */
KVC_EXTERN kv_err kvc_pool_hash_next(const kvc_pool *p, kv_hash128 parent, const void *extra,
                                     size_t extra_len, const uint32_t *tokens, kv_hash128 *out);

/* Pools whose kvc_pool_hash_algo is KVC_HASH_VLLM (the daemon's hash-mode vllm, docs/HASH.md)
 * hash as vLLM's sha256_cbor: the chain runs over 32-byte digests, and a block's key (what
 * Lookup and Commit name it by, kvc_pool_hash_tokens' output) is its digest's first 16 bytes.
 * kvc_pool_hash_next cannot extend such a chain from a key (KV_ENOTSUP): use the calls below,
 * and commit with kvc_commit_ex, which sends each block's digest. extra is none or one UTF-8
 * key without NUL of at most 256 bytes (a LoRA name or cache salt, vLLM's extra_keys of one
 * string). KV_ENOTSUP on other pools. */
#define KVC_HASH_VLLM 3
/* The chain's start: vLLM's NONE_HASH (from the daemon's vllm-hash-seed). */
KVC_EXTERN kv_err kvc_pool_vllm_none_hash(const kvc_pool *p, uint8_t out[32]);
/* Digests of the full blocks of tokens[0..ntokens), at most max_out, into full; *nout the count. */
KVC_EXTERN kv_err kvc_pool_vllm_hash_tokens(const kvc_pool *p, const void *extra, size_t extra_len,
                                            const uint32_t *tokens, size_t ntokens,
                                            uint8_t (*full)[32], size_t max_out, size_t *nout);
/* One more block's digest after parent (a 32-byte digest; NULL for the chain's first block). */
KVC_EXTERN kv_err kvc_pool_vllm_hash_next(const kvc_pool *p, const uint8_t *parent,
                                          const void *extra, size_t extra_len,
                                          const uint32_t *tokens, uint8_t out[32]);

/* ---- Synchronous block calls (one round trip each) ------------------------------------ */

/* Finds the longest cached prefix of hashes[0..n): *nhit leading blocks are cached and out[0..
 * *nhit) get handles, each referenced by this session (release them). out has room for n. */
KVC_EXTERN kv_err kvc_lookup(kvc_pool *p, const kv_hash128 *hashes, size_t n, kvc_block *out,
                             size_t *nhit);

/* kvc_lookup that also searches p's linked pools (Lookup.search_domains): each position of the
 * prefix takes the first of (p, groups in order, commons) that has it, so one prefix may mix
 * pools. pools[i] (room for n; not NULL) gets the pool block out[i] lives in: p or one of its
 * linked pools. Use that pool for the block's addresses and to release it (kvc_release_multi).
 * Errors as kvc_lookup; KV_EINVAL for pools NULL. */
KVC_EXTERN kv_err kvc_lookup_domains(kvc_pool *p, const kv_hash128 *hashes, size_t n,
                                     kvc_block *out, kvc_pool **pools, size_t *nhit);

/* ---- Lower tiers (docs/TIERS.md; PROTOCOL.md §6 Fetch) ---------------------------------- */

/* How far a prefix continues below the pool's own memory (T0) after the hits of a lookup: the
 * daemon's tier 1 (host memory) and tier 2 (disk). All zero from a daemon without lower tiers
 * (kvc_conn_has_tiers says which). */
typedef struct kvc_tier_hits {
    uint32_t fetchable; /* blocks after the hits that kvc_fetch could bring into T0 */
    uint32_t t1;        /* of them, blocks in tier 1 */
    uint32_t t2;        /* of them, blocks only in tier 2 */
} kvc_tier_hits;

/* 1 when the daemon has lower tiers (HelloReply.features TIERS), else 0. */
KVC_EXTERN int kvc_conn_has_tiers(const kvc_conn *c);

/* kvc_lookup that also reports the run below T0 in *tiers (not NULL). */
KVC_EXTERN kv_err kvc_lookup_tiers(kvc_pool *p, const kv_hash128 *hashes, size_t n, kvc_block *out,
                                   size_t *nhit, kvc_tier_hits *tiers);

/* What the daemon's remote tier (its remote-redis, shared by nodes) holds of a prefix past its
 * local tiers. */
typedef struct kvc_remote_hits {
    uint32_t blocks; /* leading blocks after the local run (the hits, then tiers->fetchable)
                        that Redis holds: kvc_fetch brings them (it checks each value; one that
                        fails a check ends its run there) */
    kv_err failure;  /* KV_OK: Redis answered for every key asked; KV_ESYS: Redis down or too
                        slow (blocks may be short); KV_EPERM: the pool is read-only for this
                        tenant; KV_EBUSY: too many of this session's replies are still to come;
                        KV_ENOTSUP: this pool has no lower tiers; KV_ENOMEM; KV_ECLOSED: the
                        daemon stops. blocks is 0 unless KV_OK or KV_ESYS. Not capped by the
                        tenant's max-held (a fetch is) */
} kvc_remote_hits;

/* 1 when the daemon has a remote tier (HelloReply.features REMOTE), else 0. */
KVC_EXTERN int kvc_conn_has_remote(const kvc_conn *c);

/* kvc_lookup_tiers that also asks the daemon's remote tier (Lookup.remote) how far the prefix
 * goes on there: *remote (not NULL) gets it. Redis is asked only when the local run ends before
 * n, and then the call takes a round trip to Redis more (at most the daemon's
 * remote-timeout-ms): ask where a prefix missing locally would be recomputed otherwise. The
 * hits are referenced as kvc_lookup's. KV_ENOTSUP (nothing sent) when the daemon has no remote
 * tier (kvc_conn_has_remote); other errors as kvc_lookup. */
KVC_EXTERN kv_err kvc_lookup_remote(kvc_pool *p, const kv_hash128 *hashes, size_t n, kvc_block *out,
                                    size_t *nhit, kvc_tier_hits *tiers, kvc_remote_hits *remote);

#define KVC_FETCH_DONE 0    /* every block of the run below T0 is in T0 now */
#define KVC_FETCH_SHORT 1   /* the run below T0 was under min_tokens: only the T0 hits */
#define KVC_FETCH_PARTIAL 2 /* the run ends early (failure says why); the blocks are good */

/* What a fetch did. */
typedef struct kvc_fetch_result {
    size_t nblocks;     /* blocks in out: the prefix in T0 now, from its first block */
    uint32_t t0_hits;   /* of them, blocks that were in T0 already */
    uint32_t promoted;  /* of them, blocks copied up from tier 1 or 2 for this call */
    uint32_t lower_run; /* blocks after the T0 hits found below T0 (what was asked up) */
    int status;         /* KVC_FETCH_* */
    kv_err failure;     /* KVC_FETCH_PARTIAL: why (KV_ENOSPC, KV_EQUOTA, KV_ECORRUPT, ...) */
} kvc_fetch_result;

/* Brings the prefix hashes[0..n) into T0 from the lower tiers and returns it as a lookup does:
 * out[0..res->nblocks) (room for n) are the prefix's blocks from its first, each referenced by
 * this session (release them). Blocks below T0 are copied up by the daemon's copy threads only
 * when their run is at least min_tokens tokens (0: the daemon's fetch-min-tokens, default 256);
 * otherwise res->status is KVC_FETCH_SHORT and out holds only the T0 hits: recompute the rest.
 * The call returns when the bytes are in place. A daemon without lower tiers answers as a
 * lookup. Errors as kvc_lookup (a FETCH_PARTIAL is not an error: res says why). In a batch, a
 * fetch's reply may come after the replies to later requests; kvc_batch_wait matches them. */
KVC_EXTERN kv_err kvc_fetch(kvc_pool *p, const kv_hash128 *hashes, size_t n, uint32_t min_tokens,
                            kvc_block *out, kvc_fetch_result *res);

/* Leases count blocks in WRITING state to this session (all or none): out[0..count). The
 * daemon evicts cached blocks when needed; KV_ENOSPC when it cannot. New segments the daemon
 * grew are mapped before this returns. */
KVC_EXTERN kv_err kvc_allocate(kvc_pool *p, uint32_t count, kvc_block *out);

/* Page summaries (IceCache) of the blocks of hashes[0..n) in this pool (attached with
 * KVC_ATTACH_SUMMARIES), wherever they are (T0 or a lower tier): out (room for n *
 * KVK_SUMMARY_FLOATS(layers, kv_heads, head_dim) floats, kernels/kvk.h) gets hash i's summary
 * at i * that many floats: per (layer, KV head) the per-channel min, max and mean of its keys,
 * computed by the daemon from the committed bytes; found[i] (may be NULL) 1 when the pool has the
 * hash, else 0 (its summary left untouched). Only this pool is searched: another domain's blocks
 * are never visible. Long lists go as several requests, each reply within the daemon's frame
 * limit. KV_ENOTSUP for a pool attached without the flag; KV_ETOOBIG when one summary alone
 * exceeds the frame limit; transport errors. */
KVC_EXTERN kv_err kvc_summaries(kvc_pool *p, const kv_hash128 *hashes, size_t n, float *out,
                                uint8_t *found);

/* Private blocks (Zipage's compressed KV, any KV without a prefix identity): WRITING blocks
 * the session keeps for a sequence's life and can never commit (kvc_commit: KV_EPERM). They
 * count in the tenant's max-held and go back with kvc_release or when the session ends, like
 * any lease. KV_ENOTSUP from a daemon without them (kvc_conn_has_private). */
KVC_EXTERN kv_err kvc_allocate_private(kvc_pool *p, uint32_t count, kvc_block *out);

/* 1 when the daemon has private blocks and Unshare (HelloReply.features PRIVATE), else 0. */
KVC_EXTERN int kvc_conn_has_private(const kvc_conn *c);

/* Turns committed blocks[0..n) that this session alone holds (one reference, its own) back into
 * private blocks it may write: they leave the shared index first, so no other worker can find
 * them. All or nothing. KV_EBUSY when another session holds one, a lower tier is copying it,
 * it is pinned or other committed blocks continue its prefix (the message says which): copy
 * such a block into a fresh private block instead. KV_ESTATE for a block that is not
 * COMMITTED. */
KVC_EXTERN kv_err kvc_unshare(kvc_pool *p, const kvc_block *blocks, size_t n);

/* One block to commit: written, full and verified, with its chain hash and parent block id. */
typedef struct kvc_commit_entry {
    kvc_block block; /* a WRITING block leased to this session */
    kv_hash128 hash; /* its block hash (kvc_pool_hash_tokens) */
    uint32_t parent; /* the previous block's id in the sequence, or KVC_NO_PARENT */
} kvc_commit_entry;

#define KVC_NO_PARENT UINT32_MAX

/* Commits entries[0..n): each becomes immutable and indexed. canonical[i] (room for n) gets the
 * block that now holds the session's reference: the same block, or an already cached block
 * with the same hash (this one was then freed; use the canonical one from now on). Errors:
 * KV_ENOENT, KV_ESTALE, KV_ESTATE (not WRITING), KV_EPERM (another session's lease). */
KVC_EXTERN kv_err kvc_commit(kvc_pool *p, const kvc_commit_entry *entries, size_t n,
                             kvc_block *canonical);

/* kvc_commit with what the daemon's KV events publish (docs/EVENTS.md): full[i] is the 32-byte
 * vLLM digest of entries[i] (required on a KVC_HASH_VLLM pool, whose Commit is KV_EINVAL
 * without it; NULL on others); parent_full (NULL: none) the digest of entries[0]'s parent when
 * that block is not in this pool (a group or commons hit: the event names it as the parent);
 * tokens (NULL: none) holds n * tokens_per_block token ids, entry i's at i * tokens_per_block,
 * which BlockStored events carry where the operator opted in. */
KVC_EXTERN kv_err kvc_commit_ex(kvc_pool *p, const kvc_commit_entry *entries, size_t n,
                                const uint8_t (*full)[32], const uint8_t *parent_full,
                                const uint32_t *tokens, kvc_block *canonical);

/* Drops the session's references on blocks[0..n) (a sequence's blocks in prefix order; WRITING
 * blocks are freed). kvc_rewind is the same for blocks past a sequence's accepted length
 * (speculative decoding), counted apart by the daemon (Stats pool.rewinds). Never write into a
 * block after releasing it: a committed block is another worker's next hit (kvd
 * --verify-blocks catches such writes; docs/CLIENT.md). */
KVC_EXTERN kv_err kvc_release(kvc_pool *p, const kvc_block *blocks, size_t n);
KVC_EXTERN kv_err kvc_rewind(kvc_pool *p, const kvc_block *blocks, size_t n);

/* kvc_release without the wait: checks what kvc_release checks here (the pool, the list's size
 * and NULLs), encodes the Release and returns; nothing is sent yet. The frame goes out ahead of
 * the connection's next call, in the same write (a synchronous call carries it with no round
 * trip of its own; kvc_batch_send sends queued ones first in one round trip), or with
 * kvc_flush. The daemon handles a connection's requests in order, so the next call sees the
 * blocks released (a quota it frees counts for that call); other sessions see it when that call
 * or kvc_flush runs. At most 64 are queued: the 65th sends the queued ones first (while a batch is
 * in flight they cannot go out, and queue beyond 64 until it is done). A refusal
 * (KV_ESTALE, KV_EPERM, ...) is logged (KVC-RELEASE-DEFERRED), counted
 * (kvc_conn_deferred_failures) and returned by the next kvc_flush; a lost connection drops the
 * queued ones, and nothing leaks: the session's end released every block it held. The same
 * rules as kvc_release: never touch a block after releasing it. */
KVC_EXTERN kv_err kvc_release_deferred(kvc_pool *p, const kvc_block *blocks, size_t n);

/* Sends the deferred Releases now and waits for their replies; returns the first refusal of a
 * deferred Release since the last kvc_flush (then forgets it), or a transport error. */
KVC_EXTERN kv_err kvc_flush(kvc_conn *c);

/* Deferred Releases queued and not sent; deferred Releases the daemon refused, all told. */
KVC_EXTERN size_t kvc_conn_deferred_pending(kvc_conn *c);
KVC_EXTERN uint64_t kvc_conn_deferred_failures(const kvc_conn *c);

/* Pins committed blocks so they are not evicted for retention_ms (priority 0..255), or unpins
 * them (unpin = 1; retention and priority ignored). */
KVC_EXTERN kv_err kvc_pin(kvc_pool *p, const kvc_block *blocks, size_t n, uint64_t retention_ms,
                          uint8_t priority, int unpin);

/* Release, Rewind and Pin of blocks[i] in pools[i] (pools of one connection; NULL entries are
 * KV_EINVAL): one request per run of consecutive blocks in the same pool, all sent in one round
 * trip, in the given order. Returns the first failure; the other requests still ran. Pin in the
 * commons is KV_EPERM. */
KVC_EXTERN kv_err kvc_release_multi(kvc_pool *const *pools, const kvc_block *blocks, size_t n);
KVC_EXTERN kv_err kvc_rewind_multi(kvc_pool *const *pools, const kvc_block *blocks, size_t n);
KVC_EXTERN kv_err kvc_pin_multi(kvc_pool *const *pools, const kvc_block *blocks, size_t n,
                                uint64_t retention_ms, uint8_t priority, int unpin);

/* ---- Batched, pipelined calls --------------------------------------------------------- */

/* A batch queues requests on one connection; kvc_batch_send writes them back to back (the
 * daemon stops reading while max_inflight replies are unsent, and the library reads replies
 * meanwhile, so a batch of any size completes), kvc_batch_wait collects the replies by id.
 * Each queued request returns its index; its own result is kvc_batch_status(b, index), and its
 * outputs (caller buffers given when queuing, which must stay valid until the wait returns) are
 * written only when that status is KV_OK. Reuse a batch with kvc_batch_reset. */

/* Allocates an empty batch for c. KV_ENOMEM. */
KVC_EXTERN kv_err kvc_batch_alloc(kvc_conn *c, kvc_batch **out);
/* Frees the batch; accepts NULL. A batch sent but not waited for makes the connection broken
 * (it reconnects on the next call). */
KVC_EXTERN void kvc_batch_free(kvc_batch *b);
/* Forgets every queued request (after wait, or before send). */
KVC_EXTERN void kvc_batch_reset(kvc_batch *b);
/* Requests queued. */
KVC_EXTERN size_t kvc_batch_count(const kvc_batch *b);

/* Queue one request; same meaning as the synchronous call. Returns KV_OK and *index (may be
 * NULL), or KV_EINVAL / KV_ETOOBIG / KV_ENOMEM / KV_EEPOCH (stale pool) without queuing. */
KVC_EXTERN kv_err kvc_batch_ping(kvc_batch *b, const void *payload, size_t len, size_t *index);
KVC_EXTERN kv_err kvc_batch_lookup(kvc_batch *b, kvc_pool *p, const kv_hash128 *hashes, size_t n,
                                   kvc_block *out, size_t *nhit, size_t *index);
KVC_EXTERN kv_err kvc_batch_lookup_domains(kvc_batch *b, kvc_pool *p, const kv_hash128 *hashes,
                                           size_t n, kvc_block *out, kvc_pool **pools, size_t *nhit,
                                           size_t *index);
KVC_EXTERN kv_err kvc_batch_fetch(kvc_batch *b, kvc_pool *p, const kv_hash128 *hashes, size_t n,
                                  uint32_t min_tokens, kvc_block *out, kvc_fetch_result *res,
                                  size_t *index);
/* count lookups (or releases) of one pool in one call, for bindings where a call per request
 * costs more than the request: lookup i reads the n[i] hashes at hashes[i] into out[i] (room
 * for n[i]) and its hit count into nhit[i]; release i the n[i] blocks at blocks[i]. They get
 * consecutive indexes from *first (when first is not NULL). All or nothing: the first request
 * that cannot be queued (the errors of kvc_batch_lookup / kvc_batch_release) fails the call and
 * none of the count stays queued. */
KVC_EXTERN kv_err kvc_batch_lookup_many(kvc_batch *b, kvc_pool *p, const kv_hash128 *const *hashes,
                                        const size_t *n, kvc_block *const *out, size_t *nhit,
                                        size_t count, size_t *first);
KVC_EXTERN kv_err kvc_batch_release_many(kvc_batch *b, kvc_pool *p, const kvc_block *const *blocks,
                                         const size_t *n, size_t count, size_t *first);
KVC_EXTERN kv_err kvc_batch_allocate(kvc_batch *b, kvc_pool *p, uint32_t count, kvc_block *out,
                                     size_t *index);
KVC_EXTERN kv_err kvc_batch_commit(kvc_batch *b, kvc_pool *p, const kvc_commit_entry *entries,
                                   size_t n, kvc_block *canonical, size_t *index);
/* kvc_commit_ex in a batch (the digests, parent digest and tokens are encoded at once). */
KVC_EXTERN kv_err kvc_batch_commit_ex(kvc_batch *b, kvc_pool *p, const kvc_commit_entry *entries,
                                      size_t n, const uint8_t (*full)[32],
                                      const uint8_t *parent_full, const uint32_t *tokens,
                                      kvc_block *canonical, size_t *index);
KVC_EXTERN kv_err kvc_batch_release(kvc_batch *b, kvc_pool *p, const kvc_block *blocks, size_t n,
                                    size_t *index);
KVC_EXTERN kv_err kvc_batch_rewind(kvc_batch *b, kvc_pool *p, const kvc_block *blocks, size_t n,
                                   size_t *index);

/* Sends every queued request not yet sent. When the daemon's in-flight limit is reached it
 * reads replies while sending. Transport errors (KV_ECLOSED, KV_ETIMEDOUT, KV_EPROTO,
 * KV_EEPOCH) fail the whole batch. */
KVC_EXTERN kv_err kvc_batch_send(kvc_batch *b);

/* Waits until every sent request has its reply (mapping new segments where a reply says the
 * pool grew). Returns KV_OK when the transport worked, even if some requests failed: check
 * kvc_batch_status. Transport errors as for send. */
KVC_EXTERN kv_err kvc_batch_wait(kvc_batch *b);

/* kvc_batch_send then kvc_batch_wait. */
KVC_EXTERN kv_err kvc_batch_run(kvc_batch *b);

/* The result of request index (KV_EINVAL for an index never queued). */
KVC_EXTERN kv_err kvc_batch_status(const kvc_batch *b, size_t index);

/* KV_OK when every queued request succeeded; else the status of the first that did not (KV_ESTATE
 * for one not completed) and *index (if not NULL) its index: one call instead of a status per
 * request. */
KVC_EXTERN kv_err kvc_batch_first_error(const kvc_batch *b, size_t *index);

/* ---- Sequences ------------------------------------------------------------------------ */

/* A sequence's tokens and the blocks that hold their K/V, for an engine:
 *   kvc_seq_prefill(prompt)  lookup of the cached prefix (at most n-1 tokens, so the last
 *                            prompt token is always computed) + allocation of the rest;
 *   the engine writes K/V of tokens [cached, n) at kvc_seq_block / kvc_pool_addr;
 *   kvc_seq_append(tokens)   decode or draft tokens, blocks allocated as needed;
 *   kvc_seq_commit(n_final)  commits every full block inside [0, n_final): the caller passes
 *                            only tokens whose K/V are written and verified, never drafts;
 *   kvc_seq_rewind(n)        drops tokens past n (rejected drafts);
 *   kvc_seq_release()        drops all blocks (the sequence can be prefilled again).
 * One thread at a time, like its connection.
 *
 * Reserved blocks: a sequence may hold WRITING blocks past its length, taken first when it
 * grows: kvc_seq_reserve(s, n) keeps blocks for n tokens at all times (admission control: a
 * running sequence cannot be starved by other workers between steps; vLLM's
 * full_sequence_must_fit), kvc_seq_set_lookahead(s, k) keeps k slots past the length
 * (speculative decoding's draft tokens: export their slots with kvc_seq_export_slots before
 * the tokens exist, append the drafts, commit only the verified length, rewind the rest; the
 * rewound blocks stay held for the next step). kvc_seq_append_many grows every sequence of a
 * scheduler step with one round trip.
 *
 * Shared domains: by default a sequence stays in its own pool (one page table always). With
 * kvc_seq_set_search_domains(s, 1), prefill also searches every domain the session may read
 * (the attached pool, then its linked group pools, then the commons), so leading blocks of the
 * table may live in linked pools (kvc_seq_block_pool); blocks allocated by the sequence are
 * always in the attached pool. Block ids are pool-local and pools do not share an id space, so
 * a table that mixes pools cannot be one page table: kvc_seq_export_csr refuses it
 * (KV_ENOTSUP) and kvc_seq_export_csr_pool exports one table per pool, whose attention results
 * the engine merges (log-sum-exp, e.g. FlashInfer merge_state).
 *
 * A sequence belongs to its pool: when the pool is detached (or its connection closed) the
 * sequence becomes an empty shell whose calls return KV_ESTATE; free it with kvc_seq_free. */

/* Allocates a sequence on pool p holding up to max_tokens tokens; extra (NULL, 0 for none; at
 * most KV_HASH_MAX_EXTRA bytes, copied) is mixed into every block hash (LoRA id, ...). */
KVC_EXTERN kv_err kvc_seq_alloc(kvc_pool *p, size_t max_tokens, const void *extra, size_t extra_len,
                                kvc_seq **out);

/* Whether the next prefills search the linked pools too (on = 1) or the attached pool only
 * (on = 0, the default). Takes effect at the next kvc_seq_prefill. */
KVC_EXTERN void kvc_seq_set_search_domains(kvc_seq *s, int on);

/* Releases the sequence's blocks (best effort) and frees it; accepts NULL. */
KVC_EXTERN void kvc_seq_free(kvc_seq *s);

/* Starts an empty sequence with prompt tokens[0..n) (n >= 1): looks up the cached prefix of
 * its first n-1 tokens and allocates blocks for the rest. With a daemon that has lower tiers
 * (kvc_conn_has_tiers) and no search of linked pools, the lookup is a kvc_fetch: blocks below T0
 * come back when their run reaches the daemon's fetch-min-tokens, else they are recomputed
 * (kvc_seq_promoted counts them). *cached_tokens gets how many leading
 * tokens already have K/V (a multiple of tokens_per_block). KV_ESTATE when the sequence is not
 * empty, KV_ETOOBIG beyond max_tokens, KV_ENOSPC when the pool cannot supply the blocks (the
 * looked-up prefix is released again then). */
KVC_EXTERN kv_err kvc_seq_prefill(kvc_seq *s, const uint32_t *tokens, size_t n,
                                  size_t *cached_tokens);

/* Appends tokens[0..n) and allocates the blocks they need. KV_ETOOBIG beyond max_tokens. */
KVC_EXTERN kv_err kvc_seq_append(kvc_seq *s, const uint32_t *tokens, size_t n);

/* Commits every not yet committed full block inside tokens [0, n_final) (n_final <= length):
 * their K/V must be written and final. Blocks the daemon already had are swapped for the
 * cached copy (same bytes). *ncommitted (may be NULL) gets the blocks committed by this call. */
KVC_EXTERN kv_err kvc_seq_commit(kvc_seq *s, size_t n_final, size_t *ncommitted);

/* Truncates the sequence to n tokens (n <= length): blocks wholly past n are given back with
 * Rewind. If n falls inside a committed block (immutable), that block is given back too and a
 * fresh one allocated in its place; *valid_tokens (may be NULL) gets the tokens whose K/V are
 * still in the table: n, or the start of that block (recompute from there). */
KVC_EXTERN kv_err kvc_seq_rewind(kvc_seq *s, size_t n, size_t *valid_tokens);

/* Releases every block, reserved ones included, and ends its reservation; the sequence is
 * empty afterwards (even on a transport error). */
KVC_EXTERN kv_err kvc_seq_release(kvc_seq *s);

/* Keeps blocks for ntokens tokens held from now on (allocating what is missing; 0 ends the
 * reservation and gives back reserved blocks past the length). KV_ETOOBIG beyond max_tokens,
 * KV_ENOSPC (nothing changed). */
KVC_EXTERN kv_err kvc_seq_reserve(kvc_seq *s, size_t ntokens);

/* Keeps ntokens slots held past the length from now on (draft tokens of speculative
 * decoding), allocating what is missing now and at each growth. KV_ENOSPC (nothing changed). */
KVC_EXTERN kv_err kvc_seq_set_lookahead(kvc_seq *s, size_t ntokens);

/* Tokens the held blocks have room for (length + what can be appended without a round trip). */
KVC_EXTERN size_t kvc_seq_capacity(const kvc_seq *s);

/* One scheduler step: appends tokens[i][0..counts[i]) to seqs[i] for every i, allocating the
 * blocks all of them need (with their lookahead and reservation) in one round trip per
 * connection (one Allocate per pool, sent back to back). status[i] (status may be NULL) gets
 * each sequence's result; a sequence whose pool could not supply every block it and the other
 * sequences of that pool needed gets that pool's error (KV_ENOSPC) and is unchanged, as is one
 * that would exceed its max_tokens (KV_ETOOBIG). Returns the first failure, KV_OK when all
 * succeeded. */
KVC_EXTERN kv_err kvc_seq_append_many(kvc_seq *const *seqs, size_t nseqs,
                                      const uint32_t *const *tokens, const size_t *counts,
                                      kv_err *status);

/* Fork (parallel sampling, beam search): *out gets a new sequence with src's tokens whose
 * committed blocks are src's own, shared (one more reference each, taken with one Lookup:
 * PagedAttention's copy-on-write), and whose other blocks (full ones not committed yet and the
 * partial last one) are fresh leases that the caller fills by copying: copy_src[j] -> copy_dst[j]
 * for j < *ncopies (block ids of src's pool; vLLM's blocks_to_copy) before the engine writes
 * into the fork or reads it. The fork keeps src's lookahead and search_domains, not its
 * reservation. One or two round trips; nothing is made on error: KV_ETOOBIG when max_copies is
 * below the blocks to copy (needed: kvc_seq_nblocks - kvc_seq_ncommitted), KV_ENOSPC, KV_ESTATE
 * (detached, or a committed block the daemon quarantined). Commit the shared prefix before
 * forking to copy the least. */
KVC_EXTERN kv_err kvc_seq_fork(kvc_seq *src, kvc_seq **out, int32_t *copy_src, int32_t *copy_dst,
                               size_t max_copies, size_t *ncopies);

/* ---- Zipage: a fixed block budget per sequence, kept by compaction ----
 * kvc_seq_set_block_budget(s, n) caps the blocks s holds at n (0: no cap, the default): an
 * append that would need more fails with KV_EQUOTA and changes nothing, reserved and lookahead
 * blocks are capped too. The engine then compacts: it chooses the tokens to keep, allocates
 * fresh private blocks (kvc_allocate_private, ceil(nkept / tokens_per_block) of them), gathers
 * the kept tokens' K/V rows into them (kvk_compact_tokens_cpu), and calls kvc_seq_compact, which
 * releases every block the sequence held (blocks shared with other sequences are only
 * de-referenced: nothing shared is ever written) and makes the fresh blocks its table. A
 * compressed sequence publishes nothing (kvc_seq_commit commits 0 blocks), grows with private
 * blocks, cannot be forked (KV_ENOTSUP), and its next token's RoPE position is
 * kvc_seq_position (tokens appended in all), no longer its length (KV rows held).
 * kvc_seq_release makes it an ordinary empty sequence again. */
KVC_EXTERN kv_err kvc_seq_set_block_budget(kvc_seq *s, size_t nblocks);
KVC_EXTERN size_t kvc_seq_block_budget(const kvc_seq *s);
/* kept[0..nkept): the kept tokens' ids in their new slot order; fresh[0..nfresh): the private
 * blocks holding their K/V, nfresh = ceil(nkept / tokens_per_block). KV_EINVAL for counts that
 * do not match, KV_EQUOTA for more blocks than the budget; a transport error from the release
 * is returned after the table was replaced. */
KVC_EXTERN kv_err kvc_seq_compact(kvc_seq *s, const uint32_t *kept, size_t nkept,
                                  const kvc_block *fresh, size_t nfresh);
/* Makes an empty sequence a compressed one again (a preempted compressed sequence swapped back
 * in): fresh[0..nfresh) are private blocks the caller filled with the K/V of tokens[0..ntokens),
 * and position is the next token's position (>= ntokens). KV_ESTATE when s is not empty,
 * KV_EINVAL for counts that do not match, KV_EQUOTA above the budget. No round trip. */
KVC_EXTERN kv_err kvc_seq_adopt(kvc_seq *s, const uint32_t *tokens, size_t ntokens, size_t position,
                                const kvc_block *fresh, size_t nfresh);
/* 1 once kvc_seq_compact ran (until kvc_seq_release), else 0. */
KVC_EXTERN int kvc_seq_compressed(const kvc_seq *s);
/* Tokens appended in all (the next token's position): kvc_seq_length plus the tokens
 * compaction dropped. */
KVC_EXTERN size_t kvc_seq_position(const kvc_seq *s);

/* Tokens, blocks (ceil(length / tokens_per_block)), committed blocks, and block i's handle:
 * valid for every held block, i < kvc_seq_capacity / tokens_per_block, so the blocks of a
 * reservation or of lookahead slots past the length are addressable too (draft K/V is
 * written there before the drafts are appended); {UINT32_MAX, 0} past that. */
KVC_EXTERN size_t kvc_seq_length(const kvc_seq *s);
KVC_EXTERN size_t kvc_seq_nblocks(const kvc_seq *s);
KVC_EXTERN size_t kvc_seq_ncommitted(const kvc_seq *s);
KVC_EXTERN kvc_block kvc_seq_block(const kvc_seq *s, size_t i);

/* Blocks this sequence's prefills got from the daemon's lower tiers (copied up by a fetch) over
 * its life. */
KVC_EXTERN size_t kvc_seq_promoted(const kvc_seq *s);

/* The pool block i lives in (the sequence's pool or one of its linked pools; NULL past the held
 * blocks), and 1 when the table has blocks in more than one pool. */
KVC_EXTERN kvc_pool *kvc_seq_block_pool(const kvc_seq *s, size_t i);
KVC_EXTERN int kvc_seq_mixed(const kvc_seq *s);

/* Exports the block tables of seqs[0..nseqs) in FlashInfer's paged-KV CSR form: indptr[nseqs+1]
 * (indptr[0] = 0), indices[indptr[nseqs]] (block ids, each sequence's in order) and
 * last_page_len[nseqs] (tokens in each sequence's last block; 0 for an empty sequence), into
 * caller buffers of the given capacities. KV_ETOOBIG when a buffer is too small (nothing
 * meaningful written then); *nindices (may be NULL) gets the index count. */
KVC_EXTERN kv_err kvc_seq_export_csr(kvc_seq *const *seqs, size_t nseqs, int32_t *indptr,
                                     size_t indptr_cap, int32_t *indices, size_t indices_cap,
                                     int32_t *last_page_len, size_t last_cap, size_t *nindices);
/* (kvc_seq_export_csr: KV_ENOTSUP when a sequence's blocks are not all in one pool.) */

/* The slot of each token in [from, to) of s: block id * tokens_per_block + offset, the index
 * vLLM's reshape_and_cache writes K/V at; to may reach past the length into held blocks
 * (lookahead slots of draft tokens). Into slots[cap] (a fixed buffer: CUDA-graph stable).
 * KV_EINVAL past the held blocks, KV_ETOOBIG when cap is short, KV_ENOTSUP for a token whose
 * block is in a linked pool (a cached prefix: it has no slot to write). */
KVC_EXTERN kv_err kvc_seq_export_slots(const kvc_seq *s, size_t from, size_t to, int64_t *slots,
                                       size_t cap);

/* The block tables of seqs as one padded 2-D table, row i = seqs[i]'s block ids then pad, into
 * table[nseqs * width] (a fixed buffer). *max_used (may be NULL) gets the longest row.
 * KV_ETOOBIG when a sequence has more than width blocks, KV_ENOTSUP for a table in several
 * pools (as kvc_seq_export_csr). */
KVC_EXTERN kv_err kvc_seq_export_table(kvc_seq *const *seqs, size_t nseqs, int32_t *table,
                                       size_t width, int32_t pad, size_t *max_used);

/* The block table restricted to pool: for each sequence, its blocks that live in pool, in
 * table order (ids index pool's layer tensors), with last_page_len[i] the tokens in the last of
 * them (a full block unless it is the sequence's last block; 0 when none is in pool). Running
 * attention over each pool's table and merging the partial results by log-sum-exp gives the
 * attention over the whole sequence. Buffers and errors as kvc_seq_export_csr. */
KVC_EXTERN kv_err kvc_seq_export_csr_pool(kvc_seq *const *seqs, size_t nseqs, const kvc_pool *pool,
                                          int32_t *indptr, size_t indptr_cap, int32_t *indices,
                                          size_t indices_cap, int32_t *last_page_len,
                                          size_t last_cap, size_t *nindices);

#ifdef __cplusplus
}
#endif

#endif
