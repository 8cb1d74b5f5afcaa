/*
 * kernels/matmul.h - (batched) matrix multiply through BLAS: on the CPU
 * kernels/gemm.h (oneDNN or OpenBLAS), cuBLAS on CUDA. Transposes are
 * flags, never copies.
 *
 * Row-major: C[b] = alpha * op(A[b]) * op(B[b]) + beta * C[b], where op(A)
 * is [m, k] (A stored [m, k] with leading dim lda, or [k, m] when ta), op(B)
 * is [k, n]; batch b at offsets b*sa, b*sb, b*sc elements. C accumulates
 * when beta != 0. A and B have dtype dt, C dtype cdt: (f32, f32) and
 * (f64, f64) on both backends; on CUDA also bf16 inputs with a bf16 or an
 * f32 C (mixed precision: activations and weights bf16, weight gradients
 * f32; the products summed in f32). Not bitwise stable across thread
 * counts or M (DESIGN.md): tests use normwise tolerances.
 */
#ifndef ML_KERNELS_MATMUL_H
#define ML_KERNELS_MATMUL_H

#include "core.h"

typedef struct {
    int64_t batch, m, n, k;
    int ta, tb;
    int64_t lda, ldb, ldc;
    int64_t sa, sb, sc;
    double alpha, beta;
} ml_gemm_shape;

ml_status ml_matmul_cpu(ml_dtype dt, ml_dtype cdt, void *c, const void *a, const void *b,
                        const ml_gemm_shape *s, const ml_kctx *ctx);
ml_status ml_matmul_cuda(ml_dtype dt, ml_dtype cdt, void *c, const void *a, const void *b,
                         const ml_gemm_shape *s, const ml_kctx *ctx);

/* count independent GEMMs in one go (CUDA only; kernels/experts.cu's
 * waves): problem i is C_i = alpha·op(A_i)·op(B_i) + beta·C_i with the
 * row-major shape s[i] (batch, sa, sb and sc unused) and the matrices
 * a[i], b[i], c[i], where a, b and c are DEVICE arrays of count pointers
 * (cuBLAS reads them on the context's stream: fill them there first). dt
 * and cdt as ml_matmul_cuda. The problems may run in any order or at
 * once: no C may overlap another problem's A, B or C. */
ml_status ml_matmul_grouped_cuda(ml_dtype dt, ml_dtype cdt, int64_t count, const ml_gemm_shape *s,
                                 const void *const *a, const void *const *b, void *const *c,
                                 const ml_kctx *ctx);

#endif
