/* model: the tiny decoder-only transformer of the example engine (llama2.c architecture:
 * RMSNorm, RoPE, grouped-query attention, SwiGLU) and its weights.
 *
 * Weights are float32, either generated from a seed (nothing can be downloaded here) or loaded
 * from a llama2.c checkpoint (header of 7 int32, then the tensors in llama2.c's order; a negative
 * vocab_size means an unshared classifier that follows the skipped RoPE tables). The row
 * kernels here (matmul by rows, norms, RoPE, SwiGLU) compute each token's row alone, in one
 * fixed order, so a token's values never depend on what else is in its batch: the engine relies
 * on that to give bit-identical results with or without the prefix cache.
 *
 * kve_model_dense_logits is a reference forward pass with its own contiguous KV arrays and plain
 * attention; tests compare the paged engine against it, and the engine calibrates the scales of
 * 8-bit KV pools with it. Pure functions over caller memory; any thread.
 */
#ifndef KVE_MODEL_H
#define KVE_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "common/kv_err.h"

typedef struct kve_config {
    int32_t dim;        /* residual width */
    int32_t hidden_dim; /* SwiGLU width */
    int32_t n_layers;   /* decoder layers */
    int32_t n_heads;    /* query heads */
    int32_t n_kv_heads; /* key/value heads (divides n_heads) */
    int32_t vocab_size; /* tokens (always positive here) */
    int32_t seq_len;    /* longest sequence (RoPE tables of the file format) */
} kve_config;

typedef struct kve_model {
    kve_config cfg;   /* shape */
    int shared_cls;   /* 1: the classifier is the token embedding */
    float *mem;       /* one allocation holding every tensor below */
    float *tok_emb;   /* [vocab][dim] */
    float *rms_att;   /* [layers][dim] */
    float *wq;        /* [layers][dim][dim] (out x in) */
    float *wk;        /* [layers][kv_dim][dim] */
    float *wv;        /* [layers][kv_dim][dim] */
    float *wo;        /* [layers][dim][dim] */
    float *rms_ffn;   /* [layers][dim] */
    float *w1;        /* [layers][hidden][dim] */
    float *w2;        /* [layers][dim][hidden] */
    float *w3;        /* [layers][hidden][dim] */
    float *rms_final; /* [dim] */
    float *wcls;      /* [vocab][dim]; == tok_emb when shared */
} kve_model;

/* Checks a shape: every field positive, dim divisible by n_heads, n_heads by n_kv_heads, an even
 * head size. Returns a static message naming what is wrong, or NULL. */
const char *kve_config_check(const kve_config *c);

/* n floats starting on a cache line (at least one line; free with free): the weights and the
 * matmuls' activation rows, so where the dims are multiples of 16 floats no 64-byte vector load
 * straddles two lines (malloc of a large block is 16 bytes past a page). NULL when out of
 * memory. */
float *kve_alloc_floats(size_t n);

/* Head size (dim / n_heads) and KV width (n_kv_heads * head size). */
int32_t kve_head_dim(const kve_config *c);
int32_t kve_kv_dim(const kve_config *c);

/* Generates weights from seed (deterministic on every machine: a 64-bit mixer, no libc rand).
 * Matrices are uniform in +-1/sqrt(fan_in); later layers' output projections are scaled down so
 * the first layers dominate the residual (which lets a shallow draft model predict the target).
 * KV_EINVAL for a bad shape, KV_ENOMEM. *out written on success; free with kve_model_fini. */
kv_err kve_model_random(const kve_config *c, uint64_t seed, int shared_cls, kve_model *out);

/* Loads a llama2.c checkpoint file. KV_ESYS when it cannot be read, KV_EINVAL for a bad header
 * or a file shorter than the header promises, KV_ENOMEM. *out written on success. */
kv_err kve_model_load(const char *path, kve_model *out);

/* Frees the weights; accepts NULL and zeroed models. */
void kve_model_fini(kve_model *m);

/* ---- Row kernels (one token's row at a time; used by the engine and the reference) ---- */

/* out[r][o] = sum_i w[o][i] * x[r][i] for rows r < n: w is [nout][nin]. The calling thread
 * alone through gemm.h (the engine uses its own pool of threads; same numbers). */
void kve_matmul(float *out, const float *x, const float *w, int n, int nin, int nout);
/* out = x * w / sqrt(mean(x^2) + 1e-5) over dim elements. */
void kve_rmsnorm(float *out, const float *x, const float *w, int dim);
/* Rotates consecutive pairs of each head of v (width heads * head_dim) for position pos. */
void kve_rope(float *v, int heads, int head_dim, uint32_t pos);
/* a = silu(a) * b over n elements. */
void kve_swiglu(float *a, const float *b, int n);
/* Index of the largest element (the first one on ties). */
uint32_t kve_argmax(const float *v, int n);

/* Reference forward over tokens[0..n) with positions 0..n-1, using the first `layers` layers
 * (the whole model when layers <= 0): logits [n][vocab] (may be NULL), and, when kabs/vabs are
 * not NULL, the running absmax of K and V per (layer, kv head) ([layers][kv_heads], updated).
 * KV_ENOMEM. */
kv_err kve_model_dense_logits(const kve_model *m, const uint32_t *tokens, size_t n, int layers,
                              float *logits, float *kabs, float *vabs);

#endif
