/*
 * kernels/cuda_util.h - CUDA-backend services that are not kernels: the
 * last device error as text (a kernel returns ML_EDEVICE, the op asks
 * here what happened), the debug switch that synchronises after every
 * launch, the device's SM count (grid sizing), and the lazily loaded
 * cuBLAS.
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
/* Record an error that has no code (e.g. cuBLAS could not be loaded). */
void ml_cuda_note_text(const char *what);
/* The last recorded error, e.g. "cudaErrorMemoryAllocation (2): out of
 * memory", or "" when none was recorded. Never NULL. */
const char *ml_cuda_error_string(void);

/* 1 when MOELUA_CUDA_SYNC=1 (read once): every launch check then waits for
 * the device, so a fault inside a kernel is reported by the call that
 * launched it instead of by some later copy. A debug mode: it serialises
 * the host with the device. */
int ml_cuda_sync_debug(void);

/* Multiprocessors of the current device (read once; 1 if the query fails). */
int ml_cuda_sm_count(void);

/* Destroy the cuBLAS handle (shutdown; the next matmul creates a new one). */
void ml_cublas_release(void);

#ifdef __cplusplus
}
#endif

#endif
