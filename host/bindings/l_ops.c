/*
 * host/bindings/l_ops.c - the Lua library `moelua.ops`: functional forward/backward
 * of the model's kernel families (kernels/rmsnorm.h, embedding.h,
 * crossentropy.h, rope.h, attention.h have the semantics). Every function
 * takes and returns moelua tensors (contiguous, f32 or f64, one dtype and
 * one device per call: the first tensor's). Each binding converts the Lua
 * values and the options table and calls its op (host/runtime/ops_nn.h),
 * which checks the tensors; a mismatch is an error naming the function and
 * the argument.
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
 *       opts: theta (default 10000), offset (position of row 1, default 0),
 *       out (the result's tensor, = x's shape and dtype; x itself: in place)
 *   attention_forward(q [S, H, hd], k [Sk, KV, hd], v)   -> out [S, H, hd], lse [H, S] f64
 *       Sk >= S: q holds the last S of Sk positions (decoding against a KV cache)
 *   attention_backward(dout, q, k, v, out, lse)          -> dq, dk, dv (Sk = S)
 *
 * A device runs a function in the dtypes its kernel table supports for the
 * family (CUDA adds bf16 to all but cross-entropy).
 *
 * Not here: the checks and the kernel calls (host/runtime/ops_nn.c),
 * modules, parameters (lua/moelua/nn).
 */
#include "libs.h"
#include "l_util.h"
#include "../runtime/ops_nn.h"

/* An output given as option `name` of the options table at idx, the last
 * argument (then at idx + 1), else a new tensor pushed there. */
static ml_tensor *opt_output(lua_State *L, int idx, const char *fn, const char *name, const char *what)
{
    if (lua_istable(L, idx) && lua_getfield(L, idx, name) != LUA_TNIL)
        return ml_checktensor_named(L, idx + 1, fn, what);
    lua_settop(L, idx);
    return ml_pushtensor(L);
}

/* ---- rmsnorm ------------------------------------------------------------------ */

static int l_ops_rmsnorm_forward(lua_State *L)
{
    static const char fn[] = "moelua.ops.rmsnorm_forward";
    ml_args(L, 3, fn);
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
    ml_args(L, 5, fn);
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
    ml_args(L, 2, fn);
    lua_settop(L, 2);
    ml_tensor *ids = ml_checktensor_named(L, 1, fn, "argument #1 (ids)");
    ml_tensor *W = ml_checktensor_named(L, 2, fn, "argument #2 (W)");
    ml_tensor *out = ml_pushtensor(L);
    ml_err e;
    ml_check_op(L, fn, ml_op_embedding_forward(ml_host_of(L), out, ids, W, &e), &e);
    return 1;
}

static int l_ops_embedding_backward(lua_State *L)
{
    static const char fn[] = "moelua.ops.embedding_backward";
    ml_args(L, 3, fn);
    lua_settop(L, 3);
    ml_tensor *dout = ml_checktensor_named(L, 1, fn, "argument #1 (dout)");
    ml_tensor *ids = ml_checktensor_named(L, 2, fn, "argument #2 (ids)");
    ml_tensor *dW;
    int64_t V = 0;
    if (lua_type(L, 3) == LUA_TNUMBER) {
        int isint = 0;
        V = lua_tointegerx(L, 3, &isint);
        if (!isint)
            ml_error(L, fn, "argument #3 (V) must be a positive integer");
        dW = ml_pushtensor(L);
        lua_replace(L, 3);
    } else {
        if (!ml_testtensor(L, 3))
            ml_error(L, fn, "argument #3 (dW): expected a tensor or a vocabulary size, got %s",
                     luaL_typename(L, 3));
        dW = ml_checktensor_named(L, 3, fn, "argument #3 (dW)");
    }
    ml_err e;
    ml_check_op(L, fn, ml_op_embedding_backward(ml_host_of(L), dW, dout, ids, V, &e), &e);
    return 1;
}

/* ---- cross-entropy ------------------------------------------------------------ */

static const char *const CE_OPTS[] = {"rows", "chunk", "dW", NULL};

/* rows and chunk from the options table at oi (nil: the defaults). */
static void ce_opts(lua_State *L, const char *fn, int oi, int64_t *rows, int64_t *chunk)
{
    ml_check_opts(L, oi, fn, CE_OPTS);
    *rows = ml_opt_integer(L, oi, fn, "rows", 256, 1, ML_CE_MAX_ROWS);
    *chunk = ml_opt_integer(L, oi, fn, "chunk", 4096, 1, INT64_MAX);
}

static int l_ops_cross_entropy_forward(lua_State *L)
{
    static const char fn[] = "moelua.ops.cross_entropy_forward";
    ml_args(L, 4, fn);
    lua_settop(L, 4);
    ml_tensor *hs = ml_checktensor_named(L, 1, fn, "argument #1 (h)");
    ml_tensor *W = ml_checktensor_named(L, 2, fn, "argument #2 (W)");
    ml_tensor *tg = ml_checktensor_named(L, 3, fn, "argument #3 (targets)");
    int64_t rows, chunk;
    ce_opts(L, fn, 4, &rows, &chunk);
    if (lua_istable(L, 4) && lua_getfield(L, 4, "dW") != LUA_TNIL)
        ml_error(L, fn, "option 'dW' belongs to cross_entropy_backward");
    lua_settop(L, 4);
    ml_tensor *lse = ml_pushtensor(L);
    double loss;
    ml_err e;
    ml_check_op(L, fn, ml_op_cross_entropy_forward(ml_host_of(L), &loss, lse, hs, W, tg, rows,
                                                   chunk, &e), &e);
    lua_pushnumber(L, loss);
    lua_insert(L, -2);
    return 2;
}

static int l_ops_cross_entropy_backward(lua_State *L)
{
    static const char fn[] = "moelua.ops.cross_entropy_backward";
    ml_args(L, 6, fn);
    lua_settop(L, 6);
    if (lua_type(L, 1) != LUA_TNUMBER)
        ml_error(L, fn, "argument #1 (dloss) must be a number, got %s", luaL_typename(L, 1));
    double dloss = lua_tonumber(L, 1);
    ml_tensor *hs = ml_checktensor_named(L, 2, fn, "argument #2 (h)");
    ml_tensor *W = ml_checktensor_named(L, 3, fn, "argument #3 (W)");
    ml_tensor *tg = ml_checktensor_named(L, 4, fn, "argument #4 (targets)");
    ml_tensor *lse = ml_checktensor_named(L, 5, fn, "argument #5 (lse)");
    int64_t rows, chunk;
    ce_opts(L, fn, 6, &rows, &chunk);
    ml_tensor *dW = opt_output(L, 6, fn, "dW", "option 'dW'");
    ml_tensor *dh = ml_pushtensor(L);
    ml_err e;
    ml_check_op(L, fn, ml_op_cross_entropy_backward(ml_host_of(L), dh, dW, dloss, hs, W, tg, lse,
                                                    rows, chunk, &e), &e);
    lua_pushvalue(L, 7);
    return 2;
}

/* ---- rope --------------------------------------------------------------------- */

static const char *const ROPE_OPTS[] = {"theta", "offset", "out", NULL};

/* A given option 'out' y: x's device, dtype and shape, contiguous, x itself
 * or apart from it. The op checks the same but names it y (dx); x (named
 * xname, as the op does) is checked first, so a bad x is reported as x. */
static void rope_check_out(lua_State *L, const char *fn, ml_host *h, const ml_tensor *y,
                           const ml_tensor *x, const char *xname)
{
    static const char what[] = "option 'out'";
    ml_device dev = ml_tensor_device(x);
    ml_err e;
    ml_status s = ml_check_input(x, xname, dev, ml_float_dtypes(h, dev, ML_OP_ROPE), 3, 1, &e);
    if (s == ML_OK)
        s = ml_check_input(y, what, dev, ML_DT(x->dtype), 3, 1, &e);
    if (s == ML_OK)
        s = ml_check_shape(y, what, 3, x->shape, &e);
    if (s == ML_OK && ml_data(y) != ml_data(x) && ml_tensors_overlap(y, x))
        s = ml_err_set(&e, ML_EINVAL, "%s overlaps %s but is not %s itself", what, xname, xname);
    ml_check_op(L, fn, s, &e);
}

static int rope_common(lua_State *L, const char *fn, const char *what, const char *xname,
                       int inverse)
{
    ml_args(L, 2, fn);
    lua_settop(L, 2);
    ml_tensor *x = ml_checktensor_named(L, 1, fn, what);
    ml_check_opts(L, 2, fn, ROPE_OPTS);
    double theta = ml_opt_number(L, 2, fn, "theta", 10000.0);
    int64_t offset = ml_opt_integer(L, 2, fn, "offset", 0, 0, ML_ROPE_OFFSET_MAX);
    ml_tensor *y = opt_output(L, 2, fn, "out", "option 'out'");
    ml_host *h = ml_host_of(L);
    if (y->st)
        rope_check_out(L, fn, h, y, x, xname);
    ml_err e;
    ml_check_op(L, fn, inverse ? ml_op_rope_backward(h, y, x, offset, theta, &e)
                               : ml_op_rope_forward(h, y, x, offset, theta, &e), &e);
    return 1;
}

static int l_ops_rope_forward(lua_State *L)
{
    return rope_common(L, "moelua.ops.rope_forward", "argument #1 (x)", "x", 0);
}

static int l_ops_rope_backward(lua_State *L)
{
    return rope_common(L, "moelua.ops.rope_backward", "argument #1 (dy)", "dy", 1);
}

/* ---- attention ---------------------------------------------------------------- */

static int l_ops_attention_forward(lua_State *L)
{
    static const char fn[] = "moelua.ops.attention_forward";
    ml_args(L, 3, fn);
    lua_settop(L, 3);
    ml_tensor *q = ml_checktensor_named(L, 1, fn, "argument #1 (q)");
    ml_tensor *k = ml_checktensor_named(L, 2, fn, "argument #2 (k)");
    ml_tensor *v = ml_checktensor_named(L, 3, fn, "argument #3 (v)");
    ml_tensor *out = ml_pushtensor(L);
    ml_tensor *lse = ml_pushtensor(L);
    ml_err e;
    ml_check_op(L, fn, ml_op_attention_forward(ml_host_of(L), out, lse, q, k, v, &e), &e);
    return 2;
}

static int l_ops_attention_backward(lua_State *L)
{
    static const char fn[] = "moelua.ops.attention_backward";
    ml_args(L, 6, fn);
    lua_settop(L, 6);
    ml_tensor *dout = ml_checktensor_named(L, 1, fn, "argument #1 (dout)");
    ml_tensor *q = ml_checktensor_named(L, 2, fn, "argument #2 (q)");
    ml_tensor *k = ml_checktensor_named(L, 3, fn, "argument #3 (k)");
    ml_tensor *v = ml_checktensor_named(L, 4, fn, "argument #4 (v)");
    ml_tensor *out = ml_checktensor_named(L, 5, fn, "argument #5 (out)");
    ml_tensor *lse = ml_checktensor_named(L, 6, fn, "argument #6 (lse)");
    ml_tensor *dq = ml_pushtensor(L);
    ml_tensor *dk = ml_pushtensor(L);
    ml_tensor *dv = ml_pushtensor(L);
    ml_err e;
    ml_check_op(L, fn, ml_op_attention_backward(ml_host_of(L), dq, dk, dv, dout, q, k, v, out, lse,
                                                &e), &e);
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
