/*
 * host/runtime/store.c - the expert store (store.h): the backing tier (a
 * file on the CPU, pinned host memory on CUDA), the cache slots, the
 * transfers between them and the residency policy.
 */
#include "store.h"
#include "backend.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/magic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/statfs.h>
#include <unistd.h>

#define NONE SIZE_MAX   /* no next use: never scheduled again */

static ml_status check_opts(const ml_store_opts *o, ml_err *e)
{
    if ((unsigned)o->device >= ML_NDEVICES)
        return ml_err_set(e, ML_EINVAL, "device %d is not a device", (int)o->device);
    if (o->device == ML_CPU && (!o->path || !o->path[0]))
        return ml_err_set(e, ML_EINVAL, "path must name the file to create");
    if (o->nslabs == 0)
        return ml_err_set(e, ML_EINVAL, "slabs must be >= 1, got 0");
    if (o->slab_bytes == 0)
        return ml_err_set(e, ML_EINVAL, "slab_bytes must be >= 1, got 0");
    if (o->nslots == 0)
        return ml_err_set(e, ML_EINVAL, "slots must be >= 1, got 0");
    if ((unsigned)o->category >= ML_NCAT || (unsigned)o->slot_category >= ML_NCAT)
        return ml_err_set(e, ML_EINVAL, "category %d is not a ledger category",
                          (int)((unsigned)o->category >= ML_NCAT ? o->category : o->slot_category));
    size_t split = 0;
    for (int c = 0; c < ML_NCAT; c++)
        split += o->cat_bytes[c];
    if (split != 0 && split != o->slab_bytes)
        return ml_err_set(e, ML_EINVAL, "a slab's bytes per category add up to %zu, not slab_bytes "
                          "(%zu)", split, o->slab_bytes);
    /* file offsets and the slots' bytes fit an off_t and an int64 numel */
    if (o->slab_bytes > (size_t)INT64_MAX / 2 || o->nslabs > (size_t)INT64_MAX / o->slab_bytes)
        return ml_err_set(e, ML_EINVAL, "slabs * slab_bytes (%zu * %zu) is too large", o->nslabs,
                          o->slab_bytes);
    size_t stride = (o->slab_bytes + 63) & ~(size_t)63;
    if (o->nslots > (size_t)INT64_MAX / 16 / stride)
        return ml_err_set(e, ML_EINVAL, "slots * slab_bytes (%zu * %zu) is too large", o->nslots,
                          o->slab_bytes);
    return ML_OK;
}

/* Create the backing file: never an existing one, never on tmpfs/ramfs,
 * every byte fallocated. On failure after the file exists, s->fd is set
 * so that ml_store_close removes it. */
static ml_status create_file(ml_expert_store *s, size_t bytes, ml_err *e)
{
    int fd = open(s->path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0 && errno == EEXIST)
        return ml_err_set(e, ML_EINVAL, "%s exists: the store creates its file and never "
                          "overwrites one (remove it or choose another path)", s->path);
    if (fd < 0)
        return ml_err_set(e, ML_EINVAL, "cannot create %s: %s%s", s->path, strerror(errno),
                          errno == ENOENT ? " (its directory must exist)" : "");
    s->fd = fd;
    struct statfs fs;
    if (fstatfs(fd, &fs) == 0 && (fs.f_type == TMPFS_MAGIC || fs.f_type == RAMFS_MAGIC))
        return ml_err_set(e, ML_EINVAL, "%s is on %s: its pages are memory, so the store would "
                          "not bound anything; put it on a disk", s->path,
                          fs.f_type == TMPFS_MAGIC ? "tmpfs" : "ramfs");
    int err = posix_fallocate(fd, 0, (off_t)bytes);
    if (err) {
        char need[32];
        ml_format_bytes(bytes, need, sizeof need);
        return ml_err_set(e, ML_EIO, "cannot allocate %s (%zu bytes) for the store at %s: "
                          "%s (the store takes its whole file up front)", need, bytes, s->path,
                          strerror(err));
    }
    return ML_OK;
}

/* CUDA's backing tier: the slabs in pinned host memory (zeros, as a new
 * file reads; a plan's address space is left untouched), the copy stream
 * and each slot's two events. */
static ml_status open_pinned(ml_expert_store *s, size_t bytes, ml_err *e)
{
    const ml_memory *m = s->host->mem[ML_CUDA];
    if (!m || !m->host_alloc)
        return ml_err_set(e, ML_EINVAL, "the store's slabs live in pinned host memory on cuda, "
                          "which this build lacks");
    s->mem = m;
    s->pinned = m->host_alloc(bytes);
    if (!s->pinned) {
        char need[32];
        ml_format_bytes(bytes, need, sizeof need);
        return ml_err_set(e, ML_EALLOC, "cannot pin %s (%zu bytes) of host memory for the store's "
                          "slabs", need, bytes);
    }
    if (!s->planned)
        memset(s->pinned, 0, bytes);
    s->copied = calloc(s->nslots, sizeof *s->copied);
    s->released = calloc(s->nslots, sizeof *s->released);
    s->unawaited = calloc(s->nslots, 1);
    if (!s->copied || !s->released || !s->unawaited)
        return ml_err_set(e, ML_EALLOC, "out of memory for the store's events");
    ml_status st = m->stream_new(&s->copy_stream);
    for (size_t i = 0; i < s->nslots && st == ML_OK; i++) {
        st = m->event_new(&s->copied[i]);
        if (st == ML_OK)
            st = m->event_new(&s->released[i]);
    }
    return ml_kernel_status(st, e);
}

/* The tables of the policy, empty: no slab resident, no schedule. */
static int alloc_tables(ml_expert_store *s)
{
    s->slot_slab = calloc(s->nslots, sizeof *s->slot_slab);
    s->slab_slot = calloc(s->nslabs, sizeof *s->slab_slot);
    s->slab_next = calloc(s->nslabs, sizeof *s->slab_next);
    s->pins = calloc(s->nslots, sizeof *s->pins);
    s->dirty = calloc(s->nslots, 1);
    s->last_use = calloc(s->nslots, sizeof *s->last_use);
    s->hinted = calloc(s->nslabs, 1);
    if (!s->slot_slab || !s->slab_slot || !s->slab_next || !s->pins || !s->dirty || !s->last_use ||
        !s->hinted)
        return -1;
    for (size_t i = 0; i < s->nslots; i++)
        s->slot_slab[i] = -1;
    for (size_t i = 0; i < s->nslabs; i++) {
        s->slab_slot[i] = -1;
        s->slab_next[i] = NONE;
    }
    return 0;
}

ml_status ml_store_open(ml_host *h, const ml_store_opts *o, ml_expert_store **out, ml_err *e)
{
    *out = NULL;
    ML_TRY(check_opts(o, e));
    ml_expert_store *s = calloc(1, sizeof *s);
    if (!s)
        return ml_err_set(e, ML_EALLOC, "out of memory for the store");
    s->host = h;
    s->device = o->device;
    s->fd = -1;
    s->planned = h->planning;
    s->nslabs = o->nslabs;
    s->slab_bytes = o->slab_bytes;
    s->nslots = o->nslots;
    s->stride = (o->slab_bytes + 63) & ~(size_t)63;
    s->prefetch_depth = o->prefetch_depth;
    s->path = o->device == ML_CPU ? strdup(o->path) : NULL;
    if ((o->device == ML_CPU && !s->path) || alloc_tables(s) != 0) {
        ml_store_close(s);
        return ml_err_set(e, ML_EALLOC, "out of memory for the store's tables");
    }
    /* the budgets first, so a refusal creates no file */
    size_t backing = s->nslabs * s->slab_bytes;
    ml_tier tier = o->device == ML_CUDA ? ML_TIER_PINNED : ML_TIER_FILE;
    int split = 0;
    for (int c = 0; c < ML_NCAT; c++)
        split |= o->cat_bytes[c] != 0;
    ml_status st = ML_OK;
    for (int c = 0; c < ML_NCAT && st == ML_OK; c++) {
        size_t n = split ? s->nslabs * o->cat_bytes[c] : c == (int)o->category ? backing : 0;
        if (n > 0) {
            st = ml_tier_charge(h, tier, (ml_category)c, n, "allocating", &s->backing_book, e);
            if (st == ML_OK)
                s->backing_bytes[c] = n;
        }
    }
    if (st == ML_OK) {
        ml_category saved = h->category;
        int64_t n = (int64_t)(s->nslots * s->stride);
        h->category = o->slot_category;
        st = ml_tensor_alloc(h, &s->slots, o->device, ML_U8, 1, &n, e);
        h->category = saved;
    }
    if (st == ML_OK && o->device == ML_CUDA)
        st = open_pinned(s, backing, e);
    else if (st == ML_OK && !s->planned)
        st = create_file(s, backing, e);
    if (st != ML_OK) {
        ml_store_close(s);
        return st;
    }
    *out = s;
    return ML_OK;
}

/* Undo open_pinned, after the copy stream has finished. */
static void close_pinned(ml_expert_store *s)
{
    const ml_memory *m = s->mem;
    if (s->copy_stream) {
        (void)m->synchronize(s->copy_stream);   /* an error was reported by the copy that made it */
        m->stream_free(s->copy_stream);
    }
    for (size_t i = 0; i < s->nslots; i++) {
        if (s->copied && s->copied[i])
            m->event_free(s->copied[i]);
        if (s->released && s->released[i])
            m->event_free(s->released[i]);
    }
    free(s->copied);
    free(s->released);
    free(s->unawaited);
    if (s->pinned)
        m->host_free(s->pinned, s->nslabs * s->slab_bytes);
}

void ml_store_close(ml_expert_store *s)
{
    if (!s)
        return;
    if (s->mem)   /* no copy may still read or write the slots or the slabs */
        close_pinned(s);
    if (s->slots.st) {
        ml_storage_release_memory(s->slots.st, "the expert store was closed");
        ml_tensor_drop(&s->slots);
    }
    for (int c = 0; c < ML_NCAT; c++)
        if (s->backing_bytes[c])
            ml_ledger_credit(s->backing_book, (ml_category)c, s->backing_bytes[c]);
    if (s->fd >= 0) {
        close(s->fd);
        unlink(s->path);
    }
    free(s->slot_slab);
    free(s->slab_slot);
    free(s->slab_next);
    free(s->pins);
    free(s->dirty);
    free(s->last_use);
    free(s->hinted);
    free(s->sched);
    free(s->sched_next);
    free(s->path);
    free(s);
}

/* ---- transfers ---------------------------------------------------------- */

/* A store moves slabs only in the kind of run it was opened in: a real
 * one outside plans, a planned one inside its plan. */
static ml_status check_usable(const ml_expert_store *s, ml_err *e)
{
    if (s->planned && !s->host->planning)
        return ml_err_set(e, ML_EINVAL, "the store was opened inside a memory plan that has ended "
                          "(it holds no memory)");
    if (!s->planned && s->host->planning)
        return ml_err_set(e, ML_EINVAL, "the store was opened outside moelua.mem.plan, which "
                          "cannot move its slabs (open the store inside the planned function)");
    return ML_OK;
}

static ml_status check_index(size_t i, size_t n, const char *what, ml_err *e)
{
    if (i >= n)
        return ml_err_set(e, ML_EINVAL, "%s %zu is outside [0, %zu)", what, i, n);
    return ML_OK;
}

/* Slab <-> slot, whole, on this thread: pwrite when `out`, else pread
 * (short transfers and EINTR continue). */
static ml_status move_file(ml_expert_store *s, int out, size_t slab, size_t slot, ml_err *e)
{
    char *buf = ml_store_slot_data(s, slot);
    off_t off = (off_t)(slab * s->slab_bytes);
    size_t n = s->slab_bytes, done = 0;
    while (done < n) {
        ssize_t r = out ? pwrite(s->fd, buf + done, n - done, off + (off_t)done)
                        : pread(s->fd, buf + done, n - done, off + (off_t)done);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return ml_err_set(e, ML_EIO, "%s slab %zu of %s: %s", out ? "writing" : "reading", slab,
                              s->path, r < 0 ? strerror(errno)
                                             : out ? "no byte was written" : "the file ended early");
        done += (size_t)r;
    }
    return ML_OK;
}

/* Slab <-> slot on the copy stream: D2H when `out`, else H2D. The copy
 * waits for the compute stream's last use of the slot (its `released`
 * event) and records its `copied` event, which kernels touching the slot
 * must wait for (await_slot): a read's bytes must arrive first, and a
 * write-back must have read the slot before a kernel changes it. The wait
 * is not queued here: a copy-ahead's must not hold up the kernels queued
 * before its slab is acquired. */
static ml_status move_pinned(ml_expert_store *s, int out, size_t slab, size_t slot, ml_err *e)
{
    const ml_memory *m = s->mem;
    void *dev = ml_store_slot_data(s, slot), *host = s->pinned + slab * s->slab_bytes;
    ml_status st = m->stream_wait(s->copy_stream, s->released[slot]);
    if (st == ML_OK)
        st = out ? m->memcpy(host, dev, s->slab_bytes, ML_COPY_D2H, s->copy_stream)
                 : m->memcpy(dev, host, s->slab_bytes, ML_COPY_H2D, s->copy_stream);
    if (st == ML_OK)
        st = m->event_record(s->copied[slot], s->copy_stream);
    if (st == ML_OK) {
        s->unawaited[slot] = 1;
        return ML_OK;
    }
    ml_err why;
    ml_kernel_status(st, &why);
    return ml_err_set(e, st, "%s slab %zu (pinned host memory, slot %zu on cuda): %s",
                      out ? "writing" : "reading", slab, slot, why.msg);
}

/* Mark the compute stream's work so far as slot's last use: a copy into
 * or out of it waits for that (CUDA; nothing elsewhere). */
static ml_status fence_slot(ml_expert_store *s, size_t slot, ml_err *e)
{
    if (!s->mem)
        return ML_OK;
    return ml_kernel_status(s->mem->event_record(s->released[slot], ml_host_kctx(s->host).stream), e);
}

/* Kernels queued from now on wait for slot's copies so far (CUDA: the
 * compute stream waits for its `copied` event, once per copy; the copy
 * stream is in order, so its last copy's event covers the earlier ones). */
static ml_status await_slot(ml_expert_store *s, size_t slot, ml_err *e)
{
    if (!s->mem || !s->unawaited[slot])
        return ML_OK;
    ML_TRY(ml_kernel_status(s->mem->stream_wait(ml_host_kctx(s->host).stream, s->copied[slot]), e));
    s->unawaited[slot] = 0;
    return ML_OK;
}

/* await_slot for every slot: the direct transfers and flush return with
 * their copies awaited (and any copy-ahead's: they are rare, and kernels
 * may touch the slots through views without an acquire). */
static ml_status await_all(ml_expert_store *s, ml_err *e)
{
    for (size_t i = 0; i < s->nslots; i++)
        ML_TRY(await_slot(s, i, e));
    return ML_OK;
}

/* Slab <-> slot in the device's way. A planned store moves nothing but
 * counts the bytes a run would move (its counters are the run's). */
static ml_status transfer(ml_expert_store *s, int out, size_t slab, size_t slot, ml_err *e)
{
    if (!s->planned)
        ML_TRY(s->device == ML_CUDA ? move_pinned(s, out, slab, slot, e)
                                    : move_file(s, out, slab, slot, e));
    size_t n = s->slab_bytes;
    if (out) {
        s->stats.bytes_written += n;
    } else {
        s->stats.bytes_read += n;
        s->hinted[slab] = 0;
    }
    return ML_OK;
}

/* The slab in slot written back when dirty. */
static ml_status write_back(ml_expert_store *s, size_t slot, ml_err *e)
{
    if (!s->dirty[slot])
        return ML_OK;
    ML_TRY(transfer(s, 1, (size_t)s->slot_slab[slot], slot, e));
    s->dirty[slot] = 0;
    s->stats.writebacks++;
    return ML_OK;
}

/* slot holds nothing now. */
static void unmap_slot(ml_expert_store *s, size_t slot)
{
    if (s->slot_slab[slot] >= 0)
        s->slab_slot[s->slot_slab[slot]] = -1;
    s->slot_slab[slot] = -1;
    s->dirty[slot] = 0;
}

static ml_status check_unpinned(const ml_expert_store *s, size_t slot, ml_err *e)
{
    if (s->pins[slot])
        return ml_err_set(e, ML_EINVAL, "slot %zu holds slab %lld, which is acquired (release it "
                          "first)", slot, (long long)s->slot_slab[slot]);
    return ML_OK;
}

ml_status ml_store_read(ml_expert_store *s, size_t slab, size_t slot, ml_err *e)
{
    ML_TRY(check_usable(s, e));
    ML_TRY(check_index(slab, s->nslabs, "slab", e));
    ML_TRY(check_index(slot, s->nslots, "slot", e));
    ML_TRY(check_unpinned(s, slot, e));
    ML_TRY(fence_slot(s, slot, e));
    if (s->slab_slot[slab] >= 0)   /* the file gets the current bytes first */
        ML_TRY(write_back(s, (size_t)s->slab_slot[slab], e));
    ML_TRY(write_back(s, slot, e));
    unmap_slot(s, slot);
    ML_TRY(transfer(s, 0, slab, slot, e));
    return await_all(s, e);
}

ml_status ml_store_write(ml_expert_store *s, size_t slot, size_t slab, ml_err *e)
{
    ML_TRY(check_usable(s, e));
    ML_TRY(check_index(slot, s->nslots, "slot", e));
    ML_TRY(check_index(slab, s->nslabs, "slab", e));
    ML_TRY(check_unpinned(s, slot, e));
    ML_TRY(fence_slot(s, slot, e));
    int64_t other = s->slab_slot[slab];
    if (other >= 0 && (size_t)other != slot) {   /* its resident copy becomes stale */
        ML_TRY(check_unpinned(s, (size_t)other, e));
        unmap_slot(s, (size_t)other);
    }
    ML_TRY(transfer(s, 1, slab, slot, e));
    if (other >= 0 && (size_t)other == slot)
        s->dirty[slot] = 0;
    return await_all(s, e);
}

void ml_store_prefetch(ml_expert_store *s, size_t slab)
{
    if (s->device != ML_CPU || slab >= s->nslabs)   /* CUDA copies ahead instead */
        return;
    /* a hint: the kernel starts reading the range; a refusal changes nothing
     * (a plan has no file, and counts the hint as its run would) */
    if (s->fd >= 0)
        (void)posix_fadvise(s->fd, (off_t)(slab * s->slab_bytes), (off_t)s->slab_bytes,
                            POSIX_FADV_WILLNEED);
    s->hinted[slab] = 1;
    s->stats.prefetches++;
}

/* ---- the policy ----------------------------------------------------------- */

ml_status ml_store_schedule(ml_expert_store *s, const int64_t *seq, size_t n, ml_err *e)
{
    ML_TRY(check_usable(s, e));
    for (size_t i = 0; i < n; i++)
        if (seq[i] < 0 || (uint64_t)seq[i] >= s->nslabs)
            return ml_err_set(e, ML_EINVAL, "schedule entry %zu is slab %lld, outside [0, %zu)",
                              i + 1, (long long)seq[i], s->nslabs);
    int64_t *sched = n ? malloc(n * sizeof *sched) : NULL;
    size_t *next = n ? malloc(n * sizeof *next) : NULL;
    if (n && (!sched || !next)) {
        free(sched);
        free(next);
        return ml_err_set(e, ML_EALLOC, "out of memory for a schedule of %zu slabs", n);
    }
    /* a new step: its slabs may be hinted again (the page cache may have
     * dropped what an earlier step's hint read) */
    memset(s->hinted, 0, s->nslabs);
    for (size_t b = 0; b < s->nslabs; b++)
        s->slab_next[b] = NONE;
    for (size_t i = n; i-- > 0;) {   /* backwards: each entry learns the next of its slab */
        sched[i] = seq[i];
        next[i] = s->slab_next[seq[i]];
        s->slab_next[seq[i]] = i;
    }
    free(s->sched);
    free(s->sched_next);
    s->sched = sched;
    s->sched_next = next;
    s->nsched = n;
    s->cursor = 0;
    return ML_OK;
}

/* The slot a slab that is not resident would take: the first free one,
 * else the unpinned slot whose slab is needed furthest ahead (never again
 * is furthest; ties: least recently used). NONE: every slot is pinned. */
static size_t choose_slot(const ml_expert_store *s)
{
    size_t best = NONE, best_next = 0;
    for (size_t i = 0; i < s->nslots; i++) {
        if (s->slot_slab[i] < 0)
            return i;
        if (s->pins[i])
            continue;
        size_t next = s->slab_next[s->slot_slab[i]];
        if (best == NONE || next > best_next ||
            (next == best_next && s->last_use[i] < s->last_use[best])) {
            best = i;
            best_next = next;
        }
    }
    return best;
}

/* slot emptied for another slab: the slab it holds, if any, evicted
 * (written back first when dirty). */
static ml_status vacate(ml_expert_store *s, size_t slot, ml_err *e)
{
    if (s->slot_slab[slot] < 0)
        return ML_OK;
    ML_TRY(write_back(s, slot, e));
    unmap_slot(s, slot);
    s->stats.evictions++;
    return ML_OK;
}

/* slot holds slab, just read: the most recently used. */
static void map_slot(ml_expert_store *s, size_t slot, size_t slab)
{
    s->slot_slab[slot] = (int64_t)slab;
    s->slab_slot[slab] = (int64_t)slot;
    s->last_use[slot] = ++s->clock;
}

/* Whether a copy-ahead of slab (not resident) may take slot `at`
 * (choose_slot's): only as its miss would at its acquire. A free slot, or
 * a victim needed later than slab and later than every pinned slab: once
 * released, a pinned slab needed later would be the miss's victim, so
 * evicting this one now would trade it for an extra read (a victim needed
 * before slab would trade slab's miss for an earlier one). */
static int ahead_may_take(const ml_expert_store *s, size_t at, size_t slab)
{
    if (s->slot_slab[at] < 0)
        return 1;
    size_t victim = s->slab_next[s->slot_slab[at]];
    if (victim <= s->slab_next[slab])
        return 0;
    for (size_t i = 0; i < s->nslots; i++)
        if (s->pins[i] && s->slab_next[s->slot_slab[i]] > victim)
            return 0;
    return 1;
}

/* CUDA: slab (not resident) copied into a slot now, on the copy stream,
 * so that the copy overlaps the kernels queued until its acquire, which
 * is then a hit whose kernels wait for it (await_slot). Refused (tried
 * again at the next acquire) where ahead_may_take says no. In a plan the
 * same slots are taken (the plan's counters are the run's) and no byte
 * moves. */
static ml_status copy_ahead(ml_expert_store *s, size_t slab, ml_err *e)
{
    size_t at = choose_slot(s);
    if (at == NONE || !ahead_may_take(s, at, slab))
        return ML_OK;
    ML_TRY(vacate(s, at, e));
    ML_TRY(transfer(s, 0, slab, at, e));
    map_slot(s, at, slab);
    s->stats.prefetches++;
    return ML_OK;
}

/* After an acquire: the next prefetch_depth scheduled slabs that are not
 * resident are read ahead: on CUDA copied into slots (copy_ahead), on the
 * CPU hinted (each once until it is read). */
static ml_status read_ahead(ml_expert_store *s, ml_err *e)
{
    for (size_t i = s->cursor; i < s->nsched && i - s->cursor < s->prefetch_depth; i++) {
        size_t slab = (size_t)s->sched[i];
        if (s->slab_slot[slab] >= 0)
            continue;
        if (s->device == ML_CUDA)
            ML_TRY(copy_ahead(s, slab, e));
        else if (!s->hinted[slab])
            ml_store_prefetch(s, slab);
    }
    return ML_OK;
}

ml_status ml_store_acquire(ml_expert_store *s, size_t slab, size_t *slot, int *hit, ml_err *e)
{
    ML_TRY(check_usable(s, e));
    ML_TRY(check_index(slab, s->nslabs, "slab", e));
    size_t at = 0;
    *hit = s->slab_slot[slab] >= 0;
    if (*hit) {
        at = (size_t)s->slab_slot[slab];
        s->last_use[at] = ++s->clock;
        s->stats.hits++;
    } else {
        at = choose_slot(s);
        if (at == NONE)
            return ml_err_set(e, ML_EINVAL, "all %zu cache slots are in use: the budget holds fewer "
                              "experts than one step needs at once", s->nslots);
        ML_TRY(vacate(s, at, e));
        ML_TRY(transfer(s, 0, slab, at, e));
        map_slot(s, at, slab);
        s->stats.misses++;
    }
    s->pins[at]++;
    if (s->cursor < s->nsched && s->sched[s->cursor] == (int64_t)slab) {
        s->slab_next[slab] = s->sched_next[s->cursor];
        s->cursor++;
    }
    /* the kernels of this slab wait for its copies (a miss's, an earlier
     * copy-ahead's), not for the copies read_ahead queues after them */
    ml_status st = await_slot(s, at, e);
    if (st == ML_OK)
        st = read_ahead(s, e);
    if (st != ML_OK) {   /* a device error: nothing is acquired */
        s->pins[at]--;
        return st;
    }
    *slot = at;
    return ML_OK;
}

ml_status ml_store_release(ml_expert_store *s, size_t slab, int dirty, ml_err *e)
{
    ML_TRY(check_usable(s, e));
    ML_TRY(check_index(slab, s->nslabs, "slab", e));
    int64_t at = s->slab_slot[slab];
    if (at < 0 || s->pins[at] == 0)
        return ml_err_set(e, ML_EINVAL, "slab %zu is not acquired (release it once per acquire)",
                          slab);
    s->pins[at]--;
    s->dirty[at] |= dirty != 0;
    return s->pins[at] ? ML_OK : fence_slot(s, (size_t)at, e);
}

ml_status ml_store_flush(ml_expert_store *s, ml_err *e)
{
    ML_TRY(check_usable(s, e));
    for (size_t i = 0; i < s->nslots; i++) {
        if (s->slot_slab[i] < 0)
            continue;
        if (s->pins[i])   /* acquired: its kernels so far are what the write-back must see */
            ML_TRY(fence_slot(s, i, e));
        ML_TRY(write_back(s, i, e));
    }
    return await_all(s, e);
}

int64_t ml_store_resident(const ml_expert_store *s, size_t slab)
{
    return slab < s->nslabs ? s->slab_slot[slab] : -1;
}
