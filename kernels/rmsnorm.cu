/*
 * kernels/rmsnorm.cu - RMSNorm forward/backward (CUDA; see rmsnorm.h).
 *
 * One block per row. The row's sums (sum x^2; sum dy*w*x) run in the
 * compute type (f32 for f32 and bf16, f64 for f64): each thread adds a
 * fixed strided slice of the row and the block adds the partials in a fixed
 * tree (ml_block_sum), so results are the same run to run. rstd is f64:
 * 1 / sqrt(sum / D + eps) in f64 from the compute-type sum. The CPU sums in
 * f64 in column order, so parity is a normwise tolerance, not bitwise.
 *
 * dw (+=) needs no float atomics and no scratch: a block owns 32 columns
 * and splits the rows into 32 contiguous slices; thread (slice, column)
 * adds dy * x * rstd, the CPU's terms in f64 (bf16 widened exactly), over
 * its slice in row order, and the 32 partials of a column are then added in
 * slice order and rounded once into dw (f32 for bf16: the weight gradient
 * of mixed precision). A fixed order, so deterministic; not the CPU's
 * single sequence, which would leave the pass with D threads only.
 */
#include "cuda_float.cuh"

extern "C" {
#include "rmsnorm.h"
}

#define RMS_THREADS 256
#define RMS_COLS 32     /* columns per block of the dw pass */
#define RMS_SLICES 32   /* row slices per column; RMS_COLS * RMS_SLICES threads */

template <typename T>
__global__ void __launch_bounds__(RMS_THREADS)
rms_fwd_kernel(T *y, double *rstd, const T *x, const T *w, int64_t N, int64_t D, double eps)
{
    typedef ml_float<T> F;
    typedef typename F::acc A;
    __shared__ A red[RMS_THREADS];
    for (int64_t n = blockIdx.x; n < N; n += gridDim.x) {
        const T *xr = x + n * D;
        T *yr = y + n * D;
        A ss = 0;
        for (int64_t d = threadIdx.x; d < D; d += RMS_THREADS) {
            A v = F::load(xr[d]);
            ss += v * v;
        }
        ss = ml_block_sum(red, ss);
        double r = 1.0 / sqrt((double)ss / (double)D + eps);
        if (threadIdx.x == 0)
            rstd[n] = r;
        A ra = (A)r;
        for (int64_t d = threadIdx.x; d < D; d += RMS_THREADS)
            yr[d] = F::store(F::load(xr[d]) * ra * F::load(w[d]));
    }
}

/* dx = rstd * g - x * rstd^3 * mean(g * x), g = dy * w */
template <typename T>
__global__ void __launch_bounds__(RMS_THREADS)
rms_bwd_rows_kernel(T *dx, const T *dy, const T *x, const T *w, const double *rstd, int64_t N,
                    int64_t D)
{
    typedef ml_float<T> F;
    typedef typename F::acc A;
    __shared__ A red[RMS_THREADS];
    for (int64_t n = blockIdx.x; n < N; n += gridDim.x) {
        const T *xr = x + n * D, *dyr = dy + n * D;
        T *dxr = dx + n * D;
        A gx = 0;
        for (int64_t d = threadIdx.x; d < D; d += RMS_THREADS)
            gx += F::load(dyr[d]) * F::load(w[d]) * F::load(xr[d]);
        gx = ml_block_sum(red, gx);
        double r = rstd[n];
        A ra = (A)r, ca = (A)(r * r * r * (double)gx / (double)D);
        for (int64_t d = threadIdx.x; d < D; d += RMS_THREADS) {
            A g = F::load(dyr[d]) * F::load(w[d]);
            dxr[d] = F::store(ra * g - F::load(xr[d]) * ca);
        }
    }
}

/* dw[d] += sum_n dy[n, d] * x[n, d] * rstd[n] in f64: slices of rows in
 * row order, then the slices' partials in slice order; dw of the gradient
 * type G (ml_grad_dtype: f32 for bf16 T) */
template <typename T, typename G>
__global__ void __launch_bounds__(RMS_COLS * RMS_SLICES)
rms_bwd_cols_kernel(G *dw, const T *dy, const T *x, const double *rstd, int64_t N, int64_t D)
{
    typedef ml_float<T> F;
    typedef ml_float<G> FG;
    __shared__ double part[RMS_SLICES][RMS_COLS];
    int c = threadIdx.x % RMS_COLS, s = threadIdx.x / RMS_COLS;
    int64_t per = (N + RMS_SLICES - 1) / RMS_SLICES;
    int64_t n0 = s * per, n1 = n0 + per < N ? n0 + per : N;
    for (int64_t d0 = (int64_t)blockIdx.x * RMS_COLS; d0 < D; d0 += (int64_t)gridDim.x * RMS_COLS) {
        int64_t d = d0 + c;
        double acc = 0;
        for (int64_t n = n0; d < D && n < n1; n++)
            acc += (double)F::load(dy[n * D + d]) * (double)F::load(x[n * D + d]) * rstd[n];
        part[s][c] = acc;
        __syncthreads();
        if (s == 0 && d < D) {
            for (int k = 1; k < RMS_SLICES; k++)
                acc += part[k][c];
            dw[d] = FG::store((typename FG::acc)((double)FG::load(dw[d]) + acc));
        }
        __syncthreads();   /* part is rewritten by the next columns */
    }
}

static unsigned row_blocks(int64_t N)
{
    return (unsigned)(N < ML_CUDA_MAX_BLOCKS ? N : ML_CUDA_MAX_BLOCKS);
}

template <typename T>
static ml_status fwd_launch(void *y, double *rstd, const void *x, const void *w, int64_t N,
                            int64_t D, double eps, cudaStream_t st)
{
    rms_fwd_kernel<T><<<row_blocks(N), RMS_THREADS, 0, st>>>((T *)y, rstd, (const T *)x,
                                                             (const T *)w, N, D, eps);
    return ml_cuda_launched();
}

extern "C" ml_status ml_rmsnorm_forward_cuda(ml_dtype dt, void *y, double *rstd, const void *x,
                                             const void *w, int64_t N, int64_t D, double eps,
                                             const ml_kctx *ctx)
{
    if (dt != ML_F32 && dt != ML_F64 && dt != ML_BF16)
        return ML_EUNSUPPORTED;
    if (N <= 0 || D <= 0)
        return ML_OK;
    if (ml_kctx_interrupted(ctx))
        return ML_EINTERRUPTED;
    cudaStream_t st = ml_cuda_stream(ctx);
    switch (dt) {
    case ML_F32: return fwd_launch<float>(y, rstd, x, w, N, D, eps, st);
    case ML_F64: return fwd_launch<double>(y, rstd, x, w, N, D, eps, st);
    default:     return fwd_launch<ml_bf16>(y, rstd, x, w, N, D, eps, st);
    }
}

template <typename T, typename G>
static ml_status bwd_launch(void *dx, void *dw, const void *dy, const void *x, const void *w,
                            const double *rstd, int64_t N, int64_t D, cudaStream_t st)
{
    rms_bwd_rows_kernel<T><<<row_blocks(N), RMS_THREADS, 0, st>>>(
        (T *)dx, (const T *)dy, (const T *)x, (const T *)w, rstd, N, D);
    ml_status s = ml_cuda_launched();
    if (s != ML_OK)
        return s;
    rms_bwd_cols_kernel<T, G><<<ml_cuda_blocks(D, RMS_COLS), RMS_COLS * RMS_SLICES, 0, st>>>(
        (G *)dw, (const T *)dy, (const T *)x, rstd, N, D);
    return ml_cuda_launched();
}

extern "C" ml_status ml_rmsnorm_backward_cuda(ml_dtype dt, void *dx, void *dw, const void *dy,
                                              const void *x, const void *w, const double *rstd,
                                              int64_t N, int64_t D, const ml_kctx *ctx)
{
    if (dt != ML_F32 && dt != ML_F64 && dt != ML_BF16)
        return ML_EUNSUPPORTED;
    if (N <= 0 || D <= 0)
        return ML_OK;
    if (ml_kctx_interrupted(ctx))
        return ML_EINTERRUPTED;
    cudaStream_t st = ml_cuda_stream(ctx);
    switch (dt) {
    case ML_F32: return bwd_launch<float, float>(dx, dw, dy, x, w, rstd, N, D, st);
    case ML_F64: return bwd_launch<double, double>(dx, dw, dy, x, w, rstd, N, D, st);
    default:     return bwd_launch<ml_bf16, float>(dx, dw, dy, x, w, rstd, N, D, st);
    }
}
