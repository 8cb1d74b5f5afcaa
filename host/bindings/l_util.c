/*
 * host/bindings/l_util.c - shared binding helpers: the host in the registry, tensor
 * argument checks, ledger-backed tensor creation and error reporting.
 */
#include "l_util.h"
#include "../runtime/pool.h"
#ifdef ML_WITH_CUDA
#include "../runtime/backend_cuda.h"
#endif

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

static const char HOST_KEY[] = "moelua.host";

/* h->reclaim for the op layer: the allocator's cache and a full collection. */
static void reclaim_hook(ml_host *h, ml_device dev)
{
    ml_reclaim(h->hook_ud, h, dev);
}

/* h->allocated: the collector sees a small userdata, not the bytes behind
 * it: tell it (in KiB) so garbage tensors are collected at the pace they
 * are made, as Torch7's heap tracking did. Not while it is stopped (a
 * trainer's step: moelua.train), where a step would still run one. */
static void allocated_hook(ml_host *h, size_t nbytes)
{
    if (nbytes >= ((size_t)64 << 10) && lua_gc(h->hook_ud, LUA_GCISRUNNING))
        lua_gc(h->hook_ud, LUA_GCSTEP, (int)(nbytes >> 10 < INT32_MAX ? nbytes >> 10 : INT32_MAX));
}

void ml_host_register(lua_State *L, ml_host *h)
{
    lua_pushlightuserdata(L, h);
    lua_setfield(L, LUA_REGISTRYINDEX, HOST_KEY);
    h->reclaim = reclaim_hook;
    h->allocated = allocated_hook;
    h->hook_ud = L;
}

ml_host *ml_host_of(lua_State *L)
{
    lua_getfield(L, LUA_REGISTRYINDEX, HOST_KEY);
    ml_host *h = lua_touserdata(L, -1);
    lua_pop(L, 1);
    if (!h)
        luaL_error(L, "moelua: the moelua C libraries run only inside the moelua host");
    return h;
}

int ml_error(lua_State *L, const char *fn, const char *fmt, ...)
{
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    luaL_where(L, 1);
    lua_pushfstring(L, "%s: %s", fn, msg);
    lua_concat(L, 2);
    lua_error(L);
    for (;;) {}  /* lua_error does not return */
}

/* The formatted message as a moelua.errors user error, after the caller's
 * position when `where`. */
static void raise_user(lua_State *L, int where, const char *fmt, va_list ap)
{
    char msg[1024];
    vsnprintf(msg, sizeof msg, fmt, ap);
    lua_getglobal(L, "require");
    lua_pushliteral(L, "moelua.errors");
    lua_call(L, 1, 1);
    lua_getfield(L, -1, "user");
    if (where)
        luaL_where(L, 1);
    else
        lua_pushliteral(L, "");
    lua_pushstring(L, msg);
    lua_concat(L, 2);
    lua_call(L, 1, 0);
    luaL_error(L, "%s", msg);   /* moelua.errors.user returned: raise the message anyway */
}

int ml_user_error(lua_State *L, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    raise_user(L, 1, fmt, ap);
    va_end(ap);
    for (;;) {}
}

int ml_env_error(lua_State *L, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    raise_user(L, 0, fmt, ap);
    va_end(ap);
    for (;;) {}
}

/* The registry fields holding the last interrupt error raised, and its
 * text without the position. */
static const char INTERRUPT_KEY[] = "moelua.interrupt_message";
static const char INTERRUPT_TEXT_KEY[] = "moelua.interrupt_text";

int ml_interrupt_error(lua_State *L, const char *fn)
{
    if (fn)
        lua_pushfstring(L, "%s: interrupted", fn);
    else
        lua_pushliteral(L, "interrupted!");
    lua_pushvalue(L, -1);
    lua_setfield(L, LUA_REGISTRYINDEX, INTERRUPT_TEXT_KEY);
    luaL_where(L, 1);
    lua_insert(L, -2);
    lua_concat(L, 2);
    lua_pushvalue(L, -1);
    lua_setfield(L, LUA_REGISTRYINDEX, INTERRUPT_KEY);
    lua_error(L);
    for (;;) {}
}

int ml_is_interrupt_error(lua_State *L, int idx)
{
    idx = lua_absindex(L, idx);
    if (lua_type(L, idx) != LUA_TSTRING)
        return 0;
    lua_getfield(L, LUA_REGISTRYINDEX, INTERRUPT_KEY);
    int is = lua_rawequal(L, idx, -1);
    lua_pop(L, 1);
    return is;
}

void ml_push_interrupt_text(lua_State *L)
{
    lua_getfield(L, LUA_REGISTRYINDEX, INTERRUPT_TEXT_KEY);
}

ml_tensor *ml_testtensor(lua_State *L, int idx)
{
    return luaL_testudata(L, idx, ML_TENSOR_MT);
}

/* The tensor at idx, or an error naming `what`; viewable: its storage may
 * be released (metadata and views), otherwise it must be usable. */
static ml_tensor *check_tensor(lua_State *L, int idx, const char *fn, const char *what, int viewable)
{
    ml_tensor *t = ml_testtensor(L, idx);
    if (!t)
        ml_error(L, fn, "%s: expected a tensor, got %s", what, luaL_typename(L, idx));
    const char *why = viewable ? ml_storage_unviewable(t->st) : ml_storage_unusable(t->st);
    if (why)
        ml_error(L, fn, "%s: %s", what, why);
    return t;
}

ml_tensor *ml_checktensor_named(lua_State *L, int idx, const char *fn, const char *what)
{
    return check_tensor(L, idx, fn, what, 0);
}

ml_tensor *ml_checkview(lua_State *L, int idx, const char *fn)
{
    char what[32];
    snprintf(what, sizeof what, "argument #%d", idx);
    return check_tensor(L, idx, fn, what, 1);
}

ml_tensor *ml_checktensor(lua_State *L, int idx, const char *fn)
{
    char what[32];
    snprintf(what, sizeof what, "argument #%d", idx);
    return ml_checktensor_named(L, idx, fn, what);
}

ml_tensor *ml_checkcontig(lua_State *L, int idx, const char *fn, int dt)
{
    ml_tensor *t = ml_checktensor(L, idx, fn);
    if (dt >= 0 && t->dtype != (ml_dtype)dt)
        ml_error(L, fn, "argument #%d: expected dtype %s, got %s", idx, ml_dtype_names[dt],
                 ml_dtype_names[t->dtype]);
    if (!ml_is_contiguous(t))
        ml_error(L, fn, "argument #%d: expected a contiguous tensor (call :contiguous())", idx);
    return t;
}

ml_tensor *ml_pushtensor(lua_State *L)
{
    ml_tensor *t = lua_newuserdatauv(L, sizeof *t, 0);
    memset(t, 0, sizeof *t);
    luaL_setmetatable(L, ML_TENSOR_MT);
    return t;
}

void ml_push_ledger_report(lua_State *L, ml_host *h, ml_tier tier)
{
    char buf[2048];
    ml_host_ledger_report(h, tier, buf, sizeof buf);
    lua_pushstring(L, buf);
}

void ml_reclaim(lua_State *L, ml_host *h, ml_device dev)
{
    if (dev == ML_CPU)
        ml_cpu_empty_cache();
#ifdef ML_WITH_CUDA
    if (dev == ML_CUDA)
        ml_cuda_empty_cache(&h->books[ML_CUDA]);
#else
    (void)h;
#endif
    lua_gc(L, LUA_GCCOLLECT);
}

ml_tensor *ml_newtensor(lua_State *L, const char *fn, ml_device dev, ml_dtype dt,
                        int ndim, const int64_t *shape)
{
    ml_host *h = ml_host_of(L);
    ml_tensor *t = ml_pushtensor(L);   /* safe empty state first: an error below leaks nothing */
    ml_err e;
    ml_check_op(L, fn, ml_tensor_alloc(h, t, dev, dt, ndim, shape, &e), &e);
    return t;
}

void ml_setfield_int(lua_State *L, const char *key, lua_Integer v)
{
    lua_pushinteger(L, v);
    lua_setfield(L, -2, key);
}

/* One Ctrl-C is one error: consume the flag and the main thread's hook, so
 * a script that catches "interrupted" computes again. */
static void consume_interrupt(lua_State *L)
{
    *ml_host_of(L)->interrupt = 0;
    lua_rawgeti(L, LUA_REGISTRYINDEX, LUA_RIDX_MAINTHREAD);
    lua_sethook(lua_tothread(L, -1), NULL, 0, 0);
    lua_pop(L, 1);
}

void ml_check_status(lua_State *L, const char *fn, ml_status s)
{
    ml_err e;
    ml_check_op(L, fn, ml_kernel_status(s, &e), &e);
}

void ml_check_op(lua_State *L, const char *fn, ml_status s, const ml_err *e)
{
    if (s == ML_OK)
        return;
    if (s == ML_EINTERRUPTED) {
        consume_interrupt(L);
        ml_interrupt_error(L, fn);
    }
    luaL_where(L, 1);
    lua_pushstring(L, fn);
    lua_pushliteral(L, ": ");
    lua_pushstring(L, e->msg);
    lua_concat(L, 4);
    lua_error(L);
}

void ml_check_device(lua_State *L, const char *fn, ml_device dev)
{
    ml_host *h = ml_host_of(L);
    if (!h->kern[dev])   /* inside a plan every device has a table (host/runtime/plan.h) */
        ml_error(L, fn, "device %s is not built in (make CUDA=1)", ml_device_names[dev]);
}

static int find_name(const char *s, const char *const *names, int n)
{
    for (int i = 0; i < n; i++)
        if (strcmp(s, names[i]) == 0)
            return i;
    return -1;
}

int ml_dtype_from_name(const char *s) { return find_name(s, ml_dtype_names, ML_NDTYPES); }
int ml_device_from_name(const char *s) { return find_name(s, ml_device_names, ML_NDEVICES); }
int ml_category_from_name(const char *s) { return find_name(s, ml_category_names, ML_NCAT); }

/* opts[key] as an index into names[n]; def when the key is absent. */
static int opt_name(lua_State *L, int idx, const char *fn, const char *key,
                    const char *const *names, int n, int def, const char *choices)
{
    if (idx == 0 || lua_isnoneornil(L, idx))
        return def;
    lua_getfield(L, idx, key);
    if (lua_isnil(L, -1)) {
        lua_pop(L, 1);
        return def;
    }
    const char *s = lua_type(L, -1) == LUA_TSTRING ? lua_tostring(L, -1) : NULL;
    int v = s ? find_name(s, names, n) : -1;
    if (v < 0)
        ml_error(L, fn, "option '%s': unknown %s '%s' (%s)", key, key, s ? s : luaL_typename(L, -1),
                 choices);
    lua_pop(L, 1);
    return v;
}

ml_dtype ml_opt_dtype(lua_State *L, int idx, const char *fn, ml_dtype def)
{
    return (ml_dtype)opt_name(L, idx, fn, "dtype", ml_dtype_names, ML_NDTYPES, def,
                              "f32, f64, bf16, f16, i32, i64, u8");
}

ml_device ml_opt_device(lua_State *L, int idx, const char *fn, ml_device def)
{
    return (ml_device)opt_name(L, idx, fn, "device", ml_device_names, ML_NDEVICES, def, "cpu, cuda");
}

void ml_check_opts(lua_State *L, int idx, const char *fn, const char *const *allowed)
{
    if (idx == 0 || lua_isnoneornil(L, idx))
        return;
    if (!lua_istable(L, idx))
        ml_error(L, fn, "options must be a table, got %s", luaL_typename(L, idx));
    lua_pushnil(L);
    while (lua_next(L, idx)) {
        lua_pop(L, 1);
        const char *k = lua_type(L, -1) == LUA_TSTRING ? lua_tostring(L, -1) : NULL;
        int ok = 0;
        for (const char *const *a = allowed; k && *a; a++)
            ok |= strcmp(k, *a) == 0;
        if (!ok) {
            luaL_Buffer b;
            luaL_buffinit(L, &b);
            for (const char *const *a = allowed; *a; a++) {
                luaL_addstring(&b, a == allowed ? "" : ", ");
                luaL_addstring(&b, *a);
            }
            luaL_pushresult(&b);
            ml_error(L, fn, "unknown option '%s' (expected one of: %s)",
                     k ? k : luaL_typename(L, -2), lua_tostring(L, -1));
        }
    }
}

/* Push opts[key] of the table at idx; 0 (nothing pushed) when idx is 0 or
 * none, or the key is absent. */
static int opt_field(lua_State *L, int idx, const char *key)
{
    if (idx == 0 || lua_isnoneornil(L, idx))
        return 0;
    if (lua_getfield(L, idx, key) != LUA_TNIL)
        return 1;
    lua_pop(L, 1);
    return 0;
}

int64_t ml_opt_integer(lua_State *L, int idx, const char *fn, const char *key, int64_t def,
                       int64_t lo, int64_t hi)
{
    if (!opt_field(L, idx, key))
        return def;
    lua_Integer v;
    const char *got = ml_not_integer(L, -1, &v);
    if (got)
        ml_error(L, fn, "option '%s' must be an integer, got %s", key, got);
    if ((v < lo || v > hi) && lo != INT64_MIN && hi != INT64_MAX)
        ml_error(L, fn, "option '%s' must be in [%lld, %lld], got %lld", key, (long long)lo,
                 (long long)hi, (long long)v);
    if (v < lo)
        ml_error(L, fn, "option '%s' must be >= %lld, got %lld", key, (long long)lo, (long long)v);
    if (v > hi)
        ml_error(L, fn, "option '%s' must be <= %lld, got %lld", key, (long long)hi, (long long)v);
    lua_pop(L, 1);
    return v;
}

double ml_opt_number(lua_State *L, int idx, const char *fn, const char *key, double def)
{
    if (!opt_field(L, idx, key))
        return def;
    if (lua_type(L, -1) != LUA_TNUMBER)
        ml_error(L, fn, "option '%s' must be a number, got %s", key, luaL_typename(L, -1));
    double v = lua_tonumber(L, -1);
    lua_pop(L, 1);
    if (!isfinite(v))
        ml_error(L, fn, "option '%s' must be finite, got %g", key, v);
    return v;
}

int ml_opt_bool(lua_State *L, int idx, const char *fn, const char *key, int def)
{
    if (!opt_field(L, idx, key))
        return def;
    if (lua_type(L, -1) != LUA_TBOOLEAN)
        ml_error(L, fn, "option '%s' must be a boolean, got %s", key, luaL_typename(L, -1));
    int v = lua_toboolean(L, -1);
    lua_pop(L, 1);
    return v;
}

static int64_t check_size(lua_State *L, int idx, const char *fn, int dim)
{
    lua_Integer v;
    const char *got = ml_not_integer(L, idx, &v);
    if (got)
        ml_error(L, fn, "size of dim %d must be an integer, got %s", dim + 1, got);
    if (v < 0)
        ml_error(L, fn, "size of dim %d is negative (%lld)", dim + 1, (long long)v);
    return v;
}

int ml_checkshape(lua_State *L, int idx, const char *fn, int64_t *shape, int *next)
{
    int ndim = 0;
    if (lua_istable(L, idx) && !ml_testtensor(L, idx)) {
        ndim = (int)luaL_len(L, idx);
        if (ndim > ML_MAXDIM)
            ml_error(L, fn, "%d dims given, at most %d are supported", ndim, ML_MAXDIM);
        for (int i = 0; i < ndim; i++) {
            lua_geti(L, idx, i + 1);
            shape[i] = check_size(L, -1, fn, i);
            lua_pop(L, 1);
        }
        *next = idx + 1;
    } else {
        int top = lua_gettop(L);
        while (idx + ndim <= top && lua_type(L, idx + ndim) == LUA_TNUMBER) {
            if (ndim == ML_MAXDIM)
                ml_error(L, fn, "more than %d dims given", ML_MAXDIM);
            shape[ndim] = check_size(L, idx + ndim, fn, ndim);
            ndim++;
        }
        if (ndim == 0 && idx <= top && !lua_istable(L, idx))
            ml_error(L, fn, "argument #%d: expected a shape (table or integers), got %s", idx,
                     luaL_typename(L, idx));
        *next = idx + ndim;
    }
    if (ml_shape_numel(ndim, shape) < 0)
        ml_error(L, fn, "shape has too many elements");
    return ndim;
}

const char *ml_not_integer(lua_State *L, int idx, lua_Integer *v)
{
    int isint = 0;
    *v = lua_tointegerx(L, idx, &isint);
    if (isint && lua_type(L, idx) == LUA_TNUMBER)
        return NULL;
    return lua_type(L, idx) == LUA_TNUMBER ? "a fraction" : luaL_typename(L, idx);
}

lua_Integer ml_checkinteger_named(lua_State *L, int idx, const char *fn, const char *what)
{
    lua_Integer v;
    const char *got = ml_not_integer(L, idx, &v);
    if (got)
        ml_error(L, fn, "%s must be an integer, got %s", what, got);
    return v;
}

void ml_checktype_named(lua_State *L, int idx, const char *fn, const char *what, int t)
{
    if (lua_type(L, idx) != t)
        ml_error(L, fn, "%s must be a %s, got %s", what, lua_typename(L, t), luaL_typename(L, idx));
}

const char *ml_checkstring_named(lua_State *L, int idx, const char *fn, const char *what)
{
    ml_checktype_named(L, idx, fn, what, LUA_TSTRING);
    return lua_tostring(L, idx);
}

void ml_args(lua_State *L, int n, const char *fn)
{
    int top = lua_gettop(L), self = strchr(fn, ':') != NULL;
    while (top > n && lua_isnil(L, top))   /* f(a, nil): a wrapper passing an absent argument on */
        top--;
    if (top > n) {
        char takes[32];
        snprintf(takes, sizeof takes, n == self ? "no arguments" : "at most %d argument%s", n - self,
                 n - self == 1 ? "" : "s");
        ml_error(L, fn, "takes %s, got %d (#%d is a %s)", takes, top - self, n + 1 - self,
                 luaL_typename(L, n + 1));
    }
    if (lua_gettop(L) > n)   /* the trailing nils */
        lua_settop(L, n);
}

int ml_checkdim(lua_State *L, int idx, const char *fn, int ndim)
{
    lua_Integer given;
    const char *got = ml_not_integer(L, idx, &given);
    if (got)
        ml_error(L, fn, "expected a dim (an integer, 1-based or negative from the end), got %s", got);
    lua_Integer d = given;
    if (d < 0)
        d += ndim + 1;
    if (d < 1 || d > ndim)
        ml_error(L, fn, "dim %lld out of range for a %d-dim tensor (dims are 1-based)", (long long)given, ndim);
    return (int)d - 1;
}
