/*
 * tests/tools/cuda_emu/emu_runtime.cpp - the emulator's runtime (emu.h) as
 * one object of the emulated build of the whole program (moelua.sh), with
 * what the kernels link to besides: cuBLAS's stand-in as ml_matmul_cuda
 * and ml_matmul_grouped_cuda (kernels/matmul.cu dlopens the real one) and
 * the launch error the host's cudaGetLastError reads (host_api.cpp).
 */
#include <cuda_runtime.h>   /* the emulator's stand-in (include/), which emu.h builds on */

#include "emu.h"

extern "C" {
#include "matmul.h"
}

extern "C" ml_status ml_matmul_cuda(ml_dtype dt, ml_dtype cdt, void *c, const void *a, const void *b,
                                    const ml_gemm_shape *s, const ml_kctx *ctx)
{
    if (s->batch <= 0 || s->m <= 0 || s->n <= 0)
        return ML_OK;
    return emu_cublas(dt, cdt, c, a, b, s, ctx);
}

extern "C" ml_status ml_matmul_grouped_cuda(ml_dtype dt, ml_dtype cdt, int64_t count, const ml_gemm_shape *s,
                                            const void *const *a, const void *const *b, void *const *c,
                                            const ml_kctx *ctx)
{
    return emu_cublas_grouped(dt, cdt, count, s, a, b, c, ctx);
}

extern "C" void ml_cublas_release(void) {}

extern "C" int emu_take_error(void) { return (int)cudaGetLastError(); }

extern "C" int emu_peek_error(void) { return (int)cudaPeekAtLastError(); }
