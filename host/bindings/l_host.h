/*
 * host/bindings/l_host.h - SIGINT/SIGTERM for the thread that owns the Lua state
 * (host/bindings/l_host.c): the flag kernels poll, the handlers that host/bindings/main.c
 * arms while a chunk runs, and the holds of moelua.host.hold_interrupts.
 */
#ifndef ML_L_HOST_H
#define ML_L_HOST_H

#include <lua.h>
#include <signal.h>

/* The Ctrl-C flag that ml_host.interrupt points to: set by the first signal
 * outside a hold, cleared by whoever consumes it (a kernel's binding or the
 * hook). Never set during a hold. */
volatile sig_atomic_t *ml_interrupt_flag(void);

/* The handlers a chunk runs under, and what they replaced: the actions
 * and the calling thread's alternate signal stack. */
typedef struct {
    struct sigaction sigint, sigterm;
    stack_t stack;
} ml_signals_saved;

/* Install the handlers for a chunk run on L (the main thread), on an
 * alternate stack for this thread: the first signal sets the flag and arms
 * a hook that raises "interrupted!". */
void ml_signals_arm(lua_State *L, ml_signals_saved *old);
/* Put back what ml_signals_arm replaced, remove the hook, clear the flag. */
void ml_signals_restore(lua_State *L, const ml_signals_saved *old);

#endif
