/*
 * tests/c/test_store.c - the expert store (host/runtime/store.h) on a host
 * with the CPU backend and no Lua state, printing TAP.
 *
 * Covers: open charges the file book (the file's bytes) and the cpu book
 * (`cache`, one allocation, every slot 64-byte aligned) and close gives
 * every byte back and removes the file; write/read round trips; the
 * policy's hits, misses, evictions and prefetch hints on a known schedule
 * (furthest next use) and the same order without one (LRU); dirty slabs
 * written back on eviction and by flush, their bytes kept; the all-pinned
 * error; bad arguments; refusals that leave nothing behind: an existing
 * file (kept as it was), tmpfs (/dev/shm), a full file system or file-size
 * limit (RLIMIT_FSIZE in a child), a budget on the file or cache book;
 * plans: a store opened in a plan charges the plan's books and creates no
 * file, one opened outside cannot move slabs inside; views of a closed
 * store's slots are unusable. Not here: the Lua face (tests/spec/store_spec.lua).
 */
#include <linux/magic.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/statfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include "plan.h"
#include "store.h"
#include "tap.h"

static char dir[4096];

/* A directory for the test's files on a disk: $TMPDIR or /tmp unless it
 * is tmpfs (the store refuses that), else build/. */
static int make_dir(void)
{
    const char *bases[] = {getenv("TMPDIR"), "/tmp", "build"};
    for (size_t i = 0; i < sizeof bases / sizeof *bases; i++) {
        struct statfs fs;
        if (!bases[i] || statfs(bases[i], &fs) != 0 || fs.f_type == TMPFS_MAGIC ||
            fs.f_type == RAMFS_MAGIC)
            continue;
        snprintf(dir, sizeof dir, "%s/moelua-store-XXXXXX", bases[i]);
        if (mkdtemp(dir))
            return 0;
    }
    return -1;
}

static const char *path_of(const char *name)
{
    static char buf[4200];
    snprintf(buf, sizeof buf, "%s/%s", dir, name);
    return buf;
}

static int exists(const char *path) { return access(path, F_OK) == 0; }

static ml_expert_store *open_store(ml_host *h, const char *name, size_t slabs, size_t slab_bytes,
                                   size_t slots, size_t prefetch, ml_err *e)
{
    ml_store_opts o = {.path = path_of(name), .nslabs = slabs, .slab_bytes = slab_bytes, .nslots = slots,
                       .prefetch_depth = prefetch, .category = ML_CAT_PARAMS, .slot_category = ML_CAT_CACHE};
    ml_expert_store *s = NULL;
    ml_store_open(h, &o, &s, e);
    return s;
}

/* Slab b's bytes: b * 7 + i, so every slab and every byte differ. */
static void fill(unsigned char *p, size_t n, size_t b, int add)
{
    for (size_t i = 0; i < n; i++)
        p[i] = (unsigned char)(b * 7 + i + (size_t)add);
}

static int holds(const unsigned char *p, size_t n, size_t b, int add)
{
    for (size_t i = 0; i < n; i++)
        if (p[i] != (unsigned char)(b * 7 + i + (size_t)add))
            return 0;
    return 1;
}

static void test_books_and_io(void)
{
    ml_host h;
    ml_host_init(&h);
    ml_err e;
    /* 100-byte slabs: a stride of 128 */
    ml_expert_store *s = open_store(&h, "io", 5, 100, 3, 0, &e);
    ok(s != NULL, "open: 5 slabs of 100 bytes, 3 slots");
    if (!s)
        return;
    ok(exists(path_of("io")), "open: the file exists");
    ok(h.books[ML_TIER_FILE].cur[ML_CAT_PARAMS] == 500 && h.books[ML_TIER_FILE].total == 500,
       "books: the file's 500 bytes on the file book under params");
    ok(h.books[ML_CPU].cur[ML_CAT_CACHE] == 3 * 128 && h.books[ML_CPU].nalloc[ML_CAT_CACHE] == 1 &&
       h.books[ML_CPU].total == 3 * 128, "books: the slots are one cache allocation of 3 * 128 bytes");
    int aligned = 1;
    for (size_t i = 0; i < 3; i++)
        aligned &= (uintptr_t)ml_store_slot_data(s, i) % 64 == 0;
    ok(aligned && s->stride == 128, "slots: every slot is 64-byte aligned");
    int good = 1;
    for (size_t b = 0; b < 5; b++) {
        fill(ml_store_slot_data(s, b % 3), 100, b, 0);
        good &= ml_store_write(s, b % 3, b, &e) == ML_OK;
    }
    for (size_t b = 0; b < 5; b++) {
        memset(ml_store_slot_data(s, 2), 0, 100);
        good &= ml_store_read(s, b, 2, &e) == ML_OK && holds(ml_store_slot_data(s, 2), 100, b, 0);
    }
    ok(good && s->stats.bytes_written == 500 && s->stats.bytes_read == 500,
       "write then read: every slab round trips, 500 bytes each way");
    ok(ml_store_read(s, 5, 0, &e) == ML_EINVAL && strcmp(e.msg, "slab 5 is outside [0, 5)") == 0,
       "read: slab out of range: %s", e.msg);
    ok(ml_store_write(s, 3, 0, &e) == ML_EINVAL && strcmp(e.msg, "slot 3 is outside [0, 3)") == 0,
       "write: slot out of range: %s", e.msg);
    /* a view of the slots outlives the store: it becomes unusable, not dangling */
    ml_storage *view = s->slots.st;
    ml_storage_retain(view);
    char path[4200];
    snprintf(path, sizeof path, "%s", s->path);
    ml_store_close(s);
    ok(ml_storage_unusable(view) && strcmp(ml_storage_unusable(view), "the expert store was closed") == 0,
       "close: a view of a slot says the store was closed");
    ml_storage_release(view);
    ok(!exists(path), "close: the file is removed");
    ok(h.books[ML_TIER_FILE].total == 0 && h.books[ML_CPU].total == 0,
       "close: both books are back to zero");
    ml_host_free(&h);
}

/* Acquire each slab of seq in turn, releasing it at once. */
static int run(ml_expert_store *s, const int64_t *seq, size_t n, int *hits)
{
    ml_err e;
    for (size_t i = 0; i < n; i++) {
        size_t slot;
        int hit;
        if (ml_store_acquire(s, (size_t)seq[i], &slot, &hit, &e) != ML_OK ||
            ml_store_release(s, (size_t)seq[i], 0, &e) != ML_OK)
            return -1;
        hits[i] = hit;
    }
    return 0;
}

static void test_policy(void)
{
    ml_host h;
    ml_host_init(&h);
    ml_err e;
    /* 3 slots, the cyclic order 0 1 2 3 0 1 2 3 (plain LRU's worst case).
     * With the schedule (cursor at the access being served when a victim
     * is chosen):
     *   0 1 2  miss x3 into the free slots
     *   3      miss: next uses 0@4 1@5 2@6: evict 2 (furthest)
     *   0 1    hits
     *   2      miss: next uses 3@7, 0 and 1 never: a tie, LRU among them:
     *          0 (used at clock 5) before 1 (clock 6): evict 0
     *   3      hit
     * = 3 hits, 5 misses, 2 evictions. Prefetch depth 2, each slab hinted
     * once until read: after 0: 1, 2; after 1: 3; after 3 (cursor 4): none;
     * after the second 0 (cursor 5): 2 (evicted, read since) = 4 hints. */
    const int64_t seq[8] = {0, 1, 2, 3, 0, 1, 2, 3};
    const int belady[8] = {0, 0, 0, 0, 1, 1, 0, 1};
    ml_expert_store *s = open_store(&h, "policy", 4, 64, 3, 2, &e);
    int hits[8];
    ok(s && ml_store_schedule(s, seq, 8, &e) == ML_OK && run(s, seq, 8, hits) == 0 &&
       memcmp(hits, belady, sizeof hits) == 0,
       "schedule: furthest next use gives hits at 0 1 and the last 3");
    ok(s && s->stats.hits == 3 && s->stats.misses == 5 && s->stats.evictions == 2 &&
       s->stats.writebacks == 0 && s->stats.bytes_read == 5 * 64,
       "schedule: 3 hits, 5 misses, 2 evictions, no write-back of clean slabs");
    ok(s && s->stats.prefetches == 4, "schedule: 4 prefetch hints (got %llu)",
       s ? (unsigned long long)s->stats.prefetches : 0ULL);
    ok(s && ml_store_resident(s, 2) >= 0 && ml_store_resident(s, 3) >= 0 &&
       ml_store_resident(s, 1) >= 0 && ml_store_resident(s, 0) == -1,
       "schedule: 1, 2, 3 resident at the end, 0 not");
    ml_store_close(s);

    /* The same order without a schedule: LRU evicts the slab needed next
     * every time: 8 misses, 5 evictions, no hint. */
    s = open_store(&h, "lru", 4, 64, 3, 2, &e);
    const int none[8] = {0};
    ok(s && run(s, seq, 8, hits) == 0 && memcmp(hits, none, sizeof hits) == 0 &&
       s->stats.misses == 8 && s->stats.evictions == 5 && s->stats.prefetches == 0,
       "no schedule: LRU, 8 misses and 5 evictions on the cyclic order");
    /* An exhausted schedule is LRU again: 0 1 2 scheduled, then 3 evicts
     * the least recently used (0), not the one the schedule last named. */
    const int64_t short_seq[3] = {0, 1, 2};
    ml_store_close(s);
    s = open_store(&h, "lru2", 4, 64, 3, 0, &e);
    const int64_t after[4] = {0, 1, 2, 3};
    ok(s && ml_store_schedule(s, short_seq, 3, &e) == ML_OK && run(s, after, 4, hits) == 0 &&
       ml_store_resident(s, 0) == -1 && ml_store_resident(s, 1) >= 0,
       "exhausted schedule: LRU evicts 0");
    ok(s && ml_store_schedule(s, (const int64_t[]){1, 4}, 2, &e) == ML_EINVAL &&
       strcmp(e.msg, "schedule entry 2 is slab 4, outside [0, 4)") == 0, "schedule: %s", e.msg);
    ml_store_close(s);
    ok(h.books[ML_TIER_FILE].total == 0 && h.books[ML_CPU].total == 0, "policy: books back to zero");
    ml_host_free(&h);
}

static void test_dirty(void)
{
    ml_host h;
    ml_host_init(&h);
    ml_err e;
    ml_expert_store *s = open_store(&h, "dirty", 3, 200, 2, 0, &e);
    if (!s) {
        ok(0, "open: %s", e.msg);
        return;
    }
    for (size_t b = 0; b < 3; b++) {
        fill(ml_store_slot_data(s, 0), 200, b, 0);
        ml_store_write(s, 0, b, &e);
    }
    size_t slot;
    int hit;
    /* 0 changed and released dirty; 1 clean; 2 evicts 0 (LRU): written back */
    ok(ml_store_acquire(s, 0, &slot, &hit, &e) == ML_OK && !hit &&
       holds(ml_store_slot_data(s, slot), 200, 0, 0), "acquire: a miss reads the slab");
    fill(ml_store_slot_data(s, slot), 200, 0, 100);
    ml_store_release(s, 0, 1, &e);
    ml_store_acquire(s, 1, &slot, &hit, &e);
    ml_store_release(s, 1, 0, &e);
    ok(ml_store_acquire(s, 2, &slot, &hit, &e) == ML_OK && s->stats.evictions == 1 &&
       s->stats.writebacks == 1 && ml_store_resident(s, 0) == -1,
       "evicting a dirty slab writes it back first");
    ml_store_release(s, 2, 0, &e);
    ok(ml_store_acquire(s, 0, &slot, &hit, &e) == ML_OK && !hit &&
       holds(ml_store_slot_data(s, slot), 200, 0, 100) && s->stats.writebacks == 1,
       "re-read after eviction: the changed bytes were kept (the clean victim was not written)");
    /* all pinned: 0 is held; acquire 1 takes the other slot; 2 finds none */
    ok(ml_store_acquire(s, 1, &slot, &hit, &e) == ML_OK, "acquire: a second pin");
    uint64_t misses = s->stats.misses;
    ok(ml_store_acquire(s, 2, &slot, &hit, &e) == ML_EINVAL &&
       strcmp(e.msg, "all 2 cache slots are in use: the budget holds fewer experts than one step "
                     "needs at once") == 0 && s->stats.misses == misses,
       "all slots pinned: %s", e.msg);
    fill(ml_store_slot_data(s, (size_t)ml_store_resident(s, 1)), 200, 1, 50);
    ok(ml_store_release(s, 1, 1, &e) == ML_OK && ml_store_release(s, 0, 0, &e) == ML_OK,
       "release both");
    ok(ml_store_release(s, 0, 0, &e) == ML_EINVAL &&
       strcmp(e.msg, "slab 0 is not acquired (release it once per acquire)") == 0,
       "release of an unpinned slab: %s", e.msg);
    ok(ml_store_release(s, 2, 0, &e) == ML_EINVAL, "release of a slab that is not resident");
    ok(ml_store_release(s, 9, 0, &e) == ML_EINVAL && strcmp(e.msg, "slab 9 is outside [0, 3)") == 0,
       "release out of range: %s", e.msg);
    ok(ml_store_flush(s, &e) == ML_OK && s->stats.writebacks == 2 && ml_store_flush(s, &e) == ML_OK &&
       s->stats.writebacks == 2, "flush writes the dirty slab 1 once");
    /* a direct read into a slot the policy holds frees the slot; the file had the current bytes */
    int64_t held1 = ml_store_resident(s, 1);
    ok(ml_store_read(s, 1, (size_t)(1 - held1), &e) == ML_OK &&
       holds(ml_store_slot_data(s, (size_t)(1 - held1)), 200, 1, 50) && ml_store_resident(s, 0) == -1,
       "read: the slab's current bytes, into a slot the policy gives up");
    ml_store_acquire(s, 0, &slot, &hit, &e);
    ok(ml_store_read(s, 2, slot, &e) == ML_EINVAL &&
       strstr(e.msg, "holds slab 0, which is acquired (release it first)"),
       "read into a pinned slot: %s", e.msg);
    ml_store_release(s, 0, 0, &e);
    ml_store_close(s);
    ok(h.books[ML_TIER_FILE].total == 0 && h.books[ML_CPU].total == 0, "dirty: books back to zero");
    ml_host_free(&h);
}

static void test_refusals(void)
{
    ml_host h;
    ml_host_init(&h);
    ml_err e;
    /* an existing file is never overwritten */
    FILE *f = fopen(path_of("mine"), "w");
    fputs("keep", f);
    fclose(f);
    ml_expert_store *s = open_store(&h, "mine", 2, 64, 1, 0, &e);
    char buf[8] = {0};
    f = fopen(path_of("mine"), "r");
    size_t got = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
    if (f)
        fclose(f);
    ok(!s && strstr(e.msg, "mine exists: the store creates its file and never overwrites one") &&
       got == 4 && strcmp(buf, "keep") == 0, "existing file: refused and kept: %s", e.msg);
    ok(h.books[ML_TIER_FILE].total == 0 && h.books[ML_CPU].total == 0,
       "existing file: nothing stays charged");
    unlink(path_of("mine"));

    /* tmpfs */
    struct statfs fs;
    if (statfs("/dev/shm", &fs) == 0 && fs.f_type == TMPFS_MAGIC) {
        char p[128];
        snprintf(p, sizeof p, "/dev/shm/moelua-store-test-%d", (int)getpid());
        ml_store_opts o = {.path = p, .nslabs = 2, .slab_bytes = 64, .nslots = 1,
                           .prefetch_depth = 0, .category = ML_CAT_PARAMS, .slot_category = ML_CAT_CACHE};
        ml_status st = ml_store_open(&h, &o, &s, &e);
        ok(st == ML_EINVAL && strstr(e.msg, "is on tmpfs: its pages are memory, so the store would "
                                     "not bound anything; put it on a disk") &&
           strstr(e.msg, p) && !exists(p), "tmpfs: refused, the file removed: %s", e.msg);
    } else {
        printf("ok %d - # SKIP /dev/shm is not tmpfs here\n", ++ntests);
    }

    /* a budget on the file book: refused before any file exists */
    h.books[ML_TIER_FILE].budget_total = 1000;
    s = open_store(&h, "budget", 20, 100, 1, 0, &e);
    ok(!s && strstr(e.msg, "allocating 1.95 KiB (params) on file would exceed the total budget of "
                           "1000 B") && strstr(e.msg, "memory ledger (file)") &&
       !exists(path_of("budget")) && h.books[ML_TIER_FILE].nrefused == 1,
       "file budget: refused with the file ledger, no file: %.40s", e.msg);
    h.books[ML_TIER_FILE].budget_total = 0;
    /* a budget on the cache: the file book's charge is given back */
    h.books[ML_CPU].budget[ML_CAT_CACHE] = 100;
    s = open_store(&h, "cache", 2, 100, 2, 0, &e);
    ok(!s && strstr(e.msg, "(cache) on cpu would exceed the cache budget") &&
       !exists(path_of("cache")) && h.books[ML_TIER_FILE].total == 0,
       "cache budget: refused, no file, the file book back to zero");
    h.books[ML_CPU].budget[ML_CAT_CACHE] = 0;

    /* bad options */
    ml_store_opts o = {.path = path_of("bad"), .nslabs = 0, .slab_bytes = 64, .nslots = 1,
                       .prefetch_depth = 0, .category = ML_CAT_PARAMS, .slot_category = ML_CAT_CACHE};
    ok(ml_store_open(&h, &o, &s, &e) == ML_EINVAL && strcmp(e.msg, "slabs must be >= 1, got 0") == 0,
       "options: %s", e.msg);
    o = (ml_store_opts){.path = path_of("bad"), .nslabs = 2, .slab_bytes = 0, .nslots = 1,
                       .prefetch_depth = 0, .category = ML_CAT_PARAMS, .slot_category = ML_CAT_CACHE};
    ok(ml_store_open(&h, &o, &s, &e) == ML_EINVAL && strcmp(e.msg, "slab_bytes must be >= 1, got 0") == 0,
       "options: %s", e.msg);
    o = (ml_store_opts){.path = path_of("bad"), .nslabs = 2, .slab_bytes = 64, .nslots = 0,
                       .prefetch_depth = 0, .category = ML_CAT_PARAMS, .slot_category = ML_CAT_CACHE};
    ok(ml_store_open(&h, &o, &s, &e) == ML_EINVAL && strcmp(e.msg, "slots must be >= 1, got 0") == 0,
       "options: %s", e.msg);
    o = (ml_store_opts){.path = path_of("bad"), .nslabs = SIZE_MAX / 2, .slab_bytes = 64, .nslots = 1,
                       .prefetch_depth = 0, .category = ML_CAT_PARAMS, .slot_category = ML_CAT_CACHE};
    ok(ml_store_open(&h, &o, &s, &e) == ML_EINVAL && strstr(e.msg, "is too large"), "options: %s", e.msg);
    o = (ml_store_opts){.path = path_of("nodir/x"), .nslabs = 2, .slab_bytes = 64, .nslots = 1,
                       .prefetch_depth = 0, .category = ML_CAT_PARAMS, .slot_category = ML_CAT_CACHE};
    ok(ml_store_open(&h, &o, &s, &e) == ML_EINVAL && strstr(e.msg, "cannot create") &&
       strstr(e.msg, "No such file or directory (its directory must exist)"), "options: %s", e.msg);
    ok(h.books[ML_TIER_FILE].total == 0 && h.books[ML_CPU].total == 0 && !exists(path_of("bad")),
       "refusals: nothing charged, no file");
    ml_host_free(&h);
}

/* A full disk at creation, simulated by a file-size limit in a child: the
 * fallocate fails (EFBIG), the message names the path and the bytes, and
 * the partial file is gone. */
static void test_full_disk(void)
{
    int fds[2];
    if (pipe(fds) != 0) {
        ok(0, "pipe");
        return;
    }
    pid_t pid = fork();
    if (pid == 0) {
        close(fds[0]);
        signal(SIGXFSZ, SIG_IGN);   /* EFBIG instead of the signal's default: dying */
        struct rlimit rl = {64 << 10, 64 << 10};
        setrlimit(RLIMIT_FSIZE, &rl);
        ml_host h;
        ml_host_init(&h);
        ml_err e = {{0}};
        ml_store_opts o = {.path = path_of("full"), .nslabs = 16, .slab_bytes = 64 << 10, .nslots = 1,
                           .prefetch_depth = 0, .category = ML_CAT_PARAMS, .slot_category = ML_CAT_CACHE};
        ml_expert_store *s = NULL;
        ml_status st = ml_store_open(&h, &o, &s, &e);
        int good = st == ML_EIO && !s && !exists(path_of("full")) && h.books[ML_TIER_FILE].total == 0 &&
                   h.books[ML_CPU].total == 0;
        if (write(fds[1], e.msg, strlen(e.msg)) < 0)
            good = 0;
        _exit(good ? 0 : 1);
    }
    close(fds[1]);
    char msg[1024] = {0};
    size_t n = 0;
    ssize_t r;
    while (n < sizeof msg - 1 && (r = read(fds[0], msg + n, sizeof msg - 1 - n)) > 0)
        n += (size_t)r;
    close(fds[0]);
    int status = 0;
    waitpid(pid, &status, 0);
    ok(WIFEXITED(status) && WEXITSTATUS(status) == 0 && strstr(msg, path_of("full")) &&
       strstr(msg, "cannot allocate 1.00 MiB (1048576 bytes) for the store at"),
       "full disk: ML_EIO naming the path and the bytes, the partial file removed: %s", msg);
}

/* What test_plan runs on a real store and on a planned one: a schedule, a
 * miss (with a hint ahead), a dirty release, a write, a read, a flush. */
static int store_ops(ml_expert_store *s, ml_err *e)
{
    size_t slot;
    int hit;
    const int64_t seq[3] = {0, 1, 2};
    return s && ml_store_schedule(s, seq, 3, e) == ML_OK && ml_store_acquire(s, 0, &slot, &hit, e) == ML_OK &&
           ml_store_release(s, 0, 1, e) == ML_OK && ml_store_write(s, 1, 3, e) == ML_OK &&
           ml_store_read(s, 3, 1, e) == ML_OK && ml_store_flush(s, e) == ML_OK;
}

static void test_plan(void)
{
    ml_host h;
    ml_host_init(&h);
    ml_err e;
    ml_expert_store *twin = open_store(&h, "twin", 4, 100, 2, 1, &e);
    ok(store_ops(twin, &e), "plan: the ops on a real store");
    ml_store_stats want = twin->stats;
    ml_store_close(twin);
    ml_expert_store *real = open_store(&h, "real", 4, 64, 2, 0, &e);
    ml_plan_saved saved;
    ml_plan_begin(&h, &saved, &e);
    ml_expert_store *s = open_store(&h, "planned", 4, 100, 2, 1, &e);
    ok(s && !exists(path_of("planned")) && s->fd == -1, "plan: open creates no file");
    ok(h.plan_books[ML_TIER_FILE].cur[ML_CAT_PARAMS] == 4 * 64 + 400 &&
       h.plan_books[ML_CPU].cur[ML_CAT_CACHE] == 2 * 64 + 2 * 128 &&
       h.books[ML_TIER_FILE].total == 4 * 64 && h.books[ML_CPU].total == 2 * 64,
       "plan: the plan's books are charged (on top of the real store), the real ones are not");
    ok(store_ops(s, &e) && memcmp(&s->stats, &want, sizeof want) == 0 && want.misses == 1 &&
       want.bytes_read == 200 && want.bytes_written == 200 && want.prefetches == 1,
       "plan: the policy runs without a file and counts what the real store moved and hinted");
    size_t slot;
    int hit;
    ok(ml_store_acquire(real, 0, &slot, &hit, &e) == ML_EINVAL &&
       strstr(e.msg, "the store was opened outside moelua.mem.plan, which cannot move its slabs"),
       "plan: a real store refuses: %s", e.msg);
    ml_store_close(s);
    ok(h.plan_books[ML_TIER_FILE].total == 4 * 64 && h.plan_books[ML_CPU].total == 2 * 64 &&
       h.plan_live == 0, "plan: close gives the plan's books back");
    s = open_store(&h, "planned", 4, 100, 2, 1, &e);
    ml_plan_end(&h, &saved);
    ok(ml_store_acquire(s, 0, &slot, &hit, &e) == ML_EINVAL &&
       strstr(e.msg, "opened inside a memory plan that has ended"), "after the plan: %s", e.msg);
    ml_store_close(s);
    ml_store_close(real);
    ok(h.books[ML_TIER_FILE].total == 0 && h.books[ML_CPU].total == 0 && h.plan_live == 0,
       "plan: every book back to zero");
    ml_host_free(&h);
}

/* A slab's bytes split by category on the file book (an expert's
 * parameters, gradients and states); a split that does not add up. */
static void test_categories(void)
{
    ml_host h;
    ml_host_init(&h);
    ml_err e;
    ml_store_opts o = {.path = path_of("cats"), .nslabs = 3, .slab_bytes = 64, .nslots = 1,
                       .category = ML_CAT_PARAMS, .slot_category = ML_CAT_OPTIM};
    o.cat_bytes[ML_CAT_PARAMS] = 16;
    o.cat_bytes[ML_CAT_GRADS] = 16;
    o.cat_bytes[ML_CAT_OPTIM] = 32;
    ml_expert_store *s = NULL;
    ok(ml_store_open(&h, &o, &s, &e) == ML_OK, "categories: open");
    const ml_ledger *f = &h.books[ML_TIER_FILE];
    ok(f->cur[ML_CAT_PARAMS] == 48 && f->cur[ML_CAT_GRADS] == 48 && f->cur[ML_CAT_OPTIM] == 96 &&
       f->total == 192, "categories: 3 slabs' 16 + 16 + 32 bytes on the file book by category");
    ok(h.books[ML_CPU].cur[ML_CAT_OPTIM] == 64 && h.books[ML_CPU].cur[ML_CAT_CACHE] == 0,
       "categories: the slot under the slot category given (optim)");
    ml_store_close(s);
    ok(f->total == 0 && f->cur[ML_CAT_OPTIM] == 0, "categories: credited back by category");
    o.cat_bytes[ML_CAT_OPTIM] = 16;
    ok(ml_store_open(&h, &o, &s, &e) == ML_EINVAL &&
       strcmp(e.msg, "a slab's bytes per category add up to 48, not slab_bytes (64)") == 0 &&
       !exists(path_of("cats")), "categories: a split that does not add up: %s", e.msg);
    ml_host_free(&h);
}

int main(void)
{
    if (make_dir() != 0) {
        ok(0, "a temporary directory on a disk");
        return tap_done();
    }
    test_books_and_io();
    test_policy();
    test_dirty();
    test_refusals();
    test_full_disk();
    test_plan();
    test_categories();
    ok(rmdir(dir) == 0, "every file the stores made is gone (%s is empty)", dir);
    return tap_done();
}
