/*
 * kernels/matmul.c - (batched) GEMM through kernels/gemm.h (oneDNN or
 * OpenBLAS by its rule, on their own threads), row-major, transposes as
 * flags. One GEMM per batch item; the interrupt flag is polled between
 * items.
 */
#include "matmul.h"
#include "gemm.h"

ml_status ml_matmul_cpu(ml_dtype dt, ml_dtype cdt, void *c, const void *a, const void *b,
                        const ml_gemm_shape *s, const ml_kctx *ctx)
{
    if ((dt != ML_F32 && dt != ML_F64) || cdt != dt)
        return ML_EUNSUPPORTED;
    size_t es = ml_dtype_size(dt);
    for (int64_t i = 0; i < s->batch; i++) {
        if (ml_kctx_interrupted(ctx))
            return ML_EINTERRUPTED;
        ml_gemm(dt, ML_GEMM_THREADED, s->ta, s->tb, s->m, s->n, s->k, s->alpha,
                (const char *)a + (size_t)(i * s->sa) * es, s->lda,
                (const char *)b + (size_t)(i * s->sb) * es, s->ldb, s->beta,
                (char *)c + (size_t)(i * s->sc) * es, s->ldc);
    }
    return ML_OK;
}
