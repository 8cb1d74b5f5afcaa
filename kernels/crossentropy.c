/*
 * kernels/crossentropy.c - chunked LM-head cross-entropy on the CPU (see
 * crossentropy.h).
 */
#include "crossentropy.h"
#include "matmul.h"
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

static int64_t clamp(int64_t a, int64_t n) { return a < n ? a : n; }

ml_ce_scratch ml_ce_scratch_layout(ml_dtype dt, int64_t S, int64_t V, int64_t D, int64_t rows,
                                   int64_t vchunk)
{
    int64_t nr = clamp(rows, S > 0 ? S : 1), n = nr * clamp(vchunk, V > 0 ? V : 1);
    ml_ce_scratch l = {0, 0, (size_t)n * ml_dtype_size(dt)};
    if (dt == ML_BF16) {   /* f32 logits, then dh's f32 sums, then the bf16 copy: aligned */
        l.acc = (size_t)n * sizeof(float);
        l.copy = l.acc + (size_t)(nr * D) * sizeof(float);
        l.bytes = l.copy + (size_t)n * sizeof(uint16_t);
    }
    return l;
}

size_t ml_ce_scratch_bytes(ml_dtype dt, int64_t S, int64_t V, int64_t D, int64_t rows,
                           int64_t vchunk)
{
    return ml_ce_scratch_layout(dt, S, V, D, rows, vchunk).bytes;
}

/* block[r, c] = h[r0 + r] . W[c0 + c], r < nr, c < nc (ld = nc) */
static ml_status logits_block(ml_dtype dt, void *blk, const void *h, const void *W, int64_t r0,
                              int64_t nr, int64_t c0, int64_t nc, int64_t D, const ml_kctx *ctx)
{
    size_t es = ml_dtype_size(dt);
    ml_gemm_shape g = {.batch = 1, .m = nr, .n = nc, .k = D, .ta = 0, .tb = 1,
                       .lda = D, .ldb = D, .ldc = nc, .alpha = 1.0, .beta = 0.0};
    return ml_matmul_cpu(dt, dt, blk, (const char *)h + (size_t)(r0 * D) * es,
                         (const char *)W + (size_t)(c0 * D) * es, &g, ctx);
}

typedef struct {
    ml_dtype dt;
    void *blk;
    const int64_t *targets;
    double *m, *l, *tl;       /* per row of the chunk: running max, sum, target logit */
    const double *lse;
    int64_t r0, c0, nc;
    double scale;
} ce_args;

/* Online logsumexp over one block, rows [lo, hi) of the chunk. */
static void fwd_rows(void *arg, int64_t lo, int64_t hi)
{
    const ce_args *a = arg;
    for (int64_t r = lo; r < hi; r++) {
        double mx = a->m[r];
        for (int64_t c = 0; c < a->nc; c++) {
            double v = ld(a->dt, a->blk, r * a->nc + c);
            mx = v > mx ? v : mx;
        }
        double sum = a->m[r] == -INFINITY ? 0.0 : a->l[r] * exp(a->m[r] - mx);
        for (int64_t c = 0; c < a->nc; c++)
            sum += exp(ld(a->dt, a->blk, r * a->nc + c) - mx);
        a->m[r] = mx;
        a->l[r] = sum;
        int64_t t = a->targets[a->r0 + r] - a->c0;
        if (t >= 0 && t < a->nc)
            a->tl[r] = ld(a->dt, a->blk, r * a->nc + t);
    }
}

ml_status ml_ce_forward_cpu(ml_dtype dt, double *loss, double *lse, const void *h, const void *W,
                            const int64_t *targets, int64_t S, int64_t V, int64_t D, int64_t rows,
                            int64_t vchunk, void *scratch, const ml_kctx *ctx)
{
    if (dt != ML_F32 && dt != ML_F64)
        return ML_EUNSUPPORTED;
    if (rows < 1 || rows > ML_CE_MAX_ROWS || vchunk < 1)
        return ML_EUNSUPPORTED;
    double m[ML_CE_MAX_ROWS], l[ML_CE_MAX_ROWS], tl[ML_CE_MAX_ROWS];
    double total = 0;
    for (int64_t r0 = 0; r0 < S; r0 += rows) {
        int64_t nr = clamp(rows, S - r0);
        for (int64_t r = 0; r < nr; r++) {
            m[r] = -INFINITY;
            l[r] = 0;
            tl[r] = 0;
        }
        for (int64_t c0 = 0; c0 < V; c0 += vchunk) {
            if (ml_kctx_interrupted(ctx))
                return ML_EINTERRUPTED;
            int64_t nc = clamp(vchunk, V - c0);
            ml_status s = logits_block(dt, scratch, h, W, r0, nr, c0, nc, D, ctx);
            if (s != ML_OK)
                return s;
            ce_args a = {dt, scratch, targets, m, l, tl, NULL, r0, c0, nc, 0};
            s = ml_parallel_tiles(nr, 8, 8 * nc, ctx, fwd_rows, &a);
            if (s != ML_OK)
                return s;
        }
        for (int64_t r = 0; r < nr; r++) {
            if (m[r] != m[r] || l[r] != l[r])
                return ML_ENAN;
            lse[r0 + r] = m[r] + log(l[r]);
            total += lse[r0 + r] - tl[r];
        }
    }
    *loss = S > 0 ? total / (double)S : 0.0;
    return ML_OK;
}

/* block <- (exp(logit - lse) - onehot) * scale, rows [lo, hi) of the chunk */
static void bwd_rows(void *arg, int64_t lo, int64_t hi)
{
    const ce_args *a = arg;
    for (int64_t r = lo; r < hi; r++) {
        double z = a->lse[a->r0 + r];
        int64_t t = a->targets[a->r0 + r] - a->c0;
        for (int64_t c = 0; c < a->nc; c++) {
            double p = exp(ld(a->dt, a->blk, r * a->nc + c) - z);
            st(a->dt, a->blk, r * a->nc + c, (p - (c == t ? 1.0 : 0.0)) * a->scale);
        }
    }
}

ml_status ml_ce_backward_cpu(ml_dtype dt, void *dh, void *dW, double dloss, const void *h,
                             const void *W, const int64_t *targets, const double *lse, int64_t S,
                             int64_t V, int64_t D, int64_t rows, int64_t vchunk, void *scratch,
                             const ml_kctx *ctx)
{
    if (dt != ML_F32 && dt != ML_F64)
        return ML_EUNSUPPORTED;
    if (rows < 1 || rows > ML_CE_MAX_ROWS || vchunk < 1)
        return ML_EUNSUPPORTED;
    size_t es = ml_dtype_size(dt);
    memset(dh, 0, (size_t)(S * D) * es);
    double scale = S > 0 ? dloss / (double)S : 0.0;
    for (int64_t r0 = 0; r0 < S; r0 += rows) {
        int64_t nr = clamp(rows, S - r0);
        for (int64_t c0 = 0; c0 < V; c0 += vchunk) {
            if (ml_kctx_interrupted(ctx))
                return ML_EINTERRUPTED;
            int64_t nc = clamp(vchunk, V - c0);
            ml_status s = logits_block(dt, scratch, h, W, r0, nr, c0, nc, D, ctx);
            if (s != ML_OK)
                return s;
            ce_args a = {dt, scratch, targets, NULL, NULL, NULL, lse, r0, c0, nc, scale};
            s = ml_parallel_tiles(nr, 8, 8 * nc, ctx, bwd_rows, &a);
            if (s != ML_OK)
                return s;
            /* dh[r0:r0+nr] += G [nr, nc] . W[c0:c0+nc] [nc, D] */
            ml_gemm_shape g1 = {.batch = 1, .m = nr, .n = D, .k = nc, .ta = 0, .tb = 0,
                                .lda = nc, .ldb = D, .ldc = D, .alpha = 1.0, .beta = 1.0};
            s = ml_matmul_cpu(dt, dt, (char *)dh + (size_t)(r0 * D) * es, scratch,
                              (const char *)W + (size_t)(c0 * D) * es, &g1, ctx);
            if (s != ML_OK)
                return s;
            /* dW[c0:c0+nc] += G^T [nc, nr] . h[r0:r0+nr] [nr, D] */
            ml_gemm_shape g2 = {.batch = 1, .m = nc, .n = D, .k = nr, .ta = 1, .tb = 0,
                                .lda = nc, .ldb = D, .ldc = D, .alpha = 1.0, .beta = 1.0};
            s = ml_matmul_cpu(dt, dt, (char *)dW + (size_t)(c0 * D) * es, scratch,
                              (const char *)h + (size_t)(r0 * D) * es, &g2, ctx);
            if (s != ML_OK)
                return s;
        }
    }
    return ML_OK;
}
