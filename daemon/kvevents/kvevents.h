/* kvd_kvevents: KV events in vLLM's format (docs/EVENTS.md), so that a cluster router built for
 * vLLM (NVIDIA Dynamo's KV router, llm-d's KV-cache indexer) sees which prefixes this node holds.
 *
 * A publisher is one ZMQ PUB socket (and optionally one ROUTER answering replays) that carries
 * some domains: one per tenants-file `events` line (its domains only), and the daemon options'
 * (kv-events-endpoint) for every domain no line names. A domain no publisher carries publishes
 * nothing. Each publisher numbers its batches 0, 1, ... (vLLM's sequence) and keeps the last
 * `buffer` of them (and at most KVD_KVEVENTS_RING_BYTES) for replay.
 *
 * A publisher is one vLLM worker to its router: a set of block hashes. Several pools may feed
 * it (a tenant's private pool and its groups' on the default publisher; two models whose hashes
 * meet in hash-mode vllm), so it counts, per hash, the T0 blocks of its pools that hold it:
 * BlockStored goes out when the count leaves 0, BlockRemoved when it returns to 0.
 *
 * Messages are vLLM's: multipart [topic, seq (8 bytes big-endian), payload], payload the msgpack
 * of the array-like batch [ts, [event...], data_parallel_rank = 0] whose events are vLLM's tagged
 * structs, array-like (kv-events-format array, vLLM up to its map switch):
 *   ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
 *    lora_name]
 *   ["BlockRemoved", block_hashes, medium]
 *   ["AllBlocksCleared"]
 * or maps with the same fields and "type" first (kv-events-format map, vLLM's newer schema). A
 * block is named by vLLM's int form (the digest's last 8 bytes, big-endian) or by the digest's
 * bytes (hash-form): in hash-mode vllm the 32-byte sha256_cbor digest the Commit carried, else
 * kvd's 16-byte key. token_ids is empty unless the publisher opted in (token-ids). The events of
 * kv-events-flush-ms (a timer armed by a batch's first event; 0: of one loop iteration, a
 * uv_check handle) go out as one batch, so a Commit's events are never split. Every publisher's
 * first batch (seq 0, at start) is [AllBlocksCleared] alone: a router that knew this node's
 * previous run forgets it.
 *
 * What is published: a Commit's new canonical blocks (BlockStored, one event per chained run,
 * medium "GPU" for CUDA pools and "CPU" for host pools), every published block that leaves T0
 * (BlockRemoved: eviction, parking, quarantine, Unshare; removals in a row on one medium share
 * one event), the blocks a Fetch brings into T0,
 * the lower tiers' copies (medium "CPU" for tier 1, "DISK" for tier 2) and the remote tier's
 * writes ("REMOTE"): kvd_kvevents_tier_change; and the blocks the daemon promotes into the
 * commons (kvd_kvevents_stored on the commons pool, from the Commit handler).
 *
 * Off the request path: the Commit handler, the pools' drop hook and the tiers' event hook only
 * record what happened (copied: key, digest, token ids where the publisher sends them); the
 * records are run, in the order they came, when the flush window ends (kv-events-flush-ms after
 * its first record; flush-ms 0: at the end of the loop iteration, a uv_check handle, after every
 * I/O callback, so after the replies were written): the bookkeeping below (the advertised-hash
 * counts), the encoding and the send of the batch. With kv-events-thread on (auto: where the
 * daemon may run on two or more CPUs) they run on a thread of their own, to which the loop hands
 * the records (a pointer swap under a mutex); off, on the loop thread itself.
 * A reader of that state on the loop thread (digest_tail, stats, close) has the records so far
 * run first (handed over and waited for), so it never sees an older state.
 *
 * Nothing here blocks the loop thread but those readers: sends are non-blocking and zero-copy (a
 * batch's buffer is shared by the live send, the replay buffer and every replay, counted),
 * replays are answered from the buffer on the loop thread, at most
 * KVD_KVEVENTS_REPLAYS_PER_WAKE requests taken and 256 batches sent per wake-up (a long replay
 * goes on at the next). Every function here: loop thread only.
 */
#ifndef KVD_KVEVENTS_H
#define KVD_KVEVENTS_H

#include <stddef.h>
#include <stdint.h>

#include <uv.h>

#include "common/kv_err.h"
#include "common/kv_hash.h"
#include "common/kv_stat.h"
#include "daemon/config/config.h"
#include "daemon/registry/registry.h"
#include "daemon/tenancy/tenant.h"

#define KVD_KVEVENTS_RING_BYTES (64u << 20) /* replay buffer bytes per publisher, at most */
#define KVD_KVEVENTS_REPLAYS_PER_WAKE 16    /* replay requests answered per loop wake-up */

typedef struct kvd_kvevents kvd_kvevents;

/* Makes the publishers the options and the tenants' `events` lines ask for (nothing bound yet).
 * *out is NULL (and every call below a cheap no-op) when none is configured. medium_t0: "GPU"
 * or "CPU", what T0 is. KV_EINVAL with msg for two publishers on one endpoint, KV_ENOMEM. */
kv_err kvd_kvevents_alloc(uv_loop_t *loop, const kvd_config *cfg, const kvd_tenants *tenants,
                          const char *medium_t0, kvd_kvevents **out, char *msg, size_t len);

/* Binds every publisher's sockets (call once the daemon holds its client socket, so a second
 * daemon started by mistake never takes the first one's endpoints), starts the replay watchers
 * and the events thread (kv-events-thread), and sends each publisher's AllBlocksCleared first
 * (the thread does, or this call without it). KV_ESYS with msg when an endpoint cannot be bound
 * or the thread cannot start. */
kv_err kvd_kvevents_start(kvd_kvevents *e, char *msg, size_t len);

/* Runs and sends what is pending, ends the events thread (joined), closes the loop handles (the
 * loop runs their close callbacks) and the sockets (a PUB lingers 100 ms for its last batch).
 * Once, at stop. Accepts NULL. */
void kvd_kvevents_close(kvd_kvevents *e);

/* Frees everything; ends the thread and closes the sockets if close never ran (a daemon freed
 * without a stop started no handle then). Accepts NULL. */
void kvd_kvevents_free(kvd_kvevents *e);

/* 1 when pool p's domain is published (its events go somewhere). */
int kvd_kvevents_publishes(const kvd_kvevents *e, const kvd_reg_pool *p);

/* Pool p starts publishing its removals (the pool's KVD_DROP_HOOK_EVENTS slot) when its domain
 * is published; nothing otherwise. Idempotent. */
void kvd_kvevents_attach(kvd_kvevents *e, kvd_reg_pool *p);

/* One new canonical block of a Commit, as the handler knows it. */
typedef struct kvd_kvevent_block {
    kv_hash128 key;         /* the index key */
    const uint8_t *full;    /* hash-mode vllm: its 32-byte digest; else NULL */
    const uint32_t *tokens; /* its tokens_per_block token ids, or NULL (not sent) */
} kvd_kvevent_block;

/* Blocks b[0..n) of pool p were stored, each the parent of the next. parent: the key of the
 * first one's parent (NULL: a prefix's first block, or unknown); parent_full its digest when
 * the handler knows it (hash-mode vllm; else the publisher's own record of it, if any). Records
 * them (b and its arrays are copied; the caller may free them on return); when the records are
 * run (the flush window's end), BlockStored for the blocks this publisher did not hold yet
 * (split where a block it holds already sits in the chain) joins the batch being built. */
void kvd_kvevents_stored(kvd_kvevents *e, const kvd_reg_pool *p, const kvd_kvevent_block *b,
                         size_t n, const kv_hash128 *parent, const uint8_t *parent_full);

/* The tiers' event hook (kvd_tiers_set_event_hook; arg: the kvd_kvevents): a block of pool
 * pool_id entered (present 1) or left (0) tier `tier`:
 *   KVD_KVEV_T0: T0, by a Fetch (a block brought up from a lower tier or from Redis); its
 *     medium is the pool's (GPU / CPU), counted with the Commits' blocks;
 *   1: tier 1 (medium "CPU"; for a host pool the same medium as T0, counted with it);
 *   2: tier 2 ("DISK");
 *   KVD_KVEV_REMOTE: the remote tier (a write Redis acknowledged, the DEL of a quarantined
 *     block, or with remote-watch a value Redis expired or evicted): "REMOTE", not counted.
 * parent (NULL: none or unknown) is published only on T0's medium (vLLM's offloading connector
 * reports its copies without parent or tokens). In hash-mode vllm an event needs the block's
 * digest, which the publisher knows while some medium of it records the block (its T0 copy,
 * when it went down from there), or from tail (the digest's last 16 bytes, which a remote value
 * carries when its writer knew them, or a tier-2 record keeps): a block whose digest nobody gave
 * kvd is not published (counted as a gap). */
#define KVD_KVEV_T0 0
#define KVD_KVEV_REMOTE 3
void kvd_kvevents_tier_change(void *arg, uint32_t pool_id, uint32_t domain, uint32_t block_size,
                              kv_hash128 hash, const kv_hash128 *parent, const uint8_t *tail,
                              int tier, int present);

/* The tiers' digest hook (kvd_tiers_set_digest_fn; arg: the kvd_kvevents): in hash-mode vllm,
 * the last 16 bytes of hash's digest as domain's publisher records it (1), else 0. */
int kvd_kvevents_digest_tail(void *arg, uint32_t domain, kv_hash128 hash, uint8_t tail[16]);

/* An event that could not be published for want of memory (the handler's): counted. */
void kvd_kvevents_gap(kvd_kvevents *e);

/* Counters over all publishers through sink (after running the records so far):
 * kv_events_publishers, kv_events_batches, kv_events_events, kv_events_send_errors, kv_events_gaps,
 * kv_events_replays, kv_events_replay_bad, kv_events_blocks (hashes advertised now). */
void kvd_kvevents_stats(kvd_kvevents *e, kvd_stat_sink sink, void *arg);
const kv_stat_desc *kvd_kvevents_stat_descs(size_t *n);

#endif
