/*
 * kernels/elementwise_ops.h - the scalar math of the elementwise family,
 * written once for both backends (ML_HD: host and device), so the CPU and
 * CUDA kernels cannot drift apart. NaN wins max and min; integer division
 * truncates toward zero (a zero divisor is refused by the binding).
 */
#ifndef ML_KERNELS_ELEMENTWISE_OPS_H
#define ML_KERNELS_ELEMENTWISE_OPS_H

#include <math.h>

#include "elementwise.h"

static inline ML_HD double ml_binop_f64(ml_binop op, double x, double y)
{
    switch (op) {
    case ML_ADD: return x + y;
    case ML_SUB: return x - y;
    case ML_MUL: return x * y;
    case ML_DIV: return x / y;
    case ML_MAX: return (x > y || x != x) ? x : y;
    case ML_MIN: return (x < y || x != x) ? x : y;
    default:     return 0;
    }
}

static inline ML_HD float ml_binop_f32(ml_binop op, float x, float y)
{
    switch (op) {
    case ML_ADD: return x + y;
    case ML_SUB: return x - y;
    case ML_MUL: return x * y;
    case ML_DIV: return x / y;
    case ML_MAX: return (x > y || x != x) ? x : y;
    case ML_MIN: return (x < y || x != x) ? x : y;
    default:     return 0;
    }
}

/* Integer dtypes compute in double (exact for i32, and i64 up to 2^53). */
static inline ML_HD double ml_binop_int(ml_binop op, double x, double y)
{
    if (op == ML_DIV)
        return y != 0 ? trunc(x / y) : 0;
    return ml_binop_f64(op, x, y);
}

static inline ML_HD float ml_unop_f32(ml_unop op, float x)
{
    switch (op) {
    case ML_EXP:     return expf(x);
    case ML_LOG:     return logf(x);
    case ML_SQRT:    return sqrtf(x);
    case ML_RSQRT:   return 1.0f / sqrtf(x);
    case ML_SILU:    return x / (1.0f + expf(-x));
    case ML_SIGMOID: return 1.0f / (1.0f + expf(-x));
    case ML_TANH:    return tanhf(x);
    case ML_NEG:     return -x;
    case ML_ABS:     return fabsf(x);
    default:         return 0;
    }
}

static inline ML_HD double ml_unop_f64(ml_unop op, double x)
{
    switch (op) {
    case ML_EXP:     return exp(x);
    case ML_LOG:     return log(x);
    case ML_SQRT:    return sqrt(x);
    case ML_RSQRT:   return 1.0 / sqrt(x);
    case ML_SILU:    return x / (1.0 + exp(-x));
    case ML_SIGMOID: return 1.0 / (1.0 + exp(-x));
    case ML_TANH:    return tanh(x);
    case ML_NEG:     return -x;
    case ML_ABS:     return fabs(x);
    default:         return 0;
    }
}

#endif
