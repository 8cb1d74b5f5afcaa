/*
 * kernels/router_ops.h - the per-token math of the router family, written
 * once for both backends (ML_HD: host and device), so router.c and
 * router.cu cannot drift apart: noise, lse, scores, softmax, p' and
 * entropy, keys and top-k selection, combine weights, and the per-token
 * backward to dL/dl. Semantics and noise counters in router.h.
 *
 * Not here: the logits and everything across tokens (dx, dwg, psum, counts,
 * zsum, entropy sums), threads, blocks, chunks, NaN flags: those differ by
 * backend by design (router.c, router.cu). Functions work on raw pointers
 * into one token's scratch row and never allocate.
 *
 * Scratch row of one token (4E + 2 f64):
 *   [0, E)    L  raw logits (backward: overwritten by dL/dl)
 *   [E, 2E)   S  scores
 *   [2E, 3E)  P  p' (forward) or p (backward)
 *   [3E, 4E)  G  selection keys (forward) or dL/dp' (backward)
 *   4E        lse^2 (CUDA backward: 1 for a NaN token),  4E + 1  entropy H(p')
 */
#ifndef ML_KERNELS_ROUTER_OPS_H
#define ML_KERNELS_ROUTER_OPS_H

#include <math.h>

#include "philox.h"
#include "router.h"

static inline ML_HD int64_t ml_router_row_width(int64_t E) { return 4 * E + 2; }

/* Tokens per chunk: chunk clamped to [1, T]. */
static inline ML_HD int64_t ml_router_chunk_rows(int64_t T, int64_t chunk)
{
    int64_t c = chunk < T ? chunk : T;
    return c < 1 ? 1 : c;
}

/* One Philox block of the router's noise (counter layout in router.h). */
static inline ML_HD void ml_router_noise_block(const ml_router_cfg *cfg, int64_t t, int64_t group,
                                               uint32_t word, uint32_t out[4])
{
    uint32_t key[2] = {(uint32_t)cfg->seed, (uint32_t)(cfg->seed >> 32)};
    uint32_t ctr[4] = {(uint32_t)(cfg->token_offset + (uint64_t)t), (uint32_t)cfg->step,
                       ((uint32_t)group << 2) | word, 0x80000000u | (uint32_t)cfg->layer};
    ml_philox4x32_10(ctr, key, out);
}

/* s = l / tau [+ noise z] [+ gumbel g] for token t. */
static inline ML_HD void ml_router_scores(const ml_router_cfg *cfg, int64_t t, int64_t E,
                                          const double *l, double *s)
{
    for (int64_t e = 0; e < E; e++)
        s[e] = l[e] / cfg->temperature;
    int noise = cfg->noise > 0;
    if (!noise && !cfg->gumbel)
        return;
    for (int64_t g = 0; g * 4 < E; g++) {
        uint32_t r0[4] = {0}, r1[4] = {0}, r2[4] = {0};   /* set when used; -O3 cannot tell */
        if (noise) {
            ml_router_noise_block(cfg, t, g, 0, r0);
            ml_router_noise_block(cfg, t, g, 1, r1);
        }
        if (cfg->gumbel)
            ml_router_noise_block(cfg, t, g, 2, r2);
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
static inline ML_HD double ml_router_logsumexp(const double *v, int64_t n)
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
static inline ML_HD void ml_router_softmax(const double *s, double *p, int64_t n)
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

/* lse, scores and p for token t from the logits already in its row.
 * Returns lse, or NAN on a NaN logit or score (the caller raises its flag). */
static inline ML_HD double ml_router_probs(const ml_router_cfg *cfg, int64_t t, int64_t E,
                                           double *row)
{
    double *L = row, *S = row + E, *P = row + 2 * E;
    int bad = 0;
    for (int64_t e = 0; e < E; e++)
        bad |= isnan(L[e]);
    if (bad)
        return NAN;
    double lse = ml_router_logsumexp(L, E);
    ml_router_scores(cfg, t, E, L, S);
    ml_router_softmax(S, P, E);
    for (int64_t e = 0; e < E; e++)
        bad |= isnan(P[e]);
    return bad ? NAN : lse;
}

/* The k largest keys, ties to the lower index, in descending order
 * (insertion into the sorted output row, as kernels/topk.c). */
static inline ML_HD void ml_router_select_topk(const double *key, int64_t E, int64_t k, int64_t *ix)
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
static inline ML_HD void ml_router_subset_softmax(const double *S, const int64_t *ix, int64_t k,
                                                  double *m, double *den)
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

/* Forward of one token after ml_router_probs returned lse (not NaN):
 * p' and H(p') into the row (P, 4E, 4E + 1), keys into K, the selection
 *   ix [k] int64  =  expert ids, descending key order
 *   w  [k] dt     =  combine weights (w is the weights tensor, w0 the
 *                    token's first slot)
 * bias [E] of bias_dt or NULL. */
static inline ML_HD void ml_router_token_forward(ml_dtype dt, int64_t *ix, void *w, size_t w0,
                                                 double *row, double lse,
                                                 ml_dtype bias_dt, const void *bias,
                                                 int64_t E, const ml_router_cfg *cfg)
{
    int64_t k = cfg->k;
    double om = 1.0 - cfg->eps, u = cfg->eps / (double)E;
    double *S = row + E, *P = row + 2 * E, *K = row + 3 * E;
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
        K[e] = base[e] + (bias ? ml_load(bias_dt, bias, (size_t)e) : 0.0);
    ml_router_select_topk(K, E, k, ix);

    if (cfg->mode == ML_ROUTER_SOFTMAX_TOPK) {
        double Z = 0;
        if (cfg->renorm)
            for (int64_t j = 0; j < k; j++)
                Z += P[ix[j]];
        for (int64_t j = 0; j < k; j++)
            ml_store(dt, w, w0 + (size_t)j, cfg->renorm ? P[ix[j]] / Z : P[ix[j]]);
    } else {
        double m, den;
        ml_router_subset_softmax(S, ix, k, &m, &den);
        for (int64_t j = 0; j < k; j++)
            ml_store(dt, w, w0 + (size_t)j, exp(S[ix[j]] - m) / den);
    }
}

/* Backward of one token after ml_router_probs returned lse (not NaN):
 * dL/dl into L (row[0, E), =), dL/dp' into G as scratch. ix [k] the saved
 * selection; dw the weights' gradient tensor of dt, w0 the token's first
 * slot; aux [E] f64 or NULL; gz = dL/dzsum. */
static inline ML_HD void ml_router_token_backward(ml_dtype dt, double *row, const int64_t *ix,
                                                  const void *dw, size_t w0, const double *aux,
                                                  double gz, double lse, int64_t E,
                                                  const ml_router_cfg *cfg)
{
    int64_t k = cfg->k;
    double om = 1.0 - cfg->eps, u = cfg->eps / (double)E, tau = cfg->temperature;
    double *L = row, *S = row + E, *P = row + 2 * E, *G = row + 3 * E;
    /* z-loss: d(gz lse^2)/dl_e = 2 gz lse softmax(l)_e */
    for (int64_t e = 0; e < E; e++) {
        L[e] = 2.0 * gz * lse * exp(L[e] - lse);
        G[e] = aux ? aux[e] : 0.0;
    }
    if (cfg->mode == ML_ROUTER_SOFTMAX_TOPK) {
        if (cfg->renorm) {
            double Z = 0, dotw = 0;
            for (int64_t j = 0; j < k; j++)
                Z += om * P[ix[j]] + u;
            for (int64_t j = 0; j < k; j++)
                dotw += ml_load(dt, dw, w0 + (size_t)j) * ((om * P[ix[j]] + u) / Z);
            for (int64_t j = 0; j < k; j++)
                G[ix[j]] += (ml_load(dt, dw, w0 + (size_t)j) - dotw) / Z;
        } else {
            for (int64_t j = 0; j < k; j++)
                G[ix[j]] += ml_load(dt, dw, w0 + (size_t)j);
        }
    } else {
        double m, den, dotw = 0;
        ml_router_subset_softmax(S, ix, k, &m, &den);
        for (int64_t j = 0; j < k; j++)
            dotw += ml_load(dt, dw, w0 + (size_t)j) * (exp(S[ix[j]] - m) / den);
        for (int64_t j = 0; j < k; j++) {
            double wj = exp(S[ix[j]] - m) / den;
            L[ix[j]] += wj * (ml_load(dt, dw, w0 + (size_t)j) - dotw) / tau;
        }
    }
    /* through p' = (1 - eps) p + eps / E and p = softmax(s), s = l / tau + const */
    double gbar = 0;
    for (int64_t e = 0; e < E; e++)
        gbar += P[e] * (om * G[e]);
    for (int64_t e = 0; e < E; e++)
        L[e] += P[e] * (om * G[e] - gbar) / tau;
}

/* Aux-loss-free bias step (router.h): b_e += gamma * sign(mean - C_e). */
static inline ML_HD void ml_router_bias_step(ml_dtype dt, void *bias, const int64_t *counts,
                                             int64_t E, double gamma)
{
    double total = 0;
    for (int64_t e = 0; e < E; e++)
        total += (double)counts[e];
    double mean = E > 0 ? total / (double)E : 0;
    for (int64_t e = 0; e < E; e++) {
        double diff = mean - (double)counts[e];
        double sgn = diff > 0 ? 1.0 : diff < 0 ? -1.0 : 0.0;
        ml_store(dt, bias, (size_t)e, ml_load(dt, bias, (size_t)e) + gamma * sgn);
    }
}

#endif
