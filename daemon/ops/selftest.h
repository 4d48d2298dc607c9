/* kvd_selftest: checks the daemon can run on a live server (admin `selftest isolation`).
 *
 * The isolation test makes two throwaway tenants ("selftest:a", "selftest:b"; reachable by no
 * peer, made once per daemon run) and proves on the server's own pools, index and sessions
 * code: a block committed in tenant a's domain is a hit for another session of a (same domain)
 * and no hit for b (different domain), and b cannot reach a's pool. It writes through the
 * segment memory and checks a's second session reads the same bytes. Its pools are freed
 * afterwards; it holds nothing when it returns. Loop thread only (runs synchronously).
 */
#ifndef KVD_SELFTEST_H
#define KVD_SELFTEST_H

#include <stddef.h>

#include "common/kv_err.h"
#include "daemon/ops/ops.h"

/* Runs the isolation self-test. KV_OK when every check held; KV_EINTERNAL when isolation is
 * broken; KV_ENOSPC / KV_EQUOTA / KV_ESYS when it could not run (no budget for two small
 * pools, tenant table full). report gets one line per check ("ok ..." / "FAIL ..."). */
kv_err kvd_selftest_isolation(kvd_ops *o, char *report, size_t len);

#endif
