/*
 * kernels/philox.cu - counter-addressed uniform and normal draws (CUDA),
 * element i a pure function of (seed, offset, i) through the same
 * ml_philox4x32_10 as the CPU (kernels/philox.h). Uniforms are computed in
 * f64 without FMA contraction (--fmad=false) and rounded once by ml_store,
 * so they are bit-identical to kernels/philox.c; normals use CUDA's f64
 * log/cos and agree with the CPU to a few ulp of f64 (before rounding).
 */
#include "cuda_common.cuh"

extern "C" {
#include "philox.h"
}

__global__ void rng_kernel(ml_dtype dt, void *out, int64_t n, uint32_t k0, uint32_t k1, uint64_t offset,
                           double a, double b, int normal)
{
    const uint32_t key[2] = {k0, k1};
    ML_CUDA_FOR(i, n) {
        uint64_t ctr = offset + (uint64_t)i / 4;
        int lane = (int)(i % 4);
        uint32_t c[4] = {(uint32_t)ctr, (uint32_t)(ctr >> 32), 0, 0};
        uint32_t r0[4];
        ml_philox4x32_10(c, key, r0);
        double v;
        if (normal) {
            uint32_t r1[4];
            c[2] = 1;
            ml_philox4x32_10(c, key, r1);
            double u1 = ((double)(r0[lane] >> 8) + 1.0) * (1.0 / 16777216.0);
            double u2 = (double)(r1[lane] >> 8) * (1.0 / 16777216.0);
            v = a + b * sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
        } else {
            double u = (double)(r0[lane] >> 8) * (1.0 / 16777216.0);
            v = a + (b - a) * u;
        }
        ml_store(dt, out, (size_t)i, v);
    }
}

static ml_status draw(ml_dtype dt, void *out, int64_t n, uint64_t seed, uint64_t offset,
                      double a, double b, int normal, const ml_kctx *ctx)
{
    if (dt != ML_F32 && dt != ML_F64 && dt != ML_BF16 && dt != ML_F16)
        return ML_EUNSUPPORTED;
    if (n <= 0)
        return ML_OK;
    if (ml_kctx_interrupted(ctx))
        return ML_EINTERRUPTED;
    rng_kernel<<<ml_cuda_blocks(n, ML_CUDA_THREADS), ML_CUDA_THREADS, 0, ml_cuda_stream(ctx)>>>(
        dt, out, n, (uint32_t)seed, (uint32_t)(seed >> 32), offset, a, b, normal);
    return ml_cuda_launched();
}

extern "C" ml_status ml_rand_cuda(ml_dtype dt, void *out, int64_t n, uint64_t seed, uint64_t offset,
                                  double lo, double hi, const ml_kctx *ctx)
{
    return draw(dt, out, n, seed, offset, lo, hi, 0, ctx);
}

extern "C" ml_status ml_randn_cuda(ml_dtype dt, void *out, int64_t n, uint64_t seed, uint64_t offset,
                                   double mean, double std, const ml_kctx *ctx)
{
    return draw(dt, out, n, seed, offset, mean, std, 1, ctx);
}
