/*
 * tests/c/test_ledger.c - the memory ledger's bookkeeping (host/runtime/ledger.c),
 * printing TAP.
 *
 * Covers: charge/credit counts, per-category and total peaks, the breakdown
 * at the total peak, total and per-category budgets (including requests near
 * SIZE_MAX that would wrap a naive sum; on a caching ledger the total budget
 * also bounds reserved + the reservation's growth, 0 for a cache hit),
 * reset_peak, reserved bytes with and without a caching allocator, the
 * timeline (cap, interval, dropped samples, off), the text report, byte
 * formatting, and the abort on a credit underflow. Not here: allocation
 * (host/runtime/tensor.c, host/runtime/pool.c) and the Lua face (tests/spec/mem_spec.lua).
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ledger.h"
#include "tap.h"


static int all_zero(const size_t *v)
{
    for (int c = 0; c < ML_NCAT; c++)
        if (v[c])
            return 0;
    return 1;
}

static void test_init(void)
{
    ml_ledger lg;
    ml_ledger_init(&lg, "cpu");
    ok(lg.total == 0 && lg.total_peak == 0 && all_zero(lg.cur) && all_zero(lg.peak) &&
       all_zero(lg.at_peak) && lg.budget_total == 0 && lg.cap == 0 && lg.samples == NULL,
       "init: an empty ledger with no budget and no timeline");
    ok(strcmp(lg.device, "cpu") == 0, "init: the device name is kept");
    ml_ledger_free(&lg);
}

static void test_charge_credit(void)
{
    ml_ledger lg;
    ml_ledger_init(&lg, "cpu");
    ml_ledger_charge(&lg, ML_CAT_PARAMS, 100);
    ml_ledger_charge(&lg, ML_CAT_PARAMS, 20);
    ml_ledger_charge(&lg, ML_CAT_ACTS, 7);
    ok(lg.cur[ML_CAT_PARAMS] == 120 && lg.cur[ML_CAT_ACTS] == 7 && lg.total == 127,
       "charge: current bytes per category and in total");
    ok(lg.nalloc[ML_CAT_PARAMS] == 2 && lg.nalloc[ML_CAT_ACTS] == 1 && lg.nfree[ML_CAT_PARAMS] == 0,
       "charge: allocation counts per category");
    ml_ledger_credit(&lg, ML_CAT_PARAMS, 100);
    ok(lg.cur[ML_CAT_PARAMS] == 20 && lg.total == 27 && lg.nfree[ML_CAT_PARAMS] == 1,
       "credit: bytes and free count go back");
    ok(lg.peak[ML_CAT_PARAMS] == 120 && lg.total_peak == 127, "credit: peaks stay");
    ok(lg.reserved == 27 && lg.reserved_peak == 127,
       "reserved: follows total on a non-caching ledger (CPU), with its peak");
    ml_ledger_credit(&lg, ML_CAT_PARAMS, 20);
    ml_ledger_credit(&lg, ML_CAT_ACTS, 7);
    ok(lg.total == 0 && all_zero(lg.cur), "credit: everything back to zero");
    ml_ledger_charge(&lg, ML_CAT_OTHER, 0);
    ok(lg.total == 0 && lg.nalloc[ML_CAT_OTHER] == 1, "charge: a zero-byte allocation is counted");
    ml_ledger_free(&lg);
}

static void test_reserved_caching(void)
{
    ml_ledger lg;
    ml_ledger_init(&lg, "cuda");
    lg.caching = 1;
    ml_ledger_set_reserved(&lg, 4096);     /* the allocator took a 4 KiB segment */
    ml_ledger_charge(&lg, ML_CAT_ACTS, 1000);
    ok(lg.reserved == 4096, "caching: a charge inside the reserved bytes leaves reserved alone");
    ml_ledger_credit(&lg, ML_CAT_ACTS, 1000);
    ok(lg.reserved == 4096 && lg.total == 0, "caching: a credit keeps the bytes reserved (cached)");
    ml_ledger_charge(&lg, ML_CAT_ACTS, 5000);
    ok(lg.reserved == 5000 && lg.reserved_peak == 5000,
       "caching: reserved is never below total, peak follows");
    ml_ledger_set_reserved(&lg, 8192);
    ml_ledger_set_reserved(&lg, 6000);
    ok(lg.reserved == 6000 && lg.reserved_peak == 8192, "set_reserved: current and peak reserved");
    ml_ledger_credit(&lg, ML_CAT_ACTS, 5000);
    ml_ledger_free(&lg);
}

static void test_peaks(void)
{
    ml_ledger lg;
    ml_ledger_init(&lg, "cpu");
    ml_ledger_charge(&lg, ML_CAT_PARAMS, 100);
    ml_ledger_charge(&lg, ML_CAT_ACTS, 50);        /* total 150: the peak */
    ml_ledger_credit(&lg, ML_CAT_PARAMS, 100);
    ml_ledger_charge(&lg, ML_CAT_ACTS, 80);        /* total 130 < 150, acts 130 */
    ok(lg.total_peak == 150, "peak: the total peak is the maximum total");
    ok(lg.peak[ML_CAT_ACTS] == 130 && lg.peak[ML_CAT_PARAMS] == 100,
       "peak: each category keeps its own peak");
    ok(lg.at_peak[ML_CAT_PARAMS] == 100 && lg.at_peak[ML_CAT_ACTS] == 50,
       "at_peak: the breakdown at the moment of the total peak, not the category peaks");
    ml_ledger_charge(&lg, ML_CAT_GRADS, 30);       /* total 160: a new peak */
    ok(lg.total_peak == 160 && lg.at_peak[ML_CAT_PARAMS] == 0 && lg.at_peak[ML_CAT_ACTS] == 130 &&
       lg.at_peak[ML_CAT_GRADS] == 30, "at_peak: replaced when the total crosses its peak");
    size_t sum = 0;
    for (int c = 0; c < ML_NCAT; c++)
        sum += lg.at_peak[c];
    ok(sum == lg.total_peak, "at_peak: sums to the total peak");

    ml_ledger_credit(&lg, ML_CAT_ACTS, 130);
    ml_ledger_reset_peak(&lg);
    ok(lg.total_peak == 30 && lg.peak[ML_CAT_ACTS] == 0 && lg.peak[ML_CAT_GRADS] == 30 &&
       lg.at_peak[ML_CAT_GRADS] == 30 && lg.at_peak[ML_CAT_ACTS] == 0,
       "reset_peak: peaks and breakdown become the current values");
    ok(lg.reserved_peak == lg.reserved, "reset_peak: the reserved peak too");
    ml_ledger_charge(&lg, ML_CAT_OPTIM, 5);
    ok(lg.total_peak == 35 && lg.at_peak[ML_CAT_OPTIM] == 5, "reset_peak: peaks count again from there");
    ml_ledger_free(&lg);
}

static void test_budgets(void)
{
    ml_ledger lg;
    ml_ledger_init(&lg, "cpu");
    ok(ml_ledger_check(&lg, ML_CAT_OTHER, SIZE_MAX, SIZE_MAX) == ML_LEDGER_OK,
       "budget: none set, anything fits");

    lg.budget_total = 1000;
    ml_ledger_charge(&lg, ML_CAT_PARAMS, 900);
    ok(ml_ledger_check(&lg, ML_CAT_ACTS, 100, 100) == ML_LEDGER_OK, "budget total: exactly up to the budget fits");
    ok(ml_ledger_check(&lg, ML_CAT_ACTS, 101, 101) == ML_LEDGER_OVER_TOTAL, "budget total: one byte over is refused");
    ok(ml_ledger_check(&lg, ML_CAT_ACTS, SIZE_MAX, SIZE_MAX) == ML_LEDGER_OVER_TOTAL,
       "budget total: SIZE_MAX is refused");
    ok(ml_ledger_check(&lg, ML_CAT_ACTS, SIZE_MAX - 850, SIZE_MAX - 850) == ML_LEDGER_OVER_TOTAL,
       "budget total: a request that wraps total + n is refused");
    ok(lg.total == 900 && lg.cur[ML_CAT_ACTS] == 0, "budget: check counts nothing");

    lg.budget[ML_CAT_PARAMS] = 950;
    ok(ml_ledger_check(&lg, ML_CAT_PARAMS, 50, 50) == ML_LEDGER_OK, "budget category: up to it fits");
    ok(ml_ledger_check(&lg, ML_CAT_PARAMS, 51, 51) == ML_LEDGER_OVER_CATEGORY,
       "budget category: over the category, under the total");
    ok(ml_ledger_check(&lg, ML_CAT_ACTS, 51, 51) == ML_LEDGER_OK,
       "budget category: other categories are not limited by it");
    ok(ml_ledger_check(&lg, ML_CAT_PARAMS, 200, 200) == ML_LEDGER_OVER_TOTAL,
       "budget: over both reports the total");

    lg.budget_total = 0;
    ok(ml_ledger_check(&lg, ML_CAT_PARAMS, SIZE_MAX - 100, SIZE_MAX - 100) == ML_LEDGER_OVER_CATEGORY,
       "budget category: a request that wraps cur + n is refused");
    ok(ml_ledger_check(&lg, ML_CAT_PARAMS, SIZE_MAX, SIZE_MAX) == ML_LEDGER_OVER_CATEGORY,
       "budget category: SIZE_MAX is refused");
    lg.budget[ML_CAT_PARAMS] = SIZE_MAX;
    ok(ml_ledger_check(&lg, ML_CAT_PARAMS, SIZE_MAX - 900, SIZE_MAX - 900) == ML_LEDGER_OK &&
       ml_ledger_check(&lg, ML_CAT_PARAMS, SIZE_MAX - 899, SIZE_MAX - 899) == ML_LEDGER_OVER_CATEGORY,
       "budget category: a SIZE_MAX budget is exact at its edge");
    lg.budget_total = SIZE_MAX - 1;
    ok(ml_ledger_check(&lg, ML_CAT_ACTS, SIZE_MAX - 901, SIZE_MAX - 901) == ML_LEDGER_OK &&
       ml_ledger_check(&lg, ML_CAT_ACTS, SIZE_MAX - 900, SIZE_MAX - 900) == ML_LEDGER_OVER_TOTAL,
       "budget total: a budget near SIZE_MAX is exact at its edge");
    lg.budget_total = 500;   /* already above a lowered budget */
    ok(ml_ledger_check(&lg, ML_CAT_ACTS, 0, 0) == ML_LEDGER_OVER_TOTAL &&
       ml_ledger_check(&lg, ML_CAT_ACTS, 1, 1) == ML_LEDGER_OVER_TOTAL,
       "budget total: lowered below the current total, nothing more fits");
    ml_ledger_free(&lg);
}

/* A caching ledger: the total budget bounds max(total + n, reserved + grow). */
static void test_budgets_caching(void)
{
    ml_ledger lg;
    ml_ledger_init(&lg, "cuda");
    lg.caching = 1;
    ml_ledger_set_reserved(&lg, 8192);            /* two 4 KiB blocks, one cached */
    ml_ledger_charge(&lg, ML_CAT_ACTS, 4000);
    lg.budget_total = 10000;
    ok(ml_ledger_check(&lg, ML_CAT_ACTS, 4000, 0) == ML_LEDGER_OK,
       "budget caching: a request a cached block serves fits (max(total, reserved) + n would not)");
    ok(ml_ledger_check(&lg, ML_CAT_ACTS, 4000, 4096) == ML_LEDGER_OVER_TOTAL,
       "budget caching: the same request needing a new block is refused");
    ok(ml_ledger_check(&lg, ML_CAT_ACTS, 100, 1808) == ML_LEDGER_OK &&
       ml_ledger_check(&lg, ML_CAT_ACTS, 100, 1809) == ML_LEDGER_OVER_TOTAL,
       "budget caching: reserved + grow is exact at the budget");
    ok(ml_ledger_check(&lg, ML_CAT_ACTS, 6000, 0) == ML_LEDGER_OK &&
       ml_ledger_check(&lg, ML_CAT_ACTS, 6001, 0) == ML_LEDGER_OVER_TOTAL,
       "budget caching: total + n still bounds a request a cached block serves");
    ok(ml_ledger_check(&lg, ML_CAT_ACTS, 0, SIZE_MAX) == ML_LEDGER_OVER_TOTAL &&
       ml_ledger_check(&lg, ML_CAT_ACTS, 0, SIZE_MAX - 4000) == ML_LEDGER_OVER_TOTAL,
       "budget caching: a growth that wraps reserved + grow is refused");
    lg.budget_total = SIZE_MAX - 1;
    ok(ml_ledger_check(&lg, ML_CAT_ACTS, 0, SIZE_MAX - 8193) == ML_LEDGER_OK &&
       ml_ledger_check(&lg, ML_CAT_ACTS, 0, SIZE_MAX - 8192) == ML_LEDGER_OVER_TOTAL,
       "budget caching: a total budget near SIZE_MAX is exact at its edge");
    lg.budget_total = 10000;
    lg.budget[ML_CAT_ACTS] = 5000;
    ok(ml_ledger_check(&lg, ML_CAT_ACTS, 1000, 0) == ML_LEDGER_OK &&
       ml_ledger_check(&lg, ML_CAT_ACTS, 1001, 0) == ML_LEDGER_OVER_CATEGORY,
       "budget caching: the category budget bounds n, a cache hit or not");
    lg.budget_total = 0;
    ok(ml_ledger_check(&lg, ML_CAT_ACTS, 1000, SIZE_MAX) == ML_LEDGER_OK,
       "budget caching: grow counts against no category budget");
    ml_ledger_credit(&lg, ML_CAT_ACTS, 4000);
    ml_ledger_free(&lg);

    ml_ledger_init(&lg, "cpu");
    ml_ledger_charge(&lg, ML_CAT_ACTS, 900);
    lg.budget_total = 1000;
    ok(ml_ledger_check(&lg, ML_CAT_ACTS, 100, SIZE_MAX) == ML_LEDGER_OK &&
       ml_ledger_check(&lg, ML_CAT_ACTS, 101, 0) == ML_LEDGER_OVER_TOTAL,
       "budget: a non-caching ledger bounds total + n and ignores grow");
    ml_ledger_free(&lg);
}

static void test_timeline(void)
{
    ml_ledger lg;
    ml_ledger_init(&lg, "cpu");
    ml_ledger_charge(&lg, ML_CAT_OTHER, 1);       /* timeline off: nothing kept */
    ok(lg.nsamples == 0 && lg.ndropped == 0, "timeline: off by default");

    ok(ml_ledger_timeline(&lg, 3, 0) == 0 && lg.nsamples == 1 && lg.samples[0].bytes[ML_CAT_OTHER] == 1,
       "timeline: starting takes a first sample of the current state");
    ml_ledger_charge(&lg, ML_CAT_PARAMS, 10);
    ml_ledger_credit(&lg, ML_CAT_OTHER, 1);
    ok(lg.nsamples == 3, "timeline: interval 0 samples every change");
    ok(lg.samples[1].bytes[ML_CAT_PARAMS] == 10 && lg.samples[1].bytes[ML_CAT_OTHER] == 1 &&
       lg.samples[2].bytes[ML_CAT_PARAMS] == 10 && lg.samples[2].bytes[ML_CAT_OTHER] == 0,
       "timeline: samples hold the bytes per category after each change");
    ok(lg.samples[0].t >= 0 && lg.samples[1].t >= lg.samples[0].t && lg.samples[2].t >= lg.samples[1].t,
       "timeline: times are non-decreasing seconds since the ledger started");
    ml_ledger_charge(&lg, ML_CAT_PARAMS, 10);
    ml_ledger_charge(&lg, ML_CAT_PARAMS, 10);
    ok(lg.nsamples == 3 && lg.ndropped == 2, "timeline: past the cap samples are counted as dropped");

    ok(ml_ledger_timeline(&lg, 10, 3600.0) == 0 && lg.nsamples == 1 && lg.ndropped == 0,
       "timeline: restarting clears samples and the dropped count");
    for (int i = 0; i < 5; i++)
        ml_ledger_charge(&lg, ML_CAT_ACTS, 1);
    ok(lg.nsamples == 1 && lg.ndropped == 0, "timeline: at most one sample per interval");

    ok(ml_ledger_timeline(&lg, 0, 0) == 0 && lg.samples == NULL && lg.cap == 0,
       "timeline: cap 0 turns it off");
    ml_ledger_charge(&lg, ML_CAT_ACTS, 1);
    ok(lg.nsamples == 0 && lg.ndropped == 0, "timeline: off again, changes are not sampled");
    ml_ledger_free(&lg);
}

static void test_format(void)
{
    ml_ledger lg;
    char buf[4096], small[16];
    ml_ledger_init(&lg, "cuda");
    ml_ledger_charge(&lg, ML_CAT_POOL, 3 << 20);
    lg.budget[ML_CAT_POOL] = (size_t)8 << 20;
    lg.budget_total = (size_t)1 << 30;
    size_t n = ml_ledger_format(&lg, 0, 0, buf, sizeof buf);
    ok(n == strlen(buf) && n > 0, "format: returns the length written");
    int all = 1;
    for (int c = 0; c < ML_NCAT; c++)
        all &= strstr(buf, ml_category_names[c]) != NULL;
    ok(all, "format: every category is listed");
    ok(strstr(buf, "memory ledger (cuda)") && strstr(buf, "total") && strstr(buf, "peak") &&
       strstr(buf, "at peak") && strstr(buf, "budget"), "format: the header names device and columns");
    ok(strstr(buf, "3.00 MiB") && strstr(buf, "8.00 MiB") && strstr(buf, "1.00 GiB"),
       "format: bytes, category budget and total budget appear");
    ok(!strstr(buf, "untracked"), "format: no untracked line unless asked");
    ml_ledger_format(&lg, 5 << 10, 1, buf, sizeof buf);
    ok(strstr(buf, "untracked (RSS - ledger): 5.00 KiB") != NULL, "format: the untracked remainder");
    size_t need = ml_ledger_format(&lg, 5 << 10, 1, small, sizeof small);
    ok(need == strlen(buf) && strlen(small) == sizeof small - 1 && strncmp(small, buf, sizeof small - 1) == 0,
       "format: a short buffer is truncated, NUL-terminated, and the full length returned");
    lg.caching = 1;
    ml_ledger_set_reserved(&lg, (size_t)4 << 20);
    ml_ledger_format(&lg, 0, 0, buf, sizeof buf);
    ok(strstr(buf, "reserved") && strstr(buf, "4.00 MiB"), "format: reserved shown when it differs from total");

    char b[32];
    ml_format_bytes(512, b, sizeof b);
    int r1 = strcmp(b, "512 B") == 0;
    ml_format_bytes(1536, b, sizeof b);
    int r2 = strcmp(b, "1.50 KiB") == 0;
    ml_format_bytes((size_t)3 << 40, b, sizeof b);
    int r3 = strcmp(b, "3.00 TiB") == 0;
    ml_format_bytes(SIZE_MAX, b, sizeof b);
    int r4 = strstr(b, "PiB") != NULL;
    ok(r1 && r2 && r3 && r4, "format_bytes: B, KiB, TiB, and SIZE_MAX in PiB");
    ml_ledger_free(&lg);
}

static void test_underflow_aborts(void)
{
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        freopen("/dev/null", "w", stderr);
        ml_ledger lg;
        ml_ledger_init(&lg, "cpu");
        ml_ledger_charge(&lg, ML_CAT_ACTS, 10);
        ml_ledger_credit(&lg, ML_CAT_ACTS, 11);
        _exit(0);
    }
    int st = 0;
    waitpid(pid, &st, 0);
    ok(WIFSIGNALED(st) && WTERMSIG(st) == SIGABRT, "credit: more than was charged aborts (a broken invariant)");
}

int main(void)
{
    test_init();
    test_charge_credit();
    test_reserved_caching();
    test_peaks();
    test_budgets();
    test_budgets_caching();
    test_timeline();
    test_format();
    test_underflow_aborts();
    return tap_done();
}
