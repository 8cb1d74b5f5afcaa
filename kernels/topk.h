/*
 * kernels/topk.h - the k largest values of each row, in descending order,
 * ties to the lower index (the same rule on every backend). A NaN in a row
 * is reported as ML_ENAN: routing refuses NaN logits.
 */
#ifndef ML_KERNELS_TOPK_H
#define ML_KERNELS_TOPK_H

#include "core.h"

/* values [rows, k] (dtype dt), indices [rows, k] (0-based) overwritten.
 * f32, f64. scratch: ml_topk_scratch_bytes_cuda bytes on CUDA (the NaN
 * flag), none on the CPU. */
ml_status ml_topk_cpu(ml_dtype dt, void *values, int64_t *indices, const void *in,
                      int64_t rows, int64_t cols, int64_t k, void *scratch, const ml_kctx *ctx);
ml_status ml_topk_cuda(ml_dtype dt, void *values, int64_t *indices, const void *in,
                       int64_t rows, int64_t cols, int64_t k, void *scratch, const ml_kctx *ctx);

/* Bytes of 8-aligned device scratch ml_topk_cuda needs: its NaN flag.
 * Plain C (topk.c, every build), so a plan of a CUDA run books it. */
size_t ml_topk_scratch_bytes_cuda(int64_t rows, int64_t cols, int64_t k);

#endif
