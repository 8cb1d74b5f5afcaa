/*
 * host/bindings/repl.c - the REPL: GNU readline for editing and history (saved in
 * ~/.moelua_history at exit, os.exit included), multi-line input (a chunk
 * that ends in <eof> waits for more lines), expression results printed by
 * moelua.repl's print (lua/moelua/repl.lua: a table nested and bounded by
 * moelua.pretty, the printer `moelua attach` uses too; a tensor by its
 * __tostring), errors with a traceback, and a global help() (moelua.repl's)
 * unless the session defines one. The loop is lua.c's doREPL: `=expr`
 * prints expr, _PROMPT and _PROMPT2 replace the prompts.
 *
 * Ctrl-C while a computation runs interrupts it and returns to the prompt
 * (ml_docall, host/bindings/main.c). Ctrl-C at the prompt discards the line being
 * typed (and a pending multi-line chunk) and prompts again; Ctrl-D on an
 * empty line ends the REPL. For that, readline runs through its callback
 * interface with rl_catch_signals off: readline's own SIGINT handler would
 * re-raise the signal under SIG_DFL and kill the process. The wait for a
 * key is a ppoll that is the only place SIGINT is unblocked, so a Ctrl-C is
 * never lost between the check and the wait.
 *
 * ml_attach_repl is the client of `moelua attach RUN_DIR`: it connects to
 * RUN_DIR/attach/sock (host/bindings/l_attach.c), reads lines with the same editing
 * (a plain line loop when stdin is not a terminal), sends each line and
 * prints the reply, which ends with a NUL byte. Ctrl-D leaves; the job
 * keeps running. On a terminal the socket is watched at the prompt too: a
 * job that ends is reported at once, not at the next line typed.
 *
 * Not here: the interrupt machinery itself (host/bindings/l_host.c, kernels/parallel.c).
 */
#include "repl.h"

#include <errno.h>
#include <lauxlib.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <readline/history.h>
#include <readline/readline.h>

#define PROMPT  "> "
#define PROMPT2 ">> "
#define EOFMARK "<eof>"
#define HISTORY_LINES 1000

/* pushline: 0 (end of input), 1 (a line) or LINE_INTERRUPTED; loadline:
 * a lua_load status, LINE_INTERRUPTED or LINE_EOF; read_tty_line also
 * LINE_PEER (the watched socket stirred at the prompt). */
#define LINE_INTERRUPTED (-1)
#define LINE_EOF         (-2)
#define LINE_PEER        (-3)

static char history_path[4096];
static int interactive;  /* stdin is a terminal: readline, prompts, history */

static void history_save(void)
{
    if (!history_path[0])
        return;
    write_history(history_path);
    history_truncate_file(history_path, HISTORY_LINES);
    history_path[0] = '\0';  /* once, whether from atexit or ml_repl */
}

static void history_open(void)
{
    static int registered;
    const char *home = getenv("HOME");
    if (!home || !interactive)
        return;
    snprintf(history_path, sizeof history_path, "%s/.moelua_history", home);
    /* A multi-line chunk is one entry; a "#<time>" line before each entry
     * lets the file keep it whole (without a comment character, readline
     * writes no timestamps). */
    history_comment_char = '#';
    history_write_timestamps = 1;
    history_multiline_entries = 1;
    stifle_history(HISTORY_LINES);
    read_history(history_path);
    if (!registered)  /* os.exit() ends the process without returning here */
        registered = atexit(history_save) == 0;
}

static void saveline(const char *line)
{
    if (interactive && line[0] != '\0')
        add_history(line);
}

/* ---- reading one line from the terminal -------------------------------- */

static volatile sig_atomic_t prompt_sigint;
static char *rl_result;
static int rl_have_result;

static void on_prompt_sigint(int sig)
{
    (void)sig;
    prompt_sigint = 1;
}

static void on_rl_line(char *line)
{
    rl_result = line;  /* NULL: end of input */
    rl_have_result = 1;
    rl_callback_handler_remove();  /* no new prompt until we ask for one */
}

/* Discard the line being edited (after a Ctrl-C: echo it) and leave the
 * terminal as readline found it. */
static void rl_abandon_line(int sigint)
{
    rl_free_line_state();
    rl_callback_sigcleanup();
    rl_replace_line("", 0);
    rl_point = rl_end = rl_mark = 0;
    if (sigint)
        rl_echo_signal_char(SIGINT);
    rl_callback_handler_remove();
    fputc('\n', rl_outstream);
    fflush(rl_outstream);
}

/* Returns 1 with *out (malloc'd), 0 at end of input, LINE_INTERRUPTED, or
 * LINE_PEER when `watch` (a socket that says nothing unasked, or -1) turns
 * readable or hangs up while the user types: `moelua attach` then learns
 * that its job ended without waiting for the next line. */
static int read_tty_line(const char *prompt, int watch, char **out)
{
    sigset_t block, orig, waitmask;
    sigemptyset(&block);
    sigaddset(&block, SIGINT);
    sigprocmask(SIG_BLOCK, &block, &orig);
    waitmask = orig;
    sigdelset(&waitmask, SIGINT);
    struct sigaction sa, old;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_prompt_sigint;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, &old);

    prompt_sigint = 0;
    rl_result = NULL;
    rl_have_result = 0;
    int status = 1;
    rl_callback_handler_install(prompt, on_rl_line);
    while (!rl_have_result) {
        struct pollfd p[2] = {{.fd = fileno(rl_instream), .events = POLLIN}, {.fd = watch, .events = POLLIN}};
        int r = ppoll(p, watch >= 0 ? 2 : 1, NULL, &waitmask);
        if (prompt_sigint) {
            rl_abandon_line(1);
            status = LINE_INTERRUPTED;
            break;
        }
        if (r < 0 && errno == EINTR) {
            rl_check_signals();  /* SIGWINCH: readline resizes and redraws */
            continue;
        }
        if (r > 0 && watch >= 0 && p[1].revents) {
            rl_abandon_line(0);
            status = LINE_PEER;
            break;
        }
        if (r < 0 || (p[0].revents & POLLNVAL)) {
            rl_callback_handler_remove();
            status = 0;
            break;
        }
        rl_callback_read_char();  /* POLLIN, or POLLHUP: readline reads EOF */
    }
    /* Unblock first: a Ctrl-C that came during rl_callback_read_char then
     * reaches our handler and is dropped instead of killing the process. */
    sigprocmask(SIG_SETMASK, &orig, NULL);
    sigaction(SIGINT, &old, NULL);
    if (status == 1) {
        *out = rl_result;
        status = rl_result != NULL;
    }
    return status;
}

/* ---- lua.c's REPL --------------------------------------------------------- */

/* The prompt, pushed: _PROMPT / _PROMPT2 when it is a string or a number,
 * as lua.c does (no __tostring: this runs unprotected). */
static const char *get_prompt(lua_State *L, int firstline)
{
    lua_getglobal(L, firstline ? "_PROMPT" : "_PROMPT2");
    const char *p = lua_tostring(L, -1);
    if (p)
        return p;
    lua_pop(L, 1);
    return lua_pushstring(L, firstline ? PROMPT : PROMPT2);
}

/* One line on the stack (without its newline): 1; 0 at end of input;
 * LINE_INTERRUPTED after Ctrl-C at the prompt (nothing pushed). */
static int pushline(lua_State *L, int firstline)
{
    char *line = NULL;
    if (interactive) {
        const char *prompt = get_prompt(L, firstline);
        int r = read_tty_line(prompt, -1, &line);
        lua_pop(L, 1);  /* the prompt */
        if (r != 1)
            return r;
    } else {
        /* Piped input: no editing and no prompts, so the output is clean. */
        size_t cap = 0;
        ssize_t n = getline(&line, &cap, stdin);
        if (n < 0) {
            free(line);
            return 0;
        }
        if (n > 0 && line[n - 1] == '\n')
            line[n - 1] = '\0';
    }
    if (firstline && line[0] == '=')  /* lua.c: "=expr" prints expr */
        lua_pushfstring(L, "return %s", line + 1);
    else
        lua_pushstring(L, line);
    free(line);
    return 1;
}

/* A syntax error at <eof>: the chunk may go on. The message stays. */
static int incomplete(lua_State *L, int status)
{
    if (status == LUA_ERRSYNTAX) {
        size_t lmsg;
        const char *msg = lua_tolstring(L, -1, &lmsg);
        size_t lmark = sizeof(EOFMARK) - 1;
        return lmsg >= lmark && strcmp(msg + lmsg - lmark, EOFMARK) == 0;
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
        saveline(line);
    } else {
        lua_pop(L, 2);
    }
    return status;
}

/* The chunk is at index 1; read continuation lines until it compiles or
 * fails for another reason than <eof>. Leaves the function or the error
 * message on top; LINE_INTERRUPTED drops everything but index 1. */
static int multiline(lua_State *L)
{
    for (;;) {
        size_t len;
        const char *chunk = lua_tolstring(L, 1, &len);
        int status = luaL_loadbuffer(L, chunk, len, "=stdin");
        if (!incomplete(L, status)) {
            saveline(chunk);
            return status;
        }
        int r = pushline(L, 0);
        if (r == 0) {  /* end of input inside a chunk: report the <eof> error */
            saveline(chunk);
            return status;
        }
        if (r == LINE_INTERRUPTED) {
            lua_settop(L, 1);
            return LINE_INTERRUPTED;
        }
        lua_remove(L, -2);  /* the <eof> message */
        lua_pushliteral(L, "\n");
        lua_insert(L, -2);
        lua_concat(L, 3);
    }
}

/* The next chunk compiled on the stack top: LUA_OK, a load error (message
 * on top), LINE_INTERRUPTED (stack empty) or LINE_EOF. */
static int loadline(lua_State *L)
{
    lua_settop(L, 0);
    int r = pushline(L, 1);
    if (r == 0)
        return LINE_EOF;
    if (r == LINE_INTERRUPTED)
        return LINE_INTERRUPTED;
    int status = addreturn(L);
    if (status != LUA_OK)
        status = multiline(L);
    lua_remove(L, 1);
    return status;
}

#define REPL_PRINT "moelua.repl.print"

/* moelua.repl's print into the registry, its help as the global `help`
 * (unless one is defined). Run protected. */
static int repl_setup(lua_State *L)
{
    lua_getglobal(L, "require");
    lua_pushliteral(L, "moelua.repl");
    lua_call(L, 1, 1);
    lua_getfield(L, -1, "print");
    lua_setfield(L, LUA_REGISTRYINDEX, REPL_PRINT);
    if (lua_getglobal(L, "help") == LUA_TNIL) {
        lua_getfield(L, -2, "help");
        lua_setglobal(L, "help");
    }
    return 0;
}

static void print_results(lua_State *L)
{
    int n = lua_gettop(L);
    if (n == 0)
        return;
    luaL_checkstack(L, LUA_MINSTACK, "too many results to print");
    /* moelua.repl's print; the plain print if it did not load */
    if (lua_getfield(L, LUA_REGISTRYINDEX, REPL_PRINT) != LUA_TFUNCTION) {
        lua_pop(L, 1);
        lua_getglobal(L, "print");
    }
    lua_insert(L, 1);
    /* through ml_docall: printing a large value can be interrupted too */
    int status = ml_docall(L, n, 0);
    if (status != LUA_OK) {
        lua_pushfstring(L, "error calling 'print' (%s)", lua_tostring(L, -1));
        lua_remove(L, -2);
        ml_report(L, status);
    }
}

void ml_repl(lua_State *L)
{
    int status;
    interactive = isatty(0);
    if (interactive) {
        rl_readline_name = "moelua";
        rl_catch_signals = 0;  /* SIGINT at the prompt is read_tty_line's */
        /* readline's SIGWINCH handler stays installed while a line is read,
         * not only inside rl_callback_read_char, so a resize during the
         * wait is seen */
        rl_persistent_signal_handlers = 1;
    }
    history_open();
    lua_pushcfunction(L, repl_setup);
    if (lua_pcall(L, 0, 0, 0) != LUA_OK) {  /* the REPL still runs, printing with print */
        fprintf(stderr, "moelua: results print plainly: %s\n", lua_tostring(L, -1));
        lua_pop(L, 1);
    }
    while ((status = loadline(L)) != LINE_EOF) {
        if (status == LINE_INTERRUPTED)
            continue;
        if (status == LUA_OK)
            status = ml_docall(L, 0, LUA_MULTRET);
        if (status == LUA_OK)
            print_results(L);
        else
            ml_report(L, status);
        fflush(stdout);
    }
    lua_settop(L, 0);
    if (interactive)
        fputc('\n', stdout);
    fflush(stdout);
    history_save();
}

/* ---- moelua attach RUN_DIR ------------------------------------------------ */

/* Print the reply up to its NUL; 0, 1 when the job refused this client
 * (another uid: the job closes the connection next), or -1 when the job
 * closed the socket. */
static int print_reply(int fd)
{
    static const char refused[] = "error: refused";
    char buf[4096];
    int first = 1, was_refused = 0;
    for (;;) {
        ssize_t r = recv(fd, buf, sizeof buf, 0);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return -1;
        if (first)
            was_refused = (size_t)r >= sizeof refused - 1 && !memcmp(buf, refused, sizeof refused - 1);
        first = 0;
        char *end = memchr(buf, '\0', (size_t)r);
        fwrite(buf, 1, end ? (size_t)(end - buf) : (size_t)r, stdout);
        fflush(stdout);
        if (end)
            return was_refused;
    }
}

/* Send line (freed here; its newline stripped, the NUL's byte free) and
 * print the reply: print_reply's result, -1 when the send fails. */
static int send_line(int fd, char *line)
{
    size_t len = strlen(line);
    line[len] = '\n';  /* getline/readline leave room: the NUL's byte */
    ssize_t w = send(fd, line, len + 1, MSG_NOSIGNAL);
    free(line);
    return w == (ssize_t)(len + 1) ? print_reply(fd) : -1;
}

/* The pid in RUN_DIR/lock when that process is alive (a job trains
 * there; moelua.train writes its pid when it takes the lock), -1 when
 * there is no lock yet (no job has started there), -2 when the lock is a
 * job's that ended (one may be starting there again), 0 when the lock
 * cannot be read. */
static long live_job(const char *run_dir)
{
    char path[4200], text[32];
    snprintf(path, sizeof path, "%s/lock", run_dir);
    FILE *f = fopen(path, "re");
    if (!f)
        return errno == ENOENT ? -1 : 0;
    size_t n = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    text[n] = '\0';
    long pid = strtol(text, NULL, 10);
    return pid > 0 && (kill((pid_t)pid, 0) == 0 || errno == EPERM) ? pid : -2;
}

/* Has the job that holds RUN_DIR/lock started training? moelua.train
 * writes metrics.jsonl right after it takes the lock, and a recipe listens
 * before it trains: such a job without a socket was started without
 * --attach, and waiting for it is pointless. */
static int job_trains(const char *run_dir)
{
    char path[4200];
    struct stat lock, metrics;
    snprintf(path, sizeof path, "%s/lock", run_dir);
    if (stat(path, &lock) != 0)
        return 0;
    snprintf(path, sizeof path, "%s/metrics.jsonl", run_dir);
    if (stat(path, &metrics) != 0)
        return 0;
    return metrics.st_mtim.tv_sec > lock.st_mtim.tv_sec ||
           (metrics.st_mtim.tv_sec == lock.st_mtim.tv_sec && metrics.st_mtim.tv_nsec >= lock.st_mtim.tv_nsec);
}

/* Connect fd to addr, waiting for a job that is starting, so that
 * `job --attach & moelua attach RUN_DIR` works: up to 5 s for a job to
 * take RUN_DIR's lock, then up to a minute while a live one holds it
 * (it plans and builds before it listens), unless it trains already
 * (job_trains: then -2, errno untouched). */
static int connect_job(int fd, const struct sockaddr_un *addr, const char *run_dir)
{
    int said_start = 0, said_job = 0;
    for (int tries = 0;; tries++) {
        if (connect(fd, (const struct sockaddr *)addr, sizeof *addr) == 0)
            return 0;
        int e = errno;
        long pid = e == ENOENT || e == ECONNREFUSED ? live_job(run_dir) : 0;
        if (pid == 0 || tries >= (pid < 0 ? 50 : 600)) {
            errno = e;
            return -1;
        }
        if (pid > 0 && job_trains(run_dir)) {
            fprintf(stderr, "moelua attach: the job in %s (pid %ld) is training and listens on no socket: "
                    "it was started without --attach\n", run_dir, pid);
            return -2;
        }
        if (pid == -1 && !said_start++)
            fprintf(stderr, "moelua attach: no job in %s yet: waiting up to 5 s for one to start\n", run_dir);
        if (pid == -2 && !said_start++)
            fprintf(stderr, "moelua attach: the last job in %s has ended: waiting up to 5 s for another "
                    "to start\n", run_dir);
        if (pid > 0 && !said_job++)
            fprintf(stderr, "moelua attach: waiting for the job (pid %ld) to open %s\n", pid, addr->sun_path);
        nanosleep(&(struct timespec){0, 100000000}, NULL);
    }
}

int ml_attach_repl(const char *run_dir)
{
    struct sockaddr_un addr;
    memset(&addr, 0, sizeof addr);
    addr.sun_family = AF_UNIX;
    if (!run_dir || !run_dir[0]) {
        fprintf(stderr, "usage: moelua attach RUN_DIR\n");
        return 1;
    }
    int n = snprintf(addr.sun_path, sizeof addr.sun_path, "%s/attach/sock", run_dir);
    if (n < 0 || (size_t)n >= sizeof addr.sun_path) {
        fprintf(stderr, "moelua attach: '%s/attach/sock' is over the %zu-byte limit of a Unix "
                "socket address\n", run_dir, sizeof addr.sun_path - 1);
        return 1;
    }
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    int rc = fd < 0 ? -1 : connect_job(fd, &addr, run_dir);
    if (rc != 0) {
        if (rc == -1)
            fprintf(stderr, "moelua attach: cannot connect to %s: %s (is a job running with --attach?)\n",
                    addr.sun_path, strerror(errno));
        if (fd >= 0)
            close(fd);
        return 1;
    }
    interactive = isatty(0);
    if (interactive) {
        rl_readline_name = "moelua";
        rl_catch_signals = 0;
        rl_persistent_signal_handlers = 1;
        printf("attached to %s (Ctrl-D detaches; the job keeps running)\n", run_dir);
    }
    int status = 0;
    for (;;) {
        char *line = NULL;
        int r = 1;
        if (interactive) {
            r = read_tty_line("attach> ", fd, &line);
            if (r == LINE_INTERRUPTED)
                continue;
            if (r != 1 && r != LINE_PEER)
                break;
            if (r == 1)
                saveline(line);
        } else {
            size_t cap = 0;
            ssize_t len = getline(&line, &cap, stdin);
            if (len < 0) {
                free(line);
                break;
            }
            if (len > 0 && line[len - 1] == '\n')
                line[len - 1] = '\0';
        }
        if (r == LINE_PEER) {
            r = print_reply(fd);   /* unasked: the job refused this client, or ended */
        } else if (line[0] == '\0') {
            free(line);
            continue;
        } else {
            r = send_line(fd, line);
        }
        if (r != 0) {
            if (r < 0)
                fprintf(stderr, "moelua attach: the job closed the connection\n");
            status = 1;
            break;
        }
    }
    if (interactive)
        fputc('\n', stdout);
    fflush(stdout);
    close(fd);
    return status;
}
