/*
 * host/bindings/attach.c - the server of `moelua attach` (host/bindings/attach.h): a Unix
 * stream socket RUN_DIR/attach/sock in a directory of mode 0700, served by
 * a thread of its own. No network port.
 *
 * The server thread owns every socket: it accepts, refuses a peer of
 * another uid (SO_PEERCRED: told so, both uids named, its input discarded
 * until it leaves or ML_ATTACH_REFUSED_S pass), reads lines, drops a line
 * over ML_ATTACH_LINE bytes with an error reply (the client stays) and
 * writes every reply (its text, a newline and a NUL byte). It answers each
 * line itself, at once, in its own small Lua state (base, string, table,
 * math; no io, os, debug or package; ML_ATTACH_MEM at most), against the
 * last published snapshot, by the evaluator of lua/moelua/attach_env.lua
 * (attach_env.server, given dkjson, moelua/pretty.lua and this file's instruction-limited
 * runner). A line that calls a control, even under pcall, is not answered
 * there: it goes, whole, to a queue the training thread takes at its safe
 * points (ml_attach_peek/drop); the training thread hands back the reply
 * (ml_attach_reply), which the server thread sends. Until then the server
 * thread reads nothing more from that client, so its replies keep their
 * order. The training thread never blocks on a socket; the server thread
 * never touches the training thread's Lua state. One mutex guards the
 * snapshot, the two queues and the table of connected clients; a self-pipe
 * wakes the server thread (a reply, free), a condition variable the
 * training thread (a request). The server thread blocks SIGINT, SIGTERM
 * and SIGPIPE, so Ctrl-C reaches the training thread's handler.
 *
 * Not here: the Lua binding and its argument checks (host/bindings/l_attach.c), what
 * a line sees and its reply text (lua/moelua/attach_env.lua), running the
 * controls and publishing the snapshot (lua/moelua/remote.lua).
 */
#include "attach.h"

#include <lauxlib.h>
#include <lua.h>
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
#include <time.h>
#include <unistd.h>

#define ML_ATTACH_CLIENTS 8
#define ML_ATTACH_ACCEPT  4
#define ML_ATTACH_LINE    8192
#define ML_ATTACH_REFUSED_S 2.0
#define ML_ATTACH_MEM     ((size_t)64 << 20)  /* the server thread's Lua state, at most */
#define ML_ATTACH_EVAL    "moelua.attach.eval"  /* its registry key of the evaluator */

/* The reason, printf-style, into err (errlen bytes); the value -1. */
#define FAIL(err, errlen, ...) (snprintf((err), (errlen), __VA_ARGS__), -1)

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

struct ml_attach {
    /* set by ml_attach_listen, read-only once the server thread runs */
    char path[ML_ATTACH_PATH_MAX];
    lua_Integer limit;   /* instructions per request line */
    int wake[2];         /* the self-pipe: a byte in wake[1] wakes the server thread */
    int started;         /* the server thread runs: ml_attach_free joins it */
    int bound;           /* the socket file at path is this server's: dev and ino */
    dev_t dev;
    ino_t ino;
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
    int stop;                  /* ml_attach_free asked the server thread to end */
};

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

/* Loads the Lua file at path and pushes the table it returns. */
static void server_module(lua_State *T, const char *path)
{
    if (luaL_loadfilex(T, path, "t") != LUA_OK)
        lua_error(T);
    lua_call(T, 0, 1);
    if (!lua_istable(T, -1))
        luaL_error(T, "%s did not return a table", path);
}

/* Opens T's libraries, loads dkjson (its path at 1), attach_env (its path
 * at 2) and pretty (at 3); attach_env.server(json, pretty, limited), the
 * evaluator, goes into the registry. Run protected. */
static int server_setup(lua_State *T)
{
    const char *json_path = lua_tostring(T, 1), *env_path = lua_tostring(T, 2);
    const char *pretty_path = lua_tostring(T, 3);
    luaL_requiref(T, LUA_GNAME, luaopen_base, 1);
    luaL_requiref(T, LUA_STRLIBNAME, luaopen_string, 1);
    luaL_requiref(T, LUA_TABLIBNAME, luaopen_table, 1);
    luaL_requiref(T, LUA_MATHLIBNAME, luaopen_math, 1);
    lua_settop(T, 3);
    server_module(T, json_path);    /* 4: json */
    server_module(T, env_path);     /* 5: attach_env */
    server_module(T, pretty_path);  /* 6: pretty */
    if (lua_getfield(T, 5, "server") != LUA_TFUNCTION)
        return luaL_error(T, "%s did not return a table with a function server", env_path);
    lua_pushvalue(T, 4);
    lua_pushvalue(T, 6);
    lua_pushcfunction(T, server_limited);
    lua_call(T, 3, 1);
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

/* ---- the training thread's side --------------------------------------- */

ml_attach *ml_attach_new(void)
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

void ml_attach_free(ml_attach *a)
{
    if (!a)
        return;
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
    if (a->fd >= 0)
        close(a->fd);
    /* Only the socket this server bound: another job may have bound its own
     * there since (after removing this one). */
    struct stat st;
    if (a->bound && lstat(a->path, &st) == 0 && st.st_dev == a->dev && st.st_ino == a->ino)
        unlink(a->path);
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

/* The server thread's Lua state; 0 or -1 (err). */
static int server_open(ml_attach *a, const char *json_path, const char *env_path, const char *pretty_path,
                       char *err, size_t errlen)
{
    a->T = lua_newstate(server_alloc, a);
    if (!a->T)
        return FAIL(err, errlen, "cannot create the server thread's Lua state: out of memory");
    lua_atpanic(a->T, server_panic);
    lua_pushcfunction(a->T, server_setup);
    lua_pushstring(a->T, json_path);  /* a new state has room: no error */
    lua_pushstring(a->T, env_path);
    lua_pushstring(a->T, pretty_path);
    if (lua_pcall(a->T, 3, 0, 0) != LUA_OK) {
        char msg[400];
        snprintf(msg, sizeof msg, "%s", lua_isstring(a->T, -1) ? lua_tostring(a->T, -1) : "(no message)");
        return FAIL(err, errlen, "cannot set up the server thread's Lua state: %s", msg);
    }
    return 0;
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

/* A non-blocking Unix stream socket (-1: errno) and in addr the address of
 * path (shorter than sun_path). */
static int unix_socket(const char *path, struct sockaddr_un *addr)
{
    memset(addr, 0, sizeof *addr);
    addr->sun_family = AF_UNIX;
    snprintf(addr->sun_path, sizeof addr->sun_path, "%s", path);
    return socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
}

/* A socket at path that a job serves: connect() to it is accepted (or
 * fails with anything but ECONNREFUSED, what a socket whose job died gives,
 * or ENOENT, gone meanwhile). 0: nobody serves it; -1 (err). */
static int check_served(const char *path, char *err, size_t errlen)
{
    struct sockaddr_un addr;
    int fd = unix_socket(path, &addr);
    if (fd < 0)
        return FAIL(err, errlen, "socket: %s", strerror(errno));
    int r = connect(fd, (struct sockaddr *)&addr, sizeof addr);
    int e = errno;
    close(fd);
    if (r == 0 || e == EAGAIN)  /* EAGAIN: its backlog is full */
        return FAIL(err, errlen, "another job serves %s: stop it first, or give this job another run "
                    "directory", path);
    if (e == ECONNREFUSED || e == ENOENT)
        return 0;
    return FAIL(err, errlen, "another job may serve %s (connecting to it: %s): stop it first, or give "
                "this job another run directory", path, strerror(e));
}

/* sock_path's directory, made 0700 and this user's; a socket left there by
 * a job that died removed, one that a job serves refused (anything else
 * there is an error). 0 or -1 (err). */
static int make_dir(const char *path, char *err, size_t errlen)
{
    char dir[ML_ATTACH_PATH_MAX];
    snprintf(dir, sizeof dir, "%s", path);
    char *slash = strrchr(dir, '/');
    if (slash)
        *slash = '\0';
    else
        snprintf(dir, sizeof dir, ".");
    if (mkdir(dir, 0700) != 0 && errno != EEXIST)
        return FAIL(err, errlen, "cannot create '%s': %s", dir, strerror(errno));
    struct stat st;
    if (lstat(dir, &st) != 0)
        return FAIL(err, errlen, "cannot stat '%s': %s", dir, strerror(errno));
    if (!S_ISDIR(st.st_mode) || st.st_uid != geteuid())
        return FAIL(err, errlen, "'%s' is not a directory owned by this user", dir);
    if (chmod(dir, 0700) != 0)
        return FAIL(err, errlen, "cannot chmod 0700 '%s': %s", dir, strerror(errno));
    if (lstat(path, &st) == 0) {
        if (!S_ISSOCK(st.st_mode))
            return FAIL(err, errlen, "'%s' exists and is not a socket", path);
        if (check_served(path, err, errlen) != 0)
            return -1;
        unlink(path);
    }
    return 0;
}

int ml_attach_listen(ml_attach *a, const char *sock_path, long long limit, const char *json_path,
                     const char *env_path, const char *pretty_path, char *err, size_t errlen)
{
    size_t plen = strlen(sock_path);
    if (plen >= sizeof a->path)
        return FAIL(err, errlen, "socket path '%s' is %zu bytes, over the %zu-byte limit of a Unix "
                    "socket address", sock_path, plen, sizeof a->path - 1);
    if (make_dir(sock_path, err, errlen) != 0)
        return -1;
    a->limit = (lua_Integer)limit;
    memcpy(a->path, sock_path, plen + 1);
    if (server_open(a, json_path, env_path, pretty_path, err, errlen) != 0)
        return -1;
    if (pipe2(a->wake, O_NONBLOCK | O_CLOEXEC) != 0)
        return FAIL(err, errlen, "pipe: %s", strerror(errno));
    struct sockaddr_un addr;
    int fd = unix_socket(sock_path, &addr);
    if (fd < 0)
        return FAIL(err, errlen, "socket: %s", strerror(errno));
    if (bind(fd, (struct sockaddr *)&addr, sizeof addr) != 0) {
        int e = errno;
        close(fd);
        return FAIL(err, errlen, "cannot bind '%s': %s", sock_path, strerror(e));
    }
    a->fd = fd;
    struct stat st;  /* the file bound: ml_attach_free removes it while it is still this one */
    if (lstat(sock_path, &st) != 0)
        return FAIL(err, errlen, "cannot stat '%s' after binding it: %s", sock_path, strerror(errno));
    a->bound = 1;
    a->dev = st.st_dev;
    a->ino = st.st_ino;
    if (chmod(sock_path, 0600) != 0)
        return FAIL(err, errlen, "cannot chmod 0600 '%s': %s", sock_path, strerror(errno));
    if (listen(fd, ML_ATTACH_CLIENTS) != 0)
        return FAIL(err, errlen, "listen '%s': %s", sock_path, strerror(errno));
    int e = server_start(a);
    if (e != 0)
        return FAIL(err, errlen, "cannot start the server thread: %s", strerror(e));
    return 0;
}

int ml_attach_publish(ml_attach *a, const char *json, size_t len)
{
    char *copy = malloc(len + 1);
    if (!copy)
        return -1;
    memcpy(copy, json, len);
    copy[len] = '\0';
    pthread_mutex_lock(&a->mu);
    char *old = a->snapshot;
    a->snapshot = copy;
    a->snapshot_len = len;
    pthread_mutex_unlock(&a->mu);
    free(old);
    return 0;
}

void ml_attach_wait(ml_attach *a, long long timeout_ms)
{
    if (timeout_ms <= 0)
        return;
    struct timespec until;
    clock_gettime(CLOCK_MONOTONIC, &until);
    until.tv_sec += (time_t)(timeout_ms / 1000);
    until.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
    if (until.tv_nsec >= 1000000000L) {
        until.tv_sec++;
        until.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&a->mu);
    while (!a->requests.head)
        if (pthread_cond_timedwait(&a->queued, &a->mu, &until) == ETIMEDOUT)
            break;
    pthread_mutex_unlock(&a->mu);
}

/* Only the training thread takes from the head of `requests`, so the
 * message peeked stays there, whole, until it drops it. */
int ml_attach_peek(ml_attach *a, int *client, const char **code, size_t *len)
{
    pthread_mutex_lock(&a->mu);
    const ml_attach_msg *m = a->requests.head;
    pthread_mutex_unlock(&a->mu);
    if (!m)
        return 0;
    *client = m->client;
    *code = m->text;
    *len = m->len;
    return 1;
}

void ml_attach_drop(ml_attach *a)
{
    pthread_mutex_lock(&a->mu);
    free(queue_pop(&a->requests));
    pthread_mutex_unlock(&a->mu);
}

int ml_attach_clients(ml_attach *a)
{
    pthread_mutex_lock(&a->mu);
    int n = a->connected;
    pthread_mutex_unlock(&a->mu);
    return n;
}

int ml_attach_reply(ml_attach *a, long long client, const char *text, size_t len)
{
    int live = 0;
    pthread_mutex_lock(&a->mu);
    for (int i = 0; i < ML_ATTACH_CLIENTS; i++)
        live |= client > 0 && a->live[i] == client;
    ml_attach_msg *m = live ? msg_new((int)client, text, len, 1) : NULL;
    if (m)
        queue_push(&a->replies, m);
    pthread_mutex_unlock(&a->mu);
    if (!live)
        return 0;
    if (!m)
        return -1;
    wake_server(a);
    return 1;
}
