/*
 * tests/c/test_ops_optim.c - the optimizer ops (host/runtime/ops_optim.c)
 * from C with no Lua state, on a host built by hand with the CPU backend,
 * printing TAP.
 *
 * Covers: one AdamW step on 4 f64 params against torch.optim.AdamW's
 * update written out here, the global norm of two buffers, a global clip,
 * a refused argument (status, message, nothing changed) and the ledger
 * back to zero once every tensor is dropped. Not here: the numerics over
 * many steps, lazy Adam, SGD (tests/spec/optim_spec.lua).
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "ops_optim.h"
#include "tap.h"

/* A new f64 [n] tensor holding vals (zeros when NULL). */
static ml_tensor f64_tensor(ml_host *h, int64_t n, const double *vals)
{
    ml_tensor t = {0};
    ml_err e;
    if (ml_tensor_alloc(h, &t, ML_CPU, ML_F64, 1, &n, &e) != ML_OK) {
        fprintf(stderr, "allocation failed: %s\n", e.msg);
        return t;
    }
    double *d = ml_data(&t);
    for (int64_t i = 0; i < n; i++)
        d[i] = vals ? vals[i] : 0.0;
    return t;
}

static int close_to(double a, double b)
{
    return fabs(a - b) <= 1e-14 * fabs(b);
}

static void test_adamw(ml_host *h)
{
    const double p0[4] = {0.5, -1.25, 2.0, 0.0}, g0[4] = {0.1, -0.3, 0.0, 2.5};
    ml_tensor p = f64_tensor(h, 4, p0), g = f64_tensor(h, 4, g0);
    ml_tensor m = f64_tensor(h, 4, NULL), v = f64_tensor(h, 4, NULL);
    ml_adamw_hp hp = {.lr = 0.1, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8,
                      .weight_decay = 0.01, .step = 1};
    ml_err e;
    ok(ml_op_adamw_step(h, &p, &g, &m, &v, &hp, &e) == ML_OK, "adamw: one step runs");
    const double *pd = ml_data(&p), *md = ml_data(&m), *vd = ml_data(&v);
    int good = 1;
    for (int i = 0; i < 4; i++) {
        /* torch.optim.AdamW at t = 1 from zero states */
        double mi = (1 - hp.beta1) * g0[i], vi = (1 - hp.beta2) * g0[i] * g0[i];
        double mhat = mi / (1 - hp.beta1), vhat = vi / (1 - hp.beta2);
        double want = p0[i] * (1 - hp.lr * hp.weight_decay) - hp.lr * mhat / (sqrt(vhat) + hp.eps);
        good &= close_to(pd[i], want) && close_to(md[i], mi) && close_to(vd[i], vi);
    }
    ok(good, "adamw: params and both states match the closed form");

    /* a refused argument: grads of another length, nothing written */
    ml_tensor g3 = f64_tensor(h, 3, NULL);
    double before[4];
    memcpy(before, pd, sizeof before);
    ml_status s = ml_op_adamw_step(h, &p, &g3, &m, &v, &hp, &e);
    ok(s == ML_EINVAL, "adamw: grads [3] for params [4] is ML_EINVAL");
    ok(!strcmp(e.msg, "grads has 3 elements but must have 4"), "adamw: message '%s'", e.msg);
    ok(!memcmp(before, pd, sizeof before), "adamw: a refused step changes nothing");
    hp.step = 0;
    s = ml_op_adamw_step(h, &p, &g, &m, &v, &hp, &e);
    ok(s == ML_EINVAL && !strcmp(e.msg, "step must be >= 1 (1-based), got 0"),
       "adamw: step 0 refused: '%s'", e.msg);

    ml_tensor_drop(&p);
    ml_tensor_drop(&g);
    ml_tensor_drop(&m);
    ml_tensor_drop(&v);
    ml_tensor_drop(&g3);
}

static void test_norm_and_clip(ml_host *h)
{
    const double a0[4] = {1, 2, 3, 4}, b0[1] = {2};
    ml_tensor a = f64_tensor(h, 4, a0), b = f64_tensor(h, 1, b0);
    const ml_tensor *both[2] = {&a, &b};
    ml_err e;
    double norm = -1;
    ml_status s = ml_op_grad_norm(h, both, 2, &norm, &e);
    ok(s == ML_OK && norm == sqrt(34.0), "grad_norm: sqrt(1 + 4 + 9 + 16 + 4) = %.17g", norm);
    ok(ml_op_grad_norm(h, both, 0, &norm, &e) == ML_OK && norm == 0, "grad_norm: no tensors is 0");

    ml_tensor *clip[2] = {&a, &b};
    ok(ml_op_clip_grad_norm(h, clip, 2, 10.0, &norm, &e) == ML_OK && norm == sqrt(34.0) &&
       ((double *)ml_data(&a))[3] == 4, "clip: under the bound nothing moves");
    ok(ml_op_clip_grad_norm(h, clip, 2, 1.0, &norm, &e) == ML_OK && norm == sqrt(34.0),
       "clip: returns the norm before clipping");
    double coef = 1.0 / (sqrt(34.0) + ML_CLIP_EPS);
    const double *ad = ml_data(&a), *bd = ml_data(&b);
    int good = bd[0] == 2 * coef;
    for (int i = 0; i < 4; i++)
        good &= ad[i] == a0[i] * coef;
    ok(good, "clip: every element scaled by max_norm / (norm + 1e-6)");
    double after;
    ml_op_grad_norm(h, both, 2, &after, &e);
    ok(fabs(after - 1.0) < 1e-6, "clip: the norm after is %.9f", after);
    ok(ml_op_clip_grad_norm(h, clip, 2, -1.0, &norm, &e) == ML_EINVAL &&
       !strcmp(e.msg, "max_norm must be >= 0, got -1"), "clip: max_norm -1 refused: '%s'", e.msg);

    ml_tensor_drop(&a);
    ml_tensor_drop(&b);
}

int main(void)
{
    ml_host h;
    ml_host_init(&h);
    test_adamw(&h);
    test_norm_and_clip(&h);
    const ml_ledger *lg = &h.books[ML_CPU];
    ok(lg->total == 0 && lg->cur[ML_CAT_OTHER] == 0, "ledger: back to zero (%zu bytes)", lg->total);
    ml_host_free(&h);
    return tap_done();
}
