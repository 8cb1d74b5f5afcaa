/*
 * kernels/philox.h - Philox-4x32-10 (Salmon et al., Random123) and the
 * uniform / normal draws built on it, addressed by counter, never by call
 * order (DESIGN.md, Tensors).
 *
 * Element i of a draw at `offset` uses the 64-bit counter offset + i/4 in
 * words 0-1 and lane i % 4 of the output. Uniforms use word 2 = 0. A normal
 * takes u1 from word 2 = 0 and u2 from word 2 = 1 at the same counter and
 * lane (Box-Muller, cosine branch), so every element is a pure function of
 * (key, offset, i): chunking and thread count never change it. A draw of n
 * elements consumes ceil(n/4) counters.
 */
#ifndef ML_KERNELS_PHILOX_H
#define ML_KERNELS_PHILOX_H

#include "core.h"

#if defined(__CUDACC__)
#define ML_HD __host__ __device__
#else
#define ML_HD
#endif

/* One Philox-4x32-10 block: out = philox(ctr, key). */
static inline ML_HD void ml_philox4x32_10(const uint32_t ctr_in[4], const uint32_t key_in[2], uint32_t out[4])
{
    uint32_t c0 = ctr_in[0], c1 = ctr_in[1], c2 = ctr_in[2], c3 = ctr_in[3];
    uint32_t k0 = key_in[0], k1 = key_in[1];
    for (int r = 0; r < 10; r++) {
        uint64_t p0 = (uint64_t)0xD2511F53u * c0;
        uint64_t p1 = (uint64_t)0xCD9E8D57u * c2;
        uint32_t hi0 = (uint32_t)(p0 >> 32), lo0 = (uint32_t)p0;
        uint32_t hi1 = (uint32_t)(p1 >> 32), lo1 = (uint32_t)p1;
        c0 = hi1 ^ c1 ^ k0;
        c1 = lo1;
        c2 = hi0 ^ c3 ^ k1;
        c3 = lo0;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    out[0] = c0; out[1] = c1; out[2] = c2; out[3] = c3;
}

/* out[i] = lo + (hi - lo) * u, u = (lane >> 8) * 2^-24 in [0, 1): 24 bits,
 * exact in f32, so CPU and CUDA agree bitwise. Computed in f64, rounded
 * once to the target. Any float dtype. */
ml_status ml_rand_cpu(ml_dtype dt, void *out, int64_t n, uint64_t seed, uint64_t offset,
                      double lo, double hi, const ml_kctx *ctx);
ml_status ml_rand_cuda(ml_dtype dt, void *out, int64_t n, uint64_t seed, uint64_t offset,
                       double lo, double hi, const ml_kctx *ctx);

/* out[i] = mean + std * sqrt(-2 ln u1) cos(2 pi u2), u1 = ((lane0 >> 8) + 1) * 2^-24
 * in (0, 1], u2 = (lane1 >> 8) * 2^-24, in f64, rounded once. Any float dtype. */
ml_status ml_randn_cpu(ml_dtype dt, void *out, int64_t n, uint64_t seed, uint64_t offset,
                       double mean, double std, const ml_kctx *ctx);
ml_status ml_randn_cuda(ml_dtype dt, void *out, int64_t n, uint64_t seed, uint64_t offset,
                        double mean, double std, const ml_kctx *ctx);

#endif
