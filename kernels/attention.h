/*
 * kernels/attention.h - causal grouped-query attention, tiled in the
 * flash-attention style (issue 4, Model): memory O(S * D), never an S x S
 * matrix.
 *
 * Shapes (row-major, tokens first): q [S, H, hd], k and v [S, KV, hd],
 * out [S, H, hd], lse [H, S] f64. H % KV == 0; query head h reads kv head
 * h / (H / KV) (DESIGN.md, Numerics). Scale 1/sqrt(hd); query i attends to
 * keys j <= i.
 *
 * The forward also takes fewer queries than keys (decoding against a KV
 * cache): q [Sq, H, hd] holds the last Sq of Sk positions, so query i sits at
 * position P + i, P = Sk - Sq, and attends to keys j <= P + i. Each query
 * row walks the same key blocks in the same order as row P + i of the square
 * call, so f64 gives the same bits as that row; f32 differs only where the
 * tile sgemm's shape does (its M is the number of query rows).
 *
 * f64 (the reference; gradient checks run on it): per (head, block of 64
 * queries), key/value blocks of 64 rows stream through an online softmax
 * (running max and sum in f64); the log-sum-exp of every row is saved. A K/V
 * block of 64 x 128 f32 is 32 KiB, so a q block, a K block and a V block sit
 * in a 512 KiB L2. Backward: Drow_i = dout_i . out_i; dq by a pass over
 * (head, q block) that recomputes P_ij = exp(s_ij - lse_i) per key block; dk
 * and dv by a pass over (kv head, kv block), each owned by one tile that loops
 * over the group's query heads and the queries i >= j. Scores, softmax and
 * every accumulator are f64; each thread copies its blocks to its scratch as
 * f64 (K and V also transposed), so the inner loops vectorise over independent
 * outputs and no sum is reordered.
 *
 * f32: tiles of 128 queries x 128 keys, each product one serial sgemm of
 * kernels/gemm.h straight on the strided inputs (as in experts.c). Forward: S = scale Q_blk K_blkᵀ, online
 * softmax per row with the running max in f32 and the running sum in f64
 * (each tile's row sum in f32 over 16 fixed lanes), a vectorised f32 exp
 * (about 1 ulp), acc += P V_blk in f32, then out = acc / l and lse = m +
 * log l (f64). Backward: Drow as above (f64); per tile P is recomputed from
 * lse, dP = dO V_blkᵀ, dS = P (dP - Drow), then dv += Pᵀ dO, dk += scale
 * dSᵀ Q, dq += scale dS K, accumulated in place in the f32 outputs. When the
 * kv heads spread evenly over the threads (KV % nthreads == 0) one pass over
 * kv heads does all three (a tile owns its kv head's dk, dv and its group's
 * dq rows); otherwise dq by (head, q block) and dk, dv by (kv head, kv block),
 * each recomputing P. Both issue the same sgemms on the same operands in the
 * same order into every output, so they give the same bits. Against the f64
 * path: normwise error about 3e-7 (1e-5 is tested).
 *
 * No two tiles write the same element: no atomics, no races. Determinism:
 * every output is bitwise identical for a fixed thread count. The summation
 * order is fixed by the shapes and the block constants, never by the thread
 * count, so f64 is also bitwise identical across thread counts; f32 is too,
 * as long as a serial sgemm depends only on its shapes and operands (true of
 * OpenBLAS 0.3.21 and oneDNN 2.6, tests/c/test_gemm.c; the spec compares 1
 * and 4 threads for both dtypes).
 *
 * Scratch: the caller passes ml_attention_scratch_bytes(hd, Sq,
 * ctx->nthreads) bytes (8-aligned), for either dtype.
 *
 * CUDA (kernels/attention.cu): the same arguments and the f64 path's
 * summation order in 16 x 16 tiles, for f32, f64 and bf16 (bf16 in and out,
 * f32 accumulation; lse and drow stay f64). The CUDA kernels do not use
 * `scratch` (tiles live in shared memory): the op layer passes NULL, and
 * books nothing for it (the CUDA kernel table has no scratch size).
 *
 * Not here: allocation, Lua, RoPE (kernels/rope.h).
 */
#ifndef ML_KERNELS_ATTENTION_H
#define ML_KERNELS_ATTENTION_H

#include "core.h"

#define ML_ATT_HD_MAX 256

/* Bytes of scratch a forward or backward call over Sq query rows needs
 * with nthreads threads. */
size_t ml_attention_scratch_bytes(int64_t hd, int64_t Sq, int nthreads);

/* Forward.
 *   out [Sq, H, hd] dt   =
 *   lse [H, Sq] f64      =   log sum_j<=P+i exp(s_ij), saved for the backward
 *   q [Sq, H, hd] dt, k, v [Sk, KV, hd] dt; Sq <= Sk (Sq = Sk to train);
 *   1 <= hd <= ML_ATT_HD_MAX */
ml_status ml_attention_forward_cpu(ml_dtype dt, void *out, double *lse, const void *q,
                                   const void *k, const void *v, int64_t Sq, int64_t Sk,
                                   int64_t H, int64_t KV, int64_t hd, void *scratch,
                                   const ml_kctx *ctx);

/* Backward (square: the S queries of S keys).
 *   dq [S, H, hd] dt     =
 *   dk, dv [S, KV, hd] dt =
 *   drow [H, S] f64      =   scratch (dout_i . out_i)
 *   dout, out [S, H, hd] dt, lse [H, S] f64 from the forward */
ml_status ml_attention_backward_cpu(ml_dtype dt, void *dq, void *dk, void *dv, double *drow,
                                    const void *dout, const void *q, const void *k, const void *v,
                                    const void *out, const double *lse, int64_t S, int64_t H,
                                    int64_t KV, int64_t hd, void *scratch, const ml_kctx *ctx);

#ifdef ML_WITH_CUDA
ml_status ml_attention_forward_cuda(ml_dtype dt, void *out, double *lse, const void *q,
                                    const void *k, const void *v, int64_t Sq, int64_t Sk,
                                    int64_t H, int64_t KV, int64_t hd, void *scratch,
                                    const ml_kctx *ctx);
ml_status ml_attention_backward_cuda(ml_dtype dt, void *dq, void *dk, void *dv, double *drow,
                                     const void *dout, const void *q, const void *k, const void *v,
                                     const void *out, const double *lse, int64_t S, int64_t H,
                                     int64_t KV, int64_t hd, void *scratch, const ml_kctx *ctx);
#endif

#endif
