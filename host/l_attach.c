/*
 * host/l_attach.c - the Lua library `moelua.attach`: the job's side of
 * `moelua attach RUN_DIR`, a Unix stream socket RUN_DIR/attach/sock in a
 * directory of mode 0700. No network port.
 *
 * Two threads. A server thread, started by listen, owns every socket: it
 * accepts, refuses a peer of another uid, reads lines, enforces the line
 * limit and writes every reply. It answers each request line itself, at
 * once, in its own small Lua state (base, string, table, math; no io, os,
 * debug or package; 64 MiB at most), against the last snapshot the
 * training thread published: the line runs in a sandbox that sees `stats`,
 * `ledger`, `progress`, `overrides` and `staged` decoded from that JSON
 * text (by dkjson, found on the caller's package.path, which also encodes
 * table results), under the same instruction limit. A line that calls a
 * control (set, checkpoint, pause, resume), even under pcall, is not
 * answered there: it goes, whole, to a queue that the training thread
 * takes at its safe points (poll); the training thread runs it in its own
 * state and hands back the reply (reply), which the server thread sends.
 * Until then the server thread reads nothing more from that client, so its
 * replies keep their order. The training thread never blocks on a socket;
 * the server thread never touches the training thread's Lua state. One
 * mutex guards the snapshot, the two queues and the table of connected
 * clients; a self-pipe wakes the server thread (a reply, close), a
 * condition variable the training thread in poll (a request). The server
 * thread blocks SIGINT and SIGTERM, so Ctrl-C reaches the training
 * thread's handler.
 *
 *   attach.listen(run_dir [, instructions]) -> handle (the directory 0700,
 *       the socket 0600; the server thread running; instructions: the limit
 *       per request line, default 1e6)
 *   attach.publish(h, json)         the snapshot the server thread answers
 *       from: a JSON object with any of stats, ledger, progress, overrides,
 *       staged (replaces the last one)
 *   attach.poll(h [, timeout_ms])   -> {{client = id, code = line}, ...}, n_clients
 *       the control requests queued since the last poll, in arrival order;
 *       timeout_ms > 0 waits that long for one first (a paused job's
 *       sleep). n_clients: the clients attached now; a peer refused by its
 *       SO_PEERCRED uid never counts (it is told so, both uids named, its
 *       input discarded until it leaves or ML_ATTACH_REFUSED_S pass). A
 *       line over ML_ATTACH_LINE bytes gets an error reply and is dropped
 *       up to its newline; the client stays.
 *   attach.reply(h, client, text)   -> true, or false when the client is gone
 *       queues text, a newline and a NUL byte (the end of one reply) for
 *       the server thread to send; the client's next line is read after it
 *   attach.close(h)                 wakes and joins the server thread,
 *       closes every socket, removes sock (also __gc / __close)
 *
 * Not here: running the control requests and publishing the snapshot
 * (lua/moelua/remote.lua), the client (host/repl.c, ml_attach_repl).
 */
#include "l_util.h"
#include "libs.h"

#include <lualib.h>

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#define ML_ATTACH_MT      "moelua.Attach"
#define ML_ATTACH_CLIENTS 8
#define ML_ATTACH_ACCEPT  4
#define ML_ATTACH_LINE    8192
#define ML_ATTACH_REFUSED_S 2.0
#define ML_ATTACH_MEM     ((size_t)64 << 20)  /* the server thread's Lua state, at most */
#define ML_ATTACH_EVAL    "moelua.attach.eval"  /* its registry key of the evaluator */

typedef enum {
    ML_ATTACH_OPEN,     /* lines are requests */
    ML_ATTACH_SKIP,     /* dropping the rest of an over-long line, up to its newline */
    ML_ATTACH_REFUSED   /* another uid: told so, input discarded until it leaves or `until` */
} ml_attach_state;

typedef struct {
    int fd;            /* -1: free slot */
    int id;
    ml_attach_state state;
    int waiting;       /* a control request of its own is with the training thread */
    double until;      /* ML_ATTACH_REFUSED: closed at this time (monotonic seconds) */
    size_t len;        /* bytes in buf */
    char buf[ML_ATTACH_LINE];
} ml_attach_client;

/* A request for the training thread (text: the line) or a reply for the
 * server thread to send (text: the reply, its newline and its NUL). */
typedef struct ml_attach_msg {
    struct ml_attach_msg *next;
    int client;
    size_t len;        /* bytes of text to use */
    char text[];       /* len bytes and a NUL */
} ml_attach_msg;

typedef struct {
    ml_attach_msg *head, *tail;
} ml_attach_queue;

typedef struct {
    /* set by listen, read-only once the server thread runs */
    char path[sizeof(((struct sockaddr_un *)0)->sun_path)];
    lua_Integer limit;   /* instructions per request line */
    int wake[2];         /* the self-pipe: a byte in wake[1] wakes the server thread */
    int started;         /* the server thread runs: close joins it */
    pthread_t thread;
    /* the server thread's alone while it runs */
    int fd;              /* the listening socket */
    int next_id;
    lua_State *T;        /* its Lua state */
    size_t mem;          /* bytes T holds */
    ml_attach_client client[ML_ATTACH_CLIENTS];
    /* under mu */
    pthread_mutex_t mu;
    pthread_cond_t queued;     /* a request was queued for the training thread */
    char *snapshot;            /* the last published JSON text (NULL: none yet) */
    size_t snapshot_len;
    ml_attach_queue requests;  /* controls, for the training thread */
    ml_attach_queue replies;   /* the training thread's replies, for the server thread */
    int live[ML_ATTACH_CLIENTS];  /* the id of each slot's attached client, 0: none */
    int connected;             /* clients attached, refused peers not counted */
    int stop;                  /* close asked the server thread to end */
} ml_attach;

/* The userdata: a NULL once closed. */
typedef struct {
    ml_attach *a;
    char path[sizeof(((struct sockaddr_un *)0)->sun_path)];
} ml_attach_handle;

/* The server thread's sandbox, run in its own state with (json, limited):
 * returns the evaluator, evaluator(line, snapshot_or_nil) -> reply text,
 * or nil when the line calls a control (the training thread runs it: its
 * partial evaluation here is dropped, as nothing here can change the job).
 * The same environment as lua/moelua/remote.lua's, with copies of the
 * libraries, so no request changes what the next one sees. */
static const char server_sandbox[] =
    "local json, limited = ...\n"
    "local REPLY_MAX = 60000\n"
    "local BASE = {'pairs', 'ipairs', 'next', 'tostring', 'tonumber', 'type', 'select', 'pcall',\n"
    "              'error', 'assert'}\n"
    "local LIBS = {'math', 'string', 'table'}\n"
    "local G, CONTROL = _G, {}\n"
    "local function show(v)\n"
    "  if type(v) == 'table' then\n"
    "    local ok, s = pcall(json.encode, v, {indent = false})\n"
    "    if ok and s then return s end\n"
    "  end\n"
    "  return tostring(v)\n"
    "end\n"
    "local function copy(t)\n"
    "  local c = {}\n"
    "  for k, v in pairs(t) do c[k] = v end\n"
    "  return c\n"
    "end\n"
    "return function(code, snapshot)\n"
    "  local snap = snapshot and json.decode(snapshot)\n"
    "  if type(snap) ~= 'table' then snap = {} end\n"
    "  local out, control = {}, false\n"
    "  local env = {stats = snap.stats, ledger = snap.ledger, progress = snap.progress,\n"
    "               overrides = snap.overrides or {}, staged = snap.staged or {}}\n"
    "  for _, k in ipairs(BASE) do env[k] = G[k] end\n"
    "  for _, k in ipairs(LIBS) do env[k] = copy(G[k]) end\n"
    "  function env.print(...)\n"
    "    local parts = {}\n"
    "    for i = 1, select('#', ...) do parts[i] = show((select(i, ...))) end\n"
    "    out[#out + 1] = table.concat(parts, '\\t')\n"
    "  end\n"
    "  local function queue() control = true; error(CONTROL, 0) end\n"
    "  env.set, env.checkpoint, env.pause, env.resume = queue, queue, queue, queue\n"
    "  local fn = load('return ' .. code, '=attach', 't', env)\n"
    "  if not fn then\n"
    "    local err\n"
    "    fn, err = load(code, '=attach', 't', env)\n"
    "    if not fn then return 'error: ' .. err end\n"
    "  end\n"
    "  local res = table.pack(limited(fn))\n"
    "  if control then return nil end\n"
    "  if not res[1] then return 'error: ' .. show(res[2]) end\n"
    "  for i = 2, res.n do out[#out + 1] = show(res[i]) end\n"
    "  local text = table.concat(out, '\\n')\n"
    "  if #text > REPLY_MAX then\n"
    "    text = text:sub(1, REPLY_MAX) .. '\\n... (cut at ' .. REPLY_MAX .. ' bytes)'\n"
    "  end\n"
    "  return text\n"
    "end\n";

static ml_attach *check_attach(lua_State *L, int idx, const char *fn)
{
    ml_attach_handle *h = luaL_testudata(L, idx, ML_ATTACH_MT);
    if (!h)
        ml_error(L, fn, "argument #%d: expected an attach handle, got %s", idx, luaL_typename(L, idx));
    if (!h->a)
        ml_error(L, fn, "argument #%d: the attach handle is closed", idx);
    return h->a;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ---- the queues (callers hold mu) ------------------------------------ */

/* A message holding text (len bytes); with_end adds a newline unless text
 * ends in one, and a NUL byte (a reply's end on the wire). NULL: no memory. */
static ml_attach_msg *msg_new(int client, const char *text, size_t len, int with_end)
{
    ml_attach_msg *m = malloc(sizeof *m + len + 3);  /* a newline, a NUL, the terminating NUL */
    if (!m)
        return NULL;
    m->next = NULL;
    m->client = client;
    memcpy(m->text, text, len);
    if (with_end) {
        if (len == 0 || text[len - 1] != '\n')
            m->text[len++] = '\n';
        m->text[len++] = '\0';
    }
    m->text[len] = '\0';
    m->len = len;
    return m;
}

static void queue_push(ml_attach_queue *q, ml_attach_msg *m)
{
    if (q->tail)
        q->tail->next = m;
    else
        q->head = m;
    q->tail = m;
}

static ml_attach_msg *queue_pop(ml_attach_queue *q)
{
    ml_attach_msg *m = q->head;
    if (m) {
        q->head = m->next;
        if (!q->head)
            q->tail = NULL;
    }
    return m;
}

static void queue_free(ml_attach_queue *q)
{
    ml_attach_msg *m;
    while ((m = queue_pop(q)))
        free(m);
}

static void wake_server(ml_attach *a)
{
    ssize_t w;
    do
        w = write(a->wake[1], "", 1);
    while (w < 0 && errno == EINTR);  /* EAGAIN: the pipe is full, it will wake anyway */
}

/* ---- sockets (the server thread) -------------------------------------- */

/* Write all of s to a non-blocking socket, waiting at most ~1 s in total
 * for a slow reader; 0 on success, -1 (the caller drops the client). */
static int write_all(int fd, const char *s, size_t n)
{
    int waits = 0;
    while (n > 0) {
        ssize_t w = send(fd, s, n, MSG_NOSIGNAL);
        if (w > 0) {
            s += w;
            n -= (size_t)w;
            continue;
        }
        if (w < 0 && errno == EINTR)
            continue;
        if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) && waits++ < 100) {
            struct pollfd p = {.fd = fd, .events = POLLOUT};
            poll(&p, 1, 10);
            continue;
        }
        return -1;
    }
    return 0;
}

/* The slot's client, attached or not, as the training thread sees it. */
static void client_publish(ml_attach *a, int slot)
{
    const ml_attach_client *c = &a->client[slot];
    pthread_mutex_lock(&a->mu);
    a->live[slot] = c->fd >= 0 && c->state != ML_ATTACH_REFUSED ? c->id : 0;
    a->connected = 0;
    for (int i = 0; i < ML_ATTACH_CLIENTS; i++)
        a->connected += a->live[i] != 0;
    pthread_mutex_unlock(&a->mu);
}

static void client_close(ml_attach *a, int slot)
{
    ml_attach_client *c = &a->client[slot];
    if (c->fd >= 0)
        close(c->fd);
    c->fd = -1;
    c->len = 0;
    c->waiting = 0;
    c->state = ML_ATTACH_OPEN;
    client_publish(a, slot);
}

static int free_slot(const ml_attach *a)
{
    for (int i = 0; i < ML_ATTACH_CLIENTS; i++)
        if (a->client[i].fd < 0)
            return i;
    return -1;
}

/* Tell a peer of another uid why it is refused. It is kept (input
 * discarded) so that the message is there whenever it reads: closed at once,
 * its next send would fail before it saw why. */
static void refuse_peer(ml_attach *a, int fd, long peer_uid)
{
    char msg[200];
    int n = snprintf(msg, sizeof msg, "error: refused: this job runs as uid %ld and the peer is uid "
                     "%ld (SO_PEERCRED); attach as the job's user\n", (long)geteuid(), peer_uid);
    int slot = free_slot(a);
    if (write_all(fd, msg, (size_t)n + 1) != 0 || slot < 0) {  /* with its NUL */
        close(fd);
        return;
    }
    shutdown(fd, SHUT_WR);
    ml_attach_client *c = &a->client[slot];
    c->fd = fd;
    c->id = 0;  /* never a request's client */
    c->len = 0;
    c->waiting = 0;
    c->state = ML_ATTACH_REFUSED;
    c->until = now_s() + ML_ATTACH_REFUSED_S;
}

static void accept_pending(ml_attach *a)
{
    for (int n = 0; n < ML_ATTACH_ACCEPT; n++) {
        int fd = accept4(a->fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0)
            return;  /* EAGAIN: none pending; anything else: try when woken next */
        struct ucred cred;
        socklen_t len = sizeof cred;
        if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
            close(fd);
            continue;
        }
        if (cred.uid != geteuid()) {
            refuse_peer(a, fd, (long)cred.uid);
            continue;
        }
        int slot = free_slot(a);
        if (slot < 0) {
            static const char full[] = "error: too many clients attached\n";
            write_all(fd, full, sizeof full);
            close(fd);
            continue;
        }
        ml_attach_client *c = &a->client[slot];
        c->fd = fd;
        c->len = 0;
        c->waiting = 0;
        c->state = ML_ATTACH_OPEN;
        c->id = a->next_id++;
        client_publish(a, slot);
    }
}

/* ---- the server thread's Lua state ------------------------------------ */

/* Its allocator: at most ML_ATTACH_MEM bytes (a request's string.rep of a
 * gigabyte is "not enough memory", not the machine's memory). */
static void *server_alloc(void *ud, void *ptr, size_t osize, size_t nsize)
{
    ml_attach *a = ud;
    if (!ptr)
        osize = 0;  /* then osize is a type tag */
    if (nsize == 0) {
        free(ptr);
        a->mem -= osize;
        return NULL;
    }
    if (nsize > osize && a->mem + (nsize - osize) > ML_ATTACH_MEM)
        return NULL;
    void *p = realloc(ptr, nsize);
    if (p)
        a->mem = a->mem - osize + nsize;
    return p;
}

static int server_panic(lua_State *T)
{
    fprintf(stderr, "%s:%d: moelua.attach: unprotected error in the server thread's state: %s\n",
            __FILE__, __LINE__, lua_tostring(T, -1));
    abort();
}

/* Raised in the running request once it has run a->limit instructions.
 * From then on every instruction raises it again, so a pcall inside the
 * request cannot outlast it. */
static void limit_hook(lua_State *T, lua_Debug *ar)
{
    void *ud;
    lua_getallocf(T, &ud);
    const ml_attach *a = ud;
    lua_sethook(T, limit_hook, LUA_MASKCOUNT, 1);
    luaL_where(T, 0);  /* the request's line: a C hook has no frame of its own */
    lua_pushfstring(T, "instruction limit exceeded (%I instructions)", (LUAI_UACINT)a->limit);
    lua_concat(T, 2);
    lua_error(T);
}

/* limited(fn) -> true, results... | false, error: fn under the instruction limit. */
static int server_limited(lua_State *T)
{
    luaL_checktype(T, 1, LUA_TFUNCTION);
    void *ud;
    lua_getallocf(T, &ud);
    const ml_attach *a = ud;
    lua_sethook(T, limit_hook, LUA_MASKCOUNT, (int)a->limit);
    int status = lua_pcall(T, lua_gettop(T) - 1, LUA_MULTRET, 0);
    lua_sethook(T, NULL, 0, 0);
    lua_pushboolean(T, status == LUA_OK);
    lua_insert(T, 1);
    return lua_gettop(T);
}

/* Opens T's libraries, loads dkjson from the path at 1 and the sandbox;
 * the evaluator goes into the registry. Run protected. */
static int server_setup(lua_State *T)
{
    const char *json_path = lua_tostring(T, 1);
    luaL_requiref(T, LUA_GNAME, luaopen_base, 1);
    luaL_requiref(T, LUA_STRLIBNAME, luaopen_string, 1);
    luaL_requiref(T, LUA_TABLIBNAME, luaopen_table, 1);
    luaL_requiref(T, LUA_MATHLIBNAME, luaopen_math, 1);
    lua_settop(T, 1);
    if (luaL_loadfilex(T, json_path, "t") != LUA_OK)
        return lua_error(T);
    lua_call(T, 0, 1);
    if (!lua_istable(T, -1))
        return luaL_error(T, "%s did not return a table", json_path);
    if (luaL_loadbufferx(T, server_sandbox, sizeof server_sandbox - 1, "=attach-server", "t") != LUA_OK)
        return lua_error(T);
    lua_insert(T, -2);
    lua_pushcfunction(T, server_limited);
    lua_call(T, 2, 1);
    lua_setfield(T, LUA_REGISTRYINDEX, ML_ATTACH_EVAL);
    return 0;
}

typedef struct {
    const char *code, *snapshot;
    size_t code_len, snapshot_len;
} ml_attach_request;

/* evaluator(code, snapshot): the reply or nil. Run protected. */
static int server_eval_protected(lua_State *T)
{
    const ml_attach_request *r = lua_touserdata(T, 1);
    lua_getfield(T, LUA_REGISTRYINDEX, ML_ATTACH_EVAL);
    lua_pushlstring(T, r->code, r->code_len);
    if (r->snapshot)
        lua_pushlstring(T, r->snapshot, r->snapshot_len);
    else
        lua_pushnil(T);
    lua_call(T, 2, 1);
    return 1;
}

/* A copy of the last snapshot (NULL: none, or no memory: then the request
 * sees no snapshot). */
static char *snapshot_copy(ml_attach *a, size_t *len)
{
    pthread_mutex_lock(&a->mu);
    char *s = a->snapshot ? malloc(a->snapshot_len + 1) : NULL;
    if (s) {
        memcpy(s, a->snapshot, a->snapshot_len + 1);
        *len = a->snapshot_len;
    }
    pthread_mutex_unlock(&a->mu);
    return s;
}

/* ---- serving (the server thread) -------------------------------------- */

static void send_reply(ml_attach *a, int slot, const char *text, size_t len)
{
    ml_attach_client *c = &a->client[slot];
    int ok = write_all(c->fd, text, len) == 0 &&
             (len == 0 || text[len - 1] == '\n' || write_all(c->fd, "\n", 1) == 0) &&
             write_all(c->fd, "", 1) == 0;
    if (!ok)
        client_close(a, slot);
}

/* Hand one line to the training thread: the client waits for its reply. */
static void queue_control(ml_attach *a, int slot, const char *code, size_t len)
{
    ml_attach_client *c = &a->client[slot];
    ml_attach_msg *m = msg_new(c->id, code, len, 0);
    if (!m) {
        static const char oom[] = "error: out of memory queueing the request; not run";
        send_reply(a, slot, oom, sizeof oom - 1);
        return;
    }
    pthread_mutex_lock(&a->mu);
    queue_push(&a->requests, m);
    pthread_cond_signal(&a->queued);
    pthread_mutex_unlock(&a->mu);
    c->waiting = 1;
}

/* One request line: answered here from the snapshot, or queued. */
static void serve_line(ml_attach *a, int slot, const char *code, size_t len)
{
    lua_State *T = a->T;
    ml_attach_request r = {.code = code, .code_len = len};
    char *snap = snapshot_copy(a, &r.snapshot_len);
    r.snapshot = snap;
    lua_settop(T, 0);
    lua_pushcfunction(T, server_eval_protected);
    lua_pushlightuserdata(T, &r);
    int status = lua_pcall(T, 1, 1, 0);
    free(snap);
    size_t n;
    const char *text = lua_tolstring(T, -1, &n);
    if (status == LUA_OK && lua_isnil(T, -1)) {
        queue_control(a, slot, code, len);
    } else if (status == LUA_OK && text) {
        send_reply(a, slot, text, n);
    } else {
        char msg[600];
        int m = snprintf(msg, sizeof msg, "error: %s", text ? text : "(not a string)");
        send_reply(a, slot, msg, (size_t)m < sizeof msg ? (size_t)m : sizeof msg - 1);
    }
    lua_settop(T, 0);
}

/* Serve each complete line of client `slot` in turn, until it waits on the
 * training thread or is closed. */
static void take_lines(ml_attach *a, int slot)
{
    ml_attach_client *c = &a->client[slot];
    size_t start = 0;
    for (size_t i = 0; i < c->len && !c->waiting && c->fd >= 0; i++) {
        if (c->buf[i] != '\n')
            continue;
        serve_line(a, slot, c->buf + start, i - start);
        start = i + 1;
    }
    if (c->fd < 0)
        return;  /* closed: buf is cleared */
    memmove(c->buf, c->buf + start, c->len - start);
    c->len -= start;
}

/* Drop the start of c's buffer up to and including its first newline;
 * 1 when there was one (the over-long line ended). */
static int skip_to_newline(ml_attach_client *c)
{
    char *nl = memchr(c->buf, '\n', c->len);
    if (!nl) {
        c->len = 0;
        return 0;
    }
    size_t rest = c->len - (size_t)(nl + 1 - c->buf);
    memmove(c->buf, nl + 1, rest);
    c->len = rest;
    return 1;
}

/* Read what client `slot` sent without blocking and serve its complete
 * lines; stops early while it waits on the training thread. 0, or -1 when
 * the client is gone. */
static int read_client(ml_attach *a, int slot)
{
    ml_attach_client *c = &a->client[slot];
    for (;;) {
        if (c->fd < 0)
            return -1;
        if (c->waiting)
            return 0;
        if (c->len == sizeof c->buf && c->state == ML_ATTACH_OPEN) {
            static const char big[] = "error: request over 8192 bytes: refused, not run "
                                      "(one line at most 8192 bytes with its newline)\n";
            if (write_all(c->fd, big, sizeof big) != 0)  /* with its NUL */
                return -1;
            c->state = ML_ATTACH_SKIP;
        }
        if (c->state == ML_ATTACH_SKIP && skip_to_newline(c)) {
            c->state = ML_ATTACH_OPEN;
            take_lines(a, slot);
            continue;
        }
        ssize_t r = recv(c->fd, c->buf + c->len, sizeof c->buf - c->len, 0);
        if (r < 0 && errno == EINTR)
            continue;
        if (r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK))
            return -1;
        if (r < 0)
            return 0;
        c->len += (size_t)r;
        if (c->state == ML_ATTACH_REFUSED)
            c->len = 0;
        else if (c->state == ML_ATTACH_OPEN)
            take_lines(a, slot);
    }
}

/* Send the training thread's replies; each client that got one serves the
 * lines it sent meanwhile. */
static void send_replies(ml_attach *a)
{
    for (;;) {
        pthread_mutex_lock(&a->mu);
        ml_attach_msg *m = queue_pop(&a->replies);
        pthread_mutex_unlock(&a->mu);
        if (!m)
            return;
        for (int i = 0; i < ML_ATTACH_CLIENTS; i++) {
            ml_attach_client *c = &a->client[i];
            if (c->fd < 0 || c->id != m->client || c->state == ML_ATTACH_REFUSED)
                continue;
            if (write_all(c->fd, m->text, m->len) != 0) {
                client_close(a, i);
            } else {
                c->waiting = 0;
                take_lines(a, i);
            }
            break;
        }
        free(m);
    }
}

/* ms until the first refused peer is due to be closed; -1: none. */
static int refused_timeout(const ml_attach *a, double t)
{
    double first = -1;
    for (int i = 0; i < ML_ATTACH_CLIENTS; i++) {
        const ml_attach_client *c = &a->client[i];
        if (c->fd >= 0 && c->state == ML_ATTACH_REFUSED && (first < 0 || c->until - t < first))
            first = c->until - t > 0 ? c->until - t : 0;
    }
    return first < 0 ? -1 : (int)(first * 1000) + 1;
}

static int server_stopping(ml_attach *a)
{
    pthread_mutex_lock(&a->mu);
    int stop = a->stop;
    pthread_mutex_unlock(&a->mu);
    return stop;
}

static void *server_main(void *arg)
{
    ml_attach *a = arg;
    while (!server_stopping(a)) {
        struct pollfd p[2 + ML_ATTACH_CLIENTS];
        int slot_of[2 + ML_ATTACH_CLIENTS];
        nfds_t np = 0;
        p[np++] = (struct pollfd){.fd = a->wake[0], .events = POLLIN};
        p[np++] = (struct pollfd){.fd = a->fd, .events = POLLIN};
        for (int i = 0; i < ML_ATTACH_CLIENTS; i++)
            if (a->client[i].fd >= 0 && !a->client[i].waiting) {  /* a waiting one is read after its reply */
                slot_of[np] = i;
                p[np++] = (struct pollfd){.fd = a->client[i].fd, .events = POLLIN};
            }
        if (poll(p, np, refused_timeout(a, now_s())) < 0 && errno != EINTR)
            poll(NULL, 0, 10);  /* not expected: do not spin */
        char drain[64];
        while (read(a->wake[0], drain, sizeof drain) > 0) {}
        accept_pending(a);
        send_replies(a);
        for (nfds_t k = 2; k < np; k++)
            if (p[k].revents && read_client(a, slot_of[k]) != 0)
                client_close(a, slot_of[k]);
        double t = now_s();
        for (int i = 0; i < ML_ATTACH_CLIENTS; i++)
            if (a->client[i].fd >= 0 && a->client[i].state == ML_ATTACH_REFUSED && t >= a->client[i].until)
                client_close(a, i);
    }
    return NULL;
}

/* ---- the binding ------------------------------------------------------ */

static void attach_release(ml_attach_handle *h)
{
    ml_attach *a = h->a;
    if (!a)
        return;
    h->a = NULL;
    if (a->started) {
        pthread_mutex_lock(&a->mu);
        a->stop = 1;
        pthread_mutex_unlock(&a->mu);
        wake_server(a);
        pthread_join(a->thread, NULL);
    }
    for (int i = 0; i < ML_ATTACH_CLIENTS; i++)
        if (a->client[i].fd >= 0)
            close(a->client[i].fd);
    if (a->fd >= 0) {
        close(a->fd);
        unlink(a->path);
    }
    if (a->T)
        lua_close(a->T);
    for (int i = 0; i < 2; i++)
        if (a->wake[i] >= 0)
            close(a->wake[i]);
    queue_free(&a->requests);
    queue_free(&a->replies);
    free(a->snapshot);
    pthread_cond_destroy(&a->queued);
    pthread_mutex_destroy(&a->mu);
    free(a);
}

static int l_attach_gc(lua_State *L)
{
    ml_attach_handle *h = luaL_testudata(L, 1, ML_ATTACH_MT);
    if (h)
        attach_release(h);
    return 0;
}

/* A new server in a safe empty state (nothing open), or NULL. */
static ml_attach *attach_new(void)
{
    ml_attach *a = calloc(1, sizeof *a);
    if (!a)
        return NULL;
    a->fd = -1;
    a->wake[0] = a->wake[1] = -1;
    a->next_id = 1;
    for (int i = 0; i < ML_ATTACH_CLIENTS; i++)
        a->client[i].fd = -1;
    pthread_mutex_init(&a->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&a->queued, &ca);
    pthread_condattr_destroy(&ca);
    return a;
}

/* Pushes the path of dkjson.lua by the caller's package.path. */
static void find_dkjson(lua_State *L, const char *fn)
{
    luaL_getsubtable(L, LUA_REGISTRYINDEX, LUA_LOADED_TABLE);
    if (lua_getfield(L, -1, LUA_LOADLIBNAME) != LUA_TTABLE ||
        lua_getfield(L, -1, "searchpath") != LUA_TFUNCTION)
        ml_error(L, fn, "no package.searchpath to find dkjson.lua for the server thread");
    lua_pushliteral(L, "dkjson");
    lua_getfield(L, -3, "path");
    lua_call(L, 2, 2);  /* loaded, package, path or nil, nil or why */
    if (lua_type(L, -2) != LUA_TSTRING) {
        const char *why = lua_tostring(L, -1);
        ml_error(L, fn, "cannot find dkjson.lua for the server thread:%s", why ? why : "");
    }
    lua_pop(L, 1);
    lua_replace(L, -3);  /* path, package */
    lua_pop(L, 1);
}

/* The server thread's Lua state, or an error. */
static void server_open(lua_State *L, ml_attach *a, const char *fn, const char *json_path)
{
    a->T = lua_newstate(server_alloc, a);
    if (!a->T)
        ml_error(L, fn, "cannot create the server thread's Lua state: out of memory");
    lua_atpanic(a->T, server_panic);
    lua_pushcfunction(a->T, server_setup);
    lua_pushstring(a->T, json_path);  /* a new state has room: no error */
    if (lua_pcall(a->T, 1, 0, 0) != LUA_OK) {
        char msg[400];
        snprintf(msg, sizeof msg, "%s", lua_isstring(a->T, -1) ? lua_tostring(a->T, -1) : "(no message)");
        ml_error(L, fn, "cannot set up the server thread's Lua state: %s", msg);
    }
}

/* The server thread, with SIGINT and SIGTERM blocked from its first instruction. */
static int server_start(ml_attach *a)
{
    sigset_t block, old;
    sigemptyset(&block);
    sigaddset(&block, SIGINT);
    sigaddset(&block, SIGTERM);
    sigaddset(&block, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &block, &old);
    int e = pthread_create(&a->thread, NULL, server_main, a);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    a->started = e == 0;
    return e;
}

static int l_attach_listen(lua_State *L)
{
    static const char fn[] = "moelua.attach.listen";
    size_t rlen;
    const char *run_dir = luaL_checklstring(L, 1, &rlen);
    lua_Integer limit = luaL_optinteger(L, 2, 1000000);
    if (rlen == 0 || strlen(run_dir) != rlen)
        ml_error(L, fn, "argument #1 (run_dir): expected a non-empty path without NUL bytes");
    if (limit < 1 || limit > 1000000000)
        ml_error(L, fn, "argument #2 (instructions): expected 1..1e9, got %lld", (long long)limit);
    char dir[4096], path[4200];
    snprintf(dir, sizeof dir, "%s/attach", run_dir);
    int plen = snprintf(path, sizeof path, "%s/sock", dir);
    if ((size_t)plen >= sizeof ((ml_attach *)0)->path)
        ml_error(L, fn, "socket path '%s' is %d bytes, over the %zu-byte limit of a Unix socket "
                 "address: use a shorter run directory", path, plen, sizeof ((ml_attach *)0)->path - 1);
    find_dkjson(L, fn);
    const char *json_path = lua_tostring(L, -1);
    if (mkdir(dir, 0700) != 0 && errno != EEXIST)
        ml_error(L, fn, "cannot create '%s': %s", dir, strerror(errno));
    struct stat st;
    if (lstat(dir, &st) != 0)
        ml_error(L, fn, "cannot stat '%s': %s", dir, strerror(errno));
    if (!S_ISDIR(st.st_mode) || st.st_uid != geteuid())
        ml_error(L, fn, "'%s' is not a directory owned by this user", dir);
    if (chmod(dir, 0700) != 0)
        ml_error(L, fn, "cannot chmod 0700 '%s': %s", dir, strerror(errno));
    /* a socket left by a job that died; anything else there is an error */
    if (lstat(path, &st) == 0) {
        if (!S_ISSOCK(st.st_mode))
            ml_error(L, fn, "'%s' exists and is not a socket", path);
        unlink(path);
    }
    /* the userdata first, in a safe empty state: a later error frees it */
    ml_attach_handle *h = lua_newuserdatauv(L, sizeof *h, 0);
    h->a = NULL;
    memcpy(h->path, path, (size_t)plen + 1);  /* plen < sizeof h->path: checked above */
    luaL_setmetatable(L, ML_ATTACH_MT);
    ml_attach *a = attach_new();
    if (!a)
        ml_error(L, fn, "out of memory");
    h->a = a;
    a->limit = limit;
    memcpy(a->path, path, (size_t)plen + 1);  /* plen < sizeof a->path: checked above */
    server_open(L, a, fn, json_path);
    if (pipe2(a->wake, O_NONBLOCK | O_CLOEXEC) != 0)
        ml_error(L, fn, "pipe: %s", strerror(errno));
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0)
        ml_error(L, fn, "socket: %s", strerror(errno));
    struct sockaddr_un addr;
    memset(&addr, 0, sizeof addr);
    addr.sun_family = AF_UNIX;
    memcpy(addr.sun_path, path, (size_t)plen + 1);
    if (bind(fd, (struct sockaddr *)&addr, sizeof addr) != 0) {
        int e = errno;
        close(fd);
        ml_error(L, fn, "cannot bind '%s': %s", path, strerror(e));
    }
    a->fd = fd;  /* bound: release unlinks the socket */
    if (chmod(path, 0600) != 0) {
        int e = errno;
        attach_release(h);
        ml_error(L, fn, "cannot chmod 0600 '%s': %s", path, strerror(e));
    }
    if (listen(fd, ML_ATTACH_CLIENTS) != 0) {
        int e = errno;
        attach_release(h);
        ml_error(L, fn, "listen '%s': %s", path, strerror(e));
    }
    int e = server_start(a);
    if (e != 0) {
        attach_release(h);
        ml_error(L, fn, "cannot start the server thread: %s", strerror(e));
    }
    return 1;
}

static int l_attach_publish(lua_State *L)
{
    static const char fn[] = "moelua.attach.publish";
    ml_attach *a = check_attach(L, 1, fn);
    size_t len;
    const char *text = luaL_checklstring(L, 2, &len);
    char *copy = malloc(len + 1);
    if (!copy)
        ml_error(L, fn, "out of memory copying a %zu-byte snapshot", len);
    memcpy(copy, text, len + 1);
    pthread_mutex_lock(&a->mu);
    char *old = a->snapshot;
    a->snapshot = copy;
    a->snapshot_len = len;
    pthread_mutex_unlock(&a->mu);
    free(old);
    return 0;
}

/* Wait on `queued` until a request is there or timeout_ms pass (mu held). */
static void wait_queued(ml_attach *a, lua_Integer timeout_ms)
{
    struct timespec until;
    clock_gettime(CLOCK_MONOTONIC, &until);
    until.tv_sec += (time_t)(timeout_ms / 1000);
    until.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
    if (until.tv_nsec >= 1000000000L) {
        until.tv_sec++;
        until.tv_nsec -= 1000000000L;
    }
    while (!a->requests.head)
        if (pthread_cond_timedwait(&a->queued, &a->mu, &until) == ETIMEDOUT)
            return;
}

static int l_attach_poll(lua_State *L)
{
    static const char fn[] = "moelua.attach.poll";
    ml_attach *a = check_attach(L, 1, fn);
    lua_Integer timeout = luaL_optinteger(L, 2, 0);
    if (timeout < 0 || timeout > 60000)
        ml_error(L, fn, "argument #2 (timeout_ms): expected 0..60000, got %lld", (long long)timeout);
    lua_newtable(L);
    if (timeout > 0) {
        pthread_mutex_lock(&a->mu);
        wait_queued(a, timeout);
        pthread_mutex_unlock(&a->mu);
    }
    /* Each request is copied into Lua before it leaves the queue (a memory
     * error then leaks nothing); only this thread takes from its head. */
    for (lua_Integer n = 1;; n++) {
        pthread_mutex_lock(&a->mu);
        ml_attach_msg *m = a->requests.head;
        pthread_mutex_unlock(&a->mu);
        if (!m)
            break;
        lua_createtable(L, 0, 2);
        lua_pushinteger(L, m->client);
        lua_setfield(L, -2, "client");
        lua_pushlstring(L, m->text, m->len);
        lua_setfield(L, -2, "code");
        lua_rawseti(L, -2, n);
        pthread_mutex_lock(&a->mu);
        free(queue_pop(&a->requests));
        pthread_mutex_unlock(&a->mu);
    }
    pthread_mutex_lock(&a->mu);
    lua_Integer connected = a->connected;
    pthread_mutex_unlock(&a->mu);
    lua_pushinteger(L, connected);
    return 2;
}

static int l_attach_reply(lua_State *L)
{
    static const char fn[] = "moelua.attach.reply";
    ml_attach *a = check_attach(L, 1, fn);
    lua_Integer id = luaL_checkinteger(L, 2);
    size_t len;
    const char *text = luaL_checklstring(L, 3, &len);
    if (memchr(text, '\0', len))
        ml_error(L, fn, "argument #3 (text): contains a NUL byte");
    int live = 0;
    pthread_mutex_lock(&a->mu);
    for (int i = 0; i < ML_ATTACH_CLIENTS; i++)
        live |= id > 0 && a->live[i] == id;
    ml_attach_msg *m = live ? msg_new((int)id, text, len, 1) : NULL;
    if (m)
        queue_push(&a->replies, m);
    pthread_mutex_unlock(&a->mu);
    if (live && !m)
        ml_error(L, fn, "out of memory queueing a %zu-byte reply", len);
    if (m)
        wake_server(a);
    lua_pushboolean(L, m != NULL);
    return 1;
}

static int l_attach_close(lua_State *L)
{
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
