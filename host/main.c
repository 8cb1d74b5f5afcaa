/*
 * host/main.c - the moelua executable: a Lua 5.4 interpreter (same command
 * line as `lua`) with moelua's libraries preloaded, a memory ledger per
 * device, and a REPL with line editing (host/repl.c).
 *
 *   moelua [options] [script [args]]
 *     -e stat   run the string `stat`      -l mod   require `mod` into global mod
 *     -i        REPL after the script      -v       print the version
 *     -E        ignore LUA_INIT/LUA_PATH   -W       turn warnings on
 *     -         run stdin                  --       stop handling options
 * LUA_INIT_5_4 (or LUA_INIT) runs first, as in lua.c; no script and no
 * option: a REPL when stdin is a terminal, else stdin is the script.
 *
 *   moelua plot RUN_DIR [OUT_DIR]
 * The one subcommand: when argv[1] is exactly "plot" and no file named
 * "plot" exists in the current directory (else it is a script, as in lua.c),
 * the host runs require("moelua.plot").main({RUN_DIR, OUT_DIR}) (arg[0] =
 * "plot"); main returning false makes the exit status 1.
 *
 *   moelua attach RUN_DIR
 * The same rule for "attach": a REPL on a running job's socket (a job
 * started with --attach; host/repl.c ml_attach_repl, host/attach.c). It
 * needs no Lua state of its own: the code runs inside the job.
 *
 * Ctrl-C: while a chunk runs (ml_docall), SIGINT sets `interrupted` and
 * arms a Lua hook, like lua.c. The flag is consumed exactly once: by a
 * kernel, which stops between tiles and returns ML_EINTERRUPTED so that the
 * binding clears the flag and raises "interrupted" after its parallel region
 * (host/l_util.c), or else by the hook at the next Lua instruction. The
 * handler resets itself to SIG_DFL, so a second Ctrl-C before either kills a
 * stuck process. SIGTERM is handled the same way, so a training job asked
 * to stop finishes or abandons its step and checkpoints (moelua.train).
 * Not here: Ctrl-C at the REPL prompt (host/repl.c).
 *
 * Shutdown order (STYLE.md): close the Lua state (finalizers return every
 * tensor to the ledger), then check that every ledger is empty.
 */
#include <lauxlib.h>
#include <lua.h>
#include <lualib.h>

#include <omp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "libs.h"
#include "l_util.h"
#include "repl.h"
#ifdef ML_WITH_CUDA
#include "backend_cuda.h"
#endif

#define MOELUA_VERSION "moelua 0.1 (" LUA_RELEASE ")"

static const char *progname = "moelua";

/* The Ctrl-C flag: set by the signal handler, polled by kernels between
 * tiles and by the Lua hook below. The only global the host keeps, because a
 * signal handler can reach nothing else. */
static volatile sig_atomic_t interrupted;
static lua_State *global_L;

static void lstop(lua_State *L, lua_Debug *ar)
{
    (void)ar;
    lua_sethook(L, NULL, 0, 0);
    if (!interrupted)
        return;  /* a kernel saw it first and its binding raised already */
    interrupted = 0;
    luaL_error(L, "interrupted!");
}

static void on_sigint(int sig)
{
    int flag = LUA_MASKCALL | LUA_MASKRET | LUA_MASKLINE | LUA_MASKCOUNT;
    signal(sig, SIG_DFL);  /* a second Ctrl-C before the hook runs kills the process */
    interrupted = 1;
    lua_sethook(global_L, lstop, flag, 1);
}

static void l_message(const char *pname, const char *msg)
{
    if (pname)
        fprintf(stderr, "%s: ", pname);
    fprintf(stderr, "%s\n", msg);
    fflush(stderr);
}

static int report(lua_State *L, int status)
{
    if (status != LUA_OK) {
        const char *msg = lua_tostring(L, -1);
        l_message(progname, msg ? msg : "(error object is not a string)");
        lua_pop(L, 1);
    }
    return status;
}

static int msghandler(lua_State *L)
{
    const char *msg = lua_tostring(L, 1);
    if (msg == NULL) {
        if (luaL_callmeta(L, 1, "__tostring") && lua_type(L, -1) == LUA_TSTRING)
            return 1;
        msg = lua_pushfstring(L, "(error object is a %s value)", luaL_typename(L, 1));
    }
    luaL_traceback(L, L, msg, 1);
    return 1;
}

int ml_docall(lua_State *L, int narg, int nres)
{
    int base = lua_gettop(L) - narg;
    lua_pushcfunction(L, msghandler);
    lua_insert(L, base);
    interrupted = 0;
    global_L = L;
    struct sigaction sa, old_int, old_term;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_sigint;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, &old_int);
    sigaction(SIGTERM, &sa, &old_term);
    int status = lua_pcall(L, narg, nres, base);
    sigaction(SIGINT, &old_int, NULL);
    sigaction(SIGTERM, &old_term, NULL);
    lua_sethook(L, NULL, 0, 0);
    interrupted = 0;
    lua_remove(L, base);
    return status;
}

int ml_report(lua_State *L, int status)
{
    return report(L, status);
}

static int dochunk(lua_State *L, int status)
{
    if (status == LUA_OK)
        status = ml_docall(L, 0, 0);
    return report(L, status);
}

static int dostring(lua_State *L, const char *s, const char *name)
{
    return dochunk(L, luaL_loadbuffer(L, s, strlen(s), name));
}

static int dolibrary(lua_State *L, char *globname)
{
    char *mod = strchr(globname, '=');
    if (mod)
        *mod++ = '\0';
    else
        mod = globname;
    lua_getglobal(L, "require");
    lua_pushstring(L, mod);
    int status = ml_docall(L, 1, 1);
    if (status == LUA_OK)
        lua_setglobal(L, globname);
    return report(L, status);
}

static int pushargs(lua_State *L)
{
    if (lua_getglobal(L, "arg") != LUA_TTABLE)
        luaL_error(L, "'arg' is not a table");
    int n = (int)luaL_len(L, -1);
    luaL_checkstack(L, n + 3, "too many arguments to script");
    for (int i = 1; i <= n; i++)
        lua_rawgeti(L, -i, i);
    lua_remove(L, -n - 1);
    return n;
}

/* `moelua plot ...`: moelua.plot.main with the words after "plot". */
static int handle_plot(lua_State *L)
{
    static const char code[] =
        "return require('moelua.plot').main(table.move(arg, 1, #arg, 1, {}))";
    int status = luaL_loadbuffer(L, code, sizeof code - 1, "=plot");
    if (status == LUA_OK)
        status = ml_docall(L, 0, 1);
    if (status != LUA_OK)
        return report(L, status);
    status = lua_toboolean(L, -1) ? LUA_OK : LUA_ERRRUN;
    lua_pop(L, 1);
    return status;
}

static int handle_script(lua_State *L, char **argv)
{
    const char *fname = argv[0];
    if (strcmp(fname, "-") == 0 && strcmp(argv[-1], "--") != 0)
        fname = NULL;  /* stdin */
    int status = luaL_loadfile(L, fname);
    if (status == LUA_OK) {
        int n = pushargs(L);
        status = ml_docall(L, n, LUA_MULTRET);
    }
    return report(L, status);
}

#define has_error 1
#define has_i     2
#define has_v     4
#define has_e     8
#define has_E     16

/* Scan options like lua.c: returns flags; *first = index of the script,
 * argc when there is none, or of the bad option on has_error. */
static int collectargs(char **argv, int *first)
{
    int args = 0, i;
    *first = 0;
    if (argv[0] == NULL)
        return 0;  /* no program name, no arguments */
    for (i = 1; argv[i] != NULL; i++) {
        *first = i;
        if (argv[i][0] != '-')
            return args;
        switch (argv[i][1]) {
        case '-':
            if (argv[i][2] != '\0')
                return has_error;
            *first = i + 1;
            return args;
        case '\0':
            return args;
        case 'E':
            if (argv[i][2] != '\0')
                return has_error;
            args |= has_E;
            break;
        case 'W':
            if (argv[i][2] != '\0')
                return has_error;
            break;
        case 'i':
            if (argv[i][2] != '\0')
                return has_error;
            args |= has_i | has_v;
            break;
        case 'v':
            if (argv[i][2] != '\0')
                return has_error;
            args |= has_v;
            break;
        case 'e':
            args |= has_e;
            /* fallthrough */
        case 'l':
            if (argv[i][2] == '\0') {
                i++;
                if (argv[i] == NULL || argv[i][0] == '-')
                    return has_error;
            }
            break;
        default:
            return has_error;
        }
    }
    *first = i;
    return args;
}

static void print_usage(const char *badoption)
{
    if (badoption[0] == '-' && (badoption[1] == 'e' || badoption[1] == 'l'))
        fprintf(stderr, "%s: '%s' needs argument\n", progname, badoption);
    else
        fprintf(stderr, "%s: unrecognized option '%s'\n", progname, badoption);
    fprintf(stderr, "usage: %s [options] [script [args]]\n"
            "Available options are:\n"
            "  -e stat  execute string 'stat'\n"
            "  -i       enter interactive mode after executing 'script'\n"
            "  -l mod   require library 'mod' into global 'mod'\n"
            "  -l g=mod require library 'mod' into global 'g'\n"
            "  -v       show version information\n"
            "  -E       ignore environment variables\n"
            "  -W       turn warnings on\n"
            "  --       stop handling options\n"
            "  -        execute stdin and stop handling options\n", progname);
    fflush(stderr);
}

static int runargs(lua_State *L, char **argv, int n)
{
    for (int i = 1; i < n; i++) {
        int option = argv[i][1];
        if (option == 'W') {
            lua_warning(L, "@on", 0);
        } else if (option == 'e' || option == 'l') {
            char *extra = argv[i] + 2;
            if (*extra == '\0')
                extra = argv[++i];
            int status = option == 'e' ? dostring(L, extra, "=(command line)") : dolibrary(L, extra);
            if (status != LUA_OK)
                return 0;
        }
    }
    return 1;
}

static void createargtable(lua_State *L, char **argv, int argc, int script)
{
    if (script == argc)
        script = 0;  /* no script: the program name is arg[0] */
    int narg = argc - (script + 1);
    lua_createtable(L, narg > 0 ? narg : 0, script + 1);
    for (int i = 0; i < argc; i++) {
        lua_pushstring(L, argv[i]);
        lua_rawseti(L, -2, i - script);
    }
    lua_setglobal(L, "arg");
}

/* package.path gains <dir of the executable>/lua, so `require "moelua"`
 * works from any directory; MOELUA_LUA_DIR overrides it (the GPU bundle). */
static void set_lua_path(lua_State *L)
{
    char exe[4096], dir[4200];
    const char *env = getenv("MOELUA_LUA_DIR");
    if (env) {
        snprintf(dir, sizeof dir, "%s", env);
    } else {
        ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
        if (n <= 0)
            return;
        exe[n] = '\0';
        char *slash = strrchr(exe, '/');
        if (slash)
            *slash = '\0';
        /* the binary lives in the repo root, or in build/<kind>/ */
        snprintf(dir, sizeof dir, "%s/lua", exe);
        if (access(dir, R_OK) != 0)
            snprintf(dir, sizeof dir, "%s/../../lua", exe);
    }
    lua_getglobal(L, "package");
    lua_getfield(L, -1, "path");
    lua_pushfstring(L, "%s/?.lua;%s/?/init.lua;%s", dir, dir, lua_tostring(L, -1));
    lua_setfield(L, -3, "path");
    lua_pop(L, 2);
}

/* LUA_INIT_5_4 or LUA_INIT: "@file" runs a file, anything else is a chunk. */
static int handle_luainit(lua_State *L)
{
    const char *name = "=LUA_INIT_5_4";
    const char *init = getenv(name + 1);
    if (init == NULL) {
        name = "=LUA_INIT";
        init = getenv(name + 1);
    }
    if (init == NULL)
        return LUA_OK;
    if (init[0] == '@')
        return dochunk(L, luaL_loadfile(L, init + 1));
    return dostring(L, init, name);
}

static void print_version(void)
{
    printf("%s\n", MOELUA_VERSION);
    fflush(stdout);
}

static void preload(lua_State *L)
{
    luaL_getsubtable(L, LUA_REGISTRYINDEX, LUA_PRELOAD_TABLE);
    for (const luaL_Reg *lib = ml_libs; lib->name; lib++) {
        lua_pushcfunction(L, lib->func);
        lua_setfield(L, -2, lib->name);
    }
    lua_pop(L, 1);
}

static int check_ledgers(ml_host *h)
{
    int clean = 1;
    for (int d = 0; d < ML_NDEVICES; d++) {
        if (h->books[d].total == 0)
            continue;
        char buf[2048];
        ml_ledger_format(&h->books[d], 0, 0, buf, sizeof buf);
        fprintf(stderr, "moelua: leak: the %s ledger is not empty after closing Lua\n%s",
                ml_device_names[d], buf);
        clean = 0;
    }
    return clean;
}

/* The host lives here so that os.exit can close Lua and check the ledger. */
static ml_host host;

static void host_init(ml_host *h)
{
    ml_host_init(h);
    h->nthreads = omp_get_max_threads();
    h->interrupt = &interrupted;
    h->seed = 0x6d6f656c7561ULL;  /* "moelua"; moelua.manual_seed replaces it */
#ifdef ML_WITH_CUDA
    h->backend[ML_CUDA] = h->device_backend[ML_CUDA] = &ml_backend_cuda;
#endif
    /* Without a budget an impossible allocation is an OOM kill; with one it
     * is a Lua error (DESIGN.md, The memory ledger). */
    h->books[ML_CPU].budget_total = ml_mem_available() / 10 * 9;
}

static int host_close(lua_State *L)
{
    lua_close(L);
    int clean = check_ledgers(&host);
    ml_host_free(&host);
#ifdef ML_WITH_CUDA
    ml_cuda_shutdown();   /* last: the ledger check needed the device's bytes returned */
#endif
    return clean;
}

/* os.exit(code, close): with close, finalizers run and the ledger is checked. */
static int os_exit(lua_State *L)
{
    int status;
    if (lua_isboolean(L, 1))
        status = lua_toboolean(L, 1) ? EXIT_SUCCESS : EXIT_FAILURE;
    else
        status = (int)luaL_optinteger(L, 1, EXIT_SUCCESS);
    if (lua_toboolean(L, 2) && !host_close(L) && status == EXIT_SUCCESS)
        status = EXIT_FAILURE;
    exit(status);
}

static int pmain(lua_State *L)
{
    int argc = (int)lua_tointeger(L, 1);
    char **argv = (char **)lua_touserdata(L, 2);
    int script = 1;
    int plot = argc > 1 && strcmp(argv[1], "plot") == 0 && access("plot", F_OK) != 0;
    int args = plot ? 0 : collectargs(argv, &script);
    int has_script = script > 0 && script < argc;
    luaL_checkversion(L);
    if (args == has_error) {
        print_usage(argv[script]);
        return 0;
    }
    if (args & has_v)
        print_version();
    if (args & has_E) {  /* the standard libraries then ignore LUA_PATH, LUA_CPATH */
        lua_pushboolean(L, 1);
        lua_setfield(L, LUA_REGISTRYINDEX, "LUA_NOENV");
    }
    luaL_openlibs(L);
    lua_getglobal(L, "os");
    lua_pushcfunction(L, os_exit);
    lua_setfield(L, -2, "exit");
    lua_pop(L, 1);
    set_lua_path(L);
    preload(L);
    createargtable(L, argv, argc, has_script ? script : argc);
    if (!(args & has_E) && handle_luainit(L) != LUA_OK)
        return 0;
    if (!runargs(L, argv, has_script ? script : argc))
        return 0;
    if (has_script && (plot ? handle_plot(L) : handle_script(L, argv + script)) != LUA_OK)
        return 0;
    if (args & has_i) {
        ml_repl(L);
    } else if (!has_script && !(args & (has_e | has_v))) {
        if (isatty(0)) {
            print_version();
            ml_repl(L);
        } else {
            if (dochunk(L, luaL_loadfile(L, NULL)) != LUA_OK)
                return 0;
        }
    }
    lua_pushboolean(L, 1);
    return 1;
}

int main(int argc, char **argv)
{
    if (argc > 0 && argv[0] && argv[0][0])
        progname = argv[0];
    if (argc > 1 && strcmp(argv[1], "attach") == 0 && access("attach", F_OK) != 0)
        return ml_attach_repl(argc > 2 ? argv[2] : NULL) == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
    host_init(&host);
    lua_State *L = luaL_newstate();
    if (!L) {
        l_message(progname, "cannot create state: not enough memory");
        return EXIT_FAILURE;
    }
    ml_host_register(L, &host);
    lua_pushcfunction(L, pmain);
    lua_pushinteger(L, argc);
    lua_pushlightuserdata(L, argv);
    int status = lua_pcall(L, 2, 1, 0);
    int result = lua_toboolean(L, -1);
    report(L, status);
    int clean = host_close(L);
    return (result && status == LUA_OK && clean) ? EXIT_SUCCESS : EXIT_FAILURE;
}
