/*
 * kernels/reduce.cu - CUDA sum / mean / max / min over a dim or everything, and
 * cumsum, in the CPU's summation order (kernels/reduce.h), so results are
 * bit-identical to kernels/reduce.c, not merely close:
 *   - over a dim: one thread per output, sequential in f64 along the dim
 *     (coalesced across threads when inner > 1);
 *   - everything: one thread per ML_REDUCE_BLOCK block summing it
 *     sequentially in f64 (a grid sized from the SM count, so the blocks of
 *     one super block spread over the GPU instead of sharing one SM), then
 *     one thread per super block of SUPER blocks adds their partials in
 *     block order, and one thread adds the super partials in order; PASS
 *     super blocks at a time, the running result carried between passes;
 *   - cumsum: one thread per column, sequential.
 * The block partials and the running result live in the caller's scratch
 * (about 1 MiB, ml_reduce_all_scratch_bytes_cuda), not in __device__
 * module state that calls on two streams would share.
 */
#include "cuda_common.cuh"

extern "C" {
#include "reduce.h"
}

#define SUPER 1024           /* must equal kernels/reduce.c's SUPER */
#define PASS ML_REDUCE_CUDA_PASS   /* super blocks per pass: 2^28 elements */
#define BLOCK_THREADS 64     /* small CUDA blocks: more SMs share few partials */

__device__ __forceinline__ double at(ml_dtype dt, const void *p, int64_t i)
{
    return dt == ML_F32 ? (double)((const float *)p)[i] : ((const double *)p)[i];
}

/* Running max (or min) with NaN winning and the first position kept on ties. */
__device__ __forceinline__ void ext_step(ml_redop op, double v, int64_t j, double *best, int64_t *bi)
{
    if (*best != *best)
        return;
    if ((op == ML_RMAX ? v > *best : v < *best) || v != v) {
        *best = v;
        *bi = j;
    }
}

/* ---- over one dim ------------------------------------------------------- */

__global__ void reduce_kernel(ml_redop op, ml_dtype dt, void *out, int64_t *idx, const void *in,
                              int64_t nout, int64_t r, int64_t inner)
{
    ML_CUDA_FOR(q, nout) {
        int64_t o = q / inner, i = q % inner;
        int64_t base = o * r * inner + i;
        double acc;
        int64_t bi = 0;
        if (op == ML_RMAX || op == ML_RMIN) {
            acc = r ? at(dt, in, base) : NAN;
            for (int64_t j = 1; j < r; j++)
                ext_step(op, at(dt, in, base + j * inner), j, &acc, &bi);
        } else {
            acc = 0;
            for (int64_t j = 0; j < r; j++)
                acc += at(dt, in, base + j * inner);
            if (op == ML_RMEAN)
                acc = r ? acc / (double)r : NAN;
        }
        ml_store(dt, out, (size_t)q, acc);
        if (idx)
            idx[q] = bi;
    }
}

extern "C" ml_status ml_reduce_cuda(ml_redop op, ml_dtype dt, void *out, int64_t *idx, const void *in,
                                    int64_t outer, int64_t r, int64_t inner, const ml_kctx *ctx)
{
    if (dt != ML_F32 && dt != ML_F64)
        return ML_EUNSUPPORTED;
    int64_t nout = outer * inner;
    if (nout <= 0)
        return ML_OK;
    if (ml_kctx_interrupted(ctx))
        return ML_EINTERRUPTED;
    reduce_kernel<<<ml_cuda_blocks(nout, ML_CUDA_THREADS), ML_CUDA_THREADS, 0, ml_cuda_stream(ctx)>>>(
        op, dt, out, idx, in, nout, r, inner);
    return ml_cuda_launched();
}

/* ---- everything ---------------------------------------------------------- */

/* One pass's block partials ([PASS * SUPER]; positions for max / min) and
 * the running result across passes. */
typedef struct {
    double part[PASS * SUPER];
    int64_t pidx[PASS * SUPER];
    double acc;
    int64_t idx;
} all_ws;
static_assert(sizeof(all_ws) == ((size_t)PASS * SUPER + 1) * 16,
              "ml_reduce_all_scratch_bytes_cuda (reduce.c) sizes it");

/* Thread j: block first_block + j of the input, sequentially (the CPU's block sum). */
__global__ void all_blocks_kernel(ml_redop op, ml_dtype dt, all_ws *ws, const void *in, int64_t n,
                                  int64_t first_block, int64_t nb)
{
    ML_CUDA_FOR(j, nb) {
        int64_t s = (first_block + j) * ML_REDUCE_BLOCK;
        int64_t e = s + ML_REDUCE_BLOCK < n ? s + ML_REDUCE_BLOCK : n;
        if (op == ML_RMAX || op == ML_RMIN) {
            double best = at(dt, in, s);
            int64_t bi = s;
            for (int64_t i = s + 1; i < e; i++)
                ext_step(op, at(dt, in, i), i, &best, &bi);
            ws->part[j] = best;
            ws->pidx[j] = bi;
        } else {
            double acc = 0;
            for (int64_t i = s; i < e; i++)
                acc += at(dt, in, i);
            ws->part[j] = acc;
        }
    }
}

/* One block of PASS threads: thread s adds super block s's partials in
 * block order (as the CPU's super partial), then thread 0 folds the super
 * partials into the running result in order, starting like the CPU (sum 0;
 * max/min from element 0, position 0); the last pass writes out (and idx).
 * ext_step keeps the first NaN or else the first extremum, so folding per
 * block, per super block and then across super blocks selects what the
 * CPU's flat fold selects. */
__global__ void __launch_bounds__(PASS)
all_combine_kernel(ml_redop op, ml_dtype dt, void *out, int64_t *idx, all_ws *ws, const void *in,
                   int64_t nsup, int64_t nb, int first_pass, int last_pass, int64_t n)
{
    __shared__ double spart[PASS];
    __shared__ int64_t sidx[PASS];
    int ext = op == ML_RMAX || op == ML_RMIN;
    int64_t t = threadIdx.x;
    if (t < nsup) {
        int64_t b0 = t * SUPER, b1 = b0 + SUPER < nb ? b0 + SUPER : nb;
        double acc = ext ? ws->part[b0] : 0.0;
        int64_t bi = ext ? ws->pidx[b0] : 0;
        for (int64_t b = ext ? b0 + 1 : b0; b < b1; b++) {
            if (ext)
                ext_step(op, ws->part[b], ws->pidx[b], &acc, &bi);
            else
                acc += ws->part[b];
        }
        spart[t] = acc;
        sidx[t] = bi;
    }
    __syncthreads();
    if (t != 0)
        return;
    double acc = !first_pass ? ws->acc : !ext ? 0.0 : n ? at(dt, in, 0) : NAN;
    int64_t bi = first_pass ? 0 : ws->idx;
    for (int64_t s = 0; s < nsup; s++) {
        if (ext)
            ext_step(op, spart[s], sidx[s], &acc, &bi);
        else
            acc += spart[s];
    }
    ws->acc = acc;
    ws->idx = bi;
    if (last_pass) {
        if (op == ML_RMEAN)
            acc = n ? acc / (double)n : NAN;
        ml_store(dt, out, 0, acc);
        if (idx)
            idx[0] = bi;
    }
}

/* Grid of the block pass: enough small CUDA blocks to cover nb partials,
 * at most 8 per SM (grid-stride beyond). */
static unsigned blocks_grid(int64_t nb)
{
    unsigned g = ml_cuda_blocks(nb, BLOCK_THREADS), cap = 8u * (unsigned)ml_cuda_sm_count();
    return g < cap ? g : cap;
}

static ml_status all_passes(ml_redop op, ml_dtype dt, void *out, int64_t *idx, const void *in,
                            int64_t n, all_ws *ws, const ml_kctx *ctx)
{
    cudaStream_t st = ml_cuda_stream(ctx);
    int64_t nblocks = (n + ML_REDUCE_BLOCK - 1) / ML_REDUCE_BLOCK;
    int64_t nsuper = (nblocks + SUPER - 1) / SUPER;
    ml_status s;
    if (nsuper == 0) {   /* empty: sum 0, mean / max / min NaN at 0, as on the CPU */
        all_combine_kernel<<<1, PASS, 0, st>>>(op, dt, out, idx, ws, in, 0, 0, 1, 1, 0);
        return ml_cuda_launched();
    }
    for (int64_t first = 0; first < nsuper; first += PASS) {
        if (ml_kctx_interrupted(ctx))
            return ML_EINTERRUPTED;
        int64_t count = nsuper - first < PASS ? nsuper - first : PASS;
        int64_t b0 = first * SUPER, nb = nblocks - b0 < count * SUPER ? nblocks - b0 : count * SUPER;
        all_blocks_kernel<<<blocks_grid(nb), BLOCK_THREADS, 0, st>>>(op, dt, ws, in, n, b0, nb);
        if ((s = ml_cuda_launched()) != ML_OK)
            return s;
        all_combine_kernel<<<1, PASS, 0, st>>>(op, dt, out, idx, ws, in, count, nb, first == 0,
                                               first + count == nsuper, n);
        if ((s = ml_cuda_launched()) != ML_OK)
            return s;
    }
    return ML_OK;
}

extern "C" ml_status ml_reduce_all_cuda(ml_redop op, ml_dtype dt, void *out, int64_t *idx, const void *in,
                                        int64_t n, void *scratch, const ml_kctx *ctx)
{
    if (dt != ML_F32 && dt != ML_F64)
        return ML_EUNSUPPORTED;
    return all_passes(op, dt, out, idx, in, n, (all_ws *)scratch, ctx);
}

/* ---- cumsum -------------------------------------------------------------- */

__global__ void cumsum_kernel(ml_dtype dt, void *out, const void *in, int64_t ncols, int64_t r, int64_t inner)
{
    ML_CUDA_FOR(q, ncols) {
        int64_t o = q / inner, i = q % inner, base = o * r * inner + i;
        double acc = 0;
        for (int64_t j = 0; j < r; j++) {
            size_t k = (size_t)(base + j * inner);
            acc += ml_load(dt, in, k);
            ml_store(dt, out, k, acc);
        }
    }
}

extern "C" ml_status ml_cumsum_cuda(ml_dtype dt, void *out, const void *in,
                                    int64_t outer, int64_t r, int64_t inner, const ml_kctx *ctx)
{
    if (dt != ML_F32 && dt != ML_F64 && dt != ML_I32 && dt != ML_I64)
        return ML_EUNSUPPORTED;
    int64_t ncols = outer * inner;
    if (ncols <= 0 || r <= 0)
        return ML_OK;
    if (ml_kctx_interrupted(ctx))
        return ML_EINTERRUPTED;
    cumsum_kernel<<<ml_cuda_blocks(ncols, ML_CUDA_THREADS), ML_CUDA_THREADS, 0, ml_cuda_stream(ctx)>>>(
        dt, out, in, ncols, r, inner);
    return ml_cuda_launched();
}
