/*
 * kernels/softmax.c - row softmax / log-softmax (CPU): subtract the row
 * max, sum exp in f64, normalise.
 */
#include "softmax.h"
#include "parallel.h"

#include <math.h>

typedef struct { int log; ml_dtype dt; void *out; const void *in; int64_t cols; } sm_arg;

static void softmax_tile(void *p, int64_t lo, int64_t hi)
{
    const sm_arg *g = p;
    for (int64_t r = lo; r < hi; r++) {
        size_t base = (size_t)(r * g->cols);
        double mx = -INFINITY, sum = 0;
        for (int64_t j = 0; j < g->cols; j++) {
            double v = ml_load(g->dt, g->in, base + (size_t)j);
            if (v > mx || isnan(v)) mx = v;
        }
        for (int64_t j = 0; j < g->cols; j++)
            sum += exp(ml_load(g->dt, g->in, base + (size_t)j) - mx);
        double lse = log(sum);
        for (int64_t j = 0; j < g->cols; j++) {
            double z = ml_load(g->dt, g->in, base + (size_t)j) - mx;
            ml_store(g->dt, g->out, base + (size_t)j, g->log ? z - lse : exp(z) / sum);
        }
    }
}

ml_status ml_softmax_cpu(int log, ml_dtype dt, void *out, const void *in,
                         int64_t rows, int64_t cols, const ml_kctx *ctx)
{
    if (dt != ML_F32 && dt != ML_F64)
        return ML_EUNSUPPORTED;
    sm_arg g = {log, dt, out, in, cols};
    return ml_parallel_tiles(rows, 64, cols * 8, ctx, softmax_tile, &g);
}
