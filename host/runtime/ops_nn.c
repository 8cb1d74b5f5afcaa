/*
 * host/runtime/ops_nn.c - the dense model's ops (host/runtime/ops_nn.h).
 */
#include "ops_nn.h"

#include <math.h>

/* ---- rmsnorm ------------------------------------------------------------------ */

/* x [..., D] and w [D] on x's device, one float dtype; N rows. */
static ml_status rmsnorm_args(const ml_tensor *x, const ml_tensor *w, int64_t *N, int64_t *D,
                              ml_err *e)
{
    ml_device dev = x->st ? x->st->device : ML_CPU;
    ML_TRY(ml_check_input(x, "x", dev, ML_DT_FLOAT, -1, 1, e));
    ML_TRY(ml_check_input(w, "w", dev, ML_DT_FLOAT, 1, 1, e));
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
    ML_TRY(rmsnorm_args(x, w, &N, &D, e));
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
    ML_TRY(rmsnorm_args(x, w, &N, &D, e));
    ml_device dev = x->st->device;
    ML_TRY(ml_check_input(dy, "dy", dev, ML_DT_FLOAT, -1, 1, e));
    ML_TRY(ml_check_input(rstd, "rstd", dev, ML_DT(ML_F64), 1, 1, e));
    ML_TRY(ml_check_same_dtype(dy, "dy", "x", x->dtype, e));
    ML_TRY(ml_check_shape(dy, "dy", x->ndim, x->shape, e));
    ML_TRY(ml_check_shape(rstd, "rstd", 1, &N, e));
    if (dw->st)
        ML_TRY(ml_check_same_dtype(dw, "dw", "x", x->dtype, e));
    ML_TRY(ml_prepare_accumulator(h, dw, "dw", dev, x->dtype, 1, &D, e));
    ML_TRY(ml_prepare_output(h, dx, "dx", dev, x->dtype, x->ndim, x->shape, e));
    ml_kctx c = ml_host_kctx(h);
    return ml_kernel_status(ML_KCALL(h, dev, rmsnorm_backward, x->dtype, ml_data(dx), ml_data(dw),
                                     ml_data(dy), ml_data(x), ml_data(w), ml_data(rstd), N, D, &c), e);
}
