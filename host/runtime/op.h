/*
 * host/runtime/op.h - the op layer's common part (DESIGN.md, Layers): what
 * every op of host/runtime/ops_*.c shares. An op is a C function over
 * moelua tensors that checks dtypes, shapes and devices, picks the device's
 * kernel (ML_KCALL, the one dispatch point) and returns a status with a
 * message in an ml_err. It never raises and needs no Lua state: the Lua
 * bindings (host/bindings/) convert Lua values, call it, and raise the
 * message naming their function; C callers (tests/c, the sharding and
 * expert-store code) read it.
 *
 * Outputs: an output tensor whose storage is NULL (a zeroed ml_tensor, or
 * a binding's new userdata) is allocated by the op, contiguous, on the
 * inputs' device, under the host's current ledger category; one that has
 * storage is checked (dtype, shape, device, contiguous) and written. Each
 * op's comment says which outputs are overwritten (=) and which
 * accumulate (+=). Every argument is checked before the first allocation,
 * so a refused argument allocates nothing; after a failed allocation or
 * kernel, the outputs already allocated stay with the caller, who
 * releases them (ml_tensor_drop).
 */
#ifndef ML_OP_H
#define ML_OP_H

#include <stdarg.h>

#include "backend.h"
#include "pool.h"
#include "tensor.h"

/* An op's message: "w is [5] but must be [4]". A budget refusal carries
 * the ledger table, hence the size. */
typedef struct ml_err {
    char msg[4096];
} ml_err;

/* Format e->msg and return s (s for ML_OK leaves e alone). */
ml_status ml_err_set(ml_err *e, ml_status s, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Fill e->msg for a kernel's status ("not supported on this device for
 * this dtype": a dtype the kernel lacks or a family the device lacks; the
 * device's error text, ...) and return it. ML_EINTERRUPTED
 * reads "interrupted": a binding turns it into the interrupt error. */
ml_status ml_kernel_status(ml_status s, ml_err *e);

/* The kernel context of the host now: its thread count and Ctrl-C flag. */
ml_kctx ml_host_kctx(const ml_host *h);
/* The CPU threads of every kernel and of BLAS (n >= 1). */
void ml_host_set_threads(ml_host *h, int n);

/* A new contiguous tensor in *t (whose storage must be NULL), on dev,
 * charged to the current category. A refusal by the ledger or the system
 * calls h->reclaim once and retries; then ML_EALLOC with the budget that
 * refused and the device's ledger table in e. ML_EINVAL: no such device or
 * a shape that overflows. */
ml_status ml_tensor_alloc(ml_host *h, ml_tensor *t, ml_device dev, ml_dtype dt, int ndim,
                          const int64_t *shape, ml_err *e);
/* The same on a reserved storage (tensor.h: ml_storage_reserve): on the
 * CPU nothing is charged until elements are committed. */
ml_status ml_tensor_reserve(ml_host *h, ml_tensor *t, ml_device dev, ml_dtype dt, int ndim,
                            const int64_t *shape, ml_err *e);
/* The message of a request for nbytes of cat on dev that the ledger (a
 * budget) or the system refused with s: "<verb> 1.00 MiB (optim) on cpu
 * would exceed the optim budget of ..." and the device's ledger table.
 * Returns ML_EALLOC. */
ml_status ml_alloc_refusal(const ml_host *h, ml_device dev, ml_category cat, size_t nbytes,
                           ml_alloc_status s, const char *verb, ml_err *e);
/* Charge nbytes of cat to the tier's book (tensor.h: ml_tier_take) for
 * bytes no tensor holds: a backing file's (host/runtime/store.h), pinned
 * staging. A budget refusal calls h->reclaim once (a dead holder may give
 * its bytes back) and checks again; then ML_EALLOC, worded like
 * ml_alloc_refusal ("<verb> 1.00 MiB (params) on file would exceed the
 * total budget of ...") with the tier's ledger table. *book: where the
 * bytes go back (ml_ledger_credit). */
ml_status ml_tier_charge(ml_host *h, ml_tier tier, ml_category cat, size_t nbytes, const char *verb,
                         ml_ledger **book, ml_err *e);
/* Fill the contiguous tensor t with zeros (not interrupted: it is short). */
ml_status ml_tensor_zero(ml_host *h, ml_tensor *t, ml_err *e);
/* Release t's storage now (idempotent; never fails). */
void ml_tensor_drop(ml_tensor *t);
/* The tier's ledger as text, with the untracked remainder on the CPU. */
void ml_host_ledger_report(const ml_host *h, ml_tier tier, char *buf, size_t len);
/* Why dev has no usable backend ("built without it: make CUDA=1", ...). */
const char *ml_device_unavailable_reason(const ml_host *h, ml_device dev);

/* ---- pools (host/runtime/pool.h) ---- */

/* A pool refusal that freeing memory might fix: a budget, or the system. */
int ml_pool_may_retry(ml_pool_status ps, ml_alloc_status as);
/* The message for a pool that could not get new memory (any status but OK
 * and FULL) on dev; `what` says what for ("reserving 4.00 MiB"). A budget
 * refusal carries the budget and the device's ledger table. ML_EALLOC, or
 * ML_EINVAL when dev is not available. */
ml_status ml_pool_refusal(const ml_host *h, ml_device dev, ml_pool_status ps, ml_alloc_status as,
                          const char *what, ml_err *e);
/* A new contiguous tensor in *t (whose storage must be NULL): a view in a
 * new slot of p, charged to the pool's category; `name` says what it is
 * for in messages ("pool full: idx needs 7.81 KiB, ..."). When the ledger
 * or the system refuses to grow the pool, h->reclaim runs once and the
 * slot is asked again. The view holds a reference to p, so a pool closed
 * meanwhile outlives it. */
ml_status ml_pool_tensor(ml_host *h, ml_pool *p, ml_tensor *t, const char *name, ml_dtype dt,
                         int ndim, const int64_t *dims, ml_err *e);

/* ---- argument checks: ML_OK, or ML_EINVAL with a message naming `name` ---- */

/* Which dtypes an argument accepts. */
#define ML_DT(dt) (1u << (dt))
#define ML_DT_FLOAT (ML_DT(ML_F32) | ML_DT(ML_F64))
#define ML_DT_ANY ((1u << ML_NDTYPES) - 1)

/* t's device (CPU for a freed tensor: the check that follows names it). */
static inline ml_device ml_tensor_device(const ml_tensor *t)
{
    return t->st ? t->st->device : ML_CPU;
}

/* t is usable (ml_storage_unusable), of any dtype, rank and layout. */
ml_status ml_check_live(const ml_tensor *t, const char *name, ml_err *e);
/* t can be viewed (metadata, a new view): live, or with its memory released. */
ml_status ml_check_view(const ml_tensor *t, const char *name, ml_err *e);
/* d (0-based) is one of t's dims. */
ml_status ml_check_dim(const ml_tensor *t, int d, ml_err *e);
/* Elements [i0, i0 + n) of the contiguous tensor t into the host buffer buf
 * (a copy back from the device; a plain copy on the CPU). Never inside a
 * plan: there, nothing was computed. */
ml_status ml_read_back(ml_host *h, const ml_tensor *t, int64_t i0, int64_t n, void *buf, ml_err *e);
/* A kernel's scratch of nbytes (ML_KSCRATCH) on dev: a ledger tensor of f64
 * slots (8-byte aligned), or none (t stays empty) for 0 bytes. */
ml_status ml_kernel_scratch(ml_host *h, ml_tensor *t, ml_device dev, size_t nbytes, ml_err *e);
/* The first entry of the contiguous i64 tensor idx outside [0, hi), found
 * on idx's device (the dispatch validator): *pos = its position and *value
 * its value, or *pos = -1 (always inside a plan). The caller words the
 * error. */
ml_status ml_find_bad_index(ml_host *h, const ml_tensor *idx, int64_t hi, int64_t *pos,
                            int64_t *value, ml_err *e);

/* The float dtypes dev runs family `op` in: f32 and f64, and bf16 where
 * the device's kernel table says so (in a plan of CUDA on a build without
 * it, ml_kernels_cuda_plan answers). */
unsigned ml_float_dtypes(const ml_host *h, ml_device dev, ml_op op);
/* t is live (storage not freed, its bytes committed), on dev, of a dtype in `dtypes`, with ndim
 * dims (ndim < 0: at least 1) and, when `contig`, contiguous. */
ml_status ml_check_input(const ml_tensor *t, const char *name, ml_device dev, unsigned dtypes,
                         int ndim, int contig, ml_err *e);
/* t has exactly the shape [dims...]: "name is [5] but must be [4]". */
ml_status ml_check_shape(const ml_tensor *t, const char *name, int ndim, const int64_t *dims,
                         ml_err *e);
/* t's dtype is dt: "name is f64 but ref is f32 (same dtype expected)". */
ml_status ml_check_same_dtype(const ml_tensor *t, const char *name, const char *ref, ml_dtype dt,
                              ml_err *e);
/* An output: allocated when its storage is NULL (contiguous, dt, dev,
 * [dims...]), else checked to be exactly that. */
ml_status ml_prepare_output(ml_host *h, ml_tensor *t, const char *name, ml_device dev, ml_dtype dt,
                            int ndim, const int64_t *dims, ml_err *e);
/* The same, filled with zeros when the op allocates it (for += outputs). */
ml_status ml_prepare_accumulator(ml_host *h, ml_tensor *t, const char *name, ml_device dev,
                                 ml_dtype dt, int ndim, const int64_t *dims, ml_err *e);

/* Return early with the status of a check or a call that is not ML_OK. */
#define ML_TRY(call) do { ml_status ml_try_s_ = (call); if (ml_try_s_ != ML_OK) return ml_try_s_; } while (0)

#endif
