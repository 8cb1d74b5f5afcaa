/*
 * host/runtime/tensor.c - storage allocation through the ledger, reference counts,
 * and shape arithmetic. Nothing here knows Lua.
 */
#include "tensor.h"
#include "backend.h"
#include "op.h"
#include "pool.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *const ml_device_names[ML_NDEVICES] = {"cpu", "cuda"};
const char *const ml_tier_names[ML_NTIERS] = {"cpu", "cuda", "pinned", "file"};
const char *const ml_dtype_names[ML_NDTYPES] = {"f32", "f64", "bf16", "f16", "i32", "i64", "u8"};

void ml_host_init(ml_host *h)
{
    memset(h, 0, sizeof *h);
    for (int t = 0; t < ML_NTIERS; t++) {
        ml_ledger_init(&h->books[t], ml_tier_names[t]);
        ml_ledger_init(&h->plan_books[t], ml_tier_names[t]);
        h->ledger[t] = &h->books[t];
    }
    h->books[ML_CUDA].caching = 1;
    h->category = ML_CAT_OTHER;
    h->nthreads = 1;
    h->mem[ML_CPU] = h->device_mem[ML_CPU] = ml_backend_cpu.mem;
    h->kern[ML_CPU] = ml_backend_cpu.kern;
}

void ml_host_free(ml_host *h)
{
    for (int t = 0; t < ML_NTIERS; t++) {
        ml_ledger_free(&h->books[t]);
        ml_ledger_free(&h->plan_books[t]);
    }
}

/* Is st charged range by range as it is committed? (A reserved storage on
 * the CPU; on CUDA the memory table allocates it whole.) */
static int charged_on_commit(const ml_storage *st)
{
    return st->reserved && st->device == ML_CPU;
}

/* Would n more bytes of st's category fit its book? grow: what the
 * device's reservation grows by. */
static ml_alloc_status check_budget(ml_ledger *lg, ml_category cat, size_t n, size_t grow)
{
    switch (ml_ledger_check(lg, cat, n, grow)) {
    case ML_LEDGER_OVER_TOTAL:    lg->nrefused++; return ML_ALLOC_OVER_TOTAL;
    case ML_LEDGER_OVER_CATEGORY: lg->nrefused++; return ML_ALLOC_OVER_CATEGORY;
    case ML_LEDGER_OK:            break;
    }
    return ML_ALLOC_OK;
}

ml_alloc_status ml_tier_take(ml_host *h, ml_tier tier, ml_category cat, size_t nbytes,
                             ml_ledger **book)
{
    ml_ledger *lg = h->ledger[tier];
    ml_alloc_status s = check_budget(lg, cat, nbytes, nbytes);
    if (s != ML_ALLOC_OK)
        return s;
    ml_ledger_charge(lg, cat, nbytes);
    *book = lg;
    return ML_ALLOC_OK;
}

/* Memory for st (st->nbytes of st->cat on st->device) from the host's
 * current book and memory table: budgets checked first, then allocated and
 * charged (a storage charged on commit: nothing yet). */
static ml_alloc_status take_memory(ml_storage *st)
{
    ml_host *h = st->host;
    const ml_memory *mem = h->mem[st->device];
    ml_ledger *lg = h->ledger[st->device];
    if (!mem || !mem->available())
        return ML_ALLOC_NODEVICE;
    int charge = !charged_on_commit(st);
    size_t grow = mem->reserve_bytes ? mem->reserve_bytes(st->nbytes) : st->nbytes;
    ml_alloc_status s = charge ? check_budget(lg, st->cat, st->nbytes, grow) : ML_ALLOC_OK;
    if (s != ML_ALLOC_OK)
        return s;
    void *data = NULL;
    if (st->nbytes && !(data = mem->alloc(st->nbytes, lg)))
        return ML_ALLOC_NOMEM;
    st->data = data;
    st->lg = lg;
    st->mem = mem;
    h->plan_live += h->planning;
    if (charge)
        ml_ledger_charge(lg, st->cat, st->nbytes);
    return ML_ALLOC_OK;
}

/* st's memory back to the book and table it came from: its bytes, or
 * each committed range as it was charged. A reserved storage keeps no
 * committed range. */
static void return_memory(ml_storage *st)
{
    if (!charged_on_commit(st))
        ml_ledger_credit(st->lg, st->cat, st->nbytes);
    else
        for (size_t i = 0; i < st->nranges; i++)
            ml_ledger_credit(st->lg, st->cat, st->ranges[i].hi - st->ranges[i].lo);
    st->nranges = 0;
    if (st->data)
        st->mem->free(st->data, st->nbytes, st->lg);
    st->data = NULL;
    st->host->plan_live -= ml_is_plan_ledger(st->host, st->lg);
}

static ml_alloc_status storage_make(ml_host *h, ml_device dev, size_t nbytes, int reserved,
                                    ml_storage **out)
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
    st->reserved = reserved;
    ml_alloc_status s = take_memory(st);
    if (s != ML_ALLOC_OK) {
        free(st);
        return s;
    }
    *out = st;
    return ML_ALLOC_OK;
}

ml_alloc_status ml_storage_new(ml_host *h, ml_device dev, size_t nbytes, ml_storage **out)
{
    return storage_make(h, dev, nbytes, 0, out);
}

ml_alloc_status ml_storage_reserve(ml_host *h, ml_device dev, size_t nbytes, ml_storage **out)
{
    return storage_make(h, dev, nbytes, 1, out);
}

/* The index of the first committed range of st that ends after byte off
 * (st->nranges when none does). */
static size_t first_range_after(const ml_storage *st, size_t off)
{
    size_t lo = 0, hi = st->nranges;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (st->ranges[mid].hi <= off)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

int ml_storage_committed(const ml_storage *st, size_t off, size_t n)
{
    if (!st->reserved || n == 0)
        return 1;
    /* adjacent ranges (one commit per expert) cover a view of several */
    size_t end = off + n;
    for (size_t i = first_range_after(st, off); i < st->nranges; i++) {
        if (st->ranges[i].lo > off)
            return 0;
        if (st->ranges[i].hi >= end)
            return 1;
        off = st->ranges[i].hi;
    }
    return 0;
}

const char *ml_tensor_uncommitted(const ml_tensor *t)
{
    if (!t->st || !t->st->reserved || ml_numel(t) == 0)
        return NULL;
    int64_t last = t->offset;   /* the last element the view may touch */
    for (int i = 0; i < t->ndim; i++)
        last += (t->shape[i] - 1) * t->stride[i];
    size_t es = ml_dtype_size(t->dtype), lo = (size_t)t->offset * es;
    return ml_storage_committed(t->st, lo, ((size_t)last + 1) * es - lo)
               ? NULL : "the tensor is reserved but not committed";
}

ml_status ml_tensor_commit(const ml_tensor *t, ml_err *e)
{
    ML_TRY(ml_check_view(t, "t", e));
    if (!ml_is_contiguous(t))
        return ml_err_set(e, ML_EINVAL, "t must be contiguous");
    size_t es = ml_dtype_size(t->dtype);
    return ml_storage_commit(t->st, (size_t)t->offset * es, ml_nbytes(t), e);
}

/* Record [lo, hi) in st's sorted ranges at index at. */
static int insert_range(ml_storage *st, size_t at, size_t lo, size_t hi)
{
    if (st->nranges == st->cap_ranges) {
        size_t cap = st->cap_ranges ? 2 * st->cap_ranges : 8;
        struct ml_range *r = realloc(st->ranges, cap * sizeof *r);
        if (!r)
            return 0;
        st->ranges = r;
        st->cap_ranges = cap;
    }
    memmove(st->ranges + at + 1, st->ranges + at, (st->nranges - at) * sizeof *st->ranges);
    st->ranges[at] = (struct ml_range){lo, hi};
    st->nranges++;
    return 1;
}

ml_status ml_storage_commit(ml_storage *st, size_t off, size_t n, ml_err *e)
{
    const char *why = ml_storage_unusable(st);
    if (why)
        return ml_err_set(e, ML_EINVAL, "%s", why);
    ml_host *h = st->host;
    if (!st->reserved)
        return ml_err_set(e, ML_EINVAL, "the storage is not reserved (every byte is committed)");
    if (off > st->nbytes || n > st->nbytes - off)
        return ml_err_set(e, ML_EINVAL, "bytes [%zu, %zu) are outside the storage's %zu bytes",
                          off, off + n, st->nbytes);
    if (n == 0)
        return ML_OK;
    size_t at = first_range_after(st, off);
    if (at < st->nranges && st->ranges[at].lo < off + n)
        return ml_err_set(e, ML_EINVAL, "bytes [%zu, %zu) overlap the committed bytes [%zu, %zu)",
                          off, off + n, st->ranges[at].lo, st->ranges[at].hi);
    if (h->planning && !ml_is_plan_ledger(h, st->lg))
        return ml_err_set(e, ML_EINVAL, "the storage was reserved outside moelua.mem.plan, which "
                          "cannot commit real memory (reserve it inside the planned function)");
    if (charged_on_commit(st)) {
        ml_alloc_status s = check_budget(st->lg, st->cat, n, n);
        if (s != ML_ALLOC_OK && h->reclaim) {
            uint64_t refused = st->lg->nrefused;   /* one request: counted once */
            h->reclaim(h, st->device);
            s = check_budget(st->lg, st->cat, n, n);
            st->lg->nrefused = refused;
        }
        if (s != ML_ALLOC_OK)
            return ml_alloc_refusal(h, st->device, st->cat, n, s, "committing", e);
    }
    if (!insert_range(st, at, off, off + n))
        return ml_err_set(e, ML_EALLOC, "out of memory for a committed range");
    if (charged_on_commit(st))
        ml_ledger_charge(st->lg, st->cat, n);
    /* zeros in words when the range allows it: a commit can be large */
    size_t es = (off | n) % 8 == 0 ? 8 : 1;
    ml_tensor bytes = {.st = st, .offset = (int64_t)(off / es), .ndim = 1,
                       .dtype = es == 8 ? ML_I64 : ML_U8, .shape = {(int64_t)(n / es)}, .stride = {1}};
    return ml_tensor_zero(h, &bytes, e);
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
    free(st->ranges);
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
    if (!st->released[0] || st->pool || st->reserved || fresh->pool || fresh->refs != 1 ||
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
