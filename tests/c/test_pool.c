/*
 * tests/c/test_pool.c - stack pools (host/runtime/pool.c) on a host built by hand
 * with the CPU backend, printing TAP.
 *
 * Covers: the first block charged to the ledger under `pool`, 64-byte
 * alignment, mark/rewind LIFO, the high-water mark, stale ids after a rewind
 * and a re-allocation of the same bytes, growth by a new block that leaves
 * live data in place, ML_POOL_FULL with grow off, ledger budgets refusing a
 * new pool or growth (total and category), a missing device, and release
 * returning every byte once the last reference goes. Not here: the Lua
 * binding (tests/spec/pool_spec.lua).
 */
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "backend.h"
#include "pool.h"
#include "tap.h"


/* One allocation; returns its data (NULL on failure) and the status. */
typedef struct {
    void *data;
    size_t slot;
    uint64_t id;
    ml_pool_status s;
    ml_alloc_status as;
} alloc_result;

static alloc_result alloc(ml_pool *p, size_t n)
{
    alloc_result r = {0};
    r.s = ml_pool_alloc(p, n, &r.data, &r.slot, &r.id, &r.as);
    return r;
}

static int aligned(const void *ptr)
{
    return ((uintptr_t)ptr & 63) == 0;
}

static void test_new_and_alloc(void)
{
    ml_host h;
    ml_host_init(&h);
    ml_ledger *lg = &h.books[ML_CPU];
    ml_pool *p;
    ml_alloc_status as;
    ok(ml_pool_new(&h, ML_CPU, 1000, 0, &p, &as) == ML_POOL_OK && p && as == ML_ALLOC_OK,
       "new: a pool of 1000 bytes");
    ok(p->capacity == 1024 && p->nblocks == 1 && p->used == 0 && p->nslots == 0,
       "new: the block is rounded up to 64 bytes");
    ok(lg->cur[ML_CAT_POOL] == 1024 && lg->total == 1024 && lg->nalloc[ML_CAT_POOL] == 1,
       "new: the block is charged to the ledger under pool");
    ok(aligned(p->blocks[0].data), "new: the block is 64-byte aligned");

    alloc_result a = alloc(p, 1), b = alloc(p, 100), c = alloc(p, 64);
    ok(a.s == ML_POOL_OK && b.s == ML_POOL_OK && c.s == ML_POOL_OK, "alloc: three slots fit");
    ok(aligned(a.data) && aligned(b.data) && aligned(c.data), "alloc: every slot is 64-byte aligned");
    ok((char *)b.data == (char *)a.data + 64 && (char *)c.data == (char *)b.data + 128,
       "alloc: slots are packed in order, each rounded up to 64 bytes");
    ok(p->used == 256 && p->nslots == 3 && a.slot == 0 && b.slot == 1 && c.slot == 2,
       "alloc: used bytes and the slot stack");
    ok(a.id != b.id && b.id != c.id && a.id != c.id, "alloc: every allocation has its own id");
    ok(lg->total == 1024 && lg->nalloc[ML_CAT_POOL] == 1, "alloc: carving a slot does not touch the ledger");
    ok(ml_pool_view_valid(p, a.slot, a.id) && ml_pool_view_valid(p, c.slot, c.id),
       "alloc: live views are valid");
    ok(!ml_pool_view_valid(p, a.slot, b.id) && !ml_pool_view_valid(p, 7, a.id),
       "view_valid: a wrong id or a slot above the stack is not valid");
    memset(a.data, 0xab, 1);
    memset(b.data, 0xcd, 100);
    memset(c.data, 0xef, 64);
    ok(((unsigned char *)a.data)[0] == 0xab && ((unsigned char *)b.data)[99] == 0xcd,
       "alloc: slots do not overlap");
    ml_pool_release(p);
    ok(lg->total == 0 && lg->cur[ML_CAT_POOL] == 0 && lg->nfree[ML_CAT_POOL] == 1,
       "release: the block returns to the ledger");
    ml_host_free(&h);
}

static void test_mark_rewind(void)
{
    ml_host h;
    ml_host_init(&h);
    ml_pool *p;
    ml_alloc_status as;
    ml_pool_new(&h, ML_CPU, 4096, 0, &p, &as);
    alloc_result frame = alloc(p, 128);                 /* a layer's saved frame */
    size_t m = ml_pool_mark(p);
    ok(m == 1, "mark: the stack depth");
    alloc_result t1 = alloc(p, 256), t2 = alloc(p, 512);  /* transients */
    size_t m2 = ml_pool_mark(p);
    alloc_result t3 = alloc(p, 64);
    ok(p->used == 128 + 256 + 512 + 64 && p->high_water == p->used, "high water: follows used while growing");
    ml_pool_rewind(p, m2);
    ok(p->nslots == 3 && p->used == 128 + 256 + 512 && !ml_pool_view_valid(p, t3.slot, t3.id) &&
       ml_pool_view_valid(p, t2.slot, t2.id), "rewind: pops only the slots above the inner mark (LIFO)");
    ml_pool_rewind(p, m);
    ok(p->nslots == 1 && p->used == 128, "rewind: back to the outer mark");
    ok(ml_pool_view_valid(p, frame.slot, frame.id), "rewind: a view below the mark stays valid");
    ok(!ml_pool_view_valid(p, t1.slot, t1.id) && !ml_pool_view_valid(p, t2.slot, t2.id),
       "rewind: views above the mark are stale");
    ok(p->high_water == 128 + 256 + 512 + 64, "high water: kept after rewinding");

    alloc_result r = alloc(p, 256);
    ok(r.data == t1.data && r.slot == t1.slot, "realloc: the rewound bytes and slot are reused");
    ok(r.id != t1.id && !ml_pool_view_valid(p, t1.slot, t1.id) && ml_pool_view_valid(p, r.slot, r.id),
       "realloc: the old view stays stale although its slot is live again");
    ml_pool_rewind(p, ml_pool_mark(p));
    ok(p->nslots == 2, "rewind: to the current depth is a no-op");
    ml_pool_rewind(p, 0);
    ok(p->nslots == 0 && p->used == 0 && p->blocks[0].used == 0 && !ml_pool_view_valid(p, frame.slot, frame.id),
       "rewind: to 0 empties the pool");
    alloc_result again = alloc(p, 8);
    ok(again.data == frame.data && again.id > r.id, "rewind: ids keep increasing after a reset");
    ml_pool_release(p);
    ok(h.books[ML_CPU].total == 0, "release: ledger empty");
    ml_host_free(&h);
}

static void test_slot_stack_grows(void)
{
    ml_host h;
    ml_host_init(&h);
    ml_pool *p;
    ml_alloc_status as;
    ml_pool_new(&h, ML_CPU, 64 * 200, 0, &p, &as);
    alloc_result first = alloc(p, 1), last = first;
    int all = first.s == ML_POOL_OK;
    for (int i = 1; i < 200; i++) {
        last = alloc(p, 1);
        all &= last.s == ML_POOL_OK;
    }
    ok(all && p->nslots == 200 && ml_pool_view_valid(p, first.slot, first.id) &&
       ml_pool_view_valid(p, last.slot, last.id), "alloc: more slots than the first stack holds");
    ok(alloc(p, 1).s == ML_POOL_FULL, "alloc: exactly full after 200 slots of 64 bytes");
    ml_pool_release(p);
    ml_host_free(&h);
}

static void test_grow(void)
{
    ml_host h;
    ml_host_init(&h);
    ml_ledger *lg = &h.books[ML_CPU];
    ml_pool *p;
    ml_alloc_status as;
    ml_pool_new(&h, ML_CPU, 256, 1, &p, &as);
    alloc_result a = alloc(p, 200);
    memset(a.data, 0x5a, 200);
    alloc_result b = alloc(p, 100);
    ok(b.s == ML_POOL_OK && p->nblocks == 2 && p->noverflow == 1, "grow: an overflow adds a block and is recorded");
    ok(p->capacity == 512 && lg->cur[ML_CAT_POOL] == 512 && lg->nalloc[ML_CAT_POOL] == 2,
       "grow: the new block (at least the old capacity) is charged under pool");
    int intact = 1;
    for (int i = 0; i < 200; i++)
        intact &= ((unsigned char *)a.data)[i] == 0x5a;
    ok(p->blocks[0].data == (char *)a.data && intact && ml_pool_view_valid(p, a.slot, a.id),
       "grow: live data is neither moved nor touched");
    ok(b.data == p->blocks[1].data && aligned(b.data), "grow: the new slot is at the start of the new block");
    alloc_result big = alloc(p, 5000);
    ok(big.s == ML_POOL_OK && p->nblocks == 3 && p->blocks[2].size >= 5000 && p->noverflow == 2,
       "grow: a request larger than the capacity gets a block that fits it");
    ml_pool_rewind(p, 1);                 /* a partial rewind keeps every block */
    alloc_result b2 = alloc(p, 100);
    ok(b2.s == ML_POOL_OK && p->nblocks == 3 && p->noverflow == 2 && b2.data == p->blocks[1].data,
       "grow: after a partial rewind, later blocks are reused before the pool grows");
    size_t hw = p->high_water;
    ok(hw == 256 + 128 + 5056, "grow: the high-water mark counts the aligned live bytes");
    ml_pool_rewind(p, 0);
    ok(p->nblocks == 1 && p->capacity == hw && lg->cur[ML_CAT_POOL] == hw &&
       lg->nfree[ML_CAT_POOL] == 3 && lg->nalloc[ML_CAT_POOL] == 4,
       "grow: rewinding a grown pool to empty consolidates it into one block of the high-water mark");
    alloc_result r1 = alloc(p, 200), r2 = alloc(p, 100), r3 = alloc(p, 5000);
    ok(r1.s == ML_POOL_OK && r2.s == ML_POOL_OK && r3.s == ML_POOL_OK && p->nblocks == 1 &&
       p->noverflow == 2 && lg->nalloc[ML_CAT_POOL] == 4,
       "grow: the consolidated pool replays the same step without growing");
    ml_pool_rewind(p, 0);
    ok(p->nblocks == 1 && lg->nalloc[ML_CAT_POOL] == 4, "grow: a pool of one block is not consolidated again");
    ml_pool_release(p);
    ok(lg->total == 0 && lg->nfree[ML_CAT_POOL] == 4, "release: every block returns to the ledger");
    ml_host_free(&h);
}

static void test_full(void)
{
    ml_host h;
    ml_host_init(&h);
    ml_pool *p;
    ml_alloc_status as;
    ml_pool_new(&h, ML_CPU, 256, 0, &p, &as);
    alloc_result a = alloc(p, 192);
    alloc_result b = alloc(p, 65);
    ok(b.s == ML_POOL_FULL && p->noverflow == 1, "full: grow off, an overflow is ML_POOL_FULL and recorded");
    ok(p->nslots == 1 && p->used == 192 && p->nblocks == 1 && p->capacity == 256 &&
       h.books[ML_CPU].total == 256, "full: nothing changed");
    ok(ml_pool_view_valid(p, a.slot, a.id), "full: live views stay valid");
    ok(alloc(p, 64).s == ML_POOL_OK && p->used == 256, "full: what still fits is allocated");
    ml_pool_release(p);
    ml_host_free(&h);
}

static void test_ledger_refuses(void)
{
    ml_host h;
    ml_host_init(&h);
    ml_ledger *lg = &h.books[ML_CPU];
    ml_pool *p = (ml_pool *)&h;
    ml_alloc_status as;

    lg->budget[ML_CAT_POOL] = 1000;
    ok(ml_pool_new(&h, ML_CPU, 2000, 1, &p, &as) == ML_POOL_LEDGER && p == NULL &&
       as == ML_ALLOC_OVER_CATEGORY, "new: refused by the pool budget");
    ok(lg->total == 0 && lg->nrefused == 1 && lg->nalloc[ML_CAT_POOL] == 0, "new: a refusal charges nothing");

    ok(ml_pool_new(&h, ML_CPU, 512, 1, &p, &as) == ML_POOL_OK, "new: within the budget");
    alloc_result a = alloc(p, 512);
    memset(a.data, 7, 512);
    alloc_result b = alloc(p, 64);   /* growth needs 512 more: 1024 > 1000 */
    ok(b.s == ML_POOL_LEDGER && b.as == ML_ALLOC_OVER_CATEGORY, "grow: refused by the pool budget");
    ok(p->nblocks == 1 && p->capacity == 512 && p->nslots == 1 && lg->cur[ML_CAT_POOL] == 512 &&
       lg->nrefused == 2, "grow: a refusal leaves the pool and the ledger as they were");
    ok(ml_pool_view_valid(p, a.slot, a.id) && ((unsigned char *)a.data)[511] == 7,
       "grow: a refusal leaves live views valid");

    lg->budget[ML_CAT_POOL] = 0;
    lg->budget_total = 1000;
    b = alloc(p, 64);
    ok(b.s == ML_POOL_LEDGER && b.as == ML_ALLOC_OVER_TOTAL, "grow: refused by the total budget");
    lg->budget_total = 1024;
    b = alloc(p, 64);
    ok(b.s == ML_POOL_OK && p->nblocks == 2 && lg->total == 1024, "grow: allowed up to the budget exactly");
    ml_pool_release(p);
    ok(lg->total == 0, "release: ledger empty");
    ml_host_free(&h);
}

static void test_no_device(void)
{
    ml_host h;
    ml_host_init(&h);
    ml_pool *p;
    ml_alloc_status as;
    ok(ml_pool_new(&h, ML_CUDA, 1024, 0, &p, &as) == ML_POOL_LEDGER && as == ML_ALLOC_NODEVICE && !p,
       "new: a device without a backend is refused");
    ok(h.books[ML_CUDA].total == 0, "new: nothing charged on that device");
    ml_host_free(&h);
}

static void test_release_refs(void)
{
    ml_host h;
    ml_host_init(&h);
    ml_ledger *lg = &h.books[ML_CPU];
    ml_pool *p;
    ml_alloc_status as;
    ml_pool_new(&h, ML_CPU, 128, 1, &p, &as);
    alloc(p, 128);
    alloc(p, 128);                         /* a second block */
    ml_pool_retain(p);                     /* two views */
    ml_pool_retain(p);
    ml_pool_release(p);                    /* the Lua object goes */
    ok(lg->cur[ML_CAT_POOL] == 256, "release: live views keep the blocks charged");
    ml_pool_release(p);
    ok(lg->cur[ML_CAT_POOL] == 256, "release: until the last reference");
    ml_pool_release(p);
    ok(lg->total == 0 && lg->cur[ML_CAT_POOL] == 0 && lg->nfree[ML_CAT_POOL] == lg->nalloc[ML_CAT_POOL],
       "release: the last reference returns every byte and every block");

    ml_pool_new(&h, ML_CPU, 0, 1, &p, &as);
    alloc_result a = alloc(p, 10);
    ok(a.s == ML_POOL_OK && p->nblocks == 2 && aligned(a.data), "new: a zero-byte pool grows on first use");
    ml_pool_release(p);
    ok(lg->total == 0, "release: a grown empty pool returns everything");
    ml_host_free(&h);
}

int main(void)
{
    test_new_and_alloc();
    test_mark_rewind();
    test_slot_stack_grows();
    test_grow();
    test_full();
    test_ledger_refuses();
    test_no_device();
    test_release_refs();
    return tap_done();
}
