/* kv_log: the process-wide log threshold and sink. */
#include "common/kv_log.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

kv_log_level kv_log_threshold = KV_LOG_INFO;
static kv_log_sink log_sink = kv_log_stderr_sink;
static void *log_sink_arg;

static const char *const level_names[] = {"error", "warn", "info", "debug"};

void kv_log_set_sink(kv_log_sink sink, void *arg) {
    log_sink = sink;
    log_sink_arg = arg;
}

const char *kv_log_level_name(kv_log_level level) {
    if ((unsigned)level > KV_LOG_DEBUG) {
        return "unknown";
    }
    return level_names[level];
}

int kv_log_level_parse(const char *s, kv_log_level *out) {
    for (int i = 0; i <= KV_LOG_DEBUG; i++) {
        if (strcmp(s, level_names[i]) == 0) {
            *out = (kv_log_level)i;
            return 0;
        }
    }
    return -1;
}

void kv_log_stderr_sink(void *arg, kv_log_level level, const char *id, const char *msg) {
    (void)arg;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct tm tm;
    gmtime_r(&ts.tv_sec, &tm);
    fprintf(stderr, "%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ %-5s %s %s\n", tm.tm_year + 1900,
            tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, ts.tv_nsec / 1000000,
            kv_log_level_name(level), id, msg);
}

void kv_log_emit(kv_log_level level, const char *id, const char *fmt, ...) {
    if (log_sink == NULL) {
        return;
    }
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof(buf), fmt, ap);
    va_end(ap);
    log_sink(log_sink_arg, level, id, buf);
}

void kv_assert_fail(const char *expr, const char *file, int line) {
    fprintf(stderr, "kvd: assertion failed: %s at %s:%d\n", expr, file, line);
    abort();
}
