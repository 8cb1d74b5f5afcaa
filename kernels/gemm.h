/*
 * kernels/gemm.h - the CPU kernels' one GEMM: C = alpha·op(A)·op(B) +
 * beta·C, row-major, transposes as flags, f32 or f64. Every CPU kernel
 * that multiplies matrices (matmul, experts, attention) calls it, so the
 * library behind it is chosen in one place (BENCHMARKS.md, "GEMM libraries
 * on this machine", has the measurements behind the rule):
 *
 *   f64                                    OpenBLAS (oneDNN has no dgemm)
 *   f32, CPU below AVX2                    OpenBLAS (oneDNN not measured
 *                                          there)
 *   f32, threaded                          oneDNN's dnnl_sgemm (OpenBLAS's
 *                                          pool spins after each call against
 *                                          the kernels' threads: a training
 *                                          step is 4-9% faster without it)
 *   f32 serial, AVX-512 (oneDNN's          oneDNN (1.02-1.20× OpenBLAS), but
 *        avx512_core)                      OpenBLAS for A·Bᵀ with M < 128 if
 *                                          its own kernel is AVX-512 (oneDNN
 *                                          0.84-0.86× there at M 64; 1.4-1.8×
 *                                          OpenBLAS held to its AVX2 kernel)
 *   f32 serial, AVX2 only                  oneDNN for A·Bᵀ (1.0-1.45×
 *                                          OpenBLAS, a Zen 3) and A·B with
 *                                          K <= 128 (the attention's tiles:
 *                                          1.1-1.2×); OpenBLAS for Aᵀ·B
 *                                          (oneDNN 0.5-0.75×) and longer A·B
 *                                          (oneDNN 0.6-1.05×)
 *
 * The rule reads only the dtype, the flags, M, K and the thread mode, the
 * machine's ISA and OpenBLAS's kernel (which OPENBLAS_CORETYPE may set), so
 * a given machine and environment always send a shape to the same
 * library. Both libraries' one-thread results depend only on the shapes
 * (DESIGN.md, Numerics; checked for both in BENCHMARKS.md), so kernels
 * that run one GEMM per thread stay bitwise repeatable for every thread
 * count; threaded GEMMs depend on the thread count, as before.
 *
 * Threads: a GEMM is either serial (one thread: the caller's, which may be
 * one of a kernel's OpenMP threads) or threaded (the libraries' own
 * threads, ml_gemm_set_threads). Kernels that run GEMMs side by side on
 * their own threads bracket their region with ml_gemm_serial_begin/end.
 */
#ifndef ML_KERNELS_GEMM_H
#define ML_KERNELS_GEMM_H

#include "core.h"

typedef enum { ML_GEMM_THREADED, ML_GEMM_SERIAL } ml_gemm_mode;

/* C [m, n] = alpha·op(A) [m, k]·op(B) [k, n] + beta·C; ta/tb: 1 = the
 * operand is stored transposed; lda/ldb/ldc are the row strides. m, n, k
 * >= 0; k = 0 sets C = beta·C. dt: ML_F32 or ML_F64 (else nothing). */
void ml_gemm(ml_dtype dt, ml_gemm_mode mode, int ta, int tb, int64_t m, int64_t n, int64_t k,
             double alpha, const void *a, int64_t lda, const void *b, int64_t ldb, double beta,
             void *c, int64_t ldc);

/* The threads of threaded GEMMs (OpenBLAS's pool and the calling thread's
 * OpenMP team size, which oneDNN uses). */
void ml_gemm_set_threads(int n);

/* Around a kernel region whose threads each run serial GEMMs: OpenBLAS's
 * pool set to one thread (its threads would spin against the kernel's),
 * restored by ml_gemm_serial_end with begin's value. */
int ml_gemm_serial_begin(void);
void ml_gemm_serial_end(int saved);

/* Which library an f32 GEMM of this kind goes to on this machine:
 * "oneDNN" or "OpenBLAS"; and a line naming both libraries, their
 * versions and kernel paths (benchmark tables print it). */
const char *ml_gemm_library(ml_dtype dt, ml_gemm_mode mode, int ta, int tb, int64_t m, int64_t k);
const char *ml_gemm_describe(void);

#endif
