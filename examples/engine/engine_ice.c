/* engine_ice: the example engine's IceCache mode (docs/ICECACHE.md, engine_int.h). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "examples/engine/engine_int.h"
#include "examples/engine/icecache.h"
#include "kernels/kvk_dtype.h"

/* ---- IceCache: the per-layer selection and fetch of a decode row (docs/ICECACHE.md) ------
 * The row's query picks, per KV head, the top-k offloaded pages from their summaries; the union
 * is fetched in one round trip (pages still in T0 are hits, the others come up from kvd's lower
 * tiers) and held until the forward pass ends; the row attends to its sinks, those pages and
 * its window. */
kv_err kve__ice_select_fetch(kve_engine *e, req_state *rs, uint32_t layer, const float *q,
                             ice_row *ir) {
    const kve_config *c = &e->m->cfg;
    uint32_t KH = (uint32_t)c->n_kv_heads, hd = (uint32_t)kve_head_dim(c);
    uint32_t k = e->o.ice_budget < rs->ice_n ? e->o.ice_budget : (uint32_t)rs->ice_n;
    double t0 = kve__now_ms();
    ir->nins = 0;
    if (k == 0) {
        return KV_OK;
    }
    int32_t *sel = malloc((size_t)KH * k * sizeof(int32_t));
    uint8_t *mark = calloc(rs->ice_n, 1);
    uint32_t *pages = malloc(rs->ice_n * sizeof(uint32_t));
    kvc_block *out = malloc(rs->ice_n * sizeof(kvc_block));
    kvc_fetch_result *res = malloc(rs->ice_n * sizeof(kvc_fetch_result));
    size_t *idx = malloc(rs->ice_n * sizeof(size_t));
    kvc_batch *b = NULL;
    kv_err rc = KV_ENOMEM;
    if (!sel || !mark || !pages || !out || !res || !idx) {
        goto cleanup;
    }
    kvk_select_args a = {.summaries = rs->ice_summ,
                         .npages = (uint32_t)rs->ice_n,
                         .num_layers = (uint32_t)c->n_layers,
                         .layer = layer,
                         .num_kv_heads = KH,
                         .head_dim = hd,
                         .q = q,
                         .num_qo_heads = (uint32_t)c->n_heads,
                         .k = k,
                         .mode = e->o.ice_centroid ? KVK_SELECT_CENTROID : KVK_SELECT_BOUND};
    rc = kvk_page_select_cpu(&a, sel, NULL);
    if (rc != KV_OK) {
        rc = kve__fail(e, rc, "page select: %s", kvk_last_error());
        goto cleanup;
    }
    uint32_t nu = 0;
    for (size_t i = 0; i < (size_t)KH * k; i++) {
        if (!mark[sel[i]]) {
            mark[sel[i]] = 1;
        }
    }
    for (uint32_t p = 0; p < rs->ice_n; p++) {
        if (mark[p]) {
            pages[nu++] = p;
        }
    }
    rc = kvc_batch_alloc(e->conn, &b);
    for (uint32_t j = 0; j < nu && rc == KV_OK; j++) {
        rc = kvc_batch_fetch(b, e->pool, &rs->ice_hash[pages[j]], 1, 1, &out[j], &res[j], &idx[j]);
    }
    if (rc == KV_OK) {
        rc = kvc_batch_run(b);
    }
    if (rc != KV_OK) {
        rc = kve__fail(e, rc, "ice fetch: %s", kvc_last_error(e->conn));
        goto cleanup;
    }
    if (ir->nheld + nu > ir->cap) {
        size_t nc = (ir->nheld + nu) * 2;
        kvc_block *nh = realloc(ir->held, nc * sizeof(kvc_block));
        if (nh != NULL) {
            ir->held = nh; /* kept at once: the old buffer is gone */
        }
        int32_t *ni = nh != NULL ? realloc(ir->ins, nc * sizeof(int32_t)) : NULL;
        if (ni != NULL) {
            ir->ins = ni;
        }
        if (nh == NULL || ni == NULL) {
            /* Give back what this fetch got: nothing else holds it. */
            for (uint32_t j = 0; j < nu; j++) {
                if (kvc_batch_status(b, idx[j]) == KV_OK && res[j].nblocks == 1) {
                    (void)kvc_release(e->pool, &out[j], 1);
                }
            }
            rc = KV_ENOMEM;
            goto cleanup;
        }
        ir->cap = nc;
    }
    for (uint32_t j = 0; j < nu; j++) {
        if (kvc_batch_status(b, idx[j]) == KV_OK && res[j].nblocks == 1) {
            ir->held[ir->nheld++] = out[j];
            ir->ins[ir->nins++] = (int32_t)out[j].id;
            e->st.ice_pages_fetched++;
            e->st.ice_pages_promoted += res[j].promoted;
        } else {
            e->st.ice_pages_missing++; /* gone from every tier: attended without it */
        }
    }
    e->st.ice_selections++;
    rc = KV_OK;
cleanup:
    kvc_batch_free(b);
    free(sel), free(mark), free(pages), free(out), free(res), free(idx);
    e->st.ice_step_ms += kve__now_ms() - t0;
    return rc;
}

/* ---- IceCache: offload ---------------------------------------------------------------------
 * A decoding sequence keeps its first ice_sinks pages and its last ice_window pages in its
 * table. The first time the rest outgrows the budget, the middle pages' tokens are packed by key
 * similarity (icecache.h; token order with ice_no_pack), gathered into fresh blocks that are
 * committed under hashes of this engine's own (so kvd may demote them to its lower tiers, and
 * keeps their summaries), and given back; later, each window page that leaves the window is
 * offloaded the same way in token order (the index updated at decode). The table itself is then
 * rebuilt from the sinks and the window (kvc_seq_compact into private blocks). */

static size_t ice_pos(const kve_engine *e, const req_state *rs, size_t slot) {
    return slot < (size_t)e->o.ice_sinks * e->tpb ? slot : slot + rs->dropped;
}

static kv_err ice_init(kve_engine *e, req_state *rs) {
    if (rs->slotpos != NULL) {
        return KV_OK;
    }
    rs->cap = ((size_t)e->o.ice_sinks + e->o.ice_window + 2) * e->tpb;
    rs->slotpos = calloc(rs->cap, sizeof(uint32_t));
    rs->gscore = calloc(rs->cap, sizeof(float));
    return rs->slotpos != NULL && rs->gscore != NULL ? KV_OK
                                                     : kve__fail(e, KV_ENOMEM, "no IceCache state");
}

/* Offloads the sequence's pages [p0, p1) (full ones) and rebuilds its table without them. */
static kv_err ice_offload(kve_engine *e, req_state *rs, size_t p0, size_t p1, int pack) {
    const kve_config *c = &e->m->cfg;
    const uint32_t L = (uint32_t)c->n_layers, KH = (uint32_t)c->n_kv_heads;
    const uint32_t hd = (uint32_t)kve_head_dim(c), tpb = e->tpb;
    const size_t len = kvc_seq_length(rs->seq), np = p1 - p0, ntok = np * tpb;
    const size_t nkept = len - ntok, nfresh = kve__blocks_for(e, nkept);
    const size_t per = KVK_SUMMARY_FLOATS(L, KH, hd), width = (size_t)L * KH * hd;
    double t0 = kve__now_ms();
    kv_err rc = ice_init(e, rs);
    if (rc != KV_OK) {
        return rc;
    }
    uint32_t *order = malloc(ntok * sizeof(uint32_t));
    float *keys = pack ? malloc(ntok * width * sizeof(float)) : NULL;
    int64_t *src = malloc((ntok > nkept ? ntok : nkept) * sizeof(int64_t));
    int32_t *dst = malloc((np > nfresh ? np : nfresh) * sizeof(int32_t));
    kvc_block *blk = malloc(np * sizeof(kvc_block)), *fresh = malloc(nfresh * sizeof(kvc_block));
    kvc_commit_entry *ent = malloc(np * sizeof(kvc_commit_entry));
    kvc_block *canon = malloc(np * sizeof(kvc_block));
    uint32_t *ids = malloc((tpb > nkept ? tpb : nkept) * sizeof(uint32_t));
    uint32_t *pos = malloc(nkept * sizeof(uint32_t));
    kvk_cache cache[64];
    uint32_t la[64];
    int got_blocks = 0, got_fresh = 0;
    rc = KV_ENOMEM;
    if (!order || (pack && !keys) || !src || !dst || !blk || !fresh || !ent || !canon || !ids ||
        !pos) {
        goto cleanup;
    }
    for (uint32_t l = 0; l < L; l++) {
        rc = kve__layer_cache(e, l, &cache[l], &la[l]);
        if (rc != KV_OK) {
            goto cleanup;
        }
    }
    for (size_t i = 0; i < ntok; i++) {
        order[i] = (uint32_t)i;
    }
    if (pack) {
        /* Every layer's keys side by side: one packing for all layers (a block holds them). */
        for (size_t i = 0; i < ntok; i++) {
            size_t slot = p0 * tpb + i;
            uint32_t b = kvc_seq_block(rs->seq, slot / tpb).id;
            for (uint32_t l = 0; l < L; l++) {
                for (uint32_t g = 0; g < KH; g++) {
                    kve__load_key(&cache[l], la[l], b, (uint32_t)(slot % tpb), g,
                                  keys + i * width + ((size_t)l * KH + g) * hd);
                }
            }
        }
        rc = kve_ice_pack(keys, ntok, width, tpb, order);
        if (rc != KV_OK) {
            goto cleanup;
        }
    }
    /* The pages to offload: fresh blocks, gathered, committed under this engine's hashes. */
    rc = kvc_allocate(e->pool, (uint32_t)np, blk);
    if (rc == KV_ENOSPC) {
        rc = KV_OK; /* no room now: the next step tries again */
        goto cleanup;
    }
    if (rc != KV_OK) {
        rc = kve__fail(e, rc, "ice allocate: %s", kvc_last_error(e->conn));
        goto cleanup;
    }
    got_blocks = 1;
    for (size_t i = 0; i < ntok; i++) {
        size_t slot = p0 * tpb + order[i];
        src[i] = (int64_t)kvc_seq_block(rs->seq, slot / tpb).id * tpb + slot % tpb;
    }
    for (size_t j = 0; j < np; j++) {
        dst[j] = (int32_t)blk[j].id;
    }
    uint32_t nviews = cache[0].num_sections == 2 ? L : 1;
    for (uint32_t l = 0; l < nviews; l++) {
        rc = kvk_compact_tokens_cpu(&cache[l], &cache[l], src, (uint32_t)ntok, dst);
        if (rc != KV_OK) {
            rc = kve__fail(e, rc, "ice gather: %s", kvk_last_error());
            goto cleanup;
        }
    }
    if (rs->ice_n + np > rs->ice_cap) {
        size_t nc = (rs->ice_n + np) * 2;
        kv_hash128 *nh = realloc(rs->ice_hash, nc * sizeof(kv_hash128));
        if (nh == NULL) {
            goto cleanup;
        }
        rs->ice_hash = nh;
        float *ns = realloc(rs->ice_summ, nc * per * sizeof(float));
        if (ns == NULL) {
            goto cleanup;
        }
        rs->ice_summ = ns;
        rs->ice_cap = nc;
    }
    for (size_t j = 0; j < np; j++) {
        uint32_t extra[4] = {(uint32_t)e->nonce, (uint32_t)(e->nonce >> 32), rs->r->id,
                             rs->ice_serial++};
        for (uint32_t t = 0; t < tpb; t++) {
            ids[t] = rs->toks[ice_pos(e, rs, p0 * tpb + order[j * tpb + t])];
        }
        size_t nh = 0;
        rc = kvc_pool_hash_tokens(e->pool, extra, sizeof(extra), ids, tpb,
                                  &rs->ice_hash[rs->ice_n + j], 1, &nh);
        if (rc != KV_OK) {
            goto cleanup;
        }
        ent[j] = (kvc_commit_entry){blk[j], rs->ice_hash[rs->ice_n + j], KVC_NO_PARENT};
    }
    rc = kvc_commit(e->pool, ent, np, canon);
    if (rc != KV_OK) {
        rc = kve__fail(e, rc, "ice commit: %s", kvc_last_error(e->conn));
        goto cleanup;
    }
    got_blocks = 0; /* the commit's references (canon) are what is held now: released below */
    /* The summaries while the pages are still held (nothing can evict them yet), then the
     * pages go back: cached in T0, demoted below as kvd decides. */
    uint8_t *found = malloc(np);
    rc = found == NULL ? KV_ENOMEM
                       : kvc_summaries(e->pool, rs->ice_hash + rs->ice_n, np,
                                       rs->ice_summ + rs->ice_n * per, found);
    for (size_t j = 0; rc == KV_OK && j < np; j++) {
        if (!found[j]) {
            rc = kve__fail(e, KV_EINTERNAL, "no summary of a page just committed");
        }
    }
    free(found);
    kv_err rrc = kvc_release(e->pool, canon, np);
    rc = rc == KV_OK ? rrc : rc;
    if (rc != KV_OK) {
        rc = kve__fail(e, rc, "ice summaries: %s", kvc_last_error(e->conn));
        goto cleanup;
    }
    rs->ice_n += np;
    e->st.ice_pages_out += np;
    /* The table without them: sinks and window, into private blocks. */
    size_t k = 0;
    for (size_t s = 0; s < len; s++) {
        if (s >= p0 * tpb && s < p1 * tpb) {
            continue;
        }
        src[k] = (int64_t)kvc_seq_block(rs->seq, s / tpb).id * tpb + s % tpb;
        pos[k] = (uint32_t)ice_pos(e, rs, s);
        ids[k] = rs->toks[pos[k]];
        k++;
    }
    rc = kvc_allocate_private(e->pool, (uint32_t)nfresh, fresh);
    if (rc != KV_OK) {
        rc =
            rc == KV_ENOSPC ? KV_OK : kve__fail(e, rc, "ice allocate: %s", kvc_last_error(e->conn));
        /* The pages are offloaded twice until the table can be rebuilt: harmless, and rare. */
        rs->ice_n -= np;
        goto cleanup;
    }
    got_fresh = 1;
    for (size_t j = 0; j < nfresh; j++) {
        dst[j] = (int32_t)fresh[j].id;
    }
    for (uint32_t l = 0; l < nviews; l++) {
        rc = kvk_compact_tokens_cpu(&cache[l], &cache[l], src, (uint32_t)nkept, dst);
        if (rc != KV_OK) {
            rc = kve__fail(e, rc, "ice rebuild: %s", kvk_last_error());
            goto cleanup;
        }
    }
    rc = kvc_seq_compact(rs->seq, ids, nkept, fresh, nfresh);
    got_fresh = 0;
    if (rc != KV_OK) {
        rc = kve__fail(e, rc, "ice compact: %s", kvc_last_error(e->conn));
        goto cleanup;
    }
    rs->dropped += ntok;
    for (size_t i = 0; i < nkept && i < rs->cap; i++) {
        rs->slotpos[i] = pos[i];
    }
    rs->zbase = nkept;
    if (!rs->ice_on) {
        e->st.ice_offloads++;
    }
    rs->ice_on = 1;
cleanup:
    if (got_blocks) {
        (void)kvc_release(e->pool, blk, np);
    }
    if (got_fresh) {
        (void)kvc_release(e->pool, fresh, nfresh);
    }
    free(order), free(keys), free(src), free(dst), free(blk), free(fresh), free(ent);
    free(canon), free(ids), free(pos);
    e->st.ice_pack_ms += kve__now_ms() - t0;
    return rc;
}

/* After a step: offloads what left the resident pages of each decoding IceCache sequence. */
kv_err kve__ice_maintain(kve_engine *e, sched *s) {
    for (size_t i = 0; e->o.ice_budget != 0 && i < s->nrun; i++) {
        req_state *rs = s->run[i];
        if (rs->zstate != Z_NONE || rs->done + 1 != rs->ntoks) {
            continue; /* still prefilling */
        }
        size_t npages = kvc_seq_nblocks(rs->seq), S = e->o.ice_sinks, W = e->o.ice_window;
        kv_err rc = KV_OK;
        size_t at = e->o.ice_offload_min != 0 ? e->o.ice_offload_min : e->o.ice_budget;
        if (!rs->ice_on && npages > S + W + at) {
            rc = ice_offload(e, rs, S, npages - W, !e->o.ice_no_pack);
        } else if (rs->ice_on && npages > S + W) {
            rc = ice_offload(e, rs, S, npages - W, 0);
        }
        if (rc != KV_OK) {
            return rc;
        }
    }
    return KV_OK;
}
