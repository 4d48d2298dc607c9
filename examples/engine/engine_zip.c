/* engine_zip: the example engine's Zipage mode (docs/ZIPAGE.md, engine_int.h).
 *
 * The compression thread (kve__zip_main) reads a job's requests' query ring, carried scores,
 * page list, fresh blocks and the engine's cache views, and writes their kept slots and scores
 * and the fresh blocks' bytes; the scheduler set all of that before handing the job over under
 * the engine's mutex, and reads the results only after taking it back under the mutex. The
 * scheduler never plans, commits or preempts a request that is in a job.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "examples/engine/engine_int.h"
#include "examples/engine/zipage.h"
#include "kernels/kvk_dtype.h"

/* ---- Zipage ----------------------------------------------------------------------------------
 * A sequence that must grow past zip_budget blocks becomes Z_PENDING (it computes nothing). At
 * the start of a step the pending ones (up to zip_batch_blocks blocks) get their fresh private
 * blocks and form one job (Z_JOB); the compression thread scores their tokens, chooses the kept
 * ones (zipage.h) and gathers them into the fresh blocks, while this thread goes on with the
 * other sequences; a later step finishes the job here (kvc_seq_compact, which gives the old
 * blocks back: shared ones are only de-referenced). A job's sequences are never preempted. */

size_t kve__zcap(const kve_engine *e) {
    return (size_t)e->o.zip_budget * e->tpb;
}

/* Zipage state of rs, allocated at its first admission. */
kv_err kve__zip_init(kve_engine *e, req_state *rs) {
    if (e->o.zip_budget == 0 || rs->qring != NULL) {
        return KV_OK;
    }
    const kve_config *c = &e->m->cfg;
    rs->cap = kve__zcap(e) + 1;
    rs->qring = calloc((size_t)e->o.zip_queries * c->n_layers * c->dim, sizeof(float));
    rs->slotpos = calloc(rs->cap, sizeof(uint32_t));
    rs->gscore = calloc(rs->cap, sizeof(float));
    rs->kept = malloc(e->zkeep * sizeof(uint32_t));
    rs->gout = malloc(e->zkeep * sizeof(float));
    rs->zpages = malloc(((size_t)e->o.zip_budget + 1) * sizeof(int32_t));
    rs->fresh = malloc(kve__blocks_for(e, e->zkeep) * sizeof(kvc_block));
    if (!rs->qring || !rs->slotpos || !rs->gscore || !rs->kept || !rs->gout || !rs->zpages ||
        !rs->fresh) {
        return kve__fail(e, KV_ENOMEM, "no memory for Zipage state");
    }
    return KV_OK;
}

void kve__zip_fini(req_state *rs) {
    free(rs->qring), free(rs->slotpos), free(rs->gscore), free(rs->kept), free(rs->gout);
    free(rs->zpages), free(rs->fresh), free(rs->swap);
    free(rs->ice_hash), free(rs->ice_summ);
    rs->ice_hash = NULL;
    rs->ice_summ = NULL;
    rs->qring = NULL;
    rs->swap = NULL;
}

/* Records the positions of slots [zbase, n) (appended since the last compression). */
void kve__zip_note_slots(req_state *rs, size_t n) {
    for (size_t t = rs->zbase; t < n && t < rs->cap; t++) {
        rs->slotpos[t] = (uint32_t)(t + rs->dropped);
        rs->gscore[t] = 0.0f;
    }
    rs->zbase = n;
}

/* The compression thread's part for one sequence: scores, selection, gather. */
static kv_err zip_compress(kve_engine *e, req_state *rs, char *err, size_t errlen) {
    const kve_config *c = &e->m->cfg;
    const uint32_t L = (uint32_t)c->n_layers, d = (uint32_t)c->dim;
    const uint32_t hd = (uint32_t)kve_head_dim(c), KH = (uint32_t)c->n_kv_heads;
    const size_t n = rs->zslots, nq = e->o.zip_queries;
    size_t nqe = rs->qvalid < n ? rs->qvalid : n;
    nqe = nqe == 0 ? 1 : nqe;
    size_t keep = e->zkeep, nfresh = kve__blocks_for(e, keep);
    float *attn = calloc(n, sizeof(float));
    float *qbuf = malloc(nqe * d * sizeof(float));
    float *keys = e->o.zip_lambda > 0 ? malloc((size_t)KH * n * hd * sizeof(float)) : NULL;
    float *red = e->o.zip_lambda > 0 ? malloc(n * sizeof(float)) : NULL;
    int64_t *src = malloc(keep * sizeof(int64_t));
    int32_t *dst = malloc(nfresh * sizeof(int32_t));
    kv_err rc = KV_ENOMEM;
    if (!attn || !qbuf || !src || !dst || (e->o.zip_lambda > 0 && (!keys || !red))) {
        snprintf(err, errlen, "no memory to compress %zu tokens", n);
        goto cleanup;
    }
    for (uint32_t l = 0; l < L; l++) {
        for (size_t j = 0; j < nqe; j++) {
            size_t pos = rs->qlast + 1 - nqe + j;
            memcpy(qbuf + j * d, rs->qring + ((pos % nq) * L + l) * d, d * sizeof(float));
        }
        kvk_score_args a = {.q = qbuf,
                            .q_dtype = KV_DTYPE_FP32,
                            .nq = (uint32_t)nqe,
                            .num_qo_heads = (uint32_t)c->n_heads,
                            .sm_scale = 1.0f / sqrtf((float)hd),
                            .causal = 1};
        rc = kvk_token_scores_cpu(&e->zcache[l], e->zlayer[l], rs->zpages, (uint32_t)n, &a, attn);
        if (rc != KV_OK) {
            snprintf(err, errlen, "token scores: %s", kvk_last_error());
            goto cleanup;
        }
    }
    if (keys != NULL) {
        /* The last layer's keys as floats, [kv head][token][dim]. */
        for (size_t t = 0; t < n; t++) {
            uint32_t blk = (uint32_t)rs->zpages[t / e->tpb];
            for (uint32_t g = 0; g < KH; g++) {
                kve__load_key(&e->zcache[L - 1], e->zlayer[L - 1], blk, (uint32_t)(t % e->tpb), g,
                              keys + ((size_t)g * n + t) * hd);
            }
        }
        rc = kve_zip_redundancy(keys, KH, n, hd, e->o.zip_temp, red);
        if (rc != KV_OK) {
            snprintf(err, errlen, "no memory for the redundancy of %zu tokens", n);
            goto cleanup;
        }
    }
    kve_zip_params prm = {.keep = keep,
                          .sinks = e->o.zip_sinks,
                          .window = e->zwindow,
                          .pool = e->o.zip_pool,
                          .decay = e->o.zip_decay,
                          .lambda = e->o.zip_lambda};
    rc = kve_zip_select(&prm, attn, e->o.zip_decay > 0 ? rs->gscore : NULL, red, n, rs->kept,
                        rs->gout);
    if (rc != KV_OK) {
        snprintf(err, errlen, "selection of %zu of %zu tokens failed", keep, n);
        goto cleanup;
    }
    for (size_t i = 0; i < keep; i++) {
        src[i] = (int64_t)rs->zpages[rs->kept[i] / e->tpb] * e->tpb + rs->kept[i] % e->tpb;
    }
    for (size_t j = 0; j < nfresh; j++) {
        dst[j] = (int32_t)rs->fresh[j].id;
    }
    /* Per-layer views (two sections each), or one view of every section (8-bit pools). */
    uint32_t nviews = e->zcache[0].num_sections == 2 ? L : 1;
    for (uint32_t l = 0; l < nviews; l++) {
        rc = kvk_compact_tokens_cpu(&e->zcache[l], &e->zcache[l], src, (uint32_t)keep, dst);
        if (rc != KV_OK) {
            snprintf(err, errlen, "compaction: %s", kvk_last_error());
            goto cleanup;
        }
    }
    rc = KV_OK;
cleanup:
    free(attn), free(qbuf), free(keys), free(red), free(src), free(dst);
    return rc;
}

void *kve__zip_main(void *arg) {
    kve_engine *e = arg;
    pthread_mutex_lock(&e->zmu);
    for (;;) {
        while (!e->zstop && (e->zjob == NULL || e->zjob_done)) {
            pthread_cond_wait(&e->zcv, &e->zmu);
        }
        if (e->zstop) {
            break;
        }
        req_state **job = e->zjob;
        size_t n = e->nzjob;
        pthread_mutex_unlock(&e->zmu);
        double t0 = kve__now_ms();
        char err[160] = "";
        kv_err rc = KV_OK;
        for (size_t i = 0; i < n && rc == KV_OK; i++) {
            rc = zip_compress(e, job[i], err, sizeof(err));
        }
        pthread_mutex_lock(&e->zmu);
        e->st.zip_job_ms += kve__now_ms() - t0;
        e->zjob_rc = rc;
        snprintf(e->zerr, sizeof(e->zerr), "%s", err);
        e->zjob_done = 1;
        pthread_cond_broadcast(&e->zcv);
    }
    pthread_mutex_unlock(&e->zmu);
    return NULL;
}

/* Installs a finished compression of rs. */
static kv_err zip_finish(kve_engine *e, req_state *rs) {
    size_t keep = e->zkeep, nfresh = kve__blocks_for(e, keep);
    uint32_t *ids = malloc(keep * sizeof(uint32_t));
    uint32_t *pos = malloc(keep * sizeof(uint32_t));
    if (ids == NULL || pos == NULL) {
        free(ids);
        free(pos);
        return kve__fail(e, KV_ENOMEM, "no memory to finish a compression");
    }
    for (size_t i = 0; i < keep; i++) {
        pos[i] = rs->slotpos[rs->kept[i]];
        ids[i] = rs->toks[pos[i]];
    }
    kv_err rc = kvc_seq_compact(rs->seq, ids, keep, rs->fresh, nfresh);
    for (size_t i = 0; i < keep; i++) {
        rs->slotpos[i] = pos[i];
        rs->gscore[i] = rs->gout[i];
    }
    free(ids);
    free(pos);
    e->st.compressions++;
    e->st.zip_dropped += rs->zslots - keep;
    rs->r->compressions++;
    rs->dropped += rs->zslots - keep;
    rs->zbase = keep;
    rs->zstate = Z_NONE;
    return rc != KV_OK ? kve__fail(e, rc, "compact: %s", kvc_last_error(e->conn)) : KV_OK;
}

/* Finishes the job in flight when it is done (wait: waits for it). */
kv_err kve__zip_poll(kve_engine *e, int wait) {
    if (e->zjob == NULL) {
        return KV_OK;
    }
    pthread_mutex_lock(&e->zmu);
    double t0 = kve__now_ms();
    while (wait && !e->zjob_done) {
        pthread_cond_wait(&e->zcv, &e->zmu);
    }
    if (wait) {
        e->st.zip_wait_ms += kve__now_ms() - t0;
    }
    int done = e->zjob_done;
    kv_err rc = e->zjob_rc;
    req_state **job = e->zjob;
    size_t n = e->nzjob;
    if (done) {
        e->zjob = NULL;
        e->nzjob = 0;
        e->zjob_done = 0;
    }
    pthread_mutex_unlock(&e->zmu);
    if (!done) {
        return KV_OK;
    }
    kv_err first = rc != KV_OK ? kve__fail(e, rc, "compression: %s", e->zerr) : KV_OK;
    for (size_t i = 0; i < n; i++) {
        kv_err r2 = KV_OK;
        if (rc == KV_OK) {
            r2 = zip_finish(e, job[i]);
        } else {
            /* A failed job: its fresh private blocks belong to no sequence. */
            (void)kvc_release(e->pool, job[i]->fresh, job[i]->nfresh);
            job[i]->zstate = Z_NONE;
        }
        first = first == KV_OK ? r2 : first;
    }
    free(job);
    return first;
}

/* Starts a job for the pending sequences (at most zip_batch_blocks blocks; at least one). */
kv_err kve__zip_submit(kve_engine *e, sched *s) {
    if (e->o.zip_budget == 0 || e->zjob != NULL) {
        return KV_OK;
    }
    req_state **job = malloc((s->nrun + 1) * sizeof(*job));
    if (job == NULL) {
        return kve__fail(e, KV_ENOMEM, "no memory for a compression job");
    }
    size_t nj = 0, blocks = 0, nfresh = kve__blocks_for(e, e->zkeep);
    for (size_t i = 0; i < s->nrun; i++) {
        req_state *rs = s->run[i];
        if (rs->zstate != Z_PENDING) {
            continue;
        }
        size_t nb = kvc_seq_nblocks(rs->seq);
        if (nj > 0 && blocks + nb > e->o.zip_batch_blocks) {
            break;
        }
        if (e->o.block_budget != 0 && kve__held_blocks(e, s) + nfresh > e->o.block_budget) {
            /* The fresh blocks must fit the engine's budget too: make room as growth does. */
            req_state *v = NULL;
            kv_err pr = kve__preempt_newest(e, s, &v);
            if (pr == KV_EBUSY) {
                break;
            }
            if (pr != KV_OK) {
                free(job);
                return kve__fail(e, pr, "preempt: %s", kvc_last_error(e->conn));
            }
            i = (size_t)-1; /* the running list changed: scan it again */
            continue;
        }
        kv_err rc = kvc_allocate_private(e->pool, (uint32_t)nfresh, rs->fresh);
        if (rc == KV_ENOSPC) {
            break; /* the next step tries again, once blocks came back */
        }
        if (rc != KV_OK) {
            free(job);
            return kve__fail(e, rc, "allocate private: %s", kvc_last_error(e->conn));
        }
        rs->nfresh = nfresh;
        rs->zslots = kvc_seq_length(rs->seq);
        kve__zip_note_slots(rs, rs->zslots);
        for (size_t b = 0; b < nb; b++) {
            rs->zpages[b] = (int32_t)kvc_seq_block(rs->seq, b).id;
        }
        rs->zstate = Z_JOB;
        job[nj++] = rs;
        blocks += nb;
    }
    if (nj == 0) {
        free(job);
        return KV_OK;
    }
    for (uint32_t l = 0; l < (uint32_t)e->m->cfg.n_layers; l++) {
        kv_err rc = kve__layer_cache(e, l, &e->zcache[l], &e->zlayer[l]);
        if (rc != KV_OK) {
            free(job);
            return rc;
        }
    }
    e->st.zip_jobs++;
    if (!e->zthread_on) {
        e->zjob = job;
        e->nzjob = nj;
        /* zip_sync: the same work on this thread. */
        double t0 = kve__now_ms();
        kv_err rc = KV_OK;
        for (size_t i = 0; i < nj && rc == KV_OK; i++) {
            rc = zip_compress(e, job[i], e->zerr, sizeof(e->zerr));
        }
        e->st.zip_job_ms += kve__now_ms() - t0;
        e->zjob_rc = rc;
        e->zjob_done = 1;
        return kve__zip_poll(e, 0);
    }
    /* The job's fields are the thread's to read from here on: set under its mutex. */
    pthread_mutex_lock(&e->zmu);
    e->zjob = job;
    e->nzjob = nj;
    e->zjob_done = 0;
    pthread_cond_broadcast(&e->zcv);
    pthread_mutex_unlock(&e->zmu);
    return KV_OK;
}

/* A compressed sequence that is preempted keeps its state: its blocks' bytes go to engine
 * memory (bounded by the budget) and its blocks back to kvd; admission brings them back into
 * fresh private blocks (kve__zip_swap_in), so nothing is recomputed. */
static size_t swap_block_bytes(const kve_engine *e) {
    const kv_layout *l = &e->layout;
    size_t per = (size_t)l->num_layers * 2 * l->kv_block_bytes;
    return kve__is_8bit(l->dtype)
               ? per + (size_t)l->num_layers * 2 * l->num_kv_heads * sizeof(float)
               : per;
}

static void swap_copy(kve_engine *e, uint32_t id, uint8_t *buf, int out) {
    const kv_layout *l = &e->layout;
    for (uint32_t y = 0; y < l->num_layers; y++) {
        for (int kv = 0; kv < 2; kv++) {
            uint8_t *p = kvc_pool_addr(e->pool, id, y, kv, 0, 0);
            if (out) {
                memcpy(buf, p, l->kv_block_bytes);
            } else {
                memcpy(p, buf, l->kv_block_bytes);
            }
            buf += l->kv_block_bytes;
            for (uint32_t h = 0; kve__is_8bit(l->dtype) && h < l->num_kv_heads; h++) {
                float *sp = kvc_pool_scale_addr(e->pool, id, y, kv, h);
                if (out) {
                    memcpy(buf, sp, sizeof(float));
                } else {
                    memcpy(sp, buf, sizeof(float));
                }
                buf += sizeof(float);
            }
        }
    }
}

kv_err kve__zip_swap_out(kve_engine *e, req_state *rs) {
    size_t nb = kvc_seq_nblocks(rs->seq), per = swap_block_bytes(e);
    rs->swap = malloc(nb * per + 1);
    if (rs->swap == NULL) {
        return kve__fail(e, KV_ENOMEM, "no memory to swap out a compressed sequence");
    }
    for (size_t b = 0; b < nb; b++) {
        swap_copy(e, kvc_seq_block(rs->seq, b).id, rs->swap + b * per, 1);
    }
    rs->swap_blocks = nb;
    rs->swap_slots = kvc_seq_length(rs->seq);
    kve__zip_note_slots(rs, rs->swap_slots);
    e->st.zip_swaps++;
    return kvc_seq_release(rs->seq);
}

kv_err kve__zip_swap_in(kve_engine *e, sched *s, req_state *rs) {
    size_t nb = rs->swap_blocks, per = swap_block_bytes(e);
    /* Room for its blocks and for what it takes before it can give any back: the blocks up to
     * its budget and its next compression's fresh ones. Less, and it would soon be the victim
     * again (a swap costs a copy of its blocks each way). */
    size_t grow = e->o.zip_budget > nb ? e->o.zip_budget - nb : 0;
    size_t need = nb + grow + kve__blocks_for(e, e->zkeep);
    if (e->o.block_budget != 0 && kve__held_blocks(e, s) + need > e->o.block_budget) {
        return KV_ENOSPC;
    }
    kvc_block *blk = malloc(nb * sizeof(*blk));
    uint32_t *ids = malloc(rs->swap_slots * sizeof(uint32_t));
    kv_err rc = KV_ENOMEM;
    if (blk == NULL || ids == NULL) {
        goto cleanup;
    }
    rc = kvc_allocate_private(e->pool, (uint32_t)nb, blk);
    if (rc != KV_OK) {
        if (rc != KV_ENOSPC) {
            kve__fail(e, rc, "swap in: %s", kvc_last_error(e->conn));
        }
        goto cleanup;
    }
    for (size_t b = 0; b < nb; b++) {
        swap_copy(e, blk[b].id, rs->swap + b * per, 0);
    }
    for (size_t i = 0; i < rs->swap_slots; i++) {
        ids[i] = rs->toks[rs->slotpos[i]];
    }
    rc = kvc_seq_adopt(rs->seq, ids, rs->swap_slots, rs->swap_slots + rs->dropped, blk, nb);
    if (rc != KV_OK) {
        kve__fail(e, rc, "adopt: %s", kvc_last_error(e->conn));
        (void)kvc_release(e->pool, blk, nb);
        goto cleanup;
    }
    free(rs->swap);
    rs->swap = NULL;
cleanup:
    free(blk);
    free(ids);
    return rc;
}
