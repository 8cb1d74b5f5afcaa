/*
 * kernels/cuda_common.cuh - what every CUDA kernel family shares: the
 * stream of a kernel context, grid sizing for grid-stride loops, the
 * launch check that turns a CUDA error into ML_EDEVICE (kernels never
 * raise; the binding does, after the call returns).
 *
 * Not here: allocation (host/runtime/backend_cuda.c owns device memory; a
 * kernel's scratch is passed in by its caller, so the ledger counts it) and
 * any kernel of a family. Include from .cu files only.
 */
#ifndef ML_KERNELS_CUDA_COMMON_CUH
#define ML_KERNELS_CUDA_COMMON_CUH

#include <cuda_runtime.h>

extern "C" {
#include "core.h"
#include "cuda_util.h"
}

#define ML_CUDA_THREADS 256
/* Grid-stride loops cover any n with at most this many blocks. */
#define ML_CUDA_MAX_BLOCKS 65536

static inline cudaStream_t ml_cuda_stream(const ml_kctx *ctx)
{
    return ctx ? (cudaStream_t)ctx->stream : (cudaStream_t)0;
}

static inline unsigned ml_cuda_blocks(int64_t n, int threads)
{
    int64_t b = (n + threads - 1) / threads;
    if (b < 1)
        b = 1;
    return (unsigned)(b < ML_CUDA_MAX_BLOCKS ? b : ML_CUDA_MAX_BLOCKS);
}

/* ML_OK for cudaSuccess; anything else is recorded (ml_cuda_error_string)
 * and becomes ML_EDEVICE. */
static inline ml_status ml_cuda_status(cudaError_t e)
{
    if (e == cudaSuccess)
        return ML_OK;
    ml_cuda_note_error(cudaGetErrorName(e), (int)e, cudaGetErrorString(e));
    return ML_EDEVICE;
}

/* After a <<<>>> launch (or a library call that launches): a bad
 * configuration shows up here; faults inside the kernel show up at the
 * next synchronising call (memcpy, synchronize), unless MOELUA_CUDA_SYNC=1
 * (ml_cuda_sync_debug), which waits here so the launching call reports
 * them. */
static inline ml_status ml_cuda_launched(void)
{
    ml_status s = ml_cuda_status(cudaGetLastError());
    if (s == ML_OK && ml_cuda_sync_debug())
        s = ml_cuda_status(cudaDeviceSynchronize());
    return s;
}

/* Grid-stride loop over [0, n) with 64-bit indices. */
#define ML_CUDA_FOR(i, n)                                                     \
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n); \
         i += (int64_t)gridDim.x * blockDim.x)

#endif
