/*
 * host/runtime/plan.c - entering and leaving a memory plan (plan.h).
 */
#include "plan.h"

ml_status ml_plan_begin(ml_host *h, ml_plan_saved *saved, ml_err *e)
{
    if (h->planning)
        return ml_err_set(e, ML_EINVAL, "plans do not nest");
    if (h->plan_live)
        return ml_err_set(e, ML_EINVAL, "%zu tensor%s or pool%s of an earlier plan %s still alive "
                          "(a plan's function must not keep them)", h->plan_live,
                          h->plan_live == 1 ? "" : "s", h->plan_live == 1 ? "" : "s",
                          h->plan_live == 1 ? "is" : "are");
    *saved = (ml_plan_saved){h->seed, h->rng_offset, h->nthreads, h->category, h->kern[ML_CUDA]};
    if (!h->kern[ML_CUDA])
        h->kern[ML_CUDA] = &ml_kernels_cuda_plan;
    for (int t = 0; t < ML_NTIERS; t++) {
        const ml_ledger *real = &h->books[t];
        ml_ledger *v = &h->plan_books[t];
        ml_ledger_free(v);
        ml_ledger_init(v, real->device);
        for (int c = 0; c < ML_NCAT; c++) {
            v->cur[c] = v->peak[c] = v->at_peak[c] = real->cur[c];
            v->budget[c] = real->budget[c];
        }
        v->total = v->total_peak = real->total;
        memcpy(v->phase, real->phase, sizeof v->phase);
        memcpy(v->peak_phase, real->phase, sizeof v->peak_phase);
        v->caching = real->caching;
        v->reserved = v->reserved_peak = real->reserved;
        v->budget_total = real->budget_total;
        h->ledger[t] = v;
    }
    for (int d = 0; d < ML_NDEVICES; d++)
        h->mem[d] = ml_memory_plan[d];
    h->planning = 1;
    return ML_OK;
}

void ml_plan_end(ml_host *h, const ml_plan_saved *saved)
{
    for (int t = 0; t < ML_NTIERS; t++)
        h->ledger[t] = &h->books[t];
    for (int d = 0; d < ML_NDEVICES; d++)
        h->mem[d] = h->device_mem[d];
    h->planning = 0;
    h->kern[ML_CUDA] = saved->cuda_kern;
    h->seed = saved->seed;
    h->rng_offset = saved->rng_offset;
    h->category = saved->category;
    if (h->nthreads != saved->nthreads)
        ml_host_set_threads(h, saved->nthreads);
}
