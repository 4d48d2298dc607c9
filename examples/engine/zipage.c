/* zipage: Zipage's token selection (see zipage.h). */
#include "examples/engine/zipage.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef struct cand {
    float score;
    uint32_t slot;
} cand;

static int by_score_desc(const void *a, const void *b) {
    const cand *x = a, *y = b;
    if (x->score != y->score) {
        return x->score > y->score ? -1 : 1;
    }
    return x->slot < y->slot ? -1 : x->slot > y->slot;
}

static int by_slot(const void *a, const void *b) {
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : x > y;
}

kv_err kve_zip_select(const kve_zip_params *p, const float *attn, const float *global,
                      const float *red, size_t n, uint32_t *kept, float *global_out) {
    if (p == NULL || attn == NULL || kept == NULL || p->keep > n ||
        p->keep < p->sinks + p->window || p->sinks + p->window > n) {
        return KV_EINVAL;
    }
    float *score = malloc((n ? n : 1) * sizeof(float));
    cand *c = malloc((n ? n : 1) * sizeof(cand));
    if (score == NULL || c == NULL) {
        free(score);
        free(c);
        return KV_ENOMEM;
    }
    float amax = 0.0f;
    for (size_t t = 0; t < n; t++) {
        amax = attn[t] > amax ? attn[t] : amax;
    }
    float norm = amax > 0.0f ? 1.0f / amax : 0.0f;
    size_t half = p->pool > 1 ? p->pool / 2 : 0;
    for (size_t t = 0; t < n; t++) {
        size_t lo = t >= half ? t - half : 0, hi = t + half < n ? t + half : n - 1;
        float m = attn[t];
        for (size_t u = lo; u <= hi; u++) {
            m = attn[u] > m ? attn[u] : m;
        }
        score[t] = m * norm;
        if (global != NULL) {
            score[t] += p->decay * global[t];
        }
        if (red != NULL) {
            score[t] -= p->lambda * red[t];
        }
    }
    size_t k = 0, nc = 0;
    for (size_t t = 0; t < n; t++) {
        if (t < p->sinks || t >= n - p->window) {
            kept[k++] = (uint32_t)t;
        } else {
            c[nc++] = (cand){score[t], (uint32_t)t};
        }
    }
    qsort(c, nc, sizeof(cand), by_score_desc);
    for (size_t i = 0; k < p->keep; i++) {
        kept[k++] = c[i].slot;
    }
    qsort(kept, p->keep, sizeof(uint32_t), by_slot);
    for (size_t i = 0; global_out != NULL && i < p->keep; i++) {
        global_out[i] = score[kept[i]];
    }
    free(score);
    free(c);
    return KV_OK;
}

kv_err kve_zip_redundancy(const float *keys, size_t heads, size_t n, size_t dim, float temp,
                          float *red) {
    float *nrm = malloc((n ? n : 1) * sizeof(float));
    float *cs = malloc((n ? n : 1) * sizeof(float));
    if (nrm == NULL || cs == NULL) {
        free(nrm);
        free(cs);
        return KV_ENOMEM;
    }
    for (size_t t = 0; t < n; t++) {
        red[t] = 0.0f;
    }
    for (size_t h = 0; h < heads; h++) {
        const float *k = keys + h * n * dim;
        for (size_t t = 0; t < n; t++) {
            double s = 0.0;
            for (size_t e = 0; e < dim; e++) {
                s += (double)k[t * dim + e] * k[t * dim + e];
            }
            nrm[t] = s > 0.0 ? (float)(1.0 / sqrt(s)) : 0.0f;
        }
        for (size_t t = 0; t < n; t++) {
            float m = -INFINITY;
            for (size_t u = 0; u < n; u++) {
                float d = 0.0f;
                for (size_t e = 0; e < dim; e++) {
                    d += k[t * dim + e] * k[u * dim + e];
                }
                cs[u] = u == t ? -INFINITY : d * nrm[t] * nrm[u];
                m = u != t && cs[u] / temp > m ? cs[u] / temp : m;
            }
            double z = 0.0, acc = 0.0;
            for (size_t u = 0; u < n && n > 1; u++) {
                if (u == t) {
                    continue;
                }
                double w = exp((double)(cs[u] / temp - m));
                z += w;
                acc += w * cs[u];
            }
            red[t] += z > 0.0 ? (float)(acc / z) / (float)heads : 0.0f;
        }
    }
    free(nrm);
    free(cs);
    return KV_OK;
}
