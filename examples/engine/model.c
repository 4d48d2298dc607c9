/* model: weights of the example engine's transformer (seeded or llama2.c file), its row kernels
 * and a dense reference forward pass. Every row is computed alone in a fixed order (see
 * model.h), which is what makes paged, cached and batched runs agree bit for bit. */
#include "examples/engine/model.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "examples/engine/gemm.h"

const char *kve_config_check(const kve_config *c) {
    if (c->dim <= 0 || c->hidden_dim <= 0 || c->n_layers <= 0 || c->n_heads <= 0 ||
        c->n_kv_heads <= 0 || c->vocab_size <= 0 || c->seq_len <= 0) {
        return "every dimension must be positive";
    }
    if (c->dim % c->n_heads != 0) {
        return "dim must be a multiple of n_heads";
    }
    if (c->n_heads % c->n_kv_heads != 0) {
        return "n_heads must be a multiple of n_kv_heads";
    }
    if ((c->dim / c->n_heads) % 2 != 0) {
        return "head size must be even (RoPE rotates pairs)";
    }
    if (c->dim > (1 << 16) || c->hidden_dim > (1 << 18) || c->n_layers > 1024 ||
        c->vocab_size > (1 << 20)) {
        return "shape too large for the example engine";
    }
    return NULL;
}

int32_t kve_head_dim(const kve_config *c) {
    return c->dim / c->n_heads;
}

int32_t kve_kv_dim(const kve_config *c) {
    return c->n_kv_heads * (c->dim / c->n_heads);
}

/* Floats of every tensor, in llama2.c's order, without the RoPE tables. */
static size_t tensor_floats(const kve_config *c, int shared_cls) {
    size_t d = (size_t)c->dim, h = (size_t)c->hidden_dim, l = (size_t)c->n_layers;
    size_t kv = (size_t)kve_kv_dim(c), v = (size_t)c->vocab_size;
    size_t n = v * d + l * d + l * d * d + 2 * l * kv * d + l * d * d + l * d + 3 * l * h * d + d;
    return shared_cls ? n : n + v * d;
}

/* Points the tensor fields into m->mem. */
static void layout_tensors(kve_model *m) {
    const kve_config *c = &m->cfg;
    size_t d = (size_t)c->dim, h = (size_t)c->hidden_dim, l = (size_t)c->n_layers;
    size_t kv = (size_t)kve_kv_dim(c), v = (size_t)c->vocab_size;
    float *p = m->mem;
    m->tok_emb = p, p += v * d;
    m->rms_att = p, p += l * d;
    m->wq = p, p += l * d * d;
    m->wk = p, p += l * kv * d;
    m->wv = p, p += l * kv * d;
    m->wo = p, p += l * d * d;
    m->rms_ffn = p, p += l * d;
    m->w1 = p, p += l * h * d;
    m->w2 = p, p += l * d * h;
    m->w3 = p, p += l * h * d;
    m->rms_final = p, p += d;
    m->wcls = m->shared_cls ? m->tok_emb : p;
}

static uint64_t mix64(uint64_t *s) {
    uint64_t x = (*s += 0x9e3779b97f4a7c15ull);
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static void fill_uniform(float *p, size_t n, float bound, uint64_t *s) {
    for (size_t i = 0; i < n; i++) {
        p[i] = bound * (float)((double)(mix64(s) >> 11) * (2.0 / 9007199254740992.0) - 1.0);
    }
}

float *kve_alloc_floats(size_t n) {
    size_t bytes = (n * sizeof(float) + 63) / 64 * 64;
    return aligned_alloc(64, bytes == 0 ? 64 : bytes);
}

kv_err kve_model_random(const kve_config *c, uint64_t seed, int shared_cls, kve_model *out) {
    if (kve_config_check(c) != NULL) {
        return KV_EINVAL;
    }
    kve_model m = {.cfg = *c, .shared_cls = shared_cls != 0};
    m.mem = kve_alloc_floats(tensor_floats(c, m.shared_cls));
    if (m.mem == NULL) {
        return KV_ENOMEM;
    }
    layout_tensors(&m);
    uint64_t s = seed;
    size_t d = (size_t)c->dim, h = (size_t)c->hidden_dim, kv = (size_t)kve_kv_dim(c);
    fill_uniform(m.tok_emb, (size_t)c->vocab_size * d, 1.0f, &s);
    for (int32_t l = 0; l < c->n_layers; l++) {
        /* Deeper layers write less into the residual: a draft made of the first layers then
         * agrees with the target often, as trained models' early exits do. */
        float out_gain = l == 0 ? 1.0f : 0.35f / (float)l;
        float bd = 1.0f / sqrtf((float)d), bh = 1.0f / sqrtf((float)h);
        for (size_t i = 0; i < d; i++) {
            m.rms_att[l * d + i] = 1.0f;
            m.rms_ffn[l * d + i] = 1.0f;
        }
        fill_uniform(m.wq + l * d * d, d * d, bd, &s);
        fill_uniform(m.wk + l * kv * d, kv * d, bd, &s);
        fill_uniform(m.wv + l * kv * d, kv * d, bd, &s);
        fill_uniform(m.wo + l * d * d, d * d, bd * out_gain, &s);
        fill_uniform(m.w1 + l * h * d, h * d, bd, &s);
        fill_uniform(m.w2 + l * d * h, d * h, bh * out_gain, &s);
        fill_uniform(m.w3 + l * h * d, h * d, bd, &s);
    }
    for (size_t i = 0; i < d; i++) {
        m.rms_final[i] = 1.0f;
    }
    if (!m.shared_cls) {
        fill_uniform(m.wcls, (size_t)c->vocab_size * d, 1.0f, &s);
    }
    *out = m;
    return KV_OK;
}

kv_err kve_model_load(const char *path, kve_model *out) {
    kv_err rc = KV_OK;
    kve_model m = {0};
    int32_t hdr[7];
    FILE *f = fopen(path, "rb");
    if (f == NULL) {
        return KV_ESYS;
    }
    if (fread(hdr, sizeof(int32_t), 7, f) != 7) {
        rc = KV_EINVAL;
        goto cleanup_file;
    }
    m.cfg = (kve_config){hdr[0], hdr[1], hdr[2], hdr[3], hdr[4], hdr[5], hdr[6]};
    m.shared_cls = m.cfg.vocab_size > 0;
    if (m.cfg.vocab_size < 0) {
        m.cfg.vocab_size = -m.cfg.vocab_size;
    }
    if (kve_config_check(&m.cfg) != NULL) {
        rc = KV_EINVAL;
        goto cleanup_file;
    }
    size_t total = tensor_floats(&m.cfg, m.shared_cls);
    m.mem = kve_alloc_floats(total);
    if (m.mem == NULL) {
        rc = KV_ENOMEM;
        goto cleanup_file;
    }
    layout_tensors(&m);
    /* Everything up to and including rms_final is contiguous in the file and in mem. */
    size_t head = (size_t)(m.rms_final - m.mem) + (size_t)m.cfg.dim;
    if (fread(m.mem, sizeof(float), head, f) != head) {
        rc = KV_EINVAL;
        goto cleanup_mem;
    }
    if (!m.shared_cls) {
        /* Skip freq_cis_real and freq_cis_imag: seq_len * head_size / 2 floats each. */
        long skip = (long)m.cfg.seq_len * kve_head_dim(&m.cfg) * (long)sizeof(float);
        size_t ncls = (size_t)m.cfg.vocab_size * (size_t)m.cfg.dim;
        if (fseek(f, skip, SEEK_CUR) != 0 || fread(m.wcls, sizeof(float), ncls, f) != ncls) {
            rc = KV_EINVAL;
            goto cleanup_mem;
        }
    }
    fclose(f);
    *out = m;
    return KV_OK;
cleanup_mem:
    free(m.mem);
cleanup_file:
    fclose(f);
    return rc;
}

void kve_model_fini(kve_model *m) {
    if (m == NULL) {
        return;
    }
    free(m->mem);
    memset(m, 0, sizeof(*m));
}

void kve_matmul(float *out, const float *x, const float *w, int n, int nin, int nout) {
    kve_gemm_run(NULL, out, x, w, n, nin, nout);
}

void kve_rmsnorm(float *out, const float *x, const float *w, int dim) {
    float ss = 0.0f;
    for (int i = 0; i < dim; i++) {
        ss += x[i] * x[i];
    }
    float inv = 1.0f / sqrtf(ss / (float)dim + 1e-5f);
    for (int i = 0; i < dim; i++) {
        out[i] = w[i] * (inv * x[i]);
    }
}

void kve_rope(float *v, int heads, int head_dim, uint32_t pos) {
    for (int h = 0; h < heads; h++) {
        float *p = v + (size_t)h * head_dim;
        for (int i = 0; i < head_dim; i += 2) {
            float freq = 1.0f / powf(10000.0f, (float)i / (float)head_dim);
            float a = (float)pos * freq;
            float c = cosf(a), s = sinf(a);
            float x0 = p[i], x1 = p[i + 1];
            p[i] = x0 * c - x1 * s;
            p[i + 1] = x0 * s + x1 * c;
        }
    }
}

void kve_swiglu(float *a, const float *b, int n) {
    for (int i = 0; i < n; i++) {
        a[i] = a[i] / (1.0f + expf(-a[i])) * b[i];
    }
}

uint32_t kve_argmax(const float *v, int n) {
    int best = 0;
    for (int i = 1; i < n; i++) {
        if (v[i] > v[best]) {
            best = i;
        }
    }
    return (uint32_t)best;
}

kv_err kve_model_dense_logits(const kve_model *m, const uint32_t *tokens, size_t n, int layers,
                              float *logits, float *kabs, float *vabs) {
    const kve_config *c = &m->cfg;
    int d = c->dim, hd = kve_head_dim(c), kvd = kve_kv_dim(c), hid = c->hidden_dim;
    int L = layers <= 0 || layers > c->n_layers ? c->n_layers : layers;
    int grp = c->n_heads / c->n_kv_heads;
    kv_err rc = KV_ENOMEM;
    float *kc = malloc((size_t)L * n * (size_t)kvd * sizeof(float));
    float *vc = malloc((size_t)L * n * (size_t)kvd * sizeof(float));
    float *x = malloc((size_t)d * sizeof(float));
    float *xb = malloc((size_t)d * sizeof(float));
    float *q = malloc((size_t)d * sizeof(float));
    float *att = malloc((size_t)d * sizeof(float));
    float *hb = malloc((size_t)hid * sizeof(float));
    float *hb2 = malloc((size_t)hid * sizeof(float));
    float *sc = malloc((n + 1) * sizeof(float));
    if (!kc || !vc || !x || !xb || !q || !att || !hb || !hb2 || !sc) {
        goto cleanup;
    }
    for (size_t pos = 0; pos < n; pos++) {
        memcpy(x, m->tok_emb + (size_t)tokens[pos] * d, (size_t)d * sizeof(float));
        for (int l = 0; l < L; l++) {
            float *kr = kc + ((size_t)l * n + pos) * kvd;
            float *vr = vc + ((size_t)l * n + pos) * kvd;
            kve_rmsnorm(xb, x, m->rms_att + (size_t)l * d, d);
            kve_matmul(q, xb, m->wq + (size_t)l * d * d, 1, d, d);
            kve_matmul(kr, xb, m->wk + (size_t)l * kvd * d, 1, d, kvd);
            kve_matmul(vr, xb, m->wv + (size_t)l * kvd * d, 1, d, kvd);
            kve_rope(q, c->n_heads, hd, (uint32_t)pos);
            kve_rope(kr, c->n_kv_heads, hd, (uint32_t)pos);
            if (kabs != NULL && vabs != NULL) {
                for (int i = 0; i < kvd; i++) {
                    float *ka = &kabs[l * c->n_kv_heads + i / hd];
                    float *va = &vabs[l * c->n_kv_heads + i / hd];
                    *ka = fabsf(kr[i]) > *ka ? fabsf(kr[i]) : *ka;
                    *va = fabsf(vr[i]) > *va ? fabsf(vr[i]) : *va;
                }
            }
            for (int h = 0; h < c->n_heads; h++) {
                int kh = h / grp;
                float mx = -INFINITY;
                for (size_t t = 0; t <= pos; t++) {
                    const float *kt = kc + ((size_t)l * n + t) * kvd + (size_t)kh * hd;
                    float dot = 0.0f;
                    for (int i = 0; i < hd; i++) {
                        dot += q[h * hd + i] * kt[i];
                    }
                    sc[t] = dot / sqrtf((float)hd);
                    mx = sc[t] > mx ? sc[t] : mx;
                }
                float sum = 0.0f;
                for (int i = 0; i < hd; i++) {
                    att[h * hd + i] = 0.0f;
                }
                for (size_t t = 0; t <= pos; t++) {
                    float p = expf(sc[t] - mx);
                    sum += p;
                    const float *vt = vc + ((size_t)l * n + t) * kvd + (size_t)kh * hd;
                    for (int i = 0; i < hd; i++) {
                        att[h * hd + i] += p * vt[i];
                    }
                }
                for (int i = 0; i < hd; i++) {
                    att[h * hd + i] /= sum;
                }
            }
            kve_matmul(xb, att, m->wo + (size_t)l * d * d, 1, d, d);
            for (int i = 0; i < d; i++) {
                x[i] += xb[i];
            }
            kve_rmsnorm(xb, x, m->rms_ffn + (size_t)l * d, d);
            kve_matmul(hb, xb, m->w1 + (size_t)l * hid * d, 1, d, hid);
            kve_matmul(hb2, xb, m->w3 + (size_t)l * hid * d, 1, d, hid);
            kve_swiglu(hb, hb2, hid);
            kve_matmul(xb, hb, m->w2 + (size_t)l * d * hid, 1, hid, d);
            for (int i = 0; i < d; i++) {
                x[i] += xb[i];
            }
        }
        if (logits != NULL) {
            kve_rmsnorm(xb, x, m->rms_final, d);
            kve_matmul(logits + pos * (size_t)c->vocab_size, xb, m->wcls, 1, d, c->vocab_size);
        }
    }
    rc = KV_OK;
cleanup:
    free(kc), free(vc), free(x), free(xb), free(q), free(att), free(hb), free(hb2), free(sc);
    return rc;
}
