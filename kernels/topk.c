/*
 * kernels/topk.c - per-row top-k by insertion into the (sorted) output row:
 * O(cols * k), fine for the small k of routing. Scanning columns in order
 * and inserting a new value after every equal one gives ties to the lower
 * index.
 */
#include "topk.h"
#include "parallel.h"

#include <math.h>

typedef struct {
    ml_dtype dt; void *values; int64_t *indices; const void *in;
    int64_t cols, k; int nan;
} topk_arg;

static void topk_tile(void *p, int64_t lo, int64_t hi)
{
    topk_arg *g = p;
    for (int64_t r = lo; r < hi; r++) {
        int64_t *ix = g->indices + r * g->k;
        size_t in0 = (size_t)(r * g->cols);
        double vals[64];   /* row buffer for k <= 64; larger k re-reads the input */
        int64_t n = 0;
        for (int64_t j = 0; j < g->cols; j++) {
            double v = ml_load(g->dt, g->in, in0 + (size_t)j);
            if (isnan(v)) {
                #pragma omp atomic write
                g->nan = 1;
                v = -INFINITY;
            }
            if (n == g->k) {
                double last = g->k <= 64 ? vals[n - 1] : ml_load(g->dt, g->in, in0 + (size_t)ix[n - 1]);
                if (!(v > last))
                    continue;
                n--;
            }
            int64_t pos = n;
            while (pos > 0) {
                double prev = g->k <= 64 ? vals[pos - 1] : ml_load(g->dt, g->in, in0 + (size_t)ix[pos - 1]);
                if (!(v > prev))
                    break;
                if (g->k <= 64)
                    vals[pos] = vals[pos - 1];
                ix[pos] = ix[pos - 1];
                pos--;
            }
            if (g->k <= 64)
                vals[pos] = v;
            ix[pos] = j;
            n++;
        }
        for (int64_t q = 0; q < g->k; q++)
            ml_store(g->dt, g->values, (size_t)(r * g->k + q), ml_load(g->dt, g->in, in0 + (size_t)ix[q]));
    }
}

ml_status ml_topk_cpu(ml_dtype dt, void *values, int64_t *indices, const void *in,
                      int64_t rows, int64_t cols, int64_t k, void *scratch, const ml_kctx *ctx)
{
    if (dt != ML_F32 && dt != ML_F64)
        return ML_EUNSUPPORTED;
    if (k == 0)
        return ML_OK;
    topk_arg g = {dt, values, indices, in, cols, k, 0};
    ml_status s = ml_parallel_tiles(rows, 64, cols * (k < 8 ? k : 8), ctx, topk_tile, &g);
    return s != ML_OK ? s : g.nan ? ML_ENAN : ML_OK;
}

/* The CUDA twin's NaN flag (topk.cu), one 8-aligned slot. */
size_t ml_topk_scratch_bytes_cuda(int64_t rows, int64_t cols, int64_t k)
{
    return sizeof(int64_t);
}
