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
 * Forward: per (head, block of 64 queries), key/value blocks of 64
 * rows stream through an online softmax (running max and sum in f64); the
 * log-sum-exp of every row is saved. A K/V block of 64 x 128 f32 is 32 KiB,
 * so a q block, a K block and a V block sit in a 512 KiB L2.
 * Backward: Drow_i = dout_i . out_i; dq by a pass over (head, q block) that
 * recomputes P_ij = exp(s_ij - lse_i) per key block; dk and dv by a pass over
 * (kv head, kv block), each owned by one tile that loops over the group's
 * query heads and the queries i >= j. No two tiles write the same element,
 * so there are no atomics and no races.
 *
 * dt is ML_F32 or ML_F64; scores, softmax and every accumulator are f64,
 * rounded once to dt. The summation order is fixed by the shapes and the
 * block constants, never by the thread count: every output is bitwise
 * identical for every thread count.
 *
 * Scratch: the caller passes ml_attention_scratch_bytes(hd, ctx->nthreads)
 * bytes (8-aligned); each thread copies its blocks there as f64 (K and V also
 * transposed), so the inner loops vectorise over independent outputs and no
 * sum is reordered.
 *
 * Not here: allocation, Lua, RoPE (kernels/rope.h). CPU only so far (CUDA
 * twins: suffix _cuda).
 */
#ifndef ML_KERNELS_ATTENTION_H
#define ML_KERNELS_ATTENTION_H

#include "core.h"

#define ML_ATT_HD_MAX 256

/* Bytes of scratch a forward or backward call needs with nthreads threads. */
size_t ml_attention_scratch_bytes(int64_t hd, int nthreads);

/* Forward.
 *   out [S, H, hd] dt   =
 *   lse [H, S] f64      =   log sum_j<=i exp(s_ij), saved for the backward
 *   q [S, H, hd] dt, k, v [S, KV, hd] dt; 1 <= hd <= ML_ATT_HD_MAX */
ml_status ml_attention_forward_cpu(ml_dtype dt, void *out, double *lse, const void *q,
                                   const void *k, const void *v, int64_t S, int64_t H,
                                   int64_t KV, int64_t hd, void *scratch, const ml_kctx *ctx);

/* Backward.
 *   dq [S, H, hd] dt     =
 *   dk, dv [S, KV, hd] dt =
 *   drow [H, S] f64      =   scratch (dout_i . out_i)
 *   dout, out [S, H, hd] dt, lse [H, S] f64 from the forward */
ml_status ml_attention_backward_cpu(ml_dtype dt, void *dq, void *dk, void *dv, double *drow,
                                    const void *dout, const void *q, const void *k, const void *v,
                                    const void *out, const double *lse, int64_t S, int64_t H,
                                    int64_t KV, int64_t hd, void *scratch, const ml_kctx *ctx);

#endif
