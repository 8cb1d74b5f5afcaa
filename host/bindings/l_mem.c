/*
 * host/bindings/l_mem.c - the Lua library `moelua.mem`: the memory ledger's account
 * books, budgets, peaks, the timeline, and the category of allocations.
 * One book per tier (DESIGN.md, The memory ledger): the devices "cpu" and
 * "cuda", "pinned" host memory and "file" (backing files such as the
 * expert store's); `device` below names any of them.
 *
 *   mem.report([device])          the account book as text: print(mem.report()); without
 *                                 a device the cpu book and every other one holding bytes
 *   mem.stats()                   {cpu = {...}, cuda = {...}, pinned = {...}, file = {...}}
 *   mem.reset_peak([device])
 *   mem.format_bytes(n)           "1.50 MiB": bytes as the reports print them
 *   mem.phase(text)               the phase of the work from now on; a book's peak_phase is
 *                                 the one its total peaked in
 *   mem.budget{total=, params=, ..., device=, force=}   sizes in bytes; 0 removes;
 *                                 more than the device can hold needs force = true;
 *                                 returns the old budgets with their device
 *   mem.scope(category, fn, ...)  run fn with allocations tagged `category`
 *   mem.category([name])          get / set the current category
 *   mem.timeline{cap=, interval=, device=} / mem.timeline() -> samples
 *   mem.empty_cache()             release the CUDA caching allocator's free blocks and
 *                                 the CPU's freed mappings kept for reuse
 *   mem.plan(fn, ...)             dry run of fn(...): {cpu = book, ...} with its peaks, nothing
 *                                 allocated; nil, message, books when fn raised (a budget
 *                                 refusal counts in book.refused)
 *   mem.planning()                true inside mem.plan
 */
#include "l_util.h"

#ifdef ML_WITH_CUDA
#include "../runtime/backend_cuda.h"
#endif

#include <math.h>
#include <string.h>

#include "../runtime/plan.h"

/* A tier's name at idx (none: cpu). */
static ml_tier opt_tier(lua_State *L, int idx, const char *fn)
{
    if (lua_type(L, idx) == LUA_TSTRING) {
        const char *s = lua_tostring(L, idx);
        for (int t = 0; t < ML_NTIERS; t++)
            if (strcmp(s, ml_tier_names[t]) == 0)
                return (ml_tier)t;
        ml_error(L, fn, "unknown device '%s' (cpu, cuda, pinned, file)", s);
    }
    if (!lua_isnoneornil(L, idx))
        ml_error(L, fn, "argument #%d: expected a device name, got %s", idx, luaL_typename(L, idx));
    return ML_TIER_CPU;
}

/* mem.report(device): that book; mem.report(): the cpu book and every
 * other book that holds bytes now, so the report shows where they live. */
static int l_mem_report(lua_State *L)
{
    ml_args(L, 1, "moelua.mem.report");
    ml_host *h = ml_host_of(L);
    if (!lua_isnoneornil(L, 1)) {
        ml_push_ledger_report(L, h, opt_tier(L, 1, "moelua.mem.report"));
        return 1;
    }
    ml_push_ledger_report(L, h, ML_TIER_CPU);
    int n = 1;
    for (int t = 0; t < ML_NTIERS; t++) {
        if (t == ML_TIER_CPU || h->ledger[t]->total == 0)
            continue;
        ml_push_ledger_report(L, h, (ml_tier)t);
        n++;
    }
    lua_concat(L, n);
    return 1;
}

static void push_categories(lua_State *L, const size_t *v)
{
    lua_createtable(L, 0, ML_NCAT);
    for (int c = 0; c < ML_NCAT; c++) {
        lua_pushinteger(L, (lua_Integer)v[c]);
        lua_setfield(L, -2, ml_category_names[c]);
    }
}

static void push_ledger(lua_State *L, const ml_host *h, const ml_ledger *lg, ml_tier d)
{
    lua_createtable(L, 0, 16);
    push_categories(L, lg->cur);
    lua_setfield(L, -2, "current");
    push_categories(L, lg->peak);
    lua_setfield(L, -2, "peak");
    push_categories(L, lg->at_peak);
    lua_setfield(L, -2, "at_peak");
    push_categories(L, lg->budget);
    lua_setfield(L, -2, "budget");
    size_t allocs[ML_NCAT], frees[ML_NCAT];
    for (int c = 0; c < ML_NCAT; c++) {
        allocs[c] = (size_t)lg->nalloc[c];
        frees[c] = (size_t)lg->nfree[c];
    }
    push_categories(L, allocs);
    lua_setfield(L, -2, "allocs");
    push_categories(L, frees);
    lua_setfield(L, -2, "frees");
    ml_setfield_int(L, "total", (lua_Integer)lg->total);
    ml_setfield_int(L, "total_peak", (lua_Integer)lg->total_peak);
    lua_pushstring(L, lg->peak_phase);
    lua_setfield(L, -2, "peak_phase");
    ml_setfield_int(L, "reserved", (lua_Integer)lg->reserved);
    ml_setfield_int(L, "reserved_peak", (lua_Integer)lg->reserved_peak);
    ml_setfield_int(L, "budget_total", (lua_Integer)lg->budget_total);
    ml_setfield_int(L, "refused", (lua_Integer)lg->nrefused);
    if (d == ML_TIER_CPU && !ml_is_plan_ledger(h, lg)) {
        size_t rss = ml_process_rss();
        ml_setfield_int(L, "rss", (lua_Integer)rss);
        ml_setfield_int(L, "untracked", (lua_Integer)(rss > lg->total ? rss - lg->total : 0));
    }
#ifdef ML_WITH_CUDA
    if (d == ML_TIER_CUDA && !ml_is_plan_ledger(h, lg)) {
        ml_cuda_alloc_stats a;
        ml_cuda_alloc_get_stats(&a);
        /* device bytes in use that the caching allocator did not reserve:
         * the CUDA context, cuBLAS workspaces, other processes. Read once
         * this process has device memory: before, cudaMemGetInfo would
         * create the context (hundreds of MiB there, ~100 MB of RSS here) */
        size_t free_b, total_b;
        if (a.nmalloc > 0 && ml_cuda_mem_info(&free_b, &total_b) == 0) {
            size_t used = total_b - free_b;
            ml_setfield_int(L, "untracked", (lua_Integer)(used > lg->reserved ? used - lg->reserved : 0));
        }
        lua_createtable(L, 0, 8);
        ml_setfield_int(L, "reserved", (lua_Integer)a.reserved);
        ml_setfield_int(L, "allocated", (lua_Integer)a.allocated);
        ml_setfield_int(L, "cached", (lua_Integer)a.cached);
        ml_setfield_int(L, "requested", (lua_Integer)a.requested);
        ml_setfield_int(L, "mallocs", (lua_Integer)a.nmalloc);
        ml_setfield_int(L, "hits", (lua_Integer)a.nhits);
        ml_setfield_int(L, "flushes", (lua_Integer)a.nflush);
        ml_setfield_int(L, "failures", (lua_Integer)a.nfail);
        lua_setfield(L, -2, "allocator");
    }
#endif
}

static int l_mem_stats(lua_State *L)
{
    ml_args(L, 0, "moelua.mem.stats");
    ml_host *h = ml_host_of(L);
    lua_createtable(L, 0, ML_NTIERS);
    for (int t = 0; t < ML_NTIERS; t++) {
        push_ledger(L, h, h->ledger[t], (ml_tier)t);
        lua_setfield(L, -2, ml_tier_names[t]);
    }
    return 1;
}

/* mem.format_bytes(n): n bytes as the ledger's reports print them ("1.50 MiB"). */
static int l_mem_format_bytes(lua_State *L)
{
    ml_args(L, 1, "moelua.mem.format_bytes");
    lua_Integer n = ml_checkinteger_named(L, 1, "moelua.mem.format_bytes", "argument #1 (n)");
    if (n < 0)
        ml_error(L, "moelua.mem.format_bytes", "argument #1: expected bytes >= 0, got %lld", (long long)n);
    char buf[32];
    ml_format_bytes((size_t)n, buf, sizeof buf);
    lua_pushstring(L, buf);
    return 1;
}

/* mem.phase(text): what the host does from now on ("forward of layer 3"),
 * on every book in use (a plan's inside mem.plan, which starts from the
 * real books' phase and leaves them as they were): the phase when a book's
 * total peaks is its stats' peak_phase. */
static int l_mem_phase(lua_State *L)
{
    ml_args(L, 1, "moelua.mem.phase");
    ml_host *h = ml_host_of(L);
    const char *text = ml_checkstring_named(L, 1, "moelua.mem.phase", "argument #1 (phase)");
    for (int t = 0; t < ML_NTIERS; t++)
        ml_ledger_set_phase(h->ledger[t], text);
    return 0;
}

static int l_mem_reset_peak(lua_State *L)
{
    ml_args(L, 1, "moelua.mem.reset_peak");
    ml_host *h = ml_host_of(L);
    if (lua_isnoneornil(L, 1)) {
        for (int t = 0; t < ML_NTIERS; t++)
            ml_ledger_reset_peak(h->ledger[t]);
    } else {
        ml_ledger_reset_peak(h->ledger[opt_tier(L, 1, "moelua.mem.reset_peak")]);
    }
    return 0;
}

static size_t check_bytes(lua_State *L, int idx, const char *fn, const char *key)
{
    int isnum;
    lua_Number v = lua_tonumberx(L, idx, &isnum);
    if (!isnum || v < 0 || v != v || v > 9.0e18 || v != floor(v))   /* 8 * 2^30 is a float: whole ones pass */
        ml_error(L, fn, "option '%s' must be a whole byte count >= 0, got %s", key,
                 isnum ? lua_tostring(L, idx) : luaL_typename(L, idx));
    return (size_t)v;
}

#define GIB(n) ((double)(n) / (double)((size_t)1 << 30))

/* Refuse a budget the device cannot hold (0 removes a budget: never
 * refused). On the CPU that is more than MemAvailable plus what the ledger
 * holds already (its bytes are in the budget, no longer in MemAvailable);
 * on CUDA, more than the device's memory; pinned and file: no check (a
 * budget there bounds what the run may take, not what the machine has). Such a budget never refuses an
 * allocation, so the run allocates until the kernel's OOM killer (or the
 * CUDA allocator) stops it with no Lua error and no ledger report: only
 * force = true accepts one. No figure (no /proc/meminfo, no device): no check. */
static void check_holdable(lua_State *L, ml_host *h, ml_tier d, const char *key, size_t want)
{
    static const char fn[] = "moelua.mem.budget";
    if (want == 0)
        return;
    if (d == ML_TIER_CPU) {
        size_t avail = ml_mem_available(), held = h->books[ML_TIER_CPU].total;
        if (avail == 0 || want <= avail + held)
            return;
        ml_user_error(L, "%s: the %s budget of %.2f GiB is more than this machine can hold: %.2f GiB "
                      "(MemAvailable %.2f GiB + %.2f GiB the cpu ledger holds) of %.2f GiB MemTotal. "
                      "mem.budget{%s = ..., force = true} sets it anyway: past what the machine has, "
                      "the kernel's OOM killer ends the run instead of a Lua error", fn, key,
                      GIB(want), GIB(avail + held), GIB(avail), GIB(held), GIB(ml_mem_total()), key);
    }
#ifdef ML_WITH_CUDA
    size_t free_b, total_b;
    if (d == ML_TIER_CUDA && ml_cuda_mem_info(&free_b, &total_b) == 0 && want > total_b)
        ml_user_error(L, "%s: the %s budget of %.2f GiB on cuda is more than the device's memory: "
                      "%.2f GiB in all (%.2f GiB free). mem.budget{device = \"cuda\", %s = ..., "
                      "force = true} sets it anyway: past what the device has, the run ends with "
                      "a device out-of-memory error instead of a budget error with the ledger",
                      fn, key, GIB(want), GIB(total_b), GIB(free_b), key);
#endif
}

/* mem.budget{total=, <category>=, device=, force=}: bytes, 0 removes a
 * budget; one the device cannot hold is refused without force = true
 * (check_holdable). Returns the old values and their device, so that
 * mem.budget(old) restores that book. */
static int l_mem_budget(lua_State *L)
{
    static const char fn[] = "moelua.mem.budget";
    ml_args(L, 1, fn);
    ml_host *h = ml_host_of(L);
    ml_checktype_named(L, 1, fn, "argument #1 (budgets)", LUA_TTABLE);
    lua_getfield(L, 1, "device");
    ml_tier d = opt_tier(L, -1, fn);
    lua_pop(L, 1);
    int force = ml_opt_bool(L, 1, fn, "force", 0);
    ml_ledger *lg = h->ledger[d];
    /* validate every key before changing anything */
    lua_pushnil(L);
    while (lua_next(L, 1)) {
        const char *k = lua_type(L, -2) == LUA_TSTRING ? lua_tostring(L, -2) : NULL;
        int opt = k && (strcmp(k, "device") == 0 || strcmp(k, "force") == 0);
        if (!k || (!opt && strcmp(k, "total") != 0 && ml_category_from_name(k) < 0))
            ml_error(L, fn, "unknown option '%s' (total, device, force, or a category: params, "
                     "grads, optim, acts, pool, comm, cache, other)", k ? k : luaL_typename(L, -2));
        if (!opt && !force)
            check_holdable(L, h, d, k, check_bytes(L, -1, fn, k));
        else if (!opt)
            check_bytes(L, -1, fn, k);
        lua_pop(L, 1);
    }
    lua_createtable(L, 0, ML_NCAT + 2);
    lua_pushstring(L, ml_tier_names[d]);   /* so mem.budget(old) restores the same book */
    lua_setfield(L, -2, "device");
    ml_setfield_int(L, "total", (lua_Integer)lg->budget_total);
    for (int c = 0; c < ML_NCAT; c++)
        ml_setfield_int(L, ml_category_names[c], (lua_Integer)lg->budget[c]);
    if (lua_getfield(L, 1, "total") != LUA_TNIL)
        lg->budget_total = check_bytes(L, -1, fn, "total");
    lua_pop(L, 1);
    for (int c = 0; c < ML_NCAT; c++) {
        if (lua_getfield(L, 1, ml_category_names[c]) != LUA_TNIL)
            lg->budget[c] = check_bytes(L, -1, fn, ml_category_names[c]);
        lua_pop(L, 1);
    }
    return 1;
}

static int check_category(lua_State *L, int idx, const char *fn)
{
    const char *s = ml_checkstring_named(L, idx, fn, "the category");
    int c = ml_category_from_name(s);
    if (c < 0)
        ml_error(L, fn, "unknown category '%s' (params, grads, optim, acts, pool, comm, cache, other)", s);
    return c;
}

static int l_mem_category(lua_State *L)
{
    ml_args(L, 1, "moelua.mem.category");
    ml_host *h = ml_host_of(L);
    lua_pushstring(L, ml_category_names[h->category]);
    if (!lua_isnoneornil(L, 1))
        h->category = (ml_category)check_category(L, 1, "moelua.mem.category");
    return 1;
}

/* Restores the category even when fn raises, then re-raises. */
static int l_mem_scope(lua_State *L)
{
    static const char fn[] = "moelua.mem.scope";
    ml_host *h = ml_host_of(L);
    ml_category c = (ml_category)check_category(L, 1, fn);
    ml_checktype_named(L, 2, fn, "argument #2 (fn)", LUA_TFUNCTION);
    ml_category saved = h->category;
    h->category = c;
    int nargs = lua_gettop(L) - 2;
    int status = lua_pcall(L, nargs, LUA_MULTRET, 0);
    h->category = saved;
    if (status != LUA_OK)
        return lua_error(L);
    return lua_gettop(L) - 1;
}

/* mem.timeline{cap=, interval=, device=} starts (cap 0 stops) sampling;
 * mem.timeline([device]) returns {{t=, <category>=bytes...}, ...}, dropped. */
static int l_mem_timeline(lua_State *L)
{
    static const char fn[] = "moelua.mem.timeline";
    ml_args(L, 1, fn);
    ml_host *h = ml_host_of(L);
    if (lua_istable(L, 1)) {
        static const char *const opts[] = {"cap", "interval", "device", NULL};
        ml_check_opts(L, 1, fn, opts);
        lua_getfield(L, 1, "device");
        ml_tier d = opt_tier(L, -1, fn);
        lua_Integer cap = 100000;
        lua_Number interval = 0;
        int isnum = 1;
        if (lua_getfield(L, 1, "cap") != LUA_TNIL)
            cap = lua_tointegerx(L, -1, &isnum);
        if (!isnum || cap < 0 || cap > 100000000)
            ml_error(L, fn, "option 'cap' must be an integer in 0..1e8");
        if (lua_getfield(L, 1, "interval") != LUA_TNIL)
            interval = lua_tonumberx(L, -1, &isnum);
        if (!isnum || !(interval >= 0))
            ml_error(L, fn, "option 'interval' must be a number of seconds >= 0");
        if (ml_ledger_timeline(h->ledger[d], (size_t)cap, interval) != 0)
            ml_error(L, fn, "out of memory for %lld samples", (long long)cap);
        return 0;
    }
    const ml_ledger *lg = h->ledger[opt_tier(L, 1, fn)];
    lua_createtable(L, (int)lg->nsamples, 0);
    for (size_t i = 0; i < lg->nsamples; i++) {
        const ml_sample *s = &lg->samples[i];
        push_categories(L, s->bytes);
        lua_pushnumber(L, s->t);
        lua_setfield(L, -2, "t");
        size_t total = 0;
        for (int c = 0; c < ML_NCAT; c++)
            total += s->bytes[c];
        ml_setfield_int(L, "total", (lua_Integer)total);
        lua_rawseti(L, -2, (lua_Integer)i + 1);
    }
    lua_pushinteger(L, (lua_Integer)lg->ndropped);
    return 2;
}

/* mem.empty_cache(): return the CUDA allocator's cached blocks to the
 * device, and the CPU's kept mappings to the system. */
static int l_mem_empty_cache(lua_State *L)
{
    ml_args(L, 0, "moelua.mem.empty_cache");
    ml_cpu_empty_cache();
#ifdef ML_WITH_CUDA
    ml_cuda_empty_cache(&ml_host_of(L)->books[ML_TIER_CUDA]);
#else
    (void)L;
#endif
    return 0;
}

/* ---- planning (host/runtime/plan.h) ---------------------------------------------
 *
 * mem.plan(fn, ...) runs fn(...) inside a plan: the same code, every
 * kernel skipped, allocations charged to virtual books. Tensor contents
 * inside a plan are meaningless; code whose sizes depend on data asks
 * mem.planning() and takes its worst case. A plan whose tensors are still
 * referenced when it ends fails. A failed plan returns nil, the message,
 * the books and the error as raised. */

static int l_mem_plan(lua_State *L)
{
    static const char fn[] = "moelua.mem.plan";
    ml_host *h = ml_host_of(L);
    ml_checktype_named(L, 1, fn, "argument #1 (fn)", LUA_TFUNCTION);
    if (!h->planning)
        lua_gc(L, LUA_GCCOLLECT);   /* an earlier plan's garbage returns to its book */
    ml_plan_saved saved;
    ml_err e;
    ml_check_op(L, fn, ml_plan_begin(h, &saved, &e), &e);
    int err = lua_pcall(L, lua_gettop(L) - 1, 0, 0);
    ml_plan_end(h, &saved);
    /* the plan's tensors are garbage now: return them to the virtual book
     * (two passes: finalizers of the first may free more) */
    lua_gc(L, LUA_GCCOLLECT);
    lua_gc(L, LUA_GCCOLLECT);
    if (err == LUA_OK && h->plan_live) {   /* kept by a global or an object from outside */
        err = LUA_ERRRUN;
        int one = h->plan_live == 1;
        lua_pushfstring(L, "%d tensor%s or pool%s of the plan %s still referenced after it "
                        "(by a global, an upvalue or an object made outside the plan, such as an "
                        "optimizer stepped inside it); they hold no real memory and must not be used",
                        (int)h->plan_live, one ? "" : "s", one ? "" : "s", one ? "is" : "are");
    }
    lua_createtable(L, 0, ML_NTIERS);
    for (int t = 0; t < ML_NTIERS; t++) {
        push_ledger(L, h, &h->plan_books[t], (ml_tier)t);
        lua_setfield(L, -2, ml_tier_names[t]);
    }
    if (err == LUA_OK)
        return 1;
    if (ml_is_interrupt_error(L, -2)) {   /* Ctrl-C stops the caller too, as raised */
        lua_pop(L, 1);
        return lua_error(L);
    }
    const char *msg = luaL_tolstring(L, -2, NULL);   /* stack: error, books, msg */
    lua_pushnil(L);
    lua_pushfstring(L, "%s: the planned run failed (nothing was allocated): %s", fn, msg);
    lua_pushvalue(L, -4);
    lua_pushvalue(L, -6);   /* the error as raised: a caller re-raises a user error as it is */
    return 4;
}

static int l_mem_planning(lua_State *L)
{
    ml_args(L, 0, "moelua.mem.planning");
    lua_pushboolean(L, ml_host_of(L)->planning);
    return 1;
}

static const luaL_Reg mem_functions[] = {
    {"empty_cache", l_mem_empty_cache},
    {"report", l_mem_report},
    {"stats", l_mem_stats},
    {"format_bytes", l_mem_format_bytes},
    {"phase", l_mem_phase},
    {"reset_peak", l_mem_reset_peak},
    {"budget", l_mem_budget},
    {"category", l_mem_category},
    {"scope", l_mem_scope},
    {"timeline", l_mem_timeline},
    {"plan", l_mem_plan},
    {"planning", l_mem_planning},
    {NULL, NULL}
};

int luaopen_moelua_mem(lua_State *L)
{
    ml_host_of(L);
    luaL_newlib(L, mem_functions);
    return 1;
}
