/*
 * kernels/index.c - index_select, gather, scatter_add, bincount (CPU).
 * Every output element is written by exactly one tile, in index order, so
 * results do not depend on the thread count.
 */
#include "index.h"
#include "parallel.h"

typedef struct {
    ml_dtype dt; void *out; const void *in; const int64_t *idx;
    int64_t n, inner, m; size_t esz;
} ix_arg;

/* Tiles over (outer, m): copy one inner row each. */
static void index_select_tile(void *p, int64_t lo, int64_t hi)
{
    const ix_arg *g = p;
    size_t row = (size_t)g->inner * g->esz;
    for (int64_t q = lo; q < hi; q++) {
        int64_t o = q / g->m, j = q % g->m;
        memcpy((char *)g->out + (size_t)q * row,
               (const char *)g->in + (size_t)(o * g->n + g->idx[j]) * row, row);
    }
}

ml_status ml_index_select_cpu(ml_dtype dt, void *out, const void *in, const int64_t *idx,
                              int64_t outer, int64_t n, int64_t inner, int64_t m, const ml_kctx *ctx)
{
    if (inner == 0)   /* nothing to copy, and an empty tensor may have no buffer */
        return ML_OK;
    ix_arg g = {dt, out, in, idx, n, inner, m, ml_dtype_size(dt)};
    return ml_parallel_tiles(outer * m, 64, inner, ctx, index_select_tile, &g);
}

static void gather_tile(void *p, int64_t lo, int64_t hi)
{
    const ix_arg *g = p;
    for (int64_t q = lo; q < hi; q++) {
        int64_t i = q % g->inner, o = q / (g->m * g->inner);
        memcpy((char *)g->out + (size_t)q * g->esz,
               (const char *)g->in + (size_t)((o * g->n + g->idx[q]) * g->inner + i) * g->esz, g->esz);
    }
}

ml_status ml_gather_cpu(ml_dtype dt, void *out, const void *in, const int64_t *idx,
                        int64_t outer, int64_t n, int64_t inner, int64_t m, const ml_kctx *ctx)
{
    ix_arg g = {dt, out, in, idx, n, inner, m, ml_dtype_size(dt)};
    return ml_parallel_tiles(outer * m * inner, 4096, 1, ctx, gather_tile, &g);
}

/* Tiles over output columns (o, i): one tile owns a column and adds the
 * sources j = 0..m-1 in order. */
static void scatter_add_tile(void *p, int64_t lo, int64_t hi)
{
    const ix_arg *g = p;
    for (int64_t q = lo; q < hi; q++) {
        int64_t o = q / g->inner, i = q % g->inner;
        for (int64_t j = 0; j < g->m; j++) {
            size_t s = (size_t)((o * g->m + j) * g->inner + i);
            size_t d = (size_t)((o * g->n + g->idx[s]) * g->inner + i);
            if (g->dt == ML_F32)
                ((float *)g->out)[d] += ((const float *)g->in)[s];
            else
                ml_store(g->dt, g->out, d, ml_load(g->dt, g->out, d) + ml_load(g->dt, g->in, s));
        }
    }
}

ml_status ml_scatter_add_cpu(ml_dtype dt, void *out, const void *src, const int64_t *idx,
                             int64_t outer, int64_t n, int64_t inner, int64_t m, const ml_kctx *ctx)
{
    if (dt != ML_F32 && dt != ML_F64 && dt != ML_I32 && dt != ML_I64)
        return ML_EUNSUPPORTED;
    ix_arg g = {dt, out, src, idx, n, inner, m, ml_dtype_size(dt)};
    return ml_parallel_tiles(outer * inner, 64, m, ctx, scatter_add_tile, &g);
}

ml_status ml_bincount_cpu(int64_t *counts, const int64_t *idx, int64_t n, int64_t nbins, const ml_kctx *ctx)
{
    if (nbins > 0)   /* an empty output may have no buffer at all */
        memset(counts, 0, (size_t)nbins * sizeof *counts);
    for (int64_t i = 0; i < n; i++) {
        if ((i & 0xfffff) == 0 && ml_kctx_interrupted(ctx))
            return ML_EINTERRUPTED;
        counts[idx[i]]++;
    }
    return ML_OK;
}
