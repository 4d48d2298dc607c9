/* man: the manual pages kvd(8) and kvctl(1), generated from the option table
 * (daemon/config) and the admin command table with kvctl's exit codes, so they cannot drift:
 * `kvd --print-man=kvd > docs/man/kvd.8`, `kvd --print-man=kvctl > docs/man/kvctl.1`;
 * man_test compares and lints them. */
#ifndef KVD_OPS_MAN_H
#define KVD_OPS_MAN_H

#include <stdio.h>

/* Writes page "kvd" or "kvctl" as man(7) roff to f; returns -1 (nothing written) for another
 * name. Deterministic (no dates). Any thread. */
int kvd_man_write(FILE *f, const char *page);

#endif
