/* kvd_tenants: who a peer is. Maps kernel credentials (SO_PEERCRED uid, gid) to a tenant.
 *
 * The tenants file has one tenant per line, `#` comments:
 *     tenant NAME uid=1000,1001 gid=2000,2001
 *     tenant NAME [uid=U,U...] [gid=G,G...] [token-file=PATH]
 *     group NAME members=TENANT,TENANT...
 *     commons [min-tenants=K]
 *     quota NAME|default [max-held=N] [guarantee=N] [max-pinned=N] [max-sessions=N]
 *           [max-pools=N] [tier-max=N] [tier-guarantee=N] [tier-max-bytes=SIZE]
 *           [tier-guarantee-bytes=SIZE] [tier-total-bytes=SIZE]
 *     events endpoint=URL [replay=URL] [topic=T] [token-ids=on|off] [hash-form=int|bytes]
 *            [format=array|map] [buffer=N] domains=NAME,group:NAME,commons
 *     tiers [model=M] [domains=NAME,group:NAME,commons] [write=write-back|write-through]
 *           [remote-write=write-back|write-through] [min-hits=N] [clean-ahead=N]
 * (a tenant needs at least one of uid=, gid=, token-file=; NAME is 1..63 of [A-Za-z0-9._-], not
 * "uid-N", "commons" or "default"). Without a token a peer gets the first token-less line whose
 * uid list holds its uid, else the first token-less line whose gid list holds its gid, else the
 * tenant "uid-<uid>" made on first sight. With a token (Hello.token) the peer gets the tenant
 * whose token-file holds exactly those bytes, and only if its uid/gid lists (when given) admit
 * the peer; anything else is KV_EAUTH. A tenant with a token is never reached without it.
 * Tenant ids are small integers (file tenants first, in file order), < KVD_MAX_TENANTS, never
 * reused in one daemon run.
 *
 * Domains (docs/TENANCY.md): tenant t's private domain is t; group g is KVD_DOMAIN_GROUP0 + g;
 * the commons is KVD_DOMAIN_COMMONS (only with a `commons` line; a prefix enters it once
 * min-tenants distinct tenants committed it). With a commons, tenant id KVD_COMMONS_TENANT owns
 * the commons' blocks and is not handed out. Loop thread only.
 */
#ifndef KVD_TENANT_H
#define KVD_TENANT_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "common/kv_err.h"
#include "common/kv_limits.h"

#include "daemon/tenancy/quota.h"

#define KVD_TENANT_NAME_MAX 64                    /* bytes including the NUL */
#define KVD_TOKEN_MIN 16                          /* a token-file must hold at least this */
#define KVD_MAX_GROUPS 256                        /* group lines */
#define KVD_MAX_DOMAINS_PER_TENANT 18             /* private + at most 16 groups + commons */
#define KVD_DOMAIN_GROUP0 0x10000u                /* domain of group 0 */
#define KVD_DOMAIN_COMMONS 0xFFFFFFF0u            /* the commons domain */
#define KVD_COMMONS_TENANT (KVD_MAX_TENANTS - 1u) /* owner of commons blocks */
#define KVD_COMMONS_MAX_K 16                      /* largest min-tenants */

typedef struct kvd_tenants kvd_tenants;

/* One `events` line: a KV-event publisher (docs/EVENTS.md) of its own, carrying only the listed
 * domains (tenants and groups defined above it, or commons). A domain is on one line at most;
 * the daemon's kv-events-* options make the publisher of every domain no line names. */
#define KVD_MAX_EVENT_LINES 16
#define KVD_EVENT_LINE_DOMAINS 64
typedef struct kvd_events_line {
    char endpoint[256]; /* ZMQ PUB endpoint, bound */
    char replay[256];   /* ZMQ ROUTER endpoint for replays; "" = none */
    char topic[128];    /* topic frame */
    int token_ids;      /* BlockStored carries token ids */
    int hash_bytes;     /* hashes as the digest's bytes (else vLLM's u64 form) */
    int map;            /* events as maps (vLLM's newer schema), else array-like */
    uint64_t buffer;    /* batches kept for replay */
    uint32_t domains[KVD_EVENT_LINE_DOMAINS];
    uint32_t ndomains;
    unsigned lineno; /* for messages */
} kvd_events_line;

/* One `tiers` line: the lower-tier policy of the pools it matches (docs/TIERS.md, "Per pool"),
 * applied when such a pool is made, as admin `tiers pool=ID ...` would. A pool matches when its
 * model id is model (or the line names none) and its domain is listed (or the line lists none);
 * the first matching line in file order wins. A setting left out stays the daemon's option. */
#define KVD_MAX_TIERS_LINES 64
typedef struct kvd_tiers_line {
    char model[KV_WIRE_MAX_MODEL_ID + 1]; /* "" = any model */
    uint32_t domains[KVD_EVENT_LINE_DOMAINS];
    uint32_t ndomains; /* 0 = any domain */
    int write_through; /* 1 write-through, 0 write-back, -1 not set */
    int remote_back;   /* remote-write: 1 write-back, 0 write-through, -1 not set */
    int64_t min_hits;  /* -1 not set */
    int64_t clean_ahead;
    unsigned lineno;
} kvd_tiers_line;

/* An empty map (every uid its own tenant). KV_ENOMEM. */
kv_err kvd_tenants_alloc(kvd_tenants **out);

/* Frees the map; accepts NULL. */
void kvd_tenants_free(kvd_tenants *t);

/* Adds the tenant lines of text (see above). KV_EINVAL with "source:line: why" in err for a
 * bad line or a duplicate name; KV_EQUOTA past KVD_MAX_TENANTS. Lines before a bad one stay. */
kv_err kvd_tenants_parse(kvd_tenants *t, const char *text, const char *source, char *err,
                         size_t errlen);

/* Reads path and parses it. KV_ESYS when it cannot be read. */
kv_err kvd_tenants_load(kvd_tenants *t, const char *path, char *err, size_t errlen);

/* Resolves credentials to a tenant id, creating "uid-N" on first sight. KV_EQUOTA when the
 * table is full. Tenants with a token are skipped (they need kvd_tenants_resolve_token). */
kv_err kvd_tenants_resolve(kvd_tenants *t, uid_t uid, gid_t gid, uint32_t *id);

/* Resolves a Hello token (len 1..KV_WIRE_MAX_TOKEN bytes): the tenant whose token it is, if its
 * uid/gid lists (when it has any) admit (uid, gid). KV_EAUTH otherwise. Compares every token in
 * constant time for its length. */
kv_err kvd_tenants_resolve_token(kvd_tenants *t, uid_t uid, gid_t gid, const uint8_t *token,
                                 size_t len, uint32_t *id);

/* Finds a tenant by name. KV_ENOENT when unknown. */
kv_err kvd_tenants_find(const kvd_tenants *t, const char *name, uint32_t *id);

/* Adds (or finds) a tenant with no credentials, reachable by no peer: for the isolation
 * self-test. Names may contain ':' (file names cannot), so they never clash. KV_EQUOTA. */
kv_err kvd_tenants_add_internal(kvd_tenants *t, const char *name, uint32_t *id);

/* Writes tenant id's domains in lookup order (private, its groups in file order, commons) to
 * out (capacity KVD_MAX_DOMAINS_PER_TENANT) and returns how many. */
uint32_t kvd_tenants_domains(const kvd_tenants *t, uint32_t id, uint32_t *out);

/* 1 when tenant id may allocate and commit in domain (its private domain and its groups). */
int kvd_tenants_domain_writable(const kvd_tenants *t, uint32_t id, uint32_t domain);

/* A domain's name into buf: the tenant's name, "group:NAME", or "commons". */
const char *kvd_tenants_domain_name(const kvd_tenants *t, uint32_t domain, char *buf, size_t len);

/* Distinct tenants that must commit a block before it enters the commons; 0 = no commons. */
uint32_t kvd_tenants_commons_k(const kvd_tenants *t);

/* The quota tenant id obeys (its own, else the default). */
const kvd_quota *kvd_tenants_quota(const kvd_tenants *t, uint32_t id);

/* Gives tenant id its own quota (id UINT32_MAX: the default). */
void kvd_tenants_set_quota(kvd_tenants *t, uint32_t id, const kvd_quota *q);

/* The tenant's name; "?" for an id never handed out. */
const char *kvd_tenants_name(const kvd_tenants *t, uint32_t id);

/* The `events` lines, in file order, into *out; returns how many. */
uint32_t kvd_tenants_event_lines(const kvd_tenants *t, const kvd_events_line **out);

/* The first `tiers` line that matches a pool of model in domain, or NULL. */
const kvd_tiers_line *kvd_tenants_tiers_rule(const kvd_tenants *t, const char *model,
                                             uint32_t domain);

/* Number of tenants known. */
uint32_t kvd_tenants_count(const kvd_tenants *t);

#endif
