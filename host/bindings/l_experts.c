/*
 * host/bindings/l_experts.c - the Lua library `moelua.experts`: token dispatch and
 * tiled SwiGLU experts with their combine, forward and backward
 * (kernels/dispatch.h, kernels/experts.h). Functional: the router lives in
 * moelua.router, the layer object is composed in Lua.
 *
 *   experts.dispatch(idx, E, opts) -> plan
 *       idx [T, k] int64 expert ids (0-based). plan = {offsets = [E+1] i64,
 *       order = [T·k] i64, counts = [E] i64 kept per expert, dropped = [T, k]
 *       u8, ndropped = n, E =, T =, k =, capacity = (-1: dropless, or
 *       per-expert capacities given)}
 *   experts.forward(x, gate_up, down, idx, w, plan, opts) -> y, saved
 *       x [T, D], gate_up [E, 2F, D], down [E, D, F], w [T, k] (one float
 *       dtype: f32 or f64, or bf16 on CUDA with f32 dgate_up and ddown in
 *       backward); y [T, D]; saved = {tile =, nsaved = S, h = [S, 2F]
 *       (absent when S = 0)}
 *   experts.backward(dy, x, gate_up, down, idx, w, plan, saved, opts, grads)
 *       -> dx, dgate_up, ddown, dw, touched
 *       dx, dgate_up, ddown accumulate (+=) into grads.dx / grads.dgate_up /
 *       grads.ddown when given (else into new zeroed tensors); dw [T, k] and
 *       touched [E] u8 are overwritten (grads.dw / grads.touched when given).
 *
 *   Per-expert weights (the expert store's cache slots): gate_up and down
 *   may instead be Lua tables {[e + 1] = tensor} of expert e's gate_up
 *   [2F, D] and down [D, F] (each contiguous, x's dtype and device), E from
 *   opts.E or plan.E. An expert without an entry (in both tables) is
 *   skipped: its rows are neither read nor written. Backward then takes
 *   grads.dgate_up and grads.ddown as such tables too, with an entry for
 *   every expert run (+=; the others untouched), and returns them. One
 *   layer may so run its experts over several calls, a subset per call in
 *   ascending expert order, bitwise one call over all:
 *     local y, saved
 *     for _, s in ipairs(subsets) do   -- e.g. {gu0, gu1} and {[3] = gu2, [4] = gu3}
 *       y, saved = experts.forward(x, s.gu, s.dn, idx, w, plan, {out = y, saved = saved})
 *     end
 *     local g = {dgate_up = dgu, ddown = ddn}   -- tables covering every expert run
 *     for i, s in ipairs(subsets) do
 *       g.dx, _, _, g.dw, g.touched = experts.backward(dy, x, s.gu, s.dn, idx, w, plan,
 *                                                      saved, {accumulate = i > 1}, g)
 *     end
 *   The first call has no out and no saved: it makes y (zeroed) and saved;
 *   each later one adds its experts' rows into out = y and writes its
 *   experts' h into the same saved.h (its tile and S are saved's). The
 *   first backward makes dx, dw and touched; with accumulate = true a later
 *   one adds into grads.dx and writes only its experts' entries of grads.dw
 *   and grads.touched (both required).
 *   experts.pack(src, plan, opts) -> rows
 *       the kept assignments' rows in plan order (what expert parallelism
 *       sends): rows [kept, C] (kept = T·k - plan.ndropped), row p = row
 *       order[p] of src [T·k, C] (per assignment) or row order[p] // k of
 *       src [T, C] (per token); any dtype. Reads opts.pool only.
 *   experts.unpack(rows, plan, out) -> out
 *       the reverse, summed: out [T, C] or [T·k, C] (given, f32/f64; bf16 on CUDA) +=
 *       row p of rows [kept, C] at its token or assignment, p ascending
 *       (the experts combine's order: unpacking the per-assignment outputs
 *       w·expert(x) is bitwise experts.forward's y).
 *
 * Options (one table shape for all three; each function reads what it needs):
 *   tile = 256            rows per expert GEMM tile (scratch is tile-sized)
 *   save = "save"         "save" keeps h [T·k, 2F] for backward,
 *                         "recompute" keeps nothing (h recomputed per tile)
 *   partial_recompute = f in [0, 1] (instead of save): keeps h for the first
 *                         floor((1-f)·T·k) dispatch positions, recomputes the
 *                         tiles beyond (kernels/experts.h)
 *   capacity = c          per-expert capacity (integer >= 0; needs policy "drop")
 *   capacities = caps     instead of capacity: i64 [E] on idx's device, expert e
 *                         keeps its first caps[e] assignments (each >= 0)
 *   policy = "dropless"   or "drop" (assignments over capacity, in (t, j) order,
 *                         are dropped and counted)
 *   pool = moelua.pool    outputs, saved h and scratch come from this pool
 *                         (scratch in a frame rewound before returning), so a
 *                         warmed-up forward+backward makes no ledger allocation
 *   E = n                 the number of experts when the weights are per-expert
 *                         tables (default plan.E)
 *   out = y               (forward) add into y [T, D] instead of making a new one
 *   saved = saved         (forward) the saved table of an earlier call over other
 *                         experts of the same layer: its tile and S are taken,
 *                         its h gets this call's experts' positions
 *   accumulate = false    (backward) true: grads.dw and grads.touched are an
 *                         earlier call's and keep the other experts' entries
 * backward takes tile and S from `saved`; an opts.tile that differs is an error
 * (the same for forward with opts.saved).
 *
 * Devices: every tensor (idx, x, weights, w, the plan, saved, grads) and the
 * pool on one device, cpu or cuda. Each function converts its Lua values
 * (tables to the C structs of host/runtime/ops_moe.h) and calls one op,
 * which checks them, allocates the outputs and the scratch and runs the
 * kernels.
 *
 * Not here: routing, the layer object.
 */
#include "libs.h"
#include "l_util.h"
#include "../runtime/ops_moe.h"

#include <math.h>
#include <string.h>

static const char *const OPTS[] = {"tile", "save", "partial_recompute", "capacity", "capacities",
                                   "policy", "pool", "E", "out", "saved", "accumulate", NULL};

typedef struct {
    int64_t tile;
    int has_tile;
    double recompute;       /* fraction of positions recomputed: 0 save, 1 recompute */
    int has_save;           /* save or partial_recompute given */
    int64_t capacity;       /* -1: none given */
    ml_tensor *caps;        /* capacities, or NULL; the options table keeps it alive */
    int drop;
    ml_pool *pool;          /* NULL: none; the options table keeps it alive */
    int64_t E;              /* 0: none given */
    int has_out, has_saved; /* out and saved given (read where used) */
    int accumulate;
} ex_opts;

/* ---- options ----------------------------------------------------------------- */

static void parse_opts(lua_State *L, int idx, const char *fn, ex_opts *o)
{
    memset(o, 0, sizeof *o);
    o->tile = 256;
    o->capacity = -1;
    if (lua_isnoneornil(L, idx))
        return;
    ml_check_opts(L, idx, fn, OPTS);
    int isint;

    if (lua_getfield(L, idx, "tile") != LUA_TNIL) {
        lua_Integer v = lua_tointegerx(L, -1, &isint);
        if (!isint || v < 1)
            ml_error(L, fn, "option 'tile' must be an integer >= 1, got %s",
                     luaL_tolstring(L, -1, NULL));
        o->tile = v;
        o->has_tile = 1;
    }
    lua_pop(L, 1);

    int has_save = 0;
    if (lua_getfield(L, idx, "save") != LUA_TNIL) {
        const char *s = lua_type(L, -1) == LUA_TSTRING ? lua_tostring(L, -1) : NULL;
        if (s && strcmp(s, "save") == 0)
            o->recompute = 0;
        else if (s && strcmp(s, "recompute") == 0)
            o->recompute = 1;
        else
            ml_error(L, fn, "option 'save' must be \"save\" or \"recompute\", got %s",
                     luaL_tolstring(L, -1, NULL));
        has_save = 1;
    }
    lua_pop(L, 1);

    if (lua_getfield(L, idx, "partial_recompute") != LUA_TNIL) {
        if (lua_type(L, -1) != LUA_TNUMBER)
            ml_error(L, fn, "option 'partial_recompute' must be a number in [0, 1], got %s",
                     luaL_typename(L, -1));
        double f = lua_tonumber(L, -1);
        if (!(f >= 0 && f <= 1))
            ml_error(L, fn, "option 'partial_recompute' must be in [0, 1], got %g", f);
        if (has_save)
            ml_error(L, fn, "options 'save' and 'partial_recompute' exclude each other "
                     "(partial_recompute = 0 is save, 1 is recompute)");
        o->recompute = f;
        has_save = 1;
    }
    lua_pop(L, 1);
    o->has_save = has_save;

    if (lua_getfield(L, idx, "capacity") != LUA_TNIL) {
        lua_Integer v = lua_tointegerx(L, -1, &isint);
        if (!isint || v < 0)
            ml_error(L, fn, "option 'capacity' must be an integer >= 0, got %s",
                     luaL_tolstring(L, -1, NULL));
        o->capacity = v;
    }
    lua_pop(L, 1);

    if (lua_getfield(L, idx, "capacities") != LUA_TNIL) {
        if (o->capacity >= 0)
            ml_error(L, fn, "options 'capacity' and 'capacities' exclude each other");
        o->caps = ml_checktensor_named(L, -1, fn, "option 'capacities'");
    }
    lua_pop(L, 1);

    int has_policy = 0;
    if (lua_getfield(L, idx, "policy") != LUA_TNIL) {
        const char *s = lua_type(L, -1) == LUA_TSTRING ? lua_tostring(L, -1) : NULL;
        if (s && strcmp(s, "drop") == 0)
            o->drop = 1;
        else if (!s || strcmp(s, "dropless") != 0)
            ml_error(L, fn, "option 'policy' must be \"dropless\" or \"drop\", got %s",
                     luaL_tolstring(L, -1, NULL));
        has_policy = 1;
    }
    lua_pop(L, 1);
    if (o->drop && o->capacity < 0 && !o->caps)
        ml_error(L, fn, "option 'policy' = \"drop\" needs option 'capacity' or 'capacities'");
    if ((o->capacity >= 0 || o->caps) && !o->drop)
        ml_error(L, fn, "option '%s' needs policy = \"drop\"%s", o->caps ? "capacities" : "capacity",
                 has_policy ? " (policy is \"dropless\")" : "");

    if (lua_getfield(L, idx, "pool") != LUA_TNIL)
        o->pool = ml_checkpool(L, -1, fn, "option 'pool'");
    lua_pop(L, 1);

    if (lua_getfield(L, idx, "E") != LUA_TNIL) {
        lua_Integer v = lua_tointegerx(L, -1, &isint);
        if (!isint || v < 1)
            ml_error(L, fn, "option 'E' must be an integer number of experts >= 1, got %s",
                     luaL_tolstring(L, -1, NULL));
        o->E = v;
    }
    lua_pop(L, 1);

    if (lua_getfield(L, idx, "out") != LUA_TNIL) {
        ml_checktensor_named(L, -1, fn, "option 'out'");
        o->has_out = 1;
    }
    lua_pop(L, 1);

    if (lua_getfield(L, idx, "saved") != LUA_TNIL) {
        if (!lua_istable(L, -1))
            ml_error(L, fn, "option 'saved' must be the table experts.forward returned, got %s",
                     luaL_typename(L, -1));
        o->has_saved = 1;
    }
    lua_pop(L, 1);

    if (lua_getfield(L, idx, "accumulate") != LUA_TNIL) {
        if (!lua_isboolean(L, -1))
            ml_error(L, fn, "option 'accumulate' must be a boolean, got %s", luaL_typename(L, -1));
        o->accumulate = lua_toboolean(L, -1);
    }
    lua_pop(L, 1);
}

/* ---- arguments ----------------------------------------------------------------- */

/* Argument idx, a live tensor (the op checks the rest). */
static ml_tensor *arg(lua_State *L, int idx, const char *fn, const char *name)
{
    char what[64];
    snprintf(what, sizeof what, "argument #%d (%s)", idx, name);
    return ml_checktensor_named(L, idx, fn, what);
}

/* tbl[key] (the table is named tname): a live tensor, left on the stack. */
static ml_tensor *field_tensor(lua_State *L, int tbl, const char *tname, const char *key,
                               const char *fn)
{
    char what[64];
    snprintf(what, sizeof what, "%s.%s", tname, key);
    lua_getfield(L, tbl, key);
    return ml_checktensor_named(L, -1, fn, what);
}

/* The plan table at idx: its offsets and order (the table keeps them alive). */
static ml_dispatch_plan read_plan(lua_State *L, int idx, const char *fn)
{
    if (!lua_istable(L, idx))
        ml_error(L, fn, "argument #%d (plan): expected the table experts.dispatch returned, got %s",
                 idx, luaL_typename(L, idx));
    ml_dispatch_plan p = {0};
    p.offsets = field_tensor(L, idx, "plan", "offsets", fn);
    p.order = field_tensor(L, idx, "plan", "order", fn);
    lua_pop(L, 2);
    return p;
}

/* The plan table at idx as pack and unpack read it: order, ndropped and
 * (in *k) k. */
static ml_dispatch_plan read_plan_rows(lua_State *L, int idx, const char *fn, int64_t *k)
{
    ml_dispatch_plan p = read_plan(L, idx, fn);
    static const char *const keys[] = {"k", "ndropped"};
    int64_t *vals[] = {k, &p.ndropped};
    for (int i = 0; i < 2; i++) {
        int isint;
        lua_getfield(L, idx, keys[i]);
        *vals[i] = lua_tointegerx(L, -1, &isint);
        if (!isint)
            ml_error(L, fn, "argument #%d (plan): expected an integer plan.%s (the table "
                     "experts.dispatch returned), got %s", idx, keys[i], luaL_typename(L, -1));
        lua_pop(L, 1);
    }
    return p;
}

/* S = floor((1 - f)·n) of n = T·k dispatch positions (kernels/experts.h). */
static int64_t nsaved_of(int64_t n, double recompute)
{
    int64_t s = (int64_t)floor((1.0 - recompute) * (double)n);
    return s < 0 ? 0 : s > n ? n : s;
}

/* The saved table at idx (`what` names it): tile and S from forward. */
static void read_saved(lua_State *L, int idx, const char *fn, const char *what, int64_t *tile,
                       int64_t *nsaved)
{
    if (!lua_istable(L, idx))
        ml_error(L, fn, "%s: expected the table experts.forward returned, got %s", what,
                 luaL_typename(L, idx));
    int isint1, isint2;
    lua_getfield(L, idx, "tile");
    *tile = lua_tointegerx(L, -1, &isint1);
    lua_getfield(L, idx, "nsaved");
    *nsaved = lua_tointegerx(L, -1, &isint2);
    lua_pop(L, 2);
    if (!isint1 || !isint2)
        ml_error(L, fn, "%s: expected integers saved.tile and saved.nsaved (the table "
                 "experts.forward returned)", what);
}

/* ---- per-expert tables ------------------------------------------------------------ */

/* 1 when the weights at gi and gi + 1 (gate_up, down) are per-expert Lua
 * tables, 0 when tensors (checked later); one of each is an error. */
static int weight_tables(lua_State *L, int gi, const char *fn)
{
    int tables = lua_istable(L, gi);
    if (lua_istable(L, gi + 1) != tables)
        ml_error(L, fn, "argument #%d (down): expected a %s like gate_up, got %s", gi + 1,
                 tables ? "table of per-expert tensors" : "tensor", luaL_typename(L, gi + 1));
    return tables;
}

/* E for per-expert tables: opts.E, else the plan's (at plan_idx). */
static int64_t experts_E(lua_State *L, int plan_idx, const ex_opts *o, const char *fn)
{
    int isint;
    lua_getfield(L, plan_idx, "E");
    lua_Integer pe = lua_tointegerx(L, -1, &isint);
    lua_pop(L, 1);
    if (o->E && isint && pe != o->E)
        ml_error(L, fn, "option 'E' = %lld differs from plan.E = %lld", (long long)o->E,
                 (long long)pe);
    if (o->E)
        return o->E;
    if (!isint || pe < 1)
        ml_error(L, fn, "argument #%d (plan): no plan.E: give option 'E' (the number of experts) "
                 "with per-expert tables", plan_idx);
    return pe;
}

/* The tensors of the Lua table at idx, {[e + 1] = tensor}, into ts[0 .. E)
 * (NULL where absent); `what` names it in errors. */
static void read_experts(lua_State *L, int idx, const char *fn, const char *what, int64_t E,
                         ml_tensor **ts)
{
    for (int64_t i = 0; i < E; i++)
        ts[i] = NULL;
    lua_pushnil(L);
    while (lua_next(L, idx)) {
        int isint = lua_type(L, -2) == LUA_TNUMBER;
        lua_Integer key = isint ? lua_tointegerx(L, -2, &isint) : 0;
        if (!isint || key < 1 || key > E)
            ml_error(L, fn, "%s: key %s is not an expert's (expected integers 1 .. E = %lld: "
                     "expert + 1)", what, luaL_tolstring(L, -2, NULL), (long long)E);
        char name[64];
        snprintf(name, sizeof name, "%s[%lld]", what, (long long)key);
        ts[key - 1] = ml_checktensor_named(L, -1, fn, name);
        lua_pop(L, 1);
    }
}

/* Arrays for the per-expert tables of E experts, in one userdata pushed on
 * the stack (collected with it): the weights' and gradients' tensors
 * [E] each, and the pointer tables the ops read (2E each). */
typedef struct {
    ml_tensor **gate_up, **down, **dgate_up, **ddown;
    const void **wptrs;
    void **gptrs;
} ex_lists;

static ex_lists push_lists(lua_State *L, int64_t E, const char *fn)
{
    if ((uint64_t)E > SIZE_MAX / (8 * sizeof(void *)))
        ml_error(L, fn, "E = %lld experts are too many for the pointer tables", (long long)E);
    void **p = lua_newuserdatauv(L, (size_t)E * 8 * sizeof(void *), 0);
    ex_lists l = {(ml_tensor **)p, (ml_tensor **)p + E, (ml_tensor **)p + 2 * E,
                  (ml_tensor **)p + 3 * E, (const void **)(p + 4 * E), p + 6 * E};
    return l;
}

/* The weights at gi, gi + 1 (per-expert tables) tabulated against x. */
static ml_experts_table read_weight_tables(lua_State *L, int gi, const ml_tensor *x, int64_t E,
                                           ex_lists *l, const char *fn)
{
    read_experts(L, gi, fn, "gate_up", E, l->gate_up);
    read_experts(L, gi + 1, fn, "down", E, l->down);
    ml_experts_table t;
    ml_err e;
    ml_check_op(L, fn, ml_op_experts_tabulate(&t, l->wptrs, (const ml_tensor *const *)l->gate_up,
                                              (const ml_tensor *const *)l->down, E, x, &e), &e);
    return t;
}

/* ---- experts.dispatch ------------------------------------------------------------ */

static int l_experts_dispatch(lua_State *L)
{
    static const char fn[] = "moelua.experts.dispatch";
    ml_args(L, 3, fn);
    lua_settop(L, 3);
    ml_tensor *idx = arg(L, 1, fn, "idx");
    int isint;
    lua_Integer E = lua_tointegerx(L, 2, &isint);
    if (!isint || E < 1)
        ml_error(L, fn, "argument #2 (E): expected an integer number of experts >= 1, got %s",
                 luaL_tolstring(L, 2, NULL));
    ex_opts o;
    parse_opts(L, 3, fn, &o);
    int64_t capacity = o.drop && !o.caps ? o.capacity : -1;

    lua_createtable(L, 0, 10);
    ml_dispatch_plan plan = {0};
    static const char *const keys[] = {"offsets", "order", "counts", "dropped"};
    ml_tensor **outs[] = {&plan.offsets, &plan.order, &plan.counts, &plan.dropped};
    for (int i = 0; i < 4; i++) {
        *outs[i] = ml_pushtensor(L);
        lua_setfield(L, -2, keys[i]);   /* the table keeps it */
    }
    ml_err e;
    ml_host *h = ml_host_of(L);
    ml_check_op(L, fn, o.caps ? ml_op_dispatch_caps(h, &plan, idx, E, o.caps, o.pool, &e)
                              : ml_op_dispatch(h, &plan, idx, E, capacity, o.pool, &e), &e);
    ml_setfield_int(L, "ndropped", plan.ndropped);
    ml_setfield_int(L, "E", E);
    ml_setfield_int(L, "T", idx->shape[0]);
    ml_setfield_int(L, "k", idx->shape[1]);
    ml_setfield_int(L, "capacity", capacity);
    return 1;
}

/* ---- experts.pack, experts.unpack ------------------------------------------------- */

static int l_experts_pack(lua_State *L)
{
    static const char fn[] = "moelua.experts.pack";
    ml_args(L, 3, fn);
    lua_settop(L, 3);
    ml_tensor *src = arg(L, 1, fn, "src");
    int64_t k;
    ml_dispatch_plan plan = read_plan_rows(L, 2, fn, &k);
    ex_opts o;
    parse_opts(L, 3, fn, &o);
    ml_tensor *rows = ml_pushtensor(L);
    ml_err e;
    ml_check_op(L, fn, ml_op_dispatch_pack(ml_host_of(L), rows, src, &plan, k, o.pool, &e), &e);
    return 1;
}

static int l_experts_unpack(lua_State *L)
{
    static const char fn[] = "moelua.experts.unpack";
    ml_args(L, 3, fn);
    lua_settop(L, 3);
    ml_tensor *rows = arg(L, 1, fn, "rows");
    int64_t k;
    ml_dispatch_plan plan = read_plan_rows(L, 2, fn, &k);
    ml_tensor *out = arg(L, 3, fn, "out");
    ml_err e;
    ml_check_op(L, fn, ml_op_dispatch_unpack(ml_host_of(L), out, rows, &plan, k, NULL, &e), &e);
    lua_settop(L, 3);
    return 1;
}

/* ---- experts.forward ------------------------------------------------------------- */

static int l_experts_forward(lua_State *L)
{
    static const char fn[] = "moelua.experts.forward";
    ml_args(L, 7, fn);
    lua_settop(L, 7);
    ml_tensor *x = arg(L, 1, fn, "x");
    int tables = weight_tables(L, 2, fn);
    ml_tensor *gate_up = tables ? NULL : arg(L, 2, fn, "gate_up");
    ml_tensor *down = tables ? NULL : arg(L, 3, fn, "down");
    ml_tensor *idx = arg(L, 4, fn, "idx"), *w = arg(L, 5, fn, "w");
    ml_dispatch_plan plan = read_plan(L, 6, fn);
    ex_opts o;
    parse_opts(L, 7, fn, &o);
    ml_experts_cfg c = {.tile = o.tile, .nsaved = nsaved_of(ml_numel(idx), o.recompute),
                        .accumulate = o.has_out};

    /* 8: y, 9: saved, 10: saved.h, each given or new */
    if (o.has_out)
        lua_getfield(L, 7, "out");
    ml_tensor *y = o.has_out ? ml_checktensor_named(L, 8, fn, "option 'out'") : ml_pushtensor(L);
    ml_tensor *h;
    if (o.has_saved) {
        lua_getfield(L, 7, "saved");
        int64_t tile, nsaved;
        read_saved(L, 9, fn, "option 'saved'", &tile, &nsaved);
        if (o.has_tile && o.tile != tile)
            ml_error(L, fn, "option 'tile' = %lld differs from the forward's tile %lld "
                     "(saved.tile)", (long long)o.tile, (long long)tile);
        if (o.has_save && c.nsaved != nsaved)
            ml_error(L, fn, "options 'save' / 'partial_recompute' keep S = %lld positions but "
                     "saved.nsaved is %lld (the first call's)", (long long)c.nsaved,
                     (long long)nsaved);
        c.tile = tile;
        c.nsaved = nsaved;
        h = nsaved > 0 ? field_tensor(L, 9, "saved", "h", fn) : ml_pushtensor(L);
    } else {
        lua_createtable(L, 0, 4);
        h = ml_pushtensor(L);
    }
    ml_err e;
    ml_host *H = ml_host_of(L);
    if (tables) {
        int64_t E = experts_E(L, 6, &o, fn);
        ex_lists l = push_lists(L, E, fn);   /* 11 */
        ml_experts_table t = read_weight_tables(L, 2, x, E, &l, fn);
        ml_check_op(L, fn, ml_op_experts_forward_table(H, y, h, x, &t, idx, w, &plan, &c, o.pool,
                                                       &e), &e);
    } else {
        ml_check_op(L, fn, ml_op_experts_forward(H, y, h, x, gate_up, down, idx, w, &plan, &c,
                                                 o.pool, &e), &e);
    }
    if (!o.has_saved) {
        lua_settop(L, 10);
        if (c.nsaved > 0)
            lua_setfield(L, 9, "h");
        lua_settop(L, 9);
        ml_setfield_int(L, "tile", o.tile);   /* as asked; backward clamps it again */
        ml_setfield_int(L, "nsaved", c.nsaved);
        lua_pushnumber(L, o.recompute);
        lua_setfield(L, 9, "partial_recompute");
    }
    lua_settop(L, 9);
    return 2;
}

/* ---- experts.backward ------------------------------------------------------------ */

static const char *const GRADS[] = {"dx", "dgate_up", "ddown", "dw", "touched", NULL};

static int l_experts_backward(lua_State *L)
{
    static const char fn[] = "moelua.experts.backward";
    ml_args(L, 10, fn);
    lua_settop(L, 10);
    ml_tensor *dy = arg(L, 1, fn, "dy"), *x = arg(L, 2, fn, "x");
    int tables = weight_tables(L, 3, fn);
    ml_tensor *gate_up = tables ? NULL : arg(L, 3, fn, "gate_up");
    ml_tensor *down = tables ? NULL : arg(L, 4, fn, "down");
    ml_tensor *idx = arg(L, 5, fn, "idx"), *w = arg(L, 6, fn, "w");
    ml_dispatch_plan plan = read_plan(L, 7, fn);
    ex_opts o;
    parse_opts(L, 9, fn, &o);

    /* saved: tile and S from forward */
    int64_t tile, nsaved;
    read_saved(L, 8, fn, "argument #8 (saved)", &tile, &nsaved);
    if (o.has_tile && o.tile != tile)
        ml_error(L, fn, "option 'tile' = %lld differs from the forward's tile %lld (saved.tile)",
                 (long long)o.tile, (long long)tile);
    ml_experts_cfg c = {.tile = tile, .nsaved = nsaved, .accumulate = o.accumulate};
    const ml_tensor *h = nsaved > 0 ? field_tensor(L, 8, "saved", "h", fn) : NULL;   /* 11 */

    /* grads: supplied tensors, or empty ones the op allocates */
    int gi = 10;
    int has_grads = !lua_isnil(L, gi);
    if (has_grads) {
        if (!lua_istable(L, gi))
            ml_error(L, fn, "argument #10 (grads): expected a table, got %s", luaL_typename(L, gi));
        lua_pushnil(L);
        while (lua_next(L, gi)) {
            lua_pop(L, 1);
            const char *key = lua_type(L, -1) == LUA_TSTRING ? lua_tostring(L, -1) : NULL;
            int ok = 0;
            for (const char *const *g = GRADS; key && *g; g++)
                ok |= strcmp(key, *g) == 0;
            if (!ok)
                ml_error(L, fn, "argument #10 (grads): unknown key '%s' (expected dx, dgate_up, "
                         "ddown, dw, touched)", key ? key : luaL_typename(L, -1));
        }
    }
    ml_experts_table t;
    ml_experts_wgrads gw;
    if (tables) {   /* the weights' and their gradients' tables, before the five results */
        int64_t E = experts_E(L, 7, &o, fn);
        ex_lists l = push_lists(L, E, fn);
        t = read_weight_tables(L, 3, x, E, &l, fn);
        for (int i = 1; i <= 2; i++) {
            char what[32];
            snprintf(what, sizeof what, "grads.%s", GRADS[i]);
            if (!has_grads || lua_getfield(L, gi, GRADS[i]) != LUA_TTABLE)
                ml_error(L, fn, "%s: expected a table of per-expert gradient tensors (the weights "
                         "are per-expert tables)", what);
            read_experts(L, lua_gettop(L), fn, what, E, i == 1 ? l.dgate_up : l.ddown);
            lua_pop(L, 1);
        }
        ml_err e;
        ml_check_op(L, fn, ml_op_experts_tabulate_grads(&gw, l.gptrs, l.dgate_up, l.ddown, &t, &e),
                    &e);
    }
    ml_tensor *gt[5];
    for (int i = 0; i < 5; i++) {
        if (tables && (i == 1 || i == 2)) {   /* the tables read above, returned as they are */
            lua_getfield(L, gi, GRADS[i]);
            gt[i] = NULL;
            continue;
        }
        int given = has_grads && lua_getfield(L, gi, GRADS[i]) != LUA_TNIL;
        lua_pop(L, has_grads ? 1 : 0);
        gt[i] = given ? field_tensor(L, gi, "grads", GRADS[i], fn) : ml_pushtensor(L);
    }
    ml_experts_grads g = {gt[0], gt[1], gt[2], gt[3], gt[4]};
    ml_err e;
    ml_host *H = ml_host_of(L);
    ml_check_op(L, fn, tables ? ml_op_experts_backward_table(H, &g, &gw, dy, x, &t, idx, w, &plan,
                                                             h, &c, o.pool, &e)
                              : ml_op_experts_backward(H, &g, dy, x, gate_up, down, idx, w, &plan,
                                                       h, &c, o.pool, &e), &e);
    return 5;   /* dx, dgate_up, ddown, dw, touched */
}

static const luaL_Reg experts_functions[] = {
    {"dispatch", l_experts_dispatch},
    {"pack", l_experts_pack},
    {"unpack", l_experts_unpack},
    {"forward", l_experts_forward},
    {"backward", l_experts_backward},
    {NULL, NULL}
};

int luaopen_moelua_experts(lua_State *L)
{
    ml_host_of(L);  /* refuse to load outside the host */
    luaL_requiref(L, "moelua.tensor", luaopen_moelua_tensor, 0);
    lua_pop(L, 1);
    luaL_requiref(L, "moelua.pool", luaopen_moelua_pool, 0);   /* the Pool metatable */
    lua_pop(L, 1);
    luaL_newlib(L, experts_functions);
    return 1;
}
