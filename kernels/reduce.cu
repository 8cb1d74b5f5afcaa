/*
 * kernels/reduce.cu - CUDA sum / mean / max / min over a dim or everything, and
 * cumsum, in the CPU's summation order (kernels/reduce.h), so results are
 * bit-identical to kernels/reduce.c, not merely close:
 *   - over a dim: one thread per output, sequential in f64 along the dim
 *     (coalesced across threads when inner > 1);
 *   - everything: one thread per ML_REDUCE_BLOCK block summing it
 *     sequentially in f64, one CUDA block per super block of SUPER blocks
 *     whose partials thread 0 adds in block order, then one thread adds the
 *     super partials in order;
 *   - cumsum: one thread per column, sequential.
 * The super partials live in a fixed __device__ scratch array (no
 * allocation in kernels/); calls on concurrent streams would share it, and
 * the host drives one stream.
 */
#include "cuda_common.cuh"

extern "C" {
#include "reduce.h"
}

#define SUPER 1024           /* must equal kernels/reduce.c's SUPER */
#define SCRATCH 4096         /* super partials per pass: 2^34 elements */

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

__device__ double super_part[SCRATCH];
__device__ int64_t super_idx[SCRATCH];
__device__ double run_acc;     /* running result across passes */
__device__ int64_t run_idx;

/* Block s of the grid reduces super block `first + s` of the input. */
__global__ void __launch_bounds__(SUPER)
all_super_kernel(ml_redop op, ml_dtype dt, const void *in, int64_t n, int64_t first)
{
    __shared__ double part[SUPER];
    __shared__ int64_t pidx[SUPER];
    int64_t sbase = (first + blockIdx.x) * (int64_t)SUPER * ML_REDUCE_BLOCK;
    int64_t s = sbase + (int64_t)threadIdx.x * ML_REDUCE_BLOCK;
    if (s < n) {
        int64_t e = s + ML_REDUCE_BLOCK < n ? s + ML_REDUCE_BLOCK : n;
        if (op == ML_RMAX || op == ML_RMIN) {
            double best = at(dt, in, s);
            int64_t bi = s;
            for (int64_t i = s + 1; i < e; i++)
                ext_step(op, at(dt, in, i), i, &best, &bi);
            part[threadIdx.x] = best;
            pidx[threadIdx.x] = bi;
        } else {
            double acc = 0;
            for (int64_t i = s; i < e; i++)
                acc += at(dt, in, i);
            part[threadIdx.x] = acc;
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int64_t left = n - sbase, nblocks = (left + ML_REDUCE_BLOCK - 1) / ML_REDUCE_BLOCK;
        if (nblocks > SUPER)
            nblocks = SUPER;
        if (op == ML_RMAX || op == ML_RMIN) {
            double best = part[0];
            int64_t bi = pidx[0];
            for (int64_t b = 1; b < nblocks; b++)
                ext_step(op, part[b], pidx[b], &best, &bi);
            super_part[blockIdx.x] = best;
            super_idx[blockIdx.x] = bi;
        } else {
            double sacc = 0;
            for (int64_t b = 0; b < nblocks; b++)
                sacc += part[b];
            super_part[blockIdx.x] = sacc;
        }
    }
}

/* One thread folds this pass's super partials into the running result in
 * order, starting like the CPU (sum 0; max/min from element 0, position
 * 0); the last pass writes out (and idx). ext_step keeps the first NaN or
 * else the first extremum, so folding per super block and then across
 * super blocks selects what the CPU's flat fold selects. */
__global__ void all_fold_kernel(ml_redop op, ml_dtype dt, void *out, int64_t *idx, const void *in,
                                int64_t nsup, int first_pass, int last_pass, int64_t n)
{
    int ext = op == ML_RMAX || op == ML_RMIN;
    double acc = !first_pass ? run_acc : !ext ? 0.0 : n ? at(dt, in, 0) : NAN;
    int64_t bi = first_pass ? 0 : run_idx;
    for (int64_t s = 0; s < nsup; s++) {
        if (ext)
            ext_step(op, super_part[s], super_idx[s], &acc, &bi);
        else
            acc += super_part[s];
    }
    run_acc = acc;
    run_idx = bi;
    if (last_pass) {
        if (op == ML_RMEAN)
            acc = n ? acc / (double)n : NAN;
        ml_store(dt, out, 0, acc);
        if (idx)
            idx[0] = bi;
    }
}

extern "C" ml_status ml_reduce_all_cuda(ml_redop op, ml_dtype dt, void *out, int64_t *idx, const void *in,
                                        int64_t n, const ml_kctx *ctx)
{
    if (dt != ML_F32 && dt != ML_F64)
        return ML_EUNSUPPORTED;
    cudaStream_t st = ml_cuda_stream(ctx);
    int64_t super_elems = (int64_t)SUPER * ML_REDUCE_BLOCK;
    int64_t nsuper = n > 0 ? (n + super_elems - 1) / super_elems : 0;
    if (nsuper == 0) {   /* empty: sum 0, mean / max / min NaN at 0, as on the CPU */
        all_fold_kernel<<<1, 1, 0, st>>>(op, dt, out, idx, in, 0, 1, 1, 0);
        return ml_cuda_launched();
    }
    for (int64_t first = 0; first < nsuper; first += SCRATCH) {
        if (ml_kctx_interrupted(ctx))
            return ML_EINTERRUPTED;
        int64_t count = nsuper - first < SCRATCH ? nsuper - first : SCRATCH;
        all_super_kernel<<<(unsigned)count, SUPER, 0, st>>>(op, dt, in, n, first);
        ml_status s = ml_cuda_launched();
        if (s != ML_OK)
            return s;
        all_fold_kernel<<<1, 1, 0, st>>>(op, dt, out, idx, in, count, first == 0,
                                         first + count == nsuper, n);
        if ((s = ml_cuda_launched()) != ML_OK)
            return s;
    }
    return ML_OK;
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
