/* kv_util: small helpers kvd, kvctl and libkvclient share, one definition each: the default
 * socket location, decimal and size parsing, and the huge-page advice on mappings of pool
 * segments. Any thread. */
#ifndef KV_UTIL_H
#define KV_UTIL_H

#include <stddef.h>
#include <stdint.h>

/* The default path of `file` in kvd's socket directory: $XDG_RUNTIME_DIR/kvd/FILE when
 * XDG_RUNTIME_DIR is set and not empty, else /tmp/kvd-UID/FILE (kvd.sock for clients,
 * admin.sock for kvctl). Returns -1 when it does not fit cap (buf then holds a cut path). */
int kv_default_socket_path(const char *file, char *buf, size_t cap);

/* Parses a decimal unsigned number at the start of s: at least one digit, no sign or space, no
 * overflow. *end (may be NULL) gets the first byte after the digits. Returns 0, or -1 (out and
 * end untouched). Callers that want the whole string check **end == '\0'. */
int kv_parse_u64(const char *s, const char **end, uint64_t *out);

/* Parses a whole string as kv_parse_u64's digits with an optional binary suffix: K, M, G or T
 * (either case), optionally followed by B or iB ("64K", "2MiB", "1GB": all powers of 1024).
 * Returns 0, or -1 for anything else or a value past UINT64_MAX (out untouched). */
int kv_parse_size(const char *s, uint64_t *out);

/* Asks for transparent huge pages behind [base, base + bytes), a shared mapping of a host
 * pool's memfd segment (madvise MADV_HUGEPAGE; base page aligned). kvd and libkvclient advise
 * every mapping of pool memory, because with the kernel's shmem THP mode `advise` a 2 MiB page
 * of a memfd is allocated huge only when the mapping that first touches it carries the advice,
 * and a mapping maps it with one entry only when it carries it too: one page fault and one TLB
 * entry per 2 MiB instead of 512. In the modes `never` and `deny` (the shmem default of most
 * distributions) the kernel ignores the advice: 4 KiB pages as without it. Returns 0, or -1 when
 * the kernel refused the advice (built without THP; errno set): callers that map pool memory
 * ignore that, the memory being the same either way; tests use it to tell such a kernel. */
int kv_map_advise_huge(void *base, uint64_t bytes);

/* n bytes (n > 0) for a large, long-lived buffer of one thread or job: from n = 2 MiB on,
 * 2 MiB-aligned and advised for transparent huge pages (kv_map_advise_huge: for private memory
 * the kernel's THP mode for anonymous memory decides, `madvise` on most distributions), else
 * 4096-aligned; free() frees it. What it buys: a first touch, and each O_DIRECT transfer's pinning,
 * handles one 2 MiB page instead of 512 (docs/ARCHITECTURE.md, Huge pages). NULL when out of
 * memory. */
void *kv_alloc_huge(uint64_t n);

/* The system's shmem THP mode, the bracketed word of
 * /sys/kernel/mm/transparent_hugepage/shmem_enabled as the kernel spells it (today's kernels:
 * never, advise, within_size, always, deny, force), copied into buf (cap bytes); "unknown" where
 * it cannot be read (no THP, no sysfs). Returns buf. A diagnostic: no kv_err, it cannot fail. */
const char *kv_shmem_thp_mode(char *buf, size_t cap);

/* 1 when shmem THP mode `mode` (as kv_shmem_thp_mode reads it) gives an advised mapping of a
 * memfd 2 MiB pages: advise, within_size, always, force; 0 for never, deny, unknown and any
 * other word. The one list kvd decides by (the start-up line, tier2-zero-copy auto). */
int kv_shmem_thp_huge(const char *mode);

/* 1 when the mapping that holds addr carries the huge-page advice (VmFlags `hg` in
 * /proc/self/smaps), 0 when it does not, -1 when that cannot be told (no such mapping, no
 * /proc). Reads smaps: for tests and diagnostics, not hot paths (a tri-state answer, not a
 * kv_err). */
int kv_map_advised_huge(const void *addr);

#endif
