/*
 * host/bindings/l_unit.c - the Lua library `moelua.unit`: flat units
 * (DESIGN.md, Parameters: flat units; host/runtime/unit.h) as a
 * moelua.Unit userdata. Offsets are 0-based element counts, like the flat
 * buffers they index; segment indices are 1-based, like Lua lists.
 *
 *   unit.new(name, {{name=, shape=, weight_decay=, lr_mult=, frozen=, experts=}, ...})
 *                            segments laid out in the given order; weight_decay
 *                            nil: the optimizer's default; lr_mult 1, frozen
 *                            false, experts nil (or E = shape[1]: E experts)
 *   u:name(), u:numel(), #u  the unit's name, elements, segments
 *   u:segments()             {{name=, offset=, numel=, shape=, weight_decay=,
 *                              lr_mult=, frozen=, experts=}, ...}
 *   u:segment(name)          that table, or nil
 *   u:partition(rank, world) {shard=, padded=, offset=, len=} (rank 0-based)
 *   u:pieces(offset, len)    {{segment=, index=, offset=, seg_offset=, n=}, ...}:
 *                            [offset, offset + len) segment by segment
 *   u:views(flat)            {name = view}: each segment's view of a contiguous
 *                            1-D tensor of at least u:numel() elements
 *
 * Not here: the buffers (any tensor of the right size) and releasing them
 * (Tensor:release_storage, host/bindings/l_tensor.c).
 */
#include "libs.h"
#include "l_util.h"
#include "../runtime/ops_view.h"
#include "../runtime/unit.h"

#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#define ML_UNIT_MT "moelua.Unit"

static ml_unit *check_unit(lua_State *L, int idx)
{
    return luaL_checkudata(L, idx, ML_UNIT_MT);
}

/* ---- unit.new --------------------------------------------------------------- */

static const char *const SEGMENT_KEYS[] = {"name", "shape", "weight_decay", "lr_mult", "frozen",
                                           "experts", NULL};

/* The segment description at idx (a table) into *s; `where` names it in errors. */
static void check_segment_spec(lua_State *L, int idx, const char *where, ml_segment *s)
{
    memset(s, 0, sizeof *s);
    ml_check_opts(L, idx, where, SEGMENT_KEYS);
    if (lua_getfield(L, idx, "name") != LUA_TSTRING)
        ml_error(L, where, "name must be a string, got %s", luaL_typename(L, -1));
    size_t len;
    const char *name = lua_tolstring(L, -1, &len);
    if (len == 0 || len >= ML_UNIT_NAME)
        ml_error(L, where, "name must have 1 to %d characters, got %zu", ML_UNIT_NAME - 1, len);
    memcpy(s->name, name, len + 1);
    lua_pop(L, 1);
    if (lua_getfield(L, idx, "shape") != LUA_TTABLE)
        ml_error(L, where, "shape must be a table, got %s", luaL_typename(L, -1));
    int next;
    s->ndim = ml_checkshape(L, lua_gettop(L), where, s->shape, &next);
    lua_pop(L, 1);
    s->weight_decay = ml_opt_number(L, idx, where, "weight_decay", NAN);
    s->lr_mult = ml_opt_number(L, idx, where, "lr_mult", 1);
    s->frozen = ml_opt_bool(L, idx, where, "frozen", 0);
    s->experts = (int)ml_opt_integer(L, idx, where, "experts", 0, 0, INT_MAX);
}

static int l_unit_new(lua_State *L)
{
    static const char fn[] = "moelua.unit.new";
    ml_args(L, 2, fn);
    const char *name = ml_checkstring_named(L, 1, fn, "argument #1 (name)");
    ml_checktype_named(L, 2, fn, "argument #2 (segments)", LUA_TTABLE);
    ml_unit *u = lua_newuserdatauv(L, sizeof *u, 0);   /* empty first: __gc is safe */
    memset(u, 0, sizeof *u);
    luaL_setmetatable(L, ML_UNIT_MT);
    ml_err e;
    ml_check_op(L, fn, ml_unit_init(u, name, &e), &e);
    lua_Integer n = luaL_len(L, 2);
    for (lua_Integer i = 1; i <= n; i++) {
        char where[64];
        snprintf(where, sizeof where, "%s: segment #%lld", fn, (long long)i);
        if (lua_geti(L, 2, i) != LUA_TTABLE)
            ml_error(L, where, "expected a table, got %s", luaL_typename(L, -1));
        ml_segment s;
        check_segment_spec(L, lua_gettop(L), where, &s);
        lua_pop(L, 1);
        ml_check_op(L, fn, ml_unit_add(u, &s, &e), &e);
    }
    return 1;
}

/* ---- queries ------------------------------------------------------------------ */

static void push_segment(lua_State *L, const ml_segment *s)
{
    lua_createtable(L, 0, 8);
    lua_pushstring(L, s->name);
    lua_setfield(L, -2, "name");
    ml_setfield_int(L, "offset", s->offset);
    ml_setfield_int(L, "numel", s->numel);
    lua_createtable(L, s->ndim, 0);
    for (int d = 0; d < s->ndim; d++) {
        lua_pushinteger(L, s->shape[d]);
        lua_rawseti(L, -2, d + 1);
    }
    lua_setfield(L, -2, "shape");
    if (!isnan(s->weight_decay)) {
        lua_pushnumber(L, s->weight_decay);
        lua_setfield(L, -2, "weight_decay");
    }
    lua_pushnumber(L, s->lr_mult);
    lua_setfield(L, -2, "lr_mult");
    lua_pushboolean(L, s->frozen);
    lua_setfield(L, -2, "frozen");
    if (s->experts)
        ml_setfield_int(L, "experts", s->experts);
}

static int l_unit_name(lua_State *L)
{
    ml_args(L, 1, "Unit:name");
    lua_pushstring(L, check_unit(L, 1)->name);
    return 1;
}

static int l_unit_numel(lua_State *L)
{
    ml_args(L, 1, "Unit:numel");
    lua_pushinteger(L, check_unit(L, 1)->numel);
    return 1;
}

static int l_unit_len(lua_State *L)
{
    lua_pushinteger(L, check_unit(L, 1)->nseg);
    return 1;
}

static int l_unit_segments(lua_State *L)
{
    ml_args(L, 1, "Unit:segments");
    ml_unit *u = check_unit(L, 1);
    lua_createtable(L, u->nseg, 0);
    for (int i = 0; i < u->nseg; i++) {
        push_segment(L, &u->seg[i]);
        lua_rawseti(L, -2, i + 1);
    }
    return 1;
}

static int l_unit_segment(lua_State *L)
{
    ml_args(L, 2, "Unit:segment");
    ml_unit *u = check_unit(L, 1);
    int i = ml_unit_find(u, ml_checkstring_named(L, 2, "Unit:segment", "argument #1 (name)"));
    if (i < 0)
        lua_pushnil(L);
    else
        push_segment(L, &u->seg[i]);
    return 1;
}

static int l_unit_partition(lua_State *L)
{
    static const char fn[] = "Unit:partition";
    ml_args(L, 3, fn);
    ml_unit *u = check_unit(L, 1);
    lua_Integer rank = ml_checkinteger_named(L, 2, fn, "argument #2 (rank)");
    lua_Integer world = ml_checkinteger_named(L, 3, fn, "argument #3 (world)");
    if (world < 1 || world > INT_MAX)
        ml_error(L, fn, "world must be in [1, %d], got %lld", INT_MAX, (long long)world);
    if (rank < 0 || rank >= world)
        ml_error(L, fn, "rank must be in [0, %lld], got %lld", (long long)world - 1,
                 (long long)rank);
    ml_partition p;
    ml_partition_of(u->numel, (int)rank, (int)world, &p);
    lua_createtable(L, 0, 4);
    ml_setfield_int(L, "shard", p.shard);
    ml_setfield_int(L, "padded", p.padded);
    ml_setfield_int(L, "offset", p.offset);
    ml_setfield_int(L, "len", p.len);
    return 1;
}

static int l_unit_pieces(lua_State *L)
{
    static const char fn[] = "Unit:pieces";
    ml_args(L, 3, fn);
    ml_unit *u = check_unit(L, 1);
    lua_Integer off = ml_checkinteger_named(L, 2, fn, "argument #2 (offset)");
    lua_Integer len = ml_checkinteger_named(L, 3, fn, "argument #3 (len)");
    if (off < 0)
        ml_error(L, fn, "offset must be >= 0, got %lld", (long long)off);
    if (len < 0 || len > INT64_MAX - off)
        ml_error(L, fn, "len must be in [0, %lld], got %lld", (long long)(INT64_MAX - off),
                 (long long)len);
    /* at most one piece per segment; the scratch is a userdata: an error frees it */
    ml_piece *pc = lua_newuserdatauv(L, (size_t)(u->nseg ? u->nseg : 1) * sizeof *pc, 0);
    int n = ml_unit_pieces(u, off, len, pc, u->nseg);
    lua_createtable(L, n, 0);
    for (int i = 0; i < n; i++) {
        lua_createtable(L, 0, 5);
        lua_pushstring(L, u->seg[pc[i].seg].name);
        lua_setfield(L, -2, "segment");
        ml_setfield_int(L, "index", pc[i].seg + 1);
        ml_setfield_int(L, "offset", pc[i].offset);
        ml_setfield_int(L, "seg_offset", pc[i].seg_offset);
        ml_setfield_int(L, "n", pc[i].n);
        lua_rawseti(L, -2, i + 1);
    }
    return 1;
}

static int l_unit_views(lua_State *L)
{
    static const char fn[] = "Unit:views";
    ml_args(L, 2, fn);
    ml_unit *u = check_unit(L, 1);
    ml_tensor *flat = ml_checkview(L, 2, fn);
    if (flat->ndim != 1 || !ml_is_contiguous(flat))
        ml_error(L, fn, "flat must be a contiguous 1-D tensor, got %d dims%s", flat->ndim,
                 ml_is_contiguous(flat) ? "" : " (not contiguous)");
    if (flat->shape[0] < u->numel)
        ml_error(L, fn, "flat has %lld elements, unit %s needs %lld", (long long)flat->shape[0],
                 u->name, (long long)u->numel);
    lua_createtable(L, 0, u->nseg);
    for (int i = 0; i < u->nseg; i++) {
        const ml_segment *s = &u->seg[i];
        ml_err e;
        ml_tensor *v = ml_pushtensor(L);
        ml_check_op(L, fn, ml_op_view_at(v, flat, s->offset, s->ndim, s->shape, &e), &e);
        lua_setfield(L, -2, s->name);
    }
    return 1;
}

/* ---- lifetime and printing -------------------------------------------------------- */

/* __gc: idempotent, never raises. */
static int l_unit_gc(lua_State *L)
{
    ml_unit_free(check_unit(L, 1));
    return 0;
}

static int l_unit_tostring(lua_State *L)
{
    ml_unit *u = check_unit(L, 1);
    lua_pushfstring(L, "Unit %s (%I elements, %d segments)", u->name, (lua_Integer)u->numel,
                    u->nseg);
    return 1;
}

static const luaL_Reg unit_functions[] = {
    {"new", l_unit_new},
    {NULL, NULL}
};

static const luaL_Reg unit_methods[] = {
    {"name", l_unit_name},
    {"numel", l_unit_numel},
    {"segments", l_unit_segments},
    {"segment", l_unit_segment},
    {"partition", l_unit_partition},
    {"pieces", l_unit_pieces},
    {"views", l_unit_views},
    {NULL, NULL}
};

static const luaL_Reg unit_meta[] = {
    {"__gc", l_unit_gc},
    {"__len", l_unit_len},
    {"__tostring", l_unit_tostring},
    {NULL, NULL}
};

int luaopen_moelua_unit(lua_State *L)
{
    ml_host_of(L);  /* refuse to load outside the host */
    /* views are moelua.Tensor userdata: that metatable must exist first */
    luaL_requiref(L, "moelua.tensor", luaopen_moelua_tensor, 0);
    lua_pop(L, 1);
    luaL_newlib(L, unit_functions);
    luaL_newmetatable(L, ML_UNIT_MT);
    luaL_setfuncs(L, unit_meta, 0);
    luaL_newlib(L, unit_methods);
    lua_setfield(L, -2, "__index");
    lua_pop(L, 1);
    return 1;
}
