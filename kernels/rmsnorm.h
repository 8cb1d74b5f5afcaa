/*
 * kernels/rmsnorm.h - RMSNorm over the last dim (DESIGN.md, Numerics:
 * RMSNorm in fp32): y = x * rstd * w, rstd = 1 / sqrt(mean(x^2) + eps).
 *
 * CPU: dt is ML_F32 (training) or ML_F64 (reference paths, gradient
 * checks). Every row is computed in f64 and rounded once to dt; an f32
 * row's sums run over 8 f64 lanes (column d in lane d mod 8) added in lane
 * order, so they vectorise, an f64 row's in column order. Rows run in
 * parallel fixed tiles; dw is summed per column in row order in f64 by the
 * thread that owns the column, so every output is bitwise identical for
 * every thread count.
 *
 * CUDA (suffix _cuda, same arguments, every pointer on the device): f32,
 * f64 and bf16 (bf16 in and out, f32 inside; rstd stays f64; dw is f32,
 * ml_grad_dtype, the mixed-precision weight gradient). A row's sums
 * run in the compute type in a fixed tree; dw sums the CPU's f64 terms in
 * 32 row slices, then the slices in order (rmsnorm.cu). Deterministic;
 * parity with the CPU is a normwise tolerance.
 *
 * Not here: allocation, Lua.
 */
#ifndef ML_KERNELS_RMSNORM_H
#define ML_KERNELS_RMSNORM_H

#include "core.h"

/* Forward.
 *   y    [N, D] dt    =   x * rstd * w
 *   rstd [N] f64      =   saved for the backward
 *   x    [N, D] dt, w [D] dt, eps >= 0 */
ml_status ml_rmsnorm_forward_cpu(ml_dtype dt, void *y, double *rstd, const void *x, const void *w,
                                 int64_t N, int64_t D, double eps, const ml_kctx *ctx);
ml_status ml_rmsnorm_forward_cuda(ml_dtype dt, void *y, double *rstd, const void *x, const void *w,
                                  int64_t N, int64_t D, double eps, const ml_kctx *ctx);

/* Backward.
 *   dx   [N, D] dt    =   rstd * (g - x * rstd^2 * mean(g * x)),  g = dy * w
 *   dw   [D] gdt      +=  sum_n dy[n] * x[n] * rstd[n] (f64, row order, rounded
 *                         once to gdt = ml_grad_dtype(dt): f32 for bf16, else dt)
 *   dy   [N, D] dt, x [N, D] dt, w [D] dt, rstd [N] f64 (from the forward) */
ml_status ml_rmsnorm_backward_cpu(ml_dtype dt, void *dx, void *dw, const void *dy, const void *x,
                                  const void *w, const double *rstd, int64_t N, int64_t D,
                                  const ml_kctx *ctx);
ml_status ml_rmsnorm_backward_cuda(ml_dtype dt, void *dx, void *dw, const void *dy, const void *x,
                                   const void *w, const double *rstd, int64_t N, int64_t D,
                                   const ml_kctx *ctx);

#endif
