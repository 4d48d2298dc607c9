/* kvd_tenants: a flat table; lookups scan the file's lines (few) and then the dynamic uid
 * tenants (linear; resolve runs once per connection, not per request). */
#include "daemon/tenant.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/pool.h"

#define MAX_IDS 64 /* uids or gids per tenant line */

typedef struct tenant {
    char name[KVD_TENANT_NAME_MAX]; /* NUL-terminated */
    int from_file;                  /* 1: a file line, 0: a "uid-N" tenant */
    uint32_t nuids, ngids;          /* used entries of uids, gids */
    uid_t uids[MAX_IDS];            /* file: uids listed; dynamic: uids[0] is its uid */
    gid_t gids[MAX_IDS];            /* file: gids listed */
} tenant;

struct kvd_tenants {
    tenant *v;  /* tenants by id */
    uint32_t n; /* ids 0..n-1 handed out */
};

static void set_err(char *err, size_t errlen, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void set_err(char *err, size_t errlen, const char *fmt, ...) {
    if (err == NULL || errlen == 0) {
        return;
    }
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

kv_err kvd_tenants_alloc(kvd_tenants **out) {
    kvd_tenants *t = calloc(1, sizeof(*t));
    if (t == NULL) {
        return KV_ENOMEM;
    }
    t->v = calloc(KVD_MAX_TENANTS, sizeof(tenant));
    if (t->v == NULL) {
        free(t);
        return KV_ENOMEM;
    }
    *out = t;
    return KV_OK;
}

void kvd_tenants_free(kvd_tenants *t) {
    if (t == NULL) {
        return;
    }
    free(t->v);
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

static kv_err parse_line(kvd_tenants *t, char *line, const char *source, unsigned lineno, char *err,
                         size_t errlen) {
    char *save = NULL;
    char *word = strtok_r(line, " \t\r", &save);
    if (word == NULL) {
        return KV_OK;
    }
    if (strcmp(word, "tenant") != 0) {
        set_err(err, errlen, "%s:%u: expected 'tenant NAME uid=... gid=...'", source, lineno);
        return KV_EINVAL;
    }
    char *name = strtok_r(NULL, " \t\r", &save);
    if (name == NULL || !valid_name(name, strlen(name)) || strncmp(name, "uid-", 4) == 0) {
        set_err(err, errlen, "%s:%u: tenant name must be 1..63 of [A-Za-z0-9._-], not uid-N",
                source, lineno);
        return KV_EINVAL;
    }
    for (uint32_t i = 0; i < t->n; i++) {
        if (strcmp(t->v[i].name, name) == 0) {
            set_err(err, errlen, "%s:%u: tenant %s defined twice", source, lineno, name);
            return KV_EINVAL;
        }
    }
    if (t->n == KVD_MAX_TENANTS) {
        set_err(err, errlen, "%s:%u: more than %d tenants", source, lineno, KVD_MAX_TENANTS);
        return KV_EQUOTA;
    }
    tenant nt;
    memset(&nt, 0, sizeof(nt));
    snprintf(nt.name, sizeof(nt.name), "%s", name);
    nt.from_file = 1;
    char *kv;
    while ((kv = strtok_r(NULL, " \t\r", &save)) != NULL) {
        uint32_t ids[MAX_IDS], n;
        if (strncmp(kv, "uid=", 4) == 0 && parse_ids(kv + 4, ids, &n) == 0 && nt.nuids == 0) {
            for (uint32_t i = 0; i < n; i++) {
                nt.uids[i] = ids[i];
            }
            nt.nuids = n;
        } else if (strncmp(kv, "gid=", 4) == 0 && parse_ids(kv + 4, ids, &n) == 0 &&
                   nt.ngids == 0) {
            for (uint32_t i = 0; i < n; i++) {
                nt.gids[i] = ids[i];
            }
            nt.ngids = n;
        } else {
            set_err(err, errlen, "%s:%u: '%s' is not uid=N[,N...] or gid=N[,N...] (at most %d)",
                    source, lineno, kv, MAX_IDS);
            return KV_EINVAL;
        }
    }
    if (nt.nuids == 0 && nt.ngids == 0) {
        set_err(err, errlen, "%s:%u: tenant %s lists no uid= or gid=", source, lineno, name);
        return KV_EINVAL;
    }
    t->v[t->n++] = nt;
    return KV_OK;
}

kv_err kvd_tenants_parse(kvd_tenants *t, const char *text, const char *source, char *err,
                         size_t errlen) {
    char *copy = strdup(text);
    if (copy == NULL) {
        return KV_ENOMEM;
    }
    kv_err rc = KV_OK;
    unsigned lineno = 0;
    char *line = copy;
    while (line != NULL) {
        char *next = strchr(line, '\n');
        if (next != NULL) {
            *next++ = '\0';
        }
        lineno++;
        char *hash = strchr(line, '#');
        if (hash != NULL) {
            *hash = '\0';
        }
        rc = parse_line(t, line, source, lineno, err, errlen);
        if (rc != KV_OK) {
            break;
        }
        line = next;
    }
    free(copy);
    return rc;
}

kv_err kvd_tenants_load(kvd_tenants *t, const char *path, char *err, size_t errlen) {
    FILE *f = fopen(path, "r");
    if (f == NULL) {
        set_err(err, errlen, "%s: %s", path, strerror(errno));
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
        set_err(err, errlen, "%s: larger than 1 MiB", path);
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
        for (uint32_t j = 0; t->v[i].from_file && j < t->v[i].nuids; j++) {
            if (t->v[i].uids[j] == uid) {
                *id = i;
                return KV_OK;
            }
        }
    }
    for (uint32_t i = 0; i < t->n; i++) {
        for (uint32_t j = 0; t->v[i].from_file && j < t->v[i].ngids; j++) {
            if (t->v[i].gids[j] == gid) {
                *id = i;
                return KV_OK;
            }
        }
    }
    for (uint32_t i = 0; i < t->n; i++) {
        if (!t->v[i].from_file && t->v[i].uids[0] == uid) {
            *id = i;
            return KV_OK;
        }
    }
    if (t->n == KVD_MAX_TENANTS) {
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

const char *kvd_tenants_name(const kvd_tenants *t, uint32_t id) {
    return id < t->n ? t->v[id].name : "?";
}

uint32_t kvd_tenants_count(const kvd_tenants *t) {
    return t->n;
}
