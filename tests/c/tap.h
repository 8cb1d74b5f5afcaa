/*
 * tests/c/tap.h - the C unit tests' one assertion: ok(cond, description)
 * prints a TAP line ("ok N - ..." / "not ok N - ..."), which tests/run.sh
 * counts. tap_done() prints the plan and returns the exit status.
 * Header-only: each test is one translation unit.
 */
#ifndef ML_TESTS_TAP_H
#define ML_TESTS_TAP_H

#include <stdarg.h>
#include <stdio.h>

static int ntests, nfailed;

__attribute__((format(printf, 2, 3)))
static void ok(int cond, const char *fmt, ...)
{
    va_list ap;
    ntests++;
    if (!cond)
        nfailed++;
    printf("%s %d - ", cond ? "ok" : "not ok", ntests);
    va_start(ap, fmt);
    vprintf(fmt, ap);
    va_end(ap);
    printf("\n");
}

static int tap_done(void)
{
    printf("1..%d\n", ntests);
    return nfailed ? 1 : 0;
}

#endif
