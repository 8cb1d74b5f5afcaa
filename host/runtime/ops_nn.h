/*
 * host/runtime/ops_nn.h - the op layer of the dense model's kernel families
 * (kernels/rmsnorm.h, embedding.h, crossentropy.h, rope.h, attention.h have
 * the semantics): each op checks its tensors (one device, one float dtype,
 * contiguous, matching shapes), allocates the outputs it is given empty
 * (host/runtime/op.h) and calls the device's kernel through ML_KCALL.
 *
 * Not here: Lua (host/bindings/l_ops.c binds these as moelua.ops), modules
 * and parameters (lua/moelua/nn).
 */
#ifndef ML_OPS_NN_H
#define ML_OPS_NN_H

#include "op.h"

/* y [..., D] = x / rms(x) * w, rstd [N] f64 saved for the backward
 * (N = numel(x) / D); y and rstd are overwritten. eps >= 0. */
ml_status ml_op_rmsnorm_forward(ml_host *h, ml_tensor *y, ml_tensor *rstd, const ml_tensor *x,
                                const ml_tensor *w, double eps, ml_err *e);
/* dx (=) and dw [D] (+=; allocated as zeros when empty). */
ml_status ml_op_rmsnorm_backward(ml_host *h, ml_tensor *dx, ml_tensor *dw, const ml_tensor *dy,
                                 const ml_tensor *x, const ml_tensor *w, const ml_tensor *rstd,
                                 ml_err *e);

#endif
