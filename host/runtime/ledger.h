/*
 * host/runtime/ledger.h - the memory ledger: one per device, through which every
 * tensor byte is accounted, tagged with a category.
 *
 * The ledger counts; it does not allocate. host/runtime/tensor.c (ml_storage_new)
 * and host/runtime/pool.c ask it for permission (ml_ledger_check), allocate, charge
 * (ml_ledger_charge) and give the bytes back with ml_ledger_credit. Budgets are
 * checked before anything is allocated, so a refused request leaves every
 * existing tensor intact.
 */
#ifndef ML_LEDGER_H
#define ML_LEDGER_H

#include <stddef.h>
#include <stdint.h>

typedef enum {
    ML_CAT_PARAMS, ML_CAT_GRADS, ML_CAT_OPTIM, ML_CAT_ACTS,
    ML_CAT_POOL, ML_CAT_COMM, ML_CAT_CACHE, ML_CAT_OTHER, ML_NCAT
} ml_category;

extern const char *const ml_category_names[ML_NCAT];

/* One timeline point: seconds since the ledger was created, bytes per category. */
typedef struct {
    double t;
    size_t bytes[ML_NCAT];
} ml_sample;

typedef struct {
    const char *device;             /* "cpu" or "cuda", for reports */
    size_t cur[ML_NCAT];            /* live bytes per category */
    size_t peak[ML_NCAT];           /* each category's own peak */
    size_t total, total_peak;
    size_t at_peak[ML_NCAT];        /* breakdown at the moment of total_peak */
    char phase[64];                 /* what the host is doing (ml_ledger_set_phase) */
    char peak_phase[64];            /* ... at the moment of total_peak */
    uint64_t nalloc[ML_NCAT], nfree[ML_NCAT];
    int caching;                    /* 1: a caching allocator reports `reserved`;
                                       0: reserved follows total (CPU) */
    size_t reserved;                /* bytes held from the device (>= total) */
    size_t reserved_peak;
    size_t budget_total;            /* 0: no budget */
    size_t budget[ML_NCAT];         /* 0: no budget for that category */
    uint64_t nrefused;              /* requests refused by a budget */
    /* timeline: off when cap == 0 */
    ml_sample *samples;
    size_t nsamples, cap;
    uint64_t ndropped;              /* samples not kept because the buffer was full */
    double interval, last_t, t0;    /* interval 0: sample on every change */
} ml_ledger;

typedef enum { ML_LEDGER_OK = 0, ML_LEDGER_OVER_TOTAL, ML_LEDGER_OVER_CATEGORY } ml_ledger_verdict;

void ml_ledger_init(ml_ledger *lg, const char *device);
void ml_ledger_free(ml_ledger *lg);

/* Would `n` more bytes of category `cat` fit the budgets? Counts nothing.
 * The category budget bounds cur[cat] + n. The total budget bounds what the
 * device holds afterwards: total + n, or on a caching ledger
 * max(total + n, reserved + grow), where grow is what the reservation grows
 * by (ml_memory.reserve_bytes: 0 when a cached block serves the request). */
ml_ledger_verdict ml_ledger_check(const ml_ledger *lg, ml_category cat, size_t n, size_t grow);
/* Account n bytes (the caller has already checked and allocated). */
void ml_ledger_charge(ml_ledger *lg, ml_category cat, size_t n);
void ml_ledger_credit(ml_ledger *lg, ml_category cat, size_t n);
/* Reserved bytes of a caching allocator; the CPU allocator keeps it == total. */
void ml_ledger_set_reserved(ml_ledger *lg, size_t reserved);

void ml_ledger_reset_peak(ml_ledger *lg);
/* The phase of the work that charges the ledger from now on ("forward of
 * layer 3"), kept beside the breakdown when the total peaks. */
void ml_ledger_set_phase(ml_ledger *lg, const char *phase);
/* cap samples, one per change (interval 0) or at most one per interval s. cap 0 turns it off. */
int ml_ledger_timeline(ml_ledger *lg, size_t cap, double interval);

/* The account book as text (for reports and budget errors). Writes at most
 * len bytes including the terminating NUL; returns the length it needed. */
size_t ml_ledger_format(const ml_ledger *lg, size_t untracked, int has_untracked, char *buf, size_t len);

/* Human-readable byte count, e.g. "1.50 MiB". */
void ml_format_bytes(size_t n, char *buf, size_t len);

/* Resident set size of this process in bytes (0 when unknown). */
size_t ml_process_rss(void);
/* MemAvailable from /proc/meminfo in bytes (0 when unknown). */
size_t ml_mem_available(void);
/* MemTotal from /proc/meminfo in bytes (0 when unknown). */
size_t ml_mem_total(void);

#endif
