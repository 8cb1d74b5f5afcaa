/*
 * host/runtime/store.h - the expert store (DESIGN.md, Bounded expert
 * memory): `nslabs` slabs of `slab_bytes` in a backing tier and `nslots`
 * cache slots on the device that computes on them, with the residency
 * policy that decides which slab a slot holds. One policy for every
 * device; only the byte movement differs.
 *
 * On the CPU the backing tier is a file, created by the store (never an
 * existing one: it is mutated in place, so it is never a recovery source;
 * a checkpoint holds the full expert bytes), refused on tmpfs/ramfs (its
 * pages would be memory), fallocated whole up front and charged to the
 * `file` tier's book; closing the store removes it. The slots are one
 * ledger allocation under the slot category on the cpu book, each slot
 * 64-byte aligned. Slabs move between the file and the slots with
 * pread/pwrite only, never through a mapping (mapped pages would count in
 * RSS and break the bound), synchronously, on the calling thread;
 * prefetch is a posix_fadvise(WILLNEED) hint: it moves no slab and takes
 * no slot.
 *
 * On CUDA (opts.device) the backing tier is pinned host memory from the
 * device's memory table (host_alloc; no file, the path is not used),
 * charged to the `pinned` tier's book, and the slots are device memory
 * on the cuda book. Slabs move with the table's memcpy (H2D, D2H) on a
 * copy stream of the store's own: the compute stream (the kernel
 * context's) waits for a slot's copies (a slab's arrival; a write-back's
 * end) before kernels touch it: at the acquire that returns the slot, and
 * before a direct transfer or flush returns. A slot is written back or
 * overwritten only after the event recorded on the compute stream at its
 * last release (or at a direct transfer) has completed (the copy stream
 * waits on it). Prefetch is a copy-ahead: after each acquire, each of the
 * next prefetch_depth scheduled slabs that is not resident is copied into
 * a slot right away: a free one, else the one a miss would evict if that
 * slab is needed later than the copied one and than every pinned slab
 * (the slot its miss would take, so the copy moves the read earlier
 * instead of adding one). Its copy overlaps the kernels queued meanwhile,
 * and its acquire is a hit that only waits for the copy. The calls return
 * with the copies queued; the host never touches the pinned bytes.
 *
 * The policy (so callers never write eviction logic): ml_store_schedule
 * gives the step's future slab order once routing is known;
 * ml_store_acquire makes a slab resident and pins it, evicting the
 * unpinned slab whose next scheduled use is furthest away (never again
 * counts as furthest; ties: least recently used), which is LRU when there
 * is no schedule left. A dirty slab is written back before its slot is
 * reused.
 *
 * Inside a memory plan (h->planning) a store opened there charges the
 * plan's books (the backing bytes and the slots) and creates no file
 * (pinned memory: the plan table's address space); its policy runs but
 * moves no bytes, and every counter is the run's: hits, misses,
 * evictions, prefetches (a cpu store's hints, a cuda store's copies
 * ahead) and the bytes a run would read and write. A store opened outside
 * a plan cannot move slabs inside one, nor a planned store after its plan.
 *
 * Not here: the Lua binding (host/bindings/l_store.c), what a slab holds
 * and when a step acquires it (the moe layer).
 */
#ifndef ML_STORE_H
#define ML_STORE_H

#include "op.h"

typedef struct {
    uint64_t hits, misses, evictions, writebacks, prefetches, bytes_read, bytes_written;
} ml_store_stats;

typedef struct {
    ml_device device;       /* of the slots: ML_CPU (a file) or ML_CUDA (pinned host memory) */
    const char *path;       /* the backing file to create (the CPU's; unused on CUDA) */
    size_t nslabs, slab_bytes, nslots;
    size_t prefetch_depth;  /* scheduled slabs read ahead after each acquire (cpu: hinted;
                               cuda: copied into slots) */
    ml_category category;   /* of the backing bytes on the file or pinned book, unless: */
    size_t cat_bytes[ML_NCAT];  /* a slab's bytes per category (all 0: the slab is
                                   `category`'s; else they add up to slab_bytes) */
    ml_category slot_category;  /* of the cache slots on the device's book (the expert
                                   store's: cache; an optimizer's staging: optim) */
} ml_store_opts;

typedef struct ml_expert_store {
    ml_host *host;
    ml_device device;
    char *path;             /* NULL on CUDA */
    int fd;                 /* -1: opened inside a plan, no file, or CUDA */
    int planned;            /* opened inside a memory plan */
    size_t nslabs, slab_bytes, nslots, stride;   /* stride: slab_bytes rounded up to 64 */
    size_t prefetch_depth;
    ml_tensor slots;        /* u8 [nslots * stride] under `cache`; slot i at i * stride */
    ml_ledger *backing_book;   /* where the file's or the pinned memory's bytes go back */
    size_t backing_bytes[ML_NCAT];   /* charged to backing_book, per category */
    /* CUDA: the slabs in pinned host memory, moved on a copy stream */
    const struct ml_memory *mem;   /* the table that allocated pinned (a plan's inside a plan) */
    char *pinned;           /* [nslabs * slab_bytes] */
    void *copy_stream;
    void **copied;          /* [nslots] recorded on the copy stream after each copy of the slot */
    void **released;        /* [nslots] recorded on the compute stream when kernels are done with it */
    unsigned char *unawaited;  /* [nslots] copied since the compute stream last waited for `copied` */
    /* residency */
    int64_t *slot_slab;     /* [nslots] the slab a slot holds, -1: free */
    int64_t *slab_slot;     /* [nslabs] the slot holding a slab, -1: not resident */
    int *pins;              /* [nslots] acquires not yet released */
    unsigned char *dirty;   /* [nslots] must be written back before reuse */
    uint64_t *last_use;     /* [nslots] clock of the last acquire (LRU) */
    uint64_t clock;
    unsigned char *hinted;  /* [nslabs] hinted (cpu) and not read since */
    /* the schedule: sched[cursor..nsched) is still ahead */
    int64_t *sched;         /* [nsched] slab ids */
    size_t *sched_next;     /* [nsched] the next index of the same slab, SIZE_MAX: none */
    size_t *slab_next;      /* [nslabs] its next index at or after cursor, SIZE_MAX: none */
    size_t nsched, cursor;
    ml_store_stats stats;
} ml_expert_store;

/* Open a store (every option checked first; a budget refusal creates no
 * file). ML_EINVAL: bad options, the path exists, is on tmpfs/ramfs or
 * cannot be created; ML_EALLOC: a budget refused the backing bytes or the
 * slots (the ledger table in e), or the pinned memory was refused;
 * ML_EIO: the file could not be fallocated (the message names the path
 * and the bytes needed; the partial file is removed); ML_EDEVICE: a
 * stream or an event could not be made. */
ml_status ml_store_open(ml_host *h, const ml_store_opts *o, ml_expert_store **out, ml_err *e);
/* Wait for the copy stream, free the slots (views of them become
 * unusable: "the expert store was closed") and the pinned memory, credit
 * the books and remove the file. Writes nothing back:
 * flush first to keep dirty slabs (the file is removed anyway; a caller
 * keeps slabs by reading them out). NULL does nothing. */
void ml_store_close(ml_expert_store *s);

/* Slot i's first byte (64-byte aligned). */
static inline void *ml_store_slot_data(const ml_expert_store *s, size_t slot)
{
    return (char *)s->slots.st->data + slot * s->stride;
}

/* Direct transfers that bypass the policy (the initial fill, checkpoints):
 * read copies slab into slot, write copies slot to slab (synchronously on
 * the CPU; on CUDA ordered after every kernel queued so far, and kernels
 * queued after a read see its bytes).
 * A slot the policy holds pinned is refused. read makes the slot free
 * (what it held is written back first when dirty) and, when `slab` is
 * resident and dirty elsewhere, writes that copy back first, so read gives
 * the slab's current bytes. write drops `slab`'s resident copy in another
 * slot (refused when pinned), which the write made stale. */
ml_status ml_store_read(ml_expert_store *s, size_t slab, size_t slot, ml_err *e);
ml_status ml_store_write(ml_expert_store *s, size_t slot, size_t slab, ml_err *e);
/* The CPU's readahead hint for slab (POSIX_FADV_WILLNEED); counts in
 * prefetches (in a plan too, with no file to hint). Nothing on CUDA (its
 * read-ahead is the acquire's copy-ahead, which takes slots under the
 * policy). */
void ml_store_prefetch(ml_expert_store *s, size_t slab);

/* The future access order: seq[0..n) slab ids (copied); replaces the
 * schedule before it, and every slab may be hinted again. n == 0 clears
 * it (LRU). */
ml_status ml_store_schedule(ml_expert_store *s, const int64_t *seq, size_t n, ml_err *e);
/* Make slab resident and pin it: *slot its slot, *hit whether it was
 * resident (a slab copied ahead is a hit). A miss takes a free slot or
 * evicts (writing back a dirty victim), then reads the slab. The cursor
 * moves past seq[cursor] when it is this slab; then the next
 * prefetch_depth scheduled slabs that are not resident are read ahead:
 * hinted on the CPU (each once until it is read), copied ahead on CUDA
 * (each counts in prefetches, bytes_read and, for its victim, evictions
 * and writebacks; one refused for want of a slot is tried again at the
 * next acquire). ML_EINVAL when every slot is pinned; ML_EDEVICE when a
 * copy could not be queued (then nothing is acquired). */
ml_status ml_store_acquire(ml_expert_store *s, size_t slab, size_t *slot, int *hit, ml_err *e);
/* Unpin slab; dirty: its slot must be written back before reuse. On
 * CUDA the last release records the compute stream's event that the
 * slot's reuse waits for. */
ml_status ml_store_release(ml_expert_store *s, size_t slab, int dirty, ml_err *e);
/* Write back every dirty resident slab (pinned ones too). */
ml_status ml_store_flush(ml_expert_store *s, ml_err *e);
/* The slot holding slab, or -1. */
int64_t ml_store_resident(const ml_expert_store *s, size_t slab);

#endif
