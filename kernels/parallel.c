/*
 * kernels/parallel.c - fixed-tile static scheduling with interrupt polling.
 */
#include "parallel.h"

#include <omp.h>

ml_status ml_parallel_tiles(int64_t n, int64_t tile, int64_t cost_per_item,
                            const ml_kctx *ctx, ml_tile_fn fn, void *arg)
{
    if (n <= 0)
        return ML_OK;
    if (tile < 1)
        tile = 1;
    int64_t ntiles = (n + tile - 1) / tile;
    int nt = ml_kctx_threads(ctx);
    int64_t cost = cost_per_item > 0 ? cost_per_item : 1;
    int par = nt > 1 && ntiles > 1 && n > ML_PAR_MIN / cost;   /* n * cost > ML_PAR_MIN, without overflow */
    int skipped = 0;
    #pragma omp parallel for schedule(static) num_threads(nt) if (par)
    for (int64_t t = 0; t < ntiles; t++) {
        if (omp_get_thread_num() == 0)
            ml_kctx_progress(ctx);
        if (ml_kctx_interrupted(ctx)) {
            #pragma omp atomic write
            skipped = 1;
            continue;
        }
        int64_t lo = t * tile, hi = lo + tile < n ? lo + tile : n;
        fn(arg, lo, hi);
    }
    return skipped ? ML_EINTERRUPTED : ML_OK;
}
