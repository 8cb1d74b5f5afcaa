/*
 * kernels/attention.c - tiled causal GQA attention on the CPU (see
 * attention.h). Tiles copy their blocks into the caller's per-thread
 * scratch as f64 (K and V also transposed), so every inner loop runs over
 * independent outputs (keys of a block, or the head dim) and vectorises
 * without reordering a sum: each output's summation order is fixed by the
 * source, whatever the vector width or thread count.
 */
#include "attention.h"
#include "parallel.h"

#include <math.h>
#include <omp.h>

/* The tile functions are also built for AVX2 and picked at load time: the
 * same IEEE operations in the same order (no FMA: -ffp-contract=off), only
 * wider, so both clones give bitwise the same results. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_ADDRESS__)
#define ML_ATT_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define ML_ATT_CLONES
#endif

#define BQ 64   /* query rows per block */
#define BK 64   /* key/value rows per block */

size_t ml_attention_scratch_bytes(int64_t hd, int nthreads)
{
    if (nthreads < 1)
        nthreads = 1;
    return (size_t)nthreads * (size_t)(6 * BQ * hd + 4 * BQ) * sizeof(double);
}

typedef struct {
    ml_dtype dt;
    void *out, *dq, *dk, *dv;
    double *lse_out, *drow, *scratch;
    const double *lse;
    const void *q, *k, *v, *o, *dout;
    int64_t S, H, KV, hd, group;
    double scale;
} att_args;

/* this thread's scratch: 6 blocks of BQ * hd f64 and 4 of BQ */
static double *my_scratch(const att_args *a)
{
    return a->scratch + (size_t)omp_get_thread_num() * (size_t)(6 * BQ * a->hd + 4 * BQ);
}

/* rows [r0, r0 + n) of head h of a [S, heads, hd] tensor -> dst [n, hd] f64 */
static void load_rows(ml_dtype dt, const void *p, int64_t r0, int64_t n, int64_t heads, int64_t h,
                      int64_t hd, double *dst)
{
    for (int64_t r = 0; r < n; r++) {
        int64_t base = ((r0 + r) * heads + h) * hd;
        if (dt == ML_F32) {
            const float *s = (const float *)p + base;
            for (int64_t d = 0; d < hd; d++)
                dst[r * hd + d] = s[d];
        } else {
            memcpy(dst + r * hd, (const double *)p + base, (size_t)hd * sizeof(double));
        }
    }
}

/* the same rows transposed: dst [hd, BK], columns >= n zeroed */
static void load_rows_t(ml_dtype dt, const void *p, int64_t r0, int64_t n, int64_t heads, int64_t h,
                        int64_t hd, double *dst)
{
    for (int64_t r = 0; r < BK; r++) {
        int64_t base = ((r0 + r) * heads + h) * hd;
        for (int64_t d = 0; d < hd; d++)
            dst[d * BK + r] = r >= n ? 0.0
                : dt == ML_F32 ? (double)((const float *)p)[base + d] : ((const double *)p)[base + d];
    }
}

static void store_row(ml_dtype dt, void *p, int64_t i, int64_t heads, int64_t h, int64_t hd,
                      const double *src, double scale)
{
    int64_t base = (i * heads + h) * hd;
    if (dt == ML_F32) {
        float *d = (float *)p + base;
        for (int64_t e = 0; e < hd; e++)
            d[e] = (float)(src[e] * scale);
    } else {
        double *d = (double *)p + base;
        for (int64_t e = 0; e < hd; e++)
            d[e] = src[e] * scale;
    }
}

/* s[j] = sum_d x[d] * t[d, j] for the BK keys of a block (t: [hd, BK]) */
static inline void row_dots(double *restrict s, const double *restrict x, const double *restrict t,
                            int64_t hd)
{
    for (int64_t j = 0; j < BK; j++)
        s[j] = 0;
    for (int64_t d = 0; d < hd; d++) {
        double xd = x[d];
        const double *tr = t + d * BK;
        #pragma omp simd
        for (int64_t j = 0; j < BK; j++)
            s[j] += xd * tr[j];
    }
}

/* y[d] += c * x[d] */
static inline void axpy(double *restrict y, double c, const double *restrict x, int64_t hd)
{
    #pragma omp simd
    for (int64_t d = 0; d < hd; d++)
        y[d] += c * x[d];
}

/* ---- forward: one (head, q block) per item ------------------------------- */

ML_ATT_CLONES
static void fwd_tile(void *arg, int64_t lo, int64_t hi)
{
    const att_args *a = arg;
    int64_t S = a->S, hd = a->hd, nqb = (S + BQ - 1) / BQ;
    double *Q = my_scratch(a), *acc = Q + BQ * hd, *Kt = acc + BQ * hd, *Vb = Kt + BK * hd;
    double *m = Vb + BK * hd, *l = m + BQ, *sc = l + BQ;
    for (int64_t it = lo; it < hi; it++) {
        int64_t h = it / nqb, g = h / a->group;
        int64_t i0 = (it % nqb) * BQ, i1 = i0 + BQ < S ? i0 + BQ : S, nq = i1 - i0;
        load_rows(a->dt, a->q, i0, nq, a->H, h, hd, Q);
        for (int64_t r = 0; r < nq; r++) {
            m[r] = -INFINITY;
            l[r] = 0;
        }
        memset(acc, 0, (size_t)(nq * hd) * sizeof(double));
        for (int64_t j0 = 0; j0 < i1; j0 += BK) {
            int64_t j1 = j0 + BK < i1 ? j0 + BK : i1;
            load_rows_t(a->dt, a->k, j0, j1 - j0, a->KV, g, hd, Kt);
            load_rows(a->dt, a->v, j0, j1 - j0, a->KV, g, hd, Vb);
            for (int64_t r = 0; r < nq; r++) {
                int64_t i = i0 + r, n = (j1 < i + 1 ? j1 : i + 1) - j0;
                if (n <= 0)
                    continue;
                row_dots(sc, Q + r * hd, Kt, hd);
                double mx = m[r];
                for (int64_t j = 0; j < n; j++) {
                    sc[j] *= a->scale;
                    mx = sc[j] > mx ? sc[j] : mx;
                }
                double corr = m[r] == -INFINITY ? 0.0 : exp(m[r] - mx);
                double *ar = acc + r * hd;
                l[r] *= corr;
                for (int64_t d = 0; d < hd; d++)
                    ar[d] *= corr;
                for (int64_t j = 0; j < n; j++) {
                    double p = exp(sc[j] - mx);
                    l[r] += p;
                    axpy(ar, p, Vb + j * hd, hd);
                }
                m[r] = mx;
            }
        }
        for (int64_t r = 0; r < nq; r++) {
            store_row(a->dt, a->out, i0 + r, a->H, h, hd, acc + r * hd, 1.0 / l[r]);
            a->lse_out[h * S + i0 + r] = m[r] + log(l[r]);
        }
    }
}

ml_status ml_attention_forward_cpu(ml_dtype dt, void *out, double *lse, const void *q,
                                   const void *k, const void *v, int64_t S, int64_t H,
                                   int64_t KV, int64_t hd, void *scratch, const ml_kctx *ctx)
{
    if (dt != ML_F32 && dt != ML_F64)
        return ML_EUNSUPPORTED;
    if (hd < 1 || hd > ML_ATT_HD_MAX || KV < 1 || H % KV != 0)
        return ML_EUNSUPPORTED;
    att_args a = {.dt = dt, .out = out, .lse_out = lse, .scratch = scratch, .q = q, .k = k,
                  .v = v, .S = S, .H = H, .KV = KV, .hd = hd, .group = H / KV,
                  .scale = 1.0 / sqrt((double)hd)};
    int64_t nqb = (S + BQ - 1) / BQ;
    return ml_parallel_tiles(H * nqb, 1, BQ * (S / 2 + 1) * hd * 2, ctx, fwd_tile, &a);
}

/* ---- backward ------------------------------------------------------------- */

/* drow[h, i] = dout_i . out_i for tokens [lo, hi) */
static void drow_tile(void *arg, int64_t lo, int64_t hi)
{
    const att_args *a = arg;
    double *x = my_scratch(a), *y = x + a->hd;
    for (int64_t i = lo; i < hi; i++)
        for (int64_t h = 0; h < a->H; h++) {
            load_rows(a->dt, a->dout, i, 1, a->H, h, a->hd, x);
            load_rows(a->dt, a->o, i, 1, a->H, h, a->hd, y);
            double s = 0;
            for (int64_t d = 0; d < a->hd; d++)
                s += x[d] * y[d];
            a->drow[h * a->S + i] = s;
        }
}

/* dq for one (head, q block) per item */
ML_ATT_CLONES
static void dq_tile(void *arg, int64_t lo, int64_t hi)
{
    const att_args *a = arg;
    int64_t S = a->S, hd = a->hd, nqb = (S + BQ - 1) / BQ;
    double *Q = my_scratch(a), *G = Q + BQ * hd, *acc = G + BQ * hd, *Kt = acc + BQ * hd;
    double *Kb = Kt + BK * hd, *Vt = Kb + BK * hd, *sc = Vt + BK * hd, *dp = sc + BQ;
    for (int64_t it = lo; it < hi; it++) {
        int64_t h = it / nqb, g = h / a->group;
        int64_t i0 = (it % nqb) * BQ, i1 = i0 + BQ < S ? i0 + BQ : S, nq = i1 - i0;
        load_rows(a->dt, a->q, i0, nq, a->H, h, hd, Q);
        load_rows(a->dt, a->dout, i0, nq, a->H, h, hd, G);
        memset(acc, 0, (size_t)(nq * hd) * sizeof(double));
        for (int64_t j0 = 0; j0 < i1; j0 += BK) {
            int64_t j1 = j0 + BK < i1 ? j0 + BK : i1;
            load_rows_t(a->dt, a->k, j0, j1 - j0, a->KV, g, hd, Kt);
            load_rows(a->dt, a->k, j0, j1 - j0, a->KV, g, hd, Kb);
            load_rows_t(a->dt, a->v, j0, j1 - j0, a->KV, g, hd, Vt);
            for (int64_t r = 0; r < nq; r++) {
                int64_t i = i0 + r, n = (j1 < i + 1 ? j1 : i + 1) - j0;
                if (n <= 0)
                    continue;
                double z = a->lse[h * S + i], di = a->drow[h * S + i];
                row_dots(sc, Q + r * hd, Kt, hd);
                row_dots(dp, G + r * hd, Vt, hd);
                for (int64_t j = 0; j < n; j++) {
                    double p = exp(a->scale * sc[j] - z);
                    axpy(acc + r * hd, p * (dp[j] - di), Kb + j * hd, hd);
                }
            }
        }
        for (int64_t r = 0; r < nq; r++)
            store_row(a->dt, a->dq, i0 + r, a->H, h, hd, acc + r * hd, a->scale);
    }
}

/* dk, dv for one (kv head, kv block) per item: the group's query heads in
 * order, then the queries i >= j in order */
ML_ATT_CLONES
static void dkv_tile(void *arg, int64_t lo, int64_t hi)
{
    const att_args *a = arg;
    int64_t S = a->S, hd = a->hd, nkb = (S + BK - 1) / BK;
    double *Kt = my_scratch(a), *Vt = Kt + BK * hd, *ak = Vt + BK * hd, *av = ak + BK * hd;
    double *Q = av + BK * hd, *G = Q + hd, *sc = G + hd, *dp = sc + BQ;
    for (int64_t it = lo; it < hi; it++) {
        int64_t g = it / nkb;
        int64_t j0 = (it % nkb) * BK, j1 = j0 + BK < S ? j0 + BK : S, nk = j1 - j0;
        load_rows_t(a->dt, a->k, j0, nk, a->KV, g, hd, Kt);
        load_rows_t(a->dt, a->v, j0, nk, a->KV, g, hd, Vt);
        memset(ak, 0, (size_t)(nk * hd) * sizeof(double));
        memset(av, 0, (size_t)(nk * hd) * sizeof(double));
        for (int64_t h = g * a->group; h < (g + 1) * a->group; h++)
            for (int64_t i = j0; i < S; i++) {
                load_rows(a->dt, a->q, i, 1, a->H, h, hd, Q);
                load_rows(a->dt, a->dout, i, 1, a->H, h, hd, G);
                double z = a->lse[h * S + i], di = a->drow[h * S + i];
                int64_t n = (j1 < i + 1 ? j1 : i + 1) - j0;
                row_dots(sc, Q, Kt, hd);
                row_dots(dp, G, Vt, hd);
                for (int64_t j = 0; j < n; j++) {
                    double p = exp(a->scale * sc[j] - z);
                    axpy(av + j * hd, p, G, hd);
                    axpy(ak + j * hd, p * (dp[j] - di), Q, hd);
                }
            }
        for (int64_t c = 0; c < nk; c++) {
            store_row(a->dt, a->dk, j0 + c, a->KV, g, hd, ak + c * hd, a->scale);
            store_row(a->dt, a->dv, j0 + c, a->KV, g, hd, av + c * hd, 1.0);
        }
    }
}

ml_status ml_attention_backward_cpu(ml_dtype dt, void *dq, void *dk, void *dv, double *drow,
                                    const void *dout, const void *q, const void *k, const void *v,
                                    const void *out, const double *lse, int64_t S, int64_t H,
                                    int64_t KV, int64_t hd, void *scratch, const ml_kctx *ctx)
{
    if (dt != ML_F32 && dt != ML_F64)
        return ML_EUNSUPPORTED;
    if (hd < 1 || hd > ML_ATT_HD_MAX || KV < 1 || H % KV != 0)
        return ML_EUNSUPPORTED;
    att_args a = {.dt = dt, .dq = dq, .dk = dk, .dv = dv, .drow = drow, .scratch = scratch,
                  .lse = lse, .q = q, .k = k, .v = v, .o = out, .dout = dout, .S = S, .H = H,
                  .KV = KV, .hd = hd, .group = H / KV, .scale = 1.0 / sqrt((double)hd)};
    ml_status s = ml_parallel_tiles(S, 64, 2 * H * hd, ctx, drow_tile, &a);
    if (s != ML_OK)
        return s;
    int64_t nqb = (S + BQ - 1) / BQ, nkb = (S + BK - 1) / BK;
    s = ml_parallel_tiles(H * nqb, 1, BQ * (S / 2 + 1) * hd * 4, ctx, dq_tile, &a);
    if (s != ML_OK)
        return s;
    return ml_parallel_tiles(KV * nkb, 1, a.group * BK * (S / 2 + 1) * hd * 6, ctx, dkv_tile, &a);
}
