/* kvd_config: every daemon option, from ONE table.
 *
 * The table (config.c) drives command-line flags (`--name=value`), the config file (`name =
 * value` lines, `#` comments, `--config=FILE`), `--help` (every option with default and
 * description) and the check that deploy/kvd.conf documents every option (config_test).
 * Values are parsed by type: strings, unsigned integers with optional K/M/G/T suffix (powers of
 * 1024), octal modes, booleans, log levels. Loop thread (or main before the loop); no state
 * beyond the caller's kvd_config.
 */
#ifndef KVD_CONFIG_H
#define KVD_CONFIG_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "common/kv_err.h"
#include "common/kv_log.h"

#define KVD_CONFIG_PATH_MAX 4096

typedef struct kvd_config {
    char socket[KVD_CONFIG_PATH_MAX];       /* socket path; "" = default location */
    uint32_t socket_mode;                   /* mode of the socket file (octal in text) */
    uint32_t socket_dir_mode;               /* mode of a socket directory kvd creates */
    char backend[16];                       /* "auto", "host", "cuda-vmm", "cuda-ipc" */
    uint64_t device;                        /* GPU backends: CUDA device ordinal */
    int hugepages;                          /* host backend: MFD_HUGETLB segments */
    int strict_layouts;                     /* refuse a second layout of one model id */
    int verify_blocks;                      /* checksum committed blocks, check on hits */
    uint64_t pool_memory;                   /* bytes of segments over all pools */
    uint64_t segment_bytes;                 /* target bytes per segment */
    uint64_t index_entries;                 /* capacity of the prefix index */
    char evict_policy[16];                  /* "lru" or "s3fifo" */
    int evict_duel;                         /* adaptive: set dueling picks the leaf order */
    uint64_t max_connections;               /* open client connections */
    uint64_t max_pools;                     /* pools over all tenants */
    uint64_t frame_timeout_ms;              /* a started request frame must complete in this */
    uint64_t shutdown_grace_ms;             /* cuda-ipc: how long a stop waits for sessions */
    uint64_t max_inflight;                  /* unsent replies before reading pauses */
    uint64_t max_output_bytes;              /* queued reply bytes before a client is dropped */
    uint64_t max_buffer_bytes;              /* input + output buffer bytes over all connections */
    uint64_t max_frame_bytes;               /* largest request body */
    uint64_t max_blocks_per_request;        /* longest list in one request */
    char tenants_file[KVD_CONFIG_PATH_MAX]; /* "" = every uid is its own tenant */
    kv_log_level log_level;                 /* error|warn|info|debug */
    char admin_socket[KVD_CONFIG_PATH_MAX]; /* admin socket path; "" = beside the socket */
    uint32_t admin_socket_mode;             /* mode of the admin socket file */
    char admin_group[64];                   /* group allowed on the admin socket; "" = none */
    uint64_t metrics_port;                  /* Prometheus HTTP port; 0 = off */
    char metrics_address[64];               /* address the metrics port binds */
    uint64_t events;                        /* entries of the admin event ring */
    uint64_t tier1_memory;                  /* T1 host bytes over all pools; 0 = no T1 */
    char tier2_path[KVD_CONFIG_PATH_MAX];   /* T2 directory; "" = no T2 */
    uint64_t tier2_bytes;                   /* T2 disk bytes over all pools */
    int tier2_direct;                       /* T2: O_DIRECT where the file system takes it */
    char tier_format[16];                   /* "raw", "lz4" or "zstd" */
    char tier_lossy_format[16];             /* "int8", "fp8" or "off": pools that asked */
    char tier_write[16];                    /* "write-back" or "write-through" */
    char tier2_zero_copy[8];                /* "auto", "on" or "off" (host pools' T2 transfers) */
    uint64_t tier_min_hits;                 /* selective: lookups a block needs to go down */
    uint64_t tier_clean_ahead;              /* write-back: victims kept copied ahead */
    uint64_t fetch_min_tokens;              /* a shorter lower-tier hit is not fetched */
    char hash_mode[16];                     /* "xxh3" or "vllm" (sha256_cbor, docs/HASH.md) */
    char vllm_hash_seed[256];               /* vllm mode: PYTHONHASHSEED; "" = random per run */
    char kv_events_endpoint[256];           /* ZMQ PUB of vLLM KV events; "" = off */
    char kv_events_replay[256];             /* ZMQ ROUTER answering replays; "" = none */
    char kv_events_topic[128];              /* topic frame of every message */
    int kv_events_token_ids;                /* BlockStored carries the token ids */
    char kv_events_hash_form[8];            /* "int" (vLLM's u64) or "bytes" */
    char kv_events_format[8];               /* "array" (vLLM's array-like) or "map" */
    uint64_t kv_events_buffer;              /* batches kept for replay */
    uint64_t kv_events_flush_ms;            /* a batch collects this long; 0: one iteration */
    char kv_events_thread[8];               /* "auto", "on" or "off" (kvd_kvevents' thread) */
    char remote_redis[1024];                /* remote tier seeds HOST:PORT,...; "" = off */
    char remote_key_prefix[64];             /* first part of every remote key */
    char remote_password_file[KVD_CONFIG_PATH_MAX]; /* AUTH password file; "" = none */
    uint64_t remote_ttl_s;                          /* EX of every SET; 0 = none */
    uint64_t remote_timeout_ms;                     /* connect and command timeout */
    uint64_t remote_backoff_max_ms;                 /* longest wait between reconnect tries */
    uint64_t remote_fetch_max;                      /* blocks past the local run a Fetch asks for */
    uint64_t remote_queue_bytes;                    /* puts queued at most */
    char remote_write[16];                          /* "write-through" or "write-back" */
    uint64_t remote_drain_s;      /* write-back: seconds a stop may spend writing T1's unwritten */
    int remote_watch;             /* listen to Redis's expiries and evictions (kvd_rwatch) */
    uint64_t remote_watch_ledger; /* values announced on REMOTE remembered for reconciliation */
    uint64_t remote_watch_reconcile_s; /* seconds between passes while the watch is up; 0: none */
    uint64_t remote_watch_refresh_s;   /* seconds between checks of the cluster's masters */
    char remote_uid_tenants[16];       /* uid-N tenants in Redis: shared, node or off */
    char node_name[64];                /* this node's name ("" = the host name) */
} kvd_config;

typedef enum kvd_opt_type {
    KVD_OPT_STRING = 1, /* char[size] field */
    KVD_OPT_U64 = 2,    /* uint64_t, K/M/G/T suffixes */
    KVD_OPT_MODE = 3,   /* uint32_t, octal */
    KVD_OPT_BOOL = 4,   /* int: true/false/yes/no/1/0 */
    KVD_OPT_LEVEL = 5,  /* kv_log_level */
} kvd_opt_type;

/* One row of the option table. */
typedef struct kvd_config_option {
    const char *name;        /* flag and file key, e.g. "pool-memory" */
    kvd_opt_type type;       /* how the text is parsed */
    size_t offset;           /* field in kvd_config */
    size_t size;             /* field size (string capacity) */
    const char *def;         /* default, as text */
    uint64_t min, max;       /* U64 range, inclusive */
    const char *description; /* one line for --help and kvd.conf */
    int runtime;             /* admin `config set` may change it while kvd runs */
} kvd_config_option;

/* The table: *n gets its length. Static storage; any thread. */
const kvd_config_option *kvd_config_options(size_t *n);

/* Fills c with every option's default. Cannot fail (defaults are tested). */
void kvd_config_init(kvd_config *c);

/* Sets option name from text. KV_ENOENT unknown name, KV_EINVAL bad value; err (if not NULL)
 * gets a sentence saying why. On error c is unchanged. */
kv_err kvd_config_set(kvd_config *c, const char *name, const char *value, char *err, size_t errlen);

/* Applies `name = value` lines of text (`#` starts a comment; blank lines ignored; value may
 * be empty for strings). source names the text in errors ("FILE:LINE: ..."). Stops at the first
 * bad line: options before it stay applied. */
kv_err kvd_config_parse_text(kvd_config *c, const char *text, const char *source, char *err,
                             size_t errlen);

/* Every reply fits max_frame_bytes + 64 (PROTOCOL.md §2): a reply names at most
 * max-blocks-per-request blocks (a repeated BlockRef costs at most 14 bytes, a packed one 8) and
 * at most 200 segments and 18 linked pools (under 32 KiB). */
#define KVD_REPLY_BYTES_PER_BLOCK 16
#define KVD_REPLY_RESERVE 32768

/* Checks what one option cannot: max-frame-bytes >= 16 * max-blocks-per-request + 32K. KV_EINVAL
 * with a sentence in err. Called once the options are read, and by admin `config set` on the
 * values it would apply. */
kv_err kvd_config_check(const kvd_config *c, char *err, size_t errlen);

/* Reads a file and applies it as kvd_config_parse_text. KV_ESYS when it cannot be read. */
kv_err kvd_config_load_file(kvd_config *c, const char *path, char *err, size_t errlen);

/* Applies argv[1..argc): first every --config=FILE (in order), then every other --name=value, so
 * flags override the file. `--help` sets *help = 1 (other arguments still parsed). An argument
 * not of the form --name=value is KV_EINVAL. */
kv_err kvd_config_parse_args(kvd_config *c, int argc, char **argv, int *help, char *err,
                             size_t errlen);

/* Prints usage with every option, its default and description. */
void kvd_config_print_help(FILE *f);

/* The option named name, or NULL. Any thread. */
const kvd_config_option *kvd_config_find(const char *name);

/* Prints the commented example config (deploy/kvd.conf): every option with its description and
 * default, as `# name = default` lines; `kvd --print-config` writes it and config_test checks
 * the committed file is exactly this. */
void kvd_config_print_example(FILE *f);

/* Prints one option's current value as text into buf. */
void kvd_config_format(const kvd_config *c, const kvd_config_option *o, char *buf, size_t len);

#endif
