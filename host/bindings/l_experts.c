/*
 * host/bindings/l_experts.c - the Lua library `moelua.experts`: token dispatch and
 * tiled SwiGLU experts with their combine, forward and backward
 * (kernels/dispatch.h, kernels/experts.h). Functional: the router lives in
 * moelua.router, the layer object is composed in Lua.
 *
 *   experts.dispatch(idx, E, opts) -> plan
 *       idx [T, k] int64 expert ids (0-based). plan = {offsets = [E+1] i64,
 *       order = [T·k] i64, counts = [E] i64 kept per expert, dropped = [T, k]
 *       u8, ndropped = n, E =, T =, k =, capacity = (-1: dropless)}
 *   experts.forward(x, gate_up, down, idx, w, plan, opts) -> y, saved
 *       x [T, D], gate_up [E, 2F, D], down [E, D, F], w [T, k] (one float
 *       dtype: f32 or f64); y [T, D]; saved = {tile =, nsaved = S, h = [S, 2F]
 *       (absent when S = 0)}
 *   experts.backward(dy, x, gate_up, down, idx, w, plan, saved, opts, grads)
 *       -> dx, dgate_up, ddown, dw, touched
 *       dx, dgate_up, ddown accumulate (+=) into grads.dx / grads.dgate_up /
 *       grads.ddown when given (else into new zeroed tensors); dw [T, k] and
 *       touched [E] u8 are overwritten (grads.dw / grads.touched when given).
 *
 * Options (one table shape for all three; each function reads what it needs):
 *   tile = 256            rows per expert GEMM tile (scratch is tile-sized)
 *   save = "save"         "save" keeps h [T·k, 2F] for backward,
 *                         "recompute" keeps nothing (h recomputed per tile)
 *   partial_recompute = f in [0, 1] (instead of save): keeps h for the first
 *                         floor((1-f)·T·k) dispatch positions, recomputes the
 *                         tiles beyond (kernels/experts.h)
 *   capacity = c          per-expert capacity (integer >= 0; needs policy "drop")
 *   policy = "dropless"   or "drop" (assignments over capacity, in (t, j) order,
 *                         are dropped and counted)
 *   pool = moelua.pool    outputs, saved h and scratch come from this pool
 *                         (scratch in a frame rewound before returning), so a
 *                         warmed-up forward+backward makes no ledger allocation
 * backward takes tile and S from `saved`; an opts.tile that differs is an error.
 *
 * Devices: every tensor (idx, x, weights, w, the plan, saved, grads) and the
 * pool on one device, cpu or cuda; the kernels are reached through the
 * kernel table (ML_KCALL) and new tensors are allocated on that device.
 *
 * Not here: routing, the layer object.
 */
#include "libs.h"
#include "l_util.h"
#include "../runtime/pool.h"
#include "../../kernels/dispatch.h"
#include "../../kernels/experts.h"

#include <math.h>
#include <string.h>

static const char *const OPTS[] = {"tile", "save", "partial_recompute", "capacity", "policy",
                                   "pool", NULL};

typedef struct {
    int64_t tile;
    int has_tile;
    ml_device dev;          /* the operands' device */
    double recompute;       /* fraction of positions recomputed: 0 save, 1 recompute */
    int64_t capacity;       /* -1: none given */
    int drop;
    int pool;               /* stack index of the pool, 0: none */
} ex_opts;

/* ---- options ----------------------------------------------------------------- */

static void parse_opts(lua_State *L, int idx, const char *fn, ml_device dev, ex_opts *o)
{
    memset(o, 0, sizeof *o);
    o->dev = dev;
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
    }
    lua_pop(L, 1);

    if (lua_getfield(L, idx, "capacity") != LUA_TNIL) {
        lua_Integer v = lua_tointegerx(L, -1, &isint);
        if (!isint || v < 0)
            ml_error(L, fn, "option 'capacity' must be an integer >= 0, got %s",
                     luaL_tolstring(L, -1, NULL));
        o->capacity = v;
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
    if (o->drop && o->capacity < 0)
        ml_error(L, fn, "option 'policy' = \"drop\" needs option 'capacity'");
    if (o->capacity >= 0 && !o->drop)
        ml_error(L, fn, "option 'capacity' needs policy = \"drop\"%s",
                 has_policy ? " (policy is \"dropless\")" : "");

    if (lua_getfield(L, idx, "pool") != LUA_TNIL) {
        o->pool = lua_gettop(L);   /* keep it on the stack (the table holds it anyway) */
        ml_device pd = ml_checkpool(L, o->pool, fn, "option 'pool'")->device;
        if (pd != dev)
            ml_error(L, fn, "option 'pool': a %s pool but the tensors are on %s (one device "
                     "expected)", ml_device_names[pd], ml_device_names[dev]);
    } else {
        lua_pop(L, 1);
    }
}

/* ---- argument checks ------------------------------------------------------------- */

/* dev < 0: any device (the first operand sets it for the others). */
static ml_tensor *check_arg(lua_State *L, int idx, const char *fn, const char *name, int dt,
                            int ndim, int dev)
{
    ml_tensor *t = ml_checkcontig(L, idx, fn, dt);
    if (dev >= 0 && t->st->device != (ml_device)dev)
        ml_error(L, fn, "argument #%d (%s): a %s tensor but the other operands are on %s (one "
                 "device expected)", idx, name, ml_device_names[t->st->device],
                 ml_device_names[dev]);
    if (t->ndim != ndim) {
        char s[96];
        ml_format_shape(t, s, sizeof s);
        ml_error(L, fn, "argument #%d (%s): expected %d dims, got %s", idx, name, ndim, s);
    }
    return t;
}

static void check_float(lua_State *L, int idx, const char *fn, const char *name, ml_tensor *t)
{
    if (t->dtype != ML_F32 && t->dtype != ML_F64)
        ml_error(L, fn, "argument #%d (%s): expected dtype f32 or f64, got %s", idx, name,
                 ml_dtype_names[t->dtype]);
}

/* "name [a,b] does not match ref [c,d]" */
static void shape_mismatch(lua_State *L, const char *fn, const char *what, const ml_tensor *a,
                           const char *an, const ml_tensor *b, const char *bn)
{
    char sa[96], sb[96];
    ml_format_shape(a, sa, sizeof sa);
    ml_format_shape(b, sb, sizeof sb);
    ml_error(L, fn, "%s: %s %s does not match %s %s", what, an, sa, bn, sb);
}

/* The tensor plan[key] (or saved[key], grads[key]): contiguous, on dev,
 * dtype dt, with the given shape. Left on the stack. NULL when absent and
 * optional. */
static ml_tensor *field_tensor(lua_State *L, int tbl, const char *tname, const char *key,
                               const char *fn, ml_device dev, ml_dtype dt, int ndim,
                               const int64_t *shape, int optional)
{
    int ty = lua_getfield(L, tbl, key);
    if (ty == LUA_TNIL && optional) {
        lua_pop(L, 1);
        return NULL;
    }
    char what[64], shape_what[66];
    snprintf(what, sizeof what, "%s.%s", tname, key);
    snprintf(shape_what, sizeof shape_what, "%s:", what);   /* "grads.dx: expected shape ..." */
    ml_tensor *t = ml_checktensor_named(L, -1, fn, what);
    if (t->st->device != dev)
        ml_error(L, fn, "%s.%s: a %s tensor but the other operands are on %s (one device "
                 "expected)", tname, key, ml_device_names[t->st->device], ml_device_names[dev]);
    if (t->dtype != dt)
        ml_error(L, fn, "%s.%s: expected dtype %s, got %s", tname, key, ml_dtype_names[dt],
                 ml_dtype_names[t->dtype]);
    if (!ml_is_contiguous(t))
        ml_error(L, fn, "%s.%s: expected a contiguous tensor", tname, key);
    ml_check_shape_eq(L, fn, shape_what, t, ndim, shape);
    return t;
}

/* The common arguments of forward and backward, checked against each other. */
typedef struct {
    ml_tensor *x, *gate_up, *down, *idx, *w;
    const int64_t *offsets, *order;
    ml_dtype dt;
    ml_device dev;
    ml_host *h;
    int64_t T, k, D, F, E;
} ex_args;

/* x, gate_up, down, idx, w at stack indices base..base+4, plan at base+5. */
static void check_common(lua_State *L, const char *fn, int base, ex_args *a)
{
    a->x = check_arg(L, base, fn, "x", -1, 2, -1);
    check_float(L, base, fn, "x", a->x);
    a->dt = a->x->dtype;
    a->dev = a->x->st->device;
    ml_check_device(L, fn, a->dev);
    a->h = ml_host_of(L);
    a->gate_up = check_arg(L, base + 1, fn, "gate_up", -1, 3, a->dev);
    a->down = check_arg(L, base + 2, fn, "down", -1, 3, a->dev);
    a->idx = check_arg(L, base + 3, fn, "idx", ML_I64, 2, a->dev);
    a->w = check_arg(L, base + 4, fn, "w", -1, 2, a->dev);
    const char *names[] = {"gate_up", "down", "w"};
    ml_tensor *ts[] = {a->gate_up, a->down, a->w};
    for (int i = 0; i < 3; i++)
        if (ts[i]->dtype != a->dt)
            ml_error(L, fn, "argument #%d (%s): dtype %s does not match x's %s",
                     base + (i == 2 ? 4 : i + 1), names[i], ml_dtype_names[ts[i]->dtype],
                     ml_dtype_names[a->dt]);
    a->T = a->x->shape[0];
    a->D = a->x->shape[1];
    a->E = a->gate_up->shape[0];
    a->F = a->gate_up->shape[1] / 2;
    a->k = a->idx->shape[1];
    if (a->gate_up->shape[2] != a->D || a->gate_up->shape[1] % 2 != 0)
        shape_mismatch(L, fn, "expected gate_up [E, 2F, D]", a->gate_up, "gate_up", a->x, "x [T, D]");
    if (a->E < 1 || a->F < 1)
        ml_error(L, fn, "argument #%d (gate_up): needs E >= 1 experts and F >= 1", base + 1);
    if (a->down->shape[0] != a->E || a->down->shape[1] != a->D || a->down->shape[2] != a->F)
        shape_mismatch(L, fn, "expected down [E, D, F]", a->down, "down", a->gate_up,
                       "gate_up [E, 2F, D]");
    if (a->idx->shape[0] != a->T)
        shape_mismatch(L, fn, "expected idx [T, k]", a->idx, "idx", a->x, "x [T, D]");
    if (a->k < 1)
        ml_error(L, fn, "argument #%d (idx): needs k >= 1 slots per token", base + 3);
    if (a->w->shape[0] != a->T || a->w->shape[1] != a->k)
        shape_mismatch(L, fn, "expected w [T, k]", a->w, "w", a->idx, "idx");

    int pl = base + 5;
    if (!lua_istable(L, pl))
        ml_error(L, fn, "argument #%d (plan): expected the table experts.dispatch returned, got %s",
                 pl, luaL_typename(L, pl));
    int64_t n = a->T * a->k, e1 = a->E + 1;
    ml_tensor *off = field_tensor(L, pl, "plan", "offsets", fn, a->dev, ML_I64, 1, &e1, 0);
    ml_tensor *ord = field_tensor(L, pl, "plan", "order", fn, a->dev, ML_I64, 1, &n, 0);
    lua_pop(L, 2);   /* the plan table keeps them alive */
    a->offsets = ml_data(off);
    a->order = ml_data(ord);
    int64_t bad = ML_KCHECK(a->h, a->dev, dispatch_check_plan, a->offsets, a->order, ml_data(a->idx), n, a->E);
    if (bad == ML_DISPATCH_EDEVICE)
        ml_check_status(L, fn, ML_EDEVICE);
    if (bad <= -2)
        ml_error(L, fn, "argument #%d (plan): offsets are not a plan for %lld assignments "
                 "(offsets[%lld] is out of order or range)", pl, (long long)n, (long long)(-2 - bad));
    if (bad >= 0)
        ml_error(L, fn, "argument #%d (plan): order[%lld] does not match idx (a plan from other "
                 "routing?)", pl, (long long)bad);
}

/* The tile the kernels run: refuse one whose scratch, tile·(2D + 4F)
 * elements, cannot be counted in int64; clamp to max(T·k, 1) rows (a tile
 * is never longer than the assignments). */
static int64_t run_tile(lua_State *L, const char *fn, const ex_args *a, int64_t tile)
{
    int64_t row = 2 * a->D + 4 * a->F;   /* D, F come from allocated tensors: no overflow */
    if (tile < 1 || tile > INT64_MAX / row)
        ml_error(L, fn, "option 'tile' = %lld is out of range (the scratch of tile·(2D + 4F) "
                 "elements must fit in int64: tile <= %lld)", (long long)tile,
                 (long long)(INT64_MAX / row));
    int64_t n = a->T * a->k;
    return tile < n ? tile : n > 1 ? n : 1;
}

/* Scratch bytes from the kernels' element count; -1 (overflow) raises. */
static size_t scratch_bytes(lua_State *L, const char *fn, int64_t ne, ml_dtype dt)
{
    size_t es = ml_dtype_size(dt);
    if (ne < 0 || (uint64_t)ne > SIZE_MAX / es)
        ml_error(L, fn, "option 'tile': the scratch size overflows int64");
    return (size_t)ne * es;
}

static int64_t nsaved_of(const ex_args *a, double recompute)
{
    int64_t n = a->T * a->k;
    int64_t s = (int64_t)floor((1.0 - recompute) * (double)n);
    return s < 0 ? 0 : s > n ? n : s;
}

/* ---- experts.dispatch ------------------------------------------------------------ */

static int l_experts_dispatch(lua_State *L)
{
    static const char fn[] = "moelua.experts.dispatch";
    ml_tensor *idx = check_arg(L, 1, fn, "idx", ML_I64, 2, -1);
    ml_device dev = idx->st->device;
    ml_check_device(L, fn, dev);
    ml_host *h = ml_host_of(L);
    int isint;
    lua_Integer E = lua_tointegerx(L, 2, &isint);
    if (!isint || E < 1)
        ml_error(L, fn, "argument #2 (E): expected an integer number of experts >= 1, got %s",
                 luaL_tolstring(L, 2, NULL));
    ex_opts o;
    parse_opts(L, 3, fn, dev, &o);
    int64_t T = idx->shape[0], k = idx->shape[1], n = T * k;
    int64_t bad = ML_KCHECK(h, dev, dispatch_find_bad, ml_data(idx), n, E);
    if (bad == ML_DISPATCH_EDEVICE)
        ml_check_status(L, fn, ML_EDEVICE);
    if (bad >= 0) {
        int64_t v;
        ml_check_status(L, fn, h->mem[dev]->memcpy(&v, (const int64_t *)ml_data(idx) + bad, sizeof v,
                                                   dev == ML_CPU ? ML_COPY_H2H : ML_COPY_D2H, NULL));
        ml_error(L, fn, "argument #1 (idx): expert id %lld at token %lld, slot %lld (0-based) is "
                 "outside [0, %lld)", (long long)v, (long long)(bad / k), (long long)(bad % k),
                 (long long)E);
    }

    lua_createtable(L, 0, 10);
    int res = lua_gettop(L);
    int64_t e1 = E + 1, shp[2] = {T, k};
    ml_tensor *off = ml_newbuf(L, fn, o.dev, o.pool, ML_I64, 1, &e1);
    lua_setfield(L, res, "offsets");
    ml_tensor *ord = ml_newbuf(L, fn, o.dev, o.pool, ML_I64, 1, &n);
    lua_setfield(L, res, "order");
    int64_t ee = E;
    ml_tensor *cnt = ml_newbuf(L, fn, o.dev, o.pool, ML_I64, 1, &ee);
    lua_setfield(L, res, "counts");
    ml_tensor *drp = ml_newbuf(L, fn, o.dev, o.pool, ML_U8, 2, shp);
    lua_setfield(L, res, "dropped");
    int64_t nd = 0;
    ml_kctx ctx = ml_kctx_of(ml_host_of(L));
    ml_status s = ML_KCALL(h, dev, dispatch, ml_data(off), ml_data(ord), ml_data(cnt), ml_data(drp), &nd,
                                  ml_data(idx), n, E, o.drop ? o.capacity : -1, &ctx);
    ml_check_status(L, fn, s);
    ml_setfield_int(L, "ndropped", nd);
    ml_setfield_int(L, "E", E);
    ml_setfield_int(L, "T", T);
    ml_setfield_int(L, "k", k);
    ml_setfield_int(L, "capacity", o.drop ? o.capacity : -1);
    return 1;
}

/* ---- experts.forward ------------------------------------------------------------- */

static int l_experts_forward(lua_State *L)
{
    static const char fn[] = "moelua.experts.forward";
    ex_args a;
    check_common(L, fn, 1, &a);
    ex_opts o;
    parse_opts(L, 7, fn, a.dev, &o);
    ml_experts_cfg c = {a.T, a.k, a.D, a.F, a.E, run_tile(L, fn, &a, o.tile),
                        nsaved_of(&a, o.recompute)};

    int64_t yshape[2] = {a.T, a.D}, hshape[2] = {c.nsaved, 2 * a.F};
    ml_tensor *y = ml_newbuf(L, fn, o.dev, o.pool, a.dt, 2, yshape);
    int yi = lua_gettop(L);
    lua_createtable(L, 0, 4);
    int si = lua_gettop(L);
    ml_setfield_int(L, "tile", o.tile);   /* as asked; backward clamps it again */
    ml_setfield_int(L, "nsaved", c.nsaved);
    lua_pushnumber(L, o.recompute);
    lua_setfield(L, si, "partial_recompute");
    void *h = NULL;
    if (c.nsaved > 0) {
        h = ml_data(ml_newbuf(L, fn, o.dev, o.pool, a.dt, 2, hshape));
        lua_setfield(L, si, "h");
    }
    ml_pool_scratch sc;
    size_t nb = scratch_bytes(L, fn, ml_experts_forward_scratch(&c), a.dt);
    void *buf = ml_pool_scratch_acquire(L, fn, "the experts scratch", o.dev, o.pool, nb, &sc);
    ml_kctx ctx = ml_kctx_of(ml_host_of(L));
    ml_status s = ML_KCALL(a.h, a.dev, experts_forward, a.dt, ml_data(y), h, buf, ml_data(a.x), ml_data(a.w),
                                         a.order, a.offsets, ml_data(a.gate_up), ml_data(a.down),
                                         &c, &ctx);
    ml_pool_scratch_release(&sc);
    lua_pop(L, 1);
    ml_check_status(L, fn, s);
    lua_pushvalue(L, yi);
    lua_pushvalue(L, si);
    return 2;
}

/* ---- experts.backward ------------------------------------------------------------ */

static const char *const GRADS[] = {"dx", "dgate_up", "ddown", "dw", "touched", NULL};

static int l_experts_backward(lua_State *L)
{
    static const char fn[] = "moelua.experts.backward";
    ex_args a;
    check_common(L, fn, 2, &a);
    ml_tensor *dy = check_arg(L, 1, fn, "dy", -1, 2, a.dev);
    if (dy->dtype != a.dt)
        ml_error(L, fn, "argument #1 (dy): dtype %s does not match x's %s",
                 ml_dtype_names[dy->dtype], ml_dtype_names[a.dt]);
    if (dy->shape[0] != a.T || dy->shape[1] != a.D)
        shape_mismatch(L, fn, "expected dy [T, D]", dy, "dy", a.x, "x");
    ex_opts o;
    parse_opts(L, 9, fn, a.dev, &o);

    /* saved: tile and S from forward */
    if (!lua_istable(L, 8))
        ml_error(L, fn, "argument #8 (saved): expected the table experts.forward returned, got %s",
                 luaL_typename(L, 8));
    lua_Integer tile, nsaved;
    int isint1, isint2;
    lua_getfield(L, 8, "tile");
    tile = lua_tointegerx(L, -1, &isint1);
    lua_getfield(L, 8, "nsaved");
    nsaved = lua_tointegerx(L, -1, &isint2);
    lua_pop(L, 2);
    if (!isint1 || tile < 1 || !isint2 || nsaved < 0 || nsaved > a.T * a.k)
        ml_error(L, fn, "argument #8 (saved): expected saved.tile >= 1 and saved.nsaved in "
                 "[0, T·k = %lld] (the table experts.forward returned)", (long long)(a.T * a.k));
    if (o.has_tile && o.tile != tile)
        ml_error(L, fn, "option 'tile' = %lld differs from the forward's tile %lld (saved.tile)",
                 (long long)o.tile, (long long)tile);
    ml_experts_cfg c = {a.T, a.k, a.D, a.F, a.E, run_tile(L, fn, &a, tile), nsaved};
    int64_t hshape[2] = {nsaved, 2 * a.F};
    const void *h = NULL;
    ml_tensor *ht = NULL;
    if (nsaved > 0) {
        ht = field_tensor(L, 8, "saved", "h", fn, a.dev, a.dt, 2, hshape, 0);
        h = ml_data(ht);
        lua_pop(L, 1);
    }

    /* grads: supplied tensors, or new ones */
    int gi = 10;
    int has_grads = !lua_isnoneornil(L, gi);
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
    int64_t shapes[5][3] = {{a.T, a.D}, {a.E, 2 * a.F, a.D}, {a.E, a.D, a.F}, {a.T, a.k}, {a.E}};
    int ndims[5] = {2, 3, 3, 2, 1};
    ml_dtype dts[5] = {a.dt, a.dt, a.dt, a.dt, ML_U8};
    int zero[5] = {1, 1, 1, 0, 0};
    void *out[5];
    ml_tensor *gt[5];   /* the supplied grads, NULL where new */
    int first = lua_gettop(L) + 1;
    for (int i = 0; i < 5; i++) {
        ml_tensor *t = has_grads ? field_tensor(L, gi, "grads", GRADS[i], fn, a.dev, dts[i],
                                                ndims[i], shapes[i], 1)
                                 : NULL;
        if (t) {
            /* an output the kernel zeroes or writes while it reads the inputs */
            const ml_tensor *ins[] = {dy, a.x, a.gate_up, a.down, a.idx, a.w, ht};
            const char *inn[] = {"argument #1 (dy)", "argument #2 (x)", "argument #3 (gate_up)",
                                 "argument #4 (down)", "argument #5 (idx)", "argument #6 (w)",
                                 "saved.h"};
            for (int j = 0; j < 7; j++)
                if (ins[j] && ml_overlaps(t, ins[j]))
                    ml_error(L, fn, "grads.%s shares storage with %s (outputs must not alias "
                             "inputs)", GRADS[i], inn[j]);
            for (int j = 0; j < i; j++)
                if (gt[j] && ml_overlaps(t, gt[j]))
                    ml_error(L, fn, "grads.%s shares storage with grads.%s", GRADS[i], GRADS[j]);
        }
        gt[i] = t;
        if (!t)
            t = (zero[i] ? ml_newzeros : ml_newbuf)(L, fn, o.dev, o.pool, dts[i], ndims[i],
                                                    shapes[i]);
        out[i] = ml_data(t);
    }
    ml_pool_scratch sc;
    size_t nb = scratch_bytes(L, fn, ml_experts_backward_scratch(&c), a.dt);
    void *buf = ml_pool_scratch_acquire(L, fn, "the experts scratch", o.dev, o.pool, nb, &sc);
    ml_kctx ctx = ml_kctx_of(ml_host_of(L));
    ml_status s = ML_KCALL(a.h, a.dev, experts_backward, a.dt, out[0], out[1], out[2], out[3], out[4], buf, h,
                                          ml_data(dy), ml_data(a.x), ml_data(a.w), a.order,
                                          a.offsets, ml_data(a.gate_up), ml_data(a.down), &c, &ctx);
    ml_pool_scratch_release(&sc);
    lua_pop(L, 1);
    ml_check_status(L, fn, s);
    return lua_gettop(L) - first + 1;   /* dx, dgate_up, ddown, dw, touched */
}

static const luaL_Reg experts_functions[] = {
    {"dispatch", l_experts_dispatch},
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
