/*
 * host/bindings/l_fs.c - the Lua library `moelua.fs`: the file-system calls that
 * lua/moelua/data.lua and lua/moelua/ckpt.lua need and Lua's io/os lack.
 *
 *   fs.read(path, offset, count, format [, out [, at]]) -> out (i64 [count])
 *       tokens offset .. offset+count-1 of a file (format "bytes"/"u8",
 *       "u16", "u32": little-endian) into an int64 tensor, read with pread in
 *       fixed 64 KiB chunks; `out` (contiguous cpu i64) receives them at the
 *       1-based position `at` (default 1), else a new tensor [count]
 *   fs.stat(path) -> {type = "file"|"dir"|"other", size =, mtime = ns, link = bool}
 *       (type, size and mtime of the link's target) or nil, message
 *   fs.fsync(path)            fsync a file or a directory
 *   fs.mkdir_p(path)          mkdir -p (mode 0777 before the umask)
 *   fs.rename(from, to)       rename(2)
 *   fs.exchange(a, b)         swap two paths at once (renameat2 RENAME_EXCHANGE)
 *                             -> true, or nil and why where the file system cannot
 *   fs.listdir(path)          -> sorted names, without "." and ".."
 *   fs.remove_tree(path)      rm -rf without following links; -> false if absent
 *   fs.free_bytes(path)       bytes available to this user (statvfs)
 *   fs.sha256(path)           hex digest of a file (OpenSSL EVP, streamed)
 *   fs.sha256_string(s)       hex digest of a string
 *   fs.glob(pattern)          -> sorted matches of glob(3) (none: {})
 *   fs.lock(path)             -> lock, or nil and the holder's pid (0: unknown),
 *                                or false and why where the file system has no flock
 *       an exclusive flock(2) on path (created 0644), not waited for; the
 *       holder writes its pid there. Held until lock:release(), its
 *       collection or the process's end (the kernel drops it then, so a
 *       killed job leaves no stale lock); the file stays.
 *
 * Every argument is checked; errors name the function ("moelua.fs.read: ...")
 * and the path with strerror. Nothing here keeps a file open across calls
 * but a lock.
 *
 * Not here: checkpoint or corpus logic (Lua), safetensors (host/bindings/l_io.c),
 * recursive "**" globbing (glob(3) has none: lua/moelua/data.lua walks).
 */
#include "l_util.h"
#include "libs.h"

#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <glob.h>
#include <dirent.h>
#include <openssl/evp.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#define FS_CHUNK 65536   /* bytes per pread */

/* The string at idx, which must not contain NUL (C paths cannot). */
static const char *check_path(lua_State *L, int idx, const char *fn, const char *what)
{
    size_t len;
    if (lua_type(L, idx) != LUA_TSTRING)
        ml_error(L, fn, "argument #%d (%s): expected a string, got %s", idx, what,
                 luaL_typename(L, idx));
    const char *s = lua_tolstring(L, idx, &len);
    if (len == 0)
        ml_error(L, fn, "argument #%d (%s): empty path", idx, what);
    if (strlen(s) != len)
        ml_error(L, fn, "argument #%d (%s): contains a NUL byte", idx, what);
    return s;
}

static int64_t check_int(lua_State *L, int idx, const char *fn, const char *what, int64_t lo)
{
    if (!lua_isinteger(L, idx))
        ml_error(L, fn, "argument #%d (%s): expected an integer, got %s", idx, what,
                 lua_type(L, idx) == LUA_TNUMBER ? "a float" : luaL_typename(L, idx));
    lua_Integer v = lua_tointeger(L, idx);
    if (v < lo)
        ml_error(L, fn, "argument #%d (%s): must be >= %lld, got %lld", idx, what, (long long)lo,
                 (long long)v);
    return v;
}

/* A file descriptor closed by the to-be-closed userdata at the stack top. */
typedef struct { int fd; } fs_fd;
#define FD_MT "moelua.fs.Fd"

static int l_fs_fd_close(lua_State *L)
{
    fs_fd *f = luaL_testudata(L, 1, FD_MT);
    if (f && f->fd >= 0) {
        close(f->fd);
        f->fd = -1;
    }
    return 0;
}

/* Push a closable fd holder (fd -1) and mark it to-be-closed. */
static fs_fd *push_fd(lua_State *L)
{
    fs_fd *f = lua_newuserdatauv(L, sizeof *f, 0);
    f->fd = -1;
    luaL_setmetatable(L, FD_MT);
    lua_toclose(L, -1);
    return f;
}

/* Little-endian tokens of width w in buf[0 .. n*w) -> dst[0 .. n). */
static void widen(int64_t *dst, const unsigned char *buf, size_t n, int w)
{
    if (w == 1) {
        for (size_t i = 0; i < n; i++) dst[i] = buf[i];
    } else if (w == 2) {
        for (size_t i = 0; i < n; i++) dst[i] = (int64_t)buf[2 * i] | (int64_t)buf[2 * i + 1] << 8;
    } else {
        for (size_t i = 0; i < n; i++)
            dst[i] = (int64_t)buf[4 * i] | (int64_t)buf[4 * i + 1] << 8 |
                     (int64_t)buf[4 * i + 2] << 16 | (int64_t)buf[4 * i + 3] << 24;
    }
}

/* fs.read(path, offset, count, format [, out [, at]]) */
static int l_fs_read(lua_State *L)
{
    static const char fn[] = "moelua.fs.read";
    ml_args(L, 6, fn);
    const char *path = check_path(L, 1, fn, "path");
    int64_t offset = check_int(L, 2, fn, "offset", 0);
    int64_t count = check_int(L, 3, fn, "count", 0);
    const char *fmt = luaL_optstring(L, 4, "bytes");
    int w;
    if (!strcmp(fmt, "bytes") || !strcmp(fmt, "u8")) w = 1;
    else if (!strcmp(fmt, "u16")) w = 2;
    else if (!strcmp(fmt, "u32")) w = 4;
    else ml_error(L, fn, "argument #4 (format): expected \"bytes\", \"u8\", \"u16\" or \"u32\", got '%s'", fmt);
    if (offset > INT64_MAX / 4 || count > INT64_MAX / 4 - offset)
        ml_error(L, fn, "offset %lld + count %lld is out of range", (long long)offset, (long long)count);
    lua_settop(L, 6);

    ml_tensor *out;
    int64_t at = 1;
    if (lua_isnil(L, 5)) {
        int64_t shape[1] = {count};
        out = ml_newtensor(L, fn, ML_CPU, ML_I64, 1, shape);
        lua_replace(L, 5);
    } else {
        out = ml_checkcontig(L, 5, fn, ML_I64);
        if (out->st->device != ML_CPU)
            ml_error(L, fn, "argument #5 (out): must be a cpu tensor, got %s",
                     ml_device_names[out->st->device]);
        if (!lua_isnil(L, 6))
            at = check_int(L, 6, fn, "at", 1);
        if (at - 1 > ml_numel(out) || count > ml_numel(out) - (at - 1))
            ml_error(L, fn, "argument #5 (out): %lld tokens at position %lld do not fit a tensor of %lld",
                     (long long)count, (long long)at, (long long)ml_numel(out));
    }

    fs_fd *f = push_fd(L);
    f->fd = open(path, O_RDONLY | O_CLOEXEC);
    if (f->fd < 0)
        ml_env_error(L, "%s: cannot open '%s': %s", fn, path, strerror(errno));
    struct stat sb;
    if (fstat(f->fd, &sb) != 0)
        ml_env_error(L, "%s: cannot stat '%s': %s", fn, path, strerror(errno));
    if (!S_ISREG(sb.st_mode))
        ml_env_error(L, "%s: '%s' is not a regular file", fn, path);
    if ((offset + count) * w > (int64_t)sb.st_size)
        ml_env_error(L, "%s: tokens [%lld, %lld) of %d byte(s) read past the end of '%s' (%lld bytes)", fn,
                 (long long)offset, (long long)(offset + count), w, path, (long long)sb.st_size);

    int64_t *dst = (int64_t *)ml_data(out) + (at - 1);
    unsigned char buf[FS_CHUNK];
    int64_t done = 0;
    while (done < count) {
        size_t n = (size_t)(count - done) < (size_t)(FS_CHUNK / w) ? (size_t)(count - done) : (size_t)(FS_CHUNK / w);
        size_t got = 0;
        while (got < n * w) {
            ssize_t r = pread(f->fd, buf + got, n * w - got, (off_t)((offset + done) * w) + (off_t)got);
            if (r < 0 && errno == EINTR) continue;
            if (r < 0)
                ml_env_error(L, "%s: reading '%s': %s", fn, path, strerror(errno));
            if (r == 0)
                ml_env_error(L, "%s: reading '%s': the file shrank while reading", fn, path);
            got += (size_t)r;
        }
        widen(dst + done, buf, n, w);
        done += (int64_t)n;
    }
    lua_pushvalue(L, 5);
    return 1;
}

/* fs.stat(path) -> table or nil, message */
static int l_fs_stat(lua_State *L)
{
    ml_args(L, 1, "moelua.fs.stat");
    const char *path = check_path(L, 1, "moelua.fs.stat", "path");
    struct stat sb;   /* lstat first: one call for all but links (a corpus walk stats every entry) */
    int rc = lstat(path, &sb);
    int link = rc == 0 && S_ISLNK(sb.st_mode);
    if (link)
        rc = stat(path, &sb);
    if (rc != 0) {
        lua_pushnil(L);
        lua_pushfstring(L, "moelua.fs.stat: '%s': %s", path, strerror(errno));
        return 2;
    }
    lua_createtable(L, 0, 4);
    lua_pushstring(L, S_ISREG(sb.st_mode) ? "file" : S_ISDIR(sb.st_mode) ? "dir" : "other");
    lua_setfield(L, -2, "type");
    lua_pushboolean(L, link);
    lua_setfield(L, -2, "link");
    lua_pushinteger(L, (lua_Integer)sb.st_size);
    lua_setfield(L, -2, "size");
    lua_pushinteger(L, (lua_Integer)sb.st_mtim.tv_sec * 1000000000 + sb.st_mtim.tv_nsec);
    lua_setfield(L, -2, "mtime");
    return 1;
}

/* fs.fsync(path): a file or a directory */
static int l_fs_fsync(lua_State *L)
{
    static const char fn[] = "moelua.fs.fsync";
    ml_args(L, 1, fn);
    const char *path = check_path(L, 1, fn, "path");
    fs_fd *f = push_fd(L);
    f->fd = open(path, O_RDONLY | O_CLOEXEC);
    if (f->fd < 0)
        ml_env_error(L, "%s: cannot open '%s': %s", fn, path, strerror(errno));
    if (fsync(f->fd) != 0)
        ml_env_error(L, "%s: fsync '%s': %s", fn, path, strerror(errno));
    return 0;
}

/* fs.mkdir_p(path) */
static int l_fs_mkdir_p(lua_State *L)
{
    static const char fn[] = "moelua.fs.mkdir_p";
    ml_args(L, 1, fn);
    const char *path = check_path(L, 1, fn, "path");
    size_t len = strlen(path);
    char *p = lua_newuserdatauv(L, len + 1, 0);
    memcpy(p, path, len + 1);
    for (size_t i = 1; i <= len; i++) {
        if (p[i] != '/' && p[i] != '\0')
            continue;
        char c = p[i];
        p[i] = '\0';
        if (mkdir(p, 0777) != 0 && errno != EEXIST)
            ml_env_error(L, "%s: cannot create '%s': %s", fn, p, strerror(errno));
        p[i] = c;
    }
    struct stat sb;
    if (stat(path, &sb) != 0 || !S_ISDIR(sb.st_mode))
        ml_env_error(L, "%s: '%s' exists and is not a directory", fn, path);
    return 0;
}

/* fs.rename(from, to) */
static int l_fs_rename(lua_State *L)
{
    static const char fn[] = "moelua.fs.rename";
    ml_args(L, 2, fn);
    const char *from = check_path(L, 1, fn, "from");
    const char *to = check_path(L, 2, fn, "to");
    if (rename(from, to) != 0)
        ml_env_error(L, "%s: '%s' -> '%s': %s", fn, from, to, strerror(errno));
    return 0;
}

/* fs.exchange(a, b): both exist; renameat2's RENAME_EXCHANGE swaps them
 * in one step. true, or nil and why when this file system cannot. */
static int l_fs_exchange(lua_State *L)
{
    static const char fn[] = "moelua.fs.exchange";
    ml_args(L, 2, fn);
    const char *a = check_path(L, 1, fn, "a");
    const char *b = check_path(L, 2, fn, "b");
    if (renameat2(AT_FDCWD, a, AT_FDCWD, b, RENAME_EXCHANGE) == 0) {
        lua_pushboolean(L, 1);
        return 1;
    }
    int e = errno;
    if (e != EINVAL && e != ENOSYS && e != EOPNOTSUPP)
        ml_env_error(L, "%s: '%s' <-> '%s': %s", fn, a, b, strerror(e));
    lua_pushnil(L);
    lua_pushstring(L, strerror(e));
    return 2;
}

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* Sort the array of strings at idx (n entries) by byte order. */
static void sort_names(lua_State *L, int idx, lua_Integer n)
{
    const char **v = lua_newuserdatauv(L, (size_t)(n ? n : 1) * sizeof *v, 0);
    for (lua_Integer i = 0; i < n; i++) {
        lua_rawgeti(L, idx, i + 1);
        v[i] = lua_tostring(L, -1);   /* anchored by the table until we rewrite it */
        lua_pop(L, 1);
    }
    qsort(v, (size_t)n, sizeof *v, cmp_str);
    lua_createtable(L, (int)n, 0);
    for (lua_Integer i = 0; i < n; i++) {
        lua_pushstring(L, v[i]);
        lua_rawseti(L, -2, i + 1);
    }
    lua_replace(L, idx);
    lua_pop(L, 1);
}

typedef struct { DIR *d; } fs_dir;
#define DIR_MT "moelua.fs.Dir"

static int l_fs_dir_close(lua_State *L)
{
    fs_dir *d = luaL_testudata(L, 1, DIR_MT);
    if (d && d->d) {
        closedir(d->d);
        d->d = NULL;
    }
    return 0;
}

/* fs.listdir(path) -> sorted names */
static int l_fs_listdir(lua_State *L)
{
    static const char fn[] = "moelua.fs.listdir";
    ml_args(L, 1, fn);
    const char *path = check_path(L, 1, fn, "path");
    lua_settop(L, 1);
    fs_dir *d = lua_newuserdatauv(L, sizeof *d, 0);   /* slot 2 */
    d->d = NULL;
    luaL_setmetatable(L, DIR_MT);
    lua_toclose(L, 2);
    d->d = opendir(path);
    if (!d->d)
        ml_env_error(L, "%s: cannot open directory '%s': %s", fn, path, strerror(errno));
    lua_newtable(L);                                   /* slot 3 */
    lua_Integer n = 0;
    struct dirent *e;
    errno = 0;
    while ((e = readdir(d->d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
            continue;
        lua_pushstring(L, e->d_name);
        lua_rawseti(L, 3, ++n);
        errno = 0;
    }
    if (errno)
        ml_env_error(L, "%s: reading directory '%s': %s", fn, path, strerror(errno));
    sort_names(L, 3, n);
    return 1;
}

static int rm_entry(const char *p, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb; (void)ftw;
    return (flag == FTW_DP ? rmdir(p) : unlink(p)) ? errno : 0;
}

/* fs.remove_tree(path) -> true, or false when it did not exist */
static int l_fs_remove_tree(lua_State *L)
{
    static const char fn[] = "moelua.fs.remove_tree";
    ml_args(L, 1, fn);
    const char *path = check_path(L, 1, fn, "path");
    if (!strcmp(path, "/") || !strcmp(path, ".") || !strcmp(path, ".."))
        ml_error(L, fn, "refusing to remove '%s'", path);
    struct stat sb;
    if (lstat(path, &sb) != 0) {
        if (errno == ENOENT) {
            lua_pushboolean(L, 0);
            return 1;
        }
        ml_env_error(L, "%s: '%s': %s", fn, path, strerror(errno));
    }
    int rc = S_ISDIR(sb.st_mode) ? nftw(path, rm_entry, 16, FTW_DEPTH | FTW_PHYS)
                                 : (unlink(path) ? errno : 0);
    if (rc != 0)
        ml_env_error(L, "%s: removing '%s': %s", fn, path, strerror(rc > 0 ? rc : errno));
    lua_pushboolean(L, 1);
    return 1;
}

/* fs.free_bytes(path) */
static int l_fs_free_bytes(lua_State *L)
{
    static const char fn[] = "moelua.fs.free_bytes";
    ml_args(L, 1, fn);
    const char *path = check_path(L, 1, fn, "path");
    struct statvfs sv;
    if (statvfs(path, &sv) != 0)
        ml_env_error(L, "%s: '%s': %s", fn, path, strerror(errno));
    unsigned long long b = (unsigned long long)sv.f_bavail * sv.f_frsize;
    lua_pushinteger(L, b > (unsigned long long)LUA_MAXINTEGER ? LUA_MAXINTEGER : (lua_Integer)b);
    return 1;
}

/* The digest state, freed by __close/__gc. */
typedef struct { EVP_MD_CTX *ctx; int fd; } fs_hash;
#define HASH_MT "moelua.fs.Hash"

static int l_fs_hash_close(lua_State *L)
{
    fs_hash *h = luaL_testudata(L, 1, HASH_MT);
    if (h) {
        if (h->ctx) EVP_MD_CTX_free(h->ctx);
        h->ctx = NULL;
        if (h->fd >= 0) close(h->fd);
        h->fd = -1;
    }
    return 0;
}

static fs_hash *push_hash(lua_State *L, const char *fn)
{
    fs_hash *h = lua_newuserdatauv(L, sizeof *h, 0);
    h->ctx = NULL;
    h->fd = -1;
    luaL_setmetatable(L, HASH_MT);
    lua_toclose(L, -1);
    h->ctx = EVP_MD_CTX_new();
    if (!h->ctx || EVP_DigestInit_ex(h->ctx, EVP_sha256(), NULL) != 1)
        ml_error(L, fn, "cannot initialise SHA-256 (OpenSSL)");
    return h;
}

static void push_digest(lua_State *L, fs_hash *h, const char *fn)
{
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned int n = 0;
    if (EVP_DigestFinal_ex(h->ctx, md, &n) != 1)
        ml_error(L, fn, "SHA-256 failed (OpenSSL)");
    char hex[2 * EVP_MAX_MD_SIZE + 1];
    for (unsigned int i = 0; i < n; i++)
        snprintf(hex + 2 * i, 3, "%02x", md[i]);
    lua_pushlstring(L, hex, 2 * n);
}

/* fs.sha256(path) -> hex */
static int l_fs_sha256(lua_State *L)
{
    static const char fn[] = "moelua.fs.sha256";
    ml_args(L, 1, fn);
    const char *path = check_path(L, 1, fn, "path");
    lua_settop(L, 1);
    fs_hash *h = push_hash(L, fn);
    h->fd = open(path, O_RDONLY | O_CLOEXEC);
    if (h->fd < 0)
        ml_env_error(L, "%s: cannot open '%s': %s", fn, path, strerror(errno));
    unsigned char buf[FS_CHUNK];
    for (;;) {
        ssize_t r = read(h->fd, buf, sizeof buf);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0)
            ml_env_error(L, "%s: reading '%s': %s", fn, path, strerror(errno));
        if (r == 0) break;
        if (EVP_DigestUpdate(h->ctx, buf, (size_t)r) != 1)
            ml_error(L, fn, "SHA-256 failed (OpenSSL)");
    }
    push_digest(L, h, fn);
    return 1;
}

/* fs.sha256_string(s) -> hex */
static int l_fs_sha256_string(lua_State *L)
{
    static const char fn[] = "moelua.fs.sha256_string";
    ml_args(L, 1, fn);
    if (lua_type(L, 1) != LUA_TSTRING)
        ml_error(L, fn, "argument #1: expected a string, got %s", luaL_typename(L, 1));
    size_t len;
    const char *s = lua_tolstring(L, 1, &len);
    lua_settop(L, 1);
    fs_hash *h = push_hash(L, fn);
    if (EVP_DigestUpdate(h->ctx, s, len) != 1)
        ml_error(L, fn, "SHA-256 failed (OpenSSL)");
    push_digest(L, h, fn);
    return 1;
}

typedef struct { glob_t g; int used; } fs_glob;
#define GLOB_MT "moelua.fs.Glob"

static int l_fs_glob_close(lua_State *L)
{
    fs_glob *g = luaL_testudata(L, 1, GLOB_MT);
    if (g && g->used) {
        globfree(&g->g);
        g->used = 0;
    }
    return 0;
}

/* fs.glob(pattern) -> sorted paths */
static int l_fs_glob(lua_State *L)
{
    static const char fn[] = "moelua.fs.glob";
    ml_args(L, 1, fn);
    const char *pat = check_path(L, 1, fn, "pattern");
    lua_settop(L, 1);
    fs_glob *g = lua_newuserdatauv(L, sizeof *g, 0);   /* slot 2 */
    memset(g, 0, sizeof *g);
    luaL_setmetatable(L, GLOB_MT);
    lua_toclose(L, 2);
    int rc = glob(pat, GLOB_ERR | GLOB_BRACE | GLOB_TILDE, NULL, &g->g);
    g->used = 1;
    if (rc == GLOB_NOSPACE)
        ml_error(L, fn, "'%s': out of memory", pat);
    if (rc == GLOB_ABORTED)
        ml_env_error(L, "%s: '%s': a directory could not be read", fn, pat);
    lua_createtable(L, rc == 0 ? (int)g->g.gl_pathc : 0, 0);
    if (rc == 0)
        for (size_t i = 0; i < g->g.gl_pathc; i++) {   /* glob(3) sorts them */
            lua_pushstring(L, g->g.gl_pathv[i]);
            lua_rawseti(L, -2, (lua_Integer)i + 1);
        }
    return 1;
}

/* fs.isatty(fd): is the descriptor a terminal? (progress bars vs plain lines) */
static int l_fs_isatty(lua_State *L)
{
    ml_args(L, 1, "moelua.fs.isatty");
    lua_Integer fd = ml_checkinteger_named(L, 1, "moelua.fs.isatty", "argument #1 (fd)");
    if (fd < 0 || fd > 1024)
        ml_error(L, "moelua.fs.isatty", "argument #1: descriptor %lld out of range", (long long)fd);
    lua_pushboolean(L, isatty((int)fd));
    return 1;
}

#define LOCK_MT "moelua.fs.Lock"

/* __gc and __close (and lock:release()): closing the descriptor drops the flock */
static int l_fs_lock_gc(lua_State *L)
{
    fs_fd *f = luaL_checkudata(L, 1, LOCK_MT);
    if (f->fd >= 0) {
        close(f->fd);
        f->fd = -1;
    }
    return 0;
}

static int l_fs_lock_release(lua_State *L)
{
    ml_args(L, 1, "moelua.fs.Lock:release");
    return l_fs_lock_gc(L);
}

/* fs.lock(path) */
static int l_fs_lock(lua_State *L)
{
    ml_args(L, 1, "moelua.fs.lock");
    const char *path = check_path(L, 1, "moelua.fs.lock", "path");
    fs_fd *f = lua_newuserdatauv(L, sizeof *f, 0);
    f->fd = -1;
    luaL_setmetatable(L, LOCK_MT);
    f->fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (f->fd < 0)
        ml_env_error(L, "moelua.fs.lock: '%s': %s", path, strerror(errno));
    char pid[32];
    if (flock(f->fd, LOCK_EX | LOCK_NB) != 0) {
        int e = errno;
        ssize_t n = e == EWOULDBLOCK ? pread(f->fd, pid, sizeof pid - 1, 0) : -1;
        close(f->fd);
        f->fd = -1;
        if (e == ENOSYS || e == ENOLCK || e == EOPNOTSUPP) {   /* a file system without flock */
            lua_pushboolean(L, 0);
            lua_pushstring(L, strerror(e));
            return 2;
        }
        if (e != EWOULDBLOCK)
            ml_env_error(L, "moelua.fs.lock: '%s': %s", path, strerror(e));
        pid[n > 0 ? n : 0] = '\0';
        lua_pushnil(L);
        lua_pushinteger(L, strtoll(pid, NULL, 10));
        return 2;
    }
    int n = snprintf(pid, sizeof pid, "%ld\n", (long)getpid());
    errno = 0;
    if (ftruncate(f->fd, 0) != 0 || pwrite(f->fd, pid, (size_t)n, 0) != n) {
        int e = errno ? errno : EIO;   /* a short write sets none */
        close(f->fd);                  /* released before raising */
        f->fd = -1;
        ml_env_error(L, "moelua.fs.lock: '%s': writing the pid: %s", path, strerror(e));
    }
    return 1;
}

static const luaL_Reg fs_functions[] = {
    {"isatty", l_fs_isatty},
    {"read", l_fs_read},
    {"stat", l_fs_stat},
    {"fsync", l_fs_fsync},
    {"mkdir_p", l_fs_mkdir_p},
    {"rename", l_fs_rename},
    {"exchange", l_fs_exchange},
    {"listdir", l_fs_listdir},
    {"remove_tree", l_fs_remove_tree},
    {"free_bytes", l_fs_free_bytes},
    {"sha256", l_fs_sha256},
    {"sha256_string", l_fs_sha256_string},
    {"glob", l_fs_glob},
    {"lock", l_fs_lock},
    {NULL, NULL}
};

int luaopen_moelua_fs(lua_State *L)
{
    static const struct { const char *name; lua_CFunction close; } mts[] = {
        {FD_MT, l_fs_fd_close}, {DIR_MT, l_fs_dir_close},
        {HASH_MT, l_fs_hash_close}, {GLOB_MT, l_fs_glob_close},
        {LOCK_MT, l_fs_lock_gc},
    };
    ml_host_of(L);  /* refuse to load outside the host */
    /* fs.read makes tensors: their metatable must exist before the first */
    luaL_requiref(L, "moelua.tensor", luaopen_moelua_tensor, 0);
    lua_pop(L, 1);
    for (size_t i = 0; i < sizeof mts / sizeof mts[0]; i++) {
        luaL_newmetatable(L, mts[i].name);
        lua_pushcfunction(L, mts[i].close);
        lua_setfield(L, -2, "__gc");
        lua_pushcfunction(L, mts[i].close);
        lua_setfield(L, -2, "__close");
        lua_pop(L, 1);
    }
    luaL_getmetatable(L, LOCK_MT);
    lua_createtable(L, 0, 1);
    lua_pushcfunction(L, l_fs_lock_release);
    lua_setfield(L, -2, "release");
    lua_setfield(L, -2, "__index");
    lua_pop(L, 1);
    luaL_newlib(L, fs_functions);
    return 1;
}
