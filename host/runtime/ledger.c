/*
 * host/runtime/ledger.c - the memory ledger's bookkeeping: current and peak bytes per
 * category, the breakdown at the total peak, budgets, an optional timeline,
 * and the account book as text.
 */
#include "ledger.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

const char *const ml_category_names[ML_NCAT] = {
    "params", "grads", "optim", "acts", "pool", "comm", "cache", "other"
};

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

void ml_ledger_init(ml_ledger *lg, const char *device)
{
    memset(lg, 0, sizeof *lg);
    lg->device = device;
    lg->t0 = now_s();
    lg->last_t = -1e300;
}

void ml_ledger_free(ml_ledger *lg)
{
    free(lg->samples);
    lg->samples = NULL;
    lg->cap = lg->nsamples = 0;
}

/* held + add > limit, without wrapping */
static int exceeds(size_t held, size_t add, size_t limit)
{
    return add > limit || held > limit - add;
}

ml_ledger_verdict ml_ledger_check(const ml_ledger *lg, ml_category cat, size_t n, size_t grow)
{
    /* A caching allocator's budget bounds what it holds (DESIGN.md): a
     * refusal makes the caller release the cache and try again. A request
     * that a cached block serves holds nothing more (grow 0). */
    if (lg->budget_total && (exceeds(lg->total, n, lg->budget_total) ||
                             (lg->caching && exceeds(lg->reserved, grow, lg->budget_total))))
        return ML_LEDGER_OVER_TOTAL;
    if (lg->budget[cat] && exceeds(lg->cur[cat], n, lg->budget[cat]))
        return ML_LEDGER_OVER_CATEGORY;
    return ML_LEDGER_OK;
}

static void sample(ml_ledger *lg)
{
    if (lg->cap == 0)
        return;
    double t = now_s() - lg->t0;
    if (lg->interval > 0 && t - lg->last_t < lg->interval)
        return;
    if (lg->nsamples == lg->cap) {
        lg->ndropped++;
        return;
    }
    ml_sample *s = &lg->samples[lg->nsamples++];
    s->t = t;
    memcpy(s->bytes, lg->cur, sizeof s->bytes);
    lg->last_t = t;
}

void ml_ledger_charge(ml_ledger *lg, ml_category cat, size_t n)
{
    lg->cur[cat] += n;
    lg->total += n;
    lg->nalloc[cat]++;
    if (lg->cur[cat] > lg->peak[cat])
        lg->peak[cat] = lg->cur[cat];
    if (lg->total > lg->total_peak) {
        lg->total_peak = lg->total;
        memcpy(lg->at_peak, lg->cur, sizeof lg->at_peak);
        memcpy(lg->peak_phase, lg->phase, sizeof lg->peak_phase);
    }
    if (!lg->caching || lg->reserved < lg->total)
        ml_ledger_set_reserved(lg, lg->total);
    sample(lg);
}

void ml_ledger_credit(ml_ledger *lg, ml_category cat, size_t n)
{
    if (n > lg->cur[cat]) {
        fprintf(stderr, "moelua: %s:%d: ledger underflow in %s (%zu > %zu)\n",
                __FILE__, __LINE__, ml_category_names[cat], n, lg->cur[cat]);
        abort();
    }
    lg->cur[cat] -= n;
    lg->total -= n;
    lg->nfree[cat]++;
    if (!lg->caching)
        ml_ledger_set_reserved(lg, lg->total);
    sample(lg);
}

void ml_ledger_set_reserved(ml_ledger *lg, size_t reserved)
{
    lg->reserved = reserved;
    if (reserved > lg->reserved_peak)
        lg->reserved_peak = reserved;
}

void ml_ledger_set_phase(ml_ledger *lg, const char *phase)
{
    snprintf(lg->phase, sizeof lg->phase, "%s", phase);
}

void ml_ledger_reset_peak(ml_ledger *lg)
{
    memcpy(lg->peak, lg->cur, sizeof lg->peak);
    memcpy(lg->at_peak, lg->cur, sizeof lg->at_peak);
    memcpy(lg->peak_phase, lg->phase, sizeof lg->peak_phase);
    lg->total_peak = lg->total;
    lg->reserved_peak = lg->reserved;
}

int ml_ledger_timeline(ml_ledger *lg, size_t cap, double interval)
{
    ml_sample *s = NULL;
    if (cap && !(s = calloc(cap, sizeof *s)))
        return -1;
    free(lg->samples);
    lg->samples = s;
    lg->cap = cap;
    lg->nsamples = 0;
    lg->ndropped = 0;
    lg->interval = interval;
    lg->last_t = -1e300;
    if (cap)
        sample(lg);
    return 0;
}

void ml_format_bytes(size_t n, char *buf, size_t len)
{
    static const char *const unit[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
    double v = (double)n;
    int u = 0;
    while (v >= 1024.0 && u < 5) {
        v /= 1024.0;
        u++;
    }
    if (u == 0)
        snprintf(buf, len, "%zu B", n);
    else
        snprintf(buf, len, "%.2f %s", v, unit[u]);
}

/* Append to buf without overflowing; returns the new logical length. */
__attribute__((format(printf, 4, 5)))
static size_t put(char *buf, size_t len, size_t at, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(at < len ? buf + at : NULL, at < len ? len - at : 0, fmt, ap);
    va_end(ap);
    return at + (n > 0 ? (size_t)n : 0);
}

size_t ml_ledger_format(const ml_ledger *lg, size_t untracked, int has_untracked, char *buf, size_t len)
{
    char a[32], b[32], c[32], d[32];
    size_t at = 0;
    if (len)
        buf[0] = '\0';
    at = put(buf, len, at, "memory ledger (%s)\n", lg->device);
    at = put(buf, len, at, "  %-8s %12s %12s %12s %6s %12s %8s\n",
             "category", "current", "peak", "at peak", "share", "budget", "allocs");
    for (int i = 0; i < ML_NCAT; i++) {
        ml_format_bytes(lg->cur[i], a, sizeof a);
        ml_format_bytes(lg->peak[i], b, sizeof b);
        ml_format_bytes(lg->at_peak[i], c, sizeof c);
        if (lg->budget[i])
            ml_format_bytes(lg->budget[i], d, sizeof d);
        else
            snprintf(d, sizeof d, "-");
        double share = lg->total_peak ? 100.0 * (double)lg->at_peak[i] / (double)lg->total_peak : 0.0;
        at = put(buf, len, at, "  %-8s %12s %12s %12s %5.1f%% %12s %8llu\n", ml_category_names[i],
                 a, b, c, share, d, (unsigned long long)lg->nalloc[i]);
    }
    ml_format_bytes(lg->total, a, sizeof a);
    ml_format_bytes(lg->total_peak, b, sizeof b);
    ml_format_bytes(lg->total_peak, c, sizeof c);
    if (lg->budget_total)
        ml_format_bytes(lg->budget_total, d, sizeof d);
    else
        snprintf(d, sizeof d, "-");
    at = put(buf, len, at, "  %-8s %12s %12s %12s %6s %12s\n", "total", a, b, c, "100%", d);
    if (lg->reserved != lg->total || lg->reserved_peak != lg->total_peak) {
        ml_format_bytes(lg->reserved, a, sizeof a);
        ml_format_bytes(lg->reserved_peak, b, sizeof b);
        at = put(buf, len, at, "  %-8s %12s %12s\n", "reserved", a, b);
    }
    if (has_untracked) {
        ml_format_bytes(untracked, a, sizeof a);
        at = put(buf, len, at, "  untracked (RSS - ledger): %s\n", a);
    }
    return at;
}

static size_t read_kb_field(const char *path, const char *key)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return 0;
    char line[256];
    size_t kb = 0, klen = strlen(key);
    while (fgets(line, sizeof line, f)) {
        if (strncmp(line, key, klen) == 0) {
            kb = strtoull(line + klen, NULL, 10);
            break;
        }
    }
    fclose(f);
    return kb * 1024;
}

size_t ml_process_rss(void)
{
    return read_kb_field("/proc/self/status", "VmRSS:");
}

size_t ml_mem_available(void)
{
    return read_kb_field("/proc/meminfo", "MemAvailable:");
}

size_t ml_mem_total(void)
{
    return read_kb_field("/proc/meminfo", "MemTotal:");
}
