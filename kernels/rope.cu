/*
 * kernels/rope.cu - rotate-half RoPE (CUDA; see rope.h).
 *
 * One thread per (token s, pair i): it computes the angle once, as the CPU
 * does, (offset + s) * theta^(-2i/hd) in f64, takes cos and sin in f64 and
 * rounds them to the compute type (f32 for f32 and bf16, f64 for f64), then
 * rotates pair i of every head: the rotation is evaluated in f64 and
 * rounded once to the dtype (bf16: to f32, then to nearest even bf16, the
 * same two roundings as the CPU's f32 result rounded to bf16). CUDA's pow,
 * cos and sin are within 2 ulp of glibc's, hence a normwise tolerance
 * against the CPU. y may alias x: each thread reads its pair before it
 * writes it, and no other thread touches that pair.
 */
#include "cuda_float.cuh"

extern "C" {
#include "rope.h"
}

template <typename T>
__global__ void rope_kernel(T *y, const T *x, int64_t S, int64_t heads, int64_t hd, int64_t offset,
                            double theta, double sign)
{
    typedef ml_float<T> F;
    typedef typename F::acc A;
    int64_t half = hd / 2;
    ML_CUDA_FOR(q, S * half) {
        int64_t s = q / half, i = q % half;
        double ang = (double)(offset + s) * pow(theta, -(double)(2 * i) / (double)hd);
        double c = (double)(A)cos(ang), sn = sign * (double)(A)sin(ang);
        for (int64_t h = 0; h < heads; h++) {
            int64_t base = (s * heads + h) * hd;
            double x0 = (double)F::load(x[base + i]), x1 = (double)F::load(x[base + i + half]);
            y[base + i] = F::store((A)(x0 * c - x1 * sn));
            y[base + i + half] = F::store((A)(x1 * c + x0 * sn));
        }
    }
}

template <typename T>
static ml_status rope_launch(void *y, const void *x, int64_t S, int64_t heads, int64_t hd,
                             int64_t offset, double theta, double sign, cudaStream_t st)
{
    rope_kernel<T><<<ml_cuda_blocks(S * (hd / 2), ML_CUDA_THREADS), ML_CUDA_THREADS, 0, st>>>(
        (T *)y, (const T *)x, S, heads, hd, offset, theta, sign);
    return ml_cuda_launched();
}

/* sign +1: the forward rotation, -1: its inverse */
static ml_status rope_run(ml_dtype dt, void *y, const void *x, int64_t S, int64_t heads,
                          int64_t hd, int64_t offset, double theta, double sign,
                          const ml_kctx *ctx)
{
    if (dt != ML_F32 && dt != ML_F64 && dt != ML_BF16)
        return ML_EUNSUPPORTED;
    if (S <= 0 || heads <= 0 || hd < 2)
        return ML_OK;
    if (ml_kctx_interrupted(ctx))
        return ML_EINTERRUPTED;
    cudaStream_t st = ml_cuda_stream(ctx);
    switch (dt) {
    case ML_F32: return rope_launch<float>(y, x, S, heads, hd, offset, theta, sign, st);
    case ML_F64: return rope_launch<double>(y, x, S, heads, hd, offset, theta, sign, st);
    default:     return rope_launch<ml_bf16>(y, x, S, heads, hd, offset, theta, sign, st);
    }
}

extern "C" ml_status ml_rope_forward_cuda(ml_dtype dt, void *y, const void *x, int64_t S,
                                          int64_t heads, int64_t hd, int64_t offset, double theta,
                                          const ml_kctx *ctx)
{
    return rope_run(dt, y, x, S, heads, hd, offset, theta, 1.0, ctx);
}

extern "C" ml_status ml_rope_backward_cuda(ml_dtype dt, void *dx, const void *dy, int64_t S,
                                           int64_t heads, int64_t hd, int64_t offset,
                                           double theta, const ml_kctx *ctx)
{
    return rope_run(dt, dx, dy, S, heads, hd, offset, theta, -1.0, ctx);
}
