/*
 * host/runtime/ops_view.h - the op layer of tensor geometry and data
 * movement: views (narrow, select, view/reshape, view_at, transpose) that
 * share their input's storage, copies between dtypes and devices, fills,
 * arange and random draws. Views compute their geometry into an output
 * ml_tensor whose storage is NULL, and retain the input's storage.
 *
 * Dims, starts and indices are 0-based here; the Lua bindings
 * (host/bindings/l_tensor.c) convert their 1-based arguments. Not here:
 * the host generator's counter (the caller chooses seed and offset and
 * advances it), elementwise math (host/runtime/ops_math.h).
 */
#ifndef ML_OPS_VIEW_H
#define ML_OPS_VIEW_H

#include "op.h"

/* ---- views: out (storage NULL) becomes a view sharing t's storage ---- */

/* Rows [start, start + len) of dim d. */
ml_status ml_op_narrow(ml_tensor *out, const ml_tensor *t, int d, int64_t start, int64_t len,
                       ml_err *e);
/* Index i of dim d, that dim removed. */
ml_status ml_op_select(ml_tensor *out, const ml_tensor *t, int d, int64_t i, ml_err *e);
/* t (contiguous) seen with another shape of as many elements; one -1 in
 * shape is inferred. */
ml_status ml_op_view(ml_tensor *out, const ml_tensor *t, int ndim, const int64_t *shape,
                     ml_err *e);
/* The same for any t: a view when t is contiguous, else a contiguous copy. */
ml_status ml_op_reshape(ml_host *h, ml_tensor *out, const ml_tensor *t, int ndim,
                        const int64_t *shape, ml_err *e);
/* A contiguous view of `shape` starting `offset` elements into t
 * (contiguous): the flat-unit layout's views. */
ml_status ml_op_view_at(ml_tensor *out, const ml_tensor *t, int64_t offset, int ndim,
                        const int64_t *shape, ml_err *e);
/* Dims a and b swapped (strides only). */
ml_status ml_op_transpose(ml_tensor *out, const ml_tensor *t, int a, int b, ml_err *e);

/* ---- data ---- */

/* dst = src (same shape, any strides), converting dtype; across devices
 * through a contiguous staging copy and one memcpy. Overlapping views of
 * one storage go through a temporary. */
ml_status ml_op_copy(ml_host *h, ml_tensor *dst, const ml_tensor *src, ml_err *e);
/* out = t when t is contiguous (a view), else a contiguous copy of t on
 * its device; out's storage must be NULL. */
ml_status ml_op_contiguous(ml_host *h, ml_tensor *out, const ml_tensor *t, ml_err *e);
/* Every element of t (any strides) = v. */
ml_status ml_op_fill(ml_host *h, ml_tensor *t, double v, ml_err *e);
/* out [n] = start, start + step, ... below stop (Python's range), of dt
 * on dev; out is allocated (storage NULL) or checked. */
ml_status ml_op_arange(ml_host *h, ml_tensor *out, ml_device dev, ml_dtype dt, double start,
                       double stop, double step, ml_err *e);
/* t (contiguous, a float dtype) = uniform draws in [lo, hi) or normal draws
 * (mean, std) of the Philox stream (seed, offset): element i uses counter
 * offset + i/4 (DESIGN.md, Tensors); (numel + 3) / 4 counters are used. */
ml_status ml_op_rand(ml_host *h, ml_tensor *t, uint64_t seed, uint64_t offset, double lo,
                     double hi, ml_err *e);
ml_status ml_op_randn(ml_host *h, ml_tensor *t, uint64_t seed, uint64_t offset, double mean,
                      double std, ml_err *e);

#endif
