/*
 * host/runtime/ops_moe.c - the MoE layer's ops (host/runtime/ops_moe.h):
 * router, dispatch and experts, with their pool-or-ledger outputs and
 * scratch.
 */
#include "ops_moe.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- pool or ledger ------------------------------------------------------------- */

/* t is live: not freed and not a view of a rewound pool frame (op.h's
 * message for either). */
static ml_status live(const ml_tensor *t, const char *name, ml_err *e)
{
    if (t->st && (!t->st->pool || ml_pool_view_valid(t->st->pool, t->st->slot, t->st->id)))
        return ML_OK;
    return ml_check_input(t, name, ML_CPU, 0, -1, 0, e);
}

static ml_status check_pool(const ml_pool *p, ml_device dev, ml_err *e)
{
    if (!p || p->device == dev)
        return ML_OK;
    return ml_err_set(e, ML_EINVAL, "pool is on %s but the other operands are on %s (one device "
                      "expected)", ml_device_names[p->device], ml_device_names[dev]);
}

/* An output: a given one is checked, an empty one allocated in the pool
 * (when there is one) or by the ledger; zero: a += output, zeros when
 * allocated. */
static ml_status output(ml_host *h, ml_pool *p, ml_tensor *t, const char *name, ml_device dev,
                        ml_dtype dt, int ndim, const int64_t *dims, int zero, ml_err *e)
{
    if (t->st || !p)
        return (zero ? ml_prepare_accumulator : ml_prepare_output)(h, t, name, dev, dt, ndim, dims, e);
    ML_TRY(ml_pool_tensor(h, p, t, name, dt, ndim, dims, e));
    return zero ? ml_tensor_zero(h, t, e) : ML_OK;
}

/* One kernel call's scratch: a tensor in a pool slot rewound after, or a
 * ledger tensor; dropped after either way. None (NULL) for 0 bytes. */
typedef struct {
    ml_tensor t;
    ml_pool *pool;
    size_t mark;
} scratch;

static ml_status scratch_take(ml_host *h, ml_pool *p, ml_device dev, size_t nbytes,
                              const char *what, scratch *s, void **data, ml_err *e)
{
    memset(s, 0, sizeof *s);
    *data = NULL;
    if (!nbytes)
        return ML_OK;
    if (!p) {
        int64_t n = (int64_t)((nbytes + 7) / 8);
        ML_TRY(ml_tensor_alloc(h, &s->t, dev, ML_F64, 1, &n, e));
    } else {
        int64_t n = (int64_t)nbytes;
        s->mark = ml_pool_mark(p);
        ML_TRY(ml_pool_tensor(h, p, &s->t, what, ML_U8, 1, &n, e));
        s->pool = p;
    }
    *data = ml_data(&s->t);
    return ML_OK;
}

static void scratch_give(scratch *s)
{
    if (s->pool) {
        ml_pool_rewind(s->pool, s->mark);
        s->pool = NULL;
    }
    ml_tensor_drop(&s->t);
}

/* Host-side reads go through this many elements at a time. */
#define READ_BLOCK 256

/* ---- router ------------------------------------------------------------------------ */

/* x or wg: a live contiguous matrix of a float dtype the device runs the
 * router in (f32, f64; bf16 where ml_float_dtypes says so). */
static ml_status router_matrix(const ml_host *h, const ml_tensor *t, const char *name, ml_err *e)
{
    ML_TRY(live(t, name, e));
    ml_device dev = t->st->device;
    ML_TRY(ml_check_input(t, name, dev, ml_float_dtypes(h, dev, ML_OP_ROUTER), t->ndim, 0, e));
    if (t->ndim != 2)
        return ml_err_set(e, ML_EINVAL, "%s must be 2-dim, got %d dims", name, t->ndim);
    if (!ml_is_contiguous(t))
        return ml_err_set(e, ML_EINVAL, "%s must be contiguous", name);
    return ML_OK;
}

/* x [T, D] and wg [E, D] of one dtype on one device, E >= 1. */
static ml_status router_x_wg(const ml_host *h, const ml_tensor *x, const ml_tensor *wg, ml_err *e)
{
    ML_TRY(router_matrix(h, x, "x", e));
    ML_TRY(router_matrix(h, wg, "wg", e));
    if (wg->st->device != x->st->device)
        return ml_err_set(e, ML_EINVAL, "x is on %s but wg is on %s (one device expected)",
                          ml_device_names[x->st->device], ml_device_names[wg->st->device]);
    char sx[64], sw[64];
    ml_format_shape(x, sx, sizeof sx);
    ml_format_shape(wg, sw, sizeof sw);
    if (x->dtype != wg->dtype)
        return ml_err_set(e, ML_EINVAL, "x is %s but wg is %s (same dtype expected)",
                          ml_dtype_names[x->dtype], ml_dtype_names[wg->dtype]);
    if (x->shape[1] != wg->shape[1])
        return ml_err_set(e, ML_EINVAL, "x is %s but wg is %s: wg must be [E, %lld]", sx, sw,
                          (long long)x->shape[1]);
    if (wg->shape[0] < 1)
        return ml_err_set(e, ML_EINVAL, "wg is %s: at least one expert expected", sw);
    return ML_OK;
}

static ml_status on_device(const ml_tensor *t, const char *what, ml_device dev, ml_err *e)
{
    if (t->st->device == dev)
        return ML_OK;
    return ml_err_set(e, ML_EINVAL, "%s is on %s but the other operands are on %s (one device "
                      "expected)", what, ml_device_names[t->st->device], ml_device_names[dev]);
}

/* One value per expert: a live contiguous [E] tensor on dev, f64 or (when
 * !f64_only) f32. */
static ml_status router_vector(const ml_tensor *t, const char *what, int64_t E, int f64_only,
                               ml_device dev, ml_err *e)
{
    ML_TRY(live(t, what, e));
    ML_TRY(on_device(t, what, dev, e));
    if (f64_only ? t->dtype != ML_F64 : t->dtype != ML_F32 && t->dtype != ML_F64)
        return ml_err_set(e, ML_EINVAL, "%s must be %s, got %s", what, f64_only ? "f64" : "f32 or f64",
                          ml_dtype_names[t->dtype]);
    if (t->ndim != 1 || t->shape[0] != E) {
        char s[64];
        ml_format_shape(t, s, sizeof s);
        return ml_err_set(e, ML_EINVAL, "%s is %s but must be [%lld] (one value per expert)", what,
                          s, (long long)E);
    }
    if (!ml_is_contiguous(t))
        return ml_err_set(e, ML_EINVAL, "%s must be contiguous", what);
    return ML_OK;
}

/* cfg for T tokens over E experts, and the optional bias (finite values:
 * read back, except inside a plan). */
static ml_status router_cfg_check(ml_host *h, const ml_router_cfg *c, const ml_tensor *bias,
                                  int64_t T, int64_t E, ml_device dev, ml_err *e)
{
    if (c->k < 1)
        return ml_err_set(e, ML_EINVAL, "k must be >= 1, got %lld", (long long)c->k);
    if (c->k > E)
        return ml_err_set(e, ML_EINVAL, "k = %lld exceeds the number of experts (%lld)",
                          (long long)c->k, (long long)E);
    if (c->chunk < 1)
        return ml_err_set(e, ML_EINVAL, "chunk must be >= 1, got %lld", (long long)c->chunk);
    if (c->mode != ML_ROUTER_SOFTMAX_TOPK && c->mode != ML_ROUTER_TOPK_SOFTMAX)
        return ml_err_set(e, ML_EINVAL, "mode %d is not a router mode", (int)c->mode);
    if (!(c->temperature > 0) || !isfinite(c->temperature))
        return ml_err_set(e, ML_EINVAL, "temperature must be finite and > 0, got %g", c->temperature);
    if (!(c->eps >= 0 && c->eps < 1))
        return ml_err_set(e, ML_EINVAL, "eps must be in [0, 1), got %g", c->eps);
    if (!(c->noise >= 0) || !isfinite(c->noise))
        return ml_err_set(e, ML_EINVAL, "noise must be finite and >= 0, got %g", c->noise);
    if (c->step > 0xffffffffu || c->layer > 0x7fffffffu)
        return ml_err_set(e, ML_EINVAL, "step must be < 2^32 and layer < 2^31, got %llu and %llu",
                          (unsigned long long)c->step, (unsigned long long)c->layer);
    /* The noise counter c0 = token_offset + t must fit in 32 bits. */
    if ((c->noise > 0 || c->gumbel) &&
        (T > 0xffffffffLL || c->token_offset > (uint64_t)(0xffffffffLL - T)))
        return ml_err_set(e, ML_EINVAL, "noise is keyed by a 32-bit token index: token_offset + T = "
                          "%llu + %lld exceeds 2^32 - 1", (unsigned long long)c->token_offset,
                          (long long)T);
    if (!bias)
        return ML_OK;
    ML_TRY(router_vector(bias, "bias", E, 0, dev, e));
    if (h->planning)
        return ML_OK;
    double buf[READ_BLOCK];
    for (int64_t e0 = 0; e0 < E; e0 += READ_BLOCK) {
        int64_t nb = E - e0 < READ_BLOCK ? E - e0 : READ_BLOCK;
        ML_TRY(ml_read_back(h, bias, e0, nb, buf, e));
        for (int64_t i = 0; i < nb; i++)
            if (!isfinite(ml_load(bias->dtype, buf, (size_t)i)))
                return ml_err_set(e, ML_EINVAL, "bias has a non-finite value at expert %lld",
                                  (long long)(e0 + i));
    }
    return ML_OK;
}

static ml_status router_status(ml_status s, ml_err *e)
{
    if (s == ML_ENAN)
        return ml_err_set(e, s, "NaN in router logits");
    return ml_kernel_status(s, e);
}

/* sum_e C_e P_e and max_e C_e from counts and psum, read back; inside a
 * plan 0 and the worst case T. */
static ml_status router_sums(ml_host *h, ml_router_stats *st, int64_t T, int64_t E, ml_err *e)
{
    st->cp = 0;
    st->max_count = h->planning ? T : 0;
    for (int64_t e0 = 0; e0 < E && !h->planning; e0 += READ_BLOCK) {
        int64_t cv[READ_BLOCK], nb = E - e0 < READ_BLOCK ? E - e0 : READ_BLOCK;
        double pv[READ_BLOCK];
        ML_TRY(ml_read_back(h, st->counts, e0, nb, cv, e));
        ML_TRY(ml_read_back(h, st->psum, e0, nb, pv, e));
        for (int64_t i = 0; i < nb; i++) {
            st->cp += (double)cv[i] * pv[i];
            st->max_count = cv[i] > st->max_count ? cv[i] : st->max_count;
        }
    }
    return ML_OK;
}

ml_status ml_op_router_forward(ml_host *h, ml_tensor *idx, ml_tensor *w, ml_router_stats *st,
                               const ml_tensor *x, const ml_tensor *wg, const ml_router_cfg *cfg,
                               const ml_tensor *bias, ml_pool *pool, ml_err *e)
{
    ML_TRY(router_x_wg(h, x, wg, e));
    int64_t T = x->shape[0], D = x->shape[1], E = wg->shape[0];
    ml_device dev = x->st->device;
    ML_TRY(router_cfg_check(h, cfg, bias, T, E, dev, e));
    ML_TRY(check_pool(pool, dev, e));
    int64_t sk[2] = {T, cfg->k};
    ML_TRY(output(h, pool, idx, "idx", dev, ML_I64, 2, sk, 0, e));
    ML_TRY(output(h, pool, w, "w", dev, x->dtype, 2, sk, 0, e));
    ML_TRY(output(h, pool, st->counts, "counts", dev, ML_I64, 1, &E, 1, e));
    ML_TRY(output(h, pool, st->psum, "psum", dev, ML_F64, 1, &E, 1, e));
    scratch s;
    void *buf;
    ML_TRY(scratch_take(h, pool, dev, ML_KSCRATCH(h, dev, router, T, D, E, cfg->chunk, 0),
                        "the router scratch", &s, &buf, e));
    st->z = st->entropy = 0;
    ml_kctx c = ml_host_kctx(h);
    ml_status ks = ML_KCALL(h, dev, router_forward, x->dtype, ml_data(idx), ml_data(w),
                            ml_data(st->counts), ml_data(st->psum), &st->z, &st->entropy,
                            ml_data(x), ml_data(wg), bias ? bias->dtype : ML_F64,
                            bias ? ml_data(bias) : NULL, T, D, E, cfg, buf, &c);
    scratch_give(&s);
    ML_TRY(router_status(ks, e));
    return router_sums(h, st, T, E, e);
}

/* grads->dx or dwg when given: contiguous, on dev, of dtype dt (x's for
 * dx, ml_grad_dtype of x's for dwg), [a, b]. */
static ml_status router_grad(const ml_tensor *t, const char *what, ml_dtype dt, ml_dtype xdt,
                             int64_t a, int64_t b, ml_device dev, ml_err *e)
{
    if (!t->st)
        return ML_OK;   /* the op allocates it */
    ML_TRY(live(t, what, e));
    if (t->st->device != dev)
        return ml_err_set(e, ML_EINVAL, "%s is on %s but x is on %s (one device expected)", what,
                          ml_device_names[t->st->device], ml_device_names[dev]);
    if (t->dtype != dt)
        return ml_err_set(e, ML_EINVAL, "%s is %s but x is %s: %s must be %s", what,
                          ml_dtype_names[t->dtype], ml_dtype_names[xdt], what, ml_dtype_names[dt]);
    const int64_t dims[2] = {a, b};
    ML_TRY(ml_check_shape(t, what, 2, dims, e));
    if (!ml_is_contiguous(t))
        return ml_err_set(e, ML_EINVAL, "%s must be contiguous", what);
    return ML_OK;
}

/* dw or idx of the backward: contiguous [T, k] on dev. */
static ml_status router_tk(const ml_tensor *t, const char *what, const ml_tensor *x, int64_t k,
                           ml_device dev, ml_err *e)
{
    ML_TRY(live(t, what, e));
    ML_TRY(on_device(t, what, dev, e));
    if (!ml_is_contiguous(t))
        return ml_err_set(e, ML_EINVAL, "%s must be contiguous", what);
    int64_t T = x->shape[0];
    if (t->ndim == 2 && t->shape[0] == T && t->shape[1] == k)
        return ML_OK;
    char s[64], sx[64];
    ml_format_shape(t, s, sizeof s);
    ml_format_shape(x, sx, sizeof sx);
    return ml_err_set(e, ML_EINVAL, "%s is %s but x is %s and k = %lld: %s must be [%lld,%lld]",
                      what, s, sx, (long long)k, what, (long long)T, (long long)k);
}

ml_status ml_op_router_backward(ml_host *h, const ml_router_grads *g, const ml_tensor *dw,
                                const ml_tensor *x, const ml_tensor *wg, const ml_tensor *idx,
                                const ml_router_cfg *cfg, const ml_tensor *bias, ml_pool *pool,
                                ml_err *e)
{
    ML_TRY(router_x_wg(h, x, wg, e));
    int64_t T = x->shape[0], D = x->shape[1], E = wg->shape[0], k = cfg->k;
    ml_device dev = x->st->device;
    ML_TRY(router_cfg_check(h, cfg, bias, T, E, dev, e));
    ML_TRY(check_pool(pool, dev, e));
    ML_TRY(live(dw, "dw", e));
    if (dw->dtype != x->dtype)
        return ml_err_set(e, ML_EINVAL, "dw is %s but x is %s (same dtype expected)",
                          ml_dtype_names[dw->dtype], ml_dtype_names[x->dtype]);
    ML_TRY(router_tk(dw, "dw", x, k, dev, e));
    ML_TRY(live(idx, "idx", e));
    if (idx->dtype != ML_I64)
        return ml_err_set(e, ML_EINVAL, "idx must be i64, got %s", ml_dtype_names[idx->dtype]);
    ML_TRY(router_tk(idx, "idx", x, k, dev, e));
    ml_kctx c = ml_host_kctx(h);
    int64_t bad, v;
    ML_TRY(ml_find_bad_index(h, idx, E, &bad, &v, e));
    if (bad >= 0) {
        return ml_err_set(e, ML_EINVAL, "idx: expert %lld at position %lld is outside [0, %lld) "
                          "(ids are 0-based)", (long long)v, (long long)bad, (long long)E);
    }
    if (g->aux)
        ML_TRY(router_vector(g->aux, "grads.aux", E, 1, dev, e));
    if (!isfinite(g->z))
        return ml_err_set(e, ML_EINVAL, "grads.z must be finite, got %g", g->z);
    ml_dtype gdt = ml_grad_dtype(x->dtype);   /* dwg: f32 for bf16 x (mixed precision) */
    ML_TRY(router_grad(g->dx, "grads.dx", x->dtype, x->dtype, T, D, dev, e));
    ML_TRY(router_grad(g->dwg, "grads.dwg", gdt, x->dtype, E, D, dev, e));
    if ((g->dx->st && g->dx->st == x->st) || (g->dwg->st && g->dwg->st == wg->st) ||
        (g->dx->st && g->dx->st == g->dwg->st))
        return ml_err_set(e, ML_EINVAL, "grads.dx and grads.dwg must not share storage with x, wg "
                          "or each other");
    int64_t sxd[2] = {T, D}, swd[2] = {E, D};
    ML_TRY(output(h, pool, g->dx, "grads.dx", dev, x->dtype, 2, sxd, 1, e));
    ML_TRY(output(h, pool, g->dwg, "grads.dwg", dev, gdt, 2, swd, 1, e));
    scratch s;
    void *buf;
    ML_TRY(scratch_take(h, pool, dev, ML_KSCRATCH(h, dev, router, T, D, E, cfg->chunk, 1),
                        "the router scratch", &s, &buf, e));
    ml_status ks = ML_KCALL(h, dev, router_backward, x->dtype, ml_data(g->dx), ml_data(g->dwg),
                            ml_data(idx), ml_data(dw), g->aux ? ml_data(g->aux) : NULL, g->z,
                            ml_data(x), ml_data(wg), T, D, E, cfg, buf, &c);
    scratch_give(&s);
    return router_status(ks, e);
}

ml_status ml_op_router_update_bias(ml_host *h, ml_tensor *bias, const ml_tensor *counts,
                                   double gamma, ml_err *e)
{
    ML_TRY(live(bias, "bias", e));
    if (bias->ndim != 1)
        return ml_err_set(e, ML_EINVAL, "bias must be 1-dim [E], got %d dims", bias->ndim);
    int64_t E = bias->shape[0];
    ml_device dev = bias->st->device;
    ML_TRY(router_vector(bias, "bias", E, 0, dev, e));
    ML_TRY(live(counts, "counts", e));
    ML_TRY(on_device(counts, "counts", dev, e));
    if (counts->dtype != ML_I64)
        return ml_err_set(e, ML_EINVAL, "counts must be i64, got %s", ml_dtype_names[counts->dtype]);
    if (counts->ndim != 1 || counts->shape[0] != E) {
        char sb[64], sc[64];
        ml_format_shape(bias, sb, sizeof sb);
        ml_format_shape(counts, sc, sizeof sc);
        return ml_err_set(e, ML_EINVAL, "bias is %s but counts is %s (one count per expert)", sb, sc);
    }
    if (!ml_is_contiguous(counts))
        return ml_err_set(e, ML_EINVAL, "counts must be contiguous");
    if (!isfinite(gamma) || gamma < 0)
        return ml_err_set(e, ML_EINVAL, "gamma must be finite and >= 0, got %g", gamma);
    ml_kctx c = ml_host_kctx(h);
    return ml_kernel_status(ML_KCALL(h, dev, router_update_bias, bias->dtype, ml_data(bias),
                                     ml_data(counts), E, gamma, &c), e);
}

/* ---- dispatch and experts: operand checks ----------------------------------------- */

#define EX_ANY (-1)
/* Every float dtype a device may run the experts in (ml_float_dtypes says
 * which one does). */
#define EX_FLOATS (ML_DT_FLOAT | ML_DT(ML_BF16))

/* A live contiguous tensor named `name` on dev, of dtype dt (or EX_ANY),
 * with shape [dims...] or, when dims is NULL, ndim dims. */
static ml_status ex_tensor(const ml_tensor *t, const char *name, ml_device dev, int dt, int ndim,
                           const int64_t *dims, ml_err *e)
{
    ML_TRY(live(t, name, e));
    if (dt >= 0 && t->dtype != (ml_dtype)dt)
        return ml_err_set(e, ML_EINVAL, "%s: expected dtype %s, got %s", name, ml_dtype_names[dt],
                          ml_dtype_names[t->dtype]);
    if (!ml_is_contiguous(t))
        return ml_err_set(e, ML_EINVAL, "%s: expected a contiguous tensor (call :contiguous())", name);
    if (t->st->device != dev)
        return ml_err_set(e, ML_EINVAL, "%s: a %s tensor but the other operands are on %s (one "
                          "device expected)", name, ml_device_names[t->st->device],
                          ml_device_names[dev]);
    char have[96], want[96];
    ml_format_shape(t, have, sizeof have);
    if (!dims && t->ndim != ndim)
        return ml_err_set(e, ML_EINVAL, "%s: expected %d dims, got %s", name, ndim, have);
    if (dims && ml_check_shape(t, name, ndim, dims, NULL) != ML_OK) {   /* a test: own wording */
        ml_format_dims(ndim, dims, want, sizeof want);
        return ml_err_set(e, ML_EINVAL, "%s: expected shape %s, got %s", name, want, have);
    }
    return ML_OK;
}

/* ex_tensor of a float dtype in dts: f32 and f64, and bf16 where dts has it
 * (ml_float_dtypes: where the device runs the family in bf16). */
static ml_status ex_float(const ml_tensor *t, const char *name, ml_device dev, unsigned dts,
                          int ndim, const int64_t *dims, ml_err *e)
{
    ML_TRY(live(t, name, e));
    if (!(dts & ML_DT(t->dtype)))
        return ml_err_set(e, ML_EINVAL, "%s: expected dtype %s, got %s", name,
                          dts & ML_DT(ML_BF16) ? "f32, f64 or bf16" : "f32 or f64",
                          ml_dtype_names[t->dtype]);
    return ex_tensor(t, name, dev, EX_ANY, ndim, dims, e);
}

/* "what: an [a,b] does not match bn [c,d]" */
static ml_status mismatch(const char *what, const ml_tensor *a, const char *an, const ml_tensor *b,
                          const char *bn, ml_err *e)
{
    char sa[96], sb[96];
    ml_format_shape(a, sa, sizeof sa);
    ml_format_shape(b, sb, sizeof sb);
    return ml_err_set(e, ML_EINVAL, "%s: %s %s does not match %s %s", what, an, sa, bn, sb);
}

/* capacities: i64 [E] on dev, every entry >= 0 (read back, except inside a
 * plan: nothing was computed there). */
static ml_status check_caps(ml_host *h, const ml_tensor *caps, int64_t E, ml_device dev, ml_err *e)
{
    ML_TRY(ex_tensor(caps, "capacities", dev, ML_I64, 1, &E, e));
    if (h->planning)
        return ML_OK;
    int64_t buf[READ_BLOCK];
    for (int64_t e0 = 0; e0 < E; e0 += READ_BLOCK) {
        int64_t nb = E - e0 < READ_BLOCK ? E - e0 : READ_BLOCK;
        ML_TRY(ml_read_back(h, caps, e0, nb, buf, e));
        for (int64_t i = 0; i < nb; i++)
            if (buf[i] < 0)
                return ml_err_set(e, ML_EINVAL, "capacities: expert %lld's capacity is %lld (must "
                                  "be >= 0)", (long long)(e0 + i), (long long)buf[i]);
    }
    return ML_OK;
}

/* ml_op_dispatch with either capacity (caps NULL) or capacities caps. */
static ml_status dispatch(ml_host *h, ml_dispatch_plan *plan, const ml_tensor *idx, int64_t E,
                          int64_t capacity, const ml_tensor *caps, ml_pool *pool, ml_err *e)
{
    ML_TRY(live(idx, "idx", e));
    ml_device dev = idx->st->device;
    ML_TRY(ex_tensor(idx, "idx", dev, ML_I64, 2, NULL, e));
    if (E < 1)
        return ml_err_set(e, ML_EINVAL, "E: expected a number of experts >= 1, got %lld", (long long)E);
    if (caps)
        ML_TRY(check_caps(h, caps, E, dev, e));
    ML_TRY(check_pool(pool, dev, e));
    int64_t T = idx->shape[0], k = idx->shape[1], n = T * k;
    ml_kctx c = ml_host_kctx(h);
    int64_t bad, v;
    ML_TRY(ml_find_bad_index(h, idx, E, &bad, &v, e));
    if (bad >= 0) {
        return ml_err_set(e, ML_EINVAL, "idx: expert id %lld at token %lld, slot %lld (0-based) is "
                          "outside [0, %lld)", (long long)v, (long long)(bad / k),
                          (long long)(bad % k), (long long)E);
    }
    int64_t e1 = E + 1, tk[2] = {T, k};
    ML_TRY(output(h, pool, plan->offsets, "plan.offsets", dev, ML_I64, 1, &e1, 0, e));
    ML_TRY(output(h, pool, plan->order, "plan.order", dev, ML_I64, 1, &n, 0, e));
    ML_TRY(output(h, pool, plan->counts, "plan.counts", dev, ML_I64, 1, &E, 0, e));
    ML_TRY(output(h, pool, plan->dropped, "plan.dropped", dev, ML_U8, 2, tk, 0, e));
    plan->ndropped = 0;
    scratch s;
    void *buf;
    ML_TRY(scratch_take(h, pool, dev, ML_KSCRATCH(h, dev, dispatch, n, E, 0),
                        "the dispatch scratch", &s, &buf, e));
    ml_status ks = ML_KCALL(h, dev, dispatch, ml_data(plan->offsets), ml_data(plan->order),
                            ml_data(plan->counts), ml_data(plan->dropped), &plan->ndropped,
                            ml_data(idx), n, E, capacity < 0 ? -1 : capacity,
                            caps ? ml_data(caps) : NULL, buf, &c);
    scratch_give(&s);
    return ml_kernel_status(ks, e);
}

ml_status ml_op_dispatch(ml_host *h, ml_dispatch_plan *plan, const ml_tensor *idx, int64_t E,
                         int64_t capacity, ml_pool *pool, ml_err *e)
{
    return dispatch(h, plan, idx, E, capacity, NULL, pool, e);
}

ml_status ml_op_dispatch_caps(ml_host *h, ml_dispatch_plan *plan, const ml_tensor *idx, int64_t E,
                              const ml_tensor *capacities, ml_pool *pool, ml_err *e)
{
    return dispatch(h, plan, idx, E, -1, capacities, pool, e);
}

/* ---- pack and unpack ------------------------------------------------------------- */

/* The plan's side of pack / unpack on dev: k >= 1, order [T·k] i64 with
 * every entry in [0, T·k) (read back, except inside a plan), ndropped in
 * [0, T·k]. Sets T and kept = T·k - ndropped. */
static ml_status plan_rows(ml_host *h, const ml_dispatch_plan *plan, int64_t k, ml_device dev,
                           int64_t *T, int64_t *kept, ml_err *e)
{
    if (k < 1)
        return ml_err_set(e, ML_EINVAL, "k: expected >= 1 slots per token, got %lld", (long long)k);
    ML_TRY(ex_tensor(plan->order, "plan.order", dev, ML_I64, 1, NULL, e));
    int64_t n = plan->order->shape[0];
    if (n % k != 0)
        return ml_err_set(e, ML_EINVAL, "plan.order: %lld assignments are not T·k for k = %lld",
                          (long long)n, (long long)k);
    if (plan->ndropped < 0 || plan->ndropped > n)
        return ml_err_set(e, ML_EINVAL, "plan.ndropped = %lld is outside [0, T·k = %lld]",
                          (long long)plan->ndropped, (long long)n);
    int64_t bad, v;
    ML_TRY(ml_find_bad_index(h, plan->order, n, &bad, &v, e));
    if (bad >= 0)
        return ml_err_set(e, ML_EINVAL, "plan.order[%lld] = %lld is not an assignment in [0, %lld)",
                          (long long)bad, (long long)v, (long long)n);
    *T = n / k;
    *kept = n - plan->ndropped;
    return ML_OK;
}

/* A per-token [T, C] (div = k) or per-assignment [T·k, C] (div = 1)
 * matrix t, live, contiguous, on dev. */
static ml_status token_rows(const ml_tensor *t, const char *name, ml_device dev, int dt, int64_t T,
                            int64_t k, int64_t *div, ml_err *e)
{
    ML_TRY(ex_tensor(t, name, dev, dt, 2, NULL, e));
    if (t->shape[0] != T && t->shape[0] != T * k) {
        char have[96];
        ml_format_shape(t, have, sizeof have);
        return ml_err_set(e, ML_EINVAL, "%s is %s but must be [T, C] = [%lld, C] (per token) or "
                          "[T·k, C] = [%lld, C] (per assignment) for the plan's T = %lld, k = %lld",
                          name, have, (long long)T, (long long)(T * k), (long long)T, (long long)k);
    }
    *div = t->shape[0] == T ? k : 1;
    return ML_OK;
}

ml_status ml_op_dispatch_pack(ml_host *h, ml_tensor *out, const ml_tensor *src,
                              const ml_dispatch_plan *plan, int64_t k, ml_pool *pool, ml_err *e)
{
    ML_TRY(live(src, "src", e));
    ml_device dev = src->st->device;
    int64_t T, kept, div;
    ML_TRY(plan_rows(h, plan, k, dev, &T, &kept, e));
    ML_TRY(token_rows(src, "src", dev, EX_ANY, T, k, &div, e));
    ML_TRY(check_pool(pool, dev, e));
    if (out->st && ml_tensors_overlap(out, src))
        return ml_err_set(e, ML_EINVAL, "rows shares storage with src (outputs must not alias inputs)");
    int64_t C = src->shape[1], dims[2] = {kept, C};
    ML_TRY(output(h, pool, out, "rows", dev, src->dtype, 2, dims, 0, e));
    ml_kctx c = ml_host_kctx(h);
    return ml_kernel_status(ML_KCALL(h, dev, dispatch_pack, src->dtype, ml_data(out), ml_data(src),
                                     ml_data(plan->order), kept, C, div, &c), e);
}

ml_status ml_op_dispatch_unpack(ml_host *h, ml_tensor *out, const ml_tensor *rows,
                                const ml_dispatch_plan *plan, int64_t k, ml_pool *pool, ml_err *e)
{
    ML_TRY(live(rows, "rows", e));
    ml_device dev = rows->st->device;
    ML_TRY(ex_float(rows, "rows", dev, ml_float_dtypes(h, dev, ML_OP_DISPATCH), 2, NULL, e));
    int64_t T, kept, div;
    ML_TRY(plan_rows(h, plan, k, dev, &T, &kept, e));
    if (!out->st)
        return ml_err_set(e, ML_EINVAL, "out: expected a given [T, C] or [T·k, C] tensor (unpack "
                          "adds into it)");
    ML_TRY(token_rows(out, "out", dev, rows->dtype, T, k, &div, e));
    int64_t C = out->shape[1];
    if (rows->shape[0] != kept || rows->shape[1] != C) {
        char have[96];
        ml_format_shape(rows, have, sizeof have);
        return ml_err_set(e, ML_EINVAL, "rows is %s but must be [kept, C] = [%lld, %lld] (the plan "
                          "keeps %lld of T·k = %lld assignments)", have, (long long)kept,
                          (long long)C, (long long)kept, (long long)(T * k));
    }
    if (ml_tensors_overlap(out, rows))
        return ml_err_set(e, ML_EINVAL, "out shares storage with rows (outputs must not alias inputs)");
    ML_TRY(check_pool(pool, dev, e));
    scratch s;
    void *buf;
    ML_TRY(scratch_take(h, pool, dev, ML_KSCRATCH(h, dev, dispatch_unpack, out->shape[0], div),
                        "the unpack scratch", &s, &buf, e));
    ml_kctx c = ml_host_kctx(h);
    ml_status ks = ML_KCALL(h, dev, dispatch_unpack, rows->dtype, ml_data(out), ml_data(rows),
                            ml_data(plan->order), kept, C, div, out->shape[0], buf, &c);
    scratch_give(&s);
    return ml_kernel_status(ks, e);
}

/* ---- experts ------------------------------------------------------------------------ */

/* The experts as the ops see them: a table (kernels/experts.h) and, when
 * the caller gave tensors, those tensors and the arrays tabulating them.
 * The arrays of up to EX_STACK experts live here, in the op's frame, so
 * a step with a usual expert count makes no heap allocation (pool and
 * scratch are on the operands' device, and a CUDA table must be host
 * memory); more experts take one malloc of 4·E pointers, freed by
 * ex_release before the op returns. */
#define EX_STACK 64

typedef struct {
    ml_experts_table t;
    ml_experts_wgrads gw;              /* the gradients' table (backward) */
    const ml_tensor *gate_up, *down;   /* the tensors t tabulates; NULL for a given table */
    const void *wst[2 * EX_STACK];     /* gate_up [E], then down [E] */
    void *gst[2 * EX_STACK];           /* dgate_up [E], then ddown [E] */
    void *heap;                        /* E > EX_STACK: 2E const pointers, then 2E more */
} ex_weights;

static void ex_release(ex_weights *wt)
{
    free(wt->heap);
    wt->heap = NULL;
}

/* Expert i's slice of t [E, a, b] (contiguous, checked). */
static char *ex_slice(const ml_tensor *t, int64_t E, int64_t i)
{
    return (char *)ml_data(t) + (size_t)i * (ml_nbytes(t) / (size_t)E);
}

/* x [T, D] of a dtype x's device runs the experts in, with gate_up
 * [E, 2F, D] and down [E, D, F] of x's dtype on x's device, E >= 1,
 * F >= 1, tabulated into wt. */
static ml_status ex_tabulate(ml_host *h, const ml_tensor *x, const ml_tensor *gate_up,
                             const ml_tensor *down, ex_weights *wt, ml_err *e)
{
    ML_TRY(live(x, "x", e));
    ml_device dev = x->st->device;
    ML_TRY(ex_float(x, "x", dev, ml_float_dtypes(h, dev, ML_OP_EXPERTS), 2, NULL, e));
    ML_TRY(ex_tensor(gate_up, "gate_up", dev, EX_ANY, 3, NULL, e));
    ML_TRY(ex_tensor(down, "down", dev, EX_ANY, 3, NULL, e));
    const char *names[] = {"gate_up", "down"};
    const ml_tensor *ts[] = {gate_up, down};
    for (int i = 0; i < 2; i++)
        if (ts[i]->dtype != x->dtype)
            return ml_err_set(e, ML_EINVAL, "%s: dtype %s does not match x's %s", names[i],
                              ml_dtype_names[ts[i]->dtype], ml_dtype_names[x->dtype]);
    int64_t D = x->shape[1], E = gate_up->shape[0], F = gate_up->shape[1] / 2;
    if (gate_up->shape[2] != D || gate_up->shape[1] % 2 != 0)
        return mismatch("expected gate_up [E, 2F, D]", gate_up, "gate_up", x, "x [T, D]", e);
    if (E < 1 || F < 1)
        return ml_err_set(e, ML_EINVAL, "gate_up: needs E >= 1 experts and F >= 1");
    if (down->shape[0] != E || down->shape[1] != D || down->shape[2] != F)
        return mismatch("expected down [E, D, F]", down, "down", gate_up, "gate_up [E, 2F, D]", e);
    const void **p = wt->wst;
    wt->heap = NULL;
    if (E > EX_STACK && !(p = wt->heap = malloc((size_t)E * 4 * sizeof(void *))))
        return ml_err_set(e, ML_EALLOC, "out of host memory for the pointer tables of %lld experts",
                          (long long)E);
    for (int64_t i = 0; i < E; i++) {
        p[i] = ex_slice(gate_up, E, i);
        p[E + i] = ex_slice(down, E, i);
    }
    wt->t = (ml_experts_table){{p, p + E}, E, F, D, x->dtype, dev};
    wt->gate_up = gate_up;
    wt->down = down;
    return ML_OK;
}

/* The gradients' table from the tensors g->dgate_up and g->ddown (given
 * or just allocated), into the arrays ex_tabulate chose. */
static void ex_tabulate_grads(ex_weights *wt, const ml_experts_grads *g)
{
    int64_t E = wt->t.E;
    void **p = wt->heap ? (void **)wt->heap + 2 * E : wt->gst;
    for (int64_t i = 0; i < E; i++) {
        p[i] = ex_slice(g->dgate_up, E, i);
        p[E + i] = ex_slice(g->ddown, E, i);
    }
    wt->gw = (ml_experts_wgrads){p, p + E};
}

/* The operands forward and backward share, checked against each other and
 * against the table (its pointers are trusted); fills cfg's dims. */
static ml_status ex_common(ml_host *h, const ml_tensor *x, const ml_experts_table *t,
                           const ml_tensor *idx, const ml_tensor *w, const ml_dispatch_plan *plan,
                           ml_experts_cfg *c, ml_err *e)
{
    ML_TRY(live(x, "x", e));
    ml_device dev = x->st->device;
    ML_TRY(ex_float(x, "x", dev, ml_float_dtypes(h, dev, ML_OP_EXPERTS), 2, NULL, e));
    if (t->E < 1 || t->F < 1 || !t->w.gate_up || !t->w.down)
        return ml_err_set(e, ML_EINVAL, "table: needs E >= 1 experts, F >= 1 and both arrays, got "
                          "E = %lld, F = %lld", (long long)t->E, (long long)t->F);
    if (t->dtype != x->dtype || t->device != dev || t->D != x->shape[1])
        return ml_err_set(e, ML_EINVAL, "table: experts of %s on %s with D = %lld do not match x "
                          "(%s on %s, D = %lld)", ml_dtype_names[t->dtype],
                          ml_device_names[t->device], (long long)t->D, ml_dtype_names[x->dtype],
                          ml_device_names[dev], (long long)x->shape[1]);
    for (int64_t i = 0; i < t->E; i++)
        if (!t->w.gate_up[i] != !t->w.down[i])
            return ml_err_set(e, ML_EINVAL, "table: expert %lld has %s but no %s (both or neither: "
                              "NULL skips it)", (long long)i, t->w.gate_up[i] ? "gate_up" : "down",
                              t->w.gate_up[i] ? "down" : "gate_up");
    ML_TRY(ex_tensor(idx, "idx", dev, ML_I64, 2, NULL, e));
    ML_TRY(ex_tensor(w, "w", dev, EX_ANY, 2, NULL, e));
    if (w->dtype != x->dtype)
        return ml_err_set(e, ML_EINVAL, "w: dtype %s does not match x's %s",
                          ml_dtype_names[w->dtype], ml_dtype_names[x->dtype]);
    c->T = x->shape[0];
    c->D = t->D;
    c->E = t->E;
    c->F = t->F;
    c->k = idx->shape[1];
    if (idx->shape[0] != c->T)
        return mismatch("expected idx [T, k]", idx, "idx", x, "x [T, D]", e);
    if (c->k < 1)
        return ml_err_set(e, ML_EINVAL, "idx: needs k >= 1 slots per token");
    if (w->shape[0] != c->T || w->shape[1] != c->k)
        return mismatch("expected w [T, k]", w, "w", idx, "idx", e);

    int64_t n = c->T * c->k, e1 = c->E + 1;
    ML_TRY(ex_tensor(plan->offsets, "plan.offsets", dev, ML_I64, 1, &e1, e));
    ML_TRY(ex_tensor(plan->order, "plan.order", dev, ML_I64, 1, &n, e));
    scratch s;
    void *buf;
    ML_TRY(scratch_take(h, NULL, dev, ML_KSCRATCH(h, dev, dispatch, n, c->E, 1),
                        "the plan check's scratch", &s, &buf, e));
    ml_kctx kc = ml_host_kctx(h);
    int64_t bad = ML_KCHECK(h, dev, dispatch_check_plan, ml_data(plan->offsets),
                            ml_data(plan->order), ml_data(idx), n, c->E, buf, &kc);
    scratch_give(&s);
    if (bad == ML_DISPATCH_EDEVICE)
        return ml_kernel_status(ML_EDEVICE, e);
    if (bad <= -2)
        return ml_err_set(e, ML_EINVAL, "plan: offsets are not a plan for %lld assignments "
                          "(offsets[%lld] is out of order or range)", (long long)n,
                          (long long)(-2 - bad));
    if (bad >= 0)
        return ml_err_set(e, ML_EINVAL, "plan: order[%lld] does not match idx (a plan from other "
                          "routing?)", (long long)bad);
    return ML_OK;
}

/* The run's cfg: tile clamped to max(T·k, 1) rows, refused when its
 * scratch, tile·(3D + 4F) elements, cannot be counted in int64; nsaved in
 * [0, T·k]. */
static ml_status ex_run_cfg(const ml_experts_cfg *c, ml_experts_cfg *run, ml_err *e)
{
    /* D is x's and F a tensor's or a table's whose [2F, D] blocks exist: no overflow */
    int64_t row = 3 * c->D + 4 * c->F;
    int64_t n = c->T * c->k;
    if (c->tile < 1 || c->tile > INT64_MAX / row)
        return ml_err_set(e, ML_EINVAL, "tile = %lld is out of range (the scratch of tile·(3D + 4F) "
                          "elements must fit in int64: tile <= %lld)", (long long)c->tile,
                          (long long)(INT64_MAX / row));
    if (c->nsaved < 0 || c->nsaved > n)
        return ml_err_set(e, ML_EINVAL, "nsaved = %lld is outside [0, T·k = %lld]",
                          (long long)c->nsaved, (long long)n);
    *run = *c;
    run->tile = c->tile < n ? c->tile : n > 1 ? n : 1;
    return ML_OK;
}

/* The kernels' scratch bytes on dev (SIZE_MAX: overflow). */
static ml_status ex_scratch_bytes(ml_host *h, ml_device dev, ml_dtype dt, const ml_experts_cfg *run,
                                  int backward, size_t *nb, ml_err *e)
{
    *nb = ML_KSCRATCH(h, dev, experts, dt, run, backward, h->nthreads);
    if (*nb == SIZE_MAX)
        return ml_err_set(e, ML_EINVAL, "tile: the scratch size overflows (too many elements or bytes)");
    return ML_OK;
}

/* One expert's [a, b] block `what` ("gate_up", ...) of expert i, checked. */
static ml_status ex_block(const ml_tensor *t, const char *what, int64_t i, ml_device dev,
                          ml_dtype dt, int64_t a, int64_t b, ml_err *e)
{
    char name[64];
    int64_t dims[2] = {a, b};
    snprintf(name, sizeof name, "%s of expert %lld", what, (long long)i);
    return ex_tensor(t, name, dev, (int)dt, 2, dims, e);
}

ml_status ml_op_experts_tabulate(ml_experts_table *t, const void **ptrs,
                                 const ml_tensor *const *gate_up, const ml_tensor *const *down,
                                 int64_t E, const ml_tensor *x, ml_err *e)
{
    ML_TRY(live(x, "x", e));
    ml_device dev = x->st->device;
    ML_TRY(ex_float(x, "x", dev, EX_FLOATS, 2, NULL, e));   /* the ops check x's device runs it */
    if (E < 1)
        return ml_err_set(e, ML_EINVAL, "E: expected a number of experts >= 1, got %lld",
                          (long long)E);
    int64_t D = x->shape[1], F = 0;
    for (int64_t i = 0; i < E; i++) {
        if (!gate_up[i] != !down[i])
            return ml_err_set(e, ML_EINVAL, "expert %lld has %s but no %s (both or neither: "
                              "neither skips it)", (long long)i, gate_up[i] ? "gate_up" : "down",
                              gate_up[i] ? "down" : "gate_up");
        if (!gate_up[i])
            continue;
        if (!F)   /* the first expert given sets F >= 1 (its check names a bad shape) */
            F = gate_up[i]->ndim == 2 && gate_up[i]->shape[0] >= 2 ? gate_up[i]->shape[0] / 2 : 1;
        ML_TRY(ex_block(gate_up[i], "gate_up", i, dev, x->dtype, 2 * F, D, e));
        ML_TRY(ex_block(down[i], "down", i, dev, x->dtype, D, F, e));
    }
    if (!F)
        return ml_err_set(e, ML_EINVAL, "gate_up: no expert given (at least one of the %lld)",
                          (long long)E);
    for (int64_t i = 0; i < E; i++) {
        ptrs[i] = gate_up[i] ? ml_data(gate_up[i]) : NULL;
        ptrs[E + i] = down[i] ? ml_data(down[i]) : NULL;
    }
    *t = (ml_experts_table){{ptrs, ptrs + E}, E, F, D, x->dtype, dev};
    return ML_OK;
}

ml_status ml_op_experts_tabulate_grads(ml_experts_wgrads *gw, void **ptrs,
                                       ml_tensor *const *dgate_up, ml_tensor *const *ddown,
                                       const ml_experts_table *t, ml_err *e)
{
    int64_t E = t->E, D = t->D, F = t->F;
    ml_dtype gdt = ml_grad_dtype(t->dtype);   /* f32 for bf16 weights */
    for (int64_t i = 0; i < E; i++) {
        if (t->w.gate_up[i] && (!dgate_up[i] || !ddown[i]))
            return ml_err_set(e, ML_EINVAL, "%s of expert %lld: missing, but the expert runs (its "
                              "weights are given)", dgate_up[i] ? "ddown" : "dgate_up",
                              (long long)i);
        if (dgate_up[i])
            ML_TRY(ex_block(dgate_up[i], "dgate_up", i, t->device, gdt, 2 * F, D, e));
        if (ddown[i])
            ML_TRY(ex_block(ddown[i], "ddown", i, t->device, gdt, D, F, e));
        ptrs[i] = t->w.gate_up[i] ? ml_data(dgate_up[i]) : NULL;
        ptrs[E + i] = t->w.gate_up[i] ? ml_data(ddown[i]) : NULL;
    }
    *gw = (ml_experts_wgrads){ptrs, ptrs + E};
    return ML_OK;
}

ml_status ml_op_experts_forward_table(ml_host *h, ml_tensor *y, ml_tensor *saved_h,
                                      const ml_tensor *x, const ml_experts_table *t,
                                      const ml_tensor *idx, const ml_tensor *w,
                                      const ml_dispatch_plan *plan, ml_experts_cfg *cfg,
                                      ml_pool *pool, ml_err *e)
{
    ML_TRY(ex_common(h, x, t, idx, w, plan, cfg, e));
    ml_experts_cfg run;
    ML_TRY(ex_run_cfg(cfg, &run, e));
    ml_device dev = x->st->device;
    size_t nb = 0;
    ML_TRY(ex_scratch_bytes(h, dev, x->dtype, &run, 0, &nb, e));
    ML_TRY(check_pool(pool, dev, e));
    int64_t yshape[2] = {run.T, run.D}, hshape[2] = {run.nsaved, 2 * run.F};
    if (run.accumulate && !y->st)
        return ml_err_set(e, ML_EINVAL, "y: expected a given [T, D] tensor (an accumulating call "
                          "adds into it)");
    if (y->st && (ml_tensors_overlap(y, x) || ml_tensors_overlap(y, w)))
        return ml_err_set(e, ML_EINVAL, "y shares storage with %s (outputs must not alias inputs)",
                          ml_tensors_overlap(y, x) ? "x" : "w");
    ML_TRY(output(h, pool, y, "y", dev, x->dtype, 2, yshape, 0, e));
    if (run.nsaved > 0)
        ML_TRY(output(h, pool, saved_h, "saved.h", dev, x->dtype, 2, hshape, 0, e));
    scratch s;
    void *buf;
    ML_TRY(scratch_take(h, pool, dev, nb, "the experts scratch", &s, &buf, e));
    ml_kctx c = ml_host_kctx(h);
    ml_status ks = ML_KCALL(h, dev, experts_forward, x->dtype, ml_data(y),
                            run.nsaved > 0 ? ml_data(saved_h) : NULL, buf, ml_data(x), ml_data(w),
                            ml_data(plan->order), ml_data(plan->offsets), &t->w, &run, &c);
    scratch_give(&s);
    return ml_kernel_status(ks, e);
}

ml_status ml_op_experts_forward(ml_host *h, ml_tensor *y, ml_tensor *saved_h, const ml_tensor *x,
                                const ml_tensor *gate_up, const ml_tensor *down,
                                const ml_tensor *idx, const ml_tensor *w,
                                const ml_dispatch_plan *plan, ml_experts_cfg *cfg, ml_pool *pool,
                                ml_err *e)
{
    ex_weights wt;
    ML_TRY(ex_tabulate(h, x, gate_up, down, &wt, e));
    ml_status s = ml_op_experts_forward_table(h, y, saved_h, x, &wt.t, idx, w, plan, cfg, pool, e);
    ex_release(&wt);
    return s;
}

/* The backward of both forms: with tensors (wt->gate_up set) the weight
 * gradients are g's dgate_up and ddown, checked, allocated when empty and
 * tabulated here; with a table they are wt->gw and g's are not used. */
static ml_status ex_backward(ml_host *h, const ml_experts_grads *g, const ml_tensor *dy,
                             const ml_tensor *x, ex_weights *wt, const ml_tensor *idx,
                             const ml_tensor *w, const ml_dispatch_plan *plan,
                             const ml_tensor *saved_h, ml_experts_cfg *cfg, ml_pool *pool,
                             ml_err *e)
{
    ML_TRY(ex_common(h, x, &wt->t, idx, w, plan, cfg, e));
    ml_device dev = x->st->device;
    ml_dtype dt = x->dtype;
    ML_TRY(ex_tensor(dy, "dy", dev, EX_ANY, 2, NULL, e));
    if (dy->dtype != dt)
        return ml_err_set(e, ML_EINVAL, "dy: dtype %s does not match x's %s",
                          ml_dtype_names[dy->dtype], ml_dtype_names[dt]);
    if (dy->shape[0] != cfg->T || dy->shape[1] != cfg->D)
        return mismatch("expected dy [T, D]", dy, "dy", x, "x", e);
    ml_experts_cfg run;
    ML_TRY(ex_run_cfg(cfg, &run, e));
    int64_t hshape[2] = {run.nsaved, 2 * run.F};
    if (run.nsaved > 0)
        ML_TRY(ex_tensor(saved_h, "saved.h", dev, dt, 2, hshape, e));
    ML_TRY(check_pool(pool, dev, e));

    static const char *const gnames[] = {"grads.dx", "grads.dgate_up", "grads.ddown", "grads.dw",
                                         "grads.touched"};
    int tensors = wt->gate_up != NULL;
    ml_tensor *gt[5] = {g->dx, tensors ? g->dgate_up : NULL, tensors ? g->ddown : NULL, g->dw,
                        g->touched};
    int64_t shapes[5][3] = {{run.T, run.D}, {run.E, 2 * run.F, run.D}, {run.E, run.D, run.F},
                            {run.T, run.k}, {run.E}};
    const int ndims[5] = {2, 3, 3, 2, 1}, zero[5] = {1, 1, 1, 0, 0};
    /* the weights' gradients in ml_grad_dtype(dt) (f32 for bf16); dw is of w's dtype */
    const ml_dtype dts[5] = {dt, ml_grad_dtype(dt), ml_grad_dtype(dt), dt, ML_U8};
    /* outputs the kernel zeroes or writes while it reads the inputs (a
     * table's blocks are trusted not to overlap them) */
    const ml_tensor *ins[] = {dy, x, wt->gate_up, wt->down, idx, w,
                              run.nsaved > 0 ? saved_h : NULL};
    static const char *const inn[] = {"dy", "x", "gate_up", "down", "idx", "w", "saved.h"};
    for (int i = 0; i < 5; i++) {
        if (!gt[i] || !gt[i]->st)
            continue;
        ML_TRY(ex_tensor(gt[i], gnames[i], dev, dts[i], ndims[i], shapes[i], e));
        for (int j = 0; j < 7; j++)
            if (ins[j] && ml_tensors_overlap(gt[i], ins[j]))
                return ml_err_set(e, ML_EINVAL, "%s shares storage with %s (outputs must not alias "
                                  "inputs)", gnames[i], inn[j]);
        for (int j = 0; j < i; j++)
            if (gt[j] && ml_tensors_overlap(gt[i], gt[j]))
                return ml_err_set(e, ML_EINVAL, "%s shares storage with %s", gnames[i], gnames[j]);
    }
    for (int i = 3; i < 5 && run.accumulate; i++)
        if (!gt[i]->st)
            return ml_err_set(e, ML_EINVAL, "%s: expected a given tensor (an accumulating call "
                              "keeps the earlier calls' entries)", gnames[i]);
    size_t nb = 0;
    ML_TRY(ex_scratch_bytes(h, dev, dt, &run, 1, &nb, e));
    for (int i = 0; i < 5; i++)
        if (gt[i])
            ML_TRY(output(h, pool, gt[i], gnames[i], dev, dts[i], ndims[i], shapes[i], zero[i], e));
    if (tensors)
        ex_tabulate_grads(wt, g);
    scratch s;
    void *buf;
    ML_TRY(scratch_take(h, pool, dev, nb, "the experts scratch", &s, &buf, e));
    ml_kctx c = ml_host_kctx(h);
    ml_status ks = ML_KCALL(h, dev, experts_backward, dt, ml_data(g->dx), &wt->gw, ml_data(g->dw),
                            ml_data(g->touched), buf, run.nsaved > 0 ? ml_data(saved_h) : NULL,
                            ml_data(dy), ml_data(x), ml_data(w), ml_data(plan->order),
                            ml_data(plan->offsets), &wt->t.w, &run, &c);
    scratch_give(&s);
    return ml_kernel_status(ks, e);
}

ml_status ml_op_experts_backward(ml_host *h, const ml_experts_grads *g, const ml_tensor *dy,
                                 const ml_tensor *x, const ml_tensor *gate_up,
                                 const ml_tensor *down, const ml_tensor *idx, const ml_tensor *w,
                                 const ml_dispatch_plan *plan, const ml_tensor *saved_h,
                                 ml_experts_cfg *cfg, ml_pool *pool, ml_err *e)
{
    ex_weights wt;
    ML_TRY(ex_tabulate(h, x, gate_up, down, &wt, e));
    ml_status s = ex_backward(h, g, dy, x, &wt, idx, w, plan, saved_h, cfg, pool, e);
    ex_release(&wt);
    return s;
}

ml_status ml_op_experts_backward_table(ml_host *h, const ml_experts_grads *g,
                                       const ml_experts_wgrads *gw, const ml_tensor *dy,
                                       const ml_tensor *x, const ml_experts_table *t,
                                       const ml_tensor *idx, const ml_tensor *w,
                                       const ml_dispatch_plan *plan, const ml_tensor *saved_h,
                                       ml_experts_cfg *cfg, ml_pool *pool, ml_err *e)
{
    if (!gw->gate_up || !gw->down)
        return ml_err_set(e, ML_EINVAL, "gw: needs both gradient arrays");
    for (int64_t i = 0; t->w.gate_up && i < t->E; i++)
        if (t->w.gate_up[i] && (!gw->gate_up[i] || !gw->down[i]))
            return ml_err_set(e, ML_EINVAL, "gw: expert %lld runs (its weights are given) but has "
                              "no %s gradient", (long long)i, gw->gate_up[i] ? "down" : "gate_up");
    ex_weights wt;   /* a given table: no tensors, nothing to release */
    wt.t = *t;
    wt.gw = *gw;
    wt.gate_up = wt.down = NULL;
    return ex_backward(h, g, dy, x, &wt, idx, w, plan, saved_h, cfg, pool, e);
}
