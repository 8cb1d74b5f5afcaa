/*
 * host/bindings/l_tensor.c - the Lua library `moelua.tensor`: the moelua.Tensor
 * userdata, creation, views, copies between dtypes and devices, releasing
 * and re-acquiring a storage's memory (ZeRO-3's units), printing.
 * The math bindings (elementwise, reductions, matmul, ...) are in
 * host/bindings/l_tensor_math.c and are added to the same method table.
 *
 * Conventions: dims and positions given as arguments are 1-based, like Lua
 * and Torch7 (t:narrow(1, 1, 2) is the first two rows; -1 is the last dim).
 * Index *data* (topk indices, index_select, gather) is 0-based int64, the
 * convention shared with kernels, files and Hugging Face.
 */
#include "l_tensor.h"
#include "../runtime/ops_math.h"
#include "../runtime/ops_view.h"
#include "../runtime/pool.h"

#include <stdio.h>
#include <string.h>

/* ---- helpers shared with the other binding files ----------------------- */

void ml_run_copy(lua_State *L, const char *fn, ml_tensor *dst, const ml_tensor *src)
{
    ml_err e;
    ml_check_op(L, fn, ml_op_copy(ml_host_of(L), dst, src, &e), &e);
}

ml_tensor *ml_contiguous_arg(lua_State *L, int idx, const char *fn)
{
    ml_tensor *t = ml_checktensor(L, idx, fn);
    if (ml_is_contiguous(t))
        return t;
    ml_tensor *c = ml_pushtensor(L);
    ml_err e;
    ml_check_op(L, fn, ml_op_contiguous(ml_host_of(L), c, t, &e), &e);
    lua_replace(L, idx);   /* the copy takes the argument's place and is owned by the stack */
    return c;
}

/* ---- creation ------------------------------------------------------------ */

static const char *const CREATE_OPTS[] = {"dtype", "device", NULL};

/* Nothing but nils after the arguments, which end at next - 1 or, with an
 * options table, at optidx: (2, 3, "f64") gives no options, it is an error. */
static void check_rest(lua_State *L, const char *fn, int next, int optidx)
{
    for (int i = optidx ? optidx + 1 : next; i <= lua_gettop(L); i++) {
        if (lua_isnil(L, i))
            continue;
        if (!optidx && i == next)
            ml_error(L, fn, "argument #%d: expected an options table {dtype =, device =}, got %s", i,
                     luaL_typename(L, i));
        ml_error(L, fn, "argument #%d: unexpected %s after the %s", i, luaL_typename(L, i),
                 optidx ? "options table" : "arguments");
    }
}

/* Shape, then an optional options table: (2, 3, opts) or ({2, 3}, opts).
 * reserve: a reserved storage (tensor.reserve), else an allocated one. */
static ml_tensor *create_as(lua_State *L, const char *fn, int idx, int *optidx,
                            const char *const *allowed, int reserve)
{
    int64_t shape[ML_MAXDIM];
    int next;
    int ndim = ml_checkshape(L, idx, fn, shape, &next);
    *optidx = lua_istable(L, next) ? next : 0;
    check_rest(L, fn, next, *optidx);
    ml_check_opts(L, *optidx, fn, allowed);
    ml_dtype dt = ml_opt_dtype(L, *optidx, fn, ML_F32);
    ml_device dev = ml_opt_device(L, *optidx, fn, ML_CPU);
    if (!reserve)
        return ml_newtensor(L, fn, dev, dt, ndim, shape);
    ml_tensor *t = ml_pushtensor(L);
    ml_err e;
    ml_check_op(L, fn, ml_tensor_reserve(ml_host_of(L), t, dev, dt, ndim, shape, &e), &e);
    return t;
}

static ml_tensor *create(lua_State *L, const char *fn, int idx, int *optidx,
                         const char *const *allowed)
{
    return create_as(L, fn, idx, optidx, allowed, 0);
}

static int fill_new(lua_State *L, const char *fn, double v)
{
    int opt;
    ml_tensor *t = create(L, fn, 1, &opt, CREATE_OPTS);
    ml_err e;
    ml_check_op(L, fn, ml_op_fill(ml_host_of(L), t, v, &e), &e);
    return 1;
}

static int l_tensor_zeros(lua_State *L) { return fill_new(L, "moelua.zeros", 0); }
static int l_tensor_ones(lua_State *L) { return fill_new(L, "moelua.ones", 1); }

static int l_tensor_empty(lua_State *L)
{
    int opt;
    create(L, "moelua.empty", 1, &opt, CREATE_OPTS);
    return 1;
}

/* tensor.reserve(shape [, {dtype =, device =}]): a tensor of a reserved
 * storage (tensor.h: ml_storage_reserve) under the current category; on
 * the CPU it costs the ledger nothing until views of it are committed
 * (t:commit_()), and an op refuses a view of uncommitted elements. */
static int l_tensor_reserve(lua_State *L)
{
    int opt;
    create_as(L, "moelua.reserve", 1, &opt, CREATE_OPTS, 1);
    return 1;
}

static int l_tensor_full(lua_State *L)
{
    static const char fn[] = "moelua.full";
    int64_t shape[ML_MAXDIM];
    int next;
    int ndim = ml_checkshape(L, 1, fn, shape, &next);
    if (lua_type(L, next) != LUA_TNUMBER)
        ml_error(L, fn, "argument #%d: expected the fill value, got %s", next, luaL_typename(L, next));
    double v = lua_tonumber(L, next);
    int opt = lua_istable(L, next + 1) ? next + 1 : 0;
    check_rest(L, fn, next + 1, opt);
    ml_check_opts(L, opt, fn, CREATE_OPTS);
    ml_tensor *t = ml_newtensor(L, fn, ml_opt_device(L, opt, fn, ML_CPU),
                                ml_opt_dtype(L, opt, fn, ML_F32), ndim, shape);
    ml_err e;
    ml_check_op(L, fn, ml_op_fill(ml_host_of(L), t, v, &e), &e);
    return 1;
}

/* arange(n) | arange(start, stop [, step]), stop exclusive, like Python. */
static int l_tensor_arange(lua_State *L)
{
    static const char fn[] = "moelua.arange";
    int nnum = 0;
    while (nnum < 3 && lua_type(L, nnum + 1) == LUA_TNUMBER)
        nnum++;
    if (nnum == 0)
        ml_error(L, fn, "expected arange(n) or arange(start, stop [, step])");
    double start = 0, stop, step = 1;
    if (nnum == 1) {
        stop = lua_tonumber(L, 1);
    } else {
        start = lua_tonumber(L, 1);
        stop = lua_tonumber(L, 2);
        if (nnum == 3)
            step = lua_tonumber(L, 3);
    }
    int opt = lua_istable(L, nnum + 1) ? nnum + 1 : 0;
    check_rest(L, fn, nnum + 1, opt);
    ml_check_opts(L, opt, fn, CREATE_OPTS);
    ml_device dev = ml_opt_device(L, opt, fn, ML_CPU);
    ml_dtype dt = ml_opt_dtype(L, opt, fn, ML_F32);
    ml_tensor *t = ml_pushtensor(L);
    ml_err e;
    ml_check_op(L, fn, ml_op_arange(ml_host_of(L), t, dev, dt, start, stop, step, &e), &e);
    return 1;
}

/* Shape of a nested Lua table, following first elements. */
static int table_shape(lua_State *L, int idx, const char *fn, int64_t *shape)
{
    int ndim = 0;
    lua_pushvalue(L, idx);
    while (lua_istable(L, -1)) {
        if (ndim == ML_MAXDIM)
            ml_error(L, fn, "nested deeper than %d levels", ML_MAXDIM);
        shape[ndim++] = (int64_t)luaL_len(L, -1);
        lua_geti(L, -1, 1);
        lua_remove(L, -2);
    }
    lua_pop(L, 1);
    return ndim;
}

static void table_fill(lua_State *L, const char *fn, ml_tensor *t, int level, int64_t *pos)
{
    int64_t n = luaL_len(L, -1);
    if (n != t->shape[level])
        ml_error(L, fn, "ragged table: %lld elements at depth %d where %lld were expected",
                 (long long)n, level + 1, (long long)t->shape[level]);
    for (int64_t i = 1; i <= n; i++) {
        lua_geti(L, -1, i);
        if (level + 1 < t->ndim) {
            if (!lua_istable(L, -1))
                ml_error(L, fn, "ragged table: expected a table at depth %d, got %s", level + 2,
                         luaL_typename(L, -1));
            table_fill(L, fn, t, level + 1, pos);
        } else {
            int isnum;
            double v = lua_tonumberx(L, -1, &isnum);
            if (!isnum)
                ml_error(L, fn, "element %lld is %s, not a number", (long long)(*pos + 1),
                         luaL_typename(L, -1));
            if (t->dtype == ML_I64 && lua_isinteger(L, -1))   /* exact beyond 2^53 */
                ((int64_t *)t->st->data)[(*pos)++] = lua_tointeger(L, -1);
            else
                ml_store(t->dtype, t->st->data, (size_t)(*pos)++, v);
        }
        lua_pop(L, 1);
    }
}

/* moelua.tensor(table [, opts]): values from a (nested) Lua table or a number (0-dim). */
static int l_tensor_tensor(lua_State *L)
{
    static const char fn[] = "moelua.tensor";
    ml_args(L, 2, fn);
    if (!lua_istable(L, 1) && lua_type(L, 1) != LUA_TNUMBER)
        ml_error(L, fn, "argument #1: expected a table or a number, got %s", luaL_typename(L, 1));
    ml_check_opts(L, 2, fn, CREATE_OPTS);
    ml_dtype dt = ml_opt_dtype(L, 2, fn, ML_F32);
    ml_device dev = ml_opt_device(L, 2, fn, ML_CPU);
    int64_t shape[ML_MAXDIM];
    int ndim = lua_istable(L, 1) ? table_shape(L, 1, fn, shape) : 0;
    ml_tensor *t = ml_newtensor(L, fn, ML_CPU, dt, ndim, shape);
    if (ndim == 0 && dt == ML_I64 && lua_isinteger(L, 1)) {
        *(int64_t *)t->st->data = lua_tointeger(L, 1);
    } else if (ndim == 0) {
        ml_store(dt, t->st->data, 0, lua_tonumber(L, 1));
    } else {
        int64_t pos = 0;
        lua_pushvalue(L, 1);
        table_fill(L, fn, t, 0, &pos);
        lua_pop(L, 1);
    }
    if (dev != ML_CPU) {
        ml_tensor *d = ml_newtensor(L, fn, dev, dt, ndim, shape);
        ml_run_copy(L, fn, d, t);
    }
    return 1;
}

/* ---- random ------------------------------------------------------------ */

static const char *const RAND_OPTS[] = {"dtype", "device", "lo", "hi", "seed", "offset", NULL};
static const char *const RANDN_OPTS[] = {"dtype", "device", "mean", "std", "seed", "offset", NULL};

/* A draw uses the host generator (advancing its counter) unless opts give
 * a seed and/or an offset (seed defaults to the host's, offset to 0), which
 * address a stream directly and advance nothing. t: the tensor drawn into;
 * opt: the options' stack index (0: none). */
static int draw_into(lua_State *L, const char *fn, ml_tensor *t, int opt, int normal)
{
    ml_host *h = ml_host_of(L);
    double a = 0, b = 1;
    uint64_t seed = h->seed, offset = h->rng_offset;
    int addressed = 0;   /* {seed=} and/or {offset=}: a fixed place in a stream */
    if (opt) {
        a = ml_opt_number(L, opt, fn, normal ? "mean" : "lo", a);
        b = ml_opt_number(L, opt, fn, normal ? "std" : "hi", b);
        int has_seed = lua_getfield(L, opt, "seed") != LUA_TNIL;
        int has_offset = lua_getfield(L, opt, "offset") != LUA_TNIL;
        lua_pop(L, 2);
        if (has_seed) {
            seed = (uint64_t)ml_opt_integer(L, opt, fn, "seed", 0, INT64_MIN, INT64_MAX);
            offset = 0;
            addressed = 1;
        }
        if (has_offset) {
            offset = (uint64_t)ml_opt_integer(L, opt, fn, "offset", 0, 0, INT64_MAX);
            addressed = 1;
        }
    }
    ml_err e;
    ml_check_op(L, fn, normal ? ml_op_randn(h, t, seed, offset, a, b, &e)
                              : ml_op_rand(h, t, seed, offset, a, b, &e), &e);
    if (!addressed)
        h->rng_offset += (uint64_t)(ml_numel(t) + 3) / 4;
    return 1;
}

static int draw(lua_State *L, const char *fn, int normal)
{
    int opt;
    ml_tensor *t = create(L, fn, 1, &opt, normal ? RANDN_OPTS : RAND_OPTS);
    return draw_into(L, fn, t, opt, normal);
}

/* t:normal_{mean =, std =, seed =, offset =}: t (contiguous) drawn in
 * place, the numbers moelua.randn of its shape and dtype gives with the
 * same options (a model draws its weights into its flat units). */
static int l_tensor_normal_(lua_State *L)
{
    static const char fn[] = "Tensor:normal_";
    static const char *const opts[] = {"mean", "std", "seed", "offset", NULL};
    ml_args(L, 2, fn);
    ml_tensor *t = ml_checktensor(L, 1, fn);
    int opt = lua_isnoneornil(L, 2) ? 0 : 2;
    if (opt)
        ml_checktype_named(L, 2, fn, "argument #1 (options)", LUA_TTABLE);
    ml_check_opts(L, opt, fn, opts);
    lua_settop(L, opt ? 2 : 1);
    lua_pushvalue(L, 1);
    return draw_into(L, fn, t, opt, 1);
}

static int l_tensor_rand(lua_State *L) { return draw(L, "moelua.rand", 0); }
static int l_tensor_randn(lua_State *L) { return draw(L, "moelua.randn", 1); }

/* moelua.philox4x32_10({c0,c1,c2,c3}, {k0,k1}) -> four u32: the raw block,
 * for known-answer tests against Random123. */
static int l_tensor_philox4x32_10(lua_State *L)
{
    static const char fn[] = "moelua.philox4x32_10";
    ml_args(L, 2, fn);
    uint32_t ctr[4], key[2], out[4];
    ml_checktype_named(L, 1, fn, "argument #1 (counter)", LUA_TTABLE);
    ml_checktype_named(L, 2, fn, "argument #2 (key)", LUA_TTABLE);
    for (int i = 0; i < 6; i++) {
        lua_geti(L, i < 4 ? 1 : 2, i < 4 ? i + 1 : i - 3);
        int isint;
        lua_Integer v = lua_tointegerx(L, -1, &isint);
        if (!isint || v < 0 || v > 0xffffffffLL)
            ml_error(L, fn, "%s word %d must be an integer in [0, 2^32)", i < 4 ? "counter" : "key",
                     i < 4 ? i + 1 : i - 3);
        if (i < 4) ctr[i] = (uint32_t)v; else key[i - 4] = (uint32_t)v;
        lua_pop(L, 1);
    }
    ml_philox4x32_10(ctr, key, out);
    for (int i = 0; i < 4; i++)
        lua_pushinteger(L, out[i]);
    return 4;
}

static int l_tensor_manual_seed(lua_State *L)
{
    ml_args(L, 1, "moelua.manual_seed");
    ml_host *h = ml_host_of(L);
    h->seed = (uint64_t)ml_checkinteger_named(L, 1, "moelua.manual_seed", "argument #1 (seed)");
    h->rng_offset = 0;
    return 0;
}

/* moelua.rng_state() -> {seed=, offset=}; moelua.rng_state(t) restores it. */
static int l_tensor_rng_state(lua_State *L)
{
    ml_host *h = ml_host_of(L);
    ml_args(L, 1, "moelua.rng_state");
    lua_settop(L, 1);
    if (!lua_isnil(L, 1)) {   /* both fields, as rng_state() gave them */
        if (!lua_istable(L, 1))
            ml_error(L, "moelua.rng_state", "expected a state {seed =, offset =} (from rng_state()), got %s",
                     luaL_typename(L, 1));
        for (int i = 0; i < 2; i++)
            if (lua_getfield(L, 1, i ? "offset" : "seed") == LUA_TNIL)
                ml_error(L, "moelua.rng_state", "the state has no '%s' (rng_state() gives {seed =, offset =})",
                         i ? "offset" : "seed");
        lua_pop(L, 2);
        uint64_t seed = (uint64_t)ml_opt_integer(L, 1, "moelua.rng_state", "seed", 0, INT64_MIN, INT64_MAX);
        h->rng_offset = (uint64_t)ml_opt_integer(L, 1, "moelua.rng_state", "offset", 0, 0, INT64_MAX);
        h->seed = seed;
        return 0;
    }
    lua_createtable(L, 0, 2);
    lua_pushinteger(L, (lua_Integer)h->seed);
    lua_setfield(L, -2, "seed");
    lua_pushinteger(L, (lua_Integer)h->rng_offset);
    lua_setfield(L, -2, "offset");
    return 1;
}

static int l_tensor_threads(lua_State *L)
{
    ml_args(L, 1, "moelua.threads");
    ml_host *h = ml_host_of(L);
    if (!lua_isnoneornil(L, 1)) {
        lua_Integer n = ml_checkinteger_named(L, 1, "moelua.threads", "argument #1 (n)");
        if (n < 1 || n > 1024)
            ml_error(L, "moelua.threads", "thread count must be in 1..1024, got %lld", (long long)n);
        ml_host_set_threads(h, (int)n);
    }
    lua_pushinteger(L, h->nthreads);
    return 1;
}

/* cuda_available() -> true and the number of devices, or false and why not */
static int l_tensor_cuda_available(lua_State *L)
{
    ml_args(L, 0, "moelua.cuda_available");
    ml_host *h = ml_host_of(L);
    const ml_memory *mem = h->device_mem[ML_CUDA];
    int devices = mem ? mem->available() : 0;
    if (devices > 0) {
        lua_pushboolean(L, 1);
        lua_pushinteger(L, devices);
        return 2;
    }
    lua_pushboolean(L, 0);
    lua_pushstring(L, ml_device_unavailable_reason(h, ML_CUDA));
    return 2;
}

/* ---- metadata ------------------------------------------------------------ */

static int l_tensor_shape(lua_State *L)
{
    ml_args(L, 1, "Tensor:shape");
    ml_tensor *t = ml_checkview(L, 1, "Tensor:shape");
    lua_createtable(L, t->ndim, 0);
    for (int i = 0; i < t->ndim; i++) {
        lua_pushinteger(L, t->shape[i]);
        lua_rawseti(L, -2, i + 1);
    }
    return 1;
}

/* t:stride() -> every dim's stride (elements); t:stride(dim) -> one */
static int l_tensor_stride(lua_State *L)
{
    ml_args(L, 2, "Tensor:stride");
    lua_settop(L, 2);
    ml_tensor *t = ml_checkview(L, 1, "Tensor:stride");
    if (!lua_isnil(L, 2)) {
        lua_pushinteger(L, t->stride[ml_checkdim(L, 2, "Tensor:stride", t->ndim)]);
        return 1;
    }
    lua_createtable(L, t->ndim, 0);
    for (int i = 0; i < t->ndim; i++) {
        lua_pushinteger(L, t->stride[i]);
        lua_rawseti(L, -2, i + 1);
    }
    return 1;
}

static int l_tensor_size(lua_State *L)
{
    ml_args(L, 2, "Tensor:size");
    lua_settop(L, 2);
    ml_tensor *t = ml_checkview(L, 1, "Tensor:size");
    if (lua_isnoneornil(L, 2))
        return l_tensor_shape(L);
    lua_pushinteger(L, t->shape[ml_checkdim(L, 2, "Tensor:size", t->ndim)]);
    return 1;
}

static int l_tensor_dim(lua_State *L)
{
    ml_args(L, 1, "Tensor:dim");
    lua_pushinteger(L, ml_checkview(L, 1, "Tensor:dim")->ndim);
    return 1;
}

static int l_tensor_numel(lua_State *L)
{
    ml_args(L, 1, "Tensor:numel");
    lua_pushinteger(L, ml_numel(ml_checkview(L, 1, "Tensor:numel")));
    return 1;
}

static int l_tensor_dtype(lua_State *L)
{
    ml_args(L, 1, "Tensor:dtype");
    lua_pushstring(L, ml_dtype_names[ml_checkview(L, 1, "Tensor:dtype")->dtype]);
    return 1;
}

static int l_tensor_device(lua_State *L)
{
    ml_args(L, 1, "Tensor:device");
    lua_pushstring(L, ml_device_names[ml_checkview(L, 1, "Tensor:device")->st->device]);
    return 1;
}

static int l_tensor_category(lua_State *L)
{
    ml_args(L, 1, "Tensor:category");
    lua_pushstring(L, ml_category_names[ml_checkview(L, 1, "Tensor:category")->st->cat]);
    return 1;
}

static int l_tensor_is_contiguous(lua_State *L)
{
    ml_args(L, 1, "Tensor:is_contiguous");
    lua_pushboolean(L, ml_is_contiguous(ml_checkview(L, 1, "Tensor:is_contiguous")));
    return 1;
}

/* t:storage_offset(): the view's first element, counted from the start of
 * its storage (0-based), so a view's place in a flat unit can be found. */
static int l_tensor_storage_offset(lua_State *L)
{
    ml_args(L, 1, "Tensor:storage_offset");
    lua_pushinteger(L, ml_checkview(L, 1, "Tensor:storage_offset")->offset);
    return 1;
}

/* a:same_storage(b): are a and b views of one storage? */
static int l_tensor_same_storage(lua_State *L)
{
    ml_args(L, 2, "Tensor:same_storage");
    ml_tensor *a = ml_checkview(L, 1, "Tensor:same_storage");
    ml_tensor *b = ml_checkview(L, 2, "Tensor:same_storage");
    lua_pushboolean(L, a->st == b->st);
    return 1;
}

static int l_tensor_is_tensor(lua_State *L)
{
    ml_args(L, 1, "moelua.is_tensor");
    lua_pushboolean(L, ml_testtensor(L, 1) != NULL);
    return 1;
}

/* ---- views ------------------------------------------------------------------ */

/* Raise for a view op's status: the pushed view stays empty on failure. */
static int view_done(lua_State *L, const char *fn, ml_status s, const ml_err *e)
{
    ml_check_op(L, fn, s, e);
    return 1;
}

static int l_tensor_narrow(lua_State *L)
{
    static const char fn[] = "Tensor:narrow";
    ml_args(L, 4, fn);
    ml_tensor *t = ml_checkview(L, 1, fn);
    int d = ml_checkdim(L, 2, fn, t->ndim);
    lua_Integer start = ml_checkinteger_named(L, 3, fn, "argument #3 (start)");
    lua_Integer len = ml_checkinteger_named(L, 4, fn, "argument #4 (len)");
    if (start < 1 || len < 0 || start - 1 > t->shape[d] - len)
        ml_error(L, fn, "range [%lld, %lld] is outside dim %d of size %lld (1-based, inclusive)",
                 (long long)start, (long long)(start + len - 1), d + 1, (long long)t->shape[d]);
    ml_err e;
    return view_done(L, fn, ml_op_narrow(ml_pushtensor(L), t, d, start - 1, len, &e), &e);
}

static int l_tensor_select(lua_State *L)
{
    static const char fn[] = "Tensor:select";
    ml_args(L, 3, fn);
    ml_tensor *t = ml_checkview(L, 1, fn);
    int d = ml_checkdim(L, 2, fn, t->ndim);
    lua_Integer i = ml_checkinteger_named(L, 3, fn, "argument #3 (index)");
    int64_t i1 = i < 0 ? i + t->shape[d] + 1 : i;   /* -1 is the last */
    if (i1 < 1 || i1 > t->shape[d])
        ml_error(L, fn, "index %lld is outside dim %d of size %lld (1-based, negative from the end)",
                 (long long)i, d + 1, (long long)t->shape[d]);
    ml_err e;
    return view_done(L, fn, ml_op_select(ml_pushtensor(L), t, d, i1 - 1, &e), &e);
}

/* Size i of a view's shape, at idx: an integer (-1: inferred; the op checks the sizes). */
static int64_t shape_size(lua_State *L, int idx, const char *fn, int i)
{
    lua_Integer v;
    const char *got = ml_not_integer(L, idx, &v);
    if (got)
        ml_error(L, fn, "size of dim %d must be an integer, got %s", i + 1, got);
    return v;
}

/* The sizes of a shape given as a table {2, -1} or as integers from idx
 * on, and nothing after them. */
static int shape_arg(lua_State *L, int idx, const char *fn, int64_t *shape)
{
    int ndim = 0;
    if (lua_istable(L, idx)) {
        ndim = (int)luaL_len(L, idx);
        if (ndim > ML_MAXDIM)
            ml_error(L, fn, "%d dims given, at most %d are supported", ndim, ML_MAXDIM);
        for (int i = 0; i < ndim; i++) {
            lua_geti(L, idx, i + 1);
            shape[i] = shape_size(L, -1, fn, i);
            lua_pop(L, 1);
        }
        ml_args(L, idx, fn);   /* nothing after the shape */
        return ndim;
    }
    while (lua_type(L, idx + ndim) == LUA_TNUMBER) {
        if (ndim == ML_MAXDIM)
            ml_error(L, fn, "more than %d dims given", ML_MAXDIM);
        shape[ndim] = shape_size(L, idx + ndim, fn, ndim);
        ndim++;
    }
    ml_args(L, idx + ndim - 1, fn);
    return ndim;
}

static int l_tensor_view(lua_State *L)
{
    static const char fn[] = "Tensor:view";
    ml_tensor *t = ml_checkview(L, 1, fn);
    int64_t shape[ML_MAXDIM];
    int nd = shape_arg(L, 2, fn, shape);
    ml_err e;
    return view_done(L, fn, ml_op_view(ml_pushtensor(L), t, nd, shape, &e), &e);
}

static int l_tensor_reshape(lua_State *L)
{
    static const char fn[] = "Tensor:reshape";
    ml_tensor *t = ml_checktensor(L, 1, fn);
    int64_t shape[ML_MAXDIM];
    int nd = shape_arg(L, 2, fn, shape);
    ml_err e;
    return view_done(L, fn, ml_op_reshape(ml_host_of(L), ml_pushtensor(L), t, nd, shape, &e), &e);
}

/* flat:view_at(offset, shape): the flat-unit layout's views, `offset`
 * elements (0-based) into a contiguous tensor. */
static int l_tensor_view_at(lua_State *L)
{
    static const char fn[] = "Tensor:view_at";
    ml_tensor *t = ml_checkview(L, 1, fn);
    lua_Integer off = ml_checkinteger_named(L, 2, fn, "argument #2 (offset)");
    int64_t shape[ML_MAXDIM];
    int next;
    int nd = ml_checkshape(L, 3, fn, shape, &next);
    ml_args(L, next - 1, fn);   /* nothing after the shape */
    ml_err e;
    return view_done(L, fn, ml_op_view_at(ml_pushtensor(L), t, off, nd, shape, &e), &e);
}

static int l_tensor_transpose(lua_State *L)
{
    static const char fn[] = "Tensor:transpose";
    ml_args(L, 3, fn);
    ml_tensor *t = ml_checkview(L, 1, fn);
    int a = ml_checkdim(L, 2, fn, t->ndim), b = ml_checkdim(L, 3, fn, t->ndim);
    ml_err e;
    return view_done(L, fn, ml_op_transpose(ml_pushtensor(L), t, a, b, &e), &e);
}

static int l_tensor_t(lua_State *L)
{
    ml_args(L, 1, "Tensor:t");
    ml_tensor *t = ml_checkview(L, 1, "Tensor:t");
    if (t->ndim != 2)
        ml_error(L, "Tensor:t", "expected a 2-dim tensor, got %d dims", t->ndim);
    lua_settop(L, 1);
    lua_pushinteger(L, 1);
    lua_pushinteger(L, 2);
    return l_tensor_transpose(L);
}

/* ---- copies ---------------------------------------------------------------- */

static int l_tensor_contiguous(lua_State *L)
{
    ml_args(L, 1, "Tensor:contiguous");
    lua_settop(L, 1);
    ml_contiguous_arg(L, 1, "Tensor:contiguous");
    return 1;
}

static int l_tensor_clone(lua_State *L)
{
    static const char fn[] = "Tensor:clone";
    ml_args(L, 1, fn);
    ml_tensor *t = ml_checktensor(L, 1, fn);
    ml_tensor *c = ml_newtensor(L, fn, t->st->device, t->dtype, t->ndim, t->shape);
    ml_run_copy(L, fn, c, t);
    return 1;
}

/* t:to(x): x is a dtype name, a device name, or {dtype=, device=}. Always a copy. */
static int l_tensor_to(lua_State *L)
{
    static const char fn[] = "Tensor:to";
    static const char *const opts[] = {"dtype", "device", NULL};
    ml_args(L, 2, fn);
    ml_tensor *t = ml_checktensor(L, 1, fn);
    ml_dtype dt = t->dtype;
    ml_device dev = t->st->device;
    if (lua_type(L, 2) == LUA_TSTRING) {
        const char *s = lua_tostring(L, 2);
        int v;
        if ((v = ml_dtype_from_name(s)) >= 0)
            dt = (ml_dtype)v;
        else if ((v = ml_device_from_name(s)) >= 0)
            dev = (ml_device)v;
        else
            ml_error(L, fn, "'%s' is neither a dtype (f32, f64, bf16, f16, i32, i64, u8) nor a "
                     "device (cpu, cuda)", s);
    } else if (lua_istable(L, 2)) {
        ml_check_opts(L, 2, fn, opts);
        dt = ml_opt_dtype(L, 2, fn, dt);
        dev = ml_opt_device(L, 2, fn, dev);
    } else {
        ml_error(L, fn, "argument #2: expected a dtype, a device or an options table, got %s",
                 luaL_typename(L, 2));
    }
    ml_tensor *c = ml_newtensor(L, fn, dev, dt, t->ndim, t->shape);
    ml_run_copy(L, fn, c, t);
    return 1;
}

/* dst:copy_(src): same shape; converts dtype, crosses devices. */
static int l_tensor_copy_(lua_State *L)
{
    static const char fn[] = "Tensor:copy_";
    ml_args(L, 2, fn);
    ml_tensor *dst = ml_checktensor(L, 1, fn), *src = ml_checktensor(L, 2, fn);
    ml_run_copy(L, fn, dst, src);
    lua_settop(L, 1);
    return 1;
}

static int l_tensor_fill_(lua_State *L)
{
    static const char fn[] = "Tensor:fill_";
    ml_args(L, 2, fn);
    lua_settop(L, 2);
    ml_tensor *t = ml_checktensor(L, 1, fn);
    if (lua_type(L, 2) != LUA_TNUMBER)
        ml_error(L, fn, "expected the fill value (a number), got %s", luaL_typename(L, 2));
    double v = lua_tonumber(L, 2);
    lua_settop(L, 1);
    ml_err e;
    ml_check_op(L, fn, ml_op_fill(ml_host_of(L), t, v, &e), &e);
    return 1;
}

static int l_tensor_zero_(lua_State *L)
{
    ml_args(L, 1, "Tensor:zero_");
    lua_settop(L, 1);
    lua_pushinteger(L, 0);
    return l_tensor_fill_(L);
}

/* A CPU, contiguous version of t on the stack top (t itself when it is one). */
static ml_tensor *host_copy(lua_State *L, int idx, const char *fn)
{
    ml_tensor *t = ml_checktensor(L, idx, fn);
    const char *why = ml_tensor_uncommitted(t);
    if (why)
        ml_error(L, fn, "argument #%d: %s", idx, why);
    if (t->st->device == ML_CPU && ml_is_contiguous(t)) {
        lua_pushvalue(L, idx);
        return t;
    }
    ml_tensor *c = ml_newtensor(L, fn, ML_CPU, t->dtype, t->ndim, t->shape);
    ml_run_copy(L, fn, c, t);
    return c;
}

static void push_element(lua_State *L, const ml_tensor *t, size_t i)
{
    if (t->dtype == ML_I64)
        lua_pushinteger(L, ((const int64_t *)ml_data(t))[i]);
    else if (t->dtype == ML_I32 || t->dtype == ML_U8)
        lua_pushinteger(L, (lua_Integer)ml_load(t->dtype, ml_data(t), i));
    else
        lua_pushnumber(L, ml_load(t->dtype, ml_data(t), i));
}

static void totable_rec(lua_State *L, const ml_tensor *t, int level, size_t *pos)
{
    lua_createtable(L, (int)t->shape[level], 0);
    for (int64_t i = 0; i < t->shape[level]; i++) {
        if (level + 1 < t->ndim)
            totable_rec(L, t, level + 1, pos);
        else
            push_element(L, t, (*pos)++);
        lua_rawseti(L, -2, i + 1);
    }
}

static int l_tensor_totable(lua_State *L)
{
    static const char fn[] = "Tensor:totable";
    ml_args(L, 1, fn);
    ml_tensor *t = ml_checktensor(L, 1, fn);
    /* Lua tables made: one per index of every leading dim (shape [2^40, 0]
     * has no elements but would make 2^40 tables) plus the elements. */
    int64_t tables = 0, lead = 1, limit = (int64_t)1 << 26;
    for (int d = 0; d < t->ndim && tables <= limit; d++) {
        if (t->shape[d] > INT32_MAX)
            ml_error(L, fn, "dim %d has %lld entries, too many for a Lua table", d + 1,
                     (long long)t->shape[d]);
        tables += lead;
        lead = lead > limit / (t->shape[d] ? t->shape[d] : 1) ? limit + 1 : lead * t->shape[d];
    }
    if (tables > limit || ml_numel(t) > limit)
        ml_error(L, fn, "shape is too large for Lua tables (at most %lld tables and elements)",
                 (long long)limit);
    t = host_copy(L, 1, fn);
    size_t pos = 0;
    if (t->ndim == 0)
        push_element(L, t, 0);
    else
        totable_rec(L, t, 0, &pos);
    return 1;
}

static int l_tensor_item(lua_State *L)
{
    static const char fn[] = "Tensor:item";
    ml_args(L, 1, fn);
    ml_tensor *t = ml_checktensor(L, 1, fn);
    if (ml_numel(t) != 1)
        ml_error(L, fn, "expected a tensor with one element, got %lld", (long long)ml_numel(t));
    t = host_copy(L, 1, fn);
    push_element(L, t, 0);
    return 1;
}

/* ---- lifetime ---------------------------------------------------------------- */

/* __gc, __close and :free() share this: idempotent, never raises. */
static int l_tensor_release(lua_State *L)
{
    ml_tensor *t = ml_testtensor(L, 1);
    if (t && t->st) {
        ml_storage_release(t->st);
        t->st = NULL;
    }
    return 0;
}

static int l_tensor_free(lua_State *L)
{
    ml_args(L, 1, "Tensor:free");
    return l_tensor_release(L);
}

/* ---- released storage (tensor.h: ml_storage_release_memory) ------------------
 *
 * t:release_storage(why) returns the memory of t's storage to the ledger
 * and keeps the storage: every view of it, made before or after, is then
 * an error that says `why` when used. t:acquire_storage() allocates it
 * again (contents undefined) under the category it had, with the budget
 * error of any allocation. Both do nothing when the storage is already
 * in that state; a pool view's memory belongs to its pool, so releasing
 * one is an error. */

/* Argument #1's storage in any state but freed: released, or (to release
 * it) holding the address space of a plan that has ended. */
static ml_storage *storage_arg(lua_State *L, const char *fn)
{
    ml_tensor *t = ml_testtensor(L, 1);
    if (t && t->st)
        return t->st;
    return ml_checktensor(L, 1, fn)->st;
}

static int l_tensor_release_storage(lua_State *L)
{
    static const char fn[] = "Tensor:release_storage";
    ml_args(L, 2, fn);
    ml_storage *st = storage_arg(L, fn);
    const char *why = luaL_optstring(L, 2, NULL);
    if (st->pool)
        ml_error(L, fn, "a pool view's memory belongs to its pool (rewind the pool instead)");
    if (st->reserved)
        ml_error(L, fn, "a reserved storage is committed range by range and cannot be released");
    ml_storage_release_memory(st, why);
    return 0;
}

/* The memory comes from ml_tensor_alloc under the storage's category, so
 * an acquire reclaims, retries and words a refusal like any allocation. */
static int l_tensor_acquire_storage(lua_State *L)
{
    static const char fn[] = "Tensor:acquire_storage";
    ml_args(L, 1, fn);
    ml_storage *st = storage_arg(L, fn);
    if (!st->released[0])
        return 0;
    ml_host *h = ml_host_of(L);
    ml_tensor fresh = {0};
    int64_t n = (int64_t)st->nbytes;
    ml_category cat = h->category;
    ml_err e;
    h->category = st->cat;
    ml_status s = ml_tensor_alloc(h, &fresh, st->device, ML_U8, 1, &n, &e);
    h->category = cat;
    ml_check_op(L, fn, s, &e);
    ml_storage_adopt(st, fresh.st);
    return 0;
}

/* ---- reserved storage (tensor.h: ml_storage_reserve) ------------------------
 *
 * t:commit_() commits the elements of the contiguous view t of a reserved
 * storage (charged to the ledger under the storage's category, zeros) and
 * returns t; elements committed before (overlap) are an error.
 * t:committed(): is every element of view t committed (always, for a
 * storage that was not reserved)? */
static int l_tensor_commit_(lua_State *L)
{
    static const char fn[] = "Tensor:commit_";
    ml_args(L, 1, fn);
    ml_tensor *t = ml_checkview(L, 1, fn);
    ml_err e;
    ml_check_op(L, fn, ml_tensor_commit(t, &e), &e);
    lua_settop(L, 1);
    return 1;
}

static int l_tensor_committed(lua_State *L)
{
    ml_args(L, 1, "Tensor:committed");
    lua_pushboolean(L, ml_tensor_uncommitted(ml_checkview(L, 1, "Tensor:committed")) == NULL);
    return 1;
}

static int l_tensor_storage_released(lua_State *L)
{
    ml_args(L, 1, "Tensor:storage_released");
    lua_pushboolean(L, storage_arg(L, "Tensor:storage_released")->released[0] != 0);
    return 1;
}

/* ---- printing --------------------------------------------------------------- */

/* Metadata, up to 6 leading values and, for contiguous float tensors,
 * min/mean/max. Only those few numbers leave a device (the statistics are
 * reduced where the tensor lives) and nothing is copied whole. The text is
 * built in a C buffer, since the temporaries below use the Lua stack. */
static int l_tensor_tostring(lua_State *L)
{
    static const char fn[] = "Tensor:__tostring";
    ml_tensor *t = ml_testtensor(L, 1);
    if (!t)
        return luaL_error(L, "%s: expected a tensor", fn);
    if (!t->st) {
        lua_pushliteral(L, "tensor(freed)");
        return 1;
    }
    if (t->st->pool && !ml_pool_view_valid(t->st->pool, t->st->slot, t->st->id)) {
        lua_pushliteral(L, "tensor(stale pool view)");
        return 1;
    }
    char shape[160], text[512];
    ml_format_shape(t, shape, sizeof shape);
    if (t->st->released[0] || ml_tensor_uncommitted(t)) {
        lua_pushfstring(L, "tensor(%s, %s, %s, %s)", shape, ml_dtype_names[t->dtype],
                        ml_device_names[t->st->device],
                        t->st->released[0] ? "released" : "reserved, not committed");
        return 1;
    }
    size_t at = (size_t)snprintf(text, sizeof text, "tensor(%s, %s, %s", shape,
                                 ml_dtype_names[t->dtype], ml_device_names[t->st->device]);
    int64_t n = ml_numel(t);
    if (n > 0) {
        lua_settop(L, 1);
        /* up to 6 leading values, never a copy of the whole: in storage order
         * when contiguous, else from the first row (strided) */
        int contig = ml_is_contiguous(t);
        ml_tensor head = *t;
        int64_t run = contig ? n : t->ndim ? t->shape[t->ndim - 1] : 1;
        int64_t shown = run < 6 ? run : 6;
        head.ndim = 1;
        head.shape[0] = shown;
        head.stride[0] = contig || !t->ndim ? 1 : t->stride[t->ndim - 1];
        int ints = t->dtype == ML_I32 || t->dtype == ML_I64 || t->dtype == ML_U8;   /* every digit */
        ml_tensor *vals = ml_newtensor(L, fn, ML_CPU, ints ? ML_I64 : ML_F64, 1, &shown);
        ml_run_copy(L, fn, vals, &head);
        at += (size_t)snprintf(text + at, sizeof text - at, ", {");
        for (int64_t i = 0; i < shown && at < sizeof text; i++) {
            const char *sep = i ? ", " : "";
            at += ints ? (size_t)snprintf(text + at, sizeof text - at, "%s%lld", sep,
                                          (long long)((int64_t *)vals->st->data)[i])
                       : (size_t)snprintf(text + at, sizeof text - at, "%s%.6g", sep,
                                          ((double *)vals->st->data)[i]);
        }
        if (at < sizeof text)
            at += (size_t)snprintf(text + at, sizeof text - at, n > shown ? ", ...}" : "}");
        /* statistics where they cost no copy: contiguous float tensors */
        if ((t->dtype == ML_F32 || t->dtype == ML_F64) && contig && at < sizeof text) {
            ml_host *h = ml_host_of(L);
            int64_t three = 3;
            ml_tensor *st = ml_newtensor(L, fn, t->st->device, t->dtype, 1, &three);
            static const ml_redop ops[3] = {ML_RMIN, ML_RMEAN, ML_RMAX};
            ml_err e;
            ml_status s = ML_OK;
            for (int i = 0; i < 3 && s == ML_OK; i++) {
                ml_tensor v = {0};   /* st[i], 0-dim */
                s = ml_op_select(&v, st, 0, i, &e);
                if (s == ML_OK)
                    s = ml_op_reduce(h, &v, NULL, ops[i], t, -1, &e);
                ml_tensor_drop(&v);
            }
            ml_check_op(L, fn, s, &e);
            ml_tensor *hs = ml_newtensor(L, fn, ML_CPU, ML_F64, 1, &three);
            ml_run_copy(L, fn, hs, st);
            const double *v = hs->st->data;
            at += (size_t)snprintf(text + at, sizeof text - at, ", min %.6g mean %.6g max %.6g",
                                   v[0], v[1], v[2]);
        }
    }
    if (at < sizeof text)
        snprintf(text + at, sizeof text - at, ")");
    lua_pushstring(L, text);
    return 1;
}

static const luaL_Reg tensor_functions[] = {
    {"zeros", l_tensor_zeros},
    {"ones", l_tensor_ones},
    {"empty", l_tensor_empty},
    {"reserve", l_tensor_reserve},
    {"full", l_tensor_full},
    {"arange", l_tensor_arange},
    {"tensor", l_tensor_tensor},
    {"rand", l_tensor_rand},
    {"randn", l_tensor_randn},
    {"manual_seed", l_tensor_manual_seed},
    {"philox4x32_10", l_tensor_philox4x32_10},
    {"rng_state", l_tensor_rng_state},
    {"threads", l_tensor_threads},
    {"cuda_available", l_tensor_cuda_available},
    {"is_tensor", l_tensor_is_tensor},
    {NULL, NULL}
};

static const luaL_Reg tensor_methods[] = {
    {"shape", l_tensor_shape},
    {"size", l_tensor_size},
    {"stride", l_tensor_stride},
    {"dim", l_tensor_dim},
    {"numel", l_tensor_numel},
    {"dtype", l_tensor_dtype},
    {"device", l_tensor_device},
    {"category", l_tensor_category},
    {"is_contiguous", l_tensor_is_contiguous},
    {"storage_offset", l_tensor_storage_offset},
    {"same_storage", l_tensor_same_storage},
    {"narrow", l_tensor_narrow},
    {"select", l_tensor_select},
    {"view", l_tensor_view},
    {"reshape", l_tensor_reshape},
    {"view_at", l_tensor_view_at},
    {"transpose", l_tensor_transpose},
    {"t", l_tensor_t},
    {"contiguous", l_tensor_contiguous},
    {"clone", l_tensor_clone},
    {"to", l_tensor_to},
    {"copy_", l_tensor_copy_},
    {"commit_", l_tensor_commit_},
    {"committed", l_tensor_committed},
    {"fill_", l_tensor_fill_},
    {"normal_", l_tensor_normal_},
    {"zero_", l_tensor_zero_},
    {"totable", l_tensor_totable},
    {"item", l_tensor_item},
    {"free", l_tensor_free},
    {"release_storage", l_tensor_release_storage},
    {"acquire_storage", l_tensor_acquire_storage},
    {"storage_released", l_tensor_storage_released},
    {NULL, NULL}
};

static const luaL_Reg tensor_meta[] = {
    {"__gc", l_tensor_release},
    {"__close", l_tensor_release},
    {"__tostring", l_tensor_tostring},
    {NULL, NULL}
};

int luaopen_moelua_tensor(lua_State *L)
{
    ml_host_of(L);  /* refuse to load outside the host */
    luaL_newlib(L, tensor_functions);
    luaL_newmetatable(L, ML_TENSOR_MT);
    luaL_setfuncs(L, tensor_meta, 0);
    luaL_newlib(L, tensor_methods);
    ml_tensor_math_register(L);       /* math methods + functions (l_tensor_math.c) */
    lua_setfield(L, -2, "__index");
    lua_pop(L, 1);
    return 1;
}
