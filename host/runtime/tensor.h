/*
 * host/runtime/tensor.h - tensors: reference-counted storage plus a view (offset,
 * shape, strides, dtype). Row-major; views share storage (narrow, select,
 * reshape, transpose, a flat buffer at an offset).
 *
 * Every storage byte comes from ml_storage_new, which charges the device's
 * ledger under the host's current category, or from ml_storage_acquire,
 * which gives a released storage its memory back, or from
 * ml_storage_reserve, whose bytes are charged as they are committed
 * (ml_storage_commit). Pool views
 * (host/runtime/pool.h) are storages that borrow a pool's block and are
 * valid only while their pool slot still holds the same allocation id.
 */
#ifndef ML_TENSOR_H
#define ML_TENSOR_H

#include <signal.h>
#include <stdint.h>
#include <stddef.h>

#include "../../kernels/core.h"
#include "ledger.h"

#define ML_MAXDIM 8

typedef enum { ML_CPU, ML_CUDA, ML_NDEVICES } ml_device;

/* Where bytes live (DESIGN.md, The memory ledger: books per tier): each
 * device's memory (a device's tier has the device's number), pinned host
 * memory and backing files (the expert store's, host/runtime/store.h).
 * Tensors live on devices; the other tiers are charged by whatever holds
 * their bytes (ml_tier_take, op.h: ml_tier_charge). */
typedef enum {
    ML_TIER_CPU = ML_CPU, ML_TIER_CUDA = ML_CUDA, ML_TIER_PINNED = ML_NDEVICES, ML_TIER_FILE,
    ML_NTIERS
} ml_tier;

extern const char *const ml_device_names[ML_NDEVICES];
extern const char *const ml_tier_names[ML_NTIERS];   /* "cpu", "cuda", "pinned", "file" */
extern const char *const ml_dtype_names[ML_NDTYPES];

struct ml_pool;
struct ml_memory;
struct ml_err;
struct ml_kernels;

/* Process-wide state of one moelua host. Owned by main.c, reached from Lua
 * through the registry (host/bindings/l_util.h: ml_host_of).
 *
 * `ledger` and `mem` are what allocations use now: each tier's real
 * account book and each device's memory table, or, while moelua.mem.plan
 * runs a dry run (DESIGN.md, The memory ledger), a virtual book on every
 * tier and a plan memory table (host/runtime/backend_plan.c: address
 * space only) on every device, while
 * `planning` makes ML_KCALL skip every kernel. Every storage and pool
 * remembers the book and table it was charged to, so one that outlives a
 * plan is still returned to the right place.
 *
 * `reclaim`, when set, is called once before an allocation that the ledger
 * or the system refused is retried: the Lua bindings collect garbage there
 * (host/bindings/l_util.c), so dead tensors give their bytes back;
 * `allocated` after every allocation, so they collect at the pace tensors
 * are made. Both may run Lua finalizers: an op holds its inputs and outputs
 * in the caller's references, and its scratch in C structs no finalizer
 * sees. */
typedef struct ml_host {
    ml_ledger books[ML_NTIERS];           /* the real account books, per tier */
    ml_ledger plan_books[ML_NTIERS];      /* mem.plan's virtual books */
    ml_ledger *ledger[ML_NTIERS];
    ml_category category;                 /* category of allocations made now */
    int nthreads;                         /* CPU kernel threads */
    uint64_t seed;                        /* Philox key of the host generator */
    uint64_t rng_offset;                  /* next unused Philox counter */
    volatile sig_atomic_t *interrupt;     /* Ctrl-C flag set by the signal handler */
    const struct ml_memory *mem[ML_NDEVICES];        /* NULL: device not built in */
    const struct ml_memory *device_mem[ML_NDEVICES]; /* the real memory tables */
    const struct ml_kernels *kern[ML_NDEVICES];      /* NULL: device not built in */
    int planning;                         /* inside moelua.mem.plan */
    size_t plan_live;                     /* storages and pools charged to plan_books */
    void (*reclaim)(struct ml_host *h, ml_device dev);
    /* Called after each allocation of the op layer (ml_tensor_alloc) with
     * its bytes: the Lua bindings step their collector there. */
    void (*allocated)(struct ml_host *h, size_t nbytes);
    void *hook_ud;                        /* what reclaim and allocated need (a lua_State) */
    /* Polled between tiles of long kernels (ml_kctx.progress): the
     * collectives' progress while a ZeRO-3 gather is in flight. */
    void (*progress)(void *ud);
    void *progress_ud;
} ml_host;

typedef struct ml_storage {
    void *data;
    size_t nbytes;
    ml_device device;
    ml_category cat;
    int refs;
    ml_host *host;
    ml_ledger *lg;            /* the book and memory table it was charged to */
    const struct ml_memory *mem;
    struct ml_pool *pool;     /* non-NULL: a pool view, freed with the pool */
    size_t slot;              /* pool slot and allocation id of that view */
    uint64_t id;
    char released[128];       /* non-empty while its memory is released: why */
    /* A reserved storage (ml_storage_reserve): its committed byte ranges,
     * sorted, disjoint, one per commit (never merged, so each is credited
     * as it was charged). */
    int reserved;
    struct ml_range { size_t lo, hi; } *ranges;
    size_t nranges, cap_ranges;
} ml_storage;

typedef struct ml_tensor {
    ml_storage *st;           /* NULL once freed */
    int64_t offset;           /* in elements, from st->data */
    int ndim;
    ml_dtype dtype;
    int64_t shape[ML_MAXDIM];
    int64_t stride[ML_MAXDIM];  /* in elements */
} ml_tensor;

/* Allocation results, turned into Lua errors by host/bindings/l_util.c. */
typedef enum {
    ML_ALLOC_OK = 0,
    ML_ALLOC_OVER_TOTAL,      /* the device's total budget */
    ML_ALLOC_OVER_CATEGORY,   /* the category's budget */
    ML_ALLOC_NOMEM,           /* the system refused */
    ML_ALLOC_NODEVICE         /* backend not built in or no device present */
} ml_alloc_status;

/* A host with empty books, the CPU backend and no budget (main.c adds the rest). */
void ml_host_init(ml_host *h);
void ml_host_free(ml_host *h);
/* Is lg one of mem.plan's virtual books? */
static inline int ml_is_plan_ledger(const ml_host *h, const ml_ledger *lg)
{
    return lg >= h->plan_books && lg < h->plan_books + ML_NTIERS;
}

ml_alloc_status ml_storage_new(ml_host *h, ml_device dev, size_t nbytes, ml_storage **out);

/* Charge nbytes of cat to the tier's current book (the plan's inside a
 * plan) for bytes that no storage holds (a backing file, pinned staging),
 * with the budget checks of ml_storage_new: ML_ALLOC_OVER_TOTAL or
 * ML_ALLOC_OVER_CATEGORY charge nothing. *book is the book charged: the
 * bytes go back there (ml_ledger_credit), also after the plan ended. */
ml_alloc_status ml_tier_take(ml_host *h, ml_tier tier, ml_category cat, size_t nbytes,
                             ml_ledger **book);

/* Reserved storage (DESIGN.md, Parameters: lazy Adam's per-expert states
 * cost nothing until an expert first receives tokens). ml_storage_reserve
 * is ml_storage_new (the same memory table and book, so it works inside a
 * plan, under the host's current category) except that on the CPU the
 * ledger is charged nothing: the bytes are address space until committed
 * (glibc serves large blocks by mmap, whose untouched pages take no RAM).
 * On CUDA the memory table allocates every byte, so reserve charges the
 * whole size there and commits charge nothing more (mapping pages on
 * commit is future work); everything else below is the same.
 *
 * ml_storage_commit commits bytes [off, off + n) of a reserved st: on the
 * CPU it charges n bytes to st's book under st's category, with the budget
 * checks of an allocation (one refusal calls h->reclaim and checks again;
 * then ML_EALLOC with the budget and the ledger table), then zero-fills
 * them (writing the pages is what commits them; inside a plan nothing is
 * written). ML_EINVAL: st is not reserved or not usable, the range is out
 * of bounds or overlaps a committed one (so no byte is counted twice), or
 * st was reserved outside the plan that is running. n == 0 does nothing.
 * Freeing st credits exactly the committed bytes; releasing its memory
 * (ml_storage_release_memory) uncommits every range and an acquire
 * reserves it again with nothing committed. */
ml_alloc_status ml_storage_reserve(ml_host *h, ml_device dev, size_t nbytes, ml_storage **out);
ml_status ml_storage_commit(ml_storage *st, size_t off, size_t n, struct ml_err *e);
/* Commit the elements of the contiguous view t (ml_storage_commit; the
 * message names it "t"). */
ml_status ml_tensor_commit(const ml_tensor *t, struct ml_err *e);
/* Are bytes [off, off + n) of st committed? Always for a storage that was
 * not reserved; n == 0 is. */
int ml_storage_committed(const ml_storage *st, size_t off, size_t n);
/* "the tensor is reserved but not committed" when some element of view t
 * lies in bytes of a reserved storage that are not committed, else NULL
 * (ml_check_input refuses such a view in every op). Only reserved
 * storages have ranges: for any other this is one test. */
const char *ml_tensor_uncommitted(const ml_tensor *t);
/* Why a tensor's storage cannot be used now, or NULL: freed (st NULL), its
 * memory released (the reason given), a view of a rewound pool frame, or
 * made inside a memory plan that has ended (address space that holds
 * nothing, on no device). */
const char *ml_storage_unusable(const ml_storage *st);
/* The same, except that released memory (ml_storage_release_memory) is
 * fine: views and metadata of a released storage can be made and read;
 * only a use of its elements needs the memory back. */
const char *ml_storage_unviewable(const ml_storage *st);
void ml_storage_retain(ml_storage *st);
/* Drop a reference; the last one returns the memory (none when released)
 * and frees the struct. */
void ml_storage_release(ml_storage *st);

/* Released storage (DESIGN.md, Parameters: ZeRO-3 holds a unit's full
 * parameters only while in use). ml_storage_release_memory credits the
 * book the storage was charged to, frees its memory and keeps the struct
 * and its references: data becomes NULL and ml_storage_unusable returns
 * `why` (copied, at most 127 chars; NULL or "" reads "its memory was
 * released"), so every op refuses each of its views with that message.
 * ml_storage_acquire allocates nbytes again like ml_storage_new does, but
 * under st->cat: the host's current book and memory table (inside a plan
 * the plan's, counted in h->plan_live until released or freed), the same
 * budget checks and statuses. The contents after an acquire are
 * undefined. Releasing a released storage or a pool view (its pool owns
 * the bytes) does nothing; acquiring a storage that holds its memory
 * returns ML_ALLOC_OK. ml_storage_adopt refuses a reserved st (fatal). */
void ml_storage_release_memory(ml_storage *st, const char *why);
ml_alloc_status ml_storage_acquire(ml_storage *st);
/* The same for a caller that allocates through the op layer
 * (ml_tensor_alloc: reclaim and retry, the budget message): the released
 * st takes the memory of `fresh`, a storage of st's bytes, device and
 * category with one reference, whose struct is freed. */
void ml_storage_adopt(ml_storage *st, ml_storage *fresh);

int64_t ml_numel(const ml_tensor *t);
size_t ml_nbytes(const ml_tensor *t);
int ml_is_contiguous(const ml_tensor *t);
void ml_set_contiguous_strides(ml_tensor *t);
/* Do the element ranges two views may touch intersect? (Same storage only;
 * bounds from offset and strides, so two interleaved views count as one.) */
int ml_tensors_overlap(const ml_tensor *a, const ml_tensor *b);
/* Number of elements of a shape, or -1 when it overflows int64 or has a negative size. */
int64_t ml_shape_numel(int ndim, const int64_t *shape);
static inline void *ml_data(const ml_tensor *t)
{
    return (char *)t->st->data + (size_t)t->offset * ml_dtype_size(t->dtype);
}

/* "[2,3]" into buf: a shape, or t's. */
void ml_format_dims(int ndim, const int64_t *dims, char *buf, size_t len);
void ml_format_shape(const ml_tensor *t, char *buf, size_t len);

#endif
