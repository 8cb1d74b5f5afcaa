/*
 * kernels/dispatch.c - the counting sort of kernels/dispatch.h on the CPU,
 * and pack / unpack of a plan's rows.
 * The sort is sequential: O(T·k + E) integer work is microseconds next to
 * the expert GEMMs, and one pass in (t, j) order is what makes it stable
 * and makes "the first cap assignments" well defined. Pack splits rows
 * over threads, unpack columns (every thread walks all positions, so each
 * output element's sum runs in position order).
 */
#include "dispatch.h"
#include "parallel.h"

ml_status ml_dispatch_cpu(int64_t *offsets, int64_t *order, int64_t *counts, uint8_t *dropped,
                          int64_t *ndropped, const int64_t *idx, int64_t n, int64_t E,
                          int64_t cap, const int64_t *caps, void *scratch, const ml_kctx *ctx)
{
    if (ml_kctx_interrupted(ctx))
        return ML_EINTERRUPTED;
    /* histogram of all assignments (counts doubles as it) */
    for (int64_t e = 0; e < E; e++)
        counts[e] = 0;
    for (int64_t a = 0; a < n; a++)
        counts[idx[a]]++;
    /* kept per expert -> offsets; counts becomes the fill cursor */
    offsets[0] = 0;
    for (int64_t e = 0; e < E; e++) {
        int64_t c = caps ? caps[e] : cap;
        int64_t kept = c >= 0 && counts[e] > c ? c : counts[e];
        offsets[e + 1] = offsets[e] + kept;
        counts[e] = 0;
    }
    int64_t nkept = offsets[E], nd = 0;
    for (int64_t a = 0; a < n; a++) {
        int64_t e = idx[a];
        if (offsets[e] + counts[e] < offsets[e + 1]) {
            order[offsets[e] + counts[e]++] = a;
            dropped[a] = 0;
        } else {
            order[nkept + nd++] = a;
            dropped[a] = 1;
        }
    }
    *ndropped = nd;
    return ML_OK;
}

/* ---- pack and unpack ---------------------------------------------------- */

typedef struct {
    ml_dtype dt; void *out; const void *in; const int64_t *order;
    int64_t n, cols, div; size_t esz;
} rows_arg;

/* Rows [lo, hi) of out. */
static void pack_tile(void *p, int64_t lo, int64_t hi)
{
    const rows_arg *g = p;
    size_t row = (size_t)g->cols * g->esz;
    for (int64_t q = lo; q < hi; q++)
        memcpy((char *)g->out + (size_t)q * row,
               (const char *)g->in + (size_t)(g->order[q] / g->div) * row, row);
}

ml_status ml_dispatch_pack_cpu(ml_dtype dt, void *out, const void *in, const int64_t *order,
                               int64_t n, int64_t cols, int64_t div, const ml_kctx *ctx)
{
    if (n == 0 || cols == 0)   /* nothing to copy, and an empty tensor may have no buffer */
        return ML_OK;
    rows_arg g = {dt, out, in, order, n, cols, div, ml_dtype_size(dt)};
    return ml_parallel_tiles(n, 64, cols, ctx, pack_tile, &g);
}

/* Columns [lo, hi) of out, every position p in order. */
static void unpack_tile(void *p, int64_t lo, int64_t hi)
{
    const rows_arg *g = p;
    for (int64_t q = 0; q < g->n; q++) {
        int64_t r = g->order[q] / g->div;
        if (g->dt == ML_F32) {
            float *y = (float *)g->out + r * g->cols;
            const float *x = (const float *)g->in + q * g->cols;
            for (int64_t c = lo; c < hi; c++)
                y[c] += x[c];
        } else {
            double *y = (double *)g->out + r * g->cols;
            const double *x = (const double *)g->in + q * g->cols;
            for (int64_t c = lo; c < hi; c++)
                y[c] += x[c];
        }
    }
}

ml_status ml_dispatch_unpack_cpu(ml_dtype dt, void *out, const void *in, const int64_t *order,
                                 int64_t n, int64_t cols, int64_t div, int64_t rows_out,
                                 void *scratch, const ml_kctx *ctx)
{
    if (dt != ML_F32 && dt != ML_F64)
        return ML_EUNSUPPORTED;
    if (n == 0 || cols == 0)
        return ML_OK;
    rows_arg g = {dt, out, in, order, n, cols, div, ml_dtype_size(dt)};
    return ml_parallel_tiles(cols, 64, n, ctx, unpack_tile, &g);
}

/* ---- validation ----------------------------------------------------------- */

int64_t ml_dispatch_find_bad_cpu(const int64_t *idx, int64_t n, int64_t E, void *scratch,
                                 const ml_kctx *ctx)
{
    (void)ctx;   /* sequential: a scan is cheaper than forking */
    for (int64_t a = 0; a < n; a++)
        if (idx[a] < 0 || idx[a] >= E)
            return a;
    return -1;
}

int64_t ml_dispatch_check_plan_cpu(const int64_t *offsets, const int64_t *order,
                                   const int64_t *idx, int64_t n, int64_t E, void *scratch,
                                   const ml_kctx *ctx)
{
    (void)ctx;   /* sequential */
    if (offsets[0] != 0)
        return -2;
    for (int64_t e = 0; e < E; e++)
        if (offsets[e + 1] < offsets[e] || offsets[e + 1] > n)
            return -2 - (e + 1);
    for (int64_t e = 0; e < E; e++)
        for (int64_t p = offsets[e]; p < offsets[e + 1]; p++)
            if (order[p] < 0 || order[p] >= n || idx[order[p]] != e ||
                (p > offsets[e] && order[p - 1] >= order[p]))
                return p;   /* out of range, other expert, or not increasing (a duplicate) */
    return -1;
}

/* ---- the CUDA twin's sizing (dispatch.cu), plain C for plans ------------- */

#define CUDA_MIN_TILE 2048                /* 64 steps of one warp */
#define CUDA_MAX_RANKS ((int64_t)1 << 22) /* (tile, expert) ranks: 32 MiB of int64 */

/* CUDA_MIN_TILE, or longer when n·E would need more than CUDA_MAX_RANKS ranks. */
int64_t ml_dispatch_cuda_tile(int64_t n, int64_t E)
{
    int64_t e = E > 0 ? E : 1;
    int64_t max_tiles = CUDA_MAX_RANKS / e > 0 ? CUDA_MAX_RANKS / e : 1;
    int64_t t = (n + max_tiles - 1) / max_tiles;
    return t > CUDA_MIN_TILE ? t : CUDA_MIN_TILE;
}

/* Unpack: one position per assignment, rows_out·div of them. */
size_t ml_dispatch_unpack_scratch_bytes_cuda(int64_t rows_out, int64_t div)
{
    return (size_t)(rows_out > 0 && div > 0 ? rows_out * div : 0) * sizeof(int64_t);
}

/* Sort: the int64 ranks [B, E] then the drops [B] of B tiles. A validator:
 * its two result slots (first bad position, bad offset). */
size_t ml_dispatch_scratch_bytes_cuda(int64_t n, int64_t E, int check)
{
    if (check)
        return 2 * sizeof(int64_t);
    int64_t tile = ml_dispatch_cuda_tile(n, E);
    int64_t B = n > 0 ? (n + tile - 1) / tile : 0;
    return (size_t)(B * (E > 0 ? E : 0) + B) * sizeof(int64_t);
}
