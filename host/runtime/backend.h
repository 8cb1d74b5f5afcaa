/*
 * host/runtime/backend.h - the device abstraction (as in ggml): a device is
 * two tables of function pointers, memory and kernels. The CPU's are always
 * built; CUDA's exist in `make CUDA=1` builds (host/runtime/backend_cuda.c),
 * whose memory table reports itself absent when no GPU is present.
 *
 * Not here: argument checks and the choice of device (the op layer,
 * host/runtime/op.h), kernels (kernels/).
 */
#ifndef ML_BACKEND_H
#define ML_BACKEND_H

#include "tensor.h"
#include "../../kernels/attention.h"
#include "../../kernels/copy.h"
#include "../../kernels/crossentropy.h"
#include "../../kernels/dispatch.h"
#include "../../kernels/elementwise.h"
#include "../../kernels/embedding.h"
#include "../../kernels/experts.h"
#include "../../kernels/index.h"
#include "../../kernels/matmul.h"
#include "../../kernels/optim.h"
#include "../../kernels/philox.h"
#include "../../kernels/reduce.h"
#include "../../kernels/rmsnorm.h"
#include "../../kernels/rope.h"
#include "../../kernels/router.h"
#include "../../kernels/softmax.h"
#include "../../kernels/topk.h"

typedef enum {
    ML_OP_FILL, ML_OP_ARANGE, ML_OP_BINARY, ML_OP_UNARY, ML_OP_COPY, ML_OP_REDUCE,
    ML_OP_CUMSUM, ML_OP_SOFTMAX, ML_OP_TOPK, ML_OP_INDEX, ML_OP_MATMUL, ML_OP_RANDOM,
    ML_OP_ROUTER, ML_OP_DISPATCH, ML_OP_EXPERTS, ML_OP_RMSNORM, ML_OP_ROPE, ML_OP_EMBEDDING,
    ML_OP_CROSSENTROPY, ML_OP_ATTENTION, ML_OP_OPTIM,
    ML_NOPS
} ml_op;

/* Direction of a copy: host (CPU memory, pageable or pinned) or device. */
typedef enum { ML_COPY_H2H, ML_COPY_H2D, ML_COPY_D2H, ML_COPY_D2D } ml_copy_dir;

/* A device's memory table. A memory plan (moelua.mem.plan) swaps it for a
 * plan table on every device (host/runtime/backend_plan.c) and leaves the
 * kernel table alone: kernels are skipped at the one dispatch point,
 * ML_KCALL below. Streams and events are opaque handles (cudaStream_t,
 * cudaEvent_t on CUDA); the CPU's are NULL and every call on them is a no-op. */
typedef struct ml_memory {
    const char *name;
    /* How many devices of this kind are present and usable (0: none; the
     * CPU: 1; CUDA: cudaGetDeviceCount when the build runs on them)? */
    int (*available)(void);
    /* Raw device memory; the ledger is charged by the caller (tensor.c,
     * pool.c). The CUDA table caches freed blocks and reports its reserved
     * bytes to lg. */
    void *(*alloc)(size_t nbytes, ml_ledger *lg);
    void (*free)(void *p, size_t nbytes, ml_ledger *lg);
    /* Bytes the device's reservation grows by for a request of nbytes
     * (caching: the rounded size, 0 when a cached block serves it; NULL:
     * nbytes): the total budget of a caching ledger is checked against
     * reserved + this (ml_ledger_check). */
    size_t (*reserve_bytes)(size_t nbytes);
    /* Page-locked host memory that the device copies to and from
     * asynchronously (CUDA: cudaHostAlloc; a plan's: address space only;
     * NULL on a device without it, the CPU). The caller charges the
     * `pinned` tier's book (op.h: ml_tier_charge). */
    void *(*host_alloc)(size_t nbytes);
    void (*host_free)(void *p, size_t nbytes);
    /* Byte copy in direction dir, ordered on stream (NULL: the default
     * stream; the call returns when the bytes are there). */
    ml_status (*memcpy)(void *dst, const void *src, size_t n, ml_copy_dir dir, void *stream);
    ml_status (*stream_new)(void **stream);
    void (*stream_free)(void *stream);
    ml_status (*event_new)(void **event);
    void (*event_free)(void *event);
    ml_status (*event_record)(void *event, void *stream);
    /* Work queued on stream after this waits for event. */
    ml_status (*stream_wait)(void *stream, void *event);
    /* Wait for stream (NULL: every stream of the device). */
    ml_status (*synchronize)(void *stream);
} ml_memory;

/* A device's kernel table: every family of kernels/, with the signatures
 * of kernels/<family>.h, the same on every device. An entry a device lacks
 * is NULL (ML_KCALL says ML_EUNSUPPORTED). `supports` says whether an
 * op/dtype pair runs, so an op can name what is missing instead of failing
 * inside a kernel. */
typedef struct ml_kernels {
    int (*supports)(ml_op op, ml_dtype dt);

    /* Bytes of the scratch (8-aligned, on the device) a family's kernels
     * take from their caller, who allocates it in the ledger
     * (ML_KSCRATCH); NULL: none. dispatch: (n, E, check) as
     * ml_dispatch_scratch_bytes_cuda; dispatch_unpack: (rows_out, div);
     * router: as ml_router_scratch_bytes;
     * topk: (rows, cols, k); reduce_all: (n); sumsq: (n); slice_norms:
     * (n, E); experts: (dt, cfg, backward, the host's thread count), SIZE_MAX
     * on overflow; attention: (hd, Sq, the host's thread count). */
    size_t (*dispatch_scratch_bytes)(int64_t n, int64_t E, int check);
    size_t (*dispatch_unpack_scratch_bytes)(int64_t rows_out, int64_t div);
    size_t (*router_scratch_bytes)(int64_t T, int64_t D, int64_t E, int64_t chunk, int backward);
    size_t (*topk_scratch_bytes)(int64_t rows, int64_t cols, int64_t k);
    size_t (*reduce_all_scratch_bytes)(int64_t n);
    size_t (*sumsq_scratch_bytes)(int64_t n);
    size_t (*slice_norms_scratch_bytes)(int64_t n, int64_t E);
    size_t (*experts_scratch_bytes)(ml_dtype dt, const ml_experts_cfg *c, int backward,
                                    int nthreads);
    size_t (*attention_scratch_bytes)(int64_t hd, int64_t Sq, int nthreads);

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
    ml_status (*reduce_all)(ml_redop, ml_dtype, void *, int64_t *, const void *, int64_t, void *,
                            const ml_kctx *);
    ml_status (*cumsum)(ml_dtype, void *, const void *, int64_t, int64_t, int64_t, const ml_kctx *);
    ml_status (*softmax)(int, ml_dtype, void *, const void *, int64_t, int64_t, const ml_kctx *);
    ml_status (*topk)(ml_dtype, void *, int64_t *, const void *, int64_t, int64_t, int64_t,
                      void *, const ml_kctx *);
    ml_status (*index_select)(ml_dtype, void *, const void *, const int64_t *,
                              int64_t, int64_t, int64_t, int64_t, const ml_kctx *);
    ml_status (*gather)(ml_dtype, void *, const void *, const int64_t *,
                        int64_t, int64_t, int64_t, int64_t, const ml_kctx *);
    ml_status (*scatter_add)(ml_dtype, void *, const void *, const int64_t *,
                             int64_t, int64_t, int64_t, int64_t, const ml_kctx *);
    ml_status (*bincount)(int64_t *, const int64_t *, int64_t, int64_t, const ml_kctx *);
    ml_status (*matmul)(ml_dtype, ml_dtype, void *, const void *, const void *,
                        const ml_gemm_shape *, const ml_kctx *);
    ml_status (*rand)(ml_dtype, void *, int64_t, uint64_t, uint64_t, double, double, const ml_kctx *);
    ml_status (*randn)(ml_dtype, void *, int64_t, uint64_t, uint64_t, double, double, const ml_kctx *);

    /* The MoE layer (kernels/router.h, dispatch.h, experts.h). Host scalars
     * (zsum, entropy, ndropped) stay host pointers on every backend; the
     * validators return a position, -1, or ML_DISPATCH_EDEVICE, and run on
     * the context's stream like every kernel. */
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
                          int64_t, int64_t, int64_t, const int64_t *, void *, const ml_kctx *);
    ml_status (*dispatch_pack)(ml_dtype, void *, const void *, const int64_t *, int64_t, int64_t,
                               int64_t, const ml_kctx *);
    ml_status (*dispatch_unpack)(ml_dtype, void *, const void *, const int64_t *, int64_t, int64_t,
                                 int64_t, int64_t, void *, const ml_kctx *);
    int64_t (*dispatch_find_bad)(const int64_t *, int64_t, int64_t, void *, const ml_kctx *);
    int64_t (*dispatch_check_plan)(const int64_t *, const int64_t *, const int64_t *, int64_t, int64_t,
                                   void *, const ml_kctx *);
    ml_status (*experts_forward)(ml_dtype, void *, void *, void *, const void *, const void *,
                                 const int64_t *, const int64_t *, const ml_experts_weights *,
                                 const ml_experts_cfg *, const ml_kctx *);
    ml_status (*experts_backward)(ml_dtype, void *, const ml_experts_wgrads *, void *, uint8_t *,
                                  void *, const void *, const void *, const void *, const void *,
                                  const int64_t *, const int64_t *, const ml_experts_weights *,
                                  const ml_experts_cfg *, const ml_kctx *);

    /* The dense layers (kernels/rmsnorm.h, rope.h, embedding.h,
     * crossentropy.h, attention.h). Host scalars (the CE loss) stay host
     * pointers on every backend. */
    ml_status (*rmsnorm_forward)(ml_dtype, void *, double *, const void *, const void *,
                                 int64_t, int64_t, double, const ml_kctx *);
    ml_status (*rmsnorm_backward)(ml_dtype, void *, void *, const void *, const void *,
                                  const void *, const double *, int64_t, int64_t, const ml_kctx *);
    ml_status (*rope_forward)(ml_dtype, void *, const void *, int64_t, int64_t, int64_t, int64_t,
                              double, const ml_kctx *);
    ml_status (*rope_backward)(ml_dtype, void *, const void *, int64_t, int64_t, int64_t, int64_t,
                               double, const ml_kctx *);
    ml_status (*embedding_forward)(ml_dtype, void *, const int64_t *, const void *, int64_t,
                                   int64_t, int64_t, const ml_kctx *);
    ml_status (*embedding_backward)(ml_dtype, void *, const void *, const int64_t *, int64_t,
                                    int64_t, int64_t, const ml_kctx *);
    ml_status (*ce_forward)(ml_dtype, double *, double *, const void *, const void *,
                            const int64_t *, int64_t, int64_t, int64_t, int64_t, int64_t, void *,
                            const ml_kctx *);
    ml_status (*ce_backward)(ml_dtype, void *, void *, double, const void *, const void *,
                             const int64_t *, const double *, int64_t, int64_t, int64_t, int64_t,
                             int64_t, void *, const ml_kctx *);
    ml_status (*attention_forward)(ml_dtype, void *, double *, const void *, const void *,
                                   const void *, int64_t, int64_t, int64_t, int64_t, int64_t,
                                   void *, const ml_kctx *);
    ml_status (*attention_backward)(ml_dtype, void *, void *, void *, double *, const void *,
                                    const void *, const void *, const void *, const void *,
                                    const double *, int64_t, int64_t, int64_t, int64_t, void *,
                                    const ml_kctx *);

    /* Optimizers and norms (kernels/optim.h). Host scalars (sumsq's out,
     * lazy Adam's nactive) stay host pointers on every backend. */
    ml_status (*adamw)(ml_dtype, void *, void *, void *, const void *, int64_t,
                       const ml_adamw_hp *, const ml_kctx *);
    ml_status (*lazy_adamw)(ml_dtype, void *, void *const *, void *const *, int64_t *,
                            const void *, const uint8_t *, int64_t, int64_t, const ml_adamw_hp *,
                            int64_t *, const ml_kctx *);
    ml_status (*sgd)(ml_dtype, void *, void *, const void *, int64_t, const ml_sgd_hp *,
                     const ml_kctx *);
    ml_status (*sumsq)(ml_dtype, double *, const void *, int64_t, void *, const ml_kctx *);
    ml_status (*slice_norms)(ml_dtype, double *, const void *, int64_t, int64_t, void *,
                             const ml_kctx *);
    ml_status (*scale_slices)(ml_dtype, void *, const double *, int64_t, int64_t,
                              const ml_kctx *);
} ml_kernels;

/* A device: its memory table and its kernel table. */
typedef struct ml_backend {
    const char *name;
    const ml_memory *mem;
    const ml_kernels *kern;
} ml_backend;

extern const ml_backend ml_backend_cpu;
/* Unmap the freed buffers the CPU backend keeps for reuse (backend_cpu.c). */
void ml_cpu_empty_cache(void);
/* The streams and events of a memory that has none (the CPU, a plan):
 * handles are NULL and work is done in program order (backend_cpu.c). */
ml_status ml_no_handle_new(void **handle);
void ml_no_handle_free(void *handle);
ml_status ml_no_event_record(void *event, void *stream);
ml_status ml_no_stream_wait(void *stream, void *event);
ml_status ml_no_synchronize(void *stream);
#ifdef ML_WITH_CUDA
extern const ml_backend ml_backend_cuda;
#endif
/* host/runtime/backend_plan.c: the memory tables of a dry run, per device
 * (address space only; CUDA's with the caching allocator's rounding, so a
 * CUDA run plans on a machine without a GPU). */
extern const ml_memory *const ml_memory_plan[ML_NDEVICES];
/* What a CUDA device runs (op, dtype), on every build; and the kernel
 * table a plan of CUDA uses on a build without CUDA: supports and the
 * scratch sizes, no kernels (a plan skips them). */
int ml_cuda_supports(ml_op op, ml_dtype dt);
extern const ml_kernels ml_kernels_cuda_plan;
/* Those plain-C entries, written once: the real CUDA table (backend_cuda.c)
 * and the plan's both start with them, so a plan books every scratch the
 * kernels will take. */
#define ML_CUDA_SIZING                                                                  \
    .supports = ml_cuda_supports,                                                       \
    .dispatch_scratch_bytes = ml_dispatch_scratch_bytes_cuda,                           \
    .dispatch_unpack_scratch_bytes = ml_dispatch_unpack_scratch_bytes_cuda,             \
    .router_scratch_bytes = ml_router_scratch_bytes_cuda,                               \
    .topk_scratch_bytes = ml_topk_scratch_bytes_cuda,                                   \
    .reduce_all_scratch_bytes = ml_reduce_all_scratch_bytes_cuda,                       \
    .sumsq_scratch_bytes = ml_sumsq_scratch_bytes_cuda,                                 \
    .slice_norms_scratch_bytes = ml_slice_norms_scratch_bytes_cuda,                     \
    .experts_scratch_bytes = ml_experts_scratch_bytes_cuda

/* The caching allocator's block size for a request of n bytes (512 B steps
 * up to 1 MiB, then 2 MiB steps): what the CUDA allocator reserves and
 * what a plan of a CUDA run charges. */
size_t ml_cuda_round_size(size_t n);

/* The one dispatch point of kernels (DESIGN.md, Layers): inside a memory
 * plan every kernel is skipped here, and a family the device lacks is
 * ML_EUNSUPPORTED. h is an ml_host *, dev an ml_device. */
#define ML_KCALL(h, dev, family, ...)                                                   \
    ((h)->planning ? ML_OK                                                              \
     : !(h)->kern[dev] || !(h)->kern[dev]->family ? ML_EUNSUPPORTED                     \
     : (h)->kern[dev]->family(__VA_ARGS__))
/* The scratch bytes of `family` (the table's family##_scratch_bytes) on dev,
 * asked of the device's table, also inside a plan, so the plan books what
 * the kernels will take (a plan of CUDA on a build without it asks
 * ml_kernels_cuda_plan). No table or no entry: none. */
#define ML_KSCRATCH(h, dev, family, ...)                                                \
    ((h)->kern[dev] && (h)->kern[dev]->family##_scratch_bytes                           \
     ? (h)->kern[dev]->family##_scratch_bytes(__VA_ARGS__) : (size_t)0)
/* The same for the validators that return a position or -1 ("nothing bad"):
 * a plan has nothing to validate; a device without the validator answers
 * ML_DISPATCH_EDEVICE (kernels/dispatch.h), never "nothing bad". */
#define ML_KCHECK(h, dev, family, ...)                                                  \
    ((h)->planning ? (int64_t)-1                                                        \
     : !(h)->kern[dev] || !(h)->kern[dev]->family ? (int64_t)ML_DISPATCH_EDEVICE        \
     : (h)->kern[dev]->family(__VA_ARGS__))

#endif
