/* kvd_tenants: a flat table; lookups scan the file's lines (few) and then the dynamic uid
 * tenants (linear; resolve runs once per connection, not per request). */
#include "daemon/tenancy/tenant.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/config/conffile.h"
#include "daemon/core/pool.h"

#define MAX_IDS 64 /* uids or gids per tenant line */

typedef struct tenant {
    char name[KVD_TENANT_NAME_MAX];   /* NUL-terminated */
    int from_file;                    /* 1: a file line, 0: a "uid-N" or internal tenant */
    int internal;                     /* 1: reachable by no peer (self-test tenants) */
    uint32_t nuids, ngids;            /* used entries of uids, gids */
    uid_t uids[MAX_IDS];              /* file: uids listed; dynamic: uids[0] is its uid */
    gid_t gids[MAX_IDS];              /* file: gids listed */
    uint8_t token[KV_WIRE_MAX_TOKEN]; /* token-file contents (trailing whitespace cut) */
    uint32_t token_len;               /* 0: no token */
    uint32_t groups[KVD_MAX_DOMAINS_PER_TENANT - 2]; /* group numbers, file order */
    uint32_t ngroups;                                /* used entries of groups */
    int has_quota;                                   /* 1: quota below, else the default */
    kvd_quota quota;                                 /* own limits */
} tenant;

typedef struct group {
    char name[KVD_TENANT_NAME_MAX]; /* NUL-terminated */
} group;

struct kvd_tenants {
    tenant *v;          /* tenants by id */
    uint32_t n;         /* ids 0..n-1 handed out */
    uint32_t limit;     /* ids that may be handed out (one less with a commons) */
    group *groups;      /* groups by number */
    uint32_t ngroups;   /* used entries of groups */
    uint32_t commons_k; /* min-tenants of the commons; 0 = none */
    kvd_quota def;      /* quota of tenants without their own */
    kvd_events_line ev[KVD_MAX_EVENT_LINES]; /* `events` lines */
    uint32_t nev;
    kvd_tiers_line *tl; /* `tiers` lines (KVD_MAX_TIERS_LINES, allocated at the first) */
    uint32_t ntl;
};

kv_err kvd_tenants_alloc(kvd_tenants **out) {
    kvd_tenants *t = calloc(1, sizeof(*t));
    if (t == NULL) {
        return KV_ENOMEM;
    }
    t->v = calloc(KVD_MAX_TENANTS, sizeof(tenant));
    t->groups = calloc(KVD_MAX_GROUPS, sizeof(group));
    if (t->v == NULL || t->groups == NULL) {
        free(t->v);
        free(t->groups);
        free(t);
        return KV_ENOMEM;
    }
    t->limit = KVD_MAX_TENANTS;
    *out = t;
    return KV_OK;
}

void kvd_tenants_free(kvd_tenants *t) {
    if (t == NULL) {
        return;
    }
    free(t->v);
    free(t->groups);
    free(t->tl);
    free(t);
}

static int valid_name(const char *s, size_t n) {
    if (n == 0 || n >= KVD_TENANT_NAME_MAX) {
        return 0;
    }
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '.' || c == '_' || c == '-')) {
            return 0;
        }
    }
    return 1;
}

/* Parses "1,2,3" into ids; -1 on a bad number or too many. */
static int parse_ids(const char *s, uint32_t *ids, uint32_t *n) {
    *n = 0;
    while (*s != '\0') {
        if (*s < '0' || *s > '9' || *n == MAX_IDS) {
            return -1;
        }
        errno = 0;
        char *end;
        unsigned long v = strtoul(s, &end, 10);
        if (errno != 0 || v > UINT32_MAX - 1) {
            return -1;
        }
        ids[(*n)++] = (uint32_t)v;
        if (*end == ',' && end[1] != '\0') {
            end++;
        } else if (*end != '\0') {
            return -1;
        }
        s = end;
    }
    return *n > 0 ? 0 : -1;
}

/* Reads a token file: its bytes with trailing whitespace (a newline from an editor) cut. */
static kv_err read_token(const char *path, tenant *nt, const char *source, unsigned lineno,
                         char *err, size_t errlen) {
    FILE *f = fopen(path, "r");
    if (f == NULL) {
        kvd_conf_err(err, errlen, "%s:%u: token-file %s: %s", source, lineno, path,
                     strerror(errno));
        return KV_ESYS;
    }
    uint8_t buf[KV_WIRE_MAX_TOKEN + 2];
    size_t n = fread(buf, 1, sizeof(buf), f);
    fclose(f);
    while (n > 0 &&
           (buf[n - 1] == '\n' || buf[n - 1] == '\r' || buf[n - 1] == ' ' || buf[n - 1] == '\t')) {
        n--;
    }
    if (n < KVD_TOKEN_MIN || n > KV_WIRE_MAX_TOKEN) {
        kvd_conf_err(err, errlen, "%s:%u: token-file %s must hold %d..%d bytes", source, lineno,
                     path, KVD_TOKEN_MIN, KV_WIRE_MAX_TOKEN);
        return KV_EINVAL;
    }
    memcpy(nt->token, buf, n);
    nt->token_len = (uint32_t)n;
    return KV_OK;
}

static int find_name(const kvd_tenants *t, const char *name) {
    for (uint32_t i = 0; i < t->n; i++) {
        if (strcmp(t->v[i].name, name) == 0) {
            return (int)i;
        }
    }
    return -1;
}

static kv_err parse_tenant(kvd_tenants *t, char **save, const char *source, unsigned lineno,
                           char *err, size_t errlen) {
    char *name = strtok_r(NULL, " \t\r", save);
    if (name == NULL || !valid_name(name, strlen(name)) || strncmp(name, "uid-", 4) == 0 ||
        strcmp(name, "commons") == 0 || strcmp(name, "default") == 0) {
        kvd_conf_err(err, errlen,
                     "%s:%u: tenant name must be 1..63 of [A-Za-z0-9._-], not uid-N, commons or "
                     "default",
                     source, lineno);
        return KV_EINVAL;
    }
    if (find_name(t, name) >= 0) {
        kvd_conf_err(err, errlen, "%s:%u: tenant %s defined twice", source, lineno, name);
        return KV_EINVAL;
    }
    if (t->n >= t->limit) {
        kvd_conf_err(err, errlen, "%s:%u: more than %u tenants", source, lineno, t->limit);
        return KV_EQUOTA;
    }
    tenant *nt = calloc(1, sizeof(*nt));
    if (nt == NULL) {
        return KV_ENOMEM;
    }
    kv_err rc = KV_EINVAL;
    snprintf(nt->name, sizeof(nt->name), "%s", name);
    nt->from_file = 1;
    char *kv;
    while ((kv = strtok_r(NULL, " \t\r", save)) != NULL) {
        uint32_t ids[MAX_IDS], n;
        if (strncmp(kv, "uid=", 4) == 0 && parse_ids(kv + 4, ids, &n) == 0 && nt->nuids == 0) {
            for (uint32_t i = 0; i < n; i++) {
                nt->uids[i] = ids[i];
            }
            nt->nuids = n;
        } else if (strncmp(kv, "gid=", 4) == 0 && parse_ids(kv + 4, ids, &n) == 0 &&
                   nt->ngids == 0) {
            for (uint32_t i = 0; i < n; i++) {
                nt->gids[i] = ids[i];
            }
            nt->ngids = n;
        } else if (strncmp(kv, "token-file=", 11) == 0 && kv[11] != '\0' && nt->token_len == 0) {
            rc = read_token(kv + 11, nt, source, lineno, err, errlen);
            if (rc != KV_OK) {
                goto cleanup;
            }
            rc = KV_EINVAL;
        } else {
            kvd_conf_err(
                err, errlen,
                "%s:%u: '%s' is not uid=N[,N...], gid=N[,N...] (at most %d) or token-file=PATH",
                source, lineno, kv, MAX_IDS);
            goto cleanup;
        }
    }
    if (nt->nuids == 0 && nt->ngids == 0 && nt->token_len == 0) {
        kvd_conf_err(err, errlen, "%s:%u: tenant %s lists no uid=, gid= or token-file=", source,
                     lineno, name);
        goto cleanup;
    }
    for (uint32_t i = 0; i < t->n; i++) {
        if (nt->token_len != 0 && t->v[i].token_len == nt->token_len &&
            memcmp(t->v[i].token, nt->token, nt->token_len) == 0) {
            kvd_conf_err(err, errlen, "%s:%u: tenant %s has the same token as tenant %s", source,
                         lineno, name, t->v[i].name);
            goto cleanup;
        }
    }
    t->v[t->n++] = *nt;
    rc = KV_OK;
cleanup:
    memset(nt, 0, sizeof(*nt)); /* no token bytes left behind in freed memory */
    free(nt);
    return rc;
}

static kv_err parse_group(kvd_tenants *t, char **save, const char *source, unsigned lineno,
                          char *err, size_t errlen) {
    char *name = strtok_r(NULL, " \t\r", save);
    if (name == NULL || !valid_name(name, strlen(name))) {
        kvd_conf_err(err, errlen, "%s:%u: group name must be 1..63 of [A-Za-z0-9._-]", source,
                     lineno);
        return KV_EINVAL;
    }
    for (uint32_t i = 0; i < t->ngroups; i++) {
        if (strcmp(t->groups[i].name, name) == 0) {
            kvd_conf_err(err, errlen, "%s:%u: group %s defined twice", source, lineno, name);
            return KV_EINVAL;
        }
    }
    if (t->ngroups == KVD_MAX_GROUPS) {
        kvd_conf_err(err, errlen, "%s:%u: more than %d groups", source, lineno, KVD_MAX_GROUPS);
        return KV_EQUOTA;
    }
    char *kv = strtok_r(NULL, " \t\r", save);
    if (kv == NULL || strncmp(kv, "members=", 8) != 0 || strtok_r(NULL, " \t\r", save) != NULL) {
        kvd_conf_err(err, errlen, "%s:%u: expected 'group NAME members=TENANT,TENANT...'", source,
                     lineno);
        return KV_EINVAL;
    }
    /* Check every member before changing anything: a bad line leaves no half-joined group. */
    uint32_t members[MAX_IDS], nm = 0;
    char *msave = NULL;
    for (char *m = strtok_r(kv + 8, ",", &msave); m != NULL; m = strtok_r(NULL, ",", &msave)) {
        int id = find_name(t, m);
        if (id < 0 || !t->v[id].from_file) {
            kvd_conf_err(err, errlen, "%s:%u: group %s: member %s is not a tenant defined above",
                         source, lineno, name, m);
            return KV_EINVAL;
        }
        if (nm == MAX_IDS || t->v[id].ngroups == KVD_MAX_DOMAINS_PER_TENANT - 2) {
            kvd_conf_err(err, errlen, "%s:%u: group %s: too many members, or %s is in %d groups",
                         source, lineno, name, m, KVD_MAX_DOMAINS_PER_TENANT - 2);
            return KV_EINVAL;
        }
        members[nm++] = (uint32_t)id;
    }
    if (nm == 0) {
        kvd_conf_err(err, errlen, "%s:%u: group %s has no members", source, lineno, name);
        return KV_EINVAL;
    }
    uint32_t g = t->ngroups++;
    snprintf(t->groups[g].name, sizeof(t->groups[g].name), "%s", name);
    for (uint32_t i = 0; i < nm; i++) {
        tenant *m = &t->v[members[i]];
        int dup = 0;
        for (uint32_t j = 0; j < m->ngroups; j++) {
            dup |= m->groups[j] == g;
        }
        if (!dup) {
            m->groups[m->ngroups++] = g;
        }
    }
    return KV_OK;
}

static kv_err parse_commons(kvd_tenants *t, char **save, const char *source, unsigned lineno,
                            char *err, size_t errlen) {
    uint32_t k = 3;
    char *kv = strtok_r(NULL, " \t\r", save);
    if (kv != NULL) {
        uint32_t ids[MAX_IDS], n;
        if (strncmp(kv, "min-tenants=", 12) != 0 || parse_ids(kv + 12, ids, &n) != 0 || n != 1 ||
            ids[0] < 2 || ids[0] > KVD_COMMONS_MAX_K || strtok_r(NULL, " \t\r", save) != NULL) {
            kvd_conf_err(err, errlen, "%s:%u: expected 'commons [min-tenants=K]' with K in 2..%d",
                         source, lineno, KVD_COMMONS_MAX_K);
            return KV_EINVAL;
        }
        k = ids[0];
    }
    if (t->n > KVD_COMMONS_TENANT) {
        kvd_conf_err(err, errlen, "%s:%u: the commons needs a free tenant id", source, lineno);
        return KV_EQUOTA;
    }
    t->commons_k = k;
    t->limit = KVD_COMMONS_TENANT;
    return KV_OK;
}

static kv_err parse_quota(kvd_tenants *t, char **save, const char *source, unsigned lineno,
                          char *err, size_t errlen) {
    char *name = strtok_r(NULL, " \t\r", save);
    int id = -1;
    if (name == NULL || (strcmp(name, "default") != 0 && (id = find_name(t, name)) < 0)) {
        kvd_conf_err(err, errlen,
                     "%s:%u: expected 'quota TENANT|default NAME=N...' after the tenant", source,
                     lineno);
        return KV_EINVAL;
    }
    kvd_quota q = id >= 0 ? *kvd_tenants_quota(t, (uint32_t)id) : t->def;
    char *kv;
    while ((kv = strtok_r(NULL, " \t\r", save)) != NULL) {
        char *eq = strchr(kv, '=');
        if (eq == NULL) {
            kvd_conf_err(err, errlen, "%s:%u: '%s' is not NAME=N (%s)", source, lineno, kv,
                         KVD_QUOTA_NAMES);
            return KV_EINVAL;
        }
        *eq = '\0';
        if (kvd_quota_parse_field(&q, kv, eq + 1) != KV_OK) {
            kvd_conf_err(err, errlen,
                         "%s:%u: '%s=%s': names are %s, values decimal (the *-bytes limits: a "
                         "size, 64K, 1G)",
                         source, lineno, kv, eq + 1, KVD_QUOTA_NAMES);
            return KV_EINVAL;
        }
    }
    kvd_tenants_set_quota(t, id >= 0 ? (uint32_t)id : UINT32_MAX, &q);
    return KV_OK;
}

/* One domain name of an events line: a tenant or group defined above, or commons. */
static int event_domain(const kvd_tenants *t, const char *name, uint32_t *out) {
    if (strcmp(name, "commons") == 0) {
        *out = KVD_DOMAIN_COMMONS;
        return 0;
    }
    if (strncmp(name, "group:", 6) == 0) {
        for (uint32_t g = 0; g < t->ngroups; g++) {
            if (strcmp(t->groups[g].name, name + 6) == 0) {
                *out = KVD_DOMAIN_GROUP0 + g;
                return 0;
            }
        }
        return -1;
    }
    int id = find_name(t, name);
    if (id < 0 || !t->v[id].from_file) {
        return -1;
    }
    *out = (uint32_t)id;
    return 0;
}

static int on_off(const char *v, int *out) {
    if (strcmp(v, "on") == 0 || strcmp(v, "yes") == 0 || strcmp(v, "true") == 0) {
        *out = 1;
        return 0;
    }
    if (strcmp(v, "off") == 0 || strcmp(v, "no") == 0 || strcmp(v, "false") == 0) {
        *out = 0;
        return 0;
    }
    return -1;
}

static kv_err parse_events(kvd_tenants *t, char **save, const char *source, unsigned lineno,
                           char *err, size_t errlen) {
    if (t->nev == KVD_MAX_EVENT_LINES) {
        kvd_conf_err(err, errlen, "%s:%u: more than %d events lines", source, lineno,
                     KVD_MAX_EVENT_LINES);
        return KV_EQUOTA;
    }
    kvd_events_line l;
    memset(&l, 0, sizeof(l));
    l.buffer = 10000;
    l.lineno = lineno;
    unsigned seen = 0;
    char *kv;
    while ((kv = strtok_r(NULL, " \t\r", save)) != NULL) {
        char *eq = strchr(kv, '=');
        if (eq == NULL) {
            kvd_conf_err(err, errlen, "%s:%u: events: '%s' is not NAME=VALUE", source, lineno, kv);
            return KV_EINVAL;
        }
        *eq = '\0';
        const char *v = eq + 1;
        int bad = 0;
        static const char *const keys[] = {"endpoint",  "replay", "topic",  "token-ids",
                                           "hash-form", "format", "buffer", "domains"};
        for (unsigned k = 0; k < sizeof(keys) / sizeof(keys[0]); k++) {
            if (strcmp(kv, keys[k]) == 0 && (seen & (1u << k))) {
                kvd_conf_err(err, errlen, "%s:%u: events: %s given twice", source, lineno, kv);
                return KV_EINVAL;
            } else if (strcmp(kv, keys[k]) == 0) {
                seen |= 1u << k;
            }
        }
        if (strcmp(kv, "endpoint") == 0 || strcmp(kv, "replay") == 0 || strcmp(kv, "topic") == 0) {
            char *dst = kv[0] == 'e' ? l.endpoint : kv[0] == 'r' ? l.replay : l.topic;
            size_t cap = kv[0] == 't' ? sizeof(l.topic) : sizeof(l.endpoint);
            bad = strlen(v) >= cap;
            if (!bad) {
                snprintf(dst, cap, "%s", v);
            }
        } else if (strcmp(kv, "token-ids") == 0) {
            bad = on_off(v, &l.token_ids) != 0;
        } else if (strcmp(kv, "hash-form") == 0) {
            bad = strcmp(v, "int") != 0 && strcmp(v, "bytes") != 0;
            l.hash_bytes = strcmp(v, "bytes") == 0;
        } else if (strcmp(kv, "format") == 0) {
            bad = strcmp(v, "array") != 0 && strcmp(v, "map") != 0;
            l.map = strcmp(v, "map") == 0;
        } else if (strcmp(kv, "buffer") == 0) {
            char *end;
            errno = 0;
            unsigned long long b = strtoull(v, &end, 10);
            bad = *v == '\0' || *end != '\0' || errno != 0 || b < 1 || b > (1u << 24);
            l.buffer = b;
        } else if (strcmp(kv, "domains") == 0) {
            char *dsave = NULL;
            char *list = (char *)v;
            for (char *d = strtok_r(list, ",", &dsave); d != NULL;
                 d = strtok_r(NULL, ",", &dsave)) {
                uint32_t dom;
                if (event_domain(t, d, &dom) != 0) {
                    kvd_conf_err(err, errlen,
                                 "%s:%u: events: domain '%s' is not a tenant or group:NAME "
                                 "defined above, or commons",
                                 source, lineno, d);
                    return KV_EINVAL;
                }
                for (uint32_t j = 0; j < l.ndomains; j++) {
                    if (l.domains[j] == dom) {
                        kvd_conf_err(err, errlen, "%s:%u: events: domain '%s' listed twice", source,
                                     lineno, d);
                        return KV_EINVAL;
                    }
                }
                for (uint32_t i = 0; i < t->nev; i++) {
                    for (uint32_t j = 0; j < t->ev[i].ndomains; j++) {
                        if (t->ev[i].domains[j] == dom) {
                            kvd_conf_err(err, errlen,
                                         "%s:%u: events: domain '%s' is already on the events "
                                         "line of line %u",
                                         source, lineno, d, t->ev[i].lineno);
                            return KV_EINVAL;
                        }
                    }
                }
                if (l.ndomains == KVD_EVENT_LINE_DOMAINS) {
                    kvd_conf_err(err, errlen, "%s:%u: events: more than %d domains", source, lineno,
                                 KVD_EVENT_LINE_DOMAINS);
                    return KV_EINVAL;
                }
                l.domains[l.ndomains++] = dom;
            }
        } else {
            kvd_conf_err(err, errlen,
                         "%s:%u: events: unknown '%s' (endpoint, replay, topic, token-ids, "
                         "hash-form, format, buffer, domains)",
                         source, lineno, kv);
            return KV_EINVAL;
        }
        if (bad) {
            kvd_conf_err(err, errlen, "%s:%u: events: bad value '%s' for %s", source, lineno, v,
                         kv);
            return KV_EINVAL;
        }
    }
    if (l.endpoint[0] == '\0' || l.ndomains == 0) {
        kvd_conf_err(err, errlen,
                     "%s:%u: expected 'events endpoint=URL [replay=URL] [topic=T] "
                     "[token-ids=on|off] [hash-form=int|bytes] [format=array|map] [buffer=N] "
                     "domains=NAME,...'",
                     source, lineno);
        return KV_EINVAL;
    }
    t->ev[t->nev++] = l;
    return KV_OK;
}

/* A `tiers` line (tenant.h has its meaning). */
static kv_err parse_tiers(kvd_tenants *t, char **save, const char *source, unsigned lineno,
                          char *err, size_t errlen) {
    if (t->ntl == KVD_MAX_TIERS_LINES) {
        kvd_conf_err(err, errlen, "%s:%u: more than %d tiers lines", source, lineno,
                     KVD_MAX_TIERS_LINES);
        return KV_EQUOTA;
    }
    if (t->tl == NULL && (t->tl = calloc(KVD_MAX_TIERS_LINES, sizeof(*t->tl))) == NULL) {
        return KV_ENOMEM;
    }
    kvd_tiers_line l;
    memset(&l, 0, sizeof(l));
    l.write_through = l.remote_back = -1;
    l.min_hits = l.clean_ahead = -1;
    l.lineno = lineno;
    unsigned seen = 0, nset = 0;
    char *kv;
    while ((kv = strtok_r(NULL, " \t\r", save)) != NULL) {
        char *eq = strchr(kv, '=');
        if (eq == NULL) {
            kvd_conf_err(err, errlen, "%s:%u: tiers: '%s' is not NAME=VALUE", source, lineno, kv);
            return KV_EINVAL;
        }
        *eq = '\0';
        const char *v = eq + 1;
        static const char *const keys[] = {"model",    "domains",     "write",
                                           "min-hits", "clean-ahead", "remote-write"};
        int k = -1;
        for (int i = 0; i < (int)(sizeof(keys) / sizeof(keys[0])); i++) {
            k = strcmp(kv, keys[i]) == 0 ? i : k;
        }
        if (k < 0) {
            kvd_conf_err(err, errlen,
                         "%s:%u: tiers: unknown '%s' (model, domains, write, min-hits, "
                         "clean-ahead, remote-write)",
                         source, lineno, kv);
            return KV_EINVAL;
        }
        if (seen & (1u << k)) {
            kvd_conf_err(err, errlen, "%s:%u: tiers: %s given twice", source, lineno, kv);
            return KV_EINVAL;
        }
        seen |= 1u << k;
        int bad = 0;
        if (k == 0) {
            bad = v[0] == '\0' || strlen(v) > KV_WIRE_MAX_MODEL_ID;
            if (!bad) {
                snprintf(l.model, sizeof(l.model), "%s", v);
            }
        } else if (k == 1) {
            char *dsave = NULL;
            for (char *d = strtok_r((char *)v, ",", &dsave); d != NULL;
                 d = strtok_r(NULL, ",", &dsave)) {
                uint32_t dom;
                if (event_domain(t, d, &dom) != 0) {
                    kvd_conf_err(err, errlen,
                                 "%s:%u: tiers: domain '%s' is not a tenant or group:NAME "
                                 "defined above, or commons",
                                 source, lineno, d);
                    return KV_EINVAL;
                }
                if (l.ndomains == KVD_EVENT_LINE_DOMAINS) {
                    kvd_conf_err(err, errlen, "%s:%u: tiers: more than %d domains", source, lineno,
                                 KVD_EVENT_LINE_DOMAINS);
                    return KV_EINVAL;
                }
                l.domains[l.ndomains++] = dom;
            }
            bad = l.ndomains == 0;
        } else if (k == 2 || k == 5) {
            bad = strcmp(v, "write-back") != 0 && strcmp(v, "write-through") != 0;
            if (k == 2) {
                l.write_through = strcmp(v, "write-through") == 0;
            } else {
                l.remote_back = strcmp(v, "write-back") == 0;
            }
            nset++;
        } else {
            char *end;
            errno = 0;
            unsigned long long n = strtoull(v, &end, 10);
            bad = *v == '\0' || *end != '\0' || errno != 0 || n > (1u << 20) || (k == 4 && n == 0);
            *(k == 3 ? &l.min_hits : &l.clean_ahead) = (int64_t)n;
            nset++;
        }
        if (bad) {
            kvd_conf_err(err, errlen, "%s:%u: tiers: bad value '%s' for %s", source, lineno, v, kv);
            return KV_EINVAL;
        }
    }
    if (nset == 0) {
        kvd_conf_err(err, errlen,
                     "%s:%u: expected 'tiers [model=M] [domains=NAME,...] "
                     "[write=write-back|write-through] [remote-write=write-back|write-through] "
                     "[min-hits=N] [clean-ahead=N]' with at least one setting",
                     source, lineno);
        return KV_EINVAL;
    }
    t->tl[t->ntl++] = l;
    return KV_OK;
}

const kvd_tiers_line *kvd_tenants_tiers_rule(const kvd_tenants *t, const char *model,
                                             uint32_t domain) {
    for (uint32_t i = 0; t != NULL && i < t->ntl; i++) {
        const kvd_tiers_line *l = &t->tl[i];
        if (l->model[0] != '\0' && strcmp(l->model, model) != 0) {
            continue;
        }
        int in = l->ndomains == 0;
        for (uint32_t j = 0; j < l->ndomains && !in; j++) {
            in = l->domains[j] == domain;
        }
        if (in) {
            return l;
        }
    }
    return NULL;
}

uint32_t kvd_tenants_event_lines(const kvd_tenants *t, const kvd_events_line **out) {
    *out = t->ev;
    return t->nev;
}

static kv_err parse_line(kvd_tenants *t, char *line, const char *source, unsigned lineno, char *err,
                         size_t errlen) {
    char *save = NULL;
    char *word = strtok_r(line, " \t\r", &save);
    if (word == NULL) {
        return KV_OK;
    }
    if (strcmp(word, "tenant") == 0) {
        return parse_tenant(t, &save, source, lineno, err, errlen);
    }
    if (strcmp(word, "group") == 0) {
        return parse_group(t, &save, source, lineno, err, errlen);
    }
    if (strcmp(word, "commons") == 0) {
        return parse_commons(t, &save, source, lineno, err, errlen);
    }
    if (strcmp(word, "quota") == 0) {
        return parse_quota(t, &save, source, lineno, err, errlen);
    }
    if (strcmp(word, "events") == 0) {
        return parse_events(t, &save, source, lineno, err, errlen);
    }
    if (strcmp(word, "tiers") == 0) {
        return parse_tiers(t, &save, source, lineno, err, errlen);
    }
    kvd_conf_err(err, errlen,
                 "%s:%u: expected a tenant, group, commons, quota, events or tiers line", source,
                 lineno);
    return KV_EINVAL;
}

kv_err kvd_tenants_parse(kvd_tenants *t, const char *text, const char *source, char *err,
                         size_t errlen) {
    char *copy = strdup(text);
    if (copy == NULL) {
        return KV_ENOMEM;
    }
    kv_err rc = KV_OK;
    kvd_conf_lines it;
    kvd_conf_lines_init(&it, copy);
    char *line;
    while ((line = kvd_conf_lines_next(&it)) != NULL) {
        rc = parse_line(t, line, source, it.lineno, err, errlen);
        if (rc != KV_OK) {
            break;
        }
    }
    free(copy);
    return rc;
}

kv_err kvd_tenants_load(kvd_tenants *t, const char *path, char *err, size_t errlen) {
    FILE *f = fopen(path, "r");
    if (f == NULL) {
        kvd_conf_err(err, errlen, "%s: %s", path, strerror(errno));
        return KV_ESYS;
    }
    kv_err rc = KV_OK;
    char *text = calloc(1, 1u << 20);
    if (text == NULL) {
        rc = KV_ENOMEM;
        goto cleanup_file;
    }
    size_t n = fread(text, 1, (1u << 20) - 1, f);
    if (n == (1u << 20) - 1) {
        kvd_conf_err(err, errlen, "%s: larger than 1 MiB", path);
        rc = KV_ETOOBIG;
        goto cleanup_text;
    }
    rc = kvd_tenants_parse(t, text, path, err, errlen);
cleanup_text:
    free(text);
cleanup_file:
    fclose(f);
    return rc;
}

kv_err kvd_tenants_resolve(kvd_tenants *t, uid_t uid, gid_t gid, uint32_t *id) {
    for (uint32_t i = 0; i < t->n; i++) {
        for (uint32_t j = 0; t->v[i].from_file && t->v[i].token_len == 0 && j < t->v[i].nuids;
             j++) {
            if (t->v[i].uids[j] == uid) {
                *id = i;
                return KV_OK;
            }
        }
    }
    for (uint32_t i = 0; i < t->n; i++) {
        for (uint32_t j = 0; t->v[i].from_file && t->v[i].token_len == 0 && j < t->v[i].ngids;
             j++) {
            if (t->v[i].gids[j] == gid) {
                *id = i;
                return KV_OK;
            }
        }
    }
    for (uint32_t i = 0; i < t->n; i++) {
        if (!t->v[i].from_file && !t->v[i].internal && t->v[i].uids[0] == uid) {
            *id = i;
            return KV_OK;
        }
    }
    if (t->n >= t->limit) {
        return KV_EQUOTA;
    }
    tenant *nt = &t->v[t->n];
    memset(nt, 0, sizeof(*nt));
    snprintf(nt->name, sizeof(nt->name), "uid-%u", (unsigned)uid);
    nt->uids[0] = uid;
    nt->nuids = 1;
    *id = t->n++;
    return KV_OK;
}

/* Constant time in the token's length: no early exit tells a prober how much matched. */
static int token_equal(const uint8_t *a, const uint8_t *b, size_t n) {
    uint8_t d = 0;
    for (size_t i = 0; i < n; i++) {
        d |= (uint8_t)(a[i] ^ b[i]);
    }
    return d == 0;
}

kv_err kvd_tenants_resolve_token(kvd_tenants *t, uid_t uid, gid_t gid, const uint8_t *token,
                                 size_t len, uint32_t *id) {
    int found = -1;
    for (uint32_t i = 0; i < t->n; i++) {
        const tenant *c = &t->v[i];
        if (c->token_len != 0 && c->token_len == len && token_equal(c->token, token, len)) {
            found = (int)i;
        }
    }
    if (found < 0) {
        return KV_EAUTH;
    }
    const tenant *c = &t->v[found];
    int admitted = c->nuids == 0 && c->ngids == 0;
    for (uint32_t j = 0; j < c->nuids; j++) {
        admitted |= c->uids[j] == uid;
    }
    for (uint32_t j = 0; j < c->ngids; j++) {
        admitted |= c->gids[j] == gid;
    }
    if (!admitted) {
        return KV_EAUTH;
    }
    *id = (uint32_t)found;
    return KV_OK;
}

kv_err kvd_tenants_find(const kvd_tenants *t, const char *name, uint32_t *id) {
    int i = find_name(t, name);
    if (i < 0) {
        return KV_ENOENT;
    }
    *id = (uint32_t)i;
    return KV_OK;
}

kv_err kvd_tenants_add_internal(kvd_tenants *t, const char *name, uint32_t *id) {
    int i = find_name(t, name);
    if (i >= 0) {
        if (!t->v[i].internal) {
            return KV_EEXIST;
        }
        *id = (uint32_t)i;
        return KV_OK;
    }
    if (t->n >= t->limit) {
        return KV_EQUOTA;
    }
    tenant *nt = &t->v[t->n];
    memset(nt, 0, sizeof(*nt));
    snprintf(nt->name, sizeof(nt->name), "%s", name);
    nt->internal = 1;
    *id = t->n++;
    return KV_OK;
}

uint32_t kvd_tenants_domains(const kvd_tenants *t, uint32_t id, uint32_t *out) {
    uint32_t n = 0;
    out[n++] = id;
    if (id < t->n) {
        for (uint32_t i = 0; i < t->v[id].ngroups; i++) {
            out[n++] = KVD_DOMAIN_GROUP0 + t->v[id].groups[i];
        }
    }
    if (t->commons_k != 0) {
        out[n++] = KVD_DOMAIN_COMMONS;
    }
    return n;
}

int kvd_tenants_domain_writable(const kvd_tenants *t, uint32_t id, uint32_t domain) {
    if (domain == id) {
        return 1;
    }
    if (id >= t->n || domain < KVD_DOMAIN_GROUP0 || domain == KVD_DOMAIN_COMMONS) {
        return 0;
    }
    for (uint32_t i = 0; i < t->v[id].ngroups; i++) {
        if (KVD_DOMAIN_GROUP0 + t->v[id].groups[i] == domain) {
            return 1;
        }
    }
    return 0;
}

const char *kvd_tenants_domain_name(const kvd_tenants *t, uint32_t domain, char *buf, size_t len) {
    if (domain == KVD_DOMAIN_COMMONS) {
        snprintf(buf, len, "commons");
    } else if (domain >= KVD_DOMAIN_GROUP0 && domain - KVD_DOMAIN_GROUP0 < t->ngroups) {
        snprintf(buf, len, "group:%s", t->groups[domain - KVD_DOMAIN_GROUP0].name);
    } else {
        snprintf(buf, len, "%s", kvd_tenants_name(t, domain));
    }
    return buf;
}

uint32_t kvd_tenants_commons_k(const kvd_tenants *t) {
    return t->commons_k;
}

const kvd_quota *kvd_tenants_quota(const kvd_tenants *t, uint32_t id) {
    if (id < t->n && t->v[id].has_quota) {
        return &t->v[id].quota;
    }
    return &t->def;
}

void kvd_tenants_set_quota(kvd_tenants *t, uint32_t id, const kvd_quota *q) {
    if (id == UINT32_MAX) {
        t->def = *q;
    } else if (id < t->n) {
        t->v[id].quota = *q;
        t->v[id].has_quota = 1;
    }
}

const char *kvd_tenants_name(const kvd_tenants *t, uint32_t id) {
    if (id == KVD_COMMONS_TENANT && t->commons_k != 0) {
        return "commons";
    }
    return id < t->n ? t->v[id].name : "?";
}

uint32_t kvd_tenants_count(const kvd_tenants *t) {
    return t->n;
}
