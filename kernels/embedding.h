/*
 * kernels/embedding.h - token embedding lookup and its gradient.
 *
 * CPU: dt is ML_F32 or ML_F64. ids are int64 in [0, V) (the op checks).
 * The backward is deterministic without atomics: each tile owns a range of
 * vocabulary rows and scans the tokens in order, so dW[v] receives its
 * tokens' gradients in token order whatever the thread count (bitwise).
 *
 * CUDA (suffix _cuda, same arguments, pointers on the device): f32, f64
 * and bf16 (W, out and dout bf16; dW f32, ml_grad_dtype: the
 * mixed-precision weight gradient). The backward, without atomics or
 * scratch, gives each block a range of vocabulary rows that scans the ids
 * in order and sorts each tile of them by id (embedding.cu): the same adds
 * in the same order as the CPU, so f32 and f64 are bitwise equal to it,
 * and bf16 to the CPU's f32 kernel on the widened dout.
 *
 * Not here: allocation, Lua, range checks.
 */
#ifndef ML_KERNELS_EMBEDDING_H
#define ML_KERNELS_EMBEDDING_H

#include "core.h"

/* out [T, D] dt  =   W[ids[t]]
 * ids [T] int64, W [V, D] dt */
ml_status ml_embedding_forward_cpu(ml_dtype dt, void *out, const int64_t *ids, const void *W,
                                   int64_t T, int64_t V, int64_t D, const ml_kctx *ctx);
ml_status ml_embedding_forward_cuda(ml_dtype dt, void *out, const int64_t *ids, const void *W,
                                    int64_t T, int64_t V, int64_t D, const ml_kctx *ctx);

/* dW [V, D] gdt  +=  sum over t with ids[t] == v of dout[t], in token order,
 *                   gdt = ml_grad_dtype(dt) (f32 for bf16, else dt)
 * dout [T, D] dt, ids [T] int64 */
ml_status ml_embedding_backward_cpu(ml_dtype dt, void *dW, const void *dout, const int64_t *ids,
                                    int64_t T, int64_t V, int64_t D, const ml_kctx *ctx);
ml_status ml_embedding_backward_cuda(ml_dtype dt, void *dW, const void *dout, const int64_t *ids,
                                     int64_t T, int64_t V, int64_t D, const ml_kctx *ctx);

#endif
