/*
 * kernels/crossentropy.cu - chunked LM-head cross-entropy (CUDA; see
 * crossentropy.h), the CPU's algorithm with cuBLAS for the logits: rows
 * `rows` at a time, the vocabulary `vchunk` columns at a time, each
 * [nr, nc] block of logits formed in the caller's scratch by ml_matmul_cuda.
 * f32 and f64 (the cuBLAS path has no bf16 GEMM).
 *
 * Forward. The device memory is lse [S] and the scratch, nothing more, so
 * the online log-sum-exp keeps one f64 per row, the running lse itself, in
 * lse: after each block, lse = M + log(exp(lse - M) + sum_c exp(x_c - M))
 * with M the max of lse and the block's row (one block of threads per row,
 * fixed-tree sums). Mathematically the CPU's (max, sum) pair; numerically
 * within a few f64 ulp of it. Then, rows at a time, each row's target logit
 * is formed in the scratch by a fixed-order f64 dot h[s] . W[targets[s]]
 * rounded to dt (the CPU takes it from BLAS's block: the two differ by
 * about an ulp of the logit), lse and target logits are copied to the host,
 * and loss = (1/S) sum_s (lse[s] - logit) is added in row order in f64, as
 * on the CPU. A NaN lse (NaN or infinite logits) is ML_ENAN, as on the CPU.
 * The copy waits for the stream once per row chunk.
 *
 * Backward. As on the CPU: dh = 0; per block, G = (exp(logit - lse) -
 * onehot) * dloss / S in the scratch, then dh += G W_c and dW_c += G^T h
 * by cuBLAS.
 */
#include "cuda_float.cuh"

extern "C" {
#include "crossentropy.h"
#include "matmul.h"
}

#define CE_THREADS 256

static int64_t clamp(int64_t a, int64_t n) { return a < n ? a : n; }

/* One row-major GEMM: C [m, n] = op(A) op(B) + beta C (matmul.h). */
static ml_gemm_shape gemm1(int64_t m, int64_t n, int64_t k, int ta, int tb, int64_t lda,
                           int64_t ldb, int64_t ldc, double beta)
{
    ml_gemm_shape g = {1, m, n, k, ta, tb, lda, ldb, ldc, 0, 0, 0, 1.0, beta};
    return g;
}

/* block[r, c] = h[r0 + r] . W[c0 + c], r < nr, c < nc (ld = nc) */
static ml_status logits_block(ml_dtype dt, void *blk, const void *h, const void *W, int64_t r0,
                              int64_t nr, int64_t c0, int64_t nc, int64_t D, const ml_kctx *ctx)
{
    size_t es = ml_dtype_size(dt);
    ml_gemm_shape g = gemm1(nr, nc, D, 0, 1, D, D, nc, 0.0);
    return ml_matmul_cuda(dt, dt, blk, (const char *)h + (size_t)(r0 * D) * es,
                          (const char *)W + (size_t)(c0 * D) * es, &g, ctx);
}


/* One block per row r of the chunk: fold the block's logits into lse[r0+r]
 * (first: no earlier block, the running lse is -inf). */
template <typename T>
__global__ void __launch_bounds__(CE_THREADS)
ce_lse_kernel(double *lse, const T *blk, int64_t r0, int64_t nr, int64_t nc, int first)
{
    __shared__ double red[CE_THREADS];
    for (int64_t r = blockIdx.x; r < nr; r += gridDim.x) {
        const T *row = blk + r * nc;
        double old = first ? -INFINITY : lse[r0 + r];
        double mx = old;
        for (int64_t c = threadIdx.x; c < nc; c += CE_THREADS)
            mx = ml_nanmax(mx, (double)row[c]);
        mx = ml_block_nanmax(red, mx);
        double sum = 0;
        for (int64_t c = threadIdx.x; c < nc; c += CE_THREADS)
            sum += exp((double)row[c] - mx);
        sum = ml_block_sum(red, sum);
        if (threadIdx.x == 0)
            lse[r0 + r] = mx + log((old == -INFINITY ? 0.0 : exp(old - mx)) + sum);
    }
}

/* out[r] = h[r0 + r] . W[targets[r0 + r]] in f64, rounded to T; one block
 * per row. */
template <typename T>
__global__ void __launch_bounds__(CE_THREADS)
ce_target_kernel(T *out, const T *h, const T *W, const int64_t *targets, int64_t r0, int64_t nr,
                 int64_t D)
{
    __shared__ double red[CE_THREADS];
    for (int64_t r = blockIdx.x; r < nr; r += gridDim.x) {
        const T *hr = h + (r0 + r) * D, *wr = W + targets[r0 + r] * D;
        double dot = 0;
        for (int64_t d = threadIdx.x; d < D; d += CE_THREADS)
            dot += (double)hr[d] * (double)wr[d];
        dot = ml_block_sum(red, dot);
        if (threadIdx.x == 0)
            out[r] = (T)dot;
    }
}

/* blk[r, c] <- (exp(logit - lse) - onehot) * scale, one thread per entry */
template <typename T>
__global__ void ce_grad_kernel(T *blk, const double *lse, const int64_t *targets, int64_t r0,
                               int64_t nr, int64_t c0, int64_t nc, double scale)
{
    ML_CUDA_FOR(q, nr * nc) {
        int64_t r = q / nc, c = q % nc;
        double p = exp((double)blk[q] - lse[r0 + r]);
        blk[q] = (T)((p - (c0 + c == targets[r0 + r] ? 1.0 : 0.0)) * scale);
    }
}

static unsigned row_blocks(int64_t nr)
{
    return (unsigned)(nr < ML_CUDA_MAX_BLOCKS ? nr : ML_CUDA_MAX_BLOCKS);
}

/* loss from lse and the target logits, `rows` rows at a time through host
 * buffers, added in row order */
template <typename T>
static ml_status ce_loss(double *loss, const double *lse, const T *h, const T *W,
                         const int64_t *targets, int64_t S, int64_t D, int64_t rows, T *scratch,
                         const ml_kctx *ctx)
{
    cudaStream_t st = ml_cuda_stream(ctx);
    double hl[ML_CE_MAX_ROWS];
    T ht[ML_CE_MAX_ROWS];
    double total = 0;
    for (int64_t r0 = 0; r0 < S; r0 += rows) {
        int64_t nr = clamp(rows, S - r0);
        ce_target_kernel<T><<<row_blocks(nr), CE_THREADS, 0, st>>>(scratch, h, W, targets, r0, nr, D);
        ml_status s = ml_cuda_launched();
        if (s == ML_OK)
            s = ml_cuda_status(cudaMemcpyAsync(hl, lse + r0, (size_t)nr * sizeof *hl,
                                               cudaMemcpyDeviceToHost, st));
        if (s == ML_OK)
            s = ml_cuda_status(cudaMemcpyAsync(ht, scratch, (size_t)nr * sizeof *ht,
                                               cudaMemcpyDeviceToHost, st));
        if (s == ML_OK)
            s = ml_cuda_status(cudaStreamSynchronize(st));
        if (s != ML_OK)
            return s;
        for (int64_t r = 0; r < nr; r++) {
            if (hl[r] != hl[r])
                return ML_ENAN;
            total += hl[r] - (double)ht[r];
        }
    }
    *loss = S > 0 ? total / (double)S : 0.0;
    return ML_OK;
}

template <typename T>
static ml_status ce_forward(ml_dtype dt, double *loss, double *lse, const void *h, const void *W,
                            const int64_t *targets, int64_t S, int64_t V, int64_t D, int64_t rows,
                            int64_t vchunk, void *scratch, const ml_kctx *ctx)
{
    cudaStream_t st = ml_cuda_stream(ctx);
    for (int64_t r0 = 0; r0 < S; r0 += rows) {
        int64_t nr = clamp(rows, S - r0);
        for (int64_t c0 = 0; c0 < V; c0 += vchunk) {
            if (ml_kctx_interrupted(ctx))
                return ML_EINTERRUPTED;
            int64_t nc = clamp(vchunk, V - c0);
            ml_status s = logits_block(dt, scratch, h, W, r0, nr, c0, nc, D, ctx);
            if (s != ML_OK)
                return s;
            ce_lse_kernel<T><<<row_blocks(nr), CE_THREADS, 0, st>>>(lse, (const T *)scratch, r0, nr,
                                                                   nc, c0 == 0);
            if ((s = ml_cuda_launched()) != ML_OK)
                return s;
        }
    }
    return ce_loss<T>(loss, lse, (const T *)h, (const T *)W, targets, S, D, rows, (T *)scratch, ctx);
}

extern "C" ml_status ml_ce_forward_cuda(ml_dtype dt, double *loss, double *lse, const void *h,
                                        const void *W, const int64_t *targets, int64_t S,
                                        int64_t V, int64_t D, int64_t rows, int64_t vchunk,
                                        void *scratch, const ml_kctx *ctx)
{
    if (dt != ML_F32 && dt != ML_F64)
        return ML_EUNSUPPORTED;
    if (rows < 1 || rows > ML_CE_MAX_ROWS || vchunk < 1)
        return ML_EUNSUPPORTED;
    if (dt == ML_F32)
        return ce_forward<float>(dt, loss, lse, h, W, targets, S, V, D, rows, vchunk, scratch, ctx);
    return ce_forward<double>(dt, loss, lse, h, W, targets, S, V, D, rows, vchunk, scratch, ctx);
}

template <typename T>
static ml_status ce_backward(ml_dtype dt, void *dh, void *dW, double dloss, const void *h,
                             const void *W, const int64_t *targets, const double *lse, int64_t S,
                             int64_t V, int64_t D, int64_t rows, int64_t vchunk, void *scratch,
                             const ml_kctx *ctx)
{
    cudaStream_t st = ml_cuda_stream(ctx);
    size_t es = sizeof(T);
    ml_status s = ml_cuda_status(cudaMemsetAsync(dh, 0, (size_t)(S * D) * es, st));
    if (s != ML_OK)
        return s;
    double scale = S > 0 ? dloss / (double)S : 0.0;
    for (int64_t r0 = 0; r0 < S; r0 += rows) {
        int64_t nr = clamp(rows, S - r0);
        for (int64_t c0 = 0; c0 < V; c0 += vchunk) {
            if (ml_kctx_interrupted(ctx))
                return ML_EINTERRUPTED;
            int64_t nc = clamp(vchunk, V - c0);
            if ((s = logits_block(dt, scratch, h, W, r0, nr, c0, nc, D, ctx)) != ML_OK)
                return s;
            ce_grad_kernel<T><<<ml_cuda_blocks(nr * nc, ML_CUDA_THREADS), ML_CUDA_THREADS, 0, st>>>(
                (T *)scratch, lse, targets, r0, nr, c0, nc, scale);
            if ((s = ml_cuda_launched()) != ML_OK)
                return s;
            /* dh[r0:r0+nr] += G [nr, nc] . W[c0:c0+nc] [nc, D] */
            ml_gemm_shape g1 = gemm1(nr, D, nc, 0, 0, nc, D, D, 1.0);
            s = ml_matmul_cuda(dt, dt, (char *)dh + (size_t)(r0 * D) * es, scratch,
                               (const char *)W + (size_t)(c0 * D) * es, &g1, ctx);
            if (s != ML_OK)
                return s;
            /* dW[c0:c0+nc] += G^T [nc, nr] . h[r0:r0+nr] [nr, D] */
            ml_gemm_shape g2 = gemm1(nc, D, nr, 1, 0, nc, D, D, 1.0);
            s = ml_matmul_cuda(dt, dt, (char *)dW + (size_t)(c0 * D) * es, scratch,
                               (const char *)h + (size_t)(r0 * D) * es, &g2, ctx);
            if (s != ML_OK)
                return s;
        }
    }
    return ML_OK;
}

extern "C" ml_status ml_ce_backward_cuda(ml_dtype dt, void *dh, void *dW, double dloss,
                                         const void *h, const void *W, const int64_t *targets,
                                         const double *lse, int64_t S, int64_t V, int64_t D,
                                         int64_t rows, int64_t vchunk, void *scratch,
                                         const ml_kctx *ctx)
{
    if (dt != ML_F32 && dt != ML_F64)
        return ML_EUNSUPPORTED;
    if (rows < 1 || rows > ML_CE_MAX_ROWS || vchunk < 1)
        return ML_EUNSUPPORTED;
    if (dt == ML_F32)
        return ce_backward<float>(dt, dh, dW, dloss, h, W, targets, lse, S, V, D, rows, vchunk,
                                  scratch, ctx);
    return ce_backward<double>(dt, dh, dW, dloss, h, W, targets, lse, S, V, D, rows, vchunk,
                               scratch, ctx);
}
