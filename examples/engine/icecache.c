/* icecache: the PCA-tree packing of IceCache's offloaded tokens (see icecache.h). */
#include "examples/engine/icecache.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef struct proj {
    float v;
    uint32_t tok;
} proj;

static int by_proj(const void *a, const void *b) {
    const proj *x = a, *y = b;
    if (x->v != y->v) {
        return x->v < y->v ? -1 : 1;
    }
    return x->tok < y->tok ? -1 : x->tok > y->tok;
}

static int by_tok(const void *a, const void *b) {
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : x > y;
}

/* Splits idx[0..n) (n > page, a multiple of it) at a median along the principal direction. */
static void split(const float *keys, size_t width, size_t page, uint32_t *idx, size_t n,
                  float *mean, float *dir, float *tmp, proj *pr) {
    if (n <= page) {
        qsort(idx, n, sizeof(uint32_t), by_tok);
        return;
    }
    memset(mean, 0, width * sizeof(float));
    for (size_t i = 0; i < n; i++) {
        const float *k = keys + (size_t)idx[i] * width;
        for (size_t d = 0; d < width; d++) {
            mean[d] += k[d];
        }
    }
    for (size_t d = 0; d < width; d++) {
        mean[d] /= (float)n;
    }
    /* Power iteration on the covariance, from the direction of the farthest key. */
    double far = -1;
    for (size_t i = 0; i < n; i++) {
        const float *k = keys + (size_t)idx[i] * width;
        double s = 0;
        for (size_t d = 0; d < width; d++) {
            s += (double)(k[d] - mean[d]) * (k[d] - mean[d]);
        }
        if (s > far) {
            far = s;
            for (size_t d = 0; d < width; d++) {
                dir[d] = k[d] - mean[d];
            }
        }
    }
    for (int it = 0; it < 8; it++) {
        memset(tmp, 0, width * sizeof(float));
        for (size_t i = 0; i < n; i++) {
            const float *k = keys + (size_t)idx[i] * width;
            double p = 0;
            for (size_t d = 0; d < width; d++) {
                p += (double)(k[d] - mean[d]) * dir[d];
            }
            for (size_t d = 0; d < width; d++) {
                tmp[d] += (float)p * (k[d] - mean[d]);
            }
        }
        double nrm = 0;
        for (size_t d = 0; d < width; d++) {
            nrm += (double)tmp[d] * tmp[d];
        }
        if (nrm <= 0) {
            break; /* all keys equal: any split is as good */
        }
        for (size_t d = 0; d < width; d++) {
            dir[d] = (float)(tmp[d] / sqrt(nrm));
        }
    }
    for (size_t i = 0; i < n; i++) {
        const float *k = keys + (size_t)idx[i] * width;
        double p = 0;
        for (size_t d = 0; d < width; d++) {
            p += (double)(k[d] - mean[d]) * dir[d];
        }
        pr[i] = (proj){(float)p, idx[i]};
    }
    qsort(pr, n, sizeof(proj), by_proj);
    for (size_t i = 0; i < n; i++) {
        idx[i] = pr[i].tok;
    }
    size_t pages = n / page, left = (pages / 2) * page;
    split(keys, width, page, idx, left, mean, dir, tmp, pr);
    split(keys, width, page, idx + left, n - left, mean, dir, tmp, pr);
}

kv_err kve_ice_pack(const float *keys, size_t n, size_t width, size_t page, uint32_t *order) {
    if (page == 0 || n == 0 || n % page != 0 || keys == NULL || order == NULL || width == 0) {
        return KV_EINVAL;
    }
    float *mean = malloc(width * sizeof(float));
    float *dir = malloc(width * sizeof(float));
    float *tmp = malloc(width * sizeof(float));
    proj *pr = malloc(n * sizeof(proj));
    if (mean == NULL || dir == NULL || tmp == NULL || pr == NULL) {
        free(mean), free(dir), free(tmp), free(pr);
        return KV_ENOMEM;
    }
    for (size_t i = 0; i < n; i++) {
        order[i] = (uint32_t)i;
    }
    split(keys, width, page, order, n, mean, dir, tmp, pr);
    free(mean), free(dir), free(tmp), free(pr);
    return KV_OK;
}
