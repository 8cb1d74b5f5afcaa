/*
 * kernels/matmul.c - (batched) GEMM through kernels/gemm.h (oneDNN or
 * OpenBLAS by its rule, on their own threads), row-major, transposes as
 * flags. One GEMM per batch item, a large one in blocks of rows; the
 * interrupt flag is polled between them.
 */
#include "matmul.h"
#include "gemm.h"

/* A library call cannot be stopped, and a 9000^3 product takes seconds:
 * a GEMM of more than CHUNK_FLOP runs as equal blocks of rows of at most
 * that many FLOPs (0.1-0.4 s on two cores; each block packs B again, so
 * smaller blocks cost: 2048^3 in 476-row blocks ran at 0.90 of one call).
 * The model's GEMMs are far smaller and run whole. */
#define CHUNK_FLOP 32e9

ml_status ml_matmul_cpu(ml_dtype dt, ml_dtype cdt, void *c, const void *a, const void *b,
                        const ml_gemm_shape *s, const ml_kctx *ctx)
{
    if ((dt != ML_F32 && dt != ML_F64) || cdt != dt)
        return ML_EUNSUPPORTED;
    size_t es = ml_dtype_size(dt);
    double flop = 2.0 * (double)s->m * (double)s->n * (double)s->k;
    int64_t blocks = flop > CHUNK_FLOP ? (int64_t)(flop / CHUNK_FLOP) + 1 : 1;
    if (blocks > s->m)
        blocks = s->m;
    int64_t rows = blocks > 1 ? (s->m + blocks - 1) / blocks : s->m;
    for (int64_t i = 0; i < s->batch; i++) {
        for (int64_t r0 = 0; r0 < s->m; r0 += rows) {
            if (ml_kctx_interrupted(ctx))
                return ML_EINTERRUPTED;
            int64_t nr = s->m - r0 < rows ? s->m - r0 : rows;
            /* rows r0.. of op(A): rows of A, or columns when it is stored transposed */
            size_t a_off = (size_t)(i * s->sa + (s->ta ? r0 : r0 * s->lda));
            ml_gemm(dt, ML_GEMM_THREADED, s->ta, s->tb, nr, s->n, s->k, s->alpha,
                    (const char *)a + a_off * es, s->lda,
                    (const char *)b + (size_t)(i * s->sb) * es, s->ldb, s->beta,
                    (char *)c + (size_t)(i * s->sc + r0 * s->ldc) * es, s->ldc);
        }
    }
    return ML_OK;
}
