/*
 * host/bindings/l_tensor_math.c - the math half of the tensor library: elementwise
 * ops with broadcasting, unary ops, reductions, cumsum, softmax, top-k,
 * index ops and matmul. Each binding converts its Lua arguments (1-based
 * dims to 0-based), pushes its outputs empty, calls one op of
 * host/runtime/ops_math.h (which checks, allocates and runs the kernel)
 * and raises its message naming the Lua function.
 */
#include "l_tensor.h"
#include "../runtime/ops_math.h"

/* ---- elementwise binary ---------------------------------------------------- */

static const char *const BINOP_NAMES[ML_NBINOPS] = {
    "moelua.add", "moelua.sub", "moelua.mul", "moelua.div", "moelua.maximum", "moelua.minimum"
};

/* tensor op tensor, tensor op number and number op tensor (from metamethods);
 * in place, the first argument is a tensor that takes the result. */
static int binary(lua_State *L, ml_binop op, int inplace)
{
    const char *fn = BINOP_NAMES[op];
    ml_args(L, 2, fn);
    int ta = ml_testtensor(L, 1) != NULL, tb = ml_testtensor(L, 2) != NULL;
    if (!ta && !tb)
        ml_error(L, fn, "expected a tensor argument");
    if (!ta && inplace)
        ml_error(L, fn, "argument #1: expected a tensor, got %s", luaL_typename(L, 1));
    ml_host *h = ml_host_of(L);
    ml_err e;
    if (!ta || !tb) {
        int ti = ta ? 1 : 2, si = ta ? 2 : 1;
        ml_tensor *t = ml_checktensor(L, ti, fn);
        if (lua_type(L, si) != LUA_TNUMBER)
            ml_error(L, fn, "argument #%d: expected a tensor or a number, got %s", si,
                     luaL_typename(L, si));
        double s = lua_tonumber(L, si);
        ml_tensor *out = inplace ? t : ml_pushtensor(L);
        ml_check_op(L, fn, ml_op_binary_scalar(h, out, op, t, s, !ta, &e), &e);
    } else {
        ml_tensor *a = ml_checktensor(L, 1, fn), *b = ml_checktensor(L, 2, fn);
        ml_tensor *out = inplace ? a : ml_pushtensor(L);
        ml_check_op(L, fn, ml_op_binary(h, out, op, a, b, &e), &e);
    }
    if (inplace)
        lua_settop(L, 1);
    return 1;
}

static int l_tensor_add(lua_State *L) { return binary(L, ML_ADD, 0); }
static int l_tensor_sub(lua_State *L) { return binary(L, ML_SUB, 0); }
static int l_tensor_mul(lua_State *L) { return binary(L, ML_MUL, 0); }
static int l_tensor_div(lua_State *L) { return binary(L, ML_DIV, 0); }
static int l_tensor_maximum(lua_State *L) { return binary(L, ML_MAX, 0); }
static int l_tensor_minimum(lua_State *L) { return binary(L, ML_MIN, 0); }
static int l_tensor_add_(lua_State *L) { return binary(L, ML_ADD, 1); }
static int l_tensor_sub_(lua_State *L) { return binary(L, ML_SUB, 1); }
static int l_tensor_mul_(lua_State *L) { return binary(L, ML_MUL, 1); }
static int l_tensor_div_(lua_State *L) { return binary(L, ML_DIV, 1); }

/* ---- unary -------------------------------------------------------------------- */

static const char *const UNOP_NAMES[ML_NUNOPS] = {
    "Tensor:exp", "Tensor:log", "Tensor:sqrt", "Tensor:rsqrt", "Tensor:silu", "Tensor:sigmoid",
    "Tensor:tanh", "Tensor:neg", "Tensor:abs"
};

static int unary(lua_State *L, ml_unop op, int inplace)
{
    const char *fn = UNOP_NAMES[op];
    ml_args(L, 1, fn);
    lua_settop(L, 1);
    ml_tensor *t = ml_checktensor(L, 1, fn);
    ml_tensor *out = inplace ? t : ml_pushtensor(L);
    ml_err e;
    ml_check_op(L, fn, ml_op_unary(ml_host_of(L), out, op, t, &e), &e);
    return 1;
}

#define UNARY(name, op) \
    static int l_tensor_##name(lua_State *L) { return unary(L, op, 0); } \
    static int l_tensor_##name##_(lua_State *L) { return unary(L, op, 1); }
UNARY(exp, ML_EXP)
UNARY(log, ML_LOG)
UNARY(sqrt, ML_SQRT)
UNARY(rsqrt, ML_RSQRT)
UNARY(silu, ML_SILU)
UNARY(sigmoid, ML_SIGMOID)
UNARY(tanh, ML_TANH)
UNARY(neg, ML_NEG)
UNARY(abs, ML_ABS)
#undef UNARY

/* ---- reductions ------------------------------------------------------------------ */

/* t:sum([dim]) and friends: no dim reduces everything to a 0-dim tensor.
 * want_idx: also (or only, when values == 0) the int64 positions. */
static int reduce(lua_State *L, const char *fn, ml_redop op, int values, int want_idx)
{
    ml_args(L, 2, fn);
    lua_settop(L, 2);
    ml_tensor *t = ml_checktensor(L, 1, fn);
    int d = lua_isnil(L, 2) ? -1 : ml_checkdim(L, 2, fn, t->ndim);
    ml_tensor *out = values ? ml_pushtensor(L) : NULL;
    ml_tensor *idx = want_idx ? ml_pushtensor(L) : NULL;
    ml_err e;
    ml_check_op(L, fn, ml_op_reduce(ml_host_of(L), out, idx, op, t, d, &e), &e);
    return values + want_idx;
}

static int l_tensor_sum(lua_State *L) { return reduce(L, "Tensor:sum", ML_RSUM, 1, 0); }
static int l_tensor_mean(lua_State *L) { return reduce(L, "Tensor:mean", ML_RMEAN, 1, 0); }
static int l_tensor_max(lua_State *L) { return reduce(L, "Tensor:max", ML_RMAX, 1, 1); }
static int l_tensor_min(lua_State *L) { return reduce(L, "Tensor:min", ML_RMIN, 1, 1); }
static int l_tensor_argmax(lua_State *L) { return reduce(L, "Tensor:argmax", ML_RMAX, 0, 1); }

static int l_tensor_cumsum(lua_State *L)
{
    static const char fn[] = "Tensor:cumsum";
    ml_args(L, 2, fn);
    lua_settop(L, 2);
    ml_tensor *t = ml_checktensor(L, 1, fn);
    int d = ml_checkdim(L, 2, fn, t->ndim);
    ml_tensor *out = ml_pushtensor(L);
    ml_err e;
    ml_check_op(L, fn, ml_op_cumsum(ml_host_of(L), out, t, d, &e), &e);
    return 1;
}

/* ---- softmax, top-k --------------------------------------------------------------- */

static int softmax(lua_State *L, const char *fn, int log)
{
    ml_args(L, 1, fn);
    lua_settop(L, 1);
    ml_tensor *t = ml_checktensor(L, 1, fn);
    ml_tensor *out = ml_pushtensor(L);
    ml_err e;
    ml_check_op(L, fn, ml_op_softmax(ml_host_of(L), out, t, log, &e), &e);
    return 1;
}

static int l_tensor_softmax(lua_State *L) { return softmax(L, "Tensor:softmax", 0); }
static int l_tensor_log_softmax(lua_State *L) { return softmax(L, "Tensor:log_softmax", 1); }

/* t:topk(k) over the last dim -> values, indices (int64, 0-based), ties to the lower index. */
static int l_tensor_topk(lua_State *L)
{
    static const char fn[] = "Tensor:topk";
    ml_args(L, 2, fn);
    lua_settop(L, 2);
    ml_tensor *t = ml_checktensor(L, 1, fn);
    lua_Integer k;
    const char *got = ml_not_integer(L, 2, &k);
    if (got)
        ml_error(L, fn, "expected k (an integer), got %s", got);
    ml_tensor *vals = ml_pushtensor(L), *idx = ml_pushtensor(L);
    ml_err e;
    ml_check_op(L, fn, ml_op_topk(ml_host_of(L), vals, idx, t, k, &e), &e);
    return 2;
}

/* ---- index ops ---------------------------------------------------------------------- */

/* t:<fn>(dim, idx) -> a new tensor, for the index ops of one signature. */
static int index_op(lua_State *L, const char *fn,
                    ml_status (*op)(ml_host *, ml_tensor *, const ml_tensor *, int, const ml_tensor *,
                                    ml_err *))
{
    ml_args(L, 3, fn);
    lua_settop(L, 3);
    ml_tensor *t = ml_checktensor(L, 1, fn);
    int d = ml_checkdim(L, 2, fn, t->ndim);
    ml_tensor *idx = ml_checktensor(L, 3, fn);
    ml_tensor *out = ml_pushtensor(L);
    ml_err e;
    ml_check_op(L, fn, op(ml_host_of(L), out, t, d, idx, &e), &e);
    return 1;
}

static int l_tensor_index_select(lua_State *L)
{
    return index_op(L, "Tensor:index_select", ml_op_index_select);
}

static int l_tensor_gather(lua_State *L)
{
    return index_op(L, "Tensor:gather", ml_op_gather);
}

/* t:scatter_add_(dim, idx, src): t[.., idx[j], ..] += src[.., j, ..], in place. */
static int l_tensor_scatter_add_(lua_State *L)
{
    static const char fn[] = "Tensor:scatter_add_";
    ml_args(L, 4, fn);
    lua_settop(L, 4);
    ml_tensor *t = ml_checktensor(L, 1, fn);
    int d = ml_checkdim(L, 2, fn, t->ndim);
    ml_tensor *idx = ml_checktensor(L, 3, fn), *src = ml_checktensor(L, 4, fn);
    ml_err e;
    ml_check_op(L, fn, ml_op_scatter_add(ml_host_of(L), t, d, idx, src, &e), &e);
    lua_settop(L, 1);
    return 1;
}

/* moelua.bincount(idx, nbins) -> int64 [nbins]. */
static int l_tensor_bincount(lua_State *L)
{
    static const char fn[] = "moelua.bincount";
    ml_args(L, 2, fn);
    lua_settop(L, 2);
    ml_tensor *idx = ml_checktensor(L, 1, fn);
    lua_Integer nbins = ml_checkinteger_named(L, 2, fn, "argument #2 (nbins)");
    ml_tensor *out = ml_pushtensor(L);
    ml_err e;
    ml_check_op(L, fn, ml_op_bincount(ml_host_of(L), out, idx, nbins, &e), &e);
    return 1;
}

/* ---- matmul ---------------------------------------------------------------------------- */

static const char *const MATMUL_OPTS[] = {"out", "alpha", "beta", NULL};

/* moelua.matmul(a, b [, {out=, alpha=, beta=}]): [m,k]x[k,n], [B,m,k]x[B,k,n]
 * or [B,m,k]x[k,n]. With `out`, C = alpha*A*B + beta*C in place. */
static int l_tensor_matmul(lua_State *L)
{
    static const char fn[] = "moelua.matmul";
    ml_args(L, 3, fn);
    lua_settop(L, 3);
    ml_tensor *a = ml_checktensor(L, 1, fn), *b = ml_checktensor(L, 2, fn);
    ml_check_opts(L, lua_isnil(L, 3) ? 0 : 3, fn, MATMUL_OPTS);
    double alpha = 1, beta = 0;
    ml_tensor *c = NULL;
    if (!lua_isnil(L, 3)) {
        lua_getfield(L, 3, "alpha");
        alpha = luaL_optnumber(L, -1, 1.0);
        lua_getfield(L, 3, "beta");
        beta = luaL_optnumber(L, -1, 0.0);
        if (lua_getfield(L, 3, "out") != LUA_TNIL)
            c = ml_checktensor_named(L, -1, fn, "option 'out'");
    }
    int given = c != NULL;
    if (!given)
        c = ml_pushtensor(L);
    ml_err e;
    ml_check_op(L, fn, ml_op_matmul(ml_host_of(L), c, a, b, alpha, beta, &e), &e);
    return 1;
}

/* ---- metamethods --------------------------------------------------------------------- */

static int l_tensor_unm(lua_State *L)
{
    lua_settop(L, 1);
    return unary(L, ML_NEG, 0);
}

static const luaL_Reg math_methods[] = {
    {"add", l_tensor_add}, {"sub", l_tensor_sub}, {"mul", l_tensor_mul}, {"div", l_tensor_div},
    {"maximum", l_tensor_maximum}, {"minimum", l_tensor_minimum},
    {"add_", l_tensor_add_}, {"sub_", l_tensor_sub_}, {"mul_", l_tensor_mul_}, {"div_", l_tensor_div_},
    {"exp", l_tensor_exp}, {"log", l_tensor_log}, {"sqrt", l_tensor_sqrt}, {"rsqrt", l_tensor_rsqrt},
    {"silu", l_tensor_silu}, {"sigmoid", l_tensor_sigmoid}, {"tanh", l_tensor_tanh},
    {"neg", l_tensor_neg}, {"abs", l_tensor_abs},
    {"exp_", l_tensor_exp_}, {"log_", l_tensor_log_}, {"sqrt_", l_tensor_sqrt_},
    {"rsqrt_", l_tensor_rsqrt_}, {"silu_", l_tensor_silu_}, {"sigmoid_", l_tensor_sigmoid_},
    {"tanh_", l_tensor_tanh_}, {"neg_", l_tensor_neg_}, {"abs_", l_tensor_abs_},
    {"sum", l_tensor_sum}, {"mean", l_tensor_mean}, {"max", l_tensor_max}, {"min", l_tensor_min},
    {"argmax", l_tensor_argmax}, {"cumsum", l_tensor_cumsum},
    {"softmax", l_tensor_softmax}, {"log_softmax", l_tensor_log_softmax}, {"topk", l_tensor_topk},
    {"index_select", l_tensor_index_select}, {"gather", l_tensor_gather},
    {"scatter_add_", l_tensor_scatter_add_},
    {"matmul", l_tensor_matmul},
    {NULL, NULL}
};

static const luaL_Reg math_functions[] = {
    {"add", l_tensor_add}, {"sub", l_tensor_sub}, {"mul", l_tensor_mul}, {"div", l_tensor_div},
    {"maximum", l_tensor_maximum}, {"minimum", l_tensor_minimum},
    {"matmul", l_tensor_matmul}, {"bincount", l_tensor_bincount},
    {NULL, NULL}
};

static const luaL_Reg math_meta[] = {
    {"__add", l_tensor_add}, {"__sub", l_tensor_sub}, {"__mul", l_tensor_mul},
    {"__div", l_tensor_div}, {"__unm", l_tensor_unm},
    {NULL, NULL}
};

void ml_tensor_math_register(lua_State *L)
{
    /* stack: library, metatable, methods */
    luaL_setfuncs(L, math_methods, 0);
    lua_pushvalue(L, -2);
    luaL_setfuncs(L, math_meta, 0);
    lua_pop(L, 1);
    lua_pushvalue(L, -3);
    luaL_setfuncs(L, math_functions, 0);
    lua_pop(L, 1);
}
