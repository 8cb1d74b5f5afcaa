/*
 * kernels/parallel.h - the CPU kernels' one way to split work: fixed tiles,
 * statically scheduled over OpenMP threads, with the interrupt flag polled
 * between tiles (never inside one). Tile boundaries depend only on n and
 * the tile size, so a kernel whose tiles write disjoint outputs is
 * bit-identical for every thread count.
 */
#ifndef ML_KERNELS_PARALLEL_H
#define ML_KERNELS_PARALLEL_H

#include "core.h"

typedef void (*ml_tile_fn)(void *arg, int64_t lo, int64_t hi);

/* Calls fn(arg, lo, hi) over [0, n) in tiles of `tile` items; threads are
 * used when n * cost_per_item exceeds ML_PAR_MIN. Returns ML_EINTERRUPTED
 * if the flag was raised before every tile ran. */
ml_status ml_parallel_tiles(int64_t n, int64_t tile, int64_t cost_per_item,
                            const ml_kctx *ctx, ml_tile_fn fn, void *arg);

#endif
