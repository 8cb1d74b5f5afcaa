/*
 * host/bindings/l_tensor_math.c - the math half of the tensor library: elementwise
 * ops with broadcasting, unary ops, reductions, cumsum, softmax, top-k,
 * index ops and matmul. Each binding checks its arguments, allocates its
 * output through the ledger, runs one backend kernel and raises on a bad
 * status only after the kernel returned.
 *
 * Broadcasting: two tensors combine when their shapes are equal, when one
 * has a single element, or when the shorter shape equals the trailing dims
 * of the longer (a [D] bias over [T, D] activations).
 */
#include "l_tensor.h"

#include <math.h>
#include <string.h>

static void check_same_device(lua_State *L, const char *fn, const ml_tensor *a, const ml_tensor *b)
{
    if (a->st->device != b->st->device)
        ml_error(L, fn, "tensors are on different devices (%s and %s)",
                 ml_device_names[a->st->device], ml_device_names[b->st->device]);
}

static void check_float(lua_State *L, const char *fn, const ml_tensor *t)
{
    if (t->dtype != ML_F32 && t->dtype != ML_F64)
        ml_error(L, fn, "expected an f32 or f64 tensor, got %s", ml_dtype_names[t->dtype]);
}

/* ---- elementwise binary ---------------------------------------------------- */

static const char *const BINOP_NAMES[ML_NBINOPS] = {
    "moelua.add", "moelua.sub", "moelua.mul", "moelua.div", "moelua.maximum", "moelua.minimum"
};

/* Is `small` a suffix of `big` (or a single element)? */
static int broadcasts(const ml_tensor *big, const ml_tensor *small)
{
    if (ml_numel(small) == 1 || small->ndim > big->ndim)
        return ml_numel(small) == 1;
    for (int i = 1; i <= small->ndim; i++)
        if (small->shape[small->ndim - i] != big->shape[big->ndim - i])
            return 0;
    return 1;
}

static int binary(lua_State *L, ml_binop op, int inplace)
{
    const char *fn = BINOP_NAMES[op];
    /* number op tensor (from metamethods) and tensor op number */
    int ta = ml_testtensor(L, 1) != NULL, tb = ml_testtensor(L, 2) != NULL;
    if (!ta && !tb)
        ml_error(L, fn, "expected a tensor argument");
    if (!ta || !tb) {
        int ti = ta ? 1 : 2, si = ta ? 2 : 1;
        if (!ta && inplace)
            ml_error(L, fn, "argument #1: expected a tensor, got %s", luaL_typename(L, 1));
        /* in place writes the tensor itself, never a contiguous copy of it */
        ml_tensor *t = inplace ? ml_checkcontig(L, 1, fn, -1) : ml_contiguous_arg(L, ti, fn);
        if (lua_type(L, si) != LUA_TNUMBER)
            ml_error(L, fn, "argument #%d: expected a tensor or a number, got %s", si,
                     luaL_typename(L, si));
        double s = lua_tonumber(L, si);
        if ((t->dtype == ML_I32 || t->dtype == ML_I64) && s != floor(s))
            ml_error(L, fn, "a fractional number (%g) with an integer tensor: convert the tensor with :to()", s);
        if (op == ML_DIV && (t->dtype == ML_I32 || t->dtype == ML_I64) && !ta)
            ml_error(L, fn, "integer division of a number by a tensor is not supported");
        if (op == ML_DIV && s == 0 && (t->dtype == ML_I32 || t->dtype == ML_I64))
            ml_error(L, fn, "integer division by zero");
        ml_tensor *out = inplace ? t : ml_newtensor(L, fn, t->st->device, t->dtype, t->ndim, t->shape);
        ml_kctx ctx = ml_kctx_of(ml_host_of(L));
        ml_check_status(L, fn, ML_KCALL(ml_host_of(L), t->st->device, binary_scalar, op, t->dtype, ml_data(out), ml_data(t),
                                                                    s, !ta, ml_numel(t), &ctx));
        if (inplace)
            lua_settop(L, 1);
        return 1;
    }
    ml_tensor *a = ml_checktensor(L, 1, fn), *b = ml_checktensor(L, 2, fn);
    check_same_device(L, fn, a, b);
    if (a->dtype != b->dtype)
        ml_error(L, fn, "dtypes differ (%s and %s): convert one with :to()", ml_dtype_names[a->dtype],
                 ml_dtype_names[b->dtype]);
    /* the output takes the shape of the operand that is not a single
     * element, else of the longer one ([3] + [1,3], [0,D] + [D]) */
    int64_t na = ml_numel(a), nb = ml_numel(b);
    int b_big = na == 1 && nb != 1 ? 1 : nb == 1 && na != 1 ? 0 : b->ndim > a->ndim;
    const ml_tensor *big = b_big ? b : a;
    const ml_tensor *small = big == a ? b : a;
    if (!broadcasts(big, small) || (inplace && big != a && ml_numel(a) != ml_numel(b))) {
        char sa[128], sb[128];
        ml_format_shape(a, sa, sizeof sa);
        ml_format_shape(b, sb, sizeof sb);
        ml_error(L, fn, "shapes %s and %s do not broadcast%s", sa, sb,
                 inplace ? " into the first" : "");
    }
    int big_is_a = big == a;
    a = inplace ? ml_checkcontig(L, 1, fn, -1) : ml_contiguous_arg(L, 1, fn);
    b = ml_contiguous_arg(L, 2, fn);
    big = big_is_a ? a : b;
    if ((a->dtype == ML_I32 || a->dtype == ML_I64) && op == ML_DIV)
        ml_error(L, fn, "integer division is not supported between tensors");
    ml_tensor *out = inplace ? a : ml_newtensor(L, fn, a->st->device, a->dtype, big->ndim, big->shape);
    ml_kctx ctx = ml_kctx_of(ml_host_of(L));
    ml_check_status(L, fn, ML_KCALL(ml_host_of(L), a->st->device, binary, op, a->dtype, ml_data(out), ml_data(a), ml_data(b),
                                                         ml_numel(big), ml_numel(a), ml_numel(b), &ctx));
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
    lua_settop(L, 1);
    ml_tensor *t = inplace ? ml_checkcontig(L, 1, fn, -1) : ml_contiguous_arg(L, 1, fn);
    int is_int = t->dtype == ML_I32 || t->dtype == ML_I64;
    if (!(t->dtype == ML_F32 || t->dtype == ML_F64 || (is_int && (op == ML_NEG || op == ML_ABS))))
        ml_error(L, fn, "not defined for dtype %s", ml_dtype_names[t->dtype]);
    ml_tensor *out = inplace ? t : ml_newtensor(L, fn, t->st->device, t->dtype, t->ndim, t->shape);
    ml_kctx ctx = ml_kctx_of(ml_host_of(L));
    ml_check_status(L, fn, ML_KCALL(ml_host_of(L), t->st->device, unary, op, t->dtype, ml_data(out), ml_data(t),
                                                        ml_numel(t), &ctx));
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

/* outer, r, inner of a contiguous tensor around dim d. */
static void split_dims(const ml_tensor *t, int d, int64_t *outer, int64_t *r, int64_t *inner)
{
    *outer = 1;
    *inner = 1;
    for (int i = 0; i < d; i++) *outer *= t->shape[i];
    for (int i = d + 1; i < t->ndim; i++) *inner *= t->shape[i];
    *r = t->shape[d];
}

/* The input shape without dim d. */
static int drop_dim(const ml_tensor *t, int d, int64_t *shape)
{
    int nd = 0;
    for (int i = 0; i < t->ndim; i++)
        if (i != d)
            shape[nd++] = t->shape[i];
    return nd;
}

/* t:sum([dim]) and friends: no dim reduces everything to a 0-dim tensor.
 * want_idx: also (or only, when values == 0) the int64 positions. */
static int reduce(lua_State *L, const char *fn, ml_redop op, int values, int want_idx)
{
    lua_settop(L, 2);
    ml_tensor *t = ml_contiguous_arg(L, 1, fn);
    check_float(L, fn, t);
    ml_host *kh = ml_host_of(L);
    ml_device kd = t->st->device;
    ml_kctx ctx = ml_kctx_of(ml_host_of(L));
    int64_t n = ml_numel(t);
    if ((op == ML_RMAX || op == ML_RMIN) && n == 0 && lua_isnil(L, 2))
        ml_error(L, fn, "reduction of an empty tensor has no identity");
    int64_t shape[ML_MAXDIM];
    int nd = 0, d = -1;
    if (!lua_isnil(L, 2)) {
        d = ml_checkdim(L, 2, fn, t->ndim);
        nd = drop_dim(t, d, shape);
        if ((op == ML_RMAX || op == ML_RMIN) && t->shape[d] == 0)
            ml_error(L, fn, "reduction over an empty dim has no identity");
    }
    ml_tensor *out = ml_newtensor(L, fn, t->st->device, t->dtype, nd, shape);
    ml_tensor *idx = want_idx ? ml_newtensor(L, fn, t->st->device, ML_I64, nd, shape) : NULL;
    ml_status s;
    if (d < 0) {
        s = ML_KCALL(kh, kd, reduce_all, op, t->dtype, ml_data(out), idx ? ml_data(idx) : NULL, ml_data(t), n, &ctx);
    } else {
        int64_t outer, r, inner;
        split_dims(t, d, &outer, &r, &inner);
        s = ML_KCALL(kh, kd, reduce, op, t->dtype, ml_data(out), idx ? ml_data(idx) : NULL, ml_data(t),
                       outer, r, inner, &ctx);
    }
    ml_check_status(L, fn, s);
    if (!values) {
        lua_remove(L, -2);
        return 1;
    }
    return want_idx ? 2 : 1;
}

static int l_tensor_sum(lua_State *L) { return reduce(L, "Tensor:sum", ML_RSUM, 1, 0); }
static int l_tensor_mean(lua_State *L) { return reduce(L, "Tensor:mean", ML_RMEAN, 1, 0); }
static int l_tensor_max(lua_State *L) { return reduce(L, "Tensor:max", ML_RMAX, 1, 1); }
static int l_tensor_min(lua_State *L) { return reduce(L, "Tensor:min", ML_RMIN, 1, 1); }
static int l_tensor_argmax(lua_State *L) { return reduce(L, "Tensor:argmax", ML_RMAX, 0, 1); }

static int l_tensor_cumsum(lua_State *L)
{
    static const char fn[] = "Tensor:cumsum";
    lua_settop(L, 2);
    ml_tensor *t = ml_contiguous_arg(L, 1, fn);
    int d = ml_checkdim(L, 2, fn, t->ndim);
    if (t->dtype != ML_F32 && t->dtype != ML_F64 && t->dtype != ML_I32 && t->dtype != ML_I64)
        ml_error(L, fn, "not defined for dtype %s", ml_dtype_names[t->dtype]);
    int64_t outer, r, inner;
    split_dims(t, d, &outer, &r, &inner);
    ml_tensor *out = ml_newtensor(L, fn, t->st->device, t->dtype, t->ndim, t->shape);
    ml_kctx ctx = ml_kctx_of(ml_host_of(L));
    ml_check_status(L, fn, ML_KCALL(ml_host_of(L), t->st->device, cumsum, t->dtype, ml_data(out), ml_data(t),
                                                         outer, r, inner, &ctx));
    return 1;
}

/* ---- softmax, top-k --------------------------------------------------------------- */

static int softmax(lua_State *L, const char *fn, int log)
{
    lua_settop(L, 1);
    ml_tensor *t = ml_contiguous_arg(L, 1, fn);
    check_float(L, fn, t);
    if (t->ndim == 0)
        ml_error(L, fn, "expected at least one dim");
    int64_t cols = t->shape[t->ndim - 1], rows = cols ? ml_numel(t) / cols : 0;
    ml_tensor *out = ml_newtensor(L, fn, t->st->device, t->dtype, t->ndim, t->shape);
    ml_kctx ctx = ml_kctx_of(ml_host_of(L));
    ml_check_status(L, fn, ML_KCALL(ml_host_of(L), t->st->device, softmax, log, t->dtype, ml_data(out), ml_data(t),
                                                          rows, cols, &ctx));
    return 1;
}

static int l_tensor_softmax(lua_State *L) { return softmax(L, "Tensor:softmax", 0); }
static int l_tensor_log_softmax(lua_State *L) { return softmax(L, "Tensor:log_softmax", 1); }

/* t:topk(k) over the last dim -> values, indices (int64, 0-based), ties to the lower index. */
static int l_tensor_topk(lua_State *L)
{
    static const char fn[] = "Tensor:topk";
    lua_settop(L, 2);
    ml_tensor *t = ml_contiguous_arg(L, 1, fn);
    check_float(L, fn, t);
    if (t->ndim == 0)
        ml_error(L, fn, "expected at least one dim");
    int64_t cols = t->shape[t->ndim - 1];
    lua_Integer k = luaL_checkinteger(L, 2);
    if (k < 0 || k > cols)
        ml_error(L, fn, "k = %lld is outside [0, %lld] (the size of the last dim)", (long long)k,
                 (long long)cols);
    int64_t shape[ML_MAXDIM];
    memcpy(shape, t->shape, sizeof shape);
    shape[t->ndim - 1] = k;
    int64_t rows = cols ? ml_numel(t) / cols : 0;
    ml_tensor *vals = ml_newtensor(L, fn, t->st->device, t->dtype, t->ndim, shape);
    ml_tensor *idx = ml_newtensor(L, fn, t->st->device, ML_I64, t->ndim, shape);
    ml_kctx ctx = ml_kctx_of(ml_host_of(L));
    ml_status s = ML_KCALL(ml_host_of(L), t->st->device, topk, t->dtype, ml_data(vals), ml_data(idx), ml_data(t),
                                             rows, cols, k, &ctx);
    if (s == ML_ENAN)
        ml_error(L, fn, "NaN in the input (top-k refuses NaN scores)");
    ml_check_status(L, fn, s);
    return 2;
}

/* ---- index ops ---------------------------------------------------------------------- */

/* Every index in [0, bound). Device indices are checked on a host copy. */
static void check_index(lua_State *L, const char *fn, int arg, const ml_tensor *idx, int64_t bound)
{
    if (idx->dtype != ML_I64)
        ml_error(L, fn, "argument #%d: indices must be i64, got %s", arg, ml_dtype_names[idx->dtype]);
    int top = lua_gettop(L);
    const ml_tensor *h = idx;
    if (idx->st->device != ML_CPU) {
        ml_tensor *c = ml_newtensor(L, fn, ML_CPU, ML_I64, idx->ndim, idx->shape);
        ml_run_copy(L, fn, c, idx);
        h = c;
    }
    const int64_t *p = ml_data(h);
    int64_t n = ml_numel(h);
    for (int64_t i = 0; i < n; i++)
        if (p[i] < 0 || p[i] >= bound)
            ml_error(L, fn, "argument #%d: index %lld at position %lld is outside [0, %lld) (indices are 0-based)",
                     arg, (long long)p[i], (long long)i, (long long)bound);
    lua_settop(L, top);
}

static int l_tensor_index_select(lua_State *L)
{
    static const char fn[] = "Tensor:index_select";
    lua_settop(L, 3);
    ml_tensor *t = ml_contiguous_arg(L, 1, fn);
    int d = ml_checkdim(L, 2, fn, t->ndim);
    ml_tensor *idx = ml_contiguous_arg(L, 3, fn);
    check_same_device(L, fn, t, idx);
    if (idx->ndim != 1)
        ml_error(L, fn, "argument #3: indices must be 1-dim, got %d dims", idx->ndim);
    check_index(L, fn, 3, idx, t->shape[d]);
    int64_t shape[ML_MAXDIM], outer, r, inner;
    memcpy(shape, t->shape, sizeof shape);
    shape[d] = idx->shape[0];
    split_dims(t, d, &outer, &r, &inner);
    ml_tensor *out = ml_newtensor(L, fn, t->st->device, t->dtype, t->ndim, shape);
    ml_kctx ctx = ml_kctx_of(ml_host_of(L));
    ml_check_status(L, fn, ML_KCALL(ml_host_of(L), t->st->device, index_select, t->dtype, ml_data(out), ml_data(t),
                                                               ml_data(idx), outer, r, inner,
                                                               idx->shape[0], &ctx));
    return 1;
}

/* idx must match t in every dim but d. */
static void check_index_shape(lua_State *L, const char *fn, const ml_tensor *t, const ml_tensor *idx, int d)
{
    int ok = idx->ndim == t->ndim;
    for (int i = 0; ok && i < t->ndim; i++)
        ok = i == d || idx->shape[i] == t->shape[i];
    if (!ok) {
        char st[128], si[128];
        ml_format_shape(t, st, sizeof st);
        ml_format_shape(idx, si, sizeof si);
        ml_error(L, fn, "index shape %s must equal %s except in dim %d", si, st, d + 1);
    }
}

static int l_tensor_gather(lua_State *L)
{
    static const char fn[] = "Tensor:gather";
    lua_settop(L, 3);
    ml_tensor *t = ml_contiguous_arg(L, 1, fn);
    int d = ml_checkdim(L, 2, fn, t->ndim);
    ml_tensor *idx = ml_contiguous_arg(L, 3, fn);
    check_same_device(L, fn, t, idx);
    check_index_shape(L, fn, t, idx, d);
    check_index(L, fn, 3, idx, t->shape[d]);
    int64_t outer, r, inner;
    split_dims(t, d, &outer, &r, &inner);
    ml_tensor *out = ml_newtensor(L, fn, t->st->device, t->dtype, idx->ndim, idx->shape);
    ml_kctx ctx = ml_kctx_of(ml_host_of(L));
    ml_check_status(L, fn, ML_KCALL(ml_host_of(L), t->st->device, gather, t->dtype, ml_data(out), ml_data(t), ml_data(idx),
                                                         outer, r, inner, idx->shape[d], &ctx));
    return 1;
}

/* t:scatter_add_(dim, idx, src): t[.., idx[j], ..] += src[.., j, ..], in place. */
static int l_tensor_scatter_add_(lua_State *L)
{
    static const char fn[] = "Tensor:scatter_add_";
    lua_settop(L, 4);
    ml_tensor *t = ml_checkcontig(L, 1, fn, -1);
    int d = ml_checkdim(L, 2, fn, t->ndim);
    ml_tensor *idx = ml_contiguous_arg(L, 3, fn);
    ml_tensor *src = ml_contiguous_arg(L, 4, fn);
    check_same_device(L, fn, t, idx);
    check_same_device(L, fn, t, src);
    if (src->dtype != t->dtype)
        ml_error(L, fn, "source dtype %s differs from %s", ml_dtype_names[src->dtype],
                 ml_dtype_names[t->dtype]);
    check_index_shape(L, fn, t, idx, d);
    int same = src->ndim == idx->ndim;
    for (int i = 0; same && i < idx->ndim; i++)
        same = src->shape[i] == idx->shape[i];
    if (!same) {
        char ss[128], si[128];
        ml_format_shape(src, ss, sizeof ss);
        ml_format_shape(idx, si, sizeof si);
        ml_error(L, fn, "source shape %s differs from index shape %s", ss, si);
    }
    check_index(L, fn, 3, idx, t->shape[d]);
    if (t->dtype != ML_F32 && t->dtype != ML_F64 && t->dtype != ML_I32 && t->dtype != ML_I64)
        ml_error(L, fn, "not defined for dtype %s", ml_dtype_names[t->dtype]);
    int64_t outer, r, inner;
    split_dims(t, d, &outer, &r, &inner);
    ml_kctx ctx = ml_kctx_of(ml_host_of(L));
    ml_check_status(L, fn, ML_KCALL(ml_host_of(L), t->st->device, scatter_add, t->dtype, ml_data(t), ml_data(src), ml_data(idx),
                                                              outer, r, inner, idx->shape[d], &ctx));
    lua_settop(L, 1);
    return 1;
}

/* moelua.bincount(idx, nbins) -> int64 [nbins]. */
static int l_tensor_bincount(lua_State *L)
{
    static const char fn[] = "moelua.bincount";
    lua_settop(L, 2);
    ml_tensor *idx = ml_contiguous_arg(L, 1, fn);
    lua_Integer nbins = luaL_checkinteger(L, 2);
    if (nbins < 0)
        ml_error(L, fn, "argument #2: nbins must be >= 0, got %lld", (long long)nbins);
    if (idx->ndim != 1)
        ml_error(L, fn, "argument #1: indices must be 1-dim, got %d dims", idx->ndim);
    check_index(L, fn, 1, idx, nbins);
    int64_t nb = nbins;
    ml_tensor *out = ml_newtensor(L, fn, idx->st->device, ML_I64, 1, &nb);
    ml_kctx ctx = ml_kctx_of(ml_host_of(L));
    ml_check_status(L, fn, ML_KCALL(ml_host_of(L), idx->st->device, bincount, ml_data(out), ml_data(idx), ml_numel(idx),
                                                             nbins, &ctx));
    return 1;
}

/* ---- matmul ---------------------------------------------------------------------------- */

/* BLAS view of the last two dims: row-major with leading dim ld, or
 * transposed (a :t() view). Anything else needs a contiguous copy. */
static int blas_layout(const ml_tensor *t, int *trans, int64_t *ld)
{
    int r = t->ndim - 2, c = t->ndim - 1;
    if (t->stride[c] == 1 && t->stride[r] >= (t->shape[c] > 1 ? t->shape[c] : 1)) {
        *trans = 0;
        *ld = t->stride[r] > 0 ? t->stride[r] : 1;
        return 1;
    }
    if (t->stride[r] == 1 && t->stride[c] >= (t->shape[r] > 1 ? t->shape[r] : 1)) {
        *trans = 1;
        *ld = t->stride[c] > 0 ? t->stride[c] : 1;
        return 1;
    }
    return 0;
}

static const char *const MATMUL_OPTS[] = {"out", "alpha", "beta", NULL};

/* moelua.matmul(a, b [, {out=, alpha=, beta=}]): [m,k]x[k,n], [B,m,k]x[B,k,n]
 * or [B,m,k]x[k,n]. With `out`, C = alpha*A*B + beta*C in place. */
static int l_tensor_matmul(lua_State *L)
{
    static const char fn[] = "moelua.matmul";
    lua_settop(L, 3);
    ml_tensor *a = ml_checktensor(L, 1, fn), *b = ml_checktensor(L, 2, fn);
    ml_check_opts(L, lua_isnil(L, 3) ? 0 : 3, fn, MATMUL_OPTS);
    check_same_device(L, fn, a, b);
    if (a->dtype != b->dtype)
        ml_error(L, fn, "dtypes differ (%s and %s)", ml_dtype_names[a->dtype], ml_dtype_names[b->dtype]);
    check_float(L, fn, a);
    if (a->ndim < 2 || a->ndim > 3 || b->ndim < 2 || b->ndim > 3 || (a->ndim == 2 && b->ndim == 3))
        ml_error(L, fn, "expected [m,k]x[k,n], [B,m,k]x[B,k,n] or [B,m,k]x[k,n]; got %d and %d dims",
                 a->ndim, b->ndim);
    int64_t m = a->shape[a->ndim - 2], k = a->shape[a->ndim - 1];
    int64_t kb = b->shape[b->ndim - 2], n = b->shape[b->ndim - 1];
    int64_t batch = a->ndim == 3 ? a->shape[0] : 1;
    if (k != kb || (b->ndim == 3 && b->shape[0] != batch)) {
        char sa[128], sb[128];
        ml_format_shape(a, sa, sizeof sa);
        ml_format_shape(b, sb, sizeof sb);
        ml_error(L, fn, "shapes %s and %s do not agree on the %s", sa, sb,
                 k != kb ? "inner dimension" : "batch dimension");
    }
    ml_gemm_shape g = {.batch = batch, .m = m, .n = n, .k = k, .alpha = 1, .beta = 0};
    if (!blas_layout(a, &g.ta, &g.lda) || (a->ndim == 3 && a->stride[0] < 0))
        a = ml_contiguous_arg(L, 1, fn), blas_layout(a, &g.ta, &g.lda);
    if (!blas_layout(b, &g.tb, &g.ldb))
        b = ml_contiguous_arg(L, 2, fn), blas_layout(b, &g.tb, &g.ldb);
    g.sa = a->ndim == 3 ? a->stride[0] : 0;
    g.sb = b->ndim == 3 ? b->stride[0] : 0;
    int64_t shape[3] = {batch, m, n};
    int nd = a->ndim;
    const int64_t *oshape = nd == 3 ? shape : shape + 1;
    ml_tensor *c;
    if (!lua_isnil(L, 3) && lua_getfield(L, 3, "out") != LUA_TNIL) {
        c = ml_testtensor(L, -1);
        if (!c || !c->st || c->dtype != a->dtype || !ml_is_contiguous(c))
            ml_error(L, fn, "option 'out': expected a contiguous %s tensor, got %s", ml_dtype_names[a->dtype],
                     !c ? luaL_typename(L, -1) : !c->st ? "a freed tensor"
                     : c->dtype != a->dtype ? ml_dtype_names[c->dtype] : "a non-contiguous view");
        c = ml_checktensor(L, -1, fn);   /* refuses a stale pool view */
        check_same_device(L, fn, a, c);
        int ok = c->ndim == nd;
        for (int i = 0; ok && i < nd; i++)
            ok = c->shape[i] == oshape[i];
        if (!ok)
            ml_error(L, fn, "option 'out' has the wrong shape");
        if (ml_overlaps(c, a) || ml_overlaps(c, b))
            ml_error(L, fn, "option 'out' overlaps an input");
        lua_getfield(L, 3, "alpha");
        g.alpha = luaL_optnumber(L, -1, 1.0);
        lua_getfield(L, 3, "beta");
        g.beta = luaL_optnumber(L, -1, 0.0);
        lua_pop(L, 2);
    } else {
        if (!lua_isnil(L, 3)) {
            lua_pop(L, 1);
            lua_getfield(L, 3, "alpha");
            g.alpha = luaL_optnumber(L, -1, 1.0);
            lua_pop(L, 1);
        }
        c = ml_newtensor(L, fn, a->st->device, a->dtype, nd, oshape);
    }
    g.ldc = n > 0 ? n : 1;
    g.sc = m * n;
    if (g.lda < 1) g.lda = 1;
    if (g.ldb < 1) g.ldb = 1;
    if (m == 0 || n == 0)
        return 1;
    if (k == 0) {   /* BLAS is not asked about empty sums: C = beta*C, C not read when beta = 0 */
        ml_kctx ctx = ml_kctx_of(ml_host_of(L));
        ml_host *kh = ml_host_of(L);
        ml_device kd = c->st->device;
        ml_check_status(L, fn, g.beta == 0 ? ML_KCALL(kh, kd, fill, c->dtype, ml_data(c), 0, ml_numel(c), &ctx)
                                           : ML_KCALL(kh, kd, binary_scalar, ML_MUL, c->dtype, ml_data(c), ml_data(c),
                                                               g.beta, 0, ml_numel(c), &ctx));
        return 1;
    }
    if (m > INT32_MAX || n > INT32_MAX || k > INT32_MAX || g.lda > INT32_MAX || g.ldb > INT32_MAX)
        ml_error(L, fn, "a dimension exceeds the BLAS integer range");
    ml_kctx ctx = ml_kctx_of(ml_host_of(L));
    ml_check_status(L, fn, ML_KCALL(ml_host_of(L), a->st->device, matmul, a->dtype, ml_data(c), ml_data(a), ml_data(b), &g, &ctx));
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
