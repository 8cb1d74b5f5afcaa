/*
 * kernels/router.c - the chunked router on the CPU (semantics, noise
 * counters and invariance rules in router.h).
 * Each chunk runs in two phases. Phase A, parallel over fixed tiles of the
 * chunk's tokens: per token, logits -> scores -> probabilities -> selection
 * and weights (forward) or the logit gradient and dx (backward); each token
 * writes only its own outputs and its own scratch row. Phase B, in token
 * order: the sums across tokens (psum, counts, zsum, entropy serially; dwg
 * per element, parallel over elements), added into accumulators carried
 * across chunks. Nothing here depends on the chunk size or the thread count
 * except which tokens share a parallel region, so results are bitwise
 * invariant. The per-token math (scores, softmax, selection, weights, the
 * per-token backward) is router_ops.h, shared with router.cu; the scratch
 * row layout is described there.
 *
 */
#include "router.h"
#include "router_ops.h"
#include "parallel.h"
#include "vmath.h"

#include <math.h>

#define TILE_TOKENS 16     /* tokens per parallel tile */
#define TILE_COLS 64       /* dwg columns per parallel tile (acc block E x 64 in L1) */
#define DX_COLS 64         /* dx columns accumulated per pass over the experts */

size_t ml_router_scratch_bytes(int64_t T, int64_t D, int64_t E, int64_t chunk, int backward)
{
    size_t n = (size_t)ml_router_chunk_rows(T, chunk) * (size_t)ml_router_row_width(E);
    if (backward)
        n += (size_t)E * (size_t)D;
    return n * sizeof(double);
}

size_t ml_router_scratch_bytes_cuda(int64_t T, int64_t D, int64_t E, int64_t chunk, int backward)
{
    size_t nd = 1;   /* the flags */
    if (!backward) {
        int64_t V = E + 2, np = ml_router_chunk_rows(T, chunk) / ML_ROUTER_CUDA_SEG + 2;
        nd += (size_t)(2 * V + np * V);
    }
    return ml_router_scratch_bytes(T, D, E, chunk, backward) + nd * sizeof(double);
}

typedef struct {
    ml_dtype dt;
    const ml_router_cfg *cfg;
    const void *x, *wg;
    int64_t T, D, E, c0;       /* c0: first token of the chunk */
    double *rows;              /* [chunk, 4E + 2] */
    int nan;
    /* forward */
    int64_t *idx;
    void *w;
    ml_dtype bias_dt;
    const void *bias;
    /* backward */
    const int64_t *sidx;
    const void *dw;
    const double *aux;
    double gz;
    void *dx;
    double *acc;               /* [E, D] */
} rt_arg;

/* The 8 partial sums of dot() combined: a fixed tree. */
static double tree8(const double s[8])
{
    return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

/* sum_d a[d] b[d]: products in f64 (exact for f32 inputs), 8 interleaved
 * partial sums, a fixed tree; unrounded (logits() rounds). */
ML_CLONES
static double dot(ml_dtype dt, const void *a, const void *b, int64_t D)
{
    double s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t d = 0;
    if (dt == ML_F32) {
        const float *x = a, *y = b;
        for (; d + 8 <= D; d += 8)
            for (int j = 0; j < 8; j++)
                s[j] += (double)x[d + j] * (double)y[d + j];
        for (; d < D; d++)
            s[d % 8] += (double)x[d] * (double)y[d];
    } else {
        const double *x = a, *y = b;
        for (; d + 8 <= D; d += 8)
            for (int j = 0; j < 8; j++)
                s[j] += x[d + j] * y[d + j];
        for (; d < D; d++)
            s[d % 8] += x[d] * y[d];
    }
    return tree8(s);
}

/* row[e] = dot(x, wg_e) rounded once to dt, for every expert. f32 takes
 * four experts at a time: one load of x serves four products, and the four
 * chains of adds overlap instead of each waiting on its own latency; every
 * row's sums run in dot()'s order. The rounding is a pass of its own: GCC
 * 12.2 at -O3 (SLP vectorizer) dropped the (double)(float) of two of the
 * four rows when it sat in the block loop. */
ML_CLONES
static void logits(ml_dtype dt, const void *x, const void *wg, int64_t E, int64_t D, double *row)
{
    int64_t e = 0;
    if (dt == ML_F32)
        for (; e + 4 <= E; e += 4) {
            const float *a = x, *b = (const float *)wg + e * D;
            double s[4][8] = {{0}};
            int64_t d = 0;
            for (; d + 8 <= D; d += 8)
                for (int i = 0; i < 4; i++)
                    for (int j = 0; j < 8; j++)
                        s[i][j] += (double)a[d + j] * (double)b[i * D + d + j];
            for (; d < D; d++)
                for (int i = 0; i < 4; i++)
                    s[i][d % 8] += (double)a[d] * (double)b[i * D + d];
            for (int i = 0; i < 4; i++)
                row[e + i] = tree8(s[i]);
        }
    size_t es = ml_dtype_size(dt);
    for (; e < E; e++)
        row[e] = dot(dt, x, (const char *)wg + (size_t)(e * D) * es, D);
    if (dt == ML_F32)
        for (e = 0; e < E; e++)
            row[e] = (double)(float)row[e];
}

/* Logits, lse, scores and p for token t into its row. Returns lse, or NAN
 * after flagging a NaN logit or score. */
static double recompute(rt_arg *g, int64_t t, double *row)
{
    int64_t E = g->E, D = g->D;
    size_t es = ml_dtype_size(g->dt);
    const char *xt = (const char *)g->x + (size_t)(t * D) * es;
    logits(g->dt, xt, g->wg, E, D, row);
    double lse = ml_router_probs(g->cfg, t, E, row);
    if (isnan(lse)) {
        #pragma omp atomic write
        g->nan = 1;
    }
    return lse;
}

ML_CLONES
static void forward_tile(void *p, int64_t lo, int64_t hi)
{
    rt_arg *g = p;
    int64_t E = g->E, k = g->cfg->k;
    for (int64_t r = lo; r < hi; r++) {
        int64_t t = g->c0 + r;
        double *row = g->rows + r * ml_router_row_width(E);
        double lse = recompute(g, t, row);
        if (isnan(lse))
            continue;
        ml_router_token_forward(g->dt, g->idx + t * k, g->w, (size_t)(t * k), row, lse,
                                g->bias_dt, g->bias, E, g->cfg);
    }
}

ml_status ml_router_forward_cpu(ml_dtype dt, int64_t *idx, void *w, int64_t *counts,
                                double *psum, double *zsum, double *entropy,
                                const void *x, const void *wg, ml_dtype bias_dt, const void *bias,
                                int64_t T, int64_t D, int64_t E, const ml_router_cfg *cfg,
                                void *scratch, const ml_kctx *ctx)
{
    if (dt != ML_F32 && dt != ML_F64)
        return ML_EUNSUPPORTED;
    if (bias && bias_dt != ML_F32 && bias_dt != ML_F64)
        return ML_EUNSUPPORTED;
    int64_t chunk = ml_router_chunk_rows(T, cfg->chunk), k = cfg->k, rw = ml_router_row_width(E);
    rt_arg g = {0};
    g.dt = dt; g.cfg = cfg; g.x = x; g.wg = wg; g.T = T; g.D = D; g.E = E;
    g.rows = scratch; g.idx = idx; g.w = w; g.bias_dt = bias_dt; g.bias = bias;
    double z = *zsum, h = *entropy;
    for (int64_t c0 = 0; c0 < T; c0 += chunk) {
        int64_t n = T - c0 < chunk ? T - c0 : chunk;
        g.c0 = c0;
        ml_status s = ml_parallel_tiles(n, TILE_TOKENS, E * D + 64 * E, ctx, forward_tile, &g);
        if (s != ML_OK)
            return s;
        if (g.nan)
            return ML_ENAN;
        /* phase B: token order */
        for (int64_t r = 0; r < n; r++) {
            const double *row = g.rows + r * rw, *P = row + 2 * E;
            for (int64_t e = 0; e < E; e++)
                psum[e] += P[e];
            const int64_t *ix = idx + (c0 + r) * k;
            for (int64_t j = 0; j < k; j++)
                counts[ix[j]]++;
            z += row[4 * E];
            h += row[4 * E + 1];
        }
        if (ml_kctx_interrupted(ctx))   /* arrived during phase B: the call stops, not the next Lua line */
            return ML_EINTERRUPTED;
    }
    *zsum = z;
    *entropy = h;
    return ML_OK;
}

ML_CLONES
static void backward_tile(void *p, int64_t lo, int64_t hi)
{
    rt_arg *g = p;
    int64_t E = g->E, D = g->D, k = g->cfg->k;
    for (int64_t r = lo; r < hi; r++) {
        int64_t t = g->c0 + r;
        double *row = g->rows + r * ml_router_row_width(E);
        const double *L = row;
        double lse = recompute(g, t, row);
        if (isnan(lse))
            continue;
        ml_router_token_backward(g->dt, row, g->sidx + t * k, g->dw, (size_t)(t * k), g->aux,
                                 g->gz, lse, E, g->cfg);
        /* dx_t += sum_e dl_e wg_e (expert order, f64), in column blocks */
        for (int64_t d0 = 0; d0 < D; d0 += DX_COLS) {
            int64_t nd = D - d0 < DX_COLS ? D - d0 : DX_COLS;
            double a[DX_COLS];
            for (int64_t d = 0; d < nd; d++)
                a[d] = 0;
            if (g->dt == ML_F32) {
                const float *wg = (const float *)g->wg + d0;
                for (int64_t e = 0; e < E; e++)
                    for (int64_t d = 0; d < nd; d++)
                        a[d] += L[e] * (double)wg[e * D + d];
                float *dx = (float *)g->dx + t * D + d0;
                for (int64_t d = 0; d < nd; d++)
                    dx[d] = (float)((double)dx[d] + a[d]);
            } else {
                const double *wg = (const double *)g->wg + d0;
                for (int64_t e = 0; e < E; e++)
                    for (int64_t d = 0; d < nd; d++)
                        a[d] += L[e] * wg[e * D + d];
                double *dx = (double *)g->dx + t * D + d0;
                for (int64_t d = 0; d < nd; d++)
                    dx[d] += a[d];
            }
        }
    }
}

/* Phase B of the backward: acc[e, d] += sum over the chunk's tokens, in
 * token order, of dl_te x_td. Item = a block of TILE_COLS columns for every
 * expert, so each x row of the chunk is read once. */
ML_CLONES
static void dwg_tile(void *p, int64_t lo, int64_t hi)
{
    rt_arg *g = p;
    int64_t E = g->E, D = g->D, rw = ml_router_row_width(E);
    int64_t n = g->T - g->c0 < g->cfg->chunk ? g->T - g->c0 : g->cfg->chunk;
    for (int64_t it = lo; it < hi; it++) {
        int64_t d0 = it * TILE_COLS, d1 = d0 + TILE_COLS < D ? d0 + TILE_COLS : D;
        for (int64_t r = 0; r < n; r++) {
            const double *dl = g->rows + r * rw;
            int64_t t = g->c0 + r;
            double xf[TILE_COLS];   /* the row's block in f64, converted once for all experts */
            const double *xd = xf;
            if (g->dt == ML_F32) {
                const float *x = (const float *)g->x + t * D + d0;
                for (int64_t d = 0; d < d1 - d0; d++)
                    xf[d] = (double)x[d];
            } else {
                xd = (const double *)g->x + t * D + d0;
            }
            for (int64_t e = 0; e < E; e++) {
                double v = dl[e], *acc = g->acc + e * D;
                #pragma omp simd
                for (int64_t d = d0; d < d1; d++)
                    acc[d] += v * xd[d - d0];
            }
        }
    }
}

ml_status ml_router_backward_cpu(ml_dtype dt, void *dx, void *dwg, const int64_t *idx,
                                 const void *dw, const double *aux, double gz,
                                 const void *x, const void *wg,
                                 int64_t T, int64_t D, int64_t E, const ml_router_cfg *cfg,
                                 void *scratch, const ml_kctx *ctx)
{
    if (dt != ML_F32 && dt != ML_F64)
        return ML_EUNSUPPORTED;
    int64_t chunk = ml_router_chunk_rows(T, cfg->chunk);
    ml_router_cfg c = *cfg;
    c.chunk = chunk;
    rt_arg g = {0};
    g.dt = dt; g.cfg = &c; g.x = x; g.wg = wg; g.T = T; g.D = D; g.E = E;
    g.rows = scratch; g.sidx = idx; g.dw = dw; g.aux = aux; g.gz = gz; g.dx = dx;
    g.acc = (double *)scratch + (size_t)chunk * (size_t)ml_router_row_width(E);
    memset(g.acc, 0, (size_t)(E * D) * sizeof(double));
    int64_t nb = (D + TILE_COLS - 1) / TILE_COLS;
    for (int64_t c0 = 0; c0 < T; c0 += chunk) {
        int64_t n = T - c0 < chunk ? T - c0 : chunk;
        g.c0 = c0;
        ml_status s = ml_parallel_tiles(n, TILE_TOKENS, 2 * E * D + 64 * E, ctx, backward_tile, &g);
        if (s != ML_OK)
            return s;
        if (g.nan)
            return ML_ENAN;
        s = ml_parallel_tiles(nb, 1, n * E * TILE_COLS, ctx, dwg_tile, &g);
        if (s != ML_OK)
            return s;
    }
    size_t ne = (size_t)(E * D);
    if (dt == ML_F32) {
        float *o = dwg;
        for (size_t i = 0; i < ne; i++)
            o[i] = (float)((double)o[i] + g.acc[i]);
    } else {
        double *o = dwg;
        for (size_t i = 0; i < ne; i++)
            o[i] += g.acc[i];
    }
    return ML_OK;
}

ml_status ml_router_update_bias_cpu(ml_dtype dt, void *bias, const int64_t *counts, int64_t E,
                                    double gamma, const ml_kctx *ctx)
{
    (void)ctx;
    if (dt != ML_F32 && dt != ML_F64)
        return ML_EUNSUPPORTED;
    ml_router_bias_step(dt, bias, counts, E, gamma);
    return ML_OK;
}
