/*
 * host/runtime/backend_cpu.c - the CPU backend table: 64-byte aligned host memory
 * and the kernels/<family>.c implementations.
 */
#include "backend.h"

#include <stdlib.h>
#include <string.h>

static int cpu_available(void) { return 1; }

static int cpu_supports(ml_op op, ml_dtype dt)
{
    (void)op; (void)dt;
    return 1;  /* every op exists on the CPU; kernels refuse dtypes they lack */
}

static void *cpu_alloc(size_t nbytes, ml_ledger *lg)
{
    (void)lg;
    void *p = NULL;
    size_t rounded = (nbytes + 63) & ~(size_t)63;
    return posix_memalign(&p, 64, rounded) == 0 ? p : NULL;
}

static void cpu_free(void *p, size_t nbytes, ml_ledger *lg)
{
    (void)nbytes; (void)lg;
    free(p);
}

static ml_status cpu_memcpy(void *dst, int dst_host, const void *src, int src_host, size_t n)
{
    (void)dst_host; (void)src_host;
    if (n)
        memcpy(dst, src, n);
    return ML_OK;
}

static ml_status cpu_synchronize(void) { return ML_OK; }

const ml_backend ml_backend_cpu = {
    .name = "cpu",
    .available = cpu_available,
    .supports = cpu_supports,
    .alloc = cpu_alloc,
    .free = cpu_free,
    .memcpy = cpu_memcpy,
    .synchronize = cpu_synchronize,
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
    .dispatch_find_bad = ml_dispatch_find_bad_cpu,
    .dispatch_check_plan = ml_dispatch_check_plan_cpu,
    .experts_forward = ml_experts_forward_cpu,
    .experts_backward = ml_experts_backward_cpu,
};
