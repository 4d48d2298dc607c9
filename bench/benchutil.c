/* benchutil: clock, errors, server processes and medians for bench/ (see benchutil.h). */
#include "bench/benchutil.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

double bench_now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

#define MAX_TRACKED 32

static pid_t tracked[MAX_TRACKED]; /* children bench_die kills; 0 = free slot */

void bench_track(pid_t pid) {
    for (int i = 0; i < MAX_TRACKED; i++) {
        if (tracked[i] == 0) {
            tracked[i] = pid;
            return;
        }
    }
}

static void untrack(pid_t pid) {
    for (int i = 0; i < MAX_TRACKED; i++) {
        if (tracked[i] == pid) {
            tracked[i] = 0;
        }
    }
}

void bench_die(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "%s: ", program_invocation_short_name);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    for (int i = 0; i < MAX_TRACKED; i++) {
        if (tracked[i] > 0) {
            kill(tracked[i], SIGKILL);
            waitpid(tracked[i], NULL, 0);
        }
    }
    exit(1);
}

int bench_unix_connect(const char *path) {
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path);
    if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
        if (fd >= 0) {
            close(fd);
        }
        return -1;
    }
    return fd;
}

int bench_admin(const char *path, const char *command, char *out, size_t len) {
    int fd = bench_unix_connect(path);
    if (fd < 0 || len == 0) {
        if (fd >= 0) {
            close(fd);
        }
        return -1;
    }
    char line[256];
    int n = snprintf(line, sizeof(line), "%s\n", command);
    size_t got = 0;
    int rc = n > 0 && (size_t)n < sizeof(line) && write(fd, line, (size_t)n) == n ? 0 : -1;
    while (rc == 0 && (got == 0 || out[got - 1] != '\n')) {
        if (got + 1 >= len) {
            rc = -1; /* the reply does not fit */
            break;
        }
        ssize_t r = read(fd, out + got, len - 1 - got);
        if (r <= 0) {
            rc = -1;
            break;
        }
        got += (size_t)r;
    }
    out[got] = '\0';
    close(fd);
    return rc;
}

int bench_admin_stat(const char *path, const char *section, const char *field, uint64_t *out) {
    static char reply[1 << 16];
    char sec[64], key[64];
    snprintf(sec, sizeof(sec), "\"%s\":[", section);
    snprintf(key, sizeof(key), "\"%s\":", field);
    if (bench_admin(path, "stats", reply, sizeof(reply)) != 0) {
        return -1;
    }
    const char *s = strstr(reply, sec);
    const char *v = s != NULL ? strstr(s, key) : NULL;
    if (v == NULL) {
        return -1;
    }
    *out = strtoull(v + strlen(key), NULL, 10);
    return 0;
}

pid_t bench_spawn(char *const argv[]) {
    pid_t pid = fork();
    if (pid < 0) {
        bench_die("fork: %s", strerror(errno));
    }
    if (pid == 0) {
        int null = open("/dev/null", O_WRONLY);
        if (null >= 0) {
            dup2(null, 1);
        }
        execvp(argv[0], argv);
        fprintf(stderr, "%s: exec %s: %s\n", program_invocation_short_name, argv[0],
                strerror(errno));
        _exit(127);
    }
    bench_track(pid);
    return pid;
}

void bench_wait_socket(const char *path, pid_t pid) {
    for (int i = 0; i < 1000; i++) {
        int fd = bench_unix_connect(path);
        if (fd >= 0) {
            close(fd);
            return;
        }
        int st;
        if (waitpid(pid, &st, WNOHANG) == pid) {
            bench_die("the server for %s exited during start", path);
        }
        usleep(10000);
    }
    bench_die("the server for %s did not start within 10 s", path);
}

int bench_stop(pid_t pid) {
    if (pid <= 0) {
        return 0;
    }
    untrack(pid);
    kill(pid, SIGTERM);
    int st;
    if (waitpid(pid, &st, 0) != pid || !WIFEXITED(st)) {
        return -1;
    }
    return WEXITSTATUS(st);
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

double bench_median(double *v, size_t n) {
    if (n == 0) {
        return 0;
    }
    qsort(v, n, sizeof(*v), cmp_double);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

double bench_lower_quartile(double *v, size_t n) {
    if (n == 0) {
        return 0;
    }
    qsort(v, n, sizeof(*v), cmp_double);
    double at = (double)(n - 1) * 0.25;
    size_t lo = (size_t)at;
    double f = at - (double)lo;
    return lo + 1 < n ? v[lo] + (v[lo + 1] - v[lo]) * f : v[lo];
}

static uint64_t task_cpu_ns(pid_t pid, const char *tid) {
    char path[96];
    snprintf(path, sizeof(path), "/proc/%d/task/%s/schedstat", (int)pid, tid);
    FILE *f = fopen(path, "r");
    unsigned long long ns = 0;
    if (f != NULL) {
        if (fscanf(f, "%llu", &ns) != 1) {
            ns = 0;
        }
        fclose(f);
    }
    return ns;
}

uint64_t bench_cpu_ns(pid_t pid, int loop) {
    char tid[24];
    if (loop) {
        snprintf(tid, sizeof(tid), "%d", (int)pid);
        return task_cpu_ns(pid, tid);
    }
    char dir[64];
    snprintf(dir, sizeof(dir), "/proc/%d/task", (int)pid);
    DIR *d = opendir(dir);
    if (d == NULL) {
        return 0;
    }
    uint64_t sum = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] != '.') {
            sum += task_cpu_ns(pid, e->d_name);
        }
    }
    closedir(d);
    return sum;
}
