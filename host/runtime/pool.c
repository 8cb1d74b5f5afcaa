/*
 * host/runtime/pool.c - stack pools: blocks from the ledger (category `pool`), a
 * bump pointer per block, and an allocation stack whose ids make stale
 * views detectable. See pool.h for the contract.
 */
#include "pool.h"
#include "backend.h"

#include <stdlib.h>

#define POOL_ALIGN 64

static size_t align_up(size_t n)
{
    return (n + POOL_ALIGN - 1) & ~(size_t)(POOL_ALIGN - 1);
}

/* Inside mem.plan, a pool made outside it: its blocks are real memory,
 * which a plan must not take (nor give back). */
static int outside_plan(const ml_pool *p)
{
    return p->host->planning && !ml_is_plan_ledger(p->host, p->lg);
}

/* What the device's reservation grows by for a new block of `bytes`. */
static size_t reserve_growth(const ml_memory *mem, size_t bytes)
{
    return mem->reserve_bytes ? mem->reserve_bytes(bytes) : bytes;
}

/* a - b, or 0 when b >= a */
static size_t sub_floor(size_t a, size_t b)
{
    return a > b ? a - b : 0;
}

/* A new block of `bytes` charged to the ledger under `pool`. */
static ml_pool_status add_block(ml_pool *p, size_t bytes, ml_alloc_status *astatus)
{
    ml_ledger *lg = p->lg;
    const ml_memory *mem = p->mem;
    *astatus = ML_ALLOC_OK;
    if (outside_plan(p))
        return ML_POOL_OUTSIDE_PLAN;
    if (!mem || !mem->available()) {
        *astatus = ML_ALLOC_NODEVICE;
        return ML_POOL_LEDGER;
    }
    switch (ml_ledger_check(lg, ML_CAT_POOL, bytes, reserve_growth(mem, bytes))) {
    case ML_LEDGER_OVER_TOTAL:    lg->nrefused++; *astatus = ML_ALLOC_OVER_TOTAL; return ML_POOL_LEDGER;
    case ML_LEDGER_OVER_CATEGORY: lg->nrefused++; *astatus = ML_ALLOC_OVER_CATEGORY; return ML_POOL_LEDGER;
    case ML_LEDGER_OK:            break;
    }
    ml_pool_block *nb = realloc(p->blocks, (p->nblocks + 1) * sizeof *nb);
    if (!nb)
        return ML_POOL_NOMEM;
    p->blocks = nb;
    void *data = bytes ? mem->alloc(bytes, lg) : NULL;
    if (bytes && !data) {
        *astatus = ML_ALLOC_NOMEM;
        return ML_POOL_NOMEM;
    }
    ml_ledger_charge(lg, ML_CAT_POOL, bytes);
    p->blocks[p->nblocks++] = (ml_pool_block){data, bytes, 0};
    p->capacity += bytes;
    return ML_POOL_OK;
}

ml_pool_status ml_pool_new(ml_host *h, ml_device dev, size_t bytes, int grow,
                           ml_pool **out, ml_alloc_status *astatus)
{
    *out = NULL;
    *astatus = ML_ALLOC_OK;
    if (bytes > SIZE_MAX - POOL_ALIGN)
        return ML_POOL_NOMEM;
    ml_pool *p = calloc(1, sizeof *p);
    if (!p)
        return ML_POOL_NOMEM;
    p->host = h;
    p->device = dev;
    p->lg = h->ledger[dev];
    p->mem = h->mem[dev];
    p->refs = 1;
    p->grow = grow;
    ml_pool_status s = add_block(p, align_up(bytes), astatus);
    if (s != ML_POOL_OK) {
        free(p->blocks);
        free(p);
        return s;
    }
    h->plan_live += h->planning;
    *out = p;
    return ML_POOL_OK;
}

ml_pool_status ml_pool_alloc(ml_pool *p, size_t nbytes, void **data, size_t *slot, uint64_t *id,
                             ml_alloc_status *astatus)
{
    *astatus = ML_ALLOC_OK;
    if (nbytes > SIZE_MAX - POOL_ALIGN)
        return ML_POOL_NOMEM;
    size_t need = align_up(nbytes);
    /* The stack fills blocks in order; blocks after the top slot's block
     * are empty, so after a rewind they are reused before the pool grows,
     * and a warmed-up step allocates nothing new. */
    size_t bi = p->nslots ? p->slots[p->nslots - 1].block : 0;
    while (bi < p->nblocks && p->blocks[bi].size - p->blocks[bi].used < need)
        bi++;
    if (bi == p->nblocks) {
        p->noverflow++;
        if (!p->grow)
            return ML_POOL_FULL;
        /* grow by at least the current capacity, so growth is geometric */
        size_t add = need > p->capacity ? need : p->capacity;
        ml_pool_status s = add_block(p, add, astatus);
        if (s != ML_POOL_OK)
            return s;
    }
    ml_pool_block *b = &p->blocks[bi];
    if (p->nslots == p->cap_slots) {
        size_t cap = p->cap_slots ? 2 * p->cap_slots : 64;
        ml_pool_slot *ns = realloc(p->slots, cap * sizeof *ns);
        if (!ns)
            return ML_POOL_NOMEM;
        p->slots = ns;
        p->cap_slots = cap;
    }
    ml_pool_slot *s = &p->slots[p->nslots];
    s->block = bi;
    s->offset = b->used;
    s->nbytes = need;
    s->id = ++p->next_id;
    b->used += need;
    p->used += need;
    if (p->used > p->high_water)
        p->high_water = p->used;
    *data = (char *)b->data + s->offset;
    *slot = p->nslots++;
    *id = s->id;
    return ML_POOL_OK;
}

size_t ml_pool_mark(const ml_pool *p)
{
    return p->nslots;
}

/* An empty pool's blocks replaced by one block of `bytes`. No view is live:
 * every slot is gone, and stale views never touch their data. If the new
 * block is refused the pool is left without blocks and grows again on
 * demand (or, without grow, is full). */
static ml_pool_status rebuild(ml_pool *p, size_t bytes, ml_alloc_status *astatus)
{
    for (size_t i = 0; i < p->nblocks; i++) {
        ml_ledger_credit(p->lg, ML_CAT_POOL, p->blocks[i].size);
        if (p->blocks[i].data)
            p->mem->free(p->blocks[i].data, p->blocks[i].size, p->lg);
    }
    p->nblocks = 0;
    p->capacity = 0;
    return add_block(p, align_up(bytes), astatus);
}

ml_pool_status ml_pool_reserve(ml_pool *p, size_t bytes, ml_alloc_status *astatus)
{
    *astatus = ML_ALLOC_OK;
    if (p->nslots)
        return ML_POOL_BUSY;
    if (outside_plan(p))
        return ML_POOL_OUTSIDE_PLAN;
    if (bytes > SIZE_MAX - POOL_ALIGN)
        return ML_POOL_NOMEM;
    bytes = align_up(bytes);
    if (p->nblocks == 1 && p->capacity == bytes)
        return ML_POOL_OK;
    /* Asked as if the old blocks were returned already, so that a refusal
     * keeps them. They hold at least their own sizes of the device's
     * reservation (a caching allocator rounds up), so a reserve that passes
     * here fits once they are given back. */
    switch (ml_ledger_check(p->lg, ML_CAT_POOL, sub_floor(bytes, p->capacity),
                            sub_floor(reserve_growth(p->mem, bytes), p->capacity))) {
    case ML_LEDGER_OVER_TOTAL:    p->lg->nrefused++; *astatus = ML_ALLOC_OVER_TOTAL; return ML_POOL_LEDGER;
    case ML_LEDGER_OVER_CATEGORY: p->lg->nrefused++; *astatus = ML_ALLOC_OVER_CATEGORY; return ML_POOL_LEDGER;
    case ML_LEDGER_OK:            break;
    }
    return rebuild(p, bytes, astatus);
}

void ml_pool_rewind(ml_pool *p, size_t mark)
{
    while (p->nslots > mark) {
        ml_pool_slot *s = &p->slots[--p->nslots];
        p->blocks[s->block].used = s->offset;
        p->used -= s->nbytes;
    }
    /* a pool that grew: one block of its high-water mark, so what it holds
     * from the ledger is what a step needs (not the geometric overshoot of
     * growing), and the next step, which fits that block, allocates nothing */
    ml_alloc_status as;
    if (mark == 0 && p->nblocks > 1 && !outside_plan(p))
        rebuild(p, p->high_water, &as);
}

int ml_pool_view_valid(const ml_pool *p, size_t slot, uint64_t id)
{
    return slot < p->nslots && p->slots[slot].id == id;
}

void ml_pool_retain(ml_pool *p)
{
    p->refs++;
}

void ml_pool_release(ml_pool *p)
{
    if (--p->refs > 0)
        return;
    for (size_t i = 0; i < p->nblocks; i++) {
        ml_ledger_credit(p->lg, ML_CAT_POOL, p->blocks[i].size);
        if (p->blocks[i].data)
            p->mem->free(p->blocks[i].data, p->blocks[i].size, p->lg);
    }
    p->host->plan_live -= ml_is_plan_ledger(p->host, p->lg);
    free(p->blocks);
    free(p->slots);
    free(p);
}
