/*
 * kernels/matmul.c - (batched) GEMM through OpenBLAS's CBLAS interface,
 * row-major, transposes as flags. One sgemm/dgemm per batch item; the
 * interrupt flag is polled between items.
 */
#include "matmul.h"

#include <cblas.h>

ml_status ml_matmul_cpu(ml_dtype dt, void *c, const void *a, const void *b,
                        const ml_gemm_shape *s, const ml_kctx *ctx)
{
    if (dt != ML_F32 && dt != ML_F64)
        return ML_EUNSUPPORTED;
    enum CBLAS_TRANSPOSE ta = s->ta ? CblasTrans : CblasNoTrans;
    enum CBLAS_TRANSPOSE tb = s->tb ? CblasTrans : CblasNoTrans;
    for (int64_t i = 0; i < s->batch; i++) {
        if (ml_kctx_interrupted(ctx))
            return ML_EINTERRUPTED;
        if (dt == ML_F32)
            cblas_sgemm(CblasRowMajor, ta, tb, (blasint)s->m, (blasint)s->n, (blasint)s->k,
                        (float)s->alpha, (const float *)a + i * s->sa, (blasint)s->lda,
                        (const float *)b + i * s->sb, (blasint)s->ldb,
                        (float)s->beta, (float *)c + i * s->sc, (blasint)s->ldc);
        else
            cblas_dgemm(CblasRowMajor, ta, tb, (blasint)s->m, (blasint)s->n, (blasint)s->k,
                        s->alpha, (const double *)a + i * s->sa, (blasint)s->lda,
                        (const double *)b + i * s->sb, (blasint)s->ldb,
                        s->beta, (double *)c + i * s->sc, (blasint)s->ldc);
    }
    return ML_OK;
}

void ml_matmul_set_threads_cpu(int n)
{
    openblas_set_num_threads(n);
}
