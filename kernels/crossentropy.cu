/*
 * kernels/crossentropy.cu - chunked LM-head cross-entropy (CUDA; see
 * crossentropy.h), the CPU's algorithm with cuBLAS for the logits: rows
 * `rows` at a time, the vocabulary `vchunk` columns at a time, each
 * [nr, nc] block of logits formed in the caller's scratch by ml_matmul_cuda.
 * f32, f64 and bf16. T is the storage type of h, W and dh, L = ml_float<T>::acc
 * the type of the logits, the target logits, dW and dh's sums: f32 for bf16
 * (cuBLAS forms the block from bf16 operands with f32 accumulation), else T.
 *
 * Forward. The device memory is lse [S] and the scratch, nothing more, so
 * the online log-sum-exp keeps one f64 per row, the running lse itself, in
 * lse: after each block, lse = M + log(exp(lse - M) + sum_c exp(x_c - M))
 * with M the max of lse and the block's row (one block of threads per row,
 * fixed-tree sums). Mathematically the CPU's (max, sum) pair; numerically
 * within a few f64 ulp of it. Then, rows at a time, each row's target logit
 * is formed in the scratch by a fixed-order f64 dot h[s] . W[targets[s]]
 * rounded to L (the CPU takes it from BLAS's block: the two differ by
 * about an ulp of the logit), lse and target logits are copied to the host,
 * and loss = (1/S) sum_s (lse[s] - logit) is added in row order in f64, as
 * on the CPU. A NaN lse (NaN or infinite logits) is ML_ENAN, as on the CPU.
 * The copy waits for the stream once per row chunk.
 *
 * Backward. As on the CPU, per block G = (exp(logit - lse) - onehot) *
 * dloss / S, then dh_rows (+)= G W_c (= for the first vocabulary chunk)
 * and dW_c += G^T h by cuBLAS. f32 and f64 form G in place of the logits
 * and sum dh in dh itself. bf16 rounds G into its bf16 copy in the
 * scratch (a GEMM's operands share a dtype; that rounding, at most 2^-8
 * of each G entry, is the one difference from f32 math), sums the row
 * chunk's dh in f32 in the scratch and rounds it into dh once, after the
 * last vocabulary chunk. V >= 1 (the op layer checks it).
 */
#include "cuda_float.cuh"

extern "C" {
#include "copy.h"
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

/* block[r, c] = h[r0 + r] . W[c0 + c] in ml_grad_dtype(dt), r < nr, c < nc
 * (ld = nc) */
static ml_status logits_block(ml_dtype dt, void *blk, const void *h, const void *W, int64_t r0,
                              int64_t nr, int64_t c0, int64_t nc, int64_t D, const ml_kctx *ctx)
{
    size_t es = ml_dtype_size(dt);
    ml_gemm_shape g = gemm1(nr, nc, D, 0, 1, D, D, nc, 0.0);
    return ml_matmul_cuda(dt, ml_grad_dtype(dt), blk, (const char *)h + (size_t)(r0 * D) * es,
                          (const char *)W + (size_t)(c0 * D) * es, &g, ctx);
}


/* One block per row r of the chunk: fold the block's logits into lse[r0+r]
 * (first: no earlier block, the running lse is -inf). */
template <typename L>
__global__ void __launch_bounds__(CE_THREADS)
ce_lse_kernel(double *lse, const L *blk, int64_t r0, int64_t nr, int64_t nc, int first)
{
    __shared__ double red[CE_THREADS];
    for (int64_t r = blockIdx.x; r < nr; r += gridDim.x) {
        const L *row = blk + r * nc;
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

/* out[r] = h[r0 + r] . W[targets[r0 + r]] in f64, rounded to the logits'
 * type L; one block per row. */
template <typename T, typename L = typename ml_float<T>::acc>
__global__ void __launch_bounds__(CE_THREADS)
ce_target_kernel(L *out, const T *h, const T *W, const int64_t *targets, int64_t r0, int64_t nr,
                 int64_t D)
{
    typedef ml_float<T> F;
    __shared__ double red[CE_THREADS];
    for (int64_t r = blockIdx.x; r < nr; r += gridDim.x) {
        const T *hr = h + (r0 + r) * D, *wr = W + targets[r0 + r] * D;
        double dot = 0;
        for (int64_t d = threadIdx.x; d < D; d += CE_THREADS)
            dot += (double)F::load(hr[d]) * (double)F::load(wr[d]);
        dot = ml_block_sum(red, dot);
        if (threadIdx.x == 0)
            out[r] = (L)dot;
    }
}

/* g[r, c] = (exp(blk[r, c] - lse) - onehot) * scale, one thread per entry;
 * g may be blk itself (f32, f64) or its bf16 copy */
template <typename T, typename L = typename ml_float<T>::acc>
__global__ void ce_grad_kernel(T *g, const L *blk, const double *lse, const int64_t *targets,
                               int64_t r0, int64_t nr, int64_t c0, int64_t nc, double scale)
{
    ML_CUDA_FOR(q, nr * nc) {
        int64_t r = q / nc, c = q % nc;
        double p = exp((double)blk[q] - lse[r0 + r]);
        g[q] = ml_float<T>::store((L)((p - (c0 + c == targets[r0 + r] ? 1.0 : 0.0)) * scale));
    }
}

static unsigned row_blocks(int64_t nr)
{
    return (unsigned)(nr < ML_CUDA_MAX_BLOCKS ? nr : ML_CUDA_MAX_BLOCKS);
}

/* loss from lse and the target logits, `rows` rows at a time through host
 * buffers, added in row order */
template <typename T, typename L = typename ml_float<T>::acc>
static ml_status ce_loss(double *loss, const double *lse, const T *h, const T *W,
                         const int64_t *targets, int64_t S, int64_t D, int64_t rows, L *scratch,
                         const ml_kctx *ctx)
{
    cudaStream_t st = ml_cuda_stream(ctx);
    double hl[ML_CE_MAX_ROWS];
    L ht[ML_CE_MAX_ROWS];
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

template <typename T, typename L = typename ml_float<T>::acc>
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
            ce_lse_kernel<L><<<row_blocks(nr), CE_THREADS, 0, st>>>(lse, (const L *)scratch, r0, nr,
                                                                   nc, c0 == 0);
            if ((s = ml_cuda_launched()) != ML_OK)
                return s;
        }
    }
    return ce_loss<T>(loss, lse, (const T *)h, (const T *)W, targets, S, D, rows, (L *)scratch, ctx);
}

extern "C" ml_status ml_ce_forward_cuda(ml_dtype dt, double *loss, double *lse, const void *h,
                                        const void *W, const int64_t *targets, int64_t S,
                                        int64_t V, int64_t D, int64_t rows, int64_t vchunk,
                                        void *scratch, const ml_kctx *ctx)
{
    if (dt != ML_F32 && dt != ML_F64 && dt != ML_BF16)
        return ML_EUNSUPPORTED;
    if (rows < 1 || rows > ML_CE_MAX_ROWS || vchunk < 1)
        return ML_EUNSUPPORTED;
    if (dt == ML_F32)
        return ce_forward<float>(dt, loss, lse, h, W, targets, S, V, D, rows, vchunk, scratch, ctx);
    if (dt == ML_BF16)
        return ce_forward<ml_bf16>(dt, loss, lse, h, W, targets, S, V, D, rows, vchunk, scratch,
                                   ctx);
    return ce_forward<double>(dt, loss, lse, h, W, targets, S, V, D, rows, vchunk, scratch, ctx);
}

/* dh[r0:r0+nr] = the f32 sums at acc, rounded to bf16 (copy.h's
 * conversion) */
static ml_status round_rows(void *dh, const void *acc, int64_t r0, int64_t nr, int64_t D,
                            const ml_kctx *ctx)
{
    int64_t n = nr * D, one = 1;
    return ml_copy_cuda(ML_BF16, (char *)dh + (size_t)(r0 * D) * sizeof(ml_bf16), &one, ML_F32,
                        acc, &one, 1, &n, ctx);
}

template <typename T, typename L = typename ml_float<T>::acc>
static ml_status ce_backward(ml_dtype dt, void *dh, void *dW, double dloss, const void *h,
                             const void *W, const int64_t *targets, const double *lse, int64_t S,
                             int64_t V, int64_t D, int64_t rows, int64_t vchunk, void *scratch,
                             const ml_kctx *ctx)
{
    cudaStream_t st = ml_cuda_stream(ctx);
    ml_dtype adt = ml_grad_dtype(dt);
    size_t es = sizeof(T), as = sizeof(L);
    ml_ce_scratch lay = ml_ce_scratch_layout(dt, S, V, D, rows, vchunk);
    bool mixed = dt == ML_BF16;
    T *g = mixed ? (T *)((char *)scratch + lay.copy) : (T *)scratch;
    double scale = S > 0 ? dloss / (double)S : 0.0;
    ml_status s;
    for (int64_t r0 = 0; r0 < S; r0 += rows) {
        int64_t nr = clamp(rows, S - r0);
        void *dsum = mixed ? (char *)scratch + lay.acc : (char *)dh + (size_t)(r0 * D) * es;
        for (int64_t c0 = 0; c0 < V; c0 += vchunk) {
            if (ml_kctx_interrupted(ctx))
                return ML_EINTERRUPTED;
            int64_t nc = clamp(vchunk, V - c0);
            if ((s = logits_block(dt, scratch, h, W, r0, nr, c0, nc, D, ctx)) != ML_OK)
                return s;
            ce_grad_kernel<T><<<ml_cuda_blocks(nr * nc, ML_CUDA_THREADS), ML_CUDA_THREADS, 0, st>>>(
                g, (const L *)scratch, lse, targets, r0, nr, c0, nc, scale);
            if ((s = ml_cuda_launched()) != ML_OK)
                return s;
            /* dsum (+)= G [nr, nc] . W[c0:c0+nc] [nc, D] */
            ml_gemm_shape g1 = gemm1(nr, D, nc, 0, 0, nc, D, D, c0 > 0 ? 1.0 : 0.0);
            s = ml_matmul_cuda(dt, adt, dsum, g, (const char *)W + (size_t)(c0 * D) * es, &g1, ctx);
            if (s != ML_OK)
                return s;
            /* dW[c0:c0+nc] += G^T [nc, nr] . h[r0:r0+nr] [nr, D] */
            ml_gemm_shape g2 = gemm1(nc, D, nr, 1, 0, nc, D, D, 1.0);
            s = ml_matmul_cuda(dt, adt, (char *)dW + (size_t)(c0 * D) * as, g,
                               (const char *)h + (size_t)(r0 * D) * es, &g2, ctx);
            if (s != ML_OK)
                return s;
        }
        if (mixed && (s = round_rows(dh, dsum, r0, nr, D, ctx)) != ML_OK)
            return s;
    }
    return ML_OK;
}

extern "C" ml_status ml_ce_backward_cuda(ml_dtype dt, void *dh, void *dW, double dloss,
                                         const void *h, const void *W, const int64_t *targets,
                                         const double *lse, int64_t S, int64_t V, int64_t D,
                                         int64_t rows, int64_t vchunk, void *scratch,
                                         const ml_kctx *ctx)
{
    if (dt != ML_F32 && dt != ML_F64 && dt != ML_BF16)
        return ML_EUNSUPPORTED;
    if (rows < 1 || rows > ML_CE_MAX_ROWS || vchunk < 1)
        return ML_EUNSUPPORTED;
    if (dt == ML_F32)
        return ce_backward<float>(dt, dh, dW, dloss, h, W, targets, lse, S, V, D, rows, vchunk,
                                  scratch, ctx);
    if (dt == ML_BF16)
        return ce_backward<ml_bf16>(dt, dh, dW, dloss, h, W, targets, lse, S, V, D, rows, vchunk,
                                    scratch, ctx);
    return ce_backward<double>(dt, dh, dW, dloss, h, W, targets, lse, S, V, D, rows, vchunk,
                               scratch, ctx);
}
