/*
 * kernels/embedding.c - embedding lookup / gradient on the CPU (see embedding.h).
 */
#include "embedding.h"
#include "parallel.h"

typedef struct {
    ml_dtype dt;
    void *out;
    const void *in;
    const int64_t *ids;
    int64_t T, V, D;
} emb_args;

static void fwd_tokens(void *arg, int64_t lo, int64_t hi)
{
    const emb_args *a = arg;
    size_t es = ml_dtype_size(a->dt), row = (size_t)a->D * es;
    for (int64_t t = lo; t < hi; t++)
        memcpy((char *)a->out + (size_t)t * row, (const char *)a->in + (size_t)a->ids[t] * row, row);
}

ml_status ml_embedding_forward_cpu(ml_dtype dt, void *out, const int64_t *ids, const void *W,
                                   int64_t T, int64_t V, int64_t D, const ml_kctx *ctx)
{
    if (dt != ML_F32 && dt != ML_F64)
        return ML_EUNSUPPORTED;
    emb_args a = {dt, out, W, ids, T, V, D};
    return ml_parallel_tiles(T, 64, D, ctx, fwd_tokens, &a);
}

/* Vocabulary rows [lo, hi): every token scanned, in order. */
static void bwd_rows(void *arg, int64_t lo, int64_t hi)
{
    const emb_args *a = arg;
    int64_t D = a->D;
    for (int64_t t = 0; t < a->T; t++) {
        int64_t v = a->ids[t];
        if (v < lo || v >= hi)
            continue;
        if (a->dt == ML_F32) {
            float *o = (float *)a->out + v * D;
            const float *g = (const float *)a->in + t * D;
            for (int64_t d = 0; d < D; d++)
                o[d] += g[d];
        } else {
            double *o = (double *)a->out + v * D;
            const double *g = (const double *)a->in + t * D;
            for (int64_t d = 0; d < D; d++)
                o[d] += g[d];
        }
    }
}

ml_status ml_embedding_backward_cpu(ml_dtype dt, void *dW, const void *dout, const int64_t *ids,
                                    int64_t T, int64_t V, int64_t D, const ml_kctx *ctx)
{
    if (dt != ML_F32 && dt != ML_F64)
        return ML_EUNSUPPORTED;
    emb_args a = {dt, dW, dout, ids, T, V, D};
    /* one range of rows per thread: each range costs a scan of the T ids */
    int nt = ml_kctx_threads(ctx);
    int64_t tile = (V + nt - 1) / nt;
    return ml_parallel_tiles(V, tile < 1 ? 1 : tile, (T + T * D / (V > 0 ? V : 1)) + 1, ctx,
                             bwd_rows, &a);
}
