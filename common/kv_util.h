/* kv_util: small helpers kvd, kvctl and libkvclient share, one definition each: the default
 * socket location and decimal and size parsing. Any thread. */
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

#endif
