/*
 * host/runtime/backend.h - the device abstraction (as in ggml): one table of
 * function pointers per device. The CPU table is always built; the CUDA
 * table exists in `make CUDA=1` builds (host/runtime/backend_cuda.c) and reports
 * itself absent when no GPU is present.
 *
 * Kernel entries have the signatures of kernels/<family>.h. `supports` says
 * whether an op/dtype pair runs on this device, so a binding can name what
 * is missing instead of failing inside a kernel.
 */
#ifndef ML_BACKEND_H
#define ML_BACKEND_H

#include "ledger.h"
#include "../../kernels/copy.h"
#include "../../kernels/dispatch.h"
#include "../../kernels/elementwise.h"
#include "../../kernels/experts.h"
#include "../../kernels/index.h"
#include "../../kernels/matmul.h"
#include "../../kernels/philox.h"
#include "../../kernels/reduce.h"
#include "../../kernels/router.h"
#include "../../kernels/softmax.h"
#include "../../kernels/topk.h"

typedef enum {
    ML_OP_FILL, ML_OP_ARANGE, ML_OP_BINARY, ML_OP_UNARY, ML_OP_COPY, ML_OP_REDUCE,
    ML_OP_CUMSUM, ML_OP_SOFTMAX, ML_OP_TOPK, ML_OP_INDEX, ML_OP_MATMUL, ML_OP_RANDOM,
    ML_OP_ROUTER, ML_OP_DISPATCH, ML_OP_EXPERTS,
    ML_NOPS
} ml_op;

typedef struct ml_backend {
    const char *name;
    /* Is a device of this kind present? (CUDA: cudaGetDeviceCount > 0) */
    int (*available)(void);
    int (*supports)(ml_op op, ml_dtype dt);
    /* Raw device memory; the ledger is charged by the caller. The CUDA
     * backend caches freed blocks and reports its reserved bytes. */
    void *(*alloc)(size_t nbytes, ml_ledger *lg);
    /* Bytes the device reserves for a block of nbytes (a caching allocator
     * rounds up); NULL: nbytes. Budgets are checked against this. */
    size_t (*reserve_bytes)(size_t nbytes);
    void (*free)(void *p, size_t nbytes, ml_ledger *lg);
    /* Byte copy where one side may be on the host (dst_host / src_host). */
    ml_status (*memcpy)(void *dst, int dst_host, const void *src, int src_host, size_t n);
    ml_status (*synchronize)(void);

    ml_status (*fill)(ml_dtype, void *, double, int64_t, const ml_kctx *);
    ml_status (*arange)(ml_dtype, void *, double, double, int64_t, const ml_kctx *);
    ml_status (*binary)(ml_binop, ml_dtype, void *, const void *, const void *,
                        int64_t, int64_t, int64_t, const ml_kctx *);
    ml_status (*binary_scalar)(ml_binop, ml_dtype, void *, const void *, double, int,
                               int64_t, const ml_kctx *);
    ml_status (*unary)(ml_unop, ml_dtype, void *, const void *, int64_t, const ml_kctx *);
    ml_status (*copy)(ml_dtype, void *, const int64_t *, ml_dtype, const void *, const int64_t *,
                      int, const int64_t *, const ml_kctx *);
    ml_status (*reduce)(ml_redop, ml_dtype, void *, int64_t *, const void *,
                        int64_t, int64_t, int64_t, const ml_kctx *);
    ml_status (*reduce_all)(ml_redop, ml_dtype, void *, int64_t *, const void *, int64_t,
                            const ml_kctx *);
    ml_status (*cumsum)(ml_dtype, void *, const void *, int64_t, int64_t, int64_t, const ml_kctx *);
    ml_status (*softmax)(int, ml_dtype, void *, const void *, int64_t, int64_t, const ml_kctx *);
    ml_status (*topk)(ml_dtype, void *, int64_t *, const void *, int64_t, int64_t, int64_t,
                      const ml_kctx *);
    ml_status (*index_select)(ml_dtype, void *, const void *, const int64_t *,
                              int64_t, int64_t, int64_t, int64_t, const ml_kctx *);
    ml_status (*gather)(ml_dtype, void *, const void *, const int64_t *,
                        int64_t, int64_t, int64_t, int64_t, const ml_kctx *);
    ml_status (*scatter_add)(ml_dtype, void *, const void *, const int64_t *,
                             int64_t, int64_t, int64_t, int64_t, const ml_kctx *);
    ml_status (*bincount)(int64_t *, const int64_t *, int64_t, int64_t, const ml_kctx *);
    ml_status (*matmul)(ml_dtype, void *, const void *, const void *, const ml_gemm_shape *,
                        const ml_kctx *);
    ml_status (*rand)(ml_dtype, void *, int64_t, uint64_t, uint64_t, double, double, const ml_kctx *);
    ml_status (*randn)(ml_dtype, void *, int64_t, uint64_t, uint64_t, double, double, const ml_kctx *);

    /* The MoE layer (kernels/router.h, dispatch.h, experts.h). Host scalars
     * (zsum, entropy, ndropped) stay host pointers on every backend; the
     * validators return a position, -1, or ML_DISPATCH_EDEVICE. */
    ml_status (*router_forward)(ml_dtype, int64_t *, void *, int64_t *, double *, double *, double *,
                                const void *, const void *, ml_dtype, const void *,
                                int64_t, int64_t, int64_t, const ml_router_cfg *, void *,
                                const ml_kctx *);
    ml_status (*router_backward)(ml_dtype, void *, void *, const int64_t *, const void *,
                                 const double *, double, const void *, const void *,
                                 int64_t, int64_t, int64_t, const ml_router_cfg *, void *,
                                 const ml_kctx *);
    ml_status (*router_update_bias)(ml_dtype, void *, const int64_t *, int64_t, double,
                                    const ml_kctx *);
    ml_status (*dispatch)(int64_t *, int64_t *, int64_t *, uint8_t *, int64_t *, const int64_t *,
                          int64_t, int64_t, int64_t, const ml_kctx *);
    int64_t (*dispatch_find_bad)(const int64_t *, int64_t, int64_t);
    int64_t (*dispatch_check_plan)(const int64_t *, const int64_t *, const int64_t *, int64_t, int64_t);
    ml_status (*experts_forward)(ml_dtype, void *, void *, void *, const void *, const void *,
                                 const int64_t *, const int64_t *, const void *, const void *,
                                 const ml_experts_cfg *, const ml_kctx *);
    ml_status (*experts_backward)(ml_dtype, void *, void *, void *, void *, uint8_t *, void *,
                                  const void *, const void *, const void *, const void *,
                                  const int64_t *, const int64_t *, const void *, const void *,
                                  const ml_experts_cfg *, const ml_kctx *);
} ml_backend;

extern const ml_backend ml_backend_cpu;
extern const ml_backend ml_backend_plan;   /* host/runtime/backend_plan.c: moelua.mem.plan's dry run */
#ifdef ML_WITH_CUDA
extern const ml_backend ml_backend_cuda;
#endif

#endif
