/*
 * host/runtime/store.h - the expert store for CPU runs (DESIGN.md, Bounded
 * expert memory): `nslabs` slabs of `slab_bytes` in a backing file and
 * `nslots` cache slots in memory, with the residency policy that decides
 * which slab a slot holds.
 *
 * The file is created by the store (never an existing one: it is mutated
 * in place, so it is never a recovery source; a checkpoint holds the full
 * expert bytes), refused on tmpfs/ramfs (its pages would be memory),
 * fallocated whole up front and charged to the `file` tier's book; closing
 * the store removes it. The slots are one ledger allocation under `cache`
 * on the cpu book, each slot 64-byte aligned. Slabs move between the file
 * and the slots with pread/pwrite only, never through a mapping (mapped
 * pages would count in RSS and break the bound), synchronously, on the
 * calling thread; prefetch is a posix_fadvise(WILLNEED) hint.
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
 * plan's books (the file bytes and the slots) and creates no file; its
 * policy runs but moves no bytes. A store opened outside a plan cannot
 * move slabs inside one, nor a planned store after its plan.
 *
 * Not here: the Lua binding (host/bindings/l_store.c), what a slab holds
 * and when a step acquires it (the moe layer), the GPU's pinned tier.
 */
#ifndef ML_STORE_H
#define ML_STORE_H

#include "op.h"

typedef struct {
    uint64_t hits, misses, evictions, writebacks, prefetches, bytes_read, bytes_written;
} ml_store_stats;

typedef struct {
    const char *path;       /* the backing file to create */
    size_t nslabs, slab_bytes, nslots;
    size_t prefetch_depth;  /* scheduled slabs hinted after each acquire */
    ml_category category;   /* of the file's bytes on the file book, unless: */
    size_t cat_bytes[ML_NCAT];  /* a slab's bytes per category (all 0: the slab is
                                   `category`'s; else they add up to slab_bytes) */
    ml_category slot_category;  /* of the cache slots on the cpu book (the expert
                                   store's: cache; an optimizer's staging: optim) */
} ml_store_opts;

typedef struct ml_expert_store {
    ml_host *host;
    char *path;
    int fd;                 /* -1: opened inside a plan, no file */
    int planned;            /* opened inside a memory plan */
    size_t nslabs, slab_bytes, nslots, stride;   /* stride: slab_bytes rounded up to 64 */
    size_t prefetch_depth;
    ml_tensor slots;        /* u8 [nslots * stride] under `cache`; slot i at i * stride */
    ml_ledger *file_book;   /* where the file's bytes go back */
    size_t file_bytes[ML_NCAT];   /* charged to file_book, per category */
    /* residency */
    int64_t *slot_slab;     /* [nslots] the slab a slot holds, -1: free */
    int64_t *slab_slot;     /* [nslabs] the slot holding a slab, -1: not resident */
    int *pins;              /* [nslots] acquires not yet released */
    unsigned char *dirty;   /* [nslots] must be written back before reuse */
    uint64_t *last_use;     /* [nslots] clock of the last acquire (LRU) */
    uint64_t clock;
    unsigned char *hinted;  /* [nslabs] prefetched and not read since */
    /* the schedule: sched[cursor..nsched) is still ahead */
    int64_t *sched;         /* [nsched] slab ids */
    size_t *sched_next;     /* [nsched] the next index of the same slab, SIZE_MAX: none */
    size_t *slab_next;      /* [nslabs] its next index at or after cursor, SIZE_MAX: none */
    size_t nsched, cursor;
    ml_store_stats stats;
} ml_expert_store;

/* Open a store (every option checked first; a budget refusal creates no
 * file). ML_EINVAL: bad options, the path exists, is on tmpfs/ramfs or
 * cannot be created; ML_EALLOC: a budget refused the file or the slots
 * (the ledger table in e); ML_EIO: the file could not be fallocated (the
 * message names the path and the bytes needed; the partial file is
 * removed). */
ml_status ml_store_open(ml_host *h, const ml_store_opts *o, ml_expert_store **out, ml_err *e);
/* Free the slots (views of them become unusable: "the expert store was
 * closed"), credit the books and remove the file. Writes nothing back:
 * flush first to keep dirty slabs (the file is removed anyway; a caller
 * keeps slabs by reading them out). NULL does nothing. */
void ml_store_close(ml_expert_store *s);

/* Slot i's first byte (64-byte aligned). */
static inline void *ml_store_slot_data(const ml_expert_store *s, size_t slot)
{
    return (char *)s->slots.st->data + slot * s->stride;
}

/* Direct transfers that bypass the policy (the initial fill, checkpoints):
 * read copies slab into slot, write copies slot to slab, synchronously.
 * A slot the policy holds pinned is refused. read makes the slot free
 * (what it held is written back first when dirty) and, when `slab` is
 * resident and dirty elsewhere, writes that copy back first, so read gives
 * the slab's current bytes. write drops `slab`'s resident copy in another
 * slot (refused when pinned), which the write made stale. */
ml_status ml_store_read(ml_expert_store *s, size_t slab, size_t slot, ml_err *e);
ml_status ml_store_write(ml_expert_store *s, size_t slot, size_t slab, ml_err *e);
/* A readahead hint for slab (POSIX_FADV_WILLNEED); counts in prefetches. */
void ml_store_prefetch(ml_expert_store *s, size_t slab);

/* The future access order: seq[0..n) slab ids (copied); replaces the
 * schedule before it, and every slab may be hinted again. n == 0 clears
 * it (LRU). */
ml_status ml_store_schedule(ml_expert_store *s, const int64_t *seq, size_t n, ml_err *e);
/* Make slab resident and pin it: *slot its slot, *hit whether it was
 * resident. A miss takes a free slot or evicts (writing back a dirty
 * victim), then reads the slab. The cursor moves past seq[cursor] when it
 * is this slab; then the next prefetch_depth scheduled slabs that are not
 * resident are hinted (each once until it is read). ML_EINVAL when every
 * slot is pinned. */
ml_status ml_store_acquire(ml_expert_store *s, size_t slab, size_t *slot, int *hit, ml_err *e);
/* Unpin slab; dirty: its slot must be written back before reuse. */
ml_status ml_store_release(ml_expert_store *s, size_t slab, int dirty, ml_err *e);
/* Write back every dirty resident slab (pinned ones too). */
ml_status ml_store_flush(ml_expert_store *s, ml_err *e);
/* The slot holding slab, or -1. */
int64_t ml_store_resident(const ml_expert_store *s, size_t slab);

#endif
