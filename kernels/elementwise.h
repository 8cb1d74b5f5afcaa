/*
 * kernels/elementwise.h - fill, arange, binary ops with broadcasting over
 * leading dims, scalar ops and unary ops. One signature, two backends.
 *
 * All buffers are contiguous and of one dtype. Outputs are overwritten (=);
 * out may alias a (in-place variants). Integer dtypes compute through f64:
 * i64 is exact up to 2^53, and results saturate at the dtype's range.
 * bf16 (CUDA only; the CPU says ML_EUNSUPPORTED) computes in f32 and
 * rounds to nearest even once, on store.
 */
#ifndef ML_KERNELS_ELEMENTWISE_H
#define ML_KERNELS_ELEMENTWISE_H

#include "core.h"

typedef enum { ML_ADD, ML_SUB, ML_MUL, ML_DIV, ML_MAX, ML_MIN, ML_NBINOPS } ml_binop;
typedef enum {
    ML_EXP, ML_LOG, ML_SQRT, ML_RSQRT, ML_SILU, ML_SIGMOID, ML_TANH, ML_NEG, ML_ABS, ML_NUNOPS
} ml_unop;

/* out[i] = v, i < n. Any dtype. */
ml_status ml_fill_cpu(ml_dtype dt, void *out, double v, int64_t n, const ml_kctx *ctx);
ml_status ml_fill_cuda(ml_dtype dt, void *out, double v, int64_t n, const ml_kctx *ctx);

/* out[i] = start + i*step, computed in f64 and rounded once. Any dtype. */
ml_status ml_arange_cpu(ml_dtype dt, void *out, double start, double step, int64_t n, const ml_kctx *ctx);
ml_status ml_arange_cuda(ml_dtype dt, void *out, double start, double step, int64_t n, const ml_kctx *ctx);

/* out[i] = a[i % na] op b[i % nb], i < n, with na and nb dividing n: a tensor
 * broadcasts over the leading dims of the other. f32, f64, i32, i64; bf16
 * on CUDA. */
ml_status ml_binary_cpu(ml_binop op, ml_dtype dt, void *out, const void *a, const void *b,
                        int64_t n, int64_t na, int64_t nb, const ml_kctx *ctx);
ml_status ml_binary_cuda(ml_binop op, ml_dtype dt, void *out, const void *a, const void *b,
                         int64_t n, int64_t na, int64_t nb, const ml_kctx *ctx);

/* out[i] = a[i] op s, or s op a[i] when reverse. f32, f64, i32, i64; bf16
 * on CUDA (s as an f32, as for f32). */
ml_status ml_binary_scalar_cpu(ml_binop op, ml_dtype dt, void *out, const void *a, double s,
                               int reverse, int64_t n, const ml_kctx *ctx);
ml_status ml_binary_scalar_cuda(ml_binop op, ml_dtype dt, void *out, const void *a, double s,
                                int reverse, int64_t n, const ml_kctx *ctx);

/* out[i] = f(a[i]). f32, f64, bf16 on CUDA (ML_NEG and ML_ABS also i32,
 * i64). */
ml_status ml_unary_cpu(ml_unop op, ml_dtype dt, void *out, const void *a, int64_t n, const ml_kctx *ctx);
ml_status ml_unary_cuda(ml_unop op, ml_dtype dt, void *out, const void *a, int64_t n, const ml_kctx *ctx);

#endif
