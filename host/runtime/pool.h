/*
 * host/runtime/pool.h - stack pools (DESIGN.md, Pools): one block taken from the
 * ledger under `pool`, carved by a bump pointer into zero-copy views.
 *
 * Forward pushes each layer's frame; backward marks, allocates transients,
 * rewinds, and pops (LIFO). Every allocation is a slot on the pool's stack
 * with a unique id; a view is valid only while its slot still holds its id,
 * so a view used after its frame was rewound is an error, never a read of
 * reused memory. Overflow either raises (ML_POOL_FULL) or grows the pool by
 * a new block from the ledger (recorded in `noverflow`); blocks never move,
 * so live views stay valid when the pool grows. Rewinding a grown pool to
 * empty consolidates it into one block of its high-water mark.
 */
#ifndef ML_POOL_H
#define ML_POOL_H

#include "tensor.h"

typedef struct {
    void *data;
    size_t size, used;
} ml_pool_block;

typedef struct {
    size_t block, offset, nbytes;
    uint64_t id;
} ml_pool_slot;

typedef struct ml_pool {
    ml_host *host;
    ml_device device;
    ml_ledger *lg;            /* the book and table its blocks come from */
    const struct ml_memory *mem;
    int refs;                 /* the Lua object + each live view */
    int grow;                 /* overflow policy: 1 grow, 0 raise */
    ml_pool_block *blocks;
    size_t nblocks;
    ml_pool_slot *slots;      /* the allocation stack */
    size_t nslots, cap_slots;
    uint64_t next_id;
    size_t used, high_water;  /* bytes in live slots, and their maximum */
    size_t capacity;          /* sum of block sizes */
    uint64_t noverflow;       /* allocations that did not fit the blocks */
} ml_pool;

typedef enum {
    ML_POOL_OK = 0,
    ML_POOL_FULL,             /* no room and the policy is to raise */
    ML_POOL_LEDGER,           /* growing was refused by the ledger (see alloc status) */
    ML_POOL_NOMEM,
    ML_POOL_BUSY,             /* ml_pool_reserve on a pool with live slots */
    ML_POOL_OUTSIDE_PLAN      /* new blocks asked inside mem.plan for a pool made outside it */
} ml_pool_status;

/* A pool of `bytes` on `dev`. On ML_POOL_LEDGER *astatus says why. */
ml_pool_status ml_pool_new(ml_host *h, ml_device dev, size_t bytes, int grow,
                           ml_pool **out, ml_alloc_status *astatus);
/* Push a slot of nbytes (aligned to 64 bytes). */
ml_pool_status ml_pool_alloc(ml_pool *p, size_t nbytes, void **data, size_t *slot, uint64_t *id,
                             ml_alloc_status *astatus);
/* A mark is the stack depth; rewinding to it pops every slot above. Rewinding
 * to 0 a pool that grew replaces its blocks by one block of the high-water
 * mark (a ledger reallocation once, after the first step). */
size_t ml_pool_mark(const ml_pool *p);
void ml_pool_rewind(ml_pool *p, size_t mark);
/* An empty pool (no live slot) made one block of `bytes`, e.g. the
 * high-water mark a memory plan predicted, so the first step does not
 * grow it either. ML_POOL_BUSY with live slots; ML_POOL_LEDGER when a
 * budget refuses the change (the pool is then unchanged). */
ml_pool_status ml_pool_reserve(ml_pool *p, size_t bytes, ml_alloc_status *astatus);
int ml_pool_view_valid(const ml_pool *p, size_t slot, uint64_t id);
void ml_pool_retain(ml_pool *p);
/* Drops one reference; the last one returns every block to the ledger. */
void ml_pool_release(ml_pool *p);

#endif
