/*
 * host/bindings/repl.h - the interactive loop of `moelua -i`, and the protected-call
 * helpers it shares with host/bindings/main.c.
 */
#ifndef ML_REPL_H
#define ML_REPL_H

#include <lua.h>

/* pcall with a traceback handler and Ctrl-C armed; returns the status. */
int ml_docall(lua_State *L, int narg, int nres);
/* Print the error on the stack top (if status != OK) and pop it. */
int ml_report(lua_State *L, int status);
/* Read-eval-print until end of input. */
void ml_repl(lua_State *L);
/* `moelua attach RUN_DIR`: send each line to the job's socket, print each
 * reply; returns the exit status (no Lua state involved). */
int ml_attach_repl(const char *run_dir);

#endif
