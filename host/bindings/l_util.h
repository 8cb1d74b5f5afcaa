/*
 * host/bindings/l_util.h - what every binding file shares: reaching the host from a
 * Lua state, checking tensor arguments, creating tensors through the ledger
 * (with the collect-and-retry rule), and turning statuses into Lua errors
 * that name the function.
 */
#ifndef ML_L_UTIL_H
#define ML_L_UTIL_H

#include <lauxlib.h>
#include <lua.h>

#include "../runtime/op.h"

#define ML_TENSOR_MT "moelua.Tensor"
#define ML_POOL_MT "moelua.Pool"

ml_host *ml_host_of(lua_State *L);
void ml_host_register(lua_State *L, ml_host *h);

/* "fn: message" as a Lua error (never returns). */
int ml_error(lua_State *L, const char *fn, const char *fmt, ...)
    __attribute__((format(printf, 3, 4), noreturn));
/* The message, prefixed with the caller's position, as a moelua.errors
 * user error (printed without a traceback; the caller names the function
 * in fmt). For what the user asked wrongly, not for bugs. */
int ml_user_error(lua_State *L, const char *fmt, ...)
    __attribute__((format(printf, 2, 3), noreturn));
/* The same without a position: for a failure of the job's environment that
 * no Lua line caused (a collective that timed out because a rank died). */
int ml_env_error(lua_State *L, const char *fmt, ...)
    __attribute__((format(printf, 2, 3), noreturn));
/* Raise the interrupt error: "<position>fn: interrupted", or the hook's
 * "<position>interrupted!" when fn is NULL. It stays a plain string
 * (scripts match on it); the host remembers its exact text, so that
 * ml_is_interrupt_error tells it apart from a bug's error. */
int ml_interrupt_error(lua_State *L, const char *fn) __attribute__((noreturn));
int ml_is_interrupt_error(lua_State *L, int idx);
/* Push the last interrupt error's text without its position ("fn:
 * interrupted" or "interrupted!"): what the host prints for it. */
void ml_push_interrupt_text(lua_State *L);

/* The tensor at idx: a moelua.Tensor that is neither freed nor a view of a
 * rewound pool frame; otherwise an error naming fn and the argument. */
/* A tensor whose metadata or views are wanted: as ml_checktensor, but a
 * tensor whose storage is released (a ZeRO-3 unit between uses) passes. */
ml_tensor *ml_checkview(lua_State *L, int idx, const char *fn);
ml_tensor *ml_checktensor(lua_State *L, int idx, const char *fn);
/* The same checks for any value: `what` names it in errors ("option 'bias'",
 * "grads.dx", "argument #2 (x)"): "fn: what: the tensor was freed". */
ml_tensor *ml_checktensor_named(lua_State *L, int idx, const char *fn, const char *what);
ml_tensor *ml_testtensor(lua_State *L, int idx);
/* Additionally: contiguous, and of dtype dt (dt < 0: any). */
ml_tensor *ml_checkcontig(lua_State *L, int idx, const char *fn, int dt);

/* A new tensor userdata pushed in the freed (safe) state; the caller fills it. */
ml_tensor *ml_pushtensor(lua_State *L);
/* Push a new contiguous tensor of the given shape, allocated through the
 * ledger. Over budget: collect garbage once, retry, then raise an error
 * that contains the ledger table. */
ml_tensor *ml_newtensor(lua_State *L, const char *fn, ml_device dev, ml_dtype dt,
                        int ndim, const int64_t *shape);
/* t[key] = v for the table on the stack top. */
void ml_setfield_int(lua_State *L, const char *key, lua_Integer v);
/* Push the tier's account book as text (with the untracked remainder on
 * CPU), for errors that report a refused allocation. */
void ml_push_ledger_report(lua_State *L, ml_host *h, ml_tier tier);
/* Before retrying a refused allocation: return the device allocator's
 * cached blocks (CUDA) and collect garbage once. May run finalizers. */
void ml_reclaim(lua_State *L, ml_host *h, ml_device dev);

/* The open pool of the moelua.Pool at idx (host/bindings/l_pool.c), for bindings
 * whose op takes outputs and scratch from a pool (option 'pool'); an error
 * naming fn and `what` when it is not a pool or is closed. */
struct ml_pool *ml_checkpool(lua_State *L, int idx, const char *fn, const char *what);

/* Raise for a non-OK kernel status. */
void ml_check_status(lua_State *L, const char *fn, ml_status s);
/* Raise for a non-OK op status (host/runtime/op.h): "<position>fn: e->msg",
 * or the interrupt error. The caller has released what it holds. */
void ml_check_op(lua_State *L, const char *fn, ml_status s, const ml_err *e);
/* An error naming fn unless dev is built in (inside a plan every device is). */
void ml_check_device(lua_State *L, const char *fn, ml_device dev);

/* Names -> enums; -1 when unknown. */
int ml_dtype_from_name(const char *s);
int ml_device_from_name(const char *s);
int ml_category_from_name(const char *s);
/* opts.dtype / opts.device of the table at idx (0 or none: defaults). */
ml_dtype ml_opt_dtype(lua_State *L, int idx, const char *fn, ml_dtype def);
ml_device ml_opt_device(lua_State *L, int idx, const char *fn, ml_device def);
/* opts[key] of the table at idx (0 or none: def; an absent key: def),
 * checked: an integer in [lo, hi] (INT64_MIN / INT64_MAX: unbounded on that
 * side, and the error names only the bound that applies), a finite number,
 * a boolean. Errors read "option 'key' must be ...". */
int64_t ml_opt_integer(lua_State *L, int idx, const char *fn, const char *key, int64_t def,
                       int64_t lo, int64_t hi);
double ml_opt_number(lua_State *L, int idx, const char *fn, const char *key, double def);
int ml_opt_bool(lua_State *L, int idx, const char *fn, const char *key, int def);
/* Refuse keys of the options table at idx that are not in `allowed` (NULL-terminated). */
void ml_check_opts(lua_State *L, int idx, const char *fn, const char *const *allowed);

/* A shape from a table {2,3} or from integers at idx..top; returns ndim.
 * Stops at the first non-number (an options table). *next gets the index after. */
int ml_checkshape(lua_State *L, int idx, const char *fn, int64_t *shape, int *next);
/* A binding's n arguments: more is an error that names the count (a
 * binding reading fewer would ignore them: t:softmax(1) would run over the
 * last dim); trailing nils past n are dropped, fewer are left as they are
 * (a missing one is "no value" in errors; a binding that wants nils in
 * fixed slots follows with lua_settop(L, n)). A method (fn "Type:name")
 * counts its arguments after self, as Lua's own errors do. */
void ml_args(lua_State *L, int n, const char *fn);
/* NULL when the value at idx is an integer (a whole float too), stored in
 * *v; else what it is, for an error's "got ...": "a fraction" or its type. */
const char *ml_not_integer(lua_State *L, int idx, lua_Integer *v);
/* The integer at idx (a whole float too), else "fn: what must be an
 * integer, got a fraction" (or the type); `what` names it ("argument #2
 * (mark)"), as ml_checktensor_named's does. */
lua_Integer ml_checkinteger_named(lua_State *L, int idx, const char *fn, const char *what);
/* The value at idx is of Lua type t (LUA_TTABLE, LUA_TFUNCTION, ...), else
 * "fn: what must be a table, got no value"; the string at idx (a string
 * only, not a number), else the same error. */
void ml_checktype_named(lua_State *L, int idx, const char *fn, const char *what, int t);
const char *ml_checkstring_named(lua_State *L, int idx, const char *fn, const char *what);
/* Normalise a 1-based (or negative, from the end) dim to 0-based; error if out of range. */
int ml_checkdim(lua_State *L, int idx, const char *fn, int ndim);

#endif
