/*
 * host/runtime/ops_optim.h - the op layer of the optimizers and gradient
 * norms (kernels/optim.h has the update formulas): AdamW, lazy AdamW with
 * per-expert states, SGD, a step over many parameter groups at once, the
 * global gradient norm and its clipping, per-slice (per-expert) norms and
 * clipping, scaling. Each op checks every operand (live, contiguous, one
 * float dtype, matching element counts, on the device of the first param)
 * and the hyperparameters before any kernel runs, so a refused call
 * changes nothing; then it updates in place through ML_KCALL.
 *
 * Buffers are flat: any shape, compared by element count. Host scalar
 * results (a norm, the number of active experts) come back through
 * pointers. Inside a memory plan (h->planning) the kernels are skipped and
 * nothing is read back from the device: norms are 0, no expert is active,
 * and a mask is read as "every expert active" (the worst case).
 *
 * Not interruptible (DESIGN.md, Layers): the kernels ignore Ctrl-C, and
 * ml_op_optim_step_all runs every group's update with nothing in between.
 *
 * Not here: Lua (host/bindings/l_optim.c binds these as moelua.optim_c),
 * parameter groups, lazy state allocation and the clipping policy
 * (lua/moelua/optim.lua).
 */
#ifndef ML_OPS_OPTIM_H
#define ML_OPS_OPTIM_H

#include "op.h"

#define ML_CLIP_EPS 1e-6   /* torch.nn.utils.clip_grad_norm_'s: factor = max / (norm + eps) */

/* AdamW (torch.optim.AdamW): p, m, v [n] updated (=), g [n] read;
 * hp->step is the 1-based step of the bias correction. */
ml_status ml_op_adamw_step(ml_host *h, ml_tensor *p, const ml_tensor *g, ml_tensor *m,
                           ml_tensor *v, const ml_adamw_hp *hp, ml_err *e);

/* Lazy AdamW over the E experts of p [n] = [E, n/E]: m[e], v[e] are expert
 * e's states ([n/E] each, NULL where it has none, which only an inactive
 * expert may), active [E] u8, steps [E] i64 (each active expert's count
 * advances; both cpu tensors on every device: host counters, as
 * kernels/optim.h says). hp->step is ignored. *nactive (may be NULL): the experts
 * updated. */
ml_status ml_op_lazy_adamw_step(ml_host *h, ml_tensor *p, const ml_tensor *g,
                                ml_tensor *const *m, ml_tensor *const *v,
                                const ml_tensor *active, ml_tensor *steps, int64_t E,
                                const ml_adamw_hp *hp, int64_t *nactive, ml_err *e);

/* The experts that are active but have no states (m[e] == NULL), which a
 * caller must allocate before a lazy step: out[0..*k) (0-based, room for
 * E). In a plan: every expert without states. */
ml_status ml_op_lazy_adamw_unstated(ml_host *h, const ml_tensor *active, ml_tensor *const *m,
                                    int64_t E, int64_t *out, int64_t *k, ml_err *e);

/* SGD (torch.optim.SGD): p [n] and buf [n] updated, g read; buf may be
 * NULL when hp->momentum == 0 (it is then not touched). step: the 1-based
 * step (1 initialises buf; hp->first is ignored). */
ml_status ml_op_sgd_step(ml_host *h, ml_tensor *p, const ml_tensor *g, ml_tensor *buf,
                         const ml_sgd_hp *hp, int64_t step, ml_err *e);

/* One group's update in a multi-group step. */
typedef enum { ML_OPTIM_ADAMW, ML_OPTIM_LAZY_ADAMW, ML_OPTIM_SGD } ml_optim_kind;

typedef struct {
    ml_optim_kind kind;
    ml_tensor *params;
    const ml_tensor *grads;
    ml_tensor *exp_avg, *exp_avg_sq;             /* adamw: [n] */
    ml_tensor *const *expert_avg;                /* lazy: [E] per-expert states, */
    ml_tensor *const *expert_avg_sq;             /*   NULL entries as above */
    const ml_tensor *active;                     /* lazy: [E] u8 */
    ml_tensor *steps;                            /* lazy: [E] i64 */
    int64_t experts;                             /* lazy: E */
    ml_tensor *momentum_buffer;                  /* sgd: [n]; NULL when momentum = 0 */
    ml_adamw_hp adamw;                           /* adamw, lazy (step: from `step`) */
    ml_sgd_hp sgd;                               /* sgd (first: from `step`) */
    int64_t step;                                /* adamw, sgd: completed steps, += 1 */
} ml_optim_job;

/* One optimizer step over jobs[0..n): every job is checked first (a
 * message names "job i (kind)", 1-based), then every update runs, then the
 * adamw and sgd jobs' `step` advance. *skipped (may be NULL): the lazy
 * jobs' inactive experts. */
ml_status ml_op_optim_step_all(ml_host *h, ml_optim_job *jobs, int64_t n, int64_t *skipped,
                               ml_err *e);

/* *sumsq = the squares of all of t[0..n) summed: in f64 per tensor in a
 * fixed order, so the value is thread-count invariant (a rank's part of a
 * sharded gradient norm). */
ml_status ml_op_grad_sumsq(ml_host *h, const ml_tensor *const *t, int64_t n, double *sumsq,
                           ml_err *e);
/* *norm = the L2 norm of all of t[0..n) together: the root of ml_op_grad_sumsq. */
ml_status ml_op_grad_norm(ml_host *h, const ml_tensor *const *t, int64_t n, double *norm,
                          ml_err *e);
/* The same, then every t[i] *= max_norm / (*norm + ML_CLIP_EPS) when that
 * is < 1; a non-finite norm scales nothing (the caller skips the step). */
ml_status ml_op_clip_grad_norm(ml_host *h, ml_tensor *const *t, int64_t n, double max_norm,
                               double *norm, ml_err *e);

/* norms [E] f64 (=, allocated when empty) = the L2 norm of each of the E
 * equal slices of x. */
ml_status ml_op_slice_norms(ml_host *h, ml_tensor *norms, const ml_tensor *x, int64_t E,
                            ml_err *e);
/* x *= factor (finite). */
ml_status ml_op_scale(ml_host *h, ml_tensor *x, double factor, ml_err *e);
/* Slice e of x *= min(1, bounds[e] / (norm_e + ML_CLIP_EPS)) (a slice with
 * a non-finite norm is left alone); norms as in ml_op_slice_norms gets the
 * norms before clipping. bounds: E finite numbers >= 0 on the host. */
ml_status ml_op_clip_slices(ml_host *h, ml_tensor *x, int64_t E, const double *bounds,
                            ml_tensor *norms, ml_err *e);

#endif
