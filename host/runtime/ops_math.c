/*
 * host/runtime/ops_math.c - elementwise ops, reductions, softmax, top-k,
 * index ops and matmul (host/runtime/ops_math.h).
 */
#include "ops_math.h"
#include "ops_view.h"

#include <math.h>
#include <string.h>

#define ML_DT_INT (ML_DT(ML_I32) | ML_DT(ML_I64))

static ml_status check_same_device(const ml_tensor *a, const ml_tensor *b, ml_err *e)
{
    if (a->st->device != b->st->device)
        return ml_err_set(e, ML_EINVAL, "tensors are on different devices (%s and %s)",
                          ml_device_names[a->st->device], ml_device_names[b->st->device]);
    return ML_OK;
}

static ml_status check_float(const ml_tensor *t, ml_err *e)
{
    if (t->dtype != ML_F32 && t->dtype != ML_F64)
        return ml_err_set(e, ML_EINVAL, "expected an f32 or f64 tensor, got %s",
                          ml_dtype_names[t->dtype]);
    return ML_OK;
}

static ml_status check_dtype_in(const ml_tensor *t, unsigned dtypes, ml_err *e)
{
    if (!(dtypes & ML_DT(t->dtype)))
        return ml_err_set(e, ML_EINVAL, "not defined for dtype %s", ml_dtype_names[t->dtype]);
    return ML_OK;
}

/* outer, r, inner of a tensor around dim d. */
static void split_dims(const ml_tensor *t, int d, int64_t *outer, int64_t *r, int64_t *inner)
{
    *outer = 1;
    *inner = 1;
    for (int i = 0; i < d; i++) *outer *= t->shape[i];
    for (int i = d + 1; i < t->ndim; i++) *inner *= t->shape[i];
    *r = t->shape[d];
}

/* ---- elementwise ------------------------------------------------------------------ */

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

static ml_status binary_args(const ml_tensor *out, ml_binop op, const ml_tensor *a,
                             const ml_tensor *b, const ml_tensor **big, ml_err *e)
{
    int inplace = out == a;
    ML_TRY(ml_check_live(a, "a", e));
    ML_TRY(ml_check_live(b, "b", e));
    ML_TRY(check_same_device(a, b, e));
    if (a->dtype != b->dtype)
        return ml_err_set(e, ML_EINVAL, "dtypes differ (%s and %s): convert one with :to()",
                          ml_dtype_names[a->dtype], ml_dtype_names[b->dtype]);
    /* the output takes the shape of the operand that is not a single
     * element, else of the longer one ([3] + [1,3], [0,D] + [D]) */
    int64_t na = ml_numel(a), nb = ml_numel(b);
    int b_big = na == 1 && nb != 1 ? 1 : nb == 1 && na != 1 ? 0 : b->ndim > a->ndim;
    *big = b_big ? b : a;
    if (!broadcasts(*big, b_big ? a : b) || (inplace && b_big && na != nb)) {
        char sa[128], sb[128];
        ml_format_shape(a, sa, sizeof sa);
        ml_format_shape(b, sb, sizeof sb);
        return ml_err_set(e, ML_EINVAL, "shapes %s and %s do not broadcast%s", sa, sb,
                          inplace ? " into the first" : "");
    }
    if (inplace)
        ML_TRY(ml_check_input(a, "a", a->st->device, ML_DT_ANY, a->ndim, 1, e));
    if ((ML_DT_INT & ML_DT(a->dtype)) && op == ML_DIV)
        return ml_err_set(e, ML_EINVAL, "integer division is not supported between tensors");
    return ML_OK;
}

ml_status ml_op_binary(ml_host *h, ml_tensor *out, ml_binop op, const ml_tensor *a,
                       const ml_tensor *b, ml_err *e)
{
    const ml_tensor *big = a;
    ML_TRY(binary_args(out, op, a, b, &big, e));
    ml_device dev = a->st->device;
    ml_tensor ca = {0}, cb = {0};
    ml_status s = out == a ? ML_OK : ml_op_contiguous(h, &ca, a, e);
    if (s == ML_OK)
        s = ml_op_contiguous(h, &cb, b, e);
    if (s == ML_OK && out != a)
        s = ml_prepare_output(h, out, "out", dev, a->dtype, big->ndim, big->shape, e);
    if (s == ML_OK) {
        const ml_tensor *x = out == a ? a : &ca;
        ml_kctx c = ml_host_kctx(h);
        s = ml_kernel_status(ML_KCALL(h, dev, binary, op, a->dtype, ml_data(out), ml_data(x), ml_data(&cb),
                             ml_numel(big), ml_numel(a), ml_numel(b), &c), e);
    }
    ml_tensor_drop(&ca);
    ml_tensor_drop(&cb);
    return s;
}

/* The operand of a one-input elementwise op writing out: t itself in place
 * (out == t, checked contiguous by the caller), else a contiguous copy in
 * *ct (the caller drops it) with out prepared in t's dtype and shape. */
static ml_status elementwise_io(ml_host *h, ml_tensor *out, const ml_tensor *t, ml_tensor *ct,
                                const ml_tensor **src, ml_err *e)
{
    *src = t;
    if (out == t)
        return ML_OK;
    *src = ct;
    ML_TRY(ml_op_contiguous(h, ct, t, e));
    return ml_prepare_output(h, out, "out", t->st->device, t->dtype, t->ndim, t->shape, e);
}

ml_status ml_op_binary_scalar(ml_host *h, ml_tensor *out, ml_binop op, const ml_tensor *t,
                              double s, int scalar_first, ml_err *e)
{
    int inplace = out == t;
    ML_TRY(ml_check_live(t, "a", e));
    if (inplace)
        ML_TRY(ml_check_input(t, "a", t->st->device, ML_DT_ANY, t->ndim, 1, e));
    int is_int = (ML_DT_INT & ML_DT(t->dtype)) != 0;
    if (is_int && s != floor(s))
        return ml_err_set(e, ML_EINVAL, "a fractional number (%g) with an integer tensor: convert "
                          "the tensor with :to()", s);
    if (op == ML_DIV && is_int && scalar_first)
        return ml_err_set(e, ML_EINVAL, "integer division of a number by a tensor is not supported");
    if (op == ML_DIV && is_int && s == 0)
        return ml_err_set(e, ML_EINVAL, "integer division by zero");
    ml_tensor ct = {0};
    const ml_tensor *src;
    ml_status st = elementwise_io(h, out, t, &ct, &src, e);
    if (st == ML_OK) {
        ml_kctx c = ml_host_kctx(h);
        st = ml_kernel_status(ML_KCALL(h, t->st->device, binary_scalar, op, t->dtype, ml_data(out),
                              ml_data(src), s, scalar_first, ml_numel(t), &c), e);
    }
    ml_tensor_drop(&ct);
    return st;
}

ml_status ml_op_unary(ml_host *h, ml_tensor *out, ml_unop op, const ml_tensor *t, ml_err *e)
{
    int inplace = out == t;
    ML_TRY(ml_check_live(t, "t", e));
    if (inplace)
        ML_TRY(ml_check_input(t, "t", t->st->device, ML_DT_ANY, t->ndim, 1, e));
    ML_TRY(check_dtype_in(t, ml_float_dtypes(h, t->st->device, ML_OP_UNARY) |
                                 (op == ML_NEG || op == ML_ABS ? ML_DT_INT : 0), e));
    ml_tensor ct = {0};
    const ml_tensor *src;
    ml_status s = elementwise_io(h, out, t, &ct, &src, e);
    if (s == ML_OK) {
        ml_kctx c = ml_host_kctx(h);
        s = ml_kernel_status(ML_KCALL(h, t->st->device, unary, op, t->dtype, ml_data(out), ml_data(src),
                             ml_numel(t), &c), e);
    }
    ml_tensor_drop(&ct);
    return s;
}

/* ---- reductions, cumsum, softmax, top-k --------------------------------------------- */

/* The work of each op below on a contiguous copy ct of its input; the
 * caller drops ct. */

static ml_status reduce_run(ml_host *h, ml_tensor *out, ml_tensor *idx, ml_redop op,
                            const ml_tensor *t, int d, ml_err *e)
{
    int64_t shape[ML_MAXDIM];
    int nd = 0;
    for (int i = 0; d >= 0 && i < t->ndim; i++)
        if (i != d)
            shape[nd++] = t->shape[i];
    ml_device dev = t->st->device;
    ML_TRY(ml_prepare_output(h, out, "out", dev, t->dtype, nd, shape, e));
    if (idx)
        ML_TRY(ml_prepare_output(h, idx, "idx", dev, ML_I64, nd, shape, e));
    ml_kctx c = ml_host_kctx(h);
    void *pi = idx ? ml_data(idx) : NULL;
    if (d < 0) {
        ml_tensor scr = {0};
        ML_TRY(ml_kernel_scratch(h, &scr, dev, ML_KSCRATCH(h, dev, reduce_all, ml_numel(t)), e));
        ml_status s = ML_KCALL(h, dev, reduce_all, op, t->dtype, ml_data(out), pi, ml_data(t),
                               ml_numel(t), scr.st ? ml_data(&scr) : NULL, &c);
        ml_tensor_drop(&scr);
        return ml_kernel_status(s, e);
    }
    int64_t outer, r, inner;
    split_dims(t, d, &outer, &r, &inner);
    return ml_kernel_status(ML_KCALL(h, dev, reduce, op, t->dtype, ml_data(out), pi, ml_data(t), outer, r,
                            inner, &c), e);
}

ml_status ml_op_reduce(ml_host *h, ml_tensor *out, ml_tensor *idx, ml_redop op,
                       const ml_tensor *t, int d, ml_err *e)
{
    ML_TRY(ml_check_live(t, "t", e));
    ML_TRY(check_float(t, e));
    int extremum = op == ML_RMAX || op == ML_RMIN;
    if (extremum && d < 0 && ml_numel(t) == 0)
        return ml_err_set(e, ML_EINVAL, "reduction of an empty tensor has no identity");
    if (d >= 0) {
        ML_TRY(ml_check_dim(t, d, e));
        if (extremum && t->shape[d] == 0)
            return ml_err_set(e, ML_EINVAL, "reduction over an empty dim has no identity");
    }
    ml_tensor ct = {0}, vals = {0};   /* vals: the values when out is not wanted */
    ml_status s = ml_op_contiguous(h, &ct, t, e);
    if (s == ML_OK)
        s = reduce_run(h, out ? out : &vals, idx, op, &ct, d, e);
    ml_tensor_drop(&ct);
    ml_tensor_drop(&vals);
    return s;
}

ml_status ml_op_cumsum(ml_host *h, ml_tensor *out, const ml_tensor *t, int d, ml_err *e)
{
    ML_TRY(ml_check_live(t, "t", e));
    ML_TRY(ml_check_dim(t, d, e));
    ML_TRY(check_dtype_in(t, ML_DT_FLOAT | ML_DT_INT, e));
    ml_tensor ct = {0};
    ml_status s = ml_op_contiguous(h, &ct, t, e);
    if (s == ML_OK)
        s = ml_prepare_output(h, out, "out", t->st->device, t->dtype, t->ndim, t->shape, e);
    if (s == ML_OK) {
        int64_t outer, r, inner;
        split_dims(t, d, &outer, &r, &inner);
        ml_kctx c = ml_host_kctx(h);
        s = ml_kernel_status(ML_KCALL(h, t->st->device, cumsum, t->dtype, ml_data(out), ml_data(&ct), outer,
                             r, inner, &c), e);
    }
    ml_tensor_drop(&ct);
    return s;
}

ml_status ml_op_softmax(ml_host *h, ml_tensor *out, const ml_tensor *t, int log, ml_err *e)
{
    ML_TRY(ml_check_live(t, "t", e));
    ML_TRY(check_float(t, e));
    if (t->ndim == 0)
        return ml_err_set(e, ML_EINVAL, "expected at least one dim");
    ml_tensor ct = {0};
    ml_status s = ml_op_contiguous(h, &ct, t, e);
    if (s == ML_OK)
        s = ml_prepare_output(h, out, "out", t->st->device, t->dtype, t->ndim, t->shape, e);
    if (s == ML_OK) {
        int64_t cols = t->shape[t->ndim - 1], rows = cols ? ml_numel(t) / cols : 0;
        ml_kctx c = ml_host_kctx(h);
        s = ml_kernel_status(ML_KCALL(h, t->st->device, softmax, log, t->dtype, ml_data(out), ml_data(&ct),
                             rows, cols, &c), e);
    }
    ml_tensor_drop(&ct);
    return s;
}

ml_status ml_op_topk(ml_host *h, ml_tensor *vals, ml_tensor *idx, const ml_tensor *t, int64_t k,
                     ml_err *e)
{
    ML_TRY(ml_check_live(t, "t", e));
    ML_TRY(check_float(t, e));
    if (t->ndim == 0)
        return ml_err_set(e, ML_EINVAL, "expected at least one dim");
    int64_t cols = t->shape[t->ndim - 1], rows = cols ? ml_numel(t) / cols : 0;
    if (k < 0 || k > cols)
        return ml_err_set(e, ML_EINVAL, "k = %lld is outside [0, %lld] (the size of the last dim)",
                          (long long)k, (long long)cols);
    int64_t shape[ML_MAXDIM];
    memcpy(shape, t->shape, sizeof shape);
    shape[t->ndim - 1] = k;
    ml_device dev = t->st->device;
    ml_tensor ct = {0};
    ml_status s = ml_op_contiguous(h, &ct, t, e);
    if (s == ML_OK)
        s = ml_prepare_output(h, vals, "vals", dev, t->dtype, t->ndim, shape, e);
    if (s == ML_OK)
        s = ml_prepare_output(h, idx, "idx", dev, ML_I64, t->ndim, shape, e);
    ml_tensor scr = {0};
    if (s == ML_OK)
        s = ml_kernel_scratch(h, &scr, dev, ML_KSCRATCH(h, dev, topk, rows, cols, k), e);
    if (s == ML_OK) {
        ml_kctx c = ml_host_kctx(h);
        s = ML_KCALL(h, dev, topk, t->dtype, ml_data(vals), ml_data(idx), ml_data(&ct), rows, cols,
                     k, scr.st ? ml_data(&scr) : NULL, &c);
        s = s == ML_ENAN ? ml_err_set(e, s, "NaN in the input (top-k refuses NaN scores)")
                         : ml_kernel_status(s, e);
    }
    ml_tensor_drop(&scr);
    ml_tensor_drop(&ct);
    return s;
}

/* ---- index ops ---------------------------------------------------------------------- */

/* idx is i64 on t's device. */
static ml_status check_index_tensor(const ml_tensor *t, const ml_tensor *idx, ml_err *e)
{
    ML_TRY(ml_check_live(idx, "idx", e));
    ML_TRY(check_same_device(t, idx, e));
    return ml_check_input(idx, "idx", idx->st->device, ML_DT(ML_I64), idx->ndim, 0, e);
}

/* Every index of idx (contiguous) in [0, bound), checked on its device. */
static ml_status check_index_values(ml_host *h, const ml_tensor *idx, int64_t bound, ml_err *e)
{
    int64_t bad, v;
    ML_TRY(ml_find_bad_index(h, idx, bound, &bad, &v, e));
    if (bad < 0)
        return ML_OK;
    return ml_err_set(e, ML_EINVAL, "idx: index %lld at position %lld is outside [0, %lld) "
                      "(indices are 0-based)", (long long)v, (long long)bad, (long long)bound);
}

/* idx must match t in every dim but d. */
static ml_status check_index_shape(const ml_tensor *t, const ml_tensor *idx, int d, ml_err *e)
{
    int ok = idx->ndim == t->ndim;
    for (int i = 0; ok && i < t->ndim; i++)
        ok = i == d || idx->shape[i] == t->shape[i];
    if (ok)
        return ML_OK;
    char st[128], si[128];
    ml_format_shape(t, st, sizeof st);
    ml_format_shape(idx, si, sizeof si);
    return ml_err_set(e, ML_EINVAL, "index shape %s must equal %s except in dim %d", si, st, d + 1);
}

/* Which index op runs on the contiguous copies. */
typedef enum { INDEX_SELECT, INDEX_GATHER, INDEX_SCATTER_ADD } index_kind;

/* Contiguous copies of t (unless in place), idx and src, the index check,
 * the output, the kernel. */
static ml_status index_run(ml_host *h, index_kind kind, ml_tensor *out, const ml_tensor *t, int d,
                           const ml_tensor *idx, const ml_tensor *src, ml_err *e)
{
    ml_device dev = t->st->device;
    ml_tensor ct = {0}, ci = {0}, cs = {0};
    ml_status s = kind == INDEX_SCATTER_ADD ? ML_OK : ml_op_contiguous(h, &ct, t, e);
    if (s == ML_OK)
        s = ml_op_contiguous(h, &ci, idx, e);
    if (s == ML_OK && src)
        s = ml_op_contiguous(h, &cs, src, e);
    if (s == ML_OK)
        s = check_index_values(h, &ci, t->shape[d], e);
    int64_t shape[ML_MAXDIM], outer, r, inner;
    memcpy(shape, kind == INDEX_GATHER ? idx->shape : t->shape, sizeof shape);
    if (kind == INDEX_SELECT)
        shape[d] = idx->shape[0];
    if (s == ML_OK && kind != INDEX_SCATTER_ADD)
        s = ml_prepare_output(h, out, "out", dev, t->dtype, t->ndim, shape, e);
    split_dims(t, d, &outer, &r, &inner);
    ml_kctx c = ml_host_kctx(h);
    if (s == ML_OK && kind == INDEX_SELECT)
        s = ml_kernel_status(ML_KCALL(h, dev, index_select, t->dtype, ml_data(out), ml_data(&ct),
                             ml_data(&ci), outer, r, inner, idx->shape[0], &c), e);
    else if (s == ML_OK && kind == INDEX_GATHER)
        s = ml_kernel_status(ML_KCALL(h, dev, gather, t->dtype, ml_data(out), ml_data(&ct), ml_data(&ci),
                             outer, r, inner, idx->shape[d], &c), e);
    else if (s == ML_OK)
        s = ml_kernel_status(ML_KCALL(h, dev, scatter_add, t->dtype, ml_data(t), ml_data(&cs), ml_data(&ci),
                             outer, r, inner, idx->shape[d], &c), e);
    ml_tensor_drop(&ct);
    ml_tensor_drop(&ci);
    ml_tensor_drop(&cs);
    return s;
}

ml_status ml_op_index_select(ml_host *h, ml_tensor *out, const ml_tensor *t, int d,
                             const ml_tensor *idx, ml_err *e)
{
    ML_TRY(ml_check_live(t, "t", e));
    ML_TRY(ml_check_dim(t, d, e));
    ML_TRY(check_index_tensor(t, idx, e));
    if (idx->ndim != 1)
        return ml_err_set(e, ML_EINVAL, "idx must be 1-dim, got %d dims", idx->ndim);
    return index_run(h, INDEX_SELECT, out, t, d, idx, NULL, e);
}

ml_status ml_op_gather(ml_host *h, ml_tensor *out, const ml_tensor *t, int d,
                       const ml_tensor *idx, ml_err *e)
{
    ML_TRY(ml_check_live(t, "t", e));
    ML_TRY(ml_check_dim(t, d, e));
    ML_TRY(check_index_tensor(t, idx, e));
    ML_TRY(check_index_shape(t, idx, d, e));
    return index_run(h, INDEX_GATHER, out, t, d, idx, NULL, e);
}

ml_status ml_op_scatter_add(ml_host *h, ml_tensor *t, int d, const ml_tensor *idx,
                            const ml_tensor *src, ml_err *e)
{
    ML_TRY(ml_check_live(t, "t", e));
    ML_TRY(ml_check_input(t, "t", t->st->device, ML_DT_ANY, t->ndim, 1, e));
    ML_TRY(ml_check_dim(t, d, e));
    ML_TRY(ml_check_live(idx, "idx", e));
    ML_TRY(ml_check_live(src, "src", e));
    ML_TRY(check_same_device(t, idx, e));
    ML_TRY(check_same_device(t, src, e));
    if (src->dtype != t->dtype)
        return ml_err_set(e, ML_EINVAL, "source dtype %s differs from %s",
                          ml_dtype_names[src->dtype], ml_dtype_names[t->dtype]);
    ML_TRY(check_index_shape(t, idx, d, e));
    int same = src->ndim == idx->ndim;
    for (int i = 0; same && i < idx->ndim; i++)
        same = src->shape[i] == idx->shape[i];
    if (!same) {
        char ss[128], si[128];
        ml_format_shape(src, ss, sizeof ss);
        ml_format_shape(idx, si, sizeof si);
        return ml_err_set(e, ML_EINVAL, "source shape %s differs from index shape %s", ss, si);
    }
    ML_TRY(ml_check_input(idx, "idx", idx->st->device, ML_DT(ML_I64), idx->ndim, 0, e));
    ML_TRY(check_dtype_in(t, ML_DT_FLOAT | ML_DT_INT, e));
    return index_run(h, INDEX_SCATTER_ADD, NULL, t, d, idx, src, e);
}

ml_status ml_op_bincount(ml_host *h, ml_tensor *out, const ml_tensor *idx, int64_t nbins,
                         ml_err *e)
{
    ML_TRY(ml_check_live(idx, "idx", e));
    if (nbins < 0)
        return ml_err_set(e, ML_EINVAL, "nbins must be >= 0, got %lld", (long long)nbins);
    if (idx->ndim != 1)
        return ml_err_set(e, ML_EINVAL, "idx must be 1-dim, got %d dims", idx->ndim);
    ML_TRY(ml_check_input(idx, "idx", idx->st->device, ML_DT(ML_I64), 1, 0, e));
    ml_device dev = idx->st->device;
    ml_tensor ci = {0};
    ml_status s = ml_op_contiguous(h, &ci, idx, e);
    if (s == ML_OK)
        s = check_index_values(h, &ci, nbins, e);
    if (s == ML_OK)
        s = ml_prepare_output(h, out, "out", dev, ML_I64, 1, &nbins, e);
    if (s == ML_OK) {
        ml_kctx c = ml_host_kctx(h);
        s = ml_kernel_status(ML_KCALL(h, dev, bincount, ml_data(out), ml_data(&ci), ml_numel(&ci), nbins, &c),
                    e);
    }
    ml_tensor_drop(&ci);
    return s;
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

/* t itself when BLAS reads its layout (and a batch stride that is not
 * negative), else a contiguous copy in *tmp; sets trans and ld. */
static ml_status blas_operand(ml_host *h, const ml_tensor *t, ml_tensor *tmp,
                              const ml_tensor **use, int *trans, int64_t *ld, ml_err *e)
{
    *use = t;
    if (blas_layout(t, trans, ld) && !(t->ndim == 3 && t->stride[0] < 0))
        return ML_OK;
    ML_TRY(ml_tensor_alloc(h, tmp, t->st->device, t->dtype, t->ndim, t->shape, e));
    *use = tmp;
    blas_layout(tmp, trans, ld);
    return ml_op_copy(h, tmp, t, e);
}

static ml_status matmul_args(const ml_host *h, const ml_tensor *a, const ml_tensor *b,
                             ml_gemm_shape *g, ml_err *e)
{
    ML_TRY(ml_check_live(a, "a", e));
    ML_TRY(ml_check_live(b, "b", e));
    ML_TRY(check_same_device(a, b, e));
    if (a->dtype != b->dtype)
        return ml_err_set(e, ML_EINVAL, "dtypes differ (%s and %s)", ml_dtype_names[a->dtype],
                          ml_dtype_names[b->dtype]);
    if (a->ndim < 2 || a->ndim > 3 || b->ndim < 2 || b->ndim > 3 || (a->ndim == 2 && b->ndim == 3))
        return ml_err_set(e, ML_EINVAL, "expected [m,k]x[k,n], [B,m,k]x[B,k,n] or [B,m,k]x[k,n]; "
                          "got %d and %d dims", a->ndim, b->ndim);
    ML_TRY(ml_check_input(a, "a", a->st->device, ml_float_dtypes(h, a->st->device, ML_OP_MATMUL),
                          a->ndim, 0, e));
    g->m = a->shape[a->ndim - 2];
    g->k = a->shape[a->ndim - 1];
    g->n = b->shape[b->ndim - 1];
    g->batch = a->ndim == 3 ? a->shape[0] : 1;
    int64_t kb = b->shape[b->ndim - 2];
    if (g->k != kb || (b->ndim == 3 && b->shape[0] != g->batch)) {
        char sa[128], sb[128];
        ml_format_shape(a, sa, sizeof sa);
        ml_format_shape(b, sb, sizeof sb);
        return ml_err_set(e, ML_EINVAL, "shapes %s and %s do not agree on the %s", sa, sb,
                          g->k != kb ? "inner dimension" : "batch dimension");
    }
    return ML_OK;
}

/* C = alpha A B + beta C on BLAS-readable operands (C of A's dtype, or f32
 * for bf16 A and B: mixed precision's weight gradients, kernels/matmul.h). BLAS is not asked
 * about empty sums: with k = 0, C = beta C (C not read when beta = 0). */
static ml_status matmul_run(ml_host *h, ml_tensor *c, const ml_tensor *a, const ml_tensor *b,
                            ml_gemm_shape *g, ml_err *e)
{
    ml_device dev = c->st->device;
    ml_kctx kc = ml_host_kctx(h);
    g->sa = a->ndim == 3 ? a->stride[0] : 0;
    g->sb = b->ndim == 3 ? b->stride[0] : 0;
    g->ldc = g->n > 0 ? g->n : 1;
    g->sc = g->m * g->n;
    if (g->m == 0 || g->n == 0)
        return ML_OK;
    if (g->k == 0)
        return ml_kernel_status(g->beta == 0
                       ? ML_KCALL(h, dev, fill, c->dtype, ml_data(c), 0, ml_numel(c), &kc)
                       : ML_KCALL(h, dev, binary_scalar, ML_MUL, c->dtype, ml_data(c), ml_data(c),
                                  g->beta, 0, ml_numel(c), &kc), e);
    if (g->m > INT32_MAX || g->n > INT32_MAX || g->k > INT32_MAX || g->lda > INT32_MAX ||
        g->ldb > INT32_MAX)
        return ml_err_set(e, ML_EINVAL, "a dimension exceeds the BLAS integer range");
    return ml_kernel_status(ML_KCALL(h, dev, matmul, a->dtype, c->dtype, ml_data(c), ml_data(a),
                                     ml_data(b), g, &kc), e);
}

ml_status ml_op_matmul(ml_host *h, ml_tensor *c, const ml_tensor *a, const ml_tensor *b,
                       double alpha, double beta, ml_err *e)
{
    ml_gemm_shape g = {.alpha = alpha, .beta = c->st ? beta : 0};
    ML_TRY(matmul_args(h, a, b, &g, e));
    int64_t shape[3] = {g.batch, g.m, g.n};
    int nd = a->ndim;
    const int64_t *oshape = nd == 3 ? shape : shape + 1;
    int given = c->st != NULL;
    ml_dtype cdt = given && a->dtype == ML_BF16 && c->dtype == ML_F32 ? ML_F32 : a->dtype;
    ML_TRY(ml_prepare_output(h, c, "out", a->st->device, cdt, nd, oshape, e));
    if (given && (ml_tensors_overlap(c, a) || ml_tensors_overlap(c, b)))
        return ml_err_set(e, ML_EINVAL, "out overlaps an input");
    ml_tensor ta = {0}, tb = {0};
    const ml_tensor *ua, *ub;
    ml_status s = blas_operand(h, a, &ta, &ua, &g.ta, &g.lda, e);
    if (s == ML_OK)
        s = blas_operand(h, b, &tb, &ub, &g.tb, &g.ldb, e);
    if (s == ML_OK)
        s = matmul_run(h, c, ua, ub, &g, e);
    ml_tensor_drop(&ta);
    ml_tensor_drop(&tb);
    return s;
}
