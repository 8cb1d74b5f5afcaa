/*
 * host/runtime/backend_cuda.h - what the CUDA backend offers beyond the ml_backend
 * table (host/runtime/backend.h): the caching allocator's statistics and cache
 * release, device memory info for the ledger's untracked remainder, the
 * reason CUDA is unavailable, and shutdown. `make CUDA=1` builds only.
 *
 * The allocator is process-wide (one device, driven by the thread that
 * owns the Lua state). Sizes are rounded (512 B up to 1 MiB, then 2 MiB
 * steps); freed blocks wait in per-size free lists and are reused by the
 * next request whose rounded size is within 1/8 below the block's (best
 * fit). When cudaMalloc fails, every
 * cached block is released and the call retried once. Blocks are reused
 * in stream order: kernels run on one stream.
 */
#ifndef ML_BACKEND_CUDA_H
#define ML_BACKEND_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "ledger.h"

typedef struct {
    size_t reserved;          /* bytes held from cudaMalloc (live + cached) */
    size_t allocated;         /* rounded bytes of live blocks */
    size_t cached;            /* rounded bytes waiting in free lists */
    size_t requested;         /* bytes asked for by live blocks (before rounding) */
    uint64_t nmalloc;         /* cudaMalloc calls that succeeded */
    uint64_t nhits;           /* allocations served from the cache */
    uint64_t nflush;          /* cache releases (OOM retry, budget, empty_cache) */
    uint64_t nfail;           /* allocations that failed after the retry */
} ml_cuda_alloc_stats;

void ml_cuda_alloc_get_stats(ml_cuda_alloc_stats *s);

/* Return every cached block to the device; reports reserved to lg (may be NULL). */
void ml_cuda_empty_cache(ml_ledger *lg);

/* cudaMemGetInfo; 0 on success, -1 (and *free = *total = 0) otherwise. */
int ml_cuda_mem_info(size_t *free_bytes, size_t *total_bytes);

/* Why ml_backend_cuda.available() said no ("" when it said yes or was not asked). */
const char *ml_cuda_unavailable_reason(void);

/* The last CUDA/cuBLAS error as text, for ML_EDEVICE messages. */
const char *ml_cuda_last_error(void);

/* After the Lua state is closed and the ledger checked: drop the cache, the
 * cuBLAS handle, and reset the device. Safe when CUDA was never used. */
void ml_cuda_shutdown(void);

#endif
