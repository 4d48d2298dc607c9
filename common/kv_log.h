/* kv_log: level-checked logging with stable message ids.
 *
 * KV_LOG(WARN, "KVD-CONN-PROTO", "fmt", ...) formats only when the level is enabled. Output goes
 * to a sink: the daemon's default writes one line to stderr; libkvclient installs the
 * application's callback instead and never writes to stderr itself.
 */
#ifndef KV_LOG_H
#define KV_LOG_H

typedef enum kv_log_level {
    KV_LOG_ERROR = 0,
    KV_LOG_WARN = 1,
    KV_LOG_INFO = 2,
    KV_LOG_DEBUG = 3,
} kv_log_level;

/* Receives every enabled message; msg is formatted, without trailing newline. */
typedef void (*kv_log_sink)(void *arg, kv_log_level level, const char *id, const char *msg);

/* Current threshold: messages with level <= this are emitted. */
extern kv_log_level kv_log_threshold;

/* Replace the sink (NULL silences). Call before other threads log. */
void kv_log_set_sink(kv_log_sink sink, void *arg);

/* Writes "LEVEL ID msg" lines to stderr with a timestamp; the daemon's default sink. */
void kv_log_stderr_sink(void *arg, kv_log_level level, const char *id, const char *msg);

/* Parses "error|warn|info|debug"; returns 0 and writes *out on success, -1 otherwise. */
int kv_log_level_parse(const char *s, kv_log_level *out);
const char *kv_log_level_name(kv_log_level level);

void kv_log_emit(kv_log_level level, const char *id, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

#define KV_LOG(level, id, ...)                                                                     \
    do {                                                                                           \
        if (KV_LOG_##level <= kv_log_threshold) {                                                  \
            kv_log_emit(KV_LOG_##level, id, __VA_ARGS__);                                          \
        }                                                                                          \
    } while (0)

/* Always-on invariant check: logs file and line, then aborts. For broken internal invariants
 * only; bad input from a peer gets an error code instead. */
#define KV_ASSERT(cond)                                                                            \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            kv_assert_fail(#cond, __FILE__, __LINE__);                                             \
        }                                                                                          \
    } while (0)

void kv_assert_fail(const char *expr, const char *file, int line) __attribute__((noreturn));

#endif
