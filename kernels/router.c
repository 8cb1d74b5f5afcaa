/*
 * kernels/router.c - the chunked router on the CPU (semantics, noise
 * counters and invariance rules in router.h).
 *
 * Each chunk runs in two phases. Phase A, parallel over fixed tiles of the
 * chunk's tokens: per token, logits -> scores -> probabilities -> selection
 * and weights (forward) or the logit gradient and dx (backward); each token
 * writes only its own outputs and its own scratch row. Phase B, in token
 * order: the sums across tokens (psum, counts, zsum, entropy serially; dwg
 * per element, parallel over elements), added into accumulators carried
 * across chunks. Nothing here depends on the chunk size or the thread count
 * except which tokens share a parallel region, so results are bitwise
 * invariant.
 *
 * Scratch row of one token (4E + 2 f64):
 *   [0, E)    L  raw logits (backward: overwritten by dL/dl)
 *   [E, 2E)   S  scores
 *   [2E, 3E)  P  p' (forward) or p (backward)
 *   [3E, 4E)  G  selection keys (forward) or dL/dp' (backward)
 *   4E        lse^2,  4E + 1  entropy H(p')
 */
#include "router.h"
#include "parallel.h"
#include "philox.h"

#include <math.h>

#define TILE_TOKENS 16     /* tokens per parallel tile */
#define TILE_COLS 64       /* dwg columns per parallel tile (acc block E x 64 in L1) */
#define DX_COLS 64         /* dx columns accumulated per pass over the experts */

static inline int64_t row_width(int64_t E) { return 4 * E + 2; }

static inline int64_t chunk_rows(int64_t T, int64_t chunk)
{
    int64_t c = chunk < T ? chunk : T;
    return c < 1 ? 1 : c;
}

size_t ml_router_scratch_bytes(int64_t T, int64_t D, int64_t E, int64_t chunk, int backward)
{
    size_t n = (size_t)chunk_rows(T, chunk) * (size_t)row_width(E);
    if (backward)
        n += (size_t)E * (size_t)D;
    return n * sizeof(double);
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

/* sum_d a[d] b[d]: products in f64 (exact for f32 inputs), 8 interleaved
 * partial sums, a fixed tree, one rounding to dt. */
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
    double r = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
    return dt == ML_F32 ? (double)(float)r : r;
}

/* One Philox block of the router's noise (counter layout in router.h). */
static void noise_block(const ml_router_cfg *cfg, int64_t t, int64_t group, uint32_t word,
                        uint32_t out[4])
{
    uint32_t key[2] = {(uint32_t)cfg->seed, (uint32_t)(cfg->seed >> 32)};
    uint32_t ctr[4] = {(uint32_t)(cfg->token_offset + (uint64_t)t), (uint32_t)cfg->step, ((uint32_t)group << 2) | word,
                       0x80000000u | (uint32_t)cfg->layer};
    ml_philox4x32_10(ctr, key, out);
}

/* s = l / tau [+ noise z] [+ gumbel g] for token t. */
static void scores(const ml_router_cfg *cfg, int64_t t, int64_t E, const double *l, double *s)
{
    for (int64_t e = 0; e < E; e++)
        s[e] = l[e] / cfg->temperature;
    int noise = cfg->noise > 0;
    if (!noise && !cfg->gumbel)
        return;
    for (int64_t g = 0; g * 4 < E; g++) {
        uint32_t r0[4], r1[4], r2[4];
        if (noise) {
            noise_block(cfg, t, g, 0, r0);
            noise_block(cfg, t, g, 1, r1);
        }
        if (cfg->gumbel)
            noise_block(cfg, t, g, 2, r2);
        for (int lane = 0; lane < 4 && g * 4 + lane < E; lane++) {
            int64_t e = g * 4 + lane;
            if (noise) {
                double u1 = ((double)(r0[lane] >> 8) + 1.0) * (1.0 / 16777216.0);
                double u2 = (double)(r1[lane] >> 8) * (1.0 / 16777216.0);
                s[e] += cfg->noise * (sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
            }
            if (cfg->gumbel) {
                double u = ((double)(r2[lane] >> 8) + 0.5) * (1.0 / 16777216.0);
                s[e] += -log(-log(u));
            }
        }
    }
}

/* Max-subtracted log-sum-exp, sums in expert order. */
static double logsumexp(const double *v, int64_t n)
{
    double m = v[0];
    for (int64_t i = 1; i < n; i++)
        m = v[i] > m ? v[i] : m;
    double sum = 0;
    for (int64_t i = 0; i < n; i++)
        sum += exp(v[i] - m);
    return m + log(sum);
}

/* p = softmax(s), max-subtracted, sums in expert order. */
static void softmax(const double *s, double *p, int64_t n)
{
    double m = s[0];
    for (int64_t i = 1; i < n; i++)
        m = s[i] > m ? s[i] : m;
    double sum = 0;
    for (int64_t i = 0; i < n; i++) {
        p[i] = exp(s[i] - m);
        sum += p[i];
    }
    for (int64_t i = 0; i < n; i++)
        p[i] /= sum;
}

/* Logits, lse, scores and p for token t into its row. Returns lse, or NAN
 * after flagging a NaN logit or score. */
static double recompute(rt_arg *g, int64_t t, double *row)
{
    int64_t E = g->E, D = g->D;
    size_t es = ml_dtype_size(g->dt);
    double *L = row, *S = row + E, *P = row + 2 * E;
    const char *xt = (const char *)g->x + (size_t)(t * D) * es;
    int bad = 0;
    for (int64_t e = 0; e < E; e++) {
        L[e] = dot(g->dt, xt, (const char *)g->wg + (size_t)(e * D) * es, D);
        bad |= isnan(L[e]);
    }
    double lse = bad ? NAN : logsumexp(L, E);
    if (!bad) {
        scores(g->cfg, t, E, L, S);
        softmax(S, P, E);
        for (int64_t e = 0; e < E; e++)
            bad |= isnan(P[e]);
    }
    if (bad) {
        #pragma omp atomic write
        g->nan = 1;
        return NAN;
    }
    return lse;
}

/* The k largest keys, ties to the lower index, in descending order
 * (insertion into the sorted output row, as kernels/topk.c). */
static void select_topk(const double *key, int64_t E, int64_t k, int64_t *ix)
{
    int64_t n = 0;
    for (int64_t e = 0; e < E; e++) {
        double v = key[e];
        if (n == k) {
            if (!(v > key[ix[n - 1]]))
                continue;
            n--;
        }
        int64_t pos = n;
        while (pos > 0 && v > key[ix[pos - 1]]) {
            ix[pos] = ix[pos - 1];
            pos--;
        }
        ix[pos] = e;
        n++;
    }
}

/* Softmax over the selected scores: max and denominator. */
static void subset_softmax(const double *S, const int64_t *ix, int64_t k, double *m, double *den)
{
    double mx = S[ix[0]];
    for (int64_t j = 1; j < k; j++)
        mx = S[ix[j]] > mx ? S[ix[j]] : mx;
    double sum = 0;
    for (int64_t j = 0; j < k; j++)
        sum += exp(S[ix[j]] - mx);
    *m = mx;
    *den = sum;
}

static void forward_tile(void *p, int64_t lo, int64_t hi)
{
    rt_arg *g = p;
    const ml_router_cfg *cfg = g->cfg;
    int64_t E = g->E, k = cfg->k;
    double om = 1.0 - cfg->eps, u = cfg->eps / (double)E;
    for (int64_t r = lo; r < hi; r++) {
        int64_t t = g->c0 + r;
        double *row = g->rows + r * row_width(E);
        double *S = row + E, *P = row + 2 * E, *K = row + 3 * E;
        double lse = recompute(g, t, row);
        if (isnan(lse))
            continue;
        double H = 0;
        for (int64_t e = 0; e < E; e++) {
            P[e] = om * P[e] + u;
            if (P[e] > 0)
                H -= P[e] * log(P[e]);
        }
        row[4 * E] = lse * lse;
        row[4 * E + 1] = H;

        const double *base = cfg->mode == ML_ROUTER_SOFTMAX_TOPK ? P : S;
        for (int64_t e = 0; e < E; e++)
            K[e] = base[e] + (g->bias ? ml_load(g->bias_dt, g->bias, (size_t)e) : 0.0);
        int64_t *ix = g->idx + t * k;
        select_topk(K, E, k, ix);

        size_t w0 = (size_t)(t * k);
        if (cfg->mode == ML_ROUTER_SOFTMAX_TOPK) {
            double Z = 0;
            if (cfg->renorm)
                for (int64_t j = 0; j < k; j++)
                    Z += P[ix[j]];
            for (int64_t j = 0; j < k; j++)
                ml_store(g->dt, g->w, w0 + (size_t)j, cfg->renorm ? P[ix[j]] / Z : P[ix[j]]);
        } else {
            double m, den;
            subset_softmax(S, ix, k, &m, &den);
            for (int64_t j = 0; j < k; j++)
                ml_store(g->dt, g->w, w0 + (size_t)j, exp(S[ix[j]] - m) / den);
        }
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
    int64_t chunk = chunk_rows(T, cfg->chunk), k = cfg->k, rw = row_width(E);
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
    }
    *zsum = z;
    *entropy = h;
    return ML_OK;
}

static void backward_tile(void *p, int64_t lo, int64_t hi)
{
    rt_arg *g = p;
    const ml_router_cfg *cfg = g->cfg;
    int64_t E = g->E, D = g->D, k = cfg->k;
    double om = 1.0 - cfg->eps, u = cfg->eps / (double)E, tau = cfg->temperature;
    for (int64_t r = lo; r < hi; r++) {
        int64_t t = g->c0 + r;
        double *row = g->rows + r * row_width(E);
        double *L = row, *S = row + E, *P = row + 2 * E, *G = row + 3 * E;
        double lse = recompute(g, t, row);
        if (isnan(lse))
            continue;
        /* z-loss: d(gz lse^2)/dl_e = 2 gz lse softmax(l)_e */
        for (int64_t e = 0; e < E; e++) {
            L[e] = 2.0 * g->gz * lse * exp(L[e] - lse);
            G[e] = g->aux ? g->aux[e] : 0.0;
        }
        const int64_t *ix = g->sidx + t * k;
        size_t w0 = (size_t)(t * k);
        if (cfg->mode == ML_ROUTER_SOFTMAX_TOPK) {
            if (cfg->renorm) {
                double Z = 0, dotw = 0;
                for (int64_t j = 0; j < k; j++)
                    Z += om * P[ix[j]] + u;
                for (int64_t j = 0; j < k; j++)
                    dotw += ml_load(g->dt, g->dw, w0 + (size_t)j) * ((om * P[ix[j]] + u) / Z);
                for (int64_t j = 0; j < k; j++)
                    G[ix[j]] += (ml_load(g->dt, g->dw, w0 + (size_t)j) - dotw) / Z;
            } else {
                for (int64_t j = 0; j < k; j++)
                    G[ix[j]] += ml_load(g->dt, g->dw, w0 + (size_t)j);
            }
        } else {
            double m, den, dotw = 0;
            subset_softmax(S, ix, k, &m, &den);
            for (int64_t j = 0; j < k; j++)
                dotw += ml_load(g->dt, g->dw, w0 + (size_t)j) * (exp(S[ix[j]] - m) / den);
            for (int64_t j = 0; j < k; j++) {
                double wj = exp(S[ix[j]] - m) / den;
                L[ix[j]] += wj * (ml_load(g->dt, g->dw, w0 + (size_t)j) - dotw) / tau;
            }
        }
        /* through p' = (1 - eps) p + eps / E and p = softmax(s), s = l / tau + const */
        double gbar = 0;
        for (int64_t e = 0; e < E; e++)
            gbar += P[e] * (om * G[e]);
        for (int64_t e = 0; e < E; e++)
            L[e] += P[e] * (om * G[e] - gbar) / tau;
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
static void dwg_tile(void *p, int64_t lo, int64_t hi)
{
    rt_arg *g = p;
    int64_t E = g->E, D = g->D, rw = row_width(E);
    int64_t n = g->T - g->c0 < g->cfg->chunk ? g->T - g->c0 : g->cfg->chunk;
    for (int64_t it = lo; it < hi; it++) {
        int64_t d0 = it * TILE_COLS, d1 = d0 + TILE_COLS < D ? d0 + TILE_COLS : D;
        for (int64_t r = 0; r < n; r++) {
            const double *dl = g->rows + r * rw;
            int64_t t = g->c0 + r;
            for (int64_t e = 0; e < E; e++) {
                double v = dl[e], *acc = g->acc + e * D;
                if (g->dt == ML_F32) {
                    const float *x = (const float *)g->x + t * D;
                    for (int64_t d = d0; d < d1; d++)
                        acc[d] += v * (double)x[d];
                } else {
                    const double *x = (const double *)g->x + t * D;
                    for (int64_t d = d0; d < d1; d++)
                        acc[d] += v * x[d];
                }
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
    int64_t chunk = chunk_rows(T, cfg->chunk);
    ml_router_cfg c = *cfg;
    c.chunk = chunk;
    rt_arg g = {0};
    g.dt = dt; g.cfg = &c; g.x = x; g.wg = wg; g.T = T; g.D = D; g.E = E;
    g.rows = scratch; g.sidx = idx; g.dw = dw; g.aux = aux; g.gz = gz; g.dx = dx;
    g.acc = (double *)scratch + (size_t)chunk * (size_t)row_width(E);
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
    double total = 0;
    for (int64_t e = 0; e < E; e++)
        total += (double)counts[e];
    double mean = E > 0 ? total / (double)E : 0;
    for (int64_t e = 0; e < E; e++) {
        double diff = mean - (double)counts[e];
        double sgn = diff > 0 ? 1.0 : diff < 0 ? -1.0 : 0.0;
        ml_store(dt, bias, (size_t)e, ml_load(dt, bias, (size_t)e) + gamma * sgn);
    }
    return ML_OK;
}
