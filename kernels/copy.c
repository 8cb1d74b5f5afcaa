/*
 * kernels/copy.c - strided copy with dtype conversion (CPU).
 */
#include "copy.h"
#include "parallel.h"

#define TILE 16384

typedef struct {
    ml_dtype dto, dti;
    void *out; const void *in;
    const int64_t *os, *is, *shape;
    int ndim;
} copy_arg;

static void copy_tile(void *p, int64_t lo, int64_t hi)
{
    const copy_arg *g = p;
    int64_t idx[16], oo = 0, io = 0, rem = lo;
    for (int d = g->ndim - 1; d >= 0; d--) {
        idx[d] = g->shape[d] ? rem % g->shape[d] : 0;
        rem = g->shape[d] ? rem / g->shape[d] : 0;
        oo += idx[d] * g->os[d];
        io += idx[d] * g->is[d];
    }
    size_t esz = ml_dtype_size(g->dto);
    int same = g->dto == g->dti;
    for (int64_t i = lo; i < hi; i++) {
        if (same) {
            memcpy((char *)g->out + (size_t)oo * esz, (const char *)g->in + (size_t)io * esz, esz);
        } else if (g->dto == ML_I64 && g->dti == ML_I32) {
            ((int64_t *)g->out)[oo] = ((const int32_t *)g->in)[io];
        } else {
            double v = ml_load(g->dti, g->in, (size_t)io);
            ml_store(g->dto, g->out, (size_t)oo, v);
        }
        for (int d = g->ndim - 1; d >= 0; d--) {   /* odometer step */
            oo += g->os[d];
            io += g->is[d];
            if (++idx[d] < g->shape[d])
                break;
            oo -= g->os[d] * g->shape[d];
            io -= g->is[d] * g->shape[d];
            idx[d] = 0;
        }
    }
}

typedef struct { void *out; const void *in; size_t esz; } flat_arg;

static void flat_tile(void *p, int64_t lo, int64_t hi)
{
    const flat_arg *g = p;
    memcpy((char *)g->out + (size_t)lo * g->esz, (const char *)g->in + (size_t)lo * g->esz,
           (size_t)(hi - lo) * g->esz);
}

static int is_row_major(int ndim, const int64_t *shape, const int64_t *stride)
{
    int64_t s = 1;
    for (int d = ndim - 1; d >= 0; d--) {
        if (shape[d] != 1 && stride[d] != s)
            return 0;
        s *= shape[d];
    }
    return 1;
}

ml_status ml_copy_cpu(ml_dtype dt_out, void *out, const int64_t *out_stride,
                      ml_dtype dt_in, const void *in, const int64_t *in_stride,
                      int ndim, const int64_t *shape, const ml_kctx *ctx)
{
    int64_t n = 1;
    for (int d = 0; d < ndim; d++)
        n *= shape[d];
    if (ndim > 16)
        return ML_EUNSUPPORTED;
    if (dt_out == dt_in && is_row_major(ndim, shape, out_stride) && is_row_major(ndim, shape, in_stride)) {
        if (out == in)
            return ML_OK;
        flat_arg f = {out, in, ml_dtype_size(dt_out)};   /* a plain byte copy */
        return ml_parallel_tiles(n, 1 << 16, 1, ctx, flat_tile, &f);
    }
    copy_arg g = {dt_out, dt_in, out, in, out_stride, in_stride, shape, ndim};
    return ml_parallel_tiles(n, TILE, 1, ctx, copy_tile, &g);
}
