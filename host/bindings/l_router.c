/*
 * host/bindings/l_router.c - the Lua library `moelua.router`: the chunked MoE router
 * (kernels/router.h has the semantics, the noise counters and the
 * invariance rules).
 *
 *   router.forward(x, wg, opts)  -> idx [T,k] i64, w [T,k], stats
 *       stats = {counts = i64 [E], psum = f64 [E], z = sum_t lse_t^2,
 *                entropy = sum_t H(p'_t), tokens = T, cp = sum_e C_e P_e,
 *                max_count = max_e C_e}
 *   router.backward(dw, x, wg, idx, opts [, grads]) -> dx, dwg
 *       grads = {aux = f64 [E] (dL/dp'_te), z = dL/dzsum, dx =, dwg =}; dx
 *       and dwg accumulate (+=) into the given tensors, or into new zeroed ones
 *   router.update_bias(bias, counts, gamma) -> bias (in place)
 *   router.scratch_bytes(T, D, E, chunk [, backward]) -> bytes of scratch
 *
 * opts: k (required, 1..E), chunk (default 2048), mode ("softmax_topk" |
 * "topk_softmax"), renorm (default true), temperature (default 1), eps
 * (default 0), noise (default 0), gumbel (default false), seed, step, layer,
 * token_offset (default 0: the noise counter of x's first row, router.h), bias (f32/f64 [E]: selection only), pool (a moelua.pool that
 * lends the scratch; otherwise it is allocated under the current category
 * and freed before returning).
 *
 * backward takes the forward's opts: the noise options (noise, gumbel, seed,
 * step, layer), temperature, eps, mode and renorm must be the forward's, so
 * the recompute sees the same scores; bias is accepted and unused (the saved
 * idx is never re-selected).
 *
 * Devices: every tensor (x, wg, dw, idx, bias, grads) and the pool on one
 * device, cpu or cuda; the kernels are reached through the backend table
 * (ML_KCALL), and outputs and scratch are allocated on that device.
 * On cuda the stats' cp and max_count read counts and psum back (E values).
 *
 * Not here: the aux loss (the model forms it from every layer's counts and
 * psum), capacity and dispatch.
 */
#include "libs.h"
#include "l_tensor.h"
#include "../runtime/pool.h"
#include "../../kernels/router.h"

#include <math.h>
#include <string.h>

static const char *const OPTS[] = {"k", "chunk", "mode", "renorm", "temperature", "eps",
                                   "noise", "gumbel", "seed", "step", "layer", "token_offset", "bias",
                                   "pool", NULL};
static const char *const GRAD_OPTS[] = {"aux", "z", "dx", "dwg", NULL};

typedef struct {
    ml_router_cfg cfg;
    ml_device dev;            /* x's device: every operand lives there */
    ml_host *h;
    const ml_tensor *bias;    /* NULL: none */
    ml_pool *pool;            /* NULL: none; its userdata stays on the stack */
    int pool_idx;             /* stack index of that userdata */
} router_opts;

/* Push opts[key]; is it present? (Popped by the caller either way.) */
static int field(lua_State *L, int idx, const char *key)
{
    return lua_getfield(L, idx, key) != LUA_TNIL;
}

/* opts[key] as an integer in [0, hi] (hi < 2^63: the noise counters). */
static uint64_t opt_counter(lua_State *L, int idx, const char *fn, const char *key, int64_t hi)
{
    int64_t v = ml_opt_integer(L, idx, fn, key, 0, 0, INT64_MAX);
    if (v > hi)
        ml_error(L, fn, "option '%s' must be <= %lld, got %lld", key, (long long)hi, (long long)v);
    return (uint64_t)v;
}

/* A live tensor on the stack top, named "option 'key'" in errors. */
static ml_tensor *opt_tensor(lua_State *L, const char *fn, const char *key)
{
    char what[64];
    snprintf(what, sizeof what, "option '%s'", key);
    if (!ml_testtensor(L, -1))
        ml_error(L, fn, "%s must be a tensor, got %s", what, luaL_typename(L, -1));
    return ml_checktensor_named(L, -1, fn, what);
}

/* `what` must be on dev (the device of x, or of bias for update_bias). */
static void check_device(lua_State *L, const char *fn, const char *what, const ml_tensor *t,
                         ml_device dev)
{
    if (t->st->device != dev)
        ml_error(L, fn, "%s is on %s but the other operands are on %s (one device expected)", what,
                 ml_device_names[t->st->device], ml_device_names[dev]);
}

/* Elements [e0, e0 + n) of the contiguous tensor t into the host buffer buf
 * (a copy back from the device; a plain copy on the cpu). Inside a plan
 * nothing was computed: buf reads as zeros. */
static void read_back(lua_State *L, const char *fn, ml_host *h, const ml_tensor *t,
                      int64_t e0, int64_t n, void *buf)
{
    size_t es = ml_dtype_size(t->dtype);
    ml_device dev = t->st->device;
    if (h->planning) {
        memset(buf, 0, (size_t)n * es);
        return;
    }
    ml_check_status(L, fn, h->mem[dev]->memcpy(buf, (const char *)ml_data(t) + (size_t)e0 * es,
                                               (size_t)n * es, dev == ML_CPU ? ML_COPY_H2H : ML_COPY_D2H,
                                               NULL));
}

/* Host-side reads go through this many elements at a time. */
#define READ_BLOCK 256

/* A contiguous tensor on dev of one dimension E and a float dtype. */
static void check_vector(lua_State *L, const char *fn, const char *what, const ml_tensor *t,
                         int64_t E, int f64_only, ml_device dev)
{
    char s[64];
    ml_format_shape(t, s, sizeof s);
    check_device(L, fn, what, t, dev);
    if (f64_only ? t->dtype != ML_F64 : t->dtype != ML_F32 && t->dtype != ML_F64)
        ml_error(L, fn, "%s must be %s, got %s", what, f64_only ? "f64" : "f32 or f64",
                 ml_dtype_names[t->dtype]);
    if (t->ndim != 1 || t->shape[0] != E)
        ml_error(L, fn, "%s is %s but must be [%lld] (one value per expert)", what, s, (long long)E);
    if (!ml_is_contiguous(t))
        ml_error(L, fn, "%s must be contiguous", what);
}

/* opts at idx (a table, required: k has no default). E from wg, dev from x.
 * A pool, if given, is left on the stack and its index stored. */
static void read_opts(lua_State *L, int idx, const char *fn, int64_t E, ml_device dev,
                      router_opts *o)
{
    if (!lua_istable(L, idx))
        ml_error(L, fn, "argument #%d: expected an options table with k, got %s", idx,
                 luaL_typename(L, idx));
    ml_check_opts(L, idx, fn, OPTS);
    memset(o, 0, sizeof *o);
    o->dev = dev;
    ml_check_device(L, fn, dev);
    o->h = ml_host_of(L);
    ml_router_cfg *c = &o->cfg;
    if (!field(L, idx, "k"))
        ml_error(L, fn, "option 'k' (experts per token) is required");
    lua_pop(L, 1);
    c->k = ml_opt_integer(L, idx, fn, "k", 0, 1, INT64_MAX);
    if (c->k > E)
        ml_error(L, fn, "k = %lld exceeds the number of experts (%lld)", (long long)c->k,
                 (long long)E);
    c->chunk = ml_opt_integer(L, idx, fn, "chunk", 2048, 1, INT64_MAX);
    c->mode = ML_ROUTER_SOFTMAX_TOPK;
    if (field(L, idx, "mode")) {
        const char *m = lua_type(L, -1) == LUA_TSTRING ? lua_tostring(L, -1) : NULL;
        if (!m)
            ml_error(L, fn, "option 'mode' must be a string, got %s", luaL_typename(L, -1));
        if (strcmp(m, "softmax_topk") == 0)
            c->mode = ML_ROUTER_SOFTMAX_TOPK;
        else if (strcmp(m, "topk_softmax") == 0)
            c->mode = ML_ROUTER_TOPK_SOFTMAX;
        else
            ml_error(L, fn, "option 'mode': unknown mode '%s' (softmax_topk, topk_softmax)", m);
    }
    lua_pop(L, 1);
    c->renorm = ml_opt_bool(L, idx, fn, "renorm", 1);
    c->temperature = ml_opt_number(L, idx, fn, "temperature", 1.0);
    if (!(c->temperature > 0))
        ml_error(L, fn, "option 'temperature' must be > 0, got %g", c->temperature);
    c->eps = ml_opt_number(L, idx, fn, "eps", 0.0);
    if (!(c->eps >= 0 && c->eps < 1))
        ml_error(L, fn, "option 'eps' must be in [0, 1), got %g", c->eps);
    c->noise = ml_opt_number(L, idx, fn, "noise", 0.0);
    if (!(c->noise >= 0))
        ml_error(L, fn, "option 'noise' must be >= 0, got %g", c->noise);
    c->gumbel = ml_opt_bool(L, idx, fn, "gumbel", 0);
    c->seed = opt_counter(L, idx, fn, "seed", INT64_MAX);
    c->step = opt_counter(L, idx, fn, "step", 0xffffffffLL);
    c->layer = opt_counter(L, idx, fn, "layer", 0x7fffffffLL);
    c->token_offset = opt_counter(L, idx, fn, "token_offset", INT64_MAX);
    if (field(L, idx, "bias")) {
        o->bias = opt_tensor(L, fn, "bias");
        check_vector(L, fn, "option 'bias'", o->bias, E, 0, dev);
        const ml_tensor *b = o->bias;
        double buf[READ_BLOCK];
        for (int64_t e0 = 0; e0 < E; e0 += READ_BLOCK) {
            int64_t nb = E - e0 < READ_BLOCK ? E - e0 : READ_BLOCK;
            read_back(L, fn, o->h, b, e0, nb, buf);
            for (int64_t e = 0; e < nb; e++)
                if (!isfinite(ml_load(b->dtype, buf, (size_t)e)))
                    ml_error(L, fn, "option 'bias' has a non-finite value at expert %lld",
                             (long long)(e0 + e));
        }
    }
    lua_pop(L, 1);
    if (field(L, idx, "pool")) {
        /* Scratch is taken and given back through host/runtime/pool.h, never through
         * the pool's Lua methods: a Lua call after the kernel could run the
         * Ctrl-C hook and raise before the slot was rewound. */
        ml_pool *p = ml_checkpool(L, -1, fn, "option 'pool'");
        if (p->device != dev)
            ml_error(L, fn, "option 'pool' is on %s but the other operands are on %s (one device "
                     "expected)", ml_device_names[p->device], ml_device_names[dev]);
        o->pool = p;   /* the userdata stays on the stack */
        o->pool_idx = lua_gettop(L);
    } else {
        lua_pop(L, 1);
    }
}

/* ---- tensors ---------------------------------------------------------------- */

static ml_tensor *check_float(lua_State *L, int idx, const char *fn, const char *name)
{
    ml_tensor *t = ml_contiguous_arg(L, idx, fn);
    if (t->dtype != ML_F32 && t->dtype != ML_F64)
        ml_error(L, fn, "argument #%d (%s) must be f32 or f64, got %s", idx, name,
                 ml_dtype_names[t->dtype]);
    if (t->ndim != 2)
        ml_error(L, fn, "argument #%d (%s) must be 2-dim, got %d dims", idx, name, t->ndim);
    return t;
}

/* x [T, D] and wg [E, D] of one dtype. */
static void check_x_wg(lua_State *L, const char *fn, int ix, int iw, ml_tensor **x, ml_tensor **wg)
{
    *x = check_float(L, ix, fn, "x");
    *wg = check_float(L, iw, fn, "wg");
    if ((*wg)->st->device != (*x)->st->device)
        ml_error(L, fn, "x is on %s but wg is on %s (one device expected)",
                 ml_device_names[(*x)->st->device], ml_device_names[(*wg)->st->device]);
    char sx[64], sw[64];
    ml_format_shape(*x, sx, sizeof sx);
    ml_format_shape(*wg, sw, sizeof sw);
    if ((*x)->dtype != (*wg)->dtype)
        ml_error(L, fn, "x is %s but wg is %s (same dtype expected)", ml_dtype_names[(*x)->dtype],
                 ml_dtype_names[(*wg)->dtype]);
    if ((*x)->shape[1] != (*wg)->shape[1])
        ml_error(L, fn, "x is %s but wg is %s: wg must be [E, %lld]", sx, sw,
                 (long long)(*x)->shape[1]);
    if ((*wg)->shape[0] < 1)
        ml_error(L, fn, "wg is %s: at least one expert expected", sw);
}

static void check_router_status(lua_State *L, const char *fn, ml_status st)
{
    if (st == ML_ENAN)
        ml_error(L, fn, "NaN in router logits");
    ml_check_status(L, fn, st);
}

/* ---- bindings ------------------------------------------------------------------ */

/* router.forward(x, wg, opts) -> idx, w, stats */
/* The noise counter c0 = token_offset + t must fit in 32 bits. */
static void check_noise_range(lua_State *L, const char *fn, const ml_router_cfg *c, int64_t T)
{
    if ((c->noise > 0 || c->gumbel) &&
        (T > 0xffffffffLL || c->token_offset > (uint64_t)(0xffffffffLL - T)))
        ml_error(L, fn, "noise is keyed by a 32-bit token index: token_offset + T = %llu + %lld "
                 "exceeds 2^32 - 1", (unsigned long long)c->token_offset, (long long)T);
}

static int l_router_forward(lua_State *L)
{
    static const char fn[] = "moelua.router.forward";
    lua_settop(L, 3);
    ml_tensor *x, *wg;
    check_x_wg(L, fn, 1, 2, &x, &wg);
    int64_t T = x->shape[0], D = x->shape[1], E = wg->shape[0];
    router_opts o;
    read_opts(L, 3, fn, E, x->st->device, &o);
    int64_t k = o.cfg.k;
    check_noise_range(L, fn, &o.cfg, T);

    int64_t sk[2] = {T, k}, se[1] = {E};
    ml_tensor *idx = ml_newbuf(L, fn, o.dev, o.pool_idx, ML_I64, 2, sk);
    int iidx = lua_gettop(L);
    ml_tensor *w = ml_newbuf(L, fn, o.dev, o.pool_idx, x->dtype, 2, sk);
    ml_tensor *counts = ml_newzeros(L, fn, o.dev, o.pool_idx, ML_I64, 1, se);
    int icounts = lua_gettop(L);
    ml_tensor *psum = ml_newzeros(L, fn, o.dev, o.pool_idx, ML_F64, 1, se);
    ml_pool_scratch s;
    void *buf = ml_pool_scratch_acquire(L, fn, "the router scratch", o.dev, o.pool_idx,
                                        ml_router_scratch_bytes(T, D, E, o.cfg.chunk, 0), &s);

    double zsum = 0, entropy = 0;
    ml_kctx ctx = ml_kctx_of(ml_host_of(L));
    ml_status st = ML_KCALL(o.h, o.dev, router_forward, x->dtype, ml_data(idx), ml_data(w), ml_data(counts),
                                         ml_data(psum), &zsum, &entropy, ml_data(x), ml_data(wg),
                                         o.bias ? o.bias->dtype : ML_F64,
                                         o.bias ? ml_data(o.bias) : NULL, T, D, E, &o.cfg, buf, &ctx);
    ml_pool_scratch_release(&s);
    check_router_status(L, fn, st);

    /* sum_e C_e P_e (the aux loss is E times this over N^2) and max_e C_e
     * (the largest expert share), so the layer needs no tensor math for them */
    double cp = 0;
    int64_t cmax = 0;
    for (int64_t e0 = 0; e0 < E; e0 += READ_BLOCK) {
        int64_t cv[READ_BLOCK], nb = E - e0 < READ_BLOCK ? E - e0 : READ_BLOCK;
        double pv[READ_BLOCK];
        read_back(L, fn, o.h, counts, e0, nb, cv);
        read_back(L, fn, o.h, psum, e0, nb, pv);
        for (int64_t e = 0; e < nb; e++) {
            cp += (double)cv[e] * pv[e];
            cmax = cv[e] > cmax ? cv[e] : cmax;
        }
    }
    lua_pushvalue(L, iidx);
    lua_pushvalue(L, iidx + 1);
    lua_createtable(L, 0, 7);
    lua_pushnumber(L, cp);
    lua_setfield(L, -2, "cp");
    lua_pushinteger(L, cmax);
    lua_setfield(L, -2, "max_count");
    lua_pushvalue(L, icounts);
    lua_setfield(L, -2, "counts");
    lua_pushvalue(L, icounts + 1);
    lua_setfield(L, -2, "psum");
    lua_pushnumber(L, zsum);
    lua_setfield(L, -2, "z");
    lua_pushnumber(L, entropy);
    lua_setfield(L, -2, "entropy");
    lua_pushinteger(L, T);
    lua_setfield(L, -2, "tokens");
    return 3;
}

/* grads.<key>: a contiguous tensor on dev of dtype dt and shape [a, b], or nil. */
static ml_tensor *grad_matrix(lua_State *L, int gi, const char *fn, const char *key, ml_dtype dt,
                              int64_t a, int64_t b, ml_device dev)
{
    if (!gi || !field(L, gi, key)) {
        lua_pop(L, gi ? 1 : 0);
        return NULL;
    }
    ml_tensor *t = opt_tensor(L, fn, key);
    if (t->st->device != dev)
        ml_error(L, fn, "grads.%s is on %s but x is on %s (one device expected)", key,
                 ml_device_names[t->st->device], ml_device_names[dev]);
    if (t->dtype != dt)
        ml_error(L, fn, "grads.%s is %s but x is %s", key, ml_dtype_names[t->dtype], ml_dtype_names[dt]);
    char what[64];
    snprintf(what, sizeof what, "grads.%s", key);
    const int64_t dims[2] = {a, b};
    ml_check_shape_eq(L, fn, what, t, 2, dims);
    if (!ml_is_contiguous(t))
        ml_error(L, fn, "grads.%s must be contiguous", key);
    return t;   /* stays on the stack */
}

/* router.backward(dw, x, wg, idx, opts [, grads]) -> dx, dwg */
static int l_router_backward(lua_State *L)
{
    static const char fn[] = "moelua.router.backward";
    lua_settop(L, 6);
    ml_tensor *x, *wg;
    check_x_wg(L, fn, 2, 3, &x, &wg);
    int64_t T = x->shape[0], D = x->shape[1], E = wg->shape[0];
    router_opts o;
    read_opts(L, 5, fn, E, x->st->device, &o);
    int64_t k = o.cfg.k;
    check_noise_range(L, fn, &o.cfg, T);
    char sx[64], s[64];
    ml_format_shape(x, sx, sizeof sx);

    ml_tensor *dw = ml_contiguous_arg(L, 1, fn);
    ml_format_shape(dw, s, sizeof s);
    check_device(L, fn, "argument #1 (dw)", dw, o.dev);
    if (dw->dtype != x->dtype)
        ml_error(L, fn, "dw is %s but x is %s (same dtype expected)", ml_dtype_names[dw->dtype],
                 ml_dtype_names[x->dtype]);
    if (dw->ndim != 2 || dw->shape[0] != T || dw->shape[1] != k)
        ml_error(L, fn, "dw is %s but x is %s and k = %lld: dw must be [%lld,%lld]", s, sx,
                 (long long)k, (long long)T, (long long)k);
    ml_tensor *idx = ml_contiguous_arg(L, 4, fn);
    ml_format_shape(idx, s, sizeof s);
    check_device(L, fn, "argument #4 (idx)", idx, o.dev);
    if (idx->dtype != ML_I64)
        ml_error(L, fn, "idx must be i64, got %s", ml_dtype_names[idx->dtype]);
    if (idx->ndim != 2 || idx->shape[0] != T || idx->shape[1] != k)
        ml_error(L, fn, "idx is %s but x is %s and k = %lld: idx must be [%lld,%lld]", s, sx,
                 (long long)k, (long long)T, (long long)k);
    const int64_t *ip = ml_data(idx);
    int64_t bad = ML_KCHECK(o.h, o.dev, dispatch_find_bad, ip, T * k, E);
    if (bad == ML_DISPATCH_EDEVICE)
        ml_check_status(L, fn, ML_EDEVICE);
    if (bad >= 0) {
        int64_t v;
        read_back(L, fn, o.h, idx, bad, 1, &v);
        ml_error(L, fn, "idx: expert %lld at position %lld is outside [0, %lld) (ids are 0-based)",
                 (long long)v, (long long)bad, (long long)E);
    }

    int gi = 0;
    if (!lua_isnil(L, 6)) {
        if (!lua_istable(L, 6))
            ml_error(L, fn, "argument #6 (grads) must be a table or nil, got %s", luaL_typename(L, 6));
        ml_check_opts(L, 6, fn, GRAD_OPTS);
        gi = 6;
    }
    const double *aux = NULL;
    if (gi && field(L, gi, "aux")) {
        ml_tensor *a = opt_tensor(L, fn, "aux");
        check_vector(L, fn, "grads.aux", a, E, 1, o.dev);
        aux = ml_data(a);
    } else {
        lua_pop(L, gi ? 1 : 0);
    }
    double gz = 0;
    if (gi && field(L, gi, "z")) {
        if (lua_type(L, -1) != LUA_TNUMBER)
            ml_error(L, fn, "grads.z must be a number, got %s", luaL_typename(L, -1));
        gz = lua_tonumber(L, -1);
        if (!isfinite(gz))
            ml_error(L, fn, "grads.z must be finite, got %g", gz);
    }
    lua_pop(L, gi ? 1 : 0);

    int64_t sxd[2] = {T, D}, swd[2] = {E, D};
    ml_tensor *dx = grad_matrix(L, gi, fn, "dx", x->dtype, T, D, o.dev);
    if (!dx)
        dx = ml_newzeros(L, fn, o.dev, o.pool_idx, x->dtype, 2, sxd);
    int idx_dx = lua_gettop(L);
    ml_tensor *dwg = grad_matrix(L, gi, fn, "dwg", x->dtype, E, D, o.dev);
    if (!dwg)
        dwg = ml_newzeros(L, fn, o.dev, o.pool_idx, x->dtype, 2, swd);
    int idx_dwg = lua_gettop(L);
    if (dx->st == x->st || dwg->st == wg->st || dx->st == dwg->st)
        ml_error(L, fn, "grads.dx and grads.dwg must not share storage with x, wg or each other");

    ml_pool_scratch sc;
    void *buf = ml_pool_scratch_acquire(L, fn, "the router scratch", o.dev, o.pool_idx,
                                        ml_router_scratch_bytes(T, D, E, o.cfg.chunk, 1), &sc);
    ml_kctx ctx = ml_kctx_of(ml_host_of(L));
    ml_status st = ML_KCALL(o.h, o.dev, router_backward, x->dtype, ml_data(dx), ml_data(dwg), ip, ml_data(dw), aux, gz,
                                          ml_data(x), ml_data(wg), T, D, E, &o.cfg, buf, &ctx);
    ml_pool_scratch_release(&sc);
    check_router_status(L, fn, st);
    lua_pushvalue(L, idx_dx);
    lua_pushvalue(L, idx_dwg);
    return 2;
}

/* router.update_bias(bias, counts, gamma) -> bias */
static int l_router_update_bias(lua_State *L)
{
    static const char fn[] = "moelua.router.update_bias";
    lua_settop(L, 3);
    ml_tensor *b = ml_checktensor(L, 1, fn);
    ml_tensor *c = ml_checktensor(L, 2, fn);
    if (b->ndim != 1)
        ml_error(L, fn, "argument #1 (bias) must be 1-dim [E], got %d dims", b->ndim);
    int64_t E = b->shape[0];
    ml_device dev = b->st->device;
    ml_check_device(L, fn, dev);
    check_vector(L, fn, "argument #1 (bias)", b, E, 0, dev);
    char sb[64], sc[64];
    ml_format_shape(b, sb, sizeof sb);
    ml_format_shape(c, sc, sizeof sc);
    check_device(L, fn, "argument #2 (counts)", c, dev);
    if (c->dtype != ML_I64)
        ml_error(L, fn, "argument #2 (counts) must be i64, got %s", ml_dtype_names[c->dtype]);
    if (c->ndim != 1 || c->shape[0] != E)
        ml_error(L, fn, "bias is %s but counts is %s (one count per expert)", sb, sc);
    if (!ml_is_contiguous(c))
        ml_error(L, fn, "argument #2 (counts) must be contiguous");
    if (lua_type(L, 3) != LUA_TNUMBER)
        ml_error(L, fn, "argument #3 (gamma) must be a number, got %s", luaL_typename(L, 3));
    double gamma = lua_tonumber(L, 3);
    if (!isfinite(gamma) || gamma < 0)
        ml_error(L, fn, "argument #3 (gamma) must be finite and >= 0, got %g", gamma);
    ml_host *h = ml_host_of(L);
    ml_kctx ctx = ml_kctx_of(h);
    ml_check_status(L, fn, ML_KCALL(h, dev, router_update_bias, b->dtype, ml_data(b), ml_data(c), E, gamma, &ctx));
    lua_settop(L, 1);
    return 1;
}

/* router.scratch_bytes(T, D, E, chunk [, backward]) -> bytes */
static int l_router_scratch_bytes(lua_State *L)
{
    static const char fn[] = "moelua.router.scratch_bytes";
    static const char *const names[] = {"T", "D", "E", "chunk"};
    int64_t v[4];
    for (int i = 0; i < 4; i++) {
        int isint = 0;
        lua_Integer n = lua_tointegerx(L, i + 1, &isint);
        if (!isint || lua_type(L, i + 1) != LUA_TNUMBER)
            ml_error(L, fn, "argument #%d (%s) must be an integer, got %s", i + 1, names[i],
                     luaL_typename(L, i + 1));
        if (n < (i == 3 ? 1 : 0) || n > ((int64_t)1 << 40))
            ml_error(L, fn, "argument #%d (%s) is out of range: %lld", i + 1, names[i], (long long)n);
        v[i] = n;
    }
    if (!lua_isnoneornil(L, 5) && lua_type(L, 5) != LUA_TBOOLEAN)
        ml_error(L, fn, "argument #5 (backward) must be a boolean, got %s", luaL_typename(L, 5));
    lua_pushinteger(L, (lua_Integer)ml_router_scratch_bytes(v[0], v[1], v[2], v[3], lua_toboolean(L, 5)));
    return 1;
}

static const luaL_Reg router_functions[] = {
    {"forward", l_router_forward},
    {"backward", l_router_backward},
    {"update_bias", l_router_update_bias},
    {"scratch_bytes", l_router_scratch_bytes},
    {NULL, NULL}
};

int luaopen_moelua_router(lua_State *L)
{
    ml_host_of(L);  /* refuse to load outside the host */
    luaL_requiref(L, "moelua.tensor", luaopen_moelua_tensor, 0);
    lua_pop(L, 1);
    luaL_newlib(L, router_functions);
    return 1;
}
