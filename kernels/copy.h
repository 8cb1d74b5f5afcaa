/*
 * kernels/copy.h - strided copy with dtype conversion: contiguous(), clone,
 * cast and copy_ into a view are all this one kernel.
 *
 * Conversions: floats round to nearest even (bf16/f16 keep NaN a NaN);
 * float -> integer truncates toward zero, saturates at the integer's range
 * and maps NaN to 0 (a defined result, never undefined behaviour).
 */
#ifndef ML_KERNELS_COPY_H
#define ML_KERNELS_COPY_H

#include "core.h"

/* out[idx . out_stride] = convert(in[idx . in_stride]) for every idx in shape.
 * Strides in elements. out is overwritten; out and in must not overlap
 * unless they are the same buffer with the same strides and dtype. */
ml_status ml_copy_cpu(ml_dtype dt_out, void *out, const int64_t *out_stride,
                      ml_dtype dt_in, const void *in, const int64_t *in_stride,
                      int ndim, const int64_t *shape, const ml_kctx *ctx);
ml_status ml_copy_cuda(ml_dtype dt_out, void *out, const int64_t *out_stride,
                       ml_dtype dt_in, const void *in, const int64_t *in_stride,
                       int ndim, const int64_t *shape, const ml_kctx *ctx);

#endif
