/*
 * tests/c/test_gemm.c - the CPU's one GEMM (kernels/gemm.c), printing TAP,
 * on this machine's kernel paths (whatever OpenBLAS and oneDNN pick here;
 * the OPENBLAS_* variables are left as the environment has them).
 *
 * Covers, for every shape class moelua multiplies (square, the expert
 * tiles tall and skinny and their weight gradients, the attention tiles
 * with strided rows, M 64 A·Bᵀ, which stays on an AVX-512 OpenBLAS), every transpose
 * pair, alpha and beta, f32 and f64, serial and threaded: the normwise
 * error against an f64 reference; the library the rule picks; serial
 * results bitwise the same when repeated, when the operands move (4 bytes
 * off their alignment) and when two OpenMP threads run them side by side
 * (DESIGN.md, Numerics: a one-thread GEMM depends only on the shapes);
 * and k = 0 and empty outputs.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include <cblas.h>
#include <oneapi/dnnl/dnnl.h>

#include "../../kernels/gemm.h"
#include "tap.h"

typedef struct {
    const char *name;
    int64_t m, n, k;
    int ta, tb;
    int64_t lda, ldb, ldc;   /* 0: packed */
} shape;

/* moelua's GEMMs (D 512, F 1408, tile 256; attention FB 128, hd 64 in rows
 * of H·hd = 256) at a quarter of their sizes where a full one takes long */
static const shape shapes[] = {
    {"square A·B", 96, 96, 96, 0, 0, 0, 0, 0},
    {"square A·Bᵀ", 96, 96, 96, 0, 1, 0, 0, 0},
    {"expert h = x·gate_upᵀ", 256, 704, 128, 0, 1, 0, 0, 0},
    {"expert out = act·downᵀ", 256, 128, 352, 0, 1, 0, 0, 0},
    {"expert dact = dy·down", 256, 352, 128, 0, 0, 0, 0, 0},
    {"expert dx = dh·gate_up", 256, 128, 704, 0, 0, 0, 0, 0},
    {"expert dgate_up += dhᵀ·x", 704, 128, 256, 1, 0, 0, 0, 0},
    {"expert h, M 64 (serial: OpenBLAS if AVX-512)", 64, 704, 128, 0, 1, 0, 0, 0},
    {"expert, one row", 1, 352, 128, 0, 0, 0, 0, 0},
    {"attention s = q·kᵀ (strided)", 128, 128, 64, 0, 1, 256, 256, 128},
    {"attention o += p·v (strided)", 128, 64, 128, 0, 0, 128, 256, 64},
    {"attention dk += dsᵀ·q (strided)", 128, 64, 128, 1, 0, 128, 256, 256},
    {"Aᵀ·Bᵀ", 40, 72, 56, 1, 1, 0, 0, 0},
};

static int64_t lda_of(const shape *s) { return s->lda ? s->lda : s->ta ? s->m : s->k; }
static int64_t ldb_of(const shape *s) { return s->ldb ? s->ldb : s->tb ? s->k : s->n; }
static int64_t ldc_of(const shape *s) { return s->ldc ? s->ldc : s->n; }
static int64_t rows_a(const shape *s) { return s->ta ? s->k : s->m; }
static int64_t rows_b(const shape *s) { return s->tb ? s->n : s->k; }

static double urand(uint64_t *x)
{
    *x = *x * 6364136223846793005ull + 1442695040888963407ull;
    return (double)(*x >> 11) / 9007199254740992.0 * 2 - 1;
}

static double *randn(int64_t n, uint64_t seed)
{
    double *p = malloc((size_t)n * sizeof *p);
    for (int64_t i = 0; i < n; i++)
        p[i] = urand(&seed);
    return p;
}

static double at(const double *x, int64_t ld, int t, int64_t i, int64_t j)
{
    return t ? x[j * ld + i] : x[i * ld + j];
}

/* R = alpha·op(A)·op(B) + beta·C0 in f64; returns ||C - R|| / ||R|| for C. */
static double error(const shape *s, const void *c, ml_dtype dt, const double *a, const double *b,
                    const double *c0, double alpha, double beta)
{
    double num = 0, den = 0;
    int64_t lda = lda_of(s), ldb = ldb_of(s), ldc = ldc_of(s);
    for (int64_t i = 0; i < s->m; i++)
        for (int64_t j = 0; j < s->n; j++) {
            double r = 0;
            for (int64_t p = 0; p < s->k; p++)
                r += at(a, lda, s->ta, i, p) * at(b, ldb, s->tb, p, j);
            r = alpha * r + beta * c0[i * ldc + j];
            double v = dt == ML_F32 ? ((const float *)c)[i * ldc + j] : ((const double *)c)[i * ldc + j];
            num += (v - r) * (v - r);
            den += r * r;
        }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

/* n values of x in dt at dst (+ off elements) */
static void *as_dt(ml_dtype dt, const double *x, int64_t n, int64_t off)
{
    size_t es = dt == ML_F32 ? 4 : 8;
    char *p = calloc((size_t)(n + off + 1), es);
    for (int64_t i = 0; i < n; i++) {
        if (dt == ML_F32)
            ((float *)p)[off + i] = (float)x[i];
        else
            ((double *)p)[off + i] = x[i];
    }
    return p;
}

static void run(const shape *s, ml_dtype dt, ml_gemm_mode mode, int64_t off, double alpha,
                double beta, const double *a, const double *b, const double *c0, void **out)
{
    size_t es = dt == ML_F32 ? 4 : 8;
    int64_t na = rows_a(s) * lda_of(s), nb = rows_b(s) * ldb_of(s), nc = s->m * ldc_of(s);
    char *pa = as_dt(dt, a, na, off), *pb = as_dt(dt, b, nb, off), *pc = as_dt(dt, c0, nc, off);
    ml_gemm(dt, mode, s->ta, s->tb, s->m, s->n, s->k, alpha, pa + off * es, lda_of(s),
            pb + off * es, ldb_of(s), beta, pc + off * es, ldc_of(s));
    *out = malloc((size_t)nc * es);
    memcpy(*out, pc + off * es, (size_t)nc * es);
    free(pa), free(pb), free(pc);
}

static void check_shape(const shape *s, ml_dtype dt)
{
    const char *dn = dt == ML_F32 ? "f32" : "f64";
    double tol = dt == ML_F32 ? 2e-6 : 1e-14;
    int64_t na = rows_a(s) * lda_of(s), nb = rows_b(s) * ldb_of(s), nc = s->m * ldc_of(s);
    double *a = randn(na, 1 + (uint64_t)s->m), *b = randn(nb, 2 + (uint64_t)s->n),
           *c0 = randn(nc, 3 + (uint64_t)s->k);
    size_t bytes = (size_t)nc * (dt == ML_F32 ? 4 : 8);
    const double ab[][2] = {{1.0, 0.0}, {0.5, 1.0}};   /* C = A·B; C = 0.5·A·B + C */
    for (int v = 0; v < 2; v++) {
        for (int mode = 0; mode < 2; mode++) {
            void *c;
            run(s, dt, (ml_gemm_mode)mode, 0, ab[v][0], ab[v][1], a, b, c0, &c);
            double err = error(s, c, dt, a, b, c0, ab[v][0], ab[v][1]);
            ok(err <= tol, "%s %s %s alpha %g beta %g (%s): error %.2e <= %.0e", s->name, dn,
               mode == ML_GEMM_SERIAL ? "serial" : "threaded", ab[v][0], ab[v][1],
               ml_gemm_library(dt, (ml_gemm_mode)mode, s->ta, s->tb, s->m, s->k), err, tol);
            free(c);
        }
    }
    /* serial: repeated, moved by one element, and two threads side by side */
    void *c1, *c2, *c3, *par[2];
    run(s, dt, ML_GEMM_SERIAL, 0, 1.0, 1.0, a, b, c0, &c1);
    run(s, dt, ML_GEMM_SERIAL, 0, 1.0, 1.0, a, b, c0, &c2);
    run(s, dt, ML_GEMM_SERIAL, 1, 1.0, 1.0, a, b, c0, &c3);
    #pragma omp parallel num_threads(2)
    {
        int t = omp_get_thread_num();
        if (t < 2)
            run(s, dt, ML_GEMM_SERIAL, t, 1.0, 1.0, a, b, c0, &par[t]);
    }
    ok(!memcmp(c1, c2, bytes), "%s %s serial: bitwise repeatable", s->name, dn);
    ok(!memcmp(c1, c3, bytes), "%s %s serial: bitwise the same 1 element off alignment", s->name, dn);
    ok(!memcmp(c1, par[0], bytes) && !memcmp(c1, par[1], bytes),
       "%s %s serial: bitwise the same from two OpenMP threads at once", s->name, dn);
    free(c1), free(c2), free(c3), free(par[0]), free(par[1]);
    free(a), free(b), free(c0);
}

int main(void)
{
    printf("# %s\n", ml_gemm_describe());
    for (size_t i = 0; i < sizeof shapes / sizeof *shapes; i++) {
        check_shape(&shapes[i], ML_F32);
        check_shape(&shapes[i], ML_F64);
    }

    /* the rule: f64 on OpenBLAS everywhere; threaded f32 on oneDNN where
     * it is used (AVX2 and up); serial M 64 A·Bᵀ on OpenBLAS where its
     * kernel is AVX-512; on AVX2 alone, serial Aᵀ·B and A·B with K > 128 on
     * OpenBLAS */
    ok(!strcmp(ml_gemm_library(ML_F64, ML_GEMM_SERIAL, 0, 0, 4096, 64), "OpenBLAS"), "f64 goes to OpenBLAS");
    const char *core = openblas_get_corename();
    int blas512 = !strcasecmp(core, "SkylakeX") || !strcasecmp(core, "Cooperlake") ||
                  !strcasecmp(core, "SapphireRapids");
    unsigned isa = (unsigned)dnnl_get_effective_cpu_isa();
    int avx512 = (isa & dnnl_cpu_isa_avx512_core) == dnnl_cpu_isa_avx512_core;
    int avx2 = !avx512 && (isa & dnnl_cpu_isa_avx2) == dnnl_cpu_isa_avx2, used = avx512 || avx2;
    const char *dnn = used ? "oneDNN" : "OpenBLAS";
    const char *small = ml_gemm_library(ML_F32, ML_GEMM_SERIAL, 0, 1, 64, 512);
    ok(!strcmp(small, blas512 && !avx2 ? "OpenBLAS" : dnn),
       "f32 serial A·Bᵀ with few rows (M < 128) goes to %s (OpenBLAS kernel %s)", small, core);
    const char *big = ml_gemm_library(ML_F32, ML_GEMM_THREADED, 0, 0, 2048, 2048);
    const char *few = ml_gemm_library(ML_F32, ML_GEMM_THREADED, 0, 1, 256, 256);
    ok(!strcmp(big, dnn) && !strcmp(few, dnn),
       "f32 threaded 2048² A·B and 256-row A·Bᵀ go to %s, %s: oneDNN from AVX2 up, else OpenBLAS", big, few);
    const char *deep = ml_gemm_library(ML_F32, ML_GEMM_SERIAL, 0, 0, 256, 512);
    const char *nn = ml_gemm_library(ML_F32, ML_GEMM_SERIAL, 0, 0, 128, 128);
    const char *tn = ml_gemm_library(ML_F32, ML_GEMM_SERIAL, 1, 0, 128, 128);
    ok(!strcmp(deep, avx2 ? "OpenBLAS" : dnn) && !strcmp(nn, dnn) && !strcmp(tn, avx2 ? "OpenBLAS" : dnn),
       "f32 serial A·B with K 512 and 128, Aᵀ·B go to %s, %s, %s: with AVX2 alone only A·Bᵀ and A·B with "
       "K <= 128 on oneDNN", deep, nn, tn);

    /* k = 0: C = beta·C; empty outputs write nothing */
    float c[4] = {1, 2, 3, 4}, a1 = 7;
    ml_gemm(ML_F32, ML_GEMM_THREADED, 0, 0, 2, 2, 0, 1.0, &a1, 1, &a1, 2, 0.5, c, 2);
    ok(c[0] == 0.5f && c[3] == 2.0f, "k = 0 scales C by beta");
    ml_gemm(ML_F32, ML_GEMM_THREADED, 0, 0, 2, 2, 0, 1.0, &a1, 1, &a1, 2, 0.0, c, 2);
    ok(c[0] == 0 && c[1] == 0 && c[2] == 0 && c[3] == 0, "k = 0, beta 0 zeroes C");
    c[0] = 9;
    ml_gemm(ML_F32, ML_GEMM_SERIAL, 0, 0, 0, 2, 3, 1.0, &a1, 3, &a1, 2, 0.0, c, 2);
    ml_gemm(ML_F32, ML_GEMM_SERIAL, 0, 0, 2, 0, 3, 1.0, &a1, 3, &a1, 2, 0.0, c, 2);
    ok(c[0] == 9, "m = 0 or n = 0 writes nothing");
    return tap_done();
}
