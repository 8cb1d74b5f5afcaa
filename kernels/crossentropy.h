/*
 * kernels/crossentropy.h - the LM head fused with cross-entropy, computed in
 * chunks so the [S, V] logits never exist at once (issue 4, Model).
 *
 * For hidden states h [S, D], head weight W [V, D] (Hugging Face Linear
 * layout) and targets [S] int64 in [0, V):
 *     logits[s, v] = h[s] . W[v]          (BLAS, rounded to dt)
 *     lse[s]       = logsumexp_v logits[s, v]   (f64, online over chunks)
 *     loss         = (1/S) sum_s (lse[s] - logits[s, targets[s]])   (f64,
 *                    added in row order)
 * Rows go `rows` at a time and the vocabulary `vchunk` columns at a time;
 * only a [rows, vchunk] dt block of logits (the caller's scratch) is alive.
 * The backward recomputes each block and forms G = (softmax - onehot) *
 * dloss / S in it, then dh += G W_c and dW_c += G^T h by BLAS.
 *
 * Numerics: the logits come from BLAS (sgemm/dgemm), whose summation order
 * depends on the GEMM thread count and the block shape, so neither the
 * loss nor the gradients are promised bitwise across thread counts or chunk
 * sizes; they agree to a normwise tolerance (the specs state it). Everything
 * after the logits is f64.
 *
 * CUDA (suffix _cuda, same arguments; every pointer on the device except
 * loss, a host pointer): f32, f64 and bf16, the same chunks with cuBLAS
 * logits. bf16 (mixed precision, DESIGN.md Numerics): h, W and dh are
 * bf16, dW is f32 (ml_grad_dtype); each block of logits is formed in f32
 * from the bf16 operands (f32 accumulation), and everything after it runs
 * as for f32. The backward rounds each block's G to a bf16 copy (a GEMM's
 * operands share a dtype), sums dh in f32 over the vocabulary and rounds
 * it once. The CPU refuses bf16 (ML_EUNSUPPORTED).
 * The running log-sum-exp is kept in lse itself and the target logit is a
 * fixed-order f64 dot rounded to dt (crossentropy.cu); the forward waits
 * for the stream to add the loss on the host. Parity with the CPU is a
 * normwise tolerance.
 *
 * Not here: allocation, Lua, range checks of targets (the binding does).
 */
#ifndef ML_KERNELS_CROSSENTROPY_H
#define ML_KERNELS_CROSSENTROPY_H

#include "core.h"

#define ML_CE_MAX_ROWS 1024

/* The scratch: the [rows, vchunk] block of logits (each clamped to S, V)
 * in dt, in f32 for bf16. For bf16 the backward also needs, at these byte
 * offsets, dh's f32 sums over the vocabulary [rows, D] (acc) and the bf16
 * copy of the block (copy); f32 and f64 use neither. bytes: the total. */
typedef struct {
    size_t acc, copy, bytes;
} ml_ce_scratch;
ml_ce_scratch ml_ce_scratch_layout(ml_dtype dt, int64_t S, int64_t V, int64_t D, int64_t rows,
                                   int64_t vchunk);
/* Bytes of scratch both kernels need (a plan books it without a GPU). */
size_t ml_ce_scratch_bytes(ml_dtype dt, int64_t S, int64_t V, int64_t D, int64_t rows,
                           int64_t vchunk);

/* Forward.
 *   loss    (f64)      =   mean over the S rows
 *   lse     [S] f64    =   saved for the backward
 *   h [S, D] dt, W [V, D] dt, targets [S] int64; V >= 1,
 *   1 <= rows <= ML_CE_MAX_ROWS, vchunk >= 1; scratch of
 *   ml_ce_scratch_bytes(...) bytes, 8-byte aligned. */
ml_status ml_ce_forward_cpu(ml_dtype dt, double *loss, double *lse, const void *h, const void *W,
                            const int64_t *targets, int64_t S, int64_t V, int64_t D, int64_t rows,
                            int64_t vchunk, void *scratch, const ml_kctx *ctx);
ml_status ml_ce_forward_cuda(ml_dtype dt, double *loss, double *lse, const void *h, const void *W,
                             const int64_t *targets, int64_t S, int64_t V, int64_t D, int64_t rows,
                             int64_t vchunk, void *scratch, const ml_kctx *ctx);

/* Backward of loss scaled by dloss.
 *   dh [S, D] dt                  =   dloss/S * (softmax - onehot) W
 *   dW [V, D] ml_grad_dtype(dt)   +=  dloss/S * (softmax - onehot)^T h
 *   lse [S] f64 from the forward (same h, W). */
ml_status ml_ce_backward_cpu(ml_dtype dt, void *dh, void *dW, double dloss, const void *h,
                             const void *W, const int64_t *targets, const double *lse, int64_t S,
                             int64_t V, int64_t D, int64_t rows, int64_t vchunk, void *scratch,
                             const ml_kctx *ctx);
ml_status ml_ce_backward_cuda(ml_dtype dt, void *dh, void *dW, double dloss, const void *h,
                              const void *W, const int64_t *targets, const double *lse, int64_t S,
                              int64_t V, int64_t D, int64_t rows, int64_t vchunk, void *scratch,
                              const ml_kctx *ctx);

#endif
