/*
 * kernels/dispatch.c - the counting sort of kernels/dispatch.h on the CPU.
 * Sequential: O(T·k + E) integer work is microseconds next to the expert
 * GEMMs, and one pass in (t, j) order is what makes it stable and makes
 * "the first cap assignments" well defined.
 */
#include "dispatch.h"

ml_status ml_dispatch_cpu(int64_t *offsets, int64_t *order, int64_t *counts, uint8_t *dropped,
                          int64_t *ndropped, const int64_t *idx, int64_t n, int64_t E,
                          int64_t cap, void *scratch, const ml_kctx *ctx)
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
        int64_t kept = cap >= 0 && counts[e] > cap ? cap : counts[e];
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
