/*
 * host/runtime/op.c - the op layer's common part (host/runtime/op.h):
 * messages, allocation (ledger tensors and pool views) with the
 * reclaim-and-retry rule, argument checks.
 */
#include "op.h"
#include "../../kernels/gemm.h"
#ifdef ML_WITH_CUDA
#include "backend_cuda.h"
#endif

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

ml_status ml_err_set(ml_err *e, ml_status s, const char *fmt, ...)
{
    if (s == ML_OK || !e)
        return s;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->msg, sizeof e->msg, fmt, ap);
    va_end(ap);
    return s;
}

ml_status ml_kernel_status(ml_status s, ml_err *e)
{
    switch (s) {
    case ML_OK:           return s;
    case ML_EINTERRUPTED: return ml_err_set(e, s, "interrupted");
    case ML_ENAN:         return ml_err_set(e, s, "NaN in the input");
    case ML_EUNSUPPORTED: return ml_err_set(e, s, "not supported on this device for this dtype");
#ifdef ML_WITH_CUDA
    case ML_EDEVICE:      return ml_err_set(e, s, "the device reported an error: %s", ml_cuda_last_error());
#else
    case ML_EDEVICE:      return ml_err_set(e, s, "the device reported an error");
#endif
    case ML_EINVAL: case ML_EALLOC: case ML_EIO:
        return s;         /* an op's own status: its message is already set */
    }
    return ml_err_set(e, s, "unknown status %d", (int)s);
}

ml_kctx ml_host_kctx(const ml_host *h)
{
    ml_kctx c = {h->nthreads, h->interrupt, NULL, h->progress, h->progress_ud};
    return c;
}

void ml_host_set_threads(ml_host *h, int n)
{
    h->nthreads = n;
    ml_gemm_set_threads(n);
}

void ml_host_ledger_report(const ml_host *h, ml_tier tier, char *buf, size_t len)
{
    size_t rss = tier == ML_TIER_CPU ? ml_process_rss() : 0;
    size_t total = h->ledger[tier]->total;
    ml_ledger_format(h->ledger[tier], rss > total ? rss - total : 0,
                     tier == ML_TIER_CPU && !h->planning, buf, len);
}

const char *ml_device_unavailable_reason(const ml_host *h, ml_device dev)
{
    if (!h->mem[dev])
        return "built without it: make CUDA=1";
#ifdef ML_WITH_CUDA
    if (dev == ML_CUDA && ml_cuda_unavailable_reason()[0])
        return ml_cuda_unavailable_reason();
#endif
    return "no device present";
}

/* The element count of a shape to allocate: at most ML_MAXDIM dims, sizes
 * >= 0, bytes that fit a size_t for any dtype. */
static ml_status alloc_numel(int ndim, const int64_t *dims, int64_t *n, ml_err *e)
{
    *n = ndim >= 0 && ndim <= ML_MAXDIM ? ml_shape_numel(ndim, dims) : -1;
    if (*n < 0 || (uint64_t)*n > SIZE_MAX / 16)
        return ml_err_set(e, ML_EINVAL, "shape has more than %d dims, a negative size or too many "
                          "elements", ML_MAXDIM);
    return ML_OK;
}

/* t becomes all of st, contiguous [dims...] of dt. */
static void set_contiguous(ml_tensor *t, ml_storage *st, ml_dtype dt, int ndim, const int64_t *dims)
{
    t->st = st;
    t->offset = 0;
    t->dtype = dt;
    t->ndim = ndim;
    memcpy(t->shape, dims, (size_t)ndim * sizeof *dims);
    ml_set_contiguous_strides(t);
}

/* ml_alloc_refusal on any tier. */
static ml_status tier_refusal(const ml_host *h, ml_tier tier, ml_category cat, size_t nbytes,
                              ml_alloc_status s, const char *verb, ml_err *e)
{
    char want[32], limit[32], report[2048];
    const ml_ledger *lg = h->ledger[tier];
    const char *name = ml_category_names[cat];
    ml_format_bytes(nbytes, want, sizeof want);
    ml_format_bytes(s == ML_ALLOC_OVER_TOTAL ? lg->budget_total : lg->budget[cat], limit,
                    sizeof limit);
    ml_host_ledger_report(h, tier, report, sizeof report);
    if (s == ML_ALLOC_NOMEM)
        return ml_err_set(e, ML_EALLOC, "out of memory %s %s (%s) on %s\n%s", verb, want, name,
                          ml_tier_names[tier], report);
    return ml_err_set(e, ML_EALLOC, "%s %s (%s) on %s would exceed the %s budget of %s\n%s", verb,
                      want, name, ml_tier_names[tier], s == ML_ALLOC_OVER_TOTAL ? "total" : name,
                      limit, report);
}

ml_status ml_alloc_refusal(const ml_host *h, ml_device dev, ml_category cat, size_t nbytes,
                           ml_alloc_status s, const char *verb, ml_err *e)
{
    return tier_refusal(h, (ml_tier)dev, cat, nbytes, s, verb, e);
}

ml_status ml_tier_charge(ml_host *h, ml_tier tier, ml_category cat, size_t nbytes, const char *verb,
                         ml_ledger **book, ml_err *e)
{
    ml_alloc_status s = ml_tier_take(h, tier, cat, nbytes, book);
    if (s != ML_ALLOC_OK && h->reclaim) {
        /* the collector frees dead holders of every tier; only a device's
         * tier has an allocator cache to empty as well */
        uint64_t refused = h->ledger[tier]->nrefused;   /* one request: counted once */
        h->reclaim(h, tier == ML_TIER_CUDA ? ML_CUDA : ML_CPU);
        s = ml_tier_take(h, tier, cat, nbytes, book);
        h->ledger[tier]->nrefused = refused;
    }
    return s == ML_ALLOC_OK ? ML_OK : tier_refusal(h, tier, cat, nbytes, s, verb, e);
}

/* ml_tensor_alloc, or ml_tensor_reserve when `reserve`. */
static ml_status tensor_new(ml_host *h, ml_tensor *t, ml_device dev, ml_dtype dt, int ndim,
                            const int64_t *shape, int reserve, ml_err *e)
{
    ml_alloc_status (*make)(ml_host *, ml_device, size_t, ml_storage **) =
        reserve ? ml_storage_reserve : ml_storage_new;
    int64_t n;
    ML_TRY(alloc_numel(ndim, shape, &n, e));
    size_t nbytes = (size_t)n * ml_dtype_size(dt);
    ml_storage *st = NULL;
    ml_alloc_status s = make(h, dev, nbytes, &st);
    if ((s == ML_ALLOC_OVER_TOTAL || s == ML_ALLOC_OVER_CATEGORY || s == ML_ALLOC_NOMEM) && h->reclaim) {
        uint64_t refused = h->ledger[dev]->nrefused;   /* one request: counted once */
        h->reclaim(h, dev);
        s = make(h, dev, nbytes, &st);
        h->ledger[dev]->nrefused = refused;
    }
    if (s == ML_ALLOC_NODEVICE)
        return ml_err_set(e, ML_EINVAL, "device %s is not available (%s)", ml_device_names[dev],
                          ml_device_unavailable_reason(h, dev));
    if (s != ML_ALLOC_OK)
        return ml_alloc_refusal(h, dev, h->category, nbytes, s, reserve ? "reserving" : "allocating",
                                e);
    set_contiguous(t, st, dt, ndim, shape);
    if (h->allocated && !reserve)
        h->allocated(h, nbytes);
    return ML_OK;
}

ml_status ml_tensor_alloc(ml_host *h, ml_tensor *t, ml_device dev, ml_dtype dt, int ndim,
                          const int64_t *shape, ml_err *e)
{
    return tensor_new(h, t, dev, dt, ndim, shape, 0, e);
}

ml_status ml_tensor_reserve(ml_host *h, ml_tensor *t, ml_device dev, ml_dtype dt, int ndim,
                            const int64_t *shape, ml_err *e)
{
    return tensor_new(h, t, dev, dt, ndim, shape, 1, e);
}

int ml_pool_may_retry(ml_pool_status ps, ml_alloc_status as)
{
    return (ps == ML_POOL_LEDGER && (as == ML_ALLOC_OVER_TOTAL || as == ML_ALLOC_OVER_CATEGORY)) ||
           as == ML_ALLOC_NOMEM;
}

ml_status ml_pool_refusal(const ml_host *h, ml_device dev, ml_pool_status ps, ml_alloc_status as,
                          const char *what, ml_err *e)
{
    if (ps == ML_POOL_OUTSIDE_PLAN)
        return ml_err_set(e, ML_EALLOC, "%s: this pool was made outside moelua.mem.plan, which "
                          "cannot give it real memory (build the pool inside the planned function)",
                          what);
    if (as == ML_ALLOC_NODEVICE)
        return ml_err_set(e, ML_EINVAL, "device %s is not available (%s)", ml_device_names[dev],
                          ml_device_unavailable_reason(h, dev));
    if (ps != ML_POOL_LEDGER || as == ML_ALLOC_NOMEM)
        return ml_err_set(e, ML_EALLOC, "out of memory %s on %s", what, ml_device_names[dev]);
    char limit[32], report[2048];
    const ml_ledger *lg = h->ledger[dev];
    int total = as == ML_ALLOC_OVER_TOTAL;
    ml_format_bytes(total ? lg->budget_total : lg->budget[ML_CAT_POOL], limit, sizeof limit);
    ml_host_ledger_report(h, (ml_tier)dev, report, sizeof report);
    return ml_err_set(e, ML_EALLOC, "%s on %s would exceed the %s budget of %s\n%s", what,
                      ml_device_names[dev], total ? "total" : "pool", limit, report);
}

ml_status ml_pool_tensor(ml_host *h, ml_pool *p, ml_tensor *t, const char *name, ml_dtype dt,
                         int ndim, const int64_t *dims, ml_err *e)
{
    int64_t n;
    ML_TRY(alloc_numel(ndim, dims, &n, e));
    size_t nbytes = (size_t)n * ml_dtype_size(dt), slot;
    uint64_t id;
    void *data;
    ml_alloc_status as;
    ml_pool_retain(p);   /* the view's reference; h->reclaim might close the pool meanwhile */
    ml_pool_status ps = ml_pool_alloc(p, nbytes, &data, &slot, &id, &as);
    if (h->reclaim && ml_pool_may_retry(ps, as)) {
        uint64_t refused = p->lg->nrefused;   /* one request: counted once */
        h->reclaim(h, p->device);
        ps = ml_pool_alloc(p, nbytes, &data, &slot, &id, &as);
        p->lg->nrefused = refused;
    }
    if (ps != ML_POOL_OK) {
        char need[32], used[32], cap[32], what[160];
        ml_format_bytes(nbytes > SIZE_MAX - 63 ? nbytes : (nbytes + 63) & ~(size_t)63, need,
                        sizeof need);
        ml_format_bytes(p->used, used, sizeof used);
        ml_format_bytes(p->capacity, cap, sizeof cap);
        ml_pool_release(p);
        if (ps == ML_POOL_FULL)
            return ml_err_set(e, ML_EALLOC, "pool full: %s needs %s, %s of %s are in use "
                              "(grow=false)", name, need, used, cap);
        snprintf(what, sizeof what, "growing the pool for %s (needs %s, %s of %s in use)", name,
                 need, used, cap);
        return ml_pool_refusal(h, p->device, ps, as, what, e);
    }
    ml_storage *st = calloc(1, sizeof *st);
    if (!st) {
        ml_pool_rewind(p, slot);   /* the top slot: give it back */
        ml_pool_release(p);
        return ml_err_set(e, ML_EALLOC, "out of memory for a tensor header");
    }
    *st = (ml_storage){.data = data, .nbytes = nbytes, .device = p->device, .cat = ML_CAT_POOL,
                       .refs = 1, .host = p->host, .pool = p, .slot = slot, .id = id};
    set_contiguous(t, st, dt, ndim, dims);
    return ML_OK;
}

void ml_tensor_drop(ml_tensor *t)
{
    if (t && t->st) {
        ml_storage_release(t->st);
        t->st = NULL;
    }
}

/* "f32 or f64" for a dtype mask. */
static void format_dtypes(unsigned dtypes, char *buf, size_t len)
{
    size_t at = 0;
    int n = 0, total = __builtin_popcount(dtypes);
    buf[0] = 0;
    for (int d = 0; d < ML_NDTYPES && at < len; d++) {
        if (!(dtypes & ML_DT(d)))
            continue;
        n++;
        at += (size_t)snprintf(buf + at, len - at, "%s%s",
                               n == 1 ? "" : n == total ? " or " : ", ", ml_dtype_names[d]);
    }
}

ml_status ml_check_input(const ml_tensor *t, const char *name, ml_device dev, unsigned dtypes,
                         int ndim, int contig, ml_err *e)
{
    const char *why = ml_storage_unusable(t->st);
    if (why || (why = ml_tensor_uncommitted(t)))
        return ml_err_set(e, ML_EINVAL, "%s: %s", name, why);
    if (t->st->device != dev)
        return ml_err_set(e, ML_EINVAL, "%s is on %s but the op runs on %s", name,
                          ml_device_names[t->st->device], ml_device_names[dev]);
    if (!(dtypes & ML_DT(t->dtype))) {
        char want[64];
        format_dtypes(dtypes, want, sizeof want);
        return ml_err_set(e, ML_EINVAL, "%s must be %s, got %s", name, want, ml_dtype_names[t->dtype]);
    }
    if (ndim >= 0 && t->ndim != ndim)
        return ml_err_set(e, ML_EINVAL, "%s must have %d dims, got %d", name, ndim, t->ndim);
    if (ndim < 0 && t->ndim < 1)
        return ml_err_set(e, ML_EINVAL, "%s must have at least 1 dim, got 0", name);
    if (contig && !ml_is_contiguous(t))
        return ml_err_set(e, ML_EINVAL, "%s must be contiguous (call :contiguous())", name);
    return ML_OK;
}

ml_status ml_check_live(const ml_tensor *t, const char *name, ml_err *e)
{
    return ml_check_input(t, name, ml_tensor_device(t), ML_DT_ANY, t->ndim, 0, e);
}

ml_status ml_check_view(const ml_tensor *t, const char *name, ml_err *e)
{
    const char *why = ml_storage_unviewable(t->st);
    return why ? ml_err_set(e, ML_EINVAL, "%s: %s", name, why) : ML_OK;
}

ml_status ml_check_dim(const ml_tensor *t, int d, ml_err *e)
{
    if (d < 0 || d >= t->ndim)
        return ml_err_set(e, ML_EINVAL, "dim %d out of range for a %d-dim tensor (0-based)", d,
                          t->ndim);
    return ML_OK;
}

ml_status ml_read_back(ml_host *h, const ml_tensor *t, int64_t i0, int64_t n, void *buf, ml_err *e)
{
    size_t es = ml_dtype_size(t->dtype);
    ml_device dev = t->st->device;
    return ml_kernel_status(h->mem[dev]->memcpy(buf, (const char *)ml_data(t) + (size_t)i0 * es,
                                                (size_t)n * es, dev == ML_CPU ? ML_COPY_H2H : ML_COPY_D2H,
                                                NULL), e);
}

ml_status ml_kernel_scratch(ml_host *h, ml_tensor *t, ml_device dev, size_t nbytes, ml_err *e)
{
    int64_t n = (int64_t)((nbytes + 7) / 8);
    return n > 0 ? ml_tensor_alloc(h, t, dev, ML_F64, 1, &n, e) : ML_OK;
}

ml_status ml_find_bad_index(ml_host *h, const ml_tensor *idx, int64_t hi, int64_t *pos,
                            int64_t *value, ml_err *e)
{
    ml_device dev = idx->st->device;
    int64_t n = ml_numel(idx);
    ml_tensor scr = {0};   /* the validator's result slots */
    ML_TRY(ml_kernel_scratch(h, &scr, dev, ML_KSCRATCH(h, dev, dispatch, n, hi, 1), e));
    ml_kctx c = ml_host_kctx(h);
    *pos = ML_KCHECK(h, dev, dispatch_find_bad, ml_data(idx), n, hi,
                     scr.st ? ml_data(&scr) : NULL, &c);
    ml_tensor_drop(&scr);
    if (*pos == ML_DISPATCH_EDEVICE)
        return ml_kernel_status(ML_EDEVICE, e);
    return *pos >= 0 ? ml_read_back(h, idx, *pos, 1, value, e) : ML_OK;
}

ml_status ml_check_shape(const ml_tensor *t, const char *name, int ndim, const int64_t *dims,
                         ml_err *e)
{
    int ok = t->ndim == ndim;
    for (int i = 0; ok && i < ndim; i++)
        ok = t->shape[i] == dims[i];
    if (ok)
        return ML_OK;
    char have[96], want[96];
    ml_format_dims(t->ndim, t->shape, have, sizeof have);
    ml_format_dims(ndim, dims, want, sizeof want);
    return ml_err_set(e, ML_EINVAL, "%s is %s but must be %s", name, have, want);
}

ml_status ml_check_same_dtype(const ml_tensor *t, const char *name, const char *ref, ml_dtype dt,
                              ml_err *e)
{
    if (t->dtype == dt)
        return ML_OK;
    return ml_err_set(e, ML_EINVAL, "%s is %s but %s is %s (same dtype expected)", name,
                      ml_dtype_names[t->dtype], ref, ml_dtype_names[dt]);
}

unsigned ml_float_dtypes(const ml_host *h, ml_device dev, ml_op op)
{
    const ml_kernels *k = h->kern[dev];
    int bf16 = k && k->supports(op, ML_BF16);
    return ML_DT_FLOAT | (bf16 ? ML_DT(ML_BF16) : 0u);
}

ml_status ml_prepare_output(ml_host *h, ml_tensor *t, const char *name, ml_device dev, ml_dtype dt,
                            int ndim, const int64_t *dims, ml_err *e)
{
    if (!t->st)
        return ml_tensor_alloc(h, t, dev, dt, ndim, dims, e);
    ML_TRY(ml_check_input(t, name, dev, ML_DT(dt), ndim, 1, e));
    return ml_check_shape(t, name, ndim, dims, e);
}

ml_status ml_tensor_zero(ml_host *h, ml_tensor *t, ml_err *e)
{
    if (ml_numel(t) == 0)
        return ML_OK;
    ml_kctx c = ml_host_kctx(h);
    c.interrupt = NULL;   /* a fill is short; Ctrl-C is seen by the kernel that follows */
    return ml_kernel_status(ML_KCALL(h, t->st->device, fill, t->dtype, ml_data(t), 0.0, ml_numel(t), &c),
                            e);
}

ml_status ml_prepare_accumulator(ml_host *h, ml_tensor *t, const char *name, ml_device dev,
                                 ml_dtype dt, int ndim, const int64_t *dims, ml_err *e)
{
    int fresh = !t->st;
    ML_TRY(ml_prepare_output(h, t, name, dev, dt, ndim, dims, e));
    return fresh ? ml_tensor_zero(h, t, e) : ML_OK;
}
