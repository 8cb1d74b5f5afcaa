/*
 * kernels/rope.h - rotary position embedding, rotate-half convention
 * (DESIGN.md, Numerics): pairs (i, i + hd/2), i < hd/2, of each head of
 * token s at position p = offset + s are rotated by the angle
 *     a_i = p * inv_freq_i,   inv_freq_i = theta^(-2i/hd)
 * computed in f64 (on the CPU, libm gives cos and sin of a 16-row tile's
 * first row, and each following row's are the previous row's rotated by
 * inv_freq_i in f64: at most about 3e-15 off by a tile's last row, below
 * the error of rounding p·inv_freq itself past the first positions; so a
 * row's last bits depend on its place in its tile, and a one-token decode
 * may differ from a prefill there); cos a_i and sin a_i are rounded once to
 * dt, and
 *     y[i]        = x[i] c - x[i + hd/2] s
 *     y[i + hd/2] = x[i + hd/2] c + x[i] s
 * is evaluated in f64 and rounded to dt. The backward is the inverse
 * rotation (the transpose). x may be q [S, H, hd] or k [S, KV, hd]: heads is
 * the middle dim. y may alias x (in place). Output is bitwise identical for
 * every thread count.
 *
 * CPU: f32, f64. CUDA (suffix _cuda, same arguments, pointers on the
 * device): f32, f64 and bf16 (cos and sin rounded to f32, the rotation in
 * f64, rounded to f32 and then to bf16); CUDA's pow/cos/sin differ from
 * glibc's by an ulp or two, so parity is a normwise tolerance.
 *
 * Not here: allocation, Lua.
 */
#ifndef ML_KERNELS_ROPE_H
#define ML_KERNELS_ROPE_H

#include "core.h"

/* y [S, heads, hd] dt  =  rotate(x [S, heads, hd] dt); hd even. */
ml_status ml_rope_forward_cpu(ml_dtype dt, void *y, const void *x, int64_t S, int64_t heads,
                              int64_t hd, int64_t offset, double theta, const ml_kctx *ctx);
ml_status ml_rope_forward_cuda(ml_dtype dt, void *y, const void *x, int64_t S, int64_t heads,
                               int64_t hd, int64_t offset, double theta, const ml_kctx *ctx);

/* dx [S, heads, hd] dt  =  rotate^-1(dy [S, heads, hd] dt) */
ml_status ml_rope_backward_cpu(ml_dtype dt, void *dx, const void *dy, int64_t S, int64_t heads,
                               int64_t hd, int64_t offset, double theta, const ml_kctx *ctx);
ml_status ml_rope_backward_cuda(ml_dtype dt, void *dx, const void *dy, int64_t S, int64_t heads,
                                int64_t hd, int64_t offset, double theta, const ml_kctx *ctx);

#endif
