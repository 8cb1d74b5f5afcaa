/*
 * host/bindings/l_ops.c - the Lua library `moelua.ops`: functional forward/backward
 * of the model's kernel families (kernels/rmsnorm.h, embedding.h,
 * crossentropy.h, rope.h, attention.h have the semantics). Every function
 * takes and returns moelua tensors (CPU, contiguous, f32 or f64, one dtype
 * per call); every argument is checked and a mismatch is an error naming
 * the function and the argument.
 *
 *   rmsnorm_forward(x [..., D], w [D] [, eps = 1e-6])    -> y, rstd [N] f64
 *   rmsnorm_backward(dy, x, w, rstd [, dw])              -> dx (=), dw (+=)
 *   embedding_forward(ids [T] i64, W [V, D])             -> out [T, D]
 *   embedding_backward(dout [T, D], ids, dW [V, D] | V)  -> dW (+=; V: new zeros)
 *   cross_entropy_forward(h [S, D], W [V, D], targets [S] i64 [, opts])
 *                                                        -> loss (number), lse [S] f64
 *   cross_entropy_backward(dloss, h, W, targets, lse [, opts])
 *                                                        -> dh (=), dW (+= opts.dW or new)
 *       opts: rows (default 256, <= 1024), chunk (vocabulary columns, default 4096), dW
 *   rope_forward(x [S, heads, hd] [, opts])              -> y
 *   rope_backward(dy [S, heads, hd] [, opts])            -> dx
 *       opts: theta (default 10000), offset (position of row 1, default 0)
 *   attention_forward(q [S, H, hd], k [S, KV, hd], v)    -> out [S, H, hd], lse [H, S] f64
 *   attention_backward(dout, q, k, v, out, lse)          -> dq, dk, dv
 *
 * Not here: modules, parameters (lua/moelua/nn), CUDA (CPU tensors only
 * until the .cu twins exist).
 */
#include "libs.h"
#include "l_tensor.h"
#include "../runtime/ops_nn.h"
#include "../../kernels/attention.h"
#include "../../kernels/crossentropy.h"
#include "../../kernels/embedding.h"
#include "../../kernels/rmsnorm.h"
#include "../../kernels/rope.h"

#include <math.h>
#include <string.h>

/* Argument idx (named `name`): a live, contiguous CPU tensor with ndim dims
 * (ndim < 0: any >= 1) of dtype dt (dt < 0: f32 or f64). */
static ml_tensor *arg_tensor(lua_State *L, int idx, const char *fn, const char *name, int dt,
                             int ndim)
{
    char what[64];
    snprintf(what, sizeof what, "argument #%d (%s)", idx, name);
    ml_tensor *t = ml_checktensor_named(L, idx, fn, what);
    if (t->st->device != ML_CPU)
        ml_error(L, fn, "argument #%d (%s) is on %s; moelua.ops runs on cpu", idx, name,
                 ml_device_names[t->st->device]);
    if (dt < 0 ? t->dtype != ML_F32 && t->dtype != ML_F64 : t->dtype != (ml_dtype)dt)
        ml_error(L, fn, "argument #%d (%s) must be %s, got %s", idx, name,
                 dt < 0 ? "f32 or f64" : ml_dtype_names[dt], ml_dtype_names[t->dtype]);
    if (ndim >= 0 && t->ndim != ndim)
        ml_error(L, fn, "argument #%d (%s) must have %d dims, got %d", idx, name, ndim, t->ndim);
    if (ndim < 0 && t->ndim < 1)
        ml_error(L, fn, "argument #%d (%s) must have at least 1 dim, got 0", idx, name);
    if (!ml_is_contiguous(t))
        ml_error(L, fn, "argument #%d (%s) must be contiguous (call :contiguous())", idx, name);
    return t;
}

static void same_dtype(lua_State *L, const char *fn, const char *name, const ml_tensor *t,
                       const char *ref, ml_dtype dt)
{
    if (t->dtype != dt)
        ml_error(L, fn, "%s is %s but %s is %s (same dtype expected)", name,
                 ml_dtype_names[t->dtype], ref, ml_dtype_names[dt]);
}

/* Every entry of ids [n] i64 in [0, hi). */
static void check_ids(lua_State *L, const char *fn, const char *name, const ml_tensor *ids,
                      int64_t hi)
{
    const int64_t *p = ml_data(ids);
    int64_t n = ml_numel(ids);
    for (int64_t i = 0; i < n; i++)
        if (p[i] < 0 || p[i] >= hi)
            ml_error(L, fn, "%s[%lld] = %lld is out of range [0, %lld)", name, (long long)(i + 1),
                     (long long)p[i], (long long)hi);
}

/* Free a scratch tensor now (never raises). */
static void drop(ml_tensor *t)
{
    if (t && t->st) {
        ml_storage_release(t->st);
        t->st = NULL;
    }
}

static int opts_table(lua_State *L, int idx, const char *fn, const char *const *allowed)
{
    if (lua_isnoneornil(L, idx))
        return 0;
    if (!lua_istable(L, idx))
        ml_error(L, fn, "argument #%d: expected an options table, got %s", idx, luaL_typename(L, idx));
    ml_check_opts(L, idx, fn, allowed);
    return idx;
}

static ml_kctx kctx(lua_State *L) { return ml_kctx_of(ml_host_of(L)); }

/* ---- rmsnorm ------------------------------------------------------------------ */

static int l_ops_rmsnorm_forward(lua_State *L)
{
    static const char fn[] = "moelua.ops.rmsnorm_forward";
    lua_settop(L, 3);
    ml_tensor *x = ml_checktensor_named(L, 1, fn, "argument #1 (x)");
    ml_tensor *w = ml_checktensor_named(L, 2, fn, "argument #2 (w)");
    double eps = 1e-6;
    if (!lua_isnoneornil(L, 3)) {
        if (lua_type(L, 3) != LUA_TNUMBER)
            ml_error(L, fn, "argument #3 (eps) must be a number, got %s", luaL_typename(L, 3));
        eps = lua_tonumber(L, 3);
    }
    ml_tensor *y = ml_pushtensor(L);
    ml_tensor *rstd = ml_pushtensor(L);
    ml_err e;
    ml_check_op(L, fn, ml_op_rmsnorm_forward(ml_host_of(L), y, rstd, x, w, eps, &e), &e);
    return 2;
}

static int l_ops_rmsnorm_backward(lua_State *L)
{
    static const char fn[] = "moelua.ops.rmsnorm_backward";
    lua_settop(L, 5);
    ml_tensor *dy = ml_checktensor_named(L, 1, fn, "argument #1 (dy)");
    ml_tensor *x = ml_checktensor_named(L, 2, fn, "argument #2 (x)");
    ml_tensor *w = ml_checktensor_named(L, 3, fn, "argument #3 (w)");
    ml_tensor *rstd = ml_checktensor_named(L, 4, fn, "argument #4 (rstd)");
    ml_tensor *dw = lua_isnil(L, 5) ? ml_pushtensor(L) : ml_checktensor_named(L, 5, fn, "argument #5 (dw)");
    if (lua_gettop(L) > 5)
        lua_replace(L, 5);
    ml_tensor *dx = ml_pushtensor(L);
    ml_err e;
    ml_check_op(L, fn, ml_op_rmsnorm_backward(ml_host_of(L), dx, dw, dy, x, w, rstd, &e), &e);
    lua_pushvalue(L, 5);
    return 2;
}

/* ---- embedding ---------------------------------------------------------------- */

static int l_ops_embedding_forward(lua_State *L)
{
    static const char fn[] = "moelua.ops.embedding_forward";
    lua_settop(L, 2);
    ml_tensor *ids = arg_tensor(L, 1, fn, "ids", ML_I64, 1);
    ml_tensor *W = arg_tensor(L, 2, fn, "W", -1, 2);
    int64_t T = ids->shape[0], V = W->shape[0], D = W->shape[1];
    check_ids(L, fn, "ids", ids, V);
    int64_t so[2] = {T, D};
    ml_tensor *out = ml_newtensor(L, fn, ML_CPU, W->dtype, 2, so);
    ml_kctx c = kctx(L);
    ml_check_status(L, fn, ML_KCALL(ml_host_of(L), ML_CPU, embedding_forward, 
        W->dtype, ml_data(out), ml_data(ids), ml_data(W), T, V, D, &c));
    return 1;
}

static int l_ops_embedding_backward(lua_State *L)
{
    static const char fn[] = "moelua.ops.embedding_backward";
    lua_settop(L, 3);
    ml_tensor *dout = arg_tensor(L, 1, fn, "dout", -1, 2);
    ml_tensor *ids = arg_tensor(L, 2, fn, "ids", ML_I64, 1);
    int64_t T = ids->shape[0], D = dout->shape[1], V;
    int64_t sd[2] = {T, D};
    ml_check_shape_eq(L, fn, "dout", dout, 2, sd);
    ml_tensor *dW;
    if (lua_type(L, 3) == LUA_TNUMBER) {
        int isint = 0;
        V = lua_tointegerx(L, 3, &isint);
        if (!isint || V < 1)
            ml_error(L, fn, "argument #3 (V) must be a positive integer");
        int64_t sw[2] = {V, D};
        dW = ml_newzeros(L, fn, ML_CPU, 0, dout->dtype, 2, sw);
        lua_replace(L, 3);
    } else {
        if (!ml_testtensor(L, 3))
            ml_error(L, fn, "argument #3 (dW): expected a tensor or a vocabulary size, got %s",
                     luaL_typename(L, 3));
        dW = arg_tensor(L, 3, fn, "dW", -1, 2);
        same_dtype(L, fn, "dW", dW, "dout", dout->dtype);
        V = dW->shape[0];
        int64_t sw[2] = {V, D};
        ml_check_shape_eq(L, fn, "dW", dW, 2, sw);
    }
    check_ids(L, fn, "ids", ids, V);
    ml_kctx c = kctx(L);
    ml_check_status(L, fn, ML_KCALL(ml_host_of(L), ML_CPU, embedding_backward, 
        dout->dtype, ml_data(dW), ml_data(dout), ml_data(ids), T, V, D, &c));
    lua_pushvalue(L, 3);
    return 1;
}

/* ---- cross-entropy ------------------------------------------------------------ */

static const char *const CE_OPTS[] = {"rows", "chunk", "dW", NULL};

/* h [S, D], W [V, D], targets [S] at a, a+1, a+2; opts at oi. */
static void ce_args(lua_State *L, const char *fn, int a, ml_tensor **h, ml_tensor **W,
                    ml_tensor **tg, int oi, int64_t *rows, int64_t *chunk)
{
    *h = arg_tensor(L, a, fn, "h", -1, 2);
    *W = arg_tensor(L, a + 1, fn, "W", -1, 2);
    *tg = arg_tensor(L, a + 2, fn, "targets", ML_I64, 1);
    same_dtype(L, fn, "W", *W, "h", (*h)->dtype);
    int64_t S = (*h)->shape[0], D = (*h)->shape[1], V = (*W)->shape[0];
    int64_t sw[2] = {V, D};
    ml_check_shape_eq(L, fn, "W", *W, 2, sw);
    ml_check_shape_eq(L, fn, "targets", *tg, 1, &S);
    if (V < 1)
        ml_error(L, fn, "W is empty: at least one vocabulary row expected");
    if (D < 1)
        ml_error(L, fn, "h has no columns: the hidden size must be >= 1");
    check_ids(L, fn, "targets", *tg, V);
    *rows = ml_opt_integer(L, oi, fn, "rows", 256, 1, ML_CE_MAX_ROWS);
    *chunk = ml_opt_integer(L, oi, fn, "chunk", 4096, 1, INT64_MAX);
}

static int l_ops_cross_entropy_forward(lua_State *L)
{
    static const char fn[] = "moelua.ops.cross_entropy_forward";
    lua_settop(L, 4);
    int oi = opts_table(L, 4, fn, CE_OPTS);
    ml_tensor *h, *W, *tg;
    int64_t rows, chunk;
    ce_args(L, fn, 1, &h, &W, &tg, oi, &rows, &chunk);
    if (oi && lua_getfield(L, oi, "dW") != LUA_TNIL)
        ml_error(L, fn, "option 'dW' belongs to cross_entropy_backward");
    lua_settop(L, 4);
    int64_t S = h->shape[0], D = h->shape[1], V = W->shape[0];
    ml_tensor *lse = ml_newtensor(L, fn, ML_CPU, ML_F64, 1, &S);
    int ilse = lua_gettop(L);
    int64_t ne = ml_ce_scratch_elems(S, V, rows, chunk);
    ml_tensor *scr = ml_newtensor(L, fn, ML_CPU, h->dtype, 1, &ne);
    double loss = 0;
    ml_kctx c = kctx(L);
    ml_status st = ML_KCALL(ml_host_of(L), ML_CPU, ce_forward, 
        h->dtype, &loss, ml_data(lse), ml_data(h), ml_data(W), ml_data(tg), S, V, D, rows, chunk,
        ml_data(scr), &c);
    drop(scr);
    if (st == ML_ENAN)
        ml_error(L, fn, "NaN in the logits");
    ml_check_status(L, fn, st);
    lua_pushnumber(L, loss);
    lua_pushvalue(L, ilse);
    return 2;
}

static int l_ops_cross_entropy_backward(lua_State *L)
{
    static const char fn[] = "moelua.ops.cross_entropy_backward";
    lua_settop(L, 6);
    if (lua_type(L, 1) != LUA_TNUMBER)
        ml_error(L, fn, "argument #1 (dloss) must be a number, got %s", luaL_typename(L, 1));
    double dloss = lua_tonumber(L, 1);
    if (!isfinite(dloss))
        ml_error(L, fn, "argument #1 (dloss) must be finite, got %g", dloss);
    int oi = opts_table(L, 6, fn, CE_OPTS);
    ml_tensor *h, *W, *tg;
    int64_t rows, chunk;
    ce_args(L, fn, 2, &h, &W, &tg, oi, &rows, &chunk);
    int64_t S = h->shape[0], D = h->shape[1], V = W->shape[0];
    ml_tensor *lse = arg_tensor(L, 5, fn, "lse", ML_F64, 1);
    ml_check_shape_eq(L, fn, "lse", lse, 1, &S);
    int64_t sw[2] = {V, D};
    ml_tensor *dW;
    if (oi && lua_getfield(L, oi, "dW") != LUA_TNIL) {
        dW = arg_tensor(L, lua_gettop(L), fn, "dW", -1, 2);
        same_dtype(L, fn, "option 'dW'", dW, "h", h->dtype);
        ml_check_shape_eq(L, fn, "option 'dW'", dW, 2, sw);
    } else {
        if (oi)
            lua_pop(L, 1);
        dW = ml_newzeros(L, fn, ML_CPU, 0, h->dtype, 2, sw);
    }
    int idw = lua_gettop(L);
    ml_tensor *dh = ml_newtensor(L, fn, ML_CPU, h->dtype, 2, h->shape);
    int64_t ne = ml_ce_scratch_elems(S, V, rows, chunk);
    ml_tensor *scr = ml_newtensor(L, fn, ML_CPU, h->dtype, 1, &ne);
    ml_kctx c = kctx(L);
    ml_status st = ML_KCALL(ml_host_of(L), ML_CPU, ce_backward, 
        h->dtype, ml_data(dh), ml_data(dW), dloss, ml_data(h), ml_data(W), ml_data(tg),
        ml_data(lse), S, V, D, rows, chunk, ml_data(scr), &c);
    drop(scr);
    ml_check_status(L, fn, st);
    lua_pushvalue(L, idw + 1);
    lua_pushvalue(L, idw);
    return 2;
}

/* ---- rope --------------------------------------------------------------------- */

static const char *const ROPE_OPTS[] = {"theta", "offset", NULL};

static int rope_common(lua_State *L, const char *fn, const char *name, int inverse)
{
    lua_settop(L, 2);
    ml_tensor *x = arg_tensor(L, 1, fn, name, -1, 3);
    int oi = opts_table(L, 2, fn, ROPE_OPTS);
    double theta = ml_opt_number(L, oi, fn, "theta", 10000.0);
    if (!(theta > 1))
        ml_error(L, fn, "option 'theta' must be > 1, got %g", theta);
    int64_t offset = ml_opt_integer(L, oi, fn, "offset", 0, 0, (int64_t)1 << 52);
    int64_t S = x->shape[0], heads = x->shape[1], hd = x->shape[2];
    if (hd < 2 || hd % 2)
        ml_error(L, fn, "argument #1 (%s): head dim %lld must be even and >= 2", name, (long long)hd);
    ml_tensor *y = ml_newtensor(L, fn, ML_CPU, x->dtype, 3, x->shape);
    ml_kctx c = kctx(L);
    ml_host *h = ml_host_of(L);
    ml_status st = inverse
        ? ML_KCALL(h, ML_CPU, rope_backward, x->dtype, ml_data(y), ml_data(x), S, heads, hd, offset, theta, &c)
        : ML_KCALL(h, ML_CPU, rope_forward, x->dtype, ml_data(y), ml_data(x), S, heads, hd, offset, theta, &c);
    ml_check_status(L, fn, st);
    return 1;
}

static int l_ops_rope_forward(lua_State *L)
{
    return rope_common(L, "moelua.ops.rope_forward", "x", 0);
}

static int l_ops_rope_backward(lua_State *L)
{
    return rope_common(L, "moelua.ops.rope_backward", "dy", 1);
}

/* ---- attention ---------------------------------------------------------------- */

/* q [S, H, hd], k, v [S, KV, hd] at a, a+1, a+2 */
static void qkv_args(lua_State *L, const char *fn, int a, ml_tensor **q, ml_tensor **k,
                     ml_tensor **v)
{
    *q = arg_tensor(L, a, fn, "q", -1, 3);
    *k = arg_tensor(L, a + 1, fn, "k", -1, 3);
    *v = arg_tensor(L, a + 2, fn, "v", -1, 3);
    same_dtype(L, fn, "k", *k, "q", (*q)->dtype);
    same_dtype(L, fn, "v", *v, "q", (*q)->dtype);
    int64_t S = (*q)->shape[0], H = (*q)->shape[1], hd = (*q)->shape[2], KV = (*k)->shape[1];
    int64_t sk[3] = {S, KV, hd};
    ml_check_shape_eq(L, fn, "k", *k, 3, sk);
    ml_check_shape_eq(L, fn, "v", *v, 3, sk);
    if (KV < 1 || H % KV)
        ml_error(L, fn, "q has %lld heads, not a multiple of k's %lld kv heads", (long long)H,
                 (long long)KV);
    if (hd < 1 || hd > ML_ATT_HD_MAX)
        ml_error(L, fn, "head dim %lld must be in [1, %d]", (long long)hd, ML_ATT_HD_MAX);
}

static int l_ops_attention_forward(lua_State *L)
{
    static const char fn[] = "moelua.ops.attention_forward";
    lua_settop(L, 3);
    ml_tensor *q, *k, *v;
    qkv_args(L, fn, 1, &q, &k, &v);
    int64_t S = q->shape[0], H = q->shape[1], hd = q->shape[2], KV = k->shape[1];
    ml_tensor *out = ml_newtensor(L, fn, ML_CPU, q->dtype, 3, q->shape);
    int64_t sl[2] = {H, S};
    ml_tensor *lse = ml_newtensor(L, fn, ML_CPU, ML_F64, 2, sl);
    ml_kctx c = kctx(L);
    int64_t ns = (int64_t)(ml_attention_scratch_bytes(hd, c.nthreads) / sizeof(double));
    ml_tensor *scr = ml_newtensor(L, fn, ML_CPU, ML_F64, 1, &ns);
    ml_status st = ML_KCALL(ml_host_of(L), ML_CPU, attention_forward, 
        q->dtype, ml_data(out), ml_data(lse), ml_data(q), ml_data(k), ml_data(v), S, H, KV, hd,
        ml_data(scr), &c);
    drop(scr);
    lua_pop(L, 1);
    ml_check_status(L, fn, st);
    return 2;
}

static int l_ops_attention_backward(lua_State *L)
{
    static const char fn[] = "moelua.ops.attention_backward";
    lua_settop(L, 6);
    ml_tensor *q, *k, *v;
    qkv_args(L, fn, 2, &q, &k, &v);
    int64_t S = q->shape[0], H = q->shape[1], hd = q->shape[2], KV = k->shape[1];
    ml_tensor *dout = arg_tensor(L, 1, fn, "dout", -1, 3);
    ml_tensor *out = arg_tensor(L, 5, fn, "out", -1, 3);
    ml_tensor *lse = arg_tensor(L, 6, fn, "lse", ML_F64, 2);
    same_dtype(L, fn, "dout", dout, "q", q->dtype);
    same_dtype(L, fn, "out", out, "q", q->dtype);
    ml_check_shape_eq(L, fn, "dout", dout, 3, q->shape);
    ml_check_shape_eq(L, fn, "out", out, 3, q->shape);
    int64_t sl[2] = {H, S};
    ml_check_shape_eq(L, fn, "lse", lse, 2, sl);
    ml_tensor *dq = ml_newtensor(L, fn, ML_CPU, q->dtype, 3, q->shape);
    ml_tensor *dk = ml_newtensor(L, fn, ML_CPU, q->dtype, 3, k->shape);
    ml_tensor *dv = ml_newtensor(L, fn, ML_CPU, q->dtype, 3, v->shape);
    ml_tensor *drow = ml_newtensor(L, fn, ML_CPU, ML_F64, 2, sl);
    ml_kctx c = kctx(L);
    int64_t ns = (int64_t)(ml_attention_scratch_bytes(hd, c.nthreads) / sizeof(double));
    ml_tensor *scr = ml_newtensor(L, fn, ML_CPU, ML_F64, 1, &ns);
    ml_status st = ML_KCALL(ml_host_of(L), ML_CPU, attention_backward, 
        q->dtype, ml_data(dq), ml_data(dk), ml_data(dv), ml_data(drow), ml_data(dout), ml_data(q),
        ml_data(k), ml_data(v), ml_data(out), ml_data(lse), S, H, KV, hd, ml_data(scr), &c);
    drop(scr);
    drop(drow);
    lua_pop(L, 2);
    ml_check_status(L, fn, st);
    return 3;
}

static const luaL_Reg ops_funcs[] = {
    {"rmsnorm_forward", l_ops_rmsnorm_forward},
    {"rmsnorm_backward", l_ops_rmsnorm_backward},
    {"embedding_forward", l_ops_embedding_forward},
    {"embedding_backward", l_ops_embedding_backward},
    {"cross_entropy_forward", l_ops_cross_entropy_forward},
    {"cross_entropy_backward", l_ops_cross_entropy_backward},
    {"rope_forward", l_ops_rope_forward},
    {"rope_backward", l_ops_rope_backward},
    {"attention_forward", l_ops_attention_forward},
    {"attention_backward", l_ops_attention_backward},
    {NULL, NULL}
};

int luaopen_moelua_ops(lua_State *L)
{
    luaL_newlib(L, ops_funcs);
    return 1;
}
