/*
 * kernels/router.h - the MoE router, computed in chunks of tokens (issue 3;
 * DESIGN.md, Numerics): logits by moelua's own fixed-order kernel, scores,
 * fp64 softmax, top-k selection, combine weights, the per-expert sums the
 * model turns into the aux and z losses, and the recompute backward.
 *
 * Not here: capacity and dropping (dispatch decides; the router counts
 * assignments before any drop), the aux loss itself (the model forms it from
 * every layer's C_e and P_e), allocation (the caller passes the scratch),
 * Lua. The CPU variants are router.c, the CUDA twins router.cu (same
 * arguments, suffix _cuda; every pointer on the device except zsum and
 * entropy, which are host scalars on both backends, so the CUDA forward
 * synchronises its stream); both call the per-token math of router_ops.h.
 * CUDA computes logits, selection, dx and dwg in the CPU's order (bitwise),
 * and psum, zsum and entropy in fixed 64-token segments (deterministic and
 * chunk-invariant, not the CPU's order); its f64 exp/log/cos may differ
 * from glibc's by an ulp or two, so p, w and the sums agree to ~1e-12
 * relative.
 *
 * Shapes: x [T, D] and wg [E, D] (the Hugging Face Linear layout), both of
 * dtype dt (ML_F32 for training, ML_F64 for reference paths and gradient
 * checks; one implementation over the dtype); bias [E] of bias_dt (f32/f64).
 * CUDA also runs dt = ML_BF16 (mixed precision; the CPU refuses it with
 * ML_EUNSUPPORTED): x, wg, w, dw and dx are bf16, the router itself runs
 * in fp32 (DESIGN.md; Megatron's fp32 router likewise): the logits are the
 * same fixed-order f64 sums of exact bf16 products, rounded to f32 (not to
 * bf16), and everything after them is f64 as for f32; w and dx are rounded
 * to bf16 once on store (as Hugging Face Mixtral casts the routing weights
 * to the hidden dtype); dwg is f32 (ml_grad_dtype). So a bf16 call equals
 * the f32 call on the widened inputs with w and dx then rounded to bf16.
 *
 * Per token t (every quantity after the logits is in f64):
 *   l_e   = sum_d x[t,d] * wg[e,d]   products exact in f64 (an f32 x f32
 *           product fits), added into 8 interleaved partial sums (element d
 *           goes to sum d % 8), combined as ((s0+s1)+(s2+s3))+((s4+s5)+(s6+s7)),
 *           then rounded once to dt (to f32 for bf16: the fp32 router).
 *           The order depends on D only, never on the chunk size, the
 *           thread count or T: logits are bitwise invariant.
 *   lse   = logsumexp(l) over the RAW logits (max-subtracted);
 *           z-loss term zsum += lse^2 (ST-MoE).
 *   s_e   = l_e / tau  [+ noise * z_te]  [+ g_te if gumbel]
 *   p     = softmax(s) (max-subtracted, sums in f64 in expert order)
 *   p'_e  = (1 - eps) * p_e + eps / E
 *   selection: the k largest keys, ties to the lower expert index, written in
 *           descending key order; key_e = p'_e + b_e (SOFTMAX_TOPK) or
 *           s_e + b_e (TOPK_SOFTMAX); b is the optional aux-loss-free bias
 *           (DeepSeek-V3) and only ever touches the keys, never a weight.
 *   weights: SOFTMAX_TOPK, renorm: w_j = p'_sel_j / sum_i p'_sel_i (Mixtral)
 *            SOFTMAX_TOPK, no renorm: w_j = p'_sel_j
 *            TOPK_SOFTMAX: w_j = softmax over the k selected s (renorm is
 *            ignored: these weights already sum to 1)
 *   stats: counts[e] += 1 per selection (before any capacity drop),
 *          psum[e] += p'_e, entropy += -sum_e p'_e log p'_e.
 *
 * Temperature and eps preserve the order of the scores, so they change the
 * combine weights and the aux probabilities but never which experts are
 * selected; only gate noise and Gumbel sampling change the selection.
 *
 * Noise is a pure function of (seed, step, layer, token, expert), never
 * stored: chunking and the backward's recompute reproduce it. Philox-4x32-10
 * with key = (seed mod 2^32, seed >> 32) and counter
 *     c0 = token_offset + t (t the row of x; token_offset + T <= 2^32 - 1)
 *     c1 = step (< 2^32)
 *     c2 = (e / 4) << 2 | w               c3 = 0x80000000 | layer (< 2^31)
 * and lane e % 4, where word w = 0 and 1 give u1, u2 of the normal and w = 2
 * the Gumbel uniform. The set top bit of c3 keeps these counters apart from
 * moelua.rand / randn (c3 = 0). With r = lane >> 8 (24 bits):
 *     z = sqrt(-2 ln u1) cos(2 pi u2),  u1 = (r_0 + 1) 2^-24, u2 = r_1 2^-24
 *     g = -ln(-ln u),                   u  = (r_2 + 0.5) 2^-24, in (0, 1)
 * (the normal is moelua.randn's formula). token_offset (default 0) is the
 * position of x's first row in the step's token stream: a caller that routes
 * a batch in pieces (micro-batches, sequence shards) passes each piece's
 * first token, and the pieces draw exactly the noise one call on the whole
 * batch would. A NaN logit (or a NaN score from an infinite logit) is
 * ML_ENAN.
 *
 * Chunks: tokens are processed `chunk` at a time; only a [chunk, 4E + 2] f64
 * scratch is alive (never a [T, E] tensor). Within a chunk tokens run in
 * parallel fixed tiles; every sum across tokens (psum, zsum, entropy, dwg)
 * is added in token order into an accumulator carried across chunks, so
 * every output is bitwise identical for every chunk size and thread count.
 */
#ifndef ML_KERNELS_ROUTER_H
#define ML_KERNELS_ROUTER_H

#include "core.h"

typedef enum {
    ML_ROUTER_SOFTMAX_TOPK = 0,   /* softmax -> top-k (-> renormalise) */
    ML_ROUTER_TOPK_SOFTMAX = 1    /* top-k on the scores -> softmax over the k */
} ml_router_mode;

typedef struct {
    int64_t k;            /* experts per token, 1..E */
    int64_t chunk;        /* tokens per chunk, >= 1 */
    ml_router_mode mode;
    int renorm;           /* SOFTMAX_TOPK: weights sum to 1 */
    double temperature;   /* tau > 0 */
    double eps;           /* 0 <= eps < 1: uniform share mixed into p */
    double noise;         /* sigma >= 0: gate noise after the temperature */
    int gumbel;           /* add Gumbel(0, 1) to the scores */
    uint64_t seed, step, layer;
    uint64_t token_offset; /* noise counter of x's row 0: c0 = token_offset + t */
} ml_router_cfg;

/* Bytes of the scratch a call needs: chunk rows of 4E + 2 f64, plus (for
 * the backward) the [E, D] f64 accumulator of dwg. chunk is clamped to T. */
size_t ml_router_scratch_bytes(int64_t T, int64_t D, int64_t E, int64_t chunk, int backward);
/* Tokens per segment of the CUDA forward's psum / zsum / entropy (router.cu). */
#define ML_ROUTER_CUDA_SEG 64
/* The same for the CUDA twins: the CPU's bytes, then the call's flags (one
 * f64 slot) and, for the forward, the segment sums' workspace ((E + 2)·(2
 * + chunk / ML_ROUTER_CUDA_SEG + 2) f64). Plain C (router.c, every build),
 * so a plan of a CUDA run books it without CUDA. */
size_t ml_router_scratch_bytes_cuda(int64_t T, int64_t D, int64_t E, int64_t chunk, int backward);

/* Forward.
 *   idx    [T, k] int64   =   expert ids, descending key order
 *   w      [T, k] dt      =   combine weights
 *   counts [E] int64      +=  top-k assignments
 *   psum   [E] f64        +=  sum_t p'_te
 *   zsum, entropy (f64)   +=  sum_t lse_t^2, sum_t H(p'_t)
 *   bias   [E] bias_dt or NULL
 *   scratch of ml_router_scratch_bytes(T, D, E, chunk, 0) bytes, 8-aligned.
 * ML_ENAN on a NaN logit; ML_EINTERRUPTED between tiles. */
ml_status ml_router_forward_cpu(ml_dtype dt, int64_t *idx, void *w, int64_t *counts,
                                double *psum, double *zsum, double *entropy,
                                const void *x, const void *wg, ml_dtype bias_dt, const void *bias,
                                int64_t T, int64_t D, int64_t E, const ml_router_cfg *cfg,
                                void *scratch, const ml_kctx *ctx);

/* Backward by recompute: each chunk's logits, scores (same noise) and
 * probabilities are recomputed from x and wg; the saved idx is used, never a
 * new selection. The loss seen is
 *     L = sum_tj dw[t,j] w[t,j] + sum_te aux[e] p'_te + gz * sum_t lse_t^2
 * (dw: dL/dw, zero for dropped slots; aux: dL/dp'_te for every t, or NULL;
 * gz: dL/dzsum). Noise and Gumbel terms are constants.
 *   dx  [T, D] dt  +=  dL/dx (f64 sum, added and rounded once to dt)
 *   dwg [E, D] gdt +=  dL/dwg, summed per element in token order in the f64
 *                      accumulator at the end of the scratch, then added;
 *                      gdt = ml_grad_dtype(dt): f32 for bf16, else dt
 *   scratch of ml_router_scratch_bytes(T, D, E, chunk, 1) bytes, 8-aligned.
 * idx entries must be in [0, E) (the binding checks). On ML_ENAN (a NaN
 * logit in some chunk) dx may already hold the += of the chunks before it
 * (and dwg is not updated): the caller treats dx as spoiled. */
ml_status ml_router_backward_cpu(ml_dtype dt, void *dx, void *dwg, const int64_t *idx,
                                 const void *dw, const double *aux, double gz,
                                 const void *x, const void *wg,
                                 int64_t T, int64_t D, int64_t E, const ml_router_cfg *cfg,
                                 void *scratch, const ml_kctx *ctx);

/* Aux-loss-free balancing (DeepSeek-V3), after a step:
 *     b_e += gamma * sign(mean - C_e),  mean = sum_e C_e / E
 * so overloaded experts lose score and idle ones gain. bias [E] of dt
 * (f32/f64), updated in place; counts [E] int64. */
ml_status ml_router_update_bias_cpu(ml_dtype dt, void *bias, const int64_t *counts, int64_t E,
                                    double gamma, const ml_kctx *ctx);

/* The CUDA twins (router.cu; `make CUDA=1` builds only), with a scratch of
 * ml_router_scratch_bytes_cuda bytes. */
ml_status ml_router_forward_cuda(ml_dtype dt, int64_t *idx, void *w, int64_t *counts,
                                 double *psum, double *zsum, double *entropy,
                                 const void *x, const void *wg, ml_dtype bias_dt, const void *bias,
                                 int64_t T, int64_t D, int64_t E, const ml_router_cfg *cfg,
                                 void *scratch, const ml_kctx *ctx);
ml_status ml_router_backward_cuda(ml_dtype dt, void *dx, void *dwg, const int64_t *idx,
                                  const void *dw, const double *aux, double gz,
                                  const void *x, const void *wg,
                                  int64_t T, int64_t D, int64_t E, const ml_router_cfg *cfg,
                                  void *scratch, const ml_kctx *ctx);
ml_status ml_router_update_bias_cuda(ml_dtype dt, void *bias, const int64_t *counts, int64_t E,
                                     double gamma, const ml_kctx *ctx);

#endif
