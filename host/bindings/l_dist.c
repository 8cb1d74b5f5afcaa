/*
 * host/bindings/l_dist.c - the Lua library `moelua.dist`: the collectives
 * of host/runtime/comm.h over the world communicator or a group of its
 * ranks (ranks are 0-based).
 *
 *   dist.init{timeout = 300, debug = false, nccl = false}  the communicator
 *                            (MPI starts here, only under mpiexec; NCCL
 *                            for CUDA tensors when the world has 2+ ranks
 *                            with GPUs, or also in world 1 with nccl =
 *                            true, an error when it cannot be had);
 *                            returns dist. Again: returns dist, an option
 *                            given with another value than the first
 *                            call's is an error
 *   dist.nccl()              do CUDA tensors travel over NCCL? (false before init)
 *   dist.launched()          true under mpiexec (PMI_SIZE set); before init too
 *   dist.initialized()       has dist.init run?
 *   dist.rank(), dist.world()  0 and 1 before init and without mpiexec
 *   dist.set_context(text)   a label ("step 3") in every later error
 *   dist.all_gather(shard, full, what)          -> full
 *   dist.iall_gather(shard, full, what)         -> req: req:test() -> done,
 *                            req:wait(); __gc / __close wait silently
 *   dist.reduce_scatter(full, shard, what [, accumulate])  -> shard
 *   dist.all_reduce(t, what)                    -> t (sum, in place)
 *   dist.all_reduce_numbers(values, "sum"|"max"|"min", what) -> a new table
 *   dist.broadcast(t, root, what)               -> t
 *   dist.all_to_all_v(send, send_rows, recv, recv_rows, what) -> recv
 *                            (rows: tables of world integers)
 *   dist.barrier(what)
 *   dist.split(color, key [, label])  -> a group of the ranks that give the
 *                            same color (integers >= 0), ranked by key; every
 *                            rank calls it; errors name "group <label>(color C)"
 *   dist.world_group()       the world as a group
 *   dist.plan_world(rank, world)  before init: init makes a planned world
 *                            (moelua plan --world: no MPI; this process is
 *                            that rank; collectives only inside mem.plan)
 *   dist.planned()           is the world a planned one?
 *   dist.planned_group(rank, world [, label])  a group of a planned world
 *                            of the given shape (a split needs every rank)
 *   g:rank(), g:world(), g:set_context(text), g:all_gather(...), g:iall_gather(...),
 *   g:reduce_scatter(...), g:all_reduce(...), g:all_reduce_numbers(...),
 *   g:broadcast(...), g:all_to_all_v(...), g:barrier(what), g:split(...)
 *                            the module functions' collectives on group g
 *                            (ranks, roots and rows tables are g's); one
 *                            implementation serves both. dist.progress()
 *                            advances the groups' operations too
 *   dist.progress()          advance pending non-blocking collectives
 *   dist.abort(msg)          under mpiexec with 2+ ranks: "rank R: msg" on
 *                            stderr, MPI_Abort(1); otherwise error(msg)
 *
 * Tensors: contiguous, all on one device (CPU: MPI; CUDA: NCCL, or local
 * copies and sums in world 1 without it).
 * `what` names the data in error messages ("unit layers.0.dense"). A
 * collective's error (a refused argument, a timeout, a mismatch in debug
 * mode) is a Lua error "moelua.dist.<fn>: <message>". Collectives before
 * dist.init are an error. Not here: the semantics, MPI and NCCL
 * (host/runtime/comm.c), ZeRO (lua/moelua).
 */
#include "libs.h"
#include "l_util.h"
#include "../runtime/comm.h"

#include <limits.h>
#include <string.h>

#define GROUP_MT "moelua.dist.Group"
#define REQ_MT "moelua.dist.Request"
#define COMM_KEY "moelua.dist.comm"   /* registry: the communicator's userdata */
#define PLAN_KEY "moelua.dist.plan_world"   /* registry: {rank, world} of dist.plan_world */
#define DEFAULT_TIMEOUT 300.0

typedef struct {
    ml_comm *c;   /* NULL once freed */
} l_comm;

/* A request; its user value 1 is the l_comm, kept alive while it is. */
typedef struct {
    ml_comm_req *r;   /* NULL once freed */
} l_req;

/* The world's group userdata pushed, and its communicator; NULL (nil
 * pushed) before dist.init. */
static ml_comm *push_world(lua_State *L)
{
    lua_getfield(L, LUA_REGISTRYINDEX, COMM_KEY);
    l_comm *b = lua_touserdata(L, -1);
    return b ? b->c : NULL;
}

/* The world communicator, or NULL before dist.init. */
static ml_comm *comm_of(lua_State *L)
{
    ml_comm *c = push_world(L);
    lua_pop(L, 1);   /* the registry keeps it */
    return c;
}

static ml_comm *check_comm(lua_State *L, const char *fn)
{
    ml_comm *c = comm_of(L);
    if (!c)
        ml_error(L, fn, "call moelua.dist.init first");
    return c;
}

/* A communicator's status: a broken one (a timeout, a rank that died, a
 * mismatch that debug mode found: ML_EIO) is the job's environment, a user
 * error printed without a traceback; anything else as ml_check_op says. */
static void check_coll(lua_State *L, const char *fn, ml_status s, const ml_err *e)
{
    if (s == ML_EIO)
        ml_env_error(L, "%s: %s", fn, e->msg);
    ml_check_op(L, fn, s, e);
}

/* Argument idx (self at 1: it is argument #idx-1) as a string. */
static const char *check_string(lua_State *L, int idx, const char *fn, const char *name)
{
    if (lua_type(L, idx) != LUA_TSTRING)
        ml_error(L, fn, "argument #%d (%s) must be a string, got %s", idx - 1, name,
                 luaL_typename(L, idx));
    return lua_tostring(L, idx);
}

/* Argument idx as an integer in [0, INT_MAX]. */
static int check_nonneg_int(lua_State *L, int idx, const char *fn, const char *name)
{
    if (!lua_isinteger(L, idx) || lua_tointeger(L, idx) < 0 || lua_tointeger(L, idx) > INT_MAX)
        ml_error(L, fn, "argument #%d (%s) must be an integer >= 0, got %s", idx - 1, name,
                 lua_isinteger(L, idx) ? lua_tostring(L, idx) : luaL_typename(L, idx));
    return (int)lua_tointeger(L, idx);
}

/* __gc of a group (the world's too): waits for pending operations (at
 * most the timeout), never raises. */
static int l_comm_gc(lua_State *L)
{
    l_comm *b = luaL_checkudata(L, 1, GROUP_MT);
    ml_host *h = ml_host_of(L);
    if (h->progress_ud == b->c)
        h->progress = NULL, h->progress_ud = NULL;
    ml_comm_free(b->c);
    b->c = NULL;
    return 0;
}

static void progress(void *c)
{
    ml_comm_progress(c);
}

static int l_dist_init(lua_State *L)
{
    static const char fn[] = "moelua.dist.init";
    static const char *const allowed[] = {"timeout", "debug", "nccl", NULL};
    ml_args(L, 1, fn);
    lua_settop(L, 1);
    ml_check_opts(L, 1, fn, allowed);
    ml_comm *c = comm_of(L);
    double timeout = ml_opt_number(L, 1, fn, "timeout", c ? ml_comm_timeout(c) : DEFAULT_TIMEOUT);
    int debug = ml_opt_bool(L, 1, fn, "debug", c ? ml_comm_debug(c) : 0);
    /* a second call asks nothing of NCCL unless nccl = true (then c must have it) */
    int nccl = ml_opt_bool(L, 1, fn, "nccl", 0);
    if (c && (timeout != ml_comm_timeout(c) || debug != ml_comm_debug(c)))
        ml_error(L, fn, "already initialized with timeout = %g, debug = %s: a second call cannot "
                 "change them", ml_comm_timeout(c), ml_comm_debug(c) ? "true" : "false");
    if (c && nccl && !ml_comm_nccl(c))
        ml_error(L, fn, "already initialized without NCCL: a second call cannot add it");
    if (!c) {
        if (!(timeout > 0))
            ml_error(L, fn, "option 'timeout' must be > 0 seconds, got %g", timeout);
        l_comm *b = lua_newuserdatauv(L, sizeof *b, 1);
        b->c = NULL;
        luaL_setmetatable(L, GROUP_MT);
        ml_err e;
        ml_host *h = ml_host_of(L);
        if (lua_getfield(L, LUA_REGISTRYINDEX, PLAN_KEY) == LUA_TTABLE) {   /* dist.plan_world */
            lua_geti(L, -1, 1);
            lua_geti(L, -2, 2);
            int r = (int)lua_tointeger(L, -2), w = (int)lua_tointeger(L, -1);
            lua_pop(L, 3);
            check_coll(L, fn, ml_comm_init_planned(h, r, w, timeout, &b->c, &e), &e);
        } else {
            lua_pop(L, 1);
            check_coll(L, fn, (nccl ? ml_comm_init_nccl : ml_comm_init)(h, timeout, debug, &b->c, &e),
                        &e);
        }
        lua_setfield(L, LUA_REGISTRYINDEX, COMM_KEY);
        if (ml_comm_world(b->c) > 1 && !ml_comm_planned(b->c)) {   /* long kernels advance prefetches between tiles */
            h->progress = progress;
            h->progress_ud = b->c;
        }
    }
    lua_pushvalue(L, lua_upvalueindex(1));
    return 1;
}

static int l_dist_launched(lua_State *L)
{
    ml_args(L, 0, "moelua.dist.launched");
    lua_pushboolean(L, ml_comm_launched());
    return 1;
}

static int l_dist_nccl(lua_State *L)
{
    ml_args(L, 0, "moelua.dist.nccl");
    ml_comm *c = comm_of(L);
    lua_pushboolean(L, c && ml_comm_nccl(c));
    return 1;
}

static int l_dist_initialized(lua_State *L)
{
    ml_args(L, 0, "moelua.dist.initialized");
    lua_pushboolean(L, comm_of(L) != NULL);
    return 1;
}

static int l_dist_rank(lua_State *L)
{
    ml_args(L, 0, "moelua.dist.rank");
    ml_comm *c = comm_of(L);
    lua_pushinteger(L, c ? ml_comm_rank(c) : 0);
    return 1;
}

static int l_dist_world(lua_State *L)
{
    ml_args(L, 0, "moelua.dist.world");
    ml_comm *c = comm_of(L);
    lua_pushinteger(L, c ? ml_comm_world(c) : 1);
    return 1;
}

static int l_dist_world_group(lua_State *L)
{
    ml_args(L, 0, "moelua.dist.world_group");
    if (!push_world(L))
        ml_error(L, "moelua.dist.world_group", "call moelua.dist.init first");
    return 1;
}

/* dist.plan_world(rank, world), before dist.init: init then makes a
 * planned world (moelua plan --world; host/runtime/comm.h). */
static int l_dist_plan_world(lua_State *L)
{
    static const char fn[] = "moelua.dist.plan_world";
    ml_args(L, 2, fn);
    int rank = check_nonneg_int(L, 1, fn, "rank");
    int world = check_nonneg_int(L, 2, fn, "world");
    if (world < 1 || rank >= world)
        ml_error(L, fn, "expected 0 <= rank < world, got rank %d of %d", rank, world);
    if (comm_of(L))
        ml_error(L, fn, "moelua.dist.init has run: a planned world is chosen before it");
    lua_createtable(L, 2, 0);
    lua_pushinteger(L, rank);
    lua_rawseti(L, -2, 1);
    lua_pushinteger(L, world);
    lua_rawseti(L, -2, 2);
    lua_setfield(L, LUA_REGISTRYINDEX, PLAN_KEY);
    return 0;
}

static int l_dist_planned(lua_State *L)
{
    ml_args(L, 0, "moelua.dist.planned");
    ml_comm *c = comm_of(L);
    lua_pushboolean(L, c && ml_comm_planned(c));
    return 1;
}

/* dist.planned_group(rank, world [, label]): a group of the planned world. */
static int l_dist_planned_group(lua_State *L)
{
    static const char fn[] = "moelua.dist.planned_group";
    ml_args(L, 3, fn);
    lua_settop(L, 3);
    int rank = check_nonneg_int(L, 1, fn, "rank");
    int world = check_nonneg_int(L, 2, fn, "world");
    const char *label = lua_isnil(L, 3) ? NULL : check_string(L, 3, fn, "label");
    if (!push_world(L))
        ml_error(L, fn, "call moelua.dist.init first");
    ml_comm *c = comm_of(L);
    l_comm *b = lua_newuserdatauv(L, sizeof *b, 1);
    b->c = NULL;
    luaL_setmetatable(L, GROUP_MT);
    lua_pushvalue(L, -2);
    lua_setiuservalue(L, -2, 1);   /* the group holds the world */
    ml_err e;
    check_coll(L, fn, ml_comm_planned_group(c, rank, world, label, &b->c, &e), &e);
    return 1;
}

/* ---- the operations on a group: one implementation each, called with
 * the group at 1 and the arguments from 2, as a method (g:all_gather(...))
 * or as a module function on the world (dist.all_gather(...)). fn names
 * the caller in errors. ---- */

static int set_context(lua_State *L, ml_comm *c, const char *fn)
{
    ml_comm_set_context(c, check_string(L, 2, fn, "context"));
    return 0;
}

static int all_gather(lua_State *L, ml_comm *c, const char *fn)
{
    lua_settop(L, 4);
    ml_tensor *shard = ml_checktensor_named(L, 2, fn, "argument #1 (shard)");
    ml_tensor *full = ml_checktensor_named(L, 3, fn, "argument #2 (full)");
    const char *what = check_string(L, 4, fn, "what");
    ml_err e;
    check_coll(L, fn, ml_comm_all_gather(c, shard, full, what, NULL, &e), &e);
    lua_settop(L, 3);
    return 1;
}

static int iall_gather(lua_State *L, ml_comm *c, const char *fn)
{
    lua_settop(L, 4);
    ml_tensor *shard = ml_checktensor_named(L, 2, fn, "argument #1 (shard)");
    ml_tensor *full = ml_checktensor_named(L, 3, fn, "argument #2 (full)");
    const char *what = check_string(L, 4, fn, "what");
    l_req *q = lua_newuserdatauv(L, sizeof *q, 1);
    q->r = NULL;
    luaL_setmetatable(L, REQ_MT);
    lua_pushvalue(L, 1);   /* the group stays while the request does */
    lua_setiuservalue(L, -2, 1);
    ml_err e;
    check_coll(L, fn, ml_comm_all_gather(c, shard, full, what, &q->r, &e), &e);
    return 1;
}

static int reduce_scatter(lua_State *L, ml_comm *c, const char *fn)
{
    lua_settop(L, 5);
    ml_tensor *full = ml_checktensor_named(L, 2, fn, "argument #1 (full)");
    ml_tensor *shard = ml_checktensor_named(L, 3, fn, "argument #2 (shard)");
    const char *what = check_string(L, 4, fn, "what");
    if (!lua_isnil(L, 5) && !lua_isboolean(L, 5))
        ml_error(L, fn, "argument #4 (accumulate) must be a boolean, got %s", luaL_typename(L, 5));
    ml_err e;
    check_coll(L, fn, ml_comm_reduce_scatter(c, full, shard, lua_toboolean(L, 5), what, &e), &e);
    lua_settop(L, 3);
    return 1;
}

static int all_reduce(lua_State *L, ml_comm *c, const char *fn)
{
    lua_settop(L, 3);
    ml_tensor *t = ml_checktensor_named(L, 2, fn, "argument #1 (t)");
    const char *what = check_string(L, 3, fn, "what");
    ml_err e;
    check_coll(L, fn, ml_comm_all_reduce(c, t, what, &e), &e);
    lua_settop(L, 2);
    return 1;
}

static int all_reduce_numbers(lua_State *L, ml_comm *c, const char *fn)
{
    static const char *const ops[] = {"sum", "max", "min"};
    lua_settop(L, 4);
    if (!lua_istable(L, 2))
        ml_error(L, fn, "argument #1 (values) must be a table of numbers, got %s",
                 luaL_typename(L, 2));
    const char *name = check_string(L, 3, fn, "op");
    int op = 0;
    while (op < 3 && strcmp(name, ops[op]) != 0)
        op++;
    if (op == 3)
        ml_error(L, fn, "argument #2 (op) must be 'sum', 'max' or 'min', got '%s'", name);
    const char *what = check_string(L, 4, fn, "what");
    lua_Unsigned n = lua_rawlen(L, 2);
    if (n > INT_MAX / sizeof(double))
        ml_error(L, fn, "argument #1 (values) has too many numbers (%llu)", (unsigned long long)n);
    double *v = lua_newuserdatauv(L, (n ? n : 1) * sizeof *v, 0);   /* freed by the GC on error */
    for (lua_Unsigned i = 0; i < n; i++) {
        if (lua_rawgeti(L, 2, (lua_Integer)i + 1) != LUA_TNUMBER)
            ml_error(L, fn, "argument #1 (values)[%llu] must be a number, got %s",
                     (unsigned long long)i + 1, luaL_typename(L, -1));
        v[i] = lua_tonumber(L, -1);
        lua_pop(L, 1);
    }
    ml_err e;
    check_coll(L, fn, ml_comm_all_reduce_f64(c, v, (int)n, (ml_comm_op)op, what, &e), &e);
    lua_createtable(L, (int)n, 0);
    for (lua_Unsigned i = 0; i < n; i++) {
        lua_pushnumber(L, v[i]);
        lua_rawseti(L, -2, (lua_Integer)i + 1);
    }
    return 1;
}

static int broadcast(lua_State *L, ml_comm *c, const char *fn)
{
    lua_settop(L, 4);
    ml_tensor *t = ml_checktensor_named(L, 2, fn, "argument #1 (t)");
    if (!lua_isinteger(L, 3))
        ml_error(L, fn, "argument #2 (root) must be an integer rank, got %s", luaL_typename(L, 3));
    lua_Integer root = lua_tointeger(L, 3);
    const char *what = check_string(L, 4, fn, "what");
    if (root < 0 || root >= ml_comm_world(c))
        ml_error(L, fn, "argument #2 (root) must be a rank in [0, %d), got %lld", ml_comm_world(c),
                 (long long)root);
    ml_err e;
    check_coll(L, fn, ml_comm_broadcast(c, t, (int)root, what, &e), &e);
    lua_settop(L, 2);
    return 1;
}

/* The table at idx (argument #idx-1) as world row counts >= 0, into rows. */
static void check_rows(lua_State *L, int idx, const char *fn, const char *name, int world,
                       int64_t *rows)
{
    if (!lua_istable(L, idx))
        ml_error(L, fn, "argument #%d (%s) must be a table of %d integers (rows per rank), got %s",
                 idx - 1, name, world, luaL_typename(L, idx));
    if (lua_rawlen(L, idx) != (lua_Unsigned)world)
        ml_error(L, fn, "argument #%d (%s) must have %d entries (one per rank), got %llu", idx - 1,
                 name, world, (unsigned long long)lua_rawlen(L, idx));
    for (int q = 0; q < world; q++) {
        lua_rawgeti(L, idx, q + 1);
        if (!lua_isinteger(L, -1) || lua_tointeger(L, -1) < 0)
            ml_error(L, fn, "argument #%d (%s)[%d] must be an integer >= 0, got %s", idx - 1, name,
                     q + 1, lua_isinteger(L, -1) ? lua_tostring(L, -1) : luaL_typename(L, -1));
        rows[q] = lua_tointeger(L, -1);
        lua_pop(L, 1);
    }
}

static int all_to_all_v(lua_State *L, ml_comm *c, const char *fn)
{
    lua_settop(L, 6);
    int world = ml_comm_world(c);
    ml_tensor *send = ml_checktensor_named(L, 2, fn, "argument #1 (send)");
    ml_tensor *recv = ml_checktensor_named(L, 4, fn, "argument #3 (recv)");
    const char *what = check_string(L, 6, fn, "what");
    int64_t *rows = lua_newuserdatauv(L, 2 * (size_t)world * sizeof *rows, 0);
    check_rows(L, 3, fn, "send_rows", world, rows);
    check_rows(L, 5, fn, "recv_rows", world, rows + world);
    ml_err e;
    check_coll(L, fn, ml_comm_all_to_all_v(c, send, rows, recv, rows + world, what, &e), &e);
    lua_settop(L, 4);
    return 1;
}

static int barrier(lua_State *L, ml_comm *c, const char *fn)
{
    const char *what = check_string(L, 2, fn, "what");
    ml_err e;
    check_coll(L, fn, ml_comm_barrier(c, what, &e), &e);
    return 0;
}

/* A new group of this group's ranks (every one calls it): its userdata
 * holds the group it was split from (user value 1). */
static int split(lua_State *L, ml_comm *c, const char *fn)
{
    lua_settop(L, 4);
    int color = check_nonneg_int(L, 2, fn, "color");
    int key = check_nonneg_int(L, 3, fn, "key");
    const char *label = lua_isnil(L, 4) ? NULL : check_string(L, 4, fn, "label");
    l_comm *b = lua_newuserdatauv(L, sizeof *b, 1);
    b->c = NULL;
    luaL_setmetatable(L, GROUP_MT);
    lua_pushvalue(L, 1);
    lua_setiuservalue(L, -2, 1);
    ml_err e;
    check_coll(L, fn, ml_comm_split(c, color, key, label, &b->c, &e), &e);
    return 1;
}

static int rank(lua_State *L, ml_comm *c, const char *fn)
{
    (void)fn;
    lua_pushinteger(L, ml_comm_rank(c));
    return 1;
}

static int world(lua_State *L, ml_comm *c, const char *fn)
{
    (void)fn;
    lua_pushinteger(L, ml_comm_world(c));
    return 1;
}

typedef struct {
    const char *name, *fn, *method;   /* "all_gather", "moelua.dist.all_gather", "...Group:..." */
    int (*impl)(lua_State *L, ml_comm *c, const char *fn);
    int module;                       /* also a module function on the world */
    int nargs;                        /* the arguments it takes after the group */
} group_op;

#define OP(name, module, nargs) \
    {#name, "moelua.dist." #name, "moelua.dist.Group:" #name, name, module, nargs}
static const group_op group_ops[] = {
    OP(set_context, 1, 1), OP(all_gather, 1, 3), OP(iall_gather, 1, 3), OP(reduce_scatter, 1, 4),
    OP(all_reduce, 1, 2), OP(all_reduce_numbers, 1, 3), OP(broadcast, 1, 3),
    OP(all_to_all_v, 1, 5), OP(barrier, 1, 1), OP(split, 1, 3),
    OP(rank, 0, 0), OP(world, 0, 0),   /* the module's answer before init too */
};
#undef OP

/* dist.<op>(...): the op on the world's group (inserted at 1). */
static int call_on_world(lua_State *L)
{
    const group_op *op = lua_touserdata(L, lua_upvalueindex(1));
    ml_args(L, op->nargs, op->fn);
    ml_comm *c = check_comm(L, op->fn);
    push_world(L);
    lua_insert(L, 1);
    return op->impl(L, c, op->fn);
}

/* g:<op>(...) */
static int call_on_group(lua_State *L)
{
    const group_op *op = lua_touserdata(L, lua_upvalueindex(1));
    ml_args(L, op->nargs + 1, op->method);
    l_comm *b = luaL_testudata(L, 1, GROUP_MT);
    if (!b)
        ml_error(L, op->method, "self must be a moelua.dist group (call it as g:%s(...)), got %s",
                 op->name, luaL_typename(L, 1));
    if (!b->c)
        ml_error(L, op->method, "the group was freed");
    return op->impl(L, b->c, op->method);
}

/* Sets group_ops' closures (calling `call`) in the table at -1: every op,
 * or the module's only. */
static void set_group_ops(lua_State *L, lua_CFunction call, int module_only)
{
    for (size_t i = 0; i < sizeof group_ops / sizeof group_ops[0]; i++) {
        if (module_only && !group_ops[i].module)
            continue;
        lua_pushlightuserdata(L, (void *)&group_ops[i]);
        lua_pushcclosure(L, call, 1);
        lua_setfield(L, -2, group_ops[i].name);
    }
}

/* The request at 1 and its group's communicator (NULL when freed at shutdown). */
static l_req *check_req(lua_State *L, ml_comm **c)
{
    l_req *q = luaL_checkudata(L, 1, REQ_MT);
    lua_getiuservalue(L, 1, 1);
    l_comm *b = lua_touserdata(L, -1);
    lua_pop(L, 1);
    *c = b ? b->c : NULL;
    return q;
}

static int l_req_test(lua_State *L)
{
    ml_args(L, 1, "moelua.dist.Request:test");
    ml_comm *c;
    l_req *q = check_req(L, &c);
    int done = 1;
    ml_err e;
    if (q->r)
        check_coll(L, "moelua.dist.Request:test", ml_comm_test(c, q->r, &done, &e), &e);
    lua_pushboolean(L, done);
    return 1;
}

static int l_req_wait(lua_State *L)
{
    ml_args(L, 1, "moelua.dist.Request:wait");
    ml_comm *c;
    l_req *q = check_req(L, &c);
    ml_err e;
    if (q->r)
        check_coll(L, "moelua.dist.Request:wait", ml_comm_wait(c, q->r, &e), &e);
    return 0;
}

/* __gc and __close: wait silently when pending, free; idempotent. */
static int l_req_release(lua_State *L)
{
    l_req *q = luaL_checkudata(L, 1, REQ_MT);
    ml_comm_req_free(q->r);
    q->r = NULL;
    return 0;
}

static int l_dist_progress(lua_State *L)
{
    ml_args(L, 0, "moelua.dist.progress");
    ml_comm *c = comm_of(L);
    if (c)
        ml_comm_progress(c);
    return 0;
}

static int l_dist_abort(lua_State *L)
{
    ml_args(L, 1, "moelua.dist.abort");
    if (lua_type(L, 1) != LUA_TSTRING)
        ml_error(L, "moelua.dist.abort", "argument #1 (msg) must be a string, got %s",
                 luaL_typename(L, 1));
    const char *msg = lua_tostring(L, 1);
    ml_comm_abort(msg);   /* returns only in a world of one rank */
    luaL_where(L, 1);
    lua_pushvalue(L, 1);
    lua_concat(L, 2);
    return lua_error(L);
}

static const luaL_Reg dist_functions[] = {
    {"init", l_dist_init},
    {"launched", l_dist_launched},
    {"initialized", l_dist_initialized},
    {"nccl", l_dist_nccl},
    {"rank", l_dist_rank},
    {"world", l_dist_world},
    {"world_group", l_dist_world_group},
    {"plan_world", l_dist_plan_world},
    {"planned", l_dist_planned},
    {"planned_group", l_dist_planned_group},
    {"progress", l_dist_progress},
    {"abort", l_dist_abort},
    {NULL, NULL}
};

static const luaL_Reg req_methods[] = {
    {"test", l_req_test},
    {"wait", l_req_wait},
    {NULL, NULL}
};

static const luaL_Reg req_meta[] = {
    {"__gc", l_req_release},
    {"__close", l_req_release},
    {NULL, NULL}
};

int luaopen_moelua_dist(lua_State *L)
{
    ml_host_of(L);  /* refuse to load outside the host */
    luaL_requiref(L, "moelua.tensor", luaopen_moelua_tensor, 0);
    lua_pop(L, 1);
    if (luaL_newmetatable(L, GROUP_MT)) {
        lua_pushcfunction(L, l_comm_gc);
        lua_setfield(L, -2, "__gc");
        lua_newtable(L);
        set_group_ops(L, call_on_group, 0);
        lua_setfield(L, -2, "__index");
    }
    lua_pop(L, 1);
    luaL_newmetatable(L, REQ_MT);
    luaL_setfuncs(L, req_meta, 0);
    luaL_newlib(L, req_methods);
    lua_setfield(L, -2, "__index");
    lua_pop(L, 1);
    luaL_newlibtable(L, dist_functions);
    lua_pushvalue(L, -1);   /* dist.init returns the library */
    luaL_setfuncs(L, dist_functions, 1);
    set_group_ops(L, call_on_world, 1);
    return 1;
}
