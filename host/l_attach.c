/*
 * host/l_attach.c - the Lua library `moelua.attach`: the job's side of
 * `moelua attach RUN_DIR`, a Unix stream socket RUN_DIR/attach/sock in a
 * directory of mode 0700. No network port; no thread: every call is made by
 * the training thread, which owns the Lua state, at its safe points.
 *
 *   attach.listen(run_dir)          -> handle (listening, non-blocking;
 *                                      the directory 0700, the socket 0600)
 *   attach.poll(h [, timeout_ms])   -> {{client = id, code = line}, ...}, n_clients
 *       accepts at most ML_ATTACH_ACCEPT pending connections, reads what
 *       the clients sent without blocking and returns each complete line
 *       (newline-terminated, at most ML_ATTACH_LINE bytes). A longer line
 *       gets an error reply and is dropped up to its newline; the client
 *       stays. A peer whose uid, by SO_PEERCRED, is not geteuid() is told
 *       so (both uids named), its input discarded until it leaves or
 *       ML_ATTACH_REFUSED_S pass (so it reads the message whenever it
 *       sends), and it never counts in n_clients. timeout_ms > 0 waits that
 *       long for a connection or input first (a paused job's sleep).
 *   attach.reply(h, client, text)   -> true, or false when the client is gone
 *       writes text, a newline and a NUL byte (the end of one reply)
 *   attach.close(h)                 closes every socket, removes sock
 *       (also __gc / __close)
 *
 * Not here: running the requests (lua/moelua/remote.lua), the client
 * (host/repl.c, ml_attach_repl).
 */
#include "l_util.h"
#include "libs.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
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

typedef enum {
    ML_ATTACH_OPEN,     /* lines are requests */
    ML_ATTACH_SKIP,     /* dropping the rest of an over-long line, up to its newline */
    ML_ATTACH_REFUSED   /* another uid: told so, input discarded until it leaves or `until` */
} ml_attach_state;

typedef struct {
    int fd;            /* -1: free slot */
    int id;
    ml_attach_state state;
    double until;      /* ML_ATTACH_REFUSED: closed at this time (monotonic seconds) */
    size_t len;        /* bytes in buf */
    char buf[ML_ATTACH_LINE];
} ml_attach_client;

typedef struct {
    int fd;            /* the listening socket; -1 once closed */
    int next_id;
    char path[sizeof(((struct sockaddr_un *)0)->sun_path)];
    ml_attach_client client[ML_ATTACH_CLIENTS];
} ml_attach;

static ml_attach *check_attach(lua_State *L, int idx, const char *fn)
{
    ml_attach *a = luaL_testudata(L, idx, ML_ATTACH_MT);
    if (!a)
        ml_error(L, fn, "argument #%d: expected an attach handle, got %s", idx, luaL_typename(L, idx));
    if (a->fd < 0)
        ml_error(L, fn, "argument #%d: the attach handle is closed", idx);
    return a;
}

static void client_close(ml_attach_client *c)
{
    if (c->fd >= 0)
        close(c->fd);
    c->fd = -1;
    c->len = 0;
    c->state = ML_ATTACH_OPEN;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

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

static int attach_release(ml_attach *a)
{
    for (int i = 0; i < ML_ATTACH_CLIENTS; i++)
        client_close(&a->client[i]);
    if (a->fd >= 0) {
        close(a->fd);
        a->fd = -1;
        unlink(a->path);
    }
    return 0;
}

static int l_attach_gc(lua_State *L)
{
    ml_attach *a = luaL_testudata(L, 1, ML_ATTACH_MT);
    if (a)
        attach_release(a);
    return 0;
}

static int l_attach_listen(lua_State *L)
{
    static const char fn[] = "moelua.attach.listen";
    size_t rlen;
    const char *run_dir = luaL_checklstring(L, 1, &rlen);
    if (rlen == 0 || strlen(run_dir) != rlen)
        ml_error(L, fn, "argument #1 (run_dir): expected a non-empty path without NUL bytes");
    char dir[4096], path[4200];
    snprintf(dir, sizeof dir, "%s/attach", run_dir);
    int plen = snprintf(path, sizeof path, "%s/sock", dir);
    ml_attach probe;
    if ((size_t)plen >= sizeof probe.path)
        ml_error(L, fn, "socket path '%s' is %d bytes, over the %zu-byte limit of a Unix socket "
                 "address: use a shorter run directory", path, plen, sizeof probe.path - 1);
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
    ml_attach *a = lua_newuserdatauv(L, sizeof *a, 0);
    a->fd = -1;
    a->next_id = 1;
    for (int i = 0; i < ML_ATTACH_CLIENTS; i++)
        a->client[i].fd = -1, a->client[i].len = 0, a->client[i].state = ML_ATTACH_OPEN;
    memcpy(a->path, path, (size_t)plen + 1);  /* plen < sizeof a->path: checked above */
    luaL_setmetatable(L, ML_ATTACH_MT);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0)
        ml_error(L, fn, "socket: %s", strerror(errno));
    a->fd = fd;
    struct sockaddr_un addr;
    memset(&addr, 0, sizeof addr);
    addr.sun_family = AF_UNIX;
    memcpy(addr.sun_path, path, (size_t)plen + 1);
    if (bind(fd, (struct sockaddr *)&addr, sizeof addr) != 0) {
        int e = errno;
        close(fd);
        a->fd = -1;
        ml_error(L, fn, "cannot bind '%s': %s", path, strerror(e));
    }
    if (chmod(path, 0600) != 0) {
        int e = errno;
        attach_release(a);
        ml_error(L, fn, "cannot chmod 0600 '%s': %s", path, strerror(e));
    }
    if (listen(fd, ML_ATTACH_CLIENTS) != 0) {
        int e = errno;
        attach_release(a);
        ml_error(L, fn, "listen '%s': %s", path, strerror(e));
    }
    return 1;
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
    c->state = ML_ATTACH_REFUSED;
    c->until = now_s() + ML_ATTACH_REFUSED_S;
}

static void accept_pending(ml_attach *a)
{
    for (int n = 0; n < ML_ATTACH_ACCEPT; n++) {
        int fd = accept4(a->fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0)
            return;  /* EAGAIN: none pending; anything else: try next poll */
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
        a->client[slot].fd = fd;
        a->client[slot].len = 0;
        a->client[slot].state = ML_ATTACH_OPEN;
        a->client[slot].id = a->next_id++;
    }
}

/* Push each complete line of c as {client =, code =} into the table at -1. */
static void take_lines(lua_State *L, ml_attach_client *c, lua_Integer *n)
{
    size_t start = 0;
    for (size_t i = 0; i < c->len; i++) {
        if (c->buf[i] != '\n')
            continue;
        lua_createtable(L, 0, 2);
        lua_pushinteger(L, c->id);
        lua_setfield(L, -2, "client");
        lua_pushlstring(L, c->buf + start, i - start);
        lua_setfield(L, -2, "code");
        lua_rawseti(L, -2, ++*n);
        start = i + 1;
    }
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

/* Read what c sent without blocking, pushing its complete lines into the
 * table at -1; 0, or -1 when the client is gone. */
static int read_client(lua_State *L, ml_attach_client *c, lua_Integer *n)
{
    for (;;) {
        if (c->len == sizeof c->buf && c->state == ML_ATTACH_OPEN) {
            static const char big[] = "error: request over 8192 bytes: refused, not run "
                                      "(one line at most 8192 bytes with its newline)\n";
            if (write_all(c->fd, big, sizeof big) != 0)  /* with its NUL */
                return -1;
            c->state = ML_ATTACH_SKIP;
        }
        if (c->state == ML_ATTACH_SKIP && skip_to_newline(c)) {
            c->state = ML_ATTACH_OPEN;
            take_lines(L, c, n);
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
            take_lines(L, c, n);
    }
}

static int l_attach_poll(lua_State *L)
{
    static const char fn[] = "moelua.attach.poll";
    ml_attach *a = check_attach(L, 1, fn);
    lua_Integer timeout = luaL_optinteger(L, 2, 0);
    if (timeout < 0 || timeout > 60000)
        ml_error(L, fn, "argument #2 (timeout_ms): expected 0..60000, got %lld", (long long)timeout);
    lua_newtable(L);  /* before any socket work: no error after this point */
    if (timeout > 0) {
        struct pollfd p[ML_ATTACH_CLIENTS + 1];
        int np = 0;
        p[np++] = (struct pollfd){.fd = a->fd, .events = POLLIN};
        for (int i = 0; i < ML_ATTACH_CLIENTS; i++)
            if (a->client[i].fd >= 0)
                p[np++] = (struct pollfd){.fd = a->client[i].fd, .events = POLLIN};
        poll(p, (nfds_t)np, (int)timeout);
    }
    accept_pending(a);
    lua_Integer n = 0;
    int connected = 0;
    double t = now_s();
    for (int i = 0; i < ML_ATTACH_CLIENTS; i++) {
        ml_attach_client *c = &a->client[i];
        if (c->fd < 0)
            continue;
        if (read_client(L, c, &n) != 0 || (c->state == ML_ATTACH_REFUSED && t >= c->until))
            client_close(c);
        else if (c->state != ML_ATTACH_REFUSED)
            connected++;
    }
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
    for (int i = 0; i < ML_ATTACH_CLIENTS; i++) {
        ml_attach_client *c = &a->client[i];
        if (c->fd < 0 || c->id != id || c->state == ML_ATTACH_REFUSED)
            continue;
        int ok = write_all(c->fd, text, len) == 0 &&
                 (len == 0 || text[len - 1] == '\n' || write_all(c->fd, "\n", 1) == 0) &&
                 write_all(c->fd, "", 1) == 0;
        if (!ok)
            client_close(c);
        lua_pushboolean(L, ok);
        return 1;
    }
    lua_pushboolean(L, 0);
    return 1;
}

static int l_attach_close(lua_State *L)
{
    ml_attach *a = luaL_checkudata(L, 1, ML_ATTACH_MT);
    attach_release(a);
    return 0;
}

static int l_attach_tostring(lua_State *L)
{
    ml_attach *a = luaL_checkudata(L, 1, ML_ATTACH_MT);
    lua_pushfstring(L, "moelua.Attach(%s%s)", a->path, a->fd < 0 ? ", closed" : "");
    return 1;
}

static const luaL_Reg attach_methods[] = {
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
