/* soak: a long randomized run of kvd with many worker processes and an invariant checker.
 *
 * soak_run starts kvd (optionally under a wrapper such as valgrind) with a tenants file of
 * token tenants, forks `clients` worker processes spread over `tenants` tenants, and lets them
 * do random sequences of lookups (verifying every hit byte for byte), allocations, writes,
 * commits, releases, rewinds, pins and deaths (SIGKILL at a random step; the slot is refilled by
 * a new process) until the time is up. Block contents are derived from the block hash and the
 * writer's tenant, so any reader can verify them and a hit that crossed a domain is told apart
 * from corrupted bytes. Afterwards, with every worker gone, it checks through Stats that every
 * block of every pool is accounted for (free + cached + parked = total, nothing held or WRITING),
 * stops kvd with SIGTERM and requires exit status 0. Single-threaded caller; forks.
 */
#ifndef KV_SOAK_H
#define KV_SOAK_H

#include <stdint.h>

typedef struct soak_options {
    int seconds;          /* run time of the workers */
    int clients;          /* worker processes alive at any time */
    int tenants;          /* token tenants (clients are spread round-robin), 1..16 */
    int death_permille;   /* chance, per step of a worker's cycle, that it SIGKILLs itself */
    const char *kvd;      /* kvd binary */
    const char *wrap;     /* NULL or a command prefix (space-separated) kvd runs under */
    const char *pool_mem; /* --pool-memory of kvd */
    const char *seg_size; /* --segment-bytes of kvd: small ones make many segments and gaps */
    int busy;             /* CPU-burning processes run beside the workers (load: races show) */
    int tiers;            /* 1: kvd with tier 1 and tier 2 (write-back), workers Fetch instead of
                             Lookup, so hits come from every tier (docs/TIERS.md); 2: the same,
                             write-through */
    const char *redis;    /* NULL, or a redis-server binary: with tiers, the soak starts one on
                             loopback and kvd gets it as its remote tier (tier 1 small, no tier
                             2, write-through), so blocks T0 and T1 let go come back from Redis,
                             read straight into T0 (docs/TIERS.md, remote tier) */
    const char *remote_write; /* with redis: kvd's --remote-write (NULL: its default,
                                 write-through) */
    int block_major;          /* pools block-major (each block one piece of memory: with tiers, T2
                                 moves host blocks with no copy) instead of layer-major */
    int events;               /* kvd publishes KV events (token ids on, docs/EVENTS.md), and a
                                 subscriber in this process checks every batch: sequence numbers
                                 without a gap from the first one received, each payload a
                                 [ts, [events], dp_rank] of known event tags */
    int verbose;              /* print per-tenant pool figures */
} soak_options;

typedef struct soak_result {
    uint64_t ops;                /* worker cycles (lookup .. release), finished or not */
    uint64_t requests;           /* kvd requests made by workers */
    uint64_t lookups;            /* Lookup requests */
    uint64_t hit_blocks;         /* blocks returned by Lookup (or Fetch, with tiers) */
    uint64_t promoted;           /* of them, blocks a Fetch copied up from tier 1 or 2 */
    uint64_t remote_direct;      /* remote values read straight into T0 blocks (kvd's count) */
    uint64_t t2_zero_copy;       /* T2 transfers with no copy (kvd's tier2_zero_copy) */
    uint64_t remote_bad;         /* remote values that failed a check (kvd's count; 0 expected) */
    uint64_t remote_lookups;     /* kvc_lookup_remote calls (with redis: a quarter of the cycles) */
    uint64_t remote_lookup_hits; /* blocks they said Redis holds past the local tiers */
    uint64_t allocated;          /* blocks leased by Allocate */
    uint64_t committed;          /* blocks committed */
    uint64_t duplicates;         /* commits answered with another writer's canonical block */
    uint64_t rewinds;            /* Rewind requests (drafts thrown away) */
    uint64_t pins;               /* Pin requests */
    uint64_t enospc;             /* Allocate refused with ENOSPC (expected under memory pressure) */
    uint64_t verified;           /* blocks whose bytes were checked after a hit or a commit */
    uint64_t mismatched;         /* blocks whose bytes differed from what their writer wrote */
    uint64_t unmapped;           /* of those: kvc_pool_addr gave NULL (segment not mapped) */
    uint64_t cross_domain;       /* hits holding another tenant's bytes */
    uint64_t unexpected;         /* requests that failed with an error no scenario explains */
    uint64_t deaths;             /* workers that SIGKILLed themselves (faults injected) */
    uint64_t crashes;            /* workers that died any other way, or could not start */
    uint64_t leaked;             /* blocks neither free nor cached after every worker was gone */
    uint64_t blocks_total;       /* blocks of all pools at the end */
    uint64_t rss_start_kb;       /* kvd VmRSS after start (idle) */
    uint64_t rss_warm_kb;        /* kvd VmRSS after a quarter of the run */
    uint64_t rss_end_kb;         /* kvd VmRSS at the end, every worker gone */
    uint64_t anon_warm_kb;       /* kvd RssAnon after a quarter of the run */
    uint64_t anon_end_kb;        /* kvd RssAnon at the end */
    uint64_t ev_batches;         /* with events: batches received */
    uint64_t ev_stored;          /* BlockStored events in them */
    uint64_t ev_removed;         /* BlockRemoved events */
    uint64_t ev_cleared;         /* AllBlocksCleared events */
    uint64_t ev_gaps;           /* batches missing between sequence numbers received (0 expected) */
    uint64_t ev_bad;            /* batches not in kvd's format, or going back in sequence */
    uint64_t ev_first, ev_last; /* sequence numbers of the first and last batch received */
    uint64_t ev_published;      /* kvd's kv_events_batches once every worker was gone (the batches
                                   up to the last received must cover them: no tail lost) */
    int kvd_status;             /* kvd's exit status after SIGTERM (0 expected), -1 if killed */
    int check_failed;           /* the end-of-run checker could not run */
} soak_result;

/* Fills o with the defaults: 60 s, 64 clients, 4 tenants, 2 permille deaths, kvd at the runfile
 * daemon/kvd, no wrapper, 32M pool memory, 1M segments, no CPU burners. */
void soak_options_init(soak_options *o);

/* Runs the soak; fills *r (also when it fails). Returns 0 when every invariant held: nothing
 * leaked, no byte mismatched, no hit crossed a domain, no unexpected error or crash, kvd exited
 * 0, and with events every batch came, in order and well formed; else -1. Prints a summary to
 * stdout. */
int soak_run(const soak_options *o, soak_result *r);

#endif
