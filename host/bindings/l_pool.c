/*
 * host/bindings/l_pool.c - the Lua library `moelua.pool`: stack pools (DESIGN.md,
 * Pools; host/runtime/pool.h) as a moelua.Pool userdata whose tensors are zero-copy
 * views into the pool's blocks.
 *
 *   pool.new(bytes, {grow=false, device="cpu"})  a pool of `bytes` under the
 *                                  ledger category `pool`
 *   p:tensor(shape, {dtype="f32"}) a view in a new slot; its contents are
 *                                  whatever the slot held before (like empty)
 *   p:mark()                       the stack depth, for p:rewind
 *   p:rewind(mark)                 pop every slot above mark; views in them
 *                                  become stale (using one is an error)
 *   p:reset()                      rewind(0)
 *   p:reserve(bytes)               an empty pool made one block of `bytes` (the
 *                                  high-water mark a memory plan predicted)
 *   p:stats()                      {capacity=, used=, high_water=, utilisation=,
 *                                   overflows=, blocks=, slots=, grow=, device=}
 *   p:close() / __close / __gc     drop the pool object; the blocks return to
 *                                  the ledger once no view of them is left
 *
 * Overflow with grow=false is an error; with grow=true the pool takes a new
 * block from the ledger (blocks never move, live views stay valid), and a
 * refusal is an error that prints the ledger. Not here: the allocator itself
 * (host/runtime/pool.c) and anything device-specific (the backend table does that).
 */
#include "libs.h"
#include "l_util.h"
#include "../runtime/pool.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The userdata: the pool's Lua reference, NULL once closed. */
typedef struct {
    ml_pool *p;
} l_pool;

static l_pool *check_pool_ud(lua_State *L, int idx)
{
    return luaL_checkudata(L, idx, ML_POOL_MT);
}

/* The open pool at idx, or an error naming fn. */
static ml_pool *check_pool(lua_State *L, int idx, const char *fn)
{
    l_pool *u = check_pool_ud(L, idx);
    if (!u->p)
        ml_error(L, fn, "the pool is closed");
    return u->p;
}

ml_pool *ml_checkpool(lua_State *L, int idx, const char *fn, const char *what)
{
    l_pool *u = luaL_testudata(L, idx, ML_POOL_MT);
    if (!u)
        ml_error(L, fn, "%s must be a moelua.pool, got %s", what, luaL_typename(L, idx));
    if (!u->p)
        ml_error(L, fn, "%s: the pool is closed", what);
    return u->p;
}

/* Raise for a pool status other than OK and FULL: a refused or failed
 * request for new pool memory, with the ledger when a budget refused it.
 * `what` says what the bytes were for ("allocating a pool of 4.00 KiB"). */
static void raise_alloc(lua_State *L, const char *fn, ml_host *h, ml_device dev,
                        ml_pool_status ps, ml_alloc_status as, const char *what)
{
    char limit[32];
    const ml_ledger *lg = h->ledger[dev];
    if (ps == ML_POOL_OUTSIDE_PLAN)
        ml_error(L, fn, "%s: this pool was made outside moelua.mem.plan, which cannot give it "
                 "real memory (build the pool inside the planned function)", what);
    if (as == ML_ALLOC_NODEVICE)
        ml_error(L, fn, "device %s is not available (%s)", ml_device_names[dev],
                 ml_device_unavailable_reason(h, dev));
    if (ps == ML_POOL_NOMEM || as == ML_ALLOC_NOMEM)
        ml_error(L, fn, "out of memory %s on %s", what, ml_device_names[dev]);
    int total = as == ML_ALLOC_OVER_TOTAL;
    ml_format_bytes(total ? lg->budget_total : lg->budget[ML_CAT_POOL], limit, sizeof limit);
    luaL_where(L, 1);
    lua_pushfstring(L, "%s: %s on %s would exceed the %s budget of %s\n", fn, what,
                    ml_device_names[dev], total ? "total" : "pool", limit);
    ml_push_ledger_report(L, h, dev);
    lua_concat(L, 3);
    lua_error(L);
}

/* A refusal that freeing memory might fix: a budget, or the device allocator. */
static int worth_retrying(ml_pool_status ps, ml_alloc_status as)
{
    return (ps == ML_POOL_LEDGER && (as == ML_ALLOC_OVER_TOTAL || as == ML_ALLOC_OVER_CATEGORY)) ||
           as == ML_ALLOC_NOMEM;
}

/* opts.grow: a boolean, false when absent. */
static int opt_grow(lua_State *L, int idx, const char *fn)
{
    if (idx == 0 || lua_isnoneornil(L, idx))
        return 0;
    int t = lua_getfield(L, idx, "grow");
    if (t != LUA_TNIL && t != LUA_TBOOLEAN)
        ml_error(L, fn, "option 'grow' must be a boolean, got %s", luaL_typename(L, -1));
    int grow = lua_toboolean(L, -1);
    lua_pop(L, 1);
    return grow;
}

/* pool.new(bytes, {grow=, device=}) */
static int l_pool_new(lua_State *L)
{
    static const char fn[] = "moelua.pool.new";
    static const char *const opts[] = {"grow", "device", NULL};
    ml_host *h = ml_host_of(L);
    lua_Integer bytes = luaL_checkinteger(L, 1);
    if (bytes < 0)
        ml_error(L, fn, "argument #1: size must be >= 0 bytes, got %lld", (long long)bytes);
    int optidx = lua_isnoneornil(L, 2) ? 0 : 2;
    ml_check_opts(L, optidx, fn, opts);
    int grow = opt_grow(L, optidx, fn);
    ml_device dev = ml_opt_device(L, optidx, fn, ML_CPU);

    l_pool *u = lua_newuserdatauv(L, sizeof *u, 0);   /* safe empty state first */
    u->p = NULL;
    luaL_setmetatable(L, ML_POOL_MT);
    ml_alloc_status as;
    ml_pool_status ps = ml_pool_new(h, dev, (size_t)bytes, grow, &u->p, &as);
    if (worth_retrying(ps, as)) {
        ml_reclaim(L, h, dev);
        ps = ml_pool_new(h, dev, (size_t)bytes, grow, &u->p, &as);
    }
    if (ps != ML_POOL_OK) {
        char what[64], want[32];
        ml_format_bytes((size_t)bytes, want, sizeof want);
        snprintf(what, sizeof what, "allocating a pool of %s", want);
        raise_alloc(L, fn, h, dev, ps, as, what);
    }
    return 1;
}

/* Free bytes in the block the next slot is carved from. */
static size_t top_free(const ml_pool *p)
{
    const ml_pool_block *b = &p->blocks[p->nslots ? p->slots[p->nslots - 1].block : 0];
    return b->size - b->used;
}

/* One slot of nbytes in u's pool, reclaiming memory once and retrying when
 * growing is refused; the status of the last try. Raises only when a
 * finalizer closed the pool meanwhile. */
static ml_pool_status alloc_retry(lua_State *L, const char *fn, l_pool *u, size_t nbytes,
                                  void **data, size_t *slot, uint64_t *id, ml_alloc_status *as)
{
    ml_pool *p = u->p;
    ml_pool_status ps = ml_pool_alloc(p, nbytes, data, slot, id, as);
    if (worth_retrying(ps, *as)) {
        ml_pool_retain(p);             /* a finalizer might close the pool meanwhile */
        ml_reclaim(L, p->host, p->device);
        int closed = u->p == NULL;
        if (!closed)
            ps = ml_pool_alloc(p, nbytes, data, slot, id, as);
        ml_pool_release(p);
        if (closed)
            ml_error(L, fn, "the pool was closed by a finalizer");
    }
    return ps;
}

/* One slot of nbytes in u's pool (alloc_retry); raise on failure. */
static void *alloc_slot(lua_State *L, const char *fn, l_pool *u, size_t nbytes,
                        size_t *slot, uint64_t *id)
{
    ml_pool *p = u->p;
    void *data = NULL;
    ml_alloc_status as;
    size_t free_before = top_free(p);
    ml_pool_status ps = alloc_retry(L, fn, u, nbytes, &data, slot, id, &as);
    char need[32], avail[32], cap[32];
    ml_format_bytes((nbytes + 63) & ~(size_t)63, need, sizeof need);
    ml_format_bytes(free_before, avail, sizeof avail);
    ml_format_bytes(p->capacity, cap, sizeof cap);
    if (ps == ML_POOL_FULL)
        ml_error(L, "moelua.pool", "pool full: need %s, %s free of %s (grow=false)", need, avail, cap);
    if (ps != ML_POOL_OK) {
        char what[160];
        snprintf(what, sizeof what, "growing the pool (need %s, %s free of %s)", need, avail, cap);
        raise_alloc(L, fn, p->host, p->device, ps, as, what);
    }
    return data;
}

ml_tensor *ml_pool_pushtensor(lua_State *L, const char *fn, int pool_idx, ml_dtype dt, int ndim,
                              const int64_t *shape)
{
    pool_idx = lua_absindex(L, pool_idx);
    ml_pool *p = ml_checkpool(L, pool_idx, fn, "the pool");
    l_pool *u = check_pool_ud(L, pool_idx);
    int64_t n = ml_shape_numel(ndim, shape);
    if (n < 0 || (uint64_t)n > SIZE_MAX / 16)
        ml_error(L, fn, "shape has a negative size or too many elements");
    size_t nbytes = (size_t)n * ml_dtype_size(dt);

    ml_tensor *t = ml_pushtensor(L);   /* safe empty state first */
    size_t slot;
    uint64_t id;
    void *data = alloc_slot(L, fn, u, nbytes, &slot, &id);
    ml_storage *st = calloc(1, sizeof *st);
    if (!st) {
        ml_pool_rewind(p, slot);       /* give the slot back: it is the top one */
        ml_error(L, fn, "out of memory for a tensor header");
    }
    st->data = data;
    st->nbytes = nbytes;
    st->device = p->device;
    st->cat = ML_CAT_POOL;
    st->refs = 1;
    st->host = p->host;
    st->pool = p;
    st->slot = slot;
    st->id = id;
    ml_pool_retain(p);
    t->st = st;
    t->dtype = dt;
    t->ndim = ndim;
    memcpy(t->shape, shape, (size_t)ndim * sizeof *shape);
    ml_set_contiguous_strides(t);
    return t;
}

/* p:tensor(shape, {dtype=}) -> a view in a new slot of the pool */
static int l_pool_tensor(lua_State *L)
{
    static const char fn[] = "Pool:tensor";
    static const char *const opts[] = {"dtype", NULL};
    check_pool(L, 1, fn);
    int64_t shape[ML_MAXDIM];
    int next;
    int ndim = ml_checkshape(L, 2, fn, shape, &next);
    int optidx = lua_istable(L, next) ? next : 0;
    if (!optidx && !lua_isnoneornil(L, next))
        ml_error(L, fn, "argument #%d: expected an options table, got %s", next,
                 luaL_typename(L, next));
    ml_check_opts(L, optidx, fn, opts);
    ml_pool_pushtensor(L, fn, 1, ml_opt_dtype(L, optidx, fn, ML_F32), ndim, shape);
    return 1;
}

static int l_pool_mark(lua_State *L)
{
    lua_pushinteger(L, (lua_Integer)ml_pool_mark(check_pool(L, 1, "Pool:mark")));
    return 1;
}

static int l_pool_rewind(lua_State *L)
{
    static const char fn[] = "Pool:rewind";
    ml_pool *p = check_pool(L, 1, fn);
    lua_Integer mark = luaL_checkinteger(L, 2);
    size_t depth = ml_pool_mark(p);
    if (mark < 0)
        ml_error(L, fn, "argument #2: mark must be >= 0, got %lld", (long long)mark);
    if ((lua_Unsigned)mark > depth)
        ml_error(L, fn, "argument #2: mark %lld is above the current depth %zu",
                 (long long)mark, depth);
    ml_pool_rewind(p, (size_t)mark);
    return 0;
}

static int l_pool_reset(lua_State *L)
{
    ml_pool_rewind(check_pool(L, 1, "Pool:reset"), 0);
    return 0;
}

static int l_pool_reserve(lua_State *L)
{
    static const char fn[] = "Pool:reserve";
    ml_pool *p = check_pool(L, 1, fn);
    lua_Integer bytes = luaL_checkinteger(L, 2);
    if (bytes < 0)
        ml_error(L, fn, "argument #2: size must be >= 0 bytes, got %lld", (long long)bytes);
    ml_alloc_status as;
    ml_pool_status ps = ml_pool_reserve(p, (size_t)bytes, &as);
    if (worth_retrying(ps, as)) {
        ml_reclaim(L, p->host, p->device);
        ps = ml_pool_reserve(p, (size_t)bytes, &as);
    }
    if (ps == ML_POOL_BUSY)
        ml_error(L, fn, "the pool has %zu live slot%s (reserve an empty pool: reset it first)",
                 p->nslots, p->nslots == 1 ? "" : "s");
    if (ps != ML_POOL_OK) {
        char what[64], want[32];
        ml_format_bytes((size_t)bytes, want, sizeof want);
        snprintf(what, sizeof what, "reserving %s", want);
        raise_alloc(L, fn, p->host, p->device, ps, as, what);
    }
    return 0;
}

static int l_pool_stats(lua_State *L)
{
    ml_pool *p = check_pool(L, 1, "Pool:stats");
    lua_createtable(L, 0, 9);
    ml_setfield_int(L, "capacity", (lua_Integer)p->capacity);
    ml_setfield_int(L, "used", (lua_Integer)p->used);
    ml_setfield_int(L, "high_water", (lua_Integer)p->high_water);
    lua_pushnumber(L, p->capacity ? (double)p->used / (double)p->capacity : 0.0);
    lua_setfield(L, -2, "utilisation");
    ml_setfield_int(L, "overflows", (lua_Integer)p->noverflow);
    ml_setfield_int(L, "blocks", (lua_Integer)p->nblocks);
    ml_setfield_int(L, "slots", (lua_Integer)p->nslots);
    lua_pushboolean(L, p->grow);
    lua_setfield(L, -2, "grow");
    lua_pushstring(L, ml_device_names[p->device]);
    lua_setfield(L, -2, "device");
    return 1;
}

/* __gc, __close and :close() share this: idempotent, never raises. Views
 * hold their own reference, so a view outlives a closed pool safely. */
static int l_pool_release(lua_State *L)
{
    l_pool *u = luaL_testudata(L, 1, ML_POOL_MT);
    if (u && u->p) {
        ml_pool_release(u->p);
        u->p = NULL;
    }
    return 0;
}

static int l_pool_tostring(lua_State *L)
{
    l_pool *u = check_pool_ud(L, 1);
    if (!u->p) {
        lua_pushliteral(L, "moelua.Pool(closed)");
        return 1;
    }
    char cap[32], used[32];
    ml_format_bytes(u->p->capacity, cap, sizeof cap);
    ml_format_bytes(u->p->used, used, sizeof used);
    lua_pushfstring(L, "moelua.Pool(%s, %s used of %s, %d slots, %d blocks, grow=%s)",
                    ml_device_names[u->p->device], used, cap, (int)u->p->nslots,
                    (int)u->p->nblocks, u->p->grow ? "true" : "false");
    return 1;
}

static const luaL_Reg pool_functions[] = {
    {"new", l_pool_new},
    {NULL, NULL}
};

static const luaL_Reg pool_methods[] = {
    {"tensor", l_pool_tensor},
    {"mark", l_pool_mark},
    {"rewind", l_pool_rewind},
    {"reset", l_pool_reset},
    {"reserve", l_pool_reserve},
    {"stats", l_pool_stats},
    {"close", l_pool_release},
    {NULL, NULL}
};

static const luaL_Reg pool_meta[] = {
    {"__gc", l_pool_release},
    {"__close", l_pool_release},
    {"__tostring", l_pool_tostring},
    {NULL, NULL}
};

int luaopen_moelua_pool(lua_State *L)
{
    ml_host_of(L);  /* refuse to load outside the host */
    /* views are moelua.Tensor userdata: that metatable must exist first */
    luaL_requiref(L, "moelua.tensor", luaopen_moelua_tensor, 0);
    lua_pop(L, 1);
    luaL_newlib(L, pool_functions);
    luaL_newmetatable(L, ML_POOL_MT);
    luaL_setfuncs(L, pool_meta, 0);
    luaL_newlib(L, pool_methods);
    lua_setfield(L, -2, "__index");
    lua_pop(L, 1);
    return 1;
}
