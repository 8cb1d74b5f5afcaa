/*
 * tests/c/test_ops_moe.c - the MoE layer's ops (host/runtime/ops_moe.c)
 * from C, with no Lua state, on a host built by ml_host_init (CPU, f64),
 * printing TAP.
 *
 * Covers: routing 6 tokens over E = 4 experts (k = 2) with a gate set by
 * hand so the top-2 is known; dispatch; the experts forward against a
 * SwiGLU computed here; the backward against a finite difference; the same
 * route with a pool (scratch given back, outputs kept); a refused argument
 * (status, message, nothing allocated); per-expert capacities, pack and
 * unpack of the plan's rows per token and per assignment; the experts
 * given as pointer tables in reverse order with NULL for experts without
 * rows, bitwise the tensors' results (E = 4 and E = 70, past the ops' stack
 * tables); one layer's experts run a subset per call (random routing,
 * with and without drops, every save mode), bitwise one call, and the
 * subset calls' bad input; the ledger back to zero. Not here:
 * the Lua bindings (tests/spec/router_spec.lua, experts_spec.lua).
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "ops_moe.h"
#include "tap.h"

enum { T = 6, D = 4, E = 4, K = 2, F = 2 };

static volatile sig_atomic_t no_interrupt;

/* A new f64 tensor [dims...] filled from v (NULL: f(i)). */
static void mk(ml_host *h, ml_tensor *t, int ndim, const int64_t *dims, const double *v,
               double (*f)(int))
{
    ml_err e;
    memset(t, 0, sizeof *t);
    if (ml_tensor_alloc(h, t, ML_CPU, ML_F64, ndim, dims, &e) != ML_OK) {
        printf("Bail out! %s\n", e.msg);
        return;
    }
    double *p = ml_data(t);
    for (int64_t i = 0; i < ml_numel(t); i++)
        p[i] = v ? v[i] : f((int)i);
}

static double weight(int i) { return 0.5 * sin(0.7 * i + 0.3); }
static double grad_y(int i) { return 0.25 * cos(0.9 * i) + 0.1; }

/* Each row's top two (expert 0..3) from a gate wg = 2·I: the largest x. */
static const double X[T * D] = {3, 2, 0, -1,   0, 1, 3, 2,   2, -1, 0, 3,
                                -1, 3, 2, 0,   1, 0, -2, 2,  0, 2, 1, -3};
static const int64_t TOP2[T * K] = {0, 1, 2, 3, 3, 0, 1, 2, 3, 0, 1, 2};

typedef struct {
    ml_tensor x, wg, idx, w, counts, psum, off, order, cnt, drop, gu, dn;
    ml_router_stats st;
    ml_dispatch_plan plan;
    ml_router_cfg rc;
} moe;

static double silu(double g) { return g / (1 + exp(-g)); }

/* y[t] = sum_j w[t,j] · down[e] (silu(W1 x) * W3 x), e = idx[t,j]. */
static void swiglu_row(const moe *m, int t, double *y)
{
    const double *x = (const double *)ml_data(&m->x) + t * D, *gu = ml_data(&m->gu);
    const double *dn = ml_data(&m->dn), *w = ml_data(&m->w);
    const int64_t *idx = ml_data(&m->idx);
    for (int d = 0; d < D; d++)
        y[d] = 0;
    for (int j = 0; j < K; j++) {
        int64_t ex = idx[t * K + j];
        double a[F];
        for (int f = 0; f < F; f++) {
            double g = 0, u = 0;
            for (int d = 0; d < D; d++) {
                g += gu[(ex * 2 * F + f) * D + d] * x[d];
                u += gu[(ex * 2 * F + F + f) * D + d] * x[d];
            }
            a[f] = silu(g) * u;
        }
        for (int d = 0; d < D; d++)
            for (int f = 0; f < F; f++)
                y[d] += w[t * K + j] * dn[(ex * D + d) * F + f] * a[f];
    }
}

/* sum_t,d dy · y of one forward with the current weights. */
static double loss(ml_host *h, moe *m, const ml_tensor *dy, ml_experts_cfg *c)
{
    ml_tensor y = {0}, hs = {0};
    ml_err e;
    double L = NAN;
    if (ml_op_experts_forward(h, &y, &hs, &m->x, &m->gu, &m->dn, &m->idx, &m->w, &m->plan, c,
                              NULL, &e) == ML_OK) {
        L = 0;
        for (int i = 0; i < T * D; i++)
            L += ((double *)ml_data(dy))[i] * ((double *)ml_data(&y))[i];
    }
    ml_tensor_drop(&y);
    ml_tensor_drop(&hs);
    return L;
}

static void test_route_dispatch_experts(ml_host *h)
{
    moe m;
    memset(&m, 0, sizeof m);
    int64_t xd[2] = {T, D}, wgd[2] = {E, D}, gud[3] = {E, 2 * F, D}, dnd[3] = {E, D, F};
    double gate[E * D] = {0};
    for (int e = 0; e < E; e++)
        gate[e * D + e] = 2;
    mk(h, &m.x, 2, xd, X, NULL);
    mk(h, &m.wg, 2, wgd, gate, NULL);
    m.rc = (ml_router_cfg){.k = K, .chunk = 4, .mode = ML_ROUTER_SOFTMAX_TOPK, .renorm = 1,
                           .temperature = 1};
    m.st = (ml_router_stats){.counts = &m.counts, .psum = &m.psum};
    ml_err e;
    ml_status s = ml_op_router_forward(h, &m.idx, &m.w, &m.st, &m.x, &m.wg, &m.rc, NULL, NULL, &e);
    ok(s == ML_OK, "router forward: %s", s == ML_OK ? "ok" : e.msg);
    ok(memcmp(ml_data(&m.idx), TOP2, sizeof TOP2) == 0, "router forward: the known top-2 per token");
    double w00 = ((double *)ml_data(&m.w))[0];
    ok(fabs(w00 - 1 / (1 + exp(-2.0))) < 1e-14, "router forward: renormalised weight %.17g", w00);
    const int64_t *cnt = ml_data(&m.counts);
    ok(cnt[0] == 3 && cnt[1] == 3 && cnt[2] == 3 && cnt[3] == 3 && m.st.max_count == 3,
       "router forward: counts 3 per expert, max_count 3");
    double psum = 0;
    for (int i = 0; i < E; i++)
        psum += ((double *)ml_data(&m.psum))[i];
    ok(fabs(psum - T) < 1e-12 && fabs(m.st.cp - 3 * psum) < 1e-12, "router forward: psum and cp");

    m.plan = (ml_dispatch_plan){&m.off, &m.order, &m.cnt, &m.drop, -1};
    s = ml_op_dispatch(h, &m.plan, &m.idx, E, -1, NULL, &e);
    const int64_t *off = ml_data(&m.off);
    ok(s == ML_OK && m.plan.ndropped == 0 && off[0] == 0 && off[1] == 3 && off[4] == T * K,
       "dispatch: dropless, 3 assignments per expert");

    mk(h, &m.gu, 3, gud, NULL, weight);
    mk(h, &m.dn, 3, dnd, NULL, weight);
    ml_experts_cfg c = {.tile = 2, .nsaved = T * K / 2};   /* tiles of 2; half of h saved */
    ml_tensor y = {0}, hs = {0}, dy;
    s = ml_op_experts_forward(h, &y, &hs, &m.x, &m.gu, &m.dn, &m.idx, &m.w, &m.plan, &c, NULL, &e);
    ok(s == ML_OK && c.T == T && c.F == F && hs.shape[0] == T * K / 2,
       "experts forward: %s", s == ML_OK ? "ok" : e.msg);
    for (int t = 0; t < T; t += 5) {
        double want[D], err = 0;
        swiglu_row(&m, t, want);
        for (int d = 0; d < D; d++)
            err = fmax(err, fabs(((double *)ml_data(&y))[t * D + d] - want[d]));
        ok(err < 1e-14, "experts forward: row %d is the SwiGLU computed here (max err %.2g)", t, err);
    }

    mk(h, &dy, 2, xd, NULL, grad_y);
    ml_tensor gt[5] = {{0}};
    ml_experts_grads g = {&gt[0], &gt[1], &gt[2], &gt[3], &gt[4]};
    s = ml_op_experts_backward(h, &g, &dy, &m.x, &m.gu, &m.dn, &m.idx, &m.w, &m.plan, &hs, &c,
                               NULL, &e);
    ok(s == ML_OK, "experts backward: %s", s == ML_OK ? "ok" : e.msg);
    /* dL/dgate_up[e=2, row F+1 (w3), d=1] by a central difference */
    double *p = (double *)ml_data(&m.gu) + (2 * 2 * F + F + 1) * D + 1, p0 = *p, eps = 1e-6;
    *p = p0 + eps;
    double lp = loss(h, &m, &dy, &c);
    *p = p0 - eps;
    double lm = loss(h, &m, &dy, &c);
    *p = p0;
    double fd = (lp - lm) / (2 * eps), an = ((double *)ml_data(&gt[1]))[p - (double *)ml_data(&m.gu)];
    ok(fabs(fd - an) <= 1e-7 * fmax(1, fabs(an)) && an != 0,
       "experts backward: dgate_up %.12g matches the finite difference %.12g", an, fd);
    const uint8_t *touched = ml_data(&gt[4]);
    ok(touched[0] && touched[1] && touched[2] && touched[3], "experts backward: every expert touched");

    /* a refused argument: a status and a message, no output allocated */
    ml_router_cfg bad = m.rc;
    bad.k = 5;
    ml_tensor idx2 = {0}, w2 = {0}, c2 = {0}, p2 = {0};
    ml_router_stats st2 = {.counts = &c2, .psum = &p2};
    s = ml_op_router_forward(h, &idx2, &w2, &st2, &m.x, &m.wg, &bad, NULL, NULL, &e);
    ok(s == ML_EINVAL && strcmp(e.msg, "k = 5 exceeds the number of experts (4)") == 0 && !idx2.st,
       "bad k: ML_EINVAL, \"%s\", nothing allocated", e.msg);
    ml_tensor wrong;
    int64_t wd[2] = {T, 3};
    mk(h, &wrong, 2, wd, NULL, weight);
    s = ml_op_experts_forward(h, &y, &hs, &m.x, &m.gu, &m.dn, &m.idx, &wrong, &m.plan, &c, NULL, &e);
    ok(s == ML_EINVAL && strcmp(e.msg, "expected w [T, k]: w [6,3] does not match idx [6,2]") == 0,
       "bad w: \"%s\"", e.msg);

    ml_tensor *all[] = {&m.x, &m.wg, &m.idx, &m.w, &m.counts, &m.psum, &m.off, &m.order, &m.cnt,
                        &m.drop, &m.gu, &m.dn, &y, &hs, &dy, &wrong, &gt[0], &gt[1], &gt[2],
                        &gt[3], &gt[4]};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++)
        ml_tensor_drop(all[i]);
}

/* Outputs in the pool, the scratch given back: the pool holds the outputs only. */
static void test_pool(ml_host *h)
{
    ml_pool *p;
    ml_alloc_status as;
    ml_pool_new(h, ML_CPU, 1 << 16, 0, &p, &as);
    ml_tensor x, wg, idx = {0}, w = {0}, counts = {0}, psum = {0};
    int64_t xd[2] = {T, D}, wgd[2] = {E, D};
    mk(h, &x, 2, xd, X, NULL);
    mk(h, &wg, 2, wgd, NULL, weight);
    size_t before = h->books[ML_CPU].total;
    ml_router_cfg rc = {.k = K, .chunk = 4, .renorm = 1, .temperature = 1};
    ml_router_stats st = {.counts = &counts, .psum = &psum};
    ml_err e;
    ml_status s = ml_op_router_forward(h, &idx, &w, &st, &x, &wg, &rc, NULL, p, &e);
    ok(s == ML_OK && idx.st->pool == p && h->books[ML_CPU].total == before,
       "pool: the outputs are pool views, nothing from the ledger");
    ok(p->nslots == 4 && p->used == 2 * 128 + 2 * 64 && p->high_water > p->used,
       "pool: the scratch slot was rewound (used %zu, high water %zu)", p->used, p->high_water);
    ml_tensor *all[] = {&x, &wg, &idx, &w, &counts, &psum};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++)
        ml_tensor_drop(all[i]);
    ml_pool_release(p);
}

/* Per-expert capacities drop the known assignments; pack and unpack move
 * the kept rows (x's small integers add exactly). */
static void test_caps_pack_unpack(ml_host *h)
{
    ml_tensor idx, caps, x, xa, rows = {0}, rowsa = {0}, out, outa;
    ml_tensor off = {0}, order = {0}, cnt = {0}, drop = {0};
    int64_t td[2] = {T, K}, ed = E, xd[2] = {T, D}, ad[2] = {T * K, 1};
    ml_err e;
    memset(&idx, 0, sizeof idx);
    memset(&caps, 0, sizeof caps);
    ml_tensor_alloc(h, &idx, ML_CPU, ML_I64, 2, td, &e);
    ml_tensor_alloc(h, &caps, ML_CPU, ML_I64, 1, &ed, &e);
    memcpy(ml_data(&idx), TOP2, sizeof TOP2);
    const int64_t cap[E] = {2, 3, 3, 1};   /* every expert has 3 assignments: 1 + 2 dropped */
    memcpy(ml_data(&caps), cap, sizeof cap);
    ml_dispatch_plan plan = {&off, &order, &cnt, &drop, -1};
    ml_status s = ml_op_dispatch_caps(h, &plan, &idx, E, &caps, NULL, &e);
    const int64_t *o = ml_data(&order), *of = ml_data(&off);
    const uint8_t *dr = ml_data(&drop);
    /* expert 0's assignments are 0, 5, 9 (keeps 0, 5); expert 3's 3, 4, 8 (keeps 3) */
    ok(s == ML_OK && plan.ndropped == 3 && of[1] == 2 && of[4] == 9 && dr[9] && dr[4] && dr[8] &&
       o[9] == 4 && o[10] == 8 && o[11] == 9, "dispatch caps: the first caps[e] kept, 3 dropped in "
       "(t, j) order: %s", s == ML_OK ? "ok" : e.msg);

    int64_t kept = T * K - plan.ndropped;
    mk(h, &x, 2, xd, X, NULL);
    s = ml_op_dispatch_pack(h, &rows, &x, &plan, K, NULL, &e);
    int same = s == ML_OK && rows.shape[0] == kept && rows.shape[1] == D;
    for (int64_t p = 0; same && p < kept; p++)
        same = memcmp((double *)ml_data(&rows) + p * D, X + o[p] / K * D, D * sizeof(double)) == 0;
    ok(same, "pack per token: row p is x[order[p] / k] (%s)", s == ML_OK ? "ok" : e.msg);

    mk(h, &out, 2, xd, NULL, weight);
    double before[T * D];
    memcpy(before, ml_data(&out), sizeof before);
    s = ml_op_dispatch_unpack(h, &out, &rows, &plan, K, NULL, &e);
    double err = s == ML_OK ? 0 : INFINITY;
    for (int t = 0; t < T; t++)
        for (int d = 0; d < D; d++) {
            double want = before[t * D + d];
            for (int j = 0; j < K; j++)   /* the token's kept slots, ascending expert */
                want += dr[t * K + j] ? 0 : X[t * D + d];
            err = fmax(err, fabs(((double *)ml_data(&out))[t * D + d] - want));
        }
    ok(err < 1e-15, "unpack per token: out += x once per kept slot (max err %.2g)", err);

    double av[T * K];
    for (int a = 0; a < T * K; a++)
        av[a] = a;
    const double zero_a[T * K] = {0};
    mk(h, &xa, 2, ad, av, NULL);
    mk(h, &outa, 2, ad, zero_a, NULL);
    s = ml_op_dispatch_pack(h, &rowsa, &xa, &plan, K, NULL, &e);
    if (s == ML_OK)
        s = ml_op_dispatch_unpack(h, &outa, &rowsa, &plan, K, NULL, &e);
    same = s == ML_OK;
    for (int a = 0; same && a < T * K; a++)
        same = ((double *)ml_data(&outa))[a] == (dr[a] ? 0 : a);
    ok(same, "pack then unpack per assignment: the kept ids back in place, 0 where dropped (%s)",
       s == ML_OK ? "ok" : e.msg);

    ml_tensor short_rows;
    int64_t sd[2] = {kept - 1, D};
    mk(h, &short_rows, 2, sd, NULL, weight);
    s = ml_op_dispatch_unpack(h, &out, &short_rows, &plan, K, NULL, &e);
    ok(s == ML_EINVAL && strcmp(e.msg, "rows is [8,4] but must be [kept, C] = [9, 4] (the plan "
                                "keeps 9 of T·k = 12 assignments)") == 0, "unpack: \"%s\"", e.msg);

    ml_tensor *all[] = {&idx, &caps, &x, &xa, &rows, &rowsa, &out, &outa, &off, &order, &cnt,
                        &drop, &short_rows};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++)
        ml_tensor_drop(all[i]);
}

static double zero(int i) { (void)i; return 0; }

/* The table ops on experts stored in reverse order, the entries of
 * experts without rows NULL (a cache slot holding a subset): y, saved h
 * and every gradient bitwise those of the tensor ops. */
enum { TABLE_MAX = 128 };
static void test_table(ml_host *h, int64_t nE)
{
    int64_t td[2] = {T, K}, xd[2] = {T, D}, gud[3] = {nE, 2 * F, D}, dnd[3] = {nE, D, F};
    const int64_t sgu = 2 * F * D, sdn = D * F;
    ml_tensor x, w, idx = {0}, gu, dn, rgu, rdgu, rdn, rddn, dy;
    ml_tensor off = {0}, order = {0}, cnt = {0}, drop = {0};
    ml_err e;
    ml_tensor_alloc(h, &idx, ML_CPU, ML_I64, 2, td, &e);
    for (int64_t a = 0; a < T * K; a++)   /* two distinct experts per token, the last never */
        ((int64_t *)ml_data(&idx))[a] = (a / K * 7 + a % K) % (nE - 1);
    mk(h, &x, 2, xd, X, NULL);
    mk(h, &w, 2, td, NULL, weight);
    mk(h, &gu, 3, gud, NULL, weight);
    mk(h, &dn, 3, dnd, NULL, grad_y);
    mk(h, &dy, 2, xd, NULL, grad_y);
    ml_dispatch_plan plan = {&off, &order, &cnt, &drop, -1};
    ml_status s = ml_op_dispatch(h, &plan, &idx, nE, -1, NULL, &e);

    ml_experts_cfg c = {.tile = 2, .nsaved = T * K / 2};
    ml_tensor y = {0}, hs = {0}, gt[5] = {{0}};
    ml_experts_grads g = {&gt[0], &gt[1], &gt[2], &gt[3], &gt[4]};
    if (s == ML_OK)
        s = ml_op_experts_forward(h, &y, &hs, &x, &gu, &dn, &idx, &w, &plan, &c, NULL, &e);
    if (s == ML_OK)
        s = ml_op_experts_backward(h, &g, &dy, &x, &gu, &dn, &idx, &w, &plan, &hs, &c, NULL, &e);
    ok(s == ML_OK, "table E = %lld: the tensor ops (%s)", (long long)nE, s == ML_OK ? "ok" : e.msg);

    /* expert i in slot nE-1-i of the reversed buffers, NULL when it has no rows */
    mk(h, &rgu, 3, gud, NULL, zero);
    mk(h, &rdn, 3, dnd, NULL, zero);
    mk(h, &rdgu, 3, gud, NULL, zero);
    mk(h, &rddn, 3, dnd, NULL, zero);
    const void *pgu[TABLE_MAX], *pdn[TABLE_MAX];
    void *pdgu[TABLE_MAX], *pddn[TABLE_MAX];
    const int64_t *of = ml_data(&off);
    for (int64_t i = 0; i < nE; i++) {
        int64_t r = nE - 1 - i;
        double *bgu = (double *)ml_data(&rgu) + r * sgu, *bdn = (double *)ml_data(&rdn) + r * sdn;
        memcpy(bgu, (double *)ml_data(&gu) + i * sgu, sgu * sizeof(double));
        memcpy(bdn, (double *)ml_data(&dn) + i * sdn, sdn * sizeof(double));
        int rows = of[i + 1] > of[i];
        pgu[i] = rows ? bgu : NULL;
        pdn[i] = rows ? bdn : NULL;
        pdgu[i] = rows ? (double *)ml_data(&rdgu) + r * sgu : NULL;
        pddn[i] = rows ? (double *)ml_data(&rddn) + r * sdn : NULL;
    }
    ml_experts_table tab = {{pgu, pdn}, nE, F, D, ML_F64, ML_CPU};
    ml_experts_wgrads gw = {pdgu, pddn};
    ml_experts_cfg c2 = {.tile = 2, .nsaved = T * K / 2};
    ml_tensor y2 = {0}, hs2 = {0}, gt2[3] = {{0}};
    ml_experts_grads g2 = {&gt2[0], NULL, NULL, &gt2[1], &gt2[2]};
    s = ml_op_experts_forward_table(h, &y2, &hs2, &x, &tab, &idx, &w, &plan, &c2, NULL, &e);
    if (s == ML_OK)
        s = ml_op_experts_backward_table(h, &g2, &gw, &dy, &x, &tab, &idx, &w, &plan, &hs2, &c2,
                                         NULL, &e);
    ok(s == ML_OK && c2.E == nE && c2.F == F, "table E = %lld: the table ops (%s)", (long long)nE,
       s == ML_OK ? "ok" : e.msg);
    int same = s == ML_OK && memcmp(ml_data(&y), ml_data(&y2), ml_nbytes(&y)) == 0 &&
               memcmp(ml_data(&hs), ml_data(&hs2), ml_nbytes(&hs)) == 0;
    ok(same, "table E = %lld: y and saved h bitwise the tensors'", (long long)nE);
    same = s == ML_OK && memcmp(ml_data(&gt[0]), ml_data(&gt2[0]), ml_nbytes(&gt[0])) == 0 &&
           memcmp(ml_data(&gt[3]), ml_data(&gt2[1]), ml_nbytes(&gt[3])) == 0 &&
           memcmp(ml_data(&gt[4]), ml_data(&gt2[2]), ml_nbytes(&gt[4])) == 0;
    ok(same, "table E = %lld: dx, dw and touched bitwise the tensors'", (long long)nE);
    int nrows = 0;
    for (int64_t i = 0; same && i < nE; i++) {
        int64_t r = nE - 1 - i;
        nrows += of[i + 1] > of[i];
        same = memcmp((double *)ml_data(&gt[1]) + i * sgu, (double *)ml_data(&rdgu) + r * sgu,
                      sgu * sizeof(double)) == 0 &&
               memcmp((double *)ml_data(&gt[2]) + i * sdn, (double *)ml_data(&rddn) + r * sdn,
                      sdn * sizeof(double)) == 0;
    }
    ok(same && nrows < nE, "table E = %lld: each expert's gradients bitwise in its slot, the %lld "
       "without rows untouched", (long long)nE, (long long)(nE - nrows));

    ml_tensor *all[] = {&x, &w, &idx, &gu, &dn, &rgu, &rdgu, &rdn, &rddn, &dy, &off, &order, &cnt,
                        &drop, &y, &hs, &gt[0], &gt[1], &gt[2], &gt[3], &gt[4], &y2, &hs2, &gt2[0],
                        &gt2[1], &gt2[2]};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++)
        ml_tensor_drop(all[i]);
}

/* One layer's experts run over several calls, a subset per call (the
 * expert store's cache slots): each expert's weights and gradients in
 * buffers of their own, the other experts' entries NULL, the first call
 * with cfg.accumulate = 0 and the rest with 1. y, saved h, dx, dw,
 * touched and every expert's gradients are bitwise one tensor call's, for
 * a random routing with and without drops, in every save mode; an expert
 * not yet run keeps its gradient buffers' sentinel bit for bit. */
enum { ST = 37, SK = 2, SE = 4, SD = 6, SF = 5 };

static uint64_t lcg = 12345;
static int64_t lcg_next(int64_t n)
{
    lcg = lcg * 6364136223846793005ULL + 1442695040888963407ULL;
    return (int64_t)((lcg >> 33) % (uint64_t)n);
}

static double sentinel(int i) { (void)i; return 0.5; }
static double xval(int i) { return sin(1.3 * i + 0.2); }
static double guval(int i) { return 0.4 * cos(0.37 * i + 0.1); }

typedef struct {
    ml_tensor y, hs, dx, dw, touched;
} layer_out;

static void drop_out(layer_out *o)
{
    ml_tensor *all[] = {&o->y, &o->hs, &o->dx, &o->dw, &o->touched};
    for (int i = 0; i < 5; i++)
        ml_tensor_drop(all[i]);
}

static int same_bytes(const ml_tensor *a, const ml_tensor *b)
{
    return ml_nbytes(a) == ml_nbytes(b) && memcmp(ml_data(a), ml_data(b), ml_nbytes(a)) == 0;
}

static int all_sentinel(const ml_tensor *t)
{
    for (int64_t i = 0; i < ml_numel(t); i++)
        if (((double *)ml_data(t))[i] != 0.5)
            return 0;
    return 1;
}

/* The rows of saved h that forward wrote: those of tiles (of `tile` rows
 * within each expert) lying below S; the others are never written. */
static int same_saved_h(const ml_tensor *a, const ml_tensor *b, const ml_tensor *offsets,
                        int64_t E, int64_t tile, int64_t S)
{
    const int64_t *of = ml_data(offsets);
    size_t row = ml_nbytes(a) / (size_t)S;
    for (int64_t e = 0; e < E; e++)
        for (int64_t p0 = of[e]; p0 < of[e + 1]; p0 += tile) {
            int64_t r = of[e + 1] - p0 < tile ? of[e + 1] - p0 : tile;
            if (p0 + r <= S && memcmp((char *)ml_data(a) + p0 * row, (char *)ml_data(b) + p0 * row,
                                      (size_t)r * row) != 0)
                return 0;
        }
    return 1;
}

static void test_subsets(ml_host *h)
{
    int64_t td[2] = {ST, SK}, xd[2] = {ST, SD}, gud[3] = {SE, 2 * SF, SD}, dnd[3] = {SE, SD, SF};
    int64_t gu1[2] = {2 * SF, SD}, dn1[2] = {SD, SF};
    const int64_t sgu = 2 * SF * SD, sdn = SD * SF;
    ml_tensor x, w, idx = {0}, gu, dn, dy, pgu[SE], pdn[SE];
    ml_err e;
    ml_tensor_alloc(h, &idx, ML_CPU, ML_I64, 2, td, &e);
    for (int64_t t = 0; t < ST; t++) {   /* two distinct random experts per token */
        int64_t a = lcg_next(SE), b = (a + 1 + lcg_next(SE - 1)) % SE;
        ((int64_t *)ml_data(&idx))[t * SK] = a;
        ((int64_t *)ml_data(&idx))[t * SK + 1] = b;
    }
    mk(h, &x, 2, xd, NULL, xval);
    mk(h, &w, 2, td, NULL, weight);
    mk(h, &gu, 3, gud, NULL, guval);
    mk(h, &dn, 3, dnd, NULL, weight);
    mk(h, &dy, 2, xd, NULL, grad_y);
    for (int i = 0; i < SE; i++) {   /* each expert copied into buffers of its own */
        mk(h, &pgu[i], 2, gu1, (double *)ml_data(&gu) + i * sgu, NULL);
        mk(h, &pdn[i], 2, dn1, (double *)ml_data(&dn) + i * sdn, NULL);
    }
    static const int groups[2][SE + 1] = {{0, 2, 4}, {0, 1, 2, 3, 4}};   /* subset bounds */
    static const int ngroups[2] = {2, 4};
    for (int drop = 0; drop < 2; drop++) {
        ml_tensor off = {0}, order = {0}, cnt = {0}, dropped = {0};
        ml_dispatch_plan plan = {&off, &order, &cnt, &dropped, -1};
        ml_status s = ml_op_dispatch(h, &plan, &idx, SE, drop ? 15 : -1, NULL, &e);
        ok(s == ML_OK && (plan.ndropped > 0) == drop, "subsets: plan %s (%lld dropped)",
           drop ? "with capacity 15" : "dropless", (long long)plan.ndropped);
        const int64_t saves[3] = {ST * SK, 0, ST * SK * 37 / 100};
        for (int m = 0; m < 3; m++) {
            ml_experts_cfg c = {.tile = 5, .nsaved = saves[m]};
            layer_out ref;
            memset(&ref, 0, sizeof ref);
            ml_tensor rdgu, rddn;
            mk(h, &ref.dx, 2, xd, NULL, sentinel);
            mk(h, &rdgu, 3, gud, NULL, sentinel);
            mk(h, &rddn, 3, dnd, NULL, sentinel);
            ml_experts_grads rg = {&ref.dx, &rdgu, &rddn, &ref.dw, &ref.touched};
            s = ml_op_experts_forward(h, &ref.y, &ref.hs, &x, &gu, &dn, &idx, &w, &plan, &c, NULL,
                                      &e);
            if (s == ML_OK)
                s = ml_op_experts_backward(h, &rg, &dy, &x, &gu, &dn, &idx, &w, &plan, &ref.hs, &c,
                                           NULL, &e);
            ok(s == ML_OK, "subsets drop %d S %lld: one call (%s)", drop, (long long)saves[m],
               s == ML_OK ? "ok" : e.msg);
            for (int gi = 0; gi < 2; gi++) {
                layer_out o;
                memset(&o, 0, sizeof o);
                ml_tensor dgu[SE], ddn[SE];
                mk(h, &o.dx, 2, xd, NULL, sentinel);
                for (int i = 0; i < SE; i++) {
                    mk(h, &dgu[i], 2, gu1, NULL, sentinel);
                    mk(h, &ddn[i], 2, dn1, NULL, sentinel);
                }
                int untouched = 1;
                for (int pass = 0; pass < 2 && s == ML_OK; pass++)   /* forward, then backward */
                    for (int k = 0; k < ngroups[gi] && s == ML_OK; k++) {
                        const ml_tensor *wgu[SE] = {0}, *wdn[SE] = {0};
                        ml_tensor *ggu[SE] = {0}, *gdn[SE] = {0};
                        for (int i = groups[gi][k]; i < groups[gi][k + 1]; i++) {
                            wgu[i] = &pgu[i];
                            wdn[i] = &pdn[i];
                            ggu[i] = &dgu[i];
                            gdn[i] = &ddn[i];
                        }
                        const void *wp[2 * SE];
                        void *gp[2 * SE];
                        ml_experts_table t;
                        ml_experts_wgrads gw;
                        ml_experts_cfg cs = {.tile = 5, .nsaved = saves[m], .accumulate = k > 0};
                        ml_experts_grads g = {&o.dx, NULL, NULL, &o.dw, &o.touched};
                        s = ml_op_experts_tabulate(&t, wp, wgu, wdn, SE, &x, &e);
                        if (s == ML_OK && pass == 0)
                            s = ml_op_experts_forward_table(h, &o.y, &o.hs, &x, &t, &idx, &w,
                                                            &plan, &cs, NULL, &e);
                        if (s == ML_OK && pass == 1)
                            s = ml_op_experts_tabulate_grads(&gw, gp, ggu, gdn, &t, &e);
                        if (s == ML_OK && pass == 1)
                            s = ml_op_experts_backward_table(h, &g, &gw, &dy, &x, &t, &idx, &w,
                                                             &plan, &o.hs, &cs, NULL, &e);
                        for (int i = groups[gi][k + 1]; pass == 1 && i < SE; i++)
                            untouched &= all_sentinel(&dgu[i]) && all_sentinel(&ddn[i]);
                    }
                int same = s == ML_OK && same_bytes(&o.y, &ref.y) && same_bytes(&o.dx, &ref.dx) &&
                           same_bytes(&o.dw, &ref.dw) && same_bytes(&o.touched, &ref.touched) &&
                           (saves[m] == 0 || same_saved_h(&o.hs, &ref.hs, &off, SE, 5, saves[m]));
                for (int i = 0; same && i < SE; i++)
                    same = memcmp(ml_data(&dgu[i]), (double *)ml_data(&rdgu) + i * sgu,
                                  (size_t)sgu * sizeof(double)) == 0 &&
                           memcmp(ml_data(&ddn[i]), (double *)ml_data(&rddn) + i * sdn,
                                  (size_t)sdn * sizeof(double)) == 0;
                ok(same, "subsets drop %d S %lld, %d calls: y, h, dx, dw, touched and every "
                   "expert's gradients bitwise one call's (%s)", drop, (long long)saves[m],
                   ngroups[gi], s == ML_OK ? "ok" : e.msg);
                ok(untouched, "subsets drop %d S %lld, %d calls: experts not yet run keep their "
                   "gradients' sentinel", drop, (long long)saves[m], ngroups[gi]);
                drop_out(&o);
                for (int i = 0; i < SE; i++) {
                    ml_tensor_drop(&dgu[i]);
                    ml_tensor_drop(&ddn[i]);
                }
            }
            drop_out(&ref);
            ml_tensor_drop(&rdgu);
            ml_tensor_drop(&rddn);
        }

        if (drop) {   /* bad input */
            const ml_tensor *wgu[SE] = {&pgu[0], &pgu[1], NULL, NULL};
            const ml_tensor *wdn[SE] = {&pdn[0], NULL, NULL, NULL};
            const void *wp[2 * SE];
            void *gp[2 * SE];
            ml_experts_table t;
            ml_experts_wgrads gw;
            s = ml_op_experts_tabulate(&t, wp, wgu, wdn, SE, &x, &e);
            ok(s == ML_EINVAL && strcmp(e.msg, "expert 1 has gate_up but no down (both or "
                                        "neither: neither skips it)") == 0,
               "subsets: \"%s\"", e.msg);
            wdn[1] = &pdn[1];
            wgu[1] = &pdn[1];
            s = ml_op_experts_tabulate(&t, wp, wgu, wdn, SE, &x, &e);
            ok(s == ML_EINVAL && strcmp(e.msg, "gate_up of expert 1: expected shape [10,6], got "
                                        "[6,5]") == 0, "subsets: \"%s\"", e.msg);
            wgu[1] = &pgu[1];
            s = ml_op_experts_tabulate(&t, wp, wgu, wdn, SE, &x, &e);
            ml_tensor *ggu[SE] = {&pgu[2], NULL, NULL, NULL}, *gdn[SE] = {&pdn[2], &pdn[3], 0, 0};
            if (s == ML_OK)
                s = ml_op_experts_tabulate_grads(&gw, gp, ggu, gdn, &t, &e);
            ok(s == ML_EINVAL && strcmp(e.msg, "dgate_up of expert 1: missing, but the expert "
                                        "runs (its weights are given)") == 0, "subsets: \"%s\"",
               e.msg);
            ml_experts_cfg cs = {.tile = 5, .accumulate = 1};
            ml_tensor y = {0}, hs = {0};
            s = ml_op_experts_forward_table(h, &y, &hs, &x, &t, &idx, &w, &plan, &cs, NULL, &e);
            ok(s == ML_EINVAL && !y.st && strcmp(e.msg, "y: expected a given [T, D] tensor "
                                                 "(an accumulating call adds into it)") == 0,
               "subsets: \"%s\"", e.msg);
            ml_tensor dx = {0}, dw = {0}, touched = {0};
            ml_experts_grads g = {&dx, NULL, NULL, &dw, &touched};
            ggu[1] = &pgu[3];
            gw = (ml_experts_wgrads){0};
            s = ml_op_experts_tabulate_grads(&gw, gp, ggu, gdn, &t, &e);
            if (s == ML_OK)
                s = ml_op_experts_backward_table(h, &g, &gw, &dy, &x, &t, &idx, &w, &plan, &hs,
                                                 &cs, NULL, &e);
            ok(s == ML_EINVAL && !dx.st && strcmp(e.msg, "grads.dw: expected a given tensor "
                                                  "(an accumulating call keeps the earlier calls' "
                                                  "entries)") == 0, "subsets: \"%s\"", e.msg);
            const void *half[2 * SE] = {wp[0], wp[1], NULL, NULL, wp[4], NULL, NULL, NULL};
            ml_experts_table bad = {{half, half + SE}, SE, SF, SD, ML_F64, ML_CPU};
            cs.accumulate = 0;
            s = ml_op_experts_forward_table(h, &y, &hs, &x, &bad, &idx, &w, &plan, &cs, NULL, &e);
            ok(s == ML_EINVAL && !y.st && strcmp(e.msg, "table: expert 1 has gate_up but no down "
                                                 "(both or neither: NULL skips it)") == 0,
               "subsets: \"%s\"", e.msg);
        }
        ml_tensor *pl[] = {&off, &order, &cnt, &dropped};
        for (int i = 0; i < 4; i++)
            ml_tensor_drop(pl[i]);
    }
    ml_tensor *all[] = {&x, &w, &idx, &gu, &dn, &dy};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++)
        ml_tensor_drop(all[i]);
    for (int i = 0; i < SE; i++) {
        ml_tensor_drop(&pgu[i]);
        ml_tensor_drop(&pdn[i]);
    }
}

int main(void)
{
    ml_host h;
    ml_host_init(&h);
    h.interrupt = &no_interrupt;
    test_route_dispatch_experts(&h);
    test_pool(&h);
    test_caps_pack_unpack(&h);
    test_table(&h, E);
    test_table(&h, 70);
    test_subsets(&h);
    ok(h.books[ML_CPU].total == 0, "the ledger is back to zero (%zu bytes)", h.books[ML_CPU].total);
    ml_host_free(&h);
    return tap_done();
}
