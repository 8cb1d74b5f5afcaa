/*
 * host/bindings/l_router.c - the Lua library `moelua.router`: the chunked MoE router
 * (kernels/router.h has the semantics, the noise counters and the
 * invariance rules).
 *
 *   router.forward(x, wg, opts)  -> idx [T,k] i64, w [T,k], stats
 *       stats = {counts = i64 [E], psum = f64 [E], z = sum_t lse_t^2,
 *                entropy = sum_t H(p'_t), tokens = T, cp = sum_e C_e P_e,
 *                max_count = max_e C_e}
 *   router.backward(dw, x, wg, idx, opts [, grads]) -> dx, dwg
 *       grads = {aux = f64 [E] (dL/dp'_te), z = dL/dzsum, dx =, dwg =}; dx
 *       and dwg accumulate (+=) into the given tensors, or into new zeroed ones
 *   router.update_bias(bias, counts, gamma) -> bias (in place)
 *   router.scratch_bytes(T, D, E, chunk [, backward]) -> bytes of scratch
 *
 * opts: k (required, 1..E), chunk (default 2048), mode ("softmax_topk" |
 * "topk_softmax"), renorm (default true), temperature (default 1), eps
 * (default 0), noise (default 0), gumbel (default false), seed, step, layer,
 * token_offset (default 0: the noise counter of x's first row, router.h),
 * bias (f32/f64 [E]: selection only), pool (a moelua.pool that lends the
 * outputs and the scratch; otherwise they come from the ledger under the
 * current category and the scratch is freed before returning).
 *
 * backward takes the forward's opts: the noise options (noise, gumbel, seed,
 * step, layer), temperature, eps, mode and renorm must be the forward's, so
 * the recompute sees the same scores; bias is accepted and unused (the saved
 * idx is never re-selected).
 *
 * Devices: every tensor (x, wg, dw, idx, bias, grads) and the pool on one
 * device, cpu or cuda. Each function converts its Lua values and calls one
 * op of host/runtime/ops_moe.h, which checks them, allocates the outputs and
 * the scratch and runs the kernels; on cuda the stats' cp and max_count read
 * counts and psum back (E values).
 *
 * Not here: the aux loss (the model forms it from every layer's counts and
 * psum), capacity and dispatch.
 */
#include "libs.h"
#include "l_tensor.h"
#include "../runtime/ops_moe.h"

#include <string.h>

static const char *const OPTS[] = {"k", "chunk", "mode", "renorm", "temperature", "eps",
                                   "noise", "gumbel", "seed", "step", "layer", "token_offset", "bias",
                                   "pool", NULL};
static const char *const GRAD_OPTS[] = {"aux", "z", "dx", "dwg", NULL};

typedef struct {
    ml_router_cfg cfg;
    const ml_tensor *bias;    /* NULL: none; the options table keeps it alive */
    ml_pool *pool;            /* NULL: none; likewise */
} router_opts;

/* Push opts[key]; is it present? (Popped by the caller either way.) */
static int field(lua_State *L, int idx, const char *key)
{
    return lua_getfield(L, idx, key) != LUA_TNIL;
}

/* opts[key] as an integer in [0, hi] (hi < 2^63: the noise counters). */
static uint64_t opt_counter(lua_State *L, int idx, const char *fn, const char *key, int64_t hi)
{
    int64_t v = ml_opt_integer(L, idx, fn, key, 0, 0, INT64_MAX);
    if (v > hi)
        ml_error(L, fn, "option '%s' must be <= %lld, got %lld", key, (long long)hi, (long long)v);
    return (uint64_t)v;
}

/* A live tensor on the stack top, named "option 'key'" in errors. */
static ml_tensor *opt_tensor(lua_State *L, const char *fn, const char *key)
{
    char what[64];
    snprintf(what, sizeof what, "option '%s'", key);
    if (!ml_testtensor(L, -1))
        ml_error(L, fn, "%s must be a tensor, got %s", what, luaL_typename(L, -1));
    return ml_checktensor_named(L, -1, fn, what);
}

/* opts at idx (a table, required: k has no default) -> o. The values the
 * router refuses (k > E, temperature <= 0, a bias of the wrong shape, ...)
 * are the op's to check. */
static void read_opts(lua_State *L, int idx, const char *fn, router_opts *o)
{
    if (!lua_istable(L, idx))
        ml_error(L, fn, "argument #%d: expected an options table with k, got %s", idx,
                 luaL_typename(L, idx));
    ml_check_opts(L, idx, fn, OPTS);
    memset(o, 0, sizeof *o);
    ml_router_cfg *c = &o->cfg;
    if (!field(L, idx, "k"))
        ml_error(L, fn, "option 'k' (experts per token) is required");
    lua_pop(L, 1);
    c->k = ml_opt_integer(L, idx, fn, "k", 0, 1, INT64_MAX);
    c->chunk = ml_opt_integer(L, idx, fn, "chunk", 2048, 1, INT64_MAX);
    c->mode = ML_ROUTER_SOFTMAX_TOPK;
    if (field(L, idx, "mode")) {
        const char *m = lua_type(L, -1) == LUA_TSTRING ? lua_tostring(L, -1) : NULL;
        if (!m)
            ml_error(L, fn, "option 'mode' must be a string, got %s", luaL_typename(L, -1));
        if (strcmp(m, "softmax_topk") == 0)
            c->mode = ML_ROUTER_SOFTMAX_TOPK;
        else if (strcmp(m, "topk_softmax") == 0)
            c->mode = ML_ROUTER_TOPK_SOFTMAX;
        else
            ml_error(L, fn, "option 'mode': unknown mode '%s' (softmax_topk, topk_softmax)", m);
    }
    lua_pop(L, 1);
    c->renorm = ml_opt_bool(L, idx, fn, "renorm", 1);
    c->temperature = ml_opt_number(L, idx, fn, "temperature", 1.0);
    c->eps = ml_opt_number(L, idx, fn, "eps", 0.0);
    c->noise = ml_opt_number(L, idx, fn, "noise", 0.0);
    c->gumbel = ml_opt_bool(L, idx, fn, "gumbel", 0);
    c->seed = opt_counter(L, idx, fn, "seed", INT64_MAX);
    c->step = opt_counter(L, idx, fn, "step", 0xffffffffLL);
    c->layer = opt_counter(L, idx, fn, "layer", 0x7fffffffLL);
    c->token_offset = opt_counter(L, idx, fn, "token_offset", INT64_MAX);
    if (field(L, idx, "bias"))
        o->bias = opt_tensor(L, fn, "bias");
    lua_pop(L, 1);
    if (field(L, idx, "pool"))
        o->pool = ml_checkpool(L, -1, fn, "option 'pool'");
    lua_pop(L, 1);
}

/* ---- bindings ------------------------------------------------------------------ */

/* router.forward(x, wg, opts) -> idx, w, stats */
static int l_router_forward(lua_State *L)
{
    static const char fn[] = "moelua.router.forward";
    ml_args(L, 3, fn);
    lua_settop(L, 3);
    ml_tensor *x = ml_contiguous_arg(L, 1, fn);
    ml_tensor *wg = ml_contiguous_arg(L, 2, fn);
    router_opts o;
    read_opts(L, 3, fn, &o);
    ml_tensor *idx = ml_pushtensor(L);
    ml_tensor *w = ml_pushtensor(L);
    ml_router_stats st = {.counts = ml_pushtensor(L), .psum = ml_pushtensor(L)};
    ml_err e;
    ml_check_op(L, fn, ml_op_router_forward(ml_host_of(L), idx, w, &st, x, wg, &o.cfg, o.bias,
                                            o.pool, &e), &e);
    lua_createtable(L, 0, 7);
    lua_pushnumber(L, st.cp);
    lua_setfield(L, -2, "cp");
    lua_pushinteger(L, st.max_count);
    lua_setfield(L, -2, "max_count");
    lua_pushvalue(L, 6);
    lua_setfield(L, -2, "counts");
    lua_pushvalue(L, 7);
    lua_setfield(L, -2, "psum");
    lua_pushnumber(L, st.z);
    lua_setfield(L, -2, "z");
    lua_pushnumber(L, st.entropy);
    lua_setfield(L, -2, "entropy");
    lua_pushinteger(L, x->shape[0]);
    lua_setfield(L, -2, "tokens");
    lua_pushvalue(L, 4);
    lua_pushvalue(L, 5);
    lua_rotate(L, -3, 2);   /* idx, w, stats */
    return 3;
}

/* grads.<key> of the table at gi: a tensor (left on the stack), or an empty
 * one pushed for the op to allocate. */
static ml_tensor *grad_tensor(lua_State *L, int gi, const char *fn, const char *key)
{
    if (gi && field(L, gi, key))
        return opt_tensor(L, fn, key);
    lua_pop(L, gi ? 1 : 0);
    return ml_pushtensor(L);
}

/* router.backward(dw, x, wg, idx, opts [, grads]) -> dx, dwg */
static int l_router_backward(lua_State *L)
{
    static const char fn[] = "moelua.router.backward";
    ml_args(L, 6, fn);
    lua_settop(L, 6);
    ml_tensor *dw = ml_contiguous_arg(L, 1, fn);
    ml_tensor *x = ml_contiguous_arg(L, 2, fn);
    ml_tensor *wg = ml_contiguous_arg(L, 3, fn);
    ml_tensor *idx = ml_contiguous_arg(L, 4, fn);
    router_opts o;
    read_opts(L, 5, fn, &o);
    int gi = 0;
    if (!lua_isnil(L, 6)) {
        if (!lua_istable(L, 6))
            ml_error(L, fn, "argument #6 (grads) must be a table or nil, got %s", luaL_typename(L, 6));
        ml_check_opts(L, 6, fn, GRAD_OPTS);
        gi = 6;
    }
    ml_router_grads g = {0};
    if (gi && field(L, gi, "aux"))
        g.aux = opt_tensor(L, fn, "aux");
    lua_pop(L, gi ? 1 : 0);
    if (gi && field(L, gi, "z")) {
        if (lua_type(L, -1) != LUA_TNUMBER)
            ml_error(L, fn, "grads.z must be a number, got %s", luaL_typename(L, -1));
        g.z = lua_tonumber(L, -1);
    }
    lua_pop(L, gi ? 1 : 0);
    g.dx = grad_tensor(L, gi, fn, "dx");
    g.dwg = grad_tensor(L, gi, fn, "dwg");
    ml_err e;
    ml_check_op(L, fn, ml_op_router_backward(ml_host_of(L), &g, dw, x, wg, idx, &o.cfg, o.bias,
                                             o.pool, &e), &e);
    return 2;
}

/* router.update_bias(bias, counts, gamma) -> bias (in place) */
static int l_router_update_bias(lua_State *L)
{
    static const char fn[] = "moelua.router.update_bias";
    ml_args(L, 3, fn);
    lua_settop(L, 3);
    ml_tensor *b = ml_checktensor(L, 1, fn);
    ml_tensor *c = ml_checktensor(L, 2, fn);
    if (lua_type(L, 3) != LUA_TNUMBER)
        ml_error(L, fn, "argument #3 (gamma) must be a number, got %s", luaL_typename(L, 3));
    ml_err e;
    ml_check_op(L, fn, ml_op_router_update_bias(ml_host_of(L), b, c, lua_tonumber(L, 3), &e), &e);
    lua_settop(L, 1);
    return 1;
}

/* router.scratch_bytes(T, D, E, chunk [, backward]) -> bytes */
static int l_router_scratch_bytes(lua_State *L)
{
    static const char fn[] = "moelua.router.scratch_bytes";
    static const char *const names[] = {"T", "D", "E", "chunk"};
    ml_args(L, 5, fn);
    int64_t v[4];
    for (int i = 0; i < 4; i++) {
        int isint = 0;
        lua_Integer n = lua_tointegerx(L, i + 1, &isint);
        if (!isint || lua_type(L, i + 1) != LUA_TNUMBER)
            ml_error(L, fn, "argument #%d (%s) must be an integer, got %s", i + 1, names[i],
                     luaL_typename(L, i + 1));
        if (n < (i == 3 ? 1 : 0) || n > ((int64_t)1 << 40))
            ml_error(L, fn, "argument #%d (%s) is out of range: %lld", i + 1, names[i], (long long)n);
        v[i] = n;
    }
    if (!lua_isnoneornil(L, 5) && lua_type(L, 5) != LUA_TBOOLEAN)
        ml_error(L, fn, "argument #5 (backward) must be a boolean, got %s", luaL_typename(L, 5));
    lua_pushinteger(L, (lua_Integer)ml_router_scratch_bytes(v[0], v[1], v[2], v[3], lua_toboolean(L, 5)));
    return 1;
}

static const luaL_Reg router_functions[] = {
    {"forward", l_router_forward},
    {"backward", l_router_backward},
    {"update_bias", l_router_update_bias},
    {"scratch_bytes", l_router_scratch_bytes},
    {NULL, NULL}
};

int luaopen_moelua_router(lua_State *L)
{
    ml_host_of(L);  /* refuse to load outside the host */
    luaL_requiref(L, "moelua.tensor", luaopen_moelua_tensor, 0);
    lua_pop(L, 1);
    luaL_newlib(L, router_functions);
    return 1;
}
