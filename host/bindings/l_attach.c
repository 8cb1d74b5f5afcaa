/*
 * host/bindings/l_attach.c - the Lua library `moelua.attach`: the job's side of
 * `moelua attach RUN_DIR` as a moelua.Attach userdata over the server of
 * host/bindings/attach.h (the socket RUN_DIR/attach/sock, 0600 in a 0700 directory,
 * and the thread that serves it). No network port.
 *
 *   attach.listen(run_dir [, instructions]) -> handle (the directory 0700,
 *       the socket 0600; the server thread running; instructions: the limit
 *       per request line, default 1e6). A socket there that a job serves
 *       is an error ("another job serves ..."), one left by a dead job is
 *       replaced.
 *   attach.publish(h, json)         the snapshot the server thread answers
 *       queries from: a JSON object with any of stats, ledger, progress,
 *       overrides, staged (replaces the last one)
 *   attach.poll(h [, timeout_ms])   -> {{client = id, code = line}, ...}, n_clients
 *       the lines that call a control, queued since the last poll, in
 *       arrival order; timeout_ms > 0 waits that long for one first (a
 *       paused job's sleep). n_clients: the clients attached now; a peer
 *       refused by its SO_PEERCRED uid never counts.
 *   attach.reply(h, client, text)   -> true, or false when the client is gone
 *       queues text as the reply to that line; the client's next line is
 *       read after it
 *   attach.close(h)                 wakes and joins the server thread,
 *       closes every socket, removes sock while it is the one it bound
 *       (also __gc / __close)
 *
 * Not here: the server (host/bindings/attach.c), what a line sees and its reply text
 * (lua/moelua/attach_env.lua), running the controls and publishing the
 * snapshot (lua/moelua/remote.lua), the client (host/bindings/repl.c).
 */
#include "attach.h"
#include "l_util.h"
#include "libs.h"

#include <lualib.h>

#include <stdio.h>
#include <string.h>

#define ML_ATTACH_MT "moelua.Attach"

/* The userdata: a NULL once closed; path kept for __tostring. */
typedef struct {
    ml_attach *a;
    char path[ML_ATTACH_PATH_MAX];
} ml_attach_handle;

static ml_attach *check_attach(lua_State *L, int idx, const char *fn)
{
    ml_attach_handle *h = luaL_testudata(L, idx, ML_ATTACH_MT);
    if (!h)
        ml_error(L, fn, "argument #%d: expected an attach handle, got %s", idx, luaL_typename(L, idx));
    if (!h->a)
        ml_error(L, fn, "argument #%d: the attach handle is closed", idx);
    return h->a;
}

static void attach_release(ml_attach_handle *h)
{
    ml_attach *a = h->a;
    h->a = NULL;
    ml_attach_free(a);
}

/* Pushes the path of `file` (module `name`) by the caller's package.path:
 * the server thread's state has no package library to find it. */
static void find_lua(lua_State *L, const char *fn, const char *name, const char *file)
{
    luaL_getsubtable(L, LUA_REGISTRYINDEX, LUA_LOADED_TABLE);
    if (lua_getfield(L, -1, LUA_LOADLIBNAME) != LUA_TTABLE ||
        lua_getfield(L, -1, "searchpath") != LUA_TFUNCTION)
        ml_error(L, fn, "no package.searchpath to find %s for the server thread", file);
    lua_pushstring(L, name);
    lua_getfield(L, -3, "path");
    lua_call(L, 2, 2);  /* loaded, package, path or nil, nil or why */
    if (lua_type(L, -2) != LUA_TSTRING) {
        const char *why = lua_tostring(L, -1);
        ml_error(L, fn, "cannot find %s for the server thread:%s", file, why ? why : "");
    }
    lua_pop(L, 1);
    lua_replace(L, -3);  /* path, package */
    lua_pop(L, 1);
}

static int l_attach_listen(lua_State *L)
{
    static const char fn[] = "moelua.attach.listen";
    ml_args(L, 2, fn);
    size_t rlen;
    const char *run_dir = luaL_checklstring(L, 1, &rlen);
    lua_Integer limit = luaL_optinteger(L, 2, 1000000);
    if (rlen == 0 || strlen(run_dir) != rlen)
        ml_error(L, fn, "argument #1 (run_dir): expected a non-empty path without NUL bytes");
    if (limit < 1 || limit > 1000000000)
        ml_error(L, fn, "argument #2 (instructions): expected 1..1e9, got %lld", (long long)limit);
    char path[4200];
    int plen = snprintf(path, sizeof path, "%s/attach/sock", run_dir);
    if ((size_t)plen >= ML_ATTACH_PATH_MAX)
        ml_env_error(L, "%s: socket path '%s' is %d bytes, over the %zu-byte limit of a Unix socket "
                     "address: use a shorter run directory", fn, path, plen, ML_ATTACH_PATH_MAX - 1);
    find_lua(L, fn, "dkjson", "dkjson.lua");
    find_lua(L, fn, "moelua.attach_env", "moelua/attach_env.lua");
    find_lua(L, fn, "moelua.pretty", "moelua/pretty.lua");
    const char *json_path = lua_tostring(L, -3), *env_path = lua_tostring(L, -2);
    const char *pretty_path = lua_tostring(L, -1);
    /* the userdata first, in a safe empty state: a later error frees it */
    ml_attach_handle *h = lua_newuserdatauv(L, sizeof *h, 0);
    h->a = NULL;
    memcpy(h->path, path, (size_t)plen + 1);  /* plen < sizeof h->path: checked above */
    luaL_setmetatable(L, ML_ATTACH_MT);
    h->a = ml_attach_new();
    if (!h->a)
        ml_error(L, fn, "out of memory");
    char err[1024];
    if (ml_attach_listen(h->a, path, limit, json_path, env_path, pretty_path, err, sizeof err) != 0) {
        attach_release(h);
        /* a live job on the socket, or the system refusing one: not a bug,
         * and no line of the caller's to point at */
        ml_env_error(L, "%s: %s", fn, err);
    }
    return 1;
}

static int l_attach_publish(lua_State *L)
{
    static const char fn[] = "moelua.attach.publish";
    ml_args(L, 2, fn);
    ml_attach *a = check_attach(L, 1, fn);
    size_t len;
    const char *text = luaL_checklstring(L, 2, &len);
    if (ml_attach_publish(a, text, len) != 0)
        ml_error(L, fn, "out of memory copying a %zu-byte snapshot", len);
    return 0;
}

static int l_attach_poll(lua_State *L)
{
    static const char fn[] = "moelua.attach.poll";
    ml_args(L, 2, fn);
    ml_attach *a = check_attach(L, 1, fn);
    lua_Integer timeout = luaL_optinteger(L, 2, 0);
    if (timeout < 0 || timeout > 60000)
        ml_error(L, fn, "argument #2 (timeout_ms): expected 0..60000, got %lld", (long long)timeout);
    lua_newtable(L);
    ml_attach_wait(a, timeout);
    /* Each request is copied into Lua before it leaves the queue: a memory
     * error then leaks nothing. */
    int client;
    const char *code;
    size_t len;
    for (lua_Integer n = 1; ml_attach_peek(a, &client, &code, &len); n++) {
        lua_createtable(L, 0, 2);
        lua_pushinteger(L, client);
        lua_setfield(L, -2, "client");
        lua_pushlstring(L, code, len);
        lua_setfield(L, -2, "code");
        lua_rawseti(L, -2, n);
        ml_attach_drop(a);
    }
    lua_pushinteger(L, ml_attach_clients(a));
    return 2;
}

static int l_attach_reply(lua_State *L)
{
    static const char fn[] = "moelua.attach.reply";
    ml_args(L, 3, fn);
    ml_attach *a = check_attach(L, 1, fn);
    lua_Integer id = luaL_checkinteger(L, 2);
    size_t len;
    const char *text = luaL_checklstring(L, 3, &len);
    if (memchr(text, '\0', len))
        ml_error(L, fn, "argument #3 (text): contains a NUL byte");
    int queued = ml_attach_reply(a, (long long)id, text, len);
    if (queued < 0)
        ml_error(L, fn, "out of memory queueing a %zu-byte reply", len);
    lua_pushboolean(L, queued);
    return 1;
}

static int l_attach_gc(lua_State *L)
{
    ml_attach_handle *h = luaL_testudata(L, 1, ML_ATTACH_MT);
    if (h)
        attach_release(h);
    return 0;
}

static int l_attach_close(lua_State *L)
{
    ml_args(L, 1, "moelua.attach.close");
    ml_attach_handle *h = luaL_checkudata(L, 1, ML_ATTACH_MT);
    attach_release(h);
    return 0;
}

static int l_attach_tostring(lua_State *L)
{
    ml_attach_handle *h = luaL_checkudata(L, 1, ML_ATTACH_MT);
    lua_pushfstring(L, "moelua.Attach(%s%s)", h->path, h->a ? "" : ", closed");
    return 1;
}

static const luaL_Reg attach_methods[] = {
    {"publish", l_attach_publish},
    {"poll", l_attach_poll},
    {"reply", l_attach_reply},
    {"close", l_attach_close},
    {NULL, NULL}
};

static const luaL_Reg attach_meta[] = {
    {"__gc", l_attach_gc},
    {"__close", l_attach_gc},
    {"__tostring", l_attach_tostring},
    {NULL, NULL}
};

static const luaL_Reg attach_funcs[] = {
    {"listen", l_attach_listen},
    {"publish", l_attach_publish},
    {"poll", l_attach_poll},
    {"reply", l_attach_reply},
    {"close", l_attach_close},
    {NULL, NULL}
};

int luaopen_moelua_attach(lua_State *L)
{
    if (luaL_newmetatable(L, ML_ATTACH_MT)) {
        luaL_setfuncs(L, attach_meta, 0);
        luaL_newlib(L, attach_methods);
        lua_setfield(L, -2, "__index");
    }
    lua_pop(L, 1);
    luaL_newlib(L, attach_funcs);
    return 1;
}
