/*
 * host/runtime/ops_moe.h - the op layer of the MoE layer: router, dispatch
 * (with pack / unpack of a plan's rows), SwiGLU experts (as tensors or as
 * per-expert pointer tables); kernels/router.h, dispatch.h, experts.h have
 * the semantics. Each op checks every operand (one device, dtypes, shapes,
 * contiguity, expert ids and plans), allocates the outputs it is given
 * empty, takes its scratch, calls the device's kernels through ML_KCALL
 * and gives the scratch back before returning, so C code (expert
 * parallelism, the expert store, tests/c) routes, dispatches and runs
 * experts without a Lua state.
 *
 * Pool: every op takes an optional ml_pool (NULL: none). With one, the
 * outputs it allocates are views in new slots of the pool and its scratch
 * is a slot rewound before returning, so a warmed-up step makes no ledger
 * allocation; without one, outputs and scratch come from the ledger under
 * the current category and the scratch is freed before returning. The pool
 * must be on the operands' device.
 *
 * Inside a memory plan (h->planning) no kernel runs and nothing is read
 * back: expert ids and plans are not validated and the host-side
 * statistics take the values the ops' comments give.
 *
 * Not here: Lua (host/bindings/l_router.c and l_experts.c bind these as
 * moelua.router and moelua.experts), the aux loss, the layer object.
 */
#ifndef ML_OPS_MOE_H
#define ML_OPS_MOE_H

#include "op.h"
#include "pool.h"

/* ---- router ------------------------------------------------------------------- */

/* What router_forward returns beside idx and w. counts and psum accumulate
 * (+=; zeros when the op allocates them). */
typedef struct {
    ml_tensor *counts;     /* [E] i64   += top-k assignments, before any drop */
    ml_tensor *psum;       /* [E] f64   += sum_t p'_te */
    double z;              /* = sum_t lse_t^2 */
    double entropy;        /* = sum_t H(p'_t) */
    double cp;             /* sum_e C_e P_e over counts and psum (the aux loss is E times
                            * this over N^2); 0 inside a plan */
    int64_t max_count;     /* max_e C_e; T (the worst case of this call) inside a plan */
} ml_router_stats;

/* Gradients of the router's backward: aux and z are what the loss puts on
 * the probabilities and on zsum, dx and dwg accumulate (+=; zeros when the
 * op allocates them). */
typedef struct {
    const ml_tensor *aux;  /* [E] f64 dL/dp'_te (the same for every t), or NULL */
    double z;              /* dL/dzsum, finite */
    ml_tensor *dx;         /* [T, D] x's dtype */
    ml_tensor *dwg;        /* [E, D] ml_grad_dtype(x's): f32 for bf16 x */
} ml_router_grads;

/* idx [T, k] i64 (=) and w [T, k] (=, x's dtype) from x [T, D] and wg
 * [E, D] (one float dtype: f32, f64, or bf16 where the device runs it);
 * cfg is checked (k in [1, E], chunk >= 1, temperature > 0,
 * eps in [0, 1), noise >= 0, the noise counters' ranges); bias [E] f32/f64
 * (finite; selection only) or NULL. ML_ENAN: a NaN logit. */
ml_status ml_op_router_forward(ml_host *h, ml_tensor *idx, ml_tensor *w, ml_router_stats *st,
                               const ml_tensor *x, const ml_tensor *wg, const ml_router_cfg *cfg,
                               const ml_tensor *bias, ml_pool *pool, ml_err *e);
/* Backward by recompute, with the forward's cfg and bias (bias is checked
 * and unused: the saved idx is never re-selected). dw [T, k] = dL/dw.
 * On ML_ENAN grads->dx may hold part of the +=. */
ml_status ml_op_router_backward(ml_host *h, const ml_router_grads *g, const ml_tensor *dw,
                                const ml_tensor *x, const ml_tensor *wg, const ml_tensor *idx,
                                const ml_router_cfg *cfg, const ml_tensor *bias, ml_pool *pool,
                                ml_err *e);
/* b_e += gamma * sign(mean - C_e), in place: bias [E] f32/f64, counts [E]
 * i64, gamma finite >= 0. */
ml_status ml_op_router_update_bias(ml_host *h, ml_tensor *bias, const ml_tensor *counts,
                                   double gamma, ml_err *e);

/* ---- dispatch ----------------------------------------------------------------- */

/* A dispatch plan (kernels/dispatch.h). Every tensor is an output of
 * ml_op_dispatch (=); the experts ops read offsets and order. */
typedef struct {
    ml_tensor *offsets;    /* [E+1] i64 */
    ml_tensor *order;      /* [T·k] i64 */
    ml_tensor *counts;     /* [E] i64 kept per expert */
    ml_tensor *dropped;    /* [T, k] u8 */
    int64_t ndropped;      /* 0 inside a plan */
} ml_dispatch_plan;

/* Sort the assignments of idx [T, k] i64 (ids in [0, E), E >= 1) by
 * expert; capacity >= 0 keeps each expert's first `capacity` assignments
 * and drops the rest, capacity < 0 is dropless. */
ml_status ml_op_dispatch(ml_host *h, ml_dispatch_plan *plan, const ml_tensor *idx, int64_t E,
                         int64_t capacity, ml_pool *pool, ml_err *e);
/* The same with a capacity per expert: capacities [E] i64 on idx's
 * device, each >= 0 (read back and checked, except inside a plan); expert
 * e keeps its first capacities[e] assignments in (t, j) order. Expert
 * parallelism's local budgets, which differ per expert. */
ml_status ml_op_dispatch_caps(ml_host *h, ml_dispatch_plan *plan, const ml_tensor *idx, int64_t E,
                              const ml_tensor *capacities, ml_pool *pool, ml_err *e);

/* The rows of a plan's kept assignments, in plan order (kernels/dispatch.h):
 * out [kept, C] (=; any dtype, src's) has row p = row order[p] / div of
 * src, where src is [T, C] per token (div = k) or [T·k, C] per assignment
 * (div = 1; for k = 1 the two are one). kept = T·k - plan->ndropped
 * (T·k inside a plan, where ndropped is 0). The plan's order must be
 * [T·k] i64 on src's device with entries in [0, T·k) (read back and
 * checked, except inside a plan); k is the plan's. */
ml_status ml_op_dispatch_pack(ml_host *h, ml_tensor *out, const ml_tensor *src,
                              const ml_dispatch_plan *plan, int64_t k, ml_pool *pool, ml_err *e);
/* The reverse: out [T, C] or [T·k, C] (given, +=) gains row p of rows
 * [kept, C] (out's dtype: f32, f64, or bf16 where the device runs it, CUDA,
 * each element summed in f32 and rounded once) at row order[p] / div, for p = 0, 1,
 * ... in that order: a token's rows add in ascending expert, the experts
 * combine's order, so unpacking the per-assignment outputs of the experts
 * is bitwise their y. */
ml_status ml_op_dispatch_unpack(ml_host *h, ml_tensor *out, const ml_tensor *rows,
                                const ml_dispatch_plan *plan, int64_t k, ml_pool *pool, ml_err *e);

/* ---- experts ------------------------------------------------------------------ */

/* Gradients of the experts' backward (kernels/experts.h): dx, dgate_up and
 * ddown accumulate (+=; zeros when the op allocates them), dw and touched
 * are overwritten (=; with cfg->accumulate only the run experts' entries,
 * and then both must be given). None may overlap an input or another. */
typedef struct {
    ml_tensor *dx;         /* [T, D] */
    ml_tensor *dgate_up;   /* [E, 2F, D] ml_grad_dtype(x's dtype): f32 for bf16 */
    ml_tensor *ddown;      /* [E, D, F] likewise */
    ml_tensor *dw;         /* [T, k] w's dtype */
    ml_tensor *touched;    /* [E] u8 */
} ml_experts_grads;

/* y [T, D] (=) = the experts' weighted sum over the plan's kept
 * assignments; saved_h [S, 2F] (=) keeps h for the first S dispatch
 * positions (left empty when S = 0). x [T, D], gate_up [E, 2F, D],
 * down [E, D, F], w [T, k] of one float dtype (f32, f64, or bf16 where the
 * device runs it: CUDA, mixed precision), idx [T, k] i64, plan's
 * offsets and order from ml_op_dispatch of idx (checked).
 * cfg: the caller sets tile (rows per tile asked, >= 1; the kernels run
 * min(tile, max(T·k, 1))), nsaved (S, 0 .. T·k) and accumulate (0, or 1:
 * y is given and += instead of =, see kernels/experts.h); the op sets T,
 * k, D, F and E from the tensors. */
ml_status ml_op_experts_forward(ml_host *h, ml_tensor *y, ml_tensor *saved_h, const ml_tensor *x,
                                const ml_tensor *gate_up, const ml_tensor *down,
                                const ml_tensor *idx, const ml_tensor *w,
                                const ml_dispatch_plan *plan, ml_experts_cfg *cfg, ml_pool *pool,
                                ml_err *e);
/* The backward with dy [T, D], the forward's cfg (tile, nsaved) and
 * saved_h (ignored when nsaved = 0). */
ml_status ml_op_experts_backward(ml_host *h, const ml_experts_grads *g, const ml_tensor *dy,
                                 const ml_tensor *x, const ml_tensor *gate_up,
                                 const ml_tensor *down, const ml_tensor *idx, const ml_tensor *w,
                                 const ml_dispatch_plan *plan, const ml_tensor *saved_h,
                                 ml_experts_cfg *cfg, ml_pool *pool, ml_err *e);

/* The experts as per-expert pointer tables (kernels/experts.h) instead of
 * [E, 2F, D] / [E, D, F] tensors: expert parallelism and the expert store,
 * where a rank or a cache slot holds any subset of the experts, anywhere
 * and in any order. The tensor ops above are these with the tables of
 * their tensors. The arrays are host memory read during the call only.
 * An expert whose entries are NULL (gate_up and down both; checked) is
 * skipped, rows or not: one layer may run its experts over several calls,
 * a subset per call in ascending expert order, the first with
 * cfg->accumulate = 0 and the rest with 1 (the same y, saved_h, dx, dw and
 * touched given to each), bitwise one call over all of them. The op checks
 * the sizes against x and trusts the pointers: the non-NULL entries point
 * at contiguous blocks of dtype on device ([2F, D] and [D, F]) that stay
 * live through the call and that no output overlaps. */
typedef struct {
    ml_experts_weights w;  /* [E] host arrays of pointers on `device` */
    int64_t E, F, D;       /* E >= 1, F >= 1; D is x's */
    ml_dtype dtype;        /* x's */
    ml_device device;      /* x's */
} ml_experts_table;

/* The table of per-expert tensors for x [T, D]: gate_up[e] [2F, D] and
 * down[e] [D, F] for e in [0, E), both NULL for a skipped expert; each
 * given one live, contiguous, of x's dtype and on x's device, with one F
 * (at least one expert given); x f32, f64 or bf16 (the ops check that x's
 * device runs it). t points into ptrs, 2E host pointers the caller keeps
 * through the ops. */
ml_status ml_op_experts_tabulate(ml_experts_table *t, const void **ptrs,
                                 const ml_tensor *const *gate_up, const ml_tensor *const *down,
                                 int64_t E, const ml_tensor *x, ml_err *e);
/* Their gradients' table: dgate_up[e] [2F, D] and ddown[e] [D, F] of
 * ml_grad_dtype(t's dtype) (f32 for bf16) on t's device, given for every expert t runs (NULL allowed for a
 * skipped one; a given one is checked all the same). gw points into ptrs,
 * 2E host pointers. */
ml_status ml_op_experts_tabulate_grads(ml_experts_wgrads *gw, void **ptrs,
                                       ml_tensor *const *dgate_up, ml_tensor *const *ddown,
                                       const ml_experts_table *t, ml_err *e);

/* ml_op_experts_forward over table t (cfg's E and F are t's). */
ml_status ml_op_experts_forward_table(ml_host *h, ml_tensor *y, ml_tensor *saved_h,
                                      const ml_tensor *x, const ml_experts_table *t,
                                      const ml_tensor *idx, const ml_tensor *w,
                                      const ml_dispatch_plan *plan, ml_experts_cfg *cfg,
                                      ml_pool *pool, ml_err *e);
/* ml_op_experts_backward over table t: g's dx, dw and touched as there
 * (g->dgate_up and g->ddown are not used; NULL allowed), the weights'
 * gradients accumulate (+=) into gw's [E] blocks, trusted as t's (an
 * expert without rows or skipped is not written; every expert t runs must
 * have both entries: checked). */
ml_status ml_op_experts_backward_table(ml_host *h, const ml_experts_grads *g,
                                       const ml_experts_wgrads *gw, const ml_tensor *dy,
                                       const ml_tensor *x, const ml_experts_table *t,
                                       const ml_tensor *idx, const ml_tensor *w,
                                       const ml_dispatch_plan *plan, const ml_tensor *saved_h,
                                       ml_experts_cfg *cfg, ml_pool *pool, ml_err *e);

#endif
