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

/* Raise for a pool status other than OK and FULL (host/runtime/op.h:
 * ml_pool_refusal). */
static void raise_alloc(lua_State *L, const char *fn, ml_host *h, ml_device dev,
                        ml_pool_status ps, ml_alloc_status as, const char *what)
{
    ml_err e;
    ml_check_op(L, fn, ml_pool_refusal(h, dev, ps, as, what, &e), &e);
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
    ml_args(L, 2, fn);
    ml_host *h = ml_host_of(L);
    lua_Integer bytes = ml_checkinteger_named(L, 1, fn, "argument #1 (bytes)");
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
    if (ml_pool_may_retry(ps, as)) {
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

/* p:tensor(shape, {dtype=}) -> a view in a new slot of the pool */
static int l_pool_tensor(lua_State *L)
{
    static const char fn[] = "Pool:tensor";
    static const char *const opts[] = {"dtype", NULL};
    ml_pool *p = check_pool(L, 1, fn);
    int64_t shape[ML_MAXDIM];
    int next;
    int ndim = ml_checkshape(L, 2, fn, shape, &next);
    int optidx = lua_istable(L, next) ? next : 0;
    if (!optidx && !lua_isnoneornil(L, next))
        ml_error(L, fn, "argument #%d: expected an options table, got %s", next,
                 luaL_typename(L, next));
    ml_args(L, optidx ? optidx : next - 1, fn);   /* nothing after the options */
    ml_check_opts(L, optidx, fn, opts);
    ml_dtype dt = ml_opt_dtype(L, optidx, fn, ML_F32);
    ml_tensor *t = ml_pushtensor(L);   /* safe empty state first */
    ml_err e;
    ml_check_op(L, fn, ml_pool_tensor(ml_host_of(L), p, t, "the tensor", dt, ndim, shape, &e), &e);
    return 1;
}

static int l_pool_mark(lua_State *L)
{
    ml_args(L, 1, "Pool:mark");
    lua_pushinteger(L, (lua_Integer)ml_pool_mark(check_pool(L, 1, "Pool:mark")));
    return 1;
}

static int l_pool_rewind(lua_State *L)
{
    static const char fn[] = "Pool:rewind";
    ml_args(L, 2, fn);
    ml_pool *p = check_pool(L, 1, fn);
    lua_Integer mark = ml_checkinteger_named(L, 2, fn, "argument #2 (mark)");
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
    ml_args(L, 1, "Pool:reset");
    ml_pool_rewind(check_pool(L, 1, "Pool:reset"), 0);
    return 0;
}

static int l_pool_reserve(lua_State *L)
{
    static const char fn[] = "Pool:reserve";
    ml_args(L, 2, fn);
    ml_pool *p = check_pool(L, 1, fn);
    lua_Integer bytes = ml_checkinteger_named(L, 2, fn, "argument #2 (bytes)");
    if (bytes < 0)
        ml_error(L, fn, "argument #2: size must be >= 0 bytes, got %lld", (long long)bytes);
    ml_alloc_status as;
    ml_pool_status ps = ml_pool_reserve(p, (size_t)bytes, &as);
    if (ml_pool_may_retry(ps, as)) {
        uint64_t refused = p->lg->nrefused;   /* one request: counted once */
        ml_reclaim(L, p->host, p->device);
        ps = ml_pool_reserve(p, (size_t)bytes, &as);
        p->lg->nrefused = refused;
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
    ml_args(L, 1, "Pool:stats");
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

static int l_pool_close(lua_State *L)
{
    ml_args(L, 1, "Pool:close");
    return l_pool_release(L);
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
    {"close", l_pool_close},
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
