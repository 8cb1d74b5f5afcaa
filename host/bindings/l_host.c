/*
 * host/bindings/l_host.c - the Lua library `moelua.host`, and SIGINT / SIGTERM
 * (Ctrl-C, a job asked to stop) for the thread that owns the Lua state.
 *
 *   held, ... = host.hold_interrupts(fn, ...)
 *       runs fn(...) with SIGINT and SIGTERM held, and returns the number
 *       of signals held (0 or 1) followed by fn's results. fn's error is
 *       raised again, unchanged, after the hold has ended. For work that
 *       must not be cut in half (the trainer's checkpoint save): the caller
 *       decides what a held interrupt means once the work is done. Holds
 *       nest: an inner hold returns what arrived during it, and that
 *       signal stays held for the outer one.
 *
 *   ... = host.interruptible(fn, ...)
 *       fn(...) inside a hold as if outside it: a signal interrupts fn
 *       (kernels stop, the hook raises), and fn's results or error come
 *       back unchanged. A signal already held when it is called interrupts
 *       fn before it starts (the interrupt error, the signal consumed); one
 *       that arrived in fn but stopped nothing (fn's last instructions) is
 *       held once fn has returned. Outside a hold it is a plain call. For
 *       the one part of a held loop that a Ctrl-C may cut short: the
 *       trainer's loop holds everything but each step's forward and
 *       backward, so no signal lands between an update and the bookkeeping
 *       that records it.
 *
 *   host.is_interrupt(err)
 *       true when err is the interrupt error Ctrl-C raised last (a kernel's
 *       "<fn>: interrupted" or the hook's "interrupted!", as raised): for a
 *       pcall that skips what fails but must let Ctrl-C through.
 *
 *   taken = host.take_interrupt()
 *       true when a signal is held, which it clears: the caller acts on it
 *       now (the trainer saves and stops), and the next signal is a first
 *       one again, held by the save's own hold instead of aborting it.
 *       false otherwise (always outside a hold).
 *
 * What a signal does (lua.c's scheme, plus holds):
 * - Outside a hold, the first sets the flag that kernels poll
 *   (ml_host.interrupt) and arms a hook. It is consumed once: by a kernel,
 *   whose binding raises "<fn>: interrupted" (host/bindings/l_util.c), or by the
 *   hook at the next Lua instruction ("interrupted!"). A second one while
 *   the first is still pending means C code that does not poll (a long
 *   pattern match, a blocking call): it writes a line and kills the process
 *   by that signal, as the default action would have.
 * - In a hold, the first is held: one line on stderr and nothing else, so
 *   neither kernels nor the hook stop the work. A second aborts the process
 *   at once (status 130) with a line saying that the work is lost.
 * The handler may run on any thread (OpenMP workers too): it touches only
 * the sig_atomic_t flags below, write(2), _exit, raise and the hook (as
 * lua.c does). Only the Lua thread changes the hold depth.
 * On the Lua thread it runs on an alternate stack of its own (SA_ONSTACK):
 * oneDNN 2.6's sgemm kernel (xbyak_gemm, for K > 84) moves the stack
 * pointer into a workspace it mallocs, and a signal frame pushed there
 * (3.3 KiB with AVX-512 state) overwrote the heap below it: "corrupted
 * size vs. prev_size" after a Ctrl-C (tests/c/test_signals.c). Other
 * threads keep their own stacks; Linux hands a process's signal to the
 * main thread unless it blocks it or already has one pending.
 *
 * Not here: arming the handlers around each chunk (host/bindings/main.c ml_docall),
 * consuming the flag in a binding (host/bindings/l_util.c), the REPL's own Ctrl-C at
 * the prompt (host/bindings/repl.c), what the trainer does with a held interrupt
 * (moelua.train).
 */
#include "l_host.h"
#include "l_util.h"
#include "libs.h"
#include "../runtime/comm.h"

#include <string.h>
#include <unistd.h>

#define HELD_MSG  "moelua: interrupt held until the work in progress is done (a step's update, " \
                  "a checkpoint; interrupt again to abort and lose it)\n"
#define ABORT_MSG "moelua: second interrupt while the first is held: aborting, " \
                  "the checkpoint or step being finished is lost\n"
#define KILL_MSG  "moelua: second interrupt before the first was handled " \
                  "(a C call that does not stop): killing the process\n"

static volatile sig_atomic_t interrupted;   /* pending, outside a hold */
static char handler_stack[64 * 1024];      /* the handler's stack on the Lua thread */
static volatile sig_atomic_t hold_depth;    /* holds running, nested */
static volatile sig_atomic_t held;          /* signals held since the outermost hold began */
static lua_State *main_L;                   /* the state whose hook the handler arms */
static volatile sig_atomic_t quiet;         /* a rank > 0 under mpiexec: rank 0 says it for all */

volatile sig_atomic_t *ml_interrupt_flag(void)
{
    return &interrupted;
}

static void lstop(lua_State *L, lua_Debug *ar)
{
    (void)ar;
    lua_sethook(L, NULL, 0, 0);
    if (!interrupted)
        return;  /* a kernel saw it first and its binding raised already */
    interrupted = 0;
    ml_interrupt_error(L, NULL);
}

/* write(2) of a literal: async-signal-safe, unlike stdio. */
#define SAY(msg) do { ssize_t r_ = write(STDERR_FILENO, msg, sizeof msg - 1); (void)r_; } while (0)

static void on_signal(int sig)
{
    if (hold_depth > 0) {
        if (held) {
            SAY(ABORT_MSG);
            _exit(130);
        }
        held = 1;
        if (!quiet)
            SAY(HELD_MSG);
        return;
    }
    if (interrupted) {
        SAY(KILL_MSG);
        signal(sig, SIG_DFL);
        raise(sig);   /* delivered, with the default action, when this handler returns */
        return;
    }
    interrupted = 1;
    lua_sethook(main_L, lstop, LUA_MASKCALL | LUA_MASKRET | LUA_MASKLINE | LUA_MASKCOUNT, 1);
}

void ml_signals_arm(lua_State *L, ml_signals_saved *old)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sa.sa_flags = SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    stack_t ss = {.ss_sp = handler_stack, .ss_size = sizeof handler_stack};
    interrupted = 0;
    main_L = L;
    sigaltstack(&ss, &old->stack);
    sigaction(SIGINT, &sa, &old->sigint);
    sigaction(SIGTERM, &sa, &old->sigterm);
}

void ml_signals_restore(lua_State *L, const ml_signals_saved *old)
{
    sigaction(SIGINT, &old->sigint, NULL);
    sigaction(SIGTERM, &old->sigterm, NULL);
    sigaltstack(&old->stack, NULL);
    lua_sethook(L, NULL, 0, 0);
    interrupted = 0;
}

/* An interrupt still pending (it arrived between the call hook and here)
 * becomes a held one: kernels inside a hold must not see the flag. */
static void hold_pending(lua_State *L)
{
    if (interrupted) {
        interrupted = 0;
        held = 1;
        lua_rawgeti(L, LUA_REGISTRYINDEX, LUA_RIDX_MAINTHREAD);
        lua_sethook(lua_tothread(L, -1), NULL, 0, 0);
        lua_pop(L, 1);
    }
}

/* Enter a hold; returns the signals held before it, so that its own count
 * is the difference at the end. */
static int hold_begin(lua_State *L)
{
    quiet = ml_comm_world_rank() > 0;   /* (MPI may have started since the last hold) */
    hold_depth++;
    int before = held;
    hold_pending(L);
    return before;
}

static void hold_end(void)
{
    if (--hold_depth == 0)
        held = 0;   /* the caller of the outermost hold has the count now */
}

static int l_host_hold_interrupts(lua_State *L)
{
    ml_checktype_named(L, 1, "moelua.host.hold_interrupts", "argument #1 (fn)", LUA_TFUNCTION);
    int before = hold_begin(L);
    int status = lua_pcall(L, lua_gettop(L) - 1, LUA_MULTRET, 0);
    int n = held > before;   /* 0 when an interruptible() inside consumed the one held before */
    hold_end();
    if (status != LUA_OK)
        return lua_error(L);   /* fn's error object, as it was raised */
    luaL_checkstack(L, 1, "too many results");
    lua_pushinteger(L, n);
    lua_insert(L, 1);
    return lua_gettop(L);
}

static int l_host_interruptible(lua_State *L)
{
    ml_checktype_named(L, 1, "moelua.host.interruptible", "argument #1 (fn)", LUA_TFUNCTION);
    int depth = hold_depth;
    if (depth == 0) {
        lua_call(L, lua_gettop(L) - 1, LUA_MULTRET);
        return lua_gettop(L);
    }
    if (held) {   /* held before fn: it is interrupted before it starts */
        held = 0;
        return ml_interrupt_error(L, NULL);
    }
    hold_depth = 0;
    int status = lua_pcall(L, lua_gettop(L) - 1, LUA_MULTRET, 0);
    hold_depth = depth;
    hold_pending(L);
    if (status != LUA_OK)
        return lua_error(L);
    return lua_gettop(L);
}

static int l_host_is_interrupt(lua_State *L)
{
    ml_args(L, 1, "moelua.host.is_interrupt");
    luaL_checkany(L, 1);
    lua_pushboolean(L, ml_is_interrupt_error(L, 1));
    return 1;
}

static int l_host_take_interrupt(lua_State *L)
{
    ml_args(L, 0, "moelua.host.take_interrupt");
    int taken = held != 0;
    if (taken)   /* a signal now finds held set and aborts: none is lost between the two lines */
        held = 0;
    lua_pushboolean(L, taken);
    return 1;
}

static const luaL_Reg host_functions[] = {
    {"hold_interrupts", l_host_hold_interrupts},
    {"interruptible", l_host_interruptible},
    {"take_interrupt", l_host_take_interrupt},
    {"is_interrupt", l_host_is_interrupt},
    {NULL, NULL}
};

int luaopen_moelua_host(lua_State *L)
{
    ml_host_of(L);  /* refuse to load outside the host */
    luaL_newlib(L, host_functions);
    return 1;
}
