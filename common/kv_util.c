#include "common/kv_util.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int kv_default_socket_path(const char *file, char *buf, size_t cap) {
    const char *xdg = getenv("XDG_RUNTIME_DIR");
    int n = xdg != NULL && xdg[0] != '\0'
                ? snprintf(buf, cap, "%s/kvd/%s", xdg, file)
                : snprintf(buf, cap, "/tmp/kvd-%u/%s", (unsigned)getuid(), file);
    return n < 0 || (size_t)n >= cap ? -1 : 0;
}

int kv_parse_u64(const char *s, const char **end, uint64_t *out) {
    if (s == NULL || *s < '0' || *s > '9') {
        return -1;
    }
    errno = 0;
    char *e;
    unsigned long long v = strtoull(s, &e, 10);
    if (errno != 0) {
        return -1;
    }
    if (end != NULL) {
        *end = e;
    }
    *out = v;
    return 0;
}

int kv_parse_size(const char *s, uint64_t *out) {
    const char *end;
    uint64_t v;
    if (kv_parse_u64(s, &end, &v) != 0) {
        return -1;
    }
    unsigned shift = 0;
    switch (*end) {
        case 'k':
        case 'K':
            shift = 10;
            break;
        case 'm':
        case 'M':
            shift = 20;
            break;
        case 'g':
        case 'G':
            shift = 30;
            break;
        case 't':
        case 'T':
            shift = 40;
            break;
        case '\0':
            break;
        default:
            return -1;
    }
    if (shift != 0) {
        end++;
        if (strcmp(end, "iB") == 0 || strcmp(end, "B") == 0) {
            end += strlen(end);
        }
        if (v > (UINT64_MAX >> shift)) {
            return -1;
        }
        v <<= shift;
    }
    if (*end != '\0') {
        return -1;
    }
    *out = v;
    return 0;
}
