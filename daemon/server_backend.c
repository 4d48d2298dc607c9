/* kvd_server_backend: backend choice at start and the cuda-ipc mapping rule. */
#include "daemon/server_backend.h"

#include <stdio.h>
#include <string.h>

#include "common/kv_log.h"
#include "daemon/server_int.h"

kv_err kvd_server_backend_open(kvd_server *s) {
    char why[512];
    kvd_backend_sel sel;
    kv_err rc = kvd_backend_select(s->cfg.backend, (int)s->cfg.device, NULL, &s->host, &sel, why,
                                   sizeof(why));
    if (rc != KV_OK) {
        KV_LOG(ERROR, "KVD-BACKEND", "%s", why);
        return rc;
    }
    s->backend_sel = sel;
    s->be = sel.ops;
    s->be_ctx = sel.ctx;
    snprintf(s->cfg.backend, sizeof(s->cfg.backend), "%s", sel.ops->name);
    KV_LOG(INFO, "KVD-BACKEND", "%s", sel.reason);
    return KV_OK;
}

void kvd_server_backend_close(kvd_server *s) {
    kvd_backend_sel_fini(&s->backend_sel);
    s->be = &kvd_backend_host;
    s->be_ctx = &s->host;
}

uint32_t kvd_segment_mappers(const kvd_server *s, uint32_t pool_id, uint32_t seg) {
    uint32_t n = 0;
    for (const kvd_conn *c = s->conns; c != NULL; c = c->next) {
        for (uint32_t i = 0; i < c->sess.npools; i++) {
            const kvd_session_pool *sp = &c->sess.pools[i];
            if (sp->pool_id == pool_id && kvd_session_pool_was_sent(sp, seg)) {
                n++;
            }
        }
    }
    return n;
}

int kvd_segment_may_free(const kvd_server *s, uint32_t pool_id, uint32_t seg) {
    if (s->be->kind != KVD_MEM_CUDA_IPC) {
        return 1;
    }
    return kvd_segment_mappers(s, pool_id, seg) == 0;
}
