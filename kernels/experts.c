/*
 * kernels/experts.c - the tiled SwiGLU experts of kernels/experts.h on the
 * CPU. One OpenMP region runs every tile: the threads split each GEMM by
 * output columns (one single-threaded cblas call each; OpenBLAS's own
 * threads are set to 1 for the call and restored after, so the two thread
 * pools never spin against each other) and the elementwise steps by rows or
 * columns, with a barrier between steps. Every output element is written by
 * one thread, so results are bitwise repeatable for a fixed thread count.
 *
 * Per tile, forward: gather -> GEMM h -> silu·mul -> GEMM out -> add into y.
 * Backward: gather x and dy -> h (saved or recomputed) -> GEMM dact_u =
 * dyt·down[e] -> one fused row pass (act, dw = <dact_u, act>, dh) -> scale
 * dyt by w -> GEMMs ddown += doutᵀ·act, dgate_up += dhᵀ·xt, dxt = dh·gate_up[e]
 * -> add into dx. One exp per element in each direction.
 */
#include "experts.h"
#include <cblas.h>
#include <omp.h>

#include <math.h>
#include <string.h>

/* tile · (a·D + b·F), or -1 when a size is negative or the product overflows. */
static int64_t scratch_elems(const ml_experts_cfg *c, int64_t a, int64_t b)
{
    int64_t ad, bf, row, n;
    if (c->tile < 0 || c->D < 0 || c->F < 0 || __builtin_mul_overflow(a, c->D, &ad) ||
        __builtin_mul_overflow(b, c->F, &bf) || __builtin_add_overflow(ad, bf, &row) ||
        __builtin_mul_overflow(c->tile, row, &n))
        return -1;
    return n;
}

int64_t ml_experts_forward_scratch(const ml_experts_cfg *c)
{
    return scratch_elems(c, 1, 3);
}

int64_t ml_experts_backward_scratch(const ml_experts_cfg *c)
{
    return scratch_elems(c, 2, 4);
}

/* ---- elementwise steps over one tile ------------------------------------ */

typedef struct {
    ml_dtype dt;
    size_t es;              /* element size */
    int64_t D, F, k;
    const int64_t *pos;     /* order + p0: the tile's assignment ids */
    const void *w;          /* [T, k] */
    /* gather: dst [r, D] <- src rows */
    void *dst; const void *src;
    /* swiglu: h [r, 2F] -> act [r, F]; backward also dact_u [r, F] -> dh, dw */
    const void *h; void *act; const void *dact_u; void *dh; void *dw;
    /* add: acc [T, D] += scale_a · rows [r, D], rows sequential per column block */
    void *acc; const void *rows; int scaled; int64_t r;
} tile_arg;

static void gather_rows(void *p, int64_t lo, int64_t hi)
{
    tile_arg *g = p;
    size_t row = (size_t)g->D * g->es;
    for (int64_t i = lo; i < hi; i++)
        memcpy((char *)g->dst + (size_t)i * row, (const char *)g->src + (size_t)(g->pos[i] / g->k) * row,
               row);
}

/* dst rows *= w[a] in place (dout = w · dy). */
static void scale_rows(void *p, int64_t lo, int64_t hi)
{
    tile_arg *g = p;
    for (int64_t i = lo; i < hi; i++) {
        if (g->dt == ML_F32) {
            float s = ((const float *)g->w)[g->pos[i]], *d = (float *)g->dst + i * g->D;
            for (int64_t c = 0; c < g->D; c++)
                d[c] *= s;
        } else {
            double s = ((const double *)g->w)[g->pos[i]], *d = (double *)g->dst + i * g->D;
            for (int64_t c = 0; c < g->D; c++)
                d[c] *= s;
        }
    }
}

static void swiglu_fwd(void *p, int64_t lo, int64_t hi)
{
    tile_arg *g = p;
    int64_t F = g->F;
    for (int64_t i = lo; i < hi; i++) {
        if (g->dt == ML_F32) {
            const float *h = (const float *)g->h + i * 2 * F;
            float *a = (float *)g->act + i * F;
            for (int64_t f = 0; f < F; f++) {
                float x = h[f];
                a[f] = x / (1.0f + expf(-x)) * h[F + f];
            }
        } else {
            const double *h = (const double *)g->h + i * 2 * F;
            double *a = (double *)g->act + i * F;
            for (int64_t f = 0; f < F; f++) {
                double x = h[f];
                a[f] = x / (1.0 + exp(-x)) * h[F + f];
            }
        }
    }
}

/* One pass per row: act = silu(g)·u (as forward computed it), dw[a] =
 * <dact_u, act> (f64 sum, f ascending), then with dact = w·dact_u:
 * dg = dact·u·silu'(g), du = dact·silu(g), written to dh (which may be h
 * itself: each element is read before it is written). */
static void swiglu_bwd(void *p, int64_t lo, int64_t hi)
{
    tile_arg *g = p;
    int64_t F = g->F;
    for (int64_t i = lo; i < hi; i++) {
        int64_t a = g->pos[i];
        double dot = 0;
        if (g->dt == ML_F32) {
            const float *h = (const float *)g->h + i * 2 * F;
            const float *du_ = (const float *)g->dact_u + i * F;
            float *act = (float *)g->act + i * F, *dh = (float *)g->dh + i * 2 * F;
            float w = ((const float *)g->w)[a];
            for (int64_t f = 0; f < F; f++) {
                float x = h[f], u = h[F + f];
                float ex = expf(-x);
                float s = 1.0f / (1.0f + ex);
                float silu = x / (1.0f + ex);
                float av = silu * u;
                act[f] = av;
                dot += (double)du_[f] * (double)av;
                float d = w * du_[f];
                dh[f] = d * u * (s * (1.0f + x * (1.0f - s)));
                dh[F + f] = d * silu;
            }
            ((float *)g->dw)[a] = (float)dot;
        } else {
            const double *h = (const double *)g->h + i * 2 * F;
            const double *du_ = (const double *)g->dact_u + i * F;
            double *act = (double *)g->act + i * F, *dh = (double *)g->dh + i * 2 * F;
            double w = ((const double *)g->w)[a];
            for (int64_t f = 0; f < F; f++) {
                double x = h[f], u = h[F + f];
                double ex = exp(-x);
                double s = 1.0 / (1.0 + ex);
                double silu = x / (1.0 + ex);
                double av = silu * u;
                act[f] = av;
                dot += du_[f] * av;
                double d = w * du_[f];
                dh[f] = d * u * (s * (1.0 + x * (1.0 - s)));
                dh[F + f] = d * silu;
            }
            ((double *)g->dw)[a] = dot;
        }
    }
}

/* acc[t_i, c] += s_i · rows[i, c] for columns [lo, hi), rows in order:
 * each output element's additions happen in row order whatever the thread
 * count, even when a token appears twice in a tile. */
static void add_rows(void *p, int64_t lo, int64_t hi)
{
    tile_arg *g = p;
    for (int64_t i = 0; i < g->r; i++) {
        int64_t a = g->pos[i], t = a / g->k;
        if (g->dt == ML_F32) {
            float s = g->scaled ? ((const float *)g->w)[a] : 1.0f;
            float *y = (float *)g->acc + t * g->D;
            const float *o = (const float *)g->rows + i * g->D;
            if (g->scaled)
                for (int64_t c = lo; c < hi; c++)
                    y[c] += s * o[c];
            else
                for (int64_t c = lo; c < hi; c++)
                    y[c] += o[c];
        } else {
            double s = g->scaled ? ((const double *)g->w)[a] : 1.0;
            double *y = (double *)g->acc + t * g->D;
            const double *o = (const double *)g->rows + i * g->D;
            if (g->scaled)
                for (int64_t c = lo; c < hi; c++)
                    y[c] += s * o[c];
            else
                for (int64_t c = lo; c < hi; c++)
                    y[c] += o[c];
        }
    }
}

/* ---- the parallel tile driver ---------------------------------------------- */

/* [lo, hi) of n items for thread tid of nt, boundaries multiples of align. */
static void split(int64_t n, int tid, int nt, int64_t align, int64_t *lo, int64_t *hi)
{
    int64_t blocks = (n + align - 1) / align;
    *lo = blocks * tid / nt * align;
    *hi = blocks * (tid + 1) / nt * align;
    if (*lo > n) *lo = n;
    if (*hi > n) *hi = n;
}

/* Columns [n0, n1) of C [m, n] = op(A) · op(B) + beta·C (row-major): one
 * single-threaded cblas call on the calling thread. */
static void gemm_cols(ml_dtype dt, void *c, const void *a, const void *b, int64_t m, int64_t n0,
                      int64_t n1, int64_t k, int ta, int tb, int64_t lda, int64_t ldb, int64_t ldc,
                      double beta)
{
    if (n1 <= n0 || m <= 0)
        return;
    size_t boff = (size_t)(tb ? n0 * ldb : n0);
    enum CBLAS_TRANSPOSE TA = ta ? CblasTrans : CblasNoTrans, TB = tb ? CblasTrans : CblasNoTrans;
    if (k <= 0) {   /* C = beta·C */
        for (int64_t i = 0; i < m; i++)
            for (int64_t j = n0; j < n1; j++) {
                if (dt == ML_F32)
                    ((float *)c)[i * ldc + j] = beta == 0 ? 0.0f : (float)beta * ((float *)c)[i * ldc + j];
                else
                    ((double *)c)[i * ldc + j] = beta == 0 ? 0.0 : beta * ((double *)c)[i * ldc + j];
            }
        return;
    }
    if (dt == ML_F32)
        cblas_sgemm(CblasRowMajor, TA, TB, (blasint)m, (blasint)(n1 - n0), (blasint)k, 1.0f,
                    (const float *)a, (blasint)lda, (const float *)b + boff, (blasint)ldb,
                    (float)beta, (float *)c + n0, (blasint)ldc);
    else
        cblas_dgemm(CblasRowMajor, TA, TB, (blasint)m, (blasint)(n1 - n0), (blasint)k, 1.0,
                    (const double *)a, (blasint)lda, (const double *)b + boff, (blasint)ldb,
                    beta, (double *)c + n0, (blasint)ldc);
}

/* This thread's share of a GEMM's output columns (blocks of 16). */
#define GEMM_SPLIT(dt, c, a, b, m, n, k, ta, tb, lda, ldb, ldc, beta) do {     \
        int64_t n0_, n1_;                                                    \
        split((n), tid, nth, 16, &n0_, &n1_);                                \
        gemm_cols(dt, c, a, b, m, n0_, n1_, k, ta, tb, lda, ldb, ldc, beta); \
    } while (0)

/* This thread's rows (or columns) of an elementwise step. */
#define EW_SPLIT(n, align, fn, arg) do {                                     \
        int64_t lo_, hi_;                                                    \
        split((n), tid, nth, align, &lo_, &hi_);                             \
        if (hi_ > lo_) fn(arg, lo_, hi_);                                    \
    } while (0)

static int nthreads_of(const ml_kctx *ctx)
{
    return ctx && ctx->nthreads > 0 ? ctx->nthreads : 1;
}

/* ---- forward ---------------------------------------------------------------- */

ml_status ml_experts_forward_cpu(ml_dtype dt, void *y, void *h_saved, void *scratch,
                                 const void *x, const void *w, const int64_t *order,
                                 const int64_t *offsets, const ml_experts_weights *wt,
                                 const ml_experts_cfg *c, const ml_kctx *ctx)
{
    if (dt != ML_F32 && dt != ML_F64)
        return ML_EUNSUPPORTED;
    size_t es = ml_dtype_size(dt);
    int64_t D = c->D, F = c->F, R = c->tile;
    char *xt = scratch;                              /* [R, D], then out [R, D] */
    char *hbuf = xt + (size_t)(R * D) * es;          /* [R, 2F] */
    char *act = hbuf + (size_t)(R * 2 * F) * es;     /* [R, F] */
    /* y may be NULL when it holds nothing (memset(NULL, 0, 0) is UB) */
    if (!c->accumulate && c->T * D > 0)
        memset(y, 0, (size_t)(c->T * D) * es);
    int nt = nthreads_of(ctx), blas_threads = openblas_get_num_threads(), stop = 0;
    openblas_set_num_threads(1);
    #pragma omp parallel num_threads(nt) if (nt > 1)
    {
        int tid = omp_get_thread_num(), nth = omp_get_num_threads();
        tile_arg g = {.dt = dt, .es = es, .D = D, .F = F, .k = c->k, .w = w};
        for (int64_t e = 0; e < c->E; e++) {
            const void *gu = wt->gate_up[e], *dn = wt->down[e];
            if (!gu)   /* skipped (the same for every thread) */
                continue;
            for (int64_t p0 = offsets[e]; p0 < offsets[e + 1]; p0 += R) {
                #pragma omp master
                ml_kctx_progress(ctx);
                #pragma omp single
                stop = ml_kctx_interrupted(ctx);
                /* (the implied barrier: the previous tile is done, all see stop) */
                if (stop)
                    goto done;
                int64_t r = offsets[e + 1] - p0 < R ? offsets[e + 1] - p0 : R;
                void *h = p0 + r <= c->nsaved ? (char *)h_saved + (size_t)(p0 * 2 * F) * es : hbuf;
                g.pos = order + p0;
                g.r = r;
                g.dst = xt; g.src = x;
                EW_SPLIT(r, 1, gather_rows, &g);
                #pragma omp barrier
                GEMM_SPLIT(dt, h, xt, gu, r, 2 * F, D, 0, 1, D, D, 2 * F, 0.0);
                #pragma omp barrier
                g.h = h; g.act = act;
                EW_SPLIT(r, 1, swiglu_fwd, &g);
                #pragma omp barrier
                GEMM_SPLIT(dt, xt, act, dn, r, D, F, 0, 1, F, F, D, 0.0);
                #pragma omp barrier
                g.acc = y; g.rows = xt; g.scaled = 1;
                EW_SPLIT(D, 16, add_rows, &g);
            }
        }
    done:;
    }
    openblas_set_num_threads(blas_threads);
    return stop ? ML_EINTERRUPTED : ML_OK;
}

/* ---- backward --------------------------------------------------------------- */

ml_status ml_experts_backward_cpu(ml_dtype dt, void *dx, const ml_experts_wgrads *dwt, void *dw,
                                  uint8_t *touched, void *scratch, const void *h_saved,
                                  const void *dy, const void *x, const void *w,
                                  const int64_t *order, const int64_t *offsets,
                                  const ml_experts_weights *wt, const ml_experts_cfg *c,
                                  const ml_kctx *ctx)
{
    if (dt != ML_F32 && dt != ML_F64)
        return ML_EUNSUPPORTED;
    size_t es = ml_dtype_size(dt);
    int64_t D = c->D, F = c->F, R = c->tile;
    char *xt = scratch;                              /* [R, D] x rows */
    char *dyt = xt + (size_t)(R * D) * es;           /* [R, D] dy rows, then w·dy, then dxt */
    char *hbuf = dyt + (size_t)(R * D) * es;         /* [R, 2F] h (recomputed), then dh */
    char *act = hbuf + (size_t)(R * 2 * F) * es;     /* [R, F] */
    char *dact = act + (size_t)(R * F) * es;         /* [R, F] unscaled: dyt · down[e] */
    if (!c->accumulate) {
        if (c->T * c->k > 0)   /* dw may be NULL when it holds nothing */
            memset(dw, 0, (size_t)(c->T * c->k) * es);
        memset(touched, 0, (size_t)c->E);
    }
    for (int64_t e = 0; e < c->E; e++)
        if (wt->gate_up[e])
            touched[e] = offsets[e + 1] > offsets[e];
    int nt = nthreads_of(ctx), blas_threads = openblas_get_num_threads(), stop = 0;
    openblas_set_num_threads(1);
    #pragma omp parallel num_threads(nt) if (nt > 1)
    {
        int tid = omp_get_thread_num(), nth = omp_get_num_threads();
        tile_arg g = {.dt = dt, .es = es, .D = D, .F = F, .k = c->k, .w = w, .dw = dw};
        for (int64_t e = 0; e < c->E; e++) {
            const void *gu = wt->gate_up[e], *dn = wt->down[e];
            if (!gu)   /* skipped: its gradient entries are not read */
                continue;
            void *dgu = dwt->gate_up[e], *ddn = dwt->down[e];
            for (int64_t p0 = offsets[e]; p0 < offsets[e + 1]; p0 += R) {
                #pragma omp master
                ml_kctx_progress(ctx);
                #pragma omp single
                stop = ml_kctx_interrupted(ctx);
                if (stop)
                    goto done;
                int64_t r = offsets[e + 1] - p0 < R ? offsets[e + 1] - p0 : R;
                const void *h = p0 + r <= c->nsaved
                                    ? (const char *)h_saved + (size_t)(p0 * 2 * F) * es : hbuf;
                g.pos = order + p0;
                g.r = r;
                g.dst = xt; g.src = x;
                EW_SPLIT(r, 1, gather_rows, &g);
                g.dst = dyt; g.src = dy;
                EW_SPLIT(r, 1, gather_rows, &g);
                #pragma omp barrier
                if (h == hbuf)   /* recompute h [r, 2F] = xt · gate_up[e]ᵀ */
                    GEMM_SPLIT(dt, hbuf, xt, gu, r, 2 * F, D, 0, 1, D, D, 2 * F, 0.0);
                /* dact_u [r, F] = dyt [r, D] · down[e] [D, F] */
                GEMM_SPLIT(dt, dact, dyt, dn, r, F, D, 0, 0, D, F, F, 0.0);
                #pragma omp barrier
                g.h = h; g.act = act; g.dact_u = dact; g.dh = hbuf;
                EW_SPLIT(r, 1, swiglu_bwd, &g);
                g.dst = dyt;
                EW_SPLIT(r, 1, scale_rows, &g);
                #pragma omp barrier
                /* ddown[e] [D, F] += doutᵀ [D, r] · act [r, F] */
                GEMM_SPLIT(dt, ddn, dyt, act, D, F, r, 1, 0, D, F, F, 1.0);
                /* dgate_up[e] [2F, D] += dhᵀ [2F, r] · xt [r, D] */
                GEMM_SPLIT(dt, dgu, hbuf, xt, 2 * F, D, r, 1, 0, 2 * F, D, D, 1.0);
                #pragma omp barrier
                /* dxt [r, D] = dh [r, 2F] · gate_up[e] [2F, D], into dyt (dout is consumed) */
                GEMM_SPLIT(dt, dyt, hbuf, gu, r, D, 2 * F, 0, 0, 2 * F, D, D, 0.0);
                #pragma omp barrier
                g.acc = dx; g.rows = dyt; g.scaled = 0;
                EW_SPLIT(D, 16, add_rows, &g);
            }
        }
    done:;
    }
    openblas_set_num_threads(blas_threads);
    return stop ? ML_EINTERRUPTED : ML_OK;
}
