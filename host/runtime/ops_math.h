/*
 * host/runtime/ops_math.h - the op layer of tensor math: elementwise ops
 * with broadcasting, unary ops, reductions, cumsum, softmax, top-k, index
 * ops and matmul (kernels/elementwise.h, reduce.h, softmax.h, topk.h,
 * index.h, matmul.h have the semantics). Inputs may be strided views: an op
 * makes the contiguous copies its kernel needs and drops them before it
 * returns. Outputs follow host/runtime/op.h (allocated when empty, else
 * checked); where an op says so, out may be its first input (in place).
 *
 * Broadcasting: two tensors combine when their shapes are equal, when one
 * has a single element, or when the shorter shape equals the trailing dims
 * of the longer (a [D] bias over [T, D] activations).
 *
 * Dims are 0-based; index data is 0-based int64. Not here: Lua
 * (host/bindings/l_tensor_math.c), views and copies (ops_view.h).
 */
#ifndef ML_OPS_MATH_H
#define ML_OPS_MATH_H

#include "op.h"

/* out = a op b with broadcasting (same dtype and device); out == a: in
 * place (a contiguous, b broadcast into it). */
ml_status ml_op_binary(ml_host *h, ml_tensor *out, ml_binop op, const ml_tensor *a,
                       const ml_tensor *b, ml_err *e);
/* out = t op s, or s op t when scalar_first; out == t: in place. An
 * integer tensor takes only whole numbers. */
ml_status ml_op_binary_scalar(ml_host *h, ml_tensor *out, ml_binop op, const ml_tensor *t,
                              double s, int scalar_first, ml_err *e);
/* out = op(t); out == t: in place. Float dtypes; neg and abs also ints. */
ml_status ml_op_unary(ml_host *h, ml_tensor *out, ml_unop op, const ml_tensor *t, ml_err *e);
/* Reduce t (f32/f64) over dim d (d < 0: over everything, 0-dim results):
 * out (NULL: not wanted) the values, idx (NULL: not wanted) the i64
 * positions of max/min. max and min of nothing are refused. */
ml_status ml_op_reduce(ml_host *h, ml_tensor *out, ml_tensor *idx, ml_redop op,
                       const ml_tensor *t, int d, ml_err *e);
/* out = running sums of t along dim d (f32, f64, i32, i64). */
ml_status ml_op_cumsum(ml_host *h, ml_tensor *out, const ml_tensor *t, int d, ml_err *e);
/* out = softmax (log: log-softmax) of t (f32/f64) over its last dim. */
ml_status ml_op_softmax(ml_host *h, ml_tensor *out, const ml_tensor *t, int log, ml_err *e);
/* The k largest of each row of t's last dim: vals (t's dtype) and idx
 * (i64), ties to the lower index; a NaN is refused. */
ml_status ml_op_topk(ml_host *h, ml_tensor *vals, ml_tensor *idx, const ml_tensor *t, int64_t k,
                     ml_err *e);

/* Index ops. Every index is checked to lie in [0, bound) (on a host copy
 * for device indices; not inside a memory plan, where nothing was
 * computed). */
/* out = the entries idx [n] (1-dim) of dim d of t. */
ml_status ml_op_index_select(ml_host *h, ml_tensor *out, const ml_tensor *t, int d,
                             const ml_tensor *idx, ml_err *e);
/* out[.., j, ..] = t[.., idx[.., j, ..], ..] along d; idx matches t but in d. */
ml_status ml_op_gather(ml_host *h, ml_tensor *out, const ml_tensor *t, int d,
                       const ml_tensor *idx, ml_err *e);
/* t[.., idx[j], ..] += src[.., j, ..] along d, in place (t contiguous). */
ml_status ml_op_scatter_add(ml_host *h, ml_tensor *t, int d, const ml_tensor *idx,
                            const ml_tensor *src, ml_err *e);
/* out [nbins] i64 = how often each value occurs in idx (1-dim i64). */
ml_status ml_op_bincount(ml_host *h, ml_tensor *out, const ml_tensor *idx, int64_t nbins,
                         ml_err *e);

/* c = alpha * a b + beta * c for [m,k]x[k,n], [B,m,k]x[B,k,n] or
 * [B,m,k]x[k,n] (f32/f64). a and b may be transposed views (:t()), which
 * BLAS reads in place; other strided views are copied. c allocated by the
 * op: beta is ignored (c is not read). c given: contiguous, not
 * overlapping a or b. */
ml_status ml_op_matmul(ml_host *h, ml_tensor *c, const ml_tensor *a, const ml_tensor *b,
                       double alpha, double beta, ml_err *e);

#endif
