/*
 * kernels/softmax.cu - row softmax / log-softmax (CUDA): one block per row,
 * row max and sum of exp(x - max) in f64 as on the CPU. Each thread
 * accumulates a fixed strided slice of the row and the block combines the
 * partials in a fixed tree, so results are deterministic run to run; the
 * order differs from the CPU's sequential sum and exp is CUDA's, so parity
 * with kernels/softmax.c is a normwise tolerance (GPU spec), not bitwise.
 * A NaN anywhere in a row makes the row max NaN, hence the row NaN, as on
 * the CPU.
 */
#include "cuda_common.cuh"
#include "cuda_float.cuh"

extern "C" {
#include "softmax.h"
}

#define SM_THREADS 128

__global__ void __launch_bounds__(SM_THREADS)
softmax_kernel(int log_out, ml_dtype dt, void *out, const void *in, int64_t rows, int64_t cols)
{
    __shared__ double red[SM_THREADS];
    for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
        size_t base = (size_t)(r * cols);
        double mx = -INFINITY;
        for (int64_t j = threadIdx.x; j < cols; j += SM_THREADS) {
            double v = ml_load(dt, in, base + (size_t)j);
            if (v > mx || v != v) mx = v;
            if (mx != mx) break;
        }
        mx = ml_block_nanmax(red, mx);
        double sum = 0;
        for (int64_t j = threadIdx.x; j < cols; j += SM_THREADS)
            sum += exp(ml_load(dt, in, base + (size_t)j) - mx);
        sum = ml_block_sum(red, sum);
        double lse = log(sum);
        for (int64_t j = threadIdx.x; j < cols; j += SM_THREADS) {
            double z = ml_load(dt, in, base + (size_t)j) - mx;
            ml_store(dt, out, base + (size_t)j, log_out ? z - lse : exp(z) / sum);
        }
    }
}

extern "C" ml_status ml_softmax_cuda(int log, ml_dtype dt, void *out, const void *in,
                                     int64_t rows, int64_t cols, const ml_kctx *ctx)
{
    if (dt != ML_F32 && dt != ML_F64)
        return ML_EUNSUPPORTED;
    if (rows <= 0 || cols <= 0)
        return ML_OK;
    if (ml_kctx_interrupted(ctx))
        return ML_EINTERRUPTED;
    unsigned blocks = (unsigned)(rows < ML_CUDA_MAX_BLOCKS ? rows : ML_CUDA_MAX_BLOCKS);
    softmax_kernel<<<blocks, SM_THREADS, 0, ml_cuda_stream(ctx)>>>(log, dt, out, in, rows, cols);
    return ml_cuda_launched();
}
