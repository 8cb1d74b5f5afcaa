/*
 * host/runtime/tensor.c - storage allocation through the ledger, reference counts,
 * and shape arithmetic. Nothing here knows Lua.
 */
#include "tensor.h"
#include "backend.h"
#include "pool.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *const ml_device_names[ML_NDEVICES] = {"cpu", "cuda"};
const char *const ml_dtype_names[ML_NDTYPES] = {"f32", "f64", "bf16", "f16", "i32", "i64", "u8"};

void ml_host_init(ml_host *h)
{
    memset(h, 0, sizeof *h);
    for (int d = 0; d < ML_NDEVICES; d++) {
        ml_ledger_init(&h->books[d], ml_device_names[d]);
        ml_ledger_init(&h->plan_books[d], ml_device_names[d]);
        h->ledger[d] = &h->books[d];
    }
    h->books[ML_CUDA].caching = 1;
    h->category = ML_CAT_OTHER;
    h->nthreads = 1;
    h->mem[ML_CPU] = h->device_mem[ML_CPU] = ml_backend_cpu.mem;
    h->kern[ML_CPU] = ml_backend_cpu.kern;
}

void ml_host_free(ml_host *h)
{
    for (int d = 0; d < ML_NDEVICES; d++) {
        ml_ledger_free(&h->books[d]);
        ml_ledger_free(&h->plan_books[d]);
    }
}

/* Memory for st (st->nbytes of st->cat on st->device) from the host's
 * current book and memory table: budgets checked first, then allocated and
 * charged. */
static ml_alloc_status take_memory(ml_storage *st)
{
    ml_host *h = st->host;
    const ml_memory *mem = h->mem[st->device];
    ml_ledger *lg = h->ledger[st->device];
    if (!mem || !mem->available())
        return ML_ALLOC_NODEVICE;
    size_t grow = mem->reserve_bytes ? mem->reserve_bytes(st->nbytes) : st->nbytes;
    switch (ml_ledger_check(lg, st->cat, st->nbytes, grow)) {
    case ML_LEDGER_OVER_TOTAL:    lg->nrefused++; return ML_ALLOC_OVER_TOTAL;
    case ML_LEDGER_OVER_CATEGORY: lg->nrefused++; return ML_ALLOC_OVER_CATEGORY;
    case ML_LEDGER_OK:            break;
    }
    void *data = NULL;
    if (st->nbytes && !(data = mem->alloc(st->nbytes, lg)))
        return ML_ALLOC_NOMEM;
    st->data = data;
    st->lg = lg;
    st->mem = mem;
    h->plan_live += h->planning;
    ml_ledger_charge(lg, st->cat, st->nbytes);
    return ML_ALLOC_OK;
}

/* st's memory back to the book and table it came from. */
static void return_memory(ml_storage *st)
{
    ml_ledger_credit(st->lg, st->cat, st->nbytes);
    if (st->data)
        st->mem->free(st->data, st->nbytes, st->lg);
    st->data = NULL;
    st->host->plan_live -= ml_is_plan_ledger(st->host, st->lg);
}

ml_alloc_status ml_storage_new(ml_host *h, ml_device dev, size_t nbytes, ml_storage **out)
{
    *out = NULL;
    ml_storage *st = calloc(1, sizeof *st);
    if (!st)
        return ML_ALLOC_NOMEM;
    st->nbytes = nbytes;
    st->device = dev;
    st->cat = h->category;
    st->refs = 1;
    st->host = h;
    ml_alloc_status s = take_memory(st);
    if (s != ML_ALLOC_OK) {
        free(st);
        return s;
    }
    *out = st;
    return ML_ALLOC_OK;
}

const char *ml_storage_unusable(const ml_storage *st)
{
    if (!st)
        return "the tensor was freed";
    if (st->released[0])
        return st->released;
    if (st->pool && !ml_pool_view_valid(st->pool, st->slot, st->id))
        return "stale pool view (its frame was rewound)";
    const ml_ledger *lg = st->pool ? st->pool->lg : st->lg;
    if (!st->host->planning && ml_is_plan_ledger(st->host, lg))
        return "the tensor was made inside a memory plan that has ended (it holds no memory)";
    return NULL;
}

const char *ml_storage_unviewable(const ml_storage *st)
{
    return st && st->released[0] ? NULL : ml_storage_unusable(st);
}

void ml_storage_retain(ml_storage *st)
{
    st->refs++;
}

void ml_storage_release(ml_storage *st)
{
    if (--st->refs > 0)
        return;
    if (st->pool)
        ml_pool_release(st->pool);   /* a view: the pool owns the bytes */
    else if (!st->released[0])
        return_memory(st);
    free(st);
}

void ml_storage_release_memory(ml_storage *st, const char *why)
{
    if (st->pool || st->released[0])
        return;
    return_memory(st);
    snprintf(st->released, sizeof st->released, "%s",
             why && why[0] ? why : "its memory was released");
}

ml_alloc_status ml_storage_acquire(ml_storage *st)
{
    if (!st->released[0])
        return ML_ALLOC_OK;
    ml_alloc_status s = take_memory(st);
    if (s == ML_ALLOC_OK)
        st->released[0] = 0;
    return s;
}

void ml_storage_adopt(ml_storage *st, ml_storage *fresh)
{
    if (!st->released[0] || st->pool || fresh->pool || fresh->refs != 1 ||
        fresh->nbytes != st->nbytes || fresh->device != st->device || fresh->cat != st->cat) {
        fprintf(stderr, "moelua: %s:%d: ml_storage_adopt: st is not released or fresh does "
                "not match it\n", __FILE__, __LINE__);
        abort();
    }
    /* fresh's charge (and plan_live count) pass to st with its memory */
    st->data = fresh->data;
    st->lg = fresh->lg;
    st->mem = fresh->mem;
    st->released[0] = 0;
    free(fresh);
}

int64_t ml_shape_numel(int ndim, const int64_t *shape)
{
    int64_t n = 1;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0)
            return -1;
        if (shape[i] && n > INT64_MAX / shape[i])
            return -1;
        n *= shape[i];
    }
    return n;
}

int64_t ml_numel(const ml_tensor *t)
{
    return ml_shape_numel(t->ndim, t->shape);
}

size_t ml_nbytes(const ml_tensor *t)
{
    return (size_t)ml_numel(t) * ml_dtype_size(t->dtype);
}

void ml_set_contiguous_strides(ml_tensor *t)
{
    int64_t s = 1;
    for (int i = t->ndim - 1; i >= 0; i--) {
        t->stride[i] = s;
        s *= t->shape[i];
    }
}

int ml_is_contiguous(const ml_tensor *t)
{
    int64_t s = 1;
    for (int i = t->ndim - 1; i >= 0; i--) {
        if (t->shape[i] != 1 && t->stride[i] != s)
            return 0;
        s *= t->shape[i];
    }
    return 1;
}

int ml_tensors_overlap(const ml_tensor *a, const ml_tensor *b)
{
    if (!a->st || a->st != b->st || ml_numel(a) == 0 || ml_numel(b) == 0)
        return 0;
    int64_t ae = a->offset, be = b->offset;
    for (int i = 0; i < a->ndim; i++)
        ae += (a->shape[i] - 1) * a->stride[i];
    for (int i = 0; i < b->ndim; i++)
        be += (b->shape[i] - 1) * b->stride[i];
    return a->offset <= be && b->offset <= ae;
}

void ml_format_dims(int ndim, const int64_t *dims, char *buf, size_t len)
{
    size_t at = 0;
    at += (size_t)snprintf(buf, len, "[");
    for (int i = 0; i < ndim && at < len; i++)
        at += (size_t)snprintf(buf + at, len - at, i ? ",%lld" : "%lld", (long long)dims[i]);
    if (at < len)
        snprintf(buf + at, len - at, "]");
}

void ml_format_shape(const ml_tensor *t, char *buf, size_t len)
{
    ml_format_dims(t->ndim, t->shape, buf, len);
}
