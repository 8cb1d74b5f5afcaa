/*
 * kernels/matmul.cu - (batched) GEMM through cuBLAS (CUDA), row-major with
 * transposes as flags. cuBLAS is column-major, and a row-major [r, c]
 * matrix read column-major is its transpose, so C = op(A) op(B) is computed
 * as C^T = op(B)^T op(A)^T: operands swapped, m and n swapped, each
 * transpose flag kept. One cublas<S|D>gemmStridedBatched_64 call covers
 * the batch; bf16 inputs go through cublasGemmStridedBatchedEx_64 with
 * CUBLAS_COMPUTE_32F (products summed in f32, C in bf16 or f32).
 *
 * cuBLAS is opened with dlopen on first use (libcublas.so.13, then
 * libcublas.so): the binary starts on a machine without it, and matmul
 * then returns ML_EDEVICE with the recorded error (ml_cuda_error_string)
 * saying why, e.g. the dlopen text "libcublas.so.13: cannot open shared
 * object file" (not ML_EUNSUPPORTED, which reads "dtype not supported"). The
 * handle uses CUBLAS_DEFAULT_MATH (no TF32), so f32 GEMMs are f32 GEMMs;
 * the order of the k-sum is cuBLAS's, hence normwise tolerances in tests.
 */
#include <dlfcn.h>
#include <stdio.h>

#include <cublas_v2.h>

#include "cuda_common.cuh"

extern "C" {
#include "matmul.h"
}

static struct {
    int tried;
    void *lib;
    cublasHandle_t handle;
    char error[256];
    decltype(&cublasCreate_v2) create;
    decltype(&cublasDestroy_v2) destroy;
    decltype(&cublasSetStream_v2) set_stream;
    decltype(&cublasSetMathMode) set_math_mode;
    decltype(&cublasSgemmStridedBatched_64) sgemm;
    decltype(&cublasDgemmStridedBatched_64) dgemm;
    decltype(&cublasGemmStridedBatchedEx_64) gemm_ex;
    decltype(&cublasGetStatusString) status_string;
} cb;

static ml_status cublas_status(cublasStatus_t s)
{
    if (s == CUBLAS_STATUS_SUCCESS)
        return ML_OK;
    ml_cuda_note_error("cublas", (int)s, cb.status_string ? cb.status_string(s) : "cuBLAS error");
    return ML_EDEVICE;
}

/* dlopen + dlsym once; 0 when cuBLAS is usable. */
static int cublas_load(void)
{
    if (cb.tried)
        return cb.lib ? 0 : -1;
    cb.tried = 1;
    const char *names[] = {"libcublas.so.13", "libcublas.so"};
    for (size_t i = 0; i < sizeof names / sizeof *names && !cb.lib; i++) {
        cb.lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
        const char *e = cb.lib ? NULL : dlerror();
        if (i == 0 && e)   /* the first name's failure says which library is missing */
            snprintf(cb.error, sizeof cb.error, "cannot load cuBLAS: %s", e);
    }
    if (!cb.lib)
        return -1;
    cb.error[0] = 0;   /* the fallback name loaded */
#define SYM(field, name)                                                             \
    if (!(*(void **)&cb.field = dlsym(cb.lib, name))) {                              \
        snprintf(cb.error, sizeof cb.error, "cuBLAS lacks %s", name);                \
        dlclose(cb.lib);                                                             \
        cb.lib = NULL;                                                               \
        return -1;                                                                   \
    }
    SYM(create, "cublasCreate_v2")
    SYM(destroy, "cublasDestroy_v2")
    SYM(set_stream, "cublasSetStream_v2")
    SYM(set_math_mode, "cublasSetMathMode")
    SYM(sgemm, "cublasSgemmStridedBatched_64")
    SYM(dgemm, "cublasDgemmStridedBatched_64")
    SYM(gemm_ex, "cublasGemmStridedBatchedEx_64")
#undef SYM
    *(void **)&cb.status_string = dlsym(cb.lib, "cublasGetStatusString");  /* optional */
    return 0;
}

extern "C" void ml_cublas_release(void)
{
    if (cb.handle) {
        cb.destroy(cb.handle);
        cb.handle = NULL;
    }
}

extern "C" ml_status ml_matmul_cuda(ml_dtype dt, ml_dtype cdt, void *c, const void *a,
                                    const void *b, const ml_gemm_shape *s, const ml_kctx *ctx)
{
    int mixed = dt == ML_BF16 && (cdt == ML_BF16 || cdt == ML_F32);
    if (!mixed && ((dt != ML_F32 && dt != ML_F64) || cdt != dt))
        return ML_EUNSUPPORTED;
    if (s->batch <= 0 || s->m <= 0 || s->n <= 0)
        return ML_OK;
    if (ml_kctx_interrupted(ctx))
        return ML_EINTERRUPTED;
    if (cublas_load() != 0) {
        /* noted on every call: a later CUDA error may have replaced the text */
        ml_cuda_note_text(cb.error[0] ? cb.error : "cannot load cuBLAS");
        return ML_EDEVICE;
    }
    ml_status st;
    if (!cb.handle) {
        if ((st = cublas_status(cb.create(&cb.handle))) != ML_OK) {
            cb.handle = NULL;
            return st;
        }
        if ((st = cublas_status(cb.set_math_mode(cb.handle, CUBLAS_DEFAULT_MATH))) != ML_OK)
            return st;
    }
    if ((st = cublas_status(cb.set_stream(cb.handle, ml_cuda_stream(ctx)))) != ML_OK)
        return st;
    cublasOperation_t opa = s->ta ? CUBLAS_OP_T : CUBLAS_OP_N;
    cublasOperation_t opb = s->tb ? CUBLAS_OP_T : CUBLAS_OP_N;
    /* column-major: C^T [n, m] = op(B)^T [n, k] * op(A)^T [k, m] */
    if (mixed) {
        float alpha = (float)s->alpha, beta = (float)s->beta;
        cudaDataType ct = cdt == ML_F32 ? CUDA_R_32F : CUDA_R_16BF;
        st = cublas_status(cb.gemm_ex(cb.handle, opb, opa, s->n, s->m, s->k, &alpha, b, CUDA_R_16BF,
                                      s->ldb, s->sb, a, CUDA_R_16BF, s->lda, s->sa, &beta, c, ct,
                                      s->ldc, s->sc, s->batch, CUBLAS_COMPUTE_32F,
                                      CUBLAS_GEMM_DEFAULT));
    } else if (dt == ML_F32) {
        float alpha = (float)s->alpha, beta = (float)s->beta;
        st = cublas_status(cb.sgemm(cb.handle, opb, opa, s->n, s->m, s->k, &alpha,
                                    (const float *)b, s->ldb, s->sb, (const float *)a, s->lda, s->sa,
                                    &beta, (float *)c, s->ldc, s->sc, s->batch));
    } else {
        st = cublas_status(cb.dgemm(cb.handle, opb, opa, s->n, s->m, s->k, &s->alpha,
                                    (const double *)b, s->ldb, s->sb, (const double *)a, s->lda, s->sa,
                                    &s->beta, (double *)c, s->ldc, s->sc, s->batch));
    }
    if (st != ML_OK)
        return st;
    return ml_cuda_launched();
}
