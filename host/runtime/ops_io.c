/*
 * host/runtime/ops_io.c - reading safetensors entries into tensors
 * (host/runtime/ops_io.h).
 */
#include "ops_io.h"

static int is_float(ml_dtype dt)
{
    return dt == ML_F32 || dt == ML_F64 || dt == ML_BF16 || dt == ML_F16;
}

static size_t min_size(size_t a, size_t b)
{
    return a < b ? a : b;
}

/* Read n elements from element `at` of the entry, staged: into stage (the
 * file's dtype), converted into conv (dst's dtype; NULL: no conversion)
 * or straight into dst on the CPU, then uploaded to a device dst. */
static ml_status read_chunk(ml_host *h, ml_tensor *dst, const ml_st_file *f, size_t i, int64_t at,
                            int64_t n, void *stage, void *conv, ml_err *e)
{
    const ml_st_entry *en = &f->entries[i];
    size_t es = ml_dtype_size(en->dtype), ed = ml_dtype_size(dst->dtype);
    char err[512];
    if (ml_st_read_range(f, i, (uint64_t)at * es, (size_t)n * es, stage, err, sizeof err))
        return ml_err_set(e, ML_EIO, "%s", err);
    ml_device dev = dst->st->device;
    char *out = (char *)ml_data(dst) + (size_t)at * ed;
    const void *ready = stage;
    if (dst->dtype != en->dtype) {
        static const int64_t one = 1;
        void *to = dev == ML_CPU ? out : conv;
        ml_kctx c = ml_host_kctx(h);
        ML_TRY(ml_kernel_status(ML_KCALL(h, ML_CPU, copy, dst->dtype, to, &one, en->dtype, stage, &one, 1,
                                         &n, &c), e));
        if (dev == ML_CPU)
            return ML_OK;
        ready = conv;
    }
    ml_copy_dir dir = dev == ML_CPU ? ML_COPY_H2H : ML_COPY_H2D;
    return ml_kernel_status(h->mem[dev]->memcpy(out, ready, (size_t)n * ed, dir, NULL), e);
}

ml_status ml_op_read_entry(ml_host *h, ml_tensor *dst, const ml_st_file *f, size_t i, ml_err *e)
{
    if (i >= f->nentries)
        return ml_err_set(e, ML_EINVAL, "no entry #%zu in %s", i, f->label ? f->label : "the file");
    const ml_st_entry *en = &f->entries[i];
    if (!dst->st)
        return ml_err_set(e, ML_EINVAL, "'%s': the destination was freed", en->name);
    ML_TRY(ml_check_live(dst, "the destination", e));
    if (!ml_is_contiguous(dst))   /* a copy would receive the data, not dst */
        return ml_err_set(e, ML_EINVAL, "'%s': the destination must be contiguous (a view of "
                          "contiguous storage; read into it, then copy)", en->name);
    int64_t n = ml_shape_numel(en->ndim, en->shape);
    if (n != ml_numel(dst))
        return ml_err_set(e, ML_EINVAL, "'%s' has %lld elements, the destination %lld", en->name,
                          (long long)n, (long long)ml_numel(dst));
    if (en->dtype != dst->dtype && !(is_float(en->dtype) && is_float(dst->dtype)))
        return ml_err_set(e, ML_EINVAL, "'%s' is %s in the file and cannot be converted to %s",
                          en->name, ml_dtype_names[en->dtype], ml_dtype_names[dst->dtype]);
    if (h->planning || n == 0)
        return ML_OK;
    ml_device dev = dst->st->device;
    if (dev == ML_CPU && dst->dtype == en->dtype) {
        char err[512];
        if (ml_st_read(f, i, ml_data(dst), err, sizeof err))
            return ml_err_set(e, ML_EIO, "%s", err);
        return ML_OK;
    }
    size_t es = ml_dtype_size(en->dtype), ed = ml_dtype_size(dst->dtype);
    int64_t chunk = (int64_t)min_size((size_t)n, ML_IO_STAGE_BYTES / (es > ed ? es : ed));
    ml_tensor stage = {0}, conv = {0};
    int64_t sb = chunk * (int64_t)es, cb = chunk * (int64_t)ed;
    ml_status s = ml_tensor_alloc(h, &stage, ML_CPU, ML_U8, 1, &sb, e);
    if (s == ML_OK && dev != ML_CPU && dst->dtype != en->dtype)
        s = ml_tensor_alloc(h, &conv, ML_CPU, ML_U8, 1, &cb, e);
    for (int64_t at = 0; s == ML_OK && at < n; at += chunk)
        s = read_chunk(h, dst, f, i, at, n - at < chunk ? n - at : chunk, ml_data(&stage),
                       conv.st ? ml_data(&conv) : NULL, e);
    ml_tensor_drop(&conv);
    ml_tensor_drop(&stage);
    return s;
}
