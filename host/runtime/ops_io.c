/*
 * host/runtime/ops_io.c - safetensors entries and element ranges to and
 * from tensors (host/runtime/ops_io.h).
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

/* t (a read's destination, or a write's source when `writing`) against
 * elements [off, off + numel(t)) of entry i: live, contiguous, inside the
 * entry, of a dtype that converts. */
static ml_status check_range(const ml_st_file *f, size_t i, int64_t off, const ml_tensor *t,
                             int writing, ml_err *e)
{
    const char *what = writing ? "the source" : "the destination";
    if (i >= f->nentries)
        return ml_err_set(e, ML_EINVAL, "no entry #%zu in %s", i, f->label ? f->label : "the file");
    const ml_st_entry *en = &f->entries[i];
    if (!t->st)
        return ml_err_set(e, ML_EINVAL, "'%s': %s was freed", en->name, what);
    ML_TRY(ml_check_live(t, what, e));
    if (!ml_is_contiguous(t))   /* a copy would take part, not t */
        return ml_err_set(e, ML_EINVAL, "'%s': %s must be contiguous (%s)", en->name, what,
                          writing ? "write a contiguous copy"
                                  : "a view of contiguous storage; read into it, then copy");
    int64_t n = ml_shape_numel(en->ndim, en->shape), k = ml_numel(t);
    if (off < 0 || off > n || k > n - off)
        return ml_err_set(e, ML_EINVAL, "'%s': %lld elements at element offset %lld do not fit in "
                          "its %lld", en->name, (long long)k, (long long)off, (long long)n);
    if (en->dtype != t->dtype && !(is_float(en->dtype) && is_float(t->dtype)))
        return ml_err_set(e, ML_EINVAL, "'%s' is %s in the file and cannot be converted %s %s",
                          en->name, ml_dtype_names[en->dtype], writing ? "from" : "to",
                          ml_dtype_names[t->dtype]);
    return ML_OK;
}

/* One piece: elements [at, at + n) of t, which are elements off + at... of
 * entry i; stage holds them in the file's dtype, conv (NULL unless t is on
 * a device and converts) in t's. */
typedef ml_status (*chunk_fn)(ml_host *h, const ml_st_file *f, size_t i, int64_t off,
                              const ml_tensor *t, int64_t at, int64_t n, void *stage, void *conv,
                              ml_err *e);

/* Elements between the file's dtype `from` and `to` on the CPU. */
static ml_status convert(ml_host *h, ml_dtype to_dt, void *to, ml_dtype from_dt, const void *from,
                         int64_t n, ml_err *e)
{
    static const int64_t one = 1;
    ml_kctx c = ml_host_kctx(h);
    return ml_kernel_status(ML_KCALL(h, ML_CPU, copy, to_dt, to, &one, from_dt, from, &one, 1, &n,
                                     &c), e);
}

/* Read a piece: into stage, converted into conv or straight into t on the
 * CPU, then uploaded to a device t. */
static ml_status read_chunk(ml_host *h, const ml_st_file *f, size_t i, int64_t off,
                            const ml_tensor *t, int64_t at, int64_t n, void *stage, void *conv,
                            ml_err *e)
{
    const ml_st_entry *en = &f->entries[i];
    size_t es = ml_dtype_size(en->dtype), et = ml_dtype_size(t->dtype);
    char err[512];
    if (ml_st_read_range(f, i, (uint64_t)(off + at) * es, (size_t)n * es, stage, err, sizeof err))
        return ml_err_set(e, ML_EIO, "%s", err);
    ml_device dev = t->st->device;
    char *out = (char *)ml_data(t) + (size_t)at * et;
    const void *ready = stage;
    if (t->dtype != en->dtype) {
        ML_TRY(convert(h, t->dtype, dev == ML_CPU ? out : conv, en->dtype, stage, n, e));
        if (dev == ML_CPU)
            return ML_OK;
        ready = conv;
    }
    ml_copy_dir dir = dev == ML_CPU ? ML_COPY_H2H : ML_COPY_H2D;
    return ml_kernel_status(h->mem[dev]->memcpy(out, ready, (size_t)n * et, dir, NULL), e);
}

/* Write a piece: a device t downloaded into conv (or stage), converted
 * into stage, then written. */
static ml_status write_chunk(ml_host *h, const ml_st_file *f, size_t i, int64_t off,
                             const ml_tensor *t, int64_t at, int64_t n, void *stage, void *conv,
                             ml_err *e)
{
    const ml_st_entry *en = &f->entries[i];
    size_t et = ml_dtype_size(t->dtype);
    ml_device dev = t->st->device;
    const void *ready = (const char *)ml_data(t) + (size_t)at * et;
    if (dev != ML_CPU) {
        void *to = t->dtype != en->dtype ? conv : stage;
        ML_TRY(ml_kernel_status(h->mem[dev]->memcpy(to, ready, (size_t)n * et, ML_COPY_D2H, NULL),
                                e));
        ready = to;
    }
    if (t->dtype != en->dtype) {
        ML_TRY(convert(h, en->dtype, stage, t->dtype, ready, n, e));
        ready = stage;
    }
    char err[512];
    if (ml_st_write_range(f, i, (uint64_t)(off + at), (uint64_t)n, ready, err, sizeof err))
        return ml_err_set(e, ML_EIO, "%s", err);
    return ML_OK;
}

/* All of t in pieces through host stages of at most ML_IO_STAGE_BYTES
 * each, from the ledger, released before returning. */
static ml_status staged(ml_host *h, const ml_st_file *f, size_t i, int64_t off, const ml_tensor *t,
                        chunk_fn chunk, ml_err *e)
{
    const ml_st_entry *en = &f->entries[i];
    int64_t n = ml_numel(t);
    size_t es = ml_dtype_size(en->dtype), et = ml_dtype_size(t->dtype);
    int64_t step = (int64_t)min_size((size_t)n, ML_IO_STAGE_BYTES / (es > et ? es : et));
    int64_t sb = step * (int64_t)es, cb = step * (int64_t)et;
    ml_tensor stage = {0}, conv = {0};
    ml_status s = ml_tensor_alloc(h, &stage, ML_CPU, ML_U8, 1, &sb, e);
    if (s == ML_OK && t->st->device != ML_CPU && t->dtype != en->dtype)
        s = ml_tensor_alloc(h, &conv, ML_CPU, ML_U8, 1, &cb, e);
    for (int64_t at = 0; s == ML_OK && at < n; at += step)
        s = chunk(h, f, i, off, t, at, n - at < step ? n - at : step, ml_data(&stage),
                  conv.st ? ml_data(&conv) : NULL, e);
    ml_tensor_drop(&conv);
    ml_tensor_drop(&stage);
    return s;
}

ml_status ml_op_read_range(ml_host *h, ml_tensor *dst, const ml_st_file *f, size_t i, int64_t off,
                           ml_err *e)
{
    ML_TRY(check_range(f, i, off, dst, 0, e));
    const ml_st_entry *en = &f->entries[i];
    int64_t n = ml_numel(dst);
    if (h->planning || n == 0)
        return ML_OK;
    if (dst->st->device == ML_CPU && dst->dtype == en->dtype) {
        size_t es = ml_dtype_size(en->dtype);
        char err[512];
        if (ml_st_read_range(f, i, (uint64_t)off * es, (size_t)n * es, ml_data(dst), err,
                             sizeof err))
            return ml_err_set(e, ML_EIO, "%s", err);
        return ML_OK;
    }
    return staged(h, f, i, off, dst, read_chunk, e);
}

ml_status ml_op_read_entry(ml_host *h, ml_tensor *dst, const ml_st_file *f, size_t i, ml_err *e)
{
    if (i < f->nentries && dst->st) {
        const ml_st_entry *en = &f->entries[i];
        int64_t n = ml_shape_numel(en->ndim, en->shape);
        if (n != ml_numel(dst))
            return ml_err_set(e, ML_EINVAL, "'%s' has %lld elements, the destination %lld",
                              en->name, (long long)n, (long long)ml_numel(dst));
    }
    return ml_op_read_range(h, dst, f, i, 0, e);
}

ml_status ml_op_write_range(ml_host *h, const ml_st_file *f, size_t i, int64_t off,
                            const ml_tensor *src, ml_err *e)
{
    ML_TRY(check_range(f, i, off, src, 1, e));
    const ml_st_entry *en = &f->entries[i];
    int64_t n = ml_numel(src);
    if (h->planning || n == 0)
        return ML_OK;
    if (src->st->device == ML_CPU && src->dtype == en->dtype) {
        char err[512];
        if (ml_st_write_range(f, i, (uint64_t)off, (uint64_t)n, ml_data(src), err, sizeof err))
            return ml_err_set(e, ML_EIO, "%s", err);
        return ML_OK;
    }
    return staged(h, f, i, off, src, write_chunk, e);
}
