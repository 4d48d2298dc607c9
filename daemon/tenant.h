/* kvd_tenants: who a peer is. Maps kernel credentials (SO_PEERCRED uid, gid) to a tenant.
 *
 * The tenants file has one tenant per line, `#` comments:
 *     tenant NAME uid=1000,1001 gid=2000,2001
 * (uid= and gid= are optional, at least one must be given; NAME is 1..63 of [A-Za-z0-9._-]).
 * A peer gets the first line whose uid list holds its uid, else the first line whose gid list
 * holds its gid, else the tenant "uid-<uid>" made on first sight. Tenant ids are small integers
 * (file tenants first, in file order), < KVD_MAX_TENANTS, never reused in one daemon run.
 * Loop thread only.
 */
#ifndef KVD_TENANT_H
#define KVD_TENANT_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "common/kv_err.h"

#define KVD_TENANT_NAME_MAX 64 /* bytes including the NUL */

typedef struct kvd_tenants kvd_tenants;

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
 * table is full. */
kv_err kvd_tenants_resolve(kvd_tenants *t, uid_t uid, gid_t gid, uint32_t *id);

/* The tenant's name; "?" for an id never handed out. */
const char *kvd_tenants_name(const kvd_tenants *t, uint32_t id);

/* Number of tenants known. */
uint32_t kvd_tenants_count(const kvd_tenants *t);

#endif
