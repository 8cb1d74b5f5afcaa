/*
 * host/runtime/ops_nn.c - the dense model's ops (host/runtime/ops_nn.h).
 */
#include "ops_nn.h"

#include <math.h>

/* Every entry of ids (i64, contiguous) in [0, hi), else "name[i] = v is out
 * of range [0, hi)" with i counted from 1, as in Lua. The bad value is read
 * back from the device; inside a plan nothing is checked (nothing was
 * computed). */
static ml_status check_ids(ml_host *h, const ml_tensor *ids, const char *name, int64_t hi,
                           ml_err *e)
{
    int64_t bad, v;
    ML_TRY(ml_find_bad_index(h, ids, hi, &bad, &v, e));
    if (bad < 0)
        return ML_OK;
    return ml_err_set(e, ML_EINVAL, "%s[%lld] = %lld is out of range [0, %lld)", name,
                      (long long)(bad + 1), (long long)v, (long long)hi);
}

/* ---- rmsnorm ------------------------------------------------------------------ */

/* A given weight gradient g of the input ref of dtype dt has dtype
 * ml_grad_dtype(dt): dt itself, or f32 for bf16 (mixed precision). */
static ml_status check_grad_dtype(const ml_tensor *g, const char *name, const char *ref, ml_dtype dt,
                                  ml_err *e)
{
    ml_dtype gdt = ml_grad_dtype(dt);
    if (g->dtype == gdt || gdt == dt)
        return ml_check_same_dtype(g, name, ref, gdt, e);
    return ml_err_set(e, ML_EINVAL, "%s must be %s, got %s (the weight gradient of %s %s)", name,
                      ml_dtype_names[gdt], ml_dtype_names[g->dtype], ml_dtype_names[dt], ref);
}

/* x [..., D] and w [D] on x's device, one float dtype the device runs
 * rmsnorm in; N rows. */
static ml_status rmsnorm_args(const ml_host *h, const ml_tensor *x, const ml_tensor *w, int64_t *N,
                              int64_t *D, ml_err *e)
{
    ml_device dev = ml_tensor_device(x);
    unsigned dts = ml_float_dtypes(h, dev, ML_OP_RMSNORM);
    ML_TRY(ml_check_input(x, "x", dev, dts, -1, 1, e));
    ML_TRY(ml_check_input(w, "w", dev, dts, 1, 1, e));
    ML_TRY(ml_check_same_dtype(w, "w", "x", x->dtype, e));
    *D = x->shape[x->ndim - 1];
    *N = *D ? ml_numel(x) / *D : 0;
    ML_TRY(ml_check_shape(w, "w", 1, D, e));
    if (*D == 0)
        return ml_err_set(e, ML_EINVAL, "x has an empty last dim");
    return ML_OK;
}

ml_status ml_op_rmsnorm_forward(ml_host *h, ml_tensor *y, ml_tensor *rstd, const ml_tensor *x,
                                const ml_tensor *w, double eps, ml_err *e)
{
    int64_t N, D;
    ML_TRY(rmsnorm_args(h, x, w, &N, &D, e));
    if (!(eps >= 0) || !isfinite(eps))
        return ml_err_set(e, ML_EINVAL, "eps must be finite and >= 0, got %g", eps);
    ml_device dev = x->st->device;
    ML_TRY(ml_prepare_output(h, y, "y", dev, x->dtype, x->ndim, x->shape, e));
    ML_TRY(ml_prepare_output(h, rstd, "rstd", dev, ML_F64, 1, &N, e));
    ml_kctx c = ml_host_kctx(h);
    return ml_kernel_status(ML_KCALL(h, dev, rmsnorm_forward, x->dtype, ml_data(y), ml_data(rstd),
                                     ml_data(x), ml_data(w), N, D, eps, &c), e);
}

ml_status ml_op_rmsnorm_backward(ml_host *h, ml_tensor *dx, ml_tensor *dw, const ml_tensor *dy,
                                 const ml_tensor *x, const ml_tensor *w, const ml_tensor *rstd,
                                 ml_err *e)
{
    int64_t N, D;
    ML_TRY(rmsnorm_args(h, x, w, &N, &D, e));
    ml_device dev = x->st->device;
    ML_TRY(ml_check_input(dy, "dy", dev, ml_float_dtypes(h, dev, ML_OP_RMSNORM), -1, 1, e));
    ML_TRY(ml_check_input(rstd, "rstd", dev, ML_DT(ML_F64), 1, 1, e));
    ML_TRY(ml_check_same_dtype(dy, "dy", "x", x->dtype, e));
    ML_TRY(ml_check_shape(dy, "dy", x->ndim, x->shape, e));
    ML_TRY(ml_check_shape(rstd, "rstd", 1, &N, e));
    if (dw->st)
        ML_TRY(check_grad_dtype(dw, "dw", "x", x->dtype, e));
    ML_TRY(ml_prepare_accumulator(h, dw, "dw", dev, ml_grad_dtype(x->dtype), 1, &D, e));
    ML_TRY(ml_prepare_output(h, dx, "dx", dev, x->dtype, x->ndim, x->shape, e));
    ml_kctx c = ml_host_kctx(h);
    return ml_kernel_status(ML_KCALL(h, dev, rmsnorm_backward, x->dtype, ml_data(dx), ml_data(dw),
                                     ml_data(dy), ml_data(x), ml_data(w), ml_data(rstd), N, D, &c), e);
}

/* ---- embedding ---------------------------------------------------------------- */

ml_status ml_op_embedding_forward(ml_host *h, ml_tensor *out, const ml_tensor *ids,
                                  const ml_tensor *W, ml_err *e)
{
    ml_device dev = ml_tensor_device(ids);
    ML_TRY(ml_check_input(ids, "ids", dev, ML_DT(ML_I64), 1, 1, e));
    ML_TRY(ml_check_input(W, "W", dev, ml_float_dtypes(h, dev, ML_OP_EMBEDDING), 2, 1, e));
    int64_t T = ids->shape[0], V = W->shape[0], D = W->shape[1], so[2] = {T, D};
    ML_TRY(check_ids(h, ids, "ids", V, e));
    ML_TRY(ml_prepare_output(h, out, "out", dev, W->dtype, 2, so, e));
    ml_kctx c = ml_host_kctx(h);
    return ml_kernel_status(ML_KCALL(h, dev, embedding_forward, W->dtype, ml_data(out), ml_data(ids),
                                     ml_data(W), T, V, D, &c), e);
}

ml_status ml_op_embedding_backward(ml_host *h, ml_tensor *dW, const ml_tensor *dout,
                                   const ml_tensor *ids, int64_t V, ml_err *e)
{
    ml_device dev = ml_tensor_device(dout);
    unsigned dts = ml_float_dtypes(h, dev, ML_OP_EMBEDDING);
    ML_TRY(ml_check_input(dout, "dout", dev, dts, 2, 1, e));
    ML_TRY(ml_check_input(ids, "ids", dev, ML_DT(ML_I64), 1, 1, e));
    int64_t T = ids->shape[0], D = dout->shape[1], sd[2] = {T, D};
    ML_TRY(ml_check_shape(dout, "dout", 2, sd, e));
    ml_dtype gdt = ml_grad_dtype(dout->dtype);
    if (dW->st) {
        ML_TRY(ml_check_input(dW, "dW", dev, dts, 2, 1, e));
        ML_TRY(check_grad_dtype(dW, "dW", "dout", dout->dtype, e));
        V = dW->shape[0];
    } else if (V < 1) {
        return ml_err_set(e, ML_EINVAL, "V must be a positive integer, got %lld", (long long)V);
    }
    int64_t sw[2] = {V, D};
    ML_TRY(check_ids(h, ids, "ids", V, e));
    ML_TRY(ml_prepare_accumulator(h, dW, "dW", dev, gdt, 2, sw, e));
    ml_kctx c = ml_host_kctx(h);
    return ml_kernel_status(ML_KCALL(h, dev, embedding_backward, dout->dtype, ml_data(dW),
                                     ml_data(dout), ml_data(ids), T, V, D, &c), e);
}

/* ---- cross-entropy ------------------------------------------------------------ */

/* hs [S, D], W [V, D] (one float dtype the device runs cross-entropy in)
 * and targets [S] i64 on hs's device, V, D >= 1, rows and chunk in range.
 * The targets' range is checked by the caller, last (it reads the device). */
static ml_status ce_args(const ml_host *h, const ml_tensor *hs, const ml_tensor *W,
                         const ml_tensor *tg, int64_t rows, int64_t chunk, ml_err *e)
{
    ml_device dev = ml_tensor_device(hs);
    unsigned dts = ml_float_dtypes(h, dev, ML_OP_CROSSENTROPY);
    ML_TRY(ml_check_input(hs, "h", dev, dts, 2, 1, e));
    ML_TRY(ml_check_input(W, "W", dev, dts, 2, 1, e));
    ML_TRY(ml_check_input(tg, "targets", dev, ML_DT(ML_I64), 1, 1, e));
    ML_TRY(ml_check_same_dtype(W, "W", "h", hs->dtype, e));
    int64_t S = hs->shape[0], D = hs->shape[1], V = W->shape[0], sw[2] = {V, D};
    ML_TRY(ml_check_shape(W, "W", 2, sw, e));
    ML_TRY(ml_check_shape(tg, "targets", 1, &S, e));
    if (V < 1)
        return ml_err_set(e, ML_EINVAL, "W is empty: at least one vocabulary row expected");
    if (D < 1)
        return ml_err_set(e, ML_EINVAL, "h has no columns: the hidden size must be >= 1");
    if (rows < 1 || rows > ML_CE_MAX_ROWS)
        return ml_err_set(e, ML_EINVAL, "rows must be in [1, %d], got %lld", ML_CE_MAX_ROWS,
                          (long long)rows);
    if (chunk < 1)
        return ml_err_set(e, ML_EINVAL, "chunk must be >= 1, got %lld", (long long)chunk);
    return ML_OK;
}

/* The kernels' scratch (the [rows, chunk] logits block and, for bf16, the
 * backward's sums and copy) on hs's device. */
static ml_status ce_scratch(ml_host *h, ml_tensor *scr, const ml_tensor *hs, int64_t V,
                            int64_t rows, int64_t chunk, ml_err *e)
{
    size_t n = ml_ce_scratch_bytes(hs->dtype, hs->shape[0], V, hs->shape[1], rows, chunk);
    return ml_kernel_scratch(h, scr, hs->st->device, n, e);
}

ml_status ml_op_cross_entropy_forward(ml_host *h, double *loss, ml_tensor *lse,
                                      const ml_tensor *hs, const ml_tensor *W,
                                      const ml_tensor *targets, int64_t rows, int64_t chunk,
                                      ml_err *e)
{
    *loss = 0;
    ML_TRY(ce_args(h, hs, W, targets, rows, chunk, e));
    ml_device dev = hs->st->device;
    int64_t S = hs->shape[0], D = hs->shape[1], V = W->shape[0];
    ML_TRY(check_ids(h, targets, "targets", V, e));
    ML_TRY(ml_prepare_output(h, lse, "lse", dev, ML_F64, 1, &S, e));
    ml_tensor scr = {0};
    ML_TRY(ce_scratch(h, &scr, hs, V, rows, chunk, e));
    ml_kctx c = ml_host_kctx(h);
    ml_status s = ML_KCALL(h, dev, ce_forward, hs->dtype, loss, ml_data(lse), ml_data(hs),
                           ml_data(W), ml_data(targets), S, V, D, rows, chunk, ml_data(&scr), &c);
    ml_tensor_drop(&scr);
    if (s == ML_ENAN)
        return ml_err_set(e, s, "NaN in the logits");
    return ml_kernel_status(s, e);
}

ml_status ml_op_cross_entropy_backward(ml_host *h, ml_tensor *dh, ml_tensor *dW, double dloss,
                                       const ml_tensor *hs, const ml_tensor *W,
                                       const ml_tensor *targets, const ml_tensor *lse,
                                       int64_t rows, int64_t chunk, ml_err *e)
{
    ML_TRY(ce_args(h, hs, W, targets, rows, chunk, e));
    ml_device dev = hs->st->device;
    int64_t S = hs->shape[0], D = hs->shape[1], V = W->shape[0];
    ml_dtype gdt = ml_grad_dtype(hs->dtype);
    if (!isfinite(dloss))
        return ml_err_set(e, ML_EINVAL, "dloss must be finite, got %g", dloss);
    ML_TRY(ml_check_input(lse, "lse", dev, ML_DT(ML_F64), 1, 1, e));
    ML_TRY(ml_check_shape(lse, "lse", 1, &S, e));
    if (dW->st)
        ML_TRY(check_grad_dtype(dW, "dW", "h", hs->dtype, e));
    ML_TRY(check_ids(h, targets, "targets", V, e));
    ML_TRY(ml_prepare_accumulator(h, dW, "dW", dev, gdt, 2, W->shape, e));
    ML_TRY(ml_prepare_output(h, dh, "dh", dev, hs->dtype, 2, hs->shape, e));
    ml_tensor scr = {0};
    ML_TRY(ce_scratch(h, &scr, hs, V, rows, chunk, e));
    ml_kctx c = ml_host_kctx(h);
    ml_status s = ML_KCALL(h, dev, ce_backward, hs->dtype, ml_data(dh), ml_data(dW), dloss,
                           ml_data(hs), ml_data(W), ml_data(targets), ml_data(lse), S, V, D, rows,
                           chunk, ml_data(&scr), &c);
    ml_tensor_drop(&scr);
    return ml_kernel_status(s, e);
}

/* ---- rope --------------------------------------------------------------------- */

/* y = rotate(x) (inverse: the backward); yname, xname name them in messages.
 * A given y may be x itself (the kernels read each pair before writing it),
 * not a part of it. */
static ml_status rope(ml_host *h, ml_tensor *y, const ml_tensor *x, const char *yname,
                      const char *xname, int64_t offset, double theta, int inverse, ml_err *e)
{
    ml_device dev = ml_tensor_device(x);
    ML_TRY(ml_check_input(x, xname, dev, ml_float_dtypes(h, dev, ML_OP_ROPE), 3, 1, e));
    int64_t S = x->shape[0], heads = x->shape[1], hd = x->shape[2];
    if (hd < 2 || hd % 2)
        return ml_err_set(e, ML_EINVAL, "%s: head dim %lld must be even and >= 2", xname,
                          (long long)hd);
    if (!(theta > 1) || !isfinite(theta))
        return ml_err_set(e, ML_EINVAL, "theta must be finite and > 1, got %g", theta);
    if (offset < 0 || offset > ML_ROPE_OFFSET_MAX)
        return ml_err_set(e, ML_EINVAL, "offset must be in [0, %lld], got %lld",
                          (long long)ML_ROPE_OFFSET_MAX, (long long)offset);
    ML_TRY(ml_prepare_output(h, y, yname, dev, x->dtype, 3, x->shape, e));
    if (ml_data(y) != ml_data(x) && ml_tensors_overlap(y, x))
        return ml_err_set(e, ML_EINVAL, "%s overlaps %s but is not %s itself", yname, xname, xname);
    ml_kctx c = ml_host_kctx(h);
    ml_status s = inverse
        ? ML_KCALL(h, dev, rope_backward, x->dtype, ml_data(y), ml_data(x), S, heads, hd, offset,
                   theta, &c)
        : ML_KCALL(h, dev, rope_forward, x->dtype, ml_data(y), ml_data(x), S, heads, hd, offset,
                   theta, &c);
    return ml_kernel_status(s, e);
}

ml_status ml_op_rope_forward(ml_host *h, ml_tensor *y, const ml_tensor *x, int64_t offset,
                             double theta, ml_err *e)
{
    return rope(h, y, x, "y", "x", offset, theta, 0, e);
}

ml_status ml_op_rope_backward(ml_host *h, ml_tensor *dx, const ml_tensor *dy, int64_t offset,
                              double theta, ml_err *e)
{
    return rope(h, dx, dy, "dx", "dy", offset, theta, 1, e);
}

/* ---- attention ---------------------------------------------------------------- */

/* q [S, H, hd], k, v [Sk, KV, hd] on q's device, one float dtype the
 * device runs attention in; H % KV == 0, hd in [1, ML_ATT_HD_MAX]; Sk = S
 * when square (training), else Sk >= S (a KV cache's keys). */
static ml_status qkv_args(const ml_host *h, const ml_tensor *q, const ml_tensor *k,
                          const ml_tensor *v, int square, ml_err *e)
{
    ml_device dev = ml_tensor_device(q);
    unsigned dts = ml_float_dtypes(h, dev, ML_OP_ATTENTION);
    ML_TRY(ml_check_input(q, "q", dev, dts, 3, 1, e));
    ML_TRY(ml_check_input(k, "k", dev, dts, 3, 1, e));
    ML_TRY(ml_check_input(v, "v", dev, dts, 3, 1, e));
    ML_TRY(ml_check_same_dtype(k, "k", "q", q->dtype, e));
    ML_TRY(ml_check_same_dtype(v, "v", "q", q->dtype, e));
    int64_t S = q->shape[0], H = q->shape[1], hd = q->shape[2], KV = k->shape[1];
    int64_t sk[3] = {square ? S : k->shape[0], KV, hd};
    if (sk[0] < S)
        return ml_err_set(e, ML_EINVAL, "k has %lld positions, fewer than q's %lld",
                          (long long)sk[0], (long long)S);
    ML_TRY(ml_check_shape(k, "k", 3, sk, e));
    ML_TRY(ml_check_shape(v, "v", 3, sk, e));
    if (KV < 1 || H % KV)
        return ml_err_set(e, ML_EINVAL, "q has %lld heads, not a multiple of k's %lld kv heads",
                          (long long)H, (long long)KV);
    if (hd < 1 || hd > ML_ATT_HD_MAX)
        return ml_err_set(e, ML_EINVAL, "head dim %lld must be in [1, %d]", (long long)hd,
                          ML_ATT_HD_MAX);
    return ML_OK;
}

/* The CPU kernels' per-thread blocks for c's thread count; none on CUDA,
 * whose tiles live in shared memory (scr stays empty). */
static ml_status attention_scratch(ml_host *h, ml_tensor *scr, const ml_tensor *q,
                                   const ml_kctx *c, ml_err *e)
{
    ml_device dev = q->st->device;
    return ml_kernel_scratch(h, scr, dev, ML_KSCRATCH(h, dev, attention, q->shape[2], q->shape[0],
                                                      c->nthreads), e);
}

ml_status ml_op_attention_forward(ml_host *h, ml_tensor *out, ml_tensor *lse, const ml_tensor *q,
                                  const ml_tensor *k, const ml_tensor *v, ml_err *e)
{
    ML_TRY(qkv_args(h, q, k, v, 0, e));
    ml_device dev = q->st->device;
    int64_t S = q->shape[0], Sk = k->shape[0], H = q->shape[1], hd = q->shape[2], KV = k->shape[1];
    int64_t sl[2] = {H, S};
    ML_TRY(ml_prepare_output(h, out, "out", dev, q->dtype, 3, q->shape, e));
    ML_TRY(ml_prepare_output(h, lse, "lse", dev, ML_F64, 2, sl, e));
    ml_kctx c = ml_host_kctx(h);
    ml_tensor scr = {0};
    ML_TRY(attention_scratch(h, &scr, q, &c, e));
    ml_status s = ML_KCALL(h, dev, attention_forward, q->dtype, ml_data(out), ml_data(lse),
                           ml_data(q), ml_data(k), ml_data(v), S, Sk, H, KV, hd,
                           scr.st ? ml_data(&scr) : NULL, &c);
    ml_tensor_drop(&scr);
    return ml_kernel_status(s, e);
}

ml_status ml_op_attention_backward(ml_host *h, ml_tensor *dq, ml_tensor *dk, ml_tensor *dv,
                                   const ml_tensor *dout, const ml_tensor *q, const ml_tensor *k,
                                   const ml_tensor *v, const ml_tensor *out, const ml_tensor *lse,
                                   ml_err *e)
{
    ML_TRY(qkv_args(h, q, k, v, 1, e));
    ml_device dev = q->st->device;
    int64_t S = q->shape[0], H = q->shape[1], hd = q->shape[2], KV = k->shape[1], sl[2] = {H, S};
    unsigned dts = ml_float_dtypes(h, dev, ML_OP_ATTENTION);
    ML_TRY(ml_check_input(dout, "dout", dev, dts, 3, 1, e));
    ML_TRY(ml_check_input(out, "out", dev, dts, 3, 1, e));
    ML_TRY(ml_check_input(lse, "lse", dev, ML_DT(ML_F64), 2, 1, e));
    ML_TRY(ml_check_same_dtype(dout, "dout", "q", q->dtype, e));
    ML_TRY(ml_check_same_dtype(out, "out", "q", q->dtype, e));
    ML_TRY(ml_check_shape(dout, "dout", 3, q->shape, e));
    ML_TRY(ml_check_shape(out, "out", 3, q->shape, e));
    ML_TRY(ml_check_shape(lse, "lse", 2, sl, e));
    ML_TRY(ml_prepare_output(h, dq, "dq", dev, q->dtype, 3, q->shape, e));
    ML_TRY(ml_prepare_output(h, dk, "dk", dev, q->dtype, 3, k->shape, e));
    ML_TRY(ml_prepare_output(h, dv, "dv", dev, q->dtype, 3, v->shape, e));
    ml_kctx c = ml_host_kctx(h);
    ml_tensor drow = {0}, scr = {0};
    ml_status s = ml_tensor_alloc(h, &drow, dev, ML_F64, 2, sl, e);
    if (s == ML_OK)
        s = attention_scratch(h, &scr, q, &c, e);
    if (s == ML_OK)
        s = ml_kernel_status(ML_KCALL(h, dev, attention_backward, q->dtype, ml_data(dq), ml_data(dk),
                                      ml_data(dv), ml_data(&drow), ml_data(dout), ml_data(q),
                                      ml_data(k), ml_data(v), ml_data(out), ml_data(lse), S, H, KV,
                                      hd, scr.st ? ml_data(&scr) : NULL, &c), e);
    ml_tensor_drop(&scr);
    ml_tensor_drop(&drow);
    return s;
}
