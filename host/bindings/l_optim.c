/*
 * host/bindings/l_optim.c - the Lua library `moelua.optim_c`: the raw optimizer
 * kernels of kernels/optim.h on flat CPU buffers. The classes (groups,
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
 *   slice_norms(t, E [, out]) -> [E] f64  L2 norm of each of E equal slices
 *   scale_(t, s) -> t                     t *= s
 *   clip_slices_(t, E, bounds [, out]) -> [E] f64
 *                                         per-slice clip: slice e *= min(1, bound_e /
 *                                         (norm_e + 1e-6)); returns the norms before it;
 *                                         bounds: a Lua table or a tensor of E numbers
 *
 * p, g, m, v, buf: contiguous cpu tensors of one dtype (f32 or f64) and
 * one element count (a lazy job's m[e], v[e]: n/E elements); they are
 * updated in place (kernels/optim.h).
 *
 * Not interruptible: the kernels ignore the Ctrl-C flag, and step_all runs
 * every group's update with no Lua instruction or call in between, so the
 * Lua hook cannot cut a multi-group step either: all of its arguments are
 * checked first, then every kernel runs, then the step counts are written
 * back. Ctrl-C takes effect at the next Lua instruction after it returns.
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
 * Scratch: the checked jobs and the lazy jobs' per-expert state pointers
 * live in one Lua-owned buffer (not tensor data) kept as the function's
 * upvalue and grown when a call needs more, so a warmed-up step allocates
 * nothing, not even garbage for the Lua GC.
 */
#include "libs.h"
#include "l_util.h"
#include "../../kernels/optim.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#define CLIP_EPS 1e-6   /* torch.nn.utils.clip_grad_norm_'s */

/* Arguments are checked at stack index base + k - 1 and named "argument
 * #k": base 1 for the single-op bindings, the pushed fields for step_all. */

/* A flat float buffer: cpu, contiguous, f32 or f64; with ref, the same
 * dtype and element count as ref (named ref_name). */
static ml_tensor *check_buf_as(lua_State *L, int idx, int argn, const char *fn,
                               const char *name, const ml_tensor *ref, const char *ref_name)
{
    char what[64];
    snprintf(what, sizeof what, "argument #%d (%s)", argn, name);
    ml_tensor *t = ml_checktensor_named(L, idx, fn, what);
    if (t->st->device != ML_CPU)
        ml_error(L, fn, "argument #%d (%s): expected a cpu tensor, got a %s tensor", argn, name,
                 ml_device_names[t->st->device]);
    if (!ml_is_contiguous(t))
        ml_error(L, fn, "argument #%d (%s): expected a contiguous tensor", argn, name);
    if (t->dtype != ML_F32 && t->dtype != ML_F64)
        ml_error(L, fn, "argument #%d (%s): expected dtype f32 or f64, got %s", argn, name,
                 ml_dtype_names[t->dtype]);
    if (ref && t->dtype != ref->dtype)
        ml_error(L, fn, "argument #%d (%s): dtype %s differs from %s's %s", argn, name,
                 ml_dtype_names[t->dtype], ref_name, ml_dtype_names[ref->dtype]);
    if (ref && ml_numel(t) != ml_numel(ref))
        ml_error(L, fn, "argument #%d (%s): %lld elements, %s has %lld", argn, name,
                 (long long)ml_numel(t), ref_name, (long long)ml_numel(ref));
    return t;
}

static ml_tensor *check_buf(lua_State *L, int idx, const char *fn, const char *name,
                            const ml_tensor *ref, const char *ref_name)
{
    return check_buf_as(L, idx, idx, fn, name, ref, ref_name);
}

/* A cpu contiguous tensor of dtype dt and exactly n elements. */
static ml_tensor *check_small(lua_State *L, int idx, int argn, const char *fn, const char *name,
                              ml_dtype dt, int64_t n)
{
    char what[64];
    snprintf(what, sizeof what, "argument #%d (%s)", argn, name);
    if (!ml_testtensor(L, idx))
        ml_error(L, fn, "%s: expected a %s tensor, got %s", what, ml_dtype_names[dt],
                 luaL_typename(L, idx));
    ml_tensor *t = ml_checktensor_named(L, idx, fn, what);
    if (t->st->device != ML_CPU)
        ml_error(L, fn, "argument #%d (%s): expected a cpu tensor, got a %s tensor", argn, name,
                 ml_device_names[t->st->device]);
    if (t->dtype != dt)
        ml_error(L, fn, "argument #%d (%s): expected dtype %s, got %s", argn, name,
                 ml_dtype_names[dt], ml_dtype_names[t->dtype]);
    if (!ml_is_contiguous(t))
        ml_error(L, fn, "argument #%d (%s): expected a contiguous tensor", argn, name);
    if (ml_numel(t) != n)
        ml_error(L, fn, "argument #%d (%s): expected %lld elements, got %lld", argn, name,
                 (long long)n, (long long)ml_numel(t));
    return t;
}

/* E: an integer >= 1 dividing n. */
static int64_t check_E(lua_State *L, int idx, int argn, const char *fn, int64_t n)
{
    int isint;
    lua_Integer E = lua_tointegerx(L, idx, &isint);
    if (!isint || E < 1)
        ml_error(L, fn, "argument #%d (E): expected an integer >= 1, got %s", argn,
                 luaL_tolstring(L, idx, NULL));
    if (n % E != 0)
        ml_error(L, fn, "argument #%d (E): %lld experts do not divide %lld elements", argn,
                 (long long)E, (long long)n);
    return E;
}

/* At least `bytes` of scratch: upvalue 1 of the running C function, a
 * userdata replaced by a larger one when too small (contents not kept). */
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

/* The per-expert states (exp_avg or exp_avg_sq) of a lazy job: a table
 * whose keys are experts 1..E and whose values are cpu contiguous tensors
 * of p's dtype with n/E elements; out[e] = expert e+1's data, or NULL where
 * it has none, which only an inactive expert may. */
static void check_expert_states(lua_State *L, int idx, int argn, const char *fn,
                                const char *name, const ml_tensor *p, int64_t E,
                                const uint8_t *active, void **out)
{
    if (!lua_istable(L, idx) || ml_testtensor(L, idx))
        ml_error(L, fn, "argument #%d (%s): expected a table {[expert] = tensor}, got %s", argn,
                 name, luaL_typename(L, idx));
    lua_pushnil(L);
    while (lua_next(L, idx)) {
        int isint;
        lua_Integer e = lua_tointegerx(L, -2, &isint);
        if (!isint || e < 1 || e > E) {
            lua_pop(L, 1);
            ml_error(L, fn, "argument #%d (%s): keys must be experts 1..%lld, got %s", argn, name,
                     (long long)E, luaL_tolstring(L, -1, NULL));
        }
        lua_pop(L, 1);
    }
    char what[64];
    for (int64_t e = 0; e < E; e++) {
        snprintf(what, sizeof what, "%s[%lld]", name, (long long)e + 1);
        if (lua_geti(L, idx, e + 1) == LUA_TNIL) {
            if (active[e])
                ml_error(L, fn, "argument #%d (%s): expert %lld is active but has no state", argn,
                         what, (long long)e + 1);
            out[e] = NULL;
        } else {
            out[e] = ml_data(check_small(L, lua_gettop(L), argn, fn, what, p->dtype,
                                         ml_numel(p) / E));
        }
        lua_pop(L, 1);
    }
}

/* opts[key] as a number in [lo, hi] (hi_open: < hi); def when absent and
 * not required. */
static double opt_num(lua_State *L, int idx, const char *fn, const char *key, double def,
                      int required, double lo, double hi, int hi_open)
{
    double v = def;
    int t = lua_getfield(L, idx, key);
    if (t == LUA_TNIL) {
        if (required)
            ml_error(L, fn, "option '%s' is required", key);
    } else if (t != LUA_TNUMBER) {
        ml_error(L, fn, "option '%s' must be a number, got %s", key, luaL_typename(L, -1));
    } else {
        v = lua_tonumber(L, -1);
        if (!(v >= lo && (hi_open ? v < hi : v <= hi)))
            ml_error(L, fn, "option '%s' must be in [%g, %g%s, got %g", key, lo, hi,
                     hi_open ? ")" : "]", v);
    }
    lua_pop(L, 1);
    return v;
}

static int64_t opt_step(lua_State *L, int idx, const char *fn)
{
    int isint;
    if (lua_getfield(L, idx, "step") == LUA_TNIL)
        ml_error(L, fn, "option 'step' is required (the 1-based step number)");
    lua_Integer s = lua_tointegerx(L, -1, &isint);
    if (!isint || s < 1)
        ml_error(L, fn, "option 'step' must be an integer >= 1, got %s",
                 luaL_tolstring(L, -1, NULL));
    lua_pop(L, 1);
    return s;
}

static void check_opts_table(lua_State *L, int idx, int argn, const char *fn,
                             const char *const *allowed)
{
    if (!lua_istable(L, idx))
        ml_error(L, fn, "argument #%d (opts): expected a table, got %s", argn,
                 luaL_typename(L, idx));
    ml_check_opts(L, idx, fn, allowed);
}

static ml_adamw_hp adam_opts(lua_State *L, int idx, int argn, const char *fn, int with_step)
{
    static const char *const with[] = {"lr", "beta1", "beta2", "eps", "weight_decay", "step",
                                       NULL};
    static const char *const without[] = {"lr", "beta1", "beta2", "eps", "weight_decay", NULL};
    check_opts_table(L, idx, argn, fn, with_step ? with : without);
    ml_adamw_hp hp;
    hp.lr = opt_num(L, idx, fn, "lr", 0, 1, 0, HUGE_VAL, 0);
    hp.beta1 = opt_num(L, idx, fn, "beta1", 0.9, 0, 0, 1, 1);
    hp.beta2 = opt_num(L, idx, fn, "beta2", 0.999, 0, 0, 1, 1);
    hp.eps = opt_num(L, idx, fn, "eps", 1e-8, 0, 0, HUGE_VAL, 0);
    hp.weight_decay = opt_num(L, idx, fn, "weight_decay", 0.01, 0, 0, HUGE_VAL, 0);
    hp.step = with_step ? opt_step(L, idx, fn) : 0;
    return hp;
}

static ml_sgd_hp sgd_opts(lua_State *L, int idx, int argn, const char *fn, int with_step)
{
    static const char *const with[] = {"lr", "momentum", "dampening", "weight_decay",
                                       "nesterov", "step", NULL};
    static const char *const without[] = {"lr", "momentum", "dampening", "weight_decay",
                                          "nesterov", NULL};
    check_opts_table(L, idx, argn, fn, with_step ? with : without);
    ml_sgd_hp hp;
    hp.lr = opt_num(L, idx, fn, "lr", 0, 1, 0, HUGE_VAL, 0);
    hp.momentum = opt_num(L, idx, fn, "momentum", 0, 0, 0, HUGE_VAL, 0);
    hp.dampening = opt_num(L, idx, fn, "dampening", 0, 0, 0, 1, 0);
    hp.weight_decay = opt_num(L, idx, fn, "weight_decay", 0, 0, 0, HUGE_VAL, 0);
    int t = lua_getfield(L, idx, "nesterov");
    if (t != LUA_TNIL && t != LUA_TBOOLEAN)
        ml_error(L, fn, "option 'nesterov' must be a boolean, got %s", luaL_typename(L, -1));
    hp.nesterov = lua_toboolean(L, -1);
    lua_pop(L, 1);
    if (hp.nesterov && (hp.momentum <= 0 || hp.dampening != 0))
        ml_error(L, fn, "nesterov needs momentum > 0 and dampening = 0 (got momentum %g, "
                 "dampening %g)", hp.momentum, hp.dampening);
    hp.first = with_step ? opt_step(L, idx, fn) == 1 : 0;
    return hp;
}

/* ---- one checked update, run later ----------------------------------------- */

typedef enum { JOB_ADAMW, JOB_LAZY, JOB_SGD } job_op;

typedef struct {
    job_op op;
    ml_dtype dt;
    int64_t n, E;
    void *p, *m, *v, *buf;
    void **ms, **vs;          /* lazy: [E] per-expert state pointers (in the scratch) */
    const void *g;
    const uint8_t *active;
    int64_t *steps;
    ml_adamw_hp ahp;
    ml_sgd_hp shp;
} step_job;

/* p, g, m, v at base..base+3; with_step: opts at base+4 carry the step. */
static void prep_adamw(lua_State *L, int base, const char *fn, int with_step, step_job *j)
{
    ml_tensor *p = check_buf_as(L, base, 1, fn, "params", NULL, NULL);
    ml_tensor *g = check_buf_as(L, base + 1, 2, fn, "grads", p, "params");
    ml_tensor *m = check_buf_as(L, base + 2, 3, fn, "exp_avg", p, "params");
    ml_tensor *v = check_buf_as(L, base + 3, 4, fn, "exp_avg_sq", p, "params");
    j->op = JOB_ADAMW;
    j->dt = p->dtype;
    j->n = ml_numel(p);
    j->p = ml_data(p), j->g = ml_data(g), j->m = ml_data(m), j->v = ml_data(v);
    j->ahp = adam_opts(L, base + 4, 5, fn, with_step);
}

/* p, g, m, v, active, steps, E, opts at base..base+7; ptrs: room for
 * `room` pointers, of which the job takes 2 E. */
static void prep_lazy(lua_State *L, int base, const char *fn, void **ptrs, int64_t room,
                      step_job *j)
{
    ml_tensor *p = check_buf_as(L, base, 1, fn, "params", NULL, NULL);
    ml_tensor *g = check_buf_as(L, base + 1, 2, fn, "grads", p, "params");
    int64_t E = check_E(L, base + 6, 7, fn, ml_numel(p));
    if (2 * E > room)   /* the caller sized the scratch from the same argument */
        ml_error(L, fn, "argument #7 (E): no room for the state pointers of %lld experts",
                 (long long)E);
    ml_tensor *act = check_small(L, base + 4, 5, fn, "active", ML_U8, E);
    ml_tensor *steps = check_small(L, base + 5, 6, fn, "steps", ML_I64, E);
    j->ms = ptrs, j->vs = ptrs + E;
    check_expert_states(L, base + 2, 3, fn, "exp_avg", p, E, ml_data(act), j->ms);
    check_expert_states(L, base + 3, 4, fn, "exp_avg_sq", p, E, ml_data(act), j->vs);
    j->op = JOB_LAZY;
    j->dt = p->dtype;
    j->n = ml_numel(p);
    j->E = E;
    j->p = ml_data(p), j->g = ml_data(g);
    j->active = ml_data(act);
    j->steps = ml_data(steps);
    j->ahp = adam_opts(L, base + 7, 8, fn, 0);
}

/* p, g, buf, opts at base..base+3. */
static void prep_sgd(lua_State *L, int base, const char *fn, int with_step, step_job *j)
{
    ml_tensor *p = check_buf_as(L, base, 1, fn, "params", NULL, NULL);
    ml_tensor *g = check_buf_as(L, base + 1, 2, fn, "grads", p, "params");
    j->shp = sgd_opts(L, base + 3, 4, fn, with_step);
    ml_tensor *buf = NULL;
    if (j->shp.momentum != 0) {
        if (lua_isnoneornil(L, base + 2))
            ml_error(L, fn, "argument #3 (momentum_buffer): momentum %g needs a buffer, got nil",
                     j->shp.momentum);
        buf = check_buf_as(L, base + 2, 3, fn, "momentum_buffer", p, "params");
    } else if (!lua_isnoneornil(L, base + 2)) {
        check_buf_as(L, base + 2, 3, fn, "momentum_buffer", p, "params");
    }
    j->op = JOB_SGD;
    j->dt = p->dtype;
    j->n = ml_numel(p);
    j->p = ml_data(p), j->g = ml_data(g), j->buf = buf ? ml_data(buf) : NULL;
}

/* The update; returns the active experts of a lazy job. The statuses are
 * OK once prep accepted the dtypes and E. Skipped inside mem.plan. */
static int64_t run_job(lua_State *L, const step_job *j, const ml_kctx *ctx, ml_status *st)
{
    int64_t k = 0;
    switch (j->op) {
    case JOB_ADAMW:
        *st = ML_KCALL(ml_host_of(L), ML_CPU, adamw, j->dt, j->p, j->m, j->v, j->g, j->n, &j->ahp, ctx);
        break;
    case JOB_LAZY:
        *st = ML_KCALL(ml_host_of(L), ML_CPU, lazy_adamw, j->dt, j->p, j->ms, j->vs, j->steps, j->g, j->active,
                                             j->n, j->E, &j->ahp, &k, ctx);
        break;
    case JOB_SGD:
        *st = ML_KCALL(ml_host_of(L), ML_CPU, sgd, j->dt, j->p, j->buf, j->g, j->n, &j->shp, ctx);
        break;
    }
    return k;
}

static int l_optim_adamw_step(lua_State *L)
{
    const char *fn = "moelua.optim_c.adamw_step";
    step_job j;
    memset(&j, 0, sizeof j);
    prep_adamw(L, 1, fn, 1, &j);
    ml_kctx ctx = ml_kctx_of(ml_host_of(L));
    ml_status s;
    run_job(L, &j, &ctx, &s);
    ml_check_status(L, fn, s);
    return 0;
}

static int l_optim_lazy_adamw_step(lua_State *L)
{
    const char *fn = "moelua.optim_c.lazy_adamw_step";
    step_job j;
    memset(&j, 0, sizeof j);
    int isint;
    lua_Integer E = lua_tointegerx(L, 7, &isint);   /* checked by prep_lazy */
    int64_t room = isint && E > 0 && E <= (1 << 24) ? 2 * E : 0;
    prep_lazy(L, 1, fn, scratch(L, (size_t)room * sizeof(void *)), room, &j);
    ml_kctx ctx = ml_kctx_of(ml_host_of(L));
    ml_status s;
    int64_t k = run_job(L, &j, &ctx, &s);
    ml_check_status(L, fn, s);
    lua_pushinteger(L, (lua_Integer)k);
    return 1;
}

static int l_optim_sgd_step(lua_State *L)
{
    const char *fn = "moelua.optim_c.sgd_step";
    step_job j;
    memset(&j, 0, sizeof j);
    prep_sgd(L, 1, fn, 1, &j);
    ml_kctx ctx = ml_kctx_of(ml_host_of(L));
    ml_status s;
    run_job(L, &j, &ctx, &s);
    ml_check_status(L, fn, s);
    return 0;
}

/* ---- step_all ----------------------------------------------------------------- */

static const char *const JOB_FIELDS[3][8] = {
    {"params", "grads", "exp_avg", "exp_avg_sq", "hp", NULL},
    {"params", "grads", "exp_avg", "exp_avg_sq", "active", "steps", "experts", "hp"},
    {"params", "grads", "momentum_buffer", "hp", NULL},
};

static int64_t job_count(lua_State *L, int job, const char *fn)
{
    int isint;
    lua_getfield(L, job, "step");
    lua_Integer s = lua_tointegerx(L, -1, &isint);
    if (!isint || s < 0)
        ml_error(L, fn, "field 'step' must be an integer >= 0 (completed steps), got %s",
                 luaL_tolstring(L, -1, NULL));
    lua_pop(L, 1);
    return s;
}

/* The state pointers the lazy jobs of jobs[1..n] need: 2 E each, from their
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
            if (op && !strcmp(op, "lazy_adamw") && isint && E > 0 && E <= (1 << 24))
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
    luaL_checktype(L, 1, LUA_TTABLE);
    luaL_checktype(L, 2, LUA_TTABLE);
    lua_Integer extra = luaL_optinteger(L, 3, 0);
    lua_Integer n = luaL_len(L, 1);
    if (n < 0 || n > 1 << 20)
        ml_error(L, fn0, "argument #1: %lld jobs", (long long)n);
    int64_t room = lazy_room(L, n);
    step_job *jobs = scratch(L, (size_t)n * sizeof(step_job) + (size_t)room * sizeof(void *));
    void **ptrs = (void **)(jobs + n);
    char fn[96];
    /* 1. check everything: an error here has changed nothing */
    for (lua_Integer i = 1; i <= n; i++) {
        int top = lua_gettop(L);
        if (lua_geti(L, 1, i) != LUA_TTABLE)
            ml_error(L, fn0, "job %lld: expected a table, got %s", (long long)i,
                     luaL_typename(L, -1));
        int job = lua_gettop(L);
        lua_getfield(L, job, "op");
        const char *op = lua_tostring(L, -1);
        int k = !op ? -1 : !strcmp(op, "adamw") ? JOB_ADAMW : !strcmp(op, "lazy_adamw") ? JOB_LAZY
              : !strcmp(op, "sgd") ? JOB_SGD : -1;
        if (k < 0)
            ml_error(L, fn0, "job %lld: field 'op' must be \"adamw\", \"lazy_adamw\" or \"sgd\", "
                     "got %s", (long long)i, luaL_tolstring(L, -1, NULL));
        snprintf(fn, sizeof fn, "%s: job %lld (%s)", fn0, (long long)i, op);
        lua_pop(L, 1);
        int base = lua_gettop(L) + 1;
        for (int f = 0; f < 8 && JOB_FIELDS[k][f]; f++)
            lua_getfield(L, job, JOB_FIELDS[k][f]);
        if (k == JOB_ADAMW) {
            prep_adamw(L, base, fn, 0, &jobs[i - 1]);
            jobs[i - 1].ahp.step = job_count(L, job, fn) + 1;
        } else if (k == JOB_LAZY) {
            prep_lazy(L, base, fn, ptrs, room, &jobs[i - 1]);
            ptrs += 2 * jobs[i - 1].E;
            room -= 2 * jobs[i - 1].E;
        } else {
            prep_sgd(L, base, fn, 0, &jobs[i - 1]);
            jobs[i - 1].shp.first = job_count(L, job, fn) == 0;
        }
        lua_settop(L, top);
    }
    /* 2. every update, with no Lua in between */
    ml_kctx ctx = ml_kctx_of(ml_host_of(L));
    ml_status bad = ML_OK;
    lua_Integer skipped = extra;
    for (lua_Integer i = 0; i < n; i++) {
        ml_status s = ML_OK;
        int64_t k = run_job(L, &jobs[i], &ctx, &s);
        if (jobs[i].op == JOB_LAZY)
            skipped += jobs[i].E - k;
        if (s != ML_OK && bad == ML_OK)
            bad = s;
    }
    /* 3. the counts (plain table writes: no hook runs) */
    for (lua_Integer i = 1; i <= n; i++) {
        if (jobs[i - 1].op == JOB_LAZY)
            continue;
        lua_geti(L, 1, i);
        lua_pushinteger(L, jobs[i - 1].op == JOB_ADAMW ? jobs[i - 1].ahp.step
                                                        : job_count(L, -1, fn0) + 1);
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
    lua_pushinteger(L, sk + skipped);
    lua_setfield(L, 2, "skipped_expert_steps");
    ml_check_status(L, fn0, bad);
    lua_pushinteger(L, skipped);
    return 1;
}
static int l_optim_unstated(lua_State *L)
{
    const char *fn = "moelua.optim_c.unstated";
    ml_tensor *t = ml_testtensor(L, 1);   /* any element count: check_small checks the rest */
    t = check_small(L, 1, 1, fn, "active", ML_U8, t ? ml_numel(t) : 0);
    if (!lua_istable(L, 2) || ml_testtensor(L, 2))
        ml_error(L, fn, "argument #2 (states): expected a table {[expert] = tensor}, got %s",
                 luaL_typename(L, 2));
    if (!lua_istable(L, 3))
        ml_error(L, fn, "argument #3 (out): expected a table, got %s", luaL_typename(L, 3));
    const uint8_t *a = ml_data(t);
    lua_Integer k = 0;
    for (int64_t e = 0, E = ml_numel(t); e < E; e++) {
        if (!a[e])
            continue;
        int none = lua_geti(L, 2, e + 1) == LUA_TNIL;
        lua_pop(L, 1);
        if (none) {
            lua_pushinteger(L, (lua_Integer)e + 1);
            lua_seti(L, 3, ++k);
        }
    }
    lua_pushinteger(L, k);
    return 1;
}

static int l_optim_grad_norm(lua_State *L)
{
    const char *fn = "moelua.optim_c.grad_norm";
    if (!lua_istable(L, 1) || ml_testtensor(L, 1))
        ml_error(L, fn, "argument #1: expected a table of tensors, got %s", luaL_typename(L, 1));
    lua_Integer n = luaL_len(L, 1);
    for (lua_Integer i = 1; i <= n; i++) {   /* check all before computing any */
        lua_geti(L, 1, i);
        char name[32];
        snprintf(name, sizeof name, "tensor %lld", (long long)i);
        check_buf_as(L, lua_gettop(L), 1, fn, name, NULL, NULL);
        lua_pop(L, 1);
    }
    ml_kctx ctx = ml_kctx_of(ml_host_of(L));
    double total = 0;
    for (lua_Integer i = 1; i <= n; i++) {
        lua_geti(L, 1, i);
        ml_tensor *t = ml_checktensor(L, -1, fn);
        double ss = 0;
        ml_status s = ML_KCALL(ml_host_of(L), ML_CPU, sumsq, t->dtype, &ss, ml_data(t), ml_numel(t), &ctx);
        lua_pop(L, 1);
        ml_check_status(L, fn, s);
        total += ss;
    }
    lua_pushnumber(L, sqrt(total));
    return 1;
}

/* Push the [E] f64 output: out at idx (checked) or a new tensor. */
static ml_tensor *norms_out(lua_State *L, int idx, const char *fn, int64_t E)
{
    if (lua_isnoneornil(L, idx)) {
        int64_t shape[1] = {E};
        return ml_newtensor(L, fn, ML_CPU, ML_F64, 1, shape);
    }
    ml_tensor *o = check_small(L, idx, idx, fn, "out", ML_F64, E);
    lua_pushvalue(L, idx);
    return o;
}

static int l_optim_slice_norms(lua_State *L)
{
    const char *fn = "moelua.optim_c.slice_norms";
    ml_tensor *t = check_buf(L, 1, fn, "grads", NULL, NULL);
    int64_t E = check_E(L, 2, 2, fn, ml_numel(t));
    ml_tensor *o = norms_out(L, 3, fn, E);
    ml_kctx ctx = ml_kctx_of(ml_host_of(L));
    ml_check_status(L, fn, ML_KCALL(ml_host_of(L), ML_CPU, slice_norms, t->dtype, ml_data(o), ml_data(t),
                                                           ml_numel(t), E, &ctx));
    return 1;
}

static int l_optim_scale_(lua_State *L)
{
    const char *fn = "moelua.optim_c.scale_";
    ml_tensor *t = check_buf(L, 1, fn, "tensor", NULL, NULL);
    if (lua_type(L, 2) != LUA_TNUMBER)
        ml_error(L, fn, "argument #2 (factor): expected a number, got %s", luaL_typename(L, 2));
    double f = lua_tonumber(L, 2);
    if (!isfinite(f))
        ml_error(L, fn, "argument #2 (factor): expected a finite number, got %g", f);
    ml_kctx ctx = ml_kctx_of(ml_host_of(L));
    ml_check_status(L, fn, ML_KCALL(ml_host_of(L), ML_CPU, scale_slices, t->dtype, ml_data(t), &f, ml_numel(t), 1,
                                                       &ctx));
    lua_settop(L, 1);
    return 1;
}

static double check_bound(lua_State *L, const char *fn, lua_Integer e, double b)
{
    if (!(b >= 0) || isinf(b))
        ml_error(L, fn, "argument #3 (bounds): bound %lld must be a finite number >= 0, got %g",
                 (long long)e, b);
    return b;
}

static int l_optim_clip_slices_(lua_State *L)
{
    const char *fn = "moelua.optim_c.clip_slices_";
    ml_tensor *t = check_buf(L, 1, fn, "grads", NULL, NULL);
    int64_t E = check_E(L, 2, 2, fn, ml_numel(t));
    /* factors: Lua-owned scratch of E doubles (not tensor data) */
    double *f = lua_newuserdatauv(L, (size_t)E * sizeof(double), 0);
    int fidx = lua_gettop(L);
    ml_tensor *bt = ml_testtensor(L, 3);
    if (bt) {
        bt = ml_checktensor(L, 3, fn);
        if (bt->st->device != ML_CPU || !ml_is_contiguous(bt) ||
            (bt->dtype != ML_F32 && bt->dtype != ML_F64) || ml_numel(bt) != E)
            ml_error(L, fn, "argument #3 (bounds): expected a contiguous cpu f32/f64 tensor of "
                     "%lld elements", (long long)E);
        for (int64_t e = 0; e < E; e++)
            f[e] = check_bound(L, fn, e + 1, ml_load(bt->dtype, ml_data(bt), (size_t)e));
    } else if (lua_istable(L, 3)) {
        if (luaL_len(L, 3) != E)
            ml_error(L, fn, "argument #3 (bounds): expected %lld bounds, got %lld",
                     (long long)E, (long long)luaL_len(L, 3));
        for (int64_t e = 0; e < E; e++) {
            if (lua_geti(L, 3, e + 1) != LUA_TNUMBER)
                ml_error(L, fn, "argument #3 (bounds): bound %lld must be a number, got %s",
                         (long long)e + 1, luaL_typename(L, -1));
            f[e] = check_bound(L, fn, e + 1, lua_tonumber(L, -1));
            lua_pop(L, 1);
        }
    } else {
        ml_error(L, fn, "argument #3 (bounds): expected a table or a tensor of %lld numbers, got %s",
                 (long long)E, luaL_typename(L, 3));
    }
    ml_tensor *o = norms_out(L, 4, fn, E);
    ml_kctx ctx = ml_kctx_of(ml_host_of(L));
    ml_check_status(L, fn, ML_KCALL(ml_host_of(L), ML_CPU, slice_norms, t->dtype, ml_data(o), ml_data(t),
                                                           ml_numel(t), E, &ctx));
    const double *nrm = ml_data(o);
    for (int64_t e = 0; e < E; e++) {
        double c = f[e] / (nrm[e] + CLIP_EPS);
        f[e] = isfinite(nrm[e]) && c < 1.0 ? c : 1.0;   /* a non-finite norm is left to the caller */
    }
    ml_check_status(L, fn, ML_KCALL(ml_host_of(L), ML_CPU, scale_slices, t->dtype, ml_data(t), f, ml_numel(t), E,
                                                       &ctx));
    (void)fidx;
    return 1;
}

static const luaL_Reg optim_funcs[] = {
    {"adamw_step", l_optim_adamw_step},
    {"lazy_adamw_step", l_optim_lazy_adamw_step},
    {"sgd_step", l_optim_sgd_step},
    {"step_all", l_optim_step_all},
    {"unstated", l_optim_unstated},
    {"grad_norm", l_optim_grad_norm},
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
