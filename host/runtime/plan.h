/*
 * host/runtime/plan.h - a memory plan (DESIGN.md, The memory ledger): the
 * host switched to virtual books on every tier and the plan memory tables
 * on every device, with every kernel skipped (ML_KCALL), so the same step code that
 * trains predicts the peak, and an allocation that would cross a budget
 * is the same refusal, before anything real was allocated.
 *
 * The virtual books start as copies of the real ones (live bytes and
 * budgets). On a build without CUDA, CUDA gets ml_kernels_cuda_plan for
 * the plan, so a CUDA run plans with its real dtypes and scratch sizes. What a plan changes in the host and plan_end restores: the
 * seed, the RNG counter, the thread count and the category, so planning
 * does not change the run it plans. Objects made outside a plan keep
 * their real memory (tensor.c and pool.c return each to the book it was
 * charged to).
 *
 * Not here: running the planned code and collecting its garbage (the Lua
 * binding moelua.mem.plan, host/bindings/l_mem.c).
 */
#ifndef ML_PLAN_H
#define ML_PLAN_H

#include "op.h"

/* The host state a plan may change, saved by plan_begin. */
typedef struct {
    uint64_t seed, rng_offset;
    int nthreads;
    ml_category category;
    const struct ml_kernels *cuda_kern;   /* NULL on a build without CUDA */
} ml_plan_saved;

/* Enter a plan. ML_EINVAL when one is running (plans do not nest) or when
 * objects of an earlier plan are still alive (h->plan_live). */
ml_status ml_plan_begin(ml_host *h, ml_plan_saved *saved, ml_err *e);
/* Leave it: the real books and memory tables again, the saved state back.
 * The plan's books stay readable in h->plan_books until the next plan. */
void ml_plan_end(ml_host *h, const ml_plan_saved *saved);

#endif
