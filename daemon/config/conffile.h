/* kvd_conf_lines: the line walk shared by kvd's text config formats (the `name = value` config
 * file of config.c and the tenants file of tenant.c).
 *
 * Both formats are lines with `#` comments to the end of the line, blanks (space, tab, CR)
 * around the content ignored, and errors that name the 1-based line number. The iterator walks
 * a caller-owned, writable NUL-terminated text in place (it writes NULs into it) and hands out
 * each line that has content left after the comment and the blanks are stripped. No
 * allocation; no state beyond the caller's kvd_conf_lines; any thread (one iterator, one
 * thread).
 */
#ifndef KVD_CONFFILE_H
#define KVD_CONFFILE_H

#include <stddef.h>

typedef struct kvd_conf_lines {
    char *next;      /* start of the next unread line; NULL once the text is used up */
    unsigned lineno; /* 1-based number of the line kvd_conf_lines_next last returned */
} kvd_conf_lines;

/* Starts a walk over `text` (writable, NUL-terminated; stays the caller's and must outlive the
 * walk). Never fails. */
void kvd_conf_lines_init(kvd_conf_lines *it, char *text);

/* Returns the next line that is not empty once its `#` comment is cut off and blanks (space,
 * tab, CR) at both ends are trimmed, with it->lineno set to its number (empty lines count);
 * NULL at the end of the text. The line points into the text, NUL-terminated in place. */
char *kvd_conf_lines_next(kvd_conf_lines *it);

/* Trims space, tab and CR from the end of `s` in place and returns the first byte that is not
 * a space or tab. `s` stays the caller's; never fails. */
char *kvd_conf_trim(char *s);

/* Formats an error message into err[0..errlen) (truncated, always NUL-terminated); does nothing
 * when err is NULL or errlen is 0. The error reporting both parsers share. */
void kvd_conf_err(char *err, size_t errlen, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

#endif
