/*
 * kernels/router.cu - the chunked router on CUDA (semantics, noise counters
 * and invariance rules in router.h; the CPU twin is router.c, whose scratch
 * row layout this file shares).
 *
 * Each chunk of `chunk` tokens runs as a few kernels on the context's stream:
 *   logits     8 lanes per (token, expert): lane j adds the products of the
 *              elements d = j, j+8, ... in d order (the CPU's partial sum j),
 *              then xor-shuffles 1, 2, 4 combine them as
 *              ((s0+s1)+(s2+s3))+((s4+s5)+(s6+s7)): bitwise the CPU's dot.
 *   token      one thread per token: lse, scores (the same Philox counters),
 *              softmax, p', entropy, top-k and weights (forward) or dL/dl
 *              (backward), the CPU's code line for line in f64.
 *   forward    phase B: one thread per expert adds psum and counts over the
 *              chunk's tokens in token order; one thread adds zsum and entropy
 *              in token order (carried across chunks in __device__ memory).
 *   backward   dx: one thread per (token, column) sums experts in order;
 *              dwg: one thread per (expert, column) adds the chunk's tokens in
 *              token order into the f64 accumulator at the end of the scratch.
 * No float atomics: every sum has the CPU's order, so logits, selection and
 * the token-order sums are bitwise the CPU's wherever the inputs of exp/log
 * are. CUDA's f64 exp/log/cos are within 1-2 ulp of glibc's (not correctly
 * rounded), so p, w, psum, entropy, zsum, dx, dwg may differ from the CPU by
 * a few ulp (tests: 1e-12 relative, normwise); selection differs only if two
 * keys are within that distance.
 *
 * A NaN logit sets a __device__ flag (module state, like topk.cu: the host
 * drives one stream); later kernels of the call see it and do nothing, and
 * the call returns ML_ENAN after reading it back. zsum and entropy are host
 * scalars on both backends, so each call synchronises its stream once at the
 * end. The interrupt flag is polled between chunks.
 */
#include "cuda_common.cuh"

extern "C" {
#include "router.h"
#include "philox.h"
}

#include <math.h>

#define TOKEN_THREADS 128

__device__ int router_nan;           /* a NaN was seen in this call */
__device__ int router_stop;          /* ... in an earlier chunk: later chunks do nothing */
__device__ double router_acc[2];     /* zsum, entropy carried across chunks */

static inline __host__ __device__ int64_t row_width(int64_t E) { return 4 * E + 2; }

static inline int64_t chunk_rows(int64_t T, int64_t chunk)
{
    int64_t c = chunk < T ? chunk : T;
    return c < 1 ? 1 : c;
}

/* ---- logits: 8 lanes per dot ------------------------------------------------ */

__global__ void logits_kernel(ml_dtype dt, double *rows, const void *x, const void *wg,
                              int64_t c0, int64_t n, int64_t D, int64_t E)
{
    if (router_stop)
        return;
    int64_t G = n * E;                                   /* dots in this chunk */
    int64_t tid = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    int lane = threadIdx.x & 31, sub = lane & 7;
    int64_t stride = ((int64_t)gridDim.x * blockDim.x) / 8;
    /* a warp's four groups advance together, so the shuffles see a full warp */
    for (int64_t g0 = (tid & ~(int64_t)31) / 8; g0 < G; g0 += stride) {
        int64_t g = g0 + (lane >> 3);
        double s = 0;
        if (g < G) {
            int64_t r = g / E, e = g % E;
            if (dt == ML_F32) {
                const float *a = (const float *)x + (c0 + r) * D, *b = (const float *)wg + e * D;
                for (int64_t d = sub; d < D; d += 8)
                    s += (double)a[d] * (double)b[d];
            } else {
                const double *a = (const double *)x + (c0 + r) * D, *b = (const double *)wg + e * D;
                for (int64_t d = sub; d < D; d += 8)
                    s += a[d] * b[d];
            }
        }
        s += __shfl_xor_sync(0xffffffffu, s, 1);
        s += __shfl_xor_sync(0xffffffffu, s, 2);
        s += __shfl_xor_sync(0xffffffffu, s, 4);
        if (g < G && sub == 0) {
            int64_t r = g / E, e = g % E;
            rows[r * row_width(E) + e] = dt == ML_F32 ? (double)(float)s : s;
        }
    }
}

/* ---- per-token math (router.c's functions, on the device) ------------------- */

__device__ void noise_block(const ml_router_cfg &cfg, int64_t t, int64_t group, uint32_t word,
                            uint32_t out[4])
{
    uint32_t key[2] = {(uint32_t)cfg.seed, (uint32_t)(cfg.seed >> 32)};
    uint32_t ctr[4] = {(uint32_t)(cfg.token_offset + (uint64_t)t), (uint32_t)cfg.step, ((uint32_t)group << 2) | word,
                       0x80000000u | (uint32_t)cfg.layer};
    ml_philox4x32_10(ctr, key, out);
}

__device__ void scores(const ml_router_cfg &cfg, int64_t t, int64_t E, const double *l, double *s)
{
    for (int64_t e = 0; e < E; e++)
        s[e] = l[e] / cfg.temperature;
    int noise = cfg.noise > 0;
    if (!noise && !cfg.gumbel)
        return;
    for (int64_t g = 0; g * 4 < E; g++) {
        uint32_t r0[4], r1[4], r2[4];
        if (noise) {
            noise_block(cfg, t, g, 0, r0);
            noise_block(cfg, t, g, 1, r1);
        }
        if (cfg.gumbel)
            noise_block(cfg, t, g, 2, r2);
        for (int lane = 0; lane < 4 && g * 4 + lane < E; lane++) {
            int64_t e = g * 4 + lane;
            if (noise) {
                double u1 = ((double)(r0[lane] >> 8) + 1.0) * (1.0 / 16777216.0);
                double u2 = (double)(r1[lane] >> 8) * (1.0 / 16777216.0);
                s[e] += cfg.noise * (sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
            }
            if (cfg.gumbel) {
                double u = ((double)(r2[lane] >> 8) + 0.5) * (1.0 / 16777216.0);
                s[e] += -log(-log(u));
            }
        }
    }
}

__device__ double logsumexp(const double *v, int64_t n)
{
    double m = v[0];
    for (int64_t i = 1; i < n; i++)
        m = v[i] > m ? v[i] : m;
    double sum = 0;
    for (int64_t i = 0; i < n; i++)
        sum += exp(v[i] - m);
    return m + log(sum);
}

__device__ void softmax(const double *s, double *p, int64_t n)
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

/* lse, scores and p for token t from the logits already in its row; NaN
 * (and the flag) on a NaN logit or score. */
__device__ double recompute(const ml_router_cfg &cfg, int64_t t, int64_t E, double *row)
{
    double *L = row, *S = row + E, *P = row + 2 * E;
    int bad = 0;
    for (int64_t e = 0; e < E; e++)
        bad |= isnan(L[e]);
    double lse = bad ? NAN : logsumexp(L, E);
    if (!bad) {
        scores(cfg, t, E, L, S);
        softmax(S, P, E);
        for (int64_t e = 0; e < E; e++)
            bad |= isnan(P[e]);
    }
    if (bad) {
        router_nan = 1;   /* a plain store of a constant: no race on the outcome */
        return NAN;
    }
    return lse;
}

__device__ void select_topk(const double *key, int64_t E, int64_t k, int64_t *ix)
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

__device__ void subset_softmax(const double *S, const int64_t *ix, int64_t k, double *m, double *den)
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

/* ---- forward ------------------------------------------------------------------ */

__global__ void forward_token_kernel(ml_dtype dt, ml_router_cfg cfg, int64_t *idx, void *w,
                                     ml_dtype bias_dt, const void *bias, double *rows,
                                     int64_t c0, int64_t n, int64_t E)
{
    if (router_stop)
        return;
    int64_t k = cfg.k;
    double om = 1.0 - cfg.eps, u = cfg.eps / (double)E;
    ML_CUDA_FOR(r, n) {
        int64_t t = c0 + r;
        double *row = rows + r * row_width(E);
        double *S = row + E, *P = row + 2 * E, *K = row + 3 * E;
        double lse = recompute(cfg, t, E, row);
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

        const double *base = cfg.mode == ML_ROUTER_SOFTMAX_TOPK ? P : S;
        for (int64_t e = 0; e < E; e++)
            K[e] = base[e] + (bias ? ml_load(bias_dt, bias, (size_t)e) : 0.0);
        int64_t *ix = idx + t * k;
        select_topk(K, E, k, ix);

        size_t w0 = (size_t)(t * k);
        if (cfg.mode == ML_ROUTER_SOFTMAX_TOPK) {
            double Z = 0;
            if (cfg.renorm)
                for (int64_t j = 0; j < k; j++)
                    Z += P[ix[j]];
            for (int64_t j = 0; j < k; j++)
                ml_store(dt, w, w0 + (size_t)j, cfg.renorm ? P[ix[j]] / Z : P[ix[j]]);
        } else {
            double m, den;
            subset_softmax(S, ix, k, &m, &den);
            for (int64_t j = 0; j < k; j++)
                ml_store(dt, w, w0 + (size_t)j, exp(S[ix[j]] - m) / den);
        }
    }
}

/* Phase B, per expert: psum and counts over the chunk in token order. */
__global__ void forward_sums_kernel(int64_t *counts, double *psum, const int64_t *idx,
                                    const double *rows, int64_t c0, int64_t n, int64_t E, int64_t k)
{
    if (router_nan)
        return;
    int64_t rw = row_width(E);
    ML_CUDA_FOR(e, E) {
        double p = psum[e];
        int64_t c = 0;
        for (int64_t r = 0; r < n; r++) {
            p += rows[r * rw + 2 * E + e];
            const int64_t *ix = idx + (c0 + r) * k;
            for (int64_t j = 0; j < k; j++)
                c += ix[j] == e;
        }
        psum[e] = p;
        counts[e] += c;
    }
}

/* Phase B, one thread: zsum and entropy in token order. The chunk's last
 * kernel: a NaN seen in it stops the later chunks. */
__global__ void forward_scalars_kernel(const double *rows, int64_t n, int64_t E)
{
    if (router_nan) {
        router_stop = 1;
        return;
    }
    int64_t rw = row_width(E);
    double z = router_acc[0], h = router_acc[1];
    for (int64_t r = 0; r < n; r++) {
        z += rows[r * rw + 4 * E];
        h += rows[r * rw + 4 * E + 1];
    }
    router_acc[0] = z;
    router_acc[1] = h;
}

__global__ void init_kernel(double z, double h)
{
    router_nan = 0;
    router_stop = 0;
    router_acc[0] = z;
    router_acc[1] = h;
}

/* Read the flag (and the accumulators) back; synchronises the stream. */
static ml_status finish(cudaStream_t st, int *nan, double acc[2])
{
    ml_status s = ml_cuda_status(cudaMemcpyFromSymbolAsync(nan, router_nan, sizeof *nan, 0,
                                                           cudaMemcpyDeviceToHost, st));
    if (s == ML_OK && acc)
        s = ml_cuda_status(cudaMemcpyFromSymbolAsync(acc, router_acc, 2 * sizeof(double), 0,
                                                     cudaMemcpyDeviceToHost, st));
    if (s == ML_OK)
        s = ml_cuda_status(cudaStreamSynchronize(st));
    return s;
}

static unsigned logit_blocks(int64_t n, int64_t E)
{
    return ml_cuda_blocks(n * E * 8, ML_CUDA_THREADS);
}

extern "C" ml_status ml_router_forward_cuda(ml_dtype dt, int64_t *idx, void *w, int64_t *counts,
                                            double *psum, double *zsum, double *entropy,
                                            const void *x, const void *wg, ml_dtype bias_dt,
                                            const void *bias, int64_t T, int64_t D, int64_t E,
                                            const ml_router_cfg *cfg, void *scratch,
                                            const ml_kctx *ctx)
{
    if (dt != ML_F32 && dt != ML_F64)
        return ML_EUNSUPPORTED;
    if (bias && bias_dt != ML_F32 && bias_dt != ML_F64)
        return ML_EUNSUPPORTED;
    if (T <= 0)
        return ML_OK;
    cudaStream_t st = ml_cuda_stream(ctx);
    int64_t chunk = chunk_rows(T, cfg->chunk), k = cfg->k;
    double *rows = (double *)scratch;
    ml_status s;
    init_kernel<<<1, 1, 0, st>>>(*zsum, *entropy);
    if ((s = ml_cuda_launched()) != ML_OK)
        return s;
    for (int64_t c0 = 0; c0 < T; c0 += chunk) {
        if (ml_kctx_interrupted(ctx))
            return ML_EINTERRUPTED;
        int64_t n = T - c0 < chunk ? T - c0 : chunk;
        logits_kernel<<<logit_blocks(n, E), ML_CUDA_THREADS, 0, st>>>(dt, rows, x, wg, c0, n, D, E);
        if ((s = ml_cuda_launched()) != ML_OK)
            return s;
        forward_token_kernel<<<ml_cuda_blocks(n, TOKEN_THREADS), TOKEN_THREADS, 0, st>>>(
            dt, *cfg, idx, w, bias_dt, bias, rows, c0, n, E);
        if ((s = ml_cuda_launched()) != ML_OK)
            return s;
        forward_sums_kernel<<<ml_cuda_blocks(E, TOKEN_THREADS), TOKEN_THREADS, 0, st>>>(
            counts, psum, idx, rows, c0, n, E, k);
        if ((s = ml_cuda_launched()) != ML_OK)
            return s;
        forward_scalars_kernel<<<1, 1, 0, st>>>(rows, n, E);
        if ((s = ml_cuda_launched()) != ML_OK)
            return s;
    }
    int nan = 0;
    double acc[2];
    if ((s = finish(st, &nan, acc)) != ML_OK)
        return s;
    if (nan)
        return ML_ENAN;
    *zsum = acc[0];
    *entropy = acc[1];
    return ML_OK;
}

/* ---- backward ----------------------------------------------------------------- */

/* Per token: dL/dl into L (row[0, E)); row[4E] = 1 for a NaN token, else 0. */
__global__ void backward_token_kernel(ml_dtype dt, ml_router_cfg cfg, const int64_t *sidx,
                                      const void *dw, const double *aux, double gz, double *rows,
                                      int64_t c0, int64_t n, int64_t E)
{
    if (router_stop)
        return;
    int64_t k = cfg.k;
    double om = 1.0 - cfg.eps, u = cfg.eps / (double)E, tau = cfg.temperature;
    ML_CUDA_FOR(r, n) {
        int64_t t = c0 + r;
        double *row = rows + r * row_width(E);
        double *L = row, *S = row + E, *P = row + 2 * E, *G = row + 3 * E;
        double lse = recompute(cfg, t, E, row);
        row[4 * E] = isnan(lse) ? 1.0 : 0.0;
        if (isnan(lse))
            continue;
        for (int64_t e = 0; e < E; e++) {
            L[e] = 2.0 * gz * lse * exp(L[e] - lse);
            G[e] = aux ? aux[e] : 0.0;
        }
        const int64_t *ix = sidx + t * k;
        size_t w0 = (size_t)(t * k);
        if (cfg.mode == ML_ROUTER_SOFTMAX_TOPK) {
            if (cfg.renorm) {
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
            subset_softmax(S, ix, k, &m, &den);
            for (int64_t j = 0; j < k; j++)
                dotw += ml_load(dt, dw, w0 + (size_t)j) * (exp(S[ix[j]] - m) / den);
            for (int64_t j = 0; j < k; j++) {
                double wj = exp(S[ix[j]] - m) / den;
                L[ix[j]] += wj * (ml_load(dt, dw, w0 + (size_t)j) - dotw) / tau;
            }
        }
        double gbar = 0;
        for (int64_t e = 0; e < E; e++)
            gbar += P[e] * (om * G[e]);
        for (int64_t e = 0; e < E; e++)
            L[e] += P[e] * (om * G[e] - gbar) / tau;
    }
}

/* dx[t, d] += sum_e dl_te wg[e, d], experts in order (f64). */
__global__ void backward_dx_kernel(ml_dtype dt, void *dx, const void *wg, const double *rows,
                                   int64_t c0, int64_t n, int64_t D, int64_t E)
{
    if (router_stop)
        return;
    int64_t rw = row_width(E);
    ML_CUDA_FOR(i, n * D) {
        int64_t r = i / D, d = i % D;
        const double *dl = rows + r * rw;
        if (dl[4 * E] != 0.0)
            continue;
        double a = 0;
        if (dt == ML_F32) {
            const float *W = (const float *)wg;
            for (int64_t e = 0; e < E; e++)
                a += dl[e] * (double)W[e * D + d];
            float *o = (float *)dx + (c0 + r) * D + d;
            *o = (float)((double)*o + a);
        } else {
            const double *W = (const double *)wg;
            for (int64_t e = 0; e < E; e++)
                a += dl[e] * W[e * D + d];
            ((double *)dx)[(c0 + r) * D + d] += a;
        }
    }
}

/* acc[e, d] += sum over the chunk's tokens, in token order, of dl_te x_td.
 * The chunk's last kernel: a NaN seen in it stops the later chunks (the
 * CPU returns before this phase; dx of the chunk's other tokens is added,
 * as on the CPU). */
__global__ void backward_dwg_kernel(ml_dtype dt, double *acc, const void *x, const double *rows,
                                    int64_t c0, int64_t n, int64_t D, int64_t E)
{
    if (router_nan) {
        if (blockIdx.x == 0 && threadIdx.x == 0)
            router_stop = 1;
        return;
    }
    int64_t rw = row_width(E);
    ML_CUDA_FOR(i, E * D) {
        int64_t e = i / D, d = i % D;
        double a = acc[i];
        if (dt == ML_F32) {
            const float *X = (const float *)x + c0 * D + d;
            for (int64_t r = 0; r < n; r++)
                a += rows[r * rw + e] * (double)X[r * D];
        } else {
            const double *X = (const double *)x + c0 * D + d;
            for (int64_t r = 0; r < n; r++)
                a += rows[r * rw + e] * X[r * D];
        }
        acc[i] = a;
    }
}

__global__ void add_acc_kernel(ml_dtype dt, void *dwg, const double *acc, int64_t ne)
{
    if (router_nan)
        return;
    ML_CUDA_FOR(i, ne) {
        if (dt == ML_F32) {
            float *o = (float *)dwg + i;
            *o = (float)((double)*o + acc[i]);
        } else {
            ((double *)dwg)[i] += acc[i];
        }
    }
}

extern "C" ml_status ml_router_backward_cuda(ml_dtype dt, void *dx, void *dwg, const int64_t *idx,
                                             const void *dw, const double *aux, double gz,
                                             const void *x, const void *wg,
                                             int64_t T, int64_t D, int64_t E,
                                             const ml_router_cfg *cfg, void *scratch,
                                             const ml_kctx *ctx)
{
    if (dt != ML_F32 && dt != ML_F64)
        return ML_EUNSUPPORTED;
    if (T <= 0)
        return ML_OK;
    cudaStream_t st = ml_cuda_stream(ctx);
    int64_t chunk = chunk_rows(T, cfg->chunk);
    double *rows = (double *)scratch;
    double *acc = rows + (size_t)chunk * (size_t)row_width(E);
    ml_status s;
    init_kernel<<<1, 1, 0, st>>>(0.0, 0.0);
    if ((s = ml_cuda_launched()) != ML_OK)
        return s;
    if ((s = ml_cuda_status(cudaMemsetAsync(acc, 0, (size_t)(E * D) * sizeof(double), st))) != ML_OK)
        return s;
    for (int64_t c0 = 0; c0 < T; c0 += chunk) {
        if (ml_kctx_interrupted(ctx))
            return ML_EINTERRUPTED;
        int64_t n = T - c0 < chunk ? T - c0 : chunk;
        logits_kernel<<<logit_blocks(n, E), ML_CUDA_THREADS, 0, st>>>(dt, rows, x, wg, c0, n, D, E);
        if ((s = ml_cuda_launched()) != ML_OK)
            return s;
        backward_token_kernel<<<ml_cuda_blocks(n, TOKEN_THREADS), TOKEN_THREADS, 0, st>>>(
            dt, *cfg, idx, dw, aux, gz, rows, c0, n, E);
        if ((s = ml_cuda_launched()) != ML_OK)
            return s;
        backward_dx_kernel<<<ml_cuda_blocks(n * D, ML_CUDA_THREADS), ML_CUDA_THREADS, 0, st>>>(
            dt, dx, wg, rows, c0, n, D, E);
        if ((s = ml_cuda_launched()) != ML_OK)
            return s;
        backward_dwg_kernel<<<ml_cuda_blocks(E * D, ML_CUDA_THREADS), ML_CUDA_THREADS, 0, st>>>(
            dt, acc, x, rows, c0, n, D, E);
        if ((s = ml_cuda_launched()) != ML_OK)
            return s;
    }
    add_acc_kernel<<<ml_cuda_blocks(E * D, ML_CUDA_THREADS), ML_CUDA_THREADS, 0, st>>>(dt, dwg, acc, E * D);
    if ((s = ml_cuda_launched()) != ML_OK)
        return s;
    int nan = 0;
    if ((s = finish(st, &nan, NULL)) != ML_OK)
        return s;
    return nan ? ML_ENAN : ML_OK;
}

/* ---- aux-loss-free bias ---------------------------------------------------------- */

__global__ void update_bias_kernel(ml_dtype dt, void *bias, const int64_t *counts, int64_t E,
                                   double gamma)
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

extern "C" ml_status ml_router_update_bias_cuda(ml_dtype dt, void *bias, const int64_t *counts,
                                                int64_t E, double gamma, const ml_kctx *ctx)
{
    if (dt != ML_F32 && dt != ML_F64)
        return ML_EUNSUPPORTED;
    if (E <= 0)
        return ML_OK;
    update_bias_kernel<<<1, 1, 0, ml_cuda_stream(ctx)>>>(dt, bias, counts, E, gamma);
    return ml_cuda_launched();
}
