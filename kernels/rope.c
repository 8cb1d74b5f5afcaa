/*
 * kernels/rope.c - rotate-half RoPE on the CPU (see rope.h).
 */
#include "rope.h"
#include "parallel.h"
#include "vmath.h"

#include <math.h>

typedef struct {
    ml_dtype dt;
    void *y;
    const void *x;
    int64_t heads, hd, offset;
    double theta, sign;   /* sign +1: forward, -1: inverse rotation */
} rope_args;

enum { TILE = 16, PAIRS = 32 };   /* rows per tile (their values stay in L1), pairs per block */

/* y[i], y[i + half] of one head's n pairs from x and the pairs' cos and
 * sin, in f64 and rounded once (y may be x: each pair is read first). */
ML_CLONES
static void rotate_f32(float *y, const float *x, const double *c, const double *sn, int64_t n,
                       int64_t half)
{
    #pragma omp simd
    for (int64_t i = 0; i < n; i++) {
        double x0 = x[i], x1 = x[i + half];
        y[i] = (float)(x0 * c[i] - x1 * sn[i]);
        y[i + half] = (float)(x1 * c[i] + x0 * sn[i]);
    }
}

ML_CLONES
static void rotate_f64(double *y, const double *x, const double *c, const double *sn, int64_t n,
                       int64_t half)
{
    #pragma omp simd
    for (int64_t i = 0; i < n; i++) {
        double x0 = x[i], x1 = x[i + half];
        y[i] = x0 * c[i] - x1 * sn[i];
        y[i + half] = x1 * c[i] + x0 * sn[i];
    }
}

/* The next row's cos and sin: the previous row's angle plus inv_freq,
 * (c, s) rotated by (cs, ss) in f64. */
ML_CLONES
static void rotate_angles(double *restrict c, double *restrict s, const double *restrict c0,
                          const double *restrict s0, const double *restrict cs,
                          const double *restrict ss, int64_t n)
{
    #pragma omp simd
    for (int64_t i = 0; i < n; i++) {
        c[i] = c0[i] * cs[i] - s0[i] * ss[i];
        s[i] = s0[i] * cs[i] + c0[i] * ss[i];
    }
}

/* cos and sin as the rotation uses them: rounded once to f32 for f32 data,
 * then sin times the direction (+1 forward, -1 backward). */
static void finish_angles(double *c, double *s, int f32, double sign, int64_t n)
{
    if (f32)
        for (int64_t i = 0; i < n; i++) {
            c[i] = (double)(float)c[i];
            s[i] = (double)(float)s[i];
        }
    for (int64_t i = 0; i < n; i++)
        s[i] *= sign;
}

/* Rows [lo, hi) (at most TILE), in blocks of PAIRS pairs: the block's
 * cos and sin for the tile's rows first, then each row's heads in one
 * vector pass per head. Per pair one pow and at most two sincos (libm is
 * most of the cost): the first row's angle, and inv_freq, the step by which
 * the next rows (at most TILE - 1) are rotated in f64. Each step adds a few
 * 1e-16 of error, far below f32's rounding and, past the first positions,
 * below the error of rounding the angle itself (0.5 ulp of p·inv_freq,
 * 7e-12 rad at p 1e5). */
static void rope_rows(void *arg, int64_t lo, int64_t hi)
{
    const rope_args *a = arg;
    int64_t half = a->hd / 2;
    double c[TILE][PAIRS], sn[TILE][PAIRS], cs[PAIRS], ss[PAIRS];
    for (int64_t i0 = 0; i0 < half; i0 += PAIRS) {
        int64_t np = half - i0 < PAIRS ? half - i0 : PAIRS;
        for (int64_t i = 0; i < np; i++) {
            double inv_freq = pow(a->theta, -(double)(2 * (i0 + i)) / (double)a->hd);
            double ang = (double)(a->offset + lo) * inv_freq;
            c[0][i] = cos(ang);
            sn[0][i] = sin(ang);
            if (hi - lo > 1) {   /* a one-row tile (a decode's token) takes no step */
                cs[i] = cos(inv_freq);
                ss[i] = sin(inv_freq);
            }
        }
        for (int64_t s = 1; s < hi - lo; s++)
            rotate_angles(c[s], sn[s], c[s - 1], sn[s - 1], cs, ss, np);
        for (int64_t s = 0; s < hi - lo; s++)
            finish_angles(c[s], sn[s], a->dt == ML_F32, a->sign, np);
        for (int64_t s = lo; s < hi; s++)
            for (int64_t h = 0; h < a->heads; h++) {
                int64_t base = (s * a->heads + h) * a->hd + i0;
                if (a->dt == ML_F32)
                    rotate_f32((float *)a->y + base, (const float *)a->x + base, c[s - lo], sn[s - lo],
                               np, half);
                else
                    rotate_f64((double *)a->y + base, (const double *)a->x + base, c[s - lo], sn[s - lo],
                               np, half);
            }
    }
}

static ml_status rope_run(ml_dtype dt, void *y, const void *x, int64_t S, int64_t heads, int64_t hd,
                          int64_t offset, double theta, double sign, const ml_kctx *ctx)
{
    if (dt != ML_F32 && dt != ML_F64)
        return ML_EUNSUPPORTED;
    rope_args a = {dt, y, x, heads, hd, offset, theta, sign};
    return ml_parallel_tiles(S, TILE, heads * hd + hd, ctx, rope_rows, &a);
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
