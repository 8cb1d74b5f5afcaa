/*
 * kernels/gemm.c - the rule of kernels/gemm.h over OpenBLAS (cblas) and
 * oneDNN (dnnl_sgemm, row-major like moelua; its OpenMP runtime is the
 * libgomp the kernels use, so inside a kernel's parallel region it runs on
 * the calling thread).
 */
#include "gemm.h"

#include <cblas.h>
#include <omp.h>
#include <oneapi/dnnl/dnnl.h>

#include <stdio.h>
#include <strings.h>

/* What this machine's libraries run, asked once (threads may ask at once,
 * and agree): ONEDNN_AVX512, oneDNN has AVX-512 (avx512_core), where it was
 * measured to win; ONEDNN_AVX2, it has AVX2 and no AVX-512, where it wins
 * some shapes; OPENBLAS_AVX512, OpenBLAS's kernel is AVX-512 too, the only
 * case in which it was measured to win anything on an AVX-512 machine
 * (serial A·Bᵀ with few rows). The environment may hold OpenBLAS to an
 * AVX2 kernel on an AVX-512 machine (OPENBLAS_CORETYPE): there oneDNN is
 * 1.4-1.8x it on those shapes. */
enum { ONEDNN_AVX512 = 1, ONEDNN_AVX2 = 2, OPENBLAS_AVX512 = 4 };

static int machine(void)
{
    static int state;   /* 0: not asked yet, else 8 | the bits */
    int s;
    #pragma omp atomic read
    s = state;
    if (!s) {
        const char *core = openblas_get_corename();
        unsigned isa = (unsigned)dnnl_get_effective_cpu_isa();
        s = 8;
        if ((isa & dnnl_cpu_isa_avx512_core) == dnnl_cpu_isa_avx512_core)
            s |= ONEDNN_AVX512;
        else if ((isa & dnnl_cpu_isa_avx2) == dnnl_cpu_isa_avx2)
            s |= ONEDNN_AVX2;
        if (!strcasecmp(core, "SkylakeX") || !strcasecmp(core, "Cooperlake") ||
            !strcasecmp(core, "SapphireRapids"))
            s |= OPENBLAS_AVX512;
        #pragma omp atomic write
        state = s;
    }
    return s;
}

static int use_onednn(ml_dtype dt, ml_gemm_mode mode, int ta, int tb, int64_t m, int64_t k)
{
    int s = machine();
    if (dt != ML_F32 || !(s & (ONEDNN_AVX512 | ONEDNN_AVX2)))
        return 0;
    /* threaded calls never go to OpenBLAS: its pool spins (sched_yield)
     * after each call and takes the cores from the OpenMP threads next */
    if (mode == ML_GEMM_THREADED)
        return 1;
    if (s & ONEDNN_AVX512)
        return !(!ta && tb && m < 128 && (s & OPENBLAS_AVX512));
    /* AVX2 alone (a Zen 3): oneDNN wins A·Bᵀ and A·B with a short K (the
     * attention's tiles); its Aᵀ·B runs at 0.5-0.75x OpenBLAS's, and its
     * A·B falls to 0.6x on some shapes (N 1024) */
    return !ta && (tb || k <= 128);
}

/* C = beta·C for k = 0 (neither library is asked: BLAS leaves k = 0 to
 * the implementation's care). */
static void scale_c(ml_dtype dt, int64_t m, int64_t n, double beta, void *c, int64_t ldc)
{
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < n; j++) {
            if (dt == ML_F32) {
                float *p = (float *)c + i * ldc + j;
                *p = beta == 0 ? 0.0f : (float)beta * *p;
            } else {
                double *p = (double *)c + i * ldc + j;
                *p = beta == 0 ? 0.0 : beta * *p;
            }
        }
}

void ml_gemm(ml_dtype dt, ml_gemm_mode mode, int ta, int tb, int64_t m, int64_t n, int64_t k,
             double alpha, const void *a, int64_t lda, const void *b, int64_t ldb, double beta,
             void *c, int64_t ldc)
{
    if ((dt != ML_F32 && dt != ML_F64) || m <= 0 || n <= 0)
        return;
    if (k <= 0) {
        scale_c(dt, m, n, beta, c, ldc);
        return;
    }
    if (use_onednn(dt, mode, ta, tb, m, k)) {
        /* serial outside a parallel region: a team of one for this call */
        int team = mode == ML_GEMM_SERIAL && !omp_in_parallel() ? omp_get_max_threads() : 0;
        if (team)
            omp_set_num_threads(1);
        dnnl_sgemm(ta ? 'T' : 'N', tb ? 'T' : 'N', m, n, k, (float)alpha, a, lda, b, ldb,
                   (float)beta, c, ldc);
        if (team)
            omp_set_num_threads(team);
        return;
    }
    enum CBLAS_TRANSPOSE TA = ta ? CblasTrans : CblasNoTrans, TB = tb ? CblasTrans : CblasNoTrans;
    if (dt == ML_F32)
        cblas_sgemm(CblasRowMajor, TA, TB, (blasint)m, (blasint)n, (blasint)k, (float)alpha, a,
                    (blasint)lda, b, (blasint)ldb, (float)beta, c, (blasint)ldc);
    else
        cblas_dgemm(CblasRowMajor, TA, TB, (blasint)m, (blasint)n, (blasint)k, alpha, a,
                    (blasint)lda, b, (blasint)ldb, beta, c, (blasint)ldc);
}

void ml_gemm_set_threads(int n)
{
    openblas_set_num_threads(n);
    omp_set_num_threads(n);
}

int ml_gemm_serial_begin(void)
{
    int n = openblas_get_num_threads();
    openblas_set_num_threads(1);
    return n;
}

void ml_gemm_serial_end(int saved)
{
    openblas_set_num_threads(saved);
}

const char *ml_gemm_library(ml_dtype dt, ml_gemm_mode mode, int ta, int tb, int64_t m, int64_t k)
{
    return use_onednn(dt, mode, ta, tb, m, k) ? "oneDNN" : "OpenBLAS";
}

const char *ml_gemm_describe(void)
{
    static char line[160];
    const dnnl_version_t *v = dnnl_version();
    snprintf(line, sizeof line, "%s(%s); oneDNN %d.%d.%d (isa 0x%x)%s",
             OPENBLAS_VERSION + 1, openblas_get_corename(), v->major, v->minor, v->patch,
             (unsigned)dnnl_get_effective_cpu_isa(),
             machine() & (ONEDNN_AVX512 | ONEDNN_AVX2) ? "" : ": not used below AVX2");
    return line;
}
