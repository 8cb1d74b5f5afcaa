/*
 * tests/c/test_ops_nn.c - the dense model's ops (host/runtime/ops_nn.c)
 * called from C on a host built by hand (no Lua state), printing TAP.
 *
 * Covers, on tiny f64 shapes: rmsnorm, rope, attention, embedding and
 * cross-entropy forward and backward, one value of each against a formula
 * computed here; outputs allocated by the ops when given empty; a refused
 * argument (ML_EINVAL, its message, nothing allocated); the ops' scratch
 * released (the ledger holds exactly the test's tensors) and the ledger
 * back to zero once they are dropped. Not here: numerics at scale and
 * finite-difference gradients (tests/spec/ops_spec.lua).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ops_nn.h"
#include "tap.h"

static ml_host host;
static ml_tensor tensors[48];   /* every tensor of the test, dropped at the end */
static int ntensors;

/* An empty tensor: an output the op allocates. */
static ml_tensor *empty(void)
{
    return &tensors[ntensors++];
}

/* A new CPU tensor of dt and dims holding vals (converted for i64). */
static ml_tensor *tensor(ml_dtype dt, int ndim, const int64_t *dims, const double *vals)
{
    ml_tensor *t = empty();
    ml_err e;
    if (ml_tensor_alloc(&host, t, ML_CPU, dt, ndim, dims, &e) != ML_OK) {
        fprintf(stderr, "test_ops_nn: %s\n", e.msg);
        exit(1);
    }
    for (int64_t i = 0; i < ml_numel(t); i++) {
        if (dt == ML_I64)
            ((int64_t *)ml_data(t))[i] = (int64_t)vals[i];
        else
            ((double *)ml_data(t))[i] = vals[i];
    }
    return t;
}

static double at(const ml_tensor *t, int64_t i)
{
    return ((const double *)ml_data(t))[i];
}

static int near(double a, double b)
{
    return fabs(a - b) <= 1e-12 * (1 + fabs(b));
}

static ml_err e;

static void test_rmsnorm(void)
{
    const double xv[6] = {1, -2, 3, 0.5, 4, -1}, wv[3] = {0.5, 2, -1}, dyv[6] = {1, 2, 3, -1, 0.5, 2};
    ml_tensor *x = tensor(ML_F64, 2, (int64_t[]){2, 3}, xv), *w = tensor(ML_F64, 1, (int64_t[]){3}, wv);
    ml_tensor *dy = tensor(ML_F64, 2, (int64_t[]){2, 3}, dyv);
    ml_tensor *y = empty(), *rstd = empty(), *dx = empty(), *dw = empty();
    double eps = 1e-6;
    ok(ml_op_rmsnorm_forward(&host, y, rstd, x, w, eps, &e) == ML_OK && y->st && rstd->st,
       "rmsnorm forward: y and rstd allocated");
    double r1 = 1 / sqrt((0.25 + 16 + 1) / 3 + eps);
    ok(near(at(y, 4), 4 * r1 * 2) && near(at(rstd, 1), r1), "rmsnorm forward: y = x / rms(x) * w");
    ok(ml_op_rmsnorm_backward(&host, dx, dw, dy, x, w, rstd, &e) == ML_OK && dx->st && dw->st,
       "rmsnorm backward: dx and dw allocated");
    double r0 = 1 / sqrt((1 + 4 + 9) / 3.0 + eps);
    ok(near(at(dw, 0), 1 * 1 * r0 + -1 * 0.5 * r1), "rmsnorm backward: dw = sum dy * x * rstd");
}

static void test_rope(void)
{
    /* hd = 2: one pair, inverse frequency 1, so row s turns by offset + s. */
    const double xv[4] = {1, 2, -0.5, 3};
    ml_tensor *x = tensor(ML_F64, 3, (int64_t[]){2, 1, 2}, xv);
    ml_tensor *y = empty(), *dx = empty();
    ok(ml_op_rope_forward(&host, y, x, 3, 10000, &e) == ML_OK, "rope forward runs");
    ok(near(at(y, 2), -0.5 * cos(4.0) - 3 * sin(4.0)) && near(at(y, 3), 3 * cos(4.0) - 0.5 * sin(4.0)),
       "rope forward: row 2 turned by the angle 4");
    ok(ml_op_rope_backward(&host, dx, y, 3, 10000, &e) == ML_OK && near(at(dx, 2), -0.5),
       "rope backward: the inverse rotation gives x back");
}

static void count_poll(void *n)
{
    ++*(int *)n;
}

static void test_attention(void)
{
    /* S = 1: the one key gets all the weight, so out = v in both query heads
     * (GQA, H = 2, KV = 1), dv sums dout over them and dq, dk are 0. */
    const double qv[4] = {1, 2, 3, 4}, kv[2] = {0.5, -1}, vv[2] = {7, -3}, dov[4] = {1, 2, 3, 4};
    ml_tensor *q = tensor(ML_F64, 3, (int64_t[]){1, 2, 2}, qv);
    ml_tensor *k = tensor(ML_F64, 3, (int64_t[]){1, 1, 2}, kv), *v = tensor(ML_F64, 3, (int64_t[]){1, 1, 2}, vv);
    ml_tensor *dout = tensor(ML_F64, 3, (int64_t[]){1, 2, 2}, dov);
    ml_tensor *out = empty(), *lse = empty(), *dq = empty(), *dk = empty(), *dv = empty();
    int polls = 0;   /* the host's progress hook runs between tiles (MPI's progress under ZeRO-3) */
    host.progress = count_poll, host.progress_ud = &polls;
    ok(ml_op_attention_forward(&host, out, lse, q, k, v, &e) == ML_OK, "attention forward runs");
    host.progress = NULL, host.progress_ud = NULL;
    ok(polls > 0, "attention forward calls the host's progress hook between tiles");
    ok(near(at(out, 0), 7) && near(at(out, 3), -3) && near(at(lse, 1), (3 * 0.5 - 4) / sqrt(2.0)),
       "attention forward: S = 1 gives out = v, lse = q.k / sqrt(hd)");
    ok(ml_op_attention_backward(&host, dq, dk, dv, dout, q, k, v, out, lse, &e) == ML_OK,
       "attention backward runs");
    ok(near(at(dv, 0), 1 + 3) && near(at(dv, 1), 2 + 4) && at(dq, 2) == 0 && at(dk, 1) == 0,
       "attention backward: dv = sum over heads of dout, dq = dk = 0");
}

static void test_embedding(void)
{
    const double Wv[10] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9}, iv[3] = {4, 0, 4}, dov[6] = {1, 2, 3, 4, 5, 6};
    ml_tensor *W = tensor(ML_F64, 2, (int64_t[]){5, 2}, Wv), *ids = tensor(ML_I64, 1, (int64_t[]){3}, iv);
    ml_tensor *dout = tensor(ML_F64, 2, (int64_t[]){3, 2}, dov);
    ml_tensor *out = empty(), *dW = empty();
    ok(ml_op_embedding_forward(&host, out, ids, W, &e) == ML_OK && at(out, 1) == 9 && at(out, 2) == 0,
       "embedding forward: out[t] = W[ids[t]]");
    ok(ml_op_embedding_backward(&host, dW, dout, ids, 5, &e) == ML_OK && dW->shape[0] == 5 &&
       at(dW, 8) == 1 + 5 && at(dW, 3) == 0,
       "embedding backward: dW[v] = sum of dout over ids == v, zeros elsewhere");

    const double bad[3] = {1, 9, 2};
    ml_tensor *badids = tensor(ML_I64, 1, (int64_t[]){3}, bad), *none = empty();
    ml_status s = ml_op_embedding_forward(&host, none, badids, W, &e);
    ok(s == ML_EINVAL && strcmp(e.msg, "ids[2] = 9 is out of range [0, 5)") == 0 && !none->st,
       "embedding forward: an id out of range is ML_EINVAL, named, nothing allocated (%s)", e.msg);
}

static void test_cross_entropy(void)
{
    enum { S = 2, V = 3, D = 2 };
    const double hv[S * D] = {1, -1, 0.5, 2}, Wv[V * D] = {1, 0, 0, 1, -1, 1}, tv[S] = {2, 0};
    ml_tensor *hs = tensor(ML_F64, 2, (int64_t[]){S, D}, hv), *W = tensor(ML_F64, 2, (int64_t[]){V, D}, Wv);
    ml_tensor *tg = tensor(ML_I64, 1, (int64_t[]){S}, tv);
    ml_tensor *lse = empty(), *dh = empty(), *dW = empty();
    double logit[S][V], lsum[S], loss_ref = 0, loss, dloss = 1.5;
    for (int s = 0; s < S; s++) {
        double m = -INFINITY, sum = 0;
        for (int v = 0; v < V; v++) {
            logit[s][v] = hv[s * D] * Wv[v * D] + hv[s * D + 1] * Wv[v * D + 1];
            m = fmax(m, logit[s][v]);
        }
        for (int v = 0; v < V; v++)
            sum += exp(logit[s][v] - m);
        lsum[s] = m + log(sum);
        loss_ref += (lsum[s] - logit[s][(int)tv[s]]) / S;
    }
    ok(ml_op_cross_entropy_forward(&host, &loss, lse, hs, W, tg, 1, 2, &e) == ML_OK &&
       near(loss, loss_ref) && near(at(lse, 1), lsum[1]),
       "cross-entropy forward: loss = mean(logsumexp - target logit), blocks of 1 row x 2 columns");
    ok(ml_op_cross_entropy_backward(&host, dh, dW, dloss, hs, W, tg, lse, 1, 2, &e) == ML_OK,
       "cross-entropy backward runs");
    double g = 0;
    for (int v = 0; v < V; v++)
        g += (exp(logit[0][v] - lsum[0]) - (v == (int)tv[0])) * Wv[v * D];
    ok(near(at(dh, 0), dloss / S * g), "cross-entropy backward: dh = dloss/S (softmax - onehot) W");
}

int main(void)
{
    ml_host_init(&host);
    test_rmsnorm();
    test_rope();
    test_attention();
    test_embedding();
    test_cross_entropy();

    size_t held = 0;
    for (int i = 0; i < ntensors; i++)
        held += tensors[i].st ? ml_nbytes(&tensors[i]) : 0;
    ok(host.books[ML_CPU].total == held, "the ledger holds only the test's tensors (scratch released)");
    for (int i = 0; i < ntensors; i++)
        ml_tensor_drop(&tensors[i]);
    ok(host.books[ML_CPU].total == 0, "the ledger is back to zero after dropping every tensor");
    ml_host_free(&host);
    return tap_done();
}
