/*
 * kernels/matmul.cu - (batched) GEMM through cuBLAS (CUDA), row-major with
 * transposes as flags. cuBLAS is column-major, and a row-major [r, c]
 * matrix read column-major is its transpose, so C = op(A) op(B) is computed
 * as C^T = op(B)^T op(A)^T: operands swapped, m and n swapped, each
 * transpose flag kept. One cublas<S|D>gemmStridedBatched_64 call covers
 * the batch; bf16 inputs go through cublasGemmStridedBatchedEx_64 with
 * CUBLAS_COMPUTE_32F (products summed in f32, C in bf16 or f32).
 *
 * ml_matmul_grouped_cuda runs many problems of their own shapes at once
 * (experts.cu's waves): consecutive problems of one shape form a group,
 * and the groups go to one cublasGemmGroupedBatchedEx_64 call per 64
 * groups (f32, and bf16 into bf16 C); where cuBLAS's grouped GEMM refuses
 * the dtypes (bf16 into f32 C, f64) or is missing (cuBLAS < 12.5), each
 * group is one cublasGemmBatchedEx_64 call (also from the first time the
 * grouped GEMM says NOT_SUPPORTED on). Both read their pointer arrays from
 * the device.
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
    decltype(&cublasGemmBatchedEx_64) batched_ex;
    decltype(&cublasGemmGroupedBatchedEx_64) grouped_ex;   /* NULL before cuBLAS 12.5 */
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
    SYM(batched_ex, "cublasGemmBatchedEx_64")
#undef SYM
    /* optional */
    *(void **)&cb.status_string = dlsym(cb.lib, "cublasGetStatusString");
    *(void **)&cb.grouped_ex = dlsym(cb.lib, "cublasGemmGroupedBatchedEx_64");
    return 0;
}

extern "C" void ml_cublas_release(void)
{
    if (cb.handle) {
        cb.destroy(cb.handle);
        cb.handle = NULL;
    }
}

/* (f32, f32), (f64, f64) and bf16 into bf16 or f32 */
static int types_ok(ml_dtype dt, ml_dtype cdt)
{
    if (dt == ML_BF16)
        return cdt == ML_BF16 || cdt == ML_F32;
    return (dt == ML_F32 || dt == ML_F64) && cdt == dt;
}

/* cuBLAS loaded, its handle made and on the context's stream */
static ml_status ready(const ml_kctx *ctx)
{
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
    return cublas_status(cb.set_stream(cb.handle, ml_cuda_stream(ctx)));
}

/* What every entry does first: the dtypes checked, then (unless there is
 * nothing to compute) the interrupt and ready(). *go: the GEMMs are to run
 * (then ML_OK); else the status to return. */
static ml_status start(ml_dtype dt, ml_dtype cdt, int empty, const ml_kctx *ctx, int *go)
{
    *go = 0;
    if (!types_ok(dt, cdt))
        return ML_EUNSUPPORTED;
    if (empty)
        return ML_OK;
    if (ml_kctx_interrupted(ctx))
        return ML_EINTERRUPTED;
    ml_status st = ready(ctx);
    *go = st == ML_OK;
    return st;
}

static cudaDataType cuda_type(ml_dtype dt)
{
    return dt == ML_BF16 ? CUDA_R_16BF : dt == ML_F32 ? CUDA_R_32F : CUDA_R_64F;
}

static cublasOperation_t op(int t) { return t ? CUBLAS_OP_T : CUBLAS_OP_N; }

extern "C" ml_status ml_matmul_cuda(ml_dtype dt, ml_dtype cdt, void *c, const void *a,
                                    const void *b, const ml_gemm_shape *s, const ml_kctx *ctx)
{
    int go;
    ml_status st = start(dt, cdt, s->batch <= 0 || s->m <= 0 || s->n <= 0, ctx, &go);
    if (!go)
        return st;
    cublasOperation_t opa = op(s->ta), opb = op(s->tb);
    /* column-major: C^T [n, m] = op(B)^T [n, k] * op(A)^T [k, m] */
    if (dt == ML_BF16) {
        float alpha = (float)s->alpha, beta = (float)s->beta;
        st = cublas_status(cb.gemm_ex(cb.handle, opb, opa, s->n, s->m, s->k, &alpha, b, CUDA_R_16BF,
                                      s->ldb, s->sb, a, CUDA_R_16BF, s->lda, s->sa, &beta, c,
                                      cuda_type(cdt), s->ldc, s->sc, s->batch, CUBLAS_COMPUTE_32F,
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

/* ---- grouped ---------------------------------------------------------------------- */

#define GROUPS 64   /* groups per cublasGemmGroupedBatchedEx call */

static int same_shape(const ml_gemm_shape *x, const ml_gemm_shape *y)
{
    return x->m == y->m && x->n == y->n && x->k == y->k && x->ta == y->ta && x->tb == y->tb &&
           x->lda == y->lda && x->ldb == y->ldb && x->ldc == y->ldc && x->alpha == y->alpha &&
           x->beta == y->beta;
}

/* The groups of one cublasGemmGroupedBatchedEx call, in cuBLAS's
 * column-major terms (operands swapped as in ml_matmul_cuda), over the
 * problems [first, first + sum of size). */
struct groups {
    int64_t n, first, next;   /* next: the problem after the last group's */
    cublasOperation_t ta[GROUPS], tb[GROUPS];
    int64_t m[GROUPS], nn[GROUPS], k[GROUPS], lda[GROUPS], ldb[GROUPS], ldc[GROUPS], size[GROUPS];
    float alpha[GROUPS], beta[GROUPS];
};

/* problems [i, i + n) of shape s through one batched call */
static ml_status batched_run(ml_dtype dt, ml_dtype cdt, const ml_gemm_shape *s, int64_t n,
                             const void *const *a, const void *const *b, void *const *c)
{
    float af = (float)s->alpha, bf = (float)s->beta;
    int f64 = dt == ML_F64;
    ml_status st = cublas_status(cb.batched_ex(
        cb.handle, op(s->tb), op(s->ta), s->n, s->m, s->k, f64 ? (const void *)&s->alpha : &af, b,
        cuda_type(dt), s->ldb, a, cuda_type(dt), s->lda, f64 ? (const void *)&s->beta : &bf, c,
        cuda_type(cdt), s->ldc, n, f64 ? CUBLAS_COMPUTE_64F : CUBLAS_COMPUTE_32F,
        CUBLAS_GEMM_DEFAULT));
    return st != ML_OK ? st : ml_cuda_launched();
}

/* The groups' problems (of shapes s) through one grouped call (f32, or
 * bf16 into bf16). A cuBLAS that refuses it (NOT_SUPPORTED: its grouped
 * GEMM covers fewer dtypes on some versions and GPUs; nothing ran) is not
 * asked again: these groups and all later ones go through batched calls. */
static ml_status groups_run(groups &g, ml_dtype dt, const ml_gemm_shape *s, const void *const *a,
                            const void *const *b, void *const *c)
{
    if (!g.n)
        return ML_OK;
    cudaDataType t = cuda_type(dt);
    cublasStatus_t r = cb.grouped_ex(cb.handle, g.ta, g.tb, g.m, g.nn, g.k, g.alpha, b + g.first,
                                     t, g.lda, a + g.first, t, g.ldb, g.beta, c + g.first, t,
                                     g.ldc, g.n, g.size, CUBLAS_COMPUTE_32F);
    int64_t n = g.n;
    g.n = 0;
    if (r == CUBLAS_STATUS_NOT_SUPPORTED) {
        cb.grouped_ex = NULL;
        for (int64_t i = 0, p = g.first; i < n; p += g.size[i++]) {
            ml_status st = batched_run(dt, dt, &s[p], g.size[i], a + p, b + p, c + p);
            if (st != ML_OK)
                return st;
        }
        return ML_OK;
    }
    ml_status st = cublas_status(r);
    return st != ML_OK ? st : ml_cuda_launched();
}

extern "C" ml_status ml_matmul_grouped_cuda(ml_dtype dt, ml_dtype cdt, int64_t count,
                                            const ml_gemm_shape *s, const void *const *a,
                                            const void *const *b, void *const *c,
                                            const ml_kctx *ctx)
{
    int go;
    ml_status st = start(dt, cdt, count <= 0, ctx, &go);
    if (!go)
        return st;
    groups g;
    g.n = 0;
    for (int64_t i = 0, j; i < count; i = j) {
        int grouped = cb.grouped_ex && cdt == dt && dt != ML_F64;   /* (groups_run may refuse it) */
        for (j = i + 1; j < count && same_shape(&s[i], &s[j]); j++)
            ;
        if (s[i].m <= 0 || s[i].n <= 0)   /* nothing to compute */
            continue;
        if (!grouped) {
            if ((st = batched_run(dt, cdt, &s[i], j - i, a + i, b + i, c + i)) != ML_OK)
                return st;
            continue;
        }
        if (g.n && (g.n == GROUPS || g.next != i) && (st = groups_run(g, dt, s, a, b, c)) != ML_OK)
            return st;
        if (!g.n)
            g.first = i;
        int64_t n = g.n++;
        g.ta[n] = op(s[i].tb), g.tb[n] = op(s[i].ta);
        g.m[n] = s[i].n, g.nn[n] = s[i].m, g.k[n] = s[i].k;
        g.lda[n] = s[i].ldb, g.ldb[n] = s[i].lda, g.ldc[n] = s[i].ldc, g.size[n] = j - i;
        g.alpha[n] = (float)s[i].alpha, g.beta[n] = (float)s[i].beta;
        g.next = j;
    }
    return groups_run(g, dt, s, a, b, c);
}
