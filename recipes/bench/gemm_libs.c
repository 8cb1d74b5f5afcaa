/*
 * recipes/bench/gemm_libs.c - f32 GEMM rate, error and determinism of the
 * GEMM libraries Debian ships (OpenBLAS as configured, BLIS, oneDNN's
 * dnnl_sgemm, libxsmm's JIT kernels) on the shapes moelua runs: square,
 * the MoE layer's expert tiles, attention's tiles, the training
 * benchmark's expert tiles and projections. Row-major, alpha 1,
 * beta 0. A measurement for issue 15 (recipes/bench/gemm_libs.sh builds
 * and runs it), not part of moelua or of `make`.
 *
 * Every round runs every (shape, library, thread count) once, so machine
 * noise hits all of them alike; the table shows medians over the rounds.
 * `2x1t` is two OpenMP threads each running the library's one-thread GEMM
 * on its own output at the same time (moelua's expert and attention tiles
 * run that way), as total GFLOP/s. Errors are normwise against an f64
 * reference: ||C - R||_F / ||R||_F, the worse of 1 and 2 threads.
 * Determinism, each bitwise: `rep` two one-thread calls agree; `addr` the
 * one-thread result with operands and output moved by one float agrees;
 * `nest` both threads of an OpenMP region (library at one thread) agree
 * with it; `1t=2t` the one- and two-thread results agree. Before the table,
 * per library: the MoE layer's six tile GEMMs together at 2x1t against the
 * best 2048³, the most of its GEMM floor that layer can reach.
 *
 *   gemm_libs [rounds=7] [ms_per_sample=20]
 */
#define _GNU_SOURCE
#include <cblas-openblas.h>     /* OpenBLAS's cblas.h (BLIS ships one too) */
#include <blis.h>
#include <oneapi/dnnl/dnnl.h>
#include <libxsmm.h>

#include <dlfcn.h>
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

enum { L_OPENBLAS, L_BLIS, L_DNNL, L_XSMM, NLIB };
static const char *lib_name[NLIB] = {"OpenBLAS", "BLIS", "oneDNN", "libxsmm"};

/* C [m, n] = op(A) · op(B): A stored [m, k] ([k, m] when ta), B stored
 * [k, n] ([n, k] when tb), leading dims lda, ldb (0: contiguous). */
typedef struct {
    const char *what;
    int m, n, k, ta, tb, lda, ldb;
    int layer;      /* 1: one of the MoE layer's six GEMMs, each run once per tile */
} shape;

static const shape shapes[] = {
    {"square", 256, 256, 256, 0, 1, 0, 0},
    {"square", 256, 256, 256, 0, 0, 0, 0},
    {"square", 2048, 2048, 2048, 0, 1, 0, 0},
    {"square", 2048, 2048, 2048, 0, 0, 0, 0},
    {"expert h = x·gate_upᵀ", 256, 2816, 512, 0, 1, 0, 0, 1},
    {"expert out = act·downᵀ", 256, 512, 1408, 0, 1, 0, 0, 1},
    {"expert dact = dy·down", 256, 1408, 512, 0, 0, 0, 0, 1},
    {"expert dx = dh·gate_up", 256, 512, 2816, 0, 0, 0, 0, 1},
    {"expert dgate_up = dhᵀ·x", 2816, 512, 256, 1, 0, 0, 0, 1},
    {"expert ddown = doutᵀ·act", 512, 1408, 256, 1, 0, 0, 0, 1},
    {"expert h, M 64", 64, 2816, 512, 0, 1, 0, 0},
    {"expert out, M 64", 64, 512, 1408, 0, 1, 0, 0},
    {"attention s = q·kᵀ", 128, 128, 64, 0, 1, 256, 256},
    {"attention o = p·v", 128, 64, 128, 0, 0, 0, 256},
    {"attention dk = dsᵀ·q", 128, 64, 128, 1, 0, 0, 256},
    /* the training benchmark's model (D 256, F 512, S 4096): its expert
     * tiles, and its projections (threaded in the step) */
    {"step expert h", 256, 1024, 256, 0, 1, 0, 0},
    {"step expert out", 256, 256, 512, 0, 1, 0, 0},
    {"step expert dact", 256, 512, 256, 0, 0, 0, 0},
    {"step expert dx", 256, 256, 1024, 0, 0, 0, 0},
    {"step expert dgate_up", 1024, 256, 256, 1, 0, 0, 0},
    {"step expert ddown", 256, 512, 256, 1, 0, 0, 0},
    {"step proj y = x·Wᵀ", 4096, 256, 256, 0, 1, 0, 0},
    {"step proj dx = dy·W", 4096, 256, 256, 0, 0, 0, 0},
    {"step proj dW = dyᵀ·x", 256, 256, 4096, 1, 0, 0, 0},
};
#define NSHAPE ((int)(sizeof shapes / sizeof shapes[0]))

static int lda_of(const shape *s) { return s->lda ? s->lda : (s->ta ? s->m : s->k); }
static int ldb_of(const shape *s) { return s->ldb ? s->ldb : (s->tb ? s->k : s->n); }
static size_t a_elems(const shape *s) { return (size_t)lda_of(s) * (s->ta ? s->k : s->m); }
static size_t b_elems(const shape *s) { return (size_t)ldb_of(s) * (s->tb ? s->n : s->k); }
static double flops(const shape *s) { return 2.0 * s->m * s->n * s->k; }

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* ---- the libraries ------------------------------------------------------ */

/* libxsmm is column-major: row-major C = op(A)·op(B) is column-major
 * Cᵀ = op(B)ᵀ·op(A)ᵀ, so B goes first and each transpose flag moves over. */
static libxsmm_smmfunction xsmm_kernel(const shape *s)
{
    int flags = (s->tb ? LIBXSMM_GEMM_FLAG_TRANS_A : 0) | (s->ta ? LIBXSMM_GEMM_FLAG_TRANS_B : 0);
    int prefetch = LIBXSMM_GEMM_PREFETCH_NONE;
    libxsmm_blasint lda = ldb_of(s), ldb = lda_of(s), ldc = s->n;
    float alpha = 1.0f, beta = 0.0f;
    return libxsmm_smmdispatch(s->n, s->m, s->k, &lda, &ldb, &ldc, &alpha, &beta, &flags,
                               &prefetch);
}

/* 0 on success, -1 when the library has no path for the shape. */
static int gemm(int lib, const shape *s, const float *a, const float *b, float *c)
{
    int lda = lda_of(s), ldb = ldb_of(s);
    switch (lib) {
    case L_OPENBLAS:
        cblas_sgemm(CblasRowMajor, s->ta ? CblasTrans : CblasNoTrans,
                    s->tb ? CblasTrans : CblasNoTrans, s->m, s->n, s->k, 1.0f, a, lda, b, ldb,
                    0.0f, c, s->n);
        return 0;
    case L_BLIS: {
        float one = 1.0f, zero = 0.0f;
        bli_sgemm(s->ta ? BLIS_TRANSPOSE : BLIS_NO_TRANSPOSE,
                  s->tb ? BLIS_TRANSPOSE : BLIS_NO_TRANSPOSE, s->m, s->n, s->k, &one,
                  (float *)a, lda, 1, (float *)b, ldb, 1, &zero, c, s->n, 1);
        return 0;
    }
    case L_DNNL:
        return dnnl_sgemm(s->ta ? 'T' : 'N', s->tb ? 'T' : 'N', s->m, s->n, s->k, 1.0f, a, lda,
                          b, ldb, 0.0f, c, s->n) == dnnl_success ? 0 : -1;
    case L_XSMM: {
        libxsmm_smmfunction f = xsmm_kernel(s);
        if (!f)
            return -1;
        f(b, a, c);
        return 0;
    }
    }
    return -1;
}

/* The library's own thread count for calls from the main thread; 0 when
 * it has none to set (libxsmm's kernels run on the calling thread). */
static int set_threads(int lib, int n)
{
    switch (lib) {
    case L_OPENBLAS: openblas_set_num_threads(n); return 1;
    case L_BLIS: bli_thread_set_num_threads(n); return 1;
    case L_DNNL: omp_set_num_threads(n); return 1;     /* its OpenMP runtime */
    default: return n == 1;
    }
}

/* One core's f32 FMA rate: 12 independent chains of 16-lane FMAs (AVX-512),
 * the ceiling a GEMM kernel on one core can reach. */
__attribute__((target("avx512f"))) static double fma_peak_avx512(void)
{
    __m512 acc[12], x = _mm512_set1_ps(0.999999f), y = _mm512_set1_ps(1e-7f);
    for (int i = 0; i < 12; i++)
        acc[i] = _mm512_set1_ps((float)i);
    long iters = 50000000;
    double t0 = now();
    for (long n = 0; n < iters; n++)
        #pragma GCC unroll 12
        for (int i = 0; i < 12; i++)
            acc[i] = _mm512_fmadd_ps(acc[i], x, y);
    double t = now() - t0;
    float sink = 0;
    for (int i = 0; i < 12; i++)
        sink += _mm512_reduce_add_ps(acc[i]);
    return sink == 12345.0f ? 0 : 2.0 * 16 * 12 * (double)iters / t * 1e-9;
}

static void print_paths(void)
{
    if (__builtin_cpu_supports("avx512f"))
        printf("AVX-512 FMA peak, one core: %.0f GFLOP/s\n", fma_peak_avx512());
    Dl_info where;
    dladdr((void *)cblas_sgemm, &where);
    printf("OpenBLAS: %s; core %s; cblas_sgemm from %s\n", openblas_get_config(),
           openblas_get_corename(), where.dli_fname);
    printf("BLIS %s: config %s (bli_arch_query_id), OpenMP %s\n", bli_info_get_version_str(),
           bli_arch_string(bli_arch_query_id()),
           bli_info_get_enable_openmp() ? "yes" : "no");
    const dnnl_version_t *v = dnnl_version();
    printf("oneDNN %d.%d.%d: cpu runtime %s, effective isa 0x%x (dnnl_get_effective_cpu_isa)\n",
           v->major, v->minor, v->patch, v->cpu_runtime == DNNL_RUNTIME_OMP ? "OpenMP" : "other",
           (unsigned)dnnl_get_effective_cpu_isa());
    printf("libxsmm %s: target %s\n", LIBXSMM_CONFIG_VERSION, libxsmm_get_target_arch());
    const char *vars[] = {"OPENBLAS_CORETYPE", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS",
                          "OMP_WAIT_POLICY", "BLIS_NUM_THREADS", "BLIS_ARCH_TYPE",
                          "DNNL_MAX_CPU_ISA", "LIBXSMM_TARGET"};
    printf("environment:");
    for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++)
        printf(" %s=%s", vars[i], getenv(vars[i]) ? getenv(vars[i]) : "(unset)");
    printf("\n");
}

/* ---- the checks --------------------------------------------------------- */

static void fill(float *x, size_t n, uint64_t seed)
{
    for (size_t i = 0; i < n; i++) {
        seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
        x[i] = (float)((double)(seed >> 40) / (double)(1ULL << 24) * 2.0 - 1.0);
    }
}

/* R = op(A)·op(B) in f64, op(B) copied to [k, n] first so the loop streams. */
static void reference(const shape *s, const float *a, const float *b, double *r)
{
    int lda = lda_of(s), ldb = ldb_of(s);
    double *bt = malloc(sizeof(double) * (size_t)s->k * s->n);
    for (int p = 0; p < s->k; p++)
        for (int j = 0; j < s->n; j++)
            bt[(size_t)p * s->n + j] = s->tb ? b[(size_t)j * ldb + p] : b[(size_t)p * ldb + j];
    memset(r, 0, sizeof(double) * (size_t)s->m * s->n);
    for (int i = 0; i < s->m; i++)
        for (int p = 0; p < s->k; p++) {
            double x = s->ta ? a[(size_t)p * lda + i] : a[(size_t)i * lda + p];
            double *ri = r + (size_t)i * s->n;
            const double *bp = bt + (size_t)p * s->n;
            for (int j = 0; j < s->n; j++)
                ri[j] += x * bp[j];
        }
    free(bt);
}

static double normwise(const shape *s, const float *c, const double *r)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < (size_t)s->m * s->n; i++) {
        double d = (double)c[i] - r[i];
        num += d * d;
        den += r[i] * r[i];
    }
    return sqrt(num / den);
}

static int same(const shape *s, const float *x, const float *y)
{
    return memcmp(x, y, sizeof(float) * (size_t)s->m * s->n) == 0;
}

/* ---- the timing --------------------------------------------------------- */

/* Seconds per call over `calls` calls; with twin, two OpenMP threads each
 * make the calls at the same time (library at one thread), into c and c2. */
static double time_calls(int lib, const shape *s, const float *a, const float *b, float *c,
                         float *c2, int calls, int twin)
{
    double t0 = now();
    if (twin) {
        #pragma omp parallel num_threads(2)
        {
            float *out = omp_get_thread_num() ? c2 : c;
            for (int i = 0; i < calls; i++)
                gemm(lib, s, a, b, out);
        }
    } else {
        for (int i = 0; i < calls; i++)
            gemm(lib, s, a, b, c);
    }
    return (now() - t0) / calls;
}

static int cmp_double(const void *x, const void *y)
{
    double a = *(const double *)x, b = *(const double *)y;
    return (a > b) - (a < b);
}

static double median(double *x, int n)
{
    qsort(x, (size_t)n, sizeof *x, cmp_double);
    return n % 2 ? x[n / 2] : 0.5 * (x[n / 2 - 1] + x[n / 2]);
}

enum { MODE_1T, MODE_2T, MODE_2X1T, NMODE };

typedef struct {
    int ok;                     /* the library has a path for the shape */
    int calls[NMODE];           /* per sample, calibrated once */
    double *gflops[NMODE];      /* per round */
    double err;
    int rep, addr, nest, one_two;
} result;

/* 1 when this (library, mode) can run: thread count settable, 2x1t for all. */
static int mode_setup(int lib, int mode)
{
    return set_threads(lib, mode == MODE_2T ? 2 : 1);
}

static void checks(int lib, const shape *s, const float *a, const float *b, result *r,
                   size_t cn)
{
    size_t an = a_elems(s), bn = b_elems(s);
    double *ref = malloc(sizeof(double) * cn);
    float *c1 = malloc(sizeof(float) * cn), *c1b = malloc(sizeof(float) * cn);
    float *c2 = malloc(sizeof(float) * cn);
    float *ao = malloc(sizeof(float) * (an + 1)), *bo = malloc(sizeof(float) * (bn + 1));
    float *co = malloc(sizeof(float) * (cn + 1));
    float *cn0 = malloc(sizeof(float) * cn), *cn1 = malloc(sizeof(float) * cn);
    reference(s, a, b, ref);
    memset(c1, 0xff, sizeof(float) * cn);       /* NaN: beta 0 must overwrite */
    memset(c1b, 0x7f, sizeof(float) * cn);
    set_threads(lib, 1);
    r->ok = gemm(lib, s, a, b, c1) == 0;
    if (r->ok) {
        gemm(lib, s, a, b, c1b);
        r->rep = same(s, c1, c1b);
        memcpy(ao + 1, a, sizeof(float) * an);
        memcpy(bo + 1, b, sizeof(float) * bn);
        gemm(lib, s, ao + 1, bo + 1, co + 1);
        r->addr = same(s, c1, co + 1);
        #pragma omp parallel num_threads(2)
        gemm(lib, s, a, b, omp_get_thread_num() ? cn1 : cn0);
        r->nest = same(s, c1, cn0) && same(s, c1, cn1);
        r->err = normwise(s, c1, ref);
        r->one_two = -1;
        if (set_threads(lib, 2)) {
            gemm(lib, s, a, b, c2);
            r->one_two = same(s, c1, c2);
            double e2 = normwise(s, c2, ref);
            r->err = e2 > r->err ? e2 : r->err;
        }
    }
    free(ref); free(c1); free(c1b); free(c2); free(ao); free(bo); free(co);
    free(cn0); free(cn1);
}

/* The MoE layer's six GEMMs (shape.layer) at a library's 2x1t rates, as the
 * layer runs them (h saved: each once per tile, the two threads on tiles of
 * their own): per round their FLOPs over the sum of their times, against the
 * best 2048³ rate of any library on 2 threads in the same round. The
 * layer's share of its GEMM floor (moe_layer.lua, mfu.sh) is at most this
 * ratio while its GEMMs run no faster than alone. Medians over rounds.
 * (The weight gradients run here with beta 0; the layer adds, beta 1.) */
static void print_layer_mix(result res[][NLIB], int rounds)
{
    printf("\nThe MoE layer's six GEMMs per tile, 2x1t, against the best 2048³ on 2 threads "
           "(median of rounds):\n");
    double best[rounds];
    for (int round = 0; round < rounds; round++) {
        best[round] = 0;
        for (int si = 0; si < NSHAPE; si++)
            for (int l = 0; shapes[si].m == 2048 && l < NLIB; l++)
                if (res[si][l].gflops[MODE_2T] && res[si][l].gflops[MODE_2T][round] > best[round])
                    best[round] = res[si][l].gflops[MODE_2T][round];
    }
    for (int lib = 0; lib < NLIB; lib++) {
        double rate[rounds], share[rounds];
        int have = 1;
        for (int si = 0; si < NSHAPE; si++)
            if (shapes[si].layer && !res[si][lib].gflops[MODE_2X1T])
                have = 0;
        if (!have)
            continue;
        for (int round = 0; round < rounds; round++) {
            double f = 0, t = 0;
            for (int si = 0; si < NSHAPE; si++)
                if (shapes[si].layer) {
                    f += flops(&shapes[si]);
                    t += flops(&shapes[si]) / res[si][lib].gflops[MODE_2X1T][round];
                }
            rate[round] = f / t;
            share[round] = best[round] > 0 ? rate[round] / best[round] : 0;
        }
        printf("  %s: %.0f GFLOP/s, %.1f%% of the best 2048³\n", lib_name[lib],
               median(rate, rounds), 100 * median(share, rounds));
    }
}

static const char *flag(int v) { return v < 0 ? "–" : v ? "yes" : "**no**"; }

int main(int argc, char **argv)
{
    int rounds = argc > 1 ? atoi(argv[1]) : 7;
    double sample_s = (argc > 2 ? atof(argv[2]) : 20) * 1e-3;
    libxsmm_init();
    print_paths();

    static result res[NSHAPE][NLIB];
    float *a[NSHAPE], *b[NSHAPE], *c[NSHAPE], *c2[NSHAPE];
    for (int si = 0; si < NSHAPE; si++) {
        const shape *s = &shapes[si];
        size_t cn = (size_t)s->m * s->n;
        a[si] = malloc(sizeof(float) * a_elems(s));
        b[si] = malloc(sizeof(float) * b_elems(s));
        c[si] = malloc(sizeof(float) * cn);
        c2[si] = malloc(sizeof(float) * cn);
        fill(a[si], a_elems(s), 1 + si);
        fill(b[si], b_elems(s), 1000 + si);
        for (int lib = 0; lib < NLIB; lib++) {
            result *r = &res[si][lib];
            if (lib == L_XSMM && s->m * (double)s->n * s->k > 1e9)
                continue;               /* libxsmm: small GEMMs only */
            checks(lib, s, a[si], b[si], r, cn);
            for (int mode = 0; r->ok && mode < NMODE; mode++) {
                if (!mode_setup(lib, mode))
                    continue;
                double t = time_calls(lib, s, a[si], b[si], c[si], c2[si], 1, mode == MODE_2X1T);
                r->calls[mode] = t >= sample_s ? 1 : (int)(sample_s / t) + 1;
                r->gflops[mode] = calloc((size_t)rounds, sizeof(double));
            }
        }
        fprintf(stderr, "checked %dx%dx%d\n", s->m, s->n, s->k);
    }

    for (int round = 0; round < rounds; round++) {
        for (int si = 0; si < NSHAPE; si++)
            for (int lib = 0; lib < NLIB; lib++)
                for (int mode = 0; mode < NMODE; mode++) {
                    result *r = &res[si][lib];
                    if (!r->gflops[mode])
                        continue;
                    mode_setup(lib, mode);
                    const shape *s = &shapes[si];
                    gemm(lib, s, a[si], b[si], c[si]);      /* warm */
                    double t = time_calls(lib, s, a[si], b[si], c[si], c2[si], r->calls[mode],
                                          mode == MODE_2X1T);
                    r->gflops[mode][round] = flops(s) * (mode == MODE_2X1T ? 2 : 1) / t * 1e-9;
                    /* let OpenBLAS's threads stop spinning before the next one runs */
                    usleep(lib == L_OPENBLAS && mode == MODE_2T ? 200000 : 10000);
                }
        fprintf(stderr, "round %d of %d done\n", round + 1, rounds);
    }

    print_layer_mix(res, rounds);   /* before the table's medians sort the rounds */
    printf("\n| shape | M x N x K | op | library | 1t GFLOP/s | 2t | 2x1t | rel. error "
           "| rep | addr | nest | 1t=2t |\n|---|---|---|---|---:|---:|---:|---:|---|---|---|---|\n");
    for (int si = 0; si < NSHAPE; si++) {
        const shape *s = &shapes[si];
        for (int lib = 0; lib < NLIB; lib++) {
            result *r = &res[si][lib];
            if (!r->gflops[MODE_1T])
                continue;
            char g[NMODE][16];
            for (int mode = 0; mode < NMODE; mode++) {
                if (r->gflops[mode])
                    snprintf(g[mode], sizeof g[mode], "%.0f", median(r->gflops[mode], rounds));
                else
                    snprintf(g[mode], sizeof g[mode], "–");
            }
            printf("| %s | %d x %d x %d | %s%s | %s | %s | %s | %s | %.1e | %s | %s | %s | %s |\n",
                   s->what, s->m, s->n, s->k, s->ta ? "Aᵀ" : "A", s->tb ? "·Bᵀ" : "·B",
                   lib_name[lib], g[MODE_1T], g[MODE_2T], g[MODE_2X1T], r->err, flag(r->rep),
                   flag(r->addr), flag(r->nest), flag(r->one_two));
        }
        for (int lib = 0; lib < NLIB; lib++)
            if (res[si][lib].ok == 0 && lib == L_XSMM && s->m * (double)s->n * s->k <= 1e9)
                printf("| %s | %d x %d x %d | | libxsmm | no JIT kernel | | | | | | | |\n",
                       s->what, s->m, s->n, s->k);
    }
    return 0;
}
