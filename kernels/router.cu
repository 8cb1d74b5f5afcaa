/*
 * kernels/router.cu - the chunked router on CUDA (semantics, noise counters
 * and invariance rules in router.h; the per-token math and the scratch row
 * layout are router_ops.h, shared with the CPU twin router.c).
 *
 * Each chunk of `chunk` tokens runs as a few kernels on the context's stream:
 *   logits     8 lanes per (token, expert): lane j adds the products of the
 *              elements d = j, j+8, ... in d order (the CPU's partial sum j),
 *              then xor-shuffles 1, 2, 4 combine them as
 *              ((s0+s1)+(s2+s3))+((s4+s5)+(s6+s7)): bitwise the CPU's dot.
 *   token      one thread per token: lse, scores (the same Philox counters),
 *              softmax, p', entropy, top-k and weights (forward) or dL/dl
 *              (backward): router_ops.h, the CPU's code, in f64.
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
#include "router_ops.h"
}

#include <math.h>

#define TOKEN_THREADS 128

__device__ int router_nan;           /* a NaN was seen in this call */
__device__ int router_stop;          /* ... in an earlier chunk: later chunks do nothing */
__device__ double router_acc[2];     /* zsum, entropy carried across chunks */

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
            rows[r * ml_router_row_width(E) + e] = dt == ML_F32 ? (double)(float)s : s;
        }
    }
}

/* ---- per-token math (router_ops.h) ------------------------------------------ */

/* router_ops.h's lse, scores and p for token t from the logits already in
 * its row; NaN (and the flag) on a NaN logit or score. */
__device__ double recompute(const ml_router_cfg &cfg, int64_t t, int64_t E, double *row)
{
    double lse = ml_router_probs(&cfg, t, E, row);
    if (isnan(lse))
        router_nan = 1;   /* a plain store of a constant: no race on the outcome */
    return lse;
}

/* ---- forward ------------------------------------------------------------------ */

__global__ void forward_token_kernel(ml_dtype dt, ml_router_cfg cfg, int64_t *idx, void *w,
                                     ml_dtype bias_dt, const void *bias, double *rows,
                                     int64_t c0, int64_t n, int64_t E)
{
    if (router_stop)
        return;
    int64_t k = cfg.k;
    ML_CUDA_FOR(r, n) {
        int64_t t = c0 + r;
        double *row = rows + r * ml_router_row_width(E);
        double lse = recompute(cfg, t, E, row);
        if (isnan(lse))
            continue;
        ml_router_token_forward(dt, idx + t * k, w, (size_t)(t * k), row, lse, bias_dt, bias, E,
                                &cfg);
    }
}

/* Phase B, per expert: psum and counts over the chunk in token order. */
__global__ void forward_sums_kernel(int64_t *counts, double *psum, const int64_t *idx,
                                    const double *rows, int64_t c0, int64_t n, int64_t E, int64_t k)
{
    if (router_nan)
        return;
    int64_t rw = ml_router_row_width(E);
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
    int64_t rw = ml_router_row_width(E);
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
    int64_t chunk = ml_router_chunk_rows(T, cfg->chunk), k = cfg->k;
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
    ML_CUDA_FOR(r, n) {
        int64_t t = c0 + r;
        double *row = rows + r * ml_router_row_width(E);
        double lse = recompute(cfg, t, E, row);
        row[4 * E] = isnan(lse) ? 1.0 : 0.0;
        if (isnan(lse))
            continue;
        ml_router_token_backward(dt, row, sidx + t * k, dw, (size_t)(t * k), aux, gz, lse, E, &cfg);
    }
}

/* dx[t, d] += sum_e dl_te wg[e, d], experts in order (f64). */
__global__ void backward_dx_kernel(ml_dtype dt, void *dx, const void *wg, const double *rows,
                                   int64_t c0, int64_t n, int64_t D, int64_t E)
{
    if (router_stop)
        return;
    int64_t rw = ml_router_row_width(E);
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
    int64_t rw = ml_router_row_width(E);
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
    int64_t chunk = ml_router_chunk_rows(T, cfg->chunk);
    double *rows = (double *)scratch;
    double *acc = rows + (size_t)chunk * (size_t)ml_router_row_width(E);
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
    ml_router_bias_step(dt, bias, counts, E, gamma);
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
