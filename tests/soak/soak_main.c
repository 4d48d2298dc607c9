/* soak_main: `./dev soak [seconds]` (bazel run //tests/soak:soak -- [options] [seconds]).
 * Options: --clients=N --tenants=N --deaths=PERMILLE --pool-memory=SIZE --segment-bytes=SIZE
 * --busy=N (CPU burners beside the workers) --tiers=1|2 (tier 1 and 2 on, write-back |
 * write-through; workers Fetch) --redis=PATH (with --tiers: a redis-server as kvd's remote tier)
 * --remote-write=write-back|write-through (with --redis: when kvd writes to Redis)
 * --block-major (block-major pools: with --tiers, T2 copies go with no copy) --kvd=PATH --wrap="CMD
 * ARGS" (run kvd under e.g. valgrind) -v. Exit 0 when every invariant held. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/soak/soak.h"

int main(int argc, char **argv) {
    soak_options o;
    soak_options_init(&o);
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strncmp(a, "--clients=", 10) == 0) {
            o.clients = atoi(a + 10);
        } else if (strncmp(a, "--tenants=", 10) == 0) {
            o.tenants = atoi(a + 10);
        } else if (strncmp(a, "--deaths=", 9) == 0) {
            o.death_permille = atoi(a + 9);
        } else if (strncmp(a, "--pool-memory=", 14) == 0) {
            o.pool_mem = a + 14;
        } else if (strncmp(a, "--segment-bytes=", 16) == 0) {
            o.seg_size = a + 16;
        } else if (strncmp(a, "--busy=", 7) == 0) {
            o.busy = atoi(a + 7);
        } else if (strncmp(a, "--tiers=", 8) == 0) {
            o.tiers = atoi(a + 8);
        } else if (strncmp(a, "--redis=", 8) == 0) {
            o.redis = a + 8;
        } else if (strncmp(a, "--remote-write=", 15) == 0) {
            o.remote_write = a + 15;
        } else if (strncmp(a, "--kvd=", 6) == 0) {
            o.kvd = a + 6;
        } else if (strncmp(a, "--wrap=", 7) == 0) {
            o.wrap = a + 7;
        } else if (strcmp(a, "--block-major") == 0) {
            o.block_major = 1;
        } else if (strcmp(a, "--events") == 0) {
            o.events = 1;
        } else if (strcmp(a, "-v") == 0) {
            o.verbose = 1;
        } else if (a[0] >= '0' && a[0] <= '9') {
            o.seconds = atoi(a);
        } else {
            fprintf(
                stderr,
                "usage: soak [--clients=N] [--tenants=N] [--deaths=PERMILLE] "
                "[--pool-memory=SIZE] [--segment-bytes=SIZE] [--busy=N] "
                "[--tiers=0|1|2] [--redis=PATH] [--remote-write=MODE] [--block-major] [--events] "
                "[--kvd=PATH] "
                "[--wrap=CMD] [-v] [seconds]\n");
            return 2;
        }
    }
    soak_result r;
    return soak_run(&o, &r) == 0 ? 0 : 1;
}
