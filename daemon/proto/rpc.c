/* kvd_rpc: one function per request (daemon/proto/rpc.h). Each checks its fields (validate.c),
 * then the session's state, and only then changes pools, so an Error reply means nothing
 * changed. On success a handler encodes its reply into the request arena (rpc_send); on failure
 * it returns the code and writes a message, and kvd_rpc_handle encodes the Error. Scratch
 * memory comes from the same arena: no malloc per request on the paths that hand out blocks. */
#include "daemon/proto/rpc.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/kv_log.h"
#include "common/kv_vllm_hash.h"
#include "common/kv_wire.h"
#include "daemon/mem/backend_host.h"
#include "daemon/proto/validate.h"
#include "daemon/registry/commons.h"
#include "daemon/registry/reqtrace.h"

#define FAIL(rc, ...)                                                                              \
    do {                                                                                           \
        snprintf(msg, KV_ERRMSG, __VA_ARGS__);                                                     \
        return (rc);                                                                               \
    } while (0)

/* One request in flight: what the handlers use. */
typedef struct rpc {
    const kvd_rpc_ctx *ctx; /* as the caller gave it */
    kvd_registry *reg;      /* ctx->reg */
    const kvd_config *cfg;  /* ctx->cfg */
    kvd_session *sess;      /* the request's session */
    kvd_reply *out;         /* where the reply goes */
    int layout_conflict;    /* AttachPool: another layout of the model exists */
} rpc;

static void *rpc_scratch(rpc *c, size_t size) {
    return kv_arena_alloc(c->ctx->arena, size);
}

/* Encodes env as the request's reply, with fds (borrowed: the connection layer dups them).
 * KV_ENOMEM when the arena cannot hold it. */
static kv_err rpc_send(rpc *c, const Kvd__Envelope *env, const int *fds, uint32_t nfds) {
    size_t blen;
    size_t n = kv_wire_frame_measure(env, &blen);
    if (nfds == 0 && c->ctx->reserve != NULL) {
        uint8_t *at = c->ctx->reserve(c->ctx->reserve_arg, n);
        if (at != NULL) {
            kv_wire_encode_measured(env, blen, at); /* straight into the output queue: no copy */
            c->out->queued = 1;
            return KV_OK;
        }
    }
    uint8_t *buf = kv_arena_alloc(c->ctx->arena, n);
    if (buf == NULL) {
        return KV_ENOMEM;
    }
    kv_wire_encode_measured(env, blen, buf);
    c->out->frame = buf;
    c->out->len = n;
    c->out->fds = fds;
    c->out->nfds = nfds;
    return KV_OK;
}

static void env_init(rpc *c, Kvd__Envelope *env, uint64_t id) {
    kvd__envelope__init(env);
    env->id = id;
    env->boot_epoch = c->ctx->boot_epoch;
}

/* The session's pool entry and the server's, or ENOENT. */
static kv_err session_pool(rpc *c, uint32_t pool_id, kvd_session_pool **out, kvd_reg_pool **srv_out,
                           char *msg) {
    kvd_session_pool *sp = kvd_session_find_pool(c->sess, pool_id);
    kvd_reg_pool *p = sp != NULL ? kvd_registry_pool(c->reg, pool_id) : NULL; /* clock too */
    if (sp == NULL || p == NULL) {
        FAIL(KV_ENOENT, "pool %u is not attached by this session (AttachPool first)", pool_id);
    }
    *out = sp;
    if (srv_out != NULL) {
        *srv_out = p;
    }
    return KV_OK;
}

/* Requests that hand out blocks (Allocate, Lookup, Commit) name a pool whose segment 0 the
 * session was sent: an attached pool's AttachPool reply sends it, a linked pool's comes with
 * MapSegments{pool_id, 0}. Until then a reply could not announce segment 0 (new_segments_from
 * = 0 means "nothing new"), so such requests are refused. */
static kv_err need_segment0(kvd_session_pool *sp, char *msg) {
    if (!kvd_session_pool_was_sent(sp, 0)) {
        FAIL(KV_ESTATE,
             "pool %u: this session was never sent its segments; send MapSegments{pool_id %u, "
             "first_index 0} before using it",
             sp->pool_id, sp->pool_id);
    }
    return KV_OK;
}

/* new_segments_from for a reply about sp: the lowest live segment slot this session was not
 * sent, or 0 when it was sent every one. Slot 0 is sent by every AttachPool and lives as long as
 * the pool, so for an attached pool 0 can only mean "nothing new" (PROTOCOL.md, MapSegments). */
static uint32_t new_segments_from(kvd_session_pool *sp) {
    uint32_t h = kvd_session_pool_first_unsent(sp);
    return h == KVD_NO_SEGMENT ? 0 : h;
}

#ifndef NDEBUG
/* The rule of PROTOCOL.md §6 (Segments a reply hands out): a block in a reply lies in a segment
 * the session was sent, or the same reply announces it (nsf != 0 and <= its segment). */
static void check_announced(kvd_session_pool *sp, const kvd_block_ref *refs, size_t n,
                            uint32_t nsf) {
    uint32_t bps = kvd_pool_config_get(sp->pool)->blocks_per_segment;
    for (size_t i = 0; i < n; i++) {
        uint32_t seg = refs[i].id / bps;
        KV_ASSERT(kvd_session_pool_was_sent(sp, seg) || (nsf != 0 && nsf <= seg));
    }
}
#else
#define check_announced(sp, refs, n, nsf) ((void)0)
#endif

/* Fills segs (capacity KV_WIRE_MAX_FDS) with the live segments >= first, as many as their
 * fds fit one frame (KV_WIRE_MAX_FDS: one fd per segment, one per part for segments made
 * of parts, none for CUDA_IPC), and fds with their fds in fd_index order; *nfds gets the count.
 * kind is the backend's kvd.MemoryKind. Records nothing: the caller marks them sent once the
 * reply is queued. */
static uint32_t collect_segments(kvd_session_pool *sp, uint32_t first, Kvd__Segment *segs,
                                 Kvd__Segment **ptrs, int *fds, uint32_t *nfds, int *more,
                                 uint32_t kind) {
    uint32_t n = 0, nf = 0;
    *more = 0;
    uint32_t slots = kvd_pool_segment_slots(sp->pool);
    const kvd_pool_config *pc = kvd_pool_config_get(sp->pool);
    for (uint32_t i = first; i < slots && n < KV_WIRE_MAX_FDS; i++) {
        const kvd_segment_mem *m = kvd_pool_segment(sp->pool, i);
        if (m == NULL) {
            continue;
        }
        uint32_t need = kind == KVD__MEMORY_KIND__CUDA_IPC ? 0 : m->nparts > 0 ? m->nparts : 1;
        if (nf + need > KV_WIRE_MAX_FDS) {
            *more = 1; /* the next reply: the client asks from here */
            break;
        }
        kvd__segment__init(&segs[n]);
        segs[n].index = i;
        segs[n].nblocks = pc->blocks_per_segment;
        segs[n].bytes = m->bytes;
        segs[n].kind = (Kvd__MemoryKind)kind;
        segs[n].fd_index = nf;
        if (segs[n].kind == KVD__MEMORY_KIND__CUDA_IPC) {
            /* No fd travels (send_segments_reply sends none): the handle names the memory. */
            segs[n].ipc_handle.len = sizeof(m->ipc_handle);
            segs[n].ipc_handle.data = (uint8_t *)m->ipc_handle;
        }
        if (m->nparts > 0) {
            segs[n].n_part_bytes = m->nparts;
            segs[n].part_bytes = m->part_bytes;
            for (uint32_t k = 0; k < m->nparts; k++) {
                fds[nf++] = m->part_fds[k];
            }
        } else if (need == 1) {
            fds[nf++] = m->fd;
        }
        /* The commons is written only by the daemon (promotions); every tenant reads it. */
        segs[n].read_only = pc->domain == KVD_DOMAIN_COMMONS;
        ptrs[n] = &segs[n];
        n++;
    }
    for (uint32_t i = first + n; !*more && n > 0 && i < slots; i++) {
        *more = kvd_pool_segment(sp->pool, i) != NULL && i > segs[n - 1].index;
    }
    *nfds = nf;
    return n;
}

/* ---- requests -------------------------------------------------------------------------- */

static kv_err on_hello(rpc *c, uint64_t id, const Kvd__Hello *h, char *msg) {
    kvd_registry *s = c->reg;
    if (c->sess->hello) {
        FAIL(KV_ESTATE, "Hello was already done on this connection");
    }
    if (c->ctx->draining) {
        FAIL(KV_EDRAINING, "kvd is draining (admin `drain`) for a restart; connect to the new "
                           "instance");
    }
    kv_err rc = kvd_validate_hello(h, msg, KV_ERRMSG);
    if (rc != KV_OK) {
        return rc;
    }
    uint32_t tenant;
    if (h->token.len != 0) {
        rc = kvd_tenants_resolve_token(s->tenants, c->sess->uid, c->sess->gid, h->token.data,
                                       h->token.len, &tenant);
        if (rc != KV_OK) {
            KV_LOG(WARN, "KVD-AUTH", "session %llu: pid %d uid %d: tenant token refused",
                   (unsigned long long)c->sess->id, (int)c->sess->pid, (int)c->sess->uid);
            FAIL(KV_EAUTH, "the token names no tenant that uid %d gid %d may be", (int)c->sess->uid,
                 (int)c->sess->gid);
        }
    } else {
        rc = kvd_tenants_resolve(s->tenants, c->sess->uid, c->sess->gid, &tenant);
        if (rc != KV_OK) {
            FAIL(rc, "the daemon knows %d tenants already; uid %d cannot get a new one",
                 KVD_MAX_TENANTS, (int)c->sess->uid);
        }
    }
    uint64_t max_sessions = kvd_tenants_quota(s->tenants, tenant)->max_sessions;
    if (max_sessions != 0 && kvd_registry_sessions(s, tenant) >= max_sessions) {
        FAIL(KV_EQUOTA, "tenant %s: max-sessions is %llu and that many are open",
             kvd_tenants_name(s->tenants, tenant), (unsigned long long)max_sessions);
    }
    if (kvd_registry_session_open(s, tenant) != KV_OK) {
        FAIL(KV_ENOMEM, "no memory to count the tenant's sessions");
    }
    c->sess->tenant = tenant;
    c->sess->hello = 1;
    /* What we may send it. */
    c->sess->features =
        h->features & (KV_FEATURE_PACKED | KV_FEATURE_TIERS | KV_FEATURE_PACKED_COMMIT);
    snprintf(c->sess->name, sizeof(c->sess->name), "%s", h->client_name ? h->client_name : "");
    Kvd__Envelope env;
    env_init(c, &env, id);
    Kvd__HelloReply r = KVD__HELLO_REPLY__INIT;
    uint32_t doms[KVD_MAX_DOMAINS_PER_TENANT];
    char dnames[KVD_MAX_DOMAINS_PER_TENANT][KVD_TENANT_NAME_MAX + 8];
    char *domains[KVD_MAX_DOMAINS_PER_TENANT];
    uint32_t ndoms = kvd_tenants_domains(s->tenants, tenant, doms);
    for (uint32_t i = 0; i < ndoms; i++) {
        domains[i] =
            (char *)kvd_tenants_domain_name(s->tenants, doms[i], dnames[i], sizeof(dnames[i]));
    }
    r.session_id = c->sess->id;
    r.tenant = domains[0];
    r.n_domains = ndoms;
    r.domains = domains;
    r.boot_epoch = c->ctx->boot_epoch;
    r.protocol_version = KV_PROTOCOL_VERSION;
    r.max_frame_bytes = (uint32_t)c->cfg->max_frame_bytes;
    r.max_inflight = (uint32_t)c->cfg->max_inflight;
    r.max_blocks_per_request = (uint32_t)c->cfg->max_blocks_per_request;
    r.features = KV_FEATURE_PACKED | KV_FEATURE_PRIVATE | KV_FEATURE_PACKED_COMMIT |
                 (kvd_tiers_on(c->ctx->tiers) ? KV_FEATURE_TIERS : 0) |
                 (kvd_tiers_remote_any(c->ctx->tiers) ? KV_FEATURE_REMOTE : 0);
    env.body_case = KVD__ENVELOPE__BODY_HELLO_REPLY;
    env.hello_reply = &r;
    KV_LOG(INFO, "KVD-HELLO", "session %llu: client '%s' pid %d is tenant %s",
           (unsigned long long)c->sess->id, c->sess->name, (int)c->sess->pid, domains[0]);
    return rpc_send(c, &env, NULL, 0);
}

static kv_err send_segments_reply(rpc *c, uint64_t id, kvd_session_pool *sp, kvd_reg_pool *p,
                                  uint32_t first, int attach) {
    /* In the request arena: the reply's fds must live until the connection layer dup'ed them. */
    Kvd__Segment *segs = rpc_scratch(c, KV_WIRE_MAX_FDS * sizeof(*segs));
    Kvd__Segment **ptrs = rpc_scratch(c, KV_WIRE_MAX_FDS * sizeof(*ptrs));
    int *fds = rpc_scratch(c, KV_WIRE_MAX_FDS * sizeof(int));
    int *ro_fds = rpc_scratch(c, KV_WIRE_MAX_FDS * sizeof(int));
    Kvd__LinkedPool *links = rpc_scratch(c, KVD_MAX_DOMAINS_PER_TENANT * sizeof(*links));
    Kvd__LinkedPool **link_ptrs = rpc_scratch(c, KVD_MAX_DOMAINS_PER_TENANT * sizeof(*link_ptrs));
    char(*lnames)[KVD_TENANT_NAME_MAX + 8] =
        rpc_scratch(c, KVD_MAX_DOMAINS_PER_TENANT * sizeof(*lnames));
    uint32_t n = 0, nfds = 0, nro = 0, nlinks = 0;
    kv_err rc = KV_ENOMEM;
    if (segs == NULL || ptrs == NULL || fds == NULL || ro_fds == NULL || links == NULL ||
        link_ptrs == NULL || lnames == NULL) {
        goto cleanup;
    }
    if (kvd_session_pool_reserve(sp, kvd_pool_segment_slots(sp->pool)) != KV_OK) {
        goto cleanup;
    }
    int more = 0;
    n = collect_segments(sp, first, segs, ptrs, fds, &nfds, &more,
                         c->reg->be->kind != KVD_MEM_NONE ? c->reg->be->kind : KVD_MEM_HOST_MEMFD);
    /* Segments the session may only read travel as fds that cannot be mapped writable. */
    for (uint32_t i = 0; i < n; i++) {
        /* GPU memory cannot be handed out read-only: there read_only is advisory (docs/GPU.md). */
        if (segs[i].read_only && segs[i].kind == KVD__MEMORY_KIND__HOST_MEMFD) {
            rc = kvd_backend_host_ro_fd(fds[segs[i].fd_index], &ro_fds[nro]);
            if (rc != KV_OK) {
                goto cleanup;
            }
            fds[segs[i].fd_index] = ro_fds[nro++];
        }
    }
    for (uint32_t i = 0; attach && i < p->nlinks; i++) {
        const kvd_reg_pool *lp = kvd_registry_peek(c->reg, p->links[i]);
        if (lp == NULL) {
            continue;
        }
        kvd__linked_pool__init(&links[nlinks]);
        links[nlinks].pool_id = lp->pool_id;
        links[nlinks].domain = (char *)kvd_tenants_domain_name(c->reg->tenants, lp->domain,
                                                               lnames[nlinks], sizeof(lnames[0]));
        links[nlinks].read_only =
            !kvd_tenants_domain_writable(c->reg->tenants, c->sess->tenant, lp->domain);
        links[nlinks].blocks_per_segment = kvd_pool_config_get(lp->pool)->blocks_per_segment;
        link_ptrs[nlinks] = &links[nlinks];
        nlinks++;
    }
    Kvd__Envelope env;
    env_init(c, &env, id);
    Kvd__AttachPoolReply ar = KVD__ATTACH_POOL_REPLY__INIT;
    Kvd__MapSegmentsReply mr = KVD__MAP_SEGMENTS_REPLY__INIT;
    Kvd__Layout lay = KVD__LAYOUT__INIT;
    Kvd__Hash128 seed = KVD__HASH128__INIT;
    if (attach) {
        const kv_layout *l = &p->layout;
        lay.num_layers = l->num_layers;
        lay.num_kv_heads = l->num_kv_heads;
        lay.head_dim = l->head_dim;
        lay.tokens_per_block = l->tokens_per_block;
        lay.dtype = (Kvd__DType)l->dtype;
        lay.arrangement = (Kvd__Arrangement)l->arrangement;
        lay.block_bytes = l->block_bytes;
        lay.lossy_tiers = (p->flags & KVD_POOL_LOSSY_TIERS) != 0;
        lay.summaries = (p->flags & KVD_POOL_SUMMARIES) != 0;
        seed.lo = p->seed.lo;
        seed.hi = p->seed.hi;
        ar.pool_id = p->pool_id;
        ar.layout = &lay;
        ar.blocks_per_segment = kvd_pool_config_get(p->pool)->blocks_per_segment;
        ar.n_segments = n;
        ar.segments = ptrs;
        ar.hash_seed = &seed;
        ar.hash_algo = c->reg->vllm ? 3 : 1;
        if (c->reg->vllm) {
            ar.none_hash.data = c->reg->none_hash;
            ar.none_hash.len = sizeof(c->reg->none_hash);
        }
        /* The pool's own limit is 0 while all its segments are parked and the budget is
         * spent (it may not grow now), but the client sizes its address space by this and
         * takes 0 for a malformed reply; parked segments keep their slots. So: at least the
         * pool's slots, and at least 1. */
        uint32_t max_segs = kvd_pool_config_get(p->pool)->max_segments;
        uint32_t slots = kvd_pool_segment_slots(p->pool);
        max_segs = max_segs > slots ? max_segs : slots;
        ar.max_segments = max_segs > 0 ? max_segs : 1;
        ar.n_linked = nlinks;
        ar.linked = link_ptrs;
        ar.more_segments = more;
        ar.layout_conflict = c->layout_conflict;
        if (c->reg->sel->cuda != NULL) {
            ar.device_uuid.data = c->reg->sel->cuda->dev.uuid.bytes;
            ar.device_uuid.len = sizeof(c->reg->sel->cuda->dev.uuid.bytes);
        }
        env.body_case = KVD__ENVELOPE__BODY_ATTACH_POOL_REPLY;
        env.attach_pool_reply = &ar;
    } else {
        mr.n_segments = n;
        mr.segments = ptrs;
        mr.more_segments = more;
        env.body_case = KVD__ENVELOPE__BODY_MAP_SEGMENTS_REPLY;
        env.map_segments_reply = &mr;
    }
    /* CUDA_IPC segments carry handle bytes instead of fds. */
    rc = rpc_send(c, &env, fds, nfds);
    if (rc == KV_OK) {
        /* Marked now: a reply the connection layer cannot queue closes the connection. */
        for (uint32_t i = 0; i < n; i++) {
            kvd_session_pool_mark_sent(sp, segs[i].index);
        }
        c->out->tmp_fds = ro_fds; /* closed by the connection layer once dup'ed */
        c->out->ntmp = nro;
        return KV_OK;
    }
cleanup:
    for (uint32_t i = 0; ro_fds != NULL && i < nro; i++) {
        close(ro_fds[i]);
    }
    return rc;
}

static kv_err on_attach(rpc *c, uint64_t id, const Kvd__AttachPool *a, char *msg) {
    kv_layout l;
    kv_err rc = kvd_validate_attach(a, &l, msg, KV_ERRMSG);
    if (rc != KV_OK) {
        return rc;
    }
    uint32_t ids[KVD_MAX_DOMAINS_PER_TENANT + 1], nids = 0;
    int conflict = 0;
    uint32_t flags = a->layout != NULL && a->layout->lossy_tiers ? KVD_POOL_LOSSY_TIERS : 0;
    flags |= a->layout != NULL && a->layout->summaries ? KVD_POOL_SUMMARIES : 0;
    rc = kvd_registry_attach(c->reg, c->sess->tenant, a->model_id, &l, flags, ids, &nids, &conflict,
                             msg);
    if (rc != KV_OK) {
        return rc;
    }
    /* The session records each pool once; a pool it knew already gives back the session count
     * the registry just added. */
    for (uint32_t i = 0; i < nids; i++) {
        kvd_reg_pool *lp = kvd_registry_pool(c->reg, ids[i]);
        kvd_session_pool *lsp;
        if (kvd_session_find_pool(c->sess, ids[i]) != NULL) {
            kvd_registry_sessions_gone(c->reg, &ids[i], 1);
        }
        rc = kvd_session_add_pool(c->sess, ids[i], lp->pool, &lsp);
        if (rc != KV_OK) {
            FAIL(rc, "no memory to attach the pool");
        }
        if (kvd_tiers_on(c->ctx->tiers)) {
            char dn[KVD_TENANT_NAME_MAX + 8];
            const char *dname =
                kvd_tenants_domain_name(c->reg->tenants, lp->domain, dn, sizeof(dn));
            if (kvd_tiers_attach(c->ctx->tiers, lp, dname) != KV_OK) {
                FAIL(KV_ENOMEM, "no memory for the pool's lower tiers");
            }
        }
        kvd_kvevents_attach(c->ctx->kvevents, lp);
    }
    /* Found after the loop: adding a linked pool may grow (move) the session's pool array. */
    kvd_session_pool *sp = kvd_session_find_pool(c->sess, ids[0]);
    kvd_reg_pool *p = kvd_registry_pool(c->reg, ids[0]);
    /* A repeated attach sends every segment again (the client remaps them all). */
    kvd_session_pool_forget_sent(sp);
    c->layout_conflict = conflict;
    return send_segments_reply(c, id, sp, p, 0, 1);
}

static kv_err on_map(rpc *c, uint64_t id, const Kvd__MapSegments *m, char *msg) {
    kvd_session_pool *sp;
    kvd_reg_pool *p;
    kv_err rc = session_pool(c, m->pool_id, &sp, &p, msg);
    if (rc != KV_OK) {
        return rc;
    }
    return send_segments_reply(c, id, sp, p, m->first_index, 0);
}

/* A reply's list of block handles refs[0..n), in the request arena: as *packed (the session
 * reads that reply's packed form, Hello.features bit `feature`; *nref 0) or as BlockRef
 * messages (*pv, *nref = n). */
static kv_err blocks_field(rpc *c, uint32_t feature, const kvd_block_ref *refs, size_t n,
                           ProtobufCBinaryData *packed, Kvd__BlockRef ***pv, size_t *nref) {
    packed->data = NULL;
    packed->len = 0;
    *pv = NULL;
    *nref = 0;
    if (c->sess->features & feature) {
        packed->data = rpc_scratch(c, n * KV_WIRE_BLOCK_BYTES);
        if (packed->data == NULL) {
            return KV_ENOMEM;
        }
        packed->len = n * KV_WIRE_BLOCK_BYTES;
        for (size_t i = 0; i < n; i++) {
            kv_wire_block_put(packed->data, i, refs[i].id, refs[i].gen);
        }
        return KV_OK;
    }
    Kvd__BlockRef *v = rpc_scratch(c, n * sizeof(*v));
    Kvd__BlockRef **p = rpc_scratch(c, n * sizeof(*p));
    if (v == NULL || p == NULL) {
        return KV_ENOMEM;
    }
    for (size_t i = 0; i < n; i++) {
        kvd__block_ref__init(&v[i]);
        v[i].id = refs[i].id;
        v[i].gen = refs[i].gen;
        p[i] = &v[i];
    }
    *pv = p;
    *nref = n;
    return KV_OK;
}

/* What a LookupReply says of the remote tier (Lookup.remote). */
typedef struct remote_answer {
    uint32_t hits;
    kv_err failure;
} remote_answer;

static kv_err send_blocks_reply(rpc *c, uint64_t id, const kvd_block_ref *refs, size_t n,
                                uint32_t nsf, int lookup, uint32_t *pool_ids,
                                Kvd__SegmentNotice **notices, size_t nnotices,
                                const kvd_tier_run *tr, const remote_answer *ra) {
    Kvd__BlockRef **pv;
    ProtobufCBinaryData packed;
    size_t nref;
    if (blocks_field(c, KV_FEATURE_PACKED, refs, n, &packed, &pv, &nref) != KV_OK) {
        return KV_ENOMEM;
    }
    Kvd__Envelope env;
    env_init(c, &env, id);
    Kvd__LookupReply lr = KVD__LOOKUP_REPLY__INIT;
    Kvd__AllocateReply ar = KVD__ALLOCATE_REPLY__INIT;
    if (lookup) {
        lr.n_blocks = nref;
        lr.blocks = pv;
        lr.blocks_packed = packed;
        lr.new_segments_from = nsf;
        lr.n_pool_ids = pool_ids != NULL ? n : 0;
        lr.pool_ids = pool_ids;
        lr.n_linked_segments = nnotices;
        lr.linked_segments = notices;
        if (tr != NULL) {
            lr.tier_fetchable = tr->fetchable;
            lr.tier1_hits = tr->t1;
            lr.tier2_hits = tr->t2;
        }
        if (ra != NULL) {
            lr.remote_hits = ra->hits;
            lr.remote_failure = (Kvd__ErrorCode)ra->failure;
        }
        env.body_case = KVD__ENVELOPE__BODY_LOOKUP_REPLY;
        env.lookup_reply = &lr;
    } else {
        ar.n_blocks = nref;
        ar.blocks = pv;
        ar.blocks_packed = packed;
        ar.new_segments_from = nsf;
        env.body_case = KVD__ENVELOPE__BODY_ALLOCATE_REPLY;
        env.allocate_reply = &ar;
    }
    return rpc_send(c, &env, NULL, 0);
}

/* Records n new references of the session; on ENOMEM gives them back to the pool. */
/* A reply encoded outside any request (a Fetch's, a waiting Allocate's, sent later): its own
 * arena (kv_arena_fini it after the send) and context. */
static void later_ctx(kvd_rpc_ctx *x, kv_arena *arena, kvd_reply *out, kvd_registry *reg,
                      const kvd_config *cfg, uint64_t boot_epoch, kvd_tiers *tiers) {
    kv_arena_init(arena);
    memset(x, 0, sizeof(*x));
    x->reg = reg;
    x->cfg = cfg;
    x->boot_epoch = boot_epoch;
    x->arena = arena;
    x->tiers = tiers;
    memset(out, 0, sizeof(*out));
}

/* max-held: whether tenant may hold count more blocks in pool p (msg says why not). */
static kv_err check_max_held(const rpc *c, const kvd_reg_pool *p, uint32_t count, char *msg) {
    uint64_t max_held = kvd_tenants_quota(c->reg->tenants, c->sess->tenant)->max_held;
    uint64_t held = kvd_pool_tenant_usage(p->pool, c->sess->tenant).held;
    if (max_held != 0 && held + count > max_held) {
        FAIL(KV_EQUOTA,
             "tenant %s: quota max-held is %llu blocks per pool; pool %u holds %llu, asked %u",
             kvd_tenants_name(c->reg->tenants, c->sess->tenant), (unsigned long long)max_held,
             p->pool_id, (unsigned long long)held, count);
    }
    return KV_OK;
}

/* Allocates count blocks of pool p for the session and queues the reply. KV_ENOSPC (msg) when
 * the pool has no room now, and nothing changed. */
static kv_err allocate_reply(rpc *c, uint64_t id, kvd_session_pool *sp, kvd_reg_pool *p,
                             uint32_t count, int private_blocks, char *msg) {
    kvd_block_ref *refs = rpc_scratch(c, sizeof(*refs) * count);
    if (refs == NULL) {
        FAIL(KV_ENOMEM, "no memory for %u handles", count);
    }
    /* The registry decides first (a refused Allocate changes nothing), then parks, grows and
     * allocates. */
    kv_err rc = kvd_registry_allocate(c->reg, p, count, c->sess->id, c->sess->tenant, refs, msg);
    if (rc != KV_OK) {
        return rc;
    }
    if (kvd_session_hold(c->sess, sp, refs, count) != KV_OK) {
        FAIL(KV_ENOMEM, "no memory to record %u references", count);
    }
    for (uint32_t i = 0; i < count && private_blocks; i++) {
        KV_ASSERT(kvd_pool_make_private(p->pool, c->sess->id, refs[i]) == KV_OK);
    }
    kvd_tiers_pressure(c->ctx->tiers, p);
    uint32_t nsf = new_segments_from(sp);
    check_announced(sp, refs, count, nsf);
    return send_blocks_reply(c, id, refs, count, nsf, 0, NULL, NULL, 0, NULL, NULL);
}

/* What a reply sent later needs of its request (a waiting Allocate, Fetch or Lookup). */
typedef struct later_req {
    kvd_registry *reg;
    const kvd_config *cfg;
    uint64_t boot_epoch;
    const kvd_rpc_later *later;
    uint64_t id;      /* the request's id */
    uint64_t session; /* who asked */
    uint32_t pool_id; /* the pool */
} later_req;

static void later_req_init(later_req *q, const rpc *c, uint64_t id, uint32_t pool_id) {
    *q = (later_req){c->reg, c->cfg, c->ctx->boot_epoch, c->ctx->later, id, c->sess->id, pool_id};
}

/* The session a later reply goes to, its reply no longer counted among those to come; NULL
 * when it closed (or gone: the daemon stops, the request was orphaned). */
static kvd_session *later_session(const later_req *q, int gone) {
    kvd_session *sess = gone || q->later == NULL ? NULL : q->later->find(q->later->arg, q->session);
    if (sess != NULL && sess->fetches > 0) {
        sess->fetches--;
    }
    return sess;
}

/* An Allocate that waits for copies down to give back blocks of its pool (docs/TIERS.md). */
typedef struct alloc_wait {
    later_req q;
    kvd_tiers *tiers;
    uint64_t serial; /* the pool's attach it waits in (same_attach) */
    uint32_t count;
    int private_blocks;
    char why[KV_ERRMSG]; /* the ENOSPC it met first */
} alloc_wait;

static void on_room(void *arg, kv_err why);
static kvd_session_pool *same_attach(kvd_session *sess, uint32_t pool_id, uint64_t serial);

/* Waits (at the back of the pool's queue) instead of answering ENOSPC, when copies hold blocks
 * of the pool and the session has room in max-inflight. 1 when it waits (no reply now). */
static int allocate_wait(rpc *c, uint64_t id, kvd_reg_pool *p, uint64_t serial,
                         const Kvd__Allocate *a, const char *why) {
    if (c->ctx->later == NULL || c->ctx->tiers == NULL || kvd_tiers_leased(c->ctx->tiers, p) == 0 ||
        c->sess->fetches >= c->cfg->max_inflight) {
        return 0;
    }
    alloc_wait *w = calloc(1, sizeof(*w));
    if (w == NULL) {
        return 0;
    }
    later_req_init(&w->q, c, id, p->pool_id);
    w->tiers = c->ctx->tiers;
    w->serial = serial;
    w->count = a->count;
    w->private_blocks = a->private_blocks;
    snprintf(w->why, sizeof(w->why), "%s", why);
    if (kvd_tiers_wait_room(c->ctx->tiers, p, on_room, w) != KV_OK) {
        free(w);
        return 0;
    }
    c->sess->fetches++;
    c->out->deferred = 1; /* the reply comes from on_room */
    return 1;
}

/* A copy gave a block of the waiting Allocate's pool back (or the pool went, or kvd stops). */
static void on_room(void *arg, kv_err why) {
    alloc_wait *w = arg;
    kvd_session *sess = later_session(&w->q, why == KV_ECLOSED);
    if (sess == NULL) {
        free(w); /* the session closed, or kvd stops: nobody to answer */
        return;
    }
    kv_arena arena;
    kvd_rpc_ctx x;
    kvd_reply out;
    later_ctx(&x, &arena, &out, w->q.reg, w->q.cfg, w->q.boot_epoch, w->tiers);
    rpc c = {&x, w->q.reg, w->q.cfg, sess, &out, 0};
    char msg[KV_ERRMSG];
    msg[0] = '\0';
    kvd_reg_pool *p = kvd_registry_pool(w->q.reg, w->q.pool_id);
    /* The attach it waited in: one detached and attached again has sent no segment yet. */
    kvd_session_pool *sp = p != NULL ? same_attach(sess, w->q.pool_id, w->serial) : NULL;
    kv_err rc;
    if (sp == NULL) {
        rc = KV_ESTATE;
        snprintf(msg, sizeof(msg), "pool %u was detached while this Allocate waited for room",
                 w->q.pool_id);
    } else if ((rc = check_max_held(&c, p, w->count, msg)) == KV_OK) {
        rc = allocate_reply(&c, w->q.id, sp, p, w->count, w->private_blocks, msg);
        if (rc == KV_ENOSPC && kvd_tiers_wait_room(w->tiers, p, on_room, w) == KV_OK) {
            sess->fetches++; /* still copies in flight: wait for the next one */
            kv_arena_fini(&arena);
            return;
        }
        if (rc == KV_ENOSPC) {
            snprintf(msg, sizeof(msg), "%.190s (waited for the copies to lower tiers in flight)",
                     w->why);
        }
    }
    if (rc != KV_OK) {
        kvd_rpc_error(&x, sess, w->q.id, rc, msg, &out);
    }
    out.code = KV_OK;
    w->q.later->send(w->q.later->arg, w->q.session, &out);
    kv_arena_fini(&arena);
    free(w);
}

static kv_err on_allocate(rpc *c, uint64_t id, const Kvd__Allocate *a, char *msg) {
    kvd_session_pool *sp;
    kvd_reg_pool *p;
    kv_err rc = session_pool(c, a->pool_id, &sp, &p, msg);
    if (rc != KV_OK) {
        return rc;
    }
    rc = kvd_validate_allocate(a, c->cfg->max_blocks_per_request, msg, KV_ERRMSG);
    if (rc != KV_OK) {
        return rc;
    }
    if (!kvd_tenants_domain_writable(c->reg->tenants, c->sess->tenant, p->domain)) {
        FAIL(KV_EPERM, "pool %u is read-only for tenant %s (only the daemon writes the commons)",
             p->pool_id, kvd_tenants_name(c->reg->tenants, c->sess->tenant));
    }
    rc = need_segment0(sp, msg);
    if (rc != KV_OK) {
        return rc;
    }
    rc = check_max_held(c, p, a->count, msg);
    if (rc != KV_OK) {
        return rc;
    }
    /* Allocates that wait for copies to give blocks back are answered in order: a new one
     * queues behind them rather than take what they wait for. */
    if (kvd_tiers_room_waited(c->ctx->tiers, p) &&
        allocate_wait(c, id, p, sp->serial, a, "no room in the pool")) {
        return KV_OK;
    }
    rc = allocate_reply(c, id, sp, p, a->count, a->private_blocks, msg);
    if (rc == KV_ENOSPC && allocate_wait(c, id, p, sp->serial, a, msg)) {
        return KV_OK; /* answered when a copy gives a block back */
    }
    return rc;
}

/* verify-blocks: checks the hits (runs per pool, in order) and ends the list before the first
 * block whose bytes changed since its commit, giving back the session's references to it and
 * to every hit after it. Returns the hits left. */
static size_t verify_hits(rpc *c, const kvd_block_ref *refs, const uint32_t *pool_of, size_t nhit) {
    size_t good = 0;
    while (good < nhit) {
        size_t end = good;
        while (end < nhit && pool_of[end] == pool_of[good]) {
            end++;
        }
        kvd_reg_pool *rp = kvd_registry_pool(c->reg, pool_of[good]);
        size_t ok = kvd_registry_verify_hits(c->reg, rp, refs + good, end - good);
        good += ok;
        if (good < end) {
            break;
        }
    }
    for (size_t j = good; j < nhit; j++) {
        kvd_session_unhold(c->sess, kvd_session_find_pool(c->sess, pool_of[j]), &refs[j], 1);
    }
    return good;
}

/* A request's list of hashes, repeated or packed (Lookup's, Fetch's): checked in PROTOCOL.md
 * §7's order (EINVAL, ETOOBIG for either list, EPROTO for a packed list that is not whole
 * entries or comes with the repeated one), then the pool's segment 0 (ESTATE), then decoded
 * into the request arena: *out (room for one more) and *nout. */
static kv_err take_hashes(rpc *c, kvd_session_pool *sp, size_t nrep, Kvd__Hash128 *const *rep,
                          const ProtobufCBinaryData *packed, kv_hash128 **out, size_t *nout,
                          char *msg) {
    size_t n;
    kv_err rc = kvd_validate_hashes(nrep, rep, c->cfg->max_blocks_per_request, msg, KV_ERRMSG);
    if (rc == KV_OK) {
        rc = kvd_validate_list(packed->len / KV_WIRE_HASH_BYTES, c->cfg->max_blocks_per_request,
                               "hashes_packed", msg, KV_ERRMSG);
    }
    if (rc == KV_OK && kv_wire_list_count(nrep, packed->len, KV_WIRE_HASH_BYTES, &n) != KV_OK) {
        FAIL(KV_EPROTO,
             "hashes_packed of %zu bytes: not a multiple of %d, or sent together with hashes",
             packed->len, KV_WIRE_HASH_BYTES);
    }
    if (rc == KV_OK) {
        rc = need_segment0(sp, msg);
    }
    if (rc != KV_OK) {
        return rc;
    }
    kv_hash128 *h = rpc_scratch(c, sizeof(*h) * (n + 1));
    if (h == NULL) {
        FAIL(KV_ENOMEM, "no memory for %zu hashes", n);
    }
    for (size_t i = 0; i < n; i++) {
        if (nrep > 0) {
            h[i].lo = rep[i]->lo;
            h[i].hi = rep[i]->hi;
        } else {
            kv_wire_hash_get(packed->data, i, &h[i].lo, &h[i].hi);
        }
    }
    *out = h;
    *nout = n;
    return KV_OK;
}

/* The notices of a Lookup's linked pools sp[0..n): the segments each has that this session was
 * not sent (a hit may lie in one). Returns how many went into notice/notices. */
static size_t linked_notices(kvd_session_pool *const *sp, uint32_t n, Kvd__SegmentNotice *notice,
                             Kvd__SegmentNotice **notices) {
    size_t nn = 0;
    for (uint32_t k = 0; k < n; k++) {
        uint32_t h = kvd_session_pool_first_unsent(sp[k]);
        if (h != KVD_NO_SEGMENT) {
            kvd__segment_notice__init(&notice[nn]);
            notice[nn].pool_id = sp[k]->pool_id;
            notice[nn].first_index = h;
            notices[nn] = &notice[nn];
            nn++;
        }
    }
    return nn;
}

/* A Lookup waiting for the remote tier (Lookup.remote): its answer so far. The session holds the
 * hits meanwhile (a DetachPool or the session's end gives them back, as any). */
typedef struct lookup_wait {
    later_req q;
    /* The pools searched, in order (the named one first), and which attach of each it was
     * (kvd_session_pool.serial). */
    uint32_t pools[1 + KVD_MAX_DOMAINS_PER_TENANT];
    uint64_t serials[1 + KVD_MAX_DOMAINS_PER_TENANT];
    uint32_t npools;
    int with_pools; /* search_domains: the reply names each block's pool */
    kvd_tier_run tr;
    uint32_t nhit;
    kvd_block_ref *refs; /* [nhit] */
    uint32_t *pool_of;   /* [nhit] */
} lookup_wait;

static void lookup_wait_free(lookup_wait *w) {
    free(w->refs);
    free(w->pool_of);
    free(w);
}

/* The session's pool pool_id when it is still the attach of that serial, else NULL. */
static kvd_session_pool *same_attach(kvd_session *sess, uint32_t pool_id, uint64_t serial) {
    kvd_session_pool *sp = kvd_session_find_pool(sess, pool_id);
    return sp != NULL && sp->serial == serial ? sp : NULL;
}

/* Redis answered a waiting Lookup (or it failed, or the daemon stops): the reply goes out now,
 * with what the session holds of its hits. */
static void on_lookup_remote(void *arg, kv_err rc, uint32_t run) {
    lookup_wait *w = arg;
    kvd_session *sess = later_session(&w->q, 0);
    if (sess == NULL) {
        lookup_wait_free(w); /* the session closed: its references went with it */
        return;
    }
    kv_arena arena;
    kvd_rpc_ctx x;
    kvd_reply out;
    later_ctx(&x, &arena, &out, w->q.reg, w->q.cfg, w->q.boot_epoch, NULL);
    rpc c = {&x, w->q.reg, w->q.cfg, sess, &out, 0};
    kvd_session_pool *sps[1 + KVD_MAX_DOMAINS_PER_TENANT];
    int all_there = 1;
    for (uint32_t k = 0; k < w->npools; k++) {
        sps[k] = same_attach(sess, w->pools[k], w->serials[k]);
        all_there &= sps[k] != NULL;
    }
    kv_err e = KV_OK;
    if (!all_there) {
        /* A searched pool was detached meanwhile (maybe attached again): its hits went back
         * with the DetachPool. Those in the pools still attached as they were go back now, so
         * the session holds nothing the client was not told of. */
        for (uint32_t j = 0; j < w->nhit; j++) {
            uint32_t pid = w->with_pools ? w->pool_of[j] : w->pools[0];
            for (uint32_t k = 0; k < w->npools; k++) {
                if (w->pools[k] == pid && sps[k] != NULL) {
                    /* (a Release may have taken it already: the ledger counted it) */
                    kvd_session_unhold_held(sess, sps[k], &w->refs[j], 1);
                }
            }
        }
        kvd_rpc_error(&x, sess, w->q.id, KV_ESTATE,
                      "a pool was detached while this Lookup waited for the remote tier", &out);
    } else {
        Kvd__SegmentNotice notice[KVD_MAX_DOMAINS_PER_TENANT], *notices[KVD_MAX_DOMAINS_PER_TENANT];
        size_t nnotices = linked_notices(sps + 1, w->npools - 1, notice, notices);
        remote_answer ra = {run, rc == KV_OK ? KV_OK : rc == KV_ECLOSED ? KV_ECLOSED : KV_ESYS};
        e = send_blocks_reply(&c, w->q.id, w->refs, w->nhit, new_segments_from(sps[0]), 1,
                              w->with_pools ? w->pool_of : NULL, notices, nnotices, &w->tr, &ra);
        if (e != KV_OK) {
            kvd_rpc_error(&x, sess, w->q.id, KV_ENOMEM, "no memory for the LookupReply", &out);
        }
        out.code = KV_OK;
    }
    w->q.later->send(w->q.later->arg, w->q.session, &out);
    kv_arena_fini(&arena);
    lookup_wait_free(w);
}

/* Defers the LookupReply of refs[0..nhit) (held by the session) until the remote tier says how
 * far hashes[0..nrest) (the prefix past the local tiers' run) goes on there. order[0..norder):
 * the pools searched, pool p's first. KV_OK: the reply is on its way (c->out->deferred); else
 * nothing changed. */
static kv_err lookup_later(rpc *c, uint64_t id, kvd_reg_pool *p, kvd_session_pool *const *order,
                           uint32_t norder, const kvd_block_ref *refs, const uint32_t *pool_of,
                           size_t nhit, const kvd_tier_run *tr, const kv_hash128 *rest,
                           size_t nrest) {
    lookup_wait *w = calloc(1, sizeof(*w));
    if (w != NULL) {
        w->refs = malloc(sizeof(*refs) * (nhit + 1));
        w->pool_of = malloc(sizeof(*pool_of) * (nhit + 1));
    }
    if (w == NULL || w->refs == NULL || w->pool_of == NULL) {
        if (w != NULL) {
            lookup_wait_free(w);
        }
        return KV_ENOMEM;
    }
    later_req_init(&w->q, c, id, p->pool_id);
    for (uint32_t k = 0; k < norder; k++) {
        w->pools[k] = order[k]->pool_id;
        w->serials[k] = order[k]->serial;
    }
    w->npools = norder;
    w->with_pools = pool_of != NULL;
    w->tr = *tr;
    w->nhit = (uint32_t)nhit;
    memcpy(w->refs, refs, sizeof(*refs) * nhit);
    if (pool_of != NULL) {
        memcpy(w->pool_of, pool_of, sizeof(*pool_of) * nhit);
    }
    kv_err rc = kvd_tiers_remote_probe(c->ctx->tiers, p, rest, nrest, on_lookup_remote, w);
    if (rc != KV_OK) {
        lookup_wait_free(w);
        return rc;
    }
    c->sess->fetches++;
    c->out->deferred = 1;
    return KV_OK;
}

static kv_err on_lookup(rpc *c, uint64_t id, const Kvd__Lookup *l, char *msg) {
    kvd_session_pool *sp;
    kvd_reg_pool *p;
    kv_err rc = session_pool(c, l->pool_id, &sp, &p, msg);
    if (rc != KV_OK) {
        return rc;
    }
    size_t n;
    kv_hash128 *hashes;
    rc = take_hashes(c, sp, l->n_hashes, l->hashes, &l->hashes_packed, &hashes, &n, msg);
    if (rc != KV_OK) {
        return rc;
    }
    if (c->reg->reqtrace != NULL && n > 0) {
        kvd_reqtrace_record(c->reg->reqtrace, p->pool_id, hashes, n);
    }
    /* Half the Lookups also run through the pool's two minis (core/duel.h) when the loop
     * has time: queued here, run by the daemon's check handle (kvd_registry_duel_step). */
    kvd_registry_duel_observe(c->reg, p, hashes, n);
    /* Scratch lives in the request arena: nothing to free. */
    kvd_block_ref *refs = rpc_scratch(c, sizeof(*refs) * n);
    uint32_t *pool_of = rpc_scratch(c, sizeof(*pool_of) * n);
    size_t nhit = 0;
    if (refs == NULL || pool_of == NULL) {
        FAIL(KV_ENOMEM, "no memory for %zu hashes", n);
    }
    /* Pools searched, in order: the named one, then with search_domains its links (the same
     * model in the tenant's groups and the commons). Each position takes the first pool that
     * has it; a run continues in that pool. max-held caps the references a lookup may add. */
    kvd_session_pool *order[1 + KVD_MAX_DOMAINS_PER_TENANT];
    uint32_t norder = 0;
    order[norder++] = sp;
    for (uint32_t i = 0; l->search_domains && i < p->nlinks; i++) {
        kvd_session_pool *lsp = kvd_session_find_pool(c->sess, p->links[i]);
        if (lsp != NULL) {
            kvd_pool_set_now(lsp->pool, kvd_registry_now(c->reg));
            order[norder++] = lsp;
        }
    }
    uint64_t max_held = kvd_tenants_quota(c->reg->tenants, c->sess->tenant)->max_held;
    while (nhit < n) {
        size_t got = 0;
        int room[1 + KVD_MAX_DOMAINS_PER_TENANT];
        for (uint32_t k = 0; k < norder && got == 0; k++) {
            size_t m = n - nhit;
            if (max_held != 0) {
                uint64_t held = kvd_pool_tenant_usage(order[k]->pool, c->sess->tenant).held;
                uint64_t left = held < max_held ? max_held - held : 0;
                m = left < m ? (size_t)left : m;
            }
            room[k] = m > 0;
            if (m == 0) {
                continue;
            }
            /* Each position takes the first pool (this one, groups, commons) that has it: a
             * run found in a later pool stops where an earlier pool has the next block. */
            for (size_t t = 1; k > 0 && t < m; t++) {
                int earlier = 0;
                for (uint32_t e = 0; e < k && !earlier; e++) {
                    earlier = room[e] && kvd_pool_has(order[e]->pool, hashes[nhit + t]);
                }
                if (earlier) {
                    m = t;
                }
            }
            rc = kvd_pool_lookup(order[k]->pool, c->sess->tenant, hashes + nhit, m, refs + nhit,
                                 &got);
            if (rc == KV_OK && got > 0) {
                rc = kvd_session_hold(c->sess, order[k], refs + nhit, got);
            }
            if (rc != KV_OK) {
                /* Give back the runs of earlier pools (kvd_session_hold gave back its own). */
                for (size_t j = 0; j < nhit; j++) {
                    kvd_session_unhold(c->sess, kvd_session_find_pool(c->sess, pool_of[j]),
                                       &refs[j], 1);
                }
                if (msg[0] == '\0') {
                    snprintf(msg, KV_ERRMSG, "lookup failed: %s", kv_strerror(rc));
                }
                goto cleanup;
            }
            for (size_t j = nhit; j < nhit + got; j++) {
                pool_of[j] = order[k]->pool_id;
            }
        }
        nhit += got;
        if (got == 0 || norder == 1) {
            break;
        }
    }
    if (c->cfg->verify_blocks) {
        nhit = verify_hits(c, refs, pool_of, nhit);
    }
    kvd_tenant_counters *tc = kvd_events_tenant(&c->reg->events, c->sess->tenant);
    tc->queries++;
    tc->query_blocks += n;
    tc->hit_blocks += nhit;
    tc->hit_tokens += (uint64_t)nhit * p->layout.tokens_per_block;
    /* How far the prefix goes on below T0, for a client that reads it (Hello.features). */
    kvd_tier_run tr = {0, 0, 0};
    if ((c->sess->features & KV_FEATURE_TIERS) && nhit < n && p->tiers != NULL) {
        kvd_tiers_probe(c->ctx->tiers, p, hashes + nhit, n - nhit, &tr);
    }
    /* Lookup.remote: past the local tiers' run, ask Redis (the reply waits for it). */
    remote_answer ra = {0, KV_OK};
    if (l->remote && !(c->sess->features & KV_FEATURE_TIERS)) {
        ra.failure = KV_ENOTSUP; /* the session did not say it reads the tier fields */
    } else if (l->remote) {
        size_t past = nhit + tr.fetchable;
        if (!kvd_tiers_remote_on(c->ctx->tiers, p) || c->ctx->later == NULL) {
            ra.failure = KV_ENOTSUP;
        } else if (!kvd_tenants_domain_writable(c->reg->tenants, c->sess->tenant, p->domain)) {
            ra.failure = KV_EPERM; /* a Fetch would bring nothing into a read-only pool */
        } else if (past < n && c->sess->fetches >= c->cfg->max_inflight) {
            ra.failure = KV_EBUSY;
        } else if (past < n) {
            kv_err e =
                lookup_later(c, id, p, order, norder, refs, l->search_domains ? pool_of : NULL,
                             nhit, &tr, hashes + past, n - past);
            if (e == KV_OK) {
                return KV_OK;
            }
            ra.failure = e == KV_ENOMEM ? KV_ENOMEM : KV_ESYS;
        }
    }
    /* Announce, per searched pool, the segments this session was not sent: a hit may lie in
     * one (PROTOCOL.md §6, Segments a reply hands out). */
    uint32_t nsf = new_segments_from(sp);
    Kvd__SegmentNotice notice[KVD_MAX_DOMAINS_PER_TENANT], *notices[KVD_MAX_DOMAINS_PER_TENANT];
    size_t nnotices = linked_notices(order + 1, norder - 1, notice, notices);
#ifndef NDEBUG
    for (size_t j = 0; j < nhit; j++) {
        if (pool_of[j] == sp->pool_id) {
            check_announced(sp, &refs[j], 1, nsf);
        } else {
            kvd_session_pool *q = kvd_session_find_pool(c->sess, pool_of[j]);
            uint32_t seg = refs[j].id / kvd_pool_config_get(q->pool)->blocks_per_segment;
            int announced = 0;
            for (size_t k = 0; k < nnotices; k++) {
                announced |= notice[k].pool_id == pool_of[j] && notice[k].first_index <= seg;
            }
            KV_ASSERT(kvd_session_pool_was_sent(q, seg) || announced);
        }
    }
#endif
    rc = send_blocks_reply(c, id, refs, nhit, nsf, 1, l->search_domains ? pool_of : NULL, notices,
                           nnotices, &tr, l->remote ? &ra : NULL);
cleanup:
    return rc;
}

/* ---- Fetch: a reply that may come later ---------------------------------------------------- */

/* A Fetch in flight: what its reply needs once the copies are done. */
typedef struct fetch_wait {
    later_req q;
    uint32_t lower_run; /* the run found below T0 */
    uint32_t nt0;       /* T0 hits held for the session at the request */
    kvd_block_ref t0[]; /* [nt0] */
} fetch_wait;

/* Encodes a FetchReply for refs[0..n) (held by the session) through c. */
static kv_err send_fetch_reply(rpc *c, uint64_t id, kvd_session_pool *sp, const kvd_block_ref *refs,
                               size_t n, Kvd__FetchStatus st, uint32_t t0, uint32_t promoted,
                               uint32_t lower, kv_err failure, const char *why) {
    Kvd__FetchReply fr = KVD__FETCH_REPLY__INIT;
    if (blocks_field(c, KV_FEATURE_PACKED, refs, n, &fr.blocks_packed, &fr.blocks, &fr.n_blocks) !=
        KV_OK) {
        return KV_ENOMEM;
    }
    fr.new_segments_from = new_segments_from(sp);
    check_announced(sp, refs, n, fr.new_segments_from);
    fr.status = st;
    fr.t0_hits = t0;
    fr.promoted = promoted;
    fr.lower_run = lower;
    fr.failure = (Kvd__ErrorCode)failure;
    fr.message = (char *)(why != NULL ? why : "");
    Kvd__Envelope env;
    env_init(c, &env, id);
    env.body_case = KVD__ENVELOPE__BODY_FETCH_REPLY;
    env.fetch_reply = &fr;
    return rpc_send(c, &env, NULL, 0);
}

/* The tiers finished a Fetch: the session takes the run's blocks and gets its reply. */
static int on_fetch_done(void *arg, const kvd_fetch_result *r) {
    fetch_wait *w = arg;
    if (r->nok > w->lower_run) {
        w->lower_run = r->nok; /* the remote tier extended the run */
    }
    kvd_session *sess = later_session(&w->q, r->orphan);
    if (sess == NULL) {
        free(w);
        return 0; /* the session closed: the tiers release the run */
    }
    kv_arena arena;
    kvd_rpc_ctx x;
    kvd_reply out;
    later_ctx(&x, &arena, &out, w->q.reg, w->q.cfg, w->q.boot_epoch, NULL);
    kvd_session_pool *sp = !r->detached ? kvd_session_find_pool(sess, w->q.pool_id) : NULL;
    int taken = 0; /* the tiers release what the session does not take */
    kvd_block_ref *all = NULL;
    kv_err rc = KV_OK;
    if (sp == NULL) {
        /* The session detached the pool while its Fetch was in flight (its T0 hits went back
         * with the DetachPool): the request still gets its answer. */
        kvd_rpc_error(&x, sess, w->q.id, KV_ESTATE,
                      "the pool was detached while this Fetch was in flight", &out);
    } else {
        size_t n = w->nt0;
        kv_err failure = KV_OK;
        all = malloc(sizeof(*all) * (w->nt0 + r->nok + 1));
        if (all != NULL) {
            taken = 1;
            memcpy(all, w->t0, sizeof(*all) * w->nt0);
            /* On ENOMEM kvd_session_hold gave the pool references back itself: taken. */
            if (r->nok > 0 && kvd_session_hold(sess, sp, r->refs, r->nok) == KV_OK) {
                memcpy(all + w->nt0, r->refs, sizeof(*all) * r->nok);
                n += r->nok;
            } else if (r->nok > 0) {
                failure = KV_ENOMEM; /* the reply says the run ends at the T0 hits */
            }
        }
        rpc c = {&x, w->q.reg, w->q.cfg, sess, &out, 0};
        if (r->short_run && all != NULL) {
            char why[KV_ERRMSG];
            snprintf(why, sizeof(why),
                     "%u blocks below T0 and none in the remote tier: under min_tokens, recompute "
                     "them",
                     w->lower_run);
            rc = send_fetch_reply(&c, w->q.id, sp, all, w->nt0, KVD__FETCH_STATUS__FETCH_SHORT,
                                  w->nt0, 0, w->lower_run, KV_OK, why);
        } else {
            kv_err code = failure != KV_OK ? failure : r->code;
            uint32_t up = failure != KV_OK ? 0 : r->nok;
            int partial = code != KV_OK || up < w->lower_run;
            char why[KV_ERRMSG];
            snprintf(why, sizeof(why), "%s", "");
            if (partial) {
                snprintf(why, sizeof(why), "%u of %u blocks below T0 came up: %s", up, w->lower_run,
                         code != KV_OK ? kv_strerror(code) : "evicted or failed meanwhile");
            }
            rc = all == NULL
                     ? KV_ENOMEM
                     : send_fetch_reply(&c, w->q.id, sp, all, n,
                                        partial ? KVD__FETCH_STATUS__FETCH_PARTIAL
                                                : KVD__FETCH_STATUS__FETCH_DONE,
                                        w->nt0, up > 0 ? r->promoted : 0, w->lower_run,
                                        partial ? (code != KV_OK ? code : KV_ENOENT) : KV_OK, why);
        }
        if (rc != KV_OK) {
            kvd_rpc_error(&x, sess, w->q.id, KV_ENOMEM, "no memory for the FetchReply", &out);
        }
        out.code = KV_OK;
    }
    w->q.later->send(w->q.later->arg, w->q.session, &out);
    kv_arena_fini(&arena);
    free(all);
    free(w);
    return taken;
}

static kv_err on_fetch(rpc *c, uint64_t id, const Kvd__Fetch *f, char *msg) {
    kvd_session_pool *sp;
    kvd_reg_pool *p;
    kv_err rc = session_pool(c, f->pool_id, &sp, &p, msg);
    if (rc != KV_OK) {
        return rc;
    }
    size_t n;
    kv_hash128 *hashes;
    rc = take_hashes(c, sp, f->n_hashes, f->hashes, &f->hashes_packed, &hashes, &n, msg);
    if (rc != KV_OK) {
        return rc;
    }
    if (c->reg->reqtrace != NULL && n > 0) {
        kvd_reqtrace_record(c->reg->reqtrace, f->pool_id, hashes, n);
    }
    kvd_block_ref *refs = rpc_scratch(c, sizeof(*refs) * n + 1);
    if (refs == NULL) {
        FAIL(KV_ENOMEM, "no memory for %zu hashes", n);
    }
    /* The T0 run first, as a Lookup of this pool gives it (max-held caps it). */
    size_t m = n, nhit = 0;
    uint64_t max_held = kvd_tenants_quota(c->reg->tenants, c->sess->tenant)->max_held;
    if (max_held != 0) {
        uint64_t held = kvd_pool_tenant_usage(p->pool, c->sess->tenant).held;
        uint64_t left = held < max_held ? max_held - held : 0;
        m = left < m ? (size_t)left : m;
    }
    rc = kvd_pool_lookup(p->pool, c->sess->tenant, hashes, m, refs, &nhit);
    if (rc == KV_OK && nhit > 0) {
        rc = kvd_session_hold(c->sess, sp, refs, nhit);
    }
    if (rc != KV_OK) {
        FAIL(rc, "lookup failed: %s", kv_strerror(rc));
    }
    if (c->cfg->verify_blocks && nhit > 0) {
        size_t good = kvd_registry_verify_hits(c->reg, p, refs, nhit);
        if (good < nhit) {
            kvd_session_unhold(c->sess, sp, refs + good, nhit - good);
            nhit = good;
        }
    }
    /* The run below T0 takes references too: max-held caps it as it capped the T0 hits. */
    size_t lower = n - nhit;
    if (max_held != 0) {
        uint64_t held = kvd_pool_tenant_usage(p->pool, c->sess->tenant).held;
        uint64_t left = held < max_held ? max_held - held : 0;
        lower = left < lower ? (size_t)left : lower;
    }
    kvd_tier_run tr = {0, 0, 0};
    if (lower > 0 && p->tiers != NULL) {
        kvd_tiers_probe(c->ctx->tiers, p, hashes + nhit, lower, &tr);
    }
    /* With a remote tier, the rest of the prefix past the local run is asked of Redis. */
    int writable = kvd_tenants_domain_writable(c->reg->tenants, c->sess->tenant, p->domain);
    size_t more = lower > tr.fetchable && writable && c->ctx->later != NULL &&
                          kvd_tiers_remote_on(c->ctx->tiers, p)
                      ? lower - tr.fetchable
                      : 0;
    if (tr.fetchable > 0 && !writable) {
        /* A read-only pool (the commons) takes no blocks from a session, as Allocate says. */
        char why[KV_ERRMSG];
        snprintf(why, sizeof(why), "pool %u is read-only for this tenant: nothing is copied up",
                 p->pool_id);
        return send_fetch_reply(c, id, sp, refs, nhit, KVD__FETCH_STATUS__FETCH_PARTIAL,
                                (uint32_t)nhit, 0, tr.fetchable, KV_EPERM, why);
    }
    if ((tr.fetchable > 0 || more > 0) && c->sess->fetches >= c->cfg->max_inflight) {
        char why[KV_ERRMSG];
        snprintf(why, sizeof(why), "%u Fetches of this session are in flight (max-inflight)",
                 c->sess->fetches);
        return send_fetch_reply(c, id, sp, refs, nhit, KVD__FETCH_STATUS__FETCH_PARTIAL,
                                (uint32_t)nhit, 0, tr.fetchable, KV_EBUSY, why);
    }
    uint32_t tpb = p->layout.tokens_per_block;
    uint64_t min_tokens = f->min_tokens != 0 ? f->min_tokens : c->cfg->fetch_min_tokens;
    if (tr.fetchable == 0 && more == 0) {
        return send_fetch_reply(c, id, sp, refs, nhit, KVD__FETCH_STATUS__FETCH_DONE,
                                (uint32_t)nhit, 0, 0, KV_OK, NULL);
    }
    if (more == 0 && ((uint64_t)tr.fetchable * tpb < min_tokens || c->ctx->later == NULL)) {
        char why[KV_ERRMSG];
        snprintf(why, sizeof(why),
                 "%u blocks (%llu tokens) below T0: under min_tokens %llu, recompute them",
                 tr.fetchable, (unsigned long long)tr.fetchable * tpb,
                 (unsigned long long)min_tokens);
        kvd_tiers_count_short(c->ctx->tiers);
        return send_fetch_reply(c, id, sp, refs, nhit, KVD__FETCH_STATUS__FETCH_SHORT,
                                (uint32_t)nhit, 0, tr.fetchable, KV_OK, why);
    }
    fetch_wait *w = malloc(sizeof(*w) + sizeof(kvd_block_ref) * (nhit + 1));
    if (w == NULL) {
        kvd_session_unhold(c->sess, sp, refs, nhit);
        FAIL(KV_ENOMEM, "no memory for a Fetch");
    }
    later_req_init(&w->q, c, id, p->pool_id);
    w->lower_run = tr.fetchable;
    w->nt0 = (uint32_t)nhit;
    memcpy(w->t0, refs, sizeof(*refs) * nhit);
    uint32_t parent = nhit > 0 ? refs[nhit - 1].id : KVD_NO_BLOCK;
    uint32_t nrun = 0;
    char why[KV_ERRMSG];
    why[0] = '\0';
    rc = kvd_tiers_fetch(c->ctx->tiers, p, c->sess->id, c->sess->tenant, hashes + nhit,
                         tr.fetchable, more, min_tokens, parent, on_fetch_done, w, &nrun, why);
    if (rc != KV_OK) {
        /* No room or quota for the blocks: the T0 hits are still a good answer. */
        free(w);
        return send_fetch_reply(c, id, sp, refs, nhit, KVD__FETCH_STATUS__FETCH_PARTIAL,
                                (uint32_t)nhit, 0, tr.fetchable, rc,
                                why[0] != '\0' ? why : kv_strerror(rc));
    }
    c->sess->fetches++;
    c->out->deferred = 1;
    return KV_OK;
}

/* Checks a handle the session says it holds `times` times, faults in this order (PROTOCOL.md §7,
 * "Which error"): ENOENT for an id that names no block of the pool; EPERM when the session holds
 * no reference on that id (whatever the generation: a block it never received is not its to
 * name); ESTALE when it holds the id at another generation; EPERM when it holds fewer than
 * `times` references. */
static kv_err check_held(kvd_session_pool *sp, kvd_block_ref r, uint32_t times, const char *what,
                         size_t i, char *msg) {
    /* ENOENT exactly when kvd_pool_block_info would say so (an id out of range or in a freed
     * segment); check_ref does not copy the block's record (a hash and ten fields per block of
     * every Release). Its ESTALE is decided below from the ledger, as before. */
    if (kvd_pool_check_ref(sp->pool, r) == KV_ENOENT) {
        FAIL(KV_ENOENT, "%s[%zu]: block %u does not exist in pool %u", what, i, r.id, sp->pool_id);
    }
    uint32_t gen = 0;
    uint32_t held = kvd_refs_count(&sp->refs, r.id, &gen);
    if (held == 0) {
        FAIL(KV_EPERM, "%s[%zu]: block %u is not held by this session", what, i, r.id);
    }
    if (gen != r.gen) {
        FAIL(KV_ESTALE, "%s[%zu]: block %u generation %u is stale (this session holds %u)", what, i,
             r.id, r.gen, gen);
    }
    if (held < times) {
        FAIL(KV_EPERM, "%s[%zu]: block %u is held %u times by this session, not %u", what, i, r.id,
             held, times);
    }
    return KV_OK;
}

/* hash_full and token_ids of one Commit entry: in hash-mode vllm the 32-byte digest whose first
 * 16 bytes are the key (a router names the block by it), else none; token ids, when sent, are
 * exactly the block's. */
static kv_err check_entry_hashes(rpc *c, const kvd_reg_pool *p, const Kvd__CommitEntry *e, size_t i,
                                 char *msg) {
    if (c->reg->vllm) {
        if (e->hash_full.len != KV_VLLM_HASH_BYTES) {
            FAIL(KV_EINVAL,
                 "entries[%zu]: hash_full has %zu bytes; hash-mode vllm needs the block's 32-byte "
                 "sha256_cbor digest (docs/HASH.md)",
                 i, e->hash_full.len);
        }
        kv_hash128 k = kv_vllm_hash_key(e->hash_full.data);
        if (k.lo != e->hash->lo || k.hi != e->hash->hi) {
            FAIL(KV_EINVAL, "entries[%zu]: hash is not the first 16 bytes of hash_full", i);
        }
    } else if (e->hash_full.len != 0 || e->parent_hash_full.len != 0) {
        FAIL(KV_EINVAL,
             "entries[%zu]: hash_full and parent_hash_full are only for hash-mode vllm (this "
             "daemon hashes with xxh3)",
             i);
    }
    if (e->parent_hash_full.len != 0 && e->parent_hash_full.len != KV_VLLM_HASH_BYTES) {
        FAIL(KV_EINVAL, "entries[%zu]: parent_hash_full has %zu bytes (32, or none)", i,
             e->parent_hash_full.len);
    }
    if (e->n_token_ids != 0 && e->n_token_ids != p->layout.tokens_per_block) {
        FAIL(KV_EINVAL, "entries[%zu]: %zu token_ids; a block has %u (or send none)", i,
             e->n_token_ids, p->layout.tokens_per_block);
    }
    return KV_OK;
}

/* After a Commit: BlockStored events for its new canonical blocks, one per chained run. */
static void publish_stored(rpc *c, kvd_reg_pool *p, const Kvd__Commit *cm,
                           const kvd_block_ref *canon, const uint32_t *parents) {
    kvd_kvevents *ev = c->ctx->kvevents;
    if (ev == NULL || !kvd_kvevents_publishes(ev, p)) {
        return;
    }
    size_t n = cm->n_entries;
    kvd_kvevent_block *b = rpc_scratch(c, (n > 0 ? n : 1) * sizeof(*b));
    if (b == NULL) {
        kvd_kvevents_gap(ev);
        return;
    }
    size_t i = 0;
    while (i < n) {
        if (canon[i].id != cm->entries[i]->block->id) {
            i++; /* a duplicate: the block was stored before */
            continue;
        }
        kv_hash128 pk;
        const kv_hash128 *parent = NULL;
        const uint8_t *parent_full = NULL;
        kvd_block_info pinfo;
        if (i > 0 && parents[i] == canon[i - 1].id) {
            /* After a duplicate: the previous entry, whose digest the request carries. */
            const Kvd__CommitEntry *pe = cm->entries[i - 1];
            pk = (kv_hash128){pe->hash->lo, pe->hash->hi};
            parent = &pk;
            parent_full = pe->hash_full.len == KV_VLLM_HASH_BYTES ? pe->hash_full.data : NULL;
        } else if (parents[i] != KVD_NO_BLOCK &&
                   kvd_pool_block_info(p->pool, parents[i], &pinfo) == KV_OK) {
            pk = pinfo.hash;
            parent = &pk;
        }
        const Kvd__CommitEntry *first = cm->entries[i];
        if (first->parent_hash_full.len == KV_VLLM_HASH_BYTES) {
            /* The client's word for a parent in another pool (or one this daemon forgot). */
            pk = kv_vllm_hash_key(first->parent_hash_full.data);
            parent = &pk;
            parent_full = first->parent_hash_full.data;
        }
        size_t m = 0;
        do {
            const Kvd__CommitEntry *e = cm->entries[i];
            b[m].key = (kv_hash128){e->hash->lo, e->hash->hi};
            b[m].full = e->hash_full.len == KV_VLLM_HASH_BYTES ? e->hash_full.data : NULL;
            b[m].tokens = e->n_token_ids > 0 ? e->token_ids : NULL;
            m++;
            i++;
        } while (i < n && canon[i].id == cm->entries[i]->block->id &&
                 parents[i] == canon[i - 1].id);
        kvd_kvevents_stored(ev, p, b, m, parent, parent_full);
    }
}

static kv_err on_commit(rpc *c, uint64_t id, const Kvd__Commit *req, char *msg) {
    kvd_session_pool *sp;
    kvd_reg_pool *p;
    kv_err rc = session_pool(c, req->pool_id, &sp, &p, msg);
    if (rc != KV_OK) {
        return rc;
    }
    /* Either form, checked, as the repeated one (the packed one expanded in the arena). */
    const Kvd__Commit *cm;
    rc = kvd_validate_commit_any(req, c->cfg->max_blocks_per_request, p->layout.tokens_per_block,
                                 kv_arena_allocator(c->ctx->arena), &cm, msg, KV_ERRMSG);
    if (rc != KV_OK) {
        return rc;
    }
    if (!kvd_tenants_domain_writable(c->reg->tenants, c->sess->tenant, p->domain)) {
        FAIL(KV_EPERM, "pool %u is read-only for tenant %s (only the daemon writes the commons)",
             p->pool_id, kvd_tenants_name(c->reg->tenants, c->sess->tenant));
    }
    rc = need_segment0(sp, msg);
    if (rc != KV_OK) {
        return rc;
    }
    size_t n = cm->n_entries;
    kvd_refs seen;
    kvd_refs_init(&seen);
    kvd_block_ref *canon = rpc_scratch(c, (n > 0 ? n : 1) * sizeof(*canon));
    uint32_t *parents = rpc_scratch(c, (n > 0 ? n : 1) * sizeof(*parents));
    if (canon == NULL || parents == NULL) {
        snprintf(msg, KV_ERRMSG, "no memory for %zu entries", n);
        rc = KV_ENOMEM;
        goto cleanup;
    }
    /* Check everything first: the commit itself must not fail half way. */
    for (size_t i = 0; i < n; i++) {
        const Kvd__CommitEntry *e = cm->entries[i];
        kvd_block_ref r = {e->block->id, e->block->gen};
        rc = check_held(sp, r, 1, "entries", i, msg);
        if (rc != KV_OK) {
            goto cleanup;
        }
        kvd_block_info info;
        rc = kvd_pool_block_info(p->pool, r.id, &info);
        if (rc != KV_OK || info.state != KVD_BLOCK_WRITING || info.owner_session != c->sess->id) {
            snprintf(msg, KV_ERRMSG, "entries[%zu]: block %u is not WRITING under this session", i,
                     r.id);
            rc = KV_ESTATE;
            goto cleanup;
        }
        if (info.is_private) {
            snprintf(msg, KV_ERRMSG,
                     "entries[%zu]: block %u is private (Allocate.private or Unshare): private "
                     "blocks are never committed",
                     i, r.id);
            rc = KV_EPERM;
            goto cleanup;
        }
        rc = check_entry_hashes(c, p, e, i, msg);
        if (rc != KV_OK) {
            goto cleanup;
        }
        if (kvd_refs_count(&seen, r.id, NULL) > 0) {
            snprintf(msg, KV_ERRMSG, "entries[%zu]: block %u is listed twice", i, r.id);
            rc = KV_ESTATE;
            goto cleanup;
        }
        /* A valid parent: none (KVD_NO_BLOCK), an earlier entry of this request, or a
         * COMMITTED block of this pool the session holds; never the block itself. */
        if (e->parent != KVD_NO_BLOCK && kvd_refs_count(&seen, e->parent, NULL) == 0) {
            const char *why = NULL;
            kvd_block_info pinfo;
            if (e->parent == r.id) {
                why = "is the block itself";
            } else if (kvd_pool_block_info(p->pool, e->parent, &pinfo) != KV_OK) {
                why = "does not exist in this pool";
            } else if (kvd_refs_count(&sp->refs, e->parent, NULL) == 0) {
                why = "is not held by this session";
            } else if (pinfo.state != KVD_BLOCK_COMMITTED) {
                why = "is not committed (and not an earlier entry of this request)";
            }
            if (why != NULL) {
                snprintf(msg, KV_ERRMSG,
                         "entries[%zu]: parent block %u %s; a parent is a committed block this "
                         "session holds or an earlier entry of the same Commit",
                         i, e->parent, why);
                rc = KV_EINVAL;
                goto cleanup;
            }
        }
        rc = kvd_refs_add(&seen, r.id, r.gen, 1);
        if (rc != KV_OK) {
            snprintf(msg, KV_ERRMSG, "no memory");
            goto cleanup;
        }
    }
    for (size_t i = 0; i < n; i++) {
        const Kvd__CommitEntry *e = cm->entries[i];
        kvd_block_ref r = {e->block->id, e->block->gen};
        kv_hash128 h = {e->hash->lo, e->hash->hi};
        uint32_t parent = e->parent;
        /* A parent committed earlier in this request may have been replaced by a duplicate.
         * Looked for from the entry before (a chain's parent is: O(1) per entry there). */
        for (size_t j = i; j-- > 0 && parent != KVD_NO_BLOCK;) {
            if (cm->entries[j]->block->id == parent) {
                parent = canon[j].id;
                break;
            }
        }
        parents[i] = parent;
        rc = kvd_pool_commit(p->pool, c->sess->id, r, h, parent, &canon[i]);
        if (rc != KV_OK) {
            KV_LOG(ERROR, "KVD-COMMIT", "session %llu: commit of checked block %u failed: %s",
                   (unsigned long long)c->sess->id, r.id, kv_strerror(rc));
            snprintf(msg, KV_ERRMSG, "internal: entries[%zu] failed after %zu were committed: %s",
                     i, i, kv_strerror(rc));
            rc = KV_EINTERNAL;
            goto cleanup;
        }
        if (canon[i].id == r.id && c->cfg->verify_blocks) {
            kvd_registry_verify_commit(c->reg, p, canon[i]);
        }
        if (canon[i].id == r.id && (p->flags & KVD_POOL_SUMMARIES)) {
            /* Before the tiers see it: a copy down takes the summary with it. */
            kv_err src =
                kvd_summaries_set(&p->summ, c->reg->be, c->reg->be_ctx, p->pool, canon[i], NULL);
            if (src != KV_OK) {
                KV_LOG(WARN, "KVD-SUMMARY", "pool %u block %u: no page summary: %s", p->pool_id,
                       canon[i].id, kv_strerror(src));
            }
        }
        if (canon[i].id == r.id) {
            const Kvd__CommitEntry *ce = cm->entries[i];
            kvd_tiers_committed(c->ctx->tiers, p, canon[i],
                                ce->hash_full.len == KV_VLLM_HASH_BYTES ? ce->hash_full.data
                                                                        : NULL);
        }
        if (canon[i].id != r.id && kvd_session_move_ref(c->sess, sp, r.id, canon[i]) != KV_OK) {
            /* Our block was freed; the reference lives on the canonical one, or nowhere. */
            snprintf(msg, KV_ERRMSG, "no memory to record a reference");
            rc = KV_ENOMEM;
            goto cleanup;
        }
    }
    Kvd__Envelope env;
    env_init(c, &env, id);
    kvd_events_tenant(&c->reg->events, c->sess->tenant)->commits += n;
    Kvd__CommitReply cr = KVD__COMMIT_REPLY__INIT;
    if (blocks_field(c, KV_FEATURE_PACKED_COMMIT, canon, n, &cr.canonical_packed, &cr.canonical,
                     &cr.n_canonical) != KV_OK) {
        snprintf(msg, KV_ERRMSG, "no memory for the reply");
        rc = KV_ENOMEM;
        goto cleanup;
    }
    /* A duplicate's canonical block may lie in a segment grown by another session. */
    cr.new_segments_from = new_segments_from(sp);
    check_announced(sp, canon, n, cr.new_segments_from);
    env.body_case = KVD__ENVELOPE__BODY_COMMIT_REPLY;
    env.commit_reply = &cr;
    rc = rpc_send(c, &env, NULL, 0);
    publish_stored(c, p, cm, canon, parents);
    /* After the reply is queued: a promotion into the commons changes no state of this
     * session, and its failure (budget) is not this request's. */
    for (size_t i = 0; i < n && p->commons_id != 0; i++) {
        const Kvd__CommitEntry *e = cm->entries[i];
        kv_hash128 h = {e->hash->lo, e->hash->hi}, ph;
        int has_parent;
        kvd_reg_pool *com = kvd_commons_count_commit(c->reg, cm->pool_id, c->sess->tenant, canon[i],
                                                     h, &ph, &has_parent);
        if (com != NULL && c->ctx->kvevents != NULL) {
            /* In the commons now: its publisher says so, chained to the commons parent. */
            kvd_kvevent_block one = {
                h, e->hash_full.len == KV_VLLM_HASH_BYTES ? e->hash_full.data : NULL,
                e->n_token_ids > 0 ? e->token_ids : NULL};
            const uint8_t *pf = NULL;
            if (has_parent && i > 0 && cm->entries[i - 1]->hash->lo == ph.lo &&
                cm->entries[i - 1]->hash->hi == ph.hi &&
                cm->entries[i - 1]->hash_full.len == KV_VLLM_HASH_BYTES) {
                pf = cm->entries[i - 1]->hash_full.data;
            }
            kvd_kvevents_stored(c->ctx->kvevents, com, &one, 1, has_parent ? &ph : NULL, pf);
        }
    }
cleanup:
    kvd_refs_fini(&seen);
    return rc;
}

/* Occurrences of block ids among one request's list: open addressing in the request arena,
 * sized for the list (load <= 1/2), so counting repeats costs no malloc and no rehash. */
typedef struct seen_tab {
    uint32_t *ids;    /* key per slot; KVD_NO_BLOCK = empty */
    uint32_t *counts; /* occurrences per slot */
    uint32_t mask;    /* slots - 1 (a power of two) */
} seen_tab;

static kv_err seen_init(rpc *c, seen_tab *t, size_t n) {
    size_t cap = 16;
    while (cap < 2 * n) {
        cap *= 2;
    }
    t->ids = rpc_scratch(c, cap * sizeof(uint32_t));
    t->counts = rpc_scratch(c, cap * sizeof(uint32_t));
    if (t->ids == NULL || t->counts == NULL) {
        return KV_ENOMEM;
    }
    memset(t->ids, 0xff, cap * sizeof(uint32_t));
    t->mask = (uint32_t)(cap - 1);
    return KV_OK;
}

/* Counts one more occurrence of id (!= KVD_NO_BLOCK) and returns how many there were. */
static uint32_t seen_add(seen_tab *t, uint32_t id) {
    uint32_t i = (id * 2654435761u) & t->mask;
    while (t->ids[i] != id && t->ids[i] != KVD_NO_BLOCK) {
        i = (i + 1) & t->mask;
    }
    if (t->ids[i] == KVD_NO_BLOCK) {
        t->ids[i] = id;
        t->counts[i] = 0;
    }
    return ++t->counts[i];
}

/* Release and Rewind: the list comes as nrep BlockRefs or as packed (8 bytes a block). */
static kv_err on_release(rpc *c, uint64_t id, uint32_t pool_id, size_t nrep,
                         Kvd__BlockRef *const *blocks, const ProtobufCBinaryData *packed,
                         int rewind, char *msg) {
    kvd_session_pool *sp;
    kv_err rc = session_pool(c, pool_id, &sp, NULL, msg);
    if (rc != KV_OK) {
        return rc;
    }
    /* EINVAL, ETOOBIG, then EPROTO, as for Lookup. */
    size_t n;
    rc = kvd_validate_refs(nrep, blocks, c->cfg->max_blocks_per_request, msg, KV_ERRMSG);
    if (rc == KV_OK) {
        rc = kvd_validate_list(packed->len / KV_WIRE_BLOCK_BYTES, c->cfg->max_blocks_per_request,
                               "blocks_packed", msg, KV_ERRMSG);
    }
    if (rc != KV_OK) {
        return rc;
    }
    if (kv_wire_list_count(nrep, packed->len, KV_WIRE_BLOCK_BYTES, &n) != KV_OK) {
        FAIL(KV_EPROTO,
             "blocks_packed of %zu bytes: not a multiple of %d, or sent together with blocks",
             packed->len, KV_WIRE_BLOCK_BYTES);
    }
    seen_tab times;
    kvd_block_ref *refs = rpc_scratch(c, sizeof(*refs) * n);
    if (refs == NULL || seen_init(c, &times, n) != KV_OK) {
        snprintf(msg, KV_ERRMSG, "no memory");
        rc = KV_ENOMEM;
        goto cleanup;
    }
    for (size_t i = 0; i < n; i++) {
        /* Checked from the local: reading refs[i] back right after its two 4-byte stores
         * misses store forwarding (it cost as much as the rest of the loop). */
        kvd_block_ref r;
        if (nrep > 0) {
            r.id = blocks[i]->id;
            r.gen = blocks[i]->gen;
        } else {
            kv_wire_block_get(packed->data, i, &r.id, &r.gen);
        }
        refs[i] = r;
        /* Count repeats so that a block listed k times needs k references. */
        uint32_t k = r.id != KVD_NO_BLOCK ? seen_add(&times, r.id) : 1;
        rc = check_held(sp, r, k, "blocks", i, msg);
        if (rc != KV_OK) {
            goto cleanup;
        }
    }
    rc = kvd_pool_release(sp->pool, c->sess->id, c->sess->tenant, refs, n);
    if (rc != KV_OK) {
        snprintf(msg, KV_ERRMSG, "release failed: %s", kv_strerror(rc));
        goto cleanup;
    }
    for (size_t i = 0; i < n; i++) {
        KV_ASSERT(kvd_refs_sub(&sp->refs, refs[i].id, 1) == KV_OK);
    }
    if (rewind) {
        kvd_pool_count_rewind(sp->pool, n);
    }
    Kvd__Envelope env;
    env_init(c, &env, id);
    Kvd__ReleaseReply rr = KVD__RELEASE_REPLY__INIT;
    Kvd__RewindReply wr = KVD__REWIND_REPLY__INIT;
    if (rewind) {
        env.body_case = KVD__ENVELOPE__BODY_REWIND_REPLY;
        env.rewind_reply = &wr;
    } else {
        env.body_case = KVD__ENVELOPE__BODY_RELEASE_REPLY;
        env.release_reply = &rr;
    }
    rc = rpc_send(c, &env, NULL, 0);
cleanup:
    return rc;
}

/* Summaries: per hash, the page summary of its block in this pool's T0 or lower tiers. Only
 * the session's own pool is searched, so another domain's summaries are never visible. */
static kv_err on_summaries(rpc *c, uint64_t id, const Kvd__Summaries *m, char *msg) {
    kvd_session_pool *sp;
    kvd_reg_pool *p;
    kv_err rc = session_pool(c, m->pool_id, &sp, &p, msg);
    if (rc != KV_OK) {
        return rc;
    }
    if (!(p->flags & KVD_POOL_SUMMARIES)) {
        FAIL(KV_ENOTSUP,
             "pool %u was attached without Layout.summaries: kvd keeps no page summaries of it",
             p->pool_id);
    }
    kv_hash128 *h;
    size_t n;
    rc = take_hashes(c, sp, 0, NULL, &m->hashes_packed, &h, &n, msg);
    if (rc != KV_OK) {
        return rc;
    }
    size_t per = kvd_summary_floats(&p->layout);
    /* The reply must fit one frame: its envelope and per-entry headers take little, so a
     * quarter of the frame is kept for them. */
    size_t room = c->cfg->max_frame_bytes - c->cfg->max_frame_bytes / 4;
    if (n > 0 && n * per * sizeof(float) > room) {
        FAIL(KV_ETOOBIG,
             "%zu summaries of %zu bytes do not fit one reply frame (max-frame-bytes %llu): ask "
             "at most %zu hashes per request",
             n, per * sizeof(float), (unsigned long long)c->cfg->max_frame_bytes,
             room / (per * sizeof(float)));
    }
    ProtobufCBinaryData *v = rpc_scratch(c, (n + 1) * sizeof(*v));
    if (v == NULL) {
        FAIL(KV_ENOMEM, "no memory for %zu summaries", n);
    }
    for (size_t i = 0; i < n; i++) {
        const float *s = NULL;
        uint64_t packed;
        if (kvd_index_find(c->reg->index, p->pool_id, h[i], &packed) == KV_OK) {
            kvd_block_ref r = {(uint32_t)packed, (uint32_t)(packed >> 32)};
            s = kvd_summaries_get(&p->summ, r);
        }
        if (s == NULL) {
            s = kvd_tiers_summary(c->ctx->tiers, p, h[i]);
        }
        /* float32 on the wire as the host has it: little-endian (kvd builds for x86-64 and
         * arm64 little-endian only). */
        v[i].data = s != NULL ? (uint8_t *)(uintptr_t)s : NULL;
        v[i].len = s != NULL ? per * sizeof(float) : 0;
    }
    Kvd__Envelope env;
    env_init(c, &env, id);
    Kvd__SummariesReply sr = KVD__SUMMARIES_REPLY__INIT;
    sr.n_summaries = n;
    sr.summaries = v;
    env.body_case = KVD__ENVELOPE__BODY_SUMMARIES_REPLY;
    env.summaries_reply = &sr;
    return rpc_send(c, &env, NULL, 0);
}

/* Unshare: every block must be COMMITTED and held once by this session and by nobody else;
 * checked all first, then each leaves the index and becomes the session's private block. */
static kv_err on_unshare(rpc *c, uint64_t id, const Kvd__Unshare *u, char *msg) {
    kvd_session_pool *sp;
    kvd_reg_pool *p;
    kv_err rc = session_pool(c, u->pool_id, &sp, &p, msg);
    if (rc != KV_OK) {
        return rc;
    }
    rc = kvd_validate_refs(u->n_blocks, u->blocks, c->cfg->max_blocks_per_request, msg, KV_ERRMSG);
    if (rc != KV_OK) {
        return rc;
    }
    if (!kvd_tenants_domain_writable(c->reg->tenants, c->sess->tenant, p->domain)) {
        FAIL(KV_EPERM, "pool %u is read-only for tenant %s (only the daemon writes the commons)",
             p->pool_id, kvd_tenants_name(c->reg->tenants, c->sess->tenant));
    }
    seen_tab seen;
    if (seen_init(c, &seen, u->n_blocks) != KV_OK) {
        FAIL(KV_ENOMEM, "no memory");
    }
    for (size_t i = 0; i < u->n_blocks; i++) {
        kvd_block_ref r = {u->blocks[i]->id, u->blocks[i]->gen};
        rc = check_held(sp, r, 1, "blocks", i, msg);
        if (rc != KV_OK) {
            return rc;
        }
        if (seen_add(&seen, r.id) > 1) {
            FAIL(KV_ESTATE, "blocks[%zu]: block %u is listed twice", i, r.id);
        }
        if (kvd_refs_count(&sp->refs, r.id, NULL) > 1) {
            FAIL(KV_EBUSY,
                 "blocks[%zu]: block %u is held %u times by this session; a block is unshared "
                 "only while its one reference is this session's",
                 i, r.id, kvd_refs_count(&sp->refs, r.id, NULL));
        }
        const char *why;
        rc = kvd_pool_unshare_check(p->pool, r, &why);
        if (rc != KV_OK) {
            FAIL(rc,
                 "blocks[%zu]: block %u %s; a write lease exists only on a block this session "
                 "alone holds (copy it into a fresh private block instead)",
                 i, r.id, why != NULL ? why : kv_strerror(rc));
        }
    }
    for (size_t i = 0; i < u->n_blocks; i++) {
        kvd_block_ref r = {u->blocks[i]->id, u->blocks[i]->gen};
        KV_ASSERT(kvd_pool_unshare(p->pool, c->sess->id, c->sess->tenant, r) == KV_OK);
    }
    Kvd__Envelope env;
    env_init(c, &env, id);
    Kvd__UnshareReply ur = KVD__UNSHARE_REPLY__INIT;
    env.body_case = KVD__ENVELOPE__BODY_UNSHARE_REPLY;
    env.unshare_reply = &ur;
    return rpc_send(c, &env, NULL, 0);
}

static kv_err on_pin(rpc *c, uint64_t id, const Kvd__Pin *pin, char *msg) {
    kvd_session_pool *sp;
    kv_err rc = session_pool(c, pin->pool_id, &sp, NULL, msg);
    if (rc != KV_OK) {
        return rc;
    }
    rc = kvd_validate_pin(pin, c->cfg->max_blocks_per_request, msg, KV_ERRMSG);
    if (rc != KV_OK) {
        return rc;
    }
    if (kvd_pool_config_get(sp->pool)->domain == KVD_DOMAIN_COMMONS) {
        FAIL(KV_EPERM, "pool %u is the commons: its blocks cannot be pinned by a tenant",
             pin->pool_id);
    }
    /* A block listed twice is pinned once and costs one unit of max-pinned; retention 0 pins
     * nothing, so it costs nothing. */
    uint64_t new_pins = 0;
    seen_tab once;
    if (seen_init(c, &once, pin->n_blocks) != KV_OK) {
        FAIL(KV_ENOMEM, "no memory");
    }
    for (size_t i = 0; i < pin->n_blocks; i++) {
        kvd_block_ref r = {pin->blocks[i]->id, pin->blocks[i]->gen};
        uint32_t k = r.id != KVD_NO_BLOCK ? seen_add(&once, r.id) : 1;
        rc = check_held(sp, r, 1, "blocks", i, msg);
        if (rc != KV_OK) {
            return rc;
        }
        kvd_block_info info;
        if (kvd_pool_block_info(sp->pool, r.id, &info) != KV_OK ||
            (info.state != KVD_BLOCK_COMMITTED && info.state != KVD_BLOCK_CACHED)) {
            FAIL(KV_ESTATE, "blocks[%zu]: block %u is not committed", i, r.id);
        }
        if (pin->unpin && info.pinned && info.pin_tenant != c->sess->tenant) {
            FAIL(KV_EPERM, "blocks[%zu]: block %u's pin is tenant %s's; only that tenant unpins it",
                 i, r.id, kvd_tenants_name(c->reg->tenants, info.pin_tenant));
        }
        /* A pin of another tenant's becomes this tenant's (charged to who pinned it last). */
        new_pins += (!info.pinned || info.pin_tenant != c->sess->tenant) && k == 1;
    }
    uint64_t max_pinned = kvd_tenants_quota(c->reg->tenants, c->sess->tenant)->max_pinned;
    uint64_t pinned = kvd_pool_tenant_usage(sp->pool, c->sess->tenant).pinned;
    if (!pin->unpin && pin->retention_ms != 0 && max_pinned != 0 &&
        pinned + new_pins > max_pinned) {
        FAIL(KV_EQUOTA,
             "tenant %s: quota max-pinned is %llu blocks per pool; %llu pinned, %llu more asked",
             kvd_tenants_name(c->reg->tenants, c->sess->tenant), (unsigned long long)max_pinned,
             (unsigned long long)pinned, (unsigned long long)new_pins);
    }
    for (size_t i = 0; i < pin->n_blocks; i++) {
        kvd_block_ref r = {pin->blocks[i]->id, pin->blocks[i]->gen};
        rc = pin->unpin ? kvd_pool_unpin(sp->pool, r)
                        : kvd_pool_pin(sp->pool, r, pin->retention_ms, (uint8_t)pin->priority,
                                       c->sess->tenant);
        if (rc != KV_OK) {
            FAIL(rc, "blocks[%zu]: %s", i, kv_strerror(rc));
        }
    }
    Kvd__Envelope env;
    env_init(c, &env, id);
    Kvd__PinReply pr = KVD__PIN_REPLY__INIT;
    env.body_case = KVD__ENVELOPE__BODY_PIN_REPLY;
    env.pin_reply = &pr;
    return rpc_send(c, &env, NULL, 0);
}

typedef struct stat_list {
    Kvd__Stat *v;       /* stats */
    char (*names)[64];  /* their names */
    size_t n, cap;      /* used, allocated */
    const char *prefix; /* prepended to names from a sink */
} stat_list;

static void stat_add(void *arg, const char *name, uint64_t value) {
    stat_list *l = arg;
    if (l->n == l->cap) {
        return;
    }
    kvd__stat__init(&l->v[l->n]);
    snprintf(l->names[l->n], sizeof(l->names[0]), "%s%s", l->prefix, name);
    l->v[l->n].name = l->names[l->n];
    l->v[l->n].value = value;
    l->n++;
}

static kv_err on_stats(rpc *c, uint64_t id, const Kvd__Stats *st, char *msg) {
    kvd_registry *s = c->reg;
    kvd_session_pool *sp = NULL;
    if (st->pool_id != 0) {
        kv_err rc = session_pool(c, st->pool_id, &sp, NULL, msg);
        if (rc != KV_OK) {
            return rc;
        }
    }
    stat_list l;
    l.cap = 128;
    l.n = 0;
    l.prefix = "";
    l.v = rpc_scratch(c, l.cap * sizeof(*l.v));
    l.names = rpc_scratch(c, l.cap * sizeof(*l.names));
    Kvd__Stat **pv = rpc_scratch(c, l.cap * sizeof(*pv));
    if (l.v == NULL || l.names == NULL || pv == NULL) {
        FAIL(KV_ENOMEM, "no memory for stats");
    }
    stat_add(&l, "daemon.sessions", c->ctx->conns != NULL ? c->ctx->conns->conns : 0);
    stat_add(&l, "daemon.pools", s->npools);
    stat_add(&l, "daemon.pool_memory_bytes", c->cfg->pool_memory);
    stat_add(&l, "daemon.pool_memory_used", kvd_registry_budget_used(s));
    stat_add(&l, "daemon.buffer_bytes", c->ctx->conns != NULL ? c->ctx->conns->buffer_bytes : 0);
    stat_add(&l, "daemon.conns_paused", c->ctx->conns != NULL ? c->ctx->conns->paused : 0);
    stat_add(&l, "session.id", c->sess->id);
    stat_add(&l, "session.requests", c->sess->requests);
    stat_add(&l, "session.errors", c->sess->errors);
    stat_add(&l, "session.pools_attached", c->sess->npools);
    stat_add(&l, "session.refs_held", kvd_session_refs_held(c->sess));
    if (kvd_tiers_on(c->ctx->tiers)) {
        l.prefix = "tiers.";
        kvd_tiers_stats(c->ctx->tiers, stat_add, &l);
        l.prefix = "";
    }
    if (sp != NULL) {
        stat_add(&l, "pool.id", sp->pool_id);
        l.prefix = "pool.";
        kvd_pool_stats(sp->pool, stat_add, &l);
        l.prefix = "";
        stat_add(&l, "pool.session_refs", sp->refs.total);
    }
    for (size_t i = 0; i < l.n; i++) {
        pv[i] = &l.v[i];
    }
    Kvd__Envelope env;
    env_init(c, &env, id);
    Kvd__StatsReply sr = KVD__STATS_REPLY__INIT;
    sr.n_stats = l.n;
    sr.stats = pv;
    env.body_case = KVD__ENVELOPE__BODY_STATS_REPLY;
    env.stats_reply = &sr;
    return rpc_send(c, &env, NULL, 0);
}

static kv_err on_ping(rpc *c, uint64_t id, const Kvd__Ping *p, char *msg) {
    kv_err rc = kvd_validate_ping(p, c->cfg->max_frame_bytes, msg, KV_ERRMSG);
    if (rc != KV_OK) {
        return rc;
    }
    Kvd__Envelope env;
    env_init(c, &env, id);
    Kvd__Pong pong = KVD__PONG__INIT;
    pong.nonce = p->nonce;
    pong.payload = p->payload;
    env.body_case = KVD__ENVELOPE__BODY_PONG;
    env.pong = &pong;
    return rpc_send(c, &env, NULL, 0);
}

/* DetachPool: the session gives back every reference in the pool and its linked pools and
 * stops using them; the registry may free them when no session uses them. */
static kv_err on_detach(rpc *c, uint64_t id, const Kvd__DetachPool *d, char *msg) {
    kvd_session_pool *sp;
    kvd_reg_pool *p;
    kv_err rc = session_pool(c, d->pool_id, &sp, &p, msg);
    if (rc != KV_OK) {
        return rc;
    }
    uint32_t ids[KVD_MAX_DOMAINS_PER_TENANT + 1];
    uint32_t n = 0;
    ids[n++] = p->pool_id;
    for (uint32_t i = 0; i < p->nlinks; i++) {
        if (kvd_session_find_pool(c->sess, p->links[i]) != NULL) {
            ids[n++] = p->links[i];
        }
    }
    uint64_t released = 0;
    for (uint32_t i = 0; i < n; i++) {
        kvd_tiers_pool_detached(c->ctx->tiers, c->sess->id, ids[i]); /* its Fetches in flight */
        released += kvd_session_drop_pool(c->sess, ids[i]);
    }
    kvd_registry_sessions_gone(c->reg, ids, n); /* p may be freed now */
    Kvd__Envelope env;
    env_init(c, &env, id);
    Kvd__DetachPoolReply dr = KVD__DETACH_POOL_REPLY__INIT;
    dr.released = released;
    env.body_case = KVD__ENVELOPE__BODY_DETACH_POOL_REPLY;
    env.detach_pool_reply = &dr;
    return rpc_send(c, &env, NULL, 0);
}

static kv_err on_goodbye(rpc *c, uint64_t id) {
    Kvd__Envelope env;
    env_init(c, &env, id);
    Kvd__GoodbyeReply gr = KVD__GOODBYE_REPLY__INIT;
    env.body_case = KVD__ENVELOPE__BODY_GOODBYE_REPLY;
    env.goodbye_reply = &gr;
    kv_err rc = rpc_send(c, &env, NULL, 0);
    c->out->close_after = 1;
    return rc;
}

/* The one table of requests: a handler per Envelope body case. Release and Rewind share one
 * (named apart in stats). */
typedef kv_err (*handler_fn)(rpc *c, const Kvd__Envelope *env, char *msg);

static kv_err h_hello(rpc *c, const Kvd__Envelope *e, char *msg) {
    return on_hello(c, e->id, e->hello, msg);
}
static kv_err h_attach(rpc *c, const Kvd__Envelope *e, char *msg) {
    return on_attach(c, e->id, e->attach_pool, msg);
}
static kv_err h_map(rpc *c, const Kvd__Envelope *e, char *msg) {
    return on_map(c, e->id, e->map_segments, msg);
}
static kv_err h_lookup(rpc *c, const Kvd__Envelope *e, char *msg) {
    return on_lookup(c, e->id, e->lookup, msg);
}
static kv_err h_allocate(rpc *c, const Kvd__Envelope *e, char *msg) {
    return on_allocate(c, e->id, e->allocate, msg);
}
static kv_err h_commit(rpc *c, const Kvd__Envelope *e, char *msg) {
    return on_commit(c, e->id, e->commit, msg);
}
static kv_err h_release(rpc *c, const Kvd__Envelope *e, char *msg) {
    return on_release(c, e->id, e->release->pool_id, e->release->n_blocks, e->release->blocks,
                      &e->release->blocks_packed, 0, msg);
}
static kv_err h_rewind(rpc *c, const Kvd__Envelope *e, char *msg) {
    return on_release(c, e->id, e->rewind->pool_id, e->rewind->n_blocks, e->rewind->blocks,
                      &e->rewind->blocks_packed, 1, msg);
}
static kv_err h_pin(rpc *c, const Kvd__Envelope *e, char *msg) {
    return on_pin(c, e->id, e->pin, msg);
}
static kv_err h_stats(rpc *c, const Kvd__Envelope *e, char *msg) {
    return on_stats(c, e->id, e->stats, msg);
}
static kv_err h_ping(rpc *c, const Kvd__Envelope *e, char *msg) {
    return on_ping(c, e->id, e->ping, msg);
}
static kv_err h_detach(rpc *c, const Kvd__Envelope *e, char *msg) {
    return on_detach(c, e->id, e->detach_pool, msg);
}
static kv_err h_fetch(rpc *c, const Kvd__Envelope *e, char *msg) {
    return on_fetch(c, e->id, e->fetch, msg);
}
static kv_err h_summaries(rpc *c, const Kvd__Envelope *e, char *msg) {
    return on_summaries(c, e->id, e->summaries, msg);
}
static kv_err h_unshare(rpc *c, const Kvd__Envelope *e, char *msg) {
    return on_unshare(c, e->id, e->unshare, msg);
}
static kv_err h_goodbye(rpc *c, const Kvd__Envelope *e, char *msg) {
    (void)msg;
    return on_goodbye(c, e->id);
}

/* Indexed by the body case (the body's field number), so dispatch is one load. */
static const handler_fn handlers[] = {
    [KVD__ENVELOPE__BODY_HELLO] = h_hello,
    [KVD__ENVELOPE__BODY_ATTACH_POOL] = h_attach,
    [KVD__ENVELOPE__BODY_MAP_SEGMENTS] = h_map,
    [KVD__ENVELOPE__BODY_LOOKUP] = h_lookup,
    [KVD__ENVELOPE__BODY_ALLOCATE] = h_allocate,
    [KVD__ENVELOPE__BODY_COMMIT] = h_commit,
    [KVD__ENVELOPE__BODY_RELEASE] = h_release,
    [KVD__ENVELOPE__BODY_REWIND] = h_rewind,
    [KVD__ENVELOPE__BODY_PIN] = h_pin,
    [KVD__ENVELOPE__BODY_STATS] = h_stats,
    [KVD__ENVELOPE__BODY_PING] = h_ping,
    [KVD__ENVELOPE__BODY_GOODBYE] = h_goodbye,
    [KVD__ENVELOPE__BODY_DETACH_POOL] = h_detach,
    [KVD__ENVELOPE__BODY_FETCH] = h_fetch,
    [KVD__ENVELOPE__BODY_UNSHARE] = h_unshare,
    [KVD__ENVELOPE__BODY_SUMMARIES] = h_summaries,
};

/* The pool a request names (0: none), for the refusal's event. */
static uint32_t request_pool(const Kvd__Envelope *e) {
    switch (e->body_case) {
        case KVD__ENVELOPE__BODY_MAP_SEGMENTS:
            return e->map_segments->pool_id;
        case KVD__ENVELOPE__BODY_LOOKUP:
            return e->lookup->pool_id;
        case KVD__ENVELOPE__BODY_ALLOCATE:
            return e->allocate->pool_id;
        case KVD__ENVELOPE__BODY_COMMIT:
            return e->commit->pool_id;
        case KVD__ENVELOPE__BODY_RELEASE:
            return e->release->pool_id;
        case KVD__ENVELOPE__BODY_REWIND:
            return e->rewind->pool_id;
        case KVD__ENVELOPE__BODY_PIN:
            return e->pin->pool_id;
        case KVD__ENVELOPE__BODY_STATS:
            return e->stats->pool_id;
        case KVD__ENVELOPE__BODY_DETACH_POOL:
            return e->detach_pool->pool_id;
        case KVD__ENVELOPE__BODY_FETCH:
            return e->fetch->pool_id;
        case KVD__ENVELOPE__BODY_UNSHARE:
            return e->unshare->pool_id;
        case KVD__ENVELOPE__BODY_SUMMARIES:
            return e->summaries->pool_id;
        default:
            return 0;
    }
}

static void rpc_error(const kvd_rpc_ctx *ctx, kvd_session *sess, uint64_t id, uint32_t pool,
                      kv_err code, const char *msg, kvd_reply *out);

void kvd_rpc_error(const kvd_rpc_ctx *ctx, kvd_session *sess, uint64_t id, kv_err code,
                   const char *msg, kvd_reply *out) {
    rpc_error(ctx, sess, id, 0, code, msg, out);
}

static void rpc_error(const kvd_rpc_ctx *ctx, kvd_session *sess, uint64_t id, uint32_t pool,
                      kv_err code, const char *msg, kvd_reply *out) {
    memset(out, 0, sizeof(*out));
    out->code = code;
    Kvd__Envelope env = KVD__ENVELOPE__INIT;
    Kvd__Error err = KVD__ERROR__INIT;
    err.code = (Kvd__ErrorCode)code;
    err.message = (char *)(msg != NULL && msg[0] != '\0' ? msg : kv_strerror(code));
    env.id = id;
    env.boot_epoch = ctx->boot_epoch;
    env.body_case = KVD__ENVELOPE__BODY_ERROR;
    env.error = &err;
    if (sess != NULL) {
        sess->errors++;
    }
    int hello = sess != NULL && sess->hello;
    if (kvd_events_is_refusal(code)) {
        kvd_events_push(
            &ctx->reg->events, KVD_EVENT_REFUSE, pool, hello ? (int64_t)sess->tenant : -1, 1, code,
            kv_err_name(code), "session %llu (pid %d uid %d): %s",
            sess != NULL ? (unsigned long long)sess->id : 0ull, sess != NULL ? (int)sess->pid : 0,
            sess != NULL ? (int)sess->uid : -1, err.message);
        if (hello) {
            kvd_events_tenant(&ctx->reg->events, sess->tenant)->refusals++;
        }
    }
    KV_LOG(DEBUG, "KVD-REQ-ERROR", "session %llu request %llu: %s: %s",
           sess != NULL ? (unsigned long long)sess->id : 0ull, (unsigned long long)id,
           kv_err_name(code), err.message);
    size_t n = kv_wire_frame_size(&env);
    uint8_t *buf = kv_arena_alloc(ctx->arena, n);
    if (buf != NULL) {
        kv_wire_encode_into(&env, buf);
        out->frame = buf;
        out->len = n;
    }
    size_t wl = strlen(err.message) + 1;
    char *why = kv_arena_alloc(ctx->arena, wl);
    if (why != NULL) {
        memcpy(why, err.message, wl);
    }
    out->why = why;
}

void kvd_rpc_handle(const kvd_rpc_ctx *ctx, kvd_session *sess, const Kvd__Envelope *env,
                    kvd_reply *out) {
    memset(out, 0, sizeof(*out));
    rpc call = {ctx, ctx->reg, ctx->cfg, sess, out, 0};
    rpc *c = &call;
    char msg[KV_ERRMSG];
    msg[0] = '\0';
    kv_err rc;
    sess->requests++;
    if (env->boot_epoch != 0 && env->boot_epoch != ctx->boot_epoch) {
        snprintf(msg, sizeof(msg),
                 "request is for boot epoch %016llx; this daemon is %016llx: re-attach",
                 (unsigned long long)env->boot_epoch, (unsigned long long)ctx->boot_epoch);
        rc = KV_EEPOCH;
    } else if (!sess->hello && env->body_case != KVD__ENVELOPE__BODY_HELLO) {
        snprintf(msg, sizeof(msg), "Hello must be the first request");
        rc = KV_EPROTO;
    } else {
        size_t body = (size_t)env->body_case;
        handler_fn fn = body < sizeof(handlers) / sizeof(handlers[0]) ? handlers[body] : NULL;
        if (fn != NULL) {
            rc = fn(c, env, msg);
        } else {
            snprintf(msg, sizeof(msg), "body %d is not a request", (int)env->body_case);
            rc = KV_EPROTO;
        }
    }
    if (rc == KV_OK && (out->frame != NULL || out->queued || out->deferred)) {
        return;
    }
    if (rc == KV_OK) {
        rc = KV_ENOMEM; /* the reply did not fit the arena */
        snprintf(msg, sizeof(msg), "no memory for the reply");
    }
    rpc_error(ctx, sess, env->id, request_pool(env), rc, msg, out);
}

void kvd_rpc_session_close(const kvd_rpc_ctx *ctx, kvd_session *sess) {
    /* The pools' clocks first: released blocks record their last access at close time, and
     * pins that expired meanwhile are swept before the blocks rejoin the eviction order. */
    uint64_t now = kvd_registry_now(ctx->reg);
    uint32_t npools = sess->npools;
    uint32_t *ids = npools > 0 ? malloc(sizeof(*ids) * npools) : NULL;
    for (uint32_t i = 0; i < npools; i++) {
        kvd_pool_set_now(sess->pools[i].pool, now);
        if (ids != NULL) {
            ids[i] = sess->pools[i].pool_id;
        }
    }
    int hello = sess->hello;
    uint32_t tenant = sess->tenant;
    kvd_tiers_session_gone(ctx->tiers, sess->id);
    kvd_session_fini(sess);
    if (hello) {
        kvd_registry_session_close(ctx->reg, tenant);
    }
    /* Pools no session uses and that hold nothing are freed (a pool with a cache stays). */
    if (ids != NULL || npools == 0) {
        kvd_registry_sessions_gone(ctx->reg, ids, npools);
    } else {
        KV_LOG(WARN, "KVD-CONN-CLOSE", "no memory to count the pools of a closed session");
    }
    free(ids);
}
