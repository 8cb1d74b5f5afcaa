/*
 * kernels/topk.cu - per-row top-k (CUDA): one thread per row running the
 * CPU's insertion into the sorted output row (kernels/topk.c), so values
 * and indices are identical to the CPU's, ties to the lower index. Made
 * for routing (cols = experts, small k): a row with very many columns is
 * one thread's sequential scan.
 *
 * A NaN sets a flag in the caller's scratch that the call reads back, so
 * ml_topk_cuda synchronises its stream and returns ML_ENAN like the CPU.
 */
#include "cuda_common.cuh"

extern "C" {
#include "topk.h"
}

#define KBUF 64   /* row buffer for k <= 64; larger k re-reads the input, as on the CPU */

/* nan: the call's flag (its scratch), set when a row held a NaN. */
__global__ void topk_kernel(ml_dtype dt, void *values, int64_t *indices, const void *in,
                            int64_t rows, int64_t cols, int64_t k, int *nan)
{
    ML_CUDA_FOR(r, rows) {
        int64_t *ix = indices + r * k;
        size_t in0 = (size_t)(r * cols);
        double vals[KBUF];
        int64_t n = 0;
        int saw_nan = 0;
        for (int64_t j = 0; j < cols; j++) {
            double v = ml_load(dt, in, in0 + (size_t)j);
            if (v != v) {
                saw_nan = 1;
                v = -INFINITY;
            }
            if (n == k) {
                double last = k <= KBUF ? vals[n - 1] : ml_load(dt, in, in0 + (size_t)ix[n - 1]);
                if (!(v > last))
                    continue;
                n--;
            }
            int64_t pos = n;
            while (pos > 0) {
                double prev = k <= KBUF ? vals[pos - 1] : ml_load(dt, in, in0 + (size_t)ix[pos - 1]);
                if (!(v > prev))
                    break;
                if (k <= KBUF)
                    vals[pos] = vals[pos - 1];
                ix[pos] = ix[pos - 1];
                pos--;
            }
            if (k <= KBUF)
                vals[pos] = v;
            ix[pos] = j;
            n++;
        }
        for (int64_t q = 0; q < k; q++)
            ml_store(dt, values, (size_t)(r * k + q), ml_load(dt, in, in0 + (size_t)ix[q]));
        if (saw_nan)
            *nan = 1;   /* plain store of a constant: no race on the outcome */
    }
}

extern "C" ml_status ml_topk_cuda(ml_dtype dt, void *values, int64_t *indices, const void *in,
                                  int64_t rows, int64_t cols, int64_t k, void *scratch,
                                  const ml_kctx *ctx)
{
    if (dt != ML_F32 && dt != ML_F64)
        return ML_EUNSUPPORTED;
    if (k == 0 || rows <= 0)
        return ML_OK;
    if (k > cols)
        return ML_EUNSUPPORTED;   /* the binding checks k <= cols; never index past a row */
    if (ml_kctx_interrupted(ctx))
        return ML_EINTERRUPTED;
    cudaStream_t st = ml_cuda_stream(ctx);
    int nan = 0, *dnan = (int *)scratch;
    ml_status s = ml_cuda_status(cudaMemsetAsync(dnan, 0, sizeof *dnan, st));
    if (s == ML_OK) {
        topk_kernel<<<ml_cuda_blocks(rows, 128), 128, 0, st>>>(dt, values, indices, in, rows, cols, k,
                                                               dnan);
        s = ml_cuda_launched();
    }
    if (s == ML_OK)
        s = ml_cuda_status(cudaMemcpyAsync(&nan, dnan, sizeof nan, cudaMemcpyDeviceToHost, st));
    if (s == ML_OK)
        s = ml_cuda_status(cudaStreamSynchronize(st));
    if (s != ML_OK)
        return s;
    return nan ? ML_ENAN : ML_OK;
}
