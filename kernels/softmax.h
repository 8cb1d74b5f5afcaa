/*
 * kernels/softmax.h - softmax and log-softmax over the last dim of
 * [rows, cols], max-subtracted, accumulated in f64 per row.
 */
#ifndef ML_KERNELS_SOFTMAX_H
#define ML_KERNELS_SOFTMAX_H

#include "core.h"

/* out = softmax(in) (log_softmax when log != 0), row by row; out may alias
 * in. f32, f64. */
ml_status ml_softmax_cpu(int log, ml_dtype dt, void *out, const void *in,
                         int64_t rows, int64_t cols, const ml_kctx *ctx);
ml_status ml_softmax_cuda(int log, ml_dtype dt, void *out, const void *in,
                          int64_t rows, int64_t cols, const ml_kctx *ctx);

#endif
