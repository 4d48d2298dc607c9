/* benchutil: what the benchmark programs under bench/ share: a monotonic clock, fatal errors,
 * starting a server process and waiting for its Unix socket, kvd's admin socket, and medians.
 * Not for tests or the daemon; every call is for one benchmark process (single thread unless
 * said otherwise).
 */
#ifndef KVD_BENCHUTIL_H
#define KVD_BENCHUTIL_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

/* Seconds of CLOCK_MONOTONIC. Any thread. */
double bench_now_s(void);

/* Prints "<program>: <message>" on stderr, kills the processes started by bench_spawn (or given
 * to bench_track) that were not stopped yet, and exits 1: a failed benchmark leaves no server
 * behind. */
void bench_die(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));

/* A connected blocking Unix stream socket to path, or -1. Any thread. */
int bench_unix_connect(const char *path);

/* One kvd admin command (a line) on the admin socket at path; its one-line JSON reply goes to
 * out (NUL-terminated, cut at len - 1). 0, or -1 when the socket cannot be reached or the reply
 * does not arrive whole. */
int bench_admin(const char *path, const char *command, char *out, size_t len);

/* The first `field` of the first object in the `section` array of kvd's admin `stats` (a
 * counter) on the admin socket at path. 0, or -1 when it cannot be read. */
int bench_admin_stat(const char *path, const char *section, const char *field, uint64_t *out);

/* Forks and execs argv (argv[0] searched on PATH) with stdout sent to /dev/null; returns the
 * child's pid (bench_die when fork fails). The child is tracked (bench_track). */
pid_t bench_spawn(char *const argv[]);

/* Adds a child started otherwise (fork) to the processes bench_die kills. At most 32 are kept. */
void bench_track(pid_t pid);

/* Waits up to 10 s until the Unix socket path accepts; bench_die when pid exits first or the
 * time runs out. */
void bench_wait_socket(const char *path, pid_t pid);

/* SIGTERM to pid and waits for it (and stops tracking it); returns its exit status, or -1 when
 * it did not exit normally. Does nothing (returns 0) for pid <= 0. */
int bench_stop(pid_t pid);

/* Median of v[0..n) (sorts v in place); 0 for n == 0. */
double bench_median(double *v, size_t n);

/* The lower quartile of v[0..n) (sorts v in place): the value a quarter of the way up the sorted
 * values, interpolated between the two it falls between; 0 for n == 0. A target is met when the
 * worse quartile of its runs meets it (bench/RESULTS.md says which figure each table reports). */
double bench_lower_quartile(double *v, size_t n);

/* CPU time of a process in ns, from the scheduler's own count (/proc/PID/task/TID/schedstat,
 * ns resolution, where /proc/PID/stat counts 10 ms ticks): of its main thread only (loop 1:
 * a kvd's loop thread) or of all its threads (loop 0). 0 when it cannot be read. */
uint64_t bench_cpu_ns(pid_t pid, int loop);

#endif
