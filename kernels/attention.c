/*
 * kernels/attention.c - tiled causal GQA attention on the CPU (see
 * attention.h). f64: tiles copy their blocks into the caller's per-thread
 * scratch as f64 (K and V also transposed), so every inner loop runs over
 * independent outputs (keys of a block, or the head dim) and vectorises
 * without reordering a sum: each output's summation order is fixed by the
 * source, whatever the vector width or thread count. f32: single-threaded
 * sgemm per tile product, softmax rows over fixed lanes (the f32 path below).
 */
#include "attention.h"
#include "gemm.h"
#include "vmath.h"
#include "parallel.h"

#include <math.h>
#include <omp.h>

#define BQ 64   /* query rows per block */
#define BK 64   /* key/value rows per block */

/* The f32 path's tiles: FB query rows x FB key rows, one sgemm per product.
 * Query and key blocks share the size and start at multiples of it, so the
 * diagonal tile of a query block is its last key block. The forward takes
 * QB = 4·FB query rows against each FB-row key block, so every K and V
 * block it streams from memory serves four times the rows (BENCHMARKS.md,
 * "Attention's forward": 0.91× the time at S 8192 on a Zen 5 with 2·FB and
 * the softmax changes below; issue 15's ninth pass: 0.93-0.98× again with
 * 4·FB). The backward takes up to QT = 4·FB query rows against each key
 * block: the rows of one group of QT, groups aligned to multiples of QT
 * (qgroup_end), so a key block's first group starts at the key block and
 * every scheme below runs the same GEMMs (issue 15's ninth pass: 0.91-0.95×
 * the backward's time at S 4096-16384). */
#define FB 128
#define QB (4 * FB)
#define QT (4 * FB)
#define LANES 16   /* fixed partial sums/maxima per row (vmath.h's lanes16_*): vectorises, order fixed */

/* Query rows per tile for S query rows, tiles of up to cap (QB forward, QT
 * backward): fewer when S is shorter (rounded up to FB), so a short
 * sequence's scratch stays small. */
static int64_t tile_rows(int64_t S, int64_t cap)
{
    int64_t r = (S + FB - 1) / FB * FB;
    return r < cap ? r : cap;
}

/* per-thread scratch in doubles: f64 path; f32 path, with R =
 * tile_rows(S, QB): forward l [R] f64, m and mx [R] f32 (R doubles), sc
 * [R, FB] f32, acc [R, hd] f32; backward sc and dp [tile_rows(S, QT), FB]
 * f32 after 2·FB doubles */
static size_t f64_stride(int64_t hd)
{
    return (size_t)(6 * BQ * hd + 4 * BQ);
}

static size_t f32_stride(int64_t hd, int64_t S)
{
    int64_t R = tile_rows(S, QB);
    size_t fwd = (size_t)(2 * R + R * FB / 2 + R * hd / 2 + 8), bwd = (size_t)(2 * FB + tile_rows(S, QT) * FB);
    return fwd > bwd ? fwd : bwd;
}

size_t ml_attention_scratch_bytes(int64_t hd, int64_t S, int nthreads)
{
    if (nthreads < 1)
        nthreads = 1;
    size_t a = f64_stride(hd), b = f32_stride(hd, S);
    return (size_t)nthreads * (a > b ? a : b) * sizeof(double);
}

typedef struct {
    ml_dtype dt;
    void *out, *dq, *dk, *dv;
    double *lse_out, *drow, *scratch;
    const double *lse;
    const void *q, *k, *v, *o, *dout;
    int64_t S, P, H, KV, hd, group;   /* S query rows at positions P.. of P + S keys */
    double scale;
} att_args;

/* Block t of n in the order 0, n-1, 1, n-2, ...: causal work grows (query
 * blocks) or shrinks (key blocks) linearly with the block, so each pair
 * has the same work and the threads' contiguous ranges of items (OpenMP's
 * static schedule) get equal shares. Which thread runs a block changes no
 * bit: every output element belongs to one block. */
static inline int64_t zigzag(int64_t t, int64_t n)
{
    return t % 2 ? n - 1 - t / 2 : t / 2;
}

/* this thread's scratch: f64: 6 blocks of BQ * hd f64 and 4 of BQ; f32: see
 * f32_stride */
static double *my_scratch(const att_args *a)
{
    size_t st = a->dt == ML_F32 ? f32_stride(a->hd, a->S) : f64_stride(a->hd);
    return a->scratch + (size_t)omp_get_thread_num() * st;
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

ML_CLONES
static void fwd_tile(void *arg, int64_t lo, int64_t hi)
{
    const att_args *a = arg;
    int64_t S = a->S, hd = a->hd, nqb = (S + BQ - 1) / BQ;
    double *Q = my_scratch(a), *acc = Q + BQ * hd, *Kt = acc + BQ * hd, *Vb = Kt + BK * hd;
    double *m = Vb + BK * hd, *l = m + BQ, *sc = l + BQ;
    for (int64_t it = lo; it < hi; it++) {
        int64_t h = it / nqb, g = h / a->group;
        int64_t i0 = zigzag(it % nqb, nqb) * BQ, i1 = i0 + BQ < S ? i0 + BQ : S, nq = i1 - i0;
        load_rows(a->dt, a->q, i0, nq, a->H, h, hd, Q);
        for (int64_t r = 0; r < nq; r++) {
            m[r] = -INFINITY;
            l[r] = 0;
        }
        memset(acc, 0, (size_t)(nq * hd) * sizeof(double));
        for (int64_t j0 = 0; j0 < a->P + i1; j0 += BK) {
            int64_t j1 = j0 + BK < a->P + i1 ? j0 + BK : a->P + i1;
            load_rows_t(a->dt, a->k, j0, j1 - j0, a->KV, g, hd, Kt);
            load_rows(a->dt, a->v, j0, j1 - j0, a->KV, g, hd, Vb);
            for (int64_t r = 0; r < nq; r++) {
                int64_t i = a->P + i0 + r, n = (j1 < i + 1 ? j1 : i + 1) - j0;
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

/* ---- the f32 path: sgemm tiles -------------------------------------------- */

/* max of x[0, n), n >= 1, over LANES fixed lanes */
static inline float row_max(const float *restrict x, int64_t n)
{
    float part[LANES];
    for (int t = 0; t < LANES; t++)
        part[t] = -INFINITY;
    int64_t j = 0;
    for (; j + LANES <= n; j += LANES) {
        #pragma omp simd
        for (int t = 0; t < LANES; t++)
            part[t] = x[j + t] > part[t] ? x[j + t] : part[t];
    }
    for (int t = 0; j < n; j++, t++)
        part[t] = x[j] > part[t] ? x[j] : part[t];
    return lanes16_max(part);
}

/* x[j] = e^(x[j] - z) for j < n, 0 for n <= j < nk; returns the sum of the
 * first n in f32 over LANES fixed lanes, combined by lanes16_sum's tree */
static inline float row_exp(float *restrict x, int64_t n, int64_t nk, float z)
{
    float part[LANES];
    for (int t = 0; t < LANES; t++)
        part[t] = 0;
    int64_t j = 0;
    for (; j + LANES <= n; j += LANES) {
        #pragma omp simd
        for (int t = 0; t < LANES; t++) {
            float p = exp_f(x[j + t] - z);
            x[j + t] = p;
            part[t] += p;
        }
    }
    for (int t = 0; j < n; j++, t++) {
        float p = exp_f(x[j] - z);
        x[j] = p;
        part[t] += p;
    }
    for (; j < nk; j++)
        x[j] = 0;
    return lanes16_sum(part);
}

/* forward: one (head, QB query block) per item. Per key block: the scores
 * of the rows that see any of its keys (r0 on; the rows before see none),
 * every row's new maximum, the rows' corrections e^(m - mx) in one vector
 * pass (a row's first block: e^-87.3 ~ 1e-38 times its l = 0 and acc = 0,
 * so 0 as before), then exp and the row sums, and acc += P·V. */
ML_CLONES
static void fwd_tile32(void *arg, int64_t lo, int64_t hi)
{
    const att_args *a = arg;
    int64_t S = a->S, P = a->P, hd = a->hd, nqb = (S + QB - 1) / QB, ldq = a->H * hd, ldk = a->KV * hd;
    int64_t R = tile_rows(S, QB);
    double *l = my_scratch(a);
    float *m = (float *)(l + R), *mx = m + R, *sc = mx + R, *acc = sc + R * FB;
    float scale = (float)a->scale;
    for (int64_t it = lo; it < hi; it++) {
        int64_t h = it / nqb, g = h / a->group;
        int64_t i0 = zigzag(it % nqb, nqb) * QB, nq = i0 + QB < S ? QB : S - i0;
        const float *Qb = (const float *)a->q + (i0 * a->H + h) * hd;
        for (int64_t r = 0; r < nq; r++) {
            m[r] = -INFINITY;
            l[r] = 0;
        }
        memset(acc, 0, (size_t)(nq * hd) * sizeof(float));
        for (int64_t j0 = 0; j0 < P + i0 + nq; j0 += FB) {
            int64_t nk = j0 + FB < P + S ? FB : P + S - j0;
            int64_t r0 = j0 > P + i0 ? j0 - P - i0 : 0;   /* row r sees keys < P + i0 + r + 1 */
            const float *Kb = (const float *)a->k + (j0 * a->KV + g) * hd;
            const float *Vb = (const float *)a->v + (j0 * a->KV + g) * hd;
            ml_gemm(ML_F32, ML_GEMM_SERIAL, 0, 1, (int)(nq - r0), (int)nk, (int)hd, scale,
                        Qb + r0 * ldq, (int)ldq, Kb, (int)ldk, 0.0f, sc + r0 * FB, FB);
            for (int64_t r = r0; r < nq; r++) {
                int64_t n = P + i0 + r + 1 - j0 < nk ? P + i0 + r + 1 - j0 : nk;
                float x = row_max(sc + r * FB, n);
                mx[r] = m[r] > x ? m[r] : x;
            }
            #pragma omp simd
            for (int64_t r = r0; r < nq; r++)
                m[r] = exp_f(m[r] - mx[r]);   /* m holds the correction until the row's update */
            for (int64_t r = r0; r < nq; r++) {
                int64_t n = P + i0 + r + 1 - j0 < nk ? P + i0 + r + 1 - j0 : nk;
                float corr = m[r], s = row_exp(sc + r * FB, n, nk, mx[r]);
                l[r] = l[r] * (double)corr + (double)s;
                if (corr != 1.0f) {
                    float *ar = acc + r * hd;
                    #pragma omp simd
                    for (int64_t d = 0; d < hd; d++)
                        ar[d] *= corr;
                }
                m[r] = mx[r];
            }
            ml_gemm(ML_F32, ML_GEMM_SERIAL, 0, 0, (int)(nq - r0), (int)hd, (int)nk, 1.0f,
                        sc + r0 * FB, FB, Vb, (int)ldk, 1.0f, acc + r0 * hd, (int)hd);
        }
        for (int64_t r = 0; r < nq; r++) {
            float *o = (float *)a->out + ((i0 + r) * a->H + h) * hd;
            const float *ar = acc + r * hd;
            double inv = 1.0 / l[r];
            for (int64_t d = 0; d < hd; d++)
                o[d] = (float)(ar[d] * inv);
            a->lse_out[h * S + i0 + r] = (double)m[r] + log(l[r]);
        }
    }
}

/* P (into sc) and dS = P (dP - Drow) (into dp) for the rows [i0, i0 + nq) of
 * head h against keys [j0, j0 + nk); entries past the causal edge are 0 */
static inline void probs_ds(const att_args *a, int64_t h, int64_t i0, int64_t nq, int64_t j0,
                            int64_t nk, float *restrict sc, float *restrict dp)
{
    for (int64_t r = 0; r < nq; r++) {
        int64_t i = i0 + r, n = i + 1 - j0 < nk ? i + 1 - j0 : nk;
        float *ps = sc + r * FB, *pd = dp + r * FB;
        float z = (float)a->lse[h * a->S + i], di = (float)a->drow[h * a->S + i];
        #pragma omp simd
        for (int64_t j = 0; j < n; j++) {
            float p = exp_f(ps[j] - z);
            ps[j] = p;
            pd[j] = p * (pd[j] - di);
        }
        for (int64_t j = n; j < nk; j++)
            ps[j] = pd[j] = 0;
    }
}

/* One tile's probabilities and score gradients: sc = P (from scale·Q·Kᵀ and
 * the saved lse), dp = dS (from dO·Vᵀ), as probs_ds leaves them. */
static inline void tile_p_ds(const att_args *a, int64_t h, int64_t i0, int64_t nq, int64_t j0, int64_t nk,
                             const float *Qb, const float *Gb, const float *Kb, const float *Vb,
                             float *sc, float *dp)
{
    int ldq = (int)(a->H * a->hd), ldk = (int)(a->KV * a->hd), hd = (int)a->hd;
    ml_gemm(ML_F32, ML_GEMM_SERIAL, 0, 1, (int)nq, (int)nk, hd, (float)a->scale,
                Qb, ldq, Kb, ldk, 0.0f, sc, FB);
    ml_gemm(ML_F32, ML_GEMM_SERIAL, 0, 1, (int)nq, (int)nk, hd, 1.0f,
                Gb, ldq, Vb, ldk, 0.0f, dp, FB);
    probs_ds(a, h, i0, nq, j0, nk, sc, dp);
}

/* dV += Pᵀ·dO and dK += scale·dSᵀ·Q for one tile. */
static inline void tile_dkv(const att_args *a, int64_t nq, int64_t nk, const float *sc, const float *dp,
                            const float *Qb, const float *Gb, float *dK, float *dV)
{
    int ldq = (int)(a->H * a->hd), ldk = (int)(a->KV * a->hd), hd = (int)a->hd;
    ml_gemm(ML_F32, ML_GEMM_SERIAL, 1, 0, (int)nk, hd, (int)nq,
                1.0f, sc, FB, Gb, ldq, 1.0f, dV, ldk);
    ml_gemm(ML_F32, ML_GEMM_SERIAL, 1, 0, (int)nk, hd, (int)nq,
                (float)a->scale, dp, FB, Qb, ldq, 1.0f, dK, ldk);
}

/* dQ += scale·dS·K for one tile. */
static inline void tile_dq(const att_args *a, int64_t nq, int64_t nk, const float *dp, const float *Kb,
                           float *dQ)
{
    int ldq = (int)(a->H * a->hd), ldk = (int)(a->KV * a->hd), hd = (int)a->hd;
    ml_gemm(ML_F32, ML_GEMM_SERIAL, 0, 0, (int)nq, hd, (int)nk, (float)a->scale,
                dp, FB, Kb, ldk, 1.0f, dQ, ldq);
}

/* The backward's sc and dp [tile_rows(S, QT), FB] f32 in this thread's
 * scratch (f32_stride): sc returned, dp through *dp. */
static float *bwd_tiles(const att_args *a, float **dp)
{
    float *sc = (float *)(my_scratch(a) + 2 * FB);
    *dp = sc + tile_rows(a->S, QT) * FB;
    return sc;
}

/* The end of the backward's query group holding row i0 (the next multiple
 * of QT, or S). */
static inline int64_t qgroup_end(int64_t i0, int64_t S)
{
    int64_t e = (i0 / QT + 1) * QT;
    return e < S ? e : S;
}

/* dq for one (head, QT query group) per item, accumulated in place: per key
 * block the group's rows that see it, as one tile */
ML_CLONES
static void dq_tile32(void *arg, int64_t lo, int64_t hi)
{
    const att_args *a = arg;
    int64_t S = a->S, hd = a->hd, nqg = (S + QT - 1) / QT;
    float *dp, *sc = bwd_tiles(a, &dp);
    for (int64_t it = lo; it < hi; it++) {
        int64_t h = it / nqg, g = h / a->group;
        int64_t q0 = zigzag(it % nqg, nqg) * QT, q1 = qgroup_end(q0, S);
        for (int64_t i = q0; i < q1; i++)
            memset((float *)a->dq + (i * a->H + h) * hd, 0, (size_t)hd * sizeof(float));
        for (int64_t j0 = 0; j0 < q1; j0 += FB) {
            int64_t nk = j0 + FB < S ? FB : S - j0, i0 = j0 > q0 ? j0 : q0;
            size_t off = (size_t)((i0 * a->H + h) * hd);
            const float *Qb = (const float *)a->q + off, *Gb = (const float *)a->dout + off;
            const float *Kb = (const float *)a->k + (j0 * a->KV + g) * hd;
            const float *Vb = (const float *)a->v + (j0 * a->KV + g) * hd;
            tile_p_ds(a, h, i0, q1 - i0, j0, nk, Qb, Gb, Kb, Vb, sc, dp);
            tile_dq(a, q1 - i0, nk, dp, Kb, (float *)a->dq + off);
        }
    }
}

/* dk, dv for one (kv head, FB key block) per item, accumulated in place: the
 * group's query heads in order, then the query groups' rows i0 >= j0 in
 * order */
ML_CLONES
static void dkv_tile32(void *arg, int64_t lo, int64_t hi)
{
    const att_args *a = arg;
    int64_t S = a->S, hd = a->hd, nkb = (S + FB - 1) / FB, ldk = a->KV * hd;
    float *dp, *sc = bwd_tiles(a, &dp);
    for (int64_t it = lo; it < hi; it++) {
        int64_t g = it / nkb;
        int64_t j0 = zigzag(it % nkb, nkb) * FB, nk = j0 + FB < S ? FB : S - j0;
        size_t koff = (size_t)((j0 * a->KV + g) * hd);
        const float *Kb = (const float *)a->k + koff, *Vb = (const float *)a->v + koff;
        float *dK = (float *)a->dk + koff, *dV = (float *)a->dv + koff;
        for (int64_t c = 0; c < nk; c++) {
            memset(dK + c * ldk, 0, (size_t)hd * sizeof(float));
            memset(dV + c * ldk, 0, (size_t)hd * sizeof(float));
        }
        for (int64_t h = g * a->group; h < (g + 1) * a->group; h++)
            for (int64_t i0 = j0, i1; i0 < S; i0 = i1) {
                i1 = qgroup_end(i0, S);
                int64_t nq = i1 - i0;
                size_t off = (size_t)((i0 * a->H + h) * hd);
                const float *Qb = (const float *)a->q + off, *Gb = (const float *)a->dout + off;
                tile_p_ds(a, h, i0, nq, j0, nk, Qb, Gb, Kb, Vb, sc, dp);
                tile_dkv(a, nq, nk, sc, dp, Qb, Gb, dK, dV);
            }
    }
}

/* dq, dk and dv in one pass for one kv head per item (it owns the dq rows
 * of its group's query heads and its dk, dv rows): key blocks in order, then
 * the group's query heads, then the query groups' rows i0 >= j0. Every
 * output sees the same sgemms with the same operands in the same order as
 * in dq_tile32 (key blocks ascending) and dkv_tile32 (heads, then query
 * groups), so both schemes give the same bits; this one computes each
 * tile's P and dS once. */
ML_CLONES
static void dqkv_tile32(void *arg, int64_t lo, int64_t hi)
{
    const att_args *a = arg;
    int64_t S = a->S, hd = a->hd;
    float *dp, *sc = bwd_tiles(a, &dp);
    for (int64_t g = lo; g < hi; g++) {
        for (int64_t i = 0; i < S; i++) {
            for (int64_t h = g * a->group; h < (g + 1) * a->group; h++)
                memset((float *)a->dq + (i * a->H + h) * hd, 0, (size_t)hd * sizeof(float));
            memset((float *)a->dk + (i * a->KV + g) * hd, 0, (size_t)hd * sizeof(float));
            memset((float *)a->dv + (i * a->KV + g) * hd, 0, (size_t)hd * sizeof(float));
        }
        for (int64_t j0 = 0; j0 < S; j0 += FB) {
            int64_t nk = j0 + FB < S ? FB : S - j0;
            size_t koff = (size_t)((j0 * a->KV + g) * hd);
            const float *Kb = (const float *)a->k + koff, *Vb = (const float *)a->v + koff;
            float *dK = (float *)a->dk + koff, *dV = (float *)a->dv + koff;
            for (int64_t h = g * a->group; h < (g + 1) * a->group; h++)
                for (int64_t i0 = j0, i1; i0 < S; i0 = i1) {
                    i1 = qgroup_end(i0, S);
                    int64_t nq = i1 - i0;
                    size_t off = (size_t)((i0 * a->H + h) * hd);
                    const float *Qb = (const float *)a->q + off, *Gb = (const float *)a->dout + off;
                    tile_p_ds(a, h, i0, nq, j0, nk, Qb, Gb, Kb, Vb, sc, dp);
                    tile_dkv(a, nq, nk, sc, dp, Qb, Gb, dK, dV);
                    tile_dq(a, nq, nk, dp, Kb, (float *)a->dq + off);
                }
        }
    }
}

/* ml_parallel_tiles with serial GEMMs: every sgemm above runs on the
 * calling thread, on tiles fixed by the shapes */
static ml_status tiles_blas1(int64_t n, int64_t cost, const ml_kctx *ctx, ml_tile_fn fn,
                             att_args *a)
{
    int saved = ml_gemm_serial_begin();
    ml_status s = ml_parallel_tiles(n, 1, cost, ctx, fn, a);
    ml_gemm_serial_end(saved);
    return s;
}

ml_status ml_attention_forward_cpu(ml_dtype dt, void *out, double *lse, const void *q,
                                   const void *k, const void *v, int64_t Sq, int64_t Sk,
                                   int64_t H, int64_t KV, int64_t hd, void *scratch,
                                   const ml_kctx *ctx)
{
    if (dt != ML_F32 && dt != ML_F64)
        return ML_EUNSUPPORTED;
    if (hd < 1 || hd > ML_ATT_HD_MAX || KV < 1 || H % KV != 0 || Sq < 0 || Sq > Sk)
        return ML_EUNSUPPORTED;
    int64_t P = Sk - Sq;
    att_args a = {.dt = dt, .out = out, .lse_out = lse, .scratch = scratch, .q = q, .k = k,
                  .v = v, .S = Sq, .P = P, .H = H, .KV = KV, .hd = hd, .group = H / KV,
                  .scale = 1.0 / sqrt((double)hd)};
    if (dt == ML_F32)
        return tiles_blas1(H * ((Sq + QB - 1) / QB), QB * (P + Sq / 2 + 1) * hd * 4, ctx, fwd_tile32, &a);
    int64_t nqb = (Sq + BQ - 1) / BQ;
    return ml_parallel_tiles(H * nqb, 1, BQ * (P + Sq / 2 + 1) * hd * 2, ctx, fwd_tile, &a);
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
ML_CLONES
static void dq_tile(void *arg, int64_t lo, int64_t hi)
{
    const att_args *a = arg;
    int64_t S = a->S, hd = a->hd, nqb = (S + BQ - 1) / BQ;
    double *Q = my_scratch(a), *G = Q + BQ * hd, *acc = G + BQ * hd, *Kt = acc + BQ * hd;
    double *Kb = Kt + BK * hd, *Vt = Kb + BK * hd, *sc = Vt + BK * hd, *dp = sc + BQ;
    for (int64_t it = lo; it < hi; it++) {
        int64_t h = it / nqb, g = h / a->group;
        int64_t i0 = zigzag(it % nqb, nqb) * BQ, i1 = i0 + BQ < S ? i0 + BQ : S, nq = i1 - i0;
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
ML_CLONES
static void dkv_tile(void *arg, int64_t lo, int64_t hi)
{
    const att_args *a = arg;
    int64_t S = a->S, hd = a->hd, nkb = (S + BK - 1) / BK;
    double *Kt = my_scratch(a), *Vt = Kt + BK * hd, *ak = Vt + BK * hd, *av = ak + BK * hd;
    double *Q = av + BK * hd, *G = Q + hd, *sc = G + hd, *dp = sc + BQ;
    for (int64_t it = lo; it < hi; it++) {
        int64_t g = it / nkb;
        int64_t j0 = zigzag(it % nkb, nkb) * BK, j1 = j0 + BK < S ? j0 + BK : S, nk = j1 - j0;
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
    if (dt == ML_F32) {
        /* one pass over kv heads when they spread evenly over the threads,
         * else two race-free passes; the bits are the same (dqkv_tile32) */
        int nt = ml_kctx_threads(ctx);
        int64_t nb = (S + FB - 1) / FB;
        if (KV % nt == 0)
            return tiles_blas1(KV, a.group * FB * (S / 2 + 1) * hd * nb * 10, ctx, dqkv_tile32, &a);
        s = tiles_blas1(H * ((S + QT - 1) / QT), QT * (S / 2 + 1) * hd * 6, ctx, dq_tile32, &a);
        if (s != ML_OK)
            return s;
        return tiles_blas1(KV * nb, a.group * FB * (S / 2 + 1) * hd * 8, ctx, dkv_tile32, &a);
    }
    int64_t nqb = (S + BQ - 1) / BQ, nkb = (S + BK - 1) / BK;
    s = ml_parallel_tiles(H * nqb, 1, BQ * (S / 2 + 1) * hd * 4, ctx, dq_tile, &a);
    if (s != ML_OK)
        return s;
    return ml_parallel_tiles(KV * nkb, 1, a.group * BK * (S / 2 + 1) * hd * 6, ctx, dkv_tile, &a);
}
