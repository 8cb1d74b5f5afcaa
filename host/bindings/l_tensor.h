/*
 * host/bindings/l_tensor.h - what host/bindings/l_tensor.c shares with the other binding
 * files of the tensor library (l_tensor_math.c) and with other libraries.
 */
#ifndef ML_L_TENSOR_H
#define ML_L_TENSOR_H

#include "l_util.h"

/* dst = src elementwise (same shape), converting dtype, across devices
 * (ml_op_copy); raises naming fn. */
void ml_run_copy(lua_State *L, const char *fn, ml_tensor *dst, const ml_tensor *src);
/* The tensor at idx, replaced in its stack slot by a contiguous copy when
 * it is not contiguous (so the copy is owned by the stack). */
ml_tensor *ml_contiguous_arg(lua_State *L, int idx, const char *fn);
/* Adds the math methods to the method table on the stack top, and the
 * math functions to the library table just below it. */
void ml_tensor_math_register(lua_State *L);

#endif
