/*
 * kernels/index.cu - index_select, gather, scatter_add, bincount (CUDA).
 * Indices are int64, 0-based and validated by the binding. Every output
 * element has one writer: scatter_add gives each output column (o, i) to
 * one thread that adds the sources j = 0..m-1 in order, exactly as the CPU
 * does, so it is bit-identical and uses no float atomics. bincount adds
 * integers with atomics (integer addition is associative: deterministic).
 */
#include "cuda_common.cuh"

extern "C" {
#include "index.h"
}

template <typename T>
__global__ void index_select_kernel(T *out, const T *in, const int64_t *idx,
                                    int64_t total, int64_t n, int64_t inner, int64_t m)
{
    ML_CUDA_FOR(q, total) {
        int64_t i = q % inner, row = q / inner, o = row / m, j = row % m;
        out[q] = in[(o * n + idx[j]) * inner + i];
    }
}

template <typename T>
__global__ void gather_kernel(T *out, const T *in, const int64_t *idx,
                              int64_t total, int64_t n, int64_t inner, int64_t m)
{
    ML_CUDA_FOR(q, total) {
        int64_t i = q % inner, o = q / (m * inner);
        out[q] = in[(o * n + idx[q]) * inner + i];
    }
}

template <typename T>
static void index_launch(int gather, void *out, const void *in, const int64_t *idx,
                         int64_t total, int64_t n, int64_t inner, int64_t m, cudaStream_t st)
{
    unsigned blocks = ml_cuda_blocks(total, ML_CUDA_THREADS);
    if (gather)
        gather_kernel<T><<<blocks, ML_CUDA_THREADS, 0, st>>>((T *)out, (const T *)in, idx, total, n, inner, m);
    else
        index_select_kernel<T><<<blocks, ML_CUDA_THREADS, 0, st>>>((T *)out, (const T *)in, idx, total, n, inner, m);
}

static ml_status index_common(int gather, ml_dtype dt, void *out, const void *in, const int64_t *idx,
                              int64_t outer, int64_t n, int64_t inner, int64_t m, const ml_kctx *ctx)
{
    int64_t total = outer * m * inner;
    if (total <= 0)
        return ML_OK;
    if (ml_kctx_interrupted(ctx))
        return ML_EINTERRUPTED;
    cudaStream_t st = ml_cuda_stream(ctx);
    switch (ml_dtype_size(dt)) {
    case 1:  index_launch<uint8_t>(gather, out, in, idx, total, n, inner, m, st); break;
    case 2:  index_launch<uint16_t>(gather, out, in, idx, total, n, inner, m, st); break;
    case 4:  index_launch<uint32_t>(gather, out, in, idx, total, n, inner, m, st); break;
    default: index_launch<uint64_t>(gather, out, in, idx, total, n, inner, m, st); break;
    }
    return ml_cuda_launched();
}

extern "C" ml_status ml_index_select_cuda(ml_dtype dt, void *out, const void *in, const int64_t *idx,
                                          int64_t outer, int64_t n, int64_t inner, int64_t m,
                                          const ml_kctx *ctx)
{
    return index_common(0, dt, out, in, idx, outer, n, inner, m, ctx);
}

extern "C" ml_status ml_gather_cuda(ml_dtype dt, void *out, const void *in, const int64_t *idx,
                                    int64_t outer, int64_t n, int64_t inner, int64_t m, const ml_kctx *ctx)
{
    return index_common(1, dt, out, in, idx, outer, n, inner, m, ctx);
}

/* One thread per output column (o, i), sources in index order. */
__global__ void scatter_add_kernel(ml_dtype dt, void *out, const void *src, const int64_t *idx,
                                   int64_t ncols, int64_t n, int64_t inner, int64_t m)
{
    ML_CUDA_FOR(q, ncols) {
        int64_t o = q / inner, i = q % inner;
        for (int64_t j = 0; j < m; j++) {
            size_t s = (size_t)((o * m + j) * inner + i);
            size_t d = (size_t)((o * n + idx[s]) * inner + i);
            if (dt == ML_F32)
                ((float *)out)[d] += ((const float *)src)[s];
            else
                ml_store(dt, out, d, ml_load(dt, out, d) + ml_load(dt, src, s));
        }
    }
}

extern "C" ml_status ml_scatter_add_cuda(ml_dtype dt, void *out, const void *src, const int64_t *idx,
                                         int64_t outer, int64_t n, int64_t inner, int64_t m,
                                         const ml_kctx *ctx)
{
    if (dt != ML_F32 && dt != ML_F64 && dt != ML_I32 && dt != ML_I64)
        return ML_EUNSUPPORTED;
    int64_t ncols = outer * inner;
    if (ncols <= 0 || m <= 0)
        return ML_OK;
    if (ml_kctx_interrupted(ctx))
        return ML_EINTERRUPTED;
    scatter_add_kernel<<<ml_cuda_blocks(ncols, ML_CUDA_THREADS), ML_CUDA_THREADS, 0, ml_cuda_stream(ctx)>>>(
        dt, out, src, idx, ncols, n, inner, m);
    return ml_cuda_launched();
}

__global__ void bincount_kernel(unsigned long long *counts, const int64_t *idx, int64_t n)
{
    ML_CUDA_FOR(i, n) atomicAdd(counts + idx[i], 1ULL);
}

extern "C" ml_status ml_bincount_cuda(int64_t *counts, const int64_t *idx, int64_t n, int64_t nbins,
                                      const ml_kctx *ctx)
{
    if (nbins <= 0)
        return ML_OK;
    if (ml_kctx_interrupted(ctx))
        return ML_EINTERRUPTED;
    cudaStream_t st = ml_cuda_stream(ctx);
    ml_status s = ml_cuda_status(cudaMemsetAsync(counts, 0, (size_t)nbins * sizeof *counts, st));
    if (s != ML_OK || n <= 0)
        return s;
    bincount_kernel<<<ml_cuda_blocks(n, ML_CUDA_THREADS), ML_CUDA_THREADS, 0, st>>>(
        (unsigned long long *)counts, idx, n);
    return ml_cuda_launched();
}
