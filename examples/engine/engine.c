/* engine: kvd-backed scheduler and forward pass of the example engine (see engine.h).
 *
 * A step: (1) running requests in admission order get their work — one row for a decoding
 * request (or a draft-and-verify round when speculating), a chunk of prompt rows for one that is
 * still prefilling — while the token budget lasts, growing their kvc_seq first; a request that
 * cannot grow makes the newest running request yield (preemption); (2) waiting requests are
 * admitted while budget and blocks remain, their prompt looked up in kvd first; (3) one forward
 * pass over every row; (4) greedy tokens are appended, verified full blocks committed, finished
 * requests released. A request's state is `toks` (prompt + generated) and `done` (tokens whose
 * K/V are in its blocks); the next row to compute is always toks[done].
 */
#include "examples/engine/engine.h"
#include "examples/engine/engine_int.h"

/* kvd's default fetch-min-tokens (docs/TIERS.md): a shorter run below T0 is recomputed, so it
 * does not count as cached when the first prefill chunk is sized. */
#define KVE_FETCH_MIN_TOKENS 256

#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "examples/engine/gemm.h"
#include "kernels/kvk.h"
#include "kernels/kvk_dtype.h"
#include "kvclient.h"

double kve__now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

kv_err kve__fail(kve_engine *e, kv_err err, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->err, sizeof(e->err), fmt, ap);
    va_end(ap);
    return err;
}

void kve_options_init(kve_options *o) {
    memset(o, 0, sizeof(*o));
    o->kv_dtype = KV_DTYPE_FP32;
    o->tokens_per_block = 16;
    o->prefix_cache = 1;
    o->token_budget = 256;
    o->max_batch = 64;
    o->draft_layers = 1;
    o->threads = 1;
    o->zip_queries = 16;
    o->zip_sinks = 4;
    o->zip_pool = 5;
    o->zip_decay = 0.8f;
    o->zip_lambda = 0.2f;
    o->zip_temp = 0.4f;
    o->zip_batch_blocks = 600;
    o->ice_sinks = 2;
    o->ice_window = 2;
    o->ice_reuse = 1;
}

void kve_request_fini(kve_request *r) {
    if (r == NULL) {
        return;
    }
    free(r->out);
    free(r->logits);
    r->out = NULL;
    r->logits = NULL;
}

const kve_stats *kve_engine_stats(const kve_engine *e) {
    return &e->st;
}

const kv_layout *kve_engine_layout(const kve_engine *e) {
    return &e->layout;
}

const char *kve_engine_error(const kve_engine *e) {
    return e->err;
}

int kve__is_8bit(kv_dtype d) {
    return d == KV_DTYPE_INT8 || d == KV_DTYPE_FP8_E4M3;
}

/* Per-(layer, kv head) scales from the reference model's K/V absmax on a calibration sequence,
 * with headroom. Deterministic in the weights, so every process writes blocks with the same
 * scales and shared blocks mean the same values. */
static kv_err calibrate(kve_engine *e) {
    const kve_config *c = &e->m->cfg;
    size_t nh = (size_t)c->n_layers * c->n_kv_heads;
    size_t n = c->seq_len < 128 ? (size_t)c->seq_len : 128;
    uint32_t *t = malloc(n * sizeof(*t));
    e->kscale = calloc(nh, sizeof(float));
    e->vscale = calloc(nh, sizeof(float));
    if (t == NULL || e->kscale == NULL || e->vscale == NULL) {
        free(t);
        return KV_ENOMEM;
    }
    for (size_t i = 0; i < n; i++) {
        t[i] = (uint32_t)((i * 2654435761u + 7) % (uint32_t)c->vocab_size);
    }
    kv_err rc = kve_model_dense_logits(e->m, t, n, 0, NULL, e->kscale, e->vscale);
    free(t);
    float qmax = e->o.kv_dtype == KV_DTYPE_INT8 ? 127.0f : 448.0f;
    for (size_t i = 0; i < nh; i++) {
        e->kscale[i] = e->kscale[i] > 0 ? e->kscale[i] * 1.5f / qmax : 1.0f;
        e->vscale[i] = e->vscale[i] > 0 ? e->vscale[i] * 1.5f / qmax : 1.0f;
    }
    return rc;
}

/* The Zipage and IceCache options: "" when they make sense (or the modes are off), else why
 * not; for Zipage also the effective keep and window. */
static const char *mode_check(const kve_model *m, const kve_options *o, size_t *keep,
                              size_t *window) {
    if (o->ice_budget != 0) {
        if (o->spec_k > 0 || o->static_batching || o->cascade || o->zip_budget != 0) {
            return "IceCache runs without speculative decoding, static batching, cascade and "
                   "Zipage";
        }
        if (o->ice_window == 0 || o->ice_reuse == 0) {
            return "ice-window and ice-reuse must be at least 1";
        }
        if (m->cfg.n_layers > 64) {
            return "IceCache runs models of at most 64 layers";
        }
        return "";
    }
    if (o->zip_budget == 0) {
        return "";
    }
    size_t cap = (size_t)o->zip_budget * o->tokens_per_block;
    *window = o->zip_window != 0 ? o->zip_window : o->zip_queries;
    *keep = o->zip_keep != 0 ? o->zip_keep : cap - o->tokens_per_block;
    if (o->spec_k > 0 || o->static_batching) {
        return "Zipage runs without speculative decoding and static batching";
    }
    if (o->zip_budget < 2 || m->cfg.n_layers > 64) {
        return "Zipage needs a budget of at least 2 blocks and at most 64 layers";
    }
    if (o->zip_queries == 0 || o->zip_queries > KVK_SCORE_MAX_Q || *window < o->zip_queries) {
        return "zip-queries must be 1..256 and no more than the window";
    }
    if (*keep >= cap || *keep < o->zip_sinks + *window) {
        return "zip-keep must be below budget * tokens_per_block and hold the sinks and window";
    }
    if (o->zip_temp <= 0.0f || o->zip_pool == 0) {
        return "zip-temp must be positive and zip-pool at least 1";
    }
    size_t fresh = (*keep + o->tokens_per_block - 1) / o->tokens_per_block;
    if (o->block_budget != 0 && o->block_budget < o->zip_budget + fresh) {
        return "block-budget must hold one sequence at its zip budget and its compression's "
               "fresh blocks (zip-budget + ceil(zip-keep / tokens_per_block))";
    }
    return "";
}

kv_err kve_engine_open(const kve_model *m, const kve_options *o, kve_engine **out) {
    const kve_config *c = &m->cfg;
    size_t zkeep = 0, zwindow = 0;
    const char *zwhy = o->tokens_per_block == 0 ? "" : mode_check(m, o, &zkeep, &zwindow);
    if (o->tokens_per_block == 0 || o->token_budget == 0 || o->max_batch == 0 || o->spec_k < 0 ||
        o->spec_k > 64 ||
        (o->spec_k > 0 && (o->draft_layers < 1 || o->draft_layers > c->n_layers)) ||
        o->threads < 1 || o->threads > 64 || zwhy[0] != 0) {
        if (zwhy[0] != 0) {
            fprintf(stderr, "kve: open: %s\n", zwhy);
        }
        return KV_EINVAL;
    }
    kve_engine *e = calloc(1, sizeof(*e));
    if (e == NULL) {
        return KV_ENOMEM;
    }
    kv_err rc = kve_gemm_alloc(o->threads, KVE_GEMM_AUTO, &e->gemm);
    if (rc != KV_OK) {
        kve__fail(e, rc, "cannot start %d matmul threads", o->threads);
        goto fail_free;
    }
    e->m = m;
    e->o = *o;
    e->tpb = o->tokens_per_block;
    e->zkeep = zkeep;
    e->zwindow = zwindow;
    pthread_mutex_init(&e->zmu, NULL);
    pthread_cond_init(&e->zcv, NULL);
    if (o->model_id != NULL) {
        snprintf(e->model_id, sizeof(e->model_id), "%s", o->model_id);
    } else {
        /* The weights name the pool: engines with other weights never share blocks. */
        uint64_t h = 1469598103934665603ull;
        size_t nb = ((size_t)(m->rms_final - m->mem) + (size_t)c->dim) * sizeof(float);
        const unsigned char *b = (const unsigned char *)m->mem;
        for (size_t i = 0; i < nb; i += 7) {
            h = (h ^ b[i]) * 1099511628211ull;
        }
        snprintf(e->model_id, sizeof(e->model_id), "kve-%016llx", (unsigned long long)h);
    }
    kvc_options co;
    kvc_options_init(&co);
    co.socket_path = o->socket_path;
    co.client_name = "kve-engine";
    rc = kvc_conn_open(&co, &e->conn);
    if (rc != KV_OK) {
        kve__fail(e, rc, "cannot connect to kvd");
        goto fail_free;
    }
    kv_layout want = {.num_layers = (uint32_t)c->n_layers,
                      .num_kv_heads = (uint32_t)c->n_kv_heads,
                      .head_dim = (uint32_t)kve_head_dim(c),
                      .tokens_per_block = e->tpb,
                      .dtype = o->kv_dtype,
                      .arrangement = KV_LAYER_MAJOR};
    rc = kvc_pool_attach_ex(e->conn, e->model_id, &want,
                            o->ice_budget != 0 ? KVC_ATTACH_SUMMARIES : 0, &e->pool);
    if (rc != KV_OK) {
        kve__fail(e, rc, "attach: %s", kvc_last_error(e->conn));
        goto fail_conn;
    }
    e->layout = *kvc_pool_layout(e->pool);
    if (kve__is_8bit(o->kv_dtype)) {
        rc = calibrate(e);
        if (rc != KV_OK) {
            goto fail_conn;
        }
    }
    e->nonce = (uint64_t)getpid() * 0x9e3779b97f4a7c15ull ^ (uint64_t)(kve__now_ms() * 1e3);
    if ((o->zip_budget != 0 || o->ice_budget != 0) && !kvc_conn_has_private(e->conn)) {
        rc = kve__fail(e, KV_ENOTSUP, "Zipage needs private blocks: this kvd has none");
        goto fail_conn;
    }
    if (o->zip_budget != 0 && !o->zip_sync) {
        if (pthread_create(&e->zthread, NULL, kve__zip_main, e) != 0) {
            rc = kve__fail(e, KV_ENOMEM, "cannot start the compression thread");
            goto fail_conn;
        }
        e->zthread_on = 1;
    }
    *out = e;
    return KV_OK;
fail_conn:
    kvc_pool_detach(e->pool);
    kvc_conn_close(e->conn);
fail_free:
    kve_gemm_free(e->gemm);
    free(e->kscale);
    free(e->vscale);
    /* The caller has no engine to ask: print the reason where it is not recoverable. */
    fprintf(stderr, "kve: open: %s: %s\n", kv_strerror(rc), e->err);
    free(e);
    return rc;
}

void kve_engine_close(kve_engine *e) {
    if (e == NULL) {
        return;
    }
    if (e->zthread_on) {
        pthread_mutex_lock(&e->zmu);
        e->zstop = 1;
        pthread_cond_broadcast(&e->zcv);
        pthread_mutex_unlock(&e->zmu);
        pthread_join(e->zthread, NULL);
    }
    pthread_mutex_destroy(&e->zmu);
    pthread_cond_destroy(&e->zcv);
    kvc_pool_detach(e->pool);
    kvc_conn_close(e->conn);
    kve_gemm_free(e->gemm);
    free(e->kscale);
    free(e->vscale);
    free(e);
}

/* The kvk descriptor of layer l and the layer index to pass with it. Per-layer tensors of the
 * client's contiguous view when it has them (any number of segments); else (8-bit pools, whose
 * scales sit per segment, or unaligned sections) segment 0 alone, where every block id must lie. */
kv_err kve__layer_cache(kve_engine *e, uint32_t l, kvk_cache *c, uint32_t *layer_arg) {
    const kv_layout *ly = &e->layout;
    uint8_t *kb = kvc_pool_layer_base(e->pool, l, KV_K);
    uint8_t *vb = kvc_pool_layer_base(e->pool, l, KV_V);
    if (!kve__is_8bit(ly->dtype) && kb != NULL && vb != NULL) {
        *c = (kvk_cache){.data = (uintptr_t)kb,
                         .block_stride = (int64_t)ly->kv_block_bytes,
                         .section_stride = (int64_t)(vb - kb),
                         .num_blocks =
                             kvc_pool_max_segments(e->pool) * kvc_pool_blocks_per_segment(e->pool),
                         .num_sections = 2,
                         .tokens_per_block = ly->tokens_per_block,
                         .num_kv_heads = ly->num_kv_heads,
                         .head_dim = ly->head_dim,
                         .dtype = ly->dtype};
        *layer_arg = 0;
        return KV_OK;
    }
    uint32_t nb = 0;
    void *base = kvc_pool_segment_base(e->pool, 0, &nb);
    if (base == NULL) {
        return kve__fail(e, KV_ENOTSUP, "segment 0 is not mapped");
    }
    *layer_arg = l;
    return kvk_cache_from_segment(ly, (uintptr_t)base, nb, c);
}

/* Pages [p0, p1) of a row's table (the last holding `last` tokens). */
/* Builds a CSR page table over spans; *indices is malloc'd (free it). */
static kv_err build_table(const span *sp, size_t n, int32_t *indptr, int32_t *last,
                          int32_t **indices, uint32_t seg_limit, kve_engine *e) {
    size_t tot = 0;
    for (size_t i = 0; i < n; i++) {
        tot += sp[i].p1 - sp[i].p0 + sp[i].nins;
    }
    int32_t *ix = malloc((tot + 1) * sizeof(int32_t));
    if (ix == NULL) {
        return KV_ENOMEM;
    }
    size_t k = 0;
    indptr[0] = 0;
    for (size_t i = 0; i < n; i++) {
        for (uint32_t p = sp[i].p0; p < sp[i].p1; p++) {
            for (uint32_t j = 0; p == sp[i].ins_at && j < sp[i].nins; j++) {
                if (seg_limit != 0 && (uint32_t)sp[i].ins[j] >= seg_limit) {
                    free(ix);
                    return kve__fail(e, KV_ENOTSUP, "8-bit pools must fit one segment");
                }
                ix[k++] = sp[i].ins[j]; /* full pages: they go before the partial last one */
            }
            uint32_t id = kvc_seq_block(sp[i].seq, p).id;
            if (seg_limit != 0 && id >= seg_limit) {
                free(ix);
                return kve__fail(e, KV_ENOTSUP,
                                 "8-bit pools must fit one segment (block %u beyond %u): start kvd "
                                 "with --segment-bytes >= the pool size",
                                 id, seg_limit);
            }
            ix[k++] = (int32_t)id;
        }
        indptr[i + 1] = (int32_t)k;
        last[i] = sp[i].p1 > sp[i].p0 ? sp[i].last : 0;
    }
    *indices = ix;
    return KV_OK;
}

/* Attention of n rows' queries q [n][heads][hd] over their spans, into out and lse. */
static kv_err attend(kve_engine *e, const kvk_cache *c, uint32_t layer, const span *sp, size_t n,
                     const float *q, float *out, float *lse, uint32_t qo_heads) {
    uint32_t seg_limit = c->num_sections == 2 ? 0 : kvc_pool_blocks_per_segment(e->pool);
    int32_t *indptr = malloc((n + 1) * sizeof(int32_t));
    int32_t *last = malloc((n + 1) * sizeof(int32_t));
    int32_t *ix = NULL;
    kv_err rc = KV_ENOMEM;
    if (indptr == NULL || last == NULL) {
        goto cleanup;
    }
    rc = build_table(sp, n, indptr, last, &ix, seg_limit, e);
    if (rc != KV_OK) {
        goto cleanup;
    }
    kvk_page_table pt = {
        .indptr = indptr, .indices = ix, .last_page_len = last, .batch = (uint32_t)n};
    kvk_decode_args a = {.q = q,
                         .out = out,
                         .lse = lse,
                         .qo_dtype = KV_DTYPE_FP32,
                         .num_qo_heads = qo_heads,
                         .sm_scale = 1.0f / sqrtf((float)c->head_dim)};
    rc = kvk_paged_decode_attention_cpu(c, layer, &pt, &a);
    if (rc != KV_OK) {
        kve__fail(e, rc, "attention: %s", kvk_last_error());
    }
cleanup:
    free(ix);
    free(last);
    free(indptr);
    return rc;
}

/* A row's full table: pages 0 .. slot / tpb, the last holding slot % tpb + 1 tokens. */
static span row_span(const kve_engine *e, const row *r) {
    return (span){.seq = r->rs->seq,
                  .p0 = 0,
                  .p1 = r->slot / e->tpb + 1,
                  .last = (int32_t)(r->slot % e->tpb) + 1};
}

static int cmp_first_block(const void *a, const void *b, void *arg) {
    const kve_engine *e = arg;
    const row *x = a, *y = b;
    uint32_t bx = kvc_seq_block(x->rs->seq, 0).id, by = kvc_seq_block(y->rs->seq, 0).id;
    (void)e;
    return bx < by ? -1 : bx > by;
}

/* Cascade attention: rows whose tables start with the same full blocks attend to that shared
 * prefix in one kernel call as ONE request whose query heads are every row's heads (arranged
 * [kv head][row][group head] so that GQA maps each to its KV head: the prefix pages appear once
 * in the table and a GPU kernel loads them once for the whole group), then each row attends to
 * its own suffix, and the two states are merged by log-sum-exp. Rows without a partner take the
 * plain path. */
static kv_err attend_cascade(kve_engine *e, const kvk_cache *c, uint32_t layer, row *rows, size_t n,
                             const float *q, float *att, uint32_t *order) {
    const kve_config *cf = &e->m->cfg;
    uint32_t H = (uint32_t)cf->n_heads, hd = (uint32_t)kve_head_dim(cf);
    uint32_t grp = H / (uint32_t)cf->n_kv_heads;
    kv_err rc = KV_OK;
    size_t i = 0;
    span *sp = malloc(n * sizeof(span));
    float *pq = malloc((size_t)n * H * hd * sizeof(float));
    float *po = malloc((size_t)n * H * hd * sizeof(float));
    float *pl = malloc((size_t)n * H * sizeof(float));
    float *so = malloc((size_t)n * H * hd * sizeof(float));
    float *sl = malloc((size_t)n * H * sizeof(float));
    float *ro = malloc((size_t)n * H * hd * sizeof(float));
    float *rl = malloc((size_t)n * H * sizeof(float));
    if (!sp || !pq || !po || !pl || !so || !sl || !ro || !rl) {
        rc = KV_ENOMEM;
        goto cleanup;
    }
    while (i < n) {
        /* order[] sorts rows by first block id; a group is a run with one first block. */
        size_t j = i + 1;
        const row *r0 = &rows[order[i]];
        uint32_t b0 = kvc_seq_block(r0->rs->seq, 0).id;
        uint32_t m = (r0->slot + 1) / e->tpb;
        while (j < n && kvc_seq_block(rows[order[j]].rs->seq, 0).id == b0) {
            j++;
        }
        for (size_t k = i + 1; k < j && m > 0; k++) {
            const row *r = &rows[order[k]];
            uint32_t lim = (r->slot + 1) / e->tpb;
            m = lim < m ? lim : m;
            for (uint32_t p = 0; p < m; p++) {
                if (kvc_seq_block(r->rs->seq, p).id != kvc_seq_block(r0->rs->seq, p).id) {
                    m = p;
                    break;
                }
            }
        }
        size_t G = j - i;
        if (G < 2 || m == 0) {
            for (size_t k = i; k < j; k++) {
                sp[0] = row_span(e, &rows[order[k]]);
                rc = attend(e, c, layer, sp, 1, q + (size_t)order[k] * H * hd,
                            att + (size_t)order[k] * H * hd, NULL, H);
                if (rc != KV_OK) {
                    goto cleanup;
                }
            }
            i = j;
            continue;
        }
        e->st.cascade_groups++;
        /* Shared prefix: one request with G * H query heads. */
        for (size_t k = 0; k < G; k++) {
            const float *qr = q + (size_t)order[i + k] * H * hd;
            for (uint32_t h = 0; h < H; h++) {
                uint32_t kh = h / grp, jj = h % grp;
                size_t dst = ((size_t)kh * G + k) * grp + jj;
                memcpy(pq + dst * hd, qr + (size_t)h * hd, hd * sizeof(float));
            }
        }
        sp[0] = (span){.seq = r0->rs->seq, .p0 = 0, .p1 = m, .last = (int32_t)e->tpb};
        rc = attend(e, c, layer, sp, 1, pq, po, pl, (uint32_t)G * H);
        if (rc != KV_OK) {
            goto cleanup;
        }
        for (size_t k = 0; k < G; k++) {
            for (uint32_t h = 0; h < H; h++) {
                uint32_t kh = h / grp, jj = h % grp;
                size_t src = ((size_t)kh * G + k) * grp + jj;
                memcpy(ro + (k * H + h) * hd, po + src * hd, hd * sizeof(float));
                rl[k * H + h] = pl[src];
            }
            const row *r = &rows[order[i + k]];
            span s = row_span(e, r);
            s.p0 = m;
            if (s.p0 >= s.p1) {
                s.p1 = s.p0; /* empty suffix: zeros and lse -inf */
            }
            sp[k] = s;
            memcpy(pq + k * H * hd, q + (size_t)order[i + k] * H * hd,
                   (size_t)H * hd * sizeof(float));
        }
        rc = attend(e, c, layer, sp, G, pq, so, sl, H);
        if (rc != KV_OK) {
            goto cleanup;
        }
        const void *vs[2] = {ro, so};
        const float *ss[2] = {rl, sl};
        rc = kvk_merge_states_cpu(KV_DTYPE_FP32, vs, ss, 2, (uint64_t)G * H, hd, po, NULL);
        if (rc != KV_OK) {
            goto cleanup;
        }
        for (size_t k = 0; k < G; k++) {
            memcpy(att + (size_t)order[i + k] * H * hd, po + k * H * hd,
                   (size_t)H * hd * sizeof(float));
        }
        i = j;
    }
cleanup:
    free(sp), free(pq), free(po), free(pl), free(so), free(sl), free(ro), free(rl);
    return rc;
}

/* One forward pass of rows through the first `layers` layers (then the final norm and the
 * classifier for rows that want logits). Writes each row's K/V into its slot first, layer by
 * layer, so a row attends to earlier rows of the same pass. */
static kv_err forward(kve_engine *e, row *rows, size_t n, int layers) {
    const kve_model *m = e->m;
    const kve_config *c = &m->cfg;
    int d = c->dim, hd = kve_head_dim(c), kvd = kve_kv_dim(c), hid = c->hidden_dim;
    kv_err rc = KV_ENOMEM;
    if (n == 0) {
        return KV_OK;
    }
    /* The matmuls' rows on cache lines, as their weights are: a 64-byte load of an activation
     * row straddling two lines cost a 16-row pass of `big` a fifth of its time. */
    float *x = kve_alloc_floats((size_t)n * d);
    float *xb = kve_alloc_floats((size_t)n * d);
    float *q = kve_alloc_floats((size_t)n * d);
    float *k = kve_alloc_floats((size_t)n * kvd);
    float *v = kve_alloc_floats((size_t)n * kvd);
    float *att = kve_alloc_floats((size_t)n * d);
    float *hb = kve_alloc_floats((size_t)n * hid);
    float *hb2 = kve_alloc_floats((size_t)n * hid);
    int64_t *slots = malloc(n * sizeof(int64_t));
    span *sp = malloc(n * sizeof(span));
    uint32_t *order = malloc(n * sizeof(uint32_t));
    ice_row *ice = e->o.ice_budget != 0 ? calloc(n, sizeof(ice_row)) : NULL;
    if (!x || !xb || !q || !k || !v || !att || !hb || !hb2 || !slots || !sp || !order ||
        (e->o.ice_budget != 0 && ice == NULL)) {
        goto cleanup;
    }
    for (size_t i = 0; i < n; i++) {
        memcpy(x + i * d, m->tok_emb + (size_t)rows[i].tok * d, (size_t)d * sizeof(float));
        slots[i] = (int64_t)kvc_seq_block(rows[i].rs->seq, rows[i].slot / e->tpb).id * e->tpb +
                   rows[i].slot % e->tpb;
        sp[i] = row_span(e, &rows[i]);
        order[i] = (uint32_t)i;
    }
    if (e->o.cascade) {
        /* Sort row indices by first block (insertion sort through a row copy: n is small). */
        for (size_t i = 1; i < n; i++) {
            uint32_t t = order[i];
            size_t j = i;
            while (j > 0 && cmp_first_block(&rows[order[j - 1]], &rows[t], e) > 0) {
                order[j] = order[j - 1];
                j--;
            }
            order[j] = t;
        }
    }
    for (int l = 0; l < layers; l++) {
        for (size_t i = 0; i < n; i++) {
            kve_rmsnorm(xb + i * d, x + i * d, m->rms_att + (size_t)l * d, d);
        }
        kve_gemm_run(e->gemm, q, xb, m->wq + (size_t)l * d * d, (int)n, d, d);
        kve_gemm_run(e->gemm, k, xb, m->wk + (size_t)l * kvd * d, (int)n, d, kvd);
        kve_gemm_run(e->gemm, v, xb, m->wv + (size_t)l * kvd * d, (int)n, d, kvd);
        for (size_t i = 0; i < n; i++) {
            kve_rope(q + i * d, c->n_heads, hd, rows[i].pos);
            kve_rope(k + i * kvd, c->n_kv_heads, hd, rows[i].pos);
            req_state *rs = rows[i].rs;
            if (rs->qring != NULL && layers == c->n_layers) {
                /* Zipage scores tokens with the latest queries: position % nq's ring entry. */
                size_t nq = e->o.zip_queries;
                memcpy(rs->qring + ((rows[i].pos % nq) * (size_t)c->n_layers + (size_t)l) * d,
                       q + i * d, (size_t)d * sizeof(float));
                if (l == 0) {
                    rs->qvalid = rs->qvalid > 0 && rows[i].pos == rs->qlast + 1
                                     ? (rs->qvalid < nq ? rs->qvalid + 1 : nq)
                                     : 1;
                    rs->qlast = rows[i].pos;
                }
            }
        }
        kvk_cache cache;
        uint32_t la = 0;
        rc = kve__layer_cache(e, (uint32_t)l, &cache, &la);
        if (rc != KV_OK) {
            goto cleanup;
        }
        kvk_tokens t = {.k = k,
                        .v = v,
                        .row_stride = (int64_t)kvd * (int64_t)sizeof(float),
                        .dtype = KV_DTYPE_FP32,
                        .k_scale = e->kscale ? e->kscale + (size_t)l * c->n_kv_heads : NULL,
                        .v_scale = e->vscale ? e->vscale + (size_t)l * c->n_kv_heads : NULL};
        rc = kvk_reshape_and_cache_cpu(&cache, la, &t, slots, (uint32_t)n);
        if (rc != KV_OK) {
            kve__fail(e, rc, "reshape_and_cache: %s", kvk_last_error());
            goto cleanup;
        }
        for (size_t i = 0; ice != NULL && i < n; i++) {
            req_state *rs = rows[i].rs;
            if (!rs->ice_on || layers != c->n_layers || rows[i].pos + 1 != rs->ntoks) {
                continue; /* full attention: not offloaded, or a draft pass */
            }
            if ((uint32_t)l % e->o.ice_reuse == 0) {
                rc = kve__ice_select_fetch(e, rs, (uint32_t)l, q + i * d, &ice[i]);
                if (rc != KV_OK) {
                    goto cleanup;
                }
            }
            sp[i].ins = ice[i].ins;
            sp[i].nins = ice[i].nins;
            sp[i].ins_at = e->o.ice_sinks;
        }
        if (e->o.cascade) {
            rc = attend_cascade(e, &cache, la, rows, n, q, att, order);
        } else {
            rc = attend(e, &cache, la, sp, n, q, att, NULL, (uint32_t)c->n_heads);
        }
        if (rc != KV_OK) {
            goto cleanup;
        }
        kve_gemm_run(e->gemm, xb, att, m->wo + (size_t)l * d * d, (int)n, d, d);
        for (size_t i = 0; i < n * (size_t)d; i++) {
            x[i] += xb[i];
        }
        for (size_t i = 0; i < n; i++) {
            kve_rmsnorm(xb + i * d, x + i * d, m->rms_ffn + (size_t)l * d, d);
        }
        kve_gemm_run(e->gemm, hb, xb, m->w1 + (size_t)l * hid * d, (int)n, d, hid);
        kve_gemm_run(e->gemm, hb2, xb, m->w3 + (size_t)l * hid * d, (int)n, d, hid);
        for (size_t i = 0; i < n; i++) {
            kve_swiglu(hb + i * hid, hb2 + i * hid, hid);
        }
        kve_gemm_run(e->gemm, xb, hb, m->w2 + (size_t)l * d * hid, (int)n, hid, d);
        for (size_t i = 0; i < n * (size_t)d; i++) {
            x[i] += xb[i];
        }
    }
    /* The classifier for the rows that want logits, as one product (one pass over wcls). */
    size_t nl = 0;
    for (size_t i = 0; i < n; i++) {
        if (rows[i].logits != NULL) {
            kve_rmsnorm(xb + nl * d, x + i * d, m->rms_final, d);
            nl++;
        }
    }
    if (nl > 0) {
        float *lg = malloc(nl * (size_t)c->vocab_size * sizeof(float));
        if (lg == NULL) {
            goto cleanup;
        }
        kve_gemm_run(e->gemm, lg, xb, m->wcls, (int)nl, d, c->vocab_size);
        for (size_t i = 0, j = 0; i < n; i++) {
            if (rows[i].logits != NULL) {
                memcpy(rows[i].logits, lg + j++ * (size_t)c->vocab_size,
                       (size_t)c->vocab_size * sizeof(float));
            }
        }
        free(lg);
    }
    rc = KV_OK;
cleanup:
    for (size_t i = 0; ice != NULL && i < n; i++) {
        /* In runs within the daemon's list limit (kvc_release_multi splits them). */
        kvc_pool **pp = ice[i].nheld > 0 ? malloc(ice[i].nheld * sizeof(*pp)) : NULL;
        for (size_t j = 0; pp != NULL && j < ice[i].nheld; j++) {
            pp[j] = e->pool;
        }
        if (ice[i].nheld > 0) {
            kv_err r2 = pp != NULL ? kvc_release_multi(pp, ice[i].held, ice[i].nheld) : KV_ENOMEM;
            rc = rc == KV_OK ? r2 : rc;
        }
        free(pp);
        free(ice[i].held);
        free(ice[i].ins);
    }
    free(ice);
    free(x), free(xb), free(q), free(k), free(v), free(att), free(hb), free(hb2);
    free(slots), free(sp), free(order);
    return rc;
}

/* ---- Scheduler ---------------------------------------------------------------------------- */

void kve__load_key(const kvk_cache *kc, uint32_t la, uint32_t blk, uint32_t off, uint32_t head,
                   float *out) {
    const uint32_t sec = la * 2, hd = kc->head_dim;
    const char *row = (const char *)kc->data + (int64_t)blk * kc->block_stride +
                      (int64_t)sec * kc->section_stride +
                      (int64_t)((uint64_t)off * kc->num_kv_heads * hd * kvk_dtype_bytes(kc->dtype));
    float s = 1.0f;
    if (kc->scales != 0) {
        memcpy(&s,
               (const char *)kc->scales + (int64_t)blk * kc->scale_block_stride +
                   (int64_t)sec * kc->scale_section_stride + head * sizeof(float),
               sizeof(float));
    }
    for (uint32_t x = 0; x < hd; x++) {
        out[x] = kvk_load_f32(kc->dtype, row, (uint64_t)head * hd + x) * s;
    }
}

size_t kve__blocks_for(const kve_engine *e, size_t tokens) {
    return (tokens + e->tpb - 1) / e->tpb;
}

/* Blocks the running requests hold (static batching: what they reserved). */
size_t kve__held_blocks(const kve_engine *e, const sched *s) {
    size_t h = 0;
    for (size_t i = 0; i < s->nrun; i++) {
        h += e->o.static_batching ? s->run[i]->reserved : kvc_seq_nblocks(s->run[i]->seq);
        h += s->run[i]->zstate == Z_JOB ? s->run[i]->nfresh : 0; /* a compression's fresh blocks */
    }
    return h;
}

/* Grows rs's sequence to `upto` tokens (toks must hold them), within the block budget. */
static kv_err grow(kve_engine *e, sched *s, req_state *rs, size_t upto) {
    size_t len = kvc_seq_length(rs->seq);
    size_t want = upto - rs->dropped; /* slots */
    if (want <= len) {
        return KV_OK;
    }
    if (!e->o.static_batching && e->o.block_budget != 0) {
        size_t need = kve__blocks_for(e, want) - kvc_seq_nblocks(rs->seq);
        if (kve__held_blocks(e, s) + need > e->o.block_budget) {
            return KV_ENOSPC;
        }
    }
    return kvc_seq_append(rs->seq, rs->toks + len + rs->dropped, want - len);
}

static void remove_running(sched *s, req_state *rs) {
    for (size_t i = 0; i < s->nrun; i++) {
        if (s->run[i] == rs) {
            memmove(&s->run[i], &s->run[i + 1], (s->nrun - i - 1) * sizeof(*s->run));
            s->nrun--;
            return;
        }
    }
}

/* Commits rs's verified full blocks (its cached prefix survives preemption), then releases all. */
static kv_err retire(kve_engine *e, req_state *rs) {
    kv_err rc = KV_OK;
    if (e->o.prefix_cache && rs->done > 0) {
        rc = kvc_seq_commit(rs->seq, rs->done - rs->dropped, NULL);
    }
    kv_err rc2 = kvc_seq_release(rs->seq);
    return rc != KV_OK ? rc : rc2;
}

/* Preempts the newest running request (not one a compression job holds): its blocks go back
 * (the committed ones stay cached in kvd), it goes to the front of the waiting queue and
 * recomputes from its cached prefix, or, compressed, is swapped out and back in unchanged.
 * KV_EBUSY when every running request is in a compression job. */
kv_err kve__preempt_newest(kve_engine *e, sched *s, req_state **victim) {
    size_t vi = 0;
    /* Zipage: the newest compressed request first (a swap costs a copy of its few blocks; a
     * recompute, its whole history), then the newest of the others. */
    for (size_t i = s->nrun; i > 0 && e->o.zip_budget != 0 && vi == 0; i--) {
        if (s->run[i - 1]->zstate != Z_JOB && kvc_seq_compressed(s->run[i - 1]->seq)) {
            vi = i;
        }
    }
    for (size_t i = s->nrun; i > 0 && vi == 0; i--) {
        if (s->run[i - 1]->zstate != Z_JOB) {
            vi = i;
        }
    }
    if (vi == 0) {
        return KV_EBUSY;
    }
    req_state *v = s->run[vi - 1];
    memmove(&s->run[vi - 1], &s->run[vi], (s->nrun - vi) * sizeof(*s->run));
    s->nrun--;
    v->zstate = Z_NONE;
    kv_err rc;
    if (kvc_seq_compressed(v->seq)) {
        rc = kve__zip_swap_out(e, v);
    } else {
        rc = retire(e, v);
        v->done = 0;
        v->dropped = 0;
        v->zbase = 0;
        v->qvalid = 0;
    }
    v->reserved = 0;
    v->phase = PH_WAITING;
    v->swapped_at = v->swap != NULL ? e->st.steps + 1 : 0;
    v->r->preemptions++;
    e->st.preemptions++;
    memmove(&s->wait[1], &s->wait[0], s->nwait * sizeof(*s->wait));
    s->wait[0] = v;
    s->nwait++;
    *victim = v;
    return rc;
}

/* Admits rs: looks its prompt up (a probe holds the hits while the sequence takes them over) and
 * allocates its first chunk. KV_ENOSPC when blocks are short (nothing held then). */
static kv_err admit(kve_engine *e, sched *s, req_state *rs, size_t budget) {
    size_t n = rs->ntoks, nhit = 0, cached = 0, lower = 0;
    kvc_block *probe = NULL;
    kv_hash128 *hashes = NULL;
    kv_err rc = KV_OK;
    if (rs->seq == NULL) {
        rc = kvc_seq_alloc(e->pool, rs->r->prompt_len + rs->r->max_new + (size_t)e->o.spec_k + 1,
                           NULL, 0, &rs->seq);
        if (rc != KV_OK) {
            return kve__fail(e, rc, "seq_alloc: %s", kvc_last_error(e->conn));
        }
        if (e->o.zip_budget != 0) {
            rc = kvc_seq_set_block_budget(rs->seq, e->o.zip_budget);
            rc = rc == KV_OK ? kve__zip_init(e, rs) : rc;
            if (rc != KV_OK) {
                return rc;
            }
        }
    }
    if (rs->swap != NULL) {
        /* A compressed sequence coming back: its blocks' bytes, not a recompute. */
        rc = kve__zip_swap_in(e, s, rs);
        if (rc == KV_OK) {
            rs->phase = PH_RUNNING;
            rs->order = e->next_order++;
        }
        return rc;
    }
    if (e->o.prefix_cache && n > e->tpb) {
        size_t nb = (n - 1) / e->tpb;
        hashes = malloc(nb * sizeof(*hashes));
        probe = malloc(nb * sizeof(*probe));
        if (hashes == NULL || probe == NULL) {
            rc = KV_ENOMEM;
            goto cleanup;
        }
        size_t nh = 0;
        rc = kvc_pool_hash_tokens(e->pool, NULL, 0, rs->toks, n - 1, hashes, nb, &nh);
        kvc_tier_hits th = {0, 0, 0};
        if (rc == KV_OK) {
            rc = kvc_lookup_tiers(e->pool, hashes, nh, probe, &nhit, &th);
        }
        if (rc != KV_OK) {
            kve__fail(e, rc, "lookup: %s", kvc_last_error(e->conn));
            goto cleanup;
        }
        /* A run below T0 that the prefill's fetch will bring up counts as cached for the first
         * chunk's size (a run under the daemon's fetch-min-tokens is recomputed instead). */
        if ((uint64_t)th.fetchable * e->tpb >= KVE_FETCH_MIN_TOKENS) {
            lower = th.fetchable;
        }
    }
    size_t first = n;
    if (e->o.static_batching) {
        size_t resv = kve__blocks_for(e, rs->r->prompt_len + rs->r->max_new);
        if (e->o.block_budget != 0 && kve__held_blocks(e, s) + resv > e->o.block_budget) {
            rc = KV_ENOSPC;
            goto release_probe;
        }
        rs->reserved = resv;
    } else {
        first = (nhit + lower) * e->tpb + budget;
        first = first > n ? n : first;
        if (e->o.zip_budget != 0 && first > kve__zcap(e)) {
            first = kve__zcap(e); /* the rest of the prompt comes after a compression */
        }
        if (e->o.block_budget != 0 &&
            kve__held_blocks(e, s) + kve__blocks_for(e, first) - nhit > e->o.block_budget) {
            rc = KV_ENOSPC;
            goto release_probe;
        }
    }
    if (e->o.prefix_cache) {
        rc = kvc_seq_prefill(rs->seq, rs->toks, first, &cached);
    } else {
        rc = kvc_seq_append(rs->seq, rs->toks, first);
    }
    if (rc == KV_ENOSPC) {
        rs->reserved = 0;
    } else if (rc != KV_OK) {
        kve__fail(e, rc, "prefill: %s", kvc_last_error(e->conn));
    }
release_probe:
    if (nhit > 0) {
        kv_err rc2 = kvc_release(e->pool, probe, nhit);
        rc = rc == KV_OK ? rc2 : rc;
    }
    if (rc == KV_OK) {
        rs->done = cached;
        rs->phase = PH_RUNNING;
        rs->order = e->next_order++;
        if (!rs->admitted) {
            rs->admitted = 1;
            rs->r->cached_tokens = cached < rs->r->prompt_len ? cached : rs->r->prompt_len;
            e->st.cached_tokens += rs->r->cached_tokens;
        }
    }
cleanup:
    free(hashes);
    free(probe);
    return rc;
}

/* Records token t chosen from logits lg as rs's next token. */
static void emit(kve_engine *e, req_state *rs, uint32_t t, const float *lg) {
    kve_request *r = rs->r;
    int V = e->m->cfg.vocab_size;
    if (r->nout == 0) {
        r->ttft_ms = kve__now_ms() - rs->arrive;
    }
    if (r->forced != NULL) {
        t = r->forced[r->nout]; /* teacher forcing: the given token, the model's logits */
    }
    if (e->o.keep_logits && lg != NULL) {
        memcpy(r->logits + r->nout * (size_t)V, lg, (size_t)V * sizeof(float));
    }
    r->out[r->nout++] = t;
    rs->toks[rs->ntoks++] = t;
    e->st.generated++;
}

/* Plans the rows of running request rs under *budget; grows its sequence (preempting the newest
 * request while blocks are short). Returns KV_OK with rs->nrows set (0 when rs was preempted or
 * no budget was left). */
static kv_err plan(kve_engine *e, sched *s, req_state *rs, size_t *budget) {
    rs->nrows = 0;
    rs->spec = 0;
    if (rs->zstate != Z_NONE) {
        return KV_OK; /* waiting for (or in) a compression */
    }
    size_t left = rs->ntoks - rs->done;
    size_t want;
    if (left == 1) {
        rs->spec = e->o.spec_k > 0 && rs->r->nout + 1 < rs->r->max_new;
        want = 1;
    } else {
        want = e->o.static_batching ? left : (left < *budget ? left : *budget);
    }
    if (want == 0 || (!e->o.static_batching && *budget == 0)) {
        return KV_OK;
    }
    if (e->o.zip_budget != 0) {
        /* Zipage: at the budget, the sequence is compressed before it grows. */
        size_t slots = rs->done - rs->dropped;
        if (slots + want > kve__zcap(e)) {
            want = kve__zcap(e) - slots;
            if (want == 0) {
                rs->zstate = Z_PENDING;
                return KV_OK;
            }
        }
    }
    for (;;) {
        kv_err rc = grow(e, s, rs, rs->done + want);
        if (rc == KV_OK) {
            break;
        }
        if (rc != KV_ENOSPC) {
            return kve__fail(e, rc, "grow: %s", kvc_last_error(e->conn));
        }
        req_state *v = NULL;
        rc = kve__preempt_newest(e, s, &v);
        if (rc == KV_EBUSY) {
            return KV_OK; /* every other request is being compressed: try next step */
        }
        if (rc != KV_OK) {
            return kve__fail(e, rc, "preempt: %s", kvc_last_error(e->conn));
        }
        if (v == rs) {
            return KV_OK;
        }
    }
    rs->nrows = want;
    *budget = *budget > want ? *budget - want : 0;
    return KV_OK;
}

/* Speculation for the requests flagged spec: the draft (first draft_layers layers, writing the
 * same K/V as the target there) proposes up to spec_k tokens greedily, one pass per token over
 * all of them; each draft token gets its slot as it is proposed (a request that cannot grow
 * stops proposing). */
static kv_err draft(kve_engine *e, sched *s, req_state **sp, size_t ns) {
    int V = e->m->cfg.vocab_size;
    row *rows = malloc(ns * sizeof(row));
    float *lg = malloc(ns * (size_t)V * sizeof(float));
    kv_err rc = KV_ENOMEM;
    if (rows == NULL || lg == NULL) {
        goto cleanup;
    }
    for (size_t i = 0; i < ns; i++) {
        sp[i]->kdraft = 0;
        sp[i]->draft[0] = sp[i]->toks[sp[i]->done];
    }
    for (int j = 0; j < e->o.spec_k; j++) {
        size_t nr = 0;
        for (size_t i = 0; i < ns; i++) {
            req_state *rs = sp[i];
            if (rs->kdraft != (size_t)j) {
                continue; /* stopped proposing */
            }
            size_t pos = rs->done + (size_t)j;
            if (j > 0) {
                /* the slot of d_j: append the proposed token (never committed unless verified) */
                size_t len = kvc_seq_length(rs->seq);
                if (pos >= len) {
                    if (e->o.block_budget != 0 &&
                        kve__blocks_for(e, pos + 1) > kvc_seq_nblocks(rs->seq) &&
                        kve__held_blocks(e, s) + 1 > e->o.block_budget) {
                        continue;
                    }
                    kv_err r2 = kvc_seq_append(rs->seq, &rs->draft[j], 1);
                    if (r2 == KV_ENOSPC) {
                        continue;
                    }
                    if (r2 != KV_OK) {
                        rc = kve__fail(e, r2, "draft append: %s", kvc_last_error(e->conn));
                        goto cleanup;
                    }
                }
            }
            rows[nr] = (row){rs, (uint32_t)pos, (uint32_t)pos, rs->draft[j], lg + nr * (size_t)V};
            nr++;
        }
        if (nr == 0) {
            break;
        }
        rc = forward(e, rows, nr, e->o.draft_layers);
        if (rc != KV_OK) {
            goto cleanup;
        }
        e->st.draft_rows += nr;
        for (size_t i = 0; i < nr; i++) {
            req_state *rs = rows[i].rs;
            rs->draft[j + 1] = kve_argmax(rows[i].logits, V);
            rs->kdraft = (size_t)j + 1;
        }
    }
    /* The verify pass needs d_k's slot too. */
    for (size_t i = 0; i < ns; i++) {
        req_state *rs = sp[i];
        while (rs->kdraft > 0) {
            size_t pos = rs->done + rs->kdraft;
            if (pos < kvc_seq_length(rs->seq)) {
                break;
            }
            int fits = e->o.block_budget == 0 ||
                       kve__blocks_for(e, pos + 1) <= kvc_seq_nblocks(rs->seq) ||
                       kve__held_blocks(e, s) + 1 <= e->o.block_budget;
            kv_err r2 = fits ? kvc_seq_append(rs->seq, &rs->draft[rs->kdraft], 1) : KV_ENOSPC;
            if (r2 == KV_OK) {
                break;
            }
            if (r2 != KV_ENOSPC) {
                rc = kve__fail(e, r2, "draft append: %s", kvc_last_error(e->conn));
                goto cleanup;
            }
            rs->kdraft--;
        }
    }
    rc = KV_OK;
cleanup:
    free(rows);
    free(lg);
    return rc;
}

static int cmp_arrival(const void *a, const void *b) {
    const req_state *x = *(req_state *const *)a, *y = *(req_state *const *)b;
    return x->arrive < y->arrive ? -1 : x->arrive > y->arrive;
}

/* One iteration. *progress gets whether any row was computed. */
static kv_err step(kve_engine *e, sched *s, int *progress) {
    const int V = e->m->cfg.vocab_size;
    size_t budget = e->o.token_budget;
    kv_err rc = kve__zip_poll(e, 0);
    if (rc == KV_OK) {
        rc = kve__zip_submit(e, s);
    }
    if (rc != KV_OK) {
        return rc;
    }
    *progress = 0;
    for (size_t i = 0; i < s->nrun; i++) {
        s->run[i]->nrows = 0;
        s->run[i]->spec = 0;
    }
    /* 1: running requests, oldest first. plan() may preempt the newest ones. */
    for (size_t i = 0; i < s->nrun; i++) {
        req_state *rs = s->run[i];
        size_t before = s->nrun;
        rc = plan(e, s, rs, &budget);
        if (rc != KV_OK) {
            return rc;
        }
        if (s->nrun < before && (i >= s->nrun || s->run[i] != rs)) {
            break; /* rs itself was preempted: it was the newest */
        }
    }
    /* 2: admissions. Static batching admits only into an empty batch. */
    int may_admit = !e->o.static_batching || s->nrun == 0;
    while (may_admit && s->nwait > 0 && s->nrun < e->o.max_batch &&
           (budget > 0 || e->o.static_batching)) {
        req_state *rs = s->wait[0];
        if (rs->swap != NULL && rs->swapped_at == e->st.steps + 1) {
            break; /* swapped out in this very step: not back before the next */
        }
        rc = admit(e, s, rs, budget);
        if (rc == KV_ENOSPC) {
            if (s->nrun == 0) {
                rs->r->status = KV_ENOSPC;
                rs->phase = PH_DONE;
                memmove(&s->wait[0], &s->wait[1], (s->nwait - 1) * sizeof(*s->wait));
                s->nwait--;
                kve__fail(e, KV_ENOSPC, "request %u does not fit the block budget", rs->r->id);
                continue;
            }
            break;
        }
        if (rc != KV_OK) {
            return rc;
        }
        memmove(&s->wait[0], &s->wait[1], (s->nwait - 1) * sizeof(*s->wait));
        s->nwait--;
        s->run[s->nrun++] = rs;
        rc = plan(e, s, rs, &budget);
        if (rc != KV_OK) {
            return rc;
        }
    }
    if (s->nrun > e->st.peak_running) {
        e->st.peak_running = s->nrun;
    }
    /* 3: speculation, then one forward pass over every planned row. */
    req_state **spec = malloc((s->nrun + 1) * sizeof(*spec));
    size_t ns = 0, nrows = 0;
    if (spec == NULL) {
        return KV_ENOMEM;
    }
    for (size_t i = 0; i < s->nrun; i++) {
        if (s->run[i]->nrows > 0 && s->run[i]->spec) {
            spec[ns++] = s->run[i];
        }
    }
    if (ns > 0) {
        rc = draft(e, s, spec, ns);
        if (rc != KV_OK) {
            free(spec);
            return rc;
        }
    }
    for (size_t i = 0; i < s->nrun; i++) {
        req_state *rs = s->run[i];
        if (rs->spec && rs->nrows > 0) {
            rs->nrows = rs->kdraft + 1;
        }
        nrows += rs->nrows;
    }
    row *rows = malloc((nrows + 1) * sizeof(row));
    float *lg = malloc((nrows + 1) * (size_t)V * sizeof(float));
    if (rows == NULL || lg == NULL) {
        rc = KV_ENOMEM;
        goto cleanup;
    }
    size_t k = 0;
    for (size_t i = 0; i < s->nrun; i++) {
        req_state *rs = s->run[i];
        for (size_t j = 0; j < rs->nrows; j++) {
            size_t pos = rs->done + j;
            uint32_t t = rs->spec ? rs->draft[j] : rs->toks[pos];
            int want = rs->spec || pos + 1 == rs->ntoks;
            rows[k++] = (row){rs, (uint32_t)pos, (uint32_t)(pos - rs->dropped), t,
                              want ? lg + k * (size_t)V : NULL};
        }
    }
    /* Slot accounting for memory waste: what is held against what holds a token. */
    for (size_t i = 0; i < s->nrun; i++) {
        req_state *rs = s->run[i];
        size_t alloc = e->o.static_batching ? rs->reserved : kvc_seq_nblocks(rs->seq);
        if (kvc_seq_nblocks(rs->seq) > rs->r->peak_blocks) {
            rs->r->peak_blocks = kvc_seq_nblocks(rs->seq);
        }
        e->st.slots_allocated += (double)alloc * e->tpb;
        e->st.slots_used += (double)kvc_seq_length(rs->seq);
    }
    rc = forward(e, rows, nrows, e->m->cfg.n_layers);
    if (rc != KV_OK) {
        goto cleanup;
    }
    e->st.computed_tokens += nrows;
    e->st.steps++;
    *progress = nrows > 0;
    /* 4: tokens, commits, finishes. */
    k = 0;
    for (size_t i = 0; i < s->nrun; i++) {
        req_state *rs = s->run[i];
        kve_request *r = rs->r;
        const row *base = rows + k;
        k += rs->nrows;
        r->computed_tokens += rs->nrows;
        if (rs->nrows == 0) {
            continue;
        }
        if (rs->spec) {
            /* Accept draft d_j while it equals the target's choice after d_{j-1}. */
            size_t a = 0;
            while (a < rs->kdraft && rs->draft[a + 1] == kve_argmax(base[a].logits, V)) {
                a++;
            }
            e->st.spec_steps++;
            e->st.spec_proposed += rs->kdraft;
            e->st.spec_accepted += a;
            for (size_t j = 0; j <= a && r->nout < r->max_new; j++) {
                uint32_t t = j < a ? rs->draft[j + 1] : kve_argmax(base[a].logits, V);
                emit(e, rs, t, base[j].logits);
            }
            rs->done = rs->ntoks - 1;
            size_t valid = 0;
            rc = kvc_seq_rewind(rs->seq, rs->done, &valid);
            if (rc != KV_OK || valid != rs->done) {
                rc = kve__fail(e, rc != KV_OK ? rc : KV_EINTERNAL, "rewind to %zu: %s", rs->done,
                               kvc_last_error(e->conn));
                goto cleanup;
            }
        } else {
            rs->done += rs->nrows;
            if (rs->done == rs->ntoks) {
                const float *l = base[rs->nrows - 1].logits;
                emit(e, rs, kve_argmax(l, V), l);
            }
        }
        if (e->o.prefix_cache) {
            rc = kvc_seq_commit(rs->seq, rs->done - rs->dropped, NULL);
            if (rc != KV_OK) {
                kve__fail(e, rc, "commit: %s", kvc_last_error(e->conn));
                goto cleanup;
            }
        }
    }
    for (size_t i = 0; i < s->nrun;) {
        req_state *rs = s->run[i];
        if (rs->r->nout >= rs->r->max_new) {
            rs->r->finish_ms = kve__now_ms() - rs->arrive;
            rs->r->status = KV_OK;
            rs->phase = PH_DONE;
            rc = retire(e, rs);
            if (rc != KV_OK) {
                kve__fail(e, rc, "release: %s", kvc_last_error(e->conn));
                goto cleanup;
            }
            remove_running(s, rs);
            continue;
        }
        i++;
    }
    rc = kve__ice_maintain(e, s);
cleanup:
    free(rows);
    free(lg);
    free(spec);
    return rc;
}

kv_err kve_engine_run(kve_engine *e, kve_request *reqs, size_t n) {
    const int V = e->m->cfg.vocab_size;
    sched s = {0};
    kv_err rc = KV_ENOMEM;
    s.n = n;
    s.rs = calloc(n + 1, sizeof(req_state));
    s.run = calloc(n + 1, sizeof(req_state *));
    s.wait = calloc(n + 1, sizeof(req_state *));
    req_state **future = calloc(n + 1, sizeof(req_state *));
    size_t nfut = 0, fut_i = 0, ndone = 0;
    double t0 = kve__now_ms();
    if (s.rs == NULL || s.run == NULL || s.wait == NULL || future == NULL) {
        goto cleanup;
    }
    for (size_t i = 0; i < n; i++) {
        kve_request *r = &reqs[i];
        req_state *rs = &s.rs[i];
        rs->r = r;
        r->nout = 0;
        r->status = KV_EINVAL;
        r->preemptions = 0;
        r->peak_blocks = 0;
        r->compressions = 0;
        r->computed_tokens = 0;
        r->cached_tokens = 0;
        if (r->prompt_len == 0 || r->max_new == 0) {
            ndone++;
            rs->phase = PH_DONE;
            continue;
        }
        rs->toks = malloc((r->prompt_len + r->max_new + 1) * sizeof(uint32_t));
        r->out = realloc(r->out, r->max_new * sizeof(uint32_t));
        if (e->o.keep_logits) {
            r->logits = realloc(r->logits, (size_t)r->max_new * V * sizeof(float));
        }
        if (rs->toks == NULL || r->out == NULL || (e->o.keep_logits && r->logits == NULL)) {
            goto cleanup;
        }
        for (size_t j = 0; j < r->prompt_len; j++) {
            if (r->prompt[j] >= (uint32_t)V) {
                r->status = KV_EINVAL;
                rs->phase = PH_DONE;
                break;
            }
            rs->toks[j] = r->prompt[j];
        }
        if (rs->phase == PH_DONE) {
            ndone++;
            continue;
        }
        rs->ntoks = r->prompt_len;
        rs->arrive = t0 + r->arrival_ms;
        e->st.prompt_tokens += r->prompt_len;
        future[nfut++] = rs;
    }
    qsort(future, nfut, sizeof(*future), cmp_arrival);
    rc = KV_OK;
    while (ndone < n) {
        double now = kve__now_ms();
        while (fut_i < nfut && future[fut_i]->arrive <= now) {
            future[fut_i]->phase = PH_WAITING;
            s.wait[s.nwait++] = future[fut_i++];
        }
        if (s.nrun == 0 && s.nwait == 0) {
            if (fut_i >= nfut) {
                break;
            }
            double dt = future[fut_i]->arrive - now;
            struct timespec ts = {(time_t)(dt / 1e3), (long)(fmod(dt, 1e3) * 1e6)};
            nanosleep(&ts, NULL);
            continue;
        }
        int progress = 0;
        size_t before = s.nrun + s.nwait;
        rc = step(e, &s, &progress);
        if (rc != KV_OK) {
            goto cleanup;
        }
        ndone += before - (s.nrun + s.nwait);
        if (!progress && e->zjob != NULL) {
            rc = kve__zip_poll(e, 1); /* nothing else to run: wait for the compression */
            if (rc != KV_OK) {
                goto cleanup;
            }
        }
    }
cleanup:
    if (e->zjob != NULL) {
        /* The thread may still read these requests' state: let it finish first. */
        pthread_mutex_lock(&e->zmu);
        while (!e->zjob_done) {
            pthread_cond_wait(&e->zcv, &e->zmu);
        }
        for (size_t i = 0; i < e->nzjob; i++) {
            (void)kvc_release(e->pool, e->zjob[i]->fresh, e->zjob[i]->nfresh);
            e->zjob[i]->zstate = Z_NONE;
        }
        free(e->zjob);
        e->zjob = NULL;
        e->nzjob = 0;
        e->zjob_done = 0;
        pthread_mutex_unlock(&e->zmu);
    }
    e->st.elapsed_ms = kve__now_ms() - t0;
    for (size_t i = 0; s.rs != NULL && i < n; i++) {
        if (s.rs[i].seq != NULL) {
            kvc_seq_free(s.rs[i].seq);
        }
        free(s.rs[i].toks);
        kve__zip_fini(&s.rs[i]);
    }
    free(future);
    free(s.wait);
    free(s.run);
    free(s.rs);
    return rc;
}
