/* kvctl exit codes: one X-macro list used by kvctl and by the generator of docs/ADMIN.md, so
 * the documented codes are the ones kvctl returns. Numbers are stable (scripts test them).
 */
#ifndef KVCTL_EXIT_CODES_H
#define KVCTL_EXIT_CODES_H

#define KVCTL_EXIT_MAP(X)                                                                          \
    X(OK, 0, "the command succeeded (for `ready`: kvd is ready)")                                  \
    X(ERROR, 1, "kvd answered with an error (the JSON error's code is printed)")                   \
    X(USAGE, 2, "bad kvctl usage (unknown flag, missing argument)")                                \
    X(CONNECT, 3, "cannot connect to the admin socket (kvd not running, wrong path, permission)")  \
    X(PROTO, 4, "kvd's reply was not one JSON object line (version mismatch or bug)")              \
    X(NOTREADY, 5, "`ready` only: kvd answers but is not ready (draining or stopping)")

typedef enum kvctl_exit {
#define KVCTL_EXIT_ENUM(name, num, desc) KVCTL_EXIT_##name = num,
    KVCTL_EXIT_MAP(KVCTL_EXIT_ENUM)
#undef KVCTL_EXIT_ENUM
} kvctl_exit;

#endif
