/*
 * host/runtime/backend_plan.c - the memory tables of a dry run: what
 * moelua.mem.plan swaps in on every device (DESIGN.md, The memory ledger:
 * "sizes and lifetimes only, kernels skipped"). Kernels are skipped at the
 * one dispatch point (ML_KCALL, host/runtime/backend.h), not here.
 *
 * Memory is address space only: an anonymous MAP_NORESERVE mapping that no
 * kernel touches, so a plan of a 100 GiB step costs page tables, not RAM.
 * Copies do nothing: an op that would read a result back (a count, a
 * validation) asks h->planning and takes its worst case instead. The CUDA
 * table checks budgets against what the caching allocator would reserve
 * and books the rounded bytes of live blocks as `reserved`, so a CUDA run
 * plans on a machine without a GPU. Allocated bytes per category are what
 * the device books; reserved is a lower bound there (the real cache keeps
 * freed blocks for reuse, which this table does not model).
 */
#include "backend.h"

#include <stdint.h>
#include <sys/mman.h>

static int plan_available(void) { return 1; }

static void *plan_alloc(size_t nbytes, ml_ledger *lg)
{
    (void)lg;
    void *p = mmap(NULL, nbytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

static void plan_free(void *p, size_t nbytes, ml_ledger *lg)
{
    (void)lg;
    munmap(p, nbytes);
}

/* Pinned host memory of a plan of CUDA: address space, like the rest. */
static void *plan_host_alloc(size_t nbytes) { return plan_alloc(nbytes, NULL); }
static void plan_host_free(void *p, size_t nbytes) { plan_free(p, nbytes, NULL); }

static void *plan_cuda_alloc(size_t nbytes, ml_ledger *lg)
{
    void *p = plan_alloc(nbytes, lg);
    if (p)
        ml_ledger_set_reserved(lg, lg->reserved + ml_cuda_round_size(nbytes));
    return p;
}

static void plan_cuda_free(void *p, size_t nbytes, ml_ledger *lg)
{
    plan_free(p, nbytes, lg);
    ml_ledger_set_reserved(lg, lg->reserved - ml_cuda_round_size(nbytes));
}

static ml_status plan_memcpy(void *dst, const void *src, size_t n, ml_copy_dir dir, void *stream)
{
    (void)dst; (void)src; (void)n; (void)dir; (void)stream;
    return ML_OK;
}

size_t ml_cuda_round_size(size_t n)
{
    const size_t small_max = (size_t)1 << 20, small_step = 512, large_step = (size_t)2 << 20;
    if (n == 0)
        n = 1;
    if (n <= small_max)
        return (n + small_step - 1) / small_step * small_step;
    if (n > SIZE_MAX - large_step)
        return SIZE_MAX;   /* no device has it: the ledger refuses */
    return (n + large_step - 1) / large_step * large_step;
}

/* The two tables differ in how they charge what they hand out, and in
 * pinned host memory (the CPU has none). */
#define PLAN_MEMORY(alloc_, free_, reserve_bytes_, host_alloc_, host_free_) {          \
    .name = "plan", .available = plan_available, .alloc = alloc_, .free = free_,      \
    .reserve_bytes = reserve_bytes_, .host_alloc = host_alloc_, .host_free = host_free_, \
    .memcpy = plan_memcpy,                                                            \
    .stream_new = ml_no_handle_new, .stream_free = ml_no_handle_free,                 \
    .event_new = ml_no_handle_new, .event_free = ml_no_handle_free,                   \
    .event_record = ml_no_event_record, .stream_wait = ml_no_stream_wait,             \
    .synchronize = ml_no_synchronize,                                                 \
}

static const ml_memory plan_cpu = PLAN_MEMORY(plan_alloc, plan_free, NULL, NULL, NULL);
static const ml_memory plan_cuda = PLAN_MEMORY(plan_cuda_alloc, plan_cuda_free, ml_cuda_round_size,
                                               plan_host_alloc, plan_host_free);

const ml_memory *const ml_memory_plan[ML_NDEVICES] = {&plan_cpu, &plan_cuda};

/* What a CUDA device runs, known on every build: the CUDA kernel table's
 * `supports` (host/runtime/backend_cuda.c) and, in a plan of CUDA on a
 * build without it, the questions ops ask of a table whose kernels a plan
 * skips anyway. */
int ml_cuda_supports(ml_op op, ml_dtype dt)
{
    int flt = dt == ML_F32 || dt == ML_F64;
    int num = flt || dt == ML_I32 || dt == ML_I64;
    switch (op) {
    case ML_OP_FILL: case ML_OP_ARANGE: case ML_OP_COPY: case ML_OP_INDEX:
        return 1;           /* scatter_add: f32, f64, i32, i64 (the kernel says) */
    case ML_OP_BINARY:
        return num || dt == ML_BF16;   /* bf16: binary and binary_scalar */
    case ML_OP_CUMSUM:
        return num;
    case ML_OP_UNARY:
        return num || dt == ML_BF16;   /* integers: neg and abs only (the kernel says) */
    case ML_OP_MATMUL:
        return flt || dt == ML_BF16;   /* bf16 A, B with a bf16 or f32 C */
    case ML_OP_ROUTER:
        return flt || dt == ML_BF16;   /* bf16 x, wg: an fp32 router; f32 dwg */
    case ML_OP_EXPERTS:
        return flt || dt == ML_BF16;   /* bf16: mixed precision, f32 weight gradients */
    case ML_OP_REDUCE: case ML_OP_SOFTMAX: case ML_OP_TOPK:
        return flt;
    case ML_OP_DISPATCH:
        return dt == ML_I64 || flt || dt == ML_BF16;   /* the sort's idx; unpack's rows (pack: any) */
    case ML_OP_OPTIM:
        return flt;
    case ML_OP_RANDOM:
        return flt || dt == ML_BF16 || dt == ML_F16;
    case ML_OP_ATTENTION: case ML_OP_RMSNORM: case ML_OP_ROPE: case ML_OP_EMBEDDING:
        return flt || dt == ML_BF16;
    case ML_OP_CROSSENTROPY:
        return flt || dt == ML_BF16;   /* bf16 h, W, dh; f32 dW */
    default:
        return 0;
    }
}

const ml_kernels ml_kernels_cuda_plan = {ML_CUDA_SIZING};
