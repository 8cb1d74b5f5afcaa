/*
 * kernels/experts.cu - the tiled SwiGLU experts of kernels/experts.h on
 * CUDA: the CPU's tile walk (experts ascending, positions ascending, tiles
 * of R rows), run in waves of up to ML_EXPERTS_WAVE consecutive tiles of
 * one expert (experts.h; an expert may span waves, a wave never spans
 * experts: see Determinism), each step one
 * kernel or one grouped GEMM over the whole wave (ml_matmul_grouped_cuda,
 * the dlopen'ed cuBLAS of kernels/matmul.cu) on the context's stream. The
 * tile stays the unit of every GEMM: a grouped GEMM's problems are the
 * wave's tiles, each with the shape it has tile by tile.
 *
 * Per wave, forward (3 kernels, 2 grouped GEMMs): gather (which also
 * stores the wave's GEMM pointer arrays and its rows' assignment ids) ->
 * GEMM h -> silu·mul -> GEMM out -> combine into y. Backward (3 kernels;
 * grouped GEMMs: dact_u and dxt, h when a tile of the wave recomputes it,
 * ddown and dgate_up once per round): gather x and dy in one launch -> h
 * (saved or recomputed) -> GEMM dact_u = dyt·down[e] -> one warp per row (act, dw =
 * <dact_u, act> in f64 lanes combined by a fixed xor tree, dh, and dyt
 * scaled by w) -> GEMMs ddown += doutᵀ·act and dgate_up += dhᵀ·xt, per
 * round -> GEMM dxt = dh·gate_up[e] -> combine into dx. Round j holds the
 * j-th tile of the wave: two tiles of one expert never add into its
 * accumulators in one call (a race), and they add in tile order. So the
 * weight gradients take a call per tile, the other steps one per wave
 * (the launches of an expert with many rows drop by the wave's width;
 * an expert of one tile saves nothing). matmul.cu says how many cuBLAS calls a
 * grouped GEMM makes (one, or one per run of equal shapes where cuBLAS's
 * grouped GEMM refuses the dtypes: bf16 into f32, f64).
 *
 * Determinism: the combine runs over (row, column) of the wave in
 * parallel, yet every output element gets the wave's rows in row order,
 * as on the CPU: the block of a token's first row in the wave adds all of
 * that token's rows (a token may pick an expert twice), the blocks of its
 * later rows add nothing. Where the token's rows pass from one tile to the
 * next, its running sum is rounded as a store and a load between two
 * tile-by-tile combines would round it (bf16; nothing for f32, f64), so
 * results are bitwise those of a walk tile by tile (the emulator checks
 * waves of 1, 3 and ML_EXPERTS_WAVE tiles) and a token's sum is over its
 * experts in ascending expert index; no float atomics. cuBLAS orders its
 * k-sums its own way (deterministic for a fixed GPU and the same calls),
 * so results equal the CPU's within a normwise tolerance, not bitwise.
 * Waves never span experts so that the cuBLAS calls of an expert depend
 * only on its own rows: a call over a subset of whole experts (the expert
 * store runs one expert per call) makes the very calls that one call over
 * all experts makes for them, so experts.h's bitwise subsets hold on a GPU
 * too (a grouped or batched call may choose its kernels by the whole
 * batch).
 *
 * The walk needs the plan's offsets on the host: they are read back in
 * blocks of 256 experts into a stack buffer (one synchronising copy per
 * block; a wave ends with its block); backward's touched flags of a block
 * follow from them and go to the device as one kernel argument. The
 * per-expert weight tables are host arrays of device pointers: the walk
 * reads expert e's entries on the host, puts them in the wave's pointer
 * arrays (by value to the gather, which stores them in the scratch for
 * cuBLAS), and skips the experts whose entry is NULL. The interrupt flag
 * is polled between waves.
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
#define WAVE ML_EXPERTS_WAVE
#define FWD_STEPS 2   /* grouped GEMM steps: h, out */
#define BWD_STEPS 5   /* h (recomputed), dact_u, ddown, dgate_up, dxt */

/* ---- a wave ----------------------------------------------------------------------- */

/* A wave's tiles, by value to its kernels: tile i holds the dispatch
 * positions p0[i] .. p0[i] + ro[i+1] - ro[i], which are the wave's rows
 * ro[i] .. ro[i+1] (ro[0] = 0, ro[n] the wave's rows), and its h rows
 * start at h[i]: in h_saved, or the wave's h buffer at row ro[i]. */
struct wave {
    int n;
    int64_t p0[WAVE], ro[WAVE + 1];
    const void *h[WAVE];
};

/* The tile of wave row i < ro[n] (at most WAVE steps) */
__device__ inline int tile_of(const wave &v, int64_t i)
{
    int t = 0;
    while (i >= v.ro[t + 1])
        t++;
    return t;
}

/* The wave's grouped GEMMs' pointer arrays, built on the host and stored
 * in the scratch's head by the gather: step s's problem j has its A, B
 * and C at p[(3s + 0, 1, 2)·WAVE + j]. */
struct gemm_ptrs {
    void *p[3 * BWD_STEPS * WAVE];
};

/* ---- kernels ------------------------------------------------------------------- */

/* The kernels are templates over the storage type S (float, double, ml_bf16)
 * and compute in A = ml_float<S>::acc (f32 for bf16); L is ml_float<S>. */

/* The wave's first launch: ptrs[0 .. np) <- P, pos[i] = the assignment id
 * of wave row i, and dst [rows, D] <- the rows pos[i] / k of src [T, D],
 * likewise dst2 from src2 unless dst2 is NULL (backward gathers x and dy
 * in one launch). Each row's id is found from the wave, not read from pos
 * (another thread writes it). */
template <typename S>
__global__ void gather_kernel(S *dst, const S *src, S *dst2, const S *src2, int64_t *pos,
                              void **ptrs, gemm_ptrs P, int np, const int64_t *order, wave v,
                              int64_t D, int64_t k)
{
    int64_t rows = v.ro[v.n];
    ML_CUDA_FOR(i, np)
        ptrs[i] = P.p[i];
    ML_CUDA_FOR(i, rows) {
        int t = tile_of(v, i);
        pos[i] = order[v.p0[t] + i - v.ro[t]];
    }
    ML_CUDA_FOR(i, rows * D) {
        int64_t row = i / D, c = i % D;
        int t = tile_of(v, row);
        int64_t from = (order[v.p0[t] + row - v.ro[t]] / k) * D + c;
        dst[i] = src[from];
        if (dst2)
            dst2[i] = src2[from];
    }
}

__device__ inline float ml_expm(float x) { return expf(x); }
__device__ inline double ml_expm(double x) { return exp(x); }

/* act [rows, F] = silu(h[:, :F]) * h[:, F:], h's rows where the wave says */
template <typename S>
__global__ void swiglu_fwd_kernel(S *act, wave v, int64_t Fd)
{
    typedef ml_float<S> L;
    typedef typename L::acc A;
    ML_CUDA_FOR(i, v.ro[v.n] * Fd) {
        int64_t row = i / Fd, f = i % Fd;
        int t = tile_of(v, row);
        const S *h = (const S *)v.h[t] + (row - v.ro[t]) * 2 * Fd;
        A x = L::load(h[f]);
        act[i] = L::store(x / ((A)1 + ml_expm(-x)) * L::load(h[Fd + f]));
    }
}

/* One warp per wave row: act, dw[a] = <dact_u, act> (f64 lane sums over
 * f = lane, lane+32, ..., then xor 16, 8, 4, 2, 1; with act as stored, the
 * value the forward's down GEMM read), dh [rows, 2F] = [dg, du] with dact
 * = w·dact_u (a recomputed tile's h is dh's rows: each element is read
 * before it is written), and dout [rows, D] *= w[a] (dout = w · dy, for
 * the weight GEMMs that follow). dact_u is in A: the GEMM wrote it
 * unrounded. */
template <typename S>
__global__ void swiglu_bwd_kernel(S *act, S *dh, S *dw, S *dout, wave v,
                                  const typename ml_float<S>::acc *dact_u, const S *w,
                                  const int64_t *pos, int64_t Fd, int64_t D)
{
    typedef ml_float<S> L;
    typedef typename L::acc A;
    int lane = threadIdx.x & 31;
    int64_t warp = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    int64_t nwarps = ((int64_t)gridDim.x * blockDim.x) / 32;
    for (int64_t row = warp; row < v.ro[v.n]; row += nwarps) {
        int64_t a = pos[row];
        int t = tile_of(v, row);
        A wa = L::load(w[a]);
        const S *hr = (const S *)v.h[t] + (row - v.ro[t]) * 2 * Fd;
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

/* acc[t, c] += (scaled ? w[a] : 1) · rows[i, c] over the wave's rows i,
 * a = pos[i], t = a / k, summed in A (rows are A: the GEMM's unrounded
 * result) and rounded as a store and a load would round it wherever the
 * sum passes into a later tile, so acc ends as a combine per tile would
 * leave it. Blocks stride over rows (x) and column blocks (y). A row's
 * block first looks for the row's token elsewhere in the wave: if an
 * earlier row has it, that row's block owns the token and this one adds
 * nothing; else it adds row i and, only when a later row has the token
 * too, those rows after it, in row order. acc is read and written once
 * per element. */
template <typename S>
__global__ void combine_kernel(S *acc, const typename ml_float<S>::acc *rows, const S *w,
                               const int64_t *pos, wave v, int64_t D, int64_t k, int scaled)
{
    typedef ml_float<S> L;
    typedef typename L::acc A;
    int64_t r = v.ro[v.n];
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
        int first = tile_of(v, i);
        for (int64_t c = (int64_t)blockIdx.y * blockDim.x + threadIdx.x; c < D;
             c += (int64_t)gridDim.y * blockDim.x) {
            A val = L::load(acc[t * D + c]);
            int tile = first;
            for (int64_t j = i; j < last; j++) {
                int64_t a = pos[j];
                if (a / k != t)
                    continue;
                if (j >= v.ro[tile + 1]) {   /* a later tile, whose combine loads the stored sum */
                    val = L::load(L::store(val));
                    while (j >= v.ro[tile + 1])
                        tile++;
                }
                val += scaled ? L::load(w[a]) * rows[j * D + c] : rows[j * D + c];
            }
            acc[t * D + c] = L::store(val);
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

#define TRY(expr) do { ml_status s_ = (expr); if (s_ != ML_OK) return s_; } while (0)

/* One grouped GEMM step of a wave, built on the host: its problems'
 * row-major shapes (C = op(A)·op(B) + beta·C, alpha 1); their pointers go
 * to P's arrays of the step's slot. */
struct step {
    int slot;
    int64_t n;
    ml_gemm_shape s[WAVE];
};

static void add(gemm_ptrs &P, step &g, const void *a, const void *b, void *c, int64_t m, int64_t n,
                int64_t k, int ta, int tb, int64_t lda, int64_t ldb, int64_t ldc, double beta)
{
    void **p = P.p + 3 * g.slot * WAVE + g.n;
    p[0] = const_cast<void *>(a);
    p[WAVE] = const_cast<void *>(b);
    p[2 * WAVE] = c;
    g.s[g.n++] = {1, m, n, k, ta, tb, lda, ldb, ldc, 0, 0, 0, 1.0, beta};
}

/* problems [i0, i1) of step g through cuBLAS; ptrs: the pointer arrays in
 * the scratch. A and B of dt, C of cdt. */
static ml_status grouped(ml_dtype dt, ml_dtype cdt, const step &g, void **ptrs, int64_t i0,
                         int64_t i1, const ml_kctx *ctx)
{
    void **p = ptrs + 3 * g.slot * WAVE + i0;
    return ml_matmul_grouped_cuda(dt, cdt, i1 - i0, g.s + i0, p, p + WAVE, p + 2 * WAVE, ctx);
}

/* dst2 NULL: dst only; np pointers of P to ptrs */
template <typename S>
static ml_status gather(S *dst, const void *src, S *dst2, const void *src2, int64_t *pos,
                        void **ptrs, const gemm_ptrs &P, int np, const int64_t *order,
                        const wave &v, int64_t D, int64_t k, cudaStream_t st)
{
    int64_t rows = v.ro[v.n], n = rows * D > rows ? rows * D : rows;
    gather_kernel<S><<<blocks_of(n > np ? n : np), ML_CUDA_THREADS, 0, st>>>(
        dst, (const S *)src, dst2, (const S *)src2, pos, ptrs, P, np, order, v, D, k);
    return ml_cuda_launched();
}

template <typename S>
static ml_status combine(void *acc, const typename ml_float<S>::acc *rows, const void *w,
                         const int64_t *pos, const wave &v, int64_t D, int64_t k, int scaled,
                         cudaStream_t st)
{
    unsigned rb = ml_cuda_blocks(v.ro[v.n], 1), cb = ml_cuda_blocks(D, ML_CUDA_THREADS);
    dim3 grid(rb, cb < 65535 ? cb : 65535);   /* grid y is at most 65535 */
    combine_kernel<S><<<grid, ML_CUDA_THREADS, 0, st>>>((S *)acc, rows, (const S *)w, pos, v, D, k,
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

/* ---- the walk ---------------------------------------------------------------------- */

/* A wave and what only the host needs of it: each tile's expert and
 * whether its h is saved (else it is in hbuf, at the tile's rows). */
struct wave_host {
    wave v;
    int64_t e[WAVE];
    bool saved[WAVE];
};

/* The walk in waves of up to width (<= WAVE) tiles: experts ascending
 * (those whose gate_up is NULL skipped), each one's positions in tiles of
 * R rows. Per block of OFF_BLOCK experts: its offsets to the host, then
 * block(eb, nb, off), then its waves, each run(wave_host) after an
 * interrupt poll; a wave ends with its expert. h rows (hrow bytes) are in
 * h_saved for the tiles below nsaved, else in hbuf. */
template <typename Block, typename Run>
static ml_status walk(const int64_t *offsets, const ml_experts_weights *wt, const ml_experts_cfg *c,
                      int width, const void *h_saved, const void *hbuf, int64_t hrow,
                      const ml_kctx *ctx, Block block, Run run)
{
    int64_t off[OFF_BLOCK + 1], R = c->tile;
    wave_host h = {};
    wave &v = h.v;
    auto flush = [&]() -> ml_status {
        if (ml_kctx_interrupted(ctx))
            return ML_EINTERRUPTED;
        ml_status s = run(h);
        v.n = 0;
        return s;
    };
    for (int64_t eb = 0; eb < c->E; eb += OFF_BLOCK) {
        int64_t nb = c->E - eb < OFF_BLOCK ? c->E - eb : OFF_BLOCK;
        TRY(host_offsets(off, offsets, eb, nb, ml_cuda_stream(ctx)));
        TRY(block(eb, nb, (const int64_t *)off));
        for (int64_t e = eb; e < eb + nb; e++) {
            if (!wt->gate_up[e])   /* skipped */
                continue;
            int64_t p1 = off[e - eb + 1];
            for (int64_t p0 = off[e - eb]; p0 < p1; p0 += R) {
                int64_t r = p1 - p0 < R ? p1 - p0 : R;
                int i = v.n++;
                v.p0[i] = p0;
                v.ro[i + 1] = v.ro[i] + r;
                h.e[i] = e;
                h.saved[i] = p0 + r <= c->nsaved;
                v.h[i] = h.saved[i] ? (const char *)h_saved + p0 * hrow
                                    : (const char *)hbuf + v.ro[i] * hrow;
                if (v.n == width)
                    TRY(flush());
            }
            if (v.n)
                TRY(flush());
        }
    }
    return ML_OK;
}

/* ---- forward -------------------------------------------------------------------------- */

/* The GEMM results kept unrounded (out, dact_u, dxt) are A (f32 for bf16),
 * the dtype ml_grad_dtype(dt) names: each feeds an elementwise step in A
 * (the combine, the SwiGLU backward), so rounding them to bf16 first would
 * only add an error. What feeds a GEMM (xt, dyt, h, act, dh, dout) is S:
 * the kernels that make it round once on store. h is S for the GEMM that
 * makes it (bf16: as a bf16 Linear does, and what h_saved keeps, so saved
 * and recomputed h stay bitwise equal). The scratch (experts.c books it):
 * the pointer arrays and pos, the wave rows' assignment ids (8-aligned),
 * then the buffers of A, then those of S, W = ml_experts_wave_rows rows
 * each; tile i of a wave has the rows ro[i] .. ro[i+1] of every buffer. */
template <typename S>
static ml_status forward(ml_dtype dt, void *y, void *h_saved, void *scratch, const void *x,
                         const void *w, const int64_t *order, const int64_t *offsets,
                         const ml_experts_weights *wt, const ml_experts_cfg *c, int width,
                         const ml_kctx *ctx)
{
    typedef typename ml_float<S>::acc A;
    cudaStream_t st = ml_cuda_stream(ctx);
    ml_dtype at = ml_grad_dtype(dt);
    int64_t D = c->D, Fd = c->F, W = ml_experts_wave_rows(c);
    void **ptrs = (void **)scratch;
    int64_t *pos = (int64_t *)(ptrs + 3 * FWD_STEPS * WAVE);
    A *out = (A *)(pos + W);              /* [W, D] out; first xt [W, D] of S */
    S *xt = (S *)out;
    S *hbuf = (S *)(out + W * D);         /* [W, 2F] */
    S *act = hbuf + W * 2 * Fd;           /* [W, F] */
    if (!c->accumulate)
        TRY(ml_cuda_status(cudaMemsetAsync(y, 0, (size_t)(c->T * D) * sizeof(S), st)));
    auto block = [](int64_t, int64_t, const int64_t *) { return ML_OK; };
    auto run = [&](const wave_host &h) -> ml_status {
        const wave &v = h.v;
        gemm_ptrs P = {};
        step hs = {0, 0, {}}, os = {1, 0, {}};
        for (int i = 0; i < v.n; i++) {
            int64_t r = v.ro[i + 1] - v.ro[i], ro = v.ro[i], e = h.e[i];
            /* h [r, 2F] = xt · gate_up[e]ᵀ; out [r, D] = act · down[e]ᵀ, over xt
             * (read by the GEMM h only) */
            add(P, hs, xt + ro * D, wt->gate_up[e], const_cast<void *>(v.h[i]), r, 2 * Fd, D, 0, 1,
                D, D, 2 * Fd, 0.0);
            add(P, os, act + ro * Fd, wt->down[e], out + ro * D, r, D, Fd, 0, 1, Fd, Fd, D, 0.0);
        }
        TRY(gather<S>(xt, x, NULL, NULL, pos, ptrs, P, 3 * FWD_STEPS * WAVE, order, v, D, c->k,
                      st));
        TRY(grouped(dt, dt, hs, ptrs, 0, hs.n, ctx));
        swiglu_fwd_kernel<S><<<blocks_of(v.ro[v.n] * Fd), ML_CUDA_THREADS, 0, st>>>(act, v, Fd);
        TRY(ml_cuda_launched());
        TRY(grouped(dt, at, os, ptrs, 0, os.n, ctx));
        return combine<S>(y, out, w, pos, v, D, c->k, 1, st);
    };
    return walk(offsets, wt, c, width, h_saved, hbuf, 2 * Fd * (int64_t)sizeof(S), ctx, block, run);
}

/* forward at wave width width (1 .. ML_EXPERTS_WAVE; the emulator's tests
 * vary it) */
static ml_status forward_at(ml_dtype dt, void *y, void *h_saved, void *scratch, const void *x,
                            const void *w, const int64_t *order, const int64_t *offsets,
                            const ml_experts_weights *wt, const ml_experts_cfg *c, int width,
                            const ml_kctx *ctx)
{
    switch (dt) {
    case ML_F32:
        return forward<float>(dt, y, h_saved, scratch, x, w, order, offsets, wt, c, width, ctx);
    case ML_F64:
        return forward<double>(dt, y, h_saved, scratch, x, w, order, offsets, wt, c, width, ctx);
    case ML_BF16:
        return forward<ml_bf16>(dt, y, h_saved, scratch, x, w, order, offsets, wt, c, width, ctx);
    default:
        return ML_EUNSUPPORTED;
    }
}

extern "C" ml_status ml_experts_forward_cuda(ml_dtype dt, void *y, void *h_saved, void *scratch,
                                             const void *x, const void *w, const int64_t *order,
                                             const int64_t *offsets,
                                             const ml_experts_weights *wt,
                                             const ml_experts_cfg *c, const ml_kctx *ctx)
{
    return forward_at(dt, y, h_saved, scratch, x, w, order, offsets, wt, c, WAVE, ctx);
}

/* ---- backward ------------------------------------------------------------------------- */

template <typename S>
static ml_status backward(ml_dtype dt, void *dx, const ml_experts_wgrads *dwt, void *dw,
                          uint8_t *touched, void *scratch, const void *h_saved, const void *dy,
                          const void *x, const void *w, const int64_t *order,
                          const int64_t *offsets, const ml_experts_weights *wt,
                          const ml_experts_cfg *c, int width, const ml_kctx *ctx)
{
    typedef typename ml_float<S>::acc A;
    cudaStream_t st = ml_cuda_stream(ctx);
    ml_dtype at = ml_grad_dtype(dt);      /* A's dtype, and the weight gradients' */
    int64_t D = c->D, Fd = c->F, W = ml_experts_wave_rows(c);
    void **ptrs = (void **)scratch;
    int64_t *pos = (int64_t *)(ptrs + 3 * BWD_STEPS * WAVE);
    A *dxt = (A *)(pos + W);              /* [W, D] dxt; first dyt [W, D] of S (dy rows, then w·dy) */
    S *dyt = (S *)dxt;
    A *dact = dxt + W * D;                /* [W, F] unscaled: dyt · down[e] */
    S *xt = (S *)(dact + W * Fd);         /* [W, D] x rows */
    S *hbuf = xt + W * D;                 /* [W, 2F] h (recomputed), then dh */
    S *act = hbuf + W * 2 * Fd;           /* [W, F] */
    if (!c->accumulate) {
        TRY(ml_cuda_status(cudaMemsetAsync(dw, 0, (size_t)(c->T * c->k) * sizeof(S), st)));
        TRY(ml_cuda_status(cudaMemsetAsync(touched, 0, (size_t)c->E, st)));
    }
    auto block = [&](int64_t eb, int64_t nb, const int64_t *off) -> ml_status {
        touched_block tb;
        for (int64_t i = 0; i < nb; i++)
            tb.v[i] = wt->gate_up[eb + i] ? off[i + 1] > off[i] : -1;
        touched_kernel<<<blocks_of(nb), ML_CUDA_THREADS, 0, st>>>(touched + eb, tb, nb);
        return ml_cuda_launched();
    };
    auto run = [&](const wave_host &h) -> ml_status {
        const wave &v = h.v;
        gemm_ptrs P = {};
        step hs = {0, 0, {}}, ds = {1, 0, {}}, dd = {2, 0, {}}, dg = {3, 0, {}}, xs = {4, 0, {}};
        int round[WAVE], rounds = 0;
        for (int i = 0; i < v.n; i++) {
            int64_t r = v.ro[i + 1] - v.ro[i], ro = v.ro[i], e = h.e[i];
            const void *gu = wt->gate_up[e];
            if (!h.saved[i])   /* recompute h [r, 2F] = xt · gate_up[e]ᵀ */
                add(P, hs, xt + ro * D, gu, hbuf + ro * 2 * Fd, r, 2 * Fd, D, 0, 1, D, D, 2 * Fd,
                    0.0);
            /* dact_u [r, F] = dyt [r, D] · down[e] [D, F] */
            add(P, ds, dyt + ro * D, wt->down[e], dact + ro * Fd, r, Fd, D, 0, 0, D, Fd, Fd, 0.0);
            /* dxt [r, D] = dh [r, 2F] · gate_up[e] [2F, D], over dout (consumed
             * by the rounds before it) */
            add(P, xs, hbuf + ro * 2 * Fd, gu, dxt + ro * D, r, D, 2 * Fd, 0, 0, 2 * Fd, D, D, 0.0);
            round[i] = i && h.e[i - 1] == e ? round[i - 1] + 1 : 0;
            rounds = round[i] + 1 > rounds ? round[i] + 1 : rounds;
        }
        int64_t first[WAVE + 1];   /* round j's problems: [first[j], first[j+1]) */
        for (int j = 0; j < rounds; j++) {
            first[j] = dd.n;
            for (int i = 0; i < v.n; i++) {
                if (round[i] != j)
                    continue;
                int64_t r = v.ro[i + 1] - v.ro[i], ro = v.ro[i], e = h.e[i];
                /* ddown[e] [D, F] += doutᵀ [D, r] · act [r, F] */
                add(P, dd, dyt + ro * D, act + ro * Fd, dwt->down[e], D, Fd, r, 1, 0, D, Fd, Fd,
                    1.0);
                /* dgate_up[e] [2F, D] += dhᵀ [2F, r] · xt [r, D] */
                add(P, dg, hbuf + ro * 2 * Fd, xt + ro * D, dwt->gate_up[e], 2 * Fd, D, r, 1, 0,
                    2 * Fd, D, D, 1.0);
            }
        }
        first[rounds] = dd.n;
        TRY(gather<S>(xt, x, dyt, dy, pos, ptrs, P, 3 * BWD_STEPS * WAVE, order, v, D, c->k, st));
        if (hs.n)
            TRY(grouped(dt, dt, hs, ptrs, 0, hs.n, ctx));
        TRY(grouped(dt, at, ds, ptrs, 0, ds.n, ctx));
        swiglu_bwd_kernel<S><<<ml_cuda_blocks(v.ro[v.n] * 32, ML_CUDA_THREADS), ML_CUDA_THREADS, 0,
                               st>>>(act, hbuf, (S *)dw, dyt, v, dact, (const S *)w, pos, Fd, D);
        TRY(ml_cuda_launched());
        for (int j = 0; j < rounds; j++) {
            TRY(grouped(dt, at, dd, ptrs, first[j], first[j + 1], ctx));
            TRY(grouped(dt, at, dg, ptrs, first[j], first[j + 1], ctx));
        }
        TRY(grouped(dt, at, xs, ptrs, 0, xs.n, ctx));
        return combine<S>(dx, dxt, w, pos, v, D, c->k, 0, st);
    };
    return walk(offsets, wt, c, width, h_saved, hbuf, 2 * Fd * (int64_t)sizeof(S), ctx, block, run);
}

/* backward at wave width width, as forward_at */
static ml_status backward_at(ml_dtype dt, void *dx, const ml_experts_wgrads *dwt, void *dw,
                             uint8_t *touched, void *scratch, const void *h_saved, const void *dy,
                             const void *x, const void *w, const int64_t *order,
                             const int64_t *offsets, const ml_experts_weights *wt,
                             const ml_experts_cfg *c, int width, const ml_kctx *ctx)
{
    switch (dt) {
    case ML_F32:
        return backward<float>(dt, dx, dwt, dw, touched, scratch, h_saved, dy, x, w, order,
                               offsets, wt, c, width, ctx);
    case ML_F64:
        return backward<double>(dt, dx, dwt, dw, touched, scratch, h_saved, dy, x, w, order,
                                offsets, wt, c, width, ctx);
    case ML_BF16:
        return backward<ml_bf16>(dt, dx, dwt, dw, touched, scratch, h_saved, dy, x, w, order,
                                 offsets, wt, c, width, ctx);
    default:
        return ML_EUNSUPPORTED;
    }
}

extern "C" ml_status ml_experts_backward_cuda(ml_dtype dt, void *dx, const ml_experts_wgrads *dwt,
                                              void *dw, uint8_t *touched, void *scratch,
                                              const void *h_saved, const void *dy, const void *x,
                                              const void *w, const int64_t *order,
                                              const int64_t *offsets,
                                              const ml_experts_weights *wt,
                                              const ml_experts_cfg *c, const ml_kctx *ctx)
{
    return backward_at(dt, dx, dwt, dw, touched, scratch, h_saved, dy, x, w, order, offsets, wt, c,
                       WAVE, ctx);
}
