/*
 * host/runtime/ops_nn.h - the op layer of the dense model's kernel families
 * (kernels/rmsnorm.h, embedding.h, crossentropy.h, rope.h, attention.h have
 * the semantics): each op checks its tensors (one device, the first
 * input's; one float dtype: f32 or f64, and bf16 where the device's kernel
 * table supports the family in bf16 (CUDA: rmsnorm, rope, embedding,
 * attention; cross-entropy stays f32/f64); contiguous; matching shapes; ids
 * in range), allocates the outputs it is given empty and its scratch
 * (host/runtime/op.h), calls the device's kernel through ML_KCALL and
 * releases the scratch before returning, on every path. A device whose kernel table lacks a
 * family answers ML_EUNSUPPORTED.
 *
 * Not here: Lua and options tables (host/bindings/l_ops.c binds these as
 * moelua.ops), modules and parameters (lua/moelua/nn).
 */
#ifndef ML_OPS_NN_H
#define ML_OPS_NN_H

#include "op.h"

/* The largest rope offset: positions stay exact integers in f64. */
#define ML_ROPE_OFFSET_MAX ((int64_t)1 << 52)

/* y [..., D] = x / rms(x) * w, rstd [N] f64 saved for the backward
 * (N = numel(x) / D); y and rstd are overwritten. eps >= 0. */
ml_status ml_op_rmsnorm_forward(ml_host *h, ml_tensor *y, ml_tensor *rstd, const ml_tensor *x,
                                const ml_tensor *w, double eps, ml_err *e);
/* dx (=) and dw [D] (+=; allocated as zeros when empty; of dtype
 * ml_grad_dtype(x's): f32 for bf16 x). */
ml_status ml_op_rmsnorm_backward(ml_host *h, ml_tensor *dx, ml_tensor *dw, const ml_tensor *dy,
                                 const ml_tensor *x, const ml_tensor *w, const ml_tensor *rstd,
                                 ml_err *e);

/* out [T, D] (=) = W[ids]; ids [T] i64 in [0, V), W [V, D]. */
ml_status ml_op_embedding_forward(ml_host *h, ml_tensor *out, const ml_tensor *ids,
                                  const ml_tensor *W, ml_err *e);
/* dW [V, D] (+=; of dtype ml_grad_dtype(dout's): f32 for bf16 dout) gets
 * dout [T, D] at the rows ids [T]; an empty dW is
 * allocated as zeros of V rows (V >= 1), a given one has its own V (the
 * argument is ignored). */
ml_status ml_op_embedding_backward(ml_host *h, ml_tensor *dW, const ml_tensor *dout,
                                   const ml_tensor *ids, int64_t V, ml_err *e);

/* *loss = mean cross-entropy of the logits hs [S, D] . W [V, D]^T against
 * targets [S] i64 in [0, V); lse [S] f64 (=) saved for the backward. rows
 * in [1, ML_CE_MAX_ROWS] and chunk >= 1 (vocabulary columns) size the
 * scratch block. Inside a plan *loss is 0. NaN logits: ML_ENAN. */
ml_status ml_op_cross_entropy_forward(ml_host *h, double *loss, ml_tensor *lse,
                                      const ml_tensor *hs, const ml_tensor *W,
                                      const ml_tensor *targets, int64_t rows, int64_t chunk,
                                      ml_err *e);
/* The backward of dloss * loss: dh [S, D] (=), dW [V, D] (+=; allocated as
 * zeros when empty); lse from the forward. */
ml_status ml_op_cross_entropy_backward(ml_host *h, ml_tensor *dh, ml_tensor *dW, double dloss,
                                       const ml_tensor *hs, const ml_tensor *W,
                                       const ml_tensor *targets, const ml_tensor *lse,
                                       int64_t rows, int64_t chunk, ml_err *e);

/* y (=) = x [S, heads, hd] rotated at positions offset + s (hd even,
 * offset in [0, ML_ROPE_OFFSET_MAX], theta > 1); y may be x. The backward
 * is the inverse rotation: dx (=) from dy. */
ml_status ml_op_rope_forward(ml_host *h, ml_tensor *y, const ml_tensor *x, int64_t offset,
                             double theta, ml_err *e);
ml_status ml_op_rope_backward(ml_host *h, ml_tensor *dx, const ml_tensor *dy, int64_t offset,
                              double theta, ml_err *e);

/* Causal grouped-query attention: out [S, H, hd] (=), lse [H, S] f64 (=)
 * from q [S, H, hd], k, v [Sk, KV, hd]; H % KV == 0, hd in [1, ML_ATT_HD_MAX].
 * Sk >= S: the queries are the last S positions (decoding against a KV
 * cache); the backward takes Sk = S only. */
ml_status ml_op_attention_forward(ml_host *h, ml_tensor *out, ml_tensor *lse, const ml_tensor *q,
                                  const ml_tensor *k, const ml_tensor *v, ml_err *e);
/* dq [S, H, hd], dk, dv [S, KV, hd] (all =) from dout, and out, lse of a
 * square forward (k, v [S, KV, hd]). */
ml_status ml_op_attention_backward(ml_host *h, ml_tensor *dq, ml_tensor *dk, ml_tensor *dv,
                                   const ml_tensor *dout, const ml_tensor *q, const ml_tensor *k,
                                   const ml_tensor *v, const ml_tensor *out, const ml_tensor *lse,
                                   ml_err *e);

#endif
