/*
 * kernels/reduce.h - sum, mean, max, argmax over one dim or the whole
 * tensor, and cumsum.
 *
 * Summation order is fixed by the shape alone, never by the thread count:
 * a total sum splits the input into fixed blocks of ML_REDUCE_BLOCK
 * elements, sums each block sequentially in f64, and adds the block
 * partials in block order; a sum over a dim runs sequentially in f64 along
 * that dim for each output. So sum and mean are bit-identical for any
 * number of threads (DESIGN.md, Tensors).
 */
#ifndef ML_KERNELS_REDUCE_H
#define ML_KERNELS_REDUCE_H

#include "core.h"

#define ML_REDUCE_BLOCK 4096

typedef enum { ML_RSUM, ML_RMEAN, ML_RMAX, ML_RMIN, ML_NREDOPS } ml_redop;

/* in viewed as [outer, r, inner]; out[o, i] = op_j in[o, j, i] (out is
 * [outer, inner], overwritten). For ML_RMAX / ML_RMIN, idx (may be NULL)
 * receives the first position of the extremum (0-based); a NaN wins both.
 * f32, f64. */
ml_status ml_reduce_cpu(ml_redop op, ml_dtype dt, void *out, int64_t *idx, const void *in,
                        int64_t outer, int64_t r, int64_t inner, const ml_kctx *ctx);
ml_status ml_reduce_cuda(ml_redop op, ml_dtype dt, void *out, int64_t *idx, const void *in,
                         int64_t outer, int64_t r, int64_t inner, const ml_kctx *ctx);

/* out[0] = op over all n elements (idx as above, may be NULL). f32, f64. */
/* scratch: ml_reduce_all_scratch_bytes_cuda(n) bytes on CUDA (the block
 * partials of one pass and the running result), none on the CPU. */
ml_status ml_reduce_all_cpu(ml_redop op, ml_dtype dt, void *out, int64_t *idx, const void *in,
                            int64_t n, void *scratch, const ml_kctx *ctx);
ml_status ml_reduce_all_cuda(ml_redop op, ml_dtype dt, void *out, int64_t *idx, const void *in,
                             int64_t n, void *scratch, const ml_kctx *ctx);

/* Super blocks per pass of the CUDA total (reduce.cu). */
#define ML_REDUCE_CUDA_PASS 64
/* Bytes of 8-aligned device scratch ml_reduce_all_cuda needs (about 1 MiB,
 * whatever n). Plain C (reduce.c, every build), so a plan of a CUDA run
 * books it. */
size_t ml_reduce_all_scratch_bytes_cuda(int64_t n);

/* *out = sum of x[i] (square: of x[i]^2) over n elements in f64, in the
 * fixed blocks above: the deterministic total every whole-tensor sum and
 * norm on the CPU uses (ml_reduce_all_cpu, ml_sumsq_cpu). Bit-identical
 * for every thread count. f32, f64 (ML_EUNSUPPORTED otherwise). */
ml_status ml_block_sum_cpu(ml_dtype dt, double *out, const void *x, int64_t n, int square,
                           const ml_kctx *ctx);

/* Inclusive prefix sum along the middle dim of [outer, r, inner], f64
 * accumulator. f32, f64, i32, i64. */
ml_status ml_cumsum_cpu(ml_dtype dt, void *out, const void *in,
                        int64_t outer, int64_t r, int64_t inner, const ml_kctx *ctx);
ml_status ml_cumsum_cuda(ml_dtype dt, void *out, const void *in,
                         int64_t outer, int64_t r, int64_t inner, const ml_kctx *ctx);

#endif
