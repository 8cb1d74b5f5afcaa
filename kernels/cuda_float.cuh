/*
 * kernels/cuda_float.cuh - the float storage types of the CUDA dense
 * families (rmsnorm, rope, embedding, crossentropy), elementwise and the
 * router, and what they share: each storage type's compute type, its load
 * and its rounding store, and a block sum in a fixed tree order.
 *
 * f32 and f64 compute in themselves; bf16 is stored as its 16 bits
 * (ml_bf16) and computes in f32, rounded to nearest even on store by
 * core.h's conversion, so CPU and CUDA round alike and NaN stays NaN.
 *
 * Not here: kernels of a family, launch checks (cuda_common.cuh). Include
 * from .cu files only, after cuda_common.cuh.
 */
#ifndef ML_KERNELS_CUDA_FLOAT_CUH
#define ML_KERNELS_CUDA_FLOAT_CUH

#include "cuda_common.cuh"

/* A bf16 element: a distinct type, so a template never mistakes it for an
 * integer or an f16. */
struct ml_bf16 {
    uint16_t bits;
};

template <typename T> struct ml_float;

template <> struct ml_float<float> {
    typedef float acc;
    static __device__ __forceinline__ float load(float v) { return v; }
    static __device__ __forceinline__ float store(float v) { return v; }
};

template <> struct ml_float<double> {
    typedef double acc;
    static __device__ __forceinline__ double load(double v) { return v; }
    static __device__ __forceinline__ double store(double v) { return v; }
};

template <> struct ml_float<ml_bf16> {
    typedef float acc;
    static __device__ __forceinline__ float load(ml_bf16 v) { return ml_bf16_to_f32(v.bits); }
    static __device__ __forceinline__ ml_bf16 store(float v)
    {
        ml_bf16 r;
        r.bits = ml_f32_to_bf16(v);
        return r;
    }
};

/* The sum of every thread's v, returned to every thread: the partials are
 * added in a fixed tree (stride halving), so the result does not depend on
 * timing. red holds blockDim.x elements; blockDim.x is a power of two. All
 * threads of the block must call it (it synchronises). */
template <typename A>
__device__ __forceinline__ A ml_block_sum(A *red, A v)
{
    red[threadIdx.x] = v;
    __syncthreads();
    for (unsigned w = blockDim.x / 2; w > 0; w >>= 1) {
        if (threadIdx.x < w)
            red[threadIdx.x] += red[threadIdx.x + w];
        __syncthreads();
    }
    A s = red[0];
    __syncthreads();   /* red is free again when this returns */
    return s;
}

/* NaN wins, as in a sequential max that starts from a NaN-free value and
 * keeps any NaN it meets. */
__device__ __forceinline__ double ml_nanmax(double a, double b)
{
    if (a != a) return a;
    if (b != b) return b;
    return b > a ? b : a;
}

/* The ml_nanmax of every thread's v, returned to every thread, in
 * ml_block_sum's fixed tree; the same calling rules. */
__device__ __forceinline__ double ml_block_nanmax(double *red, double v)
{
    red[threadIdx.x] = v;
    __syncthreads();
    for (unsigned w = blockDim.x / 2; w > 0; w >>= 1) {
        if (threadIdx.x < w)
            red[threadIdx.x] = ml_nanmax(red[threadIdx.x], red[threadIdx.x + w]);
        __syncthreads();
    }
    double m = red[0];
    __syncthreads();
    return m;
}

#endif
