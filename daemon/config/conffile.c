/* kvd_conf_lines: an in-place walk over config text, one line at a time (see conffile.h). */
#include "daemon/config/conffile.h"

#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

void kvd_conf_lines_init(kvd_conf_lines *it, char *text) {
    it->next = text;
    it->lineno = 0;
}

char *kvd_conf_trim(char *s) {
    while (*s == ' ' || *s == '\t') {
        s++;
    }
    size_t n = strlen(s);
    while (n > 0 && (s[n - 1] == ' ' || s[n - 1] == '\t' || s[n - 1] == '\r')) {
        s[--n] = '\0';
    }
    return s;
}

char *kvd_conf_lines_next(kvd_conf_lines *it) {
    /* strtok would skip empty lines and lose the line count; walk by hand. */
    while (it->next != NULL) {
        char *line = it->next;
        it->next = strchr(line, '\n');
        if (it->next != NULL) {
            *it->next++ = '\0';
        }
        it->lineno++;
        char *hash = strchr(line, '#');
        if (hash != NULL) {
            *hash = '\0';
        }
        char *l = kvd_conf_trim(line);
        if (*l != '\0') {
            return l;
        }
    }
    return NULL;
}

void kvd_conf_err(char *err, size_t errlen, const char *fmt, ...) {
    if (err == NULL || errlen == 0) {
        return;
    }
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}
