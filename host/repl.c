/*
 * host/repl.c - the REPL: GNU readline for editing and history (saved in
 * ~/.moelua_history), multi-line input (a chunk that ends in <eof> waits for
 * more lines), expression results printed with tostring (a tensor prints
 * its metadata and a few values), errors with a traceback. Ctrl-C while a
 * computation runs interrupts it and returns to the prompt (host/main.c).
 */
#include "repl.h"

#include <lauxlib.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <readline/history.h>
#include <readline/readline.h>

#define PROMPT  "> "
#define PROMPT2 ">> "
#define EOFMARK "<eof>"
#define HISTORY_LINES 1000

static char history_path[4096];

static void history_open(void)
{
    const char *home = getenv("HOME");
    if (!home || !isatty(0))
        return;
    snprintf(history_path, sizeof history_path, "%s/.moelua_history", home);
    read_history(history_path);
}

static void history_close(void)
{
    if (!history_path[0])
        return;
    write_history(history_path);
    history_truncate_file(history_path, HISTORY_LINES);
}

/* One line on the stack (without its newline); 0 at end of input. */
static int pushline(lua_State *L, int firstline)
{
    char *line;
    if (isatty(0)) {
        line = readline(firstline ? PROMPT : PROMPT2);
        if (!line)
            return 0;
    } else {
        /* Piped input: no editing, no echo of prompts to keep output clean. */
        size_t cap = 0;
        line = NULL;
        ssize_t n = getline(&line, &cap, stdin);
        if (n < 0) {
            free(line);
            return 0;
        }
        if (n > 0 && line[n - 1] == '\n')
            line[n - 1] = '\0';
    }
    lua_pushstring(L, line);
    free(line);
    return 1;
}

static int incomplete(lua_State *L, int status)
{
    if (status == LUA_ERRSYNTAX) {
        size_t lmsg;
        const char *msg = lua_tolstring(L, -1, &lmsg);
        size_t lmark = sizeof(EOFMARK) - 1;
        if (lmsg >= lmark && strcmp(msg + lmsg - lmark, EOFMARK) == 0) {
            lua_pop(L, 1);
            return 1;
        }
    }
    return 0;
}

/* Try the line as `return <line>` so expressions print their value. */
static int addreturn(lua_State *L)
{
    const char *line = lua_tostring(L, -1);
    const char *retline = lua_pushfstring(L, "return %s;", line);
    int status = luaL_loadbuffer(L, retline, strlen(retline), "=stdin");
    if (status == LUA_OK) {
        lua_remove(L, -2);
        if (line[0] != '\0' && isatty(0))
            add_history(line);
    } else {
        lua_pop(L, 2);
    }
    return status;
}

static int multiline(lua_State *L)
{
    for (;;) {
        size_t len;
        const char *line = lua_tolstring(L, 1, &len);
        int status = luaL_loadbuffer(L, line, len, "=stdin");
        if (!incomplete(L, status) || !pushline(L, 0)) {
            if (isatty(0))
                add_history(line);
            return status;
        }
        lua_pushliteral(L, "\n");
        lua_insert(L, -2);
        lua_concat(L, 3);
    }
}

static int loadline(lua_State *L)
{
    lua_settop(L, 0);
    if (!pushline(L, 1))
        return -1;
    int status = addreturn(L);
    if (status != LUA_OK)
        status = multiline(L);
    lua_remove(L, 1);
    return status;
}

static void print_results(lua_State *L)
{
    int n = lua_gettop(L);
    if (n == 0)
        return;
    luaL_checkstack(L, LUA_MINSTACK, "too many results to print");
    lua_getglobal(L, "print");
    lua_insert(L, 1);
    if (lua_pcall(L, n, 0, 0) != LUA_OK)
        ml_report(L, LUA_ERRRUN);
}

void ml_repl(lua_State *L)
{
    int status;
    history_open();
    while ((status = loadline(L)) != -1) {
        if (status == LUA_OK)
            status = ml_docall(L, 0, LUA_MULTRET);
        if (status == LUA_OK)
            print_results(L);
        else
            ml_report(L, status);
        fflush(stdout);
    }
    lua_settop(L, 0);
    if (isatty(0))
        fputc('\n', stdout);
    fflush(stdout);
    history_close();
}
