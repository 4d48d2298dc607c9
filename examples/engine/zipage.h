/* zipage: which tokens a Zipage compression keeps (docs/ZIPAGE.md). Pure functions over caller
 * memory, any thread; the engine runs them on its compression thread.
 *
 * A sequence's cached tokens (slots 0..n-1, in position order) are scored from the attention its
 * last queries paid them (kvk_token_scores_cpu summed over layers). The score of slot t is
 *   a_t = maxpool_w(attn)_t / max(attn) + decay * global_t - lambda * red_t
 * where maxpool_w takes the largest attention within w slots centred on t (pooling keeps the
 * neighbours of a strong token, as Zipage's pooling of size 5 does), global_t is the score the
 * token carried out of the previous compression (0 for tokens that arrived since), and red_t
 * is its key's redundancy: the mean over KV heads of sum_u softmax_u(cos(k_t, k_u) / temp) *
 * cos(k_t, k_u) over the other tokens u (a token whose key others repeat adds little). The first
 * `sinks` and the last `window` slots are always kept; the rest are the highest scores (ties:
 * the earlier slot), kept in slot order.
 */
#ifndef KVE_ZIPAGE_H
#define KVE_ZIPAGE_H

#include <stddef.h>
#include <stdint.h>

#include "common/kv_err.h"

typedef struct kve_zip_params {
    size_t keep;   /* tokens kept (>= sinks + window) */
    size_t sinks;  /* first slots always kept (Zipage: 4) */
    size_t window; /* last slots always kept (the cached queries' own tokens) */
    size_t pool;   /* max-pooling width (odd; 1 = none; Zipage: 5) */
    float decay;   /* weight of the carried global score (Zipage: 0.8; 0 = off) */
    float lambda;  /* weight of the redundancy term (Zipage: 0.2; 0 = off) */
} kve_zip_params;

/* Chooses p->keep of n slots. attn[n]: attention mass per slot (any positive scale); global[n]:
 * carried scores or NULL; red[n]: redundancy or NULL. Writes kept[0..keep) ascending, and, when
 * global_out is not NULL, global_out[i] = the final score of kept[i] (to carry into the next
 * compression). KV_EINVAL when keep > n, keep < sinks + window, or a NULL array; KV_ENOMEM. */
kv_err kve_zip_select(const kve_zip_params *p, const float *attn, const float *global,
                      const float *red, size_t n, uint32_t *kept, float *global_out);

/* red[t] for keys [heads][n][dim] (float32): the redundancy defined above, averaged over heads.
 * O(heads * n^2 * dim). KV_ENOMEM. */
kv_err kve_zip_redundancy(const float *keys, size_t heads, size_t n, size_t dim, float temp,
                          float *red);

#endif
