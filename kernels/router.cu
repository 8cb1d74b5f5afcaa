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
 *   forward    phase B: counts by integer atomics over the chunk's n·k ids
 *              (exact); psum, zsum and entropy in fixed segments of SEG
 *              tokens aligned to the token index t: one thread per (segment
 *              piece, quantity) adds its tokens in token order (a segment cut
 *              by a chunk boundary continues from its open partial), then one
 *              thread per quantity adds the finished segments in order. The
 *              order depends on T only, so the sums are deterministic and
 *              bitwise invariant to the chunk size, and the work is spread
 *              over (segments x quantities) threads instead of E threads
 *              scanning n·k ids and one thread adding two scalars.
 *   backward   dx: one thread per (token, column) sums experts in order;
 *              dwg: one thread per (expert, column) adds the chunk's tokens in
 *              token order into the f64 accumulator at the end of the scratch.
 * No float atomics: logits, selection, dx and dwg have the CPU's order, so
 * they are bitwise the CPU's wherever the inputs of exp/log are; psum,
 * zsum and entropy are added by segments (above), a fixed order of their
 * own. CUDA's f64 exp/log/cos are within 1-2 ulp of glibc's (not correctly
 * rounded), so p, w, psum, entropy, zsum, dx, dwg may differ from the CPU by
 * a few ulp (tests: 1e-12 relative, normwise); selection differs only if two
 * keys are within that distance.
 *
 * bf16 (router.h): the kernels that read x, wg, dx or dwg are templates on
 * the storage type (cuda_float.cuh's ml_float): bf16 values widened exactly,
 * the logits rounded to f32, dx rounded to bf16 once per call, dwg f32. The
 * same operations as the f32 kernels on the widened values, so a bf16 call
 * is the f32 call with w and dx then rounded to bf16.
 *
 * A NaN logit sets a flag in the call's scratch, after the rows (not
 * __device__ module state, which calls on two streams would share); later
 * kernels of the call see it and do nothing, and the call returns ML_ENAN
 * after reading it back. zsum and entropy are host scalars on both
 * backends, so each call synchronises its stream once at the end. The
 * interrupt flag is polled between chunks.
 */
#include "cuda_float.cuh"

extern "C" {
#include "router.h"
#include "router_ops.h"
}

#include <math.h>

#define TOKEN_THREADS 128
#define SEG ML_ROUTER_CUDA_SEG   /* tokens per segment of the forward's psum / zsum / entropy */

typedef struct {
    int nan;     /* a NaN was seen in this call */
    int stop;    /* ... in an earlier chunk: later chunks do nothing */
} router_flags;
static_assert(sizeof(router_flags) <= sizeof(double), "the flags take one f64 slot of the scratch");

/* ---- logits: 8 lanes per dot ------------------------------------------------ */

/* X: the storage type of x and wg. Products in f64 (exact for f32 and
 * bf16), the dot rounded once to X's compute type: f32 for f32 and bf16
 * (the fp32 router), none for f64. */
template <typename X>
__global__ void logits_kernel(const router_flags *f, double *rows, const X *x, const X *wg,
                              int64_t c0, int64_t n, int64_t D, int64_t E)
{
    typedef ml_float<X> F;
    if (f->stop)
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
            const X *a = x + (c0 + r) * D, *b = wg + e * D;
            for (int64_t d = sub; d < D; d += 8)
                s += (double)F::load(a[d]) * (double)F::load(b[d]);
        }
        s += __shfl_xor_sync(0xffffffffu, s, 1);
        s += __shfl_xor_sync(0xffffffffu, s, 2);
        s += __shfl_xor_sync(0xffffffffu, s, 4);
        if (g < G && sub == 0) {
            int64_t r = g / E, e = g % E;
            rows[r * ml_router_row_width(E) + e] = (double)(typename F::acc)s;
        }
    }
}

/* ---- per-token math (router_ops.h) ------------------------------------------ */

/* router_ops.h's lse, scores and p for token t from the logits already in
 * its row; NaN (and the flag) on a NaN logit or score. */
__device__ double recompute(router_flags *f, const ml_router_cfg &cfg, int64_t t, int64_t E,
                            double *row)
{
    double lse = ml_router_probs(&cfg, t, E, row);
    if (isnan(lse))
        f->nan = 1;   /* a plain store of a constant: no race on the outcome */
    return lse;
}

/* ---- forward ------------------------------------------------------------------ */

__global__ void forward_token_kernel(router_flags *f, ml_dtype dt, ml_router_cfg cfg, int64_t *idx,
                                     void *w, ml_dtype bias_dt, const void *bias, double *rows,
                                     int64_t c0, int64_t n, int64_t E)
{
    if (f->stop)
        return;
    int64_t k = cfg.k;
    ML_CUDA_FOR(r, n) {
        int64_t t = c0 + r;
        double *row = rows + r * ml_router_row_width(E);
        double lse = recompute(f, cfg, t, E, row);
        if (isnan(lse))
            continue;
        ml_router_token_forward(dt, idx + t * k, w, (size_t)(t * k), row, lse, bias_dt, bias, E,
                                &cfg);
    }
}

/* Phase B: counts[e] += the chunk's assignments to e (integer atomics: exact). */
__global__ void forward_counts_kernel(const router_flags *f, unsigned long long *counts,
                                      const int64_t *idx, int64_t c0, int64_t n, int64_t k)
{
    if (f->nan)
        return;
    ML_CUDA_FOR(a, n * k)
        atomicAdd(counts + idx[c0 * k + a], 1ull);
}

/* The forward's sums in segments: quantity q < E is psum[q], E the z term,
 * E + 1 the entropy term. acc[q] holds the start value plus every finished
 * segment (in order), open[q] the partial of a segment a chunk boundary
 * cut, part[p, q] this chunk's piece p of segment c0 / SEG + p. */
typedef struct {
    double *acc, *open, *part;   /* [E + 2], [E + 2], [pieces, E + 2] */
} sums_ws;

__device__ double sum_term(const double *row, int64_t q, int64_t E)
{
    return q < E ? row[2 * E + q] : row[4 * E + (q - E)];
}

/* Segments touched by tokens [c0, c0 + n). */
__host__ __device__ int64_t pieces(int64_t c0, int64_t n)
{
    return (c0 + n - 1) / SEG - c0 / SEG + 1;
}

/* A piece's end token (exclusive). */
__device__ int64_t piece_end(int64_t c0, int64_t n, int64_t p)
{
    int64_t e = (c0 / SEG + p + 1) * SEG;
    return e < c0 + n ? e : c0 + n;
}

/* One thread per (piece, quantity): the piece's tokens in token order; the
 * first piece continues the open partial when the chunk starts mid-segment. */
__global__ void sums_piece_kernel(const router_flags *f, sums_ws ws, const double *rows,
                                  int64_t c0, int64_t n, int64_t E)
{
    if (f->nan)
        return;
    int64_t V = E + 2, rw = ml_router_row_width(E);
    ML_CUDA_FOR(i, pieces(c0, n) * V) {
        int64_t p = i / V, q = i % V;
        int64_t t0 = (c0 / SEG + p) * SEG, t1 = piece_end(c0, n, p);
        double a = 0;
        if (t0 < c0) {
            t0 = c0;
            a = ws.open[q];
        }
        for (int64_t t = t0; t < t1; t++)
            a += sum_term(rows + (t - c0) * rw, q, E);
        ws.part[i] = a;
    }
}

/* One thread per quantity: finished segments into acc in order; a piece cut
 * by the chunk's end becomes the open partial. The chunk's last kernel: a
 * NaN seen in it stops the later chunks. */
__global__ void sums_fold_kernel(router_flags *f, sums_ws ws, int64_t c0, int64_t n, int64_t E)
{
    if (f->nan) {
        if (blockIdx.x == 0 && threadIdx.x == 0)
            f->stop = 1;
        return;
    }
    int64_t V = E + 2, np = pieces(c0, n);
    ML_CUDA_FOR(q, V) {
        double a = ws.acc[q];
        for (int64_t p = 0; p < np; p++) {
            if (piece_end(c0, n, p) % SEG == 0)
                a += ws.part[p * V + q];
            else
                ws.open[q] = ws.part[p * V + q];
        }
        ws.acc[q] = a;
    }
}

/* Start values: psum's, and the host's zsum and entropy; no open segment. */
__global__ void sums_init_kernel(sums_ws ws, const double *psum, double z, double h, int64_t E)
{
    ML_CUDA_FOR(q, E + 2) {
        ws.acc[q] = q < E ? psum[q] : q == E ? z : h;
        ws.open[q] = 0;
    }
}

/* The last open segment (T not a multiple of SEG) closes; psum gets its
 * result, acc[E], acc[E + 1] hold zsum and entropy for the host. */
__global__ void sums_finish_kernel(const router_flags *f, sums_ws ws, double *psum, int64_t T,
                                   int64_t E)
{
    if (f->nan)
        return;
    ML_CUDA_FOR(q, E + 2) {
        double a = T % SEG ? ws.acc[q] + ws.open[q] : ws.acc[q];
        ws.acc[q] = a;
        if (q < E)
            psum[q] = a;
    }
}

/* Read the flag (and zsum, entropy) back; synchronises the stream. */
static ml_status finish(cudaStream_t st, const router_flags *f, int *nan, const double *zh,
                        double acc[2])
{
    ml_status s = ml_cuda_status(cudaMemcpyAsync(nan, &f->nan, sizeof *nan,
                                                 cudaMemcpyDeviceToHost, st));
    if (s == ML_OK && acc)
        s = ml_cuda_status(cudaMemcpyAsync(acc, zh, 2 * sizeof(double), cudaMemcpyDeviceToHost, st));
    if (s == ML_OK)
        s = ml_cuda_status(cudaStreamSynchronize(st));
    return s;
}

/* The call's flags, then (forward) the sums' workspace, at p: the scratch
 * past the CPU's part (ml_router_scratch_bytes_cuda); the flags cleared. */
static ml_status state_init(router_flags **f, sums_ws *ws, double *p, int64_t E, cudaStream_t st)
{
    int64_t V = E + 2;
    *f = (router_flags *)p;
    if (ws) {   /* a chunk touches at most chunk / SEG + 2 segments: part's rows */
        ws->acc = p + 1;
        ws->open = ws->acc + V;
        ws->part = ws->open + V;
    }
    return ml_cuda_status(cudaMemsetAsync(p, 0, sizeof(router_flags), st));
}

static unsigned logit_blocks(int64_t n, int64_t E)
{
    return ml_cuda_blocks(n * E * 8, ML_CUDA_THREADS);
}

/* Every chunk's kernels, then the sums' close and the read-back of the
 * flag and of zsum, entropy (acc[E], acc[E + 1]) into zh. X: x's and wg's
 * storage type (dt's). */
template <typename X>
static ml_status forward_run(router_flags *f, sums_ws ws, ml_dtype dt, int64_t *idx, void *w,
                             int64_t *counts, double *psum, const void *x, const void *wg,
                             ml_dtype bias_dt, const void *bias, int64_t T, int64_t D, int64_t E,
                             const ml_router_cfg *cfg, double *rows, int64_t chunk,
                             const ml_kctx *ctx, int *nan, double zh[2])
{
    cudaStream_t st = ml_cuda_stream(ctx);
    int64_t k = cfg->k, V = E + 2;
    ml_status s;
    sums_init_kernel<<<ml_cuda_blocks(V, TOKEN_THREADS), TOKEN_THREADS, 0, st>>>(ws, psum, zh[0],
                                                                                 zh[1], E);
    if ((s = ml_cuda_launched()) != ML_OK)
        return s;
    for (int64_t c0 = 0; c0 < T; c0 += chunk) {
        if (ml_kctx_interrupted(ctx))
            return ML_EINTERRUPTED;
        int64_t n = T - c0 < chunk ? T - c0 : chunk;
        logits_kernel<X><<<logit_blocks(n, E), ML_CUDA_THREADS, 0, st>>>(
            f, rows, (const X *)x, (const X *)wg, c0, n, D, E);
        if ((s = ml_cuda_launched()) != ML_OK)
            return s;
        forward_token_kernel<<<ml_cuda_blocks(n, TOKEN_THREADS), TOKEN_THREADS, 0, st>>>(
            f, dt, *cfg, idx, w, bias_dt, bias, rows, c0, n, E);
        if ((s = ml_cuda_launched()) != ML_OK)
            return s;
        forward_counts_kernel<<<ml_cuda_blocks(n * k, ML_CUDA_THREADS), ML_CUDA_THREADS, 0, st>>>(
            f, (unsigned long long *)counts, idx, c0, n, k);
        if ((s = ml_cuda_launched()) != ML_OK)
            return s;
        sums_piece_kernel<<<ml_cuda_blocks(pieces(c0, n) * V, TOKEN_THREADS), TOKEN_THREADS, 0, st>>>(
            f, ws, rows, c0, n, E);
        if ((s = ml_cuda_launched()) != ML_OK)
            return s;
        sums_fold_kernel<<<ml_cuda_blocks(V, TOKEN_THREADS), TOKEN_THREADS, 0, st>>>(f, ws, c0, n, E);
        if ((s = ml_cuda_launched()) != ML_OK)
            return s;
    }
    sums_finish_kernel<<<ml_cuda_blocks(V, TOKEN_THREADS), TOKEN_THREADS, 0, st>>>(f, ws, psum, T, E);
    if ((s = ml_cuda_launched()) != ML_OK)
        return s;
    return finish(st, f, nan, ws.acc + E, zh);
}

extern "C" ml_status ml_router_forward_cuda(ml_dtype dt, int64_t *idx, void *w, int64_t *counts,
                                            double *psum, double *zsum, double *entropy,
                                            const void *x, const void *wg, ml_dtype bias_dt,
                                            const void *bias, int64_t T, int64_t D, int64_t E,
                                            const ml_router_cfg *cfg, void *scratch,
                                            const ml_kctx *ctx)
{
    if (dt != ML_F32 && dt != ML_F64 && dt != ML_BF16)
        return ML_EUNSUPPORTED;
    if (bias && bias_dt != ML_F32 && bias_dt != ML_F64)
        return ML_EUNSUPPORTED;
    if (T <= 0)
        return ML_OK;
    cudaStream_t st = ml_cuda_stream(ctx);
    int64_t chunk = ml_router_chunk_rows(T, cfg->chunk);
    router_flags *f = NULL;
    sums_ws ws;
    int nan = 0;
    double zh[2] = {*zsum, *entropy};
    double *rows = (double *)scratch;
    ml_status s = state_init(&f, &ws, rows + ml_router_scratch_bytes(T, D, E, cfg->chunk, 0) /
                             sizeof(double), E, st);
    if (s == ML_OK) {
        switch (dt) {
        case ML_F32:
            s = forward_run<float>(f, ws, dt, idx, w, counts, psum, x, wg, bias_dt, bias, T, D, E,
                                   cfg, rows, chunk, ctx, &nan, zh);
            break;
        case ML_F64:
            s = forward_run<double>(f, ws, dt, idx, w, counts, psum, x, wg, bias_dt, bias, T, D, E,
                                    cfg, rows, chunk, ctx, &nan, zh);
            break;
        default:
            s = forward_run<ml_bf16>(f, ws, dt, idx, w, counts, psum, x, wg, bias_dt, bias, T, D,
                                     E, cfg, rows, chunk, ctx, &nan, zh);
            break;
        }
    }
    if (s != ML_OK)
        return s;
    if (nan)
        return ML_ENAN;
    *zsum = zh[0];
    *entropy = zh[1];
    return ML_OK;
}

/* ---- backward ----------------------------------------------------------------- */

/* Per token: dL/dl into L (row[0, E)); row[4E] = 1 for a NaN token, else 0. */
__global__ void backward_token_kernel(router_flags *f, ml_dtype dt, ml_router_cfg cfg,
                                      const int64_t *sidx, const void *dw, const double *aux,
                                      double gz, double *rows, int64_t c0, int64_t n, int64_t E)
{
    if (f->stop)
        return;
    int64_t k = cfg.k;
    ML_CUDA_FOR(r, n) {
        int64_t t = c0 + r;
        double *row = rows + r * ml_router_row_width(E);
        double lse = recompute(f, cfg, t, E, row);
        row[4 * E] = isnan(lse) ? 1.0 : 0.0;
        if (isnan(lse))
            continue;
        ml_router_token_backward(dt, row, sidx + t * k, dw, (size_t)(t * k), aux, gz, lse, E, &cfg);
    }
}

/* dx[t, d] += sum_e dl_te wg[e, d], experts in order (f64), rounded once
 * to X. */
template <typename X>
__global__ void backward_dx_kernel(const router_flags *f, X *dx, const X *wg, const double *rows,
                                   int64_t c0, int64_t n, int64_t D, int64_t E)
{
    typedef ml_float<X> F;
    if (f->stop)
        return;
    int64_t rw = ml_router_row_width(E);
    ML_CUDA_FOR(i, n * D) {
        int64_t r = i / D, d = i % D;
        const double *dl = rows + r * rw;
        if (dl[4 * E] != 0.0)
            continue;
        double a = 0;
        for (int64_t e = 0; e < E; e++)
            a += dl[e] * (double)F::load(wg[e * D + d]);
        X *o = dx + (c0 + r) * D + d;
        *o = F::store((typename F::acc)((double)F::load(*o) + a));
    }
}

/* acc[e, d] += sum over the chunk's tokens, in token order, of dl_te x_td.
 * The chunk's last kernel: a NaN seen in it stops the later chunks (the
 * CPU returns before this phase; dx of the chunk's other tokens is added,
 * as on the CPU). */
template <typename X>
__global__ void backward_dwg_kernel(router_flags *f, double *acc, const X *x, const double *rows,
                                    int64_t c0, int64_t n, int64_t D, int64_t E)
{
    typedef ml_float<X> F;
    if (f->nan) {
        if (blockIdx.x == 0 && threadIdx.x == 0)
            f->stop = 1;
        return;
    }
    int64_t rw = ml_router_row_width(E);
    ML_CUDA_FOR(i, E * D) {
        int64_t e = i / D, d = i % D;
        double a = acc[i];
        const X *xd = x + c0 * D + d;
        for (int64_t r = 0; r < n; r++)
            a += rows[r * rw + e] * (double)F::load(xd[r * D]);
        acc[i] = a;
    }
}

/* dwg += acc, rounded once to G, the gradient type (ml_grad_dtype). */
template <typename G>
__global__ void add_acc_kernel(const router_flags *f, G *dwg, const double *acc, int64_t ne)
{
    typedef ml_float<G> F;
    if (f->nan)
        return;
    ML_CUDA_FOR(i, ne)
        dwg[i] = F::store((typename F::acc)((double)F::load(dwg[i]) + acc[i]));
}

/* Every chunk's kernels, the accumulator's add and the flag's read-back.
 * X: x's and wg's storage type (dt's); G: dwg's (ml_grad_dtype(dt)'s). */
template <typename X, typename G>
static ml_status backward_run(router_flags *f, ml_dtype dt, void *dx, void *dwg, const int64_t *idx,
                              const void *dw, const double *aux, double gz, const void *x,
                              const void *wg, int64_t T, int64_t D, int64_t E,
                              const ml_router_cfg *cfg, double *rows, int64_t chunk,
                              const ml_kctx *ctx, int *nan)
{
    cudaStream_t st = ml_cuda_stream(ctx);
    double *acc = rows + (size_t)chunk * (size_t)ml_router_row_width(E);
    ml_status s;
    if ((s = ml_cuda_status(cudaMemsetAsync(acc, 0, (size_t)(E * D) * sizeof(double), st))) != ML_OK)
        return s;
    for (int64_t c0 = 0; c0 < T; c0 += chunk) {
        if (ml_kctx_interrupted(ctx))
            return ML_EINTERRUPTED;
        int64_t n = T - c0 < chunk ? T - c0 : chunk;
        logits_kernel<X><<<logit_blocks(n, E), ML_CUDA_THREADS, 0, st>>>(
            f, rows, (const X *)x, (const X *)wg, c0, n, D, E);
        if ((s = ml_cuda_launched()) != ML_OK)
            return s;
        backward_token_kernel<<<ml_cuda_blocks(n, TOKEN_THREADS), TOKEN_THREADS, 0, st>>>(
            f, dt, *cfg, idx, dw, aux, gz, rows, c0, n, E);
        if ((s = ml_cuda_launched()) != ML_OK)
            return s;
        backward_dx_kernel<X><<<ml_cuda_blocks(n * D, ML_CUDA_THREADS), ML_CUDA_THREADS, 0, st>>>(
            f, (X *)dx, (const X *)wg, rows, c0, n, D, E);
        if ((s = ml_cuda_launched()) != ML_OK)
            return s;
        backward_dwg_kernel<X><<<ml_cuda_blocks(E * D, ML_CUDA_THREADS), ML_CUDA_THREADS, 0, st>>>(
            f, acc, (const X *)x, rows, c0, n, D, E);
        if ((s = ml_cuda_launched()) != ML_OK)
            return s;
    }
    add_acc_kernel<G><<<ml_cuda_blocks(E * D, ML_CUDA_THREADS), ML_CUDA_THREADS, 0, st>>>(
        f, (G *)dwg, acc, E * D);
    if ((s = ml_cuda_launched()) != ML_OK)
        return s;
    return finish(st, f, nan, NULL, NULL);
}

extern "C" ml_status ml_router_backward_cuda(ml_dtype dt, void *dx, void *dwg, const int64_t *idx,
                                             const void *dw, const double *aux, double gz,
                                             const void *x, const void *wg,
                                             int64_t T, int64_t D, int64_t E,
                                             const ml_router_cfg *cfg, void *scratch,
                                             const ml_kctx *ctx)
{
    if (dt != ML_F32 && dt != ML_F64 && dt != ML_BF16)
        return ML_EUNSUPPORTED;
    if (T <= 0)
        return ML_OK;
    cudaStream_t st = ml_cuda_stream(ctx);
    int64_t chunk = ml_router_chunk_rows(T, cfg->chunk);
    router_flags *f = NULL;
    int nan = 0;
    double *rows = (double *)scratch;
    ml_status s = state_init(&f, NULL, rows + ml_router_scratch_bytes(T, D, E, cfg->chunk, 1) /
                             sizeof(double), E, st);
    if (s == ML_OK) {
        switch (dt) {
        case ML_F32:
            s = backward_run<float, float>(f, dt, dx, dwg, idx, dw, aux, gz, x, wg, T, D, E, cfg,
                                           rows, chunk, ctx, &nan);
            break;
        case ML_F64:
            s = backward_run<double, double>(f, dt, dx, dwg, idx, dw, aux, gz, x, wg, T, D, E, cfg,
                                             rows, chunk, ctx, &nan);
            break;
        default:   /* bf16: dwg is f32 (ml_grad_dtype) */
            s = backward_run<ml_bf16, float>(f, dt, dx, dwg, idx, dw, aux, gz, x, wg, T, D, E,
                                             cfg, rows, chunk, ctx, &nan);
            break;
        }
    }
    if (s != ML_OK)
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
