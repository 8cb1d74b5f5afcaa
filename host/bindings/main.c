/*
 * host/bindings/main.c - the moelua executable: a Lua 5.4 interpreter (same command
 * line as `lua`) with moelua's libraries preloaded, a memory ledger per
 * device, and a REPL with line editing (host/bindings/repl.c).
 *
 *   moelua [options] [script [args]]
 *     -e stat   run the string `stat`      -l mod   require `mod` into global mod
 *     -i        REPL after the script      -v       print the version
 *     -E        ignore LUA_INIT/LUA_PATH   -W       turn warnings on
 *     -         run stdin                  --       stop handling options
 *     --traceback  tracebacks for user errors too (or MOELUA_TRACEBACK=1)
 *     -h, --help   the usage, the subcommands and the recipes; exit 0
 * LUA_INIT_5_4 (or LUA_INIT) runs first, as in lua.c; no script and no
 * option: a REPL when stdin is a terminal, else stdin is the script.
 *
 *   moelua plot RUN_DIR [OUT_DIR]
 *   moelua plan RECIPE [--max-seq | --fit] [recipe options]
 * Subcommands: when argv[1] is exactly "plot" (or "plan") and the current
 * directory holds no file of that name other than a directory (else it is
 * a script, as in lua.c), the host runs require("moelua.plot").main({RUN_DIR, OUT_DIR})
 * (moelua.plan_cli's for plan; arg[0] = the subcommand); main returning
 * false makes the exit status 1.
 *
 *   moelua attach RUN_DIR
 * The same rule for "attach": a REPL on a running job's socket (a job
 * started with --attach; host/bindings/repl.c ml_attach_repl, host/bindings/attach.c). It
 * needs no Lua state of its own: the code runs inside the job.
 *
 * Errors: a bug's error prints with a traceback. A user error (a
 * moelua.errors table, or any error object with __tostring) and the
 * interrupt errors ("interrupted!", "<fn>: interrupted") print as their
 * message alone, unless --traceback asks for one.
 *
 * Ctrl-C and SIGTERM: while a chunk runs (ml_docall) the handlers of
 * host/bindings/l_host.c are armed: the first signal sets the flag kernels poll and
 * arms a Lua hook, like lua.c; a second one before the first is consumed
 * kills the process, and moelua.host.hold_interrupts holds them while a
 * checkpoint is written. A training job asked to stop finishes or abandons
 * its step and checkpoints (moelua.train). Not here: Ctrl-C at the REPL
 * prompt (host/bindings/repl.c).
 *
 * Shutdown order (STYLE.md): close the Lua state (finalizers return every
 * tensor to the ledger), then check that every ledger is empty, then
 * MPI_Finalize when moelua.dist started MPI. Under mpiexec with 2+ ranks,
 * an error that ends the script ends the job (host/runtime/comm.h,
 * ml_comm_abort), unless every rank raised it together (report).
 */
#include <lauxlib.h>
#include <lua.h>
#include <lualib.h>

#include <dirent.h>
#include <omp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "libs.h"
#include "l_host.h"
#include "l_util.h"
#include "repl.h"
#include "../runtime/comm.h"
#ifdef ML_WITH_CUDA
#include "../runtime/backend_cuda.h"
#endif

#define MOELUA_VERSION "moelua 0.1 (" LUA_RELEASE ")"

static const char *progname = "moelua";

/* The registry field that --traceback (or MOELUA_TRACEBACK) sets: user
 * errors get a traceback too. */
static const char TRACEBACK_KEY[] = "moelua.traceback";

static void l_message(const char *pname, const char *msg)
{
    if (pname)
        fprintf(stderr, "%s: ", pname);
    fprintf(stderr, "%s\n", msg);
    fflush(stderr);
}

static int print_error(lua_State *L, int status)
{
    if (status != LUA_OK) {
        const char *msg = lua_tostring(L, -1);
        l_message(progname, msg ? msg : "(error object is not a string)");
        lua_pop(L, 1);
    }
    return status;
}

/* The registry field msghandler sets for an error every rank raised at
 * the same point (moelua.errors.agreed). */
static const char AGREED_KEY[] = "moelua.agreed_error";

/* An error that ends the run. Under mpiexec with 2+ ranks it ends the job
 * (ml_comm_abort: "rank R: msg", MPI_Abort), so no other rank stays blocked
 * in a collective; otherwise it is printed. An agreed error (every rank
 * raised it together) is printed by rank 0 alone, and the ranks end
 * through MPI_Finalize after the Lua state closes, as after a run. */
static int report(lua_State *L, int status)
{
    if (status != LUA_OK) {
        lua_getfield(L, LUA_REGISTRYINDEX, AGREED_KEY);
        int agreed = lua_toboolean(L, -1);
        lua_pop(L, 1);
        if (agreed && ml_comm_world_rank() > 0) {
            lua_pop(L, 1);
            return status;
        }
        if (!agreed) {
            const char *msg = lua_tostring(L, -1);
            ml_comm_abort(msg ? msg : "(error object is not a string)");
        }
    }
    return print_error(L, status);
}

/* Bugs get a traceback. A user error (an error object with __tostring, as
 * moelua.errors raises) and an interrupt error are the user's doing: their
 * message alone, unless --traceback; an interrupt's without the position
 * it was raised at (Ctrl-C came from the user, not from that line). */
static int msghandler(lua_State *L)
{
    const char *msg = lua_tostring(L, 1);
    int interrupt = msg && ml_is_interrupt_error(L, 1), user = interrupt;
    if (msg == NULL) {
        user = luaL_callmeta(L, 1, "__tostring") && lua_type(L, -1) == LUA_TSTRING;
        msg = user ? lua_tostring(L, -1)
                   : lua_pushfstring(L, "(error object is a %s value)", luaL_typename(L, 1));
    }
    int agreed = 0;   /* moelua.errors.agreed's mark, for report: set anew for every error */
    if (user && lua_istable(L, 1)) {
        agreed = lua_getfield(L, 1, "agreed") != LUA_TNIL && lua_toboolean(L, -1);
        lua_pop(L, 1);
    }
    lua_pushboolean(L, agreed);
    lua_setfield(L, LUA_REGISTRYINDEX, AGREED_KEY);
    lua_getfield(L, LUA_REGISTRYINDEX, TRACEBACK_KEY);
    int always = lua_toboolean(L, -1);
    lua_pop(L, 1);
    if (user && !always) {
        if (interrupt)
            ml_push_interrupt_text(L);
        return 1;
    }
    if (strstr(msg, "\nstack traceback:\n"))
        return 1;   /* it carries the traceback of where it was raised (moelua.train) */
    luaL_traceback(L, L, msg, 1);
    return 1;
}

int ml_docall(lua_State *L, int narg, int nres)
{
    int base = lua_gettop(L) - narg;
    lua_pushcfunction(L, msghandler);
    lua_insert(L, base);
    ml_signals_saved saved;
    ml_signals_arm(L, &saved);
    int status = lua_pcall(L, narg, nres, base);
    ml_signals_restore(L, &saved);
    lua_remove(L, base);
    return status;
}

/* The REPL's errors: printed, the session goes on. */
int ml_report(lua_State *L, int status)
{
    return print_error(L, status);
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

/* `moelua plot ...` / `moelua plan ...`: the module's main with the words
 * after the subcommand. */
static int handle_subcommand(lua_State *L, const char *module)
{
    char code[128];
    int n = snprintf(code, sizeof code, "return require('%s').main(table.move(arg, 1, #arg, 1, {}))",
                     module);
    int status = luaL_loadbuffer(L, code, (size_t)n, "=subcommand");
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
#define has_T     32   /* --traceback */
#define has_h     64   /* -h, --help */

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
            if (strcmp(argv[i], "--traceback") == 0) {
                args |= has_T;
                break;
            }
            if (strcmp(argv[i], "--help") == 0) {
                args |= has_h;
                break;
            }
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
        case 'h':
            if (argv[i][2] != '\0')
                return has_error;
            args |= has_h;
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

static void usage_text(FILE *f)
{
    fprintf(f, "usage: %s [options] [script [args]]\n"
            "       %s plot RUN_DIR [OUT_DIR]\n"
            "       %s plan RECIPE [--max-seq | --fit] [recipe options]\n"
            "       %s attach RUN_DIR\n"
            "Available options are:\n"
            "  -e stat      execute string 'stat'\n"
            "  -i           enter interactive mode after executing 'script'\n"
            "  -l mod       require library 'mod' into global 'mod'\n"
            "  -l g=mod     require library 'mod' into global 'g'\n"
            "  -v           show version information\n"
            "  -E           ignore environment variables\n"
            "  -W           turn warnings on\n"
            "  --traceback  print a traceback for user errors and Ctrl-C too\n"
            "               (also MOELUA_TRACEBACK=1)\n"
            "  -h, --help   show this help: options, subcommands and recipes\n"
            "  --           stop handling options\n"
            "  -            execute stdin and stop handling options\n",
            progname, progname, progname, progname);
}

static void print_usage(const char *badoption)
{
    if (badoption[0] == '-' && (badoption[1] == 'e' || badoption[1] == 'l'))
        fprintf(stderr, "%s: '%s' needs argument\n", progname, badoption);
    else
        fprintf(stderr, "%s: unrecognized option '%s'\n", progname, badoption);
    usage_text(stderr);
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

/* The directory of moelua's Lua library: <dir of the executable>/lua, or
 * MOELUA_LUA_DIR (the GPU bundle). 0 when the executable cannot be found. */
static int lua_dir(char *dir, size_t len)
{
    const char *env = getenv("MOELUA_LUA_DIR");
    if (env) {
        snprintf(dir, len, "%s", env);
        return 1;
    }
    char exe[4096];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n <= 0)
        return 0;
    exe[n] = '\0';
    char *slash = strrchr(exe, '/');
    if (slash)
        *slash = '\0';
    /* the binary lives in the repo root, or in build/<kind>/ */
    snprintf(dir, len, "%s/lua", exe);
    if (access(dir, R_OK) != 0)
        snprintf(dir, len, "%s/../../lua", exe);
    return 1;
}

/* package.path gains the library's directory, so `require "moelua"` works
 * from any directory. */
static void set_lua_path(lua_State *L)
{
    char dir[4200];
    if (!lua_dir(dir, sizeof dir))
        return;
    lua_getglobal(L, "package");
    lua_getfield(L, -1, "path");
    lua_pushfstring(L, "%s/?.lua;%s/?/init.lua;%s", dir, dir, lua_tostring(L, -1));
    lua_setfield(L, -3, "path");
    lua_pop(L, 2);
}

/* ---- --help: the recipes next to the library ---------------------------- */

#define MAX_RECIPES 64
#define HELP_WIDTH  79

/* What a recipe says it is: the first sentence of its header comment
 * ("-- recipes/tiny.lua: longctx at smoke-test size (seconds, not\n--
 * minutes). Options ..."), joined across lines, without the "name:" that
 * starts it. Empty when the file starts with no comment. */
static void recipe_summary(const char *path, const char *name, char *out, size_t len)
{
    out[0] = '\0';
    FILE *f = fopen(path, "r");
    if (!f)
        return;
    char line[512];
    size_t at = 0;
    while (at + 1 < len && fgets(line, sizeof line, f) && strncmp(line, "--", 2) == 0) {
        char *text = line + 2 + strspn(line + 2, " \t");
        text[strcspn(text, "\r\n")] = '\0';
        if (!text[0])
            break;   /* a blank comment line ends the paragraph */
        at += (size_t)snprintf(out + at, len - at, "%s%s", at ? " " : "", text);
        char *stop = strstr(out, ". ");
        if (stop || (at && at < len && out[at - 1] == '.')) {
            if (stop)
                stop[1] = '\0';
            break;
        }
    }
    fclose(f);
    /* drop the "recipes/tiny.lua: " or "tiny.lua: " that names the file */
    size_t word = strcspn(out, " "), nlen = strlen(name);
    if (out[word] == ' ' && word > nlen && out[word - 1] == ':' &&
        strncmp(out + word - 1 - nlen, name, nlen) == 0)
        memmove(out, out + word + 1, strlen(out + word + 1) + 1);
}

/* text, wrapped at HELP_WIDTH, its lines after the first indented by col. */
static void print_wrapped(const char *text, int col)
{
    int at = col;
    while (*text) {
        int word = (int)strcspn(text, " ");
        if (at > col && at + 1 + word > HELP_WIDTH) {
            printf("\n%*s", col, "");
            at = col;
        } else if (at > col) {
            putchar(' ');
            at++;
        }
        printf("%.*s", word, text);
        at += word;
        text += word;
        text += strspn(text, " ");
    }
    putchar('\n');
}

static int compare_names(const void *a, const void *b)
{
    return strcmp((const char *)a, (const char *)b);
}

/* The .lua files of recipes/ next to the library directory, sorted, each
 * with its summary; a line saying so when there is no such directory. */
static void print_recipes(void)
{
    char lib[4200], dir[4300], real[4096];
    DIR *d = NULL;
    if (lua_dir(lib, sizeof lib)) {
        snprintf(dir, sizeof dir, "%s/../recipes", lib);
        if (realpath(dir, real))
            snprintf(dir, sizeof dir, "%s", real);
        d = opendir(dir);
    }
    if (!d) {
        printf("Recipes: none found (no recipes/ directory next to the Lua library)\n");
        return;
    }
    char names[MAX_RECIPES][256];
    int n = 0, width = 0;
    struct dirent *e;
    while ((e = readdir(d)) && n < MAX_RECIPES) {
        size_t l = strlen(e->d_name);
        if (l > 4 && l < sizeof names[0] && strcmp(e->d_name + l - 4, ".lua") == 0) {
            snprintf(names[n++], sizeof names[0], "%s", e->d_name);
            width = (int)l > width ? (int)l : width;
        }
    }
    closedir(d);
    qsort(names, (size_t)n, sizeof names[0], compare_names);
    printf("Recipes (run one as `%s %s/NAME`; with --help it lists its options):\n", progname, dir);
    for (int i = 0; i < n; i++) {
        char path[sizeof dir + sizeof names[0]], summary[512];
        snprintf(path, sizeof path, "%s/%.255s", dir, names[i]);
        recipe_summary(path, names[i], summary, sizeof summary);
        if (!summary[0]) {
            printf("  %s\n", names[i]);
            continue;
        }
        printf("  %-*s  ", width, names[i]);
        print_wrapped(summary, width + 4);
    }
}

static void print_help(void)
{
    usage_text(stdout);
    printf("Subcommands:\n"
           "  plot RUN_DIR [OUT_DIR]  draw RUN_DIR/metrics.jsonl as SVG plots in OUT_DIR\n"
           "                          (default RUN_DIR/plots)\n"
           "  plan RECIPE [options]   the recipe's memory plan: its account book at the peak,\n"
           "                          nothing allocated (--max-seq: the longest --seq-len\n"
           "                          that fits the budget; --fit: the knobs that make it fit)\n"
           "  attach RUN_DIR          a Lua prompt inside the job training in RUN_DIR (one\n"
           "                          started with --attach); Ctrl-D detaches\n");
    print_recipes();
    fflush(stdout);
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
    for (int t = 0; t < ML_NTIERS; t++) {
        if (h->books[t].total == 0)
            continue;
        char buf[2048];
        ml_ledger_format(&h->books[t], 0, 0, buf, sizeof buf);
        fprintf(stderr, "moelua: leak: the %s ledger is not empty after closing Lua\n%s",
                ml_tier_names[t], buf);
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
    h->interrupt = ml_interrupt_flag();
    h->seed = 0x6d6f656c7561ULL;  /* "moelua"; moelua.manual_seed replaces it */
#ifdef ML_WITH_CUDA
    h->mem[ML_CUDA] = h->device_mem[ML_CUDA] = ml_backend_cuda.mem;
    h->kern[ML_CUDA] = ml_backend_cuda.kern;
#endif
    /* Without a budget an impossible allocation is an OOM kill; with one it
     * is a Lua error (DESIGN.md, The memory ledger). */
    h->books[ML_CPU].budget_total = ml_mem_available() / 10 * 9;
}

static int host_close(lua_State *L)
{
    lua_close(L);
    ml_comm_finalize();   /* after Lua freed the communicators; returns what timed-out collectives held */
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
    ml_comm_finalize();   /* (done already when host_close ran) */
    exit(status);
}

/* argv[1] is subcommand `name` unless a file of that name, a script, is
 * here (a directory of that name is not one). */
static int is_subcommand(int argc, char **argv, const char *name)
{
    struct stat st;
    return argc > 1 && strcmp(argv[1], name) == 0 && !(stat(name, &st) == 0 && !S_ISDIR(st.st_mode));
}

static int pmain(lua_State *L)
{
    int argc = (int)lua_tointeger(L, 1);
    char **argv = (char **)lua_touserdata(L, 2);
    int script = 1;
    const char *sub = NULL;   /* a subcommand's module */
    if (is_subcommand(argc, argv, "plot"))
        sub = "moelua.plot";
    else if (is_subcommand(argc, argv, "plan"))
        sub = "moelua.plan_cli";
    int args = sub ? 0 : collectargs(argv, &script);
    int has_script = script > 0 && script < argc;
    luaL_checkversion(L);
    if (args == has_error) {
        print_usage(argv[script]);
        return 0;
    }
    if (args & has_h) {
        print_help();
        lua_pushboolean(L, 1);
        return 1;
    }
    if (args & has_v)
        print_version();
    const char *tb = getenv("MOELUA_TRACEBACK");
    if ((args & has_T) || (tb && tb[0] && strcmp(tb, "0") != 0)) {
        lua_pushboolean(L, 1);
        lua_setfield(L, LUA_REGISTRYINDEX, TRACEBACK_KEY);
    }
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
    if (has_script && (sub ? handle_subcommand(L, sub) : handle_script(L, argv + script)) != LUA_OK)
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

/* `moelua attach RUN_DIR`; -h / --help print the usage on stdout (exit 0),
 * no run directory, an option, or more than one argument, prints it on
 * stderr (exit 1). */
static int attach_main(int argc, char **argv)
{
    static const char usage[] =
        "usage: %s attach RUN_DIR\n"
        "  a Lua prompt inside the job training in RUN_DIR (a job started with --attach;\n"
        "  its socket is RUN_DIR/attach/sock). help() lists what can be called there.\n"
        "  Ctrl-D detaches; the job keeps running.\n";
    const char *dir = argc > 2 ? argv[2] : NULL;
    if (dir && (strcmp(dir, "-h") == 0 || strcmp(dir, "--help") == 0)) {
        printf(usage, progname);
        return EXIT_SUCCESS;
    }
    if (!dir || !dir[0]) {
        fprintf(stderr, usage, progname);
        return EXIT_FAILURE;
    }
    if (dir[0] == '-') {   /* (a directory named so is ./-dir) */
        fprintf(stderr, "%s: attach: unknown option '%s'\n", progname, dir);
        fprintf(stderr, usage, progname);
        return EXIT_FAILURE;
    }
    if (argc > 3) {
        fprintf(stderr, "%s: attach takes one run directory, got also '%s'\n", progname, argv[3]);
        fprintf(stderr, usage, progname);
        return EXIT_FAILURE;
    }
    return ml_attach_repl(dir) == 0 ? EXIT_SUCCESS : EXIT_FAILURE;
}

static void on_sigpipe(int sig)
{
    (void)sig;
}

int main(int argc, char **argv)
{
    if (argc > 0 && argv[0] && argv[0][0])
        progname = argv[0];
    if (is_subcommand(argc, argv, "attach"))
        return attach_main(argc, argv);
    /* A closed pipe (`moelua ... | head`) fails the write (EPIPE) instead of
     * killing the process unsaved: a training job goes on and checkpoints,
     * a script's finalizers remove its scratch files. Caught, not ignored:
     * a handler resets at exec, so children (io.popen) get the default. */
    sigaction(SIGPIPE, &(struct sigaction){.sa_handler = on_sigpipe, .sa_flags = SA_RESTART}, NULL);
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
