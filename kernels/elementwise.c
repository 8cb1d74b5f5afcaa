/*
 * kernels/elementwise.c - CPU fill, arange, binary, scalar and unary ops.
 * f32 and f64 have typed loops; integer dtypes go through the generic
 * double path (exact for i32, and for i64 up to 2^53).
 */
#include "elementwise_ops.h"
#include "parallel.h"
#include "vmath.h"

#define TILE 16384

/* ---- fill / arange ------------------------------------------------------ */

typedef struct { ml_dtype dt; void *out; double v, step; } fill_arg;

static void fill_tile(void *p, int64_t lo, int64_t hi)
{
    const fill_arg *a = p;
    if (a->dt == ML_F32) {
        float v = (float)a->v, *o = a->out;
        for (int64_t i = lo; i < hi; i++) o[i] = v;
    } else {
        for (int64_t i = lo; i < hi; i++) ml_store(a->dt, a->out, (size_t)i, a->v);
    }
}

static void arange_tile(void *p, int64_t lo, int64_t hi)
{
    const fill_arg *a = p;
    for (int64_t i = lo; i < hi; i++)
        ml_store(a->dt, a->out, (size_t)i, a->v + (double)i * a->step);
}

ml_status ml_fill_cpu(ml_dtype dt, void *out, double v, int64_t n, const ml_kctx *ctx)
{
    fill_arg a = {dt, out, v, 0};
    return ml_parallel_tiles(n, TILE, 1, ctx, fill_tile, &a);
}

ml_status ml_arange_cpu(ml_dtype dt, void *out, double start, double step, int64_t n, const ml_kctx *ctx)
{
    fill_arg a = {dt, out, start, step};
    return ml_parallel_tiles(n, TILE, 1, ctx, arange_tile, &a);
}

/* ---- binary ----------------------------------------------------------- */

typedef struct {
    ml_binop op; ml_dtype dt; void *out; const void *a, *b;
    int64_t na, nb; double s; int reverse;
} bin_arg;

/* o [n] = a op b with no broadcast inside the run: the op chosen once,
 * outside the loop, so the loop vectorises (the same IEEE operation per
 * element as ml_binop_f32: the same bits). o may be a or b (in place). */
ML_CLONES
static void binary_run_f32(ml_binop op, float *o, const float *a, const float *b, int64_t n)
{
    switch (op) {
    case ML_ADD:
        #pragma omp simd
        for (int64_t i = 0; i < n; i++) o[i] = a[i] + b[i];
        break;
    case ML_SUB:
        #pragma omp simd
        for (int64_t i = 0; i < n; i++) o[i] = a[i] - b[i];
        break;
    case ML_MUL:
        #pragma omp simd
        for (int64_t i = 0; i < n; i++) o[i] = a[i] * b[i];
        break;
    case ML_DIV:
        #pragma omp simd
        for (int64_t i = 0; i < n; i++) o[i] = a[i] / b[i];
        break;
    default:
        for (int64_t i = 0; i < n; i++) o[i] = ml_binop_f32(op, a[i], b[i]);
    }
}

static void binary_tile(void *p, int64_t lo, int64_t hi)
{
    const bin_arg *g = p;
    int64_t ia = lo % g->na, ib = lo % g->nb;
    if (g->dt == ML_F32) {
        const float *a = g->a, *b = g->b;
        float *o = g->out;
        if (ia + (hi - lo) <= g->na && ib + (hi - lo) <= g->nb) {   /* neither operand wraps here */
            binary_run_f32(g->op, o + lo, a + ia, b + ib, hi - lo);
            return;
        }
        for (int64_t i = lo; i < hi; i++) {
            o[i] = ml_binop_f32(g->op, a[ia], b[ib]);
            if (++ia == g->na) ia = 0;
            if (++ib == g->nb) ib = 0;
        }
    } else if (g->dt == ML_F64) {
        const double *a = g->a, *b = g->b;
        double *o = g->out;
        for (int64_t i = lo; i < hi; i++) {
            o[i] = ml_binop_f64(g->op, a[ia], b[ib]);
            if (++ia == g->na) ia = 0;
            if (++ib == g->nb) ib = 0;
        }
    } else {
        for (int64_t i = lo; i < hi; i++) {
            double x = ml_load(g->dt, g->a, (size_t)ia), y = ml_load(g->dt, g->b, (size_t)ib);
            ml_store(g->dt, g->out, (size_t)i, ml_binop_int(g->op, x, y));
            if (++ia == g->na) ia = 0;
            if (++ib == g->nb) ib = 0;
        }
    }
}

static int binary_dtype_ok(ml_dtype dt)
{
    return dt == ML_F32 || dt == ML_F64 || dt == ML_I32 || dt == ML_I64;
}

ml_status ml_binary_cpu(ml_binop op, ml_dtype dt, void *out, const void *a, const void *b,
                        int64_t n, int64_t na, int64_t nb, const ml_kctx *ctx)
{
    if (!binary_dtype_ok(dt))
        return ML_EUNSUPPORTED;
    bin_arg g = {op, dt, out, a, b, na, nb, 0, 0};
    return ml_parallel_tiles(n, TILE, 1, ctx, binary_tile, &g);
}

static void scalar_tile(void *p, int64_t lo, int64_t hi)
{
    const bin_arg *g = p;
    if (g->dt == ML_F32) {
        const float *a = g->a;
        float *o = g->out, s = (float)g->s;
        if (g->reverse)
            for (int64_t i = lo; i < hi; i++) o[i] = ml_binop_f32(g->op, s, a[i]);
        else
            for (int64_t i = lo; i < hi; i++) o[i] = ml_binop_f32(g->op, a[i], s);
    } else if (g->dt == ML_F64) {
        const double *a = g->a;
        double *o = g->out;
        for (int64_t i = lo; i < hi; i++)
            o[i] = g->reverse ? ml_binop_f64(g->op, g->s, a[i]) : ml_binop_f64(g->op, a[i], g->s);
    } else {
        for (int64_t i = lo; i < hi; i++) {
            double x = ml_load(g->dt, g->a, (size_t)i);
            ml_store(g->dt, g->out, (size_t)i,
                     g->reverse ? ml_binop_int(g->op, g->s, x) : ml_binop_int(g->op, x, g->s));
        }
    }
}

ml_status ml_binary_scalar_cpu(ml_binop op, ml_dtype dt, void *out, const void *a, double s,
                               int reverse, int64_t n, const ml_kctx *ctx)
{
    if (!binary_dtype_ok(dt))
        return ML_EUNSUPPORTED;
    bin_arg g = {op, dt, out, a, NULL, 1, 1, s, reverse};
    return ml_parallel_tiles(n, TILE, 1, ctx, scalar_tile, &g);
}

/* ---- unary ------------------------------------------------------------ */

typedef struct { ml_unop op; ml_dtype dt; void *out; const void *a; } un_arg;

static void unary_tile(void *p, int64_t lo, int64_t hi)
{
    const un_arg *g = p;
    if (g->dt == ML_F32) {
        const float *a = g->a;
        float *o = g->out;
        for (int64_t i = lo; i < hi; i++) o[i] = ml_unop_f32(g->op, a[i]);
    } else if (g->dt == ML_F64) {
        const double *a = g->a;
        double *o = g->out;
        for (int64_t i = lo; i < hi; i++) o[i] = ml_unop_f64(g->op, a[i]);
    } else if (g->dt == ML_I32) {
        const int32_t *a = g->a;
        int32_t *o = g->out;
        /* wrap-around negation of INT32_MIN, as two's complement hardware does */
        for (int64_t i = lo; i < hi; i++) {
            uint32_t u = (uint32_t)a[i], neg = 0u - u;
            o[i] = (int32_t)((g->op == ML_NEG || a[i] < 0) ? neg : u);
        }
    } else {
        const int64_t *a = g->a;
        int64_t *o = g->out;
        for (int64_t i = lo; i < hi; i++) {
            uint64_t u = (uint64_t)a[i], neg = 0u - u;
            o[i] = (int64_t)((g->op == ML_NEG || a[i] < 0) ? neg : u);
        }
    }
}

ml_status ml_unary_cpu(ml_unop op, ml_dtype dt, void *out, const void *a, int64_t n, const ml_kctx *ctx)
{
    int is_int = dt == ML_I32 || dt == ML_I64;
    if (!(dt == ML_F32 || dt == ML_F64 || (is_int && (op == ML_NEG || op == ML_ABS))))
        return ML_EUNSUPPORTED;
    un_arg g = {op, dt, out, a};
    return ml_parallel_tiles(n, TILE, op >= ML_NEG ? 1 : 8, ctx, unary_tile, &g);
}
