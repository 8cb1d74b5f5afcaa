/*
 * kernels/cuda_util.h - CUDA-backend services that are not kernels: the
 * last device error as text (a kernel returns ML_EDEVICE, the binding asks
 * here what happened) and the lazily loaded cuBLAS.
 *
 * C-compatible; only `make CUDA=1` builds compile the definitions
 * (kernels/cuda_util.cu, kernels/matmul.cu). Not here: allocation.
 */
#ifndef ML_KERNELS_CUDA_UTIL_H
#define ML_KERNELS_CUDA_UTIL_H

#ifdef __cplusplus
extern "C" {
#endif

/* Record an error of the CUDA runtime or a CUDA library: its name (e.g.
 * "cudaErrorMemoryAllocation", "cublas"), code and description. */
void ml_cuda_note_error(const char *name, int code, const char *what);
/* The last recorded error, e.g. "cudaErrorMemoryAllocation (2): out of
 * memory", or "" when none was recorded. Never NULL. */
const char *ml_cuda_error_string(void);

/* cuBLAS is opened with dlopen on the first matmul (libcublas.so.13, then
 * libcublas.so), so the binary starts where it is missing; matmul then
 * returns ML_EUNSUPPORTED and this says why. NULL when loaded or not yet tried. */
const char *ml_cublas_load_error(void);
/* Destroy the cuBLAS handle (shutdown; the next matmul creates a new one). */
void ml_cublas_release(void);

#ifdef __cplusplus
}
#endif

#endif
