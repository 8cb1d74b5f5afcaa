/*
 * tests/c/test_signals.c - Ctrl-C's handler (host/bindings/l_host.c) must not
 * write where the interrupted code keeps its stack pointer, printing TAP.
 *
 * oneDNN 2.6's sgemm kernel (xbyak_gemm, K > 84) runs with its stack
 * pointer inside a workspace it mallocs. A signal frame pushed there lands
 * below the pointer, on the heap: a Ctrl-C during a GEMM corrupted malloc's
 * chunks (found by train_spec's Ctrl-C specs on a -O3 build). This test does
 * what that kernel does, on x86-64: moves the stack pointer into a filled
 * buffer, sends itself SIGINT from there, and checks that the handler ran,
 * that the buffer is untouched, and that restore puts the old signal stack
 * back. Not here: what an interrupt does to a running job (train_spec,
 * interrupt_spec).
 */
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>

#include <lauxlib.h>
#include <lualib.h>

#include "l_host.h"
#include "tap.h"

#define WORKSPACE (64 * 1024)
#define FILL 0xa5

static unsigned char workspace[WORKSPACE] __attribute__((aligned(64)));

#if defined(__x86_64__)
/* kill(getpid(), SIGINT) with the stack pointer at `top`, as code that runs
 * on a borrowed stack would be interrupted: the signal is delivered on the
 * system call's return, while the stack pointer is still there. */
static void sigint_on_borrowed_stack(void *top)
{
    __asm__ volatile(
        "mov %%rsp, %%r12\n\t"
        "mov %0, %%rsp\n\t"
        "mov %1, %%eax\n\t"
        "syscall\n\t"               /* getpid */
        "mov %%eax, %%edi\n\t"
        "mov %2, %%esi\n\t"
        "mov %3, %%eax\n\t"
        "syscall\n\t"               /* kill(pid, SIGINT) */
        "mov %%r12, %%rsp\n\t"
        :
        : "r"(top), "i"(SYS_getpid), "i"(SIGINT), "i"(SYS_kill)
        : "rax", "rdi", "rsi", "rcx", "r11", "r12", "memory");
}

static size_t changed_bytes(void)
{
    size_t n = 0;
    for (size_t i = 0; i < WORKSPACE; i++)
        n += workspace[i] != FILL;
    return n;
}
#endif

int main(void)
{
    lua_State *L = luaL_newstate();
    stack_t before, during, after;
    sigaltstack(NULL, &before);

    ml_signals_saved saved;
    ml_signals_arm(L, &saved);
    sigaltstack(NULL, &during);
    struct sigaction armed;
    sigaction(SIGINT, NULL, &armed);
    ok((armed.sa_flags & SA_ONSTACK) && !(during.ss_flags & SS_DISABLE) && during.ss_size >= 16384,
       "SIGINT's handler runs on an alternate stack (%zu bytes) on the Lua thread", during.ss_size);

#if defined(__x86_64__)
    memset(workspace, FILL, sizeof workspace);
    sigint_on_borrowed_stack(workspace + WORKSPACE / 2);
    ok(*ml_interrupt_flag() == 1, "SIGINT with the stack pointer in a borrowed workspace reaches the handler");
    size_t n = changed_bytes();
    ok(n == 0, "the workspace below the stack pointer is untouched (%zu bytes changed)", n);
#endif

    ml_signals_restore(L, &saved);
    sigaltstack(NULL, &after);
    ok(*ml_interrupt_flag() == 0, "restore clears the flag");
    ok(after.ss_flags == before.ss_flags && after.ss_sp == before.ss_sp &&
       after.ss_size == before.ss_size, "restore puts the thread's previous signal stack back");
    struct sigaction now;
    sigaction(SIGINT, NULL, &now);
    ok(now.sa_handler == SIG_DFL, "restore puts SIGINT's previous action back");
    lua_close(L);
    return tap_done();
}
