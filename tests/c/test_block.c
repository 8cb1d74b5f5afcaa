/*
 * tests/c/test_block.c - one Mixtral decoder block, forward and backward,
 * composed in C from the op layer (host/runtime/ops_*.h) with no Lua state,
 * the way lua/moelua/nn/transformer.lua, nn/attention.lua and moe.lua
 * compose it:
 *
 *   a1 = rmsnorm1(x)
 *   h1 = x + o_proj(attention(rope(a1 Wq^T), rope(a1 Wk^T), a1 Wv^T))
 *   a2 = rmsnorm2(h1)
 *   h2 = h1 + experts(a2, router(a2))   softmax top-k, renormalised, dropless
 *   L  = sum(h2 * r)                    r a fixed random [S, D]
 *
 * f64, S = 5 tokens, D = 8, H = 2 heads over KV = 1 kv head of hd = 4,
 * E = 4 experts (k = 2) of F = 6, printing TAP. Checks: dL/dx, dL/dWq and
 * dL/dgate_up against central differences (routing unchanged by the step),
 * a refused argument, the ledger back to zero. Not here: aux and z losses,
 * pools, capacity drops, checkpointing (tests/spec, through Lua).
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "ops_math.h"
#include "ops_moe.h"
#include "ops_nn.h"
#include "ops_view.h"
#include "tap.h"

enum { S = 5, D = 8, H = 2, KV = 1, HD = 4, E = 4, K = 2, F = 6, TILE = 256 };

static const double NORM_EPS = 1e-5, THETA = 1e6;
static const uint64_t SEED = 1234;
static const ml_router_cfg ROUTER = {.k = K, .chunk = 2048, .mode = ML_ROUTER_SOFTMAX_TOPK,
                                     .renorm = 1, .temperature = 1};

/* The block's weights; their gradients have the same layout. */
enum { WQ, WK, WV, WO, NORM1, NORM2, WG, GATE_UP, DOWN, NW };
static const struct {
    const char *name;
    int ndim;
    int64_t shape[3];
    double mean, std;
} WSPEC[NW] = {
    [WQ] = {"wq", 2, {H * HD, D}, 0, 0.4},      [WK] = {"wk", 2, {KV * HD, D}, 0, 0.4},
    [WV] = {"wv", 2, {KV * HD, D}, 0, 0.4},     [WO] = {"wo", 2, {D, H * HD}, 0, 0.4},
    [NORM1] = {"norm1", 1, {D}, 1, 0.1},        [NORM2] = {"norm2", 1, {D}, 1, 0.1},
    [WG] = {"wg", 2, {E, D}, 0, 0.5},           [GATE_UP] = {"gate_up", 3, {E, 2 * F, D}, 0, 0.4},
    [DOWN] = {"down", 3, {E, D, F}, 0, 0.4},
};

/* What the forward saves. Only ml_tensors, so it is dropped as an array. */
typedef struct {
    ml_tensor a1, r1;                   /* [S, D], [S] f64: rmsnorm1 */
    ml_tensor q, k, v;                  /* [S, H*hd], [S, KV*hd], [S, KV*hd] */
    ml_tensor q3, k3, v3;               /* views [S, H, hd], [S, KV, hd], [S, KV, hd] */
    ml_tensor qr, kr;                   /* roped q3, k3 */
    ml_tensor att, lse, att2;           /* [S, H, hd], [H, S] f64, view [S, H*hd] */
    ml_tensor y1, h1;                   /* [S, D]: o_proj, residual */
    ml_tensor a2, r2;                   /* [S, D], [S] f64: rmsnorm2 */
    ml_tensor idx, w, counts, psum;     /* router: [S, k] i64, [S, k], [E] i64, [E] f64 */
    ml_tensor off, order, kept, dropped;    /* plan: [E+1], [S*k], [E] i64, [S, k] u8 */
    ml_tensor hsaved, y2, h2;           /* experts: [S*k, 2F], [S, D]; residual [S, D] */
} acts;

/* The backward's intermediates, dropped the same way. */
typedef struct {
    ml_tensor da2, dw, touched;         /* dL/da2 (experts + router), dL/dw [S, k], [E] u8 */
    ml_tensor dn2, dh1;                 /* [S, D]: rmsnorm2 backward, dL/dh1 */
    ml_tensor datt2, datt;              /* [S, H*hd] and its view [S, H, hd] */
    ml_tensor dqr, dkr, dv, dq, dk;     /* [S, H, hd], [S, KV, hd] x2; rope backward */
    ml_tensor dq2, dk2, dv2;            /* views [S, H*hd], [S, KV*hd], [S, KV*hd] */
    ml_tensor da1, dn1;                 /* [S, D]: dL/da1, rmsnorm1 backward */
} dacts;

_Static_assert(sizeof(acts) % sizeof(ml_tensor) == 0 && sizeof(dacts) % sizeof(ml_tensor) == 0,
               "acts and dacts hold ml_tensors only");

typedef struct {
    ml_tensor x, r, dx;                 /* [S, D]: input, the loss's weights, dL/dx */
    ml_tensor W[NW], G[NW];             /* weights, dL/dW (allocated by the backward) */
    acts a;
    dacts d;
} block;

static void drop(ml_tensor *t, size_t n)
{
    for (size_t i = 0; i < n; i++)
        ml_tensor_drop(&t[i]);
}

/* t = normal draws (mean, std), the next counters of the test's stream. */
static ml_status randn(ml_host *h, ml_tensor *t, int ndim, const int64_t *shape, double mean,
                       double std, uint64_t *offset, ml_err *e)
{
    ML_TRY(ml_tensor_alloc(h, t, ML_CPU, ML_F64, ndim, shape, e));
    ML_TRY(ml_op_randn(h, t, SEED, *offset, mean, std, e));
    *offset += (uint64_t)(ml_numel(t) + 3) / 4;
    return ML_OK;
}

/* y (=) = x w^T: a Linear layer, w [out, in] (nn/attention.lua's linear). */
static ml_status linear(ml_host *h, ml_tensor *y, const ml_tensor *x, const ml_tensor *w,
                        ml_err *e)
{
    ml_tensor wt = {0};
    ML_TRY(ml_op_transpose(&wt, w, 0, 1, e));
    ml_status s = ml_op_matmul(h, y, x, &wt, 1, 0, e);
    ml_tensor_drop(&wt);
    return s;
}

/* dw [out, in] (+=; allocated when empty) = dy^T x: the Linear's weight gradient. */
static ml_status linear_dw(ml_host *h, ml_tensor *dw, const ml_tensor *dy, const ml_tensor *x,
                           ml_err *e)
{
    ml_tensor dyt = {0};
    ML_TRY(ml_op_transpose(&dyt, dy, 0, 1, e));
    ml_status s = ml_op_matmul(h, dw, &dyt, x, 1, 1, e);
    ml_tensor_drop(&dyt);
    return s;
}

static ml_dispatch_plan plan_of(acts *a)
{
    return (ml_dispatch_plan){&a->off, &a->order, &a->kept, &a->dropped, 0};
}

/* a (empty) from b->x and b->W; a->h2 is the block's output. */
static ml_status forward(ml_host *h, const block *b, acts *a, ml_err *e)
{
    const ml_tensor *W = b->W;
    /* attention half */
    ML_TRY(ml_op_rmsnorm_forward(h, &a->a1, &a->r1, &b->x, &W[NORM1], NORM_EPS, e));
    ML_TRY(linear(h, &a->q, &a->a1, &W[WQ], e));
    ML_TRY(linear(h, &a->k, &a->a1, &W[WK], e));
    ML_TRY(linear(h, &a->v, &a->a1, &W[WV], e));
    ML_TRY(ml_op_view(&a->q3, &a->q, 3, (int64_t[]){S, H, HD}, e));
    ML_TRY(ml_op_view(&a->k3, &a->k, 3, (int64_t[]){S, KV, HD}, e));
    ML_TRY(ml_op_view(&a->v3, &a->v, 3, (int64_t[]){S, KV, HD}, e));
    ML_TRY(ml_op_rope_forward(h, &a->qr, &a->q3, 0, THETA, e));
    ML_TRY(ml_op_rope_forward(h, &a->kr, &a->k3, 0, THETA, e));
    ML_TRY(ml_op_attention_forward(h, &a->att, &a->lse, &a->qr, &a->kr, &a->v3, e));
    ML_TRY(ml_op_view(&a->att2, &a->att, 2, (int64_t[]){S, H * HD}, e));
    ML_TRY(linear(h, &a->y1, &a->att2, &W[WO], e));
    ML_TRY(ml_op_binary(h, &a->h1, ML_ADD, &b->x, &a->y1, e));
    /* MoE half: route, dispatch (dropless), run the experts */
    ML_TRY(ml_op_rmsnorm_forward(h, &a->a2, &a->r2, &a->h1, &W[NORM2], NORM_EPS, e));
    ml_router_stats st = {.counts = &a->counts, .psum = &a->psum};
    ML_TRY(ml_op_router_forward(h, &a->idx, &a->w, &st, &a->a2, &W[WG], &ROUTER, NULL, NULL, e));
    ml_dispatch_plan plan = plan_of(a);
    ML_TRY(ml_op_dispatch(h, &plan, &a->idx, E, -1, NULL, e));
    ml_experts_cfg ec = {.tile = TILE, .nsaved = S * K};      /* moe.lua's save = "save" */
    ML_TRY(ml_op_experts_forward(h, &a->y2, &a->hsaved, &a->a2, &W[GATE_UP], &W[DOWN], &a->idx,
                                 &a->w, &plan, &ec, NULL, e));
    return ml_op_binary(h, &a->h2, ML_ADD, &a->h1, &a->y2, e);
}

/* b->dx (=) and b->G (+=) from dL/dh2 = r, through the forward's ops in reverse. */
static ml_status backward(ml_host *h, block *b, ml_err *e)
{
    acts *a = &b->a;
    dacts *d = &b->d;
    ml_tensor *W = b->W, *G = b->G;
    /* MoE half: experts, then the router adds its part of dL/da2 (moe.lua's Layer:backward) */
    ml_dispatch_plan plan = plan_of(a);
    ml_experts_cfg ec = {.tile = TILE, .nsaved = S * K};
    ml_experts_grads xg = {&d->da2, &G[GATE_UP], &G[DOWN], &d->dw, &d->touched};
    ML_TRY(ml_op_experts_backward(h, &xg, &b->r, &a->a2, &W[GATE_UP], &W[DOWN], &a->idx, &a->w,
                                  &plan, &a->hsaved, &ec, NULL, e));
    ml_router_grads rg = {.aux = NULL, .z = 0, .dx = &d->da2, .dwg = &G[WG]};
    ML_TRY(ml_op_router_backward(h, &rg, &d->dw, &a->a2, &W[WG], &a->idx, &ROUTER, NULL, NULL, e));
    ML_TRY(ml_op_rmsnorm_backward(h, &d->dn2, &G[NORM2], &d->da2, &a->h1, &W[NORM2], &a->r2, e));
    ML_TRY(ml_op_binary(h, &d->dh1, ML_ADD, &b->r, &d->dn2, e));
    /* attention half (nn/attention.lua's backward) */
    ML_TRY(linear_dw(h, &G[WO], &d->dh1, &a->att2, e));
    ML_TRY(ml_op_matmul(h, &d->datt2, &d->dh1, &W[WO], 1, 0, e));
    ML_TRY(ml_op_view(&d->datt, &d->datt2, 3, (int64_t[]){S, H, HD}, e));
    ML_TRY(ml_op_attention_backward(h, &d->dqr, &d->dkr, &d->dv, &d->datt, &a->qr, &a->kr, &a->v3,
                                    &a->att, &a->lse, e));
    ML_TRY(ml_op_rope_backward(h, &d->dq, &d->dqr, 0, THETA, e));
    ML_TRY(ml_op_rope_backward(h, &d->dk, &d->dkr, 0, THETA, e));
    ML_TRY(ml_op_view(&d->dq2, &d->dq, 2, (int64_t[]){S, H * HD}, e));
    ML_TRY(ml_op_view(&d->dk2, &d->dk, 2, (int64_t[]){S, KV * HD}, e));
    ML_TRY(ml_op_view(&d->dv2, &d->dv, 2, (int64_t[]){S, KV * HD}, e));
    ML_TRY(linear_dw(h, &G[WQ], &d->dq2, &a->a1, e));
    ML_TRY(linear_dw(h, &G[WK], &d->dk2, &a->a1, e));
    ML_TRY(linear_dw(h, &G[WV], &d->dv2, &a->a1, e));
    ML_TRY(ml_op_matmul(h, &d->da1, &d->dq2, &W[WQ], 1, 0, e));
    ML_TRY(ml_op_matmul(h, &d->da1, &d->dk2, &W[WK], 1, 1, e));
    ML_TRY(ml_op_matmul(h, &d->da1, &d->dv2, &W[WV], 1, 1, e));
    ML_TRY(ml_op_rmsnorm_backward(h, &d->dn1, &G[NORM1], &d->da1, &b->x, &W[NORM1], &a->r1, e));
    return ml_op_binary(h, &b->dx, ML_ADD, &d->dh1, &d->dn1, e);
}

/* sum(h2 * r) */
static double loss_of(const block *b, const acts *a)
{
    const double *h2 = ml_data(&a->h2), *r = ml_data(&b->r);
    double L = 0;
    for (int i = 0; i < S * D; i++)
        L += h2[i] * r[i];
    return L;
}

/* L by a fresh forward with the current weights; *same: it routes as idx0 did. */
static double loss(ml_host *h, const block *b, const int64_t *idx0, int *same)
{
    acts a = {0};
    ml_err e;
    double L = NAN;
    if (forward(h, b, &a, &e) == ML_OK) {
        L = loss_of(b, &a);
        *same = memcmp(ml_data(&a.idx), idx0, sizeof(int64_t) * S * K) == 0;
    }
    drop((ml_tensor *)&a, sizeof a / sizeof(ml_tensor));
    return L;
}

/* The analytic dL/dp[i] in g against a central difference (eps = 1e-6). */
static void check_grad(ml_host *h, block *b, const char *name, ml_tensor *p, const ml_tensor *g,
                       int64_t i)
{
    const int64_t *idx0 = ml_data(&b->a.idx);
    double *v = (double *)ml_data(p) + i, v0 = *v, eps = 1e-6;
    int same_p = 0, same_m = 0;
    *v = v0 + eps;
    double lp = loss(h, b, idx0, &same_p);
    *v = v0 - eps;
    double lm = loss(h, b, idx0, &same_m);
    *v = v0;
    double fd = (lp - lm) / (2 * eps), an = ((const double *)ml_data(g))[i];
    double rel = fabs(an - fd) / fmax(fabs(an), fabs(fd));
    ok(same_p && same_m && rel < 1e-6, "d%s[%lld] = %.12g, finite difference %.12g "
       "(relative error %.2g, routing %s)", name, (long long)i, an, fd, rel,
       same_p && same_m ? "unchanged" : "FLIPPED");
}

int main(void)
{
    static volatile sig_atomic_t no_interrupt;
    ml_host h;
    ml_host_init(&h);
    h.interrupt = &no_interrupt;
    block b;
    memset(&b, 0, sizeof b);
    ml_err e;
    uint64_t offset = 0;
    const int64_t sd[2] = {S, D};
    ml_status s = randn(&h, &b.x, 2, sd, 0, 1, &offset, &e);
    if (s == ML_OK)
        s = randn(&h, &b.r, 2, sd, 0, 1, &offset, &e);
    for (int i = 0; i < NW && s == ML_OK; i++)
        s = randn(&h, &b.W[i], WSPEC[i].ndim, WSPEC[i].shape, WSPEC[i].mean, WSPEC[i].std,
                  &offset, &e);
    if (s == ML_OK)
        s = forward(&h, &b, &b.a, &e);
    if (s != ML_OK) {
        printf("Bail out! forward: %s\n", e.msg);
        return 1;
    }
    double L = loss_of(&b, &b.a);
    ok(b.a.h2.shape[0] == S && b.a.h2.shape[1] == D && isfinite(L),
       "forward: h2 [5,8], L = %.12g", L);
    s = backward(&h, &b, &e);
    if (s != ML_OK) {
        printf("Bail out! backward: %s\n", e.msg);
        return 1;
    }
    int all = b.dx.st != NULL;
    for (int i = 0; i < NW; i++)
        all = all && b.G[i].st && ml_numel(&b.G[i]) == ml_numel(&b.W[i]);
    ok(all, "backward: dx and a gradient for each of the 9 weights");

    /* (a) dL/dx, (b) dL/dWq and dL/dgate_up by central differences */
    for (int64_t i = 3; i < S * D; i += 17)
        check_grad(&h, &b, "x", &b.x, &b.dx, i);
    check_grad(&h, &b, "wq", &b.W[WQ], &b.G[WQ], 5);
    check_grad(&h, &b, "wq", &b.W[WQ], &b.G[WQ], 42);
    check_grad(&h, &b, "gate_up", &b.W[GATE_UP], &b.G[GATE_UP], 61);     /* expert 0, up row 1 */
    check_grad(&h, &b, "gate_up", &b.W[GATE_UP], &b.G[GATE_UP], 200);    /* expert 2, gate row 1 */

    /* (c) a refused argument: q before its view to [S, H, hd] */
    size_t before = h.books[ML_CPU].total;
    ml_tensor y = {0};
    s = ml_op_rope_forward(&h, &y, &b.a.q, 0, THETA, &e);
    ok(s == ML_EINVAL && strcmp(e.msg, "x must have 3 dims, got 2") == 0 && !y.st &&
       h.books[ML_CPU].total == before, "rope of [S, H*hd]: ML_EINVAL, \"%s\", nothing allocated",
       e.msg);

    /* (d) everything dropped, views too (each holds its storage): the ledger is back to zero */
    drop((ml_tensor *)&b.a, sizeof b.a / sizeof(ml_tensor));
    drop((ml_tensor *)&b.d, sizeof b.d / sizeof(ml_tensor));
    drop(b.W, NW);
    drop(b.G, NW);
    ml_tensor_drop(&b.x);
    ml_tensor_drop(&b.r);
    ml_tensor_drop(&b.dx);
    ok(h.books[ML_CPU].total == 0, "the ledger is back to zero (%zu bytes)", h.books[ML_CPU].total);
    ml_host_free(&h);
    return tap_done();
}
