/*
 * kernels/philox.c - counter-addressed uniform and normal draws (CPU).
 */
#include "philox.h"
#include "parallel.h"

#include <math.h>

typedef struct {
    ml_dtype dt; void *out; uint32_t key[2]; uint64_t offset; double a, b; int normal;
} rng_arg;

static inline void block(const rng_arg *g, uint64_t ctr, uint32_t word2, uint32_t out[4])
{
    uint32_t c[4] = {(uint32_t)ctr, (uint32_t)(ctr >> 32), word2, 0};
    ml_philox4x32_10(c, g->key, out);
}

static void rng_tile(void *p, int64_t lo, int64_t hi)
{
    const rng_arg *g = p;
    for (int64_t i = lo; i < hi; i++) {
        uint64_t ctr = g->offset + (uint64_t)i / 4;
        int lane = (int)(i % 4);
        uint32_t r0[4];
        block(g, ctr, 0, r0);
        double v;
        if (g->normal) {
            uint32_t r1[4];
            block(g, ctr, 1, r1);
            double u1 = ((double)(r0[lane] >> 8) + 1.0) * (1.0 / 16777216.0);
            double u2 = (double)(r1[lane] >> 8) * (1.0 / 16777216.0);
            v = g->a + g->b * sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
        } else {
            double u = (double)(r0[lane] >> 8) * (1.0 / 16777216.0);
            v = g->a + (g->b - g->a) * u;
        }
        ml_store(g->dt, g->out, (size_t)i, v);
    }
}

static ml_status draw(ml_dtype dt, void *out, int64_t n, uint64_t seed, uint64_t offset,
                      double a, double b, int normal, const ml_kctx *ctx)
{
    if (dt != ML_F32 && dt != ML_F64 && dt != ML_BF16 && dt != ML_F16)
        return ML_EUNSUPPORTED;
    rng_arg g = {dt, out, {(uint32_t)seed, (uint32_t)(seed >> 32)}, offset, a, b, normal};
    return ml_parallel_tiles(n, 4096, 16, ctx, rng_tile, &g);
}

ml_status ml_rand_cpu(ml_dtype dt, void *out, int64_t n, uint64_t seed, uint64_t offset,
                      double lo, double hi, const ml_kctx *ctx)
{
    return draw(dt, out, n, seed, offset, lo, hi, 0, ctx);
}

ml_status ml_randn_cpu(ml_dtype dt, void *out, int64_t n, uint64_t seed, uint64_t offset,
                       double mean, double std, const ml_kctx *ctx)
{
    return draw(dt, out, n, seed, offset, mean, std, 1, ctx);
}
