/*
 * host/runtime/backend_plan.c - the plan backend: what moelua.mem.plan swaps in for
 * the CPU table during a dry run (DESIGN.md, The memory ledger: "sizes and
 * lifetimes only, kernels skipped").
 *
 * Memory is address space only: an anonymous MAP_NORESERVE mapping that no
 * kernel touches, so a plan of a 100 GiB step costs page tables, not RAM.
 * It reads as zeros, which is what the few bindings that inspect tensor
 * contents (index validation, item()) then see; a binding that writes a
 * small tensor from Lua touches only its own pages. Every kernel returns
 * ML_OK without running and the validators report "nothing bad", so the
 * step code runs unchanged with meaningless values and exact sizes.
 */
#include "backend.h"

#include <sys/mman.h>

static int plan_available(void) { return 1; }

static int plan_supports(ml_op op, ml_dtype dt)
{
    (void)op; (void)dt;
    return 1;
}

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

static ml_status plan_memcpy(void *dst, int dst_host, const void *src, int src_host, size_t n)
{
    (void)dst; (void)dst_host; (void)src; (void)src_host; (void)n;
    return ML_OK;
}

static ml_status plan_synchronize(void) { return ML_OK; }

/* The skipped kernels, one per signature of backend.h. */
static ml_status plan_fill(ml_dtype dt, void *x, double v, int64_t n, const ml_kctx *c)
{
    (void)dt; (void)x; (void)v; (void)n; (void)c;
    return ML_OK;
}

static ml_status plan_binary(ml_binop op, ml_dtype dt, void *y, const void *a, const void *b,
                             int64_t n, int64_t na, int64_t nb, const ml_kctx *c)
{
    (void)op; (void)dt; (void)y; (void)a; (void)b; (void)n; (void)na; (void)nb; (void)c;
    return ML_OK;
}

static ml_status plan_binary_scalar(ml_binop op, ml_dtype dt, void *y, const void *a, double s,
                                    int rev, int64_t n, const ml_kctx *c)
{
    (void)op; (void)dt; (void)y; (void)a; (void)s; (void)rev; (void)n; (void)c;
    return ML_OK;
}

static ml_status plan_arange(ml_dtype dt, void *x, double start, double step, int64_t n,
                             const ml_kctx *c)
{
    (void)dt; (void)x; (void)start; (void)step; (void)n; (void)c;
    return ML_OK;
}

static ml_status plan_unary(ml_unop op, ml_dtype dt, void *y, const void *x, int64_t n,
                            const ml_kctx *c)
{
    (void)op; (void)dt; (void)y; (void)x; (void)n; (void)c;
    return ML_OK;
}

static ml_status plan_copy(ml_dtype dt, void *y, const int64_t *ys, ml_dtype xt, const void *x,
                           const int64_t *xs, int nd, const int64_t *shape, const ml_kctx *c)
{
    (void)dt; (void)y; (void)ys; (void)xt; (void)x; (void)xs; (void)nd; (void)shape; (void)c;
    return ML_OK;
}

static ml_status plan_reduce(ml_redop op, ml_dtype dt, void *y, int64_t *idx, const void *x,
                             int64_t outer, int64_t n, int64_t inner, const ml_kctx *c)
{
    (void)op; (void)dt; (void)y; (void)idx; (void)x; (void)outer; (void)n; (void)inner; (void)c;
    return ML_OK;
}

static ml_status plan_reduce_all(ml_redop op, ml_dtype dt, void *y, int64_t *idx, const void *x,
                                 int64_t n, const ml_kctx *c)
{
    (void)op; (void)dt; (void)y; (void)idx; (void)x; (void)n; (void)c;
    return ML_OK;
}

static ml_status plan_cumsum(ml_dtype dt, void *y, const void *x, int64_t outer, int64_t n,
                             int64_t inner, const ml_kctx *c)
{
    (void)dt; (void)y; (void)x; (void)outer; (void)n; (void)inner; (void)c;
    return ML_OK;
}

static ml_status plan_softmax(int log, ml_dtype dt, void *y, const void *x, int64_t rows,
                              int64_t n, const ml_kctx *c)
{
    (void)log; (void)dt; (void)y; (void)x; (void)rows; (void)n; (void)c;
    return ML_OK;
}

static ml_status plan_topk(ml_dtype dt, void *v, int64_t *idx, const void *x, int64_t rows,
                           int64_t n, int64_t k, const ml_kctx *c)
{
    (void)dt; (void)v; (void)idx; (void)x; (void)rows; (void)n; (void)k; (void)c;
    return ML_OK;
}

/* index_select, gather and scatter_add share a signature */
static ml_status plan_index(ml_dtype dt, void *y, const void *x, const int64_t *idx, int64_t a,
                            int64_t b, int64_t n, int64_t inner, const ml_kctx *c)
{
    (void)dt; (void)y; (void)x; (void)idx; (void)a; (void)b; (void)n; (void)inner; (void)c;
    return ML_OK;
}

static ml_status plan_bincount(int64_t *y, const int64_t *x, int64_t n, int64_t bins,
                               const ml_kctx *c)
{
    (void)y; (void)x; (void)n; (void)bins; (void)c;
    return ML_OK;
}

static ml_status plan_matmul(ml_dtype dt, void *c_, const void *a, const void *b,
                             const ml_gemm_shape *s, const ml_kctx *c)
{
    (void)dt; (void)c_; (void)a; (void)b; (void)s; (void)c;
    return ML_OK;
}

/* rand and randn share a signature */
static ml_status plan_random(ml_dtype dt, void *x, int64_t n, uint64_t key, uint64_t ctr, double a,
                             double b, const ml_kctx *c)
{
    (void)dt; (void)x; (void)n; (void)key; (void)ctr; (void)a; (void)b; (void)c;
    return ML_OK;
}

static ml_status plan_router_forward(ml_dtype dt, int64_t *idx, void *w, int64_t *counts,
                                     double *psum, double *zsum, double *ent, const void *x,
                                     const void *wg, ml_dtype bt, const void *bias, int64_t T,
                                     int64_t D, int64_t E, const ml_router_cfg *cfg, void *scratch,
                                     const ml_kctx *c)
{
    (void)dt; (void)idx; (void)w; (void)counts; (void)psum; (void)zsum; (void)ent; (void)x;
    (void)wg; (void)bt; (void)bias; (void)T; (void)D; (void)E; (void)cfg; (void)scratch; (void)c;
    return ML_OK;
}

static ml_status plan_router_backward(ml_dtype dt, void *dx, void *dwg, const int64_t *idx,
                                      const void *dw, const double *aux, double gz, const void *x,
                                      const void *wg, int64_t T, int64_t D, int64_t E,
                                      const ml_router_cfg *cfg, void *scratch, const ml_kctx *c)
{
    (void)dt; (void)dx; (void)dwg; (void)idx; (void)dw; (void)aux; (void)gz; (void)x; (void)wg;
    (void)T; (void)D; (void)E; (void)cfg; (void)scratch; (void)c;
    return ML_OK;
}

static ml_status plan_router_update_bias(ml_dtype dt, void *bias, const int64_t *counts, int64_t E,
                                         double rate, const ml_kctx *c)
{
    (void)dt; (void)bias; (void)counts; (void)E; (void)rate; (void)c;
    return ML_OK;
}

static ml_status plan_dispatch(int64_t *off, int64_t *ord, int64_t *cnt, uint8_t *drop,
                               int64_t *ndropped, const int64_t *idx, int64_t n, int64_t E,
                               int64_t cap, const ml_kctx *c)
{
    (void)off; (void)ord; (void)cnt; (void)drop; (void)ndropped; (void)idx; (void)n; (void)E;
    (void)cap; (void)c;
    return ML_OK;
}

static int64_t plan_dispatch_find_bad(const int64_t *idx, int64_t n, int64_t E)
{
    (void)idx; (void)n; (void)E;
    return -1;
}

static int64_t plan_dispatch_check_plan(const int64_t *off, const int64_t *ord, const int64_t *idx,
                                        int64_t n, int64_t E)
{
    (void)off; (void)ord; (void)idx; (void)n; (void)E;
    return -1;
}

static ml_status plan_experts_forward(ml_dtype dt, void *y, void *h, void *buf, const void *x,
                                      const void *w, const int64_t *off, const int64_t *ord,
                                      const void *gw, const void *keep, const ml_experts_cfg *cfg,
                                      const ml_kctx *c)
{
    (void)dt; (void)y; (void)h; (void)buf; (void)x; (void)w; (void)off; (void)ord; (void)gw;
    (void)keep; (void)cfg; (void)c;
    return ML_OK;
}

static ml_status plan_experts_backward(ml_dtype dt, void *dx, void *dw, void *dgw, void *dh,
                                       uint8_t *touched, void *buf, const void *h, const void *dy,
                                       const void *x, const void *w, const int64_t *off,
                                       const int64_t *ord, const void *gw, const void *keep,
                                       const ml_experts_cfg *cfg, const ml_kctx *c)
{
    (void)dt; (void)dx; (void)dw; (void)dgw; (void)dh; (void)touched; (void)buf; (void)h; (void)dy;
    (void)x; (void)w; (void)off; (void)ord; (void)gw; (void)keep; (void)cfg; (void)c;
    return ML_OK;
}

const ml_backend ml_backend_plan = {
    .name = "plan",
    .available = plan_available,
    .supports = plan_supports,
    .alloc = plan_alloc,
    .free = plan_free,
    .memcpy = plan_memcpy,
    .synchronize = plan_synchronize,
    .fill = plan_fill,
    .arange = plan_arange,
    .binary = plan_binary,
    .binary_scalar = plan_binary_scalar,
    .unary = plan_unary,
    .copy = plan_copy,
    .reduce = plan_reduce,
    .reduce_all = plan_reduce_all,
    .cumsum = plan_cumsum,
    .softmax = plan_softmax,
    .topk = plan_topk,
    .index_select = plan_index,
    .gather = plan_index,
    .scatter_add = plan_index,
    .bincount = plan_bincount,
    .matmul = plan_matmul,
    .rand = plan_random,
    .randn = plan_random,
    .router_forward = plan_router_forward,
    .router_backward = plan_router_backward,
    .router_update_bias = plan_router_update_bias,
    .dispatch = plan_dispatch,
    .dispatch_find_bad = plan_dispatch_find_bad,
    .dispatch_check_plan = plan_dispatch_check_plan,
    .experts_forward = plan_experts_forward,
    .experts_backward = plan_experts_backward,
};
