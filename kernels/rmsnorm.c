/*
 * kernels/rmsnorm.c - RMSNorm forward/backward on the CPU (see rmsnorm.h).
 */
#include "rmsnorm.h"
#include "parallel.h"

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

static void fwd_rows(void *arg, int64_t lo, int64_t hi)
{
    const rms_args *a = arg;
    int64_t D = a->D;
    for (int64_t n = lo; n < hi; n++) {
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

static void bwd_rows(void *arg, int64_t lo, int64_t hi)
{
    const rms_args *a = arg;
    int64_t D = a->D;
    for (int64_t n = lo; n < hi; n++) {
        double r = a->crstd[n], gx = 0;
        for (int64_t d = 0; d < D; d++)
            gx += ld(a->dt, a->dy, n * D + d) * ld(a->dt, a->w, d) * ld(a->dt, a->x, n * D + d);
        double c = r * r * r * gx / (double)D;
        for (int64_t d = 0; d < D; d++) {
            double g = ld(a->dt, a->dy, n * D + d) * ld(a->dt, a->w, d);
            st(a->dt, a->dx, n * D + d, r * g - ld(a->dt, a->x, n * D + d) * c);
        }
    }
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
