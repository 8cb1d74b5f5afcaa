/*
 * kernels/reduce.c - CPU sum / mean / max over a dim or everything, and
 * cumsum. The summation order depends on the shape only (see reduce.h).
 */
#include "reduce.h"
#include "parallel.h"

#include <math.h>

static inline double at(ml_dtype dt, const void *p, int64_t i)
{
    return dt == ML_F32 ? (double)((const float *)p)[i] : ((const double *)p)[i];
}

/* Running max (or min) with NaN winning and the first position kept on ties. */
static inline void ext_step(ml_redop op, double v, int64_t j, double *best, int64_t *bi)
{
    if (isnan(*best))
        return;
    if ((op == ML_RMAX ? v > *best : v < *best) || isnan(v)) {
        *best = v;
        *bi = j;
    }
}

typedef struct {
    ml_redop op; ml_dtype dt; void *out; int64_t *idx; const void *in;
    int64_t r, inner;
} red_arg;

static void reduce_tile(void *p, int64_t lo, int64_t hi)
{
    const red_arg *g = p;
    for (int64_t q = lo; q < hi; q++) {
        int64_t o = q / g->inner, i = q % g->inner;
        int64_t base = o * g->r * g->inner + i;
        double acc;
        int64_t bi = 0;
        if (g->op == ML_RMAX || g->op == ML_RMIN) {
            acc = g->r ? at(g->dt, g->in, base) : NAN;
            for (int64_t j = 1; j < g->r; j++)
                ext_step(g->op, at(g->dt, g->in, base + j * g->inner), j, &acc, &bi);
        } else {
            acc = 0;
            for (int64_t j = 0; j < g->r; j++)
                acc += at(g->dt, g->in, base + j * g->inner);
            if (g->op == ML_RMEAN)
                acc = g->r ? acc / (double)g->r : NAN;
        }
        ml_store(g->dt, g->out, (size_t)q, acc);
        if (g->idx)
            g->idx[q] = bi;
    }
}

ml_status ml_reduce_cpu(ml_redop op, ml_dtype dt, void *out, int64_t *idx, const void *in,
                        int64_t outer, int64_t r, int64_t inner, const ml_kctx *ctx)
{
    if (dt != ML_F32 && dt != ML_F64)
        return ML_EUNSUPPORTED;
    red_arg g = {op, dt, out, idx, in, r, inner};
    return ml_parallel_tiles(outer * inner, 256, r > 0 ? r : 1, ctx, reduce_tile, &g);
}

/* Whole-tensor reduction. Blocks of ML_REDUCE_BLOCK elements are summed
 * sequentially; SUPER block partials (one stack array) are summed in block
 * order into a super partial; super partials are summed in order. Every
 * boundary depends on n alone. */
#define SUPER 1024

typedef struct {
    ml_redop op; ml_dtype dt; const void *in; int64_t base, n;
    int square;
    double *part; int64_t *pidx;
} all_arg;

static void all_tile(void *p, int64_t lo, int64_t hi)
{
    const all_arg *g = p;
    for (int64_t b = lo; b < hi; b++) {
        int64_t s = g->base + b * ML_REDUCE_BLOCK;
        int64_t e = s + ML_REDUCE_BLOCK < g->n ? s + ML_REDUCE_BLOCK : g->n;
        if (g->op == ML_RMAX || g->op == ML_RMIN) {
            double best = at(g->dt, g->in, s);
            int64_t bi = s;
            for (int64_t i = s + 1; i < e; i++)
                ext_step(g->op, at(g->dt, g->in, i), i, &best, &bi);
            g->part[b] = best;
            g->pidx[b] = bi;
        } else if (g->square) {
            double acc = 0;
            for (int64_t i = s; i < e; i++) {
                double v = at(g->dt, g->in, i);
                acc += v * v;
            }
            g->part[b] = acc;
        } else {
            double acc = 0;
            for (int64_t i = s; i < e; i++)
                acc += at(g->dt, g->in, i);
            g->part[b] = acc;
        }
    }
}

/* The block driver of every whole-tensor reduction: sum (of squares) into
 * *acc, or max/min into *acc with its position in *best_i. */
static ml_status all_blocks(ml_redop op, int square, ml_dtype dt, double *acc_out,
                            int64_t *best_out, const void *in, int64_t n, const ml_kctx *ctx)
{
    double part[SUPER];
    int64_t pidx[SUPER];
    int ext = op == ML_RMAX || op == ML_RMIN;
    double acc = !ext ? 0 : n ? at(dt, in, 0) : NAN;
    int64_t best_i = 0;
    int64_t super_elems = (int64_t)SUPER * ML_REDUCE_BLOCK;
    for (int64_t base = 0; base < n; base += super_elems) {
        int64_t len = n - base < super_elems ? n - base : super_elems;
        int64_t nblocks = (len + ML_REDUCE_BLOCK - 1) / ML_REDUCE_BLOCK;
        all_arg g = {op, dt, in, base, base + len, square, part, pidx};
        ml_status s = ml_parallel_tiles(nblocks, 1, ML_REDUCE_BLOCK, ctx, all_tile, &g);
        if (s != ML_OK)
            return s;
        double sacc = 0;
        for (int64_t b = 0; b < nblocks; b++) {
            if (ext)
                ext_step(op, part[b], pidx[b], &acc, &best_i);
            else
                sacc += part[b];
        }
        if (!ext)
            acc += sacc;
    }
    *acc_out = acc;
    *best_out = best_i;
    return ML_OK;
}

ml_status ml_block_sum_cpu(ml_dtype dt, double *out, const void *x, int64_t n, int square,
                           const ml_kctx *ctx)
{
    if (dt != ML_F32 && dt != ML_F64)
        return ML_EUNSUPPORTED;
    int64_t unused;
    return all_blocks(ML_RSUM, square, dt, out, &unused, x, n, ctx);
}

ml_status ml_reduce_all_cpu(ml_redop op, ml_dtype dt, void *out, int64_t *idx, const void *in,
                            int64_t n, void *scratch, const ml_kctx *ctx)
{
    if (dt != ML_F32 && dt != ML_F64)
        return ML_EUNSUPPORTED;
    double acc;
    int64_t best_i;
    ml_status s = all_blocks(op, 0, dt, &acc, &best_i, in, n, ctx);
    if (s != ML_OK)
        return s;
    if (op == ML_RMEAN)
        acc = n ? acc / (double)n : NAN;
    ml_store(dt, out, 0, acc);
    if (idx)
        idx[0] = best_i;
    return ML_OK;
}

typedef struct { ml_dtype dt; void *out; const void *in; int64_t r, inner; } cum_arg;

static void cumsum_tile(void *p, int64_t lo, int64_t hi)
{
    const cum_arg *g = p;
    for (int64_t q = lo; q < hi; q++) {
        int64_t o = q / g->inner, i = q % g->inner, base = o * g->r * g->inner + i;
        double acc = 0;
        for (int64_t j = 0; j < g->r; j++) {
            size_t k = (size_t)(base + j * g->inner);
            acc += ml_load(g->dt, g->in, k);
            ml_store(g->dt, g->out, k, acc);
        }
    }
}

ml_status ml_cumsum_cpu(ml_dtype dt, void *out, const void *in,
                        int64_t outer, int64_t r, int64_t inner, const ml_kctx *ctx)
{
    if (dt != ML_F32 && dt != ML_F64 && dt != ML_I32 && dt != ML_I64)
        return ML_EUNSUPPORTED;
    cum_arg g = {dt, out, in, r, inner};
    return ml_parallel_tiles(outer * inner, 256, r > 0 ? r : 1, ctx, cumsum_tile, &g);
}

/* The CUDA twin's workspace (reduce.cu's all_ws): f64 partials and int64
 * positions of PASS super blocks, then the running result and position. */
size_t ml_reduce_all_scratch_bytes_cuda(int64_t n)
{
    return ((size_t)ML_REDUCE_CUDA_PASS * SUPER + 1) * (sizeof(double) + sizeof(int64_t));
}
