/*
 * kernels/optim.h - optimizer updates and gradient norms on flat buffers
 * (DESIGN.md, Parameters: flat units): AdamW, SGD with momentum, lazy
 * (sparse-aware) AdamW over the E experts of an expert unit, the
 * global L2 norm of a set of buffers, per-slice norms and in-place scaling.
 * CPU: kernels/optim.c; CUDA: kernels/optim.cu, with the same arguments.
 *
 * Every function here updates in place (=, never +=): p, m, v, buf and x
 * are overwritten with their new values; g is read only. f32 and f64; all
 * buffers of one call share the dtype. Elementwise updates are
 * bit-identical for every thread count (disjoint tiles); norms sum squares
 * in f64 per fixed block of ML_OPTIM_BLOCK elements and add the block
 * partials in block order, so they are bit-identical too. CUDA keeps both
 * orders and rounds in the buffers' dtype with the same per-step scalars
 * (ml_adamw_coef_of, on the host), so it is built to match the CPU bit for
 * bit (tests/spec/gpu_optim_spec.lua checks it within stated bounds).
 *
 * Host and device memory: the tensor data (p, m, v, g, buf, x, the [S]
 * buffers m[e] and v[e] point at, and slice_norms' norms) is on the
 * function's device. Everything else is host memory on every backend:
 * the hyperparameter structs, lazy AdamW's pointer tables m and v, its
 * active mask, its step counts and *nactive (the step reads the mask and
 * counts to pick experts and their bias corrections, and advances the
 * counts, before or without any kernel), sumsq's *out (CUDA copies it back
 * and waits for it) and scale_slices' factors.
 *
 * Not interruptible: the optimizer step cannot be interrupted (DESIGN.md,
 * Layers). These functions never poll ctx->interrupt; a Ctrl-C during a
 * step is seen by the next interruptible kernel, so parameters and states
 * are never left half-updated. No allocation: CUDA's norms keep their
 * partial sums in the caller's scratch (ml_sumsq_scratch_bytes_cuda,
 * ml_slice_norms_scratch_bytes_cuda), which the caller takes from the
 * ledger, so plans book it; the CPU needs none (scratch may be NULL).
 *
 * Not here: parameter groups, lazy (per-expert) state allocation,
 * clipping policy (lua/moelua/optim.lua), argument checks (their caller,
 * host/bindings/l_optim.c, moving to the op layer).
 */
#ifndef ML_KERNELS_OPTIM_H
#define ML_KERNELS_OPTIM_H

#include "core.h"

#include <math.h>

#define ML_OPTIM_BLOCK 4096   /* = ML_REDUCE_BLOCK: norms use ml_block_sum_cpu */
#define ML_OPTIM_SUPER 1024   /* blocks per CUDA super block of the norms (optim.cu) */

/* AdamW hyperparameters; step is the 1-based step the bias correction
 * uses (ignored by the lazy variant, which reads per-expert counts). */
typedef struct {
    double lr, beta1, beta2, eps, weight_decay;
    int64_t step;
} ml_adamw_hp;

typedef struct {
    double lr, momentum, dampening, weight_decay;
    int nesterov;
    int first;            /* 1: the momentum buffer is initialised to d_p */
} ml_sgd_hp;

/* The per-step scalars of AdamW at the 1-based step t, computed in double
 * as PyTorch computes them in Python; both backends compute them on the
 * host with this one function and round them to the buffers' dtype. */
typedef struct {
    double decay, w, b2, c2, bc2_sqrt, eps, neg_step;
    int low;              /* lerp branch: |w| < 0.5 */
} ml_adamw_coef;

static inline ml_adamw_coef ml_adamw_coef_of(const ml_adamw_hp *hp, int64_t t)
{
    ml_adamw_coef c;
    c.decay = 1.0 - hp->lr * hp->weight_decay;
    c.w = 1.0 - hp->beta1;
    c.b2 = hp->beta2;
    c.c2 = 1.0 - hp->beta2;
    double bc1 = 1.0 - pow(hp->beta1, (double)t);
    double bc2 = 1.0 - pow(hp->beta2, (double)t);
    c.bc2_sqrt = sqrt(bc2);
    c.eps = hp->eps;
    c.neg_step = -(hp->lr / bc1);
    c.low = fabs(c.w) < 0.5;
    return c;
}

/* Lazy AdamW's precondition: every active expert has both states. */
static inline int ml_lazy_states_present(void *const *m, void *const *v, const uint8_t *active,
                                         int64_t E)
{
    for (int64_t e = 0; e < E; e++)
        if (active[e] && (!m[e] || !v[e]))
            return 0;
    return 1;
}

/* torch.optim.AdamW (amsgrad off, maximize off), per element, in the
 * buffers' dtype with PyTorch's operation order:
 *   p = p * (1 - lr wd)
 *   m = m + (1 - b1) (g - m)                  (lerp, = b1 m + (1 - b1) g)
 *   v = v b2 + (1 - b2) g g
 *   p = p + (-lr / (1 - b1^t)) m / (sqrt(v) / sqrt(1 - b2^t) + eps)
 * p, m, v, g: [n]. */
ml_status ml_adamw_cpu(ml_dtype dt, void *p, void *m, void *v, const void *g, int64_t n,
                       const ml_adamw_hp *hp, const ml_kctx *ctx);
ml_status ml_adamw_cuda(ml_dtype dt, void *p, void *m, void *v, const void *g, int64_t n,
                        const ml_adamw_hp *hp, const ml_kctx *ctx);

/* Lazy AdamW over the E experts of an expert unit: p and g are [n] =
 * [E, S] (S = n / E, expert e is the slice e*S .. (e+1)*S), and each expert
 * owns its states: m[e] and v[e] point at its own [S] buffers, NULL for an
 * expert that has none yet (m, v: tables of E pointers). Expert e is updated
 * only when active[e] != 0, with bias correction from its own count
 * t = steps[e] + 1; afterwards steps[e] = t for the active experts. An
 * inactive expert is neither updated nor decayed, its count does not
 * advance and its state pointers are not read. An active expert without
 * states is refused (ML_EUNSUPPORTED) before anything changes. active: [E]
 * u8, steps: [E] i64 (in/out), both host memory on every backend. *nactive
 * (may be NULL) receives the number of active experts. */
ml_status ml_lazy_adamw_cpu(ml_dtype dt, void *p, void *const *m, void *const *v,
                            int64_t *steps, const void *g, const uint8_t *active, int64_t n,
                            int64_t E, const ml_adamw_hp *hp, int64_t *nactive,
                            const ml_kctx *ctx);
ml_status ml_lazy_adamw_cuda(ml_dtype dt, void *p, void *const *m, void *const *v,
                             int64_t *steps, const void *g, const uint8_t *active, int64_t n,
                             int64_t E, const ml_adamw_hp *hp, int64_t *nactive,
                             const ml_kctx *ctx);

/* torch.optim.SGD: d = g + wd p; buf = first ? d : momentum buf + (1 -
 * dampening) d; d = nesterov ? d + momentum buf : buf; p = p - lr d.
 * buf may be NULL when momentum == 0 (then d = g + wd p). */
ml_status ml_sgd_cpu(ml_dtype dt, void *p, void *buf, const void *g, int64_t n,
                     const ml_sgd_hp *hp, const ml_kctx *ctx);
ml_status ml_sgd_cuda(ml_dtype dt, void *p, void *buf, const void *g, int64_t n,
                      const ml_sgd_hp *hp, const ml_kctx *ctx);

/* *out = sum of x[i]^2 over [n], in f64 (blocks in order, see above);
 * out is host memory (CUDA waits for ctx->stream before it returns).
 * scratch: ml_sumsq_scratch_bytes_cuda(n) bytes on CUDA (the total and the
 * super block partials), none on the CPU. */
ml_status ml_sumsq_cpu(ml_dtype dt, double *out, const void *x, int64_t n, void *scratch,
                       const ml_kctx *ctx);
ml_status ml_sumsq_cuda(ml_dtype dt, double *out, const void *x, int64_t n, void *scratch,
                        const ml_kctx *ctx);

/* norms[e] = L2 norm of slice e of [n] viewed as [E, n/E]; f64 out [E],
 * device memory (CUDA does not wait). scratch: as sumsq's, with
 * ml_slice_norms_scratch_bytes_cuda(n, E) bytes (every slice's partials). */
ml_status ml_slice_norms_cpu(ml_dtype dt, double *norms, const void *x, int64_t n, int64_t E,
                             void *scratch, const ml_kctx *ctx);
ml_status ml_slice_norms_cuda(ml_dtype dt, double *norms, const void *x, int64_t n, int64_t E,
                              void *scratch, const ml_kctx *ctx);

/* Bytes of 8-aligned device scratch the CUDA norms need: 8 per super
 * block of ML_OPTIM_SUPER * ML_OPTIM_BLOCK elements of each slice, and
 * sumsq's total (0 where slice_norms refuses n, E). Plain C (optim.c, every
 * build), so a plan of a CUDA run books it. */
size_t ml_sumsq_scratch_bytes_cuda(int64_t n);
size_t ml_slice_norms_scratch_bytes_cuda(int64_t n, int64_t E);

/* x[i] *= factors[i / (n/E)] (E = 1: one factor for the whole buffer);
 * the factor is rounded to the dtype once. factors: [E] host memory. */
ml_status ml_scale_slices_cpu(ml_dtype dt, void *x, const double *factors, int64_t n,
                              int64_t E, const ml_kctx *ctx);
ml_status ml_scale_slices_cuda(ml_dtype dt, void *x, const double *factors, int64_t n,
                               int64_t E, const ml_kctx *ctx);

#endif
