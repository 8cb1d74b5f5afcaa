/*
 * host/bindings/l_store.c - the Lua library `moelua.store`: the expert store
 * (DESIGN.md, Bounded expert memory; host/runtime/store.h) as a moelua.Store
 * userdata. Slabs and slots are numbered from 0.
 *
 *   store.open{device="cpu", path=, slabs=, slab_bytes=, slots=, prefetch=2,
 *              category="params", slot_category="cache"} -> s
 *                          cpu: creates the backing file at path (never an
 *                          existing one, never on tmpfs), fallocated: slabs *
 *                          slab_bytes on the `file` book; cuda: the slabs in
 *                          pinned host memory on the `pinned` book (no path),
 *                          moved on a copy stream. The backing bytes are under
 *                          category (or category = {params = b1, grads = b2,
 *                          ...}: a slab's bytes per category, adding up to
 *                          slab_bytes); `slots` slots of slab_bytes (a multiple
 *                          of 4) as one allocation under slot_category on the
 *                          device's book. prefetch: scheduled slabs read
 *                          ahead after each acquire (cpu: posix_fadvise
 *                          hints; cuda: copied into slots on the copy stream,
 *                          only into the slot a miss would take). Inside
 *                          mem.plan: the plan's books, no file, no byte moved.
 *   s:slot(i[, dtype])     a tensor [slab_bytes / size] of dtype ("f32", the default, or
 *                          "bf16": a slab may hold both) on the store's device viewing slot i,
 *                          valid while s is open (using it afterwards is an error)
 *   s:read(slab, slot)     the slab's bytes into the slot   } direct, bypassing the
 *   s:write(slot, slab)    the slot's bytes to the slab     } policy: initial fill, checkpoints
 *   s:schedule{slab, ...}  the future access order, once routing is known ({}: none)
 *   s:acquire(slab) -> slot, hit   the slab resident and pinned (a miss evicts the
 *                          unpinned slab needed furthest ahead, LRU without a schedule)
 *   s:release(slab[, dirty])  unpin; dirty = true: written back before its slot is reused
 *   s:flush()              write back every dirty resident slab
 *   s:resident(slab) -> slot or nil
 *   s:stats() -> {hits=, misses=, evictions=, writebacks=, prefetches=, bytes_read=,
 *                 bytes_written=, slots=, slabs=, slab_bytes=}
 *   s:close() / __close / __gc   free the slots, credit the books, remove the file.
 *                          Nothing is written back implicitly: the file is not
 *                          a recovery source (read slabs out to keep them).
 *
 * Transfers are synchronous pread/pwrite on the calling thread (cpu) or
 * copies ordered against the kernels by events (cuda); errors name the
 * path or the tier, and the slab. Not here: the policy, the file and the
 * pinned memory (the runtime), what a slab holds (the moe layer).
 */
#include "libs.h"
#include "l_util.h"
#include "../runtime/store.h"

#define ML_STORE_MT "moelua.Store"

/* The userdata: the store, NULL once closed. */
typedef struct {
    ml_expert_store *s;
} l_store;

static ml_expert_store *check_store(lua_State *L, const char *fn)
{
    l_store *u = luaL_checkudata(L, 1, ML_STORE_MT);
    if (!u->s)
        ml_error(L, fn, "the store is closed");
    return u->s;
}

/* Argument idx: a slab or slot number in [0, n). */
static size_t check_id(lua_State *L, int idx, const char *fn, const char *what, size_t n)
{
    lua_Integer v = ml_checkinteger_named(L, idx, fn, what);
    if (v < 0 || (lua_Unsigned)v >= n)
        ml_error(L, fn, "%s %lld is outside [0, %zu)", what, (long long)v, n);
    return (size_t)v;
}

/* A required option: an integer >= 1. */
static size_t opt_count(lua_State *L, const char *fn, const char *key)
{
    int64_t v = ml_opt_integer(L, 1, fn, key, -1, 1, INT64_MAX);
    if (v < 0)
        ml_error(L, fn, "option '%s' is required (an integer >= 1)", key);
    return (size_t)v;
}

static int l_store_open(lua_State *L)
{
    static const char fn[] = "moelua.store.open";
    static const char *const opts[] = {"device", "path", "slabs", "slab_bytes", "slots", "prefetch",
                                       "category", "slot_category", NULL};
    ml_args(L, 1, fn);
    ml_host *h = ml_host_of(L);
    luaL_checktype(L, 1, LUA_TTABLE);
    ml_check_opts(L, 1, fn, opts);
    ml_store_opts o = {.device = ml_opt_device(L, 1, fn, ML_CPU)};
    ml_check_device(L, fn, o.device);
    int path_type = lua_getfield(L, 1, "path");
    if (o.device == ML_CPU && path_type != LUA_TSTRING)
        ml_error(L, fn, "option 'path' must be a file name, got %s", luaL_typename(L, -1));
    if (o.device == ML_CUDA && path_type != LUA_TNIL)
        ml_error(L, fn, "option 'path': a cuda store keeps its slabs in pinned host memory, not in a "
                 "file (leave it out)");
    o.path = lua_tostring(L, -1);   /* kept alive by the options table */
    lua_pop(L, 1);
    o.nslabs = opt_count(L, fn, "slabs");
    o.slab_bytes = opt_count(L, fn, "slab_bytes");
    if (o.slab_bytes % 4)
        ml_error(L, fn, "option 'slab_bytes' must be a multiple of 4 (slots are viewed as f32), "
                 "got %zu", o.slab_bytes);
    o.nslots = opt_count(L, fn, "slots");
    o.prefetch_depth = (size_t)ml_opt_integer(L, 1, fn, "prefetch", 2, 0, INT64_MAX);
    o.category = ML_CAT_PARAMS;
    if (lua_getfield(L, 1, "category") == LUA_TTABLE) {   /* {category = bytes of a slab, ...} */
        lua_pushnil(L);
        while (lua_next(L, -2)) {
            int c = lua_type(L, -2) == LUA_TSTRING ? ml_category_from_name(lua_tostring(L, -2)) : -1;
            if (c < 0 || !lua_isinteger(L, -1) || lua_tointeger(L, -1) < 1)
                ml_error(L, fn, "option 'category': expected {<category> = bytes >= 1 of a slab, ...} "
                         "(params, grads, optim, acts, pool, comm, cache, other)");
            o.cat_bytes[c] = (size_t)lua_tointeger(L, -1);
            lua_pop(L, 1);
        }
    } else if (!lua_isnil(L, -1)) {
        int c = lua_type(L, -1) == LUA_TSTRING ? ml_category_from_name(lua_tostring(L, -1)) : -1;
        if (c < 0)
            ml_error(L, fn, "option 'category': unknown category '%s' (params, grads, optim, acts, "
                     "pool, comm, cache, other)", luaL_tolstring(L, -1, NULL));
        o.category = (ml_category)c;
    }
    lua_pop(L, 1);
    o.slot_category = ML_CAT_CACHE;
    if (lua_getfield(L, 1, "slot_category") != LUA_TNIL) {
        int c = lua_type(L, -1) == LUA_TSTRING ? ml_category_from_name(lua_tostring(L, -1)) : -1;
        if (c < 0)
            ml_error(L, fn, "option 'slot_category': unknown category '%s' (params, grads, optim, acts, "
                     "pool, comm, cache, other)", luaL_tolstring(L, -1, NULL));
        o.slot_category = (ml_category)c;
    }
    lua_pop(L, 1);
    l_store *u = lua_newuserdatauv(L, sizeof *u, 0);   /* safe empty state first */
    u->s = NULL;
    luaL_setmetatable(L, ML_STORE_MT);
    ml_err e;
    ml_check_op(L, fn, ml_store_open(h, &o, &u->s, &e), &e);
    return 1;
}

/* s:slot(i[, dtype]): a view holding a reference to the slots' storage,
 * which the store releases on close (tensor.h: ml_storage_release_memory),
 * so a view that outlives the store is an error to use, never a dangling
 * pointer. Slots are 64-byte aligned and slab_bytes a multiple of 4, so
 * either dtype tiles a slot exactly. */
static int l_store_slot(lua_State *L)
{
    static const char fn[] = "Store:slot";
    static const char *const dtypes[] = {"f32", "bf16", NULL};
    static const ml_dtype dt_of[] = {ML_F32, ML_BF16};
    ml_args(L, 3, fn);
    ml_expert_store *s = check_store(L, fn);
    size_t slot = check_id(L, 2, fn, "slot", s->nslots);
    const char *name = luaL_optstring(L, 3, "f32");
    int d = 0;
    while (dtypes[d] && strcmp(dtypes[d], name) != 0)
        d++;
    if (!dtypes[d])
        ml_error(L, fn, "dtype must be \"f32\" or \"bf16\", got \"%s\"", name);
    size_t size = ml_dtype_size(dt_of[d]);
    ml_tensor *t = ml_pushtensor(L);
    ml_storage_retain(s->slots.st);
    t->st = s->slots.st;
    t->offset = (int64_t)(slot * s->stride / size);
    t->dtype = dt_of[d];
    t->ndim = 1;
    t->shape[0] = (int64_t)(s->slab_bytes / size);
    t->stride[0] = 1;
    return 1;
}

static int l_store_read(lua_State *L)
{
    static const char fn[] = "Store:read";
    ml_args(L, 3, fn);
    ml_expert_store *s = check_store(L, fn);
    size_t slab = check_id(L, 2, fn, "slab", s->nslabs);
    size_t slot = check_id(L, 3, fn, "slot", s->nslots);
    ml_err e;
    ml_check_op(L, fn, ml_store_read(s, slab, slot, &e), &e);
    return 0;
}

static int l_store_write(lua_State *L)
{
    static const char fn[] = "Store:write";
    ml_args(L, 3, fn);
    ml_expert_store *s = check_store(L, fn);
    size_t slot = check_id(L, 2, fn, "slot", s->nslots);
    size_t slab = check_id(L, 3, fn, "slab", s->nslabs);
    ml_err e;
    ml_check_op(L, fn, ml_store_write(s, slot, slab, &e), &e);
    return 0;
}

static int l_store_schedule(lua_State *L)
{
    static const char fn[] = "Store:schedule";
    ml_args(L, 2, fn);
    ml_expert_store *s = check_store(L, fn);
    luaL_checktype(L, 2, LUA_TTABLE);
    size_t n = (size_t)luaL_len(L, 2);
    /* a userdata buffer: collected if an entry below raises */
    int64_t *seq = lua_newuserdatauv(L, (n ? n : 1) * sizeof *seq, 0);
    for (size_t i = 0; i < n; i++) {
        lua_geti(L, 2, (lua_Integer)i + 1);
        int isint;
        seq[i] = (int64_t)lua_tointegerx(L, -1, &isint);
        if (!isint || lua_type(L, -1) != LUA_TNUMBER)
            ml_error(L, fn, "argument #2: entry %zu must be an integer slab id, got %s", i + 1,
                     luaL_typename(L, -1));
        lua_pop(L, 1);
    }
    ml_err e;
    ml_check_op(L, fn, ml_store_schedule(s, seq, n, &e), &e);
    return 0;
}

static int l_store_acquire(lua_State *L)
{
    static const char fn[] = "Store:acquire";
    ml_args(L, 2, fn);
    ml_expert_store *s = check_store(L, fn);
    size_t slab = check_id(L, 2, fn, "slab", s->nslabs), slot;
    int hit;
    ml_err e;
    ml_check_op(L, fn, ml_store_acquire(s, slab, &slot, &hit, &e), &e);
    lua_pushinteger(L, (lua_Integer)slot);
    lua_pushboolean(L, hit);
    return 2;
}

static int l_store_release(lua_State *L)
{
    static const char fn[] = "Store:release";
    ml_args(L, 3, fn);
    ml_expert_store *s = check_store(L, fn);
    size_t slab = check_id(L, 2, fn, "slab", s->nslabs);
    if (!lua_isnoneornil(L, 3) && !lua_isboolean(L, 3))
        ml_error(L, fn, "argument #3 (dirty) must be a boolean, got %s", luaL_typename(L, 3));
    ml_err e;
    ml_check_op(L, fn, ml_store_release(s, slab, lua_toboolean(L, 3), &e), &e);
    return 0;
}

static int l_store_flush(lua_State *L)
{
    static const char fn[] = "Store:flush";
    ml_args(L, 1, fn);
    ml_expert_store *s = check_store(L, fn);
    ml_err e;
    ml_check_op(L, fn, ml_store_flush(s, &e), &e);
    return 0;
}

static int l_store_resident(lua_State *L)
{
    static const char fn[] = "Store:resident";
    ml_args(L, 2, fn);
    ml_expert_store *s = check_store(L, fn);
    int64_t slot = ml_store_resident(s, check_id(L, 2, fn, "slab", s->nslabs));
    if (slot < 0)
        lua_pushnil(L);
    else
        lua_pushinteger(L, (lua_Integer)slot);
    return 1;
}

static int l_store_stats(lua_State *L)
{
    ml_args(L, 1, "Store:stats");
    ml_expert_store *s = check_store(L, "Store:stats");
    const ml_store_stats *st = &s->stats;
    lua_createtable(L, 0, 10);
    ml_setfield_int(L, "hits", (lua_Integer)st->hits);
    ml_setfield_int(L, "misses", (lua_Integer)st->misses);
    ml_setfield_int(L, "evictions", (lua_Integer)st->evictions);
    ml_setfield_int(L, "writebacks", (lua_Integer)st->writebacks);
    ml_setfield_int(L, "prefetches", (lua_Integer)st->prefetches);
    ml_setfield_int(L, "bytes_read", (lua_Integer)st->bytes_read);
    ml_setfield_int(L, "bytes_written", (lua_Integer)st->bytes_written);
    ml_setfield_int(L, "slots", (lua_Integer)s->nslots);
    ml_setfield_int(L, "slabs", (lua_Integer)s->nslabs);
    ml_setfield_int(L, "slab_bytes", (lua_Integer)s->slab_bytes);
    return 1;
}

/* __gc, __close and :close() share this: idempotent, never raises. */
static int l_store_gc(lua_State *L)
{
    l_store *u = luaL_testudata(L, 1, ML_STORE_MT);
    if (u && u->s) {
        ml_store_close(u->s);
        u->s = NULL;
    }
    return 0;
}

static int l_store_close(lua_State *L)
{
    ml_args(L, 1, "Store:close");
    return l_store_gc(L);
}

static int l_store_tostring(lua_State *L)
{
    l_store *u = luaL_checkudata(L, 1, ML_STORE_MT);
    if (!u->s) {
        lua_pushliteral(L, "moelua.Store(closed)");
        return 1;
    }
    char slab[32];
    ml_format_bytes(u->s->slab_bytes, slab, sizeof slab);
    lua_pushfstring(L, "moelua.Store(%s, %d slabs of %s, %d slots%s)",
                    u->s->path ? u->s->path : "pinned host memory, cuda slots",
                    (int)u->s->nslabs, slab, (int)u->s->nslots, u->s->planned ? ", planned" : "");
    return 1;
}

static const luaL_Reg store_functions[] = {
    {"open", l_store_open},
    {NULL, NULL}
};

static const luaL_Reg store_methods[] = {
    {"slot", l_store_slot},
    {"read", l_store_read},
    {"write", l_store_write},
    {"schedule", l_store_schedule},
    {"acquire", l_store_acquire},
    {"release", l_store_release},
    {"flush", l_store_flush},
    {"resident", l_store_resident},
    {"stats", l_store_stats},
    {"close", l_store_close},
    {NULL, NULL}
};

static const luaL_Reg store_meta[] = {
    {"__gc", l_store_gc},
    {"__close", l_store_gc},
    {"__tostring", l_store_tostring},
    {NULL, NULL}
};

int luaopen_moelua_store(lua_State *L)
{
    ml_host_of(L);  /* refuse to load outside the host */
    /* slot views are moelua.Tensor userdata: that metatable must exist first */
    luaL_requiref(L, "moelua.tensor", luaopen_moelua_tensor, 0);
    lua_pop(L, 1);
    luaL_newlib(L, store_functions);
    luaL_newmetatable(L, ML_STORE_MT);
    luaL_setfuncs(L, store_meta, 0);
    luaL_newlib(L, store_methods);
    lua_setfield(L, -2, "__index");
    lua_pop(L, 1);
    return 1;
}
