/* icecache: IceCache's packing of offloaded tokens into pages by key similarity
 * (docs/ICECACHE.md). Pure functions over caller memory; any thread.
 *
 * IceCache packs the tokens it offloads so that a page holds keys that look alike: a page's
 * per-channel key bounds (kvk_page_summaries) are then tight, the upper bound that selects pages
 * (kvk_page_select) is close to the true logits, and the top-k pages hold most of the attention
 * mass. The paper builds a hierarchical DCI index; kve_ice_pack is a simpler hierarchy with the
 * property the pages need: a recursive balanced bisection of the keys along their principal
 * direction (a PCA tree). Every split cuts at the median projection rounded to a whole number of
 * pages, so every leaf is exactly one page; cost O(n log(n / page) * width * iterations);
 * deterministic (no random init: power iteration starts from the direction of the farthest key).
 */
#ifndef KVE_ICECACHE_H
#define KVE_ICECACHE_H

#include <stddef.h>
#include <stdint.h>

#include "common/kv_err.h"

/* Orders n tokens (n a multiple of page) into n / page pages by key similarity: keys [n][width]
 * float32 (a token's keys of every KV head side by side); order[i] gets the token in packed slot
 * i, so page p holds tokens order[p * page .. (p + 1) * page). Within a page tokens keep their
 * original order. KV_EINVAL when n is not a positive multiple of page; KV_ENOMEM. */
kv_err kve_ice_pack(const float *keys, size_t n, size_t width, size_t page, uint32_t *order);

#endif
