/* kvd_reqtrace: the daemon's own request trace (reqtrace.h has the contract). */
#include "daemon/registry/reqtrace.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

struct kvd_reqtrace {
    FILE *f;
    kvd_reqtrace_stats st;
};

kv_err kvd_reqtrace_start(const char *path, uint64_t max_bytes, kvd_reqtrace **out, char *msg,
                          size_t len) {
    if (max_bytes == 0 || path == NULL || path[0] == '\0' || strlen(path) >= 512) {
        snprintf(msg, len, "trace: a path (under 512 bytes) and max-bytes > 0 are needed");
        return KV_EINVAL;
    }
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0) {
        snprintf(msg, len, "trace: cannot create %s: %s", path, strerror(errno));
        return KV_ESYS;
    }
    kvd_reqtrace *t = calloc(1, sizeof(*t));
    FILE *f = t != NULL ? fdopen(fd, "w") : NULL;
    if (f == NULL) {
        close(fd);
        (void)unlink(path);
        free(t);
        snprintf(msg, len, "trace: no memory");
        return KV_ENOMEM;
    }
    (void)setvbuf(f, NULL, _IOFBF, 1u << 20);
    t->f = f;
    snprintf(t->st.path, sizeof(t->st.path), "%s", path);
    t->st.max_bytes = max_bytes;
    int n = fprintf(f, "# kvd request trace: one Lookup or Fetch per line, its blocks' hashes in "
                       "prefix order (the pool id folded into each); core_bench --trace-file "
                       "replays it\n");
    t->st.bytes = n > 0 ? (uint64_t)n : 0;
    *out = t;
    return KV_OK;
}

void kvd_reqtrace_record(kvd_reqtrace *t, uint32_t pool_id, const kv_hash128 *h, size_t n) {
    if (t == NULL || t->st.full || n == 0) {
        return;
    }
    uint64_t need = (uint64_t)n * 33;
    if (t->st.bytes + need > t->st.max_bytes) {
        t->st.full = 1;
        return;
    }
    char word[33];
    for (size_t i = 0; i < n; i++) {
        kv_hash128 named = {h[i].lo ^ (uint64_t)pool_id * 0x9E3779B97F4A7C15ull, h[i].hi};
        kv_hash_hex(named, word); /* kvctl's form of a hash */
        word[32] = i + 1 < n ? ' ' : '\n';
        (void)fwrite(word, 1, 33, t->f);
    }
    t->st.bytes += need;
    t->st.requests++;
}

void kvd_reqtrace_stats_get(const kvd_reqtrace *t, kvd_reqtrace_stats *out) {
    memset(out, 0, sizeof(*out));
    if (t != NULL) {
        *out = t->st;
    }
}

kv_err kvd_reqtrace_stop(kvd_reqtrace *t, kvd_reqtrace_stats *out) {
    if (t == NULL) {
        return KV_OK;
    }
    if (out != NULL) {
        *out = t->st;
    }
    int bad = fflush(t->f) != 0;
    bad |= fclose(t->f) != 0;
    free(t);
    return bad ? KV_ESYS : KV_OK;
}
