/* kvd_config: the option table and its parsers. Adding an option means one row here, one field
 * in kvd_config and one entry in deploy/kvd.conf (config_test fails until it is there). */
#include "daemon/config/config.h"

#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "common/kv_util.h"
#include "daemon/config/conffile.h"
#include "daemon/core/pool.h"

#define OPT(name, type, field, def, min, max, desc)                                                \
    {                                                                                              \
        name, type, offsetof(kvd_config, field), sizeof(((kvd_config *)0)->field), def, min, max,  \
            desc, 0                                                                                \
    }

/* An option admin `config set` may change while kvd runs (the server reads it per request). */
#define OPT_RT(name, type, field, def, min, max, desc)                                             \
    {                                                                                              \
        name, type, offsetof(kvd_config, field), sizeof(((kvd_config *)0)->field), def, min, max,  \
            desc, 1                                                                                \
    }

static const kvd_config_option options[] = {
    OPT("socket", KVD_OPT_STRING, socket, "", 0, 0,
        "client socket path; empty: $XDG_RUNTIME_DIR/kvd/kvd.sock or /tmp/kvd-$UID/kvd.sock"),
    OPT("socket-mode", KVD_OPT_MODE, socket_mode, "0600", 0, 0777,
        "permission bits of the socket file (octal)"),
    OPT("socket-dir-mode", KVD_OPT_MODE, socket_dir_mode, "0700", 0, 0777,
        "permission bits of a socket directory kvd creates (octal)"),
    OPT("backend", KVD_OPT_STRING, backend, "auto", 0, 0,
        "segment memory: auto (a GPU backend when a GPU is usable, else host), host (memfd), "
        "cuda-vmm (cuMemCreate, fds; no hostIPC needed) or cuda-ipc (legacy cudaIpc handles)"),
    OPT("device", KVD_OPT_U64, device, "0", 0, 1023,
        "GPU backends: CUDA device ordinal of every pool (numbered as CUDA_VISIBLE_DEVICES shows)"),
    OPT("hugepages", KVD_OPT_BOOL, hugepages, "false", 0, 1,
        "host backend: back segments with huge pages (MFD_HUGETLB; needs vm.nr_hugepages)"),
    OPT("pool-memory", KVD_OPT_U64, pool_memory, "1G", 1, UINT64_MAX,
        "bytes of segment memory shared by all pools (suffix K, M, G, T)"),
    OPT("segment-bytes", KVD_OPT_U64, segment_bytes, "64M", 4096, UINT64_MAX,
        "target bytes per segment; a segment holds at least one block"),
    OPT("index-entries", KVD_OPT_U64, index_entries, "1M", 1024, 1ull << 32,
        "initial capacity of the prefix index in blocks over all pools; it grows with the pools so "
        "every block can be indexed (32 bytes a slot at load 0.7: 1M takes 64 MiB, faulted in at "
        "start up to 256 MiB of table so no request pays for it)"),
    OPT("evict-policy", KVD_OPT_STRING, evict_policy, "adaptive", 0, 0,
        "eviction order of cached blocks: adaptive (LRU over the leaves of the prefix tree, reused "
        "shared prefixes kept a round longer), lru, s3fifo or prefix-lru"),
    OPT("evict-duel", KVD_OPT_BOOL, evict_duel, "true", 0, 1,
        "adaptive: every pool runs two miniature copies of itself on half its Lookups (one after "
        "each turn of the loop), one evicting by age and one taking never-reused leaves first, and "
        "follows the one with more hits (set dueling; costs about the pool's block records "
        "again, outside pool-memory)"),
    OPT_RT("max-connections", KVD_OPT_U64, max_connections, "1024", 1, 1u << 20,
           "open client connections; more are refused with EBUSY"),
    OPT_RT("strict-layouts", KVD_OPT_BOOL, strict_layouts, "false", 0, 1,
           "refuse an AttachPool whose model id already has a pool with another layout (EINVAL); "
           "off: allow it with a warning and AttachPoolReply.layout_conflict"),
    OPT_RT("verify-blocks", KVD_OPT_BOOL, verify_blocks, "false", 0, 1,
           "debug mode: checksum every committed block and check it on each Lookup hit; a block "
           "whose bytes changed since its commit (a worker wrote after Release) is taken out of "
           "the index, logged (KVD-VERIFY) and counted (quarantines); costs a read of each block"),
    OPT_RT("max-pools", KVD_OPT_U64, max_pools, "1024", 1, 1u << 20,
           "pools (model, layout, domain) over all tenants; an attach that needs one more after "
           "idle ones are freed gets ENOSPC"),
    OPT_RT("frame-timeout-ms", KVD_OPT_U64, frame_timeout_ms, "10000", 0, 1ull << 32,
           "a client that started a request frame must complete it within this many ms, else "
           "it gets ETIMEDOUT and is disconnected; 0: no limit"),
    OPT_RT("shutdown-grace-ms", KVD_OPT_U64, shutdown_grace_ms, "10000", 0, 1ull << 32,
           "cuda-ipc backend: on SIGTERM, how long kvd waits for sessions to close before it "
           "frees memory they may still map (new sessions are refused meanwhile); 0: no wait"),
    OPT_RT("max-inflight", KVD_OPT_U64, max_inflight, "64", 1, 1u << 20,
           "unsent replies per connection before kvd stops reading it"),
    OPT_RT("max-output-bytes", KVD_OPT_U64, max_output_bytes, "8M", 4096, 1ull << 40,
           "queued reply bytes per connection before the client is disconnected"),
    OPT_RT("max-buffer-bytes", KVD_OPT_U64, max_buffer_bytes, "256M", 65536, 1ull << 40,
           "input and output buffer bytes over all connections; above it kvd stops reading "
           "the connections with the largest reply backlog until they drain"),
    OPT("max-frame-bytes", KVD_OPT_U64, max_frame_bytes, "1M", 65536, 1u << 30,
        "largest request frame body; a longer one gets ETOOBIG and a close; at least "
        "16 * max-blocks-per-request + 32K, so that every reply fits it"),
    OPT_RT("max-blocks-per-request", KVD_OPT_U64, max_blocks_per_request, "4096", 1, 1u << 20,
           "longest list (hashes, blocks, entries) in one request"),
    OPT("tenants-file", KVD_OPT_STRING, tenants_file, "", 0, 0,
        "tenant map (lines: tenant NAME uid=U,U gid=G); empty: each uid is tenant uid-N"),
    OPT_RT("log-level", KVD_OPT_LEVEL, log_level, "info", 0, 0, "error, warn, info or debug"),
    OPT("admin-socket", KVD_OPT_STRING, admin_socket, "", 0, 0,
        "admin socket path (kvctl); empty: admin.sock in the client socket's directory"),
    OPT("admin-socket-mode", KVD_OPT_MODE, admin_socket_mode, "0600", 0, 0777,
        "permission bits of the admin socket (octal); peers are also checked by credentials"),
    OPT("admin-group", KVD_OPT_STRING, admin_group, "", 0, 0,
        "group (name or number) whose members may use the admin socket besides root and kvd's "
        "uid (the socket then also has group read and write)"),
    OPT("metrics-port", KVD_OPT_U64, metrics_port, "0", 0, 65535,
        "TCP port of the Prometheus endpoint (/metrics, /healthz, /readyz); 0: off"),
    OPT("metrics-address", KVD_OPT_STRING, metrics_address, "127.0.0.1", 0, 0,
        "IPv4 address the metrics port binds (0.0.0.0 for a pod's probes from the kubelet)"),
    OPT("events", KVD_OPT_U64, events, "1024", 1, 1u << 20,
        "evictions and refusals kept for admin `events` (a ring; oldest dropped)"),
    OPT("tier1-memory", KVD_OPT_U64, tier1_memory, "0", 0, UINT64_MAX,
        "bytes of host memory for tier 1 over all pools: cached blocks evicted from a pool are "
        "copied here instead of dropped, and a Fetch brings them back; 0: no tier 1"),
    OPT("tier2-path", KVD_OPT_STRING, tier2_path, "", 0, 0,
        "directory of tier 2 (local disk, survives restarts; one subdirectory per domain, mode "
        "0700, one file per pool); empty: no tier 2"),
    OPT("tier2-bytes", KVD_OPT_U64, tier2_bytes, "10G", 0, UINT64_MAX,
        "bytes of tier-2 files over all pools"),
    OPT("tier2-direct", KVD_OPT_BOOL, tier2_direct, "true", 0, 1,
        "tier 2: O_DIRECT reads and writes where the file system takes them (else buffered)"),
    OPT("tier2-zero-copy", KVD_OPT_STRING, tier2_zero_copy, "auto", 0, 0,
        "tier 2 of host pools: on moves a raw block's pages between T0 and the disk with no copy "
        "(each transfer pins T0's pages); off copies through a huge-page buffer; auto: on where "
        "T0 is in 2 MiB pages (hugepages, or the kernel's shmem THP mode is advise, within_size, "
        "always or force), off where it is in 4 KiB pages"),
    OPT("tier-format", KVD_OPT_STRING, tier_format, "raw", 0, 0,
        "how tiers 1 and 2 store a block: raw (as in the pool), lz4 or zstd (lossless; a block "
        "that does not shrink by 1/16 is stored raw)"),
    OPT("tier-lossy-format", KVD_OPT_STRING, tier_lossy_format, "int8", 0, 0,
        "how tiers 1 and 2 store the blocks of pools whose layout asked for lossy tiers "
        "(Layout.lossy_tiers; fp16, bf16 and fp32 pools): int8 or fp8 (e4m3), with a float32 "
        "scale per layer, K|V and head of each block; off: losslessly, as tier-format"),
    OPT("tier-write", KVD_OPT_STRING, tier_write, "write-back", 0, 0,
        "write-back: copy the next blocks to be evicted ahead of eviction (tier-clean-ahead); "
        "write-through: copy every committed block down at once"),
    OPT_RT("tier-min-hits", KVD_OPT_U64, tier_min_hits, "0", 0, 65535,
           "selective write-back: only blocks that Lookups found at least this often go down; "
           "0: every block"),
    OPT_RT("tier-clean-ahead", KVD_OPT_U64, tier_clean_ahead, "32", 1, 1u << 20,
           "write-back: how many of a pool's next eviction victims are kept copied down while its "
           "free blocks are fewer than this"),
    OPT_RT("fetch-min-tokens", KVD_OPT_U64, fetch_min_tokens, "256", 0, 1u << 30,
           "a lower-tier hit of fewer tokens is not worth a Fetch (the reply says SHORT; the "
           "client recomputes); HiCache's threshold"),
    OPT("hash-mode", KVD_OPT_STRING, hash_mode, "xxh3", 0, 0,
        "block hashes clients compute: xxh3 (XXH3-128, fastest) or vllm (vLLM's sha256_cbor, "
        "so that published and stored keys are the ones a vLLM-aware router computes; "
        "docs/HASH.md)"),
    OPT("vllm-hash-seed", KVD_OPT_STRING, vllm_hash_seed, "", 0, 0,
        "hash-mode vllm: the PYTHONHASHSEED the vLLM side uses (NONE_HASH = sha256(cbor(seed))); "
        "empty: a random NONE_HASH per run, as vLLM without PYTHONHASHSEED (no hit survives a "
        "restart then)"),
    OPT("kv-events-endpoint", KVD_OPT_STRING, kv_events_endpoint, "", 0, 0,
        "ZMQ endpoint (bound, e.g. tcp://127.0.0.1:5557 or ipc://PATH) publishing KV events in "
        "vLLM's format for every domain that no tenants-file `events` line names "
        "(docs/EVENTS.md); empty: off"),
    OPT("kv-events-replay", KVD_OPT_STRING, kv_events_replay, "", 0, 0,
        "ZMQ endpoint (ROUTER, bound) that replays the kv-events-endpoint's buffered batches "
        "from a sequence number; empty: no replay"),
    OPT("kv-events-topic", KVD_OPT_STRING, kv_events_topic, "", 0, 0,
        "topic frame of every KV-event message (vLLM's default is empty)"),
    OPT("kv-events-token-ids", KVD_OPT_BOOL, kv_events_token_ids, "false", 0, 1,
        "BlockStored events carry the blocks' token ids (a prompt's text, in effect: only for a "
        "router every tenant trusts); false: token_ids is empty"),
    OPT("kv-events-hash-form", KVD_OPT_STRING, kv_events_hash_form, "int", 0, 0,
        "how events name a block: int (vLLM's default: the digest's last 8 bytes, big-endian) "
        "or bytes (the whole digest: 32 bytes in vllm mode, 16 in xxh3 mode)"),
    OPT("kv-events-format", KVD_OPT_STRING, kv_events_format, "array", 0, 0,
        "how events are encoded: array (vLLM's array-like tagged structs, read by decoders of "
        "vLLM up to its switch to maps) or map (the newer schema: maps with \"type\" first)"),
    OPT("kv-events-buffer", KVD_OPT_U64, kv_events_buffer, "10000", 1, 1u << 24,
        "batches each publisher keeps for replay (vLLM's buffer_steps)"),
    OPT("kv-events-flush-ms", KVD_OPT_U64, kv_events_flush_ms, "1", 0, 10000,
        "a KV-event batch collects the events of this many ms after its first (one send, not "
        "one per request, on a busy Commit path); 0: each loop iteration's events are a batch"),
    OPT("kv-events-thread", KVD_OPT_STRING, kv_events_thread, "auto", 0, 0,
        "where KV events are counted and encoded: on (a thread of their own; the loop thread "
        "only records them), off (on the loop thread, at the end of each loop iteration; the "
        "batch still goes at the end of the flush window) or auto "
        "(on when the daemon may run on two or more CPUs, by its CPU affinity and its cgroup's "
        "CPU quota: the thread then runs beside the loop instead of taking turns with it)"),
    OPT("remote-redis", KVD_OPT_STRING, remote_redis, "", 0, 0,
        "the remote tier below T1/T2: HOST:PORT[,HOST:PORT...] of one Redis server or seed "
        "nodes of a Redis Cluster (found by CLUSTER SLOTS); blocks in tier 1 are also written "
        "there (remote-write says when), and a Fetch asks it for the blocks past the local tiers' "
        "run; "
        "needs tier1-memory (docs/TIERS.md); empty: off"),
    OPT("remote-key-prefix", KVD_OPT_STRING, remote_key_prefix, "kvd", 0, 0,
        "first part of every remote key (PREFIX:DOMAIN:LAYOUT:HASH): one per deployment"),
    OPT("remote-password-file", KVD_OPT_STRING, remote_password_file, "", 0, 0,
        "file holding the Redis AUTH password (read at start, trailing whitespace cut; never "
        "on the command line); empty: no AUTH"),
    OPT("remote-ttl-s", KVD_OPT_U64, remote_ttl_s, "0", 0, 1ull << 31,
        "seconds a remote value lives (SET ... EX); 0: until Redis's own maxmemory policy "
        "evicts it"),
    OPT("remote-timeout-ms", KVD_OPT_U64, remote_timeout_ms, "200", 1, 60000,
        "connect and command timeout of the remote tier; a Fetch waits at most about this "
        "long for Redis"),
    OPT("remote-backoff-max-ms", KVD_OPT_U64, remote_backoff_max_ms, "5000", 100, 600000,
        "longest wait between tries to reach a Redis node that failed (and between the remote "
        "watch's re-subscriptions): the wait starts at 100 ms and doubles up to this"),
    OPT_RT("remote-fetch-max", KVD_OPT_U64, remote_fetch_max, "256", 0, 4096,
           "blocks past the local tiers' run a Fetch asks the remote tier for (one pipelined "
           "round trip per node); 0: the remote tier is only written"),
    OPT("remote-queue-bytes", KVD_OPT_U64, remote_queue_bytes, "256M", 1 << 20, 1ull << 40,
        "block bytes of remote writes queued at most; more are dropped (counted) while Redis "
        "is slow or down"),
    OPT("remote-write", KVD_OPT_STRING, remote_write, "write-through", 0, 0,
        "when a block goes to the remote tier: write-through (as it lands in tier 1: other nodes "
        "find it at once) or write-back (only the next blocks tier 1 will evict, "
        "tier-clean-ahead of them per pool, are written ahead of their eviction, and the rest at "
        "a stop, remote-drain-s: Redis holds what left this node's memory, and the writes are "
        "fewer); a pool's own: tenants-file tiers lines, admin tiers"),
    OPT("remote-drain-s", KVD_OPT_U64, remote_drain_s, "10", 0, 3600,
        "remote-write write-back: at a stop, how long kvd may spend writing to Redis the blocks "
        "tier 1 holds that Redis lacks (a progress line says how many went); 0: none are "
        "written, they go with tier 1"),
    OPT("remote-uid-tenants", KVD_OPT_STRING, remote_uid_tenants, "shared", 0, 0,
        "the remote tier for peers without a tenants-file line (tenant uid-N): shared (uid N is "
        "the same tenant on every node that shares the Redis), node (their keys carry node-name: "
        "each node's uid-N is its own) or off (they use the local tiers only)"),
    OPT("node-name", KVD_OPT_STRING, node_name, "", 0, 0,
        "this node's name in the remote tier's keys of uid-N tenants (remote-uid-tenants node); "
        "1..63 of [A-Za-z0-9._-]; empty: the host name"),
    OPT("remote-watch", KVD_OPT_BOOL, remote_watch, "false", 0, 1,
        "listen to every Redis node's keyspace notifications of expired and evicted keys "
        "(the node's notify-keyspace-events must hold Exe; kvd never sets it) and publish "
        "BlockRemoved on medium REMOTE for the values of this node's pools; a block read from "
        "such a value is written to Redis again on its way down"),
    OPT("remote-watch-ledger", KVD_OPT_U64, remote_watch_ledger, "262144", 0, 1ull << 32,
        "with remote-watch: how many of the values this node announced on REMOTE it remembers "
        "(48 to 96 bytes each), so that after a gap in the watch (a subscription lost and made "
        "again) it asks Redis which are gone and publishes BlockRemoved for them; when it is "
        "full, older ones are forgotten; 0: no reconciliation"),
    OPT("remote-watch-reconcile-s", KVD_OPT_U64, remote_watch_reconcile_s, "600", 0, 604800,
        "with remote-watch and its ledger: seconds between reconciliation passes while the "
        "watch is up, besides the pass after each gap; finds the values gone without a "
        "notification (a DEL or FLUSHALL by another client; a node whose notify-keyspace-events "
        "lacks Exe); a pass asks one STRLEN per ledger entry; 0: only after gaps"),
    OPT("remote-watch-refresh-s", KVD_OPT_U64, remote_watch_refresh_s, "30", 0, 86400,
        "with remote-watch: seconds between checks of the cluster's masters (CLUSTER SLOTS "
        "asked of a watched node, in turn); when two checks in a row find them changed (a "
        "master added, slots moved to a node that had none) the watch subscribes again on the "
        "new set; 0: only after a failure"),
};

#define NOPTIONS (sizeof(options) / sizeof(options[0]))

const kvd_config_option *kvd_config_options(size_t *n) {
    *n = NOPTIONS;
    return options;
}

static const kvd_config_option *find_option(const char *name, size_t namelen) {
    for (size_t i = 0; i < NOPTIONS; i++) {
        if (strlen(options[i].name) == namelen && memcmp(options[i].name, name, namelen) == 0) {
            return &options[i];
        }
    }
    return NULL;
}

const kvd_config_option *kvd_config_find(const char *name) {
    return find_option(name, strlen(name));
}

static int parse_bool(const char *s, int *out) {
    static const char *const yes[] = {"true", "yes", "on", "1"};
    static const char *const no[] = {"false", "no", "off", "0"};
    for (size_t i = 0; i < 4; i++) {
        if (strcmp(s, yes[i]) == 0) {
            *out = 1;
            return 0;
        }
        if (strcmp(s, no[i]) == 0) {
            *out = 0;
            return 0;
        }
    }
    return -1;
}

static kv_err set_option(kvd_config *c, const kvd_config_option *o, const char *value, char *err,
                         size_t errlen) {
    char *field = (char *)c + o->offset;
    switch (o->type) {
        case KVD_OPT_STRING: {
            size_t n = strlen(value);
            if (n >= o->size) {
                kvd_conf_err(err, errlen, "%s: value longer than %zu bytes", o->name, o->size - 1);
                return KV_EINVAL;
            }
            if (strcmp(o->name, "backend") == 0 && strcmp(value, "auto") != 0 &&
                strcmp(value, "host") != 0 && strcmp(value, "cuda-vmm") != 0 &&
                strcmp(value, "cuda-ipc") != 0) {
                kvd_conf_err(err, errlen,
                             "backend: unknown backend '%s' (auto, host, cuda-vmm or cuda-ipc)",
                             value);
                return KV_EINVAL;
            }
            kvd_evict_policy pol;
            if (strcmp(o->name, "evict-policy") == 0 &&
                kvd_evict_policy_parse(value, &pol) != KV_OK) {
                kvd_conf_err(err, errlen,
                             "evict-policy: '%s' is not lru, s3fifo, prefix-lru or adaptive",
                             value);
                return KV_EINVAL;
            }
            if (strcmp(o->name, "tier-format") == 0 && strcmp(value, "raw") != 0 &&
                strcmp(value, "lz4") != 0 && strcmp(value, "zstd") != 0) {
                kvd_conf_err(err, errlen, "tier-format: '%s' is not raw, lz4 or zstd", value);
                return KV_EINVAL;
            }
            if (strcmp(o->name, "tier-lossy-format") == 0 && strcmp(value, "int8") != 0 &&
                strcmp(value, "fp8") != 0 && strcmp(value, "off") != 0) {
                kvd_conf_err(err, errlen, "tier-lossy-format: '%s' is not int8, fp8 or off", value);
                return KV_EINVAL;
            }
            if (strcmp(o->name, "tier2-zero-copy") == 0 && strcmp(value, "auto") != 0 &&
                strcmp(value, "on") != 0 && strcmp(value, "off") != 0) {
                kvd_conf_err(err, errlen, "tier2-zero-copy: '%s' is not auto, on or off", value);
                return KV_EINVAL;
            }
            if (strcmp(o->name, "kv-events-thread") == 0 && strcmp(value, "auto") != 0 &&
                strcmp(value, "on") != 0 && strcmp(value, "off") != 0) {
                kvd_conf_err(err, errlen, "kv-events-thread: '%s' is not auto, on or off", value);
                return KV_EINVAL;
            }
            if (strcmp(o->name, "tier-write") == 0 && strcmp(value, "write-back") != 0 &&
                strcmp(value, "write-through") != 0) {
                kvd_conf_err(err, errlen, "tier-write: '%s' is not write-back or write-through",
                             value);
                return KV_EINVAL;
            }
            if (strcmp(o->name, "remote-write") == 0 && strcmp(value, "write-back") != 0 &&
                strcmp(value, "write-through") != 0) {
                kvd_conf_err(err, errlen, "remote-write: '%s' is not write-back or write-through",
                             value);
                return KV_EINVAL;
            }
            if (strcmp(o->name, "hash-mode") == 0 && strcmp(value, "xxh3") != 0 &&
                strcmp(value, "vllm") != 0) {
                kvd_conf_err(err, errlen, "hash-mode: '%s' is not xxh3 or vllm", value);
                return KV_EINVAL;
            }
            if (strcmp(o->name, "remote-uid-tenants") == 0 && strcmp(value, "shared") != 0 &&
                strcmp(value, "node") != 0 && strcmp(value, "off") != 0) {
                kvd_conf_err(err, errlen, "remote-uid-tenants: '%s' is not shared, node or off",
                             value);
                return KV_EINVAL;
            }
            if (strcmp(o->name, "node-name") == 0 &&
                strspn(value,
                       "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-") !=
                    strlen(value)) {
                kvd_conf_err(err, errlen, "node-name: '%s' may hold only [A-Za-z0-9._-]", value);
                return KV_EINVAL;
            }
            if (strcmp(o->name, "remote-key-prefix") == 0 &&
                (strchr(value, ':') != NULL || value[0] == '\0')) {
                kvd_conf_err(err, errlen,
                             "remote-key-prefix: '%s' must be non-empty and without ':' (keys are "
                             "PREFIX:DOMAIN:LAYOUT:HASH)",
                             value);
                return KV_EINVAL;
            }
            if (strcmp(o->name, "kv-events-format") == 0 && strcmp(value, "array") != 0 &&
                strcmp(value, "map") != 0) {
                kvd_conf_err(err, errlen, "kv-events-format: '%s' is not array or map", value);
                return KV_EINVAL;
            }
            if (strcmp(o->name, "kv-events-hash-form") == 0 && strcmp(value, "int") != 0 &&
                strcmp(value, "bytes") != 0) {
                kvd_conf_err(err, errlen, "kv-events-hash-form: '%s' is not int or bytes", value);
                return KV_EINVAL;
            }
            memcpy(field, value, n + 1);
            return KV_OK;
        }
        case KVD_OPT_U64: {
            uint64_t v;
            if (kv_parse_size(value, &v) != 0) {
                kvd_conf_err(err, errlen, "%s: '%s' is not a number (suffixes K, M, G, T allowed)",
                             o->name, value);
                return KV_EINVAL;
            }
            if (v < o->min || v > o->max) {
                kvd_conf_err(err, errlen, "%s: %" PRIu64 " is outside %" PRIu64 "..%" PRIu64,
                             o->name, v, o->min, o->max);
                return KV_EINVAL;
            }
            memcpy(field, &v, sizeof(v));
            return KV_OK;
        }
        case KVD_OPT_MODE: {
            char *end;
            errno = 0;
            unsigned long v = strtoul(value, &end, 8);
            if (*value == '\0' || *end != '\0' || errno != 0 || v > o->max) {
                kvd_conf_err(err, errlen, "%s: '%s' is not an octal mode like 0600", o->name,
                             value);
                return KV_EINVAL;
            }
            uint32_t m = (uint32_t)v;
            memcpy(field, &m, sizeof(m));
            return KV_OK;
        }
        case KVD_OPT_BOOL: {
            int b;
            if (parse_bool(value, &b) != 0) {
                kvd_conf_err(err, errlen, "%s: '%s' is not true or false", o->name, value);
                return KV_EINVAL;
            }
            memcpy(field, &b, sizeof(b));
            return KV_OK;
        }
        case KVD_OPT_LEVEL: {
            kv_log_level l;
            if (kv_log_level_parse(value, &l) != 0) {
                kvd_conf_err(err, errlen, "%s: '%s' is not error, warn, info or debug", o->name,
                             value);
                return KV_EINVAL;
            }
            memcpy(field, &l, sizeof(l));
            return KV_OK;
        }
    }
    KV_ASSERT(0 && "unknown option type");
    return KV_EINTERNAL;
}

void kvd_config_init(kvd_config *c) {
    memset(c, 0, sizeof(*c));
    for (size_t i = 0; i < NOPTIONS; i++) {
        kv_err e = set_option(c, &options[i], options[i].def, NULL, 0);
        KV_ASSERT(e == KV_OK);
    }
}

kv_err kvd_config_set(kvd_config *c, const char *name, const char *value, char *err,
                      size_t errlen) {
    const kvd_config_option *o = find_option(name, strlen(name));
    if (o == NULL) {
        kvd_conf_err(err, errlen, "unknown option '%s' (kvd --help lists them)", name);
        return KV_ENOENT;
    }
    return set_option(c, o, value, err, errlen);
}

kv_err kvd_config_check(const kvd_config *c, char *err, size_t errlen) {
    uint64_t need = KVD_REPLY_BYTES_PER_BLOCK * c->max_blocks_per_request + KVD_REPLY_RESERVE;
    if (c->max_frame_bytes < need) {
        kvd_conf_err(err, errlen,
                     "max-frame-bytes %" PRIu64
                     " cannot hold a reply of max-blocks-per-request %" PRIu64
                     " blocks: it needs at least %" PRIu64 " (16 bytes a block + 32K)",
                     c->max_frame_bytes, c->max_blocks_per_request, need);
        return KV_EINVAL;
    }
    if (c->admin_socket[0] != '\0' && strcmp(c->admin_socket, c->socket) == 0) {
        /* The admin socket would replace the client socket (kvd removes a stale socket file
         * before it binds). */
        kvd_conf_err(err, errlen, "admin-socket and socket are the same path (%s)", c->socket);
        return KV_EINVAL;
    }
    return KV_OK;
}

kv_err kvd_config_parse_text(kvd_config *c, const char *text, const char *source, char *err,
                             size_t errlen) {
    char *copy = strdup(text);
    if (copy == NULL) {
        kvd_conf_err(err, errlen, "%s: out of memory", source);
        return KV_ENOMEM;
    }
    kv_err rc = KV_OK;
    kvd_conf_lines it;
    kvd_conf_lines_init(&it, copy);
    char *l;
    while ((l = kvd_conf_lines_next(&it)) != NULL) {
        char *eq = strchr(l, '=');
        if (eq == NULL) {
            kvd_conf_err(err, errlen, "%s:%u: expected 'name = value'", source, it.lineno);
            rc = KV_EINVAL;
            goto cleanup_copy;
        }
        *eq = '\0';
        char *name = kvd_conf_trim(l);
        char *value = kvd_conf_trim(eq + 1);
        char sub[512];
        rc = kvd_config_set(c, name, value, sub, sizeof(sub));
        if (rc != KV_OK) {
            kvd_conf_err(err, errlen, "%s:%u: %s", source, it.lineno, sub);
            goto cleanup_copy;
        }
    }
cleanup_copy:
    free(copy);
    return rc;
}

kv_err kvd_config_load_file(kvd_config *c, const char *path, char *err, size_t errlen) {
    FILE *f = fopen(path, "r");
    if (f == NULL) {
        kvd_conf_err(err, errlen, "%s: %s", path, strerror(errno));
        return KV_ESYS;
    }
    kv_err rc = KV_OK;
    char *text = NULL;
    size_t cap = 0, len = 0;
    for (;;) {
        if (len + 4096 + 1 > cap) {
            size_t ncap = cap == 0 ? 8192 : cap * 2;
            if (ncap > (16u << 20)) {
                kvd_conf_err(err, errlen, "%s: larger than 16 MiB", path);
                rc = KV_ETOOBIG;
                goto cleanup_text;
            }
            char *t = realloc(text, ncap);
            if (t == NULL) {
                rc = KV_ENOMEM;
                goto cleanup_text;
            }
            text = t;
            cap = ncap;
        }
        size_t n = fread(text + len, 1, 4096, f);
        len += n;
        if (n < 4096) {
            break;
        }
    }
    if (ferror(f)) {
        kvd_conf_err(err, errlen, "%s: read error", path);
        rc = KV_ESYS;
        goto cleanup_text;
    }
    text[len] = '\0';
    rc = kvd_config_parse_text(c, text, path, err, errlen);
cleanup_text:
    free(text);
    fclose(f);
    return rc;
}

kv_err kvd_config_parse_args(kvd_config *c, int argc, char **argv, int *help, char *err,
                             size_t errlen) {
    /* Pass 1: config files, so that flags given anywhere override them. */
    for (int i = 1; i < argc; i++) {
        if (strncmp(argv[i], "--config=", 9) == 0) {
            kv_err rc = kvd_config_load_file(c, argv[i] + 9, err, errlen);
            if (rc != KV_OK) {
                return rc;
            }
        }
    }
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            *help = 1;
            continue;
        }
        if (strncmp(a, "--config=", 9) == 0) {
            continue;
        }
        const char *eq = strchr(a, '=');
        if (strncmp(a, "--", 2) != 0 || eq == NULL) {
            kvd_conf_err(err, errlen, "argument '%s' is not --name=value (kvd --help)", a);
            return KV_EINVAL;
        }
        const kvd_config_option *o = find_option(a + 2, (size_t)(eq - (a + 2)));
        if (o == NULL) {
            kvd_conf_err(err, errlen, "unknown option '%.*s' (kvd --help lists them)",
                         (int)(eq - (a + 2)), a + 2);
            return KV_ENOENT;
        }
        kv_err rc = set_option(c, o, eq + 1, err, errlen);
        if (rc != KV_OK) {
            return rc;
        }
    }
    return KV_OK;
}

void kvd_config_print_help(FILE *f) {
    fprintf(f, "usage: kvd [--config=FILE] [--name=value ...]\n"
               "kvd: KV-cache daemon. Options (also as 'name = value' lines in --config):\n"
               "  --config=FILE  read options from FILE first; flags override it\n"
               "  --help         print this\n"
               "  --print-config     print the commented example config (deploy/kvd.conf)\n"
               "  --print-admin-doc  print docs/ADMIN.md (admin commands, kvctl exit codes)\n"
               "  --print-man=PAGE   print the manual page kvd(8) or kvctl(1) (docs/man/)\n"
               "Options marked [runtime] can also be changed while kvd runs (kvctl config set).\n");
    for (size_t i = 0; i < NOPTIONS; i++) {
        fprintf(f, "  --%s=%s%s\n      %s (default: \"%s\")\n", options[i].name,
                options[i].type == KVD_OPT_STRING ? "STRING" : "VALUE",
                options[i].runtime ? "  [runtime]" : "", options[i].description, options[i].def);
    }
}

void kvd_config_format(const kvd_config *c, const kvd_config_option *o, char *buf, size_t len) {
    const char *field = (const char *)c + o->offset;
    switch (o->type) {
        case KVD_OPT_STRING:
            snprintf(buf, len, "%s", field);
            return;
        case KVD_OPT_U64: {
            uint64_t v;
            memcpy(&v, field, sizeof(v));
            snprintf(buf, len, "%" PRIu64, v);
            return;
        }
        case KVD_OPT_MODE: {
            uint32_t m;
            memcpy(&m, field, sizeof(m));
            snprintf(buf, len, "0%o", m);
            return;
        }
        case KVD_OPT_BOOL: {
            int b;
            memcpy(&b, field, sizeof(b));
            snprintf(buf, len, "%s", b ? "true" : "false");
            return;
        }
        case KVD_OPT_LEVEL: {
            kv_log_level l;
            memcpy(&l, field, sizeof(l));
            snprintf(buf, len, "%s", kv_log_level_name(l));
            return;
        }
    }
    snprintf(buf, len, "?");
}

void kvd_config_print_example(FILE *f) {
    fprintf(f,
            "# kvd.conf: every kvd option with its default. Lines are `name = value`; `#` starts "
            "a comment.\n"
            "# Use with `kvd --config=/etc/kvd/kvd.conf`; flags `--name=value` override it.\n"
            "# Generated by `kvd --print-config` from the option table (daemon/config.c);\n"
            "# config_test fails when this file differs. Sizes take suffixes K, M, G, T (powers "
            "of 1024).\n"
            "# Options marked [runtime] can also be changed live: `kvctl config set NAME "
            "VALUE`.\n");
    for (size_t i = 0; i < NOPTIONS; i++) {
        fprintf(f, "\n# %s%s\n# %s =%s%s\n", options[i].description,
                options[i].runtime ? " [runtime]" : "", options[i].name,
                options[i].def[0] != '\0' ? " " : "", options[i].def);
    }
}
