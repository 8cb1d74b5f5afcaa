/*
 * host/tensor.c - storage allocation through the ledger, reference counts,
 * and shape arithmetic. Nothing here knows Lua.
 */
#include "tensor.h"
#include "backend.h"
#include "pool.h"

#include <stdio.h>
#include <stdlib.h>

const char *const ml_device_names[ML_NDEVICES] = {"cpu", "cuda"};
const char *const ml_dtype_names[ML_NDTYPES] = {"f32", "f64", "bf16", "f16", "i32", "i64", "u8"};

ml_alloc_status ml_storage_new(ml_host *h, ml_device dev, size_t nbytes, ml_storage **out)
{
    const ml_backend *be = h->backend[dev];
    ml_ledger *lg = &h->ledger[dev];
    *out = NULL;
    if (!be || !be->available())
        return ML_ALLOC_NODEVICE;
    switch (ml_ledger_check(lg, h->category, be->reserve_bytes ? be->reserve_bytes(nbytes) : nbytes)) {
    case ML_LEDGER_OVER_TOTAL:    lg->nrefused++; return ML_ALLOC_OVER_TOTAL;
    case ML_LEDGER_OVER_CATEGORY: lg->nrefused++; return ML_ALLOC_OVER_CATEGORY;
    case ML_LEDGER_OK:            break;
    }
    ml_storage *st = calloc(1, sizeof *st);
    if (!st)
        return ML_ALLOC_NOMEM;
    if (nbytes && !(st->data = be->alloc(nbytes, lg))) {
        free(st);
        return ML_ALLOC_NOMEM;
    }
    st->nbytes = nbytes;
    st->device = dev;
    st->cat = h->category;
    st->refs = 1;
    st->host = h;
    ml_ledger_charge(lg, st->cat, nbytes);
    *out = st;
    return ML_ALLOC_OK;
}

void ml_storage_retain(ml_storage *st)
{
    st->refs++;
}

void ml_storage_release(ml_storage *st)
{
    if (--st->refs > 0)
        return;
    if (st->pool) {
        ml_pool_release(st->pool);   /* a view: the pool owns the bytes */
    } else {
        ml_ledger *lg = &st->host->ledger[st->device];
        ml_ledger_credit(lg, st->cat, st->nbytes);
        if (st->data)
            st->host->backend[st->device]->free(st->data, st->nbytes, lg);
    }
    free(st);
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

void ml_format_shape(const ml_tensor *t, char *buf, size_t len)
{
    size_t at = 0;
    at += (size_t)snprintf(buf, len, "[");
    for (int i = 0; i < t->ndim && at < len; i++)
        at += (size_t)snprintf(buf + at, len - at, i ? ",%lld" : "%lld", (long long)t->shape[i]);
    if (at < len)
        snprintf(buf + at, len - at, "]");
}
