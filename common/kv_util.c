#include "common/kv_util.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
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

int kv_map_advise_huge(void *base, uint64_t bytes) {
    if (base == NULL || bytes == 0) {
        return 0;
    }
    return madvise(base, (size_t)bytes, MADV_HUGEPAGE) == 0 ? 0 : -1;
}

void *kv_alloc_huge(uint64_t n) {
    const uint64_t huge = 2ull << 20;
    if (n == 0 || n > SIZE_MAX - huge) {
        return NULL;
    }
    if (n < huge) {
        return aligned_alloc(4096, (size_t)((n + 4095) / 4096 * 4096));
    }
    /* aligned_alloc wants a size that is a multiple of the alignment; the tail past n is only
     * touched where the caller touches it (and then as small pages: the advice covers n). */
    void *p = aligned_alloc((size_t)huge, (size_t)((n + huge - 1) / huge * huge));
    if (p != NULL) {
        (void)kv_map_advise_huge(p, (n + 4095) / 4096 * 4096);
    }
    return p;
}

const char *kv_shmem_thp_mode(char *buf, size_t cap) {
    char line[128] = "";
    FILE *f = fopen("/sys/kernel/mm/transparent_hugepage/shmem_enabled", "r");
    if (f != NULL) {
        if (fgets(line, sizeof(line), f) == NULL) {
            line[0] = '\0';
        }
        fclose(f);
    }
    const char *a = strchr(line, '[');
    const char *b = a != NULL ? strchr(a, ']') : NULL;
    if (a == NULL || b == NULL || b == a + 1) {
        snprintf(buf, cap, "unknown");
    } else {
        snprintf(buf, cap, "%.*s", (int)(b - a - 1), a + 1);
    }
    return buf;
}

int kv_shmem_thp_huge(const char *mode) {
    static const char *const huge[] = {"advise", "within_size", "always", "force"};
    for (size_t i = 0; i < sizeof(huge) / sizeof(huge[0]); i++) {
        if (strcmp(mode, huge[i]) == 0) {
            return 1;
        }
    }
    return 0;
}

int kv_map_advised_huge(const void *addr) {
    FILE *f = fopen("/proc/self/smaps", "r");
    if (f == NULL) {
        return -1;
    }
    char *line = NULL; /* getline: a header line with a long path comes whole */
    size_t cap = 0;
    int in = 0;
    int found = -1;
    uintptr_t a = (uintptr_t)addr;
    while (found < 0 && getline(&line, &cap, f) > 0) {
        unsigned long lo;
        unsigned long hi;
        /* A mapping's first line: "lo-hi perms offset dev inode path"; its fields follow. */
        if (line[strspn(line, "0123456789abcdef")] == '-' &&
            sscanf(line, "%lx-%lx ", &lo, &hi) == 2) {
            in = a >= lo && a < hi;
        } else if (in && strncmp(line, "VmFlags:", 8) == 0) {
            found = strstr(line, " hg") != NULL ? 1 : 0; /* flags are two letters each */
        }
    }
    free(line);
    fclose(f);
    return found;
}
