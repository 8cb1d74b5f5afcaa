/*
 * host/runtime/backend_cpu.c - the CPU's two tables: 64-byte aligned host
 * memory (no streams: every copy is done when it returns) and the
 * kernels/<family>.c implementations.
 *
 * Buffers of HUGE_MIN (2 MiB) and more are mappings of their own, 2 MiB
 * aligned and rounded, with transparent huge pages asked for (madvise;
 * where the system refuses them they are ordinary pages). A step's large
 * transients (the experts' saved pre-activations: 738 MiB at T 32768) are
 * fresh mappings every step either way (glibc maps anything above 32 MiB
 * itself), so their first touch faults page by page; 2 MiB pages fault
 * 512 times less: the MoE layer benchmark at T 32768 runs about 5% faster.
 * From 2 MiB rather than 8: buffers of 2-8 MiB from malloc stayed in
 * glibc's heap once freed, and a trainer's step (the collector held until
 * the next step: moelua.train) left its heap fragmented: recipes/bench/
 * train.lua at seq_len 4096, peak RSS 533-562 MiB for a ledger peak of
 * 383; 417 with them mapped, but 4.5% slower, and 427 at the same speed
 * with the reuse below (BENCHMARKS.md, "Issue 15, sixth pass"): a freed mapping of
 * up to REUSE_MAX is kept for the next request of its length (a step asks
 * for the same buffers every step; a fresh mapping is zeroed by the
 * kernel, 4 MiB for each [4096, 256] f32 activation), at most REUSE_MAX
 * bytes in all, handed back by mem.empty_cache(). The ledger charges what
 * was asked; RSS may exceed it by < 2 MiB per buffer, and by the kept
 * mappings.
 * Under AddressSanitizer every buffer comes from malloc, where it checks
 * overflows.
 */
#include "backend.h"

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

static int cpu_available(void) { return 1; }

#define HUGE_PAGE ((size_t)2 << 20)
#ifdef __SANITIZE_ADDRESS__
#define HUGE_MIN SIZE_MAX
#else
#define HUGE_MIN HUGE_PAGE
#endif

static size_t huge_len(size_t nbytes) { return (nbytes + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1); }

/* len bytes (a multiple of HUGE_PAGE) at a HUGE_PAGE boundary: a mapping
 * one huge page longer, its ends cut off */
static void *map_huge(size_t len)
{
    char *m = mmap(NULL, len + HUGE_PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED)
        return NULL;
    char *a = (char *)(((uintptr_t)m + HUGE_PAGE - 1) & ~(uintptr_t)(HUGE_PAGE - 1));
    if (a > m)
        munmap(m, (size_t)(a - m));
    munmap(a + len, (size_t)(m + HUGE_PAGE - a));
    (void)madvise(a, len, MADV_HUGEPAGE);   /* a hint: refused, the pages are small */
    return a;
}

/* Freed mappings kept for reuse (the header): a few, REUSE_MAX bytes in
 * all, the oldest unmapped to make room (a step's lengths replace the
 * warm-up's). Any thread may free. */
#define REUSE_SLOTS 16
#define REUSE_MAX ((size_t)32 << 20)
static struct { void *p; size_t len; } kept[REUSE_SLOTS];
static int nkept;
static size_t kept_bytes;
static pthread_mutex_t kept_lock = PTHREAD_MUTEX_INITIALIZER;

/* Entry i out of the list, its mapping the caller's (kept_lock held). */
static void *unkeep(int i)
{
    void *p = kept[i].p;
    kept_bytes -= kept[i].len;
    memmove(&kept[i], &kept[i + 1], (size_t)(--nkept - i) * sizeof kept[0]);
    return p;
}

static void *take_kept(size_t len)
{
    void *p = NULL;
    pthread_mutex_lock(&kept_lock);
    for (int i = nkept - 1; i >= 0 && !p; i--)   /* the most recently freed first */
        if (kept[i].len == len)
            p = unkeep(i);
    pthread_mutex_unlock(&kept_lock);
    return p;
}

static int keep(void *p, size_t len)
{
    if (len > REUSE_MAX)
        return 0;
    pthread_mutex_lock(&kept_lock);
    while (nkept == REUSE_SLOTS || kept_bytes + len > REUSE_MAX) {
        size_t old = kept[0].len;
        munmap(unkeep(0), old);
    }
    kept[nkept].p = p;
    kept[nkept++].len = len;
    kept_bytes += len;
    pthread_mutex_unlock(&kept_lock);
    return 1;
}

void ml_cpu_empty_cache(void)
{
    pthread_mutex_lock(&kept_lock);
    for (int i = 0; i < nkept; i++)
        munmap(kept[i].p, kept[i].len);
    nkept = 0;
    kept_bytes = 0;
    pthread_mutex_unlock(&kept_lock);
}

static void *cpu_alloc(size_t nbytes, ml_ledger *lg)
{
    (void)lg;
    if (nbytes >= HUGE_MIN) {
        void *p = take_kept(huge_len(nbytes));
        return p ? p : map_huge(huge_len(nbytes));
    }
    void *p = NULL;
    size_t rounded = (nbytes + 63) & ~(size_t)63;
    return posix_memalign(&p, 64, rounded) == 0 ? p : NULL;
}

static void cpu_free(void *p, size_t nbytes, ml_ledger *lg)
{
    (void)lg;
    if (p && nbytes >= HUGE_MIN) {
        if (!keep(p, huge_len(nbytes)))
            munmap(p, huge_len(nbytes));
    } else {
        free(p);
    }
}

static ml_status cpu_memcpy(void *dst, const void *src, size_t n, ml_copy_dir dir, void *stream)
{
    (void)dir; (void)stream;
    if (n)
        memcpy(dst, src, n);
    return ML_OK;
}

ml_status ml_no_handle_new(void **handle) { *handle = NULL; return ML_OK; }
void ml_no_handle_free(void *handle) { (void)handle; }
ml_status ml_no_event_record(void *event, void *stream) { (void)event; (void)stream; return ML_OK; }
ml_status ml_no_stream_wait(void *stream, void *event) { (void)stream; (void)event; return ML_OK; }
ml_status ml_no_synchronize(void *stream) { (void)stream; return ML_OK; }

static const ml_memory cpu_memory = {
    .name = "cpu",
    .available = cpu_available,
    .alloc = cpu_alloc,
    .free = cpu_free,
    .memcpy = cpu_memcpy,
    .stream_new = ml_no_handle_new,
    .stream_free = ml_no_handle_free,
    .event_new = ml_no_handle_new,
    .event_free = ml_no_handle_free,
    .event_record = ml_no_event_record,
    .stream_wait = ml_no_stream_wait,
    .synchronize = ml_no_synchronize,
};

static int cpu_supports(ml_op op, ml_dtype dt)
{
    switch (op) {
    case ML_OP_RMSNORM: case ML_OP_ROPE: case ML_OP_EMBEDDING: case ML_OP_CROSSENTROPY:
    case ML_OP_ATTENTION: case ML_OP_MATMUL: case ML_OP_ROUTER: case ML_OP_EXPERTS:
        return dt == ML_F32 || dt == ML_F64;   /* the ops ask, to name what the CPU takes */
    case ML_OP_DISPATCH:
        return dt == ML_I64 || dt == ML_F32 || dt == ML_F64;   /* the sort's idx; unpack's rows */
    case ML_OP_BINARY: case ML_OP_UNARY:
        return dt == ML_F32 || dt == ML_F64 || dt == ML_I32 || dt == ML_I64;
    default:
        return 1;  /* every op exists on the CPU; kernels refuse dtypes they lack */
    }
}

static const ml_kernels cpu_kernels = {
    .supports = cpu_supports,
    .router_scratch_bytes = ml_router_scratch_bytes,
    .experts_scratch_bytes = ml_experts_scratch_bytes,
    .attention_scratch_bytes = ml_attention_scratch_bytes,
    .fill = ml_fill_cpu,
    .arange = ml_arange_cpu,
    .binary = ml_binary_cpu,
    .binary_scalar = ml_binary_scalar_cpu,
    .unary = ml_unary_cpu,
    .copy = ml_copy_cpu,
    .reduce = ml_reduce_cpu,
    .reduce_all = ml_reduce_all_cpu,
    .cumsum = ml_cumsum_cpu,
    .softmax = ml_softmax_cpu,
    .topk = ml_topk_cpu,
    .index_select = ml_index_select_cpu,
    .gather = ml_gather_cpu,
    .scatter_add = ml_scatter_add_cpu,
    .bincount = ml_bincount_cpu,
    .matmul = ml_matmul_cpu,
    .rand = ml_rand_cpu,
    .randn = ml_randn_cpu,
    .router_forward = ml_router_forward_cpu,
    .router_backward = ml_router_backward_cpu,
    .router_update_bias = ml_router_update_bias_cpu,
    .dispatch = ml_dispatch_cpu,
    .dispatch_pack = ml_dispatch_pack_cpu,
    .dispatch_unpack = ml_dispatch_unpack_cpu,
    .dispatch_find_bad = ml_dispatch_find_bad_cpu,
    .dispatch_check_plan = ml_dispatch_check_plan_cpu,
    .experts_forward = ml_experts_forward_cpu,
    .experts_backward = ml_experts_backward_cpu,
    .rmsnorm_forward = ml_rmsnorm_forward_cpu,
    .rmsnorm_backward = ml_rmsnorm_backward_cpu,
    .rope_forward = ml_rope_forward_cpu,
    .rope_backward = ml_rope_backward_cpu,
    .embedding_forward = ml_embedding_forward_cpu,
    .embedding_backward = ml_embedding_backward_cpu,
    .ce_forward = ml_ce_forward_cpu,
    .ce_backward = ml_ce_backward_cpu,
    .attention_forward = ml_attention_forward_cpu,
    .attention_backward = ml_attention_backward_cpu,
    .adamw = ml_adamw_cpu,
    .lazy_adamw = ml_lazy_adamw_cpu,
    .sgd = ml_sgd_cpu,
    .sumsq = ml_sumsq_cpu,
    .slice_norms = ml_slice_norms_cpu,
    .scale_slices = ml_scale_slices_cpu,
};

const ml_backend ml_backend_cpu = {"cpu", &cpu_memory, &cpu_kernels};
