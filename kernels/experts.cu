/*
 * kernels/experts.cu - the tiled SwiGLU experts of kernels/experts.h on
 * CUDA: the CPU's tile walk (experts ascending, positions ascending, tiles
 * of R rows) with each step a kernel or a cuBLAS GEMM (ml_matmul_cuda, the
 * dlopen'ed cuBLAS of kernels/matmul.cu) on the context's stream.
 *
 * Per tile, forward (3 kernels, 2 GEMMs): gather -> GEMM h -> silu·mul ->
 * GEMM out -> combine into y. Backward (3 kernels, 4 GEMMs, 5 when h is
 * recomputed): gather x and dy in one launch -> h (saved or recomputed) ->
 * GEMM dact_u = dyt·down[e] -> one warp per row (act, dw = <dact_u, act>
 * in f64 lanes combined by a fixed xor tree, dh, and dyt scaled by w) ->
 * GEMMs ddown += doutᵀ·act, dgate_up += dhᵀ·xt, dxt = dh·gate_up[e] ->
 * combine into dx.
 *
 * Determinism: the combine runs over (row, column) in parallel, yet every
 * output element gets its tile's rows in row order, as on the CPU: the
 * block of a token's first row in the tile adds all of that token's rows
 * (a token may pick an expert twice), the blocks of its later rows add
 * nothing. So a token's sum is over its experts in ascending expert index;
 * no float atomics. cuBLAS orders its k-sums its own way (deterministic
 * for a fixed GPU and shapes), so results equal the CPU's within a
 * normwise tolerance, not bitwise.
 *
 * The tile walk needs the plan's offsets on the host: they are read back in
 * blocks of 256 experts into a stack buffer (one synchronising copy per
 * block); backward's touched flags of a block follow from them and go to
 * the device as one kernel argument. The per-expert weight tables are host
 * arrays of device pointers: the walk reads expert e's entries on the host
 * and hands them to cuBLAS, and skips the experts whose entry is NULL.
 * The interrupt flag is polled between tiles.
 *
 * bf16 (mixed precision): x, w, the weights, y, dx, dw and h_saved are
 * bf16; every GEMM takes bf16 operands (cuBLAS sums in f32) and writes h
 * in bf16, out, dact_u and dxt in f32, and adds the weight gradients
 * into their f32 accumulators; the SwiGLU steps and the combine compute in
 * f32 and round once on store (see forward() for which buffer is which).
 */
#include "cuda_common.cuh"
#include "cuda_float.cuh"

extern "C" {
#include "experts.h"
#include "matmul.h"
}

#include <math.h>

#define OFF_BLOCK 256

/* ---- kernels ------------------------------------------------------------------- */

/* The kernels are templates over the storage type S (float, double, ml_bf16)
 * and compute in A = ml_float<S>::acc (f32 for bf16); L is ml_float<S>. */

/* dst [r, D] <- rows pos[i] / k of src [T, D], and likewise dst2 from src2
 * unless dst2 is NULL (backward gathers x and dy in one launch) */
template <typename S>
__global__ void gather_kernel(S *dst, const S *src, S *dst2, const S *src2, const int64_t *pos,
                              int64_t r, int64_t D, int64_t k)
{
    ML_CUDA_FOR(i, r * D) {
        int64_t row = i / D, c = i % D, from = (pos[row] / k) * D + c;
        dst[i] = src[from];
        if (dst2)
            dst2[i] = src2[from];
    }
}

__device__ inline float ml_expm(float x) { return expf(x); }
__device__ inline double ml_expm(double x) { return exp(x); }

/* act [r, F] = silu(h[:, :F]) * h[:, F:] */
template <typename S>
__global__ void swiglu_fwd_kernel(S *act, const S *h, int64_t r, int64_t Fd)
{
    typedef ml_float<S> L;
    typedef typename L::acc A;
    ML_CUDA_FOR(i, r * Fd) {
        int64_t row = i / Fd, f = i % Fd;
        A x = L::load(h[row * 2 * Fd + f]);
        act[i] = L::store(x / ((A)1 + ml_expm(-x)) * L::load(h[row * 2 * Fd + Fd + f]));
    }
}

/* One warp per row: act, dw[a] = <dact_u, act> (f64 lane sums over f = lane,
 * lane+32, ..., then xor 16, 8, 4, 2, 1; with act as stored, the value the
 * forward's down GEMM read), dh = [dg, du] with dact = w·dact_u (dh may be
 * h: each element is read before it is written), and dout [r, D] *= w[a]
 * (dout = w · dy, for the weight GEMMs that follow). dact_u is in A: the
 * GEMM wrote it unrounded. */
template <typename S>
__global__ void swiglu_bwd_kernel(S *act, S *dh, S *dw, S *dout, const S *h,
                                  const typename ml_float<S>::acc *dact_u, const S *w,
                                  const int64_t *pos, int64_t r, int64_t Fd, int64_t D)
{
    typedef ml_float<S> L;
    typedef typename L::acc A;
    int lane = threadIdx.x & 31;
    int64_t warp = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    int64_t nwarps = ((int64_t)gridDim.x * blockDim.x) / 32;
    for (int64_t row = warp; row < r; row += nwarps) {
        int64_t a = pos[row];
        A wa = L::load(w[a]);
        const S *hr = h + row * 2 * Fd;
        const A *du = dact_u + row * Fd;
        S *ar = act + row * Fd, *dr = dh + row * 2 * Fd;
        double dot = 0;
        for (int64_t f = lane; f < Fd; f += 32) {
            A x = L::load(hr[f]), u = L::load(hr[Fd + f]);
            A ex = ml_expm(-x);
            A s = (A)1 / ((A)1 + ex);
            A silu = x / ((A)1 + ex);
            S av = L::store(silu * u);
            ar[f] = av;
            dot += (double)du[f] * (double)L::load(av);
            A d = wa * du[f];
            dr[f] = L::store(d * u * (s * ((A)1 + x * ((A)1 - s))));
            dr[Fd + f] = L::store(d * silu);
        }
        for (int o = 16; o > 0; o >>= 1)
            dot += __shfl_xor_sync(0xffffffffu, dot, o);
        if (lane == 0)
            dw[a] = L::store((A)dot);
        for (int64_t c = lane; c < D; c += 32)
            dout[row * D + c] = L::store(L::load(dout[row * D + c]) * wa);
    }
}

/* acc[t, c] += (scaled ? w[a] : 1) · rows[i, c], a = pos[i], t = a / k,
 * summed in A and stored once per tile (rows are A: the GEMM's unrounded
 * result). Blocks stride over rows (x) and column blocks (y). A row's
 * block first looks for the row's token elsewhere in the tile: if an
 * earlier row has it, that row's block owns the token and this one adds
 * nothing; else it adds row i and, only when a later row has the token
 * too, those rows after it, in row order. acc is read and written once
 * per element. */
template <typename S>
__global__ void combine_kernel(S *acc, const typename ml_float<S>::acc *rows, const S *w,
                               const int64_t *pos, int64_t r, int64_t D, int64_t k, int scaled)
{
    typedef ml_float<S> L;
    typedef typename L::acc A;
    for (int64_t i = blockIdx.x; i < r; i += gridDim.x) {
        int64_t t = pos[i] / k;
        int earlier = 0, later = 0;
        for (int64_t j = threadIdx.x; j < r; j += blockDim.x)
            if (j != i && pos[j] / k == t) {
                earlier |= j < i;
                later |= j > i;
            }
        if (__syncthreads_count(earlier))
            continue;   /* the same outcome for every thread of the block */
        int64_t last = __syncthreads_count(later) ? r : i + 1;
        for (int64_t c = (int64_t)blockIdx.y * blockDim.x + threadIdx.x; c < D;
             c += (int64_t)gridDim.y * blockDim.x) {
            A v = L::load(acc[t * D + c]);
            for (int64_t j = i; j < last; j++) {
                int64_t a = pos[j];
                if (a / k == t)
                    v += scaled ? L::load(w[a]) * rows[j * D + c] : rows[j * D + c];
            }
            acc[t * D + c] = L::store(v);
        }
    }
}

/* touched[e] for a block of up to OFF_BLOCK experts, from the host walk:
 * v[e] is 0 or 1 for a run expert, -1 for a skipped one (left as is). */
typedef struct {
    int8_t v[OFF_BLOCK];
} touched_block;

__global__ void touched_kernel(uint8_t *touched, touched_block b, int64_t n)
{
    ML_CUDA_FOR(e, n)
        if (b.v[e] >= 0)
            touched[e] = (uint8_t)b.v[e];
}

/* ---- launchers -------------------------------------------------------------------- */

static unsigned blocks_of(int64_t n) { return ml_cuda_blocks(n, ML_CUDA_THREADS); }

/* C [m, n] = op(A) · op(B) + beta·C, row-major, through cuBLAS: A and B
 * of dt, C of cdt. */
static ml_status gemm(ml_dtype dt, ml_dtype cdt, void *c, const void *a, const void *b, int64_t m,
                      int64_t n, int64_t k, int ta, int tb, int64_t lda, int64_t ldb, int64_t ldc,
                      double beta, const ml_kctx *ctx)
{
    ml_gemm_shape s = {1, m, n, k, ta, tb, lda, ldb, ldc, m * k, k * n, m * n, 1.0, beta};
    return ml_matmul_cuda(dt, cdt, c, a, b, &s, ctx);
}

/* dst2 NULL: dst only */
template <typename S>
static ml_status gather(S *dst, const void *src, S *dst2, const void *src2, const int64_t *pos,
                        int64_t r, int64_t D, int64_t k, cudaStream_t st)
{
    gather_kernel<S><<<blocks_of(r * D), ML_CUDA_THREADS, 0, st>>>(dst, (const S *)src, dst2,
                                                                    (const S *)src2, pos, r, D, k);
    return ml_cuda_launched();
}

template <typename S>
static ml_status combine(void *acc, const typename ml_float<S>::acc *rows, const void *w,
                         const int64_t *pos, int64_t r, int64_t D, int64_t k, int scaled,
                         cudaStream_t st)
{
    unsigned rb = ml_cuda_blocks(r, 1), cb = ml_cuda_blocks(D, ML_CUDA_THREADS);
    dim3 grid(rb, cb < 65535 ? cb : 65535);   /* grid y is at most 65535 */
    combine_kernel<S><<<grid, ML_CUDA_THREADS, 0, st>>>((S *)acc, rows, (const S *)w, pos, r, D, k,
                                                         scaled);
    return ml_cuda_launched();
}

/* offsets[e0 .. e0+nb] (nb + 1 values) to the host. */
static ml_status host_offsets(int64_t *dst, const int64_t *offsets, int64_t e0, int64_t nb,
                              cudaStream_t st)
{
    ml_status s = ml_cuda_status(cudaMemcpyAsync(dst, offsets + e0, (size_t)(nb + 1) * sizeof(int64_t),
                                                 cudaMemcpyDeviceToHost, st));
    if (s == ML_OK)
        s = ml_cuda_status(cudaStreamSynchronize(st));
    return s;
}

#define TRY(expr) do { ml_status s_ = (expr); if (s_ != ML_OK) return s_; } while (0)

/* ---- forward -------------------------------------------------------------------------- */

/* The GEMM results kept unrounded (out, dact_u, dxt) are A (f32 for bf16),
 * the dtype ml_grad_dtype(dt) names: each feeds an elementwise step in A
 * (the combine, the SwiGLU backward), so rounding them to bf16 first would
 * only add an error. What feeds a GEMM (xt, dyt, h, act, dh, dout) is S:
 * the kernels that make it round once on store. h is S for the GEMM that
 * makes it (bf16: as a bf16 Linear does, and what h_saved keeps, so saved
 * and recomputed h stay bitwise equal). Buffers of A come first in the
 * lane, so they are aligned for A (the lane is 8-aligned). */
template <typename S>
static ml_status forward(ml_dtype dt, void *y, void *h_saved, void *scratch, const void *x,
                         const void *w, const int64_t *order, const int64_t *offsets,
                         const ml_experts_weights *wt, const ml_experts_cfg *c, const ml_kctx *ctx)
{
    typedef typename ml_float<S>::acc A;
    cudaStream_t st = ml_cuda_stream(ctx);
    ml_dtype at = ml_grad_dtype(dt);
    int64_t D = c->D, Fd = c->F, R = c->tile;
    A *out = (A *)scratch;                /* [R, D] out; first xt [R, D] of S */
    S *xt = (S *)out;
    S *hbuf = (S *)(out + R * D);         /* [R, 2F] */
    S *act = hbuf + R * 2 * Fd;           /* [R, F] */
    if (!c->accumulate)
        TRY(ml_cuda_status(cudaMemsetAsync(y, 0, (size_t)(c->T * D) * sizeof(S), st)));
    int64_t off[OFF_BLOCK + 1];
    for (int64_t eb = 0; eb < c->E; eb += OFF_BLOCK) {
        int64_t nb = c->E - eb < OFF_BLOCK ? c->E - eb : OFF_BLOCK;
        TRY(host_offsets(off, offsets, eb, nb, st));
        for (int64_t e = eb; e < eb + nb; e++) {
            const void *gu = wt->gate_up[e], *dn = wt->down[e];
            if (!gu)   /* skipped */
                continue;
            int64_t p1 = off[e - eb + 1];
            for (int64_t p0 = off[e - eb]; p0 < p1; p0 += R) {
                if (ml_kctx_interrupted(ctx))
                    return ML_EINTERRUPTED;
                int64_t r = p1 - p0 < R ? p1 - p0 : R;
                S *h = p0 + r <= c->nsaved ? (S *)h_saved + p0 * 2 * Fd : hbuf;
                const int64_t *pos = order + p0;
                TRY(gather<S>(xt, x, NULL, NULL, pos, r, D, c->k, st));
                TRY(gemm(dt, dt, h, xt, gu, r, 2 * Fd, D, 0, 1, D, D, 2 * Fd, 0.0, ctx));
                swiglu_fwd_kernel<S><<<blocks_of(r * Fd), ML_CUDA_THREADS, 0, st>>>(act, h, r, Fd);
                TRY(ml_cuda_launched());
                /* out [r, D] = act · down[e]ᵀ, over xt (read by the GEMM above only) */
                TRY(gemm(dt, at, out, act, dn, r, D, Fd, 0, 1, Fd, Fd, D, 0.0, ctx));
                TRY(combine<S>(y, out, w, pos, r, D, c->k, 1, st));
            }
        }
    }
    return ML_OK;
}

extern "C" ml_status ml_experts_forward_cuda(ml_dtype dt, void *y, void *h_saved, void *scratch,
                                             const void *x, const void *w, const int64_t *order,
                                             const int64_t *offsets,
                                             const ml_experts_weights *wt,
                                             const ml_experts_cfg *c, const ml_kctx *ctx)
{
    switch (dt) {
    case ML_F32: return forward<float>(dt, y, h_saved, scratch, x, w, order, offsets, wt, c, ctx);
    case ML_F64: return forward<double>(dt, y, h_saved, scratch, x, w, order, offsets, wt, c, ctx);
    case ML_BF16: return forward<ml_bf16>(dt, y, h_saved, scratch, x, w, order, offsets, wt, c, ctx);
    default: return ML_EUNSUPPORTED;
    }
}

/* ---- backward ------------------------------------------------------------------------- */

template <typename S>
static ml_status backward(ml_dtype dt, void *dx, const ml_experts_wgrads *dwt, void *dw,
                          uint8_t *touched, void *scratch, const void *h_saved, const void *dy,
                          const void *x, const void *w, const int64_t *order,
                          const int64_t *offsets, const ml_experts_weights *wt,
                          const ml_experts_cfg *c, const ml_kctx *ctx)
{
    typedef typename ml_float<S>::acc A;
    cudaStream_t st = ml_cuda_stream(ctx);
    ml_dtype at = ml_grad_dtype(dt);      /* A's dtype, and the weight gradients' */
    int64_t D = c->D, Fd = c->F, R = c->tile;
    A *dxt = (A *)scratch;                /* [R, D] dxt; first dyt [R, D] of S (dy rows, then w·dy) */
    S *dyt = (S *)dxt;
    A *dact = dxt + R * D;                /* [R, F] unscaled: dyt · down[e] */
    S *xt = (S *)(dact + R * Fd);         /* [R, D] x rows */
    S *hbuf = xt + R * D;                 /* [R, 2F] h (recomputed), then dh */
    S *act = hbuf + R * 2 * Fd;           /* [R, F] */
    if (!c->accumulate) {
        TRY(ml_cuda_status(cudaMemsetAsync(dw, 0, (size_t)(c->T * c->k) * sizeof(S), st)));
        TRY(ml_cuda_status(cudaMemsetAsync(touched, 0, (size_t)c->E, st)));
    }
    int64_t off[OFF_BLOCK + 1];
    for (int64_t eb = 0; eb < c->E; eb += OFF_BLOCK) {
        int64_t nb = c->E - eb < OFF_BLOCK ? c->E - eb : OFF_BLOCK;
        TRY(host_offsets(off, offsets, eb, nb, st));
        touched_block tb;
        for (int64_t i = 0; i < nb; i++)
            tb.v[i] = wt->gate_up[eb + i] ? off[i + 1] > off[i] : -1;
        touched_kernel<<<blocks_of(nb), ML_CUDA_THREADS, 0, st>>>(touched + eb, tb, nb);
        TRY(ml_cuda_launched());
        for (int64_t e = eb; e < eb + nb; e++) {
            const void *gu = wt->gate_up[e], *dn = wt->down[e];
            if (!gu)   /* skipped: its gradient entries are not read */
                continue;
            void *dgu = dwt->gate_up[e], *ddn = dwt->down[e];
            int64_t p1 = off[e - eb + 1];
            for (int64_t p0 = off[e - eb]; p0 < p1; p0 += R) {
                if (ml_kctx_interrupted(ctx))
                    return ML_EINTERRUPTED;
                int64_t r = p1 - p0 < R ? p1 - p0 : R;
                const S *h = p0 + r <= c->nsaved ? (const S *)h_saved + p0 * 2 * Fd : hbuf;
                const int64_t *pos = order + p0;
                TRY(gather<S>(xt, x, dyt, dy, pos, r, D, c->k, st));
                if (h == hbuf)   /* recompute h [r, 2F] = xt · gate_up[e]ᵀ */
                    TRY(gemm(dt, dt, hbuf, xt, gu, r, 2 * Fd, D, 0, 1, D, D, 2 * Fd, 0.0, ctx));
                /* dact_u [r, F] = dyt [r, D] · down[e] [D, F] */
                TRY(gemm(dt, at, dact, dyt, dn, r, Fd, D, 0, 0, D, Fd, Fd, 0.0, ctx));
                swiglu_bwd_kernel<S><<<ml_cuda_blocks(r * 32, ML_CUDA_THREADS), ML_CUDA_THREADS, 0, st>>>(
                    act, hbuf, (S *)dw, dyt, h, dact, (const S *)w, pos, r, Fd, D);
                TRY(ml_cuda_launched());
                /* ddown[e] [D, F] += doutᵀ [D, r] · act [r, F] */
                TRY(gemm(dt, at, ddn, dyt, act, D, Fd, r, 1, 0, D, Fd, Fd, 1.0, ctx));
                /* dgate_up[e] [2F, D] += dhᵀ [2F, r] · xt [r, D] */
                TRY(gemm(dt, at, dgu, hbuf, xt, 2 * Fd, D, r, 1, 0, 2 * Fd, D, D, 1.0, ctx));
                /* dxt [r, D] = dh [r, 2F] · gate_up[e] [2F, D], over dout (consumed above) */
                TRY(gemm(dt, at, dxt, hbuf, gu, r, D, 2 * Fd, 0, 0, 2 * Fd, D, D, 0.0, ctx));
                TRY(combine<S>(dx, dxt, w, pos, r, D, c->k, 0, st));
            }
        }
    }
    return ML_OK;
}

extern "C" ml_status ml_experts_backward_cuda(ml_dtype dt, void *dx, const ml_experts_wgrads *dwt,
                                              void *dw, uint8_t *touched, void *scratch,
                                              const void *h_saved, const void *dy, const void *x,
                                              const void *w, const int64_t *order,
                                              const int64_t *offsets,
                                              const ml_experts_weights *wt,
                                              const ml_experts_cfg *c, const ml_kctx *ctx)
{
    switch (dt) {
    case ML_F32:
        return backward<float>(dt, dx, dwt, dw, touched, scratch, h_saved, dy, x, w, order,
                               offsets, wt, c, ctx);
    case ML_F64:
        return backward<double>(dt, dx, dwt, dw, touched, scratch, h_saved, dy, x, w, order,
                                offsets, wt, c, ctx);
    case ML_BF16:
        return backward<ml_bf16>(dt, dx, dwt, dw, touched, scratch, h_saved, dy, x, w, order,
                                 offsets, wt, c, ctx);
    default:
        return ML_EUNSUPPORTED;
    }
}
