/*
 * host/bindings/l_optim.c - the Lua library `moelua.optim_c`: the optimizer
 * ops of host/runtime/ops_optim.h on flat buffers. This file only converts
 * Lua values (tables of tensors, per-expert state tables, options) and
 * raises the op's message; the ops check and compute. The classes (groups,
 * lazy states, clipping policy) are lua/moelua/optim.lua.
 *
 *   adamw_step(p, g, m, v, opts)        opts = {lr =, step = (>= 1), beta1 = 0.9,
 *                                         beta2 = 0.999, eps = 1e-8, weight_decay = 0.01}
 *   sgd_step(p, g, buf, opts)           buf: momentum buffer or nil (momentum = 0);
 *                                         opts = {lr =, step = (>= 1; 1 initialises buf),
 *                                         momentum = 0, dampening = 0, weight_decay = 0,
 *                                         nesterov = false}
 *   lazy_adamw_step(p, g, m, v, active, steps, E, opts) -> number of active experts
 *                                         m, v: per-expert states, tables {[e] = tensor
 *                                         [n/E] or nil} (an active expert needs both);
 *                                         active [E] u8, steps [E] i64 (advanced for the
 *                                         active experts); opts as adamw_step without step
 *   step_all(jobs, counters [, extra])    one optimizer step over many groups in one call
 *                                         (below); returns the number of skipped
 *                                         expert-steps
 *   unstated(active, m, out) -> k         out[1..k] = the experts e (1-based) with
 *                                         active[e] != 0 and m[e] == nil: the ones
 *                                         whose states the caller must allocate first
 *   grad_norm({t1, t2, ...}) -> number    global L2 norm (f64, fixed order)
 *   clip_grad_norm_({t1, ...}, max_norm) -> number
 *                                         the global norm before clipping; every t *=
 *                                         max_norm / (norm + 1e-6) when that is < 1
 *   slice_norms(t, E [, out]) -> [E] f64  L2 norm of each of E equal slices
 *   scale_(t, s) -> t                     t *= s
 *   clip_slices_(t, E, bounds [, out]) -> [E] f64
 *                                         per-slice clip: slice e *= min(1, bound_e /
 *                                         (norm_e + 1e-6)); returns the norms before it;
 *                                         bounds: a Lua table or a cpu tensor of E numbers
 *
 * Not interruptible: the kernels ignore the Ctrl-C flag, and step_all is
 * one op call (ml_op_optim_step_all: every job checked, then every update,
 * then the counts), so the Lua hook cannot cut a multi-group step either.
 *
 * step_all(jobs, counters [, extra_skipped]): jobs is a list of tables, each
 *   {op = "adamw" | "lazy_adamw" | "sgd", params =, grads =, hp = opts without
 *    step, step = completed steps (adamw, sgd), exp_avg =, exp_avg_sq = (adamw:
 *    tensors; lazy_adamw: per-expert tables as above), momentum_buffer = (sgd;
 *    nil when momentum = 0), active =, steps =, experts = (lazy_adamw)}
 * adamw and sgd jobs use t = job.step + 1 and set job.step = t afterwards;
 * counters.t is incremented and counters.skipped_expert_steps grows by the
 * inactive experts of the lazy jobs (plus the integer `extra_skipped`
 * argument: the experts of sparse groups none of whose experts has had
 * tokens yet, which have no step counts and so no job).
 *
 * Scratch: the converted jobs and the tensor pointer arrays live in one
 * Lua-owned buffer (not tensor data) kept as the function's upvalue and
 * grown when a call needs more, so a warmed-up step allocates nothing, not
 * even garbage for the Lua GC.
 */
#include "libs.h"
#include "l_util.h"
#include "../runtime/ops_optim.h"

#include <stdio.h>
#include <string.h>

#define MAX_EXPERTS (1 << 24)   /* bounds the scratch a call may ask for */

/* At least `bytes` of zeroed scratch: upvalue 1 of the running C function,
 * a userdata replaced by a larger one when too small. */
static void *scratch(lua_State *L, size_t bytes)
{
    if (bytes == 0)
        bytes = 1;
    void *buf = lua_touserdata(L, lua_upvalueindex(1));
    if (!buf || lua_rawlen(L, lua_upvalueindex(1)) < bytes) {
        buf = lua_newuserdatauv(L, bytes, 0);
        lua_replace(L, lua_upvalueindex(1));
    }
    memset(buf, 0, bytes);
    return buf;
}

/* How errors name a value: "argument #argn (name)", or "field 'name'" for a
 * step_all job's fields (argn 0). */
static const char *arg_name(char *buf, size_t len, int argn, const char *name)
{
    if (argn > 0)
        snprintf(buf, len, "argument #%d (%s)", argn, name);
    else
        snprintf(buf, len, "field '%s'", name);
    return buf;
}

static ml_tensor *arg_tensor(lua_State *L, int idx, int argn, const char *fn, const char *name)
{
    char what[64];
    return ml_checktensor_named(L, idx, fn, arg_name(what, sizeof what, argn, name));
}

/* E at idx: an integer; one outside 1..MAX_EXPERTS is returned as is for the
 * op to refuse when it is < 1, and refused here when it is larger. */
static int64_t arg_experts(lua_State *L, int idx, int argn, const char *fn, const char *name)
{
    lua_Integer E;
    const char *got = ml_not_integer(L, idx, &E);   /* (a numeric string is no integer) */
    char what[64];
    arg_name(what, sizeof what, argn, name);
    if (got)
        ml_error(L, fn, "%s: expected an integer, got %s", what, got);
    if (E > MAX_EXPERTS)
        ml_error(L, fn, "%s: at most %d experts, got %lld", what, MAX_EXPERTS, (long long)E);
    return E;
}

/* The per-expert states table at idx (exp_avg or exp_avg_sq): keys are
 * experts 1..E; out[e] = expert e+1's tensor, or NULL. */
static void expert_states(lua_State *L, int idx, int argn, const char *fn, const char *name,
                          int64_t E, ml_tensor **out)
{
    char what[64], elem[48];
    arg_name(what, sizeof what, argn, name);
    if (!lua_istable(L, idx) || ml_testtensor(L, idx))
        ml_error(L, fn, "%s: expected a table {[expert] = tensor}, got %s", what,
                 luaL_typename(L, idx));
    lua_pushnil(L);
    while (lua_next(L, idx)) {
        int isint;
        lua_Integer e = lua_tointegerx(L, -2, &isint);
        if (!isint || e < 1 || e > E) {
            lua_pop(L, 1);
            ml_error(L, fn, "%s: keys must be experts 1..%lld, got %s", what, (long long)E,
                     luaL_tolstring(L, -1, NULL));
        }
        lua_pop(L, 1);
    }
    for (int64_t e = 0; e < E; e++) {
        snprintf(elem, sizeof elem, "%s[%lld]", name, (long long)e + 1);
        out[e] = lua_geti(L, idx, e + 1) == LUA_TNIL ? NULL
                 : arg_tensor(L, lua_gettop(L), argn, fn, elem);
        lua_pop(L, 1);
    }
}

/* ---- options -------------------------------------------------------------------- */

static void opts_table(lua_State *L, int idx, int argn, const char *fn, const char *const *allowed)
{
    char what[64];
    if (!lua_istable(L, idx))
        ml_error(L, fn, "%s: expected a table, got %s", arg_name(what, sizeof what, argn, "opts"),
                 luaL_typename(L, idx));
    ml_check_opts(L, idx, fn, allowed);
}

static void require_opt(lua_State *L, int idx, const char *fn, const char *key)
{
    if (lua_getfield(L, idx, key) == LUA_TNIL)
        ml_error(L, fn, "option '%s' is required", key);
    lua_pop(L, 1);
}

/* opts.step, the 1-based step number (the op checks its range). */
static int64_t opt_step(lua_State *L, int idx, const char *fn)
{
    require_opt(L, idx, fn, "step");
    return ml_opt_integer(L, idx, fn, "step", 0, INT64_MIN, INT64_MAX);
}

static ml_adamw_hp adam_opts(lua_State *L, int idx, int argn, const char *fn, int with_step)
{
    static const char *const with[] = {"lr", "beta1", "beta2", "eps", "weight_decay", "step",
                                       NULL};
    static const char *const without[] = {"lr", "beta1", "beta2", "eps", "weight_decay", NULL};
    opts_table(L, idx, argn, fn, with_step ? with : without);
    ml_adamw_hp hp;
    require_opt(L, idx, fn, "lr");
    hp.lr = ml_opt_number(L, idx, fn, "lr", 0);
    hp.beta1 = ml_opt_number(L, idx, fn, "beta1", 0.9);
    hp.beta2 = ml_opt_number(L, idx, fn, "beta2", 0.999);
    hp.eps = ml_opt_number(L, idx, fn, "eps", 1e-8);
    hp.weight_decay = ml_opt_number(L, idx, fn, "weight_decay", 0.01);
    hp.step = with_step ? opt_step(L, idx, fn) : 0;
    return hp;
}

/* step: NULL when opts carry none (step_all's jobs), else gets opts.step. */
static ml_sgd_hp sgd_opts(lua_State *L, int idx, int argn, const char *fn, int64_t *step)
{
    static const char *const with[] = {"lr", "momentum", "dampening", "weight_decay",
                                       "nesterov", "step", NULL};
    static const char *const without[] = {"lr", "momentum", "dampening", "weight_decay",
                                          "nesterov", NULL};
    opts_table(L, idx, argn, fn, step ? with : without);
    ml_sgd_hp hp;
    require_opt(L, idx, fn, "lr");
    hp.lr = ml_opt_number(L, idx, fn, "lr", 0);
    hp.momentum = ml_opt_number(L, idx, fn, "momentum", 0);
    hp.dampening = ml_opt_number(L, idx, fn, "dampening", 0);
    hp.weight_decay = ml_opt_number(L, idx, fn, "weight_decay", 0);
    hp.nesterov = ml_opt_bool(L, idx, fn, "nesterov", 0);
    hp.first = 0;                      /* the op sets it from the step */
    if (step)
        *step = opt_step(L, idx, fn);
    return hp;
}

/* ---- jobs: the arguments of one update at base.. (argn 0: step_all fields) ----- */

/* p, g, m, v, opts */
static void prep_adamw(lua_State *L, int base, int args, const char *fn, ml_optim_job *j)
{
    j->kind = ML_OPTIM_ADAMW;
    j->params = arg_tensor(L, base, args ? 1 : 0, fn, "params");
    j->grads = arg_tensor(L, base + 1, args ? 2 : 0, fn, "grads");
    j->exp_avg = arg_tensor(L, base + 2, args ? 3 : 0, fn, "exp_avg");
    j->exp_avg_sq = arg_tensor(L, base + 3, args ? 4 : 0, fn, "exp_avg_sq");
    j->adamw = adam_opts(L, base + 4, args ? 5 : 0, fn, args);
}

/* p, g, m, v, active, steps, E, opts; ptrs: room for 2 E tensor pointers
 * (the caller sized it from the same E). */
static void prep_lazy(lua_State *L, int base, int args, const char *fn, ml_tensor **ptrs,
                      ml_optim_job *j)
{
    j->kind = ML_OPTIM_LAZY_ADAMW;
    j->params = arg_tensor(L, base, args ? 1 : 0, fn, "params");
    j->grads = arg_tensor(L, base + 1, args ? 2 : 0, fn, "grads");
    j->experts = arg_experts(L, base + 6, args ? 7 : 0, fn, args ? "E" : "experts");
    if (j->experts >= 1) {             /* else the op refuses E before it reads a state */
        expert_states(L, base + 2, args ? 3 : 0, fn, "exp_avg", j->experts, ptrs);
        expert_states(L, base + 3, args ? 4 : 0, fn, "exp_avg_sq", j->experts, ptrs + j->experts);
        j->expert_avg = ptrs;
        j->expert_avg_sq = ptrs + j->experts;
    }
    j->active = arg_tensor(L, base + 4, args ? 5 : 0, fn, "active");
    j->steps = arg_tensor(L, base + 5, args ? 6 : 0, fn, "steps");
    j->adamw = adam_opts(L, base + 7, args ? 8 : 0, fn, 0);
}

/* p, g, buf (or nil), opts (with args: opts.step into j->step) */
static void prep_sgd(lua_State *L, int base, int args, const char *fn, ml_optim_job *j)
{
    j->kind = ML_OPTIM_SGD;
    j->params = arg_tensor(L, base, args ? 1 : 0, fn, "params");
    j->grads = arg_tensor(L, base + 1, args ? 2 : 0, fn, "grads");
    j->momentum_buffer = lua_isnoneornil(L, base + 2) ? NULL
                         : arg_tensor(L, base + 2, args ? 3 : 0, fn, "momentum_buffer");
    j->sgd = sgd_opts(L, base + 3, args ? 4 : 0, fn, args ? &j->step : NULL);
}

static int l_optim_adamw_step(lua_State *L)
{
    const char *fn = "moelua.optim_c.adamw_step";
    ml_args(L, 5, fn);
    ml_optim_job j = {0};
    prep_adamw(L, 1, 1, fn, &j);
    ml_err e;
    ml_check_op(L, fn, ml_op_adamw_step(ml_host_of(L), j.params, j.grads, j.exp_avg,
                                        j.exp_avg_sq, &j.adamw, &e), &e);
    return 0;
}

static int l_optim_lazy_adamw_step(lua_State *L)
{
    const char *fn = "moelua.optim_c.lazy_adamw_step";
    ml_args(L, 8, fn);
    int64_t E = arg_experts(L, 7, 7, fn, "E");
    ml_optim_job j = {0};
    prep_lazy(L, 1, 1, fn, scratch(L, (size_t)(E > 0 ? 2 * E : 0) * sizeof(ml_tensor *)), &j);
    ml_err e;
    int64_t k = 0;
    ml_check_op(L, fn, ml_op_lazy_adamw_step(ml_host_of(L), j.params, j.grads, j.expert_avg,
                                             j.expert_avg_sq, j.active, j.steps, j.experts,
                                             &j.adamw, &k, &e), &e);
    lua_pushinteger(L, (lua_Integer)k);
    return 1;
}

static int l_optim_sgd_step(lua_State *L)
{
    const char *fn = "moelua.optim_c.sgd_step";
    ml_args(L, 4, fn);
    ml_optim_job j = {0};
    prep_sgd(L, 1, 1, fn, &j);
    ml_err e;
    ml_check_op(L, fn, ml_op_sgd_step(ml_host_of(L), j.params, j.grads, j.momentum_buffer,
                                      &j.sgd, j.step, &e), &e);
    return 0;
}

/* ---- step_all ----------------------------------------------------------------- */

static const char *const JOB_FIELDS[3][8] = {
    {"params", "grads", "exp_avg", "exp_avg_sq", "hp", NULL},
    {"params", "grads", "exp_avg", "exp_avg_sq", "active", "steps", "experts", "hp"},
    {"params", "grads", "momentum_buffer", "hp", NULL},
};

/* job.step: completed steps (the op checks the range). */
static int64_t job_count(lua_State *L, int job, const char *fn)
{
    int isint;
    lua_getfield(L, job, "step");
    lua_Integer s = lua_tointegerx(L, -1, &isint);
    if (!isint)
        ml_error(L, fn, "field 'step' must be an integer, got %s", luaL_tolstring(L, -1, NULL));
    lua_pop(L, 1);
    return s;
}

/* The tensor pointers the lazy jobs of jobs[1..n] need: 2 E each, from their
 * `experts` fields (a bad field counts 0; prep_lazy reports it). */
static int64_t lazy_room(lua_State *L, lua_Integer n)
{
    int64_t room = 0;
    for (lua_Integer i = 1; i <= n; i++) {
        if (lua_geti(L, 1, i) == LUA_TTABLE) {
            lua_getfield(L, -1, "op");
            lua_getfield(L, -2, "experts");
            int isint;
            lua_Integer E = lua_tointegerx(L, -1, &isint);
            const char *op = lua_tostring(L, -2);
            if (op && !strcmp(op, "lazy_adamw") && isint && E > 0 && E <= MAX_EXPERTS)
                room += 2 * E;
            lua_pop(L, 2);
        }
        lua_pop(L, 1);
    }
    return room;
}

static int l_optim_step_all(lua_State *L)
{
    const char *fn0 = "moelua.optim_c.step_all";
    ml_args(L, 3, fn0);
    luaL_checktype(L, 1, LUA_TTABLE);
    luaL_checktype(L, 2, LUA_TTABLE);
    lua_Integer extra = luaL_optinteger(L, 3, 0);
    lua_Integer n = luaL_len(L, 1);
    if (n < 0 || n > 1 << 20)
        ml_error(L, fn0, "argument #1: %lld jobs", (long long)n);
    int64_t room = lazy_room(L, n);
    ml_optim_job *jobs = scratch(L, (size_t)n * sizeof(ml_optim_job)
                                    + (size_t)room * sizeof(ml_tensor *));
    ml_tensor **ptrs = (ml_tensor **)(jobs + n);
    char fn[96];
    for (lua_Integer i = 1; i <= n; i++) {
        int top = lua_gettop(L);
        if (lua_geti(L, 1, i) != LUA_TTABLE)
            ml_error(L, fn0, "job %lld: expected a table, got %s", (long long)i,
                     luaL_typename(L, -1));
        int job = lua_gettop(L);
        lua_getfield(L, job, "op");
        const char *op = lua_tostring(L, -1);
        int k = !op ? -1 : !strcmp(op, "adamw") ? ML_OPTIM_ADAMW
              : !strcmp(op, "lazy_adamw") ? ML_OPTIM_LAZY_ADAMW
              : !strcmp(op, "sgd") ? ML_OPTIM_SGD : -1;
        if (k < 0)
            ml_error(L, fn0, "job %lld: field 'op' must be \"adamw\", \"lazy_adamw\" or \"sgd\", "
                     "got %s", (long long)i, luaL_tolstring(L, -1, NULL));
        snprintf(fn, sizeof fn, "%s: job %lld (%s)", fn0, (long long)i, op);
        lua_pop(L, 1);
        int base = lua_gettop(L) + 1;
        for (int f = 0; f < 8 && JOB_FIELDS[k][f]; f++)
            lua_getfield(L, job, JOB_FIELDS[k][f]);
        ml_optim_job *j = &jobs[i - 1];
        if (k == ML_OPTIM_ADAMW) {
            prep_adamw(L, base, 0, fn, j);
        } else if (k == ML_OPTIM_LAZY_ADAMW) {
            int64_t E = arg_experts(L, base + 6, 0, fn, "experts");
            if (E > 0 && 2 * E > room)   /* lazy_room counted the same field */
                ml_error(L, fn, "field 'experts' changed during the call");
            prep_lazy(L, base, 0, fn, ptrs, j);
            ptrs += E > 0 ? 2 * E : 0;
            room -= E > 0 ? 2 * E : 0;
        } else {
            prep_sgd(L, base, 0, fn, j);
        }
        if (k != ML_OPTIM_LAZY_ADAMW)
            j->step = job_count(L, job, fn);
        lua_settop(L, top);
    }
    ml_err e;
    int64_t skipped = 0;
    ml_status s = ml_op_optim_step_all(ml_host_of(L), jobs, n, &skipped, &e);
    if (s != ML_EINVAL) {   /* ML_EINVAL: refused before any update */
        for (lua_Integer i = 1; i <= n; i++) {   /* plain table writes: no hook runs */
            if (jobs[i - 1].kind == ML_OPTIM_LAZY_ADAMW)
                continue;
            lua_geti(L, 1, i);
            lua_pushinteger(L, jobs[i - 1].step);
            lua_setfield(L, -2, "step");
            lua_pop(L, 1);
        }
        lua_getfield(L, 2, "t");
        lua_Integer t = lua_tointeger(L, -1);
        lua_getfield(L, 2, "skipped_expert_steps");
        lua_Integer sk = lua_tointeger(L, -1);
        lua_pop(L, 2);
        lua_pushinteger(L, t + 1);
        lua_setfield(L, 2, "t");
        lua_pushinteger(L, sk + extra + skipped);
        lua_setfield(L, 2, "skipped_expert_steps");
    }
    ml_check_op(L, fn0, s, &e);
    lua_pushinteger(L, extra + skipped);
    return 1;
}

static int l_optim_unstated(lua_State *L)
{
    const char *fn = "moelua.optim_c.unstated";
    ml_args(L, 3, fn);
    ml_tensor *a = arg_tensor(L, 1, 1, fn, "active");
    if (!lua_istable(L, 2) || ml_testtensor(L, 2))
        ml_error(L, fn, "argument #2 (states): expected a table {[expert] = tensor}, got %s",
                 luaL_typename(L, 2));
    if (!lua_istable(L, 3))
        ml_error(L, fn, "argument #3 (out): expected a table, got %s", luaL_typename(L, 3));
    int64_t E = ml_numel(a);
    if (E > MAX_EXPERTS)
        ml_error(L, fn, "argument #1 (active): at most %d experts, got %lld", MAX_EXPERTS,
                 (long long)E);
    ml_tensor **m = scratch(L, (size_t)E * (sizeof(ml_tensor *) + sizeof(int64_t)));
    int64_t *out = (int64_t *)(m + E);
    for (int64_t e = 0; e < E; e++) {
        char what[48];
        snprintf(what, sizeof what, "states[%lld]", (long long)e + 1);
        m[e] = lua_geti(L, 2, e + 1) == LUA_TNIL ? NULL : arg_tensor(L, lua_gettop(L), 2, fn, what);
        lua_pop(L, 1);
    }
    ml_err err;
    int64_t k = 0;
    ml_check_op(L, fn, ml_op_lazy_adamw_unstated(ml_host_of(L), a, m, E, out, &k, &err), &err);
    for (int64_t i = 0; i < k; i++) {
        lua_pushinteger(L, (lua_Integer)out[i] + 1);
        lua_seti(L, 3, (lua_Integer)i + 1);
    }
    lua_pushinteger(L, (lua_Integer)k);
    return 1;
}

/* ---- norms and clipping --------------------------------------------------------- */

/* The list of tensors at idx into scratch: *n of them. */
static ml_tensor **tensor_list(lua_State *L, int idx, const char *fn, int64_t *n)
{
    if (!lua_istable(L, idx) || ml_testtensor(L, idx))
        ml_error(L, fn, "argument #%d: expected a table of tensors, got %s", idx,
                 luaL_typename(L, idx));
    lua_Integer len = luaL_len(L, idx);
    if (len < 0 || len > 1 << 24)
        ml_error(L, fn, "argument #%d: %lld tensors", idx, (long long)len);
    ml_tensor **t = scratch(L, (size_t)len * sizeof *t);
    for (lua_Integer i = 1; i <= len; i++) {
        char name[32];
        snprintf(name, sizeof name, "tensor %lld", (long long)i);
        lua_geti(L, idx, i);
        t[i - 1] = arg_tensor(L, lua_gettop(L), idx, fn, name);
        lua_pop(L, 1);
    }
    *n = len;
    return t;
}

/* grad_norm(list) / grad_sumsq(list): the L2 norm, or the sum of squares,
 * of a list of flat tensors together. */
static int grad_norm(lua_State *L, const char *fn, int squared)
{
    ml_args(L, 1, fn);
    int64_t n;
    ml_tensor **t = tensor_list(L, 1, fn, &n);
    ml_err e;
    double v;
    const ml_tensor *const *ts = (const ml_tensor *const *)t;
    ml_check_op(L, fn, squared ? ml_op_grad_sumsq(ml_host_of(L), ts, n, &v, &e)
                               : ml_op_grad_norm(ml_host_of(L), ts, n, &v, &e), &e);
    lua_pushnumber(L, v);
    return 1;
}

static int l_optim_grad_norm(lua_State *L) { return grad_norm(L, "moelua.optim_c.grad_norm", 0); }
static int l_optim_grad_sumsq(lua_State *L) { return grad_norm(L, "moelua.optim_c.grad_sumsq", 1); }

static int l_optim_clip_grad_norm_(lua_State *L)
{
    const char *fn = "moelua.optim_c.clip_grad_norm_";
    ml_args(L, 2, fn);
    int64_t n;
    ml_tensor **t = tensor_list(L, 1, fn, &n);
    if (lua_type(L, 2) != LUA_TNUMBER)
        ml_error(L, fn, "argument #2 (max_norm): expected a number, got %s", luaL_typename(L, 2));
    ml_err e;
    double norm;
    ml_check_op(L, fn, ml_op_clip_grad_norm(ml_host_of(L), t, n, lua_tonumber(L, 2), &norm, &e),
                &e);
    lua_pushnumber(L, norm);
    return 1;
}

/* The [E] f64 output at idx, pushed: the given tensor, or an empty one the
 * op allocates. */
static ml_tensor *norms_out(lua_State *L, int idx, const char *fn)
{
    if (lua_isnoneornil(L, idx))
        return ml_pushtensor(L);
    ml_tensor *o = arg_tensor(L, idx, idx, fn, "out");
    lua_pushvalue(L, idx);
    return o;
}

static int l_optim_slice_norms(lua_State *L)
{
    const char *fn = "moelua.optim.expert_norms";   /* its public name (moelua.optim) */
    ml_args(L, 3, fn);
    ml_tensor *t = arg_tensor(L, 1, 1, fn, "grads");
    int64_t E = arg_experts(L, 2, 2, fn, "E");
    ml_tensor *o = norms_out(L, 3, fn);
    ml_err e;
    ml_check_op(L, fn, ml_op_slice_norms(ml_host_of(L), o, t, E, &e), &e);
    return 1;
}

static int l_optim_scale_(lua_State *L)
{
    const char *fn = "moelua.optim_c.scale_";
    ml_args(L, 2, fn);
    ml_tensor *t = arg_tensor(L, 1, 1, fn, "tensor");
    if (lua_type(L, 2) != LUA_TNUMBER)
        ml_error(L, fn, "argument #2 (factor): expected a number, got %s", luaL_typename(L, 2));
    ml_err e;
    ml_check_op(L, fn, ml_op_scale(ml_host_of(L), t, lua_tonumber(L, 2), &e), &e);
    lua_settop(L, 1);
    return 1;
}

/* bounds at idx (a table or a cpu tensor of E numbers) into f[0..E). */
static void bounds_arg(lua_State *L, int idx, const char *fn, int64_t E, double *f)
{
    ml_tensor *bt = ml_testtensor(L, idx);
    if (bt) {
        bt = arg_tensor(L, idx, idx, fn, "bounds");
        if (bt->st->device != ML_CPU || !ml_is_contiguous(bt) ||
            (bt->dtype != ML_F32 && bt->dtype != ML_F64) || ml_numel(bt) != E)
            ml_error(L, fn, "argument #%d (bounds): expected a contiguous cpu f32/f64 tensor of "
                     "%lld elements", idx, (long long)E);
        for (int64_t e = 0; e < E; e++)
            f[e] = ml_load(bt->dtype, ml_data(bt), (size_t)e);
    } else if (lua_istable(L, idx)) {
        if (luaL_len(L, idx) != E)
            ml_error(L, fn, "argument #%d (bounds): expected %lld bounds, got %lld", idx,
                     (long long)E, (long long)luaL_len(L, idx));
        for (int64_t e = 0; e < E; e++) {
            if (lua_geti(L, idx, e + 1) != LUA_TNUMBER)
                ml_error(L, fn, "argument #%d (bounds): bound %lld must be a number, got %s", idx,
                         (long long)e + 1, luaL_typename(L, -1));
            f[e] = lua_tonumber(L, -1);
            lua_pop(L, 1);
        }
    } else {
        ml_error(L, fn, "argument #%d (bounds): expected a table or a tensor of %lld numbers, "
                 "got %s", idx, (long long)E, luaL_typename(L, idx));
    }
}

static int l_optim_clip_slices_(lua_State *L)
{
    const char *fn = "moelua.optim.clip_expert_norms";   /* its public name (moelua.optim) */
    ml_args(L, 4, fn);
    ml_tensor *t = arg_tensor(L, 1, 1, fn, "grads");
    int64_t E = arg_experts(L, 2, 2, fn, "E");
    double *bounds = NULL;
    if (E >= 1) {                      /* else the op refuses E first */
        bounds = scratch(L, (size_t)E * sizeof *bounds);
        bounds_arg(L, 3, fn, E, bounds);
    }
    ml_tensor *o = norms_out(L, 4, fn);
    ml_err e;
    ml_check_op(L, fn, ml_op_clip_slices(ml_host_of(L), t, E, bounds, o, &e), &e);
    return 1;
}

static const luaL_Reg optim_funcs[] = {
    {"adamw_step", l_optim_adamw_step},
    {"lazy_adamw_step", l_optim_lazy_adamw_step},
    {"sgd_step", l_optim_sgd_step},
    {"step_all", l_optim_step_all},
    {"unstated", l_optim_unstated},
    {"grad_norm", l_optim_grad_norm},
    {"grad_sumsq", l_optim_grad_sumsq},
    {"clip_grad_norm_", l_optim_clip_grad_norm_},
    {"slice_norms", l_optim_slice_norms},
    {"scale_", l_optim_scale_},
    {"clip_slices_", l_optim_clip_slices_},
    {NULL, NULL}
};

int luaopen_moelua_optim_c(lua_State *L)
{
    luaL_newlibtable(L, optim_funcs);
    lua_pushnil(L);                        /* upvalue 1: the scratch (see scratch()) */
    luaL_setfuncs(L, optim_funcs, 1);
    return 1;
}
