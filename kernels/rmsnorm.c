/*
 * kernels/rmsnorm.c - RMSNorm forward/backward on the CPU (see rmsnorm.h).
 */
#include "rmsnorm.h"
#include "parallel.h"
#include "vmath.h"

#include <math.h>

static inline double ld(ml_dtype dt, const void *p, int64_t i)
{
    return dt == ML_F32 ? (double)((const float *)p)[i] : ((const double *)p)[i];
}

static inline void st(ml_dtype dt, void *p, int64_t i, double v)
{
    if (dt == ML_F32)
        ((float *)p)[i] = (float)v;
    else
        ((double *)p)[i] = v;
}

typedef struct {
    ml_dtype dt;
    void *y, *dx, *dw;
    double *rstd;
    const double *crstd;
    const void *x, *w, *dy;
    int64_t N, D;
    double eps;
} rms_args;

/* An f32 row's sum of squares or of (dy·w)·x, in f64 over 8 lanes (lane t
 * takes the columns d = t mod 8), the lanes added in order: the order is
 * fixed, and the loop vectorises. */
ML_CLONES
static double sum8_f32(const float *x, const float *dy, const float *w, int64_t D)
{
    double part[8] = {0};
    int64_t d = 0;
    for (; d + 8 <= D; d += 8) {
        #pragma omp simd
        for (int t = 0; t < 8; t++) {
            double v = x[d + t];
            part[t] += dy ? (double)dy[d + t] * (double)w[d + t] * v : v * v;
        }
    }
    for (int t = 0; d < D; d++, t++) {
        double v = x[d];
        part[t] += dy ? (double)dy[d] * (double)w[d] * v : v * v;
    }
    double s = part[0];
    for (int t = 1; t < 8; t++)
        s += part[t];
    return s;
}

ML_CLONES
static void scale_row_f32(float *restrict y, const float *restrict x, const float *restrict w,
                          double r, int64_t D)
{
    #pragma omp simd
    for (int64_t d = 0; d < D; d++)
        y[d] = (float)((double)x[d] * r * (double)w[d]);
}

static void fwd_rows(void *arg, int64_t lo, int64_t hi)
{
    const rms_args *a = arg;
    int64_t D = a->D;
    for (int64_t n = lo; n < hi; n++) {
        if (a->dt == ML_F32) {
            const float *x = (const float *)a->x + n * D;
            double r = 1.0 / sqrt(sum8_f32(x, NULL, NULL, D) / (double)D + a->eps);
            a->rstd[n] = r;
            scale_row_f32((float *)a->y + n * D, x, a->w, r, D);
            continue;
        }
        double ss = 0;
        for (int64_t d = 0; d < D; d++) {
            double v = ld(a->dt, a->x, n * D + d);
            ss += v * v;
        }
        double r = 1.0 / sqrt(ss / (double)D + a->eps);
        a->rstd[n] = r;
        for (int64_t d = 0; d < D; d++)
            st(a->dt, a->y, n * D + d, ld(a->dt, a->x, n * D + d) * r * ld(a->dt, a->w, d));
    }
}

ml_status ml_rmsnorm_forward_cpu(ml_dtype dt, void *y, double *rstd, const void *x, const void *w,
                                 int64_t N, int64_t D, double eps, const ml_kctx *ctx)
{
    if (dt != ML_F32 && dt != ML_F64)
        return ML_EUNSUPPORTED;
    rms_args a = {.dt = dt, .y = y, .rstd = rstd, .x = x, .w = w, .N = N, .D = D, .eps = eps};
    return ml_parallel_tiles(N, 16, 3 * D, ctx, fwd_rows, &a);
}

ML_CLONES
static void bwd_row_f32(float *restrict dx, const float *restrict dy, const float *restrict x,
                        const float *restrict w, double r, double c, int64_t D)
{
    #pragma omp simd
    for (int64_t d = 0; d < D; d++)
        dx[d] = (float)(r * ((double)dy[d] * (double)w[d]) - (double)x[d] * c);
}

static void bwd_rows(void *arg, int64_t lo, int64_t hi)
{
    const rms_args *a = arg;
    int64_t D = a->D;
    for (int64_t n = lo; n < hi; n++) {
        double r = a->crstd[n];
        if (a->dt == ML_F32) {
            const float *x = (const float *)a->x + n * D, *dy = (const float *)a->dy + n * D;
            double c = r * r * r * sum8_f32(x, dy, a->w, D) / (double)D;
            bwd_row_f32((float *)a->dx + n * D, dy, x, a->w, r, c, D);
            continue;
        }
        double gx = 0;
        for (int64_t d = 0; d < D; d++)
            gx += ld(a->dt, a->dy, n * D + d) * ld(a->dt, a->w, d) * ld(a->dt, a->x, n * D + d);
        double c = r * r * r * gx / (double)D;
        for (int64_t d = 0; d < D; d++) {
            double g = ld(a->dt, a->dy, n * D + d) * ld(a->dt, a->w, d);
            st(a->dt, a->dx, n * D + d, r * g - ld(a->dt, a->x, n * D + d) * c);
        }
    }
}

/* acc [n] += dy·x·r of one f32 row's n columns (vectorised across the
 * columns: each column's sum keeps its order over the rows) */
ML_CLONES
static void dw_row_f32(double *restrict acc, const float *restrict dy, const float *restrict x, double r,
                       int64_t n)
{
    #pragma omp simd
    for (int64_t d = 0; d < n; d++)
        acc[d] += (double)dy[d] * (double)x[d] * r;
}

/* Columns [lo, hi) of dw: each summed over the rows in order, in f64. */
static void bwd_cols(void *arg, int64_t lo, int64_t hi)
{
    const rms_args *a = arg;
    int64_t D = a->D;
    double acc[64];
    for (int64_t c0 = lo; c0 < hi; c0 += 64) {
        int64_t c1 = c0 + 64 < hi ? c0 + 64 : hi;
        for (int64_t d = c0; d < c1; d++)
            acc[d - c0] = 0;
        for (int64_t n = 0; n < a->N; n++) {
            double r = a->crstd[n];
            if (a->dt == ML_F32) {
                dw_row_f32(acc, (const float *)a->dy + n * D + c0, (const float *)a->x + n * D + c0, r,
                           c1 - c0);
                continue;
            }
            for (int64_t d = c0; d < c1; d++)
                acc[d - c0] += ld(a->dt, a->dy, n * D + d) * ld(a->dt, a->x, n * D + d) * r;
        }
        for (int64_t d = c0; d < c1; d++)
            st(a->dt, a->dw, d, ld(a->dt, a->dw, d) + acc[d - c0]);
    }
}

ml_status ml_rmsnorm_backward_cpu(ml_dtype dt, void *dx, void *dw, const void *dy, const void *x,
                                  const void *w, const double *rstd, int64_t N, int64_t D,
                                  const ml_kctx *ctx)
{
    if (dt != ML_F32 && dt != ML_F64)
        return ML_EUNSUPPORTED;
    rms_args a = {.dt = dt, .dx = dx, .dw = dw, .crstd = rstd, .x = x, .w = w, .dy = dy,
                  .N = N, .D = D};
    ml_status s = ml_parallel_tiles(N, 16, 4 * D, ctx, bwd_rows, &a);
    if (s != ML_OK)
        return s;
    return ml_parallel_tiles(D, 64, 3 * N, ctx, bwd_cols, &a);
}
