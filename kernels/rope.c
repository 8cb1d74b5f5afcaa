/*
 * kernels/rope.c - rotate-half RoPE on the CPU (see rope.h).
 */
#include "rope.h"
#include "parallel.h"

#include <math.h>

typedef struct {
    ml_dtype dt;
    void *y;
    const void *x;
    int64_t heads, hd, offset;
    double theta, sign;   /* sign +1: forward, -1: inverse rotation */
} rope_args;

/* Rows [lo, hi) (a tile of 16: its rows stay in L1), pair index outer so
 * that inv_freq_i is one pow per tile, not per row. */
static void rope_rows(void *arg, int64_t lo, int64_t hi)
{
    const rope_args *a = arg;
    int64_t half = a->hd / 2;
    for (int64_t i = 0; i < half; i++) {
        double inv_freq = pow(a->theta, -(double)(2 * i) / (double)a->hd);
        for (int64_t s = lo; s < hi; s++) {
            double ang = (double)(a->offset + s) * inv_freq;
            double c = cos(ang), sn = sin(ang);
            if (a->dt == ML_F32) {
                c = (double)(float)c;
                sn = (double)(float)sn;
            }
            sn *= a->sign;
            for (int64_t h = 0; h < a->heads; h++) {
                int64_t base = (s * a->heads + h) * a->hd;
                if (a->dt == ML_F32) {
                    const float *x = (const float *)a->x + base;
                    float *y = (float *)a->y + base;
                    double x0 = x[i], x1 = x[i + half];
                    y[i] = (float)(x0 * c - x1 * sn);
                    y[i + half] = (float)(x1 * c + x0 * sn);
                } else {
                    const double *x = (const double *)a->x + base;
                    double *y = (double *)a->y + base;
                    double x0 = x[i], x1 = x[i + half];
                    y[i] = x0 * c - x1 * sn;
                    y[i + half] = x1 * c + x0 * sn;
                }
            }
        }
    }
}

static ml_status rope_run(ml_dtype dt, void *y, const void *x, int64_t S, int64_t heads, int64_t hd,
                          int64_t offset, double theta, double sign, const ml_kctx *ctx)
{
    if (dt != ML_F32 && dt != ML_F64)
        return ML_EUNSUPPORTED;
    rope_args a = {dt, y, x, heads, hd, offset, theta, sign};
    return ml_parallel_tiles(S, 16, heads * hd + hd, ctx, rope_rows, &a);
}

ml_status ml_rope_forward_cpu(ml_dtype dt, void *y, const void *x, int64_t S, int64_t heads,
                              int64_t hd, int64_t offset, double theta, const ml_kctx *ctx)
{
    return rope_run(dt, y, x, S, heads, hd, offset, theta, 1.0, ctx);
}

ml_status ml_rope_backward_cpu(ml_dtype dt, void *dx, const void *dy, int64_t S, int64_t heads,
                               int64_t hd, int64_t offset, double theta, const ml_kctx *ctx)
{
    return rope_run(dt, dx, dy, S, heads, hd, offset, theta, -1.0, ctx);
}
