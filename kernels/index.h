/*
 * kernels/index.h - index_select, gather, scatter_add, bincount. Index
 * buffers are int64 and 0-based (the convention of the data the kernels
 * share with files and Hugging Face). Indices are validated by the
 * binding before the kernel runs; kernels trust them.
 *
 * scatter_add is deterministic: each output column is accumulated in index
 * order by one thread, no atomics.
 */
#ifndef ML_KERNELS_INDEX_H
#define ML_KERNELS_INDEX_H

#include "core.h"

/* in [outer, n, inner], idx [m] -> out [outer, m, inner] (=). Any dtype. */
ml_status ml_index_select_cpu(ml_dtype dt, void *out, const void *in, const int64_t *idx,
                              int64_t outer, int64_t n, int64_t inner, int64_t m, const ml_kctx *ctx);
ml_status ml_index_select_cuda(ml_dtype dt, void *out, const void *in, const int64_t *idx,
                               int64_t outer, int64_t n, int64_t inner, int64_t m, const ml_kctx *ctx);

/* in [outer, n, inner], idx [outer, m, inner] -> out[o, j, i] = in[o, idx[o, j, i], i] (=). Any dtype. */
ml_status ml_gather_cpu(ml_dtype dt, void *out, const void *in, const int64_t *idx,
                        int64_t outer, int64_t n, int64_t inner, int64_t m, const ml_kctx *ctx);
ml_status ml_gather_cuda(ml_dtype dt, void *out, const void *in, const int64_t *idx,
                         int64_t outer, int64_t n, int64_t inner, int64_t m, const ml_kctx *ctx);

/* out [outer, n, inner] += src[o, j, i] at out[o, idx[o, j, i], i], j in
 * order. f32, f64, i32, i64. */
ml_status ml_scatter_add_cpu(ml_dtype dt, void *out, const void *src, const int64_t *idx,
                             int64_t outer, int64_t n, int64_t inner, int64_t m, const ml_kctx *ctx);
ml_status ml_scatter_add_cuda(ml_dtype dt, void *out, const void *src, const int64_t *idx,
                              int64_t outer, int64_t n, int64_t inner, int64_t m, const ml_kctx *ctx);

/* counts[b] = #{ i : idx[i] == b } for b < nbins (=). */
ml_status ml_bincount_cpu(int64_t *counts, const int64_t *idx, int64_t n, int64_t nbins, const ml_kctx *ctx);
ml_status ml_bincount_cuda(int64_t *counts, const int64_t *idx, int64_t n, int64_t nbins, const ml_kctx *ctx);

#endif
