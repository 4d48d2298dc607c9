/* kvd_rwatch: hears Redis drop the remote tier's keys (docs/TIERS.md, "Remote tier"), so that
 * the KV events can say BlockRemoved on medium REMOTE for a value that expired (remote-ttl-s)
 * or that Redis's own maxmemory policy evicted: Redis does both without a word to its clients.
 *
 * Redis publishes such drops as keyspace notifications when its `notify-keyspace-events`
 * holds E (keyevent channels) and x (expired) or e (evicted), A for both; kvd never changes a
 * server's configuration: a node without them is counted (`unconfigured`) and logged once per
 * connection, and its drops go unheard. Notifications are node-local, so the watcher
 * subscribes on every master of a Redis Cluster (the masters of CLUSTER SLOTS, asked of the
 * seeds and then every node an earlier CLUSTER SLOTS named, in turn), or on the one server
 * where cluster support is off, to the channels
 * __keyevent@0__:expired and __keyevent@0__:evicted. When a subscriber's connection goes (a
 * master killed, a failover) the watcher forgets every node and asks the seeds again, after a
 * backoff of 100 ms doubling to backoff_max_ms (5 s by default); a discovery or subscription
 * not done within 5 x timeout_ms starts over the same way. Drops while a node has no subscriber
 * are not heard (Redis keeps no backlog of notifications): each such gap is counted
 * (kvd_rwatch_stats.gaps), and when every node is subscribed again the up callback says so
 * (kvd_rwatch_set_up_fn). While every node of a cluster is subscribed, one of them (in turn) is
 * asked for CLUSTER SLOTS every refresh_ms: when two checks in a row name the same set of
 * masters and it is not the one watched (a master added, slots moved to a node that had none),
 * the watch starts again on the new set (its restart is a gap: drops on the new master before
 * it were not heard). A check unanswered by the next tick is abandoned.
 *
 * It runs on the loop thread, through Debian's libhiredis asynchronous API and its libuv
 * adapter: nothing here blocks (a connect is non-blocking; a host name is resolved on libuv's
 * thread pool, uv_getaddrinfo, its first IPv4 address taken, else its first one). Loop thread
 * only.
 */
#ifndef KVD_RWATCH_H
#define KVD_RWATCH_H

#include <stddef.h>
#include <stdint.h>

#include <uv.h>

#include "common/kv_err.h"

typedef struct kvd_rwatch kvd_rwatch;

/* A key Redis dropped: expired (evicted 0) or evicted by maxmemory (1). key is not NUL-ended
 * and lives until the callback returns. */
typedef void (*kvd_rwatch_fn)(void *arg, const char *key, size_t len, int evicted);

typedef struct kvd_rwatch_cfg {
    const char *seeds;       /* "HOST:PORT[,HOST:PORT...]", as remote-redis */
    const char *password;    /* AUTH password, or "" (copied) */
    uint64_t timeout_ms;     /* the remote tier's timeout: discovery gives up after 5x */
    uint64_t backoff_max_ms; /* longest wait before the next discovery; 0: 5000 */
    uint64_t refresh_ms;     /* a check of the masters this often while all are subscribed; 0:
                                none */
} kvd_rwatch_cfg;

/* Parses the seeds and starts the first discovery (returns at once). KV_EINVAL with msg for a
 * bad seed list, KV_ENOMEM. */
kv_err kvd_rwatch_alloc(uv_loop_t *loop, const kvd_rwatch_cfg *cfg, kvd_rwatch_fn fn, void *arg,
                        kvd_rwatch **out, char *msg, size_t len);

/* Called each time every node is subscribed: the first time and after each gap, when drops may
 * have gone unheard; the caller then asks Redis what is gone (kvd_tiers' reconciliation against
 * its ledger, rledger.h). Set once, before the loop runs. */
typedef void (*kvd_rwatch_up_fn)(void *arg);
void kvd_rwatch_set_up_fn(kvd_rwatch *w, kvd_rwatch_up_fn fn, void *arg);

/* 1 while every node is subscribed (no gap open, discovery done), else 0; still 1 between a
 * check that found the masters changed and the restart it scheduled. */
int kvd_rwatch_up(const kvd_rwatch *w);

/* Drops every connection and stops the timers (the loop runs their close callbacks); fn is never
 * called again. Once. Accepts NULL. */
void kvd_rwatch_close(kvd_rwatch *w);

/* Frees it (after close, once the loop ran the close callbacks). Accepts NULL. */
void kvd_rwatch_free(kvd_rwatch *w);

typedef struct kvd_rwatch_stats {
    uint32_t nodes;        /* nodes subscribed now */
    uint32_t unconfigured; /* of the nodes asked, those whose notify-keyspace-events lacks E
                              with x and e (or A): their drops are not heard */
    uint64_t expired;      /* expiry notifications heard */
    uint64_t evicted;      /* eviction notifications heard */
    uint64_t discoveries;  /* discoveries started (the first one included) */
    uint64_t gaps;         /* times subscriptions that were up were lost (each counted once until
                              every node is subscribed again): drops in between went unheard */
    uint64_t checks;       /* checks of the masters answered (refresh_ms) */
    uint64_t changes;      /* of them, those that found the masters changed: the watch started
                              again (a gap too) */
} kvd_rwatch_stats;

void kvd_rwatch_get_stats(const kvd_rwatch *w, kvd_rwatch_stats *out);

#endif
