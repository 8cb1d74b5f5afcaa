/*
 * tests/c/test_unit.c - flat units (host/runtime/unit.c) and released
 * storage (host/runtime/tensor.c: ml_storage_release_memory /
 * ml_storage_acquire) on a host built by hand with the CPU backend,
 * printing TAP.
 *
 * Covers: segment offsets and sizes, the checks of ml_unit_add (names,
 * sizes, overflow, weight decay, lr multiplier, experts) leaving the unit
 * unchanged, find; partitions of 10 elements over 1..4 ranks (a last rank
 * with len 0); pieces across segment boundaries and in the padding; the
 * ledger through release, acquire and free (exact bytes, counts), the
 * unusable message, budgets refusing an acquire, and the same inside a
 * memory plan on its books. Not here: the Lua binding
 * (tests/spec/unit_spec.lua).
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "plan.h"
#include "unit.h"
#include "tap.h"


static ml_segment seg(const char *name, int ndim, const int64_t *shape)
{
    ml_segment s = {0};
    snprintf(s.name, sizeof s.name, "%s", name);
    s.ndim = ndim;
    memcpy(s.shape, shape, (size_t)ndim * sizeof *shape);
    s.weight_decay = NAN;
    s.lr_mult = 1;
    return s;
}

/* The unit of the binding's example: q [4,4], norm [4], wg [2,4], gate_up [2,3,4] (2 experts). */
static void build(ml_unit *u)
{
    ml_err e;
    ml_unit_init(u, "layers.0", &e);
    ml_segment q = seg("q", 2, (int64_t[]){4, 4}), norm = seg("norm", 1, (int64_t[]){4});
    ml_segment wg = seg("wg", 2, (int64_t[]){2, 4}), gu = seg("gate_up", 3, (int64_t[]){2, 3, 4});
    norm.weight_decay = 0;
    wg.lr_mult = 0.1;
    wg.frozen = 1;
    gu.experts = 2;
    ml_unit_add(u, &q, &e);
    ml_unit_add(u, &norm, &e);
    ml_unit_add(u, &wg, &e);
    ml_unit_add(u, &gu, &e);
}

static void test_segments(void)
{
    ml_unit u;
    build(&u);
    ok(u.nseg == 4 && u.numel == 16 + 4 + 8 + 24 && strcmp(u.name, "layers.0") == 0,
       "unit: 4 segments, 52 elements");
    ok(u.seg[0].offset == 0 && u.seg[1].offset == 16 && u.seg[2].offset == 20 &&
       u.seg[3].offset == 28 && u.seg[3].numel == 24, "segments: laid out back to back");
    ok(isnan(u.seg[0].weight_decay) && u.seg[1].weight_decay == 0 && u.seg[2].lr_mult == 0.1 &&
       u.seg[2].frozen && u.seg[3].experts == 2, "segments: their settings are kept");
    ok(ml_unit_find(&u, "wg") == 2 && ml_unit_find(&u, "nope") == -1, "find: by name");
    ml_unit_free(&u);
}

/* ml_unit_add refuses s with a message containing `want`, leaving u as it was. */
static void refused(ml_unit *u, ml_segment s, const char *want)
{
    ml_err e = {{0}};
    int nseg = u->nseg;
    int64_t numel = u->numel;
    ml_status st = ml_unit_add(u, &s, &e);
    ok(st == ML_EINVAL && strstr(e.msg, want) && u->nseg == nseg && u->numel == numel,
       "add refuses: %s (got \"%s\")", want, e.msg);
}

static void test_checks(void)
{
    ml_unit u;
    ml_err e = {{0}};
    char longname[200];
    memset(longname, 'x', sizeof longname - 1);
    longname[sizeof longname - 1] = 0;
    ok(ml_unit_init(&u, longname, &e) == ML_EINVAL && strstr(e.msg, "1 to 95 characters"),
       "init: a name longer than 95 characters is refused");
    ml_unit_free(&u);
    build(&u);
    refused(&u, seg("q", 1, (int64_t[]){3}), "segment 'q' appears twice");
    refused(&u, seg("", 1, (int64_t[]){3}), "a segment name must have 1 to 95 characters");
    refused(&u, seg("z", 2, (int64_t[]){3, 0}), "segment 'z': size of dim 2 must be >= 1, got 0");
    refused(&u, seg("z", 2, (int64_t[]){INT64_MAX / 2, 3}), "segment 'z': the unit would have more");
    refused(&u, seg("z", 1, (int64_t[]){INT64_MAX - 10}), "segment 'z': the unit would have more");
    ml_segment s = seg("z", 2, (int64_t[]){4, 3});
    s.experts = 2;
    refused(&u, s, "segment 'z': experts must be 0 or the size of dim 1 (4), got 2");
    s.experts = 0;
    s.weight_decay = -1;
    refused(&u, s, "segment 'z': weight_decay must be finite and >= 0, got -1");
    s.weight_decay = NAN;
    s.lr_mult = INFINITY;
    refused(&u, s, "segment 'z': lr_mult must be finite and >= 0, got inf");
    s.lr_mult = 1;
    ok(ml_unit_add(&u, &s, &e) == ML_OK && u.seg[4].offset == 52 && u.numel == 64,
       "add: a good segment after refused ones goes at the end");
    ml_unit_free(&u);
}

static void test_partition(void)
{
    /* numel 10: world 1 -> 10; 2 -> 5,5; 3 -> 4,4,2; 4 -> 3,3,3,1 */
    static const int64_t shard[5] = {0, 10, 5, 4, 3};
    static const int64_t lens[5][4] = {{0}, {10}, {5, 5}, {4, 4, 2}, {3, 3, 3, 1}};
    for (int world = 1; world <= 4; world++) {
        int good = 1;
        for (int r = 0; r < world; r++) {
            ml_partition p;
            ml_partition_of(10, r, world, &p);
            good &= p.shard == shard[world] && p.padded == shard[world] * world &&
                    p.offset == r * shard[world] && p.len == lens[world][r];
        }
        ok(good, "partition of 10 over %d ranks: shard %lld, padded, offsets and lens", world,
           (long long)shard[world]);
    }
    ml_partition p;
    ml_partition_of(9, 3, 4, &p);   /* shard 3: ranks 0-2 hold 9 elements, rank 3 none */
    ok(p.shard == 3 && p.padded == 12 && p.offset == 9 && p.len == 0,
       "partition: a last rank wholly in the padding has len 0");
    ml_partition_of(10, 3, 11, &p);
    ok(p.shard == 1 && p.padded == 11 && p.offset == 3 && p.len == 1,
       "partition: more ranks than elements");
}

static void test_pieces(void)
{
    ml_unit u;
    build(&u);   /* q [0,16) norm [16,20) wg [20,28) gate_up [28,52) */
    ml_piece pc[4];
    int n = ml_unit_pieces(&u, 14, 16, pc, 4);   /* [14, 30) */
    ok(n == 4 && pc[0].seg == 0 && pc[0].offset == 14 && pc[0].seg_offset == 14 && pc[0].n == 2 &&
       pc[1].seg == 1 && pc[1].offset == 16 && pc[1].seg_offset == 0 && pc[1].n == 4 &&
       pc[2].seg == 2 && pc[2].n == 8 && pc[3].seg == 3 && pc[3].offset == 28 &&
       pc[3].seg_offset == 0 && pc[3].n == 2, "pieces: a range across four segments");
    n = ml_unit_pieces(&u, 17, 2, pc, 4);
    ok(n == 1 && pc[0].seg == 1 && pc[0].seg_offset == 1 && pc[0].n == 2,
       "pieces: a range inside one segment");
    n = ml_unit_pieces(&u, 39, 26, pc, 4);   /* rank 3 of 4 over 52: [39, 52) and padding */
    ok(n == 1 && pc[0].seg == 3 && pc[0].seg_offset == 11 && pc[0].n == 13,
       "pieces: the padding belongs to no segment");
    ok(ml_unit_pieces(&u, 52, 10, pc, 4) == 0 && ml_unit_pieces(&u, 5, 0, pc, 4) == 0,
       "pieces: none past the end or for an empty range");
    ok(ml_unit_pieces(&u, 0, 52, pc, 2) == 4 && pc[1].seg == 1,
       "pieces: the count of all, the first max written");
    ml_unit_free(&u);
}

/* ---- released storage ---- */

static void test_release_acquire(void)
{
    ml_host h;
    ml_host_init(&h);
    ml_ledger *lg = &h.books[ML_CPU];
    h.category = ML_CAT_PARAMS;
    ml_storage *st;
    ok(ml_storage_new(&h, ML_CPU, 1000, &st) == ML_ALLOC_OK && lg->cur[ML_CAT_PARAMS] == 1000,
       "storage: 1000 bytes of params");
    ml_storage_retain(st);   /* a view's reference */
    h.category = ML_CAT_ACTS;   /* what is current now does not matter: st keeps params */
    ml_storage_release_memory(st, "unit layers.0.dense is released (ZeRO-3 gathers it only while "
                              "in use)");
    ok(st->data == NULL && st->refs == 2 && lg->cur[ML_CAT_PARAMS] == 0 && lg->total == 0 &&
       lg->nfree[ML_CAT_PARAMS] == 1, "release: the bytes go back, the struct and refs stay");
    const char *why = ml_storage_unusable(st);
    ok(why && strcmp(why, "unit layers.0.dense is released (ZeRO-3 gathers it only while in use)")
       == 0, "release: unusable says why");
    ml_tensor t = {.st = st, .ndim = 1, .dtype = ML_F32, .shape = {250}, .stride = {1}};
    ml_err e = {{0}};
    ok(ml_check_live(&t, "x", &e) == ML_EINVAL && strstr(e.msg, "x: unit layers.0.dense is released"),
       "release: an op refuses a view with that message");
    ml_storage_release_memory(st, "again");
    ok(lg->nfree[ML_CAT_PARAMS] == 1 && strstr(ml_storage_unusable(st), "layers.0.dense"),
       "release: a second release does nothing");

    ok(ml_storage_acquire(st) == ML_ALLOC_OK && st->data && ml_storage_unusable(st) == NULL &&
       lg->cur[ML_CAT_PARAMS] == 1000 && lg->cur[ML_CAT_ACTS] == 0 && lg->nalloc[ML_CAT_PARAMS] == 2,
       "acquire: 1000 bytes again, under params");
    ok(ml_storage_acquire(st) == ML_ALLOC_OK && lg->cur[ML_CAT_PARAMS] == 1000,
       "acquire: a storage holding its memory is left alone");

    ml_storage_release_memory(st, NULL);
    ok(strcmp(ml_storage_unusable(st), "its memory was released") == 0,
       "release: no reason gives a default one");
    lg->budget[ML_CAT_PARAMS] = 999;
    ok(ml_storage_acquire(st) == ML_ALLOC_OVER_CATEGORY && st->data == NULL &&
       ml_storage_unusable(st) && lg->total == 0 && lg->nrefused == 1,
       "acquire: over the category budget, refused and still released");
    lg->budget[ML_CAT_PARAMS] = 0;
    lg->budget_total = 500;
    ok(ml_storage_acquire(st) == ML_ALLOC_OVER_TOTAL && lg->total == 0,
       "acquire: over the total budget, refused");
    lg->budget_total = 0;

    ml_storage_release(st);
    ml_storage_release(st);   /* the last reference of a released storage */
    ok(lg->total == 0 && lg->nfree[ML_CAT_PARAMS] == 2 && lg->nalloc[ML_CAT_PARAMS] == 2,
       "free: a released storage gives back nothing more");
    ml_host_free(&h);
}

static void test_plan(void)
{
    ml_host h;
    ml_host_init(&h);
    h.category = ML_CAT_PARAMS;
    ml_storage *real, *planned;
    ml_storage_new(&h, ML_CPU, 400, &real);
    ml_storage_release_memory(real, "released before the plan");
    ml_plan_saved saved;
    ml_err e;
    ok(ml_plan_begin(&h, &saved, &e) == ML_OK, "plan: begins with a released storage alive");
    ml_ledger *pb = &h.plan_books[ML_CPU];
    ok(ml_storage_acquire(real) == ML_ALLOC_OK && real->lg == pb && pb->cur[ML_CAT_PARAMS] == 400 &&
       h.books[ML_CPU].total == 0 && h.plan_live == 1,
       "plan: an acquire is charged to the plan's book and counted live");
    ml_storage_release_memory(real, "released in the plan");
    ok(pb->cur[ML_CAT_PARAMS] == 0 && pb->peak[ML_CAT_PARAMS] == 400 && h.plan_live == 0,
       "plan: a release credits the plan's book (the peak stays)");
    ml_storage_new(&h, ML_CPU, 100, &planned);
    ml_storage_release_memory(planned, "made and released in the plan");
    ml_storage_release(planned);
    ok(pb->total == 0 && h.plan_live == 0, "plan: made, released and freed inside: balanced");
    pb->budget[ML_CAT_PARAMS] = 300;
    ok(ml_storage_acquire(real) == ML_ALLOC_OVER_CATEGORY && h.plan_live == 0,
       "plan: the plan's budgets refuse an acquire");
    ml_plan_end(&h, &saved);
    ok(h.books[ML_CPU].total == 0 && h.plan_live == 0 && ml_storage_acquire(real) == ML_ALLOC_OK &&
       real->lg == &h.books[ML_CPU] && h.books[ML_CPU].cur[ML_CAT_PARAMS] == 400,
       "plan: after it, an acquire is real again");
    ml_storage_release(real);
    ok(h.books[ML_CPU].total == 0, "plan: every byte back");
    ml_host_free(&h);
}

int main(void)
{
    test_segments();
    test_checks();
    test_partition();
    test_pieces();
    test_release_acquire();
    test_plan();
    return tap_done();
}
