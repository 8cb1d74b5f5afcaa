/*
 * host/runtime/ops_view.c - views, copies, fills, arange and random draws
 * (host/runtime/ops_view.h).
 */
#include "ops_view.h"

#include <math.h>
#include <string.h>

#define ML_DT_RANDOM (ML_DT_FLOAT | ML_DT(ML_BF16) | ML_DT(ML_F16))

/* out becomes a view of t's storage; stride NULL: contiguous strides. */
static ml_status set_view(ml_tensor *out, const ml_tensor *t, int64_t offset, int ndim,
                          const int64_t *shape, const int64_t *stride)
{
    out->st = t->st;
    out->offset = offset;
    out->dtype = t->dtype;
    out->ndim = ndim;
    memmove(out->shape, shape, (size_t)ndim * sizeof *shape);
    if (stride)
        memmove(out->stride, stride, (size_t)ndim * sizeof *stride);
    else
        ml_set_contiguous_strides(out);
    ml_storage_retain(out->st);
    return ML_OK;
}

/* ---- views ------------------------------------------------------------------ */

ml_status ml_op_narrow(ml_tensor *out, const ml_tensor *t, int d, int64_t start, int64_t len,
                       ml_err *e)
{
    ML_TRY(ml_check_view(t, "t", e));
    ML_TRY(ml_check_dim(t, d, e));
    if (start < 0 || len < 0 || start > t->shape[d] - len)
        return ml_err_set(e, ML_EINVAL, "%lld entries from %lld are outside dim %d of size %lld "
                          "(0-based)", (long long)len, (long long)start, d, (long long)t->shape[d]);
    int64_t shape[ML_MAXDIM];
    memcpy(shape, t->shape, sizeof shape);
    shape[d] = len;
    return set_view(out, t, t->offset + start * t->stride[d], t->ndim, shape, t->stride);
}

ml_status ml_op_select(ml_tensor *out, const ml_tensor *t, int d, int64_t i, ml_err *e)
{
    ML_TRY(ml_check_view(t, "t", e));
    ML_TRY(ml_check_dim(t, d, e));
    if (i < 0 || i >= t->shape[d])
        return ml_err_set(e, ML_EINVAL, "index %lld is outside dim %d of size %lld (0-based)",
                          (long long)i, d, (long long)t->shape[d]);
    int64_t shape[ML_MAXDIM], stride[ML_MAXDIM];
    int nd = 0;
    for (int k = 0; k < t->ndim; k++) {
        if (k == d)
            continue;
        shape[nd] = t->shape[k];
        stride[nd++] = t->stride[k];
    }
    return set_view(out, t, t->offset + i * t->stride[d], nd, shape, stride);
}

/* shape with its one -1 inferred so that it holds n elements. */
static ml_status reshape_target(int64_t n, int ndim, const int64_t *want, int64_t *shape,
                                ml_err *e)
{
    int infer = -1;
    int64_t known = 1;
    if (ndim < 0 || ndim > ML_MAXDIM)
        return ml_err_set(e, ML_EINVAL, "%d dims given, at most %d are supported", ndim, ML_MAXDIM);
    for (int i = 0; i < ndim; i++) {
        shape[i] = want[i];
        if (shape[i] == -1 && infer < 0) {
            infer = i;
        } else if (shape[i] < 0) {
            return ml_err_set(e, ML_EINVAL, "size %lld of dim %d is invalid", (long long)shape[i],
                              i + 1);
        } else {
            if (shape[i] && known > INT64_MAX / shape[i])
                return ml_err_set(e, ML_EINVAL, "shape has too many elements");
            known *= shape[i];
        }
    }
    if (infer >= 0) {
        if (known == 0 || n % known)
            return ml_err_set(e, ML_EINVAL, "cannot infer dim %d: %lld elements do not divide by %lld",
                              infer + 1, (long long)n, (long long)known);
        shape[infer] = n / known;
        known = n;
    }
    if (known != n)
        return ml_err_set(e, ML_EINVAL, "shape has %lld elements, the tensor has %lld",
                          (long long)known, (long long)n);
    return ML_OK;
}

ml_status ml_op_view(ml_tensor *out, const ml_tensor *t, int ndim, const int64_t *shape, ml_err *e)
{
    ML_TRY(ml_check_view(t, "t", e));
    if (!ml_is_contiguous(t))
        return ml_err_set(e, ML_EINVAL, "the tensor is not contiguous (use :reshape or :contiguous)");
    int64_t s[ML_MAXDIM];
    ML_TRY(reshape_target(ml_numel(t), ndim, shape, s, e));
    return set_view(out, t, t->offset, ndim, s, NULL);
}

ml_status ml_op_reshape(ml_host *h, ml_tensor *out, const ml_tensor *t, int ndim,
                        const int64_t *shape, ml_err *e)
{
    ML_TRY(ml_check_live(t, "t", e));
    int64_t s[ML_MAXDIM];
    ML_TRY(reshape_target(ml_numel(t), ndim, shape, s, e));
    /* out holds t's storage or a contiguous copy of it, then takes the shape */
    ML_TRY(ml_op_contiguous(h, out, t, e));
    out->ndim = ndim;
    memcpy(out->shape, s, (size_t)ndim * sizeof *s);
    ml_set_contiguous_strides(out);
    return ML_OK;
}

ml_status ml_op_view_at(ml_tensor *out, const ml_tensor *t, int64_t offset, int ndim,
                        const int64_t *shape, ml_err *e)
{
    ML_TRY(ml_check_view(t, "t", e));
    if (!ml_is_contiguous(t))
        return ml_err_set(e, ML_EINVAL, "the tensor is not contiguous");
    if (ndim < 0 || ndim > ML_MAXDIM)
        return ml_err_set(e, ML_EINVAL, "%d dims given, at most %d are supported", ndim, ML_MAXDIM);
    int64_t n = ml_shape_numel(ndim, shape), have = ml_numel(t);
    if (n < 0)
        return ml_err_set(e, ML_EINVAL, "shape has a negative size or too many elements");
    if (offset < 0 || offset > have || n > have - offset)
        return ml_err_set(e, ML_EINVAL, "%lld elements at offset %lld do not fit in %lld",
                          (long long)n, (long long)offset, (long long)have);
    return set_view(out, t, t->offset + offset, ndim, shape, NULL);
}

ml_status ml_op_transpose(ml_tensor *out, const ml_tensor *t, int a, int b, ml_err *e)
{
    ML_TRY(ml_check_view(t, "t", e));
    ML_TRY(ml_check_dim(t, a, e));
    ML_TRY(ml_check_dim(t, b, e));
    int64_t shape[ML_MAXDIM], stride[ML_MAXDIM];
    memcpy(shape, t->shape, sizeof shape);
    memcpy(stride, t->stride, sizeof stride);
    shape[a] = t->shape[b]; shape[b] = t->shape[a];
    stride[a] = t->stride[b]; stride[b] = t->stride[a];
    return set_view(out, t, t->offset, t->ndim, shape, stride);
}

/* ---- copies ------------------------------------------------------------------ */

/* The copy kernel of their (common) device: any strides, any dtypes. */
static ml_status copy_kernel(ml_host *h, ml_tensor *dst, const ml_tensor *src, ml_err *e)
{
    ml_kctx c = ml_host_kctx(h);
    return ml_kernel_status(ML_KCALL(h, dst->st->device, copy, dst->dtype, ml_data(dst), dst->stride,
                                     src->dtype, ml_data(src), src->stride, src->ndim, src->shape,
                                     &c), e);
}

/* A new contiguous tensor like t (dtype dt) on t's device, holding t's values. */
static ml_status copy_new(ml_host *h, ml_tensor *out, const ml_tensor *t, ml_dtype dt, ml_err *e)
{
    ML_TRY(ml_tensor_alloc(h, out, t->st->device, dt, t->ndim, t->shape, e));
    return copy_kernel(h, out, t, e);
}

/* Across devices: a contiguous staging copy of src on its own device in
 * dst's dtype, one byte copy, then a strided copy into dst if needed. */
static ml_status copy_across(ml_host *h, ml_tensor *dst, const ml_tensor *src, ml_err *e)
{
    if (!h->mem[ML_CUDA])
        return ml_err_set(e, ML_EINVAL, "device cuda is not available (%s)",
                          ml_device_unavailable_reason(h, ML_CUDA));
    ml_tensor stage_src = {0}, stage_dst = {0};
    const ml_tensor *s = src;
    ml_tensor *d = dst;
    ml_status st = ML_OK;
    if (!ml_is_contiguous(src) || src->dtype != dst->dtype) {
        st = copy_new(h, &stage_src, src, dst->dtype, e);
        s = &stage_src;
    }
    if (st == ML_OK && !ml_is_contiguous(dst)) {
        st = ml_tensor_alloc(h, &stage_dst, dst->st->device, dst->dtype, dst->ndim, dst->shape, e);
        d = &stage_dst;
    }
    if (st == ML_OK) {
        ml_copy_dir dir = d->st->device == ML_CPU ? ML_COPY_D2H : ML_COPY_H2D;
        st = ml_kernel_status(h->mem[ML_CUDA]->memcpy(ml_data(d), ml_data(s), ml_nbytes(s), dir, NULL), e);
    }
    if (st == ML_OK && d != dst)
        st = copy_kernel(h, dst, d, e);
    ml_tensor_drop(&stage_src);
    ml_tensor_drop(&stage_dst);
    return st;
}

ml_status ml_op_copy(ml_host *h, ml_tensor *dst, const ml_tensor *src, ml_err *e)
{
    ML_TRY(ml_check_live(dst, "dst", e));
    ML_TRY(ml_check_live(src, "src", e));
    int same = dst->ndim == src->ndim;
    for (int i = 0; same && i < dst->ndim; i++)
        same = dst->shape[i] == src->shape[i];
    if (!same) {
        char sd[128], ss[128];
        ml_format_shape(dst, sd, sizeof sd);
        ml_format_shape(src, ss, sizeof ss);
        return ml_err_set(e, ML_EINVAL, "shapes %s and %s differ", sd, ss);
    }
    if (dst->st->device != src->st->device)
        return copy_across(h, dst, src, e);
    if (!ml_tensors_overlap(dst, src))
        return copy_kernel(h, dst, src, e);
    ml_tensor tmp = {0};   /* overlapping views of one buffer: through a copy */
    ml_status st = copy_new(h, &tmp, src, src->dtype, e);
    if (st == ML_OK)
        st = copy_kernel(h, dst, &tmp, e);
    ml_tensor_drop(&tmp);
    return st;
}

ml_status ml_op_contiguous(ml_host *h, ml_tensor *out, const ml_tensor *t, ml_err *e)
{
    ML_TRY(ml_check_live(t, "t", e));
    if (ml_is_contiguous(t))
        return set_view(out, t, t->offset, t->ndim, t->shape, t->stride);
    return copy_new(h, out, t, t->dtype, e);
}

/* ---- fill, arange, random ------------------------------------------------------ */

ml_status ml_op_fill(ml_host *h, ml_tensor *t, double v, ml_err *e)
{
    ML_TRY(ml_check_live(t, "t", e));
    ml_device dev = t->st->device;
    ml_kctx c = ml_host_kctx(h);
    if (ml_is_contiguous(t))
        return ml_kernel_status(ML_KCALL(h, dev, fill, t->dtype, ml_data(t), v, ml_numel(t), &c), e);
    /* a strided view: the copy kernel broadcasts one value with zero strides */
    static const int64_t zero[ML_MAXDIM];
    int64_t one = 1;
    ml_tensor s = {0};
    ml_status st = ml_tensor_alloc(h, &s, dev, t->dtype, 1, &one, e);
    if (st == ML_OK)
        st = ml_kernel_status(ML_KCALL(h, dev, fill, t->dtype, ml_data(&s), v, 1, &c), e);
    if (st == ML_OK)
        st = ml_kernel_status(ML_KCALL(h, dev, copy, t->dtype, ml_data(t), t->stride, t->dtype,
                                       ml_data(&s), zero, t->ndim, t->shape, &c), e);
    ml_tensor_drop(&s);
    return st;
}

ml_status ml_op_arange(ml_host *h, ml_tensor *out, ml_device dev, ml_dtype dt, double start,
                       double stop, double step, ml_err *e)
{
    if (step == 0 || isnan(step) || isnan(start) || isnan(stop))
        return ml_err_set(e, ML_EINVAL, "step must be a non-zero number and bounds must not be NaN");
    double count = ceil((stop - start) / step);
    if (count < 0)
        count = 0;
    if (count > 9.0e15)
        return ml_err_set(e, ML_EINVAL, "too many elements (%.6g)", count);
    int64_t n = (int64_t)count;
    ML_TRY(ml_prepare_output(h, out, "out", dev, dt, 1, &n, e));
    ml_kctx c = ml_host_kctx(h);
    return ml_kernel_status(ML_KCALL(h, dev, arange, dt, ml_data(out), start, step, n, &c), e);
}

static ml_status draw(ml_host *h, ml_tensor *t, int normal, uint64_t seed, uint64_t offset,
                      double a, double b, ml_err *e)
{
    ML_TRY(ml_check_live(t, "t", e));
    if (!(ML_DT_RANDOM & ML_DT(t->dtype)))
        return ml_err_set(e, ML_EINVAL, "random draws need a float dtype, got %s",
                          ml_dtype_names[t->dtype]);
    ML_TRY(ml_check_input(t, "t", t->st->device, ML_DT_RANDOM, t->ndim, 1, e));
    if (normal ? !(b >= 0) : !(a <= b))
        return ml_err_set(e, ML_EINVAL, normal ? "std must be >= 0, got %g"
                                               : "lo (%g) must not exceed hi", normal ? b : a);
    ml_device dev = t->st->device;
    ml_kctx c = ml_host_kctx(h);
    int64_t n = ml_numel(t);
    return ml_kernel_status(normal ? ML_KCALL(h, dev, randn, t->dtype, ml_data(t), n, seed, offset, a, b, &c)
                                   : ML_KCALL(h, dev, rand, t->dtype, ml_data(t), n, seed, offset, a, b, &c),
                            e);
}

ml_status ml_op_rand(ml_host *h, ml_tensor *t, uint64_t seed, uint64_t offset, double lo,
                     double hi, ml_err *e)
{
    return draw(h, t, 0, seed, offset, lo, hi, e);
}

ml_status ml_op_randn(ml_host *h, ml_tensor *t, uint64_t seed, uint64_t offset, double mean,
                      double std, ml_err *e)
{
    return draw(h, t, 1, seed, offset, mean, std, e);
}
