/*
 * tests/c/test_reserve.c - reserved storage (host/runtime/tensor.h:
 * ml_storage_reserve, ml_storage_commit, ml_tensor_uncommitted) on a host
 * with the CPU backend and no Lua state, printing TAP.
 *
 * Covers: a reservation charges nothing; commits charge exactly their bytes
 * under the storage's category (one allocation each) and read as zeros;
 * adjacent commits cover a view of both; an overlapping, out-of-bounds or
 * non-reserved commit is refused with a message and charges nothing; an op
 * refuses a view of uncommitted bytes (ml_check_input); freeing after
 * partial commits credits exactly the committed bytes (allocation and
 * free counts balance); a budget refuses a commit with the ledger table
 * and commits nothing; inside a plan the commits are charged to the plan's
 * books and nothing is written, and a storage reserved outside the plan
 * cannot be committed there. Not here: the Lua face (tests/spec/tensor_spec.lua)
 * and the optimizer's use (tests/spec/optim_spec.lua).
 */
#include <string.h>

#include "ops_math.h"
#include "plan.h"
#include "tap.h"

/* A contiguous f32 view [n] of st at element off. */
static ml_tensor view_of(ml_storage *st, int64_t off, int64_t n)
{
    return (ml_tensor){.st = st, .offset = off, .ndim = 1, .dtype = ML_F32, .shape = {n},
                       .stride = {1}};
}

static int all_zero(const ml_tensor *t)
{
    const float *p = ml_data(t);
    for (int64_t i = 0; i < ml_numel(t); i++)
        if (p[i] != 0)
            return 0;
    return 1;
}

static void test_commit(void)
{
    ml_host h;
    ml_host_init(&h);
    h.category = ML_CAT_OPTIM;
    ml_ledger *lg = &h.books[ML_CPU];
    ml_storage *st;
    ml_err e;
    ok(ml_storage_reserve(&h, ML_CPU, 4000, &st) == ML_ALLOC_OK && st->reserved && st->cat == ML_CAT_OPTIM,
       "reserve: a reserved storage under the current category");
    ok(lg->total == 0 && lg->nalloc[ML_CAT_OPTIM] == 0, "reserve: the ledger is charged nothing");
    /* dirty the bytes the allocator handed out, so the zero-fill is seen */
    memset(st->data, 0xff, st->nbytes);
    ml_tensor a = view_of(st, 100, 100), b = view_of(st, 200, 100), ab = view_of(st, 100, 200);
    ok(ml_tensor_uncommitted(&a) && strstr(ml_tensor_uncommitted(&a), "reserved but not committed"),
       "uncommitted: a view of reserved bytes says why");
    ok(ml_storage_commit(st, 400, 400, &e) == ML_OK && lg->cur[ML_CAT_OPTIM] == 400 &&
       lg->nalloc[ML_CAT_OPTIM] == 1 && ml_tensor_uncommitted(&a) == NULL && all_zero(&a),
       "commit: charges its bytes under the storage's category, zeros");
    ok(ml_tensor_uncommitted(&ab) != NULL, "uncommitted: a view reaching past the committed range");
    ok(ml_storage_commit(st, 800, 400, &e) == ML_OK && ml_tensor_uncommitted(&ab) == NULL &&
       all_zero(&b) && lg->cur[ML_CAT_OPTIM] == 800 && lg->nalloc[ML_CAT_OPTIM] == 2,
       "commit: adjacent commits cover a view of both");
    ok(ml_storage_commit(st, 1000, 400, &e) == ML_EINVAL &&
       strcmp(e.msg, "bytes [1000, 1400) overlap the committed bytes [800, 1200)") == 0 &&
       lg->cur[ML_CAT_OPTIM] == 800, "commit: an overlap is refused, naming both ranges: %s", e.msg);
    ok(ml_storage_commit(st, 0, 401, &e) == ML_EINVAL && lg->cur[ML_CAT_OPTIM] == 800,
       "commit: an overlap from below is refused");
    ok(ml_storage_commit(st, 3900, 200, &e) == ML_EINVAL && strstr(e.msg, "outside the storage's 4000 bytes"),
       "commit: out of bounds is refused: %s", e.msg);
    ok(ml_storage_commit(st, 0, 0, &e) == ML_OK && lg->nalloc[ML_CAT_OPTIM] == 2,
       "commit: zero bytes do nothing");
    ok(ml_storage_commit(st, 0, 40, &e) == ML_OK && lg->cur[ML_CAT_OPTIM] == 840,
       "commit: a range before the others (kept sorted)");
    ml_tensor head = view_of(st, 0, 10), gap = view_of(st, 10, 1), out = {0};
    ok(ml_storage_committed(st, 0, 40) && !ml_storage_committed(st, 0, 41) &&
       ml_tensor_uncommitted(&head) == NULL && ml_tensor_uncommitted(&gap) != NULL,
       "committed: exactly the committed bytes");

    /* an op refuses a view of uncommitted bytes */
    ok(ml_op_unary(&h, &out, ML_NEG, &gap, &e) == ML_EINVAL &&
       strcmp(e.msg, "t: the tensor is reserved but not committed") == 0 && out.st == NULL,
       "op: refuses an uncommitted view: %s", e.msg);
    h.category = ML_CAT_ACTS;   /* the op's output: not optim's bytes */
    ok(ml_op_unary(&h, &out, ML_NEG, &ab, &e) == ML_OK, "op: runs on committed elements");
    ml_tensor_drop(&out);

    ml_storage *plain;   /* under acts, too */
    ml_storage_new(&h, ML_CPU, 64, &plain);
    ok(ml_storage_commit(plain, 0, 8, &e) == ML_EINVAL && strstr(e.msg, "not reserved"),
       "commit: a storage that was not reserved is refused: %s", e.msg);
    ml_tensor pv = view_of(plain, 0, 16);
    ok(ml_storage_committed(plain, 0, 64) && ml_tensor_uncommitted(&pv) == NULL,
       "committed: any storage that was not reserved");
    ml_storage_release(plain);
    h.category = ML_CAT_OPTIM;

    ml_storage_release(st);
    ok(lg->total == 0 && lg->cur[ML_CAT_OPTIM] == 0 && lg->nfree[ML_CAT_OPTIM] == lg->nalloc[ML_CAT_OPTIM],
       "free: credits exactly the committed bytes, one free per commit");
    ok(lg->peak[ML_CAT_OPTIM] == 840, "free: the peak is the committed bytes");
    ml_host_free(&h);
}

static void test_budget(void)
{
    ml_host h;
    ml_host_init(&h);
    h.category = ML_CAT_OPTIM;
    ml_ledger *lg = &h.books[ML_CPU];
    ml_storage *st;
    ml_err e;
    lg->budget_total = 1000;
    ok(ml_storage_reserve(&h, ML_CPU, 1 << 20, &st) == ML_ALLOC_OK && lg->total == 0,
       "budget: a reservation larger than the budget is fine (nothing charged)");
    ok(ml_storage_commit(st, 0, 800, &e) == ML_OK, "budget: a commit within it");
    ok(ml_storage_commit(st, 800, 400, &e) == ML_EALLOC &&
       strstr(e.msg, "committing 400 B (optim) on cpu would exceed the total budget of 1000 B") &&
       strstr(e.msg, "memory ledger (cpu)") && lg->nrefused == 1,
       "budget: a refused commit is the budget error with the ledger");
    ok(lg->total == 800 && !ml_storage_committed(st, 800, 1), "budget: a refused commit commits nothing");
    lg->budget_total = 0;
    lg->budget[ML_CAT_OPTIM] = 1000;
    ok(ml_storage_commit(st, 800, 400, &e) == ML_EALLOC && strstr(e.msg, "exceed the optim budget"),
       "budget: the category's budget refuses too");
    ml_storage_release(st);
    ok(lg->total == 0, "budget: every byte back");
    ml_host_free(&h);
}

static void test_plan(void)
{
    ml_host h;
    ml_host_init(&h);
    h.category = ML_CAT_OPTIM;
    ml_storage *real, *planned;
    ml_err e;
    ml_storage_reserve(&h, ML_CPU, 1000, &real);
    ml_plan_saved saved;
    ok(ml_plan_begin(&h, &saved, &e) == ML_OK, "plan: begins with a reserved storage alive");
    ml_ledger *pb = &h.plan_books[ML_CPU];
    ok(ml_storage_reserve(&h, ML_CPU, 1000, &planned) == ML_ALLOC_OK && planned->lg == pb &&
       pb->total == 0 && h.plan_live == 1, "plan: a reservation in the plan's book, nothing charged");
    ok(ml_storage_commit(planned, 0, 600, &e) == ML_OK && pb->cur[ML_CAT_OPTIM] == 600 &&
       h.books[ML_CPU].total == 0, "plan: a commit is charged to the plan's book");
    ok(ml_storage_commit(real, 0, 100, &e) == ML_EINVAL && strstr(e.msg, "outside moelua.mem.plan") &&
       h.books[ML_CPU].total == 0, "plan: a storage reserved outside cannot be committed: %s", e.msg);
    ml_storage_release(planned);
    ok(pb->total == 0 && pb->peak[ML_CAT_OPTIM] == 600 && h.plan_live == 0,
       "plan: freed in the plan, its commits credited (the peak stays)");
    ml_plan_end(&h, &saved);
    ok(ml_storage_commit(real, 0, 100, &e) == ML_OK && h.books[ML_CPU].cur[ML_CAT_OPTIM] == 100,
       "plan: after it, commits are real again");
    ml_storage_release(real);
    ok(h.books[ML_CPU].total == 0, "plan: every byte back");
    ml_host_free(&h);
}

int main(void)
{
    test_commit();
    test_budget();
    test_plan();
    return tap_done();
}
